/*
 * libzipcache_cuda on a GPU (`make check-gpu`): every config the codec's
 * tests use, reconstructed on the device bit-identical to the CPU codec;
 * through every transfer path (bounce buffer in small and default chunks,
 * registered host memory, payloads already on the device); incremental
 * loads equal to full ones; a corrupt device payload reported and not
 * written. `cuda_test --probe` only says whether a GPU is there (what
 * `make check` prints); --require makes its absence a failure.
 */
#include <check.h>

#include <cuda_runtime.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda_layers.h"
#include "../suite_main.h"
#include "zipcache/cuda.h"

#define REQUIRE(condition, ...) \
	do { \
		if (!(condition)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

#define CUDA_OK(call) \
	do { \
		cudaError_t ok_error_ = (call); \
		REQUIRE(ok_error_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(ok_error_)); \
	} while (0)

static bool quick(void)
{
	return getenv("ZC_CUDA_TEST_QUICK") != NULL;
}

struct device_target {
	struct test_target shape;
	uint16_t *keys, *values;            /* device */
	uint16_t *host_keys, *host_values;  /* what came back */
	uint16_t *expected_keys, *expected_values;
	zc_cuda_target target;
	size_t offset;                      /* elements the target starts past the allocation */
};

static void target_init(struct device_target *t, const struct test_layer *layer,
			uint32_t max_tokens, uint32_t token_pad, uint32_t head_pad, size_t offset)
{
	memset(t, 0, sizeof *t);
	test_target_shape(&t->shape, layer, max_tokens, token_pad, head_pad);
	t->offset = offset;
	size_t kb = (t->shape.key_elements + offset) * 2, vb = (t->shape.value_elements + offset) * 2;
	CUDA_OK(cudaMalloc((void **)&t->keys, kb));
	CUDA_OK(cudaMalloc((void **)&t->values, vb));
	t->host_keys = malloc(kb);
	t->host_values = malloc(vb);
	t->expected_keys = malloc(kb);
	t->expected_values = malloc(vb);
	ck_assert(t->host_keys && t->host_values && t->expected_keys && t->expected_values);
	test_fill_sentinel(t->host_keys, t->shape.key_elements + offset);
	test_fill_sentinel(t->host_values, t->shape.value_elements + offset);
	CUDA_OK(cudaMemcpy(t->keys, t->host_keys, kb, cudaMemcpyHostToDevice));
	CUDA_OK(cudaMemcpy(t->values, t->host_values, vb, cudaMemcpyHostToDevice));
	t->target = (zc_cuda_target){ t->keys + offset, t->values + offset, t->shape.key_strides,
				      t->shape.value_strides, max_tokens };
}

static void target_free(struct device_target *t)
{
	cudaFree(t->keys);
	cudaFree(t->values);
	free(t->host_keys);
	free(t->host_values);
	free(t->expected_keys);
	free(t->expected_values);
}

static void target_fetch(struct device_target *t)
{
	CUDA_OK(cudaMemcpy(t->host_keys, t->keys + t->offset, t->shape.key_elements * 2,
			   cudaMemcpyDeviceToHost));
	CUDA_OK(cudaMemcpy(t->host_values, t->values + t->offset, t->shape.value_elements * 2,
			   cudaMemcpyDeviceToHost));
}

static void assert_target(struct device_target *t, const struct test_layer *layer,
			  const char *what, int index)
{
	target_fetch(t);
	ck_assert_int_eq(test_expected(layer, &t->shape, t->expected_keys, t->expected_values), 0);
	long k = test_first_difference(t->host_keys, t->expected_keys, t->shape.key_elements);
	long v = test_first_difference(t->host_values, t->expected_values, t->shape.value_elements);
	REQUIRE(k < 0, "%s case %d: keys differ at element %ld: GPU %#x, CPU codec %#x", what,
		index, k, k < 0 ? 0 : t->host_keys[k], k < 0 ? 0 : t->expected_keys[k]);
	REQUIRE(v < 0, "%s case %d: values differ at element %ld: GPU %#x, CPU codec %#x", what,
		index, v, v < 0 ? 0 : t->host_values[v], v < 0 ? 0 : t->expected_values[v]);
}

static zc_cuda *open_context(size_t chunk)
{
	zc_cuda *cuda = NULL;
	int rc = zc_cuda_open(0, chunk, &cuda);
	REQUIRE(rc == 0, "zc_cuda_open: %s", zc_strerror(rc));
	return cuda;
}

static void load(zc_cuda *cuda, const zc_cuda_layer *layer, const zc_cuda_target *target,
		 zc_cuda_mirror *mirror, const char *what, int index)
{
	int rc = zc_cuda_load_layer(cuda, layer, target, mirror, NULL);
	REQUIRE(rc == 0, "%s case %d: load: %s (%s)", what, index, zc_strerror(rc),
		zc_cuda_last_error(cuda));
	rc = zc_cuda_synchronize(cuda, NULL);
	REQUIRE(rc == 0, "%s case %d: synchronize: %s (%s)", what, index, zc_strerror(rc),
		zc_cuda_last_error(cuda));
}

static void build_case(struct test_layer *layer, const struct test_case_config *c, int index)
{
	int rc = test_layer_build(layer, &c->config, c->batch, c->heads, c->head_dim_k,
				  c->head_dim_v, c->block_tokens, c->n_blocks, c->residual,
				  1000u + (uint64_t)index);
	REQUIRE(rc == 0, "case %d: build: %s", index, zc_strerror(rc));
}

/* Device copies of a layer's payloads and residual (ZC_CUDA_DEVICE). */
struct device_layer {
	zc_cuda_block blocks[TEST_LAYER_MAX_BLOCKS];
	void *buffers[2 * TEST_LAYER_MAX_BLOCKS + 2];
	size_t n_buffers;
	zc_cuda_layer layer;
};

static void *device_copy(struct device_layer *d, const void *host, size_t bytes)
{
	void *device = NULL;
	CUDA_OK(cudaMalloc(&device, bytes ? bytes : 1));
	if (bytes)
		CUDA_OK(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
	d->buffers[d->n_buffers++] = device;
	return device;
}

static void device_layer_init(struct device_layer *d, const struct test_layer *layer)
{
	const zc_cuda_layer *l = &layer->layer;
	memset(d, 0, sizeof *d);
	d->layer = *l;
	for (size_t i = 0; i < l->n_blocks; i++) {
		d->blocks[i] = l->blocks[i];
		d->blocks[i].keys = device_copy(d, l->blocks[i].keys, l->blocks[i].key_bytes);
		d->blocks[i].values = device_copy(d, l->blocks[i].values, l->blocks[i].value_bytes);
	}
	size_t heads = (size_t)layer->batch * layer->heads;
	size_t kb = heads * (layer->residual_capacity + 1) * layer->head_dim_k * 2;
	size_t vb = heads * (layer->residual_capacity + 1) * layer->head_dim_v * 2;
	d->layer.residual_keys = device_copy(d, layer->residual_k, kb);
	d->layer.residual_values = device_copy(d, layer->residual_v, vb);
	d->layer.blocks = d->blocks;
	d->layer.memory = ZC_CUDA_DEVICE;
}

static void device_layer_free(struct device_layer *d)
{
	for (size_t i = 0; i < d->n_buffers; i++)
		cudaFree(d->buffers[i]);
}

/* Every config of the codec tests, from host memory through 64 KiB chunks
 * (heads split between chunks) and the default ones, and from device
 * memory; some targets start one element past an aligned address, so the
 * unaligned store path runs too. */
START_TEST(test_bit_identity)
{
	zc_cuda *small = open_context(64u << 10);
	zc_cuda *normal = open_context(0);
	int step = quick() ? 7 : 1;
	for (int i = 0; i < test_case_config_count(); i += step) {
		struct test_case_config c;
		struct test_layer layer;
		struct device_target t;
		struct device_layer d;

		test_case_config_get(i, &c);
		build_case(&layer, &c, i);
		zc_cuda_layer *l = test_layer_state(&layer, layer.n_blocks, c.residual);
		target_init(&t, &layer, layer.tokens + 2, c.token_pad, c.head_pad, i % 6 == 5 ? 1 : 0);
		load(i % 2 ? small : normal, l, &t.target, NULL, "host", i);
		assert_target(&t, &layer, "host", i);
		target_free(&t);

		device_layer_init(&d, &layer);
		target_init(&t, &layer, layer.tokens, c.token_pad, c.head_pad, i % 6 == 2 ? 1 : 0);
		load(normal, &d.layer, &t.target, NULL, "device", i);
		assert_target(&t, &layer, "device", i);
		target_free(&t);
		device_layer_free(&d);
		test_layer_free(&layer);
	}
	zc_cuda_close(small);
	zc_cuda_close(normal);
}
END_TEST

/* Prefill-sized blocks (4096 tokens, D = 128, the default config) from a
 * registered host range: the DMA reads them in place; the result is the
 * bounce buffer's. */
START_TEST(test_registered_host)
{
	zc_codec_config config;
	struct test_layer layer;
	struct device_target t;
	static const uint32_t tokens[] = { 4096, 4096, 1000 };
	zc_codec_config_default(&config);
	ck_assert_int_eq(test_layer_build(&layer, &config, 1, 8, 128, 128, tokens, 3, 37, 77), 0);
	zc_cuda_layer *l = test_layer_state(&layer, 3, 37);
	zc_cuda *cuda = open_context(1u << 20);
	int registered = 0;
	for (size_t i = 0; i < layer.n_blocks; i++) {
		int rk = zc_cuda_register_host(cuda, layer.blocks[i].keys, layer.blocks[i].key_bytes);
		int rv = zc_cuda_register_host(cuda, layer.blocks[i].values,
					       layer.blocks[i].value_bytes);
		REQUIRE(rk == 0 && rv == 0, "register: %s", zc_cuda_last_error(cuda));
		registered += 2;
	}
	target_init(&t, &layer, layer.tokens, 0, 0, 0);
	load(cuda, l, &t.target, NULL, "registered", 0);
	assert_target(&t, &layer, "registered", 0);
	zc_cuda_stats stats;
	zc_cuda_get_stats(cuda, &stats);
	REQUIRE(stats.bytes_direct > 0, "nothing went straight from registered memory");
	REQUIRE(stats.bytes_staged > 0, "the residual should have been staged");
	for (size_t i = 0; i < layer.n_blocks; i++) {
		ck_assert_int_eq(zc_cuda_unregister_host(cuda, layer.blocks[i].keys), 0);
		ck_assert_int_eq(zc_cuda_unregister_host(cuda, layer.blocks[i].values), 0);
	}
	ck_assert_int_eq(zc_cuda_unregister_host(cuda, layer.blocks[0].keys), -ENOENT);
	/* Unregistered now: the same bytes through the bounce buffer. */
	target_free(&t);
	target_init(&t, &layer, layer.tokens, 0, 0, 0);
	load(cuda, l, &t.target, NULL, "bounced", 0);
	assert_target(&t, &layer, "bounced", 0);
	target_free(&t);
	zc_cuda_close(cuda);
	test_layer_free(&layer);
	(void)registered;
}
END_TEST

/* A layer growing as the daemon grows it; after each step the mirrored
 * target equals the CPU codec on the layer's tokens, and the context's
 * counters say only new blocks and rows moved. */
START_TEST(test_incremental)
{
	zc_cuda *cuda = open_context(0);
	int step = quick() ? 35 : 5;
	for (int i = 0; i < test_case_config_count(); i += step) {
		struct test_case_config c;
		struct test_layer layer;
		struct device_target inc, full;
		zc_cuda_mirror *mirror = NULL;

		test_case_config_get(i, &c);
		c.n_blocks = 3;
		c.block_tokens[0] = 128;
		c.block_tokens[1] = 33;
		c.block_tokens[2] = 128;
		c.residual = 40;
		build_case(&layer, &c, i);
		target_init(&inc, &layer, layer.tokens, c.token_pad, c.head_pad, 0);
		ck_assert_int_eq(zc_cuda_mirror_new(&mirror), 0);
		static const uint32_t steps[][2] = { { 0, 1 }, { 0, 2 }, { 1, 0 }, { 1, 1 },
						     { 1, 30 }, { 2, 3 }, { 2, 4 }, { 3, 40 } };
		for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
			zc_cuda_stats before, after;
			zc_cuda_layer *l = test_layer_state(&layer, steps[s][0], steps[s][1]);
			zc_cuda_get_stats(cuda, &before);
			load(cuda, l, &inc.target, mirror, "incremental", i);
			zc_cuda_get_stats(cuda, &after);
			uint64_t new_blocks = s == 0 ? steps[s][0] : steps[s][0] - steps[s - 1][0];
			REQUIRE(after.blocks - before.blocks == new_blocks,
				"case %d step %zu: %llu blocks moved, %llu new", i, s,
				(unsigned long long)(after.blocks - before.blocks),
				(unsigned long long)new_blocks);
			target_init(&full, &layer, layer.tokens, c.token_pad, c.head_pad, 0);
			load(cuda, l, &full.target, NULL, "full", i);
			assert_target(&full, &layer, "full", i);
			target_fetch(&inc);
			uint32_t end = l->residual_first + l->residual_tokens;
			for (uint32_t b = 0; b < layer.batch; b++)
				for (uint32_t h = 0; h < layer.heads; h++)
					for (uint32_t tok = 0; tok < end; tok++) {
						size_t ko = b * inc.shape.key_strides.batch +
							    h * inc.shape.key_strides.head +
							    tok * inc.shape.key_strides.token;
						size_t vo = b * inc.shape.value_strides.batch +
							    h * inc.shape.value_strides.head +
							    tok * inc.shape.value_strides.token;
						REQUIRE(memcmp(inc.host_keys + ko, full.host_keys + ko,
							       layer.head_dim_k * 2) == 0 &&
							memcmp(inc.host_values + vo, full.host_values + vo,
							       layer.head_dim_v * 2) == 0,
							"case %d step %zu: incremental differs at (%u, %u, %u)",
							i, s, b, h, tok);
					}
			target_free(&full);
		}
		zc_cuda_mirror_free(mirror);
		target_free(&inc);
		test_layer_free(&layer);
	}
	zc_cuda_close(cuda);
}
END_TEST

/* A device payload whose mask has one salient token too many: the load is
 * queued (the host cannot see the mask), synchronize says ZC_ECORRUPT, the
 * corrupt head is not written, the context works afterwards. */
START_TEST(test_corrupt_device_payload)
{
	zc_codec_config config;
	struct test_layer layer;
	struct device_target t;
	struct device_layer d;
	static const uint32_t tokens[] = { 100 };
	zc_codec_config_default(&config);
	ck_assert_int_eq(test_layer_build(&layer, &config, 1, 2, 64, 64, tokens, 1, 0, 5), 0);
	zc_cuda_layer *l = test_layer_state(&layer, 1, 0);
	zc_block_layout k;
	zc_block_shape shape = { 1, 2, 100, 64 };
	ck_assert_int_eq(zc_block_layout_compute(&config, ZC_TENSOR_KEYS, &shape, &k), 0);
	uint8_t *bad = malloc(layer.blocks[0].key_bytes);
	memcpy(bad, layer.blocks[0].keys, layer.blocks[0].key_bytes);
	/* Head 1's first clear mask bit set. */
	uint8_t *mask = bad + k.head_bytes + k.mask_offset;
	size_t byte = 0;
	while (mask[byte] == 0xff)
		byte++;
	uint8_t clear = (uint8_t)~mask[byte];
	mask[byte] |= (uint8_t)(clear & (uint8_t)-clear);
	device_layer_init(&d, &layer);
	CUDA_OK(cudaMemcpy((void *)d.blocks[0].keys, bad, layer.blocks[0].key_bytes,
			   cudaMemcpyHostToDevice));
	zc_cuda *cuda = open_context(0);
	target_init(&t, &layer, 100, 0, 0, 0);
	ck_assert_int_eq(zc_cuda_load_layer(cuda, &d.layer, &t.target, NULL, NULL), 0);
	ck_assert_int_eq(zc_cuda_synchronize(cuda, NULL), ZC_ECORRUPT);
	target_fetch(&t);
	for (size_t i = 0; i < 100 * 64; i++)
		REQUIRE(t.host_keys[t.shape.key_strides.head + i] == TEST_SENTINEL,
			"the corrupt head was written at %zu", i);
	/* Head 0 and the values are right. */
	ck_assert_int_eq(test_expected(&layer, &t.shape, t.expected_keys, t.expected_values), 0);
	ck_assert_int_eq(memcmp(t.host_keys, t.expected_keys, 100 * 64 * 2), 0);
	ck_assert_int_eq(memcmp(t.host_values, t.expected_values, t.shape.value_elements * 2), 0);
	/* The same payload from the host is refused before anything moves. */
	zc_cuda_block host_block = layer.blocks[0];
	host_block.keys = bad;
	zc_cuda_layer host_layer = *l;
	host_layer.blocks = &host_block;
	ck_assert_int_eq(zc_cuda_load_layer(cuda, &host_layer, &t.target, NULL, NULL), ZC_ECORRUPT);
	ck_assert_int_eq(zc_cuda_synchronize(cuda, NULL), 0);
	target_free(&t);
	target_init(&t, &layer, 100, 0, 0, 0);
	load(cuda, l, &t.target, NULL, "after corrupt", 0);
	assert_target(&t, &layer, "after corrupt", 0);
	target_free(&t);
	device_layer_free(&d);
	zc_cuda_close(cuda);
	free(bad);
	test_layer_free(&layer);
}
END_TEST

static int probe(bool require)
{
	int count = zc_cuda_device_count();
	if (count > 0) {
		printf("gpu: %d CUDA device(s) here; `make check-gpu` runs the GPU suites\n", count);
		return 0;
	}
	const char *why = "no CUDA device";
	if (count < 0) {
		int driver = 0;
		cudaError_t error = cudaDriverGetVersion(&driver);
		why = error == cudaSuccess && driver == 0 ? "no NVIDIA driver" : "the CUDA driver failed";
	}
	printf("gpu: skipped: %s here; `make check-gpu` runs the GPU suites on a machine with a GPU\n",
	       why);
	return require ? 1 : 0;
}

int main(int argc, char **argv)
{
	bool want_probe = false, require = false;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--probe") == 0)
			want_probe = true;
		else if (strcmp(argv[i], "--require") == 0)
			require = true;
	}
	if (want_probe)
		return probe(require);
	if (zc_cuda_device_count() <= 0)
		return probe(true);
	const struct test_case cases[] = {
		{ "reconstruct", { test_bit_identity, test_registered_host, NULL } },
		{ "incremental", { test_incremental, NULL } },
		{ "errors", { test_corrupt_device_payload, NULL } },
	};
	Suite *suite = suite_create("cuda");
	suite_add_cases(suite, cases, sizeof cases / sizeof cases[0], 600);
	/* No fork: CUDA, initialised by the probe above, does not survive one. */
	return suite_main(suite, CK_NOFORK);
}
