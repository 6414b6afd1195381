/*
 * What the host lends the daemon, read once at start: descriptors
 * (RLIMIT_NOFILE) and memory (the shm-dir's file system and the cgroup's
 * memory limit). So the defaults fit the machine, and the limits that
 * cannot be met are said at start rather than found under load.
 */
#ifndef ZIPCACHE_RESOURCES_H
#define ZIPCACHE_RESOURCES_H

#include <stddef.h>
#include <stdint.h>

struct options;

/* Descriptors held open at most by the daemon's fixed handles. */
#define RESOURCES_FIXED_DESCRIPTORS 16

/*
 * Descriptors the configured limits can hold open at once:
 * RESOURCES_FIXED_DESCRIPTORS (stdio, listener, lock, the spare kept for
 * EMFILE, libuv's epoll, signal and wake-up descriptors, the shm-dir),
 * plus per connection its socket, its staging buffer and the descriptors
 * its queued replies may hold (CONNECTION_DESCRIPTORS), plus one per
 * session (its file), plus the metrics endpoint's when it is on.
 */
uint64_t resources_descriptors_needed(const struct options *options);

/* The same as a sentence's worth of arithmetic, for --help and the log:
 * "16 + 6 per connection + 1 per session + 68 for metrics". */
void resources_descriptors_formula(const struct options *options, char *text, size_t size);

/* The CPUs the calling thread may run on now (its affinity; the daemon's
 * threads share it unless a benchmark spread them), at least 1: what
 * sizes the codec's and the snapshots' threads. */
int resources_cpus(void);

/* CPUs online on the machine, whatever this process is allowed (>= 1). */
int resources_cpus_online(void);

/* Raises the soft RLIMIT_NOFILE to the hard limit. *before is the soft
 * limit found, *soft and *hard the limits after. */
int resources_raise_descriptor_limit(uint64_t *before, uint64_t *soft, uint64_t *hard);

/*
 * The tightest memory limit of the cgroups the process is in, bytes, or 0
 * for none: memory.max (cgroup v2) or memory.limit_in_bytes (v1) of its
 * cgroup and each ancestor, read from proc_cgroup (/proc/self/cgroup)
 * under cgroup_root (/sys/fs/cgroup; v1's memory controller under
 * ROOT/memory). A cgroup directory not visible (a cgroup namespace shows
 * only its root) counts as the root's limit.
 */
uint64_t resources_cgroup_memory_limit(const char *proc_cgroup, const char *cgroup_root);

/*
 * The default memory budget for a file system of fs_bytes and a cgroup
 * limit of cgroup_bytes (either 0: unknown or none): the smaller, less
 * headroom of a tenth (at least 64 MiB, at most half). 0 when both are 0.
 */
uint64_t resources_budget_from(uint64_t fs_bytes, uint64_t cgroup_bytes);

/* What the default budget was derived from. */
struct resources_memory {
	uint64_t fs_bytes;       /* statfs of the shm-dir: f_blocks * f_bsize */
	uint64_t cgroup_bytes;   /* 0: no cgroup limit */
	uint64_t budget;         /* 0: nothing to derive it from */
};

/* Reads the shm-dir's file system and this process's cgroups. */
void resources_memory_budget_default(const char *shm_dir, struct resources_memory *out);

#endif
