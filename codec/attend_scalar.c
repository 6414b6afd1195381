/*
 * The scalar reference of the attention kernels: plain C, any CPU. Every
 * product that is summed is one fmaf (one rounding), as the SIMD tables'
 * FMA instructions do; the dot products keep 16 lanes (lane j: channels
 * c = j mod 16, c increasing) folded as codec_fold_lanes.
 */
#include "attend_kernels.h"

#include <math.h>
#include <string.h>

#include "attend_softmax.h"
#include "kernels.h"
#include "zipcache/codec.h"

static float load_half(const uint8_t *bytes)
{
	uint16_t value;
	memcpy(&value, bytes, sizeof value);
	return zc_fp16_to_float(value);
}

/*
 * One row of codes, decoded to what zc_block_reconstruct() stores:
 * fp16(clamp(code * scale + min)), widened. The product is exact, so
 * mul-then-add here equals the SIMD tables' FMA.
 */
static void decode_row(const uint8_t *stream, const uint8_t *read_end, size_t bit_offset,
		       size_t dim, int bits, const uint8_t *scales, const uint8_t *mins, float *y)
{
	const uint32_t code_mask = (1u << bits) - 1u;
	for (size_t c = 0; c < dim; c++) {
		size_t bit = bit_offset + c * (size_t)bits;
		const uint8_t *at = stream + (bit >> 3);
		uint32_t window = at[0];
		if (at + 1 < read_end)
			window |= (uint32_t)at[1] << 8;
		uint32_t code = (window >> (bit & 7u)) & code_mask;
		float x = (float)code * load_half(scales + 2 * c) + load_half(mins + 2 * c);
		/* MAXPS/MINPS(x, bound): the bound wins a NaN. */
		x = x > -65504.0f ? x : -65504.0f;
		x = x < 65504.0f ? x : 65504.0f;
		y[c] = zc_fp16_to_float(zc_float_to_fp16(x));
	}
}

static void fp16_row(const uint16_t *row, size_t dim, float *y)
{
	for (size_t c = 0; c < dim; c++)
		y[c] = zc_fp16_to_float(row[c]);
}

static float dot_lanes(const float *q, const float *y, size_t dim)
{
	float lanes[16] = { 0 };
	for (size_t c = 0; c < dim; c++)
		lanes[c & 15] = fmaf(q[c], y[c], lanes[c & 15]);
	return codec_fold_lanes(lanes);
}

static void score_row(const float *y, size_t dim, const float *q, size_t n_q, size_t q_stride,
		      float *s, uint8_t pos)
{
	for (size_t r = 0; r < n_q; r++)
		s[r * ATTEND_CHUNK + pos] = dot_lanes(q + r * q_stride, y, dim);
}

static void accumulate_row(const float *y, size_t dim, const float *p, size_t i, size_t n_p,
			   float *part, size_t part_stride)
{
	for (size_t r = 0; r < n_p; r++) {
		float w = p[r * ATTEND_CHUNK + i];
		float *out = part + r * part_stride;
		for (size_t c = 0; c < dim; c++)
			out[c] = fmaf(w, y[c], out[c]);
	}
}

static void scalar_score_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows,
			      size_t dim, const float *q, size_t n_q, size_t q_stride, float *s,
			      const uint8_t *pos)
{
	float y[ZC_MAX_HEAD_DIM];
	for (size_t i = 0; i < n_rows; i++) {
		fp16_row(rows + i * row_stride, dim, y);
		score_row(y, dim, q, n_q, q_stride, s, pos[i]);
	}
}

static void scalar_score_codes(const uint8_t *stream, const uint8_t *read_end,
			       size_t bit_offset, size_t n_rows, size_t dim, int bits,
			       const uint8_t *scales, const uint8_t *mins, const float *q,
			       size_t n_q, size_t q_stride, float *s, const uint8_t *pos,
			       void *cache)
{
	float y[ZC_MAX_HEAD_DIM];
	(void)cache;
	for (size_t i = 0; i < n_rows; i++) {
		decode_row(stream, read_end, bit_offset + i * dim * (size_t)bits, dim, bits, scales,
			   mins, y);
		score_row(y, dim, q, n_q, q_stride, s, pos[i]);
	}
}

static void scalar_accumulate_fp16(const uint16_t *rows, size_t row_stride, size_t n_rows,
				   size_t dim, const float *p, size_t n_p, float *part,
				   size_t part_stride)
{
	float y[ZC_MAX_HEAD_DIM];
	for (size_t i = 0; i < n_rows; i++) {
		fp16_row(rows + i * row_stride, dim, y);
		accumulate_row(y, dim, p, i, n_p, part, part_stride);
	}
}

static void scalar_accumulate_codes(const uint8_t *stream, const uint8_t *read_end,
				    size_t bit_offset, size_t n_rows, size_t dim, int bits,
				    const uint8_t *scales, const uint8_t *mins, const float *p,
				    size_t n_p, float *part, size_t part_stride, void *cache)
{
	float y[ZC_MAX_HEAD_DIM];
	(void)cache;
	for (size_t i = 0; i < n_rows; i++) {
		decode_row(stream, read_end, bit_offset + i * dim * (size_t)bits, dim, bits, scales,
			   mins, y);
		accumulate_row(y, dim, p, i, n_p, part, part_stride);
	}
}

static void scalar_softmax(float *s, size_t n_rows, float *m, float *l, float *alpha)
{
	attend_softmax_step(s, n_rows, m, l, alpha);
}

static void scalar_combine(float *acc, float *part, size_t n_rows, size_t stride,
			   const float *alpha)
{
	attend_combine_rows(acc, part, n_rows, stride, alpha);
}

const struct attend_kernels attend_kernels_scalar = {
	.name = "scalar",
	.score_fp16 = scalar_score_fp16,
	.score_codes = scalar_score_codes,
	.accumulate_fp16 = scalar_accumulate_fp16,
	.accumulate_codes = scalar_accumulate_codes,
	.softmax = scalar_softmax,
	.combine = scalar_combine,
};
