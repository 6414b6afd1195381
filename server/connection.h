/*
 * One client connection: a non-blocking Unix socket driven by a uv_poll_t
 * (libuv's stream handles cannot send our shared-memory descriptors), a
 * frame reader, and a queue of reply frames with the descriptors that go
 * with their first byte.
 *
 * States, advanced by connection_on_poll():
 *   OPEN      reading frames and dispatching them; writing when replies wait
 *   PAUSED    too many requests in flight, or replies unsent past a bound
 *             (--max-reply-queue-bytes for this connection, or
 *             --max-reply-queue-total over all while this one has some
 *             waiting, or CONNECTION_MAX_QUEUED_FDS descriptors): neither
 *             reading nor dispatching; frames already read wait, and run
 *             first when the connection opens again
 *   DRAINING  the server is stopping, or the peer sent EOF and every whole
 *             frame it sent has been dispatched: no more reads, replies
 *             still flushed, closed when nothing is left
 *   CLOSING   handle closing; freed when the last job releases it
 */
#ifndef ZIPCACHE_CONNECTION_H
#define ZIPCACHE_CONNECTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "frame.h"
#include "metrics.h"

struct server;
struct staging;
struct out_frame;
struct quota_usage;

/* Descriptors queued replies may hold before the connection stops
 * reading: a client that pipelines opens without reading the replies
 * would otherwise pin a descriptor per reply. */
#define CONNECTION_MAX_QUEUED_FDS 4

/* Descriptors one connection may hold: its socket, its staging buffer
 * and those of its queued replies. */
#define CONNECTION_DESCRIPTORS (2 + CONNECTION_MAX_QUEUED_FDS)

enum connection_state {
	CONNECTION_OPEN,
	CONNECTION_PAUSED,
	CONNECTION_DRAINING,
	CONNECTION_CLOSING
};

struct connection {
	uv_poll_t poll;
	/* Runs frames that arrived while paused: no readiness event will
	 * announce bytes that are already in the reader. */
	uv_idle_t resume;
	int fd;
	uint64_t id;
	uint32_t uid;
	int32_t pid;
	enum connection_state state;
	int poll_events;
	struct server *server;
	frame_reader reader;
	struct out_frame *out_head, *out_tail;
	size_t out_bytes;
	size_t out_charged;        /* of out_bytes, what the budget and totals count */
	size_t out_peak;           /* most out_bytes since the queue was last empty */
	int out_fds;               /* descriptors the queued frames hold */
	struct quota_usage *quota; /* the peer uid's holdings (server->quotas) */
	unsigned in_flight;        /* requests dispatched, not yet answered */
	bool peer_closed;          /* EOF read; frames still buffered are served */
	bool dispatching;          /* inside frames_dispatch: no nested run */
	unsigned refs;             /* the two handles, plus each job */
	struct staging *staging;
	struct request_meta current;   /* the request being dispatched */
	struct connection *prev, *next;
};

/* Takes over an accepted socket; closes it on failure. */
void connection_accept(struct server *server, int fd);

/*
 * Queues one reply frame (ownership of `frame`, a malloc'd buffer, passes
 * here) and the descriptors to send with it (closed once sent or dropped).
 * Replies to a closing connection are dropped. Returns 0 when queued (or
 * sent), or a negative errno when dropped: -EPIPE for a closing
 * connection, -ENOMEM, -EINVAL for too many descriptors.
 */
int connection_send(struct connection *connection, uint8_t *frame, size_t len,
		    const int *fds, int n_fds);

/* A request finished (its reply was queued): may resume reading. */
void connection_request_done(struct connection *connection);

void connection_ref(struct connection *connection);
void connection_unref(struct connection *connection);

/* Starts closing now (protocol error, server stop). */
void connection_close(struct connection *connection);

/* Stop reading; close once every reply is out. */
void connection_drain(struct connection *connection);

#endif
