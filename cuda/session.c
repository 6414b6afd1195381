/*
 * A session's layer loaded inside one consistent read: see session.h.
 *
 * Trims. A mirror skips the blocks and residual rows it loaded before, and
 * the block table shows most trims: a layer holding fewer tokens than the
 * mirror knows is trimmed to that count; a block that is not the entry the
 * mirror loaded (first token, size, pool pointers) is loaded again. What
 * the table cannot show is a trim that appends made up for before the next
 * fetch: the same counts, and with the pool's first-fit reuse even the same
 * entries, over other bytes. So the mirror also keeps prints (a hash of
 * some bytes) of the residual rows and blocks it loaded, and each fetch
 * compares the print of the last token both know with what is there now:
 * a difference resets the mirror (the next load is a full one). A caller
 * that trims through its own client says so with zc_cuda_mirror_trim and
 * never depends on the prints.
 */
#include "session.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PRINT_EDGE 64u

void session_layer_init(struct session_layer *sl)
{
	memset(sl, 0, sizeof *sl);
}

void session_layer_free(struct session_layer *sl)
{
	free(sl->blocks);
	free(sl->block_prints);
	free(sl->row_prints);
	session_layer_init(sl);
}

static int blocks_room(struct session_layer *sl, size_t n)
{
	if (n <= sl->capacity)
		return 0;
	size_t capacity = sl->capacity ? sl->capacity : 16;
	while (capacity < n)
		capacity *= 2;
	zc_cuda_block *blocks = realloc(sl->blocks, capacity * sizeof *blocks);
	if (!blocks)
		return -ENOMEM;
	sl->blocks = blocks;
	uint64_t *prints = realloc(sl->block_prints, capacity * sizeof *prints);
	if (!prints)
		return -ENOMEM;
	sl->block_prints = prints;
	sl->capacity = capacity;
	return 0;
}

int session_layer_read(struct session_layer *sl, const zc_session *session, const zc_read *read)
{
	const zc_session_info *info = zc_session_get_info(session);
	zc_layer_contents layout;
	zc_block block;
	int rc = zc_layer_layout(session, read, &layout);
	if (rc < 0)
		return rc;
	if ((rc = blocks_room(sl, layout.blocks)) < 0)
		return rc;
	for (uint32_t i = 0; i < layout.blocks; i++) {
		if ((rc = zc_layer_block(session, read, i, &block)) < 0)
			return rc;
		sl->blocks[i] = (zc_cuda_block){
			.keys = block.key_payload, .values = block.value_payload,
			.key_bytes = (size_t)block.key_bytes, .value_bytes = (size_t)block.value_bytes,
			.first_token = block.first_token, .tokens = block.tokens,
			.valid_tokens = block.valid_tokens,
		};
	}
	sl->layer = (zc_cuda_layer){
		.config = info->codec,
		.batch = info->batch,
		.heads = info->kv_heads,
		.head_dim_k = info->head_dim_k,
		.head_dim_v = info->head_dim_v,
		.blocks = sl->blocks,
		.n_blocks = layout.blocks,
		.residual_keys = layout.residual_keys,
		.residual_values = layout.residual_values,
		.residual_key_strides = layout.key_strides,
		.residual_value_strides = layout.value_strides,
		.residual_first = layout.tokens - layout.residual_tokens,
		.residual_tokens = layout.residual_tokens,
		.memory = ZC_CUDA_HOST,
	};
	return 0;
}

/* ---- prints --------------------------------------------------------------- */

static uint64_t print_mix(uint64_t h, const void *bytes, size_t n)
{
	const uint8_t *p = bytes;
	for (; n >= 8; n -= 8, p += 8) {
		uint64_t word;
		memcpy(&word, p, 8);
		h = (h ^ word) * UINT64_C(0x9e3779b97f4a7c15);
		h ^= h >> 29;
	}
	for (; n > 0; n--, p++)
		h = (h ^ *p) * UINT64_C(0x100000001b3);
	return h;
}

static uint64_t print_edges(uint64_t h, const void *payload, size_t bytes)
{
	size_t edge = bytes < PRINT_EDGE ? bytes : PRINT_EDGE;
	h = print_mix(h, payload, edge);
	return print_mix(h, (const uint8_t *)payload + bytes - edge, edge);
}

uint64_t session_block_print(const zc_cuda_block *block)
{
	uint64_t h = UINT64_C(0xcbf29ce484222325);
	uint32_t where[2] = { block->first_token, block->tokens };
	h = print_mix(h, where, sizeof where);
	h = print_edges(h, block->keys, block->key_bytes);
	return print_edges(h, block->values, block->value_bytes);
}

/* Residual row r of the first and the last head, K and V. */
static uint64_t row_print(const zc_cuda_layer *layer, uint32_t r)
{
	uint64_t h = UINT64_C(0xcbf29ce484222325);
	uint32_t last = layer->batch * layer->heads - 1;
	uint32_t heads[2] = { 0, last };
	for (int i = 0; i < 2; i++) {
		uint32_t b = heads[i] / layer->heads, head = heads[i] % layer->heads;
		const zc_strides *ks = &layer->residual_key_strides, *vs = &layer->residual_value_strides;
		h = print_mix(h, layer->residual_keys + b * ks->batch + head * ks->head + r * ks->token,
			      2u * layer->head_dim_k);
		h = print_mix(h, layer->residual_values + b * vs->batch + head * vs->head + r * vs->token,
			      2u * layer->head_dim_v);
	}
	return h;
}

/* ---- what the table says about trims ---------------------------------------- */

static uint32_t layer_end(const zc_cuda_layer *layer)
{
	if (layer->residual_tokens)
		return layer->residual_first + layer->residual_tokens;
	for (size_t i = layer->n_blocks; i-- > 0;)
		if (layer->blocks[i].valid_tokens)
			return layer->blocks[i].first_token + layer->blocks[i].valid_tokens;
	return 0;
}

/* The block holding token t: the last one starting at or before it. */
static bool layer_block_at(const zc_cuda_layer *layer, uint32_t t, size_t *index)
{
	size_t lo = 0, hi = layer->n_blocks;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (layer->blocks[mid].first_token <= t)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo == 0)
		return false;
	const zc_cuda_block *b = &layer->blocks[lo - 1];
	*index = lo - 1;
	return t < b->first_token + b->valid_tokens;
}

static bool mirror_block_at(const zc_cuda_mirror *mirror, uint32_t t, size_t *index)
{
	size_t lo = 0, hi = mirror->n_blocks;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (mirror->blocks[mid].first_token <= t)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo == 0)
		return false;
	const struct mirror_block *b = &mirror->blocks[lo - 1];
	*index = lo - 1;
	return t < b->first_token + b->valid_tokens;
}

/* Whether the last token both the mirror and the layer hold still has the
 * bytes the mirror loaded (as far as its print can tell). */
static bool last_common_token_same(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
				   uint32_t end)
{
	uint32_t common = mirror->tokens < end ? mirror->tokens : end;
	if (common == 0)
		return true;
	uint32_t q = common - 1;
	bool in_mirror_residual = mirror->residual_rows && q >= mirror->residual_first &&
				  q < mirror->residual_first + mirror->residual_rows;
	bool in_residual = layer->residual_tokens && q >= layer->residual_first;
	if (in_mirror_residual && in_residual) {
		uint32_t r = q - layer->residual_first;
		if (mirror->residual_first != layer->residual_first ||
		    mirror->row_prints_first != layer->residual_first || r >= mirror->n_row_prints)
			return true; /* rows the plan loads again anyway, or nothing to compare */
		return row_print(layer, r) == mirror->row_prints[r];
	}
	size_t i, j;
	if (in_mirror_residual || in_residual || !layer_block_at(layer, q, &i) ||
	    !mirror_block_at(mirror, q, &j))
		return true; /* a different kind of container: the plan sees the change */
	const struct mirror_block *was = &mirror->blocks[j];
	const zc_cuda_block *now = &layer->blocks[i];
	if (!was->printed || was->keys != now->keys || was->values != now->values ||
	    was->first_token != now->first_token || was->tokens != now->tokens)
		return true;
	return session_block_print(now) == was->print;
}

static void mirror_check(zc_cuda_mirror *mirror, const zc_cuda_layer *layer)
{
	if (!mirror->known)
		return;
	uint32_t end = layer_end(layer);
	if (!last_common_token_same(mirror, layer, end)) {
		zc_cuda_mirror_reset(mirror);
		return;
	}
	if (end < mirror->tokens)
		zc_cuda_mirror_trim(mirror, end);
}

/* Inside the read, after the load: the prints the mirror lacks now. */
static int prints_take(struct session_layer *sl, const zc_cuda_mirror *mirror)
{
	const zc_cuda_layer *layer = &sl->layer;
	for (size_t i = 0; i < mirror->n_blocks && i < layer->n_blocks; i++)
		if (!mirror->blocks[i].printed)
			sl->block_prints[i] = session_block_print(&layer->blocks[i]);
	uint32_t from = 0;
	if (mirror->row_prints_first == layer->residual_first)
		from = mirror->n_row_prints < layer->residual_tokens ? mirror->n_row_prints :
								     layer->residual_tokens;
	if (layer->residual_tokens > sl->row_prints_capacity) {
		uint64_t *prints = realloc(sl->row_prints, layer->residual_tokens * sizeof *prints);
		if (!prints)
			return -ENOMEM;
		sl->row_prints = prints;
		sl->row_prints_capacity = layer->residual_tokens;
	}
	for (uint32_t r = from; r < layer->residual_tokens; r++)
		sl->row_prints[r] = row_print(layer, r);
	sl->row_prints_from = from;
	sl->n_row_prints = layer->residual_tokens;
	return 0;
}

/* After the read ended well: the prints join the mirror. */
static void prints_apply(const struct session_layer *sl, zc_cuda_mirror *mirror)
{
	const zc_cuda_layer *layer = &sl->layer;
	for (size_t i = 0; i < mirror->n_blocks && i < layer->n_blocks; i++)
		if (!mirror->blocks[i].printed) {
			mirror->blocks[i].print = sl->block_prints[i];
			mirror->blocks[i].printed = true;
		}
	if (sl->n_row_prints > mirror->row_prints_capacity) {
		uint64_t *prints = realloc(mirror->row_prints, sl->n_row_prints * sizeof *prints);
		if (!prints) {
			/* Without row prints the mirror cannot check its residual: forget it. */
			zc_cuda_mirror_reset(mirror);
			return;
		}
		mirror->row_prints = prints;
		mirror->row_prints_capacity = sl->n_row_prints;
	}
	/* (Nothing to copy, and perhaps no array yet, when no row was printed.) */
	if (sl->n_row_prints > sl->row_prints_from)
		memcpy(mirror->row_prints + sl->row_prints_from, sl->row_prints + sl->row_prints_from,
		       (sl->n_row_prints - sl->row_prints_from) * sizeof *sl->row_prints);
	mirror->row_prints_first = layer->residual_first;
	mirror->n_row_prints = sl->n_row_prints;
}

/* ---- the fetch ------------------------------------------------------------ */

static int64_t clock_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

int session_fetch(struct session_layer *sl, const zc_session *session, uint32_t layer,
		  const zc_cuda_target *target, zc_cuda_mirror *mirror,
		  const struct session_load *load)
{
	if (!session || !target || !load)
		return -EINVAL;
	int64_t deadline = clock_ms() + ZC_READ_TIMEOUT_MS;
	for (;;) {
		int64_t left = deadline - clock_ms();
		zc_read read;
		int rc = zc_read_begin(session, layer, left > 0 ? (int)left : 1, &read);
		if (rc < 0)
			return rc;
		bool queued = false;
		uint32_t first = 0;
		rc = session_layer_read(sl, session, &read);
		if (rc == 0) {
			bool rewrite = true;
			if (mirror) {
				/* What it checks only ever makes the mirror forget, so a
				 * torn read can cost a reload, never a wrong row. */
				mirror_check(mirror, &sl->layer);
				uint32_t known = mirror->known ? mirror->tokens : 0;
				first = plan_mirror_valid(mirror, &sl->layer, target);
				rewrite = first < known || !mirror->known;
			}
			rc = load->load(load->arg, session, layer, &sl->layer, target, mirror, first,
					rewrite);
			queued = rc == 0;
			if (rc == 0 && mirror)
				rc = prints_take(sl, mirror);
		}
		int end = zc_read_end(session, &read);
		if (end == 0) {
			if (rc < 0) {
				if (queued && mirror)
					zc_cuda_mirror_reset(mirror);
				return rc;
			}
			if (mirror)
				prints_apply(sl, mirror);
			return (int)read.tokens;
		}
		/* A torn read: what its load wrote from `first` on is unknown. */
		if (queued && mirror)
			zc_cuda_mirror_trim(mirror, first);
		if (end != ZC_EAGAIN)
			return end;
		if (clock_ms() >= deadline)
			return ZC_EAGAIN;
	}
}
