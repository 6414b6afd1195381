/*
 * The expected state of a zipcached session (tests/layer_model.h), built
 * from the codec's public API alone. Shared by tests/service_test.c and
 * tests/reliability_test.c so both suites check the daemon against one
 * reading of the specification.
 */
#include "layer_model.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "process_run.h"
#include "zipcache/error.h"

/* ---- failure messages ------------------------------------------------------ */

bool fail_with(char *why, size_t size, const char *format, ...)
{
	va_list args;

	va_start(args, format);
	vsnprintf(why, size, format, args);
	va_end(args);
	return false;
}

void model_abort(const char *format, ...)
{
	va_list args;

	va_start(args, format);
	fprintf(stderr, "%s model: ", program_invocation_short_name);
	vfprintf(stderr, format, args);
	fputc('\n', stderr);
	va_end(args);
	abort();
}

/* ---- deterministic data ------------------------------------------------------ */

void rng_seed(struct rng *rng, uint64_t seed)
{
	/* splitmix64 of the seed: nearby seeds give unrelated streams. */
	uint64_t z = seed + 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	rng->state = (z ^ (z >> 31)) | 1;
}

uint64_t rng_next(struct rng *rng)
{
	/* xorshift64*: fixed seeds, so a failure reproduces exactly. */
	rng->state ^= rng->state >> 12;
	rng->state ^= rng->state << 25;
	rng->state ^= rng->state >> 27;
	return rng->state * 0x2545f4914f6cdd1dull;
}

uint32_t rng_below(struct rng *rng, uint32_t bound)
{
	return (uint32_t)(rng_next(rng) % bound);
}

/* Irwin-Hall: the sum of four 16-bit uniforms, centred and scaled to unit
 * variance (tails end at 3.46). The suites make millions of these, and
 * Box-Muller's log and cos were a third of the crash tests' CPU time. */
double rng_normal(struct rng *rng)
{
	uint64_t bits = rng_next(rng);
	uint32_t sum = (uint32_t)(bits & 0xffff) + (uint32_t)(bits >> 16 & 0xffff) +
		       (uint32_t)(bits >> 32 & 0xffff) + (uint32_t)(bits >> 48);
	/* Each term is uniform on [0, 65535]: mean 2 * 65535 in all, variance
	 * 4 * (65536^2 - 1) / 12. */
	return ((double)sum - 131070.0) * (1.7320508075688772 / 65536.0);
}

/* ---- the model of a session ----------------------------------------------- */

void *allocate(size_t bytes)
{
	void *p = calloc(1, bytes ? bytes : 1);
	if (!p)
		model_abort("out of memory for %zu bytes", bytes);
	return p;
}

void model_init(struct model *model, const zc_session_config *config)
{
	memset(model, 0, sizeof(*model));
	model->layers = config->layers;
	model->batch = config->batch;
	model->kv_heads = config->kv_heads;
	model->head_dim_k = config->head_dim_k;
	model->head_dim_v = config->head_dim_v;
	model->max_tokens = config->max_tokens;
	model->codec = config->codec;
	model->per_call = config->policy == ZC_POLICY_PER_CALL;
	model->residual_threshold = config->residual_tokens ? config->residual_tokens :
							      MODEL_DEFAULT_RESIDUAL_TOKENS;
	model->residual_capacity = 2 * model->residual_threshold;
	if (model->residual_capacity > model->max_tokens)
		model->residual_capacity = model->max_tokens;
	model->layer = allocate(model->layers * sizeof(*model->layer));
	for (uint32_t i = 0; i < model->layers; i++) {
		struct model_layer *l = &model->layer[i];
		size_t rows = (size_t)model->batch * model->kv_heads * model->max_tokens;
		l->exact_keys = allocate(rows * model->head_dim_k * 2);
		l->exact_values = allocate(rows * model->head_dim_v * 2);
		l->keys = allocate(rows * model->head_dim_k * 2);
		l->values = allocate(rows * model->head_dim_v * 2);
	}
}

void model_fork(struct model *fork, const struct model *source, uint32_t tokens)
{
	*fork = *source;
	fork->layer = allocate(source->layers * sizeof(*fork->layer));
	size_t rows = (size_t)source->batch * source->kv_heads * source->max_tokens;
	for (uint32_t i = 0; i < source->layers; i++) {
		const struct model_layer *from = &source->layer[i];
		struct model_layer *to = &fork->layer[i];
		*to = *from;
		to->exact_keys = allocate(rows * source->head_dim_k * 2);
		to->exact_values = allocate(rows * source->head_dim_v * 2);
		to->keys = allocate(rows * source->head_dim_k * 2);
		to->values = allocate(rows * source->head_dim_v * 2);
		memcpy(to->exact_keys, from->exact_keys, rows * source->head_dim_k * 2);
		memcpy(to->exact_values, from->exact_values, rows * source->head_dim_v * 2);
		memcpy(to->keys, from->keys, rows * source->head_dim_k * 2);
		memcpy(to->values, from->values, rows * source->head_dim_v * 2);
		to->capacity = from->n_blocks ? from->n_blocks : 1;
		to->blocks = allocate(to->capacity * sizeof(*to->blocks));
		if (from->n_blocks)   /* an empty layer may have no array yet */
			memcpy(to->blocks, from->blocks, from->n_blocks * sizeof(*to->blocks));
		/* The fork's first `tokens` tokens are the source's, exactly as a
		 * trim to that length leaves them. */
		if (to->tokens > tokens)
			model_trim_layer(fork, i, to->tokens - tokens);
	}
}

void model_free(struct model *model)
{
	for (uint32_t i = 0; model->layer && i < model->layers; i++) {
		struct model_layer *l = &model->layer[i];
		free(l->exact_keys);
		free(l->exact_values);
		free(l->keys);
		free(l->values);
		free(l->blocks);
	}
	free(model->layer);
	memset(model, 0, sizeof(*model));
}

zc_strides model_strides(const struct model *model, uint32_t dim)
{
	return (zc_strides){ (size_t)model->kv_heads * model->max_tokens * dim,
			     (size_t)model->max_tokens * dim, dim };
}

/* Copies a contiguous [B][H][tokens][dim] block to rows [first, first +
 * tokens) of a view-layout buffer, or (gather) the other way. */
static void rows_scatter(const struct model *model, uint16_t *view, uint32_t first,
			 const uint16_t *block, uint32_t tokens, uint32_t dim)
{
	zc_strides s = model_strides(model, dim);
	size_t head_elements = (size_t)tokens * dim;
	for (uint32_t b = 0; b < model->batch; b++)
		for (uint32_t h = 0; h < model->kv_heads; h++)
			memcpy(view + b * s.batch + h * s.head + (size_t)first * dim,
			       block + ((size_t)b * model->kv_heads + h) * head_elements,
			       head_elements * 2);
}

static void rows_gather(const struct model *model, const uint16_t *view, uint32_t first,
			uint16_t *block, uint32_t tokens, uint32_t dim)
{
	zc_strides s = model_strides(model, dim);
	size_t head_elements = (size_t)tokens * dim;
	for (uint32_t b = 0; b < model->batch; b++)
		for (uint32_t h = 0; h < model->kv_heads; h++)
			memcpy(block + ((size_t)b * model->kv_heads + h) * head_elements,
			       view + b * s.batch + h * s.head + (size_t)first * dim,
			       head_elements * 2);
}

/* Compresses one tensor of a contiguous block with the codec and writes
 * its reconstruction at rows [first, first + tokens) of the expected view;
 * returns the block's byte count. */
static zc_byte_count model_codec_block(const struct model *model, zc_tensor tensor,
				       uint16_t *view, uint32_t first, const uint16_t *block,
				       uint32_t tokens)
{
	uint32_t dim = tensor == ZC_TENSOR_KEYS ? model->head_dim_k : model->head_dim_v;
	zc_block_shape shape = { model->batch, model->kv_heads, tokens, dim };
	zc_strides strides = model_strides(model, dim);
	zc_byte_count count;
	int rc = zc_block_count_bytes(&model->codec, tensor, &shape, &count);
	if (rc < 0)
		model_abort("zc_block_count_bytes: %s", zc_strerror(rc));
	uint8_t *compressed = allocate(count.compressed);
	int64_t written = zc_block_compress(&model->codec, tensor, &shape, block, compressed,
					    count.compressed);
	if (written != (int64_t)count.compressed)
		model_abort("zc_block_compress wrote %" PRId64 " bytes, the count says %" PRIu64,
			    written, count.compressed);
	rc = zc_block_reconstruct(&model->codec, tensor, &shape, compressed, count.compressed,
				  view + (size_t)first * dim, &strides);
	if (rc < 0)
		model_abort("zc_block_reconstruct: %s", zc_strerror(rc));
	free(compressed);
	return count;
}

static void model_append_block(struct model *model, uint32_t layer, uint32_t first,
			       const uint16_t *keys, const uint16_t *values, uint32_t tokens)
{
	struct model_layer *l = &model->layer[layer];
	struct model_block block = { .first_token = first, .tokens = tokens };

	block.key = model_codec_block(model, ZC_TENSOR_KEYS, l->keys, first, keys, tokens);
	block.value = model_codec_block(model, ZC_TENSOR_VALUES, l->values, first, values, tokens);
	if (l->n_blocks == l->capacity) {
		l->capacity = l->capacity ? 2 * l->capacity : 16;
		l->blocks = realloc(l->blocks, l->capacity * sizeof(*l->blocks));
		if (!l->blocks)
			model_abort("out of memory for the block list");
	}
	l->blocks[l->n_blocks++] = block;
}

void model_flush(struct model *model, uint32_t layer)
{
	struct model_layer *l = &model->layer[layer];
	uint32_t first = l->tokens - l->residual;
	size_t heads = (size_t)model->batch * model->kv_heads;

	if (l->residual == 0)
		return;
	uint16_t *keys = allocate(heads * l->residual * model->head_dim_k * 2);
	uint16_t *values = allocate(heads * l->residual * model->head_dim_v * 2);
	rows_gather(model, l->exact_keys, first, keys, l->residual, model->head_dim_k);
	rows_gather(model, l->exact_values, first, values, l->residual, model->head_dim_v);
	model_append_block(model, layer, first, keys, values, l->residual);
	l->blocks[l->n_blocks - 1].flushed = true;
	l->residual = 0;
	free(keys);
	free(values);
}

bool model_unpublish_last_flush(struct model *model, uint32_t layer)
{
	struct model_layer *l = &model->layer[layer];
	if (model->per_call || l->n_blocks == 0)
		return false;
	const struct model_block *b = &l->blocks[l->n_blocks - 1];
	if (!b->flushed || b->first_token + b->tokens != l->tokens - l->residual ||
	    l->residual + b->tokens > model->residual_capacity)
		return false;
	/* The view shows the exact rows again. */
	size_t heads = (size_t)model->batch * model->kv_heads;
	for (size_t h = 0; h < heads; h++) {
		size_t first = h * model->max_tokens + b->first_token;
		memcpy(l->keys + first * model->head_dim_k, l->exact_keys + first * model->head_dim_k,
		       (size_t)b->tokens * model->head_dim_k * 2);
		memcpy(l->values + first * model->head_dim_v,
		       l->exact_values + first * model->head_dim_v,
		       (size_t)b->tokens * model->head_dim_v * 2);
	}
	l->residual += b->tokens;
	l->n_blocks--;
	return true;
}

bool model_direct(const struct model *model, uint32_t tokens)
{
	return model->per_call || tokens >= model->residual_threshold;
}

/*
 * The daemon flushes a residual that cannot take the tokens first. In an
 * ordinary update that never happens (the residual stays below R and a
 * short update is shorter than R, so both fit in 2R, and max_tokens bounds
 * the rest); it does after a crash left a residual of R or more behind.
 */
void model_append_exact(struct model *model, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values)
{
	struct model_layer *l = &model->layer[layer];
	uint32_t first = l->tokens;

	if (l->residual + tokens > model->residual_capacity)
		model_flush(model, layer);
	rows_scatter(model, l->exact_keys, first, keys, tokens, model->head_dim_k);
	rows_scatter(model, l->exact_values, first, values, tokens, model->head_dim_v);
	rows_scatter(model, l->keys, first, keys, tokens, model->head_dim_k);
	rows_scatter(model, l->values, first, values, tokens, model->head_dim_v);
	l->tokens += tokens;
	l->residual += tokens;
}

int model_update(struct model *model, uint32_t layer, uint32_t tokens, const uint16_t *keys,
		 const uint16_t *values)
{
	if (layer >= model->layers || tokens == 0)
		return ZC_EINVALID;
	struct model_layer *l = &model->layer[layer];
	if ((uint64_t)l->tokens + tokens > model->max_tokens)
		return ZC_EEXHAUSTED;
	if (model_direct(model, tokens)) {
		uint32_t first = l->tokens;
		rows_scatter(model, l->exact_keys, first, keys, tokens, model->head_dim_k);
		rows_scatter(model, l->exact_values, first, values, tokens, model->head_dim_v);
		model_flush(model, layer);
		model_append_block(model, layer, first, keys, values, tokens);
		l->tokens += tokens;
		return 0;
	}
	model_append_exact(model, layer, tokens, keys, values);
	if (l->residual >= model->residual_threshold)
		model_flush(model, layer);
	return 0;
}

uint32_t model_trim_layer(struct model *model, uint32_t layer, uint32_t tokens)
{
	struct model_layer *l = &model->layer[layer];
	uint32_t cut = tokens < l->tokens ? tokens : l->tokens;
	uint32_t keep = l->tokens - cut;

	if (cut == 0)
		return 0;
	if (cut <= l->residual) {
		l->residual -= cut;
	} else {
		l->residual = 0;
		while (l->n_blocks > 0 && l->blocks[l->n_blocks - 1].first_token >= keep)
			l->n_blocks--;
	}
	l->tokens = keep;
	return cut;
}

uint32_t model_trim(struct model *model, uint32_t tokens)
{
	uint32_t most = 0;

	for (uint32_t i = 0; i < model->layers; i++) {
		uint32_t cut = model_trim_layer(model, i, tokens);
		if (cut > most)
			most = cut;
	}
	return most;
}

static void stats_ratios(zc_layer_stats *s)
{
	s->compression_ratio = s->compressed_key_bytes ?
				       (double)s->fp16_key_bytes / (double)s->compressed_key_bytes : 0.0;
	s->effective_avg_bits = s->fp16_key_bytes ?
					16.0 * (double)s->compressed_key_bytes / (double)s->fp16_key_bytes :
					0.0;
}

void model_layer_stats(const struct model *model, uint32_t layer, zc_layer_stats *out)
{
	const struct model_layer *l = &model->layer[layer];
	uint64_t heads = (uint64_t)model->batch * model->kv_heads;

	memset(out, 0, sizeof(*out));
	out->layer = layer;
	out->tokens = l->tokens;
	out->residual_tokens = l->residual;
	out->blocks = l->n_blocks;
	for (size_t i = 0; i < l->n_blocks; i++) {
		out->compressed_key_bytes += l->blocks[i].key.compressed;
		out->compressed_value_bytes += l->blocks[i].value.compressed;
		out->baseline_key_bytes += l->blocks[i].key.baseline;
		out->baseline_value_bytes += l->blocks[i].value.baseline;
	}
	if (l->residual > 0) {
		zc_block_shape key_shape = { model->batch, model->kv_heads, l->residual, model->head_dim_k };
		zc_block_shape value_shape = { model->batch, model->kv_heads, l->residual, model->head_dim_v };
		zc_byte_count key, value;
		if (zc_block_count_bytes(&model->codec, ZC_TENSOR_KEYS, &key_shape, &key) < 0 ||
		    zc_block_count_bytes(&model->codec, ZC_TENSOR_VALUES, &value_shape, &value) < 0)
			model_abort("zc_block_count_bytes failed for the residual");
		out->compressed_key_bytes += 2 * heads * l->residual * model->head_dim_k;
		out->compressed_value_bytes += 2 * heads * l->residual * model->head_dim_v;
		out->baseline_key_bytes += key.baseline;
		out->baseline_value_bytes += value.baseline;
	}
	out->fp16_key_bytes = 2 * heads * l->tokens * model->head_dim_k;
	out->fp16_value_bytes = 2 * heads * l->tokens * model->head_dim_v;
	stats_ratios(out);
}

void model_total_stats(const struct model *model, zc_layer_stats *out)
{
	memset(out, 0, sizeof(*out));
	for (uint32_t i = 0; i < model->layers; i++) {
		zc_layer_stats s;
		model_layer_stats(model, i, &s);
		out->tokens += s.tokens;
		out->residual_tokens += s.residual_tokens;
		out->blocks += s.blocks;
		out->compressed_key_bytes += s.compressed_key_bytes;
		out->compressed_value_bytes += s.compressed_value_bytes;
		out->baseline_key_bytes += s.baseline_key_bytes;
		out->baseline_value_bytes += s.baseline_value_bytes;
		out->fp16_key_bytes += s.fp16_key_bytes;
		out->fp16_value_bytes += s.fp16_value_bytes;
	}
	stats_ratios(out);
}

/* ---- comparing the daemon with the model ------------------------------------ */

/* Where token t of a layer lives in the model, for failure messages. */
static void token_origin(const struct model *model, uint32_t layer, uint32_t token, char *out,
			 size_t size)
{
	const struct model_layer *l = &model->layer[layer];
	if (token >= l->tokens - l->residual) {
		snprintf(out, size, "exact residual [%u, %u)", l->tokens - l->residual, l->tokens);
		return;
	}
	for (size_t i = 0; i < l->n_blocks; i++) {
		const struct model_block *b = &l->blocks[i];
		if (token >= b->first_token && token < b->first_token + b->tokens) {
			snprintf(out, size, "block %zu [%u, %u)", i, b->first_token,
				 b->first_token + b->tokens);
			return;
		}
	}
	snprintf(out, size, "no block");
}

static bool tensor_matches(const struct model *model, uint32_t layer, const char *tensor,
			   const uint16_t *view, const zc_strides *strides, const uint16_t *expected,
			   uint32_t dim, uint32_t tokens, char *why, size_t size)
{
	zc_strides s = model_strides(model, dim);
	size_t row_bytes = (size_t)tokens * dim * 2;

	for (uint32_t b = 0; b < model->batch; b++) {
		for (uint32_t h = 0; h < model->kv_heads; h++) {
			const uint16_t *got = view + b * strides->batch + h * strides->head;
			const uint16_t *want = expected + b * s.batch + h * s.head;
			if (memcmp(got, want, row_bytes) == 0)
				continue;
			for (uint32_t t = 0; t < tokens; t++) {
				for (uint32_t d = 0; d < dim; d++) {
					uint16_t g = got[t * strides->token + d], w = want[(size_t)t * dim + d];
					char origin[96];
					if (g == w)
						continue;
					token_origin(model, layer, t, origin, sizeof(origin));
					return fail_with(why, size,
							 "layer %u %s (batch %u, head %u, token %u, dim %u) of %u "
							 "tokens: view holds 0x%04x (%g), expected 0x%04x (%g) "
							 "[token in %s]",
							 layer, tensor, b, h, t, d, tokens, g,
							 (double)zc_fp16_to_float(g), w,
							 (double)zc_fp16_to_float(w), origin);
				}
			}
		}
	}
	return true;
}

bool view_matches(const struct model *model, uint32_t layer, const zc_view *view, char *why,
		  size_t size)
{
	const struct model_layer *l = &model->layer[layer];
	zc_strides ks = model_strides(model, model->head_dim_k);
	zc_strides vs = model_strides(model, model->head_dim_v);

	if (view->tokens != l->tokens)
		return fail_with(why, size, "layer %u view has %u tokens, expected %u", layer,
				 view->tokens, l->tokens);
	if (view->batch != model->batch || view->kv_heads != model->kv_heads ||
	    view->head_dim_k != model->head_dim_k || view->head_dim_v != model->head_dim_v ||
	    view->max_tokens != model->max_tokens)
		return fail_with(why, size,
				 "layer %u view shape %u/%u/%u/%u max %u, expected %u/%u/%u/%u max %u",
				 layer, view->batch, view->kv_heads, view->head_dim_k, view->head_dim_v,
				 view->max_tokens, model->batch, model->kv_heads, model->head_dim_k,
				 model->head_dim_v, model->max_tokens);
	if (view->key_strides.batch != ks.batch || view->key_strides.head != ks.head ||
	    view->key_strides.token != ks.token || view->value_strides.batch != vs.batch ||
	    view->value_strides.head != vs.head || view->value_strides.token != vs.token)
		return fail_with(why, size,
				 "layer %u view strides keys %zu/%zu/%zu values %zu/%zu/%zu, expected "
				 "%zu/%zu/%zu and %zu/%zu/%zu",
				 layer, view->key_strides.batch, view->key_strides.head,
				 view->key_strides.token, view->value_strides.batch,
				 view->value_strides.head, view->value_strides.token, ks.batch, ks.head,
				 ks.token, vs.batch, vs.head, vs.token);
	if (view->keys == NULL || view->values == NULL)
		return fail_with(why, size, "layer %u view without pointers", layer);
	return tensor_matches(model, layer, "keys", view->keys, &view->key_strides, l->keys,
			      model->head_dim_k, l->tokens, why, size) &&
	       tensor_matches(model, layer, "values", view->values, &view->value_strides, l->values,
			      model->head_dim_v, l->tokens, why, size);
}

bool stats_match(const char *what, const zc_layer_stats *got, const zc_layer_stats *want,
		 bool compare_layer, char *why, size_t size)
{
	const struct {
		const char *name;
		uint64_t got, want;
	} fields[] = {
		{ "layer", compare_layer ? got->layer : 0, compare_layer ? want->layer : 0 },
		{ "tokens", got->tokens, want->tokens },
		{ "residual_tokens", got->residual_tokens, want->residual_tokens },
		{ "blocks", got->blocks, want->blocks },
		{ "compressed_key_bytes", got->compressed_key_bytes, want->compressed_key_bytes },
		{ "compressed_value_bytes", got->compressed_value_bytes, want->compressed_value_bytes },
		{ "baseline_key_bytes", got->baseline_key_bytes, want->baseline_key_bytes },
		{ "baseline_value_bytes", got->baseline_value_bytes, want->baseline_value_bytes },
		{ "fp16_key_bytes", got->fp16_key_bytes, want->fp16_key_bytes },
		{ "fp16_value_bytes", got->fp16_value_bytes, want->fp16_value_bytes },
	};

	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
		if (fields[i].got != fields[i].want)
			return fail_with(why, size, "%s: %s is %" PRIu64 ", expected %" PRIu64, what,
					 fields[i].name, fields[i].got, fields[i].want);
	if (fabs(got->compression_ratio - want->compression_ratio) >
	    1e-9 * fmax(1.0, want->compression_ratio))
		return fail_with(why, size, "%s: compression_ratio is %.12g, expected %.12g", what,
				 got->compression_ratio, want->compression_ratio);
	if (fabs(got->effective_avg_bits - want->effective_avg_bits) >
	    1e-9 * fmax(1.0, want->effective_avg_bits))
		return fail_with(why, size, "%s: effective_avg_bits is %.12g, expected %.12g", what,
				 got->effective_avg_bits, want->effective_avg_bits);
	return true;
}

bool session_matches(zc_session *session, const struct model *model, char *why, size_t size)
{
	zc_layer_stats *layers = allocate(model->layers * sizeof(*layers));
	zc_layer_stats total, want;
	char what[64];
	bool ok = true;
	int rc;

	/* views = none: the layer as a client reconstructs it from its blocks
	 * and residual (client/reader.c), compared as a view would be. */
	bool none = zc_session_get_info(session)->views == ZC_VIEWS_NONE;
	for (uint32_t i = 0; ok && none && i < model->layers; i++) {
		size_t rows = (size_t)model->batch * model->kv_heads * model->max_tokens;
		zc_view view = { .batch = model->batch, .kv_heads = model->kv_heads,
				 .head_dim_k = model->head_dim_k, .head_dim_v = model->head_dim_v,
				 .max_tokens = model->max_tokens,
				 .key_strides = model_strides(model, model->head_dim_k),
				 .value_strides = model_strides(model, model->head_dim_v) };
		uint16_t *keys = allocate(rows * model->head_dim_k * 2);
		uint16_t *values = allocate(rows * model->head_dim_v * 2);
		rc = zc_layer_reconstruct(session, i, keys, &view.key_strides, values,
					  &view.value_strides, model->max_tokens, &view.tokens);
		view.keys = keys;
		view.values = values;
		if (rc < 0)
			ok = fail_with(why, size, "zc_layer_reconstruct(layer %u): %s (%s)", i,
				       zc_error_name(rc), zc_strerror(rc));
		else
			ok = view_matches(model, i, &view, why, size);
		free(keys);
		free(values);
	}
	for (uint32_t i = 0; ok && !none && i < model->layers; i++) {
		zc_view view;
		rc = zc_session_view(session, i, &view);
		if (rc < 0)
			ok = fail_with(why, size, "zc_session_view(layer %u): %s (%s)", i,
				       zc_error_name(rc), zc_strerror(rc));
		else
			ok = view_matches(model, i, &view, why, size);
	}
	if (ok) {
		rc = zc_session_stats(session, layers, model->layers, &total);
		if (rc < 0)
			ok = fail_with(why, size, "zc_session_stats: %s (%s)", zc_error_name(rc),
				       zc_strerror(rc));
	}
	for (uint32_t i = 0; ok && i < model->layers; i++) {
		model_layer_stats(model, i, &want);
		snprintf(what, sizeof(what), "session stats of layer %u", i);
		ok = stats_match(what, &layers[i], &want, true, why, size);
	}
	if (ok) {
		model_total_stats(model, &want);
		ok = stats_match("session total stats", &total, &want, false, why, size);
	}
	free(layers);
	return ok;
}

/* ---- blocks and checked updates -------------------------------------------- */

void block_make_shape(struct block *block, uint32_t heads, uint32_t head_dim_k,
		      uint32_t head_dim_v, uint32_t tokens, struct rng *rng)
{
	block->tokens = tokens;
	block->key_elements = (size_t)heads * tokens * head_dim_k;
	block->value_elements = (size_t)heads * tokens * head_dim_v;
	block->keys = allocate(block->key_elements * 2);
	block->values = allocate(block->value_elements * 2);
	for (size_t i = 0; i < block->key_elements; i++) {
		size_t d = i % head_dim_k;
		double x = rng_normal(rng) * (d % 16 == 3 ? 6.0 : 1.0);
		if (i / head_dim_k % 11 == 0)
			x *= 3.0;
		block->keys[i] = zc_float_to_fp16((float)x);
	}
	for (size_t i = 0; i < block->value_elements; i++)
		block->values[i] = zc_float_to_fp16((float)(0.5 * rng_normal(rng)));
}

void block_make(struct block *block, const struct model *model, uint32_t tokens,
		struct rng *rng)
{
	block_make_shape(block, model->batch * model->kv_heads, model->head_dim_k,
			 model->head_dim_v, tokens, rng);
}

void block_free(struct block *block)
{
	free(block->keys);
	free(block->values);
	memset(block, 0, sizeof(*block));
}

bool update_block_checked(zc_client *client, zc_session *session, struct model *model,
			  uint32_t layer, const struct block *block, zc_view *view_out,
			  zc_layer_stats *stats_out, char *why, size_t size)
{
	zc_view view;
	zc_layer_stats stats, want;
	int expected = model_update(model, layer, block->tokens, block->keys, block->values);
	int rc;

	memset(&view, 0, sizeof(view));
	memset(&stats, 0, sizeof(stats));
	rc = zc_update_and_fetch(session, layer, block->tokens, block->keys, block->values, &view,
				 &stats);
	if (rc != expected)
		return fail_with(why, size,
				 "update of layer %u with %u tokens returned %s (%d) '%s', expected %s",
				 layer, block->tokens, zc_error_name(rc), rc, zc_client_last_error(client),
				 zc_error_name(expected));
	if (rc < 0) {
		if (zc_client_last_error(client)[0] == '\0')
			return fail_with(why, size, "update of layer %u refused (%s) without a message",
					 layer, zc_error_name(rc));
		return session_matches(session, model, why, size);
	}
	if (view_out)
		*view_out = view;
	if (stats_out)
		*stats_out = stats;
	if (view.sequence % 2 != 0)
		return fail_with(why, size, "layer %u view sequence %" PRIu64 " is odd after a reply",
				 layer, view.sequence);
	if (zc_session_get_info(session)->views == ZC_VIEWS_NONE) {
		if (view.keys || view.values || view.tokens != model->layer[layer].tokens)
			return fail_with(why, size, "views = none, but the reply points at fp16 rows "
					 "or counts %u tokens, not %u", view.tokens,
					 model->layer[layer].tokens);
	} else if (!view_matches(model, layer, &view, why, size)) {
		return false;
	}
	model_layer_stats(model, layer, &want);
	return stats_match("stats returned by update_and_fetch", &stats, &want, true, why, size);
}

bool update_checked(zc_client *client, zc_session *session, struct model *model,
		    struct rng *rng, uint32_t layer, uint32_t tokens, char *why, size_t size)
{
	struct block block;
	bool ok;

	block_make(&block, model, tokens, rng);
	ok = update_block_checked(client, session, model, layer, &block, NULL, NULL, why, size);
	block_free(&block);
	return ok;
}

bool trim_checked(zc_client *client, zc_session *session, struct model *model, uint32_t tokens,
		  char *why, size_t size)
{
	uint32_t expected = model_trim(model, tokens), trimmed = UINT32_MAX;
	int rc = zc_session_trim(session, tokens, &trimmed);

	if (rc < 0)
		return fail_with(why, size, "trim of %u tokens failed: %s '%s'", tokens,
				 zc_error_name(rc), zc_client_last_error(client));
	if (trimmed != expected)
		return fail_with(why, size, "trim of %u tokens reports %u trimmed, expected %u", tokens,
				 trimmed, expected);
	return session_matches(session, model, why, size);
}

/* ---- the client in the test process ------------------------------------------ */

zc_client *connect_client(const struct daemon_harness *daemon)
{
	zc_client *client = NULL;
	int rc = zc_client_connect(daemon->socket_path, CLIENT_TIMEOUT_MS, &client);

	ck_assert_msg(rc == 0, "zc_client_connect(%s): %s (%d)", daemon->socket_path,
		      zc_strerror(rc), rc);
	return client;
}


zc_session *open_session(zc_client *client, const zc_session_config *config)
{
	zc_session *session = NULL;
	int rc = zc_session_open(client, config, &session);

	ck_assert_msg(rc == 0, "zc_session_open('%s'): %s (%d) '%s'", config->name ? config->name : "",
		      zc_strerror(rc), rc, zc_client_last_error(client));
	return session;
}

zc_session_config streaming_config(const char *name, uint32_t layers, uint32_t kv_heads,
				   uint32_t head_dim, uint32_t max_tokens, uint32_t residual_tokens)
{
	zc_session_config config;

	zc_session_config_default(&config);
	config.name = name;
	config.layers = layers;
	config.kv_heads = kv_heads;
	config.head_dim_k = config.head_dim_v = head_dim;
	config.max_tokens = max_tokens;
	config.residual_tokens = residual_tokens;
	return config;
}

void assert_refused(zc_client *client, int rc, int expected, const char *needle,
		    const char *what)
{
	const char *message = zc_client_last_error(client);

	ck_assert_msg(rc == expected, "%s: expected %s (%d), got %s (%d), message '%s'", what,
		      zc_error_name(expected), expected, zc_error_name(rc), rc, message);
	ck_assert_msg(message[0] != '\0', "%s: refused with %s but no message", what,
		      zc_error_name(rc));
	ck_assert_msg(strcasestr(message, needle) != NULL, "%s: message '%s' does not mention '%s'",
		      what, message, needle);
}

bool session_matches_after_crash(zc_session *session, const struct model *model,
				 uint32_t *unpublished, char *why, size_t size)
{
	/* Layers whose last block could be a flush not yet published. */
	uint32_t candidates[16];
	unsigned n = 0;
	for (uint32_t i = 0; i < model->layers && n < 16; i++) {
		struct model probe;
		model_fork(&probe, model, model->max_tokens);
		if (model_unpublish_last_flush(&probe, i))
			candidates[n++] = i;
		model_free(&probe);
	}
	if (unpublished)
		*unpublished = 0;
	if (session_matches(session, model, why, size))
		return true;
	for (unsigned mask = 1; mask < (1u << n); mask++) {
		struct model lazy;
		char inner[WHY_BYTES];
		model_fork(&lazy, model, model->max_tokens);
		for (unsigned k = 0; k < n; k++)
			if (mask & (1u << k))
				model_unpublish_last_flush(&lazy, candidates[k]);
		bool ok = session_matches(session, &lazy, inner, sizeof(inner));
		model_free(&lazy);
		if (ok && unpublished)
			for (unsigned k = 0; k < n; k++)
				if (mask & (1u << k))
					*unpublished |= 1u << candidates[k];
		if (ok)
			return true;
	}
	return false;  /* why holds the first model's mismatch */
}

bool daemon_sessions_match(zc_client *client, const zc_session_config *configs,
			   const struct model *models, const bool *exists, int n,
			   uint32_t *unpublished, char *why, size_t size)
{
	zc_session_info infos[64];
	size_t count = 0;
	int rc = zc_client_list_sessions(client, infos, 64, &count);
	if (rc < 0)
		return fail_with(why, size, "list: %s", zc_strerror(rc));
	for (int s = 0; s < n; s++) {
		zc_session_config config = configs[s];
		bool found = false;
		for (size_t i = 0; i < count && i < 64; i++)
			found |= strcmp(infos[i].name, config.name) == 0;
		if (found != exists[s])
			return fail_with(why, size, "session '%s' %s", config.name,
					 found ? "exists but should not" : "is missing");
		if (!found)
			continue;
		zc_session *session;
		config.attach = true;
		rc = zc_session_open(client, &config, &session);
		if (rc < 0)
			return fail_with(why, size, "attach '%s': %s: %s", config.name, zc_strerror(rc),
					 zc_client_last_error(client));
		char inner[WHY_BYTES];
		bool ok = session_matches_after_crash(session, &models[s],
						      unpublished ? &unpublished[s] : NULL, inner,
						      sizeof(inner));
		zc_session_release(session);
		if (!ok)
			return fail_with(why, size, "session '%s': %s", config.name, inner);
	}
	return true;
}

bool daemon_lost(int rc)
{
	return rc == ZC_EBROKEN || rc == ZC_EPROTOCOL || rc == -EPIPE || rc == -ECONNRESET ||
	       rc == -ENOTCONN || rc == -ETIMEDOUT || rc == ZC_ERESTARTED || rc == -ECONNREFUSED ||
	       rc == -ENOENT || (rc < 0 && rc > -200 && rc != -ENOMEM);
}

void service_start(struct service *service, const char *const *extra_args)
{
	daemon_start(&service->daemon, extra_args);
	service->client = connect_client(&service->daemon);
}

uint16_t service_start_metrics(struct service *service, const char *const *extra_args)
{
	char listen_at[32];
	const char *args[DAEMON_MAX_EXTRA_ARGS + 1];
	int n = 0;
	uint16_t port = free_tcp_port();
	snprintf(listen_at, sizeof(listen_at), "127.0.0.1:%u", port);
	for (; extra_args && extra_args[n]; n++) {
		ck_assert_int_lt(n, DAEMON_MAX_EXTRA_ARGS - 2);
		args[n] = extra_args[n];
	}
	args[n++] = "--metrics-listen";
	args[n++] = listen_at;
	args[n] = NULL;
	service_start(service, args);
	return port;
}

void service_stop(struct service *service)
{
	zc_client_close(service->client);
	service->client = NULL;
	daemon_stop(&service->daemon);
	daemon_cleanup(&service->daemon);
}

zc_session_config shaped_config(const char *name, uint32_t layers, uint32_t batch,
				uint32_t kv_heads, uint32_t head_dim_k, uint32_t head_dim_v,
				uint32_t max_tokens, zc_block_policy policy, uint32_t residual_tokens)
{
	zc_session_config config;

	zc_session_config_default(&config);
	config.name = name;
	config.layers = layers;
	config.batch = batch;
	config.kv_heads = kv_heads;
	config.head_dim_k = head_dim_k;
	config.head_dim_v = head_dim_v;
	config.max_tokens = max_tokens;
	config.policy = policy;
	config.residual_tokens = residual_tokens;
	return config;
}
