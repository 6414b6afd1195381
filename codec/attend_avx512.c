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
#include <stddef.h>
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

/* ---- codes whose rows start on whole bytes: per-call tables ------------- */

/*
 * The codes path for dim % 8 == 0 (every row, and every 16 channels of
 * it, starts on a whole byte: chunk k of a row is the 2*bits bytes at
 * row + 2*bits*k) and dim <= FAST_MAX_DIM, when every load below stays
 * before read_end. Everything that depends only on the group is done
 * once per call, not once per tile:
 *
 * - 1 and 2 bits: the 2 or 4 values a code can take in each channel,
 *   fp16(clamp(code * scale + min)) widened, as zc_block_reconstruct()
 *   stores them (kernels_avx512.c's lut_rows does the same); a row is
 *   then selected from them with blends whose masks are the code bits
 *   themselves. No arithmetic per element: the same fp32 values, so the
 *   same products and sums as every other table.
 * - 3..8 bits: scale and min widened, whether the clamp can change
 *   anything, and the controls of a shuffle that unpacks 16 codes from a
 *   16-byte window (byte and shift of code j, then the code mask)
 *   instead of two PDEPs.
 */
#define FAST_MAX_DIM 256u
#define FAST_CHUNKS (FAST_MAX_DIM / 16)

struct codes_plan {
	/* The group the tables are for (attend_kernels.h's group cache):
	 * zeroed, it matches none. */
	const uint8_t *scales, *mins;
	size_t dim;
	const uint8_t *rows;   /* row 0's first byte (set every call) */
	size_t row_bytes;      /* dim * bits / 8 */
	size_t chunks;         /* 16-channel chunks: ceil(dim / 16) */
	int bits;
	bool clamp;            /* bits > 2: the clamp can change something */
	__m512i shuffle, shifts, code_mask;
	__m512 scale[FAST_CHUNKS], min[FAST_CHUNKS];
	__m512 lut[4][FAST_CHUNKS];
};

/* Whether the fast path takes this call: whole-byte rows, and a 16-byte
 * window at every chunk of every row lies before read_end. */
static bool fast_codes(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
		       size_t n_rows, size_t dim, int bits)
{
	if (dim % 8 != 0 || dim > FAST_MAX_DIM || bits < 1 || bits > 8 || bit_offset % 8 != 0)
		return false;
	size_t end = bit_offset / 8 + n_rows * dim * (size_t)bits / 8;
	return (size_t)(read_end - stream) >= end + 16;
}

static void codes_plan_init(struct codes_plan *cp, const uint8_t *stream, size_t bit_offset,
			    size_t dim, int bits, const uint8_t *scales, const uint8_t *mins)
{
	const __m512 largest = _mm512_set1_ps(65504.0f);
	const __m512 lowest = _mm512_set1_ps(-65504.0f);
	const __m512 zero = _mm512_setzero_ps();

	cp->rows = stream + bit_offset / 8;
	cp->row_bytes = dim * (size_t)bits / 8;
	cp->chunks = (dim + 15) / 16;
	cp->bits = bits;
	cp->clamp = false;
	/* The params two groups on (about one chunk for groups of 32). */
	for (size_t at = 0; at < 2 * dim; at += 64) {
		_mm_prefetch((const char *)scales + 8 * dim + at, _MM_HINT_T0);
		_mm_prefetch((const char *)mins + 8 * dim + at, _MM_HINT_T0);
	}
	for (size_t k = 0; k < cp->chunks; k++) {
		__mmask16 mask = tail_mask16(dim - 16 * k);
		/* Lanes past dim: scale = min = 0, so every value there is 0. */
		__m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + 32 * k));
		__m512 min = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + 32 * k));
		if (bits <= 2) {
			for (int v = 0; v < (1 << bits); v++) {
				/* The product is exact: one rounding, as the reference's
				 * mul + add; MAXPS/MINPS with the bound second, as there. */
				__m512 y = _mm512_fmadd_ps(_mm512_set1_ps((float)v), scale, min);
				y = _mm512_min_ps(_mm512_max_ps(y, lowest), largest);
				cp->lut[v][k] = _mm512_cvtph_ps(_mm512_cvtps_ph(y, ROUND_NEAREST));
			}
			continue;
		}
		cp->scale[k] = scale;
		cp->min[k] = min;
		__m512 top = _mm512_fmadd_ps(_mm512_set1_ps((float)((1 << bits) - 1)), scale, min);
		__mmask16 good = _mm512_cmp_ps_mask(scale, zero, _CMP_GE_OQ) &
				 _mm512_cmp_ps_mask(scale, _mm512_set1_ps(__builtin_inff()),
						    _CMP_LT_OQ) &
				 _mm512_cmp_ps_mask(min, lowest, _CMP_GE_OQ) &
				 _mm512_cmp_ps_mask(top, largest, _CMP_LE_OQ);
		cp->clamp |= good != 0xffff;
	}
	if (bits > 2) {
		/* Code j: bits j*bits.. of the window, in bytes b and b+1
		 * (b + 1 <= 14 for bits <= 7; for 8 bits byte b alone), the
		 * dword's other bytes zero. */
		const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
						      2, 1, 0);
		__m512i at = _mm512_mullo_epi32(iota, _mm512_set1_epi32(bits));
		__m512i b = _mm512_srli_epi32(at, 3);
		__m512i next = _mm512_add_epi32(b, _mm512_set1_epi32(1));
		next = _mm512_mask_blend_epi32(
			_mm512_cmpge_epi32_mask(next, _mm512_set1_epi32(16)), next,
			_mm512_set1_epi32(0x80));
		cp->shuffle = _mm512_or_si512(_mm512_or_si512(b, _mm512_slli_epi32(next, 8)),
					      _mm512_set1_epi32((int)0x80800000u));
		cp->shifts = _mm512_and_si512(at, _mm512_set1_epi32(7));
		cp->code_mask = _mm512_set1_epi32((1 << bits) - 1);
	}
}

_Static_assert(sizeof(struct codes_plan) <= ATTEND_CACHE_BYTES, "the group cache holds a plan");
_Static_assert(offsetof(struct codes_plan, dim) + sizeof(size_t) <= ATTEND_CACHE_KEY_BYTES,
	       "zeroing the cache's key bytes forgets the plan");

/* The plan of this call: the cached tables if they are this group's
 * (same params bytes: a payload does not change during a call), else
 * built now and kept. */
static const struct codes_plan *codes_plan_get(void *at, const uint8_t *stream,
					       size_t bit_offset, size_t dim, int bits,
					       const uint8_t *scales, const uint8_t *mins,
					       bool cached)
{
	struct codes_plan *cp = at;
	if (!cached || cp->scales != scales || cp->mins != mins || cp->dim != dim ||
	    cp->bits != bits) {
		codes_plan_init(cp, stream, bit_offset, dim, bits, scales, mins);
		cp->scales = scales;
		cp->mins = mins;
		cp->dim = dim;
	}
	cp->rows = stream + bit_offset / 8;
	return cp;
}

/* The rows one chunk on: one hint per cache line of `bytes` from `at`
 * (prefetches never fault, so past the payload they cost only the hint). */
static ALWAYS_INLINE void prefetch_lines(const uint8_t *at, size_t bytes)
{
	for (size_t off = 0; off < bytes; off += 64)
		_mm_prefetch((const char *)at + off, _MM_HINT_T0);
}

/* The decoded values of one chunk held in registers across rows. */
struct chunk_regs {
	__m512 a, b, c, d; /* 1, 2 bits: lut[0..3]; else a = scale, b = min */
};

static ALWAYS_INLINE struct chunk_regs chunk_regs_load(const struct codes_plan *cp, size_t k,
						       const int B)
{
	struct chunk_regs r;
	if (B == 1) {
		r.a = cp->lut[0][k];
		r.b = cp->lut[1][k];
		r.c = r.d = r.a;
	} else if (B == 2) {
		r.a = cp->lut[0][k];
		r.b = cp->lut[1][k];
		r.c = cp->lut[2][k];
		r.d = cp->lut[3][k];
	} else {
		r.a = cp->scale[k];
		r.b = cp->min[k];
		r.c = r.d = r.a;
	}
	return r;
}

/*
 * Chunk k of the row at `row`: 16 fp32 values, exactly row_load16's.
 * B is 1, 2 (the tables) or 0 (any other width: unpack, then the
 * arithmetic of row_load16).
 */
static ALWAYS_INLINE __m512 codes_decode(const struct codes_plan *cp, const uint8_t *row,
					 size_t k, const struct chunk_regs *r, const int B,
					 const bool clamp)
{
	if (B == 1) {
		uint16_t m;
		memcpy(&m, row + 2 * k, sizeof m);
		return _mm512_mask_blend_ps((__mmask16)m, r->a, r->b);
	}
	if (B == 2) {
		const __m512i bit0 = _mm512_set_epi32(1 << 30, 1 << 28, 1 << 26, 1 << 24, 1 << 22,
						      1 << 20, 1 << 18, 1 << 16, 1 << 14, 1 << 12,
						      1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1);
		uint32_t word;
		memcpy(&word, row + 4 * k, sizeof word);
		__m512i codes = _mm512_set1_epi32((int)word);
		__mmask16 low = _mm512_test_epi32_mask(codes, bit0);
		__mmask16 high = _mm512_test_epi32_mask(codes, _mm512_add_epi32(bit0, bit0));
		__m512 even = _mm512_mask_blend_ps(low, r->a, r->b);
		__m512 odd = _mm512_mask_blend_ps(low, r->c, r->d);
		return _mm512_mask_blend_ps(high, even, odd);
	}
	__m512i window = _mm512_broadcast_i32x4(
		_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)cp->bits * k)));
	__m512i codes = _mm512_and_si512(
		_mm512_srlv_epi32(_mm512_shuffle_epi8(window, cp->shuffle), cp->shifts),
		cp->code_mask);
	__m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), r->a, r->b);
	if (clamp) {
		y = _mm512_max_ps(y, _mm512_set1_ps(-65504.0f));
		y = _mm512_min_ps(y, _mm512_set1_ps(65504.0f));
	}
	return _mm512_cvtph_ps(_mm512_cvtps_ph(y, ROUND_NEAREST));
}

/* score_tile over the plan: the same tiles, accumulators and fold. */
static ALWAYS_INLINE void fast_score_tile(const struct codes_plan *cp, size_t i0, size_t n_rows,
					  const float *q, size_t q_stride, float *s,
					  const uint8_t *pos, const int TR, const int QB,
					  const int B, const bool clamp)
{
	__m512 acc[16];
	const uint8_t *rows = cp->rows + i0 * cp->row_bytes;
	_Pragma("GCC unroll 16")
	for (int k = 0; k < 16; k++)
		acc[k] = _mm512_setzero_ps();
	prefetch_lines(rows + PREFETCH_ROWS * cp->row_bytes,
		       (n_rows < (size_t)TR ? n_rows : (size_t)TR) * cp->row_bytes);
	for (size_t k = 0; k < cp->chunks; k++) {
		struct chunk_regs regs = chunk_regs_load(cp, k, B);
		_Pragma("GCC unroll 16")
		for (int i = 0; i < TR; i++) {
			if ((size_t)i >= n_rows)
				break;
			__m512 y = codes_decode(cp, rows + (size_t)i * cp->row_bytes, k, &regs, B,
						clamp);
			_Pragma("GCC unroll 16")
			for (int r = 0; r < QB; r++)
				acc[i * QB + r] = _mm512_fmadd_ps(
					_mm512_load_ps(q + (size_t)r * q_stride + 16 * k), y,
					acc[i * QB + r]);
		}
	}
	float sums[16];
	_mm512_storeu_ps(sums, codec_fold16x16(acc));
	for (int i = 0; i < TR && (size_t)i < n_rows; i++)
		for (int r = 0; r < QB; r++)
			s[(size_t)r * ATTEND_CHUNK + pos[i0 + (size_t)i]] = sums[i * QB + r];
}

static ALWAYS_INLINE void fast_score_rows(const struct codes_plan *cp, size_t n_rows,
					  const float *q, size_t n_q, size_t q_stride, float *s,
					  const uint8_t *pos, const int QB, const int B,
					  const bool clamp)
{
	const int TR = 16 / QB;
	/* Whole tiles with TR a constant (no row checks), then the rest. */
	size_t whole = n_rows / (size_t)TR * (size_t)TR;
	for (size_t r0 = 0; r0 < n_q; r0 += (size_t)QB) {
		for (size_t i0 = 0; i0 < whole; i0 += (size_t)TR)
			fast_score_tile(cp, i0, (size_t)TR, q + r0 * q_stride, q_stride,
					s + r0 * ATTEND_CHUNK, pos, TR, QB, B, clamp);
		if (whole < n_rows)
			fast_score_tile(cp, whole, n_rows - whole, q + r0 * q_stride, q_stride,
					s + r0 * ATTEND_CHUNK, pos, TR, QB, B, clamp);
	}
}

static ALWAYS_INLINE void fast_score_any(const struct codes_plan *cp, size_t n_rows,
					 const float *q, size_t n_q, size_t q_stride, float *s,
					 const uint8_t *pos, const int B, const bool clamp)
{
	if (n_q % 16 == 0)
		fast_score_rows(cp, n_rows, q, n_q, q_stride, s, pos, 16, B, clamp);
	else if (n_q % 8 == 0)
		fast_score_rows(cp, n_rows, q, n_q, q_stride, s, pos, 8, B, clamp);
	else if (n_q % 4 == 0)
		fast_score_rows(cp, n_rows, q, n_q, q_stride, s, pos, 4, B, clamp);
	else if (n_q == 2)
		fast_score_rows(cp, n_rows, q, n_q, q_stride, s, pos, 2, B, clamp);
	else
		fast_score_rows(cp, n_rows, q, n_q, q_stride, s, pos, 1, B, clamp);
}

static void fast_score(const struct codes_plan *cp, size_t n_rows, const float *q, size_t n_q,
		       size_t q_stride, float *s, const uint8_t *pos)
{
	if (cp->bits == 1)
		fast_score_any(cp, n_rows, q, n_q, q_stride, s, pos, 1, false);
	else if (cp->bits == 2)
		fast_score_any(cp, n_rows, q, n_q, q_stride, s, pos, 2, false);
	else if (cp->clamp)
		fast_score_any(cp, n_rows, q, n_q, q_stride, s, pos, 0, true);
	else
		fast_score_any(cp, n_rows, q, n_q, q_stride, s, pos, 0, false);
}

/*
 * accumulate_block over the plan: NR query rows, KC consecutive chunks
 * from k, tokens in order. The chunks only multiply the independent FMA
 * chains (NR of them per chunk are too few to hide the FMA latency);
 * each (row, channel) still adds its tokens in increasing order.
 */
static ALWAYS_INLINE void fast_accumulate_block(const struct codes_plan *cp, size_t n_rows,
						size_t k, const struct chunk_regs *regs,
						const float *w, float *part, size_t part_stride,
						const int NR, const int KC, const int B,
						const bool clamp)
{
	__m512 a[4][8];
	_Pragma("GCC unroll 4")
	for (int j = 0; j < KC; j++)
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++)
			a[j][r] = _mm512_load_ps(part + (size_t)r * part_stride + 16 * (k + (size_t)j));
	for (size_t i = 0; i < n_rows; i++) {
		__m512 y[4];
		_Pragma("GCC unroll 4")
		for (int j = 0; j < KC; j++)
			y[j] = codes_decode(cp, cp->rows + i * cp->row_bytes, k + (size_t)j, &regs[j],
					    B, clamp);
		/* One broadcast weight for the KC chunks. */
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++) {
			__m512 weight = _mm512_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]);
			_Pragma("GCC unroll 4")
			for (int j = 0; j < KC; j++)
				a[j][r] = _mm512_fmadd_ps(weight, y[j], a[j][r]);
		}
	}
	_Pragma("GCC unroll 4")
	for (int j = 0; j < KC; j++)
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++)
			_mm512_store_ps(part + (size_t)r * part_stride + 16 * (k + (size_t)j), a[j][r]);
}

/* KC chunks from k, all the query rows, NR at a time. */
static ALWAYS_INLINE void fast_accumulate_chunks(const struct codes_plan *cp, size_t n_rows,
						 size_t k, const float *w, size_t n_p, float *part,
						 size_t part_stride, const int KC, const int B,
						 const bool clamp)
{
	struct chunk_regs regs[4];
	_Pragma("GCC unroll 4")
	for (int j = 0; j < KC; j++)
		regs[j] = chunk_regs_load(cp, k + (size_t)j, B);
	for (size_t r0 = 0; r0 < n_p; r0 += 8) {
		const float *wr = w + r0 * ATTEND_CHUNK;
		float *pr = part + r0 * part_stride;
#define FAST_ACC(NR) \
	fast_accumulate_block(cp, n_rows, k, regs, wr, pr, part_stride, NR, KC, B, clamp)
		switch (n_p - r0 < 8 ? n_p - r0 : 8) {
		case 1: FAST_ACC(1); break;
		case 2: FAST_ACC(2); break;
		case 3: FAST_ACC(3); break;
		case 4: FAST_ACC(4); break;
		case 5: FAST_ACC(5); break;
		case 6: FAST_ACC(6); break;
		case 7: FAST_ACC(7); break;
		default: FAST_ACC(8); break;
		}
#undef FAST_ACC
	}
}

static ALWAYS_INLINE void fast_accumulate_any(const struct codes_plan *cp, size_t n_rows,
					      const float *w, size_t n_p, float *part,
					      size_t part_stride, const int B, const bool clamp)
{
	size_t k = 0;
	prefetch_lines(cp->rows + PREFETCH_ROWS * cp->row_bytes, n_rows * cp->row_bytes);
	for (; k + 2 <= cp->chunks; k += 2)
		fast_accumulate_chunks(cp, n_rows, k, w, n_p, part, part_stride, 2, B, clamp);
	if (k < cp->chunks)
		fast_accumulate_chunks(cp, n_rows, k, w, n_p, part, part_stride, 1, B, clamp);
}

/*
 * 4-bit values with dim % 32 == 0, 32 channels (chunks 2v and 2v + 1)
 * per pass: 16 code bytes widen to 16 dwords whose low nibbles are the
 * even channels and high nibbles the odd ones (kernels_avx512.c's
 * nibble_rows), so one widening unpacks two chunks. The accumulators
 * hold the even and the odd channels (the partials are regrouped on
 * load and put back on store); every (row, channel) still adds its
 * tokens in order, one FMA each, from the same fp32 values.
 */
static ALWAYS_INLINE void nibble_accumulate_block(const struct codes_plan *cp, size_t n_rows,
						  size_t v, const __m512 *params, const float *w,
						  float *part, size_t part_stride, const int NR,
						  const bool clamp)
{
	const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
					      4, 2, 0);
	const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
	/* Lane c of chunk 2v (first) and 2v + 1 (second) from the even (c
	 * even) or the odd (c odd, index + 16) accumulator. */
	const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
					       16, 0);
	const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
	const __m512i low4 = _mm512_set1_epi32(15);
	__m512 a_even[8], a_odd[8];
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++) {
		const float *at = part + (size_t)r * part_stride + 32 * v;
		__m512 lo = _mm512_load_ps(at), hi = _mm512_load_ps(at + 16);
		a_even[r] = _mm512_permutex2var_ps(lo, even, hi);
		a_odd[r] = _mm512_permutex2var_ps(lo, odd, hi);
	}
	for (size_t i = 0; i < n_rows; i++) {
		__m512i pairs = _mm512_cvtepu8_epi32(
			_mm_loadu_si128((const __m128i *)(cp->rows + i * cp->row_bytes + 16 * v)));
		__m512 y_even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(pairs, low4)),
						params[0], params[2]);
		__m512 y_odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 4)),
					       params[1], params[3]);
		if (clamp) {
			const __m512 lowest = _mm512_set1_ps(-65504.0f);
			const __m512 highest = _mm512_set1_ps(65504.0f);
			y_even = _mm512_min_ps(_mm512_max_ps(y_even, lowest), highest);
			y_odd = _mm512_min_ps(_mm512_max_ps(y_odd, lowest), highest);
		}
		y_even = _mm512_cvtph_ps(_mm512_cvtps_ph(y_even, ROUND_NEAREST));
		y_odd = _mm512_cvtph_ps(_mm512_cvtps_ph(y_odd, ROUND_NEAREST));
		_Pragma("GCC unroll 8")
		for (int r = 0; r < NR; r++) {
			__m512 weight = _mm512_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]);
			a_even[r] = _mm512_fmadd_ps(weight, y_even, a_even[r]);
			a_odd[r] = _mm512_fmadd_ps(weight, y_odd, a_odd[r]);
		}
	}
	_Pragma("GCC unroll 8")
	for (int r = 0; r < NR; r++) {
		float *at = part + (size_t)r * part_stride + 32 * v;
		_mm512_store_ps(at, _mm512_permutex2var_ps(a_even[r], first, a_odd[r]));
		_mm512_store_ps(at + 16, _mm512_permutex2var_ps(a_even[r], second, a_odd[r]));
	}
}

static ALWAYS_INLINE void nibble_accumulate_any(const struct codes_plan *cp, size_t n_rows,
						const float *w, size_t n_p, float *part,
						size_t part_stride, const bool clamp)
{
	const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
					      4, 2, 0);
	const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
	prefetch_lines(cp->rows + PREFETCH_ROWS * cp->row_bytes, n_rows * cp->row_bytes);
	for (size_t v = 0; v < cp->chunks / 2; v++) {
		/* scale even, scale odd, min even, min odd */
		__m512 params[4] = {
			_mm512_permutex2var_ps(cp->scale[2 * v], even, cp->scale[2 * v + 1]),
			_mm512_permutex2var_ps(cp->scale[2 * v], odd, cp->scale[2 * v + 1]),
			_mm512_permutex2var_ps(cp->min[2 * v], even, cp->min[2 * v + 1]),
			_mm512_permutex2var_ps(cp->min[2 * v], odd, cp->min[2 * v + 1]),
		};
		for (size_t r0 = 0; r0 < n_p; r0 += 8) {
			const float *wr = w + r0 * ATTEND_CHUNK;
			float *pr = part + r0 * part_stride;
#define NIBBLE_ACC(NR) \
	nibble_accumulate_block(cp, n_rows, v, params, wr, pr, part_stride, NR, clamp)
			switch (n_p - r0 < 8 ? n_p - r0 : 8) {
			case 1: NIBBLE_ACC(1); break;
			case 2: NIBBLE_ACC(2); break;
			case 3: NIBBLE_ACC(3); break;
			case 4: NIBBLE_ACC(4); break;
			case 5: NIBBLE_ACC(5); break;
			case 6: NIBBLE_ACC(6); break;
			case 7: NIBBLE_ACC(7); break;
			default: NIBBLE_ACC(8); break;
			}
#undef NIBBLE_ACC
		}
	}
}

static void fast_accumulate(const struct codes_plan *cp, size_t n_rows, const float *w,
			    size_t n_p, float *part, size_t part_stride)
{
	if (cp->bits == 4 && cp->row_bytes % 16 == 0) {
		if (cp->clamp)
			nibble_accumulate_any(cp, n_rows, w, n_p, part, part_stride, true);
		else
			nibble_accumulate_any(cp, n_rows, w, n_p, part, part_stride, false);
	} else if (cp->bits == 1)
		fast_accumulate_any(cp, n_rows, w, n_p, part, part_stride, 1, false);
	else if (cp->bits == 2)
		fast_accumulate_any(cp, n_rows, w, n_p, part, part_stride, 2, false);
	else if (cp->clamp)
		fast_accumulate_any(cp, n_rows, w, n_p, part, part_stride, 0, true);
	else
		fast_accumulate_any(cp, n_rows, w, n_p, part, part_stride, 0, false);
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
			       size_t n_q, size_t q_stride, float *s, const uint8_t *pos, void *cache)
{
	if (fast_codes(stream, read_end, bit_offset, n_rows, dim, bits)) {
		struct codes_plan local;
		const struct codes_plan *cp = codes_plan_get(cache ? cache : &local, stream,
							     bit_offset, dim, bits, scales, mins,
							     cache != NULL);
		fast_score(cp, n_rows, q, n_q, q_stride, s, pos);
		return;
	}
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
				    size_t n_p, float *part, size_t part_stride, void *cache)
{
	if (fast_codes(stream, read_end, bit_offset, n_rows, dim, bits)) {
		struct codes_plan local;
		const struct codes_plan *cp = codes_plan_get(cache ? cache : &local, stream,
							     bit_offset, dim, bits, scales, mins,
							     cache != NULL);
		fast_accumulate(cp, n_rows, p, n_p, part, part_stride);
		return;
	}
	struct rows_src src = codes_src(stream, read_end, bit_offset, n_rows, dim, bits, scales,
					mins);
	accumulate_any(&src, true, n_rows, dim, p, n_p, part, part_stride);
}

/* attend_exp2 on 16 lanes: the same operations (no FMA), so the same bits. */
static ALWAYS_INLINE __m512 exp2_16(__m512 x)
{
	const __m512 shifter = _mm512_set1_ps(12582912.0f);
	/* x >= -126 ? x : -127, NaN included (the compare is false). */
	x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ),
				 _mm512_set1_ps(-127.0f), x);
	__m512 f = _mm512_sub_ps(_mm512_add_ps(x, shifter), shifter);
	__m512 r = _mm512_sub_ps(x, f);
	__m512 poly = _mm512_set1_ps(1.525273380405984e-05f);
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.540353039338161e-04f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.333355814642844e-03f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(9.618129107628477e-03f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(5.550410866482158e-02f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(2.402265069591007e-01f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(6.931471805599453e-01f));
	poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f));
	/* f is a whole number: truncation is the C cast's conversion. */
	__m512i bits = _mm512_slli_epi32(
		_mm512_add_epi32(_mm512_cvttps_epi32(f), _mm512_set1_epi32(127)), 23);
	return _mm512_mul_ps(poly, _mm512_castsi512_ps(bits));
}

/*
 * attend_softmax_step with the chunk's four vectors of positions (lane
 * j: t = j mod 16, t increasing down the vectors): MAXPS(row, lanes) is
 * `row > lanes ? row : lanes`, the sums add the vectors in order from
 * +0, and the steps across lanes are attend_softmax.h's own code.
 */
static void avx512_softmax(float *s, size_t n_rows, float *m, float *l, float *alpha)
{
	_Static_assert(ATTEND_CHUNK == 64, "four vectors per chunk");
	for (size_t r = 0; r < n_rows; r++) {
		float *row = s + r * ATTEND_CHUNK;
		__m512 v[4];
		float lanes[16];
		_Pragma("GCC unroll 4")
		for (int k = 0; k < 4; k++)
			v[k] = _mm512_loadu_ps(row + 16 * k);
		__m512 top16 = _mm512_set1_ps(-__builtin_inff());
		_Pragma("GCC unroll 4")
		for (int k = 0; k < 4; k++)
			top16 = _mm512_max_ps(v[k], top16);
		_mm512_storeu_ps(lanes, top16);
		float top = m[r];
		for (int j = 0; j < 16; j++)
			top = lanes[j] > top ? lanes[j] : top;
		if (top == -__builtin_inff()) {
			alpha[r] = 1.0f;
			memset(row, 0, ATTEND_CHUNK * sizeof *row);
			continue;
		}
		alpha[r] = attend_exp2(m[r] - top);
		__m512 sum = _mm512_setzero_ps();
		_Pragma("GCC unroll 4")
		for (int k = 0; k < 4; k++) {
			__m512 p = exp2_16(_mm512_sub_ps(v[k], _mm512_set1_ps(top)));
			_mm512_storeu_ps(row + 16 * k, p);
			sum = _mm512_add_ps(sum, p);
		}
		_mm512_storeu_ps(lanes, sum);
		l[r] = l[r] * alpha[r] + codec_fold_lanes(lanes);
		m[r] = top;
	}
}

/* attend_combine_rows: mul, then add (stride is a multiple of 16). */
static void avx512_combine(float *acc, float *part, size_t n_rows, size_t stride,
			   const float *alpha)
{
	for (size_t r = 0; r < n_rows; r++) {
		__m512 a = _mm512_set1_ps(alpha[r]);
		float *out = acc + r * stride, *in = part + r * stride;
		for (size_t c = 0; c < stride; c += 16) {
			_mm512_store_ps(out + c, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(out + c), a),
							       _mm512_load_ps(in + c)));
			_mm512_store_ps(in + c, _mm512_setzero_ps());
		}
	}
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
