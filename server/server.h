/*
 * The daemon's state: its loop, listener, connections and sessions, and
 * the counters stats and metrics report. One per process; every field is
 * touched on the loop thread only.
 *
 * server.c owns the connections: it accepts them (limits, quotas), keeps
 * the list, is the owner their callbacks report to (a frame goes to
 * dispatch, queued reply bytes are charged to the uid's budget), and
 * drains and closes them to stop.
 */
#ifndef ZIPCACHE_SERVER_H
#define ZIPCACHE_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "adopt.h"
#include "busy_poll.h"
#include "ring_pump.h"
#include "connection.h"
#include "dispatch.h"
#include "metrics.h"
#include "options.h"
#include "offload.h"
#include "quota.h"
#include "session.h"
#include "pool.h"
#include "prefix.h"
#include "workers.h"

struct server;

/* One connection this daemon serves: the transport, who is on the other
 * end as dispatch sees it, and the responder its replies go through. */
struct client {
	struct connection connection;
	struct peer peer;
	struct responder responder;
	struct server *server;
	struct client *prev, *next;
};

struct server_counters {
	uint64_t connections_accepted;
	uint64_t requests;
	uint64_t request_errors;
	uint64_t tokens_appended;
	uint64_t ring_requests;    /* requests taken from request rings */
	uint64_t ring_replies;     /* replies written into their reply areas */
	uint64_t ring_doorbells;   /* doorbell counts read (clients that woke the loop) */
	uint64_t ring_nudges;      /* empty frames sent to clients asleep on their socket */
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
	struct workers workers;        /* the threads costly jobs run on */
	struct session_table sessions;
	struct adoption adoption;
	struct store_budget budget;
	struct store_budget staging;   /* staging bytes of all connections: counted, no limit */
	struct quota_table quotas;
	struct pool_set pools;         /* one block pool per uid */
	struct prefix_index prefix;    /* chunks of prefix reuse (docs/PREFIX.md) */
	uint64_t reply_queue_bytes;    /* unsent reply bytes of all connections */
	bool replies_over;             /* past --max-reply-queue-total */
	struct connection_limits connection_limits;
	struct client *clients;
	uint32_t n_connections;
	bool stopping;
	uint64_t stop_deadline_ms;
	struct server_counters counters;
	struct metrics metrics;
	struct http_endpoint *http;
	struct remote *remote;         /* --remote; NULL without */
	struct offload_state offload;  /* --offload-idle-seconds, relief's offload step */
	struct busy_poll busy_poll;    /* --busy-poll-us */
	struct ring_pump ring_pump;    /* the connections' request rings into their connections */
	uint32_t rings;                /* connections that hold a request ring */
};

/* Takes over an accepted socket: serves it, or tells it why not (a limit,
 * a stop) and closes it. */
void server_accept(struct server *server, int fd);

/* What the sessions' files and maps and the block pools hold, by kind
 * (every uid's with all, else uid's); *file_bytes their sum. A shared
 * block counts once. */
void server_memory_by_kind(const struct server *server, bool all, uint32_t uid,
			   struct store_memory *kinds, uint64_t *file_bytes);

/* Binds the socket, adopts (or clears) old sessions, starts serving on loop. */
int server_start(struct server *server, uv_loop_t *loop, const struct options *options);

/* Graceful stop: no new connections or requests; in-flight work finishes,
 * replies are flushed, then the loop ends. Idempotent. */
void server_stop(struct server *server);

/* Frees what server_start made; call after the loop has returned. */
void server_free(struct server *server);

/* Memory charged to the budget by all sessions, staging buffers and
 * queued replies, bytes. */
static inline uint64_t server_memory_bytes(const struct server *server)
{
	return __atomic_load_n(&server->budget.used, __ATOMIC_RELAXED);
}

#endif
