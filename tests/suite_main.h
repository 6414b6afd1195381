/*
 * The main() every Check suite here would otherwise repeat.
 */
#ifndef ZIPCACHE_TESTS_SUITE_MAIN_H
#define ZIPCACHE_TESTS_SUITE_MAIN_H

#include <check.h>
#include <stddef.h>

/* A test case by name and its tests, NULL-terminated. */
struct test_case {
	const char *name;
	const TTest *tests[16];
};

/* Adds each case, its tests in order, with the same timeout. */
void suite_add_cases(Suite *suite, const struct test_case *cases, size_t count,
		     int timeout_seconds);

/*
 * Runs the suite (CK_NORMAL output) and returns main()'s exit status:
 * EXIT_SUCCESS when no test failed. fork_mode is CK_FORK for suites whose
 * tests own daemons and helper processes that must die with the test's own
 * process (only fork mode gives each test one), or CK_FORK_GETENV to leave
 * it to $CK_FORK, Check's default.
 */
int suite_main(Suite *suite, enum fork_status fork_mode);

#endif
