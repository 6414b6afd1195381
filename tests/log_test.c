/*
 * The log's rate limit (server/log.c): a flood of one event costs a burst
 * of lines and then one line that says how many were left out; other
 * events and debug lines are not held back by it.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../server/log.h"
#include "process_run.h"
#include "suite_main.h"

/* stderr goes to a temporary file for the test; returns that file. */
static FILE *stderr_capture(void)
{
	FILE *file = tmpfile();
	ck_assert_ptr_nonnull(file);
	fflush(stderr);
	ck_assert_int_ge(dup2(fileno(file), STDERR_FILENO), 0);
	return file;
}

/* What was written so far, NUL-terminated (caller frees). */
static char *captured(FILE *file)
{
	fflush(stderr);
	long size = lseek(fileno(file), 0, SEEK_END);
	ck_assert_int_ge(size, 0);
	char *text = calloc(1, (size_t)size + 1);
	ck_assert_ptr_nonnull(text);
	ck_assert_int_eq(pread(fileno(file), text, (size_t)size, 0), size);
	return text;
}

static int count(const char *text, const char *needle)
{
	int n = 0;
	for (const char *p = text; (p = strstr(p, needle)) != NULL; p += strlen(needle))
		n++;
	return n;
}

START_TEST(a_flood_costs_a_burst_and_a_count)
{
	FILE *file = stderr_capture();
	log_set_level(LOG_INFO);
	log_set_rate_limit(3, 300);
	for (int i = 0; i < 1000; i++)
		log_warn("server", "accept failed", "error=%s attempt=%d", "Too many open files", i);
	log_warn("server", "other event", "n=%d", 1);
	char *text = captured(file);
	ck_assert_msg(count(text, "event=\"accept failed\"") == 3,
		      "the flood wrote %d lines, want the burst of 3:\n%s",
		      count(text, "event=\"accept failed\""), text);
	ck_assert_msg(strstr(text, "attempt=2\n") && !strstr(text, "attempt=3"),
		      "the first three lines, whole, and none after:\n%s", text);
	ck_assert_msg(count(text, "event=\"other event\" n=1") == 1, "another event held back:\n%s", text);
	free(text);

	/* After the window the next line says what was left out. */
	sleep_ms(350);
	log_warn("server", "accept failed", "error=%s attempt=%d", "Too many open files", 1000);
	text = captured(file);
	ck_assert_msg(strstr(text, "attempt=1000 suppressed=997\n"),
		      "the line after the window does not count the 997 left out:\n%s", text);
	free(text);
	fclose(file);
}
END_TEST

START_TEST(debug_lines_are_never_suppressed)
{
	FILE *file = stderr_capture();
	log_set_level(LOG_DEBUG);
	log_set_rate_limit(2, 60000);
	for (int i = 0; i < 50; i++)
		log_debug("dispatch", "request refused", "i=%d", i);
	char *text = captured(file);
	ck_assert_int_eq(count(text, "event=\"request refused\""), 50);
	free(text);
	fclose(file);
}
END_TEST

START_TEST(many_events_each_get_their_burst)
{
	FILE *file = stderr_capture();
	char event[32];
	log_set_level(LOG_INFO);
	log_set_rate_limit(2, 60000);
	/* More events than the table has slots: collisions take slots over,
	 * and what a slot had counted is written, not lost. */
	for (int round = 0; round < 5; round++)
		for (int e = 0; e < 100; e++) {
			snprintf(event, sizeof(event), "event %d", e);
			log_info("test", event, "round=%d", round);
		}
	char *text = captured(file);
	int lines = count(text, "\n");
	ck_assert_msg(lines >= 200 && lines <= 500, "%d lines for 100 events x 5", lines);
	for (int e = 0; e < 100; e++) {
		char needle[48];
		snprintf(needle, sizeof(needle), "event=\"event %d\" round=0", e);
		ck_assert_msg(strstr(text, needle), "no first line for event %d", e);
	}
	free(text);
	fclose(file);
}
END_TEST

static Suite *log_suite(void)
{
	Suite *suite = suite_create("log");
	const struct test_case cases[] = {
		{ "rate_limit", { a_flood_costs_a_burst_and_a_count, debug_lines_are_never_suppressed,
				  many_events_each_get_their_burst, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 30);
	return suite;
}

int main(void)
{
	/* Each test redirects stderr: fork mode keeps that to the test. */
	return suite_main(log_suite(), CK_FORK);
}
