/*
 * zipcache codec: ZipCache-adapted saliency-routed mixed-precision
 * quantization of fp16 K/V blocks. Pure numerics: no I/O; thread-safe (no
 * shared mutable state after zc_codec_init()). Compression allocates
 * scratch that it frees before returning (-ENOMEM if it cannot).
 *
 * A block is [batch][heads][tokens][head_dim] fp16 (IEEE binary16 bits in
 * uint16_t), C order. Each [tokens, head_dim] head matrix is compressed on
 * its own; the compressed block is the head payloads back to back, each of
 * exactly the size the numerics contract in docs/CODEC.md gives:
 *
 *   ceil(n_hi*D*hi_bits/8) + ceil(n_lo*D*lo_bits/8)
 *     + 4*D*(groups_hi + groups_lo) + ceil(S/8)
 *
 * The payload carries its own scales, minimums and saliency mask; what it
 * does not carry is the shape and the config, which the owner of the block
 * already holds (a session stores them once, not once per block). Give
 * the same config, tensor and shape to zc_block_reconstruct().
 *
 * Every ISA path (scalar, AVX2, AVX-512) produces bit-identical output.
 */
#ifndef ZIPCACHE_CODEC_H
#define ZIPCACHE_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zipcache/error.h"

#define ZC_DEFAULT_HI_BITS 4
#define ZC_DEFAULT_LO_BITS 2
#define ZC_DEFAULT_HI_FRACTION 0.20
#define ZC_DEFAULT_GROUP_SIZE 32

/* Largest head_dim and tokens-per-block the codec accepts. */
#define ZC_MAX_HEAD_DIM 4096u
#define ZC_MAX_BLOCK_TOKENS (1u << 24)

/*
 * How a session's residual flushes choose their salient key tokens. The
 * codec's own calls always rank by key norm (the numerics contract,
 * docs/CODEC.md); ZC_SALIENCY_ATTENTION is for the owner of the blocks: a
 * daemon session with it ranks each residual flush by the attention mass
 * its clients' zc_attend measured (zc_block_compress_scored), falling back
 * to key norm where it has none (docs/ATTEND.md, "Saliency from
 * attention"). Payloads are the same format either way.
 */
typedef enum zc_saliency {
	ZC_SALIENCY_KEY_NORM = 0,   /* the default and the contract */
	ZC_SALIENCY_ATTENTION = 1
} zc_saliency;

typedef struct zc_codec_config {
	int hi_bits;         /* bits for salient key tokens and for all values, 1..8 */
	int lo_bits;         /* bits for the other key tokens, 1..8 */
	double hi_fraction;  /* fraction of key tokens that are salient, [0, 1] */
	int group_size;      /* token rows per quantization group, >= 1 */
	bool quantize_values;/* false: values are stored as exact fp16 */
	int saliency;        /* a zc_saliency; anything else is ZC_EINVALID */
} zc_codec_config;

typedef enum zc_tensor {
	ZC_TENSOR_KEYS = 0,   /* saliency routed: hi_bits / lo_bits */
	ZC_TENSOR_VALUES = 1  /* every token at hi_bits (or exact fp16) */
} zc_tensor;

typedef struct zc_block_shape {
	uint32_t batch;
	uint32_t heads;
	uint32_t tokens;    /* 0 is a valid, empty block */
	uint32_t head_dim;
} zc_block_shape;

/* Element strides of a block in memory, e.g. a reconstruction target, e.g. a [B][H][max_tokens][D]
 * view: batch = H*max_tokens*D, head = max_tokens*D, token = D. */
typedef struct zc_strides {
	size_t batch;
	size_t head;
	size_t token;
} zc_strides;

/* Where everything sits inside one head payload; derived, never stored. */
typedef struct zc_block_layout {
	uint32_t tokens, head_dim;
	uint32_t n_hi, n_lo;          /* salient and other tokens per head */
	uint32_t groups_hi, groups_lo;
	int hi_bits, lo_bits;
	bool exact;                   /* payload is raw fp16 (values, not quantized) */
	size_t mask_offset, mask_bytes;
	size_t hi_params_offset, lo_params_offset; /* per group: D fp16 scales, D fp16 mins */
	size_t hi_codes_offset, hi_codes_bytes;
	size_t lo_codes_offset, lo_codes_bytes;
	size_t head_bytes;            /* one head payload */
	size_t heads;                 /* batch * heads */
	size_t total_bytes;           /* heads * head_bytes */
} zc_block_layout;

/* The seed's byte accounting for one block. */
typedef struct zc_byte_count {
	uint64_t compressed;  /* what the compressed form really occupies */
	uint64_t baseline;    /* uniform lo_bits: ceil(S*D*lo/8) + 4*D*ceil(S/G) per head */
	uint64_t fp16;        /* 2*S*D per head */
} zc_byte_count;

typedef enum zc_isa {
	ZC_ISA_SCALAR = 0,
	ZC_ISA_AVX2 = 1,
	ZC_ISA_AVX512 = 2
} zc_isa;

/* Chooses the kernels once: the best the CPU has, or ZC_CODEC_ISA=
 * scalar|avx2|avx512 from the environment. Called implicitly by the first
 * codec call; calling it first avoids the race-free but redundant probe. */
void zc_codec_init(void);

/* Forces a kernel set; -ENOTSUP if this CPU lacks it. Not thread-safe:
 * for tests and benchmarks, before concurrent use. */
int zc_codec_set_isa(zc_isa isa);
zc_isa zc_codec_isa(void);
const char *zc_isa_name(zc_isa isa);

void zc_codec_config_default(zc_codec_config *config);
int zc_codec_config_validate(const zc_codec_config *config);

/* n_hi for a block of `tokens` tokens: ceil(tokens * hi_fraction) in
 * double, clamped to [0, tokens]; values always take every token. */
uint32_t zc_codec_salient_tokens(const zc_codec_config *config, zc_tensor tensor,
				 uint32_t tokens);

int zc_block_layout_compute(const zc_codec_config *config, zc_tensor tensor,
			    const zc_block_shape *shape, zc_block_layout *layout);

int zc_block_count_bytes(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, zc_byte_count *count);

/* Compresses a contiguous block into out (capacity bytes). Returns the
 * number of bytes written, or a negative code; on NaN/Inf in the input it
 * returns ZC_ENONFINITE before writing anything. */
int64_t zc_block_compress(const zc_codec_config *config, zc_tensor tensor,
			  const zc_block_shape *shape, const uint16_t *input,
			  void *out, size_t capacity);

/* The same for a block whose heads are not back to back, e.g. the first
 * S tokens of a [B][H][capacity][D] buffer. Rows must be contiguous
 * (input_strides->token == head_dim, else ZC_ESHAPE). */
int64_t zc_block_compress_strided(const zc_codec_config *config, zc_tensor tensor,
				  const zc_block_shape *shape, const uint16_t *input,
				  const zc_strides *input_strides, void *out, size_t capacity);

/* Keys compressed with the salient tokens chosen by the caller's scores
 * instead of the key norms: the n_hi tokens of each head with the largest
 * (score, index), scores[(b * heads + h) * tokens + t]. For saliency
 * measured some other way, e.g. the attention tokens received
 * (examples/saliency_attention.py). Scores must be finite and >= 0, else
 * ZC_EINVALID; nothing is written on any error. The payload has the same
 * layout and size as zc_block_compress's and reconstructs with
 * zc_block_reconstruct. */
int64_t zc_block_compress_scored(const zc_codec_config *config, const zc_block_shape *shape,
				 const uint16_t *keys, const float *scores, void *out,
				 size_t capacity);

/* The same over a block whose heads are not back to back (as
 * zc_block_compress_strided); scores stay [batch][heads][tokens]. */
int64_t zc_block_compress_scored_strided(const zc_codec_config *config,
					 const zc_block_shape *shape, const uint16_t *keys,
					 const zc_strides *key_strides, const float *scores,
					 void *out, size_t capacity);

/* Compresses as zc_block_compress_strided (or, with scores, as
 * zc_block_compress_scored_strided; scores need tensor KEYS) and writes
 * the block's reconstruction to view at view_strides: exactly what
 * zc_block_reconstruct would write there from the returned bytes, in the
 * encode's pass where the kernels can, which saves unpacking the codes
 * again. Where that pass does a whole head of values (kernels that pack
 * from registers, AVX-512 VBMI, and D*bits a multiple of 8), it also
 * checks the values on the way instead of reading the block once more
 * ahead of it: so ZC_ENONFINITE for values may come with out and view
 * partly written. On every other error (keys holding NaN or Inf
 * included) nothing is written to out or view. */
int64_t zc_block_compress_view(const zc_codec_config *config, zc_tensor tensor,
			       const zc_block_shape *shape, const uint16_t *input,
			       const zc_strides *input_strides, const float *scores, void *out,
			       size_t capacity, uint16_t *view, const zc_strides *view_strides);

/* Reconstructs a compressed block into out, token t of head (b, h) landing
 * at out[b*strides->batch + h*strides->head + t*strides->token]. size must
 * equal the layout's total_bytes. */
int zc_block_reconstruct(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, const void *compressed,
			 size_t size, uint16_t *out, const zc_strides *strides);

/* Returns 0 if every element of the n fp16 values is finite, else ZC_ENONFINITE. */
int zc_fp16_check_finite(const uint16_t *values, size_t n);

/* IEEE binary16 conversions: exact, round to nearest even, subnormals,
 * Inf and NaN preserved; identical on every ISA. */
float zc_fp16_to_float(uint16_t half);
uint16_t zc_float_to_fp16(float value);

#endif
