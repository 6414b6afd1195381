/* Scratch directories on tmpfs (tests/shm_dir.h). */
#include "shm_dir.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void shm_dir_make(struct shm_dir *dir, const char *tag)
{
	struct stat st;
	const char *base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" :
										getenv("TMPDIR");
	if (!base || !*base)
		base = "/tmp";
	snprintf(dir->path, sizeof(dir->path), "%s/zc_%s.XXXXXX", base, tag);
	ck_assert_msg(mkdtemp(dir->path) != NULL, "mkdtemp %s: %s", dir->path, strerror(errno));
	dir->fd = open(dir->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	ck_assert_msg(dir->fd >= 0, "open %s: %s", dir->path, strerror(errno));
}

void shm_dir_remove(struct shm_dir *dir)
{
	int fd = dup(dir->fd);
	DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
	if (d) {
		struct dirent *entry;
		/* The dup shares the descriptor's offset: whoever listed the
		 * directory through it last left it at the end. */
		rewinddir(d);
		while ((entry = readdir(d)) != NULL)
			if (strcmp(entry->d_name, ".") != 0 && strcmp(entry->d_name, "..") != 0)
				unlinkat(dir->fd, entry->d_name, 0);
		closedir(d);
	} else if (fd >= 0) {
		close(fd);
	}
	close(dir->fd);
	dir->fd = -1;
	rmdir(dir->path);
}

uint64_t shm_dir_file_bytes(const struct shm_dir *dir, const char *name)
{
	struct stat st;
	return fstatat(dir->fd, name, &st, 0) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

int shm_dir_has(const struct shm_dir *dir, const char *name)
{
	struct stat st;
	return fstatat(dir->fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}
