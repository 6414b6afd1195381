/*
 * The client-side reader (zipcache/reader.h) against a real daemon: for
 * every block of long mixed sessions the reconstruction in this process
 * is bit-identical to the daemon's fp16 view and to tests/layer_model.c;
 * reads racing a writer accept only whole states (each identified by its
 * sequence and checked against a replay of the writer's operations); a
 * view dropped under a read is reported, never read as zeros; and forged
 * maps (a copy of a real one, with one field wrong) are refused with
 * ZC_EPROTOCOL and never yield a pointer out of bounds.
 */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../client/map_reader.h"
#include "daemon_harness.h"
#include "layer_model.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/reader.h"

#define TEST_TIMEOUT_SECONDS 120

/* ---- comparing reconstructions ---------------------------------------------- */

/* The first row of head (b, h) of a strided buffer that differs from
 * another's over rows [0, rows), as a sentence; true when none does. */
static bool rows_equal(const char *what, const struct model *model, const uint16_t *got,
		       const zc_strides *gs, const uint16_t *want, const zc_strides *ws,
		       uint32_t rows, uint32_t dim, uint32_t first_token, char *why, size_t size)
{
	for (uint32_t b = 0; b < model->batch; b++)
		for (uint32_t h = 0; h < model->kv_heads; h++)
			for (uint32_t t = 0; t < rows; t++) {
				const uint16_t *g = got + b * gs->batch + h * gs->head + t * gs->token;
				const uint16_t *w = want + b * ws->batch + h * ws->head + t * ws->token;
				if (memcmp(g, w, (size_t)dim * 2) == 0)
					continue;
				for (uint32_t d = 0; d < dim; d++)
					if (g[d] != w[d])
						return fail_with(why, size,
								 "%s: batch %u head %u token %u dim %u holds "
								 "0x%04x, expected 0x%04x",
								 what, b, h, first_token + t, d, g[d], w[d]);
			}
	return true;
}

/*
 * Everything the reader shows of one layer, with no writer running:
 * zc_layer_reconstruct equals the view and the model; each block, read and
 * reconstructed on its own, equals the view's rows it covers, and its
 * entry the model's block; the residual rows are the exact tokens sent.
 */
static bool reader_matches(zc_session *session, const struct model *model, uint32_t layer,
			   char *why, size_t size)
{
	const struct model_layer *l = &model->layer[layer];
	zc_strides ks = model_strides(model, model->head_dim_k);
	zc_strides vs = model_strides(model, model->head_dim_v);
	size_t rows = (size_t)model->batch * model->kv_heads * model->max_tokens;
	uint16_t *keys = allocate(rows * model->head_dim_k * 2);
	uint16_t *values = allocate(rows * model->head_dim_v * 2);
	size_t pool_bytes;
	const uint8_t *pool = zc_session_pool(session, &pool_bytes);
	uint32_t tokens = UINT32_MAX;
	zc_view view;
	zc_read read;
	zc_layer_contents layout;
	char what[96];
	bool ok = true;
	int rc;

	rc = zc_session_view(session, layer, &view);
	if (rc < 0)
		ok = fail_with(why, size, "zc_session_view(%u): %s", layer, zc_error_name(rc));
	if (ok)
		ok = view_matches(model, layer, &view, why, size);
	if (ok) {
		rc = zc_layer_reconstruct(session, layer, keys, &ks, values, &vs, model->max_tokens,
					  &tokens);
		if (rc < 0 || tokens != l->tokens)
			ok = fail_with(why, size, "zc_layer_reconstruct(%u): %s, %u tokens, expected %u",
				       layer, zc_error_name(rc), tokens, l->tokens);
	}
	if (ok) {
		snprintf(what, sizeof(what), "layer %u keys reconstructed vs the view", layer);
		ok = rows_equal(what, model, keys, &ks, view.keys, &view.key_strides, l->tokens,
				model->head_dim_k, 0, why, size);
	}
	if (ok) {
		snprintf(what, sizeof(what), "layer %u values reconstructed vs the view", layer);
		ok = rows_equal(what, model, values, &vs, view.values, &view.value_strides, l->tokens,
				model->head_dim_v, 0, why, size);
	}
	if (ok) {
		snprintf(what, sizeof(what), "layer %u keys reconstructed vs the model", layer);
		ok = rows_equal(what, model, keys, &ks, l->keys, &ks, l->tokens, model->head_dim_k, 0,
				why, size);
	}
	if (ok) {
		snprintf(what, sizeof(what), "layer %u values reconstructed vs the model", layer);
		ok = rows_equal(what, model, values, &vs, l->values, &vs, l->tokens, model->head_dim_v,
				0, why, size);
	}

	/* Block by block, inside one read. */
	if (ok && (rc = zc_read_begin(session, layer, 0, &read)) < 0)
		ok = fail_with(why, size, "zc_read_begin(%u): %s", layer, zc_error_name(rc));
	if (ok && (rc = zc_layer_layout(session, &read, &layout)) < 0)
		ok = fail_with(why, size, "zc_layer_layout(%u): %s", layer, zc_error_name(rc));
	if (ok && (layout.tokens != l->tokens || layout.residual_tokens != l->residual ||
		   layout.blocks != l->n_blocks || layout.views != ZC_VIEWS_FULL || !layout.view_valid ||
		   !read.view || read.sequence % 2 != 0))
		ok = fail_with(why, size,
			       "layer %u layout: %u tokens, %u residual, %u blocks, views %u valid %u "
			       "(read view %u, sequence %" PRIu64 "); model: %u, %u, %zu",
			       layer, layout.tokens, layout.residual_tokens, layout.blocks, layout.views,
			       layout.view_valid, read.view, read.sequence, l->tokens, l->residual,
			       l->n_blocks);
	for (uint32_t i = 0; ok && i < layout.blocks; i++) {
		const struct model_block *mb = &l->blocks[i];
		uint32_t end = i + 1 < l->n_blocks ? l->blocks[i + 1].first_token : l->tokens - l->residual;
		zc_block block;
		if ((rc = zc_layer_block(session, &read, i, &block)) < 0) {
			ok = fail_with(why, size, "zc_layer_block(%u, %u): %s", layer, i, zc_error_name(rc));
			break;
		}
		if (block.layer != layer || block.index != i || block.first_token != mb->first_token ||
		    block.tokens != mb->tokens || block.valid_tokens != end - mb->first_token ||
		    block.key_bytes != mb->key.compressed || block.value_bytes != mb->value.compressed ||
		    block.key_shape.tokens != mb->tokens || block.value_shape.head_dim != model->head_dim_v) {
			ok = fail_with(why, size,
				       "layer %u block %u: first %u tokens %u valid %u bytes %" PRIu64
				       "/%" PRIu64 "; model: first %u tokens %u valid %u bytes %" PRIu64
				       "/%" PRIu64,
				       layer, i, block.first_token, block.tokens, block.valid_tokens,
				       block.key_bytes, block.value_bytes, mb->first_token, mb->tokens,
				       end - mb->first_token, mb->key.compressed, mb->value.compressed);
			break;
		}
		if (block.key_payload != pool + block.key_offset ||
		    block.value_payload != pool + block.value_offset ||
		    block.key_offset + block.key_bytes > pool_bytes ||
		    block.value_offset + block.value_bytes > pool_bytes) {
			ok = fail_with(why, size, "layer %u block %u: payloads outside the pool", layer, i);
			break;
		}
		/* A packed [B][H][valid][D] target of its own: the rows must not
		 * depend on where they go. */
		size_t heads = (size_t)model->batch * model->kv_heads;
		zc_strides bks = { (size_t)model->kv_heads * block.valid_tokens * model->head_dim_k,
				   (size_t)block.valid_tokens * model->head_dim_k, model->head_dim_k };
		zc_strides bvs = { (size_t)model->kv_heads * block.valid_tokens * model->head_dim_v,
				   (size_t)block.valid_tokens * model->head_dim_v, model->head_dim_v };
		uint16_t *bk = allocate(heads * block.valid_tokens * model->head_dim_k * 2);
		uint16_t *bv = allocate(heads * block.valid_tokens * model->head_dim_v * 2);
		rc = zc_block_reconstruct_rows(session, &block, bk, &bks, bv, &bvs);
		if (rc < 0)
			ok = fail_with(why, size, "zc_block_reconstruct_rows(%u, %u): %s", layer, i,
				       zc_error_name(rc));
		if (ok) {
			snprintf(what, sizeof(what), "layer %u block %u keys vs the view", layer, i);
			ok = rows_equal(what, model, bk, &bks, view.keys + (size_t)block.first_token * ks.token,
					&view.key_strides, block.valid_tokens, model->head_dim_k,
					block.first_token, why, size);
		}
		if (ok) {
			snprintf(what, sizeof(what), "layer %u block %u values vs the view", layer, i);
			ok = rows_equal(what, model, bv, &bvs,
					view.values + (size_t)block.first_token * vs.token,
					&view.value_strides, block.valid_tokens, model->head_dim_v,
					block.first_token, why, size);
		}
		free(bk);
		free(bv);
	}
	if (ok && l->residual > 0) {
		uint32_t first = l->tokens - l->residual;
		snprintf(what, sizeof(what), "layer %u residual keys vs the tokens sent", layer);
		ok = rows_equal(what, model, layout.residual_keys, &layout.key_strides,
				l->exact_keys + (size_t)first * ks.token, &ks, l->residual,
				model->head_dim_k, first, why, size);
		if (ok) {
			snprintf(what, sizeof(what), "layer %u residual values vs the tokens sent", layer);
			ok = rows_equal(what, model, layout.residual_values, &layout.value_strides,
					l->exact_values + (size_t)first * vs.token, &vs, l->residual,
					model->head_dim_v, first, why, size);
		}
	}
	if (ok && (rc = zc_read_end(session, &read)) != 0)
		ok = fail_with(why, size, "zc_read_end(%u) with no writer: %s", layer, zc_error_name(rc));
	free(keys);
	free(values);
	return ok;
}

static bool session_reader_matches(zc_session *session, const struct model *model, char *why,
				   size_t size)
{
	for (uint32_t i = 0; i < model->layers; i++)
		if (!reader_matches(session, model, i, why, size))
			return false;
	return true;
}

/* One checked update, then the reader on that layer. */
static void step(struct service *service, zc_session *session, struct model *model,
		 struct rng *rng, uint32_t layer, uint32_t tokens)
{
	CHECK(update_checked, service->client, session, model, rng, layer, tokens);
	CHECK(reader_matches, session, model, layer);
}

static void trim_layer_checked(struct service *service, zc_session *session, struct model *model,
			       uint32_t layer, uint32_t tokens)
{
	uint32_t expected = model_trim_layer(model, layer, tokens), trimmed = UINT32_MAX;
	int rc = zc_session_trim_layer(session, layer, tokens, &trimmed);
	ck_assert_msg(rc == 0 && trimmed == expected, "trim_layer(%u, %u): %s, %u trimmed, expected %u",
		      layer, tokens, zc_error_name(rc), trimmed, expected);
	CHECK(session_reader_matches, session, model);
}

/* ---- 1. bit identity over long mixed sessions --------------------------------- */

START_TEST(long_mixed_session_reconstructs_bit_identical)
{
	struct service service;
	zc_session_config config = shaped_config("mixed", 2, 2, 2, 64, 32, 2048,
						 ZC_POLICY_STREAMING, 16);
	struct model model;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 101);
	CHECK(session_reader_matches, session, &model);   /* empty layers */

	/* Prefill blocks of several sizes (16 = R goes straight to a block). */
	static const uint32_t prefill[] = { 200, 37, 16, 5, 64 };
	for (size_t i = 0; i < sizeof(prefill) / sizeof(prefill[0]); i++)
		for (uint32_t layer = 0; layer < 2; layer++)
			step(&service, session, &model, &rng, layer, prefill[i]);
	/* Hundreds of decode steps: the residual fills and flushes every 16. */
	for (int s = 0; s < 300; s++)
		step(&service, session, &model, &rng, (uint32_t)s % 2, 1 + (s % 7 == 0));
	/* Trims through the residual, then through a block (it stays whole,
	 * its tail cut), then decode and a block right after the cut one. */
	CHECK(trim_checked, service.client, session, &model, 3);
	CHECK(session_reader_matches, session, &model);
	CHECK(trim_checked, service.client, session, &model, 45);
	CHECK(session_reader_matches, session, &model);
	trim_layer_checked(&service, session, &model, 1, 70);
	for (int s = 0; s < 60; s++)
		step(&service, session, &model, &rng, (uint32_t)s % 2, 1 + (s % 5 == 0) * 2);
	for (uint32_t layer = 0; layer < 2; layer++)
		step(&service, session, &model, &rng, layer, 40);
	trim_layer_checked(&service, session, &model, 0, 30);
	step(&service, session, &model, &rng, 0, 50);
	for (int s = 0; s < 40; s++)
		step(&service, session, &model, &rng, (uint32_t)s % 2, 1);
	CHECK(session_matches, session, &model);
	CHECK(session_reader_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(per_call_and_codec_variants_reconstruct_bit_identical)
{
	struct service service;
	zc_session_config per_call = shaped_config("per-call", 1, 1, 3, 32, 48, 1024,
						   ZC_POLICY_PER_CALL, 0);
	zc_session_config exact = shaped_config("exact-values", 1, 2, 1, 16, 16, 1024,
						ZC_POLICY_STREAMING, 8);
	struct model models[2];
	zc_session *sessions[2];
	struct rng rng;

	per_call.codec.group_size = 7;
	per_call.codec.hi_fraction = 0.33;
	per_call.codec.lo_bits = 3;
	exact.codec.quantize_values = false;
	service_start(&service, NULL);
	sessions[0] = open_session(service.client, &per_call);
	sessions[1] = open_session(service.client, &exact);
	model_init(&models[0], &per_call);
	model_init(&models[1], &exact);
	rng_seed(&rng, 202);
	for (int m = 0; m < 2; m++) {
		static const uint32_t sizes[] = { 33, 1, 2, 100, 1, 1, 9, 3, 1, 17 };
		for (int round = 0; round < 4; round++)
			for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
				step(&service, sessions[m], &models[m], &rng, 0, sizes[i]);
		CHECK(trim_checked, service.client, sessions[m], &models[m], 60);
		CHECK(session_reader_matches, sessions[m], &models[m]);
		step(&service, sessions[m], &models[m], &rng, 0, 4);
		step(&service, sessions[m], &models[m], &rng, 0, 12);
	}
	for (int m = 0; m < 2; m++) {
		ck_assert_int_eq(zc_session_close(sessions[m]), 0);
		model_free(&models[m]);
	}
	service_stop(&service);
}
END_TEST

/* ---- 2. reads racing a writer ------------------------------------------------- */

#define RACE_OPS 300
#define RACE_PREFILL 2000

/* FNV-1a over rows [0, tokens) of every head of a [B][H][max_tokens][D] buffer. */
static uint64_t rows_hash(const struct model *model, const uint16_t *buffer, uint32_t dim,
			  uint32_t tokens)
{
	zc_strides s = model_strides(model, dim);
	uint64_t hash = 0xcbf29ce484222325ull;
	for (uint32_t b = 0; b < model->batch; b++)
		for (uint32_t h = 0; h < model->kv_heads; h++) {
			const uint8_t *p = (const uint8_t *)(buffer + b * s.batch + h * s.head);
			for (size_t i = 0; i < (size_t)tokens * dim * 2; i++)
				hash = (hash ^ p[i]) * 0x100000001b3ull;
		}
	return hash;
}

struct race_state {
	uint64_t tokens;          /* 64 bits: no padding for memcmp to see */
	uint64_t key_hash, value_hash;
};

/* Operation k of the writer, decided from the layer's tokens alone so the
 * replay makes the same choices: a trim (> 0), or an update of `tokens`. */
struct race_op {
	uint32_t trim, tokens;
};

static struct race_op race_op_next(struct rng *rng, uint32_t held, uint32_t max_tokens)
{
	/* Trims and short updates mostly: each rewrites the layer's last rows,
	 * which a reader copies last, so a read a write overlaps sees rows of
	 * two states unless the protocol stops it. */
	uint32_t kind = rng_below(rng, 10);
	if ((kind < 4 && held > 1) || held + 64 > max_tokens)
		return (struct race_op){ .trim = 1 + rng_below(rng, held - 1 < 8 ? held - 1 : 8) };
	if (kind == 4)
		return (struct race_op){ .tokens = 20 + rng_below(rng, 30) };
	return (struct race_op){ .tokens = 1 + rng_below(rng, 8) };
}

static void race_block(const struct model *model, int k, uint32_t tokens, struct block *block)
{
	struct rng rng;
	rng_seed(&rng, 5000 + (uint64_t)k);
	block_make(block, model, tokens, &rng);
}

struct race_writer {
	const char *socket_path;
	zc_session_config config;
	const struct model *shape;   /* geometry only, read-only */
	int rc;                      /* 0, or the first failure */
	int failed_op;
	bool done;
};

static void *race_writer_main(void *arg)
{
	struct race_writer *w = arg;
	zc_client *client = NULL;
	zc_session *session = NULL;
	struct rng rng;
	uint32_t held = RACE_PREFILL;

	w->rc = zc_client_connect(w->socket_path, CLIENT_TIMEOUT_MS, &client);
	if (w->rc == 0) {
		w->config.attach = true;
		w->rc = zc_session_open(client, &w->config, &session);
	}
	rng_seed(&rng, 77);
	for (int k = 0; w->rc == 0 && k < RACE_OPS; k++) {
		struct race_op op = race_op_next(&rng, held, w->config.max_tokens);
		if (op.trim) {
			uint32_t trimmed = 0;
			w->rc = zc_session_trim_layer(session, 0, op.trim, &trimmed);
			held -= trimmed;
		} else {
			struct block block;
			zc_view view;
			race_block(w->shape, k, op.tokens, &block);
			/* Stats asked for: the flush a step causes is part of its
			 * write, so each op is one write (deferred flushes are
			 * raced in tests/deferred_flush_test.c). */
			zc_layer_stats stats;
			w->rc = zc_update_and_fetch(session, 0, op.tokens, block.keys, block.values, &view,
						    &stats);
			held = view.tokens;
			block_free(&block);
		}
		if (w->rc < 0)
			w->failed_op = k;
	}
	if (session)
		zc_session_release(session);
	if (client)
		zc_client_close(client);
	__atomic_store_n(&w->done, true, __ATOMIC_RELEASE);
	return NULL;
}

struct race_record {
	uint64_t sequence;   /* UINT64_MAX: from zc_layer_reconstruct, sequence unknown */
	struct race_state state;
};

/* One read by hand, with the primitives: 0 and the record, or the code
 * of zc_read_end (or of a call inside the read that failed). */
static int race_read(zc_session *session, const struct model *model, uint16_t *keys,
		     uint16_t *values, struct race_record *record, int *retries)
{
	zc_strides ks = model_strides(model, model->head_dim_k);
	zc_strides vs = model_strides(model, model->head_dim_v);
	for (;;) {
		zc_read read;
		zc_layer_contents layout;
		int rc = zc_read_begin(session, 0, 0, &read);
		if (rc < 0)
			return rc;
		rc = zc_layer_layout(session, &read, &layout);
		for (uint32_t i = 0; rc == 0 && i < layout.blocks; i++) {
			zc_block block;
			rc = zc_layer_block(session, &read, i, &block);
			if (rc == 0)
				rc = zc_block_reconstruct_rows(session, &block,
							       keys + (size_t)block.first_token * ks.token, &ks,
							       values + (size_t)block.first_token * vs.token,
							       &vs);
		}
		if (rc == 0) {
			uint32_t first = layout.tokens - layout.residual_tokens;
			for (uint32_t b = 0; b < model->batch; b++)
				for (uint32_t h = 0; h < model->kv_heads; h++)
					for (uint32_t r = 0; r < layout.residual_tokens; r++) {
						memcpy(keys + b * ks.batch + h * ks.head + (first + r) * ks.token,
						       layout.residual_keys + b * layout.key_strides.batch +
							       h * layout.key_strides.head +
							       r * layout.key_strides.token,
						       (size_t)model->head_dim_k * 2);
						memcpy(values + b * vs.batch + h * vs.head + (first + r) * vs.token,
						       layout.residual_values + b * layout.value_strides.batch +
							       h * layout.value_strides.head +
							       r * layout.value_strides.token,
						       (size_t)model->head_dim_v * 2);
					}
		}
		int end = zc_read_end(session, &read);
		if (end == ZC_EAGAIN) {
			++*retries;
			continue;
		}
		if (end != 0)
			return end;
		if (rc < 0)
			return rc;
		*record = (struct race_record){
			read.sequence,
			{ layout.tokens, rows_hash(model, keys, model->head_dim_k, layout.tokens),
			  rows_hash(model, values, model->head_dim_v, layout.tokens) },
		};
		return 0;
	}
}

START_TEST(reads_racing_a_writer_accept_only_whole_states)
{
	struct service service;
	zc_session_config config = shaped_config("race", 1, 1, 2, 64, 64, 4096,
						 ZC_POLICY_STREAMING, 16);
	struct model model;
	struct rng rng;
	size_t rows;
	struct race_record *records = NULL;
	size_t n_records = 0, capacity = 0;
	int retries = 0;
	pthread_t thread;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 303);
	/* A long layer, so a read takes long enough for writes to land in it. */
	step(&service, session, &model, &rng, 0, RACE_PREFILL - 7);
	step(&service, session, &model, &rng, 0, 7);
	rows = (size_t)model.batch * model.kv_heads * model.max_tokens;
	uint16_t *keys = allocate(rows * model.head_dim_k * 2);
	uint16_t *values = allocate(rows * model.head_dim_v * 2);
	struct race_record first;
	ck_assert_int_eq(race_read(session, &model, keys, values, &first, &retries), 0);
	uint64_t s0 = first.sequence;

	struct race_writer writer = { service.daemon.socket_path, config, &model, 0, -1, false };
	ck_assert_int_eq(pthread_create(&thread, NULL, race_writer_main, &writer), 0);
	for (unsigned n = 0;; n++) {
		bool last = __atomic_load_n(&writer.done, __ATOMIC_ACQUIRE);
		struct race_record record;
		if (n_records == capacity) {
			capacity = capacity ? 2 * capacity : 256;
			records = realloc(records, capacity * sizeof(*records));
			ck_assert_ptr_nonnull(records);
		}
		if (n % 3 == 2) {
			/* The convenience call: its state is one of those with its tokens. */
			zc_strides ks = model_strides(&model, model.head_dim_k);
			zc_strides vs = model_strides(&model, model.head_dim_v);
			uint32_t tokens = 0;
			int rc = zc_layer_reconstruct(session, 0, keys, &ks, values, &vs, model.max_tokens,
						      &tokens);
			ck_assert_msg(rc == 0, "zc_layer_reconstruct during writes: %s", zc_error_name(rc));
			record = (struct race_record){ UINT64_MAX,
						       { tokens, rows_hash(&model, keys, model.head_dim_k, tokens),
							 rows_hash(&model, values, model.head_dim_v, tokens) } };
		} else {
			int rc = race_read(session, &model, keys, values, &record, &retries);
			ck_assert_msg(rc == 0, "read during writes: %s", zc_error_name(rc));
		}
		records[n_records++] = record;
		if (last)
			break;
	}
	ck_assert_int_eq(pthread_join(thread, NULL), 0);
	ck_assert_msg(writer.rc == 0, "writer op %d: %s", writer.failed_op, zc_error_name(writer.rc));

	/* Replay the writer: state k is the layer after its k-th operation. */
	struct race_state *states = allocate((RACE_OPS + 1) * sizeof(*states));
	struct model_layer *l = &model.layer[0];
	rng_seed(&rng, 77);
	for (int k = 0; k <= RACE_OPS; k++) {
		states[k] = (struct race_state){ l->tokens,
						 rows_hash(&model, l->keys, model.head_dim_k, l->tokens),
						 rows_hash(&model, l->values, model.head_dim_v, l->tokens) };
		if (k == RACE_OPS)
			break;
		struct race_op op = race_op_next(&rng, l->tokens, model.max_tokens);
		if (op.trim) {
			ck_assert_uint_eq(model_trim_layer(&model, 0, op.trim), op.trim);
		} else {
			struct block block;
			race_block(&model, k, op.tokens, &block);
			ck_assert_int_eq(model_update(&model, 0, op.tokens, block.keys, block.values), 0);
			block_free(&block);
		}
	}
	ck_assert_msg(first.state.tokens == states[0].tokens &&
			      first.state.key_hash == states[0].key_hash,
		      "the read before the writer is not the prefill");
	/* Each operation is one write of the layer (its sequence moves by 2),
	 * so a sequence names the state a read saw. */
	struct race_record last;
	ck_assert_int_eq(race_read(session, &model, keys, values, &last, &retries), 0);
	ck_assert_msg(last.sequence == s0 + 2 * RACE_OPS, "final sequence %" PRIu64 ", expected %" PRIu64,
		      last.sequence, s0 + 2 * RACE_OPS);
	ck_assert_msg(memcmp(&last.state, &states[RACE_OPS], sizeof(last.state)) == 0,
		      "the final read is not the writer's last state");
	for (size_t i = 0; i < n_records; i++) {
		const struct race_record *r = &records[i];
		if (r->sequence == UINT64_MAX) {
			bool found = false;
			for (int k = 0; k <= RACE_OPS && !found; k++)
				found = memcmp(&states[k], &r->state, sizeof(r->state)) == 0;
			ck_assert_msg(found, "read %zu (zc_layer_reconstruct, %u tokens) is no state the "
				      "writer made", i, (unsigned)r->state.tokens);
			continue;
		}
		ck_assert_msg(r->sequence >= s0 && (r->sequence - s0) % 2 == 0 &&
				      (r->sequence - s0) / 2 <= RACE_OPS,
			      "read %zu: sequence %" PRIu64 " (start %" PRIu64 ")", i, r->sequence, s0);
		const struct race_state *want = &states[(r->sequence - s0) / 2];
		ck_assert_msg(memcmp(want, &r->state, sizeof(*want)) == 0,
			      "read %zu at sequence %" PRIu64 ": %u tokens, hashes %016" PRIx64 "/%016" PRIx64
			      "; the state there: %u tokens, %016" PRIx64 "/%016" PRIx64,
			      i, r->sequence, (unsigned)r->state.tokens, r->state.key_hash,
			      r->state.value_hash, (unsigned)want->tokens, want->key_hash, want->value_hash);
	}
	CHECK(session_reader_matches, session, &model);
	free(states);
	free(records);
	free(keys);
	free(values);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ---- 3. a view dropped under a reader --------------------------------------- */

START_TEST(dropped_view_is_reported_not_read_as_zeros)
{
	static const char *const args[] = { "--memory-budget", "24M", NULL };
	struct service service;
	zc_session_config cold_config = shaped_config("cold", 2, 1, 4, 128, 128, 4096,
						      ZC_POLICY_STREAMING, 16);
	zc_session_config hot_config = shaped_config("hot", 1, 1, 4, 128, 128, 8192,
						     ZC_POLICY_STREAMING, 16);
	struct model cold_model, hot_model;
	struct rng rng;
	zc_read held, later;
	zc_layer_contents layout;
	int end = 0;

	service_start(&service, args);
	zc_session *cold = open_session(service.client, &cold_config);
	model_init(&cold_model, &cold_config);
	rng_seed(&rng, 404);
	/* Layer 0 ends in residual rows (only the view holds them, views =
	 * full); layer 1 is whole blocks. */
	step(&service, cold, &cold_model, &rng, 0, 600);
	step(&service, cold, &cold_model, &rng, 0, 10);
	step(&service, cold, &cold_model, &rng, 1, 600);
	step(&service, cold, &cold_model, &rng, 1, 32);
	ck_assert_uint_eq(cold_model.layer[1].residual, 0);

	ck_assert_int_eq(zc_read_begin(cold, 0, 0, &held), 0);
	ck_assert_uint_eq(held.view, 1);
	/* Against the rules: the read goes on after the lease was given up. */
	ck_assert_int_eq(zc_session_release_views(cold), 0);
	/* Another session grows until the budget makes the daemon drop the
	 * idle one's views; the read held across it must say so. */
	zc_session *hot = open_session(service.client, &hot_config);
	model_init(&hot_model, &hot_config);
	for (int s = 0; s < 30 && end == 0; s++) {
		CHECK(update_checked, service.client, hot, &hot_model, &rng, 0, 256);
		end = zc_read_end(cold, &held);
	}
	ck_assert_msg(end == ZC_ESTALE, "a read across a view drop ended with %s", zc_error_name(end));

	/* A new read knows the view is gone: the residual rows are refused... */
	ck_assert_int_eq(zc_read_begin(cold, 0, 0, &later), 0);
	ck_assert_uint_eq(later.view_valid, 0);
	ck_assert_uint_eq(later.view, 0);
	ck_assert_int_eq(zc_layer_layout(cold, &later, &layout), ZC_ESTALE);
	ck_assert_int_eq(zc_read_end(cold, &later), 0);
	uint32_t tokens = 0;
	size_t rows = (size_t)cold_model.kv_heads * cold_model.max_tokens;
	zc_strides s = model_strides(&cold_model, cold_model.head_dim_k);
	uint16_t *keys = allocate(rows * cold_model.head_dim_k * 2);
	uint16_t *values = allocate(rows * cold_model.head_dim_v * 2);
	ck_assert_int_eq(zc_layer_reconstruct(cold, 0, keys, &s, values, &s, cold_model.max_tokens,
					      &tokens), ZC_ESTALE);
	/* ...while a layer of whole blocks reconstructs from the pool alone,
	 * bit for bit, with its view still dropped. */
	ck_assert_int_eq(zc_read_begin(cold, 1, 0, &later), 0);
	ck_assert_uint_eq(later.view_valid, 0);
	ck_assert_int_eq(zc_layer_reconstruct(cold, 1, keys, &s, values, &s, cold_model.max_tokens,
					      &tokens), 0);
	ck_assert_uint_eq(tokens, cold_model.layer[1].tokens);
	CHECK(rows_equal, "layer 1 keys from the pool", &cold_model, keys, &s,
	      cold_model.layer[1].keys, &s, tokens, cold_model.head_dim_k, 0);
	CHECK(rows_equal, "layer 1 values from the pool", &cold_model, values, &s,
	      cold_model.layer[1].values, &s, tokens, cold_model.head_dim_v, 0);

	/* zc_session_view brings the views back (a request; the hot session's
	 * lease given up so that its views make room), and with them the reader. */
	ck_assert_int_eq(zc_session_release_views(hot), 0);
	CHECK(session_matches, cold, &cold_model);
	CHECK(session_reader_matches, cold, &cold_model);
	free(keys);
	free(values);
	ck_assert_int_eq(zc_session_close(hot), 0);
	ck_assert_int_eq(zc_session_close(cold), 0);
	model_free(&hot_model);
	model_free(&cold_model);
	service_stop(&service);
}
END_TEST

/* ---- 4. forged maps ------------------------------------------------------------ */

/* A writable copy of a real session's map, over the real pool. */
struct forged {
	zc_map_header *map;
	struct map_reader reader;
	const zc_map_header *real;
};

static void forged_reset(struct forged *f)
{
	memcpy(f->map, f->real, f->real->map_bytes);
	f->reader.map = f->map;
	f->reader.map_bytes = f->real->map_bytes;
}

static zc_map_block *forged_table(struct forged *f, uint32_t layer)
{
	return (zc_map_block *)((uint8_t *)f->map + f->map->table_offset +
				(uint64_t)layer * f->map->table_bytes);
}

static bool blocks_equal(const zc_block *a, const zc_block *b, char *why, size_t size)
{
	if (a->layer != b->layer || a->index != b->index || a->first_token != b->first_token ||
	    a->tokens != b->tokens || a->valid_tokens != b->valid_tokens ||
	    memcmp(&a->key_shape, &b->key_shape, sizeof(a->key_shape)) != 0 ||
	    memcmp(&a->value_shape, &b->value_shape, sizeof(a->value_shape)) != 0 ||
	    a->key_payload != b->key_payload || a->value_payload != b->value_payload ||
	    a->key_bytes != b->key_bytes || a->value_bytes != b->value_bytes ||
	    a->key_offset != b->key_offset || a->value_offset != b->value_offset)
		return fail_with(why, size, "block %u of the copy differs from the session's", a->index);
	return true;
}

/* ZC_EPROTOCOL from zc_layer_block for every block of layer 0 that the
 * forgery touches, with the output untouched; begin must still work. */
static int forged_block(struct forged *f, uint32_t index, zc_block *out)
{
	zc_read read;
	int rc = map_read_begin(&f->reader, 0, 0, &read);
	if (rc < 0)
		return rc;
	memset(out, 0xa5, sizeof(*out));
	return map_layer_block(&f->reader, &read, index, out);
}

static bool untouched(const zc_block *block)
{
	const uint8_t *p = (const uint8_t *)block;
	for (size_t i = 0; i < sizeof(*block); i++)
		if (p[i] != 0xa5)
			return false;
	return true;
}

#define ASSERT_BLOCK_REFUSED(f, index, what)                                              \
	do {                                                                              \
		zc_block out_;                                                            \
		int rc_ = forged_block((f), (index), &out_);                              \
		ck_assert_msg(rc_ == ZC_EPROTOCOL, "%s: block %u gave %s", (what), (index), \
			      zc_error_name(rc_));                                        \
		ck_assert_msg(untouched(&out_), "%s: the refused block was written", (what)); \
		forged_reset(f);                                                          \
	} while (0)

#define ASSERT_BEGIN_REFUSED(f, what)                                                     \
	do {                                                                              \
		zc_read read_;                                                            \
		int rc_ = map_read_begin(&(f)->reader, 0, 0, &read_);                     \
		ck_assert_msg(rc_ == ZC_EPROTOCOL, "%s: begin gave %s", (what),           \
			      zc_error_name(rc_));                                        \
		forged_reset(f);                                                          \
	} while (0)

START_TEST(forged_maps_are_refused_never_followed)
{
	struct service service;
	zc_session_config config = shaped_config("forged", 2, 1, 2, 32, 16, 256, ZC_POLICY_STREAMING,
						 16);
	struct model model;
	struct rng rng;
	struct forged f;
	size_t pool_bytes;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 505);
	step(&service, session, &model, &rng, 0, 40);
	step(&service, session, &model, &rng, 0, 30);
	step(&service, session, &model, &rng, 0, 5);
	CHECK(trim_checked, service.client, session, &model, 8);   /* cuts block 1: 27 of 30 */
	step(&service, session, &model, &rng, 0, 20);              /* block 2 right after the cut */
	step(&service, session, &model, &rng, 0, 3);
	ck_assert_uint_eq(model.layer[0].n_blocks, 3);

	f.real = zc_session_map(session);
	f.map = aligned_alloc(4096, (f.real->map_bytes + 4095) / 4096 * 4096);
	ck_assert_ptr_nonnull(f.map);
	const uint8_t *pool = zc_session_pool(session, &pool_bytes);
	forged_reset(&f);
	f.reader.pool = pool;
	f.reader.pool_bytes = pool_bytes;

	/* The pristine copy reads as the session does. */
	zc_read read, real_read;
	zc_block mine, theirs;
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 0, &read), 0);
	ck_assert_int_eq(zc_read_begin(session, 0, 0, &real_read), 0);
	ck_assert_uint_eq(read.blocks, 3);
	for (uint32_t i = 0; i < 3; i++) {
		ck_assert_int_eq(map_layer_block(&f.reader, &read, i, &mine), 0);
		ck_assert_int_eq(zc_layer_block(session, &real_read, i, &theirs), 0);
		CHECK(blocks_equal, &mine, &theirs);
	}
	ck_assert_uint_eq(mine.first_token, 67);
	ck_assert_int_eq(map_layer_block(&f.reader, &read, 1, &mine), 0);
	ck_assert_uint_eq(mine.tokens, 30);
	ck_assert_uint_eq(mine.valid_tokens, 27);   /* the tiling decides, and the map agrees */
	ck_assert_uint_eq(forged_table(&f, 0)[1].valid_tokens, 27);

	/* Block entries. */
	zc_map_block *t = forged_table(&f, 0);
	t[0].key_offset = pool_bytes - 10;
	ASSERT_BLOCK_REFUSED(&f, 0, "K payload past the pool's end");
	t = forged_table(&f, 0);
	t[0].value_offset = UINT64_MAX - 5;
	ASSERT_BLOCK_REFUSED(&f, 0, "V offset that wraps");
	t = forged_table(&f, 0);
	t[1].key_offset = 0;
	ASSERT_BLOCK_REFUSED(&f, 1, "K payload over the pool header");
	t = forged_table(&f, 0);
	t[2].key_bytes += 1;
	ASSERT_BLOCK_REFUSED(&f, 2, "K size not the codec's");
	t = forged_table(&f, 0);
	t[2].value_bytes = 0;
	ASSERT_BLOCK_REFUSED(&f, 2, "V size 0");
	t = forged_table(&f, 0);
	t[0].tokens = 0;
	ASSERT_BLOCK_REFUSED(&f, 0, "a block of no tokens");
	t = forged_table(&f, 0);
	t[0].tokens += 1;
	ASSERT_BLOCK_REFUSED(&f, 0, "tokens the payload size cannot have");
	t = forged_table(&f, 0);
	t[0].first_token = 1;
	ASSERT_BLOCK_REFUSED(&f, 0, "a first block not at token 0");
	t = forged_table(&f, 0);
	t[1].first_token = 41;   /* block 0 would cover 41 rows of 40 */
	ASSERT_BLOCK_REFUSED(&f, 0, "a gap after block 0");
	t = forged_table(&f, 0);
	t[2].first_token = 30;   /* block 1 (at 40) would have none */
	ASSERT_BLOCK_REFUSED(&f, 1, "blocks out of order");
	t = forged_table(&f, 0);
	t[2].first_token = 87;   /* where the blocks end: block 2 would have no rows */
	ASSERT_BLOCK_REFUSED(&f, 1, "a next block with no valid row");
	t = forged_table(&f, 0);
	t[2].first_token = 87;
	ASSERT_BLOCK_REFUSED(&f, 2, "a block with no valid row");
	t = forged_table(&f, 0);
	t[0].flags = 1;
	ASSERT_BLOCK_REFUSED(&f, 0, "unknown flags");
	t = forged_table(&f, 0);
	t[1].valid_tokens = 26;   /* less than the 27 rows the tiling gives it */
	ASSERT_BLOCK_REFUSED(&f, 1, "valid_tokens below the tiling");
	t = forged_table(&f, 0);
	t[2].valid_tokens = t[2].tokens + 1;
	ASSERT_BLOCK_REFUSED(&f, 2, "valid_tokens past tokens");
	t = forged_table(&f, 0);
	t[2].first_token = 240;
	t[2].tokens = 20;   /* 260 > max_tokens 256 */
	ASSERT_BLOCK_REFUSED(&f, 2, "a block past max_tokens");

	/* The layer's counts, in the map and in a forged zc_read. */
	f.map->layer[0].blocks = (uint32_t)f.map->max_blocks + 1;
	ASSERT_BLOCK_REFUSED(&f, 0, "more blocks than the table holds");
	f.map->layer[0].residual_tokens = f.map->layer[0].tokens + 1;
	ASSERT_BLOCK_REFUSED(&f, 0, "more residual than tokens");
	f.map->layer[0].tokens = 257;
	ASSERT_BLOCK_REFUSED(&f, 0, "tokens past max_tokens");
	f.map->layer[0].residual_tokens = 0;   /* block 2 (20 rows at 67) would reach 90 */
	ASSERT_BLOCK_REFUSED(&f, 2, "the last block short of the residual");
	zc_read forged_read = read;
	zc_layer_contents contents;
	forged_read.blocks = 1000;
	ck_assert_int_eq(map_layer_layout(&f.reader, &forged_read, &contents), ZC_EPROTOCOL);
	forged_read = read;
	forged_read.tokens = 100000;
	ck_assert_int_eq(map_layer_block(&f.reader, &forged_read, 0, &mine), ZC_EPROTOCOL);
	forged_read = read;
	forged_read.layer = 2;
	ck_assert_int_eq(map_layer_layout(&f.reader, &forged_read, &contents), ZC_EINVALID);
	ck_assert_int_eq(map_layer_block(&f.reader, &read, 3, &mine), ZC_EINVALID);

	/* The header. */
	f.map->magic[0] = 'X';
	ASSERT_BEGIN_REFUSED(&f, "magic");
	f.map->version = 2;
	ASSERT_BEGIN_REFUSED(&f, "version");
	f.map->map_bytes += 4096;
	ASSERT_BEGIN_REFUSED(&f, "map_bytes not what is mapped");
	f.map->pool_bytes -= 4096;
	ASSERT_BEGIN_REFUSED(&f, "pool_bytes not what is mapped");
	f.map->table_offset = f.map->map_bytes;
	ASSERT_BEGIN_REFUSED(&f, "block tables past the map");
	f.map->table_bytes = 8;
	ASSERT_BEGIN_REFUSED(&f, "block tables smaller than max_blocks");
	f.map->key_view_bytes = 64;
	ASSERT_BEGIN_REFUSED(&f, "K views too small");
	f.map->view_layer_bytes *= 4;
	ASSERT_BEGIN_REFUSED(&f, "views past the map");
	f.map->views_offset = 0;
	ASSERT_BEGIN_REFUSED(&f, "views = full without views");
	f.map->views = ZC_VIEWS_NONE;
	ASSERT_BEGIN_REFUSED(&f, "views = none without a residual");
	f.map->views = 7;
	ASSERT_BEGIN_REFUSED(&f, "unknown views");
	f.map->hi_bits = 9;
	ASSERT_BEGIN_REFUSED(&f, "a codec config the codec refuses");
	f.map->head_dim_k = 0;
	ASSERT_BEGIN_REFUSED(&f, "head_dim_k 0");
	f.map->layers = 1u << 30;
	ASSERT_BEGIN_REFUSED(&f, "more layers than the header holds");
	f.map->max_blocks = 1000;
	ASSERT_BEGIN_REFUSED(&f, "more blocks than tokens");

	/* views = none from the header alone: a readers' residual region
	 * (made here out of the views' room) is where its rows come from. */
	f.map->views = ZC_VIEWS_NONE;
	f.map->residual_offset = f.map->views_offset;
	f.map->residual_bytes = f.map->view_layer_bytes;
	f.map->key_residual_bytes = f.map->key_view_bytes;
	f.map->residual_capacity = 32;
	f.map->views_offset = 0;
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 0, &read), 0);
	ck_assert_uint_eq(read.view, 0);
	ck_assert_int_eq(map_layer_layout(&f.reader, &read, &contents), 0);
	ck_assert_ptr_eq(contents.residual_keys, (const uint16_t *)((const uint8_t *)f.map +
								   f.map->residual_offset));
	ck_assert_uint_eq(contents.key_strides.head, 32 * 32);
	ck_assert_ptr_eq(contents.residual_values,
			 (const uint16_t *)((const uint8_t *)f.map + f.map->residual_offset +
					    f.map->key_residual_bytes));
	ck_assert_uint_eq(contents.value_strides.head, 32 * 16);
	f.map->layer[0].residual_tokens = 33;   /* past the residual's capacity */
	f.map->layer[0].tokens = 120;
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 0, &read), 0);
	ck_assert_int_eq(map_layer_layout(&f.reader, &read, &contents), ZC_EPROTOCOL);
	forged_reset(&f);

	/* The pool's header. */
	uint8_t *fake_pool = aligned_alloc(4096, 8192);
	memset(fake_pool, 0, 8192);
	f.map->pool_bytes = 8192;
	f.reader.pool = fake_pool;
	f.reader.pool_bytes = 8192;
	ASSERT_BEGIN_REFUSED(&f, "a pool without its magic");
	f.reader.pool = pool;
	f.reader.pool_bytes = pool_bytes;

	/* A sequence left odd (a daemon killed mid-write): bounded wait. */
	f.map->layer[0].sequence |= 1;
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 30, &read), -ETIMEDOUT);
	forged_reset(&f);
	ck_assert_int_eq(map_read_begin(&f.reader, 0, -1, &read), ZC_EINVALID);
	ck_assert_int_eq(map_read_begin(&f.reader, 2, 0, &read), ZC_EINVALID);

	/* The end of a read: unchanged, moved, moved across a view drop. */
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 0, &read), 0);
	ck_assert_uint_eq(read.view, 1);
	ck_assert_int_eq(map_read_end(&f.reader, &read), 0);
	f.map->layer[0].sequence += 2;
	ck_assert_int_eq(map_read_end(&f.reader, &read), ZC_EAGAIN);
	f.map->layer[0].sequence += 1;   /* a write in progress */
	ck_assert_int_eq(map_read_end(&f.reader, &read), ZC_EAGAIN);
	f.map->layer[0].generation += 1;
	ck_assert_int_eq(map_read_end(&f.reader, &read), ZC_ESTALE);
	f.map->layer[0].generation -= 1;
	f.map->layer[0].view_valid = 0;
	ck_assert_int_eq(map_read_end(&f.reader, &read), ZC_ESTALE);
	read.view = 0;   /* a read that never saw the view only needs a retry */
	ck_assert_int_eq(map_read_end(&f.reader, &read), ZC_EAGAIN);
	forged_reset(&f);

	/* A zc_block handed back forged. */
	ck_assert_int_eq(map_read_begin(&f.reader, 0, 0, &read), 0);
	ck_assert_int_eq(map_layer_block(&f.reader, &read, 0, &mine), 0);
	uint16_t *rows = allocate((size_t)2 * 40 * 32 * 2);
	zc_strides ks = { 2 * 40 * 32, 40 * 32, 32 };
	zc_block bad = mine;
	bad.key_payload = (const uint8_t *)rows;
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &bad, rows, &ks, NULL, NULL),
			 ZC_EINVALID);
	bad = mine;
	bad.key_payload = pool + pool_bytes - 8;
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &bad, rows, &ks, NULL, NULL),
			 ZC_EINVALID);
	bad = mine;
	bad.valid_tokens = 41;
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &bad, rows, &ks, NULL, NULL),
			 ZC_EINVALID);
	bad = mine;
	bad.key_shape.head_dim = 16;
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &bad, rows, &ks, NULL, NULL),
			 ZC_EINVALID);
	zc_strides narrow = { 2 * 40 * 32, 40 * 32, 31 };
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &mine, rows, &narrow, NULL, NULL),
			 ZC_EINVALID);
	ck_assert_int_eq(map_block_reconstruct_rows(&f.reader, &mine, rows, &ks, NULL, NULL), 0);

	/* Too small a target for the layer: ZC_EBUFFER, and how many it holds. */
	uint32_t tokens = 0;
	ck_assert_int_eq(zc_layer_reconstruct(session, 0, rows, &ks, NULL, NULL, 40, &tokens),
			 ZC_EBUFFER);
	ck_assert_uint_eq(tokens, model.layer[0].tokens);

	free(rows);
	free(fake_pool);
	free(f.map);
	CHECK(session_reader_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(struct_layouts_are_reported)
{
	ck_assert_uint_eq(zc_reader_layout_of("zc_block", NULL), sizeof(zc_block));
	ck_assert_uint_eq(zc_reader_layout_of("zc_read", "generation"), offsetof(zc_read, generation));
	ck_assert_uint_eq(zc_reader_layout_of("zc_map_header", "layer"),
			  offsetof(zc_map_header, layer));
	ck_assert_uint_eq(zc_reader_layout_of("zc_layer_contents", "value_strides"),
			  offsetof(zc_layer_contents, value_strides));
	ck_assert_uint_eq(zc_reader_layout_of("zc_block", "nothing"), SIZE_MAX);
	ck_assert_uint_eq(zc_reader_layout_of("zc_nothing", NULL), SIZE_MAX);
	ck_assert_uint_eq(zc_reader_layout_of(NULL, NULL), SIZE_MAX);
}
END_TEST

static Suite *reader_suite(void)
{
	Suite *suite = suite_create("reader");
	const struct test_case cases[] = {
		{ "bit_identity", { long_mixed_session_reconstructs_bit_identical,
				    per_call_and_codec_variants_reconstruct_bit_identical, NULL } },
		{ "consistency", { reads_racing_a_writer_accept_only_whole_states,
				   dropped_view_is_reported_not_read_as_zeros, NULL } },
		{ "bad_entries", { forged_maps_are_refused_never_followed, struct_layouts_are_reported,
				   NULL } },
	};

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(reader_suite(), CK_FORK);
}
