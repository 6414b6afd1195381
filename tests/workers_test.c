/*
 * server/workers.c: tasks run on worker threads, nicer than the loop, and
 * each one's `after` runs on the loop thread once its work is done, in
 * the order they finished (submission order with one thread), with every
 * signal blocked in the workers (the caller's mask untouched); tasks in
 * flight keep the loop alive and idle workers do not; an `after` may
 * submit more; UV_THREADPOOL_SIZE sizes the crew as it sized libuv's
 * pool; without threads a submit is refused (the caller runs inline); a
 * stop joins the threads and leaves nothing open in the loop.
 */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include <uv.h>

#include "../server/workers.h"
#include "suite_main.h"

#define TEST_TIMEOUT_SECONDS 60
#define TASKS 300

struct probe {
	struct worker_task task;
	struct workers *workers;
	unsigned index;
	pid_t work_tid, after_tid;
	int work_nice;
	bool signals_blocked;         /* SIGTERM and SIGINT, in the worker */
	atomic_bool worked;
	bool worked_before_after;
	unsigned chain;               /* more tasks to submit from after */
};

static pid_t loop_tid;
static unsigned after_order[TASKS];
static unsigned afters;

static void probe_work(struct worker_task *task)
{
	struct probe *p = (struct probe *)task;
	p->work_tid = gettid();
	sigset_t mask;
	pthread_sigmask(SIG_SETMASK, NULL, &mask);
	p->signals_blocked = sigismember(&mask, SIGTERM) == 1 && sigismember(&mask, SIGINT) == 1;
	errno = 0;
	p->work_nice = getpriority(PRIO_PROCESS, (id_t)p->work_tid);
	/* Some work, so that tasks overlap and finish out of order. */
	volatile uint64_t x = p->index;
	for (unsigned i = 0; i < 2000u * (p->index % 7 + 1); i++)
		x = x * 6364136223846793005ull + 1442695040888963407ull;
	atomic_store(&p->worked, true);
}

static void probe_after(struct worker_task *task)
{
	struct probe *p = (struct probe *)task;
	p->after_tid = gettid();
	p->worked_before_after = atomic_load(&p->worked);
	if (afters < TASKS)
		after_order[afters] = p->index;
	afters++;
	if (p->chain) {
		struct probe *next = p + 1;
		next->chain = p->chain - 1;
		ck_assert_int_eq(workers_submit(p->workers, &next->task), 0);
	}
}

static void probes_init(struct probe *probes, struct workers *w)
{
	for (unsigned i = 0; i < TASKS; i++)
		probes[i] = (struct probe){ .task = { .work = probe_work, .after = probe_after },
					    .workers = w, .index = i };
	afters = 0;
	loop_tid = gettid();
}

/* A loop and a crew sized by UV_THREADPOOL_SIZE=size (NULL: unset). */
static unsigned crew_open(uv_loop_t *loop, struct workers *w, const char *size)
{
	ck_assert_int_eq(uv_loop_init(loop), 0);
	if (size)
		setenv("UV_THREADPOOL_SIZE", size, 1);
	else
		unsetenv("UV_THREADPOOL_SIZE");
	unsigned started = workers_start(w, loop);
	unsetenv("UV_THREADPOOL_SIZE");
	return started;
}

static void loop_close_all(uv_loop_t *loop, struct workers *w)
{
	workers_stop(w, NULL);
	ck_assert_uint_eq(w->threads, 0);
	uv_run(loop, UV_RUN_DEFAULT);
	ck_assert_int_eq(uv_loop_close(loop), 0);
}

START_TEST(afters_run_on_the_loop_once_their_work_is_done)
{
	static struct probe probes[TASKS];
	uv_loop_t loop;
	struct workers w;
	sigset_t before, after;
	pthread_sigmask(SIG_SETMASK, NULL, &before);
	ck_assert_uint_eq(crew_open(&loop, &w, "3"), 3);
	pthread_sigmask(SIG_SETMASK, NULL, &after);
	ck_assert_int_eq(sigismember(&after, SIGTERM), sigismember(&before, SIGTERM));
	probes_init(probes, &w);
	errno = 0;
	int loop_nice = getpriority(PRIO_PROCESS, (id_t)loop_tid);
	for (unsigned i = 0; i < TASKS; i++)
		ck_assert_int_eq(workers_submit(&w, &probes[i].task), 0);
	ck_assert_uint_eq(workers_in_flight(&w), TASKS);
	/* Only the tasks keep this loop alive: it returns once every after ran. */
	uv_run(&loop, UV_RUN_DEFAULT);
	ck_assert_uint_eq(afters, TASKS);
	ck_assert_uint_eq(workers_in_flight(&w), 0);
	bool seen[TASKS] = { false };
	int expected_nice = loop_nice + 10 > 19 ? 19 : loop_nice + 10;
	for (unsigned i = 0; i < TASKS; i++) {
		ck_assert_uint_lt(after_order[i], TASKS);
		ck_assert(!seen[after_order[i]]);
		seen[after_order[i]] = true;
		ck_assert_int_ne(probes[i].work_tid, loop_tid);
		ck_assert_int_eq(probes[i].after_tid, loop_tid);
		ck_assert(probes[i].worked_before_after);
		ck_assert_int_eq(probes[i].work_nice, expected_nice);
		ck_assert(probes[i].signals_blocked);
	}
	loop_close_all(&loop, &w);
}
END_TEST

START_TEST(one_thread_finishes_tasks_in_the_order_given)
{
	static struct probe probes[TASKS];
	uv_loop_t loop;
	struct workers w;
	ck_assert_uint_eq(crew_open(&loop, &w, "1"), 1);
	probes_init(probes, &w);
	for (unsigned i = 0; i < TASKS; i++)
		ck_assert_int_eq(workers_submit(&w, &probes[i].task), 0);
	uv_run(&loop, UV_RUN_DEFAULT);
	ck_assert_uint_eq(afters, TASKS);
	for (unsigned i = 0; i < TASKS; i++)
		ck_assert_uint_eq(after_order[i], i);
	loop_close_all(&loop, &w);
}
END_TEST

START_TEST(an_after_may_submit_the_next_task)
{
	static struct probe probes[TASKS];
	uv_loop_t loop;
	struct workers w;
	ck_assert_uint_eq(crew_open(&loop, &w, NULL), WORKERS_DEFAULT);
	probes_init(probes, &w);
	probes[0].chain = TASKS - 1;
	ck_assert_int_eq(workers_submit(&w, &probes[0].task), 0);
	uv_run(&loop, UV_RUN_DEFAULT);
	ck_assert_uint_eq(afters, TASKS);
	for (unsigned i = 0; i < TASKS; i++) {
		ck_assert_uint_eq(after_order[i], i);
		ck_assert(probes[i].worked_before_after);
	}
	loop_close_all(&loop, &w);
}
END_TEST

START_TEST(idle_workers_do_not_keep_the_loop_alive)
{
	uv_loop_t loop;
	struct workers w;
	ck_assert_uint_gt(crew_open(&loop, &w, NULL), 0);
	/* Nothing in flight: returns at once (0: no active handle left). */
	ck_assert_int_eq(uv_run(&loop, UV_RUN_DEFAULT), 0);
	loop_close_all(&loop, &w);
}
END_TEST

START_TEST(the_crew_is_sized_as_libuvs_pool_was)
{
	static const struct {
		const char *value;
		unsigned threads;
	} cases[] = {
		{ NULL, WORKERS_DEFAULT }, { "", WORKERS_DEFAULT }, { "2", 2 },
		{ "0", WORKERS_DEFAULT },  { "-3", WORKERS_DEFAULT }, { "7x", WORKERS_DEFAULT },
		{ "1000", WORKERS_MAX },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uv_loop_t loop;
		struct workers w;
		unsigned started = crew_open(&loop, &w, cases[i].value);
		ck_assert_msg(started == cases[i].threads, "UV_THREADPOOL_SIZE=%s: %u threads",
			      cases[i].value ? cases[i].value : "(unset)", started);
		loop_close_all(&loop, &w);
	}
}
END_TEST

START_TEST(without_threads_a_submit_is_refused)
{
	struct workers never_started;
	struct probe p = { .task = { .work = probe_work, .after = probe_after } };
	memset(&never_started, 0, sizeof(never_started));
	ck_assert_int_eq(workers_submit(NULL, &p.task), -EAGAIN);
	ck_assert_int_eq(workers_submit(&never_started, &p.task), -EAGAIN);
	ck_assert_uint_eq(workers_in_flight(&never_started), 0);
	workers_stop(&never_started, NULL);   /* nothing to stop: no effect */

	uv_loop_t loop;
	struct workers w;
	ck_assert_uint_gt(crew_open(&loop, &w, NULL), 0);
	loop_close_all(&loop, &w);
	/* Stopped: refused, and stopping again does nothing. */
	ck_assert_int_eq(workers_submit(&w, &p.task), -EAGAIN);
	workers_stop(&w, NULL);
	ck_assert(!atomic_load(&p.worked));
}
END_TEST

static Suite *workers_suite(void)
{
	Suite *s = suite_create("workers");
	TCase *tc = tcase_create("workers");
	tcase_set_timeout(tc, TEST_TIMEOUT_SECONDS);
	tcase_add_test(tc, afters_run_on_the_loop_once_their_work_is_done);
	tcase_add_test(tc, one_thread_finishes_tasks_in_the_order_given);
	tcase_add_test(tc, an_after_may_submit_the_next_task);
	tcase_add_test(tc, idle_workers_do_not_keep_the_loop_alive);
	tcase_add_test(tc, the_crew_is_sized_as_libuvs_pool_was);
	tcase_add_test(tc, without_threads_a_submit_is_refused);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return suite_main(workers_suite(), CK_FORK_GETENV);
}
