/* zipcached's flags: defaults, parsing, --help. */
#ifndef ZIPCACHE_OPTIONS_H
#define ZIPCACHE_OPTIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "log.h"
#include "pool.h"
#include "remote.h"

/* A limit left to server_start to derive (the memory budget from the
 * host, per-uid quotas from the daemon-wide limits). */
#define OPTIONS_DERIVED UINT64_MAX

struct options {
	char socket_path[108];     /* sun_path's size */
	unsigned socket_mode;
	char shm_dir[4096];
	uint32_t max_frame_bytes;
	uint32_t max_inline_bytes;
	uint32_t max_connections;
	uint32_t max_sessions;
	uint32_t max_tokens;       /* per session */
	uint64_t max_staging_bytes;
	uint64_t memory_budget;    /* 0: no budget; OPTIONS_DERIVED: from the host */
	/* Per-uid quotas (0: none; OPTIONS_DERIVED: see quota.h). */
	uint64_t max_sessions_per_uid;
	uint64_t max_connections_per_uid;
	uint64_t memory_budget_per_uid;
	uint64_t max_staging_bytes_per_uid;
	/* Reply bytes queued for clients that do not read them. */
	uint64_t max_reply_queue_bytes;   /* per connection */
	uint64_t max_reply_queue_total;   /* all connections */
	uint64_t idle_ttl_seconds; /* 0: sessions never expire */
	uint64_t lease_seconds;    /* a view's lease without another call on its session */
	uint64_t view_idle_seconds;/* views of sessions idle this long are dropped; 0: never */
	uint32_t offload_elements; /* jobs costing more go to the thread pool */
	uint32_t codec_threads;    /* threads per large block (codec_fanout.h); 0: the CPUs allowed */
	uint32_t busy_poll_us;     /* the loop polls without sleeping this long after a request (busy_poll.h); 0: off */
	uint32_t ring_poll_us;     /* the same after a request from a request ring; RING_POLL_AUTO until server_start */
	enum pool_writes pool_writes; /* how blocks get into the pool (pool.h); AUTO until server_start */
	uint64_t max_mapped_bytes; /* address space of all session mappings; 0: derived */
	uint64_t retain_bytes;     /* pages of closed sessions kept for reuse (retain.h); 0: none */
	enum log_level log_level;
	bool adopt;
	char metrics_listen[272]; /* HOST:PORT, or "off" */
	/* The shared tier on Redis (--remote, --remote-credentials,
	 * --remote-timeout-ms); no endpoints: none. */
	struct remote_config remote;
	/* Offload to the remote tier (docs/REMOTE.md): sessions idle this
	 * long are written there and dropped here; 0: only memory relief
	 * offloads. Needs --remote. */
	uint64_t offload_idle_seconds;
	uint32_t remote_ttl_seconds;   /* expiry of every key written */
};

void options_default(struct options *options);

/* 0 to run; 1 when --help/--version was printed; -EINVAL after printing
 * what was wrong to stderr. A --config FILE is read first, wherever it
 * stands, so the command line overrides the file. */
int options_parse(struct options *options, int argc, char **argv);

/* Applies a config file: one `flag-name = value` per line (the long flag
 * without its dashes), `#` comments, blank lines; `no-adopt = true`. */
int options_load_file(struct options *options, const char *path);

/* --help, with the descriptors that `configured`'s limits need. */
void options_print_help(const char *program, const struct options *configured);

#endif
