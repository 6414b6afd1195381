/*
 * One session's store in a sparse shared-memory file: create or adopt it,
 * append blocks, trim, count bytes, drop and rebuild views. The numerics
 * are the codec's; this file decides where bytes go and in which order
 * they become durable (docs/DURABILITY.md) and visible (store_format.h).
 *
 * The daemon keeps its working state (shape, codec, every layer's counts,
 * the block index) in private memory. What it writes into the file is a
 * copy: the commit area and index for the next daemon, the layer headers
 * and views for readers. It never reads the file's copy back except when
 * it adopts the file, and then it checks every field first, so a client
 * that found a way to write its mapping can spoil only its own data.
 */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fault.h"
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

/* A sparse file larger than this is refused: the address space and tmpfs
 * have limits even when untouched pages cost nothing. */
#define STORE_MAX_FILE_BYTES (UINT64_C(1) << 44)

/* The daemon's own copy of a layer's committed state: the truth while it
 * runs. A mutation works on a copy and commits it whole. */
struct layer_state {
	uint32_t tokens;
	uint32_t residual_tokens;
	uint32_t blocks;
	uint32_t active;              /* the record slot that holds the committed state */
	uint64_t key_arena_used, value_arena_used;
	uint64_t key_compressed, key_baseline, value_compressed, value_baseline;
};

/* What is not durable: reservations and the readers' view. */
struct layer_room {
	uint64_t reserved_view_tokens;   /* views fallocated up to this token */
	uint64_t reserved_key_arena;     /* arena bytes fallocated */
	uint64_t reserved_value_arena;
	bool residual_reserved;
	bool view_valid;
	uint64_t sequence;
};

/* What the store's memory holds, by kind (store_memory). */
enum memory_kind { KIND_VIEWS, KIND_BLOCKS, KIND_RESIDUAL, KIND_INDEX, KIND_HEADERS, KINDS };

struct layer_index {
	struct store_block *entries;
	uint32_t capacity;
};

struct store {
	struct store_budget *budget;
	uint64_t charged;         /* bytes of budget.used that are this file's */
	uint64_t kind_bytes[KINDS];   /* charged, by what the pages hold (atomic) */
	uint64_t mapped;          /* bytes of the address-space bound that are this file's */
	int dir_fd;               /* borrowed: the shm-dir */
	int fd;                   /* the durable file: never handed out */
	bool unlinked;
	uint8_t *base;
	size_t file_bytes;
	/* What readers map: the header and the fp16 views, in a memfd sealed
	 * against resizing, so no descriptor a client holds can truncate
	 * memory the daemon writes. Not durable: rebuilt after adoption. */
	int view_fd;
	uint8_t *view_base;
	size_t view_bytes;
	struct store_header *header;      /* private copy: shape, codec, layout */
	struct store_header *shared;      /* the file's header, for readers */
	struct store_commit_area *commit; /* in the file */
	uint64_t generation;              /* last committed */
	struct layer_state *layer;
	struct layer_room *room;
	struct layer_index *index;
	zc_codec_config codec;
	char name[64];
	char path[4096];          /* for logs */
};

static uint64_t view_rebuilds;
static uint64_t mapped_total;     /* atomic: bytes mapped by all stores */
static uint64_t mapped_limit;     /* 0: none */

uint64_t store_view_rebuilds_total(void)
{
	return __atomic_load_n(&view_rebuilds, __ATOMIC_RELAXED);
}

void store_set_map_limit(uint64_t bytes)
{
	mapped_limit = bytes;
}

uint64_t store_map_limit(void)
{
	return mapped_limit;
}

uint64_t store_mapped_bytes_total(void)
{
	return __atomic_load_n(&mapped_total, __ATOMIC_RELAXED);
}

/* Takes address space for a mapping, or refuses without taking any. */
static int map_take(uint64_t bytes)
{
	uint64_t used = __atomic_load_n(&mapped_total, __ATOMIC_RELAXED);
	do {
		if (mapped_limit && (used + bytes < used || used + bytes > mapped_limit))
			return ZC_EEXHAUSTED;
	} while (!__atomic_compare_exchange_n(&mapped_total, &used, used + bytes, true,
					      __ATOMIC_RELAXED, __ATOMIC_RELAXED));
	return 0;
}

static void map_give(uint64_t bytes)
{
	__atomic_fetch_sub(&mapped_total, bytes, __ATOMIC_RELAXED);
}

static uint64_t round_up(uint64_t value, uint64_t unit)
{
	return (value + unit - 1) / unit * unit;
}

/* a * b * c, or false when it does not fit in 64 bits. */
static bool mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
	uint64_t ab;
	return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, out);
}

static uint64_t heads_of(const struct store_header *h)
{
	return (uint64_t)h->batch * h->kv_heads;
}

/* Bytes of one [B][H][max_tokens][D] fp16 view. Only called on headers
 * whose layout was checked, so it cannot wrap. */
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

static uint64_t layer_region_offset(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	return h->commit_offset + h->commit_bytes + (uint64_t)layer * h->layer_region_bytes;
}

static uint8_t *layer_region(const struct store *store, uint32_t layer)
{
	return store->base + layer_region_offset(store, layer);
}

static struct store_block *file_index(const struct store *store, uint32_t layer)
{
	return (struct store_block *)(layer_region(store, layer) + store->header->index_offset);
}

static uint16_t *key_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->view_base + store_key_view_offset(store, layer));
}

static uint16_t *value_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->view_base + store_value_view_offset(store, layer));
}

static uint16_t *key_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->key_residual_offset);
}

static uint16_t *value_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->value_residual_offset);
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

/* The tokens block i of a layer still holds: up to the next block, or for
 * the last one up to where the residual begins. */
static uint32_t block_valid_tokens(const struct store *store, uint32_t layer,
				   const struct layer_state *state, uint32_t i)
{
	const struct store_block *index = store->index[layer].entries;
	uint32_t end = i + 1 < state->blocks ? index[i + 1].first_token :
					       state->tokens - state->residual_tokens;
	return end - index[i].first_token;
}

static uint64_t fd_allocated(int fd)
{
	struct stat st;
	return fd >= 0 && fstat(fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

/* What the store holds in memory: the durable file and the views. */
static uint64_t file_allocated(const struct store *store)
{
	return fd_allocated(store->fd) + fd_allocated(store->view_fd);
}

/* Brings the charge up to what the file holds: pages a client's read
 * faults allocated in dropped views are memory too. Returns the growth. */
static void kinds_measure(struct store *store);

static void kind_add(struct store *store, enum memory_kind kind, int64_t bytes)
{
	__atomic_fetch_add(&store->kind_bytes[kind], (uint64_t)bytes, __ATOMIC_RELAXED);
}

/* Growth nobody reserved is a reader's faults, and readers map only the
 * views. */
static uint64_t charge_sync(struct store *store, uint64_t allocated)
{
	if (allocated <= store->charged)
		return 0;
	uint64_t grown = allocated - store->charged;
	store_budget_force(store->budget, grown);
	store->charged = allocated;
	kind_add(store, KIND_VIEWS, (int64_t)grown);
	return grown;
}

void store_charge_to(struct store *store, struct store_budget *budget)
{
	store_budget_give(store->budget, store->charged);
	store->budget = budget;
	store_budget_force(budget, store->charged);
}

uint64_t store_sync_charge(struct store *store)
{
	return charge_sync(store, file_allocated(store));
}

static int budget_take_one(struct store_budget *budget, uint64_t bytes)
{
	uint64_t used = __atomic_load_n(&budget->used, __ATOMIC_RELAXED);
	do {
		if (budget->limit && (used + bytes < used || used + bytes > budget->limit))
			return STORE_EBUDGET;
	} while (!__atomic_compare_exchange_n(&budget->used, &used, used + bytes, true,
					      __ATOMIC_RELAXED, __ATOMIC_RELAXED));
	return 0;
}

int store_budget_take(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent) {
		if (budget_take_one(b, bytes) < 0) {
			for (struct store_budget *undo = budget; undo != b; undo = undo->parent)
				__atomic_fetch_sub(&undo->used, bytes, __ATOMIC_RELAXED);
			return STORE_EBUDGET;
		}
	}
	return 0;
}

void store_budget_give(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent)
		__atomic_fetch_sub(&b->used, bytes, __ATOMIC_RELAXED);
}

void store_budget_force(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent)
		__atomic_fetch_add(&b->used, bytes, __ATOMIC_RELAXED);
}

/* Makes pages real before they are written, so that a full tmpfs is an
 * error we can report instead of a SIGBUS on the next store. The range is
 * taken from the budget first; afterwards the charge is set to what the
 * file really holds (the range may overlap pages that exist already). */
static int reserve_in(struct store *store, int fd, uint64_t offset, uint64_t bytes,
		      enum memory_kind kind)
{
	if (bytes == 0)
		return 0;
	uint64_t start = offset / PAGE_BYTES * PAGE_BYTES;
	uint64_t end = round_up(offset + bytes, PAGE_BYTES);
	int rc = store_budget_take(store->budget, end - start);
	if (rc < 0) {
		/* Pages that exist already cost nothing more (an adopted file's
		 * index, a view rebuilt over pages a drop did not punch). */
		off_t hole = lseek(fd, (off_t)start, SEEK_HOLE);
		return hole >= 0 && (uint64_t)hole >= end ? 0 : rc;
	}
	uint64_t before = file_allocated(store);
	if (fallocate(fd, 0, (off_t)start, (off_t)(end - start)) < 0) {
		int err = errno;
		store_budget_give(store->budget, end - start);
		log_warn("store", "fallocate failed", "path=%s offset=%llu bytes=%llu error=%s",
			 store->path, (unsigned long long)start,
			 (unsigned long long)(end - start), strerror(err));
		return -err;
	}
	/* The provisional charge becomes the real one: what was taken and not
	 * grown goes back (never all of it first: another thread could take
	 * the room in between and pass the limit). */
	uint64_t after = file_allocated(store);
	uint64_t grown = after > before ? after - before : 0;
	if (grown > end - start)
		grown = end - start;
	store_budget_give(store->budget, end - start - grown);
	store->charged += grown;
	kind_add(store, kind, (int64_t)grown);
	/* Anything else the file gained (a client's read faults) is charged too. */
	charge_sync(store, after);
	return 0;
}

static int reserve_range(struct store *store, uint64_t offset, uint64_t bytes,
			 enum memory_kind kind)
{
	return reserve_in(store, store->fd, offset, bytes, kind);
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
			int rc = reserve_in(store, store->view_fd, head_start + from * dim * 2,
					    (to - from) * dim * 2, KIND_VIEWS);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

static int reserve_views(struct store *store, uint32_t layer, uint64_t tokens_needed)
{
	struct layer_room *l = &store->room[layer];
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
	struct layer_room *l = &store->room[layer];
	uint64_t *reserved = keys ? &l->reserved_key_arena : &l->reserved_value_arena;
	uint64_t capacity = keys ? h->key_arena_bytes : h->value_arena_bytes;
	uint64_t arena = layer_region_offset(store, layer) +
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
	int rc = reserve_range(store, arena + *reserved, target - *reserved, KIND_BLOCKS);
	if (rc < 0)
		return rc;
	*reserved = target;
	return 0;
}

/* The residual is small and used at once; reserve it on a layer's first
 * write (and again after an adoption: reservations are not durable). */
static int reserve_residual(struct store *store, uint32_t layer)
{
	struct layer_room *l = &store->room[layer];
	if (l->residual_reserved)
		return 0;
	int rc = reserve_range(store, layer_region_offset(store, layer), store->header->index_offset,
			       KIND_RESIDUAL);
	if (rc == 0)
		l->residual_reserved = true;
	return rc;
}

/* Index pages are reserved as entries reach them. */
static int reserve_index_entry(struct store *store, uint32_t layer, uint32_t entry)
{
	uint64_t entry_bytes = sizeof(struct store_block);
	uint64_t start = (uint64_t)entry * entry_bytes;
	if (entry > 0 && start / PAGE_BYTES == (start - 1) / PAGE_BYTES &&
	    (start + entry_bytes - 1) / PAGE_BYTES == start / PAGE_BYTES)
		return 0;
	uint64_t index = layer_region_offset(store, layer) + store->header->index_offset;
	return reserve_range(store, index + start, entry_bytes, KIND_INDEX);
}

/* Room for entry `entry` in the private index. */
static int index_grow(struct store *store, uint32_t layer, uint32_t entry)
{
	struct layer_index *index = &store->index[layer];
	if (entry < index->capacity)
		return 0;
	uint64_t capacity = index->capacity ? (uint64_t)index->capacity * 2 : 16;
	if (capacity <= entry)
		capacity = (uint64_t)entry + 1;
	if (capacity > store->header->max_blocks)
		capacity = store->header->max_blocks;
	if (capacity <= entry)
		return ZC_EEXHAUSTED;
	struct store_block *entries = realloc(index->entries, capacity * sizeof(*entries));
	if (!entries)
		return -ENOMEM;
	index->entries = entries;
	index->capacity = (uint32_t)capacity;
	return 0;
}

/* ---- readers' copy ------------------------------------------------------- */

static void sequence_begin(struct store *store, uint32_t layer)
{
	struct layer_room *l = &store->room[layer];
	__atomic_store_n(&l->sequence, l->sequence | 1, __ATOMIC_RELAXED);
	__atomic_store_n(&store->shared->layer[layer].sequence, l->sequence, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}

static void sequence_end(struct store *store, uint32_t layer)
{
	struct layer_room *l = &store->room[layer];
	__atomic_store_n(&l->sequence, l->sequence + 1, __ATOMIC_RELEASE);
	__atomic_store_n(&store->shared->layer[layer].sequence, l->sequence, __ATOMIC_RELEASE);
}

/* Copies a layer's private state into the header readers see. */
static void mirror_layer(struct store *store, uint32_t layer)
{
	const struct layer_state *l = &store->layer[layer];
	struct store_layer_header *p = &store->shared->layer[layer];
	p->residual_tokens = l->residual_tokens;
	p->blocks = l->blocks;
	p->key_arena_used = l->key_arena_used;
	p->value_arena_used = l->value_arena_used;
	p->key_compressed_bytes = l->key_compressed;
	p->key_baseline_bytes = l->key_baseline;
	p->value_compressed_bytes = l->value_compressed;
	p->value_baseline_bytes = l->value_baseline;
	__atomic_store_n(&p->view_valid, store->room[layer].view_valid ? 1u : 0u, __ATOMIC_RELEASE);
	__atomic_store_n(&p->tokens, l->tokens, __ATOMIC_RELEASE);
}

/* ---- the commit protocol (docs/DURABILITY.md) ------------------------------- */

static struct store_layer_commit *record_slot(const struct store *store, uint32_t layer,
					      unsigned slot)
{
	return &store->commit->record[2 * (size_t)layer + slot];
}

/* Writes a layer's next state into its inactive record under `generation`,
 * which is past the committed one: until it is published, a daemon that
 * adopts the file ignores the record. */
static void record_write(struct store *store, uint32_t layer, const struct layer_state *next,
			 uint64_t generation)
{
	struct store_layer_commit *r = record_slot(store, layer, 1u - store->layer[layer].active);
	__atomic_store_n(&r->generation, generation, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	r->tokens = next->tokens;
	r->residual_tokens = next->residual_tokens;
	r->blocks = next->blocks;
	r->pad = 0;
	r->key_arena_used = next->key_arena_used;
	r->value_arena_used = next->value_arena_used;
}

/* The commit point: one aligned 64-bit store makes every record written
 * under `generation` the current state of its layer. */
static void generation_publish(struct store *store, uint64_t generation)
{
	__atomic_thread_fence(__ATOMIC_RELEASE);
	__atomic_store_n(&store->commit->generation, generation, __ATOMIC_RELEASE);
	store->generation = generation;
}

/* The private state becomes `next`. The loop thread reads tokens and
 * residual_tokens while a worker runs a job: those are stored atomically. */
static void layer_state_set(struct store *store, uint32_t layer, const struct layer_state *next)
{
	struct layer_state *l = &store->layer[layer];
	l->blocks = next->blocks;
	l->active = next->active;
	l->key_arena_used = next->key_arena_used;
	l->value_arena_used = next->value_arena_used;
	l->key_compressed = next->key_compressed;
	l->key_baseline = next->key_baseline;
	l->value_compressed = next->value_compressed;
	l->value_baseline = next->value_baseline;
	__atomic_store_n(&l->residual_tokens, next->residual_tokens, __ATOMIC_RELEASE);
	__atomic_store_n(&l->tokens, next->tokens, __ATOMIC_RELEASE);
}

static void view_valid_set(struct store *store, uint32_t layer, bool valid)
{
	__atomic_store_n(&store->room[layer].view_valid, valid, __ATOMIC_RELEASE);
}

/* Makes `next` the committed state of one layer, then the private one. */
static void layer_commit(struct store *store, uint32_t layer, struct layer_state *next,
			 const char *step_record, const char *step_publish)
{
	uint64_t generation = store->generation + 1;
	record_write(store, layer, next, generation);
	fault_point(step_record);
	generation_publish(store, generation);
	fault_point(step_publish);
	next->active = 1u - store->layer[layer].active;
	layer_state_set(store, layer, next);
}

/* ---- layout ----------------------------------------------------------------- */

static int params_validate(const struct store_params *p)
{
	int rc = zc_codec_config_validate(&p->codec);
	if (rc < 0)
		return rc;
	if (p->layers == 0 || p->layers > STORE_MAX_LAYERS || p->batch == 0 || p->kv_heads == 0 ||
	    p->head_dim_k == 0 || p->head_dim_v == 0 || p->max_tokens == 0)
		return ZC_ESHAPE;
	if (p->head_dim_k > ZC_MAX_HEAD_DIM || p->head_dim_v > ZC_MAX_HEAD_DIM ||
	    (uint64_t)p->batch * p->kv_heads > STORE_MAX_HEADS || p->max_tokens > ZC_MAX_BLOCK_TOKENS)
		return ZC_ESHAPE;
	if (p->policy != STORE_POLICY_STREAMING && p->policy != STORE_POLICY_PER_CALL)
		return ZC_EINVALID;
	if (p->policy == STORE_POLICY_STREAMING &&
	    (p->residual_tokens == 0 || p->residual_tokens > STORE_MAX_RESIDUAL_TOKENS))
		return ZC_EINVALID;
	if (!p->name || strlen(p->name) >= STORE_NAME_BYTES)
		return ZC_EINVALID;
	return 0;
}

/* A residual below R tokens plus a block below R never reaches 2R. */
static uint32_t residual_capacity_of(uint32_t residual_tokens, uint32_t max_tokens)
{
	uint64_t capacity = 2 * (uint64_t)residual_tokens;
	return capacity < max_tokens ? (uint32_t)capacity : max_tokens;
}

/* Adds `bytes` (page-rounded) at *offset, checked; false when it wraps or
 * passes the largest file we make. */
static bool region_add(uint64_t *offset, uint64_t bytes)
{
	uint64_t rounded;
	if (__builtin_add_overflow(bytes, PAGE_BYTES - 1, &rounded))
		return false;
	rounded = rounded / PAGE_BYTES * PAGE_BYTES;
	if (__builtin_add_overflow(*offset, rounded, offset))
		return false;
	return *offset <= STORE_MAX_FILE_BYTES;
}

/*
 * Fills in every size and offset of a header from its shape: the one
 * definition of the file's layout, for new files and for checking adopted
 * ones. Every product is checked: the shape comes from a client (or from a
 * file), and a wrapped size would put regions past the mapping.
 */
static int header_layout(struct store_header *h)
{
	uint64_t heads = (uint64_t)h->batch * h->kv_heads;
	uint64_t offset = 0, bytes, key_view, value_view, key_res, value_res, key_arena, value_arena;

	if (!mul3(heads, h->max_tokens, (uint64_t)h->head_dim_k * 2, &key_view) ||
	    !mul3(heads, h->max_tokens, (uint64_t)h->head_dim_v * 2, &value_view) ||
	    !mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_k * 2, &key_res) ||
	    !mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_v * 2, &value_res) ||
	    !mul3(ARENA_TOKEN_FACTOR * heads, h->max_tokens, 5ull * h->head_dim_k + 3, &key_arena) ||
	    !mul3(ARENA_TOKEN_FACTOR * heads, h->max_tokens, 5ull * h->head_dim_v + 3, &value_arena))
		return ZC_EEXHAUSTED;

	if (!region_add(&offset, sizeof(*h) + (uint64_t)h->layers * sizeof(h->layer[0])))
		return ZC_EEXHAUSTED;
	h->header_bytes = (uint32_t)offset;
	for (uint32_t i = 0; i < h->layers; i++)
		if (!region_add(&offset, key_view) || !region_add(&offset, value_view))
			return ZC_EEXHAUSTED;
	h->views_bytes = offset;
	h->max_blocks = h->max_tokens;
	h->commit_offset = offset;
	if (!region_add(&offset, sizeof(struct store_commit_area) +
					 2 * (uint64_t)h->layers * sizeof(struct store_layer_commit)))
		return ZC_EEXHAUSTED;
	h->commit_bytes = offset - h->commit_offset;

	uint64_t region = 0;
	h->key_residual_offset = region;
	bool ok = region_add(&region, key_res);
	h->value_residual_offset = region;
	ok = ok && region_add(&region, value_res);
	h->index_offset = region;
	ok = ok && region_add(&region, h->max_blocks * sizeof(struct store_block));
	h->key_arena_offset = region;
	h->key_arena_bytes = round_up(key_arena, PAGE_BYTES);
	ok = ok && region_add(&region, key_arena);
	h->value_arena_offset = region;
	h->value_arena_bytes = round_up(value_arena, PAGE_BYTES);
	ok = ok && region_add(&region, value_arena);
	h->layer_region_bytes = region;
	if (!ok || __builtin_mul_overflow(region, (uint64_t)h->layers, &bytes) ||
	    __builtin_add_overflow(offset, bytes, &h->file_bytes) ||
	    h->file_bytes > STORE_MAX_FILE_BYTES)
		return ZC_EEXHAUSTED;
	return 0;
}

static void store_free_memory(struct store *store)
{
	if (store->index)
		for (uint32_t i = 0; i < store->header->layers; i++)
			free(store->index[i].entries);
	free(store->index);
	free(store->layer);
	free(store->room);
	free(store->header);
	free(store);
}

/* The private state of a store with `h`'s shape (h is copied). */
static int store_alloc(const struct store_header *h, struct store **out)
{
	struct store *store = calloc(1, sizeof(*store));
	if (!store)
		return -ENOMEM;
	store->fd = -1;
	store->view_fd = -1;
	store->header = malloc(sizeof(*h));
	if (!store->header) {
		free(store);
		return -ENOMEM;
	}
	memcpy(store->header, h, sizeof(*h));
	store->layer = calloc(h->layers, sizeof(*store->layer));
	store->room = calloc(h->layers, sizeof(*store->room));
	store->index = calloc(h->layers, sizeof(*store->index));
	if (!store->layer || !store->room || !store->index) {
		store_free_memory(store);
		return -ENOMEM;
	}
	store->codec = header_codec(h);
	*out = store;
	return 0;
}

static int store_map(struct store *store, size_t bytes)
{
	int rc = map_take(bytes);
	if (rc < 0)
		return rc;
	void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, store->fd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		map_give(bytes);
		return rc;
	}
	store->base = base;
	store->file_bytes = bytes;
	store->mapped = bytes;
	store->commit = (struct store_commit_area *)(store->base + store->header->commit_offset);
	return 0;
}

/*
 * The readers' part: a memfd of header + views, sealed so that it can
 * never shrink or grow (whoever holds a descriptor), mapped, its header
 * page reserved and written from the private header, every layer's
 * readers' copy from the private state.
 */
static int views_open(struct store *store)
{
	const struct store_header *h = store->header;
	size_t bytes = h->views_bytes;
	int rc = map_take(bytes);
	if (rc < 0)
		return rc;
	store->view_fd = memfd_create("zipcache-views", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (store->view_fd < 0 || ftruncate(store->view_fd, (off_t)bytes) < 0 ||
	    fcntl(store->view_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		rc = -errno;
		goto out_close;
	}
	/* Readers get a read-only descriptor; no write bits keeps them (as
	 * any other user) from reopening it for writing. */
	fchmod(store->view_fd, 0400);
	rc = reserve_in(store, store->view_fd, 0, h->header_bytes, KIND_HEADERS);
	if (rc < 0)
		goto out_close;
	void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, store->view_fd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		goto out_close;
	}
	store->view_base = base;
	store->view_bytes = bytes;
	store->shared = base;
	memcpy(store->shared, h, sizeof(*h));
	memcpy(store->shared->magic, STORE_MAGIC, sizeof(store->shared->magic));
	for (uint32_t i = 0; i < h->layers; i++) {
		mirror_layer(store, i);
		__atomic_store_n(&store->shared->layer[i].sequence, store->room[i].sequence,
				 __ATOMIC_RELEASE);
	}
	return 0;

out_close:
	/* What its header page was charged stays in store->charged, which
	 * the caller's failure path gives back whole. */
	if (store->view_fd >= 0)
		close(store->view_fd);
	store->view_fd = -1;
	map_give(bytes);
	return rc;
}

static void store_unmap(struct store *store)
{
	if (store->view_base) {
		munmap(store->view_base, store->view_bytes);
		map_give(store->view_bytes);
		store->view_base = NULL;
	}
	if (store->view_fd >= 0)
		close(store->view_fd);
	store->view_fd = -1;
	if (!store->base)
		return;
	munmap(store->base, store->file_bytes);
	map_give(store->mapped);
	store->base = NULL;
}

static void file_name(char *out, size_t size, uint64_t session_id, bool temporary)
{
	snprintf(out, size, "%ssession-%016llx.zcs%s", temporary ? "." : "",
		 (unsigned long long)session_id, temporary ? ".tmp" : "");
}

static void layout_from_params(struct store_header *layout, const struct store_params *params)
{
	layout->layers = params->layers;
	layout->batch = params->batch;
	layout->kv_heads = params->kv_heads;
	layout->head_dim_k = params->head_dim_k;
	layout->head_dim_v = params->head_dim_v;
	layout->max_tokens = params->max_tokens;
	layout->policy = (uint32_t)params->policy;
	layout->residual_tokens = params->policy == STORE_POLICY_STREAMING ? params->residual_tokens : 0;
	layout->residual_capacity = residual_capacity_of(layout->residual_tokens, layout->max_tokens);
	layout->version = STORE_VERSION;
	layout->session_id = params->session_id;
	layout->created_epoch = params->boot_epoch;
	layout->owner_uid = params->owner_uid;
	layout->hi_bits = params->codec.hi_bits;
	layout->lo_bits = params->codec.lo_bits;
	layout->hi_fraction = params->codec.hi_fraction;
	layout->group_size = params->codec.group_size;
	layout->quantize_values = params->codec.quantize_values;
	snprintf(layout->name, sizeof(layout->name), "%s", params->name);
}

int store_layout_bytes(const struct store_params *params, uint64_t *bytes)
{
	struct store_header layout = { 0 };
	int rc = params_validate(params);
	if (rc < 0)
		return rc;
	layout_from_params(&layout, params);
	rc = header_layout(&layout);
	*bytes = rc == 0 ? layout.file_bytes : 0;
	return rc;
}

uint64_t store_max_file_bytes(void)
{
	return STORE_MAX_FILE_BYTES;
}

int store_create(int dir_fd, const char *dir_path, const struct store_params *params,
		 struct store_budget *budget, struct store **out)
{
	struct store_header layout = { 0 };
	struct store *store;
	char temporary[64];
	int rc = params_validate(params);

	if (rc < 0)
		return rc;
	layout_from_params(&layout, params);
	rc = header_layout(&layout);
	if (rc < 0)
		return rc;
	rc = store_alloc(&layout, &store);
	if (rc < 0)
		return rc;
	store->budget = budget;
	store->dir_fd = dir_fd;
	file_name(store->name, sizeof(store->name), params->session_id, false);
	file_name(temporary, sizeof(temporary), params->session_id, true);
	snprintf(store->path, sizeof(store->path), "%s/%s", dir_path, store->name);
	for (uint32_t i = 0; i < layout.layers; i++)
		store->room[i].view_valid = true;

	/* Built under a temporary name and renamed into place: a crash
	 * before the rename leaves a file no daemon mistakes for a session. */
	store->fd = openat(dir_fd, temporary, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
			   0600);
	if (store->fd < 0 && errno == EEXIST && unlinkat(dir_fd, temporary, 0) == 0)
		store->fd = openat(dir_fd, temporary,
				   O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (store->fd < 0) {
		rc = -errno;
		goto out_free;
	}
	if (ftruncate(store->fd, (off_t)layout.file_bytes) < 0) {
		rc = -errno;
		goto out_unlink;
	}
	fault_point("create.file");
	rc = reserve_range(store, 0, layout.header_bytes, KIND_HEADERS);
	if (rc == 0)
		rc = reserve_range(store, layout.commit_offset, layout.commit_bytes, KIND_HEADERS);
	if (rc == 0)
		rc = store_map(store, layout.file_bytes);
	if (rc < 0)
		goto out_unlink;

	struct store_header *durable = (struct store_header *)store->base;
	memcpy(durable, &layout, sizeof(layout));
	memset(durable->magic, 0, sizeof(durable->magic));
	/* The magic goes in last: a file without it was never finished. */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	memcpy(durable->magic, STORE_MAGIC, sizeof(durable->magic));
	/* No write bits: the daemon keeps its own read-write descriptor. */
	if (fchmod(store->fd, 0400) < 0) {
		rc = -errno;
		goto out_unlink;
	}
	rc = views_open(store);
	if (rc < 0)
		goto out_unlink;
	fault_point("create.header");
	if (renameat2(dir_fd, temporary, dir_fd, store->name, RENAME_NOREPLACE) < 0) {
		rc = errno == EEXIST ? ZC_EEXISTS : -errno;
		goto out_unlink;
	}
	fault_point("create.rename");
	*out = store;
	return 0;

out_unlink:
	unlinkat(dir_fd, temporary, 0);
	store_unmap(store);
	store_budget_give(store->budget, store->charged);
	close(store->fd);
out_free:
	store_free_memory(store);
	return rc;
}

/* Refuses an adopted file with the reason said. */
static int corrupt(char *reason, size_t size, const char *format, ...)
	__attribute__((format(printf, 3, 4)));

static int corrupt(char *reason, size_t size, const char *format, ...)
{
	va_list args;
	va_start(args, format);
	if (reason && size)
		vsnprintf(reason, size, format, args);
	va_end(args);
	return ZC_ECORRUPT;
}

/* Everything the daemon would trust in a header found on disk. */
static int header_check(const struct store_header *h, uint64_t file_bytes, char *reason,
			size_t size)
{
	struct store_header expected = { 0 };

	if (memcmp(h->magic, STORE_MAGIC, sizeof(h->magic)) != 0)
		return corrupt(reason, size, "no store magic (the file was never finished)");
	if (h->version != STORE_VERSION)
		return corrupt(reason, size, "format version %u, this daemon reads %u", h->version,
			       STORE_VERSION);
	expected.layers = h->layers;
	expected.batch = h->batch;
	expected.kv_heads = h->kv_heads;
	expected.head_dim_k = h->head_dim_k;
	expected.head_dim_v = h->head_dim_v;
	expected.max_tokens = h->max_tokens;
	expected.residual_capacity = h->residual_capacity;
	if (h->layers == 0 || h->layers > STORE_MAX_LAYERS || h->batch == 0 || h->kv_heads == 0 ||
	    h->head_dim_k == 0 || h->head_dim_k > ZC_MAX_HEAD_DIM || h->head_dim_v == 0 ||
	    h->head_dim_v > ZC_MAX_HEAD_DIM || h->max_tokens == 0 ||
	    h->max_tokens > ZC_MAX_BLOCK_TOKENS || (uint64_t)h->batch * h->kv_heads > STORE_MAX_HEADS ||
	    h->policy > STORE_POLICY_PER_CALL ||
	    (h->policy == STORE_POLICY_STREAMING &&
	     (h->residual_tokens == 0 || h->residual_tokens > STORE_MAX_RESIDUAL_TOKENS)) ||
	    (h->policy == STORE_POLICY_PER_CALL && h->residual_tokens != 0) ||
	    h->residual_capacity != residual_capacity_of(h->residual_tokens, h->max_tokens))
		return corrupt(reason, size, "shape or policy out of range");
	if (header_layout(&expected) < 0 || expected.file_bytes != h->file_bytes ||
	    expected.file_bytes != file_bytes || expected.header_bytes != h->header_bytes ||
	    expected.views_bytes != h->views_bytes || expected.commit_offset != h->commit_offset ||
	    expected.commit_bytes != h->commit_bytes ||
	    expected.layer_region_bytes != h->layer_region_bytes ||
	    expected.key_residual_offset != h->key_residual_offset ||
	    expected.value_residual_offset != h->value_residual_offset ||
	    expected.index_offset != h->index_offset ||
	    expected.key_arena_offset != h->key_arena_offset ||
	    expected.key_arena_bytes != h->key_arena_bytes ||
	    expected.value_arena_offset != h->value_arena_offset ||
	    expected.value_arena_bytes != h->value_arena_bytes ||
	    expected.max_blocks != h->max_blocks)
		return corrupt(reason, size, "layout does not follow from the shape (file %llu bytes)",
			       (unsigned long long)file_bytes);
	zc_codec_config codec = header_codec(h);
	if (zc_codec_config_validate(&codec) < 0)
		return corrupt(reason, size, "codec config out of range");
	if (memchr(h->name, '\0', sizeof(h->name)) == NULL)
		return corrupt(reason, size, "session name not terminated");
	return 0;
}

/*
 * A layer's durable state after a crash: the record with the highest
 * generation not past the committed one. Its block entries must tile the
 * tokens before the residual and sit end to end in the arenas, with the
 * sizes the codec gives their shapes, or the file is corrupt. Records of
 * a generation that was never committed are cleared, so no later commit
 * can make them current by accident.
 */
static int layer_recover(struct store *store, uint32_t layer, char *reason, size_t size)
{
	const struct store_header *h = store->header;
	struct layer_state *l = &store->layer[layer];
	uint64_t committed = store->generation;
	struct store_layer_commit *slots[2] = { record_slot(store, layer, 0),
						record_slot(store, layer, 1) };
	for (int i = 0; i < 2; i++)
		if (slots[i]->generation > committed)
			memset(slots[i], 0, sizeof(*slots[i]));
	int best = slots[1]->generation > slots[0]->generation ? 1 : 0;
	const struct store_layer_commit r = *slots[best];
	*l = (struct layer_state){ .active = (uint32_t)best };
	if (r.tokens > h->max_tokens || r.blocks > h->max_blocks || r.blocks > r.tokens ||
	    r.residual_tokens > r.tokens || r.residual_tokens > h->residual_capacity)
		return corrupt(reason, size, "layer %u: record counts out of range", layer);
	if (r.blocks > 0) {
		int rc = index_grow(store, layer, r.blocks - 1);
		if (rc < 0)
			return rc;
		memcpy(store->index[layer].entries, file_index(store, layer),
		       (size_t)r.blocks * sizeof(struct store_block));
	}
	l->tokens = r.tokens;
	l->residual_tokens = r.residual_tokens;
	l->blocks = r.blocks;

	const struct store_block *index = store->index[layer].entries;
	uint64_t key_end = 0, value_end = 0;
	uint32_t end_of_blocks = r.tokens - r.residual_tokens;
	for (uint32_t i = 0; i < r.blocks; i++) {
		const struct store_block *b = &index[i];
		zc_block_shape key_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_v };
		zc_byte_count key_bytes, value_bytes;
		uint64_t end = i + 1 < r.blocks ? index[i + 1].first_token : end_of_blocks;
		if ((i == 0 && b->first_token != 0) || end <= b->first_token ||
		    (uint64_t)b->first_token + b->tokens > h->max_tokens || end - b->first_token > b->tokens ||
		    b->key_offset != key_end || b->value_offset != value_end)
			return corrupt(reason, size, "layer %u: block %u does not follow its predecessor",
				       layer, i);
		if (zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_bytes) < 0 ||
		    zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_bytes) < 0 ||
		    key_bytes.compressed != b->key_bytes || value_bytes.compressed != b->value_bytes ||
		    key_end + b->key_bytes > h->key_arena_bytes ||
		    value_end + b->value_bytes > h->value_arena_bytes)
			return corrupt(reason, size, "layer %u: block %u has sizes its shape cannot have",
				       layer, i);
		key_end += b->key_bytes;
		value_end += b->value_bytes;
		l->key_compressed += key_bytes.compressed;
		l->key_baseline += key_bytes.baseline;
		l->value_compressed += value_bytes.compressed;
		l->value_baseline += value_bytes.baseline;
	}
	if (r.blocks == 0 && end_of_blocks != 0)
		return corrupt(reason, size, "layer %u: %u tokens but no blocks and a residual of %u",
			       layer, r.tokens, r.residual_tokens);
	if (key_end != r.key_arena_used || value_end != r.value_arena_used)
		return corrupt(reason, size, "layer %u: arena marks disagree with the blocks", layer);
	l->key_arena_used = key_end;
	l->value_arena_used = value_end;

	struct layer_room *room = &store->room[layer];
	/* Reservations are not durable (a dropped view may have been punched
	 * after its mark): every page past what the blocks fill is reserved
	 * again before it is written. */
	*room = (struct layer_room){
		.reserved_key_arena = key_end / PAGE_BYTES * PAGE_BYTES,
		.reserved_value_arena = value_end / PAGE_BYTES * PAGE_BYTES,
		.sequence = 0,
	};
	return 0;
}

static bool owner_may_write(int fd, uid_t uid)
{
	return uid == 0 || fchmod(fd, 0600) == 0;
}

int store_adopt(int dir_fd, const char *dir_path, const char *name, struct store_budget *budget,
		struct store **out, char *reason, size_t reason_size)
{
	struct stat st;
	struct store_header copy;
	struct store *store;
	char proc_path[64];
	uid_t uid = geteuid();
	int rc;

	if (reason && reason_size)
		reason[0] = '\0';
	int ro = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (ro < 0)
		return -errno;
	if (fstat(ro, &st) < 0) {
		rc = -errno;
		close(ro);
		return rc;
	}
	if (!S_ISREG(st.st_mode)) {
		close(ro);
		return corrupt(reason, reason_size, "not a regular file");
	}
	if (st.st_uid != uid) {
		close(ro);
		snprintf(reason, reason_size, "owned by uid %u, not the daemon's %u",
			 (unsigned)st.st_uid, (unsigned)uid);
		return -EPERM;
	}
	if ((uint64_t)st.st_size < sizeof(struct store_header)) {
		close(ro);
		return corrupt(reason, reason_size, "%lld bytes: shorter than a header",
			       (long long)st.st_size);
	}
	/* The file is 0400 so that readers cannot reopen it for writing; its
	 * owner lifts that for the moment it takes a read-write descriptor. */
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", ro);
	int fd = -1;
	if (owner_may_write(ro, uid)) {
		fd = open(proc_path, O_RDWR | O_CLOEXEC);
		rc = fd < 0 ? -errno : 0;
		if (fchmod(ro, 0400) < 0 && rc == 0)
			rc = -errno;
	} else {
		rc = -errno;
	}
	if (rc < 0 || pread(ro, &copy, sizeof(copy), 0) != (ssize_t)sizeof(copy)) {
		rc = rc < 0 ? rc : -EIO;
		if (fd >= 0)
			close(fd);
		close(ro);
		return rc;
	}
	close(ro);
	rc = header_check(&copy, (uint64_t)st.st_size, reason, reason_size);
	if (rc < 0) {
		close(fd);
		return rc;
	}
	rc = store_alloc(&copy, &store);
	if (rc < 0) {
		close(fd);
		return rc;
	}
	store->fd = fd;
	store->dir_fd = dir_fd;
	snprintf(store->name, sizeof(store->name), "%s", name);
	snprintf(store->path, sizeof(store->path), "%s/%s", dir_path, name);
	rc = store_map(store, (size_t)st.st_size);
	if (rc < 0)
		goto out_free;
	/* The commit area's pages may never have been written by a daemon
	 * that died early: reserve them before reading (a hole reads as 0). */
	if (fallocate(store->fd, 0, (off_t)copy.commit_offset, (off_t)copy.commit_bytes) < 0) {
		rc = -errno;
		goto out_unmap;
	}
	/* Views live in memory of their own; pages a file still holds there
	 * (nothing writes them) are given back. */
	fallocate(store->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)copy.header_bytes,
		  (off_t)(copy.views_bytes - copy.header_bytes));
	store->generation = __atomic_load_n(&store->commit->generation, __ATOMIC_ACQUIRE);
	/* One commit per mutation: 2^62 of them is not a file any daemon wrote. */
	if (store->generation > (UINT64_C(1) << 62)) {
		rc = corrupt(reason, reason_size, "committed generation %llu out of range",
			     (unsigned long long)store->generation);
		goto out_unmap;
	}
	char expected_name[64];
	file_name(expected_name, sizeof(expected_name), copy.session_id, false);
	if (strcmp(expected_name, name) != 0) {
		rc = corrupt(reason, reason_size, "the header names session %llu, not the file's",
			     (unsigned long long)copy.session_id);
		goto out_unmap;
	}
	for (uint32_t i = 0; rc == 0 && i < copy.layers; i++)
		rc = layer_recover(store, i, reason, reason_size);
	if (rc < 0)
		goto out_unmap;
	/* Views are not durable: every daemon that adopts a file rebuilds
	 * them from the committed blocks and residual on first use, in views
	 * of its own. */
	for (uint32_t i = 0; i < copy.layers; i++)
		store->room[i].view_valid = false;
	rc = views_open(store);
	if (rc < 0)
		goto out_unmap;
	/* What an adopted file holds counts, even past the budget: refusing
	 * it would lose acknowledged tokens. New reservations then wait
	 * until views are dropped or sessions close. */
	store->budget = budget;
	store->charged = file_allocated(store);
	store_budget_force(budget, store->charged);
	kinds_measure(store);
	*out = store;
	return 0;

out_unmap:
	store_unmap(store);
out_free:
	close(store->fd);
	store_free_memory(store);
	return rc;
}

void store_unlink(struct store *store)
{
	if (store->unlinked)
		return;
	fault_point("close.unlink");
	if (unlinkat(store->dir_fd, store->name, 0) < 0)
		log_warn("store", "cannot remove session file", "path=%s error=%s", store->path,
			 strerror(errno));
	store->unlinked = true;
	fault_point("close.done");
}

void store_close(struct store *store, bool remove_file)
{
	if (!store)
		return;
	if (remove_file) {
		store_unlink(store);
		/* A client may still map the unlinked file: its pages would live
		 * on, charged to nobody. */
		fallocate(store->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)store->file_bytes);
		fallocate(store->view_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
			  (off_t)store->view_bytes);
	}
	store_budget_give(store->budget, store->charged);
	store_unmap(store);
	close(store->fd);
	store_free_memory(store);
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
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", store->view_fd);
	/* A new open file description of the views (never the durable file),
	 * read-only: the client cannot get PROT_WRITE on a MAP_SHARED mapping
	 * of it, and the seals keep anyone from resizing it. */
	int fd = open(proc_path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	return fd;
}

uint64_t store_memory_bytes(const struct store *store)
{
	return file_allocated(store);
}

/* Written bytes of [start, end) of a file: its data extents (tmpfs counts
 * pages reserved but never written as holes). */
static uint64_t range_written(int fd, uint64_t start, uint64_t end)
{
	uint64_t total = 0;
	off_t at = (off_t)start;
	while (fd >= 0 && (uint64_t)at < end) {
		off_t data = lseek(fd, at, SEEK_DATA);
		if (data < 0 || (uint64_t)data >= end)
			break;
		off_t hole = lseek(fd, data, SEEK_HOLE);
		if (hole < 0)
			break;
		total += ((uint64_t)hole < end ? (uint64_t)hole : end) - (uint64_t)data;
		at = hole;
	}
	return total;
}

/* An adopted file's charge by kind: what each region holds written; the
 * rest (reserved, never written) is arena room reserved ahead. */
static void kinds_measure(struct store *store)
{
	const struct store_header *h = store->header;
	uint64_t kinds[KINDS] = { 0 };
	kinds[KIND_HEADERS] = range_written(store->fd, 0, h->header_bytes) +
			      range_written(store->fd, h->commit_offset, h->commit_offset + h->commit_bytes) +
			      fd_allocated(store->view_fd);
	for (uint32_t i = 0; i < h->layers; i++) {
		uint64_t region = layer_region_offset(store, i);
		kinds[KIND_RESIDUAL] += range_written(store->fd, region, region + h->index_offset);
		kinds[KIND_INDEX] += range_written(store->fd, region + h->index_offset,
						   region + h->key_arena_offset);
		kinds[KIND_BLOCKS] += range_written(store->fd, region + h->key_arena_offset,
						    region + h->layer_region_bytes);
	}
	uint64_t measured = kinds[KIND_HEADERS] + kinds[KIND_RESIDUAL] + kinds[KIND_INDEX] +
			    kinds[KIND_BLOCKS];
	if (store->charged > measured)
		kinds[KIND_BLOCKS] += store->charged - measured;
	for (int k = 0; k < KINDS; k++)
		__atomic_store_n(&store->kind_bytes[k], kinds[k], __ATOMIC_RELAXED);
}

void store_memory_add(const struct store *store, struct store_memory *sum)
{
	sum->views += __atomic_load_n(&store->kind_bytes[KIND_VIEWS], __ATOMIC_RELAXED);
	sum->blocks += __atomic_load_n(&store->kind_bytes[KIND_BLOCKS], __ATOMIC_RELAXED);
	sum->residual += __atomic_load_n(&store->kind_bytes[KIND_RESIDUAL], __ATOMIC_RELAXED);
	sum->index += __atomic_load_n(&store->kind_bytes[KIND_INDEX], __ATOMIC_RELAXED);
	sum->headers += __atomic_load_n(&store->kind_bytes[KIND_HEADERS], __ATOMIC_RELAXED);
}

uint64_t store_rebuild_bytes(const struct store *store)
{
	const struct store_header *h = store->header;
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < h->layers; i++) {
		if (__atomic_load_n(&store->room[i].view_valid, __ATOMIC_RELAXED))
			continue;
		uint64_t tokens = __atomic_load_n(&store->layer[i].tokens, __ATOMIC_RELAXED) +
				  VIEW_RESERVE_TOKENS;
		bytes += heads_of(h) * tokens * (h->head_dim_k + h->head_dim_v) * 2;
	}
	return bytes;
}

uint32_t store_layer_tokens(const struct store *store, uint32_t layer)
{
	return __atomic_load_n(&store->layer[layer].tokens, __ATOMIC_ACQUIRE);
}

uint64_t store_layer_sequence(const struct store *store, uint32_t layer)
{
	return __atomic_load_n(&store->room[layer].sequence, __ATOMIC_ACQUIRE);
}

/* ---- mutations ---------------------------------------------------------------- */

/*
 * Compresses a [B, H, tokens, D] block (keys and values, each with its own
 * strides) into the arenas past next's marks, reconstructs it into the
 * views at first_token and writes its index entry past next's count; then
 * counts it in next. Nothing is committed here: until the caller commits
 * next, the block is scratch a crash forgets.
 */
static int block_append(struct store *store, uint32_t layer, struct layer_state *next,
			uint32_t first_token, uint32_t tokens, const uint16_t *keys,
			const zc_strides *key_strides, const uint16_t *values,
			const zc_strides *value_strides, const char *step_compress,
			const char *step_index)
{
	const struct store_header *h = store->header;
	zc_block_shape key_shape = { h->batch, h->kv_heads, tokens, h->head_dim_k };
	zc_block_shape value_shape = { h->batch, h->kv_heads, tokens, h->head_dim_v };
	zc_byte_count key_count, value_count;
	uint8_t *region = layer_region(store, layer);
	int rc;

	if (next->blocks >= h->max_blocks)
		return ZC_EEXHAUSTED;
	rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
	if (rc == 0)
		rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
	if (rc == 0)
		rc = index_grow(store, layer, next->blocks);
	if (rc == 0)
		rc = reserve_index_entry(store, layer, next->blocks);
	if (rc == 0)
		rc = reserve_arena(store, layer, true, next->key_arena_used + key_count.compressed);
	if (rc == 0)
		rc = reserve_arena(store, layer, false, next->value_arena_used + value_count.compressed);
	if (rc < 0)
		return rc;

	uint8_t *key_out = region + h->key_arena_offset + next->key_arena_used;
	uint8_t *value_out = region + h->value_arena_offset + next->value_arena_used;
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
	if (rc < 0) {
		/* Rows of the view may hold the half-written reconstruction. */
		view_valid_set(store, layer, false);
		return rc;
	}
	fault_point(step_compress);

	struct store_block entry = {
		.first_token = first_token,
		.tokens = tokens,
		.valid_tokens = tokens,
		.key_offset = next->key_arena_used,
		.key_bytes = key_count.compressed,
		.value_offset = next->value_arena_used,
		.value_bytes = value_count.compressed,
	};
	store->index[layer].entries[next->blocks] = entry;
	file_index(store, layer)[next->blocks] = entry;
	fault_point(step_index);
	next->blocks++;
	next->key_arena_used += key_count.compressed;
	next->value_arena_used += value_count.compressed;
	next->key_compressed += key_count.compressed;
	next->key_baseline += key_count.baseline;
	next->value_compressed += value_count.compressed;
	next->value_baseline += value_count.baseline;
	return 0;
}

/* Compresses next's whole residual as one block (the rows stay where they
 * are: only the counts move). On failure next is as it was. */
static int residual_to_block(struct store *store, uint32_t layer, struct layer_state *next)
{
	const struct store_header *h = store->header;
	if (next->residual_tokens == 0)
		return 0;
	zc_strides key_strides = residual_strides(h, h->head_dim_k);
	zc_strides value_strides = residual_strides(h, h->head_dim_v);
	struct layer_state attempt = *next;
	int rc = block_append(store, layer, &attempt, next->tokens - next->residual_tokens,
			      next->residual_tokens, key_residual(store, layer), &key_strides,
			      value_residual(store, layer), &value_strides, "flush.compress",
			      "flush.index");
	if (rc < 0)
		return rc;
	attempt.residual_tokens = 0;
	*next = attempt;
	return 0;
}

/* Compresses and commits a full residual on its own. */
static int residual_flush(struct store *store, uint32_t layer)
{
	struct layer_state next = store->layer[layer];
	int rc = residual_to_block(store, layer, &next);
	if (rc == 0 && next.blocks != store->layer[layer].blocks)
		layer_commit(store, layer, &next, "flush.record", "flush.publish");
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

/* Whether rows [at, at + tokens) of every head of a strided buffer are finite. */
static int rows_check_finite(const uint16_t *buffer, const zc_strides *strides, size_t at,
			     const struct store_header *h, uint32_t tokens, uint32_t dim)
{
	for (uint32_t b = 0; b < h->batch; b++)
		for (uint32_t head = 0; head < h->kv_heads; head++) {
			int rc = zc_fp16_check_finite(buffer + b * strides->batch + head * strides->head +
							      at * dim,
						      (size_t)tokens * dim);
			if (rc < 0)
				return rc;
		}
	return 0;
}

static int views_rebuild_layer(struct store *store, uint32_t layer);

/* A direct block: the residual (if any) becomes its own block first, so
 * blocks stay in token order; both commit together. */
static int update_direct(struct store *store, uint32_t layer, uint32_t tokens,
			 const uint16_t *keys, const uint16_t *values)
{
	const struct store_header *h = store->header;
	struct layer_state next = store->layer[layer];
	zc_strides key_input = { (size_t)h->kv_heads * tokens * h->head_dim_k,
				 (size_t)tokens * h->head_dim_k, h->head_dim_k };
	zc_strides value_input = { (size_t)h->kv_heads * tokens * h->head_dim_v,
				   (size_t)tokens * h->head_dim_v, h->head_dim_v };
	uint32_t residual = next.residual_tokens;
	int rc = residual_to_block(store, layer, &next);
	if (rc == 0)
		rc = block_append(store, layer, &next, next.tokens, tokens, keys, &key_input, values,
				  &value_input, "append.compress", "append.index");
	if (rc < 0) {
		/* The residual's rows in the view may hold its reconstruction
		 * now, but the residual stays exact: rebuild before the next read. */
		if (residual > 0)
			view_valid_set(store, layer, false);
		return rc;
	}
	next.tokens += tokens;
	layer_commit(store, layer, &next, "append.record", "append.publish");
	return 0;
}

/* A short streaming block goes into the exact residual (and the views);
 * a residual that fills up is compressed as one block right after. */
static int update_residual(struct store *store, uint32_t layer, uint32_t tokens,
			   const uint16_t *keys, const uint16_t *values)
{
	const struct store_header *h = store->header;
	int rc;

	if (store->layer[layer].residual_tokens + tokens > h->residual_capacity) {
		/* Only after an earlier flush failed for lack of space, or a
		 * crash between an update's commit and its flush. */
		rc = residual_flush(store, layer);
		if (rc < 0)
			return rc;
	}
	struct layer_state next = store->layer[layer];
	zc_strides key_res = residual_strides(h, h->head_dim_k);
	zc_strides value_res = residual_strides(h, h->head_dim_v);
	zc_strides key_view_s = view_strides(h, h->head_dim_k);
	zc_strides value_view_s = view_strides(h, h->head_dim_v);
	rows_copy(key_residual(store, layer), &key_res, next.residual_tokens, keys, h, tokens,
		  h->head_dim_k);
	rows_copy(value_residual(store, layer), &value_res, next.residual_tokens, values, h, tokens,
		  h->head_dim_v);
	/* Staged input sits in memory the client may still write: what counts
	 * is what was copied, so that is what must be finite. */
	rc = rows_check_finite(key_residual(store, layer), &key_res, next.residual_tokens, h, tokens,
			       h->head_dim_k);
	if (rc == 0)
		rc = rows_check_finite(value_residual(store, layer), &value_res, next.residual_tokens, h,
				       tokens, h->head_dim_v);
	if (rc < 0)
		return rc;
	rows_copy(key_view(store, layer), &key_view_s, next.tokens, keys, h, tokens, h->head_dim_k);
	rows_copy(value_view(store, layer), &value_view_s, next.tokens, values, h, tokens,
		  h->head_dim_v);
	fault_point("residual.copy");
	next.residual_tokens += tokens;
	next.tokens += tokens;
	layer_commit(store, layer, &next, "residual.record", "residual.publish");
	if (next.residual_tokens >= h->residual_tokens) {
		/* The tokens are stored exactly either way; a failed flush is
		 * retried on the next update and only costs compression. */
		rc = residual_flush(store, layer);
		if (rc < 0)
			log_warn("store", "residual flush deferred", "session=%llu layer=%u error=%s",
				 (unsigned long long)h->session_id, layer,
				 rc == STORE_EBUDGET ? "memory budget exhausted" : zc_strerror(rc));
	}
	return 0;
}

int store_update(struct store *store, uint32_t layer, uint32_t tokens,
		 const uint16_t *keys, const uint16_t *values)
{
	const struct store_header *h = store->header;
	int rc;

	if (layer >= h->layers || tokens == 0)
		return ZC_EINVALID;
	const struct layer_state *l = &store->layer[layer];
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
	if (!store->room[layer].view_valid) {
		rc = views_rebuild_layer(store, layer);
		if (rc < 0)
			return rc;
	}
	rc = reserve_residual(store, layer);
	if (rc == 0)
		rc = reserve_views(store, layer, (uint64_t)l->tokens + tokens);
	if (rc < 0)
		return rc;

	sequence_begin(store, layer);
	rc = direct ? update_direct(store, layer, tokens, keys, values) :
		      update_residual(store, layer, tokens, keys, values);
	mirror_layer(store, layer);
	sequence_end(store, layer);
	return rc;
}

/* What trimming `tokens` from a layer leaves (next starts as its state);
 * returns the tokens cut. Pure: nothing is written. */
static uint32_t trim_state(const struct store *store, uint32_t layer, uint32_t tokens,
			   struct layer_state *next)
{
	const struct store_header *h = store->header;
	const struct store_block *index = store->index[layer].entries;
	uint32_t cut = tokens < next->tokens ? tokens : next->tokens;
	uint32_t keep = next->tokens - cut;

	if (cut <= next->residual_tokens) {
		next->residual_tokens -= cut;
	} else {
		next->residual_tokens = 0;
		/* Blocks are appended in order, so the arenas unwind like a
		 * stack; a block cut in the middle stays whole (re-encoding its
		 * prefix would change tokens the model already used). */
		while (next->blocks > 0 && index[next->blocks - 1].first_token >= keep) {
			const struct store_block *last = &index[next->blocks - 1];
			zc_block_shape key_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_k };
			zc_block_shape value_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_v };
			zc_byte_count key_count = { 0 }, value_count = { 0 };
			zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
			zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
			next->key_compressed -= key_count.compressed;
			next->key_baseline -= key_count.baseline;
			next->value_compressed -= value_count.compressed;
			next->value_baseline -= value_count.baseline;
			next->key_arena_used = last->key_offset;
			next->value_arena_used = last->value_offset;
			next->blocks--;
		}
	}
	next->tokens = keep;
	return cut;
}

/*
 * Trims layers [first, first + count) by `tokens` each as one mutation:
 * every changed layer's record is written under one generation, which is
 * then published, so a crash leaves all of them trimmed or none.
 */
static int trim_layers(struct store *store, uint32_t first, uint32_t count, uint32_t tokens,
		       uint32_t *trimmed)
{
	struct layer_state *next = malloc(count * sizeof(*next));
	uint64_t generation = store->generation + 1;
	uint32_t most = 0;
	bool changed = false;

	if (!next)
		return -ENOMEM;
	for (uint32_t i = 0; i < count; i++) {
		next[i] = store->layer[first + i];
		uint32_t cut = trim_state(store, first + i, tokens, &next[i]);
		if (cut > most)
			most = cut;
		if (cut == 0)
			continue;
		record_write(store, first + i, &next[i], generation);
		fault_point("trim.record");
		changed = true;
	}
	if (changed) {
		generation_publish(store, generation);
		fault_point("trim.publish");
	}
	for (uint32_t i = 0; i < count; i++) {
		uint32_t layer = first + i;
		if (next[i].tokens == store->layer[layer].tokens)
			continue;
		sequence_begin(store, layer);
		next[i].active = 1u - store->layer[layer].active;
		layer_state_set(store, layer, &next[i]);
		mirror_layer(store, layer);
		sequence_end(store, layer);
	}
	free(next);
	*trimmed = most;
	return 0;
}

int store_trim(struct store *store, uint32_t tokens, uint32_t *trimmed)
{
	return trim_layers(store, 0, store->header->layers, tokens, trimmed);
}

int store_trim_layer(struct store *store, uint32_t layer, uint32_t tokens, uint32_t *trimmed)
{
	if (layer >= store->header->layers)
		return ZC_EINVALID;
	return trim_layers(store, layer, 1, tokens, trimmed);
}

bool store_update_compresses(const struct store *store, uint32_t layer, uint32_t tokens)
{
	const struct store_header *h = store->header;
	if (layer >= h->layers)
		return false;
	uint32_t residual = __atomic_load_n(&store->layer[layer].residual_tokens, __ATOMIC_RELAXED);
	return h->policy == STORE_POLICY_PER_CALL || tokens >= h->residual_tokens ||
	       residual + tokens >= h->residual_tokens;
}

void store_layer_stats(const struct store *store, uint32_t layer, struct store_layer_stats *out)
{
	const struct store_header *h = store->header;
	const struct layer_state *l = &store->layer[layer];
	uint64_t heads = heads_of(h);

	*out = (struct store_layer_stats){ .layer = layer };
	out->tokens = l->tokens;
	out->residual_tokens = l->residual_tokens;
	out->blocks = l->blocks;
	out->key.compressed = l->key_compressed;
	out->key.baseline = l->key_baseline;
	out->value.compressed = l->value_compressed;
	out->value.baseline = l->value_baseline;
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
		uint32_t t = __atomic_load_n(&store->layer[i].tokens, __ATOMIC_ACQUIRE);
		if (t < low)
			low = t;
		if (t > high)
			high = t;
	}
	*min_tokens = low;
	*max_tokens = high;
}

/* Views are not durable, so dropping them needs no commit: readers are
 * told first (view_valid, under the seqlock), then the pages go. */
int store_drop_views(struct store *store, uint64_t *freed)
{
	const struct store_header *h = store->header;
	uint64_t before = file_allocated(store);
	int rc = 0;

	charge_sync(store, before);
	for (uint32_t i = 0; i < h->layers && rc == 0; i++) {
		struct layer_room *room = &store->room[i];
		uint64_t start = store_key_view_offset(store, i);
		uint64_t bytes = view_bytes(h, h->head_dim_k) + view_bytes(h, h->head_dim_v);
		/* An invalid view holds nothing but pages a reader faulted in
		 * (or an adopted file's old views): those go too. */
		if (room->view_valid && room->reserved_view_tokens == 0)
			continue;
		sequence_begin(store, i);
		view_valid_set(store, i, false);
		room->reserved_view_tokens = 0;
		mirror_layer(store, i);
		fault_point("drop.mark");
		if (fallocate(store->view_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)start,
			      (off_t)bytes) < 0)
			rc = -errno;
		fault_point("drop.punch");
		sequence_end(store, i);
	}
	uint64_t after = file_allocated(store);
	uint64_t released = before > after ? before - after : 0;
	if (released > store->charged)
		released = store->charged;
	store->charged -= released;
	store_budget_give(store->budget, released);
	uint64_t views = __atomic_load_n(&store->kind_bytes[KIND_VIEWS], __ATOMIC_RELAXED);
	kind_add(store, KIND_VIEWS, -(int64_t)(released < views ? released : views));
	*freed = released;
	return rc;
}

/* Reconstructs one block's valid tokens into the views. A block cut by
 * trim goes through a scratch buffer, so its dead tail never lands past
 * its valid tokens (or past the end of the view). */
static int block_restore(struct store *store, uint32_t layer, uint32_t i)
{
	const struct store_header *h = store->header;
	const struct store_block *block = &store->index[layer].entries[i];
	uint32_t valid = block_valid_tokens(store, layer, &store->layer[layer], i);
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

		if (valid == block->tokens) {
			rc = zc_block_reconstruct(&store->codec, kind, &shape, data, bytes,
						  view + (size_t)block->first_token * dim, &strides);
		} else {
			/* Head by head (each head's payload is contiguous), so the
			 * scratch is one head's rows, not the whole block's. */
			zc_block_shape one = { 1, 1, block->tokens, dim };
			zc_byte_count head_count;
			size_t head_elements = (size_t)block->tokens * dim;
			zc_strides packed = { head_elements, head_elements, dim };
			rc = zc_block_count_bytes(&store->codec, kind, &one, &head_count);
			uint16_t *scratch = rc == 0 ? malloc(head_elements * 2) : NULL;
			if (rc == 0 && !scratch)
				rc = -ENOMEM;
			for (uint64_t head = 0; rc == 0 && head < heads_of(h); head++) {
				rc = zc_block_reconstruct(&store->codec, kind, &one,
							  data + head * head_count.compressed,
							  head_count.compressed, scratch, &packed);
				uint16_t *to = view + (head / h->kv_heads) * strides.batch +
					       (head % h->kv_heads) * strides.head +
					       (size_t)block->first_token * dim;
				if (rc == 0)
					memcpy(to, scratch, (size_t)valid * dim * 2);
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
	const struct store_header *h = store->header;
	const struct layer_state *l = &store->layer[layer];
	int rc = reserve_views(store, layer, l->tokens);
	if (rc < 0)
		return rc;
	sequence_begin(store, layer);
	for (uint32_t i = 0; i < l->blocks && rc == 0; i++) {
		rc = block_restore(store, layer, i);
		fault_point("rebuild.block");
	}
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
		view_valid_set(store, layer, true);
		__atomic_fetch_add(&view_rebuilds, 1, __ATOMIC_RELAXED);
		mirror_layer(store, layer);
		fault_point("rebuild.done");
	}
	sequence_end(store, layer);
	return rc;
}

int store_rebuild_views(struct store *store)
{
	for (uint32_t i = 0; i < store->header->layers; i++) {
		if (store->room[i].view_valid)
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
		/* A worker may be rebuilding or appending to this store. */
		if (!__atomic_load_n(&store->room[i].view_valid, __ATOMIC_RELAXED))
			tokens += __atomic_load_n(&store->layer[i].tokens, __ATOMIC_RELAXED);
	}
	return tokens * heads_of(h) * ((uint64_t)h->head_dim_k + h->head_dim_v);
}
