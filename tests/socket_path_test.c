/*
 * One rule for the default socket (zipcache/client.h): zipcached listens,
 * and zipcachectl and the clients dial, where zc_daemon_socket_path() and
 * zc_default_socket_path() say. First the rule itself, environment by
 * environment; then the programs: zipcached's --help names the path it
 * would listen on, zipcachectl names the one it dials (in its output, or
 * in its failure to connect), and both must be the library's.
 * (tests/python/test_socket_path.py holds the Python client to the same.)
 *
 * Each test sets its own environment; Check runs each in its own process.
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "process_run.h"
#include "zipcache/client.h"
#include "suite_main.h"

#define TEST_TIMEOUT_SECONDS 60

/* A clean slate: none of the variables the rule reads. */
static void environment_clear(void)
{
	unsetenv("ZIPCACHE_SOCKET");
	unsetenv("RUNTIME_DIRECTORY");
	unsetenv("XDG_RUNTIME_DIR");
}

/* What the per-user place is for this uid with $XDG_RUNTIME_DIR = xdg (or unset). */
static void user_place(char *buf, size_t len, const char *xdg)
{
	if (getuid() == 0)
		snprintf(buf, len, "/run/zipcached.sock");
	else if (xdg)
		snprintf(buf, len, "%s/zipcached.sock", xdg);
	else
		snprintf(buf, len, "/tmp/zipcached-%u.sock", (unsigned)getuid());
}

static void assert_daemon_path(const char *want, const char *what)
{
	char got[PATH_MAX];

	ck_assert_int_eq(zc_daemon_socket_path(got, sizeof(got)), 0);
	ck_assert_msg(strcmp(got, want) == 0, "%s: the daemon listens at '%s', expected '%s'", what,
		      got, want);
}

static void assert_client_path(const char *want, const char *what)
{
	char got[PATH_MAX];

	ck_assert_int_eq(zc_default_socket_path(got, sizeof(got)), 0);
	ck_assert_msg(strcmp(got, want) == 0, "%s: clients dial '%s', expected '%s'", what, got,
		      want);
}

START_TEST(the_rule_environment_by_environment)
{
	char want[PATH_MAX];

	environment_clear();
	user_place(want, sizeof(want), NULL);
	/* (The system service's socket is no fallback unless it exists; on a
	 * machine that runs the service, the client's answer may be it.) */
	assert_daemon_path(want, "nothing set");
	if (access(ZC_SERVICE_SOCKET_PATH, F_OK) != 0)
		assert_client_path(want, "nothing set");

	setenv("XDG_RUNTIME_DIR", "/nonexistent/xdg", 1);
	user_place(want, sizeof(want), "/nonexistent/xdg");
	assert_daemon_path(want, "XDG_RUNTIME_DIR");
	if (access(ZC_SERVICE_SOCKET_PATH, F_OK) != 0)
		assert_client_path(want, "XDG_RUNTIME_DIR");
	setenv("XDG_RUNTIME_DIR", "", 1);  /* empty is unset */
	user_place(want, sizeof(want), NULL);
	assert_daemon_path(want, "empty XDG_RUNTIME_DIR");

	/* systemd's RuntimeDirectory is the daemon's own: clients never look there. */
	setenv("RUNTIME_DIRECTORY", "/run/first:/run/second", 1);
	assert_daemon_path("/run/first/zipcached.sock", "RUNTIME_DIRECTORY list");
	if (access(ZC_SERVICE_SOCKET_PATH, F_OK) != 0)
		assert_client_path(want, "a client with RUNTIME_DIRECTORY");
	setenv("RUNTIME_DIRECTORY", "/run/zipcached", 1);
	assert_daemon_path(ZC_SERVICE_SOCKET_PATH, "the shipped unit's RuntimeDirectory");

	/* $ZIPCACHE_SOCKET points clients anywhere; the daemon has --socket. */
	setenv("ZIPCACHE_SOCKET", "/somewhere/else.sock", 1);
	assert_client_path("/somewhere/else.sock", "ZIPCACHE_SOCKET");
	assert_daemon_path(ZC_SERVICE_SOCKET_PATH, "a daemon with ZIPCACHE_SOCKET");
}
END_TEST

START_TEST(a_path_that_does_not_fit_says_so)
{
	char small[16];
	char long_dir[300];

	environment_clear();
	setenv("ZIPCACHE_SOCKET", "/a/path/longer/than/sixteen.sock", 1);
	ck_assert_int_eq(zc_default_socket_path(small, sizeof(small)), -ENAMETOOLONG);
	ck_assert_uint_eq(strlen(small), sizeof(small) - 1);
	memset(long_dir, 'd', sizeof(long_dir) - 1);
	long_dir[0] = '/';
	long_dir[sizeof(long_dir) - 1] = '\0';
	setenv("RUNTIME_DIRECTORY", long_dir, 1);
	ck_assert_int_eq(zc_daemon_socket_path(small, sizeof(small)), -ENAMETOOLONG);
	ck_assert_int_eq(zc_daemon_socket_path(small, 0), -ENAMETOOLONG);
}
END_TEST

/* zipcached --help: "--socket PATH ... (default PATH)". */
static char *daemon_help_socket(const char *dir)
{
	char bin[PATH_MAX], out[PATH_MAX], err[PATH_MAX];
	struct program_output result;

	snprintf(bin, sizeof(bin), "%s/bin/zipcached", build_dir());
	snprintf(out, sizeof(out), "%s/help.out", dir);
	snprintf(err, sizeof(err), "%s/help.err", dir);
	const char *argv[] = { bin, "--help", NULL };
	program_capture(&result, argv, out, err, NULL, NULL);
	ck_assert_int_eq(result.status, 0);
	const char *line = strstr(result.out, "--socket PATH");
	ck_assert_msg(line != NULL, "zipcached --help has no --socket line:\n%s", result.out);
	const char *start = strstr(line, "(default ");
	ck_assert_ptr_nonnull(start);
	start += strlen("(default ");
	char *path = strndup(start, strcspn(start, ")"));
	program_output_free(&result);
	return path;
}

/* The socket zipcachectl dials: it names it whether it connects or not. */
static char *ctl_socket(const char *dir)
{
	char bin[PATH_MAX], out[PATH_MAX], err[PATH_MAX];
	struct program_output result;
	char *path = NULL;

	snprintf(bin, sizeof(bin), "%s/bin/zipcachectl", build_dir());
	snprintf(out, sizeof(out), "%s/ctl.out", dir);
	snprintf(err, sizeof(err), "%s/ctl.err", dir);
	const char *argv[] = { bin, "--timeout", "5000", "ping", NULL };
	program_capture(&result, argv, out, err, NULL, NULL);
	const char *failed = strstr(result.err, "cannot connect to ");
	const char *answered = strstr(result.out, " at ");
	if (failed) {
		failed += strlen("cannot connect to ");
		path = strndup(failed, strcspn(failed, ":"));
	} else if (answered && result.status == 0) {
		answered += strlen(" at ");
		path = strndup(answered, strcspn(answered, " \n"));
	}
	ck_assert_msg(path != NULL, "zipcachectl ping names no socket (status %d):\n%s%s",
		      result.status, result.out, result.err);
	program_output_free(&result);
	return path;
}

/* The three agree in one environment. */
static void assert_programs_agree(const char *dir, const char *what)
{
	char daemon[PATH_MAX], client[PATH_MAX];

	ck_assert_int_eq(zc_daemon_socket_path(daemon, sizeof(daemon)), 0);
	ck_assert_int_eq(zc_default_socket_path(client, sizeof(client)), 0);
	char *help = daemon_help_socket(dir);
	char *ctl = ctl_socket(dir);
	ck_assert_msg(strcmp(help, daemon) == 0, "%s: zipcached would listen at '%s', the rule says '%s'",
		      what, help, daemon);
	ck_assert_msg(strcmp(ctl, client) == 0, "%s: zipcachectl dials '%s', the rule says '%s'",
		      what, ctl, client);
	free(help);
	free(ctl);
}

START_TEST(daemon_and_zipcachectl_follow_the_rule)
{
	char dir[] = "/tmp/zc-socket-path-XXXXXX";
	char xdg[PATH_MAX];

	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(xdg, sizeof(xdg), "%s/xdg", dir);
	environment_clear();
	assert_programs_agree(dir, "nothing set");

	setenv("XDG_RUNTIME_DIR", xdg, 1);
	assert_programs_agree(dir, "XDG_RUNTIME_DIR");
	if (access(ZC_SERVICE_SOCKET_PATH, F_OK) != 0) {
		/* Where a daemon this user starts listens is where the user's tools dial. */
		char daemon[PATH_MAX];
		ck_assert_int_eq(zc_daemon_socket_path(daemon, sizeof(daemon)), 0);
		char *ctl = ctl_socket(dir);
		ck_assert_str_eq(ctl, daemon);
		free(ctl);
	}

	setenv("ZIPCACHE_SOCKET", "/nonexistent/pointed.sock", 1);
	assert_programs_agree(dir, "ZIPCACHE_SOCKET");
	unsetenv("ZIPCACHE_SOCKET");

	setenv("RUNTIME_DIRECTORY", dir, 1);
	assert_programs_agree(dir, "RUNTIME_DIRECTORY");
	directory_remove(dir);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "rule", { the_rule_environment_by_environment, a_path_that_does_not_fit_says_so,
			    NULL } },
		{ "programs", { daemon_and_zipcachectl_follow_the_rule, NULL } },
	};
	Suite *suite = suite_create("socket_path");

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
