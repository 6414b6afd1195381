/*
 * The default socket path: one rule for zipcached (where it listens
 * without --socket), zipcachectl and every client (where they dial without
 * a path), so that a daemon a user starts is the one that user's tools
 * find. The rule itself is written down in zipcache/client.h.
 */
#include "zipcache/client.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* snprintf that says whether it all fit: 0, or -ENAMETOOLONG (buf cut). */
__attribute__((format(printf, 3, 4)))
static int path_format(char *buf, size_t len, const char *format, ...)
{
	va_list args;
	int n;

	if (len == 0)
		return -ENAMETOOLONG;
	va_start(args, format);
	n = vsnprintf(buf, len, format, args);
	va_end(args);
	return n >= 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/* The per-user place both sides agree on. */
static int user_socket_path(char *buf, size_t len)
{
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	uid_t uid = getuid();

	if (uid == 0)
		return path_format(buf, len, "/run/%s", ZC_SOCKET_NAME);
	if (xdg && *xdg)
		return path_format(buf, len, "%s/%s", xdg, ZC_SOCKET_NAME);
	return path_format(buf, len, "/tmp/zipcached-%u.sock", (unsigned)uid);
}

int zc_daemon_socket_path(char *buf, size_t len)
{
	const char *runtime = getenv("RUNTIME_DIRECTORY");

	if (runtime && *runtime) {
		/* systemd's RuntimeDirectory=; a colon list when a unit names several. */
		int first = (int)strcspn(runtime, ":");
		return path_format(buf, len, "%.*s/%s", first, runtime, ZC_SOCKET_NAME);
	}
	return user_socket_path(buf, len);
}

int zc_default_socket_path(char *buf, size_t len)
{
	const char *env = getenv("ZIPCACHE_SOCKET");
	struct stat st;
	int rc;

	if (env && *env)
		return path_format(buf, len, "%s", env);
	rc = user_socket_path(buf, len);
	if (rc == 0 && stat(buf, &st) < 0 && stat(ZC_SERVICE_SOCKET_PATH, &st) == 0)
		rc = path_format(buf, len, "%s", ZC_SERVICE_SOCKET_PATH);
	return rc;
}
