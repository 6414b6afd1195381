/*
 * zipcache attention: softmax(q K^T * scale) V for one layer, computed
 * straight from the codec's compressed blocks (and exact fp16 rows), with
 * the dequantization fused into the dot products: no block is ever
 * reconstructed to memory. Pure numerics, no I/O, thread-safe.
 *
 * A layer is given as a list of segments in token order: compressed
 * blocks exactly as zc_block_compress() wrote them (the first valid_tokens
 * tokens of each count, so a trim cut needs no rewrite), and fp16 rows
 * (the exact streaming residual, or a whole fp16 view). Attention over a
 * compressed block equals attention over zc_block_reconstruct()'s output
 * for that block, up to fp32 rounding: the kernels decode every element
 * to the very fp16 value the reconstruction would store.
 *
 * Results are bit-identical on every ISA (scalar, AVX2, AVX-512, chosen
 * by zc_codec_set_isa() / ZC_CODEC_ISA like the codec's) and for every
 * thread count: docs/ATTEND.md fixes the order of every floating-point
 * operation.
 */
#ifndef ZIPCACHE_ATTEND_H
#define ZIPCACHE_ATTEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/error.h"

/* Query rows one attention call takes at most per KV head
 * ((q_heads / kv_heads) * n_q): bounds the per-thread scratch. */
#define ZC_ATTEND_MAX_ROWS 4096u

typedef enum zc_attend_kind {
	ZC_ATTEND_BLOCK = 0, /* a compressed block: K and V payloads */
	ZC_ATTEND_ROWS = 1   /* fp16 rows: the residual, or a whole fp16 view */
} zc_attend_kind;

typedef enum zc_attend_dtype {
	ZC_ATTEND_FP32 = 0,
	ZC_ATTEND_FP16 = 1   /* IEEE binary16 bits in uint16_t */
} zc_attend_dtype;

/* A compressed block of one layer, as a session's block table lists it. */
typedef struct zc_attend_block {
	zc_codec_config config;  /* the session's codec config */
	zc_block_shape shape;    /* batch, heads = kv_heads, tokens, head_dim = D_k */
	uint32_t head_dim_v;     /* D_v of the value payload */
	uint32_t valid_tokens;   /* the first valid_tokens tokens count (<= tokens) */
	const void *keys;        /* key payload (ZC_TENSOR_KEYS) */
	size_t key_bytes;        /* must equal its layout's total_bytes */
	const void *values;      /* value payload (ZC_TENSOR_VALUES) */
	size_t value_bytes;
} zc_attend_block;

/* fp16 rows [batch][heads][tokens][head_dim] at any strides; each row
 * (token) must be contiguous. */
typedef struct zc_attend_rows {
	uint32_t batch, heads, tokens;
	uint32_t head_dim_k, head_dim_v;
	const uint16_t *keys;
	zc_strides key_strides;    /* in elements */
	const uint16_t *values;
	zc_strides value_strides;
} zc_attend_rows;

typedef struct zc_attend_segment {
	zc_attend_kind kind;
	union {
		zc_attend_block block;  /* kind == ZC_ATTEND_BLOCK */
		zc_attend_rows rows;    /* kind == ZC_ATTEND_ROWS */
	};
} zc_attend_segment;

/* Queries [batch][q_heads][n_q][head_dim], C order. Query head qh reads
 * KV head qh / (q_heads / kv_heads) (grouped-query attention). */
typedef struct zc_attend_query {
	uint32_t batch, q_heads, n_q, head_dim;
	zc_attend_dtype dtype;
	const void *data;
	double scale;   /* softmax scale; 0 means 1 / sqrt(head_dim) */
	bool causal;    /* query i is token T - n_q + i of the T tokens and sees only tokens <= it */
} zc_attend_query;

/*
 * The attention mass each token got (saliency by attention, docs/ATTEND.md):
 * for each (batch b, KV head h) and each token t from first_token on, the
 * softmax probability of t summed over the query rows of h's group (its
 * q_heads / kv_heads query heads times n_q queries; a causally masked
 * query adds 0): data[(b * kv_heads + h) * tokens + t - first_token].
 * Computed after the online softmax, from its final max and sum, by a
 * second score pass over these tokens only; the same bytes on every ISA
 * and thread count.
 */
typedef struct zc_attend_mass {
	float *data;
	size_t capacity;       /* floats at data: at least batch * kv_heads * tokens */
	uint32_t first_token;  /* zc_attend_segments: the first token wanted (in, <= the
				* segments' tokens); zc_attend: the layer's first residual
				* token (out) */
	uint32_t tokens;       /* out: the tokens from first_token on (0: none) */
} zc_attend_mass;

/* Output [batch][q_heads][n_q][head_dim_v], C order. */
typedef struct zc_attend_output {
	zc_attend_dtype dtype;
	void *data;
	size_t capacity;       /* bytes at data */
	zc_attend_mass *mass;  /* NULL: no masses wanted */
} zc_attend_output;

/* A query of the given shape over fp32 data, default scale, not causal. */
void zc_attend_query_init(zc_attend_query *query, uint32_t batch, uint32_t q_heads,
			  uint32_t n_q, uint32_t head_dim, const float *data);

/*
 * Attention of query over the segments, in order (the tokens of segment
 * i precede those of i + 1), into output. threads > 1 splits the
 * (batch, KV head) pairs over that many threads (the caller's among
 * them); the output does not depend on it. Returns 0, or: ZC_ESHAPE
 * (q_heads not a multiple of kv_heads, segments that disagree with each
 * other or the query, no tokens, causal with fewer tokens than n_q, too
 * many rows per KV head), ZC_EINVALID (a NULL pointer, an unknown kind or
 * dtype, valid_tokens > tokens, a non-finite or zero scale), ZC_ENONFINITE
 * (NaN or Inf in the query), ZC_ECORRUPT (a payload whose size or mask
 * disagrees with its layout), ZC_EBUFFER (output too small), a codec
 * config error (ZC_EBITS, ...), -ENOMEM, or a pthread error. On error the
 * output is untouched, and nothing past any buffer is ever read.
 *
 * With output->mass, also the masses of the tokens from mass->first_token
 * on (ZC_ESHAPE past the segments' tokens, ZC_EBUFFER for too small a
 * capacity, ZC_EINVALID for NULL data with tokens to write).
 */
int zc_attend_segments(const zc_attend_segment *segments, size_t n_segments,
		       const zc_attend_query *query, const zc_attend_output *output,
		       unsigned threads);

/* ---- one layer of a session (libzipcache's client, client/attend_session.c) ---- */

typedef struct zc_session zc_session;

/* zc_attend's flags. */
#define ZC_ATTEND_OVER_VIEW 1u  /* the layer's fp16 view (views = full) instead of its
				 * compressed blocks and residual */

/*
 * Attention of query over one layer of a session, read in this process
 * through the reader protocol (zipcache/reader.h): inside one
 * zc_read_begin/zc_read_end, the layer's compressed blocks (their payloads
 * in the pool mapping, each block's valid rows) and its exact residual rows
 * become the segments of zc_attend_segments(), in token order. Nothing is
 * reconstructed to memory and nothing is sent to the daemon. Works for
 * views = none and views = full alike (with views = full the residual rows
 * are the view's last ones).
 *
 * ZC_ATTEND_OVER_VIEW attends over the view's fp16 rows instead, cut at
 * the same block boundaries: the same call over the fp16 a views = full
 * worker holds. The view holds each block's reconstruction, and attention
 * over a block equals attention over its reconstruction in the same
 * segments, so both give the same bytes; what differs is what they read.
 *
 * Causal masking, grouped-query attention, threads and the output are as
 * zc_attend_segments() says (T is the layer's token count). A read torn by
 * a concurrent write is retried, for up to ZC_READ_TIMEOUT_MS; the result
 * is always that of one consistent state of the layer.
 *
 * Returns 0, or: the errors of zc_attend_segments() (ZC_ESHAPE for a query
 * whose batch or head dim is not the session's, q_heads not a multiple of
 * its kv_heads, an empty layer, ...; ZC_ENONFINITE, ZC_EBUFFER, ...);
 * ZC_EINVALID (a NULL pointer, a layer out of range, unknown flags);
 * ZC_EPRECONDITION (ZC_ATTEND_OVER_VIEW on a views = none session);
 * ZC_ESTALE when the layer's rows are in a view the daemon dropped (the
 * residual rows of a views = full session, or any row with
 * ZC_ATTEND_OVER_VIEW; a request on the session, e.g. zc_session_view,
 * brings it back); ZC_EAGAIN when every read within the bound was torn;
 * -ETIMEDOUT when a write never ended; ZC_EPROTOCOL for a map that
 * contradicts itself; -ENOMEM. On any error the output is untouched: the
 * call computes into scratch of the output's size and copies it out once
 * the read is known to be consistent.
 *
 * With output->mass, the masses of the layer's residual rows (the tokens
 * that wait exact, which a later flush ranks): mass->first_token and
 * mass->tokens are set to the residual's first token and its rows (0 rows:
 * an empty residual), read in the same consistent read; ZC_EBUFFER when
 * capacity holds fewer than batch * kv_heads * rows floats. They are what
 * zc_session_set_attention_mass (zipcache/client.h) hands to the layer's
 * next update.
 */
int zc_attend(const zc_session *session, uint32_t layer, const zc_attend_query *query,
	      const zc_attend_output *output, unsigned flags, unsigned threads);

#endif
