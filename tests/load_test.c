/*
 * Tests of the zipcache-load program against a real daemon: a short run
 * that must pass (zero errors, calls made, every session closed, the
 * daemon's session memory back to zero), a run with recycling by trim,
 * a run the daemon refuses (a max_tokens above its --max-tokens), which
 * must fail fast with the daemon's message, and the usage errors.
 *
 * The program is run as a real process (fork + exec of
 * ZC_BUILD_DIR/bin/zipcache-load through program_run(), bounded) and
 * judged by what a script sees: its exit status and its JSON object.
 * The runs are a few seconds with small shapes; the 64-client soak and
 * its memory flatness are measured by hand (docs/BENCHMARKS.md), since a
 * few sessions of a few kilobytes cannot show a flat line within 5 %.
 *
 * When the program is not built (it is not yet in TOOL_MAINS), every test
 * says so and passes: the suite must not fail a build that lacks it.
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "process_run.h"
#include "suite_main.h"

/* Short runs are no steady state, so their drift bound is loose; under
 * AddressSanitizer freed memory sits in quarantine and the daemon's heap
 * only grows, so the bound there says nothing and is looser still. */
#ifdef __SANITIZE_ADDRESS__
#define SHORT_RUN_DRIFT "1000"
#else
#define SHORT_RUN_DRIFT "100"
#endif

/* A run is 3 s plus start-up; ASan makes everything several times slower. */
#define TEST_TIMEOUT_SECONDS 60

#define OUTPUT_BYTES (64u << 10)

static const char *load_binary_path(void)
{
	static char path[PATH_MAX];

	snprintf(path, sizeof(path), "%s/bin/zipcache-load", build_dir());
	return path;
}

/* Whether the program exists; if not, says why the test does nothing. */
static bool load_binary_present(void)
{
	if (access(load_binary_path(), X_OK) == 0)
		return true;
	fprintf(stderr, "load_test: SKIPPED: %s is not built (add tools/zipcache-load.c to "
		"TOOL_MAINS in the Makefile)\n", load_binary_path());
	return false;
}

struct load_result {
	int status;                /* from waitpid() */
	char out[OUTPUT_BYTES];
	char err[OUTPUT_BYTES];
};

/* Runs zipcache-load with the arguments (NULL-terminated, after argv[0]). */
static void load_run(struct load_result *result, const char *const *args)
{
	const char *argv[64];
	int argc = 0, rc;

	argv[argc++] = load_binary_path();
	for (int i = 0; args[i]; i++) {
		ck_assert_int_lt(argc, 63);
		argv[argc++] = args[i];
	}
	argv[argc] = NULL;
	rc = program_run(argv, &result->status, result->out, sizeof(result->out), result->err,
			 sizeof(result->err));
	ck_assert_msg(rc == 0, "running %s: %s", argv[0], strerror(-rc));
}

static int exit_code(const struct load_result *result)
{
	ck_assert_msg(WIFEXITED(result->status), "zipcache-load died of signal %d; stderr:\n%s",
		      WTERMSIG(result->status), result->err);
	return WEXITSTATUS(result->status);
}

/*
 * The number after the last key of a path of keys in the tool's JSON,
 * each key searched after the one before it ("memory", "after",
 * "sessions" finds memory.after.sessions). The tool writes its own keys
 * without spaces, which keeps this honest enough for a test.
 */
static double json_number(const char *json, const char *const *keys)
{
	const char *at = json;
	char needle[128];

	for (int i = 0; keys[i]; i++) {
		snprintf(needle, sizeof(needle), "\"%s\":", keys[i]);
		at = strstr(at, needle);
		ck_assert_msg(at != NULL, "no key \"%s\" in the JSON:\n%s", keys[i], json);
		at += strlen(needle);
	}
	char *end;
	double value = strtod(at, &end);
	ck_assert_msg(end != at, "key \"%s\" holds no number in:\n%s", keys[0], json);
	return value;
}

#define JSON_NUMBER(json, ...) json_number((json), (const char *const[]){ __VA_ARGS__, NULL })

static bool json_has(const char *json, const char *text)
{
	return strstr(json, text) != NULL;
}

/* The JSON object must be one line: the whole of stdout. */
static void assert_one_json_line(const struct load_result *result)
{
	size_t length = strlen(result->out);

	ck_assert_msg(length > 2 && result->out[0] == '{' && result->out[length - 1] == '\n' &&
			      result->out[length - 2] == '}' && !memchr(result->out, '\n', length - 1),
		      "stdout is not one JSON object on one line:\n%s", result->out);
}

/* ---- tests --------------------------------------------------------------- */

/* A short healthy run: exit 0, no errors, real traffic, nothing left behind. */
START_TEST(test_short_run_passes)
{
	struct daemon_harness daemon;
	static struct load_result result;
	const char *daemon_args[] = { "--metrics-listen", "off", NULL };

	if (!load_binary_present())
		return;
	daemon_start(&daemon, daemon_args);
	/* --max-drift 100: four sessions of a few kilobytes are not a steady
	 * state (one closed for recycling is a quarter of the memory); the
	 * soak measures flatness, this run the machinery. */
	const char *args[] = { "--socket", daemon.socket_path, "--clients", "4", "--layers", "4",
			       "--seconds", "3", "--warmup", "1", "--kv-heads", "2", "--head-dim",
			       "64", "--prefill", "32", "--prefill-every", "48", "--max-drift", SHORT_RUN_DRIFT,
			       "--json", NULL };
	load_run(&result, args);
	ck_assert_msg(exit_code(&result) == 0, "zipcache-load should pass, exit %d:\n%s\n%s",
		      exit_code(&result), result.out, result.err);
	assert_one_json_line(&result);
	ck_assert_msg(json_has(result.out, "\"pass\":true"), "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "errors") == 0, "%s", result.out);
	ck_assert_msg(json_has(result.out, "\"first_errors\":[]"), "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "calls_per_s") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "decode_tokens_per_s") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "latency_us", "decode", "count") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "latency_us", "decode", "p50") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "latency_us", "decode", "p99") >=
			      JSON_NUMBER(result.out, "latency_us", "decode", "p50"),
		      "%s", result.out);
	/* 48-step cycles: every client recycles several times in 3 s. */
	double opened = JSON_NUMBER(result.out, "sessions_opened");
	ck_assert_msg(opened > 4, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "sessions_closed") == opened, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "leftover_sessions") == 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "daemon_request_errors") == 0, "%s", result.out);
	/* The daemon's pid came from SO_PEERCRED, so RSS was sampled. */
	ck_assert_msg(JSON_NUMBER(result.out, "daemon_pid") == daemon.pid, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "end", "rss_anon_bytes") > 0, "%s", result.out);
	/* While the clients ran, their sessions held memory (one may have
	 * been between close and reopen at that instant); after they closed
	 * them the daemon holds none. */
	double open_at_end = JSON_NUMBER(result.out, "memory", "end", "sessions");
	ck_assert_msg(open_at_end >= 1 && open_at_end <= 4, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "end", "shm_bytes") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "after", "sessions") == 0, "%s", result.out);
	/* What stays is the uid's block pool's header page. */
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "after", "shm_bytes") <= 4096, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "after", "connections") == 1, "%s", result.out);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Recycling by trim keeps the sessions open and trims them empty. */
START_TEST(test_trim_recycling_passes)
{
	struct daemon_harness daemon;
	static struct load_result result;
	const char *daemon_args[] = { "--metrics-listen", "off", NULL };

	if (!load_binary_present())
		return;
	daemon_start(&daemon, daemon_args);
	const char *args[] = { "--socket", daemon.socket_path, "--clients", "3", "--layers", "3",
			       "--seconds", "2", "--warmup", "1", "--kv-heads", "1", "--head-dim",
			       "32", "--prefill", "16", "--prefill-every", "40", "--recycle", "trim",
			       "--max-drift", SHORT_RUN_DRIFT, "--json", NULL };
	load_run(&result, args);
	ck_assert_msg(exit_code(&result) == 0, "zipcache-load should pass, exit %d:\n%s\n%s",
		      exit_code(&result), result.out, result.err);
	ck_assert_msg(JSON_NUMBER(result.out, "errors") == 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "sessions_trimmed") > 0, "%s", result.out);
	/* One session per client for the whole run, closed at the end. */
	ck_assert_msg(JSON_NUMBER(result.out, "sessions_opened") == 3, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "sessions_closed") == 3, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "memory", "after", "sessions") == 0, "%s", result.out);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Sessions the daemon refuses: errors with the daemon's reason, exit 1,
 * and the clients give up instead of hammering for the whole run. */
START_TEST(test_refused_sessions_fail)
{
	struct daemon_harness daemon;
	static struct load_result result;
	const char *daemon_args[] = { "--metrics-listen", "off", "--max-tokens", "1024", NULL };

	if (!load_binary_present())
		return;
	daemon_start(&daemon, daemon_args);
	const char *args[] = { "--socket", daemon.socket_path, "--clients", "2", "--layers", "2",
			       "--seconds", "10", "--warmup", "1", "--kv-heads", "1", "--head-dim",
			       "32", "--prefill", "16", "--max-tokens", "4096", "--json", NULL };
	load_run(&result, args);
	ck_assert_msg(exit_code(&result) == 1, "zipcache-load should fail, exit %d:\n%s\n%s",
		      exit_code(&result), result.out, result.err);
	assert_one_json_line(&result);
	ck_assert_msg(json_has(result.out, "\"pass\":false"), "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "errors") > 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "sessions_opened") == 0, "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "clients_gave_up") == 2, "%s", result.out);
	/* Both gave up long before the 10 s were over. */
	ck_assert_msg(json_has(result.out, "\"stopped_early\":true"), "%s", result.out);
	ck_assert_msg(JSON_NUMBER(result.out, "duration_s") < 9, "%s", result.out);
	/* The first message names the call and carries the daemon's reason. */
	ck_assert_msg(json_has(result.out, "\"first_errors\":[\"client "), "%s", result.out);
	ck_assert_msg(json_has(result.out, "open (session cycle 0"), "%s", result.out);
	ck_assert_msg(json_has(result.out, "max_tokens") || json_has(result.out, "max-tokens"),
		      "the daemon's reason should name the limit:\n%s", result.out);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* The text report (without --json) says FAIL and shows the first error. */
START_TEST(test_text_report_names_failure)
{
	struct daemon_harness daemon;
	static struct load_result result;
	const char *daemon_args[] = { "--metrics-listen", "off", "--max-tokens", "1024", NULL };

	if (!load_binary_present())
		return;
	daemon_start(&daemon, daemon_args);
	const char *args[] = { "--socket", daemon.socket_path, "--clients", "1", "--layers", "1",
			       "--seconds", "5", "--kv-heads", "1", "--head-dim", "32", "--prefill",
			       "16", "--max-tokens", "2048", NULL };
	load_run(&result, args);
	ck_assert_int_eq(exit_code(&result), 1);
	ck_assert_msg(strstr(result.out, "result: FAIL") != NULL, "%s", result.out);
	ck_assert_msg(strstr(result.out, "client 0: open") != NULL, "%s", result.out);
	ck_assert_msg(strstr(result.out, "daemon memory") != NULL, "%s", result.out);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Usage errors exit 2 with one line on stderr and touch no socket. */
START_TEST(test_usage_errors)
{
	static struct load_result result;
	static const char *const cases[][8] = {
		{ "--clients", "4", NULL },                              /* no --socket */
		{ "--socket", "/nonexistent/z.sock", "--clients", "0", NULL },
		{ "--socket", "/nonexistent/z.sock", "--seconds", "3", "--warmup", "3", NULL },
		{ "--socket", "/nonexistent/z.sock", "--prefill", "64", "--max-tokens", "64", NULL },
		{ "--socket", "/nonexistent/z.sock", "--recycle", "sometimes", NULL },
		{ "--socket", "/nonexistent/z.sock", "--bogus", "1", NULL },
		{ "--socket", "/nonexistent/z.sock", "--layers", NULL },
		{ "--socket", "/nonexistent/z.sock", "--clients", "4x", NULL },
	};

	if (!load_binary_present())
		return;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		load_run(&result, cases[i]);
		ck_assert_msg(exit_code(&result) == 2, "case %zu: exit %d, stderr:\n%s", i,
			      exit_code(&result), result.err);
		ck_assert_msg(strncmp(result.err, "zipcache-load: ", 15) == 0, "case %zu: %s", i,
			      result.err);
		ck_assert_msg(result.out[0] == '\0', "case %zu: stdout:\n%s", i, result.out);
	}
	/* A socket nobody listens on is a failure to run, not a usage error. */
	const char *args[] = { "--socket", "/nonexistent/z.sock", NULL };
	load_run(&result, args);
	ck_assert_int_eq(exit_code(&result), 1);
	ck_assert_msg(strstr(result.err, "cannot connect") != NULL, "%s", result.err);
}
END_TEST

static Suite *load_suite(void)
{
	Suite *suite = suite_create("load");
	TCase *tc = tcase_create("zipcache-load");

	tcase_set_timeout(tc, TEST_TIMEOUT_SECONDS);
	tcase_add_test(tc, test_short_run_passes);
	tcase_add_test(tc, test_trim_recycling_passes);
	tcase_add_test(tc, test_refused_sessions_fail);
	tcase_add_test(tc, test_text_report_names_failure);
	tcase_add_test(tc, test_usage_errors);
	suite_add_tcase(suite, tc);
	return suite;
}

int main(void)
{
	return suite_main(load_suite(), CK_FORK);
}
