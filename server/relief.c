/* The memory relief policy (relief.h): drop idle, unleased views, then refuse. */
#include "relief.h"

#include <stdio.h>
#include <stdlib.h>

#include "log.h"
#include "metrics.h"
#include "offload.h"
#include "pool.h"
#include "prefix.h"
#include "quota.h"
#include "retain.h"
#include "server.h"
#include "session.h"
#include "store.h"

/* Room left in a budget alone (UINT64_MAX without a limit). */
static uint64_t budget_room(const struct store_budget *budget)
{
	uint64_t used = __atomic_load_n(&budget->used, __ATOMIC_RELAXED);
	if (!budget->limit)
		return UINT64_MAX;
	return used < budget->limit ? budget->limit - used : 0;
}

/* Whether uid's own quota, rather than the daemon's budget, is what is
 * short: the one with less room left. */
static bool uid_quota_binding(struct server *server, uint32_t uid, const struct quota_usage **out)
{
	const struct quota_usage *usage = quota_usage_of(&server->quotas, uid);
	*out = usage;
	return usage && usage->memory.limit && budget_room(&usage->memory) < budget_room(&server->budget);
}

static int by_last_use(const void *a, const void *b)
{
	const struct session *x = *(struct session *const *)a, *y = *(struct session *const *)b;
	return x->last_used_ms < y->last_used_ms ? -1 : x->last_used_ms > y->last_used_ms;
}

/* Step 0: pages kept from closed sessions (retain.h), the uid's own when
 * its quota is short (they are charged to it), else every uid's. Only
 * runs when there are some, so that a daemon without retained pages
 * counts no such step. Returns the bytes freed. */
static uint64_t release_retained(struct server *server, uint64_t wanted, uint32_t uid)
{
	const struct quota_usage *usage;
	bool own_only = uid_quota_binding(server, uid, &usage);
	if (retain_held_bytes() == 0)
		return 0;
	server->metrics.relief_steps[METRICS_RELIEF_RELEASE_RETAINED]++;
	uint64_t freed = retain_maps_release(!own_only, uid, wanted);
	if (freed < wanted)
		freed += pool_set_release_kept(&server->pools, !own_only, uid, wanted - freed);
	if (freed)
		log_info("server", "released retained pages", "bytes=%llu", (unsigned long long)freed);
	return freed;
}

/* Step 1. Returns the bytes freed. */
static uint64_t drop_views(struct server *server, uint64_t wanted, const struct session *keep,
			   uint32_t uid)
{
	struct session_table *table = &server->sessions;
	struct session **candidates = calloc(table->count + 1, sizeof(*candidates));
	const struct quota_usage *usage;
	bool own_only = uid_quota_binding(server, uid, &usage);
	size_t count = 0;
	uint64_t freed = 0;

	server->metrics.relief_steps[METRICS_RELIEF_DROP_VIEWS]++;
	if (!candidates)
		return 0;
	uint64_t now = session_now_ms();
	for (size_t i = 0; i < table->count; i++) {
		struct session *s = table->items[i];
		/* A leased view is one a client may be reading right now. */
		if (s != keep && session_idle(s) && !session_leased(s, now) &&
		    (!own_only || s->owner_uid == uid))
			candidates[count++] = s;
	}
	qsort(candidates, count, sizeof(*candidates), by_last_use);
	for (size_t i = 0; i < count && freed < wanted; i++) {
		uint64_t bytes = 0;
		int rc = store_drop_views(candidates[i]->store, &bytes);
		if (rc < 0)
			log_warn("server", "cannot drop views", "session=%llu error=%s",
				 (unsigned long long)candidates[i]->id, zc_strerror(rc));
		if (bytes == 0)
			continue;
		freed += bytes;
		server->metrics.view_drops++;
		log_info("server", "dropped idle views", "session=%llu bytes=%llu",
			 (unsigned long long)candidates[i]->id, (unsigned long long)bytes);
	}
	free(candidates);
	return freed;
}

/* Step 1b. Returns the bytes freed. */
static uint64_t drop_chunks(struct server *server, uint32_t uid)
{
	const struct quota_usage *usage;
	bool own_only = uid_quota_binding(server, uid, &usage);
	uint64_t freed = 0;
	server->metrics.relief_steps[METRICS_RELIEF_DROP_CHUNKS]++;
	size_t blocks = prefix_index_drop_unused(&server->prefix, !own_only, uid, &freed);
	if (blocks)
		log_info("server", "dropped unused prefix chunks", "blocks=%zu bytes=%llu", blocks,
			 (unsigned long long)freed);
	return freed;
}

/* Step 2: the sentence names the uid's quota or the daemon's budget,
 * whichever has less room, with its size and use. */
static int refuse(struct server *server, uint32_t uid, char *text, size_t size)
{
	const struct quota_usage *usage;

	server->metrics.relief_steps[METRICS_RELIEF_REFUSE]++;
	if (uid_quota_binding(server, uid, &usage))
		snprintf(text, size, "memory quota of %llu bytes for uid %u is exhausted (%llu in use; "
			 "--memory-budget-per-uid)", (unsigned long long)usage->memory.limit, (unsigned)uid,
			 (unsigned long long)__atomic_load_n(&usage->memory.used, __ATOMIC_RELAXED));
	else
		snprintf(text, size, "memory budget of %llu bytes is exhausted (%llu in use)",
			 (unsigned long long)server->budget.limit,
			 (unsigned long long)server_memory_bytes(server));
	return ZC_EEXHAUSTED;
}

/* Step 2, with --remote: idle, unleased sessions written to the remote
 * tier and dropped here (offload.c); attach restores them. */
static uint64_t offload_sessions(struct server *server, uint64_t wanted, const struct session *keep,
				 uint32_t uid)
{
	const struct quota_usage *usage;
	if (!server->remote)
		return 0;
	server->metrics.relief_steps[METRICS_RELIEF_OFFLOAD]++;
	return offload_relief(server, wanted, keep, uid, uid_quota_binding(server, uid, &usage));
}

/* Retained pages step 0 would take out of `budget`: the daemon's budget
 * (no parent) holds every uid's, a quota its uid's. */
static uint64_t retained_in(struct server *server, const struct store_budget *budget, uint32_t uid)
{
	bool all = budget->parent == NULL;
	return retain_map_bytes(all, uid) + pool_set_kept_bytes(&server->pools, all, uid);
}

uint64_t relief_room(struct server *server, const struct store_budget *budget, uint32_t uid)
{
	uint64_t room = UINT64_MAX;
	bool any = retain_held_bytes() > 0;
	for (const struct store_budget *b = budget; b; b = b->parent) {
		uint64_t left = budget_room(b);
		if (left == UINT64_MAX)
			continue;
		if (any)
			left += retained_in(server, b, uid);
		if (left < room)
			room = left;
	}
	return room;
}

uint64_t relief_lacking(const struct store_budget *budget, uint64_t bytes)
{
	uint64_t room = UINT64_MAX;
	for (const struct store_budget *b = budget; b; b = b->parent)
		if (budget_room(b) < room)
			room = budget_room(b);
	return room < bytes ? bytes - room : 0;
}

void relief_make_room(struct server *server, const struct store_budget *budget, uint32_t uid,
		      uint64_t bytes)
{
	uint64_t lacked = relief_lacking(budget, bytes);
	if (lacked)
		release_retained(server, lacked, uid);
}

int relief_run(struct server *server, uint64_t wanted, const struct session *keep, uint32_t uid,
	       bool tried, char *text, size_t size)
{
	/* Retained pages go before anything a session holds; when they were
	 * not enough, step 1 runs in the same call (its one chance). On the
	 * retry that follows, step 0 still releases what is kept, but that is
	 * no reason to try again: the refused attempt may have kept those
	 * very pages itself (a direct block whose residual block was written,
	 * then freed when the block after it was refused), and trying again
	 * would write and free them forever (the hardening kill loop's
	 * ETIMEDOUT under a 10M budget, the daemon spinning). So a charge is
	 * tried at most twice before step 2, which takes a whole session each
	 * time it succeeds, and then step 3. */
	uint64_t retained = release_retained(server, wanted, uid);
	if (!tried) {
		if (retained >= wanted)
			return 0;
		if (drop_views(server, wanted, keep, uid) > 0 || drop_chunks(server, uid) > 0)
			return 0;
		if (retained > 0)
			return 0;
	}
	/* Also after step 1 freed too little: each offload takes a session
	 * away, so the caller's retries end. */
	if (offload_sessions(server, wanted, keep, uid) > 0)
		return 0;
	return refuse(server, uid, text, size);
}
