/*
 * Session-level attention benchmark: what zc_attend (the reader protocol
 * around the compute core) costs over zc_attend_segments on the same
 * blocks. One decode step (n_q = 1) of one layer shaped like
 * bench/attend_bench.c's: B = 1, H_kv = 8, q_heads = 32, D = 128, at
 * S = 4096 and 32768, the layer filled through a real zipcached (started
 * here, ZC_BUILD_DIR/bin/zipcached or --daemon) in prefill blocks of
 * BLOCK_TOKENS:
 *
 *   session        zc_attend over a views = none session: its blocks in
 *                  the pool mapping, read inside zc_read_begin/end
 *   segments       zc_attend_segments over the same payloads (segments
 *                  built once, outside any read): the compute core alone
 *   session_view   zc_attend with ZC_ATTEND_OVER_VIEW over a views = full
 *                  session holding the same tokens
 *   segments_view  zc_attend_segments over those view rows, cut the same
 *   session_2t     session with 2 threads
 *   read_only      the reader's part of session alone: begin, the layout,
 *                  every block entry, end (no attention): the overhead
 *                  in absolute terms, which the noise of two 2 % apart
 *                  medians hides
 *
 * and reports session / segments - 1 (the reader's overhead, both kinds)
 * twice: as a ratio of the medians, and as the median of the ratios of
 * back-to-back pairs of calls (order alternating; on a shared machine the
 * pairs see the same neighbours, the medians need not),
 * session / session_view (compressed against fp16, like for like), and
 * the 1 -> 2 thread speedup. Every figure is the median of --runs timed
 * runs, rotated as in attend_bench; one-thread measures are pinned to one
 * CPU. The daemon is idle while the clock runs (no request is made).
 *
 * Output: a table, then JSON lines (starting with '{').
 *
 * usage: attend_session [--runs N] [--tokens S] [--quick] [--daemon PATH]
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "synthetic_kv.h"
#include "zipcache/attend.h"
#include "zipcache/client.h"
#include "zipcache/error.h"
#include "zipcache/reader.h"

#define KV_HEADS 8u
#define Q_HEADS 32u
#define HEAD_DIM 128u
#define BLOCK_TOKENS 4096u
#define MAX_TOKENS 65536u

#define DEFAULT_RUNS 11
#define MIN_RUN_MS 20.0
#define QUICK_RUNS 3
#define QUICK_MIN_RUN_MS 1.0
/* Back-to-back pairs for the paired overhead: about a second of calls at
 * S = 4096, as many fewer as a call is longer (at least QUICK_PAIRS). */
#define PAIRS_AT_4096 201
#define QUICK_PAIRS 11

enum measure { M_SESSION, M_SEGMENTS, M_SESSION_VIEW, M_SEGMENTS_VIEW, M_SESSION_2T, M_READ,
	       M_COUNT };
static const char *const measure_names[M_COUNT] = { "session", "segments", "session_view",
						    "segments_view", "session_2_threads",
						    "read_only" };

struct options {
	int runs;
	double min_run_s;
	bool quick;
	uint32_t tokens;
	const char *daemon;
};

struct bench {
	zc_session *none, *full;
	zc_attend_segment *blocks, *view;   /* built once, inside one read each */
	size_t n_segments;
	float *q, *out, *check;
	size_t out_bytes;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the daemon (bench/bench_daemon.c, as the other benchmarks start it) ---- */

static void daemon_stop(void)
{
	bench_daemon_stop();
	bench_dir_remove();
}

static int daemon_start(const char *path, zc_client **client)
{
	int rc = bench_dir_make("attend-session");
	return rc < 0 ? rc : bench_daemon_start(path, -1, NULL, client);
}

/* ---- the layer ------------------------------------------------------------ */

static int session_fill(zc_client *client, zc_views views, uint32_t tokens, zc_session **out)
{
	zc_session_config config;
	size_t n = (size_t)KV_HEADS * BLOCK_TOKENS * HEAD_DIM;
	uint16_t *k = malloc(2 * n), *v = malloc(2 * n);
	zc_view view;
	int rc;

	zc_session_config_default(&config);
	config.name = views == ZC_VIEWS_NONE ? "attend-bench-none" : "attend-bench-full";
	config.layers = 1;
	config.batch = 1;
	config.kv_heads = KV_HEADS;
	config.head_dim_k = config.head_dim_v = HEAD_DIM;
	config.max_tokens = tokens;
	config.views = views;
	if (!k || !v) {
		free(k), free(v);
		return -ENOMEM;
	}
	rc = zc_session_open(client, &config, out);
	/* The same bytes into both sessions: attend_bench's seeds. */
	uint64_t seed = 0xa77e0000u + tokens;
	for (uint32_t t0 = 0; rc == 0 && t0 < tokens; t0 += BLOCK_TOKENS) {
		uint32_t S = tokens - t0 < BLOCK_TOKENS ? tokens - t0 : BLOCK_TOKENS;
		synthetic_kv_fill(k, KV_HEADS, S, HEAD_DIM, true, seed++);
		synthetic_kv_fill(v, KV_HEADS, S, HEAD_DIM, false, seed++);
		rc = zc_update_and_fetch(*out, 0, S, k, v, &view, NULL);
	}
	free(k), free(v);
	return rc;
}

/* The segments zc_attend builds, built once here inside one read (no
 * writer runs, so they stay valid): blocks, or the view's rows cut at them. */
static int segments_build(zc_session *session, bool over_view, zc_attend_segment **out,
			  size_t *n_out)
{
	const zc_session_info *info = zc_session_get_info(session);
	zc_read read;
	zc_layer_contents layout;
	int rc = zc_read_begin(session, 0, 0, &read);

	if (rc == 0)
		rc = zc_layer_layout(session, &read, &layout);
	if (rc < 0)
		return rc;
	zc_attend_segment *s = calloc((size_t)layout.blocks + 1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	size_t n = 0, first = layout.tokens - layout.residual_tokens;
	for (uint32_t i = 0; rc == 0 && i < layout.blocks; i++) {
		zc_block b;
		if ((rc = zc_layer_block(session, &read, i, &b)) < 0)
			break;
		if (over_view) {
			size_t back = first - b.first_token;
			s[n++] = (zc_attend_segment){ .kind = ZC_ATTEND_ROWS, .rows = {
				.batch = 1, .heads = KV_HEADS, .tokens = b.valid_tokens,
				.head_dim_k = HEAD_DIM, .head_dim_v = HEAD_DIM,
				.keys = layout.residual_keys - back * layout.key_strides.token,
				.key_strides = layout.key_strides,
				.values = layout.residual_values - back * layout.value_strides.token,
				.value_strides = layout.value_strides } };
		} else {
			s[n++] = (zc_attend_segment){ .kind = ZC_ATTEND_BLOCK, .block = {
				.config = info->codec, .shape = b.key_shape, .head_dim_v = HEAD_DIM,
				.valid_tokens = b.valid_tokens, .keys = b.key_payload,
				.key_bytes = b.key_bytes, .values = b.value_payload,
				.value_bytes = b.value_bytes } };
		}
	}
	if (rc == 0 && layout.residual_tokens > 0)
		rc = -EINVAL;   /* whole blocks only: S is a multiple of BLOCK_TOKENS */
	if (rc == 0)
		rc = zc_read_end(session, &read);
	if (rc < 0) {
		free(s);
		return rc;
	}
	*out = s;
	*n_out = n;
	return 0;
}

/* ---- the measured operations --------------------------------------------- */

/* What zc_attend reads besides the payloads: one read of the layer. */
static int read_only(zc_session *session)
{
	zc_read read;
	zc_layer_contents layout;
	zc_block block;
	int rc = zc_read_begin(session, 0, 0, &read);
	if (rc == 0)
		rc = zc_layer_layout(session, &read, &layout);
	for (uint32_t i = 0; rc == 0 && i < layout.blocks; i++)
		rc = zc_layer_block(session, &read, i, &block);
	return rc == 0 ? zc_read_end(session, &read) : rc;
}

static int run_measure(struct bench *b, enum measure m, float *out)
{
	zc_attend_query query;
	zc_attend_query_init(&query, 1, Q_HEADS, 1, HEAD_DIM, b->q);
	zc_attend_output output = { ZC_ATTEND_FP32, out, b->out_bytes, NULL };
	switch (m) {
	case M_SESSION:
		return zc_attend(b->none, 0, &query, &output, 0, 1);
	case M_SEGMENTS:
		return zc_attend_segments(b->blocks, b->n_segments, &query, &output, 1);
	case M_SESSION_VIEW:
		return zc_attend(b->full, 0, &query, &output, ZC_ATTEND_OVER_VIEW, 1);
	case M_SEGMENTS_VIEW:
		return zc_attend_segments(b->view, b->n_segments, &query, &output, 1);
	case M_SESSION_2T:
		return zc_attend(b->none, 0, &query, &output, 0, 2);
	case M_READ:
		return read_only(b->none);
	case M_COUNT:
		break;
	}
	return -EINVAL;
}

static int time_reps(struct bench *b, enum measure m, unsigned reps, double *per_op)
{
	int rc = run_measure(b, m, b->out);   /* re-warm after the other measures ran */
	if (rc < 0)
		return rc;
	double t0 = now_s();
	for (unsigned i = 0; i < reps; i++)
		if ((rc = run_measure(b, m, b->out)) < 0)
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

/* Medians of every measure, rotated run by run; the 2-thread one unpinned. */
static int measure_all(struct bench *b, const struct options *opt, double *med)
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
		sched_setaffinity(0, sizeof(cpu_set_t), m == M_SESSION_2T ? &all : &one);
		if ((rc = time_reps(b, (enum measure)m, 1, &one_op)) < 0)
			break;
		double want = ceil(opt->min_run_s / (one_op > 1e-9 ? one_op : 1e-9));
		reps[m] = want < 1.0 ? 1u : want > 1e6 ? 1000000u : (unsigned)want;
	}
	for (int r = 0; r < opt->runs && rc == 0; r++)
		for (int k = 0; k < M_COUNT && rc == 0; k++) {
			int m = (r + k) % M_COUNT;
			sched_setaffinity(0, sizeof(cpu_set_t), m == M_SESSION_2T ? &all : &one);
			rc = time_reps(b, (enum measure)m, reps[m], &t[m * opt->runs + r]);
		}
	sched_setaffinity(0, sizeof all, &all);
	if (rc == 0)
		for (int m = 0; m < M_COUNT; m++)
			med[m] = median(t + m * opt->runs, opt->runs);
	free(t);
	return rc;
}

/* The median over `pairs` back-to-back pairs of one call of a and one of
 * b (which goes first alternates) of time(a) / time(b), pinned to `one`. */
static int paired_ratio(struct bench *b, enum measure a, enum measure m_b, int pairs,
			const cpu_set_t *one, double *ratio)
{
	double *r = calloc((size_t)pairs, sizeof *r);
	int rc = 0;

	if (!r)
		return -ENOMEM;
	sched_setaffinity(0, sizeof(cpu_set_t), one);
	for (int i = 0; i < pairs && rc == 0; i++) {
		double t[2];
		for (int k = 0; k < 2 && rc == 0; k++) {
			enum measure m = (k ^ (i & 1)) ? m_b : a;
			double t0 = now_s();
			rc = run_measure(b, m, b->out);
			t[m == a ? 0 : 1] = now_s() - t0;
		}
		r[i] = t[0] / t[1];
	}
	if (rc == 0)
		*ratio = median(r, pairs);
	free(r);
	return rc;
}

/* Every measure gives the same bytes: the session calls are the core's
 * over the same segments, and a view holds its blocks' reconstruction. */
static int outputs_agree(struct bench *b)
{
	int rc = run_measure(b, M_SEGMENTS, b->check);
	for (int m = 0; m < M_READ && rc == 0; m++) {
		if ((rc = run_measure(b, (enum measure)m, b->out)) == 0 &&
		    memcmp(b->out, b->check, b->out_bytes) != 0) {
			fprintf(stderr, "attend_session: %s differs from segments\n", measure_names[m]);
			rc = ZC_EINTERNAL;
		}
	}
	return rc;
}

static void bench_free(struct bench *b)
{
	if (b->none)
		zc_session_close(b->none);
	if (b->full)
		zc_session_close(b->full);
	free(b->blocks);
	free(b->view);
	free(b->q);
	free(b->out);
	free(b->check);
}

static int bench_build(struct bench *b, zc_client *client, uint32_t tokens)
{
	size_t n_view = 0;
	int rc;

	memset(b, 0, sizeof *b);
	b->out_bytes = sizeof(float) * Q_HEADS * HEAD_DIM;
	b->q = malloc(sizeof(float) * Q_HEADS * HEAD_DIM);
	b->out = malloc(b->out_bytes);
	b->check = malloc(b->out_bytes);
	uint16_t *q16 = malloc(2 * Q_HEADS * HEAD_DIM);
	if (!b->q || !b->out || !b->check || !q16) {
		free(q16);
		return -ENOMEM;
	}
	/* attend_bench's query: its seed follows the layer's blocks. */
	synthetic_kv_fill(q16, Q_HEADS, 1, HEAD_DIM, false,
			  0xa77e0000u + tokens + 2 * ((tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS));
	for (size_t i = 0; i < Q_HEADS * HEAD_DIM; i++)
		b->q[i] = zc_fp16_to_float(q16[i]);
	free(q16);
	if ((rc = session_fill(client, ZC_VIEWS_NONE, tokens, &b->none)) < 0 ||
	    (rc = session_fill(client, ZC_VIEWS_FULL, tokens, &b->full)) < 0 ||
	    (rc = segments_build(b->none, false, &b->blocks, &b->n_segments)) < 0 ||
	    (rc = segments_build(b->full, true, &b->view, &n_view)) < 0)
		return rc;
	return n_view == b->n_segments ? 0 : ZC_EINTERNAL;
}

/* ---- main ----------------------------------------------------------------- */

static int parse_args(int argc, char **argv, struct options *opt)
{
	bool runs_set = false;
	*opt = (struct options){ .runs = DEFAULT_RUNS, .min_run_s = MIN_RUN_MS * 1e-3 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		char *end;
		if (!strcmp(a, "--quick")) {
			opt->quick = true;
		} else if (!strcmp(a, "--daemon") && v) {
			opt->daemon = argv[++i];
		} else if (!strcmp(a, "--runs") && v) {
			long n = strtol(argv[++i], &end, 10);
			if (*end || n < 1 || n > 10000)
				return -1;
			opt->runs = (int)n;
			runs_set = true;
		} else if (!strcmp(a, "--tokens") && v) {
			long n = strtol(argv[++i], &end, 10);
			if (*end || n < 1 || n > (long)MAX_TOKENS || n % BLOCK_TOKENS)
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
	static const uint32_t standard[] = { 4096, 32768 };
	struct options opt;
	uint32_t shapes[2];
	size_t n_shapes = 0;
	char daemon_path[PATH_MAX];
	zc_client *client = NULL;

	if (parse_args(argc, argv, &opt) < 0) {
		fprintf(stderr, "usage: attend_session [--runs N] [--tokens S (a multiple of %u)] "
				"[--quick] [--daemon PATH]\n", BLOCK_TOKENS);
		return 2;
	}
	if (!opt.daemon) {
		const char *build = getenv("ZC_BUILD_DIR");
		snprintf(daemon_path, sizeof daemon_path, "%s/bin/zipcached", build ? build : ZC_BUILD_DIR);
		opt.daemon = daemon_path;
	}
	zc_codec_init();
	if (opt.tokens)
		shapes[n_shapes++] = opt.tokens;
	else
		for (size_t i = 0; i < 2; i++)
			if (!opt.quick || standard[i] <= 4096)
				shapes[n_shapes++] = standard[i];
	int rc = daemon_start(opt.daemon, &client);
	if (rc < 0) {
		fprintf(stderr, "attend_session: no daemon (%s): %s\n", opt.daemon, zc_strerror(rc));
		daemon_stop();
		return 1;
	}

	printf("session attention, one decode step: B=1 H_kv=%u q_heads=%u D=%u n_q=1, %s, median "
	       "of %d\n", KV_HEADS, Q_HEADS, HEAD_DIM, zc_isa_name(zc_codec_isa()), opt.runs);
	printf("%7s %10s %11s %10s %11s %10s %8s | %10s %10s %10s %10s %9s %9s\n", "S",
	       "session ms", "segments ms", "s view ms", "seg view ms", "2 thr ms", "read us",
	       "overhead", "paired", "view ovh", "paired", "c/view", "1->2 thr");
	for (size_t s = 0; s < n_shapes && rc == 0; s++) {
		struct bench b;
		double med[M_COUNT];
		rc = bench_build(&b, client, shapes[s]);
		if (rc == 0)
			rc = outputs_agree(&b);
		if (rc == 0)
			rc = measure_all(&b, &opt, med);
		double paired = 0, paired_view = 0;
		cpu_set_t all, one;
		sched_getaffinity(0, sizeof all, &all);
		CPU_ZERO(&one);
		for (int c = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &all)) {
				CPU_SET(c, &one);
				break;
			}
		int pairs = opt.quick ? QUICK_PAIRS : (int)(PAIRS_AT_4096 * 4096 / shapes[s]) | 1;
		pairs = pairs < QUICK_PAIRS ? QUICK_PAIRS : pairs;
		if (rc == 0)
			rc = paired_ratio(&b, M_SESSION, M_SEGMENTS, pairs, &one, &paired);
		if (rc == 0)
			rc = paired_ratio(&b, M_SESSION_VIEW, M_SEGMENTS_VIEW, pairs, &one, &paired_view);
		sched_setaffinity(0, sizeof all, &all);
		if (rc < 0) {
			fprintf(stderr, "attend_session: S=%u: %s\n", shapes[s], zc_strerror(rc));
			bench_free(&b);
			break;
		}
		double overhead = med[M_SESSION] / med[M_SEGMENTS] - 1.0;
		double view_overhead = med[M_SESSION_VIEW] / med[M_SEGMENTS_VIEW] - 1.0;
		double c_view = med[M_SESSION] / med[M_SESSION_VIEW];
		double scaling = med[M_SESSION] / med[M_SESSION_2T];
		printf("%7u %10.3f %11.3f %10.3f %11.3f %10.3f %8.2f | %9.2f%% %9.2f%% %9.2f%% "
		       "%9.2f%% %9.3f %9.3f\n",
		       shapes[s], 1e3 * med[M_SESSION], 1e3 * med[M_SEGMENTS],
		       1e3 * med[M_SESSION_VIEW], 1e3 * med[M_SEGMENTS_VIEW], 1e3 * med[M_SESSION_2T],
		       1e6 * med[M_READ], 100 * overhead, 100 * (paired - 1), 100 * view_overhead,
		       100 * (paired_view - 1), c_view, scaling);
		for (int m = 0; m < M_COUNT; m++)
			printf("{\"bench\":\"attend_session\",\"tokens\":%u,\"op\":\"%s\","
			       "\"median_ms\":%.4f,\"isa\":\"%s\",\"runs\":%d}\n",
			       shapes[s], measure_names[m], 1e3 * med[m], zc_isa_name(zc_codec_isa()),
			       opt.runs);
		printf("{\"bench\":\"attend_session\",\"tokens\":%u,\"op\":\"summary\","
		       "\"session_overhead\":%.4f,\"view_session_overhead\":%.4f,"
		       "\"session_overhead_paired\":%.4f,\"view_session_overhead_paired\":%.4f,"
		       "\"compressed_over_view\":%.4f,\"threads_1_to_2_speedup\":%.4f,"
		       "\"read_only_us\":%.3f,\"blocks\":%zu,\"isa\":\"%s\",\"runs\":%d}\n",
		       shapes[s], overhead, view_overhead, paired - 1, paired_view - 1, c_view, scaling,
		       1e6 * med[M_READ],
		       b.n_segments,
		       zc_isa_name(zc_codec_isa()), opt.runs);
		fflush(stdout);
		bench_free(&b);
	}
	zc_client_close(client);
	daemon_stop();
	return rc < 0 ? 1 : 0;
}
