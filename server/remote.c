/*
 * The remote tier (remote.h): its configuration, its keys, and the calls
 * over the router, each timed, counted and, when Redis goes down or comes
 * back, logged once.
 */
#include "remote.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

/* A credentials file is two short lines; anything larger is not one. */
#define REMOTE_CREDENTIALS_MAX 4096

struct remote {
	pthread_mutex_t lock;
	struct remote_config config;
	char *user, *password;
	struct router router;
	/* Up or down as the log last said it; -1 before the first call. */
	int state;
	/* Atomic: read by metrics from the loop thread. */
	uint64_t errors[REMOTE_ERROR_KIND_COUNT];
	uint64_t latency_buckets[METRICS_BUCKETS];
	uint64_t latency_count, latency_sum_ns;
	uint64_t offloads, restores;
	uint64_t offload_failures[REMOTE_TRANSFER_FAILURE_COUNT];
	uint64_t restore_failures[REMOTE_TRANSFER_FAILURE_COUNT];
	uint64_t offload_ns;
};

static const char *const transfer_failure_names[REMOTE_TRANSFER_FAILURE_COUNT] = {
	"remote", "touched", "missing", "corrupt", "local",
};

const char *remote_transfer_failure_name(enum remote_transfer_failure kind)
{
	return kind < REMOTE_TRANSFER_FAILURE_COUNT ? transfer_failure_names[kind] : "?";
}

static const char *const error_kind_names[REMOTE_ERROR_KIND_COUNT] = {
	"timeout", "unavailable", "denied", "reply",
};

const char *remote_error_kind_name(enum remote_error_kind kind)
{
	return kind < REMOTE_ERROR_KIND_COUNT ? error_kind_names[kind] : "?";
}

static void why_put(char *why, size_t size, const char *format, ...) __attribute__((format(printf, 3, 4)));

static void why_put(char *why, size_t size, const char *format, ...)
{
	va_list args;
	if (!why || !size)
		return;
	va_start(args, format);
	vsnprintf(why, size, format, args);
	va_end(args);
}

/* ---- configuration --------------------------------------------------- */

/* One HOST:PORT (or [V6]:PORT) of length len into endpoint. */
static int endpoint_parse(const char *text, size_t len, struct router_endpoint *endpoint, char *why,
			  size_t size)
{
	const char *host = text, *colon;
	size_t host_len;
	if (len && text[0] == '[') {
		const char *close = memchr(text, ']', len);
		if (!close || close + 1 >= text + len || close[1] != ':') {
			why_put(why, size, "'%.*s': an IPv6 address is written [ADDRESS]:PORT", (int)len, text);
			return -EINVAL;
		}
		host = text + 1;
		host_len = (size_t)(close - host);
		colon = close + 1;
	} else {
		colon = memchr(text, ':', len);
		if (!colon || memchr(colon + 1, ':', len - (size_t)(colon + 1 - text))) {
			why_put(why, size, "'%.*s' is not HOST:PORT", (int)len, text);
			return -EINVAL;
		}
		host_len = (size_t)(colon - text);
	}
	if (host_len == 0 || host_len >= ROUTER_HOST_MAX) {
		why_put(why, size, "'%.*s': the host is %s", (int)len, text, host_len ? "too long" : "empty");
		return -EINVAL;
	}
	for (size_t i = 0; i < host_len; i++) {
		char c = host[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '.' || c == '-' || c == '_' || c == ':')) {
			why_put(why, size, "'%.*s': the host has a character a host name cannot have",
				(int)len, text);
			return -EINVAL;
		}
	}
	const char *port = colon + 1, *end = text + len;
	unsigned long value = 0;
	if (port == end || end - port > 5) {
		why_put(why, size, "'%.*s': the port is %s", (int)len, text, port == end ? "missing" : "too long");
		return -EINVAL;
	}
	for (const char *p = port; p < end; p++) {
		if (*p < '0' || *p > '9') {
			why_put(why, size, "'%.*s': the port is not a number", (int)len, text);
			return -EINVAL;
		}
		value = value * 10 + (unsigned long)(*p - '0');
	}
	if (value == 0 || value > 65535) {
		why_put(why, size, "'%.*s': the port is outside 1..65535", (int)len, text);
		return -EINVAL;
	}
	memcpy(endpoint->host, host, host_len);
	endpoint->host[host_len] = '\0';
	endpoint->port = (uint16_t)value;
	return 0;
}

int remote_url_parse(const char *text, struct remote_config *config, char *why, size_t size)
{
	static const char scheme[] = "redis://";
	static const char unix_scheme[] = "unix://";
	struct remote_config parsed = *config;
	parsed.n_endpoints = 0;
	if (strncmp(text, unix_scheme, sizeof(unix_scheme) - 1) == 0) {
		/* One standalone server on this machine: unix:///PATH. */
		const char *path = text + sizeof(unix_scheme) - 1;
		size_t len = strlen(path);
		if (path[0] != '/') {
			why_put(why, size, "'%s': a Unix socket is unix:///ABSOLUTE/PATH", text);
			return -EINVAL;
		}
		if (len >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
			why_put(why, size, "'%s': the socket path is longer than %zu bytes", text,
				sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
			return -EINVAL;
		}
		if (strchr(path, ',')) {
			why_put(why, size, "'%s': one Unix socket, no list", text);
			return -EINVAL;
		}
		memcpy(parsed.endpoints[0].host, path, len + 1);
		parsed.endpoints[0].port = 0;
		parsed.n_endpoints = 1;
		*config = parsed;
		return 0;
	}
	if (strncmp(text, scheme, sizeof(scheme) - 1) != 0) {
		why_put(why, size, "'%s' does not start with redis:// or unix://", text);
		return -EINVAL;
	}
	/* No user or password in the URL: they would be on the command
	 * line, in ps and in shell histories (--remote-credentials FILE). */
	const char *p = text + sizeof(scheme) - 1;
	if (strchr(p, '@')) {
		why_put(why, size, "credentials do not go in the URL: use --remote-credentials FILE");
		return -EINVAL;
	}
	if (strchr(p, '/') || strchr(p, '?')) {
		why_put(why, size, "'%s': a path, database number or query is not supported (HOST:PORT[,HOST:PORT...])",
			text);
		return -EINVAL;
	}
	for (;;) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		if (parsed.n_endpoints == REMOTE_MAX_ENDPOINTS) {
			why_put(why, size, "more than %u addresses", REMOTE_MAX_ENDPOINTS);
			return -EINVAL;
		}
		if (len == 0) {
			why_put(why, size, "'%s': an empty address", text);
			return -EINVAL;
		}
		if (endpoint_parse(p, len, &parsed.endpoints[parsed.n_endpoints], why, size) < 0)
			return -EINVAL;
		parsed.n_endpoints++;
		if (!comma)
			break;
		p = comma + 1;
	}
	*config = parsed;
	return 0;
}

int remote_credentials_read(const char *path, char **user, char **password, char *why, size_t size)
{
	char buffer[REMOTE_CREDENTIALS_MAX + 1];
	struct stat st;
	ssize_t total = 0;
	int rc = -EINVAL;

	*user = *password = NULL;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
	if (fd < 0) {
		why_put(why, size, "cannot open the credentials file %s: %s", path, strerror(errno));
		return -errno == -EACCES ? ZC_EDENIED : -EINVAL;
	}
	/* The file opened, not the name: a swapped file cannot pass. */
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		why_put(why, size, "the credentials file %s is not a regular file", path);
		goto out_close;
	}
	if (st.st_uid != geteuid() && st.st_uid != 0) {
		why_put(why, size,
			"the credentials file %s is owned by uid %u, not by zipcached's uid %u (or root)",
			path, (unsigned)st.st_uid, (unsigned)geteuid());
		rc = ZC_EDENIED;
		goto out_close;
	}
	/* Ours: for us alone. Root's (a Kubernetes Secret volume, owned
	 * root:fsGroup): group-readable at most, PostgreSQL's rule for its
	 * key file, since that is the only way such a file reaches us. */
	mode_t forbidden = st.st_uid == geteuid() ? 077 : 037;
	if (st.st_mode & forbidden) {
		why_put(why, size,
			"the credentials file %s is accessible by %s (mode %04o): chmod %s it", path,
			forbidden == 077 ? "group or others" : "others or writable by its group",
			(unsigned)(st.st_mode & 07777), forbidden == 077 ? "600" : "640");
		rc = ZC_EDENIED;
		goto out_close;
	}
	while (total <= REMOTE_CREDENTIALS_MAX) {
		ssize_t n = read(fd, buffer + total, sizeof(buffer) - (size_t)total);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			why_put(why, size, "cannot read the credentials file %s: %s", path, strerror(errno));
			goto out_wipe;
		}
		if (n == 0)
			break;
		total += n;
	}
	if (total > REMOTE_CREDENTIALS_MAX) {
		why_put(why, size, "the credentials file %s is larger than %u bytes", path,
			REMOTE_CREDENTIALS_MAX);
		goto out_wipe;
	}
	buffer[total] = '\0';
	if (memchr(buffer, '\0', (size_t)total)) {
		why_put(why, size, "the credentials file %s holds a NUL byte", path);
		goto out_wipe;
	}
	char *first = buffer, *newline = strchr(buffer, '\n');
	if (!newline) {
		why_put(why, size, "the credentials file %s has no second line: line 1 the ACL user, line 2 the password",
			path);
		goto out_wipe;
	}
	*newline = '\0';
	char *second = newline + 1, *end = strchr(second, '\n');
	if (end) {
		if (end[1] != '\0') {
			why_put(why, size, "the credentials file %s has more than two lines", path);
			goto out_wipe;
		}
		*end = '\0';
	}
	/* Files written on Windows end lines with CR LF. */
	size_t ulen = strlen(first), plen = strlen(second);
	if (ulen && first[ulen - 1] == '\r')
		first[--ulen] = '\0';
	if (plen && second[plen - 1] == '\r')
		second[--plen] = '\0';
	if (plen == 0) {
		why_put(why, size, "the credentials file %s has an empty password (line 2)", path);
		goto out_wipe;
	}
	for (size_t i = 0; i < ulen; i++)
		if ((unsigned char)first[i] <= ' ' || first[i] == 0x7f) {
			why_put(why, size, "the credentials file %s: the user name (line 1) has a space or control character",
				path);
			goto out_wipe;
		}
	*user = ulen ? strdup(first) : NULL;
	*password = strdup(second);
	if ((ulen && !*user) || !*password) {
		free(*user);
		free(*password);
		*user = *password = NULL;
		rc = -ENOMEM;
		goto out_wipe;
	}
	rc = 0;
out_wipe:
	explicit_bzero(buffer, sizeof(buffer));
out_close:
	close(fd);
	return rc;
}

/* ---- keys ------------------------------------------------------------ */

static const char *const key_kind_codes[REMOTE_KEY_KIND_COUNT] = { "m", "b", "r", "c" };

/* Appends the hex of bytes; false when it does not fit. */
static bool put_hex(char *out, size_t size, size_t *at, const void *bytes, size_t len)
{
	static const char digits[] = "0123456789abcdef";
	const unsigned char *b = bytes;
	if (*at + 2 * len >= size)
		return false;
	for (size_t i = 0; i < len; i++) {
		out[(*at)++] = digits[b[i] >> 4];
		out[(*at)++] = digits[b[i] & 15];
	}
	out[*at] = '\0';
	return true;
}

static bool put_text(char *out, size_t size, size_t *at, const char *format, ...) __attribute__((format(printf, 4, 5)));

static bool put_text(char *out, size_t size, size_t *at, const char *format, ...)
{
	va_list args;
	va_start(args, format);
	int n = vsnprintf(out + *at, size - *at, format, args);
	va_end(args);
	if (n < 0 || (size_t)n >= size - *at)
		return false;
	*at += (size_t)n;
	return true;
}

int remote_key_make(struct remote_key *key, uint32_t uid, const struct remote_key_parts *parts)
{
	size_t at = 0, size = sizeof(key->text);
	char *out = key->text;
	enum remote_key_kind kind = parts->kind;
	if (kind >= REMOTE_KEY_KIND_COUNT)
		return ZC_EINVALID;
	bool named = kind != REMOTE_KEY_CHUNK, printed = kind != REMOTE_KEY_MANIFEST;
	size_t name_len = named && parts->name ? strlen(parts->name) : 0;
	if (named && (name_len == 0 || name_len > ZC_SESSION_NAME_MAX))
		return ZC_EINVALID;
	if (printed && (!parts->fingerprint || parts->fingerprint_len == 0 ||
			parts->fingerprint_len > REMOTE_ID_MAX))
		return ZC_EINVALID;
	if (!named && (!parts->chain || parts->chain_len == 0 || parts->chain_len > REMOTE_ID_MAX))
		return ZC_EINVALID;

	bool ok = put_text(out, size, &at, "zc:%u:%u:%s:", REMOTE_KEY_VERSION, uid, key_kind_codes[kind]);
	if (named)
		ok = ok && put_hex(out, size, &at, parts->name, name_len);
	if (named && printed)
		ok = ok && put_text(out, size, &at, ":");
	if (printed)
		ok = ok && put_hex(out, size, &at, parts->fingerprint, parts->fingerprint_len);
	switch (kind) {
	case REMOTE_KEY_MANIFEST:
		break;
	case REMOTE_KEY_BLOCK:
		ok = ok && put_text(out, size, &at, ":%llu:%u:%u", (unsigned long long)parts->generation,
				    parts->layer, parts->block);
		break;
	case REMOTE_KEY_RESIDUAL:
		ok = ok && put_text(out, size, &at, ":%llu:%u", (unsigned long long)parts->generation,
				    parts->layer);
		break;
	case REMOTE_KEY_CHUNK:
		ok = ok && put_text(out, size, &at, ":") &&
		     put_hex(out, size, &at, parts->chain, parts->chain_len) &&
		     put_text(out, size, &at, ":%u", parts->layer);
		break;
	case REMOTE_KEY_KIND_COUNT:
		ok = false;
		break;
	}
	/* NEVER: the parts' bounds make every key fit REMOTE_KEY_MAX. */
	if (!ok)
		return ZC_EINVALID;
	key->len = (uint16_t)at;
	return 0;
}

/* ---- calls ----------------------------------------------------------- */

static uint64_t clock_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void counter_add(uint64_t *counter, uint64_t n)
{
	__atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
}

static enum remote_error_kind error_kind_of(int rc)
{
	switch (rc) {
	case -ETIMEDOUT:
		return REMOTE_ERROR_TIMEOUT;
	case ZC_EDENIED:
		return REMOTE_ERROR_DENIED;
	default:
		return REMOTE_ERROR_UNAVAILABLE;
	}
}

/*
 * After a call (the lock held): its time in the histogram, its failure
 * counted, and the log told when Redis went down or came back. Only a
 * failure to talk to Redis is "down"; an error reply is Redis answering.
 */
static void call_end(struct remote *r, uint64_t start_ns, int rc, bool reachable)
{
	uint64_t elapsed = clock_ns() - start_ns;
	counter_add(&r->latency_buckets[metrics_bucket_of(elapsed)], 1);
	counter_add(&r->latency_count, 1);
	counter_add(&r->latency_sum_ns, elapsed);
	if (rc < 0 && rc != ZC_ENOTFOUND)
		counter_add(&r->errors[reachable ? REMOTE_ERROR_REPLY : error_kind_of(rc)], 1);
	int state = reachable ? 1 : 0;
	if (state == r->state)
		return;
	if (state)
		log_info("remote", "redis up", "mode=%s endpoints=%u", r->router.cluster ? "cluster" : "standalone",
			 r->config.n_endpoints);
	else
		log_warn("remote", "redis down", "error=%s reason=\"%s\"", zc_error_name(rc), r->router.why);
	__atomic_store_n(&r->state, state, __ATOMIC_RELAXED);
}

/* Runs a batch (the lock held) and checks each reply with check; the
 * batch's result: 0 or the first failure. */
typedef int (*reply_check)(struct remote *r, struct router_command *command, void *arg, size_t index);

static int batch_run(struct remote *r, struct router_command *commands, size_t count,
		     reply_check check, void *arg)
{
	uint64_t start = clock_ns();
	int rc = router_run(&r->router, commands, count);
	bool reachable = rc == 0;
	for (size_t i = 0; rc == 0 && i < count; i++) {
		int one = check(r, &commands[i], arg, i);
		if (one < 0 && one != ZC_ENOTFOUND)
			rc = one;
	}
	/* Down is the router's failure, a refused AUTH included (Redis
	 * answers, but the tier cannot be used); an error reply is not. */
	call_end(r, start, rc, reachable);
	router_commands_clear(commands, count);
	return rc;
}

/* An error reply as a failure, with its text kept for remote_last_error. */
static int reply_error(struct remote *r, const redisReply *reply, const char *what)
{
	if (reply->type == REDIS_REPLY_ERROR)
		snprintf(r->router.why, sizeof(r->router.why), "%s: %.*s", what,
			 (int)(reply->len > 200 ? 200 : reply->len), reply->str);
	else
		snprintf(r->router.why, sizeof(r->router.why), "%s: an unexpected reply (type %d)", what,
			 reply->type);
	return ZC_EREMOTE;
}

static int check_ok(struct remote *r, struct router_command *c, void *arg, size_t index)
{
	if (c->reply->type == REDIS_REPLY_STATUS && c->reply->len == 2 && memcmp(c->reply->str, "OK", 2) == 0)
		return 0;
	return reply_error(r, c->reply, c->argv[0]);
}

static int check_integer(struct remote *r, struct router_command *c, void *arg, size_t index)
{
	if (c->reply->type != REDIS_REPLY_INTEGER)
		return reply_error(r, c->reply, c->argv[0]);
	uint64_t *sum = arg;
	if (sum)
		*sum += (uint64_t)(c->reply->integer > 0 ? c->reply->integer : 0);
	return c->reply->integer > 0 ? 0 : ZC_ENOTFOUND;
}

static void command_key(struct router_command *c, const char *verb, const struct remote_key *key)
{
	memset(c, 0, sizeof(*c));
	c->argc = 2;
	c->argv[0] = verb;
	c->argvlen[0] = strlen(verb);
	c->argv[1] = key->text;
	c->argvlen[1] = key->len;
}

/* "SET key value [EX ttl]"; ttl's text in a buffer the caller keeps. */
static int command_set(struct router_command *c, const struct remote_key *key, const void *value,
		       size_t len, const char *ttl)
{
	if (len > REMOTE_VALUE_MAX)
		return ZC_EINVALID;
	command_key(c, "SET", key);
	c->argv[2] = value;
	c->argvlen[2] = len;
	c->argc = 3;
	if (ttl) {
		c->argv[3] = "EX";
		c->argvlen[3] = 2;
		c->argv[4] = ttl;
		c->argvlen[4] = strlen(ttl);
		c->argc = 5;
	}
	return 0;
}

int remote_open(const struct remote_config *config, struct remote **out, char *why, size_t size)
{
	*out = NULL;
	if (config->n_endpoints == 0 || config->timeout_ms == 0) {
		why_put(why, size, "no Redis address or a zero timeout");
		return ZC_EINVALID;
	}
	struct remote *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	r->config = *config;
	r->state = -1;
	int rc = 0;
	if (config->credentials_path[0]) {
		rc = remote_credentials_read(config->credentials_path, &r->user, &r->password, why, size);
		if (rc < 0)
			goto out_free;
	}
	rc = router_init(&r->router, r->config.endpoints, r->config.n_endpoints, r->user, r->password,
			 config->timeout_ms, (size_t)REMOTE_VALUE_MAX + REMOTE_REPLY_SLACK);
	if (rc < 0) {
		why_put(why, size, "cannot make the Redis router: %s", zc_strerror(rc));
		goto out_free;
	}
	if (pthread_mutex_init(&r->lock, NULL) != 0) {
		router_free(&r->router);
		rc = -ENOMEM;
		goto out_free;
	}
	/* Only to tell the log (and the up gauge) where Redis stands. */
	(void)remote_ping(r);
	*out = r;
	return 0;

out_free:
	if (r->password)
		explicit_bzero(r->password, strlen(r->password));
	free(r->password);
	free(r->user);
	free(r);
	return rc;
}

void remote_close(struct remote *r)
{
	if (!r)
		return;
	router_free(&r->router);
	pthread_mutex_destroy(&r->lock);
	if (r->password)
		explicit_bzero(r->password, strlen(r->password));
	free(r->password);
	free(r->user);
	free(r);
}

static int check_pong(struct remote *r, struct router_command *c, void *arg, size_t index)
{
	if (c->reply->type == REDIS_REPLY_STATUS || c->reply->type == REDIS_REPLY_STRING)
		return 0;
	return reply_error(r, c->reply, "PING");
}

int remote_ping(struct remote *r)
{
	/* PING with an argument names a key slot: the router wants one. */
	struct router_command c;
	memset(&c, 0, sizeof(c));
	c.argc = 2;
	c.argv[0] = "PING";
	c.argvlen[0] = 4;
	c.argv[1] = "zc";
	c.argvlen[1] = 2;
	pthread_mutex_lock(&r->lock);
	int rc = batch_run(r, &c, 1, check_pong, NULL);
	pthread_mutex_unlock(&r->lock);
	return rc;
}

int remote_set(struct remote *r, const struct remote_key *key, const void *value, size_t len,
	       uint32_t ttl_seconds)
{
	struct remote_item item = { .key = key, .value = value, .len = len };
	return remote_set_many(r, &item, 1, ttl_seconds);
}

int remote_set_many(struct remote *r, const struct remote_item *items, size_t count,
		    uint32_t ttl_seconds)
{
	char ttl[16];
	if (count == 0)
		return 0;
	snprintf(ttl, sizeof(ttl), "%u", ttl_seconds);
	struct router_command *commands = calloc(count, sizeof(*commands));
	if (!commands)
		return -ENOMEM;
	for (size_t i = 0; i < count; i++)
		if (command_set(&commands[i], items[i].key, items[i].value, items[i].len,
				ttl_seconds ? ttl : NULL) < 0) {
			free(commands);
			return ZC_EINVALID;
		}
	pthread_mutex_lock(&r->lock);
	int rc = batch_run(r, commands, count, check_ok, NULL);
	pthread_mutex_unlock(&r->lock);
	free(commands);
	return rc;
}

/* A GET's answer into its item: a copy of the value, or not found. */
static int check_value(struct remote *r, struct router_command *c, void *arg, size_t index)
{
	struct remote_item *item = &((struct remote_item *)arg)[index];
	redisReply *reply = c->reply;
	item->got = NULL;
	item->got_len = 0;
	if (reply->type == REDIS_REPLY_NIL) {
		item->status = ZC_ENOTFOUND;
		return ZC_ENOTFOUND;
	}
	if (reply->type != REDIS_REPLY_STRING)
		return item->status = reply_error(r, reply, "GET");
	if (reply->len > REMOTE_VALUE_MAX) {
		snprintf(r->router.why, sizeof(r->router.why), "a value of %zu bytes is over the limit of %u",
			 (size_t)reply->len, REMOTE_VALUE_MAX);
		return item->status = ZC_EREMOTE;
	}
	/* hiredis made the string with malloc (len + 1 bytes): taken over,
	 * not copied; freeReplyObject frees the NULL left behind. */
	item->got = reply->str;
	item->got_len = reply->len;
	c->reply->str = NULL;
	item->status = 0;
	return 0;
}

int remote_get_many(struct remote *r, struct remote_item *items, size_t count)
{
	if (count == 0)
		return 0;
	struct router_command *commands = calloc(count, sizeof(*commands));
	if (!commands)
		return -ENOMEM;
	for (size_t i = 0; i < count; i++) {
		command_key(&commands[i], "GET", items[i].key);
		items[i].got = NULL;
		items[i].got_len = 0;
		items[i].status = 0;
	}
	pthread_mutex_lock(&r->lock);
	int rc = batch_run(r, commands, count, check_value, items);
	pthread_mutex_unlock(&r->lock);
	free(commands);
	if (rc < 0)
		for (size_t i = 0; i < count; i++) {
			free(items[i].got);
			items[i].got = NULL;
			items[i].got_len = 0;
			items[i].status = rc;
		}
	return rc;
}

int remote_get(struct remote *r, const struct remote_key *key, void **value, size_t *len)
{
	struct remote_item item = { .key = key };
	*value = NULL;
	*len = 0;
	int rc = remote_get_many(r, &item, 1);
	if (rc < 0)
		return rc;
	if (item.status < 0)
		return item.status;
	*value = item.got;
	*len = item.got_len;
	return 0;
}

/* One verb on each key with an integer answer; *sum the answers'. */
static int integer_many(struct remote *r, const char *verb, const struct remote_key *const *keys,
			size_t count, const char *argument, uint64_t *sum)
{
	if (count == 0)
		return 0;
	struct router_command *commands = calloc(count, sizeof(*commands));
	if (!commands)
		return -ENOMEM;
	for (size_t i = 0; i < count; i++) {
		command_key(&commands[i], verb, keys[i]);
		if (argument) {
			commands[i].argv[2] = argument;
			commands[i].argvlen[2] = strlen(argument);
			commands[i].argc = 3;
		}
	}
	uint64_t total = 0;
	pthread_mutex_lock(&r->lock);
	int rc = batch_run(r, commands, count, check_integer, &total);
	pthread_mutex_unlock(&r->lock);
	free(commands);
	if (sum)
		*sum = total;
	return rc;
}

int remote_del_many(struct remote *r, const struct remote_key *const *keys, size_t count,
		    uint64_t *deleted)
{
	return integer_many(r, "DEL", keys, count, NULL, deleted);
}

int remote_exists(struct remote *r, const struct remote_key *key)
{
	uint64_t found = 0;
	int rc = integer_many(r, "EXISTS", &key, 1, NULL, &found);
	return rc < 0 ? rc : found > 0;
}

int remote_exists_count(struct remote *r, const struct remote_key *const *keys, size_t count,
			uint64_t *found)
{
	*found = 0;
	return integer_many(r, "EXISTS", keys, count, NULL, found);
}

int remote_expire(struct remote *r, const struct remote_key *key, uint32_t ttl_seconds)
{
	char ttl[16];
	uint64_t set = 0;
	snprintf(ttl, sizeof(ttl), "%u", ttl_seconds);
	int rc = integer_many(r, "EXPIRE", &key, 1, ttl, &set);
	return rc < 0 ? rc : set ? 0 : ZC_ENOTFOUND;
}

void remote_last_error(struct remote *r, char *text, size_t size)
{
	pthread_mutex_lock(&r->lock);
	snprintf(text, size, "%s", r->router.why);
	pthread_mutex_unlock(&r->lock);
}

void remote_count_offload(struct remote *r, uint64_t elapsed_ns)
{
	counter_add(&r->offloads, 1);
	counter_add(&r->offload_ns, elapsed_ns);
}

void remote_count_restore(struct remote *r)
{
	counter_add(&r->restores, 1);
}

void remote_count_offload_failure(struct remote *r, enum remote_transfer_failure kind)
{
	if (kind < REMOTE_TRANSFER_FAILURE_COUNT)
		counter_add(&r->offload_failures[kind], 1);
}

void remote_count_restore_failure(struct remote *r, enum remote_transfer_failure kind)
{
	if (kind < REMOTE_TRANSFER_FAILURE_COUNT)
		counter_add(&r->restore_failures[kind], 1);
}

static uint64_t counter_get(const uint64_t *counter)
{
	return __atomic_load_n(counter, __ATOMIC_RELAXED);
}

void remote_stats_read(struct remote *r, struct remote_stats *s)
{
	memset(s, 0, sizeof(*s));
	s->up = __atomic_load_n(&r->state, __ATOMIC_RELAXED) == 1;
	for (int i = 0; i < REMOTE_ERROR_KIND_COUNT; i++)
		s->errors[i] = counter_get(&r->errors[i]);
	for (int i = 0; i < METRICS_BUCKETS; i++)
		s->latency_buckets[i] = counter_get(&r->latency_buckets[i]);
	s->latency_count = counter_get(&r->latency_count);
	s->latency_sum_ns = counter_get(&r->latency_sum_ns);
	s->bytes_sent = counter_get(&r->router.bytes_sent);
	s->bytes_received = counter_get(&r->router.bytes_received);
	s->redirections = counter_get(&r->router.redirections);
	s->offloads = counter_get(&r->offloads);
	s->restores = counter_get(&r->restores);
	s->offload_ns = counter_get(&r->offload_ns);
	for (int i = 0; i < REMOTE_TRANSFER_FAILURE_COUNT; i++) {
		s->offload_failures[i] = counter_get(&r->offload_failures[i]);
		s->restore_failures[i] = counter_get(&r->restore_failures[i]);
	}
}
