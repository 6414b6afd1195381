/* One-line error messages for the command-line tools. */
#ifndef ZIPCACHE_TOOLS_FAILURE_H
#define ZIPCACHE_TOOLS_FAILURE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

/*
 * Prints "PROGRAM: <message>" on stderr as exactly one line and returns
 * status. Control characters (a newline in a file name, an escape in a
 * daemon's message) become '?', so the message can never spill onto a
 * second line or move a terminal's cursor. stdout is flushed first so the
 * two streams stay in order.
 */
int failure_print(const char *program, int status, const char *format, va_list arguments);

/*
 * Why connecting to the Unix socket at path failed with error (a negative
 * errno), when the file system says so: the first directory on the way
 * that the caller may not enter, or a socket it may not write, with that
 * file's group and mode and the group to join. Writes one sentence that
 * starts "permission denied" into out and returns true; false (out
 * untouched) when the file system explains nothing.
 *
 * A socket in a directory closed to the caller looks absent to it (a
 * daemon's default path that does not exist sends a client elsewhere), so
 * for -ENOENT the same is said of known_path (where a daemon usually
 * listens; NULL for none) when its directory exists and is closed.
 */
bool failure_socket_hint(const char *path, int error, const char *known_path, char *out,
			 size_t size);

#endif
