/*
 * One line per event on stderr, journald-friendly:
 *   2026-11-29T08:50:00.123Z level=warn module=store event="fallocate failed" path=...
 * The format string adds key=value fields after the event.
 *
 * Repeated lines are rate-limited: an event (module and event name) may
 * write LOG_BURST lines per window; the rest of that window are counted,
 * not written, and the next line of the event after the window carries
 * `suppressed=N`. A client that makes the daemon fail in a loop (accept at
 * the descriptor limit, refused requests) thus costs a few lines, not the
 * disk. Debug lines are never suppressed: whoever asks for them is
 * watching.
 */
#ifndef ZIPCACHE_LOG_H
#define ZIPCACHE_LOG_H

#include <stdint.h>

enum log_level {
	LOG_ERROR = 0,
	LOG_WARN = 1,
	LOG_INFO = 2,
	LOG_DEBUG = 3
};

/* Lines of one event written per window before the rest are counted. */
#define LOG_BURST 10
/* The window, in milliseconds: a flood costs LOG_BURST lines per 5 s. */
#define LOG_WINDOW_MS 5000

void log_set_level(enum log_level level);
enum log_level log_get_level(void);

/* Parses "error|warn|info|debug"; returns -EINVAL otherwise. */
int log_level_parse(const char *text, enum log_level *level);

/* Changes the rate limit (tests use a short window); burst 0 turns it off. */
void log_set_rate_limit(unsigned burst, uint64_t window_ms);

void log_write(enum log_level level, const char *module, const char *event, const char *fields, ...)
	__attribute__((format(printf, 4, 5)));

#define log_error(module, event, ...) log_write(LOG_ERROR, module, event, __VA_ARGS__)
#define log_warn(module, event, ...) log_write(LOG_WARN, module, event, __VA_ARGS__)
#define log_info(module, event, ...) log_write(LOG_INFO, module, event, __VA_ARGS__)
#define log_debug(module, event, ...) log_write(LOG_DEBUG, module, event, __VA_ARGS__)

#endif
