/* The request rings taken into their connections: see ring_pump.h. */
#include "ring_pump.h"

#include <errno.h>
#include <stdlib.h>

#include "busy_poll.h"
#include "connection.h"
#include "frame.h"
#include "log.h"
#include "ring.h"
#include "ring_format.h"
#include "server.h"
#include "zipcache/error.h"

/* Entries one connection gives per turn, so that one busy client does
 * not hold the loop from the others. */
#define RING_PUMP_BATCH 64u

/* Takes what a connection's ring holds, as far as the connection takes
 * frames; true when entries wait that it could take on another turn. */
static bool pump_client(struct ring_pump *pump, struct client *client)
{
	struct ring *ring = client->peer.ring;
	char why[200];
	unsigned n = 0;

	while (client->peer.ring && connection_accepting(&client->connection)) {
		if (n == RING_PUMP_BATCH)
			return ring_pending(ring);
		uint32_t len;
		int rc = ring_next(ring, pump->frame, pump->frame_bytes, &len, why, sizeof(why));
		if (rc == 0)
			break;
		if (rc < 0) {
			log_warn("ring", "connection closed", "connection=%llu uid=%u pid=%d why=\"%s\"",
				 (unsigned long long)client->connection.id, client->connection.uid,
				 (int)client->connection.pid, why);
			connection_close(&client->connection);
			return false;
		}
		pump->server->counters.ring_requests++;
		busy_poll_kick(&pump->server->busy_poll, pump->server->options.ring_poll_us);
		connection_deliver(&client->connection, pump->frame + FRAME_HEADER_BYTES, len);
		n++;
	}
	return false;
}

static bool pump_all(struct ring_pump *pump)
{
	bool more = false;
	for (struct client *c = pump->server->clients, *next; c; c = next) {
		next = c->next;
		if (c->peer.ring)
			more |= pump_client(pump, c);
	}
	return more;
}

static void on_idle(uv_idle_t *idle)
{
	(void)idle;   /* only keeps the poll from sleeping; check does the work */
}

static void keep_awake(struct ring_pump *pump, bool awake)
{
	if (awake && !uv_is_active((uv_handle_t *)&pump->idle))
		uv_idle_start(&pump->idle, on_idle);
	else if (!awake && uv_is_active((uv_handle_t *)&pump->idle))
		uv_idle_stop(&pump->idle);
}

int ring_pump_reserve(struct ring_pump *pump)
{
	if (pump->frame)
		return 0;
	uint32_t bytes = pump->server->options.max_frame_bytes;
	if (bytes > RING_MAX_BYTES)
		bytes = RING_MAX_BYTES;
	pump->frame = malloc((size_t)bytes + FRAME_HEADER_BYTES);
	if (!pump->frame) {
		log_error("ring", "no memory for the rings' frame buffer", "bytes=%u", bytes);
		return -ENOMEM;
	}
	pump->frame_bytes = bytes;
	return 0;
}

/* Whether there is work: a ring exists only once ring_pump_reserve made
 * the buffer. */
static bool pump_ready(const struct ring_pump *pump)
{
	return pump->server->rings > 0 && pump->frame;
}

static void on_check(uv_check_t *check)
{
	struct ring_pump *pump = check->data;
	if (!pump_ready(pump))
		return;
	for (struct client *c = pump->server->clients; c; c = c->next)
		if (c->peer.ring)
			ring_awake(c->peer.ring);
	keep_awake(pump, pump_all(pump));
}

static void on_prepare(uv_prepare_t *prepare)
{
	struct ring_pump *pump = prepare->data;
	if (!pump_ready(pump))
		return;
	bool more = pump_all(pump);
	keep_awake(pump, more);
	/* Only a loop that will sleep asks to be rung: one that polls
	 * anyway (busy polling, work pending) finds the entries itself. */
	if (more || uv_backend_timeout(pump->server->loop) == 0)
		return;
	bool came = false;
	for (struct client *c = pump->server->clients; c; c = c->next)
		if (c->peer.ring && connection_accepting(&c->connection))
			came |= ring_sleep(c->peer.ring);
	/* An entry came before the flag was seen: take it on another turn. */
	keep_awake(pump, came);
}

void ring_pump_init(struct ring_pump *pump, struct server *server)
{
	pump->server = server;
	pump->frame = NULL;
	pump->frame_bytes = 0;
	uv_prepare_init(server->loop, &pump->prepare);
	uv_check_init(server->loop, &pump->check);
	uv_idle_init(server->loop, &pump->idle);
	pump->prepare.data = pump->check.data = pump->idle.data = pump;
	uv_prepare_start(&pump->prepare, on_prepare);
	uv_check_start(&pump->check, on_check);
	/* They never keep the loop alive by themselves. */
	uv_unref((uv_handle_t *)&pump->prepare);
	uv_unref((uv_handle_t *)&pump->check);
	pump->open = true;
}

void ring_pump_close(struct ring_pump *pump, uv_close_cb cb)
{
	if (!pump->open)
		return;
	pump->open = false;
	uv_close((uv_handle_t *)&pump->prepare, cb);
	uv_close((uv_handle_t *)&pump->check, cb);
	uv_close((uv_handle_t *)&pump->idle, cb);
	free(pump->frame);
	pump->frame = NULL;
}
