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
#include "pages.h"
#include "ring_entries.h"
#include "ring_format.h"
#include "staging.h"
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
		*ring->doorbells += count;
}

uint64_t ring_max_bytes(uint64_t max_staging_bytes)
{
	uint64_t max = max_staging_bytes < RING_MAX_BYTES ? max_staging_bytes : RING_MAX_BYTES;
	uint64_t pages = max / PAGE_BYTES * PAGE_BYTES;
	return pages >= RING_MIN_BYTES ? pages : 0;
}

/* The request area: what was asked, in whole pages. */
static uint64_t capacity_of(uint64_t bytes)
{
	return round_up(bytes, PAGE_BYTES);
}

uint64_t ring_charge_bytes(uint64_t bytes)
{
	return ring_mapped_bytes(capacity_of(bytes));
}

int ring_create(uv_loop_t *loop, uint64_t bytes, struct store_budget *memory,
		struct store_budget *quota, uint64_t *doorbells, struct ring **out)
{
	if (bytes < RING_MIN_BYTES || bytes > RING_MAX_BYTES)
		return -EINVAL;
	uint64_t capacity = capacity_of(bytes);
	uint64_t mapped = ring_mapped_bytes(capacity);
	int rc;

	if ((rc = staging_charge(memory, quota, mapped)) < 0)
		return rc;
	rc = -ENOMEM;
	struct ring *ring = calloc(1, sizeof(*ring));
	if (!ring)
		goto out_charge;
	ring->eventfd = -1;
	/* Sealed against shrinking: our writable mapping never faults. */
	uint8_t *base;
	rc = staging_memfd_map("zipcache-ring", mapped, PROT_READ | PROT_WRITE, &ring->memfd, &base);
	if (rc < 0)
		goto out_free;
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
	ring->doorbells = doorbells;
	uv_poll_start(&ring->doorbell, UV_READABLE, on_doorbell);
	*out = ring;
	return 0;

out_unmap:
	munmap(base, mapped);
	if (ring->eventfd >= 0)
		close(ring->eventfd);
	close(ring->memfd);
out_free:
	free(ring);
out_charge:
	staging_uncharge(memory, quota, mapped);
	return rc;
}

int ring_next(struct ring *ring, uint8_t *buffer, uint32_t max_frame, uint32_t *len,
	      char *why, size_t why_len)
{
	struct ring_area area = ring_requests(ring->base, ring->capacity);
	uint64_t tail = __atomic_load_n(&header_of(ring)->tail, __ATOMIC_ACQUIRE);
	const char *what;
	uint64_t bad[2];
	size_t frame_len;
	int rc = ring_entry_take(&area, &ring->head, tail, max_frame, buffer, &frame_len, &what,
				 bad);
	if (rc == 1) {
		*len = (uint32_t)(frame_len - FRAME_HEADER_BYTES);
		__atomic_store_n(&header_of(ring)->head, ring->head, __ATOMIC_RELEASE);
	} else if (rc < 0) {
		snprintf(why, why_len, "request ring: %s (%" PRIu64 ", %" PRIu64 ")", what, bad[0],
			 bad[1]);
	}
	return rc;
}

int ring_reply(struct ring *ring, const uint8_t *frame, size_t len, bool *nudge)
{
	struct ring_area area = ring_replies(ring->base, ring->capacity);
	struct ring_header *h = header_of(ring);
	*nudge = false;
	if (!ring_entry_fits(&area, len))
		return 0;
	/* The client's head, untrusted: a lie costs it its own replies. */
	uint64_t head = __atomic_load_n(&h->reply_head, __ATOMIC_ACQUIRE);
	if (ring_entry_put(&area, &ring->reply_tail, head, frame, len) != 1)
		return 0;
	*nudge = ring_tail_publish(&h->reply_tail, ring->reply_tail, &h->client_waiting);
	return 1;
}

bool ring_pending(const struct ring *ring)
{
	return __atomic_load_n(&header_of(ring)->tail, __ATOMIC_ACQUIRE) != ring->head;
}

bool ring_sleep(struct ring *ring)
{
	struct ring_header *h = header_of(ring);
	return ring_flag_sleep(&h->need_wakeup, &h->tail, ring->head);
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
	staging_uncharge(ring->memory, ring->quota, ring->mapped_bytes);
	free(ring);
}

void ring_close(struct ring *ring)
{
	if (ring)
		uv_close((uv_handle_t *)&ring->doorbell, on_closed);
}
