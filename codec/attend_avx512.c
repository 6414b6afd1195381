/*
 * AVX-512 attention kernels (F, BW, VL, DQ + F16C + BMI2): 16 channels per
 * vector, which is exactly the 16-lane order of the dot products, so lane
 * j of an accumulator is lane j of the reference's. Scores come in tiles
 * of rows x query rows (16 accumulators) folded together by
 * codec_fold16x16; values accumulate with channels across the vector and
 * tokens in order, one FMA each, like attend_scalar.c.
 */
#include "attend_kernels.h"

#include <immintrin.h>
#include <string.h>

#include "attend_softmax.h"
#include "fold_avx512.h"
#include "zipcache/codec.h"

#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* How far ahead rows are prefetched: one chunk. A head's rows are read
 * in 64-row bursts (K, then V, then the next chunk's K), too short and
 * too interleaved for the hardware prefetchers to run ahead: without the
 * hints the fp16 path ran at a fifth of the memory bandwidth. */
#define PREFETCH_ROWS ATTEND_CHUNK

static __mmask16 tail_mask16(size_t remaining)
{
	return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

/* Where the rows of one kernel call come from. */
struct rows_src {
	const uint16_t *rows;          /* fp16: row i at rows + i*row_stride */
	size_t row_stride;
	const uint8_t *stream, *read_end; /* codes: row i at bit_offset + i*dim*bits */
	size_t bit_offset, dim;
	int bits;
	uint64_t lanes;                /* PDEP mask: `bits` low bits of each byte */
	const uint8_t *scales, *mins;
	bool safe;                     /* every 8-byte code load lies before read_end */
};

/* One group's params for 16 channels, and whether the clamp of
 * docs/CODEC.md can change anything there (see kernels_avx512.c's
 * recon_params: with 0 <= scale < Inf, min >= -65504 and
 * max_code*scale + min <= 65504 it is the identity). */
struct params16 {
	__m512 scale, min;
	bool clamp;
};

static ALWAYS_INLINE struct params16 params_load(const struct rows_src *src, size_t c,
						 __mmask16 mask)
{
	const __m512 largest = _mm512_set1_ps(65504.0f);
	const __m512 zero = _mm512_setzero_ps();
	struct params16 p;
	/* The params two groups on (about one chunk for groups of 32). */
	if (c % 32 == 0) {
		_mm_prefetch((const char *)src->scales + 2 * c + 8 * src->dim, _MM_HINT_T0);
		_mm_prefetch((const char *)src->mins + 2 * c + 8 * src->dim, _MM_HINT_T0);
	}
	p.scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src->scales + 2 * c));
	p.min = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src->mins + 2 * c));
	__m512 top = _mm512_fmadd_ps(_mm512_set1_ps((float)((1 << src->bits) - 1)), p.scale,
				     p.min);
	__mmask16 good = _mm512_cmp_ps_mask(p.scale, zero, _CMP_GE_OQ) &
			 _mm512_cmp_ps_mask(p.scale, _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ) &
			 _mm512_cmp_ps_mask(p.min, _mm512_sub_ps(zero, largest), _CMP_GE_OQ) &
			 _mm512_cmp_ps_mask(top, largest, _CMP_LE_OQ);
	p.clamp = good != 0xffff;
	return p;
}

static ALWAYS_INLINE uint64_t load_codes64(const uint8_t *at, const uint8_t *read_end, bool safe)
{
	uint64_t value = 0;
	if (safe || at + 8 <= read_end)
		memcpy(&value, at, 8);
	else if (at < read_end)
		memcpy(&value, at, (size_t)(read_end - at));
	return value;
}

/* Row i, channels c..c+15, as fp32 of the fp16 the reconstruction stores. */
static ALWAYS_INLINE __m512 row_load16(const struct rows_src *src, bool codes, size_t i, size_t c,
				       __mmask16 mask, const struct params16 *p)
{
	if (!codes) {
		const uint16_t *at = src->rows + i * src->row_stride + c;
		/* fp16 rows are 4x the bytes: ask for the next chunk's line now,
		 * one hint per line, spread over the work (prefetches never
		 * fault, so past the segment's end they cost only the hint). */
		if (c % 32 == 0)
			_mm_prefetch((const char *)(at + PREFETCH_ROWS * src->row_stride), _MM_HINT_T0);
		return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
	}
	size_t bit = src->bit_offset + (i * src->dim + c) * (size_t)src->bits;
	size_t next = bit + 8 * (size_t)src->bits;
	if (c == 0)
		_mm_prefetch((const char *)src->stream + (bit >> 3) +
				     PREFETCH_ROWS * src->dim * (size_t)src->bits / 8,
			     _MM_HINT_T0);
	uint64_t first = load_codes64(src->stream + (bit >> 3), src->read_end, src->safe) >>
			 (bit & 7u);
	uint64_t second = load_codes64(src->stream + (next >> 3), src->read_end, src->safe) >>
			  (next & 7u);
	__m128i bytes = _mm_insert_epi64(_mm_cvtsi64_si128((long long)_pdep_u64(first, src->lanes)),
					 (long long)_pdep_u64(second, src->lanes), 1);
	/* The product is exact: one rounding, as the reference's mul + add. */
	__m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), p->scale,
				   p->min);
	if (p->clamp) {
		y = _mm512_max_ps(y, _mm512_set1_ps(-65504.0f));
		y = _mm512_min_ps(y, _mm512_set1_ps(65504.0f));
	}
	return _mm512_cvtph_ps(_mm512_cvtps_ph(y, ROUND_NEAREST));
}

/*
 * Scores of TR rows (from i0; only the first n_rows are real) against QB
 * query rows (from q): 16 accumulators, accumulator i*QB + r holding the
 * 16 lanes of row i times query r, folded together at the end.
 */
static ALWAYS_INLINE void score_tile(const struct rows_src *src, bool codes, size_t i0,
				     size_t n_rows, size_t dim, const float *q, size_t q_stride,
				     float *s, const uint8_t *pos, const int TR, const int QB)
{
	__m512 acc[16];
	_Pragma("GCC unroll 16")
	for (int k = 0; k < 16; k++)
		acc[k] = _mm512_setzero_ps();
	for (size_t c = 0; c < dim; c += 16) {
		__mmask16 mask = tail_mask16(dim - c);
		struct params16 p = { 0 };
		if (codes)
			p = params_load(src, c, mask);
		_Pragma("GCC unroll 16")
		for (int i = 0; i < TR; i++) {
			if ((size_t)i >= n_rows)
				break;
			__m512 y = row_load16(src, codes, i0 + (size_t)i, c, mask, &p);
			_Pragma("GCC unroll 16")
			for (int r = 0; r < QB; r++)
				acc[i * QB + r] = _mm512_fmadd_ps(
					_mm512_load_ps(q + (size_t)r * q_stride + c), y, acc[i * QB + r]);
		}
	}
	float sums[16];
	_mm512_storeu_ps(sums, codec_fold16x16(acc));
	for (int i = 0; i < TR && (size_t)i < n_rows; i++)
		for (int r = 0; r < QB; r++)
			s[(size_t)r * ATTEND_CHUNK + pos[i0 + (size_t)i]] = sums[i * QB + r];
}

static ALWAYS_INLINE void score_rows(const struct rows_src *src, bool codes, size_t n_rows,
				     size_t dim, const float *q, size_t n_q, size_t q_stride,
				     float *s, const uint8_t *pos, const int QB)
{
	const int TR = 16 / QB;
	for (size_t r0 = 0; r0 < n_q; r0 += (size_t)QB)
		for (size_t i0 = 0; i0 < n_rows; i0 += (size_t)TR)
			score_tile(src, codes, i0, n_rows - i0, dim, q + r0 * q_stride, q_stride,
				   s + r0 * ATTEND_CHUNK, pos, TR, QB);
}

/* The widest tile the (padded) query rows allow: 1, 2, or 4.. per pass. */
static ALWAYS_INLINE void score_any(const struct rows_src *src, bool codes, size_t n_rows,
				    size_t dim, const float *q, size_t n_q, size_t q_stride,
				    float *s, const uint8_t *pos)
{
	if (n_q % 16 == 0)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 16);
	else if (n_q % 8 == 0)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 8);
	else if (n_q % 4 == 0)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 4);
	else if (n_q == 2)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 2);
	else
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 1);
}

static bool codes_safe(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
		       size_t n_rows, size_t dim, int bits)
{
	size_t end_byte = (bit_offset + n_rows * dim * (size_t)bits + 7) / 8;
	return (size_t)(read_end - stream) >= end_byte + 16;
}

static struct rows_src codes_src(const uint8_t *stream, const uint8_t *read_end,
				 size_t bit_offset, size_t n_rows, size_t dim, int bits,
				 const uint8_t *scales, const uint8_t *mins)
{
	return (struct rows_src){ .stream = stream, .read_end = read_end,
				  .bit_offset = bit_offset, .dim = dim, .bits = bits,
				  .lanes = 0x0101010101010101ull * ((1u << bits) - 1u),
				  .scales = scales, .mins = mins,
				  .safe = codes_safe(stream, read_end, bit_offset, n_rows, dim, bits) };
}

static void avx512_score_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows,
			      size_t dim, const float *q, size_t n_q, size_t q_stride, float *s,
			      const uint8_t *pos)
{
	struct rows_src src = { .rows = rows, .row_stride = row_stride, .dim = dim };
	score_any(&src, false, n_rows, dim, q, n_q, q_stride, s, pos);
}

static void avx512_score_codes(const uint8_t *stream, const uint8_t *read_end,
			       size_t bit_offset, size_t n_rows, size_t dim, int bits,
			       const uint8_t *scales, const uint8_t *mins, const float *q,
			       size_t n_q, size_t q_stride, float *s, const uint8_t *pos)
{
	struct rows_src src = codes_src(stream, read_end, bit_offset, n_rows, dim, bits, scales,
					mins);
	if (src.safe)
		score_any(&src, true, n_rows, dim, q, n_q, q_stride, s, pos);
	else
		score_any(&src, true, n_rows, dim, q, n_q, q_stride, s, pos);
}

/*
 * NR query rows' partials for channels c..c+15: token i adds
 * p[r][i] * v_i, in increasing i, one FMA each.
 */
static ALWAYS_INLINE void accumulate_block(const struct rows_src *src, bool codes, size_t n_rows,
					   size_t c, __mmask16 mask, const struct params16 *p,
					   const float *w, float *part, size_t part_stride,
					   const int NR)
{
	__m512 a[8];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++)
		a[r] = _mm512_load_ps(part + (size_t)r * part_stride + c);
	for (size_t i = 0; i < n_rows; i++) {
		__m512 y = row_load16(src, codes, i, c, mask, p);
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++)
			a[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]), y, a[r]);
	}
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++)
		_mm512_store_ps(part + (size_t)r * part_stride + c, a[r]);
}

static ALWAYS_INLINE void accumulate_any(const struct rows_src *src, bool codes, size_t n_rows,
					 size_t dim, const float *w, size_t n_p, float *part,
					 size_t part_stride)
{
	for (size_t c = 0; c < dim; c += 16) {
		__mmask16 mask = tail_mask16(dim - c);
		struct params16 p = { 0 };
		if (codes)
			p = params_load(src, c, mask);
		for (size_t r0 = 0; r0 < n_p; r0 += 8) {
			const float *wr = w + r0 * ATTEND_CHUNK;
			float *pr = part + r0 * part_stride;
			switch (n_p - r0 < 8 ? n_p - r0 : 8) {
			case 1: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 1); break;
			case 2: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 2); break;
			case 3: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 3); break;
			case 4: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 4); break;
			case 5: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 5); break;
			case 6: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 6); break;
			case 7: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 7); break;
			default: accumulate_block(src, codes, n_rows, c, mask, &p, wr, pr, part_stride, 8); break;
			}
		}
	}
}

static void avx512_accumulate_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows,
				   size_t dim, const float *p, size_t n_p, float *part,
				   size_t part_stride)
{
	struct rows_src src = { .rows = rows, .row_stride = row_stride, .dim = dim };
	accumulate_any(&src, false, n_rows, dim, p, n_p, part, part_stride);
}

static void avx512_accumulate_codes(const uint8_t *stream, const uint8_t *read_end,
				    size_t bit_offset, size_t n_rows, size_t dim, int bits,
				    const uint8_t *scales, const uint8_t *mins, const float *p,
				    size_t n_p, float *part, size_t part_stride)
{
	struct rows_src src = codes_src(stream, read_end, bit_offset, n_rows, dim, bits, scales,
					mins);
	accumulate_any(&src, true, n_rows, dim, p, n_p, part, part_stride);
}

static void avx512_softmax(float *s, size_t n_rows, float *m, float *l, float *alpha)
{
	attend_softmax_step(s, n_rows, m, l, alpha);
}

static void avx512_combine(float *acc, float *part, size_t n_rows, size_t stride,
			   const float *alpha)
{
	attend_combine_rows(acc, part, n_rows, stride, alpha);
}

const struct attend_kernels attend_kernels_avx512 = {
	.name = "avx512",
	.score_fp16 = avx512_score_fp16,
	.score_codes = avx512_score_codes,
	.accumulate_fp16 = avx512_accumulate_fp16,
	.accumulate_codes = avx512_accumulate_codes,
	.softmax = avx512_softmax,
	.combine = avx512_combine,
};
