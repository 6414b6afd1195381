/*
 * AVX2 attention kernels (AVX2 + FMA + F16C + BMI2): 8 channels per
 * vector, so a dot product's 16 lanes live in two registers (lanes 0-7
 * and 8-15) and fold as avx2_row_norms does. Values accumulate with
 * channels across the vector and tokens in order, one FMA each. The last
 * partial vector of a row goes through a zero-padded copy (AVX2 has no
 * 16-bit masked loads); zeros add nothing. Every result equals
 * attend_scalar.c's bit for bit.
 */
#include "attend_kernels.h"

#include <immintrin.h>
#include <string.h>

#include "attend_softmax.h"
#include "zipcache/codec.h"

#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* How far ahead rows are prefetched: one chunk (attend_avx512.c says why). */
#define PREFETCH_ROWS ATTEND_CHUNK

static ALWAYS_INLINE __m256 widen8(const void *at, size_t count)
{
	if (count >= 8)
		return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
	uint16_t padded[8] = { 0 };
	memcpy(padded, at, count * 2);
	return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)padded));
}

struct rows_src {
	const uint16_t *rows;
	size_t row_stride;
	const uint8_t *stream, *read_end;
	size_t bit_offset, dim;
	int bits;
	uint64_t lanes;
	const uint8_t *scales, *mins;
};

/* One group's params for 8 channels; clamp as in attend_avx512.c. */
struct params8 {
	__m256 scale, min;
	bool clamp;
};

static ALWAYS_INLINE struct params8 params_load(const struct rows_src *src, size_t c,
						size_t count)
{
	const __m256 largest = _mm256_set1_ps(65504.0f);
	const __m256 zero = _mm256_setzero_ps();
	struct params8 p;
	if (c % 32 == 0) {
		_mm_prefetch((const char *)src->scales + 2 * c + 8 * src->dim, _MM_HINT_T0);
		_mm_prefetch((const char *)src->mins + 2 * c + 8 * src->dim, _MM_HINT_T0);
	}
	p.scale = widen8(src->scales + 2 * c, count);
	p.min = widen8(src->mins + 2 * c, count);
	__m256 top = _mm256_fmadd_ps(_mm256_set1_ps((float)((1 << src->bits) - 1)), p.scale,
				     p.min);
	__m256 good = _mm256_and_ps(
		_mm256_and_ps(_mm256_cmp_ps(p.scale, zero, _CMP_GE_OQ),
			      _mm256_cmp_ps(p.scale, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ)),
		_mm256_and_ps(_mm256_cmp_ps(p.min, _mm256_sub_ps(zero, largest), _CMP_GE_OQ),
			      _mm256_cmp_ps(top, largest, _CMP_LE_OQ)));
	p.clamp = _mm256_movemask_ps(good) != 0xff;
	return p;
}

static ALWAYS_INLINE uint64_t load_codes64(const uint8_t *at, const uint8_t *read_end)
{
	uint64_t value = 0;
	if (at + 8 <= read_end)
		memcpy(&value, at, 8);
	else if (at < read_end)
		memcpy(&value, at, (size_t)(read_end - at));
	return value;
}

/* Row i, channels c..c+7 (count of them real). */
static ALWAYS_INLINE __m256 row_load8(const struct rows_src *src, bool codes, size_t i, size_t c,
				      size_t count, const struct params8 *p)
{
	if (!codes) {
		const uint16_t *at = src->rows + i * src->row_stride + c;
		/* As in attend_avx512.c: the next chunk's line, one hint each. */
		if (c % 32 == 0)
			_mm_prefetch((const char *)(at + PREFETCH_ROWS * src->row_stride), _MM_HINT_T0);
		return widen8(at, count);
	}
	size_t bit = src->bit_offset + (i * src->dim + c) * (size_t)src->bits;
	if (c == 0)
		_mm_prefetch((const char *)src->stream + (bit >> 3) +
				     PREFETCH_ROWS * src->dim * (size_t)src->bits / 8,
			     _MM_HINT_T0);
	uint64_t window = load_codes64(src->stream + (bit >> 3), src->read_end) >> (bit & 7u);
	__m128i bytes = _mm_cvtsi64_si128((long long)_pdep_u64(window, src->lanes));
	__m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), p->scale,
				   p->min);
	if (p->clamp) {
		y = _mm256_max_ps(y, _mm256_set1_ps(-65504.0f));
		y = _mm256_min_ps(y, _mm256_set1_ps(65504.0f));
	}
	return _mm256_cvtph_ps(_mm256_cvtps_ph(y, ROUND_NEAREST));
}

/* The fold of codec_fold_lanes over lanes 0-7 (low) and 8-15 (high). */
static ALWAYS_INLINE float fold(__m256 low, __m256 high)
{
	__m256 eight = _mm256_add_ps(low, high);
	__m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
	__m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
	__m128 one = _mm_add_ss(two, _mm_shuffle_ps(two, two, 1));
	return _mm_cvtss_f32(one);
}

/* TR rows x QB query rows, two accumulators (lanes 0-7, 8-15) each. */
static ALWAYS_INLINE void score_tile(const struct rows_src *src, bool codes, size_t i0,
				     size_t n_rows, size_t dim, const float *q, size_t q_stride,
				     float *s, const uint8_t *pos, const int TR, const int QB)
{
	__m256 low[4], high[4];
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++)
		low[k] = high[k] = _mm256_setzero_ps();
	for (size_t c = 0; c < dim; c += 16) {
		size_t count = dim - c;
		struct params8 p0 = { 0 }, p1 = { 0 };
		if (codes) {
			p0 = params_load(src, c, count);
			if (count > 8)
				p1 = params_load(src, c + 8, count - 8);
		}
		_Pragma("GCC unroll 4")
		for (int i = 0; i < TR; i++) {
			if ((size_t)i >= n_rows)
				break;
			__m256 y = row_load8(src, codes, i0 + (size_t)i, c, count, &p0);
			_Pragma("GCC unroll 4")
			for (int r = 0; r < QB; r++)
				low[i * QB + r] = _mm256_fmadd_ps(
					_mm256_load_ps(q + (size_t)r * q_stride + c), y, low[i * QB + r]);
			if (count > 8) {
				y = row_load8(src, codes, i0 + (size_t)i, c + 8, count - 8, &p1);
				_Pragma("GCC unroll 4")
				for (int r = 0; r < QB; r++)
					high[i * QB + r] = _mm256_fmadd_ps(
						_mm256_load_ps(q + (size_t)r * q_stride + c + 8), y,
						high[i * QB + r]);
			}
		}
	}
	for (int i = 0; i < TR && (size_t)i < n_rows; i++)
		for (int r = 0; r < QB; r++)
			s[(size_t)r * ATTEND_CHUNK + pos[i0 + (size_t)i]] =
				fold(low[i * QB + r], high[i * QB + r]);
}

static ALWAYS_INLINE void score_rows(const struct rows_src *src, bool codes, size_t n_rows,
				     size_t dim, const float *q, size_t n_q, size_t q_stride,
				     float *s, const uint8_t *pos, const int QB)
{
	const int TR = 4 / QB;
	for (size_t r0 = 0; r0 < n_q; r0 += (size_t)QB)
		for (size_t i0 = 0; i0 < n_rows; i0 += (size_t)TR)
			score_tile(src, codes, i0, n_rows - i0, dim, q + r0 * q_stride, q_stride,
				   s + r0 * ATTEND_CHUNK, pos, TR, QB);
}

static ALWAYS_INLINE void score_any(const struct rows_src *src, bool codes, size_t n_rows,
				    size_t dim, const float *q, size_t n_q, size_t q_stride,
				    float *s, const uint8_t *pos)
{
	if (n_q % 4 == 0)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 4);
	else if (n_q == 2)
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 2);
	else
		score_rows(src, codes, n_rows, dim, q, n_q, q_stride, s, pos, 1);
}

static struct rows_src codes_src(const uint8_t *stream, const uint8_t *read_end,
				 size_t bit_offset, size_t dim, int bits, const uint8_t *scales,
				 const uint8_t *mins)
{
	return (struct rows_src){ .stream = stream, .read_end = read_end,
				  .bit_offset = bit_offset, .dim = dim, .bits = bits,
				  .lanes = 0x0101010101010101ull * ((1u << bits) - 1u),
				  .scales = scales, .mins = mins };
}

static void avx2_score_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows, size_t dim,
			    const float *q, size_t n_q, size_t q_stride, float *s,
			    const uint8_t *pos)
{
	struct rows_src src = { .rows = rows, .row_stride = row_stride, .dim = dim };
	score_any(&src, false, n_rows, dim, q, n_q, q_stride, s, pos);
}

static void avx2_score_codes(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
			     size_t n_rows, size_t dim, int bits, const uint8_t *scales,
			     const uint8_t *mins, const float *q, size_t n_q, size_t q_stride,
			     float *s, const uint8_t *pos)
{
	struct rows_src src = codes_src(stream, read_end, bit_offset, dim, bits, scales, mins);
	score_any(&src, true, n_rows, dim, q, n_q, q_stride, s, pos);
}

static ALWAYS_INLINE void accumulate_block(const struct rows_src *src, bool codes, size_t n_rows,
					   size_t c, size_t count, const struct params8 *p,
					   const float *w, float *part, size_t part_stride,
					   const int NR)
{
	__m256 a[8];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++)
		a[r] = _mm256_load_ps(part + (size_t)r * part_stride + c);
	for (size_t i = 0; i < n_rows; i++) {
		__m256 y = row_load8(src, codes, i, c, count, p);
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++)
			a[r] = _mm256_fmadd_ps(_mm256_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]), y, a[r]);
	}
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++)
		_mm256_store_ps(part + (size_t)r * part_stride + c, a[r]);
}

static ALWAYS_INLINE void accumulate_any(const struct rows_src *src, bool codes, size_t n_rows,
					 size_t dim, const float *w, size_t n_p, float *part,
					 size_t part_stride)
{
	for (size_t c = 0; c < dim; c += 8) {
		size_t count = dim - c;
		struct params8 p = { 0 };
		if (codes)
			p = params_load(src, c, count);
		for (size_t r0 = 0; r0 < n_p; r0 += 4) {
			const float *wr = w + r0 * ATTEND_CHUNK;
			float *pr = part + r0 * part_stride;
			switch (n_p - r0 < 4 ? n_p - r0 : 4) {
			case 1: accumulate_block(src, codes, n_rows, c, count, &p, wr, pr, part_stride, 1); break;
			case 2: accumulate_block(src, codes, n_rows, c, count, &p, wr, pr, part_stride, 2); break;
			case 3: accumulate_block(src, codes, n_rows, c, count, &p, wr, pr, part_stride, 3); break;
			default: accumulate_block(src, codes, n_rows, c, count, &p, wr, pr, part_stride, 4); break;
			}
		}
	}
}

static void avx2_accumulate_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows,
				 size_t dim, const float *p, size_t n_p, float *part,
				 size_t part_stride)
{
	struct rows_src src = { .rows = rows, .row_stride = row_stride, .dim = dim };
	accumulate_any(&src, false, n_rows, dim, p, n_p, part, part_stride);
}

static void avx2_accumulate_codes(const uint8_t *stream, const uint8_t *read_end,
				  size_t bit_offset, size_t n_rows, size_t dim, int bits,
				  const uint8_t *scales, const uint8_t *mins, const float *p,
				  size_t n_p, float *part, size_t part_stride)
{
	struct rows_src src = codes_src(stream, read_end, bit_offset, dim, bits, scales, mins);
	accumulate_any(&src, true, n_rows, dim, p, n_p, part, part_stride);
}

static void avx2_softmax(float *s, size_t n_rows, float *m, float *l, float *alpha)
{
	attend_softmax_step(s, n_rows, m, l, alpha);
}

static void avx2_combine(float *acc, float *part, size_t n_rows, size_t stride,
			 const float *alpha)
{
	attend_combine_rows(acc, part, n_rows, stride, alpha);
}

const struct attend_kernels attend_kernels_avx2 = {
	.name = "avx2",
	.score_fp16 = avx2_score_fp16,
	.score_codes = avx2_score_codes,
	.accumulate_fp16 = avx2_accumulate_fp16,
	.accumulate_codes = avx2_accumulate_codes,
	.softmax = avx2_softmax,
	.combine = avx2_combine,
};
