/* One-line error messages for the command-line tools. */
#include "failure.h"

#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int failure_print(const char *program, int status, const char *format, va_list arguments)
{
	char message[1024];

	vsnprintf(message, sizeof(message), format, arguments);
	for (char *c = message; *c; c++)
		if ((unsigned char)*c < 0x20 || *c == 0x7f)
			*c = '?';
	fflush(stdout);
	fprintf(stderr, "%s: %s\n", program, message);
	return status;
}

/* The first directory on the way to path that the caller may not enter
 * (search), copied to out; false when it may enter them all. */
static bool closed_directory(const char *path, char *out, size_t size)
{
	char prefix[PATH_MAX];
	size_t length = strlen(path);

	if (length >= sizeof(prefix))
		return false;
	memcpy(prefix, path, length + 1);
	for (char *slash = strchr(prefix + 1, '/'); slash; slash = strchr(slash + 1, '/')) {
		*slash = '\0';
		if (access(prefix, X_OK) != 0 && errno == EACCES) {
			snprintf(out, size, "%s", prefix);
			return true;
		}
		*slash = '/';
	}
	return false;
}

/* Whether the caller's login session (not only /etc/group) has gid. */
static bool session_has_group(gid_t gid)
{
	gid_t groups[NGROUPS_MAX];
	int count = getgroups(NGROUPS_MAX, groups);

	if (getegid() == gid)
		return true;
	for (int i = 0; i < count; i++)
		if (groups[i] == gid)
			return true;
	return false;
}

/* Whether /etc/group (or the primary group) puts the user in group. */
static bool user_in_group(const char *user_name, gid_t primary, const struct group *group)
{
	if (!group)
		return false;
	if (primary == group->gr_gid)
		return true;
	for (char **member = group->gr_mem; member && *member; member++)
		if (strcmp(*member, user_name) == 0)
			return true;
	return false;
}

/*
 * "permission denied: uid 1000 (alice) may not enter /run/zipcached
 * (owner zipcached, group zipcached, mode 0750); join group zipcached: ..."
 * for the directory or socket at blocked, which needs group permission
 * bit to let a group member through.
 */
static void describe_denial(const char *blocked, const char *action, mode_t bit, char *out,
			    size_t size)
{
	struct passwd *user = getpwuid(getuid());
	char user_name[64], owner_name[64], group_name[64], advice[320];
	gid_t primary = user ? user->pw_gid : (gid_t)-1;
	struct group *group = NULL;
	struct stat st;

	/* Copied now: getpwuid() reuses one static entry. */
	snprintf(user_name, sizeof(user_name), "%s", user ? user->pw_name : "?");
	if (stat(blocked, &st) != 0) {
		snprintf(out, size, "permission denied: uid %u (%s) may not %s %s", (unsigned)getuid(),
			 user_name, action, blocked);
		return;
	}
	{
		struct passwd *owner = getpwuid(st.st_uid);

		if (owner)
			snprintf(owner_name, sizeof(owner_name), "%s", owner->pw_name);
		else
			snprintf(owner_name, sizeof(owner_name), "%u", (unsigned)st.st_uid);
	}
	group = getgrgid(st.st_gid);
	if (group)
		snprintf(group_name, sizeof(group_name), "%s", group->gr_name);
	else
		snprintf(group_name, sizeof(group_name), "%u", (unsigned)st.st_gid);

	if (!(st.st_mode & bit))
		snprintf(advice, sizeof(advice),
			 "only its owner %s may; whoever runs the daemon can open it to a group "
			 "(zipcached --socket-mode 0660, a directory of mode 0750)",
			 owner_name);
	else if (user_in_group(user_name, primary, group) && !session_has_group(st.st_gid))
		snprintf(advice, sizeof(advice),
			 "%s is in group %s but this login session is not yet: log in again "
			 "(or run `newgrp %s`)",
			 user_name, group_name, group_name);
	else
		snprintf(advice, sizeof(advice),
			 "join group %s: sudo usermod -aG %s %s, then log in again", group_name,
			 group_name, user_name);
	snprintf(out, size, "permission denied: uid %u (%s) may not %s %s (owner %s, group %s, mode %04o); %s",
		 (unsigned)getuid(), user_name, action, blocked, owner_name, group_name,
		 (unsigned)(st.st_mode & 07777), advice);
}

bool failure_socket_hint(const char *path, int error, const char *known_path, char *out,
			 size_t size)
{
	char blocked[PATH_MAX];

	if (error == -EACCES || error == -EPERM || error == -ENOENT) {
		if (closed_directory(path, blocked, sizeof(blocked))) {
			describe_denial(blocked, "enter", S_IXGRP, out, size);
			return true;
		}
	}
	if (error == -EACCES || error == -EPERM) {
		if (access(path, W_OK) != 0 && errno == EACCES) {
			describe_denial(path, "write to the socket", S_IWGRP, out, size);
			return true;
		}
		return false;
	}
	if (error == -ENOENT && known_path && strcmp(path, known_path) != 0 &&
	    closed_directory(known_path, blocked, sizeof(blocked))) {
		char denial[PATH_MAX + 512];

		describe_denial(blocked, "enter", S_IXGRP, denial, sizeof(denial));
		snprintf(out, size, "a daemon may be listening on %s instead, but %s", known_path,
			 denial);
		return true;
	}
	return false;
}
