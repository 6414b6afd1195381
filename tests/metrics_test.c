/*
 * Integration tests of the metrics endpoint: a real zipcached
 * (tests/daemon_harness.c) with --metrics-listen on a loopback port,
 * scraped with a small raw HTTP/1.x client written here (socket, send,
 * recv: no curl), validated with `promtool check metrics`, and scraped by
 * a real Prometheus server.
 *
 * The workload test drives a known sequence of requests through the C
 * client and asserts that every counter and gauge says exactly what that
 * sequence implies; the robustness tests hold partial, slow, oversized
 * and garbage HTTP connections open and check that neither the cache nor
 * the endpoint stalls, and that the daemon still exits 0 on SIGTERM.
 *
 * Only loopback addresses are used. Ports are picked by binding
 * 127.0.0.1:0 and closing the socket: the daemon logs the port it bound
 * only at info level, so the test chooses it.
 */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "process_run.h"
#include "frame.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* ASan makes the daemon several times slower; the slowloris test waits
 * out the endpoint's 5 s idle timeout and the Prometheus test waits for
 * a server to start and scrape. */
#define TEST_TIMEOUT_SECONDS 60
#define PROMETHEUS_TEST_TIMEOUT_SECONDS 90

#define CLIENT_TIMEOUT_MS 20000
#define HTTP_TIMEOUT_MS 10000

/* What "quickly" means while another HTTP peer misbehaves: far above a
 * healthy round trip (milliseconds, even under ASan), far below the
 * endpoint's 5 s idle timeout that a stalled loop would wait for. */
#define QUICK_MS 2000

/* The endpoint closes a silent connection after this long (server/http.c). */
#define HTTP_IDLE_TIMEOUT_MS 5000

/* How many connections one address may hold (server/http.c). */
#define HTTP_PER_IP_LIMIT 16

#define PROMETHEUS_PATH "/usr/bin/prometheus"
#define PROMTOOL_PATH "/usr/bin/promtool"

#define FP16_NAN 0x7e00u

/* ---- TCP on loopback ------------------------------------------------------- */

/*
 * A blocking TCP connection to 127.0.0.1:port, from source address
 * `from` (NULL: any; "127.0.0.2" is loopback too, and counts as another
 * peer for per-address limits). The descriptor, or a negative errno.
 */
static int tcp_connect_from(const char *from, uint16_t port)
{
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(port) };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -errno;
	if (from) {
		struct sockaddr_in source = { .sin_family = AF_INET };
		inet_pton(AF_INET, from, &source.sin_addr);
		if (bind(fd, (struct sockaddr *)&source, sizeof(source)) < 0) {
			int rc = -errno;
			close(fd);
			return rc;
		}
	}
	address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (connect(fd, (struct sockaddr *)&address, sizeof(address)) < 0) {
		int rc = -errno;
		close(fd);
		return rc;
	}
	return fd;
}

static int tcp_connect(uint16_t port)
{
	return tcp_connect_from(NULL, port);
}

/* Writes all bytes (no SIGPIPE); 0 or a negative errno. */
static int send_all(int fd, const void *bytes, size_t len)
{
	const char *p = bytes;
	while (len > 0) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

/* Waits (bounded) until something accepts on 127.0.0.1:port. */
static bool port_wait_accepting(uint16_t port, int timeout_ms)
{
	int64_t deadline = now_ms() + timeout_ms;
	for (;;) {
		int fd = tcp_connect(port);
		if (fd >= 0) {
			close(fd);
			return true;
		}
		if (now_ms() > deadline)
			return false;
		sleep_ms(10);
	}
}

/*
 * Whether the peer closes the connection (EOF or reset) within
 * timeout_ms; any bytes it sends first are read and dropped.
 */
static bool wait_peer_closed(int fd, int timeout_ms)
{
	int64_t deadline = now_ms() + timeout_ms;
	char buffer[4096];

	for (;;) {
		int64_t left = deadline - now_ms();
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (left <= 0)
			return false;
		int ready = poll(&p, 1, (int)left);
		if (ready < 0 && errno == EINTR)
			continue;
		if (ready <= 0)
			return false;
		ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
		if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
			return true;
	}
}

/* ---- a small HTTP/1.x client --------------------------------------------- */

struct http_reply {
	int status;        /* 0: no status line came back */
	char *raw;         /* everything received, NUL-terminated */
	size_t raw_len;
	const char *body;  /* into raw, after the blank line; NULL without one */
	size_t body_len;
	bool reset;        /* the connection was reset rather than closed */
};

static void http_reply_free(struct http_reply *reply)
{
	free(reply->raw);
	memset(reply, 0, sizeof(*reply));
}

/* The value of header `name` (case-insensitive) copied into out, or false. */
static bool http_header(const struct http_reply *reply, const char *name, char *out, size_t size)
{
	const char *end = reply->body ? reply->body : reply->raw + reply->raw_len;
	const char *line = reply->raw ? strstr(reply->raw, "\r\n") : NULL;
	size_t name_len = strlen(name);

	while (line && line + 2 < end) {
		line += 2;
		const char *next = strstr(line, "\r\n");
		if (!next || next > end)
			break;
		if ((size_t)(next - line) > name_len && strncasecmp(line, name, name_len) == 0 &&
		    line[name_len] == ':') {
			const char *value = line + name_len + 1;
			while (*value == ' ')
				value++;
			size_t len = (size_t)(next - value);
			if (len >= size)
				len = size - 1;
			memcpy(out, value, len);
			out[len] = '\0';
			return true;
		}
		line = next;
	}
	return false;
}

/*
 * Sends request (raw bytes) on a fresh connection from `from` and reads
 * the reply until the peer closes or, with a Content-Length, until the
 * body is whole (HEAD: at the end of the headers). Returns 0 with
 * *reply filled (status 0 if the peer closed without one), or a negative
 * errno (-ETIMEDOUT when nothing complete came in timeout_ms).
 */
static int http_exchange_from(const char *from, uint16_t port, const char *request,
			      size_t request_len, int timeout_ms, struct http_reply *reply)
{
	int64_t deadline = now_ms() + timeout_ms;
	size_t capacity = 65536, len = 0;
	bool head = strncmp(request, "HEAD ", 5) == 0;
	int fd, rc = 0;

	memset(reply, 0, sizeof(*reply));
	fd = tcp_connect_from(from, port);
	if (fd < 0)
		return fd;
	reply->raw = malloc(capacity);
	ck_assert(reply->raw != NULL);
	rc = send_all(fd, request, request_len);
	if (rc == -EPIPE || rc == -ECONNRESET)
		rc = 0;   /* the peer may answer and close before it has read all */
	while (rc == 0) {
		int64_t left = deadline - now_ms();
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (left <= 0) {
			rc = -ETIMEDOUT;
			break;
		}
		int ready = poll(&p, 1, (int)left);
		if (ready < 0 && errno == EINTR)
			continue;
		if (ready < 0) {
			rc = -errno;
			break;
		}
		if (ready == 0) {
			rc = -ETIMEDOUT;
			break;
		}
		if (len + 1 >= capacity) {
			capacity *= 2;
			reply->raw = realloc(reply->raw, capacity);
			ck_assert(reply->raw != NULL);
		}
		ssize_t n = recv(fd, reply->raw + len, capacity - len - 1, MSG_DONTWAIT);
		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n < 0) {
			if (errno == ECONNRESET) {
				reply->reset = true;
				break;
			}
			rc = -errno;
			break;
		}
		if (n == 0)
			break;
		len += (size_t)n;
		reply->raw[len] = '\0';
		/* Stop early when the reply is complete by its own account. */
		char *blank = strstr(reply->raw, "\r\n\r\n");
		char length_text[32];
		if (blank) {
			reply->raw_len = len;
			reply->body = blank + 4;
			if (head)
				break;
			if (http_header(reply, "Content-Length", length_text, sizeof(length_text)) &&
			    (size_t)(reply->raw + len - reply->body) >= strtoull(length_text, NULL, 10))
				break;
		}
	}
	close(fd);
	reply->raw[len] = '\0';
	reply->raw_len = len;
	if (rc < 0)
		return rc;
	char *blank = strstr(reply->raw, "\r\n\r\n");
	reply->body = blank ? blank + 4 : NULL;
	reply->body_len = blank ? (size_t)(reply->raw + len - reply->body) : 0;
	if (strncmp(reply->raw, "HTTP/1.", 7) == 0 && len > 12)
		reply->status = atoi(reply->raw + 9);
	return 0;
}

static int http_exchange(uint16_t port, const char *request, int timeout_ms,
			 struct http_reply *reply)
{
	return http_exchange_from(NULL, port, request, strlen(request), timeout_ms, reply);
}

/* GET path as HTTP/1.1; asserts a reply came. */
static void http_get(uint16_t port, const char *path, struct http_reply *reply)
{
	char request[512];
	snprintf(request, sizeof(request),
		 "GET %s HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nUser-Agent: metrics_test\r\n"
		 "Accept: text/plain\r\nConnection: close\r\n\r\n",
		 path, port);
	int rc = http_exchange(port, request, HTTP_TIMEOUT_MS, reply);
	ck_assert_msg(rc == 0, "GET %s on port %u: %s", path, port, strerror(-rc));
	ck_assert_msg(reply->status != 0, "GET %s: no HTTP status line; got %zu bytes: %.200s", path,
		      reply->raw_len, reply->raw);
}

/* GET /metrics, asserting 200 and the text format's Content-Type; the
 * body (NUL-terminated) is reply->body. */
static void scrape(uint16_t port, struct http_reply *reply)
{
	char type[256] = "";

	http_get(port, "/metrics", reply);
	ck_assert_msg(reply->status == 200, "GET /metrics: status %d: %.300s", reply->status,
		      reply->raw);
	ck_assert_msg(reply->body != NULL, "GET /metrics: no body");
	ck_assert_msg(http_header(reply, "Content-Type", type, sizeof(type)),
		      "GET /metrics: no Content-Type: %.300s", reply->raw);
	ck_assert_msg(strncmp(type, "text/plain; version=0.0.4", 25) == 0,
		      "GET /metrics: Content-Type '%s', want text/plain; version=0.0.4", type);
	char length[32];
	if (http_header(reply, "Content-Length", length, sizeof(length)))
		ck_assert_uint_eq(strtoull(length, NULL, 10), reply->body_len);
}

/* Scrapes within QUICK_MS, from address `from`. */
static void scrape_quickly_from(const char *from, uint16_t port, const char *while_what)
{
	static const char request[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
				      "Connection: close\r\n\r\n";
	struct http_reply reply;
	int64_t start = now_ms();
	int rc = http_exchange_from(from, port, request, strlen(request), QUICK_MS, &reply);
	int64_t took = now_ms() - start;

	ck_assert_msg(rc == 0 && reply.status == 200,
		      "a scrape from %s %s: %s, status %d after %lld ms (%.120s)",
		      from ? from : "127.0.0.1", while_what, rc ? strerror(-rc) : "replied",
		      reply.status, (long long)took, reply.raw ? reply.raw : "");
	ck_assert_msg(took < QUICK_MS, "a scrape %s took %lld ms", while_what, (long long)took);
	ck_assert_msg(reply.body && strstr(reply.body, "zipcache_build_info{") != NULL,
		      "a scrape %s has no zipcache_build_info", while_what);
	http_reply_free(&reply);
}

/* A scrape answered within QUICK_MS of now. The client sees a dropped
 * connection's close before the endpoint has counted it out of the
 * address's share, so a scrape in between is closed unanswered: such
 * closes are retried, within the same bound. */
static void scrape_soon(uint16_t port, const char *while_what)
{
	static const char request[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
				      "Connection: close\r\n\r\n";
	int64_t deadline = now_ms() + QUICK_MS;
	for (;;) {
		struct http_reply reply;
		int64_t left = deadline - now_ms();
		int rc = http_exchange(port, request, left > 1 ? (int)left : 1, &reply);
		bool answered = rc == 0 && reply.status == 200;
		if (answered || (rc == 0 && reply.status == 0 && now_ms() + 20 < deadline)) {
			if (answered)
				ck_assert_msg(reply.body && strstr(reply.body, "zipcache_build_info{"),
					      "a scrape %s has no zipcache_build_info", while_what);
			http_reply_free(&reply);
			if (answered)
				return;
			sleep_ms(20);
			continue;
		}
		ck_assert_msg(0, "a scrape %s: %s, status %d, not answered within %d ms (%.120s)",
			      while_what, rc ? strerror(-rc) : "replied", reply.status, QUICK_MS,
			      reply.raw ? reply.raw : "");
	}
}

/* ---- reading the exposition ------------------------------------------------ */

/*
 * The value of the sample whose series (name and labels, exactly as the
 * daemon prints them) is `series`; false if there is none. Asserts that
 * the series appears only once.
 */
static bool sample_find(const char *body, const char *series, double *value)
{
	size_t len = strlen(series);
	bool found = false;

	for (const char *line = body; line && *line;) {
		const char *next = strchr(line, '\n');
		if (strncmp(line, series, len) == 0 && line[len] == ' ') {
			ck_assert_msg(!found, "series %s appears twice", series);
			char *end;
			*value = strtod(line + len + 1, &end);
			ck_assert_msg(end != line + len + 1, "series %s: no number", series);
			found = true;
		}
		line = next ? next + 1 : NULL;
	}
	return found;
}

static double sample(const char *body, const char *series)
{
	double value = 0;
	ck_assert_msg(sample_find(body, series, &value), "no sample %s in the exposition", series);
	return value;
}

/* A counter that must hold an exact integer. */
static void assert_sample_eq(const char *body, const char *series, double want)
{
	double got = sample(body, series);
	ck_assert_msg(got == want, "%s = %.17g, want %.17g", series, got, want);
}

/* Sum of every sample whose line starts with prefix. */
static double sample_sum(const char *body, const char *prefix)
{
	size_t len = strlen(prefix);
	double sum = 0;
	for (const char *line = body; line && *line;) {
		const char *next = strchr(line, '\n');
		if (strncmp(line, prefix, len) == 0) {
			const char *space = strchr(line, ' ');
			ck_assert_msg(space && (!next || space < next), "no value on line %.80s", line);
			sum += strtod(space + 1, NULL);
		}
		line = next ? next + 1 : NULL;
	}
	return sum;
}

static int compare_strings(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* No series (a sample's name and labels) appears twice anywhere. */
static void assert_series_unique(const char *body)
{
	char *copy = strdup(body);
	size_t count = 0, capacity = 1024;
	char **series = malloc(capacity * sizeof(*series));

	ck_assert(copy && series);
	for (char *line = strtok(copy, "\n"); line; line = strtok(NULL, "\n")) {
		if (line[0] == '#')
			continue;
		char *space = strrchr(line, ' ');
		ck_assert_msg(space != NULL, "sample line without a value: %s", line);
		*space = '\0';
		if (count == capacity) {
			capacity *= 2;
			series = realloc(series, capacity * sizeof(*series));
			ck_assert(series);
		}
		series[count++] = line;
	}
	qsort(series, count, sizeof(*series), compare_strings);
	for (size_t i = 1; i < count; i++)
		ck_assert_msg(strcmp(series[i - 1], series[i]) != 0, "series %s appears twice",
			      series[i]);
	free(series);
	free(copy);
}

static const char *const op_names[] = {
	"hello", "open_session", "update_and_fetch", "trim", "close_session",
	"stats", "list_sessions", "staging", "invalid",
};

/*
 * For every op, the histogram's buckets come in ascending `le`, are
 * cumulative (never decrease), end with le="+Inf" equal to _count, and
 * _count equals the requests counted for that op over every status.
 */
static void assert_histograms(const char *body)
{
	for (size_t i = 0; i < sizeof(op_names) / sizeof(op_names[0]); i++) {
		char prefix[160], series[160];
		double last_le = -1, last_value = -1, count;
		int buckets = 0;
		bool saw_inf = false;

		snprintf(series, sizeof(series), "zipcache_request_duration_seconds_count{op=\"%s\"}",
			 op_names[i]);
		count = sample(body, series);
		snprintf(prefix, sizeof(prefix), "zipcache_request_duration_seconds_bucket{op=\"%s\",le=\"",
			 op_names[i]);
		size_t len = strlen(prefix);
		for (const char *line = body; line && *line;) {
			const char *next = strchr(line, '\n');
			if (strncmp(line, prefix, len) == 0) {
				const char *le = line + len;
				const char *quote = strchr(le, '"');
				ck_assert_msg(quote && strncmp(quote, "\"} ", 3) == 0, "bad bucket line %.120s",
					      line);
				ck_assert_msg(!saw_inf, "op %s: a bucket after le=\"+Inf\"", op_names[i]);
				double bound = strncmp(le, "+Inf\"", 5) == 0 ? INFINITY : strtod(le, NULL);
				double value = strtod(quote + 3, NULL);
				ck_assert_msg(bound > last_le, "op %s: le %g after %g: not ascending",
					      op_names[i], bound, last_le);
				ck_assert_msg(value >= last_value, "op %s: bucket le=%g holds %g < %g before it",
					      op_names[i], bound, value, last_value);
				last_le = bound;
				last_value = value;
				saw_inf = isinf(bound);
				buckets++;
			}
			line = next ? next + 1 : NULL;
		}
		ck_assert_msg(buckets >= 2, "op %s: %d buckets", op_names[i], buckets);
		ck_assert_msg(saw_inf, "op %s: no le=\"+Inf\" bucket", op_names[i]);
		ck_assert_msg(last_value == count, "op %s: +Inf bucket %g != _count %g", op_names[i],
			      last_value, count);
		snprintf(prefix, sizeof(prefix), "zipcache_requests_total{op=\"%s\",", op_names[i]);
		double requests = sample_sum(body, prefix);
		ck_assert_msg(requests == count, "op %s: %g requests counted but histogram _count %g",
			      op_names[i], requests, count);
		snprintf(series, sizeof(series), "zipcache_request_duration_seconds_sum{op=\"%s\"}",
			 op_names[i]);
		double sum = sample(body, series);
		ck_assert_msg(sum >= 0 && (count > 0 || sum == 0), "op %s: _sum %g with _count %g",
			      op_names[i], sum, count);
	}
}

/* ---- promtool -------------------------------------------------------------- */

/*
 * `promtool check metrics` with the body on its stdin (bounded: 20 s);
 * asserts exit status 0 and prints what it said otherwise.
 */
static void assert_promtool_accepts(const char *body, size_t len)
{
	char output[4096];
	int in[2];
	FILE *captured = tmpfile();
	pid_t pid;
	int status = 0;

	if (access(PROMTOOL_PATH, X_OK) != 0) {
		/* make deps installs it; a machine without it cannot run this check. */
		fprintf(stderr, "metrics_test: %s absent; skipping the promtool check\n", PROMTOOL_PATH);
		if (captured)
			fclose(captured);
		return;
	}
	ck_assert(captured != NULL);
	ck_assert_msg(pipe2(in, O_CLOEXEC) == 0, "pipe: %s", strerror(errno));
	pid = fork_dying_with_parent(127);
	if (pid == 0) {
		dup2(in[0], STDIN_FILENO);
		dup2(fileno(captured), STDOUT_FILENO);
		dup2(fileno(captured), STDERR_FILENO);
		execl(PROMTOOL_PATH, PROMTOOL_PATH, "check", "metrics", (char *)NULL);
		_exit(127);
	}
	close(in[0]);
	/* A write that fails (promtool gone early) shows in its status. */
	for (const char *p = body; len > 0;) {
		ssize_t n = write(in[1], p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			break;
		p += n;
		len -= (size_t)n;
	}
	close(in[1]);
	int64_t deadline = now_ms() + 20000;
	for (;;) {
		pid_t done = waitpid(pid, &status, WNOHANG);
		if (done == pid)
			break;
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			ck_abort_msg("promtool check metrics did not finish in 20 s");
		}
		sleep_ms(5);
	}
	rewind(captured);
	size_t n = fread(output, 1, sizeof(output) - 1, captured);
	output[n] = '\0';
	fclose(captured);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "promtool check metrics rejects the exposition (status 0x%x):\n%s", status, output);
}

/* ---- a daemon with its metrics endpoint ------------------------------------ */

struct metrics_daemon {
	struct daemon_harness daemon;
	uint16_t port;
};

/* Starts zipcached with --metrics-listen 127.0.0.1:PORT on a free port
 * and waits (bounded) until the endpoint accepts. */
static void metrics_daemon_start(struct metrics_daemon *m, const char *const *more_args)
{
	char listen_arg[64];
	const char *args[DAEMON_MAX_EXTRA_ARGS + 1];
	int n = 0;

	m->port = free_tcp_port();
	snprintf(listen_arg, sizeof(listen_arg), "127.0.0.1:%u", m->port);
	args[n++] = "--metrics-listen";
	args[n++] = listen_arg;
	for (int i = 0; more_args && more_args[i]; i++)
		args[n++] = more_args[i];
	args[n] = NULL;
	daemon_start(&m->daemon, args);
	if (!port_wait_accepting(m->port, 10000)) {
		char tail[2048];
		ck_abort_msg("the metrics endpoint on port %u never accepted; log:\n%s", m->port,
			     daemon_log_tail(&m->daemon, tail, sizeof(tail)));
	}
}

static void metrics_daemon_stop(struct metrics_daemon *m)
{
	daemon_stop(&m->daemon);
	daemon_cleanup(&m->daemon);
}

/* ---- the C-client workload ------------------------------------------------- */

#define HEAD_DIM 32
#define KV_HEADS 2

static void fill_block(uint16_t *keys, uint16_t *values, size_t elements, uint32_t seed)
{
	uint32_t state = seed * 2654435761u + 1;
	for (size_t i = 0; i < elements; i++) {
		state = state * 1664525u + 1013904223u;
		keys[i] = zc_float_to_fp16((float)((int32_t)(state >> 8) % 2000) / 500.0f);
		state = state * 1664525u + 1013904223u;
		values[i] = zc_float_to_fp16((float)((int32_t)(state >> 8) % 2000) / 700.0f);
	}
}

/* zc_update_and_fetch of `tokens` fresh tokens; returns its code. */
static int update(zc_session *session, uint32_t layer, uint32_t tokens, uint32_t seed,
		  bool poison)
{
	size_t elements = (size_t)KV_HEADS * tokens * HEAD_DIM;
	uint16_t *keys = malloc(elements * 2), *values = malloc(elements * 2);
	zc_view view;

	ck_assert(keys && values);
	fill_block(keys, values, elements, seed);
	if (poison)
		keys[elements / 2] = FP16_NAN;
	int rc = zc_update_and_fetch(session, layer, tokens, keys, values, &view, NULL);
	free(keys);
	free(values);
	return rc;
}

static void update_ok(zc_session *session, uint32_t layer, uint32_t tokens, uint32_t seed)
{
	int rc = update(session, layer, tokens, seed, false);
	ck_assert_msg(rc == 0, "update_and_fetch layer %u, %u tokens: %s", layer, tokens,
		      zc_strerror(rc));
}

static zc_session *session_open(zc_client *client, const char *name, uint32_t layers,
				zc_block_policy policy)
{
	zc_session_config config;
	zc_session *session = NULL;

	zc_session_config_default(&config);
	config.name = name;
	config.layers = layers;
	config.batch = 1;
	config.kv_heads = KV_HEADS;
	config.head_dim_k = config.head_dim_v = HEAD_DIM;
	config.max_tokens = 512;
	config.policy = policy;
	config.residual_tokens = 16;
	int rc = zc_session_open(client, &config, &session);
	ck_assert_msg(rc == 0, "open session %s: %s (%s)", name, zc_strerror(rc),
		      zc_client_last_error(client));
	return session;
}

static zc_client *client_connect(const struct daemon_harness *daemon)
{
	zc_client *client = NULL;
	int rc = zc_client_connect(daemon->socket_path, CLIENT_TIMEOUT_MS, &client);
	ck_assert_msg(rc == 0, "connect %s: %s", daemon->socket_path, zc_strerror(rc));
	return client;
}

/* What the workload did, as the metrics should count it. */
struct workload {
	unsigned updates_ok;
	unsigned updates_invalid;
	unsigned updates_not_found;
	uint64_t tokens_appended;
	uint64_t memory_budget;     /* as hello says: derived, no --memory-budget given */
	zc_layer_stats total;       /* the open session's, from zc_session_stats */
};

/*
 * Two clients, two sessions (one streaming with a short residual, one
 * per_call); known update sizes; a block with a NaN key; a layer out of
 * range; an update for a session id that does not exist (on a raw
 * connection: the client API cannot name one); a trim of one token;
 * session stats; then the per_call session is closed.
 */
static void workload_run(const struct daemon_harness *daemon, struct workload *w)
{
	static const uint32_t a_sizes[][2] = { { 0, 40 }, { 0, 1 }, { 1, 40 }, { 0, 1 }, { 1, 1 },
					       { 1, 20 } };
	static const uint32_t b_sizes[][2] = { { 0, 33 }, { 0, 7 } };
	zc_client *c1 = client_connect(daemon), *c2 = client_connect(daemon);
	zc_session *a = session_open(c1, "metrics-a", 2, ZC_POLICY_STREAMING);
	zc_session *b = session_open(c2, "metrics-b", 1, ZC_POLICY_PER_CALL);
	uint32_t seed = 1, trimmed = 0;
	int rc;

	memset(w, 0, sizeof(*w));
	w->memory_budget = zc_client_server_info(c1)->memory_budget_bytes;
	for (size_t i = 0; i < sizeof(a_sizes) / sizeof(a_sizes[0]); i++) {
		update_ok(a, a_sizes[i][0], a_sizes[i][1], seed++);
		w->updates_ok++;
		w->tokens_appended += a_sizes[i][1];
	}
	for (size_t i = 0; i < sizeof(b_sizes) / sizeof(b_sizes[0]); i++) {
		update_ok(b, b_sizes[i][0], b_sizes[i][1], seed++);
		w->updates_ok++;
		w->tokens_appended += b_sizes[i][1];
	}

	rc = update(a, 0, 5, seed++, true);
	ck_assert_msg(rc == ZC_ENONFINITE || rc == ZC_EINVALID,
		      "update with a NaN key: %s, want an invalid-argument error", zc_strerror(rc));
	w->updates_invalid++;
	rc = update(a, 7, 1, seed++, false);
	ck_assert_msg(rc == ZC_EINVALID, "update of layer 7 of 2: %s, want ZC_EINVALID",
		      zc_strerror(rc));
	w->updates_invalid++;

	/* A session id no one opened. */
	int fd = raw_connect(daemon->socket_path);
	ck_assert_msg(fd >= 0, "raw connect: %s", strerror(-fd));
	uint16_t one_token[KV_HEADS * HEAD_DIM] = { 0 };
	wire_pb_request request = { 0 };
	wire_pb_response reply;
	request.msg.request_id = 77;
	request.msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	request.msg.op.update_and_fetch.session_id = 987654321;
	request.msg.op.update_and_fetch.layer = 0;
	request.msg.op.update_and_fetch.tokens = 1;
	request.keys = (wire_span){ (const uint8_t *)one_token, sizeof(one_token) };
	request.values = (wire_span){ (const uint8_t *)one_token, sizeof(one_token) };
	rc = raw_call(fd, &request, &reply, NULL);
	ck_assert_msg(rc == 0, "raw update of an unknown session: no reply: %s", zc_strerror(rc));
	ck_assert_int_eq(reply.msg.status, zipcache_v1_Status_NOT_FOUND);
	wire_pb_response_free(&reply);
	close(fd);
	w->updates_not_found++;

	rc = zc_session_trim(a, 1, &trimmed);
	ck_assert_msg(rc == 0, "trim: %s", zc_strerror(rc));
	ck_assert_uint_eq(trimmed, 1);

	rc = zc_session_close(b);
	ck_assert_msg(rc == 0, "close session b: %s", zc_strerror(rc));

	rc = zc_session_stats(a, NULL, 0, &w->total);
	ck_assert_msg(rc == 0, "session stats: %s", zc_strerror(rc));
	/* Layer 0: 40+1+1 = 42, layer 1: 40+1+20 = 61, one token trimmed from each. */
	ck_assert_uint_eq(w->total.tokens, 41 + 60);

	zc_session_release(a);
	zc_client_close(c1);
	zc_client_close(c2);
}

/* ---- 1. what a scrape says after a known workload --------------------------- */

START_TEST(test_metrics_after_workload)
{
	struct metrics_daemon m;
	struct workload w;
	struct http_reply reply;
	char series[256];

	metrics_daemon_start(&m, NULL);
	workload_run(&m.daemon, &w);
	scrape(m.port, &reply);
	const char *body = reply.body;

	assert_promtool_accepts(body, reply.body_len);
	assert_series_unique(body);

	/* Build info: one sample, value 1, with version and codec labels. */
	const char *info = strstr(body, "\nzipcache_build_info{");
	ck_assert_msg(info != NULL, "no zipcache_build_info sample");
	ck_assert_msg(strstr(body, "# TYPE zipcache_build_info gauge\n") != NULL,
		      "zipcache_build_info has no TYPE gauge line");
	const char *info_end = strchr(info + 1, '\n');
	ck_assert_msg(info_end && strncmp(info_end - 2, " 1", 2) == 0,
		      "zipcache_build_info is not 1: %.*s", (int)(info_end ? info_end - info : 80),
		      info);
	ck_assert_msg(strstr(info, "version=\"") && strstr(info, "codec_isa=\""),
		      "zipcache_build_info without version/codec_isa labels");

	/* Requests by op and status. */
	assert_sample_eq(body, "zipcache_requests_total{op=\"update_and_fetch\",status=\"ok\"}",
			 w.updates_ok);
	assert_sample_eq(body,
			 "zipcache_requests_total{op=\"update_and_fetch\",status=\"invalid_argument\"}",
			 w.updates_invalid);
	assert_sample_eq(body, "zipcache_requests_total{op=\"update_and_fetch\",status=\"not_found\"}",
			 w.updates_not_found);
	assert_sample_eq(body, "zipcache_requests_total{op=\"hello\",status=\"ok\"}", 2);
	assert_sample_eq(body, "zipcache_requests_total{op=\"open_session\",status=\"ok\"}", 2);
	assert_sample_eq(body, "zipcache_requests_total{op=\"trim\",status=\"ok\"}", 1);
	assert_sample_eq(body, "zipcache_requests_total{op=\"close_session\",status=\"ok\"}", 1);
	assert_sample_eq(body, "zipcache_requests_total{op=\"stats\",status=\"ok\"}", 1);
	/* Nothing else failed, and no request went unclassified. */
	double all = sample_sum(body, "zipcache_requests_total{");
	ck_assert_msg(all == 2 + 2 + w.updates_ok + w.updates_invalid + w.updates_not_found + 1 + 1 + 1,
		      "zipcache_requests_total sums to %g", all);
	ck_assert_msg(sample_sum(body, "zipcache_requests_total{op=\"invalid\",") == 0,
		      "requests counted under op=\"invalid\"");

	/* Errors by reason: one NaN, one bad layer, one unknown session. */
	assert_sample_eq(body, "zipcache_errors_total{reason=\"nonfinite_input\"}", 1);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"invalid_argument\"}", 1);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"not_found\"}", 1);
	double errors = sample_sum(body, "zipcache_errors_total{");
	ck_assert_msg(errors == 3, "zipcache_errors_total sums to %g, want 3", errors);

	/* Gauges: what the one open session holds. */
	assert_sample_eq(body, "zipcache_sessions", 1);
	assert_sample_eq(body, "zipcache_stored_tokens", w.total.tokens);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"compressed\"}",
			 (double)w.total.compressed_key_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"compressed\"}",
			 (double)w.total.compressed_value_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"baseline\"}",
			 (double)w.total.baseline_key_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"baseline\"}",
			 (double)w.total.baseline_value_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"fp16\"}",
			 (double)w.total.fp16_key_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"fp16\"}",
			 (double)w.total.fp16_value_bytes);
	ck_assert_uint_eq(w.total.fp16_key_bytes, (uint64_t)w.total.tokens * KV_HEADS * HEAD_DIM * 2);
	ck_assert_msg(w.total.compressed_key_bytes > 0 &&
			      w.total.compressed_key_bytes < w.total.fp16_key_bytes,
		      "compressed key bytes %llu of %llu fp16",
		      (unsigned long long)w.total.compressed_key_bytes,
		      (unsigned long long)w.total.fp16_key_bytes);
	double key_ratio = sample(body, "zipcache_compression_ratio{tensor=\"key\"}");
	double value_ratio = sample(body, "zipcache_compression_ratio{tensor=\"value\"}");
	double want_key = (double)w.total.fp16_key_bytes / (double)w.total.compressed_key_bytes;
	double want_value = (double)w.total.fp16_value_bytes / (double)w.total.compressed_value_bytes;
	ck_assert_msg(fabs(key_ratio - want_key) <= 1e-9 * want_key, "key ratio %.17g, want %.17g",
		      key_ratio, want_key);
	ck_assert_msg(fabs(value_ratio - want_value) <= 1e-9 * want_value,
		      "value ratio %.17g, want %.17g", value_ratio, want_value);
	ck_assert_msg(fabs(key_ratio - w.total.compression_ratio) <= 1e-6 * key_ratio,
		      "metrics key ratio %g, session stats say %g", key_ratio, w.total.compression_ratio);

	/* Counters of the daemon's life. */
	assert_sample_eq(body, "zipcache_tokens_appended_total", (double)w.tokens_appended);
	/* c1, c2 and the raw connection at least (the harness's readiness
	 * probes connect too). */
	ck_assert_msg(sample(body, "zipcache_connections_total") >= 3,
		      "zipcache_connections_total %g < 3", sample(body, "zipcache_connections_total"));
	double uptime = sample(body, "zipcache_uptime_seconds");
	ck_assert_msg(uptime >= 0 && uptime < 120, "zipcache_uptime_seconds %g", uptime);
	ck_assert_msg(sample(body, "zipcache_memory_used_bytes") > 0, "no shared memory counted");
	/* No --memory-budget: one derived from the host, the one hello gave. */
	ck_assert_msg(w.memory_budget > 0, "no memory budget derived");
	assert_sample_eq(body, "zipcache_memory_budget_bytes", (double)w.memory_budget);
	ck_assert_msg(sample(body, "zipcache_staging_bytes") >= 0, "no zipcache_staging_bytes");
	ck_assert_msg(sample(body, "zipcache_reply_queue_bytes") >= 0, "no zipcache_reply_queue_bytes");
	assert_sample_eq(body, "zipcache_view_drops_total", 0);

	/* Histograms agree with the request counters. */
	assert_histograms(body);
	snprintf(series, sizeof(series), "zipcache_request_duration_seconds_count{op=\"%s\"}",
		 "update_and_fetch");
	assert_sample_eq(body, series, w.updates_ok + w.updates_invalid + w.updates_not_found);
	http_reply_free(&reply);

	/* The clients are gone: a scrape after they closed says so. Closing
	 * is asynchronous on the daemon's side, so wait for it (bounded). */
	int64_t deadline = now_ms() + 5000;
	for (;;) {
		scrape(m.port, &reply);
		double open = sample(reply.body, "zipcache_connections");
		http_reply_free(&reply);
		if (open == 0)
			break;
		ck_assert_msg(now_ms() < deadline, "zipcache_connections still %g after clients closed",
			      open);
		sleep_ms(20);
	}

	/* HEAD gets the headers of a GET and no body. */
	int rc = http_exchange(m.port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
			       HTTP_TIMEOUT_MS, &reply);
	ck_assert_msg(rc == 0 && reply.status == 200, "HEAD /metrics: %s, status %d",
		      strerror(-rc), reply.status);
	http_reply_free(&reply);

	metrics_daemon_stop(&m);
}
END_TEST

/* A scrape of an idle daemon is valid text too (families with no
 * samples yet, zero-valued histograms). */
START_TEST(test_metrics_fresh_daemon_valid)
{
	struct metrics_daemon m;
	struct http_reply reply;

	metrics_daemon_start(&m, NULL);
	scrape(m.port, &reply);
	assert_promtool_accepts(reply.body, reply.body_len);
	assert_series_unique(reply.body);
	assert_histograms(reply.body);
	assert_sample_eq(reply.body, "zipcache_sessions", 0);
	assert_sample_eq(reply.body, "zipcache_stored_tokens", 0);
	/* No bytes stored: the ratio must still be a number promtool and
	 * Prometheus take (0, or NaN spelled "NaN"), never "nan"/"-nan". */
	ck_assert_msg(strstr(reply.body, " nan\n") == NULL && strstr(reply.body, " -nan\n") == NULL &&
			      strstr(reply.body, " inf\n") == NULL,
		      "a value printed in C's nan/inf spelling");
	http_reply_free(&reply);
	metrics_daemon_stop(&m);
}
END_TEST

/* ---- error reasons the C client never causes ------------------------------- */

/* Scrapes until series has the value want (bounded: 5 s); the daemon
 * updates some gauges a loop iteration after the event. */
static void wait_sample(uint16_t port, const char *series, double want)
{
	int64_t deadline = now_ms() + 5000;
	struct http_reply reply;
	for (;;) {
		scrape(port, &reply);
		double got = sample(reply.body, series);
		http_reply_free(&reply);
		if (got == want)
			return;
		ck_assert_msg(now_ms() < deadline, "%s stays %g, want %g", series, got, want);
		sleep_ms(20);
	}
}

START_TEST(test_metrics_error_reasons)
{
	struct metrics_daemon m;
	struct http_reply reply;
	wire_pb_response response;
	const char *args[] = { "--max-connections", "2", "--max-frame-bytes", "4096", NULL };

	metrics_daemon_start(&m, args);

	/* A frame whose body is not a Request. */
	int fd = raw_connect(m.daemon.socket_path);
	ck_assert(fd >= 0);
	uint8_t junk[FRAME_HEADER_BYTES + 3];
	frame_header_write(junk, 3);
	memset(junk + FRAME_HEADER_BYTES, 0xff, 3);
	ck_assert_int_eq(raw_send(fd, junk, sizeof(junk)), 0);
	ck_assert_int_eq(raw_read_reply(fd, CLIENT_TIMEOUT_MS, &response, NULL), 0);
	ck_assert_int_eq(response.msg.status, zipcache_v1_Status_INVALID_ARGUMENT);
	wire_pb_response_free(&response);

	/* A well-formed Request with no operation in it. */
	wire_pb_request empty = { 0 };
	empty.msg.request_id = 5;
	ck_assert_int_eq(raw_call(fd, &empty, &response, NULL), 0);
	ck_assert_int_eq(response.msg.status, zipcache_v1_Status_INVALID_ARGUMENT);
	wire_pb_response_free(&response);

	/* A header announcing more than --max-frame-bytes: refused, closed. */
	uint8_t header[FRAME_HEADER_BYTES];
	frame_header_write(header, 1u << 20);
	ck_assert_int_eq(raw_send(fd, header, sizeof(header)), 0);
	ck_assert_int_eq(raw_read_reply(fd, CLIENT_TIMEOUT_MS, &response, NULL), 0);
	ck_assert_int_eq(response.msg.status, zipcache_v1_Status_RESOURCE_EXHAUSTED);
	wire_pb_response_free(&response);
	ck_assert_msg(raw_wait_closed(fd, 5000), "the connection stays open after an oversized frame");
	close(fd);

	/* Two connections are the limit: a third is refused. */
	wait_sample(m.port, "zipcache_connections", 0);
	zc_client *c1 = client_connect(&m.daemon), *c2 = client_connect(&m.daemon);
	wait_sample(m.port, "zipcache_connections", 2);
	fd = raw_connect(m.daemon.socket_path);
	ck_assert(fd >= 0);
	ck_assert_int_eq(raw_read_reply(fd, CLIENT_TIMEOUT_MS, &response, NULL), 0);
	ck_assert_int_eq(response.msg.status, zipcache_v1_Status_RESOURCE_EXHAUSTED);
	wire_pb_response_free(&response);
	close(fd);

	scrape(m.port, &reply);
	const char *body = reply.body;
	assert_promtool_accepts(body, reply.body_len);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"malformed_request\"}", 1);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"invalid_argument\"}", 1);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"frame_too_large\"}", 1);
	assert_sample_eq(body, "zipcache_errors_total{reason=\"connection_refused\"}", 1);
	ck_assert_msg(sample_sum(body, "zipcache_errors_total{") == 4,
		      "zipcache_errors_total sums to %g, want 4", sample_sum(body, "zipcache_errors_total{"));
	assert_sample_eq(body, "zipcache_requests_total{op=\"invalid\",status=\"invalid_argument\"}", 2);
	assert_sample_eq(body, "zipcache_requests_total{op=\"invalid\",status=\"resource_exhausted\"}", 1);
	assert_sample_eq(body, "zipcache_requests_total{op=\"hello\",status=\"ok\"}", 2);
	assert_sample_eq(body, "zipcache_connections", 2);
	assert_histograms(body);
	http_reply_free(&reply);

	zc_client_close(c1);
	zc_client_close(c2);
	metrics_daemon_stop(&m);
}
END_TEST

/* Sessions closed by --idle-ttl leave the gauges. */
START_TEST(test_metrics_after_idle_expiry)
{
	struct metrics_daemon m;
	struct http_reply reply;
	const char *args[] = { "--idle-ttl", "1", NULL };

	metrics_daemon_start(&m, args);
	zc_client *client = client_connect(&m.daemon);
	zc_session *session = session_open(client, "expiring", 2, ZC_POLICY_PER_CALL);
	update_ok(session, 0, 40, 1);
	update_ok(session, 1, 40, 2);
	zc_session_release(session);
	zc_client_close(client);

	scrape(m.port, &reply);
	double sessions = sample(reply.body, "zipcache_sessions");
	http_reply_free(&reply);
	if (sessions == 1) {
		/* Still there (ASan can be that slow): the gauges show it. */
		scrape(m.port, &reply);
		ck_assert_msg(sample(reply.body, "zipcache_stored_tokens") == 80 ||
				      sample(reply.body, "zipcache_sessions") == 0,
			      "stored tokens %g before expiry, want 80",
			      sample(reply.body, "zipcache_stored_tokens"));
		http_reply_free(&reply);
	}
	wait_sample(m.port, "zipcache_sessions", 0);
	scrape(m.port, &reply);
	const char *body = reply.body;
	assert_sample_eq(body, "zipcache_stored_tokens", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"compressed\"}", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"compressed\"}", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"fp16\"}", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"fp16\"}", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"baseline\"}", 0);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"baseline\"}", 0);
	assert_sample_eq(body, "zipcache_tokens_appended_total", 80);
	assert_promtool_accepts(body, reply.body_len);
	http_reply_free(&reply);
	metrics_daemon_stop(&m);
}
END_TEST

/*
 * Memory relief's steps are counted as they run: sessions grow under a
 * small budget until a charge is refused. Every refusal went through
 * drop_views first, so that count is at least the refusals'; the daemon
 * still answers afterwards.
 */
START_TEST(test_metrics_relief_steps)
{
	struct metrics_daemon m;
	struct http_reply reply;
	const char *args[] = { "--memory-budget", "4M", NULL };
	zc_session *sessions[64] = { 0 };
	int refused = 0, n = 0;

	metrics_daemon_start(&m, args);
	zc_client *client = client_connect(&m.daemon);
	scrape(m.port, &reply);
	assert_sample_eq(reply.body, "zipcache_relief_steps_total{step=\"drop_views\"}", 0);
	assert_sample_eq(reply.body, "zipcache_relief_steps_total{step=\"refuse\"}", 0);
	http_reply_free(&reply);
	for (; n < 64 && !refused; n++) {
		char name[32];
		zc_session_config config;
		snprintf(name, sizeof(name), "grow-%d", n);
		zc_session_config_default(&config);
		config.name = name;
		config.layers = 2;
		config.kv_heads = KV_HEADS;
		config.head_dim_k = config.head_dim_v = HEAD_DIM;
		config.max_tokens = 512;
		config.policy = ZC_POLICY_PER_CALL;
		int rc = zc_session_open(client, &config, &sessions[n]);
		for (uint32_t layer = 0; rc == 0 && layer < 2; layer++)
			rc = update(sessions[n], layer, 512, (uint32_t)n, false);
		ck_assert_msg(rc == 0 || rc == ZC_EEXHAUSTED, "session %d: %s (%s)", n, zc_strerror(rc),
			      zc_client_last_error(client));
		refused = rc == ZC_EEXHAUSTED;
	}
	ck_assert_msg(refused, "64 sessions fit a 4 MiB budget");
	scrape(m.port, &reply);
	double drops = sample(reply.body, "zipcache_relief_steps_total{step=\"drop_views\"}");
	double refusals = sample(reply.body, "zipcache_relief_steps_total{step=\"refuse\"}");
	ck_assert_msg(refusals >= 1 && drops >= refusals, "relief steps: drop_views %g, refuse %g",
		      drops, refusals);
	assert_promtool_accepts(reply.body, reply.body_len);
	http_reply_free(&reply);
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	for (int i = 0; i < n; i++)
		zc_session_release(sessions[i]);
	zc_client_close(client);
	metrics_daemon_stop(&m);
}
END_TEST

/* A restarted daemon that adopts a session counts what it holds. */
START_TEST(test_metrics_after_restart)
{
	struct metrics_daemon m;
	struct workload w;
	struct http_reply reply;

	metrics_daemon_start(&m, NULL);
	workload_run(&m.daemon, &w);
	daemon_stop(&m.daemon);
	daemon_restart(&m.daemon);
	ck_assert_msg(port_wait_accepting(m.port, 10000),
		      "the metrics endpoint did not come back on port %u", m.port);

	scrape(m.port, &reply);
	const char *body = reply.body;
	assert_promtool_accepts(body, reply.body_len);
	assert_sample_eq(body, "zipcache_sessions", 1);
	assert_sample_eq(body, "zipcache_stored_tokens", w.total.tokens);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"compressed\"}",
			 (double)w.total.compressed_key_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"compressed\"}",
			 (double)w.total.compressed_value_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"key\",kind=\"fp16\"}",
			 (double)w.total.fp16_key_bytes);
	assert_sample_eq(body, "zipcache_stored_bytes{tensor=\"value\",kind=\"fp16\"}",
			 (double)w.total.fp16_value_bytes);
	/* Counters start again at zero in a new process. */
	assert_sample_eq(body, "zipcache_requests_total{op=\"update_and_fetch\",status=\"ok\"}", 0);
	assert_sample_eq(body, "zipcache_tokens_appended_total", 0);
	http_reply_free(&reply);
	metrics_daemon_stop(&m);
}
END_TEST

/* ---- 2. the other paths and methods ---------------------------------------- */

START_TEST(test_healthz_404_405)
{
	struct metrics_daemon m;
	struct http_reply reply;
	int rc;

	metrics_daemon_start(&m, NULL);

	http_get(m.port, "/healthz", &reply);
	ck_assert_msg(reply.status == 200, "GET /healthz: status %d", reply.status);
	ck_assert_msg(reply.body && strncmp(reply.body, "ok", 2) == 0, "GET /healthz body '%s'",
		      reply.body ? reply.body : "(none)");
	http_reply_free(&reply);

	http_get(m.port, "/nope", &reply);
	ck_assert_msg(reply.status == 404, "GET /nope: status %d, want 404", reply.status);
	http_reply_free(&reply);

	http_get(m.port, "/metrics/extra", &reply);
	ck_assert_msg(reply.status == 404, "GET /metrics/extra: status %d, want 404", reply.status);
	http_reply_free(&reply);

	http_get(m.port, "/", &reply);
	ck_assert_msg(reply.status == 404, "GET /: status %d, want 404", reply.status);
	http_reply_free(&reply);

	/* A query string does not change the path. */
	http_get(m.port, "/metrics?x=1", &reply);
	ck_assert_msg(reply.status == 200, "GET /metrics?x=1: status %d, want 200", reply.status);
	http_reply_free(&reply);

	static const char post[] = "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
				   "Connection: close\r\n\r\nhello";
	rc = http_exchange(m.port, post, HTTP_TIMEOUT_MS, &reply);
	ck_assert_msg(rc == 0 && reply.status == 405, "POST /metrics: %s, status %d, want 405",
		      strerror(-rc), reply.status);
	http_reply_free(&reply);

	/* A chunked body is read and dropped too. */
	static const char chunked[] = "PUT /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
				      "Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
	rc = http_exchange(m.port, chunked, HTTP_TIMEOUT_MS, &reply);
	ck_assert_msg(rc == 0 && reply.status == 405, "chunked PUT /healthz: %s, status %d, want 405",
		      strerror(-rc), reply.status);
	http_reply_free(&reply);

	rc = http_exchange(m.port, "DELETE /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
			   HTTP_TIMEOUT_MS, &reply);
	ck_assert_msg(rc == 0 && reply.status == 405, "DELETE /metrics: %s, status %d, want 405",
		      strerror(-rc), reply.status);
	http_reply_free(&reply);

	/* HTTP/1.0 without a Host header is still a scrape. */
	rc = http_exchange(m.port, "GET /metrics HTTP/1.0\r\n\r\n", HTTP_TIMEOUT_MS, &reply);
	ck_assert_msg(rc == 0 && reply.status == 200, "HTTP/1.0 GET /metrics: %s, status %d",
		      strerror(-rc), reply.status);
	http_reply_free(&reply);

	metrics_daemon_stop(&m);
}
END_TEST

/* ---- 3. misbehaving HTTP peers --------------------------------------------- */

/* One update_and_fetch on a fresh client and session, within QUICK_MS. */
static void cache_works_quickly(const struct daemon_harness *daemon, const char *name,
				const char *while_what)
{
	int64_t start = now_ms();
	zc_client *client = client_connect(daemon);
	zc_session *session = session_open(client, name, 1, ZC_POLICY_PER_CALL);
	update_ok(session, 0, 8, 99);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	int64_t took = now_ms() - start;
	ck_assert_msg(took < QUICK_MS, "connect+open+update+close %s took %lld ms", while_what,
		      (long long)took);
}

START_TEST(test_partial_request_does_not_stall)
{
	struct metrics_daemon m;

	metrics_daemon_start(&m, NULL);
	int partial = tcp_connect(m.port);
	ck_assert_msg(partial >= 0, "connect: %s", strerror(-partial));
	ck_assert_int_eq(send_all(partial, "GET /metr", 9), 0);
	sleep_ms(100);

	cache_works_quickly(&m.daemon, "partial-1", "while a partial HTTP request is open");
	scrape_quickly_from(NULL, m.port, "while a partial HTTP request is open");

	/* More of the same request, still not whole: nothing changes. */
	ck_assert_int_eq(send_all(partial, "ics HTTP/1.1\r\nHost: x\r\n", 24), 0);
	sleep_ms(100);
	cache_works_quickly(&m.daemon, "partial-2", "while a partial HTTP request is open");
	scrape_quickly_from(NULL, m.port, "while a partial HTTP request is open");

	/* Its end: the held connection gets its answer. */
	ck_assert_int_eq(send_all(partial, "Connection: close\r\n\r\n", 21), 0);
	char buffer[256] = "";
	struct pollfd p = { .fd = partial, .events = POLLIN };
	ck_assert_msg(poll(&p, 1, HTTP_TIMEOUT_MS) == 1, "the completed request got no answer");
	ssize_t n = recv(partial, buffer, sizeof(buffer) - 1, 0);
	ck_assert_msg(n > 12 && strncmp(buffer, "HTTP/1.1 200", 12) == 0,
		      "the completed request got '%.40s'", buffer);
	close(partial);

	metrics_daemon_stop(&m);
}
END_TEST

#define SLOWLORIS_CONNECTIONS 100

/*
 * Many connections that each send part of a request and then nothing.
 * The endpoint's connection limits refuse most of them; those it takes
 * it must close after its idle timeout. Meanwhile the cache works at
 * full speed, another peer can scrape, and afterwards anyone can.
 */
START_TEST(test_slowloris)
{
	struct metrics_daemon m;
	int fds[SLOWLORIS_CONNECTIONS];
	int opened = 0;

	metrics_daemon_start(&m, NULL);
	int64_t start = now_ms();
	for (int i = 0; i < SLOWLORIS_CONNECTIONS; i++) {
		fds[i] = tcp_connect(m.port);
		if (fds[i] >= 0) {
			opened++;
			/* The peer may already have refused it: a failed send is fine. */
			send_all(fds[i], "GET /metrics HTTP/1.1\r\nX-Slow: ", 31);
		}
	}
	ck_assert_msg(opened > 0, "no connection opened at all");
	sleep_ms(200);

	cache_works_quickly(&m.daemon, "slowloris", "while 100 partial HTTP requests are open");
	/* 127.0.0.2 is another peer: the per-address limit keeps room for it. */
	int probe = tcp_connect_from("127.0.0.2", m.port);
	if (probe >= 0) {
		close(probe);
		scrape_quickly_from("127.0.0.2", m.port, "while 100 partial requests from 127.0.0.1 wait");
	} else {
		fprintf(stderr, "metrics_test: cannot connect from 127.0.0.2 (%s); skipping that check\n",
			strerror(-probe));
	}

	/* The endpoint closes every held connection within its idle timeout
	 * (plus slack for a slow, sanitized daemon). */
	int still_open = 0;
	for (int i = 0; i < SLOWLORIS_CONNECTIONS; i++) {
		if (fds[i] < 0)
			continue;
		int64_t left = start + HTTP_IDLE_TIMEOUT_MS + 5000 - now_ms();
		if (!wait_peer_closed(fds[i], left > 0 ? (int)left : 0))
			still_open++;
		close(fds[i]);
	}
	ck_assert_msg(still_open == 0,
		      "%d partial HTTP connections still open %d ms after they went silent",
		      still_open, HTTP_IDLE_TIMEOUT_MS + 5000);

	scrape_soon(m.port, "after the slow connections were dropped");
	cache_works_quickly(&m.daemon, "slowloris-after", "after the slowloris");
	metrics_daemon_stop(&m);
}
END_TEST

/*
 * While one peer holds its per-address share of partial connections, a
 * scrape from that same address gets an answer once the held ones time
 * out — never a hang past the idle timeout.
 */
START_TEST(test_same_address_scrape_after_idle_timeout)
{
	struct metrics_daemon m;
	int fds[HTTP_PER_IP_LIMIT + 4];
	static const char request[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

	metrics_daemon_start(&m, NULL);
	for (int i = 0; i < HTTP_PER_IP_LIMIT + 4; i++) {
		fds[i] = tcp_connect(m.port);
		if (fds[i] >= 0)
			send_all(fds[i], "GET /", 5);
	}
	sleep_ms(100);
	/* Keep retrying: refused at first, answered once the idle ones go. */
	int64_t start = now_ms(), deadline = start + HTTP_IDLE_TIMEOUT_MS + 5000;
	struct http_reply reply = { 0 };
	int rc;
	for (;;) {
		rc = http_exchange(m.port, request, 2000, &reply);
		if (rc == 0 && reply.status == 200)
			break;
		http_reply_free(&reply);
		ck_assert_msg(now_ms() < deadline,
			      "no scrape from 127.0.0.1 succeeded within %d ms while partial requests "
			      "from it went idle (last: %s)",
			      HTTP_IDLE_TIMEOUT_MS + 5000, rc ? strerror(-rc) : "closed without a reply");
		sleep_ms(100);
	}
	http_reply_free(&reply);
	for (int i = 0; i < HTTP_PER_IP_LIMIT + 4; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	metrics_daemon_stop(&m);
}
END_TEST

/* An oversized request gets an error status or a closed connection
 * (a reset or a failed send mid-request count as closed), never a page. */
static void assert_oversized_refused(uint16_t port, const char *request, size_t len,
				     const char *what)
{
	struct http_reply reply;
	int rc = http_exchange_from(NULL, port, request, len, HTTP_TIMEOUT_MS, &reply);

	ck_assert_msg(rc == 0 || rc == -ECONNRESET || rc == -EPIPE,
		      "%s: %s (want an error status or a closed connection)", what, strerror(-rc));
	ck_assert_msg(reply.status == 0 || reply.status >= 400, "%s answered with status %d", what,
		      reply.status);
	http_reply_free(&reply);
}

START_TEST(test_oversized_request)
{
	struct metrics_daemon m;
	size_t header_bytes = 1u << 20;

	metrics_daemon_start(&m, NULL);

	/* 1 MiB of headers, far past the endpoint's 32 KiB request memory. */
	char *request = malloc(header_bytes + 256);
	ck_assert(request != NULL);
	size_t len = (size_t)sprintf(request, "GET /metrics HTTP/1.1\r\nHost: x\r\n");
	while (len < header_bytes) {
		len += (size_t)sprintf(request + len, "X-Filler-%07zu: %0100d\r\n", len, 0);
	}
	len += (size_t)sprintf(request + len, "\r\n");
	assert_oversized_refused(m.port, request, len, "1 MiB of headers");

	/* One enormous header line. */
	len = (size_t)sprintf(request, "GET /metrics HTTP/1.1\r\nX-Big: ");
	memset(request + len, 'a', header_bytes - len);
	len = header_bytes;
	len += (size_t)sprintf(request + len, "\r\n\r\n");
	assert_oversized_refused(m.port, request, len, "a 1 MiB header line");

	/* A 1 MiB URL. */
	len = (size_t)sprintf(request, "GET /");
	memset(request + len, 'm', header_bytes - len);
	len = header_bytes;
	len += (size_t)sprintf(request + len, " HTTP/1.1\r\nHost: x\r\n\r\n");
	assert_oversized_refused(m.port, request, len, "a 1 MiB URL");

	/* A declared 1 GiB body on a GET: read and dropped, or refused. */
	static const char big_body[] = "POST /metrics HTTP/1.1\r\nHost: x\r\n"
				       "Content-Length: 1073741824\r\n\r\n";
	int fd = tcp_connect(m.port);
	ck_assert(fd >= 0);
	send_all(fd, big_body, strlen(big_body));
	memset(request, 'b', header_bytes);
	send_all(fd, request, header_bytes);   /* 1 MiB of the promised 1 GiB, then silence */
	close(fd);
	free(request);

	scrape_quickly_from(NULL, m.port, "after oversized requests");
	cache_works_quickly(&m.daemon, "oversized", "after oversized requests");
	metrics_daemon_stop(&m);
}
END_TEST

START_TEST(test_garbage_bytes)
{
	struct metrics_daemon m;
	struct http_reply reply;
	char garbage[8192];
	uint32_t state = 12345;

	metrics_daemon_start(&m, NULL);
	for (int round = 0; round < 20; round++) {
		size_t len = 64 + (size_t)round * 400;
		for (size_t i = 0; i < len; i++) {
			state = state * 1664525u + 1013904223u;
			garbage[i] = (char)(state >> 24);
		}
		/* Some rounds end like a request would, so the parser must decide. */
		if (round % 2)
			memcpy(garbage + len - 4, "\r\n\r\n", 4);
		int rc = http_exchange_from(NULL, m.port, garbage, len, 3000, &reply);
		/* An error status, a closed connection, or a connection held until
		 * its idle timeout (then we give up on it): never a 200. */
		ck_assert_msg(rc == 0 || rc == -ETIMEDOUT || rc == -ECONNRESET,
			      "garbage round %d: %s", round, strerror(-rc));
		ck_assert_msg(reply.status == 0 || reply.status >= 400,
			      "garbage round %d answered with status %d", round, reply.status);
		http_reply_free(&reply);
	}
	static const char *const malformed[] = {
		"GET\r\n\r\n",
		"GET /metrics\r\n\r\n",
		"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n",
		"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
		"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
		"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
		"GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n",
		"\x00\x01\x02 / HTTP/1.1\r\n\r\n",
		"GET /\x01\x7f\xff HTTP/1.1\r\nHost: x\r\n\r\n",
		"\r\n\r\n\r\n\r\n",
	};
	for (size_t i = 0; i < sizeof(malformed) / sizeof(malformed[0]); i++) {
		size_t len = i == 7 ? 19 : strlen(malformed[i]);
		int rc = http_exchange_from(NULL, m.port, malformed[i], len, 3000, &reply);
		ck_assert_msg(rc == 0 || rc == -ETIMEDOUT || rc == -ECONNRESET, "malformed #%zu: %s", i,
			      strerror(-rc));
		ck_assert_msg(reply.status != 200 || i == 3 || i == 5 || i == 6 || i == 9,
			      "malformed request #%zu answered 200", i);
		http_reply_free(&reply);
	}
	scrape_quickly_from(NULL, m.port, "after garbage");
	cache_works_quickly(&m.daemon, "garbage", "after garbage");
	metrics_daemon_stop(&m);
}
END_TEST

/* Scrapes while the daemon is busy with clients, and many scrapes one
 * after another: every one whole and valid. */
START_TEST(test_scrapes_under_load)
{
	struct metrics_daemon m;
	struct http_reply reply;

	metrics_daemon_start(&m, NULL);
	fflush(NULL);
	pid_t worker = fork();
	ck_assert(worker >= 0);
	if (worker == 0) {
		/* A helper process: report through the exit status only. */
		zc_client *client = NULL;
		zc_session *session = NULL;
		zc_session_config config;
		uint16_t block[KV_HEADS * 4 * HEAD_DIM] = { 0 };
		zc_view view;
		if (zc_client_connect(m.daemon.socket_path, CLIENT_TIMEOUT_MS, &client) < 0)
			_exit(2);
		zc_session_config_default(&config);
		config.layers = 1;
		config.batch = 1;
		config.kv_heads = KV_HEADS;
		config.head_dim_k = config.head_dim_v = HEAD_DIM;
		config.max_tokens = 4 * 200;
		config.policy = ZC_POLICY_PER_CALL;
		if (zc_session_open(client, &config, &session) < 0)
			_exit(3);
		for (int i = 0; i < 200; i++)
			if (zc_update_and_fetch(session, 0, 4, block, block, &view, NULL) < 0)
				_exit(4);
		zc_session_close(session);
		zc_client_close(client);
		_exit(0);
	}
	for (int i = 0; i < 30; i++) {
		scrape(m.port, &reply);
		ck_assert_msg(strstr(reply.body, "zipcache_uptime_seconds ") != NULL,
			      "scrape %d is cut short (%zu bytes)", i, reply.body_len);
		if (i % 10 == 0)
			assert_promtool_accepts(reply.body, reply.body_len);
		assert_histograms(reply.body);
		http_reply_free(&reply);
	}
	int status;
	ck_assert_int_eq(waitpid(worker, &status, 0), worker);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker status 0x%x", status);
	scrape(m.port, &reply);
	assert_sample_eq(reply.body, "zipcache_tokens_appended_total", 800);
	assert_sample_eq(reply.body, "zipcache_requests_total{op=\"update_and_fetch\",status=\"ok\"}",
			 200);
	http_reply_free(&reply);
	metrics_daemon_stop(&m);
}
END_TEST

/* ---- 4. a real Prometheus server ------------------------------------------- */

/* The string value of the first result of a Prometheus instant query
 * (`"value":[<ts>,"<v>"]`) into out; false if there is none. */
static bool prometheus_query(uint16_t port, const char *encoded_query, char *out, size_t size)
{
	char request[1024];
	struct http_reply reply;

	/* HTTP/1.0: the answer ends with the connection, never chunked. */
	snprintf(request, sizeof(request), "GET /api/v1/query?query=%s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
		 encoded_query);
	if (http_exchange(port, request, 5000, &reply) < 0 || reply.status != 200 || !reply.body) {
		http_reply_free(&reply);
		return false;
	}
	const char *value = strstr(reply.body, "\"value\":[");
	const char *open = value ? strstr(value, ",\"") : NULL;
	const char *close = open ? strchr(open + 2, '"') : NULL;
	bool found = close && (size_t)(close - open - 2) < size;
	if (found) {
		memcpy(out, open + 2, (size_t)(close - open - 2));
		out[close - open - 2] = '\0';
	}
	http_reply_free(&reply);
	return found;
}

START_TEST(test_prometheus_scrapes)
{
	struct metrics_daemon m;
	struct workload w;
	char dir[PATH_MAX + 16], path[PATH_MAX + 64], data[PATH_MAX + 64], value[64];
	char config_flag[PATH_MAX + 128], data_flag[PATH_MAX + 128], listen_flag[64], tail[2048];

	if (access(PROMETHEUS_PATH, X_OK) != 0) {
		fprintf(stderr, "metrics_test: SKIP test_prometheus_scrapes: %s is absent "
				"(Debian package prometheus; make deps installs it)\n",
			PROMETHEUS_PATH);
		return;
	}
	metrics_daemon_start(&m, NULL);
	workload_run(&m.daemon, &w);

	/* Its files live under the daemon's directory, removed with it. */
	snprintf(dir, sizeof(dir), "%s/prometheus", m.daemon.dir);
	ck_assert_msg(mkdir(dir, 0700) == 0, "mkdir %s: %s", dir, strerror(errno));
	snprintf(path, sizeof(path), "%s/prometheus.yml", dir);
	snprintf(data, sizeof(data), "%s/data", dir);
	FILE *yml = fopen(path, "w");
	ck_assert(yml != NULL);
	fprintf(yml,
		"global:\n"
		"  scrape_interval: 1s\n"
		"  scrape_timeout: 1s\n"
		"  evaluation_interval: 1s\n"
		"scrape_configs:\n"
		"  - job_name: zipcached\n"
		"    static_configs:\n"
		"      - targets: ['127.0.0.1:%u']\n",
		m.port);
	fclose(yml);

	uint16_t web_port = free_tcp_port();
	snprintf(config_flag, sizeof(config_flag), "--config.file=%s", path);
	snprintf(data_flag, sizeof(data_flag), "--storage.tsdb.path=%s", data);
	snprintf(listen_flag, sizeof(listen_flag), "--web.listen-address=127.0.0.1:%u", web_port);
	char log_path[PATH_MAX + 64];
	snprintf(log_path, sizeof(log_path), "%s/prometheus.log", dir);

	pid_t prometheus = fork_dying_with_parent(127);
	if (prometheus == 0) {
		int log = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		int null = open("/dev/null", O_RDONLY);
		if (null >= 0)
			dup2(null, STDIN_FILENO);
		if (log >= 0) {
			dup2(log, STDOUT_FILENO);
			dup2(log, STDERR_FILENO);
		}
		if (chdir(dir) < 0)
			_exit(126);
		execl(PROMETHEUS_PATH, PROMETHEUS_PATH, config_flag, data_flag, listen_flag,
		      "--log.level=warn", "--storage.tsdb.retention.time=1h",
		      (char *)NULL);
		_exit(127);
	}

	/* up == 1 for our job: Prometheus runs and scraped the endpoint. */
	int64_t deadline = now_ms() + 30000;
	bool up = false;
	while (!up) {
		int status;
		if (waitpid(prometheus, &status, WNOHANG) == prometheus) {
			FILE *log = fopen(log_path, "r");
			size_t n = log ? fread(tail, 1, sizeof(tail) - 1, log) : 0;
			tail[n] = '\0';
			if (log)
				fclose(log);
			ck_abort_msg("prometheus exited (status 0x%x):\n%s", status, tail);
		}
		up = prometheus_query(web_port, "up%7Bjob%3D%22zipcached%22%7D", value, sizeof(value)) &&
		     strcmp(value, "1") == 0;
		if (!up) {
			if (now_ms() > deadline) {
				kill(prometheus, SIGKILL);
				waitpid(prometheus, NULL, 0);
				ck_abort_msg("Prometheus did not report up=1 for 127.0.0.1:%u within 30 s "
					     "(last value '%s')", m.port, value);
			}
			sleep_ms(250);
		}
	}

	/* Its stored sample equals the workload's count. */
	char want[32];
	snprintf(want, sizeof(want), "%u", w.updates_ok);
	bool equal = false;
	deadline = now_ms() + 10000;
	while (!equal && now_ms() < deadline) {
		value[0] = '\0';
		equal = prometheus_query(web_port,
					 "zipcache_requests_total%7Bop%3D%22update_and_fetch%22%2C"
					 "status%3D%22ok%22%7D",
					 value, sizeof(value)) &&
			strcmp(value, want) == 0;
		if (!equal)
			sleep_ms(250);
	}
	ck_assert_msg(equal, "Prometheus says update_and_fetch ok = '%s', want %s", value, want);

	snprintf(want, sizeof(want), "%u", w.total.tokens);
	ck_assert_msg(prometheus_query(web_port, "zipcache_stored_tokens", value, sizeof(value)) &&
			      strcmp(value, want) == 0,
		      "Prometheus says zipcache_stored_tokens = '%s', want %s", value, want);
	/* A histogram Prometheus can take a quantile of. */
	ck_assert_msg(prometheus_query(web_port,
				       "histogram_quantile(0.5%2C%20zipcache_request_duration_seconds_bucket"
				       "%7Bop%3D%22update_and_fetch%22%7D)",
				       value, sizeof(value)),
		      "no histogram_quantile over zipcache_request_duration_seconds");
	ck_assert_msg(strcmp(value, "NaN") != 0 && atof(value) > 0,
		      "median update_and_fetch latency '%s'", value);
	/* No scrape failed: Prometheus took every sample it was given. */
	ck_assert_msg(prometheus_query(web_port,
				       "scrape_samples_post_metric_relabeling%7Bjob%3D%22zipcached%22%7D",
				       value, sizeof(value)) &&
			      atof(value) > 100,
		      "scrape_samples_post_metric_relabeling = '%s'", value);

	kill(prometheus, SIGTERM);
	int64_t stop_deadline = now_ms() + 10000;
	int status;
	while (waitpid(prometheus, &status, WNOHANG) == 0) {
		if (now_ms() > stop_deadline) {
			kill(prometheus, SIGKILL);
			waitpid(prometheus, &status, 0);
			break;
		}
		sleep_ms(20);
	}
	directory_remove(dir);
	metrics_daemon_stop(&m);
}
END_TEST

/* ---- 5. --metrics-listen off, and when the port is taken ------------------ */

START_TEST(test_metrics_listen_off)
{
	struct daemon_harness daemon;
	char listen_arg[64];
	uint16_t port = free_tcp_port();

	/* The later flag wins: a configured address turned off. */
	snprintf(listen_arg, sizeof(listen_arg), "127.0.0.1:%u", port);
	const char *args[] = { "--metrics-listen", listen_arg, "--metrics-listen", "off", NULL };
	daemon_start(&daemon, args);
	sleep_ms(200);
	int fd = tcp_connect(port);
	ck_assert_msg(fd == -ECONNREFUSED, "connect to 127.0.0.1:%u with metrics off: %s", port,
		      fd >= 0 ? "accepted" : strerror(-fd));
	ck_assert_msg(process_tcp_sockets(daemon.pid) == 0,
		      "zipcached holds TCP sockets with --metrics-listen off");
	cache_works_quickly(&daemon, "off", "with metrics off");
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* With its port taken, the daemon says so and serves the cache anyway. */
START_TEST(test_metrics_port_taken)
{
	struct daemon_harness daemon;
	struct sockaddr_in address = { .sin_family = AF_INET };
	socklen_t length = sizeof(address);
	char listen_arg[64], tail[4096];
	int holder = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert(bind(holder, (struct sockaddr *)&address, sizeof(address)) == 0);
	ck_assert(listen(holder, 4) == 0);
	ck_assert(getsockname(holder, (struct sockaddr *)&address, &length) == 0);
	snprintf(listen_arg, sizeof(listen_arg), "127.0.0.1:%u", ntohs(address.sin_port));
	const char *args[] = { "--metrics-listen", listen_arg, NULL };
	daemon_start(&daemon, args);
	cache_works_quickly(&daemon, "taken", "with its metrics port taken");
	daemon_log_tail(&daemon, tail, sizeof(tail));
	ck_assert_msg(strstr(tail, "metrics") != NULL,
		      "the daemon did not say that its metrics endpoint is off; log:\n%s", tail);
	ck_assert_msg(process_tcp_sockets(daemon.pid) == 0,
		      "zipcached holds a TCP socket although its port was taken");
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
	close(holder);
}
END_TEST

/* IPv6 loopback, "[::1]:PORT". */
START_TEST(test_metrics_listen_ipv6)
{
	struct daemon_harness daemon;
	struct sockaddr_in6 address = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
	socklen_t length = sizeof(address);
	char listen_arg[64];
	int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0 || bind(fd, (struct sockaddr *)&address, sizeof(address)) < 0) {
		fprintf(stderr, "metrics_test: SKIP test_metrics_listen_ipv6: no ::1 here (%s)\n",
			strerror(errno));
		if (fd >= 0)
			close(fd);
		return;
	}
	getsockname(fd, (struct sockaddr *)&address, &length);
	uint16_t port = ntohs(address.sin6_port);
	close(fd);
	snprintf(listen_arg, sizeof(listen_arg), "[::1]:%u", port);
	const char *args[] = { "--metrics-listen", listen_arg, NULL };
	daemon_start(&daemon, args);

	int64_t deadline = now_ms() + 10000;
	char reply[256] = "";
	for (;;) {
		fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
		address.sin6_port = htons(port);
		if (connect(fd, (struct sockaddr *)&address, sizeof(address)) == 0)
			break;
		close(fd);
		ck_assert_msg(now_ms() < deadline, "nothing listens on [::1]:%u", port);
		sleep_ms(10);
	}
	static const char request[] = "GET /healthz HTTP/1.0\r\n\r\n";
	ck_assert_int_eq(send_all(fd, request, strlen(request)), 0);
	struct pollfd p = { .fd = fd, .events = POLLIN };
	ck_assert(poll(&p, 1, HTTP_TIMEOUT_MS) == 1);
	ssize_t n = recv(fd, reply, sizeof(reply) - 1, 0);
	ck_assert_msg(n > 12 && strncmp(reply + 9, "200", 3) == 0, "GET /healthz on [::1]: '%.40s'",
		      reply);
	close(fd);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* /healthz says "stopping" (503) or the listener is gone once SIGTERM
 * arrives; either way the daemon exits 0. */
START_TEST(test_sigterm_with_open_http_connections)
{
	struct metrics_daemon m;
	int held[8];

	metrics_daemon_start(&m, NULL);
	for (int i = 0; i < 8; i++) {
		held[i] = tcp_connect(m.port);
		ck_assert(held[i] >= 0);
		send_all(held[i], "GET /metrics HTTP/1.1\r\n", 23);
	}
	sleep_ms(100);
	int64_t start = now_ms();
	metrics_daemon_stop(&m);
	/* Held HTTP connections must not delay the exit to the idle timeout. */
	ck_assert_msg(now_ms() - start < HTTP_IDLE_TIMEOUT_MS,
		      "SIGTERM took %lld ms with partial HTTP requests open",
		      (long long)(now_ms() - start));
	for (int i = 0; i < 8; i++) {
		ck_assert_msg(wait_peer_closed(held[i], 2000),
			      "an HTTP connection outlived the daemon's exit");
		close(held[i]);
	}
}
END_TEST

/*
 * The daemons' directories (the harness makes them under $TMPDIR) go
 * under one directory per test case, made and removed by the runner
 * process: a failed assertion ends a forked test with _exit(), past the
 * harness's atexit cleanup, so only the runner can remove them reliably.
 */
static char base_dir[64];
static char *saved_tmpdir;

static void base_dir_make(void)
{
	const char *tmpdir = getenv("TMPDIR");
	snprintf(base_dir, sizeof(base_dir), "/tmp/zc_metrics.XXXXXX");
	if (!mkdtemp(base_dir)) {
		fprintf(stderr, "metrics_test: mkdtemp: %s\n", strerror(errno));
		base_dir[0] = '\0';
		return;
	}
	free(saved_tmpdir);
	saved_tmpdir = tmpdir ? strdup(tmpdir) : NULL;
	setenv("TMPDIR", base_dir, 1);
}

static void base_dir_remove(void)
{
	if (!base_dir[0])
		return;
	directory_remove(base_dir);
	base_dir[0] = '\0';
	if (saved_tmpdir)
		setenv("TMPDIR", saved_tmpdir, 1);
	else
		unsetenv("TMPDIR");
}

static Suite *metrics_suite(void)
{
	Suite *suite = suite_create("metrics");
	TCase *scrapes = tcase_create("scrapes");
	TCase *robust = tcase_create("robustness");
	TCase *prometheus = tcase_create("prometheus");
	TCase *listening = tcase_create("listen");

	tcase_add_unchecked_fixture(scrapes, base_dir_make, base_dir_remove);
	tcase_set_timeout(scrapes, TEST_TIMEOUT_SECONDS);
	tcase_add_test(scrapes, test_metrics_after_workload);
	tcase_add_test(scrapes, test_metrics_fresh_daemon_valid);
	tcase_add_test(scrapes, test_healthz_404_405);
	tcase_add_test(scrapes, test_scrapes_under_load);
	tcase_add_test(scrapes, test_metrics_error_reasons);
	tcase_add_test(scrapes, test_metrics_after_idle_expiry);
	tcase_add_test(scrapes, test_metrics_relief_steps);
	tcase_add_test(scrapes, test_metrics_after_restart);
	suite_add_tcase(suite, scrapes);

	tcase_add_unchecked_fixture(robust, base_dir_make, base_dir_remove);
	tcase_set_timeout(robust, TEST_TIMEOUT_SECONDS);
	tcase_add_test(robust, test_partial_request_does_not_stall);
	tcase_add_test(robust, test_slowloris);
	tcase_add_test(robust, test_same_address_scrape_after_idle_timeout);
	tcase_add_test(robust, test_oversized_request);
	tcase_add_test(robust, test_garbage_bytes);
	tcase_add_test(robust, test_sigterm_with_open_http_connections);
	suite_add_tcase(suite, robust);

	tcase_add_unchecked_fixture(prometheus, base_dir_make, base_dir_remove);
	tcase_set_timeout(prometheus, PROMETHEUS_TEST_TIMEOUT_SECONDS);
	tcase_add_test(prometheus, test_prometheus_scrapes);
	suite_add_tcase(suite, prometheus);

	tcase_add_unchecked_fixture(listening, base_dir_make, base_dir_remove);
	tcase_set_timeout(listening, TEST_TIMEOUT_SECONDS);
	tcase_add_test(listening, test_metrics_listen_off);
	tcase_add_test(listening, test_metrics_port_taken);
	tcase_add_test(listening, test_metrics_listen_ipv6);
	suite_add_tcase(suite, listening);
	return suite;
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	return suite_main(metrics_suite(), CK_FORK_GETENV);
}
