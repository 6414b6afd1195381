/*
 * The request ring (docs/RING.md) through a real daemon:
 *   full ring       frames of 24 KiB in the smallest ring: the client waits
 *                   for room, and every update lands, in order
 *   doorbells       rung when the daemon sleeps, hardly ever while it busy
 *                   polls
 *   sync            synchronous updates take the ring once there is one,
 *                   mixed with asynchronous ones, views and stats exact
 *   nudge           a client asleep on its socket is nudged there when its
 *                   reply went to the ring; a reply head it garbles sends
 *                   its replies back to the socket
 *   refused         a daemon that will not make one (--max-staging-bytes)
 *                   leaves the client on the socket, with no error
 *   hostile         every kind of broken ring (an entry too long, one past
 *                   the end, one cut by the tail, a wrap mark past the tail,
 *                   a tail out of line or a lap ahead) closes that one
 *                   connection, says why in the log, and loses nothing of
 *                   anyone's
 * async_decode_test.c runs its asynchronous loops with and without a ring.
 */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "ring_format.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define MAX_TOKENS 4096u

static size_t ring_mappings(uintptr_t *starts, size_t max);
static struct ring_header *ring_new_mapping(const uintptr_t *before, size_t n_before);
#define TEST_TIMEOUT_SECONDS 120

static zc_session_config wide_config(const char *name)
{
	/* One token of K and V: 8 heads x 128 x 2 bytes x 2 = 4 KiB. */
	return shaped_config(name, 2, 1, 8, 128, 128, MAX_TOKENS, ZC_POLICY_STREAMING, 128);
}

/* `steps` rounds of both layers through zc_update_async, `tokens` each
 * (0: 1 to 6 at random), the model updated alike; then the session must
 * equal the model. */
static void async_rounds(zc_client *client, zc_session *session, struct model *model,
			 struct rng *rng, unsigned steps, uint32_t tokens, int gap_us)
{
	zc_ticket ticket;
	for (unsigned step = 0; step < steps; step++) {
		for (uint32_t layer = 0; layer < 2; layer++) {
			struct block block;
			uint32_t n = tokens ? tokens : 1 + rng_below(rng, 6);
			block_make(&block, model, n, rng);
			ck_assert_int_eq(model_update(model, layer, n, block.keys, block.values), 0);
			int rc = zc_update_async(session, layer, n, block.keys, block.values, &ticket);
			ck_assert_msg(rc == 0, "step %u: %s (%s)", step, zc_error_name(rc),
				      zc_client_last_error(client));
			block_free(&block);
			if (gap_us > 0)
				usleep((useconds_t)gap_us);
		}
	}
	ck_assert_int_eq(zc_wait_all(client), 0);
	ck_assert_int_eq(zc_session_stats(session, NULL, 0, NULL), 0);
	CHECK(session_matches, session, model);
}

START_TEST(a_full_ring_waits_for_room)
{
	struct service service;
	zc_session_config config = wide_config("full");
	struct model model;
	struct rng rng;
	size_t bytes;
	uint64_t doorbells;

	service_start(&service, NULL);
	ck_assert_int_eq(zc_client_set_async_ring(service.client, ZC_ASYNC_RING_MIN_BYTES), 0);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 77);
	/* 64 updates of up to 24 KiB in flight against 64 KiB of ring. */
	async_rounds(service.client, session, &model, &rng, 300, 0, 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &doorbells), 0);
	ck_assert_uint_eq(bytes, ZC_ASYNC_RING_MIN_BYTES);
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
}
END_TEST

/* The doorbells `rounds` rounds of both layers ring, `gap_us` apart, to
 * a daemon started with `args`; every update checked against the model. */
static uint64_t doorbells_rung(const char *const *args, const char *name, unsigned rounds,
			       int gap_us, struct rng *rng)
{
	struct service service;
	zc_session_config config = wide_config(name);
	struct model model;
	size_t bytes;
	uint64_t before, after;

	uint16_t port = service_start_metrics(&service, args);
	ck_assert_uint_eq(zc_client_server_info(service.client)->max_ring_bytes,
			  ZC_ASYNC_RING_MAX_BYTES);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	/* The first update makes the ring. */
	async_rounds(service.client, session, &model, rng, 1, 1, 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &before), 0);
	ck_assert_uint_eq(bytes, ZC_ASYNC_RING_BYTES);
	async_rounds(service.client, session, &model, rng, rounds, 1, gap_us);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &after), 0);
	/* The daemon counts what the client did: each doorbell read once,
	 * every update taken from the ring, every reply written there. */
	ck_assert_int_eq(metric_value(port, "zipcache_request_rings"), 1);
	ck_assert_int_eq(metric_value(port, "zipcache_ring_doorbells_total"), (long long)after);
	ck_assert_int_ge(metric_value(port, "zipcache_ring_requests_total"), 2 * (rounds + 1));
	ck_assert_int_ge(metric_value(port, "zipcache_ring_replies_total"), 2 * (rounds + 1));
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
	return after - before;
}

START_TEST(doorbells_only_while_the_daemon_sleeps)
{
	struct rng rng;
	rng_seed(&rng, 78);
	/* Sleeping between updates 2 ms apart: nearly every one rings. */
	uint64_t n = doorbells_rung(NULL, "asleep", 50, 2000, &rng);
	ck_assert_msg(n >= 80, "%llu doorbells for 100 updates 2 ms apart", (unsigned long long)n);
	/* Busy polling for 100 ms after each request: the loop finds the
	 * entries itself, except while a flush is on the thread pool. */
	n = doorbells_rung((const char *const[]){ "--busy-poll-us", "100000", NULL }, "polling", 200,
			   200, &rng);
	ck_assert_msg(n <= 100, "%llu doorbells for 400 updates to a polling daemon",
		      (unsigned long long)n);
}
END_TEST

/* Once the connection has a ring, synchronous updates take it too (each
 * rings the sleeping daemon once), mixed with asynchronous ones, and
 * every view and stat they return is the model's. Off (0), they are
 * written to the socket again and ring nothing. */
START_TEST(synchronous_updates_take_the_ring)
{
	struct service service;
	zc_session_config config = wide_config("sync");
	struct model model;
	struct rng rng;
	size_t bytes;
	uint64_t before, after;

	service_start(&service, NULL);
	ck_assert_int_eq(zc_client_set_async_ring(service.client, ZC_ASYNC_RING_BYTES), 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &before), 0);
	ck_assert_uint_eq(bytes, ZC_ASYNC_RING_BYTES);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 81);
	for (unsigned step = 0; step < 300; step++) {
		uint32_t layer = step % 2, tokens = 1 + rng_below(&rng, 4);
		if (step % 3 == 2) {
			async_rounds(service.client, session, &model, &rng, 1, tokens, 0);
			continue;
		}
		CHECK(update_checked, service.client, session, &model, &rng, layer, tokens);
	}
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &after), 0);
	ck_assert_msg(after - before >= 100, "%llu doorbells for 200 synchronous updates",
		      (unsigned long long)(after - before));
	ck_assert_int_eq(zc_client_set_async_ring(service.client, 0), 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &before), 0);
	for (unsigned step = 0; step < 50; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &after), 0);
	ck_assert_uint_eq(after, before);
	CHECK(session_matches, session, &model);
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
}
END_TEST

/* A client that sleeps on its socket at once (no receive spin) is nudged
 * there whenever its reply went to the ring: nothing waits for the
 * timeout. And a reply head the client garbles only sends its replies
 * back to the socket. */
START_TEST(a_sleeping_client_is_nudged)
{
	struct service service;
	zc_session_config config = wide_config("nudged");
	struct model model;
	struct rng rng;
	size_t bytes;
	uint64_t doorbells;

	uint16_t port = service_start_metrics(&service, NULL);
	ck_assert_int_eq(zc_client_set_receive_spin(service.client, 0), 0);
	uintptr_t before[16];
	size_t n_before = ring_mappings(before, 16);
	ck_assert_int_eq(zc_client_set_async_ring(service.client, ZC_ASYNC_RING_BYTES), 0);
	struct ring_header *h = ring_new_mapping(before, n_before);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 82);
	int64_t start = now_ms();
	for (unsigned step = 0; step < 200; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1);
	async_rounds(service.client, session, &model, &rng, 50, 0, 0);
	/* 300 replies: a missed nudge would cost the client's whole timeout. */
	ck_assert_int_lt(now_ms() - start, CLIENT_TIMEOUT_MS);
	ck_assert_uint_gt(__atomic_load_n(&h->reply_tail, __ATOMIC_ACQUIRE), 0);
	ck_assert_int_gt(metric_value(port, "zipcache_ring_nudges_total"), 0);

	/* The client's head a lap ahead of the daemon's tail: the daemon
	 * trusts it no further than its own replies. */
	__atomic_store_n(&h->reply_head, h->reply_tail + 3 * RING_REPLY_BYTES, __ATOMIC_RELEASE);
	for (unsigned step = 0; step < 20; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1);
	async_rounds(service.client, session, &model, &rng, 5, 0, 0);
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &doorbells), 0);
	ck_assert_uint_eq(bytes, ZC_ASYNC_RING_BYTES);
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
}
END_TEST

START_TEST(a_refused_ring_leaves_the_socket)
{
	struct service service;
	zc_session_config config = wide_config("refused");
	struct model model;
	struct rng rng;
	size_t bytes = 1;
	uint64_t doorbells;

	service_start(&service, (const char *const[]){ "--max-staging-bytes", "65536", NULL });
	/* The hello says how large a ring the daemon makes. */
	ck_assert_uint_eq(zc_client_server_info(service.client)->max_ring_bytes, 65536);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 79);
	async_rounds(service.client, session, &model, &rng, 100, 0, 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &bytes, &doorbells), 0);
	ck_assert_uint_eq(bytes, 0);
	ck_assert_str_eq(zc_client_last_error(service.client), "");
	/* A ring the daemon can make is used from the next connection on. */
	ck_assert_int_eq(zc_client_set_async_ring(service.client, ZC_ASYNC_RING_MIN_BYTES), 0);
	ck_assert_int_eq(zc_client_set_async_ring(service.client, 1000), ZC_EINVALID);
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
}
END_TEST

/* ---- hostile rings ---------------------------------------------------------- */

/* The rings this process has mapped for its clients, found by their
 * memfds' name: up to `max` start addresses. */
static size_t ring_mappings(uintptr_t *starts, size_t max)
{
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[512];
	size_t n = 0;
	ck_assert_ptr_nonnull(maps);
	while (fgets(line, sizeof(line), maps))
		if (strstr(line, "zipcache-ring") && n < max) {
			unsigned long start;
			ck_assert_int_eq(sscanf(line, "%lx-", &start), 1);
			starts[n++] = start;
		}
	fclose(maps);
	return n;
}

/* The one ring mapped that was not among `before`. */
static struct ring_header *ring_new_mapping(const uintptr_t *before, size_t n_before)
{
	uintptr_t now[16];
	size_t n = ring_mappings(now, 16);
	struct ring_header *found = NULL;
	for (size_t i = 0; i < n; i++) {
		bool old = false;
		for (size_t j = 0; j < n_before; j++)
			old |= now[i] == before[j];
		if (!old) {
			ck_assert_ptr_null(found);
			found = (struct ring_header *)now[i];
		}
	}
	ck_assert_ptr_nonnull(found);
	ck_assert_uint_eq(found->magic, RING_MAGIC);
	return found;
}

enum breakage { TOO_LONG, PAST_THE_END, CUT, WRAP_PAST_TAIL, MISALIGNED, A_LAP_AHEAD, BREAKAGES };

static const char *const breakage_log[BREAKAGES] = {
	"an entry longer than a frame may be", "an entry that runs past the end of the data",
	"an entry cut by the tail", "a wrap mark past the tail", "the tail is not aligned",
	"the tail is not within one lap of the head",
};

/* Writes one kind of broken entry at the tail and publishes it. */
static void ring_break(struct ring_header *h, enum breakage kind)
{
	uint8_t *data = (uint8_t *)h + RING_HEADER_BYTES;
	uint64_t tail = __atomic_load_n(&h->tail, __ATOMIC_RELAXED);
	uint64_t offset = tail % h->capacity;
	uint32_t len = 0;
	uint64_t advance = 8;

	switch (kind) {
	case TOO_LONG:
		len = 0x7ffffff0u;
		break;
	case PAST_THE_END:
		len = (uint32_t)(h->capacity - offset);   /* 4 + len > what is left */
		advance = h->capacity - offset;
		break;
	case CUT:
		len = 100;
		break;
	case WRAP_PAST_TAIL:
		len = RING_WRAP;
		break;
	case MISALIGNED:
		len = 4;
		advance = 3;
		break;
	case A_LAP_AHEAD:
		len = 4;
		advance = h->capacity + 8;
		break;
	default:
		break;
	}
	memcpy(data + offset, &len, sizeof(len));
	__atomic_store_n(&h->tail, tail + advance, __ATOMIC_RELEASE);
}

START_TEST(a_broken_ring_closes_only_its_connection)
{
	struct service service;
	zc_session_config mine = wide_config("bystander");
	struct model model, theirs;
	struct rng rng;
	char tail[16384];

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &mine);
	model_init(&model, &mine);
	rng_seed(&rng, 80);
	async_rounds(service.client, session, &model, &rng, 20, 0, 0);
	for (enum breakage kind = 0; kind < BREAKAGES; kind++) {
		char name[32];
		snprintf(name, sizeof(name), "victim-%d", (int)kind);
		zc_session_config config = wide_config(name);
		zc_client *client = connect_client(&service.daemon);
		zc_session *victim = open_session(client, &config);
		model_init(&theirs, &config);
		/* A few updates, the ring made and used; then it is broken. */
		uintptr_t before[16];
		size_t n_before = ring_mappings(before, 16);
		async_rounds(client, victim, &theirs, &rng, 5, 0, 0);
		ring_break(ring_new_mapping(before, n_before), kind);
		/* Any request wakes the loop, which then looks at every ring. */
		zc_server_stats stats;
		ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
		int rc = 0;
		for (int i = 0; i < 100 && rc == 0; i++) {
			rc = zc_client_stats(client, &stats);
			if (rc == 0)
				usleep(10000);
		}
		ck_assert_msg(rc == -ECONNRESET || rc == -EPIPE || rc == ZC_EBROKEN,
			      "%s: the connection still answers (%s)", breakage_log[kind],
			      zc_error_name(rc));
		ck_assert_msg(strstr(daemon_log_tail(&service.daemon, tail, sizeof(tail)),
				     breakage_log[kind]) != NULL,
			      "the log does not say \"%s\":\n%s", breakage_log[kind], tail);
		zc_session_release(victim);
		zc_client_close(client);
		/* What the broken client had stored is still there. */
		config.attach = true;
		zc_session *again = open_session(service.client, &config);
		CHECK(session_matches, again, &theirs);
		zc_session_close(again);
		model_free(&theirs);
		/* And the other client goes on through its own ring. */
		async_rounds(service.client, session, &model, &rng, 5, 0, 0);
	}
	model_free(&model);
	zc_session_release(session);
	service_stop(&service);
}
END_TEST

static Suite *ring_suite(void)
{
	Suite *suite = suite_create("ring");
	const struct test_case cases[] = {
		{ "full", { a_full_ring_waits_for_room, NULL } },
		{ "doorbells", { doorbells_only_while_the_daemon_sleeps, NULL } },
		{ "refused", { a_refused_ring_leaves_the_socket, NULL } },
		{ "sync", { synchronous_updates_take_the_ring, NULL } },
		{ "nudge", { a_sleeping_client_is_nudged, NULL } },
		{ "hostile", { a_broken_ring_closes_only_its_connection, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(ring_suite(), CK_FORK);
}
