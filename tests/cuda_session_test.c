/*
 * zc_cuda_fetch_layer's CPU half against a real daemon: the layer built
 * from a session's block table and residual inside the reader protocol
 * (cuda/session.c), planned by cuda/plan.c, its kernels emulated on the
 * CPU (tests/cuda_emulator.c), is bit-identical to the client's own
 * reconstruction (zc_layer_reconstruct) after every step of long mixed
 * sessions, views = none and views = full, full and incremental; an
 * incremental fetch moves only what is new; trims the mirror is told of,
 * trims it sees in the table and trims appends made up for before the next
 * fetch all end bit-identical; reads torn by a concurrent writer are read
 * again and never leave a wrong row; refusals touch nothing. The GPU half
 * (pins, DMA, kernels) runs in `make check-gpu`.
 */
#include <check.h>

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/session.h"
#include "cuda_emulator.h"
#include "cuda_layers.h"
#include "daemon_harness.h"
#include "layer_model.h"
#include "suite_main.h"
#include "zipcache/client.h"

#define LAYERS 2u
#define BATCH 2u
#define HEADS 2u
#define DIM_K 64u
#define DIM_V 32u
#define MAX_TOKENS 1024u

#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

/* ---- the load, emulated ------------------------------------------------------ */

struct emulated {
	struct emulator e;
	struct session_layer sl;
	int error;
	size_t blocks, loads;   /* blocks moved, loads run (torn reads included) */
	uint64_t rows;
};

static int emulated_load(void *arg, const zc_session *session, uint32_t layer,
			 const zc_cuda_layer *contents, const zc_cuda_target *target,
			 zc_cuda_mirror *mirror, uint32_t first, bool rewrite)
{
	struct emulated *em = arg;
	int error = 0;
	int rc = emulate_load(&em->e, contents, target, mirror, &error);
	em->error |= error;
	em->blocks += em->e.plan.blocks;
	em->rows += em->e.plan.residual_rows;
	em->loads++;
	return rc;
}

static void emulated_init(struct emulated *em)
{
	memset(em, 0, sizeof *em);
	emulator_init(&em->e, 64u << 10);
	session_layer_init(&em->sl);
}

static void emulated_free(struct emulated *em)
{
	emulator_free(&em->e);
	session_layer_free(&em->sl);
}

static int fetch(struct emulated *em, const zc_session *session, uint32_t layer,
		 const zc_cuda_target *target, zc_cuda_mirror *mirror)
{
	struct session_load load = { emulated_load, em };
	em->blocks = em->rows = 0;
	return session_fetch(&em->sl, session, layer, target, mirror, &load);
}

/* ---- targets ----------------------------------------------------------------- */

/* A host target [BATCH][HEADS][rows + 3][D + 8]: padded, so strides matter. */
struct target {
	uint16_t *keys, *values;
	size_t key_elements, value_elements;
	zc_cuda_target target;
};

static void target_init(struct target *t, uint32_t rows)
{
	zc_strides ks = { 0, 0, DIM_K + 8 }, vs = { 0, 0, DIM_V + 8 };
	ks.head = ks.token * (rows + 3);
	ks.batch = ks.head * HEADS;
	vs.head = vs.token * (rows + 3);
	vs.batch = vs.head * HEADS;
	t->key_elements = ks.batch * BATCH;
	t->value_elements = vs.batch * BATCH;
	t->keys = allocate(t->key_elements * 2);
	t->values = allocate(t->value_elements * 2);
	test_fill_sentinel(t->keys, t->key_elements);
	test_fill_sentinel(t->values, t->value_elements);
	t->target = (zc_cuda_target){ t->keys, t->values, ks, vs, rows };
}

static void target_free(struct target *t)
{
	free(t->keys);
	free(t->values);
}

/* The first element of rows [0, tokens) of any head that differs, as a sentence. */
static bool rows_same(const char *what, const uint16_t *got, const uint16_t *want,
		      const zc_strides *s, uint32_t tokens, uint32_t dim, char *why, size_t size)
{
	for (uint32_t b = 0; b < BATCH; b++)
		for (uint32_t h = 0; h < HEADS; h++)
			for (uint32_t t = 0; t < tokens; t++) {
				size_t at = b * s->batch + h * s->head + t * s->token;
				for (uint32_t d = 0; d < dim; d++)
					if (got[at + d] != want[at + d])
						return fail_with(why, size,
								 "%s (%u, %u, %u, %u): %#x, the client "
								 "reconstructs %#x",
								 what, b, h, t, d, got[at + d],
								 want[at + d]);
			}
	return true;
}

/* The target holds what zc_layer_reconstruct gives for the layer's tokens;
 * with `untouched`, every element past them is still the sentinel. */
static bool target_matches(const zc_session *session, uint32_t layer, const struct target *t,
			   uint32_t tokens, bool untouched, const char *what, char *why, size_t size)
{
	struct target want;
	uint32_t held = UINT32_MAX;
	target_init(&want, t->target.max_tokens);
	int rc = zc_layer_reconstruct(session, layer, want.keys, &want.target.key_strides,
				      want.values, &want.target.value_strides, want.target.max_tokens,
				      &held);
	bool ok = true;
	if (rc < 0 || held != tokens)
		ok = fail_with(why, size, "%s: zc_layer_reconstruct: %s, %u tokens (fetch said %u)",
			       what, zc_error_name(rc), held, tokens);
	if (ok && untouched) {
		ok = memcmp(t->keys, want.keys, t->key_elements * 2) == 0 &&
		     memcmp(t->values, want.values, t->value_elements * 2) == 0;
		if (!ok) /* say where */
			ok = rows_same(what, t->keys, want.keys, &t->target.key_strides, tokens, DIM_K,
				       why, size) &&
			     rows_same(what, t->values, want.values, &t->target.value_strides, tokens,
				       DIM_V, why, size) &&
			     fail_with(why, size, "%s: an element past the layer's %u tokens was written",
				       what, tokens);
	} else if (ok) {
		ok = rows_same(what, t->keys, want.keys, &t->target.key_strides, tokens, DIM_K, why,
			       size) &&
		     rows_same(what, t->values, want.values, &t->target.value_strides, tokens, DIM_V,
			       why, size);
	}
	target_free(&want);
	return ok;
}

/* ---- sessions ---------------------------------------------------------------- */

static zc_session_config session_config(const char *name, zc_views views, zc_block_policy policy,
					int variant)
{
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = name;
	config.layers = LAYERS;
	config.batch = BATCH;
	config.kv_heads = HEADS;
	config.head_dim_k = DIM_K;
	config.head_dim_v = DIM_V;
	config.max_tokens = MAX_TOKENS;
	config.policy = policy;
	config.residual_tokens = 16;
	config.views = views;
	if (variant == 1) {
		config.codec.hi_bits = config.codec.lo_bits = 8;
		config.codec.group_size = 7;
	} else if (variant == 2) {
		config.codec.hi_bits = 3;
		config.codec.lo_bits = 1;
		config.codec.hi_fraction = 0.5;
		config.codec.group_size = 33;
		config.codec.quantize_values = false;
	}
	return config;
}

static uint64_t seed_next = 1;

/* Appends `tokens` random tokens; returns the layer's block count after. */
static uint64_t append(zc_session *session, uint32_t layer, uint32_t tokens)
{
	size_t kn = (size_t)BATCH * HEADS * tokens * DIM_K, vn = (size_t)BATCH * HEADS * tokens * DIM_V;
	uint16_t *k = allocate(kn * 2), *v = allocate(vn * 2);
	zc_view view;
	zc_layer_stats stats;
	test_fill_halves(k, kn, __atomic_fetch_add(&seed_next, 2, __ATOMIC_RELAXED));
	test_fill_halves(v, vn, __atomic_fetch_add(&seed_next, 2, __ATOMIC_RELAXED) + 1);
	int rc = zc_update_and_fetch(session, layer, tokens, k, v, &view, &stats);
	ck_assert_msg(rc == 0, "update of %u tokens: %s", tokens, zc_error_name(rc));
	free(k);
	free(v);
	return stats.blocks;
}

/* Per layer: a target fetched incrementally through a mirror, and what
 * the layer looked like at its last fetch. */
struct follower {
	struct target t;
	zc_cuda_mirror *mirror;
	uint64_t blocks;
	uint32_t tokens;
};

/* Fetches every layer incrementally and fully; both must be the client's
 * reconstruction. `appended` (per layer, or NULL after anything else):
 * tokens appended since the last fetch, which with no new block is exactly
 * what must move. */
static bool followers_check(struct emulated *em, zc_session *session, struct follower *f,
			    const uint64_t *blocks_now, const uint32_t *appended, const char *what,
			    char *why, size_t size)
{
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		char label[160];
		int tokens = fetch(em, session, layer, &f[layer].t.target, f[layer].mirror);
		snprintf(label, sizeof label, "%s, layer %u, incremental", what, layer);
		if (tokens < 0 || em->error)
			return fail_with(why, size, "%s: fetch: %s, kernels flagged %d", label,
					 zc_error_name(tokens), em->error);
		if (!target_matches(session, layer, &f[layer].t, (uint32_t)tokens, false, label, why,
				    size))
			return false;
		if (appended && blocks_now && blocks_now[layer] == f[layer].blocks &&
		    (em->blocks != 0 || em->rows != appended[layer]))
			return fail_with(why, size, "%s: %zu blocks and %llu rows moved for %u new rows",
					 label, em->blocks, (unsigned long long)em->rows,
					 appended[layer]);
		if (blocks_now)
			f[layer].blocks = blocks_now[layer];
		f[layer].tokens = (uint32_t)tokens;

		struct target full;
		target_init(&full, MAX_TOKENS);
		snprintf(label, sizeof label, "%s, layer %u, full", what, layer);
		int got = fetch(em, session, layer, &full.target, NULL);
		bool ok = got == tokens && !em->error &&
			  target_matches(session, layer, &full, (uint32_t)got, true, label, why, size);
		if (!ok && got != tokens)
			fail_with(why, size, "%s: %d tokens, incremental said %d", label, got, tokens);
		target_free(&full);
		if (!ok)
			return false;
	}
	return true;
}

static void followers_init(struct follower *f)
{
	for (uint32_t i = 0; i < LAYERS; i++) {
		memset(&f[i], 0, sizeof f[i]);
		target_init(&f[i].t, MAX_TOKENS);
		ck_assert_int_eq(zc_cuda_mirror_new(&f[i].mirror), 0);
	}
}

static void followers_free(struct follower *f)
{
	for (uint32_t i = 0; i < LAYERS; i++) {
		target_free(&f[i].t);
		zc_cuda_mirror_free(f[i].mirror);
	}
}

/* One update per layer of `tokens[layer]` tokens, then the check. */
static void step(struct emulated *em, zc_session *session, struct follower *f,
		 const uint32_t *tokens, const char *what)
{
	uint64_t blocks[LAYERS];
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		blocks[layer] = tokens[layer] ? append(session, layer, tokens[layer]) : f[layer].blocks;
	CHECK(followers_check, em, session, f, blocks, tokens, what);
}

static void trimmed(struct emulated *em, zc_session *session, struct follower *f, uint32_t n,
		    const char *what)
{
	uint32_t count = 0;
	ck_assert_int_eq(zc_session_trim(session, n, &count), 0);
	uint64_t blocks[LAYERS];
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		zc_layer_stats stats[LAYERS], total;
		ck_assert_int_eq(zc_session_stats(session, stats, LAYERS, &total), 0);
		blocks[layer] = stats[layer].blocks;
	}
	CHECK(followers_check, em, session, f, blocks, NULL, what);
}

/* ---- 1. bit identity over long mixed sessions -------------------------------------- */

static void mixed_session(zc_views views, zc_block_policy policy, int variant)
{
	struct daemon_harness daemon;
	struct emulated em;
	struct follower f[LAYERS];
	char name[32];
	snprintf(name, sizeof name, "s-%d-%d-%d", (int)views, (int)policy, variant);
	zc_session_config config = session_config(name, views, policy, variant);

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	emulated_init(&em);
	followers_init(f);
	CHECK(followers_check, &em, session, f, NULL, NULL, "empty");

	static const uint32_t prefill[] = { 200, 37, 16, 5, 64 };
	for (size_t i = 0; i < sizeof prefill / sizeof prefill[0]; i++)
		step(&em, session, f, (uint32_t[]){ prefill[i], prefill[i] - 1 }, "prefill");
	for (uint32_t s = 0; s < 40; s++)
		step(&em, session, f, (uint32_t[]){ 1, s % 3 == 0 ? 2 : (s % 5 == 0 ? 0 : 1) },
		     "decode");
	trimmed(&em, session, f, 3, "trim 3");
	trimmed(&em, session, f, 45, "trim 45, into a block");
	for (uint32_t s = 0; s < 20; s++)
		step(&em, session, f, (uint32_t[]){ 1, 1 }, "decode after trims");
	step(&em, session, f, (uint32_t[]){ 40, 33 }, "a block after decode");

	/* A trim the mirror is told of, then appends before the next fetch. */
	uint32_t count;
	ck_assert_int_eq(zc_session_trim_layer(session, 0, 5, &count), 0);
	zc_cuda_mirror_trim(f[0].mirror, f[0].tokens - count);
	append(session, 0, 5);
	CHECK(followers_check, &em, session, f, NULL, NULL, "trim told, then appends");

	/* The same without telling the mirror: the counts are as before, the
	 * rows are not; and once more through whole blocks, whose entries the
	 * daemon's first-fit pool may give back unchanged over new bytes. */
	ck_assert_int_eq(zc_session_trim_layer(session, 0, 5, &count), 0);
	append(session, 0, 5);
	CHECK(followers_check, &em, session, f, NULL, NULL, "trim not told, rows appended back");
	ck_assert_int_eq(zc_session_trim_layer(session, 1, 40, &count), 0);
	append(session, 1, 40);
	CHECK(followers_check, &em, session, f, NULL, NULL, "trim not told, a block appended back");
	ck_assert_int_eq(zc_session_trim_layer(session, 1, 50, &count), 0);
	append(session, 1, 20);
	CHECK(followers_check, &em, session, f, NULL, NULL, "trim not told, fewer appended back");

	for (uint32_t s = 0; s < 20; s++)
		step(&em, session, f, (uint32_t[]){ 1, 1 }, "decode at the end");
	followers_free(f);
	emulated_free(&em);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}

START_TEST(test_views_none_streaming)
{
	mixed_session(ZC_VIEWS_NONE, ZC_POLICY_STREAMING, 0);
}
END_TEST

START_TEST(test_views_full_streaming)
{
	mixed_session(ZC_VIEWS_FULL, ZC_POLICY_STREAMING, 0);
}
END_TEST

START_TEST(test_codec_variants)
{
	mixed_session(ZC_VIEWS_NONE, ZC_POLICY_PER_CALL, 1);
	mixed_session(ZC_VIEWS_FULL, ZC_POLICY_STREAMING, 2);
}
END_TEST

/* ---- 2. refusals ---------------------------------------------------------------- */

START_TEST(test_refusals_touch_nothing)
{
	struct daemon_harness daemon;
	struct emulated em;
	zc_session_config config = session_config("refusals", ZC_VIEWS_NONE, ZC_POLICY_STREAMING, 0);

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	emulated_init(&em);
	append(session, 0, 100);
	append(session, 0, 3);

	struct target small, fresh;
	target_init(&small, 102);
	target_init(&fresh, 102);
	zc_cuda_mirror *mirror;
	ck_assert_int_eq(zc_cuda_mirror_new(&mirror), 0);
	ck_assert_int_eq(fetch(&em, session, 0, &small.target, mirror), ZC_EBUFFER);
	ck_assert_int_eq(memcmp(small.keys, fresh.keys, small.key_elements * 2), 0);
	ck_assert_int_eq(memcmp(small.values, fresh.values, small.value_elements * 2), 0);
	ck_assert_int_eq(fetch(&em, session, LAYERS, &small.target, mirror), ZC_EINVALID);
	ck_assert_int_eq(fetch(&em, session, 0, NULL, mirror), -EINVAL);
	/* Refused, the mirror learnt nothing: a fetch into room enough is whole. */
	struct target room;
	target_init(&room, 103);
	ck_assert_int_eq(fetch(&em, session, 0, &room.target, mirror), 103);
	CHECK(target_matches, session, 0, &room, 103, true, "after refusals");
	/* An empty layer: nothing moves, nothing is written. */
	ck_assert_int_eq(fetch(&em, session, 1, &fresh.target, NULL), 0);
	ck_assert_uint_eq(em.loads, 3); /* the refused one ran its plan too */
	CHECK(target_matches, session, 1, &fresh, 0, true, "an empty layer");
	zc_cuda_mirror_free(mirror);
	target_free(&fresh);
	target_free(&room);
	target_free(&small);
	emulated_free(&em);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ---- 3. a writer racing the fetches --------------------------------------------------- */

struct writer {
	const char *socket_path;
	const char *name;
	int steps;
	int done;
};

static void *writer_main(void *arg)
{
	struct writer *w = arg;
	zc_client *client = NULL;
	zc_session *session = NULL;
	zc_session_config config = session_config(w->name, ZC_VIEWS_NONE, ZC_POLICY_STREAMING, 0);
	config.attach = true;
	if (zc_client_connect(w->socket_path, 10000, &client) == 0 &&
	    zc_session_open(client, &config, &session) == 0) {
		for (int s = 0; s < w->steps; s++) {
			uint32_t count;
			if (s % 37 == 36)
				zc_session_trim_layer(session, 0, 1 + (uint32_t)s % 23, &count);
			else
				append(session, 0, s % 11 == 0 ? 24 : 1);
		}
		zc_session_release(session);
	}
	zc_client_close(client);
	__atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

START_TEST(test_torn_reads_leave_no_wrong_row)
{
	struct daemon_harness daemon;
	struct emulated em;
	zc_session_config config = session_config("raced", ZC_VIEWS_NONE, ZC_POLICY_STREAMING, 0);

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	emulated_init(&em);
	append(session, 0, 120);
	struct target t;
	target_init(&t, MAX_TOKENS);
	zc_cuda_mirror *mirror;
	ck_assert_int_eq(zc_cuda_mirror_new(&mirror), 0);

	struct writer w = { daemon.socket_path, "raced", 300, 0 };
	pthread_t thread;
	ck_assert_int_eq(pthread_create(&thread, NULL, writer_main, &w), 0);
	int fetches = 0;
	while (!__atomic_load_n(&w.done, __ATOMIC_ACQUIRE)) {
		int tokens = fetch(&em, session, 0, &t.target, mirror);
		REQUIRE(tokens >= 0 && !em.error, "fetch during writes: %s", zc_error_name(tokens));
		fetches++;
	}
	pthread_join(thread, NULL);
	/* The writer's trims were never told: prints and counts must do. */
	int tokens = fetch(&em, session, 0, &t.target, mirror);
	ck_assert_int_ge(tokens, 0);
	CHECK(target_matches, session, 0, &t, (uint32_t)tokens, false, "after the writer");
	ck_assert_int_gt(fetches, 0);
	zc_cuda_mirror_free(mirror);
	target_free(&t);
	emulated_free(&em);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "bit_identity", { test_views_none_streaming, test_views_full_streaming,
				    test_codec_variants, NULL } },
		{ "edges", { test_refusals_touch_nothing, test_torn_reads_leave_no_wrong_row,
			     NULL } },
	};
	Suite *suite = suite_create("cuda_session");
	suite_add_cases(suite, cases, sizeof cases / sizeof cases[0], 300);
	return suite_main(suite, CK_FORK_GETENV);
}
