/* Synthetic K/V blocks shared by the benchmarks. */
#ifndef ZIPCACHE_SYNTHETIC_KV_H
#define ZIPCACHE_SYNTHETIC_KV_H

#include <stdbool.h>
#include <stdint.h>

/*
 * Fills a contiguous [heads, tokens, head_dim] fp16 block (head_dim at most
 * ZC_MAX_HEAD_DIM) from a fixed seed: the same bytes on every run and
 * machine. Keys (keys = true) look like real post-RoPE keys in the ways
 * that matter to the codec: per-channel scales around 1, four outlier
 * channels per head with a large fixed-sign offset (they stretch the
 * per-channel ranges) and a high-norm first token (the attention sink the
 * saliency routing must pick). Values are plain roughly-normal data with a
 * mild per-channel spread; real models have no channel outliers there.
 */
void synthetic_kv_fill(uint16_t *x, uint32_t heads, uint32_t tokens, uint32_t head_dim,
		       bool keys, uint64_t seed);

#endif
