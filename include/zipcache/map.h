/*
 * What a client maps, read-only, for one session: the public, versioned
 * layout of a session's readable state (docs/MAP.md). Two mappings:
 *
 *   the session map (one per session, a sealed memfd of the daemon's):
 *     [zc_map_header + layers x zc_map_layer]
 *     [per layer: block table, max_blocks x zc_map_block]
 *     [per layer: exact residual K then V, [batch][kv_heads][residual_capacity][D]
 *      fp16 — only with views = none; with full views the residual rows
 *      are the view's last residual_tokens rows]
 *     [per layer: fp16 views K then V, [batch][kv_heads][max_tokens][D]
 *      — only with views = full]
 *   the pool map (one per uid: every compressed block of the uid's
 *     sessions, immutable while any session refers to it; a block's K
 *     payload at key_offset, its V payload at value_offset, exactly as
 *     docs/CODEC.md lays them out for shape [batch, kv_heads, tokens, D]
 *     and the session's codec config).
 *
 * A layer is consistent when read inside its seqlock: `sequence` even and
 * unchanged before and after every load of the layer's counts, table,
 * residual, view rows and the pool bytes its blocks name (a block's pool
 * bytes may be freed and reused after a trim, and the sequence changes
 * before that happens). `generation` changes whenever the layer's view is
 * dropped or rebuilt. client.h's zc_read_begin/zc_read_end implement this.
 */
#ifndef ZIPCACHE_MAP_H
#define ZIPCACHE_MAP_H

#include <stdint.h>

#define ZC_MAP_MAGIC "ZCMAP001"
#define ZC_MAP_VERSION 1u

#define ZC_POOL_MAGIC "ZCPOOL01"
#define ZC_POOL_VERSION 1u

typedef enum zc_views {
	ZC_VIEWS_FULL = 0,   /* fp16 views materialized (the seed's surface) */
	ZC_VIEWS_NONE = 1    /* compressed blocks + exact residual only */
} zc_views;

/* One compressed block of a layer. The layer's tokens from first_token up
 * to the next entry's first_token (for the last entry: up to tokens -
 * residual_tokens) are the first rows of its reconstruction. A trim or
 * fork may cut a block's tail; the payload is always that of `tokens`
 * rows, and a committed entry is never rewritten, so valid_tokens is what
 * belonged to the layer when the entry was written: the rows that belong
 * to it now are those the tiling gives, never more than valid_tokens. */
typedef struct zc_map_block {
	uint32_t first_token;
	uint32_t tokens;          /* rows the payload was compressed with */
	uint32_t valid_tokens;    /* rows of it the layer held when it was written */
	uint32_t flags;           /* 0 */
	uint64_t key_offset;      /* in the pool map */
	uint64_t key_bytes;
	uint64_t value_offset;
	uint64_t value_bytes;
} zc_map_block;

typedef struct zc_map_layer {
	uint64_t sequence;        /* odd while the daemon writes this layer */
	uint64_t generation;      /* changes when the view is dropped or rebuilt */
	uint32_t tokens;          /* tokens of the layer */
	uint32_t residual_tokens; /* the last residual_tokens of them are exact fp16 */
	uint32_t blocks;          /* valid entries of the block table */
	uint32_t view_valid;      /* 1 when the fp16 view holds every token */
	uint64_t key_compressed_bytes;   /* the seed's accounting, residual excluded */
	uint64_t key_baseline_bytes;
	uint64_t value_compressed_bytes;
	uint64_t value_baseline_bytes;
} zc_map_layer;

typedef struct zc_map_header {
	char magic[8];            /* ZC_MAP_MAGIC */
	uint32_t version;         /* ZC_MAP_VERSION */
	uint32_t header_bytes;    /* header + layer array, page-rounded */
	uint64_t session_id;
	uint32_t layers;
	uint32_t batch;
	uint32_t kv_heads;
	uint32_t head_dim_k;
	uint32_t head_dim_v;
	uint32_t max_tokens;
	uint32_t policy;          /* 0 streaming, 1 per call */
	uint32_t residual_tokens; /* streaming threshold */
	uint32_t residual_capacity;
	uint32_t views;           /* enum zc_views */
	int32_t hi_bits;
	int32_t lo_bits;
	double hi_fraction;
	int32_t group_size;
	uint32_t quantize_values;
	uint64_t max_blocks;      /* block table entries per layer */
	uint64_t map_bytes;       /* size of the session map */
	uint64_t table_offset;    /* layer i's table at table_offset + i * table_bytes */
	uint64_t table_bytes;
	uint64_t residual_offset; /* 0 without a separate residual */
	uint64_t residual_bytes;  /* one layer's K + V residual */
	uint64_t key_residual_bytes;
	uint64_t views_offset;    /* 0 without views */
	uint64_t view_layer_bytes;/* one layer's K + V view */
	uint64_t key_view_bytes;
	uint64_t pool_bytes;      /* size of the pool map */
	uint64_t reserved[4];
	zc_map_layer layer[];
} zc_map_header;

/* The first page of the pool map. */
typedef struct zc_pool_header {
	char magic[8];            /* ZC_POOL_MAGIC */
	uint32_t version;
	uint32_t owner_uid;
	uint64_t capacity;        /* bytes of the pool file */
	uint64_t data_offset;     /* first byte a block may occupy */
} zc_pool_header;

#endif
