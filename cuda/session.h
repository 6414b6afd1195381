/*
 * A session's layer as libzipcache_cuda loads it: the reader protocol
 * (zipcache/reader.h) around one load, the layer built from the block
 * table and the residual rows, and what a mirror can learn from the table
 * about trims. Pure C over the public client API: the CPU tests
 * (tests/cuda_session_test.c) run all of it against a real daemon with the
 * kernels emulated; cuda.c runs it with the real load.
 */
#ifndef ZIPCACHE_CUDA_SESSION_H
#define ZIPCACHE_CUDA_SESSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "plan.h"
#include "zipcache/client.h"
#include "zipcache/cuda.h"

/* One layer as one read saw it, and room for the prints a fetch takes. */
struct session_layer {
	zc_cuda_layer layer;
	zc_cuda_block *blocks;
	size_t capacity;
	/* Prints taken inside the read, applied to the mirror once it ended well. */
	uint64_t *block_prints;
	uint64_t *row_prints;
	uint32_t row_prints_capacity, row_prints_from, n_row_prints;
};

void session_layer_init(struct session_layer *sl);
void session_layer_free(struct session_layer *sl);

/* The layer `read` is reading, from its block table (pointers into the pool
 * mapping) and residual (in the session map): valid until the read ends. */
int session_layer_read(struct session_layer *sl, const zc_session *session, const zc_read *read);

/* The load inside the read: first is the first token it will write
 * (plan_mirror_valid), rewrite whether earlier tokens may have changed
 * since the mirror's last load (a trim: blocks may have left the table). */
struct session_load {
	int (*load)(void *arg, const zc_session *session, uint32_t layer,
		    const zc_cuda_layer *contents, const zc_cuda_target *target,
		    zc_cuda_mirror *mirror, uint32_t first, bool rewrite);
	void *arg;
};

/*
 * zc_cuda_fetch_layer without CUDA: reads begin, the layer is built, the
 * mirror checked against it, `load` runs, the read ends. A torn read
 * (ZC_EAGAIN) is read again, for up to ZC_READ_TIMEOUT_MS; whatever a torn
 * load wrote is forgotten by the mirror (trimmed to the first token it
 * wrote). Returns the layer's token count or a negative code: the load's,
 * ZC_ESTALE (the view was dropped: zc_session_view brings it back),
 * -ETIMEDOUT (a write that never ended), ZC_EAGAIN (torn until the bound).
 */
int session_fetch(struct session_layer *sl, const zc_session *session, uint32_t layer,
		  const zc_cuda_target *target, zc_cuda_mirror *mirror,
		  const struct session_load *load);

/* A hash of some payload bytes of a block: its first and last 64 bytes of
 * K and of V (head 0's mask and parameters, the last head's codes). Two
 * different blocks at the same pool extent almost never agree on it. */
uint64_t session_block_print(const zc_cuda_block *block);

#endif
