/*
 * Planning a layer load: see plan.h. Every check a caller's mistake can
 * fail happens in plan_layer, before the driver queues anything.
 */
#include "plan.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void plan_init(struct plan *plan)
{
	memset(plan, 0, sizeof *plan);
}

void plan_free(struct plan *plan)
{
	free(plan->units);
	plan_init(plan);
}

/* Empty again, keeping the room for the next layer's units. */
static void plan_reset(struct plan *plan)
{
	plan->n_units = 0;
	plan->blocks = plan->blocks_skipped = 0;
	plan->residual_rows = 0;
	plan->max_per_head = 0;
}

static struct plan_unit *plan_add(struct plan *plan)
{
	if (plan->n_units == plan->capacity) {
		size_t capacity = plan->capacity ? 2 * plan->capacity : 16;
		struct plan_unit *units = realloc(plan->units, capacity * sizeof *units);
		if (!units)
			return NULL;
		plan->units = units;
		plan->capacity = capacity;
	}
	struct plan_unit *unit = &plan->units[plan->n_units++];
	memset(unit, 0, sizeof *unit);
	return unit;
}

static uint64_t divide_up(uint64_t n, uint64_t d)
{
	return (n + d - 1) / d;
}

/* zc_block_reconstruct's mask rule: as many set bits as salient tokens,
 * none past the last token. */
static bool mask_matches(const zc_block_layout *layout, const uint8_t *mask)
{
	uint64_t count = 0;
	size_t i = 0;
	for (; i + 8 <= layout->mask_bytes; i += 8) {
		uint64_t word;
		memcpy(&word, mask + i, 8);
		/* SWAR popcount: the portable build has no POPCNT instruction. */
		word -= (word >> 1) & UINT64_C(0x5555555555555555);
		word = (word & UINT64_C(0x3333333333333333)) +
		       ((word >> 2) & UINT64_C(0x3333333333333333));
		word = (word + (word >> 4)) & UINT64_C(0x0f0f0f0f0f0f0f0f);
		count += (word * UINT64_C(0x0101010101010101)) >> 56;
	}
	for (; i < layout->mask_bytes; i++)
		count += (uint64_t)__builtin_popcount(mask[i]);
	unsigned used = layout->tokens & 7u;
	if (used && (mask[layout->mask_bytes - 1] >> used) != 0)
		return false;
	return count == layout->n_hi;
}

static bool same_target(const zc_cuda_target *a, const zc_cuda_target *b)
{
	return a->keys == b->keys && a->values == b->values &&
	       a->key_strides.batch == b->key_strides.batch &&
	       a->key_strides.head == b->key_strides.head &&
	       a->key_strides.token == b->key_strides.token &&
	       a->value_strides.batch == b->value_strides.batch &&
	       a->value_strides.head == b->value_strides.head &&
	       a->value_strides.token == b->value_strides.token;
}

static bool same_layer_shape(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer)
{
	const zc_codec_config *a = &mirror->config, *b = &layer->config;
	return a->hi_bits == b->hi_bits && a->lo_bits == b->lo_bits &&
	       a->hi_fraction == b->hi_fraction && a->group_size == b->group_size &&
	       a->quantize_values == b->quantize_values && mirror->batch == layer->batch &&
	       mirror->heads == layer->heads && mirror->head_dim_k == layer->head_dim_k &&
	       mirror->head_dim_v == layer->head_dim_v;
}

static bool same_block(const struct mirror_block *done, const zc_cuda_block *block)
{
	return done->keys == block->keys && done->values == block->values &&
	       done->key_bytes == block->key_bytes && done->value_bytes == block->value_bytes &&
	       done->first_token == block->first_token && done->tokens == block->tokens &&
	       block->valid_tokens <= done->valid_tokens;
}

static void job_target(struct cuda_job *job, uint16_t *base, const zc_strides *strides,
		       uint32_t first_token)
{
	job->dst = (uint64_t)(uintptr_t)base + 2u * (uint64_t)first_token * strides->token;
	job->dst_batch = strides->batch;
	job->dst_head = strides->head;
	job->dst_token = strides->token;
}

static void job_shape(struct cuda_job *job, const zc_cuda_layer *layer, uint32_t dim,
		      uint32_t valid)
{
	job->heads_per_batch = layer->heads;
	job->head0 = 0;
	job->n_heads = layer->batch * layer->heads;
	job->valid = valid;
	job->dim = dim;
	job->chunks = (uint32_t)divide_up(dim, CHUNK_CHANNELS);
	job->tile_tokens = job->chunks >= TILE_ITEMS ? 1 : TILE_ITEMS / job->chunks;
	job->tiles_per_head = (uint32_t)divide_up(valid, job->tile_tokens);
}

/* One tensor of one block: a quantized unit, or exact rows (values kept as fp16). */
static int plan_block_tensor(struct plan *plan, const zc_cuda_layer *layer,
			     const zc_cuda_target *target, const zc_block_layout *layout,
			     zc_tensor tensor, const uint8_t *payload, uint32_t first_token,
			     uint32_t valid)
{
	bool keys = tensor == ZC_TENSOR_KEYS;
	struct plan_unit *unit = plan_add(plan);
	if (!unit)
		return -ENOMEM;
	struct cuda_job *job = &unit->job;
	job_target(job, keys ? target->keys : target->values,
		   keys ? &target->key_strides : &target->value_strides, first_token);
	job_shape(job, layer, layout->head_dim, valid);
	job->tokens = layout->tokens;
	unit->source = payload;
	if (layout->exact) {
		uint64_t head = (uint64_t)layout->tokens * layout->head_dim;
		job->kind = JOB_COPY;
		job->src_token = layout->head_dim;
		job->src_head = head;
		job->src_batch = head * layer->heads;
		unit->strided = true;
		unit->per_head = 2u * (uint64_t)valid * layout->head_dim;
	} else {
		job->kind = JOB_QUANTIZED;
		job->head_bytes = layout->head_bytes;
		job->mask_offset = layout->mask_offset;
		job->hi_params_offset = layout->hi_params_offset;
		job->lo_params_offset = layout->lo_params_offset;
		job->hi_codes_offset = layout->hi_codes_offset;
		job->lo_codes_offset = layout->lo_codes_offset;
		job->n_hi = layout->n_hi;
		job->n_lo = layout->n_lo;
		job->group_size = (uint32_t)layer->config.group_size;
		job->hi_bits = (uint32_t)layout->hi_bits;
		job->lo_bits = (uint32_t)layout->lo_bits;
		job->words = (uint32_t)divide_up(layout->tokens, 64);
		unit->head_stride_bytes = layout->head_bytes;
		unit->per_head = layout->head_bytes;
	}
	if (unit->per_head > plan->max_per_head)
		plan->max_per_head = unit->per_head;
	return 0;
}

static int plan_residual(struct plan *plan, const zc_cuda_layer *layer,
			 const zc_cuda_target *target, zc_tensor tensor, uint32_t done)
{
	bool keys = tensor == ZC_TENSOR_KEYS;
	const zc_strides *strides = keys ? &layer->residual_key_strides :
					   &layer->residual_value_strides;
	const uint16_t *rows = keys ? layer->residual_keys : layer->residual_values;
	uint32_t dim = keys ? layer->head_dim_k : layer->head_dim_v;
	uint32_t valid = layer->residual_tokens - done;
	struct plan_unit *unit = plan_add(plan);
	if (!unit)
		return -ENOMEM;
	struct cuda_job *job = &unit->job;
	job_target(job, keys ? target->keys : target->values,
		   keys ? &target->key_strides : &target->value_strides,
		   layer->residual_first + done);
	job_shape(job, layer, dim, valid);
	job->kind = JOB_COPY;
	job->tokens = valid;
	job->src_batch = strides->batch;
	job->src_head = strides->head;
	job->src_token = strides->token;
	unit->source = (const uint8_t *)(rows + (size_t)done * strides->token);
	unit->strided = true;
	unit->per_head = 2u * (uint64_t)valid * dim;
	if (unit->per_head > plan->max_per_head)
		plan->max_per_head = unit->per_head;
	return 0;
}

static bool mirror_knows(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
			 const zc_cuda_target *target)
{
	return mirror && mirror->known && same_target(&mirror->target, target) &&
	       same_layer_shape(mirror, layer);
}

/* The leading blocks the mirror loaded into the target already. */
static size_t mirror_skip(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer)
{
	size_t skip = 0;
	while (skip < layer->n_blocks && skip < mirror->n_blocks &&
	       same_block(&mirror->blocks[skip], &layer->blocks[skip]))
		skip++;
	return skip;
}

static int check_target(const zc_cuda_target *target, uint32_t end)
{
	if (end > target->max_tokens)
		return ZC_EBUFFER;
	return 0;
}

/* The residual rows a mirror says the target holds already. */
static uint32_t residual_done(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer)
{
	if (!mirror || !mirror->known || mirror->residual_first != layer->residual_first)
		return 0;
	uint32_t done = mirror->residual_rows;
	uint32_t kept = mirror->tokens > mirror->residual_first ?
				mirror->tokens - mirror->residual_first : 0;
	if (done > kept)
		done = kept;
	if (done > layer->residual_tokens)
		done = layer->residual_tokens;
	return done;
}

uint32_t plan_mirror_valid(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
			   const zc_cuda_target *target)
{
	if (!mirror_knows(mirror, layer, target))
		return 0;
	size_t skip = mirror_skip(mirror, layer);
	for (size_t i = skip; i < layer->n_blocks; i++)
		if (layer->blocks[i].valid_tokens)
			return layer->blocks[i].first_token;
	uint32_t done = residual_done(mirror, layer);
	if (layer->residual_tokens > done)
		return layer->residual_first + done;
	/* Nothing to write: the layer's end. */
	uint32_t end = layer->residual_tokens ? layer->residual_first + layer->residual_tokens : 0;
	for (size_t i = layer->n_blocks; i-- > 0;)
		if (layer->blocks[i].valid_tokens) {
			uint32_t block_end = layer->blocks[i].first_token + layer->blocks[i].valid_tokens;
			return block_end > end ? block_end : end;
		}
	return end;
}

int plan_layer(struct plan *plan, const zc_cuda_layer *layer, const zc_cuda_target *target,
	       const zc_cuda_mirror *mirror)
{
	int rc;

	plan_reset(plan);
	if (!layer || !target)
		return -EINVAL;
	if (layer->memory != ZC_CUDA_HOST && layer->memory != ZC_CUDA_DEVICE)
		return -EINVAL;
	rc = zc_codec_config_validate(&layer->config);
	if (rc < 0)
		return rc;
	if (layer->batch == 0 || layer->heads == 0 || layer->head_dim_k == 0 ||
	    layer->head_dim_v == 0 || layer->head_dim_k > ZC_MAX_HEAD_DIM ||
	    layer->head_dim_v > ZC_MAX_HEAD_DIM)
		return ZC_ESHAPE;
	if (layer->n_blocks && !layer->blocks)
		return -EINVAL;
	plan->memory = layer->memory;

	/* What a mirror says the target holds already: those blocks were
	 * checked when they were loaded and are immutable, so only the others
	 * are checked (a decode step pays for its new rows, not the layer). */
	bool known = mirror_knows(mirror, layer, target);
	size_t skip = known ? mirror_skip(mirror, layer) : 0;

	/* Checks first, so a refusal queues nothing. */
	for (size_t i = skip; i < layer->n_blocks; i++) {
		const zc_cuda_block *block = &layer->blocks[i];
		zc_block_layout k, v;
		zc_block_shape shape = { layer->batch, layer->heads, block->tokens, layer->head_dim_k };
		if (block->valid_tokens > block->tokens)
			return -EINVAL;
		if ((rc = zc_block_layout_compute(&layer->config, ZC_TENSOR_KEYS, &shape, &k)) < 0)
			return rc;
		shape.head_dim = layer->head_dim_v;
		if ((rc = zc_block_layout_compute(&layer->config, ZC_TENSOR_VALUES, &shape, &v)) < 0)
			return rc;
		if (block->key_bytes != k.total_bytes || block->value_bytes != v.total_bytes)
			return ZC_ECORRUPT;
		if (block->valid_tokens == 0)
			continue;
		if (!block->keys || !block->values || !target->keys || !target->values)
			return -EINVAL;
		if ((uint64_t)block->first_token + block->valid_tokens > UINT32_MAX)
			return ZC_EBUFFER;
		if ((rc = check_target(target, block->first_token + block->valid_tokens)) < 0)
			return rc;
		/* Host payloads are checked here, before anything moves; device
		 * payloads by the kernels (zc_cuda_synchronize reports them). */
		if (layer->memory == ZC_CUDA_HOST) {
			for (size_t h = 0; h < k.heads; h++) {
				const uint8_t *kp = (const uint8_t *)block->keys + h * k.head_bytes;
				if (!mask_matches(&k, kp + k.mask_offset))
					return ZC_ECORRUPT;
				if (!v.exact) {
					const uint8_t *vp = (const uint8_t *)block->values +
							    h * v.head_bytes;
					if (!mask_matches(&v, vp + v.mask_offset))
						return ZC_ECORRUPT;
				}
			}
		}
	}
	if (layer->residual_tokens) {
		const zc_strides *ks = &layer->residual_key_strides;
		const zc_strides *vs = &layer->residual_value_strides;
		if (!layer->residual_keys || !layer->residual_values || !target->keys ||
		    !target->values)
			return -EINVAL;
		if (ks->token != layer->head_dim_k || vs->token != layer->head_dim_v)
			return ZC_ESHAPE;
		if ((uint64_t)layer->residual_first + layer->residual_tokens > UINT32_MAX)
			return ZC_EBUFFER;
		if ((rc = check_target(target, layer->residual_first + layer->residual_tokens)) < 0)
			return rc;
	}

	plan->blocks_skipped = skip;
	/* All keys, then all values: where a layer's K payloads lie back to
	 * back in a K arena, neighbouring units are neighbours in host memory
	 * too and move in one DMA. Where instead each block's V follows its K
	 * (the daemon's pool: one extent per block), block by block, K then V,
	 * so that each block moves in one DMA (plan_next_chunk keeps the gap). */
	bool by_block = plan->memory == ZC_CUDA_HOST && layer->n_blocks > skip;
	for (size_t i = skip; i < layer->n_blocks && by_block; i++) {
		const zc_cuda_block *block = &layer->blocks[i];
		const uint8_t *k_end = (const uint8_t *)block->keys + block->key_bytes;
		const uint8_t *v = (const uint8_t *)block->values;
		if (block->valid_tokens && (v < k_end || (uint64_t)(v - k_end) > PLAN_GAP_BYTES))
			by_block = false;
	}
	size_t outer = by_block ? layer->n_blocks - skip : 2;
	size_t inner = by_block ? 2 : layer->n_blocks - skip;
	for (size_t a = 0; a < outer; a++) {
		for (size_t b = 0; b < inner; b++) {
			size_t i = skip + (by_block ? a : b);
			int tensor = (int)(by_block ? b : a) + ZC_TENSOR_KEYS;
			const zc_cuda_block *block = &layer->blocks[i];
			bool keys = tensor == ZC_TENSOR_KEYS;
			zc_block_layout layout;
			zc_block_shape shape = { layer->batch, layer->heads, block->tokens,
						 keys ? layer->head_dim_k : layer->head_dim_v };
			if (block->valid_tokens == 0)
				continue;
			zc_block_layout_compute(&layer->config, (zc_tensor)tensor, &shape, &layout);
			if ((rc = plan_block_tensor(plan, layer, target, &layout, (zc_tensor)tensor,
						    keys ? block->keys : block->values,
						    block->first_token, block->valid_tokens)) < 0)
				goto out_free;
			plan->blocks += keys;
		}
	}
	uint32_t done = known ? residual_done(mirror, layer) : 0;
	if (layer->residual_tokens > done) {
		if ((rc = plan_residual(plan, layer, target, ZC_TENSOR_KEYS, done)) < 0 ||
		    (rc = plan_residual(plan, layer, target, ZC_TENSOR_VALUES, done)) < 0)
			goto out_free;
		plan->residual_rows = layer->residual_tokens - done;
	}
	return 0;
out_free:
	plan_reset(plan);
	return rc;
}

static uint64_t align_up(uint64_t n)
{
	return (n + PLAN_ALIGN - 1) & ~(uint64_t)(PLAN_ALIGN - 1);
}

static bool multiple_of_vector(uint64_t n)
{
	return n % CHUNK_CHANNELS == 0;
}

bool plan_next_chunk(const struct plan *plan, struct plan_cursor *cursor,
		     uint64_t data_capacity, struct plan_chunk *chunk)
{
	bool host = plan->memory == ZC_CUDA_HOST;

	chunk->n_jobs = 0;
	chunk->data_bytes = 0;
	chunk->tiles = chunk->scan_heads = chunk->prefix_words = 0;
	while (cursor->unit < plan->n_units && chunk->n_jobs < chunk->max_jobs) {
		const struct plan_unit *unit = &plan->units[cursor->unit];
		uint32_t left = unit->job.n_heads - cursor->head;
		uint32_t take = left;
		/* Exact rows are read 16 bytes at a time, so they start aligned;
		 * payloads are read at any byte, so they pack back to back (and
		 * neighbours in host memory stay neighbours: one DMA). */
		uint64_t offset = unit->strided ? align_up(chunk->data_bytes) : chunk->data_bytes;
		/* A payload a few bytes past the previous one in host memory keeps
		 * that gap here: the two then move in one DMA (cuda.c). */
		if (host && !unit->strided && unit->job.kind == JOB_QUANTIZED && chunk->n_jobs > 0) {
			const struct plan_placement *prev = &chunk->placements[chunk->n_jobs - 1];
			const uint8_t *first = unit->source + (uint64_t)cursor->head * unit->head_stride_bytes;
			const uint8_t *prev_end = prev->source + prev->bytes;
			if (!prev->strided && prev->bytes && first >= prev_end &&
			    (uint64_t)(first - prev_end) <= PLAN_GAP_BYTES &&
			    prev->offset + prev->bytes == chunk->data_bytes)
				offset += (uint64_t)(first - prev_end);
		}
		if (host && unit->per_head) {
			uint64_t room = offset < data_capacity ? data_capacity - offset : 0;
			uint64_t fit = room / unit->per_head;
			if (fit == 0 && chunk->n_jobs > 0)
				break;
			if (fit == 0)
				fit = 1; /* cannot happen: the caller sized the chunk to max_per_head */
			if (fit < take)
				take = (uint32_t)fit;
		}
		struct cuda_job *job = &chunk->jobs[chunk->n_jobs];
		struct plan_placement *place = &chunk->placements[chunk->n_jobs];
		*job = unit->job;
		memset(place, 0, sizeof *place);
		job->head0 = cursor->head;
		job->n_heads = take;
		job->tile0 = chunk->tiles;
		chunk->tiles += (uint64_t)take * job->tiles_per_head;
		/* Each head's dst is 16-byte aligned if the first is and every stride is. */
		bool vector = job->dst % 16u == 0 && multiple_of_vector(job->dst_batch) &&
			      multiple_of_vector(job->dst_head) && multiple_of_vector(job->dst_token);
		/* Every job gets the running scan and prefix counts, those with
		 * nothing to scan too: the kernels find a block's job by the
		 * last start at or below its index, so starts must not go back. */
		job->scan0 = chunk->scan_heads;
		job->prefix = chunk->prefix_words;
		if (job->kind == JOB_QUANTIZED) {
			chunk->scan_heads += take;
			chunk->prefix_words += (uint64_t)take * (job->words + 1u);
			const uint8_t *first = unit->source + (uint64_t)cursor->head * unit->head_stride_bytes;
			if (host) {
				job->src = offset;
				place->source = first;
				place->offset = offset;
				place->bytes = (uint64_t)take * unit->per_head;
			} else {
				job->src = (uint64_t)(uintptr_t)first;
			}
		} else if (host) {
			/* Packed: head i of the placement at offset + i * per_head. */
			uint64_t rows = job->valid;
			job->src_token = job->dim;
			job->src_head = rows * job->dim;
			job->src_batch = job->src_head * job->heads_per_batch;
			job->src = offset - 2u * (uint64_t)cursor->head * job->src_head;
			vector = vector && multiple_of_vector(job->dim);
			place->source = unit->source;
			place->offset = offset;
			place->bytes = (uint64_t)take * unit->per_head;
			place->strided = true;
			place->heads = take;
			place->rows = job->valid;
			place->row_bytes = 2u * (uint64_t)job->dim;
			place->src_batch_bytes = 2u * unit->job.src_batch;
			place->src_head_bytes = 2u * unit->job.src_head;
			place->src_token_bytes = 2u * unit->job.src_token;
			place->heads_per_batch = job->heads_per_batch;
			place->head0 = cursor->head;
		} else {
			job->src = (uint64_t)(uintptr_t)unit->source;
			vector = vector && job->src % 16u == 0 && multiple_of_vector(job->src_batch) &&
				 multiple_of_vector(job->src_head) &&
				 multiple_of_vector(job->src_token);
		}
		job->vector = vector;
		if (host)
			chunk->data_bytes = offset + place->bytes;
		chunk->n_jobs++;
		cursor->head += take;
		if (cursor->head == unit->job.n_heads) {
			cursor->unit++;
			cursor->head = 0;
		}
	}
	return chunk->n_jobs > 0;
}

void plan_stage(const struct plan_placement *placement, uint8_t *data)
{
	uint8_t *out = data + placement->offset;
	if (!placement->strided) {
		memcpy(out, placement->source, placement->bytes);
		return;
	}
	for (uint32_t i = 0; i < placement->heads; i++) {
		uint32_t flat = placement->head0 + i;
		const uint8_t *head = placement->source +
				      (uint64_t)(flat / placement->heads_per_batch) *
					      placement->src_batch_bytes +
				      (uint64_t)(flat % placement->heads_per_batch) *
					      placement->src_head_bytes;
		uint64_t head_bytes = (uint64_t)placement->rows * placement->row_bytes;
		if (placement->src_token_bytes == placement->row_bytes) {
			memcpy(out, head, head_bytes);
		} else {
			for (uint32_t r = 0; r < placement->rows; r++)
				memcpy(out + r * placement->row_bytes,
				       head + r * placement->src_token_bytes, placement->row_bytes);
		}
		out += head_bytes;
	}
}

int plan_mirror_update(zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
		       const zc_cuda_target *target)
{
	if (layer->n_blocks > mirror->capacity) {
		struct mirror_block *blocks = realloc(mirror->blocks,
						      layer->n_blocks * sizeof *blocks);
		if (!blocks) {
			zc_cuda_mirror_reset(mirror);
			return -ENOMEM;
		}
		mirror->blocks = blocks;
		mirror->capacity = layer->n_blocks;
	}
	uint32_t tokens = 0;
	bool known = mirror->known;
	for (size_t i = 0; i < layer->n_blocks; i++) {
		const zc_cuda_block *block = &layer->blocks[i];
		/* A print belongs to the entry it was taken of. */
		struct mirror_block *was = &mirror->blocks[i];
		bool keep = known && i < mirror->n_blocks && was->printed && was->keys == block->keys &&
			    was->values == block->values && was->first_token == block->first_token &&
			    was->tokens == block->tokens;
		uint64_t print = keep ? was->print : 0;
		mirror->blocks[i] = (struct mirror_block){
			.printed = keep, .print = print,
			.keys = block->keys, .values = block->values,
			.key_bytes = block->key_bytes, .value_bytes = block->value_bytes,
			.first_token = block->first_token, .tokens = block->tokens,
			.valid_tokens = block->valid_tokens,
		};
		if (block->valid_tokens && block->first_token + block->valid_tokens > tokens)
			tokens = block->first_token + block->valid_tokens;
	}
	mirror->n_blocks = layer->n_blocks;
	mirror->residual_first = layer->residual_first;
	mirror->residual_rows = layer->residual_tokens;
	if (layer->residual_tokens && layer->residual_first + layer->residual_tokens > tokens)
		tokens = layer->residual_first + layer->residual_tokens;
	mirror->tokens = tokens;
	mirror->target = *target;
	mirror->config = layer->config;
	mirror->batch = layer->batch;
	mirror->heads = layer->heads;
	mirror->head_dim_k = layer->head_dim_k;
	mirror->head_dim_v = layer->head_dim_v;
	mirror->known = true;
	return 0;
}

int zc_cuda_mirror_new(zc_cuda_mirror **out)
{
	zc_cuda_mirror *mirror = calloc(1, sizeof *mirror);
	if (!mirror)
		return -ENOMEM;
	*out = mirror;
	return 0;
}

void zc_cuda_mirror_free(zc_cuda_mirror *mirror)
{
	if (!mirror)
		return;
	free(mirror->row_prints);
	free(mirror->blocks);
	free(mirror);
}

void zc_cuda_mirror_reset(zc_cuda_mirror *mirror)
{
	mirror->known = false;
	mirror->n_blocks = 0;
	mirror->n_row_prints = 0;
}

void zc_cuda_mirror_trim(zc_cuda_mirror *mirror, uint32_t tokens)
{
	if (!mirror->known || tokens >= mirror->tokens)
		return;
	mirror->tokens = tokens;
	/* Blocks that start at or past the cut are gone; one that straddles it
	 * keeps the tokens before it (the target still holds them). */
	size_t kept = 0;
	while (kept < mirror->n_blocks && mirror->blocks[kept].first_token < tokens) {
		struct mirror_block *block = &mirror->blocks[kept];
		if (block->first_token + block->valid_tokens > tokens)
			block->valid_tokens = tokens - block->first_token;
		kept++;
	}
	mirror->n_blocks = kept;
	uint32_t rows = tokens > mirror->row_prints_first ? tokens - mirror->row_prints_first : 0;
	if (mirror->n_row_prints > rows)
		mirror->n_row_prints = rows;
}
