/*
 * What the daemon reads of its host (server/resources.c), without a
 * daemon: the default budget's arithmetic, cgroup limits from a made-up
 * /proc/self/cgroup and cgroup tree (v2 and v1, nested, "max", a cgroup
 * namespace), the descriptor formula, and raising RLIMIT_NOFILE.
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../server/connection.h"
#include "../server/http.h"
#include "../server/options.h"
#include "../server/resources.h"
#include "../server/retain.h"
#include "process_run.h"
#include "suite_main.h"

#define MIB (1ull << 20)
#define GIB (1ull << 30)

START_TEST(budget_is_the_smaller_less_headroom)
{
	/* A tenth off the smaller of the two. */
	ck_assert_uint_eq(resources_budget_from(10 * GIB, 0), 9 * GIB);
	ck_assert_uint_eq(resources_budget_from(0, 20 * GIB), 18 * GIB);
	ck_assert_uint_eq(resources_budget_from(10 * GIB, 20 * GIB), 9 * GIB);
	ck_assert_uint_eq(resources_budget_from(40 * GIB, 20 * GIB), 18 * GIB);
	/* At least 64 MiB off, at most half. */
	ck_assert_uint_eq(resources_budget_from(256 * MIB, 0), 192 * MIB);
	ck_assert_uint_eq(resources_budget_from(100 * MIB, 0), 50 * MIB);
	/* Nothing to go by: no budget. */
	ck_assert_uint_eq(resources_budget_from(0, 0), 0);
}
END_TEST

static char tree[PATH_MAX];

static void tree_make(void)
{
	snprintf(tree, sizeof(tree), "/tmp/zc_resources.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tree));
}

/* Writes tree/relative (making its directories) with printf text. */
static void tree_write(const char *relative, const char *format, ...)
	__attribute__((format(printf, 2, 3)));

static void tree_write(const char *relative, const char *format, ...)
{
	char path[PATH_MAX + 256];
	va_list args;
	snprintf(path, sizeof(path), "%s/%s", tree, relative);
	for (char *p = path + strlen(tree) + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		mkdir(path, 0755);
		*p = '/';
	}
	FILE *file = fopen(path, "w");
	ck_assert_msg(file != NULL, "%s: %s", path, strerror(errno));
	va_start(args, format);
	vfprintf(file, format, args);
	va_end(args);
	fclose(file);
}

static uint64_t tree_limit(void)
{
	char proc[PATH_MAX + 16], root[PATH_MAX + 16];
	snprintf(proc, sizeof(proc), "%s/cgroup", tree);
	snprintf(root, sizeof(root), "%s/fs", tree);
	return resources_cgroup_memory_limit(proc, root);
}

START_TEST(cgroup_v2_takes_the_tightest_ancestor)
{
	tree_make();
	tree_write("cgroup", "0::/kubepods/pod1/ctr\n");
	tree_write("fs/kubepods/pod1/ctr/memory.max", "max\n");
	tree_write("fs/kubepods/pod1/memory.max", "%llu\n", 3 * GIB);
	tree_write("fs/kubepods/memory.max", "%llu\n", 8 * GIB);
	ck_assert_uint_eq(tree_limit(), 3 * GIB);
	tree_write("fs/kubepods/pod1/ctr/memory.max", "%llu\n", 2 * GIB);
	ck_assert_uint_eq(tree_limit(), 2 * GIB);
	/* "max" all the way up: no limit. */
	tree_write("fs/kubepods/pod1/ctr/memory.max", "max\n");
	tree_write("fs/kubepods/pod1/memory.max", "max\n");
	tree_write("fs/kubepods/memory.max", "max\n");
	ck_assert_uint_eq(tree_limit(), 0);
	directory_remove(tree);
}
END_TEST

START_TEST(cgroup_namespace_shows_only_its_root)
{
	tree_make();
	/* Inside a cgroup namespace the path is "/" and the mount is the
	 * container's own cgroup. */
	tree_write("cgroup", "0::/\n");
	tree_write("fs/memory.max", "%llu\n", 512 * MIB);
	ck_assert_uint_eq(tree_limit(), 512 * MIB);
	/* A path that is not visible counts as the mount's root. */
	tree_write("cgroup", "0::/not/visible/here\n");
	ck_assert_uint_eq(tree_limit(), 512 * MIB);
	directory_remove(tree);
}
END_TEST

START_TEST(cgroup_v1_memory_controller)
{
	tree_make();
	/* cgroup v1 (or hybrid): the memory controller has its own tree and
	 * says "no limit" with a huge number. */
	tree_write("cgroup", "12:cpu,cpuacct:/x\n4:memory:/a/b\n0::/\n");
	tree_write("fs/memory/a/b/memory.limit_in_bytes", "9223372036854771712\n");
	tree_write("fs/memory/a/memory.limit_in_bytes", "%llu\n", 6 * GIB);
	tree_write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");
	ck_assert_uint_eq(tree_limit(), 6 * GIB);
	tree_write("fs/memory/a/memory.limit_in_bytes", "9223372036854771712\n");
	ck_assert_uint_eq(tree_limit(), 0);
	/* No cgroup file at all: no limit. */
	tree_write("cgroup", "%s", "");
	ck_assert_uint_eq(tree_limit(), 0);
	directory_remove(tree);
}
END_TEST

START_TEST(descriptors_needed_follow_the_limits)
{
	struct options o;
	char formula[128];

	options_default(&o);
	o.max_connections = 10;
	o.max_sessions = 20;
	o.retain_bytes = 0;
	snprintf(o.metrics_listen, sizeof(o.metrics_listen), "off");
	ck_assert_uint_eq(resources_descriptors_needed(&o),
			  RESOURCES_FIXED_DESCRIPTORS + 10 * CONNECTION_DESCRIPTORS + 20);
	resources_descriptors_formula(&o, formula, sizeof(formula));
	ck_assert_msg(strstr(formula, "per connection") && strstr(formula, "per session") &&
			      !strstr(formula, "metrics"), "%s", formula);
	snprintf(o.metrics_listen, sizeof(o.metrics_listen), "127.0.0.1:0");
	ck_assert_uint_eq(resources_descriptors_needed(&o),
			  RESOURCES_FIXED_DESCRIPTORS + 10 * CONNECTION_DESCRIPTORS + 20 +
				  HTTP_FIXED_DESCRIPTORS + HTTP_CONNECTION_LIMIT);
	resources_descriptors_formula(&o, formula, sizeof(formula));
	ck_assert_msg(strstr(formula, "metrics"), "%s", formula);
	/* Retained maps hold a descriptor each. */
	o.retain_bytes = 1 << 20;
	ck_assert_uint_eq(resources_descriptors_needed(&o),
			  RESOURCES_FIXED_DESCRIPTORS + 10 * CONNECTION_DESCRIPTORS + 20 +
				  HTTP_FIXED_DESCRIPTORS + HTTP_CONNECTION_LIMIT + RETAIN_MAX_MAPS);
	resources_descriptors_formula(&o, formula, sizeof(formula));
	ck_assert_msg(strstr(formula, "retained maps"), "%s", formula);
}
END_TEST

START_TEST(soft_descriptor_limit_goes_up_to_the_hard_one)
{
	struct rlimit limit;
	uint64_t before, soft, hard;

	/* Only the soft limit is lowered: the hard one stays as it is, since
	 * valgrind refuses any change to it (it keeps descriptors of its own
	 * above the limit it shows), and the test is about the soft one. An
	 * infinite hard limit is brought down to a number to compare with. */
	ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &limit), 0);
	if (limit.rlim_max == RLIM_INFINITY)
		limit.rlim_max = 512;
	ck_assert_msg(limit.rlim_max > 64, "hard descriptor limit %llu leaves nothing to raise",
		      (unsigned long long)limit.rlim_max);
	const uint64_t hard_limit = limit.rlim_max;
	limit.rlim_cur = 64;
	/* Check runs this in its own process: the limit dies with it. */
	ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &limit), 0);
	ck_assert_int_eq(resources_raise_descriptor_limit(&before, &soft, &hard), 0);
	ck_assert_uint_eq(before, 64);
	ck_assert_uint_eq(soft, hard_limit);
	ck_assert_uint_eq(hard, hard_limit);
	ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &limit), 0);
	ck_assert_uint_eq(limit.rlim_cur, hard_limit);
	/* Already there: nothing to do. */
	ck_assert_int_eq(resources_raise_descriptor_limit(&before, &soft, &hard), 0);
	ck_assert_uint_eq(before, hard_limit);
}
END_TEST

static Suite *resources_suite(void)
{
	Suite *suite = suite_create("resources");
	const struct test_case cases[] = {
		{ "memory", { budget_is_the_smaller_less_headroom, cgroup_v2_takes_the_tightest_ancestor,
			      cgroup_namespace_shows_only_its_root, cgroup_v1_memory_controller, NULL } },
		{ "descriptors", { descriptors_needed_follow_the_limits,
				   soft_descriptor_limit_goes_up_to_the_hard_one, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 30);
	return suite;
}

int main(void)
{
	/* The descriptor test changes its process's limit: fork mode. */
	return suite_main(resources_suite(), CK_FORK);
}
