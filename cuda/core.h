/*
 * What one thread computes: the reconstruction of one item (up to eight
 * channels of one token of one head), in the order docs/CODEC.md fixes.
 * Compiled twice: into the kernels by nvcc, and into the CPU emulation in
 * tests/cuda_plan_test.c by cc, which checks the indexing here against
 * zc_block_reconstruct on machines without a GPU. The two builds differ
 * only in CORE_FN and the fp16 conversions, which are exact (half to float)
 * or round-to-nearest-even with subnormals (float to half) on both sides.
 *
 * Reads: a payload may sit at any byte address, so multi-byte fields are
 * assembled from aligned 32-bit words, and a word that reaches outside the
 * head payload is assembled byte by byte from the bytes inside it (bytes
 * outside read as 0). Every read is therefore inside the payload, whatever
 * the mask says.
 */
#ifndef ZIPCACHE_CUDA_CORE_H
#define ZIPCACHE_CUDA_CORE_H

#include <stdint.h>

#include "job.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define CORE_FN __device__ static __forceinline__
#define CORE_HALF_TO_FLOAT(bits) __half2float(__ushort_as_half((unsigned short)(bits)))
#define CORE_FLOAT_TO_HALF(value) ((uint16_t)__half_as_ushort(__float2half_rn(value)))
#define CORE_POPCOUNT64(word) ((uint32_t)__popcll(word))
/* Separate, correctly rounded operations: the product is exact in any case
 * (code < 256 times an fp16 scale), and the sum must round once, as on the CPU. */
#define CORE_MUL(a, b) __fmul_rn(a, b)
#define CORE_ADD(a, b) __fadd_rn(a, b)
/* Through the read-only data cache: nothing a kernel reads is written
 * during it, and saying so lets loads of later items start early. */
#define CORE_LOAD32(address) __ldg((const unsigned int *)(address))
#else
#include "zipcache/codec.h"
#define CORE_FN static inline
#define CORE_HALF_TO_FLOAT(bits) zc_fp16_to_float((uint16_t)(bits))
#define CORE_FLOAT_TO_HALF(value) zc_float_to_fp16(value)
#define CORE_POPCOUNT64(word) ((uint32_t)__builtin_popcountll(word))
#define CORE_MUL(a, b) ((a) * (b))
#define CORE_ADD(a, b) ((a) + (b))
#define CORE_LOAD32(address) (*(const uint32_t *)(address))
#endif

/* The little-endian 32-bit word at address `at` (4-aligned, may lie partly
 * outside [base, base + size)): one load when it lies inside, else its
 * bytes inside, the others 0. */
CORE_FN uint32_t core_word(const uint8_t *base, uint64_t size, uintptr_t at)
{
	uintptr_t begin = (uintptr_t)base, end = begin + size;
	if (at >= begin && at + 4 <= end)
		return CORE_LOAD32(at);
	uint32_t word = 0;
	for (uint32_t i = 0; i < 4; i++) {
		uintptr_t byte = at + i;
		if (byte >= begin && byte < end)
			word |= (uint32_t)base[byte - begin] << (8 * i);
	}
	return word;
}

/* 64 bits of the byte stream base[0 .. size) from bit `bit` on (LSB first). */
CORE_FN uint64_t core_bits64(const uint8_t *base, uint64_t size, uint64_t bit)
{
	uintptr_t address = (uintptr_t)base + (uintptr_t)(bit >> 3);
	uintptr_t aligned = address & ~(uintptr_t)3;
	uint32_t shift = (uint32_t)(address - aligned) * 8u + (uint32_t)(bit & 7u);
	uint64_t low = (uint64_t)core_word(base, size, aligned) |
		       (uint64_t)core_word(base, size, aligned + 4) << 32;
	if (shift == 0)
		return low;
	uint64_t high = core_word(base, size, aligned + 8);
	return (low >> shift) | (high << (64u - shift));
}

/* 16 bytes of the stream from byte `offset` on, as two little-endian
 * 64-bit halves: five aligned words at most. */
CORE_FN void core_bytes16(const uint8_t *base, uint64_t size, uint64_t offset, uint64_t out[2])
{
	uintptr_t address = (uintptr_t)base + (uintptr_t)offset;
	uintptr_t aligned = address & ~(uintptr_t)3;
	uint32_t shift = (uint32_t)(address - aligned) * 8u;
	uint64_t w0 = core_word(base, size, aligned), w1 = core_word(base, size, aligned + 4);
	uint64_t w2 = core_word(base, size, aligned + 8), w3 = core_word(base, size, aligned + 12);
	uint64_t low = w0 | w1 << 32, high = w2 | w3 << 32;
	if (shift == 0) {
		out[0] = low;
		out[1] = high;
		return;
	}
	uint64_t w4 = core_word(base, size, aligned + 16);
	out[0] = (low >> shift) | (high << (64u - shift));
	out[1] = (high >> shift) | (w4 << (64u - shift));
}

/* The mask word of tokens 64*w .. 64*w + 63 (bits past the mask's tokens
 * cleared). */
CORE_FN uint64_t core_mask_word(const struct cuda_job *job, const uint8_t *head, uint32_t w)
{
	uint64_t word = core_bits64(head, job->head_bytes, job->mask_offset * 8u + (uint64_t)w * 64u);
	uint32_t left = job->tokens - w * 64u;
	if (left < 64u)
		word &= (UINT64_C(1) << left) - 1u;
	return word;
}

/* 0 if the mask word's stray bits (past the last token, inside the mask's
 * bytes) are clear, as zc_block_reconstruct demands. */
CORE_FN int core_mask_stray(const struct cuda_job *job, const uint8_t *head, uint32_t w)
{
	uint32_t left = job->tokens - w * 64u;
	if (left >= 64u || (job->tokens & 7u) == 0)
		return 0;
	uint64_t raw = core_bits64(head, job->head_bytes, job->mask_offset * 8u + (uint64_t)w * 64u);
	uint32_t mask_bits = ((job->tokens + 7u) & ~7u) - w * 64u;
	uint64_t in_mask = mask_bits >= 64u ? ~UINT64_C(0) : (UINT64_C(1) << mask_bits) - 1u;
	uint64_t stray = raw & ~((UINT64_C(1) << left) - 1u) & in_mask;
	return stray != 0;
}

/*
 * Channels c0 .. c0 + n - 1 (n <= 8) of token t of a quantized head into
 * out[0 .. n). word: the mask word of token t (core_mask_word of t / 64);
 * prefix_word: the number of salient tokens before that word. Returns 0,
 * or -1 (out untouched) when the mask puts the token past its subset's
 * rows (a corrupt payload).
 */
CORE_FN int core_quantized_item(const struct cuda_job *job, const uint8_t *head, uint64_t word,
				uint32_t prefix_word, uint32_t t, uint32_t c0, uint32_t n,
				uint16_t out[CHUNK_CHANNELS])
{
	uint32_t below = t & 63u;
	uint32_t rank = prefix_word + CORE_POPCOUNT64(word & ((UINT64_C(1) << below) - 1u));
	uint32_t salient = (uint32_t)(word >> below) & 1u;
	uint32_t row = salient ? rank : t - rank;
	uint32_t rows = salient ? job->n_hi : job->n_lo;
	uint32_t bits = salient ? job->hi_bits : job->lo_bits;
	uint64_t params = salient ? job->hi_params_offset : job->lo_params_offset;
	uint64_t codes = salient ? job->hi_codes_offset : job->lo_codes_offset;
	uint64_t dim = job->dim;

	if (row >= rows)
		return -1;
	uint64_t scales = params + (uint64_t)(row / job->group_size) * 4u * dim + 2u * c0;
	uint64_t window = core_bits64(head, job->head_bytes,
				      codes * 8u + ((uint64_t)row * dim + c0) * bits);
	uint64_t scale_bits[2], min_bits[2];
	core_bytes16(head, job->head_bytes, scales, scale_bits);
	core_bytes16(head, job->head_bytes, scales + 2u * dim, min_bits);
	uint32_t code_mask = (1u << bits) - 1u;
	for (uint32_t i = 0; i < CHUNK_CHANNELS; i++) {
		if (i >= n)
			break;
		uint32_t code = (uint32_t)(window >> (i * bits)) & code_mask;
		float scale = CORE_HALF_TO_FLOAT((scale_bits[i >> 2] >> (16u * (i & 3u))) & 0xffffu);
		float min = CORE_HALF_TO_FLOAT((min_bits[i >> 2] >> (16u * (i & 3u))) & 0xffffu);
		float y = CORE_ADD(CORE_MUL((float)code, scale), min);
		/* As the CPU's max_keep/min_keep: the incumbent wins ties. */
		y = y > -65504.0f ? y : -65504.0f;
		y = y < 65504.0f ? y : 65504.0f;
		out[i] = CORE_FLOAT_TO_HALF(y);
	}
	return 0;
}

/* Where flat head h of a job lands and, quantized, where its payload is. */
CORE_FN uint64_t core_dst_head(const struct cuda_job *job, uint32_t h)
{
	uint32_t flat = job->head0 + h;
	return job->dst + 2u * ((uint64_t)(flat / job->heads_per_batch) * job->dst_batch +
				(uint64_t)(flat % job->heads_per_batch) * job->dst_head);
}

CORE_FN uint64_t core_src_head(const struct cuda_job *job, uint32_t h)
{
	if (job->kind == JOB_QUANTIZED)
		return job->src + (uint64_t)h * job->head_bytes;
	uint32_t flat = job->head0 + h;
	return job->src + 2u * ((uint64_t)(flat / job->heads_per_batch) * job->src_batch +
				(uint64_t)(flat % job->heads_per_batch) * job->src_head);
}

/* The job of a launch whose range (of tiles, or of scan blocks) holds
 * index: jobs start where the previous one ended, an empty one where its
 * successor starts, so the last job starting at or below index is it. */
CORE_FN uint64_t core_job_find(const struct cuda_job *jobs, uint64_t n, uint64_t index, int scan)
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

/* What a tile's threads share: its head, its first token, its addresses,
 * and (quantized) the mask words of its tokens with their prefix counts. */
struct core_tile {
	uint64_t dst, src;
	uint32_t first_token;
	uint32_t first_word, n_words;
	int skip;                /* the scan found the head's mask corrupt: write nothing */
	const uint32_t *words;   /* quantized: the head's prefix counts */
	uint64_t mask[TILE_MASK_WORDS];
	uint32_t before[TILE_MASK_WORDS];
};

CORE_FN void core_tile_begin(const struct cuda_job *job, const uint32_t *prefix, uint64_t local,
			     struct core_tile *tile)
{
	uint32_t h = (uint32_t)(local / job->tiles_per_head);
	tile->first_token = (uint32_t)(local % job->tiles_per_head) * job->tile_tokens;
	tile->dst = core_dst_head(job, h);
	tile->src = core_src_head(job, h);
	tile->words = 0;
	tile->skip = 0;
	tile->first_word = tile->first_token >> 6;
	tile->n_words = 0;
	if (job->kind == JOB_QUANTIZED) {
		uint32_t last = tile->first_token + job->tile_tokens;
		last = (last < job->valid ? last : job->valid) - 1u;
		tile->n_words = (last >> 6) - tile->first_word + 1u;
		tile->words = prefix + job->prefix + (uint64_t)h * (job->words + 1u);
		tile->skip = tile->words[job->words] != 0;
	}
}

/* Mask word j (< n_words) of the tile and its prefix count; the threads of
 * a block load them side by side. */
CORE_FN void core_tile_word(const struct cuda_job *job, struct core_tile *tile, uint32_t j)
{
	uint32_t w = tile->first_word + j;
	tile->mask[j] = core_mask_word(job, (const uint8_t *)(uintptr_t)tile->src, w);
	tile->before[j] = tile->words[w];
}

#ifdef __CUDACC__
CORE_FN void core_load_row(uint64_t address, uint16_t value[CHUNK_CHANNELS], uint32_t n, int vector)
{
	if (vector && n == CHUNK_CHANNELS) {
		uint4 packed = __ldg((const uint4 *)(uintptr_t)address);
		value[0] = (uint16_t)packed.x;
		value[1] = (uint16_t)(packed.x >> 16);
		value[2] = (uint16_t)packed.y;
		value[3] = (uint16_t)(packed.y >> 16);
		value[4] = (uint16_t)packed.z;
		value[5] = (uint16_t)(packed.z >> 16);
		value[6] = (uint16_t)packed.w;
		value[7] = (uint16_t)(packed.w >> 16);
		return;
	}
	const uint16_t *row = (const uint16_t *)(uintptr_t)address;
	for (uint32_t i = 0; i < n; i++)
		value[i] = row[i];
}

CORE_FN void core_store_row(uint64_t address, const uint16_t value[CHUNK_CHANNELS], uint32_t n,
			    int vector)
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
#else
#include <string.h>

CORE_FN void core_load_row(uint64_t address, uint16_t value[CHUNK_CHANNELS], uint32_t n, int vector)
{
	(void)vector;
	memcpy(value, (const void *)(uintptr_t)address, 2u * n);
}

CORE_FN void core_store_row(uint64_t address, const uint16_t value[CHUNK_CHANNELS], uint32_t n,
			    int vector)
{
	(void)vector;
	memcpy((void *)(uintptr_t)address, value, 2u * n);
}
#endif

/* Item i (0 .. TILE_ITEMS - 1) of a tile: token first_token + i / chunks,
 * channels from 8 * (i % chunks). Returns 0 (done, or nothing to do past
 * the tile's tokens), or -1 when the mask sends the token past its
 * subset (nothing written). */
CORE_FN int core_tile_item(const struct cuda_job *job, const struct core_tile *tile, uint32_t i)
{
	uint32_t t = tile->first_token + i / job->chunks;
	if (i >= job->tile_tokens * job->chunks || t >= job->valid)
		return 0;
	uint32_t c0 = (i % job->chunks) * CHUNK_CHANNELS;
	uint32_t n = job->dim - c0 < CHUNK_CHANNELS ? job->dim - c0 : CHUNK_CHANNELS;
	uint16_t value[CHUNK_CHANNELS];
	if (job->kind == JOB_QUANTIZED) {
		uint32_t j = (t >> 6) - tile->first_word;
		if (core_quantized_item(job, (const uint8_t *)(uintptr_t)tile->src, tile->mask[j],
					tile->before[j], t, c0, n, value) < 0)
			return -1;
	} else {
		core_load_row(tile->src + 2u * ((uint64_t)t * job->src_token + c0), value, n,
			      (int)job->vector);
	}
	core_store_row(tile->dst + 2u * ((uint64_t)t * job->dst_token + c0), value, n,
		       (int)job->vector);
	return 0;
}

#endif
