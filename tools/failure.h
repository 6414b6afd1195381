/* One-line error messages for the command-line tools. */
#ifndef ZIPCACHE_TOOLS_FAILURE_H
#define ZIPCACHE_TOOLS_FAILURE_H

#include <stdarg.h>

/*
 * Prints "PROGRAM: <message>" on stderr as exactly one line and returns
 * status. Control characters (a newline in a file name, an escape in a
 * daemon's message) become '?', so the message can never spill onto a
 * second line or move a terminal's cursor. stdout is flushed first so the
 * two streams stay in order.
 */
int failure_print(const char *program, int status, const char *format, va_list arguments);

#endif
