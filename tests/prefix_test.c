/*
 * Prefix reuse by content (docs/PREFIX.md) against real daemons.
 *
 *   chain       zc_chunk_chain: pinned vectors (the Python client pins the
 *               same), every token and the previous key matter, bad
 *               arguments refused.
 *   sharing     A session prefills a 2048-token prompt chunk by chunk with
 *               chain keys; a second session opened with that prefix holds
 *               the same blocks (the pool's bytes do not grow; its blocks
 *               are all shared) and equals, bit for bit, both the model
 *               and a third session that prefilled the same tokens itself;
 *               it then goes on by itself. The chunks outlive the session
 *               that made them. A chain with one different token reuses
 *               only the chunks before it; lookup answers 0, partial, full.
 *   refusals    Another model id or codec, a malformed or too long key
 *               list, a prefix past max_tokens, a prefix not held, another
 *               uid's chain: clear errors, nothing made. A chunk-keyed
 *               block of the wrong size or after ordinary rows is refused
 *               with nothing stored.
 *   crashes     A prefix open killed at every step of its mutation: after
 *               the restart the writer is whole and the new session is
 *               there (after the rename) or absent, no block copied or lost.
 *   remote      Two daemons (two shm-dirs, two sockets) on one real Redis
 *               (standalone, and a three-primary cluster): the chunks one
 *               prefilled are written to Redis in the background (with an
 *               expiry); the other's lookup finds them remote, its open
 *               fetches them once (verified), equals the model bit for
 *               bit, and a second open there shares them locally. A record
 *               damaged in Redis is refused (ZC_ECORRUPT, nothing made);
 *               Redis stopped: lookup answers what is local, an open that
 *               needs the tier is ZC_EREMOTE (UNAVAILABLE) naming the tier,
 *               nothing made.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "redis_harness.h"
#include "suite_main.h"
#include "wire.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 120
#define LAYERS 4u
#define KV_HEADS 2u
#define HEAD_DIM 64u
#define MAX_TOKENS 4096u
#define PROMPT_TOKENS 2048u
#define PROMPT_CHUNKS (PROMPT_TOKENS / ZC_PREFIX_CHUNK_TOKENS)

/* ---- helpers ------------------------------------------------------------------ */

static zc_session_config prefix_config(const char *name)
{
	zc_session_config config = shaped_config(name, LAYERS, 1, KV_HEADS, HEAD_DIM, HEAD_DIM,
						 MAX_TOKENS, ZC_POLICY_STREAMING, 0);
	config.model_id = "test-model";
	return config;
}

/* A prompt's token ids and their chain keys (whole chunks only). */
struct prompt {
	uint32_t tokens[PROMPT_TOKENS];
	uint8_t keys[PROMPT_CHUNKS * ZC_CHUNK_KEY_BYTES];
};

static void prompt_chain(struct prompt *p)
{
	for (uint32_t i = 0; i < PROMPT_CHUNKS; i++) {
		const uint8_t *prev = i ? p->keys + (i - 1) * ZC_CHUNK_KEY_BYTES : NULL;
		ck_assert_int_eq(zc_chunk_chain(prev, p->tokens + i * ZC_PREFIX_CHUNK_TOKENS,
						ZC_PREFIX_CHUNK_TOKENS, p->keys + i * ZC_CHUNK_KEY_BYTES),
				 0);
	}
}

static void prompt_make(struct prompt *p, uint32_t seed)
{
	for (uint32_t i = 0; i < PROMPT_TOKENS; i++)
		p->tokens[i] = seed * 7919u + i * 31u;
	prompt_chain(p);
}

/* The K/V a "model" computes for a prompt's chunk: a function of the
 * chunk's place and tokens alone, as a real model's prefix is. */
static void chunk_block(struct block *block, const struct model *model, const struct prompt *p,
			uint32_t chunk, uint32_t layer)
{
	struct rng rng;
	uint64_t seed = layer * 1000003u + chunk;
	for (uint32_t i = 0; i < ZC_PREFIX_CHUNK_TOKENS; i++)
		seed = seed * 6364136223846793005ull + p->tokens[chunk * ZC_PREFIX_CHUNK_TOKENS + i];
	rng_seed(&rng, seed);
	block_make(block, model, ZC_PREFIX_CHUNK_TOKENS, &rng);
}

/* Prefills the prompt's chunks into every layer with their keys (or as
 * ordinary blocks without them), the model following. */
static void prefill(zc_client *client, zc_session *session, struct model *model,
		    const struct prompt *p, uint32_t chunks, bool keyed)
{
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		for (uint32_t c = 0; c < chunks; c++) {
			struct block block;
			zc_view view;
			chunk_block(&block, model, p, c, layer);
			int rc = keyed ? zc_update_and_fetch_chunk(session, layer, block.tokens,
								  block.keys, block.values,
								  p->keys + c * ZC_CHUNK_KEY_BYTES, &view,
								  NULL) :
					 zc_update_and_fetch(session, layer, block.tokens, block.keys,
							     block.values, &view, NULL);
			ck_assert_msg(rc == 0, "prefill layer %u chunk %u: %s (%s)", layer, c,
				      zc_error_name(rc), zc_client_last_error(client));
			ck_assert_int_eq(model_update(model, layer, block.tokens, block.keys,
						      block.values), 0);
			block_free(&block);
		}
	}
}

static zc_prefix_held lookup(zc_client *client, const zc_session_config *config,
			     const uint8_t *keys, size_t n)
{
	zc_prefix_held held = { 0 };
	int rc = zc_client_lookup_prefix(client, config, keys, n, &held);
	ck_assert_msg(rc == 0, "lookup: %s (%s)", zc_error_name(rc), zc_client_last_error(client));
	ck_assert_uint_eq(held.tokens, held.chunks * ZC_PREFIX_CHUNK_TOKENS);
	return held;
}

static zc_session *open_prefixed(zc_client *client, const char *name, const uint8_t *keys,
				 uint32_t n)
{
	zc_session_config config = prefix_config(name);
	config.prefix = keys;
	config.prefix_chunks = n;
	zc_session *session = NULL;
	int rc = zc_session_open(client, &config, &session);
	ck_assert_msg(rc == 0, "open %s with a prefix of %u chunks: %s (%s)", name, n,
		      zc_error_name(rc), zc_client_last_error(client));
	return session;
}

struct holdings {
	size_t sessions;
	uint64_t blocks_bytes;
};

static struct holdings holdings_of(zc_client *client)
{
	struct holdings h = { 0 };
	zc_session_info infos[32];
	zc_memory_stats memory;
	ck_assert_int_eq(zc_client_list_sessions(client, infos, 32, &h.sessions), 0);
	ck_assert_int_eq(zc_client_memory_stats(client, &memory), 0);
	h.blocks_bytes = memory.blocks_bytes;
	return h;
}

/* An open that must be refused with `code`, its message naming `words`,
 * nothing made. */
static void open_refused(zc_client *client, zc_session_config *config, int code,
			 const char *words)
{
	struct holdings before = holdings_of(client);
	zc_session *session = NULL;
	int rc = zc_session_open(client, config, &session);
	ck_assert_msg(rc == code, "open: %s, not %s (%s)", zc_error_name(rc), zc_error_name(code),
		      zc_client_last_error(client));
	ck_assert_msg(strstr(zc_client_last_error(client), words), "'%s' does not say '%s'",
		      zc_client_last_error(client), words);
	struct holdings after = holdings_of(client);
	ck_assert_uint_eq(after.sessions, before.sessions);
	ck_assert_uint_eq(after.blocks_bytes, before.blocks_bytes);
}

/* ---- the chain rule ----------------------------------------------------------- */

/* Pinned: the same values are pinned in tests/python/test_prefix.py. */
static const char *const PINNED_FIRST = "1ad0492d3dbb85bc9cc579c431609f52";
static const char *const PINNED_SECOND = "affa74b72c264e9c6a96b91531261780";

static void hex(const uint8_t *key, char *out)
{
	for (unsigned i = 0; i < ZC_CHUNK_KEY_BYTES; i++)
		sprintf(out + 2 * i, "%02x", key[i]);
}

START_TEST(chain_rule_is_pinned_and_every_token_counts)
{
	uint32_t tokens[ZC_PREFIX_CHUNK_TOKENS];
	uint8_t first[ZC_CHUNK_KEY_BYTES], second[ZC_CHUNK_KEY_BYTES], other[ZC_CHUNK_KEY_BYTES];
	char text[2 * ZC_CHUNK_KEY_BYTES + 1];

	for (uint32_t i = 0; i < ZC_PREFIX_CHUNK_TOKENS; i++)
		tokens[i] = i;
	ck_assert_int_eq(zc_chunk_chain(NULL, tokens, ZC_PREFIX_CHUNK_TOKENS, first), 0);
	hex(first, text);
	ck_assert_str_eq(text, PINNED_FIRST);
	ck_assert_int_eq(zc_chunk_chain(first, tokens, ZC_PREFIX_CHUNK_TOKENS, second), 0);
	hex(second, text);
	ck_assert_str_eq(text, PINNED_SECOND);
	/* NULL is 16 zero bytes. */
	static const uint8_t zero[ZC_CHUNK_KEY_BYTES];
	ck_assert_int_eq(zc_chunk_chain(zero, tokens, ZC_PREFIX_CHUNK_TOKENS, other), 0);
	ck_assert_mem_eq(other, first, ZC_CHUNK_KEY_BYTES);
	/* Every token, and every byte of a token id, changes the key. */
	for (uint32_t i = 0; i < ZC_PREFIX_CHUNK_TOKENS; i += 37) {
		for (int shift = 0; shift < 32; shift += 8) {
			tokens[i] ^= 1u << shift;
			ck_assert_int_eq(zc_chunk_chain(NULL, tokens, ZC_PREFIX_CHUNK_TOKENS, other), 0);
			ck_assert_msg(memcmp(other, first, ZC_CHUNK_KEY_BYTES) != 0,
				      "token %u byte %d does not change the key", i, shift / 8);
			tokens[i] ^= 1u << shift;
		}
	}
	ck_assert_int_eq(zc_chunk_chain(NULL, tokens, 0, other), ZC_EINVALID);
	ck_assert_int_eq(zc_chunk_chain(NULL, NULL, 4, other), ZC_EINVALID);
}
END_TEST

/* ---- sharing ------------------------------------------------------------------ */

static void views_equal(zc_session *a, zc_session *b, uint32_t tokens)
{
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		zc_view va, vb;
		ck_assert_int_eq(zc_session_view(a, layer, &va), 0);
		ck_assert_int_eq(zc_session_view(b, layer, &vb), 0);
		ck_assert_uint_ge(va.tokens, tokens);
		ck_assert_uint_ge(vb.tokens, tokens);
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			ck_assert_msg(memcmp(va.keys + h * va.key_strides.head,
					     vb.keys + h * vb.key_strides.head,
					     (size_t)tokens * HEAD_DIM * 2) == 0,
				      "layer %u head %u: keys differ", layer, h);
			ck_assert_msg(memcmp(va.values + h * va.value_strides.head,
					     vb.values + h * vb.value_strides.head,
					     (size_t)tokens * HEAD_DIM * 2) == 0,
				      "layer %u head %u: values differ", layer, h);
		}
	}
}

START_TEST(two_sessions_hold_a_prefix_once_and_equal_a_prefill)
{
	struct service service;
	struct model model, fork_model, self_model;
	struct prompt *p = allocate(sizeof(*p));
	struct rng rng;
	service_start(&service, NULL);
	rng_seed(&rng, 11);
	prompt_make(p, 1);

	zc_session_config config = prefix_config("writer");
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks, 0);
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, PROMPT_CHUNKS, true);
	/* The tail that is not a whole chunk goes the ordinary way. */
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		CHECK(update_checked, service.client, writer, &model, &rng, layer, 100);
	CHECK(session_matches, writer, &model);

	zc_prefix_held held = lookup(service.client, &config, p->keys, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.chunks, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.local_chunks, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.tokens, PROMPT_TOKENS);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, 3).chunks, 3);

	struct holdings before = holdings_of(service.client);
	zc_session *reader = open_prefixed(service.client, "reader", p->keys, PROMPT_CHUNKS);
	const zc_session_info *info = zc_session_get_info(reader);
	ck_assert_uint_eq(info->min_tokens, PROMPT_TOKENS);
	ck_assert_uint_eq(info->max_layer_tokens, PROMPT_TOKENS);
	ck_assert_str_eq(info->model_id, "test-model");
	struct holdings after = holdings_of(service.client);
	ck_assert_msg(after.blocks_bytes == before.blocks_bytes,
		      "the pool grew from %llu to %llu bytes of blocks: the prefix was copied",
		      (unsigned long long)before.blocks_bytes, (unsigned long long)after.blocks_bytes);
	zc_layer_stats total;
	zc_session_info now;
	ck_assert_int_eq(zc_client_session_stats(service.client, info->id, NULL, 0, &total, &now), 0);
	ck_assert_uint_eq(total.tokens, LAYERS * PROMPT_TOKENS);
	ck_assert_uint_gt(now.shared_bytes, 0);
	ck_assert_msg(now.shared_bytes == total.compressed_key_bytes + total.compressed_value_bytes ||
			      now.shared_bytes >= total.compressed_key_bytes + total.compressed_value_bytes,
		      "shared %llu of %llu compressed bytes", (unsigned long long)now.shared_bytes,
		      (unsigned long long)(total.compressed_key_bytes + total.compressed_value_bytes));

	model_fork(&fork_model, &model, PROMPT_TOKENS);
	CHECK(session_matches, reader, &fork_model);
	/* ...and a session that prefilled the same tokens itself, no keys. */
	zc_session_config self_config = prefix_config("self");
	zc_session *self = open_session(service.client, &self_config);
	model_init(&self_model, &self_config);
	prefill(service.client, self, &self_model, p, PROMPT_CHUNKS, false);
	views_equal(reader, self, PROMPT_TOKENS);

	/* It goes on by itself; the writer is untouched. */
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		CHECK(update_checked, service.client, reader, &fork_model, &rng, layer, 300);
	CHECK(session_matches, reader, &fork_model);
	CHECK(session_matches, writer, &model);

	/* The chunks outlive the session that made them. */
	ck_assert_int_eq(zc_session_close(writer), 0);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks,
			  PROMPT_CHUNKS);
	struct model third_model;
	model_fork(&third_model, &model, PROMPT_TOKENS);
	zc_session *third = open_prefixed(service.client, "third", p->keys, PROMPT_CHUNKS);
	CHECK(session_matches, third, &third_model);

	model_free(&third_model);
	model_free(&self_model);
	model_free(&fork_model);
	model_free(&model);
	free(p);
	service_stop(&service);
}
END_TEST

START_TEST(a_chain_with_one_other_token_reuses_the_chunks_before_it)
{
	struct service service;
	struct model model, fork_model;
	struct prompt *p = allocate(sizeof(*p)), *q = allocate(sizeof(*q));
	service_start(&service, NULL);
	prompt_make(p, 2);
	*q = *p;
	q->tokens[1000] ^= 1;  /* chunk 3 (tokens 768..1023) */
	prompt_chain(q);
	for (uint32_t i = 0; i < 3; i++)
		ck_assert_mem_eq(q->keys + i * ZC_CHUNK_KEY_BYTES, p->keys + i * ZC_CHUNK_KEY_BYTES,
				 ZC_CHUNK_KEY_BYTES);
	for (uint32_t i = 3; i < PROMPT_CHUNKS; i++)
		ck_assert(memcmp(q->keys + i * ZC_CHUNK_KEY_BYTES, p->keys + i * ZC_CHUNK_KEY_BYTES,
				 ZC_CHUNK_KEY_BYTES) != 0);

	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, PROMPT_CHUNKS, true);

	ck_assert_uint_eq(lookup(service.client, &config, q->keys, PROMPT_CHUNKS).chunks, 3);
	ck_assert_uint_eq(lookup(service.client, &config, q->keys + 3 * ZC_CHUNK_KEY_BYTES, 5).chunks,
			  0);
	zc_session_config whole = prefix_config("whole");
	whole.prefix = q->keys;
	whole.prefix_chunks = PROMPT_CHUNKS;
	open_refused(service.client, &whole, ZC_ENOTFOUND, "prefix chunk 3 of 8 is not held");

	zc_session *reuse = open_prefixed(service.client, "reuse", q->keys, 3);
	ck_assert_uint_eq(zc_session_get_info(reuse)->min_tokens, 3 * ZC_PREFIX_CHUNK_TOKENS);
	model_fork(&fork_model, &model, 3 * ZC_PREFIX_CHUNK_TOKENS);
	CHECK(session_matches, reuse, &fork_model);
	/* The rest is prefilled with its own keys: the chain's other branch. */
	for (uint32_t layer = 0; layer < LAYERS; layer++) {
		for (uint32_t c = 3; c < PROMPT_CHUNKS; c++) {
			struct block block;
			chunk_block(&block, &fork_model, q, c, layer);
			ck_assert_int_eq(zc_update_and_fetch_chunk(reuse, layer, block.tokens, block.keys,
								   block.values,
								   q->keys + c * ZC_CHUNK_KEY_BYTES,
								   NULL, NULL), 0);
			ck_assert_int_eq(model_update(&fork_model, layer, block.tokens, block.keys,
						      block.values), 0);
			block_free(&block);
		}
	}
	CHECK(session_matches, reuse, &fork_model);
	ck_assert_uint_eq(lookup(service.client, &config, q->keys, PROMPT_CHUNKS).chunks,
			  PROMPT_CHUNKS);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks,
			  PROMPT_CHUNKS);

	model_free(&fork_model);
	model_free(&model);
	free(p);
	free(q);
	service_stop(&service);
}
END_TEST

/* ---- refusals ------------------------------------------------------------------ */

/* A raw lookup_prefix or open_session with `bytes` of prefix: the reply's
 * status and message. */
static int raw_prefix_call(const char *socket_path, enum wire_op op, const uint8_t *prefix,
			   uint32_t bytes, char *message, size_t size)
{
	wire_request request = { .request_id = 9, .op = op };
	struct wire_open_request *o = op == WIRE_OP_LOOKUP_PREFIX ? &request.lookup_prefix :
								  &request.open_session;
	o->has_shape = true;
	o->shape = (struct wire_shape){ LAYERS, 1, KV_HEADS, HEAD_DIM, HEAD_DIM };
	o->max_tokens = MAX_TOKENS;
	snprintf(o->model_id, sizeof(o->model_id), "test-model");
	o->prefix_len = bytes;
	memcpy(o->prefix, prefix, bytes);
	uint8_t *frame = allocate(8192);
	size_t len;
	wire_pb_response reply;
	ck_assert_int_eq(wire_request_encode(&request, frame, 8192, &len), 0);
	int fd = raw_connect(socket_path);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(raw_send(fd, frame, len), 0);
	ck_assert_int_eq(raw_read_reply(fd, 5000, &reply, NULL), 0);
	close(fd);
	free(frame);
	snprintf(message, size, "%s", reply.msg.message);
	int status = reply.msg.status;
	wire_pb_response_free(&reply);
	return status;
}

START_TEST(bad_prefixes_are_refused_and_make_nothing)
{
	struct service service;
	struct model model;
	struct prompt *p = allocate(sizeof(*p));
	char message[300];
	service_start(&service, NULL);
	prompt_make(p, 3);
	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, 2, true);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, 2).chunks, 2);

	/* Another model id, another codec, another shape: nothing held. */
	zc_session_config other = prefix_config("other");
	other.model_id = "another-model";
	ck_assert_uint_eq(lookup(service.client, &other, p->keys, 2).chunks, 0);
	other.prefix = p->keys;
	other.prefix_chunks = 2;
	open_refused(service.client, &other, ZC_ENOTFOUND, "not held for this uid, model id");
	other = prefix_config("other");
	other.codec.hi_bits = 8;
	ck_assert_uint_eq(lookup(service.client, &other, p->keys, 2).chunks, 0);
	other = prefix_config("other");
	other.kv_heads = 4;
	ck_assert_uint_eq(lookup(service.client, &other, p->keys, 2).chunks, 0);
	/* The policy and residual threshold are not part of it. */
	other = prefix_config("other");
	other.policy = ZC_POLICY_PER_CALL;
	ck_assert_uint_eq(lookup(service.client, &other, p->keys, 2).chunks, 2);

	/* More than are held; past max_tokens; too many; not whole keys. */
	other = prefix_config("other");
	other.prefix = p->keys;
	other.prefix_chunks = 3;
	open_refused(service.client, &other, ZC_ENOTFOUND, "prefix chunk 2 of 3");
	other.max_tokens = 300;
	other.prefix_chunks = 2;
	open_refused(service.client, &other, ZC_EINVALID, "above max_tokens 300");
	uint8_t *many = allocate((ZC_PREFIX_MAX_CHUNKS + 1) * ZC_CHUNK_KEY_BYTES);
	zc_prefix_held held;
	ck_assert_int_eq(zc_client_lookup_prefix(service.client, &config, many,
						 ZC_PREFIX_MAX_CHUNKS + 1, &held), ZC_EINVALID);
	ck_assert_int_eq(raw_prefix_call(service.daemon.socket_path, WIRE_OP_LOOKUP_PREFIX, p->keys,
					 17, message, sizeof(message)),
			 WIRE_STATUS_INVALID_ARGUMENT);
	ck_assert_msg(strstr(message, "chain keys are 16 bytes each"), "%s", message);
	struct holdings before = holdings_of(service.client);
	ck_assert_int_eq(raw_prefix_call(service.daemon.socket_path, WIRE_OP_OPEN_SESSION, p->keys,
					 31, message, sizeof(message)),
			 WIRE_STATUS_INVALID_ARGUMENT);
	ck_assert_msg(strstr(message, "nothing was made"), "%s", message);
	struct holdings after = holdings_of(service.client);
	ck_assert_uint_eq(after.sessions, before.sessions);
	free(many);

	/* Chunk-keyed blocks: exactly a chunk, on whole chunks only. */
	struct block block;
	struct rng rng;
	rng_seed(&rng, 4);
	block_make(&block, &model, 100, &rng);
	ck_assert_int_eq(zc_update_and_fetch_chunk(writer, 0, 100, block.keys, block.values, p->keys,
						   NULL, NULL), ZC_EINVALID);
	ck_assert_msg(strstr(zc_client_last_error(service.client), "is 256 tokens"), "%s",
		      zc_client_last_error(service.client));
	CHECK(update_block_checked, service.client, writer, &model, 0, &block, NULL, NULL);
	block_free(&block);
	block_make(&block, &model, ZC_PREFIX_CHUNK_TOKENS, &rng);
	ck_assert_int_eq(zc_update_and_fetch_chunk(writer, 0, block.tokens, block.keys, block.values,
						   p->keys + 2 * ZC_CHUNK_KEY_BYTES, NULL, NULL),
			 ZC_EPRECONDITION);
	ck_assert_msg(strstr(zc_client_last_error(service.client), "multiple of 256"), "%s",
		      zc_client_last_error(service.client));
	CHECK(session_matches, writer, &model);
	block_free(&block);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks, 2);

	model_free(&model);
	free(p);
	service_stop(&service);
}
END_TEST

struct other_uid {
	const char *socket_path;
	const uint8_t *keys;
};

static int other_uid_body(void *arg)
{
	const struct other_uid *o = arg;
	char why[200];
	zc_client *client;
	CHILD_EXPECT(user_become(65534, 65534, why, sizeof(why)), "%s", why);
	CHILD_EXPECT(zc_client_connect(o->socket_path, 5000, &client) == 0, "connect");
	zc_session_config config = prefix_config("stolen");
	zc_prefix_held held = { 99, 99, 99 };
	int rc = zc_client_lookup_prefix(client, &config, o->keys, 2, &held);
	CHILD_EXPECT(rc == 0 && held.chunks == 0 && held.local_chunks == 0,
		     "another uid's lookup: %d, %u chunks", rc, held.chunks);
	config.prefix = o->keys;
	config.prefix_chunks = 2;
	zc_session *session = NULL;
	rc = zc_session_open(client, &config, &session);
	CHILD_EXPECT(rc == ZC_ENOTFOUND, "another uid's open with the prefix: %s", zc_error_name(rc));
	size_t count = 1;
	zc_session_info infos[4];
	CHILD_EXPECT(zc_client_list_sessions(client, infos, 4, &count) == 0 && count == 0,
		     "nobody has %zu sessions", count);
	zc_client_close(client);
	return 0;
}

START_TEST(another_uid_cannot_use_a_chain)
{
	struct service service;
	struct model model;
	struct prompt *p = allocate(sizeof(*p));
	const char *const args[] = { "--socket-mode", "0666", NULL };
	service_start(&service, args);
	if (!other_users_possible(service.daemon.dir)) {
		free(p);
		service_stop(&service);
		return;
	}
	ck_assert_int_eq(chmod(service.daemon.dir, 0755), 0);
	prompt_make(p, 4);
	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, 2, true);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, 2).chunks, 2);
	struct other_uid o = { service.daemon.socket_path, p->keys };
	pid_t pid = child_spawn(other_uid_body, &o, -1);
	child_wait_ok(pid, "nobody's client");
	model_free(&model);
	free(p);
	service_stop(&service);
}
END_TEST

/* ---- crashes ------------------------------------------------------------------------ */

/* A prefix open killed at `step`'s hit-th time: after a restart the writer
 * is whole, and the new session is there (committed) or not at all, its
 * blocks never copied and none lost. */
static void crash_at(const char *step, int hit, bool committed)
{
	struct service service;
	struct model model, fork_model;
	struct prompt *p = allocate(sizeof(*p));
	char spec[64], tail[4096];
	snprintf(spec, sizeof(spec), "%s:%d", step, hit);
	setenv("ZIPCACHED_FAULT", spec, 1);
	service_start(&service, NULL);
	unsetenv("ZIPCACHED_FAULT");
	prompt_make(p, 9);
	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, 2, true);
	struct holdings before = holdings_of(service.client);

	zc_session_config open = prefix_config("reader");
	open.prefix = p->keys;
	open.prefix_chunks = 2;
	zc_session *reader = NULL;
	int rc = zc_session_open(service.client, &open, &reader);
	ck_assert_msg(daemon_lost(rc), "%s: the open answered %s", spec, zc_error_name(rc));
	int status = daemon_wait_exit(&service.daemon, 20000);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 86,
		      "%s: the daemon ended with 0x%x; log:\n%s", spec, status,
		      daemon_log_tail(&service.daemon, tail, sizeof(tail)));
	zc_session_release(writer);
	zc_client_close(service.client);
	daemon_restart(&service.daemon);
	ck_assert_int_eq(zc_client_connect(service.daemon.socket_path, 5000, &service.client), 0);

	config.attach = true;
	writer = open_session(service.client, &config);
	CHECK(session_matches, writer, &model);
	zc_session_info infos[4];
	size_t count = 0;
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_msg(count == (committed ? 2u : 1u), "%s: %zu sessions after the restart", spec,
		      count);
	ck_assert_uint_eq(holdings_of(service.client).blocks_bytes, before.blocks_bytes);
	if (committed) {
		zc_session_config again = prefix_config("reader");
		again.attach = true;
		zc_session *adopted = open_session(service.client, &again);
		model_fork(&fork_model, &model, 2 * ZC_PREFIX_CHUNK_TOKENS);
		CHECK(session_matches, adopted, &fork_model);
		model_free(&fork_model);
	}
	/* The chunk index starts empty after a restart (docs/PREFIX.md). */
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, 2).chunks, 0);
	model_free(&model);
	free(p);
	service_stop(&service);
}

START_TEST(a_prefix_open_killed_at_each_step_is_whole_or_absent)
{
	/* The writer's own open is each create step's first hit. */
	crash_at("create.file", 2, false);
	crash_at("import.block", 1, false);
	crash_at("import.block", 2 * LAYERS, false);
	crash_at("import.layers", 1, false);
	crash_at("create.header", 2, false);
	crash_at("create.rename", 2, true);
}
END_TEST

/* ---- memory relief ---------------------------------------------------------------- */

/* Charged bytes after: a writer prefilled and closed (only the index
 * holds its chunks), and one session prefilled with ordinary blocks. */
static void relief_scenario(const char *budget, uint64_t *chunks_only, uint64_t *one_session,
			    bool *refill_ok, uint32_t *held_after)
{
	struct service service;
	struct model model, other_model;
	struct prompt *p = allocate(sizeof(*p)), *q = allocate(sizeof(*q));
	const char *const args[] = { "--memory-budget", budget, NULL };
	zc_memory_stats memory;
	service_start(&service, budget ? args : NULL);
	prompt_make(p, 7);
	prompt_make(q, 8);
	zc_session_config config = prefix_config("writer");
	config.views = ZC_VIEWS_NONE;
	zc_session *writer = open_session(service.client, &config);
	model_init(&model, &config);
	prefill(service.client, writer, &model, p, PROMPT_CHUNKS, true);
	ck_assert_int_eq(zc_session_close(writer), 0);
	ck_assert_uint_eq(lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks,
			  PROMPT_CHUNKS);
	ck_assert_int_eq(zc_client_memory_stats(service.client, &memory), 0);
	*chunks_only = memory.charged_bytes;

	zc_session_config other = prefix_config("other");
	other.views = ZC_VIEWS_NONE;
	zc_session *session = open_session(service.client, &other);
	model_init(&other_model, &other);
	*refill_ok = true;
	for (uint32_t layer = 0; layer < LAYERS && *refill_ok; layer++) {
		for (uint32_t c = 0; c < PROMPT_CHUNKS && *refill_ok; c++) {
			struct block block;
			chunk_block(&block, &other_model, q, c, layer);
			*refill_ok = zc_update_and_fetch(session, layer, block.tokens, block.keys,
							 block.values, NULL, NULL) == 0;
			block_free(&block);
		}
	}
	ck_assert_int_eq(zc_client_memory_stats(service.client, &memory), 0);
	*one_session = memory.charged_bytes - *chunks_only;
	*held_after = lookup(service.client, &config, p->keys, PROMPT_CHUNKS).chunks;
	model_free(&other_model);
	model_free(&model);
	free(p);
	free(q);
	service_stop(&service);
}

START_TEST(relief_drops_chunks_only_the_index_holds)
{
	uint64_t chunks_only, one_session;
	uint32_t held;
	bool ok;
	relief_scenario(NULL, &chunks_only, &one_session, &ok, &held);
	ck_assert(ok);
	ck_assert_uint_eq(held, PROMPT_CHUNKS);
	/* Room for one session's prefill and half the chunks: the second
	 * prefill fits only once relief dropped the unused chunks. */
	char budget[32];
	snprintf(budget, sizeof(budget), "%llu",
		 (unsigned long long)(one_session + chunks_only / 2));
	relief_scenario(budget, &chunks_only, &one_session, &ok, &held);
	ck_assert_msg(ok, "the prefill was refused: relief did not drop the unused chunks");
	ck_assert_uint_eq(held, 0);
}
END_TEST

/* ---- the remote tier ------------------------------------------------------------ */

static void remote_args(char *url, size_t size, const struct redis_server *servers, int n,
			const char **args)
{
	snprintf(url, size, "redis://");
	for (int i = 0; i < n; i++)
		snprintf(url + strlen(url), size - strlen(url), "%s127.0.0.1:%u", i ? "," : "",
			 servers[i].port);
	args[0] = "--remote";
	args[1] = url;
	args[2] = NULL;
}

/* Keys of chunks in Redis (root's namespace), summed over the servers. */
static long long chunk_keys(const struct redis_server *servers, int n)
{
	long long total = 0;
	for (int i = 0; i < n; i++) {
		redisReply *reply = redis_command(&servers[i], "KEYS zc:1:0:c:*");
		ck_assert_int_eq(reply->type, REDIS_REPLY_ARRAY);
		total += (long long)reply->elements;
		freeReplyObject(reply);
	}
	return total;
}

static void wait_chunk_keys(const struct redis_server *servers, int n, long long want)
{
	int64_t deadline = now_ms() + 10000;
	while (chunk_keys(servers, n) < want && now_ms() < deadline)
		sleep_ms(20);
	ck_assert_int_eq(chunk_keys(servers, n), want);
}

static void second_daemon_serves(const struct redis_server *servers, int n)
{
	struct service a, b;
	struct model model, fork_model;
	struct prompt *p = allocate(sizeof(*p));
	char url[512];
	const char *args[3];
	remote_args(url, sizeof(url), servers, n, args);
	service_start(&a, args);
	service_start(&b, args);
	prompt_make(p, 5);

	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(a.client, &config);
	model_init(&model, &config);
	prefill(a.client, writer, &model, p, PROMPT_CHUNKS, true);
	wait_chunk_keys(servers, n, PROMPT_CHUNKS * LAYERS);
	/* Every record carries an expiry. */
	for (int i = 0; i < n; i++) {
		redisReply *keys = redis_command(&servers[i], "KEYS zc:1:0:c:*");
		for (size_t k = 0; k < keys->elements; k++) {
			redisReply *ttl = redis_command(&servers[i], "TTL %s", keys->element[k]->str);
			ck_assert_int_gt(ttl->integer, 0);
			ck_assert_int_le(ttl->integer, 86400);
			freeReplyObject(ttl);
		}
		freeReplyObject(keys);
	}

	zc_prefix_held held = lookup(b.client, &config, p->keys, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.chunks, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.local_chunks, 0);
	ck_assert_uint_eq(lookup(a.client, &config, p->keys, PROMPT_CHUNKS).local_chunks,
			  PROMPT_CHUNKS);

	zc_session *first = open_prefixed(b.client, "first", p->keys, PROMPT_CHUNKS);
	model_fork(&fork_model, &model, PROMPT_TOKENS);
	CHECK(session_matches, first, &fork_model);
	struct holdings once = holdings_of(b.client);
	ck_assert_uint_gt(once.blocks_bytes, 0);
	held = lookup(b.client, &config, p->keys, PROMPT_CHUNKS);
	ck_assert_uint_eq(held.local_chunks, PROMPT_CHUNKS);
	/* Fetched once: a second session there shares the same blocks. */
	zc_session *second = open_prefixed(b.client, "second", p->keys, PROMPT_CHUNKS);
	CHECK(session_matches, second, &fork_model);
	ck_assert_uint_eq(holdings_of(b.client).blocks_bytes, once.blocks_bytes);

	model_free(&fork_model);
	model_free(&model);
	free(p);
	service_stop(&b);
	service_stop(&a);
}

START_TEST(a_second_daemon_on_the_same_redis_serves_the_prefix)
{
	if (!redis_installed())
		return;
	struct redis_server server;
	redis_server_start(&server, NULL, NULL);
	second_daemon_serves(&server, 1);
	redis_server_stop(&server);
}
END_TEST

START_TEST(a_second_daemon_on_the_same_cluster_serves_the_prefix)
{
	if (!redis_installed())
		return;
	struct redis_cluster cluster;
	redis_cluster_start(&cluster);
	second_daemon_serves(cluster.nodes, REDIS_CLUSTER_NODES);
	redis_cluster_stop(&cluster);
}
END_TEST

START_TEST(a_damaged_record_or_a_stopped_redis_makes_nothing)
{
	if (!redis_installed())
		return;
	struct redis_server server;
	struct service a, b;
	struct model model;
	struct prompt *p = allocate(sizeof(*p));
	char url[512];
	const char *args[3];
	redis_server_start(&server, NULL, NULL);
	remote_args(url, sizeof(url), &server, 1, args);
	service_start(&a, args);
	service_start(&b, args);
	prompt_make(p, 6);
	zc_session_config config = prefix_config("writer");
	zc_session *writer = open_session(a.client, &config);
	model_init(&model, &config);
	prefill(a.client, writer, &model, p, 2, true);
	wait_chunk_keys(&server, 1, 2 * LAYERS);

	/* One byte of one record's payload flipped in Redis. */
	redisReply *keys = redis_command(&server, "KEYS zc:1:0:c:*:2");
	ck_assert_int_eq((int)keys->elements, 2);
	redisReply *byte = redis_command(&server, "GETRANGE %s 200 200", keys->element[0]->str);
	char flipped[2] = { (char)(byte->str[0] ^ 0x10), 0 };
	freeReplyObject(byte);
	redisReply *set = redis_command(&server, "SETRANGE %s 200 %b", keys->element[0]->str, flipped,
					(size_t)1);
	freeReplyObject(set);
	freeReplyObject(keys);
	zc_session_config open = prefix_config("reader");
	open.prefix = p->keys;
	open.prefix_chunks = 2;
	ck_assert_uint_eq(lookup(b.client, &config, p->keys, 2).chunks, 2);
	open_refused(b.client, &open, ZC_ECORRUPT, "checksum mismatch");
	ck_assert_uint_eq(holdings_of(b.client).blocks_bytes, 0);

	/* Redis stopped: lookup says what is held here; an open that needs
	 * the tier says so. */
	redis_server_kill(&server);
	zc_prefix_held held = lookup(b.client, &config, p->keys, 2);
	ck_assert_uint_eq(held.chunks, 0);
	held = lookup(a.client, &config, p->keys, 2);
	ck_assert_uint_eq(held.chunks, 2);
	ck_assert_uint_eq(held.local_chunks, 2);
	/* UNAVAILABLE (ZC_EREMOTE: retry later), naming the tier. */
	open_refused(b.client, &open, ZC_EREMOTE, "the remote tier failed");
	/* ...and the daemon that holds them opens from what it holds. */
	zc_session *reader = open_prefixed(a.client, "reader", p->keys, 2);
	ck_assert_uint_eq(zc_session_get_info(reader)->min_tokens, 2 * ZC_PREFIX_CHUNK_TOKENS);

	model_free(&model);
	free(p);
	service_stop(&b);
	service_stop(&a);
	redis_server_stop(&server);
}
END_TEST

int main(void)
{
	Suite *suite = suite_create("prefix");
	const struct test_case cases[] = {
		{ "chain", { chain_rule_is_pinned_and_every_token_counts, NULL } },
		{ "sharing",
		  { two_sessions_hold_a_prefix_once_and_equal_a_prefill,
		    a_chain_with_one_other_token_reuses_the_chunks_before_it, NULL } },
		{ "refusals",
		  { bad_prefixes_are_refused_and_make_nothing, another_uid_cannot_use_a_chain, NULL } },
		{ "relief", { relief_drops_chunks_only_the_index_holds, NULL } },
		{ "crashes", { a_prefix_open_killed_at_each_step_is_whole_or_absent, NULL } },
		{ "remote",
		  { a_second_daemon_on_the_same_redis_serves_the_prefix,
		    a_second_daemon_on_the_same_cluster_serves_the_prefix,
		    a_damaged_record_or_a_stopped_redis_makes_nothing, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
