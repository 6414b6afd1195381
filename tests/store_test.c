/*
 * One session's store (server/store.c) on its own, without a daemon or a
 * socket: every mutation is checked against a small reference that
 * compresses the same blocks with the codec (zc_block_compress) and
 * reconstructs them (zc_block_reconstruct). After each step the session
 * map a reader would get (store_open_readonly, mmap) must show the
 * reference's counts, block table, views (views = full) or exact residual
 * (views = none); the table must equal the durable index, the pool must
 * hold the reference's compressed bytes, the stats must be the codec's
 * accounting, and the memory budget must count exactly what the files
 * hold. Forks share whole blocks by reference; adoption after a restart
 * restores every session and every reference; bad input changes nothing.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../server/budget.h"
#include "../server/pool.h"
#include "../server/store.h"
#include "layer_model.h"
#include "shm_dir.h"
#include "suite_main.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "zipcache/map.h"

#define TEST_TIMEOUT_SECONDS 300
#define PAGE 4096u

/* A small shape: two layers, two heads, K and V of different widths, a
 * streaming threshold of 8 (a residual of at most 16 rows). */
#define LAYERS 2u
#define BATCH 1u
#define KV_HEADS 2u
#define HEADS (BATCH * KV_HEADS)
#define DIM_K 16u
#define DIM_V 8u
#define MAX_TOKENS 160u
#define RESIDUAL 8u

/* ---- the reference ------------------------------------------------------------ */

struct ref_block {
	uint32_t first, tokens;
	uint8_t *kc, *vc;              /* the codec's compressed bytes */
	zc_byte_count kn, vn;
	uint16_t *krec, *vrec;         /* reconstruction, [heads][tokens][D] */
};

struct ref_layer {
	uint16_t *ek, *ev;             /* exact rows as sent, [heads][MAX_TOKENS][D] */
	uint32_t tokens, residual;
	struct ref_block *blocks;
	uint32_t n, capacity;
};

struct ref {
	zc_codec_config codec;
	bool per_call;
	enum zc_views views;
	uint32_t residual_capacity;
	struct ref_layer layer[LAYERS];
};

static uint32_t dim_of(int tensor)
{
	return tensor == 0 ? DIM_K : DIM_V;
}

static void ref_init(struct ref *r, bool per_call, enum zc_views views)
{
	memset(r, 0, sizeof(*r));
	zc_codec_config_default(&r->codec);
	r->per_call = per_call;
	r->views = views;
	r->residual_capacity = per_call ? 0 : 2 * RESIDUAL;
	for (uint32_t i = 0; i < LAYERS; i++) {
		r->layer[i].ek = allocate((size_t)HEADS * MAX_TOKENS * DIM_K * 2);
		r->layer[i].ev = allocate((size_t)HEADS * MAX_TOKENS * DIM_V * 2);
	}
}

static void ref_block_free(struct ref_block *b)
{
	free(b->kc);
	free(b->vc);
	free(b->krec);
	free(b->vrec);
}

static void ref_free(struct ref *r)
{
	for (uint32_t i = 0; i < LAYERS; i++) {
		for (uint32_t b = 0; b < r->layer[i].n; b++)
			ref_block_free(&r->layer[i].blocks[b]);
		free(r->layer[i].blocks);
		free(r->layer[i].ek);
		free(r->layer[i].ev);
	}
	memset(r, 0, sizeof(*r));
}

static void *duplicate(const void *p, size_t bytes)
{
	void *q = allocate(bytes);
	memcpy(q, p, bytes);
	return q;
}

/* A fork's reference: the first `tokens` tokens of every layer of src. */
static void ref_fork(struct ref *dst, const struct ref *src, uint32_t tokens, enum zc_views views)
{
	ref_init(dst, src->per_call, views);
	for (uint32_t i = 0; i < LAYERS; i++) {
		const struct ref_layer *s = &src->layer[i];
		struct ref_layer *d = &dst->layer[i];
		uint32_t keep = tokens < s->tokens ? tokens : s->tokens;
		uint32_t blocks_end = s->tokens - s->residual;
		memcpy(d->ek, s->ek, (size_t)HEADS * MAX_TOKENS * DIM_K * 2);
		memcpy(d->ev, s->ev, (size_t)HEADS * MAX_TOKENS * DIM_V * 2);
		d->tokens = keep;
		d->residual = keep > blocks_end ? keep - blocks_end : 0;
		d->capacity = s->n ? s->n : 1;
		d->blocks = allocate(d->capacity * sizeof(*d->blocks));
		for (uint32_t b = 0; b < s->n && s->blocks[b].first < keep; b++) {
			const struct ref_block *x = &s->blocks[b];
			struct ref_block *y = &d->blocks[d->n++];
			*y = *x;
			y->kc = duplicate(x->kc, x->kn.compressed);
			y->vc = duplicate(x->vc, x->vn.compressed);
			y->krec = duplicate(x->krec, (size_t)HEADS * x->tokens * DIM_K * 2);
			y->vrec = duplicate(x->vrec, (size_t)HEADS * x->tokens * DIM_V * 2);
		}
	}
}

/* Row t of head h of a [heads][MAX_TOKENS][D] buffer. */
static uint16_t *exact_row(uint16_t *buffer, uint32_t h, uint32_t t, uint32_t dim)
{
	return buffer + ((size_t)h * MAX_TOKENS + t) * dim;
}

/* Compresses one tensor of a contiguous [heads][tokens][D] block. */
static void ref_codec(const struct ref *r, int tensor, const uint16_t *input, uint32_t tokens,
		      uint8_t **compressed, zc_byte_count *count, uint16_t **reconstruction)
{
	zc_tensor kind = tensor == 0 ? ZC_TENSOR_KEYS : ZC_TENSOR_VALUES;
	uint32_t dim = dim_of(tensor);
	zc_block_shape shape = { BATCH, KV_HEADS, tokens, dim };
	ck_assert_int_eq(zc_block_count_bytes(&r->codec, kind, &shape, count), 0);
	*compressed = allocate(count->compressed);
	ck_assert_int_eq(zc_block_compress(&r->codec, kind, &shape, input, *compressed,
					   count->compressed),
			 (int64_t)count->compressed);
	*reconstruction = allocate((size_t)HEADS * tokens * dim * 2);
	zc_strides packed = { (size_t)KV_HEADS * tokens * dim, (size_t)tokens * dim, dim };
	ck_assert_int_eq(zc_block_reconstruct(&r->codec, kind, &shape, *compressed, count->compressed,
					      *reconstruction, &packed),
			 0);
}

/* Rows [first, first + tokens) of the exact rows become one block. */
static void ref_block_add(struct ref *r, uint32_t layer, uint32_t first, uint32_t tokens)
{
	struct ref_layer *l = &r->layer[layer];
	if (l->n == l->capacity) {
		l->capacity = l->capacity ? 2 * l->capacity : 8;
		l->blocks = realloc(l->blocks, l->capacity * sizeof(*l->blocks));
		ck_assert_ptr_nonnull(l->blocks);
	}
	struct ref_block *b = &l->blocks[l->n++];
	*b = (struct ref_block){ .first = first, .tokens = tokens };
	for (int tensor = 0; tensor < 2; tensor++) {
		uint32_t dim = dim_of(tensor);
		uint16_t *packed = allocate((size_t)HEADS * tokens * dim * 2);
		for (uint32_t h = 0; h < HEADS; h++)
			memcpy(packed + (size_t)h * tokens * dim,
			       exact_row(tensor == 0 ? l->ek : l->ev, h, first, dim),
			       (size_t)tokens * dim * 2);
		ref_codec(r, tensor, packed, tokens, tensor == 0 ? &b->kc : &b->vc,
			  tensor == 0 ? &b->kn : &b->vn, tensor == 0 ? &b->krec : &b->vrec);
		free(packed);
	}
}

static void ref_flush(struct ref *r, uint32_t layer)
{
	struct ref_layer *l = &r->layer[layer];
	if (l->residual == 0)
		return;
	ref_block_add(r, layer, l->tokens - l->residual, l->residual);
	l->residual = 0;
}

/* The rule of docs/ARCHITECTURE.md: per_call or at least R tokens is a
 * block of its own (after the residual's); else the residual, flushed
 * once it holds R. Inputs are finite and fit. */
static void ref_update(struct ref *r, uint32_t layer, const struct block *in)
{
	struct ref_layer *l = &r->layer[layer];
	uint32_t first = l->tokens;
	for (uint32_t h = 0; h < HEADS; h++) {
		memcpy(exact_row(l->ek, h, first, DIM_K), in->keys + (size_t)h * in->tokens * DIM_K,
		       (size_t)in->tokens * DIM_K * 2);
		memcpy(exact_row(l->ev, h, first, DIM_V), in->values + (size_t)h * in->tokens * DIM_V,
		       (size_t)in->tokens * DIM_V * 2);
	}
	if (r->per_call || in->tokens >= RESIDUAL) {
		ref_flush(r, layer);
		ref_block_add(r, layer, first, in->tokens);
		l->tokens += in->tokens;
		return;
	}
	l->tokens += in->tokens;
	l->residual += in->tokens;
	if (l->residual >= RESIDUAL)
		ref_flush(r, layer);
}

static uint32_t ref_trim_layer(struct ref *r, uint32_t layer, uint32_t tokens)
{
	struct ref_layer *l = &r->layer[layer];
	uint32_t cut = tokens < l->tokens ? tokens : l->tokens;
	uint32_t keep = l->tokens - cut;
	if (cut <= l->residual) {
		l->residual -= cut;
	} else {
		l->residual = 0;
		while (l->n > 0 && l->blocks[l->n - 1].first >= keep)
			ref_block_free(&l->blocks[--l->n]);
	}
	l->tokens = keep;
	return cut;
}

static uint32_t ref_trim(struct ref *r, uint32_t tokens)
{
	uint32_t most = 0;
	for (uint32_t i = 0; i < LAYERS; i++) {
		uint32_t cut = ref_trim_layer(r, i, tokens);
		most = cut > most ? cut : most;
	}
	return most;
}

/* Tokens of block b that belong to the layer. */
static uint32_t ref_valid(const struct ref_layer *l, uint32_t b)
{
	uint32_t end = b + 1 < l->n ? l->blocks[b + 1].first : l->tokens - l->residual;
	return end - l->blocks[b].first;
}

/* What a reader must see at row t of head h: the exact row in the
 * residual, else the reconstruction of the block that holds it. */
static const uint16_t *ref_row(const struct ref *r, uint32_t layer, int tensor, uint32_t h,
			       uint32_t t)
{
	const struct ref_layer *l = &r->layer[layer];
	uint32_t dim = dim_of(tensor);
	if (t >= l->tokens - l->residual)
		return exact_row(tensor == 0 ? l->ek : l->ev, h, t, dim);
	for (uint32_t b = l->n; b-- > 0;) {
		const struct ref_block *x = &l->blocks[b];
		if (x->first <= t)
			return (tensor == 0 ? x->krec : x->vrec) + ((size_t)h * x->tokens +
								     (t - x->first)) * dim;
	}
	ck_abort_msg("layer %u token %u is in no block", layer, t);
	return NULL;
}

/* ---- the store under test ---------------------------------------------------------- */

struct fixture {
	struct shm_dir dir;
	struct store_budget budget;
	struct pool_set pools;
	struct pool *pool;
	struct rng rng;
};

static void fixture_start(struct fixture *f, const char *tag)
{
	char reason[200] = "";
	memset(f, 0, sizeof(*f));
	shm_dir_make(&f->dir, tag);
	pool_set_init(&f->pools, f->dir.fd, f->dir.path);
	int rc = pool_set_get(&f->pools, (uint32_t)geteuid(), &f->budget, &f->pool, NULL, reason,
			      sizeof(reason));
	ck_assert_msg(rc == 0, "pool: %s (%s)", zc_strerror(rc), reason);
	rng_seed(&f->rng, 0x5eed5eedu);
}

static void fixture_end(struct fixture *f)
{
	pool_set_free(&f->pools);
	ck_assert_uint_eq(f->budget.used, 0);
	shm_dir_remove(&f->dir);
}

static struct store_params params_of(uint64_t id, bool per_call, enum zc_views views)
{
	zc_codec_config codec;
	zc_codec_config_default(&codec);
	return (struct store_params){
		.session_id = id,
		.boot_epoch = 1,
		.owner_uid = (uint32_t)geteuid(),
		.name = "store-test",
		.layers = LAYERS, .batch = BATCH, .kv_heads = KV_HEADS,
		.head_dim_k = DIM_K, .head_dim_v = DIM_V,
		.max_tokens = MAX_TOKENS,
		.codec = codec,
		.policy = per_call ? STORE_POLICY_PER_CALL : STORE_POLICY_STREAMING,
		.residual_tokens = per_call ? 0 : RESIDUAL,
		.views = views,
	};
}

static struct store *store_new(struct fixture *f, uint64_t id, bool per_call, enum zc_views views)
{
	struct store_params p = params_of(id, per_call, views);
	struct store *s = NULL;
	int rc = store_create(f->dir.fd, f->dir.path, &p, &f->budget, f->pool, &s);
	ck_assert_msg(rc == 0, "store_create %llu: %s", (unsigned long long)id, zc_strerror(rc));
	return s;
}

/* One update through the store and the reference. */
static void update(struct fixture *f, struct store *s, struct ref *r, uint32_t layer,
		   uint32_t tokens)
{
	struct block in;
	block_make_shape(&in, HEADS, DIM_K, DIM_V, tokens, &f->rng);
	int rc = store_update(s, layer, tokens, in.keys, in.values);
	ck_assert_msg(rc == 0, "update of layer %u by %u tokens: %s", layer, tokens, zc_strerror(rc));
	ref_update(r, layer, &in);
	block_free(&in);
}

/* A reader's read-only mapping of the session map. */
struct map {
	const uint8_t *base;
	size_t bytes;
	const zc_map_header *h;
};

static void map_open(const struct store *s, struct map *m)
{
	int fd = store_open_readonly(s);
	ck_assert_int_ge(fd, 0);
	struct stat st;
	ck_assert_int_eq(fstat(fd, &st), 0);
	m->bytes = (size_t)st.st_size;
	ck_assert_uint_eq(m->bytes, store_map_layout(s)->map_bytes);
	/* Read-only: no writable shared mapping of it. */
	ck_assert_ptr_eq(mmap(NULL, m->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
	void *base = mmap(NULL, m->bytes, PROT_READ, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(base, MAP_FAILED);
	close(fd);
	m->base = base;
	m->h = base;
}

static void map_close(struct map *m)
{
	munmap((void *)m->base, m->bytes);
}

static const zc_map_block *map_table(const struct map *m, uint32_t layer)
{
	return (const zc_map_block *)(m->base + m->h->table_offset + layer * m->h->table_bytes);
}

static const uint16_t *map_view(const struct map *m, uint32_t layer, int tensor)
{
	return (const uint16_t *)(m->base + m->h->views_offset + layer * m->h->view_layer_bytes +
				  (tensor == 0 ? 0 : m->h->key_view_bytes));
}

static const uint16_t *map_residual(const struct map *m, uint32_t layer, int tensor)
{
	return (const uint16_t *)(m->base + m->h->residual_offset + layer * m->h->residual_bytes +
				  (tensor == 0 ? 0 : m->h->key_residual_bytes));
}

/* The durable file's block index and current commit record of a layer. */
static void durable_read(const struct store *s, uint32_t layer, store_block *index, uint32_t n,
			 struct store_layer_commit *current)
{
	const struct store_header *h = store_header(s);
	int fd = open(store_path(s), O_RDONLY | O_CLOEXEC);
	ck_assert_msg(fd >= 0, "open %s: %s", store_path(s), strerror(errno));
	struct store_header on_disk;
	ck_assert_int_eq(pread(fd, &on_disk, sizeof(on_disk), 0), (ssize_t)sizeof(on_disk));
	ck_assert(memcmp(on_disk.magic, STORE_MAGIC, 8) == 0);
	/* The rest of the header is the daemon's private copy. */
	ck_assert(memcmp(on_disk.magic + 8, h->magic + 8, sizeof(on_disk) - 8) == 0);
	off_t at = (off_t)(h->layers_offset + layer * h->layer_region_bytes + h->index_offset);
	ssize_t bytes = (ssize_t)(n * sizeof(store_block));
	if (n > 0)
		ck_assert_int_eq(pread(fd, index, (size_t)bytes, at), bytes);
	uint64_t committed;
	struct store_layer_commit records[2];
	ck_assert_int_eq(pread(fd, &committed, 8, (off_t)h->commit_offset), 8);
	ck_assert_int_eq(pread(fd, records, sizeof(records),
			       (off_t)(h->commit_offset + sizeof(struct store_commit_area) +
				       2 * layer * sizeof(struct store_layer_commit))),
			 (ssize_t)sizeof(records));
	close(fd);
	int best = -1;
	for (int i = 0; i < 2; i++)
		if (records[i].generation <= committed &&
		    (best < 0 || records[i].generation > records[best].generation))
			best = i;
	ck_assert_int_ge(best, 0);
	*current = records[best];
}

static bool rows_equal(const uint16_t *a, const uint16_t *b, uint32_t dim)
{
	return memcmp(a, b, (size_t)dim * 2) == 0;
}

/*
 * The store equals the reference: counts, stats, the map's layer header,
 * block table (= durable index, = the codec's bytes in the pool), and the
 * readable rows (views where valid, or the readers' residual).
 */
static void check(const struct store *s, const struct ref *r, const char *when)
{
	struct map m;
	map_open(s, &m);
	ck_assert(memcmp(m.h->magic, ZC_MAP_MAGIC, 8) == 0);
	ck_assert(memcmp(m.h, store_map_layout(s), offsetof(zc_map_header, layer)) == 0);
	ck_assert_uint_eq(m.h->views, r->views);
	if (r->views == ZC_VIEWS_NONE) {
		ck_assert_uint_eq(m.h->views_offset, 0);
		ck_assert_uint_ne(m.h->residual_offset, 0);
	} else {
		ck_assert_uint_ne(m.h->views_offset, 0);
		ck_assert_uint_eq(m.h->residual_offset, 0);
	}
	struct pool *pool = store_pool(s);
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		const struct ref_layer *l = &r->layer[layer];
		const zc_map_layer *ml = &m.h->layer[layer];
		uint64_t kc = 0, kb = 0, vc = 0, vb = 0;
		for (uint32_t b = 0; b < l->n; b++) {
			kc += l->blocks[b].kn.compressed;
			kb += l->blocks[b].kn.baseline;
			vc += l->blocks[b].vn.compressed;
			vb += l->blocks[b].vn.baseline;
		}

		/* The counts and the map's layer header. */
		ck_assert_msg(store_layer_tokens(s, layer) == l->tokens, "%s: layer %u has %u tokens, "
			      "not %u", when, layer, store_layer_tokens(s, layer), l->tokens);
		ck_assert_msg(ml->tokens == l->tokens && ml->residual_tokens == l->residual &&
				      ml->blocks == l->n,
			      "%s: layer %u's map says %u tokens, %u residual, %u blocks; want %u, %u, %u",
			      when, layer, ml->tokens, ml->residual_tokens, ml->blocks, l->tokens,
			      l->residual, l->n);
		ck_assert_msg(ml->sequence % 2 == 0, "%s: layer %u left mid-write", when, layer);
		ck_assert_uint_eq(ml->sequence, store_layer_sequence(s, layer));
		ck_assert_uint_eq(ml->generation, store_view_generation(s, layer));
		ck_assert_uint_eq(ml->key_compressed_bytes, kc);
		ck_assert_uint_eq(ml->key_baseline_bytes, kb);
		ck_assert_uint_eq(ml->value_compressed_bytes, vc);
		ck_assert_uint_eq(ml->value_baseline_bytes, vb);

		/* Stats: the codec's accounting over the blocks, plus the
		 * residual as the fp16 it is (its baseline that of the block it
		 * will become). */
		struct store_layer_stats st;
		store_layer_stats(s, layer, &st);
		zc_byte_count rk = { 0 }, rv = { 0 };
		if (l->residual) {
			zc_block_shape ks = { BATCH, KV_HEADS, l->residual, DIM_K };
			zc_block_shape vs = { BATCH, KV_HEADS, l->residual, DIM_V };
			ck_assert_int_eq(zc_block_count_bytes(&r->codec, ZC_TENSOR_KEYS, &ks, &rk), 0);
			ck_assert_int_eq(zc_block_count_bytes(&r->codec, ZC_TENSOR_VALUES, &vs, &rv), 0);
		}
		ck_assert_uint_eq(st.layer, layer);
		ck_assert_uint_eq(st.tokens, l->tokens);
		ck_assert_uint_eq(st.residual_tokens, l->residual);
		ck_assert_uint_eq(st.blocks, l->n);
		ck_assert_msg(st.key.compressed == kc + rk.fp16 && st.key.baseline == kb + rk.baseline &&
				      st.value.compressed == vc + rv.fp16 &&
				      st.value.baseline == vb + rv.baseline,
			      "%s: layer %u stats K %llu/%llu V %llu/%llu, the codec says K %llu/%llu "
			      "V %llu/%llu", when, layer, (unsigned long long)st.key.compressed,
			      (unsigned long long)st.key.baseline, (unsigned long long)st.value.compressed,
			      (unsigned long long)st.value.baseline, (unsigned long long)(kc + rk.fp16),
			      (unsigned long long)(kb + rk.baseline), (unsigned long long)(vc + rv.fp16),
			      (unsigned long long)(vb + rv.baseline));
		ck_assert_uint_eq(st.key.fp16, (uint64_t)HEADS * l->tokens * DIM_K * 2);
		ck_assert_uint_eq(st.value.fp16, (uint64_t)HEADS * l->tokens * DIM_V * 2);

		/* The table: the reference's blocks, the durable index, the
		 * codec's bytes in the pool. */
		const zc_map_block *table = map_table(&m, layer);
		store_block *index = allocate((l->n + 1) * sizeof(*index));
		struct store_layer_commit record;
		durable_read(s, layer, index, l->n, &record);
		ck_assert_msg(record.tokens == l->tokens && record.residual_tokens == l->residual &&
				      record.blocks == l->n,
			      "%s: layer %u's durable record says %u tokens, %u residual, %u blocks",
			      when, layer, record.tokens, record.residual_tokens, record.blocks);
		for (uint32_t b = 0; b < l->n; b++) {
			const struct ref_block *x = &l->blocks[b];
			const zc_map_block *e = &table[b];
			ck_assert_msg(e->first_token == x->first && e->tokens == x->tokens &&
					      e->key_bytes == x->kn.compressed &&
					      e->value_bytes == x->vn.compressed && e->flags == 0,
				      "%s: layer %u block %u is tokens %u+%u (%llu/%llu bytes), want "
				      "%u+%u", when, layer, b, e->first_token, e->tokens,
				      (unsigned long long)e->key_bytes,
				      (unsigned long long)e->value_bytes, x->first, x->tokens);
			ck_assert_msg(e->valid_tokens == ref_valid(l, b),
				      "%s: layer %u block %u's table entry says %u valid tokens; %u of "
				      "its rows belong to the layer", when, layer, b, e->valid_tokens,
				      ref_valid(l, b));
			ck_assert_uint_eq(e->value_offset, pool_value_offset(e->key_offset, e->key_bytes));
			/* The durable entry keeps the rows it was written with
			 * (committed entries never change); the rest is the same. */
			zc_map_block durable = index[b];
			ck_assert_uint_eq(durable.valid_tokens, durable.tokens);
			durable.valid_tokens = e->valid_tokens;
			ck_assert_msg(memcmp(&durable, e, sizeof(*e)) == 0,
				      "%s: layer %u block %u: the map's entry differs from the durable "
				      "index's", when, layer, b);
			ck_assert_uint_ge(pool_refs(pool, e->key_offset), 1);
			uint8_t *got = allocate(x->kn.compressed + x->vn.compressed);
			ck_assert_int_eq(pool_read(pool, e->key_offset, got, x->kn.compressed), 0);
			ck_assert_msg(memcmp(got, x->kc, x->kn.compressed) == 0,
				      "%s: layer %u block %u: K in the pool is not the codec's", when,
				      layer, b);
			ck_assert_int_eq(pool_read(pool, e->value_offset, got, x->vn.compressed), 0);
			ck_assert_msg(memcmp(got, x->vc, x->vn.compressed) == 0,
				      "%s: layer %u block %u: V in the pool is not the codec's", when,
				      layer, b);
			free(got);
		}
		free(index);

		/* The rows a reader reads. */
		if (r->views == ZC_VIEWS_FULL) {
			ck_assert_uint_eq(ml->view_valid, store_views_full(s) ? ml->view_valid : 0);
			if (ml->view_valid) {
				for (int tensor = 0; tensor < 2; tensor++) {
					uint32_t dim = dim_of(tensor);
					const uint16_t *view = map_view(&m, layer, tensor);
					ck_assert_uint_eq((uint64_t)(view - (const uint16_t *)m.base) * 2,
							  tensor == 0 ? store_key_view_offset(s, layer) :
									store_value_view_offset(s, layer));
					for (uint32_t h = 0; h < HEADS; h++)
						for (uint32_t t = 0; t < l->tokens; t++)
							ck_assert_msg(rows_equal(view + ((size_t)h * MAX_TOKENS + t) * dim,
										 ref_row(r, layer, tensor, h, t), dim),
								      "%s: layer %u %s view, head %u, token %u differs",
								      when, layer, tensor == 0 ? "K" : "V", h, t);
				}
			}
		} else {
			ck_assert_uint_eq(store_key_view_offset(s, layer), 0);
			for (int tensor = 0; tensor < 2; tensor++) {
				uint32_t dim = dim_of(tensor);
				const uint16_t *res = map_residual(&m, layer, tensor);
				for (uint32_t h = 0; h < HEADS; h++)
					for (uint32_t i = 0; i < l->residual; i++)
						ck_assert_msg(rows_equal(res + ((size_t)h * r->residual_capacity + i) * dim,
									 ref_row(r, layer, tensor, h,
										 l->tokens - l->residual + i),
									 dim),
							      "%s: layer %u %s readers' residual, head %u, row %u "
							      "differs from the input", when, layer,
							      tensor == 0 ? "K" : "V", h, i);
			}
		}
	}
	map_close(&m);
}

/* Every view of a views = full store is valid (in the map too). */
static void assert_views_valid(const struct store *s)
{
	struct map m;
	map_open(s, &m);
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		ck_assert_msg(m.h->layer[layer].view_valid == 1, "layer %u's view is not valid", layer);
	map_close(&m);
	ck_assert_uint_eq(store_rebuild_elements(s, STORE_ALL_LAYERS), 0);
}

/* The budget counts exactly what the stores' files and the pools hold. */
#define assert_budget_exact(f, stores, n) budget_exact(f, stores, n, __LINE__)

static void budget_exact(const struct fixture *f, struct store *const *stores, int n, int line)
{
	uint64_t held = pool_set_file_bytes(&f->pools);
	for (int i = 0; i < n; i++)
		if (stores[i])
			held += store_memory_bytes(stores[i]);
	ck_assert_msg(f->budget.used == held, "line %d: the budget counts %llu bytes, the files "
		      "hold %llu", line, (unsigned long long)f->budget.used, (unsigned long long)held);
	ck_assert_uint_eq(pool_set_memory_bytes(&f->pools), pool_set_file_bytes(&f->pools));
}

static void session_file_name(char *out, size_t size, uint64_t id, bool temporary)
{
	snprintf(out, size, "%ssession-%016llx.zcs%s", temporary ? "." : "", (unsigned long long)id,
		 temporary ? ".tmp" : "");
}

/* Copies of a store's views (valid rows only), for comparing later. */
struct views_copy {
	uint16_t *rows[LAYERS][2];
	uint32_t tokens[LAYERS];
};

static void views_save(const struct store *s, struct views_copy *c)
{
	struct map m;
	map_open(s, &m);
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		ck_assert_uint_eq(m.h->layer[layer].view_valid, 1);
		c->tokens[layer] = m.h->layer[layer].tokens;
		for (int tensor = 0; tensor < 2; tensor++) {
			/* Only the rows readers may read: touching the others
			 * would fault pages into the map (a reader's cost). */
			uint32_t dim = dim_of(tensor);
			c->rows[layer][tensor] = allocate((size_t)HEADS * MAX_TOKENS * dim * 2);
			for (uint32_t h = 0; h < HEADS; h++) {
				size_t at = (size_t)h * MAX_TOKENS * dim;
				memcpy(c->rows[layer][tensor] + at, map_view(&m, layer, tensor) + at,
				       (size_t)c->tokens[layer] * dim * 2);
			}
		}
	}
	map_close(&m);
}

/* The store's valid view rows equal the copy's, bit for bit. */
static void views_compare(const struct store *s, const struct views_copy *c, const char *when)
{
	struct map m;
	map_open(s, &m);
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		ck_assert_uint_eq(m.h->layer[layer].tokens, c->tokens[layer]);
		for (int tensor = 0; tensor < 2; tensor++) {
			uint32_t dim = dim_of(tensor);
			for (uint32_t h = 0; h < HEADS; h++) {
				size_t at = (size_t)h * MAX_TOKENS * dim;
				ck_assert_msg(memcmp(map_view(&m, layer, tensor) + at,
						     c->rows[layer][tensor] + at,
						     (size_t)c->tokens[layer] * dim * 2) == 0,
					      "%s: layer %u %s view of head %u differs from before", when,
					      layer, tensor == 0 ? "K" : "V", h);
			}
		}
	}
	map_close(&m);
}

static void views_copy_free(struct views_copy *c)
{
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		for (int tensor = 0; tensor < 2; tensor++)
			free(c->rows[layer][tensor]);
}

/* ---- create ----------------------------------------------------------------------- */

START_TEST(create_views_full_and_none)
{
	struct fixture f;
	fixture_start(&f, "store_create");
	struct store *full = store_new(&f, 1, false, ZC_VIEWS_FULL);
	struct store *none = store_new(&f, 2, false, ZC_VIEWS_NONE);
	struct ref r_full, r_none;
	ref_init(&r_full, false, ZC_VIEWS_FULL);
	ref_init(&r_none, false, ZC_VIEWS_NONE);
	char name[64];

	/* The files are in place under their names, none left temporary. */
	session_file_name(name, sizeof(name), 1, false);
	ck_assert(shm_dir_has(&f.dir, name));
	session_file_name(name, sizeof(name), 1, true);
	ck_assert(!shm_dir_has(&f.dir, name));
	ck_assert(strstr(store_path(full), f.dir.path) == store_path(full));
	const struct store_header *h = store_header(full);
	ck_assert_uint_eq(h->session_id, 1);
	ck_assert_uint_eq(h->owner_uid, geteuid());
	ck_assert_uint_eq(h->residual_capacity, 2 * RESIDUAL);
	ck_assert_str_eq(h->name, "store-test");
	ck_assert(store_views_full(full));
	ck_assert(!store_views_full(none));
	ck_assert_ptr_eq(store_pool(full), f.pool);

	/* Readers' layouts: views, or a residual of their own instead. */
	const zc_map_header *mf = store_map_layout(full), *mn = store_map_layout(none);
	ck_assert_uint_eq(mf->key_view_bytes, 3 * PAGE);   /* 2 x 160 x 16 x 2 bytes, page-rounded */
	ck_assert_uint_eq(mf->view_layer_bytes, 3 * PAGE + 2 * PAGE);
	ck_assert_uint_eq(mn->views_offset, 0);
	ck_assert_uint_eq(mn->residual_bytes, 2 * PAGE);
	ck_assert_uint_lt(mn->map_bytes, mf->map_bytes);
	ck_assert_uint_eq(mf->pool_bytes, POOL_CAPACITY_BYTES);
	uint64_t bytes;
	struct store_params p = params_of(1, false, ZC_VIEWS_FULL);
	ck_assert_int_eq(store_layout_bytes(&p, &bytes), 0);
	ck_assert_uint_eq(bytes, h->file_bytes + mf->map_bytes);
	check(full, &r_full, "a new session");
	check(none, &r_none, "a new session without views");
	assert_views_valid(full);
	struct store *both[] = { full, none };
	assert_budget_exact(&f, both, 2);
	uint32_t low, high;
	store_token_range(full, &low, &high);
	ck_assert_uint_eq(low, 0);
	ck_assert_uint_eq(high, 0);

	/* A second session of the same id is refused; the first is untouched. */
	struct store *again = NULL;
	uint64_t used = f.budget.used;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &p, &f.budget, f.pool, &again),
			 ZC_EEXISTS);
	ck_assert_ptr_null(again);
	ck_assert_uint_eq(f.budget.used, used);
	session_file_name(name, sizeof(name), 1, true);
	ck_assert(!shm_dir_has(&f.dir, name));
	check(full, &r_full, "after a refused duplicate");

	/* Parameters out of range: refused, nothing left behind. */
	struct store_params q;
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.layers = 0;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again), ZC_ESHAPE);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.layers = STORE_MAX_LAYERS + 1;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again), ZC_ESHAPE);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.head_dim_k = ZC_MAX_HEAD_DIM + 1;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again), ZC_ESHAPE);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.residual_tokens = 0;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again),
			 ZC_EINVALID);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.views = (enum zc_views)7;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again),
			 ZC_EINVALID);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.codec.hi_bits = 9;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again), ZC_EBITS);
	q = params_of(9, false, ZC_VIEWS_FULL);
	q.name = NULL;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &q, &f.budget, f.pool, &again),
			 ZC_EINVALID);
	session_file_name(name, sizeof(name), 9, false);
	ck_assert(!shm_dir_has(&f.dir, name));
	session_file_name(name, sizeof(name), 9, true);
	ck_assert(!shm_dir_has(&f.dir, name));
	ck_assert_uint_eq(f.budget.used, used);

	store_close(full, true);
	store_close(none, true);
	session_file_name(name, sizeof(name), 1, false);
	ck_assert(!shm_dir_has(&f.dir, name));
	ck_assert_uint_eq(f.budget.used, PAGE);   /* the pool's header page */
	ref_free(&r_full);
	ref_free(&r_none);
	fixture_end(&f);
}
END_TEST

/* ---- update --------------------------------------------------------------------------- */

/* Short updates into the residual, its flushes, direct blocks (which
 * flush the residual ahead of them), on both layers differently. */
static void updates_run(bool per_call, enum zc_views views)
{
	struct fixture f;
	fixture_start(&f, "store_update");
	struct store *s = store_new(&f, 3, per_call, views);
	struct ref r;
	ref_init(&r, per_call, views);
	static const uint32_t steps[][2] = {
		{ 0, 3 }, { 0, 3 }, { 1, 1 }, { 0, 3 },     /* 9 >= R: flushed as one block */
		{ 0, 5 }, { 0, 20 },                         /* residual 5, then a direct 20 */
		{ 1, 8 },                                    /* exactly R: direct */
		{ 0, 7 }, { 0, 1 },                          /* fills R: flushed */
		{ 1, 2 }, { 1, 5 }, { 1, 40 }, { 0, 1 }, { 1, 7 },
	};
	char when[64];
	uint64_t sequence = store_layer_sequence(s, 0);
	for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
		uint32_t layer = steps[i][0], tokens = steps[i][1];
		bool compresses = per_call || tokens >= RESIDUAL ||
				  r.layer[layer].residual + tokens >= RESIDUAL;
		ck_assert_int_eq(store_update_compresses(s, layer, tokens), compresses);
		update(&f, s, &r, layer, tokens);
		snprintf(when, sizeof(when), "update %zu (layer %u, %u tokens)", i, layer, tokens);
		check(s, &r, when);
		struct store *one[] = { s };
		assert_budget_exact(&f, one, 1);
	}
	ck_assert_uint_gt(store_layer_sequence(s, 0), sequence);
	if (views == ZC_VIEWS_FULL)
		assert_views_valid(s);
	if (!per_call) {
		ck_assert_uint_gt(r.layer[0].n, 2);
		ck_assert_uint_gt(r.layer[1].residual, 0);
	}
	uint32_t low, high;
	store_token_range(s, &low, &high);
	ck_assert_uint_eq(low, r.layer[0].tokens < r.layer[1].tokens ? r.layer[0].tokens :
								       r.layer[1].tokens);
	ck_assert_uint_eq(high, r.layer[0].tokens > r.layer[1].tokens ? r.layer[0].tokens :
									r.layer[1].tokens);
	/* Each block is an extent of its own in the pool. */
	ck_assert_uint_eq(pool_blocks(f.pool), r.layer[0].n + r.layer[1].n);
	store_close(s, true);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	ck_assert_uint_eq(f.budget.used, PAGE);
	ref_free(&r);
	fixture_end(&f);
}

START_TEST(updates_streaming_views_full)
{
	updates_run(false, ZC_VIEWS_FULL);
}
END_TEST

START_TEST(updates_streaming_views_none)
{
	updates_run(false, ZC_VIEWS_NONE);
}
END_TEST

START_TEST(updates_per_call)
{
	updates_run(true, ZC_VIEWS_FULL);
	updates_run(true, ZC_VIEWS_NONE);
}
END_TEST

/* ---- trim ------------------------------------------------------------------------------ */

static void trims_run(enum zc_views views)
{
	struct fixture f;
	fixture_start(&f, "store_trim");
	struct store *s = store_new(&f, 4, false, views);
	struct ref r;
	ref_init(&r, false, views);
	struct store *one[] = { s };
	uint32_t trimmed = 99;
	char when[96];

	/* Layer 0: blocks of 10, 12 and 9 (0..31), a residual of 5 (31..36).
	 * Layer 1: a block of 20 and a residual of 3. */
	update(&f, s, &r, 0, 10);
	update(&f, s, &r, 0, 12);
	update(&f, s, &r, 0, 4);
	update(&f, s, &r, 0, 5);
	update(&f, s, &r, 0, 5);
	update(&f, s, &r, 1, 20);
	update(&f, s, &r, 1, 3);
	ck_assert_uint_eq(r.layer[0].n, 3);
	ck_assert_uint_eq(r.layer[0].residual, 5);
	check(s, &r, "before trimming");

	/* One layer, inside the residual. */
	ck_assert_int_eq(store_trim_layer(s, 0, 2, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim_layer(&r, 0, 2));
	check(s, &r, "trim of layer 0 inside its residual");
	/* Through the rest of the residual and into the last block: it stays
	 * whole, cut (its extent stays too). */
	uint64_t blocks_before = pool_blocks(f.pool);
	ck_assert_int_eq(store_trim_layer(s, 0, 7, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim_layer(&r, 0, 7));
	ck_assert_uint_eq(r.layer[0].n, 3);
	check(s, &r, "trim of layer 0 through its residual into a block");
	ck_assert_uint_eq(pool_blocks(f.pool), blocks_before);
	/* Exactly at a block boundary: the last block goes, its extent freed. */
	uint64_t file_before = pool_file_bytes(f.pool);
	ck_assert_int_eq(store_trim_layer(s, 0, r.layer[0].tokens - 22, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim_layer(&r, 0, r.layer[0].tokens - 22));
	ck_assert_uint_eq(r.layer[0].n, 2);
	check(s, &r, "trim of layer 0 to a block boundary");
	ck_assert_uint_eq(pool_blocks(f.pool), blocks_before - 1);
	ck_assert_uint_lt(pool_file_bytes(f.pool), file_before);
	assert_budget_exact(&f, one, 1);
	/* Zero tokens change nothing; a layer out of range is refused. */
	uint64_t sequence = store_layer_sequence(s, 0);
	ck_assert_int_eq(store_trim_layer(s, 0, 0, &trimmed), 0);
	ck_assert_uint_eq(trimmed, 0);
	ck_assert_uint_eq(store_layer_sequence(s, 0), sequence);
	ck_assert_int_eq(store_trim_layer(s, LAYERS, 1, &trimmed), ZC_EINVALID);
	check(s, &r, "after a trim of no layer");

	/* Updates after a cut: the cut block keeps its valid prefix. */
	ck_assert_int_eq(store_trim_layer(s, 0, 5, &trimmed), 0);
	ref_trim_layer(&r, 0, 5);
	update(&f, s, &r, 0, 3);
	update(&f, s, &r, 0, 11);
	check(s, &r, "updates after a trim that cut a block");

	/* All layers: each loses its own tail (the shorter as far as it has). */
	ck_assert_int_eq(store_trim(s, 6, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim(&r, 6));
	check(s, &r, "trim of all layers");
	uint32_t layer1 = r.layer[1].tokens;
	update(&f, s, &r, 1, 30);
	snprintf(when, sizeof(when), "trim of all layers by %u", layer1 + 30);
	ck_assert_int_eq(store_trim(s, layer1 + 30, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim(&r, layer1 + 30));
	ck_assert_uint_eq(r.layer[1].tokens, 0);
	check(s, &r, when);
	/* Past everything: empty, every extent freed. */
	ck_assert_int_eq(store_trim(s, MAX_TOKENS + 1000, &trimmed), 0);
	ck_assert_uint_eq(trimmed, ref_trim(&r, MAX_TOKENS + 1000));
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	check(s, &r, "trim of everything");
	ck_assert_int_eq(store_trim(s, 1, &trimmed), 0);
	ck_assert_uint_eq(trimmed, 0);
	assert_budget_exact(&f, one, 1);
	/* And it fills again. */
	update(&f, s, &r, 0, 9);
	update(&f, s, &r, 1, 2);
	check(s, &r, "updates after trimming everything");
	store_close(s, true);
	ref_free(&r);
	fixture_end(&f);
}

START_TEST(trims_views_full)
{
	trims_run(ZC_VIEWS_FULL);
}
END_TEST

START_TEST(trims_views_none)
{
	trims_run(ZC_VIEWS_NONE);
}
END_TEST

/* ---- fork ---------------------------------------------------------------------------------- */

/* A source of blocks 0..10, 10..22, a residual 22..27 in layer 0 and a
 * block 0..9 plus residual 9..11 in layer 1. */
static struct store *fork_source(struct fixture *f, struct ref *r, uint64_t id, enum zc_views views)
{
	struct store *s = store_new(f, id, false, views);
	ref_init(r, false, views);
	update(f, s, r, 0, 10);
	update(f, s, r, 0, 12);
	update(f, s, r, 0, 5);
	update(f, s, r, 1, 9);
	update(f, s, r, 1, 2);
	check(s, r, "the fork's source");
	return s;
}

static struct store *fork_of(struct fixture *f, struct store *source, uint32_t tokens, uint64_t id,
			     enum zc_views views)
{
	struct store_params p = params_of(id, false, views);
	p.name = "forked";
	p.max_tokens = 1;   /* ignored: the shape is the source's */
	struct store *fork = NULL;
	int rc = store_fork(source, tokens, f->dir.fd, f->dir.path, &p, &f->budget, &fork);
	ck_assert_msg(rc == 0, "fork at %u: %s", tokens, zc_strerror(rc));
	ck_assert_str_eq(store_header(fork)->name, "forked");
	ck_assert_uint_eq(store_header(fork)->max_tokens, MAX_TOKENS);
	return fork;
}

/* Blocks both refs name (same first token and size) and their extents. */
static uint64_t shared_extent_bytes(const struct ref *a, const struct ref *b)
{
	uint64_t bytes = 0;
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		for (uint32_t i = 0; i < a->layer[layer].n && i < b->layer[layer].n; i++) {
			const struct ref_block *x = &a->layer[layer].blocks[i];
			bytes += pool_extent_bytes(x->kn.compressed, x->vn.compressed);
		}
	return bytes;
}

/* Each block of both stores' tables has refs 1 or, where both name it, 2. */
static void assert_refs(const struct store *a, const struct store *b, const char *when)
{
	struct map ma, mb;
	map_open(a, &ma);
	map_open(b, &mb);
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		const zc_map_block *ta = map_table(&ma, layer), *tb = map_table(&mb, layer);
		for (uint32_t i = 0; i < ma.h->layer[layer].blocks; i++) {
			bool shared = false;
			for (uint32_t j = 0; j < mb.h->layer[layer].blocks; j++)
				shared = shared || tb[j].key_offset == ta[i].key_offset;
			ck_assert_msg(pool_refs(store_pool(a), ta[i].key_offset) == (shared ? 2u : 1u),
				      "%s: layer %u block %u has %u references, want %u", when, layer,
				      i, pool_refs(store_pool(a), ta[i].key_offset), shared ? 2 : 1);
		}
	}
	map_close(&ma);
	map_close(&mb);
}

/* Forks at `at`, checks both, drives both on and closes them in the
 * given order. */
static void fork_case(uint32_t at, enum zc_views source_views, enum zc_views fork_views,
		      bool close_source_first)
{
	struct fixture f;
	char tag[64], when[128];
	snprintf(tag, sizeof(tag), "store_fork%u", at);
	fixture_start(&f, tag);
	struct ref rs, rf;
	struct store *source = fork_source(&f, &rs, 10, source_views);
	struct store *fork = fork_of(&f, source, at, 11, fork_views);
	ref_fork(&rf, &rs, at, fork_views);
	struct store *both[] = { source, fork };

	snprintf(when, sizeof(when), "fork at %u", at);
	/* A fork of a source without views has its views to build. */
	if (fork_views == ZC_VIEWS_FULL && source_views == ZC_VIEWS_NONE && at > 0) {
		ck_assert_uint_gt(store_rebuild_elements(fork, STORE_ALL_LAYERS), 0);
		ck_assert_int_eq(store_rebuild_views(fork), 0);
	}
	if (fork_views == ZC_VIEWS_FULL)
		assert_views_valid(fork);
	check(fork, &rf, when);
	check(source, &rs, when);
	assert_refs(source, fork, when);
	assert_refs(fork, source, when);
	ck_assert_uint_eq(store_shared_bytes(source), shared_extent_bytes(&rs, &rf));
	ck_assert_uint_eq(store_shared_bytes(fork), shared_extent_bytes(&rs, &rf));
	ck_assert_uint_eq(pool_shared_bytes(f.pool), shared_extent_bytes(&rs, &rf));
	assert_budget_exact(&f, both, 2);

	/* Both go on: neither sees the other's changes. */
	update(&f, fork, &rf, 0, 3);
	update(&f, fork, &rf, 1, 12);
	uint32_t trimmed;
	ck_assert_int_eq(store_trim(source, 4, &trimmed), 0);
	ref_trim(&rs, 4);
	update(&f, source, &rs, 0, 6);
	ck_assert_int_eq(store_trim_layer(fork, 0, 2, &trimmed), 0);
	ref_trim_layer(&rf, 0, 2);
	update(&f, source, &rs, 1, 8);
	snprintf(when, sizeof(when), "fork at %u, both changed", at);
	check(fork, &rf, when);
	check(source, &rs, when);
	assert_refs(source, fork, when);
	assert_refs(fork, source, when);
	assert_budget_exact(&f, both, 2);

	/* One closes: every block the other names has one reference again,
	 * and the other is as it was. */
	struct store *gone = close_source_first ? source : fork;
	struct store *left = close_source_first ? fork : source;
	struct ref *left_ref = close_source_first ? &rf : &rs;
	store_close(gone, true);
	snprintf(when, sizeof(when), "fork at %u, the %s closed", at,
		 close_source_first ? "source" : "fork");
	check(left, left_ref, when);
	ck_assert_uint_eq(store_shared_bytes(left), 0);
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 0);
	ck_assert_uint_eq(pool_blocks(f.pool), left_ref->layer[0].n + left_ref->layer[1].n);
	struct map m;
	map_open(left, &m);
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		for (uint32_t i = 0; i < m.h->layer[layer].blocks; i++)
			ck_assert_uint_eq(pool_refs(f.pool, map_table(&m, layer)[i].key_offset), 1);
	map_close(&m);
	update(&f, left, left_ref, 0, 9);
	check(left, left_ref, when);
	struct store *one[] = { left };
	assert_budget_exact(&f, one, 1);
	store_close(left, true);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	ck_assert_uint_eq(f.budget.used, PAGE);
	ref_free(&rs);
	ref_free(&rf);
	fixture_end(&f);
}

START_TEST(fork_inside_a_block)
{
	fork_case(15, ZC_VIEWS_FULL, ZC_VIEWS_FULL, false);
	fork_case(4, ZC_VIEWS_FULL, ZC_VIEWS_NONE, true);
}
END_TEST

START_TEST(fork_at_a_block_boundary)
{
	fork_case(10, ZC_VIEWS_FULL, ZC_VIEWS_FULL, true);
	fork_case(22, ZC_VIEWS_NONE, ZC_VIEWS_NONE, false);
}
END_TEST

START_TEST(fork_inside_the_residual)
{
	fork_case(25, ZC_VIEWS_FULL, ZC_VIEWS_FULL, false);
	fork_case(24, ZC_VIEWS_NONE, ZC_VIEWS_FULL, true);
}
END_TEST

START_TEST(fork_at_zero_and_past_the_end)
{
	fork_case(0, ZC_VIEWS_FULL, ZC_VIEWS_FULL, true);
	fork_case(MAX_TOKENS + 5, ZC_VIEWS_FULL, ZC_VIEWS_FULL, false);
	fork_case(27, ZC_VIEWS_NONE, ZC_VIEWS_FULL, false);
}
END_TEST

START_TEST(fork_of_a_fork_after_a_trim_cut)
{
	struct fixture f;
	fixture_start(&f, "store_fork2");
	struct ref rs, ra, rb;
	struct store *source = fork_source(&f, &rs, 20, ZC_VIEWS_FULL);
	uint32_t trimmed;
	/* Cut the second block of layer 0 (10..22) down to 10..16. */
	ck_assert_int_eq(store_trim(source, 11, &trimmed), 0);
	ref_trim(&rs, 11);
	check(source, &rs, "the cut source");
	struct store *a = fork_of(&f, source, MAX_TOKENS, 21, ZC_VIEWS_FULL);
	ref_fork(&ra, &rs, MAX_TOKENS, ZC_VIEWS_FULL);
	check(a, &ra, "a fork of a cut source");
	struct store *b = fork_of(&f, a, 12, 22, ZC_VIEWS_NONE);
	ref_fork(&rb, &ra, 12, ZC_VIEWS_NONE);
	check(b, &rb, "a fork of the fork");
	/* The first block of layer 0 is named three times. */
	struct map m;
	map_open(b, &m);
	ck_assert_uint_eq(pool_refs(f.pool, map_table(&m, 0)[0].key_offset), 3);
	ck_assert_uint_eq(pool_refs(f.pool, map_table(&m, 0)[1].key_offset), 3);
	map_close(&m);
	struct store *all[] = { source, a, b };
	assert_budget_exact(&f, all, 3);
	update(&f, a, &ra, 0, 8);
	update(&f, b, &rb, 0, 2);
	check(source, &rs, "the source after its forks changed");
	check(a, &ra, "the fork after its own update");
	check(b, &rb, "the fork's fork after its own update");
	store_close(a, true);
	check(source, &rs, "the source after its fork closed");
	check(b, &rb, "the fork's fork after the fork closed");
	store_close(source, true);
	check(b, &rb, "the fork's fork alone");
	store_close(b, true);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(f.budget.used, PAGE);
	ref_free(&rs);
	ref_free(&ra);
	ref_free(&rb);
	fixture_end(&f);
}
END_TEST

/* ---- views -------------------------------------------------------------------------------- */

START_TEST(drop_and_rebuild_views)
{
	struct fixture f;
	fixture_start(&f, "store_views");
	struct ref r, rn;
	struct store *s = fork_source(&f, &r, 30, ZC_VIEWS_FULL);
	struct store *none = fork_source(&f, &rn, 31, ZC_VIEWS_NONE);
	struct store *both[] = { s, none };
	struct views_copy before;
	views_save(s, &before);
	uint64_t gen0 = store_view_generation(s, 0), gen1 = store_view_generation(s, 1);
	uint64_t memory = store_memory_bytes(s), rebuilds = store_view_rebuilds_total();

	uint64_t freed = 0;
	ck_assert_int_eq(store_drop_views(s, &freed), 0);
	ck_assert_uint_gt(freed, 0);
	ck_assert_uint_eq(store_memory_bytes(s), memory - freed);
	uint64_t freed_first = freed;
	assert_budget_exact(&f, both, 2);
	ck_assert_uint_ne(store_view_generation(s, 0), gen0);
	ck_assert_uint_ne(store_view_generation(s, 1), gen1);
	ck_assert_uint_eq(store_rebuild_elements(s, 0), (uint64_t)r.layer[0].tokens * HEADS *
								(DIM_K + DIM_V));
	ck_assert_uint_eq(store_rebuild_elements(s, STORE_ALL_LAYERS),
			  (uint64_t)(r.layer[0].tokens + r.layer[1].tokens) * HEADS * (DIM_K + DIM_V));
	ck_assert_uint_gt(store_rebuild_bytes(s), 0);
	struct map m;
	map_open(s, &m);
	ck_assert_uint_eq(m.h->layer[0].view_valid, 0);
	ck_assert_uint_eq(m.h->layer[1].view_valid, 0);
	ck_assert_uint_eq(m.h->layer[0].generation, store_view_generation(s, 0));
	map_close(&m);
	check(s, &r, "views dropped");
	/* A second drop has nothing more to give. */
	ck_assert_int_eq(store_drop_views(s, &freed), 0);
	ck_assert_uint_eq(freed, 0);
	/* A reader that reads a dropped view faults pages in: they are
	 * charged once synced, and the next drop gives them back. */
	map_open(s, &m);
	volatile uint16_t sink = 0;
	for (size_t at = 0; at < m.h->view_layer_bytes / 2; at += PAGE / 2)
		sink += map_view(&m, 1, 0)[at];
	(void)sink;
	map_close(&m);
	uint64_t faulted = store_memory_bytes(s) - (memory - freed_first);
	ck_assert_uint_gt(faulted, 0);
	ck_assert_uint_eq(store_sync_charge(s), faulted);
	assert_budget_exact(&f, both, 2);
	ck_assert_int_eq(store_drop_views(s, &freed), 0);
	ck_assert_uint_eq(freed, faulted);
	assert_budget_exact(&f, both, 2);
	/* Without views there is nothing to drop. */
	ck_assert_int_eq(store_drop_views(none, &freed), 0);
	ck_assert_uint_eq(freed, 0);
	ck_assert_uint_eq(store_rebuild_elements(none, STORE_ALL_LAYERS), 0);
	ck_assert_int_eq(store_rebuild_views(none), 0);

	uint64_t dropped0 = store_view_generation(s, 0);
	ck_assert_int_eq(store_rebuild_views(s), 0);
	ck_assert_uint_ne(store_view_generation(s, 0), dropped0);
	ck_assert_uint_eq(store_view_rebuilds_total(), rebuilds + LAYERS);
	assert_views_valid(s);
	views_compare(s, &before, "rebuilt views");
	check(s, &r, "views rebuilt");
	assert_budget_exact(&f, both, 2);

	/* A layer dropped after a trim cut a block: rebuilt, only its valid
	 * rows come back, and the next update lands after them. */
	uint32_t trimmed;
	ck_assert_int_eq(store_trim(s, 9, &trimmed), 0);
	ref_trim(&r, 9);
	ck_assert_int_eq(store_drop_views(s, &freed), 0);
	/* An update into a dropped layer rebuilds it first. */
	update(&f, s, &r, 0, 4);
	check(s, &r, "an update into a dropped layer");
	struct map m2;
	map_open(s, &m2);
	ck_assert_uint_eq(m2.h->layer[0].view_valid, 1);
	ck_assert_uint_eq(m2.h->layer[1].view_valid, 0);
	map_close(&m2);
	ck_assert_uint_eq(store_rebuild_elements(s, 0), 0);
	ck_assert_int_eq(store_rebuild_views(s), 0);
	assert_views_valid(s);
	check(s, &r, "the other layer rebuilt");
	assert_budget_exact(&f, both, 2);

	views_copy_free(&before);
	store_close(s, true);
	store_close(none, true);
	ref_free(&r);
	ref_free(&rn);
	fixture_end(&f);
}
END_TEST

/* ---- adoption ----------------------------------------------------------------------------- */

/* Every session file of the directory adopted into a fresh pool set. */
static int adopt_all(struct fixture *f, struct store **out, uint64_t *ids, int max)
{
	int fd = dup(f->dir.fd);
	DIR *dir = fdopendir(fd);
	ck_assert_ptr_nonnull(dir);
	rewinddir(dir);
	int n = 0;
	struct dirent *entry;
	while ((entry = readdir(dir)) != NULL) {
		unsigned long long id;
		char tail[8];
		if (sscanf(entry->d_name, "session-%16llx.zc%7s", &id, tail) != 2 ||
		    strcmp(tail, "s") != 0)
			continue;
		ck_assert_int_lt(n, max);
		char reason[256] = "";
		int rc = store_adopt(f->dir.fd, f->dir.path, entry->d_name, &f->budget, &f->pools,
				     &out[n], reason, sizeof(reason));
		ck_assert_msg(rc == 0, "adopting %s: %s (%s)", entry->d_name, zc_strerror(rc), reason);
		ids[n++] = id;
	}
	closedir(dir);
	return n;
}

START_TEST(adoption_restores_every_session)
{
	struct fixture f;
	fixture_start(&f, "store_adopt");
	enum { N = 6 };
	struct ref refs[N];
	struct store *stores[N];
	uint64_t ids[N] = { 40, 41, 42, 43, 44, 45 };
	/* A streaming session with views, one without, a fork of the first
	 * (cut inside a block), a per_call session, an empty one, and a fork
	 * of the one without views at a block boundary. */
	stores[0] = fork_source(&f, &refs[0], ids[0], ZC_VIEWS_FULL);
	stores[1] = fork_source(&f, &refs[1], ids[1], ZC_VIEWS_NONE);
	stores[2] = fork_of(&f, stores[0], 15, ids[2], ZC_VIEWS_FULL);
	ref_fork(&refs[2], &refs[0], 15, ZC_VIEWS_FULL);
	update(&f, stores[2], &refs[2], 1, 3);
	stores[3] = store_new(&f, ids[3], true, ZC_VIEWS_FULL);
	ref_init(&refs[3], true, ZC_VIEWS_FULL);
	update(&f, stores[3], &refs[3], 0, 5);
	update(&f, stores[3], &refs[3], 0, 1);
	update(&f, stores[3], &refs[3], 1, 17);
	stores[4] = store_new(&f, ids[4], false, ZC_VIEWS_FULL);
	ref_init(&refs[4], false, ZC_VIEWS_FULL);
	stores[5] = fork_of(&f, stores[1], 10, ids[5], ZC_VIEWS_NONE);
	ref_fork(&refs[5], &refs[1], 10, ZC_VIEWS_NONE);
	/* A trim that cut a block, and a session whose views were dropped. */
	uint32_t trimmed;
	ck_assert_int_eq(store_trim_layer(stores[0], 0, 8, &trimmed), 0);
	ref_trim_layer(&refs[0], 0, 8);
	uint64_t freed;
	struct views_copy views[N];
	memset(views, 0, sizeof(views));
	for (int i = 0; i < N; i++) {
		check(stores[i], &refs[i], "before the restart");
		if (refs[i].views == ZC_VIEWS_FULL)
			views_save(stores[i], &views[i]);
	}
	ck_assert_int_eq(store_drop_views(stores[3], &freed), 0);
	assert_budget_exact(&f, stores, N);
	/* A block a mutation wrote but never committed: nobody names it. */
	uint8_t orphan[100] = { 1 };
	uint64_t orphan_offset;
	ck_assert_int_eq(pool_write(f.pool, orphan, sizeof(orphan), orphan, sizeof(orphan),
				    &orphan_offset),
			 0);
	uint32_t refs_before[N][LAYERS][8];
	for (int i = 0; i < N; i++) {
		struct map m;
		map_open(stores[i], &m);
		for (uint32_t layer = 0; layer < LAYERS; layer++)
			for (uint32_t b = 0; b < m.h->layer[layer].blocks && b < 8; b++)
				refs_before[i][layer][b] =
					pool_refs(f.pool, map_table(&m, layer)[b].key_offset);
		map_close(&m);
	}
	uint64_t pool_bytes = pool_file_bytes(f.pool);

	/* The daemon stops: files stay, pools are closed. */
	for (int i = 0; i < N; i++)
		store_close(stores[i], false);
	pool_set_free(&f.pools);
	ck_assert_uint_eq(f.budget.used, 0);

	/* The next one adopts every file, then sweeps. */
	pool_set_init(&f.pools, f.dir.fd, f.dir.path);
	struct store *adopted[N + 1];
	uint64_t adopted_ids[N + 1];
	int n = adopt_all(&f, adopted, adopted_ids, N + 1);
	ck_assert_int_eq(n, N);
	ck_assert_uint_eq(f.pools.n, 1);
	f.pool = f.pools.items[0];
	ck_assert_uint_eq(pool_file_bytes(f.pool), pool_bytes);
	pool_set_sweep(&f.pools);
	ck_assert_uint_eq(pool_file_bytes(f.pool), pool_bytes - PAGE);   /* the orphan */
	ck_assert_uint_eq(pool_refs(f.pool, orphan_offset), 0);
	for (int k = 0; k < N; k++) {
		int i = 0;
		while (ids[i] != adopted_ids[k])
			i++;
		stores[i] = adopted[k];
	}
	assert_budget_exact(&f, stores, N);
	char when[64];
	for (int i = 0; i < N; i++) {
		snprintf(when, sizeof(when), "session %d adopted", i);
		check(stores[i], &refs[i], when);
		/* The references are those before the restart. */
		struct map m;
		map_open(stores[i], &m);
		for (uint32_t layer = 0; layer < LAYERS; layer++)
			for (uint32_t b = 0; b < m.h->layer[layer].blocks && b < 8; b++)
				ck_assert_uint_eq(pool_refs(f.pool, map_table(&m, layer)[b].key_offset),
						  refs_before[i][layer][b]);
		map_close(&m);
		/* Views are rebuilt from the blocks, identical to before. */
		if (refs[i].views == ZC_VIEWS_FULL) {
			ck_assert_int_eq(store_rebuild_views(stores[i]), 0);
			assert_views_valid(stores[i]);
			views_compare(stores[i], &views[i], when);
			check(stores[i], &refs[i], when);
		}
	}
	ck_assert_uint_eq(pool_shared_bytes(f.pool), store_shared_bytes(stores[0]) +
							     store_shared_bytes(stores[1]));
	assert_budget_exact(&f, stores, N);

	/* They go on, and closing frees everything. */
	for (int i = 0; i < N; i++) {
		update(&f, stores[i], &refs[i], 0, 2);
		update(&f, stores[i], &refs[i], 1, 9);
		snprintf(when, sizeof(when), "session %d updated after adoption", i);
		check(stores[i], &refs[i], when);
	}
	for (int i = 0; i < N; i++) {
		store_close(stores[i], true);
		ref_free(&refs[i]);
		views_copy_free(&views[i]);
	}
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	ck_assert_uint_eq(f.budget.used, PAGE);
	fixture_end(&f);
}
END_TEST

/* ---- bad input -------------------------------------------------------------------------- */

static void refused_run(enum zc_views views)
{
	struct fixture f;
	fixture_start(&f, "store_bad");
	struct ref r;
	struct store *s = fork_source(&f, &r, 50, views);
	struct store *one[] = { s };
	struct block in;
	uint64_t blocks = pool_blocks(f.pool), pool_bytes = pool_file_bytes(f.pool);

	block_make_shape(&in, HEADS, DIM_K, DIM_V, MAX_TOKENS, &f.rng);
	ck_assert_int_eq(store_update(s, LAYERS, 1, in.keys, in.values), ZC_EINVALID);
	ck_assert_int_eq(store_update(s, UINT32_MAX, 1, in.keys, in.values), ZC_EINVALID);
	ck_assert_int_eq(store_update(s, 0, 0, in.keys, in.values), ZC_EINVALID);
	/* Past max_tokens: the whole block is refused, not cut. */
	ck_assert_int_eq(store_update(s, 0, MAX_TOKENS - r.layer[0].tokens + 1, in.keys, in.values),
			 ZC_EEXHAUSTED);
	ck_assert_int_eq(store_update(s, 1, MAX_TOKENS, in.keys, in.values), ZC_EEXHAUSTED);
	check(s, &r, "after refused shapes");
	block_free(&in);

	/* NaN and Inf, in keys and in values, short (into the residual) and
	 * direct (with a residual waiting, which must not be flushed, and
	 * without one), anywhere in the block. */
	static const struct {
		uint32_t layer, tokens;
		int tensor;
		uint16_t bits;
	} poisoned[] = {
		{ 0, 2, 0, 0x7e00 },    /* NaN key into the residual */
		{ 0, 2, 1, 0x7c00 },    /* +Inf value into the residual */
		{ 0, 12, 0, 0xfc00 },   /* -Inf key, direct, residual waiting */
		{ 1, 30, 1, 0x7e01 },   /* NaN value, direct, residual waiting */
	};
	char when[96];
	for (size_t i = 0; i < sizeof(poisoned) / sizeof(poisoned[0]); i++) {
		block_make_shape(&in, HEADS, DIM_K, DIM_V, poisoned[i].tokens, &f.rng);
		uint16_t *target = poisoned[i].tensor == 0 ? in.keys : in.values;
		size_t n = poisoned[i].tensor == 0 ? in.key_elements : in.value_elements;
		target[n - 1 - i] = poisoned[i].bits;
		ck_assert_uint_gt(r.layer[poisoned[i].layer].residual, 0);
		int rc = store_update(s, poisoned[i].layer, poisoned[i].tokens, in.keys, in.values);
		snprintf(when, sizeof(when), "refused non-finite update %zu", i);
		ck_assert_msg(rc == ZC_ENONFINITE, "%s: %s", when, zc_error_name(rc));
		check(s, &r, when);
		ck_assert_uint_eq(pool_blocks(f.pool), blocks);
		ck_assert_uint_eq(pool_file_bytes(f.pool), pool_bytes);
		block_free(&in);
	}
	/* A direct block with nothing in the residual: refused by the codec. */
	update(&f, s, &r, 1, 6);            /* the residual of layer 1 reaches R: flushed */
	ck_assert_uint_eq(r.layer[1].residual, 0);
	blocks = pool_blocks(f.pool);
	pool_bytes = pool_file_bytes(f.pool);
	block_make_shape(&in, HEADS, DIM_K, DIM_V, 10, &f.rng);
	in.keys[3] = 0x7e00;
	ck_assert_int_eq(store_update(s, 1, 10, in.keys, in.values), ZC_ENONFINITE);
	check(s, &r, "a refused direct block");
	ck_assert_uint_eq(pool_blocks(f.pool), blocks);
	ck_assert_uint_eq(pool_file_bytes(f.pool), pool_bytes);
	block_free(&in);
	/* Values found bad in the encode's pass (with views), groups and
	 * heads of the block written by then: a later group of the first
	 * head, the last group of the last head. */
	for (int k = 0; k < 2; k++) {
		block_make_shape(&in, HEADS, DIM_K, DIM_V, 70, &f.rng);
		in.values[k == 0 ? (size_t)40 * DIM_V + 1 : in.value_elements - 5] =
			k == 0 ? 0x7e00 : 0xfc00;
		ck_assert_int_eq(store_update(s, 1, 70, in.keys, in.values), ZC_ENONFINITE);
		check(s, &r, k == 0 ? "a refused direct block, NaN in group 2 of head 0" :
				      "a refused direct block, -Inf in the last head");
		ck_assert_uint_eq(pool_blocks(f.pool), blocks);
		ck_assert_uint_eq(pool_file_bytes(f.pool), pool_bytes);
		block_free(&in);
	}
	assert_budget_exact(&f, one, 1);
	if (views == ZC_VIEWS_FULL)
		assert_views_valid(s);

	/* Still works. */
	update(&f, s, &r, 0, 1);
	update(&f, s, &r, 1, 11);
	check(s, &r, "updates after the refusals");
	store_close(s, true);
	ref_free(&r);
	fixture_end(&f);
}

START_TEST(bad_input_changes_nothing)
{
	refused_run(ZC_VIEWS_FULL);
	refused_run(ZC_VIEWS_NONE);
}
END_TEST

START_TEST(budget_refusal_changes_nothing)
{
	struct fixture f;
	fixture_start(&f, "store_budget");
	struct ref r;
	struct store *s = fork_source(&f, &r, 60, ZC_VIEWS_FULL);
	struct store *one[] = { s };
	/* No room for one more page: a direct block is refused. */
	f.budget.limit = f.budget.used;
	struct block in;
	block_make_shape(&in, HEADS, DIM_K, DIM_V, 40, &f.rng);
	int rc = store_update(s, 0, 40, in.keys, in.values);
	ck_assert_msg(rc == STORE_EBUDGET, "a block over the budget: %s", zc_error_name(rc));
	check(s, &r, "a block refused by the budget");
	assert_budget_exact(&f, one, 1);
	ck_assert_uint_le(f.budget.used, f.budget.limit);
	/* With room again, the same block goes in. */
	f.budget.limit = 0;
	ck_assert_int_eq(store_update(s, 0, 40, in.keys, in.values), 0);
	ref_update(&r, 0, &in);
	check(s, &r, "the block once the budget had room");
	block_free(&in);
	assert_budget_exact(&f, one, 1);
	store_close(s, true);
	ref_free(&r);
	fixture_end(&f);
}
END_TEST

/* A direct block behind a residual (two blocks to write) under every
 * budget from none left up to enough: each refusal leaves the session as
 * it was, and the first budget that is enough stores it. */
START_TEST(update_refused_by_the_budget_at_every_step)
{
	struct fixture f;
	fixture_start(&f, "store_budget_steps");
	struct ref r;
	struct store *s = fork_source(&f, &r, 61, ZC_VIEWS_FULL);
	struct store *one[] = { s };
	struct block in;
	block_make_shape(&in, HEADS, DIM_K, DIM_V, 30, &f.rng);
	ck_assert_uint_gt(r.layer[0].residual, 0);
	uint64_t blocks = pool_blocks(f.pool);
	int refusals = 0, rc;
	for (uint64_t extra = 0;; extra += PAGE / 2) {
		f.budget.limit = f.budget.used + extra;
		rc = store_update(s, 0, 30, in.keys, in.values);
		if (rc == 0)
			break;
		ck_assert_msg(rc == STORE_EBUDGET, "with %llu bytes left: %s",
			      (unsigned long long)extra, zc_error_name(rc));
		refusals++;
		check(s, &r, "an update refused by the budget");
		ck_assert_uint_eq(pool_blocks(f.pool), blocks);
		f.budget.limit = 0;
		assert_budget_exact(&f, one, 1);
		ck_assert_int_lt(refusals, 200);
	}
	ck_assert_int_gt(refusals, 1);
	f.budget.limit = 0;
	ref_update(&r, 0, &in);
	block_free(&in);
	ck_assert_int_eq(store_rebuild_views(s), 0);
	check(s, &r, "the update once the budget had room");
	assert_views_valid(s);
	assert_budget_exact(&f, one, 1);
	store_close(s, true);
	ref_free(&r);
	fixture_end(&f);
}
END_TEST

/* A fork under every budget up to enough: each refusal leaves no file, no
 * reference and no charge behind. */
START_TEST(fork_refused_by_the_budget_at_every_step)
{
	struct fixture f;
	fixture_start(&f, "store_fork_budget");
	struct ref rs, rf;
	struct store *source = fork_source(&f, &rs, 62, ZC_VIEWS_FULL);
	struct store *one[] = { source };
	struct store_params p = params_of(63, false, ZC_VIEWS_FULL);
	struct store *fork = NULL;
	char name[64];
	int refusals = 0, rc;
	for (uint64_t extra = 0;; extra += PAGE) {
		uint64_t used = f.budget.used;
		f.budget.limit = used + extra;
		rc = store_fork(source, 25, f.dir.fd, f.dir.path, &p, &f.budget, &fork);
		if (rc == 0)
			break;
		ck_assert_msg(rc == STORE_EBUDGET, "a fork with %llu bytes left: %s",
			      (unsigned long long)extra, zc_error_name(rc));
		refusals++;
		ck_assert_uint_eq(f.budget.used, used);
		session_file_name(name, sizeof(name), 63, false);
		ck_assert(!shm_dir_has(&f.dir, name));
		session_file_name(name, sizeof(name), 63, true);
		ck_assert(!shm_dir_has(&f.dir, name));
		ck_assert_uint_eq(pool_shared_bytes(f.pool), 0);
		check(source, &rs, "the source of a refused fork");
		struct map m;
		map_open(source, &m);
		for (uint32_t layer = 0; layer < LAYERS; layer++)
			for (uint32_t i = 0; i < m.h->layer[layer].blocks; i++)
				ck_assert_uint_eq(pool_refs(f.pool, map_table(&m, layer)[i].key_offset), 1);
		map_close(&m);
		assert_budget_exact(&f, one, 1);
		ck_assert_int_lt(refusals, 200);
	}
	ck_assert_int_gt(refusals, 1);
	f.budget.limit = 0;
	ref_fork(&rf, &rs, 25, ZC_VIEWS_FULL);
	check(fork, &rf, "the fork once the budget had room");
	store_close(fork, true);
	store_close(source, true);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ref_free(&rs);
	ref_free(&rf);
	fixture_end(&f);
}
END_TEST

/* Rewrites bytes of a session file in place (it is 0400: lifted for it). */
static void session_patch(const struct shm_dir *dir, const char *name, off_t offset,
			  const void *bytes, size_t size)
{
	ck_assert_int_eq(fchmodat(dir->fd, name, 0600, 0), 0);
	int fd = openat(dir->fd, name, O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, bytes, size, offset), (ssize_t)size);
	close(fd);
	ck_assert_int_eq(fchmodat(dir->fd, name, 0400, 0), 0);
}

/* Adopting name fails as corrupt with a reason naming `needle`, and
 * leaves no claim, no charge and the file where it was. */
static void adopt_refused(struct fixture *f, const char *name, const char *needle)
{
	char reason[256] = "";
	struct store *s = NULL;
	uint64_t used = f->budget.used, blocks = pool_blocks(f->pool);
	int rc = store_adopt(f->dir.fd, f->dir.path, name, &f->budget, &f->pools, &s, reason,
			     sizeof(reason));
	ck_assert_msg(rc == ZC_ECORRUPT, "adopting %s: %s (%s)", name, zc_error_name(rc), reason);
	ck_assert_msg(strstr(reason, needle) != NULL, "the reason \"%s\" does not say \"%s\"", reason,
		      needle);
	ck_assert_uint_eq(f->budget.used, used);
	ck_assert_uint_eq(pool_blocks(f->pool), blocks);
	ck_assert(shm_dir_has(&f->dir, name));
}

START_TEST(adoption_refuses_what_cannot_be_right)
{
	struct fixture f;
	fixture_start(&f, "store_adopt_bad");
	struct ref ra, rb;
	struct store *a = fork_source(&f, &ra, 70, ZC_VIEWS_FULL);
	struct store *b = fork_source(&f, &rb, 71, ZC_VIEWS_NONE);
	const struct store_header h = *store_header(a);
	store_close(a, false);
	store_close(b, false);
	pool_set_free(&f.pools);
	pool_set_init(&f.pools, f.dir.fd, f.dir.path);
	char reason[200];
	ck_assert_int_eq(pool_set_get(&f.pools, (uint32_t)geteuid(), &f.budget, &f.pool, NULL, reason,
				      sizeof(reason)),
			 0);
	char name_a[64], name_b[64];
	session_file_name(name_a, sizeof(name_a), 70, false);
	session_file_name(name_b, sizeof(name_b), 71, false);

	/* b is adopted first: it claims its blocks. */
	struct store *adopted_b = NULL;
	ck_assert_int_eq(store_adopt(f.dir.fd, f.dir.path, name_b, &f.budget, &f.pools, &adopted_b,
				     reason, sizeof(reason)),
			 0);
	uint64_t claimed = pool_blocks(f.pool);
	ck_assert_uint_eq(claimed, rb.layer[0].n + rb.layer[1].n);

	/* a's layer 0, block 1 names an unaligned offset, then b's block 0
	 * of layer 0 with a's sizes, then its own offset with another size:
	 * each refused, and a's claims of the blocks before it given back. */
	off_t entry = (off_t)(h.layers_offset + h.index_offset + sizeof(store_block));
	store_block original, bad;
	int fd = openat(f.dir.fd, name_a, O_RDONLY | O_CLOEXEC);
	ck_assert_int_eq(pread(fd, &original, sizeof(original), entry), (ssize_t)sizeof(original));
	close(fd);
	bad = original;
	bad.key_offset += 8;
	bad.value_offset += 8;
	session_patch(&f.dir, name_a, entry, &bad, sizeof(bad));
	adopt_refused(&f, name_a, "out of place");
	struct map m;
	map_open(adopted_b, &m);
	const zc_map_block *other = &map_table(&m, 0)[0];
	bad = original;
	bad.key_offset = other->key_offset;
	bad.value_offset = pool_value_offset(other->key_offset, bad.key_bytes);
	ck_assert_uint_ne(bad.key_bytes, other->key_bytes);
	map_close(&m);
	session_patch(&f.dir, name_a, entry, &bad, sizeof(bad));
	adopt_refused(&f, name_a, "another size");
	bad = original;
	bad.key_bytes += 1;
	session_patch(&f.dir, name_a, entry, &bad, sizeof(bad));
	adopt_refused(&f, name_a, "sizes its shape cannot have");
	bad = original;
	bad.first_token += 1;
	session_patch(&f.dir, name_a, entry, &bad, sizeof(bad));
	adopt_refused(&f, name_a, "does not follow");
	ck_assert_uint_eq(pool_blocks(f.pool), claimed);

	/* Restored, it is adopted whole. */
	session_patch(&f.dir, name_a, entry, &original, sizeof(original));
	struct store *adopted_a = NULL;
	ck_assert_int_eq(store_adopt(f.dir.fd, f.dir.path, name_a, &f.budget, &f.pools, &adopted_a,
				     reason, sizeof(reason)),
			 0);
	pool_set_sweep(&f.pools);
	ck_assert_int_eq(store_rebuild_views(adopted_a), 0);
	check(adopted_a, &ra, "adopted after its index was restored");
	check(adopted_b, &rb, "adopted beside it");

	/* One that will not become a session gives its claims back. */
	store_release_blocks(adopted_a);
	ck_assert_uint_eq(pool_blocks(f.pool), claimed);
	store_close(adopted_a, true);
	store_close(adopted_b, true);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	ref_free(&ra);
	ref_free(&rb);
	fixture_end(&f);
}
END_TEST


/*
 * Saliency by attention: a residual flush ranks by the masses given
 * (store_residual_mass), not by key norm. The tokens given mass are the
 * ones with the smallest norms, so key norm would never pick them; the
 * flushed block's mask must hold exactly them. Bad masses change nothing.
 */
static void masses_rank_the_flush(bool deferred)
{
	struct fixture f;
	fixture_start(&f, "store_mass");
	struct store_params p = params_of(40, false, ZC_VIEWS_NONE);
	p.codec.saliency = ZC_SALIENCY_ATTENTION;
	struct store *s = NULL;
	ck_assert_int_eq(store_create(f.dir.fd, f.dir.path, &p, &f.budget, f.pool, &s), 0);
	ck_assert_int_eq(store_codec(s).saliency, ZC_SALIENCY_ATTENTION);
	ck_assert_uint_eq(store_header(s)->saliency, ZC_SALIENCY_ATTENTION);
	/* Token t's rows all hold t + 1: norms rise with t. */
	uint16_t k[HEADS * DIM_K], v[HEADS * DIM_V];
	for (uint32_t t = 0; t + 1 < RESIDUAL; t++) {
		for (size_t i = 0; i < HEADS * DIM_K; i++)
			k[i] = zc_float_to_fp16((float)(t + 1));
		for (size_t i = 0; i < HEADS * DIM_V; i++)
			v[i] = zc_float_to_fp16(0.5f);
		ck_assert_int_eq(store_update(s, 0, 1, k, v), 0);
	}
	uint32_t n = RESIDUAL - 1, n_hi = zc_codec_salient_tokens(&p.codec, ZC_TENSOR_KEYS, RESIDUAL);
	float mass[HEADS * RESIDUAL];
	for (uint32_t h = 0; h < HEADS; h++)
		for (uint32_t j = 0; j < n; j++)
			mass[h * n + j] = j < n_hi ? 1.0f - 0.01f * (float)j : 0.0f;
	/* Refused, nothing changed: NaN, negative, tokens past the layer. */
	mass[3] = NAN;
	ck_assert_int_eq(store_residual_mass(s, 0, 0, n, mass), ZC_ENONFINITE);
	mass[3] = -1.0f;
	ck_assert_int_eq(store_residual_mass(s, 0, 0, n, mass), ZC_ENONFINITE);
	mass[3] = n_hi > 3 ? 1.0f - 0.03f : 0.0f;
	ck_assert_int_eq(store_residual_mass(s, 0, 1, n, mass), ZC_ESHAPE);
	ck_assert_int_eq(store_residual_mass(s, 0, 0, 0, mass), ZC_EINVALID);
	ck_assert_uint_eq(store_layer_tokens(s, 0), n);
	ck_assert_int_eq(store_residual_mass(s, 0, 0, n, mass), 0);
	for (size_t i = 0; i < HEADS * DIM_K; i++)
		k[i] = zc_float_to_fp16((float)RESIDUAL);
	/* Fills the residual: flush. */
	ck_assert_int_eq(store_append(s, 0, 1, k, v, deferred), 0);
	if (deferred) {
		struct store_flush flush;
		ck_assert_int_eq(store_flush_begin(s, 0, &flush), 0);
		/* Masses sent beside the pending flush do not change its ranking. */
		float late[HEADS * RESIDUAL];
		for (size_t i = 0; i < HEADS * RESIDUAL; i++)
			late[i] = i % RESIDUAL == RESIDUAL - 1 ? 1000.0f : 0.0f;
		ck_assert_int_eq(store_residual_mass(s, 0, 0, RESIDUAL, late), 0);
		store_flush_compress(s, &flush);
		ck_assert_int_eq(store_flush_publish(s, &flush), 0);
	}
	struct store_cut cut;
	store_layer_cut(s, 0, &cut);
	ck_assert_uint_eq(cut.blocks, 1);
	ck_assert_uint_eq(cut.residual_tokens, 0);
	zc_block_shape shape = { BATCH, KV_HEADS, RESIDUAL, DIM_K };
	zc_block_layout layout;
	ck_assert_int_eq(zc_block_layout_compute(&p.codec, ZC_TENSOR_KEYS, &shape, &layout), 0);
	uint8_t *payload = malloc(layout.total_bytes);
	ck_assert_int_eq(pool_read(f.pool, cut.entries[0].key_offset, payload, layout.total_bytes), 0);
	for (uint32_t h = 0; h < HEADS; h++) {
		const uint8_t *mask = payload + h * layout.head_bytes + layout.mask_offset;
		for (uint32_t t = 0; t < RESIDUAL; t++)
			ck_assert_msg(((mask[t / 8] >> (t % 8)) & 1u) == (t < n_hi),
				      "head %u token %u: salient %d, wanted %d", h, t,
				      (mask[t / 8] >> (t % 8)) & 1, t < n_hi);
	}
	/* The same data by key norm picks the last tokens. */
	struct store *plain = store_new(&f, 41, false, ZC_VIEWS_NONE);
	ck_assert_int_eq(store_residual_mass(plain, 0, 0, 1, mass), ZC_EPRECONDITION);
	free(payload);
	store_close(plain, true);
	store_close(s, true);
	fixture_end(&f);
}

START_TEST(attention_masses_rank_the_flush)
{
	masses_rank_the_flush(false);
}
END_TEST

START_TEST(attention_masses_rank_the_deferred_flush)
{
	masses_rank_the_flush(true);
}
END_TEST

static Suite *store_suite(void)
{
	Suite *suite = suite_create("store");
	const struct test_case cases[] = {
		{ "create", { create_views_full_and_none, NULL } },
		{ "update", { updates_streaming_views_full, updates_streaming_views_none,
			      updates_per_call, NULL } },
		{ "trim", { trims_views_full, trims_views_none, NULL } },
		{ "fork", { fork_inside_a_block, fork_at_a_block_boundary, fork_inside_the_residual,
			    fork_at_zero_and_past_the_end, fork_of_a_fork_after_a_trim_cut, NULL } },
		{ "views", { drop_and_rebuild_views, NULL } },
		{ "saliency", { attention_masses_rank_the_flush,
				attention_masses_rank_the_deferred_flush, NULL } },
		{ "adoption", { adoption_restores_every_session, adoption_refuses_what_cannot_be_right,
				NULL } },
		{ "refusals", { bad_input_changes_nothing, budget_refusal_changes_nothing,
				update_refused_by_the_budget_at_every_step,
				fork_refused_by_the_budget_at_every_step, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(store_suite(), CK_FORK_GETENV);
}
