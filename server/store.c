/*
 * One session's store in a sparse shared-memory file: create or adopt it,
 * append blocks, trim, count bytes, drop and rebuild views. The numerics
 * are the codec's; this file decides where bytes go and in which order
 * they become visible (see store_format.h).
 */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

#define PAGE_BYTES 4096u

/* Views are reserved this many tokens ahead: one fallocate per head
 * every 256 decode steps instead of one per step. */
#define VIEW_RESERVE_TOKENS 256u

/* Arenas grow geometrically between these steps: a short session costs
 * little, a long one few fallocate calls. */
#define ARENA_RESERVE_MIN_BYTES (64u << 10)
#define ARENA_RESERVE_MAX_BYTES (1u << 20)

/* Worst-case compressed bytes per token per head is below 5*D + 3 (one-row
 * groups: 4*D of params, up to D of codes, a mask byte); twice that leaves
 * room for the dead tails of blocks cut by trim. */
#define ARENA_TOKEN_FACTOR 2u

struct store {
	struct store_budget *budget;
	uint64_t charged;         /* bytes of budget.used that are this file's */
	int fd;
	uint8_t *base;
	size_t file_bytes;
	struct store_header *header;
	zc_codec_config codec;
	char path[4096];
};

static uint64_t round_up(uint64_t value, uint64_t unit)
{
	return (value + unit - 1) / unit * unit;
}

static uint64_t heads_of(const struct store_header *h)
{
	return (uint64_t)h->batch * h->kv_heads;
}

static uint64_t view_bytes(const struct store_header *h, uint32_t dim)
{
	return round_up(heads_of(h) * h->max_tokens * dim * 2, PAGE_BYTES);
}

uint64_t store_key_view_offset(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	return h->header_bytes + layer * (view_bytes(h, h->head_dim_k) + view_bytes(h, h->head_dim_v));
}

uint64_t store_value_view_offset(const struct store *store, uint32_t layer)
{
	return store_key_view_offset(store, layer) + view_bytes(store->header, store->header->head_dim_k);
}

static uint8_t *layer_region(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	return store->base + h->views_bytes + (uint64_t)layer * h->layer_region_bytes;
}

static struct store_block *layer_index(const struct store *store, uint32_t layer)
{
	return (struct store_block *)(layer_region(store, layer) + store->header->index_offset);
}

static uint16_t *key_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->base + store_key_view_offset(store, layer));
}

static uint16_t *value_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->base + store_value_view_offset(store, layer));
}

static zc_strides view_strides(const struct store_header *h, uint32_t dim)
{
	return (zc_strides){
		.batch = (size_t)h->kv_heads * h->max_tokens * dim,
		.head = (size_t)h->max_tokens * dim,
		.token = dim,
	};
}

static zc_strides residual_strides(const struct store_header *h, uint32_t dim)
{
	return (zc_strides){
		.batch = (size_t)h->kv_heads * h->residual_capacity * dim,
		.head = (size_t)h->residual_capacity * dim,
		.token = dim,
	};
}

static zc_codec_config header_codec(const struct store_header *h)
{
	return (zc_codec_config){
		.hi_bits = h->hi_bits,
		.lo_bits = h->lo_bits,
		.hi_fraction = h->hi_fraction,
		.group_size = h->group_size,
		.quantize_values = h->quantize_values != 0,
	};
}

static uint64_t view_rebuilds;

uint64_t store_view_rebuilds_total(void)
{
	return __atomic_load_n(&view_rebuilds, __ATOMIC_RELAXED);
}

static uint64_t file_allocated(const struct store *store)
{
	struct stat st;
	return fstat(store->fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

/* Takes `bytes` of the budget, or fails without taking any. */
static int budget_take(struct store_budget *budget, uint64_t bytes)
{
	if (!budget)
		return 0;
	uint64_t used = __atomic_load_n(&budget->used, __ATOMIC_RELAXED);
	do {
		if (budget->limit && used + bytes > budget->limit)
			return STORE_EBUDGET;
	} while (!__atomic_compare_exchange_n(&budget->used, &used, used + bytes, true,
					      __ATOMIC_RELAXED, __ATOMIC_RELAXED));
	return 0;
}

static void budget_give(struct store_budget *budget, uint64_t bytes)
{
	if (budget)
		__atomic_fetch_sub(&budget->used, bytes, __ATOMIC_RELAXED);
}

/* Makes pages real before they are written, so that a full tmpfs is an
 * error we can report instead of a SIGBUS on the next store. The budget
 * is charged what the file really grew by (a range may overlap pages
 * that exist already). */
static int reserve_range(struct store *store, uint64_t offset, uint64_t bytes)
{
	if (bytes == 0)
		return 0;
	uint64_t start = offset / PAGE_BYTES * PAGE_BYTES;
	uint64_t end = round_up(offset + bytes, PAGE_BYTES);
	int rc = budget_take(store->budget, end - start);
	if (rc < 0)
		return rc;
	uint64_t before = file_allocated(store);
	if (fallocate(store->fd, 0, (off_t)start, (off_t)(end - start)) < 0) {
		int err = errno;
		budget_give(store->budget, end - start);
		log_warn("store", "fallocate failed", "path=%s offset=%llu bytes=%llu error=%s",
			 store->path, (unsigned long long)start,
			 (unsigned long long)(end - start), strerror(err));
		return err == ENOSPC || err == ENOMEM ? ZC_EEXHAUSTED : -err;
	}
	uint64_t grown = file_allocated(store) - before;
	if (grown > end - start)
		grown = end - start;
	budget_give(store->budget, end - start - grown);
	store->charged += grown;
	return 0;
}

/* Reserves each head's slice of tokens [from, to) in both views of a layer. */
static int reserve_view_tokens(struct store *store, uint32_t layer, uint64_t from, uint64_t to)
{
	const struct store_header *h = store->header;
	uint64_t heads = heads_of(h);
	for (int tensor = 0; tensor < 2; tensor++) {
		uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
		uint64_t view = tensor == 0 ? store_key_view_offset(store, layer) :
					      store_value_view_offset(store, layer);
		for (uint64_t head = 0; head < heads; head++) {
			uint64_t head_start = view + head * h->max_tokens * dim * 2;
			int rc = reserve_range(store, head_start + from * dim * 2, (to - from) * dim * 2);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

static int reserve_views(struct store *store, uint32_t layer, uint64_t tokens_needed)
{
	struct store_layer_header *l = &store->header->layer[layer];
	if (tokens_needed <= l->reserved_view_tokens)
		return 0;
	uint64_t target = tokens_needed + VIEW_RESERVE_TOKENS;
	if (target > store->header->max_tokens)
		target = store->header->max_tokens;
	int rc = reserve_view_tokens(store, layer, l->reserved_view_tokens, target);
	if (rc < 0)
		return rc;
	l->reserved_view_tokens = target;
	return 0;
}

static int reserve_arena(struct store *store, uint32_t layer, bool keys, uint64_t bytes_needed)
{
	const struct store_header *h = store->header;
	struct store_layer_header *l = &store->header->layer[layer];
	uint64_t *reserved = keys ? &l->reserved_key_arena : &l->reserved_value_arena;
	uint64_t capacity = keys ? h->key_arena_bytes : h->value_arena_bytes;
	uint64_t arena = (uint64_t)(layer_region(store, layer) - store->base) +
			 (keys ? h->key_arena_offset : h->value_arena_offset);

	if (bytes_needed > capacity)
		return ZC_EEXHAUSTED;
	if (bytes_needed <= *reserved)
		return 0;
	uint64_t step = *reserved;
	if (step < ARENA_RESERVE_MIN_BYTES)
		step = ARENA_RESERVE_MIN_BYTES;
	if (step > ARENA_RESERVE_MAX_BYTES)
		step = ARENA_RESERVE_MAX_BYTES;
	uint64_t target = *reserved + step > bytes_needed ? *reserved + step : bytes_needed;
	if (target > capacity)
		target = capacity;
	int rc = reserve_range(store, arena + *reserved, target - *reserved);
	if (rc < 0)
		return rc;
	*reserved = target;
	return 0;
}

/* The residual is small and used at once; reserve it on a layer's first write. */
static int reserve_residual(struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	uint64_t region = (uint64_t)(layer_region(store, layer) - store->base);
	return reserve_range(store, region, h->index_offset);
}

/* Index pages are reserved one at a time, as entries reach them. */
static int reserve_index_entry(struct store *store, uint32_t layer, uint32_t entry)
{
	uint64_t entry_bytes = sizeof(struct store_block);
	uint64_t start = entry * entry_bytes;
	if (entry > 0 && start / PAGE_BYTES == (start - 1) / PAGE_BYTES &&
	    (start + entry_bytes - 1) / PAGE_BYTES == start / PAGE_BYTES)
		return 0;
	uint64_t index = (uint64_t)(layer_region(store, layer) - store->base) +
			 store->header->index_offset;
	return reserve_range(store, index + start, entry_bytes);
}

static void sequence_begin(struct store_layer_header *l)
{
	__atomic_store_n(&l->sequence, l->sequence + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}

static void sequence_end(struct store_layer_header *l)
{
	__atomic_store_n(&l->sequence, l->sequence + 1, __ATOMIC_RELEASE);
}

static int params_validate(const struct store_params *p)
{
	int rc = zc_codec_config_validate(&p->codec);
	if (rc < 0)
		return rc;
	if (p->layers == 0 || p->layers > 1024 || p->batch == 0 || p->kv_heads == 0 ||
	    p->head_dim_k == 0 || p->head_dim_v == 0 || p->max_tokens == 0)
		return ZC_ESHAPE;
	if (p->head_dim_k > ZC_MAX_HEAD_DIM || p->head_dim_v > ZC_MAX_HEAD_DIM ||
	    (uint64_t)p->batch * p->kv_heads > 65536 || p->max_tokens > ZC_MAX_BLOCK_TOKENS)
		return ZC_ESHAPE;
	if (p->policy != STORE_POLICY_STREAMING && p->policy != STORE_POLICY_PER_CALL)
		return ZC_EINVALID;
	if (p->policy == STORE_POLICY_STREAMING &&
	    (p->residual_tokens == 0 || p->residual_tokens > 65536))
		return ZC_EINVALID;
	if (!p->name || strlen(p->name) >= STORE_NAME_BYTES)
		return ZC_EINVALID;
	return 0;
}

/* Fills in every size and offset of a new header from its shape. */
static int header_layout(struct store_header *h)
{
	uint64_t heads = heads_of(h);
	uint64_t header_bytes = round_up(sizeof(*h) + h->layers * sizeof(h->layer[0]), PAGE_BYTES);
	uint64_t views = h->layers * (view_bytes(h, h->head_dim_k) + view_bytes(h, h->head_dim_v));

	h->header_bytes = (uint32_t)header_bytes;
	h->views_bytes = header_bytes + views;
	h->max_blocks = h->max_tokens;

	uint64_t offset = 0;
	h->key_residual_offset = offset;
	offset += round_up(heads * h->residual_capacity * h->head_dim_k * 2, PAGE_BYTES);
	h->value_residual_offset = offset;
	offset += round_up(heads * h->residual_capacity * h->head_dim_v * 2, PAGE_BYTES);
	h->index_offset = offset;
	offset += round_up(h->max_blocks * sizeof(struct store_block), PAGE_BYTES);
	h->key_arena_offset = offset;
	h->key_arena_bytes = round_up(ARENA_TOKEN_FACTOR * heads * h->max_tokens *
					      (5ull * h->head_dim_k + 3), PAGE_BYTES);
	offset += h->key_arena_bytes;
	h->value_arena_offset = offset;
	h->value_arena_bytes = round_up(ARENA_TOKEN_FACTOR * heads * h->max_tokens *
						(5ull * h->head_dim_v + 3), PAGE_BYTES);
	offset += h->value_arena_bytes;
	h->layer_region_bytes = offset;
	h->file_bytes = h->views_bytes + h->layers * offset;
	/* Sparse, but the address space and tmpfs still have limits. */
	if (h->file_bytes > (UINT64_C(1) << 44))
		return ZC_EEXHAUSTED;
	return 0;
}

static int store_map(struct store *store, size_t bytes)
{
	void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, store->fd, 0);
	if (base == MAP_FAILED)
		return -errno;
	store->base = base;
	store->file_bytes = bytes;
	store->header = base;
	return 0;
}

int store_create(const char *dir, const struct store_params *params,
		 struct store_budget *budget, struct store **out)
{
	struct store_header layout = { 0 };
	struct store *store;
	int rc = params_validate(params);

	if (rc < 0)
		return rc;
	layout.layers = params->layers;
	layout.batch = params->batch;
	layout.kv_heads = params->kv_heads;
	layout.head_dim_k = params->head_dim_k;
	layout.head_dim_v = params->head_dim_v;
	layout.max_tokens = params->max_tokens;
	layout.policy = (uint32_t)params->policy;
	layout.residual_tokens = params->policy == STORE_POLICY_STREAMING ? params->residual_tokens : 0;
	/* A residual below R tokens plus a block below R never reaches 2R. */
	layout.residual_capacity = 2 * layout.residual_tokens;
	if (layout.residual_capacity > layout.max_tokens)
		layout.residual_capacity = layout.max_tokens;
	rc = header_layout(&layout);
	if (rc < 0)
		return rc;

	store = calloc(1, sizeof(*store));
	if (!store)
		return -ENOMEM;
	store->budget = budget;
	snprintf(store->path, sizeof(store->path), "%s/session-%016llx.zcs", dir,
		 (unsigned long long)params->session_id);
	store->fd = open(store->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (store->fd < 0) {
		rc = -errno;
		goto out_free;
	}
	if (ftruncate(store->fd, (off_t)layout.file_bytes) < 0) {
		rc = -errno;
		goto out_unlink;
	}
	rc = reserve_range(store, 0, layout.header_bytes);
	if (rc < 0)
		goto out_unlink;
	rc = store_map(store, layout.file_bytes);
	if (rc < 0)
		goto out_unlink;

	struct store_header *h = store->header;
	memcpy(h, &layout, sizeof(layout));
	h->version = STORE_VERSION;
	h->session_id = params->session_id;
	h->created_epoch = params->boot_epoch;
	h->owner_uid = params->owner_uid;
	h->hi_bits = params->codec.hi_bits;
	h->lo_bits = params->codec.lo_bits;
	h->hi_fraction = params->codec.hi_fraction;
	h->group_size = params->codec.group_size;
	h->quantize_values = params->codec.quantize_values;
	snprintf(h->name, sizeof(h->name), "%s", params->name);
	for (uint32_t i = 0; i < h->layers; i++)
		h->layer[i].view_valid = 1;
	store->codec = params->codec;
	/* The magic goes in last: a file without it was never finished. */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	memcpy(h->magic, STORE_MAGIC, sizeof(h->magic));
	*out = store;
	return 0;

out_unlink:
	budget_give(store->budget, store->charged);
	unlink(store->path);
	close(store->fd);
out_free:
	free(store);
	return rc;
}

/* Everything a reader would trust in a header found on disk. */
static int header_check(const struct store_header *h, uint64_t file_bytes)
{
	struct store_header expected = { 0 };

	if (memcmp(h->magic, STORE_MAGIC, sizeof(h->magic)) != 0 || h->version != STORE_VERSION)
		return ZC_ECORRUPT;
	expected.layers = h->layers;
	expected.batch = h->batch;
	expected.kv_heads = h->kv_heads;
	expected.head_dim_k = h->head_dim_k;
	expected.head_dim_v = h->head_dim_v;
	expected.max_tokens = h->max_tokens;
	expected.residual_capacity = h->residual_capacity;
	if (h->layers == 0 || h->layers > 1024 || h->batch == 0 || h->kv_heads == 0 ||
	    h->head_dim_k == 0 || h->head_dim_k > ZC_MAX_HEAD_DIM || h->head_dim_v == 0 ||
	    h->head_dim_v > ZC_MAX_HEAD_DIM || h->max_tokens == 0 ||
	    h->max_tokens > ZC_MAX_BLOCK_TOKENS || (uint64_t)h->batch * h->kv_heads > 65536 ||
	    h->residual_capacity > h->max_tokens)
		return ZC_ECORRUPT;
	if (header_layout(&expected) < 0 || expected.file_bytes != h->file_bytes ||
	    expected.file_bytes != file_bytes || expected.header_bytes != h->header_bytes ||
	    expected.views_bytes != h->views_bytes ||
	    expected.layer_region_bytes != h->layer_region_bytes)
		return ZC_ECORRUPT;
	zc_codec_config codec = header_codec(h);
	if (zc_codec_config_validate(&codec) < 0 || h->name[STORE_NAME_BYTES - 1] != '\0')
		return ZC_ECORRUPT;
	for (uint32_t i = 0; i < h->layers; i++) {
		const struct store_layer_header *l = &h->layer[i];
		if (l->tokens > h->max_tokens || l->blocks > h->max_blocks)
			return ZC_ECORRUPT;
	}
	return 0;
}

/*
 * After a crash, `tokens` is the commit point: a block appended by an
 * update that never published its tokens is dropped, a residual count
 * that ran ahead is cut back, and the arena marks and byte totals are
 * recomputed from the blocks that remain. Entries must tile the sequence
 * and stay inside the arenas, or the file is corrupt.
 */
static int layer_recover(struct store *store, uint32_t layer)
{
	struct store_header *h = store->header;
	struct store_layer_header *l = &h->layer[layer];
	struct store_block *index = layer_index(store, layer);
	uint64_t next_token = 0, key_end = 0, value_end = 0;
	uint64_t totals[4] = { 0 };
	uint32_t kept = 0;

	for (uint32_t i = 0; i < l->blocks; i++) {
		struct store_block *b = &index[i];
		zc_block_shape key_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_v };
		zc_byte_count key_bytes, value_bytes;
		if (b->first_token >= l->tokens)
			break;
		if (b->first_token != next_token || b->valid_tokens == 0 ||
		    b->valid_tokens > b->tokens || b->key_offset != key_end ||
		    b->value_offset != value_end)
			return ZC_ECORRUPT;
		if (zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_bytes) < 0 ||
		    zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_bytes) < 0 ||
		    key_bytes.compressed != b->key_bytes || value_bytes.compressed != b->value_bytes ||
		    key_end + b->key_bytes > h->key_arena_bytes ||
		    value_end + b->value_bytes > h->value_arena_bytes)
			return ZC_ECORRUPT;
		if (b->first_token + b->valid_tokens > l->tokens)
			b->valid_tokens = l->tokens - b->first_token;
		next_token += b->valid_tokens;
		key_end += b->key_bytes;
		value_end += b->value_bytes;
		totals[0] += key_bytes.compressed;
		totals[1] += key_bytes.baseline;
		totals[2] += value_bytes.compressed;
		totals[3] += value_bytes.baseline;
		kept++;
	}
	if (l->tokens - next_token > h->residual_capacity)
		return ZC_ECORRUPT;
	l->blocks = kept;
	l->residual_tokens = (uint32_t)(l->tokens - next_token);
	l->key_arena_used = key_end;
	l->value_arena_used = value_end;
	l->key_compressed_bytes = totals[0];
	l->key_baseline_bytes = totals[1];
	l->value_compressed_bytes = totals[2];
	l->value_baseline_bytes = totals[3];
	if (l->reserved_key_arena > h->key_arena_bytes)
		l->reserved_key_arena = h->key_arena_bytes;
	if (l->reserved_value_arena > h->value_arena_bytes)
		l->reserved_value_arena = h->value_arena_bytes;
	if (l->reserved_view_tokens > h->max_tokens)
		l->reserved_view_tokens = h->max_tokens;
	return 0;
}

int store_adopt(const char *path, struct store_budget *budget, struct store **out)
{
	struct stat st;
	struct store *store = calloc(1, sizeof(*store));
	int rc;

	if (!store)
		return -ENOMEM;
	snprintf(store->path, sizeof(store->path), "%s", path);
	store->fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (store->fd < 0) {
		rc = -errno;
		goto out_free;
	}
	if (fstat(store->fd, &st) < 0) {
		rc = -errno;
		goto out_close;
	}
	if ((uint64_t)st.st_size < sizeof(struct store_header)) {
		rc = ZC_ECORRUPT;
		goto out_close;
	}
	rc = store_map(store, (size_t)st.st_size);
	if (rc < 0)
		goto out_close;
	rc = header_check(store->header, (uint64_t)st.st_size);
	if (rc < 0)
		goto out_unmap;
	store->codec = header_codec(store->header);
	for (uint32_t i = 0; rc == 0 && i < store->header->layers; i++)
		rc = layer_recover(store, i);
	if (rc < 0)
		goto out_unmap;
	for (uint32_t i = 0; i < store->header->layers; i++) {
		struct store_layer_header *l = &store->header->layer[i];
		/* A writer killed mid-update left the sequence odd; whatever it
		 * did not publish (tokens) is not part of the sequence, and the
		 * view is rebuilt from what was. */
		if (l->sequence & 1)
			l->sequence++;
		l->view_valid = 0;
	}
	/* What an adopted file holds counts, even past the budget: refusing
	 * it would lose acknowledged tokens. New reservations then wait
	 * until views are dropped or sessions close. */
	store->budget = budget;
	store->charged = file_allocated(store);
	if (budget)
		__atomic_fetch_add(&budget->used, store->charged, __ATOMIC_RELAXED);
	*out = store;
	return 0;

out_unmap:
	munmap(store->base, store->file_bytes);
out_close:
	close(store->fd);
out_free:
	free(store);
	return rc;
}

void store_close(struct store *store, bool remove_file)
{
	if (!store)
		return;
	budget_give(store->budget, store->charged);
	munmap(store->base, store->file_bytes);
	close(store->fd);
	if (remove_file)
		unlink(store->path);
	free(store);
}

const struct store_header *store_header(const struct store *store)
{
	return store->header;
}

const char *store_path(const struct store *store)
{
	return store->path;
}

int store_open_readonly(const struct store *store)
{
	char proc_path[64];
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", store->fd);
	/* A new open file description, read-only: the client cannot get
	 * PROT_WRITE on a MAP_SHARED mapping of it, nor truncate the file. */
	int fd = open(proc_path, O_RDONLY | O_CLOEXEC);
	return fd < 0 ? -errno : fd;
}

uint64_t store_memory_bytes(const struct store *store)
{
	return file_allocated(store);
}

uint64_t store_rebuild_bytes(const struct store *store)
{
	const struct store_header *h = store->header;
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < h->layers; i++) {
		if (h->layer[i].view_valid)
			continue;
		uint64_t tokens = h->layer[i].tokens + VIEW_RESERVE_TOKENS;
		bytes += heads_of(h) * tokens * (h->head_dim_k + h->head_dim_v) * 2;
	}
	return bytes;
}

/* Compresses a [B, H, tokens, D] block (keys and values, each with its
 * own strides) into the arenas, reconstructs it into the views at
 * first_token and publishes it in the index. Nothing is visible until
 * both tensors have compressed. */
static int block_append(struct store *store, uint32_t layer, uint32_t first_token,
			uint32_t tokens, const uint16_t *keys, const zc_strides *key_strides,
			const uint16_t *values, const zc_strides *value_strides)
{
	struct store_header *h = store->header;
	struct store_layer_header *l = &h->layer[layer];
	zc_block_shape key_shape = { h->batch, h->kv_heads, tokens, h->head_dim_k };
	zc_block_shape value_shape = { h->batch, h->kv_heads, tokens, h->head_dim_v };
	zc_byte_count key_count, value_count;
	uint8_t *region = layer_region(store, layer);
	int rc;

	if (l->blocks >= h->max_blocks)
		return ZC_EEXHAUSTED;
	rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
	if (rc == 0)
		rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
	if (rc == 0)
		rc = reserve_index_entry(store, layer, l->blocks);
	if (rc == 0)
		rc = reserve_arena(store, layer, true, l->key_arena_used + key_count.compressed);
	if (rc == 0)
		rc = reserve_arena(store, layer, false, l->value_arena_used + value_count.compressed);
	if (rc < 0)
		return rc;

	uint8_t *key_out = region + h->key_arena_offset + l->key_arena_used;
	uint8_t *value_out = region + h->value_arena_offset + l->value_arena_used;
	int64_t written = zc_block_compress_strided(&store->codec, ZC_TENSOR_KEYS, &key_shape, keys,
						    key_strides, key_out, key_count.compressed);
	if (written < 0)
		return (int)written;
	written = zc_block_compress_strided(&store->codec, ZC_TENSOR_VALUES, &value_shape, values,
					    value_strides, value_out, value_count.compressed);
	if (written < 0)
		return (int)written;

	zc_strides key_view_strides = view_strides(h, h->head_dim_k);
	zc_strides value_view_strides = view_strides(h, h->head_dim_v);
	rc = zc_block_reconstruct(&store->codec, ZC_TENSOR_KEYS, &key_shape, key_out,
				  key_count.compressed,
				  key_view(store, layer) + (size_t)first_token * h->head_dim_k,
				  &key_view_strides);
	if (rc == 0)
		rc = zc_block_reconstruct(&store->codec, ZC_TENSOR_VALUES, &value_shape, value_out,
					  value_count.compressed,
					  value_view(store, layer) + (size_t)first_token * h->head_dim_v,
					  &value_view_strides);
	if (rc < 0)
		return rc;

	layer_index(store, layer)[l->blocks] = (struct store_block){
		.first_token = first_token,
		.tokens = tokens,
		.valid_tokens = tokens,
		.key_offset = l->key_arena_used,
		.key_bytes = key_count.compressed,
		.value_offset = l->value_arena_used,
		.value_bytes = value_count.compressed,
	};
	l->key_arena_used += key_count.compressed;
	l->value_arena_used += value_count.compressed;
	l->key_compressed_bytes += key_count.compressed;
	l->key_baseline_bytes += key_count.baseline;
	l->value_compressed_bytes += value_count.compressed;
	l->value_baseline_bytes += value_count.baseline;
	__atomic_store_n(&l->blocks, l->blocks + 1, __ATOMIC_RELEASE);
	return 0;
}

static uint16_t *key_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->key_residual_offset);
}

static uint16_t *value_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->value_residual_offset);
}

/* Compresses the whole residual as one block; its view rows are rewritten
 * with the reconstruction. On failure the residual stays as it was. */
static int residual_flush(struct store *store, uint32_t layer)
{
	struct store_header *h = store->header;
	struct store_layer_header *l = &h->layer[layer];
	if (l->residual_tokens == 0)
		return 0;
	zc_strides key_strides = residual_strides(h, h->head_dim_k);
	zc_strides value_strides = residual_strides(h, h->head_dim_v);
	int rc = block_append(store, layer, l->tokens - l->residual_tokens, l->residual_tokens,
			      key_residual(store, layer), &key_strides, value_residual(store, layer),
			      &value_strides);
	if (rc == 0)
		l->residual_tokens = 0;
	return rc;
}

/* Copies a contiguous [B, H, tokens, D] block into a strided buffer at row `at`. */
static void rows_copy(uint16_t *target, const zc_strides *strides, size_t at, const uint16_t *block,
		      const struct store_header *h, uint32_t tokens, uint32_t dim)
{
	size_t head_elements = (size_t)tokens * dim;
	for (uint32_t b = 0; b < h->batch; b++) {
		for (uint32_t head = 0; head < h->kv_heads; head++) {
			const uint16_t *from = block + ((size_t)b * h->kv_heads + head) * head_elements;
			uint16_t *to = target + b * strides->batch + head * strides->head + at * dim;
			memcpy(to, from, head_elements * 2);
		}
	}
}

static int views_rebuild_layer(struct store *store, uint32_t layer);

int store_update(struct store *store, uint32_t layer, uint32_t tokens,
		 const uint16_t *keys, const uint16_t *values)
{
	struct store_header *h = store->header;
	int rc;

	if (layer >= h->layers || tokens == 0)
		return ZC_EINVALID;
	struct store_layer_header *l = &h->layer[layer];
	if ((uint64_t)l->tokens + tokens > h->max_tokens)
		return ZC_EEXHAUSTED;
	uint64_t heads = heads_of(h);
	bool direct = h->policy == STORE_POLICY_PER_CALL || tokens >= h->residual_tokens;
	/* The codec refuses NaN/Inf before writing, so a block compressed
	 * directly needs no check of its own; but the residual path copies,
	 * and a flush ahead of a direct block must not happen for a block
	 * that will then be refused. */
	if (!direct || l->residual_tokens > 0) {
		rc = zc_fp16_check_finite(keys, heads * tokens * h->head_dim_k);
		if (rc == 0)
			rc = zc_fp16_check_finite(values, heads * tokens * h->head_dim_v);
		if (rc < 0)
			return rc;
	}
	if (!l->view_valid) {
		rc = views_rebuild_layer(store, layer);
		if (rc < 0)
			return rc;
	}
	if (l->tokens == 0 && l->blocks == 0 && l->reserved_view_tokens == 0) {
		rc = reserve_residual(store, layer);
		if (rc < 0)
			return rc;
	}
	rc = reserve_views(store, layer, (uint64_t)l->tokens + tokens);
	if (rc < 0)
		return rc;

	zc_strides key_input = { (size_t)h->kv_heads * tokens * h->head_dim_k,
				 (size_t)tokens * h->head_dim_k, h->head_dim_k };
	zc_strides value_input = { (size_t)h->kv_heads * tokens * h->head_dim_v,
				   (size_t)tokens * h->head_dim_v, h->head_dim_v };

	sequence_begin(l);
	if (direct) {
		/* The residual holds earlier tokens: it becomes its own block first,
		 * so blocks stay in token order. */
		rc = residual_flush(store, layer);
		if (rc == 0)
			rc = block_append(store, layer, l->tokens, tokens, keys, &key_input, values,
					  &value_input);
		if (rc == 0)
			__atomic_store_n(&l->tokens, l->tokens + tokens, __ATOMIC_RELEASE);
		sequence_end(l);
		return rc;
	}

	if (l->residual_tokens + tokens > h->residual_capacity) {
		/* Only after an earlier flush failed for lack of space. */
		rc = residual_flush(store, layer);
		if (rc < 0) {
			sequence_end(l);
			return rc;
		}
	}
	zc_strides key_res = residual_strides(h, h->head_dim_k);
	zc_strides value_res = residual_strides(h, h->head_dim_v);
	zc_strides key_view_s = view_strides(h, h->head_dim_k);
	zc_strides value_view_s = view_strides(h, h->head_dim_v);
	rows_copy(key_residual(store, layer), &key_res, l->residual_tokens, keys, h, tokens,
		  h->head_dim_k);
	rows_copy(value_residual(store, layer), &value_res, l->residual_tokens, values, h, tokens,
		  h->head_dim_v);
	rows_copy(key_view(store, layer), &key_view_s, l->tokens, keys, h, tokens, h->head_dim_k);
	rows_copy(value_view(store, layer), &value_view_s, l->tokens, values, h, tokens,
		  h->head_dim_v);
	l->residual_tokens += tokens;
	__atomic_store_n(&l->tokens, l->tokens + tokens, __ATOMIC_RELEASE);
	if (l->residual_tokens >= h->residual_tokens) {
		/* The tokens are stored exactly either way; a failed flush is
		 * retried on the next update and only costs compression. */
		int flush = residual_flush(store, layer);
		if (flush < 0)
			log_warn("store", "residual flush deferred", "session=%llu layer=%u error=%s",
				 (unsigned long long)h->session_id, layer, zc_strerror(flush));
	}
	sequence_end(l);
	return 0;
}

static uint32_t layer_trim(struct store *store, uint32_t layer, uint32_t tokens)
{
	struct store_header *h = store->header;
	struct store_layer_header *l = &h->layer[layer];
	struct store_block *index = layer_index(store, layer);
	uint32_t cut = tokens < l->tokens ? tokens : l->tokens;
	uint32_t keep = l->tokens - cut;

	if (cut == 0)
		return 0;
	sequence_begin(l);
	if (cut <= l->residual_tokens) {
		l->residual_tokens -= cut;
	} else {
		l->residual_tokens = 0;
		while (l->blocks > 0 && index[l->blocks - 1].first_token >= keep) {
			const struct store_block *last = &index[l->blocks - 1];
			zc_block_shape key_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_k };
			zc_block_shape value_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_v };
			zc_byte_count key_count = { 0 }, value_count = { 0 };
			zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
			zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
			l->key_compressed_bytes -= key_count.compressed;
			l->key_baseline_bytes -= key_count.baseline;
			l->value_compressed_bytes -= value_count.compressed;
			l->value_baseline_bytes -= value_count.baseline;
			/* Blocks are appended in order, so the arenas unwind like a stack. */
			l->key_arena_used = last->key_offset;
			l->value_arena_used = last->value_offset;
			l->blocks--;
		}
		if (l->blocks > 0) {
			/* A block cut in the middle stays whole: re-encoding its
			 * prefix would change tokens the model already used. */
			struct store_block *last = &index[l->blocks - 1];
			if (last->first_token + last->valid_tokens > keep)
				last->valid_tokens = keep - last->first_token;
		}
	}
	__atomic_store_n(&l->tokens, keep, __ATOMIC_RELEASE);
	sequence_end(l);
	return cut;
}

int store_trim(struct store *store, uint32_t tokens, uint32_t *trimmed)
{
	uint32_t most = 0;
	for (uint32_t i = 0; i < store->header->layers; i++) {
		uint32_t cut = layer_trim(store, i, tokens);
		if (cut > most)
			most = cut;
	}
	*trimmed = most;
	return 0;
}

bool store_update_compresses(const struct store *store, uint32_t layer, uint32_t tokens)
{
	const struct store_header *h = store->header;
	if (layer >= h->layers)
		return false;
	uint32_t residual = __atomic_load_n(&h->layer[layer].residual_tokens, __ATOMIC_RELAXED);
	return h->policy == STORE_POLICY_PER_CALL || tokens >= h->residual_tokens ||
	       residual + tokens >= h->residual_tokens;
}

int store_trim_layer(struct store *store, uint32_t layer, uint32_t tokens, uint32_t *trimmed)
{
	if (layer >= store->header->layers)
		return ZC_EINVALID;
	*trimmed = layer_trim(store, layer, tokens);
	return 0;
}

void store_layer_stats(const struct store *store, uint32_t layer, struct store_layer_stats *out)
{
	const struct store_header *h = store->header;
	const struct store_layer_header *l = &h->layer[layer];
	uint64_t heads = heads_of(h);

	*out = (struct store_layer_stats){ .layer = layer };
	out->tokens = l->tokens;
	out->residual_tokens = l->residual_tokens;
	out->blocks = l->blocks;
	out->key.compressed = l->key_compressed_bytes;
	out->key.baseline = l->key_baseline_bytes;
	out->value.compressed = l->value_compressed_bytes;
	out->value.baseline = l->value_baseline_bytes;
	out->key.fp16 = heads * l->tokens * h->head_dim_k * 2;
	out->value.fp16 = heads * l->tokens * h->head_dim_v * 2;
	if (l->residual_tokens > 0) {
		/* The residual really is fp16; its baseline is that of the block
		 * it will become. */
		zc_block_shape key_shape = { h->batch, h->kv_heads, l->residual_tokens, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, l->residual_tokens, h->head_dim_v };
		zc_byte_count key_count = { 0 }, value_count = { 0 };
		zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
		zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
		out->key.compressed += key_count.fp16;
		out->key.baseline += key_count.baseline;
		out->value.compressed += value_count.fp16;
		out->value.baseline += value_count.baseline;
	}
}

void store_token_range(const struct store *store, uint32_t *min_tokens, uint32_t *max_tokens)
{
	const struct store_header *h = store->header;
	uint32_t low = UINT32_MAX, high = 0;
	for (uint32_t i = 0; i < h->layers; i++) {
		/* The loop thread lists sessions while a worker may be appending. */
		uint32_t t = __atomic_load_n(&h->layer[i].tokens, __ATOMIC_ACQUIRE);
		if (t < low)
			low = t;
		if (t > high)
			high = t;
	}
	*min_tokens = low;
	*max_tokens = high;
}

int store_drop_views(struct store *store, uint64_t *freed)
{
	struct store_header *h = store->header;
	uint64_t before = file_allocated(store);
	int rc = 0;

	for (uint32_t i = 0; i < h->layers && rc == 0; i++) {
		struct store_layer_header *l = &h->layer[i];
		uint64_t start = store_key_view_offset(store, i);
		uint64_t bytes = view_bytes(h, h->head_dim_k) + view_bytes(h, h->head_dim_v);
		if (!l->view_valid || l->reserved_view_tokens == 0)
			continue;
		sequence_begin(l);
		if (fallocate(store->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)start,
			      (off_t)bytes) < 0) {
			rc = -errno;
		} else {
			l->reserved_view_tokens = 0;
			l->view_valid = 0;
		}
		sequence_end(l);
	}
	uint64_t after = file_allocated(store);
	uint64_t released = before > after ? before - after : 0;
	if (released > store->charged)
		released = store->charged;
	store->charged -= released;
	budget_give(store->budget, released);
	*freed = released;
	return rc;
}

/* Reconstructs one block's valid tokens into the views. A block cut by
 * trim goes through a scratch buffer, so its dead tail never lands past
 * its valid tokens (or past the end of the view). */
static int block_restore(struct store *store, uint32_t layer, const struct store_block *block)
{
	const struct store_header *h = store->header;
	uint8_t *region = layer_region(store, layer);
	for (int tensor = 0; tensor < 2; tensor++) {
		zc_tensor kind = tensor == 0 ? ZC_TENSOR_KEYS : ZC_TENSOR_VALUES;
		uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
		zc_block_shape shape = { h->batch, h->kv_heads, block->tokens, dim };
		const uint8_t *data = region + (tensor == 0 ? h->key_arena_offset + block->key_offset :
							      h->value_arena_offset + block->value_offset);
		uint64_t bytes = tensor == 0 ? block->key_bytes : block->value_bytes;
		uint16_t *view = tensor == 0 ? key_view(store, layer) : value_view(store, layer);
		zc_strides strides = view_strides(h, dim);
		int rc;

		if (block->valid_tokens == block->tokens) {
			rc = zc_block_reconstruct(&store->codec, kind, &shape, data, bytes,
						  view + (size_t)block->first_token * dim, &strides);
		} else {
			size_t head_elements = (size_t)block->tokens * dim;
			uint16_t *scratch = malloc(heads_of(h) * head_elements * 2);
			if (!scratch)
				return -ENOMEM;
			zc_strides packed = { h->kv_heads * head_elements, head_elements, dim };
			rc = zc_block_reconstruct(&store->codec, kind, &shape, data, bytes, scratch,
						  &packed);
			for (uint64_t head = 0; rc == 0 && head < heads_of(h); head++) {
				uint16_t *to = view + (head / h->kv_heads) * strides.batch +
					       (head % h->kv_heads) * strides.head +
					       (size_t)block->first_token * dim;
				memcpy(to, scratch + head * head_elements,
				       (size_t)block->valid_tokens * dim * 2);
			}
			free(scratch);
		}
		if (rc < 0)
			return rc;
	}
	return 0;
}

static int views_rebuild_layer(struct store *store, uint32_t layer)
{
	struct store_header *h = store->header;
	struct store_layer_header *l = &h->layer[layer];
	int rc = reserve_views(store, layer, l->tokens);
	if (rc < 0)
		return rc;
	sequence_begin(l);
	const struct store_block *index = layer_index(store, layer);
	for (uint32_t i = 0; i < l->blocks && rc == 0; i++)
		rc = block_restore(store, layer, &index[i]);
	if (rc == 0 && l->residual_tokens > 0) {
		uint32_t first = l->tokens - l->residual_tokens;
		for (int tensor = 0; tensor < 2; tensor++) {
			uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
			zc_strides from = residual_strides(h, dim);
			zc_strides to = view_strides(h, dim);
			const uint16_t *residual = tensor == 0 ? key_residual(store, layer) :
								 value_residual(store, layer);
			uint16_t *view = tensor == 0 ? key_view(store, layer) : value_view(store, layer);
			for (uint64_t head = 0; head < heads_of(h); head++) {
				size_t b = head / h->kv_heads, hh = head % h->kv_heads;
				memcpy(view + b * to.batch + hh * to.head + (size_t)first * dim,
				       residual + b * from.batch + hh * from.head,
				       (size_t)l->residual_tokens * dim * 2);
			}
		}
	}
	if (rc == 0) {
		l->view_valid = 1;
		__atomic_fetch_add(&view_rebuilds, 1, __ATOMIC_RELAXED);
	}
	sequence_end(l);
	return rc;
}

int store_rebuild_views(struct store *store)
{
	for (uint32_t i = 0; i < store->header->layers; i++) {
		if (store->header->layer[i].view_valid)
			continue;
		int rc = views_rebuild_layer(store, i);
		if (rc < 0)
			return rc;
	}
	return 0;
}

uint64_t store_rebuild_elements(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	bool all = layer == STORE_ALL_LAYERS;
	uint32_t first = all ? 0 : layer, end = all ? h->layers : layer + 1;
	uint64_t tokens = 0;

	if (!all && layer >= h->layers)
		return 0;
	for (uint32_t i = first; i < end; i++) {
		const struct store_layer_header *l = &h->layer[i];
		/* A worker may be rebuilding or appending to this store. */
		if (!__atomic_load_n(&l->view_valid, __ATOMIC_RELAXED))
			tokens += __atomic_load_n(&l->tokens, __ATOMIC_RELAXED);
	}
	return tokens * heads_of(h) * ((uint64_t)h->head_dim_k + h->head_dim_v);
}
