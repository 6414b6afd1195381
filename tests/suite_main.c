/* The shared main() of the Check suites (tests/suite_main.h). */
#include "suite_main.h"

#include <stdlib.h>

void suite_add_cases(Suite *suite, const struct test_case *cases, size_t count,
		     int timeout_seconds)
{
	for (size_t i = 0; i < count; i++) {
		TCase *tc = tcase_create(cases[i].name);
		tcase_set_timeout(tc, timeout_seconds);
		for (size_t j = 0; cases[i].tests[j]; j++)
			tcase_add_test(tc, cases[i].tests[j]);
		suite_add_tcase(suite, tc);
	}
}

int suite_main(Suite *suite, enum fork_status fork_mode)
{
	SRunner *runner = srunner_create(suite);
	int failed;

	srunner_set_fork_status(runner, fork_mode);
	srunner_run_all(runner, CK_NORMAL);
	failed = srunner_ntests_failed(runner);
	srunner_free(runner);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
