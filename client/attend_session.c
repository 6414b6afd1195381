/*
 * zc_attend (zipcache/attend.h): one layer of a session read through the
 * reader protocol (zipcache/reader.h) and handed to zc_attend_segments()
 * as segments, blocks and residual in token order. This room only turns a
 * read into segments and retries torn reads; the numerics are the codec's
 * (codec/attend.c, docs/ATTEND.md).
 */
#include "attend_session.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The segments of one read, and the private key payloads some point at. */
struct plan {
	zc_attend_segment *segments;
	uint8_t **copies;
	size_t n, n_copies, capacity;
};

static int64_t clock_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

static int plan_reserve(struct plan *plan, size_t n)
{
	if (n <= plan->capacity)
		return 0;
	zc_attend_segment *segments = realloc(plan->segments, n * sizeof(*segments));
	if (!segments)
		return -ENOMEM;
	plan->segments = segments;
	uint8_t **copies = realloc(plan->copies, n * sizeof(*copies));
	if (!copies)
		return -ENOMEM;
	plan->copies = copies;
	plan->capacity = n;
	return 0;
}

static void plan_drop_copies(struct plan *plan)
{
	for (size_t i = 0; i < plan->n_copies; i++)
		free(plan->copies[i]);
	plan->n_copies = 0;
}

static void plan_free(struct plan *plan)
{
	plan_drop_copies(plan);
	free(plan->segments);
	free(plan->copies);
}

/*
 * The kernels trust a key payload's saliency masks, checked once before
 * the walk, to stay as checked while they walk. Inside a consistent read
 * they do (a block's bytes never change while the layer names it). In a
 * torn one, a block a trim dropped may have its extent rewritten under the
 * walk, which may then follow the new masks up to this many bytes past the
 * key payload (params of every group, codes of every row, at 8 bits): the
 * read is thrown away, but it must not leave the pool mapping. Past a
 * payload there is always mapped pool, except for a block at the mapping's
 * very end; that one is attended from a private copy, which cannot change.
 */
static uint64_t overread_bound(const zc_block *block)
{
	return 8 * ((uint64_t)block->tokens + 1) * block->key_shape.head_dim + 4096;
}

static bool near_pool_end(const struct map_reader *reader, const zc_block *block)
{
	uint64_t end = block->key_offset + block->key_bytes;
	return end > reader->pool_bytes || reader->pool_bytes - end < overread_bound(block);
}

/* A copy of the key payload as this read sees it, for near_pool_end. */
static int key_copy(struct plan *plan, const zc_block *block, const uint8_t **keys)
{
	uint8_t *copy = malloc(block->key_bytes ? block->key_bytes : 1);
	if (!copy)
		return -ENOMEM;
	memcpy(copy, block->key_payload, block->key_bytes);
	plan->copies[plan->n_copies++] = copy;
	*keys = copy;
	return 0;
}

static zc_attend_segment rows_segment(const zc_session_info *info, uint32_t tokens,
				      const uint16_t *keys, const zc_strides *key_strides,
				      const uint16_t *values, const zc_strides *value_strides)
{
	return (zc_attend_segment){
		.kind = ZC_ATTEND_ROWS,
		.rows = { .batch = info->batch, .heads = info->kv_heads, .tokens = tokens,
			  .head_dim_k = info->head_dim_k, .head_dim_v = info->head_dim_v,
			  .keys = keys, .key_strides = *key_strides,
			  .values = values, .value_strides = *value_strides },
	};
}

/*
 * One read's segments: each block's valid rows (its payloads in the pool,
 * or with over_view the view's rows it covers), then the residual rows.
 * With views = full the residual rows are the view's last rows, so the
 * view's row t lies t - first rows before the residual's row 0.
 */
static int plan_read(const struct map_reader *reader, const zc_session_info *info,
		     const zc_read *read, bool over_view, struct plan *plan,
		     uint32_t *residual_first)
{
	zc_layer_contents layout;
	int rc = map_layer_layout(reader, read, &layout);

	if (rc < 0)
		return rc;
	*residual_first = layout.tokens - layout.residual_tokens;
	if (over_view && !read->view)
		return ZC_ESTALE;
	if ((rc = plan_reserve(plan, (size_t)layout.blocks + 1)) < 0)
		return rc;
	plan->n = 0;
	size_t first = layout.tokens - layout.residual_tokens;
	for (uint32_t i = 0; i < layout.blocks; i++) {
		zc_block block;
		if ((rc = map_layer_block(reader, read, i, &block)) < 0)
			return rc;
		if (over_view) {
			ptrdiff_t back = (ptrdiff_t)first - (ptrdiff_t)block.first_token;
			plan->segments[plan->n++] = rows_segment(
				info, block.valid_tokens,
				layout.residual_keys - back * (ptrdiff_t)layout.key_strides.token,
				&layout.key_strides,
				layout.residual_values - back * (ptrdiff_t)layout.value_strides.token,
				&layout.value_strides);
			continue;
		}
		const uint8_t *keys = block.key_payload;
		if (near_pool_end(reader, &block) && (rc = key_copy(plan, &block, &keys)) < 0)
			return rc;
		plan->segments[plan->n++] = (zc_attend_segment){
			.kind = ZC_ATTEND_BLOCK,
			.block = { .config = info->codec, .shape = block.key_shape,
				   .head_dim_v = block.value_shape.head_dim,
				   .valid_tokens = block.valid_tokens,
				   .keys = keys, .key_bytes = block.key_bytes,
				   .values = block.value_payload, .value_bytes = block.value_bytes },
		};
	}
	/* An empty layer still gets its (empty) residual: the core names it
	 * ZC_ESHAPE, no tokens, as it would for an empty list of its own. */
	if (layout.residual_tokens > 0 || plan->n == 0)
		plan->segments[plan->n++] =
			rows_segment(info, layout.residual_tokens, layout.residual_keys,
				     &layout.key_strides, layout.residual_values,
				     &layout.value_strides);
	return 0;
}

/* The checks that need no read, in the core's order (shapes, then the
 * buffer), and the output's size. */
static int query_check(const zc_session_info *info, uint32_t layer, const zc_attend_query *query,
		       const zc_attend_output *output, unsigned flags, size_t *out_bytes)
{
	if (!query || !output || !query->data || !output->data ||
	    (output->mass && !output->mass->data) ||
	    (flags & ~ZC_ATTEND_OVER_VIEW) || layer >= info->layers ||
	    (output->dtype != ZC_ATTEND_FP32 && output->dtype != ZC_ATTEND_FP16))
		return ZC_EINVALID;
	if ((flags & ZC_ATTEND_OVER_VIEW) && info->views == ZC_VIEWS_NONE)
		return ZC_EPRECONDITION;
	if (query->batch != info->batch || query->head_dim != info->head_dim_k ||
	    query->q_heads == 0 || query->n_q == 0 || query->q_heads % info->kv_heads != 0 ||
	    (uint64_t)(query->q_heads / info->kv_heads) * query->n_q > ZC_ATTEND_MAX_ROWS)
		return ZC_ESHAPE;
	/* Bounded by the rows limit: batch * kv_heads * MAX_ROWS * D * 4 fits. */
	*out_bytes = (size_t)query->batch * query->q_heads * query->n_q * info->head_dim_v *
		     (output->dtype == ZC_ATTEND_FP16 ? 2 : 4);
	return output->capacity < *out_bytes ? ZC_EBUFFER : 0;
}

int map_attend(const struct map_reader *reader, const zc_session_info *info, uint32_t layer,
	       const zc_attend_query *query, const zc_attend_output *output, unsigned flags,
	       unsigned threads, size_t *copied)
{
	struct plan plan = { 0 };
	size_t out_bytes = 0;
	int rc = info ? query_check(info, layer, query, output, flags, &out_bytes) : ZC_EINVALID;

	if (rc < 0)
		return rc;
	zc_attend_output scratch = { output->dtype, malloc(out_bytes), out_bytes, NULL };
	/* The masses into scratch too, at most a full residual's worth of
	 * the caller's capacity (more could never be written). */
	zc_attend_mass mass = { 0 };
	if (output->mass) {
		size_t most = (size_t)info->batch * info->kv_heads * ZC_MAX_RESIDUAL_TOKENS;
		mass.capacity = output->mass->capacity < most ? output->mass->capacity : most;
		mass.data = malloc(mass.capacity ? mass.capacity * sizeof(float) : 1);
		scratch.mass = &mass;
	}
	if (!scratch.data || (output->mass && !mass.data)) {
		free(scratch.data);
		free(mass.data);
		return -ENOMEM;
	}
	int64_t deadline = clock_ms() + ZC_READ_TIMEOUT_MS;
	for (;;) {
		int64_t left = deadline - clock_ms();
		zc_read read;
		if ((rc = map_read_begin(reader, layer, left > 0 ? (int)left : 1, &read)) < 0)
			break;
		rc = plan_read(reader, info, &read, flags & ZC_ATTEND_OVER_VIEW, &plan,
			       &mass.first_token);
		if (rc == 0)
			rc = zc_attend_segments(plan.segments, plan.n, query, &scratch, threads);
		size_t copies = plan.n_copies;
		plan_drop_copies(&plan);
		int end = map_read_end(reader, &read);
		if (end == 0) {
			if (copied)
				*copied = copies;
			break;   /* one state of the layer: rc stands */
		}
		/* Torn, or the view moved under the read: whatever it gave is
		 * void. A view that is gone shows at the next read's layout. */
		rc = end;
		if ((end != ZC_EAGAIN && end != ZC_ESTALE) || clock_ms() >= deadline)
			break;
	}
	if (rc == 0) {
		memcpy(output->data, scratch.data, out_bytes);
		if (output->mass) {
			size_t n = (size_t)info->batch * info->kv_heads * mass.tokens;
			if (n)
				memcpy(output->mass->data, mass.data, n * sizeof(float));
			output->mass->first_token = mass.first_token;
			output->mass->tokens = mass.tokens;
		}
	}
	free(scratch.data);
	free(mass.data);
	plan_free(&plan);
	return rc;
}

int zc_attend(const zc_session *session, uint32_t layer, const zc_attend_query *query,
	      const zc_attend_output *output, unsigned flags, unsigned threads)
{
	if (!session)
		return ZC_EINVALID;
	const zc_map_header *map = zc_session_map(session);
	size_t pool_bytes = 0;
	const uint8_t *pool = zc_session_pool(session, &pool_bytes);
	/* As the reader's own calls see a handle: client.c mapped exactly
	 * map_bytes of the map, checked at open. */
	struct map_reader reader = { map, map ? __atomic_load_n(&map->map_bytes, __ATOMIC_RELAXED) : 0,
				     pool, pool_bytes };
	return map_attend(&reader, zc_session_get_info(session), layer, query, output, flags,
			  threads, NULL);
}
