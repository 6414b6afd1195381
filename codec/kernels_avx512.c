/*
 * AVX-512 kernels (F, BW, VL, DQ + F16C + BMI2): 16 channels per vector,
 * masked loads and stores for the last partial vector of a row. Every
 * operation mirrors kernels_scalar.c; see kernels.h for the contract.
 */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "zipcache/codec.h"

#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static __mmask16 tail_mask16(size_t remaining)
{
	return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

static __m512 load_fp16x16(const void *at, __mmask16 mask)
{
	return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
}

static int avx512_check_finite(const uint16_t *values, size_t n)
{
	const __m512i exponent = _mm512_set1_epi16(0x7c00);
	__mmask32 bad = 0;
	size_t i = 0;

	for (; i + 32 <= n; i += 32) {
		__m512i v = _mm512_loadu_si512((const void *)(values + i));
		bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, exponent), exponent);
	}
	if (i < n) {
		__mmask32 mask = (__mmask32)((1ull << (n - i)) - 1u);
		__m512i v = _mm512_maskz_loadu_epi16(mask, values + i);
		bad |= _mm512_mask_cmpeq_epi16_mask(mask, _mm512_and_si512(v, exponent), exponent);
	}
	return bad ? ZC_ENONFINITE : 0;
}

/* The fold of docs/CODEC.md: j+8, j+4, j+2, j+1. */
static float fold16(__m512 lanes)
{
	__m256 eight = _mm256_add_ps(_mm512_castps512_ps256(lanes), _mm512_extractf32x8_ps(lanes, 1));
	__m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
	__m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
	__m128 one = _mm_add_ss(two, _mm_shuffle_ps(two, two, 1));
	return _mm_cvtss_f32(one);
}

/* Rows per pass of row_norms: independent sums keep the adder busy. */
#define NORM_ROWS 4

static int avx512_row_norms(const uint16_t *rows, size_t n_rows, size_t dim, float *norms)
{
	const __m256i exponent = _mm256_set1_epi16(0x7c00);
	__mmask16 bad = 0;

	for (size_t r0 = 0; r0 < n_rows; r0 += NORM_ROWS) {
		size_t count = n_rows - r0 < NORM_ROWS ? n_rows - r0 : NORM_ROWS;
		__m512 lanes[NORM_ROWS];
		_Pragma("GCC unroll 4")
		for (size_t k = 0; k < NORM_ROWS; k++)
			lanes[k] = _mm512_setzero_ps();
		for (size_t c = 0; c < dim; c += 16) {
			__mmask16 mask = tail_mask16(dim - c);
			for (size_t k = 0; k < count; k++) {
				__m256i h = _mm256_maskz_loadu_epi16(mask, rows + (r0 + k) * dim + c);
				bad |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, exponent), exponent);
				__m512 x = _mm512_cvtph_ps(h);
				lanes[k] = _mm512_add_ps(lanes[k], _mm512_mul_ps(x, x));
			}
		}
		for (size_t k = 0; k < count; k++)
			norms[r0 + k] = sqrtf(fold16(lanes[k]));
	}
	return bad ? ZC_ENONFINITE : 0;
}

/* Channels per pass of group_params: four independent min/max chains
 * hide the latency that one chain per 16 channels would expose. */
#define PARAMS_VECTORS 4

static void avx512_group_params(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				size_t dim, int bits, uint8_t *scales, uint8_t *mins)
{
	const __m512 levels = _mm512_set1_ps((float)((1 << bits) - 1));
	const __m512 tiny = _mm512_set1_ps(1e-8f);
	const __m512 largest = _mm512_set1_ps(65504.0f);

	for (size_t c0 = 0; c0 < dim; c0 += 16 * PARAMS_VECTORS) {
		/* A fixed count keeps lo/hi in registers; vectors past the row
		 * end have an empty mask, so they load nothing and store nothing. */
		__m512 lo[PARAMS_VECTORS], hi[PARAMS_VECTORS];
		__mmask16 mask[PARAMS_VECTORS];
		_Pragma("GCC unroll 4")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			size_t c = c0 + 16 * (size_t)v;
			mask[v] = c < dim ? tail_mask16(dim - c) : 0;
			lo[v] = load_fp16x16(head + (size_t)rows[0] * dim + c, mask[v]);
			hi[v] = lo[v];
		}
		for (size_t r = 1; r < n_rows; r++) {
			const uint16_t *row = head + (size_t)rows[r] * dim + c0;
			_Pragma("GCC unroll 4")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
				__m512 x = load_fp16x16(row + 16 * v, mask[v]);
				lo[v] = _mm512_min_ps(x, lo[v]);
				hi[v] = _mm512_max_ps(x, hi[v]);
			}
		}
		_Pragma("GCC unroll 4")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			size_t c = c0 + 16 * (size_t)v;
			__m512 scale = _mm512_div_ps(_mm512_sub_ps(hi[v], lo[v]), levels);
			scale = _mm512_max_ps(scale, tiny);
			scale = _mm512_min_ps(scale, largest);
			_mm256_mask_storeu_epi16(scales + 2 * c, mask[v],
						 _mm512_cvtps_ph(scale, ROUND_NEAREST));
			_mm256_mask_storeu_epi16(mins + 2 * c, mask[v],
						 _mm512_cvtps_ph(lo[v], ROUND_NEAREST));
		}
	}
}

static void avx512_group_quantize(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				  size_t dim, int bits, const uint8_t *scales,
				  const uint8_t *mins, uint8_t *codes)
{
	const __m512 max_code = _mm512_set1_ps((float)((1 << bits) - 1));
	const __m512 zero = _mm512_setzero_ps();

	/* Channels outer, rows inner: each vector's scale and min are
	 * widened once per group instead of once per row. */
	for (size_t c0 = 0; c0 < dim; c0 += 16 * PARAMS_VECTORS) {
		__m512 scale[PARAMS_VECTORS], min[PARAMS_VECTORS];
		__mmask16 mask[PARAMS_VECTORS], flat[PARAMS_VECTORS];
		_Pragma("GCC unroll 4")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			size_t c = c0 + 16 * (size_t)v;
			mask[v] = c < dim ? tail_mask16(dim - c) : 0;
			scale[v] = load_fp16x16(scales + 2 * c, mask[v]);
			min[v] = load_fp16x16(mins + 2 * c, mask[v]);
			flat[v] = _mm512_cmp_ps_mask(scale[v], zero, _CMP_EQ_OQ);
		}
		for (size_t r = 0; r < n_rows; r++) {
			const uint16_t *row = head + (size_t)rows[r] * dim + c0;
			uint8_t *out = codes + r * dim + c0;
			_Pragma("GCC unroll 4")
			for (int v = 0; v < PARAMS_VECTORS; v++) {
				__m512 x = load_fp16x16(row + 16 * v, mask[v]);
				__m512 q = _mm512_div_ps(_mm512_sub_ps(x, min[v]), scale[v]);
				q = _mm512_roundscale_ps(q, ROUND_NEAREST);
				q = _mm512_max_ps(q, zero);
				q = _mm512_min_ps(q, max_code);
				q = _mm512_mask_mov_ps(q, flat[v], zero);
				__m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q));
				_mm_mask_storeu_epi8(out + 16 * v, mask[v], bytes);
			}
		}
	}
}

/* Eight bytes from `at`, zero past read_end; the caller uses only what
 * lies before it. */
static uint64_t load_codes64(const uint8_t *at, const uint8_t *read_end)
{
	uint64_t value = 0;
	if (at + 8 <= read_end)
		memcpy(&value, at, 8);
	else if (at < read_end)
		memcpy(&value, at, (size_t)(read_end - at));
	return value;
}

static void avx512_row_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				   size_t bit_offset, size_t dim, int bits,
				   const uint8_t *scales, const uint8_t *mins, uint16_t *out)
{
	const uint64_t lanes = 0x0101010101010101ull * ((1u << bits) - 1u);
	const __m512 lowest = _mm512_set1_ps(-65504.0f);
	const __m512 highest = _mm512_set1_ps(65504.0f);

	for (size_t c = 0; c < dim; c += 16) {
		__mmask16 mask = tail_mask16(dim - c);
		size_t bit = bit_offset + c * (size_t)bits;
		size_t next = bit + 8 * (size_t)bits;
		uint64_t first = load_codes64(stream + (bit >> 3), read_end) >> (bit & 7u);
		uint64_t second = load_codes64(stream + (next >> 3), read_end) >> (next & 7u);
		/* Built in registers: two 8-byte stores read back as one 16-byte
		 * load would stall store forwarding on every vector. */
		__m128i code_bytes = _mm_insert_epi64(_mm_cvtsi64_si128((long long)_pdep_u64(first, lanes)),
						      (long long)_pdep_u64(second, lanes), 1);
		__m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(code_bytes));
		__m512 scale = load_fp16x16(scales + 2 * c, mask);
		__m512 min = load_fp16x16(mins + 2 * c, mask);
		/* code * scale is exact in fp32, so the FMA rounds exactly once,
		 * like the scalar mul-then-add. */
		__m512 y = _mm512_fmadd_ps(code, scale, min);
		y = _mm512_max_ps(y, lowest);
		y = _mm512_min_ps(y, highest);
		__m256i half = _mm512_cvtps_ph(y, ROUND_NEAREST);
		/* A masked VCVTPS2PH to memory is slow; store the full vector
		 * plainly and mask only the last one of a row. */
		if (dim - c >= 16)
			_mm256_storeu_si256((__m256i *)(out + c), half);
		else
			_mm256_mask_storeu_epi16(out + c, mask, half);
	}
}

const struct codec_kernels codec_kernels_avx512 = {
	.name = "avx512",
	.check_finite = avx512_check_finite,
	.row_norms = avx512_row_norms,
	.group_params = avx512_group_params,
	.group_quantize = avx512_group_quantize,
	.pack = codec_pack_bmi2,
	.row_reconstruct = avx512_row_reconstruct,
};
