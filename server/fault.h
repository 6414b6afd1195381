/*
 * Fault injection for the crash tests: with ZIPCACHED_FAULT=STEP:N in the
 * environment, the N-th time the daemon reaches the named step of a
 * mutation it dies on the spot (_exit, no cleanup), as a kill -9 would
 * leave it. Without the variable every fault point is one predictable
 * branch. With ZIPCACHED_FAULT_PAUSE=STEP:MS the step sleeps MS ms instead
 * (each hit), for tests that act in the middle of a mutation. The steps, in the order each mutation reaches them, are listed
 * in fault.c and in docs/DURABILITY.md.
 */
#ifndef ZIPCACHE_FAULT_H
#define ZIPCACHE_FAULT_H

#include <stddef.h>

/* The status a daemon killed by a fault point exits with. */
#define FAULT_EXIT_STATUS 86

/* Dies here if this is the step (and hit) the environment names. */
void fault_point(const char *step);

/* The named steps, NULL-terminated (for the tests). */
extern const char *const fault_steps[];

#endif
