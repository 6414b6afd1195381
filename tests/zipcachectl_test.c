/*
 * Tests for zipcachectl, run as a user runs it.
 *
 * Each test starts a real zipcached (ZC_BUILD_DIR/bin/zipcached) on a
 * socket in a fresh temporary directory, makes sessions and data with the
 * C client, runs ZC_BUILD_DIR/bin/zipcachectl as a separate process with
 * stdout and stderr captured, and checks what a user or script sees: exit
 * status, table rows, and JSON whose numbers must equal what the C API
 * reports for the same daemon. JSON is also handed to /usr/bin/python3's
 * json module (when present), so "valid JSON" is judged by a real parser.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "process_run.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "suite_main.h"

#define PYTHON "/usr/bin/python3"
/* Generous for a loaded CI machine, still quick to fail a hung daemon. */
#define DAEMON_START_MS 10000
#define CLIENT_TIMEOUT_MS 5000

/* ---- the daemon --------------------------------------------------------- */

static char work_dir[PATH_MAX];
static char socket_path[PATH_MAX + 16];
static char shm_dir[PATH_MAX + 16];
static pid_t daemon_pid = -1;

static const char *binary(const char *name)
{
	static char path[2][PATH_MAX];
	static int next;
	char *out = path[next++ % 2];

	snprintf(out, PATH_MAX, "%s/bin/%s", build_dir(), name);
	return out;
}

/* Stops the daemon: SIGTERM (its graceful stop), SIGKILL if it lingers.
 * Returns its wait status, or -1 if there was none. */
static int ctl_daemon_stop(void)
{
	int status = -1;

	if (daemon_pid <= 0)
		return -1;
	kill(daemon_pid, SIGTERM);
	for (int i = 0; i < 500; i++) {
		if (waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
			daemon_pid = -1;
			return status;
		}
		sleep_ms(10);
	}
	kill(daemon_pid, SIGKILL);
	waitpid(daemon_pid, &status, 0);
	daemon_pid = -1;
	return status;
}

/* Runs at exit too: a failed assertion ends the test process without the
 * teardown, and neither the daemon nor the directory may outlive it. */
static void cleanup(void)
{
	ctl_daemon_stop();
	directory_remove(work_dir);
	work_dir[0] = '\0';
}

static void ctl_daemon_start(void)
{
	char log_path[PATH_MAX + 16];
	const char *base = getenv("TMPDIR");
	uint64_t waited = 0;

	if (!base || !*base || strlen(base) > 60)
		base = "/tmp";   /* the socket path must fit in sun_path */
	snprintf(work_dir, sizeof(work_dir), "%s/zc_ctl_test.XXXXXX", base);
	ck_assert_msg(mkdtemp(work_dir) != NULL, "mkdtemp: %s", strerror(errno));
	atexit(cleanup);
	snprintf(socket_path, sizeof(socket_path), "%s/z.sock", work_dir);
	snprintf(shm_dir, sizeof(shm_dir), "%s/shm", work_dir);
	snprintf(log_path, sizeof(log_path), "%s/daemon.log", work_dir);
	fflush(stdout);
	fflush(stderr);
	daemon_pid = fork();
	ck_assert_int_ge(daemon_pid, 0);
	if (daemon_pid == 0) {
		int log = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		int in = open("/dev/null", O_RDONLY);

		/* The test process may die on a failed assertion or a timeout:
		 * the daemon goes with it. No metrics endpoint: tests run side
		 * by side, and a fixed port would collide. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (log < 0 || in < 0 || dup2(in, 0) < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0)
			_exit(126);
		execl(binary("zipcached"), "zipcached", "--socket", socket_path, "--shm-dir", shm_dir,
		      "--metrics-listen", "off", "--log-level", "warn", (char *)NULL);
		_exit(127);
	}
	/* Ready when a client gets its hello answered. */
	for (;;) {
		zc_client *client;
		int status;

		if (zc_client_connect(socket_path, 1000, &client) == 0) {
			zc_client_close(client);
			return;
		}
		ck_assert_msg(waitpid(daemon_pid, &status, WNOHANG) == 0,
			      "zipcached exited at start (status %d); see %s", status, log_path);
		ck_assert_msg(waited < DAEMON_START_MS, "zipcached did not answer on %s", socket_path);
		sleep_ms(10);
		waited += 10;
	}
}

static void setup(void)
{
	ctl_daemon_start();
}

static void teardown(void)
{
	cleanup();
}

/* ---- the client side ---------------------------------------------------- */

static zc_client *test_connect(void)
{
	zc_client *client;
	int rc = zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client);

	ck_assert_msg(rc == 0, "connect: %s", zc_strerror(rc));
	return client;
}

static zc_session *make_session(zc_client *client, const char *name, uint32_t layers,
				uint32_t kv_heads, uint32_t head_dim_k, uint32_t head_dim_v,
				uint32_t max_tokens, zc_block_policy policy)
{
	zc_session_config config;
	zc_session *session;
	int rc;

	zc_session_config_default(&config);
	config.name = name;
	config.layers = layers;
	config.batch = 1;
	config.kv_heads = kv_heads;
	config.head_dim_k = head_dim_k;
	config.head_dim_v = head_dim_v;
	config.max_tokens = max_tokens;
	config.policy = policy;
	rc = zc_session_open(client, &config, &session);
	ck_assert_msg(rc == 0, "open %s: %s (%s)", name, zc_strerror(rc), zc_client_last_error(client));
	return session;
}

/* Appends `tokens` tokens of deterministic K/V to one layer: small values
 * with every fifth token larger, so the saliency split has work to do. */
static void append(zc_session *session, uint32_t layer, uint32_t tokens, uint32_t seed)
{
	const zc_session_info *info = zc_session_get_info(session);
	size_t key_count = (size_t)info->batch * info->kv_heads * tokens * info->head_dim_k;
	size_t value_count = (size_t)info->batch * info->kv_heads * tokens * info->head_dim_v;
	uint16_t *keys = malloc(key_count * 2 + 2), *values = malloc(value_count * 2 + 2);
	uint32_t state = seed * 2654435761u + 1;
	zc_view view;
	int rc;

	ck_assert(keys && values);
	for (size_t i = 0; i < key_count; i++) {
		state = state * 1664525u + 1013904223u;
		float x = (float)((int)(state >> 16) % 2001 - 1000) / 250.0f;
		keys[i] = zc_float_to_fp16((i / info->head_dim_k) % 5 == 0 ? x * 8.0f : x);
	}
	for (size_t i = 0; i < value_count; i++) {
		state = state * 1664525u + 1013904223u;
		values[i] = zc_float_to_fp16((float)((int)(state >> 16) % 2001 - 1000) / 500.0f);
	}
	rc = zc_update_and_fetch(session, layer, tokens, keys, values, &view, NULL);
	ck_assert_msg(rc == 0, "update layer %u: %s", layer, zc_strerror(rc));
	free(keys);
	free(values);
}

/* The caller's sessions as the C API lists them. */
static size_t api_list(zc_client *client, zc_session_info *sessions, size_t capacity)
{
	size_t count = 0;
	int rc = zc_client_list_sessions(client, sessions, capacity, &count);

	ck_assert_msg(rc == 0, "list: %s", zc_strerror(rc));
	ck_assert_uint_le(count, capacity);
	return count;
}

/* ---- running zipcachectl ------------------------------------------------ */

typedef struct run_result {
	int status;           /* exit status, or 128 + signal number */
	char *out;
	size_t out_length;
	char *err;
	size_t err_length;
	char out_path[PATH_MAX + 16];
} run_result;

static void run_result_free(run_result *result)
{
	free(result->out);
	free(result->err);
	memset(result, 0, sizeof(*result));
}

/* Environment for the child: ZIPCACHE_SOCKET set to env_socket, or unset
 * when it is NULL, so no test depends on the caller's environment. */
static void run_argv(run_result *result, const char *env_socket, char *const *argv)
{
	char err_path[PATH_MAX + 16];
	struct program_output output;

	snprintf(result->out_path, sizeof(result->out_path), "%s/stdout", work_dir);
	snprintf(err_path, sizeof(err_path), "%s/stderr", work_dir);
	program_capture(&output, (const char *const *)argv, result->out_path, err_path,
			"ZIPCACHE_SOCKET", env_socket);
	result->status = output.status;
	result->out = output.out;
	result->out_length = output.out_length;
	result->err = output.err;
	result->err_length = output.err_length;
}

/* zipcachectl --socket SOCKET args... (NULL-terminated). */
static void run_ctl(run_result *result, ...)
{
	char *argv[32];
	int argc = 0;
	va_list arguments;
	const char *arg;

	argv[argc++] = (char *)binary("zipcachectl");
	argv[argc++] = "--socket";
	argv[argc++] = socket_path;
	va_start(arguments, result);
	while ((arg = va_arg(arguments, const char *)) != NULL) {
		ck_assert_int_lt(argc, 31);
		argv[argc++] = (char *)arg;
	}
	va_end(arguments);
	argv[argc] = NULL;
	run_argv(result, NULL, argv);
}

/* A successful run: status 0, something on stdout, nothing on stderr. */
static void assert_ok(const run_result *result)
{
	ck_assert_msg(result->status == 0, "exit status %d; stderr: %s", result->status, result->err);
	ck_assert_msg(result->err_length == 0, "stderr not empty: %s", result->err);
	ck_assert_msg(result->out_length > 0, "no output");
}

static size_t count_substring(const char *text, const char *needle)
{
	size_t found = 0;

	for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle))
		found++;
	return found;
}

/* The error contract: status, nothing on stdout, one line on stderr that
 * starts with the program's name and says what is wrong. */
static void assert_error(const run_result *result, int status, const char *words)
{
	ck_assert_msg(result->status == status, "exit status %d, expected %d; stderr: %s",
		      result->status, status, result->err);
	ck_assert_msg(result->out_length == 0, "stdout not empty: %s", result->out);
	ck_assert_msg(result->err_length > 0 && count_substring(result->err, "\n") == 1 &&
		      result->err[result->err_length - 1] == '\n',
		      "stderr is not one line: '%s'", result->err);
	ck_assert_msg(strncmp(result->err, "zipcachectl: ", 13) == 0, "no program prefix: %s",
		      result->err);
	ck_assert_msg(strstr(result->err, words) != NULL, "stderr '%s' does not say '%s'", result->err,
		      words);
}

/*
 * Hands stdout to Python's json module: one document (lines = false) or
 * one per line (lines = true). Returns false only when python3 is absent.
 */
static bool assert_valid_json(const run_result *result, bool lines)
{
	static const char script[] =
		"import json, sys\n"
		"text = open(sys.argv[1], encoding='utf-8').read()\n"
		"docs = [l for l in text.split('\\n') if l] if sys.argv[2] == 'lines' else [text]\n"
		"for d in docs:\n"
		"    json.loads(d)\n";
	char *argv[] = { PYTHON, "-c", (char *)script, (char *)result->out_path,
			 lines ? "lines" : "one", NULL };
	run_result check = { 0 };

	if (access(PYTHON, X_OK) != 0)
		return false;
	/* run_argv captures into the same files: keep the output aside. */
	char saved[PATH_MAX + 32];
	snprintf(saved, sizeof(saved), "%s/tool-output", work_dir);
	ck_assert_int_eq(rename(result->out_path, saved), 0);
	argv[3] = saved;
	run_argv(&check, NULL, argv);
	ck_assert_msg(check.status == 0, "not valid JSON (%s): %s\n%s", lines ? "lines" : "document",
		      check.err, result->out);
	run_result_free(&check);
	return true;
}

/* ---- reading the output ------------------------------------------------- */

/* Where the value of "key": at or after from starts; the key must exist. */
static const char *json_value_at(const char *from, const char *key)
{
	char pattern[96];
	const char *at;

	snprintf(pattern, sizeof(pattern), "\"%s\":", key);
	at = strstr(from, pattern);
	ck_assert_msg(at != NULL, "no \"%s\" in %.200s", key, from);
	return at + strlen(pattern);
}

/* The number after "key": at or after from, which must exist. */
static uint64_t json_u64(const char *from, const char *key)
{
	const char *at = json_value_at(from, key);
	char *end;
	uint64_t value = strtoull(at, &end, 10);

	ck_assert_msg(end != at, "\"%s\" is not a number: %.40s", key, at);
	return value;
}

static double json_number(const char *from, const char *key)
{
	const char *at = json_value_at(from, key);
	char *end;
	double value = strtod(at, &end);

	ck_assert_msg(end != at, "\"%s\" is not a number: %.40s", key, at);
	return value;
}

/* The object that starts {"<key>":<value>, in json. */
static const char *json_object(const char *json, const char *key, uint64_t value)
{
	char pattern[96];
	const char *at;

	snprintf(pattern, sizeof(pattern), "{\"%s\":%" PRIu64 ",", key, value);
	at = strstr(json, pattern);
	ck_assert_msg(at != NULL, "no object %s in %s", pattern, json);
	return at;
}

/* The line of text that starts (after blanks) with first_field followed
 * by a blank, in a malloc'd copy; NULL if there is none. */
static char *find_row(const char *text, const char *first_field)
{
	size_t length = strlen(first_field);

	for (const char *line = text; *line;) {
		const char *end = strchr(line, '\n');
		const char *start = line;
		size_t line_length = end ? (size_t)(end - line) : strlen(line);

		while (*start == ' ')
			start++;
		if (strncmp(start, first_field, length) == 0 && start[length] == ' ') {
			char *copy = strndup(line, line_length);

			ck_assert_ptr_nonnull(copy);
			return copy;
		}
		if (!end)
			break;
		line = end + 1;
	}
	return NULL;
}

/* Splits a table row at runs of blanks into at most max fields. */
static size_t split_fields(char *row, char **fields, size_t max)
{
	size_t n = 0;

	for (char *token = strtok(row, " "); token && n < max; token = strtok(NULL, " "))
		fields[n++] = token;
	return n;
}

/* The value of a "key   value" line of a key/value listing. */
static char *kv_value(const char *text, const char *key)
{
	size_t length = strlen(key);

	for (const char *line = text; *line;) {
		const char *end = strchr(line, '\n');

		if (strncmp(line, key, length) == 0 && line[length] == ' ') {
			const char *value = line + length;

			while (*value == ' ')
				value++;
			return strndup(value, end ? (size_t)(end - value) : strlen(value));
		}
		if (!end)
			break;
		line = end + 1;
	}
	ck_abort_msg("no line '%s' in:\n%s", key, text);
	return NULL;
}

static void assert_kv(const char *text, const char *key, const char *expected)
{
	char *value = kv_value(text, key);

	ck_assert_msg(strcmp(value, expected) == 0, "%s: '%s', expected '%s'", key, value, expected);
	free(value);
}

/* ---- ping, stats --------------------------------------------------------- */

START_TEST(test_ping)
{
	zc_client *client = test_connect();
	const zc_server_info *server = zc_client_server_info(client);
	run_result result = { 0 };
	char expected[PATH_MAX + 128];

	run_ctl(&result, "ping", NULL);
	assert_ok(&result);
	snprintf(expected, sizeof(expected), "zipcached %s at %s", server->server_version, socket_path);
	assert_kv(result.out, "server", expected);
	snprintf(expected, sizeof(expected), "%u", server->protocol_version);
	assert_kv(result.out, "protocol", expected);
	snprintf(expected, sizeof(expected), "%" PRIu64, server->boot_epoch);
	assert_kv(result.out, "boot epoch", expected);
	char *rtt = kv_value(result.out, "round trip");
	ck_assert_msg(strncmp(rtt, "min ", 4) == 0 && strstr(rtt, " ms"), "round trip: %s", rtt);
	free(rtt);
	run_result_free(&result);

	run_ctl(&result, "--json", "ping", NULL);
	assert_ok(&result);
	snprintf(expected, sizeof(expected), "\"server_version\":\"%s\"", server->server_version);
	ck_assert_msg(strstr(result.out, expected), "%s", result.out);
	ck_assert_uint_eq(json_u64(result.out, "protocol_version"), server->protocol_version);
	ck_assert_uint_eq(json_u64(result.out, "boot_epoch"), server->boot_epoch);
	ck_assert_uint_eq(json_u64(result.out, "max_sessions"), server->max_sessions);
	ck_assert_uint_eq(json_u64(result.out, "max_frame_bytes"), server->max_frame_bytes);
	double min = json_number(result.out, "min"), max = json_number(result.out, "max");
	ck_assert_msg(min > 0 && min <= max, "rtt min %g max %g", min, max);
	ck_assert_uint_eq(count_substring(result.out, "\n"), 1);
	assert_valid_json(&result, false);
	run_result_free(&result);
	zc_client_close(client);
}
END_TEST

START_TEST(test_stats_match_the_api)
{
	zc_client *client = test_connect();
	zc_session *a = make_session(client, "stats-a", 2, 2, 64, 64, 512, ZC_POLICY_STREAMING);
	zc_session *b = make_session(client, "stats-b", 1, 1, 32, 32, 512, ZC_POLICY_PER_CALL);
	zc_server_stats api;
	run_result result = { 0 };
	char expected[128];

	append(a, 0, 150, 1);
	append(a, 1, 150, 2);
	append(b, 0, 9, 3);
	zc_session_release(a);
	zc_session_release(b);
	ck_assert_int_eq(zc_client_stats(client, &api), 0);
	ck_assert_uint_eq(api.tokens_appended, 309);

	run_ctl(&result, "stats", "--json", NULL);
	assert_ok(&result);
	assert_valid_json(&result, false);
	ck_assert_uint_eq(json_u64(result.out, "sessions"), 2);
	ck_assert_uint_eq(json_u64(result.out, "tokens_appended"), api.tokens_appended);
	ck_assert_uint_eq(json_u64(result.out, "memory_used_bytes"), api.memory_used_bytes);
	ck_assert_uint_eq(json_u64(result.out, "memory_budget_bytes"), api.memory_budget_bytes);
	ck_assert_uint_eq(json_u64(result.out, "boot_epoch"), api.boot_epoch);
	ck_assert_uint_eq(json_u64(result.out, "request_errors"), api.request_errors);
	/* This client and zipcachectl's own connection. */
	ck_assert_uint_eq(json_u64(result.out, "connections"), 2);
	/* zipcachectl's hello and stats came after ours. */
	ck_assert_uint_eq(json_u64(result.out, "requests"), api.requests + 2);
	ck_assert_uint_ge(json_u64(result.out, "uptime_ms"), api.uptime_ms);
	run_result_free(&result);

	run_ctl(&result, "stats", NULL);
	assert_ok(&result);
	assert_kv(result.out, "sessions", "2 of 1024");
	assert_kv(result.out, "connections", "2");
	snprintf(expected, sizeof(expected), "%" PRIu64, api.tokens_appended);
	assert_kv(result.out, "tokens appended", expected);
	snprintf(expected, sizeof(expected), "%" PRIu64, api.requests + 4);
	assert_kv(result.out, "requests", expected);
	/* No --memory-budget: the one derived at start, in bytes. */
	char *budget = kv_value(result.out, "memory budget");
	snprintf(expected, sizeof(expected), "(%" PRIu64 " bytes", api.memory_budget_bytes);
	ck_assert_msg(api.memory_budget_bytes > 0 && strstr(budget, expected), "memory budget: %s", budget);
	free(budget);
	/* Root is trusted: the figures are the daemon's, and no quota applies. */
	assert_kv(result.out, "figures", "the daemon's");
	assert_kv(result.out, "your sessions", "2 (no per-uid limit)");
	char *used = kv_value(result.out, "memory used");
	snprintf(expected, sizeof(expected), "(%" PRIu64 " bytes)", api.memory_used_bytes);
	ck_assert_msg(strstr(used, expected), "memory used: %s", used);
	free(used);
	run_result_free(&result);
	zc_client_close(client);
}
END_TEST

/* ---- sessions ------------------------------------------------------------ */

START_TEST(test_sessions_table_and_json)
{
	zc_client *client = test_connect();
	zc_session *alpha = make_session(client, "alpha", 4, 2, 64, 64, 1024, ZC_POLICY_STREAMING);
	zc_session *beta = make_session(client, "worker-0/request-17", 2, 1, 128, 64, 256,
					ZC_POLICY_PER_CALL);
	zc_session *gamma = make_session(client, "gamma", 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	zc_session_info listed[8];
	run_result result = { 0 };
	char *row, *fields[16];
	size_t count;

	for (uint32_t layer = 0; layer < 4; layer++)
		append(alpha, layer, 40, layer);
	append(beta, 0, 10, 7);
	append(beta, 1, 7, 8);
	zc_session_release(alpha);
	zc_session_release(beta);
	zc_session_release(gamma);
	count = api_list(client, listed, 8);
	ck_assert_uint_eq(count, 3);

	run_ctl(&result, "sessions", NULL);
	assert_ok(&result);
	/* Header, then one row per session, in id order. */
	ck_assert_uint_eq(count_substring(result.out, "\n"), 4);
	ck_assert_msg(strncmp(result.out, "ID  NAME", 8) == 0 || strstr(result.out, " ID  NAME"),
		      "header: %s", result.out);
	const char *columns[] = { "LAYERS", "BATCH", "KV_HEADS", "HEAD_DIM", "TOKENS", "MAX_TOKENS",
				  "POLICY", "IDLE" };
	for (size_t i = 0; i < sizeof(columns) / sizeof(columns[0]); i++)
		ck_assert_msg(strstr(result.out, columns[i]), "no column %s", columns[i]);
	/* Aligned: every row's name starts under the NAME header. */
	size_t name_column = (size_t)(strstr(result.out, "NAME") - result.out);
	const char *names[] = { "alpha", "worker-0/request-17", "gamma" };
	const char *line = strchr(result.out, '\n') + 1;
	for (size_t i = 0; i < 3; i++) {
		ck_assert_msg(strncmp(line + name_column, names[i], strlen(names[i])) == 0,
			      "row %zu is not '%s' at column %zu:\n%s", i, names[i], name_column, result.out);
		line = strchr(line, '\n') + 1;
	}

	for (size_t i = 0; i < count; i++) {
		const zc_session_info *s = &listed[i];
		char id[32], expected[64];

		snprintf(id, sizeof(id), "%" PRIu64, s->id);
		row = find_row(result.out, id);
		ck_assert_msg(row != NULL, "no row for session %s:\n%s", id, result.out);
		/* ... VIEWS, SHARED ("0 B": two fields), LEASED, IDLE. */
		ck_assert_uint_eq(split_fields(row, fields, 16), 14);
		ck_assert_str_eq(fields[9], s->views == ZC_VIEWS_NONE ? "none" : "full");
		ck_assert_str_eq(fields[12], s->leased ? "yes" : "no");
		ck_assert_str_eq(fields[1], s->name);
		snprintf(expected, sizeof(expected), "%u", s->layers);
		ck_assert_str_eq(fields[2], expected);
		snprintf(expected, sizeof(expected), "%u", s->kv_heads);
		ck_assert_str_eq(fields[4], expected);
		if (s->head_dim_k == s->head_dim_v)
			snprintf(expected, sizeof(expected), "%u", s->head_dim_k);
		else
			snprintf(expected, sizeof(expected), "%u/%u", s->head_dim_k, s->head_dim_v);
		ck_assert_str_eq(fields[5], expected);
		if (s->min_tokens == s->max_layer_tokens)
			snprintf(expected, sizeof(expected), "%u", s->max_layer_tokens);
		else
			snprintf(expected, sizeof(expected), "%u..%u", s->min_tokens, s->max_layer_tokens);
		ck_assert_str_eq(fields[6], expected);
		snprintf(expected, sizeof(expected), "%u", s->max_tokens);
		ck_assert_str_eq(fields[7], expected);
		ck_assert_str_eq(fields[8], s->policy == ZC_POLICY_PER_CALL ? "per_call" : "streaming");
		free(row);
	}
	row = find_row(result.out, "2");
	ck_assert_ptr_nonnull(row);
	ck_assert_ptr_nonnull(strstr(row, "7..10"));
	ck_assert_ptr_nonnull(strstr(row, "128/64"));
	free(row);
	run_result_free(&result);

	run_ctl(&result, "sessions", "--json", NULL);
	assert_ok(&result);
	assert_valid_json(&result, false);
	ck_assert_uint_eq(count_substring(result.out, "{\"id\":"), 3);
	for (size_t i = 0; i < count; i++) {
		const zc_session_info *s = &listed[i];
		const char *object = json_object(result.out, "id", s->id);
		char name[128];

		snprintf(name, sizeof(name), "\"name\":\"%s\"", s->name);
		ck_assert_msg(strstr(object, name) != NULL, "%s", object);
		ck_assert_uint_eq(json_u64(object, "layers"), s->layers);
		ck_assert_uint_eq(json_u64(object, "batch"), s->batch);
		ck_assert_uint_eq(json_u64(object, "kv_heads"), s->kv_heads);
		ck_assert_uint_eq(json_u64(object, "head_dim_k"), s->head_dim_k);
		ck_assert_uint_eq(json_u64(object, "head_dim_v"), s->head_dim_v);
		ck_assert_uint_eq(json_u64(object, "min_tokens"), s->min_tokens);
		ck_assert_uint_eq(json_u64(object, "max_layer_tokens"), s->max_layer_tokens);
		ck_assert_uint_eq(json_u64(object, "max_tokens"), s->max_tokens);
		ck_assert_uint_eq(json_u64(object, "residual_tokens"), s->residual_tokens);
		ck_assert_uint_eq(json_u64(object, "hi_bits"), (uint64_t)s->codec.hi_bits);
		ck_assert_uint_eq(json_u64(object, "group_size"), (uint64_t)s->codec.group_size);
		ck_assert_double_eq(json_number(object, "hi_fraction"), s->codec.hi_fraction);
	}
	/* In id order (the list's own order is the daemon's table order). */
	for (size_t i = 0; i < count; i++)
		for (size_t j = 0; j < count; j++)
			if (listed[i].id < listed[j].id)
				ck_assert_msg(json_object(result.out, "id", listed[i].id) <
					      json_object(result.out, "id", listed[j].id),
					      "sessions not in id order: %s", result.out);
	run_result_free(&result);
	zc_client_close(client);
}
END_TEST

START_TEST(test_sessions_empty)
{
	run_result result = { 0 };

	run_ctl(&result, "sessions", NULL);
	assert_ok(&result);
	ck_assert_str_eq(result.out, "no sessions\n");
	run_result_free(&result);
	run_ctl(&result, "sessions", "--json", NULL);
	assert_ok(&result);
	ck_assert_str_eq(result.out, "{\"sessions\":[]}\n");
	run_result_free(&result);
}
END_TEST

/* ---- session ID ---------------------------------------------------------- */

START_TEST(test_session_accounting)
{
	zc_client *client = test_connect();
	zc_session *session = make_session(client, "detail", 3, 2, 64, 32, 1024, ZC_POLICY_STREAMING);
	uint64_t id = zc_session_get_info(session)->id;
	zc_layer_stats layers[3], total, after_total;
	zc_session_info listed[4];
	run_result result = { 0 };
	char argument[32];

	append(session, 0, 200, 1);    /* one compressed block */
	append(session, 1, 130, 2);
	append(session, 1, 5, 3);      /* plus a residual */
	append(session, 2, 17, 4);     /* residual only */
	ck_assert_int_eq(zc_session_stats(session, layers, 3, &total), 0);
	snprintf(argument, sizeof(argument), "%" PRIu64, id);

	run_ctl(&result, "session", argument, NULL);
	assert_ok(&result);
	assert_kv(result.out, "name", "detail");
	assert_kv(result.out, "id", argument);
	assert_kv(result.out, "tokens", "17..200 of 1024");
	for (uint32_t i = 0; i <= 3; i++) {
		const zc_layer_stats *s = i < 3 ? &layers[i] : &total;
		char label[16], *fields[16], expected[32];
		char *row;

		snprintf(label, sizeof(label), "%u", i);
		row = find_row(strstr(result.out, "LAYER"), i < 3 ? label : "total");
		ck_assert_msg(row != NULL, "no row %s:\n%s", label, result.out);
		ck_assert_uint_eq(split_fields(row, fields, 16), 12);
		uint64_t numbers[] = { s->tokens, s->residual_tokens, s->blocks,
				       s->compressed_key_bytes, s->compressed_value_bytes,
				       s->baseline_key_bytes, s->baseline_value_bytes,
				       s->fp16_key_bytes, s->fp16_value_bytes };
		for (size_t f = 0; f < 9; f++) {
			snprintf(expected, sizeof(expected), "%" PRIu64, numbers[f]);
			ck_assert_msg(strcmp(fields[1 + f], expected) == 0, "row %s field %zu: %s != %s",
				      label, f + 1, fields[1 + f], expected);
		}
		snprintf(expected, sizeof(expected), "%.2f", s->compression_ratio);
		ck_assert_str_eq(fields[10], expected);
		snprintf(expected, sizeof(expected), "%.2f", s->effective_avg_bits);
		ck_assert_str_eq(fields[11], expected);
		free(row);
	}
	run_result_free(&result);

	run_ctl(&result, "--json", "session", argument, NULL);
	assert_ok(&result);
	assert_valid_json(&result, false);
	ck_assert_uint_eq(count_substring(result.out, "{\"layer\":"), 3);
	for (uint32_t i = 0; i <= 3; i++) {
		const zc_layer_stats *s = i < 3 ? &layers[i] : &total;
		const char *object = i < 3 ? json_object(result.out, "layer", i) :
					     strstr(result.out, "\"total\":{");

		ck_assert_ptr_nonnull(object);
		ck_assert_uint_eq(json_u64(object, "tokens"), s->tokens);
		ck_assert_uint_eq(json_u64(object, "residual_tokens"), s->residual_tokens);
		ck_assert_uint_eq(json_u64(object, "blocks"), s->blocks);
		ck_assert_uint_eq(json_u64(object, "compressed_key_bytes"), s->compressed_key_bytes);
		ck_assert_uint_eq(json_u64(object, "compressed_value_bytes"), s->compressed_value_bytes);
		ck_assert_uint_eq(json_u64(object, "baseline_key_bytes"), s->baseline_key_bytes);
		ck_assert_uint_eq(json_u64(object, "baseline_value_bytes"), s->baseline_value_bytes);
		ck_assert_uint_eq(json_u64(object, "fp16_key_bytes"), s->fp16_key_bytes);
		ck_assert_uint_eq(json_u64(object, "fp16_value_bytes"), s->fp16_value_bytes);
		/* Printed to round-trip: the very same double. */
		ck_assert_double_eq(json_number(object, "compression_ratio"), s->compression_ratio);
		ck_assert_double_eq(json_number(object, "effective_avg_bits"), s->effective_avg_bits);
	}
	ck_assert_uint_eq(json_u64(strstr(result.out, "\"session\":"), "id"), id);
	run_result_free(&result);

	/* Looking left the session alone: it is still there, unchanged, our
	 * handle still works, and nothing new appeared. */
	ck_assert_uint_eq(api_list(client, listed, 4), 1);
	ck_assert_uint_eq(listed[0].id, id);
	append(session, 2, 1, 5);
	ck_assert_int_eq(zc_session_stats(session, NULL, 0, &after_total), 0);
	ck_assert_uint_eq(after_total.tokens, total.tokens + 1);
	zc_session_release(session);
	zc_client_close(client);
}
END_TEST

/* ---- close ID ------------------------------------------------------------ */

START_TEST(test_close)
{
	zc_client *client = test_connect();
	zc_session *doomed = make_session(client, "doomed", 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	zc_session *also = make_session(client, "also-doomed", 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	zc_session *kept = make_session(client, "kept", 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	uint64_t doomed_id = zc_session_get_info(doomed)->id;
	uint64_t also_id = zc_session_get_info(also)->id;
	uint64_t kept_id = zc_session_get_info(kept)->id;
	zc_session_info listed[4];
	zc_layer_stats total;
	run_result result = { 0 };
	char argument[32], expected[128];

	append(doomed, 0, 3, 1);
	snprintf(argument, sizeof(argument), "%" PRIu64, doomed_id);
	run_ctl(&result, "close", argument, NULL);
	assert_ok(&result);
	snprintf(expected, sizeof(expected), "closed session %" PRIu64 " (doomed)\n", doomed_id);
	ck_assert_str_eq(result.out, expected);
	run_result_free(&result);
	/* Gone for the daemon: our handle now meets NOT_FOUND. */
	ck_assert_int_eq(zc_session_stats(doomed, NULL, 0, &total), ZC_ENOTFOUND);
	zc_session_release(doomed);

	snprintf(argument, sizeof(argument), "%" PRIu64, also_id);
	run_ctl(&result, "--json", "close", argument, NULL);
	assert_ok(&result);
	assert_valid_json(&result, false);
	snprintf(expected, sizeof(expected), "{\"closed\":{\"id\":%" PRIu64 ",\"name\":\"also-doomed\"}}\n",
		 also_id);
	ck_assert_str_eq(result.out, expected);
	run_result_free(&result);
	zc_session_release(also);

	ck_assert_uint_eq(api_list(client, listed, 4), 1);
	ck_assert_uint_eq(listed[0].id, kept_id);

	/* Closing it twice: the second time there is nothing to close. */
	run_ctl(&result, "close", argument, NULL);
	snprintf(expected, sizeof(expected), "no session %" PRIu64, also_id);
	assert_error(&result, 1, expected);
	run_result_free(&result);
	ck_assert_uint_eq(api_list(client, listed, 4), 1);
	zc_session_release(kept);
	zc_client_close(client);
}
END_TEST

/* export ID FILE and import FILE: the tool opens the file; the import
 * equals the original; a damaged file is refused by name and makes nothing. */
START_TEST(test_export_import)
{
	zc_client *client = test_connect();
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = "exported";
	config.layers = 2;
	config.kv_heads = 2;
	config.head_dim_k = config.head_dim_v = 32;
	config.max_tokens = 256;
	config.residual_tokens = 16;
	config.model_id = "tiny-model";
	zc_session *session;
	ck_assert_int_eq(zc_session_open(client, &config, &session), 0);
	append(session, 0, 40, 1);
	append(session, 1, 7, 2);
	uint64_t id = zc_session_get_info(session)->id;
	run_result result = { 0 };
	char argument[32], file[PATH_MAX + 16], expected[PATH_MAX + 128];
	snprintf(argument, sizeof(argument), "%" PRIu64, id);
	snprintf(file, sizeof(file), "%s/s.zcsnap", work_dir);

	run_ctl(&result, "export", argument, file, NULL);
	assert_ok(&result);
	struct stat st;
	ck_assert_int_eq(stat(file, &st), 0);
	snprintf(expected, sizeof(expected), "exported session %" PRIu64 " to %s: %llu bytes\n", id,
		 file, (unsigned long long)st.st_size);
	ck_assert_str_eq(result.out, expected);
	run_result_free(&result);

	run_ctl(&result, "import", file, "--name", "copy", "--model-id", "tiny-model", NULL);
	assert_ok(&result);
	ck_assert_msg(strstr(result.out, "(copy) from ") != NULL, "%s", result.out);
	run_result_free(&result);
	zc_session_info listed[4];
	ck_assert_uint_eq(api_list(client, listed, 4), 2);
	const zc_session_info *copy = strcmp(listed[0].name, "copy") == 0 ? &listed[0] : &listed[1];
	ck_assert_str_eq(copy->name, "copy");
	ck_assert_str_eq(copy->model_id, "tiny-model");
	ck_assert_uint_eq(copy->max_layer_tokens, 40);
	ck_assert_uint_eq(copy->min_tokens, 7);

	/* Another model, and a flipped byte: refused, nothing made. */
	run_ctl(&result, "import", file, "--model-id", "other", NULL);
	assert_error(&result, 1, "not 'other'");
	run_result_free(&result);
	int fd = open(file, O_RDWR);
	uint8_t byte;
	ck_assert_int_eq(pread(fd, &byte, 1, st.st_size / 2), 1);
	byte ^= 0x10;
	ck_assert_int_eq(pwrite(fd, &byte, 1, st.st_size / 2), 1);
	close(fd);
	run_ctl(&result, "import", file, NULL);
	assert_error(&result, 1, "checksum mismatch");
	run_result_free(&result);
	ck_assert_uint_eq(api_list(client, listed, 4), 2);
	zc_session_release(session);
	zc_client_close(client);
}
END_TEST

/* ---- errors -------------------------------------------------------------- */

struct error_case {
	const char *args[6];
	int status;
	const char *words;
};

static const struct error_case error_cases[] = {
	{ { "session", "4242" }, 1, "no session 4242" },
	{ { "close", "4242" }, 1, "no session 4242" },
	{ { "--json", "session", "4242" }, 1, "no session 4242" },
	{ { "frobnicate" }, 2, "unknown command 'frobnicate'" },
	{ { NULL }, 2, "no command" },
	{ { "session" }, 2, "needs a session ID" },
	{ { "close", "abc" }, 2, "session ID must be a number: 'abc'" },
	{ { "session", "1", "2" }, 2, "unexpected argument '2'" },
	{ { "ping", "extra" }, 2, "unexpected argument 'extra'" },
	{ { "--bogus", "stats" }, 2, "unknown option '--bogus'" },
	{ { "stats", "--count", "2" }, 2, "--count applies only to watch" },
	{ { "watch", "--no-attach" }, 2, "unknown option '--no-attach'" },
	{ { "session", "0" }, 1, "no session 0" },
	{ { "close", "0" }, 1, "no session 0" },
	{ { "watch", "--interval", "0" }, 2, "--interval must be seconds" },
	{ { "watch", "--interval", "fast" }, 2, "--interval must be seconds" },
	{ { "watch", "--count", "0" }, 2, "--count must be a positive integer" },
	{ { "stats", "--timeout" }, 2, "--timeout needs a value" },
	{ { "--json=yes", "stats" }, 2, "--json takes no value" },
	{ { "export", "1" }, 2, "export needs a session ID and a FILE" },
	{ { "export", "x", "f" }, 2, "session ID must be a number: 'x'" },
	{ { "import" }, 2, "import needs a FILE" },
	{ { "stats", "--name", "n" }, 2, "--name applies only to import" },
	{ { "export", "4242", "/dev/null" }, 1, "no session 4242" },
	{ { "import", "/nonexistent/snapshot" }, 1, "cannot open /nonexistent/snapshot" },
};

START_TEST(test_error_exit)
{
	const struct error_case *c = &error_cases[_i];
	run_result result = { 0 };
	char *argv[16];
	int argc = 0;

	argv[argc++] = (char *)binary("zipcachectl");
	argv[argc++] = "--socket";
	argv[argc++] = socket_path;
	for (size_t i = 0; i < 6 && c->args[i]; i++)
		argv[argc++] = (char *)c->args[i];
	argv[argc] = NULL;
	run_argv(&result, NULL, argv);
	assert_error(&result, c->status, c->words);
	run_result_free(&result);
}
END_TEST

START_TEST(test_cannot_connect)
{
	char *argv[] = { (char *)binary("zipcachectl"), "--socket", "/nonexistent-dir/x.sock", "stats",
			 NULL };
	char *json_argv[] = { (char *)binary("zipcachectl"), "--json", "sessions", NULL };
	run_result result = { 0 };

	run_argv(&result, NULL, argv);
	assert_error(&result, 1,
		     "cannot connect to /nonexistent-dir/x.sock: No such file or directory");
	run_result_free(&result);

	/* $ZIPCACHE_SOCKET is the default, and is named when it fails too. */
	run_argv(&result, "/nonexistent-dir/env.sock", json_argv);
	assert_error(&result, 1, "cannot connect to /nonexistent-dir/env.sock");
	run_result_free(&result);

	/* A socket nobody listens on. */
	char stale[PATH_MAX + 16];
	snprintf(stale, sizeof(stale), "%s/stale.sock", work_dir);
	close(open(stale, O_WRONLY | O_CREAT, 0600));
	argv[2] = stale;
	run_argv(&result, NULL, argv);
	assert_error(&result, 1, "cannot connect to");
	run_result_free(&result);
}
END_TEST

/* The uid and gid the permission tests run zipcachectl as (nobody). */
#define NOBODY 65534

/*
 * Runs ctl (a copy of zipcachectl) as uid/gid NOBODY with no
 * supplementary groups: `ctl --socket socket stats`. Output files are
 * opened before the privileges go, so they may stay root's.
 */
static void run_as_nobody(run_result *result, const char *ctl, const char *socket)
{
	char err_path[PATH_MAX + 16];
	pid_t child;
	int status;

	snprintf(result->out_path, sizeof(result->out_path), "%s/stdout", work_dir);
	snprintf(err_path, sizeof(err_path), "%s/stderr", work_dir);
	fflush(stdout);
	fflush(stderr);
	child = fork_dying_with_parent(126);
	if (child == 0) {
		int in = open("/dev/null", O_RDONLY);
		int out = open(result->out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		int err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

		if (in < 0 || out < 0 || err < 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0 ||
		    dup2(err, 2) < 0)
			_exit(126);
		if (chdir("/") != 0 || setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 ||
		    setuid(NOBODY) != 0)
			_exit(125);
		unsetenv("ZIPCACHE_SOCKET");
		execl(ctl, "zipcachectl", "--socket", socket, "stats", (char *)NULL);
		_exit(127);
	}
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	ck_assert_msg(WIFEXITED(status), "zipcachectl died of signal %d", WTERMSIG(status));
	ck_assert_msg(WEXITSTATUS(status) < 125, "could not run %s as uid %d (status %d)", ctl,
		      NOBODY, WEXITSTATUS(status));
	result->status = WEXITSTATUS(status);
	result->out = file_read_whole(result->out_path, &result->out_length);
	result->err = file_read_whole(err_path, &result->err_length);
}

/* assert_error(), and the denial is not reported as a missing file. */
static void assert_denied(const run_result *result, const char *words)
{
	assert_error(result, 1, "permission denied: uid 65534");
	assert_error(result, 1, words);
	ck_assert_msg(strstr(result->err, "No such file") == NULL, "%s", result->err);
}

/*
 * A user who may not reach the socket is told "permission denied", what
 * is closed to it (the socket, or which directory on the way), and which
 * group would let it in; not "No such file or directory". Needs root to
 * become nobody; zipcachectl runs from a copy nobody may execute, as the
 * build tree may be closed to it (/root/...). The daemon's socket
 * (0660, root's group) is reached through hard links in directories of
 * several modes: a socket is its inode, whatever name it is dialled by.
 */
START_TEST(test_permission_denied)
{
	char ctl[PATH_MAX + 32], closed[PATH_MAX + 16], linked[PATH_MAX + 32];
	run_result result = { 0 };
	size_t size;
	char *binary_text;
	FILE *copy;

	if (geteuid() != 0) {
		printf("test_permission_denied: skipped, needs root to run as uid %d\n", NOBODY);
		return;
	}
	/* Others may pass through the work directory, not list it. */
	ck_assert_int_eq(chmod(work_dir, 0711), 0);
	snprintf(ctl, sizeof(ctl), "%s/bin", work_dir);
	ck_assert_int_eq(mkdir(ctl, 0755), 0);
	strncat(ctl, "/zipcachectl", sizeof(ctl) - strlen(ctl) - 1);
	binary_text = file_read_whole(binary("zipcachectl"), &size);
	copy = fopen(ctl, "w");
	ck_assert(copy != NULL);
	ck_assert_uint_eq(fwrite(binary_text, 1, size, copy), size);
	ck_assert_int_eq(fclose(copy), 0);
	free(binary_text);
	ck_assert_int_eq(chmod(ctl, 0755), 0);

	/* The socket itself: 0660, group root. */
	run_as_nobody(&result, ctl, socket_path);
	assert_denied(&result, "may not write to the socket");
	assert_error(&result, 1, "(owner root, group root, mode 0660); join group root");
	run_result_free(&result);

	/* A directory on the way that the group may enter. */
	ck_assert_int_eq(chmod(socket_path, 0666), 0);
	snprintf(closed, sizeof(closed), "%s/closed", work_dir);
	snprintf(linked, sizeof(linked), "%s/z.sock", closed);
	ck_assert_int_eq(mkdir(closed, 0750), 0);
	ck_assert_int_eq(link(socket_path, linked), 0);
	run_as_nobody(&result, ctl, linked);
	assert_denied(&result, "may not enter ");
	assert_error(&result, 1, "/closed (owner root, group root, mode 0750); join group root");
	run_result_free(&result);

	/* One that only its owner may enter: no group to join. */
	ck_assert_int_eq(chmod(closed, 0700), 0);
	run_as_nobody(&result, ctl, linked);
	assert_denied(&result, "mode 0700); only its owner root may");
	run_result_free(&result);

	/* Open to everyone, the same user connects: it was the modes. */
	ck_assert_int_eq(chmod(closed, 0755), 0);
	run_as_nobody(&result, ctl, linked);
	assert_ok(&result);
	run_result_free(&result);
}
END_TEST

START_TEST(test_socket_from_environment)
{
	char *argv[] = { (char *)binary("zipcachectl"), "stats", "--json", NULL };
	run_result result = { 0 };

	run_argv(&result, socket_path, argv);
	assert_ok(&result);
	ck_assert_uint_eq(json_u64(result.out, "sessions"), 0);
	run_result_free(&result);
}
END_TEST

START_TEST(test_help_and_version)
{
	char *help_argv[] = { (char *)binary("zipcachectl"), "--help", NULL };
	char *help_command[] = { (char *)binary("zipcachectl"), "help", NULL };
	char *version_argv[] = { (char *)binary("zipcachectl"), "--version", NULL };
	const char *commands[] = { "ping", "stats", "sessions", "session ID", "close ID", "watch",
				   "--interval", "--count", "--socket", "--json",
				   "--timeout", "ZIPCACHE_SOCKET" };
	run_result result = { 0 };

	run_argv(&result, NULL, help_argv);
	assert_ok(&result);
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		ck_assert_msg(strstr(result.out, commands[i]), "--help does not mention %s", commands[i]);
	ck_assert_ptr_null(strstr(result.out, "attach"));
	char *first = strdup(result.out);
	run_result_free(&result);
	run_argv(&result, NULL, help_command);
	assert_ok(&result);
	ck_assert_str_eq(result.out, first);
	free(first);
	run_result_free(&result);
	run_argv(&result, NULL, version_argv);
	assert_ok(&result);
	ck_assert_msg(strncmp(result.out, "zipcachectl ", 12) == 0, "%s", result.out);
	run_result_free(&result);
}
END_TEST

/* ---- names that are not plain text --------------------------------------- */

START_TEST(test_hostile_names)
{
	/* A quote, a backslash, JSON punctuation and UTF-8. (Control bytes and
	 * bytes that are not UTF-8 the daemon refuses in names, checked last.) */
	static const char name[] = "q\"b\\n{}[],:\xc3\xa9";
	static const char escaped[] = "\"name\":\"q\\\"b\\\\n{}[],:\xc3\xa9\"";
	zc_client *client = test_connect();
	zc_session *session = make_session(client, name, 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	run_result result = { 0 };
	char argument[32];

	snprintf(argument, sizeof(argument), "%" PRIu64, zc_session_get_info(session)->id);
	zc_session_release(session);

	run_ctl(&result, "--json", "sessions", NULL);
	assert_ok(&result);
	ck_assert_msg(strstr(result.out, escaped) != NULL, "name not escaped as expected: %s", result.out);
	assert_valid_json(&result, false);
	run_result_free(&result);

	run_ctl(&result, "sessions", NULL);
	assert_ok(&result);
	/* One header and one row: the newline in the name did not break it,
	 * and no control byte reached the terminal. */
	ck_assert_uint_eq(count_substring(result.out, "\n"), 2);
	ck_assert_ptr_null(strchr(result.out, '\033'));
	run_result_free(&result);

	run_ctl(&result, "session", argument, NULL);
	assert_ok(&result);
	ck_assert_ptr_null(strchr(result.out, '\033'));
	run_result_free(&result);

	run_ctl(&result, "close", argument, NULL);
	assert_ok(&result);
	ck_assert_uint_eq(count_substring(result.out, "\n"), 1);
	ck_assert_ptr_null(strchr(result.out, '\033'));
	run_result_free(&result);

	static const char *const refused[] = { "new\nline", "esc\033[2J", "not utf-8 \xff" };
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		zc_session_config config;
		zc_session *rejected = NULL;
		zc_session_config_default(&config);
		config.name = refused[i];
		config.layers = 1;
		config.kv_heads = 1;
		config.head_dim_k = config.head_dim_v = 32;
		config.max_tokens = 64;
		ck_assert_int_eq(zc_session_open(client, &config, &rejected), ZC_EINVALID);
	}
	zc_client_close(client);
}
END_TEST

/* ---- watch --------------------------------------------------------------- */

START_TEST(test_watch_count)
{
	zc_client *client = test_connect();
	zc_session *session = make_session(client, "watched", 2, 2, 64, 64, 1024, ZC_POLICY_STREAMING);
	uint64_t id = zc_session_get_info(session)->id;
	zc_layer_stats total;
	run_result result = { 0 };

	append(session, 0, 160, 1);
	append(session, 1, 160, 2);
	ck_assert_int_eq(zc_session_stats(session, NULL, 0, &total), 0);
	zc_session_release(session);

	run_ctl(&result, "watch", "--count", "2", "--interval", "0.1", NULL);
	assert_ok(&result);
	/* Two refreshes, each with its header lines and table; no ANSI
	 * clearing, as stdout is not a terminal. */
	ck_assert_uint_eq(count_substring(result.out, "zipcached "), 2);
	ck_assert_uint_eq(count_substring(result.out, "MAX_TOKENS"), 2);
	ck_assert_uint_eq(count_substring(result.out, " watched "), 2);
	ck_assert_ptr_null(strchr(result.out, '\033'));
	/* The first refresh has no rate yet; the second saw no requests but
	 * its own, which it does not count. */
	ck_assert_uint_eq(count_substring(result.out, "(-/s)"), 1);
	ck_assert_uint_eq(count_substring(result.out, "(0.0/s)"), 1);
	ck_assert_msg(strstr(result.out, "(-/s)") < strstr(result.out, "(0.0/s)"), "%s", result.out);
	run_result_free(&result);

	run_ctl(&result, "watch", "--json", "--count", "2", "--interval", "0.1", NULL);
	assert_ok(&result);
	ck_assert_uint_eq(count_substring(result.out, "\n"), 2);
	assert_valid_json(&result, true);
	const char *second = strchr(result.out, '\n') + 1;
	ck_assert_ptr_nonnull(strstr(result.out, "\"request_rate\":null"));
	ck_assert_ptr_nonnull(strstr(second, "\"request_rate\":0"));
	for (const char *refresh = result.out; refresh; refresh = refresh == result.out ? second : NULL) {
		const char *object = json_object(refresh, "id", id);

		ck_assert_uint_eq(json_u64(object, "stored_bytes"),
				  total.compressed_key_bytes + total.compressed_value_bytes);
		ck_assert_uint_eq(json_u64(object, "fp16_bytes"),
				  total.fp16_key_bytes + total.fp16_value_bytes);
		ck_assert_uint_eq(json_u64(object, "max_layer_tokens"), 160);
		ck_assert_uint_eq(json_u64(refresh, "sessions"), 1);
	}
	run_result_free(&result);
	zc_client_close(client);
}
END_TEST

/*
 * Looking at a session is not using it: `session ID` and `watch` read the
 * accounting by id (zc_client_session_stats), so the daemon's idle clock
 * keeps running through them; `close ID` closes it by id.
 */
START_TEST(test_looking_leaves_sessions_idle)
{
	zc_client *client = test_connect();
	zc_session *session = make_session(client, "resting", 1, 1, 32, 32, 64, ZC_POLICY_STREAMING);
	uint64_t id = zc_session_get_info(session)->id;
	zc_session_info listed[2];
	run_result result = { 0 };
	char argument[32], expected[128];
	uint64_t before, after;

	snprintf(argument, sizeof(argument), "%" PRIu64, id);
	append(session, 0, 4, 1);
	zc_session_release(session);
	sleep_ms(300);
	ck_assert_uint_eq(api_list(client, listed, 2), 1);
	before = listed[0].idle_ms;
	ck_assert_uint_ge(before, 300);

	run_ctl(&result, "session", argument, NULL);
	assert_ok(&result);
	assert_kv(result.out, "name", "resting");
	run_result_free(&result);
	run_ctl(&result, "--json", "session", argument, NULL);
	assert_ok(&result);
	/* The idle time it shows is the daemon's, not reset by asking. */
	ck_assert_uint_ge(json_u64(strstr(result.out, "\"session\":"), "idle_ms"), before);
	run_result_free(&result);
	sleep_ms(300);
	ck_assert_uint_eq(api_list(client, listed, 2), 1);
	after = listed[0].idle_ms;
	ck_assert_msg(after >= before + 300, "idle %" PRIu64 " ms, then %" PRIu64
		      " ms 300 ms after `session %s`: it was reset", before, after, argument);

	before = after;
	run_ctl(&result, "watch", "--json", "--count", "2", "--interval", "0.1", NULL);
	assert_ok(&result);
	assert_valid_json(&result, true);
	const char *object = json_object(strchr(result.out, '\n') + 1, "id", id);
	ck_assert_ptr_nonnull(object);
	ck_assert_uint_ge(json_u64(object, "idle_ms"), before + 100);
	ck_assert_uint_eq(json_u64(object, "max_layer_tokens"), 4);
	ck_assert_ptr_nonnull(strstr(result.out, "stored_bytes"));
	run_result_free(&result);
	run_ctl(&result, "watch", "--count", "2", "--interval", "0.1", NULL);
	assert_ok(&result);
	ck_assert_uint_eq(count_substring(result.out, "RATIO"), 2);
	ck_assert_uint_eq(count_substring(result.out, "IDLE"), 2);
	run_result_free(&result);
	sleep_ms(300);
	ck_assert_uint_eq(api_list(client, listed, 2), 1);
	after = listed[0].idle_ms;
	ck_assert_msg(after >= before + 500, "idle %" PRIu64 " ms, then %" PRIu64
		      " ms after two watches and 300 ms: it was reset", before, after);

	run_ctl(&result, "close", argument, NULL);
	assert_ok(&result);
	snprintf(expected, sizeof(expected), "closed session %" PRIu64 " (resting)\n", id);
	ck_assert_str_eq(result.out, expected);
	run_result_free(&result);
	ck_assert_uint_eq(api_list(client, listed, 2), 0);
	run_ctl(&result, "session", argument, NULL);
	snprintf(expected, sizeof(expected), "no session %" PRIu64, id);
	assert_error(&result, 1, expected);
	run_result_free(&result);
	zc_client_close(client);
}
END_TEST

/* Another client keeps the daemon busy while watch samples: the rate it
 * reports must be above zero (watch's own requests are left out, so this
 * is the other client's). */
START_TEST(test_watch_rate_counts_other_clients)
{
	run_result result = { 0 };
	pid_t busy;
	int status;

	fflush(stdout);
	fflush(stderr);
	busy = fork();
	ck_assert_int_ge(busy, 0);
	if (busy == 0) {
		zc_client *client;
		zc_server_stats stats;

		if (zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client) < 0)
			_exit(1);
		for (int i = 0; i < 300; i++) {
			if (zc_client_stats(client, &stats) < 0)
				_exit(1);
			sleep_ms(5);
		}
		zc_client_close(client);
		_exit(0);
	}
	run_ctl(&result, "watch", "--json", "--count", "2", "--interval", "0.5", NULL);
	ck_assert_int_eq(waitpid(busy, &status, 0), busy);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "busy client failed");
	assert_ok(&result);
	const char *second = strchr(result.out, '\n') + 1;
	double rate = json_number(second, "request_rate");
	ck_assert_msg(rate > 10.0, "request rate %g while another client sent ~200/s", rate);
	run_result_free(&result);
}
END_TEST

/* ---- suite --------------------------------------------------------------- */

static Suite *zipcachectl_suite(void)
{
	Suite *suite = suite_create("zipcachectl");
	TCase *commands = tcase_create("commands");
	TCase *errors = tcase_create("errors");
	TCase *watch = tcase_create("watch");

	tcase_add_checked_fixture(commands, setup, teardown);
	tcase_set_timeout(commands, 60);
	tcase_add_test(commands, test_ping);
	tcase_add_test(commands, test_stats_match_the_api);
	tcase_add_test(commands, test_sessions_table_and_json);
	tcase_add_test(commands, test_sessions_empty);
	tcase_add_test(commands, test_session_accounting);
	tcase_add_test(commands, test_close);
	tcase_add_test(commands, test_export_import);
	tcase_add_test(commands, test_hostile_names);
	tcase_add_test(commands, test_socket_from_environment);
	suite_add_tcase(suite, commands);

	tcase_add_checked_fixture(errors, setup, teardown);
	tcase_set_timeout(errors, 60);
	tcase_add_loop_test(errors, test_error_exit, 0,
			    (int)(sizeof(error_cases) / sizeof(error_cases[0])));
	tcase_add_test(errors, test_cannot_connect);
	tcase_add_test(errors, test_permission_denied);
	tcase_add_test(errors, test_help_and_version);
	suite_add_tcase(suite, errors);

	tcase_add_checked_fixture(watch, setup, teardown);
	tcase_set_timeout(watch, 60);
	tcase_add_test(watch, test_watch_count);
	tcase_add_test(watch, test_watch_rate_counts_other_clients);
	tcase_add_test(watch, test_looking_leaves_sessions_idle);
	suite_add_tcase(suite, watch);
	return suite;
}

int main(void)
{
	/* Fork mode: each test gets a fresh process and its own daemon, and a
	 * crash or hang in one cannot take the others down. */
	return suite_main(zipcachectl_suite(), CK_FORK);
}
