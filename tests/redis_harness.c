/* Real Redis servers for the tests (tests/redis_harness.h). */
#include "redis_harness.h"

#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "process_run.h"

/* A program on PATH, by its full name ("" when there is none). */
static bool program_find(const char *name, char *path, size_t size)
{
	const char *search = getenv("PATH");
	char copy[4096];
	snprintf(copy, sizeof(copy), "%s", search && *search ? search : "/usr/local/bin:/usr/bin:/bin");
	for (char *save = NULL, *dir = strtok_r(copy, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
		snprintf(path, size, "%s/%s", dir, name);
		if (access(path, X_OK) == 0)
			return true;
	}
	path[0] = '\0';
	return false;
}

bool redis_installed(void)
{
	char path[4096];
	if (program_find("redis-server", path, sizeof(path)) && program_find("redis-cli", path, sizeof(path)))
		return true;
	printf("skipped: redis-server or redis-cli is not installed (make deps installs redis-server and redis-tools)\n");
	return false;
}

redisContext *redis_connect(const struct redis_server *server)
{
	struct timeval tv = { .tv_sec = 2 };
	redisContext *c = redisConnectWithTimeout("127.0.0.1", server->port, tv);
	if (!c || c->err) {
		if (c)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, (struct timeval){ .tv_sec = 10 });
	if (server->user[0]) {
		redisReply *reply = redisCommand(c, "AUTH %s %s", server->user, server->password);
		bool ok = reply && reply->type == REDIS_REPLY_STATUS;
		if (reply)
			freeReplyObject(reply);
		if (!ok) {
			redisFree(c);
			return NULL;
		}
	}
	return c;
}

redisReply *redis_command(const struct redis_server *server, const char *format, ...)
{
	redisContext *c = redis_connect(server);
	ck_assert_msg(c != NULL, "cannot connect to redis on port %u", server->port);
	va_list args;
	va_start(args, format);
	redisReply *reply = redisvCommand(c, format, args);
	va_end(args);
	ck_assert_msg(reply != NULL, "redis on port %u: %s", server->port, c->errstr);
	redisFree(c);
	return reply;
}

/* Whether the server answers PING with PONG right now. */
static bool server_pings(const struct redis_server *server)
{
	redisContext *c = redis_connect(server);
	if (!c)
		return false;
	redisReply *reply = redisCommand(c, "PING");
	bool ok = reply && reply->type == REDIS_REPLY_STATUS && strcmp(reply->str, "PONG") == 0;
	if (reply)
		freeReplyObject(reply);
	redisFree(c);
	return ok;
}

/* Execs redis-server for server (its port, directory and options). */
static pid_t server_spawn(const struct redis_server *server)
{
	char program[4096], port[8], bus[8], conf[128], log[128], acl[160];
	const char *argv[48];
	int n = 0;
	ck_assert(program_find("redis-server", program, sizeof(program)));
	snprintf(port, sizeof(port), "%u", server->port);
	snprintf(log, sizeof(log), "%s/redis.log", server->dir);
	argv[n++] = program;
	argv[n++] = "--port";
	argv[n++] = port;
	argv[n++] = "--bind";
	argv[n++] = "127.0.0.1";
	argv[n++] = "--save";
	argv[n++] = "";
	argv[n++] = "--appendonly";
	argv[n++] = "no";
	argv[n++] = "--daemonize";
	argv[n++] = "no";
	argv[n++] = "--dir";
	argv[n++] = server->dir;
	argv[n++] = "--unixsocket";
	argv[n++] = server->socket_path;
	argv[n++] = "--unixsocketperm";
	argv[n++] = "700";
	if (server->debug) {
		argv[n++] = "--enable-debug-command";
		argv[n++] = "yes";
	}
	if (server->cluster) {
		snprintf(bus, sizeof(bus), "%u", server->bus_port);
		snprintf(conf, sizeof(conf), "%s/nodes.conf", server->dir);
		argv[n++] = "--cluster-enabled";
		argv[n++] = "yes";
		argv[n++] = "--cluster-config-file";
		argv[n++] = conf;
		/* Ephemeral ports + 10000 may pass 65535: name the bus port. */
		argv[n++] = "--cluster-port";
		argv[n++] = bus;
		/* A killed node is seen as failed in a second, not fifteen. */
		argv[n++] = "--cluster-node-timeout";
		argv[n++] = "1000";
	}
	if (server->user[0]) {
		snprintf(acl, sizeof(acl), ">%s", server->password);
		argv[n++] = "--user";
		argv[n++] = server->user;
		argv[n++] = "on";
		argv[n++] = acl;
		argv[n++] = "~*";
		argv[n++] = "&*";
		argv[n++] = "+@all";
		argv[n++] = "--user";
		argv[n++] = "default";
		argv[n++] = "off";
	}
	argv[n] = NULL;
	return program_spawn(argv, log, log, NULL, NULL);
}

/* Starts the process and waits for PING; false if it exited (a port
 * someone took in between) or never answered. */
static bool server_launch(struct redis_server *server)
{
	server->pid = server_spawn(server);
	int64_t deadline = now_ms() + REDIS_HARNESS_WAIT_MS;
	while (now_ms() < deadline) {
		int status;
		if (waitpid(server->pid, &status, WNOHANG) == server->pid) {
			server->pid = 0;
			return false;
		}
		if (server_pings(server))
			return true;
		sleep_ms(20);
	}
	redis_server_kill(server);
	return false;
}

static void server_start(struct redis_server *server, bool cluster, const char *user,
			 const char *password)
{
	memset(server, 0, sizeof(*server));
	snprintf(server->dir, sizeof(server->dir), "/tmp/zc-redis-XXXXXX");
	ck_assert_msg(mkdtemp(server->dir) != NULL, "mkdtemp: %s", strerror(errno));
	snprintf(server->socket_path, sizeof(server->socket_path), "%s/redis.sock", server->dir);
	server->cluster = cluster;
	server->debug = true;
	if (user) {
		snprintf(server->user, sizeof(server->user), "%s", user);
		snprintf(server->password, sizeof(server->password), "%s", password);
	}
	/* A port free when probed may be taken before redis binds it. */
	for (int attempt = 0; attempt < 5; attempt++) {
		server->port = free_tcp_port();
		server->bus_port = free_tcp_port();
		if (server->bus_port == server->port)
			continue;
		if (server_launch(server))
			return;
	}
	char log[128];
	snprintf(log, sizeof(log), "%s/redis.log", server->dir);
	char *text = access(log, R_OK) == 0 ? file_read_whole(log, NULL) : NULL;
	ck_abort_msg("redis-server did not start: %s", text ? text : "(no log)");
}

void redis_server_start(struct redis_server *server, const char *user, const char *password)
{
	server_start(server, false, user, password);
}

/* Whether pid has ended: reaped here, or (a server the suite's process
 * started, killed from a test's fork) a zombie or gone. */
static bool process_ended(pid_t pid)
{
	int status;
	pid_t r = waitpid(pid, &status, WNOHANG);
	if (r == pid)
		return true;
	if (r == 0)
		return false;
	char path[64], text[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *file = fopen(path, "re");
	if (!file)
		return true;
	size_t n = fread(text, 1, sizeof(text) - 1, file);
	fclose(file);
	text[n] = '\0';
	const char *close = strrchr(text, ')');
	return !close || close[1] == '\0' || close[2] == 'Z' || close[2] == 'X';
}

void redis_server_kill(struct redis_server *server)
{
	if (server->pid <= 0)
		return;
	int status;
	kill(server->pid, SIGCONT); /* a test may have stopped it */
	kill(server->pid, SIGTERM);
	int64_t deadline = now_ms() + 1000;
	while (now_ms() < deadline) {
		if (process_ended(server->pid)) {
			server->pid = 0;
			return;
		}
		sleep_ms(10);
	}
	kill(server->pid, SIGKILL);
	waitpid(server->pid, &status, 0);
	server->pid = 0;
}

void redis_server_restart(struct redis_server *server)
{
	ck_assert_msg(server->pid == 0, "restart of a running server");
	ck_assert_msg(server_launch(server), "redis-server did not restart on port %u", server->port);
}

void redis_server_stop(struct redis_server *server)
{
	redis_server_kill(server);
	directory_remove(server->dir);
	server->dir[0] = '\0';
}

/* Runs a program to its end within REDIS_HARNESS_WAIT_MS; its output in
 * out_path. Returns its exit status (killed: asserts). */
static int program_run_bounded(const char *const *argv, const char *out_path)
{
	pid_t pid = program_spawn(argv, out_path, out_path, NULL, NULL);
	int64_t deadline = now_ms() + REDIS_HARNESS_WAIT_MS;
	int status;
	while (waitpid(pid, &status, WNOHANG) != pid) {
		if (now_ms() > deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			ck_abort_msg("%s did not finish within %d ms", argv[0], REDIS_HARNESS_WAIT_MS);
		}
		sleep_ms(20);
	}
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static bool node_ok(const struct redis_server *node)
{
	redisContext *c = redis_connect(node);
	if (!c)
		return false;
	redisReply *reply = redisCommand(c, "CLUSTER INFO");
	bool ok = reply && reply->type == REDIS_REPLY_STRING && strstr(reply->str, "cluster_state:ok") &&
		  strstr(reply->str, "cluster_slots_assigned:16384") && strstr(reply->str, "cluster_known_nodes:3");
	if (reply)
		freeReplyObject(reply);
	redisFree(c);
	return ok;
}

void redis_cluster_wait_ok(struct redis_cluster *cluster)
{
	int64_t deadline = now_ms() + REDIS_HARNESS_WAIT_MS;
	for (;;) {
		bool all = true;
		for (int i = 0; i < REDIS_CLUSTER_NODES && all; i++)
			all = node_ok(&cluster->nodes[i]);
		if (all)
			return;
		ck_assert_msg(now_ms() < deadline, "the cluster did not reach cluster_state:ok in %d ms",
			      REDIS_HARNESS_WAIT_MS);
		sleep_ms(50);
	}
}

void redis_cluster_start(struct redis_cluster *cluster)
{
	char cli[4096], addresses[REDIS_CLUSTER_NODES][32], out[128];
	const char *argv[16];
	int n = 0;
	memset(cluster, 0, sizeof(*cluster));
	ck_assert(program_find("redis-cli", cli, sizeof(cli)));
	argv[n++] = cli;
	argv[n++] = "--cluster";
	argv[n++] = "create";
	for (int i = 0; i < REDIS_CLUSTER_NODES; i++) {
		server_start(&cluster->nodes[i], true, NULL, NULL);
		snprintf(addresses[i], sizeof(addresses[i]), "127.0.0.1:%u", cluster->nodes[i].port);
		argv[n++] = addresses[i];
	}
	argv[n++] = "--cluster-replicas";
	argv[n++] = "0";
	argv[n++] = "--cluster-yes";
	argv[n] = NULL;
	snprintf(out, sizeof(out), "%s/cluster-create.out", cluster->nodes[0].dir);
	int status = program_run_bounded(argv, out);
	if (status != 0) {
		char *text = file_read_whole(out, NULL);
		ck_abort_msg("redis-cli --cluster create exited %d: %s", status, text);
	}
	redis_cluster_wait_ok(cluster);
	for (int i = 0; i < REDIS_CLUSTER_NODES; i++) {
		redisReply *reply = redis_command(&cluster->nodes[i], "CLUSTER MYID");
		ck_assert_int_eq(reply->type, REDIS_REPLY_STRING);
		snprintf(cluster->ids[i], sizeof(cluster->ids[i]), "%s", reply->str);
		freeReplyObject(reply);
	}
}

void redis_cluster_stop(struct redis_cluster *cluster)
{
	for (int i = 0; i < REDIS_CLUSTER_NODES; i++)
		redis_server_stop(&cluster->nodes[i]);
}

int redis_cluster_slot_owner(struct redis_cluster *cluster, unsigned slot)
{
	redisReply *reply = redis_command(&cluster->nodes[0], "CLUSTER SLOTS");
	int owner = -1;
	ck_assert_int_eq(reply->type, REDIS_REPLY_ARRAY);
	for (size_t i = 0; i < reply->elements; i++) {
		redisReply *range = reply->element[i];
		if ((unsigned long long)range->element[0]->integer <= slot &&
		    slot <= (unsigned long long)range->element[1]->integer) {
			long long port = range->element[2]->element[1]->integer;
			for (int k = 0; k < REDIS_CLUSTER_NODES; k++)
				if (cluster->nodes[k].port == port)
					owner = k;
		}
	}
	freeReplyObject(reply);
	return owner;
}
