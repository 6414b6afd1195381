/*
 * zipcachectl: looks at a running zipcached through libzipcache.
 *
 *   zipcachectl [--socket PATH] [--json] [--timeout MS] COMMAND
 *
 *   ping           server version, protocol, boot epoch, round-trip time
 *   stats          daemon totals (a user other than root or the daemon's sees
 *                  its own), and the caller's usage of its per-uid quotas
 *   sessions       the caller's sessions, one row each
 *   session ID     one session's per-layer accounting and its total
 *   close ID       closes a session (its memory is freed)
 *   watch          a live table, refreshed every --interval seconds
 *
 * Only the public zc_ API is used, so the tool sees exactly what any
 * client of the daemon sees: its own uid's sessions and nothing else.
 *
 * Output: aligned tables for people; with --json, one JSON document per
 * command (per refresh for watch, one per line) for scripts. A command's
 * output is assembled in memory and written only once it succeeded, so a
 * failure never leaves half a table or half a document on stdout. Errors
 * are one line "zipcachectl: ..." on stderr; exit status 1 for a failure
 * while running, 2 for a usage error.
 *
 * Sessions are looked at by id, without a handle: `session` and `watch`
 * read the accounting with zc_client_session_stats(), which the daemon
 * does not count as use of the session (its idle time keeps running and
 * views the memory budget dropped stay dropped), and `close` closes by id
 * with zc_client_close_session().
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "failure.h"
#include "json.h"
#include "table.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define CTL_NAME "zipcachectl"
#define CTL_VERSION "0.1.0"

/* Long enough for a daemon busy with a large prefill on its loop thread,
 * short enough that a wedged daemon does not hang a script. */
#define CTL_DEFAULT_TIMEOUT_MS 5000
/* ping times this many requests: enough for a min/avg/max that means
 * something, few enough to be instant. */
#define CTL_PING_SAMPLES 5
/* Below this, watch's own requests would be most of what it measures. */
#define CTL_MIN_INTERVAL 0.05
#define CTL_MAX_INTERVAL 86400.0
/* Where the systemd unit in deploy/ puts the socket (RuntimeDirectory). */
#define CTL_SYSTEMD_SOCKET ZC_SERVICE_SOCKET_PATH

enum ctl_exit {
	CTL_EXIT_OK = 0,
	CTL_EXIT_FAILURE = 1,
	CTL_EXIT_USAGE = 2
};

enum ctl_command {
	CMD_NONE,
	CMD_PING,
	CMD_STATS,
	CMD_SESSIONS,
	CMD_SESSION,
	CMD_CLOSE,
	CMD_WATCH,
	CMD_SET_ASIDE,
	CMD_EXPORT,
	CMD_IMPORT,
	CMD_HELP
};

/* Export and import move a whole session: they wait at least this long
 * for the daemon's reply, whatever --timeout says (0 still waits forever). */
#define CTL_SNAPSHOT_TIMEOUT_MS 600000

struct ctl {
	enum ctl_command command;
	const char *socket_path;
	char default_socket[PATH_MAX];
	bool json;
	int timeout_ms;
	uint64_t session_id;        /* session, close */
	double interval;            /* watch */
	uint64_t count;             /* watch: refreshes, 0 = until interrupted */
	zc_client *client;
	FILE *out;                  /* the command's output, in memory */
	char *out_text;
	size_t out_length;
	uint64_t own_requests;      /* requests this process sent, for watch's rate */
	const char *file;           /* export, import */
	const char *name;           /* import --name */
	const char *model_id;       /* import --model-id */
};

static void ctl_usage(FILE *stream)
{
	fprintf(stream,
		"usage: " CTL_NAME " [--socket PATH] [--json] [--timeout MS] COMMAND\n"
		"\n"
		"commands:\n"
		"  ping                 server version, protocol, boot epoch and round-trip time\n"
		"  stats                daemon totals: sessions, connections, memory, requests,\n"
		"                       errors, tokens, uptime (your own unless you are root or\n"
		"                       the daemon's user); your uid's usage of its quotas\n"
		"  sessions             your sessions: shape, tokens, capacity, policy, idle time\n"
		"  session ID           one session's per-layer byte accounting and its total\n"
		"  close ID             close a session; its memory is freed\n"
		"  watch [--interval S] [--count N]\n"
		"                       a live table of sessions, tokens, bytes, compression\n"
		"                       ratio, idle time and request rate, every S seconds\n"
		"                       (default 1) until interrupted, or N times\n"
		"  set-aside            session files the daemon did not adopt (corrupt, or\n"
		"                       another uid's) and why; root and the daemon's user only\n"
		"  export ID FILE       write a verified snapshot of a session to FILE (\"-\":\n"
		"                       standard output); this tool opens it, not the daemon\n"
		"  import FILE [--name N] [--model-id M]\n"
		"                       a new session from a snapshot, verified whole before\n"
		"                       anything is made; with --model-id, only of that model\n"
		"  help                 this text\n"
		"\n"
		"options:\n"
		"  --socket PATH        the daemon's socket (default: $ZIPCACHE_SOCKET, else the\n"
		"                       daemon's default: /run/zipcached.sock as root,\n"
		"                       $XDG_RUNTIME_DIR/zipcached.sock, /tmp/zipcached-UID.sock;\n"
		"                       if that does not exist, " CTL_SYSTEMD_SOCKET ")\n"
		"  --json               one JSON document per command (per refresh for watch)\n"
		"  --timeout MS         connect and reply timeout in milliseconds (default %d)\n"
		"  -h, --help           this text\n"
		"  --version            the version\n"
		"\n"
		"A daemon shows each user only that user's sessions. Looking at a session\n"
		"(`session`, `watch`) does not count as using it: its idle time keeps\n"
		"running. Exit status: 0 success, 1 failure while running, 2 usage error.\n",
		CTL_DEFAULT_TIMEOUT_MS);
}

/* "zipcachectl: <message>", one line; see failure_print(). */
__attribute__((format(printf, 2, 3)))
static int ctl_fail(int status, const char *format, ...)
{
	va_list arguments;

	va_start(arguments, format);
	status = failure_print(CTL_NAME, status, format, arguments);
	va_end(arguments);
	return status;
}

/* A failed call: what we were doing, the code's sentence, and the daemon's
 * own sentence when it sent one. */
static int ctl_fail_call(const struct ctl *ctl, int rc, const char *what)
{
	const char *detail = ctl->client ? zc_client_last_error(ctl->client) : "";

	if (detail && *detail && strcmp(detail, zc_strerror(rc)) != 0)
		return ctl_fail(CTL_EXIT_FAILURE, "%s: %s: %s", what, zc_strerror(rc), detail);
	return ctl_fail(CTL_EXIT_FAILURE, "%s: %s", what, zc_strerror(rc));
}

/* ---- the default socket -------------------------------------------------- */

/*
 * The rule every client shares (zc_default_socket_path): $ZIPCACHE_SOCKET,
 * else where the daemon listens when this user starts it without --socket,
 * else the system service's socket. A path too long is cut, and then
 * refused by connect with ENAMETOOLONG.
 */
static const char *default_socket_path(struct ctl *ctl)
{
	(void)zc_default_socket_path(ctl->default_socket, sizeof(ctl->default_socket));
	return ctl->default_socket;
}

/* ---- formatting ---------------------------------------------------------- */

static const char *policy_name(zc_block_policy policy)
{
	return policy == ZC_POLICY_PER_CALL ? "per_call" : "streaming";
}

/* 1536 -> "1.5 KiB": powers of 1024, as the daemon's size flags are. */
static const char *format_bytes(char *out, size_t size, uint64_t bytes)
{
	static const char *const units[] = { "KiB", "MiB", "GiB", "TiB", "PiB" };
	double value = (double)bytes;
	size_t unit = 0;

	if (bytes < 1024) {
		snprintf(out, size, "%" PRIu64 " B", bytes);
		return out;
	}
	value /= 1024.0;
	while (value >= 1024.0 && unit + 1 < sizeof(units) / sizeof(units[0])) {
		value /= 1024.0;
		unit++;
	}
	snprintf(out, size, "%.1f %s", value, units[unit]);
	return out;
}

/* 850 -> "850ms", 12300 -> "12.3s", then "5m07s", "3h05m", "2d04h". */
static const char *format_duration(char *out, size_t size, uint64_t ms)
{
	uint64_t s = ms / 1000;

	if (ms < 1000)
		snprintf(out, size, "%" PRIu64 "ms", ms);
	else if (s < 60)
		snprintf(out, size, "%.1fs", (double)ms / 1000.0);
	else if (s < 3600)
		snprintf(out, size, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
	else if (s < 86400)
		snprintf(out, size, "%" PRIu64 "h%02" PRIu64 "m", s / 3600, s % 3600 / 60);
	else
		snprintf(out, size, "%" PRIu64 "d%02" PRIu64 "h", s / 86400, s % 86400 / 3600);
	return out;
}

/* "128" when K and V heads agree, else "128/64" (K/V). */
static const char *format_head_dims(char *out, size_t size, const zc_session_info *info)
{
	if (info->head_dim_k == info->head_dim_v)
		snprintf(out, size, "%u", info->head_dim_k);
	else
		snprintf(out, size, "%u/%u", info->head_dim_k, info->head_dim_v);
	return out;
}

/* "2048" when every layer holds as many tokens, else "2040..2048". */
static const char *format_tokens(char *out, size_t size, const zc_session_info *info)
{
	if (info->min_tokens == info->max_layer_tokens)
		snprintf(out, size, "%u", info->max_layer_tokens);
	else
		snprintf(out, size, "%u..%u", info->min_tokens, info->max_layer_tokens);
	return out;
}

static double monotonic_seconds(void)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* ---- talking to the daemon ---------------------------------------------- */

static int ctl_connect(struct ctl *ctl)
{
	int rc = zc_client_connect(ctl->socket_path, ctl->timeout_ms, &ctl->client);

	if (rc < 0) {
		char hint[PATH_MAX + 512];

		ctl->client = NULL;
		/* A socket closed to this user is the newcomer's usual case:
		 * say which directory or socket, and which group opens it. */
		if (failure_socket_hint(ctl->socket_path, rc, CTL_SYSTEMD_SOCKET, hint, sizeof(hint)))
			return ctl_fail(CTL_EXIT_FAILURE, "cannot connect to %s: %s%s%s", ctl->socket_path,
					rc == -ENOENT ? zc_strerror(rc) : "",
					rc == -ENOENT ? "; " : "", hint);
		return ctl_fail(CTL_EXIT_FAILURE, "cannot connect to %s: %s", ctl->socket_path,
				zc_strerror(rc));
	}
	return 0;
}

static int ctl_server_stats(struct ctl *ctl, zc_server_stats *stats)
{
	ctl->own_requests++;
	return zc_client_stats(ctl->client, stats);
}

static int compare_session_id(const void *a, const void *b)
{
	uint64_t x = ((const zc_session_info *)a)->id, y = ((const zc_session_info *)b)->id;

	return x < y ? -1 : x > y;
}

/*
 * The caller's sessions, sorted by id, in a malloc'd array. The list may
 * grow between asking how many there are and fetching them, so fetch
 * again with room for the new count until it fits.
 */
static int ctl_list_sessions(struct ctl *ctl, zc_session_info **out, size_t *count)
{
	size_t capacity = 16;
	zc_session_info *sessions = NULL;

	for (;;) {
		zc_session_info *grown = realloc(sessions, capacity * sizeof(*sessions));
		size_t found = 0;
		int rc;

		if (!grown) {
			free(sessions);
			return -ENOMEM;
		}
		sessions = grown;
		ctl->own_requests++;
		rc = zc_client_list_sessions(ctl->client, sessions, capacity, &found);
		if (rc < 0) {
			free(sessions);
			return rc;
		}
		if (found <= capacity) {
			qsort(sessions, found, sizeof(*sessions), compare_session_id);
			*out = sessions;
			*count = found;
			return 0;
		}
		capacity = found + 16;
	}
}

/* Finds session `id` among the caller's sessions. */
static int ctl_find_session(struct ctl *ctl, uint64_t id, zc_session_info *info)
{
	zc_session_info *sessions;
	size_t count;
	int rc = ctl_list_sessions(ctl, &sessions, &count);

	if (rc < 0)
		return rc;
	rc = ZC_ENOTFOUND;
	for (size_t i = 0; i < count; i++) {
		if (sessions[i].id == id) {
			*info = sessions[i];
			rc = 0;
			break;
		}
	}
	free(sessions);
	return rc;
}

/* One session's accounting by id, without a handle and without using the
 * session (zc_client_session_stats). `layers` has room for `capacity`
 * entries (or is NULL with 0). Id 0 names no session: ZC_ENOTFOUND, as
 * for any other id the daemon does not know. */
static int ctl_session_stats(struct ctl *ctl, uint64_t id, zc_layer_stats *layers, size_t capacity,
			     zc_layer_stats *total, zc_session_info *info)
{
	if (id == 0)
		return ZC_ENOTFOUND;
	ctl->own_requests++;
	return zc_client_session_stats(ctl->client, id, layers, capacity, total, info);
}

/* ---- ping ---------------------------------------------------------------- */

/* Microseconds to the nanosecond: the clock's resolution, and no digits
 * of floating-point noise in the JSON. */
static double round_ns(double us)
{
	return round(us * 1000.0) / 1000.0;
}

static int cmd_ping(struct ctl *ctl)
{
	double started = monotonic_seconds(), connect_us, min_us = INFINITY, max_us = 0, sum_us = 0;
	const zc_server_info *server;
	zc_server_stats stats;
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	connect_us = (monotonic_seconds() - started) * 1e6;
	for (int i = 0; i < CTL_PING_SAMPLES; i++) {
		double before = monotonic_seconds(), elapsed_us;

		rc = ctl_server_stats(ctl, &stats);
		if (rc < 0)
			return ctl_fail_call(ctl, rc, "ping");
		elapsed_us = (monotonic_seconds() - before) * 1e6;
		min_us = elapsed_us < min_us ? elapsed_us : min_us;
		max_us = elapsed_us > max_us ? elapsed_us : max_us;
		sum_us += elapsed_us;
	}
	server = zc_client_server_info(ctl->client);
	if (ctl->json) {
		struct json json = { ctl->out, false };

		json_open(&json, NULL, '{');
		json_text(&json, "socket", ctl->socket_path);
		json_text(&json, "server_version", server->server_version);
		json_uint(&json, "protocol_version", server->protocol_version);
		json_uint(&json, "boot_epoch", server->boot_epoch);
		json_double(&json, "connect_us", round_ns(connect_us));
		json_key(&json, "rtt_us");
		json_open(&json, NULL, '{');
		json_double(&json, "min", round_ns(min_us));
		json_double(&json, "avg", round_ns(sum_us / CTL_PING_SAMPLES));
		json_double(&json, "max", round_ns(max_us));
		json_uint(&json, "samples", CTL_PING_SAMPLES);
		json_close(&json, '}');
		json_key(&json, "limits");
		json_open(&json, NULL, '{');
		json_uint(&json, "max_frame_bytes", server->max_frame_bytes);
		json_uint(&json, "max_inline_bytes", server->max_inline_bytes);
		json_uint(&json, "max_sessions", server->max_sessions);
		json_uint(&json, "max_tokens_per_session", server->max_tokens_per_session);
		json_uint(&json, "memory_budget_bytes", server->memory_budget_bytes);
		json_close(&json, '}');
		json_close(&json, '}');
		fputc('\n', ctl->out);
		return 0;
	}

	static const struct table_column columns[] = { { "KEY", TABLE_LEFT }, { "VALUE", TABLE_LEFT } };
	struct table table;

	table_init(&table, columns, 2);
	table.show_header = false;
	table_add(&table, "server");
	table_add(&table, "zipcached %s at %s", server->server_version, ctl->socket_path);
	table_add(&table, "protocol");
	table_add(&table, "%u", server->protocol_version);
	table_add(&table, "boot epoch");
	table_add(&table, "%" PRIu64, server->boot_epoch);
	table_add(&table, "connect");
	table_add(&table, "%.3f ms", connect_us / 1000.0);
	table_add(&table, "round trip");
	table_add(&table, "min %.3f ms, avg %.3f ms, max %.3f ms (%d requests)", min_us / 1000.0,
		  sum_us / CTL_PING_SAMPLES / 1000.0, max_us / 1000.0, CTL_PING_SAMPLES);
	rc = table_print(&table, ctl->out);
	table_free(&table);
	return rc < 0 ? ctl_fail(CTL_EXIT_FAILURE, "ping: %s", zc_strerror(rc)) : 0;
}

/* ---- stats --------------------------------------------------------------- */

static void json_memory_stats(struct json *json, const zc_memory_stats *memory)
{
	json_uint(json, "memory_file_bytes", memory->file_bytes);
	json_open(json, "memory_by_kind", '{');
	json_uint(json, "views", memory->views_bytes);
	json_uint(json, "blocks", memory->blocks_bytes);
	json_uint(json, "residual", memory->residual_bytes);
	json_uint(json, "index", memory->index_bytes);
	json_uint(json, "headers", memory->headers_bytes);
	json_uint(json, "retained", memory->retained_bytes);
	json_close(json, '}');
	json_uint(json, "set_aside_files", memory->set_aside_files);
}

static void json_server_stats(struct json *json, const zc_server_stats *stats)
{
	json_uint(json, "sessions", stats->sessions);
	json_uint(json, "connections", stats->connections);
	json_uint(json, "memory_used_bytes", stats->memory_used_bytes);
	json_uint(json, "memory_budget_bytes", stats->memory_budget_bytes);
	json_uint(json, "requests", stats->requests);
	json_uint(json, "request_errors", stats->request_errors);
	json_uint(json, "tokens_appended", stats->tokens_appended);
	json_uint(json, "uptime_ms", stats->uptime_ms);
	json_uint(json, "boot_epoch", stats->boot_epoch);
}

static void json_uid_stats(struct json *json, const zc_uid_stats *uid)
{
	json_bool(json, "daemon_wide", uid->daemon_wide);
	json_open(json, "uid", '{');
	json_uint(json, "uid", uid->uid);
	json_uint(json, "sessions", uid->sessions);
	json_uint(json, "max_sessions", uid->max_sessions);
	json_uint(json, "connections", uid->connections);
	json_uint(json, "max_connections", uid->max_connections);
	json_uint(json, "memory_used_bytes", uid->memory_used_bytes);
	json_uint(json, "memory_budget_bytes", uid->memory_budget_bytes);
	json_uint(json, "staging_bytes", uid->staging_bytes);
	json_uint(json, "max_staging_bytes", uid->max_staging_bytes);
	json_close(json, '}');
}

/* "3 of 512", or "3 (no per-uid limit)". */
static void table_add_quota(struct table *table, uint64_t used, uint64_t quota, bool bytes)
{
	char a[32], b[32];
	if (bytes)
		format_bytes(a, sizeof(a), used);
	else
		snprintf(a, sizeof(a), "%" PRIu64, used);
	if (!quota) {
		table_add(table, "%s (no per-uid limit)", a);
		return;
	}
	if (bytes)
		format_bytes(b, sizeof(b), quota);
	else
		snprintf(b, sizeof(b), "%" PRIu64, quota);
	table_add(table, "%s of %s", a, b);
}

static int cmd_stats(struct ctl *ctl)
{
	const zc_server_info *server;
	zc_server_stats stats;
	zc_uid_stats own;
	zc_memory_stats memory;
	char used[32], budget[32], uptime[32], files[32];
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	/* One request: the daemon's figures and the caller's own. */
	ctl->own_requests++;
	rc = zc_client_uid_stats(ctl->client, &own, &stats, &memory);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, "stats");
	server = zc_client_server_info(ctl->client);
	if (ctl->json) {
		struct json json = { ctl->out, false };

		json_open(&json, NULL, '{');
		json_text(&json, "server_version", server->server_version);
		json_uint(&json, "protocol_version", server->protocol_version);
		json_server_stats(&json, &stats);
		json_memory_stats(&json, &memory);
		json_uint(&json, "max_sessions", server->max_sessions);
		json_uid_stats(&json, &own);
		json_close(&json, '}');
		fputc('\n', ctl->out);
		return 0;
	}

	static const struct table_column columns[] = { { "KEY", TABLE_LEFT }, { "VALUE", TABLE_LEFT } };
	struct table table;

	table_init(&table, columns, 2);
	table.show_header = false;
	table_add(&table, "server");
	table_add(&table, "zipcached %s (protocol %u)", server->server_version,
		  server->protocol_version);
	table_add(&table, "uptime");
	table_add(&table, "%s", format_duration(uptime, sizeof(uptime), stats.uptime_ms));
	table_add(&table, "sessions");
	table_add(&table, "%u of %u", stats.sessions, server->max_sessions);
	table_add(&table, "connections");
	table_add(&table, "%u", stats.connections);
	table_add(&table, "memory used");
	table_add(&table, "%s (%" PRIu64 " bytes)", format_bytes(used, sizeof(used), stats.memory_used_bytes),
		  stats.memory_used_bytes);
	table_add(&table, "memory in files");
	table_add(&table, "%s (%" PRIu64 " bytes: what the session files hold)",
		  format_bytes(files, sizeof(files), memory.file_bytes), memory.file_bytes);
	const struct { const char *kind; uint64_t bytes; } kinds[] = {
		{ "  views", memory.views_bytes }, { "  compressed blocks", memory.blocks_bytes },
		{ "  residual", memory.residual_bytes }, { "  index", memory.index_bytes },
		{ "  headers", memory.headers_bytes },
		{ "  retained (closed sessions' pages)", memory.retained_bytes },
	};
	for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
		table_add(&table, "%s", kinds[i].kind);
		table_add(&table, "%s", format_bytes(files, sizeof(files), kinds[i].bytes));
	}
	table_add(&table, "memory budget");
	if (stats.memory_budget_bytes)
		table_add(&table, "%s (%" PRIu64 " bytes, %.1f%% used)",
			  format_bytes(budget, sizeof(budget), stats.memory_budget_bytes),
			  stats.memory_budget_bytes,
			  100.0 * (double)stats.memory_used_bytes / (double)stats.memory_budget_bytes);
	else
		table_add(&table, "none");
	table_add(&table, "requests");
	table_add(&table, "%" PRIu64, stats.requests);
	table_add(&table, "request errors");
	table_add(&table, "%" PRIu64, stats.request_errors);
	table_add(&table, "tokens appended");
	table_add(&table, "%" PRIu64, stats.tokens_appended);
	table_add(&table, "boot epoch");
	table_add(&table, "%" PRIu64, stats.boot_epoch);
	if (memory.set_aside_files) {
		table_add(&table, "set-aside files");
		table_add(&table, "%u (zipcachectl set-aside says why)", memory.set_aside_files);
	}
	/* Another user's daemon shows that user nothing of anyone else's. */
	table_add(&table, "figures");
	table_add(&table, "%s", own.daemon_wide ? "the daemon's" : "your uid's own");
	table_add(&table, "your uid");
	table_add(&table, "%u", own.uid);
	table_add(&table, "your sessions");
	table_add_quota(&table, own.sessions, own.max_sessions, false);
	table_add(&table, "your connections");
	table_add_quota(&table, own.connections, own.max_connections, false);
	table_add(&table, "your memory");
	table_add_quota(&table, own.memory_used_bytes, own.memory_budget_bytes, true);
	table_add(&table, "your staging");
	table_add_quota(&table, own.staging_bytes, own.max_staging_bytes, true);
	rc = table_print(&table, ctl->out);
	table_free(&table);
	return rc < 0 ? ctl_fail(CTL_EXIT_FAILURE, "stats: %s", zc_strerror(rc)) : 0;
}

/* ---- set-aside ----------------------------------------------------------- */

static int cmd_set_aside(struct ctl *ctl)
{
	zc_set_aside_file files[16];
	size_t count = 0;
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	ctl->own_requests++;
	rc = zc_client_set_aside(ctl->client, files, 16, &count);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, "set-aside");
	size_t shown = count < 16 ? count : 16;
	if (ctl->json) {
		struct json json = { ctl->out, false };
		json_open(&json, NULL, '{');
		json_uint(&json, "count", count);
		json_open(&json, "files", '[');
		for (size_t i = 0; i < shown; i++) {
			json_open(&json, NULL, '{');
			json_text(&json, "file", files[i].file);
			json_text(&json, "reason", files[i].reason);
			json_close(&json, '}');
		}
		json_close(&json, ']');
		json_close(&json, '}');
		fputc('\n', ctl->out);
		return 0;
	}
	if (count == 0) {
		fprintf(ctl->out, "no set-aside session files\n");
		return 0;
	}
	static const struct table_column columns[] = { { "FILE", TABLE_LEFT }, { "REASON", TABLE_LEFT } };
	struct table table;
	table_init(&table, columns, 2);
	for (size_t i = 0; i < shown; i++) {
		table_add(&table, "%s", files[i].file);
		table_add(&table, "%s", files[i].reason);
	}
	rc = table_print(&table, ctl->out);
	table_free(&table);
	if (count > shown)
		fprintf(ctl->out, "(%zu more; the daemon's log names them all)\n", count - shown);
	return rc < 0 ? ctl_fail(CTL_EXIT_FAILURE, "set-aside: %s", zc_strerror(rc)) : 0;
}

/* ---- sessions ------------------------------------------------------------ */

static void json_session_info(struct json *json, const zc_session_info *info)
{
	json_open(json, NULL, '{');
	json_uint(json, "id", info->id);
	json_text(json, "name", info->name);
	json_uint(json, "layers", info->layers);
	json_uint(json, "batch", info->batch);
	json_uint(json, "kv_heads", info->kv_heads);
	json_uint(json, "head_dim_k", info->head_dim_k);
	json_uint(json, "head_dim_v", info->head_dim_v);
	json_uint(json, "min_tokens", info->min_tokens);
	json_uint(json, "max_layer_tokens", info->max_layer_tokens);
	json_uint(json, "max_tokens", info->max_tokens);
	json_text(json, "policy", policy_name(info->policy));
	json_uint(json, "residual_tokens", info->residual_tokens);
	json_key(json, "codec");
	json_open(json, NULL, '{');
	json_uint(json, "hi_bits", (uint64_t)info->codec.hi_bits);
	json_uint(json, "lo_bits", (uint64_t)info->codec.lo_bits);
	json_double(json, "hi_fraction", info->codec.hi_fraction);
	json_uint(json, "group_size", (uint64_t)info->codec.group_size);
	json_bool(json, "quantize_values", info->codec.quantize_values);
	json_text(json, "saliency",
		  info->codec.saliency == ZC_SALIENCY_ATTENTION ? "attention" : "key_norm");
	json_close(json, '}');
	json_uint(json, "idle_ms", info->idle_ms);
	json_text(json, "views", info->views == ZC_VIEWS_NONE ? "none" : "full");
	json_uint(json, "shared_bytes", info->shared_bytes);
	json_bool(json, "leased", info->leased);
	json_text(json, "model_id", info->model_id);
	json_close(json, '}');
}

static int cmd_sessions(struct ctl *ctl)
{
	zc_session_info *sessions;
	size_t count;
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	rc = ctl_list_sessions(ctl, &sessions, &count);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, "sessions");
	if (ctl->json) {
		struct json json = { ctl->out, false };

		json_open(&json, NULL, '{');
		json_key(&json, "sessions");
		json_open(&json, NULL, '[');
		for (size_t i = 0; i < count; i++)
			json_session_info(&json, &sessions[i]);
		json_close(&json, ']');
		json_close(&json, '}');
		fputc('\n', ctl->out);
		free(sessions);
		return 0;
	}
	if (count == 0) {
		fputs("no sessions\n", ctl->out);
		free(sessions);
		return 0;
	}

	static const struct table_column columns[] = {
		{ "ID", TABLE_RIGHT }, { "NAME", TABLE_LEFT }, { "LAYERS", TABLE_RIGHT },
		{ "BATCH", TABLE_RIGHT }, { "KV_HEADS", TABLE_RIGHT }, { "HEAD_DIM", TABLE_RIGHT },
		{ "TOKENS", TABLE_RIGHT }, { "MAX_TOKENS", TABLE_RIGHT }, { "POLICY", TABLE_LEFT },
		{ "VIEWS", TABLE_LEFT }, { "SHARED", TABLE_RIGHT }, { "LEASED", TABLE_LEFT },
		{ "IDLE", TABLE_RIGHT },
	};
	struct table table;
	char dims[32], tokens[32], idle[32], shared[32];

	table_init(&table, columns, sizeof(columns) / sizeof(columns[0]));
	for (size_t i = 0; i < count; i++) {
		const zc_session_info *s = &sessions[i];

		table_add(&table, "%" PRIu64, s->id);
		table_add(&table, "%s", s->name);
		table_add(&table, "%u", s->layers);
		table_add(&table, "%u", s->batch);
		table_add(&table, "%u", s->kv_heads);
		table_add(&table, "%s", format_head_dims(dims, sizeof(dims), s));
		table_add(&table, "%s", format_tokens(tokens, sizeof(tokens), s));
		table_add(&table, "%u", s->max_tokens);
		table_add(&table, "%s", policy_name(s->policy));
		table_add(&table, "%s", s->views == ZC_VIEWS_NONE ? "none" : "full");
		table_add(&table, "%s", format_bytes(shared, sizeof(shared), s->shared_bytes));
		table_add(&table, "%s", s->leased ? "yes" : "no");
		table_add(&table, "%s", format_duration(idle, sizeof(idle), s->idle_ms));
	}
	rc = table_print(&table, ctl->out);
	table_free(&table);
	free(sessions);
	return rc < 0 ? ctl_fail(CTL_EXIT_FAILURE, "sessions: %s", zc_strerror(rc)) : 0;
}

/* ---- session ID ---------------------------------------------------------- */

static void json_layer_stats(struct json *json, const zc_layer_stats *s, bool with_layer)
{
	json_open(json, NULL, '{');
	if (with_layer)
		json_uint(json, "layer", s->layer);
	json_uint(json, "tokens", s->tokens);
	json_uint(json, "residual_tokens", s->residual_tokens);
	json_uint(json, "blocks", s->blocks);
	json_uint(json, "compressed_key_bytes", s->compressed_key_bytes);
	json_uint(json, "compressed_value_bytes", s->compressed_value_bytes);
	json_uint(json, "baseline_key_bytes", s->baseline_key_bytes);
	json_uint(json, "baseline_value_bytes", s->baseline_value_bytes);
	json_uint(json, "fp16_key_bytes", s->fp16_key_bytes);
	json_uint(json, "fp16_value_bytes", s->fp16_value_bytes);
	json_double(json, "compression_ratio", s->compression_ratio);
	json_double(json, "effective_avg_bits", s->effective_avg_bits);
	json_close(json, '}');
}

static void table_add_layer(struct table *table, const char *label, const zc_layer_stats *s)
{
	table_add(table, "%s", label);
	table_add(table, "%u", s->tokens);
	table_add(table, "%u", s->residual_tokens);
	table_add(table, "%" PRIu64, s->blocks);
	table_add(table, "%" PRIu64, s->compressed_key_bytes);
	table_add(table, "%" PRIu64, s->compressed_value_bytes);
	table_add(table, "%" PRIu64, s->baseline_key_bytes);
	table_add(table, "%" PRIu64, s->baseline_value_bytes);
	table_add(table, "%" PRIu64, s->fp16_key_bytes);
	table_add(table, "%" PRIu64, s->fp16_value_bytes);
	table_add(table, "%.2f", s->compression_ratio);
	table_add(table, "%.2f", s->effective_avg_bits);
}

static int print_session(struct ctl *ctl, const zc_session_info *info, const zc_layer_stats *layers,
			 const zc_layer_stats *total)
{
	static const struct table_column summary_columns[] = {
		{ "KEY", TABLE_LEFT }, { "VALUE", TABLE_LEFT }
	};
	static const struct table_column columns[] = {
		{ "LAYER", TABLE_RIGHT }, { "TOKENS", TABLE_RIGHT }, { "RESIDUAL", TABLE_RIGHT },
		{ "BLOCKS", TABLE_RIGHT }, { "KEY_BYTES", TABLE_RIGHT }, { "VALUE_BYTES", TABLE_RIGHT },
		{ "BASE_KEY", TABLE_RIGHT }, { "BASE_VALUE", TABLE_RIGHT }, { "FP16_KEY", TABLE_RIGHT },
		{ "FP16_VALUE", TABLE_RIGHT }, { "KEY_RATIO", TABLE_RIGHT }, { "AVG_BITS", TABLE_RIGHT },
	};
	struct table summary, table;
	char label[32], tokens[32];
	int rc;

	table_init(&summary, summary_columns, 2);
	summary.show_header = false;
	table_add(&summary, "id");
	table_add(&summary, "%" PRIu64, info->id);
	table_add(&summary, "name");
	table_add(&summary, "%s", info->name);
	table_add(&summary, "shape");
	table_add(&summary, "%u layers, batch %u, %u kv heads, head dim %u (K) %u (V)", info->layers,
		  info->batch, info->kv_heads, info->head_dim_k, info->head_dim_v);
	table_add(&summary, "tokens");
	table_add(&summary, "%s of %u", format_tokens(tokens, sizeof(tokens), info), info->max_tokens);
	table_add(&summary, "policy");
	if (info->policy == ZC_POLICY_STREAMING)
		table_add(&summary, "streaming, residual %u tokens", info->residual_tokens);
	else
		table_add(&summary, "per_call");
	table_add(&summary, "codec");
	table_add(&summary, "keys %d/%d bits, %g%% salient by %s, groups of %d; values %s",
		  info->codec.hi_bits, info->codec.lo_bits, info->codec.hi_fraction * 100.0,
		  info->codec.saliency == ZC_SALIENCY_ATTENTION ? "attention" : "key norm",
		  info->codec.group_size, info->codec.quantize_values ? "quantized" : "exact fp16");
	rc = table_print(&summary, ctl->out);
	table_free(&summary);
	if (rc < 0)
		return rc;
	fputc('\n', ctl->out);

	table_init(&table, columns, sizeof(columns) / sizeof(columns[0]));
	for (uint32_t i = 0; i < info->layers; i++) {
		snprintf(label, sizeof(label), "%u", layers[i].layer);
		table_add_layer(&table, label, &layers[i]);
	}
	table_add_layer(&table, "total", total);
	rc = table_print(&table, ctl->out);
	table_free(&table);
	return rc;
}

static int cmd_session(struct ctl *ctl)
{
	zc_session_info info;
	zc_layer_stats total, *layers = NULL;
	size_t capacity = 128;     /* most models; asked again if it has more layers */
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	for (;;) {
		zc_layer_stats *grown = realloc(layers, capacity * sizeof(*layers));

		if (!grown) {
			free(layers);
			return ctl_fail(CTL_EXIT_FAILURE, "session %" PRIu64 ": %s", ctl->session_id,
					zc_strerror(-ENOMEM));
		}
		layers = grown;
		memset(&info, 0, sizeof(info));
		rc = ctl_session_stats(ctl, ctl->session_id, layers, capacity, &total, &info);
		if (rc < 0 || info.layers <= capacity)
			break;
		capacity = info.layers;
	}
	if (rc == ZC_ENOTFOUND) {
		free(layers);
		return ctl_fail(CTL_EXIT_FAILURE, "no session %" PRIu64, ctl->session_id);
	}
	if (rc < 0) {
		char what[64];

		free(layers);
		snprintf(what, sizeof(what), "session %" PRIu64, ctl->session_id);
		return ctl_fail_call(ctl, rc, what);
	}
	if (ctl->json) {
		struct json json = { ctl->out, false };

		json_open(&json, NULL, '{');
		json_key(&json, "session");
		json_session_info(&json, &info);
		json_key(&json, "layers");
		json_open(&json, NULL, '[');
		for (uint32_t i = 0; i < info.layers; i++)
			json_layer_stats(&json, &layers[i], true);
		json_close(&json, ']');
		json_key(&json, "total");
		json_layer_stats(&json, &total, false);
		json_close(&json, '}');
		fputc('\n', ctl->out);
		rc = 0;
	} else {
		rc = print_session(ctl, &info, layers, &total);
	}
	free(layers);
	return rc < 0 ? ctl_fail(CTL_EXIT_FAILURE, "session: %s", zc_strerror(rc)) : 0;
}

/* ---- close ID ------------------------------------------------------------ */

static int cmd_close(struct ctl *ctl)
{
	zc_session_info info;
	char what[64];
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	snprintf(what, sizeof(what), "close %" PRIu64, ctl->session_id);
	/* The list, for the name to report (it does not touch the session). */
	rc = ctl_find_session(ctl, ctl->session_id, &info);
	if (rc == ZC_ENOTFOUND)
		return ctl_fail(CTL_EXIT_FAILURE, "no session %" PRIu64, ctl->session_id);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, what);
	ctl->own_requests++;
	rc = zc_client_close_session(ctl->client, ctl->session_id);
	/* Closed by someone else since the list: gone all the same, but not
	 * by us, so say so. */
	if (rc == ZC_ENOTFOUND)
		return ctl_fail(CTL_EXIT_FAILURE, "no session %" PRIu64, ctl->session_id);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, what);
	if (ctl->json) {
		struct json json = { ctl->out, false };

		json_open(&json, NULL, '{');
		json_key(&json, "closed");
		json_open(&json, NULL, '{');
		json_uint(&json, "id", info.id);
		json_text(&json, "name", info.name);
		json_close(&json, '}');
		json_close(&json, '}');
		fputc('\n', ctl->out);
	} else {
		char name[sizeof(info.name)];

		snprintf(name, sizeof(name), "%s", info.name);
		for (char *c = name; *c; c++)
			if ((unsigned char)*c < 0x20 || *c == 0x7f)
				*c = '?';
		fprintf(ctl->out, "closed session %" PRIu64 " (%s)\n", info.id, name);
	}
	return 0;
}

/* ---- export ID FILE, import FILE ------------------------------------------ */

static int ctl_connect_for_snapshot(struct ctl *ctl)
{
	int rc = ctl_connect(ctl);
	if (rc == 0 && ctl->timeout_ms != 0 && ctl->timeout_ms < CTL_SNAPSHOT_TIMEOUT_MS)
		zc_client_set_timeout(ctl->client, CTL_SNAPSHOT_TIMEOUT_MS);
	return rc;
}

static int cmd_export(struct ctl *ctl)
{
	zc_session_info info;
	char what[64];
	int rc = ctl_connect_for_snapshot(ctl);

	if (rc)
		return rc;
	snprintf(what, sizeof(what), "export %" PRIu64, ctl->session_id);
	rc = ctl_find_session(ctl, ctl->session_id, &info);
	if (rc == ZC_ENOTFOUND)
		return ctl_fail(CTL_EXIT_FAILURE, "no session %" PRIu64, ctl->session_id);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, what);
	bool to_stdout = strcmp(ctl->file, "-") == 0;
	int fd = to_stdout ? STDOUT_FILENO :
			     open(ctl->file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return ctl_fail(CTL_EXIT_FAILURE, "cannot open %s: %s", ctl->file, strerror(errno));
	uint64_t bytes = 0;
	ctl->own_requests++;
	rc = zc_client_export(ctl->client, ctl->session_id, fd, &bytes);
	if (!to_stdout && close(fd) < 0 && rc == 0)
		return ctl_fail(CTL_EXIT_FAILURE, "cannot write %s: %s", ctl->file, strerror(errno));
	if (rc < 0) {
		if (!to_stdout)
			unlink(ctl->file);   /* a partial snapshot is worth nothing */
		return ctl_fail_call(ctl, rc, what);
	}
	/* Standard output carries the snapshot: the report goes to stderr. */
	FILE *report = to_stdout ? stderr : ctl->out;
	if (ctl->json) {
		struct json json = { report, false };
		json_open(&json, NULL, '{');
		json_key(&json, "exported");
		json_open(&json, NULL, '{');
		json_uint(&json, "id", info.id);
		json_text(&json, "name", info.name);
		json_text(&json, "file", ctl->file);
		json_uint(&json, "bytes", bytes);
		json_close(&json, '}');
		json_close(&json, '}');
		fputc('\n', report);
	} else {
		fprintf(report, "exported session %" PRIu64 " to %s: %" PRIu64 " bytes\n", info.id,
			ctl->file, bytes);
	}
	return 0;
}

static int cmd_import(struct ctl *ctl)
{
	zc_import_options options;
	zc_session *session;
	int rc = ctl_connect_for_snapshot(ctl);

	if (rc)
		return rc;
	int fd = open(ctl->file, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return ctl_fail(CTL_EXIT_FAILURE, "cannot open %s: %s", ctl->file, strerror(errno));
	zc_import_options_default(&options);
	options.name = ctl->name;
	options.model_id = ctl->model_id;
	ctl->own_requests++;
	rc = zc_session_import(ctl->client, fd, &options, &session);
	close(fd);
	if (rc < 0)
		return ctl_fail_call(ctl, rc, "import");
	zc_session_info info = *zc_session_get_info(session);
	zc_session_release(session);
	if (ctl->json) {
		struct json json = { ctl->out, false };
		json_open(&json, NULL, '{');
		json_key(&json, "imported");
		json_session_info(&json, &info);
		json_close(&json, '}');
		fputc('\n', ctl->out);
	} else {
		char name[sizeof(info.name)];
		snprintf(name, sizeof(name), "%s", info.name);
		for (char *c = name; *c; c++)
			if ((unsigned char)*c < 0x20 || *c == 0x7f)
				*c = '?';
		fprintf(ctl->out, "imported session %" PRIu64 " (%s) from %s: %u layers, %u tokens in "
			"the longest\n", info.id, name, ctl->file, info.layers, info.max_layer_tokens);
	}
	return 0;
}

/* ---- watch --------------------------------------------------------------- */

/* One session's row in a watch refresh. */
struct watch_row {
	zc_session_info info;
	zc_layer_stats total;
	bool have_total;           /* false when it vanished while we looked */
};

struct watch_sample {
	zc_server_stats stats;
	double at;                 /* monotonic seconds, when the stats came back */
	uint64_t own_requests;     /* ctl->own_requests just after the stats call */
	struct watch_row *rows;
	size_t n_rows;
};

static uint64_t row_stored_bytes(const zc_layer_stats *t)
{
	return t->compressed_key_bytes + t->compressed_value_bytes;
}

static uint64_t row_fp16_bytes(const zc_layer_stats *t)
{
	return t->fp16_key_bytes + t->fp16_value_bytes;
}

/* Keys and values together: what the session's memory holds against what
 * fp16 would. (The per-layer KEY_RATIO of `session` is the key side only,
 * the seed's figure.) */
static double row_ratio(const zc_layer_stats *t)
{
	uint64_t stored = row_stored_bytes(t);

	return stored ? (double)row_fp16_bytes(t) / (double)stored : NAN;
}

static bool is_connection_error(int rc)
{
	return rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN || rc == ZC_EPROTOCOL;
}

static int watch_take(struct ctl *ctl, struct watch_sample *sample)
{
	zc_session_info *sessions;
	size_t count;
	int rc = ctl_server_stats(ctl, &sample->stats);

	if (rc < 0)
		return rc;
	sample->at = monotonic_seconds();
	sample->own_requests = ctl->own_requests;
	rc = ctl_list_sessions(ctl, &sessions, &count);
	if (rc < 0)
		return rc;
	sample->rows = calloc(count ? count : 1, sizeof(*sample->rows));
	if (!sample->rows) {
		free(sessions);
		return -ENOMEM;
	}
	sample->n_rows = count;
	for (size_t i = 0; i < count; i++) {
		struct watch_row *row = &sample->rows[i];

		zc_session_info fresh = { 0 };

		row->info = sessions[i];
		rc = ctl_session_stats(ctl, sessions[i].id, NULL, 0, &row->total, &fresh);
		if (rc == ZC_ENOTFOUND)
			continue;      /* closed while we looked: show what the list said */
		if (rc < 0) {
			free(sessions);
			return rc;
		}
		/* Newer than the list's (tokens, idle time), and of the same session. */
		if (fresh.id == sessions[i].id)
			row->info = fresh;
		row->have_total = true;
	}
	free(sessions);
	return 0;
}

static void watch_sample_free(struct watch_sample *sample)
{
	free(sample->rows);
	memset(sample, 0, sizeof(*sample));
}

/*
 * Requests per second between two samples, not counting watch's own: the
 * daemon counts a request when it arrives, so the later stats call counts
 * itself, and everything this process sent after the earlier one is ours.
 * NAN when there is no earlier sample (or the daemon restarted).
 */
static double watch_rate(const struct watch_sample *previous, const struct watch_sample *now)
{
	uint64_t total, ours;
	double elapsed;

	if (!previous || previous->stats.boot_epoch != now->stats.boot_epoch ||
	    now->stats.requests < previous->stats.requests)
		return NAN;
	elapsed = now->at - previous->at;
	if (elapsed <= 0)
		return NAN;
	total = now->stats.requests - previous->stats.requests;
	ours = now->own_requests - previous->own_requests;
	return total > ours ? (double)(total - ours) / elapsed : 0.0;
}

static void watch_print_json(struct ctl *ctl, const struct watch_sample *sample, double rate)
{
	struct json json = { ctl->out, false };
	struct timespec now;

	clock_gettime(CLOCK_REALTIME, &now);
	json_open(&json, NULL, '{');
	json_uint(&json, "time_ms", (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000);
	json_key(&json, "server");
	json_open(&json, NULL, '{');
	json_server_stats(&json, &sample->stats);
	json_close(&json, '}');
	json_double(&json, "request_rate", rate);
	json_key(&json, "sessions");
	json_open(&json, NULL, '[');
	for (size_t i = 0; i < sample->n_rows; i++) {
		const struct watch_row *row = &sample->rows[i];

		json_open(&json, NULL, '{');
		json_uint(&json, "id", row->info.id);
		json_text(&json, "name", row->info.name);
		json_uint(&json, "layers", row->info.layers);
		json_uint(&json, "min_tokens", row->info.min_tokens);
		json_uint(&json, "max_layer_tokens", row->info.max_layer_tokens);
		json_uint(&json, "max_tokens", row->info.max_tokens);
		if (row->have_total) {
			json_uint(&json, "stored_bytes", row_stored_bytes(&row->total));
			json_uint(&json, "fp16_bytes", row_fp16_bytes(&row->total));
			json_double(&json, "ratio", row_ratio(&row->total));
		}
		json_uint(&json, "idle_ms", row->info.idle_ms);
		json_close(&json, '}');
	}
	json_close(&json, ']');
	json_close(&json, '}');
	fputc('\n', ctl->out);
}

static int watch_print_table(struct ctl *ctl, const struct watch_sample *sample, double rate)
{
	static const struct table_column columns[] = {
		{ "ID", TABLE_RIGHT }, { "NAME", TABLE_LEFT }, { "LAYERS", TABLE_RIGHT },
		{ "TOKENS", TABLE_RIGHT }, { "MAX_TOKENS", TABLE_RIGHT }, { "STORED", TABLE_RIGHT },
		{ "FP16", TABLE_RIGHT }, { "RATIO", TABLE_RIGHT }, { "IDLE", TABLE_RIGHT },
	};
	const zc_server_stats *s = &sample->stats;
	char uptime[32], used[32], budget[32], tokens[32], stored[32], fp16[32], clock[32], idle[32];
	struct table table;
	time_t now = time(NULL);
	struct tm local;
	int rc;

	strftime(clock, sizeof(clock), "%H:%M:%S", localtime_r(&now, &local));
	fprintf(ctl->out, "zipcached %s at %s  %s  up %s\n",
		zc_client_server_info(ctl->client)->server_version, ctl->socket_path, clock,
		format_duration(uptime, sizeof(uptime), s->uptime_ms));
	fprintf(ctl->out, "sessions %u  connections %u  memory %s / %s  ", s->sessions, s->connections,
		format_bytes(used, sizeof(used), s->memory_used_bytes),
		s->memory_budget_bytes ? format_bytes(budget, sizeof(budget), s->memory_budget_bytes) :
					 "no budget");
	if (isnan(rate))
		fprintf(ctl->out, "requests %" PRIu64 " (-/s)  errors %" PRIu64 "\n", s->requests,
			s->request_errors);
	else
		fprintf(ctl->out, "requests %" PRIu64 " (%.1f/s)  errors %" PRIu64 "\n", s->requests,
			rate, s->request_errors);
	fputc('\n', ctl->out);
	if (sample->n_rows == 0) {
		fputs("no sessions\n", ctl->out);
		return 0;
	}
	table_init(&table, columns, sizeof(columns) / sizeof(columns[0]));
	for (size_t i = 0; i < sample->n_rows; i++) {
		const struct watch_row *row = &sample->rows[i];

		table_add(&table, "%" PRIu64, row->info.id);
		table_add(&table, "%s", row->info.name);
		table_add(&table, "%u", row->info.layers);
		table_add(&table, "%s", format_tokens(tokens, sizeof(tokens), &row->info));
		table_add(&table, "%u", row->info.max_tokens);
		if (row->have_total) {
			double ratio = row_ratio(&row->total);

			table_add(&table, "%s", format_bytes(stored, sizeof(stored),
							     row_stored_bytes(&row->total)));
			table_add(&table, "%s", format_bytes(fp16, sizeof(fp16), row_fp16_bytes(&row->total)));
			if (isnan(ratio))
				table_add(&table, "-");
			else
				table_add(&table, "%.2f", ratio);
		} else {
			table_add(&table, "-");
			table_add(&table, "-");
			table_add(&table, "-");
		}
		table_add(&table, "%s", format_duration(idle, sizeof(idle), row->info.idle_ms));
	}
	rc = table_print(&table, ctl->out);
	table_free(&table);
	return rc;
}

/* Sleeps until `deadline` (monotonic), through signals that return. */
static void sleep_until(const struct timespec *deadline)
{
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, deadline, NULL) == EINTR)
		;
}

static void timespec_add(struct timespec *t, double seconds)
{
	double whole = floor(seconds);

	t->tv_sec += (time_t)whole;
	t->tv_nsec += (long)((seconds - whole) * 1e9);
	if (t->tv_nsec >= 1000000000L) {
		t->tv_sec++;
		t->tv_nsec -= 1000000000L;
	}
}

static int ctl_flush(struct ctl *ctl);

static int cmd_watch(struct ctl *ctl)
{
	struct watch_sample previous = { 0 }, now = { 0 };
	bool have_previous = false;
	bool clear = !ctl->json && isatty(STDOUT_FILENO);
	struct timespec deadline;
	int rc = ctl_connect(ctl);

	if (rc)
		return rc;
	clock_gettime(CLOCK_MONOTONIC, &deadline);
	for (uint64_t refresh = 0; ctl->count == 0 || refresh < ctl->count; refresh++) {
		double rate;

		if (refresh > 0) {
			struct timespec current;

			timespec_add(&deadline, ctl->interval);
			clock_gettime(CLOCK_MONOTONIC, &current);
			/* Behind schedule (a slow daemon, a suspended laptop): start
			 * the schedule again from now rather than refresh in a burst. */
			if (current.tv_sec > deadline.tv_sec + 1)
				deadline = current;
			sleep_until(&deadline);
		}
		rc = watch_take(ctl, &now);
		if (rc < 0 && is_connection_error(rc)) {
			/* The daemon went away: dial again once. A restarted daemon
			 * has new counters, so the rate starts over. */
			watch_sample_free(&now);
			rc = zc_client_reconnect(ctl->client);
			if (rc == 0 || rc == ZC_ERESTARTED) {
				watch_sample_free(&previous);
				have_previous = false;
				rc = watch_take(ctl, &now);
			}
		}
		if (rc < 0) {
			watch_sample_free(&now);
			watch_sample_free(&previous);
			return ctl_fail_call(ctl, rc, "watch");
		}
		rate = watch_rate(have_previous ? &previous : NULL, &now);
		if (clear)
			fputs("\033[H\033[2J", ctl->out);
		else if (refresh > 0 && !ctl->json)
			fputc('\n', ctl->out);
		if (ctl->json)
			watch_print_json(ctl, &now, rate);
		else
			rc = watch_print_table(ctl, &now, rate);
		watch_sample_free(&previous);
		previous = now;
		memset(&now, 0, sizeof(now));
		have_previous = true;
		if (rc < 0) {
			watch_sample_free(&previous);
			return ctl_fail(CTL_EXIT_FAILURE, "watch: %s", zc_strerror(rc));
		}
		/* Each refresh goes out whole, as it is drawn. */
		rc = ctl_flush(ctl);
		if (rc) {
			watch_sample_free(&previous);
			return rc;
		}
	}
	watch_sample_free(&previous);
	return 0;
}

/* ---- arguments ----------------------------------------------------------- */

/* A decimal integer and nothing else: strtoull() would take " 12", "+12",
 * "-1" (as a huge number) and "", none of which a user meant. */
static bool parse_u64(const char *text, uint64_t *value)
{
	char *end;
	unsigned long long parsed;

	if (*text < '0' || *text > '9')
		return false;
	errno = 0;
	parsed = strtoull(text, &end, 10);
	if (errno || *end)
		return false;
	*value = parsed;
	return true;
}

static bool parse_seconds(const char *text, double *value)
{
	char *end;
	double parsed;

	if (!((*text >= '0' && *text <= '9') || *text == '.'))
		return false;
	errno = 0;
	parsed = strtod(text, &end);
	if (errno || *end || !isfinite(parsed))
		return false;
	*value = parsed;
	return true;
}

static const struct {
	const char *name;
	enum ctl_command command;
	bool takes_id;
} command_table[] = {
	{ "ping", CMD_PING, false },
	{ "stats", CMD_STATS, false },
	{ "sessions", CMD_SESSIONS, false },
	{ "session", CMD_SESSION, true },
	{ "close", CMD_CLOSE, true },
	{ "watch", CMD_WATCH, false },
	{ "set-aside", CMD_SET_ASIDE, false },
	{ "export", CMD_EXPORT, true },
	{ "import", CMD_IMPORT, false },
	{ "help", CMD_HELP, false },
};

/*
 * Options may come before or after the command (`zipcachectl sessions
 * --json` reads as naturally as `zipcachectl --json sessions`), in both
 * `--opt value` and `--opt=value` forms; `--` ends them. Returns 0, or
 * an exit status after printing why (1 is never returned here).
 */
static int parse_arguments(struct ctl *ctl, int argc, char **argv)
{
	const char *positional[3];
	size_t n_positional = 0;
	bool options_done = false, interval_set = false, count_set = false;
	size_t command_index = 0;

	for (int i = 1; i < argc; i++) {
		const char *arg = argv[i];
		const char *value = NULL;
		char name[32];
		const char *equals;

		if (options_done || arg[0] != '-' || arg[1] == '\0') {
			if (n_positional == sizeof(positional) / sizeof(positional[0]))
				return ctl_fail(CTL_EXIT_USAGE, "unexpected argument '%s' (see --help)", arg);
			positional[n_positional++] = arg;
			continue;
		}
		if (strcmp(arg, "--") == 0) {
			options_done = true;
			continue;
		}
		if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
			ctl->command = CMD_HELP;
			return 0;
		}
		if (strcmp(arg, "--version") == 0) {
			printf(CTL_NAME " " CTL_VERSION "\n");
			return -1;
		}
		equals = strchr(arg, '=');
		snprintf(name, sizeof(name), "%.*s", equals ? (int)(equals - arg) : (int)strlen(arg), arg);
		if (strcmp(name, "--json") == 0) {
			if (equals)
				return ctl_fail(CTL_EXIT_USAGE, "%s takes no value", name);
			ctl->json = true;
			continue;
		}
		if (strcmp(name, "--socket") != 0 && strcmp(name, "--timeout") != 0 &&
		    strcmp(name, "--interval") != 0 && strcmp(name, "--count") != 0 &&
		    strcmp(name, "--name") != 0 && strcmp(name, "--model-id") != 0)
			return ctl_fail(CTL_EXIT_USAGE, "unknown option '%s' (see --help)", arg);
		if (equals) {
			value = equals + 1;
		} else {
			if (i + 1 >= argc)
				return ctl_fail(CTL_EXIT_USAGE, "%s needs a value", name);
			value = argv[++i];
		}
		if (strcmp(name, "--name") == 0) {
			ctl->name = value;
		} else if (strcmp(name, "--model-id") == 0) {
			ctl->model_id = value;
		} else if (strcmp(name, "--socket") == 0) {
			if (!*value)
				return ctl_fail(CTL_EXIT_USAGE, "--socket needs a path");
			ctl->socket_path = value;
		} else if (strcmp(name, "--timeout") == 0) {
			uint64_t ms;

			if (!parse_u64(value, &ms) || ms > INT_MAX)
				return ctl_fail(CTL_EXIT_USAGE,
						"--timeout must be milliseconds, 0 to %d (0 waits forever): '%s'",
						INT_MAX, value);
			ctl->timeout_ms = (int)ms;
		} else if (strcmp(name, "--interval") == 0) {
			if (!parse_seconds(value, &ctl->interval) || ctl->interval < CTL_MIN_INTERVAL ||
			    ctl->interval > CTL_MAX_INTERVAL)
				return ctl_fail(CTL_EXIT_USAGE,
						"--interval must be seconds between %g and %g: '%s'",
						CTL_MIN_INTERVAL, CTL_MAX_INTERVAL, value);
			interval_set = true;
		} else {
			if (!parse_u64(value, &ctl->count) || ctl->count == 0)
				return ctl_fail(CTL_EXIT_USAGE, "--count must be a positive integer: '%s'",
						value);
			count_set = true;
		}
	}

	if (n_positional == 0)
		return ctl_fail(CTL_EXIT_USAGE, "no command given (see --help)");
	for (command_index = 0; command_index < sizeof(command_table) / sizeof(command_table[0]);
	     command_index++)
		if (strcmp(positional[0], command_table[command_index].name) == 0)
			break;
	if (command_index == sizeof(command_table) / sizeof(command_table[0]))
		return ctl_fail(CTL_EXIT_USAGE, "unknown command '%s' (see --help)", positional[0]);
	ctl->command = command_table[command_index].command;
	if ((ctl->name || ctl->model_id) && ctl->command != CMD_IMPORT)
		return ctl_fail(CTL_EXIT_USAGE, "%s applies only to import",
				ctl->name ? "--name" : "--model-id");
	if (ctl->command == CMD_EXPORT || ctl->command == CMD_IMPORT) {
		size_t want = ctl->command == CMD_EXPORT ? 3 : 2;
		if (n_positional < want)
			return ctl_fail(CTL_EXIT_USAGE, "%s needs %s (see --help)", positional[0],
					ctl->command == CMD_EXPORT ? "a session ID and a FILE" : "a FILE");
		if (n_positional > want)
			return ctl_fail(CTL_EXIT_USAGE, "unexpected argument '%s' (see --help)",
					positional[want]);
		if (ctl->command == CMD_EXPORT && !parse_u64(positional[1], &ctl->session_id))
			return ctl_fail(CTL_EXIT_USAGE, "export: session ID must be a number: '%s'",
					positional[1]);
		ctl->file = positional[want - 1];
	} else if (command_table[command_index].takes_id) {
		if (n_positional < 2)
			return ctl_fail(CTL_EXIT_USAGE, "%s needs a session ID (see `" CTL_NAME " sessions`)",
					positional[0]);
		if (!parse_u64(positional[1], &ctl->session_id))
			return ctl_fail(CTL_EXIT_USAGE, "%s: session ID must be a number: '%s'", positional[0],
					positional[1]);
		if (n_positional > 2)
			return ctl_fail(CTL_EXIT_USAGE, "unexpected argument '%s' (see --help)", positional[2]);
	} else if (n_positional > 1) {
		return ctl_fail(CTL_EXIT_USAGE, "unexpected argument '%s' (see --help)", positional[1]);
	}
	if ((interval_set || count_set) && ctl->command != CMD_WATCH)
		return ctl_fail(CTL_EXIT_USAGE, "%s applies only to watch",
				interval_set ? "--interval" : "--count");
	return 0;
}

/* ---- main ---------------------------------------------------------------- */

/* Writes what the command produced so far to stdout and starts afresh. */
static int ctl_flush(struct ctl *ctl)
{
	if (fflush(ctl->out) != 0)
		return ctl_fail(CTL_EXIT_FAILURE, "out of memory");
	if (ctl->out_length && fwrite(ctl->out_text, 1, ctl->out_length, stdout) != ctl->out_length)
		return ctl_fail(CTL_EXIT_FAILURE, "cannot write output: %s", strerror(errno));
	if (fflush(stdout) != 0)
		return ctl_fail(CTL_EXIT_FAILURE, "cannot write output: %s", strerror(errno));
	rewind(ctl->out);
	/* A rewound memstream keeps its old bytes; the next flush sets the
	 * length from the new position, and nothing is written twice. */
	return 0;
}

int main(int argc, char **argv)
{
	struct ctl ctl = {
		.timeout_ms = CTL_DEFAULT_TIMEOUT_MS,
		.interval = 1.0,
	};
	int rc = parse_arguments(&ctl, argc, argv);

	if (rc < 0)
		return CTL_EXIT_OK;    /* --version */
	if (rc)
		return rc;
	if (ctl.command == CMD_HELP) {
		ctl_usage(stdout);
		return CTL_EXIT_OK;
	}
	if (!ctl.socket_path)
		ctl.socket_path = default_socket_path(&ctl);
	ctl.out = open_memstream(&ctl.out_text, &ctl.out_length);
	if (!ctl.out)
		return ctl_fail(CTL_EXIT_FAILURE, "out of memory");

	switch (ctl.command) {
	case CMD_PING:
		rc = cmd_ping(&ctl);
		break;
	case CMD_STATS:
		rc = cmd_stats(&ctl);
		break;
	case CMD_SESSIONS:
		rc = cmd_sessions(&ctl);
		break;
	case CMD_SESSION:
		rc = cmd_session(&ctl);
		break;
	case CMD_CLOSE:
		rc = cmd_close(&ctl);
		break;
	case CMD_WATCH:
		rc = cmd_watch(&ctl);
		break;
	case CMD_SET_ASIDE:
		rc = cmd_set_aside(&ctl);
		break;
	case CMD_EXPORT:
		rc = cmd_export(&ctl);
		break;
	case CMD_IMPORT:
		rc = cmd_import(&ctl);
		break;
	default:
		rc = ctl_fail(CTL_EXIT_USAGE, "no command given (see --help)");
		break;
	}
	if (rc == 0)
		rc = ctl_flush(&ctl);
	zc_client_close(ctl.client);
	fclose(ctl.out);
	free(ctl.out_text);
	return rc;
}
