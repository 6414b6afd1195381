/* The client's side of the request ring: see request_ring.h. */
#include "request_ring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ring_entries.h"
#include "ring_format.h"
#include "zipcache/error.h"

static struct ring_header *header_of(const struct request_ring *ring)
{
	return (struct ring_header *)ring->base;
}

int request_ring_map(struct request_ring *ring, int memfd, int eventfd, uint64_t capacity)
{
	struct stat st;
	int rc = ZC_EPROTOCOL;
	uint64_t mapped = ring_mapped_bytes(capacity);

	memset(ring, 0, sizeof(*ring));
	ring->eventfd = -1;
	if (capacity < RING_MIN_BYTES || capacity > RING_MAX_BYTES || capacity % RING_ALIGN ||
	    fstat(memfd, &st) < 0 || (uint64_t)st.st_size < mapped)
		goto fail;
	void *base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		goto fail;
	}
	struct ring_header *h = base;
	if (h->magic != RING_MAGIC || h->capacity != capacity) {
		munmap(base, mapped);
		goto fail;
	}
	ring->base = base;
	ring->mapped_bytes = mapped;
	ring->capacity = capacity;
	ring->tail = __atomic_load_n(&h->tail, __ATOMIC_RELAXED);
	ring->reply_head = __atomic_load_n(&h->reply_head, __ATOMIC_RELAXED);
	ring->eventfd = eventfd;
	close(memfd);
	return 0;

fail:
	close(memfd);
	close(eventfd);
	return rc;
}

void request_ring_unmap(struct request_ring *ring)
{
	if (ring->base) {
		munmap(ring->base, ring->mapped_bytes);
		close(ring->eventfd);
	}
	memset(ring, 0, sizeof(*ring));
	ring->eventfd = -1;
}

bool request_ring_fits(const struct request_ring *ring, size_t len)
{
	if (!ring->base)
		return false;
	struct ring_area area = ring_requests(ring->base, ring->capacity);
	return ring_entry_fits(&area, len);
}

int request_ring_put(struct request_ring *ring, const uint8_t *frame, size_t len)
{
	struct ring_header *h = header_of(ring);
	struct ring_area area = ring_requests(ring->base, ring->capacity);
	uint64_t head = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
	int rc = ring_entry_put(&area, &ring->tail, head, frame, len);
	if (rc != 1)
		return rc;
	/* Swapped, so that entries appended before the daemon wakes ring
	 * no more. */
	if (ring_tail_publish(&h->tail, ring->tail, &h->need_wakeup) &&
	    __atomic_exchange_n(&h->need_wakeup, 0, __ATOMIC_ACQ_REL)) {
		uint64_t one = 1;
		ssize_t n;
		while ((n = write(ring->eventfd, &one, sizeof(one))) < 0 && errno == EINTR)
			;
		if (n < 0)
			return -errno;
		ring->doorbells++;
	}
	return 1;
}

bool request_ring_taken(const struct request_ring *ring)
{
	return !ring->base ||
	       __atomic_load_n(&header_of(ring)->head, __ATOMIC_ACQUIRE) == ring->tail;
}

int request_ring_reply(struct request_ring *ring, uint8_t *out, size_t *len)
{
	struct ring_header *h = header_of(ring);
	struct ring_area area = ring_replies(ring->base, ring->capacity);
	uint64_t tail = __atomic_load_n(&h->reply_tail, __ATOMIC_ACQUIRE);
	const char *why;
	uint64_t bad[2];
	int rc = ring_entry_take(&area, &ring->reply_head, tail, RING_REPLY_BYTES - 4, out, len,
				 &why, bad);
	if (rc == 1)
		__atomic_store_n(&h->reply_head, ring->reply_head, __ATOMIC_RELEASE);
	return rc;
}

bool request_ring_sleep(struct request_ring *ring)
{
	struct ring_header *h = header_of(ring);
	return ring_flag_sleep(&h->client_waiting, &h->reply_tail, ring->reply_head);
}

void request_ring_awake(struct request_ring *ring)
{
	__atomic_store_n(&header_of(ring)->client_waiting, 0, __ATOMIC_RELAXED);
}
