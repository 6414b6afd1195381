/*
 * Helpers around the programs the suites run (tests/process_run.h), once
 * instead of a copy per suite.
 */
#include "process_run.h"

#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef ZC_BUILD_DIR
#define ZC_BUILD_DIR "build"
#endif

int64_t now_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

void sleep_ms(int ms)
{
	struct timespec pause_for = { ms / 1000, (long)(ms % 1000) * 1000000L };
	while (nanosleep(&pause_for, &pause_for) < 0 && errno == EINTR)
		;
}

const char *build_dir(void)
{
	const char *build = getenv("ZC_BUILD_DIR");

	return build && *build ? build : ZC_BUILD_DIR;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
	(void)st;
	(void)type;
	(void)ftw;
	remove(path);
	return 0;
}

void directory_remove(const char *dir)
{
	if (dir[0])
		nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

char *file_read_whole(const char *path, size_t *size)
{
	FILE *file = fopen(path, "rb");
	char *bytes = NULL;
	size_t used = 0, capacity = 0;

	ck_assert_msg(file != NULL, "fopen %s: %s", path, strerror(errno));
	for (;;) {
		size_t got;

		if (capacity - used < 4096) {
			char *grown;

			capacity = capacity * 2 + 4096;
			grown = realloc(bytes, capacity + 1);
			ck_assert_ptr_nonnull(grown);
			bytes = grown;
		}
		got = fread(bytes + used, 1, capacity - used, file);
		used += got;
		if (got == 0)
			break;
	}
	ck_assert_int_eq(ferror(file), 0);
	fclose(file);
	bytes[used] = '\0';
	if (size)
		*size = used;
	return bytes;
}

pid_t fork_dying_with_parent(int orphan_status)
{
	pid_t parent = getpid();
	pid_t pid;

	/* Flushed first, or the child would write the parent's buffers again. */
	fflush(NULL);
	pid = fork();
	ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		/* The parent may have died before prctl: then no signal comes. */
		if (getppid() != parent)
			_exit(orphan_status);
	}
	return pid;
}

pid_t program_spawn(const char *const *argv, const char *out_path, const char *err_path,
		    const char *env_name, const char *env_value)
{
	pid_t pid = fork_dying_with_parent(127);

	if (pid == 0) {
		bool shared = strcmp(out_path, err_path) == 0;
		int in, out, err;

		in = open("/dev/null", O_RDONLY);
		out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		/* One descriptor for both when they share a file: two would
		 * each write from offset 0 over the other. */
		err = shared ? out : open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		if (in < 0 || out < 0 || err < 0 || dup2(in, STDIN_FILENO) < 0 ||
		    dup2(out, STDOUT_FILENO) < 0 || dup2(err, STDERR_FILENO) < 0)
			_exit(126);
		if (env_name && env_value)
			setenv(env_name, env_value, 1);
		else if (env_name)
			unsetenv(env_name);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	return pid;
}

void program_capture(struct program_output *result, const char *const *argv,
		     const char *out_path, const char *err_path, const char *env_name,
		     const char *env_value)
{
	pid_t child = program_spawn(argv, out_path, err_path, env_name, env_value);
	int status;

	ck_assert_int_eq(waitpid(child, &status, 0), child);
	result->status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	result->out = file_read_whole(out_path, &result->out_length);
	result->err = file_read_whole(err_path, &result->err_length);
	ck_assert_msg(result->status != 126 && result->status != 127,
		      "could not run %s (status %d)", argv[0], result->status);
}

void program_output_free(struct program_output *result)
{
	free(result->out);
	free(result->err);
	memset(result, 0, sizeof(*result));
}

pid_t child_spawn(child_body body, void *arg, int close_in_child)
{
	pid_t pid = fork_dying_with_parent(126);

	if (pid == 0) {
		if (close_in_child >= 0)
			close(close_in_child);
		/* _exit: the test process's atexit hooks are not ours to run. */
		_exit(body(arg));
	}
	return pid;
}

void child_wait_ok(pid_t pid, const char *what)
{
	int status = 0;

	ck_assert_msg(waitpid(pid, &status, 0) == pid, "waitpid: %s", strerror(errno));
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "%s: helper process %s %d (its stderr says why)", what,
		      WIFEXITED(status) ? "exited with status" : "was killed by signal",
		      WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}

/* ---- sockets -------------------------------------------------------------- */

bool socket_accepts(const char *path)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool ok;

	if (fd < 0)
		return false;
	snprintf(address.sun_path, sizeof(address.sun_path), "%s", path);
	ok = connect(fd, (const struct sockaddr *)&address, sizeof(address)) == 0;
	close(fd);
	return ok;
}


uint16_t free_tcp_port(void)
{
	struct sockaddr_in address = { .sin_family = AF_INET };
	socklen_t length = sizeof(address);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ck_assert_msg(fd >= 0, "socket: %s", strerror(errno));
	address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_msg(bind(fd, (struct sockaddr *)&address, sizeof(address)) == 0, "bind: %s",
		      strerror(errno));
	ck_assert_msg(getsockname(fd, (struct sockaddr *)&address, &length) == 0, "getsockname: %s",
		      strerror(errno));
	close(fd);
	return ntohs(address.sin_port);
}

/* GET /metrics from 127.0.0.1:port: the body, malloc'd. */
char *metrics_scrape(uint16_t port)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(port),
				       .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	ck_assert_int_eq(connect(fd, (struct sockaddr *)&address, sizeof(address)), 0);
	static const char request[] = "GET /metrics HTTP/1.0\r\n\r\n";
	ck_assert_int_eq(write(fd, request, sizeof(request) - 1), (ssize_t)sizeof(request) - 1);
	size_t capacity = 1 << 20, used = 0;
	char *text = malloc(capacity);
	ssize_t n;
	while ((n = read(fd, text + used, capacity - 1 - used)) > 0)
		used += (size_t)n;
	text[used] = '\0';
	close(fd);
	return text;
}

/* A sample's value in /metrics ("name{labels}" exactly), -1 when absent. */
long long metric_value(uint16_t port, const char *sample)
{
	char *text = metrics_scrape(port), needle[256];
	snprintf(needle, sizeof(needle), "\n%s ", sample);
	char *at = strstr(text, needle);
	long long v = at ? strtoll(at + strlen(needle), NULL, 10) : -1;
	free(text);
	return v;
}

int process_tcp_sockets(pid_t pid)
{
	char path[64], link[128];
	unsigned long inodes[1024];
	int n_inodes = 0, found = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	DIR *dir = opendir(path);
	ck_assert_msg(dir != NULL, "opendir %s: %s", path, strerror(errno));
	struct dirent *entry;
	while ((entry = readdir(dir)) != NULL && n_inodes < 1024) {
		char fd_path[320];
		snprintf(fd_path, sizeof(fd_path), "%s/%s", path, entry->d_name);
		ssize_t n = readlink(fd_path, link, sizeof(link) - 1);
		if (n <= 0)
			continue;
		link[n] = '\0';
		if (sscanf(link, "socket:[%lu]", &inodes[n_inodes]) == 1)
			n_inodes++;
	}
	closedir(dir);
	static const char *const tables[] = { "/proc/net/tcp", "/proc/net/tcp6" };
	for (int t = 0; t < 2; t++) {
		FILE *file = fopen(tables[t], "r");
		char line[512];
		if (!file)
			continue;
		while (fgets(line, sizeof(line), file)) {
			unsigned long inode;
			/* sl local rem st tx:rx tr:when retrnsmt uid timeout inode */
			if (sscanf(line, "%*s %*s %*s %*s %*s %*s %*s %*s %*s %lu", &inode) != 1)
				continue;
			for (int i = 0; i < n_inodes; i++)
				if (inodes[i] == inode && inode != 0)
					found++;
		}
		fclose(file);
	}
	return found;
}

/* ---- other users ------------------------------------------------------------- */

bool user_become(uid_t uid, gid_t gid, char *why, size_t size)
{
	if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0) {
		snprintf(why, size, "cannot drop privileges: %s", strerror(errno));
		return false;
	}
	if (getuid() != uid || geteuid() != uid || getgid() != gid || getegid() != gid) {
		snprintf(why, size, "still uid %u/%u gid %u/%u after dropping privileges",
			 (unsigned)getuid(), (unsigned)geteuid(), (unsigned)getgid(),
			 (unsigned)getegid());
		return false;
	}
	if (getgroups(0, NULL) != 0) {
		snprintf(why, size, "supplementary groups left after setgroups(0, NULL)");
		return false;
	}
	if (setuid(0) == 0) {
		snprintf(why, size, "could become root again");
		return false;
	}
	return true;
}

bool other_users_possible(const char *dir)
{
	char path[PATH_MAX];
	struct stat st;

	if (geteuid() != 0) {
		fprintf(stderr, "not root, so the tests cannot become another user; they pass "
				"without checking anything\n");
		return false;
	}
	snprintf(path, sizeof(path), "%s", dir);
	for (char *slash = strrchr(path, '/'); slash && slash != path; slash = strrchr(path, '/')) {
		*slash = '\0';
		if (stat(path, &st) == 0 && !(st.st_mode & S_IXOTH)) {
			fprintf(stderr, "%s is not traversable by other users (mode %o), so the tests "
					"of other users check nothing; set TMPDIR to a "
					"world-traversable directory\n", path, st.st_mode & 07777);
			return false;
		}
	}
	return true;
}
