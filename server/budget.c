/* Nested memory budgets (budget.h): compare-and-swap charges, all or none. */
#include "budget.h"

#include <stdbool.h>

static int budget_take_one(struct store_budget *budget, uint64_t bytes)
{
	uint64_t used = __atomic_load_n(&budget->used, __ATOMIC_RELAXED);
	do {
		if (budget->limit && (used + bytes < used || used + bytes > budget->limit))
			return STORE_EBUDGET;
	} while (!__atomic_compare_exchange_n(&budget->used, &used, used + bytes, true,
					      __ATOMIC_RELAXED, __ATOMIC_RELAXED));
	return 0;
}

int store_budget_take(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent) {
		if (budget_take_one(b, bytes) < 0) {
			for (struct store_budget *undo = budget; undo != b; undo = undo->parent)
				__atomic_fetch_sub(&undo->used, bytes, __ATOMIC_RELAXED);
			return STORE_EBUDGET;
		}
	}
	return 0;
}

void store_budget_give(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent)
		__atomic_fetch_sub(&b->used, bytes, __ATOMIC_RELAXED);
}

void store_budget_force(struct store_budget *budget, uint64_t bytes)
{
	for (struct store_budget *b = budget; b; b = b->parent)
		__atomic_fetch_add(&b->used, bytes, __ATOMIC_RELAXED);
}

