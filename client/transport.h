/*
 * The client's socket: connect with a timeout, send whole frames, and
 * receive reply frames together with the descriptors that arrive beside
 * them (kept in arrival order until a reply claims them).
 */
#ifndef ZIPCACHE_TRANSPORT_H
#define ZIPCACHE_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "frame.h"

struct request_ring;

#define TRANSPORT_MAX_FDS 16

struct transport {
	int fd;
	int timeout_ms;            /* 0: wait forever */
	int spin_us;               /* polls this long before sleeping */
	frame_reader reader;
	int fds[TRANSPORT_MAX_FDS];/* received, not yet claimed */
	int n_fds;
	/* The connection's request ring, whose reply area is read before
	 * the socket (and polled instead of it while a receive spins);
	 * NULL without. Its owner's (client.c); ring_frame is ours. */
	struct request_ring *ring;
	uint8_t *ring_frame;
};

/* spin_us: how long a receive polls before it sleeps (zc_client_set_receive_spin). */
int transport_connect(struct transport *transport, const char *path, int timeout_ms, int spin_us);
/* The bound on each send and receive (0: none). */
int transport_set_timeout(struct transport *transport, int timeout_ms);
void transport_close(struct transport *transport);

/* Writes all len bytes (a whole frame). */
int transport_send(struct transport *transport, const uint8_t *data, size_t len);

/* The same, with one descriptor (SCM_RIGHTS) on the frame's first byte. */
int transport_send_fd(struct transport *transport, const uint8_t *data, size_t len, int fd);

/* Replies also come from this ring's reply area from now on (NULL: only
 * the socket). An empty frame on the socket is the daemon's nudge to look
 * there, and never reaches the caller. */
int transport_set_ring(struct transport *transport, struct request_ring *ring);

/* Blocks until a whole frame is buffered; *frame stays valid until
 * transport_consume(). */
int transport_receive(struct transport *transport, const uint8_t **frame, size_t *len);
void transport_consume(struct transport *transport);

/* The same without waiting: -EAGAIN when no whole frame is there yet. */
int transport_receive_ready(struct transport *transport, const uint8_t **frame, size_t *len);

/* Takes the oldest n received descriptors (ZC_EPROTOCOL if fewer came). */
int transport_take_fds(struct transport *transport, int *fds, int n);

/* Received descriptors no reply has claimed. */
int transport_unclaimed_fds(const struct transport *transport);

/* Whether the daemon has closed its end (it stopped, or died): -ECONNRESET
 * then, else 0. Looks without waiting and reads nothing. */
int transport_peer_closed(const struct transport *transport);

#endif
