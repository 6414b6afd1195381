/*
 * Integration-test harness: a real zipcached on a private temporary
 * directory, and a raw socket for the bytes no well-behaved client sends.
 *
 *	struct daemon_harness daemon;
 *	const char *args[] = { "--max-tokens", "4096", NULL };
 *
 *	daemon_start(&daemon, args);         inside the test, after Check's fork
 *	zc_client_connect(daemon.socket_path, 5000, &client);
 *	...
 *	daemon_stop(&daemon);                SIGTERM: asserts exit 0, socket gone
 *	daemon_cleanup(&daemon);             removes the directory
 *
 * The daemon runs as bin/zipcached under $ZC_BUILD_DIR (or the build
 * directory the test was compiled for), with --socket DIR/z.sock
 * --shm-dir DIR/shm --log-level warn (and --metrics-listen off when the
 * binary has that flag, so concurrent daemons never fight over the default
 * metrics port; an extra --metrics-listen comes later and wins) plus the
 * extra flags, its output in DIR/daemon.log. It dies with the process
 * that started it: a failed assertion ends the test process at once, and
 * then PR_SET_PDEATHSIG kills the daemon and a janitor process removes
 * the directory, so neither outlives its test.
 *
 * The start/stop calls assert with Check and belong to the test process;
 * the raw-socket calls only return codes, so helper processes forked by a
 * test may use them too.
 */
#ifndef ZIPCACHE_TESTS_DAEMON_HARNESS_H
#define ZIPCACHE_TESTS_DAEMON_HARNESS_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "wire_pb.h"

#define DAEMON_MAX_EXTRA_ARGS 16

struct daemon_harness {
	pid_t pid;                 /* the running daemon, 0 when none */
	char dir[256];             /* the private temporary directory (short: sockets live in it) */
	char socket_path[108];     /* DIR/z.sock (sun_path's size) */
	char shm_dir[PATH_MAX];    /* DIR/shm */
	char log_path[PATH_MAX];   /* DIR/daemon.log: its stdout and stderr */
	/* The extra flags of the last start, reused by daemon_restart(). */
	char extra_args[DAEMON_MAX_EXTRA_ARGS][256];
	int n_extra_args;
	/* RLIMIT_NOFILE the daemon starts with (0: the test's own), kept for
	 * daemon_restart(): see daemon_start_with_nofile(). */
	unsigned long nofile_soft, nofile_hard;
	int janitor_fd;            /* private: see daemon_harness.c */
};

/* The zipcached binary this test run uses. */
const char *daemon_binary_path(void);

/* Makes a fresh directory and starts the daemon on it with the extra
 * flags (a NULL-terminated list, or NULL); returns once the socket
 * accepts connections (bounded: fails the test after 10 s). */
void daemon_start(struct daemon_harness *daemon, const char *const *extra_args);

/* The same, with RLIMIT_NOFILE set to soft/hard in the daemon's process
 * before exec (a daemon at its descriptor limit). */
void daemon_start_with_nofile(struct daemon_harness *daemon, const char *const *extra_args,
			      unsigned long soft, unsigned long hard);

/* Starts the daemon again on the same directory and flags (after
 * daemon_stop() or daemon_kill()): the sessions of the last run are there. */
void daemon_restart(struct daemon_harness *daemon);

/* SIGTERM, then waits (SIGKILL after 20 s, which fails the test). Asserts
 * that the daemon exited with status 0 and removed its socket file. */
void daemon_stop(struct daemon_harness *daemon);

/* The flags the next daemon_restart() passes (a NULL-terminated list). */
void daemon_set_extra_args(struct daemon_harness *daemon, const char *const *extra_args);

/* Waits up to timeout_ms for the daemon to exit by itself and reaps it:
 * its wait status, or -1 when it still runs (it is left running). */
int daemon_wait_exit(struct daemon_harness *daemon, int timeout_ms);

/* SIGKILL and reap: a crash. The socket file and sessions stay behind. */
void daemon_kill(struct daemon_harness *daemon);

/* Kills the daemon if it still runs and removes the directory. */
void daemon_cleanup(struct daemon_harness *daemon);

/* The last bytes of the daemon's log (for failure messages); never NULL. */
const char *daemon_log_tail(const struct daemon_harness *daemon, char *buffer, size_t size);

/*
 * Runs a program to completion (bounded: 20 s) with stdin from /dev/null,
 * capturing up to out_size - 1 / err_size - 1 bytes of its stdout and
 * stderr (NUL-terminated). Returns 0 with *status from waitpid(), or a
 * negative errno.
 */
int program_run(const char *const *argv, int *status, char *out, size_t out_size, char *err,
		size_t err_size);

/* ---- raw socket ---------------------------------------------------------- */

/* The name of a reply's status as the protocol spells it (for messages). */
const char *response_status_name(zipcache_v1_Status status);

/* A blocking connection to the socket: the descriptor, or a negative errno. */
int raw_connect(const char *socket_path);

/* Writes all bytes; 0 or a negative errno (-EPIPE once the daemon closed). */
int raw_send(int fd, const void *bytes, size_t len);

/*
 * Reads one reply frame (header and body) within timeout_ms, decodes it
 * with wire_pb_response_decode() into *reply (free it with
 * wire_pb_response_free()) and sets *frame_bytes to the whole frame's size
 * (header included; may be NULL). Descriptors that come with it are
 * closed. Returns 0, -ECONNRESET when the daemon closed the connection
 * (before a whole frame), -ETIMEDOUT, or ZC_EPROTOCOL for bytes that do
 * not decode.
 */
int raw_read_reply(int fd, int timeout_ms, wire_pb_response *reply, size_t *frame_bytes);

/* Encodes request (wire_pb_request_encode), sends it and reads the reply. */
int raw_call(int fd, const wire_pb_request *request, wire_pb_response *reply, size_t *frame_bytes);

/* The read-only view descriptor the daemon passes with an attach of the
 * caller's session `name`, taken off a raw connection of its own (the
 * client library maps it and closes it): for tests of what a client can
 * do with it. -1 on failure. */
int raw_view_descriptor(const char *socket_path, const char *name);

/* Whether the daemon closes the connection within timeout_ms, with no
 * further bytes before the end. */
bool raw_wait_closed(int fd, int timeout_ms);

#endif
