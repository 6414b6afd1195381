/*
 * server/codec_fanout.c: a block's codec work split by heads between
 * threads gives the bytes, the reconstruction and the error codes of one
 * call of the codec, for every thread count, batch and head count, keys
 * by norm and by caller's scores, values quantized and exact; a block's
 * keys and values in one go give what the calls in turn give; the helper
 * threads kept between calls give the same, call after call, with callers
 * at once, after a stop, and in a forked child.
 */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* A block's keys and values through one call of the block functions give
 * each tensor's bytes and reconstruction as the codec's own calls, for
 * every thread count, also when only one of them is large enough for the
 * threads (values of a smaller head dim). */
static void pair_case(const zc_codec_config *config, const struct shape_case *s,
		      uint32_t value_dim)
{
	const struct shape_case vs_case = { s->batch, s->heads, s->tokens, value_dim };
	const struct shape_case *cases[2] = { s, &vs_case };
	const zc_tensor tensors[2] = { ZC_TENSOR_KEYS, ZC_TENSOR_VALUES };
	zc_block_shape shape[2];
	zc_strides in[2], vs[2];
	uint16_t *input[2], *want_view[2], *got_view[2];
	uint8_t *want[2], *got[2];
	zc_byte_count count[2];
	size_t view_elements[2], at[2];
	for (int t = 0; t < 2; t++) {
		const struct shape_case *c = cases[t];
		shape[t] = (zc_block_shape){ c->batch, c->heads, c->tokens, c->dim };
		in[t] = input_strides(c);
		vs[t] = view_strides(c);
		input[t] = rows_make(c->batch * in[t].batch, c->dim);
		ck_assert_int_eq(zc_block_count_bytes(config, tensors[t], &shape[t], &count[t]), 0);
		view_elements[t] = c->batch * vs[t].batch;
		at[t] = (size_t)(c->tokens / 2) * c->dim;
		want[t] = malloc(count[t].compressed);
		got[t] = malloc(count[t].compressed);
		want_view[t] = calloc(view_elements[t], 2);
		got_view[t] = malloc(view_elements[t] * 2);
		ck_assert(want[t] && got[t] && want_view[t] && got_view[t]);
		ck_assert_int_eq(zc_block_compress_strided(config, tensors[t], &shape[t], input[t],
							   &in[t], want[t], count[t].compressed),
				 (int64_t)count[t].compressed);
		ck_assert_int_eq(zc_block_reconstruct(config, tensors[t], &shape[t], want[t],
						      count[t].compressed, want_view[t] + at[t],
						      &vs[t]),
				 0);
	}
	for (unsigned threads = 1; threads <= 5; threads++) {
		codec_fanout_set_threads(threads);
		struct copy_sink sinks[2];
		struct codec_sink sink[2];
		struct codec_fanout_tensor pair[2];
		struct codec_fanout_view views[2];
		for (int t = 0; t < 2; t++) {
			memset(got[t], 0xa5, count[t].compressed);
			memset(got_view[t], 0, view_elements[t] * 2);
			sinks[t] = (struct copy_sink){ .bytes = malloc(count[t].compressed),
						       .size = count[t].compressed };
			ck_assert_ptr_nonnull(sinks[t].bytes);
			pthread_mutex_init(&sinks[t].lock, NULL);
			sink[t] = (struct codec_sink){ copy_sink_write, &sinks[t] };
			pair[t] = (struct codec_fanout_tensor){ tensors[t], shape[t], input[t], &in[t],
								NULL, got[t], count[t].compressed,
								&sink[t], NULL, NULL };
			views[t] = (struct codec_fanout_view){ tensors[t], shape[t], got[t],
							       count[t].compressed,
							       got_view[t] + at[t], &vs[t] };
		}
		ck_assert_int_eq(codec_fanout_compress_block(config, pair, 2), 0);
		ck_assert_int_eq(codec_fanout_reconstruct_block(config, views, 2), 0);
		for (int t = 0; t < 2; t++) {
			ck_assert_mem_eq(got[t], want[t], count[t].compressed);
			ck_assert_uint_eq(sinks[t].written, count[t].compressed);
			ck_assert_mem_eq(sinks[t].bytes, want[t], count[t].compressed);
			ck_assert_mem_eq(got_view[t], want_view[t], view_elements[t] * 2);
		}
		/* With views: each head reconstructed as it is compressed writes
		 * what the second pass wrote, and nothing outside the block's rows. */
		for (int t = 0; t < 2; t++) {
			memset(got[t], 0xa5, count[t].compressed);
			memset(got_view[t], 0, view_elements[t] * 2);
			pair[t].view = got_view[t] + at[t];
			pair[t].view_strides = &vs[t];
		}
		ck_assert_int_eq(codec_fanout_compress_block(config, pair, 2), 0);
		for (int t = 0; t < 2; t++) {
			ck_assert_mem_eq(got[t], want[t], count[t].compressed);
			ck_assert_mem_eq(sinks[t].bytes, want[t], count[t].compressed);
			ck_assert_mem_eq(got_view[t], want_view[t], view_elements[t] * 2);
			pair[t].view = NULL;
		}
		/* The values' sink failing is the block's error. */
		sinks[1].fail_at = sinks[1].calls + 1;
		ck_assert_int_eq(codec_fanout_compress_block(config, pair, 2), -EIO);
		for (int t = 0; t < 2; t++) {
			pthread_mutex_destroy(&sinks[t].lock);
			free(sinks[t].bytes);
		}
	}
	codec_fanout_set_threads(1);
	for (int t = 0; t < 2; t++) {
		free(input[t]);
		free(want[t]);
		free(got[t]);
		free(want_view[t]);
		free(got_view[t]);
	}
}

START_TEST(block_is_its_tensors_in_turn)
{
	zc_codec_config config;
	zc_codec_config_default(&config);
	pair_case(&config, &shapes[0], 128);
	pair_case(&config, &shapes[1], 64);   /* values below the threshold */
	pair_case(&config, &shapes[2], 96);
	zc_codec_config exact_values = config;
	exact_values.quantize_values = false;
	pair_case(&exact_values, &shapes[3], 64);
	pair_case(&config, &shapes[5], 32);   /* both below: the codec's own calls */
}
END_TEST

/* A block's error is the first one its tensors in turn, head by head,
 * would meet, whichever thread meets which, however often it runs. */
START_TEST(block_errors_are_the_first_in_turn)
{
	zc_codec_config config;
	zc_codec_config_default(&config);
	const struct shape_case s = { 2, 4, 1024, 128 };
	zc_block_shape shape = { s.batch, s.heads, s.tokens, s.dim };
	zc_strides in = input_strides(&s);
	size_t elements = s.batch * in.batch;
	uint16_t *keys = rows_make(elements, s.dim), *values = rows_make(elements, s.dim);
	size_t n_scores = (size_t)s.batch * s.heads * s.tokens;
	float *scores = calloc(n_scores, sizeof(float));
	zc_byte_count count, value_count;
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_KEYS, &shape, &count), 0);
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_VALUES, &shape, &value_count), 0);
	uint8_t *key_out = malloc(count.compressed), *value_out = malloc(value_count.compressed);
	ck_assert(keys && values && scores && key_out && value_out);
	const struct codec_fanout_tensor pair[2] = {
		{ ZC_TENSOR_KEYS, shape, keys, &in, scores, key_out, count.compressed, NULL, NULL,
		  NULL },
		{ ZC_TENSOR_VALUES, shape, values, &in, NULL, value_out, value_count.compressed,
		  NULL, NULL, NULL },
	};
	/* Flat head (b, h) starts at b * in.batch + h * in.head. */
	size_t last_head = (s.batch - 1) * in.batch + (size_t)(s.heads - 1) * in.head;
	size_t second_head = in.head;
	for (unsigned threads = 1; threads <= 5; threads++) {
		codec_fanout_set_threads(threads);
		for (int round = 0; round < 8; round++) {
			/* A bad score in the keys' last head, a NaN in the values'
			 * first: the keys' error. */
			scores[n_scores - 1] = -1.0f;
			values[3] = 0x7e00;
			ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2), ZC_EINVALID);
			/* Keys fine: the values' error. */
			scores[n_scores - 1] = 0.0f;
			ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2),
					 ZC_ENONFINITE);
			/* Within the keys, the lower head's: an Inf in head 1
			 * before the bad score in the last. */
			values[3] = 0;
			keys[second_head + 5] = 0x7c00;
			scores[n_scores - 1] = -1.0f;
			ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2),
					 ZC_ENONFINITE);
			keys[second_head + 5] = 0;
			scores[n_scores - 1] = 0.0f;
			/* Only the values' last head. */
			values[last_head + 9] = 0xfc00;
			ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2),
					 ZC_ENONFINITE);
			values[last_head + 9] = 0;
			ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2), 0);
		}
	}
	/* Reconstruction, whose one error is ZC_ECORRUPT: the keys' wrong
	 * size (the calls in turn), then the values' corrupt mask alone (on
	 * the threads), then nothing once it is mended. */
	ck_assert_int_eq(codec_fanout_compress_block(&config, pair, 2), 0);
	zc_block_layout layout;
	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_VALUES, &shape, &layout), 0);
	uint16_t *key_view = malloc(elements * 2), *value_view = malloc(elements * 2);
	ck_assert(key_view && value_view);
	uint8_t *mask = value_out + (layout.heads - 1) * layout.head_bytes + layout.mask_offset;
	mask[0] ^= 1;   /* values are all salient: a clear bit is one too few */
	struct codec_fanout_view views[2] = {
		{ ZC_TENSOR_KEYS, shape, key_out, count.compressed - 1, key_view, &in },
		{ ZC_TENSOR_VALUES, shape, value_out, value_count.compressed, value_view, &in },
	};
	codec_fanout_set_threads(3);
	ck_assert_int_eq(codec_fanout_reconstruct_block(&config, views, 2), ZC_ECORRUPT);
	views[0].size = count.compressed;
	ck_assert_int_eq(codec_fanout_reconstruct_block(&config, views, 2), ZC_ECORRUPT);
	mask[0] ^= 1;
	ck_assert_int_eq(codec_fanout_reconstruct_block(&config, views, 2), 0);
	codec_fanout_set_threads(1);
	free(key_view);
	free(value_view);
	free(key_out);
	free(value_out);
	free(scores);
	free(keys);
	free(values);
}
END_TEST

/* ---- the helpers kept between calls ---- */

#define CREW_CALLS 40

/* One block (keys and values of [1, 8, 512, 128]: over the threshold)
 * and what one codec call per tensor makes of it. */
struct crew_block {
	zc_codec_config config;
	zc_block_shape shape;
	zc_strides in;
	uint16_t *keys, *values;
	size_t key_bytes, value_bytes;
	uint8_t *want_keys, *want_values;
};

static void crew_block_make(struct crew_block *b)
{
	zc_codec_config_default(&b->config);
	b->shape = (zc_block_shape){ 1, 8, 512, 128 };
	b->in = (zc_strides){ 8u * 512 * 128, 512u * 128, 128 };
	size_t elements = 8u * 512 * 128;
	b->keys = rows_make(elements, 128);
	b->values = rows_make(elements, 128);
	zc_byte_count k, v;
	ck_assert_int_eq(zc_block_count_bytes(&b->config, ZC_TENSOR_KEYS, &b->shape, &k), 0);
	ck_assert_int_eq(zc_block_count_bytes(&b->config, ZC_TENSOR_VALUES, &b->shape, &v), 0);
	b->key_bytes = k.compressed;
	b->value_bytes = v.compressed;
	b->want_keys = malloc(b->key_bytes);
	b->want_values = malloc(b->value_bytes);
	ck_assert(b->want_keys && b->want_values);
	ck_assert_int_eq(zc_block_compress_strided(&b->config, ZC_TENSOR_KEYS, &b->shape, b->keys,
						   &b->in, b->want_keys, b->key_bytes),
			 (int64_t)b->key_bytes);
	ck_assert_int_eq(zc_block_compress_strided(&b->config, ZC_TENSOR_VALUES, &b->shape,
						   b->values, &b->in, b->want_values,
						   b->value_bytes),
			 (int64_t)b->value_bytes);
}

static void crew_block_free(struct crew_block *b)
{
	free(b->keys);
	free(b->values);
	free(b->want_keys);
	free(b->want_values);
}

/* `calls` block calls, each checked against one codec call per tensor;
 * false at the first difference. */
static bool crew_calls(const struct crew_block *b, unsigned calls)
{
	uint8_t *keys = malloc(b->key_bytes), *values = malloc(b->value_bytes);
	bool same = keys && values;
	for (unsigned i = 0; same && i < calls; i++) {
		memset(keys, 0x5a, b->key_bytes);
		memset(values, 0x5a, b->value_bytes);
		const struct codec_fanout_tensor pair[2] = {
			{ ZC_TENSOR_KEYS, b->shape, b->keys, &b->in, NULL, keys, b->key_bytes,
			  NULL, NULL, NULL },
			{ ZC_TENSOR_VALUES, b->shape, b->values, &b->in, NULL, values,
			  b->value_bytes, NULL, NULL, NULL },
		};
		same = codec_fanout_compress_block(&b->config, pair, 2) == 0 &&
		       memcmp(keys, b->want_keys, b->key_bytes) == 0 &&
		       memcmp(values, b->want_values, b->value_bytes) == 0;
	}
	free(keys);
	free(values);
	return same;
}

static void *crew_caller(void *arg)
{
	return crew_calls(arg, CREW_CALLS) ? arg : NULL;
}

START_TEST(kept_helpers_give_one_calls_bytes_call_after_call)
{
	struct crew_block b;
	crew_block_make(&b);
	/* Calls in a row reuse the helpers; fewer threads than the crew has
	 * leave the others idle; more start the missing ones. */
	const unsigned threads[] = { 4, 2, 4, 3, 6, 2 };
	for (size_t i = 0; i < sizeof(threads) / sizeof(threads[0]); i++) {
		codec_fanout_set_threads(threads[i]);
		ck_assert_msg(crew_calls(&b, CREW_CALLS), "%u threads", threads[i]);
	}
	/* Stopped, then started again by the next call. */
	codec_fanout_stop();
	ck_assert(crew_calls(&b, 3));
	codec_fanout_stop();
	codec_fanout_set_threads(1);
	crew_block_free(&b);
}
END_TEST

START_TEST(calls_at_once_share_no_helper)
{
	struct crew_block b;
	crew_block_make(&b);
	codec_fanout_set_threads(3);
	/* One caller holds the crew at a time; the others start threads of
	 * their own for the call. Every result must be one call's. */
	pthread_t callers[4];
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(pthread_create(&callers[i], NULL, crew_caller, &b), 0);
	for (int i = 0; i < 4; i++) {
		void *ok;
		pthread_join(callers[i], &ok);
		ck_assert_msg(ok == &b, "caller %d got other bytes", i);
	}
	codec_fanout_stop();
	codec_fanout_set_threads(1);
	crew_block_free(&b);
}
END_TEST

/* A caller that also counts itself out when done. */
struct stop_race {
	struct crew_block *block;
	int finished;   /* atomic: callers done */
};

static void *counted_caller(void *arg)
{
	struct stop_race *race = arg;
	void *ok = crew_calls(race->block, CREW_CALLS) ? race->block : NULL;
	__atomic_add_fetch(&race->finished, 1, __ATOMIC_RELEASE);
	return ok;
}

/* A second thread stopping the crew until the callers are done. */
static void *stopper(void *arg)
{
	struct stop_race *race = arg;
	while (__atomic_load_n(&race->finished, __ATOMIC_ACQUIRE) < 3)
		codec_fanout_stop();
	return NULL;
}

START_TEST(a_stop_waits_for_the_call_that_holds_the_helpers)
{
	struct crew_block b;
	crew_block_make(&b);
	codec_fanout_set_threads(3);
	/* Stops over and over while three callers run: the one holding the
	 * crew finishes before its helpers are let go (a stop between its
	 * taking the crew and posting its work left it waiting for helpers
	 * that had left), the others start threads of their own, and every
	 * result is still one call's. Two threads stop at once (one waits
	 * for the other: a helper joined twice is undefined). A hang is a
	 * failure. */
	alarm(60);
	struct stop_race race = { &b, 0 };
	pthread_t callers[3], second;
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(pthread_create(&callers[i], NULL, counted_caller, &race), 0);
	ck_assert_int_eq(pthread_create(&second, NULL, stopper, &race), 0);
	unsigned stops = 0;
	while (__atomic_load_n(&race.finished, __ATOMIC_ACQUIRE) < 3) {
		codec_fanout_stop();
		stops++;
	}
	for (int i = 0; i < 3; i++) {
		void *ok;
		pthread_join(callers[i], &ok);
		ck_assert_msg(ok == &b, "caller %d got other bytes (%u stops)", i, stops);
	}
	pthread_join(second, NULL);
	alarm(0);
	ck_assert_uint_gt(stops, 0);
	ck_assert(crew_calls(&b, 2));   /* and the crew comes back */
	codec_fanout_stop();
	codec_fanout_set_threads(1);
	crew_block_free(&b);
}
END_TEST

START_TEST(a_forked_child_starts_its_own_helpers)
{
	struct crew_block b;
	crew_block_make(&b);
	codec_fanout_set_threads(3);
	ck_assert(crew_calls(&b, 2));   /* the parent's helpers exist now */
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		alarm(20);   /* a child waiting on its parent's helpers hangs: fail */
		_exit(crew_calls(&b, 3) ? 0 : 1);
	}
	int status;
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
	ck_assert(crew_calls(&b, 2));
	codec_fanout_stop();
	codec_fanout_set_threads(1);
	crew_block_free(&b);
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
		{ "block", { block_is_its_tensors_in_turn, block_errors_are_the_first_in_turn,
			     NULL } },
		{ "crew", { kept_helpers_give_one_calls_bytes_call_after_call,
			    calls_at_once_share_no_helper,
			    a_stop_waits_for_the_call_that_holds_the_helpers,
			    a_forked_child_starts_its_own_helpers, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	zc_codec_init();
	int rc = suite_main(fanout_suite(), CK_FORK_GETENV);
	codec_fanout_stop();
	return rc;
}
