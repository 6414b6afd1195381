/*
 * The chain rule of prefix reuse (zipcache/client.h, docs/PREFIX.md): the
 * one definition of a chunk's key, which the Python client calls too.
 */
#include "zipcache/client.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "zipcache/error.h"

int zc_chunk_chain(const uint8_t *prev, const uint32_t *token_ids, size_t n,
		   uint8_t out[ZC_CHUNK_KEY_BYTES])
{
	static const uint8_t zero[ZC_CHUNK_KEY_BYTES];
	XXH3_state_t state;
	uint8_t le[1024];

	if (!token_ids || n == 0 || !out)
		return ZC_EINVALID;
	XXH3_INITSTATE(&state);
	if (XXH3_128bits_reset(&state) != XXH_OK)
		return ZC_EINTERNAL;
	XXH3_128bits_update(&state, prev ? prev : zero, ZC_CHUNK_KEY_BYTES);
	/* Token ids as little-endian uint32 whatever the host's byte order. */
	for (size_t at = 0; at < n;) {
		size_t count = 0;
		for (; at < n && count < sizeof(le) / 4; at++, count++) {
			uint32_t t = token_ids[at];
			le[4 * count] = (uint8_t)t;
			le[4 * count + 1] = (uint8_t)(t >> 8);
			le[4 * count + 2] = (uint8_t)(t >> 16);
			le[4 * count + 3] = (uint8_t)(t >> 24);
		}
		XXH3_128bits_update(&state, le, 4 * count);
	}
	XXH128_canonical_t canonical;
	XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
	memcpy(out, canonical.digest, ZC_CHUNK_KEY_BYTES);
	return 0;
}
