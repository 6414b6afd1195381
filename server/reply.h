/*
 * Replies: how the result of a request becomes a message (the plain
 * structs of wire.h), a frame, and a send through the request's responder,
 * counted in the metrics. What a request does is dispatch.c's; how its
 * answer looks on the wire is here.
 */
#ifndef ZIPCACHE_REPLY_H
#define ZIPCACHE_REPLY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dispatch.h"
#include "metrics.h"
#include "wire.h"

struct server;
struct session;
struct store_layer_stats;
struct session_totals;

/* One request in hand: who asks, where its answer goes, and (for the
 * metrics) which op it is and when it arrived. Jobs keep a copy. */
struct request {
	struct server *server;
	struct peer *peer;
	struct responder *responder;
	struct request_meta meta;
	uint64_t id;
};

/* Encodes and sends a reply; the frame passes to the responder. Returns
 * 0, or why the reply could not be sent (the stream is then closed or
 * closing, and the client will never see it). */
int reply_send(const struct request *rq, wire_response *response, const int *fds, int n_fds);

/* An error reply with a formatted message; also counts and logs it. */
void reply_error(const struct request *rq, int error, const char *format, ...)
	__attribute__((format(printf, 3, 4)));

/* What ran out, for a refusal caused by a resource error (these answer
 * RESOURCE_EXHAUSTED, see wire.h); other errors are their own sentence. */
const char *reply_resource_text(const struct server *server, int rc, char *text, size_t size);

/* A session as the protocol describes it (and attach compares against). */
void reply_session_info(const struct session *session, zc_session_info *info);

/* The store's accounting of one layer (or a sum) as the protocol has it. */
void reply_layer_stats(const struct store_layer_stats *s, zc_layer_stats *out);

void reply_hello(const struct request *rq);

/* The open (or attach) reply with the view descriptor. Returns 0 once
 * queued; a negative code when it could not be (the client was told why,
 * or is gone), so that a session made for the request can be taken back. */
int reply_open(const struct request *rq, struct session *session, bool attached);
/* The same for a fork's new session (the reply of fork_session). */
int reply_fork(const struct request *rq, struct session *session);
/* The same for an imported session (import_session's reply). */
int reply_import(const struct request *rq, struct session *session);

/* A session's stats: per layer, their sum, and the daemon's figures. */
void reply_session_stats(const struct request *rq, const struct session *session,
			 const struct store_layer_stats *layers);

/* The daemon's figures only (stats without a session). */
void reply_server_stats(const struct request *rq);

void reply_list(const struct request *rq);

/* The frame that tells a connection we will not serve why: status
 * RESOURCE_EXHAUSTED, request id 0. Returns 0 with *len set. */
int reply_refusal_frame(const char *message, uint8_t *frame, size_t cap, size_t *len);

#endif
