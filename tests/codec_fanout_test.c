/*
 * server/codec_fanout.c: a block's codec work split by heads between
 * threads gives the bytes, the reconstruction and the error codes of one
 * call of the codec, for every thread count, batch and head count, keys
 * by norm and by caller's scores, values quantized and exact.
 */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../server/codec_fanout.h"
#include "suite_main.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 120

struct shape_case {
	uint32_t batch, heads, tokens, dim;
};

/* Every case is above CODEC_FANOUT_MIN_ELEMENTS but the last, which stays
 * on one thread whatever the setting. */
static const struct shape_case shapes[] = {
	{ 1, 8, 512, 128 },   /* 2^19 elements: the threshold itself */
	{ 2, 3, 1024, 128 },  /* parts cross batch entries */
	{ 1, 5, 1200, 96 },   /* heads not a multiple of the threads */
	{ 1, 2, 4096, 64 },   /* fewer heads than threads */
	{ 2, 1, 2048, 128 },
	{ 1, 4, 100, 32 },    /* below the threshold */
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rng(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state >> 16);
}

/* A sink copying into a buffer of the block's size, counting its calls
 * and bytes; it refuses the call numbered fail_at (0: none) with -EIO. */
struct copy_sink {
	uint8_t *bytes;
	size_t size, written;
	unsigned calls, fail_at;
	pthread_mutex_t lock;
};

static int copy_sink_write(void *ctx, uint64_t at, const void *bytes, size_t n)
{
	struct copy_sink *c = ctx;
	pthread_mutex_lock(&c->lock);
	unsigned call = ++c->calls;
	bool ok = at + n <= c->size && call != c->fail_at;
	if (ok)
		c->written += n;
	pthread_mutex_unlock(&c->lock);
	if (!ok)
		return -EIO;
	memcpy(c->bytes + at, bytes, n);
	return 0;
}

/* K/V-like rows: most channels small, a few outliers, some loud tokens. */
static uint16_t *rows_make(size_t n, uint32_t dim)
{
	uint16_t *out = malloc(n * 2);
	ck_assert_ptr_nonnull(out);
	for (size_t i = 0; i < n; i++) {
		float v = ((float)(rng() % 20001) - 10000.0f) / 5000.0f;
		if (i % dim == 3)
			v *= 12.0f;
		if ((i / dim) % 37 == 0)
			v *= 4.0f;
		out[i] = zc_float_to_fp16(v);
	}
	return out;
}

/* Rows between batch entries that belong to neither (a caller's strides
 * need not be packed): a part must not run across entries. */
#define BATCH_GAP_ROWS 64u

/* Input strides [B][H][S][D], the batch entries apart by the gap. */
static zc_strides input_strides(const struct shape_case *s)
{
	return (zc_strides){ ((size_t)s->heads * s->tokens + BATCH_GAP_ROWS) * s->dim,
			     (size_t)s->tokens * s->dim, s->dim };
}

/* A view with room past the block: [B][H][2S][D] (entries apart by the
 * gap), the block at row S/2. */
static zc_strides view_strides(const struct shape_case *s)
{
	size_t rows = 2u * s->tokens;
	return (zc_strides){ ((size_t)s->heads * rows + BATCH_GAP_ROWS) * s->dim, rows * s->dim,
			     s->dim };
}

static void one_case(const zc_codec_config *config, zc_tensor tensor, const struct shape_case *s,
		     bool scored)
{
	zc_block_shape shape = { s->batch, s->heads, s->tokens, s->dim };
	zc_strides in = input_strides(s);
	zc_strides vs = view_strides(s);
	uint16_t *input = rows_make(s->batch * in.batch, s->dim);
	float *scores = NULL;
	if (scored) {
		size_t n = (size_t)s->batch * s->heads * s->tokens;
		scores = malloc(n * sizeof(float));
		ck_assert_ptr_nonnull(scores);
		for (size_t i = 0; i < n; i++)
			scores[i] = (float)(rng() % 1000) / 7.0f;
	}
	zc_byte_count count;
	ck_assert_int_eq(zc_block_count_bytes(config, tensor, &shape, &count), 0);
	size_t view_elements = s->batch * vs.batch;
	size_t at = (size_t)(s->tokens / 2) * s->dim;

	uint8_t *want = malloc(count.compressed);
	uint16_t *want_view = calloc(view_elements, 2);
	ck_assert_ptr_nonnull(want);
	ck_assert_ptr_nonnull(want_view);
	int64_t n = scored ? zc_block_compress_scored_strided(config, &shape, input, &in, scores,
							       want, count.compressed) :
			     zc_block_compress_strided(config, tensor, &shape, input, &in, want,
						       count.compressed);
	ck_assert_int_eq(n, (int64_t)count.compressed);
	ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape, want, count.compressed,
					      want_view + at, &vs),
			 0);

	uint8_t *got = malloc(count.compressed);
	uint16_t *got_view = malloc(view_elements * 2);
	ck_assert_ptr_nonnull(got);
	ck_assert_ptr_nonnull(got_view);
	for (unsigned threads = 1; threads <= 5; threads++) {
		ck_assert_uint_eq(codec_fanout_set_threads(threads), threads);
		memset(got, 0xa5, count.compressed);
		memset(got_view, 0, view_elements * 2);
		n = codec_fanout_compress(config, tensor, &shape, input, &in, scored ? scores : NULL,
					  got, count.compressed, NULL);
		ck_assert_int_eq(n, (int64_t)count.compressed);
		ck_assert_mem_eq(got, want, count.compressed);
		ck_assert_int_eq(codec_fanout_reconstruct(config, tensor, &shape, got,
							  count.compressed, got_view + at, &vs),
				 0);
		/* Rows around the block untouched, the block's as one call's. */
		ck_assert_mem_eq(got_view, want_view, view_elements * 2);

		/* Through a sink: every byte handed on once, as one call's; a
		 * sink's error is the call's. */
		struct copy_sink sink_copy = { .bytes = malloc(count.compressed),
					       .size = count.compressed };
		ck_assert_ptr_nonnull(sink_copy.bytes);
		pthread_mutex_init(&sink_copy.lock, NULL);
		const struct codec_sink sink = { copy_sink_write, &sink_copy };
		n = codec_fanout_compress(config, tensor, &shape, input, &in, scored ? scores : NULL,
					  got, count.compressed, &sink);
		ck_assert_int_eq(n, (int64_t)count.compressed);
		ck_assert_uint_eq(sink_copy.written, count.compressed);
		ck_assert_mem_eq(sink_copy.bytes, want, count.compressed);
		unsigned calls = sink_copy.calls;
		sink_copy.calls = 0;
		sink_copy.fail_at = calls;
		ck_assert_int_eq(codec_fanout_compress(config, tensor, &shape, input, &in,
						       scored ? scores : NULL, got, count.compressed,
						       &sink),
				 -EIO);
		pthread_mutex_destroy(&sink_copy.lock);
		free(sink_copy.bytes);
	}
	free(got);
	free(got_view);
	free(want);
	free(want_view);
	free(scores);
	free(input);
}

START_TEST(split_by_heads_is_one_call)
{
	zc_codec_config config;
	zc_codec_config_default(&config);
	zc_codec_config exact_values = config;
	exact_values.quantize_values = false;
	zc_codec_config narrow = config;
	narrow.hi_bits = 3;
	narrow.lo_bits = 1;
	narrow.group_size = 16;
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
		one_case(&config, ZC_TENSOR_KEYS, &shapes[i], false);
		one_case(&config, ZC_TENSOR_KEYS, &shapes[i], true);
		one_case(&config, ZC_TENSOR_VALUES, &shapes[i], false);
		one_case(&exact_values, ZC_TENSOR_VALUES, &shapes[i], false);
		one_case(&narrow, ZC_TENSOR_KEYS, &shapes[i], false);
	}
	codec_fanout_set_threads(1);
}
END_TEST

/* The error of one call, whichever part meets it. */
START_TEST(errors_are_one_calls)
{
	zc_codec_config config;
	zc_codec_config_default(&config);
	const struct shape_case s = { 2, 3, 1024, 128 };
	zc_block_shape shape = { s.batch, s.heads, s.tokens, s.dim };
	zc_strides in = input_strides(&s);
	size_t elements = s.batch * in.batch;
	uint16_t *input = rows_make(elements, s.dim);
	zc_byte_count count;
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_KEYS, &shape, &count), 0);
	uint8_t *out = malloc(count.compressed);
	ck_assert_ptr_nonnull(out);
	codec_fanout_set_threads(4);

	/* Too small a buffer. */
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &in, NULL,
					       out, count.compressed - 1, NULL),
			 ZC_EBUFFER);
	/* A NaN in the last head only, then in the first. */
	size_t last = (s.batch - 1) * in.batch + (size_t)s.heads * s.tokens * s.dim - 5, first = 7;
	input[last] = 0x7e00;
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &in, NULL,
					       out, count.compressed, NULL),
			 zc_block_compress_strided(&config, ZC_TENSOR_KEYS, &shape, input, &in, out,
						   count.compressed));
	ck_assert_int_lt(codec_fanout_compress(&config, ZC_TENSOR_VALUES, &shape, input, &in, NULL,
					       out, count.compressed, NULL),
			 0);
	input[last] = 0;
	input[first] = 0x7c00;
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &in, NULL,
					       out, count.compressed, NULL),
			 zc_block_compress_strided(&config, ZC_TENSOR_KEYS, &shape, input, &in, out,
						   count.compressed));
	input[first] = 0;
	/* A negative score. */
	size_t n_scores = (size_t)s.batch * s.heads * s.tokens;
	float *scores = calloc(n_scores, sizeof(float));
	ck_assert_ptr_nonnull(scores);
	scores[n_scores - 1] = -1.0f;
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &in, scores,
					       out, count.compressed, NULL),
			 ZC_EINVALID);
	free(scores);
	/* Strides that are not rows of D: refused as one call refuses them. */
	zc_strides odd = in;
	odd.token = s.dim + 1;
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &odd, NULL,
					       out, count.compressed, NULL),
			 zc_block_compress_strided(&config, ZC_TENSOR_KEYS, &shape, input, &odd, out,
						   count.compressed));

	/* Reconstruction: a wrong size, then a mask with a bit too many in
	 * the last head. */
	ck_assert_int_eq(codec_fanout_compress(&config, ZC_TENSOR_KEYS, &shape, input, &in, NULL,
					       out, count.compressed, NULL),
			 (int64_t)count.compressed);
	uint16_t *view = malloc(elements * 2);
	ck_assert_ptr_nonnull(view);
	ck_assert_int_eq(codec_fanout_reconstruct(&config, ZC_TENSOR_KEYS, &shape, out,
						  count.compressed - 1, view, &in),
			 ZC_ECORRUPT);
	zc_block_layout layout;
	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_KEYS, &shape, &layout), 0);
	uint8_t *mask = out + (layout.heads - 1) * layout.head_bytes + layout.mask_offset;
	for (size_t i = 0; i < layout.mask_bytes; i++)
		mask[i] = 0xff;
	ck_assert_int_eq(codec_fanout_reconstruct(&config, ZC_TENSOR_KEYS, &shape, out,
						  count.compressed, view, &in),
			 ZC_ECORRUPT);
	codec_fanout_set_threads(1);
	free(view);
	free(out);
	free(input);
}
END_TEST

START_TEST(thread_count_is_bounded)
{
	ck_assert_uint_ge(codec_fanout_set_threads(0), 1);
	ck_assert_uint_le(codec_fanout_threads(), 8);
	ck_assert_uint_eq(codec_fanout_set_threads(1000), CODEC_FANOUT_MAX_THREADS);
	ck_assert_uint_eq(codec_fanout_set_threads(3), 3);
	ck_assert_uint_eq(codec_fanout_threads(), 3);
	codec_fanout_set_threads(1);
}
END_TEST

static Suite *fanout_suite(void)
{
	Suite *suite = suite_create("codec_fanout");
	const struct test_case cases[] = {
		{ "identity", { split_by_heads_is_one_call, NULL } },
		{ "errors", { errors_are_one_calls, thread_count_is_bounded, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	zc_codec_init();
	return suite_main(fanout_suite(), CK_FORK_GETENV);
}
