/* Synthetic K/V data for the benchmarks: splitmix64 and Box-Muller. */
#include "synthetic_kv.h"

#include <math.h>
#include <stddef.h>

#include "zipcache/codec.h"

struct generator {
	uint64_t state;
};

static uint64_t generator_next(struct generator *g)
{
	uint64_t z = (g->state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in (0, 1): never 0, so log() below is finite. */
static double generator_uniform(struct generator *g)
{
	return ((double)(generator_next(g) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double generator_normal(struct generator *g)
{
	/* Box-Muller; the second variate is thrown away: the generator is
	 * far from being what a benchmark's setup waits on. */
	double u1 = generator_uniform(g), u2 = generator_uniform(g);
	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void synthetic_kv_fill(uint16_t *x, uint32_t heads, uint32_t tokens, uint32_t head_dim,
		       bool keys, uint64_t seed)
{
	float scale[ZC_MAX_HEAD_DIM], bias[ZC_MAX_HEAD_DIM];
	struct generator g = { seed };

	for (uint32_t h = 0; h < heads; h++) {
		for (uint32_t c = 0; c < head_dim; c++) {
			scale[c] = (float)(0.5 + generator_uniform(&g));
			bias[c] = (float)(0.1 * generator_normal(&g));
		}
		if (keys) {
			/* Four outlier channels per head, 8..16 in magnitude. */
			for (int k = 0; k < 4; k++) {
				uint32_t c = (uint32_t)(generator_next(&g) % head_dim);
				double sign = (generator_next(&g) & 1) ? 1.0 : -1.0;
				bias[c] = (float)(sign * (8.0 + 8.0 * generator_uniform(&g)));
				scale[c] = (float)(2.0 + 2.0 * generator_uniform(&g));
			}
		}
		uint16_t *head = x + (size_t)h * tokens * head_dim;
		for (uint32_t t = 0; t < tokens; t++) {
			/* Token-to-token norm variation, plus the sink at t = 0. */
			double token_scale = 0.8 + 0.4 * generator_uniform(&g);
			if (keys && t == 0)
				token_scale = 6.0;
			for (uint32_t c = 0; c < head_dim; c++) {
				double v = bias[c] + scale[c] * token_scale * generator_normal(&g);
				head[(size_t)t * head_dim + c] = zc_float_to_fp16((float)v);
			}
		}
	}
}
