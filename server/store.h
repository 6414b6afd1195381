/*
 * One session's store: its durable file (commit area, exact residual,
 * block index: store_format.h), its compressed blocks in the owner's pool
 * (pool.h), and the session map clients read (zipcache/map.h: block
 * tables, and fp16 views or a readers' residual). Not thread-safe: the
 * session's work queue guarantees one caller at a time (the pool is
 * shared and locks itself).
 */
#ifndef ZIPCACHE_STORE_H
#define ZIPCACHE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "store_format.h"
#include "budget.h"

struct pool;
struct pool_set;

/* Shape limits a session (and an adopted file) must keep. */
#define STORE_MAX_LAYERS 1024u
#define STORE_MAX_HEADS 65536u            /* batch x kv_heads */
#define STORE_MAX_RESIDUAL_TOKENS 65536u

enum store_policy {
	STORE_POLICY_STREAMING = 0,
	STORE_POLICY_PER_CALL = 1
};

struct store_params {
	uint64_t session_id;
	uint64_t boot_epoch;
	uint32_t owner_uid;
	const char *name;
	const char *model_id;      /* NULL or "": none; at most ZC_MODEL_ID_MAX bytes */
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v;
	uint32_t max_tokens;
	zc_codec_config codec;
	enum store_policy policy;
	uint32_t residual_tokens;
	enum zc_views views;
};

/* The seed's accounting for one layer, residual included. */
struct store_layer_stats {
	uint32_t layer;
	uint32_t tokens;
	uint32_t residual_tokens;
	uint64_t blocks;
	zc_byte_count key;
	zc_byte_count value;
};


struct store;

/*
 * Validates params (ZC_EINVALID / ZC_ESHAPE / codec codes; ZC_EEXHAUSTED
 * for a layout too large to map), creates session-ID.zcs in the directory
 * dir_fd (borrowed; dir_path is for logs), built under a temporary name
 * and renamed into place. Its memory is charged to budget (may be NULL).
 * Resource failures are their negative errnos (ENOSPC, EMFILE, ENOMEM, ...);
 * nothing is left behind on failure.
 */
int store_create(int dir_fd, const char *dir_path, const struct store_params *params,
		 struct store_budget *budget, struct pool *pool, struct store **out);

/*
 * A new session (params gives its id, epoch, name and views; the rest is
 * the source's) whose first `tokens` tokens of every layer are the
 * source's: whole blocks shared by reference (the last one cut where the
 * fork ends, as a trim cuts), the residual's rows copied. The rename of
 * its file is the commit point. Then both go on independently.
 */
int store_fork(struct store *source, uint32_t tokens, int dir_fd, const char *dir_path,
	       const struct store_params *params, struct store_budget *budget, struct store **out);

/* The file (and mapping) size a session with these params needs: 0, or
 * ZC_EEXHAUSTED past store_max_file_bytes(), or a validation code. */
int store_layout_bytes(const struct store_params *params, uint64_t *bytes);
uint64_t store_max_file_bytes(void);
uint64_t store_map_limit(void);

/*
 * Adopts a file a daemon left in dir_fd after a restart: checks every
 * field before trusting it and recovers the committed state of each layer
 * (docs/DURABILITY.md), then charges what it holds. ZC_ECORRUPT with a
 * reason when the file is inconsistent; -EPERM when it belongs to another
 * uid; any other negative errno (EMFILE, ENOMEM, ...) is transient and
 * the file is untouched.
 */
int store_adopt(int dir_fd, const char *dir_path, const char *name, struct store_budget *budget,
		struct pool_set *pools, struct store **out, char *reason, size_t reason_size);

/* Drops the store's references to its blocks without touching its file:
 * an adopted file that will not become a session now (it claimed them). */
void store_release_blocks(struct store *store);

/* Unmaps; with remove_file the file is deleted (closed sessions) and its
 * blocks lose their references. */
void store_close(struct store *store, bool remove_file);

/* Deletes the file now (the commit point of a close); the mapping stays
 * until store_close. */
void store_unlink(struct store *store);

/* Tokens readable in a layer, and its readers' sequence after the last
 * change (safe from the loop thread while a job runs). */
uint32_t store_layer_tokens(const struct store *store, uint32_t layer);
uint64_t store_layer_sequence(const struct store *store, uint32_t layer);

/* Moves the store's charge to another budget (an adopted file to its
 * owner's quota, once the header said who that is). */
void store_charge_to(struct store *store, struct store_budget *budget);

/* Charges what the file holds beyond its charge (pages a client's read
 * faults allocated); returns the bytes added. Not while a job runs. */
uint64_t store_sync_charge(struct store *store);

/* Bounds the address space all stores may map together (0: none); a
 * store past it is refused with ZC_EEXHAUSTED. Set once at start. */
void store_set_map_limit(uint64_t bytes);
uint64_t store_mapped_bytes_total(void);

const struct store_header *store_header(const struct store *store);
/* The session map's layout (what readers are told in the open reply). */
const zc_map_header *store_map_layout(const struct store *store);
struct pool *store_pool(const struct store *store);
bool store_views_full(const struct store *store);
/* Changes whenever a layer's view is dropped or rebuilt. */
uint64_t store_view_generation(const struct store *store, uint32_t layer);
/* Bytes of this store's blocks another session refers to as well (safe
 * from the loop thread while a job runs). */
uint64_t store_shared_bytes(struct store *store);
zc_codec_config store_codec(const struct store *store);
const char *store_path(const struct store *store);

/* A fresh read-only descriptor of the session map for a client (caller
 * closes). */
int store_open_readonly(const struct store *store);

uint64_t store_key_view_offset(const struct store *store, uint32_t layer);
uint64_t store_value_view_offset(const struct store *store, uint32_t layer);

/* Bytes of memory the file and map really hold (fstat's blocks); what the
 * budget charges for them must match (the fuzzer checks). Blocks are the
 * pool's. */
uint64_t store_memory_bytes(const struct store *store);

/* What a store's memory holds, by kind: the file growth each reservation
 * really caused (fstat's blocks before and after), pages readers faulted
 * in counted as views, and for an adopted file its written extents.
 * Blocks are the pools' (pool_memory_bytes), filled in by the caller. */
struct store_memory {
	uint64_t views;      /* fp16 views */
	uint64_t blocks;     /* compressed blocks: the pools */
	uint64_t residual;   /* exact residual rows */
	uint64_t index;      /* block index pages */
	uint64_t headers;    /* headers and the commit area */
	/* Pages kept for reuse (server/retain.h): closed sessions' maps, and
	 * the pools' kept extents (not in `blocks`). */
	uint64_t retained_maps;
	uint64_t retained_extents;
};

/* Adds this store's charged memory, by kind, to *sum (safe from the loop
 * thread while a job runs). */
void store_memory_add(const struct store *store, struct store_memory *sum);

/* About what rebuilding the dropped views would reserve. */
uint64_t store_rebuild_bytes(const struct store *store);

/*
 * Appends a [batch, kv_heads, tokens, D] block of keys and values (fp16,
 * contiguous) to one layer and brings the layer's views up to date.
 * Either everything is stored or nothing is: ZC_EINVALID (layer, zero
 * tokens), ZC_EEXHAUSTED (max_tokens or arena space), STORE_EBUDGET,
 * -ENOSPC (tmpfs full), ZC_ENONFINITE.
 */
int store_update(struct store *store, uint32_t layer, uint32_t tokens,
		 const uint16_t *keys, const uint16_t *values);

/* store_update, with the choice of leaving a residual that fills up
 * exact for a deferred flush (defer_flush: store_flush_begin after the
 * reply) instead of compressing it on the caller's path. */
int store_append(struct store *store, uint32_t layer, uint32_t tokens, const uint16_t *keys,
		 const uint16_t *values, bool defer_flush);

/*
 * The deferred residual flush, in three steps (docs/DURABILITY.md):
 * begin (the session's loop thread: takes the residual's rows as they
 * are now, and marks the layer), compress (any thread, while the
 * session's other jobs go on: a fresh pool block from those rows), and
 * publish (a job of the session, with the store to itself: the block
 * becomes the layer's, atomically for readers) or abandon. While a flush
 * is pending on a layer only short appends that fit the residual's
 * capacity (store_append_fits) may run on it; everything else on the
 * session waits for the publish.
 */
struct store_flush {
	uint32_t layer;
	uint32_t first_token, rows, start;
	int rc;                   /* of the compress, then of the publish */
	bool written;             /* the pool holds the block, not yet named */
	uint8_t *payload;         /* K then V, compressed (owned) */
	float *scores;            /* saliency by attention: what the keys rank by (owned), or NULL */
	zc_byte_count key_count, value_count;
	uint64_t key_offset;
};

/* Whether the layer's residual is full and no flush of it is pending. */
bool store_flush_due(const struct store *store, uint32_t layer);
bool store_flush_pending(const struct store *store, uint32_t layer);
/* Whether a short update of `tokens` can go into the residual beside a
 * pending flush. */
bool store_append_fits(const struct store *store, uint32_t layer, uint32_t tokens);
/* -EAGAIN when nothing is due. */
int store_flush_begin(struct store *store, uint32_t layer, struct store_flush *flush);
void store_flush_compress(const struct store *store, struct store_flush *flush);
int store_flush_publish(struct store *store, struct store_flush *flush);
void store_flush_abandon(struct store *store, struct store_flush *flush);
/*
 * Saliency by attention (docs/ATTEND.md): the attention mass clients
 * measured for tokens [first_token, first_token + rows) of a layer,
 * mass[(b * kv_heads + h) * rows + j], replacing what the store held for
 * them; tokens no longer in the residual are skipped. Kept in memory only
 * (not durable), for the residual flushes to rank by. Call it before the
 * append of the same update. Returns 0, or with nothing changed:
 * ZC_EPRECONDITION (the session ranks by key norm), ZC_EINVALID (layer,
 * zero rows), ZC_ESHAPE (more rows than the residual holds, or tokens the
 * layer does not have), ZC_ENONFINITE (a mass that is NaN, infinite or
 * negative).
 */
int store_residual_mass(struct store *store, uint32_t layer, uint32_t first_token, uint32_t rows,
			const float *mass);

/* A chunk-keyed block (docs/PREFIX.md): one block of exactly `tokens`
 * whatever the policy, on a layer whose residual is empty (else
 * ZC_EPRECONDITION, nothing stored); *out is its entry, with one more
 * pool reference the caller owns. Otherwise as store_update. */
int store_append_block(struct store *store, uint32_t layer, uint32_t tokens,
		       const uint16_t *keys, const uint16_t *values, store_block *out);

/* Drops the last `tokens` tokens of every layer (fewer where a layer is
 * shorter); *trimmed is what the longest layer lost. */
int store_trim(struct store *store, uint32_t tokens, uint32_t *trimmed);

/* The same for one layer (ZC_EINVALID when out of range). */
int store_trim_layer(struct store *store, uint32_t layer, uint32_t tokens, uint32_t *trimmed);

void store_layer_stats(const struct store *store, uint32_t layer, struct store_layer_stats *out);

/* Whether appending `tokens` to the layer compresses something: a direct
 * block, or a residual that fills up. Only a hint when read while a job
 * runs on the store (the loop thread uses it to pick the thread pool). */
bool store_update_compresses(const struct store *store, uint32_t layer, uint32_t tokens);

/* Tokens of the shortest and the longest layer. */
void store_token_range(const struct store *store, uint32_t *min_tokens, uint32_t *max_tokens);

/* Memory pressure: give back the views' pages (not the compressed data);
 * *freed is what the budget got back. */
int store_drop_views(struct store *store, uint64_t *freed);

/* Rebuilds every dropped layer view from blocks and residual. */
int store_rebuild_views(struct store *store);

/* Layer views rebuilt since the process started (all stores). */
uint64_t store_view_rebuilds_total(void);

#define STORE_ALL_LAYERS UINT32_MAX

/* Elements (tokens x heads x head dims, keys and values) that rebuilding
 * the dropped views of one layer, or of STORE_ALL_LAYERS, would write: 0
 * when nothing is dropped or the layer is out of range. Read-only; only a
 * hint when read while a job runs on the store (the loop thread uses it to
 * price a job, as store_update_compresses). */
uint64_t store_rebuild_elements(const struct store *store, uint32_t layer);

/* ---- snapshots (server/snapshot.c) ---- */

/* Rows a streaming residual of this threshold may hold (the one formula). */
uint32_t store_residual_capacity(uint32_t residual_tokens, uint32_t max_tokens);

/* One layer as it stands: counts, its block index (the pool entries, as
 * committed) and its residual rows ([batch][kv_heads][residual_capacity][D]
 * per tensor, residual_tokens rows of each head valid from the pointers
 * on, which already skip residual_start). Pointers
 * are the store's, valid while the caller has the session to itself. */
struct store_cut {
	uint32_t tokens, residual_tokens, blocks;
	const store_block *entries;
	const uint16_t *key_residual, *value_residual;
	uint32_t residual_capacity;
};
void store_layer_cut(const struct store *store, uint32_t layer, struct store_cut *out);

/*
 * An import, built as a fork is (docs/SNAPSHOT.md): begin makes the
 * temporary file (params as for store_create); per layer, its blocks in
 * order (store_import_block: the payloads into fresh pool extents, the
 * entry's offsets ignored) and then the layer (store_import_layer: its
 * tokens and compact residual rows); commit renames the file into place
 * (the commit point; on failure the store is gone). abandon throws away
 * everything made so far, blocks included. The caller checked the counts
 * and sizes (snapshot.c verifies everything first).
 */
int store_import_begin(int dir_fd, const char *dir_path, const struct store_params *params,
		       struct store_budget *budget, struct pool *pool, struct store **out);
int store_import_block(struct store *store, uint32_t layer, const store_block *entry,
		       const void *key, const void *value);
/* store_import_block in two steps, for a block the caller streams into
 * the pool itself (pool_reserve, pool_write_at): room for the layer's
 * next index entry first, then the entry naming the caller's extent (its
 * reference passes to the store; abandon drops it). Not thread-safe
 * within one store, even for different layers (the file's charge): the
 * caller serializes them. */
int store_import_block_room(struct store *store, uint32_t layer);
void store_import_block_add(struct store *store, uint32_t layer, const store_block *entry,
			    uint64_t key_offset);
/* A block shared into the import by reference (a prefix open): the
 * entry names a live extent of the same pool; one more reference. */
int store_import_shared_block(struct store *store, uint32_t layer, const store_block *entry);
int store_import_layer(struct store *store, uint32_t layer, uint32_t tokens,
		       uint32_t residual_tokens, const uint16_t *key_rows, const uint16_t *value_rows);
int store_import_commit(struct store *store);
void store_import_abandon(struct store *store);

#endif
