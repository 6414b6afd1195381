/*
 * Counters and latency histograms for the Prometheus endpoint, and the
 * text exposition itself. Updated and read on the loop thread only.
 */
#ifndef ZIPCACHE_METRICS_H
#define ZIPCACHE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

enum metrics_op {
	METRICS_OP_HELLO,
	METRICS_OP_OPEN_SESSION,
	METRICS_OP_UPDATE_AND_FETCH,
	METRICS_OP_TRIM,
	METRICS_OP_CLOSE_SESSION,
	METRICS_OP_STATS,
	METRICS_OP_LIST_SESSIONS,
	METRICS_OP_STAGING,
	METRICS_OP_FORK_SESSION,
	METRICS_OP_RELEASE,
	METRICS_OP_EXPORT_SESSION,
	METRICS_OP_IMPORT_SESSION,
	METRICS_OP_LOOKUP_PREFIX,
	METRICS_OP_INVALID,
	METRICS_OP_COUNT
};

#define METRICS_STATUS_COUNT WIRE_STATUS_COUNT
#define METRICS_BUCKETS 14

enum metrics_reason {
	METRICS_REASON_INVALID_ARGUMENT,
	METRICS_REASON_MALFORMED_REQUEST,
	METRICS_REASON_FRAME_TOO_LARGE,
	METRICS_REASON_NONFINITE_INPUT,
	METRICS_REASON_NOT_FOUND,
	METRICS_REASON_ALREADY_EXISTS,
	METRICS_REASON_RESOURCE_EXHAUSTED,
	METRICS_REASON_PERMISSION_DENIED,
	METRICS_REASON_FAILED_PRECONDITION,
	METRICS_REASON_INTERNAL,
	METRICS_REASON_CONNECTION_REFUSED,
	METRICS_REASON_DATA_LOSS,
	METRICS_REASON_REMOTE_UNAVAILABLE,
	METRICS_REASON_COUNT
};

/* The steps of memory relief (server/relief.c), in the order they run. */
enum metrics_relief_step {
	METRICS_RELIEF_RELEASE_RETAINED, /* pages kept from closed sessions (retain.h) */
	METRICS_RELIEF_DROP_VIEWS,
	METRICS_RELIEF_DROP_CHUNKS, /* prefix chunks only the chunk index holds */
	METRICS_RELIEF_OFFLOAD,     /* idle sessions written to the remote tier and dropped */
	METRICS_RELIEF_REFUSE,
	METRICS_RELIEF_STEP_COUNT
};

/* Which request a reply answers and when it arrived, for the histogram. */
struct request_meta {
	uint8_t op;
	uint64_t start_ns;
};

struct metrics {
	uint64_t requests[METRICS_OP_COUNT][METRICS_STATUS_COUNT];
	uint64_t latency_buckets[METRICS_OP_COUNT][METRICS_BUCKETS];
	uint64_t latency_count[METRICS_OP_COUNT];
	double latency_sum[METRICS_OP_COUNT];
	uint64_t errors[METRICS_REASON_COUNT];
	uint64_t view_drops;
	uint64_t idle_view_drops;     /* part of view_drops: no memory pressure, --view-idle-seconds */
	uint64_t relief_steps[METRICS_RELIEF_STEP_COUNT];
};

enum metrics_op metrics_op_of(enum wire_op op);
/* The latency histograms' bucket of a duration (the last for longer). */
unsigned metrics_bucket_of(uint64_t elapsed_ns);
/* status: the reply's enum wire_status. */
void metrics_request_done(struct metrics *metrics, uint8_t op, int status, uint64_t elapsed_ns);
void metrics_error(struct metrics *metrics, int error);
void metrics_error_reason(struct metrics *metrics, enum metrics_reason reason);

struct server;

/* The whole exposition (text format 0.0.4) in a malloc'd string. */
int metrics_render(const struct server *server, char **text, size_t *len);

#endif
