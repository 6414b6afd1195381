/*
 * Reading a session's compressed form in the client's own process: the
 * reader protocol over the session map and the pool (zipcache/map.h,
 * docs/MAP.md), and reconstruction with the codec. Nothing here talks to
 * the daemon; every call reads the two read-only mappings a session handle
 * holds (zc_session_map, zc_session_pool).
 *
 * The reader protocol (the Linux seqlock's read side, per layer):
 *
 *	zc_read read;
 *	zc_layer_contents layout;
 *	zc_block block;
 *	for (;;) {
 *		rc = zc_read_begin(session, layer, 0, &read);   waits for an even sequence
 *		if (rc < 0) break;                              -ETIMEDOUT: a write never ended
 *		rc = zc_layer_layout(session, &read, &layout);
 *		for (i = 0; rc == 0 && i < layout.blocks; i++) {
 *			rc = zc_layer_block(session, &read, i, &block);
 *			if (rc == 0) rc = zc_block_reconstruct_rows(session, &block, ...);
 *		}
 *		... copy layout.residual_tokens rows from layout.residual_keys/values ...
 *		end = zc_read_end(session, &read);
 *		if (end == 0) break;                            consistent: rc stands
 *		if (end == ZC_ESTALE) ... the view was dropped or rebuilt under the read;
 *		                      reading again is right (a dropped view shows as
 *		                      ZC_ESTALE from zc_layer_layout until a request,
 *		                      e.g. zc_session_view, brings it back)
 *		ZC_EAGAIN: the layer changed under the read: read again
 *	}
 *
 * The rules, and why each one is there:
 *
 *  1. Begin: the layer's `sequence` is odd while the daemon writes the
 *     layer. zc_read_begin spins briefly, then polls every millisecond,
 *     until it reads an even value (acquire), or fails with -ETIMEDOUT
 *     after timeout_ms (0: ZC_READ_TIMEOUT_MS). Every wait is bounded: a
 *     daemon killed in the middle of a write leaves the sequence odd for
 *     good. It then takes the layer's counts, generation and view_valid,
 *     all after the sequence, into the zc_read.
 *  2. Everything read between begin and end counts only if zc_read_end
 *     then returns 0: the counts, the block table, the residual or view
 *     rows, and the pool bytes the blocks name (a block's extent is freed
 *     and may be reused after a trim drops it; the sequence moves first).
 *     zc_read_end issues an acquire fence, then reads the sequence again:
 *     unchanged is 0; moved is ZC_EAGAIN, or ZC_ESTALE for a read that
 *     could see the view (views = full and valid at begin) when the
 *     layer's generation moved or the view is no longer valid. The check
 *     covers the data, not only the token count, so a reader can never
 *     accept rows of two different states.
 *  3. A failure between begin and end (ZC_EPROTOCOL, ZC_ECORRUPT from a
 *     block whose bytes changed under the codec) means something only when
 *     zc_read_end returns 0; otherwise it was a torn read: read again.
 *     Nothing a torn read sees can make these calls read or write out of
 *     bounds: every offset is checked against the mappings' sizes and the
 *     codec's payload size for the block's shape, on the reader's own copy
 *     of each entry.
 *  4. Pointers stay valid (mapped, read-only) until the session handle is
 *     released; their contents are those of the read only until it ends.
 *
 * Residual rows. The newest residual_tokens tokens of a layer are exact
 * fp16. With views = none they sit in the map's readers' residual, row 0
 * first; with views = full they are the view's last residual_tokens rows,
 * which exist only while the view is valid: zc_layer_layout then answers
 * ZC_ESTALE for a dropped view with residual rows (blocks stay readable
 * from the pool either way, so a layer without residual rows reconstructs
 * even while its view is dropped).
 *
 * Threads: these calls only read; many threads may read one session at
 * once, as long as none releases the handle meanwhile.
 */
#ifndef ZIPCACHE_READER_H
#define ZIPCACHE_READER_H

#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "zipcache/map.h"

typedef struct zc_session zc_session;

/* How long zc_read_begin waits for a write to end when given 0, and how
 * long zc_layer_reconstruct keeps retrying. */
#define ZC_READ_TIMEOUT_MS 10000

/* One read of one layer, from zc_read_begin to zc_read_end. */
typedef struct zc_read {
	uint32_t layer;
	uint32_t view;            /* 1: views = full and the view was valid at begin */
	uint64_t sequence;        /* even */
	uint64_t generation;
	uint32_t tokens;          /* the layer's counts, taken inside the read */
	uint32_t residual_tokens;
	uint32_t blocks;
	uint32_t view_valid;
} zc_read;

/* A layer as one read sees it. The exact residual rows: token
 * tokens - residual_tokens + r of head (b, h) is at residual_keys[b *
 * key_strides.batch + h * key_strides.head + r * key_strides.token]. */
typedef struct zc_layer_contents {
	uint32_t layer;
	uint32_t tokens;
	uint32_t residual_tokens;
	uint32_t blocks;
	uint32_t views;           /* enum zc_views */
	uint32_t view_valid;
	const uint16_t *residual_keys;   /* never NULL; not to be read past residual_tokens rows */
	const uint16_t *residual_values;
	zc_strides key_strides;
	zc_strides value_strides;
} zc_layer_contents;

/* One block of a layer as one read sees it, checked. */
typedef struct zc_block {
	uint32_t layer;
	uint32_t index;
	uint32_t first_token;
	uint32_t tokens;          /* rows the payloads were compressed with */
	uint32_t valid_tokens;    /* rows [first_token, first_token + valid_tokens) of the layer */
	zc_block_shape key_shape; /* [batch, kv_heads, tokens, head_dim_k] */
	zc_block_shape value_shape;
	const uint8_t *key_payload;      /* in the pool mapping, docs/CODEC.md's layout */
	const uint8_t *value_payload;
	uint64_t key_bytes;
	uint64_t value_bytes;
	uint64_t key_offset;      /* in the pool map */
	uint64_t value_offset;
} zc_block;

/* Waits (bounded) for an even sequence of `layer` and starts a read.
 * ZC_EINVALID for a layer out of range or a negative timeout, -ETIMEDOUT,
 * ZC_EPROTOCOL for a map that does not describe itself consistently. */
int zc_read_begin(const zc_session *session, uint32_t layer, int timeout_ms, zc_read *read);

/* 0: everything read since begin is one state of the layer. ZC_EAGAIN:
 * read again. ZC_ESTALE: the view read is gone or was rebuilt. */
int zc_read_end(const zc_session *session, const zc_read *read);

/* The layer's counts and its residual rows, inside a read. ZC_ESTALE when
 * views = full, the view is not valid and the layer has residual rows. */
int zc_layer_layout(const zc_session *session, const zc_read *read, zc_layer_contents *layout);

/* Block `index` (< read->blocks) of the read's layer, its entry checked:
 * its tokens tile the layer (first_token where the previous block's valid
 * rows end; valid_tokens up to the next block, or to the residual), its
 * payload sizes are those the codec gives its shape, and both payloads lie
 * inside the pool mapping past its header. ZC_EPROTOCOL otherwise (out
 * untouched); ZC_EINVALID for an index not below read->blocks. */
int zc_layer_block(const zc_session *session, const zc_read *read, uint32_t index,
		   zc_block *block);

/* Reconstructs the block's valid_tokens rows with the session's codec
 * config: row t of head (b, h) lands at out[b * strides->batch + h *
 * strides->head + t * strides->token]. Either output may be NULL (skip
 * that tensor); strides->token must be at least the head dim. The codec
 * works on whole blocks, so a block cut by a trim goes head by head
 * through scratch and only its valid rows reach the output. ZC_EINVALID
 * for a block that is not one zc_layer_block gave for this session (its
 * payloads outside the pool, its sizes not the codec's for its shape) or
 * too narrow a token stride; -ENOMEM when scratch cannot be had. */
int zc_block_reconstruct_rows(const zc_session *session, const zc_block *block,
			      uint16_t *keys_out, const zc_strides *key_strides,
			      uint16_t *values_out, const zc_strides *value_strides);

/* The whole layer, blocks and residual, as one consistent read: token t of
 * head (b, h) at out[b * strides->batch + h * strides->head + t *
 * strides->token] for t < *tokens, with room for `capacity` rows per head.
 * Retries torn reads for up to ZC_READ_TIMEOUT_MS (then ZC_EAGAIN); a read
 * that found the view gone is retried too, and ZC_ESTALE means the layer
 * has residual rows only a dropped view holds (zc_session_view brings it
 * back). ZC_EBUFFER when the layer holds more than capacity rows (*tokens
 * says how many). Output rows past *tokens are untouched. */
int zc_layer_reconstruct(const zc_session *session, uint32_t layer, uint16_t *keys_out,
			 const zc_strides *key_strides, uint16_t *values_out,
			 const zc_strides *value_strides, uint32_t capacity, uint32_t *tokens);

/* sizeof(struct_name) when field is NULL, else offsetof(struct_name,
 * field), for the structs of this header and zipcache/map.h (and
 * zc_block_shape, zc_strides): what language bindings that mirror them
 * check their copies against. SIZE_MAX for a name it does not know. */
size_t zc_reader_layout_of(const char *struct_name, const char *field);

#endif
