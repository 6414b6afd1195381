/* The host's descriptors and memory, read at start (see resources.h). */
#include "resources.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "connection.h"
#include "http.h"
#include "options.h"
#include "retain.h"

/* The headroom left below the smaller of file system and cgroup: other
 * files on the same tmpfs (its metadata, other programs' /dev/shm files),
 * and in the cgroup the daemon's own heap (reply queues, frame buffers,
 * jobs), which does not shrink with the machine. */
#define HEADROOM_DIVISOR 10
#define HEADROOM_MIN_BYTES (64ull << 20)

/* cgroup v1 says "no limit" with a huge number (LONG_MAX, page-rounded). */
#define CGROUP_NO_LIMIT_ABOVE (1ull << 60)

uint64_t resources_descriptors_needed(const struct options *options)
{
	uint64_t need = RESOURCES_FIXED_DESCRIPTORS;
	if (strcmp(options->metrics_listen, "off") != 0)
		need += HTTP_FIXED_DESCRIPTORS + HTTP_CONNECTION_LIMIT;
	need += (uint64_t)options->max_connections * CONNECTION_DESCRIPTORS;
	need += options->max_sessions;
	if (options->retain_bytes)
		need += RETAIN_MAX_MAPS;
	return need;
}

void resources_descriptors_formula(const struct options *options, char *text, size_t size)
{
	int n = snprintf(text, size, "%u + %u per connection + 1 per session",
			 RESOURCES_FIXED_DESCRIPTORS, CONNECTION_DESCRIPTORS);
	if (n > 0 && (size_t)n < size && strcmp(options->metrics_listen, "off") != 0)
		n += snprintf(text + n, size - (size_t)n, " + %u for metrics",
			      HTTP_FIXED_DESCRIPTORS + HTTP_CONNECTION_LIMIT);
	if (n > 0 && (size_t)n < size && options->retain_bytes)
		snprintf(text + n, size - (size_t)n, " + %u retained maps", RETAIN_MAX_MAPS);
}

int resources_raise_descriptor_limit(uint64_t *before, uint64_t *soft, uint64_t *hard)
{
	struct rlimit limit;
	if (getrlimit(RLIMIT_NOFILE, &limit) < 0)
		return -errno;
	*before = limit.rlim_cur;
	rlim_t target = limit.rlim_max;
	if (target == RLIM_INFINITY) {
		/* The kernel caps descriptors at fs.nr_open whatever the limit says. */
		unsigned long long nr_open = 1u << 20;
		FILE *file = fopen("/proc/sys/fs/nr_open", "re");
		if (file) {
			if (fscanf(file, "%llu", &nr_open) != 1)
				nr_open = 1u << 20;
			fclose(file);
		}
		target = (rlim_t)nr_open;
	}
	int rc = 0;
	if (limit.rlim_cur < target) {
		struct rlimit raised = { .rlim_cur = target, .rlim_max = limit.rlim_max };
		if (setrlimit(RLIMIT_NOFILE, &raised) == 0)
			limit.rlim_cur = target;
		else
			rc = -errno;
	}
	*soft = limit.rlim_cur;
	*hard = limit.rlim_max == RLIM_INFINITY ? (uint64_t)target : limit.rlim_max;
	return rc;
}

/* One limit file: its bytes, or 0 for "max", a huge value, or no file. */
static uint64_t limit_file_read(const char *dir, const char *name)
{
	char path[4200], text[64];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *file = fopen(path, "re");
	if (!file)
		return 0;
	bool ok = fgets(text, sizeof(text), file) != NULL;
	fclose(file);
	if (!ok || strncmp(text, "max", 3) == 0)
		return 0;
	char *end;
	errno = 0;
	unsigned long long value = strtoull(text, &end, 10);
	if (errno || end == text || value >= CGROUP_NO_LIMIT_ABOVE)
		return 0;
	return value;
}

static uint64_t tighter(uint64_t a, uint64_t b)
{
	if (a == 0)
		return b;
	return b && b < a ? b : a;
}

/* The tightest limit from base/path up to base itself. */
static uint64_t hierarchy_limit(const char *base, const char *path, const char *name)
{
	char dir[4200];
	struct stat st;
	int n = snprintf(dir, sizeof(dir), "%s%s", base, path);
	size_t base_len = strlen(base);
	uint64_t limit = 0;

	if (n < 0 || (size_t)n >= sizeof(dir) || stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
		return limit_file_read(base, name);
	for (;;) {
		size_t len = strlen(dir);
		while (len > base_len && dir[len - 1] == '/')
			dir[--len] = '\0';
		limit = tighter(limit, limit_file_read(dir, name));
		if (len <= base_len)
			return limit;
		char *slash = strrchr(dir + base_len, '/');
		if (!slash)
			return tighter(limit, limit_file_read(base, name));
		*slash = '\0';
	}
}

/* Whether a v1 controller list ("cpu,cpuacct") names the memory controller. */
static bool names_memory(const char *controllers, size_t len)
{
	for (size_t start = 0; start < len;) {
		size_t end = start;
		while (end < len && controllers[end] != ',')
			end++;
		if (end - start == 6 && strncmp(controllers + start, "memory", 6) == 0)
			return true;
		start = end + 1;
	}
	return false;
}

uint64_t resources_cgroup_memory_limit(const char *proc_cgroup, const char *cgroup_root)
{
	char line[4096], base[4200];
	uint64_t limit = 0;
	FILE *file = fopen(proc_cgroup, "re");

	if (!file)
		return 0;
	while (fgets(line, sizeof(line), file)) {
		line[strcspn(line, "\n")] = '\0';
		/* hierarchy-id:controllers:path */
		char *first = strchr(line, ':');
		char *second = first ? strchr(first + 1, ':') : NULL;
		if (!second)
			continue;
		const char *path = second + 1;
		if (first - line == 1 && line[0] == '0' && second == first + 1) {
			limit = tighter(limit, hierarchy_limit(cgroup_root, path, "memory.max"));
		} else if (names_memory(first + 1, (size_t)(second - first - 1))) {
			snprintf(base, sizeof(base), "%s/memory", cgroup_root);
			limit = tighter(limit, hierarchy_limit(base, path, "memory.limit_in_bytes"));
		}
	}
	fclose(file);
	return limit;
}

uint64_t resources_budget_from(uint64_t fs_bytes, uint64_t cgroup_bytes)
{
	uint64_t smaller = tighter(fs_bytes, cgroup_bytes);
	uint64_t headroom = smaller / HEADROOM_DIVISOR;
	if (headroom < HEADROOM_MIN_BYTES)
		headroom = HEADROOM_MIN_BYTES;
	if (headroom > smaller / 2)
		headroom = smaller / 2;
	return smaller - headroom;
}

void resources_memory_budget_default(const char *shm_dir, struct resources_memory *out)
{
	struct statfs fs;
	out->fs_bytes = 0;
	/* tmpfs mounted without a size reports 0 blocks: no size to go by. */
	if (statfs(shm_dir, &fs) == 0)
		out->fs_bytes = (uint64_t)fs.f_blocks * (uint64_t)fs.f_bsize;
	out->cgroup_bytes = resources_cgroup_memory_limit("/proc/self/cgroup", "/sys/fs/cgroup");
	out->budget = resources_budget_from(out->fs_bytes, out->cgroup_bytes);
}

int resources_cpus_online(void)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	return n < 1 ? 1 : n > INT_MAX ? INT_MAX : (int)n;
}

int resources_cpus(void)
{
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof(set), &set) != 0)
		return 1;
	int n = CPU_COUNT(&set);
	return n < 1 ? 1 : n;
}
