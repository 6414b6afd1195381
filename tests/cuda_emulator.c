/*
 * The kernels of libzipcache_cuda run on the CPU: plan.c's chunks staged
 * with memcpy for the DMA, and every scan block and tile of each launch
 * driven through cuda/core.h the way the kernels drive them. See
 * cuda_emulator.h.
 */
#include "cuda_emulator.h"

#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/core.h"

#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

/* What the scan kernel computes for one head: prefix counts and verdict. */
static void emulate_scan(const struct cuda_job *job, const uint8_t *head, uint32_t *out)
{
	uint32_t running = 0;
	int bad = 0;
	for (uint32_t w = 0; w < job->words; w++) {
		out[w] = running;
		running += (uint32_t)__builtin_popcountll(core_mask_word(job, head, w));
		bad |= core_mask_stray(job, head, w);
	}
	out[job->words] = bad || running != job->n_hi;
}

/* The kernels over one chunk whose job src are host addresses, block by
 * block as the GPU runs them: each scan block and each tile finds its job
 * with core_job_find (checked against the job's range), then the tile's
 * items go through core_tile_item. Returns the error flag the kernels
 * would set. */
static int emulate_chunk(const struct plan_chunk *chunk, uint64_t base)
{
	int error = 0;
	struct cuda_job *jobs = malloc((chunk->n_jobs + 1) * sizeof *jobs);
	uint32_t *prefix = malloc((chunk->prefix_words + 1) * sizeof(uint32_t));
	ck_assert(jobs && prefix);
	for (size_t j = 0; j < chunk->n_jobs; j++) {
		jobs[j] = chunk->jobs[j];
		jobs[j].src += base;
	}
	for (uint64_t idx = 0; idx < chunk->scan_heads; idx++) {
		uint64_t j = core_job_find(jobs, chunk->n_jobs, idx, 1);
		const struct cuda_job *job = &jobs[j];
		REQUIRE(job->kind == JOB_QUANTIZED && idx >= job->scan0 &&
			idx < job->scan0 + job->n_heads, "scan block %llu went to job %llu",
			(unsigned long long)idx, (unsigned long long)j);
		uint32_t h = (uint32_t)(idx - job->scan0);
		emulate_scan(job, (const uint8_t *)(uintptr_t)(job->src + (uint64_t)h * job->head_bytes),
			     prefix + job->prefix + (uint64_t)h * (job->words + 1u));
		error |= prefix[job->prefix + (uint64_t)h * (job->words + 1u) + job->words] != 0;
	}
	for (uint64_t tile_index = 0; tile_index < chunk->tiles; tile_index++) {
		uint64_t j = core_job_find(jobs, chunk->n_jobs, tile_index, 0);
		const struct cuda_job *job = &jobs[j];
		REQUIRE(tile_index >= job->tile0 &&
			tile_index < job->tile0 + (uint64_t)job->n_heads * job->tiles_per_head,
			"tile %llu went to job %llu", (unsigned long long)tile_index,
			(unsigned long long)j);
		struct core_tile tile;
		core_tile_begin(job, prefix, tile_index - job->tile0, &tile);
		if (tile.skip)
			continue;
		REQUIRE(tile.n_words <= TILE_MASK_WORDS, "tile spans %u mask words", tile.n_words);
		for (uint32_t w = 0; w < tile.n_words; w++)
			core_tile_word(job, &tile, w);
		for (uint32_t i = 0; i < TILE_ITEMS; i++)
			if (core_tile_item(job, &tile, i) < 0)
				error = 1;
	}
	free(prefix);
	free(jobs);
	return error;
}


void emulator_init(struct emulator *e, uint64_t capacity)
{
	memset(e, 0, sizeof *e);
	plan_init(&e->plan);
	e->chunk.max_jobs = 5; /* small, so tables fill and chunks split */
	e->chunk.jobs = calloc(e->chunk.max_jobs, sizeof *e->chunk.jobs);
	e->chunk.placements = calloc(e->chunk.max_jobs, sizeof *e->chunk.placements);
	e->capacity = capacity;
	ck_assert_ptr_nonnull(e->chunk.jobs);
	ck_assert_ptr_nonnull(e->chunk.placements);
}

void emulator_free(struct emulator *e)
{
	plan_free(&e->plan);
	free(e->chunk.jobs);
	free(e->chunk.placements);
	free(e->data);
}

/* zc_cuda_load_layer's steps with memcpy for DMA and emulate_chunk for the kernels. */
int emulate_load(struct emulator *e, const zc_cuda_layer *layer,
			const zc_cuda_target *target, zc_cuda_mirror *mirror, int *error)
{
	int rc = plan_layer(&e->plan, layer, target, mirror);
	if (rc < 0)
		return rc;
	uint64_t capacity = e->capacity;
	if (e->plan.max_per_head > capacity)
		capacity = e->plan.max_per_head;
	free(e->data);
	e->data = malloc(capacity + PLAN_ALIGN);
	ck_assert_ptr_nonnull(e->data);
	struct plan_cursor cursor = { 0, 0 };
	*error = 0;
	while (plan_next_chunk(&e->plan, &cursor, capacity, &e->chunk)) {
		REQUIRE(e->chunk.data_bytes <= capacity, "chunk of %llu bytes past %llu",
			(unsigned long long)e->chunk.data_bytes, (unsigned long long)capacity);
		uint64_t base = 0;
		if (layer->memory == ZC_CUDA_HOST) {
			for (size_t j = 0; j < e->chunk.n_jobs; j++)
				if (e->chunk.placements[j].bytes)
					plan_stage(&e->chunk.placements[j], e->data);
			base = (uint64_t)(uintptr_t)e->data;
		}
		*error |= emulate_chunk(&e->chunk, base);
		e->chunks++;
	}
	return mirror ? plan_mirror_update(mirror, layer, target) : 0;
}

