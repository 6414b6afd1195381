/*
 * libzipcache_cuda's load without a GPU, for the CPU tests: plan.c's
 * plan and chunks, memcpy for the DMA, and the kernels' per-thread
 * arithmetic (cuda/core.h) over every job, block by block as the GPU runs
 * them. What this cannot check (the kernels' thread mapping, the CUDA
 * calls, the pipeline's synchronisation) is the GPU suites' job. Asserts
 * with Check.
 */
#ifndef ZIPCACHE_TESTS_CUDA_EMULATOR_H
#define ZIPCACHE_TESTS_CUDA_EMULATOR_H

#include <stddef.h>
#include <stdint.h>

#include "../cuda/plan.h"

struct emulator {
	struct plan plan;
	struct plan_chunk chunk;
	uint8_t *data;
	uint64_t capacity;
	size_t chunks;
};

/* capacity: the bounce buffer's data bytes (small: chunks split heads);
 * job tables hold 5 jobs, so they fill. */
void emulator_init(struct emulator *e, uint64_t capacity);
void emulator_free(struct emulator *e);

/* zc_cuda_load_layer's steps over host memory; *error is the flag the
 * kernels would set (a device payload's mask disagreeing with its layout). */
int emulate_load(struct emulator *e, const zc_cuda_layer *layer, const zc_cuda_target *target,
		 zc_cuda_mirror *mirror, int *error);

#endif
