/*
 * Tests for deploy/: the systemd unit, the Kubernetes manifests, the
 * Containerfile, the Prometheus configuration and the Grafana dashboard.
 *
 * The checks themselves live in deploy/check.py (an operator runs the
 * same script after editing a file); these tests run it, section by
 * section, with /usr/bin/python3 and its yaml module (Debian package
 * python3-yaml), against the daemon this build made: its --help is the
 * list of valid flags, and a real zipcached's /metrics is the list of
 * valid metric names. Sections whose tool (systemd-analyze, promtool) is
 * not installed are reported as skipped, not failed. A last test breaks a
 * copy of deploy/ in several ways and expects the script to say so.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
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
#include "suite_main.h"

#define PYTHON "/usr/bin/python3"
/* check.py's exit status for "this section's tool is not installed". */
#define CHECK_SKIPPED 77

static char work_dir[PATH_MAX];
static pid_t daemon_pid = -1;

static const char *daemon_path(void)
{
	static char path[PATH_MAX];

	snprintf(path, sizeof(path), "%s/bin/zipcached", build_dir());
	return path;
}

/*
 * The source tree's deploy/: $ZC_SOURCE_DIR, else the current directory
 * (make check runs tests from the top of the tree), else above the build
 * directory (build/ or build/asan/).
 */
static const char *deploy_dir(void)
{
	static char path[PATH_MAX];
	char candidates[4][PATH_MAX];
	const char *source = getenv("ZC_SOURCE_DIR");
	size_t n = 0;

	if (source && *source)
		snprintf(candidates[n++], PATH_MAX, "%s", source);
	snprintf(candidates[n++], PATH_MAX, ".");
	snprintf(candidates[n++], PATH_MAX, "%s/..", build_dir());
	snprintf(candidates[n++], PATH_MAX, "%s/../..", build_dir());
	for (size_t i = 0; i < n; i++) {
		/* Sized for the whole array: GCC cannot tell one entry from all. */
		char check[sizeof(candidates) + 32];

		snprintf(check, sizeof(check), "%s/deploy/check.py", candidates[i]);
		if (access(check, R_OK) == 0 && realpath(candidates[i], path)) {
			strncat(path, "/deploy", sizeof(path) - strlen(path) - 1);
			return path;
		}
	}
	ck_abort_msg("cannot find deploy/check.py (set ZC_SOURCE_DIR to the source tree)");
	return NULL;
}

/* At exit as well: a failed assertion skips the teardown. */
static void cleanup(void)
{
	if (daemon_pid > 0) {
		kill(daemon_pid, SIGTERM);
		waitpid(daemon_pid, NULL, 0);
		daemon_pid = -1;
	}
	directory_remove(work_dir);
	work_dir[0] = '\0';
}

static void setup(void)
{
	const char *base = getenv("TMPDIR");

	if (!base || !*base || strlen(base) > 60)
		base = "/tmp";
	snprintf(work_dir, sizeof(work_dir), "%s/zc_deploy_test.XXXXXX", base);
	ck_assert_msg(mkdtemp(work_dir) != NULL, "mkdtemp: %s", strerror(errno));
	atexit(cleanup);
}

static void teardown(void)
{
	cleanup();
}

/* Runs argv with stdout and stderr both into *output (malloc'd); returns
 * the exit status. */
static int run(char *const *argv, char **output)
{
	char path[PATH_MAX + 16];
	pid_t child;
	int status;

	snprintf(path, sizeof(path), "%s/output", work_dir);
	child = program_spawn((const char *const *)argv, path, path, NULL, NULL);
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	*output = file_read_whole(path, NULL);
	ck_assert_msg(WIFEXITED(status), "%s died of signal %d", argv[0], WTERMSIG(status));
	ck_assert_msg(WEXITSTATUS(status) != 126 && WEXITSTATUS(status) != 127, "cannot run %s",
		      argv[0]);
	return WEXITSTATUS(status);
}

/* Whether python3 and its yaml module are here; without them the tests
 * cannot judge anything, and say so. */
static bool have_python_yaml(void)
{
	char *argv[] = { PYTHON, "-c", "import yaml, json", NULL };
	char *output;
	int status;

	if (access(PYTHON, X_OK) != 0)
		return false;
	status = run(argv, &output);
	free(output);
	return status == 0;
}

/* Starts zipcached with its metrics endpoint on a free loopback port and
 * returns the /metrics URL (the daemon logs the port it got). */
static void start_daemon_with_metrics(char *url, size_t size)
{
	char socket_path[PATH_MAX + 16], shm_dir[PATH_MAX + 16], log_path[PATH_MAX + 16];

	snprintf(socket_path, sizeof(socket_path), "%s/z.sock", work_dir);
	snprintf(shm_dir, sizeof(shm_dir), "%s/shm", work_dir);
	snprintf(log_path, sizeof(log_path), "%s/daemon.log", work_dir);
	fflush(stdout);
	fflush(stderr);
	daemon_pid = fork();
	ck_assert_int_ge(daemon_pid, 0);
	if (daemon_pid == 0) {
		int log = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (log < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0)
			_exit(126);
		execl(daemon_path(), "zipcached", "--socket", socket_path, "--shm-dir", shm_dir,
		      "--metrics-listen", "127.0.0.1:0", "--log-level", "info", (char *)NULL);
		_exit(127);
	}
	for (int waited = 0;; waited += 10) {
		zc_client *client;
		char *log, *port;

		if (zc_client_connect(socket_path, 1000, &client) == 0) {
			zc_client_close(client);
			log = file_read_whole(log_path, NULL);
			port = strstr(log, "event=\"metrics endpoint\"");
			port = port ? strstr(port, " port=") : NULL;
			ck_assert_msg(port != NULL, "the daemon logged no metrics port:\n%s", log);
			snprintf(url, size, "http://127.0.0.1:%d/metrics", atoi(port + 6));
			free(log);
			return;
		}
		ck_assert_msg(waitpid(daemon_pid, NULL, WNOHANG) == 0, "zipcached exited at start");
		ck_assert_msg(waited < 10000, "zipcached did not start");
		sleep_ms(10);
	}
}

static const char *const sections[] = { "yaml", "kubernetes", "prometheus", "grafana", "systemd",
					"container" };

/* One section of check.py, with the flags of the built daemon and the
 * metric names of a running one. */
START_TEST(test_deploy_section)
{
	char script[PATH_MAX + 16], url[128];
	char *output;
	int status;

	if (!have_python_yaml()) {
		ck_abort_msg("%s with the yaml module is needed (Debian package python3-yaml)", PYTHON);
		return;
	}
	start_daemon_with_metrics(url, sizeof(url));
	snprintf(script, sizeof(script), "%s/check.py", deploy_dir());
	char *argv[] = { PYTHON, script, "--zipcached", (char *)daemon_path(), "--metrics-url", url,
			 "--only", (char *)sections[_i], (char *)deploy_dir(), NULL };
	status = run(argv, &output);
	if (status == CHECK_SKIPPED)
		printf("deploy %s: its tool is not installed, checked without it: %s", sections[_i], output);
	else
		ck_assert_msg(status == 0, "deploy/check.py --only %s (status %d):\n%s", sections[_i],
			      status, output);
	free(output);
}
END_TEST

/* ---- the script catches mistakes ----------------------------------------- */

static void replace_in_file(const char *path, const char *old, const char *new)
{
	char *text = file_read_whole(path, NULL);
	char *at = strstr(text, old);
	FILE *file;

	ck_assert_msg(at != NULL, "'%s' not in %s", old, path);
	file = fopen(path, "wb");
	ck_assert_ptr_nonnull(file);
	fwrite(text, 1, (size_t)(at - text), file);
	fputs(new, file);
	fputs(at + strlen(old), file);
	ck_assert_int_eq(fclose(file), 0);
	free(text);
}

START_TEST(test_check_catches_mistakes)
{
	char copy[PATH_MAX + 16], script[PATH_MAX + 16], path[PATH_MAX + 64];
	char *output;

	if (!have_python_yaml()) {
		ck_abort_msg("%s with the yaml module is needed (Debian package python3-yaml)", PYTHON);
		return;
	}
	snprintf(copy, sizeof(copy), "%s/deploy", work_dir);
	char *cp_argv[] = { "/bin/cp", "-R", (char *)deploy_dir(), copy, NULL };
	ck_assert_int_eq(run(cp_argv, &output), 0);
	free(output);

	/* A flag zipcached does not have: it would exit at start. */
	snprintf(path, sizeof(path), "%s/kubernetes/sidecar-pod.yaml", copy);
	replace_in_file(path, "--idle-ttl=3600", "--idle-timeout=3600");
	/* YAML that does not parse. */
	snprintf(path, sizeof(path), "%s/kubernetes/daemonset.yaml", copy);
	replace_in_file(path, "      maxUnavailable: 1", "      maxUnavailable: [1");
	/* A probe on the wrong path: the kubelet would restart a healthy daemon. */
	snprintf(path, sizeof(path), "%s/kubernetes/sidecar-pod.yaml", copy);
	replace_in_file(path, "path: /healthz", "path: /health");
	/* A metric zipcached does not export: an empty panel. */
	snprintf(path, sizeof(path), "%s/grafana/zipcached-dashboard.json", copy);
	replace_in_file(path, "zipcache_compression_ratio{", "zipcache_compresion_ratio{");
	/* A unit that would lose every session on restart. */
	snprintf(path, sizeof(path), "%s/zipcached.service", copy);
	replace_in_file(path, "RemoveIPC=no", "DynamicUser=yes");
	/* An image whose user is not the one the manifests run as, and
	 * which lacks a library the daemon loads. */
	snprintf(path, sizeof(path), "%s/Containerfile", copy);
	replace_in_file(path, "USER 10001:10001", "USER 10002:10001");
	replace_in_file(path, " libmicrohttpd12 ", " ");

	snprintf(script, sizeof(script), "%s/check.py", deploy_dir());
	char *argv[] = { PYTHON, script, "--zipcached", (char *)daemon_path(), copy, NULL };
	ck_assert_int_eq(run(argv, &output), 1);
	const char *expected[] = {
		"zipcached has no flag --idle-timeout",
		"kubernetes/daemonset.yaml: not valid YAML",
		"Probe is not httpGet /healthz on port 9464",
		"unknown metric zipcache_compresion_ratio",
		"DynamicUser= implies RemoveIPC=yes",
		"no RemoveIPC=",
		"the image's USER is 10002:10001",
		"zipcached needs libmicrohttpd.so.12",
	};
	for (size_t i = 0; i < sizeof(expected) / sizeof(expected[0]); i++)
		ck_assert_msg(strstr(output, expected[i]) != NULL, "check.py did not report '%s':\n%s",
			      expected[i], output);
	free(output);
}
END_TEST

static Suite *deploy_suite(void)
{
	Suite *suite = suite_create("deploy");
	TCase *files = tcase_create("files");

	tcase_add_checked_fixture(files, setup, teardown);
	/* systemd-analyze verify alone takes a few seconds on a cold cache. */
	tcase_set_timeout(files, 120);
	tcase_add_loop_test(files, test_deploy_section, 0,
			    (int)(sizeof(sections) / sizeof(sections[0])));
	tcase_add_test(files, test_check_catches_mistakes);
	suite_add_tcase(suite, files);
	return suite;
}

int main(void)
{
	return suite_main(deploy_suite(), CK_FORK);
}
