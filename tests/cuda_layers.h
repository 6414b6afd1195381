/*
 * Layers for the CUDA reconstruction tests: random fp16 K/V compressed by
 * the codec into blocks, an exact residual, and what the CPU codec
 * reconstructs from them into a strided target. Shared by the CPU
 * emulation (cuda_plan_test.c) and the GPU suite (gpu/cuda_test.c).
 */
#ifndef ZIPCACHE_TESTS_CUDA_LAYERS_H
#define ZIPCACHE_TESTS_CUDA_LAYERS_H

#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/cuda.h"

#define TEST_LAYER_MAX_BLOCKS 8
/* What a target element holds before a load: every load must leave the
 * elements it does not own exactly so. */
#define TEST_SENTINEL 0x5a5au

struct test_layer {
	zc_codec_config config;
	uint32_t batch, heads, head_dim_k, head_dim_v;
	uint32_t tokens;                      /* all tokens the originals hold */
	uint16_t *original_k, *original_v;    /* [B][H][tokens][D] */
	zc_cuda_block blocks[TEST_LAYER_MAX_BLOCKS];
	size_t n_blocks;
	uint16_t *residual_k, *residual_v;    /* [B][H][residual_capacity][D] */
	uint32_t residual_capacity;
	zc_cuda_layer layer;                  /* the state test_layer_state chose */
};

struct test_target {
	uint32_t batch, heads, head_dim_k, head_dim_v, max_tokens;
	zc_strides key_strides, value_strides;
	size_t key_elements, value_elements;  /* of each tensor's buffer */
};

/* A [batch, heads, S, head_dim] fp16 block of varied scales, with some
 * extremes (largest finite values, subnormals) among them. */
void test_fill_halves(uint16_t *out, size_t n, uint64_t seed);

/* Compresses block_tokens[i] tokens per block from the originals (all
 * tokens: sum of block_tokens plus residual_capacity). The blocks' tokens
 * are back to back from token 0. Returns 0 or a codec error. */
int test_layer_build(struct test_layer *layer, const zc_codec_config *config, uint32_t batch,
		     uint32_t heads, uint32_t head_dim_k, uint32_t head_dim_v,
		     const uint32_t *block_tokens, size_t n_blocks, uint32_t residual_capacity,
		     uint64_t seed);
void test_layer_free(struct test_layer *layer);

/* Chooses the state: the first n_blocks blocks, then residual_rows exact
 * rows (the originals of the tokens after them); memory says where the
 * pointers point (the host ones here; the GPU suite swaps in device
 * copies). Fills layer->layer and returns it. */
zc_cuda_layer *test_layer_state(struct test_layer *layer, size_t n_blocks, uint32_t residual_rows);

/* Strides of a [B][H][max_tokens][D] target with token_pad elements after
 * each row and head_pad after each head. */
void test_target_shape(struct test_target *target, const struct test_layer *layer,
		       uint32_t max_tokens, uint32_t token_pad, uint32_t head_pad);

/* What the CPU codec makes of the layer's current state in a target that
 * started as TEST_SENTINEL everywhere. */
int test_expected(const struct test_layer *layer, const struct test_target *target,
		  uint16_t *keys, uint16_t *values);

/* Every element TEST_SENTINEL. */
void test_fill_sentinel(uint16_t *out, size_t n);

/* The index of the first differing element, or -1. */
long test_first_difference(const uint16_t *a, const uint16_t *b, size_t n);

/* The configs the codec's tests use, as this suite walks them: every
 * (hi_bits, lo_bits) pair 1..8 x 1..8, with fractions, group sizes, head
 * dims, token counts and shapes rotated through the codec tests' lists.
 * Returns false past the last one. */
struct test_case_config {
	zc_codec_config config;
	uint32_t batch, heads, head_dim_k, head_dim_v;
	uint32_t block_tokens[3];
	size_t n_blocks;
	uint32_t residual;
	uint32_t token_pad, head_pad;
};
int test_case_config_count(void);
void test_case_config_get(int index, struct test_case_config *out);

#endif
