/*
 * Codec throughput benchmark.
 *
 * Measures zc_block_compress() and zc_block_reconstruct() on the K/V block
 * shapes of one Llama-3-8B layer (B = 1, H = 8 KV heads, D = 128):
 *
 *   S = 128     a streaming decode block (L2-resident)
 *   S = 4096    a prefill block that fits the last-level cache
 *   S = 32768   a prefill block that lives in DRAM
 *
 * Throughput is fp16 bytes per second (2*B*H*S*D bytes, GB = 1e9 bytes)
 * and, because this machine is shared and noisy, also a ratio to memcpy of
 * the same number of bytes between two separate buffers, timed the same
 * way and interleaved run by run with the codec measurement so that a
 * noisy neighbour slows both. The ratio is the figure to compare across
 * machines and days; the absolute GB/s is only for this run.
 *
 * Every figure is the median of --runs timed runs; a timed run repeats the
 * operation enough times to last at least MIN_RUN_MS so that clock
 * resolution and call overhead vanish for the small streaming block, and
 * starts with one untimed operation so that the S = 4096 block really is
 * measured cache-resident even though the other side of the interleaving
 * ran in between (both sides alike). The process is pinned to one CPU: the codec is single-threaded per block and
 * migration between cores would throw away the warm cache.
 *
 * A prefill's memory (after the shapes, or alone with --prefill): the
 * codec as the daemon meets a prefill, 32 layers of keys and values of H
 * heads x 4096 tokens, one head a call (the daemon's unit), input and
 * views 512 MiB each at H = 8, so each layer comes from and goes to
 * memory no cache holds; with views written in the encode's pass
 * (zc_block_compress_view) and without. Whole prefills are timed, keys
 * and values apart, against memcpy of the same bytes from the input to
 * the views, run by run.
 *
 * Output: an aligned table for people, then one JSON object per
 * measurement per line (lines starting with '{') for scripts.
 *
 * usage: codec [--isa scalar|avx2|avx512] [--runs N] [--cpu N] [--tokens S]
 *              [--heads H] [--prefill] [--quick]
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "synthetic_kv.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define BATCH 1u
/* KV heads per block: a Llama-3-8B layer's 8, or --heads (1: one head,
 * as the daemon hands the codec a prefill, in L2 at S = 4096). */
static uint32_t bench_heads = 8;
#define HEAD_DIM 128u

#define DEFAULT_RUNS 11
#define MIN_RUN_MS 2.0
/* --quick only has to show that every path runs, not measure it well. */
#define QUICK_RUNS 3
#define QUICK_MIN_RUN_MS 0.2

#define MAX_RESULTS 32

/* Targets from the issue, for the cache-resident prefill block. */
#define TARGET_TOKENS 4096u
#define TARGET_RECONSTRUCT 0.5
#define TARGET_COMPRESS 0.2

struct options {
	int runs;
	double min_run_s;
	bool quick;
	bool isa_forced;
	zc_isa isa;
	int cpu;          /* -1: the first CPU we are allowed on */
	uint32_t tokens;  /* 0: the standard shapes; else only S = tokens */
	bool prefill_only;
};

struct result {
	char shape[40];
	char op[32];
	const char *tensor;
	zc_isa isa;
	double fp16_bytes;
	double codec_s;   /* median seconds per operation */
	double memcpy_s;  /* median seconds per memcpy of fp16_bytes */
	int runs;
};

struct block_note {
	char shape[40];
	const char *tensor;
	double fp16_bytes;
	double compressed_bytes;
	double rel_rmse;
};

static struct result results[MAX_RESULTS];
static int n_results;
static struct block_note notes[MAX_RESULTS];
static int n_notes;

/*
 * Called through a volatile pointer so the compiler can neither inline the
 * copy into something cleverer than what a caller gets, nor drop it because
 * the destination is never read.
 */
static void *(*volatile memcpy_fn)(void *, const void *, size_t) = memcpy;

/* ---- timing ------------------------------------------------------------ */

struct op {
	/* One operation; returns < 0 on a codec error. */
	int (*run)(struct op *op);
	const zc_codec_config *config;
	zc_tensor tensor;
	const zc_block_shape *shape;
	const uint16_t *input;
	void *compressed;
	size_t compressed_size;   /* exact layout size */
	uint16_t *output;
	const zc_strides *strides;
	/* memcpy */
	void *dst;
	const void *src;
	size_t bytes;
};

static int op_compress(struct op *op)
{
	int64_t n = zc_block_compress(op->config, op->tensor, op->shape, op->input,
				      op->compressed, op->compressed_size);
	if (n < 0)
		return (int)n;
	return (size_t)n == op->compressed_size ? 0 : ZC_ECORRUPT;
}

static int op_reconstruct(struct op *op)
{
	return zc_block_reconstruct(op->config, op->tensor, op->shape, op->compressed,
				    op->compressed_size, op->output, op->strides);
}

/* Compress and the view's reconstruction in one call (a session's block
 * with views): to set against compress + reconstruct. */
static int op_compress_view(struct op *op)
{
	int64_t n = zc_block_compress_view(op->config, op->tensor, op->shape, op->input,
					   op->strides, NULL, op->compressed,
					   op->compressed_size, op->output, op->strides);
	if (n < 0)
		return (int)n;
	return (size_t)n == op->compressed_size ? 0 : ZC_ECORRUPT;
}

static int op_memcpy(struct op *op)
{
	memcpy_fn(op->dst, op->src, op->bytes);
	return 0;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/*
 * Seconds per operation over reps back-to-back operations, after one
 * untimed operation: the other side of the interleaving has just run and
 * evicted part of the last-level cache, and without this re-warm a
 * cache-resident block would be measured half cold, unfairly so for
 * whichever side repeats fewer times per run.
 */
static int time_op(struct op *op, unsigned reps, double *per_op)
{
	int rc = op->run(op);
	if (rc < 0)
		return rc;
	double t0 = now_s();
	for (unsigned i = 0; i < reps; i++)
		if ((rc = op->run(op)) < 0)
			return rc;
	*per_op = (now_s() - t0) / reps;
	return 0;
}

/* Repetitions that make one timed run last at least min_run_s, judged
 * from one (already warm) operation. */
static int calibrate(struct op *op, double min_run_s, unsigned *reps)
{
	double one;
	int rc = time_op(op, 1, &one);
	if (rc < 0)
		return rc;
	double want = ceil(1.2 * min_run_s / (one > 1e-9 ? one : 1e-9));
	*reps = want < 1.0 ? 1u : want > 1e6 ? 1000000u : (unsigned)want;
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

/*
 * Times codec and memcpy in alternation, run r codec first and run r+1
 * memcpy first, so a burst of noise from a neighbour lands on both sides
 * and neither is systematically the one that runs right after it.
 */
static int measure(struct op *codec, struct op *copy, const struct options *opt,
		   double *codec_s, double *memcpy_s)
{
	unsigned reps_c, reps_m;
	int rc;

	/* Warm-up: page-in, cache fill, branch predictors, lazy init. */
	if ((rc = codec->run(codec)) < 0 || (rc = copy->run(copy)) < 0)
		return rc;
	if ((rc = calibrate(codec, opt->min_run_s, &reps_c)) < 0 ||
	    (rc = calibrate(copy, opt->min_run_s, &reps_m)) < 0)
		return rc;
	double *tc = malloc(2 * sizeof(double) * (size_t)opt->runs);
	if (!tc)
		return -ENOMEM;
	double *tm = tc + opt->runs;
	for (int r = 0; r < opt->runs; r++) {
		if (r % 2 == 0) {
			if ((rc = time_op(codec, reps_c, &tc[r])) < 0 ||
			    (rc = time_op(copy, reps_m, &tm[r])) < 0)
				break;
		} else {
			if ((rc = time_op(copy, reps_m, &tm[r])) < 0 ||
			    (rc = time_op(codec, reps_c, &tc[r])) < 0)
				break;
		}
	}
	if (rc >= 0) {
		*codec_s = median(tc, opt->runs);
		*memcpy_s = median(tm, opt->runs);
	}
	free(tc);
	return rc < 0 ? rc : 0;
}

/* ---- reporting --------------------------------------------------------- */

static double gbps(double bytes, double s)
{
	return bytes / s / 1e9;
}

static void print_header(void)
{
	printf("%-18s %-20s %-7s %9s %10s %9s %12s %7s\n", "shape", "op", "isa",
	       "fp16 MiB", "median ms", "GB/s", "memcpy GB/s", "ratio");
}

static void print_row(const struct result *r)
{
	printf("%-18s %-20s %-7s %9.3f %10.4f %9.3f %12.3f %7.3f\n", r->shape, r->op,
	       zc_isa_name(r->isa), r->fp16_bytes / (1024.0 * 1024.0), r->codec_s * 1e3,
	       gbps(r->fp16_bytes, r->codec_s), gbps(r->fp16_bytes, r->memcpy_s),
	       r->memcpy_s / r->codec_s);
	fflush(stdout);
}

static void print_json(const struct result *r)
{
	/* ratio is the ratio of the two medians, so that it always equals
	 * gbps / memcpy_gbps for a reader who recomputes it. */
	printf("{\"bench\":\"codec\",\"shape\":\"%s\",\"op\":\"%s\",\"gbps\":%.4f,"
	       "\"memcpy_gbps\":%.4f,\"ratio\":%.4f,\"isa\":\"%s\",\"tensor\":\"%s\","
	       "\"median_ms\":%.5f,\"runs\":%d}\n",
	       r->shape, r->op, gbps(r->fp16_bytes, r->codec_s),
	       gbps(r->fp16_bytes, r->memcpy_s), r->memcpy_s / r->codec_s,
	       zc_isa_name(r->isa), r->tensor, r->codec_s * 1e3, r->runs);
}

static const struct result *find_result(uint32_t tokens, const char *op, zc_isa isa)
{
	char shape[40];
	snprintf(shape, sizeof shape, "B%uxH%uxS%uxD%u", BATCH, bench_heads, tokens, HEAD_DIM);
	for (int i = 0; i < n_results; i++)
		if (!strcmp(results[i].shape, shape) && !strcmp(results[i].op, op) &&
		    results[i].isa == isa)
			return &results[i];
	return NULL;
}

/* ---- one shape --------------------------------------------------------- */

static void *alloc_touched(size_t bytes)
{
	/* 64-byte aligned like any real tensor allocation, and written once
	 * so page faults are not part of the first timed run. */
	size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded ? rounded : 64);
	if (p)
		memset(p, 0x5a, rounded);
	return p;
}

static double rel_rmse(const uint16_t *x, const uint16_t *y, size_t n)
{
	double err = 0.0, ref = 0.0;
	for (size_t i = 0; i < n; i++) {
		double a = zc_fp16_to_float(x[i]), b = zc_fp16_to_float(y[i]);
		err += (a - b) * (a - b);
		ref += a * a;
	}
	return ref > 0.0 ? sqrt(err / ref) : 0.0;
}

/*
 * Benchmarks compress and reconstruct of one tensor kind at one shape.
 * which: bit 0 compress, bit 1 reconstruct, bit 2 compress with a view.
 */
static int bench_tensor(const struct options *opt, uint32_t tokens, zc_tensor tensor,
			int which, bool note)
{
	zc_codec_config config;
	zc_block_shape shape = {BATCH, bench_heads, tokens, HEAD_DIM};
	zc_block_layout layout;
	const char *tname = tensor == ZC_TENSOR_KEYS ? "keys" : "values";
	size_t n = (size_t)BATCH * bench_heads * tokens * HEAD_DIM;
	size_t bytes = 2 * n;
	int rc;

	zc_codec_config_default(&config);
	if ((rc = zc_block_layout_compute(&config, tensor, &shape, &layout)) < 0) {
		fprintf(stderr, "codec: layout S=%u %s: %s\n", tokens, tname, zc_strerror(rc));
		return rc;
	}

	uint16_t *input = alloc_touched(bytes);
	uint16_t *output = alloc_touched(bytes);
	void *compressed = alloc_touched(layout.total_bytes);
	void *copy_src = alloc_touched(bytes);
	void *copy_dst = alloc_touched(bytes);
	if (!input || !output || !compressed || !copy_src || !copy_dst) {
		fprintf(stderr, "codec: out of memory at S=%u\n", tokens);
		rc = -ENOMEM;
		goto out;
	}
	synthetic_kv_fill(input, BATCH * bench_heads, tokens, HEAD_DIM, tensor == ZC_TENSOR_KEYS,
			  0x5eed0000u + tokens * 2u + (unsigned)tensor);
	memcpy(copy_src, input, bytes);

	zc_strides strides = {(size_t)bench_heads * tokens * HEAD_DIM, (size_t)tokens * HEAD_DIM,
			      HEAD_DIM};
	struct op compress = {.run = op_compress, .config = &config, .tensor = tensor,
			      .shape = &shape, .input = input, .compressed = compressed,
			      .compressed_size = layout.total_bytes};
	struct op reconstruct = {.run = op_reconstruct, .config = &config, .tensor = tensor,
				 .shape = &shape, .compressed = compressed,
				 .compressed_size = layout.total_bytes, .output = output,
				 .strides = &strides};
	struct op compress_view = {.run = op_compress_view, .config = &config, .tensor = tensor,
				   .shape = &shape, .input = input, .compressed = compressed,
				   .compressed_size = layout.total_bytes, .output = output,
				   .strides = &strides};
	struct op *ops[3] = {&compress, &reconstruct, &compress_view};
	static const char *const op_names[3] = {"compress", "reconstruct", "compress_view"};
	struct op copy = {.run = op_memcpy, .dst = copy_dst, .src = copy_src, .bytes = bytes};

	/* Reconstruct needs a real payload, and a benchmark of a codec that
	 * returns garbage is worthless: check both directions once first. */
	if ((rc = op_compress(&compress)) < 0 || (rc = op_reconstruct(&reconstruct)) < 0) {
		fprintf(stderr, "codec: S=%u %s on %s: %s\n", tokens, tname,
			zc_isa_name(zc_codec_isa()), zc_strerror(rc));
		goto out;
	}
	if (note && n_notes < MAX_RESULTS) {
		struct block_note *b = &notes[n_notes++];
		snprintf(b->shape, sizeof b->shape, "B%uxH%uxS%uxD%u", BATCH, bench_heads, tokens,
			 HEAD_DIM);
		b->tensor = tname;
		b->fp16_bytes = (double)bytes;
		b->compressed_bytes = (double)layout.total_bytes;
		b->rel_rmse = rel_rmse(input, output, n);
	}

	for (int k = 0; k < 3; k++) {
		if (!(which & (1 << k)) || n_results >= MAX_RESULTS)
			continue;
		struct result *r = &results[n_results];
		snprintf(r->shape, sizeof r->shape, "B%uxH%uxS%uxD%u", BATCH, bench_heads, tokens,
			 HEAD_DIM);
		snprintf(r->op, sizeof r->op, "%s_%s", op_names[k], tname);
		r->tensor = tname;
		r->isa = zc_codec_isa();
		r->fp16_bytes = (double)bytes;
		r->runs = opt->runs;
		rc = measure(ops[k], &copy, opt, &r->codec_s, &r->memcpy_s);
		if (rc < 0) {
			fprintf(stderr, "codec: %s S=%u: %s\n", r->op, tokens, zc_strerror(rc));
			goto out;
		}
		n_results++;
		print_row(r);
	}
	rc = 0;
out:
	free(input);
	free(output);
	free(compressed);
	free(copy_src);
	free(copy_dst);
	return rc;
}

/* ---- a prefill's memory ------------------------------------------------ */

#define PREFILL_LAYERS 32u
#define QUICK_PREFILL_LAYERS 2u
#define PREFILL_TOKENS 4096u

/* Its JSON lines, views then none, printed with the others at the end. */
static char prefill_json[2][512];

struct prefill_memory {
	uint32_t layers;
	size_t head_elements, tensor_elements;
	uint16_t *input, *views;       /* [layer][keys, values][H][S][D] */
	uint8_t *out;
	size_t head_bytes[2];          /* payload of one head, keys and values */
};

/* One whole prefill, one head a codec call; seconds per tensor. */
static int prefill_pass(const struct prefill_memory *m, const zc_codec_config *config,
			bool views, double seconds[2])
{
	const zc_block_shape one = { 1, 1, PREFILL_TOKENS, HEAD_DIM };
	const zc_strides strides = { m->tensor_elements, m->head_elements, HEAD_DIM };
	uint8_t *out = m->out;

	seconds[0] = seconds[1] = 0.0;
	for (uint32_t layer = 0; layer < m->layers; layer++) {
		for (int t = 0; t < 2; t++) {
			size_t at = (2 * (size_t)layer + (size_t)t) * m->tensor_elements;
			double t0 = now_s();
			for (uint32_t h = 0; h < bench_heads; h++) {
				size_t head = at + h * m->head_elements;
				int64_t n = views ?
					zc_block_compress_view(config, (zc_tensor)t, &one,
							       m->input + head, &strides, NULL,
							       out, m->head_bytes[t],
							       m->views + head, &strides) :
					zc_block_compress_strided(config, (zc_tensor)t, &one,
								  m->input + head, &strides,
								  out, m->head_bytes[t]);
				if (n < 0)
					return (int)n;
				out += m->head_bytes[t];
			}
			seconds[t] += now_s() - t0;
		}
	}
	return 0;
}

/* The same bytes, layer by layer, from the input to the views. */
static double prefill_memcpy(const struct prefill_memory *m)
{
	double total = 0.0;
	for (uint32_t layer = 0; layer < m->layers; layer++) {
		size_t at = 2 * (size_t)layer * m->tensor_elements;
		double t0 = now_s();
		memcpy_fn(m->views + at, m->input + at, 4 * m->tensor_elements);
		total += now_s() - t0;
	}
	return total;
}

static int bench_prefill_memory(const struct options *opt)
{
	zc_codec_config config;
	zc_block_layout layout;
	struct prefill_memory m = {
		.layers = opt->quick ? QUICK_PREFILL_LAYERS : PREFILL_LAYERS,
		.head_elements = (size_t)PREFILL_TOKENS * HEAD_DIM,
	};
	const zc_block_shape one = { 1, 1, PREFILL_TOKENS, HEAD_DIM };
	int rc;

	zc_codec_config_default(&config);
	m.tensor_elements = m.head_elements * bench_heads;
	for (int t = 0; t < 2; t++) {
		if ((rc = zc_block_layout_compute(&config, (zc_tensor)t, &one, &layout)) < 0)
			return rc;
		m.head_bytes[t] = layout.total_bytes;
	}
	size_t elements = 2 * m.tensor_elements * m.layers;
	m.input = alloc_touched(2 * elements);
	m.views = alloc_touched(2 * elements);
	m.out = alloc_touched((m.head_bytes[0] + m.head_bytes[1]) * bench_heads * m.layers);
	double *t = calloc(4 * (size_t)opt->runs, sizeof *t);
	rc = -ENOMEM;
	if (!m.input || !m.views || !m.out || !t)
		goto out;
	synthetic_kv_fill(m.input, bench_heads, PREFILL_TOKENS, HEAD_DIM, true, 0x5e7e3000u);
	synthetic_kv_fill(m.input + m.tensor_elements, bench_heads, PREFILL_TOKENS, HEAD_DIM,
			  false, 0x5e7e3001u);
	for (uint32_t layer = 1; layer < m.layers; layer++)
		memcpy(m.input + 2 * (size_t)layer * m.tensor_elements, m.input,
		       4 * m.tensor_elements);

	printf("\na prefill's memory: %u layers x %u KV heads x S=%u x D=%u, keys and values, "
	       "one head a call, %.0f MiB in, median of %d\n",
	       m.layers, bench_heads, PREFILL_TOKENS, HEAD_DIM, 2.0 * elements / (1 << 20),
	       opt->runs);
	printf("  %-22s %10s %10s %10s %12s %7s\n", "op", "keys ms", "values ms", "total ms",
	       "memcpy ms", "ratio");
	for (int views = 1; views >= 0; views--) {
		double *keys = t, *values = t + opt->runs, *total = t + 2 * opt->runs;
		double *copy = t + 3 * opt->runs, pass[2];
		/* One untimed pass: the code and the output's pages. */
		if ((rc = prefill_pass(&m, &config, views, pass)) < 0)
			goto out;
		for (int r = 0; r < opt->runs; r++) {
			if (r % 2)
				copy[r] = prefill_memcpy(&m);
			if ((rc = prefill_pass(&m, &config, views, pass)) < 0)
				goto out;
			if (r % 2 == 0)
				copy[r] = prefill_memcpy(&m);
			keys[r] = pass[0];
			values[r] = pass[1];
			total[r] = pass[0] + pass[1];
		}
		const char *op = views ? "prefill_compress_view" : "prefill_compress";
		double k = median(keys, opt->runs), v = median(values, opt->runs);
		double all = median(total, opt->runs), c = median(copy, opt->runs);
		printf("  %-22s %10.1f %10.1f %10.1f %12.1f %7.3f\n", op, k * 1e3, v * 1e3,
		       all * 1e3, c * 1e3, c / all);
		snprintf(prefill_json[views], sizeof prefill_json[views],
			 "{\"bench\":\"codec\",\"op\":\"%s\",\"shape\":\"L%uxH%uxS%uxD%u\","
			 "\"isa\":\"%s\",\"keys_ms\":%.3f,\"values_ms\":%.3f,\"median_ms\":%.3f,"
			 "\"memcpy_ms\":%.3f,\"ratio\":%.4f,\"runs\":%d}",
			 op, m.layers, bench_heads, PREFILL_TOKENS, HEAD_DIM,
			 zc_isa_name(zc_codec_isa()), k * 1e3, v * 1e3, all * 1e3, c * 1e3,
			 c / all, opt->runs);
	}
	rc = 0;
out:
	if (rc == -ENOMEM)
		fprintf(stderr, "codec: prefill: out of memory\n");
	free(m.input);
	free(m.views);
	free(m.out);
	free(t);
	return rc;
}

/* ---- main -------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f, "usage: codec [--isa scalar|avx2|avx512] [--runs N] [--cpu N] [--tokens S]\n"
		   "             [--heads H] [--prefill] [--quick]\n"
		   "  --isa     force a kernel set (default: the best this CPU has)\n"
		   "  --runs    timed runs per figure, median reported (default %d)\n"
		   "  --cpu     CPU to pin to (default: the first one allowed)\n"
		   "  --tokens  only the block of S tokens (e.g. to profile one shape)\n"
		   "  --heads   KV heads per block (default 8; 1: one head, as the daemon\n"
		   "            hands the codec a prefill, in L2 at S = 4096)\n"
		   "  --prefill only a prefill's memory: 32 layers of H heads, input and\n"
		   "            views in no cache, one head a call\n"
		   "  --quick   smoke test: %d runs, short runs, no DRAM-sized block\n",
		DEFAULT_RUNS, QUICK_RUNS);
}

static int parse_args(int argc, char **argv, struct options *opt)
{
	bool runs_set = false;
	long n;

	*opt = (struct options){.runs = DEFAULT_RUNS, .min_run_s = MIN_RUN_MS * 1e-3,
				.cpu = -1};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			exit(0);
		} else if (!strcmp(a, "--quick")) {
			opt->quick = true;
		} else if (!strcmp(a, "--prefill")) {
			opt->prefill_only = true;
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
			if (bench_parse_int(v, 1, 100000, &n) < 0)
				return -1;
			opt->runs = (int)n;
			runs_set = true;
			i++;
		} else if (!strcmp(a, "--cpu") && v) {
			if (bench_parse_int(v, 0, CPU_SETSIZE - 1, &n) < 0)
				return -1;
			opt->cpu = (int)n;
			i++;
		} else if (!strcmp(a, "--heads") && v) {
			if (bench_parse_int(v, 1, 64, &n) < 0)
				return -1;
			bench_heads = (uint32_t)n;
			i++;
		} else if (!strcmp(a, "--tokens") && v) {
			if (bench_parse_int(v, 1, 1L << 20, &n) < 0)
				return -1;
			opt->tokens = (uint32_t)n;
			i++;
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

/* Pins to one CPU; returns it, or -1 if pinning failed (we still run). */
static int pin_cpu(int want)
{
	cpu_set_t set;

	if (want < 0) {
		if (sched_getaffinity(0, sizeof set, &set) != 0)
			return -1;
		for (int c = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &set)) {
				want = c;
				break;
			}
		if (want < 0)
			return -1;
	}
	CPU_ZERO(&set);
	CPU_SET(want, &set);
	if (sched_setaffinity(0, sizeof set, &set) != 0) {
		fprintf(stderr, "codec: cannot pin to CPU %d: %s (running unpinned)\n", want,
			strerror(errno));
		return -1;
	}
	return want;
}

static void print_targets(zc_isa isa)
{
	static const struct {
		const char *op;
		double target;
	} t[] = {
		{"compress_keys", TARGET_COMPRESS},
		{"reconstruct_keys", TARGET_RECONSTRUCT},
		{"compress_values", TARGET_COMPRESS},
		{"reconstruct_values", TARGET_RECONSTRUCT},
	};

	printf("\ntargets at S=%u (%s, ratio to memcpy):\n", TARGET_TOKENS, zc_isa_name(isa));
	for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
		const struct result *r = find_result(TARGET_TOKENS, t[i].op, isa);
		if (!r)
			continue;
		double ratio = r->memcpy_s / r->codec_s;
		printf("  %-20s %6.3f  >= %.1f  %s\n", t[i].op, ratio, t[i].target,
		       ratio >= t[i].target ? "met" : "MISSED");
	}
}

int main(int argc, char **argv)
{
	struct options opt;
	static const uint32_t all_tokens[] = {128, 4096, 32768};
	static const uint32_t quick_tokens[] = {128, 4096};
	const uint32_t *tokens = all_tokens;
	size_t n_tokens = sizeof all_tokens / sizeof all_tokens[0];

	if (parse_args(argc, argv, &opt) < 0) {
		usage(stderr);
		return 2;
	}
	if (opt.tokens) {
		tokens = &opt.tokens;
		n_tokens = 1;
	} else if (opt.quick) {
		tokens = quick_tokens;
		n_tokens = sizeof quick_tokens / sizeof quick_tokens[0];
	}

	int cpu = pin_cpu(opt.cpu);
	zc_codec_init();
	if (opt.isa_forced) {
		int rc = zc_codec_set_isa(opt.isa);
		if (rc < 0) {
			fprintf(stderr, "codec: isa %s: %s\n", zc_isa_name(opt.isa),
				zc_strerror(rc));
			return 1;
		}
	}
	zc_isa best = zc_codec_isa();

	if (opt.prefill_only) {
		printf("codec benchmark: isa %s, cpu %d%s\n", zc_isa_name(best), cpu,
		       opt.quick ? ", QUICK (smoke test, not a measurement)" : "");
		if (bench_prefill_memory(&opt) < 0)
			return 1;
		printf("\n%s\n%s\n", prefill_json[1], prefill_json[0]);
		return 0;
	}
	printf("codec benchmark: isa %s, cpu %d, %d runs per figure (median), "
	       ">= %.1f ms per run%s\n",
	       zc_isa_name(best), cpu, opt.runs, opt.min_run_s * 1e3,
	       opt.quick ? ", QUICK (smoke test, not a measurement)" : "");
	printf("GB/s = 1e9 fp16 bytes (2*B*H*S*D) per second; ratio = codec GB/s / memcpy "
	       "GB/s, same bytes, interleaved\n\n");
	print_header();

	for (size_t i = 0; i < n_tokens; i++)
		for (int t = 0; t < 2; t++)
			if (bench_tensor(&opt, tokens[i], (zc_tensor)t, 7, true) < 0)
				return 1;

	/* The scalar path at the cache-resident shape, so the SIMD speedup is
	 * visible in every default run without a second invocation. */
	bool scalar_ref = !opt.isa_forced && best != ZC_ISA_SCALAR &&
			  (!opt.tokens || opt.tokens == TARGET_TOKENS);
	if (scalar_ref) {
		if (zc_codec_set_isa(ZC_ISA_SCALAR) < 0 ||
		    bench_tensor(&opt, TARGET_TOKENS, ZC_TENSOR_KEYS, 3, false) < 0)
			return 1;
		zc_codec_set_isa(best);
	}

	printf("\nblocks (default config):\n");
	printf("  %-18s %-7s %10s %12s %7s %9s\n", "shape", "tensor", "fp16 B",
	       "compressed B", "x", "rel RMSE");
	for (int i = 0; i < n_notes; i++) {
		const struct block_note *b = &notes[i];
		printf("  %-18s %-7s %10.0f %12.0f %7.2f %9.4f\n", b->shape, b->tensor,
		       b->fp16_bytes, b->compressed_bytes, b->fp16_bytes / b->compressed_bytes,
		       b->rel_rmse);
	}

	if (scalar_ref) {
		printf("\n%s speedup over scalar at S=%u keys:", zc_isa_name(best), TARGET_TOKENS);
		static const char *const ops[] = {"compress_keys", "reconstruct_keys"};
		for (int k = 0; k < 2; k++) {
			const struct result *s = find_result(TARGET_TOKENS, ops[k], ZC_ISA_SCALAR);
			const struct result *v = find_result(TARGET_TOKENS, ops[k], best);
			if (s && v)
				printf("  %s %.2fx", ops[k], s->codec_s / v->codec_s);
		}
		printf("\n");
	}
	print_targets(best);
	if (!opt.tokens && bench_prefill_memory(&opt) < 0)
		return 1;

	printf("\n");
	for (int i = 0; i < n_results; i++)
		print_json(&results[i]);
	for (int views = 1; views >= 0 && !opt.tokens; views--)
		printf("%s\n", prefill_json[views]);
	return 0;
}
