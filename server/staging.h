/*
 * Staging buffers: a sealed memfd per connection that the client writes
 * large blocks into, so prefill K/V cross no socket. The daemon maps it
 * read-only; the seals stop the client from shrinking it under us (which
 * would turn our reads into SIGBUS). Refcounted: a job reading from it
 * keeps it alive after the connection replaces or drops it.
 *
 * A buffer's bytes are memory like a session's (the client can touch all
 * of them), so they are charged to the memory budget while the daemon
 * holds the buffer, and counted against its uid's staging quota.
 */
#ifndef ZIPCACHE_STAGING_H
#define ZIPCACHE_STAGING_H

#include <stdint.h>

struct store_budget;

struct staging {
	int fd;
	const uint8_t *base;
	uint64_t bytes;
	unsigned refs;
	struct store_budget *memory;   /* charged `bytes` until freed */
	struct store_budget *quota;
};

/*
 * A new buffer of `bytes` (rounded up to a page), refs = 1, its bytes
 * taken from `memory` and from `quota` (each with its parents; either may
 * be NULL). Returns STORE_EBUDGET when `memory` refuses (the caller may
 * drop idle views and retry), ZC_EEXHAUSTED when `quota` does, or a
 * negative errno; nothing is charged then.
 */
int staging_create(uint64_t bytes, struct store_budget *memory, struct store_budget *quota,
		   struct staging **out);
void staging_ref(struct staging *staging);

/*
 * Charges `bytes` to `memory` and to the uid's staging `quota` (each with
 * its parents; either may be NULL): 0, ZC_EEXHAUSTED when the quota
 * refuses, STORE_EBUDGET when the memory does; nothing charged then.
 * The staging buffers' and the request rings' charge.
 */
int staging_charge(struct store_budget *memory, struct store_budget *quota, uint64_t bytes);
void staging_uncharge(struct store_budget *memory, struct store_budget *quota, uint64_t bytes);

/*
 * A memfd of `bytes` named `name`, sealed against resizing (so that no
 * mapping of it, ours or the client's, ever faults past its end), mapped
 * shared with `prot`: 0 with *fd and *base, or a negative errno with
 * nothing left open. The staging buffers' and the request rings' memory.
 */
int staging_memfd_map(const char *name, uint64_t bytes, int prot, int *fd, uint8_t **base);
/* Drops a reference; the last one frees the buffer and gives its bytes back. */
void staging_unref(struct staging *staging);

#endif
