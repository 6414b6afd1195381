/*
 * What each request does. Each handler checks the request against the
 * session before anything changes, then either answers at once (hello,
 * open, list, staging) or queues a job on the session (update_and_fetch,
 * trim, stats, close, attach) so that work on one session stays in order.
 * Each job declares its cost in elements, which decides where it runs
 * (server/session.h). How the answers look on the wire is reply.c's.
 */
#include "dispatch.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "adopt.h"
#include "fault.h"
#include "kv_layout.h"
#include "log.h"
#include "metrics.h"
#include "offload.h"
#include "quota.h"
#include "relief.h"
#include "remote.h"
#include "reply.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "ring.h"
#include "ring_format.h"
#include "staging.h"
#include "store.h"
#include "pool.h"
#include "prefix.h"
#include "wire.h"

/* The store enforces the same shape limits the public header promises
 * (store.h keeps its own names for them until it says ZC_MAX_*). */
_Static_assert(STORE_MAX_LAYERS == ZC_MAX_LAYERS && STORE_MAX_HEADS == ZC_MAX_HEADS &&
	       STORE_MAX_RESIDUAL_TOKENS == ZC_MAX_RESIDUAL_TOKENS &&
	       STORE_NAME_BYTES == ZC_SESSION_NAME_MAX + 1,
	       "store.h and zipcache/client.h disagree on a session limit");

enum job_kind {
	JOB_UPDATE,
	JOB_TRIM,
	JOB_STATS,
	JOB_CLOSE,
	JOB_ATTACH,
	JOB_FORK,
	JOB_EXPORT,
	JOB_IMPORT,
	JOB_RESTORE,   /* an import whose snapshot comes from the remote tier */
	JOB_LOOKUP,
	JOB_PREFIX_FETCH
};

struct request_job {
	struct job job;               /* first: session.c sees only this */
	enum job_kind kind;
	struct request rq;            /* who asked, where the answer goes */
	/* update */
	uint32_t layer, tokens;
	bool retried;                 /* once, after freeing memory */
	bool omit_stats;              /* the caller asked for no stats in the reply */
	bool defer_flush;             /* and so a residual it fills is flushed after the reply */
	const uint16_t *keys, *values;
	bool chunk;                   /* a prefix chunk: chunk_key, chunk_block */
	uint8_t chunk_key[ZC_CHUNK_KEY_BYTES];
	store_block chunk_block;      /* made by update_run, one reference for the index */
	float *mass;                  /* saliency by attention: the request's masses (owned) */
	uint32_t mass_rows, mass_first_token;
	/* lookup_prefix and an open's fetch of remote chunks: the request's
	 * fields (owned), the chunks held here, what the remote tier gave */
	struct wire_open_request *open_copy;
	uint32_t prefix_local, prefix_remote;
	uint64_t prefix_fp;
	struct snapshot_config prefix_config;
	store_block *fetched;         /* [(n - local) * layers]: verified, then one reference each */
	void **records;               /* the fetched records, until written into the pool */
	size_t n_records;
	uint8_t *inline_copy;         /* owns keys/values when they came inline */
	struct staging *staging;      /* holds keys/values when staged */
	/* trim */
	uint32_t trim_tokens, trimmed;
	bool trim_one_layer;
	/* fork */
	struct store_params fork_params;
	char fork_name[STORE_NAME_BYTES];
	struct store *fork_store;     /* made by fork_run, owned by the job until added */
	/* export and import (fork_params, fork_name and fork_store serve an
	 * import as they serve a fork) */
	int snapshot_fd;              /* the client's descriptor, owned; -1 when none */
	bool snapshot_pipe;
	struct snapshot_result exported;
	struct snapshot_expect expect;
	char expect_model_id[ZC_MODEL_ID_MAX + 1];
	bool views_given;
	struct snapshot_header snapshot;  /* as verified */
	struct pool *pool;
	/* restore (an attach of a session offloaded to the remote tier) */
	struct wire_open_request open;
	struct offload_manifest manifest;
	bool manifest_found;
	uint64_t manifest_bytes;
	struct restore_result restored;                        /* for the log line */
	uint64_t restore_start_ns, manifest_ns;
	/* results */
	int rc;
	char message[200];
	uint32_t layer_tokens_before;
	struct store_layer_stats stats;
	uint64_t sequence;
	struct store_layer_stats *layer_stats; /* JOB_STATS: one per layer */
};

/* What an attach request asks that its session does not have. */
struct mismatch {
	char groups[64];    /* "shape, codec" */
	char detail[180];   /* "shape.kv_heads is 2, not 4; codec.hi_bits is 4, not 3" */
	const char *last_group;
};

/* Records one difference of a group (shape, policy, codec, ...). */
__attribute__((format(printf, 3, 4)))
static void mismatch_note(struct mismatch *m, const char *group, const char *format, ...)
{
	size_t used = strlen(m->detail);
	va_list args;

	if (group != m->last_group) {
		size_t g = strlen(m->groups);
		snprintf(m->groups + g, sizeof(m->groups) - g, "%s%s", g ? ", " : "", group);
		m->last_group = group;
	}
	if (used + 3 >= sizeof(m->detail))
		return;
	if (used) {
		memcpy(m->detail + used, "; ", 3);
		used += 2;
	}
	va_start(args, format);
	vsnprintf(m->detail + used, sizeof(m->detail) - used, format, args);
	va_end(args);
}

static const char *policy_text(int policy)
{
	return policy == ZC_POLICY_PER_CALL ? "per_call" : "streaming";
}

/*
 * Whether an attach request fits the session it names, as the session
 * describes itself (reply_session_info). Only what the request gives is
 * compared (zipcache.proto, OpenSessionRequest.attach): the shape when
 * present, max_tokens when not 0, each codec field when present,
 * residual_tokens when present and the session streams, the policy when
 * not STREAMING or when a shape is given (proto3 cannot tell STREAMING
 * from unset; a request with a shape describes a whole session, as the C
 * and Python clients send).
 */
static bool attach_matches(const struct wire_open_request *open, const zc_session_info *h,
			   struct mismatch *m)
{
	static const char shape[] = "shape", tokens[] = "max_tokens", policy_group[] = "policy",
			  residual[] = "residual_tokens", codec[] = "codec";
	const struct wire_codec *c = &open->codec;
	const zc_codec_config *has = &h->codec;
	int policy = open->policy == ZC_POLICY_PER_CALL ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING;

	memset(m, 0, sizeof(*m));
	if (open->has_shape) {
		const struct {
			const char *name;
			uint32_t has, asked;
		} dims[] = {
			{ "layers", h->layers, open->shape.layers },
			{ "batch", h->batch, open->shape.batch },
			{ "kv_heads", h->kv_heads, open->shape.kv_heads },
			{ "head_dim_k", h->head_dim_k, open->shape.head_dim_k },
			{ "head_dim_v", h->head_dim_v, open->shape.head_dim_v },
		};
		for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
			if (dims[i].has != dims[i].asked)
				mismatch_note(m, shape, "shape.%s is %u, not %u", dims[i].name, dims[i].has,
					      dims[i].asked);
	}
	if (open->max_tokens && open->max_tokens != h->max_tokens)
		mismatch_note(m, tokens, "max_tokens is %u, not %u", h->max_tokens, open->max_tokens);
	if ((open->has_shape || open->policy != ZC_POLICY_STREAMING) && policy != (int)h->policy)
		mismatch_note(m, policy_group, "policy is %s, not %s", policy_text((int)h->policy),
			      policy_text(policy));
	/* A per_call session has no residual (it keeps 0, whatever was asked). */
	if (open->has_residual_tokens && h->policy == ZC_POLICY_STREAMING &&
	    open->residual_tokens != h->residual_tokens)
		mismatch_note(m, residual, "residual_tokens is %u, not %u", h->residual_tokens,
			      open->residual_tokens);
	/* proto3 cannot tell VIEWS_FULL from unset: only NONE is a request. */
	if (open->views == ZC_VIEWS_NONE && h->views != ZC_VIEWS_NONE)
		mismatch_note(m, "views", "views is full, not none");
	if (open->has_codec) {
		if (c->has_hi_bits && c->hi_bits != (uint32_t)has->hi_bits)
			mismatch_note(m, codec, "codec.hi_bits is %d, not %u", has->hi_bits, c->hi_bits);
		if (c->has_lo_bits && c->lo_bits != (uint32_t)has->lo_bits)
			mismatch_note(m, codec, "codec.lo_bits is %d, not %u", has->lo_bits, c->lo_bits);
		if (c->has_hi_fraction && c->hi_fraction != has->hi_fraction)
			mismatch_note(m, codec, "codec.hi_fraction is %g, not %g", has->hi_fraction,
				      c->hi_fraction);
		if (c->has_group_size && c->group_size != (uint32_t)has->group_size)
			mismatch_note(m, codec, "codec.group_size is %d, not %u", has->group_size,
				      c->group_size);
		if (c->has_quantize_values && c->quantize_values != has->quantize_values)
			mismatch_note(m, codec, "codec.quantize_values is %s, not %s",
				      has->quantize_values ? "true" : "false",
				      c->quantize_values ? "true" : "false");
		if (c->has_saliency && c->saliency != (uint32_t)has->saliency)
			mismatch_note(m, codec, "codec.saliency is %s, not %s",
				      has->saliency == ZC_SALIENCY_ATTENTION ? "attention" : "key_norm",
				      c->saliency == ZC_SALIENCY_ATTENTION ? "attention" : "key_norm");
	}
	return m->groups[0] == '\0';
}

/* Names go back out in replies as protobuf strings, which other
 * languages' decoders refuse unless they are UTF-8; control characters
 * would garble logs and tables. */
static bool name_acceptable(const char *name)
{
	const unsigned char *p = (const unsigned char *)name;
	while (*p) {
		unsigned char c = *p;
		int extra = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2 :
			    (c & 0xf8) == 0xf0 ? 3 : -1;
		if (extra < 0 || c < 0x20 || c == 0x7f || c == 0xc0 || c == 0xc1 || c > 0xf4)
			return false;
		uint32_t code = extra == 0 ? c : c & (0x3f >> extra);
		for (int i = 1; i <= extra; i++) {
			if ((p[i] & 0xc0) != 0x80)
				return false;
			code = (code << 6) | (p[i] & 0x3f);
		}
		/* Overlong forms, surrogates and values past U+10FFFF. */
		if ((extra == 2 && code < 0x800) || (extra == 3 && (code < 0x10000 || code > 0x10ffff)) ||
		    (code >= 0xd800 && code <= 0xdfff))
			return false;
		p += extra + 1;
	}
	return true;
}

static void attach_submit(const struct request *rq, struct session *session);
/* True when a job was queued that ends the request (a prefix fetch). */
static bool open_request(const struct request *rq, const struct wire_open_request *open,
			 bool may_fetch);
static void job_free(struct request_job *job);
static void job_end(struct request_job *job);

/* Room for one more session, daemon-wide and for the peer's uid; else the
 * refusal is sent and false returned. (open_session and fork_session.) */
static bool session_room(const struct request *rq)
{
	struct server *server = rq->server;
	if (server->sessions.count >= server->options.max_sessions) {
		reply_error(rq, ZC_EEXHAUSTED, "session limit of %u reached",
			    server->options.max_sessions);
		return false;
	}
	uint64_t uid_limit = quota_limits_of(&server->quotas, rq->peer->quota)->sessions;
	if (uid_limit && session_count_of_uid(&server->sessions, rq->peer->uid) >= uid_limit) {
		reply_error(rq, ZC_EEXHAUSTED,
			    "session limit of %llu per uid reached (uid %u; --max-sessions-per-uid)",
			    (unsigned long long)uid_limit, rq->peer->uid);
		return false;
	}
	return true;
}

/* A file adoption could not read yet may hold a session of this name:
 * never make a second one beside it. */
static bool name_not_pending(const struct request *rq, const char *name)
{
	struct server *server = rq->server;
	if (!adopt_blocks_open(server, rq->peer->uid, name))
		return true;
	reply_error(rq, ZC_EEXHAUSTED,
		    "%zu session files could not be adopted yet and may hold session '%s' "
		    "(the daemon's log says why); try again", server->adoption.n_pending, name);
	return false;
}

static bool open_create(const struct request *rq, const struct wire_open_request *open,
			bool may_fetch);
static void restore_submit(const struct request *rq, const struct wire_open_request *open);

/* ---- prefix reuse (docs/PREFIX.md) ---- */

/* The chain keys of a request are whole keys, at most ZC_PREFIX_MAX_CHUNKS
 * (the decoder bounds the bytes). Replies and returns false when not. */
static bool prefix_keys_valid(const struct request *rq, const struct wire_open_request *open)
{
	if (open->prefix_len % ZC_CHUNK_KEY_BYTES) {
		reply_error(rq, ZC_EINVALID,
			    "prefix is %u bytes: chain keys are %u bytes each; nothing was made",
			    open->prefix_len, ZC_CHUNK_KEY_BYTES);
		return false;
	}
	return true;
}

enum prefix_verdict {
	PREFIX_READY,    /* every chunk is held here */
	PREFIX_REFUSED,  /* replied */
	PREFIX_FETCH     /* chunks from *from on are to be fetched from the remote tier */
};

/* An open with a prefix: the prefix within max_tokens and every chunk held
 * for every layer, here or (may_fetch, --remote) in the remote tier. */
static enum prefix_verdict prefix_check(const struct request *rq,
					const struct wire_open_request *open,
					const struct store_params *params, bool may_fetch,
					uint32_t *from)
{
	struct server *server = rq->server;
	if (!prefix_keys_valid(rq, open))
		return PREFIX_REFUSED;
	uint32_t n = open->prefix_len / ZC_CHUNK_KEY_BYTES;
	if ((uint64_t)n * ZC_PREFIX_CHUNK_TOKENS > params->max_tokens) {
		reply_error(rq, ZC_EINVALID,
			    "a prefix of %u chunks is %llu tokens, above max_tokens %u; nothing was made",
			    n, (unsigned long long)n * ZC_PREFIX_CHUNK_TOKENS, params->max_tokens);
		return PREFIX_REFUSED;
	}
	uint64_t fingerprint = prefix_fingerprint_of_params(params);
	uint32_t held = prefix_index_held(&server->prefix, params->owner_uid, fingerprint,
					  open->prefix, n, params->layers);
	if (held == n)
		return PREFIX_READY;
	if (may_fetch && server->remote) {
		*from = held;
		return PREFIX_FETCH;
	}
	reply_error(rq, ZC_ENOTFOUND,
		    "prefix chunk %u of %u is not held for this uid, model id, shape and codec "
		    "(lookup_prefix says how many are); nothing was made", held, n);
	return PREFIX_REFUSED;
}

static struct request_job *job_new_detached(const struct request *rq, enum job_kind kind,
					    const struct wire_open_request *open)
{
	struct request_job *job = calloc(1, sizeof(*job));
	if (!job)
		return NULL;
	job->kind = kind;
	job->rq = *rq;
	job->snapshot_fd = -1;
	job->open_copy = malloc(sizeof(*open));
	if (!job->open_copy) {
		free(job);
		return NULL;
	}
	*job->open_copy = *open;
	return job;
}

/* Verify before create: the records are fetched and checked first
 * (nothing made, not even the uid's pool), then written on the thread
 * pool once the loop gave the pool, then the open runs again. */
static void prefix_written_done(struct job *base);

static void prefix_fetch_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	uint32_t n = job->open_copy->prefix_len / ZC_CHUNK_KEY_BYTES;
	job->rc = prefix_remote_fetch(job->rq.server->remote, job->rq.peer->uid, &job->prefix_config,
				      job->open_copy->prefix, job->prefix_local, n, job->records,
				      job->fetched, job->message, sizeof(job->message));
}

static void prefix_write_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	job->rc = prefix_records_write(job->pool, job->records, job->fetched, job->n_records,
				       job->message, sizeof(job->message));
	prefix_records_free(job->records, job->n_records);
}

static void prefix_fetch_failed(struct request_job *job)
{
	uint32_t n = job->open_copy->prefix_len / ZC_CHUNK_KEY_BYTES;
	reply_error(&job->rq, job->rc == STORE_EBUDGET ? ZC_EEXHAUSTED : job->rc,
		    "prefix chunks %u..%u of %u are not held here and were not fetched: %s; "
		    "nothing was made", job->prefix_local, n - 1, n, job->message);
	job_end(job);
}

static void prefix_verified_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char reason[200] = "";

	if (job->rc < 0) {
		prefix_fetch_failed(job);
		return;
	}
	int rc = pool_set_get(&server->pools, job->rq.peer->uid, &job->rq.peer->quota->memory,
			      &job->pool, NULL, reason, sizeof(reason));
	if (rc < 0) {
		job->rc = ZC_EINTERNAL;
		snprintf(job->message, sizeof(job->message), "cannot use the block pool: %s",
			 reason[0] ? reason : zc_strerror(rc));
		prefix_fetch_failed(job);
		return;
	}
	job->job.run = prefix_write_run;
	job->job.done = prefix_written_done;
	session_table_run_detached(&server->sessions, &job->job);
}

/* The fetched chunks join the index (which takes their references), and
 * the open runs again, now from what is held here. */
static void prefix_written_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	const struct wire_open_request *open = job->open_copy;
	uint32_t n = open->prefix_len / ZC_CHUNK_KEY_BYTES, layers = job->prefix_config.layers;

	if (job->rc < 0) {
		prefix_fetch_failed(job);
		return;
	}
	for (uint32_t i = job->prefix_local; i < n; i++)
		for (uint32_t layer = 0; layer < layers; layer++)
			prefix_index_put(&job->rq.server->prefix, job->rq.peer->uid, job->prefix_fp,
					 open->prefix + (size_t)i * ZC_CHUNK_KEY_BYTES, layer,
					 i * ZC_PREFIX_CHUNK_TOKENS, job->pool,
					 &job->fetched[(size_t)(i - job->prefix_local) * layers + layer]);
	/* Never queued without a fetch (an attach's job begins the request
	 * once more for itself). */
	open_request(&job->rq, open, false);
	job_end(job);
}

/* Queues the fetch of chunks [from, n) of an open's prefix; true when
 * queued (the job answers). */
static bool prefix_fetch_submit(const struct request *rq, const struct wire_open_request *open,
				const struct store_params *params, uint32_t from)
{
	struct server *server = rq->server;
	uint32_t n = open->prefix_len / ZC_CHUNK_KEY_BYTES;
	size_t count = (size_t)(n - from) * params->layers;
	struct request_job *job = job_new_detached(rq, JOB_PREFIX_FETCH, open);
	if (job) {
		job->fetched = calloc(count, sizeof(*job->fetched));
		job->records = calloc(count, sizeof(*job->records));
		job->n_records = count;
	}
	if (!job || !job->fetched || !job->records) {
		if (job)
			job_free(job);
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	job->prefix_local = from;
	prefix_config_of_params(params, &job->prefix_config);
	job->prefix_fp = prefix_fingerprint(&job->prefix_config);
	job->job.run = prefix_fetch_run;
	job->job.done = prefix_verified_done;
	session_table_run_detached(&server->sessions, &job->job);
	return true;
}

/*
 * The store of a new session: empty, or (a prefix) built as an import is,
 * every layer starting with the chunks' blocks shared by reference from
 * the chunk index (prefix_check found them all, and nothing ran since).
 */
static int open_store(struct server *server, const struct store_params *params,
		      struct store_budget *budget, struct pool *pool,
		      const struct wire_open_request *open, struct store **out)
{
	uint32_t n = open->prefix_len / ZC_CHUNK_KEY_BYTES;
	if (n == 0)
		return store_create(server->shm_dir_fd, server->options.shm_dir, params, budget, pool,
				    out);
	uint64_t fingerprint = prefix_fingerprint_of_params(params);
	struct store *store;
	int rc = store_import_begin(server->shm_dir_fd, server->options.shm_dir, params, budget,
				    pool, &store);
	if (rc < 0)
		return rc;
	for (uint32_t layer = 0; rc == 0 && layer < params->layers; layer++) {
		for (uint32_t i = 0; rc == 0 && i < n; i++) {
			struct pool *held_in = NULL;
			const store_block *block = prefix_index_get(
				&server->prefix, params->owner_uid, fingerprint,
				open->prefix + (size_t)i * ZC_CHUNK_KEY_BYTES, layer,
				i * ZC_PREFIX_CHUNK_TOKENS, &held_in);
			if (!block || held_in != pool)  /* never: prefix_check found them */
				rc = ZC_EINTERNAL;
			else
				rc = store_import_shared_block(store, layer, block);
		}
		if (rc == 0)
			rc = store_import_layer(store, layer, n * ZC_PREFIX_CHUNK_TOKENS, 0, NULL, NULL);
	}
	if (rc == 0)
		rc = store_import_commit(store);
	else
		store_import_abandon(store);
	if (rc == 0)
		*out = store;
	return rc;
}

static void lookup_reply(const struct request *rq, uint32_t local, uint32_t remote)
{
	wire_response response;
	wire_response_init(&response, rq->id, WIRE_OP_LOOKUP_PREFIX);
	response.lookup_prefix.chunks = local + remote;
	response.lookup_prefix.tokens = (local + remote) * ZC_PREFIX_CHUNK_TOKENS;
	response.lookup_prefix.local_chunks = local;
	reply_send(rq, &response, NULL, 0);
}

static void lookup_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	uint32_t n = job->open_copy->prefix_len / ZC_CHUNK_KEY_BYTES;
	job->rc = prefix_remote_count(job->rq.server->remote, job->rq.peer->uid, job->prefix_fp,
				      job->open_copy->prefix, job->prefix_local, n,
				      job->prefix_config.layers, &job->prefix_remote);
}

/* A remote tier that failed leaves the answer at what is held here. */
static void lookup_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	lookup_reply(&job->rq, job->prefix_local, job->rc < 0 ? 0 : job->prefix_remote);
	job_end(job);
}

/* lookup_prefix: the chunk index, then (with --remote, for the chunks not
 * held here) the remote tier from the thread pool. True when queued. */
static bool handle_lookup(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	const struct wire_open_request *lookup = &request->lookup_prefix;

	if (!prefix_keys_valid(rq, lookup))
		return false;
	if (!lookup->has_shape || lookup->shape.layers == 0 || lookup->shape.layers > ZC_MAX_LAYERS) {
		reply_error(rq, ZC_EINVALID, "lookup_prefix needs the session's shape (1..%u layers)",
			    ZC_MAX_LAYERS);
		return false;
	}
	struct store_params params = {
		.owner_uid = rq->peer->uid,
		.layers = lookup->shape.layers,
		.batch = lookup->shape.batch,
		.kv_heads = lookup->shape.kv_heads,
		.head_dim_k = lookup->shape.head_dim_k,
		.head_dim_v = lookup->shape.head_dim_v,
		.model_id = lookup->model_id,
	};
	zc_codec_config_default(&params.codec);
	if (lookup->has_codec)
		wire_codec_to_config(&lookup->codec, &params.codec);
	uint32_t n = lookup->prefix_len / ZC_CHUNK_KEY_BYTES;
	uint64_t fingerprint = prefix_fingerprint_of_params(&params);
	uint32_t held = prefix_index_held(&server->prefix, rq->peer->uid, fingerprint, lookup->prefix,
					  n, params.layers);
	if (held == n || !server->remote) {
		lookup_reply(rq, held, 0);
		return false;
	}
	struct request_job *job = job_new_detached(rq, JOB_LOOKUP, lookup);
	if (!job) {
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	job->prefix_local = held;
	job->prefix_fp = fingerprint;
	prefix_config_of_params(&params, &job->prefix_config);
	job->job.run = lookup_run;
	job->job.done = lookup_done;
	session_table_run_detached(&server->sessions, &job->job);
	return true;
}

static bool open_request(const struct request *rq, const struct wire_open_request *open,
			 bool may_fetch)
{
	struct server *server = rq->server;
	struct session *session;
	char name[STORE_NAME_BYTES];

	if (!name_acceptable(open->name) || !name_acceptable(open->model_id)) {
		reply_error(rq, ZC_EINVALID,
			    "session names and model ids must be UTF-8 without control characters");
		return false;
	}
	if (open->name[0]) {
		snprintf(name, sizeof(name), "%s", open->name);
		session = session_find_name(&server->sessions, name, rq->peer->uid);
		if (session && !open->attach) {
			reply_error(rq, ZC_EEXISTS, "session '%s' already exists (id %llu)",
				    name, (unsigned long long)session->id);
			return false;
		}
		if (session) {
			struct mismatch m;
			zc_session_info has;
			reply_session_info(session, &has);
			if (!attach_matches(open, &has, &m)) {
				reply_error(rq, ZC_EINVALID,
					    "session '%s' exists with a different %s: %s; nothing was changed",
					    name, m.groups, m.detail);
				return false;
			}
			/* Dropped views are rebuilt by a job in the session's
			 * line, which replies. */
			attach_submit(rq, session);
			return false;
		}
		/* Not here: perhaps offloaded, by this node or another. The
		 * restore's job begins its own request, as an attach's does. */
		if (open->attach && server->remote) {
			restore_submit(rq, open);
			return false;
		}
	}
	return open_create(rq, open, may_fetch);
}

/* open_session's making of a new session (no session of the name exists).
 * True when a job took the request over (a prefix's chunks to fetch). */
static bool open_create(const struct request *rq, const struct wire_open_request *open,
			bool may_fetch)
{
	struct server *server = rq->server;
	struct session *session;
	struct store *store;
	char name[STORE_NAME_BYTES];
	int rc;

	if (open->name[0])
		snprintf(name, sizeof(name), "%s", open->name);
	if (!open->has_shape) {
		reply_error(rq, ZC_EINVALID, "open_session needs a shape");
		return false;
	}
	if (open->max_tokens == 0 || open->max_tokens > server->options.max_tokens) {
		reply_error(rq, open->max_tokens ? ZC_EEXHAUSTED : ZC_EINVALID,
			    "max_tokens %u is outside 1..%u", open->max_tokens,
			    server->options.max_tokens);
		return false;
	}
	if (open->shape.layers > ZC_MAX_LAYERS) {
		reply_error(rq, ZC_EINVALID, "layers %u is above the limit of %u",
			    open->shape.layers, ZC_MAX_LAYERS);
		return false;
	}
	const struct wire_shape *shape = &open->shape;
	if (!shape->layers || !shape->batch || !shape->kv_heads || !shape->head_dim_k || !shape->head_dim_v) {
		reply_error(rq, ZC_EINVALID,
			    "every dimension of the shape must be at least 1 (layers %u, batch %u, "
			    "kv_heads %u, head_dim_k %u, head_dim_v %u)", shape->layers, shape->batch,
			    shape->kv_heads, shape->head_dim_k, shape->head_dim_v);
		return false;
	}
	if ((uint64_t)shape->batch * shape->kv_heads > ZC_MAX_HEADS) {
		reply_error(rq, ZC_EINVALID,
			    "batch x kv_heads is %llu; the limit is %u",
			    (unsigned long long)shape->batch * shape->kv_heads, ZC_MAX_HEADS);
		return false;
	}
	if (shape->head_dim_k > ZC_MAX_HEAD_DIM || shape->head_dim_v > ZC_MAX_HEAD_DIM) {
		reply_error(rq, ZC_EINVALID,
			    "head_dim_k %u, head_dim_v %u: the limit is %u", shape->head_dim_k,
			    shape->head_dim_v, ZC_MAX_HEAD_DIM);
		return false;
	}
	if (open->policy == ZC_POLICY_STREAMING && open->has_residual_tokens &&
	    (open->residual_tokens == 0 || open->residual_tokens > ZC_MAX_RESIDUAL_TOKENS)) {
		reply_error(rq, ZC_EINVALID,
			    "residual_tokens %u is outside 1..%u", open->residual_tokens,
			    ZC_MAX_RESIDUAL_TOKENS);
		return false;
	}
	if (!session_room(rq))
		return false;
	if (open->policy != ZC_POLICY_STREAMING && open->policy != ZC_POLICY_PER_CALL) {
		reply_error(rq, ZC_EINVALID, "unknown block policy %d", (int)open->policy);
		return false;
	}

	struct store_params params = {
		.session_id = server->sessions.next_id,
		.boot_epoch = server->boot_epoch,
		.owner_uid = rq->peer->uid,
		.name = name,
		.layers = open->shape.layers,
		.batch = open->shape.batch,
		.kv_heads = open->shape.kv_heads,
		.head_dim_k = open->shape.head_dim_k,
		.head_dim_v = open->shape.head_dim_v,
		.max_tokens = open->max_tokens,
		.policy = open->policy == ZC_POLICY_PER_CALL ? STORE_POLICY_PER_CALL :
							       STORE_POLICY_STREAMING,
		.residual_tokens = open->has_residual_tokens ? open->residual_tokens :
							       ZC_DEFAULT_RESIDUAL_TOKENS,
		.views = open->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL,
		.model_id = open->model_id,
	};
	if (!open->name[0])
		snprintf(name, sizeof(name), "session-%llu", (unsigned long long)params.session_id);
	zc_codec_config_default(&params.codec);
	if (open->has_codec)
		wire_codec_to_config(&open->codec, &params.codec);
	if (!name_not_pending(rq, name))
		return false;
	if (open->prefix_len) {
		uint32_t from = 0;
		enum prefix_verdict verdict = prefix_check(rq, open, &params, may_fetch, &from);
		if (verdict == PREFIX_REFUSED)
			return false;
		if (verdict == PREFIX_FETCH)
			return prefix_fetch_submit(rq, open, &params, from);
	}
	struct store_budget *budget = &rq->peer->quota->memory;
	struct pool *pool = NULL;
	char pool_reason[200] = "";
	rc = pool_set_get(&server->pools, rq->peer->uid, budget, &pool, NULL, pool_reason,
			  sizeof(pool_reason));
	if (rc == ZC_ECORRUPT) {
		reply_error(rq, ZC_EINTERNAL, "cannot use the block pool of uid %u: %s",
			    (unsigned)rq->peer->uid, pool_reason);
		return false;
	}
	if (rc == 0)
		rc = open_store(server, &params, budget, pool, open, &store);
	for (int tries = 0; rc == ZC_EEXISTS && tries < 3; tries++) {
		/* A file nobody adopted holds this id: take the next. */
		params.session_id = ++server->sessions.next_id;
		if (!open->name[0])
			snprintf(name, sizeof(name), "session-%llu",
				 (unsigned long long)params.session_id);
		rc = open_store(server, &params, budget, pool, open, &store);
	}
	char why[200];
	/* Memory relief for a new session's first pages (a chunk of them),
	 * then one more try; a second refusal is the answer. */
	for (bool tried = false; rc == STORE_EBUDGET; tried = true) {
		if (relief_run(server, 1u << 20, NULL, rq->peer->uid, tried, why, sizeof(why)) < 0) {
			reply_error(rq, ZC_EEXHAUSTED, "%s", why);
			return false;
		}
		rc = open_store(server, &params, budget, pool, open, &store);
	}
	uint64_t layout_bytes = 0;
	if (rc == ZC_EEXHAUSTED && store_layout_bytes(&params, &layout_bytes) != ZC_ESHAPE &&
	    (layout_bytes == 0 || store_mapped_bytes_total() + layout_bytes > store_map_limit())) {
		reply_error(rq, rc,
			    "cannot open session '%s': its layout needs %llu bytes of address space (0: more "
			    "than fits); "
			    "one session may map at most %llu, and all of them --max-mapped-bytes %llu "
			    "(%llu mapped)", name, (unsigned long long)layout_bytes,
			    (unsigned long long)store_max_file_bytes(), (unsigned long long)store_map_limit(),
			    (unsigned long long)store_mapped_bytes_total());
		return false;
	}
	if (rc < 0) {
		reply_error(rq, rc == ZC_ESHAPE ? ZC_EINVALID : rc,
			    "cannot open session '%s': %s", name, reply_resource_text(server, rc, why, sizeof(why)));
		return false;
	}
	server->sessions.next_id++;
	rc = session_table_add(&server->sessions, store, &session);
	if (rc < 0) {
		store_close(store, true);
		reply_error(rq, rc,
			    "cannot open session '%s': %s; the session was not created", name,
			    reply_resource_text(server, rc, why, sizeof(why)));
		return false;
	}
	session_lease(session, rq->peer->id, session_now_ms() + server->options.lease_seconds * 1000);
	if (reply_open(rq, session, false) < 0) {
		/* The client was told why, or is gone: take back what was made,
		 * so a retry starts from nothing (not ALREADY_EXISTS). */
		log_warn("session", "open undone", "session=%llu name=%s uid=%u",
			 (unsigned long long)session->id, session->name, session->owner_uid);
		session_retire(&server->sessions, session, true);
		session_release_if_unused(session);
		return false;
	}
	log_info("session", "opened", "session=%llu name=%s uid=%u layers=%u batch=%u kv_heads=%u "
		 "head_dim_k=%u head_dim_v=%u max_tokens=%u policy=%s",
		 (unsigned long long)session->id, session->name, session->owner_uid, params.layers,
		 params.batch, params.kv_heads, params.head_dim_k, params.head_dim_v,
		 params.max_tokens, params.policy == STORE_POLICY_PER_CALL ? "per_call" : "streaming");
	return false;
}

static bool handle_open(const struct request *rq, const wire_request *request)
{
	return open_request(rq, &request->open_session, true);
}

/* ---- jobs: update_and_fetch, trim, stats, close, attach ---- */

static void job_free(struct request_job *job)
{
	offload_manifest_free(&job->manifest);
	if (job->snapshot_fd >= 0)
		close(job->snapshot_fd);
	free(job->inline_copy);
	free(job->mass);
	free(job->open_copy);
	free(job->fetched);
	prefix_records_free(job->records, job->n_records);
	free(job->records);
	staging_unref(job->staging);
	free(job->layer_stats);
	free(job);
}

/* The job's request is answered: the responder may let go of it. */
static void job_end(struct request_job *job)
{
	job->rq.responder->ops->end(job->rq.responder);
	job_free(job);
}

static void job_fail(struct request_job *job, int rc, const char *format, ...)
	__attribute__((format(printf, 3, 4)));

static void job_fail(struct request_job *job, int rc, const char *format, ...)
{
	va_list args;
	job->rc = rc;
	va_start(args, format);
	vsnprintf(job->message, sizeof(job->message), format, args);
	va_end(args);
}

static void update_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct store *store = base->session->store;
	const struct store_header *h = store_header(store);
	int rc;

	if (base->session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)base->session->id);
		return;
	}
	job->layer_tokens_before = store_layer_tokens(store, job->layer);
	if (job->chunk && job->layer_tokens_before % ZC_PREFIX_CHUNK_TOKENS) {
		job_fail(job, ZC_EPRECONDITION,
			 "a chunk-keyed block must start at a multiple of %u tokens; layer %u holds %u; "
			 "nothing was stored", ZC_PREFIX_CHUNK_TOKENS, job->layer,
			 job->layer_tokens_before);
		return;
	}
	/* Before the append, so the flush it may cause ranks by them;
	 * refused masses leave the layer as it was. */
	if (job->mass) {
		rc = store_residual_mass(store, job->layer, job->mass_first_token, job->mass_rows,
					 job->mass);
		if (rc == ZC_ESHAPE) {
			job_fail(job, ZC_EINVALID,
				 "attention_mass names tokens %u..%u of layer %u, which holds %u "
				 "tokens (residual of at most %u rows); nothing was stored",
				 job->mass_first_token, job->mass_first_token + job->mass_rows - 1,
				 job->layer, job->layer_tokens_before, h->residual_capacity);
			return;
		}
		if (rc == ZC_ENONFINITE) {
			job_fail(job, ZC_EINVALID, "attention_mass holds a NaN, infinite or negative "
				 "mass; nothing was stored");
			return;
		}
		if (rc < 0) {
			job_fail(job, rc, "attention_mass of layer %u refused: %s; nothing was stored",
				 job->layer, zc_strerror(rc));
			return;
		}
	}
	rc = job->chunk ? store_append_block(store, job->layer, job->tokens, job->keys, job->values,
					     &job->chunk_block) :
			  store_append(store, job->layer, job->tokens, job->keys, job->values,
				       job->defer_flush);
	if (rc == ZC_EPRECONDITION && job->chunk) {
		job_fail(job, rc, "layer %u has residual rows: chunk-keyed blocks come first, before "
			 "any ordinary block; nothing was stored", job->layer);
		return;
	}
	if (rc == ZC_ENONFINITE) {
		/* Which tensor is bad is worth saying; only a failure pays for it. */
		bool keys_bad = zc_fp16_check_finite(job->keys, kv_block_elements(h->batch, h->kv_heads,
										 job->tokens, h->head_dim_k)) < 0;
		job_fail(job, rc, "%s contain NaN or Inf; nothing was stored", keys_bad ? "keys" : "values");
		return;
	}
	if (rc == ZC_EEXHAUSTED && job->layer_tokens_before + (uint64_t)job->tokens > h->max_tokens) {
		job_fail(job, rc, "layer %u holds %u tokens; %u more exceed max_tokens %u; nothing was stored",
			 job->layer, job->layer_tokens_before, job->tokens, h->max_tokens);
		return;
	}
	if (rc == STORE_EBUDGET) {
		/* update_done may free memory and run the job again. */
		job->rc = rc;
		return;
	}
	if (rc < 0) {
		job_fail(job, rc, "update of layer %u failed: %s; nothing was stored", job->layer,
			 zc_strerror(rc));
		return;
	}
	store_layer_stats(store, job->layer, &job->stats);
	job->sequence = store_layer_sequence(store, job->layer);
}

/*
 * A job the memory budget refused goes through memory relief (relief.h):
 * if that freed anything, the job runs once more ahead of the session's
 * other jobs (nothing was stored the first time, so running it again is
 * safe) and this returns true. Else the job fails with the refusal's
 * sentence followed by `what`.
 */
static bool job_relieve_or_fail(struct request_job *job, uint64_t wanted, const char *what)
{
	struct server *server = job->rq.server;
	struct session *session = job->job.session;
	char why[200];

	if (relief_run(server, wanted, session, session->owner_uid, job->retried, why,
		       sizeof(why)) == 0) {
		job->retried = true;
		job->rc = 0;
		session_submit_front(&server->sessions, &job->job);
		return true;
	}
	job_fail(job, ZC_EEXHAUSTED, "%s; %s", why, what);
	return false;
}

/*
 * A chunk's block written to the remote tier (docs/PREFIX.md), on the
 * thread pool, after the update that made it committed: it holds a
 * reference on the block until it is done. A failure costs nothing but
 * the remote copy (the remote room counts and logs it).
 */
struct chunk_publish_job {
	struct job job;               /* first: session.c sees only this */
	struct remote *remote;
	uint32_t uid, layer;
	uint64_t fingerprint;
	uint8_t key[ZC_CHUNK_KEY_BYTES];
	struct pool *pool;
	store_block block;
	int rc;
};

static void chunk_publish_run(struct job *base)
{
	struct chunk_publish_job *job = (struct chunk_publish_job *)base;
	job->rc = prefix_remote_publish(job->remote, job->uid, job->fingerprint, job->key, job->layer,
					job->pool, &job->block);
}

static void chunk_publish_done(struct job *base)
{
	struct chunk_publish_job *job = (struct chunk_publish_job *)base;
	if (job->rc < 0)
		log_warn("prefix", "chunk not written to the remote tier", "uid=%u layer=%u error=%s",
			 job->uid, job->layer, zc_error_name(job->rc));
	pool_unref(job->pool, job->block.key_offset);
	free(job);
}

static void chunk_publish(struct server *server, uint32_t uid, uint64_t fingerprint,
			  const uint8_t *key, uint32_t layer, struct pool *pool,
			  const store_block *block)
{
	struct chunk_publish_job *job = calloc(1, sizeof(*job));
	if (!job)
		return;  /* the remote copy is a cache: a miss later */
	job->remote = server->remote;
	job->uid = uid;
	job->layer = layer;
	job->fingerprint = fingerprint;
	memcpy(job->key, key, sizeof(job->key));
	job->pool = pool;
	job->block = *block;
	pool_ref(pool, block->key_offset);
	job->job.run = chunk_publish_run;
	job->job.done = chunk_publish_done;
	session_table_run_detached(&server->sessions, &job->job);
}

static void update_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	const struct request *rq = &job->rq;

	if (job->rc == STORE_EBUDGET) {
		const struct store_header *h = store_header(base->session->store);
		/* Room for this block's views and compressed bytes, and a chunk. */
		uint64_t wanted = 2 * (kv_block_bytes(h->batch, h->kv_heads, job->tokens, h->head_dim_k) +
				       kv_block_bytes(h->batch, h->kv_heads, job->tokens, h->head_dim_v)) +
				  (2u << 20);
		if (job_relieve_or_fail(job, wanted, "nothing was stored"))
			return;
	}

	if (job->rc < 0) {
		reply_error(rq, job->rc, "%s", job->message);
	} else {
		wire_response response;
		wire_response_init(&response, rq->id, WIRE_OP_UPDATE_AND_FETCH);
		response.update_and_fetch.tokens = job->stats.tokens;
		response.update_and_fetch.has_stats = !job->omit_stats;
		if (!job->omit_stats)
			reply_layer_stats(&job->stats, &response.update_and_fetch.stats);
		response.update_and_fetch.sequence = job->sequence;
		rq->server->counters.tokens_appended += job->tokens;
		rq->peer->quota->tokens_appended += job->tokens;
		session_account_layer(&rq->server->sessions, base->session, &job->stats);
		if (job->chunk) {
			struct store *store = base->session->store;
			uint64_t fingerprint = prefix_fingerprint_of_store(store_header(store));
			if (rq->server->remote)
				chunk_publish(rq->server, base->session->owner_uid, fingerprint,
					      job->chunk_key, job->layer, store_pool(store),
					      &job->chunk_block);
			prefix_index_put(&rq->server->prefix, base->session->owner_uid, fingerprint,
					 job->chunk_key, job->layer, job->layer_tokens_before,
					 store_pool(store), &job->chunk_block);
		}
		reply_send(rq, &response, NULL, 0);
		if (job->defer_flush)
			session_flush_start(&rq->server->sessions, base->session, job->layer);
	}
	job_end(job);
}

/*
 * Whether an update may start while deferred flushes of its session are
 * pending: on a layer without one, yes (a caller that wants stats gets
 * them after every flush of its layer, as it always did); beside one, only
 * a short block that fits the residual's capacity past the rows the flush
 * holds, and only for a caller that asked for no stats.
 */
static bool update_may_overlap_flush(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct store *store = base->session->store;
	if (!store_flush_pending(store, job->layer))
		return true;
	return job->defer_flush && store_append_fits(store, job->layer, job->tokens);
}

static struct request_job *job_new(const struct request *rq, struct session *session,
				   enum job_kind kind)
{
	struct request_job *job = calloc(1, sizeof(*job));
	if (!job)
		return NULL;
	job->kind = kind;
	job->rq = *rq;
	job->snapshot_fd = -1;
	job->job.session = session;
	/* Every call on a session renews the caller's lease on its views. */
	session_lease(session, rq->peer->id,
		      session_now_ms() + rq->server->options.lease_seconds * 1000);
	return job;
}

/*
 * An update's attention masses (saliency by attention, docs/ATTEND.md):
 * checked against the session's shape and copied into the job (the frame
 * goes when the request returns; the copy is aligned for float). A bad
 * one is answered here, before anything is queued: -1.
 */
static int update_mass_copy(const struct request *rq, const struct session *session,
			    const struct wire_update_request *update, struct request_job *job)
{
	const struct store_header *h = store_header(session->store);
	uint64_t row_bytes = (uint64_t)h->batch * h->kv_heads * sizeof(float);
	size_t len = update->attention_mass.len;

	if (store_codec(session->store).saliency != ZC_SALIENCY_ATTENTION) {
		reply_error(rq, ZC_EINVALID, "attention_mass sent to session %llu, whose saliency is "
			    "key_norm; nothing was stored", (unsigned long long)session->id);
		return -1;
	}
	if (len % row_bytes != 0 || len / row_bytes > h->residual_capacity) {
		reply_error(rq, ZC_EINVALID,
			    "attention_mass is %zu bytes: it must be float32 [batch %u][kv_heads %u]"
			    "[n] with 1 <= n <= %u (the residual's rows); nothing was stored",
			    len, h->batch, h->kv_heads, h->residual_capacity);
		return -1;
	}
	job->mass = malloc(len);
	if (!job->mass) {
		reply_error(rq, -ENOMEM, "out of memory");
		return -1;
	}
	memcpy(job->mass, update->attention_mass.data, len);
	job->mass_rows = (uint32_t)(len / row_bytes);
	job->mass_first_token = update->mass_first_token;
	return 0;
}

/* Returns true when a job was queued (it finishes the request). */
static bool handle_update(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	const struct wire_update_request *update = &request->update_and_fetch;
	struct session *session = session_find(&server->sessions, update->session_id, rq->peer->uid);

	if (!session) {
		reply_error(rq, ZC_ENOTFOUND, "no session %llu",
			    (unsigned long long)update->session_id);
		return false;
	}
	const struct store_header *h = store_header(session->store);
	if (update->layer >= h->layers) {
		reply_error(rq, ZC_EINVALID, "layer %u out of range: session has %u layers",
			    update->layer, h->layers);
		return false;
	}
	if (update->tokens == 0) {
		reply_error(rq, ZC_EINVALID, "a block needs at least one token");
		return false;
	}
	if (update->tokens > h->max_tokens) {
		reply_error(rq, ZC_EEXHAUSTED,
			    "a block of %u tokens exceeds max_tokens %u; nothing was stored",
			    update->tokens, h->max_tokens);
		return false;
	}
	if (update->chunk_key_len && update->chunk_key_len != ZC_CHUNK_KEY_BYTES) {
		reply_error(rq, ZC_EINVALID, "a chunk key is %u bytes, not %u; nothing was stored",
			    ZC_CHUNK_KEY_BYTES, update->chunk_key_len);
		return false;
	}
	if (update->chunk_key_len && update->tokens != ZC_PREFIX_CHUNK_TOKENS) {
		reply_error(rq, ZC_EINVALID,
			    "a chunk-keyed block is %u tokens (ZC_PREFIX_CHUNK_TOKENS), not %u; nothing "
			    "was stored", ZC_PREFIX_CHUNK_TOKENS, update->tokens);
		return false;
	}
	uint64_t key_bytes = kv_block_bytes(h->batch, h->kv_heads, update->tokens, h->head_dim_k);
	uint64_t value_bytes = kv_block_bytes(h->batch, h->kv_heads, update->tokens, h->head_dim_v);
	struct request_job *job = NULL;

	if (update->staged) {
		struct staging *staging = rq->peer->staging;
		if (!staging) {
			reply_error(rq, ZC_EPRECONDITION,
				    "staged update without a staging buffer: request one first");
			return false;
		}
		if (update->keys.len || update->values.len) {
			reply_error(rq, ZC_EINVALID, "a staged update carries no inline bytes");
			return false;
		}
		if ((update->keys_offset | update->values_offset) & 1 ||
		    update->keys_offset > staging->bytes || key_bytes > staging->bytes - update->keys_offset ||
		    update->values_offset > staging->bytes ||
		    value_bytes > staging->bytes - update->values_offset) {
			reply_error(rq, ZC_EINVALID,
				    "staging offsets out of range: keys %llu+%llu, values %llu+%llu bytes "
				    "in a %llu-byte buffer (offsets must be even)",
				    (unsigned long long)update->keys_offset, (unsigned long long)key_bytes,
				    (unsigned long long)update->values_offset,
				    (unsigned long long)value_bytes, (unsigned long long)staging->bytes);
			return false;
		}
		job = job_new(rq, session, JOB_UPDATE);
		if (!job)
			goto out_nomem;
		job->staging = staging;
		staging_ref(staging);
		job->keys = (const uint16_t *)(staging->base + update->keys_offset);
		job->values = (const uint16_t *)(staging->base + update->values_offset);
	} else {
		if (update->keys.len + update->values.len > server->options.max_inline_bytes) {
			reply_error(rq, ZC_EEXHAUSTED,
				    "inline K/V of %zu bytes exceed the limit of %u: send large blocks "
				    "through the staging buffer; nothing was stored",
				    update->keys.len + update->values.len,
				    server->options.max_inline_bytes);
			return false;
		}
		if (update->keys.len != key_bytes || update->values.len != value_bytes) {
			reply_error(rq, ZC_EINVALID,
				    "byte lengths do not match the shape: keys %zu and values %zu bytes, "
				    "but [batch %u, kv_heads %u, tokens %u] with head dims %u/%u needs %llu and %llu",
				    update->keys.len, update->values.len, h->batch, h->kv_heads,
				    update->tokens, h->head_dim_k, h->head_dim_v,
				    (unsigned long long)key_bytes, (unsigned long long)value_bytes);
			return false;
		}
		job = job_new(rq, session, JOB_UPDATE);
		if (!job)
			goto out_nomem;
		/* The frame is consumed when we return; the job keeps a copy,
		 * which is also suitably aligned for uint16_t. */
		job->inline_copy = malloc(key_bytes + value_bytes);
		if (!job->inline_copy)
			goto out_nomem;
		memcpy(job->inline_copy, update->keys.data, key_bytes);
		memcpy(job->inline_copy + key_bytes, update->values.data, value_bytes);
		job->keys = (const uint16_t *)job->inline_copy;
		job->values = (const uint16_t *)(job->inline_copy + key_bytes);
	}
	if (update->attention_mass.len && update_mass_copy(rq, session, update, job) < 0) {
		job_free(job);
		return false;
	}
	job->layer = update->layer;
	job->tokens = update->tokens;
	job->omit_stats = update->omit_stats;
	job->chunk = update->chunk_key_len == ZC_CHUNK_KEY_BYTES;
	memcpy(job->chunk_key, update->chunk_key, sizeof(job->chunk_key));
	/* A caller that wants no stats does not wait for the flush either (a
	 * chunk-keyed block leaves no residual to flush). */
	job->defer_flush = update->omit_stats && h->policy == STORE_POLICY_STREAMING && !job->chunk;
	job->job.run = update_run;
	job->job.done = update_done;
	job->job.may_overlap_flush = update_may_overlap_flush;
	/* The block, the residual it fills (a decode step that compresses
	 * residual_tokens rows, unless that flush is deferred), and the
	 * layer's views if they were dropped. */
	bool compresses = job->defer_flush ? update->tokens >= h->residual_tokens :
					     store_update_compresses(session->store, update->layer,
								     update->tokens);
	uint64_t rows = h->policy == STORE_POLICY_STREAMING && compresses ?
			(uint64_t)h->residual_tokens + update->tokens : update->tokens;
	job->job.cost = kv_block_elements(h->batch, h->kv_heads, rows, h->head_dim_k) +
			kv_block_elements(h->batch, h->kv_heads, rows, h->head_dim_v) +
			store_rebuild_elements(session->store, update->layer);
	session_submit(&server->sessions, &job->job);
	return true;

out_nomem:
	if (job)
		job_free(job);
	reply_error(rq, -ENOMEM, "out of memory");
	return false;
}

/* Every layer's accounting, taken while the job owns the session. */
static void stats_snapshot(struct request_job *job)
{
	struct store *store = job->job.session->store;
	uint32_t layers = store_header(store)->layers;
	job->layer_stats = calloc(layers, sizeof(*job->layer_stats));
	if (!job->layer_stats)
		return;
	for (uint32_t i = 0; i < layers; i++)
		store_layer_stats(store, i, &job->layer_stats[i]);
}

/* On the loop thread: the snapshot moves the daemon-wide totals. */
static void stats_account(struct request_job *job)
{
	struct session *session = job->job.session;
	if (!job->layer_stats)
		return;
	for (uint32_t i = 0; i < store_header(session->store)->layers; i++)
		session_account_layer(&job->rq.server->sessions, session, &job->layer_stats[i]);
}

static void trim_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	uint32_t low, high;
	if (base->session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)base->session->id);
		return;
	}
	if (job->trim_one_layer)
		job->rc = store_trim_layer(base->session->store, job->layer, job->trim_tokens,
					   &job->trimmed);
	else
		job->rc = store_trim(base->session->store, job->trim_tokens, &job->trimmed);
	if (job->rc == ZC_EINVALID) {
		job_fail(job, job->rc, "layer %u out of range: session has %u layers", job->layer,
			 store_header(base->session->store)->layers);
		return;
	}
	if (job->rc < 0) {
		job_fail(job, job->rc, "trim failed: %s; nothing was trimmed", zc_strerror(job->rc));
		return;
	}
	store_token_range(base->session->store, &low, &high);
	job->stats.tokens = high;
	stats_snapshot(job);
}

static void trim_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	stats_account(job);
	if (job->rc < 0) {
		reply_error(&job->rq, job->rc, "%s", job->message);
	} else {
		wire_response response;
		wire_response_init(&response, job->rq.id, WIRE_OP_TRIM);
		response.trim.trimmed = job->trimmed;
		response.trim.tokens = job->stats.tokens;
		reply_send(&job->rq, &response, NULL, 0);
	}
	job_end(job);
}

static void stats_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	if (base->session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)base->session->id);
		return;
	}
	/* A session whose views were dropped is being used again. */
	int rc = job->job.observe_only ? 0 : store_rebuild_views(base->session->store);
	if (rc == STORE_EBUDGET) {
		/* stats_done may free memory and run the job again. */
		job->rc = rc;
		return;
	}
	if (rc < 0) {
		job_fail(job, rc, "cannot rebuild the views: %s", zc_strerror(rc));
		return;
	}
	stats_snapshot(job);
	if (!job->layer_stats)
		job_fail(job, -ENOMEM, "out of memory");
}

static void stats_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;

	if (job->rc == STORE_EBUDGET &&
	    job_relieve_or_fail(job, store_rebuild_bytes(base->session->store),
				"cannot rebuild the views"))
		return;
	if (job->rc < 0) {
		reply_error(&job->rq, job->rc, "%s", job->message);
	} else {
		stats_account(job);
		reply_session_stats(&job->rq, base->session, job->layer_stats);
	}
	job_end(job);
}

static void close_run(struct job *base)
{
	(void)base;   /* the queue ahead of it has drained: nothing left to do */
}

static void close_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	struct session *session = base->session;

	if (session->closed) {
		reply_error(&job->rq, ZC_ENOTFOUND, "session %llu was closed",
			    (unsigned long long)session->id);
	} else {
		session_retire(&server->sessions, session, true);
		log_info("session", "closed", "session=%llu name=%s", (unsigned long long)session->id,
			 session->name);
		wire_response response;
		wire_response_init(&response, job->rq.id, WIRE_OP_CLOSE_SESSION);
		reply_send(&job->rq, &response, NULL, 0);
	}
	job_end(job);
}

static void attach_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct session *session = base->session;
	if (session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session '%s' was closed before it could be attached",
			 session->name);
		return;
	}
	int rc = store_rebuild_views(session->store);
	if (rc == STORE_EBUDGET) {
		/* attach_done may free memory and run the job again. */
		job->rc = rc;
		return;
	}
	if (rc < 0)
		job_fail(job, rc, "cannot rebuild the views of '%s': %s", session->name,
			 zc_strerror(rc));
}

static void attach_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;

	if (job->rc == STORE_EBUDGET) {
		char what[120];
		snprintf(what, sizeof(what), "cannot rebuild the views of '%s'", base->session->name);
		if (job_relieve_or_fail(job, store_rebuild_bytes(base->session->store), what))
			return;
	}
	if (job->rc < 0)
		reply_error(&job->rq, job->rc, "%s", job->message);
	else
		reply_open(&job->rq, base->session, true);
	job_end(job);
}

/*
 * open_session with attach of an existing session: a job in the session's
 * line (after the work queued before it, so the reply's token counts
 * include that work), costing the views it must rebuild, so a session
 * whose views memory relief dropped is rebuilt on the thread pool.
 */
static void attach_submit(const struct request *rq, struct session *session)
{
	struct request_job *job = job_new(rq, session, JOB_ATTACH);
	if (!job) {
		reply_error(rq, -ENOMEM, "out of memory");
		return;
	}
	job->job.run = attach_run;
	job->job.done = attach_done;
	job->job.cost = store_rebuild_elements(session->store, STORE_ALL_LAYERS);
	/* handle_open's request ends when it returns; this one stays begun
	 * until attach_done has replied. */
	rq->responder->ops->begin(rq->responder);
	session_submit(&rq->server->sessions, &job->job);
}

static bool handle_session_job(const struct request *rq, const wire_request *request,
			       enum job_kind kind, uint64_t session_id)
{
	struct server *server = rq->server;
	struct session *session = session_find(&server->sessions, session_id, rq->peer->uid);

	if (!session) {
		reply_error(rq, ZC_ENOTFOUND, "no session %llu", (unsigned long long)session_id);
		return false;
	}
	struct request_job *job = job_new(rq, session, kind);
	if (!job) {
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	switch (kind) {
	case JOB_TRIM:
		job->trim_tokens = request->trim.tokens;
		job->trim_one_layer = request->trim.has_layer;
		job->layer = request->trim.layer;
		job->job.run = trim_run;
		job->job.done = trim_done;
		break;
	case JOB_STATS:
		job->job.run = stats_run;
		job->job.done = stats_done;
		job->job.observe_only = !request->stats.use;
		/* Looking rebuilds nothing; using rebuilds every dropped view. */
		if (!job->job.observe_only)
			job->job.cost = store_rebuild_elements(session->store, STORE_ALL_LAYERS);
		break;
	case JOB_CLOSE:
		job->job.run = close_run;
		job->job.done = close_done;
		break;
	case JOB_UPDATE:
	case JOB_ATTACH:
	case JOB_FORK:
	case JOB_EXPORT:
	case JOB_IMPORT:
	case JOB_RESTORE:
	case JOB_LOOKUP:
	case JOB_PREFIX_FETCH:
		break;
	}
	/* Trim and close cost nothing: they move counters, not elements. */
	session_submit(&server->sessions, &job->job);
	return true;
}

/* ---- fork ---- */

static void fork_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	struct session *source = base->session;

	if (source->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)source->id);
		return;
	}
	job->fork_params.name = job->fork_name;
	int rc = store_fork(source->store, job->tokens, server->shm_dir_fd, server->options.shm_dir,
			    &job->fork_params, &job->rq.peer->quota->memory, &job->fork_store);
	if (rc == STORE_EBUDGET) {
		job->rc = rc;   /* fork_done may free memory and run the job again */
		return;
	}
	if (rc < 0) {
		char why[160];
		job_fail(job, rc == ZC_EEXISTS ? ZC_EEXISTS : rc, "cannot fork session %llu: %s",
			 (unsigned long long)source->id,
			 rc == ZC_EEXISTS ? "a file holds the new session's id" :
					    reply_resource_text(server, rc, why, sizeof(why)));
	}
}

/* A store a job made (a fork, an import, a restore) into the session
 * table, with the caller's lease on it; NULL when the table refused it
 * (the store closed, the refusal sent). */
static struct session *job_session_add(struct request_job *job, const char *verb)
{
	struct server *server = job->rq.server;
	struct session *session;
	char why[200];
	int rc = session_table_add(&server->sessions, job->fork_store, &session);
	if (rc < 0) {
		store_close(job->fork_store, true);
		reply_error(&job->rq, rc, "cannot %s: %s; nothing was made", verb,
			    reply_resource_text(server, rc, why, sizeof(why)));
		return NULL;
	}
	session_lease(session, job->rq.peer->id,
		      session_now_ms() + server->options.lease_seconds * 1000);
	return session;
}

/* The new session's reply; one that cannot be sent undoes the session,
 * so a retry starts from nothing. True when it was sent. */
static bool job_session_reply(struct request_job *job, struct session *session,
			      int (*reply)(const struct request *rq, struct session *session))
{
	if (reply(&job->rq, session) == 0)
		return true;
	session_retire(&job->rq.server->sessions, session, true);
	session_release_if_unused(session);
	return false;
}

static void fork_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	struct session *session;

	if (job->rc == STORE_EBUDGET &&
	    job_relieve_or_fail(job, 4u << 20, "the session was not forked"))
		return;
	if (job->rc == 0 && session_find_name(&server->sessions, job->fork_name, job->rq.peer->uid)) {
		/* Another open took the name while the fork ran. */
		store_close(job->fork_store, true);
		job_fail(job, ZC_EEXISTS, "session '%s' already exists", job->fork_name);
	}
	if (job->rc < 0) {
		reply_error(&job->rq, job->rc, "%s", job->message);
		job_end(job);
		return;
	}
	session = job_session_add(job, "fork");
	if (session && job_session_reply(job, session, reply_fork))
		log_info("session", "forked", "session=%llu name=%s from=%llu tokens=%u uid=%u",
			 (unsigned long long)session->id, session->name,
			 (unsigned long long)base->session->id, job->tokens, session->owner_uid);
	job_end(job);
}

/* Returns true when a job was queued. */
static bool handle_fork(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	const struct wire_fork_request *fork = &request->fork_session;
	struct session *source = session_find(&server->sessions, fork->source_id, rq->peer->uid);
	char name[STORE_NAME_BYTES];

	if (!source) {
		reply_error(rq, ZC_ENOTFOUND, "no session %llu", (unsigned long long)fork->source_id);
		return false;
	}
	if (!name_acceptable(fork->name)) {
		reply_error(rq, ZC_EINVALID, "session names must be UTF-8 without control characters");
		return false;
	}
	if (!session_room(rq))
		return false;
	uint64_t id = server->sessions.next_id++;
	if (fork->name[0])
		snprintf(name, sizeof(name), "%s", fork->name);
	else
		snprintf(name, sizeof(name), "session-%llu", (unsigned long long)id);
	if (session_find_name(&server->sessions, name, rq->peer->uid)) {
		reply_error(rq, ZC_EEXISTS, "session '%s' already exists", name);
		return false;
	}
	if (!name_not_pending(rq, name))
		return false;
	struct request_job *job = job_new(rq, source, JOB_FORK);
	if (!job) {
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	snprintf(job->fork_name, sizeof(job->fork_name), "%s", name);
	job->tokens = fork->tokens;
	job->fork_params = (struct store_params){
		.session_id = id,
		.boot_epoch = server->boot_epoch,
		.views = fork->has_views ? (fork->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL) :
		       store_views_full(source->store) ? ZC_VIEWS_FULL : ZC_VIEWS_NONE,
	};
	job->job.run = fork_run;
	job->job.done = fork_done;
	/* Copying the source's view rows into the fork's views. */
	if (job->fork_params.views == ZC_VIEWS_FULL) {
		const struct store_header *h = store_header(source->store);
		uint32_t low, high;
		store_token_range(source->store, &low, &high);
		uint64_t tokens = fork->tokens < high ? fork->tokens : high;
		job->job.cost = tokens * h->layers * kv_block_elements(h->batch, h->kv_heads, 1,
									h->head_dim_k + h->head_dim_v);
	}
	session_submit(&server->sessions, &job->job);
	return true;
}

/* ---- export and import (docs/SNAPSHOT.md) ---- */

static const char *file_type_text(mode_t mode)
{
	return S_ISDIR(mode) ? "a directory" : S_ISSOCK(mode) ? "a socket" :
	       S_ISCHR(mode) ? "a character device" : S_ISBLK(mode) ? "a block device" :
	       S_ISFIFO(mode) ? "a pipe" : S_ISREG(mode) ? "a regular file" : "of an unknown type";
}

/*
 * The descriptor an export or import came with, checked: for an export a
 * regular file or a pipe open for writing, for an import a regular file
 * open for reading. -1 when the refusal was sent (the descriptor closed).
 */
static int snapshot_fd_take(const struct request *rq, bool export, bool *pipe)
{
	const char *op = export ? "export_session" : "import_session";
	int fd = rq->responder->ops->take_fd ? rq->responder->ops->take_fd(rq->responder) : -1;
	struct stat st;

	if (fd < 0) {
		reply_error(rq, ZC_EINVALID, "%s needs a descriptor sent with its frame (SCM_RIGHTS)", op);
		return -1;
	}
	int flags = fcntl(fd, F_GETFL);
	if (fstat(fd, &st) < 0 || flags < 0) {
		int rc = -errno;
		close(fd);
		reply_error(rq, ZC_EINVALID, "%s: cannot look at the descriptor: %s", op, strerror(-rc));
		return -1;
	}
	int mode = flags & O_ACCMODE;
	const char *bad = NULL;
	if (export && !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
		bad = "needs a regular file or a pipe";
	else if (!export && !S_ISREG(st.st_mode))
		bad = "needs a regular file";
	else if (export && mode != O_WRONLY && mode != O_RDWR)
		bad = "needs a descriptor open for writing";
	else if (!export && mode != O_RDONLY && mode != O_RDWR)
		bad = "needs a descriptor open for reading";
	if (bad) {
		close(fd);
		reply_error(rq, ZC_EINVALID, "%s %s; the descriptor is %s%s", op, bad,
			    file_type_text(st.st_mode),
			    S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode) ?
				    (mode == O_RDONLY ? " open read-only" : " open write-only") : "");
		return -1;
	}
	*pipe = S_ISFIFO(st.st_mode);
	return fd;
}

static void export_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct session *session = base->session;
	char why[180];

	if (session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)session->id);
		return;
	}
	int rc = snapshot_export(session->store, job->snapshot_fd, job->snapshot_pipe, &job->exported,
				 why, sizeof(why));
	if (rc < 0)
		job_fail(job, rc == ZC_ECORRUPT ? ZC_EINTERNAL : rc, "cannot export session %llu: %s",
			 (unsigned long long)session->id, why);
}

static void export_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;

	if (job->rc < 0) {
		reply_error(&job->rq, job->rc, "%s", job->message);
	} else {
		wire_response response;
		wire_response_init(&response, job->rq.id, WIRE_OP_EXPORT_SESSION);
		response.export_session.bytes = job->exported.bytes;
		response.export_session.fingerprint = job->exported.fingerprint;
		response.export_session.tokens = job->exported.tokens;
		reply_send(&job->rq, &response, NULL, 0);
		log_info("session", "exported", "session=%llu bytes=%llu fingerprint=%016llx uid=%u",
			 (unsigned long long)base->session->id, (unsigned long long)job->exported.bytes,
			 (unsigned long long)job->exported.fingerprint, job->rq.peer->uid);
	}
	job_end(job);
}

/* Returns true when a job was queued. */
static bool handle_export(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	bool pipe = false;
	int fd = snapshot_fd_take(rq, true, &pipe);
	if (fd < 0)
		return false;
	uint64_t id = request->export_session.session_id;
	struct session *session = session_find(&server->sessions, id, rq->peer->uid);
	if (!session) {
		close(fd);
		reply_error(rq, ZC_ENOTFOUND, "no session %llu", (unsigned long long)id);
		return false;
	}
	struct request_job *job = job_new(rq, session, JOB_EXPORT);
	if (!job) {
		close(fd);
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	job->snapshot_fd = fd;
	job->snapshot_pipe = pipe;
	job->job.run = export_run;
	job->job.done = export_done;
	/* Descriptor I/O: always on the thread pool, never on the loop. */
	job->job.cost = UINT64_MAX;
	job->job.observe_only = true;
	session_submit(&server->sessions, &job->job);
	return true;
}

/* The first job: the header and the layer table verified, nothing made
 * (not even the uid's pool); the records are verified as they are built. */
static void import_verify_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char why[180];

	int rc = snapshot_verify(job->snapshot_fd, &job->expect, &job->snapshot, why, sizeof(why));
	if (rc < 0) {
		job_fail(job, rc, "cannot import: %s; nothing was made", why);
		return;
	}
	if (job->snapshot.max_tokens > server->options.max_tokens)
		job_fail(job, ZC_EEXHAUSTED, "cannot import: the snapshot's max_tokens %u is above this "
			 "daemon's --max-tokens %u; nothing was made", job->snapshot.max_tokens,
			 server->options.max_tokens);
}

static void import_build_run(struct job *base);
static void restore_build_run(struct job *base);
static void import_done(struct job *base);
static void restore_failed(struct request_job *job);
static void restore_committed(struct request_job *job, struct session *session);

/* On the loop: the uid's pool (made now if it is the uid's first
 * session), then the second job builds the session (an import's from its
 * verified file, a restore's from the remote tier as it is fetched). */
/* About what an import or a restore charges: its snapshot's size (the
 * blocks and residual rows it makes). */
static uint64_t import_bytes(const struct request_job *job)
{
	return job->kind == JOB_RESTORE ? job->manifest.head.snapshot_bytes :
					   job->snapshot.file_bytes;
}

/* What relief is asked for when the build was refused (and undone): the
 * room it lacked, at least 4 MiB (views and tables beside the blocks). */
static uint64_t import_shortfall(const struct request_job *job)
{
	uint64_t lacked = relief_lacking(&job->rq.peer->quota->memory, import_bytes(job));
	return lacked > (4u << 20) ? lacked : 4u << 20;
}

static void import_verified_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char pool_reason[200] = "";

	if (job->rc < 0) {
		reply_error(&job->rq, job->rc, "%s", job->message);
		log_info("session", "import refused", "name=%s uid=%u reason=\"%s\"", job->fork_name,
			 job->rq.peer->uid, job->message);
		job_end(job);
		return;
	}
	/* An import that had to make the uid's pool takes it back if it fails
	 * (import_done): a refused import leaves nothing, not even that. */
	int rc = job->kind == JOB_IMPORT ?
		 pool_set_get_provisional(&server->pools, job->rq.peer->uid,
					  &job->rq.peer->quota->memory, &job->pool, pool_reason,
					  sizeof(pool_reason)) :
		 pool_set_get(&server->pools, job->rq.peer->uid, &job->rq.peer->quota->memory,
			      &job->pool, NULL, pool_reason, sizeof(pool_reason));
	if (rc < 0) {
		reply_error(&job->rq, rc == ZC_ECORRUPT ? ZC_EINTERNAL : rc,
			    "cannot use the block pool of uid %u: %s; nothing was made",
			    (unsigned)job->rq.peer->uid,
			    rc == ZC_ECORRUPT ? pool_reason : zc_strerror(rc));
		job_end(job);
		return;
	}
	/* Pages kept from closed sessions make way before the build charges
	 * its blocks (they were counted in the room it was let in by). */
	relief_make_room(server, &job->rq.peer->quota->memory, job->rq.peer->uid,
			 import_bytes(job));
	job->job.run = job->kind == JOB_RESTORE ? restore_build_run : import_build_run;
	job->job.done = import_done;
	session_table_run_detached(&server->sessions, &job->job);
}

static void import_build_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char why[180];

	fault_point("import.verified");
	job->fork_params.name = job->fork_name;
	if (!job->views_given)
		job->fork_params.views = job->snapshot.views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE :
										ZC_VIEWS_FULL;
	int rc = snapshot_import(job->snapshot_fd, &job->snapshot, &job->fork_params,
				 server->shm_dir_fd, server->options.shm_dir,
				 &job->rq.peer->quota->memory, job->pool, &job->fork_store, why,
				 sizeof(why));
	if (rc == STORE_EBUDGET) {
		job->rc = rc;   /* import_done may free memory and run the job again */
		return;
	}
	if (rc < 0)
		job_fail(job, rc, "cannot import: %s; nothing was made",
			 rc == ZC_EEXISTS ? "a file holds the new session's id" : why);
}

static void import_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	struct session *session;
	char why[200];

	if (job->rc == STORE_EBUDGET) {
		if (!job->retried &&
		    relief_run(server, import_shortfall(job), NULL, job->rq.peer->uid, false, why,
			       sizeof(why)) == 0) {
			job->retried = true;
			job->rc = 0;
			session_table_run_detached(&server->sessions, &job->job);
			return;
		}
		if (job->kind == JOB_RESTORE)
			job_fail(job, ZC_EEXHAUSTED, "cannot restore session '%s' from the remote tier: "
				 "the memory budget is exhausted; nothing was made", job->fork_name);
		else
			job_fail(job, ZC_EEXHAUSTED, "cannot import: the memory budget is exhausted; "
				 "nothing was made");
	}
	if (job->rc == 0 && session_find_name(&server->sessions, job->fork_name, job->rq.peer->uid)) {
		/* Another open took the name while the import ran. */
		store_close(job->fork_store, true);
		if (job->kind == JOB_RESTORE) {
			/* That one is the live copy: attach to it instead. */
			attach_submit(&job->rq, session_find_name(&server->sessions, job->fork_name,
								  job->rq.peer->uid));
			job_end(job);
			return;
		}
		job_fail(job, ZC_EEXISTS, "session '%s' already exists; nothing was made", job->fork_name);
	}
	if (job->rc < 0 && job->kind == JOB_RESTORE) {
		restore_failed(job);
		return;
	}
	if (job->rc < 0) {
		pool_set_drop_provisional(&server->pools, job->pool);
		reply_error(&job->rq, job->rc, "%s", job->message);
		log_info("session", "import refused", "name=%s uid=%u reason=\"%s\"", job->fork_name,
			 job->rq.peer->uid, job->message);
		job_end(job);
		return;
	}
	session = job_session_add(job, "import");
	if (session && job->kind == JOB_RESTORE) {
		restore_committed(job, session);
		return;
	}
	if (session && job_session_reply(job, session, reply_import))
		log_info("session", "imported", "session=%llu name=%s model_id=%s uid=%u",
			 (unsigned long long)session->id, session->name,
			 store_header(session->store)->model_id, session->owner_uid);
	job_end(job);
}

/* Returns true when a job was queued. */
static bool handle_import(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	const struct wire_import_request *import = &request->import_session;
	char name[STORE_NAME_BYTES];
	bool pipe = false;
	int fd = snapshot_fd_take(rq, false, &pipe);
	if (fd < 0)
		return false;
	if (!name_acceptable(import->name) || !name_acceptable(import->model_id)) {
		close(fd);
		reply_error(rq, ZC_EINVALID,
			    "session names and model ids must be UTF-8 without control characters");
		return false;
	}
	if (!session_room(rq)) {
		close(fd);
		return false;
	}
	uint64_t id = server->sessions.next_id++;
	if (import->name[0])
		snprintf(name, sizeof(name), "%s", import->name);
	else
		snprintf(name, sizeof(name), "session-%llu", (unsigned long long)id);
	if (session_find_name(&server->sessions, name, rq->peer->uid)) {
		close(fd);
		reply_error(rq, ZC_EEXISTS, "session '%s' already exists", name);
		return false;
	}
	if (!name_not_pending(rq, name)) {
		close(fd);
		return false;
	}
	struct store_budget *budget = &rq->peer->quota->memory;
	struct request_job *job = calloc(1, sizeof(*job));
	if (!job) {
		close(fd);
		reply_error(rq, -ENOMEM, "out of memory");
		return false;
	}
	job->kind = JOB_IMPORT;
	job->rq = *rq;
	job->snapshot_fd = fd;
	snprintf(job->fork_name, sizeof(job->fork_name), "%s", name);
	if (import->has_model_id) {
		snprintf(job->expect_model_id, sizeof(job->expect_model_id), "%s", import->model_id);
		job->expect.model_id = job->expect_model_id;
	}
	job->expect.has_fingerprint = import->has_fingerprint;
	job->expect.fingerprint = import->fingerprint;
	/* A snapshot is about the size of the blocks it makes: one that
	 * cannot fit the budget's room is refused before it is read. */
	job->expect.max_bytes = relief_room(server, budget, rq->peer->uid);
	job->views_given = import->has_views;
	job->fork_params = (struct store_params){
		.session_id = id,
		.boot_epoch = server->boot_epoch,
		.owner_uid = rq->peer->uid,
		.views = import->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL,
	};
	job->job.run = import_verify_run;
	job->job.done = import_verified_done;
	session_table_run_detached(&server->sessions, &job->job);
	return true;
}

/* ---- restore: attach of a session offloaded to the remote tier ---- */

/*
 * The first job, off the loop: the manifest only (nothing is made). Its
 * header says whether the session can be taken in at all (this daemon's
 * --max-tokens; the budget's room is checked with the layer table, in
 * restore_build). The rest is the import's path (import_verified_done:
 * the uid's pool; restore_build_run; import_done).
 */
static void restore_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char why[200];

	int rc = restore_manifest(server->remote, job->rq.peer->uid, job->fork_name, &job->manifest,
				  &job->manifest_found, &job->manifest_bytes, why, sizeof(why));
	job->manifest_ns = uv_hrtime();
	if (rc < 0) {
		job_fail(job, rc, "cannot restore session '%s' from the remote tier: %s; nothing was made",
			 job->fork_name, why);
		return;
	}
	if (job->manifest.header.max_tokens > server->options.max_tokens)
		job_fail(job, ZC_EEXHAUSTED, "cannot restore session '%s': its max_tokens %u is above "
			 "this daemon's --max-tokens %u; nothing was made", job->fork_name,
			 job->manifest.header.max_tokens, server->options.max_tokens);
}

/*
 * The second job, off the loop, with the uid's pool: every part fetched,
 * verified as it arrives and built into the new session's temporary file
 * layer by layer (offload.c's pipeline), renamed into place only once all
 * passed. On any failure nothing is left. STORE_EBUDGET: import_done may
 * free memory and run the job again (from the first part).
 */
static void restore_build_run(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	char why[240];

	job->fork_params.name = job->fork_name;
	job->expect.has_fingerprint = true;
	job->expect.fingerprint = job->manifest.header.fingerprint;
	const struct restore_target target = {
		.params = &job->fork_params,
		.dir_fd = server->shm_dir_fd,
		.dir_path = server->options.shm_dir,
		.budget = &job->rq.peer->quota->memory,
		.pool = job->pool,
	};
	int rc = restore_build(server->remote, job->rq.peer->uid, job->fork_name, &job->manifest,
			       &job->expect, &target, &job->fork_store, &job->restored, why,
			       sizeof(why));
	if (rc == STORE_EBUDGET) {
		job->rc = rc;
		return;
	}
	if (rc < 0)
		job_fail(job, rc, "cannot restore session '%s' from the remote tier: %s; nothing was made",
			 job->fork_name, rc == ZC_EEXISTS ? "a file holds the new session's id" : why);
}

static void restore_failed(struct request_job *job)
{
	struct server *server = job->rq.server;
	int rc = job->rc;
	remote_count_restore_failure(server->remote,
				     rc == ZC_ENOTFOUND ? REMOTE_FAILURE_MISSING :
				     rc == ZC_ECORRUPT || rc == ZC_EPRECONDITION ? REMOTE_FAILURE_CORRUPT :
				     rc == -ETIMEDOUT || rc == ZC_EREMOTE || rc == ZC_EDENIED ?
					     REMOTE_FAILURE_REMOTE : REMOTE_FAILURE_LOCAL);
	/* The tier's timeouts are its failures: UNAVAILABLE, retry later. */
	reply_error(&job->rq, rc == -ETIMEDOUT ? ZC_EREMOTE : rc, "%s", job->message);
	log_warn("session", "restore refused", "name=%s uid=%u error=%s reason=\"%s\"", job->fork_name,
		 job->rq.peer->uid, zc_strerror(rc), job->message);
	job_end(job);
}

static void restore_manifest_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->rq.server;
	struct session *session = session_find_name(&server->sessions, job->fork_name,
						    job->rq.peer->uid);

	if (session) {
		/* Opened (or restored) here while this one ran: that is the live copy. */
		attach_submit(&job->rq, session);
		job_end(job);
		return;
	}
	if (job->rc < 0 && !job->manifest_found) {
		/* Nothing offloaded under this name: an attach that may create.
		 * A prefix's fetch, if it needs one, ends the request itself. */
		if (open_create(&job->rq, &job->open, true))
			job_free(job);
		else
			job_end(job);
		return;
	}
	if (job->rc < 0) {
		restore_failed(job);
		return;
	}
	import_verified_done(base);
}

/* On the loop: the restored session is in the table (the import's commit
 * point was its file's rename). Answer as an attach; then the remote copy
 * goes, manifest first: the restored session is the one live copy. */
static void restore_committed(struct request_job *job, struct session *session)
{
	struct server *server = job->rq.server;
	struct mismatch m;
	zc_session_info has;

	remote_count_restore(server->remote);
	if (server->offload.offloaded > 0)
		server->offload.offloaded--;
	uint64_t now_ns = uv_hrtime();
	const struct restore_result *r = &job->restored;
	log_info("session", "restored", "session=%llu name=%s uid=%u generation=%llu bytes=%llu "
		 "manifest_ms=%.3f pipeline_ms=%.3f fetch_ms=%.3f verify_ms=%.3f build_ms=%.3f "
		 "build_wait_ms=%.3f overlapped=%s total_ms=%.3f", (unsigned long long)session->id,
		 session->name, session->owner_uid, (unsigned long long)job->manifest.head.generation,
		 (unsigned long long)(job->manifest_bytes + r->bytes_read),
		 (double)(job->manifest_ns - job->restore_start_ns) * 1e-6,
		 (double)r->elapsed_ns * 1e-6, (double)r->fetch_ns * 1e-6, (double)r->verify_ns * 1e-6,
		 (double)r->build_ns * 1e-6, (double)r->wait_ns * 1e-6, r->overlapped ? "yes" : "no",
		 (double)(now_ns - job->restore_start_ns) * 1e-6);
	fault_point("restore.committed");
	offload_forget(server, session->owner_uid, session->name, job->manifest.head.generation);
	reply_session_info(session, &has);
	if (!attach_matches(&job->open, &has, &m))
		reply_error(&job->rq, ZC_EINVALID,
			    "session '%s' exists with a different %s: %s; it was restored from the remote "
			    "tier and nothing else was changed", session->name, m.groups, m.detail);
	else
		reply_open(&job->rq, session, true);
	job_end(job);
}

/* Answers the attach now (a refusal) or queues the restore job, which does. */
static void restore_submit(const struct request *rq, const struct wire_open_request *open)
{
	struct server *server = rq->server;
	if (!session_room(rq) || !name_not_pending(rq, open->name))
		return;   /* refused: the sentence was sent */
	struct request_job *job = calloc(1, sizeof(*job));
	if (!job) {
		/* Never create in its place: an offloaded copy may exist. */
		reply_error(rq, -ENOMEM, "out of memory");
		return;
	}
	job->kind = JOB_RESTORE;
	job->rq = *rq;
	job->snapshot_fd = -1;
	job->open = *open;
	snprintf(job->fork_name, sizeof(job->fork_name), "%s", open->name);
	job->expect.max_bytes = relief_room(server, &rq->peer->quota->memory, rq->peer->uid);
	job->views_given = true;
	job->fork_params = (struct store_params){
		.session_id = server->sessions.next_id++,
		.boot_epoch = server->boot_epoch,
		.owner_uid = rq->peer->uid,
		.views = open->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL,
	};
	job->job.run = restore_run;
	job->job.done = restore_manifest_done;
	job->restore_start_ns = uv_hrtime();
	/* handle_open's request ends when it returns; this one stays begun
	 * until the restore has replied. */
	rq->responder->ops->begin(rq->responder);
	session_table_run_detached(&server->sessions, &job->job);
}

/* ---- staging ---- */

/* A staging buffer or a request ring: memory the client writes into, charged
 * to its uid's memory quota (and so the daemon's budget) and its staging
 * quota, made with memory relief's help when the budget is short. */
static int staging_memory_make(const struct request *rq, uint64_t bytes, bool ring,
			       struct staging **staging, struct ring **ring_out, char *why,
			       size_t why_len)
{
	struct server *server = rq->server;
	struct peer *peer = rq->peer;
	struct quota_usage *quota = peer->quota;
	int rc = STORE_EBUDGET;

	for (bool tried = false;; tried = true) {
		rc = ring ? ring_create(server->loop, bytes, &quota->memory, &quota->staging,
					&server->counters.ring_doorbells, ring_out) :
			    staging_create(bytes, &quota->memory, &quota->staging, staging);
		if (rc != STORE_EBUDGET ||
		    relief_run(server, ring ? ring_charge_bytes(bytes) : bytes, NULL, peer->uid,
			       tried, why, why_len) < 0)
			break;   /* for STORE_EBUDGET, why says so */
	}
	if (rc == ZC_EEXHAUSTED)
		snprintf(why, why_len, "staging quota of %llu bytes for uid %u is exhausted "
			 "(%llu held by its connections; --max-staging-bytes-per-uid)",
			 (unsigned long long)quota->staging.limit, peer->uid,
			 (unsigned long long)__atomic_load_n(&quota->staging.used, __ATOMIC_RELAXED));
	else if (rc < 0 && rc != STORE_EBUDGET)
		reply_resource_text(server, rc, why, why_len);
	return rc == STORE_EBUDGET ? ZC_EEXHAUSTED : rc;
}

/* The connection's request ring (docs/RING.md): one per connection. */
static void handle_ring(const struct request *rq, const wire_request *request)
{
	struct peer *peer = rq->peer;
	uint64_t bytes = request->staging.bytes;
	struct ring *ring = NULL;
	char why[200];
	int fds[2];

	if (peer->ring) {
		reply_error(rq, ZC_EINVALID, "this connection has a request ring already");
		return;
	}
	if (bytes < RING_MIN_BYTES || bytes > RING_MAX_BYTES) {
		reply_error(rq, ZC_EINVALID, "a request ring of %llu bytes is outside %u..%u",
			    (unsigned long long)bytes, RING_MIN_BYTES, RING_MAX_BYTES);
		return;
	}
	uint64_t max = ring_max_bytes(rq->server->options.max_staging_bytes);
	if (bytes > max) {
		reply_error(rq, ZC_EEXHAUSTED, "a request ring of %llu bytes is past the largest "
			    "this daemon makes, %llu (--max-staging-bytes)", (unsigned long long)bytes,
			    (unsigned long long)max);
		return;
	}
	/* The pump's buffer first: a ring it could not empty would hang its
	 * client. */
	if (ring_pump_reserve(&rq->server->ring_pump) < 0) {
		reply_error(rq, -ENOMEM, "no memory for the daemon's side of a request ring");
		return;
	}
	int rc = staging_memory_make(rq, bytes, true, NULL, &ring, why, sizeof(why));
	if (rc == 0 && (rc = ring_share(ring, fds)) < 0) {
		reply_resource_text(rq->server, rc, why, sizeof(why));
		ring_close(ring);
	}
	if (rc < 0) {
		reply_error(rq, rc, "cannot create a request ring of %llu bytes: %s",
			    (unsigned long long)bytes, why);
		return;
	}
	peer->ring = ring;
	rq->server->rings++;
	wire_response response;
	wire_response_init(&response, rq->id, WIRE_OP_STAGING);
	response.staging.bytes = ring->capacity;
	response.staging.ring = true;
	reply_send(rq, &response, fds, 2);
}

static void handle_staging(const struct request *rq, const wire_request *request)
{
	struct server *server = rq->server;
	struct peer *peer = rq->peer;
	uint64_t bytes = request->staging.bytes;
	struct staging *staging;
	char why[200];

	if (request->staging.ring) {
		handle_ring(rq, request);
		return;
	}
	if (bytes == 0 || bytes > server->options.max_staging_bytes) {
		reply_error(rq, bytes ? ZC_EEXHAUSTED : ZC_EINVALID,
			    "staging buffer of %llu bytes is outside 1..%llu",
			    (unsigned long long)bytes, (unsigned long long)server->options.max_staging_bytes);
		return;
	}
	int rc = staging_memory_make(rq, bytes, false, &staging, NULL, why, sizeof(why));
	if (rc < 0) {
		reply_error(rq, rc, "cannot create a staging buffer of %llu bytes: %s",
			    (unsigned long long)bytes, why);
		return;
	}
	int fd = dup(staging->fd);
	if (fd < 0) {
		rc = -errno;
		staging_unref(staging);
		reply_error(rq, rc, "cannot share the staging buffer: %s",
			    reply_resource_text(server, rc, why, sizeof(why)));
		return;
	}
	/* Jobs still reading the old buffer keep it alive. */
	staging_unref(peer->staging);
	peer->staging = staging;
	wire_response response;
	wire_response_init(&response, rq->id, WIRE_OP_STAGING);
	response.staging.bytes = staging->bytes;
	reply_send(rq, &response, &fd, 1);
}

void dispatch_request(struct server *server, struct peer *peer, struct responder *responder,
		      const uint8_t *frame, size_t len)
{
	struct request rq = {
		.server = server,
		.peer = peer,
		.responder = responder,
		.meta = { .op = METRICS_OP_INVALID, .start_ns = uv_hrtime() },
	};
	wire_request request;
	int rc = wire_request_decode(frame, len, &request);

	server->counters.requests++;
	peer->quota->requests++;
	/* The decoder recovers the request's id whenever it could be read (else 0). */
	rq.id = request.request_id;
	if (rc == 0)
		rq.meta.op = metrics_op_of(request.op);
	if (rc < 0) {
		/* Framing is intact, so the connection stays usable. */
		reply_error(&rq, ZC_EPROTOCOL, "malformed request: %s",
			    request.error ? request.error : zc_strerror(rc));
		responder->ops->end(responder);
		return;
	}
	bool queued = false;
	switch (request.op) {
	case WIRE_OP_HELLO:
		reply_hello(&rq);
		break;
	case WIRE_OP_OPEN_SESSION:
		queued = handle_open(&rq, &request);
		break;
	case WIRE_OP_UPDATE_AND_FETCH:
		queued = handle_update(&rq, &request);
		break;
	case WIRE_OP_TRIM:
		queued = handle_session_job(&rq, &request, JOB_TRIM, request.trim.session_id);
		break;
	case WIRE_OP_CLOSE_SESSION:
		queued = handle_session_job(&rq, &request, JOB_CLOSE, request.close_session.session_id);
		break;
	case WIRE_OP_STATS:
		if (request.stats.session_id == 0)
			reply_server_stats(&rq);
		else
			queued = handle_session_job(&rq, &request, JOB_STATS, request.stats.session_id);
		break;
	case WIRE_OP_LIST_SESSIONS:
		reply_list(&rq);
		break;
	case WIRE_OP_STAGING:
		handle_staging(&rq, &request);
		break;
	case WIRE_OP_FORK_SESSION:
		queued = handle_fork(&rq, &request);
		break;
	case WIRE_OP_EXPORT_SESSION:
		queued = handle_export(&rq, &request);
		break;
	case WIRE_OP_IMPORT_SESSION:
		queued = handle_import(&rq, &request);
		break;
	case WIRE_OP_LOOKUP_PREFIX:
		queued = handle_lookup(&rq, &request);
		break;
	case WIRE_OP_RELEASE: {
		struct session *session = session_find(&server->sessions, request.release.session_id,
						       peer->uid);
		if (!session) {
			reply_error(&rq, ZC_ENOTFOUND, "no session %llu",
				    (unsigned long long)request.release.session_id);
			break;
		}
		session_lease_release(session, peer->id);
		wire_response response;
		wire_response_init(&response, rq.id, WIRE_OP_RELEASE);
		reply_send(&rq, &response, NULL, 0);
		break;
	}
	case WIRE_OP_NONE:
		reply_error(&rq, ZC_EINVALID, "request carries no known operation");
		break;
	}
	/* A queued job ends the request when it replies. */
	if (!queued)
		responder->ops->end(responder);
}

void dispatch_reject_frame(struct server *server, struct peer *peer, struct responder *responder,
			   int error)
{
	struct request rq = {
		.server = server,
		.peer = peer,
		.responder = responder,
		.meta = { .op = METRICS_OP_INVALID, .start_ns = uv_hrtime() },
	};
	reply_error(&rq, error, "frame exceeds the limit of %u bytes; closing the connection",
		    server->options.max_frame_bytes);
	responder->ops->end(responder);
}
