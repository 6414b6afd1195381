/* The daemon's worker threads: see workers.h. */
#include "workers.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include "log.h"

/*
 * How much nicer than the daemon the workers run. Their tasks are bulk
 * work (prefill blocks, residual flushes, view rebuilds); the loop thread
 * answers every client's next decode step. At the same priority, a loop
 * thread woken on the CPU a worker holds waits out the worker's time
 * slice (milliseconds: decode p99 x3-4 during a rebuild in the service
 * benchmark, daemon on one CPU); ten steps nicer it runs at once, and a
 * worker still gets all of a CPU nothing else wants (a tenth of one that
 * a busy process shares). Threads a task starts (the codec's fanout, a
 * snapshot's writers) inherit it.
 */
#define WORKER_NICE 10

static void lower_priority(void)
{
	id_t self = (id_t)gettid();
	errno = 0;
	int nice = getpriority(PRIO_PROCESS, self);
	if ((nice == -1 && errno) || setpriority(PRIO_PROCESS, self, nice + WORKER_NICE) < 0)
		log_warn("workers", "cannot lower a worker's priority", "error=%s", strerror(errno));
}

static void *worker_main(void *arg)
{
	struct workers *w = arg;
	lower_priority();
	pthread_mutex_lock(&w->lock);
	for (;;) {
		while (!w->queue_head && !w->stopping)
			pthread_cond_wait(&w->wake, &w->lock);
		struct worker_task *task = w->queue_head;
		if (!task)
			break;
		w->queue_head = task->next;
		if (!w->queue_head)
			w->queue_tail = NULL;
		pthread_mutex_unlock(&w->lock);

		task->work(task);

		pthread_mutex_lock(&w->lock);
		task->next = NULL;
		bool was_empty = !w->done_head;
		if (w->done_tail)
			w->done_tail->next = task;
		else
			w->done_head = task;
		w->done_tail = task;
		if (was_empty) {
			/* The task is on the list before the loop can wake: a loop
			 * that preempts us here finds it, and waits for nothing.
			 * Whoever makes the list non-empty writes, so a loop that
			 * took the list before this write wakes once for nothing. */
			pthread_mutex_unlock(&w->lock);
			uint64_t one = 1;
			ssize_t n;
			do
				n = write(w->event_fd, &one, sizeof(one));
			while (n < 0 && errno == EINTR);
			pthread_mutex_lock(&w->lock);
		}
	}
	pthread_mutex_unlock(&w->lock);
	return NULL;
}

static void on_finished(uv_poll_t *poll, int status, int events)
{
	struct workers *w = poll->data;
	(void)status;
	(void)events;
	uint64_t count;
	/* Read before taking the list: a write after this read wakes us again. */
	while (read(w->event_fd, &count, sizeof(count)) < 0 && errno == EINTR)
		;
	pthread_mutex_lock(&w->lock);
	struct worker_task *task = w->done_head;
	w->done_head = w->done_tail = NULL;
	pthread_mutex_unlock(&w->lock);
	while (task) {
		struct worker_task *next = task->next;
		if (--w->in_flight == 0)
			uv_unref((uv_handle_t *)&w->poll);
		task->after(task);
		task = next;
	}
}

static unsigned threads_wanted(void)
{
	const char *env = getenv("UV_THREADPOOL_SIZE");
	if (!env || !*env)
		return WORKERS_DEFAULT;
	char *end = NULL;
	errno = 0;
	unsigned long n = *env >= '0' && *env <= '9' ? strtoul(env, &end, 10) : 0;
	if (errno || n == 0 || *end) {
		log_warn("workers", "UV_THREADPOOL_SIZE ignored", "value=\"%s\" threads=%u", env,
			 WORKERS_DEFAULT);
		return WORKERS_DEFAULT;
	}
	return n > WORKERS_MAX ? WORKERS_MAX : (unsigned)n;
}

unsigned workers_start(struct workers *w, uv_loop_t *loop)
{
	memset(w, 0, sizeof(*w));
	w->loop = loop;
	w->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (w->event_fd < 0) {
		log_warn("workers", "no worker threads: every job runs on the loop thread",
			 "error=%s", strerror(errno));
		return 0;
	}
	pthread_mutex_init(&w->lock, NULL);
	pthread_cond_init(&w->wake, NULL);
	int rc = uv_poll_init(loop, &w->poll, w->event_fd);
	if (rc == 0) {
		w->open = true;
		w->poll.data = w;
		rc = uv_poll_start(&w->poll, UV_READABLE, on_finished);
	}
	if (rc < 0) {
		log_warn("workers", "no worker threads: every job runs on the loop thread",
			 "error=%s", uv_strerror(rc));
		workers_stop(w, NULL);
		return 0;
	}
	/* Like libuv's queued work, tasks in flight keep the loop alive;
	 * idle workers do not. */
	uv_unref((uv_handle_t *)&w->poll);
	unsigned wanted = threads_wanted();
	/* Signals go to the loop thread (libuv's handlers), never to a worker,
	 * whose fallocate or write they would cut short: the threads start
	 * with every signal blocked (a new thread inherits the mask). */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (unsigned i = 0; i < wanted; i++) {
		int err = pthread_create(&w->thread[w->threads], NULL, worker_main, w);
		if (err) {
			log_warn("workers", "fewer worker threads", "started=%u wanted=%u error=%s",
				 w->threads, wanted, strerror(err));
			break;
		}
		w->threads++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return w->threads;
}

int workers_submit(struct workers *w, struct worker_task *task)
{
	if (!w || w->threads == 0 || w->stopping)
		return -EAGAIN;
	task->next = NULL;
	if (w->in_flight++ == 0)
		uv_ref((uv_handle_t *)&w->poll);
	pthread_mutex_lock(&w->lock);
	if (w->queue_tail)
		w->queue_tail->next = task;
	else
		w->queue_head = task;
	w->queue_tail = task;
	pthread_cond_signal(&w->wake);
	pthread_mutex_unlock(&w->lock);
	return 0;
}

uint64_t workers_in_flight(const struct workers *w)
{
	return w->in_flight;
}

void workers_stop(struct workers *w, uv_close_cb cb)
{
	if (!w->loop)
		return;   /* never started */
	if (w->threads) {
		pthread_mutex_lock(&w->lock);
		w->stopping = true;
		pthread_cond_broadcast(&w->wake);
		pthread_mutex_unlock(&w->lock);
		for (unsigned i = 0; i < w->threads; i++)
			pthread_join(w->thread[i], NULL);
		w->threads = 0;
	}
	if (w->open) {
		w->open = false;
		uv_close((uv_handle_t *)&w->poll, cb);
	}
	if (w->event_fd >= 0) {
		/* uv_close took it out of the loop's epoll set. */
		close(w->event_fd);
		w->event_fd = -1;
		pthread_cond_destroy(&w->wake);
		pthread_mutex_destroy(&w->lock);
	}
	w->loop = NULL;
}
