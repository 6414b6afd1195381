/*
 * The layout of one session's shared-memory file. It is self-describing
 * (a restarted daemon can adopt what it finds). Its first part — this
 * header and the fp16 views — is also the layout of what a client maps,
 * read-only: but that is a memfd of the daemon's (sealed against
 * resizing, not durable), and the file's own view range stays unwritten.
 * The file itself never leaves the daemon.
 *
 *   [header: struct store_header + layers x struct store_layer_header]
 *   [views: per layer, K then V, each [batch][kv_heads][max_tokens][D] fp16]
 *   ---- end of the client's mapping ----
 *   [commit area: struct store_commit_area, two records per layer]
 *   [per layer: K residual, V residual ([batch][kv_heads][residual_capacity][D]),
 *    block index (max_blocks x struct store_block), K arena, V arena]
 *
 * Every region starts on a page boundary. The file is sparse: pages cost
 * memory only once written (the daemon reserves them with fallocate in
 * chunks, so a full tmpfs is an error reply, not a SIGBUS).
 *
 * What is durable is the commit area (docs/DURABILITY.md): a layer's
 * state is the record whose generation is the highest not above the
 * area's committed generation, and the block entries and arena bytes it
 * counts. Everything past those counts is scratch, and a mutation writes
 * only there before it advances the committed generation (one aligned
 * 64-bit store: the commit point of every mutation, one layer or all).
 * Committed block entries and arena bytes never change.
 *
 * The layer headers and the views (in the readers' memfd) are for readers:
 * the daemon writes them from its own private state (never reads them
 * back) inside an odd/even `sequence` (a seqlock), so a reader that sees
 * an even, unchanged sequence around its read saw a consistent layer. The
 * views are rebuilt from the commit area by every daemon that adopts the
 * file.
 */
#ifndef ZIPCACHE_STORE_FORMAT_H
#define ZIPCACHE_STORE_FORMAT_H

#include <stdint.h>

#define STORE_MAGIC "ZCSTORE1"
#define STORE_VERSION 2u
#define STORE_NAME_BYTES 65

struct store_block {
	uint32_t first_token;
	uint32_t tokens;          /* tokens the block was compressed with */
	uint32_t valid_tokens;    /* as written: tokens; trim's cut follows from the records */
	uint32_t flags;
	uint64_t key_offset;      /* in the layer's K arena */
	uint64_t key_bytes;
	uint64_t value_offset;
	uint64_t value_bytes;
};

struct store_layer_header {
	uint64_t sequence;        /* odd while the daemon is writing this layer */
	uint32_t tokens;          /* tokens readable in the views */
	uint32_t residual_tokens; /* the last residual_tokens of them are exact fp16 */
	uint32_t blocks;          /* entries in the block index */
	uint32_t view_valid;      /* 0 when the views were dropped and must be rebuilt */
	uint64_t key_arena_used;
	uint64_t value_arena_used;
	uint64_t reserved[3];
	/* Running totals over the block index (the residual is added when
	 * stats are read), so a reply never walks thousands of blocks. */
	uint64_t key_compressed_bytes;
	uint64_t key_baseline_bytes;
	uint64_t value_compressed_bytes;
	uint64_t value_baseline_bytes;
};

/* One layer's durable state as of `generation`. */
struct store_layer_commit {
	uint64_t generation;
	uint32_t tokens;
	uint32_t residual_tokens; /* the last residual_tokens tokens are in the residual */
	uint32_t blocks;          /* committed entries of the block index */
	uint32_t pad;
	uint64_t key_arena_used;
	uint64_t value_arena_used;
};

struct store_commit_area {
	uint64_t generation;      /* committed; records past it are ignored */
	uint64_t pad;
	struct store_layer_commit record[];   /* layers x 2 */
};

struct store_header {
	char magic[8];
	uint32_t version;
	uint32_t header_bytes;
	uint64_t session_id;
	uint64_t created_epoch;   /* boot epoch of the daemon that created it */
	uint32_t owner_uid;
	uint32_t layers;
	uint32_t batch;
	uint32_t kv_heads;
	uint32_t head_dim_k;
	uint32_t head_dim_v;
	uint32_t max_tokens;
	uint32_t policy;          /* zipcache_v1_BlockPolicy */
	uint32_t residual_tokens; /* streaming threshold */
	uint32_t residual_capacity;
	int32_t hi_bits;
	int32_t lo_bits;
	double hi_fraction;
	int32_t group_size;
	uint32_t quantize_values;
	uint64_t max_blocks;      /* per layer */
	uint64_t views_bytes;     /* header + views: the client's mapping */
	uint64_t file_bytes;
	uint64_t commit_offset;        /* the commit area, after the views */
	uint64_t commit_bytes;
	/* Per layer, byte offsets in the file. */
	uint64_t layer_region_bytes;   /* private region of one layer */
	uint64_t key_residual_offset;  /* within a layer's private region */
	uint64_t value_residual_offset;
	uint64_t index_offset;
	uint64_t key_arena_offset;
	uint64_t key_arena_bytes;
	uint64_t value_arena_offset;
	uint64_t value_arena_bytes;
	char name[STORE_NAME_BYTES];
	char pad[7];
	struct store_layer_header layer[];
};

#endif
