/*
 * One connection's request ring (proto/ring_format.h): the daemon's side.
 * It owns the shared mapping (read-write: the daemon publishes head and
 * the wakeup flag there), the doorbell eventfd and its poll handle, and
 * the memory charge; it takes whole entries out, checked and copied,
 * so a client rewriting the ring under us can only garble its own request.
 * What an entry means is the owner's business (server.c hands it to the
 * connection as a frame).
 */
#ifndef ZIPCACHE_RING_H
#define ZIPCACHE_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

struct store_budget;

struct ring {
	uv_poll_t doorbell;
	int memfd, eventfd;
	uint8_t *base;               /* the mapping: header page, request area, reply area */
	uint64_t mapped_bytes;
	uint64_t capacity;           /* the request area's bytes (ours, not the header's) */
	uint64_t head;               /* ours: how far entries were taken */
	uint64_t reply_tail;         /* ours: reply bytes written */
	uint64_t *doorbells;         /* the eventfd's counts read are added there */
	struct store_budget *memory, *quota;   /* charged mapped_bytes */
};

/* The largest ring a daemon with this --max-staging-bytes makes (0: none). */
uint64_t ring_max_bytes(uint64_t max_staging_bytes);

/* What a ring of `bytes` of data maps and is charged: the header page,
 * the request area rounded up to pages, the reply area. */
uint64_t ring_charge_bytes(uint64_t bytes);

/*
 * A ring of at least `bytes` of data (RING_MIN_BYTES..RING_MAX_BYTES,
 * rounded up to pages), its doorbell polled on `loop`; charged to
 * `memory` and `quota` as staging_create does, with the same codes
 * (STORE_EBUDGET, ZC_EEXHAUSTED, negative errno), nothing charged then.
 */
int ring_create(uv_loop_t *loop, uint64_t bytes, struct store_budget *memory,
		struct store_budget *quota, uint64_t *doorbells, struct ring **out);

/*
 * The next entry copied into `buffer` (room for max_frame + 4 bytes): 1,
 * its body at buffer + 4 and *len bytes long; 0 when the ring is empty;
 * ZC_EPROTOCOL when what the client wrote is not a valid entry (`why`
 * says how), and the ring is unusable after that. The new head is
 * published at once, before the entry is dispatched: a client that holds
 * every reply finds the ring empty (and may write the socket).
 */
int ring_next(struct ring *ring, uint8_t *buffer, uint32_t max_frame, uint32_t *len,
	      char *why, size_t why_len);

/*
 * A reply frame (header included) into the reply area: 1 when written
 * and published (*nudge: the client sleeps on its socket, send it an
 * empty frame), 0 when it does not fit or has no room (send it on the
 * socket). The frame stays the caller's.
 */
int ring_reply(struct ring *ring, const uint8_t *frame, size_t len, bool *nudge);

/* Whether an entry waits (the tail moved past our head). */
bool ring_pending(const struct ring *ring);

/*
 * The loop is about to sleep: sets the wakeup flag, then looks at the
 * tail again. True when an entry came meanwhile (the flag is cleared
 * again and the caller must take it before sleeping).
 */
bool ring_sleep(struct ring *ring);

/* The loop is awake: the client need not ring. */
void ring_awake(struct ring *ring);

/* Descriptors for the client (dup'd): the ring and its doorbell. */
int ring_share(const struct ring *ring, int fds[2]);

/* Closes the doorbell handle; the ring is freed (and its charge given
 * back) once the handle has closed. */
void ring_close(struct ring *ring);

#endif
