/*
 * Entries of a ring area (proto/ring_format.h), either way: appended by
 * their writer, taken by their reader. I/O-free; who publishes the
 * positions, and with which fences, is the caller's.
 */
#ifndef ZIPCACHE_RING_ENTRIES_H
#define ZIPCACHE_RING_ENTRIES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ring_format.h"

/* An area: its bytes and capacity (a multiple of RING_ALIGN). */
struct ring_area {
	uint8_t *data;
	uint64_t capacity;
};

/* The two areas of a ring mapped at `base` with `capacity` bytes of
 * request area (ring_format.h's layout). */
static inline struct ring_area ring_requests(uint8_t *base, uint64_t capacity)
{
	return (struct ring_area){ base + RING_HEADER_BYTES, capacity };
}

static inline struct ring_area ring_replies(uint8_t *base, uint64_t capacity)
{
	return (struct ring_area){ base + RING_HEADER_BYTES + capacity, RING_REPLY_BYTES };
}

/* Whether a frame of len bytes (header included) may go in at all: it
 * leaves room for another of its size. */
int ring_entry_fits(const struct ring_area *area, size_t len);

/*
 * Appends one whole frame (its 4-byte header included) at *tail, the
 * reader being at `head`: 1 and *tail advanced, 0 when there is no room
 * yet, ZC_EPROTOCOL when head is not within a lap behind *tail. Nothing
 * is published.
 */
int ring_entry_put(const struct ring_area *area, uint64_t *tail, uint64_t head,
		   const uint8_t *frame, size_t len);

/*
 * Takes the entry at *head (the writer being at `tail`), trusting nothing
 * written there: 1 with the whole frame (header included) copied into
 * `out` (room for max_body + 4 bytes) and *len, *head advanced; 0 when
 * none waits; ZC_EPROTOCOL when the area is not a valid sequence of
 * entries (`why`, a static sentence, says how; *bad the numbers).
 */
int ring_entry_take(const struct ring_area *area, uint64_t *head, uint64_t tail,
		    uint32_t max_body, uint8_t *out, size_t *len, const char **why,
		    uint64_t bad[2]);

/*
 * The two halves of the wakeup handshake, the same either way (the
 * daemon sleeping for requests, the client for replies):
 *   the sleeper raises its flag and looks at the other side's tail again
 *   (true: it moved past `seen`, the flag is lowered, do not sleep);
 *   the writer publishes its tail, then (after a full fence) looks at the
 *   flag (true: the sleeper may not have seen the entry, wake it).
 * Either the sleeper sees the entry or the writer sees the flag.
 */
bool ring_flag_sleep(uint32_t *flag, const uint64_t *tail, uint64_t seen);
bool ring_tail_publish(uint64_t *tail_field, uint64_t tail, const uint32_t *flag);

#endif
