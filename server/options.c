/*
 * Flags of zipcached. Every flag has a default that works for one user
 * on one machine; --help lists them all.
 */
#include "options.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "busy_poll.h"
#include "codec_fanout.h"
#include "offload.h"
#include "quota.h"
#include "resources.h"
#include "retain.h"
#include "version.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"

void options_default(struct options *options)
{
	uid_t uid = getuid();

	memset(options, 0, sizeof(*options));
	/* The rule clients share (zipcache/client.h); a path too long for
	 * sun_path is cut here and refused when the socket is bound. */
	(void)zc_daemon_socket_path(options->socket_path, sizeof(options->socket_path));
	snprintf(options->shm_dir, sizeof(options->shm_dir), "/dev/shm/zipcached-%u", (unsigned)uid);
	options->socket_mode = 0660;
	options->max_inline_bytes = 4u << 20;
	options->max_frame_bytes = 9u << 20;
	options->max_connections = 1024;
	options->max_sessions = 1024;
	options->max_tokens = 1u << 20;
	options->max_staging_bytes = 1ull << 30;
	options->ring_poll_us = RING_POLL_AUTO;
	options->memory_budget = OPTIONS_DERIVED;
	options->max_sessions_per_uid = OPTIONS_DERIVED;
	options->max_connections_per_uid = OPTIONS_DERIVED;
	options->memory_budget_per_uid = OPTIONS_DERIVED;
	options->max_staging_bytes_per_uid = OPTIONS_DERIVED;
	/* A few large stats or list replies; a client that reads them never
	 * comes near. The total keeps a thousand such clients from adding up. */
	options->max_reply_queue_bytes = 4u << 20;
	options->max_reply_queue_total = 64u << 20;
	options->idle_ttl_seconds = 3600;
	options->lease_seconds = 30;
	options->view_idle_seconds = 60;
	/* ~64K elements is ~30 us of codec work: below it the hop to a
	 * worker thread costs more than it saves. */
	options->offload_elements = 1u << 16;
	options->retain_bytes = RETAIN_DEFAULT_BYTES;
	options->log_level = LOG_INFO;
	options->adopt = true;
	snprintf(options->metrics_listen, sizeof(options->metrics_listen), "127.0.0.1:9464");
	options->remote.timeout_ms = REMOTE_TIMEOUT_MS_DEFAULT;
	options->remote_ttl_seconds = OFFLOAD_TTL_SECONDS_DEFAULT;
}

/* A configured value for --help: the number, "none", or the rule that
 * derives it ("1/2 of --max-sessions"). */
static const char *configured_text(uint64_t value, const char *rule, char *buffer, size_t size)
{
	if (value == OPTIONS_DERIVED)
		snprintf(buffer, size, "%s", rule);
	else if (value == 0)
		snprintf(buffer, size, "none");
	else
		snprintf(buffer, size, "%llu", (unsigned long long)value);
	return buffer;
}

void options_print_help(const char *program, const struct options *configured)
{
	struct options d;
	char rule[4][48], text[5][64], formula[96];
	options_default(&d);
	resources_descriptors_formula(configured, formula, sizeof(formula));
	snprintf(rule[0], sizeof(rule[0]), "1/%u of --max-sessions", QUOTA_DEFAULT_SHARE);
	snprintf(rule[1], sizeof(rule[1]), "1/%u of --max-connections", QUOTA_DEFAULT_SHARE);
	snprintf(rule[2], sizeof(rule[2]), "1/%u of --memory-budget", QUOTA_DEFAULT_SHARE);
	snprintf(rule[3], sizeof(rule[3]), "%u x --max-staging-bytes", QUOTA_DEFAULT_STAGING_BUFFERS);
	printf("Usage: %s [options]\n"
	       "\n"
	       "zipcached holds LLM KV caches compressed (ZipCache-style mixed precision)\n"
	       "in shared memory and serves them to worker processes over a Unix socket.\n"
	       "\n"
	       "  --socket PATH            Unix socket to listen on (default %s)\n"
	       "  --socket-mode MODE       permissions of the socket, octal (default %04o)\n"
	       "  --shm-dir DIR            directory for session files, on tmpfs (default %s)\n"
	       "  --max-frame-bytes N      largest request frame accepted (default %u)\n"
	       "  --max-inline-bytes N     largest inline K+V payload (default %u)\n"
	       "  --max-connections N      concurrent connections (default %u)\n"
	       "  --max-sessions N         open sessions (default %u)\n"
	       "  --max-tokens N           max_tokens allowed per session (default %u)\n"
	       "  --max-staging-bytes N    largest staging buffer or request ring per connection (default %llu)\n"
	       "  --memory-budget N        bytes of memory for all sessions and staging buffers, 0 = none\n"
	       "                           (default: derived at start from the shm-dir's file system size\n"
	       "                           and the cgroup's memory limit, whichever is smaller, less a\n"
	       "                           tenth, at least 64M, for headroom)\n"
	       "  --max-sessions-per-uid N       sessions one uid may hold (default %s)\n"
	       "  --max-connections-per-uid N    connections one uid may hold (default %s)\n"
	       "  --memory-budget-per-uid N      bytes of the memory budget one uid may hold (default %s)\n"
	       "  --max-staging-bytes-per-uid N  staging bytes over one uid's connections (default %s)\n"
	       "                                 0 = no per-uid limit; root and the daemon's own uid\n"
	       "                                 have none\n"
	       "  --max-reply-queue-bytes N      unsent reply bytes before a connection is no longer read\n"
	       "                                 (default %llu)\n"
	       "  --max-reply-queue-total N      unsent reply bytes over all connections before those\n"
	       "                                 with replies waiting are no longer read (default %llu)\n"
	       "  --max-mapped-bytes N     address space all session files may map together; 0 = half\n"
	       "                           the address-space limit (ulimit -v), at most 64T (default 0;\n"
	       "                           each session is one mapping, so vm.max_map_count is not the limit)\n"
	       "  --retain-bytes N         pages of closed sessions kept for new ones (their maps, freed\n"
	       "                           block extents), so a new session's prefill or import does not\n"
	       "                           wait for fresh pages to be zeroed; counted as memory in use,\n"
	       "                           released first by memory relief; 0 = off (default %llu)\n"
	       "  --idle-ttl SECONDS       close sessions idle this long, 0 = never (default %llu)\n"
	       "  --lease-seconds SECONDS  a view returned to a client stays valid this long without\n"
	       "                           another call on its session, or until released (default %llu)\n"
	       "  --view-idle-seconds S    drop the fp16 views of sessions idle (and unleased) this long,\n"
	       "                           even without memory pressure; 0 = never (default %llu)\n"
	       "  --offload-elements N     jobs writing more elements (new tokens plus dropped views rebuilt) run on worker threads (default %u)\n"
	       "  --codec-threads N        threads one large block's compression and reconstruction is\n"
	       "                           spread over (a prefill block, a view rebuild), 1..%u; 0 = the\n"
	       "                           CPUs zipcached may run on, at most 8 (default 0)\n"
	       "  --busy-poll-us US        after each request the loop polls without sleeping this long,\n"
	       "                           so a decode loop's next request finds the daemon awake (no\n"
	       "                           wake-up on the client's send); costs a CPU while requests keep\n"
	       "                           coming; 0..%u, 0 = off (default 0)\n"
	       "  --ring-poll-us US        the same after each request taken from a request ring, so that\n"
	       "                           a ring client's next update needs no doorbell; 0..%u, 0 = off\n"
	       "                           (default %u on a machine with 2 CPUs or more online, else 0)\n"
	       "  --pool-writes MODE       how new blocks get into the pool file: map (in place, through a\n"
	       "                           mapping), copy (pwrite), or auto: map unless a probe at start\n"
	       "                           finds page-table work too dear (default auto)\n"
	       "  --no-adopt               delete session files left by an earlier run instead of adopting them\n"
	       "  --metrics-listen ADDR    HTTP /metrics and /healthz on HOST:PORT, or off (default %s)\n"
	       "  --remote URL             the shared tier on Redis, standalone or Cluster (found out on\n"
	       "                           first contact): redis://HOST:PORT[,HOST:PORT...], or\n"
	       "                           unix:///PATH (default none; docs/REMOTE.md)\n"
	       "  --remote-credentials FILE  Redis ACL user (line 1) and password (line 2); the file must be\n"
	       "                           zipcached's uid's with mode 0600, or root's with mode 0640, or stricter\n"
	       "  --remote-timeout-ms MS   bound on each connect and exchange with Redis (default %u)\n"
	       "  --offload-idle-seconds S write sessions idle (no request, no live lease) this long to\n"
	       "                           the remote tier and drop them here; attach restores them;\n"
	       "                           0 = only when memory relief needs it; needs --remote (default 0)\n"
	       "  --remote-ttl-seconds S   expiry of every key written to the remote tier (default %u)\n"
	       "  --log-level LEVEL        error|warn|info|debug (default info)\n"
	       "  --config FILE            read flags from FILE first: `flag-name = value` per line, # comments\n"
	       "  --help                   this text, for the other flags given with it\n"
	       "  --version                the version\n"
	       "Sizes accept a K, M or G suffix (powers of 1024).\n"
	       "\n"
	       "With these flags:\n"
	       "  descriptors needed       %llu (%s); zipcached raises its soft\n"
	       "                           RLIMIT_NOFILE to the hard limit at start and warns if that is less\n"
	       "  memory budget            %s\n"
	       "  per uid                  sessions %s, connections %s,\n"
	       "                           memory %s, staging %s\n",
	       program, d.socket_path, d.socket_mode, d.shm_dir, d.max_frame_bytes,
	       d.max_inline_bytes, d.max_connections, d.max_sessions, d.max_tokens,
	       (unsigned long long)d.max_staging_bytes, rule[0], rule[1], rule[2], rule[3],
	       (unsigned long long)d.max_reply_queue_bytes,
	       (unsigned long long)d.max_reply_queue_total, (unsigned long long)d.retain_bytes,
	       (unsigned long long)d.idle_ttl_seconds,
	       (unsigned long long)d.lease_seconds, (unsigned long long)d.view_idle_seconds,
	       d.offload_elements, CODEC_FANOUT_MAX_THREADS, BUSY_POLL_MAX_US, BUSY_POLL_MAX_US, RING_POLL_DEFAULT_US, d.metrics_listen, d.remote.timeout_ms, d.remote_ttl_seconds,
	       (unsigned long long)resources_descriptors_needed(configured), formula,
	       configured_text(configured->memory_budget, "derived at start", text[0], sizeof(text[0])),
	       configured_text(configured->max_sessions_per_uid, rule[0], text[1], sizeof(text[1])),
	       configured_text(configured->max_connections_per_uid, rule[1], text[2], sizeof(text[2])),
	       configured_text(configured->memory_budget_per_uid, rule[2], text[3], sizeof(text[3])),
	       configured_text(configured->max_staging_bytes_per_uid, rule[3], text[4], sizeof(text[4])));
}

/* A non-negative integer with an optional K/M/G suffix, nothing else. */
static int parse_size(const char *text, uint64_t max, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!*text || *text == '-')
		return -EINVAL;
	unsigned long long value = strtoull(text, &end, 10);
	if (errno || end == text)
		return -EINVAL;
	unsigned shift = 0;
	if (*end == 'K' || *end == 'k')
		shift = 10;
	else if (*end == 'M' || *end == 'm')
		shift = 20;
	else if (*end == 'G' || *end == 'g')
		shift = 30;
	if (shift)
		end++;
	if (*end || value > (max >> shift))
		return -EINVAL;
	*out = (uint64_t)value << shift;
	return 0;
}

enum option_id {
	OPT_SOCKET = 1000, OPT_SOCKET_MODE, OPT_SHM_DIR, OPT_MAX_FRAME, OPT_MAX_INLINE,
	OPT_MAX_CONNECTIONS, OPT_MAX_SESSIONS, OPT_MAX_TOKENS, OPT_MAX_STAGING, OPT_BUDGET,
	OPT_TTL, OPT_LEASE, OPT_VIEW_IDLE, OPT_OFFLOAD, OPT_NO_ADOPT, OPT_LOG_LEVEL, OPT_METRICS, OPT_CONFIG, OPT_HELP,
	OPT_VERSION, OPT_SESSIONS_PER_UID, OPT_CONNECTIONS_PER_UID, OPT_BUDGET_PER_UID,
	OPT_STAGING_PER_UID, OPT_REPLY_QUEUE, OPT_REPLY_QUEUE_TOTAL, OPT_MAX_MAPPED, OPT_REMOTE,
	OPT_REMOTE_CREDENTIALS, OPT_REMOTE_TIMEOUT, OPT_OFFLOAD_IDLE, OPT_REMOTE_TTL, OPT_RETAIN,
	OPT_CODEC_THREADS, OPT_BUSY_POLL, OPT_RING_POLL, OPT_POOL_WRITES
};

static const struct option long_options[] = {
	{ "socket", required_argument, NULL, OPT_SOCKET },
	{ "socket-mode", required_argument, NULL, OPT_SOCKET_MODE },
	{ "shm-dir", required_argument, NULL, OPT_SHM_DIR },
	{ "max-frame-bytes", required_argument, NULL, OPT_MAX_FRAME },
	{ "max-inline-bytes", required_argument, NULL, OPT_MAX_INLINE },
	{ "max-connections", required_argument, NULL, OPT_MAX_CONNECTIONS },
	{ "max-sessions", required_argument, NULL, OPT_MAX_SESSIONS },
	{ "max-tokens", required_argument, NULL, OPT_MAX_TOKENS },
	{ "max-staging-bytes", required_argument, NULL, OPT_MAX_STAGING },
	{ "memory-budget", required_argument, NULL, OPT_BUDGET },
	{ "max-sessions-per-uid", required_argument, NULL, OPT_SESSIONS_PER_UID },
	{ "max-connections-per-uid", required_argument, NULL, OPT_CONNECTIONS_PER_UID },
	{ "memory-budget-per-uid", required_argument, NULL, OPT_BUDGET_PER_UID },
	{ "max-staging-bytes-per-uid", required_argument, NULL, OPT_STAGING_PER_UID },
	{ "max-reply-queue-bytes", required_argument, NULL, OPT_REPLY_QUEUE },
	{ "max-reply-queue-total", required_argument, NULL, OPT_REPLY_QUEUE_TOTAL },
	{ "idle-ttl", required_argument, NULL, OPT_TTL },
	{ "lease-seconds", required_argument, NULL, OPT_LEASE },
	{ "view-idle-seconds", required_argument, NULL, OPT_VIEW_IDLE },
	{ "offload-elements", required_argument, NULL, OPT_OFFLOAD },
	{ "no-adopt", no_argument, NULL, OPT_NO_ADOPT },
	{ "log-level", required_argument, NULL, OPT_LOG_LEVEL },
	{ "metrics-listen", required_argument, NULL, OPT_METRICS },
	{ "config", required_argument, NULL, OPT_CONFIG },
	{ "help", no_argument, NULL, OPT_HELP },
	{ "version", no_argument, NULL, OPT_VERSION },
	{ "max-mapped-bytes", required_argument, NULL, OPT_MAX_MAPPED },
	{ "retain-bytes", required_argument, NULL, OPT_RETAIN },
	{ "codec-threads", required_argument, NULL, OPT_CODEC_THREADS },
	{ "busy-poll-us", required_argument, NULL, OPT_BUSY_POLL },
	{ "ring-poll-us", required_argument, NULL, OPT_RING_POLL },
	{ "pool-writes", required_argument, NULL, OPT_POOL_WRITES },
	{ "remote", required_argument, NULL, OPT_REMOTE },
	{ "remote-credentials", required_argument, NULL, OPT_REMOTE_CREDENTIALS },
	{ "remote-timeout-ms", required_argument, NULL, OPT_REMOTE_TIMEOUT },
	{ "offload-idle-seconds", required_argument, NULL, OPT_OFFLOAD_IDLE },
	{ "remote-ttl-seconds", required_argument, NULL, OPT_REMOTE_TTL },
	{ NULL, 0, NULL, 0 }
};

/* Why the last value was refused, where a parser says more than errno's
 * text ("the port is outside 1..65535"); "" otherwise. */
static char value_why[300];

/* The reason a value was refused, for the message. */
static const char *value_refusal(int rc)
{
	return value_why[0] ? value_why : strerror(-rc);
}

static int option_apply(struct options *o, int id, const char *arg)
{
	value_why[0] = '\0';
	uint64_t value = 0;
	switch (id) {
	case OPT_SOCKET:
		if (strlen(arg) >= sizeof(o->socket_path))
			return -ENAMETOOLONG;
		snprintf(o->socket_path, sizeof(o->socket_path), "%s", arg);
		return 0;
	case OPT_SOCKET_MODE: {
		char *end;
		errno = 0;
		unsigned long mode = strtoul(arg, &end, 8);
		if (errno || end == arg || *end || mode > 0777)
			return -EINVAL;
		o->socket_mode = (unsigned)mode;
		return 0;
	}
	case OPT_SHM_DIR:
		if (strlen(arg) >= sizeof(o->shm_dir) - 64)
			return -ENAMETOOLONG;
		snprintf(o->shm_dir, sizeof(o->shm_dir), "%s", arg);
		return 0;
	case OPT_NO_ADOPT:
		/* On the command line a bare flag; in a file, a boolean. */
		if (!arg || strcmp(arg, "true") == 0 || strcmp(arg, "yes") == 0 || strcmp(arg, "1") == 0)
			o->adopt = false;
		else if (strcmp(arg, "false") == 0 || strcmp(arg, "no") == 0 || strcmp(arg, "0") == 0)
			o->adopt = true;
		else
			return -EINVAL;
		return 0;
	case OPT_METRICS:
		if (strlen(arg) >= sizeof(o->metrics_listen))
			return -ENAMETOOLONG;
		if (strcmp(arg, "off") != 0 && !strchr(arg, ':'))
			return -EINVAL;
		snprintf(o->metrics_listen, sizeof(o->metrics_listen), "%s", arg);
		return 0;
	case OPT_LOG_LEVEL:
		return log_level_parse(arg, &o->log_level);
	case OPT_POOL_WRITES:
		return pool_writes_parse(arg, &o->pool_writes);
	case OPT_REMOTE:
		return remote_url_parse(arg, &o->remote, value_why, sizeof(value_why));
	case OPT_REMOTE_CREDENTIALS:
		/* Only the path: the file is read (and its mode checked) at start. */
		if (!*arg || strlen(arg) >= sizeof(o->remote.credentials_path))
			return -ENAMETOOLONG;
		snprintf(o->remote.credentials_path, sizeof(o->remote.credentials_path), "%s", arg);
		return 0;
	}
	if (parse_size(arg, UINT64_MAX, &value) < 0)
		return -EINVAL;
	switch (id) {
	case OPT_MAX_FRAME:
		if (value < 4096 || value > (1u << 30))
			return -ERANGE;
		o->max_frame_bytes = (uint32_t)value;
		return 0;
	case OPT_MAX_INLINE:
		if (value > (1u << 30))
			return -ERANGE;
		o->max_inline_bytes = (uint32_t)value;
		return 0;
	case OPT_MAX_CONNECTIONS:
	case OPT_MAX_SESSIONS:
	case OPT_MAX_TOKENS:
		if (value == 0 || value > (id == OPT_MAX_TOKENS ? ZC_MAX_BLOCK_TOKENS : 1000000u))
			return -ERANGE;
		if (id == OPT_MAX_CONNECTIONS)
			o->max_connections = (uint32_t)value;
		else if (id == OPT_MAX_SESSIONS)
			o->max_sessions = (uint32_t)value;
		else
			o->max_tokens = (uint32_t)value;
		return 0;
	case OPT_MAX_STAGING:
		o->max_staging_bytes = value;
		return 0;
	case OPT_BUDGET:
		/* Not the sentinel: every value a flag can give is a budget. */
		if (value == OPTIONS_DERIVED)
			return -ERANGE;
		o->memory_budget = value;
		return 0;
	case OPT_MAX_MAPPED:
		o->max_mapped_bytes = value;
		return 0;
	case OPT_RETAIN:
		o->retain_bytes = value;
		return 0;
	case OPT_SESSIONS_PER_UID:
	case OPT_CONNECTIONS_PER_UID:
		if (value > 1000000u)
			return -ERANGE;
		if (id == OPT_SESSIONS_PER_UID)
			o->max_sessions_per_uid = value;
		else
			o->max_connections_per_uid = value;
		return 0;
	case OPT_BUDGET_PER_UID:
	case OPT_STAGING_PER_UID:
		if (value == OPTIONS_DERIVED)
			return -ERANGE;
		if (id == OPT_BUDGET_PER_UID)
			o->memory_budget_per_uid = value;
		else
			o->max_staging_bytes_per_uid = value;
		return 0;
	case OPT_REPLY_QUEUE:
	case OPT_REPLY_QUEUE_TOTAL:
		/* Below a few replies' worth every connection would stall. */
		if (value < (64u << 10))
			return -ERANGE;
		if (id == OPT_REPLY_QUEUE)
			o->max_reply_queue_bytes = value;
		else
			o->max_reply_queue_total = value;
		return 0;
	case OPT_TTL:
		/* Counted in milliseconds later: keep seconds * 1000 in range. */
		if (value > UINT64_MAX / 1000)
			return -ERANGE;
		o->idle_ttl_seconds = value;
		return 0;
	case OPT_LEASE:
	case OPT_VIEW_IDLE:
		/* Counted in milliseconds (and a lease in 32 bits of them on the wire). */
		if (value > UINT32_MAX / 1000 || (id == OPT_LEASE && value == 0))
			return -ERANGE;
		if (id == OPT_LEASE)
			o->lease_seconds = value;
		else
			o->view_idle_seconds = value;
		return 0;
	case OPT_REMOTE_TIMEOUT:
		/* A minute: past it a "slow" Redis is a down one. */
		if (value == 0 || value > 60000)
			return -ERANGE;
		o->remote.timeout_ms = (uint32_t)value;
		return 0;
	case OPT_OFFLOAD_IDLE:
		if (value > UINT32_MAX / 1000)
			return -ERANGE;
		o->offload_idle_seconds = value;
		return 0;
	case OPT_REMOTE_TTL:
		/* Redis takes EX up to far beyond this; 0 would mean keys that
		 * never expire, which the brief's every-key expiry rules out. */
		if (value == 0 || value > UINT32_MAX)
			return -ERANGE;
		o->remote_ttl_seconds = (uint32_t)value;
		return 0;
	case OPT_OFFLOAD:
		if (value > UINT32_MAX)
			return -ERANGE;
		o->offload_elements = (uint32_t)value;
		return 0;
	case OPT_CODEC_THREADS:
		if (value > CODEC_FANOUT_MAX_THREADS)
			return -ERANGE;
		o->codec_threads = (uint32_t)value;
		return 0;
	case OPT_BUSY_POLL:
		if (value > BUSY_POLL_MAX_US)
			return -ERANGE;
		o->busy_poll_us = (uint32_t)value;
		return 0;
	case OPT_RING_POLL:
		if (value > BUSY_POLL_MAX_US)
			return -ERANGE;
		o->ring_poll_us = (uint32_t)value;
		return 0;
	}
	return -EINVAL;
}

static const char *option_name(int id)
{
	for (const struct option *o = long_options; o->name; o++)
		if (o->val == id)
			return o->name;
	return "?";
}

static char *trim(char *text)
{
	while (*text == ' ' || *text == '\t')
		text++;
	size_t len = strlen(text);
	while (len && (text[len - 1] == ' ' || text[len - 1] == '\t' || text[len - 1] == '\r' ||
		       text[len - 1] == '\n'))
		text[--len] = '\0';
	return text;
}

int options_load_file(struct options *options, const char *path)
{
	char *line = NULL;
	size_t capacity = 0;
	unsigned number = 0;
	struct stat st;
	int rc = 0;
	FILE *file = fopen(path, "re");

	if (!file || fstat(fileno(file), &st) < 0 || !S_ISREG(st.st_mode)) {
		fprintf(stderr, "zipcached: cannot read config %s: %s\n", path,
			file ? "not a regular file" : strerror(errno));
		if (file)
			fclose(file);
		return -EINVAL;
	}
	while (rc == 0 && getline(&line, &capacity, file) >= 0) {
		number++;
		char *text = line;
		/* A byte-order mark some editors write is not part of the key. */
		if (number == 1 && strncmp(text, "\xef\xbb\xbf", 3) == 0)
			text += 3;
		text = trim(text);
		if (!*text || *text == '#')
			continue;
		char *equals = strchr(text, '=');
		if (!equals) {
			fprintf(stderr, "zipcached: %s:%u: expected `flag-name = value`\n", path, number);
			rc = -EINVAL;
			break;
		}
		*equals = '\0';
		char *key = trim(text), *value = trim(equals + 1);
		const struct option *found = NULL;
		for (const struct option *o = long_options; o->name; o++)
			if (strcmp(o->name, key) == 0)
				found = o;
		if (!found || found->val == OPT_CONFIG || found->val == OPT_HELP ||
		    found->val == OPT_VERSION) {
			fprintf(stderr, "zipcached: %s:%u: unknown setting '%s'\n", path, number, key);
			rc = -EINVAL;
			break;
		}
		rc = option_apply(options, found->val, value);
		if (rc < 0) {
			fprintf(stderr, "zipcached: %s:%u: bad value for %s: '%s' (%s)\n", path, number,
				key, value, value_refusal(rc));
			rc = -EINVAL;
		}
	}
	if (rc == 0 && ferror(file)) {
		fprintf(stderr, "zipcached: cannot read config %s: %s\n", path, strerror(errno));
		rc = -EINVAL;
	}
	free(line);
	fclose(file);
	return rc;
}

int options_parse(struct options *options, int argc, char **argv)
{
	bool help = false;
	int id;

	/* The file first, so that flags on the command line win. */
	optind = 1;
	opterr = 0;
	while ((id = getopt_long(argc, argv, "", long_options, NULL)) != -1) {
		if (id == OPT_CONFIG && options_load_file(options, optarg) < 0)
			return -EINVAL;
	}
	optind = 1;
	while ((id = getopt_long(argc, argv, "", long_options, NULL)) != -1) {
		if (id == OPT_HELP) {
			/* Printed once every flag is applied: it says what they need. */
			help = true;
			continue;
		}
		if (id == OPT_VERSION) {
			printf("zipcached %s\n", ZIPCACHE_VERSION);
			return 1;
		}
		if (id == '?' || id == ':') {
			fprintf(stderr, "zipcached: unknown option or missing value: %s (see --help)\n",
				argv[optind - 1]);
			return -EINVAL;
		}
		if (id == OPT_CONFIG)
			continue;
		int rc = option_apply(options, id, optarg);
		if (rc < 0) {
			fprintf(stderr, "zipcached: bad value for --%s: '%s' (%s)\n", option_name(id),
				optarg ? optarg : "", value_refusal(rc));
			return -EINVAL;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "zipcached: unexpected argument: %s (see --help)\n", argv[optind]);
		return -EINVAL;
	}
	if (options->remote.credentials_path[0] && options->remote.n_endpoints == 0) {
		fprintf(stderr, "zipcached: --remote-credentials without --remote\n");
		return -EINVAL;
	}
	if (options->offload_idle_seconds && options->remote.n_endpoints == 0) {
		fprintf(stderr, "zipcached: --offload-idle-seconds needs --remote (where would sessions go?)\n");
		return -EINVAL;
	}
	/* Inline K/V must fit a frame with room for the rest of the message. */
	if (options->max_inline_bytes > options->max_frame_bytes - 1024)
		options->max_inline_bytes = options->max_frame_bytes - 1024;
	if (help) {
		options_print_help(argv[0], options);
		return 1;
	}
	return 0;
}
