/*
 * Frame reader: no sockets, only bytes handed in every way a socket could
 * hand them (one at a time, split anywhere, many frames at once).
 */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* A byte stream of frames, built by the tests and checked against. */
struct stream {
	uint8_t *bytes;
	size_t len;
	size_t n_frames;
	size_t offsets[4096]; /* body offset of each frame in bytes */
	size_t lens[4096];
};

/* Deterministic bytes so a misplaced frame never matches by accident. */
static uint8_t body_byte(size_t frame, size_t i)
{
	return (uint8_t)(frame * 131 + i * 7 + 3);
}

static void stream_add(struct stream *st, size_t body_len)
{
	size_t f = st->n_frames++;

	ck_assert_uint_lt(f, 4096);
	st->bytes = realloc(st->bytes, st->len + FRAME_HEADER_BYTES + body_len);
	ck_assert_ptr_nonnull(st->bytes);
	frame_header_write(st->bytes + st->len, (uint32_t)body_len);
	st->len += FRAME_HEADER_BYTES;
	st->offsets[f] = st->len;
	st->lens[f] = body_len;
	for (size_t i = 0; i < body_len; i++)
		st->bytes[st->len + i] = body_byte(f, i);
	st->len += body_len;
}

static struct stream *stream_new(void)
{
	struct stream *st = calloc(1, sizeof(*st));

	ck_assert_ptr_nonnull(st);
	return st;
}

static void stream_free(struct stream *st)
{
	free(st->bytes);
	free(st);
}

/* Takes every complete frame out of r, checking each against st. */
static void drain(frame_reader *r, const struct stream *st, size_t *next_frame)
{
	const uint8_t *frame;
	size_t len;
	int rc;

	while ((rc = frame_reader_next(r, &frame, &len)) == 1) {
		size_t f = (*next_frame)++;

		ck_assert_uint_lt(f, st->n_frames);
		ck_assert_uint_eq(len, st->lens[f]);
		if (len > 0)
			ck_assert_mem_eq(frame, st->bytes + st->offsets[f], len);
		frame_reader_consume(r);
	}
	ck_assert_int_eq(rc, 0);
}

/* Reads st into r through the zero-copy API, at most chunk bytes a read. */
static void read_in_chunks(frame_reader *r, const struct stream *st, size_t chunk,
			   size_t max_cap)
{
	size_t pos = 0, next_frame = 0;

	while (pos < st->len) {
		uint8_t *buf;
		size_t room, n;

		ck_assert_int_eq(frame_reader_buffer(r, &buf, &room), 0);
		ck_assert_uint_gt(room, 0);
		n = st->len - pos;
		if (n > chunk)
			n = chunk;
		if (n > room)
			n = room;
		memcpy(buf, st->bytes + pos, n);
		frame_reader_commit(r, n);
		pos += n;
		ck_assert_uint_le(r->cap, max_cap);
		drain(r, st, &next_frame);
	}
	ck_assert_uint_eq(next_frame, st->n_frames);
	ck_assert_uint_eq(frame_reader_buffered(r), 0);
}

START_TEST(header_is_little_endian)
{
	uint8_t h[4];

	frame_header_write(h, 0x01020304u);
	ck_assert_uint_eq(h[0], 0x04);
	ck_assert_uint_eq(h[1], 0x03);
	ck_assert_uint_eq(h[2], 0x02);
	ck_assert_uint_eq(h[3], 0x01);
	ck_assert_uint_eq(frame_header_read(h), 0x01020304u);
	frame_header_write(h, 0xffffffffu);
	ck_assert_uint_eq(frame_header_read(h), 0xffffffffu);
}
END_TEST

START_TEST(empty_reader_needs_bytes)
{
	frame_reader r;
	const uint8_t *frame;
	size_t len;

	frame_reader_init(&r, 1024);
	ck_assert_ptr_null(r.buf);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
	frame_reader_consume(&r); /* nothing returned: a no-op */
	ck_assert_uint_eq(frame_reader_buffered(&r), 0);
	frame_reader_free(&r);
	frame_reader_free(&r); /* twice is harmless */
}
END_TEST

START_TEST(byte_at_a_time_feed)
{
	static const size_t sizes[] = { 0, 1, 5, 0, 300, 4, 20000, 3, 0 };
	struct stream *st = stream_new();
	frame_reader r;
	size_t next_frame = 0;

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		stream_add(st, sizes[i]);
	frame_reader_init(&r, 1 << 20);
	for (size_t i = 0; i < st->len; i++) {
		ck_assert_int_eq(frame_reader_feed(&r, st->bytes + i, 1), 0);
		drain(&r, st, &next_frame);
	}
	ck_assert_uint_eq(next_frame, st->n_frames);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(byte_at_a_time_buffer)
{
	static const size_t sizes[] = { 0, 1, 5, 0, 300, 4, 20000, 3, 0 };
	struct stream *st = stream_new();
	frame_reader r;

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		stream_add(st, sizes[i]);
	frame_reader_init(&r, 1 << 20);
	read_in_chunks(&r, st, 1, (1 << 20) + 4);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

/* Every read size from 1 to 41 bytes puts the cuts at every offset. */
START_TEST(split_at_every_boundary)
{
	struct stream *st = stream_new();

	for (size_t i = 0; i < 40; i++)
		stream_add(st, (i * 37) % 23);
	for (size_t chunk = 1; chunk <= 41; chunk++) {
		frame_reader r;

		frame_reader_init(&r, 64);
		read_in_chunks(&r, st, chunk, 64 + 4);
		frame_reader_free(&r);
	}
	stream_free(st);
}
END_TEST

START_TEST(split_header)
{
	uint8_t bytes[4 + 3];
	frame_reader r;
	const uint8_t *frame;
	size_t len;

	frame_header_write(bytes, 3);
	memcpy(bytes + 4, "abc", 3);
	frame_reader_init(&r, 16);
	for (size_t i = 0; i < 4; i++) {
		ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
		ck_assert_int_eq(frame_reader_feed(&r, bytes + i, 1), 0);
	}
	/* Header complete, body missing. */
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
	ck_assert_int_eq(frame_reader_feed(&r, bytes + 4, 2), 0);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
	ck_assert_int_eq(frame_reader_feed(&r, bytes + 6, 1), 0);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 1);
	ck_assert_uint_eq(len, 3);
	ck_assert_mem_eq(frame, "abc", 3);
	frame_reader_free(&r);
}
END_TEST

START_TEST(many_frames_in_one_read)
{
	struct stream *st = stream_new();
	frame_reader r;
	uint8_t *buf;
	size_t room, next_frame = 0;

	for (size_t i = 0; i < 1000; i++)
		stream_add(st, i % 9);
	ck_assert_uint_lt(st->len, 16 * 1024); /* fits one read-ahead */
	frame_reader_init(&r, 1 << 20);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_ge(room, st->len);
	memcpy(buf, st->bytes, st->len);
	frame_reader_commit(&r, st->len);
	drain(&r, st, &next_frame);
	ck_assert_uint_eq(next_frame, 1000);
	/* Fully drained: back to the front, no memmove needed. */
	ck_assert_uint_eq(r.start, 0);
	ck_assert_uint_eq(r.end, 0);
	frame_reader_free(&r);

	/* The same through one feed. */
	next_frame = 0;
	frame_reader_init(&r, 1 << 20);
	ck_assert_int_eq(frame_reader_feed(&r, st->bytes, st->len), 0);
	drain(&r, st, &next_frame);
	ck_assert_uint_eq(next_frame, 1000);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(next_is_idempotent_until_consume)
{
	struct stream *st = stream_new();
	frame_reader r;
	const uint8_t *f1, *f2;
	size_t l1, l2;

	stream_add(st, 10);
	stream_add(st, 20);
	frame_reader_init(&r, 100);
	ck_assert_int_eq(frame_reader_feed(&r, st->bytes, st->len), 0);
	ck_assert_int_eq(frame_reader_next(&r, &f1, &l1), 1);
	ck_assert_int_eq(frame_reader_next(&r, &f2, &l2), 1);
	ck_assert_ptr_eq(f1, f2);
	ck_assert_uint_eq(l1, 10);
	ck_assert_uint_eq(l2, 10);
	frame_reader_consume(&r);
	ck_assert_int_eq(frame_reader_next(&r, &f2, &l2), 1);
	ck_assert_uint_eq(l2, 20);
	ck_assert_ptr_eq(f2, f1 + 10 + FRAME_HEADER_BYTES);
	frame_reader_consume(&r);
	frame_reader_consume(&r); /* no frame pending: no-op */
	ck_assert_int_eq(frame_reader_next(&r, &f2, &l2), 0);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(exact_max_accepted)
{
	struct stream *st = stream_new();
	frame_reader r;

	stream_add(st, 100);
	stream_add(st, 0);
	stream_add(st, 100);
	frame_reader_init(&r, 100);
	read_in_chunks(&r, st, 7, 104);
	frame_reader_free(&r);

	/* In one read: the first frame fills the whole budget. */
	frame_reader_init(&r, 100);
	read_in_chunks(&r, st, st->len, 104);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(max_plus_one_rejected_and_sticky)
{
	uint8_t bytes[4 + 101] = { 0 };
	frame_reader r;
	const uint8_t *frame;
	uint8_t *buf;
	size_t len;

	frame_header_write(bytes, 101);
	frame_reader_init(&r, 100);
	ck_assert_int_eq(frame_reader_feed(&r, bytes, 3), 0);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
	ck_assert_int_eq(frame_reader_feed(&r, bytes + 3, 1), 0);
	/* Refused on the header alone, before the body arrives. */
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &len), ZC_EFRAMESIZE);
	ck_assert_int_eq(frame_reader_feed(&r, bytes + 4, 101), ZC_EFRAMESIZE);
	frame_reader_free(&r);

	/* Found by frame_reader_buffer() first, on the zero-copy path. */
	frame_reader_init(&r, 100);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &len), 0);
	memcpy(buf, bytes, 4);
	frame_reader_commit(&r, 4);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &len), ZC_EFRAMESIZE);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	frame_reader_free(&r);
}
END_TEST

/* A good frame before the bad one is still delivered. */
START_TEST(oversized_after_good_frame)
{
	struct stream *st = stream_new();
	frame_reader r;
	const uint8_t *frame;
	size_t len;

	stream_add(st, 5);
	stream_add(st, 51);
	frame_reader_init(&r, 50);
	ck_assert_int_eq(frame_reader_feed(&r, st->bytes, st->len), 0);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 1);
	ck_assert_uint_eq(len, 5);
	frame_reader_consume(&r);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(zero_length_frames)
{
	uint8_t bytes[12];
	frame_reader r;
	const uint8_t *frame = NULL;
	size_t len = 99;

	frame_header_write(bytes, 0);
	frame_header_write(bytes + 4, 0);
	frame_header_write(bytes + 8, 0);
	frame_reader_init(&r, 0); /* only empty frames allowed */
	ck_assert_int_eq(frame_reader_feed(&r, bytes, sizeof(bytes)), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 1);
		ck_assert_uint_eq(len, 0);
		ck_assert_ptr_nonnull(frame);
		frame_reader_consume(&r);
	}
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 0);
	frame_reader_free(&r);
}
END_TEST

START_TEST(huge_declared_length_not_allocated)
{
	frame_reader r;
	const uint8_t *frame;
	uint8_t *buf;
	size_t room, len;

	frame_reader_init(&r, 16u << 20);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_le(r.cap, 64 * 1024);
	memcpy(buf, "\xff\xff\xff\xff", 4);
	frame_reader_commit(&r, 4);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), ZC_EFRAMESIZE);
	ck_assert_uint_le(r.cap, 64 * 1024);
	frame_reader_free(&r);

	/* Same through feed: nothing is sized from the header. */
	frame_reader_init(&r, 16u << 20);
	ck_assert_int_eq(frame_reader_feed(&r, "\xff\xff\xff\xff", 4), 0);
	ck_assert_uint_le(r.cap, 64);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), ZC_EFRAMESIZE);
	frame_reader_free(&r);
}
END_TEST

/*
 * Growth: the reader starts with a read-ahead's worth and grows to exactly
 * what a larger frame needs, never to max + 4 before a frame asks for it.
 */
START_TEST(buffer_grows_only_as_needed)
{
	const uint32_t max = 1u << 20;
	struct stream *st = stream_new();
	frame_reader r;
	uint8_t *buf;
	size_t room;

	frame_reader_init(&r, max);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(r.cap, 16 * 1024);
	ck_assert_uint_eq(room, 16 * 1024);

	stream_add(st, 100000);
	memcpy(buf, st->bytes, 10);
	frame_reader_commit(&r, 10);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(r.cap, 100004);
	ck_assert_uint_eq(room, 100004 - 10);
	memcpy(buf, st->bytes + 10, st->len - 10);
	frame_reader_commit(&r, st->len - 10);
	{
		size_t next_frame = 0;

		drain(&r, st, &next_frame);
		ck_assert_uint_eq(next_frame, 1);
	}
	/* Small frames afterwards reuse it; no shrink, no regrowth. */
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(r.cap, 100004);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

/* Compaction: a partial frame left behind consumed ones moves to the front. */
START_TEST(compaction_moves_partial_frame_to_front)
{
	struct stream *st = stream_new();
	frame_reader r;
	uint8_t *buf;
	size_t room, next_frame = 0;
	size_t first_part;

	/* Frames of 396 + 4 bytes. */
	for (size_t i = 0; i < 41; i++)
		stream_add(st, 396);
	frame_reader_init(&r, 4096);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(room, 4100); /* read-ahead is capped by max + 4 */
	frame_reader_free(&r);

	frame_reader_init(&r, 1 << 20);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(room, 16384);
	/* 40 whole frames and 284 bytes of the 41st; the tail has 100 left. */
	first_part = 16384 - 100;
	memcpy(buf, st->bytes, first_part);
	frame_reader_commit(&r, first_part);
	drain(&r, st, &next_frame);
	ck_assert_uint_eq(next_frame, 40);
	ck_assert_uint_eq(frame_reader_buffered(&r), 284);
	ck_assert_uint_eq(r.start, 40 * 400);

	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(r.start, 0); /* compacted, not grown */
	ck_assert_uint_eq(r.end, 284);
	ck_assert_uint_eq(r.cap, 16384);
	ck_assert_ptr_eq(buf, r.buf + 284);
	memcpy(buf, st->bytes + first_part, st->len - first_part);
	frame_reader_commit(&r, st->len - first_part);
	drain(&r, st, &next_frame);
	ck_assert_uint_eq(next_frame, 41);
	frame_reader_free(&r);
	stream_free(st);
}
END_TEST

START_TEST(undrained_full_budget_is_enobufs)
{
	uint8_t bytes[12] = { 0 };
	frame_reader r;
	uint8_t *buf;
	const uint8_t *frame;
	size_t room, len;

	frame_header_write(bytes, 8);
	frame_reader_init(&r, 8);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(room, 12);
	memcpy(buf, bytes, 12);
	frame_reader_commit(&r, 12);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), -ENOBUFS);
	ck_assert_int_eq(frame_reader_next(&r, &frame, &len), 1);
	frame_reader_consume(&r);
	ck_assert_int_eq(frame_reader_buffer(&r, &buf, &room), 0);
	ck_assert_uint_eq(room, 12);
	frame_reader_free(&r);
}
END_TEST

/* Random frame sizes and read sizes; the cap never passes max + 4. */
START_TEST(random_streams)
{
	uint32_t seed = 12345;

	for (int round = 0; round < 50; round++) {
		struct stream *st = stream_new();
		frame_reader r;
		size_t max = 1 + round * 97, chunk;

		for (int i = 0; i < 200; i++) {
			seed = seed * 1103515245u + 12345u;
			stream_add(st, (seed >> 8) % (max + 1));
		}
		seed = seed * 1103515245u + 12345u;
		chunk = 1 + (seed >> 8) % (3 * max + 64);
		frame_reader_init(&r, (uint32_t)max);
		read_in_chunks(&r, st, chunk, max + 4);
		frame_reader_free(&r);
		stream_free(st);
	}
}
END_TEST

static Suite *frame_suite(void)
{
	Suite *s = suite_create("frame");
	TCase *tc = tcase_create("reader");

	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, header_is_little_endian);
	tcase_add_test(tc, empty_reader_needs_bytes);
	tcase_add_test(tc, byte_at_a_time_feed);
	tcase_add_test(tc, byte_at_a_time_buffer);
	tcase_add_test(tc, split_at_every_boundary);
	tcase_add_test(tc, split_header);
	tcase_add_test(tc, many_frames_in_one_read);
	tcase_add_test(tc, next_is_idempotent_until_consume);
	tcase_add_test(tc, exact_max_accepted);
	tcase_add_test(tc, max_plus_one_rejected_and_sticky);
	tcase_add_test(tc, oversized_after_good_frame);
	tcase_add_test(tc, zero_length_frames);
	tcase_add_test(tc, huge_declared_length_not_allocated);
	tcase_add_test(tc, buffer_grows_only_as_needed);
	tcase_add_test(tc, compaction_moves_partial_frame_to_front);
	tcase_add_test(tc, undrained_full_budget_is_enobufs);
	tcase_add_test(tc, random_streams);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return suite_main(frame_suite(), CK_FORK_GETENV);
}
