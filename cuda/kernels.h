/*
 * The kernels' launcher, callable from C (cuda.c). A launch covers one
 * chunk: first the scan (one block per quantized head: the mask's prefix
 * counts and its verdict), then the reconstruction (one block per tile).
 */
#ifndef ZIPCACHE_CUDA_KERNELS_H
#define ZIPCACHE_CUDA_KERNELS_H

#include <stdint.h>

#include "job.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Queues a chunk's kernels on stream; returns the launch's cudaError_t.
 * launch: the chunk's header and jobs in device memory; prefix: room for
 * its prefix_words; error: a device int the kernels OR 1 into when a
 * payload's mask is corrupt. */
int cuda_kernels_launch(const struct cuda_launch *launch, uint64_t n_jobs, uint64_t tiles,
			uint64_t scan_heads, uint32_t *prefix, int *error, void *stream);

#ifdef __cplusplus
}
#endif

#endif
