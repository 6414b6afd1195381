/*
 * Request handlers. Each checks the request against the session before
 * anything changes, then either answers at once (hello, open, list,
 * staging) or queues a job on the session (update_and_fetch, trim, stats,
 * close, attach) so that work on one session stays in order. Each job
 * declares its cost in elements, which decides where it runs
 * (server/session.h).
 */
#include "dispatch.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "connection.h"
#include "log.h"
#include "metrics.h"
#include "quota.h"
#include "server.h"
#include "session.h"
#include "staging.h"
#include "store.h"
#include "pool.h"
#include "version.h"
#include "wire.h"

enum job_kind {
	JOB_UPDATE,
	JOB_TRIM,
	JOB_STATS,
	JOB_CLOSE,
	JOB_ATTACH
};

struct request_job {
	struct job job;               /* first: session.c sees only this */
	enum job_kind kind;
	struct request_meta meta;     /* for the latency histogram */
	struct connection *connection;
	uint64_t request_id;
	/* update */
	uint32_t layer, tokens;
	bool retried;                 /* once, after freeing memory */
	const uint16_t *keys, *values;
	uint8_t *inline_copy;         /* owns keys/values when they came inline */
	struct staging *staging;      /* holds keys/values when staged */
	/* trim */
	uint32_t trim_tokens, trimmed;
	bool trim_one_layer;
	/* results */
	int rc;
	char message[200];
	uint32_t layer_tokens_before;
	struct store_layer_stats stats;
	uint64_t sequence;
	struct store_layer_stats *layer_stats; /* JOB_STATS: one per layer */
};

/* Encodes and queues a reply; the frame buffer passes to the connection.
 * Returns 0, or why the reply could not be queued (the connection is then
 * closed or closing, and the client will never see it). */
static int reply_send(struct connection *connection, const struct request_meta *meta,
		      wire_response *response, const int *fds, int n_fds)
{
	size_t size, len;
	uint8_t *frame = NULL;
	int rc;

	response->msg.fds = (uint32_t)n_fds;
	rc = wire_response_frame_size(response, &size);
	if (rc == 0) {
		frame = malloc(size);
		rc = frame ? wire_response_encode(response, frame, size, &len) : -ENOMEM;
	}
	if (rc < 0) {
		log_error("dispatch", "reply encoding failed", "connection=%llu error=%s",
			  (unsigned long long)connection->id, zc_strerror(rc));
		free(frame);
		for (int i = 0; i < n_fds; i++)
			close(fds[i]);
		connection_close(connection);
		return rc;
	}
	metrics_request_done(&connection->server->metrics, meta->op, response->msg.status,
			     uv_hrtime() - meta->start_ns);
	return connection_send(connection, frame, len, fds, n_fds);
}

static void response_init(wire_response *response, uint64_t request_id)
{
	memset(response, 0, sizeof(*response));
	response->msg.request_id = request_id;
}

/* An error reply with a formatted message; also counts and logs it. */
static void reply_error(struct connection *connection, const struct request_meta *meta,
			uint64_t request_id, int error, const char *format, ...)
	__attribute__((format(printf, 5, 6)));

static void reply_error(struct connection *connection, const struct request_meta *meta,
			uint64_t request_id, int error, const char *format, ...)
{
	wire_response response;
	char message[256];
	va_list args;

	va_start(args, format);
	vsnprintf(message, sizeof(message), format, args);
	va_end(args);
	response_init(&response, request_id);
	wire_response_set_status(&response, error, message);
	connection->server->counters.request_errors++;
	connection->quota->request_errors++;
	log_debug("dispatch", "request refused", "connection=%llu request=%llu error=%s message=\"%s\"",
		  (unsigned long long)connection->id, (unsigned long long)request_id,
		  zc_error_name(error), message);
	metrics_error(&connection->server->metrics, error);
	reply_send(connection, meta, &response, NULL, 0);
}

/*
 * What ran out, for a refusal caused by a resource error (these answer
 * RESOURCE_EXHAUSTED, see wire.h); other errors are their own sentence.
 */
static const char *resource_text(const struct server *server, int rc, char *text, size_t size)
{
	switch (rc) {
	case -EMFILE:
		snprintf(text, size, "out of file descriptors (the daemon's limit is %llu; "
			 "`zipcached --help` says what its limits need)",
			 (unsigned long long)server->descriptor_limit);
		break;
	case -ENFILE:
		snprintf(text, size, "the system's open-file table is full (fs.file-max)");
		break;
	case -ENOMEM:
		snprintf(text, size, "the daemon is out of memory");
		break;
	case -ENOSPC:
		snprintf(text, size, "the shared-memory file system is full");
		break;
	case -EAGAIN:
		snprintf(text, size, "a kernel resource is temporarily exhausted");
		break;
	default:
		snprintf(text, size, "%s", zc_strerror(rc));
		break;
	}
	return text;
}

/* Sessions `uid` holds. */
static uint32_t uid_sessions(const struct session_table *table, uint32_t uid)
{
	uint32_t count = 0;
	for (size_t i = 0; i < table->count; i++)
		count += table->items[i]->owner_uid == uid && !table->items[i]->closed;
	return count;
}

static void session_info_fill(const struct session *session, zipcache_v1_SessionInfo *info)
{
	const struct store_header *h = store_header(session->store);
	uint32_t low = 0, high = 0;

	memset(info, 0, sizeof(*info));
	store_token_range(session->store, &low, &high);
	info->session_id = session->id;
	snprintf(info->name, sizeof(info->name), "%s", session->name);
	info->has_shape = true;
	info->shape = (zipcache_v1_SessionShape){ h->layers, h->batch, h->kv_heads, h->head_dim_k,
						  h->head_dim_v };
	info->max_tokens = h->max_tokens;
	info->has_codec = true;
	info->codec = (zipcache_v1_CodecConfig){
		.has_hi_bits = true, .hi_bits = (uint32_t)h->hi_bits,
		.has_lo_bits = true, .lo_bits = (uint32_t)h->lo_bits,
		.has_hi_fraction = true, .hi_fraction = h->hi_fraction,
		.has_group_size = true, .group_size = (uint32_t)h->group_size,
		.has_quantize_values = true, .quantize_values = h->quantize_values != 0,
	};
	info->policy = h->policy == STORE_POLICY_PER_CALL ? zipcache_v1_BlockPolicy_PER_CALL :
							    zipcache_v1_BlockPolicy_STREAMING;
	info->residual_tokens = h->residual_tokens;
	info->min_tokens = low;
	info->max_layer_tokens = high;
	info->idle_ms = session_now_ms() - session->last_used_ms;
}

static void layer_stats_fill(const struct store_layer_stats *s, zipcache_v1_LayerStats *out)
{
	memset(out, 0, sizeof(*out));
	out->layer = s->layer;
	out->tokens = s->tokens;
	out->residual_tokens = s->residual_tokens;
	out->blocks = s->blocks;
	out->compressed_key_bytes = s->key.compressed;
	out->compressed_value_bytes = s->value.compressed;
	out->baseline_key_bytes = s->key.baseline;
	out->baseline_value_bytes = s->value.baseline;
	out->fp16_key_bytes = s->key.fp16;
	out->fp16_value_bytes = s->value.fp16;
	/* The seed's two figures, key side. */
	out->compression_ratio = s->key.compressed ? (double)s->key.fp16 / (double)s->key.compressed : 0.0;
	out->effective_avg_bits = s->key.fp16 ? 16.0 * (double)s->key.compressed / (double)s->key.fp16 : 0.0;
}

static void server_counters_fill(const struct server *server, zipcache_v1_StatsResponse *stats)
{
	stats->requests = server->counters.requests;
	stats->request_errors = server->counters.request_errors;
	stats->tokens_appended = server->counters.tokens_appended;
	stats->uptime_ms = uv_now(server->loop) - server->started_ms;
	stats->boot_epoch = server->boot_epoch;
}

/*
 * The daemon-level figures of a stats reply, as the caller may see them.
 * Root and the daemon's own uid see the daemon's totals; any other uid
 * sees its own in the same fields (how many sessions, how much memory,
 * how much traffic other users have is theirs, not its). Configuration
 * (the budget), uptime and boot epoch are no one's secret. The caller's
 * usage and quotas come with either.
 */
static void stats_daemon_fill(const struct connection *connection, zipcache_v1_StatsResponse *stats)
{
	const struct server *server = connection->server;
	const struct quota_usage *own = connection->quota;
	const struct quota_limits *limits = quota_limits_of(&server->quotas, own);
	uint32_t own_sessions = uid_sessions(&server->sessions, connection->uid);
	uint64_t own_memory = __atomic_load_n(&own->memory.used, __ATOMIC_RELAXED);
	uint64_t own_staging = __atomic_load_n(&own->staging.used, __ATOMIC_RELAXED);

	server_counters_fill(server, stats);
	stats->memory_budget_bytes = server->options.memory_budget;
	stats->daemon_wide = own->trusted;
	struct store_memory kinds = { 0 };
	for (size_t i = 0; i < server->sessions.count; i++) {
		const struct session *s = server->sessions.items[i];
		if (own->trusted || s->owner_uid == connection->uid) {
			stats->memory_file_bytes += store_memory_bytes(s->store);
			store_memory_add(s->store, &kinds);
		}
	}
	/* Blocks are the pools': each counted once, however many sessions
	 * share it. */
	for (size_t i = 0; i < server->pools.n; i++) {
		const struct pool *pool = server->pools.items[i];
		if (own->trusted || pool_uid(pool) == connection->uid) {
			kinds.blocks += pool_memory_bytes(pool);
			stats->memory_file_bytes += pool_memory_bytes(pool);
		}
	}
	stats->has_memory = true;
	stats->memory = (zipcache_v1_MemoryByKind){ .views = kinds.views, .blocks = kinds.blocks,
						    .residual = kinds.residual, .index = kinds.index,
						    .headers = kinds.headers };
	if (own->trusted) {
		const struct adoption *adoption = &server->adoption;
		size_t listed = sizeof(stats->set_aside) / sizeof(stats->set_aside[0]);
		stats->set_aside_total = (uint32_t)adoption->n_set_aside;
		for (size_t i = 0; i < adoption->n_set_aside && i < listed; i++) {
			zipcache_v1_SetAsideFile *f = &stats->set_aside[stats->set_aside_count++];
			snprintf(f->file, sizeof(f->file), "%s", adoption->set_aside[i].file);
			snprintf(f->reason, sizeof(f->reason), "%s", adoption->set_aside[i].reason);
		}
		stats->sessions = (uint32_t)server->sessions.count;
		stats->connections = server->n_connections;
		stats->memory_used_bytes = server_memory_bytes(server);
		stats->staging_bytes = __atomic_load_n(&server->staging.used, __ATOMIC_RELAXED);
		stats->reply_queue_bytes = server->reply_queue_bytes;
	} else {
		stats->sessions = own_sessions;
		stats->connections = own->connections;
		stats->memory_used_bytes = own_memory;
		stats->staging_bytes = own_staging;
		stats->reply_queue_bytes = own->reply_queue_bytes;
		stats->requests = own->requests;
		stats->request_errors = own->request_errors;
		stats->tokens_appended = own->tokens_appended;
	}
	stats->has_caller = true;
	stats->caller = (zipcache_v1_UidUsage){
		.uid = connection->uid,
		.sessions = own_sessions,
		.max_sessions = (uint32_t)limits->sessions,
		.connections = own->connections,
		.max_connections = (uint32_t)limits->connections,
		.memory_used_bytes = own_memory,
		.memory_budget_bytes = limits->memory,
		.staging_bytes = own_staging,
		.max_staging_bytes = limits->staging,
	};
}

/* ---- hello ---- */

static void handle_hello(struct connection *connection, const wire_request *request)
{
	struct server *server = connection->server;
	wire_response response;
	zipcache_v1_HelloResponse *hello = &response.msg.op.hello;

	response_init(&response, request->msg.request_id);
	response.msg.which_op = zipcache_v1_Response_hello_tag;
	hello->protocol_version = ZIPCACHE_PROTOCOL_VERSION;
	snprintf(hello->server_version, sizeof(hello->server_version), "%s", ZIPCACHE_VERSION);
	hello->boot_epoch = server->boot_epoch;
	hello->max_frame_bytes = server->options.max_frame_bytes;
	hello->max_inline_bytes = server->options.max_inline_bytes;
	hello->max_sessions = server->options.max_sessions;
	hello->max_tokens_per_session = server->options.max_tokens;
	hello->memory_budget_bytes = server->options.memory_budget;
	reply_send(connection, &connection->current, &response, NULL, 0);
}

/* ---- open_session ---- */

/* Returns 0 once the reply is queued; a negative code when it could not
 * be (the client was told why, or its connection is gone), so that a
 * session made for this request can be taken back. */
static int reply_open(struct connection *connection, const struct request_meta *meta,
		      uint64_t request_id, struct session *session, bool attached)
{
	wire_response response;
	zipcache_v1_OpenSessionResponse *open = &response.msg.op.open_session;
	const struct store_header *h = store_header(session->store);
	const zc_map_header *m = store_map_layout(session->store);
	int fds[2] = { store_open_readonly(session->store), -1 };
	int fd = fds[0];
	char why[200];

	if (fd >= 0) {
		fds[1] = pool_open_readonly(store_pool(session->store));
		if (fds[1] < 0) {
			close(fds[0]);
			fd = fds[1];
		}
	}
	if (fd < 0) {
		reply_error(connection, meta, request_id, fd,
			    "cannot open the view of session %llu: %s%s",
			    (unsigned long long)session->id,
			    resource_text(connection->server, fd, why, sizeof(why)),
			    attached ? "" : "; the session was not created");
		return fd;
	}
	response_init(&response, request_id);
	response.msg.which_op = zipcache_v1_Response_open_session_tag;
	open->has_session = true;
	session_info_fill(session, &open->session);
	open->has_view = true;
	open->view.mapping_bytes = m->map_bytes;
	open->view.header_bytes = m->header_bytes;
	open->view.key_offsets_count = (pb_size_t)h->layers;
	open->view.value_offsets_count = (pb_size_t)h->layers;
	for (uint32_t i = 0; i < h->layers; i++) {
		open->view.key_offsets[i] = store_key_view_offset(session->store, i);
		open->view.value_offsets[i] = store_value_view_offset(session->store, i);
	}
	open->attached = attached;
	return reply_send(connection, meta, &response, fds, 2);
}

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

static const char *policy_text(uint32_t store_policy)
{
	return store_policy == STORE_POLICY_PER_CALL ? "per_call" : "streaming";
}

/*
 * Whether an attach request fits the session it names. Only what the
 * request gives is compared (zipcache.proto, OpenSessionRequest.attach):
 * the shape when present, max_tokens when not 0, each codec field when
 * present, residual_tokens when present and the session streams, the
 * policy when not STREAMING or when a shape is given (proto3 cannot tell
 * STREAMING from unset; a request with a shape describes a whole session,
 * as the C and Python clients send).
 */
static bool attach_matches(const zipcache_v1_OpenSessionRequest *open, const struct store_header *h,
			   struct mismatch *m)
{
	static const char shape[] = "shape", tokens[] = "max_tokens", policy_group[] = "policy",
			  residual[] = "residual_tokens", codec[] = "codec";
	const zipcache_v1_CodecConfig *c = &open->codec;
	uint32_t policy = open->policy == zipcache_v1_BlockPolicy_PER_CALL ? STORE_POLICY_PER_CALL :
									     STORE_POLICY_STREAMING;

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
	if ((open->has_shape || open->policy != zipcache_v1_BlockPolicy_STREAMING) && policy != h->policy)
		mismatch_note(m, policy_group, "policy is %s, not %s", policy_text(h->policy),
			      policy_text(policy));
	/* A per_call session has no residual (it keeps 0, whatever was asked). */
	if (open->has_residual_tokens && h->policy == STORE_POLICY_STREAMING &&
	    open->residual_tokens != h->residual_tokens)
		mismatch_note(m, residual, "residual_tokens is %u, not %u", h->residual_tokens,
			      open->residual_tokens);
	if (open->has_codec) {
		if (c->has_hi_bits && c->hi_bits != (uint32_t)h->hi_bits)
			mismatch_note(m, codec, "codec.hi_bits is %d, not %u", h->hi_bits, c->hi_bits);
		if (c->has_lo_bits && c->lo_bits != (uint32_t)h->lo_bits)
			mismatch_note(m, codec, "codec.lo_bits is %d, not %u", h->lo_bits, c->lo_bits);
		if (c->has_hi_fraction && c->hi_fraction != h->hi_fraction)
			mismatch_note(m, codec, "codec.hi_fraction is %g, not %g", h->hi_fraction,
				      c->hi_fraction);
		if (c->has_group_size && c->group_size != (uint32_t)h->group_size)
			mismatch_note(m, codec, "codec.group_size is %d, not %u", h->group_size,
				      c->group_size);
		if (c->has_quantize_values && c->quantize_values != (h->quantize_values != 0))
			mismatch_note(m, codec, "codec.quantize_values is %s, not %s",
				      h->quantize_values ? "true" : "false",
				      c->quantize_values ? "true" : "false");
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

static void attach_submit(struct connection *connection, uint64_t request_id,
			  struct session *session);

static void handle_open(struct connection *connection, const wire_request *request)
{
	struct server *server = connection->server;
	const zipcache_v1_OpenSessionRequest *open = &request->msg.op.open_session;
	uint64_t id = request->msg.request_id;
	struct session *session;
	struct store *store;
	char name[STORE_NAME_BYTES];
	int rc;

	if (!name_acceptable(open->name)) {
		reply_error(connection, &connection->current, id, ZC_EINVALID,
			    "session names must be UTF-8 without control characters");
		return;
	}
	if (open->name[0]) {
		snprintf(name, sizeof(name), "%s", open->name);
		session = session_find_name(&server->sessions, name, connection->uid);
		if (session && !open->attach) {
			reply_error(connection, &connection->current, id, ZC_EEXISTS, "session '%s' already exists (id %llu)",
				    name, (unsigned long long)session->id);
			return;
		}
		if (session) {
			struct mismatch m;
			if (!attach_matches(open, store_header(session->store), &m)) {
				reply_error(connection, &connection->current, id, ZC_EINVALID,
					    "session '%s' exists with a different %s: %s; nothing was changed",
					    name, m.groups, m.detail);
				return;
			}
			/* Dropped views are rebuilt by a job in the session's
			 * line, which replies. */
			attach_submit(connection, id, session);
			return;
		}
	}
	if (!open->has_shape) {
		reply_error(connection, &connection->current, id, ZC_EINVALID, "open_session needs a shape");
		return;
	}
	if (open->max_tokens == 0 || open->max_tokens > server->options.max_tokens) {
		reply_error(connection, &connection->current, id, open->max_tokens ? ZC_EEXHAUSTED : ZC_EINVALID,
			    "max_tokens %u is outside 1..%u", open->max_tokens,
			    server->options.max_tokens);
		return;
	}
	if (open->shape.layers > STORE_MAX_LAYERS) {
		reply_error(connection, &connection->current, id, ZC_EINVALID, "layers %u is above the limit of %u",
			    open->shape.layers, STORE_MAX_LAYERS);
		return;
	}
	const zipcache_v1_SessionShape *shape = &open->shape;
	if (!shape->layers || !shape->batch || !shape->kv_heads || !shape->head_dim_k || !shape->head_dim_v) {
		reply_error(connection, &connection->current, id, ZC_EINVALID,
			    "every dimension of the shape must be at least 1 (layers %u, batch %u, "
			    "kv_heads %u, head_dim_k %u, head_dim_v %u)", shape->layers, shape->batch,
			    shape->kv_heads, shape->head_dim_k, shape->head_dim_v);
		return;
	}
	if ((uint64_t)shape->batch * shape->kv_heads > STORE_MAX_HEADS) {
		reply_error(connection, &connection->current, id, ZC_EINVALID,
			    "batch x kv_heads is %llu; the limit is %u",
			    (unsigned long long)shape->batch * shape->kv_heads, STORE_MAX_HEADS);
		return;
	}
	if (shape->head_dim_k > ZC_MAX_HEAD_DIM || shape->head_dim_v > ZC_MAX_HEAD_DIM) {
		reply_error(connection, &connection->current, id, ZC_EINVALID,
			    "head_dim_k %u, head_dim_v %u: the limit is %u", shape->head_dim_k,
			    shape->head_dim_v, ZC_MAX_HEAD_DIM);
		return;
	}
	if (open->policy == zipcache_v1_BlockPolicy_STREAMING && open->has_residual_tokens &&
	    (open->residual_tokens == 0 || open->residual_tokens > STORE_MAX_RESIDUAL_TOKENS)) {
		reply_error(connection, &connection->current, id, ZC_EINVALID,
			    "residual_tokens %u is outside 1..%u", open->residual_tokens,
			    STORE_MAX_RESIDUAL_TOKENS);
		return;
	}
	if (server->sessions.count >= server->options.max_sessions) {
		reply_error(connection, &connection->current, id, ZC_EEXHAUSTED, "session limit of %u reached",
			    server->options.max_sessions);
		return;
	}
	uint64_t uid_limit = quota_limits_of(&server->quotas, connection->quota)->sessions;
	if (uid_limit && uid_sessions(&server->sessions, connection->uid) >= uid_limit) {
		reply_error(connection, &connection->current, id, ZC_EEXHAUSTED,
			    "session limit of %llu per uid reached (uid %u; --max-sessions-per-uid)",
			    (unsigned long long)uid_limit, connection->uid);
		return;
	}
	if (open->policy != zipcache_v1_BlockPolicy_STREAMING &&
	    open->policy != zipcache_v1_BlockPolicy_PER_CALL) {
		reply_error(connection, &connection->current, id, ZC_EINVALID, "unknown block policy %d", (int)open->policy);
		return;
	}

	struct store_params params = {
		.session_id = server->sessions.next_id,
		.boot_epoch = server->boot_epoch,
		.owner_uid = connection->uid,
		.name = name,
		.layers = open->shape.layers,
		.batch = open->shape.batch,
		.kv_heads = open->shape.kv_heads,
		.head_dim_k = open->shape.head_dim_k,
		.head_dim_v = open->shape.head_dim_v,
		.max_tokens = open->max_tokens,
		.policy = open->policy == zipcache_v1_BlockPolicy_PER_CALL ? STORE_POLICY_PER_CALL :
									 STORE_POLICY_STREAMING,
		.residual_tokens = open->has_residual_tokens ? open->residual_tokens : 128,
	};
	if (!open->name[0])
		snprintf(name, sizeof(name), "session-%llu", (unsigned long long)params.session_id);
	zc_codec_config_default(&params.codec);
	if (open->has_codec) {
		const zipcache_v1_CodecConfig *c = &open->codec;
		/* Bits arrive unsigned; out-of-range values must fail validation,
		 * not wrap into range. */
		if (c->has_hi_bits)
			params.codec.hi_bits = c->hi_bits > 64 ? 64 : (int)c->hi_bits;
		if (c->has_lo_bits)
			params.codec.lo_bits = c->lo_bits > 64 ? 64 : (int)c->lo_bits;
		if (c->has_hi_fraction)
			params.codec.hi_fraction = c->hi_fraction;
		if (c->has_group_size)
			params.codec.group_size = c->group_size > (1u << 24) ? 0 : (int)c->group_size;
		if (c->has_quantize_values)
			params.codec.quantize_values = c->quantize_values;
	}
	/* A file adoption could not read yet may hold this very session:
	 * never open a second one beside it. */
	if (adopt_blocks_open(server, connection->uid, name)) {
		reply_error(connection, &connection->current, id, ZC_EEXHAUSTED,
			    "%zu session files could not be adopted yet and may hold session '%s' "
			    "(the daemon's log says why); try again", server->adoption.n_pending, name);
		return;
	}
	struct store_budget *budget = &connection->quota->memory;
	struct pool *pool = NULL;
	char pool_reason[200] = "";
	rc = pool_set_get(&server->pools, connection->uid, budget, &pool, NULL, pool_reason,
			  sizeof(pool_reason));
	if (rc == ZC_ECORRUPT) {
		reply_error(connection, &connection->current, id, ZC_EINTERNAL,
			    "cannot use the block pool of uid %u: %s", (unsigned)connection->uid,
			    pool_reason);
		return;
	}
	if (rc == 0)
		rc = store_create(server->shm_dir_fd, server->options.shm_dir, &params, budget, pool,
				  &store);
	for (int tries = 0; rc == ZC_EEXISTS && tries < 3; tries++) {
		/* A file nobody adopted holds this id: take the next. */
		params.session_id = ++server->sessions.next_id;
		if (!open->name[0])
			snprintf(name, sizeof(name), "session-%llu",
				 (unsigned long long)params.session_id);
		rc = store_create(server->shm_dir_fd, server->options.shm_dir, &params, budget, pool, &store);
	}
	if (rc == STORE_EBUDGET &&
	    server_relieve_memory_for(server, 1u << 20, NULL, connection->uid) > 0)
		rc = store_create(server->shm_dir_fd, server->options.shm_dir, &params, budget, pool, &store);
	if (rc == STORE_EBUDGET) {
		char why[200];
		reply_error(connection, &connection->current, id, ZC_EEXHAUSTED, "%s",
			    server_budget_refusal(server, connection->uid, why, sizeof(why)));
		return;
	}
	uint64_t layout_bytes = 0;
	if (rc == ZC_EEXHAUSTED && store_layout_bytes(&params, &layout_bytes) != ZC_ESHAPE &&
	    (layout_bytes == 0 || store_mapped_bytes_total() + layout_bytes > store_map_limit())) {
		reply_error(connection, &connection->current, id, rc,
			    "cannot open session '%s': its layout needs %llu bytes of address space (0: more "
			    "than fits); "
			    "one session may map at most %llu, and all of them --max-mapped-bytes %llu "
			    "(%llu mapped)", name, (unsigned long long)layout_bytes,
			    (unsigned long long)store_max_file_bytes(), (unsigned long long)store_map_limit(),
			    (unsigned long long)store_mapped_bytes_total());
		return;
	}
	if (rc < 0) {
		char why[200];
		reply_error(connection, &connection->current, id, rc == ZC_ESHAPE ? ZC_EINVALID : rc,
			    "cannot open session '%s': %s", name, resource_text(server, rc, why, sizeof(why)));
		return;
	}
	server->sessions.next_id++;
	rc = session_table_add(&server->sessions, store, &session);
	if (rc < 0) {
		char why[200];
		store_close(store, true);
		reply_error(connection, &connection->current, id, rc,
			    "cannot open session '%s': %s; the session was not created", name,
			    resource_text(server, rc, why, sizeof(why)));
		return;
	}
	if (reply_open(connection, &connection->current, id, session, false) < 0) {
		/* The client was told why, or is gone: take back what was made,
		 * so a retry starts from nothing (not ALREADY_EXISTS). */
		log_warn("session", "open undone", "session=%llu name=%s uid=%u",
			 (unsigned long long)session->id, session->name, session->owner_uid);
		session_retire(&server->sessions, session, true);
		session_release_if_unused(session);
		return;
	}
	log_info("session", "opened", "session=%llu name=%s uid=%u layers=%u batch=%u kv_heads=%u "
		 "head_dim_k=%u head_dim_v=%u max_tokens=%u policy=%s",
		 (unsigned long long)session->id, session->name, session->owner_uid, params.layers,
		 params.batch, params.kv_heads, params.head_dim_k, params.head_dim_v,
		 params.max_tokens, params.policy == STORE_POLICY_PER_CALL ? "per_call" : "streaming");
}

/* ---- jobs: update_and_fetch, trim, stats, close, attach ---- */

static void job_free(struct request_job *job)
{
	free(job->inline_copy);
	staging_unref(job->staging);
	free(job->layer_stats);
	connection_unref(job->connection);
	free(job);
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
	uint64_t heads = (uint64_t)h->batch * h->kv_heads;
	int rc;

	if (base->session->closed) {
		job_fail(job, ZC_ENOTFOUND, "session %llu was closed", (unsigned long long)base->session->id);
		return;
	}
	job->layer_tokens_before = store_layer_tokens(store, job->layer);
	rc = store_update(store, job->layer, job->tokens, job->keys, job->values);
	if (rc == ZC_ENONFINITE) {
		/* Which tensor is bad is worth saying; only a failure pays for it. */
		bool keys_bad = zc_fp16_check_finite(job->keys, heads * job->tokens * h->head_dim_k) < 0;
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
 * A job the memory budget refused: drop idle sessions' views (never this
 * session's) and, if that freed anything, run the job once more ahead of
 * the session's other jobs. Nothing was stored the first time, so running
 * it again is safe. Returns true when the job was resubmitted.
 */
static bool job_retry_after_relief(struct request_job *job, uint64_t wanted)
{
	struct server *server = job->connection->server;
	if (!job->retried && server_relieve_memory(server, wanted, job->job.session) > 0) {
		job->retried = true;
		job->rc = 0;
		session_submit_front(&server->sessions, &job->job);
		return true;
	}
	return false;
}

static void update_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct connection *connection = job->connection;
	struct server *server = connection->server;

	if (job->rc == STORE_EBUDGET) {
		const struct store_header *h = store_header(base->session->store);
		/* Room for this block's views and compressed bytes, and a chunk. */
		uint64_t wanted = 2 * ((uint64_t)h->batch * h->kv_heads * job->tokens *
				       (h->head_dim_k + h->head_dim_v) * 2) + (2u << 20);
		if (job_retry_after_relief(job, wanted))
			return;
		char why[200];
		job_fail(job, ZC_EEXHAUSTED, "%s; nothing was stored",
			 server_budget_refusal(server, base->session->owner_uid, why, sizeof(why)));
	}

	if (job->rc < 0) {
		reply_error(connection, &job->meta, job->request_id, job->rc, "%s", job->message);
	} else {
		wire_response response;
		response_init(&response, job->request_id);
		response.msg.which_op = zipcache_v1_Response_update_and_fetch_tag;
		response.msg.op.update_and_fetch.tokens = job->stats.tokens;
		response.msg.op.update_and_fetch.has_stats = true;
		layer_stats_fill(&job->stats, &response.msg.op.update_and_fetch.stats);
		response.msg.op.update_and_fetch.sequence = job->sequence;
		connection->server->counters.tokens_appended += job->tokens;
		connection->quota->tokens_appended += job->tokens;
		session_account_layer(&connection->server->sessions, base->session, &job->stats);
		reply_send(connection, &job->meta, &response, NULL, 0);
	}
	connection_request_done(connection);
	job_free(job);
}

static struct request_job *job_new(struct connection *connection, struct session *session,
				   uint64_t request_id, enum job_kind kind)
{
	struct request_job *job = calloc(1, sizeof(*job));
	if (!job)
		return NULL;
	job->kind = kind;
	job->meta = connection->current;
	job->request_id = request_id;
	job->connection = connection;
	connection_ref(connection);
	job->job.session = session;
	return job;
}

/* Returns true when a job was queued (it finishes the request). */
static bool handle_update(struct connection *connection, const wire_request *request)
{
	struct server *server = connection->server;
	const zipcache_v1_UpdateAndFetchRequest *update = &request->msg.op.update_and_fetch;
	uint64_t id = request->msg.request_id;
	struct session *session = session_find(&server->sessions, update->session_id, connection->uid);

	if (!session) {
		reply_error(connection, &connection->current, id, ZC_ENOTFOUND, "no session %llu",
			    (unsigned long long)update->session_id);
		return false;
	}
	const struct store_header *h = store_header(session->store);
	if (update->layer >= h->layers) {
		reply_error(connection, &connection->current, id, ZC_EINVALID, "layer %u out of range: session has %u layers",
			    update->layer, h->layers);
		return false;
	}
	if (update->tokens == 0) {
		reply_error(connection, &connection->current, id, ZC_EINVALID, "a block needs at least one token");
		return false;
	}
	if (update->tokens > h->max_tokens) {
		reply_error(connection, &connection->current, id, ZC_EEXHAUSTED,
			    "a block of %u tokens exceeds max_tokens %u; nothing was stored",
			    update->tokens, h->max_tokens);
		return false;
	}
	uint64_t heads = (uint64_t)h->batch * h->kv_heads;
	uint64_t key_bytes = heads * update->tokens * h->head_dim_k * 2;
	uint64_t value_bytes = heads * update->tokens * h->head_dim_v * 2;
	struct request_job *job = NULL;

	if (update->staged) {
		struct staging *staging = connection->staging;
		if (!staging) {
			reply_error(connection, &connection->current, id, ZC_EPRECONDITION,
				    "staged update without a staging buffer: request one first");
			return false;
		}
		if (request->keys.len || request->values.len) {
			reply_error(connection, &connection->current, id, ZC_EINVALID, "a staged update carries no inline bytes");
			return false;
		}
		if ((update->keys_offset | update->values_offset) & 1 ||
		    update->keys_offset > staging->bytes || key_bytes > staging->bytes - update->keys_offset ||
		    update->values_offset > staging->bytes ||
		    value_bytes > staging->bytes - update->values_offset) {
			reply_error(connection, &connection->current, id, ZC_EINVALID,
				    "staging offsets out of range: keys %llu+%llu, values %llu+%llu bytes "
				    "in a %llu-byte buffer (offsets must be even)",
				    (unsigned long long)update->keys_offset, (unsigned long long)key_bytes,
				    (unsigned long long)update->values_offset,
				    (unsigned long long)value_bytes, (unsigned long long)staging->bytes);
			return false;
		}
		job = job_new(connection, session, id, JOB_UPDATE);
		if (!job)
			goto out_nomem;
		job->staging = staging;
		staging_ref(staging);
		job->keys = (const uint16_t *)(staging->base + update->keys_offset);
		job->values = (const uint16_t *)(staging->base + update->values_offset);
	} else {
		if (request->keys.len + request->values.len > server->options.max_inline_bytes) {
			reply_error(connection, &connection->current, id, ZC_EEXHAUSTED,
				    "inline K/V of %zu bytes exceed the limit of %u: send large blocks "
				    "through the staging buffer; nothing was stored",
				    request->keys.len + request->values.len,
				    server->options.max_inline_bytes);
			return false;
		}
		if (request->keys.len != key_bytes || request->values.len != value_bytes) {
			reply_error(connection, &connection->current, id, ZC_EINVALID,
				    "byte lengths do not match the shape: keys %zu and values %zu bytes, "
				    "but [batch %u, kv_heads %u, tokens %u] with head dims %u/%u needs %llu and %llu",
				    request->keys.len, request->values.len, h->batch, h->kv_heads,
				    update->tokens, h->head_dim_k, h->head_dim_v,
				    (unsigned long long)key_bytes, (unsigned long long)value_bytes);
			return false;
		}
		job = job_new(connection, session, id, JOB_UPDATE);
		if (!job)
			goto out_nomem;
		/* The frame is consumed when we return; the job keeps a copy,
		 * which is also suitably aligned for uint16_t. */
		job->inline_copy = malloc(key_bytes + value_bytes);
		if (!job->inline_copy)
			goto out_nomem;
		memcpy(job->inline_copy, request->keys.data, key_bytes);
		memcpy(job->inline_copy + key_bytes, request->values.data, value_bytes);
		job->keys = (const uint16_t *)job->inline_copy;
		job->values = (const uint16_t *)(job->inline_copy + key_bytes);
	}
	job->layer = update->layer;
	job->tokens = update->tokens;
	job->job.run = update_run;
	job->job.done = update_done;
	/* The block, the residual it fills (a decode step that compresses
	 * residual_tokens rows), and the layer's views if they were dropped. */
	job->job.cost = heads * (h->head_dim_k + h->head_dim_v) *
		(h->policy == STORE_POLICY_STREAMING &&
		 store_update_compresses(session->store, update->layer, update->tokens) ?
		 (uint64_t)h->residual_tokens + update->tokens : update->tokens) +
		store_rebuild_elements(session->store, update->layer);
	session_submit(&server->sessions, &job->job);
	return true;

out_nomem:
	if (job)
		job_free(job);
	reply_error(connection, &connection->current, id, -ENOMEM, "out of memory");
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
		session_account_layer(&job->connection->server->sessions, session, &job->layer_stats[i]);
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
		reply_error(job->connection, &job->meta, job->request_id, job->rc, "%s", job->message);
	} else {
		wire_response response;
		response_init(&response, job->request_id);
		response.msg.which_op = zipcache_v1_Response_trim_tag;
		response.msg.op.trim.trimmed = job->trimmed;
		response.msg.op.trim.tokens = job->stats.tokens;
		reply_send(job->connection, &job->meta, &response, NULL, 0);
	}
	connection_request_done(job->connection);
	job_free(job);
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
	struct connection *connection = job->connection;
	const struct store_header *h = store_header(base->session->store);
	struct server *server = connection->server;
	zipcache_v1_LayerStats *layers = NULL;

	if (job->rc == STORE_EBUDGET) {
		if (job_retry_after_relief(job, store_rebuild_bytes(base->session->store)))
			return;
		char why[200];
		job_fail(job, ZC_EEXHAUSTED, "%s; cannot rebuild the views",
			 server_budget_refusal(server, base->session->owner_uid, why, sizeof(why)));
	}
	if (job->rc < 0) {
		reply_error(connection, &job->meta, job->request_id, job->rc, "%s", job->message);
		goto out;
	}
	stats_account(job);
	layers = calloc(h->layers, sizeof(*layers));
	if (!layers) {
		reply_error(connection, &job->meta, job->request_id, -ENOMEM, "out of memory");
		goto out;
	}
	struct store_layer_stats total = { .layer = h->layers };
	for (uint32_t i = 0; i < h->layers; i++) {
		const struct store_layer_stats *s = &job->layer_stats[i];
		layer_stats_fill(s, &layers[i]);
		total.tokens += s->tokens;
		total.residual_tokens += s->residual_tokens;
		total.blocks += s->blocks;
		total.key.compressed += s->key.compressed;
		total.key.baseline += s->key.baseline;
		total.key.fp16 += s->key.fp16;
		total.value.compressed += s->value.compressed;
		total.value.baseline += s->value.baseline;
		total.value.fp16 += s->value.fp16;
	}
	wire_response response;
	response_init(&response, job->request_id);
	response.msg.which_op = zipcache_v1_Response_stats_tag;
	zipcache_v1_StatsResponse *stats = &response.msg.op.stats;
	stats->has_session = true;
	session_info_fill(base->session, &stats->session);
	stats->has_total = true;
	layer_stats_fill(&total, &stats->total);
	stats_daemon_fill(connection, stats);
	response.layers = layers;
	response.n_layers = h->layers;
	reply_send(connection, &job->meta, &response, NULL, 0);
out:
	free(layers);
	connection_request_done(connection);
	job_free(job);
}

static void close_run(struct job *base)
{
	(void)base;   /* the queue ahead of it has drained: nothing left to do */
}

static void close_done(struct job *base)
{
	struct request_job *job = (struct request_job *)base;
	struct server *server = job->connection->server;
	struct session *session = base->session;

	if (session->closed) {
		reply_error(job->connection, &job->meta, job->request_id, ZC_ENOTFOUND, "session %llu was closed",
			    (unsigned long long)session->id);
	} else {
		session_retire(&server->sessions, session, true);
		log_info("session", "closed", "session=%llu name=%s", (unsigned long long)session->id,
			 session->name);
		wire_response response;
		response_init(&response, job->request_id);
		response.msg.which_op = zipcache_v1_Response_close_session_tag;
		reply_send(job->connection, &job->meta, &response, NULL, 0);
	}
	connection_request_done(job->connection);
	job_free(job);
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
	struct connection *connection = job->connection;
	struct server *server = connection->server;

	if (job->rc == STORE_EBUDGET) {
		if (job_retry_after_relief(job, store_rebuild_bytes(base->session->store)))
			return;
		char why[200];
		job_fail(job, ZC_EEXHAUSTED, "%s; cannot rebuild the views of '%s'",
			 server_budget_refusal(server, base->session->owner_uid, why, sizeof(why)),
			 base->session->name);
	}
	if (job->rc < 0)
		reply_error(connection, &job->meta, job->request_id, job->rc, "%s", job->message);
	else
		reply_open(connection, &job->meta, job->request_id, base->session, true);
	connection_request_done(connection);
	job_free(job);
}

/*
 * open_session with attach of an existing session: a job in the session's
 * line (after the work queued before it, so the reply's token counts
 * include that work), costing the views it must rebuild, so a session
 * whose views memory relief dropped is rebuilt on the thread pool.
 */
static void attach_submit(struct connection *connection, uint64_t request_id,
			  struct session *session)
{
	struct server *server = connection->server;
	struct request_job *job = job_new(connection, session, request_id, JOB_ATTACH);
	if (!job) {
		reply_error(connection, &connection->current, request_id, -ENOMEM, "out of memory");
		return;
	}
	job->job.run = attach_run;
	job->job.done = attach_done;
	job->job.cost = store_rebuild_elements(session->store, STORE_ALL_LAYERS);
	/* handle_open's request is done when it returns; this one stays in
	 * flight until attach_done has replied. */
	connection->in_flight++;
	session_submit(&server->sessions, &job->job);
}

static bool handle_session_job(struct connection *connection, const wire_request *request,
			       enum job_kind kind, uint64_t session_id)
{
	struct server *server = connection->server;
	uint64_t id = request->msg.request_id;
	struct session *session = session_find(&server->sessions, session_id, connection->uid);

	if (!session) {
		reply_error(connection, &connection->current, id, ZC_ENOTFOUND, "no session %llu",
			    (unsigned long long)session_id);
		return false;
	}
	struct request_job *job = job_new(connection, session, id, kind);
	if (!job) {
		reply_error(connection, &connection->current, id, -ENOMEM, "out of memory");
		return false;
	}
	switch (kind) {
	case JOB_TRIM:
		job->trim_tokens = request->msg.op.trim.tokens;
		job->trim_one_layer = request->msg.op.trim.has_layer;
		job->layer = request->msg.op.trim.layer;
		job->job.run = trim_run;
		job->job.done = trim_done;
		break;
	case JOB_STATS:
		job->job.run = stats_run;
		job->job.done = stats_done;
		job->job.observe_only = !request->msg.op.stats.use;
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
		break;
	}
	/* Trim and close cost nothing: they move counters, not elements. */
	session_submit(&server->sessions, &job->job);
	return true;
}

/* ---- stats without a session, list, staging ---- */

static void handle_server_stats(struct connection *connection, const wire_request *request)
{
	wire_response response;
	response_init(&response, request->msg.request_id);
	response.msg.which_op = zipcache_v1_Response_stats_tag;
	stats_daemon_fill(connection, &response.msg.op.stats);
	reply_send(connection, &connection->current, &response, NULL, 0);
}

static void handle_list(struct connection *connection, const wire_request *request)
{
	struct server *server = connection->server;
	struct session_table *table = &server->sessions;
	zipcache_v1_SessionInfo *infos = calloc(table->count + 1, sizeof(*infos));
	size_t count = 0;

	if (!infos) {
		reply_error(connection, &connection->current, request->msg.request_id, -ENOMEM, "out of memory");
		return;
	}
	for (size_t i = 0; i < table->count; i++) {
		if (table->items[i]->owner_uid == connection->uid && !table->items[i]->closed)
			session_info_fill(table->items[i], &infos[count++]);
	}
	wire_response response;
	response_init(&response, request->msg.request_id);
	response.msg.which_op = zipcache_v1_Response_list_sessions_tag;
	response.sessions = infos;
	response.n_sessions = count;
	reply_send(connection, &connection->current, &response, NULL, 0);
	free(infos);
}

static void handle_staging(struct connection *connection, const wire_request *request)
{
	struct server *server = connection->server;
	uint64_t bytes = request->msg.op.staging.bytes;
	uint64_t id = request->msg.request_id;
	struct staging *staging;

	if (bytes == 0 || bytes > server->options.max_staging_bytes) {
		reply_error(connection, &connection->current, id, bytes ? ZC_EEXHAUSTED : ZC_EINVALID,
			    "staging buffer of %llu bytes is outside 1..%llu",
			    (unsigned long long)bytes, (unsigned long long)server->options.max_staging_bytes);
		return;
	}
	/* Charged to the uid's memory quota (and so the daemon's budget) and
	 * to its staging quota; the old buffer's charge goes when its last
	 * reader lets go of it. */
	struct quota_usage *quota = connection->quota;
	int rc = staging_create(bytes, &quota->memory, &quota->staging, &staging);
	if (rc == STORE_EBUDGET &&
	    server_relieve_memory_for(server, bytes, NULL, connection->uid) > 0)
		rc = staging_create(bytes, &quota->memory, &quota->staging, &staging);
	if (rc < 0) {
		char why[200];
		if (rc == STORE_EBUDGET)
			server_budget_refusal(server, connection->uid, why, sizeof(why));
		else if (rc == ZC_EEXHAUSTED)
			snprintf(why, sizeof(why), "staging quota of %llu bytes for uid %u is exhausted "
				 "(%llu held by its connections; --max-staging-bytes-per-uid)",
				 (unsigned long long)quota->staging.limit, connection->uid,
				 (unsigned long long)__atomic_load_n(&quota->staging.used, __ATOMIC_RELAXED));
		else
			resource_text(server, rc, why, sizeof(why));
		reply_error(connection, &connection->current, id, rc == STORE_EBUDGET ? ZC_EEXHAUSTED : rc,
			    "cannot create a staging buffer of %llu bytes: %s", (unsigned long long)bytes, why);
		return;
	}
	int fd = dup(staging->fd);
	if (fd < 0) {
		char why[200];
		rc = -errno;
		staging_unref(staging);
		reply_error(connection, &connection->current, id, rc, "cannot share the staging buffer: %s",
			    resource_text(server, rc, why, sizeof(why)));
		return;
	}
	/* Jobs still reading the old buffer keep it alive. */
	staging_unref(connection->staging);
	connection->staging = staging;
	wire_response response;
	response_init(&response, id);
	response.msg.which_op = zipcache_v1_Response_staging_tag;
	response.msg.op.staging.bytes = staging->bytes;
	reply_send(connection, &connection->current, &response, &fd, 1);
}

void dispatch_request(struct connection *connection, const uint8_t *frame, size_t len)
{
	struct server *server = connection->server;
	wire_request request;
	connection->current.start_ns = uv_hrtime();
	connection->current.op = METRICS_OP_INVALID;
	int rc = wire_request_decode(frame, len, &request);

	server->counters.requests++;
	connection->quota->requests++;
	if (rc == 0)
		connection->current.op = metrics_op_of(request.msg.which_op);
	if (rc < 0) {
		/* Framing is intact, so the connection stays usable. The decoder
		 * recovers the request's id whenever it could be read (else 0). */
		reply_error(connection, &connection->current, request.msg.request_id, ZC_EPROTOCOL,
			    "malformed request: %s",
			    request.error ? request.error : zc_strerror(rc));
		connection_request_done(connection);
		return;
	}
	bool queued = false;
	switch (request.msg.which_op) {
	case zipcache_v1_Request_hello_tag:
		handle_hello(connection, &request);
		break;
	case zipcache_v1_Request_open_session_tag:
		handle_open(connection, &request);
		break;
	case zipcache_v1_Request_update_and_fetch_tag:
		queued = handle_update(connection, &request);
		break;
	case zipcache_v1_Request_trim_tag:
		queued = handle_session_job(connection, &request, JOB_TRIM,
					    request.msg.op.trim.session_id);
		break;
	case zipcache_v1_Request_close_session_tag:
		queued = handle_session_job(connection, &request, JOB_CLOSE,
					    request.msg.op.close_session.session_id);
		break;
	case zipcache_v1_Request_stats_tag:
		if (request.msg.op.stats.session_id == 0)
			handle_server_stats(connection, &request);
		else
			queued = handle_session_job(connection, &request, JOB_STATS,
						    request.msg.op.stats.session_id);
		break;
	case zipcache_v1_Request_list_sessions_tag:
		handle_list(connection, &request);
		break;
	case zipcache_v1_Request_staging_tag:
		handle_staging(connection, &request);
		break;
	default:
		reply_error(connection, &connection->current, request.msg.request_id, ZC_EINVALID,
			    "request carries no known operation");
		break;
	}
	/* A queued job finishes the request when it replies. */
	if (!queued)
		connection_request_done(connection);
}

void dispatch_reject_frame(struct connection *connection, int error)
{
	connection->in_flight++;
	connection->current.start_ns = uv_hrtime();
	connection->current.op = METRICS_OP_INVALID;
	reply_error(connection, &connection->current, 0, error, "frame exceeds the limit of %u bytes; closing the connection",
		    connection->server->options.max_frame_bytes);
	connection_request_done(connection);
}

void dispatch_refuse_connection(struct server *server, int fd, const char *message)
{
	wire_response response;
	uint8_t frame[512];
	size_t len;

	(void)server;
	response_init(&response, 0);
	wire_response_set_status(&response, ZC_EEXHAUSTED, message);
	if (wire_response_encode(&response, frame, sizeof(frame), &len) == 0)
		(void)!send(fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
}

void dispatch_connection_closed(struct server *server)
{
	server_stop_progress(server);
}
