/*
 * Remote tier benchmark (issue 13, §5): offload and restore of a session
 * through Redis on loopback, against the same bytes through raw
 * pipelined SET and GET.
 *
 * Starts its own redis-server (127.0.0.1, a free port, no persistence,
 * stopped by pid) and its own daemon with --remote on it and
 * --offload-idle-seconds 1; opens a session of L layers x S tokens
 * (32 x 4096; B = 1, H_kv = 8, D = 128, default codec, streaming, views
 * full), prefills every layer as one block and decodes DECODE_STEPS tokens
 * per layer (so the residual is in use). Then, run by run (a warm-up
 * first, medians of --runs):
 *
 *   offload  the session left idle is offloaded by the daemon: the time is
 *            the daemon's own (zipcache_remote_offload_seconds_total's
 *            step: encode, every part's SET confirmed, the manifest), not
 *            the idle wait;
 *   restore  an attach by name, timed at the client: the manifest, every
 *            part fetched, the whole verified, the session built and the
 *            attach answered (views full: every layer's fp16 rebuilt);
 *   restore, views none   the same attach asking views = none (after
 *            offloads of its own): the rebuild of the fp16 views left out;
 *   raw SET  the same values' sizes (read back from Redis after the
 *            offload), fresh bytes, written by hiredis in one pipeline
 *            (what redis-benchmark -P does), each reply read;
 *   raw GET  those keys read back in one pipeline.
 *
 * Throughputs are fp16-equivalent (the session's fp16 bytes / seconds);
 * ratios offload / raw SET and restore / raw GET are same-run. Bytes
 * written to Redis (values of one offload) / fp16 bytes of the session is
 * the size ratio. Output: a table, then one JSON object per line.
 *
 * usage: remote [--quick] [--runs N] [--daemon PATH]
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "bench_daemon.h"
#include "redis_peer.h"
#include "synthetic_kv.h"
#include "zipcache/client.h"

#define HEADS 8u
#define HEAD_DIM 128u
#define LAYERS 32u
#define TOKENS 4096u
#define QUICK_LAYERS 4u
#define QUICK_TOKENS 1024u
#define DECODE_STEPS 64u
#define RUNS 5
#define QUICK_RUNS 2
#define SIZE_GOAL 0.28
#define SPEED_GOAL 0.8
#define WAIT_S 120.0

static struct redis_tcp redis;

static int session_fill(zc_client *client, zc_session *s, uint32_t layers, uint32_t tokens)
{
	size_t half = 2 * (size_t)tokens * HEADS * HEAD_DIM;
	uint16_t *keys = malloc(half), *values = malloc(half);
	uint16_t step_keys[HEADS * HEAD_DIM], step_values[HEADS * HEAD_DIM];
	void *staging;
	zc_view view;
	int rc = keys && values ? 0 : -ENOMEM;
	if (rc == 0) {
		synthetic_kv_fill(keys, HEADS, tokens, HEAD_DIM, true, 0x5a5a0000u);
		synthetic_kv_fill(values, HEADS, tokens, HEAD_DIM, false, 0x5a5a0001u);
		rc = zc_client_staging(client, 2 * half, &staging);
	}
	for (uint32_t layer = 0; rc == 0 && layer < layers; layer++) {
		memcpy(staging, keys, half);
		memcpy((uint8_t *)staging + half, values, half);
		rc = zc_update_and_fetch_staged(s, layer, tokens, 0, half, &view, NULL);
	}
	for (uint32_t t = 0; rc == 0 && t < DECODE_STEPS; t++) {
		synthetic_kv_fill(step_keys, HEADS, 1, HEAD_DIM, true, 0x5a5b0000u + t);
		synthetic_kv_fill(step_values, HEADS, 1, HEAD_DIM, false, 0x5a5c0000u + t);
		for (uint32_t layer = 0; rc == 0 && layer < layers; layer++)
			rc = zc_update_and_fetch(s, layer, 1, step_keys, step_values, &view, NULL);
	}
	free(keys);
	free(values);
	if (rc < 0)
		bench_fail_client(client, "fill", rc);
	return rc;
}

/* Sessions the daemon holds (0 or 1 here). */
static size_t sessions_held(zc_client *client)
{
	zc_session_info infos[4];
	size_t n = 0;
	if (zc_client_list_sessions(client, infos, 4, &n) < 0)
		return SIZE_MAX;
	return n;
}

/* The sizes of the values one offload left in Redis. */
static size_t value_sizes(redisContext *c, size_t **sizes, uint64_t *total)
{
	redisReply *keys = redisCommand(c, "KEYS zc:*");
	size_t n = keys && keys->type == REDIS_REPLY_ARRAY ? keys->elements : 0;
	*sizes = calloc(n ? n : 1, sizeof(**sizes));
	*total = 0;
	for (size_t i = 0; i < n; i++)
		redisAppendCommand(c, "STRLEN %s", keys->element[i]->str);
	for (size_t i = 0; i < n; i++) {
		redisReply *r = NULL;
		if (redisGetReply(c, (void **)&r) == REDIS_OK && r && r->type == REDIS_REPLY_INTEGER)
			(*sizes)[i] = (size_t)r->integer;
		*total += (*sizes)[i];
		freeReplyObject(r);
	}
	freeReplyObject(keys);
	return n;
}

/* One pipeline of SETs (or GETs) of values of these sizes; seconds, or -1. */
static double raw_pipeline(redisContext *c, const size_t *sizes, size_t n, const uint8_t *bytes,
			   bool set)
{
	double t0 = bench_now_s();
	for (size_t i = 0; i < n; i++) {
		char key[48];
		snprintf(key, sizeof(key), "raw:%zu", i);
		if (set)
			redisAppendCommand(c, "SET %s %b", key, bytes, sizes[i]);
		else
			redisAppendCommand(c, "GET %s", key);
	}
	bool ok = true;
	for (size_t i = 0; i < n; i++) {
		redisReply *r = NULL;
		if (redisGetReply(c, (void **)&r) != REDIS_OK || !r)
			return -1;
		ok = ok && (set ? r->type == REDIS_REPLY_STATUS :
				  r->type == REDIS_REPLY_STRING && (size_t)r->len == sizes[i]);
		freeReplyObject(r);
	}
	return ok ? bench_now_s() - t0 : -1;
}

static void usage(void)
{
	fprintf(stderr, "usage: remote [--quick] [--runs N] [--daemon PATH]\n");
}

int main(int argc, char **argv)
{
	bool quick = false;
	int runs = RUNS;
	const char *given = NULL;
	uint32_t layers = LAYERS, tokens = TOKENS;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--quick") == 0) {
			quick = true;
			layers = QUICK_LAYERS;
			tokens = QUICK_TOKENS;
			runs = QUICK_RUNS;
		} else if (i + 1 < argc && strcmp(argv[i], "--runs") == 0) {
			runs = atoi(argv[++i]);
			if (runs < 1) {
				usage();
				return 2;
			}
		} else if (i + 1 < argc && strcmp(argv[i], "--daemon") == 0) {
			given = argv[++i];
		} else {
			usage();
			return 2;
		}
	}
	bench_set_name("remote");
	if (system("command -v redis-server >/dev/null 2>&1") != 0) {
		printf("remote benchmark: skipped: redis-server is not installed (make deps)\n");
		return 0;
	}
	char daemon_path[PATH_MAX];
	if (bench_daemon_path(given, daemon_path, sizeof daemon_path) < 0)
		return 1;
	zc_codec_init();
	if (bench_dir_make("remote") < 0)
		return 1;

	int status = 1, rc;
	zc_client *client = NULL;
	redisContext *c = NULL;
	size_t *sizes = NULL;
	uint8_t *bytes = NULL;
	double *to = calloc((size_t)runs, sizeof(double)), *tr = calloc((size_t)runs, sizeof(double));
	double *ts = calloc((size_t)runs, sizeof(double)), *tg = calloc((size_t)runs, sizeof(double));
	double *tn = calloc((size_t)runs, sizeof(double));
	uint16_t metrics_port = bench_free_port();
	char url[64], listen_at[32];
	if (!to || !tr || !ts || !tg || !tn || metrics_port == 0 ||
	    (rc = redis_tcp_start("remote", &redis)) < 0) {
		fprintf(stderr, "remote: redis-server did not start\n");
		goto out;
	}
	uint16_t port = redis.port;
	snprintf(url, sizeof(url), "redis://127.0.0.1:%u", port);
	snprintf(listen_at, sizeof(listen_at), "127.0.0.1:%u", metrics_port);
	const char *extra[] = { "--remote", url, "--offload-idle-seconds", "1", "--metrics-listen",
				listen_at, "--remote-timeout-ms", "20000", NULL };
	if ((rc = bench_daemon_start(daemon_path, -1, extra, &client)) < 0) {
		fprintf(stderr, "remote: zipcached did not answer: %s\n", zc_strerror(rc));
		goto out;
	}
	c = redisConnect("127.0.0.1", port);
	if (!c || c->err) {
		fprintf(stderr, "remote: cannot connect to redis\n");
		goto out;
	}

	zc_session_config config;
	zc_session_config_default(&config);
	config.name = "remote-bench";
	config.layers = layers;
	config.kv_heads = HEADS;
	config.head_dim_k = config.head_dim_v = HEAD_DIM;
	config.max_tokens = tokens + DECODE_STEPS;
	config.model_id = "bench-model";
	zc_session *session;
	if ((rc = zc_session_open(client, &config, &session)) < 0) {
		bench_fail_client(client, "open", rc);
		goto out;
	}
	if (session_fill(client, session, layers, tokens) < 0)
		goto out;
	uint64_t fp16 = (uint64_t)layers * (tokens + DECODE_STEPS) * HEADS * HEAD_DIM * 2 * 2;
	uint64_t written = 0;
	size_t n_values = 0;
	config.attach = true;
	for (int run = -1; run < runs; run++) {
		double before = bench_daemon_metric(metrics_port,
						    "zipcache_remote_offload_seconds_total");
		zc_session_release_views(session);
		zc_session_release(session);
		double until = bench_now_s() + WAIT_S;
		while (sessions_held(client) != 0 && bench_now_s() < until)
			usleep(5000);
		if (sessions_held(client) != 0) {
			fprintf(stderr, "remote: the session was not offloaded within %.0f s\n", WAIT_S);
			goto out;
		}
		double offload_s = bench_daemon_metric(metrics_port,
						       "zipcache_remote_offload_seconds_total") -
				   before;
		if (!sizes) {
			n_values = value_sizes(c, &sizes, &written);
			size_t most = 0;
			for (size_t i = 0; i < n_values; i++)
				if (sizes[i] > most)
					most = sizes[i];
			bytes = bench_alloc_touched(most ? most : 1);
			for (size_t i = 0; i < most; i++)
				bytes[i] = (uint8_t)(i * 2654435761u >> 24);
		}
		double t0 = bench_now_s();
		rc = zc_session_open(client, &config, &session);
		double restore_s = bench_now_s() - t0;
		if (rc < 0) {
			bench_fail_client(client, "restore", rc);
			goto out;
		}
		double set_s = raw_pipeline(c, sizes, n_values, bytes, true);
		double get_s = raw_pipeline(c, sizes, n_values, bytes, false);
		freeReplyObject(redisCommand(c, "FLUSHALL"));   /* only raw:* are left */
		if (set_s < 0 || get_s < 0) {
			fprintf(stderr, "remote: raw SET/GET failed\n");
			goto out;
		}
		if (run >= 0) {
			to[run] = offload_s;
			tr[run] = restore_s;
			ts[run] = set_s;
			tg[run] = get_s;
		}
	}
	/* The same restores with views = none: what rebuilding the fp16
	 * views costs is the difference. */
	config.views = ZC_VIEWS_NONE;
	for (int run = -1; run < runs; run++) {
		zc_session_release_views(session);
		zc_session_release(session);
		double until = bench_now_s() + WAIT_S;
		while (sessions_held(client) != 0 && bench_now_s() < until)
			usleep(5000);
		double t0 = bench_now_s();
		rc = zc_session_open(client, &config, &session);
		if (rc < 0) {
			bench_fail_client(client, "restore, views none", rc);
			goto out;
		}
		if (run >= 0)
			tn[run] = bench_now_s() - t0;
	}
	double rn = bench_median(tn, (size_t)runs);
	double o = bench_median(to, (size_t)runs), r = bench_median(tr, (size_t)runs);
	double s = bench_median(ts, (size_t)runs), g = bench_median(tg, (size_t)runs);
	double gb = (double)fp16 / 1e9, size_ratio = (double)written / (double)fp16;
	printf("remote benchmark: zipcached %s, %u layers x %u tokens (+%u decoded), B=1 H=%u D=%u, "
	       "default codec, views full; redis-server on loopback; medians of %d runs%s\n",
	       zc_client_server_info(client)->server_version, layers, tokens, DECODE_STEPS, HEADS,
	       HEAD_DIM, runs, quick ? " (QUICK: a smoke test, not a measurement)" : "");
	printf("written to Redis per offload: %.1f MiB in %zu values (%.3f of the %.1f MiB fp16)\n",
	       (double)written / 1048576.0, n_values, size_ratio, (double)fp16 / 1048576.0);
	printf("  %-34s %9s %14s %8s\n", "op", "ms", "fp16 GB/s", "/ raw");
	printf("  %-34s %9.2f %14.2f %8.3f\n", "offload (daemon's time)", o * 1e3, gb / o, s / o);
	printf("  %-34s %9.2f %14.2f %8.3f\n", "restore (attach, client's time)", r * 1e3, gb / r,
	       g / r);
	printf("  %-34s %9.2f %14.2f %8.3f\n", "restore, views none", rn * 1e3, gb / rn, g / rn);
	printf("  %-34s %9.2f %14.2f\n", "raw pipelined SET, same sizes", s * 1e3, gb / s);
	printf("  %-34s %9.2f %14.2f\n", "raw pipelined GET, same sizes", g * 1e3, gb / g);
	printf("goals: bytes / fp16 <= %.2f %s; offload / raw SET >= %.1f %s; restore / raw GET >= "
	       "%.1f %s\n", SIZE_GOAL, size_ratio <= SIZE_GOAL ? "met" : "NOT met", SPEED_GOAL,
	       s / o >= SPEED_GOAL ? "met" : "NOT met", SPEED_GOAL,
	       g / r >= SPEED_GOAL ? "met" : "NOT met");
	printf("{\"bench\":\"remote\",\"op\":\"size\",\"layers\":%u,\"tokens\":%u,\"bytes\":%llu,"
	       "\"fp16_bytes\":%llu,\"values\":%zu,\"ratio\":%.4f,\"goal\":%.2f,\"quick\":%s}\n",
	       layers, tokens, (unsigned long long)written, (unsigned long long)fp16, n_values,
	       size_ratio, SIZE_GOAL, quick ? "true" : "false");
	for (int k = 0; k < 3; k++) {
		double t = k == 0 ? o : k == 1 ? r : rn, raw = k == 0 ? s : g;
		printf("{\"bench\":\"remote\",\"op\":\"%s\",\"layers\":%u,\"tokens\":%u,\"runs\":%d,"
		       "\"median_ms\":%.3f,\"fp16_gbps\":%.3f,\"raw_ms\":%.3f,\"raw_fp16_gbps\":%.3f,"
		       "\"ratio\":%.3f,\"goal\":%.1f,\"quick\":%s}\n",
		       k == 0 ? "offload" : k == 1 ? "restore" : "restore_views_none", layers, tokens, runs, t * 1e3, gb / t, raw * 1e3,
		       gb / raw, raw / t, SPEED_GOAL, quick ? "true" : "false");
	}
	status = 0;
out:
	free(sizes);
	free(to);
	free(tr);
	free(ts);
	free(tg);
	free(tn);
	if (c)
		redisFree(c);
	zc_client_close(client);
	bench_daemon_stop();
	redis_tcp_stop(&redis);
	bench_dir_remove();
	return status;
}
