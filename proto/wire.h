/*
 * Wire messages in plain C: what the daemon and the client say to each
 * other, with no protobuf type in sight. wire.c is the one room that calls
 * nanopb; it converts these structs to and from the generated ones
 * (wire_pb.h), so a nanopb upgrade, or a change of protobuf library,
 * touches proto/wire.* only. The bytes on the wire are those of
 * proto/zipcache.proto, unchanged.
 *
 * A request or response names its op in `op` and fills the member of the
 * union that goes with it; the others are not read. Where the protocol
 * tells a field that is present from one that is absent, a `has_` flag
 * says which (see zipcache.proto).
 *
 * Encoding writes a whole frame: 4-byte little-endian length header, then
 * the message, into a caller buffer. Size it with wire_*_frame_size(), or
 * try a buffer you expect to be big enough and size only on ZC_EBUFFER.
 */
#ifndef ZIPCACHE_WIRE_H
#define ZIPCACHE_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/client.h"
#include "zipcache/codec.h"

/*
 * Upper bound on the entries of one repeated list a decoder accepts. Each
 * entry costs 2 bytes on the wire but ~200 in memory, so without a cap a
 * frame of empty entries would make the decoder allocate 100x the frame.
 * 65536 is far beyond any layer count or session table.
 */
#define WIRE_MAX_LIST_ITEMS 65536

/* The sizes zipcache.options gives the bounded fields (wire.c checks
 * them against the generated structs). */
#define WIRE_CLIENT_NAME_BYTES 65
#define WIRE_MESSAGE_BYTES 257
#define WIRE_MAX_SET_ASIDE 16

/* Bytes that are not owned: a pointer and a length. */
typedef struct wire_span {
	const uint8_t *data;
	size_t len;
} wire_span;

enum wire_op {
	WIRE_OP_NONE = 0,        /* no op the decoder knows */
	WIRE_OP_HELLO,
	WIRE_OP_OPEN_SESSION,
	WIRE_OP_UPDATE_AND_FETCH,
	WIRE_OP_TRIM,
	WIRE_OP_CLOSE_SESSION,
	WIRE_OP_STATS,
	WIRE_OP_LIST_SESSIONS,
	WIRE_OP_STAGING,
	WIRE_OP_FORK_SESSION,
	WIRE_OP_RELEASE,
	WIRE_OP_EXPORT_SESSION,
	WIRE_OP_IMPORT_SESSION,
	WIRE_OP_LOOKUP_PREFIX    /* request: open_session's fields; reply: lookup_prefix */
};

/* zipcache.v1.Status, value for value. */
enum wire_status {
	WIRE_STATUS_OK = 0,
	WIRE_STATUS_INVALID_ARGUMENT = 1,
	WIRE_STATUS_NOT_FOUND = 2,
	WIRE_STATUS_ALREADY_EXISTS = 3,
	WIRE_STATUS_RESOURCE_EXHAUSTED = 4,
	WIRE_STATUS_PERMISSION_DENIED = 5,
	WIRE_STATUS_FAILED_PRECONDITION = 6,
	WIRE_STATUS_INTERNAL = 7,
	WIRE_STATUS_DATA_LOSS = 8,
	WIRE_STATUS_UNAVAILABLE = 9,
	WIRE_STATUS_COUNT
};

struct wire_shape {
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v;
};

/* A codec config as a request gives it: each field may be left out. */
struct wire_codec {
	bool has_hi_bits;
	uint32_t hi_bits;
	bool has_lo_bits;
	uint32_t lo_bits;
	bool has_hi_fraction;
	double hi_fraction;
	bool has_group_size;
	uint32_t group_size;
	bool has_quantize_values;
	bool quantize_values;
	bool has_saliency;
	uint32_t saliency;            /* a zc_saliency (the decoder refuses others in requests) */
};

/* ---- requests ---- */

struct wire_hello_request {
	uint32_t protocol_version;
	char client_name[WIRE_CLIENT_NAME_BYTES];
};

struct wire_open_request {
	char name[ZC_SESSION_NAME_MAX + 1];
	bool has_shape;
	struct wire_shape shape;
	uint32_t max_tokens;
	bool has_codec;
	struct wire_codec codec;
	int policy;                   /* a zc_block_policy (the decoder refuses others) */
	bool has_residual_tokens;
	uint32_t residual_tokens;
	bool attach;
	int views;                    /* a zc_views */
	char model_id[ZC_MODEL_ID_MAX + 1];
	/* Prefix reuse: chain keys, ZC_CHUNK_KEY_BYTES each (docs/PREFIX.md). */
	uint32_t prefix_len;          /* bytes */
	uint8_t prefix[ZC_PREFIX_MAX_CHUNKS * ZC_CHUNK_KEY_BYTES];
};

struct wire_fork_request {
	uint64_t source_id;
	uint32_t tokens;
	char name[ZC_SESSION_NAME_MAX + 1];
	bool has_views;
	int views;                    /* a zc_views */
};

/* export_session and import_session: each comes with one descriptor. */
struct wire_export_request {
	uint64_t session_id;
};

struct wire_import_request {
	char name[ZC_SESSION_NAME_MAX + 1];
	bool has_model_id;
	char model_id[ZC_MODEL_ID_MAX + 1];
	bool has_fingerprint;
	uint64_t fingerprint;
	bool has_views;
	int views;                    /* a zc_views */
};

struct wire_update_request {
	uint64_t session_id;
	uint32_t layer;
	uint32_t tokens;
	/*
	 * Inline fp16 bytes. Encode: read from here (len 0: not sent).
	 * Decode: point into the frame that was decoded, no copy, valid as
	 * long as that frame is (see frame.h); {NULL, 0} when absent.
	 */
	wire_span keys;
	wire_span values;
	bool staged;
	uint64_t keys_offset;
	uint64_t values_offset;
	bool omit_stats;            /* the reply leaves the layer's stats out */
	uint32_t chunk_key_len;       /* 0: none; the daemon wants ZC_CHUNK_KEY_BYTES */
	uint8_t chunk_key[ZC_CHUNK_KEY_BYTES];
	/* Saliency by attention: float32 masses [batch][kv_heads][n] of the
	 * residual tokens from mass_first_token on (len 0: none); a span as
	 * keys and values are. */
	wire_span attention_mass;
	uint32_t mass_first_token;
};

struct wire_trim_request {
	uint64_t session_id;
	uint32_t tokens;
	bool has_layer;
	uint32_t layer;
};

struct wire_session_request {
	uint64_t session_id;          /* close_session */
};

struct wire_stats_request {
	uint64_t session_id;          /* 0: the daemon's figures only */
	bool use;
};

struct wire_staging {
	uint64_t bytes;               /* asked for (request), granted (reply) */
	bool ring;                    /* a request ring, not a staging buffer */
};

typedef struct wire_request {
	uint64_t request_id;
	enum wire_op op;
	union {
		struct wire_hello_request hello;
		struct wire_open_request open_session;
		struct wire_update_request update_and_fetch;
		struct wire_trim_request trim;
		struct wire_session_request close_session;
		struct wire_stats_request stats;
		struct wire_staging staging;
		struct wire_fork_request fork_session;
		struct wire_session_request release;
		struct wire_export_request export_session;
		struct wire_import_request import_session;
		struct wire_open_request lookup_prefix;
	};
	/* After a failed decode: why, a static string or `reason` below (so
	 * valid as long as this struct). NULL otherwise. */
	const char *error;
	char reason[160];
} wire_request;

/* ---- responses ---- */

struct wire_view_layout {
	uint64_t mapping_bytes;
	uint64_t header_bytes;
	uint32_t key_offsets_count;
	uint64_t key_offsets[ZC_MAX_LAYERS];
	uint32_t value_offsets_count;
	uint64_t value_offsets[ZC_MAX_LAYERS];
};

struct wire_open_response {
	bool has_session;
	zc_session_info session;
	bool has_view;
	struct wire_view_layout view;
	bool attached;
};

struct wire_update_response {
	uint32_t tokens;
	bool has_stats;
	zc_layer_stats stats;
	uint64_t sequence;
};

struct wire_export_response {
	uint64_t bytes;
	uint64_t fingerprint;
	uint64_t tokens;
};

struct wire_lookup_response {
	uint32_t chunks, tokens, local_chunks;
};

struct wire_trim_response {
	uint32_t trimmed;
	uint32_t tokens;
};

struct wire_uid_usage {
	uint32_t uid;
	uint32_t sessions, max_sessions;
	uint32_t connections, max_connections;
	uint64_t memory_used_bytes, memory_budget_bytes;
	uint64_t staging_bytes, max_staging_bytes;
};

struct wire_memory_by_kind {
	uint64_t views, blocks, residual, index, headers;
	uint64_t retained;   /* kept pages of closed sessions (server/retain.h) */
};

struct wire_stats_response {
	bool has_session;
	zc_session_info session;
	bool has_total;
	zc_layer_stats total;
	uint32_t sessions;
	uint32_t connections;
	uint64_t memory_used_bytes;
	uint64_t memory_budget_bytes;
	uint64_t requests;
	uint64_t request_errors;
	uint64_t tokens_appended;
	uint64_t uptime_ms;
	uint64_t boot_epoch;
	bool has_caller;
	struct wire_uid_usage caller;
	bool daemon_wide;
	uint64_t staging_bytes;
	uint64_t reply_queue_bytes;
	uint64_t memory_file_bytes;
	uint32_t set_aside_count;
	zc_set_aside_file set_aside[WIRE_MAX_SET_ASIDE];
	uint32_t set_aside_total;
	bool has_memory;
	struct wire_memory_by_kind memory;
};

typedef struct wire_response {
	uint64_t request_id;
	int status;                   /* an enum wire_status; a newer daemon may send others */
	char message[WIRE_MESSAGE_BYTES];
	uint32_t fds;                 /* descriptors that come with the frame */
	enum wire_op op;
	union {
		zc_server_info hello;
		struct wire_open_response open_session;   /* also fork_session's and import_session's */
		struct wire_export_response export_session;
		struct wire_update_response update_and_fetch;
		struct wire_trim_response trim;
		struct wire_stats_response stats;
		struct wire_staging staging;
		struct wire_lookup_response lookup_prefix;
	};
	/*
	 * stats' per-layer list and list_sessions' sessions. Encode: the
	 * caller's arrays, only read. Decode: arrays allocated by
	 * wire_response_decode() and owned by this struct until
	 * wire_response_free(); NULL with count 0 when the list is empty or
	 * the op is another one.
	 */
	zc_layer_stats *layers;
	size_t n_layers;
	zc_session_info *sessions;
	size_t n_sessions;
	/* After a failed decode: why, a static string. NULL otherwise. */
	const char *error;
	/* Private: set by decode so wire_response_free() never frees caller arrays. */
	int lists_owned;
} wire_response;

/*
 * Decodes one request frame body (no header) into *out, which need not be
 * initialised; allocates nothing. Returns 0, or ZC_EPROTOCOL with
 * out->error set for bytes that are not a valid Request, including inline
 * keys/values that are not length-delimited, a message in which another
 * op precedes its final update_and_fetch (legal protobuf that no encoder
 * produces and that the zero-copy capture cannot follow), and a value its
 * field cannot hold: a string longer than its limit or with a NUL byte in
 * it (C would silently cut it there), an integer wider than its field, an
 * enum value the enum does not define. Then out->error names the field
 * and the limit ("open_session.name is 80 bytes; the limit is 64").
 *
 * On failure out->op is WIRE_OP_NONE and out->request_id holds the
 * request's id whenever it could be read (a well-formed field 1 before
 * any break in the message's structure), else 0, so a refusal can echo it.
 */
int wire_request_decode(const uint8_t *frame, size_t len, wire_request *out);

/*
 * Decodes one response frame body into *out, which need not be
 * initialised. Returns 0, ZC_EPROTOCOL with out->error set, or -ENOMEM.
 * On success call wire_response_free() when done with the lists; on
 * failure nothing is left to free (calling it is harmless).
 */
int wire_response_decode(const uint8_t *frame, size_t len, wire_response *out);

/* Frees the lists a decode allocated and clears them; safe to repeat. */
void wire_response_free(wire_response *resp);

/* *size = bytes of the whole frame (header + message) for req / resp. */
int wire_request_frame_size(const wire_request *req, size_t *size);
int wire_response_frame_size(const wire_response *resp, size_t *size);

/*
 * Encodes a whole frame, header included, at buf[0..cap). Returns 0 with
 * *frame_len set, ZC_EBUFFER when cap is too small (nothing useful in buf),
 * or ZC_EINVALID when the struct cannot be encoded (a string member not
 * NUL-terminated within its array, more than WIRE_MAX_LIST_ITEMS entries).
 * The input is not modified.
 */
int wire_request_encode(const wire_request *req, uint8_t *buf, size_t cap,
			size_t *frame_len);
int wire_response_encode(const wire_response *resp, uint8_t *buf, size_t cap,
			 size_t *frame_len);

/* Clears *resp and names its request and op: the start of every reply. */
void wire_response_init(wire_response *resp, uint64_t request_id, enum wire_op op);

/*
 * Sets resp->status from a zipcache error code and copies message (may be
 * NULL) into resp->message, cut to fit on a UTF-8 character boundary so
 * other protobuf decoders accept it.
 */
void wire_response_set_status(wire_response *resp, int zc_error, const char *message);

/*
 * Status <-> error code. 0 (and any non-negative count) is OK. Codec
 * validation errors (ZC_EBITS, ZC_EFRACTION, ZC_EGROUPSIZE, ZC_ESHAPE,
 * ZC_ENONFINITE, ZC_ETENSOR), ZC_EINVALID and ZC_EPROTOCOL (a malformed
 * request) are INVALID_ARGUMENT; ZC_EEXHAUSTED, ZC_EFRAMESIZE and the
 * errnos of a resource running out (-ENOMEM, -ENOSPC, -EMFILE, -ENFILE,
 * -EAGAIN, -ENOBUFS) are RESOURCE_EXHAUSTED; ZC_ECORRUPT (damaged data a
 * client handed over) is DATA_LOSS; ZC_EREMOTE (the remote tier failed:
 * the daemon gives its timeouts this code) is UNAVAILABLE; everything
 * unlisted is INTERNAL. Back
 * from a status each maps to its one ZC_E* code; an unknown status value
 * (a newer daemon) is ZC_EINTERNAL.
 */
enum wire_status wire_status_from_error(int zc_error);
int wire_error_from_status(int status);

/*
 * The codec config, the one conversion each way. To the wire: every field
 * present; a negative width goes as 0, so that it fails validation on the
 * other side instead of wrapping into range. From the wire: the fields
 * given replace those of *config (defaults, or a session's config); an
 * out-of-range width stays out of range (bits past 64 become 64, a group
 * past ZC_MAX_BLOCK_TOKENS becomes 0), never wrapping into a valid one.
 */
void wire_codec_from_config(const zc_codec_config *config, struct wire_codec *out);
void wire_codec_to_config(const struct wire_codec *codec, zc_codec_config *config);

#endif
