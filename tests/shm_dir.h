/*
 * A private scratch directory on tmpfs for the suites that drive server
 * rooms directly (pool, store): no daemon, no socket. tmpfs is what the
 * daemon runs on, and what gives hole punching and SEEK_DATA the meaning
 * the pool and the store rely on.
 */
#ifndef ZIPCACHE_TESTS_SHM_DIR_H
#define ZIPCACHE_TESTS_SHM_DIR_H

#include <stdint.h>

struct shm_dir {
	char path[256];
	int fd;                   /* O_DIRECTORY, as the daemon's shm-dir */
};

/* Makes a fresh 0700 directory under /dev/shm (else $TMPDIR, else /tmp);
 * asserts on failure. */
void shm_dir_make(struct shm_dir *dir, const char *tag);

/* Removes every file in it and the directory itself. */
void shm_dir_remove(struct shm_dir *dir);

/* Bytes a file of the directory really holds (st_blocks), 0 when absent. */
uint64_t shm_dir_file_bytes(const struct shm_dir *dir, const char *name);

/* Whether the directory holds a file of that name. */
int shm_dir_has(const struct shm_dir *dir, const char *name);

#endif
