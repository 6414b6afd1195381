/*
 * The client's side of a connection's request ring (proto/ring_format.h,
 * docs/RING.md): whole frames appended where the daemon takes them
 * without a system call, and its doorbell rung only when it asked to be.
 */
#ifndef ZIPCACHE_REQUEST_RING_H
#define ZIPCACHE_REQUEST_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct request_ring {
	uint8_t *base;          /* NULL: no ring */
	uint64_t mapped_bytes;
	uint64_t capacity;
	uint64_t tail;          /* ours; published after each entry */
	int eventfd;
	uint64_t doorbells;     /* times rung */
};

/*
 * Maps the ring the daemon sent (memfd, eventfd: both taken over, closed
 * on failure) with `capacity` bytes of data. Returns 0, or ZC_EPROTOCOL
 * when the memory is not such a ring, or a negative errno.
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

#endif
