/*
 * The work the kernels do, as the host plans it (plan.c) and the device
 * reads it (kernels.cu): plain C structs of fixed-width fields, the same
 * bytes on both sides.
 *
 * A job is some heads of one block tensor (or of the residual). Its work is
 * cut into tiles of whole tokens of one head, at most TILE_ITEMS items; an
 * item is up to CHUNK_CHANNELS consecutive channels of one token (one
 * 16-byte store). One thread block does one tile; a grid covers the tiles
 * of every job of a launch.
 */
#ifndef ZIPCACHE_CUDA_JOB_H
#define ZIPCACHE_CUDA_JOB_H

#include <stdint.h>

#define CHUNK_CHANNELS 8u
#define TILE_THREADS 256u
/* Items per thread: enough work per block that its start-up (finding the
 * job, loading the head's fields, mask words and parameters: several
 * dependent memory round trips) is amortised; 256 tokens at D = 128.
 * 16 measured 1.68 TB/s on an H200 against 1.64 for 8 (docs/BENCHMARKS.md).
 * Overridable (-D) for such comparisons; host and kernels must agree. */
#ifndef TILE_ITEMS_PER_THREAD
#define TILE_ITEMS_PER_THREAD 16u
#endif
#define TILE_ITEMS (TILE_THREADS * TILE_ITEMS_PER_THREAD)
/* Mask words a tile's tokens can span (tiles start on any token). */
#define TILE_MASK_WORDS (TILE_ITEMS / 64u + 2u)

enum job_kind {
	JOB_QUANTIZED = 0,  /* saliency-routed codes: mask, params, hi/lo codes */
	JOB_COPY = 1        /* exact fp16 rows: unquantized values, the residual */
};

struct cuda_job {
	uint64_t src;              /* device address: payload of head `head0`, or its row 0 (copy) */
	uint64_t dst;              /* device address of element (b, h) = (0, 0), token first, channel 0 */
	uint64_t dst_batch, dst_head, dst_token;  /* target element strides */
	uint64_t src_batch, src_head, src_token;  /* copy: source element strides */
	uint64_t head_bytes;       /* quantized: one head payload; reads stay inside it */
	uint64_t mask_offset, hi_params_offset, lo_params_offset, hi_codes_offset, lo_codes_offset;
	uint64_t prefix;           /* quantized: index in the prefix scratch of head0's first word;
				    * each head has `words` prefix counts, then its verdict */
	uint64_t tile0;            /* first tile of this job in its launch */
	uint64_t scan0;            /* first scan block (one per quantized head) of this job */
	uint32_t kind;
	uint32_t heads_per_batch;  /* H: flat head h is (h / H, h % H) */
	uint32_t head0, n_heads;   /* flat heads [head0, head0 + n_heads) */
	uint32_t tokens;           /* S of the block (quantized: the mask's length) */
	uint32_t valid;            /* tokens written: 0 .. valid-1 */
	uint32_t dim;
	uint32_t chunks;           /* ceil(dim / CHUNK_CHANNELS) items per token */
	uint32_t tile_tokens;      /* tokens per tile: TILE_ITEMS / chunks, at least 1 */
	uint32_t tiles_per_head;
	uint32_t n_hi, n_lo;
	uint32_t group_size;
	uint32_t hi_bits, lo_bits;
	uint32_t words;            /* quantized: ceil(tokens / 64) mask words per head */
	uint32_t vector;           /* 1: 16-byte stores (and copy loads) are aligned */
};

/* A launch's header in device memory: the jobs follow it. */
struct cuda_launch {
	uint64_t n_jobs;
	uint64_t tiles;
	uint64_t scan_heads;       /* heads of quantized jobs (one scan block each) */
	uint64_t pad;
};

#endif
