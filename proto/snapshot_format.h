/*
 * The layout of a session snapshot (docs/SNAPSHOT.md): what export_session
 * writes and import_session verifies. The one definition of it; the
 * encoder and verifier are server/snapshot.c. Every integer is
 * little-endian (these structs are written as they lie in memory, and
 * the daemon only builds on little-endian hosts: the static assert in
 * snapshot.c). Every checksum is XXH3_64bits (seed 0).
 *
 *   [struct snapshot_header]                         SNAPSHOT_HEADER_BYTES
 *   [layers x struct snapshot_layer][u64 checksum]   the layer table
 *   per layer, in order:
 *     blocks x ([struct snapshot_block][K payload][V payload][u64 payload checksum])
 *     [K residual rows [batch][kv_heads][residual_tokens][head_dim_k] fp16]
 *     [V residual rows, likewise with head_dim_v]
 *   [struct snapshot_trailer]                        SNAPSHOT_TRAILER_BYTES
 *
 * A block record is self-contained (its layer, position, sizes and both
 * checksums are in its own header), so the same record can be stored on
 * its own elsewhere (a remote tier's per-block value) and verified with
 * the header's config alone.
 */
#ifndef ZIPCACHE_SNAPSHOT_FORMAT_H
#define ZIPCACHE_SNAPSHOT_FORMAT_H

#include <stdint.h>

#define SNAPSHOT_MAGIC "ZCSNAP01"
#define SNAPSHOT_BLOCK_MAGIC "ZCBLOCK1"
#define SNAPSHOT_TRAILER_MAGIC "ZCSNEND1"
#define SNAPSHOT_VERSION 1u
#define SNAPSHOT_MODEL_ID_BYTES 65   /* ZC_MODEL_ID_MAX + 1: NUL-terminated, zero-padded */

/*
 * What the fingerprint covers: the model, the layout and the codec. A
 * session built from a snapshot keeps all of it, so two snapshots with the
 * same fingerprint hold blocks any session of that config can use.
 * Hashed as these bytes (padding zeroed), by snapshot_fingerprint().
 */
struct snapshot_config {
	uint32_t layers;
	uint32_t batch;
	uint32_t kv_heads;
	uint32_t head_dim_k;
	uint32_t head_dim_v;
	uint32_t policy;           /* zipcache_v1_BlockPolicy */
	uint32_t residual_tokens;  /* streaming threshold (0 for per_call) */
	int32_t hi_bits;
	int32_t lo_bits;
	int32_t group_size;
	double hi_fraction;
	uint32_t quantize_values;
	/* enum zc_saliency. It was padding, hashed as 0: a snapshot written
	 * before it holds 0 (key norm), and a key-norm session's fingerprint
	 * is what it always was. */
	uint32_t saliency;
	char model_id[SNAPSHOT_MODEL_ID_BYTES];
	char pad2[7];
};

struct snapshot_header {
	char magic[8];             /* SNAPSHOT_MAGIC */
	uint32_t version;          /* SNAPSHOT_VERSION */
	uint32_t header_bytes;     /* sizeof(struct snapshot_header) */
	uint64_t fingerprint;      /* snapshot_fingerprint(&config) */
	struct snapshot_config config;
	/* Not fingerprinted: a property of the session, not of its blocks. */
	uint32_t max_tokens;
	uint32_t views;            /* enum zc_views */
	uint64_t tokens;           /* summed over layers */
	uint64_t blocks;           /* summed over layers */
	uint64_t file_bytes;       /* the whole snapshot, trailer included */
	uint64_t reserved[4];      /* 0 */
	uint64_t checksum;         /* over every byte above */
};

/* One layer of the table. */
struct snapshot_layer {
	uint32_t tokens;
	uint32_t residual_tokens;  /* the last residual_tokens tokens are the residual rows */
	uint32_t blocks;
	uint32_t pad;
	uint64_t offset;           /* of its first block record (or its residual) in the file */
	uint64_t bytes;            /* its block records and residual rows */
	uint64_t residual_checksum;/* over its K then V residual rows (0 bytes: XXH3 of nothing) */
};

/* The header of one block record; its K then V payloads follow, exactly
 * as the pool holds them (docs/CODEC.md), then the payloads' checksum
 * (XXH3 over K then V), after them so that a writer streams the payloads
 * straight through without holding a whole block. */
struct snapshot_block {
	char magic[8];             /* SNAPSHOT_BLOCK_MAGIC */
	uint64_t fingerprint;      /* the snapshot's: a record never joins another config */
	uint32_t layer;
	uint32_t index;            /* its place in the layer's block list */
	uint32_t first_token;
	uint32_t tokens;           /* rows the payloads were compressed with */
	uint32_t valid_tokens;     /* as in the block table (zipcache/map.h) */
	uint32_t flags;            /* 0 */
	uint64_t key_bytes;
	uint64_t value_bytes;
	uint64_t checksum;         /* over every byte of this header above */
};

struct snapshot_trailer {
	char magic[8];             /* SNAPSHOT_TRAILER_MAGIC */
	uint64_t file_bytes;       /* the header's */
	/* Over the header, the layer table with its checksum, and then each
	 * region's own checksum in file order (every block record's header
	 * checksum and payload checksum, every layer's residual checksum):
	 * a hash of hashes, so every byte is covered without hashing the
	 * payloads twice. */
	uint64_t checksum;
};

#define SNAPSHOT_HEADER_BYTES ((uint32_t)sizeof(struct snapshot_header))
#define SNAPSHOT_LAYER_BYTES ((uint32_t)sizeof(struct snapshot_layer))
#define SNAPSHOT_BLOCK_BYTES ((uint32_t)sizeof(struct snapshot_block))
#define SNAPSHOT_TRAILER_BYTES ((uint32_t)sizeof(struct snapshot_trailer))
#define SNAPSHOT_BLOCK_END_BYTES ((uint32_t)sizeof(uint64_t))   /* the payload checksum */

/* Bytes of one block record with payloads of these sizes: the one formula. */
static inline uint64_t snapshot_record_bytes(uint64_t key_bytes, uint64_t value_bytes)
{
	return SNAPSHOT_BLOCK_BYTES + key_bytes + value_bytes + SNAPSHOT_BLOCK_END_BYTES;
}

_Static_assert(sizeof(struct snapshot_config) == 128, "snapshot_config layout");
_Static_assert(sizeof(struct snapshot_header) == 224, "snapshot_header layout");
_Static_assert(sizeof(struct snapshot_layer) == 40, "snapshot_layer layout");
_Static_assert(sizeof(struct snapshot_block) == 64, "snapshot_block layout");
_Static_assert(sizeof(struct snapshot_trailer) == 24, "snapshot_trailer layout");

#endif
