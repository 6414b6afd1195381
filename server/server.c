/*
 * The daemon's lifecycle: the listening socket, adopting sessions left by
 * an earlier run, idle expiry, and a graceful stop on SIGTERM/SIGINT.
 */
#include "server.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "connection.h"
#include "http.h"
#include "log.h"
#include "store.h"

/* How long a stopping daemon waits for in-flight work and unread replies
 * before it closes connections anyway. */
#define STOP_GRACE_MS 10000

static void on_accept(uv_poll_t *handle, int status, int events)
{
	struct server *server = handle->data;
	(void)events;
	if (status < 0) {
		log_warn("server", "listener error", "error=%s", uv_strerror(status));
		return;
	}
	for (;;) {
		int fd = accept4(server->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
			    errno != ECONNABORTED)
				log_warn("server", "accept failed", "error=%s", strerror(errno));
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			return;
		}
		connection_accept(server, fd);
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
	if (mkdir(buffer, mode) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

/* The shared-memory directory is ours alone: 0700, and locked so two
 * daemons never adopt each other's sessions. */
static int shm_dir_claim(struct server *server)
{
	char lock_path[4200];
	int rc = mkdir_parents(server->options.shm_dir, 0700);
	if (rc < 0)
		return rc;
	if (chmod(server->options.shm_dir, 0700) < 0)
		return -errno;
	struct statfs fs;
	if (statfs(server->options.shm_dir, &fs) == 0 && fs.f_type != TMPFS_MAGIC)
		/* Works, but every page is then disk-backed page cache: writes
		 * get slow and closing a session waits on the disk. */
		log_warn("server", "shared-memory directory is not on tmpfs", "path=%s",
			 server->options.shm_dir);
	snprintf(lock_path, sizeof(lock_path), "%s/.lock", server->options.shm_dir);
	server->lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
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

/* Session files of an earlier run: adopted (their acknowledged tokens are
 * all there), or removed with --no-adopt. A file that fails its checks is
 * set aside as .corrupt for a human, never deleted. */
static void sessions_adopt(struct server *server)
{
	DIR *dir = opendir(server->options.shm_dir);
	struct dirent *entry;
	char path[4400];

	if (!dir)
		return;
	while ((entry = readdir(dir))) {
		size_t len = strlen(entry->d_name);
		if (strncmp(entry->d_name, "session-", 8) != 0 || len < 4 ||
		    strcmp(entry->d_name + len - 4, ".zcs") != 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", server->options.shm_dir, entry->d_name);
		if (!server->options.adopt) {
			unlink(path);
			continue;
		}
		struct store *store;
		struct session *session;
		int rc = store_adopt(path, &server->budget, &store);
		if (rc == 0 && session_find(&server->sessions, store_header(store)->session_id,
					    store_header(store)->owner_uid)) {
			store_close(store, false);
			rc = ZC_EEXISTS;
		}
		if (rc == 0)
			rc = session_table_add(&server->sessions, store, &session);
		if (rc < 0) {
			char aside[4420];
			snprintf(aside, sizeof(aside), "%s.corrupt", path);
			log_warn("server", "cannot adopt session file", "path=%s error=%s", path,
				 zc_strerror(rc));
			rename(path, aside);
			continue;
		}
		log_info("server", "adopted session", "session=%llu name=%s uid=%u",
			 (unsigned long long)session->id, session->name, session->owner_uid);
	}
	closedir(dir);
}

static void on_ttl(uv_timer_t *timer)
{
	struct server *server = timer->data;
	uint64_t now = session_now_ms();
	uint64_t ttl_ms = server->options.idle_ttl_seconds * 1000;

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
	server_stop_progress(timer->data);
}

void server_stop_progress(struct server *server)
{
	if (!server->stopping)
		return;
	bool late = uv_now(server->loop) >= server->stop_deadline_ms;
	if (server->sessions.jobs_in_flight > 0 && !late)
		return;
	if (late) {
		while (server->connections)
			connection_close(server->connections);
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
	if (server->listening) {
		server->listening = false;
		uv_close((uv_handle_t *)&server->listener, on_listener_closed);
		unlink(server->options.socket_path);
	}
	for (struct connection *c = server->connections, *next; c; c = next) {
		next = c->next;
		connection_drain(c);
	}
	uv_timer_start(&server->stop_timer, on_stop_tick, 20, 20);
	server_stop_progress(server);
}

static int boot_epoch_make(uint64_t *epoch)
{
	if (getrandom(epoch, sizeof(*epoch), 0) != sizeof(*epoch))
		return -errno;
	if (*epoch == 0)
		*epoch = 1;
	return 0;
}

int server_start(struct server *server, uv_loop_t *loop, const struct options *options)
{
	int rc;

	memset(server, 0, sizeof(*server));
	server->loop = loop;
	server->options = *options;
	server->listen_fd = -1;
	server->lock_fd = -1;
	loop->data = server;
	server->started_ms = uv_now(loop);
	server->budget.limit = options->memory_budget;
	session_table_init(&server->sessions, loop, options->offload_elements);
	rc = boot_epoch_make(&server->boot_epoch);
	if (rc < 0)
		return rc;
	rc = shm_dir_claim(server);
	if (rc < 0) {
		log_error("server", "cannot use the shared-memory directory", "path=%s error=%s",
			  options->shm_dir, rc == -EBUSY ? "another zipcached uses it" : strerror(-rc));
		return rc;
	}
	sessions_adopt(server);
	rc = listener_open(server);
	if (rc < 0) {
		log_error("server", "cannot listen", "socket=%s error=%s", options->socket_path,
			  rc == -EADDRINUSE ? "a live zipcached already listens there" : strerror(-rc));
		return rc;
	}
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
	uv_signal_init(loop, &server->sigterm);
	uv_signal_init(loop, &server->sigint);
	server->sigterm.data = server->sigint.data = server;
	uv_signal_start(&server->sigterm, on_signal, SIGTERM);
	uv_signal_start(&server->sigint, on_signal, SIGINT);
	uv_timer_init(loop, &server->ttl_timer);
	uv_timer_init(loop, &server->stop_timer);
	server->ttl_timer.data = server->stop_timer.data = server;
	if (options->idle_ttl_seconds > 0) {
		uint64_t period = options->idle_ttl_seconds * 1000 / 4;
		if (period > 1000)
			period = 1000;
		if (period < 10)
			period = 10;
		uv_timer_start(&server->ttl_timer, on_ttl, period, period);
	}
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
	if (server->listening) {
		server->listening = false;
		uv_close((uv_handle_t *)&server->listener, on_listener_closed);
		unlink(server->options.socket_path);
	}
	while (server->connections)
		connection_close(server->connections);
	http_stop(server->http);
	server->http = NULL;
	/* Let the close callbacks run, then release what they released. */
	uv_run(server->loop, UV_RUN_DEFAULT);
	session_table_free(&server->sessions);
	if (server->lock_fd >= 0)
		close(server->lock_fd);
}

uint64_t server_memory_bytes(const struct server *server)
{
	return __atomic_load_n(&server->budget.used, __ATOMIC_RELAXED);
}

static int by_last_use(const void *a, const void *b)
{
	const struct session *x = *(struct session *const *)a, *y = *(struct session *const *)b;
	return x->last_used_ms < y->last_used_ms ? -1 : x->last_used_ms > y->last_used_ms;
}

uint64_t server_relieve_memory(struct server *server, uint64_t wanted, const struct session *keep)
{
	struct session_table *table = &server->sessions;
	struct session **candidates = calloc(table->count + 1, sizeof(*candidates));
	size_t count = 0;
	uint64_t freed = 0;

	if (!candidates)
		return 0;
	for (size_t i = 0; i < table->count; i++) {
		struct session *s = table->items[i];
		if (s != keep && session_idle(s))
			candidates[count++] = s;
	}
	qsort(candidates, count, sizeof(*candidates), by_last_use);
	for (size_t i = 0; i < count && freed < wanted; i++) {
		uint64_t bytes = 0;
		int rc = store_drop_views(candidates[i]->store, &bytes);
		if (rc < 0)
			log_warn("server", "cannot drop views", "session=%llu error=%s",
				 (unsigned long long)candidates[i]->id, zc_strerror(rc));
		if (bytes == 0)
			continue;
		freed += bytes;
		server->metrics.view_drops++;
		log_info("server", "dropped idle views", "session=%llu bytes=%llu",
			 (unsigned long long)candidates[i]->id, (unsigned long long)bytes);
	}
	free(candidates);
	return freed;
}
