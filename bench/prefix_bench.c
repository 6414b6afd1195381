/*
 * Prefix reuse benchmark (issue 13, §5: "attach of a prefix held remotely
 * vs recomputing it: report time and bytes").
 *
 * Starts a redis-server of its own on a free loopback port (no
 * persistence, stopped by pid at the end) and a daemon with --remote on
 * it. That daemon prefills an L-layer prompt of T tokens (32 x 4096; B 1,
 * H_kv 8, D 128, default codec, views none) chunk by chunk with chain
 * keys; its chunks go to Redis in the background. Then, run by run (a
 * warm-up first, medians of --runs), on a fresh daemon each run (its chunk
 * index empty, so the prefix is held only remotely):
 *
 *   lookup        zc_client_lookup_prefix of the chain: every chunk found
 *                 in Redis (EXISTS of every layer's key);
 *   remote attach zc_session_open with the prefix: every record fetched
 *                 (GET, pipelined), verified, written into the pool, the
 *                 session built sharing them;
 *   local attach  a second open with the prefix on the same daemon: the
 *                 blocks are in its chunk index now, shared by reference;
 *   recompute     a session that prefills the same tokens through the
 *                 daemon instead (the K/V of every chunk sent, compressed,
 *                 stored): what a worker pays besides the model's own
 *                 prefill FLOPs, which a real recompute adds on top.
 *
 *   raw GET       the same records fetched by a plain hiredis client,
 *                 pipelined 8 at a time as the daemon fetches them: the
 *                 peer's floor under the remote attach, same run.
 *
 * Bytes: the records in Redis (STRLEN of every chunk key: what the remote
 * attach moves), against the fp16 K/V a recompute sends the daemon.
 * Output: a table, then one JSON object per line.
 *
 * usage: prefix [--quick] [--runs N] [--cpu N] [--daemon-cpu N] [--daemon PATH]
 */
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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
#define QUICK_TOKENS 2048u
#define RUNS 5
#define QUICK_RUNS 2
#define CHUNKS_MAX (TOKENS / ZC_PREFIX_CHUNK_TOKENS)
/* How long the writer's chunks may take to reach Redis. */
#define PUBLISH_WAIT_S 60.0

struct options {
	bool quick;
	uint32_t layers, tokens;
	int runs, cpu, daemon_cpu;
	const char *daemon;
};

static struct redis_tcp redis;

static int parse_args(int argc, char **argv, struct options *o)
{
	*o = (struct options){ false, LAYERS, TOKENS, RUNS, -1, -1, NULL };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--quick") == 0) {
			o->quick = true;
			o->layers = QUICK_LAYERS;
			o->tokens = QUICK_TOKENS;
			o->runs = QUICK_RUNS;
		} else if (i + 1 < argc && strcmp(a, "--runs") == 0) {
			o->runs = atoi(argv[++i]);
			if (o->runs < 1)
				return -1;
		} else if (i + 1 < argc && strcmp(a, "--cpu") == 0) {
			o->cpu = atoi(argv[++i]);
		} else if (i + 1 < argc && strcmp(a, "--daemon-cpu") == 0) {
			o->daemon_cpu = atoi(argv[++i]);
		} else if (i + 1 < argc && strcmp(a, "--daemon") == 0) {
			o->daemon = argv[++i];
		} else {
			return -1;
		}
	}
	return 0;
}

static redisContext *redis_connect_local(void)
{
	struct timeval timeout = { 5, 0 };
	redisContext *c = redisConnectWithTimeout("127.0.0.1", redis.port, timeout);
	if (c && c->err) {
		redisFree(c);
		return NULL;
	}
	return c;
}

/* Chunk keys in Redis and the bytes of their values. */
static int redis_chunks(long long *keys, long long *bytes)
{
	redisContext *c = redis_connect_local();
	if (!c)
		return -ECONNREFUSED;
	*keys = *bytes = 0;
	redisReply *r = redisCommand(c, "KEYS zc:1:*:c:*");
	int rc = r && r->type == REDIS_REPLY_ARRAY ? 0 : -EPROTO;
	for (size_t i = 0; rc == 0 && i < r->elements; i++) {
		redisReply *len = redisCommand(c, "STRLEN %s", r->element[i]->str);
		if (len && len->type == REDIS_REPLY_INTEGER) {
			(*keys)++;
			*bytes += len->integer;
		}
		if (len)
			freeReplyObject(len);
	}
	if (r)
		freeReplyObject(r);
	redisFree(c);
	return rc;
}

/* The peer's floor: the same records fetched by a plain hiredis client,
 * GETs pipelined 8 at a time as the daemon does. Seconds, or < 0. */
static double redis_raw_get(void)
{
	redisContext *c = redis_connect_local();
	if (!c)
		return -1;
	redisReply *keys = redisCommand(c, "KEYS zc:1:*:c:*");
	double t = -1;
	if (keys && keys->type == REDIS_REPLY_ARRAY) {
		double t0 = bench_now_s();
		bool ok = true;
		for (size_t at = 0; ok && at < keys->elements; at += 8) {
			size_t n = keys->elements - at < 8 ? keys->elements - at : 8;
			for (size_t i = 0; i < n; i++)
				redisAppendCommand(c, "GET %s", keys->element[at + i]->str);
			for (size_t i = 0; ok && i < n; i++) {
				void *reply = NULL;
				ok = redisGetReply(c, &reply) == REDIS_OK && reply &&
				     ((redisReply *)reply)->type == REDIS_REPLY_STRING;
				if (reply)
					freeReplyObject(reply);
			}
		}
		if (ok)
			t = bench_now_s() - t0;
	}
	if (keys)
		freeReplyObject(keys);
	redisFree(c);
	return t;
}

struct prompt {
	uint32_t chunks;
	uint8_t keys[CHUNKS_MAX * ZC_CHUNK_KEY_BYTES];
	uint16_t *k[CHUNKS_MAX], *v[CHUNKS_MAX];  /* [H][CHUNK][D] each */
};

static int prompt_make(struct prompt *p, uint32_t tokens)
{
	uint32_t ids[ZC_PREFIX_CHUNK_TOKENS];
	size_t elements = (size_t)HEADS * ZC_PREFIX_CHUNK_TOKENS * HEAD_DIM;
	p->chunks = tokens / ZC_PREFIX_CHUNK_TOKENS;
	for (uint32_t c = 0; c < p->chunks; c++) {
		for (uint32_t i = 0; i < ZC_PREFIX_CHUNK_TOKENS; i++)
			ids[i] = 1000u + c * ZC_PREFIX_CHUNK_TOKENS + i;
		int rc = zc_chunk_chain(c ? p->keys + (c - 1) * ZC_CHUNK_KEY_BYTES : NULL, ids,
					ZC_PREFIX_CHUNK_TOKENS, p->keys + c * ZC_CHUNK_KEY_BYTES);
		if (rc < 0)
			return rc;
		p->k[c] = bench_alloc_touched(elements * 2);
		p->v[c] = bench_alloc_touched(elements * 2);
		if (!p->k[c] || !p->v[c])
			return -ENOMEM;
		synthetic_kv_fill(p->k[c], HEADS, ZC_PREFIX_CHUNK_TOKENS, HEAD_DIM, true, 0x7a000000u + c);
		synthetic_kv_fill(p->v[c], HEADS, ZC_PREFIX_CHUNK_TOKENS, HEAD_DIM, false,
				  0x7b000000u + c);
	}
	return 0;
}

static zc_session_config bench_config(const struct options *o, const char *name)
{
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = name;
	config.layers = o->layers;
	config.kv_heads = HEADS;
	config.head_dim_k = config.head_dim_v = HEAD_DIM;
	config.max_tokens = o->tokens;
	config.views = ZC_VIEWS_NONE;
	config.model_id = "bench-model";
	return config;
}

/* Every chunk of every layer, keyed or not. */
static int prefill(zc_session *s, const struct options *o, const struct prompt *p, bool keyed)
{
	int rc = 0;
	for (uint32_t layer = 0; rc == 0 && layer < o->layers; layer++)
		for (uint32_t c = 0; rc == 0 && c < p->chunks; c++)
			rc = keyed ? zc_update_and_fetch_chunk(s, layer, ZC_PREFIX_CHUNK_TOKENS, p->k[c],
							       p->v[c],
							       p->keys + c * ZC_CHUNK_KEY_BYTES, NULL,
							       NULL) :
				     zc_update_and_fetch(s, layer, ZC_PREFIX_CHUNK_TOKENS, p->k[c], p->v[c],
							 NULL, NULL);
	return rc;
}

static int daemon_fresh(const char *path, int cpu, const char *url, zc_client **client)
{
	const char *const extra[] = { "--remote", url, NULL };
	if (*client) {
		zc_client_close(*client);
		*client = NULL;
	}
	bench_daemon_stop();
	bench_dir_remove();
	int rc = bench_dir_make("prefix");
	if (rc == 0)
		rc = bench_daemon_start(path, cpu, extra, client);
	return rc;
}

int main(int argc, char **argv)
{
	struct options opt;
	char daemon_path[PATH_MAX], url[64];
	zc_client *client = NULL;
	struct prompt *p = calloc(1, sizeof(*p));
	int rc, status = 1;

	bench_set_name("prefix");
	if (parse_args(argc, argv, &opt) < 0) {
		fprintf(stderr, "usage: prefix [--quick] [--runs N] [--cpu N] [--daemon-cpu N] "
				"[--daemon PATH]\n");
		return 2;
	}
	if (bench_daemon_path(opt.daemon, daemon_path, sizeof daemon_path) < 0)
		return 1;
	bench_choose_cpus(&opt.cpu, &opt.daemon_cpu);
	if (opt.cpu >= 0 && bench_pin(0, opt.cpu) < 0)
		opt.cpu = -1;
	if (!p || prompt_make(p, opt.tokens) < 0) {
		bench_fail("prompt", -ENOMEM);
		return 1;
	}
	if ((rc = redis_tcp_start("prefix", &redis)) < 0) {
		fprintf(stderr, "prefix: cannot start redis-server (%s): is redis-server installed "
				"(make deps)?\n", strerror(-rc));
		redis_tcp_stop(&redis);
		return 1;
	}
	snprintf(url, sizeof(url), "redis://127.0.0.1:%u", redis.port);

	/* The writer: prefills with keys; its chunks reach Redis. */
	if ((rc = daemon_fresh(daemon_path, opt.daemon_cpu, url, &client)) < 0) {
		fprintf(stderr, "prefix: zipcached did not answer: %s\n", zc_strerror(rc));
		goto out;
	}
	zc_session_config config = bench_config(&opt, "writer");
	zc_session *writer;
	if ((rc = zc_session_open(client, &config, &writer)) < 0 ||
	    (rc = prefill(writer, &opt, p, true)) < 0) {
		bench_fail_client(client, "writer", rc);
		goto out;
	}
	long long records = 0, redis_bytes = 0, want = (long long)p->chunks * opt.layers;
	double deadline = bench_now_s() + PUBLISH_WAIT_S;
	while (redis_chunks(&records, &redis_bytes) == 0 && records < want && bench_now_s() < deadline)
		usleep(20000);
	if (records != want) {
		fprintf(stderr, "prefix: %lld of %lld chunk records reached Redis\n", records, want);
		goto out;
	}

	double *tl = calloc((size_t)opt.runs, sizeof(double));
	double *tr = calloc((size_t)opt.runs, sizeof(double));
	double *ta = calloc((size_t)opt.runs, sizeof(double));
	double *tc = calloc((size_t)opt.runs, sizeof(double));
	double *tg = calloc((size_t)opt.runs, sizeof(double));
	if (!tl || !tr || !ta || !tc || !tg)
		goto out;
	for (int run = -1; run < opt.runs; run++) {
		if ((rc = daemon_fresh(daemon_path, opt.daemon_cpu, url, &client)) < 0) {
			fprintf(stderr, "prefix: zipcached did not answer: %s\n", zc_strerror(rc));
			goto out;
		}
		zc_prefix_held held;
		zc_session *remote, *local, *recompute;
		zc_session_config a = bench_config(&opt, "remote");
		a.prefix = p->keys;
		a.prefix_chunks = p->chunks;
		double t0 = bench_now_s();
		rc = zc_client_lookup_prefix(client, &a, p->keys, p->chunks, &held);
		double t1 = bench_now_s();
		if (rc == 0 && (held.chunks != p->chunks || held.local_chunks != 0))
			rc = ZC_EINTERNAL;
		if (rc == 0)
			rc = zc_session_open(client, &a, &remote);
		double t2 = bench_now_s();
		if (rc < 0) {
			bench_fail_client(client, "remote attach", rc);
			goto out;
		}
		zc_session_config b = a;
		b.name = "local";
		rc = zc_session_open(client, &b, &local);
		double t3 = bench_now_s();
		if (rc < 0) {
			bench_fail_client(client, "local attach", rc);
			goto out;
		}
		zc_session_config c = bench_config(&opt, "recompute");
		rc = zc_session_open(client, &c, &recompute);
		double t4 = bench_now_s();
		if (rc == 0)
			rc = prefill(recompute, &opt, p, false);
		double t5 = bench_now_s();
		if (rc < 0) {
			bench_fail_client(client, "recompute", rc);
			goto out;
		}
		double g = redis_raw_get();
		if (g < 0) {
			bench_fail("raw GET", -EPROTO);
			goto out;
		}
		if (run >= 0) {
			tg[run] = g;
			tl[run] = t1 - t0;
			tr[run] = t2 - t1;
			ta[run] = t3 - t2;
			tc[run] = t5 - t4;
		}
	}
	double l = bench_median(tl, (size_t)opt.runs), r = bench_median(tr, (size_t)opt.runs);
	double a = bench_median(ta, (size_t)opt.runs), c = bench_median(tc, (size_t)opt.runs);
	double g = bench_median(tg, (size_t)opt.runs);
	unsigned long long fp16 = 2ull * opt.layers * opt.tokens * HEADS * HEAD_DIM * 2;
	printf("prefix: %u layers x %u tokens (%u chunks of %u), H_kv %u, D %u, views none; "
	       "medians of %d runs\n", opt.layers, opt.tokens, p->chunks, ZC_PREFIX_CHUNK_TOKENS,
	       HEADS, HEAD_DIM, opt.runs);
	printf("  %-34s %10s %12s %8s\n", "", "ms", "bytes", "x fp16");
	printf("  %-34s %10.2f\n", "lookup (all chunks in Redis)", l * 1e3);
	printf("  %-34s %10.2f %12lld %8.3f\n", "remote attach (fetch, verify, share)", r * 1e3,
	       redis_bytes, (double)redis_bytes / (double)fp16);
	printf("  %-34s %10.2f %12lld %8.3f\n", "raw GET of the records (hiredis)", g * 1e3,
	       redis_bytes, (double)redis_bytes / (double)fp16);
	printf("  %-34s %10.2f %12d\n", "local attach (shared by reference)", a * 1e3, 0);
	printf("  %-34s %10.2f %12llu %8.3f\n", "recompute (prefill through daemon)", c * 1e3, fp16,
	       1.0);
	printf("  recompute's daemon side / (lookup + remote attach): %.2f; raw GET / remote "
	       "attach: %.2f\n", c / (r + l), g / r);
	const char *names[] = { "lookup", "remote_attach", "raw_get", "local_attach", "recompute" };
	double times[] = { l, r, g, a, c };
	unsigned long long bytes[] = { 0, (unsigned long long)redis_bytes,
				       (unsigned long long)redis_bytes, 0, fp16 };
	for (int k = 0; k < 5; k++)
		printf("{\"bench\":\"prefix\",\"op\":\"%s\",\"layers\":%u,\"tokens\":%u,\"chunks\":%u,"
		       "\"runs\":%d,\"median_ms\":%.3f,\"bytes\":%llu,\"fp16_bytes\":%llu,"
		       "\"recompute_over_this\":%.3f,\"raw_get_over_this\":%.3f,\"quick\":%s}\n",
		       names[k], opt.layers, opt.tokens, p->chunks, opt.runs, times[k] * 1e3, bytes[k],
		       fp16, c / times[k], g / times[k], opt.quick ? "true" : "false");
	status = 0;
out:
	zc_client_close(client);
	bench_daemon_stop();
	bench_dir_remove();
	redis_tcp_stop(&redis);
	return status;
}
