/*
 * Takes the entries of the connections' request rings (ring.c) into their
 * connections, as frames, at the loop's two edges: after every poll (the
 * loop is awake: clients need not ring) and before it sleeps (the wakeup
 * flag set, the tails looked at again). While entries wait that a
 * connection could take, an idle handle keeps the loop from sleeping.
 */
#ifndef ZIPCACHE_RING_PUMP_H
#define ZIPCACHE_RING_PUMP_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

struct server;

struct ring_pump {
	uv_prepare_t prepare;
	uv_check_t check;
	uv_idle_t idle;
	struct server *server;
	uint8_t *frame;          /* an entry copied out of its ring: header, body */
	uint32_t frame_bytes;    /* the largest body it holds */
	bool open;
};

void ring_pump_init(struct ring_pump *pump, struct server *server);
/* Makes the buffer entries are copied into (once): before the first ring
 * is made, so that no ring waits for a buffer. 0 or -ENOMEM. */
int ring_pump_reserve(struct ring_pump *pump);
/* Closes the three handles (cb for each). */
void ring_pump_close(struct ring_pump *pump, uv_close_cb cb);

#endif
