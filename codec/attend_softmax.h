/*
 * The online-softmax step and the chunk combine of docs/ATTEND.md, one
 * definition in plain C that every attention table includes and compiles
 * with its own flags. Only elementwise IEEE operations (add, mul,
 * compare, select, exact conversions; no FMA: -ffp-contract=off and no
 * fmaf here), and the only reductions are spelled over 16 fixed lanes,
 * so however a compiler vectorizes this the bits are the same.
 */
#ifndef ZIPCACHE_ATTEND_SOFTMAX_H
#define ZIPCACHE_ATTEND_SOFTMAX_H

#include <stdint.h>
#include <string.h>

#include "attend_kernels.h"
#include "kernels.h"

/*
 * 2^x for x <= 0: x = f + r with f = rint(x) (by the 1.5 * 2^23 trick,
 * exact for |x| < 2^22) and r in [-1/2, 1/2]; 2^r by the degree-7 Taylor
 * polynomial of e^(r ln 2) (truncation below 6e-9), times 2^f built from
 * its exponent bits. Below -126 (and -Inf, and NaN) it is 0: a weight
 * under 2^-126 of the largest cannot matter in fp32.
 */
static inline float attend_exp2(float x)
{
	x = x >= -126.0f ? x : -127.0f;
	float f = (x + 12582912.0f) - 12582912.0f;
	float r = x - f;
	float poly = 1.525273380405984e-05f;
	poly = poly * r + 1.540353039338161e-04f;
	poly = poly * r + 1.333355814642844e-03f;
	poly = poly * r + 9.618129107628477e-03f;
	poly = poly * r + 5.550410866482158e-02f;
	poly = poly * r + 2.402265069591007e-01f;
	poly = poly * r + 6.931471805599453e-01f;
	poly = poly * r + 1.0f;
	uint32_t bits = (uint32_t)((int32_t)f + 127) << 23;
	float two_f;
	memcpy(&two_f, &bits, sizeof two_f);
	return poly * two_f;
}

/*
 * One chunk of scores s[r*ATTEND_CHUNK + t] (masked positions -Inf) for
 * n_rows query rows: m (running max, log2 units), l (running sum) and
 * alpha (the factor the accumulator must take) per row; s becomes the
 * weights 2^(s - m). The chunk's max and sum run over 16 lanes (lane j:
 * positions t = j mod 16, t increasing), folded as codec_fold_lanes.
 */
static inline void attend_softmax_step(float *s, size_t n_rows, float *m, float *l,
				       float *alpha)
{
	for (size_t r = 0; r < n_rows; r++) {
		float *row = s + r * ATTEND_CHUNK;
		float lanes[16];
		for (int j = 0; j < 16; j++)
			lanes[j] = -__builtin_inff();
		for (unsigned t = 0; t < ATTEND_CHUNK; t++)
			lanes[t & 15] = row[t] > lanes[t & 15] ? row[t] : lanes[t & 15];
		float top = m[r];
		for (int j = 0; j < 16; j++)
			top = lanes[j] > top ? lanes[j] : top;
		if (top == -__builtin_inff()) {
			/* Nothing visible yet: the row stays empty. */
			alpha[r] = 1.0f;
			memset(row, 0, ATTEND_CHUNK * sizeof *row);
			continue;
		}
		alpha[r] = attend_exp2(m[r] - top);
		for (unsigned t = 0; t < ATTEND_CHUNK; t++)
			row[t] = attend_exp2(row[t] - top);
		for (int j = 0; j < 16; j++)
			lanes[j] = 0.0f;
		for (unsigned t = 0; t < ATTEND_CHUNK; t++)
			lanes[t & 15] = lanes[t & 15] + row[t];
		l[r] = l[r] * alpha[r] + codec_fold_lanes(lanes);
		m[r] = top;
	}
}

/*
 * Saliency by attention: the masses of positions [from, n) of one chunk,
 * once the walk is over and m and l are final. s holds the chunk's scores
 * again (the same kernels, so the same bits as in the walk, masked
 * positions -Inf); mass[t - from] = sum over rows r, r increasing, of
 * 2^(s - m[r]) / l[r]. Called from codec/attend.c only (compiled once,
 * whatever the ISA), so every table gives the same masses.
 */
static inline void attend_mass_chunk(const float *s, size_t n_rows, const float *m,
				     const float *l, unsigned from, unsigned n, float *mass)
{
	for (unsigned t = from; t < n; t++) {
		float sum = 0.0f;
		for (size_t r = 0; r < n_rows; r++)
			sum = sum + attend_exp2(s[r * ATTEND_CHUNK + t] - m[r]) / l[r];
		mass[t - from] = sum;
	}
}

static inline void attend_combine_rows(float *acc, float *part, size_t n_rows, size_t stride,
				       const float *alpha)
{
	for (size_t r = 0; r < n_rows; r++) {
		float a = alpha[r];
		float *out = acc + r * stride, *in = part + r * stride;
		for (size_t c = 0; c < stride; c++) {
			out[c] = out[c] * a + in[c];
			in[c] = 0.0f;
		}
	}
}

#endif
