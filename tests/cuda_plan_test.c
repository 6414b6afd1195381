/*
 * The CUDA reconstruction without a GPU: plan.c's validation, chunking and
 * mirror logic, and the kernels' per-thread arithmetic (cuda/core.h)
 * driven over every job the way the kernels drive it, against
 * zc_block_reconstruct bit for bit. What this cannot check (the kernels'
 * thread mapping, the CUDA calls, the pipeline's synchronisation) is
 * tests/gpu/cuda_test.c's job on a GPU (`make check-gpu`).
 */
#include <check.h>

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/core.h"
#include "../cuda/plan.h"
#include "cuda_emulator.h"
#include "cuda_layers.h"
#include "suite_main.h"

#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

struct host_target {
	struct test_target shape;
	uint16_t *keys, *values, *expected_keys, *expected_values;
	zc_cuda_target target;
};

static void host_target_init(struct host_target *t, const struct test_layer *layer,
			     uint32_t max_tokens, uint32_t token_pad, uint32_t head_pad)
{
	test_target_shape(&t->shape, layer, max_tokens, token_pad, head_pad);
	t->keys = malloc(t->shape.key_elements * 2 + 2);
	t->values = malloc(t->shape.value_elements * 2 + 2);
	t->expected_keys = malloc(t->shape.key_elements * 2 + 2);
	t->expected_values = malloc(t->shape.value_elements * 2 + 2);
	ck_assert(t->keys && t->values && t->expected_keys && t->expected_values);
	test_fill_sentinel(t->keys, t->shape.key_elements);
	test_fill_sentinel(t->values, t->shape.value_elements);
	t->target = (zc_cuda_target){ t->keys, t->values, t->shape.key_strides,
				      t->shape.value_strides, max_tokens };
}

static void host_target_free(struct host_target *t)
{
	free(t->keys);
	free(t->values);
	free(t->expected_keys);
	free(t->expected_values);
}

static void assert_matches(struct host_target *t, const struct test_layer *layer,
			   const char *what, int index)
{
	ck_assert_int_eq(test_expected(layer, &t->shape, t->expected_keys, t->expected_values), 0);
	long k = test_first_difference(t->keys, t->expected_keys, t->shape.key_elements);
	long v = test_first_difference(t->values, t->expected_values, t->shape.value_elements);
	REQUIRE(k < 0, "%s case %d: keys differ at element %ld: %#x, CPU codec %#x", what, index, k,
		k < 0 ? 0 : t->keys[k], k < 0 ? 0 : t->expected_keys[k]);
	REQUIRE(v < 0, "%s case %d: values differ at element %ld: %#x, CPU codec %#x", what, index,
		v, v < 0 ? 0 : t->values[v], v < 0 ? 0 : t->expected_values[v]);
}

static void build_case(struct test_layer *layer, const struct test_case_config *c, int index)
{
	int rc = test_layer_build(layer, &c->config, c->batch, c->heads, c->head_dim_k,
				  c->head_dim_v, c->block_tokens, c->n_blocks, c->residual,
				  1000u + (uint64_t)index);
	REQUIRE(rc == 0, "case %d: build failed: %s", index, zc_strerror(rc));
}

/* Every config the codec tests use, through small chunks (heads split
 * between chunks, job tables full), host and device memory. */
START_TEST(test_emulated_bit_identity)
{
	for (int i = 0; i < test_case_config_count(); i++) {
		struct test_case_config c;
		struct test_layer layer;
		struct host_target t;
		struct emulator e;
		int error;

		test_case_config_get(i, &c);
		build_case(&layer, &c, i);
		zc_cuda_layer *l = test_layer_state(&layer, layer.n_blocks, c.residual);
		if (i % 4 == 3)
			l->memory = ZC_CUDA_DEVICE; /* host pointers stand in for device ones */
		host_target_init(&t, &layer, layer.tokens + 3, c.token_pad, c.head_pad);
		emulator_init(&e, 1000 + (uint64_t)(i % 7) * 3000);
		REQUIRE(emulate_load(&e, l, &t.target, NULL, &error) == 0, "case %d: load", i);
		REQUIRE(error == 0, "case %d: the kernels flagged a valid payload", i);
		assert_matches(&t, &layer, "full", i);
		emulator_free(&e);
		host_target_free(&t);
		test_layer_free(&layer);
	}
}
END_TEST

/* A layer that grows as the daemon grows it: blocks appended, the residual
 * filling and then flushed into a block. After every step the mirrored
 * (incremental) target equals a full load and the CPU codec, and the plan
 * moved only what was new. */
START_TEST(test_emulated_incremental)
{
	for (int i = 0; i < test_case_config_count(); i += 5) {
		struct test_case_config c;
		struct test_layer layer;
		struct host_target inc, full;
		struct emulator e;
		zc_cuda_mirror *mirror = NULL;
		int error;

		test_case_config_get(i, &c);
		c.n_blocks = 3;
		c.block_tokens[0] = 40;
		c.block_tokens[1] = 9;
		c.block_tokens[2] = 17;
		c.residual = 20;
		build_case(&layer, &c, i);
		host_target_init(&inc, &layer, layer.tokens, c.token_pad, c.head_pad);
		host_target_init(&full, &layer, layer.tokens, c.token_pad, c.head_pad);
		emulator_init(&e, 1u << 20);
		ck_assert_int_eq(zc_cuda_mirror_new(&mirror), 0);
		/* (blocks, residual rows): the residual grows, then its tokens
		 * become the next block and a new residual starts after it. */
		static const uint32_t steps[][2] = { { 0, 0 }, { 0, 1 }, { 0, 2 }, { 1, 0 },
						     { 1, 3 }, { 1, 4 }, { 1, 9 }, { 2, 0 },
						     { 2, 1 }, { 3, 5 }, { 3, 6 }, { 3, 20 } };
		for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
			zc_cuda_layer *l = test_layer_state(&layer, steps[s][0], steps[s][1]);
			REQUIRE(emulate_load(&e, l, &inc.target, mirror, &error) == 0 && !error,
				"case %d step %zu: incremental load", i, s);
			size_t moved_blocks = e.plan.blocks;
			uint64_t moved_rows = e.plan.residual_rows;
			size_t expected_blocks = s == 0 ? steps[s][0] : steps[s][0] - steps[s - 1][0];
			uint32_t kept_rows = s > 0 && steps[s][0] == steps[s - 1][0] ? steps[s - 1][1] : 0;
			REQUIRE(moved_blocks == expected_blocks, "case %d step %zu: %zu blocks moved, %zu new",
				i, s, moved_blocks, expected_blocks);
			REQUIRE(moved_rows == steps[s][1] - kept_rows,
				"case %d step %zu: %llu residual rows moved", i, s,
				(unsigned long long)moved_rows);
			test_fill_sentinel(full.keys, full.shape.key_elements);
			test_fill_sentinel(full.values, full.shape.value_elements);
			REQUIRE(emulate_load(&e, l, &full.target, NULL, &error) == 0 && !error,
				"case %d step %zu: full load", i, s);
			assert_matches(&full, &layer, "full", i);
			/* The incremental target holds what the layer held at every
			 * step; it equals the full one on the layer's tokens. */
			for (uint32_t b = 0; b < layer.batch; b++)
				for (uint32_t h = 0; h < layer.heads; h++) {
					uint32_t end = l->residual_first + l->residual_tokens;
					size_t ko = b * inc.shape.key_strides.batch +
						    h * inc.shape.key_strides.head;
					size_t vo = b * inc.shape.value_strides.batch +
						    h * inc.shape.value_strides.head;
					for (uint32_t tok = 0; tok < end; tok++) {
						REQUIRE(memcmp(inc.keys + ko + tok * inc.shape.key_strides.token,
							       full.keys + ko + tok * inc.shape.key_strides.token,
							       layer.head_dim_k * 2) == 0 &&
							memcmp(inc.values + vo + tok * inc.shape.value_strides.token,
							       full.values + vo + tok * inc.shape.value_strides.token,
							       layer.head_dim_v * 2) == 0,
							"case %d step %zu: incremental differs at (%u, %u, %u)",
							i, s, b, h, tok);
					}
				}
		}
		zc_cuda_mirror_free(mirror);
		emulator_free(&e);
		host_target_free(&inc);
		host_target_free(&full);
		test_layer_free(&layer);
	}
}
END_TEST

/* A trim: the mirror is told, and rows re-appended at the same positions
 * are moved again; a straddled block keeps what is before the cut. */
START_TEST(test_emulated_trim)
{
	struct test_case_config c;
	struct test_layer layer;
	struct host_target t;
	struct emulator e;
	zc_cuda_mirror *mirror = NULL;
	int error;

	test_case_config_get(11, &c);
	c.n_blocks = 2;
	c.block_tokens[0] = 32;
	c.block_tokens[1] = 32;
	c.residual = 10;
	build_case(&layer, &c, 11);
	host_target_init(&t, &layer, layer.tokens, 0, 0);
	emulator_init(&e, 1u << 20);
	ck_assert_int_eq(zc_cuda_mirror_new(&mirror), 0);
	zc_cuda_layer *l = test_layer_state(&layer, 2, 10);
	ck_assert_int_eq(emulate_load(&e, l, &t.target, mirror, &error), 0);

	/* Trim to 67 tokens: 3 residual rows stay; then 5 rows come back with
	 * other contents (a different continuation). */
	zc_cuda_mirror_trim(mirror, 67);
	l = test_layer_state(&layer, 2, 8);
	for (size_t h = 0; h < (size_t)layer.batch * layer.heads; h++)
		for (uint32_t r = 3; r < 8; r++)
			for (uint32_t d = 0; d < layer.head_dim_k; d++)
				layer.residual_k[h * l->residual_key_strides.head + r * layer.head_dim_k + d] ^= 0x0100;
	ck_assert_int_eq(emulate_load(&e, l, &t.target, mirror, &error), 0);
	ck_assert_uint_eq(e.plan.residual_rows, 5);
	ck_assert_uint_eq(e.plan.blocks, 0);
	ck_assert_int_eq(test_expected(&layer, &t.shape, t.expected_keys, t.expected_values), 0);
	/* Tokens 0 .. 71 must match (72..73 are stale rows past the layer). */
	for (size_t h = 0; h < (size_t)layer.batch * layer.heads; h++)
		ck_assert_int_eq(memcmp(t.keys + h * t.shape.key_strides.head,
					t.expected_keys + h * t.shape.key_strides.head,
					72 * t.shape.key_strides.token * 2), 0);

	/* Trim into the second block: it keeps 20 tokens; the residual is gone. */
	zc_cuda_mirror_trim(mirror, 52);
	layer.blocks[1].valid_tokens = 20;
	l = test_layer_state(&layer, 2, 0);
	l->residual_tokens = 0;
	ck_assert_int_eq(emulate_load(&e, l, &t.target, mirror, &error), 0);
	ck_assert_uint_eq(e.plan.blocks, 0);
	ck_assert_uint_eq(e.plan.blocks_skipped, 2);
	zc_cuda_mirror_free(mirror);
	emulator_free(&e);
	host_target_free(&t);
	test_layer_free(&layer);
}
END_TEST

/* Refusals: each names what is wrong and plans nothing. */
START_TEST(test_plan_refusals)
{
	struct test_case_config c;
	struct test_layer layer;
	struct host_target t;
	struct plan plan;

	test_case_config_get(3, &c);
	c.residual = 4;
	c.n_blocks = 2;
	c.block_tokens[0] = 33;
	c.block_tokens[1] = 20;
	build_case(&layer, &c, 3);
	host_target_init(&t, &layer, layer.tokens, 0, 0);
	plan_init(&plan);
	zc_cuda_layer *l = test_layer_state(&layer, 2, c.residual);
	ck_assert_int_eq(plan_layer(&plan, l, &t.target, NULL), 0);

	zc_cuda_layer bad = *l;
	bad.config.hi_bits = 9;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_EBITS);
	ck_assert_uint_eq(plan.n_units, 0);
	bad = *l;
	bad.head_dim_k = 0;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_ESHAPE);
	bad = *l;
	bad.memory = (zc_cuda_memory)7;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), -EINVAL);

	zc_cuda_block blocks[2] = { layer.blocks[0], layer.blocks[1] };
	bad = *l;
	bad.blocks = blocks;
	blocks[1].key_bytes--;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_ECORRUPT);
	blocks[1] = layer.blocks[1];
	blocks[1].valid_tokens = blocks[1].tokens + 1;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), -EINVAL);
	blocks[1] = layer.blocks[1];
	blocks[1].first_token = layer.tokens;   /* past the target's room */
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_EBUFFER);

	/* A mask with one salient token too many, and one with a stray bit
	 * past the last token (33 tokens: bit 1 of byte 4). */
	zc_block_layout k;
	zc_block_shape shape = { layer.batch, layer.heads, 33, layer.head_dim_k };
	ck_assert_int_eq(zc_block_layout_compute(&layer.config, ZC_TENSOR_KEYS, &shape, &k), 0);
	uint8_t *copy = malloc(layer.blocks[0].key_bytes);
	memcpy(copy, layer.blocks[0].keys, layer.blocks[0].key_bytes);
	blocks[1] = layer.blocks[1];
	blocks[0].keys = copy;
	copy[k.mask_offset + 4] |= 0x02;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_ECORRUPT);
	copy[k.mask_offset + 4] &= (uint8_t)~0x02;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), 0);
	for (size_t i = 0; i < k.mask_bytes; i++)
		copy[k.mask_offset + i] ^= 0xff;
	copy[k.mask_offset + 4] &= 0x01;
	if (k.n_hi != k.tokens - k.n_hi)
		ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_ECORRUPT);

	/* The same corrupt payload as device memory passes the plan (its mask
	 * cannot be read from the host) and the kernels flag it, writing
	 * nothing for its heads and nothing out of place elsewhere. */
	struct emulator e;
	int error = 0;
	emulator_init(&e, 1u << 20);
	bad.memory = ZC_CUDA_DEVICE;
	if (k.n_hi != k.tokens - k.n_hi) {
		ck_assert_int_eq(emulate_load(&e, &bad, &t.target, NULL, &error), 0);
		ck_assert_int_eq(error, 1);
	}
	emulator_free(&e);

	bad = *l;
	bad.residual_key_strides.token++;
	ck_assert_int_eq(plan_layer(&plan, &bad, &t.target, NULL), ZC_ESHAPE);
	bad = *l;
	zc_cuda_target small = t.target;
	small.max_tokens = l->residual_first + l->residual_tokens - 1;
	if (l->residual_tokens)
		ck_assert_int_eq(plan_layer(&plan, &bad, &small, NULL), ZC_EBUFFER);
	ck_assert_int_eq(plan_layer(&plan, NULL, &t.target, NULL), -EINVAL);
	free(copy);
	plan_free(&plan);
	host_target_free(&t);
	test_layer_free(&layer);
}
END_TEST

/* The daemon's pool layout: each block one extent, V at the next 64-byte
 * boundary after K. The plan then goes block by block, K then V, and
 * places V with the same gap as in host memory (so cuda.c moves both in
 * one DMA); loads through small chunks stay bit-identical. A K arena and a
 * V arena (the other tests' layout) keep all keys, then all values. */
START_TEST(test_plan_pool_layout)
{
	for (int i = 0; i < test_case_config_count(); i++) {
		struct test_case_config c;
		struct test_layer layer;
		struct host_target t;
		struct emulator e;
		struct plan plan;
		struct plan_chunk chunk = { 0 };
		int error;

		test_case_config_get(i, &c);
		build_case(&layer, &c, i);
		zc_cuda_layer *l = test_layer_state(&layer, layer.n_blocks, c.residual);
		zc_cuda_block blocks[TEST_LAYER_MAX_BLOCKS];
		uint8_t *extents[TEST_LAYER_MAX_BLOCKS];
		for (size_t b = 0; b < l->n_blocks; b++) {
			blocks[b] = l->blocks[b];
			size_t v_at = (blocks[b].key_bytes + 63u) & ~(size_t)63u;
			extents[b] = aligned_alloc(4096, (v_at + blocks[b].value_bytes + 4095u) & ~(size_t)4095u);
			ck_assert_ptr_nonnull(extents[b]);
			memcpy(extents[b], blocks[b].keys, blocks[b].key_bytes);
			memcpy(extents[b] + v_at, blocks[b].values, blocks[b].value_bytes);
			blocks[b].keys = extents[b];
			blocks[b].values = extents[b] + v_at;
		}
		zc_cuda_layer pool = *l;
		pool.blocks = blocks;
		host_target_init(&t, &layer, layer.tokens, 0, 0);

		/* One chunk of room: K0 V0 K1 V1 ..., each V at its K's gap. */
		plan_init(&plan);
		ck_assert_int_eq(plan_layer(&plan, &pool, &t.target, NULL), 0);
		chunk.max_jobs = 64;
		chunk.jobs = calloc(chunk.max_jobs, sizeof *chunk.jobs);
		chunk.placements = calloc(chunk.max_jobs, sizeof *chunk.placements);
		ck_assert(chunk.jobs && chunk.placements);
		struct plan_cursor cursor = { 0, 0 };
		ck_assert(plan_next_chunk(&plan, &cursor, UINT64_C(1) << 30, &chunk));
		size_t job = 0;
		for (size_t b = 0; b < pool.n_blocks; b++) {
			if (blocks[b].valid_tokens == 0)
				continue;
			REQUIRE(job + 1 < chunk.n_jobs, "case %d: block %zu: jobs missing", i, b);
			const struct plan_placement *k = &chunk.placements[job], *v = &chunk.placements[job + 1];
			REQUIRE(k->source == blocks[b].keys && v->source == blocks[b].values,
				"case %d: block %zu: not K then V", i, b);
			/* Exact (unquantized) values are packed rows, staged: no gap. */
			REQUIRE(chunk.jobs[job + 1].kind != JOB_QUANTIZED ||
					v->offset - k->offset == (uint64_t)(v->source - k->source),
				"case %d: block %zu: V at %llu, K at %llu, host gap %td", i, b,
				(unsigned long long)v->offset, (unsigned long long)k->offset,
				v->source - k->source);
			job += 2;
		}
		plan_free(&plan);

		/* A K arena and a V arena of back-to-back payloads: all keys first. */
		size_t k_total = 0, v_total = 0;
		for (size_t b = 0; b < pool.n_blocks; b++) {
			k_total += blocks[b].key_bytes;
			v_total += blocks[b].value_bytes;
		}
		uint8_t *k_arena = malloc(k_total + 1), *v_arena = malloc(v_total + 1);
		ck_assert(k_arena && v_arena);
		zc_cuda_block arena_blocks[TEST_LAYER_MAX_BLOCKS];
		size_t k_at = 0, v_at = 0;
		for (size_t b = 0; b < pool.n_blocks; b++) {
			arena_blocks[b] = blocks[b];
			memcpy(k_arena + k_at, blocks[b].keys, blocks[b].key_bytes);
			memcpy(v_arena + v_at, blocks[b].values, blocks[b].value_bytes);
			arena_blocks[b].keys = k_arena + k_at;
			arena_blocks[b].values = v_arena + v_at;
			k_at += blocks[b].key_bytes;
			v_at += blocks[b].value_bytes;
		}
		zc_cuda_layer arenas = pool;
		arenas.blocks = arena_blocks;
		plan_init(&plan);
		ck_assert_int_eq(plan_layer(&plan, &arenas, &t.target, NULL), 0);
		cursor = (struct plan_cursor){ 0, 0 };
		ck_assert(plan_next_chunk(&plan, &cursor, UINT64_C(1) << 30, &chunk));
		if (arenas.n_blocks > 1 && arenas.blocks[0].valid_tokens && arenas.blocks[1].valid_tokens)
			REQUIRE(chunk.placements[1].source == arenas.blocks[1].keys,
				"case %d: arena layout not all keys first", i);
		free(k_arena);
		free(v_arena);
		plan_free(&plan);
		free(chunk.jobs);
		free(chunk.placements);

		emulator_init(&e, 1000 + (uint64_t)(i % 7) * 3000);
		REQUIRE(emulate_load(&e, &pool, &t.target, NULL, &error) == 0, "case %d: load", i);
		REQUIRE(error == 0, "case %d: the kernels flagged a valid payload", i);
		assert_matches(&t, &layer, "pool layout", i);
		emulator_free(&e);
		host_target_free(&t);
		for (size_t b = 0; b < pool.n_blocks; b++)
			free(extents[b]);
		test_layer_free(&layer);
	}
}
END_TEST

/* A mask word that only partly belongs to the mask: its bits past the last
 * token are params, never counted; corrupt params cannot send a read
 * outside the head (every read goes through core_word's bounds). */
START_TEST(test_core_reads_stay_inside)
{
	uint8_t bytes[11];
	for (int i = 0; i < 11; i++)
		bytes[i] = (uint8_t)(0x11 * (i + 1));
	/* Any base alignment, any bit offset: the bytes, then zeros. */
	for (int start = 0; start < 4; start++)
		for (uint64_t bit = 0; bit < 8u * (uint64_t)(11 - start); bit += 3) {
			uint64_t got = core_bits64(bytes + start, (uint64_t)(11 - start), bit);
			uint64_t want = 0;
			for (int i = 0; i < 64; i++) {
				uint64_t b = bit + (uint64_t)i;
				if (b / 8 < (uint64_t)(11 - start) &&
				    (bytes[start + b / 8] >> (b % 8)) & 1u)
					want |= UINT64_C(1) << i;
			}
			REQUIRE(got == want, "start %d bit %llu: %#llx, want %#llx", start,
				(unsigned long long)bit, (unsigned long long)got,
				(unsigned long long)want);
		}
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "emulated", { test_emulated_bit_identity, test_emulated_incremental,
				test_emulated_trim, NULL } },
		{ "plan", { test_plan_refusals, test_core_reads_stay_inside, test_plan_pool_layout,
			    NULL } },
	};
	Suite *suite = suite_create("cuda_plan");
	suite_add_cases(suite, cases, sizeof cases / sizeof cases[0], 300);
	return suite_main(suite, CK_FORK_GETENV);
}
