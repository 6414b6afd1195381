/* A redis-server to compare with: see redis_peer.h. */
#include "redis_peer.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_daemon.h"

/* How long redis-server may take to create its socket. */
#define START_MS 5000

static pid_t peer_pid = -1;

static const char *redis_binary(void)
{
	static const char *const paths[] = { "/usr/bin/redis-server", "/usr/local/bin/redis-server" };
	for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
		if (access(paths[i], X_OK) == 0)
			return paths[i];
	return NULL;
}

int redis_peer_start(const char *dir, int cpu, int *fd)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	const char *binary = redis_binary();
	char path[sizeof(address.sun_path)];

	if (!binary)
		return -ENOENT;
	if ((size_t)snprintf(path, sizeof path, "%s/redis.sock", dir) >= sizeof path)
		return -ENAMETOOLONG;
	pid_t pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		if (cpu >= 0)
			bench_pin(0, cpu);
		int null = open("/dev/null", O_WRONLY);
		if (null >= 0) {
			dup2(null, STDOUT_FILENO);
			dup2(null, STDERR_FILENO);
		}
		execl(binary, "redis-server", "--port", "0", "--unixsocket", path, "--unixsocketperm",
		      "700", "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", dir,
		      (char *)NULL);
		_exit(127);
	}
	peer_pid = pid;
	memcpy(address.sun_path, path, strlen(path) + 1);
	for (int waited = 0; waited < START_MS; waited += 10) {
		int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (s < 0)
			break;
		if (connect(s, (struct sockaddr *)&address, sizeof address) == 0) {
			*fd = s;
			return 0;
		}
		close(s);
		if (waitpid(pid, NULL, WNOHANG) == pid) {
			peer_pid = -1;
			return -ECHILD;
		}
		nanosleep(&(struct timespec){ 0, 10 * 1000 * 1000 }, NULL);
	}
	redis_peer_stop();
	return -ETIMEDOUT;
}

void redis_peer_stop(void)
{
	if (peer_pid <= 0)
		return;
	kill(peer_pid, SIGTERM);
	waitpid(peer_pid, NULL, 0);
	peer_pid = -1;
}

size_t redis_set_command(uint8_t *out, size_t cap, size_t value_bytes)
{
	int head = snprintf((char *)out, cap, "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%zu\r\n", value_bytes);
	if (head < 0 || (size_t)head + value_bytes + 2 > cap)
		return 0;
	for (size_t i = 0; i < value_bytes; i++)
		out[head + i] = (uint8_t)('a' + i % 26);
	memcpy(out + head + value_bytes, "\r\n", 2);
	return (size_t)head + value_bytes + 2;
}

int redis_round_trip(int fd, const uint8_t *command, size_t len)
{
	char reply[16];
	size_t got = 0;
	while (len > 0) {
		ssize_t n = send(fd, command, len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -errno;
		command += n;
		len -= (size_t)n;
	}
	while (got < 5) {
		ssize_t n = recv(fd, reply + got, sizeof reply - got, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n == 0 ? -ECONNRESET : -errno;
		got += (size_t)n;
	}
	return memcmp(reply, "+OK\r\n", 5) == 0 ? 0 : -EPROTO;
}
