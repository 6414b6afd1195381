/*
 * Reliability and security tests of zipcached: what happens when things go
 * wrong around a healthy daemon, each against a real daemon
 * (tests/daemon_harness.c) on a private directory.
 *
 *   isolation   another uid (the tests run as root; a helper drops to
 *               `nobody`) sees none of root's sessions: not by name, not by
 *               id, not by file; and the default socket mode keeps it out
 *   crash       SIGKILL of the daemon under load from four clients (three
 *               times, at different moments): after a restart every
 *               acknowledged token is there, and each layer equals, bit for
 *               bit, the codec model of what was sent (plus, at most, the
 *               update in flight, whole)
 *   dying       clients killed mid-frame, holding a half-written staging
 *               buffer, with replies unread or updates in flight: the
 *               daemon gives back their connections and descriptors and no
 *               session changes
 *   limits      connection, session, max_tokens and memory-budget limits
 *               answer RESOURCE_EXHAUSTED with a sentence and store nothing
 *   restart     what a client sees of a daemon restart: the error of its
 *               first call, zc_client_last_error(), ZC_ERESTARTED
 *
 * tests/service_test.c covers correctness, trim, bad input, zero copy, a
 * restart with one client and dropped views; this suite does not repeat
 * them. Its model of a session is the same (tests/layer_model.c):
 * per_call compresses each update as one block; streaming compresses a
 * block of at least R tokens alone after flushing the residual, and keeps
 * shorter ones exact in the residual until it holds R tokens and is
 * compressed as one block.
 *
 * Helper processes never call ck_assert: they explain failures on stderr
 * and report through their exit status, which the test asserts on.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "frame.h"
#include "store_format.h"
#include "wire_pb.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "suite_main.h"

/* Generous: under ASan the daemon and the codec are several times slower. */
#define TEST_TIMEOUT_SECONDS 150

/* The unprivileged user the isolation tests become. */
#define NOBODY_UID 65534u
#define NOBODY_GID 65534u

/* ---- the daemon and its clients in the test process ------------------------ */

static zc_session_config session_config(const char *name, uint32_t layers, uint32_t kv_heads,
					uint32_t head_dim, uint32_t max_tokens,
					zc_block_policy policy, uint32_t residual_tokens)
{
	zc_session_config config;

	zc_session_config_default(&config);
	config.name = name;
	config.layers = layers;
	config.batch = 1;
	config.kv_heads = kv_heads;
	config.head_dim_k = head_dim;
	config.head_dim_v = head_dim;
	config.max_tokens = max_tokens;
	config.policy = policy;
	config.residual_tokens = residual_tokens;
	return config;
}

/* Session files in the daemon's shared-memory directory (set-aside
 * .corrupt files counted separately). */
static int session_files(const struct daemon_harness *daemon, int *corrupt)
{
	DIR *dir = opendir(daemon->shm_dir);
	struct dirent *entry;
	int count = 0;

	if (corrupt)
		*corrupt = 0;
	if (!dir)
		return 0;
	while ((entry = readdir(dir)) != NULL) {
		if (strncmp(entry->d_name, "session-", 8) != 0)
			continue;
		if (strstr(entry->d_name, ".corrupt") != NULL) {
			if (corrupt)
				(*corrupt)++;
		} else if (strstr(entry->d_name, ".zcs") != NULL) {
			count++;
		}
	}
	closedir(dir);
	return count;
}

/* Open descriptors of a process (the daemon runs as root, as do we). */
static int fd_count(pid_t pid)
{
	char path[64];
	struct dirent *entry;
	int count = 0;
	DIR *dir;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	dir = opendir(path);
	if (!dir)
		return -errno;
	while ((entry = readdir(dir)) != NULL)
		if (entry->d_name[0] != '.')
			count++;
	closedir(dir);
	return count;
}

static uint32_t server_connections(zc_client *client)
{
	zc_server_stats stats;
	int rc = zc_client_stats(client, &stats);

	ck_assert_msg(rc == 0, "zc_client_stats: %s '%s'", zc_strerror(rc), zc_client_last_error(client));
	return stats.connections;
}

/* Polls the daemon until it counts `expected` connections (the test's own
 * included); returns the last count seen. */
static uint32_t wait_connections(zc_client *client, uint32_t expected, int timeout_ms)
{
	int64_t deadline = now_ms() + timeout_ms;
	uint32_t seen;

	while ((seen = server_connections(client)) != expected && now_ms() < deadline)
		sleep_ms(10);
	return seen;
}

static int wait_fd_count(pid_t pid, int expected, int timeout_ms)
{
	int64_t deadline = now_ms() + timeout_ms;
	int seen;

	while ((seen = fd_count(pid)) != expected && now_ms() < deadline)
		sleep_ms(10);
	return seen;
}

/* ---- helper processes -------------------------------------------------------- */

/* SIGKILL and reap a helper that is meant to die that way. */
static void child_kill(pid_t pid)
{
	int status = 0;

	ck_assert_int_eq(kill(pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
		      "the helper was to die of SIGKILL, status 0x%x (its stderr says why)", status);
}

/* Waits (bounded) for a helper's one-byte "ready" on a pipe. */
static void wait_ready(int fd, const char *what)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	char byte = 0;

	ck_assert_msg(poll(&p, 1, 30000) == 1 && read(fd, &byte, 1) == 1 && byte == 'r',
		      "%s: the helper never got ready (its stderr says why)", what);
}

/* A page-aligned region shared with helper processes (results, logs). */
static void *shared_region(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_msg(p != MAP_FAILED, "mmap of %zu shared bytes: %s", bytes, strerror(errno));
	return p;
}

/* ---- raw requests ------------------------------------------------------------- */

static wire_pb_request raw_request(uint64_t request_id, pb_size_t op)
{
	wire_pb_request request;

	memset(&request, 0, sizeof(request));
	request.msg.request_id = request_id;
	request.msg.which_op = op;
	return request;
}

static wire_pb_request raw_update_request(uint64_t request_id, uint64_t session_id, uint32_t layer,
				       const struct block *block)
{
	wire_pb_request request = raw_request(request_id, zipcache_v1_Request_update_and_fetch_tag);

	request.msg.op.update_and_fetch.session_id = session_id;
	request.msg.op.update_and_fetch.layer = layer;
	request.msg.op.update_and_fetch.tokens = block->tokens;
	request.keys = (wire_span){ (const uint8_t *)block->keys, block->key_elements * 2 };
	request.values = (wire_span){ (const uint8_t *)block->values, block->value_elements * 2 };
	return request;
}

/* An encoded frame (header included) of a request; free() it. */
static uint8_t *raw_encode(const wire_pb_request *request, size_t *len)
{
	size_t size;
	uint8_t *frame;

	if (wire_pb_request_frame_size(request, &size) < 0 || !(frame = malloc(size)))
		return NULL;
	if (wire_pb_request_encode(request, frame, size, len) < 0) {
		free(frame);
		return NULL;
	}
	return frame;
}

/*
 * Sends a request on a raw connection and says whether the reply has the
 * expected status and request id and (when refused) a message naming
 * `needle`. For helpers: explains into why, never asserts.
 */
static bool raw_status_is(int fd, const wire_pb_request *request, zipcache_v1_Status expected,
			  const char *needle, const char *what, char *why, size_t size)
{
	wire_pb_response reply;
	int rc = raw_call(fd, request, &reply, NULL);
	bool ok = true;

	if (rc < 0)
		return fail_with(why, size, "%s: no reply: %s (%d)", what, zc_strerror(rc), rc);
	if (reply.msg.status != expected)
		ok = fail_with(why, size, "%s: status %s, expected %s (message '%s')", what,
			       response_status_name(reply.msg.status), response_status_name(expected), reply.msg.message);
	else if (reply.msg.request_id != request->msg.request_id)
		ok = fail_with(why, size, "%s: reply to request %" PRIu64 ", expected %" PRIu64, what,
			       reply.msg.request_id, request->msg.request_id);
	else if (expected != zipcache_v1_Status_OK &&
		 (reply.msg.message[0] == '\0' || strcasestr(reply.msg.message, needle) == NULL))
		ok = fail_with(why, size, "%s: message '%s' does not mention '%s'", what,
			       reply.msg.message, needle);
	wire_pb_response_free(&reply);
	return ok;
}

/* ======================================================================
 * 1. Isolation between users.
 * ====================================================================== */

/* Drops to nobody for good; false (with a reason) if anything is left. */
static bool become_nobody(char *why, size_t size)
{
	return user_become(NOBODY_UID, NOBODY_GID, why, size);
}

struct isolation {
	const char *socket_path;
	const char *shm_dir;
	pid_t daemon_pid;
	zc_session_config config;       /* the shape root's sessions have */
	uint64_t root_ids[2];           /* "shared-name" and "root-only" */
	const char *root_only_name;
	int report_fd;                  /* the helper writes its session ids here */
};

/* What a helper running as nobody finds: none of root's sessions. */
static int isolation_body(void *arg)
{
	const struct isolation *iso = arg;
	char why[WHY_BYTES] = "";
	char path[PATH_MAX + 64];
	zc_session_config config = iso->config;
	zc_session_info infos[8], info;
	zc_layer_stats total;
	zc_client *client = NULL;
	zc_session *own = NULL, *again = NULL, *named = NULL;
	struct block block;
	struct rng rng;
	zc_view view;
	size_t count = 99;
	int rc, fd;
	uint64_t ids[2];

	CHILD_EXPECT(become_nobody(why, sizeof(why)), "%s", why);
	CHILD_EXPECT(access(iso->socket_path, W_OK) == 0,
		     "nobody cannot reach %s (%s): is every parent directory traversable?",
		     iso->socket_path, strerror(errno));
	rc = zc_client_connect(iso->socket_path, CLIENT_TIMEOUT_MS, &client);
	CHILD_EXPECT(rc == 0, "connect as nobody: %s (%d)", zc_strerror(rc), rc);

	/* Root's sessions are not listed. */
	rc = zc_client_list_sessions(client, infos, 8, &count);
	CHILD_EXPECT(rc == 0 && count == 0, "nobody's list: rc %s, %zu sessions (expected none)",
		     zc_error_name(rc), count);

	/* The same name is free for nobody: a new, empty session. */
	config.attach = false;
	rc = zc_session_open(client, &config, &own);
	CHILD_EXPECT(rc == 0, "nobody's open of '%s': %s '%s'", config.name, zc_error_name(rc),
		     zc_client_last_error(client));
	const zc_session_info *own_info = zc_session_get_info(own);
	CHILD_EXPECT(own_info->id != iso->root_ids[0] && own_info->id != iso->root_ids[1],
		     "nobody's '%s' got root's session id %" PRIu64, config.name, own_info->id);
	CHILD_EXPECT(own_info->min_tokens == 0 && own_info->max_layer_tokens == 0,
		     "nobody's new '%s' holds tokens (%u..%u): root's data?", config.name,
		     own_info->min_tokens, own_info->max_layer_tokens);
	for (uint32_t layer = 0; layer < config.layers; layer++) {
		rc = zc_session_view(own, layer, &view);
		CHILD_EXPECT(rc == 0 && view.tokens == 0, "nobody's view of layer %u: rc %s, %u tokens",
			     layer, zc_error_name(rc), view.tokens);
	}
	rc = zc_client_list_sessions(client, infos, 8, &count);
	CHILD_EXPECT(rc == 0 && count == 1 && infos[0].id == own_info->id &&
			     strcmp(infos[0].name, config.name) == 0,
		     "nobody's list after its open: rc %s, %zu sessions, first id %" PRIu64 " '%s'",
		     zc_error_name(rc), count, count ? infos[0].id : 0, count ? infos[0].name : "");

	/* Attaching to the name finds nobody's own, never root's. */
	config.attach = true;
	rc = zc_session_open(client, &config, &again);
	CHILD_EXPECT(rc == 0 && zc_session_get_info(again)->id == own_info->id,
		     "nobody's attach to '%s': %s, id %" PRIu64 " (own %" PRIu64 ")", config.name,
		     zc_error_name(rc), rc == 0 ? zc_session_get_info(again)->id : 0, own_info->id);
	zc_session_release(again);

	/* A name only root has does not exist for nobody: attach (which
	 * reuses a session "if it exists") makes a new, empty one. */
	config.name = iso->root_only_name;
	rc = zc_session_open(client, &config, &named);
	CHILD_EXPECT(rc == 0, "nobody's attach to '%s': %s '%s'", config.name, zc_error_name(rc),
		     zc_client_last_error(client));
	CHILD_EXPECT(zc_session_get_info(named)->id != iso->root_ids[0] &&
			     zc_session_get_info(named)->id != iso->root_ids[1] &&
			     zc_session_get_info(named)->max_layer_tokens == 0,
		     "nobody's attach to root's '%s' mapped session %" PRIu64 " with %u tokens",
		     config.name, zc_session_get_info(named)->id,
		     zc_session_get_info(named)->max_layer_tokens);

	/* Root's ids, through the API: they do not exist. */
	for (int i = 0; i < 2; i++) {
		uint64_t id = iso->root_ids[i];
		rc = zc_client_session_stats(client, id, NULL, 0, &total, &info);
		CHILD_EXPECT(rc == ZC_ENOTFOUND && zc_client_last_error(client)[0] != '\0',
			     "nobody's stats of root's session %" PRIu64 ": %s (%d) '%s', expected "
			     "ZC_ENOTFOUND with a message",
			     id, zc_error_name(rc), rc, zc_client_last_error(client));
		rc = zc_client_close_session(client, id);
		CHILD_EXPECT(rc == ZC_ENOTFOUND && zc_client_last_error(client)[0] != '\0',
			     "nobody's close of root's session %" PRIu64 ": %s (%d) '%s', expected "
			     "ZC_ENOTFOUND with a message",
			     id, zc_error_name(rc), rc, zc_client_last_error(client));
	}

	/* And through raw requests: every op that names a session. */
	fd = raw_connect(iso->socket_path);
	CHILD_EXPECT(fd >= 0, "nobody's raw connect: %s", strerror(-fd));
	rng_seed(&rng, 101);
	block_make_shape(&block, config.batch * config.kv_heads, config.head_dim_k,
			 config.head_dim_v, 3, &rng);
	{
		wire_pb_request staging = raw_request(1, zipcache_v1_Request_staging_tag);
		staging.msg.op.staging.bytes = 1 << 16;
		CHILD_EXPECT(raw_status_is(fd, &staging, zipcache_v1_Status_OK, "", "staging buffer",
					   why, sizeof(why)), "%s", why);
	}
	for (int i = 0; i < 2; i++) {
		uint64_t id = iso->root_ids[i], rid = 100 + 10 * (uint64_t)i;
		char id_text[32];
		snprintf(id_text, sizeof(id_text), "%" PRIu64, id);

		wire_pb_request update = raw_update_request(rid, id, 0, &block);
		CHILD_EXPECT(raw_status_is(fd, &update, zipcache_v1_Status_NOT_FOUND, id_text,
					   "inline update of root's session", why, sizeof(why)), "%s", why);
		wire_pb_request staged = raw_request(rid + 1, zipcache_v1_Request_update_and_fetch_tag);
		staged.msg.op.update_and_fetch.session_id = id;
		staged.msg.op.update_and_fetch.tokens = 3;
		staged.msg.op.update_and_fetch.staged = true;
		staged.msg.op.update_and_fetch.values_offset = block.key_elements * 2;
		CHILD_EXPECT(raw_status_is(fd, &staged, zipcache_v1_Status_NOT_FOUND, id_text,
					   "staged update of root's session", why, sizeof(why)), "%s", why);
		wire_pb_request trim = raw_request(rid + 2, zipcache_v1_Request_trim_tag);
		trim.msg.op.trim.session_id = id;
		trim.msg.op.trim.tokens = 1000000;
		CHILD_EXPECT(raw_status_is(fd, &trim, zipcache_v1_Status_NOT_FOUND, id_text,
					   "trim of root's session", why, sizeof(why)), "%s", why);
		trim.msg.request_id = rid + 3;
		trim.msg.op.trim.has_layer = true;
		trim.msg.op.trim.layer = 1;
		CHILD_EXPECT(raw_status_is(fd, &trim, zipcache_v1_Status_NOT_FOUND, id_text,
					   "trim of one layer of root's session", why, sizeof(why)),
			     "%s", why);
		wire_pb_request stats = raw_request(rid + 4, zipcache_v1_Request_stats_tag);
		stats.msg.op.stats.session_id = id;
		stats.msg.op.stats.use = true;
		CHILD_EXPECT(raw_status_is(fd, &stats, zipcache_v1_Status_NOT_FOUND, id_text,
					   "stats (use) of root's session", why, sizeof(why)), "%s", why);
		stats.msg.request_id = rid + 5;
		stats.msg.op.stats.use = false;
		CHILD_EXPECT(raw_status_is(fd, &stats, zipcache_v1_Status_NOT_FOUND, id_text,
					   "stats of root's session", why, sizeof(why)), "%s", why);
		wire_pb_request close_request = raw_request(rid + 6, zipcache_v1_Request_close_session_tag);
		close_request.msg.op.close_session.session_id = id;
		CHILD_EXPECT(raw_status_is(fd, &close_request, zipcache_v1_Status_NOT_FOUND, id_text,
					   "close of root's session", why, sizeof(why)), "%s", why);
	}
	close(fd);

	/* Nor can nobody reach the files, or the daemon's descriptors. */
	for (int i = 0; i < 2; i++) {
		snprintf(path, sizeof(path), "%s/session-%016" PRIx64 ".zcs", iso->shm_dir,
			 iso->root_ids[i]);
		errno = 0;
		fd = open(path, O_RDONLY);
		CHILD_EXPECT(fd < 0 && errno == EACCES, "nobody's open(%s): %s, expected EACCES",
			     path, fd >= 0 ? "succeeded" : strerror(errno));
	}
	snprintf(path, sizeof(path), "%s/session-%016" PRIx64 ".zcs", iso->shm_dir, own_info->id);
	errno = 0;
	fd = open(path, O_RDONLY);
	CHILD_EXPECT(fd < 0 && errno == EACCES,
		     "nobody's open of its own session file %s: %s, expected EACCES (the daemon "
		     "owns the files)", path, fd >= 0 ? "succeeded" : strerror(errno));
	DIR *dir = opendir(iso->shm_dir);
	CHILD_EXPECT(dir == NULL && errno == EACCES, "nobody's opendir(%s): %s, expected EACCES",
		     iso->shm_dir, dir ? "succeeded" : strerror(errno));
	snprintf(path, sizeof(path), "/proc/%d/fd", (int)iso->daemon_pid);
	dir = opendir(path);
	CHILD_EXPECT(dir == NULL && errno == EACCES, "nobody's opendir(%s): %s, expected EACCES",
		     path, dir ? "succeeded" : strerror(errno));

	/* Nobody's own session works, and holds data root must not see. */
	rc = zc_update_and_fetch(own, 0, block.tokens, block.keys, block.values, &view, NULL);
	CHILD_EXPECT(rc == 0 && view.tokens == block.tokens, "nobody's update of its own session: %s '%s'",
		     zc_error_name(rc), zc_client_last_error(client));
	ids[0] = own_info->id;
	ids[1] = zc_session_get_info(named)->id;
	CHILD_EXPECT(write(iso->report_fd, ids, sizeof(ids)) == (ssize_t)sizeof(ids),
		     "cannot report the session ids");
	block_free(&block);
	zc_client_close(client);
	return 0;
}

START_TEST(sessions_of_another_user_do_not_exist)
{
	static const char *const args[] = { "--socket-mode", "0666", NULL };
	struct daemon_harness daemon;
	zc_session_config config = session_config("shared-name", 2, 2, 64, 512,
						  ZC_POLICY_STREAMING, 16);
	zc_session_config other_config = config;
	struct model model, other_model;
	struct isolation iso;
	zc_session_info infos[8];
	zc_layer_stats total;
	struct rng rng;
	struct stat st;
	uint64_t nobody_ids[2] = { 0, 0 };
	size_t count = 0;
	int report[2], rc;

	daemon_start(&daemon, args);
	if (!other_users_possible(daemon.dir)) {
		daemon_stop(&daemon);
		daemon_cleanup(&daemon);
		return;
	}
	/* mkdtemp made the directory 0700: open the way to the socket (the
	 * daemon keeps its shared-memory directory 0700 itself). */
	ck_assert_int_eq(chmod(daemon.dir, 0755), 0);
	ck_assert_int_eq(stat(daemon.socket_path, &st), 0);
	ck_assert_msg((st.st_mode & 0777) == 0666, "socket mode %o with --socket-mode 0666",
		      st.st_mode & 0777);
	ck_assert_int_eq(stat(daemon.shm_dir, &st), 0);
	ck_assert_msg((st.st_mode & 0777) == 0700 && st.st_uid == 0,
		      "shared-memory directory mode %o owner %u, expected 0700 root",
		      st.st_mode & 0777, (unsigned)st.st_uid);

	zc_client *client = connect_client(&daemon);
	zc_session *shared = open_session(client, &config);
	other_config.name = "root-only";
	zc_session *other = open_session(client, &other_config);
	model_init(&model, &config);
	model_init(&other_model, &other_config);
	rng_seed(&rng, 1);
	for (uint32_t step = 0; step < 10; step++) {
		CHECK(update_checked, client, shared, &model, &rng, step % 2, 1 + step * 7 % 20);
		CHECK(update_checked, client, other, &other_model, &rng, step % 2, 2 + step * 5 % 17);
	}
	/* Each file is the daemon's alone, and read-only even to it: readers'
	 * descriptors cannot be reopened for writing. */
	for (int i = 0; i < 2; i++) {
		char path[PATH_MAX + 64];
		uint64_t id = zc_session_get_info(i ? other : shared)->id;
		snprintf(path, sizeof(path), "%s/session-%016" PRIx64 ".zcs", daemon.shm_dir, id);
		ck_assert_msg(stat(path, &st) == 0, "no session file at %s: %s", path, strerror(errno));
		ck_assert_msg((st.st_mode & 0777) == 0400 && st.st_uid == 0,
			      "%s has mode %o owner %u, expected 0400 root", path, st.st_mode & 0777,
			      (unsigned)st.st_uid);
	}

	iso = (struct isolation){
		.socket_path = daemon.socket_path,
		.shm_dir = daemon.shm_dir,
		.daemon_pid = daemon.pid,
		.config = config,
		.root_ids = { zc_session_get_info(shared)->id, zc_session_get_info(other)->id },
		.root_only_name = "root-only",
	};
	ck_assert_int_eq(pipe2(report, O_CLOEXEC), 0);
	iso.report_fd = report[1];
	pid_t pid = child_spawn(isolation_body, &iso, -1);
	close(report[1]);
	child_wait_ok(pid, "a client running as nobody");
	ck_assert_int_eq(read(report[0], nobody_ids, sizeof(nobody_ids)), (ssize_t)sizeof(nobody_ids));
	close(report[0]);

	/* Root's data is as it was, bit for bit. */
	CHECK(session_matches, shared, &model);
	CHECK(session_matches, other, &other_model);
	/* And isolation runs both ways: root is just another uid. */
	ck_assert_int_eq(zc_client_list_sessions(client, infos, 8, &count), 0);
	ck_assert_msg(count == 2, "root lists %zu sessions, expected its 2", count);
	for (size_t i = 0; i < count; i++)
		ck_assert_msg(infos[i].id == iso.root_ids[0] || infos[i].id == iso.root_ids[1],
			      "root's list shows session %" PRIu64 " '%s' of another user",
			      infos[i].id, infos[i].name);
	for (int i = 0; i < 2; i++) {
		rc = zc_client_session_stats(client, nobody_ids[i], NULL, 0, &total, NULL);
		assert_refused(client, rc, ZC_ENOTFOUND, "session", "root's stats of nobody's session");
		rc = zc_client_close_session(client, nobody_ids[i]);
		assert_refused(client, rc, ZC_ENOTFOUND, "session", "root's close of nobody's session");
	}
	ck_assert_int_eq(session_files(&daemon, NULL), 4);
	/* Root's updates go on as before. */
	CHECK(update_checked, client, shared, &model, &rng, 0, 5);
	CHECK(update_checked, client, other, &other_model, &rng, 1, 20);
	ck_assert_int_eq(zc_session_close(shared), 0);
	ck_assert_int_eq(zc_session_close(other), 0);
	zc_client_close(client);
	model_free(&model);
	model_free(&other_model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

struct outsider {
	const char *socket_path;
};

static int outsider_body(void *arg)
{
	const struct outsider *o = arg;
	char why[WHY_BYTES] = "";
	zc_client *client = NULL;
	int rc, fd;

	CHILD_EXPECT(become_nobody(why, sizeof(why)), "%s", why);
	rc = zc_client_connect(o->socket_path, CLIENT_TIMEOUT_MS, &client);
	CHILD_EXPECT(rc == -EACCES, "nobody's connect to a 0660 root socket: %s (%d), expected -EACCES",
		     zc_error_name(rc), rc);
	fd = raw_connect(o->socket_path);
	CHILD_EXPECT(fd == -EACCES, "nobody's raw connect: %d, expected -EACCES", fd);
	return 0;
}

/* Without --socket-mode the socket is 0660: other users cannot connect. */
START_TEST(default_socket_mode_keeps_other_users_out)
{
	struct daemon_harness daemon;
	struct outsider o;
	struct stat st;

	daemon_start(&daemon, NULL);
	if (!other_users_possible(daemon.dir)) {
		daemon_stop(&daemon);
		daemon_cleanup(&daemon);
		return;
	}
	ck_assert_int_eq(chmod(daemon.dir, 0755), 0);
	ck_assert_int_eq(stat(daemon.socket_path, &st), 0);
	ck_assert_msg((st.st_mode & 0777) == 0660, "default socket mode %o, expected 0660",
		      st.st_mode & 0777);
	o.socket_path = daemon.socket_path;
	child_wait_ok(child_spawn(outsider_body, &o, -1), "nobody knocking on a 0660 socket");
	zc_client *client = connect_client(&daemon);
	ck_assert_uint_eq(server_connections(client), 1);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ======================================================================
 * 2. Crash safety under load.
 * ====================================================================== */

enum {
	CRASH_CYCLES = 3,          /* kill, restart, verify: this many times */
	CRASH_CLIENTS = 4,
	CRASH_MAX_TOKENS = 16384,  /* per layer */
	CRASH_RESIDUAL = 16,
	CRASH_MAX_STEPS = 6000,
	CRASH_LOAD_MS = 1000,
};

struct crash_record {
	uint32_t step, layer, tokens;
};

/* One client's log, in memory shared with the test process. */
struct crash_log {
	uint32_t ready;
	uint32_t acked;            /* steps acknowledged (records[0..acked) written) */
	int last_rc;               /* the error that ended the client */
	int failed;                /* 1: something other than the daemon's death */
	char error[512];
	struct crash_record records[CRASH_MAX_STEPS];
};

struct crash_client {
	int cycle, index;
	const char *socket_path;
	struct crash_log *log;
	int barrier_fd;
};

static zc_session_config crash_config(int cycle, int index, char *name, size_t size)
{
	snprintf(name, size, "crash-%d-%d", cycle, index);
	/* The last client's session compresses every update on arrival. */
	return session_config(name, 2, 2, 64, CRASH_MAX_TOKENS,
			      index == CRASH_CLIENTS - 1 ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING,
			      CRASH_RESIDUAL);
}

static uint64_t crash_stream(int cycle, int index)
{
	return (uint64_t)cycle * 1000003u + (uint64_t)index * 7919u;
}

/* The deterministic schedule: step s goes to layer s % 2 with mostly
 * short blocks (the residual) and every seventh a large one (a block of
 * its own, after a residual flush; on the thread pool). */
static void crash_step(int cycle, int index, uint32_t step, uint32_t *layer, uint32_t *tokens)
{
	struct rng rng;

	rng_seed(&rng, 0xc0ffee00ull + crash_stream(cycle, index) * 65537u + step);
	*layer = step % 2;
	if (step % 7 == 3)
		*tokens = 64 + (uint32_t)(rng_next(&rng) % 65);
	else
		*tokens = 1 + (uint32_t)(rng_next(&rng) % 6);
}

/*
 * A step's K/V: slices, at offsets drawn from the step, of a pool of
 * model-like values made once per client. Making fresh values per step
 * (a log and a cosine per element) would make the clients, not the
 * daemon, the bottleneck, and the kill would seldom land in the daemon's
 * work.
 */
enum { CRASH_POOL_ROWS = 1u << 14 };   /* of D = 64 elements */

static struct block crash_pool;
static int crash_pool_index = -1;

static void crash_block(int cycle, int index, uint32_t step, uint32_t tokens, struct block *block)
{
	size_t rows = (size_t)2 * tokens, elements = rows * 64;
	struct rng rng;

	if (crash_pool_index != index) {
		block_free(&crash_pool);
		rng_seed(&rng, 0xda7a0000ull + (uint64_t)index);
		block_make_shape(&crash_pool, 1, 64, 64, CRASH_POOL_ROWS, &rng);
		crash_pool_index = index;
	}
	rng_seed(&rng, 0x5eed0000ull + crash_stream(cycle, index) * 65537u + step);
	block->tokens = tokens;
	block->key_elements = block->value_elements = elements;
	block->keys = allocate(elements * 2);
	block->values = allocate(elements * 2);
	memcpy(block->keys, crash_pool.keys + rng_next(&rng) % (CRASH_POOL_ROWS - rows) * 64,
	       elements * 2);
	memcpy(block->values, crash_pool.values + rng_next(&rng) % (CRASH_POOL_ROWS - rows) * 64,
	       elements * 2);
}

static void crash_pool_free(void)
{
	block_free(&crash_pool);
	crash_pool_index = -1;
}

static bool connection_lost(int rc)
{
	return rc == -EPIPE || rc == -ECONNRESET || rc == ZC_EPROTOCOL;
}

static int crash_client_run(struct crash_client *c, zc_client *client, zc_session *session);

static int crash_client_body(void *arg)
{
	struct crash_client *c = arg;
	struct crash_log *log = c->log;
	char name[32];
	zc_session_config config = crash_config(c->cycle, c->index, name, sizeof(name));
	zc_client *client;
	zc_session *session;
	struct block warm;
	int rc;

	crash_block(c->cycle, c->index, 0, 1, &warm);   /* makes the pool before the go */
	block_free(&warm);
	rc = zc_client_connect(c->socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc == 0)
		rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		snprintf(log->error, sizeof(log->error), "connect/open: %s", zc_error_name(rc));
		log->failed = 1;
		return 1;
	}
	rc = crash_client_run(c, client, session);
	zc_client_close(client);
	crash_pool_free();
	return rc;
}

static int crash_client_run(struct crash_client *c, zc_client *client, zc_session *session)
{
	struct crash_log *log = c->log;
	uint32_t layer_tokens[2] = { 0, 0 };
	char byte;
	int rc;

	__atomic_store_n(&log->ready, 1, __ATOMIC_RELEASE);
	while (read(c->barrier_fd, &byte, 1) < 0 && errno == EINTR)
		;
	for (uint32_t step = 0; step < CRASH_MAX_STEPS; step++) {
		uint32_t layer, tokens;
		struct block block;
		zc_view view;

		crash_step(c->cycle, c->index, step, &layer, &tokens);
		if (layer_tokens[layer] + tokens > CRASH_MAX_TOKENS)
			break;
		crash_block(c->cycle, c->index, step, tokens, &block);
		rc = zc_update_and_fetch(session, layer, tokens, block.keys, block.values, &view, NULL);
		block_free(&block);
		if (rc < 0) {
			log->last_rc = rc;
			if (!connection_lost(rc)) {
				snprintf(log->error, sizeof(log->error), "step %u: update returned %s '%s'",
					 step, zc_error_name(rc), zc_client_last_error(client));
				log->failed = 1;
				return 1;
			}
			return 0;   /* the daemon died under us: the expected end */
		}
		layer_tokens[layer] += tokens;
		if (view.tokens != layer_tokens[layer]) {
			snprintf(log->error, sizeof(log->error),
				 "step %u: layer %u view has %u tokens after the ack, expected %u", step,
				 layer, view.tokens, layer_tokens[layer]);
			log->failed = 1;
			return 1;
		}
		/* Recorded only once acknowledged. */
		log->records[step] = (struct crash_record){ step, layer, tokens };
		__atomic_store_n(&log->acked, step + 1, __ATOMIC_RELEASE);
	}
	/* Out of tokens before the kill: done (every step acknowledged). */
	return 0;
}

/*
 * The in-flight update at the kill (never acknowledged) may have left its
 * layer in one of these states, and in no other:
 *   absent                     the layer as acknowledged
 *   absent, residual flushed   a block of >= R tokens flushes the residual
 *                              before it appends (and publishes) its own
 *   present                    the update wholly applied
 *   present, flush pending     a short update publishes its tokens before
 *                              it compresses a full residual; until then
 *                              they are exact (as the README promises of
 *                              the residual), and that is what adoption
 *                              rebuilds
 * Picks the one the daemon's view (bit for bit) and accounting equal, and
 * leaves the model in it; false with a reason when none does. (The view
 * alone cannot tell a one-token residual from a one-token block: a single
 * token may reconstruct exactly.)
 */
static bool crash_candidate(const struct model *model, uint32_t layer, const zc_view *view,
			    const zc_layer_stats *stats, char *why, size_t size)
{
	zc_layer_stats want;

	if (!view_matches(model, layer, view, why, size))
		return false;
	model_layer_stats(model, layer, &want);
	return stats_match("layer stats", stats, &want, true, why, size);
}

static bool crash_layer_settle(struct model *model, zc_session *session, uint32_t layer,
			       const struct block *inflight, const char **state, char *why,
			       size_t size)
{
	struct model_layer *l = &model->layer[layer];
	uint32_t acked_tokens = l->tokens;
	char first_why[WHY_BYTES] = "";
	zc_layer_stats stats[2];
	zc_view view;
	int rc = zc_session_view(session, layer, &view);

	if (rc == 0)
		rc = zc_session_stats(session, stats, 2, NULL);
	if (rc < 0)
		return fail_with(why, size, "reading layer %u: %s", layer, zc_error_name(rc));
	const zc_layer_stats *got = &stats[layer];
	if (view.tokens < acked_tokens)
		return fail_with(why, size,
				 "layer %u holds %u tokens after the restart, but %u were acknowledged",
				 layer, view.tokens, acked_tokens);
	if (!inflight || view.tokens == acked_tokens) {
		*state = "acknowledged";
		if (crash_candidate(model, layer, &view, got, first_why, sizeof(first_why)))
			return true;
		if (!inflight || !model_direct(model, inflight->tokens) || l->residual == 0 ||
		    model->per_call)
			return fail_with(why, size, "%s", first_why);
		model_flush(model, layer);
		*state = "acknowledged, residual flushed by the in-flight block";
		if (crash_candidate(model, layer, &view, got, why, size))
			return true;
		return fail_with(why, size, "%s (nor with the residual flushed)", first_why);
	}
	if (view.tokens != acked_tokens + inflight->tokens)
		return fail_with(why, size,
				 "layer %u holds %u tokens: neither the %u acknowledged nor those plus "
				 "the %u of the update in flight",
				 layer, view.tokens, acked_tokens, inflight->tokens);
	*state = "in-flight update applied";
	if (model_direct(model, inflight->tokens)) {
		model_update(model, layer, inflight->tokens, inflight->keys, inflight->values);
		return crash_candidate(model, layer, &view, got, why, size);
	}
	model_append_exact(model, layer, inflight->tokens, inflight->keys, inflight->values);
	if (l->residual < model->residual_threshold)
		return crash_candidate(model, layer, &view, got, why, size);
	*state = "in-flight update applied, its residual flush not yet";
	if (crash_candidate(model, layer, &view, got, first_why, sizeof(first_why)))
		return true;
	model_flush(model, layer);
	*state = "in-flight update applied";
	if (crash_candidate(model, layer, &view, got, why, size))
		return true;
	return fail_with(why, size, "%s (nor with the residual flushed)", first_why);
}

/*
 * crash_layer_settle, and if no state fits, again with the layer's last
 * deferred flush unpublished (the clients ask for no stats, so the flush
 * a step causes runs after its reply and a kill may come first). On
 * success *model is the state that fitted.
 */
static bool crash_layer_settle_lazy(struct model *model, zc_session *session, uint32_t layer,
				    const struct block *inflight, const char **state, char *why,
				    size_t size)
{
	struct model eager, lazy;
	model_fork(&eager, model, model->max_tokens);
	if (crash_layer_settle(&eager, session, layer, inflight, state, why, size)) {
		model_free(model);
		*model = eager;
		return true;
	}
	model_free(&eager);
	model_fork(&lazy, model, model->max_tokens);
	char inner[WHY_BYTES];
	if (model_unpublish_last_flush(&lazy, layer) &&
	    crash_layer_settle(&lazy, session, layer, inflight, state, inner, sizeof(inner))) {
		*state = "acknowledged, the last deferred flush not yet published";
		model_free(model);
		*model = lazy;
		return true;
	}
	model_free(&lazy);
	return false;
}

/* One cycle: four clients load the daemon, SIGKILL, restart, verify. */
static void crash_cycle(struct daemon_harness *daemon, struct crash_log *logs, int cycle)
{
	struct crash_client clients[CRASH_CLIENTS];
	pid_t pids[CRASH_CLIENTS];
	int barrier[2], corrupt = 0, files;

	memset(logs, 0, CRASH_CLIENTS * sizeof(*logs));
	ck_assert_int_eq(pipe2(barrier, O_CLOEXEC), 0);
	for (int i = 0; i < CRASH_CLIENTS; i++) {
		clients[i] = (struct crash_client){ cycle, i, daemon->socket_path, &logs[i], barrier[0] };
		pids[i] = child_spawn(crash_client_body, &clients[i], barrier[1]);
	}
	close(barrier[0]);
	int64_t deadline = now_ms() + 30000;
	for (int i = 0; i < CRASH_CLIENTS; i++) {
		while (!__atomic_load_n(&logs[i].ready, __ATOMIC_ACQUIRE) && !logs[i].failed &&
		       now_ms() < deadline)
			sleep_ms(5);
		ck_assert_msg(logs[i].ready, "cycle %d: crash client %d never opened its session: %s",
			      cycle, i, logs[i].error);
	}
	close(barrier[1]);   /* go */

	/* About a second of load, less if a client nears the end of its
	 * tokens (the kill must land while every client is still sending);
	 * a different moment each cycle. */
	int64_t start = now_ms(), load_ms = CRASH_LOAD_MS - 200 * cycle;
	for (;;) {
		bool near_end = false;
		for (int i = 0; i < CRASH_CLIENTS; i++) {
			ck_assert_msg(!logs[i].failed, "cycle %d: crash client %d failed before the kill: %s",
				      cycle, i, logs[i].error);
			near_end |= __atomic_load_n(&logs[i].acked, __ATOMIC_ACQUIRE) > 1500;
		}
		if (near_end || now_ms() - start >= load_ms)
			break;
		sleep_ms(3);
	}
	daemon_kill(daemon);
	int64_t killed_at = now_ms();

	/* Each client sees its connection die and records nothing more (one
	 * still stuck after 10 s is killed; its last ack may go unrecorded,
	 * which only widens what the check accepts by that one update). */
	for (int i = 0; i < CRASH_CLIENTS; i++) {
		int status = 0;
		pid_t done = 0;
		while ((done = waitpid(pids[i], &status, WNOHANG)) == 0 && now_ms() - killed_at < 10000)
			sleep_ms(5);
		if (done == 0) {
			kill(pids[i], SIGKILL);
			waitpid(pids[i], &status, 0);
		}
		ck_assert_msg(!logs[i].failed, "cycle %d: crash client %d: %s", cycle, i, logs[i].error);
		ck_assert_msg(logs[i].acked >= 20,
			      "cycle %d: crash client %d had only %u updates acknowledged in %" PRId64
			      " ms of load: the test measured nothing", cycle, i, logs[i].acked,
			      killed_at - start);
	}

	daemon_restart(daemon);
	files = session_files(daemon, &corrupt);
	if (corrupt) {
		char tail[2048];
		ck_abort_msg("cycle %d: the restarted daemon set %d session files aside as corrupt; "
			     "log:\n%s", cycle, corrupt, daemon_log_tail(daemon, tail, sizeof(tail)));
	}
	ck_assert_msg(files == CRASH_CLIENTS, "cycle %d: %d session files after the restart, expected %d",
		      cycle, files, CRASH_CLIENTS);
	zc_client *client = connect_client(daemon);
	for (int i = 0; i < CRASH_CLIENTS; i++) {
		struct crash_log *log = &logs[i];
		char name[32];
		zc_session_config config = crash_config(cycle, i, name, sizeof(name));
		struct model model;
		struct block inflight = { 0 };
		uint32_t inflight_layer = 0, inflight_tokens = 0;
		const char *states[2] = { "", "" };
		struct rng rng;

		config.attach = true;
		zc_session *session = open_session(client, &config);
		model_init(&model, &config);
		for (uint32_t step = 0; step < log->acked; step++) {
			uint32_t layer, tokens;
			struct block block;
			crash_step(cycle, i, step, &layer, &tokens);
			ck_assert_msg(log->records[step].step == step && log->records[step].layer == layer &&
					      log->records[step].tokens == tokens,
				      "cycle %d: client %d's record %u does not follow the schedule", cycle,
				      i, step);
			crash_block(cycle, i, step, tokens, &block);
			ck_assert_int_eq(model_update(&model, layer, tokens, block.keys, block.values), 0);
			block_free(&block);
		}
		/* The next step may have been in flight. */
		crash_step(cycle, i, log->acked, &inflight_layer, &inflight_tokens);
		bool may_be_in_flight = log->acked < CRASH_MAX_STEPS &&
					model.layer[inflight_layer].tokens + inflight_tokens <= CRASH_MAX_TOKENS;
		if (may_be_in_flight)
			crash_block(cycle, i, log->acked, inflight_tokens, &inflight);
		for (uint32_t layer = 0; layer < 2; layer++) {
			char why[WHY_BYTES] = "";
			bool ok = crash_layer_settle_lazy(&model, session, layer,
						     may_be_in_flight && layer == inflight_layer ?
							     &inflight : NULL,
						     &states[layer], why, sizeof(why));
			char tail[2048];
			ck_assert_msg(ok, "cycle %d: client %d (%s, %u updates acknowledged, the next on "
				      "layer %u with %u tokens maybe in flight), layer %u after the crash: %s; "
				      "log:\n%s",
				      cycle, i, config.policy == ZC_POLICY_PER_CALL ? "per_call" : "streaming",
				      log->acked, inflight_layer, inflight_tokens, layer, why,
				      daemon_log_tail(daemon, tail, sizeof(tail)));
		}
		block_free(&inflight);
		/* Views, residual and byte accounting all agree with the state. */
		CHECK(session_matches, session, &model);
		/* The adopted session takes updates as if nothing happened. */
		rng_seed(&rng, 7000 + crash_stream(cycle, i));
		for (uint32_t step = 0; step < 6; step++)
			CHECK(update_checked, client, session, &model, &rng, step % 2,
			      step == 3 ? 2 * CRASH_RESIDUAL : 1 + step);
		CHECK(session_matches, session, &model);
		fprintf(stderr, "crash cycle %d client %d: %u updates acknowledged in %" PRId64 " ms; "
			"layer 0 %s, layer 1 %s\n", cycle, i, log->acked, killed_at - start, states[0],
			states[1]);
		ck_assert_int_eq(zc_session_close(session), 0);
		model_free(&model);
	}
	zc_client_close(client);
}

START_TEST(sigkill_under_load_keeps_acknowledged_tokens)
{
	/* Blocks of >= R tokens run on the thread pool, short ones on the
	 * loop: the kill lands in either. */
	static const char *const args[] = { "--offload-elements", "4096", NULL };
	struct daemon_harness daemon;
	struct crash_log *logs = shared_region(CRASH_CLIENTS * sizeof(struct crash_log));

	daemon_start(&daemon, args);
	for (int cycle = 0; cycle < CRASH_CYCLES; cycle++)
		crash_cycle(&daemon, logs, cycle);
	munmap(logs, CRASH_CLIENTS * sizeof(struct crash_log));
	crash_pool_free();
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ======================================================================
 * 3. Clients that die at the worst moment.
 * ====================================================================== */

/* The shape of the session the dying clients touch: a token is 256 key
 * and 256 value bytes. */
static zc_session_config precious_config(const char *name)
{
	return session_config(name, 2, 2, 64, 1024, ZC_POLICY_STREAMING, 16);
}

struct dying {
	const char *socket_path;
	uint64_t session_id;        /* the session it aims at */
	int ready_fd;
};

/* A valid update frame whose header announces ~4 KiB, then 100 bytes of
 * it, and no more. */
static int half_frame_body(void *arg)
{
	const struct dying *d = arg;
	struct block block;
	struct rng rng;
	size_t len = 0;
	int fd = raw_connect(d->socket_path);

	CHILD_EXPECT(fd >= 0, "raw connect: %s", strerror(-fd));
	rng_seed(&rng, 31);
	block_make_shape(&block, 2, 64, 64, 8, &rng);
	wire_pb_request request = raw_update_request(1, d->session_id, 0, &block);
	uint8_t *frame = raw_encode(&request, &len);
	CHILD_EXPECT(frame != NULL, "cannot encode the update");
	CHILD_EXPECT(frame_header_read(frame) >= 4096 && frame_header_read(frame) < 4400,
		     "the frame announces %u bytes, meant ~4 KiB", frame_header_read(frame));
	CHILD_EXPECT(raw_send(fd, frame, FRAME_HEADER_BYTES + 100) == 0, "send");
	CHILD_EXPECT(write(d->ready_fd, "r", 1) == 1, "ready");
	for (;;)
		pause();
}

/* Attached to the session, with a staging buffer holding half a block. */
static int half_staged_body(void *arg)
{
	const struct dying *d = arg;
	zc_session_config config = precious_config("precious");
	zc_client *client;
	zc_session *session;
	struct block block;
	struct rng rng;
	void *buffer;
	int rc;

	config.attach = true;
	rc = zc_client_connect(d->socket_path, CLIENT_TIMEOUT_MS, &client);
	CHILD_EXPECT(rc == 0, "connect: %s", zc_error_name(rc));
	rc = zc_session_open(client, &config, &session);
	CHILD_EXPECT(rc == 0 && zc_session_get_info(session)->id == d->session_id,
		     "attach: %s '%s'", zc_error_name(rc), zc_client_last_error(client));
	rng_seed(&rng, 32);
	block_make_shape(&block, 2, 64, 64, 64, &rng);
	rc = zc_client_staging(client, (block.key_elements + block.value_elements) * 2, &buffer);
	CHILD_EXPECT(rc == 0, "staging: %s '%s'", zc_error_name(rc), zc_client_last_error(client));
	memcpy(buffer, block.keys, block.key_elements);   /* half the keys: bytes, not elements */
	CHILD_EXPECT(write(d->ready_fd, "r", 1) == 1, "ready");
	for (;;)
		pause();
}

/* Many requests whose replies it never reads. */
static int unread_replies_body(void *arg)
{
	const struct dying *d = arg;
	enum { REQUESTS = 400 };
	uint8_t *frames = NULL;
	size_t used = 0;
	int fd = raw_connect(d->socket_path);

	CHILD_EXPECT(fd >= 0, "raw connect: %s", strerror(-fd));
	for (uint64_t i = 0; i < REQUESTS; i++) {
		wire_pb_request request = raw_request(i + 1, zipcache_v1_Request_stats_tag);
		size_t len;
		request.msg.op.stats.session_id = d->session_id;
		uint8_t *frame = raw_encode(&request, &len);
		CHILD_EXPECT(frame != NULL, "encode");
		frames = realloc(frames, used + len);
		CHILD_EXPECT(frames != NULL, "memory");
		memcpy(frames + used, frame, len);
		used += len;
		free(frame);
	}
	CHILD_EXPECT(raw_send(fd, frames, used) == 0, "send");
	free(frames);
	CHILD_EXPECT(write(d->ready_fd, "r", 1) == 1, "ready");
	for (;;)
		pause();
}

enum { DOOMED_UPDATES = 24, DOOMED_TOKENS = 40 };

/* Updates sent in one write and the sender killed before any reply. */
static int updates_in_flight_body(void *arg)
{
	const struct dying *d = arg;
	uint8_t *frames = NULL;
	size_t used = 0;
	int fd = raw_connect(d->socket_path);

	CHILD_EXPECT(fd >= 0, "raw connect: %s", strerror(-fd));
	for (uint32_t i = 0; i < DOOMED_UPDATES; i++) {
		struct block block;
		struct rng rng;
		size_t len;
		rng_seed(&rng, 500 + i);
		block_make_shape(&block, 2, 64, 64, DOOMED_TOKENS, &rng);
		wire_pb_request request = raw_update_request(i + 1, d->session_id, 0, &block);
		uint8_t *frame = raw_encode(&request, &len);
		CHILD_EXPECT(frame != NULL, "encode");
		frames = realloc(frames, used + len);
		CHILD_EXPECT(frames != NULL, "memory");
		memcpy(frames + used, frame, len);
		used += len;
		free(frame);
		block_free(&block);
	}
	CHILD_EXPECT(raw_send(fd, frames, used) == 0, "send");
	free(frames);
	CHILD_EXPECT(write(d->ready_fd, "r", 1) == 1, "ready");
	for (;;)
		pause();
}

/* A client that keeps working, checked at every step, until told to stop. */
struct bystander {
	const char *socket_path;
	int stop_fd;       /* read end: end of stream means stop */
	int report_fd;     /* "r" once going, then its step count */
};

static int bystander_body(void *arg)
{
	const struct bystander *b = arg;
	zc_session_config config = session_config("bystander", 2, 2, 32, 1024, ZC_POLICY_STREAMING, 8);
	char why[WHY_BYTES];
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	uint64_t steps = 0;
	bool stop = false;
	int rc;

	rc = zc_client_connect(b->socket_path, CLIENT_TIMEOUT_MS, &client);
	CHILD_EXPECT(rc == 0, "bystander connect: %s", zc_error_name(rc));
	rc = zc_session_open(client, &config, &session);
	CHILD_EXPECT(rc == 0, "bystander open: %s '%s'", zc_error_name(rc), zc_client_last_error(client));
	model_init(&model, &config);
	rng_seed(&rng, 4242);
	while (!stop) {
		struct pollfd p = { .fd = b->stop_fd, .events = POLLIN };
		stop = poll(&p, 1, 0) > 0;
		if (model.layer[0].tokens > 900 || model.layer[1].tokens > 900)
			CHILD_EXPECT(trim_checked(client, session, &model, 700, why, sizeof(why)),
				     "bystander step %" PRIu64 ": %s", steps, why);
		CHILD_EXPECT(update_checked(client, session, &model, &rng, (uint32_t)(steps % 2),
					    1 + (uint32_t)(steps * 7 % 23), why, sizeof(why)),
			     "bystander step %" PRIu64 ": %s", steps, why);
		if (++steps == 4)
			CHILD_EXPECT(write(b->report_fd, "r", 1) == 1, "ready");
		sleep_ms(1);
	}
	CHILD_EXPECT(session_matches(session, &model, why, sizeof(why)), "bystander at the end: %s", why);
	CHILD_EXPECT(write(b->report_fd, &steps, sizeof(steps)) == (ssize_t)sizeof(steps), "report");
	rc = zc_session_close(session);
	CHILD_EXPECT(rc == 0, "bystander close: %s", zc_error_name(rc));
	zc_client_close(client);
	model_free(&model);
	return 0;
}

START_TEST(killed_clients_leave_nothing_behind)
{
	struct daemon_harness daemon;
	zc_session_config config = precious_config("precious");
	zc_session_config doomed_config = precious_config("doomed");
	struct model model, doomed_model;
	struct bystander bystander;
	struct rng rng;
	int stop[2], report[2], ready[2];
	uint64_t steps = 0;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	zc_session *doomed = open_session(client, &doomed_config);
	model_init(&model, &config);
	model_init(&doomed_model, &doomed_config);
	rng_seed(&rng, 30);
	for (uint32_t step = 0; step < 12; step++)
		CHECK(update_checked, client, session, &model, &rng, step % 2, 1 + step * 5 % 21);
	CHECK(update_checked, client, doomed, &doomed_model, &rng, 1, 7);

	ck_assert_int_eq(pipe2(stop, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(report, O_CLOEXEC), 0);
	bystander = (struct bystander){ daemon.socket_path, stop[0], report[1] };
	pid_t bystander_pid = child_spawn(bystander_body, &bystander, stop[1]);
	close(stop[0]);
	close(report[1]);
	wait_ready(report[0], "bystander");

	/* The baseline: this client and the bystander, and their descriptors. */
	uint32_t connections = server_connections(client);
	ck_assert_uint_eq(connections, 2);
	int fds = fd_count(daemon.pid);
	ck_assert_msg(fds > 0, "cannot count the daemon's descriptors: %s", strerror(-fds));

	struct {
		const char *what;
		child_body body;
		uint64_t session_id;
	} cases[] = {
		{ "half a frame (4 KiB announced, 100 bytes sent)", half_frame_body,
		  zc_session_get_info(session)->id },
		{ "a staging buffer with half a block written", half_staged_body,
		  zc_session_get_info(session)->id },
		{ "400 requests whose replies were never read", unread_replies_body,
		  zc_session_get_info(session)->id },
		{ "24 updates sent and never waited for", updates_in_flight_body,
		  zc_session_get_info(doomed)->id },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct dying d;
		ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
		d = (struct dying){ daemon.socket_path, cases[i].session_id, ready[1] };
		pid_t pid = child_spawn(cases[i].body, &d, stop[1]);
		close(ready[1]);
		wait_ready(ready[0], cases[i].what);
		close(ready[0]);
		/* The daemon has the connection before the kill. */
		ck_assert_msg(wait_connections(client, connections + 1, 10000) == connections + 1,
			      "%s: the daemon never counted the connection", cases[i].what);
		child_kill(pid);
		uint32_t seen = wait_connections(client, connections, 10000);
		ck_assert_msg(seen == connections,
			      "%s: %u connections 10 s after the client was killed, baseline %u",
			      cases[i].what, seen, connections);
		int now = wait_fd_count(daemon.pid, fds, 10000);
		ck_assert_msg(now == fds, "%s: the daemon holds %d descriptors, baseline %d",
			      cases[i].what, now, fds);
		ck_assert_msg(waitpid(daemon.pid, NULL, WNOHANG) == 0, "%s: the daemon died",
			      cases[i].what);
		/* The session they aimed at is as it was. */
		CHECK(session_matches, session, &model);
	}

	/* The updates whose sender died are applied whole, in order, or not
	 * at all: a prefix of them. */
	zc_view view;
	ck_assert_int_eq(zc_session_view(doomed, 0, &view), 0);
	uint32_t applied = view.tokens / DOOMED_TOKENS;
	ck_assert_msg(view.tokens % DOOMED_TOKENS == 0 && applied <= DOOMED_UPDATES,
		      "layer 0 of 'doomed' holds %u tokens: not whole updates of %u", view.tokens,
		      DOOMED_TOKENS);
	for (uint32_t i = 0; i < applied; i++) {
		struct block block;
		struct rng update_rng;
		rng_seed(&update_rng, 500 + i);
		block_make(&block, &doomed_model, DOOMED_TOKENS, &update_rng);
		ck_assert_int_eq(model_update(&doomed_model, 0, DOOMED_TOKENS, block.keys, block.values), 0);
		block_free(&block);
	}
	CHECK(session_matches, doomed, &doomed_model);
	fprintf(stderr, "killed_clients: %u of %u updates of the killed sender were applied\n",
		applied, DOOMED_UPDATES);

	close(stop[1]);
	ck_assert_int_eq(read(report[0], &steps, sizeof(steps)), (ssize_t)sizeof(steps));
	close(report[0]);
	child_wait_ok(bystander_pid, "the bystander client");
	ck_assert_msg(steps > 4, "the bystander made only %" PRIu64 " steps", steps);

	/* And everyone left standing goes on. */
	CHECK(update_checked, client, session, &model, &rng, 0, 64);
	CHECK(update_checked, client, doomed, &doomed_model, &rng, 0, 3);
	ck_assert_int_eq(zc_session_close(session), 0);
	ck_assert_int_eq(zc_session_close(doomed), 0);
	zc_client_close(client);
	model_free(&model);
	model_free(&doomed_model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ======================================================================
 * 4. Limits: a clean refusal, nothing half-stored.
 * ====================================================================== */

START_TEST(connection_limit)
{
	static const char *const args[] = { "--max-connections", "2", NULL };
	struct daemon_harness daemon;
	zc_session_config config = precious_config("first");
	struct model model;
	struct rng rng;
	zc_client *third = NULL;
	wire_pb_response reply;
	int rc;

	daemon_start(&daemon, args);
	zc_client *first = connect_client(&daemon);
	zc_client *second = connect_client(&daemon);
	ck_assert_uint_eq(server_connections(first), 2);

	/* The third is refused, every time, with RESOURCE_EXHAUSTED. */
	for (int i = 0; i < 200; i++) {
		rc = zc_client_connect(daemon.socket_path, CLIENT_TIMEOUT_MS, &third);
		ck_assert_msg(rc == ZC_EEXHAUSTED,
			      "attempt %d: a third connection over --max-connections 2: %s (%d), "
			      "expected ZC_EEXHAUSTED", i, zc_error_name(rc), rc);
	}
	/* What the refusal says (the client frees itself on a failed
	 * connect, so read the frame on a raw socket). */
	int fd = raw_connect(daemon.socket_path);
	ck_assert_msg(fd >= 0, "raw connect: %s", strerror(-fd));
	rc = raw_read_reply(fd, 10000, &reply, NULL);
	ck_assert_msg(rc == 0, "no refusal frame: %s (%d)", zc_strerror(rc), rc);
	ck_assert_msg(reply.msg.status == zipcache_v1_Status_RESOURCE_EXHAUSTED &&
			      reply.msg.request_id == 0 && strstr(reply.msg.message, "connection limit"),
		      "refusal: status %s, request %" PRIu64 ", message '%s'",
		      response_status_name(reply.msg.status), reply.msg.request_id, reply.msg.message);
	wire_pb_response_free(&reply);
	ck_assert_msg(raw_wait_closed(fd, 10000), "the daemon kept a refused connection open");
	close(fd);

	/* The first two never noticed. */
	zc_session *session = open_session(first, &config);
	model_init(&model, &config);
	rng_seed(&rng, 40);
	for (uint32_t step = 0; step < 6; step++)
		CHECK(update_checked, first, session, &model, &rng, step % 2, 3 + step);
	ck_assert_uint_eq(server_connections(second), 2);

	/* A freed slot is taken again. */
	zc_client_close(second);
	ck_assert_uint_eq(wait_connections(first, 1, 10000), 1);
	second = connect_client(&daemon);
	config.attach = true;
	zc_session *attached = open_session(second, &config);
	CHECK(session_matches, attached, &model);
	zc_session_release(attached);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(first);
	zc_client_close(second);
	model_free(&model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

START_TEST(session_limit)
{
	static const char *const args[] = { "--max-sessions", "2", NULL };
	struct daemon_harness daemon;
	zc_session_config a_config = precious_config("a"), b_config = precious_config("b");
	zc_session_config c_config = precious_config("c");
	zc_session_info infos[4];
	struct model a_model;
	struct rng rng;
	zc_session *c = NULL;
	size_t count = 0;
	int rc;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	ck_assert_uint_eq(zc_client_server_info(client)->max_sessions, 2);
	zc_session *a = open_session(client, &a_config);
	zc_session *b = open_session(client, &b_config);
	model_init(&a_model, &a_config);
	rng_seed(&rng, 41);
	CHECK(update_checked, client, a, &a_model, &rng, 0, 20);
	ck_assert_int_eq(session_files(&daemon, NULL), 2);

	rc = zc_session_open(client, &c_config, &c);
	assert_refused(client, rc, ZC_EEXHAUSTED, "session limit", "a third session");
	c_config.name = NULL;   /* an unnamed one neither */
	rc = zc_session_open(client, &c_config, &c);
	assert_refused(client, rc, ZC_EEXHAUSTED, "session limit", "a third, unnamed session");
	ck_assert_int_eq(session_files(&daemon, NULL), 2);
	ck_assert_int_eq(zc_client_list_sessions(client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 2);

	/* At the limit, attaching to an existing session still works. */
	a_config.attach = true;
	zc_session *a_again = open_session(client, &a_config);
	ck_assert_uint_eq(zc_session_get_info(a_again)->id, zc_session_get_info(a)->id);
	zc_session_release(a_again);
	CHECK(session_matches, a, &a_model);

	/* Closing one makes room. */
	ck_assert_int_eq(zc_session_close(b), 0);
	c_config.name = "c";
	c = open_session(client, &c_config);
	ck_assert_int_eq(session_files(&daemon, NULL), 2);
	ck_assert_int_eq(zc_session_close(c), 0);
	ck_assert_int_eq(zc_session_close(a), 0);
	ck_assert_int_eq(session_files(&daemon, NULL), 0);
	zc_client_close(client);
	model_free(&a_model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

START_TEST(max_tokens_limit)
{
	static const char *const args[] = { "--max-tokens", "1000", NULL };
	struct daemon_harness daemon;
	zc_session_config config = precious_config("long");
	zc_session *session = NULL;
	int rc;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	ck_assert_uint_eq(zc_client_server_info(client)->max_tokens_per_session, 1000);
	config.max_tokens = 2000;
	rc = zc_session_open(client, &config, &session);
	assert_refused(client, rc, ZC_EEXHAUSTED, "max_tokens", "open with max_tokens 2000");
	ck_assert_msg(strstr(zc_client_last_error(client), "1000") != NULL,
		      "the refusal does not name the limit: '%s'", zc_client_last_error(client));
	config.max_tokens = 1001;
	rc = zc_session_open(client, &config, &session);
	assert_refused(client, rc, ZC_EEXHAUSTED, "max_tokens", "open with max_tokens 1001");
	ck_assert_int_eq(session_files(&daemon, NULL), 0);
	config.max_tokens = 1000;
	session = open_session(client, &config);
	ck_assert_int_eq(session_files(&daemon, NULL), 1);
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static uint64_t memory_used(zc_client *client)
{
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	return stats.memory_used_bytes;
}

/*
 * Tries one block on a session under a tight budget. Returns true if it
 * was stored (and the model follows), false if the budget refused it —
 * then the refusal must be ZC_EEXHAUSTED naming the budget, with the
 * session exactly as it was.
 */
static char budget_refusal[300];   /* the last refusal's sentence */

/* A session's map as its read-only mapping shows it. */
static const zc_map_header *mapped_header(zc_session *session, uint32_t layers)
{
	const zc_map_header *h = zc_session_map(session);
	ck_assert_msg(memcmp(h->magic, ZC_MAP_MAGIC, sizeof(h->magic)) == 0 && h->layers == layers,
		      "no map header where the mapping starts");
	return h;
}

static uint32_t views_dropped(const zc_map_header *h)
{
	uint32_t dropped = 0;
	for (uint32_t i = 0; i < h->layers; i++)
		dropped += __atomic_load_n(&h->layer[i].view_valid, __ATOMIC_ACQUIRE) == 0;
	return dropped;
}

static bool budget_update(zc_client *client, zc_session *session, struct model *model,
			  const struct block *block, const char *what)
{
	zc_view view;
	int rc = zc_update_and_fetch(session, 0, block->tokens, block->keys, block->values, &view, NULL);

	if (rc == 0) {
		char why[WHY_BYTES] = "";
		ck_assert_int_eq(model_update(model, 0, block->tokens, block->keys, block->values), 0);
		ck_assert_msg(view_matches(model, 0, &view, why, sizeof(why)), "%s: %s", what, why);
		return true;
	}
	assert_refused(client, rc, ZC_EEXHAUSTED, "budget", what);
	snprintf(budget_refusal, sizeof(budget_refusal), "%s", zc_client_last_error(client));
	CHECK(session_matches, session, model);
	return false;
}

START_TEST(memory_budget_refuses_cleanly_and_recovers)
{
	enum { BUDGET = 8u << 20, BLOCK = 128 };
	static const char *const args[] = { "--memory-budget", "8M", NULL };
	struct daemon_harness daemon;
	/* The active session: 2 KiB of views per token. */
	zc_session_config a_config = session_config("active", 1, 4, 128, 8192, ZC_POLICY_STREAMING, 16);
	/* The other: 16 small layers, whose arenas outweigh their views. */
	zc_session_config b_config = session_config("other", 16, 1, 128, 256, ZC_POLICY_STREAMING, 16);
	struct model a_model, b_model;
	struct block block;
	struct rng rng;
	bool dropped = false, refused = false;
	int steps = 0;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	zc_session *b = open_session(client, &b_config);
	model_init(&b_model, &b_config);
	rng_seed(&rng, 50);
	for (uint32_t layer = 0; layer < b_config.layers; layer++)
		CHECK(update_checked, client, b, &b_model, &rng, layer, 40);
	ck_assert_int_eq(zc_session_release_views(b), 0);   /* idle now: its lease ends */
	zc_session *a = open_session(client, &a_config);
	model_init(&a_model, &a_config);

	/* Phase 1: the active session grows; the idle one's views go first
	 * (seen in its header, through the mapping, without touching it: a
	 * request would rebuild them), and never a refusal before that. */
	const zc_map_header *b_header = mapped_header(b, b_config.layers);
	uint64_t before = memory_used(client), lowest_drop = UINT64_MAX;
	for (steps = 0; steps < 80 && !dropped; steps++) {
		block_make(&block, &a_model, BLOCK, &rng);
		ck_assert_msg(budget_update(client, a, &a_model, &block, "growing while 'other' has views"),
			      "refused at step %d while the idle session still had views to drop", steps);
		block_free(&block);
		uint64_t used = memory_used(client);
		ck_assert_msg(used <= BUDGET, "%" PRIu64 " bytes in use over a budget of %u", used, BUDGET);
		dropped = views_dropped(b_header) == b_config.layers;
		if (used < before && before - used < lowest_drop)
			lowest_drop = before - used;
		before = used;
	}
	ck_assert_msg(dropped, "the idle session's views were never (all) dropped in %d steps", steps);
	fprintf(stderr, "memory budget: the idle views were dropped after %d steps%s\n", steps,
		lowest_drop != UINT64_MAX ? ", and memory in use went down" : "");
	/* Read back, the idle session's views are rebuilt bit for bit (the
	 * active one's lease given up, so that its views may make room). */
	ck_assert_int_eq(zc_session_release_views(a), 0);
	CHECK(session_matches, b, &b_model);
	ck_assert_uint_eq(views_dropped(b_header), 0);
	ck_assert_int_eq(zc_session_release_views(b), 0);

	/* Phase 2: grow until nothing idle is left to take from. */
	for (steps = 0; steps < 200 && !refused; steps++) {
		block_make(&block, &a_model, BLOCK, &rng);
		refused = !budget_update(client, a, &a_model, &block, "growing to the limit");
		if (!refused)
			block_free(&block);
		ck_assert_msg(memory_used(client) <= BUDGET, "over the budget");
	}
	ck_assert_msg(refused, "the budget never refused the active session (%u tokens)",
		      a_model.layer[0].tokens);
	/* Only after taking back all the idle session's views. */
	ck_assert_msg(views_dropped(b_header) == b_config.layers,
		      "refused while %u of the idle session's %u layers still had views",
		      b_config.layers - views_dropped(b_header), b_config.layers);
	fprintf(stderr, "memory budget: refused at %u tokens, %" PRIu64 " bytes in use: '%s'\n",
		a_model.layer[0].tokens, memory_used(client), budget_refusal);
	/* Refused again: the same answer, and still nothing stored. */
	ck_assert(!budget_update(client, a, &a_model, &block, "the same block again"));

	/* Phase 3: trimming one block makes room for the same update. */
	CHECK(trim_checked, client, a, &a_model, BLOCK);
	ck_assert_msg(budget_update(client, a, &a_model, &block, "after a trim"),
		      "the same block was refused after trimming one of its size");
	block_free(&block);

	/* Phase 4: full again, then closing the other session makes room. */
	for (steps = 0, refused = false; steps < 200 && !refused; steps++) {
		block_make(&block, &a_model, BLOCK, &rng);
		refused = !budget_update(client, a, &a_model, &block, "growing to the limit again");
		if (!refused)
			block_free(&block);
	}
	ck_assert_msg(refused, "the budget never refused the active session a second time");
	ck_assert_int_eq(zc_session_release_views(a), 0);
	CHECK(session_matches, b, &b_model);   /* rebuilt once more on demand */
	ck_assert_int_eq(zc_session_close(b), 0);
	ck_assert_msg(budget_update(client, a, &a_model, &block, "after closing the other session"),
		      "the same block was refused after the other session was closed");
	block_free(&block);
	CHECK(session_matches, a, &a_model);
	ck_assert_msg(memory_used(client) <= BUDGET, "over the budget at the end");
	ck_assert_int_eq(zc_session_close(a), 0);
	zc_client_close(client);
	model_free(&a_model);
	model_free(&b_model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ======================================================================
 * 5. A daemon restart, as the old client sees it.
 * ====================================================================== */

START_TEST(restart_is_reported_to_the_old_client)
{
	struct daemon_harness daemon;
	zc_session_config config = precious_config("kept");
	zc_session_info infos[2];
	struct model model;
	struct block block;
	struct rng rng;
	zc_view old_view, view;
	char why[WHY_BYTES] = "";
	size_t count = 0;
	int rc;

	daemon_start(&daemon, NULL);
	zc_client *client = connect_client(&daemon);
	uint64_t epoch = zc_client_server_info(client)->boot_epoch;
	zc_session *session = open_session(client, &config);
	uint64_t id = zc_session_get_info(session)->id;
	model_init(&model, &config);
	rng_seed(&rng, 60);
	for (uint32_t step = 0; step < 10; step++)
		CHECK(update_checked, client, session, &model, &rng, step % 2, 1 + step * 9 % 30);
	ck_assert_int_eq(zc_session_view(session, 0, &old_view), 0);

	for (int round = 0; round < 2; round++) {
		/* Round 0: a crash, and the daemon back before the next call.
		 * Round 1: a clean stop, and calls while no daemon runs. */
		block_make(&block, &model, 5, &rng);
		if (round == 0) {
			daemon_kill(&daemon);
			daemon_restart(&daemon);
			rc = zc_update_and_fetch(session, 0, 5, block.keys, block.values, &view, NULL);
		} else {
			daemon_stop(&daemon);
			rc = zc_client_list_sessions(client, infos, 2, &count);
		}
		/* The first call on the dead connection fails, and says so. */
		ck_assert_msg(rc == -EPIPE || rc == -ECONNRESET || rc == ZC_EPROTOCOL,
			      "round %d: the first call on the dropped connection returned %s (%d)",
			      round, zc_error_name(rc), rc);
		ck_assert_msg(zc_client_last_error(client)[0] != '\0',
			      "round %d: the failed call left zc_client_last_error() empty (rc %s)",
			      round, zc_error_name(rc));
		fprintf(stderr, "restart round %d: the first call failed with %s: '%s'\n", round,
			zc_error_name(rc), zc_client_last_error(client));
		/* A second one too: no stale success. */
		rc = zc_session_stats(session, NULL, 0, NULL);
		ck_assert_msg(rc < 0, "round %d: a second call on the dead connection succeeded", round);
		ck_assert_msg(zc_client_last_error(client)[0] != '\0', "round %d: no message", round);
		if (round == 1) {
			/* Nobody answers: a plain error, the old daemon's epoch kept. */
			rc = zc_client_reconnect(client);
			ck_assert_msg(rc == -ENOENT || rc == -ECONNREFUSED,
				      "reconnect with no daemon: %s (%d)", zc_error_name(rc), rc);
			ck_assert_uint_eq(zc_client_server_info(client)->boot_epoch, epoch);
			rc = zc_session_stats(session, NULL, 0, NULL);
			ck_assert_msg(rc < 0 && zc_client_last_error(client)[0] != '\0',
				      "a call after a failed reconnect: %s '%s'", zc_error_name(rc),
				      zc_client_last_error(client));
			daemon_restart(&daemon);
		}

		rc = zc_client_reconnect(client);
		ck_assert_msg(rc == ZC_ERESTARTED, "round %d: reconnect returned %s (%d)", round,
			      zc_error_name(rc), rc);
		ck_assert_msg(zc_client_last_error(client)[0] != '\0',
			      "round %d: ZC_ERESTARTED without a message", round);
		ck_assert_uint_ne(zc_client_server_info(client)->boot_epoch, epoch);
		epoch = zc_client_server_info(client)->boot_epoch;
		/* The same daemon again: no restart to report. */
		ck_assert_int_eq(zc_client_reconnect(client), 0);

		/* The update never reached a daemon: nothing of it is stored. */
		config.attach = true;
		zc_session *again = open_session(client, &config);
		ck_assert_uint_eq(zc_session_get_info(again)->id, id);
		CHECK(session_matches, again, &model);
		/* The old handle's mapping is of the same file: still the
		 * acknowledged tokens, bit for bit. */
		ck_assert_msg(view_matches(&model, 0, &old_view, why, sizeof(why)),
			      "round %d: the old view after the restart: %s", round, why);
		zc_session_release(session);
		session = again;
		CHECK(update_block_checked, client, session, &model, 0, &block, NULL, NULL);
		block_free(&block);
		ck_assert_int_eq(zc_session_view(session, 0, &old_view), 0);
	}
	ck_assert_int_eq(zc_session_close(session), 0);
	zc_client_close(client);
	model_free(&model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static Suite *reliability_suite(void)
{
	Suite *suite = suite_create("reliability");
	const struct test_case cases[] = {
		{ "isolation", { sessions_of_another_user_do_not_exist,
				 default_socket_mode_keeps_other_users_out, NULL } },
		{ "crash", { sigkill_under_load_keeps_acknowledged_tokens, NULL } },
		{ "dying_clients", { killed_clients_leave_nothing_behind, NULL } },
		{ "limits", { connection_limit, session_limit, max_tokens_limit,
			      memory_budget_refuses_cleanly_and_recovers, NULL } },
		{ "restart", { restart_is_reported_to_the_old_client, NULL } },
	};

	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	/* Each test owns its daemon and helper processes: they die with the
	 * test's own process, which only fork mode gives it. */
	return suite_main(reliability_suite(), CK_FORK);
}
