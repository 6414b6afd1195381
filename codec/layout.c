/*
 * Config validation, the n_hi rule, and where each part of a head payload
 * sits. Everything here is derived from (config, tensor, shape); nothing
 * is stored, so a block and its accounting can never disagree.
 */
#include "zipcache/codec.h"

#include <math.h>

void zc_codec_config_default(zc_codec_config *config)
{
	config->hi_bits = ZC_DEFAULT_HI_BITS;
	config->lo_bits = ZC_DEFAULT_LO_BITS;
	config->hi_fraction = ZC_DEFAULT_HI_FRACTION;
	config->group_size = ZC_DEFAULT_GROUP_SIZE;
	config->quantize_values = true;
	config->saliency = ZC_SALIENCY_KEY_NORM;
}

int zc_codec_config_validate(const zc_codec_config *config)
{
	if (config->hi_bits < 1 || config->hi_bits > 8 ||
	    config->lo_bits < 1 || config->lo_bits > 8)
		return ZC_EBITS;
	/* Written so that NaN fails too. */
	if (!(config->hi_fraction >= 0.0 && config->hi_fraction <= 1.0))
		return ZC_EFRACTION;
	if (config->group_size < 1)
		return ZC_EGROUPSIZE;
	if (config->saliency != ZC_SALIENCY_KEY_NORM && config->saliency != ZC_SALIENCY_ATTENTION)
		return ZC_EINVALID;
	return 0;
}

uint32_t zc_codec_salient_tokens(const zc_codec_config *config, zc_tensor tensor,
				 uint32_t tokens)
{
	if (tensor == ZC_TENSOR_VALUES)
		return tokens;
	double wanted = ceil((double)tokens * config->hi_fraction);
	if (!(wanted >= 0.0))
		return 0;
	if (wanted > (double)tokens)
		return tokens;
	return (uint32_t)wanted;
}

static size_t ceil_div(size_t a, size_t b)
{
	return (a + b - 1) / b;
}

static int shape_validate(const zc_block_shape *shape)
{
	if (shape->batch == 0 || shape->heads == 0 || shape->head_dim == 0)
		return ZC_ESHAPE;
	if (shape->head_dim > ZC_MAX_HEAD_DIM || shape->tokens > ZC_MAX_BLOCK_TOKENS ||
	    shape->batch > 65536 || shape->heads > 65536)
		return ZC_ESHAPE;
	/* The fp16 block must be addressable; the payload is never larger than
	 * 2.25x of it (per-group params of one-row groups), checked below. */
	uint64_t elements = (uint64_t)shape->batch * shape->heads * shape->tokens;
	if (elements > (UINT64_C(1) << 40) / shape->head_dim)
		return ZC_ESHAPE;
	return 0;
}

int zc_block_layout_compute(const zc_codec_config *config, zc_tensor tensor,
			    const zc_block_shape *shape, zc_block_layout *layout)
{
	int rc = zc_codec_config_validate(config);
	if (rc < 0)
		return rc;
	if (tensor != ZC_TENSOR_KEYS && tensor != ZC_TENSOR_VALUES)
		return ZC_ETENSOR;
	rc = shape_validate(shape);
	if (rc < 0)
		return rc;

	size_t tokens = shape->tokens, dim = shape->head_dim;
	*layout = (zc_block_layout){ 0 };
	layout->tokens = shape->tokens;
	layout->head_dim = shape->head_dim;
	layout->heads = (size_t)shape->batch * shape->heads;
	layout->hi_bits = config->hi_bits;
	layout->lo_bits = config->lo_bits;

	if (tensor == ZC_TENSOR_VALUES && !config->quantize_values) {
		layout->exact = true;
		layout->n_hi = shape->tokens;
		layout->head_bytes = 2 * tokens * dim;
		layout->total_bytes = layout->heads * layout->head_bytes;
		return 0;
	}
	if (tensor == ZC_TENSOR_VALUES)
		layout->lo_bits = config->hi_bits;

	size_t group = (size_t)config->group_size;
	layout->n_hi = zc_codec_salient_tokens(config, tensor, shape->tokens);
	layout->n_lo = shape->tokens - layout->n_hi;
	layout->groups_hi = (uint32_t)ceil_div(layout->n_hi, group);
	layout->groups_lo = (uint32_t)ceil_div(layout->n_lo, group);

	size_t offset = 0;
	layout->mask_offset = offset;
	layout->mask_bytes = ceil_div(tokens, 8);
	offset += layout->mask_bytes;
	layout->hi_params_offset = offset;
	offset += 4 * dim * layout->groups_hi;
	layout->lo_params_offset = offset;
	offset += 4 * dim * layout->groups_lo;
	layout->hi_codes_offset = offset;
	layout->hi_codes_bytes = ceil_div((size_t)layout->n_hi * dim * (size_t)layout->hi_bits, 8);
	offset += layout->hi_codes_bytes;
	layout->lo_codes_offset = offset;
	layout->lo_codes_bytes = ceil_div((size_t)layout->n_lo * dim * (size_t)layout->lo_bits, 8);
	offset += layout->lo_codes_bytes;
	layout->head_bytes = offset;
	layout->total_bytes = layout->heads * offset;
	return 0;
}

int zc_block_count_bytes(const zc_codec_config *config, zc_tensor tensor,
			 const zc_block_shape *shape, zc_byte_count *count)
{
	zc_block_layout layout;
	int rc = zc_block_layout_compute(config, tensor, shape, &layout);
	if (rc < 0)
		return rc;
	uint64_t tokens = shape->tokens, dim = shape->head_dim, heads = layout.heads;
	uint64_t baseline_head = (tokens * dim * (uint64_t)config->lo_bits + 7) / 8 +
				 4 * dim * ((tokens + (uint64_t)config->group_size - 1) /
					    (uint64_t)config->group_size);
	count->compressed = (uint64_t)layout.total_bytes;
	count->baseline = heads * baseline_head;
	count->fp16 = heads * 2 * tokens * dim;
	return 0;
}
