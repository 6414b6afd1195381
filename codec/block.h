/* What block.c shares with the other readers of a payload (attend.c). */
#ifndef ZIPCACHE_CODEC_BLOCK_H
#define ZIPCACHE_CODEC_BLOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "zipcache/codec.h"

/* True when a head's saliency mask has exactly layout->n_hi set bits and
 * none past the last token: only then do its subsets index inside the
 * payload's params and codes. */
bool codec_mask_matches(const zc_block_layout *layout, const uint8_t *mask);

#endif
