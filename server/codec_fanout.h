/*
 * One block's codec work spread over threads. A block's heads are
 * compressed and reconstructed independently (each head's payload is
 * head_bytes long at h * head_bytes, zipcache/codec.h), so splitting the
 * heads between threads gives the very bytes one thread would: a prefill
 * block uses the CPUs the daemon was given instead of one.
 */
#ifndef ZIPCACHED_CODEC_FANOUT_H
#define ZIPCACHED_CODEC_FANOUT_H

#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"

/* At most this many threads work on one block (--codec-threads). */
#define CODEC_FANOUT_MAX_THREADS 16u

/* Blocks of fewer elements stay on the calling thread: below this the
 * threads' start (tens of microseconds) costs about what they save. */
#define CODEC_FANOUT_MIN_ELEMENTS (1u << 19)

/* Threads per block from now on: 1..CODEC_FANOUT_MAX_THREADS; 0 picks the
 * CPUs the daemon may run on, at most 8. Call before serving (the value
 * is read by worker threads without a lock). Returns what was chosen. */
unsigned codec_fanout_set_threads(unsigned threads);
unsigned codec_fanout_threads(void);

/* Joins the helper threads kept between calls (a later call starts them
 * again), after the call that holds them, if any, has finished; calls
 * meanwhile run on threads of their own, and a second stop waits for the
 * first. At the daemon's exit. */
void codec_fanout_stop(void);

/* Where compressed bytes go on from the output buffer as soon as they
 * are final: write(ctx, at, bytes, n) puts the n bytes of the payload at
 * byte `at` of the block. Called from the thread that made them, for
 * disjoint ranges, in no set order; a negative return is the call's error. */
struct codec_sink {
	int (*write)(void *ctx, uint64_t at, const void *bytes, size_t n);
	void *ctx;
};

/* zc_block_compress_strided (scores NULL) or
 * zc_block_compress_scored_strided (keys, scores given), heads split
 * between threads. The same bytes as one call, and its error codes with
 * one exception: with the caller's scores, one call checks every head's
 * values before any score, so a NaN in a later head wins over a bad
 * score in an earlier one; here each head is checked whole in turn, the
 * earlier head's error first. On an error the output buffer is scratch.
 * With a sink (else NULL), each thread hands its heads' bytes on while
 * they are still in its cache, instead of one thread copying the whole
 * payload afterwards. */
int64_t codec_fanout_compress(const zc_codec_config *config, zc_tensor tensor,
			      const zc_block_shape *shape, const uint16_t *input,
			      const zc_strides *strides, const float *scores, void *out,
			      size_t capacity, const struct codec_sink *sink);

/* One tensor of a block for codec_fanout_compress_block: the arguments
 * of codec_fanout_compress. */
struct codec_fanout_tensor {
	zc_tensor tensor;
	zc_block_shape shape;
	const uint16_t *input;
	const zc_strides *strides;
	const float *scores;              /* keys by the caller's scores, else NULL */
	void *out;
	size_t capacity;
	const struct codec_sink *sink;    /* or NULL */
	/* Or NULL: each head's reconstruction goes here as it is compressed
	 * (zc_block_compress_view: what codec_fanout_reconstruct of the
	 * output would write, without a second pass over the block). On an
	 * error, rows of the view may hold some heads' reconstructions, and
	 * part of a head's (values refused for NaN/Inf in the encode's pass). */
	uint16_t *view;
	const zc_strides *view_strides;
};

/* Tensors compressed together in one call (at most this many). */
#define CODEC_FANOUT_MAX_TENSORS 2u

/* codec_fanout_compress of each of n tensors (a block's keys and values),
 * their heads shared between the threads in one go: one start and one
 * join per block, and no thread idle at the end of the keys while the
 * others finish theirs. Every tensor's output is the same as that call's;
 * returns 0, or the error that calling it tensor after tensor would have
 * returned first (every output buffer is then scratch). */
int codec_fanout_compress_block(const zc_codec_config *config,
				const struct codec_fanout_tensor *tensors, size_t n);

/* zc_block_reconstruct, heads split between threads. */
int codec_fanout_reconstruct(const zc_codec_config *config, zc_tensor tensor,
			     const zc_block_shape *shape, const void *compressed, size_t size,
			     uint16_t *out, const zc_strides *strides);

/* One tensor of a block for codec_fanout_reconstruct_block: the
 * arguments of codec_fanout_reconstruct. */
struct codec_fanout_view {
	zc_tensor tensor;
	zc_block_shape shape;
	const void *compressed;
	size_t size;
	uint16_t *out;
	const zc_strides *strides;
};

/* codec_fanout_reconstruct of each of n tensors (at most
 * CODEC_FANOUT_MAX_TENSORS), their heads shared between the threads in
 * one go; returns 0 or the error that calling it tensor after tensor
 * would have returned first. */
int codec_fanout_reconstruct_block(const zc_codec_config *config,
				   const struct codec_fanout_view *views, size_t n);

#endif
