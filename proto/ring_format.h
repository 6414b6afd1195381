/*
 * A connection's request ring: shared memory the client writes request
 * frames into without a system call, for the daemon to take in order
 * (docs/RING.md). The daemon makes it (a memfd, charged like a staging
 * buffer) with an eventfd beside it, the doorbell; both go to the client
 * in the reply to a staging request with `ring` set.
 *
 *   [struct ring_header]                       one page
 *   [data: capacity bytes]                     request entries, in order
 *   [replies: RING_REPLY_BYTES]                reply entries, in order
 *
 * An entry is one frame exactly as on the socket (4-byte length, then the
 * body), padded to RING_ALIGN. An entry never wraps: where the rest of
 * the data area is too short for the next one, the client writes
 * RING_WRAP as a length there and the entry starts again at offset 0.
 *
 * Replies go the other way the same way (entries of the reply area,
 * reply_tail written by the daemon, reply_head by the client), for a
 * client that polls memory rather than the socket while it waits: a
 * reply with descriptors, one that does not fit half the area, or one
 * for which the area has no room goes on the socket instead. Before a
 * client sleeps in recvmsg it sets client_waiting, then looks at the
 * reply area again; a daemon that published a reply and then (after a
 * full fence) finds the flag set sends an empty frame on the socket, the
 * nudge to look.
 *
 * Positions (tail, head) count bytes since the ring was made and never
 * wrap; an offset in the data area is position % capacity. Who writes what:
 *   tail         the client: published (release) after an entry's bytes
 *   head         the daemon: how far it has taken entries, published after
 *                each one, before it is dispatched; the client may reuse
 *                what lies before it
 *   need_wakeup  the daemon sets it to 1 just before its loop sleeps, then
 *                reads tail again; a client that publishes an entry and
 *                then (after a full fence) finds it 1 swaps it to 0 and
 *                writes the eventfd. Either the daemon sees the entry or
 *                the client sees the flag, never neither.
 *
 * The daemon trusts nothing here: it keeps its own head and capacity, and
 * an entry that is cut, too long, misaligned or past the tail closes the
 * connection (nothing the client stored is touched).
 */
#ifndef ZIPCACHE_RING_FORMAT_H
#define ZIPCACHE_RING_FORMAT_H

#include <stdint.h>

#include "zipcache/client.h"

#define RING_MAGIC 0x31474e495243435aull   /* "ZCCRING1", little-endian */
#define RING_HEADER_BYTES 4096u
#define RING_ALIGN 8u
#define RING_WRAP 0xffffffffu
/* The reply area: update replies are tens of bytes. */
#define RING_REPLY_BYTES (64u << 10)
/* The data area: at least one decode step's frame, at most what one
 * connection may pin (the uid's staging quota bounds it further). */
#define RING_MIN_BYTES ZC_ASYNC_RING_MIN_BYTES
#define RING_MAX_BYTES ZC_ASYNC_RING_MAX_BYTES

struct ring_header {
	uint64_t magic;
	uint64_t capacity;                     /* bytes of the data area */
	_Alignas(64) uint64_t tail;
	_Alignas(64) uint64_t head;
	_Alignas(64) uint32_t need_wakeup;
	_Alignas(64) uint64_t reply_tail;      /* daemon */
	_Alignas(64) uint64_t reply_head;      /* client */
	_Alignas(64) uint32_t client_waiting;  /* client */
};

_Static_assert(sizeof(struct ring_header) <= RING_HEADER_BYTES, "ring header fits its page");

/* What a ring with `capacity` bytes of request area maps: header page,
 * request area, reply area. */
static inline uint64_t ring_mapped_bytes(uint64_t capacity)
{
	return RING_HEADER_BYTES + capacity + RING_REPLY_BYTES;
}

/* An entry's bytes in the ring: frame header and body, padded. */
static inline uint64_t ring_entry_bytes(uint64_t body_bytes)
{
	return (4u + body_bytes + RING_ALIGN - 1) / RING_ALIGN * RING_ALIGN;
}

#endif
