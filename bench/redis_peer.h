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

/* 0 and a connected socket in *fd; -ENOENT when redis-server is not
 * installed (the comparison is skipped), another -errno on failure. */
int redis_peer_start(const char *dir, int cpu, int *fd);
void redis_peer_stop(void);

/* Builds "SET k <value_bytes bytes>" in RESP into out (cap bytes); its length. */
size_t redis_set_command(uint8_t *out, size_t cap, size_t value_bytes);

/* One SET round trip: the command out, "+OK\r\n" back. */
int redis_round_trip(int fd, const uint8_t *command, size_t len);

#endif
