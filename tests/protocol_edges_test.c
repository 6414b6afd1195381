/*
 * Protocol edges an independent protobuf client found, against a real
 * daemon (tests/daemon_harness.c) with hand-made frames (tests/pb_bytes.h):
 *
 *   - a session name with a NUL inside was cut there in silence, so
 *     "a\0x" attached to the session opened as "a\0y": now refused;
 *   - an over-long name and an enum value past 32 bits were refused with
 *     request id 0 and no word of the limit: now the request's own id and
 *     the limit ("is 80 bytes; the limit is 64");
 *   - attach = true with another codec config, policy, residual_tokens or
 *     max_tokens returned the existing session as if it matched: now
 *     refused, naming each difference, and the session is left as it was.
 *
 * Every refusal is checked to have created or changed nothing.
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "frame.h"
#include "layer_model.h"
#include "pb_bytes.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* A handful of round trips; ASan makes the daemon several times slower. */
#define TEST_TIMEOUT_SECONDS 60

/* A small, valid shape for hand-made open requests. */
static void shape_bytes(struct pb_bytes *shape)
{
	memset(shape, 0, sizeof(*shape));
	pb_field_varint(shape, zipcache_v1_SessionShape_layers_tag, 1);
	pb_field_varint(shape, zipcache_v1_SessionShape_batch_tag, 1);
	pb_field_varint(shape, zipcache_v1_SessionShape_kv_heads_tag, 1);
	pb_field_varint(shape, zipcache_v1_SessionShape_head_dim_k_tag, 16);
	pb_field_varint(shape, zipcache_v1_SessionShape_head_dim_v_tag, 16);
}

/* Request { request_id, open_session { name, shape, max_tokens 64, attach } } */
static void open_bytes(struct pb_bytes *request, uint64_t id, const char *name, size_t name_len,
		       bool attach)
{
	struct pb_bytes open = { 0 }, shape;

	shape_bytes(&shape);
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, name, name_len);
	pb_field_message(&open, zipcache_v1_OpenSessionRequest_shape_tag, &shape);
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_max_tokens_tag, 64);
	if (attach)
		pb_field_varint(&open, zipcache_v1_OpenSessionRequest_attach_tag, 1);
	memset(request, 0, sizeof(*request));
	pb_field_varint(request, zipcache_v1_Request_request_id_tag, id);
	pb_field_message(request, zipcache_v1_Request_open_session_tag, &open);
}

/* Sends one hand-made frame and reads its reply (asserts there is one). */
static void bytes_call(int fd, const struct pb_bytes *body, wire_pb_response *reply, const char *what)
{
	uint8_t header[FRAME_HEADER_BYTES];
	int rc;

	frame_header_write(header, (uint32_t)body->len);
	rc = raw_send(fd, header, sizeof(header));
	if (rc == 0)
		rc = raw_send(fd, body->data, body->len);
	ck_assert_msg(rc == 0, "%s: send: %s", what, zc_strerror(rc));
	rc = raw_read_reply(fd, 10000, reply, NULL);
	ck_assert_msg(rc == 0, "%s: no reply: %s (%d)", what, zc_strerror(rc), rc);
}

/* The reply is a refusal with this status, for this request, saying needle. */
static void assert_refusal(wire_pb_response *reply, zipcache_v1_Status status, uint64_t id,
			   const char *needle, const char *what)
{
	ck_assert_msg(reply->msg.status == status, "%s: status %s, expected %s (message '%s')", what,
		      response_status_name(reply->msg.status), response_status_name(status),
		      reply->msg.message);
	ck_assert_msg(reply->msg.request_id == id, "%s: reply carries request id %" PRIu64
		      ", the request's was %" PRIu64 " (message '%s')", what, reply->msg.request_id,
		      id, reply->msg.message);
	ck_assert_msg(strstr(reply->msg.message, needle) != NULL,
		      "%s: message '%s' does not say '%s'", what, reply->msg.message, needle);
	ck_assert_msg(reply->msg.fds == 0, "%s: a refusal carried %u descriptors", what,
		      reply->msg.fds);
	wire_pb_response_free(reply);
}

/* The smallest session a test needs: one layer, one head of 16. */
static zc_session_config tiny_config(const char *name)
{
	return streaming_config(name, 1, 1, 16, 64, 0);
}

static size_t session_count(zc_client *client)
{
	size_t count = 0;
	int rc = zc_client_list_sessions(client, NULL, 0, &count);

	ck_assert_msg(rc == 0, "list_sessions: %s", zc_strerror(rc));
	return count;
}

START_TEST(nul_in_a_name_is_refused_not_cut_short)
{
	struct daemon_harness daemon;
	wire_pb_response reply;
	struct pb_bytes request;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	int fd = raw_connect(daemon.socket_path);
	ck_assert_int_ge(fd, 0);

	open_bytes(&request, 11, "a\0y", 3, false);
	bytes_call(fd, &request, &reply, "open 'a\\0y'");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 11, "NUL", "open 'a\\0y'");
	ck_assert_uint_eq(session_count(client), 0);

	/* The session "a" exists; "a\0x" is not a way to reach it. */
	zc_session_config config = tiny_config("a");
	zc_session *a = open_session(client, &config);
	open_bytes(&request, 12, "a\0x", 3, true);
	bytes_call(fd, &request, &reply, "attach 'a\\0x'");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 12, "NUL", "attach 'a\\0x'");
	/* Nor is "a\0", whose C string would be "a" as well. */
	open_bytes(&request, 13, "a\0", 2, true);
	bytes_call(fd, &request, &reply, "attach 'a\\0'");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 13, "NUL", "attach 'a\\0'");
	ck_assert_uint_eq(session_count(client), 1);

	/* The connection is still in business: "a" by its real name. */
	open_bytes(&request, 14, "a", 1, true);
	bytes_call(fd, &request, &reply, "attach 'a'");
	ck_assert_msg(reply.msg.status == zipcache_v1_Status_OK, "attach 'a': %s '%s'",
		      response_status_name(reply.msg.status), reply.msg.message);
	ck_assert_uint_eq(reply.msg.request_id, 14);
	ck_assert(reply.msg.op.open_session.attached);
	ck_assert_uint_eq(reply.msg.op.open_session.session.session_id, zc_session_get_info(a)->id);
	wire_pb_response_free(&reply);

	close(fd);
	zc_session_release(a);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

START_TEST(limits_broken_in_decoding_echo_the_id_and_name_the_limit)
{
	struct daemon_harness daemon;
	wire_pb_response reply;
	struct pb_bytes request, open, shape;
	char name[81];

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	int fd = raw_connect(daemon.socket_path);
	ck_assert_int_ge(fd, 0);

	memset(name, 'n', 80);
	name[80] = '\0';
	open_bytes(&request, 21, name, 80, false);
	bytes_call(fd, &request, &reply, "80-byte name");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 21,
		       "open_session.name is 80 bytes; the limit is 64", "80-byte name");

	/* policy -1, as proto3 encoders send a negative enum (ten bytes). */
	shape_bytes(&shape);
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, "p", 1);
	pb_field_message(&open, zipcache_v1_OpenSessionRequest_shape_tag, &shape);
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_max_tokens_tag, 64);
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_policy_tag, UINT64_MAX);
	memset(&request, 0, sizeof(request));
	pb_field_varint(&request, zipcache_v1_Request_request_id_tag, 22);
	pb_field_message(&request, zipcache_v1_Request_open_session_tag, &open);
	bytes_call(fd, &request, &reply, "policy -1");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 22,
		       "open_session.policy is -1; it must be 0 (STREAMING) or 1 (PER_CALL)",
		       "policy -1");

	/* A uint32 past 32 bits, the id after the bad field. */
	memset(&shape, 0, sizeof(shape));
	pb_field_varint(&shape, zipcache_v1_SessionShape_layers_tag, 1ull << 33);
	memset(&open, 0, sizeof(open));
	pb_field_message(&open, zipcache_v1_OpenSessionRequest_shape_tag, &shape);
	memset(&request, 0, sizeof(request));
	pb_field_message(&request, zipcache_v1_Request_open_session_tag, &open);
	pb_field_varint(&request, zipcache_v1_Request_request_id_tag, 23);
	bytes_call(fd, &request, &reply, "layers 2^33");
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 23,
		       "open_session.shape.layers is 8589934592; the limit is 4294967295",
		       "layers 2^33");

	/* Nothing was created, and the connection still answers. */
	ck_assert_uint_eq(session_count(client), 0);
	memset(&open, 0, sizeof(open));
	pb_field_varint(&open, zipcache_v1_HelloRequest_protocol_version_tag, 1);
	memset(&request, 0, sizeof(request));
	pb_field_varint(&request, zipcache_v1_Request_request_id_tag, 24);
	pb_field_message(&request, zipcache_v1_Request_hello_tag, &open);
	bytes_call(fd, &request, &reply, "hello afterwards");
	ck_assert_int_eq(reply.msg.status, zipcache_v1_Status_OK);
	ck_assert_uint_eq(reply.msg.request_id, 24);
	wire_pb_response_free(&reply);

	/* The C client says the same before it sends anything. */
	zc_session_config config = tiny_config(name);
	zc_session *session = NULL;
	int rc = zc_session_open(client, &config, &session);
	assert_refused(client, rc, ZC_EINVALID, "is 80 bytes; the limit is 64", "80-byte name in C");
	ck_assert_uint_eq(session_count(client), 0);

	close(fd);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static zc_session_config attach_base(void)
{
	return streaming_config("shared", 2, 2, 16, 256, 32);
}

/* The session still holds what it held: 8 tokens in layer 0, 0 in layer 1. */
static void assert_untouched(zc_session *session, const char *what)
{
	zc_view view;

	ck_assert_int_eq(zc_session_view(session, 0, &view), 0);
	ck_assert_msg(view.tokens == 8, "%s: layer 0 holds %u tokens, not 8", what, view.tokens);
	ck_assert_int_eq(zc_session_view(session, 1, &view), 0);
	ck_assert_msg(view.tokens == 0, "%s: layer 1 holds %u tokens, not 0", what, view.tokens);
}

START_TEST(attach_with_other_settings_is_refused)
{
	struct daemon_harness daemon;
	zc_session_config base = attach_base();
	struct block block;
	struct rng rng;
	zc_view view;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &base);
	rng_seed(&rng, 9);
	block_make_shape(&block, 2, 16, 16, 8, &rng);
	ck_assert_int_eq(zc_update_and_fetch(session, 0, 8, block.keys, block.values, &view, NULL), 0);
	block_free(&block);

	/* One difference each (the switch below makes it), then two at once. */
	static const struct {
		const char *what;
		const char *needle;
	} cases[] = {
		{ "hi_bits", "codec.hi_bits is 4, not 3" },
		{ "lo_bits", "codec.lo_bits is 2, not 1" },
		{ "hi_fraction", "codec.hi_fraction is 0.2, not 0.25" },
		{ "group_size", "codec.group_size is 32, not 16" },
		{ "quantize_values", "codec.quantize_values is true, not false" },
		{ "policy", "a different policy: policy is streaming, not per_call" },
		{ "residual_tokens", "residual_tokens is 32, not 64" },
		{ "max_tokens", "max_tokens is 256, not 512" },
		{ "kv_heads", "a different shape: shape.kv_heads is 2, not 4" },
		{ "policy and codec",
		  "a different policy, codec: policy is streaming, not per_call; codec.hi_bits is 4, not 5" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		zc_session_config config = base;
		zc_session *attached = NULL;

		config.attach = true;
		switch (i) {
		case 0: config.codec.hi_bits = 3; break;
		case 1: config.codec.lo_bits = 1; break;
		case 2: config.codec.hi_fraction = 0.25; break;
		case 3: config.codec.group_size = 16; break;
		case 4: config.codec.quantize_values = false; break;
		case 5: config.policy = ZC_POLICY_PER_CALL; break;
		case 6: config.residual_tokens = 64; break;
		case 7: config.max_tokens = 512; break;
		case 8: config.kv_heads = 4; break;
		case 9: config.policy = ZC_POLICY_PER_CALL; config.codec.hi_bits = 5; break;
		}
		int rc = zc_session_open(client, &config, &attached);
		assert_refused(client, rc, ZC_EINVALID, cases[i].needle, cases[i].what);
		ck_assert_ptr_null(attached);
		assert_untouched(session, cases[i].what);
	}

	/* The same settings attach; residual_tokens 0 means "not given". */
	zc_session_config same = base;
	same.attach = true;
	zc_session *again = open_session(client, &same);
	assert_untouched(again, "attached with the same settings");
	zc_session_release(again);
	same.residual_tokens = 0;
	again = open_session(client, &same);
	zc_session_release(again);

	/* A raw attach gives only what it sets. */
	int fd = raw_connect(daemon.socket_path);
	ck_assert_int_ge(fd, 0);
	wire_pb_request request;
	wire_pb_response reply;

	memset(&request, 0, sizeof(request));
	request.msg.request_id = 31;
	request.msg.which_op = zipcache_v1_Request_open_session_tag;
	snprintf(request.msg.op.open_session.name, sizeof(request.msg.op.open_session.name), "shared");
	request.msg.op.open_session.attach = true;
	/* A name alone: a lookup, STREAMING or unset alike. */
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	ck_assert_msg(reply.msg.status == zipcache_v1_Status_OK, "attach by name: %s '%s'",
		      response_status_name(reply.msg.status), reply.msg.message);
	ck_assert(reply.msg.op.open_session.attached);
	wire_pb_response_free(&reply);
	/* A codec with one field present, equal: fine. */
	request.msg.request_id = 32;
	request.msg.op.open_session.has_codec = true;
	request.msg.op.open_session.codec.has_group_size = true;
	request.msg.op.open_session.codec.group_size = 32;
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	ck_assert_int_eq(reply.msg.status, zipcache_v1_Status_OK);
	wire_pb_response_free(&reply);
	/* ...and different: refused with this request's id. */
	request.msg.request_id = 33;
	request.msg.op.open_session.codec.group_size = 64;
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 33,
		       "codec.group_size is 32, not 64", "raw attach with group_size 64");
	/* PER_CALL needs no shape to count as given. */
	request.msg.request_id = 34;
	request.msg.op.open_session.has_codec = false;
	request.msg.op.open_session.policy = zipcache_v1_BlockPolicy_PER_CALL;
	ck_assert_int_eq(raw_call(fd, &request, &reply, NULL), 0);
	assert_refusal(&reply, zipcache_v1_Status_INVALID_ARGUMENT, 34,
		       "policy is streaming, not per_call", "raw attach with PER_CALL");
	close(fd);

	assert_untouched(session, "after the raw attaches");
	ck_assert_uint_eq(session_count(client), 1);

	/* A per_call session keeps no residual: residual_tokens is not compared. */
	zc_session_config per_call = base;
	per_call.name = "per-call";
	per_call.policy = ZC_POLICY_PER_CALL;
	zc_session *first = open_session(client, &per_call);
	per_call.attach = true;
	per_call.residual_tokens = 48;
	zc_session *second = open_session(client, &per_call);
	ck_assert_uint_eq(zc_session_get_info(second)->id, zc_session_get_info(first)->id);
	zc_session_release(second);
	zc_session_release(first);
	zc_session_release(session);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "names", { nul_in_a_name_is_refused_not_cut_short,
			     limits_broken_in_decoding_echo_the_id_and_name_the_limit, NULL } },
		{ "attach", { attach_with_other_settings_is_refused, NULL } },
	};
	Suite *suite = suite_create("protocol_edges");

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
