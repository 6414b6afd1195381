/*
 * zc_attend (zipcache/attend.h) against a real daemon: over long mixed
 * sessions (prefill blocks of several sizes, decode steps through residual
 * flushes, trims through the residual and through a block) the attention
 * a client computes from the session's compressed blocks and residual
 * equals, bit for bit, zc_attend_segments() over tests/layer_model.c's
 * reconstruction given as fp16 rows cut where the blocks are, for views =
 * none and views = full, and so does the same call over the fp16 view;
 * bad queries are refused and leave the output untouched; a dropped view
 * is reported (ZC_ESTALE), never read as zeros; a block at the very end
 * of the pool is attended from a private copy, with the same result; and
 * calls racing a writer give only the attention of whole states.
 */
#include <check.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../client/attend_session.h"
#include "daemon_harness.h"
#include "layer_model.h"
#include "suite_main.h"
#include "zipcache/attend.h"
#include "zipcache/client.h"
#include "zipcache/reader.h"

#define TEST_TIMEOUT_SECONDS 180
/* What the output is filled with before a call that must not touch it. */
#define UNTOUCHED 0xa5

static zc_session_config attend_config(const char *name, uint32_t batch, uint32_t kv_heads,
				       uint32_t head_dim_k, uint32_t head_dim_v,
				       uint32_t max_tokens, uint32_t residual_tokens, zc_views views)
{
	zc_session_config config = shaped_config(name, 2, batch, kv_heads, head_dim_k, head_dim_v,
						 max_tokens, ZC_POLICY_STREAMING, residual_tokens);
	config.views = views;
	return config;
}

/* ---- queries and the reference ---------------------------------------------- */

/* One query of the shapes the suite tries; data owned by the query. */
struct query {
	zc_attend_query q;
	float *data;
	size_t out_elements;
};

static void query_make(struct query *query, const struct model *model, uint32_t q_heads,
		       uint32_t n_q, bool causal, struct rng *rng)
{
	size_t n = (size_t)model->batch * q_heads * n_q * model->head_dim_k;
	query->data = allocate(n * sizeof(float));
	for (size_t i = 0; i < n; i++)
		query->data[i] = (float)rng_normal(rng);
	zc_attend_query_init(&query->q, model->batch, q_heads, n_q, model->head_dim_k, query->data);
	query->q.causal = causal;
	query->out_elements = (size_t)model->batch * q_heads * n_q * model->head_dim_v;
}

static zc_attend_segment model_rows(const struct model *model, const uint16_t *keys,
				    const uint16_t *values, uint32_t first, uint32_t tokens)
{
	zc_strides ks = model_strides(model, model->head_dim_k);
	zc_strides vs = model_strides(model, model->head_dim_v);
	return (zc_attend_segment){
		.kind = ZC_ATTEND_ROWS,
		.rows = { .batch = model->batch, .heads = model->kv_heads, .tokens = tokens,
			  .head_dim_k = model->head_dim_k, .head_dim_v = model->head_dim_v,
			  .keys = keys + (size_t)first * ks.token, .key_strides = ks,
			  .values = values + (size_t)first * vs.token, .value_strides = vs },
	};
}

/* The model's reconstruction of a layer as fp16 rows, one segment per
 * block (its valid rows) and one for the residual: the segments zc_attend
 * must give the same bytes as. */
static size_t model_segments(const struct model *model, uint32_t layer, zc_attend_segment *out)
{
	const struct model_layer *l = &model->layer[layer];
	uint32_t end = l->tokens - l->residual;
	size_t n = 0;

	for (size_t i = 0; i < l->n_blocks; i++) {
		uint32_t first = l->blocks[i].first_token;
		uint32_t next = i + 1 < l->n_blocks ? l->blocks[i + 1].first_token : end;
		out[n++] = model_rows(model, l->keys, l->values, first, next - first);
	}
	if (l->residual > 0 || n == 0)
		out[n++] = model_rows(model, l->keys, l->values, end, l->residual);
	return n;
}

static bool outputs_equal(const char *what, const float *got, const float *want, size_t n,
			  char *why, size_t size)
{
	for (size_t i = 0; i < n; i++)
		if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
			return fail_with(why, size, "%s: element %zu is %.9g, expected %.9g", what, i,
					 got[i], want[i]);
	return true;
}

/*
 * One layer, one query: zc_attend equals zc_attend_segments over the
 * model's rows cut at the blocks, bit for bit (with views = full, over the
 * view too), and is close to attention over the whole reconstruction as
 * one segment (other chunk boundaries: fp32 rounding apart).
 */
static bool attend_matches(zc_session *session, const struct model *model, uint32_t layer,
			   const struct query *query, unsigned threads, char *why, size_t size)
{
	const struct model_layer *l = &model->layer[layer];
	size_t n = query->out_elements, bytes = n * sizeof(float);
	float *got = allocate(bytes), *want = allocate(bytes), *whole = allocate(bytes);
	zc_attend_segment *segments = allocate((l->n_blocks + 1) * sizeof(*segments));
	size_t n_segments = model_segments(model, layer, segments);
	zc_attend_output out = { ZC_ATTEND_FP32, got, bytes, NULL };
	zc_attend_output ref = { ZC_ATTEND_FP32, want, bytes, NULL };
	zc_attend_output one = { ZC_ATTEND_FP32, whole, bytes, NULL };
	zc_attend_segment all = model_rows(model, l->keys, l->values, 0, l->tokens);
	char what[128];
	bool ok = true;
	int rc, want_rc;

	want_rc = zc_attend_segments(segments, n_segments, &query->q, &ref, 1);
	rc = zc_attend(session, layer, &query->q, &out, 0, threads);
	if (rc != want_rc)
		ok = fail_with(why, size, "layer %u (%u tokens, %zu blocks): zc_attend gave %s, the "
			       "model's rows %s", layer, l->tokens, l->n_blocks, zc_error_name(rc),
			       zc_error_name(want_rc));
	snprintf(what, sizeof(what), "layer %u (%u tokens, %zu blocks, %u residual) q_heads %u n_q %u%s",
		 layer, l->tokens, l->n_blocks, l->residual, query->q.q_heads, query->q.n_q,
		 query->q.causal ? " causal" : "");
	if (ok && rc == 0)
		ok = outputs_equal(what, got, want, n, why, size);
	if (ok && rc == 0 && zc_session_get_info(session)->views == ZC_VIEWS_FULL) {
		memset(got, UNTOUCHED, bytes);
		rc = zc_attend(session, layer, &query->q, &out, ZC_ATTEND_OVER_VIEW, threads);
		if (rc < 0)
			ok = fail_with(why, size, "%s: over the view: %s", what, zc_error_name(rc));
		if (ok) {
			char view_what[160];
			snprintf(view_what, sizeof(view_what), "%s, over the view", what);
			ok = outputs_equal(view_what, got, want, n, why, size);
		}
	}
	if (ok && rc == 0 && (rc = zc_attend_segments(&all, 1, &query->q, &one, 1)) < 0)
		ok = fail_with(why, size, "%s: one segment: %s", what, zc_error_name(rc));
	for (size_t i = 0; ok && want_rc == 0 && i < n; i++) {
		double scale = fmax(fabs((double)whole[i]), 0.1);
		if (fabs((double)want[i] - whole[i]) > 1e-4 * scale)
			ok = fail_with(why, size, "%s: element %zu is %.9g cut at the blocks, %.9g as "
				       "one segment", what, i, want[i], whole[i]);
	}
	free(got);
	free(want);
	free(whole);
	free(segments);
	return ok;
}

/* The shapes every check tries: decode with GQA, several causal queries,
 * plain multi-head. */
struct queries {
	struct query item[3];
};

static void queries_make(struct queries *queries, const struct model *model, struct rng *rng)
{
	query_make(&queries->item[0], model, 2 * model->kv_heads, 1, false, rng);
	query_make(&queries->item[1], model, 2 * model->kv_heads, 3, true, rng);
	query_make(&queries->item[2], model, model->kv_heads, 1, false, rng);
}

static void queries_free(struct queries *queries)
{
	for (size_t i = 0; i < 3; i++)
		free(queries->item[i].data);
}

static bool session_attends(zc_session *session, const struct model *model,
			    const struct queries *queries, char *why, size_t size)
{
	for (uint32_t layer = 0; layer < model->layers; layer++)
		for (size_t i = 0; i < 3; i++)
			if (!attend_matches(session, model, layer, &queries->item[i], 1 + (unsigned)i % 2,
					    why, size))
				return false;
	return true;
}

/* ---- 1. bit identity over long mixed sessions ---------------------------------- */

struct mixed {
	struct service *service;
	zc_session *session;
	struct model model;
	struct rng rng;
	struct queries queries;
};

static void mixed_step(struct mixed *m, uint32_t layer, uint32_t tokens)
{
	CHECK(update_checked, m->service->client, m->session, &m->model, &m->rng, layer, tokens);
	CHECK(session_attends, m->session, &m->model, &m->queries);
}

static void mixed_trim(struct mixed *m, int layer, uint32_t tokens)
{
	if (layer < 0) {
		CHECK(trim_checked, m->service->client, m->session, &m->model, tokens);
	} else {
		uint32_t expected = model_trim_layer(&m->model, (uint32_t)layer, tokens);
		uint32_t trimmed = UINT32_MAX;
		int rc = zc_session_trim_layer(m->session, (uint32_t)layer, tokens, &trimmed);
		ck_assert_msg(rc == 0 && trimmed == expected, "trim_layer(%d, %u): %s, %u, expected %u",
			      layer, tokens, zc_error_name(rc), trimmed, expected);
	}
	CHECK(session_attends, m->session, &m->model, &m->queries);
}

static void long_mixed_session(zc_views views)
{
	struct service service;
	zc_session_config config = attend_config("mixed", 2, 2, 64, 32, 2048, 16, views);
	struct mixed m = { .service = &service };

	service_start(&service, NULL);
	m.session = open_session(service.client, &config);
	ck_assert_int_eq(zc_session_get_info(m.session)->views, views);
	model_init(&m.model, &config);
	rng_seed(&m.rng, 1101 + (uint64_t)views);
	queries_make(&m.queries, &m.model, &m.rng);

	/* Prefill blocks of several sizes (16 = R goes straight to a block). */
	static const uint32_t prefill[] = { 200, 37, 16, 5, 64 };
	for (size_t i = 0; i < sizeof(prefill) / sizeof(prefill[0]); i++)
		for (uint32_t layer = 0; layer < 2; layer++)
			mixed_step(&m, layer, prefill[i]);
	/* Decode: the residual fills and flushes every 16 tokens. */
	for (int s = 0; s < 200; s++)
		mixed_step(&m, (uint32_t)s % 2, 1 + (s % 7 == 0));
	/* Trims through the residual, through a block (it stays whole, its
	 * tail cut), one layer alone; decode and blocks after the cut. */
	mixed_trim(&m, -1, 3);
	mixed_trim(&m, -1, 45);
	mixed_trim(&m, 1, 70);
	for (int s = 0; s < 60; s++)
		mixed_step(&m, (uint32_t)s % 2, 1 + (s % 5 == 0) * 2);
	for (uint32_t layer = 0; layer < 2; layer++)
		mixed_step(&m, layer, 40);
	mixed_trim(&m, 0, 30);
	mixed_step(&m, 0, 50);
	for (int s = 0; s < 40; s++)
		mixed_step(&m, (uint32_t)s % 2, 1);
	CHECK(session_matches, m.session, &m.model);

	queries_free(&m.queries);
	ck_assert_int_eq(zc_session_close(m.session), 0);
	model_free(&m.model);
	service_stop(&service);
}

START_TEST(views_none_attends_bit_identical)
{
	long_mixed_session(ZC_VIEWS_NONE);
}
END_TEST

START_TEST(views_full_attends_bit_identical_compressed_and_over_the_view)
{
	long_mixed_session(ZC_VIEWS_FULL);
}
END_TEST

/* fp16 queries and outputs, per_call blocks, a codec with exact values
 * and odd groups: still the model's bytes. */
START_TEST(variants_attend_bit_identical)
{
	struct service service;
	zc_session_config per_call = attend_config("per-call", 1, 3, 32, 48, 1024, 0, ZC_VIEWS_NONE);
	zc_session_config exact = attend_config("exact-values", 2, 1, 16, 16, 1024, 8, ZC_VIEWS_FULL);
	struct model models[2];
	zc_session *sessions[2];
	struct rng rng;

	per_call.policy = ZC_POLICY_PER_CALL;
	per_call.codec.group_size = 7;
	per_call.codec.hi_fraction = 0.33;
	per_call.codec.lo_bits = 3;
	exact.codec.quantize_values = false;
	service_start(&service, NULL);
	sessions[0] = open_session(service.client, &per_call);
	sessions[1] = open_session(service.client, &exact);
	rng_seed(&rng, 1202);
	for (int k = 0; k < 2; k++) {
		struct model *model = &models[k];
		struct queries queries;
		model_init(model, k == 0 ? &per_call : &exact);
		queries_make(&queries, model, &rng);
		static const uint32_t sizes[] = { 33, 1, 2, 100, 1, 1, 9, 3, 1, 17 };
		for (int round = 0; round < 3; round++)
			for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
				CHECK(update_checked, service.client, sessions[k], model, &rng,
				      (uint32_t)i % 2, sizes[i]);
				CHECK(session_attends, sessions[k], model, &queries);
			}
		CHECK(trim_checked, service.client, sessions[k], model, 60);
		CHECK(session_attends, sessions[k], model, &queries);

		/* fp16 in and out: the same as the model's rows in fp16. */
		const struct model_layer *l = &model->layer[0];
		size_t n = queries.item[1].out_elements;
		size_t qn = (size_t)model->batch * queries.item[1].q.q_heads * 3 * model->head_dim_k;
		uint16_t *q16 = allocate(qn * 2), *got = allocate(n * 2), *want = allocate(n * 2);
		for (size_t i = 0; i < qn; i++)
			q16[i] = zc_float_to_fp16(queries.item[1].data[i]);
		zc_attend_query q = queries.item[1].q;
		q.dtype = ZC_ATTEND_FP16;
		q.data = q16;
		q.scale = 0.3;
		zc_attend_segment *segments = allocate((l->n_blocks + 1) * sizeof(*segments));
		size_t n_segments = model_segments(model, 0, segments);
		zc_attend_output out = { ZC_ATTEND_FP16, got, n * 2, NULL }, ref = { ZC_ATTEND_FP16, want, n * 2, NULL };
		ck_assert_int_eq(zc_attend_segments(segments, n_segments, &q, &ref, 1), 0);
		ck_assert_int_eq(zc_attend(sessions[k], 0, &q, &out, 0, 2), 0);
		ck_assert_msg(memcmp(got, want, n * 2) == 0, "fp16 output differs from the model's");
		free(segments);
		free(q16);
		free(got);
		free(want);
		queries_free(&queries);
	}
	for (int k = 0; k < 2; k++) {
		ck_assert_int_eq(zc_session_close(sessions[k]), 0);
		model_free(&models[k]);
	}
	service_stop(&service);
}
END_TEST

/* ---- 2. bad input ------------------------------------------------------------- */

static void assert_untouched(const uint8_t *out, size_t bytes, const char *what)
{
	for (size_t i = 0; i < bytes; i++)
		ck_assert_msg(out[i] == UNTOUCHED, "%s: output byte %zu was written", what, i);
}

/* Refused with `expected`, the output as it was. */
static void assert_refused_untouched(zc_session *session, uint32_t layer, const zc_attend_query *q,
				     size_t capacity, unsigned flags, int expected, const char *what)
{
	static uint8_t out[1 << 16];
	zc_attend_output output = { ZC_ATTEND_FP32, out, capacity, NULL };

	memset(out, UNTOUCHED, sizeof(out));
	int rc = zc_attend(session, layer, q, &output, flags, 1);
	ck_assert_msg(rc == expected, "%s: expected %s, got %s", what, zc_error_name(expected),
		      zc_error_name(rc));
	assert_untouched(out, sizeof(out), what);
}

START_TEST(bad_queries_are_refused_output_untouched)
{
	struct service service;
	zc_session_config full = attend_config("full", 2, 2, 64, 32, 512, 16, ZC_VIEWS_FULL);
	zc_session_config none = attend_config("none", 2, 2, 64, 32, 512, 16, ZC_VIEWS_NONE);
	struct model model;
	struct rng rng;
	struct query good;
	size_t cap = 1 << 16;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &full);
	zc_session *bare = open_session(service.client, &none);
	model_init(&model, &full);
	rng_seed(&rng, 1303);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 40);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 5);
	query_make(&good, &model, 4, 2, true, &rng);

	zc_attend_query q = good.q;
	q.batch = 1;
	assert_refused_untouched(session, 0, &q, cap, 0, ZC_ESHAPE, "batch not the session's");
	q = good.q;
	q.head_dim = 32;
	assert_refused_untouched(session, 0, &q, cap, 0, ZC_ESHAPE, "head dim not the session's");
	q = good.q;
	q.q_heads = 3;
	assert_refused_untouched(session, 0, &q, cap, 0, ZC_ESHAPE, "q_heads not a multiple");
	struct query long_query;
	query_make(&long_query, &model, 4, 46, true, &rng);
	assert_refused_untouched(session, 0, &long_query.q, cap, 0, ZC_ESHAPE,
				 "causal, more queries than the layer's 45 tokens");
	free(long_query.data);
	assert_refused_untouched(session, 1, &good.q, cap, 0, ZC_ESHAPE, "an empty layer");
	assert_refused_untouched(session, 2, &good.q, cap, 0, ZC_EINVALID, "a layer out of range");
	assert_refused_untouched(session, 0, &good.q, cap, 4, ZC_EINVALID, "unknown flags");
	assert_refused_untouched(bare, 0, &good.q, cap, ZC_ATTEND_OVER_VIEW, ZC_EPRECONDITION,
				 "over the view of a views = none session");
	assert_refused_untouched(session, 0, &good.q, good.out_elements * 4 - 1, 0, ZC_EBUFFER,
				 "an output one byte short");
	assert_refused_untouched(session, 0, &good.q, good.out_elements * 4 - 1, ZC_ATTEND_OVER_VIEW,
				 ZC_EBUFFER, "an output one byte short, over the view");
	q = good.q;
	q.scale = NAN;
	assert_refused_untouched(session, 0, &q, cap, 0, ZC_EINVALID, "a NaN scale");
	good.data[7] = NAN;
	assert_refused_untouched(session, 0, &good.q, cap, 0, ZC_ENONFINITE, "NaN in q");
	assert_refused_untouched(session, 0, &good.q, cap, ZC_ATTEND_OVER_VIEW, ZC_ENONFINITE,
				 "NaN in q, over the view");
	good.data[7] = INFINITY;
	assert_refused_untouched(session, 0, &good.q, cap, 0, ZC_ENONFINITE, "Inf in q");
	good.data[7] = 0.5f;
	ck_assert_int_eq(zc_attend(NULL, 0, &good.q, &(zc_attend_output){ ZC_ATTEND_FP32, good.data, 4, NULL },
				   0, 1), ZC_EINVALID);
	ck_assert_int_eq(zc_attend(session, 0, NULL, &(zc_attend_output){ ZC_ATTEND_FP32, good.data, 4, NULL },
				   0, 1), ZC_EINVALID);
	ck_assert_int_eq(zc_attend(session, 0, &good.q, NULL, 0, 1), ZC_EINVALID);

	/* Nothing of it changed the session, and a good query still works. */
	struct queries queries;
	queries_make(&queries, &model, &rng);
	CHECK(session_matches, session, &model);
	CHECK(session_attends, session, &model, &queries);
	queries_free(&queries);
	free(good.data);
	ck_assert_int_eq(zc_session_close(bare), 0);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ---- 3. a dropped view ----------------------------------------------------------- */

START_TEST(dropped_view_is_reported_blocks_still_attend)
{
	static const char *const args[] = { "--memory-budget", "24M", NULL };
	struct service service;
	zc_session_config cold_config = attend_config("cold", 1, 4, 128, 128, 4096, 16,
						      ZC_VIEWS_FULL);
	zc_session_config hot_config = attend_config("hot", 1, 4, 128, 128, 8192, 16, ZC_VIEWS_FULL);
	struct model cold_model, hot_model;
	struct rng rng;
	struct queries queries;
	zc_read read;
	int rc;

	service_start(&service, args);
	zc_session *cold = open_session(service.client, &cold_config);
	model_init(&cold_model, &cold_config);
	rng_seed(&rng, 1404);
	queries_make(&queries, &cold_model, &rng);
	/* Layer 0 ends in residual rows (only the view holds them); layer 1
	 * is whole blocks. */
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 0, 600);
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 0, 10);
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 1, 600);
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 1, 32);
	ck_assert_uint_eq(cold_model.layer[1].residual, 0);
	CHECK(session_attends, cold, &cold_model, &queries);

	/* The cold session gives up its lease; another one grows until the
	 * budget makes the daemon drop the idle one's views. */
	ck_assert_int_eq(zc_session_release_views(cold), 0);
	zc_session *hot = open_session(service.client, &hot_config);
	model_init(&hot_model, &hot_config);
	bool dropped = false;
	for (int s = 0; s < 30 && !dropped; s++) {
		CHECK(update_checked, service.client, hot, &hot_model, &rng, 0, 256);
		ck_assert_int_eq(zc_read_begin(cold, 0, 0, &read), 0);
		dropped = !read.view_valid;
		ck_assert_int_eq(zc_read_end(cold, &read), 0);
	}
	ck_assert_msg(dropped, "the cold session's views were never dropped");

	size_t n = queries.item[0].out_elements, bytes = n * sizeof(float);
	uint8_t *out = allocate(bytes);
	zc_attend_output output = { ZC_ATTEND_FP32, out, bytes, NULL };
	/* The residual rows are gone with the view: said, not read as zeros. */
	memset(out, UNTOUCHED, bytes);
	rc = zc_attend(cold, 0, &queries.item[0].q, &output, 0, 1);
	ck_assert_msg(rc == ZC_ESTALE, "attend over a dropped residual: %s", zc_error_name(rc));
	assert_untouched(out, bytes, "a dropped residual");
	rc = zc_attend(cold, 1, &queries.item[0].q, &output, ZC_ATTEND_OVER_VIEW, 1);
	ck_assert_msg(rc == ZC_ESTALE, "attend over a dropped view: %s", zc_error_name(rc));
	assert_untouched(out, bytes, "a dropped view");
	/* A layer of whole blocks attends from the pool alone, its view gone. */
	ck_assert_int_eq(zc_read_begin(cold, 1, 0, &read), 0);
	ck_assert_uint_eq(read.view_valid, 0);
	ck_assert_int_eq(zc_read_end(cold, &read), 0);
	for (size_t i = 0; i < 3; i++) {
		const struct query *query = &queries.item[i];
		size_t qb = query->out_elements * sizeof(float);
		float *got = allocate(qb), *want = allocate(qb);
		zc_attend_segment segments[16];
		ck_assert_uint_le(cold_model.layer[1].n_blocks + 1, 16);
		size_t n_segments = model_segments(&cold_model, 1, segments);
		ck_assert_int_eq(zc_attend_segments(segments, n_segments, &query->q,
						    &(zc_attend_output){ ZC_ATTEND_FP32, want, qb, NULL }, 1), 0);
		ck_assert_int_eq(zc_attend(cold, 1, &query->q,
					   &(zc_attend_output){ ZC_ATTEND_FP32, got, qb, NULL }, 0, 1), 0);
		CHECK(outputs_equal, "layer 1 from the pool, its view dropped", got, want,
		      query->out_elements);
		free(got);
		free(want);
	}
	/* A request brings the views back, and with them everything. */
	ck_assert_int_eq(zc_session_release_views(hot), 0);
	CHECK(session_matches, cold, &cold_model);
	CHECK(session_attends, cold, &cold_model, &queries);

	free(out);
	queries_free(&queries);
	ck_assert_int_eq(zc_session_close(hot), 0);
	ck_assert_int_eq(zc_session_close(cold), 0);
	model_free(&hot_model);
	model_free(&cold_model);
	service_stop(&service);
}
END_TEST

/* ---- 4. a block at the end of the pool -------------------------------------------- */

/* A reader of the session whose pool ends right after the layer's last
 * block (a copy of its map saying so): the key payloads near that end
 * are attended from a copy, with the same bytes as from the pool. */
START_TEST(block_at_the_pool_end_is_attended_from_a_copy)
{
	struct service service;
	zc_session_config config = attend_config("edge", 1, 2, 64, 64, 1024, 16, ZC_VIEWS_NONE);
	struct model model;
	struct rng rng;
	struct query query;
	zc_read read;
	zc_block block;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 1505);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 300);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 100);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 3);
	query_make(&query, &model, 4, 1, false, &rng);

	const zc_map_header *map = zc_session_map(session);
	size_t pool_bytes;
	const uint8_t *pool = zc_session_pool(session, &pool_bytes);
	uint64_t end = 0;
	ck_assert_int_eq(zc_read_begin(session, 0, 0, &read), 0);
	ck_assert_uint_eq(read.blocks, 2);
	for (uint32_t i = 0; i < read.blocks; i++) {
		ck_assert_int_eq(zc_layer_block(session, &read, i, &block), 0);
		uint64_t block_end = block.value_offset + block.value_bytes;
		end = block_end > end ? block_end : end;
	}
	ck_assert_int_eq(zc_read_end(session, &read), 0);
	/* The map says how much pool there is: a copy of it says less. */
	zc_map_header *forged = allocate(map->map_bytes);
	memcpy(forged, map, map->map_bytes);
	forged->pool_bytes = end;
	struct map_reader whole = { map, map->map_bytes, pool, pool_bytes };
	struct map_reader cut = { forged, map->map_bytes, pool, end };

	size_t bytes = query.out_elements * sizeof(float), copied = SIZE_MAX;
	float *a = allocate(bytes), *b = allocate(bytes);
	ck_assert_int_eq(map_attend(&whole, zc_session_get_info(session), 0, &query.q,
				    &(zc_attend_output){ ZC_ATTEND_FP32, a, bytes, NULL }, 0, 1, &copied), 0);
	ck_assert_uint_eq(copied, 0);
	ck_assert_int_eq(map_attend(&cut, zc_session_get_info(session), 0, &query.q,
				    &(zc_attend_output){ ZC_ATTEND_FP32, b, bytes, NULL }, 0, 1, &copied), 0);
	ck_assert_uint_ge(copied, 1);
	CHECK(outputs_equal, "attended from a copy", b, a, query.out_elements);
	CHECK(attend_matches, session, &model, 0, &query, 1);

	free(forged);
	free(a);
	free(b);
	free(query.data);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ---- 5. attention racing a writer ---------------------------------------------- */

#define RACE_OPS 600
#define RACE_PREFILL 600
#define RACE_MAX_RECORDS 100000

/* Operation k of the writer, decided from the layer's tokens alone so the
 * replay makes the same choices: a trim (> 0), or an update of `tokens`. */
struct race_op {
	uint32_t trim, tokens;
};

static struct race_op race_op_next(struct rng *rng, uint32_t held, uint32_t max_tokens)
{
	/* Trims free extents that later blocks reuse: what a torn read could
	 * see rewritten under it. */
	uint32_t kind = rng_below(rng, 10);
	if ((kind < 3 && held > 1) || held + 64 > max_tokens)
		return (struct race_op){ .trim = 1 + rng_below(rng, held - 1 < 20 ? held - 1 : 20) };
	if (kind == 3)
		return (struct race_op){ .tokens = 16 + rng_below(rng, 30) };
	return (struct race_op){ .tokens = 1 + rng_below(rng, 4) };
}

static void race_block(const struct model *model, int k, uint32_t tokens, struct block *block)
{
	struct rng rng;
	rng_seed(&rng, 7000 + (uint64_t)k);
	block_make(block, model, tokens, &rng);
}

struct race_writer {
	const char *socket_path;
	zc_session_config config;
	const struct model *shape;   /* geometry only, read-only */
	int rc, failed_op;
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
	rng_seed(&rng, 88);
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

static uint64_t bytes_hash(const void *data, size_t n)
{
	const uint8_t *p = data;
	uint64_t hash = 0xcbf29ce484222325ull;
	for (size_t i = 0; i < n; i++)
		hash = (hash ^ p[i]) * 0x100000001b3ull;
	return hash;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return (x > y) - (x < y);
}

/* The model's attention for its current state, hashed. */
static uint64_t model_attention_hash(const struct model *model, const struct query *query,
				     float *out)
{
	const struct model_layer *l = &model->layer[0];
	zc_attend_segment *segments = allocate((l->n_blocks + 1) * sizeof(*segments));
	size_t n = model_segments(model, 0, segments), bytes = query->out_elements * sizeof(float);
	int rc = zc_attend_segments(segments, n, &query->q,
				    &(zc_attend_output){ ZC_ATTEND_FP32, out, bytes, NULL }, 1);
	free(segments);
	ck_assert_msg(rc == 0, "the model's attention: %s", zc_error_name(rc));
	return bytes_hash(out, bytes);
}

/*
 * A writer on another connection appends and trims while this thread
 * attends over and over: every call succeeds (torn reads are retried
 * inside), and every result is the attention of one state the writer
 * left the layer in (the replay of its operations on the model gives the
 * hash of each). Under ASan this is also the run in which a torn read
 * would be caught reading out of bounds.
 */
START_TEST(attends_racing_a_writer_see_whole_states)
{
	struct service service;
	zc_session_config config = attend_config("race", 1, 2, 64, 64, 4096, 16, ZC_VIEWS_NONE);
	struct model model;
	struct rng rng;
	struct query query;
	struct block block;
	pthread_t thread;

	config.layers = 1;
	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 1606);
	query_make(&query, &model, 4, 1, false, &rng);
	race_block(&model, -1, RACE_PREFILL, &block);
	CHECK(update_block_checked, service.client, session, &model, 0, &block, NULL, NULL);
	block_free(&block);

	size_t bytes = query.out_elements * sizeof(float), n_records = 0, calls = 0;
	uint64_t *records = allocate(RACE_MAX_RECORDS * sizeof(*records));
	float *out = allocate(bytes);
	struct race_writer writer = { .socket_path = service.daemon.socket_path, .config = config,
				      .shape = &model };
	ck_assert_int_eq(pthread_create(&thread, NULL, race_writer_main, &writer), 0);
	while (!__atomic_load_n(&writer.done, __ATOMIC_ACQUIRE)) {
		int rc = zc_attend(session, 0, &query.q,
				   &(zc_attend_output){ ZC_ATTEND_FP32, out, bytes, NULL }, 0, 1);
		ck_assert_msg(rc == 0, "attend %zu, with a writer: %s", calls, zc_error_name(rc));
		calls++;
		if (n_records < RACE_MAX_RECORDS)
			records[n_records++] = bytes_hash(out, bytes);
	}
	pthread_join(thread, NULL);
	ck_assert_msg(writer.rc == 0, "writer op %d: %s", writer.failed_op, zc_error_name(writer.rc));

	/* Replay: the hash of every state the writer passed through. */
	uint64_t *states = allocate((RACE_OPS + 1) * sizeof(*states));
	size_t n_states = 0;
	uint32_t held = RACE_PREFILL;
	rng_seed(&rng, 88);
	states[n_states++] = model_attention_hash(&model, &query, out);
	for (int k = 0; k < RACE_OPS; k++) {
		struct race_op op = race_op_next(&rng, held, config.max_tokens);
		if (op.trim) {
			held -= model_trim_layer(&model, 0, op.trim);
		} else {
			race_block(&model, k, op.tokens, &block);
			ck_assert_int_eq(model_update(&model, 0, op.tokens, block.keys, block.values), 0);
			block_free(&block);
			held = model.layer[0].tokens;
		}
		states[n_states++] = model_attention_hash(&model, &query, out);
	}
	qsort(states, n_states, sizeof(*states), cmp_u64);
	for (size_t i = 0; i < n_records; i++)
		ck_assert_msg(bsearch(&records[i], states, n_states, sizeof(*states), cmp_u64),
			      "attend %zu of %zu gave the attention of no state the layer was in", i,
			      n_records);
	ck_assert_uint_gt(n_records, 0);
	/* And the end state, through the daemon's own accounting. */
	CHECK(session_matches, session, &model);
	CHECK(attend_matches, session, &model, 0, &query, 2);

	free(states);
	free(records);
	free(out);
	free(query.data);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ---- 6. saliency by attention ---------------------------------------------------- */

#define SAL_R 32          /* residual rows: the 32nd token flushes them */
#define SAL_HEADS 2
#define SAL_DIM 64
#define SAL_Q_HEADS 4
static const uint32_t sal_targets[] = { 3, 9, 17, 22 };

static bool sal_is_target(uint32_t t)
{
	for (size_t i = 0; i < sizeof sal_targets / sizeof sal_targets[0]; i++)
		if (sal_targets[i] == t)
			return true;
	return false;
}

/* Token t's K/V: the targets have keys 4 e_0 (norm 4), the others normal
 * on channels 1.. (norm about 8, so key norm never picks a target); the
 * queries are 30 e_0, so only the targets get attention. */
static void sal_token(struct block *block, uint32_t t, struct rng *rng)
{
	block_make_shape(block, SAL_HEADS, SAL_DIM, SAL_DIM, 1, rng);
	for (uint32_t h = 0; h < SAL_HEADS; h++)
		for (uint32_t c = 0; c < SAL_DIM; c++) {
			double x = sal_is_target(t) ? (c == 0 ? 4.0 : 0.0) :
						      (c == 0 ? 0.0 : rng_normal(rng));
			block->keys[h * SAL_DIM + c] = zc_float_to_fp16((float)x);
		}
}

/* The key payload's saliency mask bit of token t in head h of block 0. */
static void sal_block_mask(zc_session *session, const zc_session_config *config, bool *hi,
			   uint32_t *n_hi)
{
	zc_read read;
	zc_layer_contents layout;
	zc_block block;
	zc_block_layout kl;
	for (;;) {
		ck_assert_int_eq(zc_read_begin(session, 0, 5000, &read), 0);
		ck_assert_int_eq(zc_layer_layout(session, &read, &layout), 0);
		ck_assert_uint_eq(layout.blocks, 1);
		ck_assert_uint_eq(layout.residual_tokens, 0);
		ck_assert_int_eq(zc_layer_block(session, &read, 0, &block), 0);
		ck_assert_int_eq(zc_block_layout_compute(&config->codec, ZC_TENSOR_KEYS, &block.key_shape,
							 &kl), 0);
		for (uint32_t h = 0; h < SAL_HEADS; h++) {
			const uint8_t *mask = block.key_payload + h * kl.head_bytes + kl.mask_offset;
			for (uint32_t t = 0; t < SAL_R; t++)
				hi[h * SAL_R + t] = (mask[t / 8] >> (t % 8)) & 1u;
		}
		*n_hi = kl.n_hi;
		if (zc_read_end(session, &read) == 0)
			return;
	}
}

static uint32_t sal_layer_tokens(zc_session *session)
{
	zc_layer_stats layers[2], total;
	ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
	return layers[0].tokens;
}

/* A raw update of one token carrying `mass_bytes` of masses: refused with
 * INVALID_ARGUMENT naming attention_mass. */
static void sal_raw_refused(const char *socket_path, uint64_t session_id, const struct block *block,
			    const float *mass, size_t mass_bytes, const char *what)
{
	int fd = raw_connect(socket_path);
	ck_assert_int_ge(fd, 0);
	wire_pb_request request;
	memset(&request, 0, sizeof request);
	request.msg.request_id = 7;
	request.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	request.msg.op.update_and_fetch.session_id = session_id;
	request.msg.op.update_and_fetch.layer = 0;
	request.msg.op.update_and_fetch.tokens = block->tokens;
	request.keys = (wire_span){ (const uint8_t *)block->keys, block->key_elements * 2 };
	request.values = (wire_span){ (const uint8_t *)block->values, block->value_elements * 2 };
	request.attention_mass = (wire_span){ (const uint8_t *)mass, mass_bytes };
	wire_pb_response reply;
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	ck_assert_msg(reply.msg.status == zipcache_v1_Status_INVALID_ARGUMENT &&
			      strstr(reply.msg.message, "attention_mass") &&
			      strstr(reply.msg.message, "nothing was stored"),
		      "%s: status %s, message '%s'", what, response_status_name(reply.msg.status),
		      reply.msg.message);
	close(fd);
}

/*
 * A decode of SAL_R tokens into two sessions of the same data, one ranked
 * by attention (zc_attend's masses, summed over the steps, handed to each
 * next update) and one by key norm (checked against layer_model.c's
 * key-norm reconstruction, bit for bit). At the flush the attention
 * session's block holds exactly the tokens the queries attended to among
 * its salient rows; the key-norm one none of them. Bad masses are refused
 * (by the client, and by the daemon when they pass the client) with
 * nothing stored.
 */
START_TEST(attention_masses_rank_the_flush_through_the_daemon)
{
	struct service service;
	zc_session_config by_mass = attend_config("by_mass", 1, SAL_HEADS, SAL_DIM, SAL_DIM, 256, SAL_R,
						  ZC_VIEWS_NONE);
	by_mass.codec.saliency = ZC_SALIENCY_ATTENTION;
	zc_session_config by_norm = attend_config("by_norm", 1, SAL_HEADS, SAL_DIM, SAL_DIM, 256, SAL_R,
						  ZC_VIEWS_NONE);
	struct model model;
	struct rng rng;
	float q[SAL_Q_HEADS * SAL_DIM] = { 0 };
	float out[SAL_Q_HEADS * SAL_DIM], plain[SAL_Q_HEADS * SAL_DIM];
	float step_mass[SAL_HEADS * SAL_R], sum[SAL_HEADS][SAL_R] = { { 0 } }, send[SAL_HEADS * SAL_R];

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &by_mass);
	zc_session *norm = open_session(service.client, &by_norm);
	ck_assert_int_eq(zc_session_get_info(session)->codec.saliency, ZC_SALIENCY_ATTENTION);
	ck_assert_uint_eq(zc_session_get_info(session)->residual_tokens, SAL_R);
	model_init(&model, &by_norm);
	rng_seed(&rng, 2011);
	for (uint32_t h = 0; h < SAL_Q_HEADS; h++)
		q[h * SAL_DIM] = 30.0f;
	zc_attend_query query;
	zc_attend_query_init(&query, 1, SAL_Q_HEADS, 1, SAL_DIM, q);

	for (uint32_t t = 0; t < SAL_R; t++) {
		struct block block;
		zc_view view;
		sal_token(&block, t, &rng);
		CHECK(update_block_checked, service.client, norm, &model, 0, &block, NULL, NULL);
		/* With stats: the flush is done when the call returns. */
		zc_layer_stats stats;
		ck_assert_int_eq(zc_update_and_fetch(session, 0, 1, block.keys, block.values, &view,
						     &stats), 0);
		block_free(&block);
		if (t + 1 == SAL_R)
			break;   /* that one flushed */
		/* The masses of the residual (every token so far), and the
		 * same output bytes as without them. */
		zc_attend_mass mass = { step_mass, SAL_HEADS * SAL_R, 999, 999 };
		zc_attend_output with = { ZC_ATTEND_FP32, out, sizeof out, &mass };
		zc_attend_output without = { ZC_ATTEND_FP32, plain, sizeof plain, NULL };
		ck_assert_int_eq(zc_attend(session, 0, &query, &with, 0, 1), 0);
		ck_assert_int_eq(zc_attend(session, 0, &query, &without, 0, 1), 0);
		ck_assert_int_eq(memcmp(out, plain, sizeof out), 0);
		ck_assert_uint_eq(mass.first_token, 0);
		ck_assert_uint_eq(mass.tokens, t + 1);
		/* Too small a buffer for the residual's rows. */
		zc_attend_mass small = { step_mass, SAL_HEADS * (t + 1) - 1, 0, 0 };
		ck_assert_int_eq(zc_attend(session, 0, &query,
					   &(zc_attend_output){ ZC_ATTEND_FP32, out, sizeof out, &small },
					   0, 1), ZC_EBUFFER);
		for (uint32_t h = 0; h < SAL_HEADS; h++) {
			double total = 0.0;
			for (uint32_t i = 0; i <= t; i++) {
				float m = step_mass[h * (t + 1) + i];
				total += m;
				sum[h][i] += m;
				send[h * (t + 1) + i] = sum[h][i];
			}
			/* Each of the group's 2 query rows sums to 1. */
			ck_assert_msg(fabs(total - 2.0) < 1e-5, "step %u head %u: masses sum to %.9g",
				      t, h, total);
		}
		if (t == 20) {
			/* Refused by the client, nothing kept. */
			size_t count = SAL_HEADS * (t + 1);
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, send, count - 1),
					 ZC_EINVALID);
			ck_assert_int_eq(zc_session_set_attention_mass(session, 2, 0, send, count),
					 ZC_EINVALID);
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, NULL, count),
					 ZC_EINVALID);
			float many[SAL_HEADS * (SAL_R + 1)] = { 0 };
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, many,
								       SAL_HEADS * (SAL_R + 1)),
					 ZC_EINVALID);
			float bad = send[5];
			send[5] = NAN;
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, send, count),
					 ZC_ENONFINITE);
			send[5] = -1.0f;
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, send, count),
					 ZC_ENONFINITE);
			send[5] = INFINITY;
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, send, count),
					 ZC_ENONFINITE);
			send[5] = bad;
			ck_assert_int_eq(zc_session_set_attention_mass(norm, 0, 0, send, count),
					 ZC_EPRECONDITION);
			/* Past the client (it does not know the layer's tokens),
			 * refused by the daemon: the update it rode on is not
			 * stored either. */
			struct block extra;
			sal_token(&extra, 100, &rng);
			ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 40, send, 2), 0);
			ck_assert_int_eq(zc_update_and_fetch(session, 0, 1, extra.keys, extra.values,
							     &view, NULL), ZC_EINVALID);
			ck_assert_ptr_nonnull(strstr(zc_client_last_error(service.client),
						     "attention_mass"));
			ck_assert_uint_eq(sal_layer_tokens(session), t + 1);
			/* Refused by the daemon on the wire: a length that is no
			 * whole [batch][kv_heads] row, NaN, negative. */
			uint64_t id = zc_session_get_info(session)->id;
			sal_raw_refused(service.daemon.socket_path, id, &extra, send, 5, "5 bytes");
			static const float past[SAL_HEADS * (SAL_R * 2 + 1)];
			sal_raw_refused(service.daemon.socket_path, id, &extra, past, sizeof past,
					"more rows than the residual");
			float nan_mass[SAL_HEADS] = { 0.5f, NAN }, neg_mass[SAL_HEADS] = { 0.5f, -0.5f };
			sal_raw_refused(service.daemon.socket_path, id, &extra, nan_mass, sizeof nan_mass,
					"NaN");
			sal_raw_refused(service.daemon.socket_path, id, &extra, neg_mass, sizeof neg_mass,
					"negative");
			ck_assert_uint_eq(sal_layer_tokens(session), t + 1);
			block_free(&extra);
		}
		ck_assert_int_eq(zc_session_set_attention_mass(session, 0, 0, send,
							       SAL_HEADS * (t + 1)), 0);
	}

	bool hi[SAL_HEADS * SAL_R], norm_hi[SAL_HEADS * SAL_R];
	uint32_t n_hi, norm_n_hi;
	sal_block_mask(session, &by_mass, hi, &n_hi);
	sal_block_mask(norm, &by_norm, norm_hi, &norm_n_hi);
	ck_assert_uint_eq(n_hi, norm_n_hi);
	ck_assert_uint_ge(n_hi, sizeof sal_targets / sizeof sal_targets[0]);
	for (uint32_t h = 0; h < SAL_HEADS; h++) {
		uint32_t count = 0, norm_count = 0;
		for (uint32_t t = 0; t < SAL_R; t++) {
			count += hi[h * SAL_R + t];
			norm_count += norm_hi[h * SAL_R + t];
			if (sal_is_target(t)) {
				ck_assert_msg(hi[h * SAL_R + t], "head %u: target token %u not salient "
					      "by attention", h, t);
				ck_assert_msg(!norm_hi[h * SAL_R + t], "head %u: target token %u "
					      "salient by key norm", h, t);
			}
		}
		ck_assert_uint_eq(count, n_hi);
		ck_assert_uint_eq(norm_count, n_hi);
	}
	/* Key norm as before: the model's reconstruction, bit for bit. */
	CHECK(session_matches, norm, &model);
	ck_assert_int_eq(zc_session_close(norm), 0);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

static Suite *attend_session_suite(void)
{
	Suite *suite = suite_create("attend_session");
	const struct test_case cases[] = {
		{ "bit_identity", { views_none_attends_bit_identical,
				    views_full_attends_bit_identical_compressed_and_over_the_view,
				    variants_attend_bit_identical, NULL } },
		{ "errors", { bad_queries_are_refused_output_untouched,
			      dropped_view_is_reported_blocks_still_attend, NULL } },
		{ "pool_end", { block_at_the_pool_end_is_attended_from_a_copy, NULL } },
		{ "race", { attends_racing_a_writer_see_whole_states, NULL } },
		{ "saliency", { attention_masses_rank_the_flush_through_the_daemon, NULL } },
	};

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(attend_session_suite(), CK_FORK);
}
