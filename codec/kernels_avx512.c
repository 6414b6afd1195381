/*
 * AVX-512 kernels (F, BW, VL, DQ + F16C + BMI2): 16 channels per vector,
 * masked loads and stores for the last partial vector of a row. Every
 * result equals kernels_scalar.c's bit for bit; see kernels.h for the
 * contract. Where an operation here differs from the reference's (integer
 * keys for min/max, a convert-and-unsigned-min for rint-and-clamp, tables
 * instead of per-element arithmetic), the comment at it says why the
 * results cannot differ.
 *
 * Two tables: codec_kernels_avx512, and codec_kernels_avx512_vbmi for CPUs
 * with VBMI (VPERMB, VPMULTISHIFTQB), which unpacks codes of any width and
 * quantizes and packs a group in one pass (writing, given a view, each
 * row's reconstruction from the codes it packs). Both work a group at a
 * time: a group's scales and mins are widened once for all of its rows.
 */
#include "kernels.h"
#include "fold_avx512.h"

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

/* Rows per pass of row_norms: independent sums keep the FMA units busy
 * (a row's own sum is one chain, in the order the contract fixes), and
 * sixteen folded together share their shuffles and one VSQRTPS. */
#define NORM_ROWS 16


/*
 * x*x is exact in fp32 for an fp16 x, so x*x + lane rounds once either
 * way and the FMA matches the scalar mul-then-add. A row holds NaN or Inf
 * exactly when its norm does: squares are >= 0, and the largest finite
 * sum, 4096 * 65504^2, is far below FLT_MAX. So the norms are the check.
 */
static int avx512_row_norms(const uint16_t *rows, size_t n_rows, size_t dim, float *norms)
{
	/* Not <= FLT_MAX: Inf, or NaN (which fails every comparison). */
	const __m512 largest = _mm512_set1_ps(3.40282347e38f);
	__mmask16 bad = 0;
	size_t r0 = 0;

	for (; r0 + NORM_ROWS <= n_rows; r0 += NORM_ROWS) {
		__m512 lanes[NORM_ROWS];
		/* The pass is a block's first touch (staged by another process,
		 * so in L3 or memory), and the hardware's streams stop at every
		 * 4 KiB page, which 16 rows of D = 128 are: the rows two passes
		 * ahead are asked for now (measured: a warm prefill on one CPU
		 * 115 -> 89 ms on the Zen 4 VM). A check_finite pass, a plain
		 * stream, gained nothing from the same. */
		if (r0 + 3 * NORM_ROWS <= n_rows) {
			const char *ahead = (const char *)(rows + (r0 + 2 * NORM_ROWS) * dim);
			for (size_t at = 0; at < NORM_ROWS * dim * 2; at += 64)
				_mm_prefetch(ahead + at, _MM_HINT_T0);
		}
		_Pragma("GCC unroll 16")
		for (size_t k = 0; k < NORM_ROWS; k++)
			lanes[k] = _mm512_setzero_ps();
		for (size_t c = 0; c < dim; c += 16) {
			__mmask16 mask = tail_mask16(dim - c);
			_Pragma("GCC unroll 16")
			for (size_t k = 0; k < NORM_ROWS; k++) {
				__m512 x = load_fp16x16(rows + (r0 + k) * dim + c, mask);
				lanes[k] = _mm512_fmadd_ps(x, x, lanes[k]);
			}
		}
		__m512 norm = _mm512_sqrt_ps(codec_fold16x16(lanes));
		bad |= _mm512_cmp_ps_mask(norm, largest, _CMP_NLE_UQ);
		_mm512_storeu_ps(norms + r0, norm);
	}
	if (r0 < n_rows) {
		/* The last rows; the missing ones stay zero and are not stored. */
		size_t count = n_rows - r0;
		__m512 lanes[NORM_ROWS];
		for (size_t k = 0; k < NORM_ROWS; k++) {
			__m512 lane = _mm512_setzero_ps();
			for (size_t c = 0; k < count && c < dim; c += 16) {
				__m512 x = load_fp16x16(rows + (r0 + k) * dim + c, tail_mask16(dim - c));
				lane = _mm512_fmadd_ps(x, x, lane);
			}
			lanes[k] = lane;
		}
		__mmask16 mask = tail_mask16(count);
		__m512 norm = _mm512_sqrt_ps(codec_fold16x16(lanes));
		bad |= _mm512_mask_cmp_ps_mask(mask, norm, largest, _CMP_NLE_UQ);
		_mm512_mask_storeu_ps(norms + r0, mask, norm);
	}
	return bad ? ZC_ENONFINITE : 0;
}

/* Channels per pass of group_params and reconstruct: 8 vectors, all of a
 * D = 128 head, each with its own independent min/max chain. */
#define PARAMS_VECTORS 8

/* Scale and min of 16 channels from their fp32 min and max. */
static inline __attribute__((always_inline)) void
params_store16(__m512 lo, __m512 hi, __m512 levels, __mmask16 mask, uint8_t *scale_at,
	       uint8_t *min_at)
{
	__m512 scale = _mm512_div_ps(_mm512_sub_ps(hi, lo), levels);
	scale = _mm512_max_ps(scale, _mm512_set1_ps(1e-8f));
	scale = _mm512_min_ps(scale, _mm512_set1_ps(65504.0f));
	_mm256_mask_storeu_epi16(scale_at, mask, _mm512_cvtps_ph(scale, ROUND_NEAREST));
	if (min_at)
		_mm256_mask_storeu_epi16(min_at, mask, _mm512_cvtps_ph(lo, ROUND_NEAREST));
}

/* group_params for the 128 channels from c0, in fp32 like the reference. */
static void float_params_pass(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			      size_t dim, int bits, uint8_t *scales, uint8_t *mins, size_t c0)
{
	const __m512 levels = _mm512_set1_ps((float)((1 << bits) - 1));
	/* A fixed count keeps lo/hi in registers; vectors past the row
	 * end have an empty mask, so they load nothing and store nothing. */
	__m512 lo[PARAMS_VECTORS], hi[PARAMS_VECTORS];
	__mmask16 mask[PARAMS_VECTORS];
	_Pragma("GCC unroll 8")
	for (int v = 0; v < PARAMS_VECTORS; v++) {
		size_t c = c0 + 16 * (size_t)v;
		mask[v] = c < dim ? tail_mask16(dim - c) : 0;
		lo[v] = load_fp16x16(head + (size_t)rows[0] * dim + c, mask[v]);
		hi[v] = lo[v];
	}
	for (size_t r = 1; r < n_rows; r++) {
		const uint16_t *row = head + (size_t)rows[r] * dim + c0;
		_Pragma("GCC unroll 8")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			__m512 x = load_fp16x16(row + 16 * v, mask[v]);
			lo[v] = _mm512_min_ps(x, lo[v]);
			hi[v] = _mm512_max_ps(x, hi[v]);
		}
	}
	_Pragma("GCC unroll 8")
	for (int v = 0; v < PARAMS_VECTORS; v++) {
		size_t c = c0 + 16 * (size_t)v;
		params_store16(lo[v], hi[v], levels, mask[v], scales + 2 * c, mins + 2 * c);
	}
}

static __mmask32 tail_mask32(size_t remaining)
{
	return remaining >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << remaining) - 1u);
}

/* fp16 bits <-> int16 keys in the order of the values: negative halves
 * get their magnitude bits flipped (h ^ ((h >> 15) & 0x7fff)). The map is
 * its own inverse. It orders -0 below +0, where fp32 has them equal. */
static inline __m512i half_order_key(__m512i h)
{
	return _mm512_ternarylogic_epi32(h, _mm512_srai_epi16(h, 15), _mm512_set1_epi16(0x7fff),
					 0x78); /* a ^ (b & c) */
}

/* Vectors of 32 channels per pass of the key min/max: 128 channels. */
#define KEY_VECTORS 4

/*
 * group_params finds min and max per channel as 16-bit integer keys, 32
 * channels per vector and no conversion per element. For finite halves
 * (the rows were checked, or key_range_store refuses them) the key order
 * is the fp32 order and equal values have equal bits, so the extremes
 * and their bits are those MINPS/MAXPS would find, except that fp32 keeps
 * whichever zero came first where the keys pick -0 for the min and +0 for
 * the max. A pass whose min or max is a zero in some channel is therefore
 * redone in fp32 (rare: it takes a channel that never leaves one side of
 * zero within a group and touches it).
 *
 * The running key min and max of one 128-channel pass:
 */
struct key_range {
	__m512i lo[KEY_VECTORS], hi[KEY_VECTORS];
	__mmask32 mask[KEY_VECTORS];
};

static inline __attribute__((always_inline)) void
key_range_init(struct key_range *k, const uint16_t *row, size_t dim, size_t c0)
{
	_Pragma("GCC unroll 4")
	for (int v = 0; v < KEY_VECTORS; v++) {
		size_t c = c0 + 32 * (size_t)v;
		k->mask[v] = c < dim ? tail_mask32(dim - c) : 0;
		k->lo[v] = half_order_key(_mm512_maskz_loadu_epi16(k->mask[v], row + c));
		k->hi[v] = k->lo[v];
	}
}

/* `full`: every mask is whole, and a plain load spares the masked one's
 * extra vector uop. */
static inline __attribute__((always_inline)) void
key_range_add(struct key_range *k, const uint16_t *row, bool full)
{
	_Pragma("GCC unroll 4")
	for (int v = 0; v < KEY_VECTORS; v++) {
		__m512i x = full ? _mm512_loadu_si512((const void *)(row + 32 * v)) :
				   _mm512_maskz_loadu_epi16(k->mask[v], row + 32 * v);
		__m512i key = half_order_key(x);
		k->lo[v] = _mm512_min_epi16(k->lo[v], key);
		k->hi[v] = _mm512_max_epi16(k->hi[v], key);
	}
}

/* What key_range_store did: stored the params, or left them to the fp32
 * path (a min or max is a zero), or found NaN or Inf and stored nothing. */
enum { KEY_RANGE_STORED = 0, KEY_RANGE_ZERO = 1 };

static inline __attribute__((always_inline)) int
key_range_store(const struct key_range *k, int bits, size_t c0, uint8_t *scales, uint8_t *mins)
{
	const __m512 levels = _mm512_set1_ps((float)((1 << bits) - 1));
	const __m512i one = _mm512_set1_epi16(1);
	/* Finite halves have keys from 0x8400 = -31744 (half 0xfbff, -65504)
	 * to 0x7bff (65504); -Inf and negative NaNs sort below, +Inf and
	 * positive NaNs above. */
	const __m512i lowest = _mm512_set1_epi16((short)-31744);
	const __m512i highest = _mm512_set1_epi16(0x7bff);
	/* Keys -1 and 0 are -0 and +0: key + 1 <= 1 unsigned. */
	__mmask32 zero = 0, nonfinite = 0;
	_Pragma("GCC unroll 4")
	for (int v = 0; v < KEY_VECTORS; v++) {
		nonfinite |= _mm512_mask_cmplt_epi16_mask(k->mask[v], k->lo[v], lowest);
		nonfinite |= _mm512_mask_cmpgt_epi16_mask(k->mask[v], k->hi[v], highest);
		zero |= _mm512_mask_cmple_epu16_mask(k->mask[v], _mm512_add_epi16(k->lo[v], one), one);
		zero |= _mm512_mask_cmple_epu16_mask(k->mask[v], _mm512_add_epi16(k->hi[v], one), one);
	}
	if (nonfinite)
		return ZC_ENONFINITE;
	if (zero)
		return KEY_RANGE_ZERO;
	_Pragma("GCC unroll 4")
	for (int v = 0; v < KEY_VECTORS; v++) {
		size_t c = c0 + 32 * (size_t)v;
		__m512i lo_half = half_order_key(k->lo[v]);
		__m512i hi_half = half_order_key(k->hi[v]);
		/* The min is an fp16 value already: store its bits. */
		_mm512_mask_storeu_epi16(mins + 2 * c, k->mask[v], lo_half);
		params_store16(_mm512_cvtph_ps(_mm512_castsi512_si256(lo_half)),
			       _mm512_cvtph_ps(_mm512_castsi512_si256(hi_half)), levels,
			       (__mmask16)k->mask[v], scales + 2 * c, NULL);
		params_store16(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo_half, 1)),
			       _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi_half, 1)), levels,
			       (__mmask16)(k->mask[v] >> 16), scales + 2 * c + 32, NULL);
	}
	return KEY_RANGE_STORED;
}

static void avx512_group_params(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				size_t dim, int bits, uint8_t *scales, uint8_t *mins)
{
	for (size_t c0 = 0; c0 < dim; c0 += 32 * KEY_VECTORS) {
		struct key_range k;
		key_range_init(&k, head + (size_t)rows[0] * dim, dim, c0);
		for (size_t r = 1; r < n_rows; r++)
			key_range_add(&k, head + (size_t)rows[r] * dim + c0, false);
		/* The caller checked these rows; NaN or Inf cannot be here. */
		if (key_range_store(&k, bits, c0, scales, mins) != KEY_RANGE_STORED)
			float_params_pass(head, rows, n_rows, dim, bits, scales, mins, c0);
	}
}

/* Channels per pass of group_quantize (the table without VBMI). */
#define QUANT_VECTORS 4

static void avx512_group_quantize(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				  size_t dim, int bits, const uint8_t *scales,
				  const uint8_t *mins, uint8_t *codes)
{
	const __m512 max_code = _mm512_set1_ps((float)((1 << bits) - 1));
	const __m512 zero = _mm512_setzero_ps();

	/* Channels outer, rows inner: each vector's scale and min are
	 * widened once per group instead of once per row. */
	for (size_t c0 = 0; c0 < dim; c0 += 16 * QUANT_VECTORS) {
		__m512 scale[QUANT_VECTORS], min[QUANT_VECTORS];
		__mmask16 mask[QUANT_VECTORS], flat[QUANT_VECTORS];
		_Pragma("GCC unroll 4")
		for (int v = 0; v < QUANT_VECTORS; v++) {
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
			for (int v = 0; v < QUANT_VECTORS; v++) {
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

/* ---- reconstruction ---------------------------------------------------- */

/*
 * One group's params, widened once for every row of the call: the 8
 * vectors (128 channels) starting at channel c0. `exact` says that no
 * reconstruction in these channels can need the clamp of docs/CODEC.md:
 * with 0 <= scale < Inf and a finite min, code*scale is exact and
 * rounding is monotonic, so min <= y <= fl(max_code*scale + min); when
 * that top stays <= 65504 for every channel, the clamp is the identity
 * (-0 included) and can be skipped. Corrupt payloads (NaN, Inf, negative
 * scales) simply take the clamped path, like the scalar reference.
 */
struct recon_params {
	__m512 scale[PARAMS_VECTORS], min[PARAMS_VECTORS];
	__mmask16 mask[PARAMS_VECTORS];
	size_t count;   /* channels in this pass, 1..128 */
	bool exact;
};

static inline __attribute__((always_inline)) void
recon_params_load(struct recon_params *p, size_t c0, size_t dim, int bits,
		  const uint8_t *scales, const uint8_t *mins)
{
	const __m512 max_code = _mm512_set1_ps((float)((1 << bits) - 1));
	const __m512 largest = _mm512_set1_ps(65504.0f);
	const __m512 infinity = _mm512_set1_ps(__builtin_inff());
	const __m512 zero = _mm512_setzero_ps();
	__mmask16 bad = 0;

	p->count = dim - c0 < 16 * PARAMS_VECTORS ? dim - c0 : 16 * PARAMS_VECTORS;
	_Pragma("GCC unroll 8")
	for (int v = 0; v < PARAMS_VECTORS; v++) {
		size_t c = c0 + 16 * (size_t)v;
		__mmask16 mask = c < dim ? tail_mask16(dim - c) : 0;
		__m512 scale = load_fp16x16(scales + 2 * c, mask);
		__m512 min = load_fp16x16(mins + 2 * c, mask);
		__m512 top = _mm512_fmadd_ps(max_code, scale, min);
		__mmask16 good = _mm512_cmp_ps_mask(scale, zero, _CMP_GE_OQ) &
				 _mm512_cmp_ps_mask(scale, infinity, _CMP_LT_OQ) &
				 _mm512_cmp_ps_mask(min, _mm512_sub_ps(zero, largest), _CMP_GE_OQ) &
				 _mm512_cmp_ps_mask(top, largest, _CMP_LE_OQ);
		bad |= mask & ~good;
		p->scale[v] = scale;
		p->min[v] = min;
		p->mask[v] = mask;
	}
	p->exact = bad == 0;
}

/* y = code * scale + min (one rounding: the product is exact), clamped
 * unless the group is exact, to fp16, stored. */
static inline __attribute__((always_inline)) void
recon_emit16(uint16_t *dst, __m512i code, __m512 scale, __m512 min, __mmask16 mask,
	     bool clamp, bool nt)
{
	__m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, min);
	if (clamp) {
		y = _mm512_max_ps(y, _mm512_set1_ps(-65504.0f));
		y = _mm512_min_ps(y, _mm512_set1_ps(65504.0f));
	}
	__m256i half = _mm512_cvtps_ph(y, ROUND_NEAREST);
	/* A masked VCVTPS2PH to memory is slow; store the full vector
	 * plainly and mask only the last one of a row. */
	if (mask == 0xffff && nt)
		_mm256_stream_si256((__m256i *)dst, half);
	else if (mask == 0xffff)
		_mm256_storeu_si256((__m256i *)dst, half);
	else
		_mm256_mask_storeu_epi16(dst, mask, half);
}

/* Eight bytes from `at`, zero past read_end; the caller uses only what
 * lies before it. */
static inline uint64_t load_codes64(const uint8_t *at, const uint8_t *read_end)
{
	uint64_t value = 0;
	if (at + 8 <= read_end)
		memcpy(&value, at, 8);
	else if (at < read_end)
		memcpy(&value, at, (size_t)(read_end - at));
	return value;
}

/* Sixteen codes starting at `bit` as 32-bit lanes, by PDEP. */
static inline __attribute__((always_inline)) __m512i
pdep_codes16(const uint8_t *stream, const uint8_t *read_end, size_t bit, int bits,
	     uint64_t lanes, bool safe)
{
	size_t next = bit + 8 * (size_t)bits;
	uint64_t first, second;
	if (safe) {
		memcpy(&first, stream + (bit >> 3), 8);
		memcpy(&second, stream + (next >> 3), 8);
	} else {
		first = load_codes64(stream + (bit >> 3), read_end);
		second = load_codes64(stream + (next >> 3), read_end);
	}
	first >>= bit & 7u;
	second >>= next & 7u;
	/* Built in registers: two 8-byte stores read back as one 16-byte
	 * load would stall store forwarding on every vector. */
	__m128i bytes = _mm_insert_epi64(_mm_cvtsi64_si128((long long)_pdep_u64(first, lanes)),
					 (long long)_pdep_u64(second, lanes), 1);
	return _mm512_cvtepu8_epi32(bytes);
}

static inline __attribute__((always_inline)) void
pdep_rows(const struct recon_params *p, const uint8_t *stream, const uint8_t *read_end,
	  size_t bit_offset, size_t n_rows, size_t dim, int bits, const uint32_t *tokens,
	  uint16_t *out, size_t token_stride, bool clamp, bool full, bool nt)
{
	const uint64_t lanes = 0x0101010101010101ull * ((1u << bits) - 1u);
	const size_t row_bits = dim * (size_t)bits;
	const size_t pass_bytes = (p->count * (size_t)bits + 7) / 8;

	for (size_t r = 0; r < n_rows; r++) {
		size_t bit = bit_offset + r * row_bits;
		uint16_t *dst = out + (size_t)tokens[r] * token_stride;
		/* Every 8-byte load of the row lies before read_end: unchecked. */
		bool safe = (size_t)(read_end - stream) >= (bit >> 3) + pass_bytes + 16;
		_Pragma("GCC unroll 8")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			if (!full && !p->mask[v])
				break;
			size_t vbit = bit + 16 * (size_t)v * (size_t)bits;
			__m512i code = safe ? pdep_codes16(stream, read_end, vbit, bits, lanes, true) :
					      pdep_codes16(stream, read_end, vbit, bits, lanes, false);
			recon_emit16(dst + 16 * v, code, p->scale[v], p->min[v],
				     full ? (__mmask16)0xffff : p->mask[v], clamp, nt);
		}
	}
}

/*
 * One and two bits: every channel has at most four possible outputs, so
 * the pass converts those once per group (fp16(clamp(k*scale + min)) for
 * k = 0..3, exactly the per-element formula) and each row only selects
 * among them: PEXT splits 32 codes' low and high bits into two masks,
 * and three blends pick 32 halves. No per-element arithmetic at all.
 */
#define LUT_VECTORS 4   /* 32 channels each: the 128 of one pass */

static inline __attribute__((always_inline)) __m512i
lut_entry(const struct recon_params *p, int v, float code)
{
	__m512 k = _mm512_set1_ps(code);
	__m256i lo_half, hi_half;
	__m512 y = _mm512_fmadd_ps(k, p->scale[2 * v], p->min[2 * v]);
	y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-65504.0f)), _mm512_set1_ps(65504.0f));
	lo_half = _mm512_cvtps_ph(y, ROUND_NEAREST);
	y = _mm512_fmadd_ps(k, p->scale[2 * v + 1], p->min[2 * v + 1]);
	y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-65504.0f)), _mm512_set1_ps(65504.0f));
	hi_half = _mm512_cvtps_ph(y, ROUND_NEAREST);
	return _mm512_inserti64x4(_mm512_castsi256_si512(lo_half), hi_half, 1);
}

/* `bits` bits of the stream from `bit` (up to 64), zero past read_end. */
static inline __attribute__((always_inline)) uint64_t
stream_bits64(const uint8_t *stream, const uint8_t *read_end, size_t bit, bool safe)
{
	const uint8_t *at = stream + (bit >> 3);
	unsigned shift = bit & 7u;
	uint64_t low, high = 0;
	if (safe) {
		memcpy(&low, at, 8);
		if (shift)
			memcpy(&high, at + 8, 8);
	} else {
		low = load_codes64(at, read_end);
		if (shift)
			high = load_codes64(at + 8, read_end);
	}
	return shift ? (low >> shift) | (high << (64 - shift)) : low;
}

static inline __attribute__((always_inline)) void
lut_rows(const struct recon_params *p, const uint8_t *stream, const uint8_t *read_end,
	 size_t bit_offset, size_t n_rows, size_t dim, int bits, const uint32_t *tokens,
	 uint16_t *out, size_t token_stride, bool two, bool nt)
{
	const uint64_t even = 0x5555555555555555ull, odd = 0xaaaaaaaaaaaaaaaaull;
	const size_t row_bits = dim * (size_t)bits;
	const size_t pass_bytes = (p->count * (size_t)bits + 7) / 8;
	__m512i y0[LUT_VECTORS], y1[LUT_VECTORS], y2[LUT_VECTORS], y3[LUT_VECTORS];
	__mmask32 mask[LUT_VECTORS];

	_Pragma("GCC unroll 4")
	for (int v = 0; v < LUT_VECTORS; v++) {
		mask[v] = (__mmask32)p->mask[2 * v] | (__mmask32)p->mask[2 * v + 1] << 16;
		y0[v] = lut_entry(p, v, 0.0f);
		y1[v] = lut_entry(p, v, 1.0f);
		if (two) {
			y2[v] = lut_entry(p, v, 2.0f);
			y3[v] = lut_entry(p, v, 3.0f);
		}
	}
	for (size_t r = 0; r < n_rows; r++) {
		size_t bit = bit_offset + r * row_bits;
		uint16_t *dst = out + (size_t)tokens[r] * token_stride;
		bool safe = (size_t)(read_end - stream) >= (bit >> 3) + pass_bytes + 16;
		_Pragma("GCC unroll 4")
		for (int v = 0; v < LUT_VECTORS; v++) {
			if (!mask[v])
				break;
			__m512i half;
			if (two) {
				uint64_t codes = safe ?
					stream_bits64(stream, read_end, bit + 64 * (size_t)v, true) :
					stream_bits64(stream, read_end, bit + 64 * (size_t)v, false);
				__mmask32 low = (__mmask32)_pext_u64(codes, even);
				__mmask32 high = (__mmask32)_pext_u64(codes, odd);
				half = _mm512_mask_blend_epi16(high,
							       _mm512_mask_blend_epi16(low, y0[v], y1[v]),
							       _mm512_mask_blend_epi16(low, y2[v], y3[v]));
			} else {
				uint64_t codes = safe ?
					stream_bits64(stream, read_end, bit + 32 * (size_t)v, true) :
					stream_bits64(stream, read_end, bit + 32 * (size_t)v, false);
				half = _mm512_mask_blend_epi16((__mmask32)codes, y0[v], y1[v]);
			}
			if (mask[v] == 0xffffffffu && nt)
				_mm512_stream_si512((void *)(dst + 32 * v), half);
			else if (mask[v] == 0xffffffffu)
				_mm512_storeu_si512((void *)(dst + 32 * v), half);
			else
				_mm512_mask_storeu_epi16(dst + 32 * v, mask[v], half);
		}
	}
}

/*
 * Four bits, a whole pass of 128 channels on whole bytes: byte j of a
 * 16-byte run holds channels 2j (low nibble) and 2j+1 (high nibble), so
 * one widening load gives the codes of 16 even and 16 odd channels. The
 * params are split the same way once per group, and one VPERMT2W puts
 * the two halves' results back in channel order for a 64-byte store.
 */
static inline __attribute__((always_inline)) void
nibble_rows(const struct recon_params *p, const uint8_t *stream, size_t bit_offset,
	    size_t n_rows, size_t dim, const uint32_t *tokens, uint16_t *out,
	    size_t token_stride, bool clamp, bool nt)
{
	const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
					      2, 0);
	const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
	/* Word 2i from the even results (first source), 2i+1 from the odd. */
	const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
						    41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
						    34, 2, 33, 1, 32, 0);
	const __m512i low4 = _mm512_set1_epi32(15);
	const size_t row_bytes = dim / 2;
	__m512 scale_even[4], scale_odd[4], min_even[4], min_odd[4];

	_Pragma("GCC unroll 4")
	for (int w = 0; w < 4; w++) {
		scale_even[w] = _mm512_permutex2var_ps(p->scale[2 * w], even, p->scale[2 * w + 1]);
		scale_odd[w] = _mm512_permutex2var_ps(p->scale[2 * w], odd, p->scale[2 * w + 1]);
		min_even[w] = _mm512_permutex2var_ps(p->min[2 * w], even, p->min[2 * w + 1]);
		min_odd[w] = _mm512_permutex2var_ps(p->min[2 * w], odd, p->min[2 * w + 1]);
	}
	for (size_t r = 0; r < n_rows; r++) {
		const uint8_t *at = stream + (bit_offset >> 3) + r * row_bytes;
		uint16_t *dst = out + (size_t)tokens[r] * token_stride;
		_Pragma("GCC unroll 4")
		for (int w = 0; w < 4; w++) {
			__m512i pairs = _mm512_cvtepu8_epi32(
				_mm_loadu_si128((const __m128i *)(at + 16 * w)));
			__m512 y_even = _mm512_fmadd_ps(
				_mm512_cvtepi32_ps(_mm512_and_si512(pairs, low4)), scale_even[w],
				min_even[w]);
			__m512 y_odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 4)),
						       scale_odd[w], min_odd[w]);
			if (clamp) {
				const __m512 lowest = _mm512_set1_ps(-65504.0f);
				const __m512 highest = _mm512_set1_ps(65504.0f);
				y_even = _mm512_min_ps(_mm512_max_ps(y_even, lowest), highest);
				y_odd = _mm512_min_ps(_mm512_max_ps(y_odd, lowest), highest);
			}
			__m256i h_even = _mm512_cvtps_ph(y_even, ROUND_NEAREST);
			__m256i h_odd = _mm512_cvtps_ph(y_odd, ROUND_NEAREST);
			__m512i halves = _mm512_permutex2var_epi16(_mm512_castsi256_si512(h_even),
								   interleave,
								   _mm512_castsi256_si512(h_odd));
			if (nt)
				_mm512_stream_si512((void *)(dst + 32 * w), halves);
			else
				_mm512_storeu_si512((void *)(dst + 32 * w), halves);
		}
	}
}

/* The methods for 1, 2 and 4 bits, which need no VBMI: true if one of
 * them took the 128-channel pass whose codes start at `bit`. */
static inline __attribute__((always_inline)) bool
common_pass(const struct recon_params *p, const uint8_t *stream, const uint8_t *read_end,
	    size_t bit, size_t n_rows, size_t dim, int bits, const uint32_t *tokens,
	    uint16_t *out, size_t token_stride, bool nt)
{
	if (bits == 4 && p->count == 16 * PARAMS_VECTORS && dim % 2 == 0 && bit % 8 == 0) {
		if (p->exact)
			nibble_rows(p, stream, bit, n_rows, dim, tokens, out, token_stride, false, nt);
		else
			nibble_rows(p, stream, bit, n_rows, dim, tokens, out, token_stride, true, nt);
		return true;
	}
	if (bits == 2) {
		lut_rows(p, stream, read_end, bit, n_rows, dim, bits, tokens, out, token_stride,
			 true, nt);
		return true;
	}
	if (bits == 1) {
		lut_rows(p, stream, read_end, bit, n_rows, dim, bits, tokens, out, token_stride,
			 false, nt);
		return true;
	}
	return false;
}

static inline __attribute__((always_inline)) void
group_reconstruct_with(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
		       size_t n_rows, size_t dim, int bits, const uint8_t *scales,
		       const uint8_t *mins, const uint32_t *tokens, uint16_t *out,
		       size_t token_stride, bool nt)
{
	for (size_t c0 = 0; c0 < dim; c0 += 16 * PARAMS_VECTORS) {
		struct recon_params p;
		recon_params_load(&p, c0, dim, bits, scales, mins);
		size_t bit = bit_offset + c0 * (size_t)bits;
		if (common_pass(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				token_stride, nt))
			continue;
		if (p.exact && p.count == 16 * PARAMS_VECTORS)
			pdep_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, false, true, nt);
		else if (p.exact)
			pdep_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, false, false, nt);
		else
			pdep_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, true, false, nt);
	}
}

/*
 * nt: non-temporal stores for whole vectors (rows start on cache lines,
 * so 64-byte stores are aligned, and 32-byte ones at 32-byte steps); the
 * SFENCE orders the streamed lines before whatever the caller publishes
 * next.
 */
static void avx512_group_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				     size_t bit_offset, size_t n_rows, size_t dim, int bits,
				     const uint8_t *scales, const uint8_t *mins,
				     const uint32_t *tokens, uint16_t *out, size_t token_stride,
				     bool nt)
{
	if (!nt) {
		group_reconstruct_with(stream, read_end, bit_offset, n_rows, dim, bits, scales,
				       mins, tokens, out, token_stride, false);
		return;
	}
	group_reconstruct_with(stream, read_end, bit_offset, n_rows, dim, bits, scales, mins,
			       tokens, out, token_stride, true);
	_mm_sfence();
}

/* ---- VBMI: code unpacking and packing in vector registers -------------- */

/* Everything below needs VBMI on top of the file's flags. */
/* PREFETCHW came with Broadwell and Zen, before any VBMI; where it is
 * absent its opcode is a no-op. */
#define VBMI __attribute__((target("avx512vbmi,prfchw")))

/* Byte i of each qword (0..7) and the index k of the qword. */
static inline VBMI __m512i byte_in_qword(void)
{
	return _mm512_set1_epi64(0x0706050403020100ll);
}

static inline VBMI __m512i qword_index(void)
{
	return _mm512_set_epi64(7 * 0x0101010101010101ll, 6 * 0x0101010101010101ll,
				5 * 0x0101010101010101ll, 4 * 0x0101010101010101ll,
				3 * 0x0101010101010101ll, 2 * 0x0101010101010101ll,
				0x0101010101010101ll, 0);
}

/*
 * 64 codes whose first starts at bit `shift` (0..7) of at[0], one per
 * byte. Codes 8k..8k+7 start in byte k*bits at the same bit `shift`, and
 * shift + 8*bits <= 64 for every width (8 bits: shift is 0), so VPERMB
 * puts bytes k*bits..k*bits+7 in qword k and VPMULTISHIFTQB pulls code
 * 8k+i out of it at bit shift + i*bits. Bytes past read_end load as zero.
 */
static inline __attribute__((always_inline)) VBMI __m512i
vbmi_codes64(const uint8_t *at, const uint8_t *read_end, __m512i gather, __m512i shifts,
	     __m512i code_mask)
{
	__m512i src;
	if (at + 64 <= read_end) {
		src = _mm512_loadu_si512((const void *)at);
	} else {
		size_t avail = at < read_end ? (size_t)(read_end - at) : 0;
		src = _mm512_maskz_loadu_epi8((__mmask64)((UINT64_C(1) << avail) - 1u), at);
	}
	return _mm512_and_si512(_mm512_multishift_epi64_epi8(
					shifts, _mm512_permutexvar_epi8(gather, src)),
				code_mask);
}

/* VPERMB indices that widen codes 16q..16q+15 of a 64-code vector to
 * 32-bit lanes (with a zeroing mask that keeps byte 0 of each lane). */
static inline VBMI __m512i widen_quarter(int q)
{
	return _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
						 1, 0),
				_mm512_set1_epi32(16 * q));
}

#define LANE_BYTE0 ((__mmask64)0x1111111111111111ull)

static inline __attribute__((always_inline)) VBMI void
vbmi_rows(const struct recon_params *p, const uint8_t *stream, const uint8_t *read_end,
	  size_t bit_offset, size_t n_rows, size_t dim, int bits, const uint32_t *tokens,
	  uint16_t *out, size_t token_stride, bool clamp, bool full, bool nt)
{
	const size_t row_bits = dim * (size_t)bits;
	const __m512i widths = _mm512_set1_epi16((short)bits);
	const __m512i gather = _mm512_add_epi8(_mm512_mullo_epi16(qword_index(), widths),
					       byte_in_qword());
	const __m512i shift_base = _mm512_mullo_epi16(byte_in_qword(), widths);
	const __m512i code_mask = _mm512_set1_epi8((char)((1u << bits) - 1u));
	const __m512i widen[4] = { widen_quarter(0), widen_quarter(1), widen_quarter(2),
				   widen_quarter(3) };
	const int vectors = full ? PARAMS_VECTORS : (int)((p->count + 15) / 16);

	for (size_t r = 0; r < n_rows; r++) {
		size_t bit = bit_offset + r * row_bits;
		const uint8_t *at = stream + (bit >> 3);
		uint16_t *dst = out + (size_t)tokens[r] * token_stride;
		__m512i shifts = _mm512_add_epi8(shift_base, _mm512_set1_epi8((char)(bit & 7u)));
		__m512i codes = _mm512_setzero_si512();
		_Pragma("GCC unroll 8")
		for (int v = 0; v < PARAMS_VECTORS; v++) {
			if (!full && v >= vectors)
				break;
			if (v % 4 == 0)
				codes = vbmi_codes64(at + (size_t)(v / 4) * 8 * (size_t)bits, read_end,
						     gather, shifts, code_mask);
			__m512i code = _mm512_maskz_permutexvar_epi8(LANE_BYTE0, widen[v % 4], codes);
			recon_emit16(dst + 16 * v, code, p->scale[v], p->min[v],
				     full ? (__mmask16)0xffff : p->mask[v], clamp, nt);
		}
	}
}

static inline __attribute__((always_inline)) VBMI void
vbmi_reconstruct_with(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
		      size_t n_rows, size_t dim, int bits, const uint8_t *scales,
		      const uint8_t *mins, const uint32_t *tokens, uint16_t *out,
		      size_t token_stride, bool nt)
{
	for (size_t c0 = 0; c0 < dim; c0 += 16 * PARAMS_VECTORS) {
		struct recon_params p;
		recon_params_load(&p, c0, dim, bits, scales, mins);
		size_t bit = bit_offset + c0 * (size_t)bits;
		if (common_pass(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				token_stride, nt))
			continue;
		if (p.exact && p.count == 16 * PARAMS_VECTORS)
			vbmi_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, false, true, nt);
		else if (p.exact)
			vbmi_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, false, false, nt);
		else
			vbmi_rows(&p, stream, read_end, bit, n_rows, dim, bits, tokens, out + c0,
				  token_stride, true, false, nt);
	}
}

static VBMI void vbmi_group_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				   size_t bit_offset, size_t n_rows, size_t dim, int bits,
				   const uint8_t *scales, const uint8_t *mins,
				   const uint32_t *tokens, uint16_t *out, size_t token_stride,
				   bool nt)
{
	if (!nt) {
		vbmi_reconstruct_with(stream, read_end, bit_offset, n_rows, dim, bits, scales,
				      mins, tokens, out, token_stride, false);
		return;
	}
	vbmi_reconstruct_with(stream, read_end, bit_offset, n_rows, dim, bits, scales, mins,
			      tokens, out, token_stride, true);
	_mm_sfence();
}

/*
 * Quantize and pack in one pass (dim*bits a multiple of 8, params from
 * the same rows). Per 16 channels: q = (x - min16) / scale16, a true
 * division as the contract says. Here x >= min16 (min16 is the group's
 * minimum, exact in fp16), so q >= 0 or q is NaN only for 0/0, when
 * scale16 == 0; and rint-then-clamp equals convert-with-round-to-nearest
 * then an unsigned min with max_code: VCVTPS2DQ rounds half to even like
 * rint, and its out-of-range answer 0x80000000 (q too large, Inf, NaN) is
 * above max_code unsigned. Lanes with scale16 == 0, or past the row end,
 * get a cap of 0 instead of max_code: code 0.
 *
 * Packing 64 byte codes c[0..63] to 64*bits bits: VPACKUSDW/VPACKUSWB
 * leave code 16s + 4L + i at byte 16L + 4s + i (128-bit lane L); pairs
 * of bytes, then of words, are merged by multiply-add (c0 + c1 << b,
 * then w0 + w1 << 2b), so each dword holds 4 consecutive codes (4b bits)
 * and VPERMB gathers their bytes in code order (odd b first merges dword
 * pairs into 8b-bit qwords, after VPERMD has put them side by side).
 */
struct encode_tables {
	__m512i pair, quad, order, dword_order;
	int bits;
};

static VBMI void encode_tables_init(struct encode_tables *t, int bits)
{
	uint8_t order[64] = { 0 };
	uint32_t dword_order[16];

	/* Dword (4L + s) holds codes 4g..4g+3 of group g = 4s + L. */
	for (int g = 0; g < 16; g++)
		dword_order[g] = (uint32_t)(4 * (g % 4) + g / 4);
	if (bits == 8) {
		for (int j = 0; j < 64; j++)
			order[j] = (uint8_t)(16 * ((j % 16) / 4) + 4 * (j / 16) + j % 4);
	} else if (bits % 2 == 0) {
		int per = bits / 2;
		for (int g = 0; g < 16; g++)
			for (int j = 0; j < per; j++)
				order[g * per + j] = (uint8_t)(4 * dword_order[g] + (uint32_t)j);
	} else {
		for (int m = 0; m < 8; m++)
			for (int j = 0; j < bits; j++)
				order[m * bits + j] = (uint8_t)(8 * m + j);
	}
	t->bits = bits;
	t->pair = _mm512_set1_epi16((short)(((1 << bits) << 8) | 1));
	t->quad = _mm512_set1_epi32((int)((UINT32_C(1) << (2 * bits)) << 16 | 1u));
	t->order = _mm512_loadu_si512((const void *)order);
	t->dword_order = _mm512_loadu_si512((const void *)dword_order);
}

enum pack_kind { PACK_EVEN, PACK_ODD, PACK_BYTES };

static inline __attribute__((always_inline)) VBMI __m512i
pack64(const struct encode_tables *t, enum pack_kind kind, __m512i q0, __m512i q1, __m512i q2,
       __m512i q3)
{
	__m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(q0, q1),
					    _mm512_packus_epi32(q2, q3));
	if (kind == PACK_BYTES)
		return _mm512_permutexvar_epi8(t->order, bytes);
	/* Unsigned multiplier (1, 2^b), signed codes: 2^7 fits, codes < 128. */
	__m512i words = _mm512_maddubs_epi16(t->pair, bytes);
	__m512i dwords = _mm512_madd_epi16(words, t->quad);
	if (kind == PACK_ODD) {
		dwords = _mm512_permutexvar_epi32(t->dword_order, dwords);
		__m512i high = _mm512_sll_epi64(_mm512_srli_epi64(dwords, 32),
						_mm_cvtsi32_si128(4 * t->bits));
		dwords = _mm512_ternarylogic_epi64(dwords, _mm512_set1_epi64(0xffffffffll), high,
						   0xea); /* (a & b) | c */
	}
	return _mm512_permutexvar_epi8(t->order, dwords);
}

/* Channels per pass of group_encode: two packs of 64 codes per row. */
#define ENCODE_VECTORS 8

/* One group's params for ENCODE_VECTORS vectors, widened once. */
struct encode_params {
	__m512 scale[ENCODE_VECTORS], min[ENCODE_VECTORS];
	__m512i cap[ENCODE_VECTORS];
	__mmask16 mask[ENCODE_VECTORS];
};

/*
 * What a pass of group_encode writes besides the codes, a constant in the
 * hot instantiations so that their loop carries no branch per vector:
 * no view, a view whose group is exact (recon_params: no clamp), or one
 * that needs the clamp.
 */
enum view_kind { VIEW_NONE, VIEW_EXACT, VIEW_CLAMPED };

/* The next group, whose params group_encode works out on the way. */
struct next_group {
	const uint32_t *rows;
	size_t n_rows;   /* 0: none */
	uint8_t *scales, *mins;
};

/*
 * What a pass that writes a view asks for ahead of the row it encodes. A
 * prefill's views go to lines no cache holds, so a plain store first waits
 * for its line to be read for ownership, and the salient rows lie
 * scattered over the head, where no hardware stream follows them: the
 * view lines of the row VIEW_AHEAD_ROWS on are asked for with write
 * intent. And a block of values has no pass that reads its head before
 * the encode (keys have their norms), while the stores of the views take
 * the memory's attention: the input row INPUT_AHEAD_TOKENS tokens on (two
 * groups of the default 32) is asked for too, in cache already for keys.
 * Measured on the device's host, the codec over a prefill's cold memory:
 * 14 % less time, values 19 % (docs/BENCHMARKS.md).
 */
#define VIEW_AHEAD_ROWS 8
#define INPUT_AHEAD_TOKENS 64

/* The lines of `bytes` at `at`, for reading or with write intent. */
static inline __attribute__((always_inline)) VBMI void
lines_prefetch(uintptr_t at, size_t bytes, bool write)
{
	uintptr_t last = (at + bytes - 1) & ~(uintptr_t)63;
	for (uintptr_t line = at & ~(uintptr_t)63; line <= last; line += 64) {
		if (write)
			_m_prefetchw((void *)line);
		else
			_mm_prefetch((const char *)line, _MM_HINT_T0);
	}
}

/* The view lines of the row VIEW_AHEAD_ROWS past r (in this group, else
 * in the next), and the input INPUT_AHEAD_TOKENS past row r's token (past
 * the head's end it is the next head's, or nothing: a prefetch never
 * faults, and the address is only a number here); span_bytes is a row's
 * fp16 bytes in this pass, in the input and in the view alike. */
static inline __attribute__((always_inline)) VBMI void
rows_ahead(const uint16_t *head, size_t dim, size_t c0, uint16_t *view_at, size_t view_stride,
	   size_t span_bytes, const uint32_t *rows, size_t n_rows, const struct next_group *next,
	   size_t r, bool stream)
{
	lines_prefetch((uintptr_t)(head + c0) +
			       ((size_t)rows[r] + INPUT_AHEAD_TOKENS) * dim * sizeof(uint16_t),
		       span_bytes, false);
	/* Non-temporal stores read no line for ownership. */
	if (stream)
		return;
	size_t ahead = r + VIEW_AHEAD_ROWS;
	if (ahead < n_rows)
		lines_prefetch((uintptr_t)(view_at + (size_t)rows[ahead] * view_stride), span_bytes,
			       true);
	else if (ahead - n_rows < next->n_rows)
		lines_prefetch((uintptr_t)(view_at + (size_t)next->rows[ahead - n_rows] * view_stride),
			       span_bytes, true);
}

/* `full`: the pass has all ENCODE_VECTORS vectors whole, so no load or
 * store needs a mask. The view is written as recon_emit16 would from the
 * packed stream: the same params, the same FMA, the same clamp. Plain
 * stores, their lines asked for ahead (rows_ahead), or with `stream` (a
 * full pass: whole lines, in order) non-temporal ones, where
 * codec_views_stream() says they are faster. */
static inline __attribute__((always_inline)) VBMI void
encode_row(const struct encode_params *p, const struct encode_tables *t, enum pack_kind kind,
	   const uint16_t *row, uint8_t *dst, bool two, const __mmask64 store[2], int fixed_bits,
	   bool full, enum view_kind vk, uint16_t *view_row, bool stream)
{
	_Pragma("GCC unroll 2")
	for (int h = 0; h < 2; h++) {
		if (h == 1 && !two)
			break;
		__m512i q[4];
		_Pragma("GCC unroll 4")
		for (int v = 0; v < 4; v++) {
			int u = 4 * h + v;
			__m512 x = full ? _mm512_cvtph_ps(_mm256_loadu_si256(
						  (const __m256i *)(row + 16 * u))) :
					  load_fp16x16(row + 16 * u, p->mask[u]);
			__m512 f = _mm512_div_ps(_mm512_sub_ps(x, p->min[u]), p->scale[u]);
			q[v] = _mm512_min_epu32(_mm512_cvt_roundps_epi32(f, ROUND_NEAREST), p->cap[u]);
			if (vk != VIEW_NONE && (full || p->mask[u]))
				recon_emit16(view_row + 16 * u, q[v], p->scale[u], p->min[u],
					     full ? (__mmask16)0xffff : p->mask[u],
					     vk == VIEW_CLAMPED, stream);
		}
		__m512i packed = pack64(t, kind, q[0], q[1], q[2], q[3]);
		uint8_t *at = dst + (size_t)h * 8 * (size_t)t->bits;
		/* Masked byte stores are slow: whole 64-code runs of 2 or 4
		 * bits are exactly an xmm or a ymm. */
		if (fixed_bits == 2 && (full || store[h] == 0xffff))
			_mm_storeu_si128((__m128i *)at, _mm512_castsi512_si128(packed));
		else if (fixed_bits == 4 && (full || store[h] == 0xffffffffu))
			_mm256_storeu_si256((__m256i *)at, _mm512_castsi512_si256(packed));
		else
			_mm512_mask_storeu_epi8(at, store[h], packed);
	}
}

/*
 * Encodes the pass's rows and, in the same loop, finds the next group's
 * min and max: the divisions bound the loop, and the min/max work of the
 * next group fits in their shadow.
 */
static inline __attribute__((always_inline)) VBMI int
encode_rows(const struct encode_params *p, const struct encode_tables *t, enum pack_kind kind,
	    const uint16_t *head, const uint32_t *rows, size_t n_rows, size_t dim, size_t c0,
	    size_t count, uint8_t *out, size_t row_bytes, bool two, const __mmask64 store[2],
	    const struct next_group *next, int bits, int fixed_bits, bool full,
	    enum view_kind vk, const struct codec_view *view)
{
	size_t r = 0;
	uint16_t *view_at = vk != VIEW_NONE ? view->at + c0 : NULL;
	size_t view_stride = vk != VIEW_NONE ? view->token_stride : 0;
	size_t span_bytes = count * sizeof(uint16_t);
	bool stream = full && vk != VIEW_NONE && view->stream;
	/* encode_row's arguments from `row` on, for listed row r. */
#define ROW(r) head + (size_t)rows[r] * dim + c0, out + (r) * row_bytes, two, store, fixed_bits, \
	full, vk, vk != VIEW_NONE ? view_at + (size_t)rows[r] * view_stride : NULL, stream
#define AHEAD(r)                                                                               \
	do {                                                                                   \
		if (vk != VIEW_NONE)                                                           \
			rows_ahead(head, dim, c0, view_at, view_stride, span_bytes, rows, n_rows, \
				   next, r, stream);                                           \
	} while (0)
	/* The group's first rows' views (the previous group asked for them,
	 * unless this is a subset's first). */
	for (size_t w = 0; vk != VIEW_NONE && !stream && w < VIEW_AHEAD_ROWS && w < n_rows; w++)
		lines_prefetch((uintptr_t)(view_at + (size_t)rows[w] * view_stride), span_bytes,
			       true);
	if (next->n_rows) {
		struct key_range k;
		size_t both = n_rows < next->n_rows ? n_rows : next->n_rows;
		key_range_init(&k, head + (size_t)next->rows[0] * dim, dim, c0);
		AHEAD(0);
		encode_row(p, t, kind, ROW(0));
		for (r = 1; r < both; r++) {
			key_range_add(&k, head + (size_t)next->rows[r] * dim + c0, full);
			AHEAD(r);
			encode_row(p, t, kind, ROW(r));
		}
		for (size_t n = both; n < next->n_rows; n++)
			key_range_add(&k, head + (size_t)next->rows[n] * dim + c0, full);
		int rc = key_range_store(&k, bits, c0, next->scales, next->mins);
		if (rc < 0)
			return rc;
		if (rc == KEY_RANGE_ZERO)
			float_params_pass(head, next->rows, next->n_rows, dim, bits, next->scales,
					  next->mins, c0);
	}
	for (; r < n_rows; r++) {
		AHEAD(r);
		encode_row(p, t, kind, ROW(r));
	}
#undef AHEAD
#undef ROW
	return 0;
}

static VBMI int vbmi_group_encode(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			      size_t dim, int bits, const uint8_t *scales, const uint8_t *mins,
			      uint8_t *codes, const uint32_t *next_rows, size_t n_next,
			      uint8_t *next_scales, uint8_t *next_mins,
			      const struct codec_view *view)
{
	const __m512i max_code = _mm512_set1_epi32((1 << bits) - 1);
	const __m512 zero = _mm512_setzero_ps();
	const size_t row_bytes = dim * (size_t)bits / 8;
	const enum pack_kind kind = bits == 8 ? PACK_BYTES : bits % 2 ? PACK_ODD : PACK_EVEN;
	const struct next_group next = { next_rows, n_next, next_scales, next_mins };
	struct encode_tables t;

	encode_tables_init(&t, bits);
	for (size_t c0 = 0; c0 < dim; c0 += 16 * ENCODE_VECTORS) {
		struct encode_params p;
		size_t count = dim - c0 < 16 * ENCODE_VECTORS ? dim - c0 : 16 * ENCODE_VECTORS;
		__mmask64 store[2];
		_Pragma("GCC unroll 2")
		for (int h = 0; h < 2; h++) {
			size_t n = count > 64 * (size_t)h ? count - 64 * (size_t)h : 0;
			size_t nbytes = (n < 64 ? n : 64) * (size_t)bits / 8;
			store[h] = nbytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << nbytes) - 1u);
		}
		_Pragma("GCC unroll 8")
		for (int v = 0; v < ENCODE_VECTORS; v++) {
			size_t c = c0 + 16 * (size_t)v;
			p.mask[v] = c < dim ? tail_mask16(dim - c) : 0;
			p.scale[v] = load_fp16x16(scales + 2 * c, p.mask[v]);
			p.min[v] = load_fp16x16(mins + 2 * c, p.mask[v]);
			__mmask16 flat = _mm512_cmp_ps_mask(p.scale[v], zero, _CMP_EQ_OQ);
			p.cap[v] = _mm512_maskz_mov_epi32(p.mask[v] & ~flat, max_code);
		}
		enum view_kind vk = VIEW_NONE;
		if (view) {
			struct recon_params r;
			recon_params_load(&r, c0, dim, bits, scales, mins);
			vk = r.exact ? VIEW_EXACT : VIEW_CLAMPED;
		}
		uint8_t *out = codes + c0 * (size_t)bits / 8;
		bool two = count > 64;
		/* Whole 128-channel passes of 2 or 4 bits (every prefill head at
		 * D = 128) get one instantiation per view kind; the others one
		 * per packing kind, the view kind tested per vector. */
		bool full = (bits == 2 || bits == 4) && count == 16 * ENCODE_VECTORS;
#define ENCODE(kind_, two_, fixed_, full_, vk_)                                            \
	encode_rows(&p, &t, kind_, head, rows, n_rows, dim, c0, count, out, row_bytes, two_,  \
		    store, &next, bits, fixed_, full_, vk_, view)
		int rc;
		if (full && bits == 2)
			rc = vk == VIEW_NONE  ? ENCODE(PACK_EVEN, true, 2, true, VIEW_NONE) :
			     vk == VIEW_EXACT ? ENCODE(PACK_EVEN, true, 2, true, VIEW_EXACT) :
						ENCODE(PACK_EVEN, true, 2, true, VIEW_CLAMPED);
		else if (full)
			rc = vk == VIEW_NONE  ? ENCODE(PACK_EVEN, true, 4, true, VIEW_NONE) :
			     vk == VIEW_EXACT ? ENCODE(PACK_EVEN, true, 4, true, VIEW_EXACT) :
						ENCODE(PACK_EVEN, true, 4, true, VIEW_CLAMPED);
		else if (bits == 2 && two)
			rc = ENCODE(PACK_EVEN, true, 2, false, vk);
		else if (bits == 4 && two)
			rc = ENCODE(PACK_EVEN, true, 4, false, vk);
		else if (kind == PACK_EVEN)
			rc = ENCODE(PACK_EVEN, two, 0, false, vk);
		else if (kind == PACK_ODD)
			rc = ENCODE(PACK_ODD, two, 0, false, vk);
		else
			rc = ENCODE(PACK_BYTES, two, 0, false, vk);
#undef ENCODE
		if (rc < 0)
			return rc;
	}
	return 0;
}


const struct codec_kernels codec_kernels_avx512 = {
	.name = "avx512",
	.check_finite = avx512_check_finite,
	.row_norms = avx512_row_norms,
	.group_params = avx512_group_params,
	.group_quantize = avx512_group_quantize,
	.pack = codec_pack_bmi2,
	.group_reconstruct = avx512_group_reconstruct,
};

const struct codec_kernels codec_kernels_avx512_vbmi = {
	.name = "avx512-vbmi",
	.check_finite = avx512_check_finite,
	.row_norms = avx512_row_norms,
	.group_params = avx512_group_params,
	.group_quantize = avx512_group_quantize,
	.pack = codec_pack_bmi2,
	.group_encode = vbmi_group_encode,
	.group_reconstruct = vbmi_group_reconstruct,
};
