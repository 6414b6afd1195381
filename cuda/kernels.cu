/*
 * The reconstruction kernels. What one thread computes is core.h (shared
 * with the CPU emulation test); this file maps threads onto it.
 *
 * scan: one block per quantized head. The head's mask, 64 tokens a word,
 * becomes prefix counts (salient tokens before each word), so any thread
 * finds a token's row in its subset with one popcount; and a verdict, 1
 * when the mask disagrees with the layout (wrong population, stray bits),
 * after which no thread writes that head.
 *
 * reconstruct: one block per tile (whole tokens of one head of one job,
 * at most TILE_ITEMS items); a thread does TILE_ITEMS_PER_THREAD items,
 * one 16-byte store each where the target's alignment allows. Consecutive threads take
 * consecutive channels of a token, then the next token, so a warp's stores
 * are coalesced rows and its code reads are neighbours in the stream.
 */
#include <cuda_runtime.h>

#include "core.h"
#include "kernels.h"

__global__ void __launch_bounds__(TILE_THREADS)
scan_kernel(const struct cuda_launch *launch, uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ uint32_t sums[TILE_THREADS / 32];

	if (threadIdx.x == 0)
		job = jobs[core_job_find(jobs, launch->n_jobs, blockIdx.x, 1)];
	__syncthreads();

	uint32_t h = (uint32_t)(blockIdx.x - job.scan0);
	const uint8_t *head = (const uint8_t *)(uintptr_t)job.src + (uint64_t)h * job.head_bytes;
	uint32_t *out = prefix + job.prefix + (uint64_t)h * (job.words + 1u);
	uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
	uint32_t running = 0;
	int bad = 0;

	for (uint32_t base = 0; base < job.words; base += TILE_THREADS) {
		uint32_t w = base + threadIdx.x;
		uint32_t count = 0;
		if (w < job.words) {
			count = (uint32_t)__popcll(core_mask_word(&job, head, w));
			bad |= core_mask_stray(&job, head, w);
		}
		uint32_t x = count;
		for (uint32_t offset = 1; offset < 32; offset *= 2) {
			uint32_t y = __shfl_up_sync(0xffffffffu, x, offset);
			if (lane >= offset)
				x += y;
		}
		if (lane == 31)
			sums[warp] = x;
		__syncthreads();
		if (warp == 0) {
			uint32_t s = lane < TILE_THREADS / 32 ? sums[lane] : 0;
			for (uint32_t offset = 1; offset < TILE_THREADS / 32; offset *= 2) {
				uint32_t y = __shfl_up_sync(0xffffffffu, s, offset);
				if (lane >= offset)
					s += y;
			}
			if (lane < TILE_THREADS / 32)
				sums[lane] = s;
		}
		__syncthreads();
		uint32_t before = warp ? sums[warp - 1] : 0;
		if (w < job.words)
			out[w] = running + before + x - count;
		running += sums[TILE_THREADS / 32 - 1];
		__syncthreads();
	}
	bad = __syncthreads_or(bad);
	if (threadIdx.x == 0) {
		uint32_t verdict = bad || running != job.n_hi;
		out[job.words] = verdict;
		if (verdict)
			atomicOr(error, 1);
	}
}

__global__ void __launch_bounds__(TILE_THREADS)
reconstruct_kernel(const struct cuda_launch *launch, const uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ struct core_tile tile;

	if (threadIdx.x == 0) {
		job = jobs[core_job_find(jobs, launch->n_jobs, blockIdx.x, 0)];
		core_tile_begin(&job, prefix, blockIdx.x - job.tile0, &tile);
	}
	__syncthreads();
	if (tile.skip)
		return; /* the scan flagged this head; the error is set */
	if (threadIdx.x < tile.n_words)
		core_tile_word(&job, &tile, threadIdx.x);
	__syncthreads();
	int bad = 0;
#pragma unroll 2
	for (uint32_t k = 0; k < TILE_ITEMS_PER_THREAD; k++)
		bad |= core_tile_item(&job, &tile, k * TILE_THREADS + threadIdx.x);
	if (bad)
		atomicOr(error, 1);
}

extern "C" int cuda_kernels_launch(const struct cuda_launch *launch, uint64_t n_jobs,
				   uint64_t tiles, uint64_t scan_heads, uint32_t *prefix,
				   int *error, void *stream)
{
	cudaStream_t s = (cudaStream_t)stream;
	(void)n_jobs;
	if (scan_heads)
		scan_kernel<<<(unsigned)scan_heads, TILE_THREADS, 0, s>>>(launch, prefix, error);
	if (tiles)
		reconstruct_kernel<<<(unsigned)tiles, TILE_THREADS, 0, s>>>(launch, prefix, error);
	return (int)cudaGetLastError();
}
