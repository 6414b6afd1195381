/*
 * Attention over a layer's segments (include/zipcache/attend.h): checks
 * everything first, then per (batch, KV head) pair one pass over the
 * segments in 64-token chunks, flash-decoding style: scores from the
 * keys (decoded in the kernels, never stored), the online-softmax step,
 * weights times values into a chunk partial, the partial into the
 * running accumulator. docs/ATTEND.md gives the order of every
 * operation; the arithmetic is in the kernel tables.
 */
#include "zipcache/attend.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attend_kernels.h"
#include "attend_softmax.h"
#include "block.h"

/* One segment after validation: what the walk needs per head. */
struct segment_plan {
	zc_attend_kind kind;
	uint32_t tokens;          /* the tokens that count (valid_tokens for a block) */
	zc_block_layout key_layout, value_layout;
	uint32_t group_size;
	const uint8_t *keys, *values;
	const uint8_t *keys_end, *values_end;
	const zc_attend_rows *rows;
};

struct attend_job {
	const struct attend_kernels *kernels;
	const struct segment_plan *plans;
	size_t n_plans;
	const zc_attend_query *query;
	const zc_attend_output *output;
	uint32_t kv_heads, head_dim_k, head_dim_v;
	uint32_t total_tokens;
	size_t rows;          /* R: query rows per KV head */
	size_t padded_rows;   /* R rounded as the kernels want it */
	size_t q_stride, v_stride;
	float q_factor;       /* scale * log2(e) */
	zc_attend_mass *mass; /* NULL: no masses */
	uint32_t mass_first, mass_tokens;
	_Atomic size_t next_item;
};

/* Per-thread scratch, allocated before any work starts. */
struct attend_scratch {
	float *q;       /* padded_rows x q_stride */
	float *s;       /* padded_rows x ATTEND_CHUNK: scores, then weights */
	float *acc;     /* rows x v_stride */
	float *part;    /* rows x v_stride */
	float *m, *l, *alpha;
	/* Group caches (attend_kernels.h): keys hi, keys lo, values. */
	uint8_t *cache;
};

enum { CACHE_KEYS_HI, CACHE_KEYS_LO, CACHE_VALUES, CACHES };

static const struct attend_kernels *kernels_for_isa(zc_isa isa)
{
	switch (isa) {
	case ZC_ISA_AVX512:
		return &attend_kernels_avx512;
	case ZC_ISA_AVX2:
		return &attend_kernels_avx2;
	case ZC_ISA_SCALAR:
		break;
	}
	return &attend_kernels_scalar;
}

void zc_attend_query_init(zc_attend_query *query, uint32_t batch, uint32_t q_heads,
			  uint32_t n_q, uint32_t head_dim, const float *data)
{
	*query = (zc_attend_query){ .batch = batch, .q_heads = q_heads, .n_q = n_q,
				    .head_dim = head_dim, .dtype = ZC_ATTEND_FP32,
				    .data = data };
}

static size_t round_up(size_t n, size_t to)
{
	return (n + to - 1) / to * to;
}

/* ---- validation --------------------------------------------------------- */

static int plan_block(const zc_attend_block *block, struct segment_plan *plan)
{
	zc_block_shape value_shape = block->shape;
	int rc;

	value_shape.head_dim = block->head_dim_v;
	if ((rc = zc_block_layout_compute(&block->config, ZC_TENSOR_KEYS, &block->shape,
					  &plan->key_layout)) < 0 ||
	    (rc = zc_block_layout_compute(&block->config, ZC_TENSOR_VALUES, &value_shape,
					  &plan->value_layout)) < 0)
		return rc;
	if (block->valid_tokens > block->shape.tokens)
		return ZC_EINVALID;
	if (block->key_bytes != plan->key_layout.total_bytes ||
	    block->value_bytes != plan->value_layout.total_bytes)
		return ZC_ECORRUPT;
	if ((plan->key_layout.total_bytes && !block->keys) ||
	    (plan->value_layout.total_bytes && !block->values))
		return ZC_EINVALID;
	plan->kind = ZC_ATTEND_BLOCK;
	plan->tokens = block->valid_tokens;
	plan->group_size = (uint32_t)block->config.group_size;
	plan->keys = block->keys;
	plan->values = block->values;
	plan->keys_end = plan->keys + block->key_bytes;
	plan->values_end = plan->values + block->value_bytes;
	/* A mask whose count is not n_hi would send the walk past the
	 * payload's params and codes. */
	for (size_t h = 0; h < plan->key_layout.heads; h++)
		if (!codec_mask_matches(&plan->key_layout,
					plan->keys + h * plan->key_layout.head_bytes +
						plan->key_layout.mask_offset))
			return ZC_ECORRUPT;
	if (!plan->value_layout.exact)
		for (size_t h = 0; h < plan->value_layout.heads; h++)
			if (!codec_mask_matches(&plan->value_layout,
						plan->values + h * plan->value_layout.head_bytes +
							plan->value_layout.mask_offset))
				return ZC_ECORRUPT;
	return 0;
}

static int plan_rows(const zc_attend_rows *rows, struct segment_plan *plan)
{
	if (rows->batch == 0 || rows->heads == 0 || rows->head_dim_k == 0 ||
	    rows->head_dim_v == 0 || rows->head_dim_k > ZC_MAX_HEAD_DIM ||
	    rows->head_dim_v > ZC_MAX_HEAD_DIM)
		return ZC_ESHAPE;
	if (rows->tokens && (!rows->keys || !rows->values))
		return ZC_EINVALID;
	*plan = (struct segment_plan){ .kind = ZC_ATTEND_ROWS, .tokens = rows->tokens,
				       .rows = rows };
	return 0;
}

/* Checks one segment against the query and the first segment's shape,
 * then (shapes first, so a mismatch is named as one) its payload. */
static int plan_segment(const zc_attend_segment *segment, struct attend_job *job,
			bool first, struct segment_plan *plan)
{
	uint32_t batch, heads, dim_k, dim_v;

	if (segment->kind == ZC_ATTEND_BLOCK) {
		batch = segment->block.shape.batch;
		heads = segment->block.shape.heads;
		dim_k = segment->block.shape.head_dim;
		dim_v = segment->block.head_dim_v;
	} else if (segment->kind == ZC_ATTEND_ROWS) {
		batch = segment->rows.batch;
		heads = segment->rows.heads;
		dim_k = segment->rows.head_dim_k;
		dim_v = segment->rows.head_dim_v;
	} else {
		return ZC_EINVALID;
	}
	if (first) {
		job->kv_heads = heads;
		job->head_dim_v = dim_v;
	}
	if (batch != job->query->batch || dim_k != job->head_dim_k || heads != job->kv_heads ||
	    dim_v != job->head_dim_v)
		return ZC_ESHAPE;
	if (segment->kind == ZC_ATTEND_BLOCK)
		return plan_block(&segment->block, plan);
	return plan_rows(&segment->rows, plan);
}

static int query_check_finite(const zc_attend_query *query)
{
	size_t n = (size_t)query->batch * query->q_heads * query->n_q * query->head_dim;
	if (query->dtype == ZC_ATTEND_FP16)
		return zc_fp16_check_finite(query->data, n);
	const float *q = query->data;
	unsigned bad = 0;
	for (size_t i = 0; i < n; i++)
		bad |= !isfinite(q[i]);
	return bad ? ZC_ENONFINITE : 0;
}

static size_t dtype_size(zc_attend_dtype dtype)
{
	return dtype == ZC_ATTEND_FP16 ? 2 : 4;
}

static int job_prepare(struct attend_job *job, const zc_attend_segment *segments,
		       size_t n_segments, const zc_attend_query *query,
		       const zc_attend_output *output, struct segment_plan *plans)
{
	int rc;

	if (!query || !output || (n_segments && !segments))
		return ZC_EINVALID;
	if ((query->dtype != ZC_ATTEND_FP32 && query->dtype != ZC_ATTEND_FP16) ||
	    (output->dtype != ZC_ATTEND_FP32 && output->dtype != ZC_ATTEND_FP16) ||
	    !query->data || !output->data || !isfinite(query->scale))
		return ZC_EINVALID;
	if (query->batch == 0 || query->q_heads == 0 || query->n_q == 0 ||
	    query->head_dim == 0 || query->head_dim > ZC_MAX_HEAD_DIM || n_segments == 0)
		return ZC_ESHAPE;
	job->query = query;
	job->output = output;
	job->head_dim_k = query->head_dim;
	uint64_t total = 0;
	for (size_t i = 0; i < n_segments; i++) {
		if ((rc = plan_segment(&segments[i], job, i == 0, &plans[i])) < 0)
			return rc;
		total += plans[i].tokens;
	}
	if (query->q_heads % job->kv_heads != 0)
		return ZC_ESHAPE;
	job->rows = (size_t)(query->q_heads / job->kv_heads) * query->n_q;
	if (job->rows > ZC_ATTEND_MAX_ROWS || total == 0 || total > UINT32_MAX ||
	    (query->causal && total < query->n_q))
		return ZC_ESHAPE;
	size_t out_bytes = (size_t)query->batch * query->q_heads * query->n_q * job->head_dim_v *
			   dtype_size(output->dtype);
	if (output->capacity < out_bytes)
		return ZC_EBUFFER;
	if (output->mass) {
		const zc_attend_mass *mass = output->mass;
		if (mass->first_token > total)
			return ZC_ESHAPE;
		uint32_t n = (uint32_t)total - mass->first_token;
		if (mass->capacity / ((size_t)query->batch * job->kv_heads) < n)
			return ZC_EBUFFER;
		if (n && !mass->data)
			return ZC_EINVALID;
		job->mass = output->mass;
		job->mass_first = mass->first_token;
		job->mass_tokens = n;
	}
	if ((rc = query_check_finite(query)) < 0)
		return rc;

	double scale = query->scale != 0.0 ? query->scale : 1.0 / sqrt((double)query->head_dim);
	job->q_factor = (float)(scale * 1.4426950408889634);
	job->total_tokens = (uint32_t)total;
	job->padded_rows = job->rows <= 2 ? job->rows : round_up(job->rows, ATTEND_QUERY_PAD);
	job->q_stride = round_up(job->head_dim_k, 16);
	job->v_stride = round_up(job->head_dim_v, 16);
	job->plans = plans;
	job->n_plans = n_segments;
	job->kernels = kernels_for_isa(zc_codec_isa());
	atomic_init(&job->next_item, 0);
	return 0;
}

/* ---- the walk ----------------------------------------------------------- */

static void scratch_free(struct attend_scratch *scratch)
{
	free(scratch->q);
	free(scratch->s);
	free(scratch->acc);
	free(scratch->part);
	free(scratch->m);
	free(scratch->cache);
}

static int scratch_alloc(struct attend_scratch *scratch, const struct attend_job *job)
{
	size_t rows = job->padded_rows;
	*scratch = (struct attend_scratch){ 0 };
	/* 64-byte aligned rows: q_stride and v_stride are multiples of 16. */
	scratch->q = aligned_alloc(64, rows * job->q_stride * sizeof(float));
	scratch->s = aligned_alloc(64, rows * ATTEND_CHUNK * sizeof(float));
	scratch->acc = aligned_alloc(64, rows * job->v_stride * sizeof(float));
	scratch->part = aligned_alloc(64, rows * job->v_stride * sizeof(float));
	scratch->m = malloc(3 * rows * sizeof(float));
	scratch->cache = aligned_alloc(64, CACHES * ATTEND_CACHE_BYTES);
	if (!scratch->q || !scratch->s || !scratch->acc || !scratch->part || !scratch->m ||
	    !scratch->cache) {
		scratch_free(scratch);
		return -ENOMEM;
	}
	scratch->l = scratch->m + rows;
	scratch->alpha = scratch->l + rows;
	return 0;
}

/* Forgets every group cache: what a kernel kept for one pair's payloads
 * must not be taken for another's (a payload is only known not to change
 * during one pass, and its address may be reused after the call). */
static void attend_cache_reset(uint8_t *cache)
{
	for (int i = 0; i < CACHES; i++)
		memset(cache + i * ATTEND_CACHE_BYTES, 0, ATTEND_CACHE_KEY_BYTES);
}

/* The query rows of (b, h), times scale * log2(e), zero padded. */
static void load_queries(const struct attend_job *job, size_t b, size_t h, float *q)
{
	const zc_attend_query *query = job->query;
	size_t dim = job->head_dim_k, rep = query->q_heads / job->kv_heads;
	size_t first = ((b * query->q_heads + h * rep) * query->n_q) * dim;

	memset(q, 0, job->padded_rows * job->q_stride * sizeof(float));
	for (size_t r = 0; r < job->rows; r++)
		for (size_t c = 0; c < dim; c++) {
			size_t at = first + r * dim + c;
			float x = query->dtype == ZC_ATTEND_FP16 ?
					  zc_fp16_to_float(((const uint16_t *)query->data)[at]) :
					  ((const float *)query->data)[at];
			q[r * job->q_stride + c] = x * job->q_factor;
		}
}

/* Eight mask bytes from byte `at`, zero past the mask. */
static uint64_t mask_word(const uint8_t *mask, size_t mask_bytes, size_t at)
{
	uint64_t word = 0;
	size_t n = mask_bytes - at < 8 ? mask_bytes - at : 8;
	for (size_t i = 0; i < n; i++)
		word |= (uint64_t)mask[at + i] << (8 * i);
	return word;
}

/* Scores of one subset's rows in this chunk, split where groups end. */
static void score_subset(const struct attend_job *job, const struct segment_plan *plan,
			 const uint8_t *payload, uint64_t members, uint32_t first_row, int bits,
			 size_t params_offset, size_t codes_offset, const float *q, float *s,
			 void *cache)
{
	uint8_t pos[ATTEND_CHUNK];
	size_t n = 0, dim = job->head_dim_k, group = plan->group_size;

	while (members) {
		pos[n++] = (uint8_t)__builtin_ctzll(members);
		members &= members - 1;
	}
	for (size_t done = 0; done < n;) {
		size_t row = first_row + done;
		size_t g = row / group;
		size_t run = (g + 1) * group - row < n - done ? (g + 1) * group - row : n - done;
		const uint8_t *scales = payload + params_offset + g * 4 * dim;
		job->kernels->score_codes(payload + codes_offset, plan->keys_end,
					  row * dim * (size_t)bits, run, dim, bits, scales,
					  scales + 2 * dim, q, job->padded_rows, job->q_stride, s,
					  pos + done, cache);
		done += run;
	}
}

static void chunk_scores(const struct attend_job *job, const struct segment_plan *plan,
			 size_t item, uint32_t t0, uint32_t n, uint32_t *hi_row, uint32_t *lo_row,
			 const float *q, float *s, uint8_t *cache)
{
	static const uint8_t identity[ATTEND_CHUNK] = {
		0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
		16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
		32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
		48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63,
	};
	size_t dim = job->head_dim_k;

	if (plan->kind == ZC_ATTEND_ROWS) {
		const zc_attend_rows *rows = plan->rows;
		size_t b = item / job->kv_heads, h = item % job->kv_heads;
		const uint16_t *k = rows->keys + b * rows->key_strides.batch +
				    h * rows->key_strides.head + (size_t)t0 * rows->key_strides.token;
		job->kernels->score_fp16(k, rows->key_strides.token, n, dim, q, job->padded_rows,
					 job->q_stride, s, identity);
		return;
	}
	const zc_block_layout *layout = &plan->key_layout;
	const uint8_t *payload = plan->keys + item * layout->head_bytes;
	uint64_t valid = n < 64 ? (UINT64_C(1) << n) - 1u : ~UINT64_C(0);
	uint64_t word = mask_word(payload + layout->mask_offset, layout->mask_bytes, t0 / 8);
	uint64_t hi = word & valid, lo = ~word & valid;

	score_subset(job, plan, payload, hi, *hi_row, layout->hi_bits, layout->hi_params_offset,
		     layout->hi_codes_offset, q, s, cache + CACHE_KEYS_HI * ATTEND_CACHE_BYTES);
	score_subset(job, plan, payload, lo, *lo_row, layout->lo_bits, layout->lo_params_offset,
		     layout->lo_codes_offset, q, s, cache + CACHE_KEYS_LO * ATTEND_CACHE_BYTES);
	*hi_row += (uint32_t)__builtin_popcountll(hi);
	*lo_row += (uint32_t)__builtin_popcountll(lo);
}

/* A block's chunk the mass pass does not need: only the subset rows it
 * holds, so that the next chunk's codes are found. */
static void chunk_skip(const struct segment_plan *plan, size_t item, uint32_t t0, uint32_t n,
		       uint32_t *hi_row, uint32_t *lo_row)
{
	if (plan->kind != ZC_ATTEND_BLOCK)
		return;
	const zc_block_layout *layout = &plan->key_layout;
	const uint8_t *payload = plan->keys + item * layout->head_bytes;
	uint64_t valid = n < 64 ? (UINT64_C(1) << n) - 1u : ~UINT64_C(0);
	uint64_t word = mask_word(payload + layout->mask_offset, layout->mask_bytes, t0 / 8);
	*hi_row += (uint32_t)__builtin_popcountll(word & valid);
	*lo_row += (uint32_t)__builtin_popcountll(~word & valid);
}

static void chunk_values(const struct attend_job *job, const struct segment_plan *plan,
			 size_t item, uint32_t t0, uint32_t n, const float *p, float *part,
			 uint8_t *cache)
{
	const struct attend_kernels *kernels = job->kernels;
	size_t dim = job->head_dim_v;

	if (plan->kind == ZC_ATTEND_ROWS) {
		const zc_attend_rows *rows = plan->rows;
		size_t b = item / job->kv_heads, h = item % job->kv_heads;
		const uint16_t *v = rows->values + b * rows->value_strides.batch +
				    h * rows->value_strides.head +
				    (size_t)t0 * rows->value_strides.token;
		kernels->accumulate_fp16(v, rows->value_strides.token, n, dim, p, job->rows, part,
					 job->v_stride);
		return;
	}
	const zc_block_layout *layout = &plan->value_layout;
	const uint8_t *payload = plan->values + item * layout->head_bytes;
	if (layout->exact) {
		kernels->accumulate_fp16((const uint16_t *)payload + (size_t)t0 * dim, dim, n, dim,
					 p, job->rows, part, job->v_stride);
		return;
	}
	/* Values: every token is in the hi subset, in token order. */
	size_t group = plan->group_size;
	for (size_t row = t0; row < (size_t)t0 + n;) {
		size_t g = row / group;
		size_t end = (g + 1) * group < (size_t)t0 + n ? (g + 1) * group : (size_t)t0 + n;
		const uint8_t *scales = payload + layout->hi_params_offset + g * 4 * dim;
		kernels->accumulate_codes(payload + layout->hi_codes_offset, plan->values_end,
					  row * dim * (size_t)layout->hi_bits, end - row, dim,
					  layout->hi_bits, scales, scales + 2 * dim, p + (row - t0),
					  job->rows, part, job->v_stride,
					  cache + CACHE_VALUES * ATTEND_CACHE_BYTES);
		row = end;
	}
}

/* Causal: query row r (its query i = r mod n_q) sees the tokens before
 * total - n_q + i + 1. */
static void chunk_mask(const struct attend_job *job, uint32_t first, uint32_t n, float *s)
{
	size_t n_q = job->query->n_q;
	for (size_t r = 0; r < job->rows; r++) {
		float *row = s + r * ATTEND_CHUNK;
		for (uint32_t t = n; t < ATTEND_CHUNK; t++)
			row[t] = -__builtin_inff();
		if (!job->query->causal)
			continue;
		uint64_t visible = (uint64_t)job->total_tokens - n_q + r % n_q + 1;
		for (uint32_t t = 0; t < n; t++)
			if (first + t >= visible)
				row[t] = -__builtin_inff();
	}
}

static void item_store(const struct attend_job *job, size_t item, const float *acc,
		       const float *l)
{
	const zc_attend_query *query = job->query;
	size_t b = item / job->kv_heads, h = item % job->kv_heads;
	size_t rep = query->q_heads / job->kv_heads, dim = job->head_dim_v;
	size_t first = ((b * query->q_heads + h * rep) * query->n_q) * dim;

	for (size_t r = 0; r < job->rows; r++)
		for (size_t c = 0; c < dim; c++) {
			float y = acc[r * job->v_stride + c] / l[r];
			if (job->output->dtype == ZC_ATTEND_FP16)
				((uint16_t *)job->output->data)[first + r * dim + c] =
					zc_float_to_fp16(y);
			else
				((float *)job->output->data)[first + r * dim + c] = y;
		}
}

/*
 * The masses of (batch, KV head) pair `item` (zc_attend_mass), once m and
 * l are final: the chunks holding tokens from mass_first on are scored
 * again, with the walk's kernels and mask, and attend_mass_chunk sums
 * their probabilities over the rows.
 */
static void item_mass(const struct attend_job *job, size_t item, struct attend_scratch *sc)
{
	float *out = job->mass->data + item * (size_t)job->mass_tokens;
	uint32_t first = 0, from = job->mass_first;

	attend_cache_reset(sc->cache);

	for (size_t i = 0; i < job->n_plans; i++) {
		const struct segment_plan *plan = &job->plans[i];
		uint32_t hi_row = 0, lo_row = 0;
		for (uint32_t t0 = 0; t0 < plan->tokens; t0 += ATTEND_CHUNK) {
			uint32_t n = plan->tokens - t0 < ATTEND_CHUNK ? plan->tokens - t0 :
									 ATTEND_CHUNK;
			uint32_t at = first + t0;
			if (at + n <= from) {
				chunk_skip(plan, item, t0, n, &hi_row, &lo_row);
				continue;
			}
			chunk_scores(job, plan, item, t0, n, &hi_row, &lo_row, sc->q, sc->s,
				     sc->cache);
			chunk_mask(job, at, n, sc->s);
			unsigned lo = at < from ? from - at : 0;
			attend_mass_chunk(sc->s, job->rows, sc->m, sc->l, lo, n, out + (at + lo - from));
		}
		first += plan->tokens;
	}
}

/* One (batch, KV head) pair: one pass over every segment. */
static void item_run(const struct attend_job *job, size_t item, struct attend_scratch *sc)
{
	uint32_t first = 0;

	attend_cache_reset(sc->cache);
	load_queries(job, item / job->kv_heads, item % job->kv_heads, sc->q);
	memset(sc->acc, 0, job->rows * job->v_stride * sizeof(float));
	memset(sc->part, 0, job->rows * job->v_stride * sizeof(float));
	for (size_t r = 0; r < job->rows; r++) {
		sc->m[r] = -__builtin_inff();
		sc->l[r] = 0.0f;
	}
	for (size_t i = 0; i < job->n_plans; i++) {
		const struct segment_plan *plan = &job->plans[i];
		uint32_t hi_row = 0, lo_row = 0;
		for (uint32_t t0 = 0; t0 < plan->tokens; t0 += ATTEND_CHUNK) {
			uint32_t n = plan->tokens - t0 < ATTEND_CHUNK ? plan->tokens - t0 :
									 ATTEND_CHUNK;
			chunk_scores(job, plan, item, t0, n, &hi_row, &lo_row, sc->q, sc->s,
				     sc->cache);
			chunk_mask(job, first + t0, n, sc->s);
			job->kernels->softmax(sc->s, job->rows, sc->m, sc->l, sc->alpha);
			chunk_values(job, plan, item, t0, n, sc->s, sc->part, sc->cache);
			job->kernels->combine(sc->acc, sc->part, job->rows, job->v_stride,
					      sc->alpha);
		}
		first += plan->tokens;
	}
	item_store(job, item, sc->acc, sc->l);
	if (job->mass && job->mass_tokens)
		item_mass(job, item, sc);
}

struct worker {
	struct attend_job *job;
	struct attend_scratch scratch;
	pthread_t thread;
	bool started;
};

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	size_t items = (size_t)w->job->query->batch * w->job->kv_heads;
	for (;;) {
		size_t item = atomic_fetch_add(&w->job->next_item, 1);
		if (item >= items)
			break;
		item_run(w->job, item, &w->scratch);
	}
	return NULL;
}

int zc_attend_segments(const zc_attend_segment *segments, size_t n_segments,
		       const zc_attend_query *query, const zc_attend_output *output,
		       unsigned threads)
{
	struct attend_job job;
	struct segment_plan *plans;
	struct worker *workers;
	int rc;

	memset(&job, 0, sizeof job);
	plans = calloc(n_segments ? n_segments : 1, sizeof *plans);
	if (!plans)
		return -ENOMEM;
	if ((rc = job_prepare(&job, segments, n_segments, query, output, plans)) < 0)
		goto out_plans;

	size_t items = (size_t)query->batch * job.kv_heads;
	size_t n_workers = threads > 1 ? threads : 1;
	if (n_workers > items)
		n_workers = items;
	workers = calloc(n_workers, sizeof *workers);
	if (!workers) {
		rc = -ENOMEM;
		goto out_plans;
	}
	size_t ready = 0;
	for (; ready < n_workers; ready++) {
		workers[ready].job = &job;
		if ((rc = scratch_alloc(&workers[ready].scratch, &job)) < 0)
			goto out_workers;
	}
	/* A thread that cannot start leaves its share to the others: the
	 * items are taken from one counter, so the output is the same. */
	for (size_t i = 1; i < n_workers; i++)
		workers[i].started =
			pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]) == 0;
	worker_main(&workers[0]);
	for (size_t i = 1; i < n_workers; i++)
		if (workers[i].started)
			pthread_join(workers[i].thread, NULL);
	if (job.mass)
		job.mass->tokens = job.mass_tokens;
	rc = 0;
out_workers:
	for (size_t i = 0; i < ready; i++)
		scratch_free(&workers[i].scratch);
	free(workers);
out_plans:
	free(plans);
	return rc;
}
