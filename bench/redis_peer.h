/*
 * A real redis-server for the service benchmark's peer comparison: started
 * on a Unix socket in the benchmark's directory (no TCP port, no
 * persistence), pinned to a CPU, spoken to in plain RESP over a blocking
 * socket (the same way the raw round trip is), stopped by its pid.
 */
#ifndef ZIPCACHE_BENCH_REDIS_PEER_H
#define ZIPCACHE_BENCH_REDIS_PEER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* 0 and a connected socket in *fd; -ENOENT when redis-server is not
 * installed (the comparison is skipped), another -errno on failure. */
int redis_peer_start(const char *dir, int cpu, int *fd);
void redis_peer_stop(void);

/* Builds "SET k <value_bytes bytes>" in RESP into out (cap bytes); its length. */
size_t redis_set_command(uint8_t *out, size_t cap, size_t value_bytes);

/* One SET round trip: the command out, "+OK\r\n" back. */
/* spin_us: the reply polled that long before a blocking receive. */
int redis_round_trip(int fd, const uint8_t *command, size_t len, unsigned spin_us);

/*
 * A redis-server on 127.0.0.1 and a free port, for the benchmarks of the
 * remote tier (bench/remote_bench.c, bench/prefix_bench.c): no
 * persistence, its log in a directory of its own (/tmp/zc-TAG-redis.*),
 * killed with this process. 0 once it answers PING; -ENOENT when
 * redis-server is not installed or exits at once, another -errno on
 * failure (nothing left running).
 */
struct redis_tcp {
	pid_t pid;
	uint16_t port;
	char dir[64];
};
int redis_tcp_start(const char *tag, struct redis_tcp *server);
/* SIGTERM, then SIGKILL after two seconds, and its directory removed;
 * nothing when not started. */
void redis_tcp_stop(struct redis_tcp *server);

/* A TCP port on 127.0.0.1 free just now (0 when none could be had). */
uint16_t bench_free_port(void);

#endif
