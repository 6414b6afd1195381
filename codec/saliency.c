/*
 * Which tokens are salient: the n_hi largest by (norm, index). A radix
 * select over the norms' bit patterns (non-negative floats order like
 * their bits) finds the threshold in four linear passes, so the cost is
 * O(S) whatever the data, with no worst case an adversary could pick.
 */
#include "saliency.h"

#include <string.h>

void saliency_select(const float *norms, uint32_t tokens, uint32_t n_hi, uint8_t *mask)
{
	memset(mask, 0, ((size_t)tokens + 7) / 8);
	if (n_hi == 0)
		return;
	if (n_hi >= tokens) {
		for (uint32_t t = 0; t < tokens; t++)
			mask[t >> 3] |= (uint8_t)(1u << (t & 7));
		return;
	}

	/* Find the n_hi-th largest key one byte at a time, from the top. */
	uint32_t prefix = 0, prefix_mask = 0, need = n_hi;
	for (int shift = 24; shift >= 0; shift -= 8) {
		uint32_t histogram[256] = { 0 };
		for (uint32_t t = 0; t < tokens; t++) {
			uint32_t key;
			memcpy(&key, &norms[t], sizeof(key));
			if ((key & prefix_mask) == prefix)
				histogram[(key >> shift) & 0xffu]++;
		}
		uint32_t byte = 255;
		while (histogram[byte] < need) {
			need -= histogram[byte];
			byte--;
		}
		prefix |= byte << shift;
		prefix_mask |= 0xffu << shift;
	}

	/* Everything above the threshold is salient; of the tokens equal to
	 * it, the `need` latest ones are (ties go to the later token). */
	for (uint32_t t = 0; t < tokens; t++) {
		uint32_t key;
		memcpy(&key, &norms[t], sizeof(key));
		if (key > prefix)
			mask[t >> 3] |= (uint8_t)(1u << (t & 7));
	}
	for (uint32_t t = tokens; t-- > 0 && need > 0;) {
		uint32_t key;
		memcpy(&key, &norms[t], sizeof(key));
		if (key == prefix) {
			mask[t >> 3] |= (uint8_t)(1u << (t & 7));
			need--;
		}
	}
}
