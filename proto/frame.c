/*
 * I/O-free frame reader: see frame.h for the contract.
 *
 * Layout of the buffer:
 *
 *	buf                start              end                cap
 *	 | consumed, dead   | unconsumed bytes  | free tail, lent  |
 *
 * Bytes are appended at end and frames are taken from start. Dead bytes
 * are reclaimed lazily, by one memmove of the unconsumed bytes to the
 * front, only when the free tail is too short for what is wanted next:
 * with many small pipelined frames per read that is rare, and a frame
 * already in hand never has to be moved while it is being handled.
 */
#include "frame.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zipcache/error.h"

/*
 * Room lent for a read when no frame length is known yet: enough for a few
 * hundred pipelined small requests per read() without growing per frame,
 * and small next to a typical max_frame_bytes (megabytes).
 */
#define FRAME_READ_AHEAD (16 * 1024)

void frame_header_write(uint8_t out[FRAME_HEADER_BYTES], uint32_t len)
{
	out[0] = (uint8_t)len;
	out[1] = (uint8_t)(len >> 8);
	out[2] = (uint8_t)(len >> 16);
	out[3] = (uint8_t)(len >> 24);
}

uint32_t frame_header_read(const uint8_t in[FRAME_HEADER_BYTES])
{
	return (uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 |
	       (uint32_t)in[3] << 24;
}

void frame_reader_init(frame_reader *r, uint32_t max_frame_bytes)
{
	memset(r, 0, sizeof(*r));
	r->max_frame = max_frame_bytes;
}

void frame_reader_free(frame_reader *r)
{
	free(r->buf);
	memset(r, 0, sizeof(*r));
}

size_t frame_reader_buffered(const frame_reader *r)
{
	return r->end - r->start;
}

/*
 * Size (header + body) of the frame at start, once its header is complete:
 * returns 1 with *total set, 0 while the header is still partial, or the
 * sticky ZC_EFRAMESIZE. The check happens here, on the header alone, so an
 * oversized frame is refused before a byte of room is reserved for it.
 */
static int head_frame_size(frame_reader *r, size_t *total)
{
	uint32_t len;

	if (r->end - r->start < FRAME_HEADER_BYTES)
		return 0;
	len = frame_header_read(r->buf + r->start);
	if (len > r->max_frame) {
		r->error = ZC_EFRAMESIZE;
		return r->error;
	}
	*total = FRAME_HEADER_BYTES + (size_t)len;
	return 1;
}

/* Moves the unconsumed bytes to the front of the buffer. */
static void compact(frame_reader *r)
{
	size_t used = r->end - r->start;

	if (r->start == 0)
		return;
	if (used > 0)
		memmove(r->buf, r->buf + r->start, used);
	r->start = 0;
	r->end = used;
}

/* Reallocates the buffer to exactly new_cap bytes (new_cap >= end). */
static int grow(frame_reader *r, size_t new_cap)
{
	uint8_t *p = realloc(r->buf, new_cap);

	if (p == NULL)
		return -ENOMEM;
	r->buf = p;
	r->cap = new_cap;
	return 0;
}

int frame_reader_buffer(frame_reader *r, uint8_t **buf, size_t *len)
{
	size_t limit = (size_t)r->max_frame + FRAME_HEADER_BYTES;
	size_t used, required, wanted, total = 0;
	int rc;

	if (r->error)
		return r->error;
	used = r->end - r->start;
	rc = head_frame_size(r, &total);
	if (rc < 0)
		return rc;

	/*
	 * required: room without which no progress is possible, the rest of
	 * the frame in hand (or of its header). wanted: read-ahead for the
	 * frames behind it, within the budget; worth a memmove, not a realloc.
	 */
	if (rc == 1)
		required = total > used ? total - used : 0;
	else
		required = FRAME_HEADER_BYTES - used;
	wanted = limit > used ? limit - used : 0;
	if (wanted > FRAME_READ_AHEAD)
		wanted = FRAME_READ_AHEAD;
	if (wanted < required)
		wanted = required;

	if (r->cap - r->end < wanted || r->end == r->cap)
		compact(r);
	if (r->cap == 0 || r->cap - r->end < required) {
		/* First use: room for the read-ahead; later: just the frame. */
		rc = grow(r, r->end + (r->cap == 0 ? wanted : required));
		if (rc < 0)
			return rc;
	}
	/* Only when a whole unconsumed frame fills the budget. */
	if (r->end == r->cap)
		return -ENOBUFS;
	*buf = r->buf + r->end;
	*len = r->cap - r->end;
	return 0;
}

void frame_reader_commit(frame_reader *r, size_t n)
{
	/* NEVER: a caller cannot have read more than it was lent. */
	if (n > r->cap - r->end)
		n = r->cap - r->end;
	r->end += n;
}

int frame_reader_feed(frame_reader *r, const void *data, size_t len)
{
	int rc;

	if (r->error)
		return r->error;
	if (len == 0)
		return 0;
	if (r->cap - r->end < len)
		compact(r);
	if (r->cap - r->end < len) {
		/* Doubling keeps byte-at-a-time feeding at O(log n) reallocs. */
		size_t new_cap = r->end + len;

		if (new_cap < r->end)
			return -ENOMEM;
		if (new_cap < r->cap * 2)
			new_cap = r->cap * 2;
		rc = grow(r, new_cap);
		if (rc < 0)
			return rc;
	}
	memcpy(r->buf + r->end, data, len);
	r->end += len;
	return 0;
}

int frame_reader_next(frame_reader *r, const uint8_t **frame, size_t *len)
{
	size_t total = 0;
	int rc;

	if (r->error)
		return r->error;
	rc = head_frame_size(r, &total);
	if (rc <= 0)
		return rc;
	if (r->end - r->start < total)
		return 0;
	*frame = r->buf + r->start + FRAME_HEADER_BYTES;
	*len = total - FRAME_HEADER_BYTES;
	r->pending = total;
	return 1;
}

void frame_reader_consume(frame_reader *r)
{
	if (r->pending == 0)
		return;
	r->start += r->pending;
	r->pending = 0;
	/* Empty again: start over at the front for free, no memmove needed. */
	if (r->start == r->end)
		r->start = r->end = 0;
}
