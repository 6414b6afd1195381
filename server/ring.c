/* A connection's request ring, the daemon's side (proto/ring_format.h). */
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "frame.h"
#include "ring_format.h"
#include "budget.h"
#include "zipcache/error.h"

static struct ring_header *header_of(const struct ring *ring)
{
	return (struct ring_header *)ring->base;
}

static void on_doorbell(uv_poll_t *handle, int status, int events)
{
	struct ring *ring = handle->data;
	uint64_t count;
	(void)status;
	(void)events;
	/* Level-triggered: read it back to zero, or the loop never sleeps.
	 * The entries themselves are taken by the owner's check handle,
	 * which runs right after this poll phase. */
	if (read(ring->eventfd, &count, sizeof(count)) == (ssize_t)sizeof(count))
		ring->doorbells += count;
}

int ring_create(uv_loop_t *loop, uint64_t bytes, struct store_budget *memory,
		struct store_budget *quota, struct ring **out)
{
	if (bytes < RING_MIN_BYTES || bytes > RING_MAX_BYTES)
		return -EINVAL;
	uint64_t capacity = (bytes + 4095) / 4096 * 4096;
	uint64_t mapped = RING_HEADER_BYTES + capacity;
	int rc;

	if (store_budget_take(quota, mapped) < 0)
		return ZC_EEXHAUSTED;
	rc = store_budget_take(memory, mapped);
	if (rc < 0)
		goto out_quota;
	rc = -ENOMEM;
	struct ring *ring = calloc(1, sizeof(*ring));
	if (!ring)
		goto out_memory;
	ring->eventfd = -1;
	ring->memfd = memfd_create("zipcache-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (ring->memfd < 0) {
		rc = -errno;
		goto out_free;
	}
	/* Sealed against shrinking: our writable mapping never faults. */
	if (ftruncate(ring->memfd, (off_t)mapped) < 0 ||
	    fcntl(ring->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		rc = -errno;
		goto out_close;
	}
	void *base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, ring->memfd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		goto out_close;
	}
	ring->base = base;
	ring->mapped_bytes = mapped;
	ring->capacity = capacity;
	struct ring_header *h = header_of(ring);
	h->magic = RING_MAGIC;
	h->capacity = capacity;
	ring->eventfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (ring->eventfd < 0) {
		rc = -errno;
		goto out_unmap;
	}
	rc = uv_poll_init(loop, &ring->doorbell, ring->eventfd);
	if (rc < 0)
		goto out_unmap;
	ring->doorbell.data = ring;
	ring->memory = memory;
	ring->quota = quota;
	uv_poll_start(&ring->doorbell, UV_READABLE, on_doorbell);
	*out = ring;
	return 0;

out_unmap:
	munmap(base, mapped);
out_close:
	if (ring->eventfd >= 0)
		close(ring->eventfd);
	close(ring->memfd);
out_free:
	free(ring);
out_memory:
	store_budget_give(memory, mapped);
out_quota:
	store_budget_give(quota, mapped);
	return rc;
}

static int corrupt(char *why, size_t why_len, const char *what, uint64_t a, uint64_t b)
{
	snprintf(why, why_len, "request ring: %s (%" PRIu64 ", %" PRIu64 ")", what, a, b);
	return ZC_EPROTOCOL;
}

int ring_next(struct ring *ring, uint8_t *buffer, uint32_t max_frame, uint32_t *len,
	      char *why, size_t why_len)
{
	struct ring_header *h = header_of(ring);
	const uint8_t *data = ring->base + RING_HEADER_BYTES;

	for (bool wrapped = false;;) {
		uint64_t tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
		uint64_t available = tail - ring->head;
		if (available == 0)
			return 0;
		if (available > ring->capacity)
			return corrupt(why, why_len, "the tail is not within one lap of the head",
				       tail, ring->head);
		if (tail % RING_ALIGN)
			return corrupt(why, why_len, "the tail is not aligned", tail, RING_ALIGN);
		uint64_t offset = ring->head % ring->capacity;
		uint64_t to_end = ring->capacity - offset;
		uint32_t body;
		/* Read once: the client may be rewriting it. */
		uint32_t raw = __atomic_load_n((const uint32_t *)(data + offset), __ATOMIC_RELAXED);
		uint8_t bytes[FRAME_HEADER_BYTES];
		memcpy(bytes, &raw, sizeof(bytes));
		body = frame_header_read(bytes);
		if (body == RING_WRAP) {
			if (offset == 0 || wrapped)
				return corrupt(why, why_len, "a wrap mark at the start of the data",
					       ring->head, offset);
			if (to_end > available)
				return corrupt(why, why_len, "a wrap mark past the tail", to_end,
					       available);
			ring->head += to_end;
			wrapped = true;
			continue;
		}
		if (body > max_frame)
			return corrupt(why, why_len, "an entry longer than a frame may be", body,
				       max_frame);
		uint64_t entry = ring_entry_bytes(body);
		if (entry > to_end)
			return corrupt(why, why_len, "an entry that runs past the end of the data",
				       entry, to_end);
		if (entry > available)
			return corrupt(why, why_len, "an entry cut by the tail", entry, available);
		memcpy(buffer, data + offset + 4, body);
		ring->head += entry;
		ring->taken++;
		*len = body;
		return 1;
	}
}

bool ring_pending(const struct ring *ring)
{
	return __atomic_load_n(&header_of(ring)->tail, __ATOMIC_ACQUIRE) != ring->head;
}

void ring_publish(struct ring *ring)
{
	if (ring->published == ring->head)
		return;
	__atomic_store_n(&header_of(ring)->head, ring->head, __ATOMIC_RELEASE);
	ring->published = ring->head;
}

bool ring_sleep(struct ring *ring)
{
	struct ring_header *h = header_of(ring);
	__atomic_store_n(&h->need_wakeup, 1, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(&h->tail, __ATOMIC_SEQ_CST) == ring->head)
		return false;
	__atomic_store_n(&h->need_wakeup, 0, __ATOMIC_RELAXED);
	return true;
}

void ring_awake(struct ring *ring)
{
	struct ring_header *h = header_of(ring);
	if (__atomic_load_n(&h->need_wakeup, __ATOMIC_RELAXED))
		__atomic_store_n(&h->need_wakeup, 0, __ATOMIC_RELAXED);
}

int ring_share(const struct ring *ring, int fds[2])
{
	fds[0] = dup(ring->memfd);
	if (fds[0] < 0)
		return -errno;
	fds[1] = dup(ring->eventfd);
	if (fds[1] < 0) {
		int rc = -errno;
		close(fds[0]);
		return rc;
	}
	return 0;
}

static void on_closed(uv_handle_t *handle)
{
	struct ring *ring = handle->data;
	munmap(ring->base, ring->mapped_bytes);
	close(ring->eventfd);
	close(ring->memfd);
	store_budget_give(ring->memory, ring->mapped_bytes);
	store_budget_give(ring->quota, ring->mapped_bytes);
	free(ring);
}

void ring_close(struct ring *ring)
{
	if (ring)
		uv_close((uv_handle_t *)&ring->doorbell, on_closed);
}
