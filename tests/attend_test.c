/*
 * Tests for attention over compressed blocks (include/zipcache/attend.h).
 *
 * Every case builds a layer: compressed blocks (zc_block_compress of
 * fixed-seed data, payloads copied to buffers of their exact size so that
 * ASan sees any read past them), a trim cut on some, and an exact fp16
 * residual. The reference is float64 attention over the codec's own
 * reconstruction (zc_block_reconstruct) of the same tokens. The criterion,
 * per output element d of a query row:
 *
 *     |out[d] - ref[d]| <= 1e-4 * max(|ref[d]|, 0.1 * A[d]),
 *     A[d] = sum_t p_t |v_t[d]|   (float64, p the reference weights)
 *
 * A[d] is the magnitude the output is averaged from; an output smaller
 * than a tenth of it comes from cancellation, and is held to 1e-5 of A.
 * On top of that: the same bytes on every ISA the CPU has, for every
 * thread count, and the same bytes as attention over the reconstruction
 * given as fp16 rows in the same segments (the kernels decode each element
 * to the very fp16 value the reconstruction stores).
 *
 * Loops compare silently and fail once with the first bad element:
 * Check records every passing assertion.
 */
#include <check.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "suite_main.h"
#include "zipcache/attend.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

#define TOLERANCE 1e-4
#define FLOOR_FRACTION 0.1
#define MAX_BLOCKS 12

/* ---- data ---------------------------------------------------------------- */

static uint64_t random_next(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double random_unit(uint64_t *state)
{
	return (double)(random_next(state) >> 11) * 0x1.0p-53;
}

static double random_normal(uint64_t *state)
{
	double radius = sqrt(-2.0 * log(1.0 - random_unit(state)));
	return radius * cos(6.283185307179586 * random_unit(state));
}

/*
 * [heads][tokens][dim] fp16. Keys: per-channel scales, a few outlier
 * channels with a fixed offset, a high-norm first token (what the saliency
 * routing sees in real models), all times `magnitude`. Values: plain
 * normal data with a per-channel spread.
 */
static void fill(uint16_t *x, size_t heads, size_t tokens, size_t dim, bool keys,
		 double magnitude, uint64_t seed)
{
	uint64_t state = seed;
	for (size_t h = 0; h < heads; h++)
		for (size_t t = 0; t < tokens; t++)
			for (size_t c = 0; c < dim; c++) {
				double spread = 0.5 + (double)((c * 7 + h) % 11) / 10.0;
				double v = random_normal(&state) * spread;
				if (keys) {
					if (c % 29 == 3)
						v += (c & 1) ? 6.0 : -5.0;
					if (t == 0)
						v *= 4.0;
					v *= magnitude;
				}
				x[(h * tokens + t) * dim + c] = zc_float_to_fp16((float)v);
			}
}

/* ---- a layer ------------------------------------------------------------- */

struct layer_spec {
	uint32_t batch, kv_heads, dim_k, dim_v;
	zc_codec_config config;
	size_t n_blocks;
	uint32_t tokens[MAX_BLOCKS];
	uint32_t valid[MAX_BLOCKS];   /* 0 in the spec: all of tokens (use trim for less) */
	bool trim[MAX_BLOCKS];        /* valid[i] is meant literally */
	uint32_t residual;            /* fp16 rows after the blocks */
	bool no_residual_segment;
	double key_magnitude;
	uint64_t seed;
};

struct layer {
	struct layer_spec spec;
	size_t n_segments;
	zc_attend_segment segments[MAX_BLOCKS + 1];
	/* The same segmentation, blocks replaced by their reconstruction. */
	zc_attend_segment as_rows[MAX_BLOCKS + 1];
	void *key_payload[MAX_BLOCKS], *value_payload[MAX_BLOCKS];
	uint16_t *recon_k[MAX_BLOCKS], *recon_v[MAX_BLOCKS];
	uint16_t *residual_k, *residual_v;
	uint32_t total;
	/* The tokens that count, [B][H][total][D], for the reference. */
	uint16_t *all_k, *all_v;
};

static void *exact_copy(const void *src, size_t n)
{
	void *p = malloc(n ? n : 1);
	ck_assert_ptr_nonnull(p);
	if (n)
		memcpy(p, src, n);
	return p;
}

static void layer_build(struct layer *layer, const struct layer_spec *spec)
{
	uint32_t B = spec->batch, H = spec->kv_heads, dk = spec->dim_k, dv = spec->dim_v;
	memset(layer, 0, sizeof *layer);
	layer->spec = *spec;
	uint32_t total = spec->residual;
	for (size_t i = 0; i < spec->n_blocks; i++)
		total += spec->trim[i] ? spec->valid[i] : spec->tokens[i];
	layer->total = total;
	layer->all_k = calloc((size_t)B * H * total * dk + 1, 2);
	layer->all_v = calloc((size_t)B * H * total * dv + 1, 2);
	ck_assert_ptr_nonnull(layer->all_k);
	ck_assert_ptr_nonnull(layer->all_v);

	uint32_t at = 0;
	uint64_t seed = spec->seed;
	for (size_t i = 0; i < spec->n_blocks; i++) {
		uint32_t S = spec->tokens[i];
		uint32_t valid = spec->trim[i] ? spec->valid[i] : S;
		zc_block_shape ks = { B, H, S, dk }, vs = { B, H, S, dv };
		zc_block_layout kl, vl;
		ck_assert_int_eq(zc_block_layout_compute(&spec->config, ZC_TENSOR_KEYS, &ks, &kl), 0);
		ck_assert_int_eq(zc_block_layout_compute(&spec->config, ZC_TENSOR_VALUES, &vs, &vl),
				 0);
		size_t nk = (size_t)B * H * S * dk, nv = (size_t)B * H * S * dv;
		uint16_t *k = malloc(2 * nk + 2), *v = malloc(2 * nv + 2);
		ck_assert_ptr_nonnull(k);
		ck_assert_ptr_nonnull(v);
		fill(k, (size_t)B * H, S, dk, true, spec->key_magnitude, seed++);
		fill(v, (size_t)B * H, S, dv, false, 1.0, seed++);
		void *kp = malloc(kl.total_bytes + 1), *vp = malloc(vl.total_bytes + 1);
		ck_assert_int_eq(zc_block_compress(&spec->config, ZC_TENSOR_KEYS, &ks, k, kp,
						   kl.total_bytes),
				 (int64_t)kl.total_bytes);
		ck_assert_int_eq(zc_block_compress(&spec->config, ZC_TENSOR_VALUES, &vs, v, vp,
						   vl.total_bytes),
				 (int64_t)vl.total_bytes);
		layer->key_payload[i] = exact_copy(kp, kl.total_bytes);
		layer->value_payload[i] = exact_copy(vp, vl.total_bytes);
		free(kp);
		free(vp);
		layer->recon_k[i] = malloc(2 * nk + 2);
		layer->recon_v[i] = malloc(2 * nv + 2);
		zc_strides kst = { (size_t)H * S * dk, (size_t)S * dk, dk };
		zc_strides vst = { (size_t)H * S * dv, (size_t)S * dv, dv };
		ck_assert_int_eq(zc_block_reconstruct(&spec->config, ZC_TENSOR_KEYS, &ks,
						      layer->key_payload[i], kl.total_bytes,
						      layer->recon_k[i], &kst),
				 0);
		ck_assert_int_eq(zc_block_reconstruct(&spec->config, ZC_TENSOR_VALUES, &vs,
						      layer->value_payload[i], vl.total_bytes,
						      layer->recon_v[i], &vst),
				 0);
		free(k);
		free(v);
		for (size_t bh = 0; bh < (size_t)B * H; bh++)
			for (uint32_t t = 0; t < valid; t++) {
				memcpy(layer->all_k + (bh * total + at + t) * dk,
				       layer->recon_k[i] + (bh * S + t) * dk, 2 * dk);
				memcpy(layer->all_v + (bh * total + at + t) * dv,
				       layer->recon_v[i] + (bh * S + t) * dv, 2 * dv);
			}
		zc_attend_segment *seg = &layer->segments[layer->n_segments];
		seg->kind = ZC_ATTEND_BLOCK;
		seg->block = (zc_attend_block){ .config = spec->config, .shape = ks,
						.head_dim_v = dv, .valid_tokens = valid,
						.keys = layer->key_payload[i],
						.key_bytes = kl.total_bytes,
						.values = layer->value_payload[i],
						.value_bytes = vl.total_bytes };
		zc_attend_segment *rows = &layer->as_rows[layer->n_segments];
		rows->kind = ZC_ATTEND_ROWS;
		rows->rows = (zc_attend_rows){ .batch = B, .heads = H, .tokens = valid,
					       .head_dim_k = dk, .head_dim_v = dv,
					       .keys = layer->recon_k[i], .key_strides = kst,
					       .values = layer->recon_v[i], .value_strides = vst };
		layer->n_segments++;
		at += valid;
	}
	if (!spec->no_residual_segment) {
		/* The residual sits in a [B][H][capacity][D] buffer, as in a view. */
		uint32_t R = spec->residual, cap = R + 3;
		size_t nk = (size_t)B * H * cap * dk, nv = (size_t)B * H * cap * dv;
		uint16_t *k = calloc(nk + 1, 2), *v = calloc(nv + 1, 2);
		fill(k, (size_t)B * H, cap, dk, true, spec->key_magnitude, seed++);
		fill(v, (size_t)B * H, cap, dv, false, 1.0, seed++);
		layer->residual_k = exact_copy(k, 2 * nk);
		layer->residual_v = exact_copy(v, 2 * nv);
		free(k);
		free(v);
		zc_strides kst = { (size_t)H * cap * dk, (size_t)cap * dk, dk };
		zc_strides vst = { (size_t)H * cap * dv, (size_t)cap * dv, dv };
		for (size_t bh = 0; bh < (size_t)B * H; bh++)
			for (uint32_t t = 0; t < R; t++) {
				memcpy(layer->all_k + (bh * total + at + t) * dk,
				       layer->residual_k + bh * cap * dk + (size_t)t * dk, 2 * dk);
				memcpy(layer->all_v + (bh * total + at + t) * dv,
				       layer->residual_v + bh * cap * dv + (size_t)t * dv, 2 * dv);
			}
		zc_attend_segment *seg = &layer->segments[layer->n_segments];
		seg->kind = ZC_ATTEND_ROWS;
		seg->rows = (zc_attend_rows){ .batch = B, .heads = H, .tokens = R,
					      .head_dim_k = dk, .head_dim_v = dv,
					      .keys = layer->residual_k, .key_strides = kst,
					      .values = layer->residual_v, .value_strides = vst };
		layer->as_rows[layer->n_segments] = *seg;
		layer->n_segments++;
	}
}

static void layer_free(struct layer *layer)
{
	for (size_t i = 0; i < layer->spec.n_blocks; i++) {
		free(layer->key_payload[i]);
		free(layer->value_payload[i]);
		free(layer->recon_k[i]);
		free(layer->recon_v[i]);
	}
	free(layer->residual_k);
	free(layer->residual_v);
	free(layer->all_k);
	free(layer->all_v);
}

/* ---- queries and the reference -------------------------------------------- */

struct query_spec {
	uint32_t q_heads, n_q;
	bool causal, fp16;
	double scale;   /* 0: the default */
	uint64_t seed;
};

struct query_data {
	zc_attend_query query;
	float *f32;
	uint16_t *f16;
	size_t n;
};

static void query_make(struct query_data *qd, const struct layer *layer,
		       const struct query_spec *spec)
{
	uint64_t state = spec->seed;
	qd->n = (size_t)layer->spec.batch * spec->q_heads * spec->n_q * layer->spec.dim_k;
	qd->f32 = malloc(4 * qd->n + 4);
	qd->f16 = malloc(2 * qd->n + 2);
	for (size_t i = 0; i < qd->n; i++) {
		qd->f16[i] = zc_float_to_fp16((float)random_normal(&state));
		qd->f32[i] = zc_fp16_to_float(qd->f16[i]);
	}
	if (spec->fp16) {
		/* An exact-size buffer: the library must read no further. */
		uint16_t *exact = exact_copy(qd->f16, 2 * qd->n);
		free(qd->f16);
		qd->f16 = exact;
	} else {
		float *exact = exact_copy(qd->f32, 4 * qd->n);
		free(qd->f32);
		qd->f32 = exact;
	}
	zc_attend_query_init(&qd->query, layer->spec.batch, spec->q_heads, spec->n_q,
			     layer->spec.dim_k, qd->f32);
	qd->query.causal = spec->causal;
	qd->query.scale = spec->scale;
	if (spec->fp16) {
		qd->query.dtype = ZC_ATTEND_FP16;
		qd->query.data = qd->f16;
	}
}

static void query_free(struct query_data *qd)
{
	free(qd->f32);
	free(qd->f16);
}

/* float64 attention over all_k/all_v: ref and A of every output element. */
static void reference(const struct layer *layer, const struct query_data *qd, double *ref,
		      double *mag)
{
	const zc_attend_query *q = &qd->query;
	uint32_t H = layer->spec.kv_heads, dk = layer->spec.dim_k, dv = layer->spec.dim_v;
	uint32_t T = layer->total, rep = q->q_heads / H;
	double scale = q->scale != 0.0 ? q->scale : 1.0 / sqrt((double)dk);
	double *s = malloc(sizeof(double) * (T + 1));

	for (uint32_t b = 0; b < q->batch; b++)
		for (uint32_t qh = 0; qh < q->q_heads; qh++)
			for (uint32_t i = 0; i < q->n_q; i++) {
				size_t row = ((size_t)b * q->q_heads + qh) * q->n_q + i;
				const float *qv = qd->f32 + row * dk;
				size_t bh = (size_t)b * H + qh / rep;
				uint32_t visible = q->causal ? T - q->n_q + i + 1 : T;
				double top = -INFINITY;
				for (uint32_t t = 0; t < visible; t++) {
					const uint16_t *k = layer->all_k + (bh * T + t) * dk;
					double dot = 0.0;
					for (uint32_t c = 0; c < dk; c++)
						dot += (double)qv[c] * zc_fp16_to_float(k[c]);
					s[t] = dot * scale;
					top = s[t] > top ? s[t] : top;
				}
				double z = 0.0;
				for (uint32_t t = 0; t < visible; t++)
					z += (s[t] = exp(s[t] - top));
				for (uint32_t d = 0; d < dv; d++) {
					double acc = 0.0, abs_acc = 0.0;
					for (uint32_t t = 0; t < visible; t++) {
						double v = zc_fp16_to_float(
							layer->all_v[(bh * T + t) * dv + d]);
						acc += s[t] * v;
						abs_acc += s[t] * fabs(v);
					}
					ref[row * dv + d] = acc / z;
					mag[row * dv + d] = abs_acc / z;
				}
			}
	free(s);
}

/* ---- running and checking -------------------------------------------------- */

static const zc_isa every_isa[] = { ZC_ISA_SCALAR, ZC_ISA_AVX2, ZC_ISA_AVX512 };

static size_t supported_isas(zc_isa *isas)
{
	size_t n = 0;
	for (size_t i = 0; i < 3; i++)
		if (zc_codec_set_isa(every_isa[i]) == 0)
			isas[n++] = every_isa[i];
	return n;
}

static size_t output_elements(const struct layer *layer, const zc_attend_query *q)
{
	return (size_t)q->batch * q->q_heads * q->n_q * layer->spec.dim_v;
}

static float *run_attend(const zc_attend_segment *segments, size_t n, const zc_attend_query *q,
			 size_t elements, unsigned threads, const char *label)
{
	float *out = malloc(4 * elements);
	zc_attend_output output = { ZC_ATTEND_FP32, out, 4 * elements, NULL };
	int rc = zc_attend_segments(segments, n, q, &output, threads);
	REQUIRE(rc == 0, "%s on %s: zc_attend_segments = %d (%s)", label,
		zc_isa_name(zc_codec_isa()), rc, zc_error_name(rc));
	return out;
}

static void require_same(const float *a, const float *b, size_t n, const char *label,
			 const char *what)
{
	for (size_t i = 0; i < n; i++) {
		REQUIRE(memcmp(&a[i], &b[i], 4) == 0,
			"%s: %s differs at element %zu: %.9g vs %.9g", label, what, i, a[i], b[i]);
	}
}

static void require_close(const float *out, const double *ref, const double *mag, size_t n,
			  const char *label)
{
	double worst = 0.0;
	size_t worst_at = 0;
	for (size_t i = 0; i < n; i++) {
		double bound = TOLERANCE * fmax(fabs(ref[i]), FLOOR_FRACTION * mag[i]);
		double err = fabs((double)out[i] - ref[i]);
		REQUIRE(isfinite(out[i]) && err <= bound,
			"%s on %s: element %zu is %.9g, reference %.9g (A %.6g): error %.3g > bound %.3g",
			label, zc_isa_name(zc_codec_isa()), i, out[i], ref[i], mag[i], err, bound);
		if (bound > 0 && err / bound > worst) {
			worst = err / bound;
			worst_at = i;
		}
	}
	(void)worst_at;
}

/*
 * The whole battery for one layer and query: on every ISA the output is
 * within the bound of the reference and equals the first ISA's bytes, the
 * reconstruction-as-rows' bytes, and (on the last ISA) its own bytes with
 * 2 and 3 threads.
 */
static void check_case(const struct layer_spec *ls, const struct query_spec *qs,
		       const char *label)
{
	struct layer layer;
	struct query_data qd;
	zc_isa isas[3];
	size_t n_isas = supported_isas(isas);

	layer_build(&layer, ls);
	query_make(&qd, &layer, qs);
	size_t n = output_elements(&layer, &qd.query);
	double *ref = malloc(sizeof(double) * n), *mag = malloc(sizeof(double) * n);
	reference(&layer, &qd, ref, mag);

	float *first = NULL;
	for (size_t k = 0; k < n_isas; k++) {
		ck_assert_int_eq(zc_codec_set_isa(isas[k]), 0);
		float *out = run_attend(layer.segments, layer.n_segments, &qd.query, n, 1, label);
		require_close(out, ref, mag, n, label);
		float *rows = run_attend(layer.as_rows, layer.n_segments, &qd.query, n, 1, label);
		require_same(out, rows, n, label, "blocks vs their reconstruction as rows");
		free(rows);
		if (k + 1 == n_isas) {
			for (unsigned threads = 2; threads <= 3; threads++) {
				float *t = run_attend(layer.segments, layer.n_segments, &qd.query, n,
						      threads, label);
				require_same(out, t, n, label, "1 thread vs more");
				free(t);
			}
		}
		if (!first) {
			first = out;
		} else {
			require_same(first, out, n, label, zc_isa_name(isas[k]));
			free(out);
		}
	}
	free(first);
	free(ref);
	free(mag);
	query_free(&qd);
	layer_free(&layer);
	ck_assert_int_eq(zc_codec_set_isa(isas[n_isas - 1]), 0);
}

/* ---- attention masses (saliency by attention) ------------------------------ */

/* A mass within MASS_TOLERANCE of the float64 reference, relatively, or
 * within MASS_FLOOR times the rows summed, absolutely: each of the R
 * probabilities summed carries the fp32 rounding of its score, its exp2,
 * its division and the sum l. Measured worst: 3e-6 relative, 2.5e-6
 * absolute over 128 rows (causal n_q 8, GQA 8). */
#define MASS_TOLERANCE 1e-4
#define MASS_FLOOR 1e-7

/* float64 masses of tokens [first, T) over all_k: per (b, KV head), the
 * softmax probability summed over the group's query rows. */
static void reference_mass(const struct layer *layer, const struct query_data *qd,
			   uint32_t first, double *ref)
{
	const zc_attend_query *q = &qd->query;
	uint32_t H = layer->spec.kv_heads, dk = layer->spec.dim_k;
	uint32_t T = layer->total, rep = q->q_heads / H, n = T - first;
	double scale = q->scale != 0.0 ? q->scale : 1.0 / sqrt((double)dk);
	double *s = malloc(sizeof(double) * (T + 1));

	memset(ref, 0, sizeof(double) * q->batch * H * n);
	for (uint32_t b = 0; b < q->batch; b++)
		for (uint32_t qh = 0; qh < q->q_heads; qh++)
			for (uint32_t i = 0; i < q->n_q; i++) {
				size_t row = ((size_t)b * q->q_heads + qh) * q->n_q + i;
				const float *qv = qd->f32 + row * dk;
				size_t bh = (size_t)b * H + qh / rep;
				uint32_t visible = q->causal ? T - q->n_q + i + 1 : T;
				double top = -INFINITY, z = 0.0;
				for (uint32_t t = 0; t < visible; t++) {
					const uint16_t *k = layer->all_k + (bh * T + t) * dk;
					double dot = 0.0;
					for (uint32_t c = 0; c < dk; c++)
						dot += (double)qv[c] * zc_fp16_to_float(k[c]);
					s[t] = dot * scale;
					top = s[t] > top ? s[t] : top;
				}
				for (uint32_t t = 0; t < visible; t++)
					z += (s[t] = exp(s[t] - top));
				for (uint32_t t = first; t < visible; t++)
					ref[bh * n + t - first] += s[t] / z;
			}
	free(s);
}

static float *run_mass(const zc_attend_segment *segments, size_t n_segments,
		       const zc_attend_query *q, size_t elements, uint32_t first, size_t n_mass,
		       uint32_t kv_heads, unsigned threads, const float *plain, const char *label)
{
	float *out = malloc(4 * elements), *mass = malloc(4 * n_mass + 4);
	zc_attend_mass m = { mass, n_mass, first, 12345 };
	zc_attend_output output = { ZC_ATTEND_FP32, out, 4 * elements, &m };
	int rc = zc_attend_segments(segments, n_segments, q, &output, threads);
	REQUIRE(rc == 0, "%s on %s: zc_attend_segments with masses = %d (%s)", label,
		zc_isa_name(zc_codec_isa()), rc, zc_error_name(rc));
	REQUIRE(m.first_token == first && (size_t)m.tokens * q->batch * kv_heads == n_mass,
		"%s: mass names %u tokens from %u", label, m.tokens, m.first_token);
	/* Asking for masses leaves the output's bytes as they were. */
	require_same(plain, out, elements, label, "output with masses vs without");
	free(out);
	return mass;
}

/*
 * Masses of the tokens from `first` on: within the bound of the float64
 * reference on every ISA, the same bytes on every ISA, with 1 to 3
 * threads, and over the blocks' reconstruction as rows.
 */
static void check_mass_case(const struct layer_spec *ls, const struct query_spec *qs,
			    uint32_t first, const char *label)
{
	struct layer layer;
	struct query_data qd;
	zc_isa isas[3];
	size_t n_isas = supported_isas(isas);

	layer_build(&layer, ls);
	if (first == UINT32_MAX)
		first = layer.total - ls->residual;  /* the residual's rows */
	query_make(&qd, &layer, qs);
	size_t n = output_elements(&layer, &qd.query);
	size_t n_mass = (size_t)ls->batch * ls->kv_heads * (layer.total - first);
	double *ref = malloc(sizeof(double) * (n_mass + 1));
	reference_mass(&layer, &qd, first, ref);

	float *first_mass = NULL;
	for (size_t k = 0; k < n_isas; k++) {
		ck_assert_int_eq(zc_codec_set_isa(isas[k]), 0);
		float *plain = run_attend(layer.segments, layer.n_segments, &qd.query, n, 1, label);
		float *mass = run_mass(layer.segments, layer.n_segments, &qd.query, n, first, n_mass,
				       ls->kv_heads, 1, plain, label);
		for (size_t i = 0; i < n_mass; i++) {
			double bound = MASS_TOLERANCE * ref[i] + MASS_FLOOR * (qs->q_heads / ls->kv_heads) *
									 qs->n_q;
			REQUIRE(isfinite(mass[i]) && fabs(mass[i] - ref[i]) <= bound,
				"%s on %s: mass %zu is %.9g, reference %.9g (bound %.3g)", label,
				zc_isa_name(zc_codec_isa()), i, mass[i], ref[i], bound);
		}
		float *rows_plain = run_attend(layer.as_rows, layer.n_segments, &qd.query, n, 1, label);
		float *rows = run_mass(layer.as_rows, layer.n_segments, &qd.query, n, first, n_mass,
				       ls->kv_heads, 1, rows_plain, label);
		require_same(mass, rows, n_mass, label, "masses over blocks vs their rows");
		free(rows);
		free(rows_plain);
		for (unsigned threads = 2; threads <= 3; threads++) {
			float *t = run_mass(layer.segments, layer.n_segments, &qd.query, n, first, n_mass,
					    ls->kv_heads, threads, plain, label);
			require_same(mass, t, n_mass, label, "masses, 1 thread vs more");
			free(t);
		}
		free(plain);
		if (!first_mass) {
			first_mass = mass;
		} else {
			require_same(first_mass, mass, n_mass, label, zc_isa_name(isas[k]));
			free(mass);
		}
	}
	free(first_mass);
	free(ref);
	query_free(&qd);
	layer_free(&layer);
	ck_assert_int_eq(zc_codec_set_isa(isas[n_isas - 1]), 0);
}

static struct layer_spec base_layer(void)
{
	struct layer_spec ls = { .batch = 2, .kv_heads = 2, .dim_k = 64, .dim_v = 64,
				 .n_blocks = 2, .tokens = { 64, 100 }, .residual = 5,
				 .key_magnitude = 1.0, .seed = 1 };
	zc_codec_config_default(&ls.config);
	return ls;
}

static struct query_spec base_query(void)
{
	return (struct query_spec){ .q_heads = 8, .n_q = 1, .seed = 99 };
}

/* ---- cases ----------------------------------------------------------------- */

START_TEST(test_widths)
{
	/* Every width 1..8 as hi and as lo bits. */
	for (int w = 1; w <= 8; w++) {
		struct layer_spec ls = base_layer();
		struct query_spec qs = base_query();
		char label[64];
		ls.config.hi_bits = w;
		ls.config.lo_bits = 9 - w;
		ls.dim_k = ls.dim_v = w % 2 ? 80 : 64;
		ls.seed = 10 + (uint64_t)w;
		snprintf(label, sizeof label, "hi %d lo %d", w, 9 - w);
		check_case(&ls, &qs, label);
		/* Whole-byte rows that end in half a 16-channel vector. */
		ls.dim_k = 40;
		ls.dim_v = 24;
		qs = base_query();
		snprintf(label, sizeof label, "hi %d lo %d, D_k 40 D_v 24", w, 9 - w);
		check_case(&ls, &qs, label);
	}
}
END_TEST

START_TEST(test_fractions_and_groups)
{
	static const double fractions[] = { 0.0, 0.2, 0.5, 1.0 };
	static const int groups[] = { 1, 5, 32, 200 };
	for (size_t f = 0; f < 4; f++)
		for (size_t g = 0; g < 4; g++) {
			struct layer_spec ls = base_layer();
			struct query_spec qs = base_query();
			char label[64];
			ls.config.hi_fraction = fractions[f];
			ls.config.group_size = groups[g];
			ls.tokens[1] = 150;
			ls.seed = 100 + f * 4 + g;
			snprintf(label, sizeof label, "hi_fraction %.1f group %d", fractions[f],
				 groups[g]);
			check_case(&ls, &qs, label);
		}
}
END_TEST

START_TEST(test_head_dims)
{
	static const uint32_t dims[][2] = { { 64, 64 },  { 80, 80 }, { 96, 96 }, { 128, 128 },
					    { 256, 256 }, { 96, 64 }, { 65, 33 }, { 3, 17 } };
	for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
		struct layer_spec ls = base_layer();
		struct query_spec qs = base_query();
		char label[64];
		ls.dim_k = dims[i][0];
		ls.dim_v = dims[i][1];
		ls.config.hi_bits = 3; /* rows of odd bit lengths for D = 65, 3 */
		ls.seed = 200 + i;
		snprintf(label, sizeof label, "D_k %u D_v %u", dims[i][0], dims[i][1]);
		check_case(&ls, &qs, label);
	}
}
END_TEST

START_TEST(test_gqa_and_causal)
{
	static const uint32_t ratios[] = { 1, 4, 8 };
	for (size_t r = 0; r < 3; r++)
		for (uint32_t n_q = 1; n_q <= 8; n_q += 7)
			for (int causal = 0; causal <= 1; causal++) {
				struct layer_spec ls = base_layer();
				struct query_spec qs = base_query();
				char label[64];
				qs.q_heads = ls.kv_heads * ratios[r];
				qs.n_q = n_q;
				qs.causal = causal;
				ls.seed = 300 + r * 4 + n_q + (uint64_t)causal;
				snprintf(label, sizeof label, "GQA %u n_q %u causal %d", ratios[r], n_q,
					 causal);
				check_case(&ls, &qs, label);
			}
	/* Causal where the queries' own tokens reach back into the blocks. */
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	ls.residual = 3;
	qs.n_q = 8;
	qs.causal = true;
	check_case(&ls, &qs, "causal across the residual");
	ls.residual = 0;
	ls.no_residual_segment = true;
	ls.n_blocks = 1;
	ls.tokens[0] = 8;
	check_case(&ls, &qs, "causal, exactly n_q tokens");
}
END_TEST

START_TEST(test_residual_empty_and_full)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	ls.residual = 0;
	check_case(&ls, &qs, "empty residual");
	ls.no_residual_segment = true;
	check_case(&ls, &qs, "no residual segment");
	ls = base_layer();
	ls.n_blocks = 0;
	ls.residual = 130;
	check_case(&ls, &qs, "residual only");
	ls.residual = 64;
	check_case(&ls, &qs, "one full chunk of residual");
}
END_TEST

START_TEST(test_block_sizes_and_trim)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	static const uint32_t sizes[] = { 1, 7, 63, 64, 65, 127, 128, 129, 300 };
	ls.n_blocks = 9;
	for (size_t i = 0; i < 9; i++)
		ls.tokens[i] = sizes[i];
	ls.config.group_size = 16;
	check_case(&ls, &qs, "blocks of many sizes");
	/* Trim cuts: none left, one left, mid-chunk, mid-group, all. */
	static const uint32_t valid[] = { 0, 1, 40, 64, 0, 100, 128, 77, 300 };
	for (size_t i = 0; i < 9; i++) {
		ls.trim[i] = true;
		ls.valid[i] = valid[i] < sizes[i] ? valid[i] : sizes[i];
	}
	ls.seed = 7;
	check_case(&ls, &qs, "trim cuts");
}
END_TEST

START_TEST(test_exact_values)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	ls.config.quantize_values = false;
	ls.dim_v = 72;
	check_case(&ls, &qs, "exact values");
	ls.tokens[0] = 200;
	ls.trim[0] = true;
	ls.valid[0] = 150;
	qs.n_q = 8;
	qs.causal = true;
	check_case(&ls, &qs, "exact values, trim, causal");
}
END_TEST

START_TEST(test_sharp_and_long)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	/* Large keys: scores of tens, weights across the whole exp range. */
	ls.key_magnitude = 8.0;
	check_case(&ls, &qs, "sharp softmax");
	/* An explicit scale, 4x the default: logits up to about 30. */
	ls.key_magnitude = 1.0;
	qs.scale = 0.5;
	check_case(&ls, &qs, "explicit scale");
	/* Many chunks: the long accumulation. */
	ls = base_layer();
	ls.batch = 1;
	ls.dim_k = ls.dim_v = 128;
	ls.tokens[0] = 2048;
	ls.tokens[1] = 1990;
	ls.residual = 60;
	qs = base_query();
	qs.q_heads = 8;
	check_case(&ls, &qs, "4098 tokens");
}
END_TEST

START_TEST(test_fp16_query_and_output)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	qs.fp16 = true;
	check_case(&ls, &qs, "fp16 query");

	struct layer layer;
	struct query_data qd;
	layer_build(&layer, &ls);
	query_make(&qd, &layer, &qs);
	size_t n = output_elements(&layer, &qd.query);
	float *f32 = run_attend(layer.segments, layer.n_segments, &qd.query, n, 1, "fp16 out");
	uint16_t *f16 = malloc(2 * n);
	zc_attend_output output = { ZC_ATTEND_FP16, f16, 2 * n, NULL };
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output,
					    1),
			 0);
	for (size_t i = 0; i < n; i++)
		REQUIRE(f16[i] == zc_float_to_fp16(f32[i]),
			"fp16 output %zu: 0x%04x, fp16 of the fp32 output 0x%04x", i, f16[i],
			zc_float_to_fp16(f32[i]));
	free(f16);
	free(f32);
	query_free(&qd);
	layer_free(&layer);
}
END_TEST

/* ---- bad input ------------------------------------------------------------- */

struct bad_fixture {
	struct layer layer;
	struct query_data qd;
	float *out;
	size_t n;
};

static void bad_setup(struct bad_fixture *f)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	layer_build(&f->layer, &ls);
	query_make(&f->qd, &f->layer, &qs);
	f->n = output_elements(&f->layer, &f->qd.query);
	f->out = malloc(4 * f->n);
	memset(f->out, 0x5a, 4 * f->n);
}

/* Expects rc from a call with these segments and query; the output must
 * be left exactly as it was. */
static void expect_error(struct bad_fixture *f, const zc_attend_segment *segments, size_t n,
			 const zc_attend_query *q, int expected, const char *label)
{
	zc_attend_output output = { ZC_ATTEND_FP32, f->out, 4 * f->n, NULL };
	int rc = zc_attend_segments(segments, n, q, &output, 2);
	REQUIRE(rc == expected, "%s: got %d (%s), expected %d (%s)", label, rc,
		zc_error_name(rc), expected, zc_error_name(expected));
	for (size_t i = 0; i < 4 * f->n; i++)
		REQUIRE(((uint8_t *)f->out)[i] == 0x5a, "%s: output byte %zu was written", label,
			i);
}

static void bad_teardown(struct bad_fixture *f)
{
	free(f->out);
	query_free(&f->qd);
	layer_free(&f->layer);
}

START_TEST(test_bad_shapes)
{
	struct bad_fixture f;
	bad_setup(&f);
	zc_attend_segment segs[MAX_BLOCKS + 1];
	size_t n = f.layer.n_segments;
	zc_attend_query q = f.qd.query;

	q.q_heads = 3; /* kv_heads 2 */
	expect_error(&f, f.layer.segments, n, &q, ZC_ESHAPE, "q_heads not a multiple");
	q = f.qd.query;
	q.batch = 1;
	expect_error(&f, f.layer.segments, n, &q, ZC_ESHAPE, "query batch differs");
	q = f.qd.query;
	q.head_dim = 32;
	expect_error(&f, f.layer.segments, n, &q, ZC_ESHAPE, "query head_dim differs");

	memcpy(segs, f.layer.segments, sizeof segs);
	segs[n - 1].rows.heads = 1;
	expect_error(&f, segs, n, &f.qd.query, ZC_ESHAPE, "residual heads differ");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[n - 1].rows.head_dim_v = 32;
	expect_error(&f, segs, n, &f.qd.query, ZC_ESHAPE, "residual D_v differs");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[1].block.head_dim_v = 32;
	segs[1].block.value_bytes = 0;
	{
		zc_block_layout vl;
		zc_block_shape vs = segs[1].block.shape;
		vs.head_dim = 32;
		zc_block_layout_compute(&segs[1].block.config, ZC_TENSOR_VALUES, &vs, &vl);
		segs[1].block.value_bytes = vl.total_bytes;
	}
	expect_error(&f, segs, n, &f.qd.query, ZC_ESHAPE, "block D_v differs");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.shape.batch = 1;
	expect_error(&f, segs, n, &f.qd.query, ZC_ESHAPE, "block batch differs");
	expect_error(&f, f.layer.segments, 0, &f.qd.query, ZC_ESHAPE, "no segments");
	/* Only an empty residual and a block trimmed to nothing. */
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.valid_tokens = 0;
	segs[1] = segs[n - 1];
	segs[1].rows.tokens = 0;
	expect_error(&f, segs, 2, &f.qd.query, ZC_ESHAPE, "no tokens");
	q = f.qd.query;
	q.n_q = 1000;
	q.causal = true;
	expect_error(&f, f.layer.segments, n, &q, ZC_ESHAPE, "causal with fewer tokens than n_q");
	bad_teardown(&f);
}
END_TEST

START_TEST(test_bad_arguments)
{
	struct bad_fixture f;
	bad_setup(&f);
	zc_attend_segment segs[MAX_BLOCKS + 1];
	size_t n = f.layer.n_segments;
	zc_attend_query q;

	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.valid_tokens = segs[0].block.shape.tokens + 1;
	expect_error(&f, segs, n, &f.qd.query, ZC_EINVALID, "valid_tokens > tokens");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].kind = 7;
	expect_error(&f, segs, n, &f.qd.query, ZC_EINVALID, "unknown kind");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.keys = NULL;
	expect_error(&f, segs, n, &f.qd.query, ZC_EINVALID, "NULL key payload");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[n - 1].rows.values = NULL;
	expect_error(&f, segs, n, &f.qd.query, ZC_EINVALID, "NULL residual values");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.config.lo_bits = 9;
	expect_error(&f, segs, n, &f.qd.query, ZC_EBITS, "bad codec config");
	q = f.qd.query;
	q.scale = NAN;
	expect_error(&f, f.layer.segments, n, &q, ZC_EINVALID, "NaN scale");
	q = f.qd.query;
	q.data = NULL;
	expect_error(&f, f.layer.segments, n, &q, ZC_EINVALID, "NULL query");
	q = f.qd.query;
	q.dtype = 5;
	expect_error(&f, f.layer.segments, n, &q, ZC_EINVALID, "unknown dtype");

	zc_attend_output small = { ZC_ATTEND_FP32, f.out, 4 * f.n - 1, NULL };
	ck_assert_int_eq(zc_attend_segments(f.layer.segments, n, &f.qd.query, &small, 1),
			 ZC_EBUFFER);
	bad_teardown(&f);
}
END_TEST

START_TEST(test_bad_payloads)
{
	struct bad_fixture f;
	bad_setup(&f);
	zc_attend_segment segs[MAX_BLOCKS + 1];
	size_t n = f.layer.n_segments;

	memcpy(segs, f.layer.segments, sizeof segs);
	segs[0].block.key_bytes -= 1;
	expect_error(&f, segs, n, &f.qd.query, ZC_ECORRUPT, "short key payload");
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[1].block.value_bytes += 1;
	expect_error(&f, segs, n, &f.qd.query, ZC_ECORRUPT, "long value payload");

	/* A mask with one salient token too many, in the last head. */
	zc_block_layout kl;
	zc_block_layout_compute(&segs[1].block.config, ZC_TENSOR_KEYS, &segs[1].block.shape, &kl);
	uint8_t *copy = exact_copy(segs[1].block.keys, kl.total_bytes);
	uint8_t *mask = copy + (kl.heads - 1) * kl.head_bytes + kl.mask_offset;
	for (size_t i = 0; i < kl.mask_bytes * 8 && i < kl.tokens; i++)
		if (!(mask[i / 8] >> (i % 8) & 1)) {
			mask[i / 8] |= (uint8_t)(1u << (i % 8));
			break;
		}
	memcpy(segs, f.layer.segments, sizeof segs);
	segs[1].block.keys = copy;
	expect_error(&f, segs, n, &f.qd.query, ZC_ECORRUPT, "mask count");
	free(copy);
	bad_teardown(&f);
}
END_TEST

START_TEST(test_nonfinite_query)
{
	struct bad_fixture f;
	bad_setup(&f);
	size_t n = f.layer.n_segments;
	zc_attend_query q = f.qd.query;

	f.qd.f32[f.qd.n - 1] = NAN;
	expect_error(&f, f.layer.segments, n, &q, ZC_ENONFINITE, "NaN in an fp32 query");
	f.qd.f32[f.qd.n - 1] = 0.0f;
	f.qd.f32[0] = -INFINITY;
	expect_error(&f, f.layer.segments, n, &q, ZC_ENONFINITE, "-Inf in an fp32 query");
	f.qd.f32[0] = 0.0f;
	uint16_t *h = malloc(2 * f.qd.n);
	for (size_t i = 0; i < f.qd.n; i++)
		h[i] = zc_float_to_fp16(f.qd.f32[i]);
	h[f.qd.n / 2] = 0x7e00;
	q.dtype = ZC_ATTEND_FP16;
	q.data = h;
	expect_error(&f, f.layer.segments, n, &q, ZC_ENONFINITE, "NaN in an fp16 query");
	free(h);
	bad_teardown(&f);
}
END_TEST

START_TEST(test_mass_residual)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	check_mass_case(&ls, &qs, UINT32_MAX, "masses of the residual");
	ls.residual = 130;
	ls.key_magnitude = 4.0;
	check_mass_case(&ls, &qs, UINT32_MAX, "masses of a residual of 130 rows, sharp");
	qs.n_q = 8;
	qs.causal = true;
	qs.q_heads = 2;
	check_mass_case(&ls, &qs, UINT32_MAX, "masses, causal n_q 8, GQA 1");
	qs.q_heads = 16;
	check_mass_case(&ls, &qs, UINT32_MAX, "masses, causal n_q 8, GQA 8");
	ls = base_layer();
	ls.n_blocks = 0;
	ls.residual = 200;
	qs = base_query();
	check_mass_case(&ls, &qs, UINT32_MAX, "masses, residual only");
	ls.dim_k = ls.dim_v = 128;
	ls.kv_heads = 8;
	ls.batch = 1;
	qs.q_heads = 32;
	check_mass_case(&ls, &qs, UINT32_MAX, "masses, the decode shape");
}
END_TEST

START_TEST(test_mass_any_first_token)
{
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	/* From the first token (the blocks' scores too), from inside the
	 * second block (its first chunk skipped by its masks' counts), and
	 * none (first = total). */
	check_mass_case(&ls, &qs, 0, "masses of every token");
	check_mass_case(&ls, &qs, 64 + 70, "masses from inside a block");
	check_mass_case(&ls, &qs, 64 + 100 + 5, "no masses");
	static const uint32_t sizes[] = { 1, 7, 63, 64, 65, 127, 128, 129, 300 };
	static const uint32_t valid[] = { 0, 1, 40, 64, 0, 100, 128, 77, 300 };
	ls.n_blocks = 9;
	ls.config.group_size = 16;
	for (size_t i = 0; i < 9; i++) {
		ls.tokens[i] = sizes[i];
		ls.trim[i] = true;
		ls.valid[i] = valid[i] < sizes[i] ? valid[i] : sizes[i];
	}
	check_mass_case(&ls, &qs, 0, "masses over trim cuts");
	check_mass_case(&ls, &qs, 200, "masses from inside trimmed blocks");
}
END_TEST

START_TEST(test_mass_bad_arguments)
{
	struct layer layer;
	struct query_data qd;
	struct layer_spec ls = base_layer();
	struct query_spec qs = base_query();
	layer_build(&layer, &ls);
	query_make(&qd, &layer, &qs);
	size_t n = output_elements(&layer, &qd.query), rows = layer.total - ls.residual;
	float *out = malloc(4 * n), mass[2 * 2 * 5 + 1];
	for (size_t i = 0; i < n; i++)
		out[i] = -1.0f;
	for (size_t i = 0; i < 21; i++)
		mass[i] = -1.0f;
	zc_attend_mass m = { mass, 20, layer.total + 1, 77 };
	zc_attend_output output = { ZC_ATTEND_FP32, out, 4 * n, &m };
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output, 1),
			 ZC_ESHAPE);
	m.first_token = (uint32_t)rows;
	m.capacity = 19;
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output, 1),
			 ZC_EBUFFER);
	m.capacity = 20;
	m.data = NULL;
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output, 1),
			 ZC_EINVALID);
	/* Refused: nothing written, tokens as it was. */
	ck_assert_uint_eq(m.tokens, 77);
	for (size_t i = 0; i < n; i++)
		ck_assert(out[i] == -1.0f);
	for (size_t i = 0; i < 21; i++)
		ck_assert(mass[i] == -1.0f);
	/* Exactly the capacity needed is enough, and nothing past it moves. */
	m.data = mass;
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output, 1),
			 0);
	ck_assert_uint_eq(m.tokens, 5);
	ck_assert(mass[20] == -1.0f);
	/* Per (b, KV head) the masses are at most its rows' count (4). */
	for (size_t i = 0; i < 20; i++)
		ck_assert(mass[i] > 0.0f && mass[i] <= 4.0f);
	/* None wanted (first = total): data is not needed. */
	m = (zc_attend_mass){ NULL, 0, layer.total, 77 };
	ck_assert_int_eq(zc_attend_segments(layer.segments, layer.n_segments, &qd.query, &output, 1),
			 0);
	ck_assert_uint_eq(m.tokens, 0);
	free(out);
	query_free(&qd);
	layer_free(&layer);
}
END_TEST

static Suite *attend_suite(void)
{
	Suite *suite = suite_create("attend");
	const struct test_case cases[] = {
		{ "numerics", { test_widths, test_fractions_and_groups, test_head_dims,
				test_gqa_and_causal, test_residual_empty_and_full,
				test_block_sizes_and_trim, test_exact_values, test_sharp_and_long,
				test_fp16_query_and_output, NULL } },
		{ "bad_input", { test_bad_shapes, test_bad_arguments, test_bad_payloads,
				 test_nonfinite_query, NULL } },
		{ "mass", { test_mass_residual, test_mass_any_first_token, test_mass_bad_arguments,
			    NULL } },
	};
	/* Sanitizer builds run the scalar path many times slower. */
	suite_add_cases(suite, cases, sizeof cases / sizeof cases[0], 600);
	return suite;
}

int main(void)
{
	return suite_main(attend_suite(), CK_FORK_GETENV);
}
