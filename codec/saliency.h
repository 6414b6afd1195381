#ifndef ZIPCACHE_SALIENCY_H
#define ZIPCACHE_SALIENCY_H

#include <stdint.h>

/* Sets bit t of mask (ceil(tokens/8) bytes, cleared first) for each of the
 * n_hi tokens largest by (norm, index). Norms must be >= 0 and not NaN.
 * scratch has room for `tokens` entries. */
void saliency_select(const float *norms, uint32_t tokens, uint32_t n_hi, uint8_t *mask,
		     uint32_t *scratch);

#endif
