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

#include "version.h"
#include "zipcache/codec.h"

void options_default(struct options *options)
{
	const char *runtime = getenv("RUNTIME_DIRECTORY");   /* systemd's RuntimeDirectory */
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	uid_t uid = getuid();

	memset(options, 0, sizeof(*options));
	if (runtime && *runtime)
		snprintf(options->socket_path, sizeof(options->socket_path), "%s/zipcached.sock", runtime);
	else if (uid == 0)
		snprintf(options->socket_path, sizeof(options->socket_path), "/run/zipcached.sock");
	else if (xdg && *xdg)
		snprintf(options->socket_path, sizeof(options->socket_path), "%s/zipcached.sock", xdg);
	else
		snprintf(options->socket_path, sizeof(options->socket_path), "/tmp/zipcached-%u.sock",
			 (unsigned)uid);
	snprintf(options->shm_dir, sizeof(options->shm_dir), "/dev/shm/zipcached-%u", (unsigned)uid);
	options->socket_mode = 0660;
	options->max_inline_bytes = 4u << 20;
	options->max_frame_bytes = 9u << 20;
	options->max_connections = 1024;
	options->max_sessions = 1024;
	options->max_tokens = 1u << 20;
	options->max_staging_bytes = 1ull << 30;
	options->memory_budget = 0;
	options->idle_ttl_seconds = 3600;
	/* ~64K elements is ~30 us of codec work: below it the hop to a
	 * worker thread costs more than it saves. */
	options->offload_elements = 1u << 16;
	options->log_level = LOG_INFO;
	options->adopt = true;
	snprintf(options->metrics_listen, sizeof(options->metrics_listen), "127.0.0.1:9464");
}

void options_print_help(const char *program)
{
	struct options d;
	options_default(&d);
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
	       "  --max-staging-bytes N    largest staging buffer per connection (default %llu)\n"
	       "  --memory-budget N        bytes of shared memory for all sessions, 0 = none (default 0)\n"
	       "  --idle-ttl SECONDS       close sessions idle this long, 0 = never (default %llu)\n"
	       "  --offload-elements N     jobs writing more elements (new tokens plus dropped views rebuilt) run on worker threads (default %u)\n"
	       "  --no-adopt               delete session files left by an earlier run instead of adopting them\n"
	       "  --metrics-listen ADDR    HTTP /metrics and /healthz on HOST:PORT, or off (default %s)\n"
	       "  --log-level LEVEL        error|warn|info|debug (default info)\n"
	       "  --config FILE            read flags from FILE first: `flag-name = value` per line, # comments\n"
	       "  --help                   this text\n"
	       "  --version                the version\n"
	       "Sizes accept a K, M or G suffix (powers of 1024).\n",
	       program, d.socket_path, d.socket_mode, d.shm_dir, d.max_frame_bytes,
	       d.max_inline_bytes, d.max_connections, d.max_sessions, d.max_tokens,
	       (unsigned long long)d.max_staging_bytes, (unsigned long long)d.idle_ttl_seconds,
	       d.offload_elements, d.metrics_listen);
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
	OPT_TTL, OPT_OFFLOAD, OPT_NO_ADOPT, OPT_LOG_LEVEL, OPT_METRICS, OPT_CONFIG, OPT_HELP,
	OPT_VERSION
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
	{ "idle-ttl", required_argument, NULL, OPT_TTL },
	{ "offload-elements", required_argument, NULL, OPT_OFFLOAD },
	{ "no-adopt", no_argument, NULL, OPT_NO_ADOPT },
	{ "log-level", required_argument, NULL, OPT_LOG_LEVEL },
	{ "metrics-listen", required_argument, NULL, OPT_METRICS },
	{ "config", required_argument, NULL, OPT_CONFIG },
	{ "help", no_argument, NULL, OPT_HELP },
	{ "version", no_argument, NULL, OPT_VERSION },
	{ NULL, 0, NULL, 0 }
};

static int option_apply(struct options *o, int id, const char *arg)
{
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
		o->memory_budget = value;
		return 0;
	case OPT_TTL:
		o->idle_ttl_seconds = value;
		return 0;
	case OPT_OFFLOAD:
		if (value > UINT32_MAX)
			return -ERANGE;
		o->offload_elements = (uint32_t)value;
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
				key, value, strerror(-rc));
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
			options_print_help(argv[0]);
			return 1;
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
				optarg ? optarg : "", strerror(-rc));
			return -EINVAL;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "zipcached: unexpected argument: %s (see --help)\n", argv[optind]);
		return -EINVAL;
	}
	/* Inline K/V must fit a frame with room for the rest of the message. */
	if (options->max_inline_bytes > options->max_frame_bytes - 1024)
		options->max_inline_bytes = options->max_frame_bytes - 1024;
	return 0;
}
