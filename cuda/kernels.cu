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
 * reconstruct: one block per tile (TILE_ITEMS items of one head of one
 * job); a thread does TILE_ITEMS_PER_THREAD items, one 16-byte store each
 * where the target's alignment allows. Consecutive threads take
 * consecutive channels of a token, then the next token, so a warp's stores
 * are coalesced rows and its code reads are neighbours in the stream.
 */
#include <cuda_runtime.h>

#include "core.h"
#include "kernels.h"

/* The job whose [first, first + count) range of `field` holds index. Jobs
 * with an empty range share their successor's start, so the last job whose
 * start is <= index is the one. */
__device__ static uint64_t job_find(const struct cuda_job *jobs, uint64_t n, uint64_t index,
				    bool scan)
{
	uint64_t lo = 0, hi = n;
	while (hi - lo > 1) {
		uint64_t mid = (lo + hi) / 2;
		uint64_t start = scan ? jobs[mid].scan0 : jobs[mid].tile0;
		if (start <= index)
			lo = mid;
		else
			hi = mid;
	}
	return lo;
}

__global__ void __launch_bounds__(TILE_THREADS)
scan_kernel(const struct cuda_launch *launch, uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ uint32_t sums[TILE_THREADS / 32];

	if (threadIdx.x == 0)
		job = jobs[job_find(jobs, launch->n_jobs, blockIdx.x, true)];
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

__device__ static void store_item(uint64_t address, const uint16_t value[CHUNK_CHANNELS],
				  uint32_t n, bool vector)
{
	if (vector && n == CHUNK_CHANNELS) {
		uint4 packed;
		packed.x = (uint32_t)value[0] | (uint32_t)value[1] << 16;
		packed.y = (uint32_t)value[2] | (uint32_t)value[3] << 16;
		packed.z = (uint32_t)value[4] | (uint32_t)value[5] << 16;
		packed.w = (uint32_t)value[6] | (uint32_t)value[7] << 16;
		*(uint4 *)(uintptr_t)address = packed;
		return;
	}
	uint16_t *out = (uint16_t *)(uintptr_t)address;
	for (uint32_t i = 0; i < n; i++)
		out[i] = value[i];
}

__global__ void __launch_bounds__(TILE_THREADS)
reconstruct_kernel(const struct cuda_launch *launch, const uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;

	if (threadIdx.x == 0)
		job = jobs[job_find(jobs, launch->n_jobs, blockIdx.x, false)];
	__syncthreads();

	uint64_t local = blockIdx.x - job.tile0;
	uint32_t h = (uint32_t)(local / job.tiles_per_head);
	uint64_t tile = local % job.tiles_per_head;
	uint64_t dst = core_dst_head(&job, h);
	uint64_t src = core_src_head(&job, h);
	const uint32_t *words = NULL;
	bool quantized = job.kind == JOB_QUANTIZED;
	bool vector = job.vector != 0;

	if (quantized) {
		words = prefix + job.prefix + (uint64_t)h * (job.words + 1u);
		if (words[job.words])
			return; /* the scan found this head's mask corrupt: write nothing */
	}
	uint64_t items = (uint64_t)job.valid * job.chunks;
	for (uint32_t k = 0; k < TILE_ITEMS_PER_THREAD; k++) {
		uint64_t item = tile * TILE_ITEMS + (uint64_t)k * TILE_THREADS + threadIdx.x;
		if (item >= items)
			break;
		uint32_t t = (uint32_t)(item / job.chunks);
		uint32_t c0 = (uint32_t)(item % job.chunks) * CHUNK_CHANNELS;
		uint32_t n = job.dim - c0 < CHUNK_CHANNELS ? job.dim - c0 : CHUNK_CHANNELS;
		uint16_t value[CHUNK_CHANNELS];
		if (quantized) {
			if (core_quantized_item(&job, (const uint8_t *)(uintptr_t)src, words[t >> 6],
						t, c0, n, value) < 0) {
				atomicOr(error, 1);
				continue;
			}
		} else {
			uint64_t from = src + 2u * ((uint64_t)t * job.src_token + c0);
			if (vector && n == CHUNK_CHANNELS) {
				uint4 packed = *(const uint4 *)(uintptr_t)from;
				value[0] = (uint16_t)packed.x;
				value[1] = (uint16_t)(packed.x >> 16);
				value[2] = (uint16_t)packed.y;
				value[3] = (uint16_t)(packed.y >> 16);
				value[4] = (uint16_t)packed.z;
				value[5] = (uint16_t)(packed.z >> 16);
				value[6] = (uint16_t)packed.w;
				value[7] = (uint16_t)(packed.w >> 16);
			} else {
				const uint16_t *row = (const uint16_t *)(uintptr_t)from;
				for (uint32_t i = 0; i < n; i++)
					value[i] = row[i];
			}
		}
		store_item(dst + 2u * ((uint64_t)t * job.dst_token + c0), value, n, vector);
	}
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
