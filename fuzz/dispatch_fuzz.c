/*
 * libFuzzer target: the bytes one client sends on its connection, through
 * an in-process zipcached (frame reader, request decoding, dispatch,
 * sessions, stores, the codec, the thread pool).
 *
 * The input is raw socket bytes: 4-byte little-endian lengths and protobuf
 * bodies, exactly what a client would write. Per input:
 *
 *   1. The codec's kernels are chosen by the input's length (scalar, AVX2,
 *      AVX-512 in turn, where the CPU has them) and a fresh daemon starts
 *      on a private loop (server_start on a temporary directory, adopt
 *      off), so no input sees what an earlier one left and every crash
 *      reproduces from its file alone.
 *   2. One end of a socketpair goes to server_accept(); the input is
 *      written into the other end in chunks of varying size (so headers and
 *      bodies split across reads), with loop turns in between and the
 *      replies drained (descriptors that come with them are closed).
 *   3. Our end is shut for writing; the loop runs until the daemon has
 *      closed the connection and no job is left on the thread pool.
 *   4. The daemon is stopped and freed (server_free).
 *
 * Besides the sanitizers, these oracles turn a wrong answer into a crash:
 *   - every reply frame decodes (wire_pb_response_decode), its status is a
 *     known one, its strings are valid UTF-8 (proto3 decoders other than
 *     nanopb refuse anything else), and it announces descriptors exactly
 *     when an OK open_session or staging reply should;
 *   - every complete request frame gets exactly one reply, echoing the
 *     request id the frame decodes to (0 when it does not decode), plus one
 *     reply refusing an oversized frame, after which nothing more is read;
 *   - the descriptors received are the ones the replies announced, and no
 *     partial reply frame is left at the end;
 *   - the memory budget's count equals the pages the open sessions' files
 *     really hold (on tmpfs), so no write reaches memory it never charged;
 *   - the daemon finishes within ZC_FUZZ_HANG_MS (default 10000 ms):
 *     otherwise the connection's state is printed, then abort().
 *
 * tests/fuzz_regressions_test.c includes this file and replays fuzz/corpus
 * and fuzz/regressions through the same two entry points, built by gcc.
 *
 * Environment: ZC_FUZZ_DIR (where the temporary directory goes; default
 * /dev/shm, else $TMPDIR, else /tmp), ZC_CODEC_ISA (pins the kernels),
 * ZC_FUZZ_LOG (error|warn|info|debug; default error), ZC_FUZZ_HANG_MS,
 * ZC_FUZZ_TRACE (set: print every reply), ZC_FUZZ_NO_UTF8 (set: skip the
 * UTF-8 oracle, to look past a known bug while it is open).
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
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
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>
#include <linux/magic.h>
#include <uv.h>

#include "../server/connection.h"
#include "../server/log.h"
#include "../server/options.h"
#include "../server/pool.h"
#include "../server/retain.h"
#include "../server/server.h"
#include "../server/session.h"
#include "../server/store.h"
#include "frame.h"
#include "wire_pb.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

/* Small limits, so that the interesting refusals are a few bytes away;
 * but a session's shape may reach every maximum the flags allow, so the
 * layout arithmetic is fuzzed where it could wrap: max_tokens is the
 * largest --max-tokens accepts (ZC_MAX_BLOCK_TOKENS), and the shape's own
 * limits (STORE_MAX_LAYERS, STORE_MAX_HEADS, ZC_MAX_HEAD_DIM,
 * STORE_MAX_RESIDUAL_TOKENS) are the store's, which no flag lowers. */
#define FUZZ_MAX_SESSIONS 8u
#define FUZZ_MAX_TOKENS ZC_MAX_BLOCK_TOKENS
/* Sessions that large are sparse files of up to 16 TiB each: the bound on
 * mapped bytes keeps the fuzzer from exhausting the address space (ASan's
 * shadow takes a share of it), while a few sessions of hundreds of GiB
 * still fit. The memory budget, not this, bounds what is really held. */
#define FUZZ_MAX_MAPPED_BYTES (UINT64_C(1) << 40)
#define FUZZ_MAX_FRAME_BYTES 65536u
#define FUZZ_MAX_STAGING_BYTES (1u << 20)
/* Small enough that two mid-sized sessions reach it (view drops, rebuilds). */
#define FUZZ_MEMORY_BUDGET (16u << 20)
/* Low, so inline blocks of a few dozen tokens already go to the thread pool. */
#define FUZZ_OFFLOAD_ELEMENTS 1024u

#define FUZZ_DEFAULT_HANG_MS 10000u

/* Replies are read in pieces of this size. */
#define FUZZ_READ_BYTES 65536

/* The daemon sends at most 4 descriptors with a frame; room for more. */
#define FUZZ_MAX_FDS_PER_READ 64

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Frees the daemon if one is up, closes the loop and removes the
 * temporary directory; harmless to repeat. Registered with atexit(). */
void fuzz_target_teardown(void);

static struct {
	bool ready;
	char dir[PATH_MAX];
	char shm_dir[PATH_MAX];
	struct options options;
	uv_loop_t loop;
	struct server server;
	bool server_up;
	unsigned hang_ms;
	bool trace;      /* ZC_FUZZ_TRACE: print every reply */
	bool no_utf8;    /* ZC_FUZZ_NO_UTF8: skip the UTF-8 oracle */
	/* The kernels zc_codec_init() chose; inputs take turns with the others
	 * unless ZC_CODEC_ISA pins one. */
	zc_isa best_isa;
	bool rotate_isa;
	/* On tmpfs a file's allocated blocks are exactly the pages the
	 * budget was charged for; other file systems count metadata too. */
	bool exact_blocks;
	/* libuv resets SIGINT/SIGTERM to SIG_DFL when it lets go of them;
	 * libFuzzer's own handlers go back after every start and stop. */
	struct sigaction saved_int, saved_term;
	/* Named in failure messages (the replay test sets the file name). */
	const char *label;
} fuzz;

/* What the replies of one input said. */
struct reply_log {
	frame_reader reader;
	uint64_t *ids;
	size_t n_ids, cap_ids;
	uint64_t fds_announced;
	uint64_t fds_received;
	uint64_t bytes;
};

static void dir_remove_flat(const char *path);
static void fuzz_fail(const char *format, ...) __attribute__((format(printf, 1, 2), noreturn));

/* Says what went wrong and abort()s, leaving no temporary files behind
 * (a sanitizer's own report exits without them being removed). */
static void fuzz_fail(const char *format, ...)
{
	va_list args;

	fprintf(stderr, "dispatch_fuzz: FAILED%s%s%s: ", fuzz.label ? " (" : "",
		fuzz.label ? fuzz.label : "", fuzz.label ? ")" : "");
	va_start(args, format);
	vfprintf(stderr, format, args);
	va_end(args);
	fputc('\n', stderr);
	if (fuzz.ready) {
		dir_remove_flat(fuzz.shm_dir);
		dir_remove_flat(fuzz.dir);
	}
	abort();
}

static uint64_t now_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000;
}

static void ids_push(uint64_t **ids, size_t *n, size_t *cap, uint64_t id)
{
	if (*n == *cap) {
		size_t new_cap = *cap ? *cap * 2 : 64;
		uint64_t *p = realloc(*ids, new_cap * sizeof(*p));
		if (!p)
			fuzz_fail("out of memory");
		*ids = p;
		*cap = new_cap;
	}
	(*ids)[(*n)++] = id;
}

static int id_compare(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* ---- the temporary directory -------------------------------------------- */

static const char *base_dir(void)
{
	const char *dir = getenv("ZC_FUZZ_DIR");
	if (dir && *dir)
		return dir;
	if (access("/dev/shm", W_OK) == 0)
		return "/dev/shm";
	dir = getenv("TMPDIR");
	return dir && *dir ? dir : "/tmp";
}

/* Removes the plain files of one directory, then the directory. */
static void dir_remove_flat(const char *path)
{
	DIR *dir = opendir(path);
	struct dirent *entry;
	char child[PATH_MAX + 256];

	if (!dir)
		return;
	while ((entry = readdir(dir))) {
		if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
			continue;
		snprintf(child, sizeof(child), "%s/%s", path, entry->d_name);
		unlink(child);
	}
	closedir(dir);
	rmdir(path);
}

/* ---- the daemon ------------------------------------------------------------ */

static void signals_restore(void)
{
	sigaction(SIGINT, &fuzz.saved_int, NULL);
	sigaction(SIGTERM, &fuzz.saved_term, NULL);
}

static void daemon_up(void)
{
	int rc = server_start(&fuzz.server, &fuzz.loop, &fuzz.options);
	signals_restore();
	if (rc < 0)
		fuzz_fail("server_start: %s", zc_strerror(rc));
	fuzz.server_up = true;
}

static void daemon_down(void)
{
	if (!fuzz.server_up)
		return;
	server_free(&fuzz.server);
	signals_restore();
	fuzz.server_up = false;
}

/* ---- replies ----------------------------------------------------------------- */

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool utf8_valid(const char *text)
{
	const unsigned char *s = (const unsigned char *)text;

	while (*s) {
		unsigned c = *s, need, min;
		uint32_t code;
		if (c < 0x80) {
			s++;
			continue;
		}
		if (c >= 0xc2 && c <= 0xdf) {
			need = 1, min = 0x80, code = c & 0x1f;
		} else if (c >= 0xe0 && c <= 0xef) {
			need = 2, min = 0x800, code = c & 0x0f;
		} else if (c >= 0xf0 && c <= 0xf4) {
			need = 3, min = 0x10000, code = c & 0x07;
		} else {
			return false;
		}
		s++;
		for (unsigned i = 0; i < need; i++, s++) {
			if ((*s & 0xc0) != 0x80)
				return false;
			code = code << 6 | (*s & 0x3f);
		}
		if (code < min || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff))
			return false;
	}
	return true;
}

static void check_string(const char *what, const char *text, uint64_t request_id)
{
	if (!fuzz.no_utf8 && !utf8_valid(text))
		fuzz_fail("reply to request %llu carries %s that is not valid UTF-8: \"%s\"",
			  (unsigned long long)request_id, what, text);
}

/* One whole reply frame: it must decode and make sense on its own. */
static void reply_check(struct reply_log *log, const uint8_t *frame, size_t len)
{
	wire_pb_response reply;
	int rc = wire_pb_response_decode(frame, len, &reply);
	const zipcache_v1_Response *m = &reply.msg;
	uint64_t id;

	if (rc < 0)
		fuzz_fail("a reply frame of %zu bytes does not decode: %s (%s)", len,
			  zc_strerror(rc), reply.error ? reply.error : "no reason");
	id = m->request_id;
	if (fuzz.trace)
		fprintf(stderr, "dispatch_fuzz: reply id=%llu op=%u status=%d fds=%u message=\"%s\"\n",
			(unsigned long long)id, (unsigned)m->which_op, (int)m->status, m->fds, m->message);
	if (m->status > zipcache_v1_Status_INTERNAL)
		fuzz_fail("reply to request %llu has unknown status %d", (unsigned long long)id,
			  (int)m->status);
	check_string("its message", m->message, id);
	/* An open passes the session map and the uid's pool; staging its buffer. */
	unsigned wants_fds = m->status != zipcache_v1_Status_OK ? 0u :
			     m->which_op == zipcache_v1_Response_open_session_tag ||
					     m->which_op == zipcache_v1_Response_fork_session_tag ? 2u :
			     m->which_op == zipcache_v1_Response_staging_tag ? 1u : 0u;
	if (m->fds != wants_fds)
		fuzz_fail("reply to request %llu (op %u, status %d) announces %u descriptors",
			  (unsigned long long)id, (unsigned)m->which_op, (int)m->status, m->fds);
	switch (m->which_op) {
	case zipcache_v1_Response_hello_tag:
		check_string("a server version", m->op.hello.server_version, id);
		break;
	case zipcache_v1_Response_open_session_tag:
		check_string("a session name", m->op.open_session.session.name, id);
		break;
	case zipcache_v1_Response_fork_session_tag:
		check_string("a fork's name", m->op.fork_session.session.name, id);
		break;
	case zipcache_v1_Response_stats_tag:
		check_string("a session name", m->op.stats.session.name, id);
		break;
	case zipcache_v1_Response_list_sessions_tag:
		for (size_t i = 0; i < reply.n_sessions; i++)
			check_string("a session name", reply.sessions[i].name, id);
		break;
	default:
		break;
	}
	ids_push(&log->ids, &log->n_ids, &log->cap_ids, id);
	log->fds_announced += m->fds;
	wire_pb_response_free(&reply);
}

/* Reads what the daemon sent until the socket would block; *eof once the
 * daemon's end is closed. Returns true if anything arrived. */
static bool replies_read(int fd, struct reply_log *log, bool *eof)
{
	static uint8_t buffer[FUZZ_READ_BYTES];
	bool progress = false;

	while (!*eof) {
		union {
			struct cmsghdr header;
			char bytes[CMSG_SPACE(sizeof(int) * FUZZ_MAX_FDS_PER_READ)];
		} control;
		struct iovec iov = { buffer, sizeof(buffer) };
		struct msghdr message = {
			.msg_iov = &iov, .msg_iovlen = 1,
			.msg_control = control.bytes, .msg_controllen = sizeof(control.bytes),
		};
		ssize_t n = recvmsg(fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		progress = true;
		if (n <= 0) {
			/* 0, or ECONNRESET when the daemon closed with our bytes unread. */
			*eof = true;
			break;
		}
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c)) {
			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (size_t i = 0; i < count; i++) {
				int received;
				memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				close(received);
			}
			log->fds_received += count;
		}
		if (message.msg_flags & MSG_CTRUNC)
			fuzz_fail("more descriptors arrived at once than %d", FUZZ_MAX_FDS_PER_READ);
		log->bytes += (uint64_t)n;
		if (frame_reader_feed(&log->reader, buffer, (size_t)n) < 0)
			fuzz_fail("the reply reader refused %zd bytes", n);
		const uint8_t *frame;
		size_t len;
		int rc;
		while ((rc = frame_reader_next(&log->reader, &frame, &len)) == 1) {
			reply_check(log, frame, len);
			frame_reader_consume(&log->reader);
		}
		if (rc < 0)
			fuzz_fail("a reply frame header is unreadable: %s", zc_strerror(rc));
	}
	return progress;
}

/* ---- what the replies should be ------------------------------------------- */

/*
 * The request ids the daemon must answer, one per complete frame in the
 * order sent, as the daemon's own decoder reads them (for a frame that
 * does not decode, the id it could still read, else 0); an oversized
 * header ends the stream with one more reply (id 0), and nothing after it
 * is read.
 */
static void expected_ids(const uint8_t *data, size_t size, uint64_t **ids, size_t *n)
{
	frame_reader reader;
	const uint8_t *frame;
	size_t len, cap = 0;
	int rc;

	*ids = NULL;
	*n = 0;
	frame_reader_init(&reader, FUZZ_MAX_FRAME_BYTES);
	if (frame_reader_feed(&reader, data, size) < 0)
		fuzz_fail("out of memory");
	while ((rc = frame_reader_next(&reader, &frame, &len)) == 1) {
		wire_pb_request request;
		/* A refused frame keeps the id the decoder could read. */
		(void)wire_pb_request_decode(frame, len, &request);
		ids_push(ids, n, &cap, request.msg.request_id);
		frame_reader_consume(&reader);
	}
	if (rc < 0)
		ids_push(ids, n, &cap, 0);
	frame_reader_free(&reader);
}

static void replies_verify(const uint8_t *data, size_t size, struct reply_log *log)
{
	uint64_t *want;
	size_t n_want;

	if (frame_reader_buffered(&log->reader) != 0)
		fuzz_fail("the daemon closed the connection in the middle of a reply frame "
			  "(%zu bytes of it arrived)", frame_reader_buffered(&log->reader));
	if (log->fds_received != log->fds_announced)
		fuzz_fail("replies announced %llu descriptors, %llu arrived",
			  (unsigned long long)log->fds_announced, (unsigned long long)log->fds_received);
	expected_ids(data, size, &want, &n_want);
	if (n_want != log->n_ids)
		fuzz_fail("%zu request frames (counting an oversized one) got %zu replies", n_want,
			  log->n_ids);
	if (n_want > 0) {
		qsort(want, n_want, sizeof(*want), id_compare);
		qsort(log->ids, log->n_ids, sizeof(*log->ids), id_compare);
	}
	for (size_t i = 0; i < n_want; i++) {
		if (want[i] != log->ids[i])
			fuzz_fail("the replies' request ids differ from the requests': request id %llu "
				  "vs reply id %llu (in sorted order, position %zu)",
				  (unsigned long long)want[i], (unsigned long long)log->ids[i], i);
	}
	free(want);
}

/* ---- the memory budget ------------------------------------------------------- */

/* Once the connection is gone and no job runs: every session's file holds
 * exactly what the budget says is in use. */
static void budget_verify(void)
{
	struct server *s = &fuzz.server;
	uint64_t held = 0;

	if (!fuzz.exact_blocks)
		return;
	for (size_t i = 0; i < s->sessions.count; i++)
		held += store_memory_bytes(s->sessions.items[i]->store);
	held += pool_set_file_bytes(&s->pools);   /* kept extents are pages of it */
	held += retain_map_bytes(true, 0);          /* spare maps: charged, in no session */
	if (held != server_memory_bytes(s))
		fuzz_fail("the memory budget counts %llu bytes in use, the %zu session files and "
			  "the pools hold %llu",
			  (unsigned long long)server_memory_bytes(s), s->sessions.count,
			  (unsigned long long)held);
	if (s->options.memory_budget && server_memory_bytes(s) > s->options.memory_budget)
		fuzz_fail("%llu bytes in use passes the memory budget of %llu",
			  (unsigned long long)server_memory_bytes(s),
			  (unsigned long long)s->options.memory_budget);
}

/* ---- one connection -------------------------------------------------------- */

/* Write sizes, in turn: splits headers and bodies at many places. */
static const size_t chunk_sizes[] = { 4096, 1, 700, 3, 65536, 2, 17 };

static void hang_report(size_t sent, size_t size, bool shut, bool eof)
{
	struct server *s = &fuzz.server;

	fprintf(stderr, "dispatch_fuzz: no progress for %u ms: sent %zu of %zu bytes, %s, %s; "
		"daemon: %u connections, %llu jobs in flight, %zu sessions\n",
		fuzz.hang_ms, sent, size, shut ? "write side shut" : "write side open",
		eof ? "daemon closed" : "daemon has not closed", s->n_connections,
		(unsigned long long)s->sessions.jobs_in_flight, s->sessions.count);
	for (const struct client *client = s->clients; client; client = client->next) {
		const struct connection *c = &client->connection;
		fprintf(stderr, "dispatch_fuzz: connection %llu: state %d, poll events %d, "
			"in flight %u, refs %u, reply bytes queued %zu, request bytes buffered %zu\n",
			(unsigned long long)c->id, (int)c->state, c->poll_events, c->in_flight,
			c->refs, c->out_bytes, frame_reader_buffered(&c->reader));
	}
	fuzz_fail("the daemon hangs");
}

static void connection_run(const uint8_t *data, size_t size, struct reply_log *log)
{
	struct server *s = &fuzz.server;
	uint32_t before = s->n_connections;
	size_t sent = 0, turn = 0;
	bool shut = false, eof = false;
	uint64_t last_progress = now_ms();
	int fds[2];

	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) < 0)
		fuzz_fail("socketpair: %s", strerror(errno));
	server_accept(s, fds[0]);
	if (s->n_connections != before + 1)
		fuzz_fail("the daemon refused the connection");

	for (;;) {
		bool progress = false;

		if (sent < size) {
			size_t want = chunk_sizes[turn++ % (sizeof(chunk_sizes) / sizeof(chunk_sizes[0]))];
			if (want > size - sent)
				want = size - sent;
			ssize_t n = send(fds[1], data + sent, want, MSG_NOSIGNAL | MSG_DONTWAIT);
			if (n > 0) {
				sent += (size_t)n;
				progress = true;
			} else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
				/* EPIPE: the daemon closed (after an oversized frame). */
				sent = size;
				progress = true;
			}
		} else if (!shut) {
			shutdown(fds[1], SHUT_WR);
			shut = true;
			progress = true;
		}
		uv_run(&fuzz.loop, UV_RUN_NOWAIT);
		if (replies_read(fds[1], log, &eof))
			progress = true;
		if (shut && eof && s->n_connections == before && s->sessions.jobs_in_flight == 0)
			break;
		if (progress) {
			last_progress = now_ms();
			continue;
		}
		if (now_ms() - last_progress > fuzz.hang_ms)
			hang_report(sent, size, shut, eof);
		/* Wait for the thread pool or the daemon, briefly. */
		struct pollfd waits[2] = {
			{ .fd = uv_backend_fd(&fuzz.loop), .events = POLLIN },
			{ .fd = fds[1], .events = (short)(POLLIN | (sent < size ? POLLOUT : 0)) },
		};
		poll(waits, 2, 1);
	}
	close(fds[1]);
}

/* Scalar, AVX2 and AVX-512 by turns (the length is as good a choice as any
 * and keeps a crash reproducible from its file). */
static void isa_choose(size_t size)
{
	if (!fuzz.rotate_isa || zc_codec_set_isa((zc_isa)(size % 3)) < 0)
		zc_codec_set_isa(fuzz.best_isa);
}

/* ---- libFuzzer's entry points ---------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	const char *level = getenv("ZC_FUZZ_LOG");
	const char *hang = getenv("ZC_FUZZ_HANG_MS");
	enum log_level log_level = LOG_ERROR;
	int rc;

	(void)argc;
	(void)argv;
	if (fuzz.ready)
		return 0;
	if (level && log_level_parse(level, &log_level) < 0)
		fuzz_fail("ZC_FUZZ_LOG=%s is not error|warn|info|debug", level);
	log_set_level(log_level);
	fuzz.trace = getenv("ZC_FUZZ_TRACE") != NULL;
	fuzz.no_utf8 = getenv("ZC_FUZZ_NO_UTF8") != NULL;
	fuzz.hang_ms = hang && atoi(hang) > 0 ? (unsigned)atoi(hang) : FUZZ_DEFAULT_HANG_MS;
	signal(SIGPIPE, SIG_IGN);
	sigaction(SIGINT, NULL, &fuzz.saved_int);
	sigaction(SIGTERM, NULL, &fuzz.saved_term);
	zc_codec_init();
	fuzz.best_isa = zc_codec_isa();
	fuzz.rotate_isa = !getenv("ZC_CODEC_ISA");

	snprintf(fuzz.dir, sizeof(fuzz.dir), "%s/zc-fuzz-XXXXXX", base_dir());
	if (!mkdtemp(fuzz.dir))
		fuzz_fail("mkdtemp %s: %s", fuzz.dir, strerror(errno));
	if ((size_t)snprintf(fuzz.shm_dir, sizeof(fuzz.shm_dir), "%s/shm", fuzz.dir) >= sizeof(fuzz.shm_dir))
		fuzz_fail("%s is too long a path; set ZC_FUZZ_DIR", fuzz.dir);

	options_default(&fuzz.options);
	if ((size_t)snprintf(fuzz.options.socket_path, sizeof(fuzz.options.socket_path), "%s/z.sock",
			     fuzz.dir) >= sizeof(fuzz.options.socket_path))
		fuzz_fail("socket path under %s is too long; set ZC_FUZZ_DIR", fuzz.dir);
	snprintf(fuzz.options.shm_dir, sizeof(fuzz.options.shm_dir), "%s", fuzz.shm_dir);
	struct statfs fs;
	fuzz.exact_blocks = statfs(fuzz.dir, &fs) == 0 && fs.f_type == TMPFS_MAGIC;

	snprintf(fuzz.options.metrics_listen, sizeof(fuzz.options.metrics_listen), "off");
	fuzz.options.socket_mode = 0600;
	fuzz.options.max_sessions = FUZZ_MAX_SESSIONS;
	fuzz.options.max_tokens = FUZZ_MAX_TOKENS;
	fuzz.options.max_frame_bytes = FUZZ_MAX_FRAME_BYTES;
	fuzz.options.max_inline_bytes = FUZZ_MAX_FRAME_BYTES - 1024;
	fuzz.options.max_staging_bytes = FUZZ_MAX_STAGING_BYTES;
	fuzz.options.memory_budget = FUZZ_MEMORY_BUDGET;
	fuzz.options.idle_ttl_seconds = 0;
	fuzz.options.offload_elements = FUZZ_OFFLOAD_ELEMENTS;
	fuzz.options.max_mapped_bytes = FUZZ_MAX_MAPPED_BYTES;
	fuzz.options.log_level = log_level;
	fuzz.options.adopt = false;

	rc = uv_loop_init(&fuzz.loop);
	if (rc < 0)
		fuzz_fail("uv_loop_init: %s", uv_strerror(rc));
	fuzz.ready = true;
	atexit(fuzz_target_teardown);
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct reply_log log;

	if (!fuzz.ready)
		LLVMFuzzerInitialize(NULL, NULL);
	memset(&log, 0, sizeof(log));
	frame_reader_init(&log.reader, UINT32_MAX);
	isa_choose(size);
	daemon_up();
	connection_run(data, size, &log);
	budget_verify();
	daemon_down();
	replies_verify(data, size, &log);
	frame_reader_free(&log.reader);
	free(log.ids);
	return 0;
}

void fuzz_target_teardown(void)
{
	if (!fuzz.ready)
		return;
	daemon_down();
	uv_loop_close(&fuzz.loop);
	dir_remove_flat(fuzz.shm_dir);
	dir_remove_flat(fuzz.dir);
	fuzz.ready = false;
}
