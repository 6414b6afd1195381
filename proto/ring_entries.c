/* Entries of a ring area: see ring_entries.h. */
#include "ring_entries.h"

#include <string.h>

#include "frame.h"
#include "zipcache/error.h"

int ring_entry_fits(const struct ring_area *area, size_t len)
{
	return area->data && len >= FRAME_HEADER_BYTES &&
	       len - FRAME_HEADER_BYTES <= UINT32_MAX - 2 * RING_ALIGN &&
	       ring_entry_bytes(len - FRAME_HEADER_BYTES) <= area->capacity / 2;
}

int ring_entry_put(const struct ring_area *area, uint64_t *tail, uint64_t head,
		   const uint8_t *frame, size_t len)
{
	uint64_t need = ring_entry_bytes(len - FRAME_HEADER_BYTES);
	uint64_t used = *tail - head;

	if (used > area->capacity)
		return ZC_EPROTOCOL;
	uint64_t offset = *tail % area->capacity;
	uint64_t to_end = area->capacity - offset;
	uint64_t skip = need <= to_end ? 0 : to_end;
	if (used + skip + need > area->capacity)
		return 0;
	if (skip) {
		uint32_t wrap = RING_WRAP;
		memcpy(area->data + offset, &wrap, sizeof(wrap));
		offset = 0;
	}
	memcpy(area->data + offset, frame, len);
	*tail += skip + need;
	return 1;
}

static int corrupt(const char **why, uint64_t bad[2], const char *what, uint64_t a, uint64_t b)
{
	*why = what;
	bad[0] = a;
	bad[1] = b;
	return ZC_EPROTOCOL;
}

int ring_entry_take(const struct ring_area *area, uint64_t *head, uint64_t tail,
		    uint32_t max_body, uint8_t *out, size_t *len, const char **why,
		    uint64_t bad[2])
{
	for (int wrapped = 0;;) {
		uint64_t available = tail - *head;
		if (available == 0)
			return 0;
		if (available > area->capacity)
			return corrupt(why, bad, "the tail is not within one lap of the head", tail,
				       *head);
		if (tail % RING_ALIGN)
			return corrupt(why, bad, "the tail is not aligned", tail, RING_ALIGN);
		uint64_t offset = *head % area->capacity;
		uint64_t to_end = area->capacity - offset;
		/* Read once: the writer may be rewriting it. */
		uint32_t raw = __atomic_load_n((const uint32_t *)(area->data + offset),
					       __ATOMIC_RELAXED);
		uint8_t bytes[FRAME_HEADER_BYTES];
		memcpy(bytes, &raw, sizeof(bytes));
		uint32_t body = frame_header_read(bytes);
		if (body == RING_WRAP) {
			if (offset == 0 || wrapped)
				return corrupt(why, bad, "a wrap mark at the start of the data", *head,
					       offset);
			if (to_end > available)
				return corrupt(why, bad, "a wrap mark past the tail", to_end, available);
			*head += to_end;
			wrapped = 1;
			continue;
		}
		if (body > max_body)
			return corrupt(why, bad, "an entry longer than a frame may be", body, max_body);
		uint64_t entry = ring_entry_bytes(body);
		if (entry > to_end)
			return corrupt(why, bad, "an entry that runs past the end of the data", entry,
				       to_end);
		if (entry > available)
			return corrupt(why, bad, "an entry cut by the tail", entry, available);
		/* The header as read, not as it may read now. */
		memcpy(out, bytes, FRAME_HEADER_BYTES);
		memcpy(out + FRAME_HEADER_BYTES, area->data + offset + FRAME_HEADER_BYTES, body);
		*head += entry;
		*len = FRAME_HEADER_BYTES + (size_t)body;
		return 1;
	}
}

bool ring_flag_sleep(uint32_t *flag, const uint64_t *tail, uint64_t seen)
{
	__atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(tail, __ATOMIC_SEQ_CST) == seen)
		return false;
	__atomic_store_n(flag, 0, __ATOMIC_RELAXED);
	return true;
}

bool ring_tail_publish(uint64_t *tail_field, uint64_t tail, const uint32_t *flag)
{
	__atomic_store_n(tail_field, tail, __ATOMIC_RELEASE);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	return __atomic_load_n(flag, __ATOMIC_RELAXED) != 0;
}
