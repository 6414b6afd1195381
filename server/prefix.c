/*
 * The chunk index (prefix.h, docs/PREFIX.md): a hash table over (uid,
 * fingerprint, chain key, layer) with a least-recently-used list, each
 * entry one pool reference on the block it names.
 */
#include "prefix.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "log.h"
#include "pool.h"
#include "remote.h"
#include "snapshot.h"
#include "zipcache/error.h"

struct prefix_block {
	uint32_t uid;
	uint32_t layer;
	uint32_t first_token;
	uint64_t fingerprint;
	uint8_t key[ZC_CHUNK_KEY_BYTES];
	struct pool *pool;
	store_block block;
	struct prefix_block *next;            /* in its bucket */
	struct prefix_block *newer, *older;   /* in the LRU list */
};

int prefix_index_init(struct prefix_index *index, size_t max_blocks)
{
	memset(index, 0, sizeof(*index));
	/* About one bucket per block at the bound, a power of two. */
	index->n_buckets = 1;
	while (index->n_buckets < max_blocks)
		index->n_buckets <<= 1;
	index->buckets = calloc(index->n_buckets, sizeof(*index->buckets));
	if (!index->buckets)
		return -ENOMEM;
	index->max_blocks = max_blocks;
	return 0;
}

static size_t bucket_of(const struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
			const uint8_t *key, uint32_t layer)
{
	uint64_t seed = fingerprint ^ ((uint64_t)uid << 32 | layer);
	return (size_t)(XXH3_64bits_withSeed(key, ZC_CHUNK_KEY_BYTES, seed) & (index->n_buckets - 1));
}

static void lru_unlink(struct prefix_index *index, struct prefix_block *b)
{
	if (b->newer)
		b->newer->older = b->older;
	else
		index->newest = b->older;
	if (b->older)
		b->older->newer = b->newer;
	else
		index->oldest = b->newer;
	b->newer = b->older = NULL;
}

static void lru_push(struct prefix_index *index, struct prefix_block *b)
{
	b->older = index->newest;
	b->newer = NULL;
	if (index->newest)
		index->newest->newer = b;
	index->newest = b;
	if (!index->oldest)
		index->oldest = b;
}

/* Takes b out of the table and the list and drops its reference. */
static void block_remove(struct prefix_index *index, struct prefix_block *b)
{
	size_t at = bucket_of(index, b->uid, b->fingerprint, b->key, b->layer);
	for (struct prefix_block **p = &index->buckets[at]; *p; p = &(*p)->next) {
		if (*p == b) {
			*p = b->next;
			break;
		}
	}
	lru_unlink(index, b);
	pool_unref(b->pool, b->block.key_offset);
	index->blocks--;
	free(b);
}

void prefix_index_free(struct prefix_index *index)
{
	while (index->oldest)
		block_remove(index, index->oldest);
	free(index->buckets);
	memset(index, 0, sizeof(*index));
}

uint64_t prefix_fingerprint(const struct snapshot_config *config)
{
	struct snapshot_config c = *config;
	c.policy = 0;
	c.residual_tokens = 0;
	/* A chunk is one block compressed by key norm whatever the session's
	 * saliency (only residual flushes rank by attention): the sessions of
	 * both share chunks. */
	c.saliency = 0;
	return snapshot_fingerprint(&c);
}

uint64_t prefix_fingerprint_of_store(const struct store_header *h)
{
	struct snapshot_config c;
	snapshot_config_of(h, &c);
	return prefix_fingerprint(&c);
}

void prefix_config_of_params(const struct store_params *p, struct snapshot_config *c)
{
	/* The fields snapshot_config_of() reads, as store_create() writes
	 * them into a header; policy, residual threshold and saliency left 0
	 * (prefix_fingerprint ignores them). */
	memset(c, 0, sizeof(*c));
	c->layers = p->layers;
	c->batch = p->batch;
	c->kv_heads = p->kv_heads;
	c->head_dim_k = p->head_dim_k;
	c->head_dim_v = p->head_dim_v;
	c->hi_bits = p->codec.hi_bits;
	c->lo_bits = p->codec.lo_bits;
	c->group_size = p->codec.group_size;
	c->hi_fraction = p->codec.hi_fraction;
	c->quantize_values = p->codec.quantize_values;
	snprintf(c->model_id, sizeof(c->model_id), "%s", p->model_id ? p->model_id : "");
}

uint64_t prefix_fingerprint_of_params(const struct store_params *p)
{
	struct snapshot_config c;
	prefix_config_of_params(p, &c);
	return prefix_fingerprint(&c);
}

static struct prefix_block *find(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
				 const uint8_t *key, uint32_t layer)
{
	size_t at = bucket_of(index, uid, fingerprint, key, layer);
	for (struct prefix_block *b = index->buckets[at]; b; b = b->next) {
		if (b->uid == uid && b->fingerprint == fingerprint && b->layer == layer &&
		    memcmp(b->key, key, ZC_CHUNK_KEY_BYTES) == 0)
			return b;
	}
	return NULL;
}

void prefix_index_put(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
		      const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer, uint32_t first_token,
		      struct pool *pool, const store_block *block)
{
	struct prefix_block *b = find(index, uid, fingerprint, key, layer);
	if (b && b->first_token == first_token) {
		/* Known: sessions that prefilled the same chunk themselves
		 * keep their own block; the index keeps the first. */
		lru_unlink(index, b);
		lru_push(index, b);
		pool_unref(pool, block->key_offset);
		return;
	}
	if (b)
		block_remove(index, b);  /* the same chain at another position: the newest wins */
	b = calloc(1, sizeof(*b));
	if (!b) {
		/* The index is a cache: a chunk it cannot hold is a miss later. */
		pool_unref(pool, block->key_offset);
		return;
	}
	b->uid = uid;
	b->layer = layer;
	b->first_token = first_token;
	b->fingerprint = fingerprint;
	memcpy(b->key, key, ZC_CHUNK_KEY_BYTES);
	b->pool = pool;
	b->block = *block;
	size_t at = bucket_of(index, uid, fingerprint, key, layer);
	b->next = index->buckets[at];
	index->buckets[at] = b;
	lru_push(index, b);
	index->blocks++;
	while (index->blocks > index->max_blocks && index->oldest) {
		block_remove(index, index->oldest);
		index->evicted++;
	}
}

const store_block *prefix_index_get(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
				    const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer,
				    uint32_t first_token, struct pool **pool)
{
	struct prefix_block *b = find(index, uid, fingerprint, key, layer);
	if (!b || b->first_token != first_token)
		return NULL;
	lru_unlink(index, b);
	lru_push(index, b);
	if (pool)
		*pool = b->pool;
	return &b->block;
}

uint32_t prefix_index_held(struct prefix_index *index, uint32_t uid, uint64_t fingerprint,
			   const uint8_t *keys, uint32_t n, uint32_t layers)
{
	for (uint32_t i = 0; i < n; i++) {
		for (uint32_t layer = 0; layer < layers; layer++) {
			if (!prefix_index_get(index, uid, fingerprint, keys + (size_t)i * ZC_CHUNK_KEY_BYTES,
					      layer, i * ZC_PREFIX_CHUNK_TOKENS, NULL))
				return i;
		}
	}
	return n;
}

size_t prefix_index_drop_unused(struct prefix_index *index, bool any_uid, uint32_t uid,
				uint64_t *freed_bytes)
{
	size_t dropped = 0;
	struct prefix_block *b = index->oldest;
	while (b) {
		struct prefix_block *newer = b->newer;
		/* One reference: the index's own; no session names the block. */
		if ((any_uid || b->uid == uid) && pool_refs(b->pool, b->block.key_offset) == 1) {
			*freed_bytes += pool_extent_bytes(b->block.key_bytes, b->block.value_bytes);
			block_remove(index, b);
			dropped++;
		}
		b = newer;
	}
	return dropped;
}

/* ---- the remote tier ---- */

/* Records per pipelined GET batch: of 1, 8, 32 and all 512 records of a
 * 32 x 4096 prefix, 8 fetched fastest (bench/prefix_bench.c). */
#define PREFIX_FETCH_BATCH 8u

static int chunk_key(struct remote_key *out, uint32_t uid, uint64_t fingerprint,
		     const uint8_t *key, uint32_t layer)
{
	uint8_t fp[8];
	for (int i = 0; i < 8; i++)
		fp[i] = (uint8_t)(fingerprint >> (56 - 8 * i));
	struct remote_key_parts parts = {
		.kind = REMOTE_KEY_CHUNK,
		.fingerprint = fp,
		.fingerprint_len = sizeof(fp),
		.chain = key,
		.chain_len = ZC_CHUNK_KEY_BYTES,
		.layer = layer,
	};
	return remote_key_make(out, uid, &parts);
}

int prefix_remote_publish(struct remote *remote, uint32_t uid, uint64_t fingerprint,
			  const uint8_t key[ZC_CHUNK_KEY_BYTES], uint32_t layer, struct pool *pool,
			  const store_block *block)
{
	struct remote_key name;
	int rc = chunk_key(&name, uid, fingerprint, key, layer);
	if (rc < 0)
		return rc;
	uint64_t bytes = snapshot_record_bytes(block->key_bytes, block->value_bytes);
	uint8_t *payloads = malloc(block->key_bytes + block->value_bytes);
	uint8_t *record = malloc(bytes);
	if (!payloads || !record) {
		rc = -ENOMEM;
		goto out_free;
	}
	rc = pool_read(pool, block->key_offset, payloads, block->key_bytes);
	if (rc == 0)
		rc = pool_read(pool, block->value_offset, payloads + block->key_bytes,
			       block->value_bytes);
	if (rc < 0)
		goto out_free;
	snapshot_block_encode(fingerprint, layer, block->first_token / ZC_PREFIX_CHUNK_TOKENS, block,
			      payloads, payloads + block->key_bytes, record);
	rc = remote_set(remote, &name, record, bytes, PREFIX_REMOTE_TTL_SECONDS);
out_free:
	free(payloads);
	free(record);
	return rc;
}

int prefix_remote_count(struct remote *remote, uint32_t uid, uint64_t fingerprint,
			const uint8_t *keys, uint32_t from, uint32_t n, uint32_t layers,
			uint32_t *held)
{
	struct remote_key *names = calloc(layers, sizeof(*names));
	const struct remote_key **list = calloc(layers, sizeof(*list));
	int rc = names && list ? 0 : -ENOMEM;
	*held = 0;
	/* One pipelined batch per chunk: the answer stops at the first
	 * chunk some layer lacks, and a chain is rarely long. */
	for (uint32_t i = from; rc == 0 && i < n; i++) {
		for (uint32_t layer = 0; rc == 0 && layer < layers; layer++) {
			rc = chunk_key(&names[layer], uid, fingerprint,
				       keys + (size_t)i * ZC_CHUNK_KEY_BYTES, layer);
			list[layer] = &names[layer];
		}
		uint64_t found = 0;
		if (rc == 0)
			rc = remote_exists_count(remote, list, layers, &found);
		if (rc < 0 || found < layers)
			break;
		(*held)++;
	}
	free(names);
	free(list);
	return rc;
}

int prefix_remote_fetch(struct remote *remote, uint32_t uid, const struct snapshot_config *config,
			const uint8_t *keys, uint32_t from, uint32_t n, void **records,
			store_block *out, char *why, size_t why_size)
{
	uint32_t layers = config->layers;
	size_t count = (size_t)(n - from) * layers;
	struct snapshot_header header;
	/* The header's config is the chunks' (policy and threshold 0), so its
	 * fingerprint is prefix_fingerprint's; room for any chunk's place. */
	snapshot_header_encode(config, ZC_PREFIX_MAX_CHUNKS * ZC_PREFIX_CHUNK_TOKENS, 0, 0, 0, 0,
			       &header);
	struct remote_key *names = calloc(count, sizeof(*names));
	struct remote_item *items = calloc(count, sizeof(*items));
	int rc = names && items ? 0 : -ENOMEM;
	if (rc < 0)
		snprintf(why, why_size, "out of memory");
	for (size_t j = 0; rc == 0 && j < count; j++) {
		uint32_t i = from + (uint32_t)(j / layers), layer = (uint32_t)(j % layers);
		rc = chunk_key(&names[j], uid, header.fingerprint, keys + (size_t)i * ZC_CHUNK_KEY_BYTES,
			       layer);
		items[j].key = &names[j];
	}
	/* A batch per PREFIX_FETCH_BATCH records (measured: one batch of all
	 * of them took twice as long; one round trip per record longer still). */
	for (size_t at = 0; rc == 0 && at < count; at += PREFIX_FETCH_BATCH) {
		size_t n_batch = count - at < PREFIX_FETCH_BATCH ? count - at : PREFIX_FETCH_BATCH;
		rc = remote_get_many(remote, items + at, n_batch);
		if (rc < 0) {
			char text[200];
			remote_last_error(remote, text, sizeof(text));
			snprintf(why, why_size, "the remote tier failed: %s", text);
			/* One code for the client, whatever the tier said. */
			rc = rc == -ENOMEM ? rc : ZC_EREMOTE;
		}
	}
	for (size_t j = 0; rc == 0 && j < count; j++) {
		uint32_t i = from + (uint32_t)(j / layers), layer = (uint32_t)(j % layers);
		char reason[200];
		if (items[j].status < 0) {
			rc = items[j].status;
			snprintf(why, why_size, "chunk %u layer %u is not in the remote tier (%s)", i, layer,
				 zc_error_name(rc));
			break;
		}
		rc = snapshot_block_verify(&header, layer, i, items[j].got, items[j].got_len, &out[j],
					   reason, sizeof(reason));
		if (rc == 0 && (out[j].first_token != i * ZC_PREFIX_CHUNK_TOKENS ||
				out[j].tokens != ZC_PREFIX_CHUNK_TOKENS ||
				out[j].valid_tokens != ZC_PREFIX_CHUNK_TOKENS)) {
			rc = ZC_ECORRUPT;
			snprintf(reason, sizeof(reason), "it is not a whole chunk at token %u",
				 i * ZC_PREFIX_CHUNK_TOKENS);
		}
		if (rc < 0)
			snprintf(why, why_size, "chunk %u layer %u from the remote tier: %s", i, layer,
				 reason);
	}
	for (size_t j = 0; items && j < count; j++) {
		records[j] = rc == 0 ? items[j].got : NULL;
		if (rc < 0)
			free(items[j].got);
	}
	free(items);
	free(names);
	return rc;
}

int prefix_records_write(struct pool *pool, void *const *records, store_block *entries,
			 size_t count, char *why, size_t why_size)
{
	size_t written = 0;
	int rc = 0;
	for (; written < count; written++) {
		store_block *e = &entries[written];
		const uint8_t *payload = (const uint8_t *)records[written] + SNAPSHOT_BLOCK_BYTES;
		uint64_t key_offset;
		rc = pool_write(pool, payload, e->key_bytes, payload + e->key_bytes, e->value_bytes,
				&key_offset);
		if (rc < 0) {
			snprintf(why, why_size, "cannot write a fetched chunk into the pool: %s",
				 zc_strerror(rc));
			break;
		}
		e->key_offset = key_offset;
		e->value_offset = pool_value_offset(key_offset, e->key_bytes);
		e->flags = 0;
	}
	if (rc < 0)
		for (size_t j = 0; j < written; j++)
			pool_unref(pool, entries[j].key_offset);
	return rc;
}

void prefix_records_free(void **records, size_t count)
{
	for (size_t j = 0; records && j < count; j++) {
		free(records[j]);
		records[j] = NULL;
	}
}
