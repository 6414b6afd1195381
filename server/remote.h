/*
 * The shared compressed tier on Redis (docs/REMOTE.md): configuration
 * (`--remote`, `--remote-credentials`, `--remote-timeout-ms`), the one
 * rule every key is made by, and synchronous get/set calls over the
 * router (server/redis_router.h), with their failures counted, timed and
 * logged once per change of state.
 *
 * Thread-safe: one mutex around each call, so libuv's worker threads may
 * call it at once; the calls then take turns (a batch is pipelined, so a
 * turn is one round trip per node, not one per key). Metrics read the
 * counters from the loop thread without the mutex (atomics).
 *
 * Every call returns 0 (or a count) or a negative code: -ETIMEDOUT (Redis
 * did not answer within --remote-timeout-ms), ZC_EDENIED (AUTH refused),
 * ZC_ENOTFOUND (no such key, where that is an answer), ZC_EINVALID (a
 * value over REMOTE_VALUE_MAX, a bad key part), ZC_EREMOTE (unreachable,
 * an error reply, redirections exhausted, cluster down). Nothing aborts;
 * remote_last_error() says what the last failure was, never a secret.
 */
#ifndef ZIPCACHE_REMOTE_H
#define ZIPCACHE_REMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "metrics.h"
#include "redis_router.h"

/* Addresses in one --remote URL. */
#define REMOTE_MAX_ENDPOINTS 16
/* The largest value stored or accepted back: one compressed block of a
 * session at its largest shape is a few MiB; 64 MiB leaves room and still
 * bounds what a broken or hostile server can make us buffer. */
#define REMOTE_VALUE_MAX (64u << 20)
/* What a reply may add to a value: RESP framing ($LENGTH CR LF ... CR LF)
 * and the reply object hiredis's reader builds around it. */
#define REMOTE_REPLY_SLACK 4096u
/* --remote-timeout-ms's default: a loopback or LAN round trip is well
 * under a millisecond; a block of MiBs a few; a stalled server is not
 * waited for longer than this per exchange. */
#define REMOTE_TIMEOUT_MS_DEFAULT 2000
/* Fingerprints and content hashes in keys: raw bytes, at most this many. */
#define REMOTE_ID_MAX 64
/* A key's text: the prefix, a uid, a kind, two hex ids and two numbers. */
#define REMOTE_KEY_MAX 400
/* The schema's version, the key's second field: bumped when it changes. */
#define REMOTE_KEY_VERSION 1

struct remote_config {
	struct router_endpoint endpoints[REMOTE_MAX_ENDPOINTS];
	uint32_t n_endpoints;           /* 0: no remote tier */
	char credentials_path[4096];    /* "": no AUTH */
	uint32_t timeout_ms;
};

/*
 * Parses `redis://HOST:PORT[,HOST:PORT...]` (an IPv6 host in brackets,
 * `[::1]:6379`) or `unix:///PATH` (one standalone server's Unix socket,
 * an endpoint with port 0) into config's endpoints. On failure returns -EINVAL and
 * puts a sentence naming what is wrong in why. The one parser of the URL.
 */
int remote_url_parse(const char *text, struct remote_config *config, char *why, size_t size);

/*
 * What a key names. Every kind is inside one uid's namespace. A session
 * offloaded is a manifest found by its name alone (attach knows no more),
 * naming the fingerprint and the generation its blocks and residuals were
 * written under: a new offload writes a new generation beside the old one
 * and then the manifest, so a reader never mixes two (docs/REMOTE.md).
 */
enum remote_key_kind {
	REMOTE_KEY_MANIFEST,  /* a session's record: name */
	REMOTE_KEY_BLOCK,     /* one compressed block: name, fingerprint, generation, layer, block */
	REMOTE_KEY_RESIDUAL,  /* a layer's exact residual: name, fingerprint, generation, layer */
	REMOTE_KEY_CHUNK,     /* a block by content: fingerprint, chain hash, layer */
	REMOTE_KEY_KIND_COUNT
};

/* The parts a key is made of, checked by remote_key_make; those the kind
 * does not use are ignored. */
struct remote_key_parts {
	enum remote_key_kind kind;
	const char *name;              /* session name: 1..ZC_SESSION_NAME_MAX bytes */
	const uint8_t *fingerprint;    /* 1..REMOTE_ID_MAX bytes */
	size_t fingerprint_len;
	uint64_t generation;           /* block, residual */
	const uint8_t *chain;          /* chunk: 1..REMOTE_ID_MAX bytes */
	size_t chain_len;
	uint32_t layer;                /* block, residual, chunk */
	uint32_t block;                /* block */
};

/* A key, made only by remote_key_make (the calls take nothing else). */
struct remote_key {
	uint16_t len;
	char text[REMOTE_KEY_MAX];
};

/*
 * Makes the key of parts in uid's namespace (docs/REMOTE.md, "Keys"):
 *   zc:1:UID:m:NAMEHEX
 *   zc:1:UID:b:NAMEHEX:FPHEX:GENERATION:LAYER:BLOCK
 *   zc:1:UID:r:NAMEHEX:FPHEX:GENERATION:LAYER
 *   zc:1:UID:c:FPHEX:CHAINHEX:LAYER
 * The uid is the peer's, attested by the kernel; every other part is
 * hex or a decimal number, so no byte of a name can reach another uid's
 * keys, a field separator or a cluster hash tag. ZC_EINVALID for a
 * missing, empty or oversized part.
 */
int remote_key_make(struct remote_key *key, uint32_t uid, const struct remote_key_parts *parts);

/* One key and its value, for the batch calls. */
struct remote_item {
	const struct remote_key *key;
	const void *value;      /* set_many: the bytes to store */
	size_t len;
	/* get_many: filled; value malloc'd (caller frees), status 0 or
	 * ZC_ENOTFOUND (or the batch's failure). */
	void *got;
	size_t got_len;
	int status;
};

/* Reasons in zipcache_remote_errors_total{reason}. */
enum remote_error_kind {
	REMOTE_ERROR_TIMEOUT,
	REMOTE_ERROR_UNAVAILABLE,  /* unreachable, connection lost, cluster down */
	REMOTE_ERROR_DENIED,       /* AUTH refused */
	REMOTE_ERROR_REPLY,        /* an error reply, a malformed or oversized reply */
	REMOTE_ERROR_KIND_COUNT
};

/* Reasons in zipcache_remote_{offload,restore}_failures_total{reason}. */
enum remote_transfer_failure {
	REMOTE_FAILURE_REMOTE,   /* Redis down, slow or refusing */
	REMOTE_FAILURE_TOUCHED,  /* offload: the session was used while it was written */
	REMOTE_FAILURE_MISSING,  /* restore: a part the manifest names is gone */
	REMOTE_FAILURE_CORRUPT,  /* restore: a damaged manifest or part */
	REMOTE_FAILURE_LOCAL,    /* this node could not encode or build it */
	REMOTE_TRANSFER_FAILURE_COUNT
};

const char *remote_transfer_failure_name(enum remote_transfer_failure kind);

/* What metrics.c prints (zipcache_remote_*). */
struct remote_stats {
	bool up;
	uint64_t errors[REMOTE_ERROR_KIND_COUNT];
	uint64_t latency_buckets[METRICS_BUCKETS];
	uint64_t latency_count;
	uint64_t latency_sum_ns;
	uint64_t bytes_sent, bytes_received;
	uint64_t redirections;
	/* Counted by the offload and restore paths (remote_count_*). */
	uint64_t offloads, restores;
	uint64_t offload_failures[REMOTE_TRANSFER_FAILURE_COUNT];
	uint64_t restore_failures[REMOTE_TRANSFER_FAILURE_COUNT];
	uint64_t offload_ns;   /* time the counted offloads took, summed */
};

struct remote;

/*
 * Reads the credentials file (if any; see remote_credentials_read) and
 * makes the router; connects to nothing yet except one PING that tells
 * the log whether Redis is up. A Redis that is down is not a failure here
 * (sessions stay local); bad configuration or credentials are, with why.
 */
int remote_open(const struct remote_config *config, struct remote **out, char *why, size_t size);
void remote_close(struct remote *remote);

/*
 * The credentials file: the ACL user on the first line, the password on
 * the second (nothing else; a trailing newline optional; an empty first
 * line is the default user). Refused unless a regular file owned by the
 * daemon's uid with no group or other permission bits (as ssh refuses a
 * private key), or owned by root and at most group-readable (0640: how a
 * Kubernetes Secret reaches a non-root container). user and password are
 * malloc'd; why names the file and the rule broken, never the contents.
 */
int remote_credentials_read(const char *path, char **user, char **password, char *why,
			    size_t size);

int remote_ping(struct remote *remote);

/* SET key value EX ttl (ttl 0: no expiry). */
int remote_set(struct remote *remote, const struct remote_key *key, const void *value, size_t len,
	       uint32_t ttl_seconds);

/* Every item SET (EX ttl), pipelined, grouped by node; 0 only when every
 * write was confirmed (OK), else the first failure. */
int remote_set_many(struct remote *remote, const struct remote_item *items, size_t count,
		    uint32_t ttl_seconds);

/* GET: *value malloc'd (caller frees) and *len; ZC_ENOTFOUND when there is
 * no such key. */
int remote_get(struct remote *remote, const struct remote_key *key, void **value, size_t *len);

/* Every item's GET, pipelined: items' got/got_len/status filled. Returns 0
 * when every key was answered (found or not), else the first failure
 * (and no item keeps a value). */
int remote_get_many(struct remote *remote, struct remote_item *items, size_t count);

/* DEL of every key, pipelined; *deleted (if not NULL) how many existed. */
int remote_del_many(struct remote *remote, const struct remote_key *const *keys, size_t count,
		    uint64_t *deleted);

/* 1 when the key exists, 0 when not, or a failure. */
int remote_exists(struct remote *remote, const struct remote_key *key);

/* EXISTS of every key, pipelined: *found how many exist. */
int remote_exists_count(struct remote *remote, const struct remote_key *const *keys, size_t count,
			uint64_t *found);

/* EXPIRE key ttl: 0, or ZC_ENOTFOUND when there is no such key. */
int remote_expire(struct remote *remote, const struct remote_key *key, uint32_t ttl_seconds);

/* The last failure's text (any caller's), for replies and tests. */
void remote_last_error(struct remote *remote, char *text, size_t size);

/* For the offload and restore paths' counters. */
void remote_count_offload(struct remote *remote, uint64_t elapsed_ns);
void remote_count_restore(struct remote *remote);
void remote_count_offload_failure(struct remote *remote, enum remote_transfer_failure kind);
void remote_count_restore_failure(struct remote *remote, enum remote_transfer_failure kind);

void remote_stats_read(struct remote *remote, struct remote_stats *stats);

/* The reason label of each error kind, for metrics.c. */
const char *remote_error_kind_name(enum remote_error_kind kind);

#endif
