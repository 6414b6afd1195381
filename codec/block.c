/*
 * Compress and reconstruct whole [B, H, S, D] blocks: validation, the
 * saliency split, the walk over groups, and the head payload layout of
 * docs/CODEC.md. The arithmetic itself is in the kernel tables.
 */
#include "zipcache/codec.h"

#include <errno.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "kernels.h"
#include "saliency.h"

/* Rows quantized per kernel call: enough to amortise the call, small
 * enough (with D <= 4096) that the code bytes stay in L1/L2. */
#define QUANTIZE_CHUNK_BYTES 8192u

/* A reconstruction of at least this many bytes is written with
 * non-temporal stores where the kernels have them: it is past what a
 * core's L2 keeps (a prefill's views), so storing through the cache only
 * adds a read of every destination line and evicts the caller's data.
 * Smaller ones (a decode's residual flush) stay in cache for the reads
 * that follow. */
#define RECONSTRUCT_STREAM_BYTES (512u * 1024u)

static bool reconstruct_streams(const zc_block_layout *layout)
{
	return layout->heads * layout->tokens * layout->head_dim * 2 >= RECONSTRUCT_STREAM_BYTES;
}

static inline void stores_fence(void)
{
#if defined(__x86_64__)
	__builtin_ia32_sfence();
#else
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* The stream kernels' precondition: every row starts on a cache line. */
static bool rows_on_lines(const uint16_t *out, size_t token_stride)
{
	return (uintptr_t)out % 64 == 0 && token_stride * 2 % 64 == 0;
}

struct compress_scratch {
	float *norms;      /* B*H*S key norms, computed before anything is written */
	uint32_t *rows;    /* S + 2 row indices: salient, a spare, the others, a spare */
	uint8_t *codes;    /* one chunk of code bytes */
	size_t chunk_rows;
};

static void scratch_free(struct compress_scratch *scratch)
{
	free(scratch->norms);
	free(scratch->rows);
	free(scratch->codes);
}

static int scratch_alloc(struct compress_scratch *scratch, const zc_block_layout *layout,
			 bool keys)
{
	size_t dim = layout->head_dim;
	*scratch = (struct compress_scratch){ 0 };
	scratch->chunk_rows = dim >= QUANTIZE_CHUNK_BYTES ? 1 : QUANTIZE_CHUNK_BYTES / dim;
	if (keys)
		scratch->norms = malloc(layout->heads * layout->tokens * sizeof(float) + 1);
	scratch->rows = malloc(((size_t)layout->tokens + 2) * sizeof(uint32_t));
	scratch->codes = malloc(scratch->chunk_rows * dim);
	if ((keys && !scratch->norms) || !scratch->rows || !scratch->codes) {
		scratch_free(scratch);
		return -ENOMEM;
	}
	return 0;
}

/* Whole bytes per row: every row starts on a byte, so a kernel can pack a
 * group's codes straight from its registers, work out the next group's
 * params in the same pass, and write the rows' reconstruction. */
static bool subset_encodes(const struct codec_kernels *kernels, size_t dim, int bits)
{
	return kernels->group_encode && (dim * (size_t)bits) % 8 == 0;
}

/* Both subsets of a head encode (or are empty): its view can be written
 * in the encode's pass, and the encode can check its rows. */
static bool head_encodes(const struct codec_kernels *kernels, const zc_block_layout *layout)
{
	return (layout->n_hi == 0 || subset_encodes(kernels, layout->head_dim, layout->hi_bits)) &&
	       (layout->n_lo == 0 || subset_encodes(kernels, layout->head_dim, layout->lo_bits));
}

/* Quantizes one subset (salient or other rows) of one head; where
 * subset_encodes, writes the rows' reconstruction to view (not NULL).
 * With check (only where subset_encodes), the rows are checked on the
 * way, the first group here and each next one by the encode: returns
 * ZC_ENONFINITE at the first group with NaN or Inf, the groups before
 * the one ahead of it written, that one partly, and the head's mask. */
static int subset_compress(const struct codec_kernels *kernels, const uint16_t *head,
			   const uint32_t *rows, uint32_t n_rows, size_t dim, int bits,
			   size_t group_size, uint8_t *params, uint8_t *codes_stream,
			   size_t codes_bytes, struct compress_scratch *scratch,
			   const struct codec_view *view, bool check)
{
	uint8_t *stream_end = codes_stream + codes_bytes;

	if (n_rows == 0)
		return 0;
	if (subset_encodes(kernels, dim, bits)) {
		size_t n_first = n_rows < group_size ? n_rows : group_size;
		for (size_t r = 0; check && r < n_first; r++) {
			int rc = kernels->check_finite(head + (size_t)rows[r] * dim, dim);
			if (rc < 0)
				return rc;
		}
		kernels->group_params(head, rows, n_first, dim, bits, params, params + 2 * dim);
		for (size_t first = 0; first < n_rows; first += group_size) {
			size_t n_group = n_rows - first < group_size ? n_rows - first : group_size;
			size_t next = first + n_group;
			size_t n_next = n_rows - next < group_size ? n_rows - next : group_size;
			uint8_t *scales = params + (first / group_size) * 4 * dim;
			uint8_t *next_scales = n_next ? scales + 4 * dim : NULL;
			uint8_t *codes = codes_stream + first * dim * (size_t)bits / 8;
			int rc = kernels->group_encode(head, rows + first, n_group, dim, bits,
						       scales, scales + 2 * dim, codes, rows + next,
						       n_next, next_scales,
						       n_next ? next_scales + 2 * dim : NULL, view);
			if (rc < 0)
				return rc;
		}
		return 0;
	}
	for (size_t first = 0; first < n_rows; first += group_size) {
		size_t n_group = n_rows - first < group_size ? n_rows - first : group_size;
		uint8_t *scales = params + (first / group_size) * 4 * dim;
		uint8_t *mins = scales + 2 * dim;
		kernels->group_params(head, rows + first, n_group, dim, bits, scales, mins);
		for (size_t done = 0; done < n_group; done += scratch->chunk_rows) {
			size_t n_chunk = n_group - done < scratch->chunk_rows ?
						 n_group - done : scratch->chunk_rows;
			kernels->group_quantize(head, rows + first + done, n_chunk, dim, bits,
						scales, mins, scratch->codes);
			kernels->pack(codes_stream, stream_end, (first + done) * dim * (size_t)bits,
				      scratch->codes, n_chunk * dim, bits);
		}
	}
	return 0;
}

static void head_reconstruct(const struct codec_kernels *kernels, const zc_block_layout *layout,
			     size_t group_size, const uint8_t *payload, const uint8_t *read_end,
			     uint16_t *out, size_t token_stride, bool nt);

/* Compresses one head into payload and, with a view, writes its
 * reconstruction there: in the encode's pass where both subsets encode,
 * else from the payload just written, while it is in cache. check: as
 * subset_compress (only where head_encodes). */
static int head_compress(const struct codec_kernels *kernels, const zc_block_layout *layout,
			 const zc_codec_config *config, const uint16_t *head,
			 const float *norms, uint8_t *payload, struct compress_scratch *scratch,
			 const struct codec_view *view, bool check)
{
	/* An empty subset (values have no others) writes nothing either way. */
	bool fused = view && head_encodes(kernels, layout);
	uint32_t tokens = layout->tokens, n_hi = 0, n_lo = 0;
	uint8_t *mask = payload + layout->mask_offset;
	uint32_t *hi_rows = scratch->rows;
	uint32_t *lo_rows = scratch->rows + layout->n_hi + 1;

	/* The row lists are built below, so their room is free until then.
	 * Values: every token takes the hi path. */
	saliency_select(norms, tokens, norms ? layout->n_hi : tokens, mask, scratch->rows);
	/* Branch-free: whether a token is salient is data, not a pattern. The
	 * store to the list a token does not join is overwritten by that
	 * list's next token, or lands in the spare slot after its last one. */
	for (uint32_t t = 0; t < tokens; t++) {
		uint32_t salient = (mask[t >> 3] >> (t & 7)) & 1u;
		hi_rows[n_hi] = t;
		lo_rows[n_lo] = t;
		n_hi += salient;
		n_lo += salient ^ 1u;
	}
	int rc = subset_compress(kernels, head, hi_rows, n_hi, layout->head_dim, layout->hi_bits,
				 (size_t)config->group_size, payload + layout->hi_params_offset,
				 payload + layout->hi_codes_offset, layout->hi_codes_bytes, scratch,
				 fused ? view : NULL, check);
	if (rc == 0)
		rc = subset_compress(kernels, head, lo_rows, n_lo, layout->head_dim,
				     layout->lo_bits, (size_t)config->group_size,
				     payload + layout->lo_params_offset,
				     payload + layout->lo_codes_offset, layout->lo_codes_bytes,
				     scratch, fused ? view : NULL, check);
	if (rc == 0 && view && !fused)
		head_reconstruct(kernels, layout, (size_t)config->group_size, payload,
				 payload + layout->head_bytes, view->at, view->token_stride,
				 reconstruct_streams(layout));
	return rc;
}

/* Caller-given saliency scores: the radix select orders non-negative
 * floats by their bits, so a score must be finite and >= 0 (and -0.0,
 * whose bits would sort above every positive score, is taken as 0). */
static int scores_take(const float *scores, size_t n, float *norms)
{
	for (size_t i = 0; i < n; i++) {
		float score = scores[i];
		if (!(score >= 0.0f) || score > FLT_MAX)
			return ZC_EINVALID;
		norms[i] = score == 0.0f ? 0.0f : score;
	}
	return 0;
}

/* Where flat head h (batch-major) of a block starts, in elements. */
static size_t head_offset(const zc_strides *strides, const zc_block_shape *shape, size_t h)
{
	return (h / shape->heads) * strides->batch + (h % shape->heads) * strides->head;
}

static int64_t block_compress(const zc_codec_config *config, zc_tensor tensor,
			      const zc_block_shape *shape, const uint16_t *input,
			      const zc_strides *input_strides, const float *scores, void *out,
			      size_t capacity, uint16_t *view, const zc_strides *view_strides)
{
	const struct codec_kernels *kernels = codec_kernels_active();
	zc_block_layout layout;
	struct compress_scratch scratch;
	bool stream = false;
	int rc = zc_block_layout_compute(config, tensor, shape, &layout);

	if (rc < 0)
		return rc;
	/* Rows must be contiguous: every kernel walks a head as rows of D. */
	if (input_strides->token != layout.head_dim)
		return ZC_ESHAPE;
	if (capacity < layout.total_bytes)
		return ZC_EBUFFER;
	if (layout.total_bytes == 0)
		return 0;

	size_t head_elements = (size_t)layout.tokens * layout.head_dim;
	bool keys = tensor == ZC_TENSOR_KEYS && !layout.exact;
	/* Values with a view, where the encode does the whole head: it checks
	 * the rows itself, which spares a read of the block ahead of it (the
	 * first, from memory), at the cost of all-or-nothing. */
	bool encode_checks = view && tensor == ZC_TENSOR_VALUES && !layout.exact &&
			     head_encodes(kernels, &layout);
	rc = scratch_alloc(&scratch, &layout, keys);
	if (rc < 0)
		return rc;
	/* Otherwise the whole block is checked before the first byte is
	 * written, so a rejected block leaves the caller's buffers as they
	 * were. */
	for (size_t h = 0; h < layout.heads && rc == 0; h++) {
		const uint16_t *head = input + head_offset(input_strides, shape, h);
		if (keys && !scores)
			rc = kernels->row_norms(head, layout.tokens, layout.head_dim,
						scratch.norms + h * layout.tokens);
		else if (!encode_checks)
			rc = kernels->check_finite(head, head_elements);
	}
	if (rc == 0 && keys && scores)
		rc = scores_take(scores, layout.heads * layout.tokens, scratch.norms);
	if (rc < 0)
		goto out_free;

	stream = view && !layout.exact && reconstruct_streams(&layout) && codec_views_stream();
	for (size_t h = 0; h < layout.heads; h++) {
		const uint16_t *head = input + head_offset(input_strides, shape, h);
		uint8_t *payload = (uint8_t *)out + h * layout.head_bytes;
		struct codec_view head_view = { 0 };
		if (view) {
			head_view.at = view + head_offset(view_strides, shape, h);
			head_view.token_stride = view_strides->token;
			head_view.stream = stream && rows_on_lines(head_view.at, head_view.token_stride);
		}
		if (layout.exact) {
			memcpy(payload, head, layout.head_bytes);
			for (size_t t = 0; view && t < layout.tokens; t++)
				memcpy(head_view.at + t * head_view.token_stride,
				       head + t * layout.head_dim, layout.head_dim * 2);
			continue;
		}
		rc = head_compress(kernels, &layout, config, head,
				   keys ? scratch.norms + h * layout.tokens : NULL, payload,
				   &scratch, view ? &head_view : NULL, encode_checks);
		if (rc < 0)
			goto out_free;
	}
	rc = 0;
out_free:
	/* A view written by non-temporal stores is in memory, in order with
	 * what this thread stores next, only after the fence. */
	if (stream)
		stores_fence();
	scratch_free(&scratch);
	return rc < 0 ? rc : (int64_t)layout.total_bytes;
}

int64_t zc_block_compress_strided(const zc_codec_config *config, zc_tensor tensor,
				  const zc_block_shape *shape, const uint16_t *input,
				  const zc_strides *input_strides, void *out, size_t capacity)
{
	return block_compress(config, tensor, shape, input, input_strides, NULL, out, capacity,
			      NULL, NULL);
}

static zc_strides contiguous_strides(const zc_block_shape *shape)
{
	size_t head = (size_t)shape->tokens * shape->head_dim;
	zc_strides contiguous = {
		.batch = head * shape->heads,
		.head = head,
		.token = shape->head_dim,
	};
	return contiguous;
}

int64_t zc_block_compress(const zc_codec_config *config, zc_tensor tensor,
			  const zc_block_shape *shape, const uint16_t *input,
			  void *out, size_t capacity)
{
	zc_strides contiguous = contiguous_strides(shape);
	return block_compress(config, tensor, shape, input, &contiguous, NULL, out, capacity,
			      NULL, NULL);
}

int64_t zc_block_compress_scored(const zc_codec_config *config, const zc_block_shape *shape,
				 const uint16_t *keys, const float *scores, void *out,
				 size_t capacity)
{
	if (!scores)
		return ZC_EINVALID;
	zc_strides contiguous = contiguous_strides(shape);
	return block_compress(config, ZC_TENSOR_KEYS, shape, keys, &contiguous, scores, out,
			      capacity, NULL, NULL);
}

int64_t zc_block_compress_scored_strided(const zc_codec_config *config,
					 const zc_block_shape *shape, const uint16_t *keys,
					 const zc_strides *key_strides, const float *scores,
					 void *out, size_t capacity)
{
	if (!scores || !key_strides)
		return ZC_EINVALID;
	return block_compress(config, ZC_TENSOR_KEYS, shape, keys, key_strides, scores, out,
			      capacity, NULL, NULL);
}

int64_t zc_block_compress_view(const zc_codec_config *config, zc_tensor tensor,
			       const zc_block_shape *shape, const uint16_t *input,
			       const zc_strides *input_strides, const float *scores, void *out,
			       size_t capacity, uint16_t *view, const zc_strides *view_strides)
{
	if (!input_strides || !view || !view_strides ||
	    (scores && tensor != ZC_TENSOR_KEYS))
		return ZC_EINVALID;
	return block_compress(config, tensor, shape, input, input_strides, scores, out,
			      capacity, view, view_strides);
}

/* Rows handed to one group_reconstruct call at most (a stack list). */
#define RECONSTRUCT_CHUNK_ROWS 256u

/* Walks the tokens of one subset in order: the set bits of the mask
 * (salient) or its clear bits (the others), 64 tokens at a time. */
struct token_walk {
	const uint8_t *mask;
	size_t mask_bytes;
	uint32_t tokens;
	uint32_t base;     /* token of bit 0 of word */
	uint64_t word;     /* the subset's tokens among base..base+63 not yet taken */
	uint64_t invert;   /* 0: set bits, ~0: clear bits */
};

static uint64_t walk_load(const struct token_walk *walk)
{
	size_t at = walk->base / 8;
	size_t n = walk->mask_bytes - at < 8 ? walk->mask_bytes - at : 8;
	uint64_t word = 0;
	/* Little-endian assembly, so bit t % 64 is token base + t % 64. */
	for (size_t i = 0; i < n; i++)
		word |= (uint64_t)walk->mask[at + i] << (8 * i);
	word ^= walk->invert;
	uint32_t left = walk->tokens - walk->base;
	if (left < 64)
		word &= (UINT64_C(1) << left) - 1u;
	return word;
}

static void walk_init(struct token_walk *walk, const uint8_t *mask, size_t mask_bytes,
		      uint32_t tokens, bool salient)
{
	*walk = (struct token_walk){ .mask = mask, .mask_bytes = mask_bytes, .tokens = tokens,
				     .invert = salient ? 0 : ~UINT64_C(0) };
	if (tokens)
		walk->word = walk_load(walk);
}

/* Up to max next tokens of the subset into list; returns how many. */
static size_t walk_next(struct token_walk *walk, uint32_t *list, size_t max)
{
	size_t n = 0;
	while (n < max) {
		while (walk->word == 0) {
			if (walk->tokens - walk->base <= 64)
				return n;
			walk->base += 64;
			walk->word = walk_load(walk);
		}
		list[n++] = walk->base + (uint32_t)__builtin_ctzll(walk->word);
		walk->word &= walk->word - 1u;
	}
	return n;
}

/* Reconstructs one subset of one head, a group (or a chunk of one) per
 * kernel call, so the kernel widens each group's params only once. */
static void subset_reconstruct(const struct codec_kernels *kernels, struct token_walk *walk,
			       uint32_t n_rows, size_t dim, int bits, size_t group_size,
			       const uint8_t *params, const uint8_t *codes, const uint8_t *read_end,
			       uint16_t *out, size_t token_stride, bool nt)
{
	bool streamed = nt && rows_on_lines(out, token_stride);
	uint32_t list[RECONSTRUCT_CHUNK_ROWS];
	size_t row = 0;

	while (row < n_rows) {
		size_t group = row / group_size;
		size_t group_end = (group + 1) * group_size < n_rows ? (group + 1) * group_size :
								       n_rows;
		size_t want = group_end - row < RECONSTRUCT_CHUNK_ROWS ? group_end - row :
									  RECONSTRUCT_CHUNK_ROWS;
		size_t got = walk_next(walk, list, want);
		if (got == 0)
			return; /* cannot happen: the mask's count was checked */
		const uint8_t *scales = params + group * 4 * dim;
		kernels->group_reconstruct(codes, read_end, row * dim * (size_t)bits, got, dim,
					   bits, scales, scales + 2 * dim, list, out, token_stride,
					   streamed);
		row += got;
	}
}

static void head_reconstruct(const struct codec_kernels *kernels, const zc_block_layout *layout,
			     size_t group_size, const uint8_t *payload, const uint8_t *read_end,
			     uint16_t *out, size_t token_stride, bool nt)
{
	const uint8_t *mask = payload + layout->mask_offset;
	struct token_walk walk;

	walk_init(&walk, mask, layout->mask_bytes, layout->tokens, true);
	subset_reconstruct(kernels, &walk, layout->n_hi, layout->head_dim, layout->hi_bits,
			   group_size, payload + layout->hi_params_offset,
			   payload + layout->hi_codes_offset, read_end, out, token_stride, nt);
	walk_init(&walk, mask, layout->mask_bytes, layout->tokens, false);
	subset_reconstruct(kernels, &walk, layout->n_lo, layout->head_dim, layout->lo_bits,
			   group_size, payload + layout->lo_params_offset,
			   payload + layout->lo_codes_offset, read_end, out, token_stride, nt);
}

/* A mask whose population is not n_hi would index past the params. Set
 * bits past the last token are refused as well: the walk over the mask
 * ignores them, so counting them would let a short mask through. */
bool codec_mask_matches(const zc_block_layout *layout, const uint8_t *mask)
{
	size_t count = 0, i = 0;
	for (; i + 8 <= layout->mask_bytes; i += 8) {
		uint64_t word;
		memcpy(&word, mask + i, 8);
		/* SWAR popcount: the portable build has no POPCNT instruction. */
		word -= (word >> 1) & UINT64_C(0x5555555555555555);
		word = (word & UINT64_C(0x3333333333333333)) +
		       ((word >> 2) & UINT64_C(0x3333333333333333));
		word = (word + (word >> 4)) & UINT64_C(0x0f0f0f0f0f0f0f0f);
		count += (size_t)((word * UINT64_C(0x0101010101010101)) >> 56);
	}
	for (; i < layout->mask_bytes; i++)
		count += (size_t)__builtin_popcount(mask[i]);
	unsigned used = layout->tokens & 7u;
	if (used && (mask[layout->mask_bytes - 1] >> used) != 0)
		return false;
	return count == layout->n_hi;
}

int zc_block_reconstruct(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, const void *compressed,
			 size_t size, uint16_t *out, const zc_strides *strides)
{
	const struct codec_kernels *kernels = codec_kernels_active();
	zc_block_layout layout;
	int rc = zc_block_layout_compute(config, tensor, shape, &layout);

	if (rc < 0)
		return rc;
	if (size != layout.total_bytes)
		return ZC_ECORRUPT;
	const uint8_t *bytes = compressed;
	const uint8_t *read_end = bytes + size;
	size_t dim = layout.head_dim;
	bool nt = reconstruct_streams(&layout);

	if (!layout.exact) {
		for (size_t h = 0; h < layout.heads; h++) {
			if (!codec_mask_matches(&layout, bytes + h * layout.head_bytes + layout.mask_offset))
				return ZC_ECORRUPT;
		}
	}
	for (uint32_t b = 0; b < shape->batch; b++) {
		for (uint32_t hh = 0; hh < shape->heads; hh++) {
			size_t h = (size_t)b * shape->heads + hh;
			const uint8_t *payload = bytes + h * layout.head_bytes;
			uint16_t *head_out = out + b * strides->batch + hh * strides->head;
			if (layout.exact) {
				for (uint32_t t = 0; t < layout.tokens; t++)
					memcpy(head_out + t * strides->token,
					       payload + (size_t)t * dim * 2, dim * 2);
				continue;
			}
			head_reconstruct(kernels, &layout, (size_t)config->group_size, payload,
					 read_end, head_out, strides->token, nt);
		}
	}
	/* Non-temporal stores are ordered with no later store: without a
	 * fence, the caller's next store (a layer's sequence, which tells
	 * readers the view is whole) could be seen before the view is.
	 * SFENCE, not the LOCK'd op a C11 fence compiles to, which the
	 * architecture does not promise to order them by. */
	if (nt)
		stores_fence();
	return 0;
}

int zc_fp16_check_finite(const uint16_t *values, size_t n)
{
	return codec_kernels_active()->check_finite(values, n);
}
