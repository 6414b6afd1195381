/*
 * The inner loops of attention (codec/attend.c), one table per ISA like
 * the codec's (kernels.h). attend.c walks segments, heads and 64-token
 * chunks; a kernel only sees rows of one head and, for compressed rows,
 * one quantization group. Every table gives bit-identical results:
 * docs/ATTEND.md fixes the order of every operation and the tests compare
 * the tables.
 *
 * Query rows: the R rows of one (batch, KV head) pair, R = q_heads /
 * kv_heads * n_q; q[r*q_stride + c] in fp32, already multiplied by
 * scale * log2(e), with q_stride a multiple of 16 and R padded with zero
 * rows to a multiple of 4 (ATTEND_QUERY_PAD), so kernels may read whole
 * tiles. Scores and weights of a chunk: s[r*ATTEND_CHUNK + position].
 *
 * Compressed rows: n_rows consecutive subset rows of one group, the
 * first one's codes at bit_offset of stream (each next one dim*bits bits
 * further), decoded to exactly the fp16 value zc_block_reconstruct()
 * stores, then widened to fp32. Bytes may be read (never used) up to
 * read_end, never past it.
 *
 * Group cache: `cache` (ATTEND_CACHE_BYTES, 64-byte aligned, or NULL) is
 * scratch in which a codes kernel may keep what depends only on the
 * group (scales, mins, bits, dim) from one call to the next; attend.c
 * gives each code stream of a (batch, KV head) pair its own and zeroes
 * its first ATTEND_CACHE_KEY_BYTES, where a kernel keeps which group the
 * rest is for, before the pair, so a group that spans chunks is
 * prepared once. What is kept changes no result: a kernel computes
 * the same bits with or without it.
 */
#ifndef ZIPCACHE_ATTEND_KERNELS_H
#define ZIPCACHE_ATTEND_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Tokens per online-softmax step: one 64-bit word of a saliency mask. */
#define ATTEND_CHUNK 64u
/* Query rows are padded to a multiple of this, with zeros. */
#define ATTEND_QUERY_PAD 4u
/* The bytes of one group cache (see above). */
#define ATTEND_CACHE_BYTES 8192u
#define ATTEND_CACHE_KEY_BYTES 64u

struct attend_kernels {
	const char *name;
	/* s[r*ATTEND_CHUNK + pos[i]] = dot(q row r, key row i) for r < n_q
	 * rows of q and i < n_rows; key row i at rows + i*row_stride. */
	void (*score_fp16)(const uint16_t *rows, size_t row_stride, size_t n_rows, size_t dim,
			   const float *q, size_t n_q, size_t q_stride, float *s,
			   const uint8_t *pos);
	void (*score_codes)(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
			    size_t n_rows, size_t dim, int bits, const uint8_t *scales,
			    const uint8_t *mins, const float *q, size_t n_q, size_t q_stride,
			    float *s, const uint8_t *pos, void *cache);
	/* part[r*part_stride + c] += sum over i of p[r*ATTEND_CHUNK + i] *
	 * value row i [c], i in increasing order, one fma each, for r < n_p. */
	void (*accumulate_fp16)(const uint16_t *rows, size_t row_stride, size_t n_rows,
				size_t dim, const float *p, size_t n_p, float *part,
				size_t part_stride);
	void (*accumulate_codes)(const uint8_t *stream, const uint8_t *read_end,
				 size_t bit_offset, size_t n_rows, size_t dim, int bits,
				 const uint8_t *scales, const uint8_t *mins, const float *p,
				 size_t n_p, float *part, size_t part_stride, void *cache);
	/* The online-softmax step of one chunk (attend_softmax.h). */
	void (*softmax)(float *s, size_t n_rows, float *m, float *l, float *alpha);
	/* acc = acc * alpha[r] + part, row by row; part is zeroed. */
	void (*combine)(float *acc, float *part, size_t n_rows, size_t stride,
			const float *alpha);
};

extern const struct attend_kernels attend_kernels_scalar;
extern const struct attend_kernels attend_kernels_avx2;
extern const struct attend_kernels attend_kernels_avx512;

#endif
