/*
 * Offload of sessions to the remote tier and their restore on attach
 * (docs/REMOTE.md "Offload and restore"), against real redis-servers
 * (tests/redis_harness.c) and real daemons: two daemons with their own
 * sockets and shm-dirs on the same Redis are two nodes.
 *
 *   round trip     A session idle past --offload-idle-seconds leaves the
 *                  node (list, files) for Redis, every key with an expiry;
 *                  attach on the same node and on the other restores it
 *                  bit for bit (views full and none, every counter), after
 *                  which the remote copy is gone and the session takes
 *                  more appends like the model. Standalone and cluster.
 *   redis down     Offload fails, the session stays local and usable, the
 *                  failure is counted and logged once, and once Redis is
 *                  back the offload succeeds.
 *   killed mid     Redis SIGKILLed between two layers' writes: local intact,
 *                  offloaded whole once Redis is back. SIGKILLed while a
 *                  restore fetches: the attach fails, nothing is left (no
 *                  file, block or charge), the daemon serves on, and the
 *                  restore works once Redis is back with its data.
 *   budget         The memory budget runs out in the middle of a restore's
 *                  pipeline: RESOURCE_EXHAUSTED, nothing left, the charge
 *                  back to the byte, the remote copy untouched.
 *   damaged copy   One block deleted or one byte flipped in Redis: attach
 *                  fails naming the block, nothing is made; repaired, it
 *                  restores.
 *   touched        A request that arrives while the offload is written
 *                  keeps the session local.
 *   uids           Another uid's attach of the name never reaches the
 *                  offloaded session.
 *   relief         Memory relief offloads an idle session to make room.
 *   crashes        The daemon killed at every offload and restore step:
 *                  after a restart the session is there (adopted or
 *                  restored), bit for bit.
 */
#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "redis_harness.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define WAIT_MS 20000
#define NOBODY 65534

static struct redis_server standalone;
static struct redis_cluster cluster;

static void standalone_up(void)
{
	if (redis_installed())
		redis_server_start(&standalone, NULL, NULL);
}

static void standalone_down(void)
{
	if (standalone.pid)
		redis_server_stop(&standalone);
}

static void cluster_up(void)
{
	if (redis_installed())
		redis_cluster_start(&cluster);
}

static void cluster_down(void)
{
	if (cluster.nodes[0].pid)
		redis_cluster_stop(&cluster);
}

/* The Redis a test uses: the standalone server or the cluster's nodes. */
struct tier {
	struct redis_server *nodes[REDIS_CLUSTER_NODES];
	int n;
	char url[256];
};

static struct tier tier_standalone(void)
{
	struct tier t = { .nodes = { &standalone }, .n = 1 };
	snprintf(t.url, sizeof(t.url), "redis://127.0.0.1:%u", standalone.port);
	return t;
}

static struct tier tier_cluster(void)
{
	struct tier t = { .n = REDIS_CLUSTER_NODES };
	size_t used = (size_t)snprintf(t.url, sizeof(t.url), "redis://");
	for (int i = 0; i < REDIS_CLUSTER_NODES; i++) {
		t.nodes[i] = &cluster.nodes[i];
		used += (size_t)snprintf(t.url + used, sizeof(t.url) - used, "%s127.0.0.1:%u",
					 i ? "," : "", cluster.nodes[i].port);
	}
	return t;
}

static void tier_flush(const struct tier *t)
{
	for (int i = 0; i < t->n; i++)
		freeReplyObject(redis_command(t->nodes[i], "FLUSHALL"));
}

/* Keys matching pattern over every node: their count; names[] (if given)
 * gets up to max of them (malloc'd), with their node. */
static int tier_keys(const struct tier *t, const char *pattern, char **names, int *node, int max)
{
	int count = 0;
	for (int i = 0; i < t->n; i++) {
		redisReply *r = redis_command(t->nodes[i], "KEYS %s", pattern);
		ck_assert_int_eq(r->type, REDIS_REPLY_ARRAY);
		for (size_t k = 0; k < r->elements; k++, count++)
			if (names && count < max) {
				names[count] = strdup(r->element[k]->str);
				node[count] = i;
			}
		freeReplyObject(r);
	}
	return count;
}

static void names_free(char **names, int n)
{
	for (int i = 0; i < n; i++)
		free(names[i]);
}

/* Every key of ours has an expiry (PTTL > 0). */
static void tier_keys_expire(const struct tier *t)
{
	char *names[256];
	int node[256];
	int n = tier_keys(t, "zc:*", names, node, 256);
	ck_assert_int_gt(n, 0);
	for (int i = 0; i < n && i < 256; i++) {
		redisReply *r = redis_command(t->nodes[node[i]], "PTTL %s", names[i]);
		ck_assert_int_eq(r->type, REDIS_REPLY_INTEGER);
		ck_assert_msg(r->integer > 0, "key %s has PTTL %lld", names[i], (long long)r->integer);
		freeReplyObject(r);
	}
	names_free(names, n < 256 ? n : 256);
}



/* A node: a daemon on the tier with a metrics port. */
struct node {
	struct service service;
	uint16_t metrics_port;
};

static void node_start(struct node *node, const struct tier *t, const char *idle_seconds,
		       const char *const *more)
{
	const char *args[24];
	int n = 0;
	args[n++] = "--remote";
	args[n++] = t->url;
	args[n++] = "--offload-idle-seconds";
	args[n++] = idle_seconds;
	args[n++] = "--remote-timeout-ms";
	args[n++] = "1000";
	for (int i = 0; more && more[i]; i++)
		args[n++] = more[i];
	args[n] = NULL;
	node->metrics_port = service_start_metrics(&node->service, args);
}

static void node_stop(struct node *node)
{
	service_stop(&node->service);
}

static size_t node_sessions(struct node *node)
{
	zc_session_info infos[16];
	size_t n = 0;
	ck_assert_int_eq(zc_client_list_sessions(node->service.client, infos, 16, &n), 0);
	return n;
}

static int shm_files(const struct node *node)
{
	DIR *dir = opendir(node->service.daemon.shm_dir);
	struct dirent *entry;
	int count = 0;
	ck_assert_ptr_nonnull(dir);
	while ((entry = readdir(dir)) != NULL)
		if (strstr(entry->d_name, ".zcs"))
			count++;
	closedir(dir);
	return count;
}

/* Waits until the node holds `sessions` sessions (an offload took one). */
static bool node_wait_sessions(struct node *node, size_t sessions, int timeout_ms)
{
	int64_t until = now_ms() + timeout_ms;
	while (now_ms() < until) {
		if (node_sessions(node) == sessions)
			return true;
		sleep_ms(50);
	}
	return false;
}

static bool tier_wait_keys(const struct tier *t, const char *pattern, int at_least, int timeout_ms)
{
	int64_t until = now_ms() + timeout_ms;
	while (now_ms() < until) {
		int n = tier_keys(t, pattern, NULL, NULL, 0);
		if (at_least > 0 ? n >= at_least : n == 0)
			return true;
		sleep_ms(20);
	}
	return false;
}

/* The session every test offloads: two layers, a block and a partial
 * residual in each. */
static zc_session_config config_of(const char *name, zc_views views)
{
	zc_session_config c = shaped_config(name, 2, 1, 2, 64, 64, 2048, ZC_POLICY_STREAMING, 16);
	c.views = views;
	c.model_id = "offload-model";
	return c;
}

static zc_session *session_build(zc_client *client, const zc_session_config *config,
				 struct model *model, struct rng *rng)
{
	zc_session *session = open_session(client, config);
	model_init(model, config);
	const uint32_t updates[] = { 40, 5 };
	for (int u = 0; u < 2; u++)
		for (uint32_t layer = 0; layer < config->layers; layer++)
			CHECK(update_checked, client, session, model, rng, layer, updates[u]);
	CHECK(session_matches, session, model);
	return session;
}

/* Lets go of the session so that it may be offloaded: no lease, no handle. */
static void session_leave(zc_session *session)
{
	ck_assert_int_eq(zc_session_release_views(session), 0);
	zc_session_release(session);
}

static zc_session *session_attach(struct node *node, const zc_session_config *config, int *rc_out)
{
	zc_session_config c = *config;
	zc_session *session = NULL;
	c.attach = true;
	int rc = zc_session_open(node->service.client, &c, &session);
	if (rc_out)
		*rc_out = rc;
	else
		ck_assert_msg(rc == 0, "attach of '%s': %s (%s)", config->name, zc_error_name(rc),
			      zc_client_last_error(node->service.client));
	return session;
}

static void more_appends(zc_client *client, zc_session *session, struct model *model,
			 struct rng *rng)
{
	const uint32_t steps[] = { 1, 20, 3 };
	for (size_t s = 0; s < 3; s++)
		for (uint32_t layer = 0; layer < model->layers; layer++)
			CHECK(update_checked, client, session, model, rng, layer, steps[s]);
	CHECK(session_matches, session, model);
}

/* SIGKILL by pid, no goodbye: what a crashed or OOM-killed Redis does
 * (redis_server_kill begins with SIGTERM, which closes the connections
 * in order). The server is this test's child. */
static void redis_kill_hard(struct redis_server *server)
{
	ck_assert_int_gt(server->pid, 0);
	ck_assert_int_eq(kill(server->pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(server->pid, NULL, 0), server->pid);
	server->pid = 0;
}

/* ---- round trips ---------------------------------------------------------------- */

static void round_trip(const struct tier *t, zc_views views)
{
	struct node one, two;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 77);
	tier_flush(t);
	node_start(&one, t, "1", NULL);
	node_start(&two, t, "1", NULL);
	zc_session_config config = config_of("trip", views);

	zc_session *s = session_build(one.service.client, &config, &model, &rng);
	session_leave(s);
	ck_assert_msg(node_wait_sessions(&one, 0, WAIT_MS), "the idle session was not offloaded");
	ck_assert_int_eq(shm_files(&one), 0);
	ck_assert_int_eq(tier_keys(t, "zc:*:m:*", NULL, NULL, 0), 1);
	/* two layers: a block and a residual each, and the manifest */
	ck_assert_int_eq(tier_keys(t, "zc:*", NULL, NULL, 0), 5);
	tier_keys_expire(t);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_offloads_total"), 1);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_offloaded_sessions"), 1);

	/* Back on the same node. */
	s = session_attach(&one, &config, NULL);
	ck_assert_int_eq(zc_session_get_info(s)->views, views);
	ck_assert_str_eq(zc_session_get_info(s)->model_id, "offload-model");
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_restores_total"), 1);
	ck_assert_msg(tier_wait_keys(t, "zc:*", 0, WAIT_MS), "the restored copy stayed in Redis");
	session_leave(s);
	ck_assert_msg(node_wait_sessions(&one, 0, WAIT_MS), "not offloaded the second time");

	/* On the other node: bit for bit, and it goes on like the model. */
	s = session_attach(&two, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(metric_value(two.metrics_port, "zipcache_remote_restores_total"), 1);
	more_appends(two.service.client, s, &model, &rng);
	ck_assert_int_eq(zc_session_close(s), 0);
	ck_assert_int_eq(node_sessions(&one), 0);
	model_free(&model);
	node_stop(&two);
	node_stop(&one);
}

START_TEST(round_trip_standalone)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	round_trip(&t, ZC_VIEWS_FULL);
	round_trip(&t, ZC_VIEWS_NONE);
}
END_TEST

START_TEST(round_trip_cluster)
{
	if (!cluster.nodes[0].pid)
		return;
	struct tier t = tier_cluster();
	round_trip(&t, ZC_VIEWS_FULL);
	round_trip(&t, ZC_VIEWS_NONE);
}
END_TEST

/* An attach of a name nobody offloaded, with a shape, still creates. */
START_TEST(attach_of_an_unknown_name_creates)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one;
	tier_flush(&t);
	node_start(&one, &t, "0", NULL);
	zc_session_config config = config_of("fresh", ZC_VIEWS_FULL);
	zc_session *s = session_attach(&one, &config, NULL);
	ck_assert_uint_eq(zc_session_get_info(s)->max_layer_tokens, 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	node_stop(&one);
}
END_TEST

/* ---- failures ---------------------------------------------------------------- */

static int log_count(const struct node *node, const char *needle)
{
	char *text = file_read_whole(node->service.daemon.log_path, NULL);
	int n = 0;
	for (char *p = text; p && (p = strstr(p, needle)); p += strlen(needle))
		n++;
	free(text);
	return n;
}

START_TEST(redis_down_keeps_sessions_local)
{
	if (!redis_installed())
		return;
	/* Its own server: one a test kills and starts again dies with the test. */
	struct redis_server own;
	redis_server_start(&own, NULL, NULL);
	struct tier t = { .nodes = { &own }, .n = 1 };
	snprintf(t.url, sizeof(t.url), "redis://127.0.0.1:%u", own.port);
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 5);
	tier_flush(&t);
	node_start(&one, &t, "1", (const char *const[]){ "--log-level", "info", NULL });
	zc_session_config config = config_of("stays", ZC_VIEWS_FULL);
	redis_server_kill(&own);

	zc_session *s = session_build(one.service.client, &config, &model, &rng);
	session_leave(s);
	/* Several tries' worth (1 s, then 2 s of backoff). */
	sleep_ms(4500);
	ck_assert_uint_eq(node_sessions(&one), 1);
	long long failed = metric_value(one.metrics_port,
					"zipcache_remote_offload_failures_total{reason=\"remote\"}");
	ck_assert_msg(failed >= 1 && failed <= 4, "%lld failures counted", failed);
	ck_assert_int_eq(log_count(&one, "event=\"offload failing\""), 1);
	s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	more_appends(one.service.client, s, &model, &rng);
	session_leave(s);

	redis_server_restart(&own);
	ck_assert_msg(node_wait_sessions(&one, 0, 70000), "not offloaded after Redis came back");
	ck_assert_int_eq(log_count(&one, "event=\"offload working again\""), 1);
	s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	node_stop(&one);
	redis_server_stop(&own);
}
END_TEST

START_TEST(redis_killed_mid_offload_leaves_the_session)
{
	if (!redis_installed())
		return;
	/* Its own server: one a test kills and starts again dies with the test. */
	struct redis_server own;
	redis_server_start(&own, NULL, NULL);
	struct tier t = { .nodes = { &own }, .n = 1 };
	snprintf(t.url, sizeof(t.url), "redis://127.0.0.1:%u", own.port);
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 6);
	tier_flush(&t);
	setenv("ZIPCACHED_FAULT_PAUSE", "offload.layer:3000", 1);
	node_start(&one, &t, "1", NULL);
	unsetenv("ZIPCACHED_FAULT_PAUSE");
	zc_session_config config = config_of("halfway", ZC_VIEWS_FULL);
	zc_session *s = session_build(one.service.client, &config, &model, &rng);
	session_leave(s);
	/* Layer 0 written, the daemon paused before layer 1. */
	ck_assert_msg(tier_wait_keys(&t, "zc:*:b:*", 1, WAIT_MS), "the offload never began");
	ck_assert_int_eq(tier_keys(&t, "zc:*:m:*", NULL, NULL, 0), 0);
	redis_kill_hard(&own);
	int64_t until = now_ms() + WAIT_MS;
	while (now_ms() < until &&
	       metric_value(one.metrics_port,
			    "zipcache_remote_offload_failures_total{reason=\"remote\"}") < 1)
		sleep_ms(100);
	ck_assert_int_ge(metric_value(one.metrics_port,
				      "zipcache_remote_offload_failures_total{reason=\"remote\"}"), 1);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_offloads_total"), 0);
	ck_assert_uint_eq(node_sessions(&one), 1);
	ck_assert_int_eq(shm_files(&one), 1);
	s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	more_appends(one.service.client, s, &model, &rng);
	session_leave(s);
	/* Back (empty: it kept nothing), the next try writes the whole session,
	 * appends included, and it restores bit for bit. */
	redis_server_restart(&own);
	ck_assert_msg(node_wait_sessions(&one, 0, 70000), "not offloaded after Redis came back");
	ck_assert_int_eq(shm_files(&one), 0);
	s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	node_stop(&one);
	redis_server_stop(&own);
}
END_TEST

/* Offloads the session on one; returns with it in Redis only. */
static void offload_one(struct node *one, const struct tier *t, const zc_session_config *config,
			struct model *model, struct rng *rng)
{
	zc_session *s = session_build(one->service.client, config, model, rng);
	session_leave(s);
	ck_assert_msg(node_wait_sessions(one, 0, WAIT_MS), "the idle session was not offloaded");
	ck_assert_int_eq(tier_keys(t, "zc:*:m:*", NULL, NULL, 0), 1);
}

static void attach_refused(struct node *node, const zc_session_config *config, int expected,
			   const char *needle)
{
	int rc;
	zc_session *s = session_attach(node, config, &rc);
	ck_assert_msg(rc == expected, "attach gave %s, expected %s (%s)", zc_error_name(rc),
		      zc_error_name(expected), zc_client_last_error(node->service.client));
	ck_assert_ptr_null(s);
	const char *why = zc_client_last_error(node->service.client);
	ck_assert_msg(strstr(why, needle), "the message \"%s\" does not name \"%s\"", why, needle);
	ck_assert_uint_eq(node_sessions(node), 0);
	ck_assert_int_eq(shm_files(node), 0);
}

/* A gauge or counter that must be there. */
static long long metric_present(uint16_t port, const char *sample)
{
	long long v = metric_value(port, sample);
	ck_assert_msg(v >= 0, "no sample %s in /metrics", sample);
	return v;
}

/* What a failed restore must give back exactly: the memory charged to
 * the budget (pages kept for reuse from closed sessions and freed extents
 * are charged too, and relief gives them back first: they are taken out),
 * and the pool's blocks. */
struct charge {
	long long used, retained, blocks;
};

static struct charge charge_read(uint16_t port)
{
	struct charge c = {
		.used = metric_present(port, "zipcache_memory_used_bytes"),
		.retained = metric_present(port, "zipcache_memory_file_bytes{kind=\"retained\"}"),
		.blocks = metric_present(port, "zipcache_memory_file_bytes{kind=\"blocks\"}"),
	};
	return c;
}

static void charge_same(uint16_t port, const struct charge *before, const char *what)
{
	struct charge after = charge_read(port);
	ck_assert_msg(after.used - after.retained == before->used - before->retained,
		      "%s: %lld bytes charged (%lld retained) after, %lld (%lld retained) before",
		      what, after.used, after.retained, before->used, before->retained);
	ck_assert_msg(after.blocks == before->blocks, "%s: the pool holds %lld bytes of blocks, "
		      "%lld before", what, after.blocks, before->blocks);
}

/* The daemon still serves: a new session takes updates and reads back. */
static void node_still_serves(struct node *node, struct rng *rng)
{
	zc_session_config config = config_of("still-serving", ZC_VIEWS_FULL);
	struct model model;
	zc_session *s = session_build(node->service.client, &config, &model, rng);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
}

/* An attach on a thread of its own, so that the test can act while the
 * daemon restores (the client is used by this thread only meanwhile). */
struct attach_call {
	struct node *node;
	zc_session_config config;
	pthread_t thread;
	int rc;
	zc_session *session;
	char why[512];
};

static void *attach_body(void *arg)
{
	struct attach_call *a = arg;
	a->rc = zc_session_open(a->node->service.client, &a->config, &a->session);
	snprintf(a->why, sizeof(a->why), "%s", zc_client_last_error(a->node->service.client));
	return NULL;
}

static void attach_begin(struct attach_call *a, struct node *node, const zc_session_config *config)
{
	memset(a, 0, sizeof(*a));
	a->node = node;
	a->config = *config;
	a->config.attach = true;
	ck_assert_int_eq(pthread_create(&a->thread, NULL, attach_body, a), 0);
}

static void attach_end(struct attach_call *a)
{
	ck_assert_int_eq(pthread_join(a->thread, NULL), 0);
}

/* The length of the one key matching pattern. */
static long long tier_key_len(const struct tier *t, const char *pattern)
{
	char *names[2];
	int node[2];
	ck_assert_int_eq(tier_keys(t, pattern, names, node, 2), 1);
	redisReply *r = redis_command(t->nodes[node[0]], "STRLEN %s", names[0]);
	ck_assert_int_eq(r->type, REDIS_REPLY_INTEGER);
	long long len = r->integer;
	freeReplyObject(r);
	names_free(names, 1);
	return len;
}

/*
 * Redis SIGKILLed while a restore is under way: layers 0-3 fetched and
 * verified, the builder holding layer 0 in the new session's temporary
 * file and pausing after it (restore.layer), the fetcher waiting for room
 * (3 layers ahead) before layer 4. The attach fails with Redis's error,
 * nothing is left (no session, no file, temporary or not, no block, the
 * budget's charge as before), the failure is counted, the daemon goes on
 * serving; once Redis is back with its data (restarted on its port and
 * directory, which hold the RDB the test saved) the attach restores the
 * session bit for bit.
 */
START_TEST(redis_killed_mid_restore_leaves_nothing)
{
	if (!redis_installed())
		return;
	struct redis_server own;
	redis_server_start(&own, NULL, NULL);
	struct tier t = { .nodes = { &own }, .n = 1 };
	snprintf(t.url, sizeof(t.url), "redis://127.0.0.1:%u", own.port);
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 13);
	tier_flush(&t);
	setenv("ZIPCACHED_FAULT_PAUSE", "restore.layer:1000", 1);
	node_start(&one, &t, "1", (const char *const[]){ "--log-level", "info", NULL });
	unsetenv("ZIPCACHED_FAULT_PAUSE");
	zc_session_config config = config_of("cut-off", ZC_VIEWS_FULL);
	config.layers = 6;
	offload_one(&one, &t, &config, &model, &rng);
	ck_assert_int_eq(tier_keys(&t, "zc:*", NULL, NULL, 0), 6 * 2 + 1);
	/* What Redis has now survives its death: the RDB in its directory. */
	freeReplyObject(redis_command(&own, "SAVE"));
	long long first_parts = tier_key_len(&t, "zc:*:m:*");
	for (int l = 0; l < 4; l++) {
		char pattern[64];
		snprintf(pattern, sizeof(pattern), "zc:*:b:*:%d:0", l);
		first_parts += tier_key_len(&t, pattern);
		snprintf(pattern, sizeof(pattern), "zc:*:r:*:%d", l);
		first_parts += tier_key_len(&t, pattern);
	}
	struct charge before = charge_read(one.metrics_port);
	long long received = metric_present(one.metrics_port, "zipcache_remote_received_bytes_total");

	struct attach_call a;
	attach_begin(&a, &one, &config);
	/* The manifest and layers 0-3 arrived: layer 4 waits for the builder,
	 * which sleeps a second after each layer. */
	int64_t until = now_ms() + WAIT_MS;
	while (now_ms() < until &&
	       metric_present(one.metrics_port, "zipcache_remote_received_bytes_total") <
		       received + first_parts)
		sleep_ms(10);
	ck_assert_msg(now_ms() < until, "layers 0-3 of the restore never arrived");
	redis_kill_hard(&own);
	attach_end(&a);
	/* UNAVAILABLE on the wire (ZC_EREMOTE): retry later; the sentence
	 * says what failed. */
	ck_assert_msg(a.rc == ZC_EREMOTE, "the attach gave %s (%s)", zc_error_name(a.rc), a.why);
	ck_assert_ptr_null(a.session);
	ck_assert_msg(strstr(a.why, "cannot read layer 4 of 'cut-off' from the remote tier") &&
		      strstr(a.why, "nothing was made"), "the message \"%s\"", a.why);

	ck_assert_uint_eq(node_sessions(&one), 0);
	ck_assert_int_eq(shm_files(&one), 0);
	charge_same(one.metrics_port, &before, "after the failed restore");
	ck_assert_int_eq(metric_value(one.metrics_port,
				      "zipcache_remote_restore_failures_total{reason=\"remote\"}"), 1);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_restores_total"), 0);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_up"), 0);
	ck_assert_int_eq(log_count(&one, "event=\"restore refused\""), 1);
	/* Redis still down: an attach says so, and creates nothing in place of the copy. */
	attach_refused(&one, &config, ZC_EREMOTE, "cannot read the manifest of 'cut-off'");
	ck_assert_int_ge(metric_value(one.metrics_port,
				      "zipcache_errors_total{reason=\"remote_unavailable\"}"), 1);
	node_still_serves(&one, &rng);

	redis_server_restart(&own);
	ck_assert_int_eq(tier_keys(&t, "zc:*", NULL, NULL, 0), 6 * 2 + 1);
	zc_session *s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_restores_total"), 1);
	ck_assert_msg(tier_wait_keys(&t, "zc:*", 0, WAIT_MS), "the restored copy stayed in Redis");
	more_appends(one.service.client, s, &model, &rng);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	node_stop(&one);
	redis_server_stop(&own);
}
END_TEST

/*
 * The memory budget runs out in the middle of the pipeline: the snapshot
 * (the room checked before anything is fetched) fits, its blocks in the
 * pool do not (each takes a page there; a record of this shape is about
 * 400 bytes), so the builder is refused after its first layers, with
 * relief's retry refused too. The attach fails with RESOURCE_EXHAUSTED,
 * nothing is left, the charge is as before to the byte; the remote copy
 * is untouched and restores on a node with room.
 */
START_TEST(budget_exhausted_mid_restore_leaves_nothing)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one, two;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 14);
	tier_flush(&t);
	node_start(&one, &t, "1", NULL);
	node_start(&two, &t, "0", (const char *const[]){ "--memory-budget", "2M", "--log-level",
							   "info", NULL });
	/* 4 layers of 1024 tokens in blocks of 4: 256 records a layer. */
	zc_session_config config = shaped_config("too-big", 4, 1, 1, 64, 64, 2048,
						 ZC_POLICY_STREAMING, 4);
	config.views = ZC_VIEWS_NONE;
	config.model_id = "offload-model";
	zc_session *s = open_session(one.service.client, &config);
	model_init(&model, &config);
	/* An update of 4 tokens fills the residual: one block each. */
	for (int u = 0; u < 256; u++)
		for (uint32_t layer = 0; layer < config.layers; layer++)
			CHECK(update_checked, one.service.client, s, &model, &rng, layer, 4);
	CHECK(session_matches, s, &model);
	session_leave(s);
	ck_assert_msg(node_wait_sessions(&one, 0, WAIT_MS), "the idle session was not offloaded");
	long long keys = tier_keys(&t, "zc:*", NULL, NULL, 0);
	ck_assert_int_eq(keys, 4 * 257 + 1);

	/* The uid's pool made first (an open makes it), so that the failure's
	 * accounting is about the restore alone. */
	zc_session_config small = config_of("small", ZC_VIEWS_NONE);
	ck_assert_int_eq(zc_session_close(open_session(two.service.client, &small)), 0);
	struct charge before = charge_read(two.metrics_port);
	int rc;
	zc_session *none = session_attach(&two, &config, &rc);
	const char *why = zc_client_last_error(two.service.client);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "the attach gave %s (%s)", zc_error_name(rc), why);
	ck_assert_ptr_null(none);
	ck_assert_msg(strstr(why, "cannot restore session") && strstr(why, "memory budget") &&
		      strstr(why, "nothing was made"),
		      "the message \"%s\"", why);
	/* Refused in the pipeline, by a charge (relief ran, then refused),
	 * not by the snapshot's size before anything was fetched. */
	ck_assert_msg(!strstr(why, "has room for"), "refused before the pipeline: \"%s\"", why);
	ck_assert_int_ge(metric_value(two.metrics_port, "zipcache_relief_steps_total{step=\"refuse\"}"),
			 1);
	ck_assert_uint_eq(node_sessions(&two), 0);
	ck_assert_int_eq(shm_files(&two), 0);
	charge_same(two.metrics_port, &before, "after the refused restore");
	ck_assert_int_eq(metric_value(two.metrics_port,
				      "zipcache_remote_restore_failures_total{reason=\"local\"}"), 1);
	ck_assert_int_eq(metric_value(two.metrics_port, "zipcache_remote_restores_total"), 0);
	ck_assert_int_eq(tier_keys(&t, "zc:*", NULL, NULL, 0), keys);
	node_still_serves(&two, &rng);

	s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	node_stop(&two);
	node_stop(&one);
}
END_TEST

START_TEST(a_damaged_copy_is_refused_whole)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 8);
	tier_flush(&t);
	node_start(&one, &t, "1", NULL);
	zc_session_config config = config_of("damaged", ZC_VIEWS_FULL);
	offload_one(&one, &t, &config, &model, &rng);

	char *names[4];
	int node[4];
	/* Block 0 of layer 1: ...:GENERATION:1:0 */
	int n = tier_keys(&t, "zc:*:b:*:1:0", names, node, 4);
	ck_assert_int_eq(n, 1);
	redisReply *saved = redis_command(t.nodes[0], "GET %s", names[0]);
	ck_assert_int_eq(saved->type, REDIS_REPLY_STRING);

	/* Missing. */
	freeReplyObject(redis_command(t.nodes[0], "DEL %s", names[0]));
	attach_refused(&one, &config, ZC_ENOTFOUND, "layer 1 block 0");
	ck_assert_int_eq(metric_value(one.metrics_port,
				      "zipcache_remote_restore_failures_total{reason=\"missing\"}"), 1);
	/* One byte flipped, in the K payload. */
	char *flipped = malloc(saved->len);
	memcpy(flipped, saved->str, saved->len);
	flipped[saved->len / 2] ^= 0x10;
	freeReplyObject(redis_command(t.nodes[0], "SET %s %b EX 600", names[0], flipped,
				      (size_t)saved->len));
	attach_refused(&one, &config, ZC_ECORRUPT, "layer 1 block 0");
	ck_assert_int_eq(metric_value(one.metrics_port,
				      "zipcache_remote_restore_failures_total{reason=\"corrupt\"}"), 1);
	/* Repaired: it restores. */
	freeReplyObject(redis_command(t.nodes[0], "SET %s %b EX 600", names[0], saved->str,
				      (size_t)saved->len));
	zc_session *s = session_attach(&one, &config, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_eq(zc_session_close(s), 0);
	free(flipped);
	freeReplyObject(saved);
	names_free(names, n);
	model_free(&model);
	node_stop(&one);
}
END_TEST

/* An attach that arrives while the offload is written: the offload is
 * abandoned and the session stays, with every token. */
START_TEST(a_session_touched_during_offload_stays)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 9);
	tier_flush(&t);
	setenv("ZIPCACHED_FAULT_PAUSE", "offload.layer:1500", 1);
	node_start(&one, &t, "1", NULL);
	unsetenv("ZIPCACHED_FAULT_PAUSE");
	zc_session_config config = config_of("touched", ZC_VIEWS_FULL);
	zc_session *s = session_build(one.service.client, &config, &model, &rng);
	session_leave(s);
	ck_assert_msg(tier_wait_keys(&t, "zc:*:b:*", 1, WAIT_MS), "the offload never began");
	s = session_attach(&one, &config, NULL);   /* waits behind the offload */
	CHECK(session_matches, s, &model);
	ck_assert_uint_eq(node_sessions(&one), 1);
	ck_assert_int_eq(metric_value(one.metrics_port,
				      "zipcache_remote_offload_failures_total{reason=\"touched\"}"), 1);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_offloads_total"), 0);
	/* The copy written meanwhile is forgotten. */
	ck_assert_msg(tier_wait_keys(&t, "zc:*", 0, WAIT_MS), "the abandoned copy stayed in Redis");
	more_appends(one.service.client, s, &model, &rng);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&model);
	node_stop(&one);
}
END_TEST

/* ---- uids ---------------------------------------------------------------- */

struct as_nobody {
	const char *socket_path;
	bool build;   /* build and leave the session, else attach and check it */
};

static int nobody_body(void *arg)
{
	const struct as_nobody *a = arg;
	char why[256];
	CHILD_EXPECT(user_become(NOBODY, NOBODY, why, sizeof(why)), "%s", why);
	zc_client *client = NULL;
	int rc = zc_client_connect(a->socket_path, CLIENT_TIMEOUT_MS, &client);
	CHILD_EXPECT(rc == 0, "connect to %s: %s", a->socket_path, zc_error_name(rc));
	zc_session_config config = config_of("private", ZC_VIEWS_FULL);
	struct model model;
	struct rng rng;
	rng_seed(&rng, 10);
	model_init(&model, &config);
	zc_session *s = NULL;
	if (a->build) {
		CHILD_EXPECT(zc_session_open(client, &config, &s) == 0, "open");
		for (uint32_t layer = 0; layer < 2; layer++)
			CHILD_EXPECT(update_checked(client, s, &model, &rng, layer, 40, why, sizeof(why)),
				     "%s", why);
		CHILD_EXPECT(zc_session_release_views(s) == 0, "release");
		zc_session_release(s);
	} else {
		config.attach = true;
		CHILD_EXPECT(zc_session_open(client, &config, &s) == 0, "attach: %s",
			     zc_client_last_error(client));
		CHILD_EXPECT(zc_session_get_info(s)->max_layer_tokens == 40, "restored %llu tokens",
			     (unsigned long long)zc_session_get_info(s)->max_layer_tokens);
		CHILD_EXPECT(zc_session_close(s) == 0, "close");
	}
	model_free(&model);
	zc_client_close(client);
	return 0;
}

START_TEST(another_uid_never_reaches_the_copy)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one;
	tier_flush(&t);
	node_start(&one, &t, "1", (const char *const[]){ "--socket-mode", "0666", NULL });
	chmod(one.service.daemon.dir, 0755);
	if (!other_users_possible(one.service.daemon.dir)) {
		node_stop(&one);
		return;
	}
	struct as_nobody a = { .socket_path = one.service.daemon.socket_path, .build = true };
	child_wait_ok(child_spawn(nobody_body, &a, -1), "nobody builds");
	ck_assert_msg(tier_wait_keys(&t, "zc:1:65534:m:*", 1, WAIT_MS), "nobody's session stayed");
	/* Root's attach of the same name makes root's own, empty session. */
	zc_session_config config = config_of("private", ZC_VIEWS_FULL);
	zc_session *s = session_attach(&one, &config, NULL);
	ck_assert_uint_eq(zc_session_get_info(s)->max_layer_tokens, 0);
	ck_assert_int_eq(zc_session_close(s), 0);
	ck_assert_int_eq(tier_keys(&t, "zc:1:65534:m:*", NULL, NULL, 0), 1);
	a.build = false;
	child_wait_ok(child_spawn(nobody_body, &a, -1), "nobody attaches");
	node_stop(&one);
}
END_TEST

/* ---- relief ---------------------------------------------------------------- */

START_TEST(relief_offloads_an_idle_session)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	struct node one;
	struct model model;
	struct rng rng;
	rng_seed(&rng, 11);
	tier_flush(&t);
	/* No idle offload; a budget one session (about 4.5 MiB) fits, not two. */
	/* Pages kept from closed sessions (the default --retain-bytes) make
	 * way for the restore: the attach below must not be refused for them. */
	node_start(&one, &t, "0", (const char *const[]){ "--memory-budget", "10M", "--log-level",
							   "info", NULL });
	/* Views none: only compressed bytes, which dropping views cannot free. */
	zc_session_config big = shaped_config("big", 2, 1, 8, 128, 128, 2048, ZC_POLICY_STREAMING, 0);
	big.views = ZC_VIEWS_NONE;
	zc_session *s = open_session(one.service.client, &big);
	model_init(&model, &big);
	for (int u = 0; u < 4; u++)
		for (uint32_t layer = 0; layer < 2; layer++)
			CHECK(update_checked, one.service.client, s, &model, &rng, layer, 512);
	session_leave(s);
	/* A second one does not fit beside it, views dropped or not. */
	zc_session_config other = big;
	other.name = "other";
	zc_session *o = open_session(one.service.client, &other);
	struct model other_model;
	model_init(&other_model, &other);
	for (uint32_t step = 0; step < 8; step++) {
		char why[WHY_BYTES], tail[8192];
		ck_assert_msg(update_checked(one.service.client, o, &other_model, &rng, step % 2, 512, why,
					     sizeof(why)), "%s\nlog:\n%s", why,
			      daemon_log_tail(&one.service.daemon, tail, sizeof(tail)));
	}
	ck_assert_int_ge(metric_value(one.metrics_port, "zipcache_relief_steps_total{step=\"offload\"}"),
			 1);
	ck_assert_int_eq(metric_value(one.metrics_port, "zipcache_remote_offloads_total"), 1);
	ck_assert_uint_eq(node_sessions(&one), 1);
	ck_assert_int_eq(zc_session_close(o), 0);
	/* Both sessions' blocks are kept pages now, which the room for the
	 * restore counts and which make way for it. */
	ck_assert_int_gt(metric_value(one.metrics_port, "zipcache_retained_bytes{kind=\"extents\"}"),
			 0);
	s = session_attach(&one, &big, NULL);
	CHECK(session_matches, s, &model);
	ck_assert_int_ge(metric_value(one.metrics_port,
				      "zipcache_relief_steps_total{step=\"release_retained\"}"), 1);
	ck_assert_int_eq(zc_session_close(s), 0);
	model_free(&other_model);
	model_free(&model);
	node_stop(&one);
}
END_TEST

/* ---- crashes ---------------------------------------------------------------- */

static const char *const offload_steps[] = { "offload.encoded", "offload.layer",
					     "offload.manifest", "offload.dropped", NULL };
/* restore.part and restore.layer:1 fall with layer 0 built into the
 * temporary file while layer 1 is fetched; restore.fetched with every
 * layer built, before the rename. */
static const char *const restore_steps[] = { "restore.part", "restore.layer", "import.block",
					     "restore.fetched", "import.layers", "restore.committed",
					     NULL };

/* Restarted without the fault: the session is there, bit for bit. */
static void after_crash(struct node *one, const struct tier *t, const zc_session_config *config,
			struct model *model, const char *spec)
{
	int status = daemon_wait_exit(&one->service.daemon, WAIT_MS);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 86,
		      "%s: the daemon ended with status %d, not by the fault", spec, status);
	zc_client_close(one->service.client);
	unsetenv("ZIPCACHED_FAULT");
	daemon_restart(&one->service.daemon);
	one->service.client = connect_client(&one->service.daemon);
	if ((strncmp(spec, "restore.", 8) == 0 || strncmp(spec, "import.", 7) == 0) &&
	    strcmp(spec, "restore.committed:1") != 0) {
		/* Nothing half-made survives: no session file (temporary or
		 * not), no pool extent (the pool file keeps its header page,
		 * 4096 bytes; any block adds a page at least). */
		ck_assert_msg(shm_files(one) == 0, "%s: a session file was left", spec);
		int64_t until = now_ms() + WAIT_MS;
		while (metric_value(one->metrics_port, "zipcache_memory_file_bytes{kind=\"blocks\"}") > 4096 &&
		       now_ms() < until)
			sleep_ms(50);
		ck_assert_msg(metric_value(one->metrics_port,
					   "zipcache_memory_file_bytes{kind=\"blocks\"}") <= 4096,
			      "%s: pool extents were left (%lld bytes)", spec, metric_value(one->metrics_port, "zipcache_memory_file_bytes{kind=\"blocks\"}"));
	}
	zc_session *s = session_attach(one, config, NULL);
	char why[WHY_BYTES];
	ck_assert_msg(session_matches(s, model, why, sizeof(why)), "%s: %s", spec, why);
	if (strcmp(spec, "restore.committed:1") == 0) {
		/* Both copies were left: the next offload writes a new generation
		 * and deletes the old one's keys, so one generation is left. */
		ck_assert_int_eq(tier_keys(t, "zc:*:m:*", NULL, NULL, 0), 1);
		session_leave(s);
		ck_assert_msg(node_wait_sessions(one, 0, WAIT_MS), "%s: not offloaded again", spec);
		ck_assert_int_eq(tier_keys(t, "zc:*", NULL, NULL, 0), 5);
		s = session_attach(one, config, NULL);
		ck_assert_msg(session_matches(s, model, why, sizeof(why)), "%s: %s", spec, why);
	}
	ck_assert_int_eq(zc_session_close(s), 0);
}

START_TEST(crash_at_every_step)
{
	if (!standalone.pid)
		return;
	struct tier t = tier_standalone();
	char spec[64];
	for (int r = 0; r < 2; r++) {
		const char *const *steps = r == 0 ? offload_steps : restore_steps;
		for (int i = 0; steps[i]; i++) {
			struct node one;
			struct model model;
			struct rng rng;
			rng_seed(&rng, 12);
			tier_flush(&t);
			snprintf(spec, sizeof(spec), "%s:1", steps[i]);
			zc_session_config config = config_of("crash", ZC_VIEWS_FULL);
			if (r == 0)
				setenv("ZIPCACHED_FAULT", spec, 1);
			node_start(&one, &t, "1", NULL);
			zc_session *s = session_build(one.service.client, &config, &model, &rng);
			session_leave(s);
			if (r == 1) {
				ck_assert(node_wait_sessions(&one, 0, WAIT_MS));
				zc_client_close(one.service.client);
				daemon_stop(&one.service.daemon);
				setenv("ZIPCACHED_FAULT", spec, 1);
				daemon_restart(&one.service.daemon);
				one.service.client = connect_client(&one.service.daemon);
				int rc;
				session_attach(&one, &config, &rc);
				ck_assert_msg(daemon_lost(rc), "%s: the attach gave %s", spec,
					      zc_error_name(rc));
			}
			after_crash(&one, &t, &config, &model, spec);
			model_free(&model);
			node_stop(&one);
		}
	}
}
END_TEST

static Suite *offload_suite(void)
{
	const struct {
		const char *name;
		const TTest *test;
	} singles[] = {
		{ "round_trip", round_trip_standalone },
		{ "unknown_name", attach_of_an_unknown_name_creates },
		{ "damaged", a_damaged_copy_is_refused_whole },
		{ "touched", a_session_touched_during_offload_stays },
		{ "uids", another_uid_never_reaches_the_copy },
		{ "relief", relief_offloads_an_idle_session },
		{ "killed_mid", redis_killed_mid_offload_leaves_the_session },
		{ "redis_down", redis_down_keeps_sessions_local },
		{ "killed_mid_restore", redis_killed_mid_restore_leaves_nothing },
		{ "budget_mid_restore", budget_exhausted_mid_restore_leaves_nothing },
		{ "crashes", crash_at_every_step },
	};
	Suite *suite = suite_create("remote_offload");
	/* One case each (CK_RUN_CASE picks one), each with a fresh server. */
	for (size_t i = 0; i < sizeof(singles) / sizeof(singles[0]); i++) {
		TCase *tc = tcase_create(singles[i].name);
		tcase_add_unchecked_fixture(tc, standalone_up, standalone_down);
		tcase_set_timeout(tc, 240);
		tcase_add_test(tc, singles[i].test);
		suite_add_tcase(suite, tc);
	}
	TCase *clustered = tcase_create("cluster");
	tcase_add_unchecked_fixture(clustered, cluster_up, cluster_down);
	tcase_set_timeout(clustered, 120);
	tcase_add_test(clustered, round_trip_cluster);
	suite_add_tcase(suite, clustered);
	return suite;
}

int main(void)
{
	return suite_main(offload_suite(), CK_FORK);
}
