/*
 * What several suites need around the processes they run, once instead of
 * a copy per suite: a clock, the build directory, whole files, directory
 * removal, a fork/exec with stdin from /dev/null and stdout/stderr
 * captured in files, helper processes, and socket probes.
 *
 * now_ms, sleep_ms, build_dir, directory_remove and socket_accepts never
 * call ck_assert, so helper processes may use them; the others assert with
 * Check (the forks only that fork worked) and belong to the test process.
 */
#ifndef ZIPCACHE_TESTS_PROCESS_RUN_H
#define ZIPCACHE_TESTS_PROCESS_RUN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* CLOCK_MONOTONIC in milliseconds. */
int64_t now_ms(void);

/* Sleeps the whole time even when signals interrupt it. */
void sleep_ms(int ms);

/* $ZC_BUILD_DIR, or the build directory the tests were compiled for. */
const char *build_dir(void);

/* Removes a directory tree (nothing for ""); errors are ignored: it is
 * cleanup, and a leftover must not fail a test that passed. */
void directory_remove(const char *dir);

/* A whole file, NUL-terminated and malloc'd; *size (if size is not NULL)
 * excludes the NUL. Asserts that the file can be read. */
char *file_read_whole(const char *path, size_t *size);

/* fork() whose child gets SIGKILL when the calling process dies (and
 * exits with orphan_status at once if that already happened). Asserts that
 * fork worked. */
pid_t fork_dying_with_parent(int orphan_status);

/*
 * Forks and execs argv[0] (argv NULL-terminated) with stdin from
 * /dev/null, stdout into out_path and stderr into err_path (created or
 * truncated; the same path for both gives one file with both, in order).
 * When env_name is not NULL the child sets it to env_value, or unsets it
 * when env_value is NULL, so no test depends on the caller's environment.
 * The child dies with the calling process (PR_SET_PDEATHSIG); it exits 126
 * when the redirection fails and 127 when exec does. Returns its pid
 * (asserts that fork worked).
 */
pid_t program_spawn(const char *const *argv, const char *out_path, const char *err_path,
		    const char *env_name, const char *env_value);

/* What a program run to completion left. */
struct program_output {
	int status;           /* exit status, or 128 + signal number */
	char *out;
	size_t out_length;
	char *err;
	size_t err_length;
};

/*
 * program_spawn(), then waits (no time bound: the programs the callers run
 * always end) and reads both files back. Asserts that the program could be
 * run at all (status neither 126 nor 127).
 */
void program_capture(struct program_output *result, const char *const *argv,
		     const char *out_path, const char *err_path, const char *env_name,
		     const char *env_value);

void program_output_free(struct program_output *result);

/* ---- helper processes (Check asserts: the test process only) ------------ */

typedef int (*child_body)(void *arg);

/* Forks a helper that runs body and exits with its result; it dies with
 * the test process. close_in_child (or -1) is a descriptor the helper
 * must not hold, such as the write end of a pipe whose end of stream it
 * waits for. */
pid_t child_spawn(child_body body, void *arg, int close_in_child);

/* Reaps a helper and asserts that it exited with status 0 (what says
 * which helper, for the failure message). */
void child_wait_ok(pid_t pid, const char *what);

/* In a helper process: explain on stderr and fail through the exit status. */
#define CHILD_EXPECT(cond, ...)                                                 \
	do {                                                                    \
		if (!(cond)) {                                                  \
			fprintf(stderr, "%s:%d: helper (pid %d, uid %u): ",     \
				__FILE__, __LINE__, (int)getpid(),              \
				(unsigned)getuid());                            \
			fprintf(stderr, __VA_ARGS__);                           \
			fputc('\n', stderr);                                    \
			return 1;                                               \
		}                                                               \
	} while (0)

/* ---- other users (the suites run as root) -------------------------------- */

/* In a helper: becomes uid/gid for good, with no supplementary groups;
 * false, with the reason in why, if anything of root is left. */
bool user_become(uid_t uid, gid_t gid, char *why, size_t size);

/* Whether a test can act as another user against a daemon whose socket
 * is in dir: it needs root, and dir's parents traversable by others (the
 * test makes dir itself 0755). When not, says why on stderr. */
bool other_users_possible(const char *dir);

/* ---- sockets ------------------------------------------------------------------ */

/* Whether a connection to the Unix socket at path succeeds right now. */
bool socket_accepts(const char *path);

/* The next two assert with Check. */


/* A port nothing listens on right now: bind 127.0.0.1:0, read, close. */
uint16_t free_tcp_port(void);

/* GET /metrics from 127.0.0.1:port: the body, malloc'd. */
char *metrics_scrape(uint16_t port);

/* A sample's value in /metrics ("name{labels}" exactly), -1 when absent. */
long long metric_value(uint16_t port, const char *sample);

/* The TCP sockets (IPv4 and IPv6) pid holds: their count (the first 1024
 * sockets among its descriptors). */
int process_tcp_sockets(pid_t pid);

#endif
