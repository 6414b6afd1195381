/*
 * The arithmetic of a K or V block outside the store: one definition of
 * how many elements and fp16 bytes a [batch, kv_heads, tokens, head_dim]
 * block holds, and of the strides of a [batch][kv_heads][max_tokens][D]
 * view (the layout the client maps, proto/store_format.h). The daemon
 * checks requests with it and the client sizes and reads with it, so the
 * two cannot disagree.
 */
#ifndef ZIPCACHE_KV_LAYOUT_H
#define ZIPCACHE_KV_LAYOUT_H

#include <stdint.h>

#include "zipcache/codec.h"

/* Elements of one block (every factor is bounded, so 64 bits hold it). */
static inline uint64_t kv_block_elements(uint32_t batch, uint32_t kv_heads, uint64_t tokens,
					 uint32_t head_dim)
{
	return (uint64_t)batch * kv_heads * tokens * head_dim;
}

/* Its fp16 bytes. */
static inline uint64_t kv_block_bytes(uint32_t batch, uint32_t kv_heads, uint64_t tokens,
				      uint32_t head_dim)
{
	return kv_block_elements(batch, kv_heads, tokens, head_dim) * 2;
}

/* Element strides of a view sized for max_tokens. */
static inline zc_strides kv_view_strides(uint32_t kv_heads, uint32_t max_tokens, uint32_t head_dim)
{
	return (zc_strides){ (size_t)kv_heads * max_tokens * head_dim,
			     (size_t)max_tokens * head_dim, head_dim };
}

#endif
