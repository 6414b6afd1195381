/* Logging: a timestamp, a level and key=value fields, one line each. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static enum log_level current_level = LOG_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };

void log_set_level(enum log_level level)
{
	current_level = level;
}

enum log_level log_get_level(void)
{
	return current_level;
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

void log_write(enum log_level level, const char *module, const char *event, const char *fields, ...)
{
	if (level > current_level)
		return;
	char line[1024];
	struct timespec now;
	struct tm utc;
	clock_gettime(CLOCK_REALTIME, &now);
	gmtime_r(&now.tv_sec, &utc);
	int used = snprintf(line, sizeof(line),
			    "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s module=%s event=\"%s\"",
			    utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
			    utc.tm_sec, now.tv_nsec / 1000000, level_names[level], module, event);
	if (fields && *fields && used > 0 && (size_t)used < sizeof(line) - 2) {
		va_list args;
		line[used++] = ' ';
		va_start(args, fields);
		int more = vsnprintf(line + used, sizeof(line) - (size_t)used, fields, args);
		va_end(args);
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
