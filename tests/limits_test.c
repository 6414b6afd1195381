/*
 * Exhaustion degrades, it does not collapse: a real zipcached
 * (tests/daemon_harness.c) driven to each of its limits.
 *
 *   descriptors  at RLIMIT_NOFILE the listener neither spins nor floods the
 *                log, waiting clients are told why, and service resumes when
 *                descriptors free; an open at the limit answers
 *                RESOURCE_EXHAUSTED and leaves nothing, so a retry succeeds;
 *                the soft limit is raised at start and --help says what the
 *                limits need
 *   memory       staging buffers are charged to the memory budget; unread
 *                replies are bounded per connection and in total, charged,
 *                and freed (RSS back) when their clients go; without
 *                --memory-budget one is derived from the host
 *   users        per-uid quotas keep one user from locking others out; a
 *                user other than root sees its own figures in stats
 *
 * Nothing here is timed except by generous deadlines: the CPU bound on a
 * daemon at its descriptor limit is 30% of the wall time against the 100%
 * of a spinning one.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/types.h>
#include <unistd.h>

#include "../server/options.h"
#include "../server/resources.h"
#include "daemon_harness.h"
#include "process_run.h"
#include "suite_main.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

/* Generous: under ASan the daemon is several times slower. */
#define TEST_TIMEOUT_SECONDS 240

#define MIB (1ull << 20)

/* Two unprivileged uids that need not exist in /etc/passwd. */
#define USER_A 60001u
#define USER_B 60002u
#define USER_GID 60000u

#define DEADLINE_MS 20000

/* ---- raw requests ------------------------------------------------------------ */

/*
 * Sends a request and reads one reply, also when the send failed: a
 * daemon that refused the connection has closed it after its one frame,
 * which is still there to read. Returns raw_read_reply's code.
 */
static int call_raw(int fd, const wire_pb_request *request, wire_pb_response *reply)
{
	uint8_t frame[1024];
	size_t len;

	memset(reply, 0, sizeof(*reply));
	if (wire_pb_request_encode(request, frame, sizeof(frame), &len) < 0)
		return ZC_EINVALID;
	(void)raw_send(fd, frame, len);
	return raw_read_reply(fd, 10000, reply, NULL);
}

static int stats_raw(int fd, uint64_t session_id, wire_pb_response *reply)
{
	wire_pb_request request = { 0 };
	request.msg.request_id = 11;
	request.msg.which_op = zipcache_v1_Request_stats_tag;
	request.msg.op.stats.session_id = session_id;
	return call_raw(fd, &request, reply);
}

static int open_raw(int fd, const char *name, uint32_t layers, wire_pb_response *reply)
{
	wire_pb_request request = { 0 };
	zipcache_v1_OpenSessionRequest *open = &request.msg.op.open_session;
	request.msg.request_id = 12;
	request.msg.which_op = zipcache_v1_Request_open_session_tag;
	snprintf(open->name, sizeof(open->name), "%s", name);
	open->has_shape = true;
	open->shape = (zipcache_v1_SessionShape){ layers, 1, 1, 8, 8 };
	open->max_tokens = 64;
	return call_raw(fd, &request, reply);
}

static int staging_raw(int fd, uint64_t bytes, wire_pb_response *reply)
{
	wire_pb_request request = { 0 };
	request.msg.request_id = 13;
	request.msg.which_op = zipcache_v1_Request_staging_tag;
	request.msg.op.staging.bytes = bytes;
	return call_raw(fd, &request, reply);
}

static int list_raw(int fd, wire_pb_response *reply)
{
	wire_pb_request request = { 0 };
	request.msg.request_id = 14;
	request.msg.which_op = zipcache_v1_Request_list_sessions_tag;
	return call_raw(fd, &request, reply);
}

/* The daemon-level figures of a stats reply (asserts it came). */
static zipcache_v1_StatsResponse daemon_stats(int fd)
{
	wire_pb_response reply;
	int rc = stats_raw(fd, 0, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "stats: rc %d status %s '%s'",
		      rc, response_status_name(reply.msg.status), reply.msg.message);
	zipcache_v1_StatsResponse stats = reply.msg.op.stats;
	wire_pb_response_free(&reply);
	return stats;
}

/* Asserts a reply is a refusal with `status` whose sentence contains `words`. */
static void assert_refusal(int rc, wire_pb_response *reply, zipcache_v1_Status status,
			   const char *words, const char *what)
{
	ck_assert_msg(rc == 0, "%s: no reply (%s)", what, zc_strerror(rc));
	ck_assert_msg(reply->msg.status == status && strstr(reply->msg.message, words),
		      "%s: %s '%s', expected %s naming '%s'", what, response_status_name(reply->msg.status),
		      reply->msg.message, response_status_name(status), words);
	wire_pb_response_free(reply);
}

/* Session files (not set-aside ones) in the daemon's directory. */
static int session_files(const struct daemon_harness *daemon)
{
	char command[PATH_MAX + 64];
	snprintf(command, sizeof(command), "ls %s | grep -c '^session-.*\\.zcs$'", daemon->shm_dir);
	FILE *pipe = popen(command, "r");
	int count = -1;
	ck_assert_ptr_nonnull(pipe);
	if (fscanf(pipe, "%d", &count) != 1)
		count = -1;
	pclose(pipe);
	return count;
}

/* Polls stats on fd until the daemon counts `expected` connections. */
static void wait_connections(int fd, uint32_t expected)
{
	int64_t deadline = now_ms() + DEADLINE_MS;
	uint32_t seen;
	while ((seen = daemon_stats(fd).connections) != expected) {
		ck_assert_msg(now_ms() < deadline, "the daemon counts %u connections, expected %u", seen,
			      expected);
		sleep_ms(10);
	}
}

/* ---- the daemon process ---------------------------------------------------- */

/* CPU time (user + system) the process has used, in milliseconds. */
static int64_t process_cpu_ms(pid_t pid)
{
	char path[64], text[1024];
	unsigned long long utime = 0, stime = 0;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *file = fopen(path, "r");
	ck_assert_ptr_nonnull(file);
	size_t n = fread(text, 1, sizeof(text) - 1, file);
	fclose(file);
	text[n] = '\0';
	/* After the command's ")": state is field 3, utime 14, stime 15. */
	const char *p = strrchr(text, ')');
	ck_assert_ptr_nonnull(p);
	ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
				&utime, &stime), 2);
	return (int64_t)((utime + stime) * 1000 / (unsigned long long)sysconf(_SC_CLK_TCK));
}

/* A line's number from /proc/PID/status or /proc/PID/limits. */
static uint64_t proc_number(pid_t pid, const char *file_name, const char *key, int field)
{
	char path[64], line[512];
	uint64_t value = 0;
	bool found = false;
	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, file_name);
	FILE *file = fopen(path, "r");
	ck_assert_ptr_nonnull(file);
	while (!found && fgets(line, sizeof(line), file)) {
		if (strncmp(line, key, strlen(key)) != 0)
			continue;
		const char *p = line + strlen(key);
		for (int i = 0; i <= field; i++) {
			char *end;
			while (*p == ' ' || *p == '\t' || *p == ':')
				p++;
			value = strtoull(p, &end, 10);
			p = end;
		}
		found = true;
	}
	fclose(file);
	ck_assert_msg(found, "no '%s' in %s", key, path);
	return value;
}

static uint64_t rss_bytes(pid_t pid)
{
	return proc_number(pid, "status", "VmRSS", 0) * 1024;
}

static char *log_read(const struct daemon_harness *daemon, size_t *size)
{
	return file_read_whole(daemon->log_path, size);
}

/* ======================================================================
 * Descriptors.
 * ====================================================================== */

/*
 * Opens connections until the daemon refuses one: the refusal must say
 * that descriptors ran out. The accepted ones go into kept (their count
 * returned); afterwards the daemon has no descriptor left but its spare.
 */
static int connect_until_refused(const struct daemon_harness *daemon, int *kept, int capacity)
{
	int n = 0;
	for (;;) {
		wire_pb_response reply;
		int fd = raw_connect(daemon->socket_path);
		ck_assert_msg(fd >= 0, "connect: %s", strerror(-fd));
		int rc = stats_raw(fd, 0, &reply);
		ck_assert_msg(rc == 0, "connection %d: no reply at all (%s)", n, zc_strerror(rc));
		if (reply.msg.status == zipcache_v1_Status_OK) {
			wire_pb_response_free(&reply);
			ck_assert_msg(n < capacity, "%d connections and no refusal", n);
			kept[n++] = fd;
			continue;
		}
		assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "file descriptors",
			       "the connection past the descriptor limit");
		close(fd);
		return n;
	}
}

START_TEST(accept_at_the_descriptor_limit_neither_spins_nor_floods)
{
	enum { LIMIT = 64, LATE = 60, WINDOW_MS = 1500 };
	struct daemon_harness daemon;
	int kept[LIMIT], late[LATE], n_late = 0;
	wire_pb_response reply;
	struct stat st;

	daemon_start_with_nofile(&daemon, NULL, LIMIT, LIMIT);
	int probe = raw_connect(daemon.socket_path);
	ck_assert_int_ge(probe, 0);
	daemon_stats(probe);
	int n = connect_until_refused(&daemon, kept, LIMIT);
	ck_assert_msg(n > 10 && n < LIMIT, "%d connections under a limit of %d", n, LIMIT);

	/* Exhausted, with clients still coming and never reading: a daemon
	 * that spins on its listener burns a whole CPU here. */
	int64_t cpu_before = process_cpu_ms(daemon.pid), start = now_ms();
	while (now_ms() - start < WINDOW_MS) {
		if (n_late < LATE) {
			int fd = raw_connect(daemon.socket_path);
			if (fd >= 0)
				late[n_late++] = fd;
		}
		sleep_ms(20);
	}
	int64_t cpu = process_cpu_ms(daemon.pid) - cpu_before, wall = now_ms() - start;
	fprintf(stderr, "descriptor limit: %d connections served, %d more refused; the daemon used "
		"%" PRId64 " ms of CPU in %" PRId64 " ms\n", n, n_late + 1, cpu, wall);
	ck_assert_msg(cpu * 100 < wall * 30, "the daemon used %" PRId64 " ms of CPU in %" PRId64
		      " ms at its descriptor limit: it spins", cpu, wall);
	/* Each late client was told why. */
	for (int i = 0; i < n_late; i += 10) {
		int rc = raw_read_reply(late[i], 10000, &reply, NULL);
		assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "file descriptors",
			       "a client that came at the limit");
	}
	/* Connections it has are served all along. */
	daemon_stats(probe);
	ck_assert_int_eq(stat(daemon.log_path, &st), 0);
	ck_assert_msg(st.st_size < 100 * 1024, "%lld bytes of log in %" PRId64 " ms at the limit",
		      (long long)st.st_size, wall);

	/* Clients go: new ones are served again. */
	for (int i = 0; i < n; i++)
		close(kept[i]);
	for (int i = 0; i < n_late; i++)
		close(late[i]);
	wait_connections(probe, 1);
	int64_t deadline = now_ms() + DEADLINE_MS;
	for (;;) {
		int fd = raw_connect(daemon.socket_path);
		ck_assert_int_ge(fd, 0);
		int rc = stats_raw(fd, 0, &reply);
		bool ok = rc == 0 && reply.msg.status == zipcache_v1_Status_OK;
		if (rc == 0)
			wire_pb_response_free(&reply);
		close(fd);
		if (ok)
			break;
		ck_assert_msg(now_ms() < deadline, "no connection served after the clients left");
		sleep_ms(50);
	}
	zc_client *client;
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	zc_client_close(client);
	close(probe);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Whether the daemon has no session "x" (list) and no file. */
static void assert_nothing_left(const struct daemon_harness *daemon, int fd, const char *when)
{
	wire_pb_response reply;
	int rc = list_raw(fd, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "list %s", when);
	ck_assert_msg(reply.n_sessions == 0, "%s: %zu sessions listed", when, reply.n_sessions);
	wire_pb_response_free(&reply);
	ck_assert_msg(session_files(daemon) == 0, "%s: a session file was left", when);
}

START_TEST(open_at_the_descriptor_limit_leaves_nothing_behind)
{
	enum { LIMIT = 48 };
	struct daemon_harness daemon;
	int kept[LIMIT];
	wire_pb_response reply;
	bool undone = false;
	int rc;

	daemon_start_with_nofile(&daemon, NULL, LIMIT, LIMIT);
	int n = connect_until_refused(&daemon, kept, LIMIT);
	ck_assert_int_gt(n, 4);
	int control = kept[0];

	/* No descriptor at all: the store cannot even be created. */
	rc = open_raw(control, "x", 2, &reply);
	assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "file descriptors",
		       "open with no descriptor left");
	assert_nothing_left(&daemon, control, "after an open with no descriptor");

	/*
	 * One descriptor more at a time: with one, the store is created but
	 * the client's view cannot be opened, and the creation must be taken
	 * back; with enough, the same open succeeds as if never tried.
	 */
	for (;;) {
		ck_assert_msg(n > 1, "no open succeeded with every connection closed");
		close(kept[--n]);
		wait_connections(control, (uint32_t)n);
		rc = open_raw(control, "x", 2, &reply);
		ck_assert_int_eq(rc, 0);
		if (reply.msg.status == zipcache_v1_Status_OK)
			break;
		assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "file descriptors",
			       "open at the descriptor limit");
		assert_nothing_left(&daemon, control, "after a refused open");
		size_t size;
		char *log = log_read(&daemon, &size);
		undone = undone || strstr(log, "event=\"open undone\"") != NULL;
		free(log);
	}
	ck_assert_msg(!reply.msg.op.open_session.attached && reply.msg.fds == 2,
		      "the open after the refusals: attached %d, %u descriptors",
		      reply.msg.op.open_session.attached, reply.msg.fds);
	wire_pb_response_free(&reply);
	/* The daemon holds one descriptor per store: with exactly one free,
	 * the store was made and the view for the client was not. */
	ck_assert_msg(undone, "no open was taken back after creating its store (log: no 'open undone')");
	ck_assert_int_eq(session_files(&daemon), 1);
	rc = list_raw(control, &reply);
	ck_assert_msg(rc == 0 && reply.n_sessions == 1 && strcmp(reply.sessions[0].name, "x") == 0,
		      "the list after the open");
	wire_pb_response_free(&reply);
	for (int i = 0; i < n; i++)
		close(kept[i]);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* The first line of the log that has `event` (malloc'd), or NULL. */
static char *log_line(const struct daemon_harness *daemon, const char *event)
{
	size_t size;
	char *log = log_read(daemon, &size), *line = NULL;
	char *at = strstr(log, event);
	if (at) {
		char *start = at, *end = strchr(at, '\n');
		while (start > log && start[-1] != '\n')
			start--;
		line = strndup(start, end ? (size_t)(end - start) : strlen(start));
	}
	free(log);
	return line;
}

START_TEST(descriptor_limit_is_raised_and_said)
{
	static const char *const small[] = { "--max-connections", "100", "--max-sessions", "100",
					     "--log-level", "info", NULL };
	static const char *const big[] = { "--log-level", "info", NULL };
	struct daemon_harness daemon;
	char expected[128];
	struct options o;

	/* Soft 64, hard 4096: raised to 4096, which is enough for these limits. */
	daemon_start_with_nofile(&daemon, small, 64, 4096);
	ck_assert_uint_eq(proc_number(daemon.pid, "limits", "Max open files", 0), 4096);
	char *line = log_line(&daemon, "event=\"descriptor limit\"");
	ck_assert_msg(line && strstr(line, "soft=4096 hard=4096 soft_before=64"), "%s", line);
	free(line);
	ck_assert_ptr_null(log_line(&daemon, "below what the limits need"));
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);

	/* A hard limit below what the default limits need: said at start. */
	options_default(&o);
	snprintf(o.metrics_listen, sizeof(o.metrics_listen), "off");
	daemon_start_with_nofile(&daemon, big, 64, 256);
	line = log_line(&daemon, "below what the limits need");
	snprintf(expected, sizeof(expected), "limit=256 needed=%llu",
		 (unsigned long long)resources_descriptors_needed(&o));
	ck_assert_msg(line && strstr(line, expected), "no warning with '%s': %s", expected, line);
	free(line);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);

	/* --help says what the flags given with it need. */
	char *argv[] = { "zipcached", "--max-connections", "10", "--max-sessions", "20",
			 "--metrics-listen", "off", NULL };
	options_default(&o);
	ck_assert_int_eq(options_parse(&o, 7, argv), 0);
	const char *help[] = { daemon_binary_path(), "--max-connections", "10", "--max-sessions", "20",
			       "--metrics-listen", "off", "--help", NULL };
	char out[16384], err[1024];
	int status;
	ck_assert_int_eq(program_run(help, &status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_int_eq(status, 0);
	snprintf(expected, sizeof(expected), "descriptors needed       %llu (",
		 (unsigned long long)resources_descriptors_needed(&o));
	ck_assert_msg(strstr(out, expected), "--help lacks '%s':\n%s", expected, out);
}
END_TEST

/* ======================================================================
 * Memory.
 * ====================================================================== */

START_TEST(staging_buffers_are_charged_to_the_budget)
{
	static const char *const args[] = { "--memory-budget", "8M", "--max-staging-bytes", "16M", NULL };
	struct daemon_harness daemon;
	wire_pb_response reply;
	int rc;

	daemon_start(&daemon, args);
	int a = raw_connect(daemon.socket_path), b = raw_connect(daemon.socket_path);
	int control = raw_connect(daemon.socket_path);
	ck_assert(a >= 0 && b >= 0 && control >= 0);

	rc = staging_raw(a, 4 * MIB, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "4M: %s", reply.msg.message);
	wire_pb_response_free(&reply);
	zipcache_v1_StatsResponse s = daemon_stats(control);
	ck_assert_uint_eq(s.staging_bytes, 4 * MIB);
	ck_assert_uint_eq(s.memory_used_bytes, 4 * MIB);
	/* Every connection here is root's: its own figure is the same. */
	ck_assert_uint_eq(s.caller.staging_bytes, 4 * MIB);
	ck_assert(s.daemon_wide);

	/* 4M + 6M is past the 8M budget: refused, naming it. */
	rc = staging_raw(b, 6 * MIB, &reply);
	assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "memory budget",
		       "a second buffer past the budget");
	ck_assert_uint_eq(daemon_stats(control).staging_bytes, 4 * MIB);

	/* A replaced buffer gives its charge back. */
	rc = staging_raw(a, 2 * MIB, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "2M: %s", reply.msg.message);
	wire_pb_response_free(&reply);
	ck_assert_uint_eq(daemon_stats(control).staging_bytes, 2 * MIB);
	rc = staging_raw(b, 6 * MIB, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "6M: %s", reply.msg.message);
	wire_pb_response_free(&reply);
	s = daemon_stats(control);
	ck_assert_uint_eq(s.staging_bytes, 8 * MIB);
	ck_assert_uint_eq(s.memory_used_bytes, 8 * MIB);

	/* Staging holds the whole budget: no room for a session either. */
	rc = open_raw(control, "s", 1, &reply);
	assert_refusal(rc, &reply, zipcache_v1_Status_RESOURCE_EXHAUSTED, "budget",
		       "a session while staging holds the budget");

	/* A connection that goes gives its buffer back. */
	close(a);
	int64_t deadline = now_ms() + DEADLINE_MS;
	while ((s = daemon_stats(control)).staging_bytes != 6 * MIB) {
		ck_assert_msg(now_ms() < deadline, "staging bytes %" PRIu64 " after a client left",
			      (uint64_t)s.staging_bytes);
		sleep_ms(10);
	}
	rc = open_raw(control, "s", 1, &reply);
	ck_assert_msg(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "open: %s", reply.msg.message);
	wire_pb_response_free(&reply);
	close(b);
	wait_connections(control, 1);
	s = daemon_stats(control);
	ck_assert_uint_eq(s.staging_bytes, 0);
	ck_assert_msg(s.memory_used_bytes > 0 && s.memory_used_bytes < 2 * MIB,
		      "%" PRIu64 " bytes in use with one small session", (uint64_t)s.memory_used_bytes);
	close(control);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Writes `count` stats requests for session_id without reading a reply
 * (as many as the socket takes without blocking). */
static void flood_stats(int fd, uint64_t session_id, int count)
{
	size_t capacity = (size_t)count * 32, used = 0;
	uint8_t *bytes = malloc(capacity);
	ck_assert_ptr_nonnull(bytes);
	for (int i = 0; i < count; i++) {
		wire_pb_request request = { 0 };
		size_t len;
		request.msg.request_id = 1000 + (uint64_t)i;
		request.msg.which_op = zipcache_v1_Request_stats_tag;
		request.msg.op.stats.session_id = session_id;
		ck_assert_int_eq(wire_pb_request_encode(&request, bytes + used, capacity - used, &len), 0);
		used += len;
	}
	ck_assert_int_eq(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK), 0);
	for (size_t sent = 0; sent < used;) {
		ssize_t n = send(fd, bytes + sent, used - sent, MSG_NOSIGNAL);
		if (n <= 0)
			break;
		sent += (size_t)n;
	}
	free(bytes);
}

/* Waits until the daemon's queued reply bytes reach at least `low`,
 * checking on every sample that they never pass `high`. */
static uint64_t wait_queue(int control, uint64_t low, uint64_t high, const char *what)
{
	int64_t deadline = now_ms() + DEADLINE_MS;
	for (;;) {
		zipcache_v1_StatsResponse s = daemon_stats(control);
		ck_assert_msg(s.reply_queue_bytes <= high, "%s: %" PRIu64 " reply bytes queued, bound %" PRIu64,
			      what, (uint64_t)s.reply_queue_bytes, high);
		ck_assert_msg(s.memory_used_bytes >= s.reply_queue_bytes,
			      "%s: queued replies are not charged (%" PRIu64 " in use, %" PRIu64 " queued)",
			      what, (uint64_t)s.memory_used_bytes, (uint64_t)s.reply_queue_bytes);
		if (s.reply_queue_bytes >= low)
			return s.reply_queue_bytes;
		ck_assert_msg(now_ms() < deadline, "%s: only %" PRIu64 " reply bytes queued in %d ms",
			      what, (uint64_t)s.reply_queue_bytes, DEADLINE_MS);
		sleep_ms(20);
	}
}

START_TEST(unread_replies_are_bounded_charged_and_freed)
{
	enum { LAYERS = 512, FLOODERS = 4, REQUESTS = 4000 };
	static const char *const args[] = { "--max-reply-queue-bytes", "4M", "--max-reply-queue-total",
					    "12M", NULL };
	const uint64_t per_connection = 4 * MIB, total = 12 * MIB;
	struct daemon_harness daemon;
	zc_session_config config;
	zc_session *session;
	zc_client *client;
	wire_pb_response reply;
	uint16_t kv[8];
	zc_view view;
	int flooders[FLOODERS];

	daemon_start(&daemon, args);
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	zc_session_config_default(&config);
	config.name = "wide";
	config.layers = LAYERS;
	config.batch = config.kv_heads = 1;
	config.head_dim_k = config.head_dim_v = 8;
	config.max_tokens = 64;
	ck_assert_int_eq(zc_session_open(client, &config, &session), 0);
	for (int i = 0; i < 8; i++)
		kv[i] = (uint16_t)(0x3c00 + i);   /* 1.0 and a little more */
	for (uint32_t layer = 0; layer < LAYERS; layer++)
		ck_assert_int_eq(zc_update_and_fetch(session, layer, 1, kv, kv, &view, NULL), 0);
	uint64_t id = zc_session_get_info(session)->id;
	int control = raw_connect(daemon.socket_path);
	ck_assert_int_ge(control, 0);
	ck_assert_int_eq(stats_raw(control, id, &reply), 0);
	size_t reply_bytes = 0;
	ck_assert_int_eq(wire_pb_response_frame_size(&reply, &reply_bytes), 0);
	wire_pb_response_free(&reply);
	/* A reply may still land on a queue at its bound, and a paused
	 * connection's requests in flight may add theirs (at most 8). */
	const uint64_t slack = 9 * (uint64_t)reply_bytes + 64 * 1024;
	uint64_t rss_before = rss_bytes(daemon.pid);

	/* One client that never reads: held at its own bound. */
	flooders[0] = raw_connect(daemon.socket_path);
	flood_stats(flooders[0], id, REQUESTS);
	uint64_t one = wait_queue(control, per_connection - reply_bytes, per_connection + slack,
				  "one client not reading");
	/* More of them: held at the total, while others are still served. */
	for (int i = 1; i < FLOODERS; i++) {
		flooders[i] = raw_connect(daemon.socket_path);
		flood_stats(flooders[i], id, REQUESTS);
	}
	uint64_t all = wait_queue(control, total - FLOODERS * (uint64_t)reply_bytes,
				  total + FLOODERS * slack, "four clients not reading");
	sleep_ms(300);
	all = wait_queue(control, 0, total + FLOODERS * slack, "four clients, a while later");
	/* A client that reads is still served; what it opens now lives on
	 * above the queued replies in the heap (so only giving back the free
	 * pages in the middle of it brings the RSS down). */
	zc_layer_stats served;
	zc_session *later;
	ck_assert_int_eq(zc_session_stats(session, NULL, 0, &served), 0);
	config.name = "opened-while-full";
	ck_assert_int_eq(zc_session_open(client, &config, &later), 0);
	uint64_t rss_peak = rss_bytes(daemon.pid);

	for (int i = 0; i < FLOODERS; i++)
		close(flooders[i]);
	wait_connections(control, 2);
	zipcache_v1_StatsResponse s = daemon_stats(control);
	ck_assert_uint_eq(s.reply_queue_bytes, 0);
	uint64_t rss_after = rss_bytes(daemon.pid);
	fprintf(stderr, "reply queues: %zu-byte replies; one client held at %" PRIu64 " bytes, four at %"
		PRIu64 "; daemon RSS %" PRIu64 " KiB before, %" PRIu64 " at the peak, %" PRIu64 " after\n",
		reply_bytes, one, all, rss_before >> 10, rss_peak >> 10, rss_after >> 10);
#ifndef __SANITIZE_ADDRESS__
	/* ASan's allocator keeps freed memory in quarantine: only a plain
	 * build can show the memory going back. */
	ck_assert_msg(rss_after <= rss_before + 8 * MIB,
		      "RSS %" PRIu64 " KiB after the clients left, %" PRIu64 " before (peak %" PRIu64 ")",
		      rss_after >> 10, rss_before >> 10, rss_peak >> 10);
#endif
	close(control);
	ck_assert_int_eq(zc_session_close(later), 0);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

START_TEST(default_budget_is_derived_from_the_host)
{
	static const char *const info[] = { "--log-level", "info", NULL };
	static const char *const none[] = { "--memory-budget", "0", "--log-level", "info", NULL };
	struct daemon_harness daemon;
	struct statfs fs;
	char path[64], expected[160];
	zc_client *client;

	daemon_start(&daemon, info);
	ck_assert_int_eq(statfs(daemon.shm_dir, &fs), 0);
	snprintf(path, sizeof(path), "/proc/%d/cgroup", (int)daemon.pid);
	uint64_t fs_bytes = (uint64_t)fs.f_blocks * (uint64_t)fs.f_bsize;
	uint64_t cgroup = resources_cgroup_memory_limit(path, "/sys/fs/cgroup");
	uint64_t want = resources_budget_from(fs_bytes, cgroup);
	ck_assert_msg(want > 0, "nothing to derive a budget from on this machine");
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	ck_assert_uint_eq(zc_client_server_info(client)->memory_budget_bytes, want);
	zc_client_close(client);
	char *line = log_line(&daemon, "event=\"memory budget derived\"");
	snprintf(expected, sizeof(expected), "budget=%llu shm_fs_bytes=%llu", (unsigned long long)want,
		 (unsigned long long)fs_bytes);
	ck_assert_msg(line && strstr(line, expected), "no '%s' in: %s", expected, line);
	free(line);
	/* Each uid's quota is half of it. */
	line = log_line(&daemon, "event=\"per-uid quotas\"");
	snprintf(expected, sizeof(expected), "memory=%llu", (unsigned long long)((want + 1) / 2));
	ck_assert_msg(line && strstr(line, expected), "no '%s' in: %s", expected, line);
	free(line);
	fprintf(stderr, "default budget: %llu bytes from a %llu-byte file system and cgroup limit %llu\n",
		(unsigned long long)want, (unsigned long long)fs_bytes, (unsigned long long)cgroup);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);

	/* An explicit 0: no budget, nothing derived. */
	daemon_start(&daemon, none);
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	ck_assert_uint_eq(zc_client_server_info(client)->memory_budget_bytes, 0);
	zc_client_close(client);
	ck_assert_ptr_null(log_line(&daemon, "memory budget derived"));
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ======================================================================
 * Users.
 * ====================================================================== */

struct as_user {
	const char *socket_path;
	uid_t uid;
};

/* A one-layer session with head dims 64 and kv_heads heads. */
static int helper_open(zc_client *client, const char *name, uint32_t kv_heads, zc_session **out)
{
	zc_session_config config;
	zc_session_config_default(&config);
	config.name = name;
	config.layers = 1;
	config.batch = 1;
	config.kv_heads = kv_heads;
	config.head_dim_k = config.head_dim_v = 64;
	config.max_tokens = 4096;
	return zc_session_open(client, &config, out);
}

/* Uid A at every quota: connections, sessions, staging, memory. */
static int quota_body_a(void *arg)
{
	const struct as_user *user = arg;
	char why[256];
	zc_client *client;
	zc_session *sessions[4];
	wire_pb_response reply;
	int raw[3], rc;

	CHILD_EXPECT(user_become(user->uid, USER_GID, why, sizeof(why)), "%s", why);
	CHILD_EXPECT(zc_client_connect(user->socket_path, 10000, &client) == 0, "connect");
	for (int i = 0; i < 3; i++) {
		raw[i] = raw_connect(user->socket_path);
		CHILD_EXPECT(raw[i] >= 0 && stats_raw(raw[i], 0, &reply) == 0 &&
				     reply.msg.status == zipcache_v1_Status_OK,
			     "connection %d of 4", i + 2);
		wire_pb_response_free(&reply);
	}
	/* The fifth connection of this uid. */
	int fifth = raw_connect(user->socket_path);
	rc = stats_raw(fifth, 0, &reply);
	CHILD_EXPECT(rc == 0 && reply.msg.status == zipcache_v1_Status_RESOURCE_EXHAUSTED &&
			     strstr(reply.msg.message, "per uid"),
		     "fifth connection: %s '%s'", response_status_name(reply.msg.status), reply.msg.message);
	wire_pb_response_free(&reply);
	close(fifth);

	/* Three sessions of six. */
	for (int i = 0; i < 3; i++) {
		char name[16];
		snprintf(name, sizeof(name), "a%d", i);
		CHILD_EXPECT(helper_open(client, name, 8, &sessions[i]) == 0, "session %d: %s", i,
			     zc_client_last_error(client));
	}
	rc = helper_open(client, "a3", 8, &sessions[3]);
	CHILD_EXPECT(rc == ZC_EEXHAUSTED && strstr(zc_client_last_error(client), "per uid"),
		     "fourth session: %s '%s'", zc_error_name(rc), zc_client_last_error(client));

	/* Staging: 4M of a 5M staging quota, then 2M more is refused by it. */
	rc = staging_raw(raw[0], 4 * MIB, &reply);
	CHILD_EXPECT(rc == 0 && reply.msg.status == zipcache_v1_Status_OK, "4M staging: %s", reply.msg.message);
	wire_pb_response_free(&reply);
	rc = staging_raw(raw[1], 2 * MIB, &reply);
	CHILD_EXPECT(rc == 0 && reply.msg.status == zipcache_v1_Status_RESOURCE_EXHAUSTED &&
			     strstr(reply.msg.message, "staging quota"),
		     "2M more staging: %s '%s'", response_status_name(reply.msg.status), reply.msg.message);
	wire_pb_response_free(&reply);

	/* Memory: the 6M quota, of which staging holds 4M, ends a session's growth. */
	/* 256 tokens of 8 heads: 512 KiB of views a block. */
	const size_t elements = 8 * 256 * 64;
	uint16_t *kv = calloc(elements, sizeof(*kv));
	CHILD_EXPECT(kv != NULL, "calloc");
	for (size_t i = 0; i < elements; i++)
		kv[i] = (uint16_t)(0x3c00 + i % 97);
	zc_view view;
	int stored = 0;
	for (; stored < 16; stored++) {
		rc = zc_update_and_fetch(sessions[0], 0, 256, kv, kv, &view, NULL);
		if (rc < 0)
			break;
	}
	CHILD_EXPECT(rc == ZC_EEXHAUSTED && strstr(zc_client_last_error(client), "memory quota") &&
			     strstr(zc_client_last_error(client), "uid"),
		     "after %d blocks: %s '%s'", stored, zc_error_name(rc), zc_client_last_error(client));
	free(kv);

	/* Stats as this uid: its own figures and quotas. */
	zc_uid_stats own;
	zc_server_stats stats;
	CHILD_EXPECT(zc_client_uid_stats(client, &own, &stats, NULL) == 0, "uid stats");
	CHILD_EXPECT(own.uid == user->uid && !own.daemon_wide, "uid %u, daemon_wide %d", own.uid,
		     own.daemon_wide);
	CHILD_EXPECT(own.sessions == 3 && own.max_sessions == 3, "sessions %u of %u", own.sessions,
		     own.max_sessions);
	CHILD_EXPECT(own.connections == 4 && own.max_connections == 4, "connections %u of %u",
		     own.connections, own.max_connections);
	/* The 4M buffer, and the one the client library took for its blocks. */
	CHILD_EXPECT(own.staging_bytes >= 4 * MIB && own.staging_bytes <= 5 * MIB &&
			     own.max_staging_bytes == 5 * MIB,
		     "staging %" PRIu64 " of %" PRIu64, own.staging_bytes, own.max_staging_bytes);
	CHILD_EXPECT(own.memory_budget_bytes == 6 * MIB && own.memory_used_bytes > 4 * MIB &&
			     own.memory_used_bytes <= 6 * MIB,
		     "memory %" PRIu64 " of %" PRIu64, own.memory_used_bytes, own.memory_budget_bytes);
	CHILD_EXPECT(stats.sessions == 3 && stats.memory_used_bytes == own.memory_used_bytes,
		     "the totals are not this uid's own: %u sessions, %" PRIu64 " bytes", stats.sessions,
		     stats.memory_used_bytes);
	for (int i = 0; i < 3; i++) {
		zc_session_release(sessions[i]);
		close(raw[i]);
	}
	zc_client_close(client);
	return 0;
}

/* Uid B, after A filled its quotas: B is not locked out. */
static int quota_body_b(void *arg)
{
	const struct as_user *user = arg;
	char why[256];
	zc_client *client;
	zc_session *sessions[3];

	CHILD_EXPECT(user_become(user->uid, USER_GID, why, sizeof(why)), "%s", why);
	CHILD_EXPECT(zc_client_connect(user->socket_path, 10000, &client) == 0, "connect");
	for (int i = 0; i < 3; i++) {
		char name[16];
		snprintf(name, sizeof(name), "b%d", i);
		CHILD_EXPECT(helper_open(client, name, 1, &sessions[i]) == 0, "B's session %d: %s", i,
			     zc_client_last_error(client));
	}
	zc_uid_stats own;
	zc_server_stats stats;
	CHILD_EXPECT(zc_client_uid_stats(client, &own, &stats, NULL) == 0, "uid stats");
	CHILD_EXPECT(own.sessions == 3 && stats.sessions == 3 && own.staging_bytes == 0,
		     "B sees %u own sessions, %u in total, %" PRIu64 " staging", own.sessions,
		     stats.sessions, own.staging_bytes);
	for (int i = 0; i < 3; i++)
		zc_session_release(sessions[i]);
	zc_client_close(client);
	return 0;
}

START_TEST(per_uid_quotas_keep_one_user_from_locking_out_others)
{
	static const char *const args[] = {
		"--socket-mode", "0666", "--max-sessions", "6", "--max-connections-per-uid", "4",
		"--memory-budget", "256M", "--memory-budget-per-uid", "6M", "--max-staging-bytes", "4M",
		"--max-staging-bytes-per-uid", "5M", NULL
	};
	struct daemon_harness daemon;
	zc_client *client;
	zc_session *session;

	daemon_start(&daemon, args);
	if (!other_users_possible(daemon.dir)) {
		daemon_stop(&daemon);
		daemon_cleanup(&daemon);
		return;
	}
	ck_assert_int_eq(chmod(daemon.dir, 0755), 0);
	struct as_user a = { daemon.socket_path, USER_A }, b = { daemon.socket_path, USER_B };
	child_wait_ok(child_spawn(quota_body_a, &a, -1), "uid A at its quotas");
	child_wait_ok(child_spawn(quota_body_b, &b, -1), "uid B after A");

	/* Six sessions in all now: the daemon-wide limit holds for root too,
	 * and root sees them all. */
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	ck_assert_int_eq(helper_open(client, "root", 1, &session), ZC_EEXHAUSTED);
	ck_assert_msg(strstr(zc_client_last_error(client), "session limit of 6"), "%s",
		      zc_client_last_error(client));
	zc_uid_stats own;
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_uid_stats(client, &own, &stats, NULL), 0);
	ck_assert(own.daemon_wide);
	ck_assert_uint_eq(stats.sessions, 6);
	ck_assert_uint_eq(own.sessions, 0);
	ck_assert_uint_eq(own.max_sessions, 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Another uid: the stats it sees are its own, the session's too, and
 * zipcachectl says so. */
static int visibility_body(void *arg)
{
	const struct as_user *user = arg;
	char why[256], ctl[PATH_MAX], out[8192], err[1024];
	zc_client *client;
	zc_session *session;
	wire_pb_response reply;
	zc_view view;
	uint16_t kv[7 * 64];
	int status;

	CHILD_EXPECT(user_become(user->uid, USER_GID, why, sizeof(why)), "%s", why);
	CHILD_EXPECT(zc_client_connect(user->socket_path, 10000, &client) == 0, "connect");
	CHILD_EXPECT(helper_open(client, "mine", 1, &session) == 0, "open: %s", zc_client_last_error(client));
	for (int i = 0; i < 7 * 64; i++)
		kv[i] = (uint16_t)(0x3c00 + i % 31);
	CHILD_EXPECT(zc_update_and_fetch(session, 0, 7, kv, kv, &view, NULL) == 0, "update");
	zc_uid_stats own;
	zc_server_stats stats;
	CHILD_EXPECT(zc_client_uid_stats(client, &own, &stats, NULL) == 0, "stats");
	CHILD_EXPECT(!own.daemon_wide && own.uid == user->uid, "daemon_wide %d uid %u", own.daemon_wide,
		     own.uid);
	CHILD_EXPECT(stats.sessions == 1 && stats.connections == 1 && stats.tokens_appended == 7,
		     "sees %u sessions, %u connections, %" PRIu64 " tokens: not its own", stats.sessions,
		     stats.connections, stats.tokens_appended);
	/* hello, open, update, stats: its own requests, none of root's. */
	CHILD_EXPECT(stats.requests == 4 && stats.request_errors == 0, "sees %" PRIu64 " requests, %"
		     PRIu64 " errors", stats.requests, stats.request_errors);
	CHILD_EXPECT(stats.memory_used_bytes == own.memory_used_bytes && own.memory_used_bytes > 0,
		     "memory %" PRIu64 " vs its own %" PRIu64, stats.memory_used_bytes, own.memory_used_bytes);

	/* A session's stats carry the same figures. */
	int raw = raw_connect(user->socket_path);
	CHILD_EXPECT(raw >= 0 && stats_raw(raw, zc_session_get_info(session)->id, &reply) == 0 &&
			     reply.msg.status == zipcache_v1_Status_OK,
		     "session stats");
	CHILD_EXPECT(!reply.msg.op.stats.daemon_wide && reply.msg.op.stats.sessions == 1 &&
			     reply.msg.op.stats.tokens_appended == 7 && reply.msg.op.stats.connections == 2,
		     "session stats show %u sessions, %" PRIu64 " tokens, %u connections",
		     reply.msg.op.stats.sessions, (uint64_t)reply.msg.op.stats.tokens_appended,
		     reply.msg.op.stats.connections);
	wire_pb_response_free(&reply);
	close(raw);

	snprintf(ctl, sizeof(ctl), "%s/bin/zipcachectl", build_dir());
	const char *argv[] = { ctl, "--socket", user->socket_path, "stats", NULL };
	CHILD_EXPECT(program_run(argv, &status, out, sizeof(out), err, sizeof(err)) == 0 && status == 0,
		     "zipcachectl stats: status %d: %s", status, err);
	CHILD_EXPECT(strstr(out, "your uid's own") && strstr(out, "1 of 512"),
		     "zipcachectl stats as uid %u:\n%s", (unsigned)user->uid, out);
	zc_session_release(session);
	zc_client_close(client);
	return 0;
}

START_TEST(other_users_see_their_own_figures)
{
	static const char *const args[] = { "--socket-mode", "0666", NULL };
	struct daemon_harness daemon;
	zc_client *client;
	zc_session *sessions[2];
	zc_view view;
	uint16_t kv[10 * 64];

	daemon_start(&daemon, args);
	if (!other_users_possible(daemon.dir)) {
		daemon_stop(&daemon);
		daemon_cleanup(&daemon);
		return;
	}
	ck_assert_int_eq(chmod(daemon.dir, 0755), 0);
	ck_assert_int_eq(zc_client_connect(daemon.socket_path, 10000, &client), 0);
	for (int i = 0; i < 10 * 64; i++)
		kv[i] = (uint16_t)(0x3800 + i % 13);
	ck_assert_int_eq(helper_open(client, "root-0", 1, &sessions[0]), 0);
	ck_assert_int_eq(helper_open(client, "root-1", 1, &sessions[1]), 0);
	ck_assert_int_eq(zc_update_and_fetch(sessions[0], 0, 10, kv, kv, &view, NULL), 0);

	struct as_user a = { daemon.socket_path, USER_A };
	child_wait_ok(child_spawn(visibility_body, &a, -1), "another uid's stats");

	/* Root sees the daemon: both users' sessions and tokens. */
	zc_uid_stats own;
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_uid_stats(client, &own, &stats, NULL), 0);
	ck_assert(own.daemon_wide);
	ck_assert_uint_eq(stats.sessions, 3);
	ck_assert_uint_eq(own.sessions, 2);
	ck_assert_uint_eq(stats.tokens_appended, 17);
	ck_assert_uint_ge(stats.memory_used_bytes, own.memory_used_bytes);
	zc_session_release(sessions[0]);
	zc_session_release(sessions[1]);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static Suite *limits_suite(void)
{
	Suite *suite = suite_create("limits");
	const struct test_case cases[] = {
		{ "descriptors", { accept_at_the_descriptor_limit_neither_spins_nor_floods,
				   open_at_the_descriptor_limit_leaves_nothing_behind,
				   descriptor_limit_is_raised_and_said, NULL } },
		{ "memory", { staging_buffers_are_charged_to_the_budget,
			      unread_replies_are_bounded_charged_and_freed,
			      default_budget_is_derived_from_the_host, NULL } },
		{ "users", { per_uid_quotas_keep_one_user_from_locking_out_others,
			     other_users_see_their_own_figures, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	/* Each test owns its daemon and helper processes: fork mode. */
	return suite_main(limits_suite(), CK_FORK);
}
