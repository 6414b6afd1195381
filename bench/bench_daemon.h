/*
 * What the service-level benchmarks share: a real zipcached of their own
 * (socket and session files in a fresh temporary directory, on tmpfs when
 * /dev/shm exists), a trivial echo peer for the raw Unix-socket baseline,
 * the frame sizes of a decode step as the daemon really sends them, CPU
 * pinning and the statistics.
 *
 * One daemon and one echo peer at a time, held in this file's state so
 * that a signal handler can stop them and remove the directory.
 */
#ifndef ZIPCACHE_BENCH_DAEMON_H
#define ZIPCACHE_BENCH_DAEMON_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "zipcache/client.h"

/* The prefix of every message ("service", "memory"). */
void bench_set_name(const char *name);
const char *bench_name(void);

void bench_fail(const char *what, int rc);
void bench_fail_client(zc_client *client, const char *what, int rc);

/* ZC_BUILD_DIR/bin/zipcached unless given; 0, or -ENOENT (with a message)
 * when it is not there. */
int bench_daemon_path(const char *given, char *out, size_t len);

/* Creates the directory (tag names it: /dev/shm/zc-TAG-bench.XXXXXX) and
 * installs the SIGINT/SIGTERM/SIGHUP cleanup. */
int bench_dir_make(const char *tag);
void bench_dir_remove(void);
const char *bench_socket_path(void);
const char *bench_shm_dir(void);

/*
 * Starts `path --socket S --shm-dir D --log-level warn [--metrics-listen
 * off] [extra...]` pinned to cpu (-1: not pinned) and connects to it (a
 * reply timeout of 120 s: on a loaded machine a big call takes seconds,
 * and that is a figure, not a failure). extra is NULL-terminated, or
 * NULL.
 */
int bench_daemon_start(const char *path, int cpu, const char *const *extra, zc_client **out);
/* The daemon's threads (and so the ones they make) on `count` of the
 * allowed CPUs (the benchmark's before it pinned itself), `avoid` (the
 * benchmark's) last; how many it got, 0 on failure. */
int bench_daemon_spread(pid_t pid, const cpu_set_t *allowed, int avoid, int count);
/* SIGTERM, then up to 15 s for a graceful stop. */
void bench_daemon_stop(void);
pid_t bench_daemon_pid(void);

/* The raw baseline's peer, forked, on a socketpair, pinned to cpu; after
 * each read it polls (recv without waiting) for spin_us before it sleeps
 * in a blocking recv: zipcached's --busy-poll-us, done alike. */
int bench_echo_start(int cpu, unsigned spin_us);
void bench_echo_stop(void);
int bench_echo_fd(void);

/*
 * One raw round trip: blocking send of the frame (whose body's first 4
 * bytes name the reply's total size: bench_raw_frame), then receive one
 * frame. The same as the client library does, with nothing to encode or
 * decode.
 */
int bench_raw_round_trip(int fd, const uint8_t *frame, size_t len, uint8_t *reply, size_t cap);
/* The same, the reply polled for spin_us before a blocking receive. */
int bench_raw_round_trip_spin(int fd, const uint8_t *frame, size_t len, uint8_t *reply,
			      size_t cap, unsigned spin_us);
/* Writes a raw frame of request_bytes that asks for reply_bytes back. */
void bench_raw_frame(uint8_t *frame, size_t request_bytes, size_t reply_bytes);

/* The frame sizes of a one-token update of one layer with these K/V
 * bytes (per tensor), and of the daemon's reply with these stats, as
 * proto/wire.c encodes them for a request id typical of a long run. */
int bench_update_request_bytes(uint64_t session_id, const void *keys, const void *values,
			       size_t tensor_bytes, bool omit_stats, size_t *out);
/* stats NULL: the reply to a request that asked for none (omit_stats). */
int bench_update_reply_bytes(const zc_layer_stats *stats, uint32_t tokens, uint64_t sequence,
			     size_t *out);

/* 0 or -errno; cpu < 0 does nothing. */
int bench_pin(pid_t pid, int cpu);
/* The first and second CPUs this process may use (-1 for none), for
 * whichever of *cpu, *daemon_cpu is -1; never the same one. */
void bench_choose_cpus(int *cpu, int *daemon_cpu);

/* A sample of the daemon's /metrics on 127.0.0.1:port (its --metrics-listen),
 * the line's name and labels as written there; -1 when absent or unread. */
double bench_daemon_metric(uint16_t port, const char *sample);

double bench_now_s(void);
/* Nearest-rank percentile and median, sorting v in place. */
double bench_percentile(double *v, size_t n, double p);
double bench_median(double *v, size_t n);

/* Aligned like a real tensor and written once, so that page faults of
 * the benchmark's own buffers are never part of a timed call. */
void *bench_alloc_touched(size_t bytes);

#endif
