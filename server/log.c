/* Logging: a timestamp, a level and key=value fields, one line each;
 * repeated events are rate-limited (see log.h). */
#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* Events tracked at once; a colliding event takes the slot over (and its
 * pending count is written first), so the table never grows. */
#define LOG_SLOTS 64

static enum log_level current_level = LOG_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };

struct log_slot {
	bool used;
	char module[32];
	char event[64];
	enum log_level level;
	uint64_t window_start_ms;
	unsigned written;      /* lines written in this window */
	uint64_t suppressed;   /* lines counted, not written, since the last one written */
};

/* Lines are written from the loop thread and from the thread pool. */
static pthread_mutex_t slots_lock = PTHREAD_MUTEX_INITIALIZER;
static struct log_slot slots[LOG_SLOTS];
static unsigned rate_burst = LOG_BURST;
static uint64_t rate_window_ms = LOG_WINDOW_MS;

void log_set_level(enum log_level level)
{
	current_level = level;
}

enum log_level log_get_level(void)
{
	return current_level;
}

void log_set_rate_limit(unsigned burst, uint64_t window_ms)
{
	pthread_mutex_lock(&slots_lock);
	rate_burst = burst;
	rate_window_ms = window_ms;
	memset(slots, 0, sizeof(slots));
	pthread_mutex_unlock(&slots_lock);
}

int log_level_parse(const char *text, enum log_level *level)
{
	for (int i = 0; i <= LOG_DEBUG; i++) {
		if (strcmp(text, level_names[i]) == 0) {
			*level = (enum log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

static uint64_t monotonic_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000;
}

/* Formats and writes one line; `suppressed` > 0 adds that field. */
static void line_write(enum log_level level, const char *module, const char *event,
		       uint64_t suppressed, const char *fields, va_list *args)
{
	char line[1024];
	struct timespec now;
	struct tm utc;
	clock_gettime(CLOCK_REALTIME, &now);
	gmtime_r(&now.tv_sec, &utc);
	int used = snprintf(line, sizeof(line),
			    "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s module=%s event=\"%s\"",
			    utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
			    utc.tm_sec, now.tv_nsec / 1000000, level_names[level], module, event);
	if (args && fields && *fields && used > 0 && (size_t)used < sizeof(line) - 2) {
		line[used++] = ' ';
		int more = vsnprintf(line + used, sizeof(line) - (size_t)used, fields, *args);
		if (more > 0)
			used += more;
	}
	if (suppressed && used > 0 && (size_t)used < sizeof(line) - 2) {
		int more = snprintf(line + used, sizeof(line) - (size_t)used, " suppressed=%llu",
				    (unsigned long long)suppressed);
		if (more > 0)
			used += more;
	}
	if (used < 0)
		return;
	if ((size_t)used >= sizeof(line) - 1)
		used = (int)sizeof(line) - 2;
	line[used++] = '\n';
	/* One write per line so concurrent threads never interleave mid-line. */
	fwrite(line, 1, (size_t)used, stderr);
}

static unsigned slot_of(const char *module, const char *event)
{
	uint32_t hash = 2166136261u;   /* FNV-1a */
	for (const char *p = module; *p; p++)
		hash = (hash ^ (unsigned char)*p) * 16777619u;
	for (const char *p = event; *p; p++)
		hash = (hash ^ (unsigned char)*p) * 16777619u;
	return hash % LOG_SLOTS;
}

/* A line whose event was taken out of the table with lines still counted. */
struct log_evicted {
	char module[32];
	char event[64];
	enum log_level level;
	uint64_t suppressed;
};

/*
 * Whether this line may be written, and the count it carries; under the
 * lock. An event of another key in the slot is replaced, its pending
 * count handed back in *evicted.
 */
static bool rate_admit(enum log_level level, const char *module, const char *event,
		       uint64_t *carry, struct log_evicted *evicted)
{
	struct log_slot *slot = &slots[slot_of(module, event)];
	uint64_t now = monotonic_ms();
	bool admit;

	*carry = 0;
	evicted->suppressed = 0;
	pthread_mutex_lock(&slots_lock);
	if (rate_burst == 0) {
		pthread_mutex_unlock(&slots_lock);
		return true;
	}
	if (!slot->used || strncmp(slot->module, module, sizeof(slot->module) - 1) != 0 ||
	    strncmp(slot->event, event, sizeof(slot->event) - 1) != 0) {
		if (slot->used && slot->suppressed) {
			memcpy(evicted->module, slot->module, sizeof(evicted->module));
			memcpy(evicted->event, slot->event, sizeof(evicted->event));
			evicted->level = slot->level;
			evicted->suppressed = slot->suppressed;
		}
		memset(slot, 0, sizeof(*slot));
		slot->used = true;
		snprintf(slot->module, sizeof(slot->module), "%s", module);
		snprintf(slot->event, sizeof(slot->event), "%s", event);
		slot->window_start_ms = now;
	}
	slot->level = level;
	if (now - slot->window_start_ms >= rate_window_ms) {
		slot->window_start_ms = now;
		slot->written = 0;
	}
	admit = slot->written < rate_burst;
	if (admit) {
		slot->written++;
		*carry = slot->suppressed;
		slot->suppressed = 0;
	} else {
		slot->suppressed++;
	}
	pthread_mutex_unlock(&slots_lock);
	return admit;
}

void log_write(enum log_level level, const char *module, const char *event, const char *fields, ...)
{
	struct log_evicted evicted;
	uint64_t carry = 0;
	va_list args;

	if (level > current_level)
		return;
	if (level != LOG_DEBUG) {
		bool admit = rate_admit(level, module, event, &carry, &evicted);
		if (evicted.suppressed)
			line_write(evicted.level, evicted.module, evicted.event, evicted.suppressed,
				   NULL, NULL);
		if (!admit)
			return;
	}
	va_start(args, fields);
	line_write(level, module, event, carry, fields, &args);
	va_end(args);
}
