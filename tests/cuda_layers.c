/* Test layers for the CUDA reconstruction suites: see cuda_layers.h. */
#include "cuda_layers.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

void test_fill_halves(uint16_t *out, size_t n, uint64_t seed)
{
	static const uint16_t extremes[] = { 0x7bff, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x0400 };
	uint64_t state = seed;
	double scale = ldexp(1.0, (int)(splitmix(&state) % 14) - 7);
	for (size_t i = 0; i < n; i++) {
		uint64_t r = splitmix(&state);
		if (r % 97 == 0) {
			out[i] = extremes[(r >> 8) % (sizeof extremes / sizeof extremes[0])];
			continue;
		}
		/* A sum of uniforms is normal enough; outlier channels every 13th. */
		double u = ((double)(r >> 11) / 9007199254740992.0 - 0.5) * 3.4;
		if (i % 13 == 5)
			u = 20.0 + 50.0 * u;
		uint16_t half = zc_float_to_fp16((float)(u * scale));
		out[i] = half == 0x8000u ? 0 : half;
	}
}

void test_fill_sentinel(uint16_t *out, size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = TEST_SENTINEL;
}

long test_first_difference(const uint16_t *a, const uint16_t *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (a[i] != b[i])
			return (long)i;
	return -1;
}

/* Copies tokens [first, first + count) of each head of an original
 * [B][H][tokens][D] into a contiguous [B][H][count][D] block. */
static void take_tokens(const uint16_t *original, uint32_t heads_total, uint32_t tokens,
			uint32_t dim, uint32_t first, uint32_t count, uint16_t *block,
			size_t block_head_stride)
{
	for (uint32_t h = 0; h < heads_total; h++)
		memcpy(block + h * block_head_stride,
		       original + ((size_t)h * tokens + first) * dim,
		       (size_t)count * dim * sizeof(uint16_t));
}

static int compress_tensor(const zc_codec_config *config, zc_tensor tensor,
			   const zc_block_shape *shape, const uint16_t *block, void **payload,
			   size_t *bytes)
{
	zc_block_layout layout;
	int rc = zc_block_layout_compute(config, tensor, shape, &layout);
	if (rc < 0)
		return rc;
	*payload = malloc(layout.total_bytes + 1);
	if (!*payload)
		return -ENOMEM;
	int64_t written = zc_block_compress(config, tensor, shape, block, *payload,
					    layout.total_bytes);
	if (written < 0)
		return (int)written;
	*bytes = (size_t)written;
	return 0;
}

int test_layer_build(struct test_layer *layer, const zc_codec_config *config, uint32_t batch,
		     uint32_t heads, uint32_t head_dim_k, uint32_t head_dim_v,
		     const uint32_t *block_tokens, size_t n_blocks, uint32_t residual_capacity,
		     uint64_t seed)
{
	memset(layer, 0, sizeof *layer);
	if (n_blocks > TEST_LAYER_MAX_BLOCKS)
		return -EINVAL;
	layer->config = *config;
	layer->batch = batch;
	layer->heads = heads;
	layer->head_dim_k = head_dim_k;
	layer->head_dim_v = head_dim_v;
	uint32_t tokens = residual_capacity;
	for (size_t i = 0; i < n_blocks; i++)
		tokens += block_tokens[i];
	layer->tokens = tokens;
	layer->residual_capacity = residual_capacity;
	size_t heads_total = (size_t)batch * heads;
	size_t kn = heads_total * tokens * head_dim_k, vn = heads_total * tokens * head_dim_v;
	layer->original_k = malloc(kn * sizeof(uint16_t) + 2);
	layer->original_v = malloc(vn * sizeof(uint16_t) + 2);
	layer->residual_k = malloc(heads_total * (residual_capacity + 1) * head_dim_k * 2);
	layer->residual_v = malloc(heads_total * (residual_capacity + 1) * head_dim_v * 2);
	uint16_t *block = malloc((kn > vn ? kn : vn) * sizeof(uint16_t) + 2);
	if (!layer->original_k || !layer->original_v || !layer->residual_k ||
	    !layer->residual_v || !block) {
		free(block);
		test_layer_free(layer);
		return -ENOMEM;
	}
	test_fill_halves(layer->original_k, kn, seed);
	test_fill_halves(layer->original_v, vn, seed ^ 0x5555);
	uint32_t first = 0;
	int rc = 0;
	for (size_t i = 0; i < n_blocks && rc == 0; i++) {
		zc_cuda_block *b = &layer->blocks[i];
		uint32_t s = block_tokens[i];
		zc_block_shape shape = { batch, heads, s, head_dim_k };
		void *payload = NULL;
		take_tokens(layer->original_k, (uint32_t)heads_total, tokens, head_dim_k, first, s,
			    block, (size_t)s * head_dim_k);
		rc = compress_tensor(config, ZC_TENSOR_KEYS, &shape, block, &payload,
				     &b->key_bytes);
		b->keys = payload;
		if (rc < 0)
			break;
		shape.head_dim = head_dim_v;
		take_tokens(layer->original_v, (uint32_t)heads_total, tokens, head_dim_v, first, s,
			    block, (size_t)s * head_dim_v);
		payload = NULL;
		rc = compress_tensor(config, ZC_TENSOR_VALUES, &shape, block, &payload,
				     &b->value_bytes);
		b->values = payload;
		b->first_token = first;
		b->tokens = s;
		b->valid_tokens = s;
		layer->n_blocks = i + 1;
		first += s;
	}
	free(block);
	if (rc < 0)
		test_layer_free(layer);
	return rc;
}

void test_layer_free(struct test_layer *layer)
{
	for (size_t i = 0; i < TEST_LAYER_MAX_BLOCKS; i++) {
		free((void *)layer->blocks[i].keys);
		free((void *)layer->blocks[i].values);
	}
	free(layer->original_k);
	free(layer->original_v);
	free(layer->residual_k);
	free(layer->residual_v);
	memset(layer, 0, sizeof *layer);
}

static uint32_t blocks_end(const struct test_layer *layer, size_t n_blocks)
{
	uint32_t end = 0;
	for (size_t i = 0; i < n_blocks; i++)
		end = layer->blocks[i].first_token + layer->blocks[i].tokens;
	return end;
}

zc_cuda_layer *test_layer_state(struct test_layer *layer, size_t n_blocks, uint32_t residual_rows)
{
	zc_cuda_layer *l = &layer->layer;
	uint32_t first = blocks_end(layer, n_blocks);
	size_t heads_total = (size_t)layer->batch * layer->heads;
	uint32_t cap = layer->residual_capacity + 1; /* one spare row: strides != rows */

	memset(l, 0, sizeof *l);
	l->config = layer->config;
	l->batch = layer->batch;
	l->heads = layer->heads;
	l->head_dim_k = layer->head_dim_k;
	l->head_dim_v = layer->head_dim_v;
	l->blocks = layer->blocks;
	l->n_blocks = n_blocks;
	l->memory = ZC_CUDA_HOST;
	if (first + residual_rows > layer->tokens)
		residual_rows = layer->tokens - first;
	for (size_t h = 0; h < heads_total; h++) {
		memcpy(layer->residual_k + h * cap * layer->head_dim_k,
		       layer->original_k + (h * layer->tokens + first) * layer->head_dim_k,
		       (size_t)residual_rows * layer->head_dim_k * 2);
		memcpy(layer->residual_v + h * cap * layer->head_dim_v,
		       layer->original_v + (h * layer->tokens + first) * layer->head_dim_v,
		       (size_t)residual_rows * layer->head_dim_v * 2);
	}
	l->residual_keys = layer->residual_k;
	l->residual_values = layer->residual_v;
	l->residual_key_strides = (zc_strides){ (size_t)layer->heads * cap * layer->head_dim_k,
						(size_t)cap * layer->head_dim_k, layer->head_dim_k };
	l->residual_value_strides = (zc_strides){ (size_t)layer->heads * cap * layer->head_dim_v,
						  (size_t)cap * layer->head_dim_v, layer->head_dim_v };
	l->residual_first = first;
	l->residual_tokens = residual_rows;
	return l;
}

static void shape_strides(zc_strides *strides, size_t *elements, uint32_t batch, uint32_t heads,
			  uint32_t max_tokens, uint32_t dim, uint32_t token_pad, uint32_t head_pad)
{
	strides->token = (size_t)dim + token_pad;
	strides->head = strides->token * max_tokens + head_pad;
	strides->batch = strides->head * heads;
	*elements = strides->batch * batch;
}

void test_target_shape(struct test_target *target, const struct test_layer *layer,
		       uint32_t max_tokens, uint32_t token_pad, uint32_t head_pad)
{
	target->batch = layer->batch;
	target->heads = layer->heads;
	target->head_dim_k = layer->head_dim_k;
	target->head_dim_v = layer->head_dim_v;
	target->max_tokens = max_tokens;
	shape_strides(&target->key_strides, &target->key_elements, layer->batch, layer->heads,
		      max_tokens, layer->head_dim_k, token_pad, head_pad);
	shape_strides(&target->value_strides, &target->value_elements, layer->batch, layer->heads,
		      max_tokens, layer->head_dim_v, token_pad, head_pad);
}

/* One block tensor into the target: reconstructed in full, then its valid rows copied. */
static int expected_block(const struct test_layer *layer, const zc_cuda_block *block,
			  zc_tensor tensor, const zc_strides *strides, uint16_t *out)
{
	bool keys = tensor == ZC_TENSOR_KEYS;
	uint32_t dim = keys ? layer->head_dim_k : layer->head_dim_v;
	zc_block_shape shape = { layer->batch, layer->heads, block->tokens, dim };
	size_t head = (size_t)block->tokens * dim;
	zc_strides contiguous = { head * layer->heads, head, dim };
	uint16_t *whole = malloc(head * layer->batch * layer->heads * 2 + 2);
	if (!whole)
		return -ENOMEM;
	int rc = zc_block_reconstruct(&layer->config, tensor, &shape,
				      keys ? block->keys : block->values,
				      keys ? block->key_bytes : block->value_bytes, whole,
				      &contiguous);
	for (uint32_t b = 0; rc == 0 && b < layer->batch; b++)
		for (uint32_t h = 0; h < layer->heads; h++)
			for (uint32_t t = 0; t < block->valid_tokens; t++)
				memcpy(out + b * strides->batch + h * strides->head +
					       (size_t)(block->first_token + t) * strides->token,
				       whole + b * contiguous.batch + h * contiguous.head +
					       (size_t)t * dim,
				       (size_t)dim * 2);
	free(whole);
	return rc;
}

int test_expected(const struct test_layer *layer, const struct test_target *target,
		  uint16_t *keys, uint16_t *values)
{
	const zc_cuda_layer *l = &layer->layer;
	test_fill_sentinel(keys, target->key_elements);
	test_fill_sentinel(values, target->value_elements);
	for (size_t i = 0; i < l->n_blocks; i++) {
		int rc = expected_block(layer, &l->blocks[i], ZC_TENSOR_KEYS, &target->key_strides,
					keys);
		if (rc == 0)
			rc = expected_block(layer, &l->blocks[i], ZC_TENSOR_VALUES,
					    &target->value_strides, values);
		if (rc < 0)
			return rc;
	}
	for (uint32_t b = 0; b < l->batch; b++)
		for (uint32_t h = 0; h < l->heads; h++)
			for (uint32_t t = 0; t < l->residual_tokens; t++) {
				uint32_t token = l->residual_first + t;
				memcpy(keys + b * target->key_strides.batch +
					       h * target->key_strides.head +
					       (size_t)token * target->key_strides.token,
				       layer->residual_k + b * l->residual_key_strides.batch +
					       h * l->residual_key_strides.head +
					       (size_t)t * l->residual_key_strides.token,
				       (size_t)l->head_dim_k * 2);
				memcpy(values + b * target->value_strides.batch +
					       h * target->value_strides.head +
					       (size_t)token * target->value_strides.token,
				       layer->residual_v + b * l->residual_value_strides.batch +
					       h * l->residual_value_strides.head +
					       (size_t)t * l->residual_value_strides.token,
				       (size_t)l->head_dim_v * 2);
			}
	return 0;
}

/* The codec tests' lists (tests/codec_test.c), rotated against the 64
 * width pairs so every pair meets several of each. */
static const double case_fractions[] = { 0.2, 0.0, 0.5, 1.0, 0.37, 1e-9 };
static const int case_groups[] = { 32, 1, 7, 33, 1000, 3, 16 };
static const uint32_t case_dims[] = { 128, 64, 256, 80, 96, 1, 3, 17, 576 };
static const uint32_t case_tokens[] = { 33, 1, 31, 65, 100, 7, 129, 257, 64 };
static const uint32_t case_residual[] = { 5, 0, 1, 17, 64 };
static const uint32_t case_pads[][2] = { { 0, 0 }, { 0, 8 }, { 8, 0 }, { 3, 5 }, { 8, 16 } };

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define CASE_VARIANTS 3

int test_case_config_count(void)
{
	return 64 * CASE_VARIANTS;
}

void test_case_config_get(int index, struct test_case_config *out)
{
	int pair = index % 64, variant = index / 64;
	int r = index * 7 + variant;
	memset(out, 0, sizeof *out);
	out->config.hi_bits = 1 + pair / 8;
	out->config.lo_bits = 1 + pair % 8;
	out->config.hi_fraction = case_fractions[r % COUNT(case_fractions)];
	out->config.group_size = case_groups[(r / 2) % COUNT(case_groups)];
	out->config.quantize_values = index % 5 != 0;
	out->batch = 1 + (uint32_t)(index % 2);
	out->heads = 1 + (uint32_t)((index / 2) % 3);
	out->head_dim_k = case_dims[(r / 3) % COUNT(case_dims)];
	out->head_dim_v = index % 4 == 0 ? case_dims[(r / 3 + 1) % COUNT(case_dims)] : out->head_dim_k;
	out->n_blocks = 1 + (size_t)(index % 3);
	for (size_t i = 0; i < out->n_blocks; i++)
		out->block_tokens[i] = case_tokens[(r + 3 * (int)i) % COUNT(case_tokens)];
	out->residual = case_residual[r % COUNT(case_residual)];
	out->token_pad = case_pads[index % COUNT(case_pads)][0];
	out->head_pad = case_pads[index % COUNT(case_pads)][1];
}
