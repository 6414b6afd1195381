/*
 * Metrics: what the daemon counts and how it prints it in Prometheus's
 * text format 0.0.4. One HELP and TYPE per family with all its samples
 * together, counters ending in _total, cumulative histogram buckets with
 * +Inf equal to _count. Per-session detail stays in `stats`, never in
 * labels: a label per session would grow without bound.
 */
#include "metrics.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "remote.h"
#include "retain.h"
#include "server.h"
#include "store.h"
#include "version.h"
#include "wire.h"
#include "zipcache/codec.h"

static const char *const op_names[METRICS_OP_COUNT] = {
	"hello", "open_session", "update_and_fetch", "trim", "close_session",
	"stats", "list_sessions", "staging", "fork_session", "release", "export_session",
	"import_session", "lookup_prefix", "invalid",
};

static const char *const status_names[METRICS_STATUS_COUNT] = {
	"ok", "invalid_argument", "not_found", "already_exists", "resource_exhausted",
	"permission_denied", "failed_precondition", "internal", "data_loss", "unavailable",
};

static const char *const reason_names[METRICS_REASON_COUNT] = {
	"invalid_argument", "malformed_request", "frame_too_large", "nonfinite_input",
	"not_found", "already_exists", "resource_exhausted", "permission_denied",
	"failed_precondition", "internal", "connection_refused", "data_loss",
	"remote_unavailable",
};

static const char *const relief_step_names[METRICS_RELIEF_STEP_COUNT] = {
	"release_retained", "drop_views", "drop_chunks", "offload", "refuse",
};

/* Upper bounds in seconds: a decode step is tens of microseconds, a
 * 4096-token prefill of one layer a few milliseconds. */
static const double bucket_bounds[METRICS_BUCKETS] = {
	0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
	0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
};

unsigned metrics_bucket_of(uint64_t elapsed_ns)
{
	double seconds = (double)elapsed_ns * 1e-9;
	for (unsigned i = 0; i < METRICS_BUCKETS; i++)
		if (seconds <= bucket_bounds[i])
			return i;
	return METRICS_BUCKETS - 1;
}

enum metrics_op metrics_op_of(enum wire_op op)
{
	switch (op) {
	case WIRE_OP_HELLO:
		return METRICS_OP_HELLO;
	case WIRE_OP_OPEN_SESSION:
		return METRICS_OP_OPEN_SESSION;
	case WIRE_OP_UPDATE_AND_FETCH:
		return METRICS_OP_UPDATE_AND_FETCH;
	case WIRE_OP_TRIM:
		return METRICS_OP_TRIM;
	case WIRE_OP_CLOSE_SESSION:
		return METRICS_OP_CLOSE_SESSION;
	case WIRE_OP_STATS:
		return METRICS_OP_STATS;
	case WIRE_OP_LIST_SESSIONS:
		return METRICS_OP_LIST_SESSIONS;
	case WIRE_OP_STAGING:
		return METRICS_OP_STAGING;
	case WIRE_OP_FORK_SESSION:
		return METRICS_OP_FORK_SESSION;
	case WIRE_OP_RELEASE:
		return METRICS_OP_RELEASE;
	case WIRE_OP_EXPORT_SESSION:
		return METRICS_OP_EXPORT_SESSION;
	case WIRE_OP_IMPORT_SESSION:
		return METRICS_OP_IMPORT_SESSION;
	case WIRE_OP_LOOKUP_PREFIX:
		return METRICS_OP_LOOKUP_PREFIX;
	case WIRE_OP_NONE:
		break;
	}
	return METRICS_OP_INVALID;
}

void metrics_request_done(struct metrics *metrics, uint8_t op, int status, uint64_t elapsed_ns)
{
	double seconds = (double)elapsed_ns * 1e-9;
	if (op >= METRICS_OP_COUNT)
		op = METRICS_OP_INVALID;
	if (status < 0 || status >= METRICS_STATUS_COUNT)
		status = WIRE_STATUS_INTERNAL;
	metrics->requests[op][status]++;
	metrics->latency_count[op]++;
	metrics->latency_sum[op] += seconds;
	for (int i = 0; i < METRICS_BUCKETS; i++) {
		if (seconds <= bucket_bounds[i]) {
			metrics->latency_buckets[op][i]++;
			break;
		}
	}
}

void metrics_error_reason(struct metrics *metrics, enum metrics_reason reason)
{
	metrics->errors[reason]++;
}

void metrics_error(struct metrics *metrics, int error)
{
	enum metrics_reason reason;
	switch (error) {
	case ZC_EPROTOCOL:
		reason = METRICS_REASON_MALFORMED_REQUEST;
		break;
	case ZC_EFRAMESIZE:
		reason = METRICS_REASON_FRAME_TOO_LARGE;
		break;
	case ZC_ENONFINITE:
		reason = METRICS_REASON_NONFINITE_INPUT;
		break;
	default:
		switch (wire_status_from_error(error)) {
		case WIRE_STATUS_INVALID_ARGUMENT:
			reason = METRICS_REASON_INVALID_ARGUMENT;
			break;
		case WIRE_STATUS_NOT_FOUND:
			reason = METRICS_REASON_NOT_FOUND;
			break;
		case WIRE_STATUS_ALREADY_EXISTS:
			reason = METRICS_REASON_ALREADY_EXISTS;
			break;
		case WIRE_STATUS_RESOURCE_EXHAUSTED:
			reason = METRICS_REASON_RESOURCE_EXHAUSTED;
			break;
		case WIRE_STATUS_PERMISSION_DENIED:
			reason = METRICS_REASON_PERMISSION_DENIED;
			break;
		case WIRE_STATUS_FAILED_PRECONDITION:
			reason = METRICS_REASON_FAILED_PRECONDITION;
			break;
		case WIRE_STATUS_DATA_LOSS:
			reason = METRICS_REASON_DATA_LOSS;
			break;
		case WIRE_STATUS_UNAVAILABLE:
			reason = METRICS_REASON_REMOTE_UNAVAILABLE;
			break;
		default:
			reason = METRICS_REASON_INTERNAL;
			break;
		}
	}
	metrics->errors[reason]++;
}

struct text {
	char *data;
	size_t len, capacity;
	int error;
};

static void text_printf(struct text *text, const char *format, ...)
	__attribute__((format(printf, 2, 3)));

static void text_printf(struct text *text, const char *format, ...)
{
	va_list args;
	if (text->error)
		return;
	for (;;) {
		size_t room = text->capacity - text->len;
		va_start(args, format);
		int n = vsnprintf(text->data + text->len, room, format, args);
		va_end(args);
		if (n < 0) {
			text->error = -EINVAL;
			return;
		}
		if ((size_t)n < room) {
			text->len += (size_t)n;
			return;
		}
		size_t capacity = text->capacity * 2 + (size_t)n + 1;
		char *data = realloc(text->data, capacity);
		if (!data) {
			text->error = -ENOMEM;
			return;
		}
		text->data = data;
		text->capacity = capacity;
	}
}

static void family(struct text *text, const char *name, const char *type, const char *help)
{
	text_printf(text, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(struct text *text, const char *name, const char *help, double value)
{
	family(text, name, "gauge", help);
	text_printf(text, "%s %.17g\n", name, value);
}

static void counter(struct text *text, const char *name, const char *help, uint64_t value)
{
	family(text, name, "counter", help);
	text_printf(text, "%s %llu\n", name, (unsigned long long)value);
}

static double ratio(uint64_t fp16, uint64_t stored)
{
	return stored ? (double)fp16 / (double)stored : 0.0;
}

/* The remote tier's families (docs/REMOTE.md), only with --remote. */
static void remote_render(struct text *text, struct remote *remote, int64_t offloaded)
{
	struct remote_stats s;
	remote_stats_read(remote, &s);
	gauge(text, "zipcache_remote_up", "Whether the last exchange with Redis (--remote) succeeded.",
	      s.up ? 1.0 : 0.0);
	family(text, "zipcache_remote_errors_total", "counter",
	       "Failed calls to the remote tier, by reason.");
	for (int i = 0; i < REMOTE_ERROR_KIND_COUNT; i++)
		text_printf(text, "zipcache_remote_errors_total{reason=\"%s\"} %llu\n",
			    remote_error_kind_name((enum remote_error_kind)i), (unsigned long long)s.errors[i]);
	family(text, "zipcache_remote_latency_seconds", "histogram",
	       "Time of one call to the remote tier (a batch of keys is one call).");
	uint64_t cumulative = 0;
	for (int i = 0; i < METRICS_BUCKETS; i++) {
		cumulative += s.latency_buckets[i];
		text_printf(text, "zipcache_remote_latency_seconds_bucket{le=\"%g\"} %llu\n", bucket_bounds[i],
			    (unsigned long long)cumulative);
	}
	text_printf(text, "zipcache_remote_latency_seconds_bucket{le=\"+Inf\"} %llu\n",
		    (unsigned long long)s.latency_count);
	text_printf(text, "zipcache_remote_latency_seconds_sum %.9g\n", (double)s.latency_sum_ns * 1e-9);
	text_printf(text, "zipcache_remote_latency_seconds_count %llu\n", (unsigned long long)s.latency_count);
	counter(text, "zipcache_remote_sent_bytes_total", "Bytes written to Redis.", s.bytes_sent);
	counter(text, "zipcache_remote_received_bytes_total", "Bytes read from Redis.", s.bytes_received);
	counter(text, "zipcache_remote_redirections_total",
		"MOVED and ASK redirections the cluster router followed.", s.redirections);
	counter(text, "zipcache_remote_offloads_total", "Sessions written to the remote tier.", s.offloads);
	counter(text, "zipcache_remote_restores_total", "Sessions restored from the remote tier.",
		s.restores);
	text_printf(text, "# HELP zipcache_remote_offload_seconds_total Time the counted offloads took "
		    "(encode, every write, the manifest).\n# TYPE zipcache_remote_offload_seconds_total "
		    "counter\nzipcache_remote_offload_seconds_total %.9f\n", (double)s.offload_ns * 1e-9);
	text_printf(text, "# HELP zipcache_remote_offload_failures_total Offloads that left the session "
		    "local, by reason.\n# TYPE zipcache_remote_offload_failures_total counter\n");
	for (int i = 0; i < REMOTE_TRANSFER_FAILURE_COUNT; i++)
		text_printf(text, "zipcache_remote_offload_failures_total{reason=\"%s\"} %llu\n",
			    remote_transfer_failure_name(i), (unsigned long long)s.offload_failures[i]);
	text_printf(text, "# HELP zipcache_remote_restore_failures_total Attaches the remote tier could "
		    "not restore, by reason.\n# TYPE zipcache_remote_restore_failures_total counter\n");
	for (int i = 0; i < REMOTE_TRANSFER_FAILURE_COUNT; i++)
		text_printf(text, "zipcache_remote_restore_failures_total{reason=\"%s\"} %llu\n",
			    remote_transfer_failure_name(i), (unsigned long long)s.restore_failures[i]);
	text_printf(text, "# HELP zipcache_remote_offloaded_sessions Sessions this node has offloaded "
		    "and not restored itself since it started.\n# TYPE zipcache_remote_offloaded_sessions "
		    "gauge\nzipcache_remote_offloaded_sessions %lld\n",
		    (long long)offloaded);
}

int metrics_render(const struct server *server, char **out, size_t *out_len)
{
	const struct metrics *m = &server->metrics;
	const struct session_totals *t = &server->sessions.totals;
	struct text text = { .capacity = 16384 };

	text.data = malloc(text.capacity);
	if (!text.data)
		return -ENOMEM;

	family(&text, "zipcache_build_info", "gauge", "Version and codec kernels of this zipcached.");
	text_printf(&text, "zipcache_build_info{version=\"%s\",codec_isa=\"%s\",protocol=\"%u\"} 1\n",
		    ZIPCACHE_VERSION, zc_isa_name(zc_codec_isa()), ZIPCACHE_PROTOCOL_VERSION);

	family(&text, "zipcache_requests_total", "counter", "Requests answered, by operation and status.");
	for (int op = 0; op < METRICS_OP_COUNT; op++)
		for (int status = 0; status < METRICS_STATUS_COUNT; status++)
			if (m->requests[op][status] || status == 0)
				text_printf(&text, "zipcache_requests_total{op=\"%s\",status=\"%s\"} %llu\n",
					    op_names[op], status_names[status],
					    (unsigned long long)m->requests[op][status]);

	family(&text, "zipcache_request_duration_seconds", "histogram",
	       "Time from a request's arrival to its reply, by operation.");
	for (int op = 0; op < METRICS_OP_COUNT; op++) {
		uint64_t cumulative = 0;
		for (int i = 0; i < METRICS_BUCKETS; i++) {
			cumulative += m->latency_buckets[op][i];
			text_printf(&text, "zipcache_request_duration_seconds_bucket{op=\"%s\",le=\"%g\"} %llu\n",
				    op_names[op], bucket_bounds[i], (unsigned long long)cumulative);
		}
		text_printf(&text, "zipcache_request_duration_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n",
			    op_names[op], (unsigned long long)m->latency_count[op]);
		text_printf(&text, "zipcache_request_duration_seconds_sum{op=\"%s\"} %.9g\n", op_names[op],
			    m->latency_sum[op]);
		text_printf(&text, "zipcache_request_duration_seconds_count{op=\"%s\"} %llu\n",
			    op_names[op], (unsigned long long)m->latency_count[op]);
	}

	family(&text, "zipcache_errors_total", "counter", "Refused requests and connections, by reason.");
	for (int r = 0; r < METRICS_REASON_COUNT; r++)
		text_printf(&text, "zipcache_errors_total{reason=\"%s\"} %llu\n", reason_names[r],
			    (unsigned long long)m->errors[r]);

	gauge(&text, "zipcache_sessions", "Open sessions.", (double)server->sessions.count);
	gauge(&text, "zipcache_stored_tokens", "Tokens held, summed over sessions and layers.",
	      (double)t->tokens);

	family(&text, "zipcache_stored_bytes", "gauge",
	       "K/V bytes held (compressed), their uniform lo-bit baseline, and their fp16 size.");
	const zc_byte_count *tensors[2] = { &t->key, &t->value };
	const char *tensor_names[2] = { "key", "value" };
	for (int i = 0; i < 2; i++) {
		text_printf(&text, "zipcache_stored_bytes{tensor=\"%s\",kind=\"compressed\"} %llu\n",
			    tensor_names[i], (unsigned long long)tensors[i]->compressed);
		text_printf(&text, "zipcache_stored_bytes{tensor=\"%s\",kind=\"baseline\"} %llu\n",
			    tensor_names[i], (unsigned long long)tensors[i]->baseline);
		text_printf(&text, "zipcache_stored_bytes{tensor=\"%s\",kind=\"fp16\"} %llu\n",
			    tensor_names[i], (unsigned long long)tensors[i]->fp16);
	}
	family(&text, "zipcache_compression_ratio", "gauge", "fp16 bytes over stored bytes, by tensor.");
	for (int i = 0; i < 2; i++)
		text_printf(&text, "zipcache_compression_ratio{tensor=\"%s\"} %.17g\n", tensor_names[i],
			    ratio(tensors[i]->fp16, tensors[i]->compressed));

	gauge(&text, "zipcache_memory_used_bytes",
	      "Memory charged to the budget: session files, staging buffers, queued replies.",
	      (double)server_memory_bytes(server));
	struct store_memory kinds;
	uint64_t file_bytes;
	server_memory_by_kind(server, true, 0, &kinds, &file_bytes);
	family(&text, "zipcache_memory_file_bytes", "gauge",
	       "Memory the sessions' files and the block pools really hold (allocated pages), by kind.");
	const struct { const char *kind; uint64_t bytes; } by_kind[] = {
		{ "views", kinds.views }, { "blocks", kinds.blocks }, { "residual", kinds.residual },
		{ "index", kinds.index }, { "headers", kinds.headers },
		{ "retained", kinds.retained_maps + kinds.retained_extents },
	};
	for (size_t i = 0; i < sizeof(by_kind) / sizeof(by_kind[0]); i++)
		text_printf(&text, "zipcache_memory_file_bytes{kind=\"%s\"} %llu\n", by_kind[i].kind,
			    (unsigned long long)by_kind[i].bytes);
	family(&text, "zipcache_retained_bytes", "gauge",
	       "Pages kept from closed sessions for new ones (--retain-bytes), by kind.");
	text_printf(&text, "zipcache_retained_bytes{kind=\"maps\"} %llu\n",
		    (unsigned long long)kinds.retained_maps);
	text_printf(&text, "zipcache_retained_bytes{kind=\"extents\"} %llu\n",
		    (unsigned long long)kinds.retained_extents);
	gauge(&text, "zipcache_retain_limit_bytes", "The bound on retained pages (0: off).",
	      (double)retain_limit());
	family(&text, "zipcache_retain_reuses_total", "counter",
	       "New sessions' maps and blocks that reused retained pages, by kind.");
	text_printf(&text, "zipcache_retain_reuses_total{kind=\"maps\"} %llu\n",
		    (unsigned long long)retain_map_reuses());
	text_printf(&text, "zipcache_retain_reuses_total{kind=\"extents\"} %llu\n",
		    (unsigned long long)retain_extent_reuses());
	gauge(&text, "zipcache_shared_block_bytes",
	      "Block pool bytes that more than one session refers to (forks sharing a prefix).",
	      (double)pool_set_shared_bytes(&server->pools));
	gauge(&text, "zipcache_session_files_set_aside",
	      "Session files in the shm-dir not adopted (corrupt, or another uid's).",
	      (double)server->adoption.n_set_aside);
	gauge(&text, "zipcache_memory_budget_bytes", "The memory budget (0: none).",
	      (double)server->options.memory_budget);
	gauge(&text, "zipcache_staging_bytes",
	      "Staging buffers held for connections (part of the memory in use).",
	      (double)__atomic_load_n(&server->staging.used, __ATOMIC_RELAXED));
	gauge(&text, "zipcache_reply_queue_bytes",
	      "Reply bytes queued for clients that have not read them (part of the memory in use).",
	      (double)server->reply_queue_bytes);
	counter(&text, "zipcache_view_rebuilds_total", "fp16 views rebuilt from compressed stores.",
		store_view_rebuilds_total());
	/* Named for what it counts: sessions are never evicted, their views are dropped. */
	counter(&text, "zipcache_view_drops_total",
		"Sessions whose idle, unleased fp16 views were dropped (memory relief or --view-idle-seconds).",
		m->view_drops);
	counter(&text, "zipcache_idle_view_drops_total",
		"Of those, drops without memory pressure: the session was idle --view-idle-seconds.",
		m->idle_view_drops);
	family(&text, "zipcache_relief_steps_total", "counter",
	       "Steps of memory relief run for refused charges: drop idle views, then refuse.");
	for (int i = 0; i < METRICS_RELIEF_STEP_COUNT; i++)
		text_printf(&text, "zipcache_relief_steps_total{step=\"%s\"} %llu\n", relief_step_names[i],
			    (unsigned long long)m->relief_steps[i]);
	gauge(&text, "zipcache_connections", "Open client connections.", (double)server->n_connections);
	counter(&text, "zipcache_connections_total", "Client connections accepted.",
		server->counters.connections_accepted);
	counter(&text, "zipcache_tokens_appended_total", "Tokens appended by update_and_fetch.",
		server->counters.tokens_appended);
	gauge(&text, "zipcache_request_rings", "Connections holding a request ring (docs/RING.md).",
	      (double)server->rings);
	counter(&text, "zipcache_ring_requests_total", "Requests taken from request rings.",
		server->counters.ring_requests);
	counter(&text, "zipcache_ring_replies_total", "Replies written into request rings' reply areas.",
		server->counters.ring_replies);
	counter(&text, "zipcache_ring_doorbells_total",
		"Doorbells rung: clients that appended to a ring while the loop slept.",
		server->counters.ring_doorbells);
	counter(&text, "zipcache_ring_nudges_total",
		"Empty frames sent to clients asleep on their socket whose reply went to their ring.",
		server->counters.ring_nudges);
	gauge(&text, "zipcache_uptime_seconds", "Seconds since the daemon started.",
	      (double)(uv_now(server->loop) - server->started_ms) / 1000.0);
	if (server->remote)
		remote_render(&text, server->remote, server->offload.offloaded);

	if (text.error) {
		free(text.data);
		return text.error;
	}
	*out = text.data;
	*out_len = text.len;
	return 0;
}
