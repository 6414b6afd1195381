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
 * Three paths, the first that applies: the table path (below), the fast
 * path, and core.h's item for anything else; all bit for bit the CPU's.
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

/*
 * The table path: the fast path's arithmetic with its per-item overhead
 * moved out of the item loop. What depends on the token alone (its rank in
 * the mask, row, subset, code offset, parameter slot) is computed once per
 * token into shared memory, not once per 8 channels; a thread keeps one
 * channel chunk c0 for all its items (TILE_THREADS is a multiple of the
 * chunks), so the head's fields live in registers; a window is two or three
 * aligned words under one bound check. Tiles of more tokens than the table
 * holds, or of more chunks than threads, take the fast path above.
 */
#define TABLE_TOKENS 512u
#define TABLE_BAD 0xffffffffu   /* the mask sends the token past its subset */
#ifndef ZC_TABLE_UNROLL
#define ZC_TABLE_UNROLL 1
#endif
static constexpr int table_unroll = ZC_TABLE_UNROLL;

/* Blocks per SM the compiler plans registers for: 5 gives 48 registers,
 * no spills (the shared memory allows 5 blocks too); 8 gives 32 with spills
 * in the item loop, 6 gives 40 with some: measured on an H200, 5 was the
 * fastest (docs/BENCHMARKS.md). */
#ifndef ZC_TILE_BLOCKS_PER_SM
#define ZC_TILE_BLOCKS_PER_SM 5
#endif

/* Two floats to an fp16 pair, lo in the low half, round to nearest even.
 * Callers pass y >= -65504 (or NaN-free: see table_values); satfinite then
 * rounds what the CPU clamps at 65504 to 65504, as the clamp does, and
 * leaves every other value to the plain rounding. */
__device__ static __forceinline__ uint32_t table_pack(float lo, float hi)
{
#if defined(ZC_NO_SATFINITE)
	__half2 pair = __floats2half2_rn(fminf(lo, 65504.0f), fminf(hi, 65504.0f));
	return *(uint32_t *)&pair;
#else
	uint32_t r;
	asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
#endif
}

/*
 * Eight codes into fp16 pairs, bit for bit core_quantized_item's values:
 * code * scale is exact (a code < 256 times an fp16 scale has at most 19
 * significant bits), so one fused multiply-add rounds once, as the CPU's
 * product-then-sum does. The CPU then takes max(y, -65504), which sends
 * NaN to -65504 as fmaxf does, and min(y, 65504), which satfinite does.
 */
template <typename Window>
__device__ static __forceinline__ void table_values(Window window, uint32_t bits,
						    uint32_t code_mask, const float4 p0,
						    const float4 p1, const float4 p2,
						    const float4 p3, uint4 *out)
{
	const float s[CHUNK_CHANNELS] = { p0.x, p0.z, p1.x, p1.z, p2.x, p2.z, p3.x, p3.z };
	const float m[CHUNK_CHANNELS] = { p0.y, p0.w, p1.y, p1.w, p2.y, p2.w, p3.y, p3.w };
	float y[CHUNK_CHANNELS];
#pragma unroll
	for (uint32_t k = 0; k < CHUNK_CHANNELS; k++) {
		uint32_t code = (uint32_t)window & code_mask;
		window >>= bits;
		float value = __fsub_rn(__uint_as_float(0x4b000000u | code), 8388608.0f);
		y[k] = fmaxf(__fmaf_rn(value, s[k], m[k]), -65504.0f);
	}
	out->x = table_pack(y[0], y[1]);
	out->y = table_pack(y[2], y[3]);
	out->z = table_pack(y[4], y[5]);
	out->w = table_pack(y[6], y[7]);
}

/* Whether the table path takes this tile (fast->ok already). */
__device__ static __forceinline__ int table_ok(const struct cuda_job *job)
{
	return job->chunks <= TILE_THREADS && job->tile_tokens <= TABLE_TOKENS &&
	       job->head_bytes >= 16u;
}

/* Two fp16 of the payload at byte offset `offset` (any alignment), low one
 * first, from aligned words under one bound check; bytes outside read as 0. */
__device__ static __forceinline__ uint32_t table_pair(const uint8_t *head, uint32_t head_bytes,
						      uint32_t offset)
{
	uintptr_t address = (uintptr_t)head + offset;
	uintptr_t aligned = address & ~(uintptr_t)3;
	uint32_t rel = (uint32_t)(aligned - (uintptr_t)head); /* wraps below head */
	uint32_t w0, w1;
	if (rel <= head_bytes - 8u) {
		w0 = __ldg((const unsigned int *)aligned);
		w1 = __ldg((const unsigned int *)aligned + 1);
	} else {
		w0 = core_word(head, head_bytes, aligned);
		w1 = core_word(head, head_bytes, aligned + 4);
	}
	return __funnelshift_r(w0, w1, (uint32_t)(address - aligned) * 8u);
}

/* The parameters of the tile's groups as floats, laid out for the item
 * loop's 16-byte loads: a slot holds 4 planes of dim / 2 floats, and plane
 * q holds for each chunk of 8 channels c0 .. c0 + 7 the scale and minimum
 * of channels c0 + 2q and c0 + 2q + 1. The threads of a token, one chunk
 * each, then read consecutive 16 bytes of a plane (two shared-memory
 * wavefronts for 16 threads; channel-major pairs would take eight). A
 * thread-step converts two channels. */
__device__ static void table_load_params(const struct cuda_job *job, const struct core_tile *tile,
					 const struct fast_tile *fast, float *params)
{
	const uint8_t *head = (const uint8_t *)(uintptr_t)tile->src;
	uint32_t dim = job->dim, half = dim / 2u, head_bytes = (uint32_t)job->head_bytes;
	uint32_t total = fast->slots * half;
	uint32_t slot = threadIdx.x / half, e = threadIdx.x - slot * half;
	for (uint32_t idx = threadIdx.x; idx < total; idx += TILE_THREADS) {
		int hi = slot < fast->hi_groups;
		uint32_t group = hi ? fast->hi_group0 + slot : fast->lo_group0 + (slot - fast->hi_groups);
		uint32_t offset = (uint32_t)(hi ? job->hi_params_offset : job->lo_params_offset) +
				  group * 4u * dim + 4u * e;
		uint32_t scales = table_pair(head, head_bytes, offset);
		uint32_t mins = table_pair(head, head_bytes, offset + 2u * dim);
		float4 f = make_float4(CORE_HALF_TO_FLOAT(scales & 0xffffu), CORE_HALF_TO_FLOAT(mins & 0xffffu),
				       CORE_HALF_TO_FLOAT(scales >> 16), CORE_HALF_TO_FLOAT(mins >> 16));
		*(float4 *)&params[2u * slot * dim + (e & 3u) * half + 4u * (e >> 2)] = f;
		e += TILE_THREADS;
		while (e >= half) {
			e -= half;
			slot++;
		}
	}
}

/* Each token of the tile: its code bit offset, its parameter slot and subset. */
__device__ static void table_fill(const struct cuda_job *job, const struct core_tile *tile,
				  const struct fast_tile *fast, uint2 *table, uint32_t n_tokens)
{
	for (uint32_t l = threadIdx.x; l < n_tokens; l += TILE_THREADS) {
		uint32_t t = tile->first_token + l;
		uint32_t j = (t >> 6) - tile->first_word;
		uint64_t word = tile->mask[j];
		uint32_t below = t & 63u;
		uint32_t rank = tile->before[j] +
				(uint32_t)__popcll(word & ((UINT64_C(1) << below) - 1u));
		uint32_t salient = (uint32_t)(word >> below) & 1u;
		uint32_t row = salient ? rank : t - rank;
		uint32_t rows = salient ? job->n_hi : job->n_lo;
		uint32_t bits = salient ? job->hi_bits : job->lo_bits;
		uint32_t codes = (uint32_t)(salient ? job->hi_codes_offset : job->lo_codes_offset);
		uint2 entry = make_uint2(0u, TABLE_BAD);
		if (row < rows) {
			uint32_t group = row >> fast->group_shift;
			uint32_t slot = salient ? group - fast->hi_group0
						: fast->hi_groups + (group - fast->lo_group0);
			entry.x = codes * 8u + row * job->dim * bits;
			entry.y = slot * 2u * job->dim | salient << 31;
		}
		table[l] = entry;
	}
}

/* A thread's items on the table path; returns 1 when a token was past its
 * subset. Narrow: both widths <= 4, so 8 codes fit a 32-bit window. */
template <int Narrow>
__device__ static __forceinline__ int table_items(const struct cuda_job *job,
						  const struct core_tile *tile,
						  const struct fast_tile *fast, const float *params,
						  const uint2 *table, uint32_t n_tokens)
{
	const uint8_t *head = (const uint8_t *)(uintptr_t)tile->src;
	const uint32_t head_bytes = (uint32_t)job->head_bytes;
	const uint32_t c0 = (threadIdx.x & (job->chunks - 1u)) * CHUNK_CHANNELS;
	const uint32_t step = TILE_THREADS >> fast->chunk_shift;
	const uint32_t bits_pair = job->hi_bits << 16 | job->lo_bits;
	const uint32_t limit = head_bytes - (Narrow ? 8u : 12u);
	uint32_t local = threadIdx.x >> fast->chunk_shift;
	uint64_t dst = tile->dst + 2u * ((uint64_t)(tile->first_token + local) * job->dst_token + c0);
	const uint64_t dst_step = 2u * (uint64_t)step * job->dst_token;
	const uint32_t plane = job->dim / 2u;
	const float *pbase = params + c0 / 2u;
	uint32_t end = local + TILE_ITEMS_PER_THREAD * step;
	end = end < n_tokens ? end : n_tokens;
	int bad = 0;
#pragma unroll table_unroll
	for (; local < end; local += step, dst += dst_step) {
		uint2 entry = table[local];
		if (entry.y == TABLE_BAD) {
			bad = 1;
			continue;
		}
		uint32_t salient = entry.y >> 31;
		uint32_t bits = salient ? bits_pair >> 16 : bits_pair & 0xffffu;
		uint32_t code_mask = (1u << bits) - 1u;
		uint32_t bit = entry.x + c0 * bits;
		const float *scale = pbase + (entry.y & 0x7fffffffu);
		float4 p0 = *(const float4 *)scale, p1 = *(const float4 *)(scale + plane);
		float4 p2 = *(const float4 *)(scale + 2u * plane),
		       p3 = *(const float4 *)(scale + 3u * plane);
		uintptr_t address = (uintptr_t)head + (bit >> 3);
		uintptr_t aligned = address & ~(uintptr_t)3;
		uint32_t rel = (uint32_t)(aligned - (uintptr_t)head); /* wraps below head */
		uint32_t shift = (uint32_t)(address - aligned) * 8u + (bit & 7u);
		uint4 packed;
		if (Narrow) {
			uint32_t w0, w1;
			if (rel <= limit) {
				w0 = __ldg((const unsigned int *)aligned);
				w1 = __ldg((const unsigned int *)aligned + 1);
			} else {
				w0 = core_word(head, head_bytes, aligned);
				w1 = core_word(head, head_bytes, aligned + 4);
			}
			table_values(__funnelshift_r(w0, w1, shift), bits, code_mask, p0, p1, p2, p3,
				     &packed);
		} else {
			uint32_t w0, w1, w2;
			if (rel <= limit) {
				w0 = __ldg((const unsigned int *)aligned);
				w1 = __ldg((const unsigned int *)aligned + 1);
				w2 = __ldg((const unsigned int *)aligned + 2);
			} else {
				w0 = core_word(head, head_bytes, aligned);
				w1 = core_word(head, head_bytes, aligned + 4);
				w2 = core_word(head, head_bytes, aligned + 8);
			}
			uint64_t window = (uint64_t)__funnelshift_r(w0, w1, shift) |
					  (uint64_t)__funnelshift_r(w1, w2, shift) << 32;
			table_values(window, bits, code_mask, p0, p1, p2, p3, &packed);
		}
		*(uint4 *)(uintptr_t)dst = packed;
	}
	return bad;
}

/* The paths the table path leaves, as calls: their registers then do not
 * weigh on the table path's allocation (ptxas plans the kernel for its
 * most demanding path). */
#ifdef ZC_INLINE_COLD
#define COLD_FN __device__ static __forceinline__
#else
#define COLD_FN __device__ static __noinline__
#endif

COLD_FN int fast_items(const struct cuda_job *job, const struct core_tile *tile,
		       const struct fast_tile *fast, const float *params)
{
	int bad = 0;
#pragma unroll 2
	for (uint32_t k = 0; k < TILE_ITEMS_PER_THREAD; k++)
		bad |= fast_item(job, tile, fast, params, k * TILE_THREADS + threadIdx.x);
	return bad;
}

COLD_FN int general_items(const struct cuda_job *job, const struct core_tile *tile)
{
	int bad = 0;
#pragma unroll 2
	for (uint32_t k = 0; k < TILE_ITEMS_PER_THREAD; k++)
		bad |= core_tile_item(job, tile, k * TILE_THREADS + threadIdx.x);
	return bad;
}

__global__ void __launch_bounds__(TILE_THREADS, ZC_TILE_BLOCKS_PER_SM)
reconstruct_kernel(const struct cuda_launch *launch, const uint32_t *prefix, int *error)
{
	const struct cuda_job *jobs = (const struct cuda_job *)(launch + 1);
	__shared__ struct cuda_job job;
	__shared__ struct core_tile tile;
	__shared__ struct fast_tile fast;
	__shared__ __align__(16) float params[FAST_PARAM_FLOATS];
	__shared__ uint2 table[TABLE_TOKENS];

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
#ifndef ZC_NO_TABLE
		if (fast.ok && table_ok(&job)) {
			uint32_t n_tokens = job.valid - tile.first_token;
			n_tokens = n_tokens < job.tile_tokens ? n_tokens : job.tile_tokens;
			table_load_params(&job, &tile, &fast, params);
			table_fill(&job, &tile, &fast, table, n_tokens);
			__syncthreads();
			if (job.hi_bits <= 4u && job.lo_bits <= 4u)
				bad = table_items<1>(&job, &tile, &fast, params, table, n_tokens);
			else
				bad = table_items<0>(&job, &tile, &fast, params, table, n_tokens);
			if (bad)
				atomicOr(error, 1);
			return;
		}
#endif
		if (fast.ok) {
			fast_load_params(&job, &tile, &fast, params);
			__syncthreads();
			bad = fast_items(&job, &tile, &fast, params);
			if (bad)
				atomicOr(error, 1);
			return;
		}
	}
	bad = general_items(&job, &tile);
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
#ifdef ZC_DIAG_SCAN2 /* timing only: what the scan costs */
	if (scan_heads)
		scan_kernel<<<(unsigned)scan_heads, TILE_THREADS, 0, s>>>(launch, prefix, error);
#endif
	if (tiles)
		reconstruct_kernel<<<(unsigned)tiles, TILE_THREADS, 0, s>>>(launch, prefix, error);
#ifdef ZC_DIAG_REC2 /* timing only: what the reconstruction costs */
	if (tiles)
		reconstruct_kernel<<<(unsigned)tiles, TILE_THREADS, 0, s>>>(launch, prefix, error);
#endif
	return (int)cudaGetLastError();
}
