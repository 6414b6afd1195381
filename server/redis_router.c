/*
 * The Redis router (redis_router.h): nodes, the slot map, and batches of
 * commands pipelined to the nodes that serve their keys.
 *
 * hiredis is used for what it does well, the RESP encoder and the reader;
 * the waits are ours. A context is connected blocking (hiredis bounds the
 * connect by the timeout), then switched to non-blocking, so that every
 * write and read waits in poll() for at most what is left of the batch's
 * deadline: a server that stops answering (SIGSTOP, DEBUG SLEEP) costs the
 * timeout, not forever, and one that dribbles bytes cannot stretch it.
 */
#include "redis_router.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "zipcache/error.h"

/* One read() from a socket: large enough that a block of megabytes is a
 * few dozen reads, small enough to keep per router. */
#define ROUTER_READ_CHUNK (256u << 10)
/* Bytes of commands encoded ahead of the socket: enough to keep a
 * pipeline of small commands full, little beside a large value. */
#define ROUTER_WRITE_AHEAD (1u << 20)
/* First wait after TRYAGAIN or CLUSTERDOWN; doubled each time (a slot's
 * keys being migrated, a failover's election, take tens of ms). */
#define ROUTER_BACKOFF_MS 10
#define NO_NODE UINT16_MAX

static void why_set(struct router *r, const char *format, ...) __attribute__((format(printf, 2, 3)));

static void why_set(struct router *r, const char *format, ...)
{
	va_list args;
	va_start(args, format);
	vsnprintf(r->why, sizeof(r->why), format, args);
	va_end(args);
}

uint16_t router_crc16(const void *bytes, size_t len)
{
	const unsigned char *p = bytes;
	uint16_t crc = 0;
	for (size_t i = 0; i < len; i++) {
		crc ^= (uint16_t)(p[i] << 8);
		for (int bit = 0; bit < 8; bit++)
			crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
	}
	return crc;
}

uint16_t router_key_slot(const void *key, size_t len)
{
	const char *k = key;
	const char *open = memchr(k, '{', len);
	if (open) {
		size_t from = (size_t)(open - k) + 1;
		const char *close = memchr(k + from, '}', len - from);
		if (close && close > k + from)
			return router_crc16(k + from, (size_t)(close - (k + from))) & (ROUTER_SLOTS - 1);
	}
	return router_crc16(k, len) & (ROUTER_SLOTS - 1);
}

static int64_t clock_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void sleep_for_ms(unsigned ms)
{
	struct timespec t = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L };
	while (nanosleep(&t, &t) < 0 && errno == EINTR)
		;
}

int router_init(struct router *r, const struct router_endpoint *seeds, size_t n_seeds,
		const char *user, const char *password, uint32_t timeout_ms, size_t reply_max)
{
	memset(r, 0, sizeof(*r));
	if (n_seeds == 0 || timeout_ms == 0 || reply_max == 0)
		return ZC_EINVALID;
	r->reply_max = reply_max;
	r->seeds = seeds;
	r->n_seeds = n_seeds;
	r->user = user;
	r->password = password;
	r->timeout_ms = timeout_ms;
	r->slot_node = malloc(ROUTER_SLOTS * sizeof(*r->slot_node));
	r->read_buffer = malloc(ROUTER_READ_CHUNK);
	if (!r->slot_node || !r->read_buffer) {
		router_free(r);
		return -ENOMEM;
	}
	for (size_t i = 0; i < ROUTER_SLOTS; i++)
		r->slot_node[i] = NO_NODE;
	return 0;
}

static void node_drop(struct router_node *node)
{
	if (node->context) {
		redisFree(node->context);
		node->context = NULL;
	}
}

void router_disconnect(struct router *r)
{
	for (size_t i = 0; i < r->n_nodes; i++)
		node_drop(&r->nodes[i]);
}

void router_free(struct router *r)
{
	router_disconnect(r);
	free(r->nodes);
	free(r->slot_node);
	free(r->read_buffer);
	memset(r, 0, sizeof(*r));
}

/* The node at host:port, added if new; NO_NODE when the table is full.
 * host may point into the table itself (a node's own host), which growing
 * the table moves: it is copied first. */
static uint16_t node_get(struct router *r, const char *host_in, size_t host_len, uint16_t port)
{
	char host[ROUTER_HOST_MAX];
	if (host_len >= ROUTER_HOST_MAX)
		return NO_NODE;
	memcpy(host, host_in, host_len);
	for (size_t i = 0; i < r->n_nodes; i++) {
		const struct router_endpoint *at = &r->nodes[i].at;
		if (at->port == port && strlen(at->host) == host_len && memcmp(at->host, host, host_len) == 0)
			return (uint16_t)i;
	}
	if (r->n_nodes >= NO_NODE)
		return NO_NODE;
	if (r->n_nodes == r->nodes_capacity) {
		size_t capacity = r->nodes_capacity ? r->nodes_capacity * 2 : 8;
		struct router_node *grown = realloc(r->nodes, capacity * sizeof(*grown));
		if (!grown)
			return NO_NODE;
		r->nodes = grown;
		r->nodes_capacity = capacity;
	}
	struct router_node *node = &r->nodes[r->n_nodes];
	memset(node, 0, sizeof(*node));
	memcpy(node->at.host, host, host_len);
	node->at.host[host_len] = '\0';
	node->at.port = port;
	return (uint16_t)r->n_nodes++;
}

/*
 * hiredis's reader builds replies through these (its own abort on a
 * failed allocation, and allocate what a header announces: `*2000000000`
 * from a broken server is 16 GB of pointers). Ours build the same
 * redisReply objects (freeReplyObject frees them), count what one reply
 * allocates against the router's reply_max, and refuse past it or past
 * ROUTER_MAX_ELEMENTS in one array; a refusal (NULL) is a reader error,
 * never an abort.
 */
static bool reply_charge(const redisReadTask *task, size_t bytes)
{
	struct router *r = task->privdata;
	if (bytes > r->reply_max || r->reply_bytes > r->reply_max - bytes)
		return false;
	r->reply_bytes += bytes;
	return true;
}

/* Puts reply in its parent array, if it has one. */
static void *reply_attach(const redisReadTask *task, redisReply *reply)
{
	if (task->parent) {
		redisReply *parent = task->parent->obj;
		/* NEVER: the reader gives a parent only to elements of an array. */
		if (parent->type != REDIS_REPLY_ARRAY || (size_t)task->idx >= parent->elements) {
			freeReplyObject(reply);
			return NULL;
		}
		parent->element[task->idx] = reply;
	}
	return reply;
}

static redisReply *reply_new(const redisReadTask *task, int type, size_t extra)
{
	if (!reply_charge(task, sizeof(redisReply) + extra))
		return NULL;
	redisReply *reply = calloc(1, sizeof(*reply));
	if (reply)
		reply->type = type;
	return reply;
}

static void *reply_string(const redisReadTask *task, char *text, size_t len)
{
	redisReply *reply = reply_new(task, task->type, len + 1);
	if (!reply)
		return NULL;
	reply->str = malloc(len + 1);
	if (!reply->str) {
		free(reply);
		return NULL;
	}
	memcpy(reply->str, text, len);
	reply->str[len] = '\0';
	reply->len = len;
	return reply_attach(task, reply);
}

static void *reply_array(const redisReadTask *task, int elements)
{
	if (elements > ROUTER_MAX_ELEMENTS)
		return NULL;
	size_t n = elements > 0 ? (size_t)elements : 0;
	redisReply *reply = reply_new(task, REDIS_REPLY_ARRAY, n * sizeof(redisReply *));
	if (!reply)
		return NULL;
	if (n) {
		reply->element = calloc(n, sizeof(redisReply *));
		if (!reply->element) {
			free(reply);
			return NULL;
		}
	}
	reply->elements = n;
	return reply_attach(task, reply);
}

static void *reply_integer(const redisReadTask *task, long long value)
{
	redisReply *reply = reply_new(task, REDIS_REPLY_INTEGER, 0);
	if (!reply)
		return NULL;
	reply->integer = value;
	return reply_attach(task, reply);
}

static void *reply_nil(const redisReadTask *task)
{
	redisReply *reply = reply_new(task, REDIS_REPLY_NIL, 0);
	return reply ? reply_attach(task, reply) : NULL;
}

static void reply_free(void *reply)
{
	freeReplyObject(reply);
}

static redisReplyObjectFunctions reply_functions = {
	.createString = reply_string,
	.createArray = reply_array,
	.createInteger = reply_integer,
	.createNil = reply_nil,
	.freeObject = reply_free,
};

/* One step of a pipelined exchange: a command to send and its reply. */
struct exchange_item {
	int argc;
	const char *const *argv;
	const size_t *argvlen;
	redisReply *reply;
};

static void items_clear(struct exchange_item *items, size_t count)
{
	for (size_t i = 0; i < count; i++) {
		if (items[i].reply)
			freeReplyObject(items[i].reply);
		items[i].reply = NULL;
	}
}

/*
 * Sends every item on the node's connection and reads every reply, by the
 * deadline; the node's connection is dropped on any failure (its stream
 * can no longer be trusted to line up).
 *
 * Commands are encoded into hiredis's output buffer a few at a time, up
 * to ROUTER_WRITE_AHEAD bytes (or one command larger than that), and the
 * buffer is written out from an offset of ours before more are encoded:
 * a batch of a whole session's blocks is never copied whole, and a large
 * value is not moved down the buffer after every partial write (what
 * redisBufferWrite does). Replies are taken out of the reader as soon as
 * they are whole, so what is buffered is at most one reply in progress: a
 * reply growing past reply_max fails before the router holds it.
 */
static int exchange(struct router *r, struct router_node *node, struct exchange_item *items,
		    size_t count, int64_t deadline)
{
	redisContext *c = node->context;
	size_t next = 0, encoded = 0, sent = 0;
	int rc = 0;

	r->reply_bytes = 0;

	while (next < count) {
		/* Refill the output buffer once it has all gone out. */
		if (sent == sdslen(c->obuf)) {
			sdsclear(c->obuf);
			sent = 0;
			while (encoded < count && sdslen(c->obuf) < ROUTER_WRITE_AHEAD) {
				const struct exchange_item *item = &items[encoded++];
				if (redisAppendCommandArgv(c, item->argc, (const char **)item->argv,
							   item->argvlen) != REDIS_OK) {
					why_set(r, "cannot encode a command for %s:%u: %s", node->at.host,
						node->at.port, c->errstr);
					rc = -ENOMEM;
					goto out_drop;
				}
			}
		}
		bool writing = sent < sdslen(c->obuf);
		int64_t left = deadline - clock_ms();
		if (left <= 0) {
			why_set(r, "%s:%u did not answer within %u ms", node->at.host, node->at.port,
				r->timeout_ms);
			rc = -ETIMEDOUT;
			goto out_drop;
		}
		struct pollfd p = { .fd = c->fd, .events = POLLIN | (writing ? POLLOUT : 0) };
		int ready = poll(&p, 1, (int)(left > 1000000 ? 1000000 : left));
		if (ready < 0 && errno == EINTR)
			continue;
		if (ready < 0) {
			why_set(r, "poll on %s:%u: %s", node->at.host, node->at.port, strerror(errno));
			rc = ZC_EREMOTE;
			goto out_drop;
		}
		if (ready == 0)
			continue;
		if (writing && (p.revents & (POLLOUT | POLLERR | POLLHUP))) {
			ssize_t n = send(c->fd, c->obuf + sent, sdslen(c->obuf) - sent, MSG_NOSIGNAL);
			if (n < 0 && errno != EAGAIN && errno != EINTR) {
				why_set(r, "write to %s:%u: %s", node->at.host, node->at.port, strerror(errno));
				rc = ZC_EREMOTE;
				goto out_drop;
			}
			if (n > 0) {
				sent += (size_t)n;
				__atomic_fetch_add(&r->bytes_sent, (uint64_t)n, __ATOMIC_RELAXED);
			}
		}
		if (!(p.revents & (POLLIN | POLLERR | POLLHUP)))
			continue;
		ssize_t n = read(c->fd, r->read_buffer, ROUTER_READ_CHUNK);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (n <= 0) {
			why_set(r, "%s:%u closed the connection%s%s", node->at.host, node->at.port,
				n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
			rc = ZC_EREMOTE;
			goto out_drop;
		}
		__atomic_fetch_add(&r->bytes_received, (uint64_t)n, __ATOMIC_RELAXED);
		redisReader *reader = c->reader;
		if (redisReaderFeed(reader, r->read_buffer, (size_t)n) != REDIS_OK)
			goto out_protocol;
		while (next < count) {
			void *reply = NULL;
			if (redisReaderGetReply(reader, &reply) != REDIS_OK)
				goto out_protocol;
			if (!reply)
				break;
			r->reply_bytes = 0;
			items[next++].reply = reply;
		}
		/* What is left is one reply in progress. */
		if (reader->len - reader->pos > r->reply_max) {
			why_set(r, "a reply from %s:%u is larger than %zu bytes", node->at.host,
				node->at.port, r->reply_max);
			rc = ZC_EREMOTE;
			goto out_drop;
		}
	}
	if (encoded < count || sent < sdslen(c->obuf)) {
		/* Every reply came before our last byte left: not Redis, and
		 * a command cut short is on the wire. */
		why_set(r, "%s:%u answered before the request was sent", node->at.host, node->at.port);
		rc = ZC_EREMOTE;
		goto out_drop;
	}
	sdsclear(c->obuf);
	return 0;

out_protocol:
	why_set(r, "protocol error from %s:%u: %s", node->at.host, node->at.port, c->reader->errstr);
	rc = ZC_EREMOTE;
out_drop:
	items_clear(items, count);
	node_drop(node);
	return rc;
}

/* Whether an error reply begins with word (followed by a space or end). */
static bool reply_is(const redisReply *reply, const char *word)
{
	size_t n = strlen(word);
	return reply && reply->type == REDIS_REPLY_ERROR && reply->len >= n &&
	       memcmp(reply->str, word, n) == 0 && (reply->len == n || reply->str[n] == ' ');
}

/* The node's connection, made (and authenticated) if there is none. */
static int node_connect(struct router *r, struct router_node *node)
{
	if (node->context)
		return 0;
	struct timeval tv = { .tv_sec = r->timeout_ms / 1000,
			      .tv_usec = (long)(r->timeout_ms % 1000) * 1000 };
	int64_t deadline = clock_ms() + r->timeout_ms;
	redisContext *c = redisConnectWithTimeout(node->at.host, node->at.port, tv);
	if (!c) {
		why_set(r, "cannot connect to %s:%u: out of memory", node->at.host, node->at.port);
		return -ENOMEM;
	}
	if (c->err) {
		why_set(r, "cannot connect to %s:%u: %s", node->at.host, node->at.port, c->errstr);
		int rc = strstr(c->errstr, "timed out") ? -ETIMEDOUT : ZC_EREMOTE;
		redisFree(c);
		return rc;
	}
	/* Our waits from here on (see the top of the file). */
	int flags = fcntl(c->fd, F_GETFL);
	if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
		why_set(r, "cannot configure the socket to %s:%u: %s", node->at.host, node->at.port,
			strerror(errno));
		redisFree(c);
		return ZC_EREMOTE;
	}
	c->flags &= ~REDIS_BLOCK;
	/* hiredis frees an idle reader buffer above maxbuf: after a block of
	 * megabytes the buffer goes back instead of staying per node. */
	c->reader->maxbuf = 64u << 10;
	c->reader->fn = &reply_functions;
	c->reader->privdata = r;
	node->context = c;
	if (!r->password)
		return 0;

	const char *argv[3] = { "AUTH" };
	size_t argvlen[3] = { 4 };
	int argc = 1;
	if (r->user) {
		argv[argc] = r->user;
		argvlen[argc++] = strlen(r->user);
	}
	argv[argc] = r->password;
	argvlen[argc++] = strlen(r->password);
	struct exchange_item item = { .argc = argc, .argv = argv, .argvlen = argvlen };
	int rc = exchange(r, node, &item, 1, deadline);
	if (rc < 0)
		return rc;
	if (item.reply->type == REDIS_REPLY_STATUS)
		rc = 0;
	else {
		/* Redis's text names no secret ("WRONGPASS invalid
		 * username-password pair..."); ours names the user only. */
		why_set(r, "AUTH as user '%s' refused by %s:%u: %.*s", r->user ? r->user : "default",
			node->at.host, node->at.port,
			item.reply->type == REDIS_REPLY_ERROR ? (int)item.reply->len : 0,
			item.reply->type == REDIS_REPLY_ERROR ? item.reply->str : "");
		rc = ZC_EDENIED;
		node_drop(node);
	}
	freeReplyObject(item.reply);
	return rc;
}

/* One command on one node, through its connection (made if needed). */
static int node_command(struct router *r, uint16_t index, int argc, const char *const *argv,
			const size_t *argvlen, redisReply **reply)
{
	struct router_node *node = &r->nodes[index];
	int rc = node_connect(r, node);
	if (rc < 0)
		return rc;
	struct exchange_item item = { .argc = argc, .argv = argv, .argvlen = argvlen };
	rc = exchange(r, node, &item, 1, clock_ms() + r->timeout_ms);
	*reply = item.reply;
	return rc;
}

/* Applies a CLUSTER SLOTS reply: [[start, end, [host, port, id, ...],
 * replicas...], ...]. An empty host means the node that answered. */
static int slots_apply(struct router *r, uint16_t asked, const redisReply *reply)
{
	uint16_t *map = malloc(ROUTER_SLOTS * sizeof(*map));
	if (!map)
		return -ENOMEM;
	for (size_t i = 0; i < ROUTER_SLOTS; i++)
		map[i] = NO_NODE;
	for (size_t i = 0; i < reply->elements; i++) {
		const redisReply *range = reply->element[i];
		if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
		    range->element[0]->type != REDIS_REPLY_INTEGER ||
		    range->element[1]->type != REDIS_REPLY_INTEGER ||
		    range->element[2]->type != REDIS_REPLY_ARRAY || range->element[2]->elements < 2)
			goto out_malformed;
		long long start = range->element[0]->integer, end = range->element[1]->integer;
		const redisReply *host = range->element[2]->element[0];
		const redisReply *port = range->element[2]->element[1];
		if (start < 0 || end < start || end >= ROUTER_SLOTS || host->type != REDIS_REPLY_STRING ||
		    port->type != REDIS_REPLY_INTEGER || port->integer <= 0 || port->integer > 65535)
			goto out_malformed;
		const char *name = host->str;
		size_t name_len = host->len;
		if (name_len == 0 || (name_len == 1 && name[0] == '?')) {
			name = r->nodes[asked].at.host;
			name_len = strlen(name);
		}
		uint16_t node = node_get(r, name, name_len, (uint16_t)port->integer);
		if (node == NO_NODE) {
			why_set(r, "the slot map names too many nodes");
			free(map);
			return ZC_EREMOTE;
		}
		for (long long s = start; s <= end; s++)
			map[s] = node;
	}
	memcpy(r->slot_node, map, ROUTER_SLOTS * sizeof(*map));
	free(map);
	return 0;

out_malformed:
	why_set(r, "malformed CLUSTER SLOTS reply from %s:%u", r->nodes[asked].at.host,
		r->nodes[asked].at.port);
	free(map);
	return ZC_EREMOTE;
}

/*
 * Asks node for CLUSTER SLOTS. Returns 1 for a cluster (map applied), 0
 * for a standalone server, < 0 when it could not tell.
 */
static int slots_ask(struct router *r, uint16_t node)
{
	static const char *const argv[2] = { "CLUSTER", "SLOTS" };
	static const size_t argvlen[2] = { 7, 5 };
	redisReply *reply = NULL;
	int rc = node_command(r, node, 2, argv, argvlen, &reply);
	if (rc < 0)
		return rc;
	if (reply->type == REDIS_REPLY_ARRAY)
		rc = slots_apply(r, node, reply) < 0 ? ZC_EREMOTE : 1;
	else if (reply->type == REDIS_REPLY_ERROR && strstr(reply->str, "cluster support disabled"))
		rc = 0;
	else {
		why_set(r, "CLUSTER SLOTS on %s:%u: %.*s", r->nodes[node].at.host, r->nodes[node].at.port,
			reply->type == REDIS_REPLY_ERROR ? (int)reply->len : 0,
			reply->type == REDIS_REPLY_ERROR ? reply->str : "");
		rc = ZC_EREMOTE;
	}
	freeReplyObject(reply);
	return rc;
}

/* Finds out standalone or cluster from the first seed that answers. */
static int discover(struct router *r)
{
	int rc = ZC_EREMOTE;
	for (size_t i = 0; i < r->n_seeds; i++) {
		const struct router_endpoint *seed = &r->seeds[i];
		uint16_t node = node_get(r, seed->host, strlen(seed->host), seed->port);
		if (node == NO_NODE)
			return -ENOMEM;
		rc = slots_ask(r, node);
		if (rc == ZC_EDENIED)
			return rc;
		if (rc < 0)
			continue;
		r->discovered = true;
		r->cluster = rc == 1;
		if (!r->cluster)
			for (size_t s = 0; s < ROUTER_SLOTS; s++)
				r->slot_node[s] = node;
		return 0;
	}
	return rc;
}

/* Reads the slot map again from any node that answers: those the map
 * names first, then the seeds. The old map stays if none does. */
static void slots_refresh(struct router *r)
{
	r->refresh = false;
	for (size_t i = 0; i < r->n_nodes; i++)
		if (r->nodes[i].context && slots_ask(r, (uint16_t)i) == 1)
			return;
	for (size_t i = 0; i < r->n_seeds; i++) {
		uint16_t node = node_get(r, r->seeds[i].host, strlen(r->seeds[i].host),
					 r->seeds[i].port);
		if (node != NO_NODE && slots_ask(r, node) == 1)
			return;
	}
	r->refresh = true;
}

/* "MOVED 3999 127.0.0.1:6381" and "ASK ...": the node named (an empty
 * host is the node that answered); NO_NODE when it makes no sense. */
static uint16_t redirect_target(struct router *r, const redisReply *reply, uint16_t from,
				uint16_t *slot)
{
	const char *space = memchr(reply->str, ' ', reply->len);
	if (!space)
		return NO_NODE;
	char *end;
	unsigned long s = strtoul(space + 1, &end, 10);
	const char *stop = reply->str + reply->len;
	if (end == space + 1 || *end != ' ' || s >= ROUTER_SLOTS)
		return NO_NODE;
	const char *host = end + 1;
	const char *colon = NULL;
	for (const char *p = host; p < stop; p++)
		if (*p == ':')
			colon = p;
	if (!colon)
		return NO_NODE;
	unsigned long port = strtoul(colon + 1, &end, 10);
	if (end != stop || port == 0 || port > 65535)
		return NO_NODE;
	*slot = (uint16_t)s;
	if (colon == host)
		return node_get(r, r->nodes[from].at.host, strlen(r->nodes[from].at.host),
				(uint16_t)port);
	return node_get(r, host, (size_t)(colon - host), (uint16_t)port);
}

static const char *const asking_argv[1] = { "ASKING" };
static const size_t asking_len[1] = { 6 };

/*
 * Sends every pending command bound for node, an ASKING before each that
 * an ASK redirected, and files the replies. A connection that was already
 * open may have died since (a server restarted): after an I/O failure on
 * it the node's commands are tried once more on a new connection.
 * Returns 0 or the failure every one of those commands now carries.
 */
static int node_round(struct router *r, uint16_t index, struct router_command *commands,
		      size_t count, size_t pending)
{
	struct router_node *node = &r->nodes[index];
	struct exchange_item *items = calloc(pending * 2, sizeof(*items));
	size_t *owner = calloc(pending * 2, sizeof(*owner));
	int rc = -ENOMEM;
	if (!items || !owner)
		goto out_fail;

	for (int attempt = 0; attempt < 2; attempt++) {
		bool reused = node->context != NULL;
		rc = node_connect(r, node);
		if (rc < 0)
			goto out_fail;
		size_t n = 0;
		for (size_t i = 0; i < count; i++) {
			struct router_command *cmd = &commands[i];
			if (cmd->done || cmd->node != index)
				continue;
			if (cmd->asking) {
				items[n] = (struct exchange_item){ 1, asking_argv, asking_len, NULL };
				owner[n++] = SIZE_MAX;
			}
			items[n] = (struct exchange_item){ cmd->argc, cmd->argv, cmd->argvlen, NULL };
			owner[n++] = i;
		}
		rc = exchange(r, node, items, n, clock_ms() + r->timeout_ms);
		if (rc == -ENOMEM || rc == -ETIMEDOUT || (rc < 0 && !reused))
			goto out_fail;
		if (rc < 0)
			continue;
		for (size_t k = 0; k < n; k++) {
			if (owner[k] == SIZE_MAX) {
				freeReplyObject(items[k].reply);
				continue;
			}
			struct router_command *cmd = &commands[owner[k]];
			redisReply *reply = items[k].reply;
			uint16_t slot = 0, target;
			cmd->asking = false;
			cmd->tries++;
			if (r->cluster && (reply_is(reply, "MOVED") || reply_is(reply, "ASK")) &&
			    (target = redirect_target(r, reply, index, &slot)) != NO_NODE) {
				if (reply_is(reply, "MOVED")) {
					/* This slot now; the rest of the map when
					 * the round is over. */
					r->slot_node[slot] = target;
					r->refresh = true;
				} else
					cmd->asking = true;
				__atomic_fetch_add(&r->redirections, 1, __ATOMIC_RELAXED);
				cmd->node = target;
				freeReplyObject(reply);
				continue;
			}
			if (reply_is(reply, "TRYAGAIN") || reply_is(reply, "CLUSTERDOWN")) {
				cmd->node = NO_NODE; /* back off, then ask the map */
				if (cmd->tries >= ROUTER_MAX_TRIES)
					why_set(r, "%.*s from %s:%u", (int)reply->len, reply->str,
						node->at.host, node->at.port);
				freeReplyObject(reply);
				continue;
			}
			cmd->reply = reply;
			cmd->done = true;
			cmd->status = 0;
		}
		rc = 0;
		break;
	}
out_fail:
	if (rc < 0)
		for (size_t i = 0; i < count; i++)
			if (!commands[i].done && commands[i].node == index) {
				commands[i].done = true;
				commands[i].status = rc;
			}
	free(items);
	free(owner);
	return rc;
}

int router_run(struct router *r, struct router_command *commands, size_t count)
{
	int first = 0;
	for (size_t i = 0; i < count; i++) {
		struct router_command *cmd = &commands[i];
		cmd->reply = NULL;
		cmd->status = 0;
		cmd->done = false;
		cmd->asking = false;
		cmd->tries = 0;
		cmd->slot = router_key_slot(cmd->argv[1], cmd->argvlen[1]);
		cmd->node = NO_NODE;
	}
	if (!r->discovered) {
		int rc = discover(r);
		if (rc < 0) {
			for (size_t i = 0; i < count; i++) {
				commands[i].done = true;
				commands[i].status = rc;
			}
			return rc;
		}
	}
	unsigned backoff = 0;
	for (;;) {
		if (r->refresh && r->cluster)
			slots_refresh(r);
		size_t left = 0;
		bool wait = false;
		for (size_t i = 0; i < count; i++) {
			struct router_command *cmd = &commands[i];
			if (cmd->done)
				continue;
			if (cmd->tries >= ROUTER_MAX_TRIES) {
				char last[sizeof(r->why)];
				snprintf(last, sizeof(last), "%s", r->why[0] ? r->why : "no answer");
				why_set(r, "%s after %u tries (redirections or TRYAGAIN/CLUSTERDOWN)", last,
					ROUTER_MAX_TRIES);
				cmd->done = true;
				cmd->status = ZC_EREMOTE;
				continue;
			}
			if (cmd->node == NO_NODE) {
				wait |= cmd->tries > 0;
				cmd->node = r->slot_node[cmd->slot];
			}
			if (cmd->node == NO_NODE) {
				why_set(r, "no node serves slot %u", cmd->slot);
				cmd->done = true;
				cmd->status = ZC_EREMOTE;
				r->refresh = true;
				continue;
			}
			left++;
		}
		if (left == 0)
			break;
		if (wait) {
			sleep_for_ms(ROUTER_BACKOFF_MS << backoff);
			backoff++;
			if (r->cluster)
				slots_refresh(r);
		}
		/* One node at a time, each with all its pending commands. */
		for (size_t i = 0; i < count; i++) {
			if (commands[i].done || commands[i].node == NO_NODE)
				continue;
			uint16_t node = commands[i].node;
			size_t pending = 0;
			for (size_t j = i; j < count; j++)
				pending += !commands[j].done && commands[j].node == node;
			if (node_round(r, node, commands, count, pending) < 0 && r->cluster)
				r->refresh = true;
		}
	}
	for (size_t i = 0; i < count && !first; i++)
		first = commands[i].status;
	return first;
}

void router_commands_clear(struct router_command *commands, size_t count)
{
	for (size_t i = 0; i < count; i++) {
		if (commands[i].reply)
			freeReplyObject(commands[i].reply);
		commands[i].reply = NULL;
	}
}
