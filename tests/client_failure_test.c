/*
 * The client library after a failure.
 *
 * A timed-out request may still be answered later: before, the next call
 * read that stale reply as its own, and took its descriptors. Now a
 * timeout or a protocol error marks the connection broken (hiredis's
 * c->err): every later call fails at once with ZC_EBROKEN without touching
 * the socket, and only zc_client_reconnect() clears it.
 *
 * Deterministic peers force each failure: a fake daemon (a helper process
 * speaking the wire protocol from a script: it holds a reply until the
 * test says so, answers another request id, announces descriptors it does
 * not send, sends garbage, hangs up), a real zipcached stopped with
 * SIGSTOP, and a real session file whose layer sequence is left odd, as a
 * daemon killed in the middle of a write leaves it. No assertion depends
 * on how fast anything runs: the short client timeouts only ever expire
 * against a peer that cannot answer, and every other wait is generous.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "frame.h"
#include "layer_model.h"
#include "process_run.h"
#include "store_format.h"
#include "version.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* Generous: a few dozen round trips, but ASan and a busy machine. */
#define TEST_TIMEOUT_SECONDS 120

/* The client timeout a call gets when its peer is known not to answer:
 * it can only expire, so its length decides nothing but the test's pace. */
#define SHORT_TIMEOUT_MS 200

/* ---- the fake daemon ---------------------------------------------------------- */

/* What the fake does with each request it reads, in order, across connections. */
enum fake_step {
	FAKE_ANSWER,          /* a well-formed reply */
	FAKE_HOLD,            /* the same, once the test writes a byte on the go pipe */
	FAKE_WRONG_ID,        /* a reply that names another request */
	FAKE_FD_MISSING,      /* announces one descriptor and sends none */
	FAKE_FD_UNANNOUNCED,  /* sends a descriptor its reply does not announce */
	FAKE_GARBAGE,         /* a frame that is no Response */
	FAKE_HANG_UP,         /* closes the connection without a reply */
	FAKE_END
};

struct fake {
	char dir[64];
	char socket_path[108];
	char log_path[PATH_MAX];
	int listen_fd;
	int go[2];
	const enum fake_step *script;
	pid_t pid;
};

static bool read_all(int fd, void *buffer, size_t len)
{
	uint8_t *p = buffer;
	while (len > 0) {
		ssize_t n = read(fd, p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return false;
		p += n;
		len -= (size_t)n;
	}
	return true;
}

/* One frame, with fd beside its first byte when fd >= 0. */
static bool fake_send(int conn, const uint8_t *frame, size_t len, int fd)
{
	union {
		struct cmsghdr header;
		char bytes[CMSG_SPACE(sizeof(int))];
	} control;
	struct iovec iov = { (void *)frame, len };
	struct msghdr message = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (fd >= 0) {
		message.msg_control = control.bytes;
		message.msg_controllen = sizeof(control.bytes);
		struct cmsghdr *c = CMSG_FIRSTHDR(&message);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	return sendmsg(conn, &message, MSG_NOSIGNAL) == (ssize_t)len;
}

/* A staging buffer whose first byte says which reply it came with. */
static int fake_buffer(uint64_t bytes, char marker)
{
	int fd = memfd_create("fake-staging", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)bytes) < 0 || pwrite(fd, &marker, 1, 0) != 1)
		return -1;
	return fd;
}

/* Answers one request as the script says; false when the connection ends. */
static bool fake_answer(struct fake *f, int conn, const wire_pb_request *request, enum fake_step step,
			unsigned serial, FILE *log)
{
	wire_pb_response response;
	uint8_t frame[4096];
	size_t len;
	int fd = -1;
	char go;

	memset(&response, 0, sizeof(response));
	response.msg.request_id = request->msg.request_id;
	switch (request->msg.which_op) {
	case zipcache_v1_Request_hello_tag:
		response.msg.which_op = zipcache_v1_Response_hello_tag;
		response.msg.op.hello.protocol_version = ZIPCACHE_PROTOCOL_VERSION;
		response.msg.op.hello.boot_epoch = 42;
		response.msg.op.hello.max_frame_bytes = 1u << 20;
		response.msg.op.hello.max_inline_bytes = 1u << 16;
		break;
	case zipcache_v1_Request_stats_tag:
		response.msg.which_op = zipcache_v1_Response_stats_tag;
		response.msg.op.stats.sessions = serial;  /* which reply this is */
		break;
	case zipcache_v1_Request_staging_tag:
		response.msg.which_op = zipcache_v1_Response_staging_tag;
		response.msg.op.staging.bytes = request->msg.op.staging.bytes;
		fd = fake_buffer(request->msg.op.staging.bytes, (char)('A' + serial % 26));
		if (fd < 0)
			return false;
		response.msg.fds = 1;
		break;
	default:
		wire_pb_response_set_status(&response, ZC_EINTERNAL, "the fake serves hello, stats, staging");
		break;
	}
	switch (step) {
	case FAKE_HOLD:
		if (!read_all(f->go[0], &go, 1))
			return false;
		break;
	case FAKE_WRONG_ID:
		response.msg.request_id += 1000;
		break;
	case FAKE_FD_MISSING:
		response.msg.fds = 1;
		if (fd >= 0)
			close(fd);
		fd = -1;
		break;
	case FAKE_FD_UNANNOUNCED:
		response.msg.fds = 0;
		if (fd < 0)
			fd = fake_buffer(4096, 'U');
		break;
	case FAKE_GARBAGE: {
		static const uint8_t garbage[] = { 4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff };
		fprintf(log, "sent %u\n", serial);
		return fake_send(conn, garbage, sizeof(garbage), -1);
	}
	case FAKE_HANG_UP:
		if (fd >= 0)
			close(fd);
		return false;
	default:
		break;
	}
	if (wire_pb_response_encode(&response, frame, sizeof(frame), &len) < 0)
		return false;
	bool sent = fake_send(conn, frame, len, fd);
	if (fd >= 0)
		close(fd);
	fprintf(log, "sent %u\n", serial);
	return sent;
}

static int fake_main(void *arg)
{
	struct fake *f = arg;
	FILE *log = fopen(f->log_path, "w");
	unsigned serial = 0;

	if (!log)
		return 1;
	setvbuf(log, NULL, _IONBF, 0);
	for (;;) {
		int conn = accept(f->listen_fd, NULL, NULL);
		if (conn < 0)
			return 1;
		for (;;) {
			uint8_t header[FRAME_HEADER_BYTES], body[4096];
			wire_pb_request request;

			if (!read_all(conn, header, sizeof(header)))
				break;  /* the client hung up: on to its next connection */
			uint32_t len = frame_header_read(header);
			if (len > sizeof(body) || !read_all(conn, body, len))
				return 1;
			if (wire_pb_request_decode(body, len, &request) < 0)
				return 1;
			enum fake_step step = f->script[serial];
			fprintf(log, "request %u op %u\n", serial, (unsigned)request.msg.which_op);
			if (step == FAKE_END)
				return 1;  /* more requests than the script: the test says so */
			bool more = fake_answer(f, conn, &request, step, serial, log);
			serial++;
			if (!more)
				break;
		}
		close(conn);
	}
}

static void fake_start(struct fake *f, const enum fake_step *script)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };

	memset(f, 0, sizeof(*f));
	snprintf(f->dir, sizeof(f->dir), "/tmp/zc-fake-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	snprintf(f->socket_path, sizeof(f->socket_path), "%s/f.sock", f->dir);
	snprintf(f->log_path, sizeof(f->log_path), "%s/fake.log", f->dir);
	f->script = script;
	f->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(f->listen_fd, 0);
	snprintf(address.sun_path, sizeof(address.sun_path), "%s", f->socket_path);
	ck_assert_int_eq(bind(f->listen_fd, (struct sockaddr *)&address, sizeof(address)), 0);
	ck_assert_int_eq(listen(f->listen_fd, 4), 0);
	ck_assert_int_eq(pipe2(f->go, O_CLOEXEC), 0);
	f->pid = child_spawn(fake_main, f, f->go[1]);
	close(f->go[0]);
	f->go[0] = -1;
}

static void fake_stop(struct fake *f)
{
	if (f->pid > 0) {
		kill(f->pid, SIGKILL);
		waitpid(f->pid, NULL, 0);
		f->pid = 0;
	}
	if (f->listen_fd >= 0)
		close(f->listen_fd);
	f->listen_fd = -1;
	if (f->go[1] >= 0)
		close(f->go[1]);
	f->go[1] = -1;
	directory_remove(f->dir);
}

/* The fake's log so far (malloc'd). */
static char *fake_log(const struct fake *f)
{
	return file_read_whole(f->log_path, NULL);
}

/* Waits (generously) until the fake has sent the reply of request `serial`. */
static void fake_wait_sent(const struct fake *f, unsigned serial)
{
	char needle[32];
	int64_t deadline = now_ms() + 20000;

	snprintf(needle, sizeof(needle), "sent %u\n", serial);
	for (;;) {
		char *log = fake_log(f);
		bool found = strstr(log, needle) != NULL;
		free(log);
		if (found)
			return;
		ck_assert_msg(now_ms() < deadline, "the fake never sent reply %u", serial);
		sleep_ms(10);
	}
}

/* How many requests the fake has read so far. */
static unsigned fake_requests(const struct fake *f)
{
	char *log = fake_log(f);
	unsigned count = 0;

	for (const char *p = log; (p = strstr(p, "request ")); p++)
		count++;
	free(log);
	return count;
}

static int open_fds(void)
{
	DIR *dir = opendir("/proc/self/fd");
	struct dirent *entry;
	int count = 0;

	ck_assert_ptr_nonnull(dir);
	while ((entry = readdir(dir)))
		if (entry->d_name[0] != '.')
			count++;
	closedir(dir);
	return count - 1;  /* the directory's own descriptor */
}

/* The client refuses at once with ZC_EBROKEN, naming the first failure. */
static void assert_broken(zc_client *client, int first, const char *what)
{
	zc_server_stats stats;
	void *buffer;
	size_t count;
	int rc;

	ck_assert_msg(zc_client_broken(client) == first, "%s: zc_client_broken is %s, expected %s",
		      what, zc_error_name(zc_client_broken(client)), zc_error_name(first));
	rc = zc_client_stats(client, &stats);
	assert_refused(client, rc, ZC_EBROKEN, "zc_client_reconnect", what);
	ck_assert_msg(strstr(zc_client_last_error(client), zc_error_name(first)) != NULL,
		      "%s: '%s' does not name %s", what, zc_client_last_error(client),
		      zc_error_name(first));
	ck_assert_int_eq(zc_client_list_sessions(client, NULL, 0, &count), ZC_EBROKEN);
	ck_assert_int_eq(zc_client_staging(client, 4096, &buffer), ZC_EBROKEN);
	ck_assert_int_eq(zc_client_close_session(client, 1), ZC_EBROKEN);
}

START_TEST(late_reply_never_answers_the_next_call)
{
	static const enum fake_step script[] = {
		FAKE_ANSWER,  /* 0: hello */
		FAKE_HOLD,    /* 1: staging, answered after the client gave up */
		FAKE_ANSWER,  /* 2: hello of the reconnect */
		FAKE_ANSWER,  /* 3: staging again */
		FAKE_END
	};
	struct fake f;
	zc_client *client;
	void *buffer;

	fake_start(&f, script);
	ck_assert_int_eq(zc_client_connect(f.socket_path, CLIENT_TIMEOUT_MS, &client), 0);
	int baseline = open_fds();

	ck_assert_int_eq(zc_client_set_timeout(client, SHORT_TIMEOUT_MS), 0);
	int rc = zc_client_staging(client, 4096, &buffer);
	assert_refused(client, rc, -ETIMEDOUT, "timed out", "staging against a fake that holds it");

	/* The stale reply, with its descriptor, is now in the client's socket. */
	ck_assert_int_eq(write(f.go[1], "g", 1), 1);
	fake_wait_sent(&f, 1);
	assert_broken(client, -ETIMEDOUT, "after the late reply arrived");
	/* None of those calls reached the peer. */
	ck_assert_uint_eq(fake_requests(&f), 2);

	ck_assert_int_eq(zc_client_set_timeout(client, CLIENT_TIMEOUT_MS), 0);
	ck_assert_int_eq(zc_client_reconnect(client), 0);
	ck_assert_int_eq(zc_client_broken(client), 0);
	rc = zc_client_staging(client, 4096, &buffer);
	ck_assert_msg(rc == 0, "staging after reconnect: %s '%s'", zc_error_name(rc),
		      zc_client_last_error(client));
	/* Reply 3's buffer ('D'), not the stale reply 1's ('B'). */
	ck_assert_int_eq(((const char *)buffer)[0], 'D');
	/* The stale descriptor went with the old socket. */
	ck_assert_int_eq(open_fds(), baseline);

	zc_client_close(client);
	fake_stop(&f);
}
END_TEST

/* A daemon that makes no request rings (max_ring_bytes 0 in its hello,
 * as every daemon older than rings) is never asked for one: an older one
 * would have made a staging buffer instead, in place of the one the
 * client maps. The client stays on the socket, usable. */
START_TEST(a_daemon_without_rings_is_not_asked)
{
	static const enum fake_step script[] = {
		FAKE_ANSWER,  /* 0: hello, no max_ring_bytes */
		FAKE_ANSWER,  /* 1: staging ('B') */
		FAKE_ANSWER,  /* 2: stats */
		FAKE_END
	};
	struct fake f;
	zc_client *client;
	void *buffer;
	size_t bytes = 1;
	uint64_t doorbells;
	zc_server_stats stats;

	fake_start(&f, script);
	ck_assert_int_eq(zc_client_connect(f.socket_path, CLIENT_TIMEOUT_MS, &client), 0);
	int baseline = open_fds();
	ck_assert_uint_eq(zc_client_server_info(client)->max_ring_bytes, 0);
	ck_assert_int_eq(zc_client_set_async_ring(client, ZC_ASYNC_RING_BYTES), 0);
	ck_assert_int_eq(zc_client_async_ring(client, &bytes, &doorbells), 0);
	ck_assert_uint_eq(bytes, 0);
	ck_assert_uint_eq(fake_requests(&f), 1);
	ck_assert_int_eq(zc_client_staging(client, 4096, &buffer), 0);
	ck_assert_int_eq(((const char *)buffer)[0], 'B');
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	ck_assert_uint_eq(fake_requests(&f), 3);
	ck_assert_int_eq(open_fds(), baseline);
	zc_client_close(client);
	fake_stop(&f);
}
END_TEST

START_TEST(protocol_errors_break_the_connection)
{
	static const enum fake_step script[] = {
		FAKE_ANSWER, FAKE_WRONG_ID,        /* 0, 1 */
		FAKE_ANSWER, FAKE_FD_MISSING,      /* 2, 3 */
		FAKE_ANSWER, FAKE_FD_UNANNOUNCED,  /* 4, 5 */
		FAKE_ANSWER, FAKE_GARBAGE,         /* 6, 7 */
		FAKE_ANSWER, FAKE_HANG_UP,         /* 8, 9 */
		FAKE_ANSWER, FAKE_ANSWER,          /* 10, 11 */
		FAKE_END
	};
	static const struct {
		const char *what;
		bool staging;
		int rc;
		const char *needle;
	} failures[] = {
		{ "a reply to another request", false, ZC_EPROTOCOL, "reply to request" },
		{ "a descriptor announced, none sent", true, ZC_EPROTOCOL, "announced 1 descriptors, 0 arrived" },
		{ "a descriptor sent, none announced", false, ZC_EPROTOCOL, "no reply announced" },
		{ "a frame that does not decode", false, ZC_EPROTOCOL, "malformed reply" },
		{ "the peer hangs up", false, -ECONNRESET, "closed the connection" },
	};
	struct fake f;
	zc_client *client;
	zc_server_stats stats;
	void *buffer;

	fake_start(&f, script);
	ck_assert_int_eq(zc_client_connect(f.socket_path, CLIENT_TIMEOUT_MS, &client), 0);
	int baseline = open_fds();
	for (size_t i = 0; i < sizeof(failures) / sizeof(failures[0]); i++) {
		int rc = failures[i].staging ? zc_client_staging(client, 4096, &buffer) :
					       zc_client_stats(client, &stats);
		assert_refused(client, rc, failures[i].rc, failures[i].needle, failures[i].what);
		assert_broken(client, failures[i].rc, failures[i].what);
		rc = zc_client_reconnect(client);
		ck_assert_msg(rc == 0, "%s: reconnect: %s '%s'", failures[i].what, zc_error_name(rc),
			      zc_client_last_error(client));
		ck_assert_int_eq(open_fds(), baseline);
	}
	/* Reply 11 and no other: the stream is in step again. */
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	ck_assert_uint_eq(stats.sessions, 11);
	ck_assert_uint_eq(fake_requests(&f), 12);
	zc_client_close(client);
	fake_stop(&f);
}
END_TEST

START_TEST(failed_reconnect_stays_broken)
{
	static const enum fake_step script[] = { FAKE_ANSWER, FAKE_HANG_UP, FAKE_END };
	struct fake f;
	zc_client *client;
	zc_server_stats stats;

	fake_start(&f, script);
	ck_assert_int_eq(zc_client_connect(f.socket_path, CLIENT_TIMEOUT_MS, &client), 0);
	int rc = zc_client_stats(client, &stats);
	assert_refused(client, rc, -ECONNRESET, "closed", "hang-up");
	/* Nobody listens any more. */
	fake_stop(&f);
	rc = zc_client_reconnect(client);
	ck_assert_msg(rc == -ENOENT || rc == -ECONNREFUSED, "reconnect to nothing: %s",
		      zc_error_name(rc));
	assert_broken(client, rc, "after a failed reconnect");
	zc_client_close(client);
}
END_TEST

/* ---- a real daemon, stopped ------------------------------------------------------ */

/* A real daemon, a client, one small streaming session and its model. */
struct live {
	struct daemon_harness daemon;
	zc_session_config config;
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
};

static void live_start(struct live *t, const char *name, uint64_t seed)
{
	daemon_start(&t->daemon, NULL);
	t->config = streaming_config(name, 2, 2, 32, 512, 16);
	t->client = connect_client(&t->daemon);
	t->session = open_session(t->client, &t->config);
	model_init(&t->model, &t->config);
	rng_seed(&t->rng, seed);
}

/* Everything goes, and the daemon exits 0. */
static void live_finish(struct live *t)
{
	model_free(&t->model);
	zc_session_release(t->session);
	zc_client_close(t->client);
	daemon_stop(&t->daemon);
	daemon_cleanup(&t->daemon);
}

/* Tokens in one layer, through the view (generous bound on the wait). */
static uint32_t wait_layer_tokens(zc_session *session, uint32_t layer, uint32_t want)
{
	int64_t deadline = now_ms() + 20000;
	zc_view view;

	for (;;) {
		int rc = zc_session_view(session, layer, &view);
		ck_assert_msg(rc == 0, "view: %s", zc_error_name(rc));
		if (view.tokens == want || now_ms() > deadline)
			return view.tokens;
		sleep_ms(10);
	}
}

START_TEST(stopped_daemon_times_out_and_the_session_stays_whole)
{
	struct live t;
	struct block block;
	zc_view view;

	live_start(&t, "stopped", 21);
	for (uint32_t step = 0; step < 6; step++)
		CHECK(update_checked, t.client, t.session, &t.model, &t.rng, step % 2, 5 + step);
	uint32_t before = t.model.layer[0].tokens;

	ck_assert_int_eq(kill(t.daemon.pid, SIGSTOP), 0);
	ck_assert_int_eq(zc_client_set_timeout(t.client, SHORT_TIMEOUT_MS), 0);
	block_make(&block, &t.model, 7, &t.rng);
	int rc = zc_update_and_fetch(t.session, 0, 7, block.keys, block.values, &view, NULL);
	assert_refused(t.client, rc, -ETIMEDOUT, "timed out", "update to a stopped daemon");
	assert_broken(t.client, -ETIMEDOUT, "while the daemon is stopped");
	ck_assert_int_eq(zc_session_view(t.session, 1, &view), ZC_EBROKEN);
	ck_assert_int_eq(zc_update_and_fetch(t.session, 1, 1, block.keys, block.values, &view, NULL),
			 ZC_EBROKEN);

	ck_assert_int_eq(kill(t.daemon.pid, SIGCONT), 0);
	ck_assert_int_eq(zc_client_set_timeout(t.client, CLIENT_TIMEOUT_MS), 0);
	/* The daemon runs again, and its late reply may be on its way: still broken. */
	assert_broken(t.client, -ETIMEDOUT, "after SIGCONT");
	rc = zc_client_reconnect(t.client);
	ck_assert_msg(rc == 0, "reconnect: %s '%s'", zc_error_name(rc), zc_client_last_error(t.client));

	/* The request was whole in the daemon's socket: it lands, once and whole. */
	ck_assert_uint_eq(wait_layer_tokens(t.session, 0, before + 7), before + 7);
	ck_assert_int_eq(model_update(&t.model, 0, 7, block.keys, block.values), 0);
	block_free(&block);
	CHECK(session_matches, t.session, &t.model);
	for (uint32_t step = 0; step < 4; step++)
		CHECK(update_checked, t.client, t.session, &t.model, &t.rng, step % 2, 3);
	CHECK(session_matches, t.session, &t.model);
	live_finish(&t);
}
END_TEST

/* ---- an odd layer sequence ------------------------------------------------------- */

/* The header and views every client of this session maps (the daemon's
 * views memfd), opened read-write: the test runs as root, past its 0400. */
static int session_views_open(const struct daemon_harness *daemon, const char *name)
{
	char path[64];
	int passed = raw_view_descriptor(daemon->socket_path, name);
	ck_assert_msg(passed >= 0, "no view descriptor for session '%s'", name);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", passed);
	int fd = open(path, O_RDWR | O_CLOEXEC);
	ck_assert_msg(fd >= 0, "reopening the views of '%s' read-write: %s", name, strerror(errno));
	close(passed);
	return fd;
}

static off_t sequence_offset(uint32_t layer)
{
	return (off_t)(offsetof(zc_map_header, layer) + layer * sizeof(zc_map_layer) +
		       offsetof(zc_map_layer, sequence));
}

/* Leaves the layer as a writer killed mid-write does; returns the old value. */
static uint64_t sequence_make_odd(int fd, uint32_t layer)
{
	uint64_t sequence, odd;

	ck_assert_int_eq(pread(fd, &sequence, sizeof(sequence), sequence_offset(layer)),
			 sizeof(sequence));
	ck_assert_msg(!(sequence & 1), "layer %u is already mid-write", layer);
	odd = sequence + 1;
	ck_assert_int_eq(pwrite(fd, &odd, sizeof(odd), sequence_offset(layer)), sizeof(odd));
	return sequence;
}

START_TEST(odd_sequence_of_a_live_daemon_times_out)
{
	struct live t;
	zc_server_stats stats;
	zc_view view;

	live_start(&t, "odd", 22);
	CHECK(update_checked, t.client, t.session, &t.model, &t.rng, 0, 9);
	int fd = session_views_open(&t.daemon, t.config.name);
	uint64_t sequence = sequence_make_odd(fd, 0);

	ck_assert_int_eq(zc_client_set_timeout(t.client, SHORT_TIMEOUT_MS), 0);
	int rc = zc_session_view(t.session, 0, &view);
	assert_refused(t.client, rc, -ETIMEDOUT, "still being written", "view of an odd layer");
	/* Nothing went over the socket: the connection is fine. */
	ck_assert_int_eq(zc_client_broken(t.client), 0);
	ck_assert_int_eq(zc_client_set_timeout(t.client, CLIENT_TIMEOUT_MS), 0);
	ck_assert_int_eq(zc_client_stats(t.client, &stats), 0);
	ck_assert_int_eq(zc_session_view(t.session, 1, &view), 0);

	/* The writer "finishes": the layer reads as before. */
	ck_assert_int_eq(pwrite(fd, &sequence, sizeof(sequence), sequence_offset(0)), sizeof(sequence));
	close(fd);
	CHECK(session_matches, t.session, &t.model);
	CHECK(update_checked, t.client, t.session, &t.model, &t.rng, 0, 3);
	live_finish(&t);
}
END_TEST

START_TEST(daemon_killed_mid_write_is_reported_not_waited_for)
{
	struct live t;
	zc_view view;

	live_start(&t, "killed", 23);
	/* No timeout at all: only the daemon's death can end the wait. */
	ck_assert_int_eq(zc_client_set_timeout(t.client, 0), 0);
	uint64_t id = zc_session_get_info(t.session)->id;
	CHECK(update_checked, t.client, t.session, &t.model, &t.rng, 1, 20);
	CHECK(update_checked, t.client, t.session, &t.model, &t.rng, 0, 4);

	/* Killed in the middle of a write of layer 1. */
	int fd = session_views_open(&t.daemon, t.config.name);
	daemon_kill(&t.daemon);
	sequence_make_odd(fd, 1);
	close(fd);
	int rc = zc_session_view(t.session, 1, &view);
	assert_refused(t.client, rc, -ECONNRESET, "daemon is gone", "view after the daemon died");
	assert_broken(t.client, -ECONNRESET, "after the daemon died mid-write");
	/* A layer the daemon was not writing is refused as well: the client is broken. */
	ck_assert_int_eq(zc_session_view(t.session, 0, &view), ZC_EBROKEN);

	/* The next daemon repairs the layer: every acknowledged token is there. */
	daemon_restart(&t.daemon);
	ck_assert_int_eq(zc_client_set_timeout(t.client, CLIENT_TIMEOUT_MS), 0);
	rc = zc_client_reconnect(t.client);
	ck_assert_msg(rc == ZC_ERESTARTED, "reconnect: %s '%s'", zc_error_name(rc),
		      zc_client_last_error(t.client));
	zc_session_release(t.session);
	t.config.attach = true;
	t.session = open_session(t.client, &t.config);
	ck_assert_uint_eq(zc_session_get_info(t.session)->id, id);
	CHECK(session_matches, t.session, &t.model);
	CHECK(update_checked, t.client, t.session, &t.model, &t.rng, 1, 2);
	live_finish(&t);
}
END_TEST

static double seconds_now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* The receive spin is a setting within bounds, and never outlasts the
 * call's timeout: a spin longer than the timeout still times out on time. */
START_TEST(receive_spin_is_bounded_by_the_timeout)
{
	static const enum fake_step script[] = {
		FAKE_ANSWER,  /* 0: hello */
		FAKE_ANSWER,  /* 1: staging, answered with the spin off */
		FAKE_HOLD,    /* 2: staging, never answered in time */
		FAKE_END
	};
	struct fake f;
	zc_client *client;
	void *buffer;

	fake_start(&f, script);
	ck_assert_int_eq(zc_client_connect(f.socket_path, CLIENT_TIMEOUT_MS, &client), 0);
	ck_assert_int_eq(zc_client_set_receive_spin(client, ZC_RECEIVE_SPIN_US_MAX + 1), ZC_EINVALID);
	ck_assert_int_eq(zc_client_broken(client), 0);
	ck_assert_int_eq(zc_client_set_receive_spin(client, 0), 0);
	int rc = zc_client_staging(client, 4096, &buffer);
	ck_assert_msg(rc == 0, "staging with no spin: %s '%s'", zc_error_name(rc),
		      zc_client_last_error(client));

	/* 100 ms of spin against a 20 ms timeout. */
	ck_assert_int_eq(zc_client_set_receive_spin(client, ZC_RECEIVE_SPIN_US_MAX), 0);
	ck_assert_int_eq(zc_client_set_timeout(client, 20), 0);
	double t0 = seconds_now();
	rc = zc_client_staging(client, 8192, &buffer);
	double waited = seconds_now() - t0;
	assert_refused(client, rc, -ETIMEDOUT, "timed out", "staging against a fake that holds it");
	ck_assert_msg(waited >= 0.019 && waited < 0.09, "waited %.3f s for a 20 ms timeout", waited);
	zc_client_close(client);
	fake_stop(&f);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{ "fake_peer", { late_reply_never_answers_the_next_call,
				 protocol_errors_break_the_connection, failed_reconnect_stays_broken,
				 receive_spin_is_bounded_by_the_timeout,
				 a_daemon_without_rings_is_not_asked, NULL } },
		{ "stopped_daemon", { stopped_daemon_times_out_and_the_session_stays_whole, NULL } },
		{ "seqlock", { odd_sequence_of_a_live_daemon_times_out,
			       daemon_killed_mid_write_is_reported_not_waited_for, NULL } },
	};
	Suite *suite = suite_create("client_failure");

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
