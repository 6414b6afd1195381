/*
 * A small Redis router over Debian's hiredis (0.14: no cluster support of
 * its own). It sends batches of commands, each naming one key, to the
 * node that serves the key: one node for a standalone server, the slot's
 * primary for a Redis Cluster, following the slot map (`CLUSTER SLOTS`)
 * and the MOVED and ASK redirections. It knows nothing of zipcache's keys
 * or values; server/remote.c is its only user.
 *
 * Standalone or cluster is found out on first use: a server that answers
 * `CLUSTER SLOTS` with "cluster support disabled" is standalone.
 *
 * Every node has one hiredis connection, made on first use (with AUTH when
 * credentials are set), dropped after any I/O error, timeout or protocol
 * error (hiredis's rule: a context that failed is dead), and made again on
 * the next use. Every wait on a socket is bounded by the timeout; a batch
 * is bounded by ROUTER_MAX_TRIES rounds of it.
 *
 * Not thread-safe: one caller at a time (server/remote.c holds a mutex).
 */
#ifndef ZIPCACHE_REDIS_ROUTER_H
#define ZIPCACHE_REDIS_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

/* Redis Cluster's slot count (the spec: CRC16 of the key modulo 16384). */
#define ROUTER_SLOTS 16384
/* Tries of one command: the first, then redirections (MOVED, ASK) and
 * TRYAGAIN/CLUSTERDOWN waits. A slot moves once per migration; five
 * covers a migration racing a failover, and a loop ends. */
#define ROUTER_MAX_TRIES 6
/* Elements of one array in a reply: CLUSTER SLOTS of the largest
 * cluster has at most one range per slot; our commands need no more. */
#define ROUTER_MAX_ELEMENTS 65536
/* Longest host name (DNS's 253, and room for an IPv6 literal). */
#define ROUTER_HOST_MAX 256

/* A TCP address, or (port 0) the path of a Unix socket in host. */
struct router_endpoint {
	char host[ROUTER_HOST_MAX];
	uint16_t port;
};

/* What the reply being read has allocated, against what one may. */
struct router_budget {
	size_t max, used;
};

struct router_node {
	struct router_endpoint at;
	char name[ROUTER_HOST_MAX + 8]; /* how messages name it */
	redisContext *context; /* NULL until first use and after a failure */
	struct router_budget budget;
};

struct router {
	const struct router_endpoint *seeds;
	size_t n_seeds;
	const char *user;         /* ACL user, or NULL for the default user */
	const char *password;     /* NULL: no AUTH */
	uint32_t timeout_ms;
	size_t reply_max;         /* bytes of one reply buffered (or built) before giving up */
	bool discovered;          /* standalone or cluster is known */
	bool cluster;
	bool refresh;             /* a MOVED or a lost node: read the slot map again */
	struct router_node *nodes;
	size_t n_nodes, nodes_capacity;
	uint16_t *slot_node;      /* [ROUTER_SLOTS]: index into nodes, or UINT16_MAX */
	char *read_buffer;
	/* Bytes written to and read from Redis (atomic: metrics read them
	 * from another thread). */
	uint64_t bytes_sent, bytes_received;
	uint64_t redirections;    /* MOVED and ASK followed */
	char why[512];            /* the last failure, for logs and callers */
};

/* One command of a batch. argv[1] is its key (the slot's). */
struct router_command {
	int argc;
	const char *argv[6];
	size_t argvlen[6];
	/* Filled by router_run: the final answer (an error reply that is no
	 * redirection is an answer, too) or NULL with status < 0. */
	redisReply *reply;
	int status;
	/* The router's own. */
	uint16_t slot;
	uint16_t node;
	uint8_t tries;
	bool asking;
	bool done;
};

/* CRC16 (XMODEM, as Redis Cluster uses it) of bytes. */
uint16_t router_crc16(const void *bytes, size_t len);

/* The cluster slot of a key: the CRC16 of its hash tag (the bytes between
 * the first `{` and the next `}`, if not empty) or of the whole key. */
uint16_t router_key_slot(const void *key, size_t len);

/* Copies nothing: seeds, user and password must outlive the router. A
 * reply that grows past reply_max bytes fails (ZC_EREMOTE) as it arrives,
 * before the router holds it whole. */
int router_init(struct router *router, const struct router_endpoint *seeds, size_t n_seeds,
		const char *user, const char *password, uint32_t timeout_ms, size_t reply_max);
void router_free(struct router *router);

/*
 * Runs every command and fills its reply and status. Returns 0 when every
 * command got an answer (each reply still to be checked by the caller),
 * else the first failure: -ETIMEDOUT (no answer within the timeout),
 * ZC_EDENIED (AUTH refused), ZC_EREMOTE (unreachable, protocol error,
 * redirections exhausted, cluster down); router->why says what and where.
 * Commands are grouped by node and pipelined, the nodes' exchanges run
 * together (one poll() over their sockets).
 */
int router_run(struct router *router, struct router_command *commands, size_t count);

/* Frees the replies router_run left. */
void router_commands_clear(struct router_command *commands, size_t count);

/* Drops every connection (the next use connects again). */
void router_disconnect(struct router *router);

#endif
