/*
 * The daemon's worker threads. Jobs too costly for the loop thread (a
 * prefill block, a view rebuild, a residual flush's compression, an
 * import) run here, FIFO, at a lower priority than the loop; each task's
 * `after` then runs on the loop thread, in the order the tasks finished.
 *
 * Not libuv's thread pool, for one reason: in libuv 1.44 (Debian 12) a
 * worker announces a finished task by setting the async handle's flag,
 * writing the loop's eventfd and then clearing the flag, and the loop
 * spins (997 pauses, then sched_yield, again and again) while it sees the
 * flag set. A loop woken by that write on the worker's own CPU preempts
 * the worker between the write and the clear, and then spins until the
 * scheduler gives a nicer worker the CPU back: ~200 us per task measured
 * on a daemon given one CPU, 6 % of a prefill. Here a task is on the
 * finished list before the eventfd is written, and the loop never waits
 * for a worker.
 */
#ifndef ZIPCACHED_WORKERS_H
#define ZIPCACHED_WORKERS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

/* Threads when UV_THREADPOOL_SIZE (libuv's variable, which deployments
 * used to size the pool this replaces) does not say; at most
 * WORKERS_MAX. */
#define WORKERS_DEFAULT 4u
#define WORKERS_MAX 128u

struct worker_task {
	struct worker_task *next;
	void (*work)(struct worker_task *task);    /* on a worker thread */
	void (*after)(struct worker_task *task);   /* then on the loop thread; may free task */
};

struct workers {
	uv_loop_t *loop;
	uv_poll_t poll;               /* the eventfd, readable when tasks finished */
	int event_fd;
	bool open;                    /* poll initialized and not closed */
	pthread_mutex_t lock;
	pthread_cond_t wake;
	struct worker_task *queue_head, *queue_tail;   /* to run */
	struct worker_task *done_head, *done_tail;     /* run, their after not yet */
	bool stopping;
	unsigned threads;             /* started */
	uint64_t in_flight;           /* submitted, after not yet run (loop thread) */
	pthread_t thread[WORKERS_MAX];
};

/* Starts the threads (UV_THREADPOOL_SIZE or WORKERS_DEFAULT) and the
 * loop's watch of their finished tasks. Returns the threads started; 0
 * (logged) leaves every task to its caller (workers_submit refuses). */
unsigned workers_start(struct workers *workers, uv_loop_t *loop);

/* Queues task; returns 0, or -EAGAIN without threads (run it inline).
 * Loop thread only. */
int workers_submit(struct workers *workers, struct worker_task *task);

/* Tasks submitted whose `after` has not run yet. */
uint64_t workers_in_flight(const struct workers *workers);

/* Joins the threads once the queue is empty (tasks still queued run
 * first; their `after` never does: call it with nothing in flight) and
 * closes the watch; cb as uv_close's. */
void workers_stop(struct workers *workers, uv_close_cb cb);

#endif
