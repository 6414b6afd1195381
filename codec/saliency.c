/*
 * Which tokens are salient: the n_hi largest by (norm, index). A radix
 * select over the norms' bit patterns (non-negative floats order like
 * their bits) finds the threshold, so the cost is O(S) whatever the data,
 * with no worst case an adversary could pick.
 *
 * Norms of one head mostly share their top bits, so the first digit is
 * taken just below the bits that all of them share (found from their min
 * and max); the tokens left in the threshold's bucket are copied to a
 * list, and the later digits only look at that list. Three passes over
 * the whole head: min/max, histogram, and marking.
 */
#include "saliency.h"

#include <string.h>

static uint32_t key_of(const float *norms, uint32_t t)
{
	uint32_t key;
	memcpy(&key, &norms[t], sizeof(key));
	return key;
}

static void mark(uint8_t *mask, uint32_t t)
{
	mask[t >> 3] |= (uint8_t)(1u << (t & 7));
}

/* The bucket holding the need-th largest digit; need becomes how many of
 * that bucket are still wanted. */
static uint32_t threshold_bucket(const uint32_t histogram[256], uint32_t *need)
{
	uint32_t byte = 255;
	while (histogram[byte] < *need) {
		*need -= histogram[byte];
		byte--;
	}
	return byte;
}

void saliency_select(const float *norms, uint32_t tokens, uint32_t n_hi, uint8_t *mask,
		     uint32_t *scratch)
{
	memset(mask, 0, ((size_t)tokens + 7) / 8);
	if (n_hi == 0)
		return;
	if (n_hi >= tokens) {
		for (uint32_t t = 0; t < tokens; t++)
			mark(mask, t);
		return;
	}

	uint32_t lo = UINT32_MAX, hi = 0;
	for (uint32_t t = 0; t < tokens; t++) {
		uint32_t key = key_of(norms, t);
		lo = key < lo ? key : lo;
		hi = key > hi ? key : hi;
	}
	uint32_t need = n_hi;
	if (lo == hi) {
		/* All equal: the latest n_hi. */
		for (uint32_t t = tokens - n_hi; t < tokens; t++)
			mark(mask, t);
		return;
	}

	/* The digit's top bit is the highest bit in which the keys differ;
	 * every bit above it is the same in all of them. */
	int top = 31 - __builtin_clz(lo ^ hi);
	int shift = top >= 7 ? top - 7 : 0;
	uint32_t histogram[256] = { 0 };
	for (uint32_t t = 0; t < tokens; t++)
		histogram[(key_of(norms, t) >> shift) & 0xffu]++;
	uint32_t bucket = threshold_bucket(histogram, &need);

	/* Above the bucket: salient. In it: candidates, in token order. */
	uint32_t *candidates = scratch;
	uint32_t n = 0;
	for (uint32_t t0 = 0; t0 < tokens; t0 += 8) {
		uint32_t end = tokens - t0 < 8 ? tokens - t0 : 8;
		unsigned byte = 0;
		for (uint32_t j = 0; j < end; j++) {
			uint32_t digit = (key_of(norms, t0 + j) >> shift) & 0xffu;
			byte |= (unsigned)(digit > bucket) << j;
			candidates[n] = t0 + j;
			n += digit == bucket;
		}
		mask[t0 >> 3] = (uint8_t)byte;
	}

	/* The candidates share every bit from `shift` up; narrow them down
	 * one digit at a time until the bucket is exactly what is needed or
	 * its keys are all equal (then the latest ones win the ties). */
	while (n > need && shift > 0) {
		int next = shift >= 8 ? shift - 8 : 0;
		uint32_t digit_mask = (1u << (shift - next)) - 1u;
		memset(histogram, 0, sizeof(histogram));
		for (uint32_t i = 0; i < n; i++)
			histogram[(key_of(norms, candidates[i]) >> next) & digit_mask]++;
		bucket = threshold_bucket(histogram, &need);
		uint32_t kept = 0;
		for (uint32_t i = 0; i < n; i++) {
			uint32_t t = candidates[i];
			uint32_t digit = (key_of(norms, t) >> next) & digit_mask;
			if (digit > bucket)
				mark(mask, t);
			candidates[kept] = t;
			kept += digit == bucket;
		}
		n = kept;
		shift = next;
	}
	for (uint32_t i = n - need; i < n; i++)
		mark(mask, candidates[i]);
}
