/*
 * The reader protocol and client-side reconstruction (zipcache/reader.h):
 * a seqlock read side over the session map, block entries checked against
 * the mappings and the codec, and the codec run in the client's process.
 *
 * Everything the daemon writes while readers look is read with relaxed
 * atomic loads into the reader's own memory, and only that copy is
 * checked and used: a plain struct read could be split or repeated by the
 * compiler, and a value checked in shared memory may not be the value
 * used a moment later.
 */
#include "map_reader.h"

#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zipcache/client.h"

/* A daemon's write of a layer takes microseconds to milliseconds: yield
 * this many times before polling the clock every READ_POLL_NS. */
#define READ_SPINS 1000
#define READ_POLL_NS 1000000L

_Static_assert(sizeof(zc_map_header) % 8 == 0, "the map header is read in 64-bit words");
_Static_assert(sizeof(zc_map_block) % 8 == 0, "block entries are read in 64-bit words");
_Static_assert(sizeof(zc_pool_header) % 8 == 0, "the pool header is read in 64-bit words");

/* What the map says about itself, copied and checked once per call. */
struct geometry {
	zc_map_header h;           /* fixed part only (no layer array) */
	zc_codec_config codec;
	uint64_t heads;            /* batch * kv_heads */
	uint64_t data_offset;      /* first pool byte a block may occupy */
};

static int64_t clock_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* bytes (a multiple of 8) of shared memory at an 8-aligned address. */
static void shared_copy(void *to, const void *from, size_t bytes)
{
	const uint64_t *source = from;
	uint64_t words[64];

	while (bytes > 0) {
		size_t n = bytes / 8 < 64 ? bytes / 8 : 64;
		for (size_t i = 0; i < n; i++)
			words[i] = __atomic_load_n(&source[i], __ATOMIC_RELAXED);
		memcpy(to, words, n * 8);
		to = (uint8_t *)to + n * 8;
		source += n;
		bytes -= n * 8;
	}
}

/* a * b * c without overflow. */
static bool mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
	uint64_t ab;
	return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, out);
}

/* [offset, offset + count * stride) inside [0, limit). */
static bool regions_fit(uint64_t offset, uint64_t count, uint64_t stride, uint64_t limit)
{
	uint64_t bytes, end;
	return !__builtin_mul_overflow(count, stride, &bytes) &&
	       !__builtin_add_overflow(offset, bytes, &end) && end <= limit;
}

/* One region per layer of `stride` bytes holding a K part of key_bytes
 * (at least `key` bytes) and then a V part of at least `value` bytes. */
static bool kv_regions_fit(uint64_t offset, uint64_t stride, uint64_t key_bytes, uint64_t key,
			   uint64_t value, const zc_map_header *h)
{
	return offset != 0 && offset % 8 == 0 && stride % 8 == 0 && key_bytes % 8 == 0 &&
	       key_bytes >= key && key_bytes <= stride && stride - key_bytes >= value &&
	       regions_fit(offset, h->layers, stride, h->map_bytes);
}

static int geometry_get(const struct map_reader *reader, struct geometry *g)
{
	zc_map_header *h = &g->h;
	zc_pool_header pool;
	uint64_t key, value, table;

	if (!reader->map || !reader->pool || reader->map_bytes < sizeof(zc_map_header) ||
	    reader->pool_bytes < sizeof(zc_pool_header) || (uintptr_t)reader->map % 8 != 0 ||
	    (uintptr_t)reader->pool % 8 != 0)
		return ZC_EPROTOCOL;
	shared_copy(h, reader->map, sizeof(*h));
	if (memcmp(h->magic, ZC_MAP_MAGIC, sizeof(h->magic)) != 0 || h->version != ZC_MAP_VERSION ||
	    h->map_bytes != reader->map_bytes || h->pool_bytes != reader->pool_bytes ||
	    h->layers == 0 || h->batch == 0 || h->kv_heads == 0 || h->head_dim_k == 0 ||
	    h->head_dim_v == 0 || h->head_dim_k > ZC_MAX_HEAD_DIM || h->head_dim_v > ZC_MAX_HEAD_DIM ||
	    h->max_tokens == 0 || h->max_blocks > h->max_tokens ||
	    h->header_bytes > h->map_bytes ||
	    !regions_fit(sizeof(zc_map_header), h->layers, sizeof(zc_map_layer), h->header_bytes))
		return ZC_EPROTOCOL;
	g->codec = (zc_codec_config){ .hi_bits = h->hi_bits, .lo_bits = h->lo_bits,
				      .hi_fraction = h->hi_fraction, .group_size = h->group_size,
				      .quantize_values = h->quantize_values != 0 };
	if (zc_codec_config_validate(&g->codec) < 0 || h->quantize_values > 1)
		return ZC_EPROTOCOL;
	g->heads = (uint64_t)h->batch * h->kv_heads;
	table = h->max_blocks * sizeof(zc_map_block);
	if (h->table_offset < h->header_bytes || h->table_offset % 8 != 0 ||
	    h->table_bytes % 8 != 0 || h->table_bytes < table ||
	    !regions_fit(h->table_offset, h->layers, h->table_bytes, h->map_bytes))
		return ZC_EPROTOCOL;
	if (h->views == ZC_VIEWS_FULL) {
		if (!mul3(g->heads, h->max_tokens, (uint64_t)h->head_dim_k * 2, &key) ||
		    !mul3(g->heads, h->max_tokens, (uint64_t)h->head_dim_v * 2, &value) ||
		    !kv_regions_fit(h->views_offset, h->view_layer_bytes, h->key_view_bytes, key,
				    value, h))
			return ZC_EPROTOCOL;
	} else if (h->views == ZC_VIEWS_NONE) {
		if (h->residual_capacity > h->max_tokens ||
		    !mul3(g->heads, h->residual_capacity, (uint64_t)h->head_dim_k * 2, &key) ||
		    !mul3(g->heads, h->residual_capacity, (uint64_t)h->head_dim_v * 2, &value) ||
		    !kv_regions_fit(h->residual_offset, h->residual_bytes, h->key_residual_bytes, key,
				    value, h))
			return ZC_EPROTOCOL;
	} else {
		return ZC_EPROTOCOL;
	}
	shared_copy(&pool, reader->pool, sizeof(pool));
	if (memcmp(pool.magic, ZC_POOL_MAGIC, sizeof(pool.magic)) != 0 ||
	    pool.version != ZC_POOL_VERSION || pool.capacity < reader->pool_bytes ||
	    pool.data_offset < sizeof(pool) || pool.data_offset > reader->pool_bytes)
		return ZC_EPROTOCOL;
	g->data_offset = pool.data_offset;
	return 0;
}

static const zc_map_layer *layer_of(const struct map_reader *reader, uint32_t layer)
{
	return &reader->map->layer[layer];
}

/* The counts a read took, against the map's geometry: what keeps every
 * pointer derived from them in bounds, whatever a torn read saw. */
static int read_check(const struct geometry *g, const zc_read *read)
{
	const zc_map_header *h = &g->h;
	if (read->layer >= h->layers)
		return ZC_EINVALID;
	if (read->tokens > h->max_tokens || read->residual_tokens > read->tokens ||
	    read->blocks > h->max_blocks || read->blocks > read->tokens - read->residual_tokens ||
	    (read->blocks == 0 && read->residual_tokens != read->tokens) ||
	    (h->views == ZC_VIEWS_NONE && read->residual_tokens > h->residual_capacity))
		return ZC_EPROTOCOL;
	return 0;
}

int map_read_begin(const struct map_reader *reader, uint32_t layer, int timeout_ms,
		   zc_read *read)
{
	struct geometry g;
	int rc = geometry_get(reader, &g);
	if (rc < 0)
		return rc;
	if (layer >= g.h.layers || timeout_ms < 0)
		return ZC_EINVALID;
	const zc_map_layer *l = layer_of(reader, layer);
	int64_t deadline = clock_ms() + (timeout_ms ? timeout_ms : ZC_READ_TIMEOUT_MS);
	unsigned spins = 0;
	uint64_t sequence;

	while ((sequence = __atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE)) & 1) {
		if (++spins < READ_SPINS) {
			sched_yield();
			continue;
		}
		if (clock_ms() >= deadline)
			return -ETIMEDOUT;
		nanosleep(&(struct timespec){ 0, READ_POLL_NS }, NULL);
	}
	/* After the acquire load of an even sequence: these belong to the read. */
	*read = (zc_read){
		.layer = layer,
		.sequence = sequence,
		.generation = __atomic_load_n(&l->generation, __ATOMIC_RELAXED),
		.tokens = __atomic_load_n(&l->tokens, __ATOMIC_RELAXED),
		.residual_tokens = __atomic_load_n(&l->residual_tokens, __ATOMIC_RELAXED),
		.blocks = __atomic_load_n(&l->blocks, __ATOMIC_RELAXED),
		.view_valid = __atomic_load_n(&l->view_valid, __ATOMIC_RELAXED) != 0,
	};
	read->view = g.h.views == ZC_VIEWS_FULL && read->view_valid;
	return 0;
}

int map_read_end(const struct map_reader *reader, const zc_read *read)
{
	struct geometry g;
	int rc = geometry_get(reader, &g);
	if (rc < 0)
		return rc;
	if (read->layer >= g.h.layers)
		return ZC_EINVALID;
	const zc_map_layer *l = layer_of(reader, read->layer);
	/* Every load of the read happens before the sequence is read again. */
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	if (__atomic_load_n(&l->sequence, __ATOMIC_RELAXED) == read->sequence)
		return 0;
	if (read->view && (__atomic_load_n(&l->generation, __ATOMIC_RELAXED) != read->generation ||
			   !__atomic_load_n(&l->view_valid, __ATOMIC_RELAXED)))
		return ZC_ESTALE;
	return ZC_EAGAIN;
}

static zc_strides strides_of(const zc_map_header *h, uint32_t rows, uint32_t dim)
{
	return (zc_strides){ (size_t)h->kv_heads * rows * dim, (size_t)rows * dim, dim };
}

int map_layer_layout(const struct map_reader *reader, const zc_read *read,
		     zc_layer_contents *layout)
{
	struct geometry g;
	int rc = geometry_get(reader, &g);
	if (rc == 0)
		rc = read_check(&g, read);
	if (rc < 0)
		return rc;
	const zc_map_header *h = &g.h;
	const uint8_t *base = (const uint8_t *)reader->map;
	const uint16_t *keys, *values;
	zc_strides key_strides, value_strides;

	if (h->views == ZC_VIEWS_FULL) {
		/* The residual rows are the view's; a dropped view has none. */
		if (!read->view_valid && read->residual_tokens > 0)
			return ZC_ESTALE;
		size_t first = read->tokens - read->residual_tokens;
		const uint8_t *view = base + h->views_offset + (uint64_t)read->layer * h->view_layer_bytes;
		keys = (const uint16_t *)view + first * h->head_dim_k;
		values = (const uint16_t *)(view + h->key_view_bytes) + first * h->head_dim_v;
		key_strides = strides_of(h, h->max_tokens, h->head_dim_k);
		value_strides = strides_of(h, h->max_tokens, h->head_dim_v);
	} else {
		const uint8_t *residual = base + h->residual_offset +
					  (uint64_t)read->layer * h->residual_bytes;
		keys = (const uint16_t *)residual;
		values = (const uint16_t *)(residual + h->key_residual_bytes);
		key_strides = strides_of(h, h->residual_capacity, h->head_dim_k);
		value_strides = strides_of(h, h->residual_capacity, h->head_dim_v);
	}
	*layout = (zc_layer_contents){
		.layer = read->layer,
		.tokens = read->tokens,
		.residual_tokens = read->residual_tokens,
		.blocks = read->blocks,
		.views = h->views,
		.view_valid = read->view_valid,
		.residual_keys = keys,
		.residual_values = values,
		.key_strides = key_strides,
		.value_strides = value_strides,
	};
	return 0;
}

/* Whether [offset, offset + bytes) is block space of the pool mapping. */
static bool pool_range_ok(const struct geometry *g, uint64_t offset, uint64_t bytes)
{
	return offset >= g->data_offset && offset <= g->h.pool_bytes &&
	       bytes <= g->h.pool_bytes - offset;
}

/* The payload size the codec gives one tensor of a block of `tokens`. */
static int payload_bytes(const struct geometry *g, zc_tensor tensor, uint32_t tokens,
			 uint64_t *bytes)
{
	zc_block_shape shape = { g->h.batch, g->h.kv_heads, tokens,
				 tensor == ZC_TENSOR_KEYS ? g->h.head_dim_k : g->h.head_dim_v };
	zc_byte_count count;
	int rc = zc_block_count_bytes(&g->codec, tensor, &shape, &count);
	if (rc < 0)
		return rc;
	*bytes = count.compressed;
	return 0;
}

int map_layer_block(const struct map_reader *reader, const zc_read *read, uint32_t index,
		    zc_block *block)
{
	struct geometry g;
	int rc = geometry_get(reader, &g);
	if (rc == 0)
		rc = read_check(&g, read);
	if (rc < 0)
		return rc;
	if (index >= read->blocks)
		return ZC_EINVALID;
	const zc_map_header *h = &g.h;
	const zc_map_block *table =
		(const zc_map_block *)((const uint8_t *)reader->map + h->table_offset +
				       (uint64_t)read->layer * h->table_bytes);
	zc_map_block entry, next;
	uint64_t key_bytes, value_bytes;
	uint32_t end = read->tokens - read->residual_tokens;

	bool next_ok = true;

	shared_copy(&entry, &table[index], sizeof(entry));
	if (index + 1 < read->blocks) {
		shared_copy(&next, &table[index + 1], sizeof(next));
		next_ok = next.first_token < end;   /* the next block needs a valid row */
		end = next.first_token;
	}
	/* The tiling layer_recover() holds a durable layer to: block 0 at 0,
	 * each block's rows up to the next one's first token (or the residual),
	 * at least one and at most its own tokens. The entry's valid_tokens was
	 * written with it; trims cut the tail without rewriting committed
	 * entries, so the tiling is what decides, and it may only be less. */
	if (entry.tokens == 0 || entry.tokens > ZC_MAX_BLOCK_TOKENS || entry.flags != 0 ||
	    (uint64_t)entry.first_token + entry.tokens > h->max_tokens ||
	    (index == 0 && entry.first_token != 0) || !next_ok || end <= entry.first_token ||
	    end - entry.first_token > entry.tokens ||
	    entry.valid_tokens > entry.tokens || end - entry.first_token > entry.valid_tokens)
		return ZC_EPROTOCOL;
	if (payload_bytes(&g, ZC_TENSOR_KEYS, entry.tokens, &key_bytes) < 0 ||
	    payload_bytes(&g, ZC_TENSOR_VALUES, entry.tokens, &value_bytes) < 0 ||
	    entry.key_bytes != key_bytes || entry.value_bytes != value_bytes ||
	    !pool_range_ok(&g, entry.key_offset, entry.key_bytes) ||
	    !pool_range_ok(&g, entry.value_offset, entry.value_bytes))
		return ZC_EPROTOCOL;
	*block = (zc_block){
		.layer = read->layer,
		.index = index,
		.first_token = entry.first_token,
		.tokens = entry.tokens,
		.valid_tokens = end - entry.first_token,
		.key_shape = { h->batch, h->kv_heads, entry.tokens, h->head_dim_k },
		.value_shape = { h->batch, h->kv_heads, entry.tokens, h->head_dim_v },
		.key_payload = reader->pool + entry.key_offset,
		.value_payload = reader->pool + entry.value_offset,
		.key_bytes = entry.key_bytes,
		.value_bytes = entry.value_bytes,
		.key_offset = entry.key_offset,
		.value_offset = entry.value_offset,
	};
	return 0;
}

/* A zc_block as the caller hands it back: its payloads must still lie in
 * the pool mapping with the codec's sizes for its shape. */
static int block_check(const struct map_reader *reader, const struct geometry *g,
		       const zc_block *block)
{
	const zc_map_header *h = &g->h;
	uint64_t key_bytes, value_bytes;
	uintptr_t pool = (uintptr_t)reader->pool;

	if (block->tokens == 0 || block->tokens > ZC_MAX_BLOCK_TOKENS || block->valid_tokens == 0 ||
	    block->valid_tokens > block->tokens ||
	    memcmp(&block->key_shape, &(zc_block_shape){ h->batch, h->kv_heads, block->tokens,
							   h->head_dim_k }, sizeof(zc_block_shape)) ||
	    memcmp(&block->value_shape, &(zc_block_shape){ h->batch, h->kv_heads, block->tokens,
							     h->head_dim_v }, sizeof(zc_block_shape)) ||
	    (uintptr_t)block->key_payload < pool || (uintptr_t)block->value_payload < pool ||
	    payload_bytes(g, ZC_TENSOR_KEYS, block->tokens, &key_bytes) < 0 ||
	    payload_bytes(g, ZC_TENSOR_VALUES, block->tokens, &value_bytes) < 0 ||
	    block->key_bytes != key_bytes || block->value_bytes != value_bytes ||
	    !pool_range_ok(g, (uintptr_t)block->key_payload - pool, key_bytes) ||
	    !pool_range_ok(g, (uintptr_t)block->value_payload - pool, value_bytes))
		return ZC_EINVALID;
	return 0;
}

/* One tensor of a block: whole into out when every row is valid, else
 * head by head through scratch, the valid rows copied. */
static int tensor_reconstruct(const struct geometry *g, zc_tensor tensor, const zc_block *block,
			      uint16_t *out, const zc_strides *strides)
{
	const zc_block_shape *shape = tensor == ZC_TENSOR_KEYS ? &block->key_shape :
								 &block->value_shape;
	const uint8_t *payload = tensor == ZC_TENSOR_KEYS ? block->key_payload :
							    block->value_payload;
	uint64_t bytes = tensor == ZC_TENSOR_KEYS ? block->key_bytes : block->value_bytes;
	size_t dim = shape->head_dim;

	if (strides->token < dim)
		return ZC_EINVALID;
	if (block->valid_tokens == block->tokens)
		return zc_block_reconstruct(&g->codec, tensor, shape, payload, bytes, out, strides);

	zc_block_shape one = { 1, 1, block->tokens, shape->head_dim };
	size_t head_elements = (size_t)block->tokens * dim;
	zc_strides packed = { head_elements, head_elements, dim };
	uint64_t head_bytes = bytes / g->heads;   /* heads back to back, docs/CODEC.md */
	uint16_t *rows = malloc(head_elements * 2);
	int rc = 0;

	if (!rows)
		return -ENOMEM;
	for (uint64_t head = 0; rc == 0 && head < g->heads; head++) {
		rc = zc_block_reconstruct(&g->codec, tensor, &one, payload + head * head_bytes,
					  head_bytes, rows, &packed);
		if (rc < 0)
			break;
		uint16_t *to = out + (head / shape->heads) * strides->batch +
			       (head % shape->heads) * strides->head;
		if (strides->token == dim) {
			memcpy(to, rows, (size_t)block->valid_tokens * dim * 2);
			continue;
		}
		for (uint32_t t = 0; t < block->valid_tokens; t++)
			memcpy(to + t * strides->token, rows + t * dim, dim * 2);
	}
	free(rows);
	return rc;
}

int map_block_reconstruct_rows(const struct map_reader *reader, const zc_block *block,
			       uint16_t *keys_out, const zc_strides *key_strides,
			       uint16_t *values_out, const zc_strides *value_strides)
{
	struct geometry g;
	int rc = geometry_get(reader, &g);
	if (rc < 0)
		return rc;
	if ((keys_out && !key_strides) || (values_out && !value_strides))
		return ZC_EINVALID;
	rc = block_check(reader, &g, block);
	if (rc == 0 && keys_out)
		rc = tensor_reconstruct(&g, ZC_TENSOR_KEYS, block, keys_out, key_strides);
	if (rc == 0 && values_out)
		rc = tensor_reconstruct(&g, ZC_TENSOR_VALUES, block, values_out, value_strides);
	return rc;
}

/* Rows [0, rows) of every head of a strided fp16 buffer to row `at` of another. */
static void rows_copy(uint16_t *to, const zc_strides *to_strides, size_t at, const uint16_t *from,
		      const zc_strides *from_strides, const zc_map_header *h, uint32_t rows,
		      uint32_t dim)
{
	for (uint32_t b = 0; b < h->batch; b++)
		for (uint32_t head = 0; head < h->kv_heads; head++)
			for (uint32_t r = 0; r < rows; r++)
				memcpy(to + b * to_strides->batch + head * to_strides->head +
					       (at + r) * to_strides->token,
				       from + b * from_strides->batch + head * from_strides->head +
					       r * from_strides->token,
				       (size_t)dim * 2);
}

/* One attempt inside one read: the layer into the outputs. */
static int layer_read(const struct map_reader *reader, const zc_read *read, uint16_t *keys_out,
		      const zc_strides *key_strides, uint16_t *values_out,
		      const zc_strides *value_strides, uint32_t capacity)
{
	struct geometry g;
	zc_layer_contents layout;
	zc_block block;
	int rc = geometry_get(reader, &g);

	if (rc == 0)
		rc = map_layer_layout(reader, read, &layout);
	if (rc < 0)
		return rc;
	if (layout.tokens > capacity)
		return ZC_EBUFFER;
	if ((keys_out && key_strides->token < g.h.head_dim_k) ||
	    (values_out && value_strides->token < g.h.head_dim_v))
		return ZC_EINVALID;
	for (uint32_t i = 0; i < layout.blocks; i++) {
		rc = map_layer_block(reader, read, i, &block);
		if (rc < 0)
			return rc;
		rc = map_block_reconstruct_rows(
			reader, &block,
			keys_out ? keys_out + block.first_token * key_strides->token : NULL, key_strides,
			values_out ? values_out + block.first_token * value_strides->token : NULL,
			value_strides);
		if (rc < 0)
			return rc;
	}
	size_t first = layout.tokens - layout.residual_tokens;
	if (keys_out)
		rows_copy(keys_out, key_strides, first, layout.residual_keys, &layout.key_strides, &g.h,
			  layout.residual_tokens, g.h.head_dim_k);
	if (values_out)
		rows_copy(values_out, value_strides, first, layout.residual_values,
			  &layout.value_strides, &g.h, layout.residual_tokens, g.h.head_dim_v);
	return 0;
}

int map_layer_reconstruct(const struct map_reader *reader, uint32_t layer, uint16_t *keys_out,
			  const zc_strides *key_strides, uint16_t *values_out,
			  const zc_strides *value_strides, uint32_t capacity, uint32_t *tokens)
{
	int64_t deadline = clock_ms() + ZC_READ_TIMEOUT_MS;

	if ((keys_out && !key_strides) || (values_out && !value_strides) || !tokens)
		return ZC_EINVALID;
	for (;;) {
		int64_t left = deadline - clock_ms();
		zc_read read;
		int rc = map_read_begin(reader, layer, left > 0 ? (int)left : 1, &read);
		if (rc < 0)
			return rc;
		rc = layer_read(reader, &read, keys_out, key_strides, values_out, value_strides,
				capacity);
		int end = map_read_end(reader, &read);
		if (end == 0) {
			*tokens = read.tokens;
			return rc;
		}
		if (end != ZC_EAGAIN && end != ZC_ESTALE)
			return end;
		if (clock_ms() >= deadline)
			return end;
	}
}

/* ---- the public calls: the same over a session handle's mappings --------- */

static struct map_reader session_reader(const zc_session *session)
{
	const zc_map_header *map = zc_session_map(session);
	size_t pool_bytes = 0;
	const uint8_t *pool = zc_session_pool(session, &pool_bytes);
	/* client.c mapped exactly map_bytes of it, checked at open. */
	return (struct map_reader){ map, map ? __atomic_load_n(&map->map_bytes, __ATOMIC_RELAXED) : 0,
				    pool, pool_bytes };
}

int zc_read_begin(const zc_session *session, uint32_t layer, int timeout_ms, zc_read *read)
{
	struct map_reader reader = session_reader(session);
	return map_read_begin(&reader, layer, timeout_ms, read);
}

int zc_read_end(const zc_session *session, const zc_read *read)
{
	struct map_reader reader = session_reader(session);
	return map_read_end(&reader, read);
}

int zc_layer_layout(const zc_session *session, const zc_read *read, zc_layer_contents *layout)
{
	struct map_reader reader = session_reader(session);
	return map_layer_layout(&reader, read, layout);
}

int zc_layer_block(const zc_session *session, const zc_read *read, uint32_t index,
		   zc_block *block)
{
	struct map_reader reader = session_reader(session);
	return map_layer_block(&reader, read, index, block);
}

int zc_block_reconstruct_rows(const zc_session *session, const zc_block *block,
			      uint16_t *keys_out, const zc_strides *key_strides,
			      uint16_t *values_out, const zc_strides *value_strides)
{
	struct map_reader reader = session_reader(session);
	return map_block_reconstruct_rows(&reader, block, keys_out, key_strides, values_out,
					  value_strides);
}

int zc_layer_reconstruct(const zc_session *session, uint32_t layer, uint16_t *keys_out,
			 const zc_strides *key_strides, uint16_t *values_out,
			 const zc_strides *value_strides, uint32_t capacity, uint32_t *tokens)
{
	struct map_reader reader = session_reader(session);
	return map_layer_reconstruct(&reader, layer, keys_out, key_strides, values_out,
				     value_strides, capacity, tokens);
}

/* ---- struct layouts for bindings ------------------------------------------ */

#define SIZE_OF(type) { #type, NULL, sizeof(type) }
#define OFFSET_OF(type, field) { #type, #field, offsetof(type, field) }

static const struct {
	const char *type, *field;
	size_t value;
} layouts[] = {
	SIZE_OF(zc_read),
	OFFSET_OF(zc_read, layer), OFFSET_OF(zc_read, view), OFFSET_OF(zc_read, sequence),
	OFFSET_OF(zc_read, generation), OFFSET_OF(zc_read, tokens),
	OFFSET_OF(zc_read, residual_tokens), OFFSET_OF(zc_read, blocks),
	OFFSET_OF(zc_read, view_valid),
	SIZE_OF(zc_layer_contents),
	OFFSET_OF(zc_layer_contents, layer), OFFSET_OF(zc_layer_contents, tokens),
	OFFSET_OF(zc_layer_contents, residual_tokens), OFFSET_OF(zc_layer_contents, blocks),
	OFFSET_OF(zc_layer_contents, views), OFFSET_OF(zc_layer_contents, view_valid),
	OFFSET_OF(zc_layer_contents, residual_keys), OFFSET_OF(zc_layer_contents, residual_values),
	OFFSET_OF(zc_layer_contents, key_strides), OFFSET_OF(zc_layer_contents, value_strides),
	SIZE_OF(zc_block),
	OFFSET_OF(zc_block, layer), OFFSET_OF(zc_block, index), OFFSET_OF(zc_block, first_token),
	OFFSET_OF(zc_block, tokens), OFFSET_OF(zc_block, valid_tokens),
	OFFSET_OF(zc_block, key_shape), OFFSET_OF(zc_block, value_shape),
	OFFSET_OF(zc_block, key_payload), OFFSET_OF(zc_block, value_payload),
	OFFSET_OF(zc_block, key_bytes), OFFSET_OF(zc_block, value_bytes),
	OFFSET_OF(zc_block, key_offset), OFFSET_OF(zc_block, value_offset),
	SIZE_OF(zc_block_shape),
	OFFSET_OF(zc_block_shape, batch), OFFSET_OF(zc_block_shape, heads),
	OFFSET_OF(zc_block_shape, tokens), OFFSET_OF(zc_block_shape, head_dim),
	SIZE_OF(zc_strides),
	OFFSET_OF(zc_strides, batch), OFFSET_OF(zc_strides, head), OFFSET_OF(zc_strides, token),
	SIZE_OF(zc_map_block),
	OFFSET_OF(zc_map_block, first_token), OFFSET_OF(zc_map_block, tokens),
	OFFSET_OF(zc_map_block, valid_tokens), OFFSET_OF(zc_map_block, flags),
	OFFSET_OF(zc_map_block, key_offset), OFFSET_OF(zc_map_block, key_bytes),
	OFFSET_OF(zc_map_block, value_offset), OFFSET_OF(zc_map_block, value_bytes),
	SIZE_OF(zc_map_layer),
	OFFSET_OF(zc_map_layer, sequence), OFFSET_OF(zc_map_layer, generation),
	OFFSET_OF(zc_map_layer, tokens), OFFSET_OF(zc_map_layer, residual_tokens),
	OFFSET_OF(zc_map_layer, blocks), OFFSET_OF(zc_map_layer, view_valid),
	OFFSET_OF(zc_map_layer, key_compressed_bytes), OFFSET_OF(zc_map_layer, key_baseline_bytes),
	OFFSET_OF(zc_map_layer, value_compressed_bytes),
	OFFSET_OF(zc_map_layer, value_baseline_bytes),
	SIZE_OF(zc_map_header),
	OFFSET_OF(zc_map_header, magic), OFFSET_OF(zc_map_header, version),
	OFFSET_OF(zc_map_header, header_bytes), OFFSET_OF(zc_map_header, session_id),
	OFFSET_OF(zc_map_header, layers), OFFSET_OF(zc_map_header, batch),
	OFFSET_OF(zc_map_header, kv_heads), OFFSET_OF(zc_map_header, head_dim_k),
	OFFSET_OF(zc_map_header, head_dim_v), OFFSET_OF(zc_map_header, max_tokens),
	OFFSET_OF(zc_map_header, policy), OFFSET_OF(zc_map_header, residual_tokens),
	OFFSET_OF(zc_map_header, residual_capacity), OFFSET_OF(zc_map_header, views),
	OFFSET_OF(zc_map_header, hi_bits), OFFSET_OF(zc_map_header, lo_bits),
	OFFSET_OF(zc_map_header, hi_fraction), OFFSET_OF(zc_map_header, group_size),
	OFFSET_OF(zc_map_header, quantize_values), OFFSET_OF(zc_map_header, max_blocks),
	OFFSET_OF(zc_map_header, map_bytes), OFFSET_OF(zc_map_header, table_offset),
	OFFSET_OF(zc_map_header, table_bytes), OFFSET_OF(zc_map_header, residual_offset),
	OFFSET_OF(zc_map_header, residual_bytes), OFFSET_OF(zc_map_header, key_residual_bytes),
	OFFSET_OF(zc_map_header, views_offset), OFFSET_OF(zc_map_header, view_layer_bytes),
	OFFSET_OF(zc_map_header, key_view_bytes), OFFSET_OF(zc_map_header, pool_bytes),
	OFFSET_OF(zc_map_header, reserved), OFFSET_OF(zc_map_header, layer),
	SIZE_OF(zc_session_config),
	OFFSET_OF(zc_session_config, name), OFFSET_OF(zc_session_config, layers),
	OFFSET_OF(zc_session_config, batch), OFFSET_OF(zc_session_config, kv_heads),
	OFFSET_OF(zc_session_config, head_dim_k), OFFSET_OF(zc_session_config, head_dim_v),
	OFFSET_OF(zc_session_config, max_tokens), OFFSET_OF(zc_session_config, codec),
	OFFSET_OF(zc_session_config, policy), OFFSET_OF(zc_session_config, residual_tokens),
	OFFSET_OF(zc_session_config, attach), OFFSET_OF(zc_session_config, views),
	OFFSET_OF(zc_session_config, model_id), OFFSET_OF(zc_session_config, prefix),
	OFFSET_OF(zc_session_config, prefix_chunks),
	SIZE_OF(zc_prefix_held),
	OFFSET_OF(zc_prefix_held, chunks), OFFSET_OF(zc_prefix_held, tokens),
	OFFSET_OF(zc_prefix_held, local_chunks),
	SIZE_OF(zc_session_info),
	OFFSET_OF(zc_session_info, id), OFFSET_OF(zc_session_info, name),
	OFFSET_OF(zc_session_info, layers), OFFSET_OF(zc_session_info, batch),
	OFFSET_OF(zc_session_info, kv_heads), OFFSET_OF(zc_session_info, head_dim_k),
	OFFSET_OF(zc_session_info, head_dim_v), OFFSET_OF(zc_session_info, max_tokens),
	OFFSET_OF(zc_session_info, codec), OFFSET_OF(zc_session_info, policy),
	OFFSET_OF(zc_session_info, residual_tokens), OFFSET_OF(zc_session_info, min_tokens),
	OFFSET_OF(zc_session_info, max_layer_tokens), OFFSET_OF(zc_session_info, idle_ms),
	OFFSET_OF(zc_session_info, views), OFFSET_OF(zc_session_info, shared_bytes),
	OFFSET_OF(zc_session_info, leased), OFFSET_OF(zc_session_info, model_id),
	SIZE_OF(zc_server_info),
	OFFSET_OF(zc_server_info, protocol_version), OFFSET_OF(zc_server_info, server_version),
	OFFSET_OF(zc_server_info, boot_epoch), OFFSET_OF(zc_server_info, max_frame_bytes),
	OFFSET_OF(zc_server_info, max_inline_bytes), OFFSET_OF(zc_server_info, max_sessions),
	OFFSET_OF(zc_server_info, max_tokens_per_session),
	OFFSET_OF(zc_server_info, memory_budget_bytes), OFFSET_OF(zc_server_info, lease_ms),
	OFFSET_OF(zc_server_info, max_ring_bytes),
	SIZE_OF(zc_view),
	OFFSET_OF(zc_view, keys), OFFSET_OF(zc_view, values), OFFSET_OF(zc_view, tokens),
	OFFSET_OF(zc_view, batch), OFFSET_OF(zc_view, kv_heads), OFFSET_OF(zc_view, head_dim_k),
	OFFSET_OF(zc_view, head_dim_v), OFFSET_OF(zc_view, max_tokens),
	OFFSET_OF(zc_view, key_strides), OFFSET_OF(zc_view, value_strides),
	OFFSET_OF(zc_view, sequence),
	SIZE_OF(zc_pool_header),
	OFFSET_OF(zc_pool_header, magic), OFFSET_OF(zc_pool_header, version),
	OFFSET_OF(zc_pool_header, owner_uid), OFFSET_OF(zc_pool_header, capacity),
	OFFSET_OF(zc_pool_header, data_offset),
};

size_t zc_reader_layout_of(const char *struct_name, const char *field)
{
	if (!struct_name)
		return SIZE_MAX;
	for (size_t i = 0; i < sizeof(layouts) / sizeof(layouts[0]); i++)
		if (strcmp(layouts[i].type, struct_name) == 0 &&
		    (field ? layouts[i].field && strcmp(layouts[i].field, field) == 0 :
			     !layouts[i].field))
			return layouts[i].value;
	return SIZE_MAX;
}
