/*
 * Long work off the event loop: a job that rebuilds views memory relief
 * dropped (open with attach, stats with use, a decode step into a dropped
 * layer) costs the elements it rebuilds, and above --offload-elements it
 * runs on the thread pool, so the daemon answers other connections while
 * it runs.
 *
 * Checked by order, never by time. Memory pressure from another session
 * drops the views of a big idle session (seen in its mapped header); a
 * helper thread sends the request that rebuilds them; once the header
 * shows the rebuild under way (a layer's seqlock moved), a third
 * connection asks for the daemon's stats. If that reply arrives while a
 * layer the request must rebuild is still dropped, the loop thread
 * answered in the middle of the rebuild, which it cannot do when the
 * rebuild runs on it. A rebuild that happens to finish before the stats
 * reply proves nothing either way, so the round is repeated (a bounded
 * number of times) with the views dropped again.
 *
 * Whatever the order, the request that rebuilds must succeed and the
 * views must come back as the very bits they were before the drop.
 *
 * An attach is a job in the session's line like any other: pipelined on
 * one connection behind an update that runs on the thread pool, it is
 * answered after it, with its tokens; behind a close, NOT_FOUND.
 */
#include <check.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "store_format.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

/* ASan makes the codec and the daemon several times slower. */
#define TEST_TIMEOUT_SECONDS 120

/* The big session: 8 layers of one 4096-token block, H = 8, D = 128, so
 * 128 MiB of views whose rebuild writes 4M elements per layer, far above
 * the default --offload-elements of 65536 and long enough (fresh tmpfs
 * pages, ~16 MiB a layer) for a stats round trip to fit inside it. */
#define BIG_LAYERS 8u
#define BIG_TOKENS 4096u
#define HEADS 8u
#define DIM 128u
/* Room for one decode step per round. */
#define BIG_MAX_TOKENS (BIG_TOKENS + 64u)

/* The big session (about 128 MiB of views and 36 MiB of arenas) fits with
 * room to spare; the pressure session pushes past the budget, so relief
 * takes the big session's views, and once it is closed their rebuild
 * fits again. */
#define BUDGET "256M"
#define BUDGET_BYTES (256ull << 20)
#define PRESSURE_BLOCK 2048u
#define PRESSURE_MAX_TOKENS (64u * PRESSURE_BLOCK)

#define MAX_ROUNDS 6
#define WAIT_SECONDS 60.0

enum trigger_kind { TRIGGER_ATTACH, TRIGGER_STATS, TRIGGER_DECODE };

struct fixture {
	struct daemon_harness daemon;
	zc_client *owner;    /* the big session's client: only the helper thread uses it */
	zc_client *pressure; /* grows the pressure session */
	zc_client *ping;     /* asks for the daemon's stats during the rebuild */
	zc_session_config config;
	zc_session *big;
	const zc_map_header *header;
	uint16_t *snapshot;  /* every layer's first BIG_TOKENS tokens, K then V */
	struct block decode; /* one row per decode step */
	int pressure_round;
};

struct trigger {
	enum trigger_kind kind;
	struct fixture *f;
	int rc;
	char message[256];
	uint32_t tokens;     /* layer 0's length in the reply */
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const size_t layer_elements = (size_t)HEADS * BIG_TOKENS * DIM;

/* Copies (or compares, when check) the first BIG_TOKENS tokens of every
 * layer's K and V. Returns the first layer that differs, or -1. */
static int views_walk(struct fixture *f, bool check)
{
	for (uint32_t layer = 0; layer < BIG_LAYERS; layer++) {
		zc_view view;
		ck_assert_int_eq(zc_session_view(f->big, layer, &view), 0);
		ck_assert_uint_ge(view.tokens, BIG_TOKENS);
		for (int tensor = 0; tensor < 2; tensor++) {
			const uint16_t *base = tensor == 0 ? view.keys : view.values;
			zc_strides s = tensor == 0 ? view.key_strides : view.value_strides;
			uint16_t *copy = f->snapshot + (2 * (size_t)layer + (size_t)tensor) * layer_elements;
			for (uint32_t head = 0; head < HEADS; head++) {
				const uint16_t *from = base + head * s.head;
				uint16_t *to = copy + (size_t)head * BIG_TOKENS * DIM;
				size_t bytes = (size_t)BIG_TOKENS * DIM * 2;
				if (!check)
					memcpy(to, from, bytes);
				else if (memcmp(to, from, bytes) != 0)
					return (int)layer;
			}
		}
	}
	return -1;
}

static uint32_t layers_dropped(const zc_map_header *h, uint32_t first, uint32_t count)
{
	uint32_t dropped = 0;
	for (uint32_t i = first; i < first + count; i++)
		dropped += __atomic_load_n(&h->layer[i].view_valid, __ATOMIC_ACQUIRE) == 0;
	return dropped;
}

static void fixture_start(struct fixture *f)
{
	static const char *const args[] = { "--memory-budget", BUDGET, NULL };
	struct block block;
	struct rng rng;
	zc_server_stats stats;
	zc_view view;

	memset(f, 0, sizeof(*f));
	daemon_start(&f->daemon, args);
	f->owner = connect_client(&f->daemon);
	f->pressure = connect_client(&f->daemon);
	f->ping = connect_client(&f->daemon);

	zc_session_config_default(&f->config);
	f->config.name = "big";
	f->config.layers = BIG_LAYERS;
	f->config.batch = 1;
	f->config.kv_heads = HEADS;
	f->config.head_dim_k = f->config.head_dim_v = DIM;
	f->config.max_tokens = BIG_MAX_TOKENS;
	f->big = open_session(f->owner, &f->config);

	rng_seed(&rng, 90);
	block_make_shape(&block, HEADS, DIM, DIM, BIG_TOKENS, &rng);
	for (uint32_t layer = 0; layer < BIG_LAYERS; layer++) {
		int rc = zc_update_and_fetch(f->big, layer, BIG_TOKENS, block.keys, block.values,
					     &view, NULL);
		ck_assert_msg(rc == 0, "prefill of layer %u: %s '%s'", layer, zc_strerror(rc),
			      zc_client_last_error(f->owner));
	}
	block_free(&block);
	block_make_shape(&f->decode, HEADS, DIM, DIM, 1, &rng);

	f->header = zc_session_map(f->big);
	ck_assert_msg(memcmp(f->header->magic, ZC_MAP_MAGIC, sizeof(f->header->magic)) == 0 &&
			      f->header->layers == BIG_LAYERS,
		      "no map header where the mapping starts");

	f->snapshot = allocate(2 * (size_t)BIG_LAYERS * layer_elements * 2);
	views_walk(f, false);
	ck_assert_int_eq(zc_client_stats(f->ping, &stats), 0);
	ck_assert_msg(stats.memory_used_bytes < BUDGET_BYTES / 4 * 3,
		      "the big session alone uses %llu bytes of a %llu-byte budget: no room left "
		      "for the pressure that drops its views",
		      (unsigned long long)stats.memory_used_bytes, BUDGET_BYTES);
}

static void fixture_stop(struct fixture *f)
{
	ck_assert_int_eq(zc_session_close(f->big), 0);
	zc_client_close(f->owner);
	zc_client_close(f->pressure);
	zc_client_close(f->ping);
	block_free(&f->decode);
	free(f->snapshot);
	daemon_stop(&f->daemon);
	daemon_cleanup(&f->daemon);
}

/* Another session grows until relief has taken every view of the big
 * one, then closes, so that rebuilding them fits in the budget again. */
static void views_drop(struct fixture *f)
{
	char name[32];
	struct block block;
	struct rng rng;
	zc_session_config config = f->config;
	zc_view view;

	/* The big session's client lets its lease go: its views may be dropped. */
	ck_assert_int_eq(zc_session_release_views(f->big), 0);
	snprintf(name, sizeof(name), "pressure-%d", f->pressure_round++);
	config.name = name;
	config.layers = 1;
	config.max_tokens = PRESSURE_MAX_TOKENS;
	zc_session *pressure = open_session(f->pressure, &config);
	rng_seed(&rng, 91);
	block_make_shape(&block, HEADS, DIM, DIM, PRESSURE_BLOCK, &rng);
	for (uint32_t done = 0; layers_dropped(f->header, 0, BIG_LAYERS) < BIG_LAYERS; done += PRESSURE_BLOCK) {
		ck_assert_msg(done < PRESSURE_MAX_TOKENS,
			      "%u tokens of pressure and still %u of the big session's layers have views",
			      done, BIG_LAYERS - layers_dropped(f->header, 0, BIG_LAYERS));
		int rc = zc_update_and_fetch(pressure, 0, PRESSURE_BLOCK, block.keys, block.values,
					     &view, NULL);
		ck_assert_msg(rc == 0, "pressure at %u tokens: %s '%s'", done, zc_strerror(rc),
			      zc_client_last_error(f->pressure));
	}
	block_free(&block);
	ck_assert_int_eq(zc_session_close(pressure), 0);
}

static void *trigger_body(void *arg)
{
	struct trigger *t = arg;
	struct fixture *f = t->f;
	zc_layer_stats layers[BIG_LAYERS], total;
	zc_session *attached = NULL;
	zc_session_config config = f->config;
	zc_view view;

	switch (t->kind) {
	case TRIGGER_ATTACH:
		config.attach = true;
		t->rc = zc_session_open(f->owner, &config, &attached);
		if (t->rc == 0) {
			t->tokens = zc_session_get_info(attached)->max_layer_tokens;
			zc_session_release(attached);
		}
		break;
	case TRIGGER_STATS:
		t->rc = zc_session_stats(f->big, layers, BIG_LAYERS, &total);
		t->tokens = layers[0].tokens;
		break;
	case TRIGGER_DECODE:
		t->rc = zc_update_and_fetch(f->big, 0, 1, f->decode.keys, f->decode.values, &view, NULL);
		t->tokens = view.tokens;
		break;
	}
	if (t->rc < 0)
		snprintf(t->message, sizeof(t->message), "%s", zc_client_last_error(f->owner));
	return NULL;
}

/*
 * One round: drop, rebuild from the helper thread, ask for stats in the
 * middle. Returns true when the stats reply came while one of the
 * layers [first, first + count) was still dropped.
 */
static bool rebuild_round(struct fixture *f, enum trigger_kind kind, uint32_t first,
			  uint32_t count, int round)
{
	uint64_t sequence[BIG_LAYERS];
	struct trigger t = { .kind = kind, .f = f };
	uint32_t tokens_before = __atomic_load_n(&f->header->layer[0].tokens, __ATOMIC_ACQUIRE);
	zc_server_stats stats;
	pthread_t thread;

	views_drop(f);
	for (uint32_t i = 0; i < BIG_LAYERS; i++) {
		sequence[i] = __atomic_load_n(&f->header->layer[i].sequence, __ATOMIC_ACQUIRE);
		ck_assert_msg(sequence[i] % 2 == 0, "layer %u is being written while idle", i);
	}
	ck_assert_int_eq(pthread_create(&thread, NULL, trigger_body, &t), 0);

	/* Under way: the first layer to rebuild has begun its seqlock write. */
	double deadline = now_s() + WAIT_SECONDS;
	bool started = false;
	while (!started) {
		for (uint32_t i = first; i < first + count; i++)
			started |= __atomic_load_n(&f->header->layer[i].sequence, __ATOMIC_ACQUIRE) !=
				   sequence[i];
		ck_assert_msg(started || now_s() < deadline,
			      "round %d: no rebuild began within %.0f s", round, WAIT_SECONDS);
		sched_yield();
	}
	ck_assert_int_eq(zc_client_stats(f->ping, &stats), 0);
	uint32_t still_dropped = layers_dropped(f->header, first, count);

	ck_assert_int_eq(pthread_join(thread, NULL), 0);
	ck_assert_msg(t.rc == 0, "round %d: the rebuilding request failed: %s '%s'", round,
		      zc_strerror(t.rc), t.message);
	uint32_t expected = kind == TRIGGER_DECODE ? tokens_before + 1 : tokens_before;
	ck_assert_msg(t.tokens == expected, "round %d: the reply says %u tokens in layer 0, not %u",
		      round, t.tokens, expected);
	ck_assert_uint_eq(layers_dropped(f->header, first, count), 0);
	/* Every view is read back (stats with use brings back the others). */
	int differs = views_walk(f, true);
	ck_assert_msg(differs < 0, "round %d: layer %d's rebuilt view differs from before the drop",
		      round, differs);
	fprintf(stderr, "offload: %s round %d: stats answered with %u of %u layers still to rebuild\n",
		kind == TRIGGER_ATTACH ? "attach" : kind == TRIGGER_STATS ? "stats" : "decode", round,
		still_dropped, count);
	return still_dropped > 0;
}

static void rebuild_check(enum trigger_kind kind, uint32_t first, uint32_t count)
{
	struct fixture f;
	bool overlapped = false;

	fixture_start(&f);
	for (int round = 0; round < MAX_ROUNDS && !overlapped; round++)
		overlapped = rebuild_round(&f, kind, first, count, round);
	ck_assert_msg(overlapped,
		      "in %d rounds the daemon never answered another connection while a rebuild "
		      "was under way: it rebuilds on the loop thread", MAX_ROUNDS);
	fixture_stop(&f);
}

START_TEST(attach_rebuilds_off_the_loop)
{
	rebuild_check(TRIGGER_ATTACH, 0, BIG_LAYERS);
}
END_TEST

START_TEST(stats_with_use_rebuilds_off_the_loop)
{
	rebuild_check(TRIGGER_STATS, 0, BIG_LAYERS);
}
END_TEST

/* Only layer 0 is rebuilt (the others stay dropped until read back). */
START_TEST(decode_into_a_dropped_layer_rebuilds_off_the_loop)
{
	rebuild_check(TRIGGER_DECODE, 0, 1);
}
END_TEST

/* ---- an attach waits its turn ---------------------------------------------- */

static size_t frame_append(uint8_t *buffer, size_t capacity, size_t used,
			   const wire_pb_request *request)
{
	size_t size, len;
	ck_assert_int_eq(wire_pb_request_frame_size(request, &size), 0);
	ck_assert_uint_le(used + size, capacity);
	ck_assert_int_eq(wire_pb_request_encode(request, buffer + used, capacity - used, &len), 0);
	return used + len;
}

static wire_pb_request attach_request(uint64_t request_id, const char *name)
{
	wire_pb_request request;
	memset(&request, 0, sizeof(request));
	request.msg.request_id = request_id;
	request.msg.which_op = zipcache_v1_Request_open_session_tag;
	snprintf(request.msg.op.open_session.name, sizeof(request.msg.op.open_session.name), "%s",
		 name);
	request.msg.op.open_session.attach = true;
	return request;
}

/*
 * One write, so the daemon dispatches every frame before any job ends:
 * an update of 128 tokens x 16 elements (2048, above --offload-elements
 * 1000: a worker runs it), an attach, a close, and another attach. The
 * first attach must come after the update, and show its tokens; the
 * second finds the session closed by the job ahead of it.
 */
START_TEST(attach_waits_its_turn_in_the_session_line)
{
	enum { TOKENS = 128, DIM_K = 8, DIM_V = 8 };
	static const char *const args[] = { "--offload-elements", "1000", NULL };
	static uint16_t keys[TOKENS * DIM_K], values[TOKENS * DIM_V];
	struct daemon_harness daemon;
	zc_session_config config;
	uint8_t frames[16384];
	size_t used = 0;

	for (size_t i = 0; i < TOKENS * DIM_K; i++)
		keys[i] = zc_float_to_fp16((float)(i % 97) / 50.0f - 1.0f);
	for (size_t i = 0; i < TOKENS * DIM_V; i++)
		values[i] = zc_float_to_fp16((float)(i % 89) / 60.0f - 0.5f);
	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	zc_session_config_default(&config);
	config.name = "line";
	config.layers = 1;
	config.batch = 1;
	config.kv_heads = 1;
	config.head_dim_k = DIM_K;
	config.head_dim_v = DIM_V;
	config.max_tokens = 1024;
	zc_session *session = open_session(client, &config);
	uint64_t session_id = zc_session_get_info(session)->id;

	wire_pb_request update;
	memset(&update, 0, sizeof(update));
	update.msg.request_id = 1;
	update.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	update.msg.op.update_and_fetch.session_id = session_id;
	update.msg.op.update_and_fetch.tokens = TOKENS;
	update.keys = (wire_span){ (const uint8_t *)keys, sizeof(keys) };
	update.values = (wire_span){ (const uint8_t *)values, sizeof(values) };
	wire_pb_request close_request;
	memset(&close_request, 0, sizeof(close_request));
	close_request.msg.request_id = 3;
	close_request.msg.which_op = zipcache_v1_Request_close_session_tag;
	close_request.msg.op.close_session.session_id = session_id;
	wire_pb_request first = attach_request(2, "line"), second = attach_request(4, "line");
	used = frame_append(frames, sizeof(frames), used, &update);
	used = frame_append(frames, sizeof(frames), used, &first);
	used = frame_append(frames, sizeof(frames), used, &close_request);
	used = frame_append(frames, sizeof(frames), used, &second);

	int fd = raw_connect(daemon.socket_path);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(raw_send(fd, frames, used), 0);
	static const zipcache_v1_Status expected[4] = {
		zipcache_v1_Status_OK, zipcache_v1_Status_OK, zipcache_v1_Status_OK,
		zipcache_v1_Status_NOT_FOUND
	};
	for (uint64_t n = 1; n <= 4; n++) {
		wire_pb_response reply;
		ck_assert_int_eq(raw_read_reply(fd, CLIENT_TIMEOUT_MS, &reply, NULL), 0);
		ck_assert_msg(reply.msg.request_id == n,
			      "reply %" PRIu64 " came for request %" PRIu64 " (status %s '%s')", n,
			      reply.msg.request_id, response_status_name(reply.msg.status),
			      reply.msg.message);
		ck_assert_msg(reply.msg.status == expected[n - 1], "request %" PRIu64 ": %s '%s'", n,
			      response_status_name(reply.msg.status), reply.msg.message);
		if (n == 2) {
			const zipcache_v1_OpenSessionResponse *open = &reply.msg.op.open_session;
			ck_assert(open->attached);
			ck_assert_uint_eq(open->session.session_id, session_id);
			ck_assert_msg(open->session.max_layer_tokens == TOKENS,
				      "the attach reports %u tokens, not the %u of the update ahead of it",
				      open->session.max_layer_tokens, TOKENS);
		}
		if (n == 4)
			ck_assert_msg(strstr(reply.msg.message, "closed") != NULL,
				      "the refusal '%s' does not say the session was closed",
				      reply.msg.message);
		wire_pb_response_free(&reply);
	}
	close(fd);
	zc_session_release(session);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

int main(void)
{
	Suite *suite = suite_create("offload");
	const struct test_case cases[] = {
		{ "rebuild", { attach_rebuilds_off_the_loop, stats_with_use_rebuilds_off_the_loop,
			       decode_into_a_dropped_layer_rebuilds_off_the_loop, NULL } },
		{ "order", { attach_waits_its_turn_in_the_session_line, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
