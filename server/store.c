/*
 * One session's store: its durable file (commit area, exact residual,
 * block index), its blocks in the uid's pool, and the session map readers
 * get (header, block tables, and the fp16 views or a readers' residual).
 * Create, adopt or fork it, append blocks, trim, count bytes, drop and
 * rebuild views. The numerics are the codec's; this file decides where
 * bytes go and in which order they become durable (docs/DURABILITY.md)
 * and visible (zipcache/map.h).
 *
 * The daemon keeps its working state (shape, codec, every layer's counts,
 * the block index) in private memory. What it writes into the file and
 * the map is a copy: the commit area and index for the next daemon, the
 * map for readers. It never reads either back except when it adopts a
 * file, and then it checks every field first, so a client that found a
 * way to write its mapping can spoil only its own data.
 */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec_fanout.h"
#include "fault.h"
#include "fd_write.h"
#include "log.h"
#include "pages.h"
#include "pool.h"
#include "retain.h"

/* Views are reserved this many tokens ahead: one fallocate per head
 * every 256 decode steps instead of one per step. */
#define VIEW_RESERVE_TOKENS 256u

/* Residual rows likewise, in smaller steps: after a flush they are
 * given back, so a decode loop's residual costs the rows it holds. */
#define RESIDUAL_RESERVE_TOKENS 32u

/* A file or map larger than this is refused: the address space and tmpfs
 * have limits even when untouched pages cost nothing. */
#define STORE_MAX_FILE_BYTES (UINT64_C(1) << 44)

/* Compression scratch a worker keeps between jobs; a larger block gets a
 * buffer of its own for the call. */
#define SCRATCH_KEEP_BYTES (UINT64_C(64) << 20)

/* The daemon's own copy of a layer's committed state: the truth while it
 * runs. A mutation works on a copy and commits it whole. */
struct layer_state {
	uint32_t tokens;
	uint32_t residual_tokens;
	uint32_t residual_start;      /* the residual's first row in its buffers */
	uint32_t blocks;
	uint32_t active;              /* the record slot that holds the committed state */
	uint64_t key_compressed, key_baseline, value_compressed, value_baseline;
};

/* What is not durable: reservations and the readers' view. */
struct layer_room {
	uint64_t reserved_view_tokens;   /* views fallocated up to this token */
	uint32_t reserved_residual_rows; /* residual rows fallocated (every head, K and V) */
	bool view_valid;
	bool flush_pending;              /* a deferred flush holds rows of the residual */
	uint32_t flush_rows;             /* how many (its first rows) */
	uint64_t sequence;
	uint64_t generation;             /* view drops and rebuilds */
};

/* What the store's memory holds, by kind (store_memory). */
enum memory_kind { KIND_VIEWS, KIND_RESIDUAL, KIND_INDEX, KIND_HEADERS, KINDS };

struct layer_index {
	store_block *entries;
	uint32_t capacity;
};

/*
 * Saliency by attention (docs/ATTEND.md): per layer, the attention mass
 * clients sent for the residual's rows, row i being the residual's i-th
 * token (not its buffer row). In memory only: after an adoption, for rows
 * nobody sent a mass for, and for sessions ranked by key norm, there is
 * none, and a flush falls back as mass_scores says.
 */
struct layer_mass {
	float *mass;      /* [batch * kv_heads][residual_capacity] */
	uint8_t *known;   /* [residual_capacity]: 1 where mass holds a client's figure */
};

struct store {
	struct store_budget *budget;
	uint64_t charged;         /* bytes of budget.used that are this store's */
	uint64_t kind_bytes[KINDS];   /* charged, by what the pages hold (atomic) */
	struct pool *pool;        /* borrowed: the owner's blocks */
	int dir_fd;               /* borrowed: the shm-dir */
	int fd;                   /* the durable file: never handed out */
	bool unlinked;
	uint8_t *base;
	size_t file_bytes;
	/* What readers map: a memfd sealed against resizing, so no descriptor
	 * a client holds can truncate memory the daemon writes. Not durable:
	 * rebuilt after adoption. */
	int map_fd;
	uint8_t *map_base;
	/* map_base came with a retained map: the pages the map holds are in
	 * its page tables already (see reserve_populate). */
	bool map_warm;
	zc_map_header *map;
	zc_map_header layout;             /* private copy of the map's layout */
	struct store_header *header;      /* private copy: shape, codec, layout */
	struct store_commit_area *commit; /* in the file */
	uint64_t generation;              /* last committed */
	struct layer_state *layer;
	struct layer_room *room;
	struct layer_index *index;
	struct layer_mass *mass;          /* NULL unless saliency is by attention */
	/* Held while an index grows (realloc) and while the loop thread walks
	 * the indexes (store_shared_bytes) as a job appends. */
	pthread_mutex_t index_lock;
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
static int map_try(uint64_t bytes)
{
	uint64_t used = __atomic_load_n(&mapped_total, __ATOMIC_RELAXED);
	do {
		if (mapped_limit && (used + bytes < used || used + bytes > mapped_limit))
			return ZC_EEXHAUSTED;
	} while (!__atomic_compare_exchange_n(&mapped_total, &used, used + bytes, true,
					      __ATOMIC_RELAXED, __ATOMIC_RELAXED));
	return 0;
}

/* map_try; over the bound, the mappings retained maps keep (retain.h)
 * go first, pages and all, as they do under memory pressure. */
static int map_take(uint64_t bytes)
{
	int rc = map_try(bytes);
	if (rc < 0 && retain_maps_release(true, 0, bytes) > 0)
		rc = map_try(bytes);
	return rc;
}

static void map_give(uint64_t bytes)
{
	__atomic_fetch_sub(&mapped_total, bytes, __ATOMIC_RELAXED);
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

static bool views_full(const struct store *store)
{
	return store->header->views == ZC_VIEWS_FULL;
}

uint64_t store_key_view_offset(const struct store *store, uint32_t layer)
{
	const zc_map_header *m = &store->layout;
	return m->views_offset ? m->views_offset + layer * m->view_layer_bytes : 0;
}

uint64_t store_value_view_offset(const struct store *store, uint32_t layer)
{
	const zc_map_header *m = &store->layout;
	return m->views_offset ? store_key_view_offset(store, layer) + m->key_view_bytes : 0;
}

static uint64_t layer_region_offset(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	return h->layers_offset + (uint64_t)layer * h->layer_region_bytes;
}

static uint8_t *layer_region(const struct store *store, uint32_t layer)
{
	return store->base + layer_region_offset(store, layer);
}

static store_block *file_index(const struct store *store, uint32_t layer)
{
	return (store_block *)(layer_region(store, layer) + store->header->index_offset);
}

static uint64_t table_offset(const struct store *store, uint32_t layer)
{
	return store->layout.table_offset + (uint64_t)layer * store->layout.table_bytes;
}

static zc_map_block *map_table(const struct store *store, uint32_t layer)
{
	return (zc_map_block *)(store->map_base + table_offset(store, layer));
}

static uint16_t *key_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->map_base + store_key_view_offset(store, layer));
}

static uint16_t *value_view(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(store->map_base + store_value_view_offset(store, layer));
}

static uint16_t *key_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->key_residual_offset);
}

static uint16_t *value_residual(const struct store *store, uint32_t layer)
{
	return (uint16_t *)(layer_region(store, layer) + store->header->value_residual_offset);
}

/* The readers' copy of the residual (views = none). */
static uint64_t map_residual_offset(const struct store *store, uint32_t layer, bool keys)
{
	const zc_map_header *m = &store->layout;
	return m->residual_offset + layer * m->residual_bytes + (keys ? 0 : m->key_residual_bytes);
}

static uint16_t *map_residual(const struct store *store, uint32_t layer, bool keys)
{
	return (uint16_t *)(store->map_base + map_residual_offset(store, layer, keys));
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
		/* Version 3 and 4 files hold 0 there: key norm. */
		.saliency = (int)h->saliency,
	};
}

/* The tokens block i of a layer still holds: up to the next block, or for
 * the last one up to where the residual begins. */
static uint32_t block_valid_tokens(const struct store *store, uint32_t layer,
				   const struct layer_state *state, uint32_t i)
{
	const store_block *index = store->index[layer].entries;
	uint32_t end = i + 1 < state->blocks ? index[i + 1].first_token :
					       state->tokens - state->residual_tokens;
	return end - index[i].first_token;
}

/* The readers' table entries [from, blocks) of a layer from its private
 * state: the index entries, with valid_tokens the rows that still belong
 * to the layer (zipcache/map.h). The index entries themselves keep the
 * rows they were written with: committed entries never change. */
static void map_entries_write(struct store *store, uint32_t layer, uint32_t from)
{
	const struct layer_state *l = &store->layer[layer];
	zc_map_block *table = map_table(store, layer);
	for (uint32_t i = from; i < l->blocks; i++) {
		table[i] = store->index[layer].entries[i];
		table[i].valid_tokens = block_valid_tokens(store, layer, l, i);
	}
}

static uint64_t fd_allocated(int fd)
{
	struct stat st;
	return fd >= 0 && fstat(fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

/* What the store holds in memory: the durable file and the map (its
 * blocks are the pool's). */
static uint64_t file_allocated(const struct store *store)
{
	return fd_allocated(store->fd) + fd_allocated(store->map_fd);
}

static void kinds_measure(struct store *store);

static void kind_add(struct store *store, enum memory_kind kind, int64_t bytes)
{
	__atomic_fetch_add(&store->kind_bytes[kind], (uint64_t)bytes, __ATOMIC_RELAXED);
}

/* Growth nobody reserved is a reader's faults, and readers map only the
 * map (its views, mostly). */
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

struct pool *store_pool(const struct store *store)
{
	return store->pool;
}

/* The daemon writes reserved pages through its own mappings (residual
 * rows, views). Mapping them when they are reserved, one call per range,
 * takes the first-touch fault off the decode step that writes each page
 * (about one fault per step otherwise). A refusal only leaves the faults
 * where they were. Pages a retained map brought along are mapped already,
 * unless the file grew (`grew`): walking their tables again is skipped. */
static void reserve_populate(struct store *store, int fd, uint64_t start, uint64_t end, bool grew)
{
	uint8_t *base = NULL;
	uint64_t bytes = 0;
	if (!grew && fd == store->map_fd && store->map_warm)
		return;
	if (fd == store->fd) {
		base = store->base;
		bytes = store->file_bytes;
	} else if (fd == store->map_fd) {
		base = store->map_base;
		bytes = store->layout.map_bytes;
	}
	if (!base || end > bytes || end <= start)
		return;
	(void)madvise(base + start, (size_t)(end - start), MADV_POPULATE_WRITE);
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
	reserve_populate(store, fd, start, end, grown > 0);
	if (grown > end - start)
		grown = end - start;
	store_budget_give(store->budget, end - start - grown);
	store->charged += grown;
	kind_add(store, kind, (int64_t)grown);
	/* Anything else the file gained (a client's read faults) is charged too. */
	charge_sync(store, after);
	return 0;
}

/*
 * reserve_in for the same slice of every head of a buffer: `count` ranges
 * of `bytes` at first + i * stride. One budget charge and one look at the
 * file before and after all the fallocates, instead of four fstats per
 * head: a decode step that crosses a reservation boundary pays count + 2
 * system calls, not 5 * count. When the budget refuses the whole, each
 * range goes through reserve_in (pages that exist already cost nothing).
 */
static int reserve_heads(struct store *store, int fd, uint64_t first, uint64_t stride,
			 uint64_t count, uint64_t bytes, enum memory_kind kind)
{
	uint64_t total = 0;
	int rc = 0;

	if (bytes == 0 || count == 0)
		return 0;
	for (uint64_t i = 0; i < count; i++) {
		uint64_t offset = first + i * stride;
		total += round_up(offset + bytes, PAGE_BYTES) - offset / PAGE_BYTES * PAGE_BYTES;
	}
	if (store_budget_take(store->budget, total) < 0) {
		for (uint64_t i = 0; i < count && rc == 0; i++)
			rc = reserve_in(store, fd, first + i * stride, bytes, kind);
		return rc;
	}
	uint64_t before = fd_allocated(fd);
	uint64_t done = 0;
	for (; done < count; done++) {
		uint64_t offset = first + done * stride;
		uint64_t start = offset / PAGE_BYTES * PAGE_BYTES;
		uint64_t end = round_up(offset + bytes, PAGE_BYTES);
		if (fallocate(fd, 0, (off_t)start, (off_t)(end - start)) < 0) {
			rc = -errno;
			log_warn("store", "fallocate failed", "path=%s offset=%llu bytes=%llu error=%s",
				 store->path, (unsigned long long)start,
				 (unsigned long long)(end - start), strerror(-rc));
			break;
		}
	}
	/* As in reserve_in: the provisional charge becomes what the file grew. */
	uint64_t after = fd_allocated(fd);
	uint64_t grown = after > before ? after - before : 0;
	for (uint64_t i = 0; i < done; i++) {
		uint64_t offset = first + i * stride;
		reserve_populate(store, fd, offset / PAGE_BYTES * PAGE_BYTES,
				 round_up(offset + bytes, PAGE_BYTES), grown > 0);
	}
	if (grown > total)
		grown = total;
	store_budget_give(store->budget, total - grown);
	store->charged += grown;
	kind_add(store, kind, (int64_t)grown);
	return rc;
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
		int rc = reserve_heads(store, store->map_fd, view + from * dim * 2,
				       (uint64_t)h->max_tokens * dim * 2, heads, (to - from) * dim * 2,
				       KIND_VIEWS);
		if (rc < 0)
			return rc;
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

/* Reserves residual rows [0, rows) of every head, K and V, a step ahead
 * (again after an adoption: reservations are not durable). With views =
 * none readers have a residual of their own in the map, reserved alike. */
static int reserve_residual(struct store *store, uint32_t layer, uint32_t rows)
{
	const struct store_header *h = store->header;
	struct layer_room *l = &store->room[layer];
	if (rows <= l->reserved_residual_rows)
		return 0;
	uint64_t target = (uint64_t)rows + RESIDUAL_RESERVE_TOKENS;
	if (target > h->residual_capacity)
		target = h->residual_capacity;
	uint64_t from = l->reserved_residual_rows;
	for (int copy = 0; copy < (store->layout.residual_offset ? 2 : 1); copy++) {
		int fd = copy == 0 ? store->fd : store->map_fd;
		for (int tensor = 0; tensor < 2; tensor++) {
			uint64_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
			uint64_t base = copy == 0 ? layer_region_offset(store, layer) +
							    (tensor == 0 ? h->key_residual_offset :
									   h->value_residual_offset) :
						    map_residual_offset(store, layer, tensor == 0);
			int rc = reserve_heads(store, fd, base + from * dim * 2,
					       (uint64_t)h->residual_capacity * dim * 2, heads_of(h),
					       (target - from) * dim * 2, KIND_RESIDUAL);
			if (rc < 0)
				return rc;
		}
	}
	l->reserved_residual_rows = (uint32_t)target;
	return 0;
}

/* Once a commit left the residual empty its rows are scratch: their pages
 * go back (both copies), so an idle layer's residual costs nothing. */
static void residual_release(struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	struct layer_room *l = &store->room[layer];
	if (l->reserved_residual_rows == 0 || store->layer[layer].residual_tokens != 0)
		return;
	uint64_t before = file_allocated(store);
	fallocate(store->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
		  (off_t)layer_region_offset(store, layer), (off_t)h->index_offset);
	if (store->layout.residual_offset)
		fallocate(store->map_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
			  (off_t)map_residual_offset(store, layer, true), (off_t)store->layout.residual_bytes);
	uint64_t after = file_allocated(store);
	uint64_t released = before > after ? before - after : 0;
	if (released > store->charged)
		released = store->charged;
	store->charged -= released;
	store_budget_give(store->budget, released);
	uint64_t held = __atomic_load_n(&store->kind_bytes[KIND_RESIDUAL], __ATOMIC_RELAXED);
	kind_add(store, KIND_RESIDUAL, -(int64_t)(released < held ? released : held));
	l->reserved_residual_rows = 0;
}

/* Index pages (the file's, and the readers' table) are reserved as
 * entries reach them. */
static int reserve_index_entry(struct store *store, uint32_t layer, uint32_t entry)
{
	uint64_t entry_bytes = sizeof(store_block);
	uint64_t start = (uint64_t)entry * entry_bytes;
	if (entry > 0 && start / PAGE_BYTES == (start - 1) / PAGE_BYTES &&
	    (start + entry_bytes - 1) / PAGE_BYTES == start / PAGE_BYTES)
		return 0;
	uint64_t index = layer_region_offset(store, layer) + store->header->index_offset;
	int rc = reserve_in(store, store->fd, index + start, entry_bytes, KIND_INDEX);
	if (rc == 0)
		rc = reserve_in(store, store->map_fd, table_offset(store, layer) + start, entry_bytes,
				KIND_INDEX);
	return rc;
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
	pthread_mutex_lock(&store->index_lock);
	store_block *entries = realloc(index->entries, capacity * sizeof(*entries));
	if (entries) {
		index->entries = entries;
		index->capacity = (uint32_t)capacity;
	}
	pthread_mutex_unlock(&store->index_lock);
	return entries ? 0 : -ENOMEM;
}

/* A defensive check for what cannot happen (SQLite's NEVER()). */
#define NEVER(condition) __builtin_expect(!!(condition), 0)

/* ---- readers' copy ------------------------------------------------------- */

static void sequence_begin(struct store *store, uint32_t layer)
{
	struct layer_room *l = &store->room[layer];
	__atomic_store_n(&l->sequence, l->sequence | 1, __ATOMIC_RELAXED);
	__atomic_store_n(&store->map->layer[layer].sequence, l->sequence, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}

static void sequence_end(struct store *store, uint32_t layer)
{
	struct layer_room *l = &store->room[layer];
	__atomic_store_n(&l->sequence, l->sequence + 1, __ATOMIC_RELEASE);
	__atomic_store_n(&store->map->layer[layer].sequence, l->sequence, __ATOMIC_RELEASE);
}

/* Copies a layer's private state into the header readers see. */
static void mirror_layer(struct store *store, uint32_t layer)
{
	const struct layer_state *l = &store->layer[layer];
	zc_map_layer *p = &store->map->layer[layer];
	p->residual_tokens = l->residual_tokens;
	p->blocks = l->blocks;
	p->generation = store->room[layer].generation;
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
	r->residual_start = next->residual_tokens ? next->residual_start : 0;
	r->reserved[0] = r->reserved[1] = 0;
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
	__atomic_store_n(&l->blocks, next->blocks, __ATOMIC_RELEASE);
	l->active = next->active;
	l->residual_start = next->residual_tokens ? next->residual_start : 0;
	l->key_compressed = next->key_compressed;
	l->key_baseline = next->key_baseline;
	l->value_compressed = next->value_compressed;
	l->value_baseline = next->value_baseline;
	__atomic_store_n(&l->residual_tokens, next->residual_tokens, __ATOMIC_RELEASE);
	__atomic_store_n(&l->tokens, next->tokens, __ATOMIC_RELEASE);
}

static void view_valid_set(struct store *store, uint32_t layer, bool valid)
{
	struct layer_room *room = &store->room[layer];
	if (room->view_valid != valid)
		room->generation++;
	__atomic_store_n(&room->view_valid, valid, __ATOMIC_RELEASE);
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

/* Drops the references of a layer's entries [from, to): blocks no longer
 * named by any committed state (or never committed). */
static void blocks_unref(struct store *store, uint32_t layer, uint32_t from, uint32_t to)
{
	for (uint32_t i = from; i < to; i++)
		pool_unref(store->pool, store->index[layer].entries[i].key_offset);
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
	if (p->views != ZC_VIEWS_FULL && p->views != ZC_VIEWS_NONE)
		return ZC_EINVALID;
	if (!p->name || strlen(p->name) >= STORE_NAME_BYTES)
		return ZC_EINVALID;
	if (p->model_id && strlen(p->model_id) >= STORE_NAME_BYTES)
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

/* `count` page-rounded regions of `bytes` each at *offset. */
static bool regions_add(uint64_t *offset, uint64_t count, uint64_t bytes)
{
	uint64_t rounded, total;
	if (__builtin_add_overflow(bytes, PAGE_BYTES - 1, &rounded))
		return false;
	rounded = rounded / PAGE_BYTES * PAGE_BYTES;
	return !__builtin_mul_overflow(rounded, count, &total) && region_add(offset, total);
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
	uint64_t offset = 0, key_res, value_res;

	if (!mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_k * 2, &key_res) ||
	    !mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_v * 2, &value_res))
		return ZC_EEXHAUSTED;
	if (!region_add(&offset, sizeof(*h)))
		return ZC_EEXHAUSTED;
	h->header_bytes = (uint32_t)offset;
	h->max_blocks = h->max_tokens;
	h->commit_offset = offset;
	if (!region_add(&offset, sizeof(struct store_commit_area) +
					 2 * (uint64_t)h->layers * sizeof(struct store_layer_commit)))
		return ZC_EEXHAUSTED;
	h->commit_bytes = offset - h->commit_offset;
	h->layers_offset = offset;

	uint64_t region = 0;
	h->key_residual_offset = region;
	bool ok = region_add(&region, key_res);
	h->value_residual_offset = region;
	ok = ok && region_add(&region, value_res);
	h->index_offset = region;
	ok = ok && region_add(&region, h->max_blocks * sizeof(store_block));
	h->layer_region_bytes = region;
	if (!ok || !regions_add(&offset, h->layers, region))
		return ZC_EEXHAUSTED;
	h->file_bytes = offset;
	return 0;
}

/* The session map's layout (zipcache/map.h) for a checked header: the one
 * definition readers and the daemon share. */
static int map_layout(const struct store_header *h, zc_map_header *m)
{
	uint64_t heads = (uint64_t)h->batch * h->kv_heads, offset = 0, bytes;

	memset(m, 0, sizeof(*m));
	memcpy(m->magic, ZC_MAP_MAGIC, sizeof(m->magic));
	m->version = ZC_MAP_VERSION;
	m->session_id = h->session_id;
	m->layers = h->layers;
	m->batch = h->batch;
	m->kv_heads = h->kv_heads;
	m->head_dim_k = h->head_dim_k;
	m->head_dim_v = h->head_dim_v;
	m->max_tokens = h->max_tokens;
	m->policy = h->policy;
	m->residual_tokens = h->residual_tokens;
	m->residual_capacity = h->residual_capacity;
	m->views = h->views;
	m->hi_bits = h->hi_bits;
	m->lo_bits = h->lo_bits;
	m->hi_fraction = h->hi_fraction;
	m->group_size = h->group_size;
	m->quantize_values = h->quantize_values;
	m->max_blocks = h->max_blocks;
	m->pool_bytes = POOL_CAPACITY_BYTES;
	if (!region_add(&offset, sizeof(*m) + (uint64_t)h->layers * sizeof(m->layer[0])))
		return ZC_EEXHAUSTED;
	m->header_bytes = (uint32_t)offset;
	m->table_offset = offset;
	m->table_bytes = round_up(h->max_blocks * sizeof(zc_map_block), PAGE_BYTES);
	if (!regions_add(&offset, h->layers, m->table_bytes))
		return ZC_EEXHAUSTED;
	if (h->views == ZC_VIEWS_NONE) {
		uint64_t key, value;
		if (!mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_k * 2, &key) ||
		    !mul3(heads, h->residual_capacity, (uint64_t)h->head_dim_v * 2, &value))
			return ZC_EEXHAUSTED;
		m->residual_offset = offset;
		m->key_residual_bytes = round_up(key, PAGE_BYTES);
		m->residual_bytes = m->key_residual_bytes + round_up(value, PAGE_BYTES);
		if (!regions_add(&offset, h->layers, m->residual_bytes))
			return ZC_EEXHAUSTED;
	} else {
		uint64_t key, value;
		if (!mul3(heads, h->max_tokens, (uint64_t)h->head_dim_k * 2, &key) ||
		    !mul3(heads, h->max_tokens, (uint64_t)h->head_dim_v * 2, &value) ||
		    __builtin_add_overflow(round_up(key, PAGE_BYTES), round_up(value, PAGE_BYTES), &bytes))
			return ZC_EEXHAUSTED;
		m->views_offset = offset;
		m->key_view_bytes = round_up(key, PAGE_BYTES);
		m->view_layer_bytes = bytes;
		if (!regions_add(&offset, h->layers, bytes))
			return ZC_EEXHAUSTED;
	}
	m->map_bytes = offset;
	return 0;
}

static void store_free_memory(struct store *store)
{
	if (store->index)
		for (uint32_t i = 0; i < store->header->layers; i++)
			free(store->index[i].entries);
	free(store->index);
	if (store->mass)
		for (uint32_t i = 0; i < store->header->layers; i++) {
			free(store->mass[i].mass);
			free(store->mass[i].known);
		}
	free(store->mass);
	free(store->layer);
	free(store->room);
	free(store->header);
	pthread_mutex_destroy(&store->index_lock);
	free(store);
}

/* The private state of a store with `h`'s shape (h is copied). */
static int store_alloc(const struct store_header *h, struct store **out)
{
	struct store *store = calloc(1, sizeof(*store));
	if (!store)
		return -ENOMEM;
	store->fd = -1;
	store->map_fd = -1;
	pthread_mutex_init(&store->index_lock, NULL);
	store->header = malloc(sizeof(*h));
	if (!store->header) {
		pthread_mutex_destroy(&store->index_lock);
		free(store);
		return -ENOMEM;
	}
	memcpy(store->header, h, sizeof(*h));
	store->layer = calloc(h->layers, sizeof(*store->layer));
	store->room = calloc(h->layers, sizeof(*store->room));
	store->index = calloc(h->layers, sizeof(*store->index));
	if (!store->layer || !store->room || !store->index || map_layout(h, &store->layout) < 0) {
		/* Decided before the free: store->layer is gone after it. */
		int rc = store->layer && store->room && store->index ? ZC_EEXHAUSTED : -ENOMEM;
		store_free_memory(store);
		return rc;
	}
	store->codec = header_codec(h);
	if (store->codec.saliency == ZC_SALIENCY_ATTENTION && h->residual_capacity > 0) {
		uint64_t heads = (uint64_t)h->batch * h->kv_heads;
		bool ok = (store->mass = calloc(h->layers, sizeof(*store->mass))) != NULL;
		for (uint32_t i = 0; ok && i < h->layers; i++) {
			store->mass[i].mass = calloc(heads * h->residual_capacity, sizeof(float));
			store->mass[i].known = calloc(h->residual_capacity, 1);
			ok = store->mass[i].mass && store->mass[i].known;
		}
		if (!ok) {
			store_free_memory(store);
			return -ENOMEM;
		}
	}
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
	store->commit = (struct store_commit_area *)(store->base + store->header->commit_offset);
	return 0;
}

/*
 * What a retained map tells the next session whose views lie where its
 * last session's did: the view rows that session reserved in each layer
 * (a drop punches a layer's and counts them 0; a trim keeps them). The
 * next session does not reserve them again: a fallocate over pages that
 * exist still walks every one of them, and on a prefill into a new
 * session that was about half of what it cost beyond a warm one
 * (docs/BENCHMARKS.md). Other reservations (residual rows, index pages)
 * are made again: they are few pages.
 */
/* All one width: no padding, so two compare byte for byte. */
struct view_geometry {
	uint64_t views_offset, view_layer_bytes, key_view_bytes;
	uint64_t layers, batch, kv_heads, head_dim_k, head_dim_v, max_tokens, views;
};
_Static_assert(sizeof(struct view_geometry) == 10 * sizeof(uint64_t),
	       "struct view_geometry has padding");

struct map_notes {
	struct view_geometry geometry;
	uint64_t reserved_view_tokens[];  /* one per layer */
};

static void view_geometry_of(const zc_map_header *m, struct view_geometry *g)
{
	g->views_offset = m->views_offset;
	g->view_layer_bytes = m->view_layer_bytes;
	g->key_view_bytes = m->key_view_bytes;
	g->layers = m->layers;
	g->batch = m->batch;
	g->kv_heads = m->kv_heads;
	g->head_dim_k = m->head_dim_k;
	g->head_dim_v = m->head_dim_v;
	g->max_tokens = m->max_tokens;
	g->views = m->views;
}

/* The notes a closing store leaves with its map; NULL when it has no
 * views or no memory for them (the next session reserves all again). */
static struct map_notes *map_notes_make(const struct store *store)
{
	const zc_map_header *m = &store->layout;
	if (!m->views_offset)
		return NULL;
	struct map_notes *notes =
		malloc(sizeof(*notes) + m->layers * sizeof(notes->reserved_view_tokens[0]));
	if (!notes)
		return NULL;
	view_geometry_of(m, &notes->geometry);
	for (uint32_t i = 0; i < m->layers; i++)
		notes->reserved_view_tokens[i] = store->room[i].reserved_view_tokens;
	return notes;
}

/* Takes a retained map's notes where its views lie as this store's do. */
static void map_notes_apply(struct store *store, const struct map_notes *notes)
{
	struct view_geometry mine;
	view_geometry_of(&store->layout, &mine);
	if (!notes || !mine.views_offset || memcmp(&mine, &notes->geometry, sizeof(mine)) != 0)
		return;
	for (uint64_t i = 0; i < mine.layers; i++)
		store->room[i].reserved_view_tokens = notes->reserved_view_tokens[i];
}

/*
 * The readers' part: a memfd sealed so that it can never shrink or grow
 * (whoever holds a descriptor), mapped, its header pages reserved and
 * written from the private layout, every layer's readers' copy from the
 * private state.
 */
static int map_open(struct store *store)
{
	const zc_map_header *m = &store->layout;
	size_t bytes = m->map_bytes;
	int rc;
	/* A closed session's map of this size and uid, pages and all
	 * (retain.h): its charge becomes this store's, its stale bytes are
	 * never read (readers read what the header and tables say is there,
	 * and the header pages are cleared below). */
	uint64_t retained = 0;
	void *kept = NULL, *notes = NULL;
	store->map_fd = retain_map_get(bytes, store->header->owner_uid, store->budget, &retained,
				       &kept, &notes);
	if (store->map_fd >= 0) {
		store->charged += retained;
		kind_add(store, KIND_VIEWS, (int64_t)retained);
	}
	/* Its mapping comes with its address space taken; any other mapping
	 * takes its own (taking it first could release the very map this
	 * session was about to reuse). */
	if (kept) {
		store->map_base = kept;
		store->map_warm = true;
	} else if ((rc = map_take(bytes)) < 0) {
		if (store->map_fd >= 0)
			close(store->map_fd);
		store->map_fd = -1;
		free(notes);
		return rc;
	}
	if (store->map_fd < 0) {
		store->map_fd = memfd_create("zipcache-map", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (store->map_fd < 0 || ftruncate(store->map_fd, (off_t)bytes) < 0 ||
		    fcntl(store->map_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
			rc = -errno;
			goto out_close;
		}
		/* Readers get a read-only descriptor; no write bits keeps them
		 * (as any other user) from reopening it for writing. */
		fchmod(store->map_fd, 0400);
	}
	rc = reserve_in(store, store->map_fd, 0, m->header_bytes, KIND_HEADERS);
	if (rc < 0)
		goto out_close;
	if (!store->map_base) {
		void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, store->map_fd, 0);
		if (base == MAP_FAILED) {
			rc = -errno;
			goto out_close;
		}
		store->map_base = base;
	}
	store->map = (zc_map_header *)store->map_base;
	if (retained)
		memset(store->map_base, 0, m->header_bytes);
	memcpy(store->map, m, sizeof(*m));
	for (uint32_t i = 0; i < m->layers; i++) {
		mirror_layer(store, i);
		__atomic_store_n(&store->map->layer[i].sequence, store->room[i].sequence,
				 __ATOMIC_RELEASE);
	}
	/* The retained pages, by what they hold now. */
	if (retained)
		kinds_measure(store);
	map_notes_apply(store, notes);
	free(notes);
	return 0;

out_close:
	free(notes);
	/* What its header page was charged stays in store->charged, which
	 * the caller's failure path gives back whole. */
	if (store->map_base)
		munmap(store->map_base, bytes);
	store->map_base = NULL;
	store->map_warm = false;
	if (store->map_fd >= 0)
		close(store->map_fd);
	store->map_fd = -1;
	map_give(bytes);
	return rc;
}

/* Writes the readers' table entries of a layer (after an adoption or a
 * fork filled the private index). */
static int map_table_fill(struct store *store, uint32_t layer)
{
	uint32_t blocks = store->layer[layer].blocks;
	if (blocks == 0)
		return 0;
	int rc = reserve_in(store, store->map_fd, table_offset(store, layer),
			    (uint64_t)blocks * sizeof(zc_map_block), KIND_INDEX);
	if (rc == 0)
		map_entries_write(store, layer, 0);
	return rc;
}

/* How a retained map lets go of the mapping it kept (retain_unmap_fn). */
static void map_release(void *base, uint64_t bytes)
{
	munmap(base, bytes);
	map_give(bytes);
}

/*
 * A closed session's map, kept for the next session of its size and uid
 * (retain.h) instead of closed: its pages, their charge and the daemon's
 * mapping leave the store. Only for a session gone for good (its file
 * unlinked): a store closed at shutdown or for an offload keeps nothing.
 */
static void map_retain(struct store *store)
{
	if (!store->unlinked || store->map_fd < 0 || !store->map_base)
		return;
	uint64_t allocated = fd_allocated(store->map_fd);
	if (allocated > store->charged)
		return;
	struct map_notes *notes = map_notes_make(store);
	if (!retain_map_put(store->map_fd, store->map_base, map_release, store->layout.map_bytes,
			    allocated, store->header->owner_uid, store->budget, notes)) {
		free(notes);
		return;
	}
	store->charged -= allocated;
	store->map_fd = -1;
	store->map_base = NULL;
	store->map = NULL;
}

static void store_unmap(struct store *store)
{
	if (store->map_base) {
		munmap(store->map_base, store->layout.map_bytes);
		map_give(store->layout.map_bytes);
		store->map_base = NULL;
		store->map = NULL;
	}
	if (store->map_fd >= 0)
		close(store->map_fd);
	store->map_fd = -1;
	if (!store->base)
		return;
	munmap(store->base, store->file_bytes);
	map_give(store->file_bytes);
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
	layout->saliency = (uint32_t)params->codec.saliency;
	layout->views = (uint32_t)params->views;
	snprintf(layout->name, sizeof(layout->name), "%s", params->name);
	snprintf(layout->model_id, sizeof(layout->model_id), "%s",
		 params->model_id ? params->model_id : "");
}

/* The file and map sizes a session needs, checked. */
static int layouts_of(const struct store_params *params, struct store_header *layout,
		      zc_map_header *map)
{
	int rc = params_validate(params);
	if (rc < 0)
		return rc;
	memset(layout, 0, sizeof(*layout));
	layout_from_params(layout, params);
	rc = header_layout(layout);
	return rc < 0 ? rc : map_layout(layout, map);
}

int store_layout_bytes(const struct store_params *params, uint64_t *bytes)
{
	struct store_header layout;
	zc_map_header map;
	int rc = layouts_of(params, &layout, &map);
	*bytes = rc == 0 ? layout.file_bytes + map.map_bytes : 0;
	return rc;
}

uint64_t store_max_file_bytes(void)
{
	return STORE_MAX_FILE_BYTES;
}

/*
 * Builds a new store's file under its temporary name, with header, empty
 * commit area and map; the caller fills layers (a fork) and publishes it
 * with store_publish, or throws it away with store_discard.
 */
static int store_build(int dir_fd, const char *dir_path, const struct store_params *params,
		       struct store_budget *budget, struct pool *pool, struct store **out)
{
	struct store_header layout;
	zc_map_header map;
	struct store *store;
	char temporary[64];
	int rc = layouts_of(params, &layout, &map);

	if (rc < 0)
		return rc;
	rc = store_alloc(&layout, &store);
	if (rc < 0)
		return rc;
	store->budget = budget;
	store->pool = pool;
	store->dir_fd = dir_fd;
	file_name(store->name, sizeof(store->name), params->session_id, false);
	file_name(temporary, sizeof(temporary), params->session_id, true);
	snprintf(store->path, sizeof(store->path), "%s/%s", dir_path, store->name);
	for (uint32_t i = 0; i < layout.layers; i++)
		store->room[i].view_valid = layout.views == ZC_VIEWS_FULL;

	/* Built under a temporary name and renamed into place: a crash
	 * before the rename leaves a file no daemon mistakes for a session. */
	store->fd = openat(dir_fd, temporary, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
			   0600);
	if (store->fd < 0 && errno == EEXIST && unlinkat(dir_fd, temporary, 0) == 0)
		store->fd = openat(dir_fd, temporary,
				   O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (store->fd < 0) {
		rc = -errno;
		store_free_memory(store);
		return rc;
	}
	if (ftruncate(store->fd, (off_t)layout.file_bytes) < 0) {
		rc = -errno;
		goto out_discard;
	}
	fault_point("create.file");
	rc = reserve_in(store, store->fd, 0, layout.header_bytes, KIND_HEADERS);
	if (rc == 0)
		rc = reserve_in(store, store->fd, layout.commit_offset, layout.commit_bytes,
				KIND_HEADERS);
	if (rc == 0)
		rc = store_map(store, layout.file_bytes);
	if (rc < 0)
		goto out_discard;

	struct store_header *durable = (struct store_header *)store->base;
	memcpy(durable, &layout, sizeof(layout));
	memset(durable->magic, 0, sizeof(durable->magic));
	/* The magic goes in last: a file without it was never finished. */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	memcpy(durable->magic, STORE_MAGIC, sizeof(durable->magic));
	/* No write bits: the daemon keeps its own read-write descriptor. */
	if (fchmod(store->fd, 0400) < 0) {
		rc = -errno;
		goto out_discard;
	}
	rc = map_open(store);
	if (rc < 0)
		goto out_discard;
	*out = store;
	return 0;

out_discard:
	unlinkat(dir_fd, temporary, 0);
	store_unmap(store);
	store_budget_give(store->budget, store->charged);
	close(store->fd);
	store_free_memory(store);
	return rc;
}

/* Throws away a store store_build made (its blocks' references first). */
static void store_discard(struct store *store)
{
	char temporary[64];
	file_name(temporary, sizeof(temporary), store->header->session_id, true);
	for (uint32_t i = 0; i < store->header->layers; i++)
		blocks_unref(store, i, 0, store->layer[i].blocks);
	unlinkat(store->dir_fd, temporary, 0);
	store_unmap(store);
	store_budget_give(store->budget, store->charged);
	close(store->fd);
	store_free_memory(store);
}

/* The rename: the commit point of an open (and of a fork). */
static int store_publish(struct store *store)
{
	char temporary[64];
	file_name(temporary, sizeof(temporary), store->header->session_id, true);
	fault_point("create.header");
	if (renameat2(store->dir_fd, temporary, store->dir_fd, store->name, RENAME_NOREPLACE) < 0) {
		int rc = errno == EEXIST ? ZC_EEXISTS : -errno;
		store_discard(store);
		return rc;
	}
	fault_point("create.rename");
	return 0;
}

int store_create(int dir_fd, const char *dir_path, const struct store_params *params,
		 struct store_budget *budget, struct pool *pool, struct store **out)
{
	struct store *store;
	int rc = store_build(dir_fd, dir_path, params, budget, pool, &store);
	if (rc < 0)
		return rc;
	rc = store_publish(store);
	if (rc < 0)
		return rc;
	*out = store;
	return 0;
}

/* Copies rows [from, from + tokens) of every head of a strided buffer to
 * row `at` of another. */
static void rows_move(uint16_t *target, const zc_strides *to, size_t at, const uint16_t *source,
		      const zc_strides *from, size_t first, const struct store_header *h,
		      uint32_t tokens, uint32_t dim)
{
	for (uint32_t b = 0; b < h->batch; b++)
		for (uint32_t head = 0; head < h->kv_heads; head++)
			memcpy(target + b * to->batch + head * to->head + at * dim,
			       source + b * from->batch + head * from->head + first * dim,
			       (size_t)tokens * dim * 2);
}

/*
 * rows_move's copy into the file at byte `target` (what `target` maps)
 * through the descriptor: the kernel copies into the file's pages, which
 * every mapping of it sees. An import writes its residual rows this way:
 * pages it reserved are written by the kernel, not touched one by one
 * through the daemon's mapping (each first touch is a fault, about the
 * cost of copying the page on some hypervisors: BENCHMARKS.md).
 */
static int rows_write(int fd, uint64_t target, const zc_strides *to, const uint16_t *source,
		      const zc_strides *from, const struct store_header *h, uint32_t tokens,
		      uint32_t dim)
{
	for (uint32_t b = 0; b < h->batch; b++) {
		for (uint32_t head = 0; head < h->kv_heads; head++) {
			const uint8_t *p = (const uint8_t *)(source + b * from->batch + head * from->head);
			uint64_t at = target + ((uint64_t)b * to->batch + (uint64_t)head * to->head) * 2;
			int rc = fd_pwrite_all(fd, p, (uint64_t)tokens * dim * 2, at);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

/*
 * Fills one layer of a fork with the first `tokens` tokens of the
 * source's: whole blocks by reference (the last one cut where the fork
 * ends, as a trim would), the residual's rows copied.
 */
static int fork_layer(struct store *fork, const struct store *source, uint32_t layer,
		      uint32_t tokens)
{
	const struct store_header *h = fork->header;
	const struct layer_state *s = &source->layer[layer];
	uint32_t keep = tokens < s->tokens ? tokens : s->tokens;
	uint32_t blocks_end = s->tokens - s->residual_tokens;
	struct layer_state next = { 0 };
	int rc = 0;

	const store_block *index = source->index[layer].entries;
	while (next.blocks < s->blocks && index[next.blocks].first_token < keep) {
		const store_block *b = &index[next.blocks];
		rc = index_grow(fork, layer, next.blocks);
		if (rc == 0)
			rc = reserve_index_entry(fork, layer, next.blocks);
		if (rc < 0)
			return rc;
		zc_block_shape key_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_v };
		zc_byte_count key_count = { 0 }, value_count = { 0 };
		zc_block_count_bytes(&fork->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
		zc_block_count_bytes(&fork->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
		pool_ref(fork->pool, b->key_offset);
		fork->index[layer].entries[next.blocks] = *b;
		file_index(fork, layer)[next.blocks] = *b;
		map_table(fork, layer)[next.blocks] = *b;
		next.blocks++;
		/* Counted now: a failure below unreferences every entry so far. */
		fork->layer[layer].blocks = next.blocks;
		next.key_compressed += key_count.compressed;
		next.key_baseline += key_count.baseline;
		next.value_compressed += value_count.compressed;
		next.value_baseline += value_count.baseline;
	}
	if (keep > blocks_end) {
		uint32_t rows = keep - blocks_end;
		rc = reserve_residual(fork, layer, rows);
		if (rc < 0)
			return rc;
		for (int tensor = 0; tensor < 2; tensor++) {
			uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
			zc_strides strides = residual_strides(h, dim);
			rows_move(tensor == 0 ? key_residual(fork, layer) : value_residual(fork, layer),
				  &strides, 0,
				  tensor == 0 ? key_residual(source, layer) : value_residual(source, layer),
				  &strides, s->residual_start, h, rows, dim);
			if (fork->layout.residual_offset)
				rows_move(map_residual(fork, layer, tensor == 0), &strides, 0,
					  tensor == 0 ? key_residual(source, layer) :
							value_residual(source, layer),
					  &strides, s->residual_start, h, rows, dim);
		}
		next.residual_tokens = rows;
		/* A fork goes on from the same attention: the rows it copies
		 * keep the masses their clients sent (same codec, same
		 * residual capacity). */
		if (fork->mass && source->mass) {
			for (uint64_t head = 0; head < heads_of(h); head++)
				memcpy(fork->mass[layer].mass + head * h->residual_capacity,
				       source->mass[layer].mass + head * h->residual_capacity,
				       (size_t)rows * sizeof(float));
			memcpy(fork->mass[layer].known, source->mass[layer].known, rows);
		}
	}
	next.tokens = keep;
	/* Records of generation 1, committed with the file's rename. */
	struct store_layer_commit *r = record_slot(fork, layer, 0);
	r->generation = 1;
	r->tokens = next.tokens;
	r->residual_tokens = next.residual_tokens;
	r->blocks = next.blocks;
	next.active = 0;
	layer_state_set(fork, layer, &next);
	/* The source's blocks may have been cut (by a trim, or by this fork). */
	map_entries_write(fork, layer, 0);

	/* The fork's views start as the source's rows where those are valid. */
	if (views_full(fork)) {
		if (keep > 0 && source->room[layer].view_valid && views_full(source)) {
			rc = reserve_views(fork, layer, keep);
			if (rc < 0)
				return rc;
			for (int tensor = 0; tensor < 2; tensor++) {
				uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
				zc_strides strides = view_strides(h, dim);
				rows_move(tensor == 0 ? key_view(fork, layer) : value_view(fork, layer),
					  &strides, 0,
					  tensor == 0 ? key_view(source, layer) : value_view(source, layer),
					  &strides, 0, h, keep, dim);
			}
		} else {
			fork->room[layer].view_valid = keep == 0;
		}
	}
	return 0;
}

int store_fork(struct store *source, uint32_t tokens, int dir_fd, const char *dir_path,
	       const struct store_params *params, struct store_budget *budget, struct store **out)
{
	const struct store_header *h = source->header;
	struct store_params p = {
		.session_id = params->session_id,
		.boot_epoch = params->boot_epoch,
		.owner_uid = h->owner_uid,
		.name = params->name,
		.model_id = h->model_id,  /* a fork is of the same model */
		.layers = h->layers, .batch = h->batch, .kv_heads = h->kv_heads,
		.head_dim_k = h->head_dim_k, .head_dim_v = h->head_dim_v,
		.max_tokens = h->max_tokens,
		.codec = source->codec,
		.policy = (enum store_policy)h->policy,
		.residual_tokens = h->residual_tokens,
		.views = params->views,
	};
	struct store *fork;
	int rc = store_build(dir_fd, dir_path, &p, budget, source->pool, &fork);
	if (rc < 0)
		return rc;
	for (uint32_t i = 0; rc == 0 && i < h->layers; i++)
		rc = fork_layer(fork, source, i, tokens);
	if (rc < 0) {
		store_discard(fork);
		return rc;
	}
	fork->generation = 1;
	fork->commit->generation = 1;
	for (uint32_t i = 0; i < h->layers; i++)
		mirror_layer(fork, i);
	fault_point("fork.layers");
	rc = store_publish(fork);
	if (rc < 0)
		return rc;
	*out = fork;
	return 0;
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
	zc_map_header map;

	if (memcmp(h->magic, STORE_MAGIC, sizeof(h->magic)) != 0)
		return corrupt(reason, size, "no store magic (the file was never finished)");
	if (h->version < STORE_VERSION_OLDEST || h->version > STORE_VERSION)
		return corrupt(reason, size, "format version %u, this daemon reads %u to %u",
			       h->version, STORE_VERSION_OLDEST, STORE_VERSION);
	expected.layers = h->layers;
	expected.batch = h->batch;
	expected.kv_heads = h->kv_heads;
	expected.head_dim_k = h->head_dim_k;
	expected.head_dim_v = h->head_dim_v;
	expected.max_tokens = h->max_tokens;
	expected.residual_capacity = h->residual_capacity;
	expected.views = h->views;
	if (h->layers == 0 || h->layers > STORE_MAX_LAYERS || h->batch == 0 || h->kv_heads == 0 ||
	    h->head_dim_k == 0 || h->head_dim_k > ZC_MAX_HEAD_DIM || h->head_dim_v == 0 ||
	    h->head_dim_v > ZC_MAX_HEAD_DIM || h->max_tokens == 0 ||
	    h->max_tokens > ZC_MAX_BLOCK_TOKENS || (uint64_t)h->batch * h->kv_heads > STORE_MAX_HEADS ||
	    h->policy > STORE_POLICY_PER_CALL ||
	    (h->policy == STORE_POLICY_STREAMING &&
	     (h->residual_tokens == 0 || h->residual_tokens > STORE_MAX_RESIDUAL_TOKENS)) ||
	    (h->policy == STORE_POLICY_PER_CALL && h->residual_tokens != 0) ||
	    h->residual_capacity != residual_capacity_of(h->residual_tokens, h->max_tokens) ||
	    (h->views != ZC_VIEWS_FULL && h->views != ZC_VIEWS_NONE))
		return corrupt(reason, size, "shape, policy or views out of range");
	if (header_layout(&expected) < 0 || map_layout(&expected, &map) < 0 ||
	    expected.file_bytes != h->file_bytes ||
	    expected.file_bytes != file_bytes || expected.header_bytes != h->header_bytes ||
	    expected.commit_offset != h->commit_offset ||
	    expected.commit_bytes != h->commit_bytes ||
	    expected.layers_offset != h->layers_offset ||
	    expected.layer_region_bytes != h->layer_region_bytes ||
	    expected.key_residual_offset != h->key_residual_offset ||
	    expected.value_residual_offset != h->value_residual_offset ||
	    expected.index_offset != h->index_offset || expected.max_blocks != h->max_blocks)
		return corrupt(reason, size, "layout does not follow from the shape (file %llu bytes)",
			       (unsigned long long)file_bytes);
	zc_codec_config codec = header_codec(h);
	if (zc_codec_config_validate(&codec) < 0)
		return corrupt(reason, size, "codec config out of range");
	if (memchr(h->name, '\0', sizeof(h->name)) == NULL)
		return corrupt(reason, size, "session name not terminated");
	if (memchr(h->model_id, '\0', sizeof(h->model_id)) == NULL)
		return corrupt(reason, size, "model id not terminated");
	return 0;
}

/*
 * A layer's durable state after a crash: the record with the highest
 * generation not past the committed one. Its block entries must tile the
 * tokens before the residual, with the sizes the codec gives their
 * shapes, and name blocks the pool holds, or the file is corrupt. Records
 * of a generation that was never committed are cleared, so no later
 * commit can make them current by accident. Each block it names is
 * claimed in the pool (one reference); on failure the caller gives back
 * the layer's claims (store->layer[layer].blocks of them).
 */
static int layer_recover(struct store *store, uint32_t layer, bool pool_existed, char *reason,
			 size_t size)
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
	    r.residual_tokens > r.tokens ||
	    (uint64_t)r.residual_start + r.residual_tokens > h->residual_capacity)
		return corrupt(reason, size, "layer %u: record counts out of range", layer);
	if (r.blocks > 0 && !pool_existed)
		return corrupt(reason, size, "layer %u: %u blocks, but the pool file is missing", layer,
			       r.blocks);
	if (r.blocks > 0) {
		int rc = index_grow(store, layer, r.blocks - 1);
		if (rc < 0)
			return rc;
		memcpy(store->index[layer].entries, file_index(store, layer),
		       (size_t)r.blocks * sizeof(store_block));
	}

	const store_block *index = store->index[layer].entries;
	uint32_t end_of_blocks = r.tokens - r.residual_tokens;
	for (uint32_t i = 0; i < r.blocks; i++) {
		const store_block *b = &index[i];
		zc_block_shape key_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_v };
		zc_byte_count key_bytes, value_bytes;
		uint64_t end = i + 1 < r.blocks ? index[i + 1].first_token : end_of_blocks;
		if ((i == 0 && b->first_token != 0) || end <= b->first_token ||
		    (uint64_t)b->first_token + b->tokens > h->max_tokens || end - b->first_token > b->tokens)
			return corrupt(reason, size, "layer %u: block %u does not follow its predecessor",
				       layer, i);
		if (zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_bytes) < 0 ||
		    zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_bytes) < 0 ||
		    key_bytes.compressed != b->key_bytes || value_bytes.compressed != b->value_bytes)
			return corrupt(reason, size, "layer %u: block %u has sizes its shape cannot have",
				       layer, i);
		char why[160];
		int rc = pool_claim(store->pool, b->key_offset, b->key_bytes, b->value_offset,
				    b->value_bytes, why, sizeof(why));
		if (rc < 0)
			return rc == ZC_ECORRUPT ? corrupt(reason, size, "layer %u: block %u: %s", layer,
							   i, why) : rc;
		l->blocks = i + 1;
		l->key_compressed += key_bytes.compressed;
		l->key_baseline += key_bytes.baseline;
		l->value_compressed += value_bytes.compressed;
		l->value_baseline += value_bytes.baseline;
	}
	if (r.blocks == 0 && end_of_blocks != 0)
		return corrupt(reason, size, "layer %u: %u tokens but no blocks and a residual of %u",
			       layer, r.tokens, r.residual_tokens);
	l->tokens = r.tokens;
	l->residual_tokens = r.residual_tokens;
	l->residual_start = r.residual_tokens ? r.residual_start : 0;

	/* Reservations are not durable: every page is reserved again before
	 * it is written. */
	store->room[layer] = (struct layer_room){ .sequence = 0 };
	return 0;
}

static bool owner_may_write(int fd, uid_t uid)
{
	return uid == 0 || fchmod(fd, 0600) == 0;
}

/* The readers' residual (views = none) from the durable one. */
static int map_residual_fill(struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	uint32_t rows = store->layer[layer].residual_tokens;
	uint32_t start = store->layer[layer].residual_start;
	if (!store->layout.residual_offset || rows == 0)
		return 0;
	int rc = reserve_residual(store, layer, start + rows);
	for (int tensor = 0; rc == 0 && tensor < 2; tensor++) {
		uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
		zc_strides strides = residual_strides(h, dim);
		rows_move(map_residual(store, layer, tensor == 0), &strides, 0,
			  tensor == 0 ? key_residual(store, layer) : value_residual(store, layer),
			  &strides, start, h, rows, dim);
	}
	return rc;
}

int store_adopt(int dir_fd, const char *dir_path, const char *name, struct store_budget *budget,
		struct pool_set *pools, struct store **out, char *reason, size_t reason_size)
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
	/* The file is 0400 so that nobody else can reopen it for writing; its
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
	bool pool_existed = false;
	struct pool *pool;
	rc = pool_set_get(pools, copy.owner_uid, budget, &pool, &pool_existed, reason, reason_size);
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
	store->pool = pool;
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
		rc = layer_recover(store, i, pool_existed, reason, reason_size);
	if (rc < 0)
		goto out_unclaim;
	/* Views are not durable: every daemon that adopts a file rebuilds
	 * them from the committed blocks and residual on first use, in a map
	 * of its own. */
	rc = map_open(store);
	for (uint32_t i = 0; rc == 0 && i < copy.layers; i++) {
		rc = map_table_fill(store, i);
		if (rc == 0)
			rc = map_residual_fill(store, i);
		mirror_layer(store, i);
	}
	if (rc < 0)
		goto out_unclaim;
	/* What an adopted file holds counts, even past the budget: refusing
	 * it would lose acknowledged tokens. New reservations then wait
	 * until views are dropped or sessions close. */
	store->budget = budget;
	store->charged = file_allocated(store);
	store_budget_force(budget, store->charged);
	kinds_measure(store);
	*out = store;
	return 0;

out_unclaim:
	for (uint32_t i = 0; i < copy.layers; i++)
		blocks_unref(store, i, 0, store->layer[i].blocks);
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

void store_release_blocks(struct store *store)
{
	for (uint32_t i = 0; i < store->header->layers; i++) {
		blocks_unref(store, i, 0, store->layer[i].blocks);
		store->layer[i].blocks = 0;
	}
}

void store_close(struct store *store, bool remove_file)
{
	if (!store)
		return;
	if (remove_file)
		store_unlink(store);
	/* A closed session's blocks go with their last reference. (Its map
	 * stays readable to a client that still maps it, as the seed's arrays
	 * outlive the cache; those pages go when the last mapping does.) */
	if (store->unlinked)
		store_release_blocks(store);
	map_retain(store);
	store_budget_give(store->budget, store->charged);
	store_unmap(store);
	close(store->fd);
	store_free_memory(store);
}

const struct store_header *store_header(const struct store *store)
{
	return store->header;
}

const zc_map_header *store_map_layout(const struct store *store)
{
	return &store->layout;
}

const char *store_path(const struct store *store)
{
	return store->path;
}

int store_open_readonly(const struct store *store)
{
	char proc_path[64];
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", store->map_fd);
	/* A new open file description of the map (never the durable file),
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

/* An adopted store's charge by kind: what each region holds. */
static void kinds_measure(struct store *store)
{
	const struct store_header *h = store->header;
	const zc_map_header *m = &store->layout;
	uint64_t kinds[KINDS] = { 0 };
	kinds[KIND_HEADERS] = range_written(store->fd, 0, h->layers_offset) +
			      range_written(store->map_fd, 0, m->header_bytes);
	kinds[KIND_INDEX] = range_written(store->map_fd, m->table_offset,
					  m->table_offset + m->layers * m->table_bytes);
	if (m->residual_offset)
		kinds[KIND_RESIDUAL] = range_written(store->map_fd, m->residual_offset,
						     m->residual_offset + m->layers * m->residual_bytes);
	if (m->views_offset)
		kinds[KIND_VIEWS] = range_written(store->map_fd, m->views_offset, m->map_bytes);
	for (uint32_t i = 0; i < h->layers; i++) {
		uint64_t region = layer_region_offset(store, i);
		kinds[KIND_RESIDUAL] += range_written(store->fd, region, region + h->index_offset);
		kinds[KIND_INDEX] += range_written(store->fd, region + h->index_offset,
						   region + h->layer_region_bytes);
	}
	uint64_t measured = kinds[KIND_HEADERS] + kinds[KIND_RESIDUAL] + kinds[KIND_INDEX] +
			    kinds[KIND_VIEWS];
	if (store->charged > measured)
		kinds[KIND_HEADERS] += store->charged - measured;
	for (int k = 0; k < KINDS; k++)
		__atomic_store_n(&store->kind_bytes[k], kinds[k], __ATOMIC_RELAXED);
}

void store_memory_add(const struct store *store, struct store_memory *sum)
{
	sum->views += __atomic_load_n(&store->kind_bytes[KIND_VIEWS], __ATOMIC_RELAXED);
	sum->residual += __atomic_load_n(&store->kind_bytes[KIND_RESIDUAL], __ATOMIC_RELAXED);
	sum->index += __atomic_load_n(&store->kind_bytes[KIND_INDEX], __ATOMIC_RELAXED);
	sum->headers += __atomic_load_n(&store->kind_bytes[KIND_HEADERS], __ATOMIC_RELAXED);
}

uint64_t store_rebuild_bytes(const struct store *store)
{
	const struct store_header *h = store->header;
	uint64_t bytes = 0;
	if (!views_full(store))
		return 0;
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

/* Bytes of this store's blocks that another session refers to too. Safe
 * from the loop thread while a job runs: committed entries never change,
 * and the index lock keeps an index from moving under the walk. */
uint64_t store_shared_bytes(struct store *store)
{
	uint64_t shared = 0;
	pthread_mutex_lock(&store->index_lock);
	for (uint32_t i = 0; i < store->header->layers; i++) {
		const store_block *index = store->index[i].entries;
		uint32_t blocks = __atomic_load_n(&store->layer[i].blocks, __ATOMIC_ACQUIRE);
		for (uint32_t b = 0; b < blocks; b++)
			if (pool_refs(store->pool, index[b].key_offset) > 1)
				shared += pool_extent_bytes(index[b].key_bytes, index[b].value_bytes);
	}
	pthread_mutex_unlock(&store->index_lock);
	return shared;
}

zc_codec_config store_codec(const struct store *store)
{
	return store->codec;
}

/* ---- mutations ---------------------------------------------------------------- */

/* A worker's buffer for one block's compressed bytes: kept between jobs
 * up to SCRATCH_KEEP_BYTES, so a decode loop's flushes allocate nothing.
 * The key frees it when its thread ends (workers.c joins its workers
 * at exit; the loop thread's stays until the process ends). */
static _Thread_local uint8_t *scratch_kept;
static _Thread_local uint64_t scratch_kept_bytes;
static pthread_key_t scratch_key;
static pthread_once_t scratch_key_once = PTHREAD_ONCE_INIT;
static bool scratch_key_made;

static void scratch_key_make(void)
{
	scratch_key_made = pthread_key_create(&scratch_key, free) == 0;
}

static uint8_t *scratch_get(uint64_t bytes, bool *owned)
{
	*owned = false;
	if (bytes <= scratch_kept_bytes)
		return scratch_kept;
	if (bytes > SCRATCH_KEEP_BYTES) {
		*owned = true;
		return malloc(bytes);
	}
	uint8_t *grown = realloc(scratch_kept, bytes);
	if (!grown)
		return NULL;
	scratch_kept = grown;
	scratch_kept_bytes = bytes;
	pthread_once(&scratch_key_once, scratch_key_make);
	if (scratch_key_made)
		(void)pthread_setspecific(scratch_key, grown);
	return grown;
}

static void scratch_put(uint8_t *buffer, bool owned)
{
	if (owned)
		free(buffer);
}

/* ---- saliency by attention (docs/ATTEND.md) ---------------------------------- */

/* Forgets the masses of residual rows [from, capacity): rows that left
 * the residual, or new ones no query has seen. */
static void mass_forget(struct store *store, uint32_t layer, uint32_t from)
{
	uint32_t capacity = store->header->residual_capacity;
	if (store->mass && from < capacity)
		memset(store->mass[layer].known + from, 0, capacity - from);
}

/* The residual lost its first `rows` rows (a flush published): the
 * masses of the `later` rows after them become rows 0.., the rest goes. */
static void mass_shift(struct store *store, uint32_t layer, uint32_t rows, uint32_t later)
{
	const struct store_header *h = store->header;
	if (!store->mass)
		return;
	struct layer_mass *m = &store->mass[layer];
	if (later > 0) {
		for (uint64_t head = 0; head < heads_of(h); head++) {
			float *row = m->mass + head * h->residual_capacity;
			memmove(row, row + rows, (size_t)later * sizeof(float));
		}
		memmove(m->known, m->known + rows, later);
	}
	mass_forget(store, layer, later);
}

/*
 * The scores a flush of the residual's first `rows` rows ranks by,
 * scores[head * rows + i]: a row's mass where a client sent one, and for
 * a row with none (the update's own new tokens, which no query has seen
 * yet) the mean of the head's others, so it ranks neither first nor
 * last. False, with nothing written, when no row has a mass: the flush
 * ranks by key norm then, as after a restart.
 */
static bool mass_scores(const struct store *store, uint32_t layer, uint32_t rows, float *scores)
{
	const struct store_header *h = store->header;
	if (!store->mass || rows == 0 || rows > h->residual_capacity)
		return false;
	const struct layer_mass *m = &store->mass[layer];
	uint32_t known = 0;
	for (uint32_t i = 0; i < rows; i++)
		known += m->known[i];
	if (known == 0)
		return false;
	for (uint64_t head = 0; head < heads_of(h); head++) {
		const float *mass = m->mass + head * h->residual_capacity;
		double sum = 0.0;
		for (uint32_t i = 0; i < rows; i++)
			sum += m->known[i] ? mass[i] : 0.0;
		float mean = (float)(sum / known);
		for (uint32_t i = 0; i < rows; i++)
			scores[head * rows + i] = m->known[i] ? mass[i] : mean;
	}
	return true;
}

/* mass_scores into a buffer of its own: NULL when there is nothing to
 * rank by (or no memory for it: key norm then, which only costs quality). */
static float *mass_scores_take(const struct store *store, uint32_t layer, uint32_t rows)
{
	if (!store->mass || rows == 0)
		return NULL;
	float *scores = malloc(heads_of(store->header) * rows * sizeof(float));
	if (scores && !mass_scores(store, layer, rows, scores)) {
		free(scores);
		scores = NULL;
	}
	return scores;
}

int store_residual_mass(struct store *store, uint32_t layer, uint32_t first_token, uint32_t rows,
			const float *mass)
{
	const struct store_header *h = store->header;
	if (store->codec.saliency != ZC_SALIENCY_ATTENTION)
		return ZC_EPRECONDITION;
	if (layer >= h->layers || rows == 0 || !mass)
		return ZC_EINVALID;
	const struct layer_state *l = &store->layer[layer];
	if (rows > h->residual_capacity || (uint64_t)first_token + rows > l->tokens)
		return ZC_ESHAPE;
	uint64_t heads = heads_of(h);
	for (uint64_t i = 0; i < heads * rows; i++)
		if (!(mass[i] >= 0.0f) || mass[i] > FLT_MAX)
			return ZC_ENONFINITE;
	if (!store->mass)
		return 0;  /* per_call: no residual, nothing to rank */
	uint32_t first = l->tokens - l->residual_tokens;
	struct layer_mass *m = &store->mass[layer];
	for (uint32_t j = 0; j < rows; j++) {
		if (first_token + j < first)
			continue;  /* compressed already */
		uint32_t i = first_token + j - first;
		for (uint64_t head = 0; head < heads; head++)
			m->mass[head * h->residual_capacity + i] = mass[head * rows + j];
		m->known[i] = 1;
	}
	return 0;
}

/* A codec_sink into a reserved pool extent: payload byte `at` lands at
 * offset + at. */
struct extent_sink {
	struct pool *pool;
	uint64_t offset;
};

static int extent_sink_write(void *ctx, uint64_t at, const void *bytes, size_t n)
{
	const struct extent_sink *sink = ctx;
	return pool_write_at(sink->pool, sink->offset + at, bytes, n);
}

/*
 * Compresses a [B, H, tokens, D] block (keys and values, each with its own
 * strides; the keys ranked by scores when given, else by norm) into a new
 * pool block, reconstructs it into the views at
 * first_token and writes its index entries past next's count; then
 * counts it in next. Nothing is committed here: until the caller commits
 * next, the block is scratch a crash forgets (the pool's sweep frees it),
 * and on failure the caller drops its reference (blocks_unref).
 */
static int block_append(struct store *store, uint32_t layer, struct layer_state *next,
			uint32_t first_token, uint32_t tokens, const uint16_t *keys,
			const zc_strides *key_strides, const uint16_t *values,
			const zc_strides *value_strides, const float *scores,
			const char *step_compress, const char *step_index)
{
	const struct store_header *h = store->header;
	zc_block_shape key_shape = { h->batch, h->kv_heads, tokens, h->head_dim_k };
	zc_block_shape value_shape = { h->batch, h->kv_heads, tokens, h->head_dim_v };
	zc_byte_count key_count, value_count;
	bool owned;
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
	if (rc < 0)
		return rc;

	/* The extent first. The codec then writes into it in place, through a
	 * mapping; failing that, into scratch, each codec thread handing its
	 * heads on to the pool itself (extent_sink_write). Without an extent
	 * the block is still compressed into scratch, so that bad input's
	 * error comes before a full pool's. */
	uint64_t key_offset = 0;
	int reserved = pool_reserve(store->pool, key_count.compressed, value_count.compressed,
				    &key_offset);
	uint64_t value_offset = pool_value_offset(key_offset, key_count.compressed);
	struct pool_mapping mapping = { 0 };
	uint8_t *key_out = reserved < 0 ? NULL :
		pool_extent_map(store->pool, key_offset,
				value_offset + value_count.compressed - key_offset, &mapping);
	uint8_t *value_out = key_out ? key_out + (value_offset - key_offset) : NULL;
	bool in_place = key_out != NULL;
	owned = false;
	if (!key_out) {
		key_out = scratch_get(key_count.compressed + value_count.compressed, &owned);
		if (!key_out) {
			if (reserved == 0)
				pool_unref(store->pool, key_offset);
			return -ENOMEM;
		}
		value_out = key_out + key_count.compressed;
	}
	bool sink = reserved == 0 && !in_place;
	struct extent_sink key_at = { store->pool, key_offset };
	struct extent_sink value_at = { store->pool, value_offset };
	const struct codec_sink key_sink = { extent_sink_write, &key_at };
	const struct codec_sink value_sink = { extent_sink_write, &value_at };
	/* Each head is reconstructed into the views right after it is
	 * compressed, while its bytes are in cache; only with an extent, so
	 * that a full pool leaves the views alone. */
	bool views = reserved == 0 && views_full(store);
	zc_strides key_view_strides = view_strides(h, h->head_dim_k);
	zc_strides value_view_strides = view_strides(h, h->head_dim_v);
	const struct codec_fanout_tensor pair[2] = {
		{ ZC_TENSOR_KEYS, key_shape, keys, key_strides, scores, key_out,
		  key_count.compressed, sink ? &key_sink : NULL,
		  views ? key_view(store, layer) + (size_t)first_token * h->head_dim_k : NULL,
		  &key_view_strides },
		{ ZC_TENSOR_VALUES, value_shape, values, value_strides, NULL, value_out,
		  value_count.compressed, sink ? &value_sink : NULL,
		  views ? value_view(store, layer) + (size_t)first_token * h->head_dim_v : NULL,
		  &value_view_strides },
	};
	rc = codec_fanout_compress_block(&store->codec, pair, 2);
	if (rc == 0)
		rc = reserved;
	if (rc < 0 && reserved == 0)
		pool_unref(store->pool, key_offset);
	/* Rows of the view past the layer's tokens hold nothing yet; rows
	 * before them (a residual being flushed) may now hold part of a
	 * reconstruction the layer will not have. */
	if (rc < 0 && views && first_token < store->layer[layer].tokens)
		view_valid_set(store, layer, false);
	if (rc == 0)
		fault_point("pool.write");
	scratch_put(key_out, owned);
	pool_extent_unmap(&mapping);
	if (rc < 0)
		return rc;
	fault_point(step_compress);

	store_block entry = {
		.first_token = first_token,
		.tokens = tokens,
		.valid_tokens = tokens,
		.key_offset = key_offset,
		.key_bytes = key_count.compressed,
		.value_offset = value_offset,
		.value_bytes = value_count.compressed,
	};
	store->index[layer].entries[next->blocks] = entry;
	file_index(store, layer)[next->blocks] = entry;
	map_table(store, layer)[next->blocks] = entry;
	fault_point(step_index);
	next->blocks++;
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
	size_t start = next->residual_start;
	float *scores = mass_scores_take(store, layer, next->residual_tokens);
	int rc = block_append(store, layer, &attempt, next->tokens - next->residual_tokens,
			      next->residual_tokens, key_residual(store, layer) + start * h->head_dim_k,
			      &key_strides, value_residual(store, layer) + start * h->head_dim_v,
			      &value_strides, scores, "flush.compress", "flush.index");
	free(scores);
	if (rc < 0)
		return rc;
	attempt.residual_tokens = 0;
	attempt.residual_start = 0;
	*next = attempt;
	return 0;
}

/* Compresses and commits a full residual on its own. */
static int residual_flush(struct store *store, uint32_t layer)
{
	struct layer_state next = store->layer[layer];
	int rc = residual_to_block(store, layer, &next);
	if (rc == 0 && next.blocks != store->layer[layer].blocks) {
		layer_commit(store, layer, &next, "flush.record", "flush.publish");
		mass_forget(store, layer, 0);
	}
	return rc;
}

/* ---- the deferred flush (docs/DURABILITY.md, "deferred residual flush") ---- */

bool store_flush_due(const struct store *store, uint32_t layer)
{
	const struct store_header *h = store->header;
	return layer < h->layers && h->policy == STORE_POLICY_STREAMING &&
	       !store->room[layer].flush_pending &&
	       store->layer[layer].residual_tokens >= h->residual_tokens;
}

bool store_flush_pending(const struct store *store, uint32_t layer)
{
	return layer < store->header->layers && store->room[layer].flush_pending;
}

bool store_append_fits(const struct store *store, uint32_t layer, uint32_t tokens)
{
	const struct store_header *h = store->header;
	if (layer >= h->layers)
		return false;
	const struct layer_state *l = &store->layer[layer];
	const struct layer_room *room = &store->room[layer];
	/* The rows beside the flush stay fewer than R: the update that makes
	 * them R or more waits for the publish and then flushes them itself,
	 * so blocks begin and end where the synchronous flush puts them. */
	uint32_t beside = room->flush_pending ? l->residual_tokens - room->flush_rows :
						l->residual_tokens;
	return h->policy == STORE_POLICY_STREAMING && tokens < h->residual_tokens &&
	       (uint64_t)beside + tokens < h->residual_tokens &&
	       (uint64_t)l->residual_start + l->residual_tokens + tokens <= h->residual_capacity;
}

int store_flush_begin(struct store *store, uint32_t layer, struct store_flush *flush)
{
	if (!store_flush_due(store, layer))
		return -EAGAIN;
	const struct layer_state *l = &store->layer[layer];
	*flush = (struct store_flush){
		.layer = layer,
		.first_token = l->tokens - l->residual_tokens,
		.rows = l->residual_tokens,
		.start = l->residual_start,
	};
	/* The masses as they are now: updates beside the flush may change
	 * them, and the compress runs on another thread. */
	flush->scores = mass_scores_take(store, layer, flush->rows);
	store->room[layer].flush_pending = true;
	store->room[layer].flush_rows = flush->rows;
	return 0;
}

/*
 * Runs on a worker while the session's other jobs go on: it reads only
 * the residual rows the flush took (no job writes them while the flush is
 * pending: appends go past them, everything else waits) and writes only a
 * fresh pool extent, scratch until the publish commits an entry naming it.
 */
void store_flush_compress(const struct store *store, struct store_flush *flush)
{
	const struct store_header *h = store->header;
	zc_block_shape key_shape = { h->batch, h->kv_heads, flush->rows, h->head_dim_k };
	zc_block_shape value_shape = { h->batch, h->kv_heads, flush->rows, h->head_dim_v };
	zc_strides key_strides = residual_strides(h, h->head_dim_k);
	zc_strides value_strides = residual_strides(h, h->head_dim_v);

	flush->rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &flush->key_count);
	if (flush->rc == 0)
		flush->rc = zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape,
						 &flush->value_count);
	if (flush->rc < 0)
		return;
	flush->payload = malloc(flush->key_count.compressed + flush->value_count.compressed);
	if (!flush->payload) {
		flush->rc = -ENOMEM;
		return;
	}
	uint8_t *value_out = flush->payload + flush->key_count.compressed;
	const uint16_t *keys = key_residual(store, flush->layer) + (size_t)flush->start * h->head_dim_k;
	int64_t written = codec_fanout_compress(&store->codec, ZC_TENSOR_KEYS, &key_shape, keys,
						&key_strides, flush->scores, flush->payload,
						flush->key_count.compressed, NULL);
	if (written >= 0)
		written = codec_fanout_compress(
			&store->codec, ZC_TENSOR_VALUES, &value_shape,
			value_residual(store, flush->layer) + (size_t)flush->start * h->head_dim_v,
			&value_strides, NULL, value_out, flush->value_count.compressed, NULL);
	flush->rc = written < 0 ? (int)written :
				  pool_write(store->pool, flush->payload, flush->key_count.compressed,
					     value_out, flush->value_count.compressed, &flush->key_offset);
	if (flush->rc == 0) {
		flush->written = true;
		fault_point("flush.compress");
	}
}

void store_flush_abandon(struct store *store, struct store_flush *flush)
{
	if (flush->written)
		pool_unref(store->pool, flush->key_offset);
	flush->written = false;
	free(flush->payload);
	flush->payload = NULL;
	free(flush->scores);
	flush->scores = NULL;
	if (flush->layer < store->header->layers)
		store->room[flush->layer].flush_pending = false;
}

/* Moves residual rows [from, from + rows) of every head to row `to` (both
 * tensors) in the durable buffers, or in the readers' (views = none). */
static void residual_rows_shift(struct store *store, uint32_t layer, bool readers, uint32_t from,
				uint32_t to, uint32_t rows)
{
	const struct store_header *h = store->header;
	for (int tensor = 0; tensor < 2; tensor++) {
		uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
		zc_strides strides = residual_strides(h, dim);
		uint16_t *buffer = readers ? map_residual(store, layer, tensor == 0) :
				   tensor == 0 ? key_residual(store, layer) : value_residual(store, layer);
		rows_move(buffer, &strides, to, buffer, &strides, from, h, rows, dim);
	}
}

/*
 * Makes the compressed rows the layer's block, inside the layer's seqlock,
 * with the session to itself (a job in its queue). Two commits: the block
 * with the residual now starting past the flushed rows (flush.publish, the
 * flush's commit point), then, if tokens were appended while it ran, those
 * rows moved back to row 0 (compact.publish). The moves never overwrite a
 * committed row: the rows appended meanwhile are fewer than those flushed.
 * On failure (index space, the budget) the block is dropped and the
 * residual stays as it is, exact; a later update flushes it.
 */
int store_flush_publish(struct store *store, struct store_flush *flush)
{
	const struct store_header *h = store->header;
	uint32_t layer = flush->layer;
	struct layer_state next = store->layer[layer];
	int rc = flush->rc;

	if (rc == 0 && NEVER(next.residual_start != flush->start || next.residual_tokens < flush->rows ||
			     next.tokens - next.residual_tokens != flush->first_token))
		rc = -EBUSY;
	if (rc == 0 && next.blocks >= h->max_blocks)
		rc = ZC_EEXHAUSTED;
	if (rc == 0)
		rc = index_grow(store, layer, next.blocks);
	if (rc == 0)
		rc = reserve_index_entry(store, layer, next.blocks);
	if (rc < 0) {
		store_flush_abandon(store, flush);
		flush->rc = rc;
		return rc;
	}

	sequence_begin(store, layer);
	if (views_full(store) && store->room[layer].view_valid) {
		zc_block_shape key_shape = { h->batch, h->kv_heads, flush->rows, h->head_dim_k };
		zc_block_shape value_shape = { h->batch, h->kv_heads, flush->rows, h->head_dim_v };
		zc_strides key_view_strides = view_strides(h, h->head_dim_k);
		zc_strides value_view_strides = view_strides(h, h->head_dim_v);
		int vrc = zc_block_reconstruct(&store->codec, ZC_TENSOR_KEYS, &key_shape, flush->payload,
					       flush->key_count.compressed,
					       key_view(store, layer) +
						       (size_t)flush->first_token * h->head_dim_k,
					       &key_view_strides);
		if (vrc == 0)
			vrc = zc_block_reconstruct(&store->codec, ZC_TENSOR_VALUES, &value_shape,
						   flush->payload + flush->key_count.compressed,
						   flush->value_count.compressed,
						   value_view(store, layer) +
							   (size_t)flush->first_token * h->head_dim_v,
						   &value_view_strides);
		/* The block is good either way; the view is rebuilt from it. */
		if (vrc < 0)
			view_valid_set(store, layer, false);
	}
	store_block entry = {
		.first_token = flush->first_token,
		.tokens = flush->rows,
		.valid_tokens = flush->rows,
		.key_offset = flush->key_offset,
		.key_bytes = flush->key_count.compressed,
		.value_offset = pool_value_offset(flush->key_offset, flush->key_count.compressed),
		.value_bytes = flush->value_count.compressed,
	};
	store->index[layer].entries[next.blocks] = entry;
	file_index(store, layer)[next.blocks] = entry;
	map_table(store, layer)[next.blocks] = entry;
	fault_point("flush.index");
	uint32_t later = next.residual_tokens - flush->rows;
	next.blocks++;
	next.key_compressed += flush->key_count.compressed;
	next.key_baseline += flush->key_count.baseline;
	next.value_compressed += flush->value_count.compressed;
	next.value_baseline += flush->value_count.baseline;
	next.residual_tokens = later;
	next.residual_start = later ? flush->start + flush->rows : 0;
	layer_commit(store, layer, &next, "flush.record", "flush.publish");
	flush->written = false;  /* the layer names the block now */
	mass_shift(store, layer, flush->rows, later);
	if (later > 0) {
		/* Readers' rows move inside this same write; the durable ones
		 * go to rows the commit above made scratch. */
		if (store->layout.residual_offset)
			residual_rows_shift(store, layer, true, flush->rows, 0, later);
		if (later <= next.residual_start) {
			residual_rows_shift(store, layer, false, next.residual_start, 0, later);
			fault_point("compact.copy");
			next.residual_start = 0;
			layer_commit(store, layer, &next, "compact.record", "compact.publish");
		}
	}
	residual_release(store, layer);
	mirror_layer(store, layer);
	sequence_end(store, layer);
	store_flush_abandon(store, flush);
	return 0;
}

/* Copies a contiguous [B, H, tokens, D] block into a strided buffer at row `at`. */
static void rows_copy(uint16_t *target, const zc_strides *strides, size_t at, const uint16_t *block,
		      const struct store_header *h, uint32_t tokens, uint32_t dim)
{
	size_t head_elements = (size_t)tokens * dim;
	zc_strides packed = { (size_t)h->kv_heads * head_elements, head_elements, dim };
	rows_move(target, strides, at, block, &packed, 0, h, tokens, dim);
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
				  &value_input, NULL, "append.compress", "append.index");
	if (rc < 0) {
		/* The residual's rows in the view may hold its reconstruction
		 * now, but the residual stays exact: rebuild before the next read. */
		if (residual > 0 && views_full(store))
			view_valid_set(store, layer, false);
		blocks_unref(store, layer, store->layer[layer].blocks, next.blocks);
		return rc;
	}
	next.tokens += tokens;
	layer_commit(store, layer, &next, "append.record", "append.publish");
	mass_forget(store, layer, 0);  /* the residual went into a block */
	return 0;
}

/* A short streaming block goes into the exact residual (and the views, or
 * the readers' residual); a residual that fills up is compressed as one
 * block right after. */
static int update_residual(struct store *store, uint32_t layer, uint32_t tokens,
			   const uint16_t *keys, const uint16_t *values, bool defer_flush)
{
	const struct store_header *h = store->header;
	const struct layer_state *l = &store->layer[layer];
	int rc;

	if (l->residual_start + l->residual_tokens + tokens > h->residual_capacity) {
		/* The session's queue lets no update past a deferred flush that
		 * holds the rows it would need. */
		if (NEVER(store->room[layer].flush_pending))
			return -EBUSY;
		/* Only after an earlier flush failed for lack of space, or a
		 * crash between an update's commit and its flush. */
		rc = residual_flush(store, layer);
		if (rc < 0)
			return rc;
	}
	struct layer_state next = store->layer[layer];
	zc_strides key_res = residual_strides(h, h->head_dim_k);
	zc_strides value_res = residual_strides(h, h->head_dim_v);
	/* The durable row the tokens go to; readers' rows (the map's residual
	 * with views = none) always start at 0. */
	size_t row = (size_t)next.residual_start + next.residual_tokens;
	rows_copy(key_residual(store, layer), &key_res, row, keys, h, tokens, h->head_dim_k);
	rows_copy(value_residual(store, layer), &value_res, row, values, h, tokens, h->head_dim_v);
	/* Staged input sits in memory the client may still write: what counts
	 * is what was copied, so that is what must be finite, and what
	 * readers get. */
	rc = rows_check_finite(key_residual(store, layer), &key_res, row, h, tokens, h->head_dim_k);
	if (rc == 0)
		rc = rows_check_finite(value_residual(store, layer), &value_res, row, h, tokens,
				       h->head_dim_v);
	if (rc < 0)
		return rc;
	if (views_full(store)) {
		zc_strides key_view_s = view_strides(h, h->head_dim_k);
		zc_strides value_view_s = view_strides(h, h->head_dim_v);
		rows_move(key_view(store, layer), &key_view_s, next.tokens, key_residual(store, layer),
			  &key_res, row, h, tokens, h->head_dim_k);
		rows_move(value_view(store, layer), &value_view_s, next.tokens,
			  value_residual(store, layer), &value_res, row, h, tokens, h->head_dim_v);
	} else {
		rows_move(map_residual(store, layer, true), &key_res, next.residual_tokens,
			  key_residual(store, layer), &key_res, row, h, tokens, h->head_dim_k);
		rows_move(map_residual(store, layer, false), &value_res, next.residual_tokens,
			  value_residual(store, layer), &value_res, row, h, tokens, h->head_dim_v);
	}
	fault_point("residual.copy");
	/* No query has seen the new rows. */
	mass_forget(store, layer, next.residual_tokens);
	next.residual_tokens += tokens;
	next.tokens += tokens;
	layer_commit(store, layer, &next, "residual.record", "residual.publish");
	/* Deferred: the caller flushes after its reply (store_flush_begin). */
	if (!defer_flush && next.residual_tokens >= h->residual_tokens) {
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
	return store_append(store, layer, tokens, keys, values, false);
}

int store_append(struct store *store, uint32_t layer, uint32_t tokens, const uint16_t *keys,
		 const uint16_t *values, bool defer_flush)
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
	/* A direct block compresses the residual ahead of it: never while a
	 * deferred flush holds it (the session's queue waits for the flush). */
	if (NEVER(direct && store->room[layer].flush_pending))
		return -EBUSY;
	/* The codec refuses NaN/Inf (values with views in the encode's pass,
	 * after writing part of the block, which block_append throws away
	 * as any failed block's), so a block compressed directly needs no
	 * check of its own; but the residual path copies, and a flush ahead
	 * of a direct block must not happen for a block that will then be
	 * refused. */
	if (!direct || l->residual_tokens > 0) {
		rc = zc_fp16_check_finite(keys, heads * tokens * h->head_dim_k);
		if (rc == 0)
			rc = zc_fp16_check_finite(values, heads * tokens * h->head_dim_v);
		if (rc < 0)
			return rc;
	}
	if (views_full(store) && !store->room[layer].view_valid) {
		rc = views_rebuild_layer(store, layer);
		if (rc < 0)
			return rc;
	}
	/* The residual path's rows (a block that would overflow the residual
	 * follows a flush, so never more than its capacity). */
	uint64_t rows = (uint64_t)l->residual_start + l->residual_tokens + tokens;
	rc = direct ? 0 : reserve_residual(store, layer, rows <= h->residual_capacity ?
								 (uint32_t)rows : tokens);
	if (rc == 0 && views_full(store))
		rc = reserve_views(store, layer, (uint64_t)l->tokens + tokens);
	if (rc < 0)
		return rc;

	sequence_begin(store, layer);
	rc = direct ? update_direct(store, layer, tokens, keys, values) :
		      update_residual(store, layer, tokens, keys, values, defer_flush);
	residual_release(store, layer);
	mirror_layer(store, layer);
	sequence_end(store, layer);
	return rc;
}

/*
 * A chunk-keyed block (docs/PREFIX.md): compressed as exactly one block of
 * its tokens whatever the policy, so that its boundaries are the chunk's.
 * Only on a layer whose residual is empty (ZC_EPRECONDITION otherwise):
 * the residual's rows would have to go into the block or ahead of it.
 * On success *out is the new block's entry and the caller owns one more
 * reference on it (for the chunk index).
 */
int store_append_block(struct store *store, uint32_t layer, uint32_t tokens,
		       const uint16_t *keys, const uint16_t *values, store_block *out)
{
	const struct store_header *h = store->header;
	int rc;

	if (layer >= h->layers || tokens == 0)
		return ZC_EINVALID;
	const struct layer_state *l = &store->layer[layer];
	if (l->residual_tokens > 0)
		return ZC_EPRECONDITION;
	if ((uint64_t)l->tokens + tokens > h->max_tokens)
		return ZC_EEXHAUSTED;
	if (views_full(store) && !store->room[layer].view_valid) {
		rc = views_rebuild_layer(store, layer);
		if (rc < 0)
			return rc;
	}
	if (views_full(store)) {
		rc = reserve_views(store, layer, (uint64_t)l->tokens + tokens);
		if (rc < 0)
			return rc;
	}
	sequence_begin(store, layer);
	rc = update_direct(store, layer, tokens, keys, values);
	mirror_layer(store, layer);
	sequence_end(store, layer);
	if (rc < 0)
		return rc;
	*out = store->index[layer].entries[store->layer[layer].blocks - 1];
	pool_ref(store->pool, out->key_offset);
	return 0;
}

/* What trimming `tokens` from a layer leaves (next starts as its state);
 * returns the tokens cut. Pure: nothing is written. */
static uint32_t trim_state(const struct store *store, uint32_t layer, uint32_t tokens,
			   struct layer_state *next)
{
	const struct store_header *h = store->header;
	const store_block *index = store->index[layer].entries;
	uint32_t cut = tokens < next->tokens ? tokens : next->tokens;
	uint32_t keep = next->tokens - cut;

	if (cut <= next->residual_tokens) {
		next->residual_tokens -= cut;
	} else {
		next->residual_tokens = 0;
		/* Blocks go from the end; a block cut in the middle stays whole
		 * (re-encoding its prefix would change tokens the model already
		 * used), and so it may stay shared. */
		while (next->blocks > 0 && index[next->blocks - 1].first_token >= keep) {
			const store_block *last = &index[next->blocks - 1];
			zc_block_shape key_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_k };
			zc_block_shape value_shape = { h->batch, h->kv_heads, last->tokens, h->head_dim_v };
			zc_byte_count key_count = { 0 }, value_count = { 0 };
			zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
			zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
			next->key_compressed -= key_count.compressed;
			next->key_baseline -= key_count.baseline;
			next->value_compressed -= value_count.compressed;
			next->value_baseline -= value_count.baseline;
			next->blocks--;
		}
	}
	next->tokens = keep;
	return cut;
}

/*
 * Trims layers [first, first + count) by `tokens` each as one mutation:
 * every changed layer's record is written under one generation, which is
 * then published, so a crash leaves all of them trimmed or none. Blocks
 * no longer named lose their reference after the commit, once readers
 * were told (the sequence moved).
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
		uint32_t had = store->layer[layer].blocks;
		sequence_begin(store, layer);
		next[i].active = 1u - store->layer[layer].active;
		layer_state_set(store, layer, &next[i]);
		mass_forget(store, layer, next[i].residual_tokens);
		/* The last block left may have been cut. */
		if (next[i].blocks > 0)
			map_entries_write(store, layer, next[i].blocks - 1);
		mirror_layer(store, layer);
		sequence_end(store, layer);
		blocks_unref(store, layer, next[i].blocks, had);
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
 * told first (view_valid and the generation, under the seqlock), then the
 * pages go. */
int store_drop_views(struct store *store, uint64_t *freed)
{
	const struct store_header *h = store->header;
	uint64_t before = file_allocated(store);
	int rc = 0;

	*freed = 0;
	if (!views_full(store))
		return 0;
	charge_sync(store, before);
	for (uint32_t i = 0; i < h->layers && rc == 0; i++) {
		struct layer_room *room = &store->room[i];
		uint64_t start = store_key_view_offset(store, i);
		uint64_t bytes = store->layout.view_layer_bytes;
		/* An invalid view holds nothing but pages a reader faulted in:
		 * those go too. */
		if (room->view_valid && room->reserved_view_tokens == 0)
			continue;
		sequence_begin(store, i);
		view_valid_set(store, i, false);
		room->reserved_view_tokens = 0;
		mirror_layer(store, i);
		fault_point("drop.mark");
		if (fallocate(store->map_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)start,
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

/* Reconstructs one block's valid tokens into the views, from the pool's
 * bytes read into scratch. A block cut by trim goes head by head through
 * a second scratch, so its dead tail never lands past its valid tokens
 * (or past the end of the view). */
static int block_restore(struct store *store, uint32_t layer, uint32_t i)
{
	const struct store_header *h = store->header;
	const store_block *block = &store->index[layer].entries[i];
	uint32_t valid = block_valid_tokens(store, layer, &store->layer[layer], i);
	bool owned;
	uint64_t bytes = block->key_bytes > block->value_bytes ? block->key_bytes : block->value_bytes;
	uint8_t *data = scratch_get(bytes, &owned);
	if (!data)
		return -ENOMEM;
	int rc = 0;
	for (int tensor = 0; rc == 0 && tensor < 2; tensor++) {
		zc_tensor kind = tensor == 0 ? ZC_TENSOR_KEYS : ZC_TENSOR_VALUES;
		uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
		zc_block_shape shape = { h->batch, h->kv_heads, block->tokens, dim };
		uint64_t size = tensor == 0 ? block->key_bytes : block->value_bytes;
		uint16_t *view = tensor == 0 ? key_view(store, layer) : value_view(store, layer);
		zc_strides strides = view_strides(h, dim);

		rc = pool_read(store->pool, tensor == 0 ? block->key_offset : block->value_offset, data,
			       size);
		if (rc < 0)
			break;
		if (valid == block->tokens) {
			rc = codec_fanout_reconstruct(&store->codec, kind, &shape, data, size,
						      view + (size_t)block->first_token * dim, &strides);
			continue;
		}
		zc_block_shape one = { 1, 1, block->tokens, dim };
		zc_byte_count head_count;
		size_t head_elements = (size_t)block->tokens * dim;
		zc_strides packed = { head_elements, head_elements, dim };
		rc = zc_block_count_bytes(&store->codec, kind, &one, &head_count);
		uint16_t *rows = rc == 0 ? malloc(head_elements * 2) : NULL;
		if (rc == 0 && !rows)
			rc = -ENOMEM;
		for (uint64_t head = 0; rc == 0 && head < heads_of(h); head++) {
			rc = zc_block_reconstruct(&store->codec, kind, &one,
						  data + head * head_count.compressed,
						  head_count.compressed, rows, &packed);
			uint16_t *to = view + (head / h->kv_heads) * strides.batch +
				       (head % h->kv_heads) * strides.head +
				       (size_t)block->first_token * dim;
			if (rc == 0)
				memcpy(to, rows, (size_t)valid * dim * 2);
		}
		free(rows);
	}
	scratch_put(data, owned);
	return rc;
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
			rows_move(tensor == 0 ? key_view(store, layer) : value_view(store, layer), &to,
				  first,
				  tensor == 0 ? key_residual(store, layer) : value_residual(store, layer),
				  &from, l->residual_start, h, l->residual_tokens, dim);
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
	if (!views_full(store))
		return 0;
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

	if ((!all && layer >= h->layers) || !views_full(store))
		return 0;
	for (uint32_t i = first; i < end; i++) {
		/* A worker may be rebuilding or appending to this store. */
		if (!__atomic_load_n(&store->room[i].view_valid, __ATOMIC_RELAXED))
			tokens += __atomic_load_n(&store->layer[i].tokens, __ATOMIC_RELAXED);
	}
	return tokens * heads_of(h) * ((uint64_t)h->head_dim_k + h->head_dim_v);
}

bool store_views_full(const struct store *store)
{
	return views_full(store);
}

uint64_t store_view_generation(const struct store *store, uint32_t layer)
{
	return __atomic_load_n(&store->room[layer].generation, __ATOMIC_RELAXED);
}

/* ---- snapshots (server/snapshot.c) ------------------------------------------ */

uint32_t store_residual_capacity(uint32_t residual_tokens, uint32_t max_tokens)
{
	return residual_capacity_of(residual_tokens, max_tokens);
}

void store_layer_cut(const struct store *store, uint32_t layer, struct store_cut *out)
{
	const struct layer_state *l = &store->layer[layer];
	*out = (struct store_cut){
		.tokens = l->tokens,
		.residual_tokens = l->residual_tokens,
		.blocks = l->blocks,
		.entries = store->index[layer].entries,
		/* Rows from residual_start on: a flush published beside later
		 * appends can leave the residual's first row past 0. */
		.key_residual = key_residual(store, layer) +
				(size_t)l->residual_start * store->header->head_dim_k,
		.value_residual = value_residual(store, layer) +
				  (size_t)l->residual_start * store->header->head_dim_v,
		.residual_capacity = store->header->residual_capacity,
	};
}

int store_import_begin(int dir_fd, const char *dir_path, const struct store_params *params,
		       struct store_budget *budget, struct pool *pool, struct store **out)
{
	return store_build(dir_fd, dir_path, params, budget, pool, out);
}

/* Entry `at` of an import's layer (room reserved, its pool reference
 * taken): into the index and the file's, counted in the layer's bytes
 * at once, so store_import_abandon drops its reference. */
static void import_entry_add(struct store *store, uint32_t layer, uint32_t at,
			     const store_block *b)
{
	const struct store_header *h = store->header;
	struct layer_state *l = &store->layer[layer];
	pthread_mutex_lock(&store->index_lock);
	store->index[layer].entries[at] = *b;
	pthread_mutex_unlock(&store->index_lock);
	file_index(store, layer)[at] = *b;
	zc_block_shape key_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_k };
	zc_block_shape value_shape = { h->batch, h->kv_heads, b->tokens, h->head_dim_v };
	zc_byte_count key_count = { 0 }, value_count = { 0 };
	zc_block_count_bytes(&store->codec, ZC_TENSOR_KEYS, &key_shape, &key_count);
	zc_block_count_bytes(&store->codec, ZC_TENSOR_VALUES, &value_shape, &value_count);
	l->key_compressed += key_count.compressed;
	l->key_baseline += key_count.baseline;
	l->value_compressed += value_count.compressed;
	l->value_baseline += value_count.baseline;
	__atomic_store_n(&l->blocks, at + 1, __ATOMIC_RELEASE);
	fault_point("import.block");
}

/*
 * One block of an import into a fresh pool extent and the next entry of
 * the layer's index (scratch until the rename). Counted in the layer at
 * once, so store_import_abandon drops its reference.
 */
int store_import_block(struct store *store, uint32_t layer, const store_block *entry,
		       const void *key, const void *value)
{
	int rc = store_import_block_room(store, layer);
	uint64_t key_offset = 0;
	if (rc == 0)
		rc = pool_write(store->pool, key, entry->key_bytes, value, entry->value_bytes,
				&key_offset);
	if (rc < 0)
		return rc;
	store_import_block_add(store, layer, entry, key_offset);
	return 0;
}

int store_import_block_room(struct store *store, uint32_t layer)
{
	uint32_t at = store->layer[layer].blocks;
	int rc = index_grow(store, layer, at);
	return rc < 0 ? rc : reserve_index_entry(store, layer, at);
}

void store_import_block_add(struct store *store, uint32_t layer, const store_block *entry,
			    uint64_t key_offset)
{
	store_block b = *entry;
	b.key_offset = key_offset;
	b.value_offset = pool_value_offset(key_offset, entry->key_bytes);
	b.flags = 0;
	import_entry_add(store, layer, store->layer[layer].blocks, &b);
}

/*
 * A block another session or the chunk index holds, shared into an
 * import by reference (a prefix open, docs/PREFIX.md): one more reference
 * and the next entry of the layer's index, as store_import_block does
 * with a copy.
 */
int store_import_shared_block(struct store *store, uint32_t layer, const store_block *entry)
{
	uint32_t at = store->layer[layer].blocks;
	int rc = index_grow(store, layer, at);
	if (rc == 0)
		rc = reserve_index_entry(store, layer, at);
	if (rc < 0)
		return rc;
	store_block b = *entry;
	b.flags = 0;
	pool_ref(store->pool, b.key_offset);
	import_entry_add(store, layer, at, &b);
	return 0;
}

/*
 * Finishes one layer of an import: its residual rows (compact
 * [batch][kv_heads][rows][D], K then V) copied in, its record of
 * generation 1 (committed with the rename), the readers' table. Views
 * start dropped and are rebuilt on first use, as after memory relief: an
 * import costs the bytes it moves, not a reconstruction of every token.
 */
int store_import_layer(struct store *store, uint32_t layer, uint32_t tokens,
		       uint32_t residual_tokens, const uint16_t *key_rows, const uint16_t *value_rows)
{
	const struct store_header *h = store->header;
	struct layer_state next = store->layer[layer];
	if (residual_tokens > 0) {
		int rc = reserve_residual(store, layer, residual_tokens);
		if (rc < 0)
			return rc;
		for (int tensor = 0; tensor < 2; tensor++) {
			uint32_t dim = tensor == 0 ? h->head_dim_k : h->head_dim_v;
			zc_strides strides = residual_strides(h, dim);
			zc_strides compact = { .batch = (size_t)h->kv_heads * residual_tokens * dim,
					       .head = (size_t)residual_tokens * dim };
			const uint16_t *rows = tensor == 0 ? key_rows : value_rows;
			rc = rows_write(store->fd, layer_region_offset(store, layer) +
					(tensor == 0 ? h->key_residual_offset : h->value_residual_offset),
					&strides, rows, &compact, h, residual_tokens, dim);
			if (rc == 0 && store->layout.residual_offset)
				rc = rows_write(store->map_fd, map_residual_offset(store, layer, tensor == 0),
						&strides, rows, &compact, h, residual_tokens, dim);
			if (rc < 0)
				return rc;
		}
	}
	next.tokens = tokens;
	next.residual_tokens = residual_tokens;
	next.active = 0;
	struct store_layer_commit *r = record_slot(store, layer, 0);
	r->generation = 1;
	r->tokens = next.tokens;
	r->residual_tokens = next.residual_tokens;
	r->blocks = next.blocks;
	layer_state_set(store, layer, &next);
	map_entries_write(store, layer, 0);
	if (views_full(store))
		store->room[layer].view_valid = tokens == 0;
	return 0;
}

int store_import_commit(struct store *store)
{
	store->generation = 1;
	store->commit->generation = 1;
	for (uint32_t i = 0; i < store->header->layers; i++)
		mirror_layer(store, i);
	fault_point("import.layers");
	return store_publish(store);
}

void store_import_abandon(struct store *store)
{
	store_discard(store);
}
