/*
 * The layout of one session's durable file. It is self-describing (a
 * restarted daemon can adopt what it finds) and never leaves the daemon:
 * what clients map is the session map (a sealed memfd, zipcache/map.h)
 * and the uid's block pool (server/pool.h).
 *
 *   [struct store_header]
 *   [commit area: struct store_commit_area, two records per layer]
 *   [per layer: K residual, V residual ([batch][kv_heads][residual_capacity][D]),
 *    block index (max_blocks x zc_map_block: offsets in the owner's pool)]
 *
 * Every region starts on a page boundary. The file is sparse: pages cost
 * memory only once written (the daemon reserves them with fallocate, so a
 * full tmpfs is an error reply, not a SIGBUS).
 *
 * What is durable is the commit area (docs/DURABILITY.md): a layer's
 * state is the record whose generation is the highest not above the
 * area's committed generation, and the block entries it counts. Entries
 * past that count are scratch, and a mutation writes only there before it
 * advances the committed generation (one aligned 64-bit store: the commit
 * point of every mutation, one layer or all). Committed entries never
 * change, and neither do the pool blocks they name.
 */
#ifndef ZIPCACHE_STORE_FORMAT_H
#define ZIPCACHE_STORE_FORMAT_H

#include <stdint.h>

#include "zipcache/map.h"

#define STORE_MAGIC "ZCSTORE1"
/* 4 added model_id (header) and a record's residual_start (was padding);
 * a version 3 file has zeros in both and is read as one without a model
 * id whose records start their residual at row 0. 5 gave the header's
 * pad0 a meaning, saliency; versions 3 and 4 wrote 0 there, which is
 * ZC_SALIENCY_KEY_NORM, and are read as that. */
#define STORE_VERSION 5u
#define STORE_VERSION_OLDEST 3u
#define STORE_NAME_BYTES 65

/* A block index entry is the public block entry (zipcache/map.h). */
typedef zc_map_block store_block;

/* One layer's durable state as of `generation`. */
struct store_layer_commit {
	uint64_t generation;
	uint32_t tokens;
	uint32_t residual_tokens; /* the last residual_tokens tokens are in the residual */
	uint32_t blocks;          /* committed entries of the block index */
	/* The residual's first row: its rows are [residual_start,
	 * residual_start + residual_tokens) of the residual buffers. Not 0
	 * only between a deferred flush's commit and the commit that moves
	 * the rows appended meanwhile back to row 0 (docs/DURABILITY.md). */
	uint32_t residual_start;
	uint64_t reserved[2];
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
	uint32_t owner_uid;       /* also the pool its blocks live in */
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
	uint32_t views;           /* enum zc_views */
	uint32_t saliency;        /* enum zc_saliency (version 5; 0 before) */
	uint64_t max_blocks;      /* per layer */
	uint64_t file_bytes;
	uint64_t commit_offset;
	uint64_t commit_bytes;
	uint64_t layers_offset;        /* layer i's region at layers_offset + i * layer_region_bytes */
	uint64_t layer_region_bytes;
	uint64_t key_residual_offset;  /* within a layer's region */
	uint64_t value_residual_offset;
	uint64_t index_offset;
	char name[STORE_NAME_BYTES];
	char pad[7];
	char model_id[STORE_NAME_BYTES]; /* the caller's model id (snapshots' fingerprint), "" if none */
	char pad2[7];
};

#endif
