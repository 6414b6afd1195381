/*
 * Adoption: the session files an earlier daemon left in --shm-dir become
 * sessions again. A file that fails a real consistency check is set aside
 * (renamed NAME.corrupt, never deleted) with its reason; a file that
 * could not be read for a passing reason (EMFILE, ENOMEM, ...) stays where
 * it is and is tried again later; a file of another uid stays and is
 * listed. Nothing healthy is ever thrown away.
 */
#ifndef ZIPCACHE_ADOPT_H
#define ZIPCACHE_ADOPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct server;

struct adopt_entry {
	char file[80];
	char reason[200];
};

/* A file to try again, and whose session it holds when its header could
 * be read (known): opens of other names need not wait for it. */
struct adopt_pending {
	char file[80];
	bool known;
	uint32_t uid;
	char name[65];
};

struct adoption {
	struct adopt_entry *set_aside;   /* files the daemon will not adopt */
	size_t n_set_aside;
	struct adopt_pending *pending;
	size_t n_pending;
};

/* At start: adopts (or, with --no-adopt, removes) every session file. */
void adopt_scan(struct server *server);

/* Tries the pending files again (from a timer); the number still pending. */
size_t adopt_retry(struct server *server);

/* Whether a new session (uid, name) must wait: a pending file may hold a
 * session of that name (or one whose name could not be read). Retries
 * the pending files first. */
bool adopt_blocks_open(struct server *server, uint32_t uid, const char *name);

void adopt_free(struct adoption *adoption);

#endif
