/* The client's side of the request ring: see request_ring.h. */
#include "request_ring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
	uint64_t mapped = RING_HEADER_BYTES + capacity;

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
	ring->base = base;
	ring->mapped_bytes = mapped;
	struct ring_header *h = header_of(ring);
	if (h->magic != RING_MAGIC || h->capacity != capacity) {
		munmap(base, mapped);
		ring->base = NULL;
		goto fail;
	}
	ring->capacity = capacity;
	ring->tail = __atomic_load_n(&h->tail, __ATOMIC_RELAXED);
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
	return ring->base && len >= 4 && len - 4 <= UINT32_MAX - RING_ALIGN &&
	       ring_entry_bytes(len - 4) <= ring->capacity / 2;
}

int request_ring_put(struct request_ring *ring, const uint8_t *frame, size_t len)
{
	struct ring_header *h = header_of(ring);
	uint8_t *data = ring->base + RING_HEADER_BYTES;
	uint64_t need = ring_entry_bytes(len - 4);
	uint64_t head = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
	uint64_t used = ring->tail - head;

	if (used > ring->capacity)
		return ZC_EPROTOCOL;
	uint64_t offset = ring->tail % ring->capacity;
	uint64_t to_end = ring->capacity - offset;
	uint64_t skip = need <= to_end ? 0 : to_end;
	if (used + skip + need > ring->capacity)
		return 0;
	if (skip) {
		uint32_t wrap = RING_WRAP;
		memcpy(data + offset, &wrap, sizeof(wrap));
		offset = 0;
	}
	memcpy(data + offset, frame, len);
	ring->tail += skip + need;
	__atomic_store_n(&h->tail, ring->tail, __ATOMIC_RELEASE);
	/* The other half of ring_sleep's handshake: after the tail, the flag. */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&h->need_wakeup, __ATOMIC_RELAXED) &&
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
