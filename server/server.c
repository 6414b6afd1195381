/*
 * The daemon's lifecycle: the listening socket, the connections it serves
 * (their owner: accepting, the list, what their reply queues hold, the
 * responder dispatch answers through), adopting sessions left by an
 * earlier run, idle expiry, and a graceful stop on SIGTERM/SIGINT.
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "adopt.h"
#include "codec_fanout.h"
#include "connection.h"
#include "dispatch.h"
#include "http.h"
#include "log.h"
#include "quota.h"
#include "remote.h"
#include "reply.h"
#include "retain.h"
#include "resources.h"
#include "ring.h"
#include "staging.h"
#include "store.h"
#include "zipcache/error.h"

/* How long a stopping daemon waits for in-flight work and unread replies
 * before it closes connections anyway. */
#define STOP_GRACE_MS 10000

/* How long the listener rests after an accept failure it cannot answer:
 * long enough not to spin, short enough that clients barely notice. */
#define ACCEPT_RETRY_MS 100

/* Connections taken per readiness event, so a flood of them cannot keep
 * the loop from serving the connections it has. */
#define ACCEPTS_PER_EVENT 64

/* Below this share of --max-reply-queue-total, connections paused for the
 * total read again (hysteresis: no flapping at the line). */
#define TOTAL_RESUME_NUM 3
#define TOTAL_RESUME_DEN 4

static void stop_progress(struct server *server);
static void on_handle_closed(uv_handle_t *handle);

/* ---- the connections: what each reports, and the responder ---- */

static struct client *client_of_responder(struct responder *responder)
{
	return (struct client *)((char *)responder - offsetof(struct client, responder));
}

static void client_frame(struct connection *connection, const uint8_t *frame, size_t len)
{
	struct client *client = connection->data;
	busy_poll_kick(&client->server->busy_poll, client->server->options.busy_poll_us);
	dispatch_request(client->server, &client->peer, &client->responder, frame, len);
}

static void client_frame_error(struct connection *connection, int error)
{
	struct client *client = connection->data;
	dispatch_reject_frame(client->server, &client->peer, &client->responder, error);
}

/*
 * Whether the replies queued over all connections passed
 * --max-reply-queue-total (and, once past, whether they are still above
 * the resume mark). On a change every connection is told: those with
 * replies waiting pause, or read again.
 */
static void replies_total_update(struct server *server)
{
	uint64_t total = server->options.max_reply_queue_total;
	bool over = server->replies_over ?
		server->reply_queue_bytes >= total / TOTAL_RESUME_DEN * TOTAL_RESUME_NUM :
		server->reply_queue_bytes >= total;
	if (over == server->replies_over)
		return;
	server->replies_over = over;
	log_info("connection", over ? "reply queues full" : "reply queues drained",
		 "queued_bytes=%llu limit=%llu", (unsigned long long)server->reply_queue_bytes,
		 (unsigned long long)total);
	for (struct client *c = server->clients, *next; c; c = next) {
		next = c->next;
		connection_set_total_over(&c->connection, over);
	}
}

/*
 * Reply bytes are heap, which the cgroup counts like the session files, so
 * they are charged to the uid's memory budget and the daemon's. The charge
 * is forced: a reply to work already done cannot be refused, and the
 * queue bounds keep what passes the budget bounded; new sessions and
 * blocks see the room taken until the client reads or goes.
 */
static void client_queued(struct connection *connection, int64_t delta)
{
	struct client *client = connection->data;
	struct server *server = client->server;
	struct quota_usage *quota = client->peer.quota;

	if (delta > 0) {
		store_budget_force(&quota->memory, (uint64_t)delta);
		server->reply_queue_bytes += (uint64_t)delta;
		quota->reply_queue_bytes += (uint64_t)delta;
	} else {
		store_budget_give(&quota->memory, (uint64_t)-delta);
		server->reply_queue_bytes -= (uint64_t)-delta;
		quota->reply_queue_bytes -= (uint64_t)-delta;
	}
	replies_total_update(server);
}

static void client_closing(struct connection *connection)
{
	struct client *client = connection->data;
	struct server *server = client->server;

	if (client->prev)
		client->prev->next = client->next;
	else
		server->clients = client->next;
	if (client->next)
		client->next->prev = client->prev;
	server->n_connections--;
	client->peer.quota->connections--;
	session_table_release_peer(&server->sessions, client->peer.id);
	staging_unref(client->peer.staging);
	client->peer.staging = NULL;
	if (client->peer.ring) {
		ring_close(client->peer.ring);
		client->peer.ring = NULL;
		server->rings--;
	}
	stop_progress(server);
}

static void client_freed(struct connection *connection)
{
	free(connection->data);
}

static const struct connection_callbacks client_callbacks = {
	.frame = client_frame,
	.frame_error = client_frame_error,
	.queued = client_queued,
	.closing = client_closing,
	.freed = client_freed,
};

/* A reply to a client with a request ring goes through the ring's reply
 * area when it can (no descriptors, room): the client polls memory for it
 * instead of the socket, and is nudged with an empty frame if it had
 * gone to sleep on the socket meanwhile. */
static int responder_send(struct responder *responder, uint8_t *frame, size_t len, const int *fds,
			  int n_fds)
{
	struct client *client = client_of_responder(responder);
	bool nudge;
	if (client->peer.ring && n_fds == 0 && client->connection.state != CONNECTION_CLOSING &&
	    ring_reply(client->peer.ring, frame, len, &nudge) == 1) {
		free(frame);
		client->server->counters.ring_replies++;
		if (!nudge)
			return 0;
		client->server->counters.ring_nudges++;
		uint8_t *empty = calloc(1, FRAME_HEADER_BYTES);
		return empty ? connection_send(&client->connection, empty, FRAME_HEADER_BYTES, NULL, 0) :
			       -ENOMEM;
	}
	return connection_send(&client->connection, frame, len, fds, n_fds);
}

static void responder_abort(struct responder *responder)
{
	connection_close(&client_of_responder(responder)->connection);
}

static void responder_begin(struct responder *responder)
{
	connection_request_begin(&client_of_responder(responder)->connection);
}

static void responder_end(struct responder *responder)
{
	connection_request_end(&client_of_responder(responder)->connection);
}

static int responder_take_fd(struct responder *responder)
{
	return connection_take_fd(&client_of_responder(responder)->connection);
}

static const struct responder_ops client_responder = {
	.send = responder_send,
	.abort = responder_abort,
	.begin = responder_begin,
	.end = responder_end,
	.take_fd = responder_take_fd,
};

/* Counts, logs and tells a connection we will not serve why (one
 * RESOURCE_EXHAUSTED frame saying `message`), then closes it. */
static void socket_refuse(struct server *server, int fd, const char *reason, const char *message)
{
	uint8_t frame[512];
	size_t len = 0;

	metrics_error_reason(&server->metrics, METRICS_REASON_CONNECTION_REFUSED);
	log_warn("connection", "refused", "reason=\"%s\" message=\"%s\"", reason, message);
	int rc = reply_refusal_frame(message, frame, sizeof(frame), &len);
	connection_refuse_socket(fd, rc == 0 ? frame : NULL, len);
}

void server_accept(struct server *server, int fd)
{
	struct ucred credentials;
	socklen_t length = sizeof(credentials);
	struct client *client;
	char message[160];

	if (server->n_connections >= server->options.max_connections || server->stopping) {
		snprintf(message, sizeof(message), server->stopping ? "the daemon is stopping" :
			 "connection limit of %u reached", server->options.max_connections);
		socket_refuse(server, fd, server->stopping ? "stopping" : "connection limit", message);
		return;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) < 0) {
		log_warn("connection", "refused: no peer credentials", "error=%s", strerror(errno));
		close(fd);
		return;
	}
	struct quota_usage *quota = quota_usage_of(&server->quotas, credentials.uid);
	if (!quota) {
		socket_refuse(server, fd, "out of memory", "out of memory for this uid's quota entry");
		return;
	}
	uint64_t uid_limit = quota_limits_of(&server->quotas, quota)->connections;
	if (uid_limit && quota->connections >= uid_limit) {
		snprintf(message, sizeof(message),
			 "connection limit of %llu per uid reached (uid %u has %u; --max-connections-per-uid)",
			 (unsigned long long)uid_limit, (unsigned)credentials.uid, quota->connections);
		socket_refuse(server, fd, "uid connection limit", message);
		return;
	}
	client = calloc(1, sizeof(*client));
	if (!client || connection_init(&client->connection, server->loop, fd, credentials.uid,
				       credentials.pid, &client_callbacks, &server->connection_limits,
				       client) < 0) {
		free(client);
		close(fd);
		return;
	}
	client->server = server;
	client->responder.ops = &client_responder;
	/* A connection that arrives while the total is over its bound is
	 * held to it like the others. */
	connection_set_total_over(&client->connection, server->replies_over);
	client->peer = (struct peer){ .id = client->connection.id, .uid = credentials.uid,
				      .quota = quota };
	quota->connections++;
	client->next = server->clients;
	if (server->clients)
		server->clients->prev = client;
	server->clients = client;
	server->n_connections++;
	server->counters.connections_accepted++;
}

static void on_accept(uv_poll_t *handle, int status, int events);

static int spare_open(void)
{
	return open("/dev/null", O_RDONLY | O_CLOEXEC);
}

static void on_accept_retry(uv_timer_t *timer)
{
	struct server *server = timer->data;
	if (server->spare_fd < 0)
		server->spare_fd = spare_open();
	if (server->listening)
		uv_poll_start(&server->listener, UV_READABLE, on_accept);
}

/* Stops polling the listener for ACCEPT_RETRY_MS: the failure would only
 * repeat at once (the listener stays readable while connections wait). */
static void listener_rest(struct server *server, int error)
{
	log_warn("server", "accept failed", "error=%s connections=%u descriptor_limit=%llu retry_ms=%d",
		 strerror(error), server->n_connections, (unsigned long long)server->descriptor_limit,
		 ACCEPT_RETRY_MS);
	uv_poll_stop(&server->listener);
	uv_timer_start(&server->accept_timer, on_accept_retry, ACCEPT_RETRY_MS, 0);
}

/*
 * Out of descriptors, a waiting connection is still answered: the spare
 * is closed, the connection accepted, told RESOURCE_EXHAUSTED and closed,
 * and the spare reopened (libuv's uv__emfile_trick). Returns 1 when one
 * was refused, 0 when none was waiting, a negative errno when that did
 * not work (no spare, or the freed slot went elsewhere).
 */
static int refuse_with_spare(struct server *server)
{
	char message[160];
	int fd, rc;

	if (server->spare_fd < 0)
		return -EMFILE;
	close(server->spare_fd);
	fd = accept4(server->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
	rc = fd >= 0 ? 1 : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -errno;
	if (fd >= 0) {
		snprintf(message, sizeof(message),
			 "out of file descriptors (the daemon's limit is %llu): connection refused, "
			 "try again later", (unsigned long long)server->descriptor_limit);
		socket_refuse(server, fd, "descriptor limit", message);
	}
	server->spare_fd = spare_open();
	return rc;
}

static void on_accept(uv_poll_t *handle, int status, int events)
{
	struct server *server = handle->data;
	(void)events;
	if (status < 0) {
		log_warn("server", "listener error", "error=%s", uv_strerror(status));
		return;
	}
	for (int taken = 0; taken < ACCEPTS_PER_EVENT; taken++) {
		int fd = accept4(server->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd >= 0) {
			server_accept(server, fd);
			continue;
		}
		int error = errno;
		if (error == EINTR || error == ECONNABORTED)
			continue;
		if (error == EAGAIN || error == EWOULDBLOCK)
			return;
		if (error == EMFILE || error == ENFILE) {
			int rc = refuse_with_spare(server);
			if (rc > 0)
				continue;
			if (rc == 0)
				return;
			error = -rc;
		}
		listener_rest(server, error);
		return;
	}
}

/* A socket file nobody answers on is left over from a crash: remove it.
 * One somebody answers on belongs to a live daemon: refuse to start. */
static int socket_clear_stale(const struct sockaddr_un *address)
{
	struct stat st;
	if (lstat(address->sun_path, &st) < 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISSOCK(st.st_mode))
		return -EEXIST;
	int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (probe < 0)
		return -errno;
	int rc = connect(probe, (const struct sockaddr *)address, sizeof(*address));
	close(probe);
	if (rc == 0)
		return -EADDRINUSE;
	log_info("server", "removing stale socket", "path=%s", address->sun_path);
	return unlink(address->sun_path) < 0 ? -errno : 0;
}

static int listener_open(struct server *server)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	const char *path = server->options.socket_path;
	int rc;

	if (strlen(path) >= sizeof(address.sun_path))
		return -ENAMETOOLONG;
	memcpy(address.sun_path, path, strlen(path) + 1);
	rc = socket_clear_stale(&address);
	if (rc < 0)
		return rc;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	/* Bind under a tight umask so the socket is never, even briefly,
	 * more open than --socket-mode says. */
	mode_t old_mask = umask(0177);
	rc = bind(fd, (const struct sockaddr *)&address, sizeof(address));
	umask(old_mask);
	if (rc < 0 || chmod(path, server->options.socket_mode) < 0 || listen(fd, 256) < 0) {
		rc = -errno;
		close(fd);
		unlink(path);
		return rc;
	}
	server->listen_fd = fd;
	uv_poll_init(server->loop, &server->listener, fd);
	server->listener.data = server;
	uv_poll_start(&server->listener, UV_READABLE, on_accept);
	server->listening = true;
	return 0;
}

static int mkdir_parents(const char *path, mode_t mode)
{
	char buffer[4096];
	snprintf(buffer, sizeof(buffer), "%s", path);
	for (char *p = buffer + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buffer, 0755) < 0 && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	/* mkdir is atomic: made now, it is ours with exactly this mode. */
	if (mkdir(buffer, mode) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

/*
 * The shared-memory directory must be ours alone before anything in it is
 * trusted: owned by the daemon's uid, no access for group or others, not a
 * symlink. It is opened once; every file in it is then opened relative to
 * that descriptor with O_NOFOLLOW, and locked so two daemons never adopt
 * each other's sessions.
 */
static int shm_dir_claim(struct server *server)
{
	const char *path = server->options.shm_dir;
	struct stat st;
	int rc = mkdir_parents(path, 0700);
	if (rc < 0)
		return rc;
	int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0) {
		rc = -errno;
		close(fd);
		return rc;
	}
	if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
		log_error("server", "refusing an untrusted shared-memory directory",
			  "path=%s owner=%u mode=%04o need_owner=%u need_mode=0700", path,
			  (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777), (unsigned)geteuid());
		close(fd);
		return -EPERM;
	}
	server->shm_dir_fd = fd;
	struct statfs fs;
	if (fstatfs(fd, &fs) == 0 && fs.f_type != TMPFS_MAGIC)
		/* Works, but every page is then disk-backed page cache: writes
		 * get slow and closing a session waits on the disk. */
		log_warn("server", "shared-memory directory is not on tmpfs", "path=%s", path);
	server->lock_fd = openat(fd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (server->lock_fd < 0)
		return -errno;
	if (flock(server->lock_fd, LOCK_EX | LOCK_NB) < 0) {
		rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
		close(server->lock_fd);
		server->lock_fd = -1;
		return rc;
	}
	return 0;
}

/* Views of sessions nobody used (or leased) for --view-idle-seconds are
 * dropped without memory pressure: an idle session costs its compressed
 * bytes; its next use rebuilds them off the loop thread. */
static void views_drop_idle(struct server *server, uint64_t now)
{
	uint64_t idle_ms = server->options.view_idle_seconds * 1000;
	if (idle_ms == 0)
		return;
	for (size_t i = 0; i < server->sessions.count; i++) {
		struct session *s = server->sessions.items[i];
		struct store_memory held = { 0 };
		if (!session_idle(s) || now - s->last_used_ms < idle_ms || session_leased(s, now) ||
		    !store_views_full(s->store))
			continue;
		store_memory_add(s->store, &held);
		if (held.views == 0)
			continue;
		uint64_t freed = 0;
		int rc = store_drop_views(s->store, &freed);
		if (rc < 0)
			log_warn("server", "cannot drop idle views", "session=%llu error=%s",
				 (unsigned long long)s->id, zc_strerror(rc));
		if (freed > 0) {
			server->metrics.view_drops++;
			server->metrics.idle_view_drops++;
			log_info("server", "dropped the views of an idle session", "session=%llu bytes=%llu idle_ms=%llu",
				 (unsigned long long)s->id, (unsigned long long)freed,
				 (unsigned long long)(now - s->last_used_ms));
		}
	}
}

static void on_ttl(uv_timer_t *timer)
{
	struct server *server = timer->data;
	uint64_t now = session_now_ms();
	uint64_t ttl_ms = server->options.idle_ttl_seconds * 1000;

	if (server->adoption.n_pending > 0)
		adopt_retry(server);
	/* Pages a client's read faults allocated are memory too. */
	for (size_t i = 0; i < server->sessions.count; i++)
		if (session_idle(server->sessions.items[i]))
			store_sync_charge(server->sessions.items[i]->store);
	pool_set_sync_charge(&server->pools);
	views_drop_idle(server, now);
	offload_scan(server, now);
	if (ttl_ms == 0)
		return;

	for (size_t i = 0; i < server->sessions.count;) {
		struct session *session = server->sessions.items[i];
		if (!session_idle(session) || now - session->last_used_ms < ttl_ms) {
			i++;
			continue;
		}
		log_info("session", "expired", "session=%llu name=%s idle_ms=%llu",
			 (unsigned long long)session->id, session->name,
			 (unsigned long long)(now - session->last_used_ms));
		/* Retiring moves the last session into slot i: do not advance. */
		session_retire(&server->sessions, session, true);
		session_release_if_unused(session);
	}
}

static void on_signal(uv_signal_t *handle, int signum)
{
	struct server *server = handle->data;
	log_info("server", "stopping", "signal=%d", signum);
	server_stop(server);
}

static void on_stop_tick(uv_timer_t *timer)
{
	stop_progress(timer->data);
}

/* While stopping: ends the loop once no connection or job is left, and
 * past the grace period closes what is still open. */
static void stop_progress(struct server *server)
{
	if (!server->stopping)
		return;
	bool late = uv_now(server->loop) >= server->stop_deadline_ms;
	if (server->sessions.jobs_in_flight > 0 && !late)
		return;
	if (late) {
		while (server->clients)
			connection_close(&server->clients->connection);
	}
	if (server->n_connections == 0 && server->sessions.jobs_in_flight == 0)
		uv_stop(server->loop);
}

static void on_listener_closed(uv_handle_t *handle)
{
	struct server *server = handle->data;
	close(server->listen_fd);
	server->listen_fd = -1;
}

void server_stop(struct server *server)
{
	if (server->stopping)
		return;
	server->stopping = true;
	sd_notify(0, "STOPPING=1");
	server->stop_deadline_ms = uv_now(server->loop) + STOP_GRACE_MS;
	busy_poll_close(&server->busy_poll, on_handle_closed);
	ring_pump_close(&server->ring_pump, on_handle_closed);
	if (server->listening) {
		server->listening = false;
		uv_close((uv_handle_t *)&server->listener, on_listener_closed);
		unlink(server->options.socket_path);
	}
	for (struct client *c = server->clients, *next; c; c = next) {
		next = c->next;
		connection_drain(&c->connection);
	}
	uv_timer_start(&server->stop_timer, on_stop_tick, 20, 20);
	stop_progress(server);
}

/* Sparse session files cost address space, not memory: half the
 * address-space limit, and at most half of x86-64's 128 TiB of user space,
 * so that libraries, heaps and thread stacks always have room. */
static uint64_t map_limit_default(void)
{
	uint64_t limit = UINT64_C(64) << 40;
	struct rlimit as;
	if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY && as.rlim_cur / 2 < limit)
		limit = as.rlim_cur / 2;
	return limit;
}

static int boot_epoch_make(uint64_t *epoch)
{
	if (getrandom(epoch, sizeof(*epoch), 0) != sizeof(*epoch))
		return -errno;
	if (*epoch == 0)
		*epoch = 1;
	return 0;
}

/* The soft descriptor limit goes up to the hard one (adoption and the
 * configured limits need descriptors); what the limits need is said, and
 * warned about when the limit is lower. */
static void descriptors_prepare(struct server *server)
{
	uint64_t before = 0, soft = 0, hard = 0;
	char formula[96];
	int rc = resources_raise_descriptor_limit(&before, &soft, &hard);
	uint64_t need = resources_descriptors_needed(&server->options);

	resources_descriptors_formula(&server->options, formula, sizeof(formula));
	server->descriptor_limit = soft;
	if (rc < 0)
		log_warn("server", "cannot raise the descriptor limit", "soft=%llu hard=%llu error=%s",
			 (unsigned long long)soft, (unsigned long long)hard, strerror(-rc));
	log_info("server", "descriptor limit", "soft=%llu hard=%llu soft_before=%llu needed=%llu",
		 (unsigned long long)soft, (unsigned long long)hard, (unsigned long long)before,
		 (unsigned long long)need);
	if (soft < need)
		log_warn("server", "descriptor limit below what the limits need",
			 "limit=%llu needed=%llu formula=\"%s\" fix=\"raise the hard RLIMIT_NOFILE "
			 "(systemd LimitNOFILE=) or lower --max-connections / --max-sessions\"",
			 (unsigned long long)soft, (unsigned long long)need, formula);
	server->spare_fd = spare_open();
}

/* Without --memory-budget the budget fits the host: the shm-dir's file
 * system and the cgroup's memory limit (resources.h). Then the per-uid
 * quotas, which are shares of the daemon-wide limits. */
static void limits_resolve(struct server *server)
{
	struct options *o = &server->options;
	struct quota_limits quota;

	if (o->memory_budget == OPTIONS_DERIVED) {
		struct resources_memory memory;
		char cgroup[32] = "none";
		resources_memory_budget_default(o->shm_dir, &memory);
		if (memory.cgroup_bytes)
			snprintf(cgroup, sizeof(cgroup), "%llu", (unsigned long long)memory.cgroup_bytes);
		o->memory_budget = memory.budget;
		if (memory.budget)
			log_info("server", "memory budget derived",
				 "budget=%llu shm_fs_bytes=%llu cgroup_limit=%s", (unsigned long long)memory.budget,
				 (unsigned long long)memory.fs_bytes, cgroup);
		else
			log_warn("server", "no memory budget",
				 "reason=\"the shm-dir's file system has no size and no cgroup limits memory\"");
	}
	server->budget.limit = o->memory_budget;
	quota_limits_resolve(o, &quota);
	quota_table_init(&server->quotas, &quota, &server->budget, &server->staging, (uint32_t)geteuid());
	log_info("server", "per-uid quotas",
		 "sessions=%llu connections=%llu memory=%llu staging=%llu exempt=\"root, uid %u\"",
		 (unsigned long long)quota.sessions, (unsigned long long)quota.connections,
		 (unsigned long long)quota.memory, (unsigned long long)quota.staging,
		 (unsigned)geteuid());
}

void server_memory_by_kind(const struct server *server, bool all, uint32_t uid,
			   struct store_memory *kinds, uint64_t *file_bytes)
{
	*kinds = (struct store_memory){ 0 };
	*file_bytes = 0;
	for (size_t i = 0; i < server->sessions.count; i++) {
		const struct session *s = server->sessions.items[i];
		if (all || s->owner_uid == uid) {
			*file_bytes += store_memory_bytes(s->store);
			store_memory_add(s->store, kinds);
		}
	}
	for (size_t i = 0; i < server->pools.n; i++) {
		const struct pool *pool = server->pools.items[i];
		if (all || pool_uid(pool) == uid) {
			uint64_t held = pool_memory_bytes(pool), kept = pool_kept_bytes(pool);
			if (kept > held)
				kept = held;
			kinds->blocks += held - kept;
			kinds->retained_extents += kept;
			*file_bytes += held;
		}
	}
	kinds->retained_maps = retain_map_bytes(all, uid);
	*file_bytes += kinds->retained_maps;
}

int server_start(struct server *server, uv_loop_t *loop, const struct options *options)
{
	int rc;

	memset(server, 0, sizeof(*server));
	server->loop = loop;
	server->options = *options;
	server->listen_fd = -1;
	server->lock_fd = -1;
	server->shm_dir_fd = -1;
	server->spare_fd = -1;
	loop->data = server;
	server->started_ms = uv_now(loop);
	server->connection_limits = (struct connection_limits){
		.max_frame_bytes = options->max_frame_bytes,
		.max_reply_queue_bytes = options->max_reply_queue_bytes,
	};
	(void)workers_start(&server->workers, loop);
	session_table_init(&server->sessions, &server->workers, options->offload_elements);
	store_set_map_limit(options->max_mapped_bytes ? options->max_mapped_bytes : map_limit_default());
	retain_set_limit(options->retain_bytes);
	(void)codec_fanout_set_threads(options->codec_threads);
	if (server->options.ring_poll_us == RING_POLL_AUTO)
		server->options.ring_poll_us = busy_poll_ring_default(resources_cpus_online());
	if (server->options.pool_writes == POOL_WRITES_AUTO) {
		double map_us, copy_us;
		server->options.pool_writes = pool_writes_probe(&map_us, &copy_us);
		log_info("pool", "writes chosen", "mode=%s map_us=%.0f copy_us=%.0f bytes=1048576",
			 pool_writes_name(server->options.pool_writes), map_us, copy_us);
	}
	pool_writes_set(server->options.pool_writes);
	rc = boot_epoch_make(&server->boot_epoch);
	if (rc < 0)
		return rc;
	descriptors_prepare(server);
	rc = shm_dir_claim(server);
	if (rc < 0) {
		log_error("server", "cannot use the shared-memory directory", "path=%s error=%s",
			  options->shm_dir,
			  rc == -EBUSY ? "another zipcached uses it" :
			  rc == -EPERM ? "it must be owned by the daemon's uid, mode 0700" :
					 strerror(-rc));
		return rc;
	}
	limits_resolve(server);
	pool_set_init(&server->pools, server->shm_dir_fd, server->options.shm_dir);
	rc = prefix_index_init(&server->prefix, PREFIX_INDEX_MAX_BLOCKS);
	if (rc < 0)
		return rc;
	adopt_scan(server);
	if (options->remote.n_endpoints) {
		char why[512];
		rc = remote_open(&options->remote, &server->remote, why, sizeof(why));
		if (rc < 0) {
			log_error("server", "cannot use the remote tier", "error=%s reason=\"%s\"",
				  zc_error_name(rc), why);
			return rc;
		}
	}
	/* SIGTERM handled before anything can see the daemon up: a
	 * supervisor (or a test) that stops it as soon as the socket accepts
	 * must get the graceful stop, not the default action. The callback
	 * runs from the loop, so only once everything below is set up. */
	uv_signal_init(loop, &server->sigterm);
	uv_signal_init(loop, &server->sigint);
	server->sigterm.data = server->sigint.data = server;
	uv_signal_start(&server->sigterm, on_signal, SIGTERM);
	uv_signal_start(&server->sigint, on_signal, SIGINT);
	/* The endpoint before the socket: a client (or a readiness probe)
	 * that can connect finds the metrics already served. */
	if (strcmp(options->metrics_listen, "off") != 0) {
		rc = http_start(server, options->metrics_listen, &server->http);
		if (rc < 0)
			/* The cache still works without its metrics; say so loudly. */
			log_error("server", "metrics endpoint disabled", "listen=%s error=%s",
				  options->metrics_listen, strerror(-rc));
		else
			log_info("server", "metrics endpoint", "listen=%s port=%u", options->metrics_listen,
				 http_port(server->http));
	}
	rc = listener_open(server);
	if (rc < 0) {
		log_error("server", "cannot listen", "socket=%s error=%s", options->socket_path,
			  rc == -EADDRINUSE ? "a live zipcached already listens there" : strerror(-rc));
		http_stop(server->http);
		server->http = NULL;
		return rc;
	}
	uv_timer_init(loop, &server->ttl_timer);
	uv_timer_init(loop, &server->stop_timer);
	uv_timer_init(loop, &server->accept_timer);
	server->ttl_timer.data = server->stop_timer.data = server->accept_timer.data = server;
	/* The same tick expires idle sessions, drops idle views, offloads
	 * idle sessions, retries files adoption could not read yet, and
	 * charges pages clients faulted in: a quarter of the shortest idle
	 * bound under 4 s, so that each acts within 1.25 times its bound. */
	uint64_t period = 1000;
	const uint64_t bounds[] = { options->idle_ttl_seconds, options->view_idle_seconds,
				    options->offload_idle_seconds };
	for (size_t i = 0; i < sizeof(bounds) / sizeof(bounds[0]); i++)
		if (bounds[i] > 0 && bounds[i] < 4 && bounds[i] * 1000 / 4 < period)
			period = bounds[i] * 1000 / 4;
	if (period < 10)
		period = 10;
	uv_timer_start(&server->ttl_timer, on_ttl, period, period);
	busy_poll_init(&server->busy_poll, loop, &server->workers);
	ring_pump_init(&server->ring_pump, server);
	return 0;
}

static void on_handle_closed(uv_handle_t *handle)
{
	(void)handle;
}

void server_free(struct server *server)
{
	uv_close((uv_handle_t *)&server->sigterm, on_handle_closed);
	uv_close((uv_handle_t *)&server->sigint, on_handle_closed);
	uv_close((uv_handle_t *)&server->ttl_timer, on_handle_closed);
	uv_close((uv_handle_t *)&server->stop_timer, on_handle_closed);
	uv_close((uv_handle_t *)&server->accept_timer, on_handle_closed);
	busy_poll_close(&server->busy_poll, on_handle_closed);
	ring_pump_close(&server->ring_pump, on_handle_closed);
	if (server->listening) {
		server->listening = false;
		uv_close((uv_handle_t *)&server->listener, on_listener_closed);
		unlink(server->options.socket_path);
	}
	while (server->clients)
		connection_close(&server->clients->connection);
	http_stop(server->http);
	server->http = NULL;
	/* Nothing is in flight once the loop stopped (stop_progress). */
	workers_stop(&server->workers, on_handle_closed);
	codec_fanout_stop();
	/* Let the close callbacks run, then release what they released. */
	uv_run(server->loop, UV_RUN_DEFAULT);
	session_table_free(&server->sessions);
	/* After the stores (the last closes may keep their maps), before the
	 * quotas (which the maps are charged to). */
	retain_maps_release(true, 0, UINT64_MAX);
	/* Its references go back before the pools are freed. */
	prefix_index_free(&server->prefix);
	/* After the stores (which borrow them), before the quotas (which
	 * they charge). */
	pool_set_free(&server->pools);
	/* After the stores: each gave its charge back to its uid's budget. */
	quota_table_free(&server->quotas);
	if (server->lock_fd >= 0)
		close(server->lock_fd);
	if (server->shm_dir_fd >= 0)
		close(server->shm_dir_fd);
	adopt_free(&server->adoption);
	if (server->spare_fd >= 0)
		close(server->spare_fd);
	server->spare_fd = -1;
	remote_close(server->remote);
	server->remote = NULL;
}
