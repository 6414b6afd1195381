/*
 * A daemon session's K/V back onto a GPU (`make bench-gpu`): a real
 * zipcached (started here on a scratch socket and shm dir), one session of
 * --layers x --tokens (H_kv = --heads, D = --dim, batch 1) prefilled in
 * --block-tokens blocks, and the time until all of its K/V is in GPU
 * memory as fp16:
 *   (a) the fp16 view (views = full) -> GPU from the pageable mapping,
 *   (b) the same bytes from pinned memory,
 *   (c) zc_cuda_fetch_layer per layer: compressed blocks and residual ->
 *       GPU, reconstructed there (views = none; and views = full), the
 *       first fetch (pinning the blocks) and later ones;
 * then decode: one token appended to every layer, fetched incrementally
 * (a mirror per layer), 32 layers queued then waited for. Each figure is
 * the median of --repeat, host wall clock from the first call to the
 * stream being done. Every fetch path is checked against
 * zc_layer_reconstruct (first and last layer, bit for bit). JSON lines.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "synthetic_kv.h"
#include "zipcache/client.h"
#include "zipcache/cuda.h"

#ifndef ZC_BUILD_DIR
#define ZC_BUILD_DIR "build"
#endif

struct options {
	uint32_t layers, tokens, heads, dim, block_tokens, repeat, decode_steps;
};

static double now_seconds(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int compare_doubles(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, uint32_t n)
{
	qsort(v, n, sizeof *v, compare_doubles);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#define CUDA_CHECK(call) \
	do { \
		cudaError_t e_ = (call); \
		if (e_ != cudaSuccess) { \
			fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
			exit(1); \
		} \
	} while (0)

static void check(int rc, const char *what)
{
	if (rc < 0) {
		fprintf(stderr, "cuda_session_bench: %s: %s\n", what, zc_strerror(rc));
		exit(1);
	}
}

/* ---- the daemon --------------------------------------------------------------- */

static pid_t daemon_pid;
static char scratch[64], shm[128], socket_path[108];

static void daemon_stop(void)
{
	if (daemon_pid > 0) {
		kill(daemon_pid, SIGTERM);
		waitpid(daemon_pid, NULL, 0);
		daemon_pid = 0;
	}
	char command[300];
	snprintf(command, sizeof command, "rm -rf '%s' '%s'", scratch, shm);
	if (system(command) != 0)
		fprintf(stderr, "cuda_session_bench: could not remove %s\n", scratch);
}

static zc_client *daemon_start(void)
{
	const char *build = getenv("ZC_BUILD_DIR") ? getenv("ZC_BUILD_DIR") : ZC_BUILD_DIR;
	char binary[4096];
	snprintf(binary, sizeof binary, "%s/bin/zipcached", build);
	snprintf(scratch, sizeof scratch, "/tmp/zcb-XXXXXX");
	if (!mkdtemp(scratch))
		check(-errno, "mkdtemp");
	/* The session files on tmpfs, as a deployment has them. */
	snprintf(shm, sizeof shm, "/dev/shm/%s", scratch + 5);
	if (mkdir(shm, 0700) < 0)
		check(-errno, "mkdir /dev/shm/...");
	snprintf(socket_path, sizeof socket_path, "%s/z.sock", scratch);
	daemon_pid = fork();
	if (daemon_pid == 0) {
		execl(binary, binary, "--socket", socket_path, "--shm-dir", shm, "--log-level", "warn",
		      "--metrics-listen", "off", "--memory-budget", "0", "--max-tokens", "1048576",
		      "--idle-ttl", "0", "--view-idle-seconds", "0", "--lease-seconds", "86400",
		      (char *)NULL);
		_exit(127);
	}
	atexit(daemon_stop);
	zc_client *client = NULL;
	for (int i = 0; i < 200; i++) {
		if (zc_client_connect(socket_path, 600000, &client) == 0)
			return client;
		usleep(50000);
	}
	fprintf(stderr, "cuda_session_bench: %s did not answer on %s\n", binary, socket_path);
	exit(1);
}

/* ---- sessions ------------------------------------------------------------------ */

/* Room per layer: the prefill and two tokens of each decode step (layer 0
 * gets one more for the lone fetch). */
static uint32_t rows_of(const struct options *o)
{
	return o->tokens + 2 * o->decode_steps + 2;
}

static zc_session *prefill(zc_client *client, const struct options *o, zc_views views,
			   const char *name, double *seconds)
{
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = name;
	config.layers = o->layers;
	config.batch = 1;
	config.kv_heads = o->heads;
	config.head_dim_k = config.head_dim_v = o->dim;
	config.max_tokens = rows_of(o);
	config.views = views;
	zc_session *session;
	check(zc_session_open(client, &config, &session), "open");
	/* One layer's blocks drawn once (synthetic_kv_fill is slower than the
	 * daemon), each layer's copy with its lowest mantissa bits changed. */
	size_t per = (size_t)o->heads * o->tokens * o->dim;
	uint16_t *k0 = malloc(per * 2), *v0 = malloc(per * 2), *k = malloc(per * 2),
		 *v = malloc(per * 2);
	for (uint32_t t = 0; t < o->tokens; t += o->block_tokens) {
		uint32_t m = o->tokens - t < o->block_tokens ? o->tokens - t : o->block_tokens;
		size_t at = (size_t)o->heads * t * o->dim;
		synthetic_kv_fill(k0 + at, o->heads, m, o->dim, true, t);
		synthetic_kv_fill(v0 + at, o->heads, m, o->dim, false, t ^ 0x77);
	}
	double start = now_seconds();
	for (uint32_t layer = 0; layer < o->layers; layer++) {
		for (size_t i = 0; i < per; i++) {
			k[i] = k0[i] ^ (uint16_t)(layer & 3);
			v[i] = v0[i] ^ (uint16_t)(layer & 3);
		}
		for (uint32_t t = 0; t < o->tokens; t += o->block_tokens) {
			uint32_t m = o->tokens - t < o->block_tokens ? o->tokens - t : o->block_tokens;
			size_t at = (size_t)o->heads * t * o->dim;
			zc_view view;
			check(zc_update_and_fetch(session, layer, m, k + at, v + at, &view, NULL),
			      "prefill");
		}
	}
	*seconds = now_seconds() - start;
	free(k0);
	free(v0);
	free(k);
	free(v);
	return session;
}

/* The device tensors of every layer: [layers][K/V][heads][max_tokens][dim]. */
struct device_kv {
	uint16_t *base;
	size_t layer_elements, tensor_elements;
	uint32_t rows;
};

static void device_kv_init(struct device_kv *d, const struct options *o, uint32_t rows)
{
	d->rows = rows;
	d->tensor_elements = (size_t)o->heads * rows * o->dim;
	d->layer_elements = 2 * d->tensor_elements;
	CUDA_CHECK(cudaMalloc((void **)&d->base, d->layer_elements * o->layers * 2));
}

static zc_cuda_target target_of(const struct device_kv *d, const struct options *o, uint32_t layer)
{
	zc_strides s = { (size_t)o->heads * d->rows * o->dim, (size_t)d->rows * o->dim, o->dim };
	uint16_t *k = d->base + layer * d->layer_elements;
	return (zc_cuda_target){ k, k + d->tensor_elements, s, s, d->rows };
}

/* The device copy of `layer` against the client's reconstruction. */
static void verify(zc_session *session, const struct device_kv *d, const struct options *o,
		   uint32_t layer, const char *what)
{
	size_t n = d->tensor_elements;
	uint16_t *got = malloc(n * 4), *want = malloc(n * 4);
	zc_strides s = { (size_t)o->heads * d->rows * o->dim, (size_t)d->rows * o->dim, o->dim };
	uint32_t tokens;
	check(zc_layer_reconstruct(session, layer, want, &s, want + n, &s, d->rows, &tokens),
	      "reconstruct");
	CUDA_CHECK(cudaMemcpy(got, d->base + layer * d->layer_elements, n * 4, cudaMemcpyDeviceToHost));
	for (uint32_t h = 0; h < o->heads; h++)
		for (int t = 0; t < 2; t++) {
			size_t at = t * n + h * s.head;
			if (memcmp(got + at, want + at, (size_t)tokens * o->dim * 2) != 0) {
				fprintf(stderr, "cuda_session_bench: %s: layer %u head %u %s differ from "
						"zc_layer_reconstruct\n", what, layer, h, t ? "values" : "keys");
				exit(1);
			}
		}
	free(got);
	free(want);
}

static double fetch_all(zc_cuda *cuda, zc_session *session, const struct device_kv *d,
			const struct options *o, zc_cuda_mirror **mirrors, cudaStream_t stream)
{
	double start = now_seconds();
	for (uint32_t layer = 0; layer < o->layers; layer++) {
		zc_cuda_target t = target_of(d, o, layer);
		check(zc_cuda_fetch_layer(cuda, session, layer, &t, mirrors ? mirrors[layer] : NULL,
					  stream), "fetch");
	}
	check(zc_cuda_synchronize(cuda, stream), "synchronize");
	return now_seconds() - start;
}

int main(int argc, char **argv)
{
	struct options o = { 32, 32768, 8, 128, 4096, 5, 32 };
	for (int i = 1; i + 1 < argc; i += 2) {
		uint32_t value = (uint32_t)strtoul(argv[i + 1], NULL, 10);
		if (!strcmp(argv[i], "--layers")) o.layers = value;
		else if (!strcmp(argv[i], "--tokens")) o.tokens = value;
		else if (!strcmp(argv[i], "--heads")) o.heads = value;
		else if (!strcmp(argv[i], "--dim")) o.dim = value;
		else if (!strcmp(argv[i], "--block-tokens")) o.block_tokens = value;
		else if (!strcmp(argv[i], "--repeat")) o.repeat = value;
		else if (!strcmp(argv[i], "--decode-steps")) o.decode_steps = value;
		else {
			fprintf(stderr, "usage: %s [--layers N] [--tokens N] [--heads N] [--dim N] "
					"[--block-tokens N] [--repeat N] [--decode-steps N]\n", argv[0]);
			return 2;
		}
	}
	if (zc_cuda_device_count() <= 0) {
		printf("{\"bench\":\"cuda_session\",\"skipped\":\"no CUDA device\"}\n");
		return 0;
	}
	zc_client *client = daemon_start();
	double prefill_none, prefill_full;
	zc_session *none = prefill(client, &o, ZC_VIEWS_NONE, "bench-none", &prefill_none);
	zc_session *full = prefill(client, &o, ZC_VIEWS_FULL, "bench-full", &prefill_full);
	zc_layer_stats total;
	check(zc_session_stats(none, NULL, 0, &total), "stats");
	uint64_t fp16 = total.fp16_key_bytes + total.fp16_value_bytes;
	uint64_t compressed = total.compressed_key_bytes + total.compressed_value_bytes;
	printf("{\"bench\":\"cuda_session\",\"layers\":%u,\"tokens\":%u,\"heads\":%u,\"dim\":%u,"
	       "\"block_tokens\":%u,\"fp16_bytes\":%llu,\"compressed_bytes\":%llu,"
	       "\"prefill_none_s\":%.2f,\"prefill_full_s\":%.2f}\n",
	       o.layers, o.tokens, o.heads, o.dim, o.block_tokens, (unsigned long long)fp16,
	       (unsigned long long)compressed, prefill_none, prefill_full);
	fflush(stdout);

	cudaStream_t stream;
	CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	struct device_kv d;
	device_kv_init(&d, &o, rows_of(&o));
	double *times = calloc(o.repeat + o.decode_steps + 1, sizeof(double));

	/* (a) the fp16 view from the pageable mapping; (b) from pinned memory. */
	size_t layer_bytes = (size_t)o.heads * o.tokens * o.dim * 2;
	size_t view_head = (size_t)rows_of(&o) * o.dim * 2;
	size_t rows_bytes = (size_t)o.tokens * o.dim * 2;
	zc_view *views = calloc(o.layers, sizeof *views);
	for (uint32_t layer = 0; layer < o.layers; layer++)
		check(zc_session_view(full, layer, &views[layer]), "view");
	for (uint32_t r = 0; r < o.repeat; r++) {
		double start = now_seconds();
		for (uint32_t layer = 0; layer < o.layers; layer++) {
			zc_cuda_target t = target_of(&d, &o, layer);
			CUDA_CHECK(cudaMemcpy2DAsync(t.keys, (size_t)d.rows * o.dim * 2, views[layer].keys,
						     view_head, rows_bytes, o.heads,
						     cudaMemcpyHostToDevice, stream));
			CUDA_CHECK(cudaMemcpy2DAsync(t.values, (size_t)d.rows * o.dim * 2,
						     views[layer].values, view_head, rows_bytes, o.heads,
						     cudaMemcpyHostToDevice, stream));
		}
		CUDA_CHECK(cudaStreamSynchronize(stream));
		times[r] = now_seconds() - start;
	}
	double a = median(times, o.repeat);
	uint8_t *pinned;
	CUDA_CHECK(cudaHostAlloc((void **)&pinned, 2 * layer_bytes * o.layers, 0));
	for (uint32_t layer = 0; layer < o.layers; layer++)
		for (uint32_t h = 0; h < o.heads; h++) {
			memcpy(pinned + 2 * layer * layer_bytes + h * rows_bytes,
			       (const uint8_t *)views[layer].keys + h * view_head, rows_bytes);
			memcpy(pinned + (2 * layer + 1) * layer_bytes + h * rows_bytes,
			       (const uint8_t *)views[layer].values + h * view_head, rows_bytes);
		}
	for (uint32_t r = 0; r < o.repeat; r++) {
		double start = now_seconds();
		for (uint32_t layer = 0; layer < o.layers; layer++) {
			zc_cuda_target t = target_of(&d, &o, layer);
			CUDA_CHECK(cudaMemcpy2DAsync(t.keys, (size_t)d.rows * o.dim * 2,
						     pinned + 2 * layer * layer_bytes, rows_bytes,
						     rows_bytes, o.heads, cudaMemcpyHostToDevice, stream));
			CUDA_CHECK(cudaMemcpy2DAsync(t.values, (size_t)d.rows * o.dim * 2,
						     pinned + (2 * layer + 1) * layer_bytes, rows_bytes,
						     rows_bytes, o.heads, cudaMemcpyHostToDevice, stream));
		}
		CUDA_CHECK(cudaStreamSynchronize(stream));
		times[r] = now_seconds() - start;
	}
	double b = median(times, o.repeat);
	CUDA_CHECK(cudaFreeHost(pinned));
	printf("{\"path\":\"a_fp16_pageable\",\"ms\":%.2f,\"GBps\":%.1f}\n", a * 1e3, fp16 / a / 1e9);
	printf("{\"path\":\"b_fp16_pinned\",\"ms\":%.2f,\"GBps\":%.1f}\n", b * 1e3, fp16 / b / 1e9);
	fflush(stdout);

	/* (c) session fetches. */
	zc_cuda *cuda;
	check(zc_cuda_open(0, 0, &cuda), "zc_cuda_open");
	const struct { zc_session *s; const char *name; } kinds[] = { { none, "none" },
								       { full, "full" } };
	for (int k = 0; k < 2; k++) {
		CUDA_CHECK(cudaMemset(d.base, 0, d.layer_elements * o.layers * 2));
		double cold = fetch_all(cuda, kinds[k].s, &d, &o, NULL, stream);
		verify(kinds[k].s, &d, &o, 0, "first fetch");
		verify(kinds[k].s, &d, &o, o.layers - 1, "first fetch");
		for (uint32_t r = 0; r < o.repeat; r++)
			times[r] = fetch_all(cuda, kinds[k].s, &d, &o, NULL, stream);
		double c = median(times, o.repeat);
		verify(kinds[k].s, &d, &o, o.layers - 1, "fetch");
		zc_cuda_stats st;
		zc_cuda_get_stats(cuda, &st);
		printf("{\"path\":\"c_fetch_views_%s\",\"first_ms\":%.2f,\"ms\":%.2f,"
		       "\"vs_b\":%.2f,\"vs_a\":%.2f,\"compressed_GBps\":%.1f,\"pins\":%llu,"
		       "\"pin_bytes\":%llu,\"bytes_direct\":%llu,\"bytes_staged\":%llu}\n",
		       kinds[k].name, cold * 1e3, c * 1e3, b / c, a / c, compressed / c / 1e9,
		       (unsigned long long)st.pins, (unsigned long long)st.pin_bytes,
		       (unsigned long long)st.bytes_direct, (unsigned long long)st.bytes_staged);
		fflush(stdout);
	}

	/* Decode: one token per layer, fetched through a mirror per layer. */
	zc_cuda_mirror **mirrors = calloc(o.layers, sizeof *mirrors);
	for (uint32_t layer = 0; layer < o.layers; layer++)
		check(zc_cuda_mirror_new(&mirrors[layer]), "mirror");
	fetch_all(cuda, none, &d, &o, mirrors, stream);
	size_t one = (size_t)o.heads * o.dim;
	uint16_t *k1 = malloc(one * 2), *v1 = malloc(one * 2);
	double *lone = calloc(o.decode_steps + 1, sizeof(double));
	for (uint32_t s = 0; s < o.decode_steps; s++) {
		for (uint32_t layer = 0; layer < o.layers; layer++) {
			synthetic_kv_fill(k1, o.heads, 1, o.dim, true, 9000000u + s * 64 + layer);
			synthetic_kv_fill(v1, o.heads, 1, o.dim, false, 9500000u + s * 64 + layer);
			zc_view view;
			check(zc_update_and_fetch(none, layer, 1, k1, v1, &view, NULL), "decode");
		}
		double per = fetch_all(cuda, none, &d, &o, mirrors, stream) / o.layers;
		times[s] = per;
		/* One layer alone, waited for: the latency a layer-by-layer model sees. */
		synthetic_kv_fill(k1, o.heads, 1, o.dim, true, 7000000u + s);
		zc_view view;
		check(zc_update_and_fetch(none, 0, 1, k1, k1, &view, NULL), "decode");
		zc_cuda_target t = target_of(&d, &o, 0);
		double start = now_seconds();
		check(zc_cuda_fetch_layer(cuda, none, 0, &t, mirrors[0], stream), "fetch");
		check(zc_cuda_synchronize(cuda, stream), "synchronize");
		lone[s] = now_seconds() - start;
	}
	verify(none, &d, &o, 0, "incremental");
	verify(none, &d, &o, o.layers - 1, "incremental");
	uint32_t steps = o.decode_steps;
	printf("{\"path\":\"decode_incremental\",\"steps\":%u,\"us_per_layer\":%.1f,"
	       "\"us_one_layer_waited\":%.1f}\n", steps, median(times, steps) * 1e6,
	       median(lone, steps) * 1e6);
	zc_cuda_forget_session(cuda, none);
	zc_cuda_forget_session(cuda, full);
	zc_cuda_close(cuda);
	zc_session_release(none);
	zc_session_release(full);
	zc_client_close(client);
	return 0;
}
