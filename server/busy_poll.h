/*
 * Busy polling after a request (--busy-poll-us): for a bounded time after
 * each request frame, the loop polls its descriptors without sleeping, so
 * that the next request of a decode loop (the next layer's update, a few
 * microseconds later) finds the daemon awake. A client's send to an awake
 * daemon costs no wake-up of a sleeping thread on another CPU, which is
 * most of an asynchronous update's cost and a part of a synchronous one's.
 *
 * The price is a CPU kept busy while requests keep coming, at most the
 * bound after the last one; with 0 (the default) the loop sleeps in
 * epoll_wait as soon as it has nothing to do. An idle daemon never spins,
 * nor one whose thread pool has work of its own in flight (the loop then
 * sleeps until that work is done, leaving the CPU to the workers).
 * Loop thread only.
 */
#ifndef ZIPCACHE_BUSY_POLL_H
#define ZIPCACHE_BUSY_POLL_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

/* The largest --busy-poll-us: a tenth of a second of spinning per request. */
#define BUSY_POLL_MAX_US 100000u

struct busy_poll {
	uv_idle_t idle;      /* active while spinning: the loop then polls with timeout 0 */
	uint64_t spin_ns;    /* 0: off */
	uint64_t last_ns;    /* uv_hrtime() of the last request */
	bool open;           /* initialized and not yet closed */
};

/* spin_us: 0 (off) .. BUSY_POLL_MAX_US, as options.c admits it. */
void busy_poll_init(struct busy_poll *poll, uv_loop_t *loop, uint32_t spin_us);

/* A request arrived: spin for the bound from now. */
void busy_poll_kick(struct busy_poll *poll);

/* Stops spinning for good (the server stops); cb as uv_close's. */
void busy_poll_close(struct busy_poll *poll, uv_close_cb cb);

#endif
