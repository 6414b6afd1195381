/*
 * The client's side of a connection's request ring (proto/ring_format.h,
 * docs/RING.md): whole frames appended where the daemon takes them
 * without a system call, its doorbell rung only when it asked to be; and
 * its replies taken from the reply area, with the flag that asks for a
 * nudge on the socket before the client sleeps there.
 */
#ifndef ZIPCACHE_REQUEST_RING_H
#define ZIPCACHE_REQUEST_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct request_ring {
	uint8_t *base;          /* NULL: no ring */
	uint64_t mapped_bytes;
	uint64_t capacity;      /* of the request area */
	uint64_t tail;          /* ours; published after each entry */
	uint64_t reply_head;    /* ours; published after each reply taken */
	int eventfd;
	uint64_t doorbells;     /* times rung */
};

/*
 * Maps the ring the daemon sent (memfd, eventfd: both taken over, closed
 * on failure) with `capacity` bytes of request area. Returns 0, or
 * ZC_EPROTOCOL when the memory is not such a ring, or a negative errno.
 */
int request_ring_map(struct request_ring *ring, int memfd, int eventfd, uint64_t capacity);
void request_ring_unmap(struct request_ring *ring);

/* Whether a frame of `len` bytes may go through the ring at all: it
 * leaves room for another of its size. */
bool request_ring_fits(const struct request_ring *ring, size_t len);

/*
 * Appends one whole frame (its 4-byte header included) and rings the
 * doorbell if the daemon sleeps. 1 when appended, 0 when there is no room
 * until the daemon takes more, ZC_EPROTOCOL when the daemon's head makes
 * no sense, or a negative errno from the doorbell.
 */
int request_ring_put(struct request_ring *ring, const uint8_t *frame, size_t len);

/* Whether the daemon has taken every entry appended. */
bool request_ring_taken(const struct request_ring *ring);

/*
 * The next reply frame (header included) copied into `out` (room for
 * RING_REPLY_BYTES): 1 and *len, 0 when none waits, ZC_EPROTOCOL when the
 * reply area is not a valid sequence of entries.
 */
int request_ring_reply(struct request_ring *ring, uint8_t *out, size_t *len);

/* About to sleep on the socket: asks for a nudge, then looks again.
 * True when a reply came meanwhile (and the ask is withdrawn). */
bool request_ring_sleep(struct request_ring *ring);

/* Awake again: no nudge wanted. */
void request_ring_awake(struct request_ring *ring);

#endif
