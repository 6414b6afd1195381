/* A benchmark's own zipcached, the echo peer, frame sizes, pinning and
 * statistics (bench_daemon.h). */
#include "bench_daemon.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Private, but only to size the raw baseline's frames exactly as the
 * daemon's are: a guessed size would bias the ratio. */
#include "frame.h"
#include "wire_pb.h"

#ifndef ZC_BUILD_DIR
#define ZC_BUILD_DIR "build"
#endif

/* Request ids this far into a run take two varint bytes, as they do for
 * most of the measured calls. */
#define TYPICAL_REQUEST_ID 10000u

/* Children and the directory, global so that a signal can clean up. */
static struct {
	const char *name;
	char dir[200];     /* short: the socket path must fit sun_path */
	char socket[PATH_MAX];
	char shm[PATH_MAX];
	volatile pid_t daemon;
	volatile pid_t echo;
	int echo_fd;
} harness = { .name = "bench", .echo_fd = -1 };

void bench_set_name(const char *name)
{
	harness.name = name;
}

const char *bench_name(void)
{
	return harness.name;
}

void bench_fail(const char *what, int rc)
{
	fprintf(stderr, "%s: %s: %s\n", harness.name, what, rc < 0 ? zc_strerror(rc) : "failed");
}

void bench_fail_client(zc_client *client, const char *what, int rc)
{
	const char *msg = client ? zc_client_last_error(client) : "";
	fprintf(stderr, "%s: %s: %s%s%s\n", harness.name, what, zc_strerror(rc), *msg ? ": " : "",
		msg);
}

int bench_daemon_path(const char *given, char *out, size_t len)
{
	if (given) {
		snprintf(out, len, "%s", given);
	} else {
		const char *build = getenv("ZC_BUILD_DIR");
		snprintf(out, len, "%s/bin/zipcached", build && *build ? build : ZC_BUILD_DIR);
	}
	if (access(out, X_OK) != 0) {
		fprintf(stderr, "%s: no daemon at %s (build it, or set ZC_BUILD_DIR)\n", harness.name,
			out);
		return -ENOENT;
	}
	return 0;
}

void *bench_alloc_touched(size_t bytes)
{
	size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded ? rounded : 64);
	if (p)
		memset(p, 0x5a, rounded);
	return p;
}

/* ---- timing and statistics --------------------------------------------- */

double bench_now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

double bench_percentile(double *v, size_t n, double p)
{
	qsort(v, n, sizeof *v, cmp_double);
	size_t rank = (size_t)ceil(p * (double)n);
	return v[rank ? rank - 1 : 0];
}

double bench_median(double *v, size_t n)
{
	qsort(v, n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- CPUs ----------------------------------------------------------------- */

int bench_pin(pid_t pid, int cpu)
{
	cpu_set_t set;
	if (cpu < 0)
		return 0;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	return sched_setaffinity(pid, sizeof set, &set) == 0 ? 0 : -errno;
}

void bench_choose_cpus(int *cpu, int *daemon_cpu)
{
	cpu_set_t set;
	int first = -1, second = -1;

	if (sched_getaffinity(0, sizeof set, &set) == 0) {
		for (int c = 0; c < CPU_SETSIZE; c++) {
			if (!CPU_ISSET(c, &set))
				continue;
			if (first < 0)
				first = c;
			else if (second < 0)
				second = c;
		}
	}
	if (*cpu < 0)
		*cpu = first;
	if (*daemon_cpu < 0)
		*daemon_cpu = second >= 0 && second != *cpu ? second : first != *cpu ? first : -1;
	if (*daemon_cpu == *cpu)
		*daemon_cpu = -1;
}

/* ---- the directory --------------------------------------------------------- */

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	remove(path);
	return 0;
}

void bench_dir_remove(void)
{
	if (harness.dir[0])
		nftw(harness.dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
	harness.dir[0] = '\0';
}

/*
 * Ctrl-C in the middle of a run: stop the children and remove the
 * directory. Only async-signal-safe calls (kill, waitpid, fork, execv,
 * _exit): the main flow may be inside malloc.
 */
static void on_signal(int sig)
{
	pid_t daemon = harness.daemon, echo = harness.echo;
	if (echo > 0)
		kill(echo, SIGKILL);
	if (daemon > 0) {
		kill(daemon, SIGKILL);
		waitpid(daemon, NULL, 0);
	}
	if (harness.dir[0]) {
		pid_t rm = fork();
		if (rm == 0) {
			char *argv[] = { "rm", "-rf", harness.dir, NULL };
			execv("/bin/rm", argv);
			_exit(127);
		}
		if (rm > 0)
			waitpid(rm, NULL, 0);
	}
	_exit(128 + sig);
}

int bench_dir_make(const char *tag)
{
	const char *bases[] = { "/dev/shm", getenv("TMPDIR"), "/tmp" };
	struct stat st;

	for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
		if (!bases[i] || stat(bases[i], &st) != 0 || !S_ISDIR(st.st_mode) ||
		    access(bases[i], W_OK) != 0)
			continue;
		snprintf(harness.dir, sizeof harness.dir, "%s/zc-%s-bench.XXXXXX", bases[i], tag);
		if (!mkdtemp(harness.dir)) {
			harness.dir[0] = '\0';
			continue;
		}
		snprintf(harness.socket, sizeof harness.socket, "%s/z.sock", harness.dir);
		snprintf(harness.shm, sizeof harness.shm, "%s/shm", harness.dir);
		/* sun_path holds 108 bytes. */
		if (strlen(harness.socket) >= 108) {
			rmdir(harness.dir);
			harness.dir[0] = '\0';
			continue;
		}
		struct sigaction sa = { .sa_handler = on_signal };
		sigemptyset(&sa.sa_mask);
		sigaction(SIGINT, &sa, NULL);
		sigaction(SIGTERM, &sa, NULL);
		sigaction(SIGHUP, &sa, NULL);
		return 0;
	}
	fprintf(stderr, "%s: cannot create a temporary directory\n", harness.name);
	return -ENOENT;
}

const char *bench_socket_path(void)
{
	return harness.socket;
}

const char *bench_shm_dir(void)
{
	return harness.shm;
}

/* ---- the daemon ------------------------------------------------------------ */

/* Whether `path --help` mentions `flag`: lets a benchmark drive both
 * older and newer daemons. */
static bool daemon_has_flag(const char *path, const char *flag)
{
	char command[PATH_MAX + 32], line[512];
	bool found = false;
	snprintf(command, sizeof command, "'%s' --help 2>/dev/null", path);
	FILE *f = popen(command, "r");
	if (!f)
		return false;
	while (fgets(line, sizeof line, f))
		if (strstr(line, flag))
			found = true;
	pclose(f);
	return found;
}

#define MAX_DAEMON_ARGS 32

/* The daemon's threads (and so the ones they make) on `count` of the
 * allowed CPUs (the benchmark's before it pinned itself), `avoid` (the
 * benchmark's) last; how many it got, 0 on failure. */
int bench_daemon_spread(pid_t pid, const cpu_set_t *allowed, int avoid, int count)
{
	cpu_set_t set;
	int got = 0;
	CPU_ZERO(&set);
	for (int c = 0; c < CPU_SETSIZE && got < count; c++)
		if (CPU_ISSET(c, allowed) && c != avoid) {
			CPU_SET(c, &set);
			got++;
		}
	/* Too few others: the benchmark's own too (it waits while the daemon
	 * exports or imports). */
	if (got < count && avoid >= 0 && CPU_ISSET(avoid, allowed)) {
		CPU_SET(avoid, &set);
		got++;
	}
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
	DIR *dir = opendir(path);
	struct dirent *entry;
	if (!dir || got == 0) {
		if (dir)
			closedir(dir);
		return 0;
	}
	while ((entry = readdir(dir)) != NULL) {
		pid_t tid = (pid_t)atoi(entry->d_name);
		if (tid > 0 && sched_setaffinity(tid, sizeof set, &set) != 0 && errno != ESRCH) {
			fprintf(stderr, "%s: sched_setaffinity of thread %d: %s\n", bench_name(),
				(int)tid, strerror(errno));
			got = 0;
		}
	}
	closedir(dir);
	return got;
}

int bench_daemon_start(const char *path, int cpu, const char *const *extra, zc_client **out)
{
	/* The metrics port is fixed by default: a second daemon on the
	 * machine (a test, a user's) would make ours log an error. */
	bool metrics_off = daemon_has_flag(path, "--metrics-listen");
	const char *argv[MAX_DAEMON_ARGS + 1];
	int n = 0;

	argv[n++] = "zipcached";
	argv[n++] = "--socket";
	argv[n++] = harness.socket;
	argv[n++] = "--shm-dir";
	argv[n++] = harness.shm;
	argv[n++] = "--log-level";
	argv[n++] = "warn";
	if (metrics_off) {
		argv[n++] = "--metrics-listen";
		argv[n++] = "off";
	}
	for (size_t i = 0; extra && extra[i]; i++) {
		if (n == MAX_DAEMON_ARGS)
			return -E2BIG;
		argv[n++] = extra[i];
	}
	argv[n] = NULL;

	pid_t pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		/* If the benchmark dies, so does its daemon. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		bench_pin(0, cpu);
		int null = open("/dev/null", O_WRONLY);
		if (null >= 0)
			dup2(null, STDOUT_FILENO); /* its "listening" line would break the table */
		execv(path, (char *const *)argv);
		fprintf(stderr, "%s: cannot run %s: %s\n", harness.name, path, strerror(errno));
		_exit(127);
	}
	harness.daemon = pid;

	/* Up to 10 s for the socket to answer hello. */
	double deadline = bench_now_s() + 10.0;
	int rc;
	for (;;) {
		int status;
		if (waitpid(pid, &status, WNOHANG) == pid) {
			harness.daemon = 0;
			fprintf(stderr, "%s: zipcached exited before listening (status %d)\n",
				harness.name, WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
			return ZC_EINTERNAL;
		}
		rc = zc_client_connect(harness.socket, 120000, out);
		if (rc == 0)
			return 0;
		if (bench_now_s() > deadline)
			return rc;
		usleep(10000);
	}
}

void bench_daemon_stop(void)
{
	pid_t pid = harness.daemon;
	int status;

	if (pid <= 0)
		return;
	kill(pid, SIGTERM);
	for (int i = 0; i < 1500; i++) {
		if (waitpid(pid, &status, WNOHANG) == pid) {
			harness.daemon = 0;
			if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
				fprintf(stderr, "%s: zipcached exited with status %d\n", harness.name,
					WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
			return;
		}
		usleep(10000);
	}
	fprintf(stderr, "%s: zipcached ignored SIGTERM for 15 s; killing it\n", harness.name);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	harness.daemon = 0;
}

pid_t bench_daemon_pid(void)
{
	return harness.daemon;
}

/* ---- the echo peer ----------------------------------------------------------- */

static int write_full(int fd, const uint8_t *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

/*
 * The raw baseline's peer: the least a server can do per request. Reads
 * like the daemon does (one recv into a buffer as big as it can take,
 * then whole frames out of it), and answers each frame with one whose
 * total size the request's first 4 body bytes name, so that the
 * benchmark picks the reply size after it has seen a real daemon reply.
 */
static void echo_serve(int fd, unsigned spin_us)
{
	size_t cap = 1u << 20, have = 0;
	uint8_t *in = malloc(cap), *out = calloc(1, cap);
	double spin_until = 0.0;

	if (!in || !out)
		_exit(1);
	for (;;) {
		ssize_t n = -1;
		errno = EAGAIN;
		while (spin_us > 0 && n < 0 && errno == EAGAIN && bench_now_s() < spin_until)
			n = recv(fd, in + have, cap - have, MSG_DONTWAIT);
		if (n < 0 && errno == EAGAIN)
			n = recv(fd, in + have, cap - have, 0);
		if (spin_us > 0)
			spin_until = bench_now_s() + spin_us * 1e-6;
		if (n == 0)
			_exit(0);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			_exit(1);
		}
		have += (size_t)n;
		size_t at = 0;
		while (have - at >= 8) {
			size_t len = frame_header_read(in + at);
			if (len + 4 > cap)
				_exit(1);
			if (have - at < 4 + len)
				break;
			uint32_t reply = frame_header_read(in + at + 4);
			if (reply < 4 || reply > cap)
				_exit(1);
			frame_header_write(out, reply - 4);
			if (write_full(fd, out, reply) < 0)
				_exit(0);
			at += 4 + len;
		}
		memmove(in, in + at, have - at);
		have -= at;
	}
}

int bench_echo_start(int cpu, unsigned spin_us)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -errno;
	pid_t pid = fork();
	if (pid < 0) {
		int err = errno;
		close(sv[0]);
		close(sv[1]);
		return -err;
	}
	if (pid == 0) {
		/* Ctrl-C reaches the whole process group: the cleanup is the
		 * parent's, the peer just dies (and with its parent). */
		signal(SIGINT, SIG_DFL);
		signal(SIGTERM, SIG_DFL);
		signal(SIGHUP, SIG_DFL);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		bench_pin(0, cpu);
		close(sv[0]);
		echo_serve(sv[1], spin_us);
		_exit(0);
	}
	close(sv[1]);
	harness.echo = pid;
	harness.echo_fd = sv[0];
	return 0;
}

void bench_echo_stop(void)
{
	if (harness.echo_fd >= 0)
		close(harness.echo_fd); /* EOF: the peer exits */
	harness.echo_fd = -1;
	if (harness.echo > 0)
		waitpid(harness.echo, NULL, 0);
	harness.echo = 0;
}

int bench_echo_fd(void)
{
	return harness.echo_fd;
}

int bench_raw_round_trip(int fd, const uint8_t *frame, size_t len, uint8_t *reply, size_t cap)
{
	return bench_raw_round_trip_spin(fd, frame, len, reply, cap, 0);
}

int bench_raw_round_trip_spin(int fd, const uint8_t *frame, size_t len, uint8_t *reply,
			      size_t cap, unsigned spin_us)
{
	size_t have = 0, want = 4;
	int rc = write_full(fd, frame, len);
	if (rc < 0)
		return rc;
	double until = bench_now_s() + spin_us * 1e-6;
	while (have < want) {
		/* Polled as the client library polls (ZC_RECEIVE_SPIN_US), then blocking. */
		bool spin = spin_us && bench_now_s() < until;
		ssize_t n = recv(fd, reply + have, cap - have, spin ? MSG_DONTWAIT : 0);
		if (n <= 0) {
			if (n < 0 && (errno == EINTR || (spin && errno == EAGAIN)))
				continue;
			return n == 0 ? -ECONNRESET : -errno;
		}
		have += (size_t)n;
		if (want == 4 && have >= 4)
			want = 4 + (size_t)frame_header_read(reply);
		if (want > cap)
			return -EMSGSIZE;
	}
	return 0;
}

void bench_raw_frame(uint8_t *frame, size_t request_bytes, size_t reply_bytes)
{
	/* The body's bytes do not matter to a socket, only their number. */
	frame_header_write(frame, (uint32_t)(request_bytes - 4));
	frame_header_write(frame + 4, (uint32_t)reply_bytes);
}

/* ---- frame sizes ------------------------------------------------------------ */

int bench_update_request_bytes(uint64_t session_id, const void *keys, const void *values,
			       size_t tensor_bytes, bool omit_stats, size_t *out)
{
	wire_pb_request req;
	memset(&req, 0, sizeof req);
	req.msg.request_id = TYPICAL_REQUEST_ID;
	req.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	req.msg.op.update_and_fetch.session_id = session_id;
	req.msg.op.update_and_fetch.layer = 0;
	req.msg.op.update_and_fetch.tokens = 1;
	req.msg.op.update_and_fetch.has_omit_stats = omit_stats;
	req.msg.op.update_and_fetch.omit_stats = omit_stats;
	req.keys = (wire_span){ keys, tensor_bytes };
	req.values = (wire_span){ values, tensor_bytes };
	return wire_pb_request_frame_size(&req, out);
}

/* The reply the daemon sends for an update with these stats (dispatch.c's
 * update_done); s NULL: a caller that asked for none (omit_stats). */
int bench_update_reply_bytes(const zc_layer_stats *s, uint32_t tokens, uint64_t sequence,
			     size_t *out)
{
	wire_pb_response resp;
	memset(&resp, 0, sizeof resp);
	resp.msg.request_id = TYPICAL_REQUEST_ID;
	resp.msg.which_op = zipcache_v1_Response_update_and_fetch_tag;
	zipcache_v1_UpdateAndFetchResponse *u = &resp.msg.op.update_and_fetch;
	u->tokens = tokens;
	u->sequence = sequence;
	if (!s)
		return wire_pb_response_frame_size(&resp, out);
	u->has_stats = true;
	u->stats = (zipcache_v1_LayerStats){
		.layer = s->layer,
		.tokens = s->tokens,
		.residual_tokens = s->residual_tokens,
		.compressed_key_bytes = s->compressed_key_bytes,
		.compressed_value_bytes = s->compressed_value_bytes,
		.baseline_key_bytes = s->baseline_key_bytes,
		.baseline_value_bytes = s->baseline_value_bytes,
		.fp16_key_bytes = s->fp16_key_bytes,
		.fp16_value_bytes = s->fp16_value_bytes,
		.compression_ratio = s->compression_ratio,
		.effective_avg_bits = s->effective_avg_bits,
		.blocks = s->blocks,
	};
	return wire_pb_response_frame_size(&resp, out);
}

double bench_daemon_metric(uint16_t port, const char *sample)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	static const char request[] = "GET /metrics HTTP/1.0\r\n\r\n";
	if (write(fd, request, sizeof(request) - 1) < 0) {
		close(fd);
		return -1;
	}
	size_t cap = 1 << 20, used = 0;
	char *text = malloc(cap), needle[160];
	ssize_t n;
	while (text && (n = read(fd, text + used, cap - 1 - used)) > 0)
		used += (size_t)n;
	close(fd);
	if (!text)
		return -1;
	text[used] = '\0';
	snprintf(needle, sizeof(needle), "\n%s ", sample);
	char *at = strstr(text, needle);
	double v = at ? strtod(at + strlen(needle), NULL) : -1;
	free(text);
	return v;
}
