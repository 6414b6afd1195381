/*
 * Writes the seed corpus of fuzz/dispatch_fuzz.c: each file is the bytes
 * one client sends on a connection, a handful of framed requests built
 * with wire_pb_request_encode(). The files are committed; run this only to
 * change them (see fuzz/README.md):
 *
 *	make_corpus DIR
 *
 * Session ids: the fuzz target starts a fresh daemon per input, whose
 * sessions are numbered from 1 in the order they are opened, so the seeds
 * can name them.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../server/store.h"
#include "frame.h"
#include "version.h"
#include "wire_pb.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

/* The target's -max_len is about this; seeds stay far below it. */
#define SEED_MAX_BYTES 70000

#define FP16_NAN 0x7e00u
#define FP16_INF 0x7c00u

struct seed {
	uint8_t bytes[SEED_MAX_BYTES];
	size_t len;
	uint64_t next_id;
};

struct shape {
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v;
};

static const char *out_dir;
static unsigned n_written;

static void die(const char *what)
{
	fprintf(stderr, "make_corpus: %s\n", what);
	exit(1);
}

static void seed_begin(struct seed *s)
{
	s->len = 0;
	s->next_id = 1;
}

static void seed_write(const struct seed *s, const char *name)
{
	char path[4096];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", out_dir, name);
	f = fopen(path, "wb");
	if (!f || fwrite(s->bytes, 1, s->len, f) != s->len || fclose(f) != 0)
		die(path);
	n_written++;
}

static void raw(struct seed *s, const void *bytes, size_t len)
{
	if (len > sizeof(s->bytes) - s->len)
		die("seed too large");
	memcpy(s->bytes + s->len, bytes, len);
	s->len += len;
}

static void header(struct seed *s, uint32_t len)
{
	uint8_t h[FRAME_HEADER_BYTES];
	frame_header_write(h, len);
	raw(s, h, sizeof(h));
}

/* Appends one request, giving it the next id unless it has one. */
static void add(struct seed *s, wire_pb_request *req)
{
	size_t n;

	if (req->msg.request_id == 0)
		req->msg.request_id = s->next_id++;
	if (wire_pb_request_encode(req, s->bytes + s->len, sizeof(s->bytes) - s->len, &n) < 0)
		die("cannot encode a request");
	s->len += n;
}

static wire_pb_request request_new(pb_size_t op)
{
	wire_pb_request req;
	memset(&req, 0, sizeof(req));
	req.msg.which_op = op;
	return req;
}

/* views: -1 the source's, else a zipcache_v1_Views value. */
static void fork_session(struct seed *s, uint64_t source, uint32_t tokens, const char *name,
			 int views)
{
	wire_pb_request req = request_new(zipcache_v1_Request_fork_session_tag);
	zipcache_v1_ForkSessionRequest *f = &req.msg.op.fork_session;
	f->source_id = source;
	f->tokens = tokens;
	snprintf(f->name, sizeof(f->name), "%s", name);
	f->has_views = views >= 0;
	f->views = views >= 0 ? (zipcache_v1_Views)views : zipcache_v1_Views_VIEWS_FULL;
	add(s, &req);
}

/* Export and import: the fuzzer's socket sends no descriptor, so these
 * reach the refusal ("needs a descriptor") and the decoding of their fields. */
static void export_session(struct seed *s, uint64_t session)
{
	wire_pb_request req = request_new(zipcache_v1_Request_export_session_tag);
	req.msg.op.export_session.session_id = session;
	add(s, &req);
}

static void import_session(struct seed *s, const char *name, const char *model_id,
			   bool has_fingerprint, int views)
{
	wire_pb_request req = request_new(zipcache_v1_Request_import_session_tag);
	zipcache_v1_ImportSessionRequest *m = &req.msg.op.import_session;
	snprintf(m->name, sizeof(m->name), "%s", name);
	m->has_model_id = model_id != NULL;
	snprintf(m->model_id, sizeof(m->model_id), "%s", model_id ? model_id : "");
	m->has_fingerprint = has_fingerprint;
	m->fingerprint = 0x0123456789abcdefull;
	m->has_views = views >= 0;
	m->views = views >= 0 ? (zipcache_v1_Views)views : zipcache_v1_Views_VIEWS_FULL;
	add(s, &req);
}

static void release(struct seed *s, uint64_t session)
{
	wire_pb_request req = request_new(zipcache_v1_Request_release_tag);
	req.msg.op.release.session_id = session;
	add(s, &req);
}

static void hello(struct seed *s, const char *client)
{
	wire_pb_request req = request_new(zipcache_v1_Request_hello_tag);
	req.msg.op.hello.protocol_version = ZIPCACHE_PROTOCOL_VERSION;
	snprintf(req.msg.op.hello.client_name, sizeof(req.msg.op.hello.client_name), "%s", client);
	add(s, &req);
}

/* open_session with the daemon's defaults for whatever is not given. */
static zipcache_v1_OpenSessionRequest *open_prepare(wire_pb_request *req, const char *name,
						    struct shape shape, uint32_t max_tokens)
{
	*req = request_new(zipcache_v1_Request_open_session_tag);
	zipcache_v1_OpenSessionRequest *open = &req->msg.op.open_session;
	snprintf(open->name, sizeof(open->name), "%s", name);
	open->has_shape = true;
	open->shape = (zipcache_v1_SessionShape){ shape.layers, shape.batch, shape.kv_heads,
						  shape.head_dim_k, shape.head_dim_v };
	open->max_tokens = max_tokens;
	return open;
}

static void open_streaming(struct seed *s, const char *name, struct shape shape,
			   uint32_t max_tokens, uint32_t residual)
{
	wire_pb_request req;
	zipcache_v1_OpenSessionRequest *open = open_prepare(&req, name, shape, max_tokens);
	open->policy = zipcache_v1_BlockPolicy_STREAMING;
	open->has_residual_tokens = residual != 0;
	open->residual_tokens = residual;
	add(s, &req);
}

static void open_per_call(struct seed *s, const char *name, struct shape shape,
			  uint32_t max_tokens, const zipcache_v1_CodecConfig *codec)
{
	wire_pb_request req;
	zipcache_v1_OpenSessionRequest *open = open_prepare(&req, name, shape, max_tokens);
	open->policy = zipcache_v1_BlockPolicy_PER_CALL;
	if (codec) {
		open->has_codec = true;
		open->codec = *codec;
	}
	add(s, &req);
}

static zipcache_v1_CodecConfig codec_all(uint32_t hi_bits, uint32_t lo_bits, double hi_fraction,
					   uint32_t group_size, bool quantize_values)
{
	return (zipcache_v1_CodecConfig){
		.has_hi_bits = true, .hi_bits = hi_bits,
		.has_lo_bits = true, .lo_bits = lo_bits,
		.has_hi_fraction = true, .hi_fraction = hi_fraction,
		.has_group_size = true, .group_size = group_size,
		.has_quantize_values = true, .quantize_values = quantize_values,
	};
}

static void attach(struct seed *s, const char *name, const struct shape *shape)
{
	wire_pb_request req = request_new(zipcache_v1_Request_open_session_tag);
	zipcache_v1_OpenSessionRequest *open = &req.msg.op.open_session;
	snprintf(open->name, sizeof(open->name), "%s", name);
	open->attach = true;
	if (shape) {
		open->has_shape = true;
		open->shape = (zipcache_v1_SessionShape){ shape->layers, shape->batch, shape->kv_heads,
							  shape->head_dim_k, shape->head_dim_v };
		open->max_tokens = 16;
	}
	add(s, &req);
}

/* Finite fp16 values of magnitude below 2 from a small LCG; with rows of
 * `row` values, every fifth row is twice as large, so saliency has
 * something to pick. */
static void fp16_fill(uint16_t *out, size_t n, uint32_t seed, size_t row)
{
	uint32_t x = seed * 2654435761u + 1;
	for (size_t i = 0; i < n; i++) {
		x = x * 1664525u + 1013904223u;
		uint16_t sign = (uint16_t)((x >> 31) << 15);
		uint16_t exponent = (uint16_t)(((x >> 20) % 15) + (row && (i / row) % 5 == 0 ? 1 : 0));
		uint16_t mantissa = (uint16_t)((x >> 8) & 0x3ff);
		out[i] = (uint16_t)(sign | exponent << 10 | mantissa);
	}
}

/* update_and_fetch with inline finite fp16 for the given shape. */
static void update_inline(struct seed *s, uint64_t session, uint32_t layer, uint32_t tokens,
			  struct shape shape, uint32_t seed, uint16_t poison_key, uint16_t poison_value)
{
	size_t heads = (size_t)shape.batch * shape.kv_heads;
	size_t nk = heads * tokens * shape.head_dim_k, nv = heads * tokens * shape.head_dim_v;
	uint16_t *keys = malloc((nk + 1) * 2), *values = malloc((nv + 1) * 2);
	if (!keys || !values)
		die("out of memory");
	fp16_fill(keys, nk, seed, shape.head_dim_k);
	fp16_fill(values, nv, seed + 7, shape.head_dim_v);
	if (poison_key)
		keys[nk / 2] = poison_key;
	if (poison_value)
		values[nv - 1] = poison_value;

	wire_pb_request req = request_new(zipcache_v1_Request_update_and_fetch_tag);
	req.msg.op.update_and_fetch.session_id = session;
	req.msg.op.update_and_fetch.layer = layer;
	req.msg.op.update_and_fetch.tokens = tokens;
	req.keys = (wire_span){ (const uint8_t *)keys, nk * 2 };
	req.values = (wire_span){ (const uint8_t *)values, nv * 2 };
	add(s, &req);
	free(keys);
	free(values);
}

/* update_and_fetch whose byte lengths are given, not derived. */
static void update_lengths(struct seed *s, uint64_t session, uint32_t layer, uint32_t tokens,
			   size_t key_bytes, size_t value_bytes)
{
	static const uint8_t filler[4096];
	wire_pb_request req = request_new(zipcache_v1_Request_update_and_fetch_tag);
	req.msg.op.update_and_fetch.session_id = session;
	req.msg.op.update_and_fetch.layer = layer;
	req.msg.op.update_and_fetch.tokens = tokens;
	req.keys = (wire_span){ filler, key_bytes };
	req.values = (wire_span){ filler, value_bytes };
	add(s, &req);
}

static void update_staged(struct seed *s, uint64_t session, uint32_t layer, uint32_t tokens,
			  uint64_t keys_offset, uint64_t values_offset)
{
	wire_pb_request req = request_new(zipcache_v1_Request_update_and_fetch_tag);
	req.msg.op.update_and_fetch.session_id = session;
	req.msg.op.update_and_fetch.layer = layer;
	req.msg.op.update_and_fetch.tokens = tokens;
	req.msg.op.update_and_fetch.staged = true;
	req.msg.op.update_and_fetch.keys_offset = keys_offset;
	req.msg.op.update_and_fetch.values_offset = values_offset;
	add(s, &req);
}

static void trim(struct seed *s, uint64_t session, uint32_t tokens)
{
	wire_pb_request req = request_new(zipcache_v1_Request_trim_tag);
	req.msg.op.trim.session_id = session;
	req.msg.op.trim.tokens = tokens;
	add(s, &req);
}

static void close_session(struct seed *s, uint64_t session)
{
	wire_pb_request req = request_new(zipcache_v1_Request_close_session_tag);
	req.msg.op.close_session.session_id = session;
	add(s, &req);
}

static void stats(struct seed *s, uint64_t session)
{
	wire_pb_request req = request_new(zipcache_v1_Request_stats_tag);
	req.msg.op.stats.session_id = session;
	add(s, &req);
}

static void list(struct seed *s)
{
	wire_pb_request req = request_new(zipcache_v1_Request_list_sessions_tag);
	add(s, &req);
}

static void staging(struct seed *s, uint64_t bytes)
{
	wire_pb_request req = request_new(zipcache_v1_Request_staging_tag);
	req.msg.op.staging.bytes = bytes;
	add(s, &req);
}

/* update_and_fetch from the staging buffer: keys at 0, values right after. */
static void update_staged_block(struct seed *s, uint64_t session, uint32_t layer, uint32_t tokens,
				struct shape shape)
{
	uint64_t heads = (uint64_t)shape.batch * shape.kv_heads;
	update_staged(s, session, layer, tokens, 0, heads * tokens * shape.head_dim_k * 2);
}

static size_t block_bytes(struct shape shape, uint32_t tokens, uint32_t dim)
{
	return (size_t)shape.batch * shape.kv_heads * tokens * dim * 2;
}

static const struct shape SMALL = { 2, 1, 2, 8, 8 };
static const struct shape ODD = { 3, 2, 1, 4, 12 };     /* K and V dims differ */
static const struct shape WIDE = { 1, 1, 4, 32, 32 };   /* 16 tokens go to the thread pool */
static const struct shape MID = { 16, 1, 4, 128, 128 };  /* 16 layers pass the budget */

int main(int argc, char **argv)
{
	static struct seed s;
	zipcache_v1_CodecConfig codec;

	if (argc != 2)
		die("usage: make_corpus DIR");
	out_dir = argv[1];

	seed_begin(&s);
	hello(&s, "fuzz");
	seed_write(&s, "hello");

	seed_begin(&s);
	hello(&s, "");
	list(&s);
	stats(&s, 0);
	seed_write(&s, "hello-list-stats");

	/* The whole life of a streaming session, one token at a time and more. */
	seed_begin(&s);
	hello(&s, "worker");
	open_streaming(&s, "seq", SMALL, 64, 4);
	update_inline(&s, 1, 0, 1, SMALL, 1, 0, 0);
	update_inline(&s, 1, 1, 1, SMALL, 2, 0, 0);
	update_inline(&s, 1, 0, 2, SMALL, 3, 0, 0);
	update_inline(&s, 1, 0, 4, SMALL, 4, 0, 0);
	stats(&s, 1);
	trim(&s, 1, 2);
	update_inline(&s, 1, 0, 3, SMALL, 5, 0, 0);
	list(&s);
	close_session(&s, 1);
	stats(&s, 1);
	seed_write(&s, "streaming-lifecycle");

	/* per_call with every codec knob turned. */
	seed_begin(&s);
	codec = codec_all(8, 1, 0.5, 2, false);
	open_per_call(&s, "", ODD, 32, &codec);
	update_inline(&s, 1, 2, 3, ODD, 9, 0, 0);
	update_inline(&s, 1, 2, 1, ODD, 10, 0, 0);
	stats(&s, 1);
	seed_write(&s, "per-call-codec");

	seed_begin(&s);
	codec = codec_all(3, 2, 0.0, 1, true);
	open_per_call(&s, "g1", SMALL, 16, &codec);
	codec = codec_all(4, 4, 1.0, 64, false);
	codec.has_quantize_values = false;
	open_per_call(&s, "all-hi", SMALL, 16, &codec);
	update_inline(&s, 1, 0, 4, SMALL, 11, 0, 0);
	update_inline(&s, 2, 1, 4, SMALL, 12, 0, 0);
	stats(&s, 2);
	seed_write(&s, "codec-edges");

	seed_begin(&s);
	open_streaming(&s, "shared", SMALL, 32, 0);
	attach(&s, "shared", NULL);
	attach(&s, "shared", &SMALL);
	attach(&s, "shared", &ODD);
	open_streaming(&s, "shared", SMALL, 32, 0);
	attach(&s, "nobody", NULL);
	seed_write(&s, "attach");

	/* Forks (inside a block, into the residual, past the end, onto a
	 * taken name, of nobody), views = none, releases. */
	seed_begin(&s);
	open_streaming(&s, "root", SMALL, 64, 4);
	update_inline(&s, 1, 0, 9, SMALL, 21, 0, 0);
	update_inline(&s, 1, 0, 2, SMALL, 22, 0, 0);
	update_inline(&s, 1, 1, 3, SMALL, 23, 0, 0);
	fork_session(&s, 1, 5, "branch", -1);
	fork_session(&s, 1, 10, "", 1);
	fork_session(&s, 1, 1000, "long", 0);
	fork_session(&s, 1, 3, "root", -1);
	fork_session(&s, 99, 3, "ghost", -1);
	update_inline(&s, 2, 0, 1, SMALL, 24, 0, 0);
	trim(&s, 1, 4);
	release(&s, 1);
	release(&s, 99);
	close_session(&s, 1);
	update_inline(&s, 2, 1, 2, SMALL, 25, 0, 0);
	stats(&s, 2);
	list(&s);
	seed_write(&s, "fork-release");

	seed_begin(&s);
	{
		wire_pb_request req;
		zipcache_v1_OpenSessionRequest *open = open_prepare(&req, "compressed", SMALL, 64);
		open->views = zipcache_v1_Views_VIEWS_NONE;
		add(&s, &req);
	}
	update_inline(&s, 1, 0, 9, SMALL, 26, 0, 0);
	update_inline(&s, 1, 0, 1, SMALL, 27, 0, 0);
	fork_session(&s, 1, 4, "full", 0);
	stats(&s, 1);
	seed_write(&s, "views-none");

	/* Snapshots without a descriptor, and a model id on an open. */
	seed_begin(&s);
	{
		wire_pb_request req;
		zipcache_v1_OpenSessionRequest *open = open_prepare(&req, "modelled", SMALL, 64);
		snprintf(open->model_id, sizeof(open->model_id), "%s", "llama-3-8b");
		add(&s, &req);
	}
	update_inline(&s, 1, 0, 9, SMALL, 28, 0, 0);
	export_session(&s, 1);
	export_session(&s, 99);
	import_session(&s, "copy", "llama-3-8b", true, 1);
	import_session(&s, "", NULL, false, -1);
	list(&s);
	seed_write(&s, "snapshot-no-descriptor");

	/* Staged blocks: in range, odd offsets, past the end, replaced buffer. */
	seed_begin(&s);
	staging(&s, 4096);
	open_streaming(&s, "staged", SMALL, 64, 8);
	update_staged(&s, 1, 0, 2, 0, block_bytes(SMALL, 2, 8));
	update_staged(&s, 1, 1, 2, 1, 64);
	update_staged(&s, 1, 1, 2, 4090, 0);
	update_staged(&s, 1, 1, 300, 0, 0);
	staging(&s, 8192);
	update_staged(&s, 1, 1, 16, 0, 4096);
	stats(&s, 1);
	seed_write(&s, "staging");

	seed_begin(&s);
	open_streaming(&s, "", SMALL, 64, 0);
	update_staged(&s, 1, 0, 1, 0, 0);
	staging(&s, 0);
	staging(&s, (2u << 20));
	staging(&s, 100);
	update_inline(&s, 1, 0, 1, SMALL, 3, 0, 0);
	update_staged(&s, 1, 0, 1, 0, 32);
	seed_write(&s, "staging-errors");

	/* A staged prefill big enough for the thread pool, then decode steps. */
	seed_begin(&s);
	staging(&s, 1u << 20);
	open_streaming(&s, "prefill", WIDE, 2048, 0);
	update_staged(&s, 1, 0, 512, 0, 512 * 4 * 32 * 2);
	update_inline(&s, 1, 0, 1, WIDE, 21, 0, 0);
	stats(&s, 1);
	seed_write(&s, "staged-prefill");

	/* Inline blocks on the thread pool with work queued behind them. */
	seed_begin(&s);
	open_streaming(&s, "pool", WIDE, 256, 8);
	update_inline(&s, 1, 0, 16, WIDE, 31, 0, 0);
	update_inline(&s, 1, 0, 1, WIDE, 32, 0, 0);
	stats(&s, 1);
	trim(&s, 1, 5);
	update_inline(&s, 1, 0, 16, WIDE, 33, 0, 0);
	close_session(&s, 1);
	update_inline(&s, 1, 0, 1, WIDE, 34, 0, 0);
	stats(&s, 1);
	seed_write(&s, "offload-queue");

	seed_begin(&s);
	open_per_call(&s, "nan", SMALL, 32, NULL);
	update_inline(&s, 1, 0, 2, SMALL, 41, FP16_NAN, 0);
	update_inline(&s, 1, 0, 2, SMALL, 42, 0, FP16_INF);
	update_inline(&s, 1, 0, 2, SMALL, 43, 0xfc00u, 0);
	update_inline(&s, 1, 0, 2, SMALL, 44, 0x7bffu, 0xfbffu);
	stats(&s, 1);
	seed_write(&s, "non-finite");

	/* Refusals of update_and_fetch. */
	seed_begin(&s);
	update_inline(&s, 7, 0, 1, SMALL, 1, 0, 0);
	open_streaming(&s, "u", SMALL, 8, 0);
	update_inline(&s, 1, 2, 1, SMALL, 1, 0, 0);
	update_lengths(&s, 1, 0, 0, 0, 0);
	update_lengths(&s, 1, 0, 9, 9 * 2 * 16, 9 * 2 * 16);
	update_lengths(&s, 1, 0, 1, 32, 30);
	update_lengths(&s, 1, 0, 1, 0, 32);
	update_inline(&s, 1, 0, 6, SMALL, 2, 0, 0);
	update_inline(&s, 1, 0, 3, SMALL, 3, 0, 0);
	trim(&s, 1, 100);
	update_inline(&s, 1, 0, 8, SMALL, 4, 0, 0);
	seed_write(&s, "update-refusals");

	/* Refusals of open_session. */
	seed_begin(&s);
	{
		wire_pb_request req = request_new(zipcache_v1_Request_open_session_tag);
		add(&s, &req);
	}
	open_streaming(&s, "", SMALL, 0, 0);
	open_streaming(&s, "", SMALL, ZC_MAX_BLOCK_TOKENS + 1, 0);
	open_streaming(&s, "", (struct shape){ 2000, 1, 1, 8, 8 }, 8, 0);
	open_streaming(&s, "", (struct shape){ 1, 0, 1, 8, 8 }, 8, 0);
	open_streaming(&s, "", (struct shape){ 1, 1, 1, 5000, 8 }, 8, 0);
	open_streaming(&s, "", (struct shape){ 1, 300, 300, 8, 8 }, 8, 0);
	open_streaming(&s, "", SMALL, 8, 70000);
	{
		wire_pb_request req;
		zipcache_v1_OpenSessionRequest *open = open_prepare(&req, "", SMALL, 8);
		open->policy = (zipcache_v1_BlockPolicy)7;
		add(&s, &req);
	}
	codec = (zipcache_v1_CodecConfig){ .has_hi_bits = true, .hi_bits = 0 };
	open_per_call(&s, "", SMALL, 8, &codec);
	codec = (zipcache_v1_CodecConfig){ .has_hi_bits = true, .hi_bits = 9, .has_lo_bits = true, .lo_bits = 100 };
	open_per_call(&s, "", SMALL, 8, &codec);
	codec = (zipcache_v1_CodecConfig){ .has_hi_fraction = true, .hi_fraction = 1.5,
					   .has_group_size = true, .group_size = 0 };
	open_per_call(&s, "", SMALL, 8, &codec);
	codec = (zipcache_v1_CodecConfig){ .has_hi_fraction = true, .hi_fraction = NAN };
	open_per_call(&s, "", SMALL, 8, &codec);
	codec = (zipcache_v1_CodecConfig){ .has_group_size = true, .group_size = 1u << 25 };
	open_per_call(&s, "", SMALL, 8, &codec);
	seed_write(&s, "open-refusals");

	/* More sessions than the daemon allows (8), then a close frees one. */
	seed_begin(&s);
	for (int i = 0; i < 9; i++)
		open_streaming(&s, "", (struct shape){ 1, 1, 1, 4, 4 }, 4, 0);
	close_session(&s, 3);
	open_streaming(&s, "late", (struct shape){ 1, 1, 1, 4, 4 }, 4, 0);
	list(&s);
	seed_write(&s, "session-limit");

	/* Two sessions that do not fit the 16 MiB budget together: the idle one
	 * loses its views, which stats and attach then rebuild. A layer's first
	 * token reserves about 1 MiB (views and residual); one token of MID is
	 * small enough to run on the loop, so the order is fixed. */
	seed_begin(&s);
	open_streaming(&s, "a", MID, 4096, 0);
	for (uint32_t layer = 0; layer < 14; layer++)
		update_inline(&s, 1, layer, 1, MID, 50 + layer, 0, 0);
	open_streaming(&s, "b", MID, 4096, 0);
	for (uint32_t layer = 0; layer < 3; layer++)
		update_inline(&s, 2, layer, 1, MID, 70 + layer, 0, 0);
	stats(&s, 1);
	attach(&s, "a", NULL);
	stats(&s, 2);
	stats(&s, 0);
	seed_write(&s, "memory-budget");

	/* Streaming: the residual fills and flushes, then a long block. */
	seed_begin(&s);
	open_streaming(&s, "flush", SMALL, 256, 8);
	for (int i = 0; i < 4; i++)
		update_inline(&s, 1, 0, 3, SMALL, 60 + (uint32_t)i, 0, 0);
	update_inline(&s, 1, 0, 20, SMALL, 65, 0, 0);
	update_inline(&s, 1, 1, 8, SMALL, 66, 0, 0);
	trim(&s, 1, 11);
	stats(&s, 1);
	seed_write(&s, "residual-flush");

	/* A pipelined decode step over four layers, twice. */
	seed_begin(&s);
	open_streaming(&s, "pipe", (struct shape){ 4, 1, 2, 8, 8 }, 64, 0);
	for (int step = 0; step < 2; step++)
		for (uint32_t layer = 0; layer < 4; layer++)
			update_inline(&s, 1, layer, 1, SMALL, 70 + layer, 0, 0);
	trim(&s, 1, 1);
	stats(&s, 1);
	seed_write(&s, "pipelined-layers");

	/* A session filled to max_tokens, one more token, then trimmed away. */
	seed_begin(&s);
	open_per_call(&s, "full", SMALL, 8, NULL);
	update_inline(&s, 1, 0, 8, SMALL, 80, 0, 0);
	update_inline(&s, 1, 0, 1, SMALL, 81, 0, 0);
	trim(&s, 1, 8);
	update_inline(&s, 1, 0, 1, SMALL, 82, 0, 0);
	trim(&s, 1, 0);
	stats(&s, 1);
	seed_write(&s, "max-tokens");

	seed_begin(&s);
	open_streaming(&s, "x", SMALL, 16, 0);
	open_streaming(&s, "y", ODD, 16, 0);
	open_streaming(&s, "", SMALL, 16, 0);
	list(&s);
	close_session(&s, 2);
	close_session(&s, 2);
	trim(&s, 9, 1);
	list(&s);
	seed_write(&s, "list-close");

	/* Framing: an empty frame, a frame split at the end. */
	seed_begin(&s);
	header(&s, 0);
	hello(&s, "after-empty");
	header(&s, 40);
	raw(&s, "\x08\x05", 2);
	seed_write(&s, "empty-and-partial");

	/* A header above max_frame_bytes (65536): refused, connection closed. */
	seed_begin(&s);
	hello(&s, "");
	header(&s, 65537);
	raw(&s, "\x08\x01", 2);
	hello(&s, "never read");
	seed_write(&s, "oversized-frame");

	seed_begin(&s);
	header(&s, 65536);
	for (int i = 0; i < 65536; i += 2)
		raw(&s, "\x08\x01", 2);
	seed_write(&s, "max-frame");

	/* Bytes that are not a Request. */
	seed_begin(&s);
	header(&s, 3);
	raw(&s, "\xff\xff\xff", 3);
	header(&s, 2);
	raw(&s, "\x22\x05", 2);                 /* length past the end */
	header(&s, 4);
	raw(&s, "\x22\x02\x28\x05", 4);         /* keys (field 4 of uaf) as a varint */
	header(&s, 2);
	raw(&s, "\x0a\x00", 2);                 /* request_id with the wrong wire type */
	header(&s, 6);
	raw(&s, "\xf8\x07\x01\x12\x00\x00", 6); /* unknown field, empty hello, a zero tag */
	stats(&s, 0);
	seed_write(&s, "malformed");

	/* hello, then update_and_fetch in the same message. */
	seed_begin(&s);
	header(&s, 8);
	raw(&s, "\x08\x01\x12\x00\x22\x02\x18\x01", 8);
	header(&s, 8);
	raw(&s, "\x08\x02\x22\x02\x18\x01\x12\x00", 8);
	header(&s, 0);
	seed_write(&s, "two-ops");

	/* Inline keys given twice: the last one counts. */
	seed_begin(&s);
	open_streaming(&s, "", (struct shape){ 1, 1, 1, 1, 1 }, 8, 0);
	{
		static const uint8_t body[] = { 0x08, 0x02, 0x22, 0x10, 0x08, 0x01, 0x18, 0x01,
						0x22, 0x02, 0x00, 0x3c, 0x22, 0x02, 0x00, 0xbc,
						0x2a, 0x02, 0x00, 0x3c };
		header(&s, sizeof(body));
		raw(&s, body, sizeof(body));
	}
	seed_write(&s, "repeated-bytes");

	/* Request ids at the edges, and an empty op. */
	seed_begin(&s);
	{
		wire_pb_request req = request_new(zipcache_v1_Request_hello_tag);
		req.msg.request_id = UINT64_MAX;
		add(&s, &req);
		req = request_new(0);
		req.msg.request_id = 5;
		add(&s, &req);
		req = request_new(zipcache_v1_Request_list_sessions_tag);
		req.msg.request_id = 5;
		add(&s, &req);
	}
	seed_write(&s, "request-ids");

	/* Names at the length limit, with multi-byte characters. */
	seed_begin(&s);
	open_streaming(&s, "0123456789012345678901234567890123456789012345678901234567890123",
		       SMALL, 8, 0);
	open_streaming(&s, "caf\xc3\xa9-\xe2\x82\xac", SMALL, 8, 0);
	open_streaming(&s, "caf\xc3\xa9-\xe2\x82\xac", SMALL, 8, 0);
	list(&s);
	stats(&s, 2);
	seed_write(&s, "names");

	/*
	 * Sessions at every maximum the flags and the store allow, and one
	 * past each: the layout arithmetic (shapes x tokens x dims, offsets
	 * of layer 1023's regions hundreds of GiB into a sparse file) is
	 * where a product could wrap. The target's max_tokens is
	 * ZC_MAX_BLOCK_TOKENS, --max-tokens's own maximum; the 1 TiB bound on
	 * mapped bytes lets two sessions of a few hundred GiB in, not three.
	 */
	seed_begin(&s);
	hello(&s, "max-tokens");
	open_per_call(&s, "tmax", (struct shape){ 1, 1, 1, 8, 8 }, ZC_MAX_BLOCK_TOKENS, NULL);
	update_inline(&s, 1, 0, 4, (struct shape){ 1, 1, 1, 8, 8 }, 90, 0, 0);
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, 8, 8 }, 91, 0, 0);
	update_lengths(&s, 1, 0, ZC_MAX_BLOCK_TOKENS, 16, 16);
	update_lengths(&s, 1, 0, ZC_MAX_BLOCK_TOKENS + 1, 16, 16);
	update_lengths(&s, 1, 0, UINT32_MAX, 16, 16);
	staging(&s, 1u << 20);
	update_staged(&s, 1, 0, ZC_MAX_BLOCK_TOKENS, 0, 0);
	update_staged(&s, 1, 0, (1u << 20) / 32, 0, (1u << 20) / 2);
	stats(&s, 1);
	trim(&s, 1, ZC_MAX_BLOCK_TOKENS);
	trim(&s, 1, UINT32_MAX);
	trim(&s, 1, 3);
	open_streaming(&s, "tmax-s", (struct shape){ 2, 1, 2, 8, 8 }, ZC_MAX_BLOCK_TOKENS,
		       STORE_MAX_RESIDUAL_TOKENS);
	update_inline(&s, 2, 1, 3, (struct shape){ 2, 1, 2, 8, 8 }, 92, 0, 0);
	stats(&s, 2);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, 8, 8 }, ZC_MAX_BLOCK_TOKENS + 1, NULL);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, 8, 8 }, UINT32_MAX, NULL);
	close_session(&s, 1);
	list(&s);
	seed_write(&s, "max-tokens-limit");

	seed_begin(&s);
	open_streaming(&s, "layers", (struct shape){ STORE_MAX_LAYERS, 1, 1, 1, 1 }, 16, 4);
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, 1, 1 }, 93, 0, 0);
	update_inline(&s, 1, STORE_MAX_LAYERS - 1, 1, (struct shape){ 1, 1, 1, 1, 1 }, 94, 0, 0);
	update_inline(&s, 1, STORE_MAX_LAYERS - 1, 7, (struct shape){ 1, 1, 1, 1, 1 }, 95, 0, 0);
	update_inline(&s, 1, STORE_MAX_LAYERS, 1, (struct shape){ 1, 1, 1, 1, 1 }, 96, 0, 0);
	update_inline(&s, 1, UINT32_MAX, 1, (struct shape){ 1, 1, 1, 1, 1 }, 97, 0, 0);
	stats(&s, 1);
	trim(&s, 1, 1);
	/* Every layer at max_tokens needs ~1.3 TiB, past the bound on mapped
	 * bytes; at half of it, layer 1023's regions lie ~670 GiB in. */
	open_per_call(&s, "", (struct shape){ STORE_MAX_LAYERS, 1, 1, 1, 1 }, ZC_MAX_BLOCK_TOKENS, NULL);
	open_per_call(&s, "layers-tokens", (struct shape){ STORE_MAX_LAYERS, 1, 1, 1, 1 },
		      ZC_MAX_BLOCK_TOKENS / 2, NULL);
	update_inline(&s, 2, STORE_MAX_LAYERS - 1, 2, (struct shape){ 1, 1, 1, 1, 1 }, 98, 0, 0);
	update_inline(&s, 2, 0, 1, (struct shape){ 1, 1, 1, 1, 1 }, 99, 0, 0);
	stats(&s, 2);
	trim(&s, 2, 1);
	open_streaming(&s, "", (struct shape){ STORE_MAX_LAYERS + 1, 1, 1, 1, 1 }, 16, 4);
	open_streaming(&s, "", (struct shape){ UINT32_MAX, 1, 1, 1, 1 }, 16, 4);
	stats(&s, 0);
	seed_write(&s, "max-layers");

	/* batch x kv_heads at STORE_MAX_HEADS: one token is 128 KiB of keys,
	 * so the blocks come through the staging buffer. */
	seed_begin(&s);
	staging(&s, 1u << 20);
	open_per_call(&s, "heads", (struct shape){ 1, 1, STORE_MAX_HEADS, 1, 1 }, 4, NULL);
	update_staged_block(&s, 1, 0, 1, (struct shape){ 1, 1, STORE_MAX_HEADS, 1, 1 });
	update_staged_block(&s, 1, 0, 2, (struct shape){ 1, 1, STORE_MAX_HEADS, 1, 1 });
	update_staged_block(&s, 1, 0, 2, (struct shape){ 1, 1, STORE_MAX_HEADS, 1, 1 });
	stats(&s, 1);
	trim(&s, 1, 1);
	open_streaming(&s, "heads-b", (struct shape){ 1, 256, 256, 1, 1 }, 8, 2);
	update_staged_block(&s, 2, 0, 1, (struct shape){ 1, 256, 256, 1, 1 });
	update_staged_block(&s, 2, 0, 3, (struct shape){ 1, 256, 256, 1, 1 });
	stats(&s, 2);
	open_per_call(&s, "", (struct shape){ 1, 1, STORE_MAX_HEADS + 1, 1, 1 }, 4, NULL);
	open_per_call(&s, "", (struct shape){ 1, 257, 256, 1, 1 }, 4, NULL);
	/* Products that wrap in 32 bits: to 0, and to 1. */
	open_per_call(&s, "", (struct shape){ 1, 65536, 65536, 1, 1 }, 4, NULL);
	open_per_call(&s, "", (struct shape){ 1, UINT32_MAX, UINT32_MAX, 1, 1 }, 4, NULL);
	/* 2 TiB of views: past the bound on mapped bytes. */
	open_per_call(&s, "", (struct shape){ 1, 1, STORE_MAX_HEADS, 1, 1 }, ZC_MAX_BLOCK_TOKENS, NULL);
	seed_write(&s, "max-heads");

	seed_begin(&s);
	staging(&s, 1u << 20);
	/* 1 + 16 + 47 tokens fill max_tokens; one more is refused. */
	open_per_call(&s, "dim", (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM }, 64, NULL);
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM }, 100, 0, 0);
	update_staged_block(&s, 1, 0, 16, (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM });
	update_staged_block(&s, 1, 0, 47, (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM });
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM }, 107, 0, 0);
	open_per_call(&s, "dim-k", (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, 1 }, 8, NULL);
	update_inline(&s, 2, 0, 1, (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, 1 }, 101, 0, 0);
	/* A residual of 2 x 65536 rows of 8 KiB is past the budget: the
	 * first token is refused; with a small residual it is stored. */
	open_streaming(&s, "dim-v", (struct shape){ 1, 1, 1, 1, ZC_MAX_HEAD_DIM }, 1u << 20,
		       STORE_MAX_RESIDUAL_TOKENS);
	update_inline(&s, 3, 0, 1, (struct shape){ 1, 1, 1, 1, ZC_MAX_HEAD_DIM }, 102, 0, 0);
	open_streaming(&s, "dim-v-small", (struct shape){ 1, 1, 1, 1, ZC_MAX_HEAD_DIM }, 1u << 20, 4);
	update_inline(&s, 4, 0, 1, (struct shape){ 1, 1, 1, 1, ZC_MAX_HEAD_DIM }, 108, 0, 0);
	stats(&s, 1);
	stats(&s, 3);
	trim(&s, 1, 8);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM + 1, 1 }, 8, NULL);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, 1, ZC_MAX_HEAD_DIM + 1 }, 8, NULL);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, UINT32_MAX, UINT32_MAX }, 8, NULL);
	/* ~1.5 TiB: within a file's limit, past the bound on mapped bytes. */
	open_per_call(&s, "", (struct shape){ 1, 1, 1, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM },
		      ZC_MAX_BLOCK_TOKENS, NULL);
	seed_write(&s, "max-head-dim");

	/* A residual of STORE_MAX_RESIDUAL_TOKENS: blocks of R-1, 1, R, 2R
	 * and 2R+1 tokens around its flush. */
	seed_begin(&s);
	staging(&s, 1u << 20);
	open_streaming(&s, "residual", (struct shape){ 1, 1, 1, 1, 1 }, ZC_MAX_BLOCK_TOKENS,
		       STORE_MAX_RESIDUAL_TOKENS);
	update_staged_block(&s, 1, 0, STORE_MAX_RESIDUAL_TOKENS - 1, (struct shape){ 1, 1, 1, 1, 1 });
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, 1, 1 }, 103, 0, 0);
	update_staged_block(&s, 1, 0, STORE_MAX_RESIDUAL_TOKENS, (struct shape){ 1, 1, 1, 1, 1 });
	update_staged_block(&s, 1, 0, 2 * STORE_MAX_RESIDUAL_TOKENS, (struct shape){ 1, 1, 1, 1, 1 });
	update_staged_block(&s, 1, 0, 2 * STORE_MAX_RESIDUAL_TOKENS + 1, (struct shape){ 1, 1, 1, 1, 1 });
	stats(&s, 1);
	trim(&s, 1, STORE_MAX_RESIDUAL_TOKENS + 1);
	update_inline(&s, 1, 0, 1, (struct shape){ 1, 1, 1, 1, 1 }, 104, 0, 0);
	trim(&s, 1, 1);
	stats(&s, 1);
	open_streaming(&s, "", (struct shape){ 1, 1, 1, 1, 1 }, 16, STORE_MAX_RESIDUAL_TOKENS + 1);
	open_streaming(&s, "", (struct shape){ 1, 1, 1, 1, 1 }, 16, UINT32_MAX);
	seed_write(&s, "max-residual");

	/* Every limit at once (the layout passes 2^64), then sessions of
	 * ~384 GiB each until the 1 TiB bound on mapped bytes refuses one. */
	seed_begin(&s);
	open_streaming(&s, "", (struct shape){ STORE_MAX_LAYERS, 256, 256, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM },
		       ZC_MAX_BLOCK_TOKENS, STORE_MAX_RESIDUAL_TOKENS);
	open_per_call(&s, "", (struct shape){ STORE_MAX_LAYERS, 256, 256, ZC_MAX_HEAD_DIM, ZC_MAX_HEAD_DIM },
		      ZC_MAX_BLOCK_TOKENS, NULL);
	for (int i = 0; i < 3; i++)
		open_per_call(&s, "", (struct shape){ 1, 1, 1, 1024, 1024 }, ZC_MAX_BLOCK_TOKENS, NULL);
	update_inline(&s, 2, 0, 1, (struct shape){ 1, 1, 1, 1024, 1024 }, 105, 0, 0);
	close_session(&s, 1);
	open_per_call(&s, "", (struct shape){ 1, 1, 1, 1024, 1024 }, ZC_MAX_BLOCK_TOKENS, NULL);
	update_inline(&s, 3, 0, 1, (struct shape){ 1, 1, 1, 1024, 1024 }, 106, 0, 0);
	list(&s);
	stats(&s, 0);
	seed_write(&s, "max-mapped");

	printf("make_corpus: %u seeds in %s\n", n_written, out_dir);
	return 0;
}
