/*
 * The compressed store as the product, through a real daemon: leases keep
 * a reader's views from memory relief and tell it when they end
 * (ZC_ESTALE, never silent zeros); views = none sessions cost their
 * compressed bytes; --view-idle-seconds drops idle views without
 * pressure; forks share blocks by reference, go on independently, and
 * come back from a crash with their sharing.
 *
 * Checked by order and by bounded polling, never by time: the one wait
 * on the clock is for a lease of 1 s to run out, and it only asserts what
 * holds after it.
 */
#include <check.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "suite_main.h"
#include "zipcache/client.h"

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
	nanosleep(&ts, NULL);
}

static zc_session_config config_of(const char *name, uint32_t max_tokens)
{
	zc_session_config c = streaming_config(name, 2, 8, 128, max_tokens, 0);
	return c;
}

static void memory(zc_client *client, zc_memory_stats *st)
{
	ck_assert_int_eq(zc_client_memory_stats(client, st), 0);
}

/* Whether every layer's view of the session is valid, as its map says. */
static uint32_t views_valid(const zc_session *session)
{
	const zc_map_header *m = zc_session_map(session);
	uint32_t valid = 0;
	for (uint32_t i = 0; i < m->layers; i++)
		valid += __atomic_load_n(&m->layer[i].view_valid, __ATOMIC_ACQUIRE) != 0;
	return valid;
}

/*
 * The scenario that failed before leases: a reader holds a view; another
 * client's sessions push the daemon past its budget. While the lease
 * runs, relief may not take the reader's views (the other client is
 * refused instead) and the bytes it reads stay the model's. Once the
 * lease ran out, relief takes them, and the reader is told: its lease
 * check says ZC_ESTALE, and fetching the view again gives the model back.
 */
START_TEST(a_leased_view_survives_relief_and_an_expired_one_is_told)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", "10M", "--lease-seconds", "1",
				     "--view-idle-seconds", "0", "--idle-ttl", "0", NULL };
	zc_session_config config = config_of("reader", 1024);
	struct model model;
	struct rng rng;

	daemon_start(&daemon, args);
	zc_client *reader_client = connect_client(&daemon);
	zc_client *other = connect_client(&daemon);
	zc_session *reader = open_session(reader_client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 7);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, reader_client, reader, &model, &rng, layer, 300);
	zc_view held[2];
	for (uint32_t layer = 0; layer < 2; layer++)
		ck_assert_int_eq(zc_session_view(reader, layer, &held[layer]), 0);
	ck_assert_int_eq(zc_session_lease_check(reader), 0);

	/* Pressure from the other client, right away: inside the lease. */
	zc_session_config big = config_of("pressure", 4096);
	zc_session *pressure = open_session(other, &big);
	struct model pressure_model;
	model_init(&pressure_model, &big);
	int refused = 0;
	for (int step = 0; step < 12 && !refused; step++) {
		struct block block;
		block_make(&block, &pressure_model, 256, &rng);
		zc_view ignored;
		int rc = zc_update_and_fetch(pressure, step % 2, 256, block.keys, block.values, &ignored,
					     NULL);
		if (rc == 0)
			model_update(&pressure_model, step % 2, 256, block.keys, block.values);
		else
			refused = rc;
		block_free(&block);
	}
	/* The lease is 1 s: the loop above is far shorter on any machine
	 * that can run the suite, and what follows holds either way. */
	if (zc_session_lease_check(reader) == 0) {
		ck_assert_msg(refused == ZC_EEXHAUSTED, "the pressure was never refused (%d)", refused);
		ck_assert_uint_eq(views_valid(reader), 2);
		for (uint32_t layer = 0; layer < 2; layer++) {
			char why[WHY_BYTES];
			ck_assert_msg(view_matches(&model, layer, &held[layer], why, sizeof(why)),
				      "a leased view changed under relief: %s", why);
		}
	}

	/* The lease runs out; the same pressure now takes the reader's views. */
	sleep_ms(1300);
	ck_assert_int_eq(zc_session_lease_check(reader), ZC_ESTALE);
	bool dropped = false;
	for (int step = 0; step < 12 && !dropped; step++) {
		struct block block;
		block_make(&block, &pressure_model, 256, &rng);
		zc_view ignored;
		if (zc_update_and_fetch(pressure, step % 2, 256, block.keys, block.values, &ignored,
					NULL) == 0)
			model_update(&pressure_model, step % 2, 256, block.keys, block.values);
		block_free(&block);
		dropped = views_valid(reader) < 2;
	}
	ck_assert_msg(dropped, "relief never took the views of an expired lease");
	/* Told, not fooled: the check says so, and a fresh view is the model. */
	ck_assert_int_eq(zc_session_lease_check(reader), ZC_ESTALE);
	ck_assert_int_eq(zc_session_release_views(pressure), 0);
	CHECK(session_matches, reader, &model);
	ck_assert_int_eq(zc_session_lease_check(reader), 0);

	zc_session_release(pressure);
	zc_session_release(reader);
	model_free(&model);
	model_free(&pressure_model);
	zc_client_close(other);
	zc_client_close(reader_client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* A released lease is one relief may take at once; a closed connection
 * releases its leases too. */
START_TEST(release_and_disconnect_end_leases)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", "10M", "--view-idle-seconds", "0",
				     "--idle-ttl", "0", NULL };
	zc_session_config config = config_of("released", 1024);
	struct model model;
	struct rng rng;
	zc_session_info info;
	size_t count;

	daemon_start(&daemon, args);
	zc_client *owner = connect_client(&daemon);
	zc_session *session = open_session(owner, &config);
	model_init(&model, &config);
	rng_seed(&rng, 8);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, owner, session, &model, &rng, layer, 300);
	ck_assert_int_eq(zc_client_list_sessions(owner, &info, 1, &count), 0);
	ck_assert(info.leased);
	ck_assert_int_eq(zc_session_release_views(session), 0);
	ck_assert_int_eq(zc_session_lease_check(session), ZC_ESTALE);
	ck_assert_int_eq(zc_client_list_sessions(owner, &info, 1, &count), 0);
	ck_assert(!info.leased);
	/* Unknown sessions are refused, and nothing changes. */
	ck_assert_int_eq(zc_client_close_session(owner, 999), ZC_ENOTFOUND);

	/* A second client leases it by using it, then goes away. */
	zc_client *visitor = connect_client(&daemon);
	config.attach = true;
	zc_session *visit = open_session(visitor, &config);
	ck_assert_int_eq(zc_client_list_sessions(owner, &info, 1, &count), 0);
	ck_assert(info.leased);
	zc_session_release(visit);
	zc_client_close(visitor);
	bool free_again = false;
	for (int i = 0; i < 100 && !free_again; i++) {
		ck_assert_int_eq(zc_client_list_sessions(owner, &info, 1, &count), 0);
		free_again = !info.leased;
		if (!free_again)
			sleep_ms(20);
	}
	ck_assert_msg(free_again, "a closed connection's lease outlived it");
	CHECK(session_matches, session, &model);
	zc_session_release(session);
	model_free(&model);
	zc_client_close(owner);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* views = none: no fp16 anywhere; the tokens and the accounting are the
 * model's, and the memory is the compressed blocks plus the residual. */
START_TEST(views_none_costs_its_compressed_bytes)
{
	struct daemon_harness daemon;
	zc_session_config config = config_of("compressed", 4096);
	struct model model;
	struct rng rng;
	zc_memory_stats st;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	config.views = ZC_VIEWS_NONE;
	zc_session *session = open_session(client, &config);
	ck_assert_int_eq(zc_session_get_info(session)->views, ZC_VIEWS_NONE);
	model_init(&model, &config);
	rng_seed(&rng, 9);
	for (uint32_t layer = 0; layer < 2; layer++) {
		struct block block;
		block_make(&block, &model, 2048, &rng);
		zc_view view;
		zc_layer_stats stats, want;
		ck_assert_int_eq(zc_update_and_fetch(session, layer, 2048, block.keys, block.values,
						     &view, &stats), 0);
		ck_assert_int_eq(model_update(&model, layer, 2048, block.keys, block.values), 0);
		ck_assert(view.keys == NULL && view.values == NULL);
		ck_assert_uint_eq(view.tokens, 2048);
		model_layer_stats(&model, layer, &want);
		ck_assert_uint_eq(stats.compressed_key_bytes, want.compressed_key_bytes);
		ck_assert_uint_eq(stats.compressed_value_bytes, want.compressed_value_bytes);
		block_free(&block);
		for (int step = 0; step < 40; step++)   /* decode, through the residual */
			CHECK(update_checked, client, session, &model, &rng, layer, 1);
	}
	zc_view view;
	ck_assert_int_eq(zc_session_view(session, 0, &view), ZC_EPRECONDITION);
	memory(client, &st);
	zc_layer_stats total;
	model_total_stats(&model, &total);
	uint64_t fp16 = total.fp16_key_bytes + total.fp16_value_bytes;
	fprintf(stderr, "views=none: %llu bytes held for %llu fp16 bytes (views %llu, blocks %llu, "
			"residual %llu, index %llu, headers %llu)\n",
		(unsigned long long)st.file_bytes, (unsigned long long)fp16,
		(unsigned long long)st.views_bytes, (unsigned long long)st.blocks_bytes,
		(unsigned long long)st.residual_bytes, (unsigned long long)st.index_bytes,
		(unsigned long long)st.headers_bytes);
	ck_assert_uint_eq(st.views_bytes, 0);
	/* Blocks: what the codec says, page-rounded per block, plus the pool's header page. */
	ck_assert_uint_ge(st.blocks_bytes, total.compressed_key_bytes + total.compressed_value_bytes -
						   4 * (uint64_t)config.layers * 128 * 8 * 128);
	ck_assert_uint_le(st.file_bytes, fp16 / 2);
	/* Read the client's way (blocks and residual), it is the model's. */
	CHECK(session_matches, session, &model);
	zc_session_release(session);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Views of a session nobody uses go after --view-idle-seconds, without
 * any memory pressure; the next use rebuilds them bit for bit. */
START_TEST(idle_views_are_dropped_and_rebuilt)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--view-idle-seconds", "1", "--lease-seconds", "1",
				     "--idle-ttl", "0", NULL };
	zc_session_config config = config_of("idle", 1024);
	struct model model;
	struct rng rng;
	zc_memory_stats st;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 10);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, client, session, &model, &rng, layer, 500);
	memory(client, &st);
	ck_assert_uint_gt(st.views_bytes, 0);
	bool dropped = false;
	for (int i = 0; i < 100 && !dropped; i++) {
		sleep_ms(100);
		memory(client, &st);
		dropped = st.views_bytes == 0;
	}
	ck_assert_msg(dropped, "the idle session still holds %llu bytes of views",
		      (unsigned long long)st.views_bytes);
	ck_assert_uint_eq(views_valid(session), 0);
	CHECK(session_matches, session, &model);
	ck_assert_uint_eq(views_valid(session), 2);
	zc_session_release(session);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* A same-uid process that cuts the pool file under the daemon destroys its
 * own blocks, and nothing more: the daemon (which never maps the pool)
 * answers every request after it, a rebuild that needs the lost bytes
 * fails with an error, and new blocks still go in. */
START_TEST(a_cut_pool_is_an_error_not_a_crash)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--view-idle-seconds", "1", "--lease-seconds", "1",
				     "--idle-ttl", "0", NULL };
	zc_session_config config = config_of("victim", 1024);
	struct model model;
	struct rng rng;
	zc_memory_stats st;
	char path[PATH_MAX + 32];

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 13);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, client, session, &model, &rng, layer, 400);
	ck_assert_int_eq(zc_session_release_views(session), 0);
	bool dropped = false;
	for (int i = 0; i < 100 && !dropped; i++) {
		sleep_ms(100);
		memory(client, &st);
		dropped = st.views_bytes == 0;
	}
	ck_assert(dropped);

	snprintf(path, sizeof(path), "%s/pool-%u.zcp", daemon.shm_dir, (unsigned)getuid());
	ck_assert_int_eq(chmod(path, 0600), 0);
	int fd = open(path, O_RDWR);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, 0), 0);
	close(fd);

	zc_view view;
	int rc = zc_session_view(session, 0, &view);
	ck_assert_msg(rc < 0 && !daemon_lost(rc), "a rebuild from a cut pool gave %s",
		      zc_error_name(rc));
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	/* A new session's blocks go in (the pool grows again where written). */
	zc_session_config other = config_of("after", 1024);
	zc_session *fresh = open_session(client, &other);
	struct model fresh_model;
	model_init(&fresh_model, &other);
	CHECK(update_checked, client, fresh, &fresh_model, &rng, 0, 300);
	CHECK(session_matches, fresh, &fresh_model);
	zc_session_release(fresh);
	zc_session_release(session);
	model_free(&model);
	model_free(&fresh_model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static uint64_t shared_bytes_of(zc_client *client, const char *name)
{
	zc_session_info infos[8];
	size_t count = 0;
	ck_assert_int_eq(zc_client_list_sessions(client, infos, 8, &count), 0);
	for (size_t i = 0; i < count; i++)
		if (strcmp(infos[i].name, name) == 0)
			return infos[i].shared_bytes;
	ck_abort_msg("no session '%s'", name);
	return 0;
}

/*
 * A fork inside a block and past the residual's start: both sessions are
 * the model's, share blocks (counted once in memory), go on
 * independently, survive the other's close, and come back after a crash
 * with their sharing.
 */
START_TEST(forks_share_blocks_and_go_on_independently)
{
	struct daemon_harness daemon;
	zc_session_config config = config_of("prompt", 2048);
	struct model prompt, branch, second;
	struct rng rng;
	zc_memory_stats before, after;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *source = open_session(client, &config);
	model_init(&prompt, &config);
	rng_seed(&rng, 11);
	for (uint32_t layer = 0; layer < 2; layer++) {
		CHECK(update_checked, client, source, &prompt, &rng, layer, 600);
		CHECK(update_checked, client, source, &prompt, &rng, layer, 300);
		for (int step = 0; step < 20; step++)
			CHECK(update_checked, client, source, &prompt, &rng, layer, 1);
	}
	memory(client, &before);

	/* Inside the second block: its first 100 tokens are the fork's. */
	zc_session *fork = NULL;
	ck_assert_int_eq(zc_session_fork(source, 700, "branch", ZC_VIEWS_SOURCE, &fork), 0);
	model_fork(&branch, &prompt, 700);
	CHECK(session_matches, fork, &branch);
	memory(client, &after);
	ck_assert_msg(after.blocks_bytes == before.blocks_bytes,
		      "a fork copied blocks: %llu bytes of blocks before, %llu after",
		      (unsigned long long)before.blocks_bytes, (unsigned long long)after.blocks_bytes);
	ck_assert_uint_gt(shared_bytes_of(client, "prompt"), 0);
	ck_assert_uint_eq(shared_bytes_of(client, "prompt"), shared_bytes_of(client, "branch"));

	/* Into the residual, views = none. */
	zc_session *none = NULL;
	ck_assert_int_eq(zc_session_fork(source, 905, "none", ZC_VIEWS_NONE, &none), 0);
	ck_assert_int_eq(zc_session_get_info(none)->views, ZC_VIEWS_NONE);
	ck_assert_uint_eq(zc_session_get_info(none)->max_layer_tokens, 905);

	/* Independent: updates and trims of either leave the other as it was. */
	model_fork(&second, &prompt, UINT32_MAX);
	for (uint32_t layer = 0; layer < 2; layer++) {
		CHECK(update_checked, client, fork, &branch, &rng, layer, 37);
		CHECK(update_checked, client, source, &prompt, &rng, layer, 5);
	}
	CHECK(trim_checked, client, source, &prompt, 400);
	CHECK(session_matches, fork, &branch);
	CHECK(trim_checked, client, fork, &branch, 10);
	CHECK(session_matches, source, &prompt);

	/* A crash: both come back, bit for bit, still sharing. */
	zc_session_release(none);
	zc_session_release(fork);
	zc_session_release(source);
	zc_client_close(client);
	daemon_kill(&daemon);
	daemon_restart(&daemon);
	client = connect_client(&daemon);
	zc_session_config attach = config;
	attach.attach = true;
	source = open_session(client, &attach);
	attach.name = "branch";
	fork = open_session(client, &attach);
	CHECK(session_matches, source, &prompt);
	CHECK(session_matches, fork, &branch);
	ck_assert_uint_gt(shared_bytes_of(client, "branch"), 0);

	/* Closing the source (and the views = none fork) leaves the branch
	 * whole, and its blocks no longer shared. */
	ck_assert_int_eq(zc_session_close(source), 0);
	ck_assert_int_eq(zc_client_close_session(client, zc_session_get_info(fork)->id + 1), 0);
	CHECK(session_matches, fork, &branch);
	ck_assert_uint_eq(shared_bytes_of(client, "branch"), 0);
	ck_assert_int_eq(zc_session_close(fork), 0);
	model_free(&second);
	model_free(&prompt);
	model_free(&branch);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Fork refusals: an unknown source, a taken name; nothing is made. */
START_TEST(fork_refusals_make_nothing)
{
	struct daemon_harness daemon;
	zc_session_config config = config_of("origin", 256);
	struct model model;
	struct rng rng;
	zc_session_info infos[4];
	size_t count;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *source = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 12);
	CHECK(update_checked, client, source, &model, &rng, 0, 100);
	zc_session *out = NULL;
	int rc = zc_session_fork(source, 50, "origin", ZC_VIEWS_SOURCE, &out);
	assert_refused(client, rc, ZC_EEXISTS, "already exists", "fork onto a taken name");
	rc = zc_session_fork(source, 50, "bad", 7, &out);
	ck_assert_int_eq(rc, ZC_EINVALID);
	ck_assert_int_eq(zc_client_list_sessions(client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 1);
	CHECK(session_matches, source, &model);
	/* The daemon forgets a source closed meanwhile: NOT_FOUND. */
	ck_assert_int_eq(zc_client_close_session(client, zc_session_get_info(source)->id), 0);
	rc = zc_session_fork(source, 50, "late", ZC_VIEWS_SOURCE, &out);
	assert_refused(client, rc, ZC_ENOTFOUND, "no session", "fork of a closed session");
	zc_session_release(source);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

int main(void)
{
	Suite *suite = suite_create("leases");
	const struct test_case cases[] = {
		{ "leases", { a_leased_view_survives_relief_and_an_expired_one_is_told,
			      release_and_disconnect_end_leases, NULL } },
		{ "views", { views_none_costs_its_compressed_bytes, idle_views_are_dropped_and_rebuilt,
			     a_cut_pool_is_an_error_not_a_crash, NULL } },
		{ "fork", { forks_share_blocks_and_go_on_independently, fork_refusals_make_nothing,
			    NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 120);
	return suite_main(suite, CK_FORK);
}
