/*
 * Attention benchmark: one decode step (n_q = 1) of one Llama-3-8B-shaped
 * layer, B = 1, H_kv = 8, q_heads = 32, D = 128, at S = 4096 and 32768
 * tokens, measured in one run:
 *
 *   compressed   zc_attend_segments over the layer's compressed blocks
 *                (default config: 4/2 bits, 20 % salient keys, groups of 32)
 *   fp16         zc_attend_segments over the same tokens as fp16 rows (the
 *                codec's reconstruction in a [B][H][S][D] view)
 *   float32_c    plain float32 C attention over the fp16 rows: convert K
 *                and V to float32 (what numpy's astype does), then plain
 *                loops (q K^T, expf softmax, weights V); the stand-in for
 *                a user's numpy attention over the view
 *   memcpy       of the fp16 K+V bytes between two buffers: the
 *                bytes-read limit is those bytes over memcpy's bandwidth,
 *                so limit time = memcpy time
 *
 * and reports compressed / fp16 (goal <= 1.0 at 32768), memcpy / fp16
 * (the fraction of the bytes-read limit the fp16 path reaches; goal >=
 * 0.6), compressed / float32_c, and the compressed path's speedup from 1
 * to 2 threads. The layer is blocks of BLOCK_TOKENS tokens, as a session
 * holds a long prompt's prefill. Every figure is the median of --runs
 * timed runs; the measures alternate run by run so that a noisy
 * neighbour slows all of them; single-thread figures are pinned to one
 * CPU, the thread scaling runs on every CPU allowed.
 *
 * Output: a table for people, then JSON lines (starting with '{').
 *
 * usage: attend [--isa scalar|avx2|avx512] [--runs N] [--tokens S] [--quick]
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "synthetic_kv.h"
#include "zipcache/attend.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define BATCH 1u
#define KV_HEADS 8u
#define Q_HEADS 32u
#define HEAD_DIM 128u
#define BLOCK_TOKENS 4096u
#define MAX_BLOCKS 64u

#define DEFAULT_RUNS 11
#define MIN_RUN_MS 20.0
#define QUICK_RUNS 3
#define QUICK_MIN_RUN_MS 1.0

enum measure { M_COMPRESSED, M_FP16, M_FLOAT32_C, M_MEMCPY, M_COMPRESSED_2T, M_COUNT };
static const char *const measure_names[M_COUNT] = { "compressed", "fp16", "float32_c",
						    "memcpy", "compressed_2_threads" };

struct options {
	int runs;
	double min_run_s;
	bool quick, isa_forced;
	zc_isa isa;
	uint32_t tokens;
};

struct layer {
	uint32_t tokens;
	size_t n_blocks;
	zc_attend_segment blocks[MAX_BLOCKS];
	zc_attend_segment view;
	uint16_t *k16, *v16;   /* [H][S][D] reconstruction */
	float *k32, *v32;      /* float32_c's converted copies */
	void *payloads[2 * MAX_BLOCKS];
	size_t compressed_bytes;
	float *q;              /* [Q_HEADS][D] */
	float *out;            /* [Q_HEADS][D] */
	float *scores;         /* float32_c's [S] */
	void *copy_src, *copy_dst;
	size_t fp16_bytes;
};

static void *(*volatile memcpy_fn)(void *, const void *, size_t) = memcpy;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *alloc_touched(size_t bytes)
{
	size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded ? rounded : 64);
	if (p)
		memset(p, 0, rounded);
	return p;
}

/* ---- the measured operations --------------------------------------------- */

static int attend(const struct layer *layer, bool compressed, unsigned threads)
{
	zc_attend_query query;
	zc_attend_query_init(&query, BATCH, Q_HEADS, 1, HEAD_DIM, layer->q);
	zc_attend_output output = { ZC_ATTEND_FP32, layer->out,
				    sizeof(float) * Q_HEADS * HEAD_DIM, NULL };
	if (compressed)
		return zc_attend_segments(layer->blocks, layer->n_blocks, &query, &output, threads);
	return zc_attend_segments(&layer->view, 1, &query, &output, threads);
}

/*
 * What a user would write over the fp16 view with numpy, in plain C:
 * K.astype(float32), V.astype(float32), then per query head
 * softmax(K q * scale) V in float32.
 */
static int float32_c(struct layer *layer)
{
	size_t n = (size_t)KV_HEADS * layer->tokens * HEAD_DIM;
	uint32_t S = layer->tokens;
	for (size_t i = 0; i < n; i++) {
		layer->k32[i] = zc_fp16_to_float(layer->k16[i]);
		layer->v32[i] = zc_fp16_to_float(layer->v16[i]);
	}
	const float scale = 1.0f / sqrtf((float)HEAD_DIM);
	for (uint32_t qh = 0; qh < Q_HEADS; qh++) {
		const float *q = layer->q + (size_t)qh * HEAD_DIM;
		size_t h = qh / (Q_HEADS / KV_HEADS);
		const float *k = layer->k32 + h * S * HEAD_DIM, *v = layer->v32 + h * S * HEAD_DIM;
		float top = -INFINITY, sum = 0.0f;
		for (uint32_t t = 0; t < S; t++) {
			float dot = 0.0f;
			for (uint32_t c = 0; c < HEAD_DIM; c++)
				dot += q[c] * k[(size_t)t * HEAD_DIM + c];
			layer->scores[t] = dot * scale;
			top = layer->scores[t] > top ? layer->scores[t] : top;
		}
		float *out = layer->out + (size_t)qh * HEAD_DIM;
		memset(out, 0, HEAD_DIM * sizeof *out);
		for (uint32_t t = 0; t < S; t++) {
			float p = expf(layer->scores[t] - top);
			sum += p;
			for (uint32_t c = 0; c < HEAD_DIM; c++)
				out[c] += p * v[(size_t)t * HEAD_DIM + c];
		}
		for (uint32_t c = 0; c < HEAD_DIM; c++)
			out[c] /= sum;
	}
	return 0;
}

static int run_measure(struct layer *layer, enum measure m)
{
	switch (m) {
	case M_COMPRESSED:
		return attend(layer, true, 1);
	case M_FP16:
		return attend(layer, false, 1);
	case M_FLOAT32_C:
		return float32_c(layer);
	case M_MEMCPY:
		memcpy_fn(layer->copy_dst, layer->copy_src, layer->fp16_bytes);
		return 0;
	case M_COMPRESSED_2T:
		return attend(layer, true, 2);
	case M_COUNT:
		break;
	}
	return -EINVAL;
}

/* ---- timing --------------------------------------------------------------- */

static int time_reps(struct layer *layer, enum measure m, unsigned reps, double *per_op)
{
	int rc = run_measure(layer, m); /* re-warm after the other measures ran */
	if (rc < 0)
		return rc;
	double t0 = now_s();
	for (unsigned i = 0; i < reps; i++)
		if ((rc = run_measure(layer, m)) < 0)
			return rc;
	*per_op = (now_s() - t0) / reps;
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int set_affinity(const cpu_set_t *set)
{
	return sched_setaffinity(0, sizeof *set, set) == 0 ? 0 : -errno;
}

/*
 * Medians of every measure. Run r does the measures in rotated order so
 * none is always the one right after another. The two-thread measure
 * runs unpinned; the others pinned to the first allowed CPU.
 */
static int measure_all(struct layer *layer, const struct options *opt, double *med)
{
	cpu_set_t all, one;
	unsigned reps[M_COUNT];
	double *t = calloc((size_t)M_COUNT * (size_t)opt->runs, sizeof *t);
	int rc = 0;

	if (!t)
		return -ENOMEM;
	sched_getaffinity(0, sizeof all, &all);
	CPU_ZERO(&one);
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &all)) {
			CPU_SET(c, &one);
			break;
		}
	for (int m = 0; m < M_COUNT && rc == 0; m++) {
		double one_op;
		set_affinity(m == M_COMPRESSED_2T ? &all : &one);
		if ((rc = time_reps(layer, (enum measure)m, 1, &one_op)) < 0)
			break;
		double want = ceil(opt->min_run_s / (one_op > 1e-9 ? one_op : 1e-9));
		reps[m] = want < 1.0 ? 1u : want > 1e6 ? 1000000u : (unsigned)want;
	}
	for (int r = 0; r < opt->runs && rc == 0; r++)
		for (int k = 0; k < M_COUNT && rc == 0; k++) {
			int m = (r + k) % M_COUNT;
			set_affinity(m == M_COMPRESSED_2T ? &all : &one);
			rc = time_reps(layer, (enum measure)m, reps[m], &t[m * opt->runs + r]);
		}
	set_affinity(&all);
	if (rc == 0)
		for (int m = 0; m < M_COUNT; m++)
			med[m] = median(t + m * opt->runs, opt->runs);
	free(t);
	return rc;
}

/* ---- the layer ------------------------------------------------------------ */

static void layer_free(struct layer *layer)
{
	for (size_t i = 0; i < 2 * layer->n_blocks; i++)
		free(layer->payloads[i]);
	free(layer->k16);
	free(layer->v16);
	free(layer->k32);
	free(layer->v32);
	free(layer->q);
	free(layer->out);
	free(layer->scores);
	free(layer->copy_src);
	free(layer->copy_dst);
}

static int compress_into(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, const uint16_t *input, void **payload,
			 size_t *bytes)
{
	zc_block_layout layout;
	int rc = zc_block_layout_compute(config, tensor, shape, &layout);
	if (rc < 0)
		return rc;
	*payload = alloc_touched(layout.total_bytes);
	if (!*payload)
		return -ENOMEM;
	int64_t n = zc_block_compress(config, tensor, shape, input, *payload, layout.total_bytes);
	if (n < 0)
		return (int)n;
	*bytes = (size_t)n;
	return 0;
}

static int layer_build(struct layer *layer, uint32_t tokens)
{
	zc_codec_config config;
	size_t n = (size_t)KV_HEADS * tokens * HEAD_DIM;
	int rc;

	memset(layer, 0, sizeof *layer);
	zc_codec_config_default(&config);
	layer->tokens = tokens;
	layer->fp16_bytes = 2 * 2 * n;
	layer->k16 = alloc_touched(2 * n);
	layer->v16 = alloc_touched(2 * n);
	layer->k32 = alloc_touched(4 * n);
	layer->v32 = alloc_touched(4 * n);
	layer->q = alloc_touched(4 * Q_HEADS * HEAD_DIM);
	layer->out = alloc_touched(4 * Q_HEADS * HEAD_DIM);
	layer->scores = alloc_touched(4 * (size_t)tokens);
	layer->copy_src = alloc_touched(layer->fp16_bytes);
	layer->copy_dst = alloc_touched(layer->fp16_bytes);
	if (!layer->k16 || !layer->v16 || !layer->k32 || !layer->v32 || !layer->q ||
	    !layer->out || !layer->scores || !layer->copy_src || !layer->copy_dst)
		return -ENOMEM;

	uint64_t seed = 0xa77e0000u + tokens;
	for (uint32_t t0 = 0; t0 < tokens; t0 += BLOCK_TOKENS) {
		uint32_t S = tokens - t0 < BLOCK_TOKENS ? tokens - t0 : BLOCK_TOKENS;
		size_t bn = (size_t)KV_HEADS * S * HEAD_DIM;
		uint16_t *k = malloc(2 * bn), *v = malloc(2 * bn);
		uint16_t *rk = malloc(2 * bn), *rv = malloc(2 * bn);
		zc_block_shape shape = { BATCH, KV_HEADS, S, HEAD_DIM };
		zc_strides strides = { (size_t)KV_HEADS * S * HEAD_DIM, (size_t)S * HEAD_DIM,
				       HEAD_DIM };
		size_t i = layer->n_blocks, kb = 0, vb = 0;
		if (!k || !v || !rk || !rv || i >= MAX_BLOCKS) {
			free(k), free(v), free(rk), free(rv);
			return -ENOMEM;
		}
		synthetic_kv_fill(k, KV_HEADS, S, HEAD_DIM, true, seed++);
		synthetic_kv_fill(v, KV_HEADS, S, HEAD_DIM, false, seed++);
		rc = compress_into(&config, ZC_TENSOR_KEYS, &shape, k, &layer->payloads[2 * i], &kb);
		if (rc == 0)
			rc = compress_into(&config, ZC_TENSOR_VALUES, &shape, v,
					   &layer->payloads[2 * i + 1], &vb);
		layer->n_blocks++;
		if (rc == 0)
			rc = zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape,
						  layer->payloads[2 * i], kb, rk, &strides);
		if (rc == 0)
			rc = zc_block_reconstruct(&config, ZC_TENSOR_VALUES, &shape,
						  layer->payloads[2 * i + 1], vb, rv, &strides);
		if (rc == 0)
			for (size_t h = 0; h < KV_HEADS; h++) {
				memcpy(layer->k16 + (h * tokens + t0) * HEAD_DIM, rk + h * S * HEAD_DIM,
				       2 * (size_t)S * HEAD_DIM);
				memcpy(layer->v16 + (h * tokens + t0) * HEAD_DIM, rv + h * S * HEAD_DIM,
				       2 * (size_t)S * HEAD_DIM);
			}
		free(k), free(v), free(rk), free(rv);
		if (rc < 0)
			return rc;
		layer->blocks[i].kind = ZC_ATTEND_BLOCK;
		layer->blocks[i].block = (zc_attend_block){
			.config = config, .shape = shape, .head_dim_v = HEAD_DIM, .valid_tokens = S,
			.keys = layer->payloads[2 * i], .key_bytes = kb,
			.values = layer->payloads[2 * i + 1], .value_bytes = vb };
		layer->compressed_bytes += kb + vb;
	}
	zc_strides view_strides = { (size_t)KV_HEADS * tokens * HEAD_DIM,
				    (size_t)tokens * HEAD_DIM, HEAD_DIM };
	layer->view.kind = ZC_ATTEND_ROWS;
	layer->view.rows = (zc_attend_rows){ .batch = BATCH, .heads = KV_HEADS, .tokens = tokens,
					     .head_dim_k = HEAD_DIM, .head_dim_v = HEAD_DIM,
					     .keys = layer->k16, .key_strides = view_strides,
					     .values = layer->v16, .value_strides = view_strides };
	/* A decode step's query: roughly what q of a real model looks like
	 * against these keys (the synthetic keys' channels, unit scale). */
	uint16_t *q16 = malloc(2 * Q_HEADS * HEAD_DIM);
	if (!q16)
		return -ENOMEM;
	synthetic_kv_fill(q16, Q_HEADS, 1, HEAD_DIM, false, seed++);
	for (size_t i = 0; i < Q_HEADS * HEAD_DIM; i++)
		layer->q[i] = zc_fp16_to_float(q16[i]);
	free(q16);
	memcpy(layer->copy_src, layer->k16, 2 * n);
	memcpy((uint8_t *)layer->copy_src + 2 * n, layer->v16, 2 * n);
	return 0;
}

/* The largest |compressed - fp16| output difference over the output's
 * largest magnitude: a sanity check that both paths compute attention. */
static int agreement(struct layer *layer, double *rel)
{
	size_t n = Q_HEADS * HEAD_DIM;
	float *a = malloc(4 * n);
	int rc;
	if (!a)
		return -ENOMEM;
	if ((rc = attend(layer, true, 1)) == 0) {
		memcpy(a, layer->out, 4 * n);
		rc = attend(layer, false, 1);
	}
	double diff = 0.0, top = 0.0;
	for (size_t i = 0; i < n && rc == 0; i++) {
		diff = fmax(diff, fabs((double)a[i] - layer->out[i]));
		top = fmax(top, fabs((double)layer->out[i]));
	}
	*rel = top > 0 ? diff / top : diff;
	free(a);
	return rc;
}

/* ---- main ----------------------------------------------------------------- */

static int parse_args(int argc, char **argv, struct options *opt)
{
	bool runs_set = false;
	*opt = (struct options){ .runs = DEFAULT_RUNS, .min_run_s = MIN_RUN_MS * 1e-3 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--quick")) {
			opt->quick = true;
		} else if (!strcmp(a, "--isa") && v) {
			i++;
			if (!strcmp(v, "scalar"))
				opt->isa = ZC_ISA_SCALAR;
			else if (!strcmp(v, "avx2"))
				opt->isa = ZC_ISA_AVX2;
			else if (!strcmp(v, "avx512"))
				opt->isa = ZC_ISA_AVX512;
			else
				return -1;
			opt->isa_forced = true;
		} else if (!strcmp(a, "--runs") && v) {
			char *end;
			long n = strtol(v, &end, 10);
			i++;
			if (*end || n < 1 || n > 10000)
				return -1;
			opt->runs = (int)n;
			runs_set = true;
		} else if (!strcmp(a, "--tokens") && v) {
			char *end;
			long n = strtol(v, &end, 10);
			i++;
			if (*end || n < 1 || n > (long)(BLOCK_TOKENS * MAX_BLOCKS))
				return -1;
			opt->tokens = (uint32_t)n;
		} else {
			return -1;
		}
	}
	if (opt->quick) {
		if (!runs_set)
			opt->runs = QUICK_RUNS;
		opt->min_run_s = QUICK_MIN_RUN_MS * 1e-3;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct options opt;
	static const uint32_t standard[] = { 4096, 32768 };
	uint32_t shapes[2];
	size_t n_shapes = 0;

	if (parse_args(argc, argv, &opt) < 0) {
		fprintf(stderr, "usage: attend [--isa scalar|avx2|avx512] [--runs N] [--tokens S] "
				"[--quick]\n");
		return 2;
	}
	zc_codec_init();
	if (opt.isa_forced && zc_codec_set_isa(opt.isa) < 0) {
		fprintf(stderr, "attend: this CPU cannot run %s\n", zc_isa_name(opt.isa));
		return 1;
	}
	if (opt.tokens)
		shapes[n_shapes++] = opt.tokens;
	else
		for (size_t i = 0; i < 2; i++)
			if (!opt.quick || standard[i] <= 4096)
				shapes[n_shapes++] = standard[i];

	printf("attention, one decode step: B=%u H_kv=%u q_heads=%u D=%u n_q=1, %s, median of %d\n",
	       BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, zc_isa_name(zc_codec_isa()), opt.runs);
	printf("%7s %10s %9s %11s %10s %13s | %9s %9s %9s %9s\n", "S", "compr ms", "fp16 ms",
	       "float32 ms", "memcpy ms", "2 threads ms", "c/fp16", "limit/fp16", "c/f32",
	       "1->2 thr");
	for (size_t s = 0; s < n_shapes; s++) {
		struct layer layer;
		double med[M_COUNT], rel;
		int rc = layer_build(&layer, shapes[s]);
		if (rc == 0)
			rc = agreement(&layer, &rel);
		if (rc == 0)
			rc = measure_all(&layer, &opt, med);
		if (rc < 0) {
			fprintf(stderr, "attend: S=%u: %s\n", shapes[s], zc_strerror(rc));
			layer_free(&layer);
			return 1;
		}
		double c_fp16 = med[M_COMPRESSED] / med[M_FP16];
		double limit = med[M_MEMCPY] / med[M_FP16];
		double c_f32 = med[M_COMPRESSED] / med[M_FLOAT32_C];
		double scaling = med[M_COMPRESSED] / med[M_COMPRESSED_2T];
		printf("%7u %10.3f %9.3f %11.3f %10.3f %13.3f | %9.3f %9.3f %9.3f %9.3f\n",
		       shapes[s], 1e3 * med[M_COMPRESSED], 1e3 * med[M_FP16],
		       1e3 * med[M_FLOAT32_C], 1e3 * med[M_MEMCPY], 1e3 * med[M_COMPRESSED_2T],
		       c_fp16, limit, c_f32, scaling);
		for (int m = 0; m < M_COUNT; m++)
			printf("{\"bench\":\"attend\",\"tokens\":%u,\"op\":\"%s\",\"median_ms\":%.4f,"
			       "\"isa\":\"%s\",\"runs\":%d}\n",
			       shapes[s], measure_names[m], 1e3 * med[m], zc_isa_name(zc_codec_isa()),
			       opt.runs);
		printf("{\"bench\":\"attend\",\"tokens\":%u,\"op\":\"summary\","
		       "\"compressed_over_fp16\":%.4f,\"fp16_limit_fraction\":%.4f,"
		       "\"compressed_over_float32_c\":%.4f,\"threads_1_to_2_speedup\":%.4f,"
		       "\"fp16_bytes\":%zu,\"compressed_bytes\":%zu,\"memcpy_gbps\":%.3f,"
		       "\"compressed_vs_fp16_max_rel_diff\":%.3g,\"isa\":\"%s\",\"runs\":%d}\n",
		       shapes[s], c_fp16, limit, c_f32, scaling, layer.fp16_bytes,
		       layer.compressed_bytes, layer.fp16_bytes / med[M_MEMCPY] / 1e9, rel,
		       zc_isa_name(zc_codec_isa()), opt.runs);
		fflush(stdout);
		layer_free(&layer);
	}
	return 0;
}
