/*
 * The reader (zipcache/reader.h) over a session map and a pool named by
 * address and size, so that the checks can be driven with forged maps:
 * the public zc_* calls are these on the mappings a session handle holds.
 * A map_reader borrows its mappings.
 */
#ifndef ZIPCACHE_MAP_READER_H
#define ZIPCACHE_MAP_READER_H

#include <stdint.h>

#include "zipcache/map.h"
#include "zipcache/reader.h"

struct map_reader {
	const zc_map_header *map;
	uint64_t map_bytes;        /* what is mapped at map */
	const uint8_t *pool;
	uint64_t pool_bytes;       /* what is mapped at pool */
};

int map_read_begin(const struct map_reader *reader, uint32_t layer, int timeout_ms,
		   zc_read *read);
int map_read_end(const struct map_reader *reader, const zc_read *read);
int map_layer_layout(const struct map_reader *reader, const zc_read *read,
		     zc_layer_contents *layout);
int map_layer_block(const struct map_reader *reader, const zc_read *read, uint32_t index,
		    zc_block *block);
int map_block_reconstruct_rows(const struct map_reader *reader, const zc_block *block,
			       uint16_t *keys_out, const zc_strides *key_strides,
			       uint16_t *values_out, const zc_strides *value_strides);
int map_layer_reconstruct(const struct map_reader *reader, uint32_t layer, uint16_t *keys_out,
			  const zc_strides *key_strides, uint16_t *values_out,
			  const zc_strides *value_strides, uint32_t capacity, uint32_t *tokens);

#endif
