/*
 * Dispatch: one request in, one reply out, and what the request does (the
 * ops). Validates everything a client sends before any state changes, so
 * bad input gets a clear status and message and nothing stored is touched.
 * It knows nothing of sockets: a request comes from a peer (who asks, what
 * it holds) and is answered through a responder; server.c makes both for
 * each connection, the fuzzer and tests could make others.
 */
#ifndef ZIPCACHE_DISPATCH_H
#define ZIPCACHE_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

struct server;
struct quota_usage;
struct staging;

/* Who sends the requests, as dispatch sees it. */
struct peer {
	uint64_t id;                 /* the connection's, for logs */
	uint32_t uid;
	struct quota_usage *quota;   /* the uid's holdings (server->quotas) */
	struct staging *staging;     /* the last staging buffer handed out; the peer's reference */
	struct ring *ring;           /* its request ring, if it asked for one; the peer's */
};

struct responder;

/*
 * Where the replies of one peer go. Every request dispatch is handed has
 * begun; dispatch ends it with `end` once its reply was sent (or could not
 * be), and until then the responder stays valid.
 */
struct responder_ops {
	/* Queues one reply frame (a malloc'd buffer, which passes to the
	 * responder) with descriptors to send beside it (the responder
	 * closes them once sent or dropped). Returns 0, or a negative errno
	 * when the reply was dropped (the peer is gone). */
	int (*send)(struct responder *responder, uint8_t *frame, size_t len, const int *fds,
		    int n_fds);
	/* A reply could not be made: the stream is out of step, close it. */
	void (*abort)(struct responder *responder);
	/* One more request will be answered (an attach that waits for its job). */
	void (*begin)(struct responder *responder);
	/* A request was answered. */
	void (*end)(struct responder *responder);
	/* The descriptor that came with the request's frame (ownership
	 * passes), or -1; may be NULL for peers that cannot send any. */
	int (*take_fd)(struct responder *responder);
};

struct responder {
	const struct responder_ops *ops;
};

/* Handles one frame body; everything needed later is copied out of it,
 * so the caller may consume the frame as soon as this returns. */
void dispatch_request(struct server *server, struct peer *peer, struct responder *responder,
		      const uint8_t *frame, size_t len);

/* Tells the peer why its stream is being closed (an oversized frame). */
void dispatch_reject_frame(struct server *server, struct peer *peer, struct responder *responder,
			   int error);

#endif
