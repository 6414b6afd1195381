/*
 * zipcache-load: a load and soak test of a running zipcached.
 *
 *   zipcache-load --socket PATH [--clients N] [--layers L] [--seconds T] ...
 *
 * N client processes (fork, one connection each) play inference workers:
 * each opens its own session, prefills P tokens into every layer, then
 * runs decode steps (one token into every layer per step, one
 * update_and_fetch round trip per layer) until the session has had K
 * decode steps or is full, and then recycles it: closes it and opens a
 * new one (--recycle close), or trims it empty (--recycle trim), and
 * prefills again. Sessions are recycled so that the daemon's memory has
 * a steady state; memory that keeps growing after warm-up is a leak.
 *
 * The clients start out of phase: client i's first session is prefilled
 * with P + i*K/N tokens and runs the rest of a cycle, so from the first
 * second the sessions' sizes are spread evenly over a cycle, as on a
 * server that has been up for a while, and the daemon's total memory is
 * flat instead of a sawtooth every client draws in step.
 *
 * The parent measures, it sends no load: it samples the daemon's memory
 * (VmRSS, RssAnon, RssFile and RssShmem from /proc/PID/status, the
 * session files' bytes from the daemon's stats, open descriptors, mappings
 * of deleted files from /proc/PID) at the start, at the end of
 * the warm-up, every --sample-interval seconds, at the end, and once more
 * after every client has closed its sessions. The daemon's pid comes from
 * --daemon-pid or SO_PEERCRED on a connection to the socket.
 *
 * Memory is "total = RssAnon + session file bytes": the daemon's private
 * memory plus every byte its session files hold, by the daemon's own
 * accounting (the files' allocated blocks). VmRSS is reported too, but
 * not added: it holds the session pages the daemon touched through its
 * mapping (RssShmem on tmpfs, RssFile when --shm-dir is on a disk),
 * which the file bytes already count, besides the per-connection
 * staging buffers (RssShmem). Open descriptors and mappings of deleted
 * files (a session file unlinked but still mapped, a staging buffer not
 * let go) must come back to their start values once the clients are gone.
 * The report shows them; the exit status does not judge them, as a
 * daemon shared with other users has their connections too.
 *
 * Each client records the latency of every update_and_fetch round trip
 * in a log-spaced histogram (64 buckets per power of two: within 1.6 %)
 * in memory shared with the parent, separately for decode and prefill
 * calls and for the warm-up and the measured window; the report's
 * percentiles are those of the measured window. Every call's view is
 * checked: its token count, and, while the newest token still sits in
 * the exact fp16 residual, that token's bytes against what was sent.
 *
 * Bounded: the parent stops the clients after T seconds; a client then
 * finishes its step, closes its session and exits. One that has not
 * exited --grace seconds later is killed and counted as an error; the
 * sessions it left are closed by the parent. Every reply wait is bounded
 * by --timeout. Only the given Unix socket is used.
 *
 * Exit status: 0 when there were no errors, no session was left behind
 * and the memory drift from the end of the warm-up to the end is within
 * --max-drift percent; 1 otherwise; 2 for a usage error.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define LOAD_NAME "zipcache-load"

enum load_exit {
	LOAD_EXIT_PASS = 0,
	LOAD_EXIT_FAIL = 1,
	LOAD_EXIT_USAGE = 2
};

/* How a client process ends; anything else (a signal, another status) is
 * a crash and counts as an error. */
enum child_exit {
	CHILD_EXIT_OK = 0,
	CHILD_EXIT_GAVE_UP = 3     /* too many failures in a row; they were counted */
};

/* A misconfiguration (a max_tokens the daemon refuses) fails every cycle
 * the same way: after this many cycles in a row without one good call a
 * client stops, so the run ends at once instead of logging the same
 * failure for T seconds. */
#define CHILD_MAX_FAILED_CYCLES 5
#define CHILD_BACKOFF_MS 20

/* Messages kept per client; the report shows the first few overall. */
#define SLOT_MESSAGES 4
#define SLOT_MESSAGE_BYTES 240
#define REPORT_MESSAGES 8

/* The parent wakes at least this often, to reap clients that end early. */
#define PARENT_TICK_MS 100

/* How long the daemon gets to notice the clients' connections closed. */
#define SETTLE_MS 5000

/* ---- latency histogram --------------------------------------------------- */

/*
 * Nanoseconds in log-spaced buckets: values below 64 ns exactly, above
 * that 64 buckets per power of two (relative width 1/64), up to 2^36 ns
 * (69 s; above is the last bucket). Fixed-size, so it lives in the shared
 * mapping and needs no allocation in the client's hot loop.
 */
#define HIST_SUB_BITS 6
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_MAX_EXP 36
#define HIST_BUCKETS (HIST_SUB + (HIST_MAX_EXP - HIST_SUB_BITS) * HIST_SUB)

static unsigned hist_bucket(uint64_t ns)
{
	if (ns < HIST_SUB)
		return (unsigned)ns;
	unsigned exp = 63u - (unsigned)__builtin_clzll(ns);
	if (exp >= HIST_MAX_EXP)
		return HIST_BUCKETS - 1;
	return HIST_SUB + (exp - HIST_SUB_BITS) * HIST_SUB +
	       (unsigned)((ns >> (exp - HIST_SUB_BITS)) & (HIST_SUB - 1));
}

/* The middle of a bucket, in nanoseconds. */
static double hist_value(unsigned bucket)
{
	if (bucket < HIST_SUB)
		return bucket;
	unsigned exp = (bucket - HIST_SUB) / HIST_SUB + HIST_SUB_BITS;
	uint64_t sub = (bucket - HIST_SUB) % HIST_SUB;
	uint64_t width = 1ull << (exp - HIST_SUB_BITS);
	return (double)((1ull << exp) + sub * width) + (double)width / 2;
}

/* ---- memory shared between the parent and the clients --------------------- */

enum call_kind {
	KIND_DECODE = 0,
	KIND_PREFILL = 1,
	KINDS
};

enum run_phase {
	PHASE_WARMUP = 0,
	PHASE_MEASURED = 1,
	PHASES
};

/*
 * One client's record. The counters are written by that client alone and
 * read by the parent while it runs (relaxed atomics: each is a tally, no
 * two need to agree at an instant). The histograms and messages are read
 * only after the client is gone.
 */
struct slot {
	uint64_t calls[KINDS];          /* update_and_fetch round trips that succeeded */
	uint64_t decode_steps;          /* one token through every layer */
	uint64_t prefill_tokens;        /* per layer: a P-token prefill adds P */
	uint64_t opens, closes, trims;
	uint64_t errors;
	uint64_t max_ns[KINDS][PHASES];
	uint64_t sum_ns[KINDS][PHASES];
	uint64_t hist[KINDS][PHASES][HIST_BUCKETS];
	uint32_t messages;
	char message[SLOT_MESSAGES][SLOT_MESSAGE_BYTES];
};

struct shared {
	int stop;                       /* set by the parent: finish the step and exit */
	int phase;                      /* enum run_phase, set by the parent */
	struct slot slot[];
};

/* ---- configuration ------------------------------------------------------- */

enum recycle_mode {
	RECYCLE_CLOSE,
	RECYCLE_TRIM
};

struct load_config {
	const char *socket_path;
	uint32_t clients;
	uint32_t layers;
	uint32_t seconds;
	uint32_t warmup;
	bool warmup_set;
	uint32_t kv_heads;
	uint32_t head_dim;
	uint32_t prefill;
	uint32_t prefill_every;         /* decode steps per session cycle */
	uint32_t max_tokens;
	bool max_tokens_set;
	enum recycle_mode recycle;
	long daemon_pid;
	double max_drift;               /* percent */
	int timeout_ms;
	uint32_t grace;                 /* seconds */
	double sample_interval;         /* seconds */
	bool json;
};

/* The shape every client shares, derived once from the config. */
struct workload {
	uint32_t cycle_steps;           /* decode steps of a full cycle: min(K, M - P) */
	uint32_t pool_tokens;           /* tokens of K/V in the data pools */
	const uint16_t *keys, *values;  /* [pool_tokens][H][D] each, finite random fp16 */
	char name_prefix[32];           /* "zcload-PID-": every session of this run */
};

static void usage(FILE *stream)
{
	fprintf(stream,
		"usage: " LOAD_NAME " --socket PATH [options]\n"
		"\n"
		"Load and soak test of a running zipcached: N client processes, each with its\n"
		"own connection and session, prefill and then decode (one update_and_fetch\n"
		"per layer per step) for T seconds, recycling their sessions. Reports\n"
		"throughput, latency percentiles, errors and the daemon's memory.\n"
		"\n"
		"  --socket PATH          the daemon's Unix socket (required; nothing else is used)\n"
		"  --clients N            client processes (default 4)\n"
		"  --layers L             layers per session (default 32)\n"
		"  --seconds T            length of the run (default 10)\n"
		"  --warmup S             seconds before memory and latency count (default T/4)\n"
		"  --kv-heads H           KV heads (default 8)\n"
		"  --head-dim D           head dimension of K and V (default 128)\n"
		"  --prefill P            tokens of each prefill (default 256)\n"
		"  --prefill-every K      decode steps per session before it is recycled and\n"
		"                         prefilled again (default 512)\n"
		"  --max-tokens M         the sessions' max_tokens (default P + K); a full\n"
		"                         session is recycled early\n"
		"  --recycle close|trim   close and reopen the session, or trim it empty\n"
		"                         (default close)\n"
		"  --daemon-pid PID       the daemon's pid (default: SO_PEERCRED of the socket)\n"
		"  --max-drift PCT        allowed memory change from warm-up to end (default 5)\n"
		"  --timeout MS           connect and reply timeout of every call (default 10000)\n"
		"  --grace S              seconds the clients get to stop before they are\n"
		"                         killed (default 15)\n"
		"  --sample-interval S    seconds between memory samples (default 1)\n"
		"  --json                 one JSON object on stdout instead of the report\n"
		"  -h, --help             this text\n"
		"\n"
		"Exit status: 0 no errors, no session left behind, memory drift within\n"
		"--max-drift; 1 otherwise; 2 usage error.\n");
}

__attribute__((format(printf, 1, 2)))
static int usage_error(const char *format, ...)
{
	va_list arguments;

	va_start(arguments, format);
	fputs(LOAD_NAME ": ", stderr);
	vfprintf(stderr, format, arguments);
	fputs(" (see --help)\n", stderr);
	va_end(arguments);
	return -EINVAL;
}

/* A decimal integer in [min, max], nothing else. */
static int parse_uint(const char *flag, const char *text, uint64_t min, uint64_t max,
		      uint64_t *out)
{
	char *end;

	errno = 0;
	if (!text || !*text || *text == '-' || *text == '+')
		return usage_error("%s needs a number, got '%s'", flag, text ? text : "");
	unsigned long long value = strtoull(text, &end, 10);
	if (errno || *end || value < min || value > max)
		return usage_error("%s must be an integer in [%llu, %llu], got '%s'", flag,
				   (unsigned long long)min, (unsigned long long)max, text);
	*out = value;
	return 0;
}

static int parse_double(const char *flag, const char *text, double min, double max, double *out)
{
	char *end;

	errno = 0;
	double value = text && *text ? strtod(text, &end) : NAN;
	if (!text || !*text || errno || *end || !(value >= min && value <= max))
		return usage_error("%s must be a number in [%g, %g], got '%s'", flag, min, max,
				   text ? text : "");
	*out = value;
	return 0;
}

/* 0, 1 for --help (printed), or a negative code (message printed). */
static int parse_args(struct load_config *config, int argc, char **argv)
{
	*config = (struct load_config){
		.clients = 4,
		.layers = 32,
		.seconds = 10,
		.kv_heads = 8,
		.head_dim = 128,
		.prefill = 256,
		.prefill_every = 512,
		.recycle = RECYCLE_CLOSE,
		.max_drift = 5.0,
		.timeout_ms = 10000,
		.grace = 15,
		.sample_interval = 1.0,
	};

	for (int i = 1; i < argc; i++) {
		const char *flag = argv[i];
		const char *value = i + 1 < argc ? argv[i + 1] : NULL;
		uint64_t number = 0;
		int rc = 0;

		if (strcmp(flag, "-h") == 0 || strcmp(flag, "--help") == 0) {
			usage(stdout);
			return 1;
		}
		if (strcmp(flag, "--json") == 0) {
			config->json = true;
			continue;
		}
		if (strncmp(flag, "--", 2) != 0)
			return usage_error("unexpected argument '%s'", flag);
		if (!value)
			return usage_error("%s needs a value", flag);
		i++;
		if (strcmp(flag, "--socket") == 0) {
			if (strlen(value) >= sizeof(((struct sockaddr_un *)0)->sun_path) || !*value)
				return usage_error("--socket: path empty or too long for a Unix socket");
			config->socket_path = value;
		} else if (strcmp(flag, "--clients") == 0) {
			rc = parse_uint(flag, value, 1, 4096, &number);
			config->clients = (uint32_t)number;
		} else if (strcmp(flag, "--layers") == 0) {
			rc = parse_uint(flag, value, 1, 4096, &number);
			config->layers = (uint32_t)number;
		} else if (strcmp(flag, "--seconds") == 0) {
			rc = parse_uint(flag, value, 1, 7 * 86400, &number);
			config->seconds = (uint32_t)number;
		} else if (strcmp(flag, "--warmup") == 0) {
			rc = parse_uint(flag, value, 0, 7 * 86400, &number);
			config->warmup = (uint32_t)number;
			config->warmup_set = true;
		} else if (strcmp(flag, "--kv-heads") == 0) {
			rc = parse_uint(flag, value, 1, 1024, &number);
			config->kv_heads = (uint32_t)number;
		} else if (strcmp(flag, "--head-dim") == 0) {
			rc = parse_uint(flag, value, 1, ZC_MAX_HEAD_DIM, &number);
			config->head_dim = (uint32_t)number;
		} else if (strcmp(flag, "--prefill") == 0) {
			rc = parse_uint(flag, value, 1, ZC_MAX_BLOCK_TOKENS, &number);
			config->prefill = (uint32_t)number;
		} else if (strcmp(flag, "--prefill-every") == 0) {
			rc = parse_uint(flag, value, 1, ZC_MAX_BLOCK_TOKENS, &number);
			config->prefill_every = (uint32_t)number;
		} else if (strcmp(flag, "--max-tokens") == 0) {
			rc = parse_uint(flag, value, 2, UINT32_MAX, &number);
			config->max_tokens = (uint32_t)number;
			config->max_tokens_set = true;
		} else if (strcmp(flag, "--recycle") == 0) {
			if (strcmp(value, "close") == 0)
				config->recycle = RECYCLE_CLOSE;
			else if (strcmp(value, "trim") == 0)
				config->recycle = RECYCLE_TRIM;
			else
				return usage_error("--recycle is close or trim, got '%s'", value);
		} else if (strcmp(flag, "--daemon-pid") == 0) {
			rc = parse_uint(flag, value, 1, INT_MAX, &number);
			config->daemon_pid = (long)number;
		} else if (strcmp(flag, "--max-drift") == 0) {
			rc = parse_double(flag, value, 0, 1e6, &config->max_drift);
		} else if (strcmp(flag, "--timeout") == 0) {
			rc = parse_uint(flag, value, 1, 3600 * 1000, &number);
			config->timeout_ms = (int)number;
		} else if (strcmp(flag, "--grace") == 0) {
			rc = parse_uint(flag, value, 1, 3600, &number);
			config->grace = (uint32_t)number;
		} else if (strcmp(flag, "--sample-interval") == 0) {
			rc = parse_double(flag, value, 0.05, 3600, &config->sample_interval);
		} else {
			return usage_error("unknown option '%s'", flag);
		}
		if (rc < 0)
			return rc;
	}
	if (!config->socket_path)
		return usage_error("--socket PATH is required");
	if (!config->warmup_set)
		config->warmup = config->seconds / 4;
	if (config->warmup >= config->seconds)
		return usage_error("--warmup (%u s) must be shorter than --seconds (%u s)",
				   config->warmup, config->seconds);
	if (!config->max_tokens_set) {
		uint64_t tokens = (uint64_t)config->prefill + config->prefill_every;
		config->max_tokens = tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)tokens;
	}
	if (config->max_tokens <= config->prefill)
		return usage_error("--max-tokens (%u) must exceed --prefill (%u): a session needs "
				   "room to decode", config->max_tokens, config->prefill);
	return 0;
}

/* ---- time ---------------------------------------------------------------- */

static uint64_t now_ns(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
	struct timespec pause = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
	while (nanosleep(&pause, &pause) < 0 && errno == EINTR)
		;
}

/* ---- test data ----------------------------------------------------------- */

/* xorshift64*: fast, and the same data on every run. */
static uint64_t random_next(uint64_t *state)
{
	*state ^= *state >> 12;
	*state ^= *state << 25;
	*state ^= *state >> 27;
	return *state * 0x2545F4914F6CDD1Dull;
}

/* Roughly normal around 0 (Irwin-Hall of four uniforms), a few channels
 * offset as real keys have them, so saliency routing has work to do. */
static uint16_t *pool_make(size_t tokens, uint32_t heads, uint32_t dim, uint64_t seed)
{
	size_t count = tokens * heads * dim;
	uint16_t *pool = malloc(count * sizeof(*pool));
	uint64_t state = seed | 1;

	if (!pool)
		return NULL;
	for (size_t i = 0; i < count; i++) {
		double sum = 0;
		for (int k = 0; k < 4; k++)
			sum += (double)(random_next(&state) >> 11) * 0x1.0p-53;
		float value = (float)((sum - 2.0) * 1.7);
		if (i % dim < 4)
			value += 8.0f;
		pool[i] = zc_float_to_fp16(value);
	}
	return pool;
}

/* ---- the client process -------------------------------------------------- */

struct child {
	unsigned index;
	const struct load_config *config;
	const struct workload *work;
	struct shared *shared;
	struct slot *slot;
	zc_client *client;
	zc_session *session;
	uint32_t tokens;                /* of every layer, at step boundaries */
	uint64_t cycle;
	uint64_t decode_counter;        /* picks each decode step's data */
	bool progressed;                /* a call succeeded since the last failure */
};

static void tally(uint64_t *counter, uint64_t amount)
{
	__atomic_fetch_add(counter, amount, __ATOMIC_RELAXED);
}

static bool child_stopping(const struct child *child)
{
	return __atomic_load_n(&child->shared->stop, __ATOMIC_ACQUIRE) != 0;
}

__attribute__((format(printf, 2, 3)))
static void child_error(struct child *child, const char *format, ...)
{
	struct slot *slot = child->slot;
	va_list arguments;

	tally(&slot->errors, 1);
	/* The first few, and in the last place always the latest: a client
	 * that gives up says why in its last message. */
	unsigned at = slot->messages < SLOT_MESSAGES ? slot->messages : SLOT_MESSAGES - 1;
	char *message = slot->message[at];
	int used = snprintf(message, SLOT_MESSAGE_BYTES, "client %u: ", child->index);
	va_start(arguments, format);
	vsnprintf(message + used, SLOT_MESSAGE_BYTES - (size_t)used, format, arguments);
	va_end(arguments);
	if (slot->messages < SLOT_MESSAGES)
		slot->messages++;
}

#define NO_LAYER UINT32_MAX

/* A failed call: the operation, where the session was, the code's name
 * and the daemon's sentence. */
static void child_call_error(struct child *child, const char *what, uint32_t layer, int rc)
{
	const char *detail = child->client ? zc_client_last_error(child->client) : "";
	char where[64];

	if (!detail || !*detail)
		detail = zc_strerror(rc);
	if (layer == NO_LAYER)
		snprintf(where, sizeof(where), "session cycle %" PRIu64, child->cycle);
	else
		snprintf(where, sizeof(where), "session cycle %" PRIu64 ", layer %u, %u tokens",
			 child->cycle, layer, child->tokens);
	child_error(child, "%s (%s): %s: %s", what, where, zc_error_name(rc), detail);
}

/* Codes after which the connection cannot be trusted for another request. */
static bool connection_broken(int rc)
{
	return rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN || rc == -ETIMEDOUT ||
	       rc == ZC_EPROTOCOL || rc == ZC_ERESTARTED;
}

/* Drops the session after a failure; dials again if the connection went. */
static void child_abandon(struct child *child, int rc)
{
	if (connection_broken(rc)) {
		zc_session_release(child->session);
		child->session = NULL;
		int again = zc_client_reconnect(child->client);
		if (again < 0 && again != ZC_ERESTARTED)
			child_call_error(child, "reconnect", NO_LAYER, again);
		return;
	}
	if (child->session) {
		int closed = zc_session_close(child->session);
		child->session = NULL;
		if (closed < 0) {
			child_call_error(child, "close after a failure", NO_LAYER, closed);
			if (connection_broken(closed))
				zc_client_reconnect(child->client);
		} else {
			tally(&child->slot->closes, 1);
		}
	}
}

static void record_latency(struct child *child, enum call_kind kind, uint64_t ns)
{
	struct slot *slot = child->slot;
	int phase = __atomic_load_n(&child->shared->phase, __ATOMIC_RELAXED);

	slot->hist[kind][phase][hist_bucket(ns)]++;
	slot->sum_ns[kind][phase] += ns;
	if (ns > slot->max_ns[kind][phase])
		slot->max_ns[kind][phase] = ns;
	tally(&slot->calls[kind], 1);
}

/*
 * One update_and_fetch of `tokens` tokens into `layer`, timed and checked:
 * the view must hold every token so far, and a token that is still in the
 * exact fp16 residual must read back bit for bit as sent. Returns 0 or the
 * failed call's code (-EIO for a bad view), recorded as an error.
 */
static int child_update(struct child *child, enum call_kind kind, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values)
{
	const struct load_config *config = child->config;
	uint32_t dim = config->head_dim;
	zc_layer_stats stats;
	zc_view view;

	uint64_t start = now_ns();
	int rc = zc_update_and_fetch(child->session, layer, tokens, keys, values, &view, &stats);
	uint64_t elapsed = now_ns() - start;
	if (rc < 0) {
		child_call_error(child, kind == KIND_DECODE ? "decode update_and_fetch" :
							      "prefill update_and_fetch", layer, rc);
		return rc;
	}
	record_latency(child, kind, elapsed);
	child->progressed = true;

	uint32_t expected = child->tokens + tokens;
	if (view.tokens != expected) {
		child_error(child, "layer %u: view holds %u tokens after update_and_fetch, expected %u",
			    layer, view.tokens, expected);
		return -EIO;
	}
	if (stats.residual_tokens == 0)
		return 0;
	/* The newest token of every head, keys and values. */
	for (uint32_t head = 0; head < config->kv_heads; head++) {
		size_t sent = ((size_t)head * tokens + tokens - 1) * dim;
		const uint16_t *key = view.keys + head * view.key_strides.head +
				      (size_t)(expected - 1) * view.key_strides.token;
		const uint16_t *value = view.values + head * view.value_strides.head +
					(size_t)(expected - 1) * view.value_strides.token;
		if (memcmp(key, keys + sent, dim * sizeof(*key)) != 0 ||
		    memcmp(value, values + sent, dim * sizeof(*value)) != 0) {
			child_error(child, "layer %u head %u: token %u in the view differs from the "
				    "one sent (it is in the exact residual, %u tokens)",
				    layer, head, expected - 1, stats.residual_tokens);
			return -EIO;
		}
	}
	return 0;
}

static int child_open(struct child *child)
{
	const struct load_config *config = child->config;
	zc_session_config session_config;
	char name[64];

	snprintf(name, sizeof(name), "%s%u-%" PRIu64, child->work->name_prefix, child->index,
		 child->cycle);
	zc_session_config_default(&session_config);
	session_config.name = name;
	session_config.layers = config->layers;
	session_config.batch = 1;
	session_config.kv_heads = config->kv_heads;
	session_config.head_dim_k = config->head_dim;
	session_config.head_dim_v = config->head_dim;
	session_config.max_tokens = config->max_tokens;
	child->tokens = 0;
	int rc = zc_session_open(child->client, &session_config, &child->session);
	if (rc < 0) {
		child->session = NULL;
		child_call_error(child, "open", NO_LAYER, rc);
		return rc;
	}
	tally(&child->slot->opens, 1);
	return 0;
}

/* Prefills every layer with the pool's first `tokens` tokens; 1 when the
 * parent said stop in the middle (a loaded daemon may take seconds per
 * layer, and the clients must stop within the grace period). */
static int child_prefill(struct child *child, uint32_t tokens)
{
	const struct workload *work = child->work;

	for (uint32_t layer = 0; layer < child->config->layers; layer++) {
		if (child_stopping(child))
			return 1;
		int rc = child_update(child, KIND_PREFILL, layer, tokens, work->keys, work->values);
		if (rc < 0)
			return rc;
	}
	child->tokens += tokens;
	tally(&child->slot->prefill_tokens, tokens);
	return 0;
}

/* One decode step: one token into every layer. */
static int child_step(struct child *child)
{
	const struct load_config *config = child->config;
	const struct workload *work = child->work;
	size_t token_elements = (size_t)config->kv_heads * config->head_dim;
	size_t at = (size_t)(child->decode_counter++ % work->pool_tokens) * token_elements;

	for (uint32_t layer = 0; layer < config->layers; layer++) {
		int rc = child_update(child, KIND_DECODE, layer, 1, work->keys + at, work->values + at);
		if (rc < 0)
			return rc;
	}
	child->tokens++;
	tally(&child->slot->decode_steps, 1);
	return 0;
}

/* Ends a cycle: closes the session, or trims it empty for the next one. */
static int child_recycle(struct child *child)
{
	if (child->config->recycle == RECYCLE_TRIM && !child_stopping(child)) {
		uint32_t trimmed = 0;
		int rc = zc_session_trim(child->session, child->tokens, &trimmed);
		if (rc < 0) {
			child_call_error(child, "trim", NO_LAYER, rc);
			return rc;
		}
		if (trimmed != child->tokens) {
			child_error(child, "trim of %u tokens dropped %u", child->tokens, trimmed);
			return -EIO;
		}
		child->tokens = 0;
		tally(&child->slot->trims, 1);
		return 0;
	}
	int rc = zc_session_close(child->session);
	child->session = NULL;
	if (rc < 0) {
		child_call_error(child, "close", NO_LAYER, rc);
		return rc;
	}
	tally(&child->slot->closes, 1);
	return 0;
}

/*
 * Cycles until the parent says stop: (open,) prefill, decode, recycle. The
 * first cycle starts further along (see the top of the file). A failure
 * abandons the cycle and the next one starts afresh; CHILD_MAX_FAILED_CYCLES
 * failures in a row with no good call in between end the client.
 */
static int child_run(struct child *child)
{
	const struct load_config *config = child->config;
	const struct workload *work = child->work;
	uint32_t offset = (uint32_t)((uint64_t)child->index * work->cycle_steps / config->clients);
	unsigned failed_cycles = 0;

	while (!child_stopping(child)) {
		uint32_t prefill = config->prefill + (child->cycle == 0 ? offset : 0);
		uint32_t steps = work->cycle_steps - (child->cycle == 0 ? offset : 0);
		int rc = 0;

		child->progressed = false;
		if (!child->session)
			rc = child_open(child);
		if (rc == 0)
			rc = child_prefill(child, prefill);
		for (uint32_t step = 0; rc == 0 && step < steps && !child_stopping(child); step++)
			rc = child_step(child);
		if (rc >= 0)
			rc = child_recycle(child);
		child->cycle++;
		if (rc == 0) {
			failed_cycles = 0;
			continue;
		}
		child_abandon(child, rc);
		failed_cycles = child->progressed ? 1 : failed_cycles + 1;
		if (failed_cycles >= CHILD_MAX_FAILED_CYCLES) {
			child_error(child, "stopped after %u failed session cycles in a row",
				    failed_cycles);
			return CHILD_EXIT_GAVE_UP;
		}
		sleep_ns((uint64_t)CHILD_BACKOFF_MS * 1000000u);
	}
	if (child->session) {
		int rc = zc_session_close(child->session);
		child->session = NULL;
		if (rc < 0)
			child_call_error(child, "close at the end", NO_LAYER, rc);
		else
			tally(&child->slot->closes, 1);
	}
	return CHILD_EXIT_OK;
}

static void child_main(struct child *child, pid_t parent)
{
	/* The parent coordinates Ctrl-C and SIGTERM (it tells us to stop),
	 * and we must not outlive it whatever way it ends. */
	signal(SIGINT, SIG_IGN);
	signal(SIGTERM, SIG_IGN);
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(CHILD_EXIT_GAVE_UP);
	int rc = zc_client_connect(child->config->socket_path, child->config->timeout_ms,
				   &child->client);
	if (rc < 0) {
		child->client = NULL;
		child_call_error(child, "connect", NO_LAYER, rc);
		_exit(CHILD_EXIT_GAVE_UP);
	}
	int status = child_run(child);
	zc_client_close(child->client);
	_exit(status);
}

/* ---- the daemon's memory ------------------------------------------------- */

struct memory_sample {
	double t;                       /* seconds since the clients started */
	bool have_proc;                 /* /proc/PID was readable */
	uint64_t vm_rss, rss_anon, rss_file, rss_shmem;
	int fds;                        /* open descriptors, -1 unknown */
	int deleted_mappings;           /* mappings of unlinked files, -1 unknown */
	bool have_stats;
	uint64_t shm_bytes;             /* session files, from the daemon's stats */
	uint32_t sessions, connections;
	uint64_t requests, request_errors;
	uint64_t total;                 /* rss_anon + shm_bytes */
};

/* The pid of the process that accepted a connection to the socket. */
static long peer_pid(const char *socket_path)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	struct ucred credentials;
	socklen_t length = sizeof(credentials);
	long pid = -1;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -1;
	snprintf(address.sun_path, sizeof(address.sun_path), "%s", socket_path);
	if (connect(fd, (const struct sockaddr *)&address, sizeof(address)) == 0 &&
	    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0 &&
	    credentials.pid > 0)
		pid = credentials.pid;
	close(fd);
	return pid;
}

/* Reads the "Name:   N kB" lines we need from /proc/PID/status. */
static bool proc_status(long pid, struct memory_sample *sample)
{
	char path[64], line[256];
	int found = 0;

	snprintf(path, sizeof(path), "/proc/%ld/status", pid);
	FILE *file = fopen(path, "re");
	if (!file)
		return false;
	while (fgets(line, sizeof(line), file)) {
		static const struct {
			const char *name;
			size_t offset;
		} fields[] = {
			{ "VmRSS:", offsetof(struct memory_sample, vm_rss) },
			{ "RssAnon:", offsetof(struct memory_sample, rss_anon) },
			{ "RssFile:", offsetof(struct memory_sample, rss_file) },
			{ "RssShmem:", offsetof(struct memory_sample, rss_shmem) },
		};
		for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
			size_t length = strlen(fields[i].name);
			unsigned long long kib;
			if (strncmp(line, fields[i].name, length) == 0 &&
			    sscanf(line + length, "%llu", &kib) == 1) {
				*(uint64_t *)((char *)sample + fields[i].offset) = kib * 1024;
				found++;
			}
		}
	}
	fclose(file);
	return found == 4;
}

static int proc_count_fds(long pid)
{
	char path[64];
	int count = 0;

	snprintf(path, sizeof(path), "/proc/%ld/fd", pid);
	DIR *dir = opendir(path);
	if (!dir)
		return -1;
	for (struct dirent *entry; (entry = readdir(dir)) != NULL;)
		if (entry->d_name[0] != '.')
			count++;
	closedir(dir);
	return count;
}

/* Mappings of files that no longer exist: a session file unlinked but
 * still mapped is memory nobody can free (staging memfds show up too).
 * The daemon's own executable is not counted: it reads "(deleted)" as
 * soon as someone rebuilds it under the running daemon. */
static int proc_count_deleted_mappings(long pid)
{
	char path[64], line[4352], exe[PATH_MAX];
	int count = 0;

	snprintf(path, sizeof(path), "/proc/%ld/exe", pid);
	ssize_t exe_length = readlink(path, exe, sizeof(exe) - 1);
	exe[exe_length > 0 ? exe_length : 0] = '\0';
	snprintf(path, sizeof(path), "/proc/%ld/maps", pid);
	FILE *file = fopen(path, "re");
	if (!file)
		return -1;
	while (fgets(line, sizeof(line), file)) {
		char *deleted = strstr(line, " (deleted)");
		char *name = strchr(line, '/');
		if (!deleted)
			continue;
		/* exe already ends in " (deleted)" when the file is gone. */
		if (name && exe[0] && strncmp(name, exe, strlen(exe)) == 0)
			continue;
		count++;
	}
	fclose(file);
	return count;
}

static void memory_sample_take(zc_client *client, long pid, double t, struct memory_sample *sample)
{
	zc_server_stats stats;

	memset(sample, 0, sizeof(*sample));
	sample->t = t;
	sample->fds = -1;
	sample->deleted_mappings = -1;
	if (pid > 0) {
		sample->have_proc = proc_status(pid, sample);
		sample->fds = proc_count_fds(pid);
		sample->deleted_mappings = proc_count_deleted_mappings(pid);
	}
	if (client && zc_client_stats(client, &stats) == 0) {
		sample->have_stats = true;
		sample->shm_bytes = stats.memory_used_bytes;
		sample->sessions = stats.sessions;
		sample->connections = stats.connections;
		sample->requests = stats.requests;
		sample->request_errors = stats.request_errors;
	}
	sample->total = sample->shm_bytes + (sample->have_proc ? sample->rss_anon : 0);
}

/* ---- the parent ---------------------------------------------------------- */

static volatile sig_atomic_t interrupted;

static void on_interrupt(int signal_number)
{
	(void)signal_number;
	interrupted = 1;
}

/* Sums of the live counters of every slot. */
struct totals {
	uint64_t calls[KINDS];
	uint64_t decode_steps, prefill_tokens;
	uint64_t opens, closes, trims, errors;
};

static void totals_read(const struct shared *shared, uint32_t clients, struct totals *totals)
{
	memset(totals, 0, sizeof(*totals));
	for (uint32_t i = 0; i < clients; i++) {
		const struct slot *slot = &shared->slot[i];
		for (int kind = 0; kind < KINDS; kind++)
			totals->calls[kind] += __atomic_load_n(&slot->calls[kind], __ATOMIC_RELAXED);
		totals->decode_steps += __atomic_load_n(&slot->decode_steps, __ATOMIC_RELAXED);
		totals->prefill_tokens += __atomic_load_n(&slot->prefill_tokens, __ATOMIC_RELAXED);
		totals->opens += __atomic_load_n(&slot->opens, __ATOMIC_RELAXED);
		totals->closes += __atomic_load_n(&slot->closes, __ATOMIC_RELAXED);
		totals->trims += __atomic_load_n(&slot->trims, __ATOMIC_RELAXED);
		totals->errors += __atomic_load_n(&slot->errors, __ATOMIC_RELAXED);
	}
}

struct latency {
	uint64_t count;
	double p50_us, p99_us, p999_us, max_us, mean_us;
};

/* Percentiles of one kind of call in one phase, over every client. */
static void latency_compute(const struct shared *shared, uint32_t clients, enum call_kind kind,
			    enum run_phase phase, struct latency *out)
{
	static uint64_t merged[HIST_BUCKETS];
	uint64_t sum = 0, max = 0;

	memset(out, 0, sizeof(*out));
	memset(merged, 0, sizeof(merged));
	for (uint32_t i = 0; i < clients; i++) {
		const struct slot *slot = &shared->slot[i];
		for (unsigned b = 0; b < HIST_BUCKETS; b++) {
			merged[b] += slot->hist[kind][phase][b];
			out->count += slot->hist[kind][phase][b];
		}
		sum += slot->sum_ns[kind][phase];
		if (slot->max_ns[kind][phase] > max)
			max = slot->max_ns[kind][phase];
	}
	if (out->count == 0)
		return;
	const double quantiles[3] = { 0.50, 0.99, 0.999 };
	double *targets[3] = { &out->p50_us, &out->p99_us, &out->p999_us };
	for (int q = 0; q < 3; q++) {
		/* The smallest value with at least this share of calls at or below it. */
		uint64_t rank = (uint64_t)ceil(quantiles[q] * (double)out->count);
		uint64_t seen = 0;
		if (rank == 0)
			rank = 1;
		for (unsigned b = 0; b < HIST_BUCKETS; b++) {
			seen += merged[b];
			if (seen >= rank) {
				double value = hist_value(b);
				/* A bucket's middle may lie past the largest call. */
				*targets[q] = (value < (double)max ? value : (double)max) / 1000.0;
				break;
			}
		}
	}
	out->max_us = (double)max / 1000.0;
	out->mean_us = (double)sum / (double)out->count / 1000.0;
}

struct run {
	struct load_config config;
	struct workload work;
	zc_client *client;              /* the parent's own, for stats only */
	zc_server_info server;
	long daemon_pid;
	const char *pid_source;
	struct shared *shared;
	size_t shared_bytes;
	pid_t *pids;                    /* 0 once reaped */
	uint32_t running;
	uint64_t start_ns;
	/* Samples: [0] start, then after warm-up, periodic ones, end; `after`
	 * is taken once the clients are gone. */
	struct memory_sample *samples;
	size_t n_samples, samples_capacity;
	struct memory_sample start, warm, end, after;
	bool warm_taken;
	double warm_t, end_t;
	struct totals at_warm, at_end;
	uint64_t parent_errors;         /* crashes, hangs, leftovers, failed stats */
	char parent_message[REPORT_MESSAGES][SLOT_MESSAGE_BYTES];
	unsigned parent_messages;
	uint32_t hung, crashed, gave_up;
	uint32_t leftover_sessions;
	bool stopped_early;
};

__attribute__((format(printf, 2, 3)))
static void run_error(struct run *run, const char *format, ...)
{
	va_list arguments;

	run->parent_errors++;
	if (run->parent_messages >= REPORT_MESSAGES)
		return;
	va_start(arguments, format);
	vsnprintf(run->parent_message[run->parent_messages++], SLOT_MESSAGE_BYTES, format, arguments);
	va_end(arguments);
}

static double run_elapsed(const struct run *run)
{
	return (double)(now_ns() - run->start_ns) / 1e9;
}

static int run_sample(struct run *run, double t, struct memory_sample *out)
{
	memory_sample_take(run->client, run->daemon_pid, t, out);
	if (!out->have_stats)
		run_error(run, "stats request to the daemon failed at %.1f s: %s", t,
			  zc_client_last_error(run->client));
	if (run->n_samples == run->samples_capacity) {
		size_t capacity = run->samples_capacity * 2 + 64;
		struct memory_sample *grown = realloc(run->samples, capacity * sizeof(*grown));
		if (!grown)
			return -ENOMEM;
		run->samples = grown;
		run->samples_capacity = capacity;
	}
	run->samples[run->n_samples++] = *out;
	return 0;
}

/* Notes how a reaped client ended. */
static void run_reaped(struct run *run, uint32_t index, int status)
{
	run->pids[index] = 0;
	run->running--;
	if (WIFEXITED(status) && WEXITSTATUS(status) == CHILD_EXIT_OK)
		return;
	if (WIFEXITED(status) && WEXITSTATUS(status) == CHILD_EXIT_GAVE_UP) {
		run->gave_up++;
		return;
	}
	run->crashed++;
	if (WIFSIGNALED(status))
		run_error(run, "client %u was killed by signal %d (%s)", index, WTERMSIG(status),
			  strsignal(WTERMSIG(status)));
	else
		run_error(run, "client %u exited with status %d", index, WEXITSTATUS(status));
}

/* Reaps the clients that have ended, without waiting for the others. */
static void run_reap(struct run *run)
{
	for (uint32_t i = 0; i < run->config.clients; i++) {
		int status;
		if (run->pids[i] > 0 && waitpid(run->pids[i], &status, WNOHANG) == run->pids[i])
			run_reaped(run, i, status);
	}
}

static int run_fork_clients(struct run *run)
{
	pid_t parent = getpid();

	fflush(NULL);
	for (uint32_t i = 0; i < run->config.clients; i++) {
		pid_t pid = fork();
		if (pid < 0) {
			int rc = -errno;
			run_error(run, "fork of client %u: %s", i, strerror(errno));
			return rc;
		}
		if (pid == 0) {
			struct child child = {
				.index = i,
				.config = &run->config,
				.work = &run->work,
				.shared = run->shared,
				.slot = &run->shared->slot[i],
			};
			child_main(&child, parent);
		}
		run->pids[i] = pid;
		run->running++;
	}
	return 0;
}

static void run_progress(const struct run *run, double t, const struct memory_sample *sample)
{
	struct totals now;

	if (run->config.json || !isatty(STDERR_FILENO))
		return;
	totals_read(run->shared, run->config.clients, &now);
	fprintf(stderr, LOAD_NAME ": %5.1f s  %" PRIu64 " calls  %" PRIu64 " decode steps  "
		"%" PRIu64 " errors  memory %.1f MiB  %u sessions%s\n",
		t, now.calls[KIND_DECODE] + now.calls[KIND_PREFILL], now.decode_steps, now.errors,
		(double)sample->total / 1048576.0, sample->sessions,
		run->warm_taken ? "" : "  (warm-up)");
}

/* The measured part of the run: from the clients' start until T seconds,
 * or until every client has ended. */
static int run_clients(struct run *run)
{
	const struct load_config *config = &run->config;
	uint64_t second = 1000000000u;
	uint64_t warm_at = (uint64_t)config->warmup * second;
	uint64_t end_at = (uint64_t)config->seconds * second;
	uint64_t interval = (uint64_t)(config->sample_interval * 1e9);
	uint64_t next_sample = interval;
	int rc;

	run->start_ns = now_ns();
	rc = run_fork_clients(run);
	if (rc < 0) {
		__atomic_store_n(&run->shared->stop, 1, __ATOMIC_RELEASE);
		return rc;
	}
	for (;;) {
		uint64_t elapsed = now_ns() - run->start_ns;
		run_reap(run);
		if (elapsed >= end_at || interrupted || run->running == 0) {
			run->stopped_early = elapsed < end_at;
			break;
		}
		if (!run->warm_taken && elapsed >= warm_at) {
			/* The counters first: the window's calls are those after this. */
			__atomic_store_n(&run->shared->phase, PHASE_MEASURED, __ATOMIC_RELAXED);
			totals_read(run->shared, config->clients, &run->at_warm);
			run->warm_t = (double)elapsed / 1e9;
			rc = run_sample(run, run->warm_t, &run->warm);
			if (rc < 0)
				return rc;
			run->warm_taken = true;
			run_progress(run, run->warm_t, &run->warm);
		}
		if (elapsed >= next_sample) {
			struct memory_sample sample;
			rc = run_sample(run, (double)elapsed / 1e9, &sample);
			if (rc < 0)
				return rc;
			run_progress(run, sample.t, &sample);
			while (next_sample <= elapsed)
				next_sample += interval;
		}
		uint64_t wake = next_sample < end_at ? next_sample : end_at;
		if (!run->warm_taken && warm_at < wake)
			wake = warm_at;
		uint64_t pause = wake > elapsed ? wake - elapsed : 0;
		if (pause > (uint64_t)PARENT_TICK_MS * 1000000u)
			pause = (uint64_t)PARENT_TICK_MS * 1000000u;
		sleep_ns(pause);
	}
	/* The end sample while the sessions are still open: the steady state. */
	totals_read(run->shared, config->clients, &run->at_end);
	run->end_t = run_elapsed(run);
	return run_sample(run, run->end_t, &run->end);
}

/* Tells the clients to stop and waits --grace seconds; kills the rest. */
static void run_stop_clients(struct run *run)
{
	uint64_t deadline = now_ns() + (uint64_t)run->config.grace * 1000000000u;

	__atomic_store_n(&run->shared->stop, 1, __ATOMIC_RELEASE);
	while (run->running > 0 && now_ns() < deadline) {
		run_reap(run);
		if (run->running > 0)
			sleep_ns(10 * 1000000u);
	}
	for (uint32_t i = 0; i < run->config.clients; i++) {
		if (run->pids[i] <= 0)
			continue;
		run->hung++;
		run_error(run, "client %u did not stop within %u s of the end; killed", i,
			  run->config.grace);
		kill(run->pids[i], SIGKILL);
	}
	/* SIGKILL cannot be ignored: these waits end. */
	for (uint32_t i = 0; i < run->config.clients; i++) {
		int status;
		if (run->pids[i] > 0 && waitpid(run->pids[i], &status, 0) == run->pids[i]) {
			run->pids[i] = 0;
			run->running--;
		}
	}
}

/* Closes a listed session by id: no handle, so a session that went
 * meanwhile is simply not found. */
static int run_close_listed(struct run *run, const zc_session_info *info)
{
	int rc = zc_client_close_session(run->client, info->id);
	return rc == ZC_ENOTFOUND ? 0 : rc;
}

/*
 * Sessions of this run the daemon still has after every client ended.
 * Clients that exited normally closed theirs, so any such session is a
 * leak (or a close the daemon acknowledged but did not do); those of
 * killed clients are expected. Either way they are closed here, so the
 * tool leaves nothing behind.
 */
static void run_check_leftovers(struct run *run)
{
	size_t capacity = 256, count = 0;
	zc_session_info *sessions = NULL;
	int rc;

	for (;;) {
		zc_session_info *grown = realloc(sessions, capacity * sizeof(*sessions));
		if (!grown) {
			run_error(run, "listing sessions: out of memory");
			free(sessions);
			return;
		}
		sessions = grown;
		rc = zc_client_list_sessions(run->client, sessions, capacity, &count);
		if (rc < 0 || count <= capacity)
			break;
		capacity = count + 64;
	}
	if (rc < 0) {
		run_error(run, "listing sessions after the run: %s: %s", zc_error_name(rc),
			  zc_client_last_error(run->client));
		free(sessions);
		return;
	}
	size_t prefix = strlen(run->work.name_prefix);
	for (size_t i = 0; i < count; i++) {
		if (strncmp(sessions[i].name, run->work.name_prefix, prefix) != 0)
			continue;
		run->leftover_sessions++;
		if (run->hung == 0 && run->crashed == 0)
			run_error(run, "session '%s' (id %" PRIu64 ", %u tokens) is still open after its "
				  "client closed it and exited", sessions[i].name, sessions[i].id,
				  sessions[i].max_layer_tokens);
		rc = run_close_listed(run, &sessions[i]);
		if (rc < 0)
			run_error(run, "closing leftover session '%s': %s: %s", sessions[i].name,
				  zc_error_name(rc), zc_client_last_error(run->client));
	}
	free(sessions);
}

/*
 * The daemon notices the clients' connections close on its own time: wait
 * (bounded) until it counts no more connections than at the start, so
 * that the "after" sample shows what stays, not what is still closing.
 */
static void run_settle(struct run *run)
{
	uint64_t deadline = now_ns() + (uint64_t)SETTLE_MS * 1000000u;
	zc_server_stats stats;

	while (now_ns() < deadline && zc_client_stats(run->client, &stats) == 0 &&
	       stats.connections > run->start.connections)
		sleep_ns(10 * 1000000u);
}

/* ---- the report ---------------------------------------------------------- */

struct summary {
	double window_s;
	uint64_t window_calls, window_decode_steps, window_prefill_tokens;
	double calls_per_s, decode_tokens_per_s, prefill_tokens_per_s;
	struct latency decode, prefill;
	uint64_t errors;
	bool drift_known;
	double drift_pct, band_low_pct, band_high_pct;
	size_t band_samples;
	uint64_t daemon_request_errors;
	bool pass;
};

static void summarize(const struct run *run, struct summary *s)
{
	const struct load_config *config = &run->config;
	struct totals final;

	memset(s, 0, sizeof(*s));
	totals_read(run->shared, config->clients, &final);
	s->errors = final.errors + run->parent_errors;
	if (run->warm_taken) {
		s->window_s = run->end_t - run->warm_t;
		s->window_calls = run->at_end.calls[KIND_DECODE] + run->at_end.calls[KIND_PREFILL] -
				  run->at_warm.calls[KIND_DECODE] - run->at_warm.calls[KIND_PREFILL];
		s->window_decode_steps = run->at_end.decode_steps - run->at_warm.decode_steps;
		s->window_prefill_tokens = run->at_end.prefill_tokens - run->at_warm.prefill_tokens;
	} else {
		/* Ended before the warm-up did: the whole run is all there is. */
		s->window_s = run->end_t;
		s->window_calls = run->at_end.calls[KIND_DECODE] + run->at_end.calls[KIND_PREFILL];
		s->window_decode_steps = run->at_end.decode_steps;
		s->window_prefill_tokens = run->at_end.prefill_tokens;
	}
	if (s->window_s > 0) {
		s->calls_per_s = (double)s->window_calls / s->window_s;
		s->decode_tokens_per_s = (double)s->window_decode_steps / s->window_s;
		s->prefill_tokens_per_s = (double)s->window_prefill_tokens / s->window_s;
	}
	enum run_phase phase = run->warm_taken ? PHASE_MEASURED : PHASE_WARMUP;
	latency_compute(run->shared, config->clients, KIND_DECODE, phase, &s->decode);
	latency_compute(run->shared, config->clients, KIND_PREFILL, phase, &s->prefill);

	if (run->warm_taken && run->warm.total > 0 && run->end.have_stats) {
		double base = (double)run->warm.total;
		s->drift_known = true;
		s->drift_pct = ((double)run->end.total - base) / base * 100.0;
		s->band_low_pct = s->band_high_pct = 0;
		for (size_t i = 0; i < run->n_samples; i++) {
			const struct memory_sample *m = &run->samples[i];
			if (m->t < run->warm_t || m->t > run->end_t || !m->have_stats)
				continue;
			double pct = ((double)m->total - base) / base * 100.0;
			s->band_samples++;
			if (pct < s->band_low_pct)
				s->band_low_pct = pct;
			if (pct > s->band_high_pct)
				s->band_high_pct = pct;
		}
	}
	if (run->start.have_stats && run->end.have_stats)
		s->daemon_request_errors = run->end.request_errors - run->start.request_errors;
	/* An interrupted run measured less than was asked: it cannot pass. */
	s->pass = s->errors == 0 && run->leftover_sessions == 0 && s->drift_known &&
		  fabs(s->drift_pct) <= config->max_drift && !interrupted;
}

/* The first messages overall: the parent's, then each client's in turn. */
static size_t collect_messages(const struct run *run, const char **out, size_t capacity)
{
	size_t n = 0;

	for (unsigned i = 0; i < run->parent_messages && n < capacity; i++)
		out[n++] = run->parent_message[i];
	for (unsigned round = 0; round < SLOT_MESSAGES && n < capacity; round++)
		for (uint32_t c = 0; c < run->config.clients && n < capacity; c++)
			if (run->shared->slot[c].messages > round)
				out[n++] = run->shared->slot[c].message[round];
	return n;
}

static const char *recycle_name(enum recycle_mode mode)
{
	return mode == RECYCLE_TRIM ? "trim" : "close";
}

static double mib(uint64_t bytes)
{
	return (double)bytes / 1048576.0;
}

static void print_memory_row(const char *label, const struct memory_sample *const *columns,
			     size_t offset, bool need_proc)
{
	printf("  %-34s", label);
	for (int i = 0; i < 4; i++) {
		const struct memory_sample *m = columns[i];
		if (!m || (need_proc && !m->have_proc) || (!need_proc && !m->have_stats))
			printf(" %14s", "-");
		else
			printf(" %10.1f MiB", mib(*(const uint64_t *)((const char *)m + offset)));
	}
	printf("\n");
}

static void print_count_row(const char *label, const struct memory_sample *const *columns,
			    int which)
{
	printf("  %-34s", label);
	for (int i = 0; i < 4; i++) {
		const struct memory_sample *m = columns[i];
		long value = -1;
		if (m && which == 0 && m->have_stats)
			value = m->sessions;
		else if (m && which == 1 && m->have_stats)
			value = m->connections;
		else if (m && which == 2)
			value = m->fds;
		else if (m && which == 3)
			value = m->deleted_mappings;
		if (value < 0)
			printf(" %14s", "-");
		else
			printf(" %14ld", value);
	}
	printf("\n");
}

static void print_latency(const char *label, const struct latency *l)
{
	if (l->count == 0) {
		printf("  %-8s no calls\n", label);
		return;
	}
	printf("  %-8s p50 %9.1f us   p99 %9.1f us   p99.9 %9.1f us   mean %9.1f us   "
	       "max %9.1f us   (%" PRIu64 " calls)\n",
	       label, l->p50_us, l->p99_us, l->p999_us, l->mean_us, l->max_us, l->count);
}

static void report_text(const struct run *run, const struct summary *s)
{
	const struct load_config *c = &run->config;
	struct totals final;
	const char *messages[REPORT_MESSAGES];
	size_t n_messages = collect_messages(run, messages, REPORT_MESSAGES);

	totals_read(run->shared, c->clients, &final);
	printf(LOAD_NAME ": %u clients x %u layers x %u s (warm-up %u s), kv_heads %u, head_dim %u,\n"
	       "  prefill %u tokens, recycle (%s) every %u decode steps, max_tokens %u\n",
	       c->clients, c->layers, c->seconds, c->warmup, c->kv_heads, c->head_dim, c->prefill,
	       recycle_name(c->recycle), run->work.cycle_steps, c->max_tokens);
	printf("daemon: %s, zipcached %s, pid %ld (%s)\n", c->socket_path, run->server.server_version,
	       run->daemon_pid, run->pid_source);
	if (run->stopped_early)
		printf("the run ended early, at %.1f s (%s)\n", run->end_t,
		       interrupted ? "interrupted" : "every client had stopped");
	printf("\nthroughput over %.1f s %s:\n", s->window_s,
	       run->warm_taken ? "after the warm-up" : "(no warm-up reached: the whole run)");
	printf("  update_and_fetch calls   %12" PRIu64 "   %10.1f /s\n", s->window_calls, s->calls_per_s);
	printf("  decode tokens            %12" PRIu64 "   %10.1f /s   (one token through all %u layers)\n",
	       s->window_decode_steps, s->decode_tokens_per_s, c->layers);
	printf("  prefill tokens           %12" PRIu64 "   %10.1f /s\n", s->window_prefill_tokens,
	       s->prefill_tokens_per_s);
	printf("  whole run: %" PRIu64 " sessions opened, %" PRIu64 " closed, %" PRIu64 " trimmed\n",
	       final.opens, final.closes, final.trims);
	printf("\nupdate_and_fetch round trip %s:\n",
	       run->warm_taken ? "after the warm-up" : "(whole run)");
	print_latency("decode", &s->decode);
	print_latency("prefill", &s->prefill);

	const struct memory_sample *columns[4] = { &run->start, run->warm_taken ? &run->warm : NULL,
						   &run->end, &run->after };
	printf("\n%-36s %14s %14s %14s %14s\n", "daemon memory", "start", "after warm-up", "end",
	       "after close");
	print_memory_row("VmRSS", columns, offsetof(struct memory_sample, vm_rss), true);
	print_memory_row("  RssAnon (private)", columns, offsetof(struct memory_sample, rss_anon),
			 true);
	print_memory_row("  RssFile", columns, offsetof(struct memory_sample, rss_file), true);
	print_memory_row("  RssShmem", columns, offsetof(struct memory_sample, rss_shmem), true);
	print_memory_row("session files (daemon stats)", columns,
			 offsetof(struct memory_sample, shm_bytes), false);
	print_memory_row("total = RssAnon + session files", columns,
			 offsetof(struct memory_sample, total), false);
	print_count_row("sessions", columns, 0);
	print_count_row("connections", columns, 1);
	print_count_row("open descriptors", columns, 2);
	print_count_row("mappings of deleted files", columns, 3);
	if (s->drift_known)
		printf("memory drift, after warm-up -> end: %+.2f %% (limit %.1f %%); band of the %zu "
		       "samples in between: %+.2f %% .. %+.2f %%\n",
		       s->drift_pct, c->max_drift, s->band_samples, s->band_low_pct, s->band_high_pct);
	else
		printf("memory drift: unknown (the run ended before the warm-up did, or the daemon did "
		       "not answer the stats request)\n");
	printf("daemon-side request errors during the run: %" PRIu64 "\n", s->daemon_request_errors);
	printf("sessions of this run left open: %u\n", run->leftover_sessions);
	printf("\nerrors: %" PRIu64 "%s\n", s->errors, n_messages ? ", the first:" : "");
	for (size_t i = 0; i < n_messages; i++)
		printf("  %s\n", messages[i]);
	printf("result: %s\n", s->pass ? "PASS" : "FAIL");
}

/* ---- JSON ---------------------------------------------------------------- */

static void json_latency(struct json *json, const char *key, const struct latency *l)
{
	json_open(json, key, '{');
	json_uint(json, "count", l->count);
	json_double(json, "p50", l->p50_us);
	json_double(json, "p99", l->p99_us);
	json_double(json, "p999", l->p999_us);
	json_double(json, "mean", l->mean_us);
	json_double(json, "max", l->max_us);
	json_close(json, '}');
}

static void json_memory(struct json *json, const char *key, const struct memory_sample *m)
{
	if (!m) {
		json_null(json, key);
		return;
	}
	json_open(json, key, '{');
	json_double(json, "t", m->t);
	if (m->have_proc) {
		json_uint(json, "vm_rss_bytes", m->vm_rss);
		json_uint(json, "rss_anon_bytes", m->rss_anon);
		json_uint(json, "rss_file_bytes", m->rss_file);
		json_uint(json, "rss_shmem_bytes", m->rss_shmem);
	}
	json_int(json, "fds", m->fds);
	json_int(json, "deleted_mappings", m->deleted_mappings);
	if (m->have_stats) {
		json_uint(json, "shm_bytes", m->shm_bytes);
		json_uint(json, "sessions", m->sessions);
		json_uint(json, "connections", m->connections);
	}
	json_uint(json, "total_bytes", m->total);
	json_close(json, '}');
}

static void report_json(const struct run *run, const struct summary *s)
{
	const struct load_config *c = &run->config;
	struct json json = { stdout, false };
	struct totals final;
	const char *messages[REPORT_MESSAGES];
	size_t n_messages = collect_messages(run, messages, REPORT_MESSAGES);

	totals_read(run->shared, c->clients, &final);
	json_open(&json, NULL, '{');
	json_text(&json, "tool", LOAD_NAME);
	json_text(&json, "socket", c->socket_path);
	json_text(&json, "server_version", run->server.server_version);
	json_int(&json, "daemon_pid", run->daemon_pid);
	json_open(&json, "config", '{');
	json_uint(&json, "clients", c->clients);
	json_uint(&json, "layers", c->layers);
	json_uint(&json, "seconds", c->seconds);
	json_uint(&json, "warmup", c->warmup);
	json_uint(&json, "kv_heads", c->kv_heads);
	json_uint(&json, "head_dim", c->head_dim);
	json_uint(&json, "prefill", c->prefill);
	json_uint(&json, "prefill_every", run->work.cycle_steps);
	json_uint(&json, "max_tokens", c->max_tokens);
	json_text(&json, "recycle", recycle_name(c->recycle));
	json_double(&json, "max_drift_pct", c->max_drift);
	json_close(&json, '}');
	json_double(&json, "duration_s", run->end_t);
	json_bool(&json, "stopped_early", run->stopped_early);
	json_double(&json, "window_s", s->window_s);
	json_uint(&json, "calls", s->window_calls);
	json_double(&json, "calls_per_s", s->calls_per_s);
	json_uint(&json, "decode_tokens", s->window_decode_steps);
	json_double(&json, "decode_tokens_per_s", s->decode_tokens_per_s);
	json_uint(&json, "prefill_tokens", s->window_prefill_tokens);
	json_double(&json, "prefill_tokens_per_s", s->prefill_tokens_per_s);
	json_uint(&json, "sessions_opened", final.opens);
	json_uint(&json, "sessions_closed", final.closes);
	json_uint(&json, "sessions_trimmed", final.trims);
	json_open(&json, "latency_us", '{');
	json_latency(&json, "decode", &s->decode);
	json_latency(&json, "prefill", &s->prefill);
	json_close(&json, '}');
	json_uint(&json, "errors", s->errors);
	json_open(&json, "first_errors", '[');
	for (size_t i = 0; i < n_messages; i++)
		json_text(&json, NULL, messages[i]);
	json_close(&json, ']');
	json_uint(&json, "clients_hung", run->hung);
	json_uint(&json, "clients_crashed", run->crashed);
	json_uint(&json, "clients_gave_up", run->gave_up);
	json_uint(&json, "leftover_sessions", run->leftover_sessions);
	json_uint(&json, "daemon_request_errors", s->daemon_request_errors);
	json_open(&json, "memory", '{');
	json_memory(&json, "start", &run->start);
	json_memory(&json, "warm", run->warm_taken ? &run->warm : NULL);
	json_memory(&json, "end", &run->end);
	json_memory(&json, "after", &run->after);
	if (s->drift_known) {
		json_double(&json, "drift_pct", s->drift_pct);
		json_double(&json, "band_low_pct", s->band_low_pct);
		json_double(&json, "band_high_pct", s->band_high_pct);
	} else {
		json_null(&json, "drift_pct");
	}
	/* [t, total bytes] of every sample, for a plot. */
	json_open(&json, "series", '[');
	for (size_t i = 0; i < run->n_samples; i++) {
		json_open(&json, NULL, '[');
		json_double(&json, NULL, run->samples[i].t);
		json_uint(&json, NULL, run->samples[i].total);
		json_close(&json, ']');
	}
	json_close(&json, ']');
	json_close(&json, '}');
	json_bool(&json, "pass", s->pass);
	json_close(&json, '}');
	fputc('\n', json.out);
}

/* ---- main ---------------------------------------------------------------- */

static int run_prepare(struct run *run)
{
	const struct load_config *config = &run->config;
	struct workload *work = &run->work;

	work->cycle_steps = config->prefill_every;
	if ((uint64_t)config->max_tokens - config->prefill < work->cycle_steps)
		work->cycle_steps = config->max_tokens - config->prefill;
	/* Enough for the longest first prefill (P + an offset below a cycle). */
	work->pool_tokens = config->prefill + work->cycle_steps;
	snprintf(work->name_prefix, sizeof(work->name_prefix), "zcload-%ld-", (long)getpid());

	uint16_t *keys = pool_make(work->pool_tokens, config->kv_heads, config->head_dim, 0x6b657973);
	uint16_t *values = pool_make(work->pool_tokens, config->kv_heads, config->head_dim, 0x76616c73);
	if (!keys || !values) {
		free(keys);
		free(values);
		fprintf(stderr, LOAD_NAME ": out of memory for %u tokens of test data\n",
			work->pool_tokens);
		return -ENOMEM;
	}
	work->keys = keys;
	work->values = values;

	run->pids = calloc(config->clients, sizeof(*run->pids));
	run->shared_bytes = sizeof(struct shared) + (size_t)config->clients * sizeof(struct slot);
	run->shared = mmap(NULL, run->shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
			   -1, 0);
	if (!run->pids || run->shared == MAP_FAILED) {
		run->shared = NULL;
		fprintf(stderr, LOAD_NAME ": out of memory for %u clients\n", config->clients);
		return -ENOMEM;
	}
	return 0;
}

static int run_connect(struct run *run)
{
	const struct load_config *config = &run->config;
	int rc = zc_client_connect(config->socket_path, config->timeout_ms, &run->client);

	if (rc < 0) {
		run->client = NULL;
		fprintf(stderr, LOAD_NAME ": cannot connect to %s: %s\n", config->socket_path,
			zc_strerror(rc));
		return rc;
	}
	run->server = *zc_client_server_info(run->client);
	if (config->daemon_pid > 0) {
		run->daemon_pid = config->daemon_pid;
		run->pid_source = "--daemon-pid";
	} else {
		run->daemon_pid = peer_pid(config->socket_path);
		run->pid_source = run->daemon_pid > 0 ? "SO_PEERCRED" : "unknown: RSS not sampled";
	}
	/* Limits that make the run fail for a reason of its own making are
	 * worth a word up front; the run goes ahead, and the errors will say
	 * what the daemon refused. */
	if (run->server.max_sessions && config->clients > run->server.max_sessions)
		fprintf(stderr, LOAD_NAME ": warning: %u clients but the daemon allows %u sessions\n",
			config->clients, run->server.max_sessions);
	return 0;
}

int main(int argc, char **argv)
{
	static struct run run;
	struct summary summary;
	int rc = parse_args(&run.config, argc, argv);

	if (rc != 0)
		return rc > 0 ? LOAD_EXIT_PASS : LOAD_EXIT_USAGE;
	signal(SIGPIPE, SIG_IGN);
	struct sigaction action = { .sa_handler = on_interrupt };
	sigemptyset(&action.sa_mask);
	sigaction(SIGINT, &action, NULL);
	sigaction(SIGTERM, &action, NULL);

	if (run_connect(&run) < 0 || run_prepare(&run) < 0)
		return LOAD_EXIT_FAIL;
	run.start_ns = now_ns();
	if (run_sample(&run, 0, &run.start) < 0)
		return LOAD_EXIT_FAIL;

	rc = run_clients(&run);
	if (rc < 0)
		fprintf(stderr, LOAD_NAME ": the run stopped: %s\n", strerror(-rc));
	run_stop_clients(&run);
	run_check_leftovers(&run);
	run_settle(&run);
	memory_sample_take(run.client, run.daemon_pid, run_elapsed(&run), &run.after);

	summarize(&run, &summary);
	if (rc < 0)
		summary.pass = false;
	if (run.config.json)
		report_json(&run, &summary);
	else
		report_text(&run, &summary);
	fflush(stdout);
	zc_client_close(run.client);
	return summary.pass ? LOAD_EXIT_PASS : LOAD_EXIT_FAIL;
}
