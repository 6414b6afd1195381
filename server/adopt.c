/* Adoption of session files: see adopt.h and docs/DURABILITY.md. */
#include "adopt.h"
#include "pool.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "quota.h"
#include "server.h"
#include "store.h"

static bool has_suffix(const char *name, const char *suffix)
{
	size_t len = strlen(name), n = strlen(suffix);
	return len >= n && strcmp(name + len - n, suffix) == 0;
}

/* The id in session-ID.zcs (and its .corrupt and temporary forms), so
 * that new sessions never take the name of a file that is still there. */
static void id_seen(struct server *server, const char *name)
{
	const char *p = strstr(name, "session-");
	if (!p)
		return;
	unsigned long long id = strtoull(p + 8, NULL, 16);
	if (id >= server->sessions.next_id)
		server->sessions.next_id = id + 1;
}

static void set_aside_add(struct adoption *adoption, const char *file, const char *reason)
{
	struct adopt_entry *grown = realloc(adoption->set_aside,
					    (adoption->n_set_aside + 1) * sizeof(*grown));
	if (!grown)
		return;   /* the log line still says it */
	adoption->set_aside = grown;
	struct adopt_entry *e = &grown[adoption->n_set_aside++];
	snprintf(e->file, sizeof(e->file), "%s", file);
	snprintf(e->reason, sizeof(e->reason), "%s", reason);
}

static void pending_add(struct adoption *adoption, const char *file)
{
	for (size_t i = 0; i < adoption->n_pending; i++)
		if (strcmp(adoption->pending[i].file, file) == 0)
			return;
	struct adopt_pending *grown = realloc(adoption->pending,
					      (adoption->n_pending + 1) * sizeof(*grown));
	if (!grown)
		return;
	adoption->pending = grown;
	grown[adoption->n_pending++] = (struct adopt_pending){ 0 };
	snprintf(grown[adoption->n_pending - 1].file, sizeof(grown[0].file), "%s", file);
}

/* Who a pending file belongs to, if its header can be read now. */
static void pending_identify(struct server *server, struct adopt_pending *p)
{
	struct store_header header;
	int fd = openat(server->shm_dir_fd, p->file, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return;
	if (pread(fd, &header, sizeof(header), 0) == (ssize_t)sizeof(header) &&
	    memchr(header.name, '\0', sizeof(header.name))) {
		p->known = true;
		p->uid = header.owner_uid;
		snprintf(p->name, sizeof(p->name), "%s", header.name);
	}
	close(fd);
}

/* What a daemon may wait out: the file is fine, the moment is not. */
static bool error_is_passing(int rc)
{
	return rc == -EMFILE || rc == -ENFILE || rc == -ENOMEM || rc == -EAGAIN || rc == -EACCES ||
	       rc == -ENOSPC || rc == -EINTR || rc == ZC_EEXHAUSTED;
}

/* One file: true when it is settled (adopted or set aside), false when
 * it should be tried again. */
static bool adopt_one(struct server *server, const char *file)
{
	struct adoption *adoption = &server->adoption;
	struct store *store;
	struct session *session;
	char reason[200] = "";
	int rc = store_adopt(server->shm_dir_fd, server->options.shm_dir, file, NULL, &server->pools,
			     &store, reason, sizeof(reason));

	if (rc == 0 && session_find(&server->sessions, store_header(store)->session_id,
				    store_header(store)->owner_uid)) {
		store_release_blocks(store);
		store_close(store, false);
		rc = ZC_ECORRUPT;
		snprintf(reason, sizeof(reason), "another file holds the same session id");
	}
	if (rc == 0) {
		struct store_budget *quota = quota_budget(&server->quotas, store_header(store)->owner_uid);
		store_charge_to(store, quota);
		pool_charge_to(store_pool(store), quota);
		rc = session_table_add(&server->sessions, store, &session);
		if (rc < 0) {
			/* Tried again later: it claims its blocks again then. */
			store_release_blocks(store);
			store_close(store, false);
		}
	}
	if (rc == 0) {
		log_info("server", "adopted session", "session=%llu name=%s uid=%u",
			 (unsigned long long)session->id, session->name, session->owner_uid);
		return true;
	}
	if (rc == ZC_ECORRUPT) {
		char aside[96];
		snprintf(aside, sizeof(aside), "%s.corrupt", file);
		log_warn("server", "session file set aside", "file=%s reason=\"%s\"", file, reason);
		if (renameat2(server->shm_dir_fd, file, server->shm_dir_fd, aside, RENAME_NOREPLACE) < 0)
			log_warn("server", "cannot rename the set-aside file", "file=%s error=%s", file,
				 strerror(errno));
		set_aside_add(adoption, aside, reason);
		return true;
	}
	if (rc == -EPERM) {
		log_warn("server", "session file left alone", "file=%s reason=\"%s\"", file, reason);
		set_aside_add(adoption, file, reason);
		return true;
	}
	if (rc == -ENOENT)
		return true;   /* gone meanwhile */
	if (!error_is_passing(rc)) {
		/* Not a session file at all (a symlink, a socket, ...): listed,
		 * left where it is, never waited for. */
		snprintf(reason, sizeof(reason), "cannot be opened as a session file: %s",
			 zc_strerror(rc));
		log_warn("server", "session file left alone", "file=%s reason=\"%s\"", file, reason);
		set_aside_add(adoption, file, reason);
		return true;
	}
	/* EMFILE, ENFILE, ENOMEM, EAGAIN, EACCES, ENOSPC, the address-space
	 * bound: nothing is wrong with the file; it stays where it is and is
	 * tried again. */
	log_warn("server", "cannot adopt session file now, will retry", "file=%s error=%s", file,
		 zc_strerror(rc));
	return false;
}

void adopt_scan(struct server *server)
{
	struct adoption *adoption = &server->adoption;
	int fd = dup(server->shm_dir_fd);
	DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
	struct dirent *entry;

	if (!dir) {
		log_error("server", "cannot list the shared-memory directory", "path=%s error=%s",
			  server->options.shm_dir, strerror(errno));
		if (fd >= 0)
			close(fd);
		return;
	}
	while ((entry = readdir(dir))) {
		const char *name = entry->d_name;
		if (strlen(name) >= sizeof(adoption->pending[0].file))
			continue;
		if (strncmp(name, ".session-", 9) == 0 && has_suffix(name, ".zcs.tmp")) {
			/* An open that never reached its commit point (the rename). */
			id_seen(server, name);
			unlinkat(server->shm_dir_fd, name, 0);
			continue;
		}
		if (strncmp(name, ".pool-", 6) == 0 && has_suffix(name, ".zcp.tmp")) {
			unlinkat(server->shm_dir_fd, name, 0);
			continue;
		}
		if (strncmp(name, "pool-", 5) == 0 && has_suffix(name, ".zcp")) {
			/* Pools are opened below (or, with --no-adopt, go with
			 * the sessions whose blocks they hold). */
			if (!server->options.adopt)
				unlinkat(server->shm_dir_fd, name, 0);
			continue;
		}
		if (strncmp(name, "session-", 8) != 0)
			continue;
		id_seen(server, name);
		if (has_suffix(name, ".zcs.corrupt")) {
			set_aside_add(adoption, name, "set aside by an earlier run");
			continue;
		}
		if (!has_suffix(name, ".zcs"))
			continue;
		if (!server->options.adopt) {
			unlinkat(server->shm_dir_fd, name, 0);
			continue;
		}
		pending_add(adoption, name);
	}
	closedir(dir);
	if (server->options.adopt) {
		/* Every pool, so that the sweep frees blocks no session names,
		 * even in a pool whose sessions are all gone. */
		pool_set_scan(&server->pools, NULL);
		for (size_t i = 0; i < server->pools.n; i++)
			pool_charge_to(server->pools.items[i],
				       quota_budget(&server->quotas, pool_uid(server->pools.items[i])));
	}
	adopt_retry(server);
}

size_t adopt_retry(struct server *server)
{
	struct adoption *adoption = &server->adoption;
	size_t kept = 0;
	for (size_t i = 0; i < adoption->n_pending; i++) {
		struct adopt_pending p = adoption->pending[i];
		if (adopt_one(server, p.file))
			continue;
		if (!p.known)
			pending_identify(server, &p);
		adoption->pending[kept++] = p;
	}
	adoption->n_pending = kept;
	/* Once no file waits, every block a session names has been claimed:
	 * the rest was written by mutations that never committed. */
	if (kept == 0)
		pool_set_sweep(&server->pools);
	return kept;
}

bool adopt_blocks_open(struct server *server, uint32_t uid, const char *name)
{
	struct adoption *adoption = &server->adoption;
	if (adoption->n_pending == 0 || adopt_retry(server) == 0)
		return false;
	for (size_t i = 0; i < adoption->n_pending; i++) {
		const struct adopt_pending *p = &adoption->pending[i];
		if (!p->known || (p->uid == uid && strcmp(p->name, name) == 0))
			return true;
	}
	return false;
}

void adopt_free(struct adoption *adoption)
{
	free(adoption->set_aside);
	free(adoption->pending);
	*adoption = (struct adoption){ 0 };
}
