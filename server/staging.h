/*
 * Staging buffers: a sealed memfd per connection that the client writes
 * large blocks into, so prefill K/V cross no socket. The daemon maps it
 * read-only; the seals stop the client from shrinking it under us (which
 * would turn our reads into SIGBUS). Refcounted: a job reading from it
 * keeps it alive after the connection replaces or drops it.
 */
#ifndef ZIPCACHE_STAGING_H
#define ZIPCACHE_STAGING_H

#include <stdint.h>

struct staging {
	int fd;
	const uint8_t *base;
	uint64_t bytes;
	unsigned refs;
};

/* A new buffer of `bytes` (rounded up to a page), refs = 1. */
int staging_create(uint64_t bytes, struct staging **out);
void staging_ref(struct staging *staging);
void staging_unref(struct staging *staging);

#endif
