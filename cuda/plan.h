/*
 * Planning a layer load, without CUDA: validation, what a mirror says is
 * there already, the jobs, and how they are cut into chunks that fit a
 * bounce buffer. Pure C over the public codec API, so the CPU tests
 * (tests/cuda_plan_test.c) run all of it, and the kernels' arithmetic
 * (core.h) over its jobs, on machines without a GPU.
 */
#ifndef ZIPCACHE_CUDA_PLAN_H
#define ZIPCACHE_CUDA_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "job.h"
#include "zipcache/cuda.h"

/* What a mirror remembers of one block it loaded. print: a hash of some
 * of its payload bytes (session.c), taken inside a consistent read; the
 * session fetch compares it with the bytes it finds under the same entry. */
struct mirror_block {
	const void *keys, *values;
	size_t key_bytes, value_bytes;
	uint32_t first_token, tokens, valid_tokens;
	bool printed;
	uint64_t print;
};

struct zc_cuda_mirror {
	bool known;                  /* false: the next load is a full one */
	zc_cuda_target target;       /* what it loaded into */
	zc_codec_config config;
	uint32_t batch, heads, head_dim_k, head_dim_v;
	struct mirror_block *blocks;
	size_t n_blocks, capacity;
	uint32_t residual_first;     /* residual rows residual_first .. + residual_rows are there */
	uint32_t residual_rows;
	uint32_t tokens;             /* tokens the layer held at that load, after trims */
	/* The session fetch's prints of residual rows residual_first + r
	 * (session.c): n_row_prints of them, taken for prints_first. */
	uint64_t *row_prints;
	uint32_t n_row_prints, row_prints_capacity, row_prints_first;
};

/* One piece of work before it is cut into chunks: some heads of one block
 * tensor, or of the residual. */
struct plan_unit {
	struct cuda_job job;         /* src, tile0, scan0, prefix: filled per chunk */
	const uint8_t *source;       /* flat head head0's payload (quantized, exact), or its row 0 */
	uint64_t head_stride_bytes;  /* source: from one flat head to the next (contiguous units) */
	uint64_t per_head;           /* bytes each head brings to the device */
	bool strided;                /* residual rows: per head `valid` rows at src strides */
};

struct plan {
	struct plan_unit *units;
	size_t n_units, capacity;
	size_t blocks, blocks_skipped;
	uint64_t residual_rows;
	uint64_t max_per_head;       /* the largest head any unit brings */
	zc_cuda_memory memory;
};

/* Where one job of a chunk gets its bytes from (host memory only). */
struct plan_placement {
	const uint8_t *source;
	uint64_t offset;             /* in the chunk's data area */
	uint64_t bytes;
	/* strided: rows of row_bytes per head, at source + head_stride_bytes * i ... */
	bool strided;
	uint32_t heads, rows;
	uint64_t row_bytes;
	uint64_t src_batch_bytes, src_head_bytes, src_token_bytes;
	uint32_t heads_per_batch, head0;
};

/* A chunk: jobs whose bytes fit its capacity, offsets relative to its data area. */
struct plan_chunk {
	struct cuda_job *jobs;
	struct plan_placement *placements;
	size_t n_jobs, max_jobs;
	uint64_t data_bytes;         /* bytes of the data area used */
	uint64_t tiles, scan_heads, prefix_words;
};

/* Where the next chunk starts. */
struct plan_cursor {
	size_t unit;
	uint32_t head;               /* heads of that unit already taken */
};

void plan_init(struct plan *plan);
void plan_free(struct plan *plan);

/* Validates layer and target and lists the work (with a mirror: only what
 * it lacks). Nothing is touched on error. */
int plan_layer(struct plan *plan, const zc_cuda_layer *layer, const zc_cuda_target *target,
	       const zc_cuda_mirror *mirror);

/* The next chunk: whole heads of the units from the cursor on while their
 * bytes fit data_capacity (every head fits: the caller sized it to
 * max_per_head at least) and the jobs fit max_jobs. Job src are offsets
 * into the data area (host memory) or device addresses (device memory).
 * Returns false when nothing is left. */
bool plan_next_chunk(const struct plan *plan, struct plan_cursor *cursor,
		     uint64_t data_capacity, struct plan_chunk *chunk);

/* Copies a placement's host bytes into data + placement->offset. */
void plan_stage(const struct plan_placement *placement, uint8_t *data);

/* The first token a load of `layer` into `target` through `mirror` would
 * write: what the mirror says the target holds already ends there (0 for
 * no mirror, an unknown one or another target or shape). */
uint32_t plan_mirror_valid(const zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
			   const zc_cuda_target *target);

/* After a load was queued: the mirror describes it. -ENOMEM leaves the
 * mirror reset (the next load is a full one). */
int plan_mirror_update(zc_cuda_mirror *mirror, const zc_cuda_layer *layer,
		       const zc_cuda_target *target);

/* Alignment of every placement in the data area (16-byte vector loads). */
#define PLAN_ALIGN 16u
/* A block whose V payload starts at most this far past its K payload's
 * end (the pool puts V at the next 64-byte boundary) has its two payloads
 * placed in a chunk with the same gap, so that one DMA moves both. */
#define PLAN_GAP_BYTES 64u

#endif
