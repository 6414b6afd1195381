/*
 * Wire messages: every op round-trips with every field set, inline K/V
 * bytes are captured in place, lists of any size survive, and malformed
 * bytes of every kind give ZC_EPROTOCOL without crashing (run under ASan).
 */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "pb_bytes.h"
#include "wire_pb.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* Generated structs compared with memcmp: build them from zeroed memory. */
#define ZERO(x) memset(&(x), 0, sizeof(x))

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	/* xorshift64: deterministic, so a failure reproduces. */
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/*
 * Encodes through the sizing and encoding entry points and checks they
 * agree with each other and with the header. Returns the frame (malloc).
 */
static uint8_t *encode_request(const wire_pb_request *req, size_t *frame_len)
{
	size_t size = 0, len = 0;
	uint8_t *frame;

	ck_assert_int_eq(wire_pb_request_frame_size(req, &size), 0);
	frame = malloc(size);
	ck_assert_ptr_nonnull(frame);
	ck_assert_int_eq(wire_pb_request_encode(req, frame, size, &len), 0);
	ck_assert_uint_eq(len, size);
	ck_assert_uint_eq(frame_header_read(frame), size - FRAME_HEADER_BYTES);
	*frame_len = len;
	return frame;
}

static uint8_t *encode_response(const wire_pb_response *resp, size_t *frame_len)
{
	size_t size = 0, len = 0;
	uint8_t *frame;

	ck_assert_int_eq(wire_pb_response_frame_size(resp, &size), 0);
	frame = malloc(size);
	ck_assert_ptr_nonnull(frame);
	ck_assert_int_eq(wire_pb_response_encode(resp, frame, size, &len), 0);
	ck_assert_uint_eq(len, size);
	ck_assert_uint_eq(frame_header_read(frame), size - FRAME_HEADER_BYTES);
	*frame_len = len;
	return frame;
}

/* Round trip of a request without inline bytes: decoded == sent. */
static void check_request_round_trip(const wire_pb_request *req)
{
	size_t len;
	uint8_t *frame = encode_request(req, &len);
	wire_pb_request out;

	ck_assert_int_eq(wire_pb_request_decode(frame + 4, len - 4, &out), 0);
	ck_assert_ptr_null(out.error);
	ck_assert_uint_eq(out.msg.which_op, req->msg.which_op);
	ck_assert_mem_eq(&out.msg, &req->msg, sizeof(out.msg));
	free(frame);
}

static void fill_codec(zipcache_v1_CodecConfig *c, uint32_t seed)
{
	c->has_hi_bits = true;
	c->hi_bits = 4 + seed;
	c->has_lo_bits = true;
	c->lo_bits = 2 + seed;
	c->has_hi_fraction = true;
	c->hi_fraction = 0.2 + seed;
	c->has_group_size = true;
	c->group_size = 32 + seed;
	c->has_quantize_values = true;
	c->quantize_values = true;
}

static void fill_shape(zipcache_v1_SessionShape *s, uint32_t seed)
{
	s->layers = 32 + seed;
	s->batch = 2 + seed;
	s->kv_heads = 8 + seed;
	s->head_dim_k = 128 + seed;
	s->head_dim_v = 64 + seed;
}

static void fill_session_info(zipcache_v1_SessionInfo *s, uint32_t seed)
{
	s->session_id = UINT64_MAX - seed;
	snprintf(s->name, sizeof(s->name), "session-%u", seed);
	s->has_shape = true;
	fill_shape(&s->shape, seed);
	s->max_tokens = 4096 + seed;
	s->has_codec = true;
	fill_codec(&s->codec, seed);
	s->policy = zipcache_v1_BlockPolicy_PER_CALL;
	s->residual_tokens = 128 + seed;
	s->min_tokens = 10 + seed;
	s->max_layer_tokens = 20 + seed;
	s->idle_ms = 1000000000000ull + seed;
}

static void fill_layer_stats(zipcache_v1_LayerStats *l, uint32_t seed)
{
	l->layer = seed + 1;
	l->tokens = 1000 + seed;
	l->residual_tokens = 7 + seed;
	l->compressed_key_bytes = 1ull << 40 | seed;
	l->compressed_value_bytes = 2 + seed;
	l->baseline_key_bytes = 3 + seed;
	l->baseline_value_bytes = 4 + seed;
	l->fp16_key_bytes = 5 + seed;
	l->fp16_value_bytes = 6 + seed;
	l->compression_ratio = 4.4 + seed;
	l->effective_avg_bits = 3.6 - seed;
	l->blocks = 9 + seed;
}

START_TEST(request_hello)
{
	wire_pb_request req;

	ZERO(req);
	req.msg.request_id = 1;
	req.msg.which_op = zipcache_v1_Request_hello_tag;
	req.msg.op.hello.protocol_version = 1;
	strcpy(req.msg.op.hello.client_name, "worker-7/λ"); /* UTF-8 survives */
	check_request_round_trip(&req);

	/* The longest name that fits: 64 bytes. */
	memset(req.msg.op.hello.client_name, 'n', 64);
	req.msg.op.hello.client_name[64] = '\0';
	check_request_round_trip(&req);
}
END_TEST

START_TEST(request_open_session_all_fields)
{
	wire_pb_request req;

	ZERO(req);
	req.msg.request_id = UINT64_MAX;
	req.msg.which_op = zipcache_v1_Request_open_session_tag;
	strcpy(req.msg.op.open_session.name, "user/model/seq-42");
	req.msg.op.open_session.has_shape = true;
	fill_shape(&req.msg.op.open_session.shape, 0);
	req.msg.op.open_session.max_tokens = 32768;
	req.msg.op.open_session.has_codec = true;
	fill_codec(&req.msg.op.open_session.codec, 1);
	req.msg.op.open_session.policy = zipcache_v1_BlockPolicy_PER_CALL;
	req.msg.op.open_session.has_residual_tokens = true;
	req.msg.op.open_session.residual_tokens = 64;
	req.msg.op.open_session.attach = true;
	check_request_round_trip(&req);
}
END_TEST

/*
 * proto3 `optional`: a field set to its zero value is still present, and
 * an unset one stays absent, one by one.
 */
START_TEST(request_open_session_optional_presence)
{
	wire_pb_request req;
	zipcache_v1_CodecConfig *c = &req.msg.op.open_session.codec;

	ZERO(req);
	req.msg.which_op = zipcache_v1_Request_open_session_tag;
	req.msg.op.open_session.has_codec = true; /* empty but present */
	check_request_round_trip(&req);

	for (int i = 0; i < 5; i++) {
		ZERO(req);
		req.msg.which_op = zipcache_v1_Request_open_session_tag;
		req.msg.op.open_session.has_codec = true;
		/* Zero values: only the has_ flag carries information. */
		c->has_hi_bits = i == 0;
		c->has_lo_bits = i == 1;
		c->has_hi_fraction = i == 2;
		c->has_group_size = i == 3;
		c->has_quantize_values = i == 4;
		check_request_round_trip(&req);
	}

	ZERO(req);
	req.msg.which_op = zipcache_v1_Request_open_session_tag;
	req.msg.op.open_session.has_residual_tokens = true; /* 0, present */
	check_request_round_trip(&req);

	/* Nothing set at all: no shape, no codec, no residual_tokens. */
	ZERO(req);
	req.msg.which_op = zipcache_v1_Request_open_session_tag;
	check_request_round_trip(&req);
}
END_TEST

START_TEST(request_small_ops)
{
	wire_pb_request req;

	ZERO(req);
	req.msg.request_id = 5;
	req.msg.which_op = zipcache_v1_Request_trim_tag;
	req.msg.op.trim.session_id = 77;
	req.msg.op.trim.tokens = 3;
	check_request_round_trip(&req);

	ZERO(req);
	req.msg.request_id = 6;
	req.msg.which_op = zipcache_v1_Request_close_session_tag;
	req.msg.op.close_session.session_id = UINT64_MAX;
	check_request_round_trip(&req);

	ZERO(req);
	req.msg.request_id = 7;
	req.msg.which_op = zipcache_v1_Request_stats_tag;
	req.msg.op.stats.session_id = 12;
	check_request_round_trip(&req);

	ZERO(req);
	req.msg.request_id = 8;
	req.msg.which_op = zipcache_v1_Request_list_sessions_tag;
	check_request_round_trip(&req);

	ZERO(req);
	req.msg.request_id = 9;
	req.msg.which_op = zipcache_v1_Request_staging_tag;
	req.msg.op.staging.bytes = 64ull << 20;
	check_request_round_trip(&req);

	/* Staged update_and_fetch: offsets, no inline bytes. */
	ZERO(req);
	req.msg.request_id = 10;
	req.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	req.msg.op.update_and_fetch.session_id = 3;
	req.msg.op.update_and_fetch.layer = 31;
	req.msg.op.update_and_fetch.tokens = 1;
	req.msg.op.update_and_fetch.staged = true;
	req.msg.op.update_and_fetch.keys_offset = 4096;
	req.msg.op.update_and_fetch.values_offset = 1ull << 33;
	check_request_round_trip(&req);

	/* No op at all (which_op 0) and an empty frame decode the same. */
	ZERO(req);
	req.msg.request_id = 11;
	check_request_round_trip(&req);
	{
		wire_pb_request out;

		ck_assert_int_eq(wire_pb_request_decode(NULL, 0, &out), 0);
		ck_assert_uint_eq(out.msg.which_op, 0);
		ck_assert_uint_eq(out.msg.request_id, 0);
	}
}
END_TEST

/* Builds a request with inline keys and values of the given sizes. */
static void make_inline_request(wire_pb_request *req, uint8_t *keys, size_t n_keys,
				uint8_t *values, size_t n_values)
{
	for (size_t i = 0; i < n_keys; i++)
		keys[i] = (uint8_t)(i * 7 + 1);
	for (size_t i = 0; i < n_values; i++)
		values[i] = (uint8_t)(i * 13 + 5);
	ZERO(*req);
	req->msg.request_id = 99;
	req->msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	req->msg.op.update_and_fetch.session_id = 1234;
	req->msg.op.update_and_fetch.layer = 5;
	req->msg.op.update_and_fetch.tokens = 17;
	req->keys = (wire_span){ keys, n_keys };
	req->values = (wire_span){ values, n_values };
}

static int span_inside(wire_span span, const uint8_t *buf, size_t len)
{
	return span.data >= buf && span.data + span.len <= buf + len;
}

START_TEST(request_inline_spans_point_into_frame)
{
	static const size_t sizes[][2] = { { 2, 2 }, { 1000, 2000 }, { 0, 64 },
					   { 64, 0 }, { 1 << 20, 1 << 19 } };

	for (size_t t = 0; t < sizeof(sizes) / sizeof(sizes[0]); t++) {
		uint8_t *keys = malloc(sizes[t][0] + 1), *values = malloc(sizes[t][1] + 1);
		wire_pb_request req, out;
		uint8_t *frame, *body;
		size_t len, body_len;

		make_inline_request(&req, keys, sizes[t][0], values, sizes[t][1]);
		frame = encode_request(&req, &len);
		body = frame + 4;
		body_len = len - 4;
		ck_assert_int_eq(wire_pb_request_decode(body, body_len, &out), 0);
		ck_assert_uint_eq(out.msg.which_op, zipcache_v1_Request_update_and_fetch_tag);
		ck_assert_uint_eq(out.msg.request_id, 99);
		ck_assert_uint_eq(out.msg.op.update_and_fetch.session_id, 1234);
		ck_assert_uint_eq(out.msg.op.update_and_fetch.layer, 5);
		ck_assert_uint_eq(out.msg.op.update_and_fetch.tokens, 17);
		ck_assert(!out.msg.op.update_and_fetch.staged);
		/* Nothing aimed at decode's stack frame is left behind. */
		ck_assert_ptr_null(out.msg.op.update_and_fetch.keys.funcs.decode);
		ck_assert_ptr_null(out.msg.op.update_and_fetch.keys.arg);
		ck_assert_ptr_null(out.msg.op.update_and_fetch.values.funcs.decode);

		ck_assert_uint_eq(out.keys.len, sizes[t][0]);
		ck_assert_uint_eq(out.values.len, sizes[t][1]);
		if (sizes[t][0] == 0) {
			ck_assert_ptr_null(out.keys.data); /* proto3: empty is absent */
		} else {
			/* Inside the frame buffer, hence not a copy. */
			ck_assert(span_inside(out.keys, body, body_len));
			ck_assert_mem_eq(out.keys.data, keys, sizes[t][0]);
			/* A byte changed in the frame shows through the span. */
			body[out.keys.data - body] ^= 0xff;
			ck_assert_uint_eq(out.keys.data[0], (uint8_t)(keys[0] ^ 0xff));
		}
		if (sizes[t][1] == 0) {
			ck_assert_ptr_null(out.values.data);
		} else {
			ck_assert(span_inside(out.values, body, body_len));
			ck_assert_mem_eq(out.values.data, values, sizes[t][1]);
		}
		if (sizes[t][0] && sizes[t][1])
			ck_assert(out.keys.data + out.keys.len <= out.values.data ||
				  out.values.data + out.values.len <= out.keys.data);
		free(frame);
		free(keys);
		free(values);
	}
}
END_TEST

/* A request taken from a frame reader: the spans point into its buffer. */
START_TEST(request_through_frame_reader)
{
	uint8_t keys[300], values[500];
	wire_pb_request req, out;
	frame_reader r;
	uint8_t *frame;
	const uint8_t *body;
	size_t len, body_len;

	make_inline_request(&req, keys, sizeof(keys), values, sizeof(values));
	frame = encode_request(&req, &len);
	frame_reader_init(&r, 4096);
	for (size_t i = 0; i < len; i += 7)
		ck_assert_int_eq(frame_reader_feed(&r, frame + i, len - i < 7 ? len - i : 7), 0);
	ck_assert_int_eq(frame_reader_next(&r, &body, &body_len), 1);
	ck_assert_int_eq(wire_pb_request_decode(body, body_len, &out), 0);
	ck_assert(out.keys.data >= r.buf && out.keys.data + out.keys.len <= r.buf + r.end);
	ck_assert(out.values.data >= r.buf && out.values.data + out.values.len <= r.buf + r.end);
	ck_assert_mem_eq(out.keys.data, keys, sizeof(keys));
	ck_assert_mem_eq(out.values.data, values, sizeof(values));
	frame_reader_consume(&r);
	frame_reader_free(&r);
	free(frame);
}
END_TEST

/* Round trip of a response; lists are compared entry by entry. */
static void check_response_round_trip(const wire_pb_response *resp)
{
	size_t len;
	uint8_t *frame = encode_response(resp, &len);
	wire_pb_response out;

	ck_assert_int_eq(wire_pb_response_decode(frame + 4, len - 4, &out), 0);
	ck_assert_ptr_null(out.error);
	ck_assert_uint_eq(out.msg.which_op, resp->msg.which_op);
	ck_assert_mem_eq(&out.msg, &resp->msg, sizeof(out.msg));
	if (resp->msg.which_op == zipcache_v1_Response_stats_tag) {
		ck_assert_uint_eq(out.n_layers, resp->n_layers);
		if (resp->n_layers > 0)
			ck_assert_mem_eq(out.layers, resp->layers,
					 resp->n_layers * sizeof(*out.layers));
		else
			ck_assert_ptr_null(out.layers);
	} else {
		ck_assert_uint_eq(out.n_layers, 0);
		ck_assert_ptr_null(out.layers);
	}
	if (resp->msg.which_op == zipcache_v1_Response_list_sessions_tag) {
		ck_assert_uint_eq(out.n_sessions, resp->n_sessions);
		if (resp->n_sessions > 0)
			ck_assert_mem_eq(out.sessions, resp->sessions,
					 resp->n_sessions * sizeof(*out.sessions));
		else
			ck_assert_ptr_null(out.sessions);
	} else {
		ck_assert_uint_eq(out.n_sessions, 0);
		ck_assert_ptr_null(out.sessions);
	}
	wire_pb_response_free(&out);
	ck_assert_ptr_null(out.layers);
	wire_pb_response_free(&out); /* twice is harmless */
	free(frame);
}

/* Zeroed response with the header fields every response carries. */
static void response_init(wire_pb_response *resp, pb_size_t op)
{
	ZERO(*resp);
	resp->msg.request_id = 0x123456789abcull;
	resp->msg.status = zipcache_v1_Status_OK;
	resp->msg.which_op = op;
}

START_TEST(response_hello)
{
	wire_pb_response resp;
	zipcache_v1_HelloResponse *h = &resp.msg.op.hello;

	response_init(&resp, zipcache_v1_Response_hello_tag);
	h->protocol_version = 1;
	strcpy(h->server_version, "zipcached 0.1.0");
	h->boot_epoch = 0xfeedfacecafebeefull;
	h->max_frame_bytes = 16u << 20;
	h->max_inline_bytes = 1u << 20;
	h->max_sessions = 1024;
	h->max_tokens_per_session = 1ull << 20;
	h->memory_budget_bytes = 64ull << 30;
	check_response_round_trip(&resp);
}
END_TEST

START_TEST(response_open_session)
{
	wire_pb_response *resp = calloc(1, sizeof(*resp));
	zipcache_v1_OpenSessionResponse *o = &resp->msg.op.open_session;

	ck_assert_ptr_nonnull(resp);
	response_init(resp, zipcache_v1_Response_open_session_tag);
	resp->msg.fds = 1;
	o->has_session = true;
	fill_session_info(&o->session, 3);
	o->has_view = true;
	o->view.mapping_bytes = 1ull << 36;
	o->view.header_bytes = 4096;
	o->view.key_offsets_count = 3;
	o->view.value_offsets_count = 3;
	for (int i = 0; i < 3; i++) {
		o->view.key_offsets[i] = 4096 + (uint64_t)i * 2 * 1000000;
		o->view.value_offsets[i] = 4096 + (uint64_t)(i * 2 + 1) * 1000000;
	}
	o->attached = true;
	check_response_round_trip(resp);

	/* The largest layout the options allow. */
	o->view.key_offsets_count = 1024;
	o->view.value_offsets_count = 1024;
	for (int i = 0; i < 1024; i++) {
		o->view.key_offsets[i] = (uint64_t)i << 30;
		o->view.value_offsets[i] = ((uint64_t)i << 30) + 1;
	}
	check_response_round_trip(resp);
	free(resp);
}
END_TEST

START_TEST(response_small_ops)
{
	wire_pb_response resp;

	response_init(&resp, zipcache_v1_Response_update_and_fetch_tag);
	resp.msg.op.update_and_fetch.tokens = 4097;
	resp.msg.op.update_and_fetch.has_stats = true;
	fill_layer_stats(&resp.msg.op.update_and_fetch.stats, 2);
	resp.msg.op.update_and_fetch.sequence = 1ull << 50;
	check_response_round_trip(&resp);

	response_init(&resp, zipcache_v1_Response_trim_tag);
	resp.msg.op.trim.trimmed = 5;
	resp.msg.op.trim.tokens = 4092;
	check_response_round_trip(&resp);

	response_init(&resp, zipcache_v1_Response_close_session_tag);
	check_response_round_trip(&resp);

	response_init(&resp, zipcache_v1_Response_staging_tag);
	resp.msg.fds = 1;
	resp.msg.op.staging.bytes = 32ull << 20;
	check_response_round_trip(&resp);

	/* An error response: status and message, no op. */
	response_init(&resp, 0);
	wire_pb_response_set_status(&resp, ZC_ENOTFOUND, "no session 42 for uid 1000");
	check_response_round_trip(&resp);
}
END_TEST

START_TEST(response_stats_layers)
{
	static const size_t counts[] = { 0, 1, 2, 3, 31, 100, 1000, 5000 };

	for (size_t t = 0; t < sizeof(counts) / sizeof(counts[0]); t++) {
		size_t n = counts[t];
		zipcache_v1_LayerStats *layers = calloc(n + 1, sizeof(*layers));
		wire_pb_response resp;

		ck_assert_ptr_nonnull(layers);
		for (size_t i = 0; i < n; i++)
			fill_layer_stats(&layers[i], (uint32_t)i);
		response_init(&resp, zipcache_v1_Response_stats_tag);
		resp.msg.op.stats.has_session = true;
		fill_session_info(&resp.msg.op.stats.session, 9);
		resp.msg.op.stats.has_total = true;
		fill_layer_stats(&resp.msg.op.stats.total, 77);
		resp.msg.op.stats.sessions = 12;
		resp.msg.op.stats.connections = 34;
		resp.msg.op.stats.memory_used_bytes = 5ull << 30;
		resp.msg.op.stats.memory_budget_bytes = 64ull << 30;
		resp.layers = n ? layers : NULL;
		resp.n_layers = n;
		check_response_round_trip(&resp);
		free(layers);
	}

	/* An all-default layer is two bytes on the wire and still counts. */
	{
		zipcache_v1_LayerStats empty[4];
		wire_pb_response resp;

		memset(empty, 0, sizeof(empty));
		response_init(&resp, zipcache_v1_Response_stats_tag);
		resp.layers = empty;
		resp.n_layers = 4;
		check_response_round_trip(&resp);
	}
}
END_TEST

START_TEST(response_list_sessions)
{
	static const size_t counts[] = { 0, 1, 2, 7, 64, 1000 };

	for (size_t t = 0; t < sizeof(counts) / sizeof(counts[0]); t++) {
		size_t n = counts[t];
		zipcache_v1_SessionInfo *sessions = calloc(n + 1, sizeof(*sessions));
		wire_pb_response resp;

		ck_assert_ptr_nonnull(sessions);
		for (size_t i = 0; i < n; i++)
			fill_session_info(&sessions[i], (uint32_t)i);
		/* One with no shape and no codec among them. */
		if (n > 1) {
			sessions[1].has_shape = false;
			ZERO(sessions[1].shape);
			sessions[1].has_codec = false;
			ZERO(sessions[1].codec);
		}
		response_init(&resp, zipcache_v1_Response_list_sessions_tag);
		resp.sessions = n ? sessions : NULL;
		resp.n_sessions = n;
		check_response_round_trip(&resp);
		free(sessions);
	}
}
END_TEST

START_TEST(list_limit)
{
	size_t n = WIRE_MAX_LIST_ITEMS;
	zipcache_v1_LayerStats *layers = calloc(n + 1, sizeof(*layers));
	wire_pb_response resp, out;
	uint8_t *frame;
	size_t len, size;

	ck_assert_ptr_nonnull(layers);
	response_init(&resp, zipcache_v1_Response_stats_tag);
	resp.layers = layers;
	resp.n_layers = n;
	frame = encode_response(&resp, &len);
	ck_assert_int_eq(wire_pb_response_decode(frame + 4, len - 4, &out), 0);
	ck_assert_uint_eq(out.n_layers, n);
	wire_pb_response_free(&out);
	free(frame);

	/* One more is refused by the encoder... */
	resp.n_layers = n + 1;
	ck_assert_int_eq(wire_pb_response_frame_size(&resp, &size), ZC_EINVALID);
	ck_assert_int_eq(wire_pb_response_encode(&resp, (uint8_t *)layers, 0, &len), ZC_EINVALID);
	/* ...and by the decoder, from hand-made bytes. */
	{
		size_t inner = 2 * (n + 1), pos = 0;
		uint8_t *bytes = malloc(inner + 8);

		ck_assert_ptr_nonnull(bytes);
		bytes[pos++] = (15 << 3) | 2; /* Response.stats */
		for (size_t v = inner; ; v >>= 7) {
			bytes[pos++] = (uint8_t)(v & 0x7f) | (v >= 0x80 ? 0x80 : 0);
			if (v < 0x80)
				break;
		}
		for (size_t i = 0; i <= n; i++) {
			bytes[pos++] = (2 << 3) | 2; /* StatsResponse.layers, empty */
			bytes[pos++] = 0;
		}
		ck_assert_int_eq(wire_pb_response_decode(bytes, pos, &out), ZC_EPROTOCOL);
		ck_assert_ptr_nonnull(out.error);
		ck_assert_ptr_null(out.layers);
		free(bytes);
	}
	free(layers);
}
END_TEST

START_TEST(encode_buffer_too_small)
{
	uint8_t keys[100], values[100];
	wire_pb_request req;
	wire_pb_response resp;
	zipcache_v1_SessionInfo sessions[3];
	uint8_t *frame, buf[4096];
	size_t len, out_len;

	make_inline_request(&req, keys, sizeof(keys), values, sizeof(values));
	frame = encode_request(&req, &len);
	for (size_t cap = 0; cap < len; cap++)
		ck_assert_int_eq(wire_pb_request_encode(&req, buf, cap, &out_len), ZC_EBUFFER);
	ck_assert_int_eq(wire_pb_request_encode(&req, buf, len, &out_len), 0);
	ck_assert_uint_eq(out_len, len);
	ck_assert_mem_eq(buf, frame, len);
	free(frame);

	memset(sessions, 0, sizeof(sessions));
	for (int i = 0; i < 3; i++)
		fill_session_info(&sessions[i], (uint32_t)i);
	response_init(&resp, zipcache_v1_Response_list_sessions_tag);
	resp.sessions = sessions;
	resp.n_sessions = 3;
	frame = encode_response(&resp, &len);
	for (size_t cap = 0; cap < len; cap++)
		ck_assert_int_eq(wire_pb_response_encode(&resp, buf, cap, &out_len), ZC_EBUFFER);
	ck_assert_int_eq(wire_pb_response_encode(&resp, buf, sizeof(buf), &out_len), 0);
	ck_assert_uint_eq(out_len, len);
	ck_assert_mem_eq(buf, frame, len);
	free(frame);
}
END_TEST

START_TEST(encode_invalid_struct)
{
	wire_pb_request req;
	wire_pb_response resp;
	uint8_t buf[512];
	size_t len;

	/* A string that fills its array with no NUL cannot be encoded. */
	ZERO(req);
	req.msg.which_op = zipcache_v1_Request_hello_tag;
	memset(req.msg.op.hello.client_name, 'x', sizeof(req.msg.op.hello.client_name));
	ck_assert_int_eq(wire_pb_request_frame_size(&req, &len), ZC_EINVALID);
	ck_assert_int_eq(wire_pb_request_encode(&req, buf, sizeof(buf), &len), ZC_EINVALID);
	ck_assert_int_eq(wire_pb_request_encode(&req, buf, 2, &len), ZC_EINVALID);

	/* A list said to have entries but no array. */
	response_init(&resp, zipcache_v1_Response_stats_tag);
	resp.n_layers = 2;
	ck_assert_int_eq(wire_pb_response_frame_size(&resp, &len), ZC_EINVALID);
	ck_assert_int_eq(wire_pb_response_encode(&resp, buf, sizeof(buf), &len), ZC_EINVALID);
}
END_TEST

/* Decoding must answer 0 or ZC_EPROTOCOL, and a span never leaves the input. */
static void decode_any_request(const uint8_t *bytes, size_t len)
{
	wire_pb_request out;
	int rc = wire_pb_request_decode(bytes, len, &out);

	ck_assert_msg(rc == 0 || rc == ZC_EPROTOCOL, "rc %d", rc);
	if (rc == 0) {
		ck_assert_ptr_null(out.error);
		if (out.keys.data)
			ck_assert(span_inside(out.keys, bytes, len));
		if (out.values.data)
			ck_assert(span_inside(out.values, bytes, len));
	} else {
		ck_assert_ptr_nonnull(out.error);
		ck_assert_ptr_null(out.keys.data);
	}
}

static void decode_any_response(const uint8_t *bytes, size_t len)
{
	wire_pb_response out;
	int rc = wire_pb_response_decode(bytes, len, &out);

	ck_assert_msg(rc == 0 || rc == ZC_EPROTOCOL, "rc %d", rc);
	if (rc == 0)
		ck_assert_ptr_null(out.error);
	else
		ck_assert_ptr_nonnull(out.error);
	wire_pb_response_free(&out);
}

START_TEST(malformed_random_garbage)
{
	for (int i = 0; i < 20000; i++) {
		size_t len = rng() % 300;
		/* Exactly len bytes on the heap, so ASan sees any overread. */
		uint8_t *bytes = malloc(len ? len : 1);

		ck_assert_ptr_nonnull(bytes);
		for (size_t j = 0; j < len; j++)
			bytes[j] = (uint8_t)rng();
		/* Bias towards plausible starts so the parser goes deeper. */
		if (len > 0 && i % 2)
			bytes[0] = (uint8_t)((rng() % 18) << 3 | (rng() % 6));
		decode_any_request(bytes, len);
		decode_any_response(bytes, len);
		free(bytes);
	}
}
END_TEST

/*
 * Every prefix and every single-byte corruption of real messages: those
 * reach deep into the parser, unlike uniform garbage.
 */
START_TEST(malformed_truncated_and_corrupted)
{
	uint8_t keys[40], values[24];
	zipcache_v1_LayerStats layers[3];
	zipcache_v1_SessionInfo sessions[2];
	wire_pb_request req;
	wire_pb_response resp[3];
	uint8_t *frames[4];
	size_t lens[4];

	make_inline_request(&req, keys, sizeof(keys), values, sizeof(values));
	frames[0] = encode_request(&req, &lens[0]);
	memset(layers, 0, sizeof(layers));
	memset(sessions, 0, sizeof(sessions));
	for (int i = 0; i < 3; i++)
		fill_layer_stats(&layers[i], (uint32_t)i);
	for (int i = 0; i < 2; i++)
		fill_session_info(&sessions[i], (uint32_t)i);
	response_init(&resp[0], zipcache_v1_Response_stats_tag);
	resp[0].layers = layers;
	resp[0].n_layers = 3;
	resp[0].msg.op.stats.has_session = true;
	fill_session_info(&resp[0].msg.op.stats.session, 5);
	response_init(&resp[1], zipcache_v1_Response_list_sessions_tag);
	resp[1].sessions = sessions;
	resp[1].n_sessions = 2;
	response_init(&resp[2], zipcache_v1_Response_hello_tag);
	strcpy(resp[2].msg.op.hello.server_version, "zipcached 0.1.0");
	for (int i = 0; i < 3; i++)
		frames[i + 1] = encode_response(&resp[i], &lens[i + 1]);

	for (int f = 0; f < 4; f++) {
		const uint8_t *body = frames[f] + 4;
		size_t body_len = lens[f] - 4;

		for (size_t cut = 0; cut < body_len; cut++) {
			uint8_t *copy = malloc(cut ? cut : 1);

			memcpy(copy, body, cut);
			decode_any_request(copy, cut);
			decode_any_response(copy, cut);
			free(copy);
		}
		for (size_t pos = 0; pos < body_len; pos++) {
			uint8_t *copy = malloc(body_len);

			for (int v = 0; v < 8; v++) {
				memcpy(copy, body, body_len);
				copy[pos] = v < 4 ? (uint8_t)(copy[pos] ^ (1u << (v * 2))) : (uint8_t)rng();
				decode_any_request(copy, body_len);
				decode_any_response(copy, body_len);
			}
			free(copy);
		}
		free(frames[f]);
	}
}
END_TEST

/* A cut inside the inline bytes can never succeed. */
START_TEST(malformed_truncated_inline)
{
	uint8_t keys[200], values[200];
	wire_pb_request req, out;
	uint8_t *frame;
	size_t len;

	make_inline_request(&req, keys, sizeof(keys), values, sizeof(values));
	req.msg.request_id = 0; /* so the op submessage is the whole message */
	frame = encode_request(&req, &len);
	for (size_t cut = 1; cut < len - 4; cut++) {
		int rc = wire_pb_request_decode(frame + 4, cut, &out);

		/* Everything lives inside one submessage: any cut breaks it. */
		ck_assert_int_eq(rc, ZC_EPROTOCOL);
		ck_assert_ptr_nonnull(out.error);
	}
	free(frame);
}
END_TEST

/* Hand-made messages with a field sent under the wrong wire type. */
START_TEST(malformed_wrong_wire_types)
{
	wire_pb_request rq;
	wire_pb_response rs;
	/* Request.request_id (varint) sent length-delimited. */
	static const uint8_t id_as_bytes[] = { 0x0a, 0x01, 0x00 };
	/* Request.update_and_fetch { keys: varint 5 } */
	static const uint8_t keys_as_varint[] = { 0x22, 0x02, 0x20, 0x05 };
	/* Request.update_and_fetch { values: fixed32 } */
	static const uint8_t values_as_fixed32[] = { 0x22, 0x05, 0x2d, 1, 2, 3, 4 };
	/* Request.update_and_fetch { keys: fixed64 } */
	static const uint8_t keys_as_fixed64[] = { 0x22, 0x09, 0x21, 1, 2, 3, 4, 5, 6, 7, 8 };
	/* Request.update_and_fetch sent as a varint. */
	static const uint8_t op_as_varint[] = { 0x20, 0x01 };
	/* Wire types 6 and 7 do not exist. */
	static const uint8_t wire_type_6[] = { 0x0e, 0x00 };
	static const uint8_t wire_type_7[] = { 0x0f, 0x00 };
	/* Request.update_and_fetch length past the end. */
	static const uint8_t length_past_end[] = { 0x22, 0x10, 0x08, 0x01 };
	/* Request.update_and_fetch { keys: length past the submessage } */
	static const uint8_t keys_past_sub[] = { 0x22, 0x03, 0x22, 0x05, 0x00, 0x00, 0x00, 0x00 };
	/* Response.stats { layers: varint 1 } */
	static const uint8_t layers_as_varint[] = { 0x7a, 0x02, 0x10, 0x01 };
	/* Response.list_sessions { sessions: fixed64 } */
	static const uint8_t sessions_as_fixed64[] = {
		0x82, 0x01, 0x09, 0x09, 1, 2, 3, 4, 5, 6, 7, 8
	};
	/* Response.status (enum) sent as fixed32. */
	static const uint8_t status_as_fixed32[] = { 0x15, 0, 0, 0, 0 };
	/* Response.message longer than its 256-byte array (declared 300). */
	uint8_t long_message[3 + 300];
	/* An unterminated varint. */
	static const uint8_t endless_varint[] = { 0x08, 0xff, 0xff, 0xff };
	static const uint8_t overlong_varint[] = { 0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
						   0xff, 0xff, 0xff, 0xff, 0xff, 0x01 };

	ck_assert_int_eq(wire_pb_request_decode(id_as_bytes, sizeof(id_as_bytes), &rq), ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(keys_as_varint, sizeof(keys_as_varint), &rq),
			 ZC_EPROTOCOL);
	ck_assert_str_eq(rq.error, "inline keys/values must be length-delimited bytes");
	ck_assert_int_eq(wire_pb_request_decode(values_as_fixed32, sizeof(values_as_fixed32), &rq),
			 ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(keys_as_fixed64, sizeof(keys_as_fixed64), &rq),
			 ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(op_as_varint, sizeof(op_as_varint), &rq), ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(wire_type_6, sizeof(wire_type_6), &rq), ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(wire_type_7, sizeof(wire_type_7), &rq), ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(length_past_end, sizeof(length_past_end), &rq),
			 ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(keys_past_sub, sizeof(keys_past_sub), &rq),
			 ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(endless_varint, sizeof(endless_varint), &rq),
			 ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_request_decode(overlong_varint, sizeof(overlong_varint), &rq),
			 ZC_EPROTOCOL);
	ck_assert_ptr_nonnull(rq.error);

	ck_assert_int_eq(wire_pb_response_decode(layers_as_varint, sizeof(layers_as_varint), &rs),
			 ZC_EPROTOCOL);
	ck_assert_str_eq(rs.error, "repeated message field is not length-delimited");
	ck_assert_int_eq(wire_pb_response_decode(sessions_as_fixed64, sizeof(sessions_as_fixed64),
					      &rs), ZC_EPROTOCOL);
	ck_assert_int_eq(wire_pb_response_decode(status_as_fixed32, sizeof(status_as_fixed32), &rs),
			 ZC_EPROTOCOL);
	long_message[0] = 0x1a;
	long_message[1] = 0xac; /* 300 = 0xac 0x02 */
	long_message[2] = 0x02;
	memset(long_message + 3, 'm', 300);
	ck_assert_int_eq(wire_pb_response_decode(long_message, sizeof(long_message), &rs),
			 ZC_EPROTOCOL);
	ck_assert_ptr_nonnull(rs.error);
}
END_TEST

/*
 * Repeated oneof members. Protobuf merges a repeated member and lets the
 * last one win a switch; the zero-copy capture follows the first two rules
 * and refuses a switch into update_and_fetch (no encoder produces one).
 */
START_TEST(oneof_repeated_and_switched)
{
	wire_pb_request out;
	wire_pb_response rs;
	/* update_and_fetch { keys "AB" } update_and_fetch { layer 3, keys "CDE" } */
	static const uint8_t merged[] = { 0x22, 0x04, 0x22, 0x02, 'A', 'B',
					  0x22, 0x07, 0x10, 0x03, 0x22, 0x03, 'C', 'D', 'E' };
	/* hello { } update_and_fetch { keys "AB" } */
	static const uint8_t switched_in[] = { 0x12, 0x00, 0x22, 0x04, 0x22, 0x02, 'A', 'B' };
	/* update_and_fetch { keys "AB" } hello { protocol_version 1 } */
	static const uint8_t switched_out[] = { 0x22, 0x04, 0x22, 0x02, 'A', 'B',
						0x12, 0x02, 0x08, 0x01 };
	/* Response: stats { layers {} } stats { layers { layer 2 } } */
	static const uint8_t stats_merged[] = { 0x7a, 0x02, 0x12, 0x00,
						0x7a, 0x04, 0x12, 0x02, 0x08, 0x02 };
	/* Response: hello { } stats { layers {} } */
	static const uint8_t stats_switched_in[] = { 0x52, 0x00, 0x7a, 0x02, 0x12, 0x00 };

	ck_assert_int_eq(wire_pb_request_decode(merged, sizeof(merged), &out), 0);
	ck_assert_uint_eq(out.msg.which_op, zipcache_v1_Request_update_and_fetch_tag);
	ck_assert_uint_eq(out.msg.op.update_and_fetch.layer, 3);
	ck_assert_uint_eq(out.keys.len, 3);
	ck_assert_ptr_eq(out.keys.data, merged + 12);
	ck_assert_ptr_null(out.values.data);

	ck_assert_int_eq(wire_pb_request_decode(switched_in, sizeof(switched_in), &out), ZC_EPROTOCOL);
	ck_assert_str_eq(out.error, "another op precedes update_and_fetch in the request");

	ck_assert_int_eq(wire_pb_request_decode(switched_out, sizeof(switched_out), &out), 0);
	ck_assert_uint_eq(out.msg.which_op, zipcache_v1_Request_hello_tag);
	ck_assert_uint_eq(out.msg.op.hello.protocol_version, 1);
	ck_assert_ptr_null(out.keys.data);

	ck_assert_int_eq(wire_pb_response_decode(stats_merged, sizeof(stats_merged), &rs), 0);
	ck_assert_uint_eq(rs.n_layers, 2);
	ck_assert_uint_eq(rs.layers[0].layer, 0);
	ck_assert_uint_eq(rs.layers[1].layer, 2);
	wire_pb_response_free(&rs);

	ck_assert_int_eq(wire_pb_response_decode(stats_switched_in, sizeof(stats_switched_in), &rs),
			 ZC_EPROTOCOL);
	ck_assert_ptr_null(rs.layers);
}
END_TEST

/* Frames from a stream of responses, pipelined, through one reader. */
START_TEST(responses_through_frame_reader)
{
	zipcache_v1_LayerStats layers[5];
	wire_pb_response resp, out;
	frame_reader r;
	uint8_t *stream = NULL;
	size_t stream_len = 0;

	memset(layers, 0, sizeof(layers));
	for (int i = 0; i < 5; i++)
		fill_layer_stats(&layers[i], (uint32_t)i);
	for (int i = 0; i < 20; i++) {
		uint8_t *frame;
		size_t len;

		response_init(&resp, zipcache_v1_Response_stats_tag);
		resp.msg.request_id = (uint64_t)i;
		resp.layers = layers;
		resp.n_layers = (size_t)i % 6;
		frame = encode_response(&resp, &len);
		stream = realloc(stream, stream_len + len);
		memcpy(stream + stream_len, frame, len);
		stream_len += len;
		free(frame);
	}
	frame_reader_init(&r, 1 << 16);
	ck_assert_int_eq(frame_reader_feed(&r, stream, stream_len), 0);
	for (int i = 0; i < 20; i++) {
		const uint8_t *body;
		size_t len;

		ck_assert_int_eq(frame_reader_next(&r, &body, &len), 1);
		ck_assert_int_eq(wire_pb_response_decode(body, len, &out), 0);
		ck_assert_uint_eq(out.msg.request_id, (uint64_t)i);
		ck_assert_uint_eq(out.n_layers, (size_t)i % 6);
		if (out.n_layers)
			ck_assert_mem_eq(out.layers, layers, out.n_layers * sizeof(layers[0]));
		wire_pb_response_free(&out);
		frame_reader_consume(&r);
	}
	frame_reader_free(&r);
	free(stream);
}
END_TEST

START_TEST(status_mapping)
{
	static const struct {
		int error;
		zipcache_v1_Status status;
	} to_status[] = {
		{ 0, zipcache_v1_Status_OK },
		{ 7, zipcache_v1_Status_OK },
		{ ZC_EINVALID, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_EBITS, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_EFRACTION, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_EGROUPSIZE, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_ESHAPE, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_ENONFINITE, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_ETENSOR, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_EPROTOCOL, zipcache_v1_Status_INVALID_ARGUMENT },
		{ ZC_ENOTFOUND, zipcache_v1_Status_NOT_FOUND },
		{ ZC_EEXISTS, zipcache_v1_Status_ALREADY_EXISTS },
		{ ZC_EEXHAUSTED, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ ZC_EFRAMESIZE, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -ENOMEM, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -ENOSPC, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -EMFILE, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -ENFILE, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -EAGAIN, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ -ENOBUFS, zipcache_v1_Status_RESOURCE_EXHAUSTED },
		{ ZC_EDENIED, zipcache_v1_Status_PERMISSION_DENIED },
		{ ZC_EPRECONDITION, zipcache_v1_Status_FAILED_PRECONDITION },
		{ ZC_EINTERNAL, zipcache_v1_Status_INTERNAL },
		{ ZC_ECORRUPT, zipcache_v1_Status_DATA_LOSS },
		{ ZC_EREMOTE, zipcache_v1_Status_UNAVAILABLE },
		{ -ETIMEDOUT, zipcache_v1_Status_INTERNAL },
		{ ZC_EBUFFER, zipcache_v1_Status_INTERNAL },
		{ ZC_ERESTARTED, zipcache_v1_Status_INTERNAL },
		{ -EIO, zipcache_v1_Status_INTERNAL },
		{ -EINVAL, zipcache_v1_Status_INTERNAL },
		{ -1, zipcache_v1_Status_INTERNAL },
		{ INT32_MIN, zipcache_v1_Status_INTERNAL },
	};
	static const struct {
		zipcache_v1_Status status;
		int error;
	} to_error[] = {
		{ zipcache_v1_Status_OK, 0 },
		{ zipcache_v1_Status_INVALID_ARGUMENT, ZC_EINVALID },
		{ zipcache_v1_Status_NOT_FOUND, ZC_ENOTFOUND },
		{ zipcache_v1_Status_ALREADY_EXISTS, ZC_EEXISTS },
		{ zipcache_v1_Status_RESOURCE_EXHAUSTED, ZC_EEXHAUSTED },
		{ zipcache_v1_Status_PERMISSION_DENIED, ZC_EDENIED },
		{ zipcache_v1_Status_FAILED_PRECONDITION, ZC_EPRECONDITION },
		{ zipcache_v1_Status_INTERNAL, ZC_EINTERNAL },
		{ zipcache_v1_Status_DATA_LOSS, ZC_ECORRUPT },
		{ zipcache_v1_Status_UNAVAILABLE, ZC_EREMOTE },
		{ (zipcache_v1_Status)10, ZC_EINTERNAL },
		{ (zipcache_v1_Status)1000, ZC_EINTERNAL },
	};

	for (size_t i = 0; i < sizeof(to_status) / sizeof(to_status[0]); i++)
		ck_assert_msg(wire_pb_status_from_error(to_status[i].error) == to_status[i].status,
			      "error %d", to_status[i].error);
	for (size_t i = 0; i < sizeof(to_error) / sizeof(to_error[0]); i++)
		ck_assert_int_eq(wire_pb_error_from_status(to_error[i].status), to_error[i].error);
	/* Every status survives the round trip through its error code. */
	for (int s = _zipcache_v1_Status_MIN; s <= _zipcache_v1_Status_MAX; s++)
		ck_assert_int_eq(wire_pb_status_from_error(wire_pb_error_from_status((zipcache_v1_Status)s)),
				 s);
}
END_TEST

/* An unknown status from a newer daemon decodes and maps to ZC_EINTERNAL. */
START_TEST(unknown_status_value)
{
	static const uint8_t bytes[] = { 0x10, 0x2a }; /* status: 42 */
	wire_pb_response out;

	ck_assert_int_eq(wire_pb_response_decode(bytes, sizeof(bytes), &out), 0);
	ck_assert_int_eq(out.msg.status, 42);
	ck_assert_int_eq(wire_pb_error_from_status(out.msg.status), ZC_EINTERNAL);
}
END_TEST

START_TEST(set_status_message)
{
	wire_pb_response resp;
	char msg[300];

	response_init(&resp, 0);
	wire_pb_response_set_status(&resp, ZC_EBITS, "hi_bits must be 1..8");
	ck_assert_int_eq(resp.msg.status, zipcache_v1_Status_INVALID_ARGUMENT);
	ck_assert_str_eq(resp.msg.message, "hi_bits must be 1..8");

	wire_pb_response_set_status(&resp, 0, NULL);
	ck_assert_int_eq(resp.msg.status, zipcache_v1_Status_OK);
	ck_assert_str_eq(resp.msg.message, "");

	/* 256 bytes fit exactly. */
	memset(msg, 'a', 256);
	msg[256] = '\0';
	wire_pb_response_set_status(&resp, ZC_EINTERNAL, msg);
	ck_assert_uint_eq(strlen(resp.msg.message), 256);

	/* A 2-byte character straddling the limit is dropped whole. */
	memset(msg, 'a', 255);
	memcpy(msg + 255, "\xc3\xa9tail", 7);
	wire_pb_response_set_status(&resp, ZC_EINTERNAL, msg);
	ck_assert_uint_eq(strlen(resp.msg.message), 255);

	/* A 3-byte character ending exactly at the limit is kept. */
	memset(msg, 'a', 253);
	memcpy(msg + 253, "\xe2\x82\xac" "more", 8);
	wire_pb_response_set_status(&resp, ZC_EINTERNAL, msg);
	ck_assert_uint_eq(strlen(resp.msg.message), 256);
	ck_assert_mem_eq(resp.msg.message + 253, "\xe2\x82\xac", 3);

	/* And one cut after its first byte goes away whole. */
	memset(msg, 'a', 255);
	memcpy(msg + 255, "\xe2\x82\xac", 4);
	wire_pb_response_set_status(&resp, ZC_EINTERNAL, msg);
	ck_assert_uint_eq(strlen(resp.msg.message), 255);
}
END_TEST

/* ---- hand-made requests (tests/pb_bytes.h) ---- */

/* Request { request_id: id, open_session: open } */
static void open_request(struct pb_bytes *out, uint64_t id, const struct pb_bytes *open)
{
	memset(out, 0, sizeof(*out));
	pb_field_varint(out, zipcache_v1_Request_request_id_tag, id);
	pb_field_message(out, zipcache_v1_Request_open_session_tag, open);
}

/* Decodes and expects a refusal that kept the id and says exactly why. */
static void expect_refused(const struct pb_bytes *b, uint64_t id, const char *why)
{
	wire_pb_request out;

	ck_assert_int_eq(wire_pb_request_decode(b->data, b->len, &out), ZC_EPROTOCOL);
	ck_assert_ptr_nonnull(out.error);
	ck_assert_str_eq(out.error, why);
	ck_assert_uint_eq(out.msg.request_id, id);
	ck_assert_uint_eq(out.msg.which_op, 0);
}

/*
 * What an independent protobuf client found: over-long names and enum
 * values nanopb cannot store were refused with request id 0 and no word of
 * the limit, and a NUL inside a name cut it short in silence ("a\0x"
 * named the session "a"). Each is now refused, naming field and limit,
 * with the request's own id.
 */
START_TEST(refusals_keep_the_id_and_name_the_limit)
{
	struct pb_bytes open, req, shape;
	char name[80];

	/* 80-byte name: nanopb says only "string overflow". */
	memset(name, 'n', sizeof(name));
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, name, 80);
	open_request(&req, 77, &open);
	expect_refused(&req, 77, "open_session.name is 80 bytes; the limit is 64");

	/* 65 bytes is one too many; 64 is fine. */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, name, 65);
	open_request(&req, 78, &open);
	expect_refused(&req, 78, "open_session.name is 65 bytes; the limit is 64");
	{
		wire_pb_request out;
		memset(&open, 0, sizeof(open));
		pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, name, 64);
		open_request(&req, 79, &open);
		ck_assert_int_eq(wire_pb_request_decode(req.data, req.len, &out), 0);
		ck_assert_uint_eq(strlen(out.msg.op.open_session.name), 64);
		ck_assert_uint_eq(out.msg.request_id, 79);
	}

	/* The id may come after the bad field: the walk goes on past it. */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, name, 80);
	memset(&req, 0, sizeof(req));
	pb_field_message(&req, zipcache_v1_Request_open_session_tag, &open);
	pb_field_varint(&req, zipcache_v1_Request_request_id_tag, 5);
	expect_refused(&req, 5, "open_session.name is 80 bytes; the limit is 64");

	/* Embedded NUL: "a\0x" must not become "a". */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, "a\0x", 3);
	open_request(&req, 80, &open);
	expect_refused(&req, 80, "open_session.name has a NUL byte at offset 1; text may not contain NUL");
	/* A trailing NUL too: "a\0" is not "a". */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, "a\0", 2);
	open_request(&req, 81, &open);
	expect_refused(&req, 81, "open_session.name has a NUL byte at offset 1; text may not contain NUL");
	/* The hello's client name is text as well. */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_HelloRequest_client_name_tag, "\0", 1);
	memset(&req, 0, sizeof(req));
	pb_field_varint(&req, zipcache_v1_Request_request_id_tag, 82);
	pb_field_message(&req, zipcache_v1_Request_hello_tag, &open);
	expect_refused(&req, 82, "hello.client_name has a NUL byte at offset 0; text may not contain NUL");

	/* policy -1 as a proto3 encoder sends it (ten bytes, sign-extended):
	 * more than nanopb's 32-bit enum holds. */
	memset(&open, 0, sizeof(open));
	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, "p", 1);
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_policy_tag, UINT64_MAX);
	open_request(&req, 83, &open);
	expect_refused(&req, 83, "open_session.policy is -1; it must be 0 (STREAMING) or 1 (PER_CALL)");
	/* One nanopb stores but the enum does not define. */
	memset(&open, 0, sizeof(open));
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_policy_tag, 7);
	open_request(&req, 84, &open);
	expect_refused(&req, 84, "open_session.policy is 7; it must be 0 (STREAMING) or 1 (PER_CALL)");
	/* Past 32 bits as an unsigned value. */
	memset(&open, 0, sizeof(open));
	pb_field_varint(&open, zipcache_v1_OpenSessionRequest_policy_tag, 1ull << 32);
	open_request(&req, 85, &open);
	expect_refused(&req, 85, "open_session.policy is 4294967296; it must be 0 (STREAMING) or 1 (PER_CALL)");

	/* A uint32 inside a nested message. */
	memset(&shape, 0, sizeof(shape));
	pb_field_varint(&shape, zipcache_v1_SessionShape_layers_tag, 1ull << 32);
	memset(&open, 0, sizeof(open));
	pb_field_message(&open, zipcache_v1_OpenSessionRequest_shape_tag, &shape);
	open_request(&req, 86, &open);
	expect_refused(&req, 86, "open_session.shape.layers is 4294967296; the limit is 4294967295");

	/* And in another op. */
	memset(&open, 0, sizeof(open));
	pb_field_varint(&open, zipcache_v1_UpdateAndFetchRequest_tokens_tag, 1ull << 40);
	memset(&req, 0, sizeof(req));
	pb_field_varint(&req, zipcache_v1_Request_request_id_tag, 87);
	pb_field_message(&req, zipcache_v1_Request_update_and_fetch_tag, &open);
	expect_refused(&req, 87, "update_and_fetch.tokens is 1099511627776; the limit is 4294967295");

	/* A structural break before the id: nothing after it can be read. */
	memset(&req, 0, sizeof(req));
	pb_varint(&req, 0x0e);  /* wire type 6 */
	pb_field_varint(&req, zipcache_v1_Request_request_id_tag, 88);
	{
		wire_pb_request out;
		ck_assert_int_eq(wire_pb_request_decode(req.data, req.len, &out), ZC_EPROTOCOL);
		ck_assert_uint_eq(out.msg.request_id, 0);
		ck_assert_ptr_nonnull(out.error);
	}
	/* ...but an id before it is kept. */
	memset(&req, 0, sizeof(req));
	pb_field_varint(&req, zipcache_v1_Request_request_id_tag, 89);
	pb_varint(&req, 0x0e);
	{
		wire_pb_request out;
		ck_assert_int_eq(wire_pb_request_decode(req.data, req.len, &out), ZC_EPROTOCOL);
		ck_assert_uint_eq(out.msg.request_id, 89);
	}

	/* Valid open requests with every string and enum still decode. */
	{
		wire_pb_request in, out;
		uint8_t frame[512];
		size_t len;

		ZERO(in);
		in.msg.request_id = 90;
		in.msg.which_op = zipcache_v1_Request_open_session_tag;
		strcpy(in.msg.op.open_session.name, "worker/λ");
		in.msg.op.open_session.policy = zipcache_v1_BlockPolicy_PER_CALL;
		ck_assert_int_eq(wire_pb_request_encode(&in, frame, sizeof(frame), &len), 0);
		ck_assert_int_eq(wire_pb_request_decode(frame + 4, len - 4, &out), 0);
		ck_assert_ptr_null(out.error);
		ck_assert_str_eq(out.msg.op.open_session.name, "worker/λ");
		ck_assert_int_eq(out.msg.op.open_session.policy, zipcache_v1_BlockPolicy_PER_CALL);
	}
}
END_TEST

/* ---- the plain structs of wire.h: the same bytes as the generated ones ---- */

/* A plain open request and the generated one a client used to fill by
 * hand encode to the same frame, and the plain decode gives it back. */
START_TEST(plain_request_same_bytes)
{
	uint8_t a[1024], b[1024];
	size_t la, lb;
	wire_request plain = { .request_id = 77, .op = WIRE_OP_OPEN_SESSION };
	zc_codec_config config = { .hi_bits = 5, .lo_bits = 3, .hi_fraction = 0.25, .group_size = 16,
				   .quantize_values = false, .saliency = ZC_SALIENCY_ATTENTION };
	wire_pb_request pb = { 0 };

	snprintf(plain.open_session.name, sizeof(plain.open_session.name), "plain");
	plain.open_session.has_shape = true;
	plain.open_session.shape = (struct wire_shape){ 3, 1, 2, 64, 32 };
	plain.open_session.max_tokens = 4096;
	plain.open_session.has_codec = true;
	wire_codec_from_config(&config, &plain.open_session.codec);
	plain.open_session.policy = ZC_POLICY_PER_CALL;
	plain.open_session.has_residual_tokens = true;
	plain.open_session.residual_tokens = 64;
	plain.open_session.attach = true;

	pb.msg.request_id = 77;
	pb.msg.which_op = zipcache_v1_Request_open_session_tag;
	zipcache_v1_OpenSessionRequest *o = &pb.msg.op.open_session;
	snprintf(o->name, sizeof(o->name), "plain");
	o->has_shape = true;
	o->shape = (zipcache_v1_SessionShape){ 3, 1, 2, 64, 32 };
	o->max_tokens = 4096;
	o->has_codec = true;
	o->codec = (zipcache_v1_CodecConfig){ true, 5, true, 3, true, 0.25, true, 16, true, false,
					      true, zipcache_v1_Saliency_SALIENCY_ATTENTION };
	o->policy = zipcache_v1_BlockPolicy_PER_CALL;
	o->has_residual_tokens = true;
	o->residual_tokens = 64;
	o->attach = true;

	ck_assert_int_eq(wire_request_encode(&plain, a, sizeof(a), &la), 0);
	ck_assert_int_eq(wire_pb_request_encode(&pb, b, sizeof(b), &lb), 0);
	ck_assert_uint_eq(la, lb);
	ck_assert(memcmp(a, b, la) == 0);

	wire_request back;
	ck_assert_int_eq(wire_request_decode(a + FRAME_HEADER_BYTES, la - FRAME_HEADER_BYTES, &back), 0);
	ck_assert_int_eq(back.op, WIRE_OP_OPEN_SESSION);
	ck_assert_uint_eq(back.request_id, 77);
	ck_assert_str_eq(back.open_session.name, "plain");
	ck_assert_uint_eq(back.open_session.shape.head_dim_k, 64);
	zc_codec_config again;
	zc_codec_config_default(&again);
	wire_codec_to_config(&back.open_session.codec, &again);
	/* Field by field: the struct has padding memcmp would compare. */
	ck_assert(again.hi_bits == config.hi_bits && again.lo_bits == config.lo_bits &&
		  again.hi_fraction == config.hi_fraction && again.group_size == config.group_size &&
		  again.quantize_values == config.quantize_values &&
		  again.saliency == ZC_SALIENCY_ATTENTION);
	ck_assert_int_eq(back.open_session.policy, ZC_POLICY_PER_CALL);
	ck_assert(back.open_session.attach);
}
END_TEST

/* omit_stats travels as an optional field: absent means false (older
 * clients keep their stats), present and true decodes as true. */
START_TEST(request_omit_stats)
{
	uint8_t frame[256];
	size_t len;
	wire_request plain = { .request_id = 9, .op = WIRE_OP_UPDATE_AND_FETCH };
	wire_request back;

	plain.update_and_fetch.session_id = 3;
	plain.update_and_fetch.tokens = 1;
	plain.update_and_fetch.staged = true;
	ck_assert_int_eq(wire_request_encode(&plain, frame, sizeof(frame), &len), 0);
	size_t without = len;
	ck_assert_int_eq(wire_request_decode(frame + FRAME_HEADER_BYTES, len - FRAME_HEADER_BYTES,
					     &back), 0);
	ck_assert(!back.update_and_fetch.omit_stats);

	plain.update_and_fetch.omit_stats = true;
	ck_assert_int_eq(wire_request_encode(&plain, frame, sizeof(frame), &len), 0);
	ck_assert_uint_eq(len, without + 2);
	ck_assert_int_eq(wire_request_decode(frame + FRAME_HEADER_BYTES, len - FRAME_HEADER_BYTES,
					     &back), 0);
	ck_assert(back.update_and_fetch.omit_stats);
	ck_assert_uint_eq(back.update_and_fetch.session_id, 3);
}
END_TEST

/* Fills r[0..n) from an xorshift64 generator: fixed sweeps, same every run. */
static void random_words(uint64_t *state, uint64_t *r, int n)
{
	for (int j = 0; j < n; j++) {
		*state ^= *state << 13;
		*state ^= *state >> 7;
		*state ^= *state << 17;
		r[j] = *state;
	}
}

/* Field values at every edge of a varint's length, zero included. */
static const uint64_t sweep_values[8] = { 0, 1, 127, 128, 16383, 16384, 1ull << 35, UINT64_MAX };

/*
 * A random update request for the hand-coded paths' sweeps: every field
 * from sweep_values (or both booleans), keys, values and attention masses
 * spans of data + 0, + 1 and + 2 with lengths from lens (data holds the
 * longest plus 2), a chunk key absent, whole or short.
 */
static void random_update(wire_request *req, uint64_t *state, const uint8_t *data,
			  const size_t *lens, size_t n_lens)
{
	uint64_t r[11];
	random_words(state, r, 11);
	*req = (wire_request){ .request_id = sweep_values[r[0] % 8], .op = WIRE_OP_UPDATE_AND_FETCH };
	struct wire_update_request *u = &req->update_and_fetch;
	u->session_id = sweep_values[r[1] % 8];
	u->layer = (uint32_t)sweep_values[r[2] % 8];
	u->tokens = (uint32_t)sweep_values[r[3] % 8];
	u->keys = (wire_span){ data, lens[r[4] % n_lens] };
	u->values = (wire_span){ data + 1, lens[r[5] % n_lens] };
	u->staged = r[6] & 1;
	u->keys_offset = sweep_values[(r[6] >> 1) % 8];
	u->values_offset = sweep_values[(r[6] >> 8) % 8];
	u->omit_stats = r[7] & 1;
	u->chunk_key_len = (uint32_t)((r[7] >> 1) % 3 == 0 ? 0 : (r[7] >> 1) % 3 == 1 ?
				     ZC_CHUNK_KEY_BYTES : 5);
	for (uint32_t k = 0; k < ZC_CHUNK_KEY_BYTES; k++)
		u->chunk_key[k] = (uint8_t)(r[8] >> (k % 8));
	u->attention_mass = (wire_span){ data + 2, lens[r[9] % n_lens] / 4 * 4 };
	u->mass_first_token = (uint32_t)sweep_values[r[10] % 8];
}

/* The update request is encoded by hand (its hot path): over a sweep of
 * field values, zero ones included, its bytes are nanopb's, its size is
 * what frame_size says, it decodes to what went in, and one byte less of
 * room is ZC_EBUFFER. */
START_TEST(update_request_same_bytes_as_nanopb)
{
	static uint8_t data[20000 + 2], a[70000], b[70000];
	static const size_t lens[] = { 0, 1, 127, 128, 4096, 16384, 20000 };
	uint64_t state = 0x9e3779b97f4a7c15ull;

	for (size_t i = 0; i < sizeof(data); i++)
		data[i] = (uint8_t)(i * 7 + 1);
	for (int round = 0; round < 2000; round++) {
		wire_request plain;
		random_update(&plain, &state, data, lens, sizeof(lens) / sizeof(lens[0]));
		const struct wire_update_request *u = &plain.update_and_fetch;

		wire_pb_request pb = { 0 };
		pb.msg.request_id = plain.request_id;
		pb.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
		zipcache_v1_UpdateAndFetchRequest *p = &pb.msg.op.update_and_fetch;
		p->session_id = u->session_id;
		p->layer = u->layer;
		p->tokens = u->tokens;
		p->staged = u->staged;
		p->keys_offset = u->keys_offset;
		p->values_offset = u->values_offset;
		p->has_omit_stats = u->omit_stats;
		p->omit_stats = u->omit_stats;
		p->chunk_key.size = (pb_size_t)u->chunk_key_len;
		memcpy(p->chunk_key.bytes, u->chunk_key, u->chunk_key_len);
		p->mass_first_token = u->mass_first_token;
		pb.keys = u->keys;
		pb.values = u->values;
		pb.attention_mass = u->attention_mass;

		size_t la, lb, size;
		ck_assert_int_eq(wire_request_encode(&plain, a, sizeof(a), &la), 0);
		ck_assert_int_eq(wire_pb_request_encode(&pb, b, sizeof(b), &lb), 0);
		ck_assert_msg(la == lb && memcmp(a, b, la) == 0,
			      "round %d: the hand encoding differs from nanopb's (%zu vs %zu bytes)",
			      round, la, lb);
		ck_assert_int_eq(wire_request_frame_size(&plain, &size), 0);
		ck_assert_uint_eq(size, la);
		ck_assert_int_eq(wire_request_encode(&plain, a, la - 1, &lb), ZC_EBUFFER);
		ck_assert_int_eq(wire_request_encode(&plain, a, la, &lb), 0);

		wire_request back;
		ck_assert_int_eq(wire_request_decode(a + FRAME_HEADER_BYTES, la - FRAME_HEADER_BYTES,
						     &back), 0);
		ck_assert_int_eq(back.op, WIRE_OP_UPDATE_AND_FETCH);
		ck_assert_uint_eq(back.request_id, plain.request_id);
		ck_assert_uint_eq(back.update_and_fetch.session_id, u->session_id);
		ck_assert_uint_eq(back.update_and_fetch.layer, u->layer);
		ck_assert_uint_eq(back.update_and_fetch.tokens, u->tokens);
		ck_assert_uint_eq(back.update_and_fetch.keys.len, u->keys.len);
		ck_assert(u->keys.len == 0 ||
			  memcmp(back.update_and_fetch.keys.data, u->keys.data, u->keys.len) == 0);
		ck_assert_uint_eq(back.update_and_fetch.values.len, u->values.len);
		ck_assert(u->values.len == 0 ||
			  memcmp(back.update_and_fetch.values.data, u->values.data, u->values.len) == 0);
		ck_assert_int_eq(back.update_and_fetch.staged, u->staged);
		ck_assert_uint_eq(back.update_and_fetch.keys_offset, u->keys_offset);
		ck_assert_uint_eq(back.update_and_fetch.values_offset, u->values_offset);
		ck_assert_int_eq(back.update_and_fetch.omit_stats, u->omit_stats);
		ck_assert_uint_eq(back.update_and_fetch.chunk_key_len, u->chunk_key_len);
		ck_assert_uint_eq(back.update_and_fetch.attention_mass.len, u->attention_mass.len);
		ck_assert_uint_eq(back.update_and_fetch.mass_first_token, u->mass_first_token);
	}
}
END_TEST

/* wire_request_decode's result for a frame against nanopb's own decode
 * of it (wire_pb_request_decode): the same verdict and, for an update,
 * the same fields (spans pointing at the same bytes). */
static void decode_matches_nanopb(const uint8_t *body, size_t len, const char *what, int round)
{
	wire_request plain;
	wire_pb_request pb;
	int fast = wire_request_decode(body, len, &plain);
	int slow = wire_pb_request_decode(body, len, &pb);

	ck_assert_msg((fast < 0) == (slow < 0), "%s %d: decode says %d, nanopb %d", what, round,
		      fast, slow);
	if (slow < 0) {
		ck_assert_int_eq(plain.op, WIRE_OP_NONE);
		return;
	}
	ck_assert_uint_eq(plain.request_id, pb.msg.request_id);
	if (pb.msg.which_op != zipcache_v1_Request_update_and_fetch_tag) {
		ck_assert_int_ne(plain.op, WIRE_OP_UPDATE_AND_FETCH);
		return;
	}
	const zipcache_v1_UpdateAndFetchRequest *p = &pb.msg.op.update_and_fetch;
	const struct wire_update_request *u = &plain.update_and_fetch;
	ck_assert_int_eq(plain.op, WIRE_OP_UPDATE_AND_FETCH);
	ck_assert_msg(u->session_id == p->session_id && u->layer == p->layer &&
		      u->tokens == p->tokens && u->staged == p->staged &&
		      u->keys_offset == p->keys_offset && u->values_offset == p->values_offset &&
		      u->omit_stats == (p->has_omit_stats && p->omit_stats) &&
		      u->mass_first_token == p->mass_first_token &&
		      u->chunk_key_len == p->chunk_key.size &&
		      memcmp(u->chunk_key, p->chunk_key.bytes, p->chunk_key.size) == 0,
		      "%s %d: a field decodes differently from nanopb", what, round);
	ck_assert_msg(u->keys.data == pb.keys.data && u->keys.len == pb.keys.len &&
		      u->values.data == pb.values.data && u->values.len == pb.values.len &&
		      u->attention_mass.data == pb.attention_mass.data &&
		      u->attention_mass.len == pb.attention_mass.len,
		      "%s %d: an inline span differs from nanopb's", what, round);
}

/* The update request is decoded by hand too: canonical frames of every
 * field mix, and the same frames with bytes changed or cut, decode as
 * nanopb decodes them (the hand path leaves whatever it does not expect
 * to nanopb). */
START_TEST(update_request_decode_matches_nanopb)
{
	static uint8_t data[300 + 2], frame[2048];
	static const size_t lens[] = { 0, 1, 16, 127, 128, 300 };
	uint64_t state = 0x2545f4914f6cdd1dull;

	for (size_t i = 0; i < sizeof(data); i++)
		data[i] = (uint8_t)(i * 31 + 3);
	for (int round = 0; round < 3000; round++) {
		wire_request req;
		uint64_t m[3]; /* where to cut, where and how to change */
		random_update(&req, &state, data, lens, sizeof(lens) / sizeof(lens[0]));
		random_words(&state, m, 3);
		size_t len;
		ck_assert_int_eq(wire_request_encode(&req, frame, sizeof(frame), &len), 0);
		uint8_t *body = frame + FRAME_HEADER_BYTES;
		size_t body_len = len - FRAME_HEADER_BYTES;

		decode_matches_nanopb(body, body_len, "canonical", round);
		/* Cut anywhere. */
		decode_matches_nanopb(body, (size_t)(m[0] % body_len), "cut", round);
		/* One to three bytes changed. */
		uint8_t saved[3];
		size_t at[3];
		unsigned changes = 1 + (unsigned)(m[1] % 3);
		for (unsigned c = 0; c < changes; c++) {
			at[c] = (size_t)((m[1] >> (8 + 16 * c)) % body_len);
			saved[c] = body[at[c]];
			body[at[c]] = (uint8_t)(m[2] >> (8 * c));
		}
		decode_matches_nanopb(body, body_len, "changed", round);
		for (unsigned c = changes; c-- > 0;)
			body[at[c]] = saved[c];
	}
}
END_TEST

/* The stat-less update reply, encoded and decoded by hand: nanopb's bytes
 * for every field mix, and nanopb's verdict and fields for those frames
 * cut or with bytes changed. */
START_TEST(update_response_matches_nanopb)
{
	uint64_t state = 0x853c49e6748fea9bull;
	uint8_t a[256], b[256];

	for (int round = 0; round < 4000; round++) {
		uint64_t r[4];
		random_words(&state, r, 4);
		wire_response plain;
		wire_response_init(&plain, sweep_values[r[0] % 8], WIRE_OP_UPDATE_AND_FETCH);
		plain.status = (int)((r[0] >> 8) % 4 == 0 ? (r[0] >> 12) % 20 : 0);
		plain.fds = (uint32_t)sweep_values[(r[0] >> 16) % 8];
		plain.update_and_fetch.tokens = (uint32_t)sweep_values[(r[0] >> 24) % 8];
		plain.update_and_fetch.sequence = sweep_values[(r[0] >> 32) % 8];

		wire_pb_response pb;
		memset(&pb, 0, sizeof(pb));
		pb.msg.request_id = plain.request_id;
		pb.msg.status = (zipcache_v1_Status)plain.status;
		pb.msg.fds = plain.fds;
		pb.msg.which_op = zipcache_v1_Response_update_and_fetch_tag;
		pb.msg.op.update_and_fetch.tokens = plain.update_and_fetch.tokens;
		pb.msg.op.update_and_fetch.sequence = plain.update_and_fetch.sequence;

		size_t la, lb, size;
		ck_assert_int_eq(wire_response_encode(&plain, a, sizeof(a), &la), 0);
		ck_assert_int_eq(wire_pb_response_encode(&pb, b, sizeof(b), &lb), 0);
		ck_assert_msg(la == lb && memcmp(a, b, la) == 0,
			      "round %d: the hand-encoded reply differs from nanopb's", round);
		ck_assert_int_eq(wire_response_frame_size(&plain, &size), 0);
		ck_assert_uint_eq(size, la);
		ck_assert_int_eq(wire_response_encode(&plain, a, la - 1, &lb), ZC_EBUFFER);

		uint8_t *body = a + FRAME_HEADER_BYTES;
		size_t body_len = la - FRAME_HEADER_BYTES;
		for (int variant = 0; variant < 3; variant++) {
			size_t n = body_len;
			size_t at = (size_t)(r[1] % body_len);
			uint8_t saved = body[at];
			if (variant == 1)
				n = (size_t)(r[2] % body_len);
			if (variant == 2)
				body[at] = (uint8_t)r[3];
			wire_response plain_back;
			wire_pb_response pb_back;
			int fast = wire_response_decode(body, n, &plain_back);
			int slow = wire_pb_response_decode(body, n, &pb_back);
			body[at] = saved;
			ck_assert_msg((fast < 0) == (slow < 0), "round %d variant %d: %d against nanopb's %d",
				      round, variant, fast, slow);
			if (slow == 0) {
				ck_assert_uint_eq(plain_back.request_id, pb_back.msg.request_id);
				ck_assert_int_eq(plain_back.status, (int)pb_back.msg.status);
				ck_assert_uint_eq(plain_back.fds, pb_back.msg.fds);
				ck_assert_str_eq(plain_back.message, pb_back.msg.message);
				if (pb_back.msg.which_op == zipcache_v1_Response_update_and_fetch_tag) {
					const zipcache_v1_UpdateAndFetchResponse *u =
						&pb_back.msg.op.update_and_fetch;
					ck_assert_int_eq(plain_back.op, WIRE_OP_UPDATE_AND_FETCH);
					ck_assert_uint_eq(plain_back.update_and_fetch.tokens, u->tokens);
					ck_assert_uint_eq(plain_back.update_and_fetch.sequence, u->sequence);
					ck_assert_int_eq(plain_back.update_and_fetch.has_stats, u->has_stats);
				} else {
					ck_assert_int_ne(plain_back.op, WIRE_OP_UPDATE_AND_FETCH);
				}
				wire_pb_response_free(&pb_back);
			}
			wire_response_free(&plain_back);
		}
	}
}
END_TEST

/* A stats reply with its layer list: the plain encode is the generated
 * one's bytes, and decoding it gives the plain structs back. */
START_TEST(plain_response_same_bytes)
{
	static wire_response plain;
	static wire_pb_response pb;
	zc_layer_stats layers[2] = {
		{ .layer = 0, .tokens = 10, .compressed_key_bytes = 100, .fp16_key_bytes = 400,
		  .compression_ratio = 4.0, .effective_avg_bits = 4.0, .blocks = 1 },
		{ .layer = 1, .tokens = 12, .residual_tokens = 2, .fp16_value_bytes = 48 },
	};
	zipcache_v1_LayerStats pb_layers[2] = {
		{ .layer = 0, .tokens = 10, .compressed_key_bytes = 100, .fp16_key_bytes = 400,
		  .compression_ratio = 4.0, .effective_avg_bits = 4.0, .blocks = 1 },
		{ .layer = 1, .tokens = 12, .residual_tokens = 2, .fp16_value_bytes = 48 },
	};
	uint8_t a[4096], b[4096];
	size_t la, lb;

	wire_response_init(&plain, 9, WIRE_OP_STATS);
	plain.stats.has_caller = true;
	plain.stats.caller.uid = 1000;
	plain.stats.sessions = 3;
	plain.stats.set_aside_count = 1;
	snprintf(plain.stats.set_aside[0].file, sizeof(plain.stats.set_aside[0].file), "x.zcs");
	plain.stats.set_aside_total = 1;
	plain.stats.has_memory = true;
	plain.stats.memory.views = 4096;
	plain.layers = layers;
	plain.n_layers = 2;

	memset(&pb, 0, sizeof(pb));
	pb.msg.request_id = 9;
	pb.msg.which_op = zipcache_v1_Response_stats_tag;
	pb.msg.op.stats.has_caller = true;
	pb.msg.op.stats.caller.uid = 1000;
	pb.msg.op.stats.sessions = 3;
	pb.msg.op.stats.set_aside_count = 1;
	snprintf(pb.msg.op.stats.set_aside[0].file, sizeof(pb.msg.op.stats.set_aside[0].file), "x.zcs");
	pb.msg.op.stats.set_aside_total = 1;
	pb.msg.op.stats.has_memory = true;
	pb.msg.op.stats.memory.views = 4096;
	pb.layers = pb_layers;
	pb.n_layers = 2;

	ck_assert_int_eq(wire_response_encode(&plain, a, sizeof(a), &la), 0);
	ck_assert_int_eq(wire_pb_response_encode(&pb, b, sizeof(b), &lb), 0);
	ck_assert_uint_eq(la, lb);
	ck_assert(memcmp(a, b, la) == 0);

	static wire_response back;
	ck_assert_int_eq(wire_response_decode(a + FRAME_HEADER_BYTES, la - FRAME_HEADER_BYTES, &back), 0);
	ck_assert_int_eq(back.op, WIRE_OP_STATS);
	ck_assert_uint_eq(back.n_layers, 2);
	ck_assert(memcmp(&back.layers[1], &layers[1], sizeof(layers[1])) == 0);
	ck_assert_uint_eq(back.stats.caller.uid, 1000);
	ck_assert_str_eq(back.stats.set_aside[0].file, "x.zcs");
	ck_assert_uint_eq(back.stats.memory.views, 4096);
	wire_response_free(&back);
}
END_TEST

static Suite *wire_suite(void)
{
	Suite *s = suite_create("wire");
	TCase *rt = tcase_create("round_trip");
	TCase *bad = tcase_create("malformed");
	TCase *st = tcase_create("status");

	tcase_set_timeout(rt, 60);
	tcase_add_test(rt, request_hello);
	tcase_add_test(rt, request_open_session_all_fields);
	tcase_add_test(rt, request_open_session_optional_presence);
	tcase_add_test(rt, request_small_ops);
	tcase_add_test(rt, request_inline_spans_point_into_frame);
	tcase_add_test(rt, request_through_frame_reader);
	tcase_add_test(rt, response_hello);
	tcase_add_test(rt, response_open_session);
	tcase_add_test(rt, response_small_ops);
	tcase_add_test(rt, response_stats_layers);
	tcase_add_test(rt, response_list_sessions);
	tcase_add_test(rt, list_limit);
	tcase_add_test(rt, encode_buffer_too_small);
	tcase_add_test(rt, encode_invalid_struct);
	tcase_add_test(rt, responses_through_frame_reader);
	tcase_add_test(rt, plain_request_same_bytes);
	tcase_add_test(rt, plain_response_same_bytes);
	tcase_add_test(rt, request_omit_stats);
	tcase_add_test(rt, update_request_same_bytes_as_nanopb);
	tcase_add_test(rt, update_request_decode_matches_nanopb);
	tcase_add_test(rt, update_response_matches_nanopb);
	suite_add_tcase(s, rt);

	/* ASan slows the fuzz loops several-fold. */
	tcase_set_timeout(bad, 300);
	tcase_add_test(bad, malformed_random_garbage);
	tcase_add_test(bad, malformed_truncated_and_corrupted);
	tcase_add_test(bad, malformed_truncated_inline);
	tcase_add_test(bad, malformed_wrong_wire_types);
	tcase_add_test(bad, oneof_repeated_and_switched);
	tcase_add_test(bad, refusals_keep_the_id_and_name_the_limit);
	suite_add_tcase(s, bad);

	tcase_add_test(st, status_mapping);
	tcase_add_test(st, unknown_status_value);
	tcase_add_test(st, set_status_message);
	suite_add_tcase(s, st);
	return s;
}

int main(void)
{
	return suite_main(wire_suite(), CK_FORK_GETENV);
}
