/*
 * libzipcache: the blocking C client of zipcached.
 *
 *	zc_client *client;
 *	zc_session *session;
 *	zc_session_config config;
 *	zc_view view;
 *	char path[108];
 *
 *	zc_default_socket_path(path, sizeof(path));      (or a path of one's own)
 *	zc_client_connect(path, 1000, &client);
 *	zc_session_config_default(&config);
 *	config.name = "worker-0/request-17";
 *	config.layers = 32; config.batch = 1; config.kv_heads = 8;
 *	config.head_dim_k = config.head_dim_v = 128; config.max_tokens = 4096;
 *	zc_session_open(client, &config, &session);
 *	for each step, for each layer:
 *		zc_update_and_fetch(session, layer, new_tokens, keys, values, &view, NULL);
 *		attention over view.keys / view.values, view.tokens tokens
 *	zc_session_close(session);
 *	zc_client_close(client);
 *
 * Errors: every int-returning call gives 0 or a negative code (see
 * zipcache/error.h); zc_strerror() names it and zc_client_last_error()
 * holds the daemon's sentence about the last failure.
 *
 * Zero copy: fetched K/V are never sent through the socket. A session's
 * views are mapped read-only once, at open; zc_view points into that
 * mapping. Writing through it faults.
 *
 * How long a view stays valid: its pointers are valid until the session
 * is released or closed (or the client closed). Its contents are those
 * after the call that filled it: tokens [0, view.tokens) of that layer.
 * A later update_and_fetch, trim, or a daemon restart may change them —
 * under the streaming policy the newest (residual) tokens are exact fp16
 * until the residual is compressed, at which point the daemon rewrites
 * them with their reconstruction. Read the view after each call.
 *
 * Reading a layer consistently, in this process or any other that maps
 * the session: zipcache/reader.h. The daemon writes a layer inside its
 * seqlock (map.h's `sequence`, odd during a write; `generation` moves when
 * the view is dropped or rebuilt); a reader begins with zc_read_begin
 * (a bounded wait for an even sequence), reads the counts, blocks, residual
 * and pool bytes, and accepts what it read only if zc_read_end says the
 * sequence did not move (ZC_EAGAIN: read again; ZC_ESTALE: the view it
 * read was dropped or rebuilt). zc_layer_reconstruct does the whole loop
 * and reconstructs the layer from its compressed blocks with the codec.
 *
 * Threads: a zc_client and its sessions belong to one thread at a time
 * (no internal locking). Use one client per thread; many clients may use
 * the same daemon session at once, and the daemon orders their updates.
 *
 * Failures, and what the daemon holds after each. A call that fails does
 * so in one of three ways:
 *
 *  1. Refused before anything was sent: ZC_EINVALID from the client's own
 *     checks (a name over 64 bytes, a layer out of range), -ENOMEM,
 *     ZC_EBROKEN. Nothing changed anywhere.
 *
 *  2. Refused by the daemon: it answered with a status, and
 *     zc_client_last_error() holds its sentence (ZC_EINVALID, ZC_ENONFINITE,
 *     ZC_ENOTFOUND, ZC_EEXISTS, ZC_EEXHAUSTED, ZC_EDENIED, ZC_EPRECONDITION,
 *     ZC_EINTERNAL, ...). The daemon checks a request before it changes
 *     anything, so nothing of it was applied: no token appended or trimmed,
 *     no session created, attached or closed. The connection stays usable.
 *
 *  3. The connection broke: a timeout (-ETIMEDOUT), the daemon gone
 *     (-ECONNRESET, -EPIPE), a reply that makes no sense (ZC_EPROTOCOL: the
 *     wrong request id, descriptors other than announced, bytes that do not
 *     decode), a reply too large (ZC_EFRAMESIZE), or the daemon refusing the
 *     connection itself (its connection limit, its stop). What became of
 *     the request is unknown: it may never have reached the daemon, may
 *     have been applied, or may still wait there unread (a stopped or busy
 *     daemon serves every whole request it received, even after this
 *     client hung up). Whatever happens to it happens wholly or not at
 *     all, and once: an update appends all its tokens or none, a trim
 *     removes all it would or none, an open creates the session or not.
 *     From then on every call fails at once with ZC_EBROKEN, without
 *     touching the socket, so that a late reply and the descriptors it
 *     carries can never be taken for another call's; zc_client_broken()
 *     says which failure it was, and only zc_client_reconnect() clears it.
 *     To find out what became of the request: reconnect; if it returns 0
 *     the session handles are still good, after ZC_ERESTARTED attach again
 *     (zc_session_open with attach = true); then read the layer's token
 *     count (zc_session_view, or zc_session_stats for all layers) and
 *     compare it with the count before the call: an update adds exactly
 *     its tokens, a trim removes exactly min(n, held). An open whose reply
 *     was lost shows in zc_client_list_sessions() or answers an attach. A
 *     count that does not show the request yet is final after
 *     ZC_ERESTARTED (the daemon that had it is gone); with the same
 *     daemon the request may still land while that daemon has it unread
 *     (it was stopped, or too busy to read it).
 *
 * Daemon restarts: a call on a connection the daemon dropped fails with
 * -EPIPE, -ECONNRESET or ZC_EPROTOCOL (case 3). zc_client_reconnect()
 * dials again and returns ZC_ERESTARTED when a new daemon answered; the
 * sessions it adopted hold every acknowledged token (and each request the
 * old daemon applied but could not acknowledge, whole), and
 * zc_session_open() with attach = true maps each one again. Old
 * zc_session handles must be released.
 */
#ifndef ZIPCACHE_CLIENT_H
#define ZIPCACHE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/map.h"
#include "zipcache/error.h"
#include "zipcache/reader.h"

/*
 * What one session may be, as the daemon enforces it (an open past one is
 * ZC_EINVALID naming it). Head dims are bounded by ZC_MAX_HEAD_DIM
 * (zipcache/codec.h).
 */
#define ZC_MAX_LAYERS 1024u
#define ZC_MAX_HEADS 65536u            /* batch x kv_heads */
#define ZC_MAX_RESIDUAL_TOKENS 65536u
#define ZC_SESSION_NAME_MAX 64u        /* bytes of UTF-8, without the NUL */
#define ZC_MODEL_ID_MAX 64u            /* a model id's bytes, likewise */
#define ZC_DEFAULT_RESIDUAL_TOKENS 128u

/*
 * Prefix reuse by content (docs/PREFIX.md). A prompt's leading tokens are
 * cut into chunks of ZC_PREFIX_CHUNK_TOKENS; each chunk has a chain key
 * computed by the client from the token ids (the daemon never sees them):
 *
 *	key[0] = zc_chunk_chain(NULL, tokens[0 .. C))
 *	key[i] = zc_chunk_chain(key[i-1], tokens[i*C .. (i+1)*C))
 *
 * zc_chunk_chain is XXH3-128 (xxHash 0.8, seed 0) over the previous key
 * (16 zero bytes for the first chunk) followed by the chunk's token ids as
 * little-endian uint32; the key is the hash in xxHash's canonical form
 * (big-endian high 64 bits, then low 64 bits). Each chunk goes to the
 * daemon as one block per layer with its key (zc_update_and_fetch_chunk);
 * the tail that is not a whole chunk goes the ordinary way.
 */
#define ZC_PREFIX_CHUNK_TOKENS 256u   /* a chunk's tokens: one compressed block per layer */
#define ZC_CHUNK_KEY_BYTES 16u
#define ZC_PREFIX_MAX_CHUNKS 256u     /* keys per lookup or open (65536 tokens) */

typedef struct zc_client zc_client;
typedef struct zc_session zc_session;

typedef enum zc_block_policy {
	ZC_POLICY_STREAMING = 0, /* short blocks wait, exact, in an fp16 residual */
	ZC_POLICY_PER_CALL = 1   /* every block is compressed on arrival (the seed) */
} zc_block_policy;

typedef struct zc_session_config {
	const char *name;          /* unique per user; NULL or "" lets the daemon pick one */
	uint32_t layers;
	uint32_t batch;
	uint32_t kv_heads;
	uint32_t head_dim_k;
	uint32_t head_dim_v;
	uint32_t max_tokens;       /* per layer; the views are sized for it */
	zc_codec_config codec;
	zc_block_policy policy;
	uint32_t residual_tokens;  /* streaming threshold; 0 means the default, 128 */
	bool attach;               /* reuse the session of this name if it exists
				    * with this shape, max_tokens, codec, policy
				    * and (unless 0, or per_call) residual_tokens;
				    * any difference is ZC_EINVALID naming it */
	zc_views views;            /* ZC_VIEWS_FULL (default) or ZC_VIEWS_NONE:
				    * no fp16 is materialized, the session costs
				    * its compressed bytes and its residual */
	const char *model_id;      /* NULL or "": none; at most ZC_MODEL_ID_MAX bytes,
				    * kept with the session and part of its
				    * snapshots' fingerprint (not compared by attach) */
	/* Prefix reuse: the session starts with these chunks' blocks, shared
	 * (prefix_chunks keys of ZC_CHUNK_KEY_BYTES each, at most
	 * ZC_PREFIX_MAX_CHUNKS); every one must be held for the caller's uid
	 * and this model id, shape and codec (zc_client_lookup_prefix), else
	 * ZC_ENOTFOUND and nothing is made. 0: none. */
	const uint8_t *prefix;
	uint32_t prefix_chunks;
} zc_session_config;

/* A layer's fp16 K and V as the daemon holds them, read-only. Element
 * (b, h, t, d) of the keys is keys[b*key_strides.batch + h*key_strides.head
 * + t*key_strides.token + d]. */
typedef struct zc_view {
	const uint16_t *keys;
	const uint16_t *values;
	uint32_t tokens;
	uint32_t batch, kv_heads, head_dim_k, head_dim_v, max_tokens;
	zc_strides key_strides;
	zc_strides value_strides;
	uint64_t sequence;         /* the layer's update counter */
} zc_view;

/* The seed's byte accounting for one layer (or a total). */
typedef struct zc_layer_stats {
	uint32_t layer;
	uint32_t tokens;
	uint32_t residual_tokens;
	uint64_t blocks;
	uint64_t compressed_key_bytes;
	uint64_t compressed_value_bytes;
	uint64_t baseline_key_bytes;
	uint64_t baseline_value_bytes;
	uint64_t fp16_key_bytes;
	uint64_t fp16_value_bytes;
	double compression_ratio;  /* key side: fp16 / compressed */
	double effective_avg_bits; /* key side: 16 * compressed / fp16 */
} zc_layer_stats;

typedef struct zc_session_info {
	uint64_t id;
	char name[ZC_SESSION_NAME_MAX + 1];
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v;
	uint32_t max_tokens;
	zc_codec_config codec;
	zc_block_policy policy;
	uint32_t residual_tokens;
	uint32_t min_tokens;       /* shortest layer */
	uint32_t max_layer_tokens; /* longest layer */
	uint64_t idle_ms;
	zc_views views;
	uint64_t shared_bytes;     /* of its blocks, bytes another session refers to too */
	bool leased;               /* a client holds a lease on its views */
	char model_id[ZC_MODEL_ID_MAX + 1]; /* "" when none was given */
} zc_session_info;

typedef struct zc_server_info {
	uint32_t protocol_version;
	char server_version[33];
	uint64_t boot_epoch;
	uint32_t max_frame_bytes;
	uint32_t max_inline_bytes;
	uint32_t max_sessions;
	uint64_t max_tokens_per_session;
	uint64_t memory_budget_bytes;
	uint32_t lease_ms;         /* a view's lease without another call on its session */
	uint64_t max_ring_bytes;   /* the largest request ring it makes; 0: none */
} zc_server_info;

typedef struct zc_server_stats {
	uint32_t sessions;
	uint32_t connections;
	uint64_t memory_used_bytes;
	uint64_t memory_budget_bytes;
	uint64_t requests;         /* since the daemon started */
	uint64_t request_errors;
	uint64_t tokens_appended;
	uint64_t uptime_ms;
	uint64_t boot_epoch;
} zc_server_stats;

/*
 * The sessions' memory as their files hold it (the caller's sessions, or
 * all of them for root and the daemon's uid), by kind. A struct of its own
 * so that zc_server_stats keeps its size for programs built against it.
 */
typedef struct zc_memory_stats {
	uint64_t charged_bytes;    /* what the budget counts (memory_used_bytes) */
	uint64_t file_bytes;       /* what the files hold; the charge catches up
				    * with it (pages readers faulted in) within a second */
	uint64_t views_bytes;      /* file_bytes by kind: fp16 views, */
	uint64_t blocks_bytes;     /* compressed blocks, */
	uint64_t residual_bytes;   /* exact residual rows, */
	uint64_t index_bytes;      /* block index, */
	uint64_t headers_bytes;    /* headers and commit areas */
	uint32_t set_aside_files;  /* files not adopted (see zc_client_set_aside) */
	uint64_t retained_bytes;   /* file_bytes' last kind: pages of closed sessions kept for
				    * new ones (--retain-bytes), charged until reused or released */
} zc_memory_stats;

/* A session file in the daemon's directory that it did not adopt: corrupt
 * (renamed NAME.corrupt), or another uid's; see docs/DURABILITY.md. */
typedef struct zc_set_aside_file {
	char file[80];
	char reason[200];
} zc_set_aside_file;

/*
 * The default socket, one rule shared by zipcached, zipcachectl, this
 * library's users and the Python client (zipcache.default_socket_path):
 *
 *   zipcached without --socket listens at zc_daemon_socket_path():
 *     $RUNTIME_DIRECTORY/zipcached.sock when systemd gives it one (the
 *     first, if the unit names several), else the user's place:
 *     /run/zipcached.sock for root, else $XDG_RUNTIME_DIR/zipcached.sock,
 *     else /tmp/zipcached-UID.sock.
 *   A client without a path dials zc_default_socket_path():
 *     $ZIPCACHE_SOCKET when set, else the user's place as above (not
 *     $RUNTIME_DIRECTORY, which names the client's own unit's directory),
 *     and when no socket is there but the system service's is
 *     (ZC_SERVICE_SOCKET_PATH, deploy/zipcached.service), that one.
 *
 * So a daemon a user starts by hand is the one that user's tools find, and
 * so is the machine's service. Both write the path into buf (len bytes)
 * and return 0, or -ENAMETOOLONG when it does not fit (buf holds what
 * did). Neither checks that a daemon is there.
 */
#define ZC_SOCKET_NAME "zipcached.sock"
#define ZC_SERVICE_SOCKET_PATH "/run/zipcached/zipcached.sock"

int zc_default_socket_path(char *buf, size_t len);
int zc_daemon_socket_path(char *buf, size_t len);

/* What the calling uid holds of the daemon and its per-uid quotas (a
 * quota of 0: no per-uid limit, as for root and the daemon's own uid). */
typedef struct zc_uid_stats {
	uint32_t uid;
	/* Whether zc_server_stats' totals are the daemon's (true: the caller
	 * is root or the daemon's uid) or the caller's own (false). */
	bool daemon_wide;
	uint32_t sessions, max_sessions;
	uint32_t connections, max_connections;
	uint64_t memory_used_bytes, memory_budget_bytes;
	uint64_t staging_bytes, max_staging_bytes;
} zc_uid_stats;

/* Connects and says hello; timeout_ms bounds the connect and every reply
 * wait (0: wait forever). */
int zc_client_connect(const char *socket_path, int timeout_ms, zc_client **out);

/* Releases every session handle still open on this client, then closes. */
void zc_client_close(zc_client *client);

/* Dials the same socket again, dropping whatever the old connection still
 * held (a late reply, its descriptors, the staging buffer). 0 when the
 * same daemon answered, ZC_ERESTARTED when a restarted one did (reopen
 * sessions with attach); both leave the client usable. On failure the
 * client stays broken, and reconnecting again is the way on. */
int zc_client_reconnect(zc_client *client);

/* 0 while the connection is usable; after a failure that broke it (case 3
 * above), that failure's code (-ETIMEDOUT, ZC_EPROTOCOL, ...), which every
 * call answers with ZC_EBROKEN until zc_client_reconnect() succeeds. */
int zc_client_broken(const zc_client *client);

/* Changes the bound on every later wait (connect, reply, view): 0 waits
 * forever. -EINVAL for a negative timeout. */
int zc_client_set_timeout(zc_client *client, int timeout_ms);

/*
 * How long a wait for a reply polls the socket before it sleeps, in
 * microseconds (ZC_RECEIVE_SPIN_US by default; 0: sleep at once). A
 * decode step's reply comes within tens of microseconds, and a reader
 * asleep in the kernel must be woken for it (an interrupt and a context
 * switch on each side, and one more wake-up for nothing when the daemon
 * reads the request); polling keeps the caller's core, which waits
 * anyway, busy for at most this long per call. Set it to 0 where the
 * caller's core is better given to other threads. A staged prefill
 * layer's reply takes milliseconds, past the default: where idle cores
 * are slow to wake (virtual machines that halt them), a caller that waits
 * for layer after layer and has a core to spare can raise it to a few
 * milliseconds (4000 took 2-10 % off a two-CPU prefill on the device's
 * hosts, docs/BENCHMARKS.md). ZC_EINVALID above ZC_RECEIVE_SPIN_US_MAX.
 */
#define ZC_RECEIVE_SPIN_US 50u
#define ZC_RECEIVE_SPIN_US_MAX 100000u
int zc_client_set_receive_spin(zc_client *client, unsigned microseconds);

const zc_server_info *zc_client_server_info(const zc_client *client);

/* The daemon's message for the last failed call ("" if none). */
const char *zc_client_last_error(const zc_client *client);

void zc_session_config_default(zc_session_config *config);

int zc_session_open(zc_client *client, const zc_session_config *config, zc_session **out);

/* Closes the session on the daemon (its memory is freed) and the handle. */
int zc_session_close(zc_session *session);

/* Frees the handle and unmaps the views; the daemon keeps the session. */
void zc_session_release(zc_session *session);

const zc_session_info *zc_session_get_info(const zc_session *session);

/*
 * Fork: a new session (named `name`, or NULL for the daemon's choice)
 * whose first `tokens` tokens of every layer are the source's (fewer
 * where a layer is shorter): whole compressed blocks shared by reference,
 * the rest copied; both then go on independently. views: ZC_VIEWS_FULL,
 * ZC_VIEWS_NONE, or ZC_VIEWS_SOURCE for the source's. Uses: parallel
 * sampling and beam search from one prompt, branching a conversation.
 */
#define ZC_VIEWS_SOURCE (-1)
int zc_session_fork(zc_session *source, uint32_t tokens, const char *name, int views,
		    zc_session **out);

/*
 * Snapshots (docs/SNAPSHOT.md). zc_session_export writes a verified
 * snapshot of the session to fd, a regular file or a pipe the caller
 * opened for writing (the descriptor is passed to the daemon, which never
 * opens a path; it writes from the descriptor's current position). It is
 * a consistent cut: after every earlier call on the session. *bytes (may
 * be NULL) is what was written.
 *
 * zc_session_import makes a new session from the snapshot in fd, a
 * regular file open for reading (read from offset 0). The daemon verifies
 * everything before the session exists (it commits only a snapshot that
 * passed every check, and throws away what it built from one that did
 * not): a damaged snapshot is ZC_ECORRUPT,
 * one of another model than options->model_id (or fingerprint) asks is
 * ZC_EPRECONDITION, each with zc_client_last_error() naming what is
 * wrong; nothing is made then. options may be NULL.
 */
typedef struct zc_import_options {
	const char *name;          /* NULL or "": session-ID */
	const char *model_id;      /* NULL: any; else the snapshot must be of this model */
	bool check_fingerprint;
	uint64_t fingerprint;      /* with check_fingerprint: the snapshot must have it */
	int views;                 /* ZC_VIEWS_FULL, ZC_VIEWS_NONE or ZC_VIEWS_SOURCE (the exported session's) */
} zc_import_options;

void zc_import_options_default(zc_import_options *options);
int zc_session_export(zc_session *session, int fd, uint64_t *bytes);
/* The same by id, without a handle (zipcachectl export). */
int zc_client_export(zc_client *client, uint64_t session_id, int fd, uint64_t *bytes);
int zc_session_import(zc_client *client, int fd, const zc_import_options *options,
		      zc_session **out);

/*
 * Leases. A view returned by zc_update_and_fetch, zc_session_view or an
 * open stays valid (memory relief does not drop it) until this client's
 * lease on the session ends: --lease-seconds (zc_server_info.lease_ms)
 * after its last call on the session, or at zc_session_release_views, or
 * when the connection closes. Each call on the session renews it.
 * zc_session_lease_check says 0 while the lease runs, ZC_ESTALE after:
 * data read from a view after its lease may be zeros (the views were
 * dropped) and must be fetched again (zc_session_view rebuilds them).
 */
int zc_session_lease_check(const zc_session *session);
int zc_session_release_views(zc_session *session);

/* The session map as this client maps it (read-only; layout in
 * zipcache/map.h), and the uid's block pool. */
const zc_map_header *zc_session_map(const zc_session *session);
const uint8_t *zc_session_pool(const zc_session *session, size_t *bytes);

/* Appends a [batch, kv_heads, tokens, head_dim] block of fp16 keys and
 * values (C order) to one layer and fills `view` with the whole layer.
 * Blocks larger than the daemon's inline limit go through the staging
 * buffer automatically. stats may be NULL. After a refusal nothing was
 * stored; after a failure that broke the connection the block is there
 * wholly or not at all (see Failures at the top). */
int zc_update_and_fetch(zc_session *session, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values, zc_view *view,
			zc_layer_stats *stats);

/*
 * Saliency by attention (a session opened with codec.saliency =
 * ZC_SALIENCY_ATTENTION; docs/ATTEND.md): the attention masses the next
 * update of `layer` carries, whichever call sends it (zc_update_and_fetch,
 * _staged, zc_update_async, zc_update_many; not a chunk-keyed one), and
 * only that one: mass is float32 [batch][kv_heads][n] (count = batch *
 * kv_heads * n floats), the masses of the layer's tokens first_token ..
 * first_token + n - 1 as a client measured them, e.g. zc_attend's
 * zc_attend_mass or a running sum of them (the daemon keeps the last it
 * was sent per token, and ranks the residual's next flush by them). Copied;
 * a later call replaces them, count 0 clears them. Returns 0, or
 * ZC_EPRECONDITION (a key_norm session), ZC_EINVALID (layer out of range,
 * mass NULL, count not a whole number of [batch][kv_heads] rows, more rows
 * than the residual holds, tokens past max_tokens), ZC_ENONFINITE (a NaN,
 * infinite or negative mass); nothing is kept then.
 */
int zc_session_set_attention_mass(zc_session *session, uint32_t layer, uint32_t first_token,
				  const float *mass, size_t count);

/* The chain key of a chunk: prev is the previous chunk's key, NULL for
 * the first; n token ids (n > 0). See ZC_PREFIX_CHUNK_TOKENS above. */
int zc_chunk_chain(const uint8_t *prev, const uint32_t *token_ids, size_t n,
		   uint8_t out[ZC_CHUNK_KEY_BYTES]);

/* zc_update_and_fetch of one prefix chunk with its chain key: tokens must
 * be ZC_PREFIX_CHUNK_TOKENS and the layer must hold whole chunks only (no
 * residual rows: ZC_EPRECONDITION); the block is compressed as one block
 * whatever the policy and recorded in the daemon's chunk index. */
int zc_update_and_fetch_chunk(zc_session *session, uint32_t layer, uint32_t tokens,
			      const uint16_t *keys, const uint16_t *values,
			      const uint8_t chunk_key[ZC_CHUNK_KEY_BYTES], zc_view *view,
			      zc_layer_stats *stats);

/* How much of a chain is held for the caller's uid and the model id,
 * shape and codec of config (its name, max_tokens, views and prefix are
 * not used): the leading chunks held in every layer, in this daemon or
 * (with --remote) in the shared tier. */
typedef struct zc_prefix_held {
	uint32_t chunks;        /* leading chunks of the chain held */
	uint32_t tokens;        /* chunks x ZC_PREFIX_CHUNK_TOKENS */
	uint32_t local_chunks;  /* of them, in this daemon */
} zc_prefix_held;

int zc_client_lookup_prefix(zc_client *client, const zc_session_config *config,
			    const uint8_t *keys, size_t n_keys, zc_prefix_held *out);

/*
 * Stats, when asked for (stats not NULL), describe the layer after this
 * update and after any residual flush it causes. A caller that passes
 * NULL does not wait for that flush: the daemon compresses a residual the
 * update filled after replying, on its thread pool, and until it
 * publishes the reconstruction (inside the layer's seqlock, `sequence`
 * moving again) the view keeps those tokens' exact rows.
 */

/*
 * Zero-round-trip decode. zc_update_async sends the update and returns:
 * the caller already holds the tokens it appends (under the streaming
 * policy they come back exact), so it need not wait for the daemon.
 * The ticket names the request; zc_wait blocks until its reply came,
 * zc_poll looks without blocking (1 done, 0 not yet). Updates of a
 * (session, layer) are applied in the order sent; many layers and
 * sessions of the client may be in flight together, up to its window
 * (ZC_ASYNC_WINDOW, zc_client_set_async_window): an update past it first
 * waits for the oldest reply (back-pressure). Blocks above the inline
 * limit are refused (ZC_EINVALID): prefill through zc_update_many or the
 * staging buffer.
 *
 * Errors: the daemon's refusal of an asynchronous update is returned by
 * the zc_wait or zc_poll of its ticket, and is also announced once by the
 * next zc_update_async or zc_wait_all of the client, which then sends
 * nothing; zc_client_last_error names the request (session, layer,
 * ticket) and gives the daemon's sentence. A broken connection fails
 * every ticket in flight (see Failures at the top: each update is there
 * wholly or not at all). Every synchronous call first waits for the
 * replies in flight (keeping their errors for zc_wait).
 */
#define ZC_ASYNC_WINDOW 64u
typedef uint64_t zc_ticket;

int zc_update_async(zc_session *session, uint32_t layer, uint32_t tokens,
		    const uint16_t *keys, const uint16_t *values, zc_ticket *ticket);
int zc_wait(zc_session *session, uint32_t layer, zc_ticket ticket);
int zc_poll(zc_session *session, uint32_t layer, zc_ticket ticket);
/* Waits for every update in flight; the first error not yet announced. */
int zc_wait_all(zc_client *client);
/* Updates in flight at most (1 .. ZC_ASYNC_WINDOW). */
int zc_client_set_async_window(zc_client *client, unsigned window);
/*
 * How many asynchronous updates go out in one write (1, the default:
 * each is written when zc_update_async is called). A larger batch keeps
 * up to that many encoded in the client and writes them together, which
 * costs the daemon one wake-up instead of one per update; they are also
 * written before anything waits for a reply (zc_wait, zc_poll,
 * zc_wait_all, any synchronous call, the window's back-pressure). A
 * 32-layer model may batch its layers: the daemon needs a layer's update
 * only before the next token's read of it.
 */
int zc_client_set_async_batch(zc_client *client, unsigned frames);

/*
 * The request ring (docs/RING.md). With a batch of 1, asynchronous updates
 * are appended to memory shared with the daemon instead of written to the
 * socket: no system call while the daemon's loop is awake (busy polling,
 * or still at earlier work), one eventfd write to wake it when it sleeps.
 * Once a connection has one, synchronous updates go through it too, and
 * replies without descriptors come back through its reply area. The
 * daemon makes it at the first zc_update_async, or at once when this is
 * called with a size (ZC_ASYNC_RING_BYTES unless set), charged to the
 * uid's memory and staging quotas; a daemon that cannot make one (its
 * quota, its memory, a size past its max_ring_bytes in zc_server_info,
 * 0 from a daemon that makes none) leaves the connection on the socket
 * (no error). 0 turns it off: every update is a write. Updates
 * keep their order either way. Returns 0, or ZC_EINVALID for a size out of
 * range or another size once a ring exists (it takes a
 * zc_client_reconnect), or a broken connection's code.
 */
#define ZC_ASYNC_RING_BYTES (256u << 10)
#define ZC_ASYNC_RING_MIN_BYTES (64u << 10)
#define ZC_ASYNC_RING_MAX_BYTES (16u << 20)
int zc_client_set_async_ring(zc_client *client, size_t bytes);
/* The ring's data bytes (0: none on this connection) and how many times
 * the client rang its doorbell. */
int zc_client_async_ring(const zc_client *client, size_t *bytes, uint64_t *doorbells);

/*
 * Many blocks at once (a prefill of every layer), without a round trip
 * per block; the daemon applies them in its session's order. Inline
 * blocks are sent in one write (up to the window's worth) and their
 * replies read together. Blocks over the inline limit go through two
 * slots of the staging buffer, each the size of the largest of them, in
 * turn: each is sent as soon as it is copied into its slot, once the
 * block before it there is answered, so the daemon compresses one while
 * the next is copied and reads it while it is still in cache, and the
 * buffer stays two blocks large however many there are (one slot, one
 * block at a time, where the daemon makes no buffer of two: its
 * --max-staging-bytes, the uid's staging quota or its memory; or where
 * the client's async window is 1). Each
 * block is applied or refused on its own, as if sent alone: a refused
 * one does not hold back those after it (blocks for which no staging
 * buffer could be had are refused with the daemon's reason). *done: how
 * many were applied; returns the first refusal's code
 * (zc_client_last_error: its sentence), or 0. A broken connection stops
 * it (see Failures at the top).
 */
typedef struct zc_update {
	uint32_t layer;
	uint32_t tokens;
	const uint16_t *keys;
	const uint16_t *values;
} zc_update;

int zc_update_many(zc_session *session, const zc_update *updates, size_t n, size_t *done);

/*
 * The zero-copy way in for large blocks: a buffer shared with the daemon,
 * at least `bytes` long, that the caller fills and then names by offset
 * in zc_update_and_fetch_staged(). The pointer is valid until the next
 * zc_client_staging() that needs a larger buffer, a zc_update_many() of
 * blocks over the inline limit (which uses this buffer, made larger where
 * two of its blocks do not fit, and leaves its bytes undefined), or
 * zc_client_close().
 */
int zc_client_staging(zc_client *client, size_t bytes, void **buffer);

int zc_update_and_fetch_staged(zc_session *session, uint32_t layer, uint32_t tokens,
			       size_t keys_offset, size_t values_offset, zc_view *view,
			       zc_layer_stats *stats);

/* The layer as it is now, without an update: no round trip unless the
 * daemon dropped the views (then one stats request rebuilds them). While
 * the daemon writes the layer this waits, at most the client's timeout:
 * -ETIMEDOUT if the write is still going on then (a stopped daemon; the
 * connection stays usable), -ECONNRESET at once if the daemon is gone and
 * left the write unfinished (this breaks the connection: reconnect, and a
 * restarted daemon repairs the layer). */
int zc_session_view(zc_session *session, uint32_t layer, zc_view *view);

/* Drops the last `tokens` tokens of every layer (speculative decoding). */
int zc_session_trim(zc_session *session, uint32_t tokens, uint32_t *trimmed);

/* The same for one layer, as mlx_lm's per-layer cache.trim(n). */
int zc_session_trim_layer(zc_session *session, uint32_t layer, uint32_t tokens,
			  uint32_t *trimmed);

/* Per-layer accounting into layers[0..capacity) (may be NULL with 0) and
 * the session total. */
int zc_session_stats(zc_session *session, zc_layer_stats *layers, size_t capacity,
		     zc_layer_stats *total);

/* A session's accounting by id, without a handle and without counting as
 * a use of it (monitoring: idle expiry and memory relief go on). info may
 * be NULL. */
int zc_client_session_stats(zc_client *client, uint64_t session_id, zc_layer_stats *layers,
			    size_t capacity, zc_layer_stats *total, zc_session_info *info);

/* Closes a session by id (no handle needed). */
int zc_client_close_session(zc_client *client, uint64_t session_id);

/* The caller's sessions: up to capacity into sessions, *count = how many exist. */
int zc_client_list_sessions(zc_client *client, zc_session_info *sessions, size_t capacity,
			    size_t *count);

int zc_client_stats(zc_client *client, zc_server_stats *stats);

/* The caller's own usage and quotas; stats and memory (either may be
 * NULL) get what zc_client_stats() and zc_client_memory_stats() would,
 * from the same reply. */
int zc_client_uid_stats(zc_client *client, zc_uid_stats *uid, zc_server_stats *stats,
			zc_memory_stats *memory);

int zc_client_memory_stats(zc_client *client, zc_memory_stats *out);

/* The session files the daemon set aside, into files[0..capacity) (the
 * first 16 at most); *count is how many there are in all. Only root and
 * the daemon's uid see them (others get a count of 0). */
int zc_client_set_aside(zc_client *client, zc_set_aside_file *files, size_t capacity,
			size_t *count);

#endif
