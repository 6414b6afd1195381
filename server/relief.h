/*
 * Memory relief: what the daemon does when the memory budget, or a uid's
 * quota, refuses a charge (STORE_EBUDGET from a store, a staging buffer,
 * an open). One policy, its steps in this order:
 *
 *   0. release_retained  Free the pages kept from closed sessions for
 *                  reuse (server/retain.h: spare maps, then the pools'
 *                  kept extents), the uid's own when its quota is short,
 *                  else every uid's. Nothing a session holds is touched
 *                  before these are gone.
 *   1. drop_views  Drop the fp16 views of idle sessions, least recently
 *                  used first, until about what was wanted came back. Never
 *                  the views of the session the charge is for; and when the
 *                  uid's own quota (not the daemon's budget) is what is
 *                  short, only that uid's sessions: other users' views would
 *                  not make room for it. A dropped view is rebuilt from the
 *                  compressed store when its session is used again.
 *   1b. drop_chunks  When no view came back: drop the prefix chunks
 *                  (server/prefix.h) that only the chunk index still holds,
 *                  the uid's own when its quota is short, else every uid's.
 *                  A dropped chunk is prefilled again (or fetched from the
 *                  remote tier) by whoever needs it next.
 *   2. offload     With --remote: idle, unleased sessions written to the
 *                  remote tier (least recently used first) and dropped
 *                  here; attach restores them (server/offload.h).
 *   3. refuse      The request is answered RESOURCE_EXHAUSTED, with a
 *                  sentence naming the budget or the quota, its size and
 *                  use (and nothing it would have changed is changed).
 *
 * A charge goes through steps 0 and 1 as a reason to try again at most
 * once: the caller tries it again when they freed anything, and a second
 * refusal (step 0 still releasing what is kept, which may be the refused
 * attempt's own freed blocks and so is no progress) goes on to step 2
 * (which, taking a whole session each time it succeeds, may let the
 * caller try again as often as there are idle sessions) and then step 3. Each step that runs is counted in zipcache_relief_steps_total{step};
 * every session whose views were dropped in zipcache_view_drops_total.
 * Sessions are never lost: an offloaded one is restored by its next
 * attach. Loop thread only.
 */
#ifndef ZIPCACHE_RELIEF_H
#define ZIPCACHE_RELIEF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct server;
struct session;

/*
 * Runs the policy for a refused charge of about `wanted` bytes of `uid`'s,
 * made for `keep` (NULL: no session yet). `tried`: this charge already went
 * through step 1. Returns 0 when memory came back and the charge may be
 * tried once more; else ZC_EEXHAUSTED, with the refusal's sentence in
 * text[0..size).
 */
int relief_run(struct server *server, uint64_t wanted, const struct session *keep, uint32_t uid,
	       bool tried, char *text, size_t size);

struct store_budget;

/*
 * What `budget` (uid's, and every budget above it) has room for once
 * step 0 ran: the room left now plus the retained pages relief would
 * release first (the uid's own in its quota, every uid's in the daemon's
 * budget). What a request that needs its size at once (an import, a
 * restore) is measured against, so kept pages never refuse one.
 */
uint64_t relief_room(struct server *server, const struct store_budget *budget, uint32_t uid);

/* How much more than `budget` (and every budget above it) has room for
 * now a charge of `bytes` would be (0: it fits). */
uint64_t relief_lacking(const struct store_budget *budget, uint64_t bytes);

/*
 * Step 0 alone, ahead of a charge of `bytes` known to come: releases
 * retained pages until `budget` has room for it (or none are left).
 * Nothing a session holds is touched.
 */
void relief_make_room(struct server *server, const struct store_budget *budget, uint32_t uid,
		      uint64_t bytes);

#endif
