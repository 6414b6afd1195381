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

/* The job of block `index`, as core_job_find finds it, but with the
 * threads side by side: each reads one job's start, and the starts at or
 * below index (they never go back) count to the job's position plus one.
 * One memory latency where the binary search pays one per step; launches
 * of more jobs than threads search. */
__device__ static uint64_t block_job_find(const struct cuda_job *jobs, uint64_t n, uint64_t index,
					  int scan)
{
	if (n > TILE_THREADS)
		return core_job_find(jobs, n, index, scan);
	int below = 0;
	if (threadIdx.x < n) {
		uint64_t start = scan ? jobs[threadIdx.x].scan0 : jobs[threadIdx.x].tile0;
		below = start <= index;
	}
	int count = __syncthreads_count(below);
	return count > 0 ? (uint64_t)count - 1u : 0u;
}

/* A job copied into shared memory by the block's threads, a word each. */
__device__ static void block_job_load(const struct cuda_job *jobs, uint64_t j,
				      struct cuda_job *job)
{
	const uint64_t *from = (const uint64_t *)&jobs[j];
	uint64_t *to = (uint64_t *)job;
	if (threadIdx.x < sizeof *job / sizeof(uint64_t))
		to[threadIdx.x] = __ldg(&from[threadIdx.x]);
}

__global__ void __launch_bounds__(TILE_THREADS)
scan_kernel(const struct cuda_launch *launch, uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ uint32_t sums[TILE_THREADS / 32];

	block_job_load(jobs, block_job_find(jobs, launch->n_jobs, blockIdx.x, 1), &job);
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

/*
 * The fast path of a quantized tile, bit for bit what core_tile_item
 * computes. The generic item spends most of its instructions on what its
 * neighbours repeat: sixteen fp16 parameters converted per item (shared by
 * the group_size tokens of a group), parameter bytes assembled from
 * unaligned words, 64-bit offsets, divisions by job fields. Here the
 * block converts the parameters of the groups its tokens touch once, into
 * shared memory as floats, and the items read them from there; a tile
 * qualifies when those groups fit, its divisors are powers of two, its
 * stores are 16-byte vectors and a head's bit offsets fit in 32 bits.
 */
#define FAST_PARAM_FLOATS 6144u

struct fast_tile {
	uint32_t hi_group0, lo_group0;  /* first group of each subset the tile touches */
	uint32_t hi_groups;             /* slots of the hi subset; lo's follow */
	uint32_t slots;                 /* groups of both subsets */
	uint32_t chunk_shift, group_shift;
	int ok;
};

__device__ static __forceinline__ uint32_t fast_log2(uint32_t n)
{
	return n && (n & (n - 1u)) == 0 ? (uint32_t)__ffs((int)n) - 1u : 32u;
}

/* Salient tokens of the tile before token t (t inside the tile). */
__device__ static __forceinline__ uint32_t fast_rank(const struct core_tile *tile, uint32_t t)
{
	uint32_t j = (t >> 6) - tile->first_word;
	return tile->before[j] + (uint32_t)__popcll(tile->mask[j] & ((UINT64_C(1) << (t & 63u)) - 1u));
}

/* Decides the fast path and where the tile's groups start (one thread). */
__device__ static void fast_plan(const struct cuda_job *job, const struct core_tile *tile,
				 struct fast_tile *fast)
{
	fast->ok = 0;
	fast->chunk_shift = fast_log2(job->chunks);
	fast->group_shift = fast_log2(job->group_size);
	if (job->kind != JOB_QUANTIZED || !job->vector || job->dim % CHUNK_CHANNELS != 0 ||
	    fast->chunk_shift == 32u || fast->group_shift == 32u || job->head_bytes >= (1u << 28) ||
	    job->hi_bits > 8u || job->lo_bits > 8u)
		return;
	uint32_t first = tile->first_token;
	uint32_t end = first + job->tile_tokens;
	end = end < job->valid ? end : job->valid;
	uint32_t last = end - 1u;
	uint32_t hi0 = fast_rank(tile, first);
	uint32_t j = (last >> 6) - tile->first_word;
	uint32_t hi1 = fast_rank(tile, last) + (uint32_t)((tile->mask[j] >> (last & 63u)) & 1u);
	uint32_t lo0 = first - hi0, lo1 = end - hi1;
	uint32_t hi_groups = hi1 > hi0 ? ((hi1 - 1u) >> fast->group_shift) -
						 (hi0 >> fast->group_shift) + 1u : 0u;
	uint32_t lo_groups = lo1 > lo0 ? ((lo1 - 1u) >> fast->group_shift) -
						 (lo0 >> fast->group_shift) + 1u : 0u;
	if ((uint64_t)(hi_groups + lo_groups) * 2u * job->dim > FAST_PARAM_FLOATS)
		return;
	fast->hi_group0 = hi0 >> fast->group_shift;
	fast->lo_group0 = lo0 >> fast->group_shift;
	fast->hi_groups = hi_groups;
	fast->slots = hi_groups + lo_groups;
	fast->ok = 1;
}

/* fp16 i of a group's parameters (scales, then minimums) as a float; bytes
 * outside the payload read as 0, as core_word's do. */
__device__ static __forceinline__ float fast_param(const uint8_t *head, uint32_t head_bytes,
						   uint32_t offset)
{
	uint32_t lo = offset < head_bytes ? __ldg(head + offset) : 0u;
	uint32_t hi = offset + 1u < head_bytes ? __ldg(head + offset + 1u) : 0u;
	return CORE_HALF_TO_FLOAT(lo | hi << 8);
}

__device__ static void fast_load_params(const struct cuda_job *job, const struct core_tile *tile,
					const struct fast_tile *fast, float *params)
{
	const uint8_t *head = (const uint8_t *)(uintptr_t)tile->src;
	uint32_t per_group = 2u * job->dim;
	for (uint32_t slot = 0; slot < fast->slots; slot++) {
		int hi = slot < fast->hi_groups;
		uint32_t group = hi ? fast->hi_group0 + slot : fast->lo_group0 + (slot - fast->hi_groups);
		uint32_t base = (uint32_t)(hi ? job->hi_params_offset : job->lo_params_offset) +
				group * 2u * per_group;
		for (uint32_t e = threadIdx.x; e < per_group; e += TILE_THREADS)
			params[slot * per_group + e] =
				fast_param(head, (uint32_t)job->head_bytes, base + 2u * e);
	}
}

/*
 * Eight codes of a window into fp16 pairs, as core_quantized_item computes
 * them. Conversions issue at a fraction of the float rate, so a code
 * becomes a float by its bits (2^23 + code, exact, less 2^23: one
 * subtraction, exact) and two results round to fp16 in one instruction;
 * both are the same values and roundings as the plain conversions.
 */
template <typename Window>
__device__ static __forceinline__ void fast_values(Window window, uint32_t bits,
						   const float s[CHUNK_CHANNELS],
						   const float m[CHUNK_CHANNELS],
						   uint32_t out[CHUNK_CHANNELS / 2])
{
	uint32_t code_mask = (1u << bits) - 1u;
	float y[CHUNK_CHANNELS];
#pragma unroll
	for (uint32_t k = 0; k < CHUNK_CHANNELS; k++) {
		uint32_t code = (uint32_t)(window >> (k * bits)) & code_mask;
		float value = __fsub_rn(__uint_as_float(0x4b000000u | code), 8388608.0f);
		float v = CORE_ADD(CORE_MUL(value, s[k]), m[k]);
		/* As the CPU's max_keep/min_keep: the incumbent wins ties. */
		v = v > -65504.0f ? v : -65504.0f;
		y[k] = v < 65504.0f ? v : 65504.0f;
	}
#pragma unroll
	for (uint32_t k = 0; k < CHUNK_CHANNELS / 2; k++) {
		__half2 pair = __floats2half2_rn(y[2 * k], y[2 * k + 1]);
		out[k] = *(uint32_t *)&pair;
	}
}

/* Returns 1 when the mask sends a token past its subset (nothing written). */
__device__ static __forceinline__ int fast_item(const struct cuda_job *job,
						const struct core_tile *tile,
						const struct fast_tile *fast, const float *params,
						uint32_t i)
{
	uint32_t t = tile->first_token + (i >> fast->chunk_shift);
	if (i >= job->tile_tokens * job->chunks || t >= job->valid)
		return 0;
	uint32_t c0 = (i & (job->chunks - 1u)) * CHUNK_CHANNELS;
	uint32_t j = (t >> 6) - tile->first_word;
	uint64_t word = tile->mask[j];
	uint32_t below = t & 63u;
	uint32_t rank = tile->before[j] + (uint32_t)__popcll(word & ((UINT64_C(1) << below) - 1u));
	uint32_t salient = (uint32_t)(word >> below) & 1u;
	uint32_t row = salient ? rank : t - rank;
	uint32_t rows = salient ? job->n_hi : job->n_lo;
	uint32_t bits = salient ? job->hi_bits : job->lo_bits;
	uint32_t codes = (uint32_t)(salient ? job->hi_codes_offset : job->lo_codes_offset);
	if (row >= rows)
		return 1;
	uint32_t group = row >> fast->group_shift;
	uint32_t slot = salient ? group - fast->hi_group0 : fast->hi_groups + (group - fast->lo_group0);
	const float *scale = params + slot * 2u * job->dim + c0;
	const float *min = scale + job->dim;

	const uint8_t *head = (const uint8_t *)(uintptr_t)tile->src;
	uint32_t bit = codes * 8u + (row * job->dim + c0) * bits;
	uint64_t window;
	if (bits <= 4u) {
		uintptr_t address = (uintptr_t)head + (bit >> 3);
		uintptr_t aligned = address & ~(uintptr_t)3;
		uint32_t shift = (uint32_t)(address - aligned) * 8u + (bit & 7u);
		uint32_t w0 = core_word(head, job->head_bytes, aligned);
		uint32_t w1 = core_word(head, job->head_bytes, aligned + 4);
		window = __funnelshift_r(w0, w1, shift);
	} else {
		window = core_bits64(head, job->head_bytes, bit);
	}
	float4 s0 = *(const float4 *)scale, s1 = *(const float4 *)(scale + 4);
	float4 m0 = *(const float4 *)min, m1 = *(const float4 *)(min + 4);
	float s[CHUNK_CHANNELS] = { s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w };
	float m[CHUNK_CHANNELS] = { m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w };
	uint32_t out[CHUNK_CHANNELS / 2];
	if (bits <= 4u)
		fast_values((uint32_t)window, bits, s, m, out);
	else
		fast_values(window, bits, s, m, out);
	uint4 packed = make_uint4(out[0], out[1], out[2], out[3]);
	*(uint4 *)(uintptr_t)(tile->dst + 2u * ((uint64_t)t * job->dst_token + c0)) = packed;
	return 0;
}

__global__ void __launch_bounds__(TILE_THREADS, 8)
reconstruct_kernel(const struct cuda_launch *launch, const uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ struct core_tile tile;
	__shared__ struct fast_tile fast;
	__shared__ __align__(16) float params[FAST_PARAM_FLOATS];

	block_job_load(jobs, block_job_find(jobs, launch->n_jobs, blockIdx.x, 0), &job);
	__syncthreads();
	if (threadIdx.x == 0)
		core_tile_begin(&job, prefix, blockIdx.x - job.tile0, &tile);
	__syncthreads();
	if (tile.skip)
		return; /* the scan flagged this head; the error is set */
	if (threadIdx.x < tile.n_words)
		core_tile_word(&job, &tile, threadIdx.x);
	__syncthreads();
	int bad = 0;
	if (job.kind == JOB_QUANTIZED) {
		if (threadIdx.x == 0)
			fast_plan(&job, &tile, &fast);
		__syncthreads();
		if (fast.ok) {
			fast_load_params(&job, &tile, &fast, params);
			__syncthreads();
#pragma unroll 2
			for (uint32_t k = 0; k < TILE_ITEMS_PER_THREAD; k++)
				bad |= fast_item(&job, &tile, &fast, params, k * TILE_THREADS + threadIdx.x);
			if (bad)
				atomicOr(error, 1);
			return;
		}
	}
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
