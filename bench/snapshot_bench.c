/*
 * Snapshot benchmark (issue 13, §5: "snapshot export / import ÷ memcpy of
 * the snapshot bytes ≥ 0.5").
 *
 * Starts its own daemon (bench_daemon.h), opens a session of L layers x S
 * tokens (32 x 4096; B = 1, H_kv = 8, D = 128, default codec, streaming,
 * views = full), prefills every layer as one block through the staging
 * buffer and decodes DECODE_STEPS tokens per layer (so the residual is in
 * use), then, interleaved run by run (a warm-up first, medians of --runs):
 *
 *   export   zc_session_export into a file on tmpfs (/dev/shm), written
 *            over in place from offset 0 each run: the daemon reads every
 *            block from the pool, hashes it, writes it;
 *   import   zc_session_import of that file into a new session (closed
 *            after each run, untimed): verified whole, then read again and
 *            written into fresh pool extents and a new session file;
 *   memcpy   the same snapshot bytes copied between two warm buffers (the
 *            goal's limit), and into fresh pages (mmap'd per run: what a
 *            copy into new memory costs, as the import's blocks are);
 *   write    the same bytes written with write(2) from a hot 256 KiB
 *            buffer over a tmpfs file in place (the kernel's copy into
 *            tmpfs pages: the floor under any export to a tmpfs file), and
 *            into a new tmpfs file (fresh pages: the floor under an import,
 *            which must create its blocks' pages).
 *
 * Ratios are throughputs: (bytes / export seconds) / (bytes / memcpy
 * seconds). Output: a table, then one JSON object per line.
 *
 * The benchmark runs on one CPU and zipcached on another (--cpu,
 * --daemon-cpu); --daemon-cpus N gives zipcached N CPUs instead (the
 * allowed ones other than the benchmark's, then the benchmark's own, which
 * only waits meanwhile), so that the export's writer thread can write one
 * buffer while the export reads and hashes the next.
 *
 * usage: snapshot [--quick] [--runs N] [--cpu N] [--daemon-cpu N] [--daemon-cpus N]
 *                 [--daemon PATH]
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "synthetic_kv.h"
#include "zipcache/client.h"

#define HEADS 8u
#define HEAD_DIM 128u
#define LAYERS 32u
#define TOKENS 4096u
#define QUICK_LAYERS 4u
#define QUICK_TOKENS 1024u
/* Decode steps per layer after the prefill: a residual of 64 rows. */
#define DECODE_STEPS 64u
#define RUNS 7
#define QUICK_RUNS 2
#define GOAL 0.5
#define WRITE_CHUNK (256u << 10)

struct options {
	bool quick;
	uint32_t layers, tokens;
	int runs, cpu, daemon_cpu, daemon_cpus;
	const char *daemon;
};

static void *(*volatile memcpy_fn)(void *, const void *, size_t) = memcpy;

static int parse_args(int argc, char **argv, struct options *o)
{
	*o = (struct options){ false, LAYERS, TOKENS, RUNS, -1, -1, 1, NULL };
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
		} else if (i + 1 < argc && strcmp(a, "--daemon-cpus") == 0) {
			o->daemon_cpus = atoi(argv[++i]);
			if (o->daemon_cpus < 1)
				return -1;
		} else if (i + 1 < argc && strcmp(a, "--daemon") == 0) {
			o->daemon = argv[++i];
		} else {
			return -1;
		}
	}
	return 0;
}

static int session_fill(zc_client *client, zc_session *s, const struct options *o)
{
	size_t half = 2 * (size_t)o->tokens * HEADS * HEAD_DIM;
	uint16_t *keys = malloc(half), *values = malloc(half);
	uint16_t step_keys[HEADS * HEAD_DIM], step_values[HEADS * HEAD_DIM];
	void *staging;
	zc_view view;
	int rc = keys && values ? 0 : -ENOMEM;
	if (rc == 0) {
		synthetic_kv_fill(keys, HEADS, o->tokens, HEAD_DIM, true, 0x5a5a0000u);
		synthetic_kv_fill(values, HEADS, o->tokens, HEAD_DIM, false, 0x5a5a0001u);
		rc = zc_client_staging(client, 2 * half, &staging);
	}
	for (uint32_t layer = 0; rc == 0 && layer < o->layers; layer++) {
		memcpy(staging, keys, half);
		memcpy((uint8_t *)staging + half, values, half);
		rc = zc_update_and_fetch_staged(s, layer, o->tokens, 0, half, &view, NULL);
	}
	for (uint32_t t = 0; rc == 0 && t < DECODE_STEPS; t++) {
		synthetic_kv_fill(step_keys, HEADS, 1, HEAD_DIM, true, 0x5a5b0000u + t);
		synthetic_kv_fill(step_values, HEADS, 1, HEAD_DIM, false, 0x5a5c0000u + t);
		for (uint32_t layer = 0; rc == 0 && layer < o->layers; layer++)
			rc = zc_update_and_fetch(s, layer, 1, step_keys, step_values, &view, NULL);
	}
	free(keys);
	free(values);
	if (rc < 0)
		bench_fail_client(client, "fill", rc);
	return rc;
}

int main(int argc, char **argv)
{
	struct options opt;
	char daemon_path[PATH_MAX], file[] = "/dev/shm/zc-snapshot-bench-XXXXXX";
	zc_client *client = NULL;
	int rc, status = 1, fd = -1;
	uint8_t *src = NULL, *dst = NULL;

	bench_set_name("snapshot");
	if (parse_args(argc, argv, &opt) < 0) {
		fprintf(stderr, "usage: snapshot [--quick] [--runs N] [--cpu N] [--daemon-cpu N] "
				"[--daemon-cpus N] [--daemon PATH]\n");
		return 2;
	}
	if (bench_daemon_path(opt.daemon, daemon_path, sizeof daemon_path) < 0)
		return 1;
	bench_choose_cpus(&opt.cpu, &opt.daemon_cpu);
	cpu_set_t allowed;
	if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
		CPU_ZERO(&allowed);
	if (opt.cpu >= 0 && bench_pin(0, opt.cpu) < 0)
		opt.cpu = -1;
	zc_codec_init();
	if (bench_dir_make("snapshot") < 0)
		return 1;
	/* Spread over N CPUs, its codec threads as many (it counts the CPUs
	 * it may use at start, before the spread). */
	char threads[16];
	snprintf(threads, sizeof threads, "%d", opt.daemon_cpus);
	const char *spread_args[] = { "--codec-threads", threads, NULL };
	if ((rc = bench_daemon_start(daemon_path, opt.daemon_cpus > 1 ? -1 : opt.daemon_cpu,
				     opt.daemon_cpus > 1 ? spread_args : NULL, &client)) < 0) {
		fprintf(stderr, "snapshot: zipcached did not answer: %s\n", zc_strerror(rc));
		goto out;
	}
	if (opt.daemon_cpus > 1) {
		opt.daemon_cpus = bench_daemon_spread(bench_daemon_pid(), &allowed, opt.cpu,
						     opt.daemon_cpus);
		if (opt.daemon_cpus == 0) {
			fprintf(stderr, "snapshot: cannot set zipcached's CPUs\n");
			goto out;
		}
	} else if (opt.daemon_cpu < 0) {
		opt.daemon_cpus = 0;   /* unpinned */
	}
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = "snapshot-bench";
	config.layers = opt.layers;
	config.kv_heads = HEADS;
	config.head_dim_k = config.head_dim_v = HEAD_DIM;
	config.max_tokens = opt.tokens + DECODE_STEPS;
	config.model_id = "bench-model";
	zc_session *session;
	if ((rc = zc_session_open(client, &config, &session)) < 0) {
		bench_fail_client(client, "open", rc);
		goto out;
	}
	if (session_fill(client, session, &opt) < 0)
		goto out;
	fd = mkstemp(file);
	if (fd < 0) {
		bench_fail("snapshot file", -errno);
		goto out;
	}

	double *te = calloc((size_t)opt.runs, sizeof(double));
	double *ti = calloc((size_t)opt.runs, sizeof(double));
	double *tm = calloc((size_t)opt.runs, sizeof(double));
	double *tf = calloc((size_t)opt.runs, sizeof(double));
	double *tw = calloc((size_t)opt.runs, sizeof(double));
	double *tn = calloc((size_t)opt.runs, sizeof(double));
	char plain[] = "/dev/shm/zc-snapshot-write-XXXXXX";
	int plain_fd = mkstemp(plain);
	if (plain_fd < 0) {
		bench_fail("write file", -errno);
		goto out;
	}
	uint64_t bytes = 0;
	for (int run = -1; run < opt.runs; run++) {
		/* export */
		if (lseek(fd, 0, SEEK_SET) != 0) {
			bench_fail("lseek", -errno);
			goto out;
		}
		double t0 = bench_now_s();
		rc = zc_session_export(session, fd, &bytes);
		double t1 = bench_now_s();
		if (rc < 0) {
			bench_fail_client(client, "export", rc);
			goto out;
		}
		/* import */
		zc_import_options options;
		zc_session *imported;
		zc_import_options_default(&options);
		options.name = "imported";
		options.model_id = "bench-model";
		double t2 = bench_now_s();
		rc = zc_session_import(client, fd, &options, &imported);
		double t3 = bench_now_s();
		if (rc < 0) {
			bench_fail_client(client, "import", rc);
			goto out;
		}
		zc_session_close(imported);
		/* memcpy of the same bytes: warm, then into fresh pages */
		if (!src) {
			src = malloc(bytes);
			dst = malloc(bytes);
			if (!src || !dst || pread(fd, src, bytes, 0) != (ssize_t)bytes) {
				bench_fail("snapshot bytes", -ENOMEM);
				goto out;
			}
			memset(dst, 1, bytes);
		}
		double t4 = bench_now_s();
		memcpy_fn(dst, src, bytes);
		double t5 = bench_now_s();
		uint8_t *fresh = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
				      -1, 0);
		if (fresh == MAP_FAILED) {
			bench_fail("mmap", -errno);
			goto out;
		}
		double t6 = bench_now_s();
		memcpy_fn(fresh, src, bytes);
		double t7 = bench_now_s();
		munmap(fresh, bytes);
		/* write(2) over the same tmpfs pages, then into fresh ones */
		double tws[2];
		for (int k = 0; k < 2; k++) {
			if (k == 1 && ftruncate(plain_fd, 0) < 0) {
				bench_fail("ftruncate", -errno);
				goto out;
			}
			lseek(plain_fd, 0, SEEK_SET);
			double w0 = bench_now_s();
			for (uint64_t at = 0; at < bytes; at += WRITE_CHUNK) {
				size_t n = bytes - at < WRITE_CHUNK ? (size_t)(bytes - at) : WRITE_CHUNK;
				if (write(plain_fd, src + (at % (4 * WRITE_CHUNK)), n) != (ssize_t)n) {
					bench_fail("write", -errno);
					goto out;
				}
			}
			tws[k] = bench_now_s() - w0;
		}
		if (run >= 0) {
			tw[run] = tws[0];
			tn[run] = tws[1];
			te[run] = t1 - t0;
			ti[run] = t3 - t2;
			tm[run] = t5 - t4;
			tf[run] = t7 - t6;
		}
	}
	double e = bench_median(te, (size_t)opt.runs), i = bench_median(ti, (size_t)opt.runs);
	double m = bench_median(tm, (size_t)opt.runs), f = bench_median(tf, (size_t)opt.runs);
	double wr = bench_median(tw, (size_t)opt.runs), wn = bench_median(tn, (size_t)opt.runs);
	close(plain_fd);
	unlink(plain);
	double gb = (double)bytes / 1e9;
	uint64_t fp16 = (uint64_t)opt.layers * (opt.tokens + DECODE_STEPS) * HEADS * HEAD_DIM * 2 * 2;
	printf("snapshot benchmark: zipcached %s, %u layers x %u tokens (+%u decoded), B=1 H=%u "
	       "D=%u, default codec, views full; file on tmpfs; zipcached on %d CPU(s) (0: "
	       "unpinned); medians of %d runs%s\n",
	       zc_client_server_info(client)->server_version, opt.layers, opt.tokens, DECODE_STEPS,
	       HEADS, HEAD_DIM, opt.daemon_cpus, opt.runs,
	       opt.quick ? " (QUICK: a smoke test, not a measurement)" : "");
	printf("snapshot %.1f MiB (%.3f of the %.1f MiB fp16)\n", (double)bytes / 1048576.0,
	       (double)bytes / (double)fp16, (double)fp16 / 1048576.0);
	printf("  %-26s %9s %8s %14s %14s %12s\n", "op", "ms", "GB/s", "/ memcpy warm",
	       "/ memcpy fresh", "/ write(2)");
	printf("  %-26s %9.2f %8.2f %14.3f %14.3f %12.3f\n", "export", e * 1e3, gb / e, m / e, f / e,
	       wr / e);
	printf("  %-26s %9.2f %8.2f %14.3f %14.3f %12.3f\n", "import", i * 1e3, gb / i, m / i, f / i,
	       wn / i);
	printf("  %-26s %9.2f %8.2f\n", "memcpy (warm)", m * 1e3, gb / m);
	printf("  %-26s %9.2f %8.2f\n", "memcpy (fresh pages)", f * 1e3, gb / f);
	printf("  %-26s %9.2f %8.2f   (export's floor)\n", "write(2), tmpfs in place", wr * 1e3,
	       gb / wr);
	printf("  %-26s %9.2f %8.2f   (import's floor)\n", "write(2), new tmpfs file", wn * 1e3,
	       gb / wn);
	printf("goal: export and import / memcpy (warm) >= %.1f: export %s, import %s\n", GOAL,
	       m / e >= GOAL ? "met" : "NOT met", m / i >= GOAL ? "met" : "NOT met");
	for (int k = 0; k < 2; k++) {
		double t = k == 0 ? e : i;
		printf("{\"bench\":\"snapshot\",\"op\":\"%s\",\"layers\":%u,\"tokens\":%u,\"bytes\":%llu,"
		       "\"fp16_bytes\":%llu,\"runs\":%d,\"median_ms\":%.3f,\"gbps\":%.3f,"
		       "\"memcpy_gbps\":%.3f,\"memcpy_fresh_gbps\":%.3f,\"write_gbps\":%.3f,"
		       "\"ratio\":%.3f,\"ratio_fresh\":%.3f,\"ratio_write\":%.3f,\"goal\":%.1f,"
		       "\"daemon_cpus\":%d,\"quick\":%s}\n",
		       k == 0 ? "export" : "import", opt.layers, opt.tokens, (unsigned long long)bytes,
		       (unsigned long long)fp16, opt.runs, t * 1e3, gb / t, gb / m, gb / f,
		       gb / (k == 0 ? wr : wn), m / t, f / t, (k == 0 ? wr : wn) / t, GOAL,
		       opt.daemon_cpus, opt.quick ? "true" : "false");
	}
	status = 0;
out:
	if (fd >= 0) {
		close(fd);
		unlink(file);
	}
	free(src);
	free(dst);
	zc_client_close(client);
	bench_daemon_stop();
	bench_dir_remove();
	return status;
}
