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
#include <stddef.h>
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

/* ---- codes whose rows start on whole bytes: per-call tables ------------- */

/*
 * attend_avx512.c's fast codes path on 8 channels per vector: for
 * dim % 8 == 0 (every row, and every 8 channels of it, starts on a whole
 * byte: chunk k of a row is the `bits` bytes at row + bits*k) and
 * dim <= FAST_MAX_DIM, when every load stays before read_end. Per call:
 * the 2 or 4 values of 1- and 2-bit codes, selected by blends whose sign
 * masks are the code bits shifted up; for 3..8 bits scale and min, the
 * clamp decision, and a shuffle that unpacks 8 codes from a 16-byte
 * window. The same fp32 values as row_load8, so the same bits.
 */
#define FAST_MAX_DIM 256u
#define FAST_CHUNKS (FAST_MAX_DIM / 8)

struct codes_plan {
	/* The group the tables are for (attend_kernels.h's group cache):
	 * zeroed, it matches none. */
	const uint8_t *scales, *mins;
	size_t dim;
	const uint8_t *rows;   /* row 0's first byte (set every call) */
	size_t row_bytes;      /* dim * bits / 8 */
	size_t chunks;         /* 8-channel chunks: dim / 8 */
	int bits;
	bool clamp;            /* bits > 2: the clamp can change something */
	__m256i shuffle, shifts, code_mask;
	__m256 scale[FAST_CHUNKS], min[FAST_CHUNKS];
	__m256 lut[4][FAST_CHUNKS];
};

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
	const __m256 largest = _mm256_set1_ps(65504.0f);
	const __m256 lowest = _mm256_set1_ps(-65504.0f);
	const __m256 zero = _mm256_setzero_ps();

	cp->rows = stream + bit_offset / 8;
	cp->row_bytes = dim * (size_t)bits / 8;
	cp->chunks = dim / 8;
	cp->bits = bits;
	cp->clamp = false;
	for (size_t at = 0; at < 2 * dim; at += 64) {
		_mm_prefetch((const char *)scales + 8 * dim + at, _MM_HINT_T0);
		_mm_prefetch((const char *)mins + 8 * dim + at, _MM_HINT_T0);
	}
	for (size_t k = 0; k < cp->chunks; k++) {
		__m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * k)));
		__m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + 16 * k)));
		if (bits <= 2) {
			for (int v = 0; v < (1 << bits); v++) {
				__m256 y = _mm256_fmadd_ps(_mm256_set1_ps((float)v), scale, min);
				y = _mm256_min_ps(_mm256_max_ps(y, lowest), largest);
				cp->lut[v][k] = _mm256_cvtph_ps(_mm256_cvtps_ph(y, ROUND_NEAREST));
			}
			continue;
		}
		cp->scale[k] = scale;
		cp->min[k] = min;
		__m256 top = _mm256_fmadd_ps(_mm256_set1_ps((float)((1 << bits) - 1)), scale, min);
		__m256 good = _mm256_and_ps(
			_mm256_and_ps(_mm256_cmp_ps(scale, zero, _CMP_GE_OQ),
				      _mm256_cmp_ps(scale, _mm256_set1_ps(__builtin_inff()),
						    _CMP_LT_OQ)),
			_mm256_and_ps(_mm256_cmp_ps(min, lowest, _CMP_GE_OQ),
				      _mm256_cmp_ps(top, largest, _CMP_LE_OQ)));
		cp->clamp |= _mm256_movemask_ps(good) != 0xff;
	}
	if (bits > 2) {
		/* Code j: bits j*bits.. of the window, in bytes b and b+1 <= 7,
		 * the dword's other bytes zero. */
		const __m256i iota = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
		__m256i at = _mm256_mullo_epi32(iota, _mm256_set1_epi32(bits));
		__m256i byte = _mm256_srli_epi32(at, 3);
		__m256i next = _mm256_add_epi32(byte, _mm256_set1_epi32(1));
		cp->shuffle = _mm256_or_si256(_mm256_or_si256(byte, _mm256_slli_epi32(next, 8)),
					      _mm256_set1_epi32((int)0x80800000u));
		cp->shifts = _mm256_and_si256(at, _mm256_set1_epi32(7));
		cp->code_mask = _mm256_set1_epi32((1 << bits) - 1);
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

/* The rows one chunk on: one hint per cache line of `bytes` from `at`. */
static ALWAYS_INLINE void prefetch_lines(const uint8_t *at, size_t bytes)
{
	for (size_t off = 0; off < bytes; off += 64)
		_mm_prefetch((const char *)at + off, _MM_HINT_T0);
}

struct chunk_regs {
	__m256 a, b, c, d; /* 1, 2 bits: lut[0..3]; else a = scale, b = min */
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

/* Chunk k (8 channels) of the row at `row`, exactly row_load8's values. */
static ALWAYS_INLINE __m256 codes_decode(const struct codes_plan *cp, const uint8_t *row,
					 size_t k, const struct chunk_regs *r, const int B,
					 const bool clamp)
{
	if (B == 1) {
		/* Code j's bit to the sign: vblendvps selects by it. */
		const __m256i up = _mm256_set_epi32(24, 25, 26, 27, 28, 29, 30, 31);
		__m256i codes = _mm256_set1_epi32(row[k]);
		return _mm256_blendv_ps(r->a, r->b, _mm256_castsi256_ps(_mm256_sllv_epi32(codes, up)));
	}
	if (B == 2) {
		const __m256i up0 = _mm256_set_epi32(17, 19, 21, 23, 25, 27, 29, 31);
		const __m256i up1 = _mm256_set_epi32(16, 18, 20, 22, 24, 26, 28, 30);
		uint16_t word;
		memcpy(&word, row + 2 * k, sizeof word);
		__m256i codes = _mm256_set1_epi32(word);
		__m256 low = _mm256_castsi256_ps(_mm256_sllv_epi32(codes, up0));
		__m256 high = _mm256_castsi256_ps(_mm256_sllv_epi32(codes, up1));
		__m256 even = _mm256_blendv_ps(r->a, r->b, low);
		__m256 odd = _mm256_blendv_ps(r->c, r->d, low);
		return _mm256_blendv_ps(even, odd, high);
	}
	__m256i window = _mm256_broadcastsi128_si256(
		_mm_loadu_si128((const __m128i *)(row + (size_t)cp->bits * k)));
	__m256i codes = _mm256_and_si256(
		_mm256_srlv_epi32(_mm256_shuffle_epi8(window, cp->shuffle), cp->shifts),
		cp->code_mask);
	__m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), r->a, r->b);
	if (clamp) {
		y = _mm256_max_ps(y, _mm256_set1_ps(-65504.0f));
		y = _mm256_min_ps(y, _mm256_set1_ps(65504.0f));
	}
	return _mm256_cvtph_ps(_mm256_cvtps_ph(y, ROUND_NEAREST));
}

/* score_tile over the plan: lanes 0-7 from even chunks, 8-15 from odd. */
static ALWAYS_INLINE void fast_score_tile(const struct codes_plan *cp, size_t i0, size_t n_rows,
					  const float *q, size_t q_stride, float *s,
					  const uint8_t *pos, const int TR, const int QB,
					  const int B, const bool clamp)
{
	__m256 low[4], high[4];
	const uint8_t *rows = cp->rows + i0 * cp->row_bytes;
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++)
		low[k] = high[k] = _mm256_setzero_ps();
	prefetch_lines(rows + PREFETCH_ROWS * cp->row_bytes,
		       (n_rows < (size_t)TR ? n_rows : (size_t)TR) * cp->row_bytes);
	/* Chunk k feeds lanes 0-7, chunk k + 1 lanes 8-15: one chunk's
	 * tables at a time, so that they and the accumulators fit the 16
	 * registers. */
	for (size_t k = 0; k < cp->chunks; k += 2) {
		struct chunk_regs regs = chunk_regs_load(cp, k, B);
		_Pragma("GCC unroll 4")
		for (int i = 0; i < TR; i++) {
			if ((size_t)i >= n_rows)
				break;
			__m256 y = codes_decode(cp, rows + (size_t)i * cp->row_bytes, k, &regs, B,
						clamp);
			_Pragma("GCC unroll 4")
			for (int r = 0; r < QB; r++)
				low[i * QB + r] = _mm256_fmadd_ps(
					_mm256_load_ps(q + (size_t)r * q_stride + 8 * k), y,
					low[i * QB + r]);
		}
		if (k + 1 == cp->chunks)
			break;
		regs = chunk_regs_load(cp, k + 1, B);
		_Pragma("GCC unroll 4")
		for (int i = 0; i < TR; i++) {
			if ((size_t)i >= n_rows)
				break;
			__m256 y = codes_decode(cp, rows + (size_t)i * cp->row_bytes, k + 1, &regs, B,
						clamp);
			_Pragma("GCC unroll 4")
			for (int r = 0; r < QB; r++)
				high[i * QB + r] = _mm256_fmadd_ps(
					_mm256_load_ps(q + (size_t)r * q_stride + 8 * k + 8), y,
					high[i * QB + r]);
		}
	}
	for (int i = 0; i < TR && (size_t)i < n_rows; i++)
		for (int r = 0; r < QB; r++)
			s[(size_t)r * ATTEND_CHUNK + pos[i0 + (size_t)i]] =
				fold(low[i * QB + r], high[i * QB + r]);
}

static ALWAYS_INLINE void fast_score_rows(const struct codes_plan *cp, size_t n_rows,
					  const float *q, size_t n_q, size_t q_stride, float *s,
					  const uint8_t *pos, const int QB, const int B,
					  const bool clamp)
{
	const int TR = 4 / QB;
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
	if (n_q % 4 == 0)
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

/* accumulate_block over the plan: NR query rows, KC chunks from k,
 * tokens in increasing order for every (row, channel). */
static ALWAYS_INLINE void fast_accumulate_block(const struct codes_plan *cp, size_t n_rows,
						size_t k, const struct chunk_regs *regs,
						const float *w, float *part, size_t part_stride,
						const int NR, const int KC, const int B,
						const bool clamp)
{
	__m256 a[2][4];
	_Pragma("GCC unroll 2")
	for (int j = 0; j < KC; j++)
		_Pragma("GCC unroll 4")
		for (int r = 0; r < NR; r++)
			a[j][r] = _mm256_load_ps(part + (size_t)r * part_stride + 8 * (k + (size_t)j));
	for (size_t i = 0; i < n_rows; i++) {
		__m256 y[2];
		_Pragma("GCC unroll 2")
		for (int j = 0; j < KC; j++)
			y[j] = codes_decode(cp, cp->rows + i * cp->row_bytes, k + (size_t)j, &regs[j],
					    B, clamp);
		/* One broadcast weight for the KC chunks. */
		_Pragma("GCC unroll 4")
		for (int r = 0; r < NR; r++) {
			__m256 weight = _mm256_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]);
			_Pragma("GCC unroll 2")
			for (int j = 0; j < KC; j++)
				a[j][r] = _mm256_fmadd_ps(weight, y[j], a[j][r]);
		}
	}
	_Pragma("GCC unroll 2")
	for (int j = 0; j < KC; j++)
		_Pragma("GCC unroll 4")
		for (int r = 0; r < NR; r++)
			_mm256_store_ps(part + (size_t)r * part_stride + 8 * (k + (size_t)j), a[j][r]);
}

static ALWAYS_INLINE void fast_accumulate_chunks(const struct codes_plan *cp, size_t n_rows,
						 size_t k, const float *w, size_t n_p, float *part,
						 size_t part_stride, const int KC, const int B,
						 const bool clamp)
{
	struct chunk_regs regs[2];
	_Pragma("GCC unroll 2")
	for (int j = 0; j < KC; j++)
		regs[j] = chunk_regs_load(cp, k + (size_t)j, B);
	for (size_t r0 = 0; r0 < n_p; r0 += 4) {
		const float *wr = w + r0 * ATTEND_CHUNK;
		float *pr = part + r0 * part_stride;
#define FAST_ACC(NR) \
	fast_accumulate_block(cp, n_rows, k, regs, wr, pr, part_stride, NR, KC, B, clamp)
		switch (n_p - r0 < 4 ? n_p - r0 : 4) {
		case 1: FAST_ACC(1); break;
		case 2: FAST_ACC(2); break;
		case 3: FAST_ACC(3); break;
		default: FAST_ACC(4); break;
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

/* Channels 0, 2, .., 14 (even) or 1, 3, .., 15 (odd) of the 16 in lo
 * (channels 0-7) and hi (8-15). */
static ALWAYS_INLINE __m256 even_channels(__m256 lo, __m256 hi)
{
	__m256 mixed = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)); /* 0 2 8 10 | 4 6 12 14 */
	return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(mixed),
						       _MM_SHUFFLE(3, 1, 2, 0)));
}

static ALWAYS_INLINE __m256 odd_channels(__m256 lo, __m256 hi)
{
	__m256 mixed = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
	return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(mixed),
						       _MM_SHUFFLE(3, 1, 2, 0)));
}

/*
 * attend_avx512.c's nibble_accumulate_block on 8 lanes: 4-bit values
 * with dim % 16 == 0, 16 channels (chunks 2v and 2v + 1) from 8 code
 * bytes widened once, low nibbles the even channels, high the odd.
 */
static ALWAYS_INLINE void nibble_accumulate_block(const struct codes_plan *cp, size_t n_rows,
						  size_t v, const __m256 *params, const float *w,
						  float *part, size_t part_stride, const int NR,
						  const bool clamp)
{
	const __m256i low4 = _mm256_set1_epi32(15);
	__m256 a_even[4], a_odd[4];
	_Pragma("GCC unroll 4")
	for (int r = 0; r < NR; r++) {
		const float *at = part + (size_t)r * part_stride + 16 * v;
		__m256 lo = _mm256_load_ps(at), hi = _mm256_load_ps(at + 8);
		a_even[r] = even_channels(lo, hi);
		a_odd[r] = odd_channels(lo, hi);
	}
	for (size_t i = 0; i < n_rows; i++) {
		__m256i pairs = _mm256_cvtepu8_epi32(
			_mm_loadl_epi64((const __m128i *)(cp->rows + i * cp->row_bytes + 8 * v)));
		__m256 y_even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(pairs, low4)),
						params[0], params[2]);
		__m256 y_odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(pairs, 4)),
					       params[1], params[3]);
		if (clamp) {
			const __m256 lowest = _mm256_set1_ps(-65504.0f);
			const __m256 highest = _mm256_set1_ps(65504.0f);
			y_even = _mm256_min_ps(_mm256_max_ps(y_even, lowest), highest);
			y_odd = _mm256_min_ps(_mm256_max_ps(y_odd, lowest), highest);
		}
		y_even = _mm256_cvtph_ps(_mm256_cvtps_ph(y_even, ROUND_NEAREST));
		y_odd = _mm256_cvtph_ps(_mm256_cvtps_ph(y_odd, ROUND_NEAREST));
		_Pragma("GCC unroll 4")
		for (int r = 0; r < NR; r++) {
			__m256 weight = _mm256_set1_ps(w[(size_t)r * ATTEND_CHUNK + i]);
			a_even[r] = _mm256_fmadd_ps(weight, y_even, a_even[r]);
			a_odd[r] = _mm256_fmadd_ps(weight, y_odd, a_odd[r]);
		}
	}
	_Pragma("GCC unroll 4")
	for (int r = 0; r < NR; r++) {
		float *at = part + (size_t)r * part_stride + 16 * v;
		/* Per 128-bit half: channels 0-3 | 8-11 and 4-7 | 12-15. */
		__m256 lo = _mm256_unpacklo_ps(a_even[r], a_odd[r]);
		__m256 hi = _mm256_unpackhi_ps(a_even[r], a_odd[r]);
		_mm256_store_ps(at, _mm256_permute2f128_ps(lo, hi, 0x20));
		_mm256_store_ps(at + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
	}
}

static ALWAYS_INLINE void nibble_accumulate_any(const struct codes_plan *cp, size_t n_rows,
						const float *w, size_t n_p, float *part,
						size_t part_stride, const bool clamp)
{
	prefetch_lines(cp->rows + PREFETCH_ROWS * cp->row_bytes, n_rows * cp->row_bytes);
	for (size_t v = 0; v < cp->chunks / 2; v++) {
		/* scale even, scale odd, min even, min odd */
		__m256 params[4] = {
			even_channels(cp->scale[2 * v], cp->scale[2 * v + 1]),
			odd_channels(cp->scale[2 * v], cp->scale[2 * v + 1]),
			even_channels(cp->min[2 * v], cp->min[2 * v + 1]),
			odd_channels(cp->min[2 * v], cp->min[2 * v + 1]),
		};
		for (size_t r0 = 0; r0 < n_p; r0 += 4) {
			const float *wr = w + r0 * ATTEND_CHUNK;
			float *pr = part + r0 * part_stride;
#define NIBBLE_ACC(NR) \
	nibble_accumulate_block(cp, n_rows, v, params, wr, pr, part_stride, NR, clamp)
			switch (n_p - r0 < 4 ? n_p - r0 : 4) {
			case 1: NIBBLE_ACC(1); break;
			case 2: NIBBLE_ACC(2); break;
			case 3: NIBBLE_ACC(3); break;
			default: NIBBLE_ACC(4); break;
			}
#undef NIBBLE_ACC
		}
	}
}

static void fast_accumulate(const struct codes_plan *cp, size_t n_rows, const float *w,
			    size_t n_p, float *part, size_t part_stride)
{
	if (cp->bits == 4 && cp->row_bytes % 8 == 0) {
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

/* attend_exp2 on 8 lanes: the same operations (no FMA), so the same bits. */
static ALWAYS_INLINE __m256 exp2_8(__m256 x)
{
	const __m256 shifter = _mm256_set1_ps(12582912.0f);
	x = _mm256_blendv_ps(_mm256_set1_ps(-127.0f), x,
			     _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ));
	__m256 f = _mm256_sub_ps(_mm256_add_ps(x, shifter), shifter);
	__m256 r = _mm256_sub_ps(x, f);
	__m256 poly = _mm256_set1_ps(1.525273380405984e-05f);
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(1.540353039338161e-04f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(1.333355814642844e-03f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(9.618129107628477e-03f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(5.550410866482158e-02f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(2.402265069591007e-01f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(6.931471805599453e-01f));
	poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(1.0f));
	__m256i bits = _mm256_slli_epi32(
		_mm256_add_epi32(_mm256_cvttps_epi32(f), _mm256_set1_epi32(127)), 23);
	return _mm256_mul_ps(poly, _mm256_castsi256_ps(bits));
}

/* attend_avx512.c's softmax step on two vectors per 16 lanes (v[2u]:
 * lanes 0-7 of positions 16u.., v[2u+1]: lanes 8-15). */
static void avx2_softmax(float *s, size_t n_rows, float *m, float *l, float *alpha)
{
	_Static_assert(ATTEND_CHUNK == 64, "eight vectors per chunk");
	for (size_t r = 0; r < n_rows; r++) {
		float *row = s + r * ATTEND_CHUNK;
		__m256 v[8];
		float lanes[16];
		_Pragma("GCC unroll 8")
		for (int k = 0; k < 8; k++)
			v[k] = _mm256_loadu_ps(row + 8 * k);
		__m256 top_lo = _mm256_set1_ps(-__builtin_inff()), top_hi = top_lo;
		_Pragma("GCC unroll 4")
		for (int u = 0; u < 4; u++) {
			top_lo = _mm256_max_ps(v[2 * u], top_lo);
			top_hi = _mm256_max_ps(v[2 * u + 1], top_hi);
		}
		_mm256_storeu_ps(lanes, top_lo);
		_mm256_storeu_ps(lanes + 8, top_hi);
		float top = m[r];
		for (int j = 0; j < 16; j++)
			top = lanes[j] > top ? lanes[j] : top;
		if (top == -__builtin_inff()) {
			alpha[r] = 1.0f;
			memset(row, 0, ATTEND_CHUNK * sizeof *row);
			continue;
		}
		alpha[r] = attend_exp2(m[r] - top);
		__m256 sum_lo = _mm256_setzero_ps(), sum_hi = sum_lo;
		_Pragma("GCC unroll 4")
		for (int u = 0; u < 4; u++) {
			__m256 p_lo = exp2_8(_mm256_sub_ps(v[2 * u], _mm256_set1_ps(top)));
			__m256 p_hi = exp2_8(_mm256_sub_ps(v[2 * u + 1], _mm256_set1_ps(top)));
			_mm256_storeu_ps(row + 16 * u, p_lo);
			_mm256_storeu_ps(row + 16 * u + 8, p_hi);
			sum_lo = _mm256_add_ps(sum_lo, p_lo);
			sum_hi = _mm256_add_ps(sum_hi, p_hi);
		}
		_mm256_storeu_ps(lanes, sum_lo);
		_mm256_storeu_ps(lanes + 8, sum_hi);
		l[r] = l[r] * alpha[r] + codec_fold_lanes(lanes);
		m[r] = top;
	}
}

/* attend_combine_rows: mul, then add (stride is a multiple of 16). */
static void avx2_combine(float *acc, float *part, size_t n_rows, size_t stride,
			 const float *alpha)
{
	for (size_t r = 0; r < n_rows; r++) {
		__m256 a = _mm256_set1_ps(alpha[r]);
		float *out = acc + r * stride, *in = part + r * stride;
		for (size_t c = 0; c < stride; c += 8) {
			_mm256_store_ps(out + c, _mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(out + c), a),
							       _mm256_load_ps(in + c)));
			_mm256_store_ps(in + c, _mm256_setzero_ps());
		}
	}
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
			     float *s, const uint8_t *pos, void *cache)
{
	if (fast_codes(stream, read_end, bit_offset, n_rows, dim, bits)) {
		struct codes_plan local;
		const struct codes_plan *cp = codes_plan_get(cache ? cache : &local, stream,
							     bit_offset, dim, bits, scales, mins,
							     cache != NULL);
		fast_score(cp, n_rows, q, n_q, q_stride, s, pos);
		return;
	}
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
	struct rows_src src = codes_src(stream, read_end, bit_offset, dim, bits, scales, mins);
	accumulate_any(&src, true, n_rows, dim, p, n_p, part, part_stride);
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
