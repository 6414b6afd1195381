/*
 * The chunk index of prefix reuse (docs/PREFIX.md): per uid and
 * fingerprint, a chunk key (the client's hash chain over the token ids of
 * a whole chunk, zipcache/client.h's zc_chunk_chain) and a layer name one
 * compressed block in the uid's pool. The index holds one pool reference
 * per block, so a chunk outlives the session that made it; it is bounded
 * (least recently used blocks go first) and its blocks are charged to the
 * uid's memory as every pool block is. Loop thread only.
 */
#ifndef ZIPCACHE_PREFIX_H
#define ZIPCACHE_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"
#include "zipcache/client.h"

struct pool;
struct snapshot_config;

/* Blocks the index holds at most, over all uids: about 64 K blocks is
 * 256 chunks of a 32-layer model, for each of eight prompts; more is what
 * sessions hold themselves. */
#define PREFIX_INDEX_MAX_BLOCKS 65536u

struct prefix_block;

struct prefix_index {
	struct prefix_block **buckets;
	size_t n_buckets;
	struct prefix_block *newest, *oldest;  /* the LRU list */
	size_t blocks, max_blocks;
	uint64_t evicted;
};

int prefix_index_init(struct prefix_index *index, size_t max_blocks);
/* Drops every reference the index holds (before the pools are freed). */
void prefix_index_free(struct prefix_index *index);

/*
 * What a chunk is keyed by besides its chain: the blocks' fingerprint, the
 * snapshot fingerprint (snapshot.c's one function) of the model id, shape
 * and codec with policy and residual threshold left out (they decide how
 * a session cuts blocks, not what a chunk's block holds).
 */
uint64_t prefix_fingerprint(const struct snapshot_config *config);
uint64_t prefix_fingerprint_of_store(const struct store_header *h);
uint64_t prefix_fingerprint_of_params(const struct store_params *params);

/*
 * Records that `block` (in pool, first_token its first token) is the
 * chunk `key` of one layer. The caller gives the index one reference on
 * the block it already took; when the index knows that chunk already the
 * older block stays and the given reference is dropped. Evicts the least
 * recently used blocks past the bound.
 */
void prefix_index_put(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
		      const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer, uint32_t first_token,
		      struct pool *pool, const store_block *block);

/* The block of one chunk and layer, or NULL (marks it recently used). */
const store_block *prefix_index_get(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
				    const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer,
				    uint32_t first_token, struct pool **pool);

/* How many leading chunks of keys[0..n) are held whole (every layer, at
 * the chain's positions) for uid and fingerprint. */
uint32_t prefix_index_held(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
			   const uint8_t *keys, uint32_t n, uint32_t layers);

/* The fingerprinted config of a chunk's blocks (what prefix_fingerprint
 * hashes), from a session's params. */
void prefix_config_of_params(const struct store_params *params, struct snapshot_config *out);

/* ---- the remote tier (docs/PREFIX.md, "Remote chunks"): worker threads ---- */

struct remote;

/* How long a chunk stays in Redis after it was written: a day, renewed
 * whenever a daemon writes it again. */
#define PREFIX_REMOTE_TTL_SECONDS 86400u

/*
 * Writes one chunk's block of one layer (block `chunk` of the chain, its
 * payloads read from pool) to zc:1:UID:c:FPHEX:CHAINHEX:LAYER as a
 * snapshot block record (proto/snapshot_format.h: its own checksums),
 * with PREFIX_REMOTE_TTL_SECONDS. The caller holds a reference on the
 * block while this runs.
 */
int prefix_remote_publish(struct remote *remote, uint32_t uid, uint64_t fingerprint,
			  const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer, struct pool *pool,
			  const store_block *block);

/* How many chunks of keys[from..n) are complete in Redis (every layer),
 * counting from `from`: *held. A failure of the tier is its code. */
int prefix_remote_count(struct remote *remote, uint32_t uid, uint64_t fingerprint,
			const uint8_t *keys, uint32_t from, uint32_t n, uint32_t layers,
			uint32_t *held);

/*
 * Fetches chunks keys[from..n) of every layer from Redis and verifies each
 * record (magic, checksums, fingerprint, place, sizes for config), making
 * nothing: records[(i - from) * layers + layer] is the record (malloc'd,
 * the caller frees them with prefix_records_free) and out[...] its entry.
 * ZC_ENOTFOUND for a missing record, ZC_ECORRUPT for a damaged one, the
 * tier's code when it failed; why says what. Nothing is kept on failure.
 */
int prefix_remote_fetch(struct remote *remote, uint32_t uid, const struct snapshot_config *config,
			const uint8_t *keys, uint32_t from, uint32_t n, void **records,
			store_block *out, char *why, size_t why_size);

/* Writes verified records into pool: each entry gets its extent and one
 * reference the caller owns; on failure none is kept. */
int prefix_records_write(struct pool *pool, void *const *records, store_block *entries,
			 size_t count, char *why, size_t why_size);
void prefix_records_free(void **records, size_t count);

/* Drops the blocks no session refers to (memory relief), of every uid or
 * of uid's only: how many; *freed_bytes (added to) their extents' bytes. */
size_t prefix_index_drop_unused(struct prefix_index *index, bool any_uid, uint32_t uid,
				uint64_t *freed_bytes);

#endif
