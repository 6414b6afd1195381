/*
 * One client connection, as a transport: a non-blocking Unix socket driven
 * by a uv_poll_t (libuv's stream handles cannot send our shared-memory
 * descriptors), a frame reader, and a queue of reply frames with the
 * descriptors that go with their first byte. What the frames mean is its
 * owner's business (server.c): the connection reports "a frame arrived",
 * "the stream broke", "queued bytes changed", "closing" and "freed"
 * through the callbacks the owner set, the way a libuv handle calls back
 * (or memcached's per-connection protocol pointer).
 *
 * States, advanced by the poll callback:
 *   OPEN      reading frames and handing them over; writing when replies wait
 *   PAUSED    too many requests in flight, or replies unsent past a bound
 *             (max_reply_queue_bytes for this connection, or the owner's
 *             total over all while this one has some waiting, or
 *             CONNECTION_MAX_QUEUED_FDS descriptors): neither reading nor
 *             handing frames over; frames already read wait, and go first
 *             when the connection opens again
 *   DRAINING  the owner is stopping, or the peer sent EOF and every whole
 *             frame it sent was handed over: no more reads, replies
 *             still flushed, closed when nothing is left
 *   CLOSING   handle closing; freed when the last request lets go of it
 */
#ifndef ZIPCACHE_CONNECTION_H
#define ZIPCACHE_CONNECTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "frame.h"

struct out_frame;

/* Descriptors queued replies may hold before the connection stops
 * reading: a client that pipelines opens without reading the replies
 * would otherwise pin a descriptor per reply. */
#define CONNECTION_MAX_QUEUED_FDS 4

/* Descriptors a client may send (SCM_RIGHTS) ahead of the frames that
 * claim them: one per request that takes one (export_session,
 * import_session). More are closed on arrival. */
#define CONNECTION_MAX_RECEIVED_FDS 1

/* Descriptors one connection may hold: its socket, its staging buffer,
 * its request ring and doorbell, those of its queued replies and one
 * received. */
#define CONNECTION_DESCRIPTORS (4 + CONNECTION_MAX_QUEUED_FDS + CONNECTION_MAX_RECEIVED_FDS)

enum connection_state {
	CONNECTION_OPEN,
	CONNECTION_PAUSED,
	CONNECTION_DRAINING,
	CONNECTION_CLOSING
};

struct connection;

/*
 * What a connection tells its owner; every callback runs on the loop
 * thread. `frame` and `frame_error` each begin one request: the owner ends
 * it with connection_request_end() once it has answered (connection_send).
 */
struct connection_callbacks {
	/* A whole frame, valid until the callback returns. */
	void (*frame)(struct connection *connection, const uint8_t *frame, size_t len);
	/* The stream broke (an oversized frame: error is the frame reader's
	 * code); the owner may say why, then the connection drains. */
	void (*frame_error)(struct connection *connection, int error);
	/* The bytes of unsent replies went up (delta > 0) or down. */
	void (*queued)(struct connection *connection, int64_t delta);
	/* The connection started closing: nothing more is read or sent. */
	void (*closing)(struct connection *connection);
	/* The last reference is gone: the owner may free the memory around
	 * the connection. */
	void (*freed)(struct connection *connection);
};

struct connection_limits {
	uint32_t max_frame_bytes;
	uint64_t max_reply_queue_bytes;
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
	const struct connection_callbacks *callbacks;
	const struct connection_limits *limits;
	void *data;                /* the owner's */
	frame_reader reader;
	struct out_frame *out_head, *out_tail;
	size_t out_bytes;
	size_t out_reported;       /* of out_bytes, what the owner was told (queued) */
	size_t out_peak;           /* most out_bytes since the queue was last empty */
	int out_fds;               /* descriptors the queued frames hold */
	/* Descriptors the client sent, oldest first, not yet claimed by the
	 * frame they came with (connection_take_fd). */
	int in_fds[CONNECTION_MAX_RECEIVED_FDS];
	int n_in_fds;
	bool total_over;           /* the owner's total of unsent replies is past its bound */
	unsigned in_flight;        /* requests begun, not yet ended */
	bool peer_closed;          /* EOF read; frames still buffered are served */
	bool dispatching;          /* inside frames_dispatch: no nested run */
	unsigned refs;             /* the two handles, plus each request in flight */
};

/*
 * Takes over a socket: the owner allocated `connection` (libuv style) and
 * keeps it until the `freed` callback; `callbacks` and `limits` must
 * outlive it. uid and pid are the peer's credentials, for logs. Returns 0,
 * or a negative errno with fd left to the caller.
 */
int connection_init(struct connection *connection, uv_loop_t *loop, int fd, uint32_t uid,
		    int32_t pid, const struct connection_callbacks *callbacks,
		    const struct connection_limits *limits, void *data);

/*
 * Queues one reply frame (ownership of `frame`, a malloc'd buffer, passes
 * here) and the descriptors to send with it (closed once sent or dropped).
 * Replies to a closing connection are dropped. Returns 0 when queued (or
 * sent), or a negative errno when dropped: -EPIPE for a closing
 * connection, -ENOMEM, -EINVAL for too many descriptors.
 */
int connection_send(struct connection *connection, uint8_t *frame, size_t len,
		    const int *fds, int n_fds);

/*
 * The descriptor the client sent with the frame being handed over (or
 * with one before it that took none), whose ownership passes to the
 * caller; -1 when none came. Called from the `frame` callback. A
 * descriptor no frame claimed is closed once every whole frame read so
 * far was handed over and no part of another one is buffered.
 */
int connection_take_fd(struct connection *connection);

/* One more request will be answered on this connection (begun by the
 * owner, not by a frame: an attach that waits for its job). */
void connection_request_begin(struct connection *connection);

/* A request was answered (its reply was queued): may resume reading. */
void connection_request_end(struct connection *connection);

/* The owner's total of unsent replies passed its bound, or fell back
 * under it: a connection with replies waiting pauses, or reads again. */
void connection_set_total_over(struct connection *connection, bool over);

/* Whether a frame may be handed over now: open (not paused, draining or
 * closing) and not inside another hand-over. */
bool connection_accepting(const struct connection *connection);

/*
 * Hands over a frame that came another way than the socket (the request
 * ring), exactly as one read from it: it begins a request, and the flow
 * is looked at after. Only while connection_accepting(), and only from
 * the loop's own callbacks, never from inside a request.
 */
void connection_deliver(struct connection *connection, const uint8_t *frame, size_t len);

/* Starts closing now (protocol error, server stop). */
void connection_close(struct connection *connection);

/* Stop reading; close once every reply is out. */
void connection_drain(struct connection *connection);

/* For a socket that will not become a connection: one frame, best effort
 * (the socket is new, so its buffer has room), then close(fd). */
void connection_refuse_socket(int fd, const uint8_t *frame, size_t len);

#endif
