/* Busy polling after a request: see busy_poll.h. */
#include "busy_poll.h"

#include <stddef.h>

static void on_spin(uv_idle_t *idle)
{
	struct busy_poll *poll = idle->data;
	/* An idle handle only makes the loop poll without a timeout; the
	 * requests themselves arrive through the connections' polls. While
	 * the worker threads have work of the loop's (a residual flush, a
	 * large block, a rebuild), the loop sleeps: those
	 * workers may share its CPU, and the request that waits for them
	 * would wait longer behind a spinning loop (measured: the step after
	 * a flush, 94 -> 210 us on one CPU). */
	if (uv_hrtime() >= poll->until_ns || workers_in_flight(poll->workers) > 0)
		uv_idle_stop(idle);
}

uint32_t busy_poll_ring_default(int cpus_online)
{
	return cpus_online >= 2 ? RING_POLL_DEFAULT_US : 0;
}

void busy_poll_init(struct busy_poll *poll, uv_loop_t *loop, const struct workers *workers)
{
	poll->until_ns = 0;
	poll->workers = workers;
	uv_idle_init(loop, &poll->idle);
	poll->idle.data = poll;
	poll->open = true;
}

void busy_poll_kick(struct busy_poll *poll, uint32_t spin_us)
{
	if (!poll->open || spin_us == 0)
		return;
	uint64_t until = uv_hrtime() + (uint64_t)spin_us * 1000u;
	if (until > poll->until_ns)
		poll->until_ns = until;
	if (!uv_is_active((uv_handle_t *)&poll->idle))
		uv_idle_start(&poll->idle, on_spin);
}

void busy_poll_close(struct busy_poll *poll, uv_close_cb cb)
{
	if (!poll->open)
		return;
	poll->open = false;
	uv_close((uv_handle_t *)&poll->idle, cb);
}
