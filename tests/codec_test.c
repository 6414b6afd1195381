/*
 * Unit tests for the codec (include/zipcache/codec.h) against the contract
 * in docs/CODEC.md and the "Numerics contract" of DESIGN.md.
 *
 * The heart of the suite is a small reference codec written here from the
 * documentation alone: plain loops, no SIMD, no cleverness. The library's
 * compressed bytes must equal the reference's byte for byte, and its
 * reconstruction must equal the reference's bit for bit, on every ISA the
 * CPU has. Hand-worked cases pin the reference itself to numbers a reader
 * can check on paper, so the two cannot agree on a shared misreading
 * unnoticed.
 *
 * All test data comes from a fixed-seed splitmix64 generator, so a failure
 * reproduces exactly. Comparisons run in plain loops and assert once with
 * a message naming the first mismatch: Check records every assertion, and
 * millions of them would dominate the run time.
 */
#include <check.h>

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "zipcache/codec.h"
#include "zipcache/error.h"

#include "../codec/kernels.h"

/*
 * Like ck_assert_msg, but silent when the condition holds: Check records
 * every passing assertion, which dominates loops over many elements.
 */
#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

/*
 * What the reference reconstructs where docs/CODEC.md leaves the value
 * open (an fp16 scale that overflowed to Inf, see
 * reference_dequantize_subset): the comparisons accept any finite half
 * there, and test_overflowing_scale checks what can be said about it.
 */
#define UNSPECIFIED_HALF 0x7e00u

#define LARGEST_HALF 65504.0f
#define HALF_POSITIVE_INFINITY 0x7c00u
#define HALF_NEGATIVE_INFINITY 0xfc00u

/* ------------------------------------------------------------------ */
/* Deterministic random numbers                                        */
/* ------------------------------------------------------------------ */

typedef struct random_state {
	uint64_t state;
} random_state;

static random_state random_seeded(uint64_t seed)
{
	random_state generator = { seed };
	return generator;
}

/* splitmix64: tiny, fast, and good enough to scatter test inputs. */
static uint64_t random_next(random_state *generator)
{
	uint64_t z = (generator->state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [0, bound) without modulo bias worth caring about here. */
static uint32_t random_below(random_state *generator, uint32_t bound)
{
	return (uint32_t)(((random_next(generator) >> 32) * (uint64_t)bound) >> 32);
}

/* Uniform in [0, 1). */
static double random_unit(random_state *generator)
{
	return (double)(random_next(generator) >> 11) * 0x1.0p-53;
}

/* Box-Muller: keys and values of real models are roughly Gaussian. */
static double random_normal(random_state *generator)
{
	double radius = sqrt(-2.0 * log(1.0 - random_unit(generator)));
	return radius * cos(6.283185307179586 * random_unit(generator));
}

/* ------------------------------------------------------------------ */
/* Reference fp16 conversions                                          */
/* ------------------------------------------------------------------ */

/*
 * Decodes by value rather than by moving bit fields around, so it shares
 * no trick with a bit-twiddling implementation: a normal half is
 * (1024 + mantissa) * 2^(exponent - 25), a subnormal mantissa * 2^-24.
 */
static float reference_half_to_float(uint16_t half)
{
	unsigned exponent = (half >> 10) & 0x1fu;
	unsigned mantissa = half & 0x3ffu;
	float magnitude;

	if (exponent == 0x1f)
		magnitude = mantissa ? NAN : INFINITY;
	else if (exponent == 0)
		magnitude = ldexpf((float)mantissa, -24);
	else
		magnitude = ldexpf((float)(mantissa + 1024), (int)exponent - 25);
	return (half & 0x8000u) ? -magnitude : magnitude;
}

/*
 * Round to nearest even by counting half-precision quanta. For a value in
 * [2^e, 2^(e+1)) with e >= -14 the quantum is 2^(e-10); below 2^-14 it is
 * the subnormal quantum 2^-24. Scaling a float by a power of two is exact
 * in double and rint() rounds half to even, so `steps` is the correctly
 * rounded count; the encoding is then (e + 14) * 1024 + steps, which also
 * carries a rounding overflow into the next exponent (and into Inf).
 */
static uint16_t reference_float_to_half(float value)
{
	uint16_t sign = signbit(value) ? 0x8000u : 0;
	double magnitude = fabs((double)value);
	int exponent;
	double steps;
	long encoding;

	if (isnan(value))
		return (uint16_t)(sign | 0x7e00u);
	if (isinf(value))
		return (uint16_t)(sign | HALF_POSITIVE_INFINITY);
	if (magnitude == 0.0)
		return sign;
	(void)frexp(magnitude, &exponent);
	exponent -= 1; /* magnitude is now in [2^exponent, 2^(exponent+1)) */
	if (exponent < -14)
		exponent = -14;
	steps = rint(ldexp(magnitude, 10 - exponent));
	encoding = (long)(exponent + 14) * 1024 + (long)steps;
	if (encoding >= (long)HALF_POSITIVE_INFINITY)
		encoding = HALF_POSITIVE_INFINITY;
	return (uint16_t)(sign | (uint16_t)encoding);
}

static bool half_is_nan(uint16_t half)
{
	return (half & 0x7c00u) == 0x7c00u && (half & 0x3ffu) != 0;
}

static uint32_t float_bits(float value)
{
	uint32_t bits;

	memcpy(&bits, &value, sizeof bits);
	return bits;
}

static float float_from_bits(uint32_t bits)
{
	float value;

	memcpy(&value, &bits, sizeof value);
	return value;
}

/* Half of one fp16 unit in the last place for magnitudes up to `bound`. */
static double half_precision_half_ulp(double bound)
{
	int exponent;

	if (bound < 0x1.0p-14)
		return 0x1.0p-25;
	(void)frexp(bound, &exponent);
	return ldexp(1.0, exponent - 1 - 11);
}

/* ------------------------------------------------------------------ */
/* Which kernel sets this machine runs                                 */
/* ------------------------------------------------------------------ */

static const zc_isa every_isa[] = { ZC_ISA_SCALAR, ZC_ISA_AVX2, ZC_ISA_AVX512 };
#define ISA_COUNT (sizeof every_isa / sizeof every_isa[0])

/* Fills `isas` with the kernel sets zc_codec_set_isa() accepts here. */
static size_t supported_isas(zc_isa *isas)
{
	size_t count = 0;

	for (size_t i = 0; i < ISA_COUNT; i++)
		if (zc_codec_set_isa(every_isa[i]) == 0)
			isas[count++] = every_isa[i];
	ck_assert_uint_ge(count, 1);
	ck_assert_int_eq(zc_codec_set_isa(isas[0]), 0);
	return count;
}

static void use_isa(zc_isa isa)
{
	ck_assert_int_eq(zc_codec_set_isa(isa), 0);
	ck_assert_int_eq(zc_codec_isa(), isa);
}

/* ------------------------------------------------------------------ */
/* Expected layout, straight from the formulas                         */
/* ------------------------------------------------------------------ */

typedef struct expected_layout {
	uint64_t tokens, head_dim;
	uint64_t n_hi, n_lo, groups_hi, groups_lo;
	bool exact;
	uint64_t mask_bytes;
	uint64_t hi_params_offset, lo_params_offset;
	uint64_t hi_codes_offset, hi_codes_bytes;
	uint64_t lo_codes_offset, lo_codes_bytes;
	uint64_t head_bytes;
	uint64_t heads, total_bytes;
	uint64_t baseline_bytes, fp16_bytes; /* whole block */
} expected_layout;

static uint64_t divide_round_up(uint64_t numerator, uint64_t denominator)
{
	return (numerator + denominator - 1) / denominator;
}

/* n_hi = ceil(S * hi_fraction) in double, clamped to [0, S]. */
static uint32_t reference_salient_count(double fraction, uint32_t tokens)
{
	double wanted = ceil((double)tokens * fraction);

	if (!(wanted > 0.0))
		return 0;
	if (wanted > (double)tokens)
		return tokens;
	return (uint32_t)wanted;
}

static expected_layout expected_block_layout(const zc_codec_config *config, zc_tensor tensor,
					     const zc_block_shape *shape)
{
	expected_layout layout;
	uint64_t tokens = shape->tokens, head_dim = shape->head_dim;
	uint64_t group = (uint64_t)config->group_size;

	memset(&layout, 0, sizeof layout);
	layout.tokens = tokens;
	layout.head_dim = head_dim;
	layout.heads = (uint64_t)shape->batch * shape->heads;
	layout.exact = tensor == ZC_TENSOR_VALUES && !config->quantize_values;
	if (layout.exact) {
		layout.head_bytes = 2 * tokens * head_dim;
	} else {
		layout.n_hi = tensor == ZC_TENSOR_VALUES
			? tokens : reference_salient_count(config->hi_fraction, shape->tokens);
		layout.n_lo = tokens - layout.n_hi;
		layout.groups_hi = divide_round_up(layout.n_hi, group);
		layout.groups_lo = divide_round_up(layout.n_lo, group);
		layout.mask_bytes = divide_round_up(tokens, 8);
		layout.hi_params_offset = layout.mask_bytes;
		layout.lo_params_offset = layout.hi_params_offset + 4 * head_dim * layout.groups_hi;
		layout.hi_codes_offset = layout.lo_params_offset + 4 * head_dim * layout.groups_lo;
		layout.hi_codes_bytes = divide_round_up(layout.n_hi * head_dim
							* (uint64_t)config->hi_bits, 8);
		layout.lo_codes_offset = layout.hi_codes_offset + layout.hi_codes_bytes;
		layout.lo_codes_bytes = divide_round_up(layout.n_lo * head_dim
							* (uint64_t)config->lo_bits, 8);
		/* DESIGN.md's sum, written in its own order on purpose. */
		layout.head_bytes = layout.hi_codes_bytes + layout.lo_codes_bytes
			+ 4 * head_dim * (layout.groups_hi + layout.groups_lo)
			+ layout.mask_bytes;
	}
	layout.total_bytes = layout.heads * layout.head_bytes;
	layout.baseline_bytes = layout.heads
		* (divide_round_up(tokens * head_dim * (uint64_t)config->lo_bits, 8)
		   + 4 * head_dim * divide_round_up(tokens, group));
	layout.fp16_bytes = layout.heads * 2 * tokens * head_dim;
	return layout;
}

/* ------------------------------------------------------------------ */
/* Reference codec                                                     */
/* ------------------------------------------------------------------ */

/*
 * Row norm with the documented order: 16 lanes, lane j summing the squares
 * of channels j, j+16, j+32, ... in increasing order, then folding the
 * lanes in halves. A different order rounds differently and changes which
 * tokens are salient.
 */
static float reference_row_norm(const uint16_t *row, uint32_t head_dim)
{
	float lanes[16] = { 0 };

	for (uint32_t channel = 0; channel < head_dim; channel++) {
		float x = reference_half_to_float(row[channel]);

		lanes[channel % 16] += x * x;
	}
	for (int width = 8; width >= 1; width /= 2)
		for (int lane = 0; lane < width; lane++)
			lanes[lane] += lanes[lane + width];
	return sqrtf(lanes[0]);
}

typedef struct ranked_token {
	float norm;
	uint32_t index;
} ranked_token;

/* Ascending by (norm, index): the last n_hi entries are the salient ones. */
static int compare_ranked_tokens(const void *left, const void *right)
{
	const ranked_token *a = left, *b = right;

	if (a->norm != b->norm)
		return a->norm < b->norm ? -1 : 1;
	return a->index < b->index ? -1 : (a->index > b->index);
}

static void store_le16(uint8_t *where, uint16_t value)
{
	where[0] = (uint8_t)(value & 0xff);
	where[1] = (uint8_t)(value >> 8);
}

static uint16_t load_le16(const uint8_t *where)
{
	return (uint16_t)(where[0] | (where[1] << 8));
}

/* Writes `bits` bits of code at bit `position`, least significant first. */
static void put_code(uint8_t *codes, uint64_t position, int bits, unsigned code)
{
	for (int bit = 0; bit < bits; bit++, position++)
		if ((code >> bit) & 1u)
			codes[position / 8] |= (uint8_t)(1u << (position % 8));
}

static unsigned get_code(const uint8_t *codes, uint64_t position, int bits)
{
	unsigned code = 0;

	for (int bit = 0; bit < bits; bit++, position++)
		code |= (unsigned)((codes[position / 8] >> (position % 8)) & 1u) << bit;
	return code;
}

/*
 * The error a reconstructed element may have, given its group's range,
 * number of levels and fp16 scale:
 *  - rounding to the nearest code costs at most scale16/2, but if fp16
 *    rounded the scale down, the top code reaches only levels * scale16
 *    and the clamp leaves (range - levels * scale16) (this is large when
 *    the scale is a coarse subnormal); a scale that rounded to 0 leaves
 *    every element at the minimum, up to `range` away;
 *  - x - min and the division are fp32 operations whose rounding can tip
 *    a code whose quotient sits at k + 1/2; a few fp32 ulps of the
 *    operands cover that, and the fp32 sum code * scale16 + min;
 *  - the final fp16 rounding adds half an fp16 ulp at the result's
 *    magnitude, which is at most |x| plus the two terms above.
 * Saturating at ±65504 only moves y toward x, which is inside that range.
 */
static double element_error_bound(float x, float minimum, float range, float scale16, int levels)
{
	double quantization;
	double arithmetic;

	if (isinf(scale16))
		return INFINITY; /* not checked here: see test_overflowing_scale */
	if (scale16 == 0.0f)
		quantization = range;
	else
		quantization = fmax(scale16 / 2.0, (double)range - (double)levels * scale16);
	arithmetic = ldexp(fabs((double)x) + fabs((double)minimum) + range
			   + (double)levels * scale16, -21);
	return quantization + arithmetic
		+ half_precision_half_ulp(fabs((double)x) + quantization + arithmetic);
}

/*
 * Quantizes one subset (the salient or the other rows of one head):
 * per group of group_size subset rows and per channel, min/max, scale in
 * fp32, scale and min stored as fp16, codes against the stored values.
 */
static void reference_quantize_subset(const uint16_t *head_input, uint32_t head_dim,
				      const uint32_t *rows, uint32_t row_count, int bits,
				      int group_size, uint8_t *params, uint8_t *codes,
				      double *error_bound)
{
	int levels = (1 << bits) - 1;

	for (uint32_t first = 0; first < row_count; first += (uint32_t)group_size) {
		uint32_t end = first + (uint32_t)group_size < row_count
			? first + (uint32_t)group_size : row_count;
		uint8_t *group_params = params + (uint64_t)(first / (uint32_t)group_size)
			* 4 * head_dim;

		for (uint32_t channel = 0; channel < head_dim; channel++) {
			float minimum = INFINITY, maximum = -INFINITY;

			for (uint32_t row = first; row < end; row++) {
				float x = reference_half_to_float(
					head_input[(uint64_t)rows[row] * head_dim + channel]);

				if (x < minimum)
					minimum = x;
				if (x > maximum)
					maximum = x;
			}
			float range = maximum - minimum;
			float scale = range / (float)levels;

			if (!(scale > 1e-8f))
				scale = 1e-8f;
			/* docs/CODEC.md: the scale saturates at the largest finite half. */
			if (scale > 65504.0f)
				scale = 65504.0f;
			uint16_t scale_half = reference_float_to_half(scale);
			uint16_t minimum_half = reference_float_to_half(minimum);
			float scale16 = reference_half_to_float(scale_half);
			float minimum16 = reference_half_to_float(minimum_half);

			store_le16(group_params + 2 * channel, scale_half);
			store_le16(group_params + 2 * ((uint64_t)head_dim + channel), minimum_half);
			for (uint32_t row = first; row < end; row++) {
				uint64_t element = (uint64_t)rows[row] * head_dim + channel;
				float x = reference_half_to_float(head_input[element]);
				unsigned code = 0;

				if (scale16 != 0.0f) {
					float level = rintf((x - minimum16) / scale16);

					if (level < 0.0f)
						level = 0.0f;
					if (level > (float)levels)
						level = (float)levels;
					code = (unsigned)level;
				}
				put_code(codes, ((uint64_t)row * head_dim + channel) * (uint64_t)bits,
					 bits, code);
				if (error_bound)
					error_bound[element] = element_error_bound(
						x, minimum16, range, scale16, levels);
			}
		}
	}
}

/* Compresses one [S][D] head into `payload` (head_bytes, pre-cleared here). */
static void reference_compress_head(const zc_codec_config *config, zc_tensor tensor,
				    const expected_layout *layout, const uint16_t *head_input,
				    uint8_t *payload, double *error_bound)
{
	uint32_t tokens = (uint32_t)layout->tokens, head_dim = (uint32_t)layout->head_dim;
	uint64_t elements = (uint64_t)tokens * head_dim;

	memset(payload, 0, layout->head_bytes);
	if (layout->exact) {
		for (uint64_t i = 0; i < elements; i++) {
			store_le16(payload + 2 * i, head_input[i]);
			if (error_bound)
				error_bound[i] = 0.0;
		}
		return;
	}

	bool *salient = calloc(tokens + 1, sizeof *salient);
	uint32_t *hi_rows = malloc((tokens + 1) * sizeof *hi_rows);
	uint32_t *lo_rows = malloc((tokens + 1) * sizeof *lo_rows);
	uint32_t hi_count = 0, lo_count = 0;

	ck_assert_ptr_nonnull(salient);
	ck_assert_ptr_nonnull(hi_rows);
	ck_assert_ptr_nonnull(lo_rows);
	if (tensor == ZC_TENSOR_VALUES) {
		for (uint32_t t = 0; t < tokens; t++)
			salient[t] = true;
	} else {
		ranked_token *ranked = malloc((tokens + 1) * sizeof *ranked);

		ck_assert_ptr_nonnull(ranked);
		for (uint32_t t = 0; t < tokens; t++) {
			ranked[t].norm = reference_row_norm(head_input + (uint64_t)t * head_dim,
							    head_dim);
			ranked[t].index = t;
		}
		qsort(ranked, tokens, sizeof *ranked, compare_ranked_tokens);
		for (uint64_t i = tokens - layout->n_hi; i < tokens; i++)
			salient[ranked[i].index] = true;
		free(ranked);
	}
	for (uint32_t t = 0; t < tokens; t++) {
		if (salient[t]) {
			payload[t / 8] |= (uint8_t)(1u << (t % 8));
			hi_rows[hi_count++] = t;
		} else {
			lo_rows[lo_count++] = t;
		}
	}
	ck_assert_uint_eq(hi_count, layout->n_hi);
	reference_quantize_subset(head_input, head_dim, hi_rows, hi_count, config->hi_bits,
				  config->group_size, payload + layout->hi_params_offset,
				  payload + layout->hi_codes_offset, error_bound);
	reference_quantize_subset(head_input, head_dim, lo_rows, lo_count, config->lo_bits,
				  config->group_size, payload + layout->lo_params_offset,
				  payload + layout->lo_codes_offset, error_bound);
	free(salient);
	free(hi_rows);
	free(lo_rows);
}

static void reference_dequantize_subset(const uint8_t *params, const uint8_t *codes,
					const uint32_t *rows, uint32_t row_count, uint32_t head_dim,
					int bits, int group_size, uint16_t *head_output)
{
	for (uint32_t row = 0; row < row_count; row++) {
		const uint8_t *group_params = params + (uint64_t)(row / (uint32_t)group_size)
			* 4 * head_dim;

		for (uint32_t channel = 0; channel < head_dim; channel++) {
			float scale16 = reference_half_to_float(
				load_le16(group_params + 2 * channel));
			float minimum16 = reference_half_to_float(
				load_le16(group_params + 2 * ((uint64_t)head_dim + channel)));
			unsigned code = get_code(codes, ((uint64_t)row * head_dim + channel)
						 * (uint64_t)bits, bits);
			float y = (float)code * scale16 + minimum16;

			/* At 1 bit a range above 65519.99 gives scale = range,
			 * whose fp16 is Inf; every code is then 0 and 0 * Inf is
			 * NaN, which "clamped to [-65504, 65504]" does not
			 * define. */
			if (isnan(y)) {
				head_output[(uint64_t)rows[row] * head_dim + channel] =
					UNSPECIFIED_HALF;
				continue;
			}
			if (y > LARGEST_HALF)
				y = LARGEST_HALF;
			else if (y < -LARGEST_HALF)
				y = -LARGEST_HALF;
			head_output[(uint64_t)rows[row] * head_dim + channel] =
				reference_float_to_half(y);
		}
	}
}

/* Decodes one head payload into a contiguous [S][D] output. */
static void reference_reconstruct_head(const zc_codec_config *config,
				       const expected_layout *layout, const uint8_t *payload,
				       uint16_t *head_output)
{
	uint32_t tokens = (uint32_t)layout->tokens, head_dim = (uint32_t)layout->head_dim;

	if (layout->exact) {
		for (uint64_t i = 0; i < (uint64_t)tokens * head_dim; i++)
			head_output[i] = load_le16(payload + 2 * i);
		return;
	}

	uint32_t *hi_rows = malloc((tokens + 1) * sizeof *hi_rows);
	uint32_t *lo_rows = malloc((tokens + 1) * sizeof *lo_rows);
	uint32_t hi_count = 0, lo_count = 0;

	ck_assert_ptr_nonnull(hi_rows);
	ck_assert_ptr_nonnull(lo_rows);
	for (uint32_t t = 0; t < tokens; t++) {
		if ((payload[t / 8] >> (t % 8)) & 1u)
			hi_rows[hi_count++] = t;
		else
			lo_rows[lo_count++] = t;
	}
	reference_dequantize_subset(payload + layout->hi_params_offset,
				    payload + layout->hi_codes_offset, hi_rows, hi_count,
				    head_dim, config->hi_bits, config->group_size, head_output);
	reference_dequantize_subset(payload + layout->lo_params_offset,
				    payload + layout->lo_codes_offset, lo_rows, lo_count,
				    head_dim, config->lo_bits, config->group_size, head_output);
	free(hi_rows);
	free(lo_rows);
}

/* Whole block: head (b, h) at (b*H + h) * head_bytes, input contiguous. */
static void reference_compress_block(const zc_codec_config *config, zc_tensor tensor,
				     const expected_layout *layout, const uint16_t *input,
				     uint8_t *out, double *error_bound)
{
	uint64_t head_elements = layout->tokens * layout->head_dim;

	for (uint64_t head = 0; head < layout->heads; head++)
		reference_compress_head(config, tensor, layout, input + head * head_elements,
					out + head * layout->head_bytes,
					error_bound ? error_bound + head * head_elements : NULL);
}

static void reference_reconstruct_block(const zc_codec_config *config,
					const expected_layout *layout, const uint8_t *compressed,
					uint16_t *out)
{
	uint64_t head_elements = layout->tokens * layout->head_dim;

	for (uint64_t head = 0; head < layout->heads; head++)
		reference_reconstruct_head(config, layout, compressed + head * layout->head_bytes,
					   out + head * head_elements);
}

/* ------------------------------------------------------------------ */
/* Test data                                                           */
/* ------------------------------------------------------------------ */

typedef enum data_kind {
	DATA_GAUSSIAN,          /* N(0, sigma) with sigma per head */
	DATA_OUTLIER_CHANNELS,  /* a few channels large and offset, as keys have */
	DATA_ANY_FINITE,        /* uniformly random finite bit patterns */
	DATA_SMALL_INTEGERS,    /* -2..2: many exactly equal norms */
	DATA_PERMUTED_ROWS,     /* rows are permutations of one vector */
	DATA_EXTREMES,          /* ±65504, subnormals, ±1 mixed */
	DATA_CONSTANT_CHANNELS, /* every third channel constant over tokens */
	DATA_NEAR_HALVES,       /* offset + j * unit / 2: quotients at or next to k + 1/2 */
	DATA_KIND_COUNT
} data_kind;

static const char *const data_kind_names[DATA_KIND_COUNT] = {
	"gaussian", "outlier-channels", "any-finite", "small-integers",
	"permuted-rows", "extremes", "constant-channels", "near-halves",
};

static const uint16_t extreme_halves[] = {
	0x7bff, 0xfbff,         /* ±65504 */
	0x0001, 0x8001,         /* ±smallest subnormal */
	0x03ff, 0x83ff,         /* ±largest subnormal */
	0x0400, 0x8400,         /* ±smallest normal */
	0x7bfe, 0x3c00, 0xbc00, /* just below the top, ±1 */
	0x0000,
};

static uint16_t half_from_double(double value)
{
	if (value > LARGEST_HALF)
		value = LARGEST_HALF;
	if (value < -LARGEST_HALF)
		value = -LARGEST_HALF;
	return reference_float_to_half((float)value);
}

static uint16_t random_finite_half(random_state *generator)
{
	for (;;) {
		uint16_t half = (uint16_t)random_next(generator);

		if ((half & 0x7c00u) != 0x7c00u)
			return half;
	}
}

/*
 * Fills a [heads][S][D] input. Negative zero is replaced by +0 throughout:
 * when a group's minimum is a zero, which of ±0 gets stored is not fixed by
 * the contract (they compare equal), so byte comparisons avoid the case;
 * test_signed_zero checks it on its own.
 */
static uint16_t *make_input(data_kind kind, uint64_t heads, uint32_t tokens, uint32_t head_dim,
			    uint64_t seed)
{
	uint64_t head_elements = (uint64_t)tokens * head_dim;
	uint16_t *input = malloc((heads * head_elements + 1) * sizeof *input);
	random_state generator = random_seeded(seed);
	double *base = malloc(((size_t)head_dim + 1) * sizeof *base);
	double *unit = malloc(((size_t)head_dim + 1) * sizeof *unit);
	uint32_t *order = malloc(((size_t)head_dim + 1) * sizeof *order);

	ck_assert_ptr_nonnull(input);
	ck_assert_ptr_nonnull(base);
	ck_assert_ptr_nonnull(unit);
	ck_assert_ptr_nonnull(order);
	for (uint64_t head = 0; head < heads; head++) {
		uint16_t *head_input = input + head * head_elements;
		double sigma = ldexp(1.0, (int)random_below(&generator, 14) - 7);

		for (uint32_t c = 0; c < head_dim; c++) {
			base[c] = ldexp(1.0 + random_unit(&generator),
					(int)random_below(&generator, 20) - 10);
			unit[c] = ldexp(1.0 + random_unit(&generator),
					(int)random_below(&generator, 16) - 12);
		}
		for (uint32_t t = 0; t < tokens; t++) {
			uint16_t *row = head_input + (uint64_t)t * head_dim;

			if (kind == DATA_PERMUTED_ROWS) {
				for (uint32_t c = 0; c < head_dim; c++)
					order[c] = c;
				for (uint32_t c = head_dim; c > 1; c--) {
					uint32_t pick = random_below(&generator, c);
					uint32_t swap = order[c - 1];

					order[c - 1] = order[pick];
					order[pick] = swap;
				}
			}
			for (uint32_t c = 0; c < head_dim; c++) {
				uint16_t half = 0;

				switch (kind) {
				case DATA_GAUSSIAN:
					half = half_from_double(sigma * random_normal(&generator));
					break;
				case DATA_OUTLIER_CHANNELS:
					if (c % 13 == 5)
						half = half_from_double(20.0 + 50.0
									* random_normal(&generator));
					else
						half = half_from_double(random_normal(&generator));
					break;
				case DATA_ANY_FINITE:
					half = random_finite_half(&generator);
					break;
				case DATA_SMALL_INTEGERS:
					half = half_from_double((double)random_below(&generator, 5)
								- 2.0);
					break;
				case DATA_PERMUTED_ROWS:
					/* Signs do not change a square, so every row
					 * has the same multiset of squares and only
					 * the summation order tells the norms apart. */
					half = half_from_double(random_below(&generator, 2)
								? base[order[c]] : -base[order[c]]);
					break;
				case DATA_EXTREMES:
					half = extreme_halves[random_below(
						&generator, sizeof extreme_halves
							/ sizeof extreme_halves[0])];
					break;
				case DATA_CONSTANT_CHANNELS:
					if (c % 3 == 0)
						half = half_from_double(base[c] * (c % 2 ? -1 : 1));
					else
						half = half_from_double(sigma
									* random_normal(&generator));
					break;
				case DATA_NEAR_HALVES:
					/* A group's scale comes out near unit (range /
					 * levels, rounded to a half), so (x - min) / scale
					 * lands on or within rounding of half-integers,
					 * where the kernels' shortcuts must agree with the
					 * division exactly. */
					half = half_from_double((c % 2 ? -base[c] : base[c])
								+ unit[c] / 2.0
									  * (double)random_below(
										  &generator, 64));
					break;
				case DATA_KIND_COUNT:
					break;
				}
				row[c] = half == 0x8000u ? 0 : half;
			}
		}
	}
	free(base);
	free(unit);
	free(order);
	return input;
}

static zc_codec_config make_config(int hi_bits, int lo_bits, double hi_fraction, int group_size,
				   bool quantize_values)
{
	zc_codec_config config;

	memset(&config, 0, sizeof config);
	config.hi_bits = hi_bits;
	config.lo_bits = lo_bits;
	config.hi_fraction = hi_fraction;
	config.group_size = group_size;
	config.quantize_values = quantize_values;
	return config;
}

static zc_block_shape make_shape(uint32_t batch, uint32_t heads, uint32_t tokens, uint32_t head_dim)
{
	zc_block_shape shape = { batch, heads, tokens, head_dim };

	return shape;
}

/* ------------------------------------------------------------------ */
/* Comparing the library with the reference                            */
/* ------------------------------------------------------------------ */

/* Names the part of the block a byte offset falls in, for failure messages. */
static void describe_offset(const expected_layout *layout, uint64_t offset, char *text,
			    size_t size)
{
	uint64_t head = offset / layout->head_bytes;
	uint64_t within = offset % layout->head_bytes;
	uint64_t params_bytes = 4 * layout->head_dim;

	if (layout->exact)
		snprintf(text, size, "head %llu, raw fp16 element %llu", (unsigned long long)head,
			 (unsigned long long)(within / 2));
	else if (within < layout->hi_params_offset)
		snprintf(text, size, "head %llu, mask byte %llu", (unsigned long long)head,
			 (unsigned long long)within);
	else if (within < layout->lo_params_offset || within < layout->hi_codes_offset) {
		bool hi = within < layout->lo_params_offset;
		uint64_t relative = within - (hi ? layout->hi_params_offset
					      : layout->lo_params_offset);
		uint64_t in_group = relative % params_bytes;

		snprintf(text, size, "head %llu, %s params group %llu, %s of channel %llu",
			 (unsigned long long)head, hi ? "hi" : "lo",
			 (unsigned long long)(relative / params_bytes),
			 in_group < 2 * layout->head_dim ? "scale" : "min",
			 (unsigned long long)((in_group % (2 * layout->head_dim)) / 2));
	} else if (within < layout->lo_codes_offset)
		snprintf(text, size, "head %llu, hi codes byte %llu", (unsigned long long)head,
			 (unsigned long long)(within - layout->hi_codes_offset));
	else
		snprintf(text, size, "head %llu, lo codes byte %llu", (unsigned long long)head,
			 (unsigned long long)(within - layout->lo_codes_offset));
}

/*
 * Layout fields and byte accounting against the formulas. Silent on
 * success (REQUIRE) because the grid test calls it hundreds of thousands
 * of times.
 */
static void assert_layout_matches(const zc_codec_config *config, zc_tensor tensor,
				  const zc_block_shape *shape, const expected_layout *expected,
				  const char *label)
{
	zc_block_layout layout;
	zc_byte_count count;
	int status;
	bool same;

	memset(&layout, 0xa5, sizeof layout);
	status = zc_block_layout_compute(config, tensor, shape, &layout);
	REQUIRE(status == 0, "%s: zc_block_layout_compute returned %d", label, status);
	same = layout.total_bytes == expected->total_bytes
		&& layout.head_bytes == expected->head_bytes
		&& layout.heads == expected->heads
		&& layout.tokens == expected->tokens
		&& layout.head_dim == expected->head_dim
		&& layout.exact == expected->exact;
	if (same && !expected->exact)
		same = layout.n_hi == expected->n_hi && layout.n_lo == expected->n_lo
			&& layout.groups_hi == expected->groups_hi
			&& layout.groups_lo == expected->groups_lo
			&& layout.hi_bits == config->hi_bits
			&& (tensor == ZC_TENSOR_VALUES || layout.lo_bits == config->lo_bits)
			&& layout.mask_offset == 0
			&& layout.mask_bytes == expected->mask_bytes
			&& layout.hi_params_offset == expected->hi_params_offset
			&& layout.lo_params_offset == expected->lo_params_offset
			&& layout.hi_codes_offset == expected->hi_codes_offset
			&& layout.hi_codes_bytes == expected->hi_codes_bytes
			&& layout.lo_codes_offset == expected->lo_codes_offset
			&& layout.lo_codes_bytes == expected->lo_codes_bytes;
	REQUIRE(same, "%s: %s S=%u D=%u B*H=%llu hi=%d lo=%d fraction=%.17g group=%d "
		"quantize_values=%d: layout (got/expected) exact %d/%d n_hi %u/%llu "
		"n_lo %u/%llu groups_hi %u/%llu groups_lo %u/%llu mask %zu+%zu/0+%llu "
		"hi_params %zu/%llu lo_params %zu/%llu hi_codes %zu+%zu/%llu+%llu "
		"lo_codes %zu+%zu/%llu+%llu head %zu/%llu heads %zu/%llu total %zu/%llu", label,
		tensor == ZC_TENSOR_KEYS ? "keys" : "values", shape->tokens, shape->head_dim,
		(unsigned long long)expected->heads, config->hi_bits, config->lo_bits,
		config->hi_fraction, config->group_size, config->quantize_values, layout.exact,
		expected->exact, layout.n_hi, (unsigned long long)expected->n_hi, layout.n_lo,
		(unsigned long long)expected->n_lo, layout.groups_hi,
		(unsigned long long)expected->groups_hi, layout.groups_lo,
		(unsigned long long)expected->groups_lo, layout.mask_offset, layout.mask_bytes,
		(unsigned long long)expected->mask_bytes, layout.hi_params_offset,
		(unsigned long long)expected->hi_params_offset, layout.lo_params_offset,
		(unsigned long long)expected->lo_params_offset, layout.hi_codes_offset,
		layout.hi_codes_bytes, (unsigned long long)expected->hi_codes_offset,
		(unsigned long long)expected->hi_codes_bytes, layout.lo_codes_offset,
		layout.lo_codes_bytes, (unsigned long long)expected->lo_codes_offset,
		(unsigned long long)expected->lo_codes_bytes, layout.head_bytes,
		(unsigned long long)expected->head_bytes, layout.heads,
		(unsigned long long)expected->heads, layout.total_bytes,
		(unsigned long long)expected->total_bytes);

	memset(&count, 0xa5, sizeof count);
	status = zc_block_count_bytes(config, tensor, shape, &count);
	REQUIRE(status == 0, "%s: zc_block_count_bytes returned %d", label, status);
	REQUIRE(count.compressed == expected->total_bytes
		&& count.baseline == expected->baseline_bytes
		&& count.fp16 == expected->fp16_bytes,
		"%s: %s S=%u D=%u B*H=%llu lo=%d group=%d: count compressed %llu baseline %llu "
		"fp16 %llu, expected %llu %llu %llu", label,
		tensor == ZC_TENSOR_KEYS ? "keys" : "values", shape->tokens, shape->head_dim,
		(unsigned long long)expected->heads, config->lo_bits, config->group_size,
		(unsigned long long)count.compressed, (unsigned long long)count.baseline,
		(unsigned long long)count.fp16, (unsigned long long)expected->total_bytes,
		(unsigned long long)expected->baseline_bytes,
		(unsigned long long)expected->fp16_bytes);
}

/* Returns the index of the first differing byte, or `size` if none. */
static size_t first_difference(const uint8_t *a, const uint8_t *b, size_t size)
{
	for (size_t i = 0; i < size; i++)
		if (a[i] != b[i])
			return i;
	return size;
}

static void assert_same_bytes(const expected_layout *layout, const uint8_t *expected,
			      const uint8_t *got, const char *label, const char *isa_name)
{
	size_t size = (size_t)layout->total_bytes;
	size_t at = first_difference(expected, got, size);
	char where[160] = "";

	if (at < size)
		describe_offset(layout, at, where, sizeof where);
	ck_assert_msg(at == size, "%s [%s]: compressed byte %zu (%s) expected 0x%02x got 0x%02x",
		      label, isa_name, at, where, at < size ? expected[at] : 0,
		      at < size ? got[at] : 0);
}

static void assert_same_halves(const expected_layout *layout, const uint16_t *input,
			       const uint16_t *expected, const uint16_t *got, const char *label,
			       const char *isa_name)
{
	uint64_t elements = layout->heads * layout->tokens * layout->head_dim;

	for (uint64_t i = 0; i < elements; i++) {
		if (expected[i] == got[i])
			continue;
		if (expected[i] == UNSPECIFIED_HALF && (got[i] & 0x7c00u) != 0x7c00u)
			continue;
		uint64_t head = i / (layout->tokens * layout->head_dim);
		uint64_t token = i / layout->head_dim % layout->tokens;

		ck_abort_msg("%s [%s]: reconstruction of head %llu token %llu channel %llu "
			      "(input 0x%04x) expected 0x%04x got 0x%04x", label, isa_name,
			      (unsigned long long)head, (unsigned long long)token,
			      (unsigned long long)(i % layout->head_dim), input[i], expected[i],
			      got[i]);
	}
}

/* Checks |y - x| <= bound and that y is finite, element by element. */
static void assert_within_bound(const expected_layout *layout, const uint16_t *input,
				const uint16_t *output, const double *error_bound,
				const char *label, const char *isa_name)
{
	uint64_t elements = layout->heads * layout->tokens * layout->head_dim;

	for (uint64_t i = 0; i < elements; i++) {
		float x = reference_half_to_float(input[i]);
		float y = reference_half_to_float(output[i]);
		double error = fabs((double)y - (double)x);

		if (isinf(error_bound[i]))
			continue;
		if (isfinite(y) && error <= error_bound[i])
			continue;
		ck_abort_msg("%s [%s]: element %llu input 0x%04x (%.9g) reconstructed 0x%04x "
			      "(%.9g), error %.9g exceeds bound %.9g", label, isa_name,
			      (unsigned long long)i, input[i], (double)x, output[i], (double)y,
			      error, error_bound[i]);
	}
}

/*
 * One block through the reference and through the library on every
 * supported ISA: layout and accounting, compressed bytes, reconstruction,
 * error bound. Buffers are allocated to their exact size (and misaligned on
 * purpose) so that AddressSanitizer catches any access past an end.
 */
static void verify_block(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, const uint16_t *input, const char *label)
{
	expected_layout layout = expected_block_layout(config, tensor, shape);
	uint64_t elements = layout.heads * layout.tokens * layout.head_dim;
	size_t total = (size_t)layout.total_bytes;
	uint8_t *expected = malloc(total + 1);
	uint16_t *expected_output = malloc((elements + 1) * sizeof *expected_output);
	double *error_bound = malloc((elements + 1) * sizeof *error_bound);
	uint16_t *input_storage = malloc((elements + 1) * sizeof *input_storage);
	uint8_t *compressed_storage = malloc(total + 1);
	uint16_t *output_storage = malloc((elements + 1) * sizeof *output_storage);
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	ck_assert_ptr_nonnull(expected);
	ck_assert_ptr_nonnull(expected_output);
	ck_assert_ptr_nonnull(error_bound);
	ck_assert_ptr_nonnull(input_storage);
	ck_assert_ptr_nonnull(compressed_storage);
	ck_assert_ptr_nonnull(output_storage);
	reference_compress_block(config, tensor, &layout, input, expected, error_bound);
	reference_reconstruct_block(config, &layout, expected, expected_output);
	/* The reference must meet the bound too, or the bound is wrong. */
	assert_within_bound(&layout, input, expected_output, error_bound, label, "reference");

	/* Off by one element / one byte from malloc's alignment, ending
	 * exactly at the end of the allocation. */
	uint16_t *library_input = input_storage + 1;
	uint8_t *compressed = compressed_storage + 1;
	uint16_t *output = output_storage + 1;
	zc_strides strides = {
		(size_t)(shape->heads * layout.tokens * layout.head_dim),
		(size_t)(layout.tokens * layout.head_dim),
		(size_t)layout.head_dim,
	};

	if (elements)
		memcpy(library_input, input, elements * sizeof *input);
	for (size_t i = 0; i < isa_count; i++) {
		const char *isa_name = zc_isa_name(isas[i]);
		int64_t written;
		int status;

		use_isa(isas[i]);
		assert_layout_matches(config, tensor, shape, &layout, label);
		memset(compressed, 0x5a, total);
		written = zc_block_compress(config, tensor, shape, library_input, compressed, total);
		ck_assert_msg(written == (int64_t)total, "%s [%s]: zc_block_compress returned %lld,"
			      " expected %zu", label, isa_name, (long long)written, total);
		assert_same_bytes(&layout, expected, compressed, label, isa_name);
		for (uint64_t e = 0; e < elements; e++)
			output[e] = 0xdead;
		status = zc_block_reconstruct(config, tensor, shape, compressed, total, output,
					      &strides);
		ck_assert_msg(status == 0, "%s [%s]: zc_block_reconstruct returned %d (%s)", label,
			      isa_name, status, zc_strerror(status));
		assert_same_halves(&layout, input, expected_output, output, label, isa_name);
		assert_within_bound(&layout, input, output, error_bound, label, isa_name);
	}
	free(expected);
	free(expected_output);
	free(error_bound);
	free(input_storage);
	free(compressed_storage);
	free(output_storage);
}

/* verify_block on freshly generated data. */
static void verify_generated(const zc_codec_config *config, zc_tensor tensor,
			     const zc_block_shape *shape, data_kind kind, uint64_t seed)
{
	char label[256];
	uint16_t *input = make_input(kind, (uint64_t)shape->batch * shape->heads, shape->tokens,
				     shape->head_dim, seed);

	snprintf(label, sizeof label,
		 "%s B=%u H=%u S=%u D=%u hi=%d lo=%d fraction=%.17g group=%d quantize_values=%d "
		 "data=%s seed=%llu", tensor == ZC_TENSOR_KEYS ? "keys" : "values", shape->batch,
		 shape->heads, shape->tokens, shape->head_dim, config->hi_bits, config->lo_bits,
		 config->hi_fraction, config->group_size, config->quantize_values,
		 data_kind_names[kind], (unsigned long long)seed);
	verify_block(config, tensor, shape, input, label);
	free(input);
}

/* ------------------------------------------------------------------ */
/* Hand-worked cases                                                   */
/* ------------------------------------------------------------------ */

/*
 * Compresses with the library on every ISA and compares with bytes worked
 * out by hand, then reconstructs and compares with hand-worked halves. The
 * reference must agree too, so a slip in the reference shows up here.
 */
static void check_hand_case(const zc_codec_config *config, zc_tensor tensor, uint32_t tokens,
			    uint32_t head_dim, const uint16_t *input, const uint8_t *expected,
			    size_t expected_size, const uint16_t *expected_output, const char *label)
{
	zc_block_shape shape = make_shape(1, 1, tokens, head_dim);
	expected_layout layout = expected_block_layout(config, tensor, &shape);
	uint8_t reference[256];
	uint16_t reference_output[64];
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	ck_assert_uint_eq(layout.total_bytes, expected_size);
	ck_assert_uint_le(expected_size, sizeof reference);
	reference_compress_block(config, tensor, &layout, input, reference, NULL);
	assert_same_bytes(&layout, expected, reference, label, "reference");
	reference_reconstruct_block(config, &layout, expected, reference_output);
	assert_same_halves(&layout, input, expected_output, reference_output, label, "reference");

	for (size_t i = 0; i < isa_count; i++) {
		uint8_t compressed[256 + 8];
		uint16_t output[64];
		zc_strides strides = { (size_t)tokens * head_dim, (size_t)tokens * head_dim,
				       head_dim };

		use_isa(isas[i]);
		memset(compressed, 0xee, sizeof compressed);
		ck_assert_int_eq(zc_block_compress(config, tensor, &shape, input, compressed,
						   sizeof compressed), (int64_t)expected_size);
		assert_same_bytes(&layout, expected, compressed, label, zc_isa_name(isas[i]));
		for (size_t b = expected_size; b < sizeof compressed; b++)
			ck_assert_msg(compressed[b] == 0xee, "%s: byte %zu past the end written",
				      label, b);
		ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape, compressed,
						      expected_size, output, &strides), 0);
		assert_same_halves(&layout, input, expected_output, output, label,
				   zc_isa_name(isas[i]));
	}
}

/*
 * Keys, S=4, D=2, hi_fraction 0.5 (n_hi = 2), group_size 2, hi 4 bits,
 * lo 2 bits.
 *   t0 = ( 1.0, -2.0)  norm^2 5
 *   t1 = ( 0.5, 0.25)  norm^2 0.3125
 *   t2 = ( 3.0,  0.0)  norm^2 9
 *   t3 = (-1.0,  2.0)  norm^2 5, ties t0: the later token wins
 * Salient {t2, t3}: mask 0b00001100.
 */
START_TEST(test_hand_keys_tie_and_rounding)
{
	zc_codec_config config = make_config(4, 2, 0.5, 2, true);
	const uint16_t input[] = { 0x3c00, 0xc000, 0x3800, 0x3400,
				   0x4200, 0x0000, 0xbc00, 0x4000 };
	const uint8_t expected[] = {
		0x0c,
		/* hi group (t2, t3), 15 levels:
		 *  channel 0: min -1, max 3, scale 4/15 = 0.26666668 in fp32;
		 *    fp16 quantum in [0.25, 0.5) is 2^-12: 1092.27 -> 1092,
		 *    scale16 = 1092/4096 = 0.2666015625 = 0x3444
		 *  channel 1: min 0, max 2, scale 2/15, quantum 2^-13:
		 *    1092.27 -> 1092, scale16 = 0.13330078125 = 0x3044
		 *  mins -1.0 = 0xbc00, 0.0 = 0x0000 */
		0x44, 0x34, 0x44, 0x30, 0x00, 0xbc, 0x00, 0x00,
		/* lo group (t0, t1), 3 levels:
		 *  channel 0: min 0.5, max 1, scale 0.5/3 = 0.16666667,
		 *    quantum 2^-13: 1365.33 -> 1365, 0.1666259765625 = 0x3155
		 *  channel 1: min -2, max 0.25, scale 2.25/3 = 0.75 = 0x3a00
		 *  mins 0.5 = 0x3800, -2.0 = 0xc000 */
		0x55, 0x31, 0x00, 0x3a, 0x00, 0x38, 0x00, 0xc0,
		/* hi codes, 4 bits, LSB first:
		 *  t2: (3 - -1) / 0.2666015625 = 15.004 -> 15; (0 - 0) -> 0
		 *  t3: 0; 2 / 0.13330078125 = 15.004 -> 15
		 *  byte 0 = 15 | 0 << 4, byte 1 = 0 | 15 << 4 */
		0x0f, 0xf0,
		/* lo codes, 2 bits:
		 *  t0: 0.5 / 0.1666259765625 = 3.0007 -> 3; -2 - -2 = 0 -> 0
		 *  t1: 0; 2.25 / 0.75 = 3
		 *  3 | 0 << 2 | 0 << 4 | 3 << 6 = 0xc3 */
		0xc3,
	};
	/* t2 channel 0: 15 * 1092/4096 - 1 = 12284/4096; the fp16 quantum in
	 * [2, 4) is 8/4096 and 12284/8 = 1535.5, a tie, even -> 1536 = 3.0.
	 * t3 channel 1: 15 * 1092/8192 = 16380/8192, quantum 8/8192: 2047.5
	 * -> 2048 = 2.0. t0 channel 0: 3 * 1365/8192 + 0.5 = 8191/8192,
	 * quantum 4/8192: 2047.75 -> 2048 = 1.0. The rest are exact. */
	const uint16_t expected_output[] = { 0x3c00, 0xc000, 0x3800, 0x3400,
					     0x4200, 0x0000, 0xbc00, 0x4000 };

	check_hand_case(&config, ZC_TENSOR_KEYS, 4, 2, input, expected, sizeof expected,
			expected_output, "hand keys S=4 D=2");
}
END_TEST

/*
 * Keys, S=6, D=1 (norm = |x|), hi_fraction 0.3: 6 * 0.3 = 1.7999999999999998
 * in double, ceil 2. group_size 2, hi 4 bits, lo 2 bits.
 *   x = 1, -8, 2, 3, 10, -1
 * Salient: t4 (10) and t1 (8): mask bits 1 and 4 = 0x12. The lo subset is
 * t0, t2, t3, t5; its second group (t3, t5) spans the salient t4.
 */
START_TEST(test_hand_groups_cross_split)
{
	zc_codec_config config = make_config(4, 2, 0.3, 2, true);
	const uint16_t input[] = { 0x3c00, 0xc800, 0x4000, 0x4200, 0x4900, 0xbc00 };
	const uint8_t expected[] = {
		0x12,
		/* hi group (t1, t4): min -8, max 10, scale 18/15 = 1.2 in fp32
		 * (1.20000005); fp16 quantum in [1, 2) is 2^-10: 1228.8 -> 1229,
		 * scale16 = 1229/1024 = 1.2001953125 = 0x3ccd; min -8 = 0xc800 */
		0xcd, 0x3c, 0x00, 0xc8,
		/* lo group 0 (t0, t2): min 1, max 2, scale 1/3 -> quantum 2^-12:
		 *   1365.33 -> 1365, 0.333251953125 = 0x3555; min 1.0 = 0x3c00
		 * lo group 1 (t3, t5): min -1, max 3, scale 4/3 -> quantum
		 *   2^-10: 1365.33 -> 1365, 1.3330078125 = 0x3d55; min 0xbc00 */
		0x55, 0x35, 0x00, 0x3c, 0x55, 0x3d, 0x00, 0xbc,
		/* hi codes: t1 -> 0; t4: 18 / 1.2001953125 = 14.998 -> 15;
		 * 0 | 15 << 4 */
		0xf0,
		/* lo codes: t0 0; t2 1 / 0.333251953125 = 3.0007 -> 3;
		 * t3 4 / 1.3330078125 = 3.0007 -> 3; t5 0:
		 * 0 | 3 << 2 | 3 << 4 | 0 << 6 = 0x3c */
		0x3c,
	};
	/* t4: 15 * 1229/1024 - 8 = 10.0029296875, fp16 quantum in [8, 16)
	 * is 2^-7: 1280.375 -> 1280 = 10.0. t2: 3 * 1365/4096 + 1 =
	 * 1.999755859375, 2047.75 quanta -> 2.0. t3: 4095/1024 - 1 =
	 * 2.9990234375, 1535.5 quanta of 2^-9, even -> 3.0. */
	const uint16_t expected_output[] = { 0x3c00, 0xc800, 0x4000, 0x4200, 0x4900, 0xbc00 };

	check_hand_case(&config, ZC_TENSOR_KEYS, 6, 1, input, expected, sizeof expected,
			expected_output, "hand keys groups across the split");
}
END_TEST

/*
 * Values, S=3, D=1, hi 2 bits, group_size 2: the last group is one row,
 * constant, so its scale is max(0 / 3, 1e-8) = 1e-8, which is below half
 * the smallest fp16 subnormal (2^-25 = 2.98e-8) and stores as 0.
 *   x = 0, 3, 5
 */
START_TEST(test_hand_values_short_group)
{
	zc_codec_config config = make_config(2, 7, 0.0, 2, true);
	const uint16_t input[] = { 0x0000, 0x4200, 0x4500 };
	const uint8_t expected[] = {
		0x07,                   /* values: every token salient */
		0x00, 0x3c, 0x00, 0x00, /* group (t0, t1): scale 3/3 = 1.0, min 0 */
		0x00, 0x00, 0x00, 0x45, /* group (t2): scale 0, min 5.0 = 0x4500 */
		/* codes: t0 0, t1 3 / 1 = 3, t2 0 (scale16 == 0):
		 * 0 | 3 << 2 | 0 << 4 */
		0x0c,
	};
	const uint16_t expected_output[] = { 0x0000, 0x4200, 0x4500 };

	check_hand_case(&config, ZC_TENSOR_VALUES, 3, 1, input, expected, sizeof expected,
			expected_output, "hand values short last group");
}
END_TEST

/*
 * Values, S=5, D=1, hi 2 bits, one group: min 0, max 3, scale 1. The
 * quotients 0.5, 1.5 and 2.5 are exact ties and round half to even:
 * codes 0, 0, 2, 2, 3 (not 0, 1, 2, 3, 3 as round-half-up would give).
 */
START_TEST(test_hand_codes_round_half_even)
{
	zc_codec_config config = make_config(2, 2, 0.2, 8, true);
	const uint16_t input[] = { 0x0000, 0x3800, 0x3e00, 0x4100, 0x4200 };
	const uint8_t expected[] = {
		0x1f,
		0x00, 0x3c, 0x00, 0x00, /* scale 1.0, min 0 */
		/* 0 | 0 << 2 | 2 << 4 | 2 << 6 = 0xa0, then 3 */
		0xa0, 0x03,
	};
	const uint16_t expected_output[] = { 0x0000, 0x0000, 0x4000, 0x4000, 0x4200 };

	check_hand_case(&config, ZC_TENSOR_VALUES, 5, 1, input, expected, sizeof expected,
			expected_output, "hand values round half even");
}
END_TEST

/*
 * Values, S=2, D=1, hi 8 bits: x = 0, 357 * 2^-24 (0x0165, subnormal).
 * scale = 357 * 2^-24 / 255 = 1.4 * 2^-24, which fp16 rounds down to
 * 2^-24 (0x0001); 357 / 1 = 357 clamps to 255, so the top element comes
 * back as 255 * 2^-24 = 0x00ff. The contract accepts this error
 * (102 * 2^-24, far above scale16 / 2), and the error bound above allows
 * for it: the clamp term range - levels * scale16.
 */
START_TEST(test_hand_subnormal_scale_clamps)
{
	zc_codec_config config = make_config(8, 2, 0.2, 32, true);
	const uint16_t input[] = { 0x0000, 0x0165 };
	const uint8_t expected[] = { 0x03, 0x01, 0x00, 0x00, 0x00, 0x00, 0xff };
	const uint16_t expected_output[] = { 0x0000, 0x00ff };

	check_hand_case(&config, ZC_TENSOR_VALUES, 2, 1, input, expected, sizeof expected,
			expected_output, "hand values subnormal scale");
}
END_TEST

/*
 * Keys, S=10, D=2, hi_fraction 0.3 (n_hi = 3): t2 = (2, 0) has norm 2,
 * every other token norm 1 ((±1, 0) or (0, ±1)). Salient: t2, then the two
 * latest of the tied tokens, t9 and t8. Mask bytes 0x04, 0x03.
 */
START_TEST(test_hand_norm_ties_go_to_later_tokens)
{
	zc_codec_config config = make_config(4, 2, 0.3, 32, true);
	const uint16_t input[] = {
		0x3c00, 0x0000, 0x0000, 0x3c00, 0x4000, 0x0000, 0xbc00, 0x0000, 0x0000, 0xbc00,
		0x3c00, 0x0000, 0x0000, 0x3c00, 0xbc00, 0x0000, 0x0000, 0xbc00, 0x3c00, 0x0000,
	};
	zc_block_shape shape = make_shape(1, 1, 10, 2);
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 10), 3);
	for (size_t i = 0; i < isa_count; i++) {
		uint8_t compressed[512];

		use_isa(isas[i]);
		ck_assert_int_gt(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input,
						   compressed, sizeof compressed), 0);
		ck_assert_uint_eq(compressed[0], 0x04);
		ck_assert_uint_eq(compressed[1], 0x03);
	}
	verify_block(&config, ZC_TENSOR_KEYS, &shape, input, "hand norm ties");
}
END_TEST

/*
 * The documented summation order decides saliency. D = 32, n_hi = 1:
 *   row A: channel 0 = 4096, channels 1..15 and 17..31 = 1, channel 16 = 0
 *   row B: channel 0 = 4096, channel 1 = 4
 * In 16 lanes, lane 0 holds 2^24 and lanes 1..15 hold 2 each; the fold
 * adds them pairwise (2^24 + 2, + 4, + 8, + 16) exactly: 2^24 + 30, norm
 * about 4096.0037. Summed left to right instead, every + 1 after 2^24 is
 * a tie that rounds back to 2^24: norm 4096. Row B is 2^24 + 16 in any
 * order: norm about 4096.0020. So A is salient, not B. The second head
 * holds the same rows in the other order, so that preferring a position
 * cannot pass.
 */
START_TEST(test_hand_norm_summation_order)
{
	zc_codec_config config = make_config(4, 2, 0.5, 32, true);
	zc_block_shape shape = make_shape(1, 2, 2, 32);
	uint16_t input[2 * 2 * 32];
	uint16_t *row_a = input, *row_b = input + 32;
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	memset(input, 0, sizeof input);
	row_a[0] = 0x6c00; /* 4096 */
	for (int c = 1; c < 32; c++)
		row_a[c] = c == 16 ? 0 : 0x3c00;
	row_b[0] = 0x6c00;
	row_b[1] = 0x4400; /* 4 */
	/* Second head: B first, then A. */
	memcpy(input + 64, row_b, 32 * sizeof *input);
	memcpy(input + 96, row_a, 32 * sizeof *input);
	ck_assert_float_gt(reference_row_norm(row_a, 32), reference_row_norm(row_b, 32));

	for (size_t i = 0; i < isa_count; i++) {
		expected_layout layout = expected_block_layout(&config, ZC_TENSOR_KEYS, &shape);
		uint8_t compressed[2048];

		use_isa(isas[i]);
		ck_assert_int_eq(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input,
						   compressed, sizeof compressed),
				 (int64_t)layout.total_bytes);
		ck_assert_uint_eq(compressed[0], 0x01);                  /* head 0: A is t0 */
		ck_assert_uint_eq(compressed[layout.head_bytes], 0x02); /* head 1: A is t1 */
	}
	verify_block(&config, ZC_TENSOR_KEYS, &shape, input, "hand norm summation order");
}
END_TEST

/* ------------------------------------------------------------------ */
/* Byte-for-byte against the reference                                 */
/* ------------------------------------------------------------------ */

START_TEST(test_reference_every_bit_width)
{
	zc_block_shape shape = make_shape(1, 2, 37, 19);

	for (int hi = 1; hi <= 8; hi++) {
		for (int lo = 1; lo <= 8; lo++) {
			zc_codec_config config = make_config(hi, lo, 0.3, 5, true);

			verify_generated(&config, ZC_TENSOR_KEYS, &shape,
					 (data_kind)((hi + lo) % DATA_KIND_COUNT),
					 (uint64_t)(hi * 8 + lo));
		}
		zc_codec_config values = make_config(hi, 3, 0.3, 6, true);

		verify_generated(&values, ZC_TENSOR_VALUES, &shape, DATA_GAUSSIAN, 100u + hi);
		verify_generated(&values, ZC_TENSOR_VALUES, &shape, DATA_ANY_FINITE, 200u + hi);
	}
}
END_TEST

START_TEST(test_reference_head_dims)
{
	static const uint32_t head_dims[] = { 1, 3, 64, 80, 96, 128, 256, 576 };
	static const uint32_t token_counts[] = { 1, 31, 33 };
	uint64_t seed = 1000;

	for (size_t d = 0; d < sizeof head_dims / sizeof head_dims[0]; d++) {
		for (size_t s = 0; s < sizeof token_counts / sizeof token_counts[0]; s++) {
			zc_block_shape shape = make_shape(1, 1, token_counts[s], head_dims[d]);
			zc_codec_config config = make_config(4, 2, 0.2, 32, true);

			verify_generated(&config, ZC_TENSOR_KEYS, &shape,
					 (data_kind)(seed % DATA_KIND_COUNT), seed);
			seed++;
			verify_generated(&config, ZC_TENSOR_VALUES, &shape,
					 (data_kind)(seed % DATA_KIND_COUNT), seed);
			seed++;
		}
	}
}
END_TEST

START_TEST(test_reference_token_counts)
{
	static const uint32_t token_counts[] = { 0, 1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65 };
	zc_codec_config config;

	zc_codec_config_default(&config);
	for (size_t s = 0; s < sizeof token_counts / sizeof token_counts[0]; s++) {
		zc_block_shape shape = make_shape(1, 2, token_counts[s], 24);

		verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_OUTLIER_CHANNELS, 2000 + s);
		verify_generated(&config, ZC_TENSOR_VALUES, &shape, DATA_GAUSSIAN, 3000 + s);
	}
}
END_TEST

/* A prefill-sized block: S = 4096, D = 128, the default config. */
START_TEST(test_reference_long_block)
{
	zc_codec_config config;
	zc_block_shape shape = make_shape(1, 1, 4096, 128);

	zc_codec_config_default(&config);
	verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_OUTLIER_CHANNELS, 4096);
	verify_generated(&config, ZC_TENSOR_VALUES, &shape, DATA_GAUSSIAN, 4097);
}
END_TEST

START_TEST(test_reference_fractions)
{
	static const double fractions[] = { 0.0, 1.0, 0.2, 0.5, 1e-9, 0.999999, 1.0 / 3.0 };
	static const uint32_t token_counts[] = { 1, 5, 35, 100 };
	uint64_t seed = 5000;

	for (size_t f = 0; f < sizeof fractions / sizeof fractions[0]; f++) {
		for (size_t s = 0; s < sizeof token_counts / sizeof token_counts[0]; s++) {
			zc_codec_config config = make_config(5, 3, fractions[f], 7, true);
			zc_block_shape shape = make_shape(1, 1, token_counts[s], 17);

			verify_generated(&config, ZC_TENSOR_KEYS, &shape,
					 (data_kind)(seed % DATA_KIND_COUNT), seed);
			seed++;
		}
	}
}
END_TEST

START_TEST(test_reference_group_sizes)
{
	static const int group_sizes[] = { 1, 2, 3, 7, 31, 32, 33, 48, 49, 50, 1000 };
	zc_block_shape shape = make_shape(2, 1, 49, 21);

	for (size_t g = 0; g < sizeof group_sizes / sizeof group_sizes[0]; g++) {
		zc_codec_config config = make_config(3, 2, 0.37, group_sizes[g], true);

		verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_GAUSSIAN, 6000 + g);
		verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_PERMUTED_ROWS, 6100 + g);
		verify_generated(&config, ZC_TENSOR_VALUES, &shape, DATA_OUTLIER_CHANNELS,
				 6200 + g);
	}
}
END_TEST

START_TEST(test_reference_batch_and_heads)
{
	static const zc_block_shape shapes[] = {
		{ 2, 3, 33, 64 }, { 3, 1, 5, 80 }, { 1, 4, 40, 16 }, { 4, 2, 1, 3 },
	};

	for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
		zc_codec_config config = make_config(4, 2, 0.2, 16, true);

		verify_generated(&config, ZC_TENSOR_KEYS, &shapes[i], DATA_OUTLIER_CHANNELS,
				 7000 + i);
		verify_generated(&config, ZC_TENSOR_VALUES, &shapes[i], DATA_GAUSSIAN, 7100 + i);
		config.quantize_values = false;
		verify_generated(&config, ZC_TENSOR_VALUES, &shapes[i], DATA_ANY_FINITE, 7200 + i);
	}
}
END_TEST

/*
 * Norms that tie exactly (small integers) or differ only in the rounding of
 * the sum (permuted rows), with D not a multiple of 16 so the lanes are
 * uneven, and with many heads so there are many chances to go wrong.
 */
START_TEST(test_reference_norm_ties_and_order)
{
	static const uint32_t head_dims[] = { 5, 16, 17, 47, 128 };
	uint64_t seed = 8000;

	for (size_t d = 0; d < sizeof head_dims / sizeof head_dims[0]; d++) {
		zc_block_shape shape = make_shape(2, 3, 64, head_dims[d]);
		zc_codec_config config = make_config(6, 1, 0.25, 9, true);

		verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_SMALL_INTEGERS, seed++);
		verify_generated(&config, ZC_TENSOR_KEYS, &shape, DATA_PERMUTED_ROWS, seed++);
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* Numerical edge cases                                                */
/* ------------------------------------------------------------------ */

/*
 * A channel constant over a group has range 0, scale 1e-8, which fp16
 * rounds to 0: the stored scale is 0, every code is 0 and reconstruction
 * returns the constant exactly, even for ±65504 and subnormals.
 */
START_TEST(test_constant_channels)
{
	static const uint16_t constants[] = { 0x7bff, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x3c00,
					      0xc500, 0x1234 };
	const uint32_t tokens = 40, head_dim = 8;
	uint16_t input[40 * 8];
	random_state generator = random_seeded(9000);
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	/* Channel c is the constant constants[c] in every token, except
	 * channel 7 which varies, so the tokens have different norms. */
	for (uint32_t t = 0; t < tokens; t++)
		for (uint32_t c = 0; c < head_dim; c++)
			input[t * head_dim + c] = c == 7
				? half_from_double(random_normal(&generator)) : constants[c];
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		zc_codec_config config = make_config(8, 1, 0.3, 16, true);
		zc_block_shape shape = make_shape(1, 1, tokens, head_dim);
		expected_layout layout = expected_block_layout(&config, (zc_tensor)tensor, &shape);

		for (size_t i = 0; i < isa_count; i++) {
			uint8_t compressed[4096];
			uint16_t output[40 * 8];
			zc_strides strides = { tokens * head_dim, tokens * head_dim, head_dim };

			use_isa(isas[i]);
			ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input,
							   compressed, sizeof compressed),
					 (int64_t)layout.total_bytes);
			/* Every group's scale and min for the constant channels. */
			for (uint64_t g = 0; g < layout.groups_hi + layout.groups_lo; g++) {
				const uint8_t *params = compressed + layout.hi_params_offset
					+ g * 4 * head_dim;

				for (uint32_t c = 0; c < 7; c++) {
					ck_assert_uint_eq(load_le16(params + 2 * c), 0);
					ck_assert_uint_eq(load_le16(params + 2 * (head_dim + c)),
							  constants[c]);
				}
			}
			/* Codes of the constant channels are 0. */
			for (uint64_t r = 0; r < layout.n_hi; r++)
				for (uint32_t c = 0; c < 7; c++)
					ck_assert_uint_eq(get_code(compressed + layout.hi_codes_offset,
								   (r * head_dim + c) * 8, 8), 0);
			for (uint64_t r = 0; r < layout.n_lo; r++)
				for (uint32_t c = 0; c < 7; c++)
					ck_assert_uint_eq(get_code(compressed + layout.lo_codes_offset,
								   (r * head_dim + c) * 1, 1), 0);
			ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape,
							      compressed, layout.total_bytes,
							      output, &strides), 0);
			for (uint32_t t = 0; t < tokens; t++)
				for (uint32_t c = 0; c < 7; c++)
					ck_assert_uint_eq(output[t * head_dim + c], constants[c]);
		}
		verify_block(&config, (zc_tensor)tensor, &shape, input, "constant channels");
	}
}
END_TEST

/* Returns true if any of n halves is Inf or NaN. */
static bool any_nonfinite_half(const uint16_t *halves, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		if ((halves[i] & 0x7c00u) == 0x7c00u)
			return true;
	return false;
}

/*
 * ±65504 next to subnormals, at every bit width: ranges up to 131008,
 * scales from 0 to 65504, reconstructions that overshoot 65504 and must
 * saturate instead of becoming Inf.
 */
START_TEST(test_extremes_stay_finite)
{
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);
	zc_block_shape shape = make_shape(1, 2, 45, 33);
	uint64_t elements = 2 * 45 * 33;

	for (int bits = 1; bits <= 8; bits++) {
		zc_codec_config config = make_config(bits, bits, 0.4, 4, true);
		uint16_t *input = make_input(DATA_EXTREMES, 2, 45, 33, 9100u + bits);
		expected_layout layout = expected_block_layout(&config, ZC_TENSOR_KEYS, &shape);
		uint8_t *compressed = malloc(layout.total_bytes);
		uint16_t *output = malloc(elements * sizeof *output);
		zc_strides strides = { 2 * 45 * 33, 45 * 33, 33 };
		char label[64];

		ck_assert_ptr_nonnull(compressed);
		ck_assert_ptr_nonnull(output);
		for (size_t i = 0; i < isa_count; i++) {
			use_isa(isas[i]);
			ck_assert_int_eq(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input,
							   compressed, layout.total_bytes),
					 (int64_t)layout.total_bytes);
			ck_assert_int_eq(zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape,
							      compressed, layout.total_bytes,
							      output, &strides), 0);
			ck_assert_msg(!any_nonfinite_half(output, elements),
				      "extremes, %d bits [%s]: Inf or NaN in the reconstruction",
				      bits, zc_isa_name(isas[i]));
		}
		snprintf(label, sizeof label, "extremes %d bits", bits);
		verify_block(&config, ZC_TENSOR_KEYS, &shape, input, label);
		free(input);
		free(compressed);
		free(output);
	}
}
END_TEST

/*
 * A channel holding exactly -65504 and 65504 at 2 bits: scale 131008 / 3
 * = 43669.33, fp16 43680 (quantum 32), codes 0 and 3; 3 * 43680 - 65504 =
 * 65536 overshoots and must saturate to 65504 (0x7bff), not become Inf.
 */
START_TEST(test_saturation_to_largest_half)
{
	zc_codec_config config = make_config(2, 2, 0.5, 32, true);
	const uint16_t input[] = { 0xfbff, 0x7bff };
	const uint8_t expected[] = { 0x03, 0x55, 0x79, 0xff, 0xfb, 0x0c };
	const uint16_t expected_output[] = { 0xfbff, 0x7bff };

	/* 43680 = 1.3330078125 * 2^15: exponent 30 (0x7800), mantissa 341
	 * (0x155): 0x7955. Codes 0 | 3 << 2 = 0x0c. */
	check_hand_case(&config, ZC_TENSOR_VALUES, 2, 1, input, expected, sizeof expected,
			expected_output, "saturation at 2 bits");
}
END_TEST

/*
 * At 1 bit a group channel whose range exceeds 65519.99 (possible only
 * with both signs) has scale = range, which fp16 would round to Inf; the
 * contract saturates the stored scale at 65504 instead (docs/CODEC.md).
 * The reconstruction must then be finite, identical on every ISA, and
 * inside the group's own [min, max]: quantization never leaves the data's
 * range. (The byte-exact comparison with the reference covers the rest.)
 */
START_TEST(test_overflowing_scale)
{
	zc_codec_config config = make_config(1, 1, 1.0, 32, true);
	/* Channel 0: -65504, 65504, 0. Channel 1: -100, 65504, 300. */
	const uint16_t input[] = { 0xfbff, 0xd640, 0x7bff, 0x7bff, 0x0000, 0x5cb0 };
	const float minimum[2] = { -65504.0f, -100.0f }, maximum[2] = { 65504.0f, 65504.0f };
	zc_block_shape shape = make_shape(1, 1, 3, 2);
	zc_strides strides = { 6, 6, 2 };
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);
	uint16_t first[6];

	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		for (size_t i = 0; i < isa_count; i++) {
			uint8_t compressed[64];
			uint16_t output[6];
			int64_t written;

			use_isa(isas[i]);
			written = zc_block_compress(&config, (zc_tensor)tensor, &shape, input,
						    compressed, sizeof compressed);
			ck_assert_int_gt(written, 0);
			ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape,
							      compressed, (size_t)written, output,
							      &strides), 0);
			for (int e = 0; e < 6; e++) {
				float y = reference_half_to_float(output[e]);

				ck_assert_msg(isfinite(y) && y >= minimum[e % 2]
					      && y <= maximum[e % 2],
					      "%s, 1 bit [%s]: token %d channel %d input 0x%04x "
					      "(%g) reconstructed 0x%04x (%g), outside the group's "
					      "[%g, %g]", tensor ? "values" : "keys",
					      zc_isa_name(isas[i]), e / 2, e % 2, input[e],
					      (double)reference_half_to_float(input[e]), output[e],
					      (double)y, (double)minimum[e % 2],
					      (double)maximum[e % 2]);
			}
			if (i == 0)
				memcpy(first, output, sizeof first);
			else
				ck_assert_msg(memcmp(first, output, sizeof first) == 0,
					      "[%s] differs from [%s]", zc_isa_name(isas[i]),
					      zc_isa_name(isas[0]));
		}
	}
}
END_TEST

/*
 * When a group's minimum is zero and the group holds both +0 and -0,
 * which one is stored is not fixed by the contract (they compare equal),
 * but every ISA must store the same one, and the reconstruction must equal
 * the reference's numerically (+0 == -0).
 */
START_TEST(test_signed_zero)
{
	const uint32_t tokens = 33, head_dim = 19;
	uint16_t input[33 * 19];
	random_state generator = random_seeded(9200);
	zc_codec_config config = make_config(3, 2, 0.5, 4, true);
	zc_block_shape shape = make_shape(1, 1, tokens, head_dim);
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	for (uint32_t i = 0; i < tokens * head_dim; i++) {
		uint32_t pick = random_below(&generator, 4);

		input[i] = pick == 0 ? 0x0000 : pick == 1 ? 0x8000
			: pick == 2 ? 0x3c00 : 0x4000;
	}
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		expected_layout layout = expected_block_layout(&config, (zc_tensor)tensor, &shape);
		uint8_t first[8192], compressed[8192];
		uint16_t first_output[33 * 19], output[33 * 19], expected[33 * 19];
		zc_strides strides = { tokens * head_dim, tokens * head_dim, head_dim };

		reference_compress_block(&config, (zc_tensor)tensor, &layout, input, first, NULL);
		reference_reconstruct_block(&config, &layout, first, expected);
		for (size_t i = 0; i < isa_count; i++) {
			use_isa(isas[i]);
			ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input,
							   compressed, sizeof compressed),
					 (int64_t)layout.total_bytes);
			ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape,
							      compressed, layout.total_bytes,
							      output, &strides), 0);
			for (uint32_t e = 0; e < tokens * head_dim; e++)
				REQUIRE(reference_half_to_float(output[e])
					== reference_half_to_float(expected[e]),
					"signed zero [%s]: element %u input 0x%04x expected 0x%04x "
					"got 0x%04x", zc_isa_name(isas[i]), e, input[e],
					expected[e], output[e]);
			if (i == 0) {
				memcpy(first, compressed, layout.total_bytes);
				memcpy(first_output, output, sizeof output);
				continue;
			}
			assert_same_bytes(&layout, first, compressed, "signed zero vs first ISA",
					  zc_isa_name(isas[i]));
			assert_same_halves(&layout, input, first_output, output,
					   "signed zero vs first ISA", zc_isa_name(isas[i]));
		}
	}
}
END_TEST

/*
 * The error bound (element_error_bound) on many kinds of data and widths;
 * verify_block asserts it for every element.
 */
START_TEST(test_error_bound)
{
	uint64_t seed = 9300;

	for (int kind = 0; kind < DATA_KIND_COUNT; kind++) {
		for (int bits = 1; bits <= 8; bits += 1) {
			zc_codec_config config = make_config(bits, bits > 1 ? bits - 1 : 1, 0.25,
							     1 + bits * 3, true);
			zc_block_shape shape = make_shape(1, 1, 50, 40);

			verify_generated(&config, ZC_TENSOR_KEYS, &shape, (data_kind)kind, seed++);
			verify_generated(&config, ZC_TENSOR_VALUES, &shape, (data_kind)kind, seed++);
		}
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* NaN and Inf                                                         */
/* ------------------------------------------------------------------ */

START_TEST(test_nonfinite_rejected)
{
	static const uint16_t bad_values[] = { 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe00, 0xffff };
	const uint32_t tokens = 9, head_dim = 20;
	zc_block_shape shape = make_shape(2, 2, tokens, head_dim);
	const uint64_t elements = 4ull * tokens * head_dim;
	const uint64_t positions[] = { 0, 1, 37, elements / 2, elements - head_dim,
				       elements - 1 };
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);
	uint16_t *clean = make_input(DATA_GAUSSIAN, 4, tokens, head_dim, 9400);
	uint16_t input[4 * 9 * 20];
	uint8_t out[8192], untouched[8192];

	memset(untouched, 0xa5, sizeof untouched);
	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		for (int mode = 0; mode < 3; mode++) {
			zc_tensor tensor = mode == 0 ? ZC_TENSOR_KEYS : ZC_TENSOR_VALUES;
			zc_codec_config config = make_config(4, 2, 0.2, 4, mode != 2);

			for (size_t p = 0; p < sizeof positions / sizeof positions[0]; p++) {
				for (size_t b = 0; b < sizeof bad_values / sizeof bad_values[0];
				     b++) {
					int64_t result;

					memcpy(input, clean, sizeof input);
					input[positions[p]] = bad_values[b];
					memset(out, 0xa5, sizeof out);
					result = zc_block_compress(&config, tensor, &shape, input,
								   out, sizeof out);
					ck_assert_msg(result == ZC_ENONFINITE,
						      "[%s] mode %d: 0x%04x at %llu: got %lld",
						      zc_isa_name(isas[i]), mode, bad_values[b],
						      (unsigned long long)positions[p],
						      (long long)result);
					size_t written = first_difference(out, untouched,
									  sizeof out);

					REQUIRE(written == sizeof out,
						"[%s] mode %d: 0x%04x at %llu: output byte %zu "
						"written", zc_isa_name(isas[i]), mode,
						bad_values[b], (unsigned long long)positions[p],
						written);
				}
			}
		}
	}
	free(clean);
}
END_TEST

START_TEST(test_check_finite)
{
	uint16_t values[67];
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		for (size_t n = 0; n <= 67; n++) {
			for (size_t v = 0; v < 67; v++)
				values[v] = (uint16_t)(0x7bff - v); /* finite */
			ck_assert_int_eq(zc_fp16_check_finite(values, n), 0);
			if (n == 0)
				continue;
			values[n - 1] = 0x7c00;
			ck_assert_int_eq(zc_fp16_check_finite(values, n), ZC_ENONFINITE);
			values[n - 1] = 0xfe01;
			ck_assert_int_eq(zc_fp16_check_finite(values, n), ZC_ENONFINITE);
			values[n - 1] = 0x7bff;
			values[0] = 0xfc00;
			ck_assert_int_eq(zc_fp16_check_finite(values, n), ZC_ENONFINITE);
			/* A bad element past n must not be looked at. */
			values[0] = 0x0000;
			if (n < 67) {
				values[n] = 0x7e00;
				ck_assert_int_eq(zc_fp16_check_finite(values, n), 0);
			}
		}
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* Reconstruction targets                                              */
/* ------------------------------------------------------------------ */

/*
 * Reconstruct into a [B][H][max_tokens][token_stride] view at token offset
 * 7, as a session view holds it; everything outside the written window
 * must keep its sentinel.
 */
static void check_strided(zc_tensor tensor, const zc_codec_config *config, uint32_t token_padding)
{
	const uint32_t batch = 2, heads = 3, tokens = 21, head_dim = 24, max_tokens = 40;
	const uint32_t token_offset = 7, token_stride = head_dim + token_padding;
	const uint16_t sentinel = 0xdead;
	zc_block_shape shape = make_shape(batch, heads, tokens, head_dim);
	expected_layout layout = expected_block_layout(config, tensor, &shape);
	uint64_t elements = (uint64_t)batch * heads * tokens * head_dim;
	size_t view_elements = (size_t)batch * heads * max_tokens * token_stride;
	uint16_t *input = make_input(DATA_OUTLIER_CHANNELS, batch * heads, tokens, head_dim, 9500);
	uint8_t *compressed = malloc(layout.total_bytes);
	uint16_t *expected = malloc(elements * sizeof *expected);
	uint16_t *view = malloc(view_elements * sizeof *view);
	zc_strides strides = { (size_t)heads * max_tokens * token_stride,
			       (size_t)max_tokens * token_stride, token_stride };
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	ck_assert_ptr_nonnull(compressed);
	ck_assert_ptr_nonnull(expected);
	ck_assert_ptr_nonnull(view);
	reference_compress_block(config, tensor, &layout, input, compressed, NULL);
	reference_reconstruct_block(config, &layout, compressed, expected);
	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		ck_assert_int_eq(zc_block_compress(config, tensor, &shape, input, compressed,
						   layout.total_bytes), (int64_t)layout.total_bytes);
		for (size_t v = 0; v < view_elements; v++)
			view[v] = sentinel;
		ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape, compressed,
						      layout.total_bytes,
						      view + (size_t)token_offset * token_stride,
						      &strides), 0);
		for (size_t v = 0; v < view_elements; v++) {
			uint32_t channel = (uint32_t)(v % token_stride);
			uint32_t token = (uint32_t)(v / token_stride % max_tokens);
			uint32_t head = (uint32_t)(v / token_stride / max_tokens);
			bool written = channel < head_dim && token >= token_offset
				&& token < token_offset + tokens;
			uint16_t want = written
				? expected[((uint64_t)head * tokens + token - token_offset)
					   * head_dim + channel]
				: sentinel;

			REQUIRE(view[v] == want, "strided [%s] padding %u: head %u token %u "
				      "channel %u expected 0x%04x got 0x%04x", zc_isa_name(isas[i]),
				      token_padding, head, token, channel, want, view[v]);
		}
	}
	free(input);
	free(compressed);
	free(expected);
	free(view);
}

START_TEST(test_strided_reconstruction)
{
	zc_codec_config config;

	zc_codec_config_default(&config);
	check_strided(ZC_TENSOR_KEYS, &config, 0);
	check_strided(ZC_TENSOR_VALUES, &config, 0);
	check_strided(ZC_TENSOR_KEYS, &config, 3);
	config.quantize_values = false;
	check_strided(ZC_TENSOR_VALUES, &config, 0);
	check_strided(ZC_TENSOR_VALUES, &config, 5);
}
END_TEST

/* The SIMD kernel tables this CPU runs, both AVX-512 ones included (only
 * the VBMI one is picked here otherwise), for codec_kernels_override. */
static size_t simd_tables(const struct codec_kernels **tables)
{
	size_t n = 0;
	if (zc_codec_set_isa(ZC_ISA_AVX2) == 0)
		tables[n++] = &codec_kernels_avx2;
	if (zc_codec_set_isa(ZC_ISA_AVX512) == 0) {
		tables[n++] = &codec_kernels_avx512;
		__builtin_cpu_init();
		if (__builtin_cpu_supports("avx512vbmi"))
			tables[n++] = &codec_kernels_avx512_vbmi;
	}
	return n;
}

/*
 * Views written by the kernels' fast paths, into the session's [S][H][D]
 * view, each head's row padded to a cache line (so a D like 100 streams
 * with a partial last vector), the view one element off a line (shift 1)
 * or on one (shift 0), touching nothing else (the padding included), by
 * every kernel table this CPU runs (both AVX-512 ones: the VBMI one is
 * otherwise the only one picked here):
 * - zc_block_reconstruct of 512 KiB or more goes through non-temporal
 *   stores where rows start on cache lines (codec/block.c);
 * - zc_block_compress_view writes the reconstruction in the encode's pass
 *   where rows are whole bytes, else from the payload; by plain stores,
 *   and by non-temporal ones where rows start on cache lines and the
 *   block is 512 KiB or more (codec_views_stream: both are tried).
 * Either must give exactly the scalar kernels' reconstruction of the
 * bytes zc_block_compress gives.
 */
static void check_view_writes(const zc_codec_config *config, zc_tensor tensor, uint32_t tokens,
			      uint32_t head_dim, data_kind kind, uint64_t seed, bool fused)
{
	const uint32_t heads = 2, slack = 32; /* slack: one cache line of halves */
	const uint16_t sentinel = 0xdead;
	zc_block_shape shape = make_shape(1, heads, tokens, head_dim);
	expected_layout layout = expected_block_layout(config, tensor, &shape);
	size_t elements = (size_t)heads * tokens * head_dim;
	size_t padded = (head_dim + 31u) / 32u * 32u; /* a head's row, in halves */
	size_t view_elements = (size_t)heads * tokens * padded + 2 * slack;
	uint16_t *input = make_input(kind, heads, tokens, head_dim, seed);
	uint8_t *compressed = malloc(layout.total_bytes + 1);
	uint8_t *bytes = malloc(layout.total_bytes + 1);
	uint16_t *expected = malloc(elements * sizeof *expected);
	/* C11: the size a multiple of the alignment. */
	uint16_t *view = aligned_alloc(64, (view_elements * sizeof *view + 63) & ~(size_t)63);
	zc_strides contiguous = { elements, (size_t)tokens * head_dim, head_dim };
	zc_strides interleaved = { (size_t)heads * tokens * padded, padded, heads * padded };
	const struct codec_kernels *tables[3];
	size_t n_tables;

	ck_assert_ptr_nonnull(compressed);
	ck_assert_ptr_nonnull(bytes);
	ck_assert_ptr_nonnull(expected);
	ck_assert_ptr_nonnull(view);
	n_tables = simd_tables(tables);
	use_isa(ZC_ISA_SCALAR);
	ck_assert_int_eq(zc_block_compress(config, tensor, &shape, input, compressed,
					   layout.total_bytes), (int64_t)layout.total_bytes);
	ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape, compressed,
					      layout.total_bytes, expected, &contiguous), 0);
	for (size_t k = 0; k < 2 * n_tables; k++) {
		if (!fused && k % 2)
			continue;   /* reconstruct's streams are its own */
		codec_kernels_override(tables[k / 2]);
		codec_views_stream_override((int)(k % 2));
		for (uint32_t shift = 0; shift < 2; shift++) {
			uint16_t *out = view + slack + shift;
			for (size_t v = 0; v < view_elements; v++)
				view[v] = sentinel;
			if (fused) {
				bytes[layout.total_bytes] = 0xa5;
				ck_assert_int_eq(zc_block_compress_view(config, tensor, &shape, input,
									&contiguous, NULL, bytes,
									layout.total_bytes + 1, out,
									&interleaved),
						 (int64_t)layout.total_bytes);
				REQUIRE(memcmp(bytes, compressed, layout.total_bytes) == 0 &&
						bytes[layout.total_bytes] == 0xa5,
					"compress_view [%s, %s stores]: bytes differ from "
					"zc_block_compress", tables[k / 2]->name,
					k % 2 ? "streamed" : "plain");
			} else {
				ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape,
								      compressed,
								      layout.total_bytes, out,
								      &interleaved), 0);
			}
			for (size_t v = 0; v < view_elements; v++) {
				size_t at = v - slack - shift;
				size_t token = at / (heads * padded);
				size_t head = at / padded % heads, channel = at % padded;
				bool written = v >= slack + shift && token < tokens &&
					       channel < head_dim;
				uint16_t want = written ?
					expected[(head * tokens + token) * head_dim + channel] :
					sentinel;
				REQUIRE(view[v] == want,
					"%s [%s, %s stores] hi %d lo %d S %u D %u shift %u: token %zu "
					"head %zu channel %zu expected 0x%04x got 0x%04x",
					fused ? "compress_view" : "streamed", tables[k / 2]->name,
					k % 2 ? "streamed" : "plain",
					config->hi_bits, config->lo_bits, tokens, head_dim, shift,
					token, head, channel, want, view[v]);
			}
		}
	}
	codec_kernels_override(NULL);
	codec_views_stream_override(-1);
	free(input);
	free(compressed);
	free(bytes);
	free(expected);
	free(view);
}

/* Tokens whose two heads of D make at least the streaming size. */
static uint32_t streamed_tokens(uint32_t head_dim)
{
	return (uint32_t)((512u * 1024u + 4u * head_dim - 1u) / (4u * head_dim));
}

static const int view_widths[][2] = { { 4, 2 }, { 1, 1 }, { 2, 2 }, { 3, 3 }, { 4, 4 },
				      { 5, 5 }, { 6, 6 }, { 7, 7 }, { 8, 8 }, { 8, 3 } };
static const uint32_t view_head_dims[] = { 128, 96, 100, 256, 20 };

/* ZC_CODEC_VIEW_STORES picks the views' stores over the CPU's vendor;
 * an unknown value is ignored (the vendor's default stands) and said so
 * on stderr, a known one silently taken (which tells "plain" from an
 * ignored value where plain is the vendor's default). */
START_TEST(test_view_stores_choice)
{
	unsetenv("ZC_CODEC_VIEW_STORES");
	codec_views_stream_override(-1);
	bool vendor = codec_views_stream();
	static const struct {
		const char *value;
		int stream;   /* -1: unknown, the vendor's default */
	} cases[] = { { "stream", 1 }, { "plain", 0 }, { "", -2 }, { "fast", -1 }, { "Stream", -1 } };
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		FILE *said = tmpfile();
		ck_assert_ptr_nonnull(said);
		fflush(stderr);
		int saved = dup(STDERR_FILENO);
		ck_assert_int_ge(saved, 0);
		ck_assert_int_ge(dup2(fileno(said), STDERR_FILENO), 0);
		setenv("ZC_CODEC_VIEW_STORES", cases[i].value, 1);
		codec_views_stream_override(-1);
		bool stream = codec_views_stream();
		fflush(stderr);
		dup2(saved, STDERR_FILENO);
		close(saved);
		char text[256] = "";
		rewind(said);
		size_t got = fread(text, 1, sizeof text - 1, said);
		text[got] = '\0';
		fclose(said);
		/* -2: empty, as if unset: the default, nothing said. */
		bool want = cases[i].stream < 0 ? vendor : cases[i].stream == 1;
		REQUIRE(stream == want, "ZC_CODEC_VIEW_STORES=\"%s\": %s stores", cases[i].value,
			stream ? "streamed" : "plain");
		bool warned = strstr(text, "ignoring unknown ZC_CODEC_VIEW_STORES") != NULL;
		REQUIRE(warned == (cases[i].stream == -1), "ZC_CODEC_VIEW_STORES=\"%s\": stderr \"%s\"",
			cases[i].value, text);
	}
	unsetenv("ZC_CODEC_VIEW_STORES");
	codec_views_stream_override(-1);
}
END_TEST

START_TEST(test_streamed_reconstruction)
{
	zc_codec_config values;

	for (size_t w = 0; w < sizeof view_widths / sizeof view_widths[0]; w++) {
		zc_codec_config config = make_config(view_widths[w][0], view_widths[w][1], 0.2, 32,
						     true);
		for (size_t d = 0; d < sizeof view_head_dims / sizeof view_head_dims[0]; d++) {
			uint32_t dim = view_head_dims[d], tokens = streamed_tokens(dim);
			check_view_writes(&config, ZC_TENSOR_KEYS, tokens, dim,
					  DATA_OUTLIER_CHANNELS, 9700 + 10 * w + d, false);
			check_view_writes(&config, ZC_TENSOR_KEYS, tokens, dim, DATA_EXTREMES,
					  9800 + 10 * w + d, false);
		}
	}
	zc_codec_config_default(&values);
	check_view_writes(&values, ZC_TENSOR_VALUES, streamed_tokens(128), 128, DATA_GAUSSIAN,
			  9900, false);
}
END_TEST

/*
 * zc_block_compress_view, small blocks (plain stores) and streamed ones,
 * every width (odd ones with a D whose rows are not whole bytes take the
 * payload path), clamped groups, values quantized and exact; and a block
 * it refuses (NaN, or scores for values) writes neither bytes nor view.
 */
START_TEST(test_compress_view)
{
	static const uint32_t small_tokens[] = { 1, 45, 300 };
	zc_codec_config values, exact;

	for (size_t w = 0; w < sizeof view_widths / sizeof view_widths[0]; w++) {
		zc_codec_config config = make_config(view_widths[w][0], view_widths[w][1], 0.2, 32,
						     true);
		for (size_t d = 0; d < sizeof view_head_dims / sizeof view_head_dims[0]; d++) {
			uint32_t dim = view_head_dims[d];
			for (size_t t = 0; t < sizeof small_tokens / sizeof small_tokens[0]; t++)
				check_view_writes(&config, ZC_TENSOR_KEYS, small_tokens[t], dim,
						  t % 2 ? DATA_EXTREMES : DATA_OUTLIER_CHANNELS,
						  10100 + 10 * w + d, true);
			check_view_writes(&config, ZC_TENSOR_KEYS, streamed_tokens(dim), dim,
					  DATA_EXTREMES, 10300 + 10 * w + d, true);
		}
	}
	zc_codec_config_default(&values);
	check_view_writes(&values, ZC_TENSOR_VALUES, 300, 128, DATA_GAUSSIAN, 10400, true);
	/* Finite extremes (±65504, ±0, subnormals) are not refused. */
	check_view_writes(&values, ZC_TENSOR_VALUES, 300, 128, DATA_EXTREMES, 10407, true);
	check_view_writes(&values, ZC_TENSOR_VALUES, streamed_tokens(128), 128, DATA_GAUSSIAN,
			  10401, true);
	exact = values;
	exact.quantize_values = false;
	check_view_writes(&exact, ZC_TENSOR_VALUES, 77, 96, DATA_ANY_FINITE, 10402, true);
	/* One subset empty, the other's rows whole bytes where the empty
	 * one's would not be: values (no others), keys at fractions 1 and 0. */
	zc_codec_config wide_hi = make_config(8, 3, 1.0, 32, true);
	zc_codec_config wide_lo = make_config(3, 8, 0.0, 32, true);
	check_view_writes(&wide_hi, ZC_TENSOR_VALUES, 300, 100, DATA_GAUSSIAN, 10404, true);
	check_view_writes(&wide_hi, ZC_TENSOR_KEYS, 300, 100, DATA_EXTREMES, 10405, true);
	check_view_writes(&wide_lo, ZC_TENSOR_KEYS, 300, 100, DATA_EXTREMES, 10406, true);

	/* Refusals leave both outputs as they were. */
	zc_block_shape shape = make_shape(1, 2, 64, 128);
	expected_layout layout = expected_block_layout(&values, ZC_TENSOR_KEYS, &shape);
	size_t elements = 2u * 64 * 128;
	uint16_t *input = make_input(DATA_GAUSSIAN, 2, 64, 128, 10403);
	uint8_t *bytes = malloc(layout.total_bytes);
	uint16_t *view = malloc(elements * sizeof *view);
	float scores[128] = { 0 };
	zc_strides strides = { elements, 64u * 128, 128 };

	ck_assert_ptr_nonnull(bytes);
	ck_assert_ptr_nonnull(view);
	memset(bytes, 0x5a, layout.total_bytes);
	memset(view, 0x5a, elements * sizeof *view);
	input[elements - 1] = 0x7e00;
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_KEYS, &shape, input, &strides,
						NULL, bytes, layout.total_bytes, view, &strides),
			 ZC_ENONFINITE);
	input[elements - 1] = 0x3c00;
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_VALUES, &shape, input,
						&strides, scores, bytes, layout.total_bytes, view,
						&strides),
			 ZC_EINVALID);
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_KEYS, &shape, input, &strides,
						NULL, bytes, layout.total_bytes, NULL, &strides),
			 ZC_EINVALID);
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_KEYS, &shape, input, &strides,
						NULL, bytes, layout.total_bytes - 1, view, &strides),
			 ZC_EBUFFER);
	zc_strides gapped = { elements, 64u * 128, 129 };
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_KEYS, &shape, input, &gapped,
						NULL, bytes, layout.total_bytes, view, &strides),
			 ZC_ESHAPE);
	scores[77] = -1.0f;
	ck_assert_int_eq(zc_block_compress_view(&values, ZC_TENSOR_KEYS, &shape, input, &strides,
						scores, bytes, layout.total_bytes, view, &strides),
			 ZC_EINVALID);
	for (size_t i = 0; i < layout.total_bytes; i++)
		REQUIRE(bytes[i] == 0x5a, "refused compress_view wrote byte %zu", i);
	for (size_t i = 0; i < elements; i++)
		REQUIRE(view[i] == 0x5a5a, "refused compress_view wrote view element %zu", i);
	free(input);
	free(bytes);
	free(view);
}
END_TEST

/*
 * zc_block_compress_view with the caller's saliency scores, two batch
 * entries, heads that are not back to back in the input (the first 300
 * of 310 tokens) and a padded view: the bytes of
 * zc_block_compress_scored_strided and the scalar kernels' reconstruction
 * of them, on every kernel table.
 */
START_TEST(test_compress_view_scored)
{
	const uint32_t batch = 2, heads = 2, tokens = 300, room = 310, dim = 128, padded = 160;
	zc_codec_config config;
	zc_block_shape shape = make_shape(batch, heads, tokens, dim);
	zc_codec_config_default(&config);
	expected_layout layout = expected_block_layout(&config, ZC_TENSOR_KEYS, &shape);
	size_t elements = (size_t)batch * heads * tokens * dim;
	size_t view_elements = (size_t)batch * heads * tokens * padded;
	uint16_t *input = make_input(DATA_OUTLIER_CHANNELS, batch * heads, room, dim, 10500);
	float *scores = malloc((size_t)batch * heads * tokens * sizeof *scores);
	uint8_t *compressed = malloc(layout.total_bytes), *bytes = malloc(layout.total_bytes);
	uint16_t *expected = malloc(elements * sizeof *expected);
	uint16_t *view = malloc(view_elements * sizeof *view);
	zc_strides input_strides = { (size_t)heads * room * dim, (size_t)room * dim, dim };
	zc_strides contiguous = { (size_t)heads * tokens * dim, (size_t)tokens * dim, dim };
	zc_strides view_strides = { (size_t)heads * tokens * padded, (size_t)tokens * padded,
				    padded };
	const struct codec_kernels *tables[4] = { &codec_kernels_scalar };
	size_t n_tables;
	random_state generator = random_seeded(10501);

	ck_assert_ptr_nonnull(scores);
	ck_assert_ptr_nonnull(compressed);
	ck_assert_ptr_nonnull(bytes);
	ck_assert_ptr_nonnull(expected);
	ck_assert_ptr_nonnull(view);
	for (size_t i = 0; i < (size_t)batch * heads * tokens; i++)
		scores[i] = (float)random_unit(&generator);
	n_tables = 1 + simd_tables(tables + 1);
	use_isa(ZC_ISA_SCALAR);
	ck_assert_int_eq(zc_block_compress_scored_strided(&config, &shape, input, &input_strides,
							  scores, compressed, layout.total_bytes),
			 (int64_t)layout.total_bytes);
	ck_assert_int_eq(zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape, compressed,
					      layout.total_bytes, expected, &contiguous), 0);
	for (size_t k = 0; k < n_tables; k++) {
		codec_kernels_override(tables[k]);
		for (size_t v = 0; v < view_elements; v++)
			view[v] = 0xdead;
		ck_assert_int_eq(zc_block_compress_view(&config, ZC_TENSOR_KEYS, &shape, input,
							&input_strides, scores, bytes,
							layout.total_bytes, view, &view_strides),
				 (int64_t)layout.total_bytes);
		REQUIRE(memcmp(bytes, compressed, layout.total_bytes) == 0,
			"compress_view scored [%s]: bytes differ", tables[k]->name);
		for (size_t v = 0; v < view_elements; v++) {
			size_t channel = v % padded, row = v / padded; /* row: (b*H + h)*S + t */
			uint16_t want = channel < dim ? expected[row * dim + channel] : 0xdead;
			REQUIRE(view[v] == want,
				"compress_view scored [%s]: row %zu channel %zu expected 0x%04x "
				"got 0x%04x", tables[k]->name, row, channel, want, view[v]);
		}
	}
	codec_kernels_override(NULL);
	free(input);
	free(scores);
	free(compressed);
	free(bytes);
	free(expected);
	free(view);
}
END_TEST

/*
 * NaN and Inf in values given to zc_block_compress_view: refused wherever
 * they are (the first group, the last row of a group or the first of the
 * next, the last partial group, a partial channel pass, a second pass of
 * channels, a second head), by every table and width. Where the encode
 * does the whole head, it finds them on the way and may have written the
 * groups before; elsewhere (tables without a packing encode, rows not
 * whole bytes, exact values) and for keys (the norms are the check)
 * nothing is written.
 */
static void check_view_refuses(const zc_codec_config *config, zc_tensor tensor, uint32_t tokens,
			       uint32_t dim, const struct codec_kernels *table, bool may_write)
{
	/* Both ends of both NaN ranges, both infinities. */
	static const uint16_t bad_values[] = { 0x7c00, 0xfc00, 0x7e00, 0xfe00,
					       0x7c01, 0xffff, 0x7fff, 0xfc01 };
	const uint32_t heads = 2;
	zc_block_shape shape = make_shape(1, heads, tokens, dim);
	zc_block_layout layout;
	ck_assert_int_eq(zc_block_layout_compute(config, tensor, &shape, &layout), 0);
	size_t elements = (size_t)heads * tokens * dim;
	/* Token (past the end: the last), channel and head of the bad
	 * element. */
	const size_t spots[][3] = {
		{ 0, 0, 0 }, { 31, dim - 1, 0 }, { 32, 0, 0 }, { tokens / 2, dim / 2, 0 },
		{ 299, dim - 1, 0 }, { 290, 5, 0 }, { 0, 0, 1 }, { 64, dim - 1, 1 },
		{ 299, 0, 1 },
	};
	uint16_t *input = make_input(DATA_GAUSSIAN, heads, tokens, dim, 10600);
	uint8_t *bytes = malloc(layout.total_bytes), *clean = malloc(layout.total_bytes);
	uint16_t *view = malloc(elements * sizeof *view);
	uint16_t *clean_view = malloc(elements * sizeof *view);
	zc_strides strides = { elements, (size_t)tokens * dim, dim };

	ck_assert_ptr_nonnull(bytes);
	ck_assert_ptr_nonnull(clean);
	ck_assert_ptr_nonnull(view);
	ck_assert_ptr_nonnull(clean_view);
	codec_kernels_override(table);
	ck_assert_int_eq(zc_block_compress_view(config, tensor, &shape, input, &strides, NULL,
						clean, layout.total_bytes, clean_view, &strides),
			 (int64_t)layout.total_bytes);
	for (size_t p = 0; p < sizeof spots / sizeof spots[0]; p++) {
		size_t token = spots[p][0] < tokens ? spots[p][0] : tokens - 1;
		for (size_t b = 0; b < sizeof bad_values / sizeof bad_values[0]; b++) {
			size_t at = spots[p][2] * tokens * dim + token * dim + spots[p][1];
			uint16_t was = input[at];
			input[at] = bad_values[b];
			memset(bytes, 0x5a, layout.total_bytes);
			memset(view, 0x5a, elements * sizeof *view);
			int64_t rc = zc_block_compress_view(config, tensor, &shape, input, &strides,
							    NULL, bytes, layout.total_bytes, view,
							    &strides);
			input[at] = was;
			REQUIRE(rc == ZC_ENONFINITE,
				"compress_view [%s] %s D %u bits %d/%d: 0x%04x at token %zu "
				"channel %zu head %zu gave %lld", table->name,
				tensor == ZC_TENSOR_KEYS ? "keys" : "values", dim, config->hi_bits,
				config->lo_bits, bad_values[b], token, spots[p][1],
				spots[p][2], (long long)rc);
			/* A head before the bad one is as a finite block makes it. */
			if (may_write && spots[p][2] == 1) {
				REQUIRE(memcmp(bytes, clean, layout.head_bytes) == 0,
					"compress_view [%s] D %u: head 0 differs", table->name, dim);
				REQUIRE(memcmp(view, clean_view, (size_t)tokens * dim * 2) == 0,
					"compress_view [%s] D %u: view of head 0 differs",
					table->name, dim);
			}
			for (size_t i = 0; !may_write && i < layout.total_bytes; i++)
				REQUIRE(bytes[i] == 0x5a, "compress_view [%s] D %u: refused, wrote "
					"byte %zu", table->name, dim, i);
			for (size_t i = 0; !may_write && i < elements; i++)
				REQUIRE(view[i] == 0x5a5a, "compress_view [%s] D %u: refused, wrote "
					"view element %zu", table->name, dim, i);
		}
	}
	/* The same block, finite, still goes through, to the same bytes. */
	ck_assert_int_eq(zc_block_compress_view(config, tensor, &shape, input, &strides, NULL,
						bytes, layout.total_bytes, view, &strides),
			 (int64_t)layout.total_bytes);
	REQUIRE(memcmp(bytes, clean, layout.total_bytes) == 0 &&
		memcmp(view, clean_view, elements * 2) == 0,
		"compress_view [%s] D %u: the finite block changed after refusals", table->name,
		dim);
	codec_kernels_override(NULL);
	free(input);
	free(bytes);
	free(clean);
	free(view);
	free(clean_view);
}

START_TEST(test_compress_view_nonfinite)
{
	/* Value widths (hi_bits) and dims: whole-byte rows of one pass, a
	 * partial pass, two passes; 3 bits at D 100 is not whole bytes, 6 is
	 * a partial pass of even width without a fixed store, 1 an odd
	 * width of whole bytes at 128 and 256. */
	static const int widths[] = { 4, 2, 8, 3, 6, 1 };
	/* A last group of one row, fewer tokens than a group, one token. */
	static const uint32_t short_tokens[] = { 289, 20, 1 };
	static const uint32_t dims[] = { 128, 100, 256 };
	const struct codec_kernels *tables[4] = { &codec_kernels_scalar };
	size_t n_tables = 1 + simd_tables(tables + 1);
	zc_codec_config keys;
	zc_codec_config_default(&keys);

	for (size_t k = 0; k < n_tables; k++) {
		for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
			zc_codec_config values = make_config(widths[w], 2, 0.2, 32, true);
			for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
				bool whole = dims[d] * (uint32_t)widths[w] % 8 == 0;
				check_view_refuses(&values, ZC_TENSOR_VALUES, 300, dims[d],
						   tables[k], tables[k]->group_encode && whole);
			}
		}
		for (size_t t = 0; t < sizeof short_tokens / sizeof short_tokens[0]; t++)
			check_view_refuses(&keys, ZC_TENSOR_VALUES, short_tokens[t], 128, tables[k],
					   tables[k]->group_encode != NULL);
		check_view_refuses(&keys, ZC_TENSOR_KEYS, 300, 128, tables[k], false);
		zc_codec_config exact = keys;
		exact.quantize_values = false;
		check_view_refuses(&exact, ZC_TENSOR_VALUES, 300, 128, tables[k], false);
	}
}
END_TEST

/*
 * quantize_values = false: the payload is the input's fp16 bytes (2*S*D
 * per head) and reconstruction gives back every bit, including -0,
 * subnormals and ±65504. Keys are still quantized.
 */
START_TEST(test_exact_values)
{
	zc_codec_config config = make_config(4, 2, 0.2, 32, false);
	zc_block_shape shape = make_shape(2, 2, 17, 33);
	uint64_t elements = 4ull * 17 * 33;
	uint16_t *input = make_input(DATA_ANY_FINITE, 4, 17, 33, 9600);
	uint8_t *compressed = malloc(2 * elements);
	uint16_t *output = malloc(elements * sizeof *output);
	zc_strides strides = { 2 * 17 * 33, 17 * 33, 33 };
	zc_block_layout layout;
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	ck_assert_ptr_nonnull(compressed);
	ck_assert_ptr_nonnull(output);
	input[5] = 0x8000;
	input[6] = 0x0001;
	input[7] = 0xfbff;
	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_VALUES, &shape, &layout), 0);
	ck_assert(layout.exact);
	ck_assert_uint_eq(layout.head_bytes, 2 * 17 * 33);
	ck_assert_uint_eq(layout.total_bytes, 2 * elements);
	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_KEYS, &shape, &layout), 0);
	ck_assert(!layout.exact);
	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		ck_assert_int_eq(zc_block_compress(&config, ZC_TENSOR_VALUES, &shape, input,
						   compressed, 2 * elements), (int64_t)(2 * elements));
		for (uint64_t e = 0; e < elements; e++)
			REQUIRE(load_le16(compressed + 2 * e) == input[e],
				      "exact values [%s]: element %llu stored 0x%04x, input 0x%04x",
				      zc_isa_name(isas[i]), (unsigned long long)e,
				      load_le16(compressed + 2 * e), input[e]);
		memset(output, 0, elements * sizeof *output);
		ck_assert_int_eq(zc_block_reconstruct(&config, ZC_TENSOR_VALUES, &shape, compressed,
						      2 * elements, output, &strides), 0);
		ck_assert_msg(memcmp(output, input, elements * sizeof *output) == 0,
			      "exact values [%s]: reconstruction differs at element %zu",
			      zc_isa_name(isas[i]),
			      first_difference((const uint8_t *)input, (const uint8_t *)output,
					       elements * sizeof *output) / 2);
	}
	free(input);
	free(compressed);
	free(output);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Every ISA gives the same bytes                                      */
/* ------------------------------------------------------------------ */

/*
 * Random shapes (D often not a multiple of 16, odd group sizes), configs
 * and data kinds: each ISA's compressed bytes and reconstruction equal the
 * scalar kernels' and the reference's.
 */
START_TEST(test_isas_identical)
{
	static const uint32_t head_dims[] = { 1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 48, 63, 64, 65,
					      80, 96, 100, 127, 128, 129, 200, 256 };
	random_state generator = random_seeded(10000);
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	for (int round = 0; round < 300; round++) {
		uint32_t head_dim = head_dims[random_below(&generator, sizeof head_dims
							   / sizeof head_dims[0])];
		uint32_t tokens = 1 + random_below(&generator, head_dim > 64 ? 70 : 150);
		zc_block_shape shape = make_shape(1 + random_below(&generator, 2),
						  1 + random_below(&generator, 3), tokens, head_dim);
		zc_codec_config config = make_config(1 + (int)random_below(&generator, 8),
						     1 + (int)random_below(&generator, 8),
						     random_unit(&generator),
						     1 + 2 * (int)random_below(&generator, 20),
						     random_below(&generator, 4) != 0);
		zc_tensor tensor = random_below(&generator, 3) ? ZC_TENSOR_KEYS : ZC_TENSOR_VALUES;
		data_kind kind = (data_kind)random_below(&generator, DATA_KIND_COUNT);
		expected_layout layout = expected_block_layout(&config, tensor, &shape);
		uint64_t elements = layout.heads * tokens * head_dim;
		uint16_t *input = make_input(kind, layout.heads, tokens, head_dim,
					     10000u + (uint64_t)round);
		uint8_t *scalar_bytes = malloc(layout.total_bytes);
		uint8_t *bytes = malloc(layout.total_bytes);
		uint16_t *scalar_output = malloc(elements * sizeof *scalar_output);
		uint16_t *output = malloc(elements * sizeof *output);
		zc_strides strides = { (size_t)shape.heads * tokens * head_dim,
				       (size_t)tokens * head_dim, head_dim };
		char label[96];

		ck_assert_ptr_nonnull(scalar_bytes);
		ck_assert_ptr_nonnull(bytes);
		ck_assert_ptr_nonnull(scalar_output);
		ck_assert_ptr_nonnull(output);
		snprintf(label, sizeof label, "round %d", round);
		use_isa(ZC_ISA_SCALAR);
		ck_assert_int_eq(zc_block_compress(&config, tensor, &shape, input, scalar_bytes,
						   layout.total_bytes), (int64_t)layout.total_bytes);
		ck_assert_int_eq(zc_block_reconstruct(&config, tensor, &shape, scalar_bytes,
						      layout.total_bytes, scalar_output, &strides), 0);
		for (size_t i = 0; i < isa_count; i++) {
			if (isas[i] == ZC_ISA_SCALAR)
				continue;
			use_isa(isas[i]);
			ck_assert_int_eq(zc_block_compress(&config, tensor, &shape, input, bytes,
							   layout.total_bytes),
					 (int64_t)layout.total_bytes);
			assert_same_bytes(&layout, scalar_bytes, bytes, label, zc_isa_name(isas[i]));
			ck_assert_int_eq(zc_block_reconstruct(&config, tensor, &shape, bytes,
							      layout.total_bytes, output, &strides),
					 0);
			assert_same_halves(&layout, input, scalar_output, output, label,
					   zc_isa_name(isas[i]));
			/* Bytes from this ISA, reconstructed by the scalar
			 * kernels, give the same halves too. */
			use_isa(ZC_ISA_SCALAR);
			ck_assert_int_eq(zc_block_reconstruct(&config, tensor, &shape, bytes,
							      layout.total_bytes, output, &strides),
					 0);
			assert_same_halves(&layout, input, scalar_output, output, label, "scalar");
		}
		verify_block(&config, tensor, &shape, input, label);
		free(input);
		free(scalar_bytes);
		free(bytes);
		free(scalar_output);
		free(output);
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* Layout, accounting, validation                                      */
/* ------------------------------------------------------------------ */

START_TEST(test_config_default)
{
	zc_codec_config config;

	memset(&config, 0xff, sizeof config);
	zc_codec_config_default(&config);
	ck_assert_int_eq(config.hi_bits, 4);
	ck_assert_int_eq(config.lo_bits, 2);
	ck_assert_double_eq(config.hi_fraction, 0.20);
	ck_assert_int_eq(config.group_size, 32);
	ck_assert(config.quantize_values);
	ck_assert_int_eq(zc_codec_config_validate(&config), 0);
}
END_TEST

/*
 * Every entry point that takes a config must refuse a bad one with the same
 * code. Values use hi_bits and group_size; whether they also reject a bad
 * lo_bits or hi_fraction (which they ignore) is not part of the contract,
 * so only keys are checked for those.
 */
static void assert_config_rejected(const zc_codec_config *config, int code, bool values_too,
				   const char *what)
{
	zc_block_shape shape = make_shape(1, 1, 4, 4);
	uint16_t input[16] = { 0 };
	uint8_t out[1024];
	uint16_t output[16];
	zc_strides strides = { 16, 16, 4 };
	zc_block_layout layout;
	zc_byte_count count;

	ck_assert_msg(zc_codec_config_validate(config) == code, "%s: validate gave %d, want %d",
		      what, zc_codec_config_validate(config), code);
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		if (tensor == ZC_TENSOR_VALUES && !values_too)
			continue;
		ck_assert_int_eq(zc_block_layout_compute(config, (zc_tensor)tensor, &shape,
							 &layout), code);
		ck_assert_int_eq(zc_block_count_bytes(config, (zc_tensor)tensor, &shape, &count),
				 code);
		ck_assert_int_eq(zc_block_compress(config, (zc_tensor)tensor, &shape, input, out,
						   sizeof out), code);
		ck_assert_int_eq(zc_block_reconstruct(config, (zc_tensor)tensor, &shape, out, 64,
						      output, &strides), code);
	}
}

START_TEST(test_config_validation)
{
	zc_codec_config config;
	static const int bad_bits[] = { 0, 9, -1, 16 };
	static const double bad_fractions[] = { -0.1, 1.1, -1e-300, 1.0000000000000002 };

	for (size_t i = 0; i < sizeof bad_bits / sizeof bad_bits[0]; i++) {
		zc_codec_config_default(&config);
		config.hi_bits = bad_bits[i];
		assert_config_rejected(&config, ZC_EBITS, true, "hi_bits");
		zc_codec_config_default(&config);
		config.lo_bits = bad_bits[i];
		ck_assert_int_eq(zc_codec_config_validate(&config), ZC_EBITS);
		assert_config_rejected(&config, ZC_EBITS, false, "lo_bits");
	}
	for (size_t i = 0; i < sizeof bad_fractions / sizeof bad_fractions[0]; i++) {
		zc_codec_config_default(&config);
		config.hi_fraction = bad_fractions[i];
		assert_config_rejected(&config, ZC_EFRACTION, false, "hi_fraction");
	}
	zc_codec_config_default(&config);
	config.hi_fraction = NAN;
	assert_config_rejected(&config, ZC_EFRACTION, false, "hi_fraction NaN");
	config.hi_fraction = INFINITY;
	assert_config_rejected(&config, ZC_EFRACTION, false, "hi_fraction Inf");
	zc_codec_config_default(&config);
	config.group_size = 0;
	assert_config_rejected(&config, ZC_EGROUPSIZE, true, "group_size 0");
	config.group_size = -5;
	assert_config_rejected(&config, ZC_EGROUPSIZE, true, "group_size -5");

	/* The edges are valid. */
	for (int bits = 1; bits <= 8; bits++) {
		config = make_config(bits, 9 - bits, bits % 2 ? 0.0 : 1.0, 1, bits % 2);
		ck_assert_int_eq(zc_codec_config_validate(&config), 0);
	}
}
END_TEST

START_TEST(test_salient_tokens)
{
	zc_codec_config config;
	random_state generator = random_seeded(11000);

	zc_codec_config_default(&config);
	/* 35 * 0.2 rounds to exactly 7.0 in double (0.2 is 0.2000000000000000111,
	 * the product's excess is under half an ulp of 7), so ceil gives 7. */
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 35), 7);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 5), 1);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 1), 1);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 0), 0);
	/* 10 * 0.2 = 2 exactly. */
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 10), 2);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_VALUES, 35), 35);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_VALUES, 0), 0);
	/* 100 * 0.07 is 7.000000000000001 in double: ceil gives 8, not the 7
	 * a decimal calculation would. */
	config.hi_fraction = 0.07;
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 100), 8);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_VALUES, 100), 100);
	config.hi_fraction = 0.0;
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 4096), 0);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_VALUES, 4096), 4096);
	config.hi_fraction = 1.0;
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 4096), 4096);
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, ZC_MAX_BLOCK_TOKENS),
			  ZC_MAX_BLOCK_TOKENS);
	config.hi_fraction = 1e-300;
	ck_assert_uint_eq(zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, 3), 1);

	for (int i = 0; i < 100000; i++) {
		uint32_t tokens = random_below(&generator, i % 2 ? 100 : ZC_MAX_BLOCK_TOKENS + 1);

		/* Fractions with few decimal digits are where a float
		 * product lands just above an integer. */
		config.hi_fraction = i % 3 ? (double)random_below(&generator, 1001) / 1000.0
			: random_unit(&generator);
		uint32_t want = reference_salient_count(config.hi_fraction, tokens);
		uint32_t got = zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, tokens);

		REQUIRE(got == want, "S=%u fraction=%.17g: got %u, want %u", tokens,
			      config.hi_fraction, got, want);
	}

	/* Through compression: S = 100 at 0.07 marks 8 tokens in the mask,
	 * and S = 35 at 0.2 marks 7. */
	zc_block_shape shape = make_shape(1, 1, 100, 8);
	uint16_t *input = make_input(DATA_GAUSSIAN, 1, 100, 8, 11001);
	uint8_t out[4096];
	int marked = 0;

	config = make_config(4, 2, 0.07, 32, true);
	ck_assert_int_gt(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input, out,
					   sizeof out), 0);
	for (int t = 0; t < 100; t++)
		marked += (out[t / 8] >> (t % 8)) & 1;
	ck_assert_int_eq(marked, 8);
	ck_assert_uint_eq(out[12] >> 4, 0); /* bits past S stay 0 */
	zc_codec_config_default(&config);
	shape.tokens = 35;
	ck_assert_int_gt(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input, out,
					   sizeof out), 0);
	marked = 0;
	for (int t = 0; t < 35; t++)
		marked += (out[t / 8] >> (t % 8)) & 1;
	ck_assert_int_eq(marked, 7);
	ck_assert_uint_eq(out[4] >> 3, 0);
	free(input);
}
END_TEST

/* Layout and accounting against the formulas over a grid of parameters. */
START_TEST(test_layout_and_accounting)
{
	static const uint32_t token_counts[] = { 0, 1, 7, 8, 9, 31, 32, 33, 35, 100, 4096 };
	static const uint32_t head_dims[] = { 1, 3, 64, 80, 96, 128, 256, 576, 4096 };
	static const int group_sizes[] = { 1, 7, 32, 33 };
	static const double fractions[] = { 0.0, 0.2, 0.5, 1.0 };

	for (int hi = 1; hi <= 8; hi++)
	for (int lo = 1; lo <= 8; lo += (hi == 4 ? 1 : 3))
	for (size_t s = 0; s < sizeof token_counts / sizeof token_counts[0]; s++)
	for (size_t d = 0; d < sizeof head_dims / sizeof head_dims[0]; d++)
	for (size_t g = 0; g < sizeof group_sizes / sizeof group_sizes[0]; g++)
	for (size_t f = 0; f < sizeof fractions / sizeof fractions[0]; f++)
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++)
	for (int quantize = 0; quantize <= 1; quantize++) {
		zc_codec_config config = make_config(hi, lo, fractions[f], group_sizes[g],
						     quantize);
		zc_block_shape shape = make_shape(1 + (uint32_t)(s % 3), 1 + (uint32_t)(d % 2),
						  token_counts[s], head_dims[d]);
		expected_layout expected = expected_block_layout(&config, (zc_tensor)tensor,
								 &shape);

		assert_layout_matches(&config, (zc_tensor)tensor, &shape, &expected, "grid");
	}

	/* The largest accepted block: sizes well past 32 bits. */
	zc_codec_config config = make_config(8, 8, 0.5, 1, true);
	zc_block_shape shape = make_shape(3, 5, ZC_MAX_BLOCK_TOKENS, ZC_MAX_HEAD_DIM);
	expected_layout expected = expected_block_layout(&config, ZC_TENSOR_KEYS, &shape);

	assert_layout_matches(&config, ZC_TENSOR_KEYS, &shape, &expected, "largest block");

	/* Hand-computed: default config, B=1 H=1 S=100 D=128 keys.
	 * n_hi = 20, n_lo = 80; groups 1 and 3; codes 20*128*4/8 = 1280
	 * and 80*128*2/8 = 2560; params 4*128*4 = 2048; mask 13: 5901.
	 * Baseline 100*128*2/8 + 4*128*4 = 3200 + 2048 = 5248; fp16 25600. */
	zc_codec_config_default(&config);
	shape = make_shape(1, 1, 100, 128);
	zc_byte_count count;

	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_KEYS, &shape, &count), 0);
	ck_assert_uint_eq(count.compressed, 5901);
	ck_assert_uint_eq(count.baseline, 5248);
	ck_assert_uint_eq(count.fp16, 25600);
	/* Values: 100*128*4/8 = 6400, params 4*128*4 = 2048, mask 13: 8461. */
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_VALUES, &shape, &count), 0);
	ck_assert_uint_eq(count.compressed, 8461);
	ck_assert_uint_eq(count.baseline, 5248);
	ck_assert_uint_eq(count.fp16, 25600);
	config.quantize_values = false;
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_VALUES, &shape, &count), 0);
	ck_assert_uint_eq(count.compressed, 25600);
	ck_assert_uint_eq(count.fp16, 25600);
}
END_TEST

START_TEST(test_shape_validation)
{
	zc_codec_config config;
	static const zc_block_shape bad_shapes[] = {
		{ 0, 1, 4, 4 }, { 1, 0, 4, 4 }, { 1, 1, 4, 0 },
		{ 1, 1, 4, ZC_MAX_HEAD_DIM + 1 }, { 1, 1, ZC_MAX_BLOCK_TOKENS + 1, 4 },
	};
	uint16_t input[64] = { 0 };
	uint8_t out[1024];
	uint16_t output[64];
	zc_strides strides = { 16, 16, 4 };
	zc_block_layout layout;
	zc_byte_count count;

	zc_codec_config_default(&config);
	for (size_t i = 0; i < sizeof bad_shapes / sizeof bad_shapes[0]; i++) {
		for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
			ck_assert_int_eq(zc_block_layout_compute(&config, (zc_tensor)tensor,
								 &bad_shapes[i], &layout),
					 ZC_ESHAPE);
			ck_assert_int_eq(zc_block_count_bytes(&config, (zc_tensor)tensor,
							      &bad_shapes[i], &count), ZC_ESHAPE);
			ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor,
							   &bad_shapes[i], input, out, sizeof out),
					 ZC_ESHAPE);
			ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor,
							      &bad_shapes[i], out, 0, output,
							      &strides), ZC_ESHAPE);
		}
	}

	/* An unknown tensor kind. */
	zc_block_shape shape = make_shape(1, 1, 4, 4);

	ck_assert_int_eq(zc_block_layout_compute(&config, (zc_tensor)2, &shape, &layout),
			 ZC_ETENSOR);
	ck_assert_int_eq(zc_block_count_bytes(&config, (zc_tensor)2, &shape, &count), ZC_ETENSOR);
	ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)2, &shape, input, out, sizeof out),
			 ZC_ETENSOR);
	ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)-1, &shape, input, out, sizeof out),
			 ZC_ETENSOR);
}
END_TEST

START_TEST(test_buffer_sizes)
{
	zc_codec_config config;
	zc_block_shape shape = make_shape(2, 2, 33, 20);
	uint16_t *input = make_input(DATA_GAUSSIAN, 4, 33, 20, 12000);
	zc_strides strides = { 2 * 33 * 20, 33 * 20, 20 };
	uint16_t output[4 * 33 * 20];

	zc_codec_config_default(&config);
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		expected_layout layout = expected_block_layout(&config, (zc_tensor)tensor, &shape);
		size_t total = (size_t)layout.total_bytes;
		uint8_t *out = malloc(total + 64);

		ck_assert_ptr_nonnull(out);
		ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input, out,
						   total - 1), ZC_EBUFFER);
		ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input, out,
						   0), ZC_EBUFFER);
		/* A larger buffer is fine, and nothing past total is written. */
		memset(out, 0x77, total + 64);
		ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input, out,
						   total + 64), (int64_t)total);
		for (size_t b = total; b < total + 64; b++)
			ck_assert_uint_eq(out[b], 0x77);

		for (int delta = -1; delta <= 1; delta += 2) {
			for (size_t e = 0; e < sizeof output / sizeof output[0]; e++)
				output[e] = 0xbeef;
			ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape,
							      out, total + (size_t)delta, output,
							      &strides), ZC_ECORRUPT);
		}
		ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape, out, 0,
						      output, &strides), ZC_ECORRUPT);
		ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape, out,
						      total, output, &strides), 0);
		free(out);
	}
	free(input);
}
END_TEST

/* S = 0 is a valid, empty block of zero bytes. */
START_TEST(test_empty_block)
{
	zc_codec_config config;
	zc_block_shape shape = make_shape(2, 3, 0, 64);
	uint16_t input[1] = { 0x7e00 }; /* never read */
	uint8_t out[16];
	uint16_t output[4] = { 0x1111, 0x1111, 0x1111, 0x1111 };
	zc_strides strides = { 0, 0, 64 };
	zc_byte_count count;

	zc_codec_config_default(&config);
	for (int tensor = ZC_TENSOR_KEYS; tensor <= ZC_TENSOR_VALUES; tensor++) {
		memset(out, 0x33, sizeof out);
		ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input, out,
						   sizeof out), 0);
		ck_assert_int_eq(zc_block_compress(&config, (zc_tensor)tensor, &shape, input, out,
						   0), 0);
		for (size_t b = 0; b < sizeof out; b++)
			ck_assert_uint_eq(out[b], 0x33);
		ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape, out, 0,
						      output, &strides), 0);
		ck_assert_int_eq(zc_block_reconstruct(&config, (zc_tensor)tensor, &shape, out, 1,
						      output, &strides), ZC_ECORRUPT);
		for (size_t e = 0; e < 4; e++)
			ck_assert_uint_eq(output[e], 0x1111);
		ck_assert_int_eq(zc_block_count_bytes(&config, (zc_tensor)tensor, &shape, &count),
				 0);
		ck_assert_uint_eq(count.compressed, 0);
		ck_assert_uint_eq(count.baseline, 0);
		ck_assert_uint_eq(count.fp16, 0);
	}
}
END_TEST

START_TEST(test_error_strings)
{
	static const struct {
		int code;
		const char *name;
	} codes[] = {
		{ ZC_EBITS, "ZC_EBITS" },
		{ ZC_EFRACTION, "ZC_EFRACTION" },
		{ ZC_EGROUPSIZE, "ZC_EGROUPSIZE" },
		{ ZC_ESHAPE, "ZC_ESHAPE" },
		{ ZC_ENONFINITE, "ZC_ENONFINITE" },
		{ ZC_EBUFFER, "ZC_EBUFFER" },
		{ ZC_ECORRUPT, "ZC_ECORRUPT" },
		{ ZC_ETENSOR, "ZC_ETENSOR" },
		{ ZC_EPROTOCOL, "ZC_EPROTOCOL" },
		{ ZC_EFRAMESIZE, "ZC_EFRAMESIZE" },
		{ ZC_ENOTFOUND, "ZC_ENOTFOUND" },
		{ ZC_EEXISTS, "ZC_EEXISTS" },
		{ ZC_EEXHAUSTED, "ZC_EEXHAUSTED" },
		{ ZC_EDENIED, "ZC_EDENIED" },
		{ ZC_EPRECONDITION, "ZC_EPRECONDITION" },
		{ ZC_EINTERNAL, "ZC_EINTERNAL" },
		{ ZC_EINVALID, "ZC_EINVALID" },
		{ ZC_ERESTARTED, "ZC_ERESTARTED" },
		{ ZC_EBROKEN, "ZC_EBROKEN" },
		{ ZC_ESTALE, "ZC_ESTALE" },
		{ ZC_EAGAIN, "ZC_EAGAIN" },
		{ ZC_EDEVICE, "ZC_EDEVICE" },
		{ ZC_EREMOTE, "ZC_EREMOTE" },
	};
	size_t count = sizeof codes / sizeof codes[0];

	/* The table covers every code the header defines. */
	ck_assert_int_eq((int)count, ZC_ERROR_BASE - ZC_ERROR_LAST - 1);
	for (size_t i = 0; i < count; i++) {
		const char *text = zc_strerror(codes[i].code);

		ck_assert_ptr_nonnull(text);
		ck_assert_msg(text[0] != '\0', "%s has an empty message", codes[i].name);
		ck_assert_str_eq(zc_error_name(codes[i].code), codes[i].name);
		for (size_t j = 0; j < i; j++)
			ck_assert_msg(strcmp(text, zc_strerror(codes[j].code)) != 0,
				      "%s and %s share the message \"%s\"", codes[i].name,
				      codes[j].name, text);
	}
	/* Errno codes and unknown codes still get some text. */
	ck_assert_ptr_nonnull(zc_strerror(-ENOMEM));
	ck_assert_str_ne(zc_strerror(-ENOMEM), "");
	ck_assert_str_eq(zc_error_name(-ENOMEM), "ENOMEM");
	ck_assert_ptr_nonnull(zc_strerror(ZC_ERROR_LAST));
	ck_assert_ptr_nonnull(zc_strerror(-123456));
	ck_assert_ptr_nonnull(zc_error_name(-123456));
	ck_assert_ptr_nonnull(zc_strerror(0));
}
END_TEST

/* ------------------------------------------------------------------ */
/* ISA selection                                                       */
/* ------------------------------------------------------------------ */

static bool cpu_has_avx2_kernels(void)
{
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
		&& __builtin_cpu_supports("bmi2");
}

static bool cpu_has_avx512_kernels(void)
{
	__builtin_cpu_init();
	return cpu_has_avx2_kernels() && __builtin_cpu_supports("avx512f")
		&& __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
		&& __builtin_cpu_supports("avx512dq");
}

START_TEST(test_isa_selection)
{
	const char *names[ISA_COUNT];

	ck_assert_int_eq(zc_codec_set_isa(ZC_ISA_SCALAR), 0);
	ck_assert_int_eq(zc_codec_isa(), ZC_ISA_SCALAR);
	if (cpu_has_avx2_kernels()) {
		ck_assert_int_eq(zc_codec_set_isa(ZC_ISA_AVX2), 0);
		ck_assert_int_eq(zc_codec_isa(), ZC_ISA_AVX2);
	}
	if (cpu_has_avx512_kernels()) {
		ck_assert_int_eq(zc_codec_set_isa(ZC_ISA_AVX512), 0);
		ck_assert_int_eq(zc_codec_isa(), ZC_ISA_AVX512);
	}
	for (size_t i = 0; i < ISA_COUNT; i++) {
		int status = zc_codec_set_isa(every_isa[i]);

		ck_assert_msg(status == 0 || status == -ENOTSUP, "set_isa(%d) gave %d",
			      (int)every_isa[i], status);
		names[i] = zc_isa_name(every_isa[i]);
		ck_assert_ptr_nonnull(names[i]);
		ck_assert_str_ne(names[i], "");
		for (size_t j = 0; j < i; j++)
			ck_assert_str_ne(names[i], names[j]);
	}
}
END_TEST

static char test_program[4096];

/* Runs this program in --print-isa mode under `environment`, returns the ISA. */
static int isa_chosen_with(const char *environment)
{
	char command[4500];
	int isa = -1;
	FILE *pipe;

	snprintf(command, sizeof command, "env -u ZC_CODEC_ISA %s '%s' --print-isa",
		 environment, test_program);
	pipe = popen(command, "r");
	ck_assert_ptr_nonnull(pipe);
	ck_assert_int_eq(fscanf(pipe, "%d", &isa), 1);
	ck_assert_int_eq(pclose(pipe), 0);
	return isa;
}

START_TEST(test_isa_environment)
{
	int best = cpu_has_avx512_kernels() ? ZC_ISA_AVX512
		: cpu_has_avx2_kernels() ? ZC_ISA_AVX2 : ZC_ISA_SCALAR;

	ck_assert_int_gt(readlink("/proc/self/exe", test_program, sizeof test_program - 1), 0);
	ck_assert_int_eq(isa_chosen_with(""), best);
	ck_assert_int_eq(isa_chosen_with("ZC_CODEC_ISA=scalar"), ZC_ISA_SCALAR);
	if (cpu_has_avx2_kernels())
		ck_assert_int_eq(isa_chosen_with("ZC_CODEC_ISA=avx2"), ZC_ISA_AVX2);
	if (cpu_has_avx512_kernels())
		ck_assert_int_eq(isa_chosen_with("ZC_CODEC_ISA=avx512"), ZC_ISA_AVX512);
}
END_TEST

/* ------------------------------------------------------------------ */
/* fp16 conversions                                                    */
/* ------------------------------------------------------------------ */

START_TEST(test_half_to_float_exhaustive)
{
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		for (uint32_t half = 0; half <= 0xffff; half++) {
			float want = reference_half_to_float((uint16_t)half);
			float got = zc_fp16_to_float((uint16_t)half);
			bool same = half_is_nan((uint16_t)half)
				? isnan(got) && !signbit(got) == !(half & 0x8000u)
				: float_bits(got) == float_bits(want);

			REQUIRE(same, "[%s] zc_fp16_to_float(0x%04x) = %a (0x%08x), want %a",
				      zc_isa_name(isas[i]), half, (double)got, float_bits(got),
				      (double)want);
		}
	}
}
END_TEST

/* Every half survives half -> float -> half; NaN stays NaN. */
START_TEST(test_half_round_trip)
{
	for (uint32_t half = 0; half <= 0xffff; half++) {
		uint16_t back = zc_float_to_fp16(zc_fp16_to_float((uint16_t)half));

		if (half_is_nan((uint16_t)half))
			REQUIRE(half_is_nan(back) && (back & 0x8000u) == (half & 0x8000u),
				      "NaN 0x%04x came back as 0x%04x", half, back);
		else
			REQUIRE(back == half, "0x%04x came back as 0x%04x", half, back);
	}
}
END_TEST

START_TEST(test_float_to_half_boundaries)
{
	static const struct {
		float value;
		uint16_t half;
		const char *why;
	} cases[] = {
		{ 0.0f, 0x0000, "zero" },
		{ -0.0f, 0x8000, "negative zero keeps its sign" },
		{ 1.0f, 0x3c00, "one" },
		{ 65504.0f, 0x7bff, "largest half" },
		{ 65519.996f, 0x7bff, "just under the 65520 midpoint rounds down" },
		{ 65520.0f, 0x7c00, "the midpoint to 65536 ties to even: Inf" },
		{ -65520.0f, 0xfc00, "same, negative" },
		{ 1e30f, 0x7c00, "overflow is Inf" },
		{ INFINITY, 0x7c00, "Inf" },
		{ -INFINITY, 0xfc00, "-Inf" },
		{ 0x1.0p-24f, 0x0001, "smallest subnormal" },
		{ 0x1.0p-25f, 0x0000, "half the smallest subnormal ties to 0" },
		{ 0x1.000002p-25f, 0x0001, "just above it rounds up" },
		{ 0x1.fffffep-26f, 0x0000, "just below it rounds down" },
		{ 0x1.8p-24f, 0x0002, "1.5 subnormal quanta tie to even 2" },
		{ 0x1.4p-23f, 0x0002, "2.5 subnormal quanta tie to even 2" },
		{ -0x1.0p-25f, 0x8000, "negative tie to zero keeps the sign" },
		{ 1e-8f, 0x0000, "the codec's scale floor stores as 0" },
		{ FLT_MIN, 0x0000, "smallest float normal" },
		{ 0x1.0p-149f, 0x0000, "smallest float subnormal" },
		{ 0x1.ffcp-15f, 0x0400, "largest-subnormal/smallest-normal tie goes to even" },
		{ 0x1.ff8p-15f, 0x03ff, "largest subnormal" },
		{ 0x1.0p-14f, 0x0400, "smallest normal" },
		{ 1.0009765625f, 0x3c01, "one ulp above one" },
		{ 1.00048828125f, 0x3c00, "tie above one goes to even 0x3c00" },
		{ 1.00146484375f, 0x3c02, "tie above 0x3c01 goes to even 0x3c02" },
		{ 2048.0f, 0x6800, "integers are exact up to 2048" },
		{ 2049.0f, 0x6800, "2049 ties to even 2048" },
		{ 2051.0f, 0x6802, "2051 ties to even 2052" },
		{ 0.1f, 0x2e66, "0.1" },
		{ -2.0f, 0xc000, "negative" },
	};

	ck_assert_float_eq(65519.996f, nextafterf(65520.0f, 0.0f));
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		uint16_t got = zc_float_to_fp16(cases[i].value);

		ck_assert_msg(got == cases[i].half, "%s: zc_float_to_fp16(%a) = 0x%04x, want 0x%04x",
			      cases[i].why, (double)cases[i].value, got, cases[i].half);
		ck_assert_msg(reference_float_to_half(cases[i].value) == cases[i].half,
			      "reference: %s", cases[i].why);
	}
	ck_assert(half_is_nan(zc_float_to_fp16(NAN)));
	ck_assert(half_is_nan(zc_float_to_fp16(-NAN)));
	ck_assert_uint_eq(zc_float_to_fp16(-NAN) & 0x8000u, 0x8000u);
	/* A NaN whose payload sits only in the low 13 bits must not become Inf. */
	ck_assert(half_is_nan(zc_float_to_fp16(float_from_bits(0x7f800001u))));
	ck_assert(half_is_nan(zc_float_to_fp16(float_from_bits(0xff800fffu))));
	ck_assert(half_is_nan(zc_float_to_fp16(float_from_bits(0x7fc00000u))));
}
END_TEST

/*
 * Every midpoint between adjacent finite halves (exact in fp32: 12
 * significant bits), and its float neighbours on both sides, both signs.
 */
START_TEST(test_float_to_half_ties)
{
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);

	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		for (uint32_t half = 0; half < 0x7c00; half++) {
			float lower = reference_half_to_float((uint16_t)half);
			/* Above 0x7bff the "next" value is 65536, where Inf starts. */
			float upper = half == 0x7bff ? 65536.0f
				: reference_half_to_float((uint16_t)(half + 1));
			float middle = lower + (upper - lower) / 2;
			uint16_t even = (half & 1u) ? (uint16_t)(half + 1) : (uint16_t)half;

			for (int sign = 0; sign < 2; sign++) {
				float direction = sign ? -1.0f : 1.0f;
				uint16_t sign_bit = sign ? 0x8000u : 0;
				struct {
					float value;
					uint16_t want;
				} probes[3] = {
					{ direction * middle, (uint16_t)(sign_bit | even) },
					{ direction * nextafterf(middle, 0.0f),
					  (uint16_t)(sign_bit | half) },
					{ direction * nextafterf(middle, INFINITY),
					  (uint16_t)(sign_bit | (half + 1)) },
				};

				for (int p = 0; p < 3; p++) {
					uint16_t got = zc_float_to_fp16(probes[p].value);

					if (got == probes[p].want)
						continue;
					ck_abort_msg("[%s] zc_float_to_fp16(%a) = 0x%04x, want "
						      "0x%04x", zc_isa_name(isas[i]),
						      (double)probes[p].value, got, probes[p].want);
				}
			}
		}
	}
}
END_TEST

/*
 * Millions of floats: random bit patterns (every exponent, NaNs, huge and
 * tiny) and values spread over the half range and just outside it.
 */
START_TEST(test_float_to_half_random)
{
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);
	const int samples = 3000000;

	for (size_t i = 0; i < isa_count; i++) {
		random_state generator = random_seeded(13000);

		use_isa(isas[i]);
		for (int n = 0; n < samples; n++) {
			uint64_t bits = random_next(&generator);
			float value;

			if (n % 2)
				value = float_from_bits((uint32_t)bits);
			else /* exponents -27..16, any mantissa, either sign */
				value = float_from_bits((uint32_t)(bits & 0x807fffffu)
							| ((uint32_t)(100 + (bits >> 32) % 44)
							   << 23));
			uint16_t got = zc_float_to_fp16(value);
			uint16_t want = reference_float_to_half(value);
			bool same = isnan(value)
				? half_is_nan(got) && (got & 0x8000u) == (want & 0x8000u)
				: got == want;

			if (same)
				continue;
			ck_abort_msg("[%s] zc_float_to_fp16(%a) (bits 0x%08x) = 0x%04x, want 0x%04x",
				      zc_isa_name(isas[i]), (double)value, float_bits(value), got,
				      want);
		}
	}
}
END_TEST

/* ------------------------------------------------------------------ */
/* Runner                                                              */
/* ------------------------------------------------------------------ */

static TCase *make_tcase(const char *name, double timeout_seconds)
{
	TCase *tcase = tcase_create(name);

	/* Generous for ASan builds; the -O2 suite takes a few seconds. */
	tcase_set_timeout(tcase, timeout_seconds);
	return tcase;
}

static Suite *fp16_suite(void)
{
	Suite *suite = suite_create("fp16");
	TCase *tcase = make_tcase("conversions", 120);

	tcase_add_test(tcase, test_half_to_float_exhaustive);
	tcase_add_test(tcase, test_half_round_trip);
	tcase_add_test(tcase, test_float_to_half_boundaries);
	tcase_add_test(tcase, test_float_to_half_ties);
	tcase_add_test(tcase, test_float_to_half_random);
	tcase_add_test(tcase, test_check_finite);
	suite_add_tcase(suite, tcase);
	return suite;
}

static Suite *api_suite(void)
{
	Suite *suite = suite_create("api");
	TCase *config = make_tcase("config", 60);
	TCase *layout = make_tcase("layout", 120);
	TCase *isa = make_tcase("isa", 60);

	tcase_add_test(config, test_config_default);
	tcase_add_test(config, test_config_validation);
	tcase_add_test(config, test_salient_tokens);
	tcase_add_test(config, test_error_strings);
	suite_add_tcase(suite, config);
	tcase_add_test(layout, test_layout_and_accounting);
	tcase_add_test(layout, test_shape_validation);
	tcase_add_test(layout, test_buffer_sizes);
	tcase_add_test(layout, test_empty_block);
	suite_add_tcase(suite, layout);
	tcase_add_test(isa, test_isa_selection);
	tcase_add_test(isa, test_isa_environment);
	suite_add_tcase(suite, isa);
	return suite;
}

/*
 * zc_block_compress_scored: the caller's scores choose the salient keys.
 * Scores that rank like the norms give the very payload zc_block_compress
 * writes; scores rising with the token index make the last n_hi tokens
 * salient; -0.0 counts as 0 (its bits would otherwise sort above every
 * positive score); a score that is NaN, negative or infinite is refused
 * with ZC_EINVALID before a byte is written; the payload reconstructs, on
 * every ISA alike.
 */
START_TEST(test_scored_saliency)
{
	enum { B = 1, H = 2, S = 80, D = 16 };
	zc_codec_config config = make_config(4, 2, 0.2, 32, true);
	zc_block_shape shape = make_shape(B, H, S, D);
	random_state generator = random_seeded(29);
	static uint16_t keys[B * H * S * D];
	static float norms[B * H * S], rising[B * H * S], bad[B * H * S];
	static uint8_t plain[8192], scored[8192], first[8192];
	zc_isa isas[ISA_COUNT];
	size_t isa_count = supported_isas(isas);
	uint32_t n_hi = zc_codec_salient_tokens(&config, ZC_TENSOR_KEYS, S);
	zc_block_layout layout;

	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_KEYS, &shape, &layout), 0);
	for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
		keys[i] = zc_float_to_fp16((float)random_normal(&generator));
	for (size_t h = 0; h < B * H; h++)
		for (size_t t = 0; t < S; t++) {
			double sum = 0;
			for (size_t c = 0; c < D; c++) {
				double x = zc_fp16_to_float(keys[(h * S + t) * D + c]);
				sum += x * x;
			}
			norms[h * S + t] = (float)sum; /* squared: the same order */
			rising[h * S + t] = (float)t;
		}
	for (size_t i = 0; i < isa_count; i++) {
		use_isa(isas[i]);
		int64_t n = zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, keys, plain, sizeof plain);
		ck_assert_int_eq(n, (int64_t)layout.total_bytes);
		ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, norms, scored,
							  sizeof scored), n);
		ck_assert_mem_eq(plain, scored, (size_t)n);

		ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, rising, scored,
							  sizeof scored), n);
		for (size_t h = 0; h < B * H; h++) {
			const uint8_t *mask = scored + h * layout.head_bytes + layout.mask_offset;
			for (uint32_t t = 0; t < S; t++)
				ck_assert_uint_eq((mask[t >> 3] >> (t & 7)) & 1u, t >= S - n_hi);
		}
		static uint16_t back[B * H * S * D];
		zc_strides strides = { H * S * D, S * D, D };
		ck_assert_int_eq(zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape, scored,
						      (size_t)n, back, &strides), 0);
		if (i == 0)
			memcpy(first, scored, (size_t)n);
		else
			ck_assert_mem_eq(first, scored, (size_t)n);
	}

	/* -0.0 is 0: with every other score 0 too, ties go to later tokens. */
	memset(bad, 0, sizeof bad);
	bad[0] = -0.0f;
	ck_assert_int_gt(zc_block_compress_scored(&config, &shape, keys, bad, scored, sizeof scored), 0);
	ck_assert_uint_eq(scored[layout.mask_offset] & 1u, 0);

	const float refused[] = { NAN, -1.0f, INFINITY, -INFINITY };
	for (size_t r = 0; r < sizeof refused / sizeof refused[0]; r++) {
		memcpy(bad, rising, sizeof bad);
		bad[B * H * S - 1 - r] = refused[r];
		memset(scored, 0xab, sizeof scored);
		ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, bad, scored,
							  sizeof scored), ZC_EINVALID);
		for (size_t b = 0; b < sizeof scored; b++)
			ck_assert_uint_eq(scored[b], 0xab);
	}
	ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, NULL, scored, sizeof scored),
			 ZC_EINVALID);
	/* The keys are still checked: a NaN key is refused as by zc_block_compress. */
	uint16_t saved = keys[5];
	keys[5] = 0x7e00;
	ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, rising, scored, sizeof scored),
			 ZC_ENONFINITE);
	keys[5] = saved;
	ck_assert_int_eq(zc_block_compress_scored(&config, &shape, keys, rising, scored,
						  layout.total_bytes - 1), ZC_EBUFFER);
}
END_TEST

static Suite *numerics_suite(void)
{
	Suite *suite = suite_create("numerics");
	TCase *hand = make_tcase("hand-worked", 60);
	TCase *reference = make_tcase("reference", 300);
	TCase *edges = make_tcase("edges", 120);
	TCase *targets = make_tcase("targets", 60);
	TCase *isas = make_tcase("isas", 300);

	tcase_add_test(hand, test_hand_keys_tie_and_rounding);
	tcase_add_test(hand, test_hand_groups_cross_split);
	tcase_add_test(hand, test_hand_values_short_group);
	tcase_add_test(hand, test_hand_codes_round_half_even);
	tcase_add_test(hand, test_hand_subnormal_scale_clamps);
	tcase_add_test(hand, test_hand_norm_ties_go_to_later_tokens);
	tcase_add_test(hand, test_hand_norm_summation_order);
	tcase_add_test(hand, test_scored_saliency);
	tcase_add_test(hand, test_saturation_to_largest_half);
	suite_add_tcase(suite, hand);
	tcase_add_test(reference, test_reference_every_bit_width);
	tcase_add_test(reference, test_reference_head_dims);
	tcase_add_test(reference, test_reference_token_counts);
	tcase_add_test(reference, test_reference_long_block);
	tcase_add_test(reference, test_reference_fractions);
	tcase_add_test(reference, test_reference_group_sizes);
	tcase_add_test(reference, test_reference_batch_and_heads);
	tcase_add_test(reference, test_reference_norm_ties_and_order);
	suite_add_tcase(suite, reference);
	tcase_add_test(edges, test_constant_channels);
	tcase_add_test(edges, test_extremes_stay_finite);
	tcase_add_test(edges, test_overflowing_scale);
	tcase_add_test(edges, test_signed_zero);
	tcase_add_test(edges, test_error_bound);
	tcase_add_test(edges, test_nonfinite_rejected);
	suite_add_tcase(suite, edges);
	tcase_add_test(targets, test_strided_reconstruction);
	tcase_add_test(targets, test_view_stores_choice);
	tcase_add_test(targets, test_streamed_reconstruction);
	tcase_add_test(targets, test_compress_view);
	tcase_add_test(targets, test_compress_view_scored);
	tcase_add_test(targets, test_compress_view_nonfinite);
	tcase_add_test(targets, test_exact_values);
	suite_add_tcase(suite, targets);
	tcase_add_test(isas, test_isas_identical);
	suite_add_tcase(suite, isas);
	return suite;
}

int main(int argc, char **argv)
{
	SRunner *runner;
	int failed;

	/* Child mode for test_isa_environment: report what the environment
	 * selected, before anything else touches the codec. */
	if (argc == 2 && strcmp(argv[1], "--print-isa") == 0) {
		zc_codec_init();
		printf("%d\n", (int)zc_codec_isa());
		return 0;
	}
	runner = srunner_create(fp16_suite());
	srunner_add_suite(runner, api_suite());
	srunner_add_suite(runner, numerics_suite());
	srunner_run_all(runner, CK_NORMAL);
	failed = srunner_ntests_failed(runner);
	srunner_free(runner);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
