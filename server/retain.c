/* Retained pages (retain.h): the bound, and the spare maps. */
#include "retain.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "fault.h"
#include "log.h"

struct spare_map {
	int fd;
	void *base;             /* the daemon's mapping, or NULL */
	retain_unmap_fn unmap;
	uint64_t map_bytes, allocated;
	uint32_t uid;
	struct store_budget *budget;
	void *notes;            /* the closing session's, for the next one */
};

static uint64_t limit;
static uint64_t held;            /* atomic: maps' and extents' pages */
static uint64_t map_reuses, extent_reuses;   /* atomic */

/* The spare maps, oldest first: few, so a linear scan. */
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static struct spare_map maps[RETAIN_MAX_MAPS];
static unsigned n_maps;

void retain_set_limit(uint64_t bytes)
{
	__atomic_store_n(&limit, bytes, __ATOMIC_RELAXED);
}

uint64_t retain_limit(void)
{
	return __atomic_load_n(&limit, __ATOMIC_RELAXED);
}

bool retain_take(uint64_t bytes)
{
	uint64_t bound = retain_limit();
	uint64_t now = __atomic_load_n(&held, __ATOMIC_RELAXED);
	do {
		if (now + bytes < now || now + bytes > bound)
			return false;
	} while (!__atomic_compare_exchange_n(&held, &now, now + bytes, true, __ATOMIC_RELAXED,
					      __ATOMIC_RELAXED));
	return true;
}

void retain_give(uint64_t bytes)
{
	__atomic_fetch_sub(&held, bytes, __ATOMIC_RELAXED);
}

uint64_t retain_held_bytes(void)
{
	return __atomic_load_n(&held, __ATOMIC_RELAXED);
}

uint64_t retain_map_reuses(void)
{
	return __atomic_load_n(&map_reuses, __ATOMIC_RELAXED);
}

void retain_count_extent_reuse(void)
{
	__atomic_fetch_add(&extent_reuses, 1, __ATOMIC_RELAXED);
}

uint64_t retain_extent_reuses(void)
{
	return __atomic_load_n(&extent_reuses, __ATOMIC_RELAXED);
}

uint64_t retain_map_bytes(bool all, uint32_t uid)
{
	uint64_t bytes = 0;
	pthread_mutex_lock(&maps_lock);
	for (unsigned i = 0; i < n_maps; i++)
		if (all || maps[i].uid == uid)
			bytes += maps[i].allocated;
	pthread_mutex_unlock(&maps_lock);
	return bytes;
}

/* Frees slot i (locked): its pages go with the descriptor unless a client
 * still maps them (as for any closed session's map), its charge back. */
static uint64_t map_free_locked(unsigned i)
{
	struct spare_map m = maps[i];
	maps[i] = maps[--n_maps];
	if (m.base)
		m.unmap(m.base, m.map_bytes);
	close(m.fd);
	free(m.notes);
	store_budget_give(m.budget, m.allocated);
	retain_give(m.allocated);
	return m.allocated;
}

bool retain_map_put(int fd, void *base, retain_unmap_fn unmap, uint64_t map_bytes,
		    uint64_t allocated, uint32_t uid, struct store_budget *budget, void *notes)
{
	if (allocated < RETAIN_MIN_MAP_BYTES)
		return false;
	pthread_mutex_lock(&maps_lock);
	bool kept = false;
	if (n_maps < RETAIN_MAX_MAPS && retain_take(allocated)) {
		maps[n_maps++] = (struct spare_map){ .fd = fd, .base = base, .unmap = unmap,
						     .map_bytes = map_bytes,
						     .allocated = allocated, .uid = uid,
						     .budget = budget, .notes = notes };
		kept = true;
	}
	pthread_mutex_unlock(&maps_lock);
	if (kept)
		fault_point("retain.map");
	return kept;
}

int retain_map_get(uint64_t map_bytes, uint32_t uid, struct store_budget *budget,
		   uint64_t *allocated, void **base, void **notes)
{
	int fd = -1;
	*base = NULL;
	*notes = NULL;
	pthread_mutex_lock(&maps_lock);
	/* The newest first: its pages are the likeliest still in cache. */
	for (unsigned i = n_maps; i-- > 0;) {
		if (maps[i].uid != uid || maps[i].map_bytes != map_bytes)
			continue;
		struct spare_map m = maps[i];
		if (m.budget != budget) {
			/* The charge moves only if the new budget has room for it. */
			if (store_budget_take(budget, m.allocated) < 0) {
				map_free_locked(i);
				break;
			}
			store_budget_give(m.budget, m.allocated);
		}
		maps[i] = maps[--n_maps];
		retain_give(m.allocated);
		__atomic_fetch_add(&map_reuses, 1, __ATOMIC_RELAXED);
		*allocated = m.allocated;
		*base = m.base;
		*notes = m.notes;
		fd = m.fd;
		break;
	}
	pthread_mutex_unlock(&maps_lock);
	return fd;
}

uint64_t retain_maps_release(bool all, uint32_t uid, uint64_t wanted)
{
	uint64_t freed = 0;
	pthread_mutex_lock(&maps_lock);
	/* The oldest first (slot order is not kept exactly; good enough). */
	for (unsigned i = 0; i < n_maps && freed < wanted;) {
		if (all || maps[i].uid == uid)
			freed += map_free_locked(i);
		else
			i++;
	}
	pthread_mutex_unlock(&maps_lock);
	if (freed)
		log_info("retain", "retained maps freed", "bytes=%llu", (unsigned long long)freed);
	return freed;
}
