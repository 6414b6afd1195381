/*
 * libzipcache: the blocking C client of zipcached.
 *
 *	zc_client *client;
 *	zc_session *session;
 *	zc_session_config config;
 *	zc_view view;
 *
 *	zc_client_connect("/run/zipcached.sock", 1000, &client);
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
 * Threads: a zc_client and its sessions belong to one thread at a time
 * (no internal locking). Use one client per thread; many clients may use
 * the same daemon session at once, and the daemon orders their updates.
 *
 * Daemon restarts: a call on a connection the daemon dropped fails with
 * -EPIPE, -ECONNRESET or ZC_EPROTOCOL. zc_client_reconnect() dials again
 * and returns ZC_ERESTARTED when a new daemon answered; the sessions it
 * adopted keep their acknowledged tokens, and zc_session_open() with
 * attach = true maps each one again. Old zc_session handles must be
 * released.
 */
#ifndef ZIPCACHE_CLIENT_H
#define ZIPCACHE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/error.h"

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
	bool attach;               /* reuse the session of this name if it exists */
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
	char name[65];
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v;
	uint32_t max_tokens;
	zc_codec_config codec;
	zc_block_policy policy;
	uint32_t residual_tokens;
	uint32_t min_tokens;       /* shortest layer */
	uint32_t max_layer_tokens; /* longest layer */
	uint64_t idle_ms;
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

/* Dials the same socket again. 0 when the same daemon answered,
 * ZC_ERESTARTED when a restarted one did (reopen sessions with attach). */
int zc_client_reconnect(zc_client *client);

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

/* Appends a [batch, kv_heads, tokens, head_dim] block of fp16 keys and
 * values (C order) to one layer and fills `view` with the whole layer.
 * Blocks larger than the daemon's inline limit go through the staging
 * buffer automatically. stats may be NULL. On error nothing was stored. */
int zc_update_and_fetch(zc_session *session, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values, zc_view *view,
			zc_layer_stats *stats);

/*
 * The zero-copy way in for large blocks: a buffer shared with the daemon,
 * at least `bytes` long, that the caller fills and then names by offset
 * in zc_update_and_fetch_staged(). The pointer is valid until the next
 * zc_client_staging() that needs a larger buffer, or zc_client_close().
 */
int zc_client_staging(zc_client *client, size_t bytes, void **buffer);

int zc_update_and_fetch_staged(zc_session *session, uint32_t layer, uint32_t tokens,
			       size_t keys_offset, size_t values_offset, zc_view *view,
			       zc_layer_stats *stats);

/* The layer as it is now, without an update. */
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

/* The caller's own usage and quotas; stats (may be NULL) gets what
 * zc_client_stats() would, from the same reply. */
int zc_client_uid_stats(zc_client *client, zc_uid_stats *uid, zc_server_stats *stats);

#endif
