/*
 * Retained pages: memory of closed sessions kept for the next ones, so
 * that a new session does not wait for the kernel to zero fresh tmpfs
 * pages (clear_page) on its prefill's or import's critical path.
 *
 * Two kinds, under one bound (--retain-bytes, 0 = off):
 *
 *   maps     A closed session's readers' map (the memfd with its fp16
 *            views, tables and headers), kept whole with its pages and
 *            handed to the next session of the same uid whose map has
 *            exactly the same size (a map is sealed against resizing).
 *            Not durable: a crash loses the memfd and its pages with it.
 *   extents  Freed block-pool extents whose pages the pool keeps instead
 *            of punching them (server/pool.c says how a kept extent stays
 *            free across a crash); the pool reuses them for new blocks.
 *
 * Retained pages are memory the daemon holds and are counted as such:
 * they stay charged to the budget (and the uid's quota) that held them,
 * show in zipcache_memory_file_bytes{kind="retained"} and
 * zipcache_retained_bytes{kind}, and memory relief releases them before
 * anything else (server/relief.h). A map is only ever handed to a session
 * of the uid that owned it: a client still mapping the closed session's
 * map then sees that uid's new session, which it could attach anyway.
 * Thread-safe: pools and stores are used from worker threads.
 */
#ifndef ZIPCACHE_RETAIN_H
#define ZIPCACHE_RETAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "budget.h"

/* The default bound: one closed 32 x 4096 session (views and blocks). */
#define RETAIN_DEFAULT_BYTES (UINT64_C(1) << 30)

/* Spare maps kept at most: each is a descriptor (resources.c counts them). */
#define RETAIN_MAX_MAPS 8u

/* A map smaller than this is not worth a descriptor: its pages are few. */
#define RETAIN_MIN_MAP_BYTES (UINT64_C(1) << 20)

/* The bound over both kinds (0: nothing is retained). */
void retain_set_limit(uint64_t bytes);
uint64_t retain_limit(void);

/* Room under the bound for `bytes` more, taken all or none. */
bool retain_take(uint64_t bytes);
void retain_give(uint64_t bytes);

/* What is retained now, by kind and in all. */
uint64_t retain_held_bytes(void);
uint64_t retain_map_bytes(bool all, uint32_t uid);

/* Reuses so far, by kind (metrics, tests). */
uint64_t retain_map_reuses(void);
void retain_count_extent_reuse(void);
uint64_t retain_extent_reuses(void);

/* Lets go of a retained map's daemon mapping (munmap, and the address
 * space it was charged), when the map is freed instead of reused. */
typedef void (*retain_unmap_fn)(void *base, uint64_t map_bytes);

/*
 * Keeps a closed session's map memfd `fd` (`map_bytes` long, `allocated`
 * bytes of pages, charged to `budget`, owned by uid) and the daemon's
 * mapping of it, `base` (or NULL), so that the next session finds the
 * page tables of its views built: mapping them afresh costs a fault or a
 * populate per page on that session's prefill. `notes` (malloc'd, or
 * NULL) is what the closing session knew of the map's pages, in its own
 * format, for the next one. On true the descriptor, the mapping, the
 * charge and the notes are the retained set's (`unmap` lets go of the
 * mapping if the map is freed; the notes are freed with it); on false
 * (the bound, the count, or too small) nothing was taken and the caller
 * frees all four.
 */
bool retain_map_put(int fd, void *base, retain_unmap_fn unmap, uint64_t map_bytes,
		    uint64_t allocated, uint32_t uid, struct store_budget *budget, void *notes);

/*
 * A retained map of exactly `map_bytes` for uid, its charge moved to
 * `budget` (taken there when it is another budget: when that refuses, the
 * map is freed and none is returned). Returns the descriptor (sealed,
 * mode 0400, its pages stale bytes of the closed session) with
 * *allocated its pages, *base its mapping (the caller's now, with what
 * it was charged; NULL if it came without one) and *notes those it was
 * put with (the caller's to free; NULL if none), or -1.
 */
int retain_map_get(uint64_t map_bytes, uint32_t uid, struct store_budget *budget,
		   uint64_t *allocated, void **base, void **notes);

/* Frees retained maps (all uids', or uid's alone) until about `wanted`
 * bytes came back; returns the bytes freed. */
uint64_t retain_maps_release(bool all, uint32_t uid, uint64_t wanted);

#endif
