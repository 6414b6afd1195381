/*
 * Retained pages (server/retain.h) through a real zipcached: a closed
 * session's map and block extents are kept, handed to the next session of
 * the same shape without a byte of the old one showing, counted as memory
 * in use, and the first thing memory relief, an import and a restore take
 * back. The crash at each of their steps is tests/durability_test.c's.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

/* A daemon with a metrics port. */
struct node {
	struct service service;
	uint16_t port;
};

static void node_start(struct node *node, const char *const *more)
{
	node->port = service_start_metrics(&node->service, more);
}

static long long metric(const struct node *node, const char *sample)
{
	long long v = metric_value(node->port, sample);
	ck_assert_msg(v >= 0, "%s is not in /metrics", sample);
	return v;
}

#define KEPT_MAPS "zipcache_retained_bytes{kind=\"maps\"}"
#define KEPT_EXTENTS "zipcache_retained_bytes{kind=\"extents\"}"
#define REUSED_MAPS "zipcache_retain_reuses_total{kind=\"maps\"}"
#define REUSED_EXTENTS "zipcache_retain_reuses_total{kind=\"extents\"}"
#define RELEASES "zipcache_relief_steps_total{step=\"release_retained\"}"

/* One layer of 8 heads of 128 for up to `tokens`: with views full its map
 * is 8 MiB at 2048 tokens, well past what is worth keeping. */
static zc_session_config big_config(const char *name, uint32_t tokens)
{
	return shaped_config(name, 1, 1, 8, 128, 128, tokens, ZC_POLICY_STREAMING, 0);
}

/* Opens name and fills it with updates of `each` tokens, `count` times. */
static zc_session *filled(struct node *node, const zc_session_config *config,
			  struct model *model, struct rng *rng, uint32_t each, int count)
{
	zc_session *s = open_session(node->service.client, config);
	model_init(model, config);
	for (int i = 0; i < count; i++)
		CHECK(update_checked, node->service.client, s, model, rng, 0, each);
	CHECK(session_matches, s, model);
	return s;
}

START_TEST(a_kept_map_and_kept_extents_serve_the_next_session_bit_exact)
{
	struct node node;
	struct model model, heir_model;
	struct rng rng;
	rng_seed(&rng, 5);
	node_start(&node, NULL);
	zc_session_config config = big_config("first", 2048);
	zc_session *s = filled(&node, &config, &model, &rng, 256, 8);
	long long used = metric(&node, "zipcache_memory_used_bytes");
	ck_assert_int_eq(zc_session_close(s), 0);

	/* Kept, and counted as memory in use: the close gave nothing back. */
	long long maps = metric(&node, KEPT_MAPS), extents = metric(&node, KEPT_EXTENTS);
	ck_assert_int_gt(maps, 8 << 20);
	ck_assert_int_gt(extents, 0);
	ck_assert_int_eq(metric(&node, "zipcache_memory_file_bytes{kind=\"retained\"}"),
			 maps + extents);
	ck_assert_int_le(metric(&node, "zipcache_memory_used_bytes"), used);
	ck_assert_int_ge(metric(&node, "zipcache_memory_used_bytes"), maps + extents);
	/* The client's figures say the same, each kind where it is. */
	zc_memory_stats st;
	ck_assert_int_eq(zc_client_memory_stats(node.service.client, &st), 0);
	ck_assert_uint_eq(st.retained_bytes, (uint64_t)(maps + extents));
	ck_assert_uint_eq(st.views_bytes, 0);
	ck_assert_uint_eq(st.blocks_bytes, 4096);   /* the pool file's header page */
	ck_assert_uint_eq(st.views_bytes + st.blocks_bytes + st.residual_bytes + st.index_bytes +
				  st.headers_bytes + st.retained_bytes,
			  st.file_bytes);

	/* The same shape, fewer tokens: the old session's bytes are in the
	 * pages it gets, and none of them may show. */
	zc_session_config heir = big_config("heir", 2048);
	/* A larger block than any kept extent: it takes a run of them. */
	s = filled(&node, &heir, &heir_model, &rng, 300, 1);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 1);
	ck_assert_int_ge(metric(&node, REUSED_EXTENTS), 1);
	ck_assert_int_eq(metric(&node, KEPT_MAPS), 0);
	CHECK(update_checked, node.service.client, s, &heir_model, &rng, 0, 256);
	CHECK(update_checked, node.service.client, s, &heir_model, &rng, 0, 5);
	CHECK(update_checked, node.service.client, s, &heir_model, &rng, 0, 1);
	CHECK(trim_checked, node.service.client, s, &heir_model, 100);
	CHECK(update_checked, node.service.client, s, &heir_model, &rng, 0, 7);
	CHECK(session_matches, s, &heir_model);
	ck_assert_int_eq(zc_session_close(s), 0);

	/* Another map size takes nothing kept (a map is sealed at its size). */
	struct model other_model;
	zc_session_config other = big_config("other", 1024);
	s = filled(&node, &other, &other_model, &rng, 64, 2);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 1);
	ck_assert_int_gt(metric(&node, KEPT_MAPS), 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&other_model);
	model_free(&heir_model);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

/* What the client's memory figures say the daemon holds, kind by kind,
 * against what its files hold. */
static void memory_matches_files(zc_client *client, zc_memory_stats *st)
{
	ck_assert_int_eq(zc_client_memory_stats(client, st), 0);
	ck_assert_uint_eq(st->views_bytes + st->blocks_bytes + st->residual_bytes +
				  st->index_bytes + st->headers_bytes + st->retained_bytes,
			  st->file_bytes);
}

/*
 * A session of two layers whose views were dropped while idle (both
 * layers' pages punched) and whose layer 0 was written again (its rows
 * reserved anew), closed: its map is kept. An heir of its shape takes
 * the map and writes layer 1, the punched one, under `budget` (0: none).
 * Returns that update's answer; *peak, *opened and *grown are the memory
 * in use with the first session's two layers written, when the heir
 * opened, and after its update.
 */
static int heir_writes_a_punched_layer(uint64_t budget, long long *peak, long long *opened,
				       long long *grown)
{
	char arg[32];
	snprintf(arg, sizeof(arg), "%llu", (unsigned long long)budget);
	const char *const more[] = { "--view-idle-seconds", "1", "--lease-seconds", "1",
				     "--idle-ttl", "0", budget ? "--memory-budget" : NULL, arg, NULL };
	struct node node;
	struct model model, heir_model;
	struct rng rng;
	zc_memory_stats st;
	rng_seed(&rng, 9);
	node_start(&node, more);
	zc_client *client = node.service.client;
	zc_session_config config =
		shaped_config("first", 2, 1, 8, 128, 128, 2048, ZC_POLICY_STREAMING, 0);
	zc_session *s = open_session(client, &config);
	model_init(&model, &config);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, client, s, &model, &rng, layer, 1024);
	*peak = metric(&node, "zipcache_memory_used_bytes");
	bool dropped = false;
	for (int i = 0; i < 100 && !dropped; i++) {
		sleep_ms(100);
		ck_assert_int_eq(zc_client_memory_stats(client, &st), 0);
		dropped = st.views_bytes == 0;
	}
	ck_assert_msg(dropped, "the idle views were never dropped");
	CHECK(update_checked, client, s, &model, &rng, 0, 768);
	ck_assert_int_eq(zc_session_close(s), 0);
	ck_assert_int_gt(metric(&node, KEPT_MAPS), 1 << 20);

	zc_session_config heir = shaped_config("heir", 2, 1, 8, 128, 128, 2048,
					       ZC_POLICY_STREAMING, 0);
	s = open_session(client, &heir);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 1);
	*opened = metric(&node, "zipcache_memory_used_bytes");
	model_init(&heir_model, &heir);
	struct block block;
	block_make(&block, &heir_model, 1024, &rng);
	int rc = zc_update_and_fetch(s, 1, 1024, block.keys, block.values, NULL, NULL);
	if (rc == 0)
		ck_assert_int_eq(model_update(&heir_model, 1, 1024, block.keys, block.values), 0);
	block_free(&block);
	*grown = metric(&node, "zipcache_memory_used_bytes");
	memory_matches_files(client, &st);
	if (budget)
		ck_assert_int_le(*grown, (long long)budget);
	if (rc == 0) {
		/* Then the layer whose rows the map's notes hold reserved. */
		CHECK(update_checked, client, s, &heir_model, &rng, 0, 1024);
		memory_matches_files(client, &st);
		ck_assert_uint_ge(st.views_bytes, 2u * 2u * 8u * 1024u * 128u * 2u);
		CHECK(session_matches, s, &heir_model);
	}
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&heir_model);
	model_free(&model);
	service_stop(&node.service);
	return rc;
}

/*
 * A kept map tells the next session which of its view rows are reserved,
 * so that it does not reserve them again: where the closed session's
 * pages still are, and nowhere its views were dropped. Unbounded, the
 * heir writes both kinds of layer, charged what its files hold, its views
 * the model's bit for bit. Then under a budget between the first
 * session's peak and what the heir's punched layer needs: that update
 * must be refused, and the budget held. A punched layer taken as
 * reserved would be written into holes, past the budget, and charged
 * only afterwards.
 */
START_TEST(a_kept_maps_reservations_hold_only_where_its_pages_do)
{
	long long peak, opened, grown, again, at_open, after;
	ck_assert_int_eq(heir_writes_a_punched_layer(0, &peak, &opened, &grown), 0);
	/* Room for the first session's two layers, not for the heir's
	 * punched layer beside the kept one: without its views' pages that
	 * update would fit. */
	ck_assert_int_gt(grown - peak, 1 << 20);
	uint64_t budget = (uint64_t)(peak + grown) / 2;
	int rc = heir_writes_a_punched_layer(budget, &again, &at_open, &after);
	ck_assert_int_lt(at_open, (long long)budget);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "the punched layer under a budget of %llu: %s",
		      (unsigned long long)budget, zc_error_name(rc));
}
END_TEST

/*
 * A map of the same size laid out for other heads (16 of 64 channels
 * where there were 8 of 128) is reused, but its reserved rows are not:
 * they lie elsewhere in that layout. The heir writes its views into pages
 * it reserved itself, charged what its files hold.
 */
START_TEST(a_kept_maps_reservations_serve_only_its_own_layout)
{
	struct node node;
	struct model model, heir_model;
	struct rng rng;
	zc_memory_stats st;
	rng_seed(&rng, 11);
	node_start(&node, NULL);
	zc_session_config config = big_config("first", 2048);
	zc_session *s = filled(&node, &config, &model, &rng, 256, 1);
	ck_assert_int_eq(zc_session_close(s), 0);
	ck_assert_int_gt(metric(&node, KEPT_MAPS), 1 << 20);
	zc_session_config heir =
		shaped_config("heir", 1, 1, 16, 64, 64, 2048, ZC_POLICY_STREAMING, 0);
	s = filled(&node, &heir, &heir_model, &rng, 256, 1);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 1);
	memory_matches_files(node.service.client, &st);
	CHECK(session_matches, s, &heir_model);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&heir_model);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

START_TEST(relief_takes_kept_pages_before_any_view)
{
	struct node node;
	struct model model, idle_model, grower_model;
	struct rng rng;
	rng_seed(&rng, 6);
	node_start(&node, (const char *const[]){ "--memory-budget", "13M", NULL });
	zc_session_config config = big_config("closed", 2048);
	zc_session *s = filled(&node, &config, &model, &rng, 256, 8);
	ck_assert_int_eq(zc_session_close(s), 0);
	long long kept = metric(&node, KEPT_MAPS) + metric(&node, KEPT_EXTENTS);
	ck_assert_int_gt(kept, 10 << 20);

	/* An idle, unleased session whose views relief could drop. */
	zc_session_config idle = shaped_config("idle", 1, 1, 2, 64, 64, 256, ZC_POLICY_STREAMING, 0);
	zc_session *i = filled(&node, &idle, &idle_model, &rng, 100, 1);
	ck_assert_int_eq(zc_session_release_views(i), 0);

	/* Another shape (no map to reuse) that needs what is kept. */
	zc_session_config grower = big_config("grower", 1024);
	zc_session *g = filled(&node, &grower, &grower_model, &rng, 256, 4);
	ck_assert_int_ge(metric(&node, RELEASES), 1);
	ck_assert_int_lt(metric(&node, KEPT_MAPS) + metric(&node, KEPT_EXTENTS), kept);
	ck_assert_int_eq(metric(&node, "zipcache_view_drops_total"), 0);
	ck_assert_int_le(metric(&node, "zipcache_memory_used_bytes"), 13 << 20);
	CHECK(session_matches, i, &idle_model);
	CHECK(session_matches, g, &grower_model);
	ck_assert_int_eq(zc_session_close(g), 0);
	ck_assert_int_eq(zc_session_close(i), 0);
	model_free(&grower_model);
	model_free(&idle_model);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

START_TEST(an_import_is_never_refused_for_kept_pages)
{
	struct node node;
	struct model model;
	struct rng rng;
	char path[PATH_MAX + 32];
	rng_seed(&rng, 7);
	/* 12 MiB: the closed session's kept pages (about 10.6 MiB) leave less
	 * room than its snapshot needs. */
	node_start(&node, (const char *const[]){ "--memory-budget", "12M", NULL });
	zc_session_config config = big_config("exported", 2048);
	zc_session *s = filled(&node, &config, &model, &rng, 256, 8);
	snprintf(path, sizeof(path), "%s/snapshot.zcsnap", node.service.daemon.dir);
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	uint64_t bytes = 0;
	ck_assert_int_eq(zc_session_export(s, fd, &bytes), 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	long long used = metric(&node, "zipcache_memory_used_bytes");
	ck_assert_int_gt(used + (long long)bytes, 12 << 20);

	zc_import_options options;
	zc_import_options_default(&options);
	options.name = "exported";
	options.views = ZC_VIEWS_NONE;   /* no map of the kept one's size */
	zc_session *imported = NULL;
	int rc = zc_session_import(node.service.client, fd, &options, &imported);
	ck_assert_msg(rc == 0, "import: %s (%s)", zc_error_name(rc),
		      zc_client_last_error(node.service.client));
	close(fd);
	ck_assert_int_ge(metric(&node, RELEASES) + metric(&node, REUSED_EXTENTS), 1);
	ck_assert_int_le(metric(&node, "zipcache_memory_used_bytes"), 12 << 20);
	CHECK(session_matches, imported, &model);
	ck_assert_int_eq(zc_session_close(imported), 0);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

START_TEST(retain_bytes_zero_gives_everything_back)
{
	struct node node;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 8);
	node_start(&node, (const char *const[]){ "--retain-bytes", "0", NULL });
	zc_session_config config = big_config("gone", 2048);
	zc_session *s = filled(&node, &config, &model, &rng, 256, 4);
	ck_assert_int_eq(zc_session_close(s), 0);
	ck_assert_int_eq(metric(&node, KEPT_MAPS), 0);
	ck_assert_int_eq(metric(&node, KEPT_EXTENTS), 0);
	ck_assert_int_eq(metric(&node, "zipcache_retain_limit_bytes"), 0);
	/* Every page back (the pool file keeps its header page; the client's
	 * staging buffer stays charged to its connection). */
	ck_assert_int_eq(metric(&node, "zipcache_memory_file_bytes{kind=\"retained\"}"), 0);
	ck_assert_int_eq(metric(&node, "zipcache_memory_file_bytes{kind=\"views\"}"), 0);
	ck_assert_int_le(metric(&node, "zipcache_memory_file_bytes{kind=\"blocks\"}"), 4096);
	model_free(&model);
	s = filled(&node, &config, &model, &rng, 256, 1);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 0);
	ck_assert_int_eq(metric(&node, REUSED_EXTENTS), 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

/* The address space a session's layout needs, from the refusal of a
 * daemon that may map almost nothing. */
static unsigned long long layout_needs(const zc_session_config *config)
{
	struct node node;
	zc_session *s = NULL;
	node_start(&node, (const char *const[]){ "--max-mapped-bytes", "4096", NULL });
	ck_assert_int_eq(zc_session_open(node.service.client, config, &s), ZC_EEXHAUSTED);
	const char *why = zc_client_last_error(node.service.client);
	const char *at = strstr(why, "layout needs ");
	ck_assert_msg(at != NULL, "the refusal does not say what the layout needs: %s", why);
	unsigned long long needs = strtoull(at + strlen("layout needs "), NULL, 10);
	service_stop(&node.service);
	ck_assert_uint_gt(needs, 0);
	return needs;
}

/*
 * A kept map keeps the daemon's mapping of it too (its page tables are
 * the next session's), and that mapping still counts against
 * --max-mapped-bytes: a session that would not fit beside it takes its
 * place, as memory relief would take its pages, instead of being refused.
 */
START_TEST(a_kept_mapping_gives_way_under_max_mapped_bytes)
{
	struct node node;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 9);
	zc_session_config first = big_config("first", 2048);
	zc_session_config wide = big_config("wide", 4096);
	unsigned long long first_needs = layout_needs(&first), wide_needs = layout_needs(&wide);
	/* Room for either, not for the wide one beside the first's views. */
	unsigned long long limit = wide_needs + first_needs / 2;
	char arg[32];
	snprintf(arg, sizeof(arg), "%llu", limit);
	node_start(&node, (const char *const[]){ "--max-mapped-bytes", arg, NULL });
	zc_session *s = filled(&node, &first, &model, &rng, 256, 8);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	long long kept = metric(&node, KEPT_MAPS);
	ck_assert_int_gt(kept, 8 << 20);
	/* The kept map's mapping is at least its pages: with it, the wide
	 * session is past the limit. */
	ck_assert_uint_gt((unsigned long long)kept + wide_needs, limit);
	s = filled(&node, &wide, &model, &rng, 512, 2);
	ck_assert_int_eq(metric(&node, KEPT_MAPS), 0);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	/* The wide one's map is kept in turn, and serves the next of its size. */
	ck_assert_int_gt(metric(&node, KEPT_MAPS), 0);
	s = filled(&node, &wide, &model, &rng, 300, 1);
	ck_assert_int_eq(metric(&node, REUSED_MAPS), 1);
	CHECK(update_checked, node.service.client, s, &model, &rng, 0, 7);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	service_stop(&node.service);
}
END_TEST

/*
 * A direct block whose residual went into a block of its own first, then
 * was refused by the budget, frees that block: its extent is kept. Memory
 * relief then released those very pages and called it progress, the
 * update ran again, wrote and freed them again: the daemon spun on the
 * request and never answered (the hardening kill loop under a 10M
 * budget). Budgets around the one where the residual's block fits and the
 * direct block does not: every update is answered, a refusal leaves the
 * session as it was, and at least one refusal released kept pages (the
 * path that spun). Returns whether this budget reached that path.
 */
static bool refused_direct_block_answers(uint64_t budget, uint64_t seed)
{
	struct node node;
	struct model model;
	struct rng rng;
	char arg[32];
	zc_layer_stats before, after;
	rng_seed(&rng, seed);
	snprintf(arg, sizeof(arg), "%llu", (unsigned long long)budget);
	node_start(&node, (const char *const[]){ "--memory-budget", arg, NULL });
	/* A refusal answers at once; a spin would show as this timeout. */
	ck_assert_int_eq(zc_client_set_timeout(node.service.client, 5000), 0);
	/* Staging for both updates made first, so that the second one's
	 * input never grows it (a refused staging buffer refuses the update
	 * before the store is touched). */
	void *staging = NULL;
	zc_session_config config = big_config("direct", 1024);
	zc_session *s = NULL;
	if (zc_client_staging(node.service.client, 1 << 20, &staging) < 0 ||
	    zc_session_open(node.service.client, &config, &s) < 0) {
		service_stop(&node.service);
		return false;
	}
	model_init(&model, &config);
	struct block block;
	block_make(&block, &model, 100, &rng);
	int rc = zc_update_and_fetch(s, 0, 100, block.keys, block.values, NULL, NULL);
	block_free(&block);
	bool reached = false;
	if (rc == 0) {
		ck_assert_int_eq(zc_session_stats(s, &before, 1, NULL), 0);
		ck_assert_uint_eq(before.residual_tokens, 100);
		block_make(&block, &model, 200, &rng);
		rc = zc_update_and_fetch(s, 0, 200, block.keys, block.values, NULL, NULL);
		block_free(&block);
		ck_assert_msg(rc == 0 || rc == ZC_EEXHAUSTED, "budget %llu: the direct block: %s (%s)",
			      (unsigned long long)budget, zc_error_name(rc),
			      zc_client_last_error(node.service.client));
		if (rc == ZC_EEXHAUSTED) {
			/* Nothing stored, and the daemon serves on. */
			ck_assert_int_eq(zc_session_stats(s, &after, 1, NULL), 0);
			ck_assert_uint_eq(after.tokens, before.tokens);
			ck_assert_uint_eq(after.residual_tokens, 100);
			ck_assert_uint_eq(after.blocks, 0);
			reached = metric(&node, RELEASES) > 0;
		}
	}
	zc_session_release(s);
	model_free(&model);
	service_stop(&node.service);
	return reached;
}

START_TEST(a_refused_direct_block_is_answered_not_retried_forever)
{
	int reached = 0;
	/* Where the path is (found by a sweep of 2-5 MiB, 64 KiB apart, on
	 * this layout: the 1 MiB staging buffer, 400 KiB of views and as
	 * much residual, then a 110 KiB block for the residual's rows while
	 * the direct block needs 220 KiB and 800 KiB of views): 3264-3392
	 * KiB; the sweep is wider, in 32 KiB steps. */
	for (uint64_t budget = 3200ull << 10; budget <= 3520ull << 10; budget += 32 << 10)
		reached += refused_direct_block_answers(budget, budget);
	fprintf(stderr, "refused direct blocks that released their own kept pages: %d budgets\n",
		reached);
	ck_assert_int_gt(reached, 0);
}
END_TEST

static Suite *retain_suite(void)
{
	Suite *suite = suite_create("retain");
	const struct test_case cases[] = {
		{ "reuse", { a_kept_map_and_kept_extents_serve_the_next_session_bit_exact,
			     retain_bytes_zero_gives_everything_back,
			     a_kept_mapping_gives_way_under_max_mapped_bytes,
			     a_kept_maps_reservations_hold_only_where_its_pages_do,
			     a_kept_maps_reservations_serve_only_its_own_layout, NULL } },
		{ "relief", { relief_takes_kept_pages_before_any_view,
			      an_import_is_never_refused_for_kept_pages, NULL } },
		{ "spin", { a_refused_direct_block_is_answered_not_retried_forever, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 120);
	return suite;
}

int main(void)
{
	return suite_main(retain_suite(), CK_FORK);
}
