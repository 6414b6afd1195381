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
 *
 * Requests taken from a request ring (ring_pump.c) kick it with their own
 * bound, --ring-poll-us: a client that set up a ring hands updates over
 * through memory, and a loop still polling finds the next one without the
 * eventfd write that would wake it (docs/RING.md). The longer of the two
 * bounds in force wins. Loop thread only.
 */
#ifndef ZIPCACHE_BUSY_POLL_H
#define ZIPCACHE_BUSY_POLL_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "workers.h"

/* The largest --busy-poll-us and --ring-poll-us: a tenth of a second of
 * spinning per request. */
#define BUSY_POLL_MAX_US 100000u

/* --ring-poll-us when not given: RING_POLL_DEFAULT_US on a machine with
 * two CPUs or more online, else 0 (on one CPU the spin would hold off the
 * very client whose next request it waits for). Not the CPUs zipcached
 * may use: a daemon pinned to one core of a large machine is the case
 * polling is for. The default bound covers a layer's attention between
 * two updates of a decode step (tens of microseconds). */
#define RING_POLL_AUTO UINT32_MAX
#define RING_POLL_DEFAULT_US 50u

/* What RING_POLL_AUTO means on a machine with `cpus_online` CPUs. */
uint32_t busy_poll_ring_default(int cpus_online);

struct busy_poll {
	uv_idle_t idle;      /* active while spinning: the loop then polls with timeout 0 */
	uint64_t until_ns;   /* uv_hrtime() the spin ends at */
	bool open;           /* initialized and not yet closed */
	const struct workers *workers;  /* whose tasks in flight stop the spin */
};

void busy_poll_init(struct busy_poll *poll, uv_loop_t *loop, const struct workers *workers);

/* A request arrived: spin for spin_us (0 .. BUSY_POLL_MAX_US, as
 * options.c admits it; 0 does nothing) from now. */
void busy_poll_kick(struct busy_poll *poll, uint32_t spin_us);

/* Stops spinning for good (the server stops); cb as uv_close's. */
void busy_poll_close(struct busy_poll *poll, uv_close_cb cb);

#endif
