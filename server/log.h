/*
 * One line per event on stderr, journald-friendly:
 *   2026-11-29T08:50:00.123Z level=warn module=store event="fallocate failed" path=...
 * The format string adds key=value fields after the event.
 */
#ifndef ZIPCACHE_LOG_H
#define ZIPCACHE_LOG_H

enum log_level {
	LOG_ERROR = 0,
	LOG_WARN = 1,
	LOG_INFO = 2,
	LOG_DEBUG = 3
};

void log_set_level(enum log_level level);
enum log_level log_get_level(void);

/* Parses "error|warn|info|debug"; returns -EINVAL otherwise. */
int log_level_parse(const char *text, enum log_level *level);

void log_write(enum log_level level, const char *module, const char *event, const char *fields, ...)
	__attribute__((format(printf, 4, 5)));

#define log_error(module, event, ...) log_write(LOG_ERROR, module, event, __VA_ARGS__)
#define log_warn(module, event, ...) log_write(LOG_WARN, module, event, __VA_ARGS__)
#define log_info(module, event, ...) log_write(LOG_INFO, module, event, __VA_ARGS__)
#define log_debug(module, event, ...) log_write(LOG_DEBUG, module, event, __VA_ARGS__)

#endif
