/*
 * Dispatch: one decoded request in, one reply out. Validates everything a
 * client sends before any state changes, so bad input gets a clear status
 * and message and nothing stored is touched.
 */
#ifndef ZIPCACHE_DISPATCH_H
#define ZIPCACHE_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

struct connection;
struct server;

/* Handles one frame body; everything needed later is copied out of it,
 * so the caller may consume the frame as soon as this returns. */
void dispatch_request(struct connection *connection, const uint8_t *frame, size_t len);

/* Tells the client why its stream is being closed (an oversized frame). */
void dispatch_reject_frame(struct connection *connection, int error);

/* Tells a connection we will not serve why (one RESOURCE_EXHAUSTED frame
 * saying `message`, best effort: the socket is new, so its buffer has
 * room). The caller closes fd. */
void dispatch_refuse_connection(struct server *server, int fd, const char *message);

/* A connection went away: a stopping server may now be done. */
void dispatch_connection_closed(struct server *server);

#endif
