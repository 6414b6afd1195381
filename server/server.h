/*
 * The daemon's state: its loop, listener, connections and sessions, and
 * the counters stats (and later metrics) report. One per process; every
 * field is touched on the loop thread only.
 */
#ifndef ZIPCACHE_SERVER_H
#define ZIPCACHE_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "adopt.h"
#include "metrics.h"
#include "options.h"
#include "quota.h"
#include "session.h"
#include "pool.h"

struct connection;

struct server_counters {
	uint64_t connections_accepted;
	uint64_t requests;
	uint64_t request_errors;
	uint64_t tokens_appended;
};

struct server {
	uv_loop_t *loop;
	struct options options;
	uint64_t boot_epoch;
	uint64_t started_ms;   /* uv_now() at start */
	int listen_fd;
	uv_poll_t listener;
	bool listening;
	/* A descriptor kept spare so that at the descriptor limit a waiting
	 * connection can still be accepted and told why (see on_accept). */
	int spare_fd;
	uv_timer_t accept_timer;   /* polls the listener again after a pause */
	uint64_t descriptor_limit; /* soft RLIMIT_NOFILE after start */
	uv_signal_t sigterm, sigint;
	uv_timer_t ttl_timer;
	uv_timer_t stop_timer;
	int lock_fd;
	int shm_dir_fd;            /* --shm-dir, opened once: every file in it is opened relative to it */
	struct session_table sessions;
	struct adoption adoption;
	struct store_budget budget;
	struct store_budget staging;   /* staging bytes of all connections: counted, no limit */
	struct quota_table quotas;
	struct pool_set pools;         /* one block pool per uid */
	uint64_t reply_queue_bytes;    /* unsent reply bytes of all connections */
	bool replies_over;             /* past --max-reply-queue-total (connection.c) */
	struct connection *connections;
	uint32_t n_connections;
	bool stopping;
	uint64_t stop_deadline_ms;
	struct server_counters counters;
	struct metrics metrics;
	struct http_endpoint *http;
};

/* Binds the socket, adopts (or clears) old sessions, starts serving on loop. */
int server_start(struct server *server, uv_loop_t *loop, const struct options *options);

/* Graceful stop: no new connections or requests; in-flight work finishes,
 * replies are flushed, then the loop ends. Idempotent. */
void server_stop(struct server *server);

/* While stopping: ends the loop once no connection or job is left. */
void server_stop_progress(struct server *server);

/* Frees what server_start made; call after the loop has returned. */
void server_free(struct server *server);

/* Shared memory in use by all sessions, bytes. */
uint64_t server_memory_bytes(const struct server *server);

/* Under memory pressure: drops the fp16 views of idle sessions, least
 * recently used first (never `keep`'s), until `wanted` bytes came back
 * or no candidate is left. Returns the bytes freed. When `keep`'s owner's
 * own quota is what is short, only that uid's sessions are candidates:
 * other users' views would not make room for it. */
uint64_t server_relieve_memory(struct server *server, uint64_t wanted, const struct session *keep);

/* The same for a charge of `uid`'s with no session to keep (an open, a
 * staging buffer). */
uint64_t server_relieve_memory_for(struct server *server, uint64_t wanted,
				   const struct session *keep, uint32_t uid);

/* Why a memory charge of `uid`'s was refused, as a sentence into text:
 * the uid's quota or the daemon's budget, whichever has less room, with
 * its size and use (the word "budget" or "quota" and the flag). */
const char *server_budget_refusal(struct server *server, uint32_t uid, char *text, size_t size);

#endif
