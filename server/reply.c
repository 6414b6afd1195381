/*
 * Replies: the daemon's state and a request's results as wire messages,
 * encoded and handed to the request's responder. See reply.h.
 */
#include "reply.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "quota.h"
#include "ring.h"
#include "server.h"
#include "session.h"
#include "pool.h"
#include "store.h"
#include "version.h"

int reply_send(const struct request *rq, wire_response *response, const int *fds, int n_fds)
{
	size_t size, len;
	uint8_t *frame = NULL;
	int rc;

	response->fds = (uint32_t)n_fds;
	rc = wire_response_frame_size(response, &size);
	if (rc == 0) {
		frame = malloc(size);
		rc = frame ? wire_response_encode(response, frame, size, &len) : -ENOMEM;
	}
	if (rc < 0) {
		log_error("dispatch", "reply encoding failed", "connection=%llu error=%s",
			  (unsigned long long)rq->peer->id, zc_strerror(rc));
		free(frame);
		for (int i = 0; i < n_fds; i++)
			close(fds[i]);
		rq->responder->ops->abort(rq->responder);
		return rc;
	}
	metrics_request_done(&rq->server->metrics, rq->meta.op, response->status,
			     uv_hrtime() - rq->meta.start_ns);
	return rq->responder->ops->send(rq->responder, frame, len, fds, n_fds);
}

void reply_error(const struct request *rq, int error, const char *format, ...)
{
	wire_response response;
	char message[256];
	va_list args;

	va_start(args, format);
	vsnprintf(message, sizeof(message), format, args);
	va_end(args);
	wire_response_init(&response, rq->id, WIRE_OP_NONE);
	wire_response_set_status(&response, error, message);
	rq->server->counters.request_errors++;
	rq->peer->quota->request_errors++;
	log_debug("dispatch", "request refused", "connection=%llu request=%llu error=%s message=\"%s\"",
		  (unsigned long long)rq->peer->id, (unsigned long long)rq->id,
		  zc_error_name(error), message);
	metrics_error(&rq->server->metrics, error);
	reply_send(rq, &response, NULL, 0);
}

const char *reply_resource_text(const struct server *server, int rc, char *text, size_t size)
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

void reply_session_info(const struct session *session, zc_session_info *info)
{
	const struct store_header *h = store_header(session->store);
	uint32_t low = 0, high = 0;

	memset(info, 0, sizeof(*info));
	store_token_range(session->store, &low, &high);
	info->id = session->id;
	snprintf(info->name, sizeof(info->name), "%s", session->name);
	info->layers = h->layers;
	info->batch = h->batch;
	info->kv_heads = h->kv_heads;
	info->head_dim_k = h->head_dim_k;
	info->head_dim_v = h->head_dim_v;
	info->max_tokens = h->max_tokens;
	info->codec = store_codec(session->store);
	info->policy = h->policy == STORE_POLICY_PER_CALL ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING;
	info->residual_tokens = h->residual_tokens;
	info->min_tokens = low;
	info->max_layer_tokens = high;
	info->idle_ms = session_now_ms() - session->last_used_ms;
	info->views = store_views_full(session->store) ? ZC_VIEWS_FULL : ZC_VIEWS_NONE;
	info->shared_bytes = store_shared_bytes(session->store);
	info->leased = session_leased(session, session_now_ms());
	snprintf(info->model_id, sizeof(info->model_id), "%s", h->model_id);
}

void reply_layer_stats(const struct store_layer_stats *s, zc_layer_stats *out)
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

static void server_counters_fill(const struct server *server, struct wire_stats_response *stats)
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
static void stats_daemon_fill(const struct request *rq, struct wire_stats_response *stats)
{
	const struct server *server = rq->server;
	const struct quota_usage *own = rq->peer->quota;
	uint32_t uid = rq->peer->uid;
	const struct quota_limits *limits = quota_limits_of(&server->quotas, own);
	uint32_t own_sessions = session_count_of_uid(&server->sessions, uid);
	uint64_t own_memory = __atomic_load_n(&own->memory.used, __ATOMIC_RELAXED);
	uint64_t own_staging = __atomic_load_n(&own->staging.used, __ATOMIC_RELAXED);

	server_counters_fill(server, stats);
	stats->memory_budget_bytes = server->options.memory_budget;
	stats->daemon_wide = own->trusted;
	struct store_memory kinds;
	server_memory_by_kind(server, own->trusted, uid, &kinds, &stats->memory_file_bytes);
	stats->has_memory = true;
	stats->memory = (struct wire_memory_by_kind){
		.views = kinds.views, .blocks = kinds.blocks, .residual = kinds.residual,
		.index = kinds.index, .headers = kinds.headers,
		.retained = kinds.retained_maps + kinds.retained_extents,
	};
	if (own->trusted) {
		const struct adoption *adoption = &server->adoption;
		size_t listed = sizeof(stats->set_aside) / sizeof(stats->set_aside[0]);
		stats->set_aside_total = (uint32_t)adoption->n_set_aside;
		for (size_t i = 0; i < adoption->n_set_aside && i < listed; i++) {
			zc_set_aside_file *f = &stats->set_aside[stats->set_aside_count++];
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
	stats->caller = (struct wire_uid_usage){
		.uid = uid,
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

void reply_hello(const struct request *rq)
{
	const struct server *server = rq->server;
	wire_response response;
	zc_server_info *hello = &response.hello;

	wire_response_init(&response, rq->id, WIRE_OP_HELLO);
	hello->protocol_version = ZIPCACHE_PROTOCOL_VERSION;
	snprintf(hello->server_version, sizeof(hello->server_version), "%s", ZIPCACHE_VERSION);
	hello->boot_epoch = server->boot_epoch;
	hello->max_frame_bytes = server->options.max_frame_bytes;
	hello->max_inline_bytes = server->options.max_inline_bytes;
	hello->max_sessions = server->options.max_sessions;
	hello->max_tokens_per_session = server->options.max_tokens;
	hello->memory_budget_bytes = server->options.memory_budget;
	hello->lease_ms = (uint32_t)(server->options.lease_seconds * 1000);
	hello->max_ring_bytes = ring_max_bytes(server->options.max_staging_bytes);
	reply_send(rq, &response, NULL, 0);
}

static int open_reply(const struct request *rq, struct session *session, bool attached,
		      enum wire_op op);

int reply_open(const struct request *rq, struct session *session, bool attached)
{
	return open_reply(rq, session, attached, WIRE_OP_OPEN_SESSION);
}

int reply_fork(const struct request *rq, struct session *session)
{
	return open_reply(rq, session, false, WIRE_OP_FORK_SESSION);
}

int reply_import(const struct request *rq, struct session *session)
{
	return open_reply(rq, session, false, WIRE_OP_IMPORT_SESSION);
}

static int open_reply(const struct request *rq, struct session *session, bool attached,
		      enum wire_op op)
{
	wire_response response;
	struct wire_open_response *open = &response.open_session;
	const struct store_header *h = store_header(session->store);
	const zc_map_header *m = store_map_layout(session->store);
	/* The session map and the uid's pool. */
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
		reply_error(rq, fd, "cannot open the view of session %llu: %s%s",
			    (unsigned long long)session->id,
			    reply_resource_text(rq->server, fd, why, sizeof(why)),
			    attached ? "" : "; the session was not created");
		return fd;
	}
	wire_response_init(&response, rq->id, op);
	open->has_session = true;
	reply_session_info(session, &open->session);
	open->has_view = true;
	open->view.mapping_bytes = m->map_bytes;
	open->view.header_bytes = m->header_bytes;
	open->view.key_offsets_count = h->layers;
	open->view.value_offsets_count = h->layers;
	for (uint32_t i = 0; i < h->layers; i++) {
		open->view.key_offsets[i] = store_key_view_offset(session->store, i);
		open->view.value_offsets[i] = store_value_view_offset(session->store, i);
	}
	open->attached = attached;
	return reply_send(rq, &response, fds, 2);
}

void reply_session_stats(const struct request *rq, const struct session *session,
			 const struct store_layer_stats *layer_stats)
{
	uint32_t n = store_header(session->store)->layers;
	zc_layer_stats *layers = calloc(n, sizeof(*layers));
	struct session_totals sum = { 0 };
	wire_response response;

	if (!layers) {
		reply_error(rq, -ENOMEM, "out of memory");
		return;
	}
	for (uint32_t i = 0; i < n; i++) {
		reply_layer_stats(&layer_stats[i], &layers[i]);
		session_totals_add(&sum, &layer_stats[i], 1);
	}
	/* The total is a LayerStats whose layer field is the layer count. */
	struct store_layer_stats total = {
		.layer = n,
		.tokens = (uint32_t)sum.tokens,
		.residual_tokens = (uint32_t)sum.residual_tokens,
		.blocks = sum.blocks,
		.key = sum.key,
		.value = sum.value,
	};
	wire_response_init(&response, rq->id, WIRE_OP_STATS);
	struct wire_stats_response *stats = &response.stats;
	stats->has_session = true;
	reply_session_info(session, &stats->session);
	stats->has_total = true;
	reply_layer_stats(&total, &stats->total);
	stats_daemon_fill(rq, stats);
	response.layers = layers;
	response.n_layers = n;
	reply_send(rq, &response, NULL, 0);
	free(layers);
}

void reply_server_stats(const struct request *rq)
{
	wire_response response;
	wire_response_init(&response, rq->id, WIRE_OP_STATS);
	stats_daemon_fill(rq, &response.stats);
	reply_send(rq, &response, NULL, 0);
}

void reply_list(const struct request *rq)
{
	const struct session_table *table = &rq->server->sessions;
	zc_session_info *infos = calloc(table->count + 1, sizeof(*infos));
	size_t count = 0;
	wire_response response;

	if (!infos) {
		reply_error(rq, -ENOMEM, "out of memory");
		return;
	}
	for (size_t i = 0; i < table->count; i++) {
		if (table->items[i]->owner_uid == rq->peer->uid && !table->items[i]->closed)
			reply_session_info(table->items[i], &infos[count++]);
	}
	wire_response_init(&response, rq->id, WIRE_OP_LIST_SESSIONS);
	response.sessions = infos;
	response.n_sessions = count;
	reply_send(rq, &response, NULL, 0);
	free(infos);
}

int reply_refusal_frame(const char *message, uint8_t *frame, size_t cap, size_t *len)
{
	wire_response response;

	wire_response_init(&response, 0, WIRE_OP_NONE);
	wire_response_set_status(&response, ZC_EEXHAUSTED, message);
	return wire_response_encode(&response, frame, cap, len);
}
