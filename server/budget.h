/*
 * Memory budgets: bytes of shared memory the daemon may hold, nested
 * (a uid's quota inside the daemon-wide budget). One definition for the
 * stores, the block pools and the staging buffers.
 */
#ifndef ZIPCACHE_BUDGET_H
#define ZIPCACHE_BUDGET_H

#include <stdint.h>

#include "zipcache/error.h"

/*
 * Shared memory charged to stores. Reservations are taken with a
 * compare-and-swap before the pages are allocated, so `used` never passes
 * `limit` (0: no limit), even with jobs on several threads. Budgets nest:
 * a charge is taken from a budget and every parent (a uid's quota inside
 * the daemon-wide budget), all or none.
 */
struct store_budget {
	uint64_t used;   /* atomic */
	uint64_t limit;
	struct store_budget *parent;
};

/* Takes `bytes` from budget and its parents, or fails (STORE_EBUDGET)
 * without taking any. A NULL budget takes nothing. */
int store_budget_take(struct store_budget *budget, uint64_t bytes);
void store_budget_give(struct store_budget *budget, uint64_t bytes);
/* Charges past the limit (what an adopted file already holds). */
void store_budget_force(struct store_budget *budget, uint64_t bytes);

/* A reservation that would pass the budget: the caller may free memory
 * (drop idle views) and retry; clients see ZC_EEXHAUSTED. */
#define STORE_EBUDGET (ZC_ERROR_BASE - 100)

#endif
