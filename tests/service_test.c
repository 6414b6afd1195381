/*
 * Integration tests of zipcached and libzipcache: every test starts a real
 * daemon (tests/daemon_harness.c) on a private directory and talks to it
 * through the public client API, or through a raw socket for requests the
 * client would never send.
 *
 * What the daemon hands back is checked against a model (tests/layer_model.c,
 * shared with tests/reliability_test.c), built from the codec's public API
 * alone: the model forms blocks the way the
 * block policy says (per_call: one block per update; streaming: a block of
 * at least R tokens is one block, after the residual is flushed as its own
 * block; shorter blocks stay exact in the residual until it holds R tokens
 * and is compressed as one block), compresses each block with
 * zc_block_compress() and reconstructs it with zc_block_reconstruct(). The
 * views must equal the model bit for bit, and the byte accounting must be
 * the seed's formulas over the model's blocks.
 *
 * Helper processes (several clients at once, a bystander that keeps
 * working while another client misbehaves) never call ck_assert: they
 * check with the same bool-returning helpers and report through their
 * exit status, and the test asserts on that.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "frame.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* Generous: a test does a few thousand round trips at most, but ASan
 * makes the daemon and the codec several times slower. */
#define TEST_TIMEOUT_SECONDS 60

#define FP16_NAN 0x7e00u
#define FP16_POSITIVE_INFINITY 0x7c00u
#define FP16_NEGATIVE_INFINITY 0xfc00u

/* ---- checks of this suite only ------------------------------------------- */

/* Residual tokens must be the very bits that were sent. */
static bool residual_is_exact(const struct model *model, uint32_t layer, const zc_view *view,
			      char *why, size_t size)
{
	const struct model_layer *l = &model->layer[layer];
	zc_strides s = model_strides(model, model->head_dim_k);
	uint32_t first = l->tokens - l->residual;

	for (uint32_t b = 0; b < model->batch; b++)
		for (uint32_t h = 0; h < model->kv_heads; h++)
			for (uint32_t t = first; t < l->tokens; t++)
				for (uint32_t d = 0; d < model->head_dim_k; d++) {
					uint16_t got = view->keys[b * view->key_strides.batch +
								  h * view->key_strides.head +
								  t * view->key_strides.token + d];
					uint16_t sent = l->exact_keys[b * s.batch + h * s.head +
								      (size_t)t * model->head_dim_k + d];
					if (got != sent)
						return fail_with(why, size,
								 "layer %u residual token %u (batch %u, head %u, "
								 "dim %u) reads 0x%04x, but 0x%04x was sent",
								 layer, t, b, h, d, got, sent);
				}
	return true;
}

/* ---- the daemon and its clients in the test process ------------------------ */

/* ---- helper processes -------------------------------------------------------- */

/* Blocks until the parent closes the barrier's write end, so helpers
 * start their work together. */
static void barrier_wait(int fd)
{
	char byte;
	while (read(fd, &byte, 1) < 0 && errno == EINTR)
		;
}

/* ---- the bystander: another client that must not notice anything -------- */

/*
 * A helper process with its own client and session that updates and
 * checks continuously until told to stop, while the test throws bad input
 * at the daemon on other connections. It reports "ready" after its first
 * few steps and, at the end, how many steps it checked.
 */
struct bystander {
	pid_t pid;
	int stop_fd;     /* the test closes it: stop */
	int report_fd;   /* "r" once running, then the step count */
	const char *socket_path;
	int stop_read, report_write;
};

static int bystander_body(void *arg)
{
	struct bystander *b = arg;
	zc_session_config config = shaped_config("bystander", 2, 1, 2, 32, 32, 2048,
						  ZC_POLICY_STREAMING, 8);
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	char why[WHY_BYTES];
	uint64_t steps = 0;
	bool stop = false;
	int rc;

	rc = zc_client_connect(b->socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc < 0) {
		fprintf(stderr, "bystander: connect: %s\n", zc_strerror(rc));
		return 1;
	}
	rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		fprintf(stderr, "bystander: open: %s '%s'\n", zc_strerror(rc),
			zc_client_last_error(client));
		return 1;
	}
	model_init(&model, &config);
	rng_seed(&rng, 4242);
	while (!stop) {
		struct pollfd p = { .fd = b->stop_read, .events = POLLIN };
		/* One more checked step after the stop, so the last bad input
		 * is known to have left this client alone. */
		stop = poll(&p, 1, 0) > 0;
		if (model.layer[0].tokens > 1800 || model.layer[1].tokens > 1800) {
			if (!trim_checked(client, session, &model, 1500, why, sizeof(why))) {
				fprintf(stderr, "bystander: step %" PRIu64 ": %s\n", steps, why);
				return 1;
			}
		}
		if (!update_checked(client, session, &model, &rng, (uint32_t)(steps % 2),
				    1 + rng_below(&rng, steps % 13 == 0 ? 20 : 4), why, sizeof(why))) {
			fprintf(stderr, "bystander: step %" PRIu64 ": %s\n", steps, why);
			return 1;
		}
		if (++steps == 4 && write(b->report_write, "r", 1) != 1)
			return 1;
	}
	if (!session_matches(session, &model, why, sizeof(why))) {
		fprintf(stderr, "bystander: at the end: %s\n", why);
		return 1;
	}
	if (write(b->report_write, &steps, sizeof(steps)) != sizeof(steps))
		return 1;
	rc = zc_session_close(session);
	zc_client_close(client);
	model_free(&model);
	return rc < 0 ? 1 : 0;
}

static void bystander_start(struct bystander *b, const char *socket_path)
{
	int stop_pipe[2], report_pipe[2];
	struct pollfd p;
	char ready = 0;

	ck_assert_int_eq(pipe2(stop_pipe, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(report_pipe, O_CLOEXEC), 0);
	b->socket_path = socket_path;
	b->stop_read = stop_pipe[0];
	b->report_write = report_pipe[1];
	b->pid = child_spawn(bystander_body, b, stop_pipe[1]);
	close(stop_pipe[0]);
	close(report_pipe[1]);
	b->stop_fd = stop_pipe[1];
	b->report_fd = report_pipe[0];
	p = (struct pollfd){ .fd = b->report_fd, .events = POLLIN };
	ck_assert_msg(poll(&p, 1, 20000) == 1 && read(b->report_fd, &ready, 1) == 1 && ready == 'r',
		      "the bystander client did not get going (see its stderr)");
}

static void bystander_finish(struct bystander *b)
{
	uint64_t steps = 0;
	ssize_t n;

	close(b->stop_fd);
	n = read(b->report_fd, &steps, sizeof(steps));
	close(b->report_fd);
	child_wait_ok(b->pid, "bystander client on its own session");
	ck_assert_msg(n == (ssize_t)sizeof(steps) && steps > 4,
		      "the bystander reported %" PRIu64 " checked steps", steps);
}

/* ---- raw requests ------------------------------------------------------------- */

static int raw_connect_checked(const struct daemon_harness *daemon)
{
	int fd = raw_connect(daemon->socket_path);
	ck_assert_msg(fd >= 0, "raw connect to %s: %s", daemon->socket_path, strerror(-fd));
	return fd;
}

static wire_pb_request raw_update_request(uint64_t request_id, uint64_t session_id, uint32_t layer,
				       uint32_t tokens, const void *keys, size_t key_bytes,
				       const void *values, size_t value_bytes)
{
	wire_pb_request request;

	memset(&request, 0, sizeof(request));
	request.msg.request_id = request_id;
	request.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	request.msg.op.update_and_fetch.session_id = session_id;
	request.msg.op.update_and_fetch.layer = layer;
	request.msg.op.update_and_fetch.tokens = tokens;
	request.keys = (wire_span){ keys, key_bytes };
	request.values = (wire_span){ values, value_bytes };
	return request;
}

static void assert_raw_status(const wire_pb_response *reply, zipcache_v1_Status expected,
			      uint64_t request_id, const char *needle, const char *what)
{
	ck_assert_msg(reply->msg.status == expected, "%s: status %s, expected %s (message '%s')",
		      what, response_status_name(reply->msg.status), response_status_name(expected), reply->msg.message);
	ck_assert_msg(reply->msg.request_id == request_id, "%s: reply to request %" PRIu64
		      ", expected %" PRIu64, what, reply->msg.request_id, request_id);
	if (expected != zipcache_v1_Status_OK) {
		ck_assert_msg(reply->msg.message[0] != '\0', "%s: refused without a message", what);
		ck_assert_msg(strcasestr(reply->msg.message, needle) != NULL,
			      "%s: message '%s' does not mention '%s'", what, reply->msg.message,
			      needle);
	}
}

/* Sends a request on a raw connection and checks the reply's status. */
static void raw_expect(int fd, const wire_pb_request *request, zipcache_v1_Status expected,
		       const char *needle, const char *what)
{
	wire_pb_response reply;
	int rc = raw_call(fd, request, &reply, NULL);

	ck_assert_msg(rc == 0, "%s: no reply: %s (%d)", what, zc_strerror(rc), rc);
	assert_raw_status(&reply, expected, request->msg.request_id, needle, what);
	wire_pb_response_free(&reply);
}

/* A hello answered on this raw connection: it is still in business. */
static void raw_hello_works(int fd, uint64_t request_id, const char *what)
{
	wire_pb_request request;
	wire_pb_response reply;
	int rc;

	memset(&request, 0, sizeof(request));
	request.msg.request_id = request_id;
	request.msg.which_op = zipcache_v1_Request_hello_tag;
	request.msg.op.hello.protocol_version = 1;
	rc = raw_call(fd, &request, &reply, NULL);
	ck_assert_msg(rc == 0, "%s: hello afterwards got no reply: %s", what, zc_strerror(rc));
	assert_raw_status(&reply, zipcache_v1_Status_OK, request_id, "", what);
	ck_assert_msg(reply.msg.which_op == zipcache_v1_Response_hello_tag,
		      "%s: hello answered with op %u", what, (unsigned)reply.msg.which_op);
	wire_pb_response_free(&reply);
}

/* Sends an arbitrary frame body (header added here) and returns the reply. */
static void raw_frame_call(int fd, const void *body, size_t len, wire_pb_response *reply,
			   const char *what)
{
	uint8_t header[FRAME_HEADER_BYTES];
	int rc;

	frame_header_write(header, (uint32_t)len);
	rc = raw_send(fd, header, sizeof(header));
	if (rc == 0 && len > 0)
		rc = raw_send(fd, body, len);
	ck_assert_msg(rc == 0, "%s: send: %s", what, strerror(-rc));
	rc = raw_read_reply(fd, 10000, reply, NULL);
	ck_assert_msg(rc == 0, "%s: no reply: %s (%d)", what, zc_strerror(rc), rc);
}

static void stats_from_reply(zc_layer_stats *out, const zipcache_v1_LayerStats *w)
{
	memset(out, 0, sizeof(*out));
	out->layer = w->layer;
	out->tokens = w->tokens;
	out->residual_tokens = w->residual_tokens;
	out->blocks = w->blocks;
	out->compressed_key_bytes = w->compressed_key_bytes;
	out->compressed_value_bytes = w->compressed_value_bytes;
	out->baseline_key_bytes = w->baseline_key_bytes;
	out->baseline_value_bytes = w->baseline_value_bytes;
	out->fp16_key_bytes = w->fp16_key_bytes;
	out->fp16_value_bytes = w->fp16_value_bytes;
	out->compression_ratio = w->compression_ratio;
	out->effective_avg_bits = w->effective_avg_bits;
}

/* A valid inline update on a raw connection, checked against the model;
 * returns the size of the reply frame. */
static size_t raw_update_checked(int fd, uint64_t request_id, uint64_t session_id,
				 struct model *model, struct rng *rng, uint32_t layer,
				 uint32_t tokens)
{
	struct block block;
	wire_pb_request request;
	wire_pb_response reply;
	zc_layer_stats got, want;
	size_t frame_bytes = 0;
	char why[WHY_BYTES] = "";
	int rc;

	block_make(&block, model, tokens, rng);
	ck_assert_int_eq(model_update(model, layer, tokens, block.keys, block.values), 0);
	request = raw_update_request(request_id, session_id, layer, tokens, block.keys,
				     block.key_elements * 2, block.values, block.value_elements * 2);
	rc = raw_call(fd, &request, &reply, &frame_bytes);
	block_free(&block);
	ck_assert_msg(rc == 0, "raw update: no reply: %s", zc_strerror(rc));
	assert_raw_status(&reply, zipcache_v1_Status_OK, request_id, "", "raw update");
	ck_assert_uint_eq(reply.msg.which_op, zipcache_v1_Response_update_and_fetch_tag);
	ck_assert_uint_eq(reply.msg.op.update_and_fetch.tokens, model->layer[layer].tokens);
	stats_from_reply(&got, &reply.msg.op.update_and_fetch.stats);
	model_layer_stats(model, layer, &want);
	ck_assert_msg(stats_match("raw update reply stats", &got, &want, true, why, sizeof(why)),
		      "%s", why);
	wire_pb_response_free(&reply);
	return frame_bytes;
}

/* Session files in the daemon's shared-memory directory. */
static int session_files(const struct daemon_harness *daemon)
{
	DIR *dir = opendir(daemon->shm_dir);
	struct dirent *entry;
	int count = 0;

	if (!dir)
		return 0;
	while ((entry = readdir(dir)) != NULL)
		if (strncmp(entry->d_name, "session-", 8) == 0 &&
		    strstr(entry->d_name, ".zcs") != NULL && strstr(entry->d_name, ".corrupt") == NULL)
			count++;
	closedir(dir);
	return count;
}

/* ======================================================================
 * 1. Correctness: views equal the codec's reconstruction, bit for bit.
 * ====================================================================== */

START_TEST(per_call_prefill_then_decode)
{
	struct service service;
	zc_session_config config = shaped_config("per-call", 3, 1, 2, 64, 64, 512,
						  ZC_POLICY_PER_CALL, 0);
	zc_layer_stats layers[3], total;
	struct model model;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 1);
	for (uint32_t layer = 0; layer < 3; layer++)
		CHECK(update_checked, service.client, session, &model, &rng, layer, 100);
	for (int step = 0; step < 40; step++)
		for (uint32_t layer = 0; layer < 3; layer++)
			CHECK(update_checked, service.client, session, &model, &rng, layer, 1);
	CHECK(session_matches, session, &model);

	/* per_call: every update is a block of its own, nothing waits. */
	ck_assert_int_eq(zc_session_stats(session, layers, 3, &total), 0);
	for (uint32_t layer = 0; layer < 3; layer++) {
		ck_assert_uint_eq(layers[layer].blocks, 41);
		ck_assert_uint_eq(layers[layer].residual_tokens, 0);
		ck_assert_uint_eq(layers[layer].tokens, 140);
	}
	ck_assert_uint_eq(total.tokens, 3 * 140);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(streaming_prefill_then_300_decode_steps)
{
	struct service service;
	/* residual_tokens 0: the daemon's default threshold, 128. */
	zc_session_config config = shaped_config("streaming", 2, 1, 2, 64, 64, 1024,
						  ZC_POLICY_STREAMING, 0);
	struct model model;
	struct rng rng;
	zc_view view;
	zc_layer_stats stats;
	struct block block;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	ck_assert_uint_eq(zc_session_get_info(session)->residual_tokens, MODEL_DEFAULT_RESIDUAL_TOKENS);
	model_init(&model, &config);
	rng_seed(&rng, 2);
	for (uint32_t layer = 0; layer < 2; layer++) {
		block_make(&block, &model, 200, &rng);
		CHECK(update_block_checked, service.client, session, &model, layer, &block, &view, &stats);
		block_free(&block);
		/* A prefill of at least R tokens is compressed at once. */
		ck_assert_uint_eq(stats.blocks, 1);
		ck_assert_uint_eq(stats.residual_tokens, 0);
	}
	for (uint32_t step = 1; step <= 300; step++) {
		for (uint32_t layer = 0; layer < 2; layer++) {
			block_make(&block, &model, 1, &rng);
			CHECK(update_block_checked, service.client, session, &model, layer, &block,
			      &view, &stats);
			block_free(&block);
			/* Decode tokens wait exact until R of them are there,
			 * then go as one block of R. */
			ck_assert_uint_eq(stats.residual_tokens, step % MODEL_DEFAULT_RESIDUAL_TOKENS);
			ck_assert_uint_eq(stats.blocks, 1 + step / MODEL_DEFAULT_RESIDUAL_TOKENS);
			CHECK(residual_is_exact, &model, layer, &view);
			if (step == MODEL_DEFAULT_RESIDUAL_TOKENS) {
				/* The flushed tokens now read back as their
				 * (lossy) reconstruction, not as sent. */
				const struct model_layer *l = &model.layer[layer];
				bool changed = false;
				for (uint32_t t = 200; t < 200 + step && !changed; t++)
					for (uint32_t d = 0; d < 64 && !changed; d++)
						changed = view.keys[t * 64 + d] !=
							  l->exact_keys[(size_t)t * 64 + d];
				ck_assert_msg(changed, "layer %u: flushed residual still reads exact", layer);
			}
		}
	}
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(streaming_mixed_block_sizes)
{
	/* Hand-worked with R = 32: what each update leaves behind. */
	static const struct {
		uint32_t tokens, blocks, residual;
	} plan[] = {
		{ 5, 0, 5 },    /* short: waits */
		{ 10, 0, 15 },
		{ 20, 1, 0 },   /* residual reaches 35 >= 32: one block of 35 */
		{ 40, 2, 0 },   /* long, residual empty: one block */
		{ 3, 2, 3 },
		{ 32, 4, 0 },   /* exactly R: residual (3) flushed first, then the block */
		{ 31, 4, 31 },
		{ 31, 5, 0 },   /* 62 >= 32: the whole residual is one block */
		{ 1, 5, 1 },
		{ 100, 7, 0 },
		{ 7, 7, 7 },
		{ 25, 8, 0 },
		{ 16, 8, 16 },
		{ 16, 9, 0 },
		{ 33, 10, 0 },
		{ 2, 10, 2 },
		{ 200, 12, 0 },
	};
	struct service service;
	zc_session_config config = shaped_config("mixed", 2, 1, 2, 48, 48, 2048,
						  ZC_POLICY_STREAMING, 32);
	struct model model;
	struct rng rng;
	zc_layer_stats stats;
	struct block block;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 3);
	for (size_t i = 0; i < sizeof(plan) / sizeof(plan[0]); i++) {
		for (uint32_t layer = 0; layer < 2; layer++) {
			block_make(&block, &model, plan[i].tokens, &rng);
			CHECK(update_block_checked, service.client, session, &model, layer, &block, NULL,
			      &stats);
			block_free(&block);
			ck_assert_msg(stats.blocks == plan[i].blocks && stats.residual_tokens == plan[i].residual,
				      "after update %zu (%u tokens) layer %u: %" PRIu64 " blocks and %u residual, "
				      "expected %u and %u", i, plan[i].tokens, layer, stats.blocks,
				      stats.residual_tokens, plan[i].blocks, plan[i].residual);
		}
	}
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(batch_two_and_distinct_head_dims)
{
	struct service service;
	zc_session_config streaming = shaped_config("wide-streaming", 4, 2, 3, 80, 24, 1024,
						     ZC_POLICY_STREAMING, 16);
	zc_session_config per_call = shaped_config("wide-per-call", 2, 2, 3, 24, 80, 1024,
						    ZC_POLICY_PER_CALL, 0);
	struct model model_streaming, model_per_call;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *a = open_session(service.client, &streaming);
	zc_session *b = open_session(service.client, &per_call);
	model_init(&model_streaming, &streaming);
	model_init(&model_per_call, &per_call);
	rng_seed(&rng, 4);
	for (uint32_t step = 0; step < 48; step++) {
		uint32_t tokens = step % 6 == 0 ? 20 + rng_below(&rng, 30) : 1 + rng_below(&rng, 9);
		CHECK(update_checked, service.client, a, &model_streaming, &rng, step % 4, tokens);
		if (step % 2 == 0)
			CHECK(update_checked, service.client, b, &model_per_call, &rng, step / 2 % 2,
			      tokens);
	}
	CHECK(session_matches, a, &model_streaming);
	CHECK(session_matches, b, &model_per_call);
	ck_assert_int_eq(zc_session_close(a), 0);
	ck_assert_int_eq(zc_session_close(b), 0);
	model_free(&model_streaming);
	model_free(&model_per_call);
	service_stop(&service);
}
END_TEST

START_TEST(values_exact_when_not_quantized)
{
	struct service service;
	struct rng rng;

	service_start(&service, NULL);
	rng_seed(&rng, 5);
	for (int policy = 0; policy < 2; policy++) {
		zc_session_config config = shaped_config(policy ? "exact-values-per-call" :
								   "exact-values-streaming",
							  2, 1, 2, 64, 32, 512,
							  policy ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING,
							  16);
		struct model model;
		zc_layer_stats layers[2], total;

		config.codec.quantize_values = false;
		zc_session *session = open_session(service.client, &config);
		ck_assert(!zc_session_get_info(session)->codec.quantize_values);
		model_init(&model, &config);
		for (uint32_t step = 0; step < 30; step++)
			CHECK(update_checked, service.client, session, &model, &rng, step % 2,
			      step % 5 == 0 ? 40 : 1 + step % 7);
		CHECK(session_matches, session, &model);
		/* Values, compressed or not, read back as sent. */
		for (uint32_t layer = 0; layer < 2; layer++) {
			zc_view view;
			const struct model_layer *l = &model.layer[layer];
			ck_assert_int_eq(zc_session_view(session, layer, &view), 0);
			for (uint32_t h = 0; h < 2; h++)
				ck_assert_msg(memcmp(view.values + h * view.value_strides.head,
						     l->exact_values + (size_t)h * 512 * 32,
						     (size_t)l->tokens * 32 * 2) == 0,
					      "layer %u head %u: values not exact with quantize_values "
					      "false", layer, h);
		}
		ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
		ck_assert_uint_eq(total.compressed_value_bytes, total.fp16_value_bytes);
		ck_assert_uint_lt(total.compressed_key_bytes, total.fp16_key_bytes);
		ck_assert_int_eq(zc_session_close(session), 0);
		model_free(&model);
	}
	service_stop(&service);
}
END_TEST

START_TEST(custom_codec_configs)
{
	static const zc_codec_config configs[] = {
		{ .hi_bits = 8, .lo_bits = 3, .hi_fraction = 0.5, .group_size = 16, .quantize_values = true },
		{ .hi_bits = 2, .lo_bits = 1, .hi_fraction = 0.0, .group_size = 7, .quantize_values = true },
		{ .hi_bits = 5, .lo_bits = 5, .hi_fraction = 1.0, .group_size = 1, .quantize_values = true },
		{ .hi_bits = 3, .lo_bits = 8, .hi_fraction = 0.33, .group_size = 100, .quantize_values = false },
	};
	struct service service;
	struct rng rng;
	char name[32];

	service_start(&service, NULL);
	rng_seed(&rng, 6);
	for (size_t i = 0; i < sizeof(configs) / sizeof(configs[0]); i++) {
		for (int policy = 0; policy < 2; policy++) {
			zc_session_config config = shaped_config(name, 2, 1, 2, 32, 48, 512,
								  policy ? ZC_POLICY_PER_CALL :
									   ZC_POLICY_STREAMING, 12);
			struct model model;

			snprintf(name, sizeof(name), "codec-%zu-%d", i, policy);
			config.codec = configs[i];
			zc_session *session = open_session(service.client, &config);
			const zc_session_info *info = zc_session_get_info(session);
			ck_assert_int_eq(info->codec.hi_bits, configs[i].hi_bits);
			ck_assert_int_eq(info->codec.lo_bits, configs[i].lo_bits);
			ck_assert_double_eq(info->codec.hi_fraction, configs[i].hi_fraction);
			ck_assert_int_eq(info->codec.group_size, configs[i].group_size);
			ck_assert_int_eq(info->codec.quantize_values, configs[i].quantize_values);
			ck_assert_int_eq(info->policy, config.policy);
			model_init(&model, &config);
			for (uint32_t step = 0; step < 16; step++)
				CHECK(update_checked, service.client, session, &model, &rng, step % 2,
				      step % 4 == 0 ? 30 : 1 + step % 5);
			CHECK(session_matches, session, &model);
			ck_assert_int_eq(zc_session_close(session), 0);
			model_free(&model);
		}
	}
	service_stop(&service);
}
END_TEST

/* Both ways of writing blocks into the pool (--pool-writes): in place
 * through a mapping, and by pwrite from scratch. */
static const char *const pool_writes_modes[] = { "map", "copy" };

START_TEST(large_blocks_through_staging)
{
	/* 600 tokens x 4 heads x 128 dims x 2 bytes x (K + V) = 1.2 MB: far
	 * above the inline limit, so the client stages it. */
	zc_session_config config = shaped_config("staged", 2, 1, 4, 128, 128, 2048,
						  ZC_POLICY_STREAMING, 0);

	/* Views none as well: the layer is then read back from the pool's
	 * bytes (client/reader.c), not from views made beside them. */
	for (size_t m = 0; m < 4; m++) {
		const char *const args[] = { "--pool-writes", pool_writes_modes[m % 2], NULL };
		struct service service;
		struct model model;
		struct rng rng;

		config.views = m < 2 ? ZC_VIEWS_FULL : ZC_VIEWS_NONE;
		service_start(&service, args);
		zc_session *session = open_session(service.client, &config);
		model_init(&model, &config);
		rng_seed(&rng, 7);
		for (uint32_t layer = 0; layer < 2; layer++)
			CHECK(update_checked, service.client, session, &model, &rng, layer, 600);
		for (uint32_t step = 0; step < 20; step++)
			CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1);
		/* A second large block after decode: the residual goes first. */
		CHECK(update_checked, service.client, session, &model, &rng, 0, 700);
		CHECK(session_matches, session, &model);
		ck_assert_int_eq(zc_session_close(session), 0);
		model_free(&model);
		service_stop(&service);
	}
}
END_TEST

/* A block of 1100 tokens with a NaN in its last value, refused; the
 * session must read as the model says. */
static void refused_large_block(struct service *service, zc_session *session,
				const struct model *model, struct rng *rng, uint32_t layer)
{
	struct block block;
	zc_view view;
	block_make(&block, model, 1100, rng);
	block.values[block.value_elements - 1] = FP16_NAN;
	int rc = zc_update_and_fetch(session, layer, 1100, block.keys, block.values, &view, NULL);
	assert_refused(service->client, rc, ZC_EINVALID, "values", "a NaN in the last head");
	block_free(&block);
	CHECK(session_matches, session, model);
}

/* Blocks large enough to be spread over codec threads (server/codec_fanout.c)
 * come back bit for bit as one thread makes them: a staged prefill, a
 * residual flush of 512 rows, a second large block, batch 2 so that the
 * threads' parts cross batch entries, then the views dropped under
 * memory pressure and rebuilt on the threads. */
START_TEST(large_blocks_spread_over_codec_threads)
{
	/* 2 x 4 heads x 1100 tokens x 128 dims = 1.1 M elements per tensor,
	 * above CODEC_FANOUT_MIN_ELEMENTS; a residual of 512 rows too. */
	zc_session_config config = shaped_config("spread", 2, 2, 4, 128, 128, 4096,
						  ZC_POLICY_STREAMING, 512);

	for (size_t m = 0; m < 2; m++) {
		const char *const args[] = { "--codec-threads", "3", "--pool-writes",
					     pool_writes_modes[m], NULL };
		struct service service;
		struct model model;
		struct rng rng;

		service_start(&service, args);
		zc_session *session = open_session(service.client, &config);
		model_init(&model, &config);
		rng_seed(&rng, 31);
		for (uint32_t layer = 0; layer < 2; layer++)
			CHECK(update_checked, service.client, session, &model, &rng, layer, 1100);
		/* A NaN in the last head: with nothing in the residual, the
		 * heads before it were compressed, and their views written
		 * past the layer's tokens, by the time it is met; with rows in
		 * the residual (layer 0 below), the whole block is checked
		 * before the residual is flushed. Nothing of it may show. */
		refused_large_block(&service, session, &model, &rng, 1);
		for (uint32_t step = 0; step < 520; step++)
			CHECK(update_checked, service.client, session, &model, &rng, 0, 1);
		refused_large_block(&service, session, &model, &rng, 0);
		CHECK(session_matches, session, &model);
		CHECK(update_checked, service.client, session, &model, &rng, 1, 1500);
		CHECK(session_matches, session, &model);
		ck_assert_int_eq(zc_session_close(session), 0);
		model_free(&model);
		service_stop(&service);
	}
}
END_TEST

START_TEST(decode_accounting_per_call_inflates_streaming_compresses)
{
	struct service service;
	zc_session_config per_call = shaped_config("decode-per-call", 2, 1, 2, 64, 64, 512,
						    ZC_POLICY_PER_CALL, 0);
	zc_session_config streaming = shaped_config("decode-streaming", 2, 1, 2, 64, 64, 512,
						     ZC_POLICY_STREAMING, 0);
	struct model model_per_call, model_streaming;
	zc_layer_stats layers[2], total;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *a = open_session(service.client, &per_call);
	zc_session *b = open_session(service.client, &streaming);
	model_init(&model_per_call, &per_call);
	model_init(&model_streaming, &streaming);
	rng_seed(&rng, 8);
	for (uint32_t step = 0; step < 256; step++) {
		for (uint32_t layer = 0; layer < 2; layer++) {
			CHECK(update_checked, service.client, a, &model_per_call, &rng, layer, 1);
			CHECK(update_checked, service.client, b, &model_streaming, &rng, layer, 1);
		}
	}
	CHECK(session_matches, a, &model_per_call);
	CHECK(session_matches, b, &model_streaming);

	/* One-token blocks carry a scale and a minimum per element: 289
	 * bytes per 128 of fp16 at D = 64, ratio 0.44. */
	ck_assert_int_eq(zc_session_stats(a, layers, 2, &total), 0);
	ck_assert_msg(total.compression_ratio < 1.0 && total.effective_avg_bits > 16.0,
		      "per_call decode should inflate: ratio %g, %g bits", total.compression_ratio,
		      total.effective_avg_bits);
	ck_assert_double_eq_tol(total.compression_ratio, 128.0 / 289.0, 1e-9);
	/* The residual makes decode blocks of 128: ~4.4x. */
	ck_assert_int_eq(zc_session_stats(b, layers, 2, &total), 0);
	ck_assert_msg(total.compression_ratio > 4.0 && total.effective_avg_bits < 4.0,
		      "streaming decode should compress: ratio %g, %g bits", total.compression_ratio,
		      total.effective_avg_bits);
	ck_assert_uint_eq(total.blocks, 4);
	ck_assert_uint_eq(total.residual_tokens, 0);
	ck_assert_int_eq(zc_session_close(a), 0);
	ck_assert_int_eq(zc_session_close(b), 0);
	model_free(&model_per_call);
	model_free(&model_streaming);
	service_stop(&service);
}
END_TEST

/* ======================================================================
 * 2. Trim and the max_tokens limit.
 * ====================================================================== */

START_TEST(trim_then_update_streaming)
{
	struct service service;
	zc_session_config config = shaped_config("trim", 2, 1, 2, 32, 32, 512, ZC_POLICY_STREAMING,
						  16);
	zc_layer_stats layers[2], total;
	struct model model;
	struct rng rng;
	zc_view view;
	uint16_t kept[37 * 32];

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 9);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 40); /* block [0, 40) */
	CHECK(update_checked, service.client, session, &model, &rng, 0, 10); /* residual 10 */
	CHECK(update_checked, service.client, session, &model, &rng, 1, 30); /* block [0, 30) */
	CHECK(update_checked, service.client, session, &model, &rng, 1, 4);  /* residual 4 */

	/* Within the residual: only exact tokens go. */
	CHECK(trim_checked, service.client, session, &model, 4);
	ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
	ck_assert_uint_eq(layers[0].tokens, 46);
	ck_assert_uint_eq(layers[0].residual_tokens, 6);
	ck_assert_uint_eq(layers[1].residual_tokens, 0);
	ck_assert_uint_eq(layers[1].blocks, 1);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 3); /* residual 9 */

	/* Past the residual into block [0, 40): it stays whole, its first
	 * 37 tokens read as before. */
	ck_assert_int_eq(zc_session_view(session, 0, &view), 0);
	memcpy(kept, view.keys, sizeof(kept));
	CHECK(trim_checked, service.client, session, &model, 12);
	ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
	ck_assert_uint_eq(layers[0].tokens, 37);
	ck_assert_uint_eq(layers[0].blocks, 1);
	ck_assert_uint_eq(layers[0].residual_tokens, 0);
	ck_assert_uint_eq(layers[0].fp16_key_bytes, 2 * 2 * 37 * 32);
	ck_assert_uint_eq(layers[1].tokens, 18);

	/* New tokens land after the kept ones. */
	CHECK(update_checked, service.client, session, &model, &rng, 0, 5);  /* residual [37, 42) */
	CHECK(update_checked, service.client, session, &model, &rng, 0, 20); /* [37, 42), [42, 62) */
	CHECK(update_checked, service.client, session, &model, &rng, 1, 16);
	ck_assert_int_eq(zc_session_view(session, 0, &view), 0);
	ck_assert_msg(memcmp(kept, view.keys, sizeof(kept)) == 0,
		      "the kept prefix of a block cut by trim changed");
	ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
	ck_assert_uint_eq(layers[0].blocks, 3);

	/* Both blocks after token 37 go whole. */
	CHECK(trim_checked, service.client, session, &model, 25);
	ck_assert_int_eq(zc_session_stats(session, layers, 2, &total), 0);
	ck_assert_uint_eq(layers[0].blocks, 1);
	ck_assert_uint_eq(layers[0].tokens, 37);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 16);
	for (uint32_t step = 0; step < 20; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1 + step % 3);
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(trim_accounting_per_call)
{
	struct service service;
	zc_session_config config = shaped_config("trim-per-call", 1, 1, 2, 64, 64, 256,
						  ZC_POLICY_PER_CALL, 0);
	zc_block_shape shape = { 1, 2, 10, 64 };
	zc_byte_count block_key;
	zc_layer_stats layers[1], total;
	struct model model;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 10);
	ck_assert_int_eq(zc_block_count_bytes(&config.codec, ZC_TENSOR_KEYS, &shape, &block_key), 0);
	for (int i = 0; i < 3; i++)
		CHECK(update_checked, service.client, session, &model, &rng, 0, 10);
	ck_assert_int_eq(zc_session_stats(session, layers, 1, &total), 0);
	ck_assert_uint_eq(layers[0].compressed_key_bytes, 3 * block_key.compressed);

	/* 15 of 30: block [20, 30) goes, block [10, 20) keeps 5 tokens but
	 * all its bytes; fp16 counts the 15 tokens left. */
	CHECK(trim_checked, service.client, session, &model, 15);
	ck_assert_int_eq(zc_session_stats(session, layers, 1, &total), 0);
	ck_assert_uint_eq(layers[0].blocks, 2);
	ck_assert_uint_eq(layers[0].compressed_key_bytes, 2 * block_key.compressed);
	ck_assert_uint_eq(layers[0].baseline_key_bytes, 2 * block_key.baseline);
	ck_assert_uint_eq(layers[0].fp16_key_bytes, 2 * 2 * 15 * 64);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 7); /* [15, 22) */
	ck_assert_int_eq(zc_session_stats(session, layers, 1, &total), 0);
	ck_assert_uint_eq(layers[0].blocks, 3);

	/* Everything: no blocks, no bytes. */
	CHECK(trim_checked, service.client, session, &model, 22);
	ck_assert_int_eq(zc_session_stats(session, layers, 1, &total), 0);
	ck_assert_uint_eq(layers[0].blocks, 0);
	ck_assert_uint_eq(layers[0].compressed_key_bytes, 0);
	ck_assert_uint_eq(layers[0].compressed_value_bytes, 0);
	ck_assert_uint_eq(layers[0].fp16_key_bytes, 0);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 9);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(trim_more_than_held_clamps)
{
	struct service service;
	zc_session_config config = shaped_config("trim-clamp", 3, 1, 1, 32, 32, 256,
						  ZC_POLICY_STREAMING, 8);
	zc_layer_stats layers[3], total;
	struct model model;
	struct rng rng;
	uint32_t trimmed = 12345;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 11);

	/* Trimming an empty session, and trimming nothing, change nothing. */
	ck_assert_int_eq(zc_session_trim(session, 5, &trimmed), 0);
	ck_assert_uint_eq(trimmed, 0);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 30);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 3);
	CHECK(update_checked, service.client, session, &model, &rng, 1, 10);
	CHECK(trim_checked, service.client, session, &model, 0);

	/* Layers of 33, 10 and 0 tokens: each loses what it has. */
	CHECK(trim_checked, service.client, session, &model, 1000);
	ck_assert_int_eq(zc_session_trim(session, 1000, &trimmed), 0);
	ck_assert_uint_eq(trimmed, 0);
	ck_assert_int_eq(zc_session_stats(session, layers, 3, &total), 0);
	ck_assert_uint_eq(total.tokens, 0);
	ck_assert_uint_eq(total.blocks, 0);
	ck_assert_uint_eq(total.compressed_key_bytes, 0);
	ck_assert_uint_eq(total.fp16_value_bytes, 0);
	for (uint32_t layer = 0; layer < 3; layer++)
		CHECK(update_checked, service.client, session, &model, &rng, layer, 5 + layer);
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(views_reach_max_tokens_then_refuse)
{
	struct service service;
	struct rng rng;

	service_start(&service, NULL);
	rng_seed(&rng, 12);
	for (int policy = 0; policy < 2; policy++) {
		zc_session_config config = shaped_config(policy ? "full-per-call" : "full-streaming",
							  2, 1, 2, 32, 32, 100,
							  policy ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING,
							  16);
		struct model model;
		struct block block;
		zc_view view;
		int rc;

		zc_session *session = open_session(service.client, &config);
		model_init(&model, &config);
		/* Up to exactly max_tokens, through both paths. */
		CHECK(update_checked, service.client, session, &model, &rng, 0, 40);
		CHECK(update_checked, service.client, session, &model, &rng, 0, 7);
		CHECK(update_checked, service.client, session, &model, &rng, 0, 30);
		CHECK(update_checked, service.client, session, &model, &rng, 0, 23);
		ck_assert_int_eq(zc_session_view(session, 0, &view), 0);
		ck_assert_uint_eq(view.tokens, 100);

		/* One more token: refused, nothing stored (the checked update
		 * compares the whole session with the unchanged model). */
		block_make(&block, &model, 1, &rng);
		CHECK(update_block_checked, service.client, session, &model, 0, &block, NULL, NULL);
		rc = zc_update_and_fetch(session, 0, 1, block.keys, block.values, &view, NULL);
		assert_refused(service.client, rc, ZC_EEXHAUSTED, "max_tokens", "101st token");
		block_free(&block);
		ck_assert_int_eq(zc_session_view(session, 0, &view), 0);
		ck_assert_uint_eq(view.tokens, 100);

		/* A block longer than max_tokens on an empty layer. */
		block_make(&block, &model, 101, &rng);
		rc = zc_update_and_fetch(session, 1, 101, block.keys, block.values, &view, NULL);
		assert_refused(service.client, rc, ZC_EEXHAUSTED, "max_tokens", "101-token block");
		block_free(&block);
		CHECK(session_matches, session, &model);

		/* The other layer fills up in one block; trim makes room. */
		CHECK(update_checked, service.client, session, &model, &rng, 1, 100);
		CHECK(trim_checked, service.client, session, &model, 1);
		CHECK(update_checked, service.client, session, &model, &rng, 0, 1);
		CHECK(update_checked, service.client, session, &model, &rng, 1, 1);
		CHECK(update_checked, service.client, session, &model, &rng, 1, 1); /* refused */
		CHECK(session_matches, session, &model);
		ck_assert_int_eq(zc_session_close(session), 0);
		model_free(&model);
	}
	service_stop(&service);
}
END_TEST

/* ======================================================================
 * 3. Several clients at once; sessions outlive connections.
 * ====================================================================== */

struct parallel_job {
	const char *socket_path;
	int index;
	int barrier_fd;
};

/* One client process on its own session, checking every step. */
static int parallel_client_body(void *arg)
{
	const struct parallel_job *job = arg;
	char name[32], why[WHY_BYTES];
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	int rc;

	snprintf(name, sizeof(name), "parallel-%d", job->index);
	zc_session_config config = shaped_config(name, 3, 1 + job->index % 2, 2, 32, 16, 2048,
						  job->index % 2 ? ZC_POLICY_PER_CALL :
								   ZC_POLICY_STREAMING, 16);
	rc = zc_client_connect(job->socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc < 0) {
		fprintf(stderr, "%s: connect: %s\n", name, zc_strerror(rc));
		return 1;
	}
	rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		fprintf(stderr, "%s: open: %s '%s'\n", name, zc_strerror(rc), zc_client_last_error(client));
		return 1;
	}
	model_init(&model, &config);
	rng_seed(&rng, 100 + (uint64_t)job->index);
	barrier_wait(job->barrier_fd);
	for (uint32_t step = 0; step < 90; step++) {
		uint32_t tokens = 1 + rng_below(&rng, step % 10 == 0 ? 60 : 6);
		if (!update_checked(client, session, &model, &rng, step % 3, tokens, why, sizeof(why))) {
			fprintf(stderr, "%s step %u: %s\n", name, step, why);
			return 1;
		}
	}
	if (!session_matches(session, &model, why, sizeof(why))) {
		fprintf(stderr, "%s at the end: %s\n", name, why);
		return 1;
	}
	rc = zc_session_close(session);
	zc_client_close(client);
	model_free(&model);
	return rc < 0 ? 1 : 0;
}

START_TEST(parallel_clients_on_separate_sessions)
{
	enum { CLIENTS = 4 };
	struct parallel_job jobs[CLIENTS];
	pid_t pids[CLIENTS];
	struct service service;
	zc_server_stats stats;
	int barrier[2];

	service_start(&service, NULL);
	ck_assert_int_eq(pipe2(barrier, O_CLOEXEC), 0);
	for (int i = 0; i < CLIENTS; i++) {
		jobs[i] = (struct parallel_job){ service.daemon.socket_path, i, barrier[0] };
		pids[i] = child_spawn(parallel_client_body, &jobs[i], barrier[1]);
	}
	close(barrier[0]);
	close(barrier[1]);
	for (int i = 0; i < CLIENTS; i++)
		child_wait_ok(pids[i], "parallel client");
	/* Each closed its session. */
	ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	ck_assert_uint_eq(stats.sessions, 0);
	service_stop(&service);
}
END_TEST

START_TEST(two_connections_alternate_on_one_session)
{
	struct service service;
	zc_session_config config = shaped_config("shared", 2, 1, 2, 32, 32, 1024,
						  ZC_POLICY_STREAMING, 8);
	struct model model;
	struct rng rng;

	service_start(&service, NULL);
	zc_client *other = connect_client(&service.daemon);
	zc_session *mine = open_session(service.client, &config);
	config.attach = true;
	zc_session *theirs = open_session(other, &config);
	ck_assert_uint_eq(zc_session_get_info(theirs)->id, zc_session_get_info(mine)->id);
	model_init(&model, &config);
	rng_seed(&rng, 13);
	for (uint32_t step = 0; step < 80; step++) {
		/* First different layers, then both on layer 0 in turn. */
		bool first = step % 2 == 0;
		uint32_t layer = step < 40 ? step % 2 : 0;
		zc_client *client = first ? service.client : other;
		zc_session *session = first ? mine : theirs;
		zc_session *watcher = first ? theirs : mine;
		zc_view view;
		char why[WHY_BYTES];

		CHECK(update_checked, client, session, &model, &rng, layer, 1 + step % 11);
		/* The other connection's mapping shows the same tokens. */
		ck_assert_int_eq(zc_session_view(watcher, layer, &view), 0);
		ck_assert_msg(view_matches(&model, layer, &view, why, sizeof(why)),
			      "through the other connection: %s", why);
	}
	CHECK(session_matches, mine, &model);
	CHECK(session_matches, theirs, &model);
	zc_session_release(theirs);
	zc_client_close(other);
	ck_assert_int_eq(zc_session_close(mine), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/*
 * Two processes append to the same layer at once: the daemon decides the
 * order, each reply tells where that block landed, and the parent replays
 * the blocks in that order into its model. Each process also owns a layer
 * of its own and checks it step by step.
 */
#define RACE_STEPS 60

struct race_record {
	int32_t child;
	int32_t step;
	uint32_t first_token;
	uint32_t tokens;
};

struct race_job {
	const char *socket_path;
	int child;
	int barrier_fd;
	int record_fd;
};

static zc_session_config race_config(void)
{
	zc_session_config config = shaped_config("race", 3, 1, 2, 32, 32, 4096,
						  ZC_POLICY_STREAMING, 16);
	config.attach = true;
	return config;
}

static uint32_t race_tokens(int child, int step)
{
	return step % 7 == 3 ? 16 + (uint32_t)(child * 5 + step) % 20 : 1 + (uint32_t)(child * 3 + step) % 9;
}

static uint64_t race_seed(int child, int step, int shared)
{
	return 0x5eed0000ull + (uint64_t)child * 100000 + (uint64_t)step * 10 + (uint64_t)shared;
}

static int race_body(void *arg)
{
	const struct race_job *job = arg;
	zc_session_config config = race_config();
	uint32_t own_layer = (uint32_t)job->child + 1;
	char why[WHY_BYTES];
	zc_client *client;
	zc_session *session;
	struct model model;
	int rc;

	rc = zc_client_connect(job->socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc == 0)
		rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		fprintf(stderr, "race %d: %s\n", job->child, zc_strerror(rc));
		return 1;
	}
	model_init(&model, &config);
	barrier_wait(job->barrier_fd);
	for (int step = 0; step < RACE_STEPS; step++) {
		struct race_record record = { job->child, step, 0, race_tokens(job->child, step) };
		struct block block;
		struct rng rng;
		zc_view view;

		rng_seed(&rng, race_seed(job->child, step, 1));
		block_make(&block, &model, record.tokens, &rng);
		rc = zc_update_and_fetch(session, 0, record.tokens, block.keys, block.values, &view, NULL);
		block_free(&block);
		if (rc < 0 || view.tokens < record.tokens) {
			fprintf(stderr, "race %d step %d on the shared layer: %s '%s'\n", job->child,
				step, zc_strerror(rc), zc_client_last_error(client));
			return 1;
		}
		/* Replies on one session come in the order the daemon
		 * applied them: this block ends where the view ends. */
		record.first_token = view.tokens - record.tokens;
		if (write(job->record_fd, &record, sizeof(record)) != sizeof(record))
			return 1;
		rng_seed(&rng, race_seed(job->child, step, 0));
		if (!update_checked(client, session, &model, &rng, own_layer, 1 + step % 5, why,
				    sizeof(why))) {
			fprintf(stderr, "race %d step %d on its own layer: %s\n", job->child, step, why);
			return 1;
		}
	}
	zc_session_release(session);
	zc_client_close(client);
	model_free(&model);
	return 0;
}

static int race_record_order(const void *a, const void *b)
{
	const struct race_record *x = a, *y = b;
	return x->first_token < y->first_token ? -1 : x->first_token > y->first_token;
}

START_TEST(two_processes_race_on_one_session)
{
	struct race_record records[2 * RACE_STEPS];
	struct race_job jobs[2];
	pid_t pids[2];
	zc_session_config config = race_config();
	struct service service;
	struct model model;
	int barrier[2], record_pipe[2];
	uint32_t next = 0;
	size_t got = 0;

	service_start(&service, NULL);
	config.attach = false;
	zc_session *session = open_session(service.client, &config);
	ck_assert_int_eq(pipe2(barrier, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(record_pipe, O_CLOEXEC), 0);
	for (int i = 0; i < 2; i++) {
		jobs[i] = (struct race_job){ service.daemon.socket_path, i, barrier[0], record_pipe[1] };
		pids[i] = child_spawn(race_body, &jobs[i], barrier[1]);
	}
	close(barrier[0]);
	close(barrier[1]);
	close(record_pipe[1]);
	for (int i = 0; i < 2; i++)
		child_wait_ok(pids[i], "racing client");
	for (;;) {
		ssize_t n = read(record_pipe[0], (char *)records + got, sizeof(records) - got);
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	close(record_pipe[0]);
	ck_assert_uint_eq(got, sizeof(records));

	/* The blocks must tile the layer: no two in one place, no gap. */
	qsort(records, 2 * RACE_STEPS, sizeof(records[0]), race_record_order);
	model_init(&model, &config);
	for (size_t i = 0; i < 2 * RACE_STEPS; i++) {
		struct block block;
		struct rng rng;
		ck_assert_msg(records[i].first_token == next,
			      "block %zu (client %d step %d) landed at token %u, expected %u", i,
			      records[i].child, records[i].step, records[i].first_token, next);
		next += records[i].tokens;
		rng_seed(&rng, race_seed(records[i].child, records[i].step, 1));
		block_make(&block, &model, records[i].tokens, &rng);
		ck_assert_int_eq(model_update(&model, 0, block.tokens, block.keys, block.values), 0);
		block_free(&block);
	}
	for (int child = 0; child < 2; child++) {
		for (int step = 0; step < RACE_STEPS; step++) {
			struct block block;
			struct rng rng;
			rng_seed(&rng, race_seed(child, step, 0));
			block_make(&block, &model, 1 + (uint32_t)step % 5, &rng);
			ck_assert_int_eq(model_update(&model, (uint32_t)child + 1, block.tokens, block.keys,
						      block.values), 0);
			block_free(&block);
		}
	}
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(session_survives_disconnect)
{
	struct service service;
	zc_session_config config = shaped_config("persist", 2, 1, 2, 32, 32, 1024,
						  ZC_POLICY_STREAMING, 16);
	zc_session_info infos[4];
	struct model model;
	struct rng rng;
	size_t count = 0;
	uint64_t id;
	int rc;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	id = zc_session_get_info(session)->id;
	model_init(&model, &config);
	rng_seed(&rng, 14);
	for (uint32_t step = 0; step < 12; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1 + step * 3 % 20);
	/* The worker goes away without closing its session. */
	zc_client_close(service.client);
	service.client = connect_client(&service.daemon);

	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 1);
	ck_assert_str_eq(infos[0].name, "persist");
	ck_assert_uint_eq(infos[0].id, id);
	ck_assert_uint_eq(infos[0].layers, 2);
	ck_assert_uint_eq(infos[0].min_tokens, model.layer[1].tokens);
	ck_assert_uint_eq(infos[0].max_layer_tokens, model.layer[0].tokens);

	/* Without attach the name is taken. */
	rc = zc_session_open(service.client, &config, &session);
	assert_refused(service.client, rc, ZC_EEXISTS, "persist", "open of an existing name");
	/* With attach but another shape, it is not the same session. */
	config.attach = true;
	config.layers = 3;
	rc = zc_session_open(service.client, &config, &session);
	assert_refused(service.client, rc, ZC_EINVALID, "shape", "attach with another shape");

	config.layers = 2;
	session = open_session(service.client, &config);
	ck_assert_uint_eq(zc_session_get_info(session)->id, id);
	CHECK(session_matches, session, &model);
	for (uint32_t step = 0; step < 12; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1 + step * 5 % 20);
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 0);

	/* Without a name the daemon picks distinct ones. */
	zc_session_config unnamed = shaped_config(NULL, 1, 1, 1, 32, 32, 64, ZC_POLICY_STREAMING, 0);
	zc_session *first = open_session(service.client, &unnamed);
	unnamed.name = "";
	zc_session *second = open_session(service.client, &unnamed);
	ck_assert_uint_ne(zc_session_get_info(first)->id, zc_session_get_info(second)->id);
	ck_assert_str_ne(zc_session_get_info(first)->name, zc_session_get_info(second)->name);
	ck_assert_msg(zc_session_get_info(first)->name[0] != '\0', "the daemon named no session");
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 2);
	ck_assert_int_eq(zc_session_close(first), 0);
	ck_assert_int_eq(zc_session_close(second), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/*
 * Many requests in one write, without waiting: every reply echoes its
 * request's id, and the session applies them in the order they were sent
 * (large blocks run on the thread pool, small ones on the loop, and still
 * none overtakes another).
 */
START_TEST(pipelined_requests_apply_in_order)
{
	enum { REQUESTS = 48 };
	struct service service;
	/* 400 tokens x 2 heads x (96 + 32) dims is above the daemon's
	 * offload threshold of 65536 elements: those blocks go to a worker. */
	zc_session_config config = shaped_config("pipeline", 2, 1, 2, 96, 32, 4096,
						  ZC_POLICY_STREAMING, 16);
	struct {
		bool trim;
		uint32_t layer, tokens, expect_tokens, expect_trimmed;
		zc_layer_stats expect_stats;
	} plan[REQUESTS];
	uint8_t *frames = NULL;
	size_t frames_len = 0;
	bool answered[REQUESTS] = { false };
	uint64_t last_id[2] = { 0, 0 };
	struct model model;
	struct rng rng;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	uint64_t id = zc_session_get_info(session)->id;
	model_init(&model, &config);
	rng_seed(&rng, 21);

	/* Build every frame, applying each to the model as the daemon must. */
	for (uint32_t i = 0; i < REQUESTS; i++) {
		wire_pb_request request;
		size_t size, len;

		memset(&request, 0, sizeof(request));
		plan[i].trim = i % 13 == 12;
		plan[i].layer = i % 2;
		if (plan[i].trim) {
			request.msg.request_id = 1000 + i;
			request.msg.which_op = zipcache_v1_Request_trim_tag;
			request.msg.op.trim.session_id = id;
			request.msg.op.trim.tokens = 7;
			plan[i].expect_trimmed = model_trim(&model, 7);
		} else {
			struct block block;
			plan[i].tokens = i % 9 == 4 ? 400 : 1 + rng_below(&rng, 10);
			block_make(&block, &model, plan[i].tokens, &rng);
			ck_assert_int_eq(model_update(&model, plan[i].layer, plan[i].tokens, block.keys,
						      block.values), 0);
			request = raw_update_request(1000 + i, id, plan[i].layer, plan[i].tokens, block.keys,
						     block.key_elements * 2, block.values,
						     block.value_elements * 2);
			plan[i].expect_tokens = model.layer[plan[i].layer].tokens;
			model_layer_stats(&model, plan[i].layer, &plan[i].expect_stats);
			ck_assert_int_eq(wire_pb_request_frame_size(&request, &size), 0);
			frames = realloc(frames, frames_len + size);
			ck_assert_ptr_nonnull(frames);
			ck_assert_int_eq(wire_pb_request_encode(&request, frames + frames_len, size, &len), 0);
			frames_len += len;
			block_free(&block);
			continue;
		}
		ck_assert_int_eq(wire_pb_request_frame_size(&request, &size), 0);
		frames = realloc(frames, frames_len + size);
		ck_assert_ptr_nonnull(frames);
		ck_assert_int_eq(wire_pb_request_encode(&request, frames + frames_len, size, &len), 0);
		frames_len += len;
	}

	int fd = raw_connect_checked(&service.daemon);
	ck_assert_int_eq(raw_send(fd, frames, frames_len), 0);
	free(frames);
	for (uint32_t n = 0; n < REQUESTS; n++) {
		wire_pb_response reply;
		char why[WHY_BYTES];
		zc_layer_stats got;
		int rc = raw_read_reply(fd, 20000, &reply, NULL);

		ck_assert_msg(rc == 0, "reply %u of %u: %s", n, REQUESTS, zc_strerror(rc));
		ck_assert_msg(reply.msg.request_id >= 1000 && reply.msg.request_id < 1000 + REQUESTS,
			      "reply to unknown request %" PRIu64, reply.msg.request_id);
		uint32_t i = (uint32_t)(reply.msg.request_id - 1000);
		ck_assert_msg(!answered[i], "request %u answered twice", i);
		answered[i] = true;
		assert_raw_status(&reply, zipcache_v1_Status_OK, 1000 + i, "", "pipelined request");
		if (plan[i].trim) {
			ck_assert_uint_eq(reply.msg.which_op, zipcache_v1_Response_trim_tag);
			ck_assert_uint_eq(reply.msg.op.trim.trimmed, plan[i].expect_trimmed);
		} else {
			/* Replies on one layer come in the order of the requests. */
			ck_assert_msg(reply.msg.request_id > last_id[plan[i].layer],
				      "layer %u: reply %" PRIu64 " after %" PRIu64, plan[i].layer,
				      reply.msg.request_id, last_id[plan[i].layer]);
			last_id[plan[i].layer] = reply.msg.request_id;
			ck_assert_uint_eq(reply.msg.which_op, zipcache_v1_Response_update_and_fetch_tag);
			ck_assert_msg(reply.msg.op.update_and_fetch.tokens == plan[i].expect_tokens,
				      "request %u: layer %u holds %u tokens, expected %u", i, plan[i].layer,
				      reply.msg.op.update_and_fetch.tokens, plan[i].expect_tokens);
			stats_from_reply(&got, &reply.msg.op.update_and_fetch.stats);
			ck_assert_msg(stats_match("pipelined update stats", &got, &plan[i].expect_stats, true,
						  why, sizeof(why)), "request %u: %s", i, why);
		}
		wire_pb_response_free(&reply);
	}
	CHECK(session_matches, session, &model);

	/* Work queued behind a close is answered, not lost: NOT_FOUND. */
	{
		uint16_t keys[2 * 96] = { 0 }, values[2 * 32] = { 0 };
		wire_pb_request update = raw_update_request(2001, id, 0, 1, keys, sizeof(keys), values,
							  sizeof(values));
		wire_pb_request close_request;
		wire_pb_request late = raw_update_request(2003, id, 1, 1, keys, sizeof(keys), values,
						       sizeof(values));
		uint8_t buffer[4096];
		size_t used = 0, len;
		wire_pb_response reply;

		memset(&close_request, 0, sizeof(close_request));
		close_request.msg.request_id = 2002;
		close_request.msg.which_op = zipcache_v1_Request_close_session_tag;
		close_request.msg.op.close_session.session_id = id;
		ck_assert_int_eq(wire_pb_request_encode(&update, buffer, sizeof(buffer), &len), 0);
		used += len;
		ck_assert_int_eq(wire_pb_request_encode(&close_request, buffer + used, sizeof(buffer) - used,
						     &len), 0);
		used += len;
		ck_assert_int_eq(wire_pb_request_encode(&late, buffer + used, sizeof(buffer) - used, &len), 0);
		used += len;
		ck_assert_int_eq(raw_send(fd, buffer, used), 0);
		const zipcache_v1_Status expected[3] = { zipcache_v1_Status_OK, zipcache_v1_Status_OK,
							 zipcache_v1_Status_NOT_FOUND };
		for (int n = 0; n < 3; n++) {
			ck_assert_int_eq(raw_read_reply(fd, 20000, &reply, NULL), 0);
			ck_assert_uint_eq(reply.msg.request_id, 2001 + (uint64_t)n);
			assert_raw_status(&reply, expected[n], 2001 + (uint64_t)n, "session",
					  "update, close, update");
			wire_pb_response_free(&reply);
		}
	}
	close(fd);
	zc_session_release(session);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/*
 * Under a memory budget the daemon drops the fp16 views of idle sessions
 * and rebuilds them from the compressed blocks and the exact residual on
 * the next use: the rebuilt views must be the very bits they were,
 * including a block cut by trim and the residual. Reading a view
 * (zc_session_view) is a use like an update: if the budget is full, the
 * daemon must take memory back from other idle sessions to rebuild.
 */
START_TEST(dropped_views_rebuild_bit_identical)
{
	static const char *const args[] = { "--memory-budget", "24M", NULL };
	struct service service;
	zc_session_config cold_config = shaped_config("cold", 2, 1, 4, 128, 128, 4096,
						       ZC_POLICY_STREAMING, 16);
	zc_session_config hot_config = shaped_config("hot", 1, 1, 4, 128, 128, 8192,
						      ZC_POLICY_STREAMING, 16);
	struct model cold_model, hot_model;
	zc_server_stats stats;
	struct rng rng;
	bool dropped = false;

	service_start(&service, args);
	zc_session *cold = open_session(service.client, &cold_config);
	model_init(&cold_model, &cold_config);
	rng_seed(&rng, 22);
	for (uint32_t layer = 0; layer < 2; layer++) {
		CHECK(update_checked, service.client, cold, &cold_model, &rng, layer, 600);
		CHECK(update_checked, service.client, cold, &cold_model, &rng, layer, 10);
	}
	CHECK(trim_checked, service.client, cold, &cold_model, 15);   /* cuts the 600 block */
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 0, 7);
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 1, 3);
	CHECK(session_matches, cold, &cold_model);
	/* Its client is done with its views for now: its lease ends. */
	ck_assert_int_eq(zc_session_release_views(cold), 0);

	/* Another session grows until the budget makes the daemon take
	 * memory back from the idle one. */
	zc_session *hot = open_session(service.client, &hot_config);
	model_init(&hot_model, &hot_config);
	ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	uint64_t used_before = stats.memory_used_bytes;
	for (int step = 0; step < 30 && !dropped; step++) {
		CHECK(update_checked, service.client, hot, &hot_model, &rng, 0, 256);
		ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
		ck_assert_msg(stats.memory_used_bytes <= 24u << 20,
			      "%" PRIu64 " bytes used over a budget of 24M", stats.memory_used_bytes);
		dropped = stats.memory_used_bytes < used_before;
		used_before = stats.memory_used_bytes;
	}
	ck_assert_msg(dropped, "the daemon never took memory back from the idle session");

	/* Reading the cold session brings its views back as they were (with
	 * the hot one's lease given up, its views may make room). */
	ck_assert_int_eq(zc_session_release_views(hot), 0);
	CHECK(session_matches, cold, &cold_model);
	CHECK(update_checked, service.client, cold, &cold_model, &rng, 0, 20);
	/* And the hot one's, once the cold one's lease is given up in turn. */
	ck_assert_int_eq(zc_session_release_views(cold), 0);
	CHECK(session_matches, hot, &hot_model);
	ck_assert_int_eq(zc_session_close(hot), 0);
	ck_assert_int_eq(zc_session_close(cold), 0);
	model_free(&hot_model);
	model_free(&cold_model);
	service_stop(&service);
}
END_TEST

/* ======================================================================
 * 4. Bad input: the right status, a message, nothing stored, the
 *    connection still usable, and a bystander client unaffected.
 * ====================================================================== */

struct misbehaving {
	struct service service;
	struct bystander bystander;
	zc_session_config config;
	zc_session *session;
	uint64_t session_id;
	struct model model;
	struct rng rng;
};

/* Shape B1 H2 Dk64 Dv32: a token is 256 key and 128 value bytes. */
static void misbehaving_start(struct misbehaving *m, const char *const *extra_args)
{
	service_start(&m->service, extra_args);
	bystander_start(&m->bystander, m->service.daemon.socket_path);
	m->config = shaped_config("target", 2, 1, 2, 64, 32, 1024, ZC_POLICY_STREAMING, 16);
	m->session = open_session(m->service.client, &m->config);
	m->session_id = zc_session_get_info(m->session)->id;
	model_init(&m->model, &m->config);
	rng_seed(&m->rng, 15);
	CHECK(update_checked, m->service.client, m->session, &m->model, &m->rng, 0, 20);
	CHECK(update_checked, m->service.client, m->session, &m->model, &m->rng, 0, 3);
	CHECK(update_checked, m->service.client, m->session, &m->model, &m->rng, 1, 5);
}

/* After a refusal: nothing was stored, and the client's connection still
 * takes a valid update. */
static void assert_nothing_stored_and_usable(struct misbehaving *m)
{
	CHECK(session_matches, m->session, &m->model);
	CHECK(update_checked, m->service.client, m->session, &m->model, &m->rng, 1, 2);
}

static void misbehaving_finish(struct misbehaving *m)
{
	CHECK(session_matches, m->session, &m->model);
	bystander_finish(&m->bystander);
	ck_assert_int_eq(zc_session_close(m->session), 0);
	model_free(&m->model);
	service_stop(&m->service);
}

START_TEST(unknown_session_is_not_found)
{
	struct misbehaving m;
	zc_session_config config = shaped_config("victim", 1, 1, 1, 32, 32, 64,
						  ZC_POLICY_STREAMING, 0);
	struct block block;
	zc_view view;
	uint32_t trimmed;
	int rc;

	misbehaving_start(&m, NULL);
	/* A session closed by another connection under our feet. */
	zc_session *victim = open_session(m.service.client, &config);
	zc_client *other = connect_client(&m.service.daemon);
	config.attach = true;
	zc_session *closer = open_session(other, &config);
	ck_assert_int_eq(zc_session_close(closer), 0);
	block_make(&block, &m.model, 2, &m.rng);
	rc = zc_update_and_fetch(victim, 0, 2, block.keys, block.values, &view, NULL);
	assert_refused(m.service.client, rc, ZC_ENOTFOUND, "session", "update of a closed session");
	rc = zc_session_trim(victim, 1, &trimmed);
	assert_refused(m.service.client, rc, ZC_ENOTFOUND, "session", "trim of a closed session");
	rc = zc_session_stats(victim, NULL, 0, NULL);
	assert_refused(m.service.client, rc, ZC_ENOTFOUND, "session", "stats of a closed session");
	rc = zc_session_close(victim);
	assert_refused(m.service.client, rc, ZC_ENOTFOUND, "session", "close of a closed session");
	block_free(&block);
	assert_nothing_stored_and_usable(&m);

	/* An id nobody ever had. */
	int fd = raw_connect_checked(&m.service.daemon);
	uint16_t keys[2 * 64] = { 0 }, values[2 * 32] = { 0 };
	wire_pb_request request = raw_update_request(7, 987654321, 0, 1, keys, sizeof(keys), values,
						  sizeof(values));
	raw_expect(fd, &request, zipcache_v1_Status_NOT_FOUND, "987654321", "raw update, unknown id");
	raw_hello_works(fd, 8, "after an unknown id");
	close(fd);
	zc_client_close(other);
	assert_nothing_stored_and_usable(&m);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(layer_out_of_range_is_invalid)
{
	struct misbehaving m;
	struct block block;
	zc_view view;
	int rc;

	misbehaving_start(&m, NULL);
	block_make(&block, &m.model, 3, &m.rng);
	rc = zc_update_and_fetch(m.session, 2, 3, block.keys, block.values, &view, NULL);
	assert_refused(m.service.client, rc, ZC_EINVALID, "layer", "layer == layers");
	assert_nothing_stored_and_usable(&m);
	rc = zc_update_and_fetch(m.session, UINT32_MAX, 3, block.keys, block.values, &view, NULL);
	assert_refused(m.service.client, rc, ZC_EINVALID, "layer", "layer UINT32_MAX");
	assert_nothing_stored_and_usable(&m);

	int fd = raw_connect_checked(&m.service.daemon);
	wire_pb_request request = raw_update_request(21, m.session_id, 1000, 3, block.keys,
						  block.key_elements * 2, block.values,
						  block.value_elements * 2);
	raw_expect(fd, &request, zipcache_v1_Status_INVALID_ARGUMENT, "layer", "raw layer 1000");
	raw_hello_works(fd, 22, "after a bad layer");
	close(fd);
	block_free(&block);
	assert_nothing_stored_and_usable(&m);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(byte_lengths_not_matching_the_shape)
{
	struct misbehaving m;
	struct block block;
	uint64_t request_id = 30;

	misbehaving_start(&m, NULL);
	/* Requests say 3 tokens of the session's shape: 1536 key and 768
	 * value bytes. The block is larger, so every wrong length below
	 * still points at bytes we own. */
	block_make(&block, &m.model, 8, &m.rng);
	size_t key_bytes = 3 * 2 * 64 * 2, value_bytes = 3 * 2 * 32 * 2;
	const struct {
		const char *what;
		size_t keys, values;
	} cases[] = {
		{ "head dims swapped (keys sized for Dv, values for Dk)", value_bytes, key_bytes },
		{ "keys for one head too few", key_bytes / 2, value_bytes },
		{ "values two bytes short", key_bytes, value_bytes - 2 },
		{ "keys one byte long", key_bytes + 1, value_bytes },
		{ "keys for one token more", key_bytes + 2 * 64 * 2, value_bytes },
		{ "no values", key_bytes, 0 },
		{ "no bytes at all", 0, 0 },
	};
	int fd = raw_connect_checked(&m.service.daemon);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		wire_pb_request request = raw_update_request(++request_id, m.session_id, 0, 3, block.keys,
							  cases[i].keys, block.values, cases[i].values);
		raw_expect(fd, &request, zipcache_v1_Status_INVALID_ARGUMENT, "do not match",
			   cases[i].what);
		CHECK(session_matches, m.session, &m.model);
		/* The same raw connection takes a valid update afterwards. */
		raw_update_checked(fd, ++request_id, m.session_id, &m.model, &m.rng, 0, 1);
		assert_nothing_stored_and_usable(&m);
	}
	close(fd);
	block_free(&block);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(zero_tokens_is_invalid)
{
	struct misbehaving m;
	uint16_t keys[1] = { 0 }, values[1] = { 0 };
	zc_view view;
	int rc;

	misbehaving_start(&m, NULL);
	rc = zc_update_and_fetch(m.session, 0, 0, keys, values, &view, NULL);
	assert_refused(m.service.client, rc, ZC_EINVALID, "token", "zero tokens");
	assert_nothing_stored_and_usable(&m);

	/* Zero tokens with bytes attached is no better. */
	int fd = raw_connect_checked(&m.service.daemon);
	wire_pb_request request = raw_update_request(41, m.session_id, 0, 0, keys, sizeof(keys), values,
						  sizeof(values));
	raw_expect(fd, &request, zipcache_v1_Status_INVALID_ARGUMENT, "token", "raw zero tokens");
	raw_hello_works(fd, 42, "after zero tokens");
	close(fd);
	assert_nothing_stored_and_usable(&m);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(non_finite_input_is_refused)
{
	/* Residual path (short block), direct path (long block), staged path
	 * (over the inline limit), NaN and Inf in either tensor. */
	static const struct {
		const char *what;
		uint32_t tokens;
		bool in_keys;
		uint16_t bits;
		const char *needle;
	} cases[] = {
		{ "NaN in keys of a short block", 3, true, FP16_NAN, "keys" },
		{ "+Inf in values of a short block", 3, false, FP16_POSITIVE_INFINITY, "values" },
		{ "Inf in values of a long block", 20, false, FP16_POSITIVE_INFINITY, "values" },
		{ "-Inf in keys of a long block", 40, true, FP16_NEGATIVE_INFINITY, "keys" },
		{ "signalling NaN in values of a staged block", 700, false, 0x7c01, "values" },
		{ "negative NaN in keys of a staged block", 700, true, 0xfe00, "keys" },
	};
	struct misbehaving m;
	zc_view view;

	misbehaving_start(&m, NULL);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct block block;
		int rc;

		block_make(&block, &m.model, cases[i].tokens, &m.rng);
		/* One bad element, somewhere in the middle. */
		if (cases[i].in_keys)
			block.keys[block.key_elements / 2 + 1] = cases[i].bits;
		else
			block.values[block.value_elements / 3] = cases[i].bits;
		rc = zc_update_and_fetch(m.session, (uint32_t)i % 2, cases[i].tokens, block.keys,
					 block.values, &view, NULL);
		assert_refused(m.service.client, rc, ZC_EINVALID, cases[i].needle, cases[i].what);
		ck_assert_msg(strstr(zc_client_last_error(m.service.client), "NaN") != NULL,
			      "%s: message '%s' does not name NaN/Inf", cases[i].what,
			      zc_client_last_error(m.service.client));
		block_free(&block);
		assert_nothing_stored_and_usable(&m);
	}
	misbehaving_finish(&m);
}
END_TEST

START_TEST(staging_offsets_out_of_range)
{
	struct misbehaving m;
	struct block block;
	void *buffer = NULL;
	const size_t staging_bytes = 64 * 1024;
	zc_view view;
	zc_layer_stats stats, want;
	char why[WHY_BYTES];
	int rc;

	misbehaving_start(&m, NULL);
	/* 5 tokens: 2560 key bytes, 1280 value bytes. */
	block_make(&block, &m.model, 5, &m.rng);
	const size_t key_bytes = block.key_elements * 2, value_bytes = block.value_elements * 2;
	ck_assert_int_eq(zc_client_staging(m.service.client, staging_bytes, &buffer), 0);
	memcpy(buffer, block.keys, key_bytes);
	memcpy((uint8_t *)buffer + 8192, block.values, value_bytes);
	const struct {
		const char *what;
		size_t keys_offset, values_offset;
	} cases[] = {
		{ "keys start at the end", staging_bytes, 8192 },
		{ "keys run past the end", staging_bytes - key_bytes + 2, 8192 },
		{ "values run past the end", 0, staging_bytes - value_bytes + 2 },
		{ "values offset huge", 0, SIZE_MAX - 1 },
		{ "keys offset huge", SIZE_MAX - 1, 8192 },
		{ "odd keys offset", 1, 8192 },
		{ "odd values offset", 0, 8193 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		rc = zc_update_and_fetch_staged(m.session, 0, 5, cases[i].keys_offset,
						cases[i].values_offset, &view, NULL);
		assert_refused(m.service.client, rc, ZC_EINVALID, "staging", cases[i].what);
		assert_nothing_stored_and_usable(&m);
	}
	/* The same buffer, named correctly, works. */
	ck_assert_int_eq(model_update(&m.model, 0, 5, block.keys, block.values), 0);
	rc = zc_update_and_fetch_staged(m.session, 0, 5, 0, 8192, &view, &stats);
	ck_assert_msg(rc == 0, "valid staged update: %s '%s'", zc_strerror(rc),
		      zc_client_last_error(m.service.client));
	ck_assert_msg(view_matches(&m.model, 0, &view, why, sizeof(why)), "%s", why);
	model_layer_stats(&m.model, 0, &want);
	ck_assert_msg(stats_match("staged update stats", &stats, &want, true, why, sizeof(why)),
		      "%s", why);
	block_free(&block);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(staged_update_without_a_buffer)
{
	struct misbehaving m;
	zc_view view;
	int rc;

	misbehaving_start(&m, NULL);
	/* A fresh connection has no staging buffer to name. */
	zc_client *other = connect_client(&m.service.daemon);
	zc_session_config config = m.config;
	config.attach = true;
	zc_session *session = open_session(other, &config);
	rc = zc_update_and_fetch_staged(session, 0, 5, 0, 4096, &view, NULL);
	assert_refused(other, rc, ZC_EPRECONDITION, "staging", "staged without a buffer");
	assert_nothing_stored_and_usable(&m);
	CHECK(update_checked, other, session, &m.model, &m.rng, 0, 2);

	int fd = raw_connect_checked(&m.service.daemon);
	wire_pb_request request = raw_update_request(51, m.session_id, 0, 5, NULL, 0, NULL, 0);
	request.msg.op.update_and_fetch.staged = true;
	request.msg.op.update_and_fetch.values_offset = 4096;
	raw_expect(fd, &request, zipcache_v1_Status_FAILED_PRECONDITION, "staging",
		   "raw staged without a buffer");
	/* With a buffer, a staged request must not carry inline bytes too. */
	wire_pb_request staging;
	memset(&staging, 0, sizeof(staging));
	staging.msg.request_id = 52;
	staging.msg.which_op = zipcache_v1_Request_staging_tag;
	staging.msg.op.staging.bytes = 65536;
	raw_expect(fd, &staging, zipcache_v1_Status_OK, "", "raw staging request");
	uint16_t keys[5 * 2 * 64] = { 0 }, values[5 * 2 * 32] = { 0 };
	request = raw_update_request(53, m.session_id, 0, 5, keys, sizeof(keys), values, sizeof(values));
	request.msg.op.update_and_fetch.staged = true;
	request.msg.op.update_and_fetch.values_offset = 4096;
	raw_expect(fd, &request, zipcache_v1_Status_INVALID_ARGUMENT, "inline",
		   "staged with inline bytes");
	raw_hello_works(fd, 54, "after staged requests");
	close(fd);
	zc_session_release(session);
	zc_client_close(other);
	assert_nothing_stored_and_usable(&m);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(malformed_protobuf_keeps_the_connection)
{
	struct misbehaving m;
	wire_pb_response reply;
	uint64_t request_id = 60;

	misbehaving_start(&m, NULL);
	int fd = raw_connect_checked(&m.service.daemon);

	/* Bytes that are no protobuf at all: a varint that never ends. */
	static const uint8_t garbage[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
					   0xff, 0xff, 0xff, 0xff, 0x0a, 0x03, 'z', 'c' };
	/* Field number 0 (tag byte 0x00) is never valid. */
	static const uint8_t zero_tag[] = { 0x00, 0x01, 0x02 };
	/* update_and_fetch { session_id 1, tokens 1, keys as a varint }: keys
	 * must be length-delimited. Request.update_and_fetch is field 4. */
	static const uint8_t keys_as_varint[] = { 0x08, 0x05, 0x22, 0x06, 0x08, 0x01,
						  0x18, 0x01, 0x20, 0x07 };
	/* A length-delimited field that claims more bytes than the frame has. */
	static const uint8_t overlong_field[] = { 0x08, 0x09, 0x22, 0x7f, 0x08, 0x01 };
	/* The reply carries the request id whenever one could be read (the
	 * last two start with request_id 5 and 9), else 0. */
	const struct {
		const char *what;
		const uint8_t *bytes;
		size_t len;
		const char *needle;
		uint64_t request_id;
	} cases[] = {
		{ "garbage bytes", garbage, sizeof(garbage), "malformed", 0 },
		{ "field number 0", zero_tag, sizeof(zero_tag), "malformed", 0 },
		{ "inline keys as a varint", keys_as_varint, sizeof(keys_as_varint), "malformed", 5 },
		{ "a field longer than the frame", overlong_field, sizeof(overlong_field), "malformed", 9 },
		{ "an empty frame", NULL, 0, "operation", 0 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		raw_frame_call(fd, cases[i].bytes, cases[i].len, &reply, cases[i].what);
		assert_raw_status(&reply, zipcache_v1_Status_INVALID_ARGUMENT, cases[i].request_id,
				  cases[i].needle, cases[i].what);
		wire_pb_response_free(&reply);
		raw_hello_works(fd, ++request_id, cases[i].what);
		assert_nothing_stored_and_usable(&m);
	}
	/* A valid update on the same connection after all that. */
	raw_update_checked(fd, ++request_id, m.session_id, &m.model, &m.rng, 0, 2);
	close(fd);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(oversized_frame_closes_only_that_connection)
{
	static const char *const args[] = { "--max-frame-bytes", "65536", "--max-inline-bytes",
					    "32768", NULL };
	struct misbehaving m;
	wire_pb_response reply;
	uint8_t header[FRAME_HEADER_BYTES];
	uint8_t *body;
	int fd, rc;

	misbehaving_start(&m, args);
	ck_assert_uint_eq(zc_client_server_info(m.service.client)->max_frame_bytes, 65536);

	/* A header announcing one byte more than the limit, then some of the
	 * body: an error reply, then the daemon hangs up. */
	const uint32_t announced[] = { 65537, UINT32_MAX };
	for (size_t i = 0; i < 2; i++) {
		uint8_t some_body[64] = { 0 };
		fd = raw_connect_checked(&m.service.daemon);
		frame_header_write(header, announced[i]);
		ck_assert_int_eq(raw_send(fd, header, sizeof(header)), 0);
		/* The daemon may already have answered and hung up: a refused
		 * body is part of what is being tested, not a failure. */
		rc = raw_send(fd, some_body, sizeof(some_body));
		ck_assert_msg(rc == 0 || rc == -EPIPE || rc == -ECONNRESET, "body send: %d", rc);
		rc = raw_read_reply(fd, 10000, &reply, NULL);
		ck_assert_msg(rc == 0, "frame of %u bytes: no error reply: %s (%d)", announced[i],
			      zc_strerror(rc), rc);
		assert_raw_status(&reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, 0, "limit",
				  "oversized frame");
		wire_pb_response_free(&reply);
		ck_assert_msg(raw_wait_closed(fd, 10000),
			      "the daemon kept a connection open after an oversized frame");
		close(fd);
		assert_nothing_stored_and_usable(&m);
	}

	/* Exactly the limit is a frame like any other (zeros: malformed). */
	fd = raw_connect_checked(&m.service.daemon);
	body = calloc(1, 65536);
	ck_assert_ptr_nonnull(body);
	raw_frame_call(fd, body, 65536, &reply, "frame of exactly the limit");
	assert_raw_status(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 0, "malformed",
			  "frame of exactly the limit");
	wire_pb_response_free(&reply);
	free(body);
	raw_hello_works(fd, 71, "after a frame at the limit");
	close(fd);

	/* Other connections never noticed; new ones are welcome. */
	fd = raw_connect_checked(&m.service.daemon);
	raw_hello_works(fd, 72, "a new connection");
	close(fd);
	for (uint32_t step = 0; step < 4; step++)
		CHECK(update_checked, m.service.client, m.session, &m.model, &m.rng, step % 2, 200);
	misbehaving_finish(&m);
}
END_TEST

/*
 * --max-inline-bytes is "the largest inline K+V payload" and hello
 * announces it, so the daemon must hold clients to it: a larger inline
 * payload (still well inside the frame limit) is refused and not stored.
 */
START_TEST(inline_payload_over_the_limit_is_refused)
{
	static const char *const args[] = { "--max-inline-bytes", "8192", NULL };
	struct misbehaving m;
	struct block block;
	wire_pb_response reply;

	misbehaving_start(&m, args);
	ck_assert_uint_eq(zc_client_server_info(m.service.client)->max_inline_bytes, 8192);
	/* 30 tokens: 7680 + 3840 = 11520 bytes inline. */
	block_make(&block, &m.model, 30, &m.rng);
	int fd = raw_connect_checked(&m.service.daemon);
	wire_pb_request request = raw_update_request(81, m.session_id, 0, 30, block.keys,
						  block.key_elements * 2, block.values,
						  block.value_elements * 2);
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	ck_assert_msg(reply.msg.status == zipcache_v1_Status_RESOURCE_EXHAUSTED ||
			      reply.msg.status == zipcache_v1_Status_INVALID_ARGUMENT,
		      "11520 inline bytes with --max-inline-bytes 8192: status %s (message '%s'), "
		      "expected RESOURCE_EXHAUSTED or INVALID_ARGUMENT",
		      response_status_name(reply.msg.status), reply.msg.message);
	ck_assert_msg(strcasestr(reply.msg.message, "inline") != NULL,
		      "message '%s' does not mention the inline limit", reply.msg.message);
	wire_pb_response_free(&reply);
	raw_hello_works(fd, 82, "after an oversized inline payload");
	close(fd);
	block_free(&block);
	assert_nothing_stored_and_usable(&m);
	/* The client stages such blocks itself. */
	CHECK(update_checked, m.service.client, m.session, &m.model, &m.rng, 0, 30);
	misbehaving_finish(&m);
}
END_TEST

START_TEST(open_session_with_bad_config)
{
	static const char *const args[] = { "--max-tokens", "4096", NULL };
	struct misbehaving m;
	zc_session *session = NULL;
	size_t before = 0, after = 0;
	char long_name[80];
	int files, rc;

	misbehaving_start(&m, args);
	ck_assert_int_eq(zc_client_list_sessions(m.service.client, NULL, 0, &before), 0);
	files = session_files(&m.service.daemon);
	memset(long_name, 'n', 65);
	long_name[65] = '\0';
	for (int i = 0; i < 11; i++) {
		zc_session_config config = shaped_config("bad", 2, 1, 2, 32, 32, 256,
							  ZC_POLICY_STREAMING, 0);
		int expected = ZC_EINVALID;
		const char *what = "";
		switch (i) {
		case 0: config.codec.hi_bits = 9; what = "hi_bits 9"; break;
		case 1: config.codec.lo_bits = 0; what = "lo_bits 0"; break;
		case 2: config.codec.hi_fraction = 1.5; what = "hi_fraction 1.5"; break;
		case 3: config.codec.hi_fraction = NAN; what = "hi_fraction NaN"; break;
		case 4: config.codec.group_size = 0; what = "group_size 0"; break;
		case 5: config.layers = 0; what = "no layers"; break;
		case 6: config.kv_heads = 0; what = "no heads"; break;
		case 7: config.max_tokens = 0; what = "max_tokens 0"; break;
		case 8: config.max_tokens = 4097; expected = ZC_EEXHAUSTED; what = "max_tokens over the daemon's limit"; break;
		case 9: config.residual_tokens = 70000; what = "residual_tokens 70000"; break;
		case 10: config.name = long_name; what = "a 65-byte name"; break;
		}
		rc = zc_session_open(m.service.client, &config, &session);
		ck_assert_msg(rc == expected, "open with %s: got %s (%d) '%s', expected %s", what,
			      zc_error_name(rc), rc, zc_client_last_error(m.service.client),
			      zc_error_name(expected));
		ck_assert_msg(zc_client_last_error(m.service.client)[0] != '\0',
			      "open with %s refused without a message", what);
	}
	/* Nothing was created. */
	ck_assert_int_eq(zc_client_list_sessions(m.service.client, NULL, 0, &after), 0);
	ck_assert_uint_eq(after, before);
	ck_assert_int_eq(session_files(&m.service.daemon), files);
	assert_nothing_stored_and_usable(&m);
	misbehaving_finish(&m);
}
END_TEST

/* ======================================================================
 * 5. Zero copy: K/V never travel back through the socket, and the view
 *    a client reads cannot be written.
 * ====================================================================== */

START_TEST(reply_size_does_not_grow_with_the_sequence)
{
	struct service service;
	zc_session_config config = shaped_config("zero-copy", 1, 1, 2, 64, 64, 9000,
						  ZC_POLICY_PER_CALL, 0);
	struct model model;
	struct rng rng;
	size_t short_reply, long_reply;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	uint64_t id = zc_session_get_info(session)->id;
	model_init(&model, &config);
	rng_seed(&rng, 16);
	int fd = raw_connect_checked(&service.daemon);

	CHECK(update_checked, service.client, session, &model, &rng, 0, 1023);
	short_reply = raw_update_checked(fd, 1, id, &model, &rng, 0, 1);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 7167);
	long_reply = raw_update_checked(fd, 2, id, &model, &rng, 0, 1);
	ck_assert_uint_eq(model.layer[0].tokens, 8192);

	/* 1k and 8k tokens of context: the reply differs only by the few
	 * varint bytes the larger counters take. */
	uint64_t context_bytes = 2ull * 2 * 8192 * 64 * 2; /* keys + values */
	ck_assert_msg(long_reply >= short_reply && long_reply - short_reply <= 8,
		      "reply frame grew from %zu bytes at 1k tokens to %zu at 8k", short_reply,
		      long_reply);
	ck_assert_msg(long_reply <= 160, "an update reply of %zu bytes carries more than counters",
		      long_reply);
	ck_assert_msg(long_reply * 10000 < context_bytes, "reply %zu bytes vs %" PRIu64 " of K/V",
		      long_reply, context_bytes);
	/* And the client sees all 8192 tokens through its mapping. */
	CHECK(session_matches, session, &model);
	close(fd);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* Runs in a child: a write through the view must kill it with SIGSEGV. */
static int write_through_view(void *arg)
{
	volatile uint16_t *target = arg;
	struct rlimit no_core = { 0, 0 };
	struct sigaction default_action;

	/* Not a crash worth a core file; and whatever handler a sanitizer
	 * installed, the kernel's verdict is what we want to see. */
	setrlimit(RLIMIT_CORE, &no_core);
	memset(&default_action, 0, sizeof(default_action));
	default_action.sa_handler = SIG_DFL;
	sigaction(SIGSEGV, &default_action, NULL);
	sigaction(SIGBUS, &default_action, NULL);
	*target = 0x3c00;
	return 0;
}

START_TEST(view_is_read_only)
{
	struct service service;
	zc_session_config config = shaped_config("read-only", 1, 1, 2, 64, 32, 256,
						  ZC_POLICY_STREAMING, 0);
	struct model model;
	struct rng rng;
	zc_view view;
	long page = sysconf(_SC_PAGESIZE);

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 17);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 150);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 3);
	ck_assert_int_eq(zc_session_view(session, 0, &view), 0);

	const uint16_t *targets[] = { view.keys, view.values + 5 };
	for (int i = 0; i < 2; i++) {
		int status = 0;
		pid_t pid = child_spawn(write_through_view, (void *)targets[i], -1);
		ck_assert_int_eq(waitpid(pid, &status, 0), pid);
		ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV,
			      "a write through the %s view should die of SIGSEGV, got %s %d",
			      i ? "value" : "key", WIFSIGNALED(status) ? "signal" : "exit status",
			      WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));

		/* The descriptor was read-only: the pages can never be made writable. */
		void *aligned = (void *)((uintptr_t)targets[i] & ~(uintptr_t)(page - 1));
		errno = 0;
		int rc = mprotect(aligned, (size_t)page, PROT_READ | PROT_WRITE);
		ck_assert_msg(rc == -1 && errno == EACCES,
			      "mprotect(PROT_WRITE) on the view returned %d (%s), expected EACCES", rc,
			      strerror(errno));
	}
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ======================================================================
 * 6. The daemon's life: start, stop, crash, restart, flags.
 * ====================================================================== */

START_TEST(sigterm_exits_zero_and_removes_the_socket)
{
	struct service service;
	zc_session_config config = shaped_config("until-stop", 1, 1, 1, 32, 32, 64,
						  ZC_POLICY_STREAMING, 0);
	struct model model;
	struct rng rng;
	int rc;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 18);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 10);
	/* An idle raw connection and a client with a session stay open
	 * across the stop: neither may hold the daemon up. */
	int fd = raw_connect_checked(&service.daemon);
	daemon_stop(&service.daemon);
	ck_assert(raw_wait_closed(fd, 5000));
	close(fd);
	rc = zc_session_stats(session, NULL, 0, NULL);
	ck_assert_msg(rc == -EPIPE || rc == -ECONNRESET || rc == ZC_EPROTOCOL,
		      "a call after the daemon stopped returned %s (%d)", zc_error_name(rc), rc);
	zc_client_close(service.client);
	model_free(&model);
	daemon_cleanup(&service.daemon);
}
END_TEST

/* After a crash (SIGKILL) and after a clean stop, a restarted daemon
 * adopts the sessions with every acknowledged token. */
START_TEST(restart_replaces_stale_socket_and_adopts_sessions)
{
	struct service service;
	zc_session_config config = shaped_config("survivor", 2, 1, 2, 32, 48, 1024,
						  ZC_POLICY_STREAMING, 16);
	struct model model;
	struct rng rng;
	struct stat st;
	uint64_t id;
	int rc;

	service_start(&service, NULL);
	zc_session *session = open_session(service.client, &config);
	id = zc_session_get_info(session)->id;
	model_init(&model, &config);
	rng_seed(&rng, 19);
	for (uint32_t step = 0; step < 14; step++)
		CHECK(update_checked, service.client, session, &model, &rng, step % 2, 1 + step * 7 % 30);
	/* Past the residual into a block: the adopted store holds a block
	 * with fewer valid tokens than it was compressed with. */
	CHECK(trim_checked, service.client, session, &model, 11);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 3);

	for (int round = 0; round < 2; round++) {
		if (round == 0) {
			daemon_kill(&service.daemon);
			ck_assert_msg(lstat(service.daemon.socket_path, &st) == 0 && S_ISSOCK(st.st_mode),
				      "a killed daemon should leave its socket file behind");
		} else {
			daemon_stop(&service.daemon);
		}
		daemon_restart(&service.daemon);

		/* The old connection is dead; reconnecting finds a new daemon. */
		rc = zc_session_stats(session, NULL, 0, NULL);
		ck_assert_msg(rc == -EPIPE || rc == -ECONNRESET || rc == ZC_EPROTOCOL,
			      "round %d: a call on the dead connection returned %s (%d)", round,
			      zc_error_name(rc), rc);
		rc = zc_client_reconnect(service.client);
		ck_assert_msg(rc == ZC_ERESTARTED, "round %d: reconnect returned %s (%d)", round,
			      zc_error_name(rc), rc);
		zc_session_release(session);
		config.attach = true;
		session = open_session(service.client, &config);
		ck_assert_uint_eq(zc_session_get_info(session)->id, id);
		CHECK(session_matches, session, &model);
		for (uint32_t step = 0; step < 10; step++)
			CHECK(update_checked, service.client, session, &model, &rng, step % 2,
			      1 + step * 5 % 24);
		CHECK(trim_checked, service.client, session, &model, 20);
	}
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(idle_sessions_expire)
{
	static const char *const args[] = { "--idle-ttl", "1", NULL };
	struct service service;
	zc_session_config busy_config = shaped_config("busy", 1, 1, 1, 32, 32, 4096,
						       ZC_POLICY_STREAMING, 0);
	zc_session_config idle_config = shaped_config("idle", 1, 1, 1, 32, 32, 64,
						       ZC_POLICY_STREAMING, 0);
	zc_session_info infos[4];
	struct model model;
	struct rng rng;
	size_t count = 0;
	bool idle_gone = false;

	service_start(&service, args);
	zc_session *busy = open_session(service.client, &busy_config);
	zc_session *idle = open_session(service.client, &idle_config);
	zc_session_release(idle);
	ck_assert_int_eq(session_files(&service.daemon), 2);
	model_init(&model, &busy_config);
	rng_seed(&rng, 20);

	/* 2.5 s of a session in use every 50 ms beside one left alone. */
	int64_t deadline = now_ms() + 2500;
	while (now_ms() < deadline) {
		CHECK(update_checked, service.client, busy, &model, &rng, 0, 1);
		struct timespec pause = { 0, 50 * 1000000L };
		nanosleep(&pause, NULL);
	}
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	for (size_t i = 0; i < count && i < 4; i++)
		ck_assert_msg(strcmp(infos[i].name, "idle") != 0,
			      "session 'idle' still listed after 2.5 s with --idle-ttl 1");
	idle_gone = count == 1 && strcmp(infos[0].name, "busy") == 0;
	ck_assert_msg(idle_gone, "expected only 'busy' listed, got %zu sessions", count);
	ck_assert_int_eq(session_files(&service.daemon), 1);
	CHECK(session_matches, busy, &model);
	ck_assert_int_eq(zc_session_close(busy), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* The loop thread's time on a CPU so far, ns (the first field of its
 * schedstat; zipcached runs its loop on the main thread). */
static uint64_t loop_cpu_ns(pid_t pid)
{
	char path[64];
	unsigned long long ns = 0;
	snprintf(path, sizeof(path), "/proc/%d/task/%d/schedstat", (int)pid, (int)pid);
	FILE *f = fopen(path, "r");
	ck_assert_msg(f != NULL, "cannot open %s", path);
	ck_assert_int_eq(fscanf(f, "%llu", &ns), 1);
	fclose(f);
	return ns;
}

/* How long the loop thread was on a CPU in the next `ms` milliseconds. */
static uint64_t loop_cpu_ms_over(pid_t pid, unsigned ms)
{
	uint64_t before = loop_cpu_ns(pid);
	usleep(ms * 1000u);
	return (loop_cpu_ns(pid) - before) / 1000000u;
}

START_TEST(busy_poll_spins_after_requests_then_sleeps)
{
	/* The largest bound, so that the spin is visible in CPU time. */
	static const char *const args[] = { "--busy-poll-us", "100000", NULL };
	struct service service;
	zc_session_config config = streaming_config("busy", 2, 2, 64, 1024, 16);
	struct model model;
	struct rng rng;
	zc_server_stats stats;

	service_start(&service, args);
	pid_t pid = service.daemon.pid;
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 41);
	/* A decode loop is served as without the flag, flushes included. */
	for (uint32_t step = 0; step < 60; step++)
		for (uint32_t layer = 0; layer < 2; layer++)
			CHECK(update_checked, service.client, session, &model, &rng, layer, 1);
	CHECK(session_matches, session, &model);

	/* Past the bound after the last request, the loop sleeps. */
	usleep(200000);
	uint64_t idle = loop_cpu_ms_over(pid, 500);
	ck_assert_msg(idle < 50, "an idle daemon's loop used %" PRIu64 " ms of CPU in 500 ms",
		      idle);
	/* One request: the loop polls without sleeping for about 100 ms. */
	ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	uint64_t spun = loop_cpu_ms_over(pid, 400);
	ck_assert_msg(spun >= 30 && spun < 250,
		      "after one request the loop used %" PRIu64 " ms of CPU in 400 ms "
		      "(--busy-poll-us 100000: about 100)", spun);
	/* And then sleeps again. */
	idle = loop_cpu_ms_over(pid, 500);
	ck_assert_msg(idle < 50, "after its spin the loop used %" PRIu64 " ms of CPU in 500 ms",
		      idle);

	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* --ring-poll-us: requests taken from a request ring keep the loop
 * polling for the bound, requests on the socket do not. */
START_TEST(ring_poll_spins_after_ring_requests_then_sleeps)
{
	static const char *const args[] = { "--ring-poll-us", "100000", NULL };
	struct service service;
	zc_session_config config = streaming_config("ring-poll", 2, 2, 64, 1024, 16);
	struct model model;
	struct rng rng;
	zc_server_stats stats;
	size_t ring_bytes = 0;
	uint64_t doorbells = 0;

	service_start(&service, args);
	pid_t pid = service.daemon.pid;
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 43);

	/* Requests on the socket: the loop sleeps after them. */
	usleep(200000);
	for (int i = 0; i < 20; i++)
		ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	uint64_t idle = loop_cpu_ms_over(pid, 400);
	ck_assert_msg(idle < 50, "after socket requests the loop used %" PRIu64
		      " ms of CPU in 400 ms (--ring-poll-us spins for ring requests only)", idle);

	/* One update through the ring: the loop polls for about 100 ms. */
	ck_assert_int_eq(zc_client_set_async_ring(service.client, 64u << 10), 0);
	ck_assert_int_eq(zc_client_async_ring(service.client, &ring_bytes, &doorbells), 0);
	ck_assert_uint_eq(ring_bytes, 64u << 10);
	CHECK(update_checked, service.client, session, &model, &rng, 0, 1);
	uint64_t spun = loop_cpu_ms_over(pid, 400);
	ck_assert_msg(spun >= 30 && spun < 250,
		      "after one ring request the loop used %" PRIu64 " ms of CPU in 400 ms "
		      "(--ring-poll-us 100000: about 100)", spun);
	idle = loop_cpu_ms_over(pid, 500);
	ck_assert_msg(idle < 50, "after its spin the loop used %" PRIu64 " ms of CPU in 500 ms",
		      idle);

	/* A decode loop through the ring is served as without the flag, and
	 * while the loop polls, the client rings no doorbell: at most the
	 * first update of the loop (the loop was asleep) and none after. */
	ck_assert_int_eq(zc_client_async_ring(service.client, &ring_bytes, &doorbells), 0);
	uint64_t before = doorbells;
	for (uint32_t step = 0; step < 60; step++)
		for (uint32_t layer = 0; layer < 2; layer++)
			CHECK(update_checked, service.client, session, &model, &rng, layer, 1);
	CHECK(session_matches, session, &model);
	ck_assert_int_eq(zc_client_async_ring(service.client, &ring_bytes, &doorbells), 0);
	ck_assert_msg(doorbells - before <= 1,
		      "%" PRIu64 " doorbells for 120 updates to a polling daemon", doorbells - before);

	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(no_busy_poll_by_default)
{
	struct service service;
	zc_server_stats stats;

	service_start(&service, NULL);
	usleep(100000);
	for (int i = 0; i < 20; i++)
		ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	uint64_t after = loop_cpu_ms_over(service.daemon.pid, 400);
	ck_assert_msg(after < 50, "without --busy-poll-us the loop used %" PRIu64
		      " ms of CPU in the 400 ms after its requests", after);
	service_stop(&service);
}
END_TEST

START_TEST(help_lists_the_flags)
{
	static const char *const flags[] = {
		"--socket", "--socket-mode", "--shm-dir", "--max-frame-bytes", "--max-inline-bytes",
		"--max-connections", "--max-sessions", "--max-tokens", "--max-staging-bytes",
		"--memory-budget", "--idle-ttl", "--log-level", "--help", "--version",
	};
	const char *argv[] = { daemon_binary_path(), "--help", NULL };
	char out[8192], err[1024];
	int status = 0;

	ck_assert_int_eq(program_run(argv, &status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "--help should exit 0, status 0x%x; stderr: %s", status, err);
	for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
		ck_assert_msg(strstr(out, flags[i]) != NULL, "--help does not mention %s:\n%s",
			      flags[i], out);
	ck_assert_msg(err[0] == '\0', "--help wrote to stderr: %s", err);
}
END_TEST

START_TEST(bad_flags_exit_2)
{
	static const char *const cases[][3] = {
		{ "--no-such-flag", NULL, "--no-such-flag" },
		{ "--max-frame-bytes", "banana", "max-frame-bytes" },
		{ "--max-frame-bytes", "100", "max-frame-bytes" },
		{ "--log-level", "loud", "log-level" },
		{ "--max-tokens", "0", "max-tokens" },
		{ "--socket-mode", "999", "socket-mode" },
		{ "--codec-threads", "17", "codec-threads" },
		{ "--codec-threads", "some", "codec-threads" },
		{ "--busy-poll-us", "100001", "busy-poll-us" },
		{ "--busy-poll-us", "-1", "busy-poll-us" },
		{ "--busy-poll-us", "soon", "busy-poll-us" },
		{ "--ring-poll-us", "100001", "ring-poll-us" },
		{ "--ring-poll-us", "often", "ring-poll-us" },
		{ "--pool-writes", "mmap", "pool-writes" },
		{ "--pool-writes", "", "pool-writes" },
		{ "stray-argument", NULL, "stray-argument" },
	};
	char dir[] = "/tmp/zc_service_flags.XXXXXX", socket_path[64], shm_dir[64];

	/* Paths of its own, so a flag that wrongly passed could not touch a
	 * real daemon's socket or sessions; the directory must stay empty. */
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(socket_path, sizeof(socket_path), "%s/z.sock", dir);
	snprintf(shm_dir, sizeof(shm_dir), "%s/shm", dir);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const char *argv[] = { daemon_binary_path(), "--socket", socket_path, "--shm-dir",
				       shm_dir, cases[i][0], cases[i][1], NULL };
		char out[1024], err[1024];
		int status = 0;

		ck_assert_int_eq(program_run(argv, &status, out, sizeof(out), err, sizeof(err)), 0);
		ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 2,
			      "zipcached %s %s should exit 2, got status 0x%x", cases[i][0],
			      cases[i][1] ? cases[i][1] : "", status);
		ck_assert_msg(strstr(err, cases[i][2]) != NULL,
			      "zipcached %s %s: stderr does not name '%s': %s", cases[i][0],
			      cases[i][1] ? cases[i][1] : "", cases[i][2], err);
	}
	ck_assert_msg(rmdir(dir) == 0, "a daemon with bad flags left files in %s", dir);
}
END_TEST

START_TEST(second_daemon_on_a_live_socket_is_refused)
{
	struct service service;
	char other_shm[PATH_MAX + 16], out[1024], err[2048];
	int status = 0;

	service_start(&service, NULL);
	snprintf(other_shm, sizeof(other_shm), "%s/other-shm", service.daemon.dir);
	const char *argv[] = { daemon_binary_path(), "--socket", service.daemon.socket_path,
			       "--shm-dir", other_shm, "--log-level", "warn", NULL };
	ck_assert_int_eq(program_run(argv, &status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) != 0,
		      "a second daemon on a live socket should fail, status 0x%x", status);
	/* And the same shared-memory directory is locked by the first. */
	const char *same_dir[] = { daemon_binary_path(), "--socket", "/tmp/zc-unused-never.sock",
				   "--shm-dir", service.daemon.shm_dir, "--log-level", "warn", NULL };
	ck_assert_int_eq(program_run(same_dir, &status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) != 0,
		      "a second daemon on a claimed --shm-dir should fail, status 0x%x", status);
	/* The first one never noticed. */
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_stats(service.client, &stats), 0);
	zc_client *another = connect_client(&service.daemon);
	zc_client_close(another);
	service_stop(&service);
}
END_TEST

static Suite *service_suite(void)
{
	Suite *suite = suite_create("service");
	const struct test_case cases[] = {
		{ "correctness", { per_call_prefill_then_decode, streaming_prefill_then_300_decode_steps,
				   streaming_mixed_block_sizes, batch_two_and_distinct_head_dims,
				   values_exact_when_not_quantized, custom_codec_configs,
				   large_blocks_through_staging, large_blocks_spread_over_codec_threads,
				   decode_accounting_per_call_inflates_streaming_compresses,
				   dropped_views_rebuild_bit_identical, NULL } },
		{ "trim", { trim_then_update_streaming, trim_accounting_per_call,
			    trim_more_than_held_clamps, views_reach_max_tokens_then_refuse, NULL } },
		{ "concurrency", { parallel_clients_on_separate_sessions,
				   two_connections_alternate_on_one_session,
				   two_processes_race_on_one_session, session_survives_disconnect,
				   pipelined_requests_apply_in_order, NULL } },
		{ "bad_input", { unknown_session_is_not_found, layer_out_of_range_is_invalid,
				 byte_lengths_not_matching_the_shape, zero_tokens_is_invalid,
				 non_finite_input_is_refused, staging_offsets_out_of_range,
				 staged_update_without_a_buffer, malformed_protobuf_keeps_the_connection,
				 oversized_frame_closes_only_that_connection,
				 inline_payload_over_the_limit_is_refused, open_session_with_bad_config,
				 NULL } },
		{ "zero_copy", { reply_size_does_not_grow_with_the_sequence, view_is_read_only, NULL } },
		{ "lifecycle", { sigterm_exits_zero_and_removes_the_socket,
				 restart_replaces_stale_socket_and_adopts_sessions, idle_sessions_expire,
				 help_lists_the_flags, bad_flags_exit_2,
				 second_daemon_on_a_live_socket_is_refused, NULL } },
		{ "busy_poll", { busy_poll_spins_after_requests_then_sleeps, no_busy_poll_by_default,
				 ring_poll_spins_after_ring_requests_then_sleeps, NULL } },
	};

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	/* Each test owns its daemon and helper processes: they die with the
	 * test's own process, which only fork mode gives it. */
	return suite_main(service_suite(), CK_FORK);
}
