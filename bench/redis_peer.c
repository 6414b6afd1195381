/* A redis-server to compare with: see redis_peer.h. */
#include "redis_peer.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
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

int redis_round_trip(int fd, const uint8_t *command, size_t len, unsigned spin_us)
{
	char reply[16];
	size_t got = 0;
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	double until = (double)now.tv_sec + now.tv_nsec * 1e-9 + spin_us * 1e-6;
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
		bool spin = false;
		if (spin_us) {
			clock_gettime(CLOCK_MONOTONIC, &now);
			spin = (double)now.tv_sec + now.tv_nsec * 1e-9 < until;
		}
		ssize_t n = recv(fd, reply + got, sizeof reply - got, spin ? MSG_DONTWAIT : 0);
		if (n < 0 && (errno == EINTR || (spin && errno == EAGAIN)))
			continue;
		if (n <= 0)
			return n == 0 ? -ECONNRESET : -errno;
		got += (size_t)n;
	}
	return memcmp(reply, "+OK\r\n", 5) == 0 ? 0 : -EPROTO;
}

uint16_t bench_free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0 ||
	    getsockname(fd, (struct sockaddr *)&a, &len) < 0) {
		if (fd >= 0)
			close(fd);
		return 0;
	}
	close(fd);
	return ntohs(a.sin_port);
}

static bool tcp_answers(uint16_t port)
{
	struct timeval timeout = { 5, 0 };
	redisContext *c = redisConnectWithTimeout("127.0.0.1", port, timeout);
	bool up = false;
	if (c && !c->err) {
		redisReply *r = redisCommand(c, "PING");
		up = r && r->type == REDIS_REPLY_STATUS;
		if (r)
			freeReplyObject(r);
	}
	if (c)
		redisFree(c);
	return up;
}

static void tcp_log_path(const struct redis_tcp *server, char *out, size_t size)
{
	snprintf(out, size, "%s/redis.log", server->dir);
}

int redis_tcp_start(const char *tag, struct redis_tcp *server)
{
	const char *binary = redis_binary();
	*server = (struct redis_tcp){ 0 };
	if (!binary)
		return -ENOENT;
	server->port = bench_free_port();
	if (!server->port)
		return -EADDRNOTAVAIL;
	snprintf(server->dir, sizeof(server->dir), "/tmp/zc-%s-redis.XXXXXX", tag);
	if (!mkdtemp(server->dir)) {
		server->dir[0] = '\0';
		return -errno;
	}
	char port[16], log[PATH_MAX];
	const char *dir = server->dir;
	snprintf(port, sizeof(port), "%u", server->port);
	tcp_log_path(server, log, sizeof(log));
	server->pid = fork();
	if (server->pid < 0) {
		int rc = -errno;
		redis_tcp_stop(server);
		return rc;
	}
	if (server->pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		execl(binary, "redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "",
		      "--appendonly", "no", "--dir", dir, "--logfile", log, "--daemonize", "no",
		      "--maxmemory", "0", (char *)NULL);
		_exit(127);
	}
	for (int i = 0; i < 500; i++) {
		if (tcp_answers(server->port))
			return 0;
		if (waitpid(server->pid, NULL, WNOHANG) == server->pid) {
			server->pid = 0;
			redis_tcp_stop(server);
			return -ENOENT;
		}
		usleep(10000);
	}
	redis_tcp_stop(server);
	return -ETIMEDOUT;
}

void redis_tcp_stop(struct redis_tcp *server)
{
	if (server->pid > 0) {
		kill(server->pid, SIGTERM);
		for (int i = 0; i < 200 && waitpid(server->pid, NULL, WNOHANG) == 0; i++)
			usleep(10000);
		kill(server->pid, SIGKILL);
		waitpid(server->pid, NULL, 0);
		server->pid = 0;
	}
	if (server->dir[0]) {
		char log[PATH_MAX];
		tcp_log_path(server, log, sizeof(log));
		unlink(log);
		rmdir(server->dir);
		server->dir[0] = '\0';
	}
}
