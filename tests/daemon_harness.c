/*
 * The integration-test harness (see daemon_harness.h): fork + exec of the
 * real zipcached on a private directory, a bounded wait for its socket, a
 * checked SIGTERM stop, and raw socket I/O for hand-made frames.
 */
#include "daemon_harness.h"
#include "process_run.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"
#include "zipcache/error.h"

/* Under ASan the daemon takes a while to start; 10 s is far beyond a
 * healthy start and short enough that a hang fails the test, not the run. */
#define START_TIMEOUT_MS 10000

/* The daemon gives in-flight work 10 s on SIGTERM; past 20 s it is stuck. */
#define STOP_TIMEOUT_MS 20000

/* Largest reply frame the raw reader accepts (a stats reply for 1024
 * layers is far below this). */
#define RAW_MAX_REPLY_BYTES (16u << 20)

/* ---- cleanup after a failed test ------------------------------------------ */

/*
 * A failed ck_assert leaves the test process at once (Check's _exit, or
 * SIGKILL on a timeout), past any code that would stop the daemon and
 * remove its directory. The daemon dies with the test process (it has
 * PR_SET_PDEATHSIG, and Check kills the test's process group), but the
 * directory would stay in /tmp. So each directory gets a janitor: a
 * process outside the test's process group, blocked on a pipe whose only
 * write end the test process holds (close-on-exec keeps it out of the
 * daemon). End of stream means the test process and every helper it
 * forked are gone, or daemon_cleanup() closed it: the janitor removes the
 * directory, if still there, and exits.
 */

/* Returns the write end the test process keeps, or -1 if no janitor
 * could be started (the test still runs; only cleanup after a failure is
 * lost). */
static int janitor_start(const char *dir)
{
	int fds[2];
	pid_t pid;

	if (pipe2(fds, O_CLOEXEC) < 0)
		return -1;
	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (pid == 0) {
		char byte;

		/* Out of the test's process group, which Check kills; and
		 * holding none of the test's descriptors (a copy of a client
		 * socket would keep that connection open). */
		setpgid(0, 0);
		for (int fd = 3; fd < 4096; fd++)
			if (fd != fds[0])
				close(fd);
		for (;;) {
			ssize_t n = read(fds[0], &byte, 1);
			if (n == 0 || (n < 0 && errno != EINTR))
				break;
		}
		directory_remove(dir);
		_exit(0);
	}
	close(fds[0]);
	return fds[1];
}

/* ---- starting and stopping ------------------------------------------------ */

const char *daemon_binary_path(void)
{
	static char path[PATH_MAX];

	snprintf(path, sizeof(path), "%s/bin/zipcached", build_dir());
	return path;
}

const char *daemon_log_tail(const struct daemon_harness *daemon, char *buffer, size_t size)
{
	FILE *log = fopen(daemon->log_path, "r");
	size_t n = 0;

	buffer[0] = '\0';
	if (!log)
		return buffer;
	if (fseek(log, 0, SEEK_END) == 0) {
		long end = ftell(log);
		long start = end > (long)size - 1 ? end - ((long)size - 1) : 0;
		fseek(log, start, SEEK_SET);
	}
	n = fread(buffer, 1, size - 1, log);
	buffer[n] = '\0';
	fclose(log);
	return buffer;
}

/*
 * Whether the daemon binary knows a flag, by looking for its name in the
 * executable (cheaper than running --help for every start). Used for
 * --metrics-listen: each test's daemon must not compete for the default
 * metrics port with the others (tests of the endpoint pass their own
 * --metrics-listen, which comes later on the command line and wins).
 */
static bool binary_mentions(const char *path, const char *text)
{
	static char cached_path[PATH_MAX];
	static char cached_text[64];
	static bool cached_answer;
	size_t text_len = strlen(text), n;
	char *contents = NULL;
	bool found = false;
	FILE *file;
	long size;

	if (strcmp(cached_path, path) == 0 && strcmp(cached_text, text) == 0)
		return cached_answer;
	file = fopen(path, "rb");
	if (!file)
		return false;
	if (fseek(file, 0, SEEK_END) == 0 && (size = ftell(file)) > 0 && fseek(file, 0, SEEK_SET) == 0 &&
	    (contents = malloc((size_t)size)) != NULL) {
		n = fread(contents, 1, (size_t)size, file);
		found = memmem(contents, n, text, text_len) != NULL;
	}
	free(contents);
	fclose(file);
	snprintf(cached_path, sizeof(cached_path), "%s", path);
	snprintf(cached_text, sizeof(cached_text), "%s", text);
	cached_answer = found;
	return found;
}

/* Child side of the fork: becomes the daemon, never returns. */
static void daemon_exec(const struct daemon_harness *daemon, pid_t parent, bool metrics_off)
{
	const char *argv[10 + DAEMON_MAX_EXTRA_ARGS + 1];
	int argc = 0, fd;

	/* Die with the test process, whatever way it ends. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(127);
	fd = open("/dev/null", O_RDONLY);
	if (fd >= 0) {
		dup2(fd, STDIN_FILENO);
		close(fd);
	}
	fd = open(daemon->log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
	if (fd >= 0) {
		dup2(fd, STDOUT_FILENO);
		dup2(fd, STDERR_FILENO);
		close(fd);
	}
	if (daemon->nofile_hard) {
		struct rlimit limit = { .rlim_cur = daemon->nofile_soft, .rlim_max = daemon->nofile_hard };
		if (setrlimit(RLIMIT_NOFILE, &limit) < 0) {
			fprintf(stderr, "daemon_harness: setrlimit(RLIMIT_NOFILE, %lu, %lu): %s\n",
				daemon->nofile_soft, daemon->nofile_hard, strerror(errno));
			_exit(127);
		}
	}
	argv[argc++] = daemon_binary_path();
	argv[argc++] = "--socket";
	argv[argc++] = daemon->socket_path;
	argv[argc++] = "--shm-dir";
	argv[argc++] = daemon->shm_dir;
	argv[argc++] = "--log-level";
	argv[argc++] = "warn";
	if (metrics_off) {
		argv[argc++] = "--metrics-listen";
		argv[argc++] = "off";
	}
	for (int i = 0; i < daemon->n_extra_args; i++)
		argv[argc++] = daemon->extra_args[i];
	argv[argc] = NULL;
	execv(argv[0], (char *const *)argv);
	fprintf(stderr, "daemon_harness: cannot exec %s: %s\n", argv[0], strerror(errno));
	_exit(127);
}

/* Forks the daemon on the directory already in *daemon and waits until
 * its socket accepts. */
static void daemon_launch(struct daemon_harness *daemon)
{
	char tail[2048];
	pid_t parent = getpid();
	bool metrics_off;
	int64_t deadline;
	pid_t pid;

	ck_assert_msg(access(daemon_binary_path(), X_OK) == 0, "no daemon binary at %s: %s",
		      daemon_binary_path(), strerror(errno));
	metrics_off = binary_mentions(daemon_binary_path(), "--metrics-listen");
	fflush(NULL);
	pid = fork();
	ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0)
		daemon_exec(daemon, parent, metrics_off);
	daemon->pid = pid;

	deadline = now_ms() + START_TIMEOUT_MS;
	for (;;) {
		int status;

		if (waitpid(pid, &status, WNOHANG) == pid) {
			daemon->pid = 0;
			ck_abort_msg("zipcached exited during start-up (status 0x%x); log:\n%s", status,
				     daemon_log_tail(daemon, tail, sizeof(tail)));
		}
		/* The socket file alone is not enough: a stale one exists
		 * before the daemon replaces it. */
		if (socket_accepts(daemon->socket_path))
			return;
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, NULL, 0);
			daemon->pid = 0;
			ck_abort_msg("zipcached did not accept on %s within %d ms; log:\n%s",
				     daemon->socket_path, START_TIMEOUT_MS,
				     daemon_log_tail(daemon, tail, sizeof(tail)));
		}
		sleep_ms(5);
	}
}

/* Makes the directory and records the flags; the daemon is not started. */
static void daemon_prepare(struct daemon_harness *daemon, const char *const *extra_args)
{
	const char *base = getenv("TMPDIR");
	int length;

	memset(daemon, 0, sizeof(*daemon));
	/* Session files belong on tmpfs, as in production: elsewhere (a disk
	 * /tmp) page accounting and speed depend on the disk. The socket path
	 * must fit sun_path (108 bytes): fall back when TMPDIR is deep. */
	struct stat shm;
	if (!base || !*base || strlen(base) > 60)
		base = stat("/dev/shm", &shm) == 0 && S_ISDIR(shm.st_mode) ? "/dev/shm" : "/tmp";
	snprintf(daemon->dir, sizeof(daemon->dir), "%s/zc_service.XXXXXX", base);
	ck_assert_msg(mkdtemp(daemon->dir) != NULL, "mkdtemp %s: %s", daemon->dir, strerror(errno));
	daemon->janitor_fd = janitor_start(daemon->dir);
	length = snprintf(daemon->socket_path, sizeof(daemon->socket_path), "%s/z.sock", daemon->dir);
	ck_assert_msg(length > 0 && (size_t)length < sizeof(daemon->socket_path),
		      "socket path too long under %s", daemon->dir);
	snprintf(daemon->shm_dir, sizeof(daemon->shm_dir), "%s/shm", daemon->dir);
	snprintf(daemon->log_path, sizeof(daemon->log_path), "%s/daemon.log", daemon->dir);
	daemon_set_extra_args(daemon, extra_args);
}

void daemon_set_extra_args(struct daemon_harness *daemon, const char *const *extra_args)
{
	daemon->n_extra_args = 0;
	for (int i = 0; extra_args && extra_args[i]; i++) {
		ck_assert_msg(i < DAEMON_MAX_EXTRA_ARGS, "too many extra daemon flags");
		snprintf(daemon->extra_args[i], sizeof(daemon->extra_args[i]), "%s", extra_args[i]);
		daemon->n_extra_args = i + 1;
	}
}

int daemon_wait_exit(struct daemon_harness *daemon, int timeout_ms)
{
	int64_t deadline = now_ms() + timeout_ms;
	int status = 0;
	ck_assert_msg(daemon->pid > 0, "daemon_wait_exit without a running daemon");
	for (;;) {
		pid_t done = waitpid(daemon->pid, &status, WNOHANG);
		if (done == daemon->pid)
			break;
		ck_assert_msg(done == 0, "waitpid: %s", strerror(errno));
		if (now_ms() > deadline)
			return -1;
		sleep_ms(5);
	}
	daemon->pid = 0;
	return status;
}

void daemon_start(struct daemon_harness *daemon, const char *const *extra_args)
{
	daemon_prepare(daemon, extra_args);
	daemon_launch(daemon);
}

void daemon_start_with_nofile(struct daemon_harness *daemon, const char *const *extra_args,
			      unsigned long soft, unsigned long hard)
{
	daemon_prepare(daemon, extra_args);
	daemon->nofile_soft = soft;
	daemon->nofile_hard = hard;
	daemon_launch(daemon);
}

void daemon_restart(struct daemon_harness *daemon)
{
	ck_assert_msg(daemon->pid == 0, "daemon_restart while pid %d still runs", (int)daemon->pid);
	daemon_launch(daemon);
}

void daemon_stop(struct daemon_harness *daemon)
{
	char tail[2048];
	int64_t deadline = now_ms() + STOP_TIMEOUT_MS;
	pid_t pid = daemon->pid;
	int status = 0;

	ck_assert_msg(pid > 0, "daemon_stop without a running daemon");
	ck_assert_msg(kill(pid, SIGTERM) == 0, "kill(SIGTERM): %s", strerror(errno));
	for (;;) {
		pid_t done = waitpid(pid, &status, WNOHANG);
		if (done == pid)
			break;
		ck_assert_msg(done == 0, "waitpid: %s", strerror(errno));
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			daemon->pid = 0;
			ck_abort_msg("zipcached ignored SIGTERM for %d ms (killed); log:\n%s",
				     STOP_TIMEOUT_MS, daemon_log_tail(daemon, tail, sizeof(tail)));
		}
		sleep_ms(5);
	}
	daemon->pid = 0;
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "zipcached should exit 0 on SIGTERM, got %s %d; log:\n%s",
		      WIFEXITED(status) ? "exit status" : "signal",
		      WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
		      daemon_log_tail(daemon, tail, sizeof(tail)));
	ck_assert_msg(access(daemon->socket_path, F_OK) < 0 && errno == ENOENT,
		      "zipcached left its socket %s behind after SIGTERM", daemon->socket_path);
}

void daemon_kill(struct daemon_harness *daemon)
{
	ck_assert_msg(daemon->pid > 0, "daemon_kill without a running daemon");
	kill(daemon->pid, SIGKILL);
	waitpid(daemon->pid, NULL, 0);
	daemon->pid = 0;
}

void daemon_cleanup(struct daemon_harness *daemon)
{
	if (daemon->pid > 0) {
		kill(daemon->pid, SIGKILL);
		waitpid(daemon->pid, NULL, 0);
		daemon->pid = 0;
	}
	directory_remove(daemon->dir);
	if (daemon->janitor_fd > 0)
		close(daemon->janitor_fd);
	daemon->janitor_fd = -1;
	daemon->dir[0] = '\0';
}

/* Reads what a captured stream file holds into a NUL-terminated buffer. */
static void capture_read(FILE *file, char *out, size_t size)
{
	size_t n = 0;

	if (!out || size == 0)
		return;
	rewind(file);
	n = fread(out, 1, size - 1, file);
	out[n] = '\0';
}

int program_run(const char *const *argv, int *status, char *out, size_t out_size, char *err,
		size_t err_size)
{
	FILE *out_file = tmpfile(), *err_file = tmpfile();
	int64_t deadline = now_ms() + 20000;
	pid_t pid, parent = getpid();
	int rc = 0;

	if (!out_file || !err_file) {
		rc = -errno;
		goto out_close;
	}
	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		rc = -errno;
		goto out_close;
	}
	if (pid == 0) {
		int null = open("/dev/null", O_RDONLY);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		if (null >= 0)
			dup2(null, STDIN_FILENO);
		dup2(fileno(out_file), STDOUT_FILENO);
		dup2(fileno(err_file), STDERR_FILENO);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	for (;;) {
		pid_t done = waitpid(pid, status, WNOHANG);
		if (done == pid)
			break;
		if (done < 0) {
			rc = -errno;
			goto out_close;
		}
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, status, 0);
			rc = -ETIMEDOUT;
			goto out_close;
		}
		sleep_ms(2);
	}
	capture_read(out_file, out, out_size);
	capture_read(err_file, err, err_size);
out_close:
	if (out_file)
		fclose(out_file);
	if (err_file)
		fclose(err_file);
	return rc;
}

/* ---- raw socket ------------------------------------------------------------ */

const char *response_status_name(zipcache_v1_Status status)
{
	switch (status) {
	case zipcache_v1_Status_OK: return "OK";
	case zipcache_v1_Status_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
	case zipcache_v1_Status_NOT_FOUND: return "NOT_FOUND";
	case zipcache_v1_Status_ALREADY_EXISTS: return "ALREADY_EXISTS";
	case zipcache_v1_Status_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
	case zipcache_v1_Status_PERMISSION_DENIED: return "PERMISSION_DENIED";
	case zipcache_v1_Status_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
	case zipcache_v1_Status_INTERNAL: return "INTERNAL";
	case zipcache_v1_Status_DATA_LOSS: return "DATA_LOSS";
	case zipcache_v1_Status_UNAVAILABLE: return "UNAVAILABLE";
	}
	return "unknown status";
}

int raw_connect(const char *socket_path)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(socket_path) >= sizeof(address.sun_path))
		return -ENAMETOOLONG;
	memcpy(address.sun_path, socket_path, strlen(socket_path) + 1);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (connect(fd, (const struct sockaddr *)&address, sizeof(address)) < 0) {
		int rc = -errno;
		close(fd);
		return rc;
	}
	return fd;
}

int raw_send(int fd, const void *bytes, size_t len)
{
	const uint8_t *p = bytes;

	while (len > 0) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

/*
 * Reads exactly len bytes before the deadline, closing any descriptors
 * that ride along. Returns 0, -ECONNRESET at the end of the stream,
 * -ETIMEDOUT, or a negative errno.
 */
static int read_exact(int fd, uint8_t *buffer, size_t len, int64_t deadline)
{
	while (len > 0) {
		union {
			struct cmsghdr header;
			char bytes[CMSG_SPACE(sizeof(int) * 8)];
		} control;
		struct iovec iov = { buffer, len };
		struct msghdr message = {
			.msg_iov = &iov,
			.msg_iovlen = 1,
			.msg_control = control.bytes,
			.msg_controllen = sizeof(control.bytes),
		};
		int64_t left = deadline - now_ms();
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int ready;
		ssize_t n;

		if (left <= 0)
			return -ETIMEDOUT;
		ready = poll(&p, 1, (int)left);
		if (ready < 0 && errno == EINTR)
			continue;
		if (ready < 0)
			return -errno;
		if (ready == 0)
			return -ETIMEDOUT;
		n = recvmsg(fd, &message, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n < 0)
			return errno == ECONNRESET || errno == EPIPE ? -ECONNRESET : -errno;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c)) {
			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			for (int i = 0; i < count; i++) {
				int passed;
				memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				close(passed);
			}
		}
		if (n == 0)
			return -ECONNRESET;
		buffer += n;
		len -= (size_t)n;
	}
	return 0;
}

int raw_read_reply(int fd, int timeout_ms, wire_pb_response *reply, size_t *frame_bytes)
{
	int64_t deadline = now_ms() + timeout_ms;
	uint8_t header[FRAME_HEADER_BYTES];
	uint8_t *body;
	uint32_t len;
	int rc;

	memset(reply, 0, sizeof(*reply));
	rc = read_exact(fd, header, sizeof(header), deadline);
	if (rc < 0)
		return rc;
	len = frame_header_read(header);
	if (len > RAW_MAX_REPLY_BYTES)
		return ZC_EPROTOCOL;
	body = malloc(len ? len : 1);
	if (!body)
		return -ENOMEM;
	rc = read_exact(fd, body, len, deadline);
	if (rc == 0)
		rc = wire_pb_response_decode(body, len, reply);
	free(body);
	if (rc == 0 && frame_bytes)
		*frame_bytes = FRAME_HEADER_BYTES + len;
	return rc;
}

int raw_call(int fd, const wire_pb_request *request, wire_pb_response *reply, size_t *frame_bytes)
{
	size_t size, len;
	uint8_t *frame;
	int rc = wire_pb_request_frame_size(request, &size);

	memset(reply, 0, sizeof(*reply));
	if (rc < 0)
		return rc;
	frame = malloc(size);
	if (!frame)
		return -ENOMEM;
	rc = wire_pb_request_encode(request, frame, size, &len);
	if (rc == 0)
		rc = raw_send(fd, frame, len);
	free(frame);
	if (rc < 0)
		return rc;
	return raw_read_reply(fd, 10000, reply, frame_bytes);
}

bool raw_wait_closed(int fd, int timeout_ms)
{
	uint8_t byte;
	return read_exact(fd, &byte, 1, now_ms() + timeout_ms) == -ECONNRESET;
}

int raw_view_descriptor(const char *socket_path, const char *name)
{
	wire_pb_request request = { 0 };
	size_t size, len;
	uint8_t *frame;
	int sock = raw_connect(socket_path);
	if (sock < 0)
		return -1;
	request.msg.request_id = 77;
	request.msg.which_op = zipcache_v1_Request_open_session_tag;
	snprintf(request.msg.op.open_session.name, sizeof(request.msg.op.open_session.name), "%s",
		 name);
	request.msg.op.open_session.attach = true;
	if (wire_pb_request_frame_size(&request, &size) < 0 || !(frame = malloc(size)) ||
	    wire_pb_request_encode(&request, frame, size, &len) < 0 || raw_send(sock, frame, len) < 0) {
		close(sock);
		return -1;
	}
	free(frame);
	/* The descriptor rides the reply's first byte. */
	uint8_t bytes[4096];
	char control[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { bytes, sizeof(bytes) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
			      .msg_controllen = sizeof(control) };
	int fd = -1;
	if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) > 0) {
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		if (c && c->cmsg_type == SCM_RIGHTS)
			memcpy(&fd, CMSG_DATA(c), sizeof(fd));
	}
	close(sock);
	return fd;
}
