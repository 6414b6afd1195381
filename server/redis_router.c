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
	/* For messages: HOST:PORT, [V6]:PORT, or a Unix socket's path. */
	if (port == 0)
		snprintf(node->name, sizeof(node->name), "%s", node->at.host);
	else
		snprintf(node->name, sizeof(node->name), memchr(host, ':', host_len) ? "[%s]:%u" : "%s:%u",
			 node->at.host, port);
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
	struct router_budget *budget = task->privdata;
	if (bytes > budget->max || budget->used > budget->max - bytes)
		return false;
	budget->used += bytes;
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
 * One node's part of a round: its items sent on its connection and every
 * reply read, by the round's deadline; on any failure the node's
 * connection is dropped (its stream can no longer be trusted to line up).
 * The exchanges of a round run together, in one poll() over their nodes,
 * so a batch over a cluster takes as long as its slowest node, not the
 * sum.
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
struct exchange {
	struct router_node *node;
	struct exchange_item *items;
	size_t count;
	size_t next;       /* replies read */
	size_t encoded;    /* items put in the output buffer */
	size_t sent;       /* bytes of the output buffer written */
	bool ended;
	int rc;            /* once ended: 0 or the failure */
};

static void exchange_end(struct exchange *x, int rc)
{
	x->ended = true;
	x->rc = rc;
	if (rc < 0) {
		items_clear(x->items, x->count);
		node_drop(x->node);
	} else
		sdsclear(x->node->context->obuf);
}

static void exchange_begin(struct router *r, struct exchange *x, struct router_node *node,
			   struct exchange_item *items, size_t count)
{
	*x = (struct exchange){ .node = node, .items = items, .count = count };
	/* Set here, not at connect: the budget lives in the node table,
	 * which may have grown (moved) since. */
	node->budget = (struct router_budget){ .max = r->reply_max };
	node->context->reader->privdata = &node->budget;
	if (count == 0)
		exchange_end(x, 0);
}

/* What x waits for (refilling its output buffer first); 0 once it ended. */
static short exchange_events(struct router *r, struct exchange *x)
{
	redisContext *c = x->node->context;
	if (x->sent == sdslen(c->obuf)) {
		sdsclear(c->obuf);
		x->sent = 0;
		while (x->encoded < x->count && sdslen(c->obuf) < ROUTER_WRITE_AHEAD) {
			const struct exchange_item *item = &x->items[x->encoded++];
			if (redisAppendCommandArgv(c, item->argc, (const char **)item->argv,
						   item->argvlen) != REDIS_OK) {
				why_set(r, "cannot encode a command for %s: %s", x->node->name, c->errstr);
				exchange_end(x, -ENOMEM);
				return 0;
			}
		}
	}
	return POLLIN | (x->sent < sdslen(c->obuf) ? POLLOUT : 0);
}

/* Room for n more bytes in the reader's buffer. sds grows a buffer past
 * 1 MiB by 1 MiB at a time, so a reply of tens of megabytes would be
 * copied whole once per megabyte read (quadratic where realloc copies);
 * doubling it instead keeps a large value's reads linear. Only with a
 * reply in progress: hiredis frees a large buffer that is empty. */
static int reader_room(redisReader *reader, size_t n)
{
	size_t len = sdslen(reader->buf);
	if (len == 0 || sdsavail(reader->buf) >= n)
		return 0;
	sds grown = sdsMakeRoomFor(reader->buf, len > n ? len : n);
	if (!grown)
		return -ENOMEM;
	reader->buf = grown;
	return 0;
}

/* What poll() said of x's socket: write, read, take whole replies. */
static void exchange_step(struct router *r, struct exchange *x, short revents)
{
	struct router_node *node = x->node;
	redisContext *c = node->context;
	if (x->sent < sdslen(c->obuf) && (revents & (POLLOUT | POLLERR | POLLHUP))) {
		ssize_t n = send(c->fd, c->obuf + x->sent, sdslen(c->obuf) - x->sent, MSG_NOSIGNAL);
		if (n < 0 && errno != EAGAIN && errno != EINTR) {
			why_set(r, "write to %s: %s", node->name, strerror(errno));
			exchange_end(x, ZC_EREMOTE);
			return;
		}
		if (n > 0) {
			x->sent += (size_t)n;
			__atomic_fetch_add(&r->bytes_sent, (uint64_t)n, __ATOMIC_RELAXED);
		}
	}
	if (!(revents & (POLLIN | POLLERR | POLLHUP)))
		return;
	ssize_t n = read(c->fd, r->read_buffer, ROUTER_READ_CHUNK);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) {
		why_set(r, "%s closed the connection%s%s", node->name,
			n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
		exchange_end(x, ZC_EREMOTE);
		return;
	}
	__atomic_fetch_add(&r->bytes_received, (uint64_t)n, __ATOMIC_RELAXED);
	redisReader *reader = c->reader;
	if (reader_room(reader, (size_t)n) < 0) {
		why_set(r, "out of memory for a reply from %s", node->name);
		exchange_end(x, -ENOMEM);
		return;
	}
	if (redisReaderFeed(reader, r->read_buffer, (size_t)n) != REDIS_OK)
		goto out_protocol;
	while (x->next < x->count) {
		void *reply = NULL;
		if (redisReaderGetReply(reader, &reply) != REDIS_OK)
			goto out_protocol;
		if (!reply)
			break;
		node->budget.used = 0;
		x->items[x->next++].reply = reply;
	}
	/* What is left is one reply in progress. */
	if (reader->len - reader->pos > r->reply_max) {
		why_set(r, "a reply from %s is larger than %zu bytes", node->name,
			r->reply_max);
		exchange_end(x, ZC_EREMOTE);
		return;
	}
	if (x->next < x->count)
		return;
	if (x->encoded < x->count || x->sent < sdslen(c->obuf)) {
		/* Every reply came before our last byte left: not Redis, and
		 * a command cut short is on the wire. */
		why_set(r, "%s answered before the request was sent", node->name);
		exchange_end(x, ZC_EREMOTE);
		return;
	}
	exchange_end(x, 0);
	return;

out_protocol:
	why_set(r, "protocol error from %s: %s", node->name, reader->errstr);
	exchange_end(x, ZC_EREMOTE);
}

/* Runs exchanges to their ends by deadline, all at once. */
static void exchanges_run(struct router *r, struct exchange *xs, size_t n, int64_t deadline)
{
	struct pollfd *fds = calloc(n ? n : 1, sizeof(*fds));
	size_t *which = calloc(n ? n : 1, sizeof(*which));
	if (!fds || !which) {
		for (size_t i = 0; i < n; i++)
			if (!xs[i].ended)
				exchange_end(&xs[i], -ENOMEM);
		goto out_free;
	}
	for (;;) {
		size_t active = 0;
		for (size_t i = 0; i < n; i++) {
			if (xs[i].ended)
				continue;
			short events = exchange_events(r, &xs[i]);
			if (xs[i].ended)
				continue;
			fds[active] = (struct pollfd){ .fd = xs[i].node->context->fd, .events = events };
			which[active++] = i;
		}
		if (active == 0)
			break;
		int64_t left = deadline - clock_ms();
		if (left <= 0) {
			for (size_t k = 0; k < active; k++) {
				struct router_node *node = xs[which[k]].node;
				why_set(r, "%s did not answer within %u ms", node->name,
					r->timeout_ms);
				exchange_end(&xs[which[k]], -ETIMEDOUT);
			}
			break;
		}
		int ready = poll(fds, active, (int)(left > 1000000 ? 1000000 : left));
		if (ready < 0 && errno == EINTR)
			continue;
		if (ready < 0) {
			why_set(r, "poll: %s", strerror(errno));
			for (size_t k = 0; k < active; k++)
				exchange_end(&xs[which[k]], ZC_EREMOTE);
			break;
		}
		for (size_t k = 0; ready > 0 && k < active; k++)
			if (fds[k].revents)
				exchange_step(r, &xs[which[k]], fds[k].revents);
	}
out_free:
	free(fds);
	free(which);
}

/* One node's items, alone (AUTH, CLUSTER SLOTS). */
static int exchange(struct router *r, struct router_node *node, struct exchange_item *items,
		    size_t count, int64_t deadline)
{
	struct exchange x;
	exchange_begin(r, &x, node, items, count);
	exchanges_run(r, &x, 1, deadline);
	return x.rc;
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
	redisContext *c = node->at.port ? redisConnectWithTimeout(node->at.host, node->at.port, tv) :
					  redisConnectUnixWithTimeout(node->at.host, tv);
	if (!c) {
		why_set(r, "cannot connect to %s: out of memory", node->name);
		return -ENOMEM;
	}
	if (c->err) {
		why_set(r, "cannot connect to %s: %s", node->name, c->errstr);
		int rc = strstr(c->errstr, "timed out") ? -ETIMEDOUT : ZC_EREMOTE;
		redisFree(c);
		return rc;
	}
	/* Our waits from here on (see the top of the file). */
	int flags = fcntl(c->fd, F_GETFL);
	if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
		why_set(r, "cannot configure the socket to %s: %s", node->name,
			strerror(errno));
		redisFree(c);
		return ZC_EREMOTE;
	}
	c->flags &= ~REDIS_BLOCK;
	/* hiredis frees an idle reader buffer above maxbuf: after a block of
	 * megabytes the buffer goes back instead of staying per node. */
	c->reader->maxbuf = 64u << 10;
	c->reader->fn = &reply_functions;
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
		why_set(r, "AUTH as user '%s' refused by %s: %.*s", r->user ? r->user : "default",
			node->name,
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
	why_set(r, "malformed CLUSTER SLOTS reply from %s", r->nodes[asked].name);
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
		why_set(r, "CLUSTER SLOTS on %s: %.*s", r->nodes[node].name,
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

/* Files a node's replies: answers, or redirections and waits to retry. */
static void replies_file(struct router *r, uint16_t index, struct router_command *commands,
			 struct exchange_item *items, const size_t *owner, size_t n)
{
	struct router_node *node = &r->nodes[index];
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
				/* This slot now; the rest of the map when the
				 * round is over. */
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
			why_set(r, "%.*s from %s", (int)reply->len, reply->str, node->name);
			freeReplyObject(reply);
			continue;
		}
		cmd->reply = reply;
		cmd->done = true;
		cmd->status = 0;
	}
}

/* Every pending command of one node fails with rc. */
static void node_fail(struct router_command *commands, size_t count, uint16_t index, int rc)
{
	for (size_t i = 0; i < count; i++)
		if (!commands[i].done && commands[i].node == index) {
			commands[i].done = true;
			commands[i].status = rc;
		}
}

/* A node's part of a round. */
struct round_node {
	uint16_t index;
	bool reused;                  /* its connection was open before the round */
	struct exchange_item *items;  /* an ASKING before each command an ASK redirected */
	size_t *owner;                /* the command of each item; SIZE_MAX for ASKING */
	size_t n;
};

/*
 * One round: every pending command sent to its node, the nodes' exchanges
 * run together, the replies filed. A connection that was open before the
 * round may have died since (a server restarted): after an I/O failure on
 * it, its commands stay pending and go again next round, on a new
 * connection; any other failure fails the node's commands.
 */
static void round_run(struct router *r, struct router_command *commands, size_t count)
{
	struct round_node *parts = calloc(count, sizeof(*parts));
	struct exchange *xs = calloc(count, sizeof(*xs));
	size_t n_parts = 0;
	if (!parts || !xs) {
		for (size_t i = 0; i < count; i++)
			if (!commands[i].done) {
				commands[i].done = true;
				commands[i].status = -ENOMEM;
			}
		goto out_free;
	}
	for (size_t i = 0; i < count; i++) {
		const struct router_command *cmd = &commands[i];
		if (cmd->done || cmd->node == NO_NODE)
			continue;
		size_t p = 0;
		while (p < n_parts && parts[p].index != cmd->node)
			p++;
		if (p == n_parts)
			parts[n_parts++].index = cmd->node;
		parts[p].n += cmd->asking ? 2 : 1;
	}
	size_t n_x = 0;
	for (size_t p = 0; p < n_parts; p++) {
		struct round_node *part = &parts[p];
		struct router_node *node = &r->nodes[part->index];
		part->reused = node->context != NULL;
		part->items = calloc(part->n, sizeof(*part->items));
		part->owner = calloc(part->n, sizeof(*part->owner));
		int rc = part->items && part->owner ? node_connect(r, node) : -ENOMEM;
		if (rc < 0) {
			node_fail(commands, count, part->index, rc);
			part->n = 0;
			continue;
		}
		size_t k = 0;
		for (size_t i = 0; i < count; i++) {
			struct router_command *cmd = &commands[i];
			if (cmd->done || cmd->node != part->index)
				continue;
			if (cmd->asking) {
				part->items[k] = (struct exchange_item){ 1, asking_argv, asking_len, NULL };
				part->owner[k++] = SIZE_MAX;
			}
			part->items[k] = (struct exchange_item){ cmd->argc, cmd->argv, cmd->argvlen, NULL };
			part->owner[k++] = i;
		}
	}
	/* Connecting may have grown the node table: pointers taken now. */
	for (size_t p = 0; p < n_parts; p++)
		if (parts[p].n)
			exchange_begin(r, &xs[n_x++], &r->nodes[parts[p].index], parts[p].items, parts[p].n);
	exchanges_run(r, xs, n_x, clock_ms() + r->timeout_ms);
	n_x = 0;
	for (size_t p = 0; p < n_parts; p++) {
		struct round_node *part = &parts[p];
		if (!part->n)
			continue;
		int rc = xs[n_x++].rc;
		if (rc == 0)
			replies_file(r, part->index, commands, part->items, part->owner, part->n);
		else if (!(part->reused && rc == ZC_EREMOTE))
			node_fail(commands, count, part->index, rc);
		if (rc < 0 && r->cluster)
			r->refresh = true;
	}
out_free:
	for (size_t p = 0; p < n_parts; p++) {
		free(parts[p].items);
		free(parts[p].owner);
	}
	free(parts);
	free(xs);
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
	bool exhausted = false;
	for (;;) {
		/* Commands told to wait (TRYAGAIN, CLUSTERDOWN) or out of tries. */
		bool wait = false;
		for (size_t i = 0; i < count; i++) {
			struct router_command *cmd = &commands[i];
			if (cmd->done)
				continue;
			if (cmd->tries >= ROUTER_MAX_TRIES) {
				if (!exhausted) {
					char last[sizeof(r->why)];
					snprintf(last, sizeof(last), "%s", r->why[0] ? r->why : "no answer");
					why_set(r, "%s after %u tries (redirections or TRYAGAIN/CLUSTERDOWN)",
						last, ROUTER_MAX_TRIES);
					exhausted = true;
				}
				cmd->done = true;
				cmd->status = ZC_EREMOTE;
				continue;
			}
			wait |= cmd->node == NO_NODE && cmd->tries > 0;
		}
		if (wait) {
			sleep_for_ms(ROUTER_BACKOFF_MS << backoff);
			backoff++;
			r->refresh = true;
		}
		if (r->refresh && r->cluster)
			slots_refresh(r);
		size_t left = 0;
		for (size_t i = 0; i < count; i++) {
			struct router_command *cmd = &commands[i];
			if (cmd->done)
				continue;
			if (cmd->node == NO_NODE)
				cmd->node = r->slot_node[cmd->slot];
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
		round_run(r, commands, count);
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
