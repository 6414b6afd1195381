/*
 * AVX2 kernels (AVX2 + FMA + F16C + BMI2): 8 channels per vector. AVX2
 * has no 16-bit masked loads, so the last partial vector of a row goes
 * through a zero-padded copy; zeros add nothing to a norm and are never
 * stored. Every operation mirrors kernels_scalar.c.
 */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "zipcache/codec.h"

#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Eight fp16 values from `at`, of which `count` (1..8) are real. */
static __m128i load_fp16x8(const void *at, size_t count)
{
	if (count >= 8)
		return _mm_loadu_si128((const __m128i *)at);
	uint16_t padded[8] = { 0 };
	memcpy(padded, at, count * 2);
	return _mm_loadu_si128((const __m128i *)padded);
}

static void store_fp16x8(void *at, __m128i value, size_t count)
{
	if (count >= 8) {
		_mm_storeu_si128((__m128i *)at, value);
		return;
	}
	uint16_t padded[8];
	_mm_storeu_si128((__m128i *)padded, value);
	memcpy(at, padded, count * 2);
}

static __m256 widen_fp16x8(const void *at, size_t count)
{
	return _mm256_cvtph_ps(load_fp16x8(at, count));
}

static int avx2_check_finite(const uint16_t *values, size_t n)
{
	const __m256i exponent = _mm256_set1_epi16(0x7c00);
	__m256i bad = _mm256_setzero_si256();
	size_t i = 0;

	for (; i + 16 <= n; i += 16) {
		__m256i v = _mm256_loadu_si256((const __m256i *)(values + i));
		bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(v, exponent), exponent));
	}
	int any = !_mm256_testz_si256(bad, bad);
	for (; i < n; i++)
		any |= (values[i] & 0x7c00u) == 0x7c00u;
	return any ? ZC_ENONFINITE : 0;
}

static int avx2_row_norms(const uint16_t *rows, size_t n_rows, size_t dim, float *norms)
{
	if (avx2_check_finite(rows, n_rows * dim) < 0)
		return ZC_ENONFINITE;
	for (size_t r = 0; r < n_rows; r++) {
		const uint16_t *row = rows + r * dim;
		/* Lanes 0-7 and 8-15 of the 16-lane order live in two registers. */
		__m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
		for (size_t c = 0; c < dim; c += 16) {
			__m256 x = widen_fp16x8(row + c, dim - c);
			low = _mm256_add_ps(low, _mm256_mul_ps(x, x));
			if (c + 8 < dim) {
				__m256 y = widen_fp16x8(row + c + 8, dim - c - 8);
				high = _mm256_add_ps(high, _mm256_mul_ps(y, y));
			}
		}
		__m256 eight = _mm256_add_ps(low, high);
		__m128 four = _mm_add_ps(_mm256_castps256_ps128(eight),
					 _mm256_extractf128_ps(eight, 1));
		__m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
		__m128 one = _mm_add_ss(two, _mm_shuffle_ps(two, two, 1));
		norms[r] = sqrtf(_mm_cvtss_f32(one));
	}
	return 0;
}

static void avx2_group_params(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			      size_t dim, int bits, uint8_t *scales, uint8_t *mins)
{
	const __m256 levels = _mm256_set1_ps((float)((1 << bits) - 1));
	const __m256 tiny = _mm256_set1_ps(1e-8f);
	const __m256 largest = _mm256_set1_ps(65504.0f);

	for (size_t c = 0; c < dim; c += 8) {
		size_t count = dim - c;
		__m256 lo = widen_fp16x8(head + (size_t)rows[0] * dim + c, count);
		__m256 hi = lo;
		for (size_t r = 1; r < n_rows; r++) {
			__m256 x = widen_fp16x8(head + (size_t)rows[r] * dim + c, count);
			lo = _mm256_min_ps(x, lo);
			hi = _mm256_max_ps(x, hi);
		}
		__m256 scale = _mm256_div_ps(_mm256_sub_ps(hi, lo), levels);
		scale = _mm256_max_ps(scale, tiny);
		scale = _mm256_min_ps(scale, largest);
		store_fp16x8(scales + 2 * c, _mm256_cvtps_ph(scale, ROUND_NEAREST), count);
		store_fp16x8(mins + 2 * c, _mm256_cvtps_ph(lo, ROUND_NEAREST), count);
	}
}

static void avx2_group_quantize(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				size_t dim, int bits, const uint8_t *scales,
				const uint8_t *mins, uint8_t *codes)
{
	const __m256 max_code = _mm256_set1_ps((float)((1 << bits) - 1));
	const __m256 zero = _mm256_setzero_ps();

	for (size_t r = 0; r < n_rows; r++) {
		const uint16_t *row = head + (size_t)rows[r] * dim;
		for (size_t c = 0; c < dim; c += 8) {
			size_t count = dim - c;
			__m256 x = widen_fp16x8(row + c, count);
			__m256 scale = widen_fp16x8(scales + 2 * c, count);
			__m256 min = widen_fp16x8(mins + 2 * c, count);
			__m256 q = _mm256_div_ps(_mm256_sub_ps(x, min), scale);
			q = _mm256_round_ps(q, ROUND_NEAREST);
			q = _mm256_max_ps(q, zero);
			q = _mm256_min_ps(q, max_code);
			q = _mm256_blendv_ps(q, zero, _mm256_cmp_ps(scale, zero, _CMP_EQ_OQ));
			__m256i words = _mm256_cvttps_epi32(q);
			__m128i half = _mm_packus_epi32(_mm256_castsi256_si128(words),
							_mm256_extracti128_si256(words, 1));
			uint64_t bytes = (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(half, half));
			memcpy(codes + r * dim + c, &bytes, count >= 8 ? 8 : count);
		}
	}
}

static uint64_t load_codes64(const uint8_t *at, const uint8_t *read_end)
{
	uint64_t value = 0;
	if (at + 8 <= read_end)
		memcpy(&value, at, 8);
	else if (at < read_end)
		memcpy(&value, at, (size_t)(read_end - at));
	return value;
}

static void avx2_row_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				 size_t bit_offset, size_t dim, int bits,
				 const uint8_t *scales, const uint8_t *mins, uint16_t *out)
{
	const uint64_t lanes = 0x0101010101010101ull * ((1u << bits) - 1u);
	const __m256 lowest = _mm256_set1_ps(-65504.0f);
	const __m256 highest = _mm256_set1_ps(65504.0f);

	for (size_t c = 0; c < dim; c += 8) {
		size_t count = dim - c;
		size_t bit = bit_offset + c * (size_t)bits;
		uint64_t window = load_codes64(stream + (bit >> 3), read_end) >> (bit & 7u);
		__m128i code_bytes = _mm_cvtsi64_si128((long long)_pdep_u64(window, lanes));
		__m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(code_bytes));
		__m256 scale = widen_fp16x8(scales + 2 * c, count);
		__m256 min = widen_fp16x8(mins + 2 * c, count);
		__m256 y = _mm256_fmadd_ps(code, scale, min);
		y = _mm256_max_ps(y, lowest);
		y = _mm256_min_ps(y, highest);
		store_fp16x8(out + c, _mm256_cvtps_ph(y, ROUND_NEAREST), count);
	}
}

static void avx2_group_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				   size_t bit_offset, size_t n_rows, size_t dim, int bits,
				   const uint8_t *scales, const uint8_t *mins,
				   const uint32_t *tokens, uint16_t *out, size_t token_stride,
				   bool nt)
{
	(void)nt;
	for (size_t r = 0; r < n_rows; r++)
		avx2_row_reconstruct(stream, read_end, bit_offset + r * dim * (size_t)bits,
				     dim, bits, scales, mins, out + (size_t)tokens[r] * token_stride);
}

/*
 * Eight codes of `bits` bits make exactly `bits` bytes, and PEXT gathers
 * them in one instruction. Unaligned starts (D*bits not a multiple of 8)
 * and the last few codes use the portable packer.
 */
void codec_pack_bmi2(uint8_t *stream, const uint8_t *stream_end, size_t bit_offset,
		     const uint8_t *codes, size_t n, int bits)
{
	if (bit_offset & 7u) {
		codec_pack_portable(stream, stream_end, bit_offset, codes, n, bits);
		return;
	}
	const uint64_t lanes = 0x0101010101010101ull * ((1u << bits) - 1u);
	uint8_t *out = stream + (bit_offset >> 3);
	size_t i = 0;

	for (; i + 8 <= n; i += 8) {
		uint64_t eight;
		memcpy(&eight, codes + i, 8);
		uint64_t packed = _pext_u64(eight, lanes);
		/* The 8-byte store writes zeros past this run's `bits` bytes;
		 * the next run overwrites them, and stream_end bounds it. */
		if (out + 8 <= stream_end)
			memcpy(out, &packed, 8);
		else
			memcpy(out, &packed, (size_t)bits);
		out += bits;
	}
	if (i < n)
		codec_pack_portable(stream, stream_end, bit_offset + i * (size_t)bits, codes + i,
				    n - i, bits);
}

const struct codec_kernels codec_kernels_avx2 = {
	.name = "avx2",
	.check_finite = avx2_check_finite,
	.row_norms = avx2_row_norms,
	.group_params = avx2_group_params,
	.group_quantize = avx2_group_quantize,
	.pack = codec_pack_bmi2,
	.group_reconstruct = avx2_group_reconstruct,
};
