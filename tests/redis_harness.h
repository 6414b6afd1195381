/*
 * Real Redis servers for the tests: redis-server processes on 127.0.0.1,
 * each on a free port with its own temporary directory, no persistence,
 * started by fork/exec (dying with the process that started them), ready
 * once PING answers, stopped by pid (SIGTERM, then SIGKILL), their
 * directories removed. A standalone server, optionally with an ACL user
 * and the default user off, and a three-primary cluster made by
 * `redis-cli --cluster create`. Every wait is bounded.
 *
 * All of it asserts with Check: the test process only (or an unchecked
 * fixture, which runs in the suite's own process).
 */
#ifndef ZIPCACHE_TESTS_REDIS_HARNESS_H
#define ZIPCACHE_TESTS_REDIS_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>

/* Each wait for a server (readiness, the cluster's state) ends by then. */
#define REDIS_HARNESS_WAIT_MS 15000

struct redis_server {
	pid_t pid;            /* 0 when not running */
	uint16_t port;
	uint16_t bus_port;    /* cluster nodes: --cluster-port */
	bool cluster;
	char dir[64];         /* its temporary directory ("" once removed) */
	char socket_path[96]; /* DIR/redis.sock: it listens there too (--unixsocket) */
	char user[32];        /* ACL user and password ("" for none) */
	char password[64];
	bool debug;           /* --enable-debug-command yes */
};

#define REDIS_CLUSTER_NODES 3

struct redis_cluster {
	struct redis_server nodes[REDIS_CLUSTER_NODES];
	char ids[REDIS_CLUSTER_NODES][41];
};

/* Whether redis-server and redis-cli are installed; when not, says so in
 * one line on stdout (the suite then skips). */
bool redis_installed(void);

/* A standalone server. user/password: an ACL user with every right and
 * the default user off (NULL, NULL: no ACL). */
void redis_server_start(struct redis_server *server, const char *user, const char *password);

/* SIGTERM, then SIGKILL after a second; the directory stays (restart). */
void redis_server_kill(struct redis_server *server);

/* Starts the server again on its port and directory (a cluster node
 * finds its nodes.conf there and rejoins). */
void redis_server_restart(struct redis_server *server);

/* Kills it and removes its directory. */
void redis_server_stop(struct redis_server *server);

/* Three primaries, all 16384 slots assigned, cluster_state:ok everywhere. */
void redis_cluster_start(struct redis_cluster *cluster);
void redis_cluster_stop(struct redis_cluster *cluster);

/* Waits until every node says cluster_state:ok. */
void redis_cluster_wait_ok(struct redis_cluster *cluster);

/* A command on the server's port, authenticated as its ACL user if it has
 * one; the reply (caller frees), asserted not NULL. */
redisReply *redis_command(const struct redis_server *server, const char *format, ...);

/* A connection to the server as its ACL user (caller redisFree's). */
redisContext *redis_connect(const struct redis_server *server);

/* The node (index) that serves slot, by CLUSTER SLOTS on node 0. */
int redis_cluster_slot_owner(struct redis_cluster *cluster, unsigned slot);

#endif
