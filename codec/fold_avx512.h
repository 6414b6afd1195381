/*
 * The 16-lane fold of docs/CODEC.md (codec_fold_lanes in kernels.h) for
 * sixteen sums at once, shared by the AVX-512 tables that fold (the
 * codec's row norms, attention's dot products). Include only from files
 * built with AVX-512 enabled.
 */
#ifndef ZIPCACHE_FOLD_AVX512_H
#define ZIPCACHE_FOLD_AVX512_H

#include <immintrin.h>

/*
 * The fold of docs/CODEC.md for sixteen rows at once: every add pairs
 * the same lanes as codec_fold_lanes (j+8, j+4, j+2, j+1), only several
 * rows share one instruction. Returns the sixteen sums in row order.
 */
static inline __attribute__((always_inline)) __m512 codec_fold16x16(const __m512 lanes[16])
{
	__m512 eight[8], four[4], two[2];
	/* eight[k] = [row 2k lanes 0..7 | row 2k+1 lanes 0..7], j += j+8 */
	_Pragma("GCC unroll 8")
	for (int k = 0; k < 8; k++) {
		__m512 a = lanes[2 * k], b = lanes[2 * k + 1];
		eight[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
					 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
	}
	/* four[m] = rows 4m..4m+3, lanes 0..3 each, j += j+4 */
	_Pragma("GCC unroll 4")
	for (int m = 0; m < 4; m++) {
		__m512 a = eight[2 * m], b = eight[2 * m + 1];
		four[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
					_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
	}
	/* two[n], 128-bit block k: rows 8n+k and 8n+4+k, lanes 0..1, j += j+2 */
	_Pragma("GCC unroll 2")
	for (int n = 0; n < 2; n++) {
		__m512 a = four[2 * n], b = four[2 * n + 1];
		two[n] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
				       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
	}
	/* Element 4k + i: row 4i + k, j += j+1. */
	__m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(2, 0, 2, 0)),
				   _mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(3, 1, 3, 1)));
	const __m512i rows = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4,
					      0);
	return _mm512_permutexvar_ps(rows, one);
}

#endif
