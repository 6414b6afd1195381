/*
 * The scalar reference kernels: plain C, any CPU. The SIMD tables are
 * checked against these bit for bit, so every operation here is spelled
 * in the order docs/CODEC.md fixes (and -ffp-contract=off keeps the
 * compiler from fusing it differently).
 */
#include "kernels.h"

#include <math.h>
#include <string.h>

#include "zipcache/codec.h"

static uint16_t load_u16(const uint8_t *bytes)
{
	uint16_t value;
	memcpy(&value, bytes, sizeof(value));
	return value;
}

static void store_u16(uint8_t *bytes, uint16_t value)
{
	memcpy(bytes, &value, sizeof(value));
}

static int scalar_check_finite(const uint16_t *values, size_t n)
{
	uint16_t all_ones = 0;
	for (size_t i = 0; i < n; i++)
		all_ones |= (uint16_t)((values[i] & 0x7c00u) == 0x7c00u);
	return all_ones ? ZC_ENONFINITE : 0;
}

static int scalar_row_norms(const uint16_t *rows, size_t n_rows, size_t dim, float *norms)
{
	if (scalar_check_finite(rows, n_rows * dim) < 0)
		return ZC_ENONFINITE;
	for (size_t r = 0; r < n_rows; r++) {
		const uint16_t *row = rows + r * dim;
		float lanes[16] = { 0 };
		for (size_t c = 0; c < dim; c++) {
			float x = zc_fp16_to_float(row[c]);
			lanes[c & 15] = lanes[c & 15] + x * x;
		}
		norms[r] = sqrtf(codec_fold_lanes(lanes));
	}
	return 0;
}

/* Mirrors MINPS/MAXPS(x, current): the incumbent wins ties and +-0. */
static float min_keep(float x, float current)
{
	return x < current ? x : current;
}

static float max_keep(float x, float current)
{
	return x > current ? x : current;
}

static void scalar_group_params(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				size_t dim, int bits, uint8_t *scales, uint8_t *mins)
{
	const float levels = (float)((1 << bits) - 1);
	for (size_t c = 0; c < dim; c++) {
		float lo = zc_fp16_to_float(head[(size_t)rows[0] * dim + c]);
		float hi = lo;
		for (size_t r = 1; r < n_rows; r++) {
			float x = zc_fp16_to_float(head[(size_t)rows[r] * dim + c]);
			lo = min_keep(x, lo);
			hi = max_keep(x, hi);
		}
		float scale = (hi - lo) / levels;
		scale = max_keep(scale, 1e-8f);
		/* A range wider than fp16 allows would round the scale to Inf. */
		scale = min_keep(scale, 65504.0f);
		store_u16(scales + 2 * c, zc_float_to_fp16(scale));
		store_u16(mins + 2 * c, zc_float_to_fp16(lo));
	}
}

/* One element's code; shared with nothing else so the rule reads once. */
static uint8_t quantize_one(float x, float min, float scale, float max_code)
{
	if (scale == 0.0f)
		return 0;
	float q = rintf((x - min) / scale);
	q = max_keep(q, 0.0f);
	q = min_keep(q, max_code);
	return (uint8_t)q;
}

static void scalar_group_quantize(const uint16_t *head, const uint32_t *rows, size_t n_rows,
				  size_t dim, int bits, const uint8_t *scales,
				  const uint8_t *mins, uint8_t *codes)
{
	const float max_code = (float)((1 << bits) - 1);
	for (size_t r = 0; r < n_rows; r++) {
		const uint16_t *row = head + (size_t)rows[r] * dim;
		for (size_t c = 0; c < dim; c++) {
			float scale = zc_fp16_to_float(load_u16(scales + 2 * c));
			float min = zc_fp16_to_float(load_u16(mins + 2 * c));
			codes[r * dim + c] = quantize_one(zc_fp16_to_float(row[c]), min, scale, max_code);
		}
	}
}

void codec_pack_portable(uint8_t *stream, const uint8_t *stream_end, size_t bit_offset,
			const uint8_t *codes, size_t n, int bits)
{
	uint8_t *out = stream + (bit_offset >> 3);
	unsigned fill = bit_offset & 7u;
	uint32_t pending = fill ? (*out & ((1u << fill) - 1u)) : 0;

	for (size_t i = 0; i < n; i++) {
		pending |= (uint32_t)codes[i] << fill;
		fill += (unsigned)bits;
		while (fill >= 8) {
			*out++ = (uint8_t)pending;
			pending >>= 8;
			fill -= 8;
		}
	}
	if (fill && out < stream_end)
		*out = (uint8_t)pending;
}

static void scalar_row_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				   size_t bit_offset, size_t dim, int bits,
				   const uint8_t *scales, const uint8_t *mins, uint16_t *out)
{
	const uint32_t code_mask = (1u << bits) - 1u;
	for (size_t c = 0; c < dim; c++) {
		size_t bit = bit_offset + c * (size_t)bits;
		const uint8_t *at = stream + (bit >> 3);
		uint32_t window = at[0];
		if (at + 1 < read_end)
			window |= (uint32_t)at[1] << 8;
		uint32_t code = (window >> (bit & 7u)) & code_mask;
		float scale = zc_fp16_to_float(load_u16(scales + 2 * c));
		float min = zc_fp16_to_float(load_u16(mins + 2 * c));
		float y = (float)code * scale + min;
		y = max_keep(y, -65504.0f);
		y = min_keep(y, 65504.0f);
		out[c] = zc_float_to_fp16(y);
	}
}

static void scalar_group_reconstruct(const uint8_t *stream, const uint8_t *read_end,
				     size_t bit_offset, size_t n_rows, size_t dim, int bits,
				     const uint8_t *scales, const uint8_t *mins,
				     const uint32_t *tokens, uint16_t *out, size_t token_stride,
				     bool nt)
{
	(void)nt;
	for (size_t r = 0; r < n_rows; r++)
		scalar_row_reconstruct(stream, read_end, bit_offset + r * dim * (size_t)bits,
				       dim, bits, scales, mins, out + (size_t)tokens[r] * token_stride);
}

const struct codec_kernels codec_kernels_scalar = {
	.name = "scalar",
	.check_finite = scalar_check_finite,
	.row_norms = scalar_row_norms,
	.group_params = scalar_group_params,
	.group_quantize = scalar_group_quantize,
	.pack = codec_pack_portable,
	.group_reconstruct = scalar_group_reconstruct,
};
