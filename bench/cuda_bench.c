/*
 * One session's K/V back onto a GPU: fp16 against compressed blocks
 * reconstructed there (libzipcache_cuda). JSON lines on stdout.
 *
 *   build/bench/cuda_bench [--layers 32] [--tokens 32768] [--heads 8] [--dim 128]
 *                          [--block-tokens 4096] [--repeat 5] [--decode-steps 64]
 *                          [--kernels-only 1]
 *
 * The session: `layers` layers of `tokens` tokens, batch 1, compressed on
 * the host by the codec at the default config in blocks of block-tokens
 * (chunked prefill), laid out as the store lays it out: per layer a K arena
 * and a V arena of back-to-back payloads, in one shared file mapping the
 * reader sees read-only (as a client sees its session). Paths, each timed
 * from the first byte queued until the stream is done, median of repeat:
 *   fp16_pageable   fp16 K/V from pageable memory (what a worker does today)
 *   fp16_pinned     fp16 K/V from pinned memory
 *   zc_bounce       compressed blocks through the pinned bounce buffers
 *   zc_registered   compressed blocks DMA'd from the registered (read-only) mapping
 *   zc_kernels      compressed blocks already in device memory: the kernels
 *                   alone, fp16 bytes written per second
 *   decode_step     one new exact token per layer, incremental (a mirror per layer)
 * and for scale: a device-to-device copy of the fp16 bytes, and the cost
 * of registering the mapping once. --kernels-only 1 skips the host-memory
 * paths (seconds each): for comparing kernel builds within one lease.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "synthetic_kv.h"
#include "zipcache/codec.h"
#include "zipcache/cuda.h"

#define CHECK_CUDA(call) \
	do { \
		cudaError_t e_ = (call); \
		if (e_ != cudaSuccess) { \
			fprintf(stderr, "cuda_bench: %s: %s\n", #call, cudaGetErrorString(e_)); \
			exit(1); \
		} \
	} while (0)
#define CHECK_ZC(cuda, call) \
	do { \
		int rc_ = (call); \
		if (rc_ < 0) { \
			fprintf(stderr, "cuda_bench: %s: %s (%s)\n", #call, zc_strerror(rc_), \
				zc_cuda_last_error(cuda)); \
			exit(1); \
		} \
	} while (0)

struct options {
	uint32_t layers, tokens, heads, dim, block_tokens, repeat, decode_steps, kernels_only;
};

struct bench_layer {
	uint16_t *fp16_k, *fp16_v;          /* pageable [1][H][S][D] */
	uint16_t *pinned_k, *pinned_v;
	size_t key_offset, value_offset;    /* arenas in the mapping */
	size_t key_bytes, value_bytes;      /* arena bytes used */
	size_t residual_offset;             /* K then V residual, [1][H][128][D] each */
	zc_cuda_block *blocks;
	uint32_t n_blocks;
	zc_cuda_mirror *mirror;
	uint16_t *device_k, *device_v;      /* targets [1][H][S + decode][D] */
	void *device_arena;                 /* for zc_kernels */
};

static struct options opt = { 32, 32768, 8, 128, 4096, 5, 64, 0 };
static zc_codec_config config;
static struct bench_layer *layers;
static uint8_t *mapping_rw;
static const uint8_t *mapping_ro;
static size_t mapping_bytes;
static size_t arena_room;           /* per tensor and layer */
static const uint32_t residual_capacity = 128;

static double now_seconds(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int compare_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, uint32_t n)
{
	qsort(v, n, sizeof *v, compare_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static size_t head_elements(void)
{
	return (size_t)opt.tokens * opt.dim;
}

static size_t layer_fp16_bytes(void)
{
	return 2 * (size_t)opt.heads * head_elements() * 2; /* K and V */
}

/* Fills and compresses layers [first, first + count) (one thread's share). */
struct prepare_job {
	uint32_t first, count;
};

static void *prepare_layers(void *arg)
{
	struct prepare_job *job = arg;
	size_t block_elements = (size_t)opt.heads * opt.block_tokens * opt.dim;
	uint16_t *block = malloc(block_elements * 2);
	for (uint32_t l = job->first; l < job->first + job->count; l++) {
		struct bench_layer *layer = &layers[l];
		synthetic_kv_fill(layer->fp16_k, opt.heads, opt.tokens, opt.dim, true, 1000 + l);
		synthetic_kv_fill(layer->fp16_v, opt.heads, opt.tokens, opt.dim, false, 2000 + l);
		size_t kused = 0, vused = 0;
		for (uint32_t b = 0; b < layer->n_blocks; b++) {
			uint32_t first = b * opt.block_tokens;
			uint32_t s = opt.tokens - first < opt.block_tokens ? opt.tokens - first :
									    opt.block_tokens;
			zc_block_shape shape = { 1, opt.heads, s, opt.dim };
			for (int tensor = 0; tensor < 2; tensor++) {
				const uint16_t *src = tensor ? layer->fp16_v : layer->fp16_k;
				for (uint32_t h = 0; h < opt.heads; h++)
					memcpy(block + (size_t)h * s * opt.dim,
					       src + h * head_elements() + (size_t)first * opt.dim,
					       (size_t)s * opt.dim * 2);
				size_t offset = tensor ? layer->value_offset + vused :
							 layer->key_offset + kused;
				int64_t n = zc_block_compress(&config, tensor ? ZC_TENSOR_VALUES :
									       ZC_TENSOR_KEYS,
							      &shape, block, mapping_rw + offset,
							      arena_room - (tensor ? vused : kused));
				if (n < 0) {
					fprintf(stderr, "cuda_bench: compress: %s\n", zc_strerror((int)n));
					exit(1);
				}
				zc_cuda_block *cb = &layer->blocks[b];
				if (tensor) {
					cb->values = mapping_ro + offset;
					cb->value_bytes = (size_t)n;
					vused += (size_t)n;
				} else {
					cb->keys = mapping_ro + offset;
					cb->key_bytes = (size_t)n;
					kused += (size_t)n;
				}
				cb->first_token = first;
				cb->tokens = cb->valid_tokens = s;
			}
		}
		layer->key_bytes = kused;
		layer->value_bytes = vused;
		memcpy(layer->pinned_k, layer->fp16_k, (size_t)opt.heads * head_elements() * 2);
		memcpy(layer->pinned_v, layer->fp16_v, (size_t)opt.heads * head_elements() * 2);
	}
	free(block);
	return NULL;
}

static zc_cuda_layer layer_desc(const struct bench_layer *layer, zc_cuda_memory memory,
				const zc_cuda_block *blocks, uint32_t residual_rows)
{
	zc_cuda_layer d;
	memset(&d, 0, sizeof d);
	d.config = config;
	d.batch = 1;
	d.heads = opt.heads;
	d.head_dim_k = d.head_dim_v = opt.dim;
	d.blocks = blocks;
	d.n_blocks = layer->n_blocks;
	d.memory = memory;
	size_t rh = (size_t)residual_capacity * opt.dim;
	d.residual_keys = (const uint16_t *)(mapping_ro + layer->residual_offset);
	d.residual_values = d.residual_keys + rh * opt.heads;
	d.residual_key_strides = (zc_strides){ rh * opt.heads, rh, opt.dim };
	d.residual_value_strides = d.residual_key_strides;
	d.residual_first = opt.tokens;
	d.residual_tokens = residual_rows;
	return d;
}

static zc_cuda_target layer_target(const struct bench_layer *layer)
{
	size_t head = (size_t)(opt.tokens + opt.decode_steps) * opt.dim;
	zc_strides s = { head * opt.heads, head, opt.dim };
	return (zc_cuda_target){ layer->device_k, layer->device_v, s, s,
				 opt.tokens + opt.decode_steps };
}

static void print_path(const char *path, double seconds, double bytes_moved, const char *extra)
{
	double fp16 = (double)layer_fp16_bytes() * opt.layers;
	printf("{\"bench\":\"cuda\",\"path\":\"%s\",\"layers\":%u,\"tokens\":%u,\"kv_heads\":%u,"
	       "\"head_dim\":%u,\"ms\":%.3f,\"bytes_moved\":%.0f,\"moved_gb_per_s\":%.2f,"
	       "\"fp16_bytes\":%.0f,\"fp16_gb_per_s\":%.2f%s}\n",
	       path, opt.layers, opt.tokens, opt.heads, opt.dim, seconds * 1e3, bytes_moved,
	       bytes_moved / seconds / 1e9, fp16, fp16 / seconds / 1e9, extra);
	fflush(stdout);
}

static double time_fp16(bool pinned, cudaStream_t stream)
{
	double times[64];
	size_t tensor = (size_t)opt.heads * head_elements() * 2;
	for (uint32_t r = 0; r < opt.repeat; r++) {
		CHECK_CUDA(cudaDeviceSynchronize());
		double t0 = now_seconds();
		for (uint32_t l = 0; l < opt.layers; l++) {
			struct bench_layer *layer = &layers[l];
			/* The target's rows are strided (room for decode), so a 2D copy. */
			size_t pitch = (size_t)(opt.tokens + opt.decode_steps) * opt.dim * 2;
			CHECK_CUDA(cudaMemcpy2DAsync(layer->device_k, pitch,
						     pinned ? layer->pinned_k : layer->fp16_k,
						     head_elements() * 2, head_elements() * 2,
						     opt.heads, cudaMemcpyHostToDevice, stream));
			CHECK_CUDA(cudaMemcpy2DAsync(layer->device_v, pitch,
						     pinned ? layer->pinned_v : layer->fp16_v,
						     head_elements() * 2, head_elements() * 2,
						     opt.heads, cudaMemcpyHostToDevice, stream));
		}
		CHECK_CUDA(cudaStreamSynchronize(stream));
		times[r] = now_seconds() - t0;
	}
	(void)tensor;
	return median(times, opt.repeat);
}

static double time_compressed(zc_cuda *cuda, zc_cuda_memory memory, cudaStream_t stream,
			      double *kernel_seconds)
{
	double times[64], kernels[64];
	cudaEvent_t start, stop;
	CHECK_CUDA(cudaEventCreate(&start));
	CHECK_CUDA(cudaEventCreate(&stop));
	zc_cuda_block *device_blocks = NULL;
	if (memory == ZC_CUDA_DEVICE) {
		device_blocks = calloc((size_t)opt.layers * layers[0].n_blocks, sizeof *device_blocks);
		for (uint32_t l = 0; l < opt.layers; l++)
			for (uint32_t b = 0; b < layers[l].n_blocks; b++) {
				zc_cuda_block *d = &device_blocks[(size_t)l * layers[0].n_blocks + b];
				*d = layers[l].blocks[b];
				d->keys = (uint8_t *)layers[l].device_arena +
					  ((const uint8_t *)d->keys - mapping_ro - layers[l].key_offset);
				d->values = (uint8_t *)layers[l].device_arena + arena_room +
					    ((const uint8_t *)d->values - mapping_ro -
					     layers[l].value_offset);
			}
	}
	for (uint32_t r = 0; r < opt.repeat; r++) {
		CHECK_CUDA(cudaDeviceSynchronize());
		double t0 = now_seconds();
		CHECK_CUDA(cudaEventRecord(start, stream));
		for (uint32_t l = 0; l < opt.layers; l++) {
			const zc_cuda_block *blocks = device_blocks ?
				device_blocks + (size_t)l * layers[0].n_blocks : layers[l].blocks;
			zc_cuda_layer d = layer_desc(&layers[l], memory, blocks, 0);
			zc_cuda_target t = layer_target(&layers[l]);
			CHECK_ZC(cuda, zc_cuda_load_layer(cuda, &d, &t, NULL, stream));
		}
		CHECK_CUDA(cudaEventRecord(stop, stream));
		CHECK_ZC(cuda, zc_cuda_synchronize(cuda, stream));
		times[r] = now_seconds() - t0;
		float ms = 0;
		CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
		kernels[r] = ms * 1e-3;
	}
	free(device_blocks);
	cudaEventDestroy(start);
	cudaEventDestroy(stop);
	if (kernel_seconds)
		*kernel_seconds = median(kernels, opt.repeat);
	return median(times, opt.repeat);
}

/* Layer 0 back from the GPU equals the CPU codec's reconstruction. */
static void verify_layer0(void)
{
	struct bench_layer *layer = &layers[0];
	size_t head = (size_t)(opt.tokens + opt.decode_steps) * opt.dim;
	size_t n = head * opt.heads;
	uint16_t *got = malloc(n * 2), *want = malloc(n * 2);
	CHECK_CUDA(cudaMemcpy(got, layer->device_k, n * 2, cudaMemcpyDeviceToHost));
	zc_strides s = { n, head, opt.dim };
	for (uint32_t b = 0; b < layer->n_blocks; b++) {
		zc_cuda_block *cb = &layer->blocks[b];
		zc_block_shape shape = { 1, opt.heads, cb->tokens, opt.dim };
		int rc = zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape, cb->keys, cb->key_bytes,
					      want + (size_t)cb->first_token * opt.dim, &s);
		if (rc < 0) {
			fprintf(stderr, "cuda_bench: reconstruct: %s\n", zc_strerror(rc));
			exit(1);
		}
	}
	for (uint32_t h = 0; h < opt.heads; h++)
		if (memcmp(got + h * head, want + h * head, head_elements() * 2) != 0) {
			fprintf(stderr, "cuda_bench: layer 0 head %u differs from the CPU codec\n", h);
			exit(1);
		}
	free(got);
	free(want);
}

static void bench_decode(zc_cuda *cuda, cudaStream_t stream)
{
	/* A full load through each layer's mirror first, as at the start of a turn. */
	for (uint32_t l = 0; l < opt.layers; l++) {
		zc_cuda_layer d = layer_desc(&layers[l], ZC_CUDA_HOST, layers[l].blocks, 0);
		zc_cuda_target t = layer_target(&layers[l]);
		CHECK_ZC(cuda, zc_cuda_mirror_new(&layers[l].mirror));
		CHECK_ZC(cuda, zc_cuda_load_layer(cuda, &d, &t, layers[l].mirror, stream));
	}
	CHECK_ZC(cuda, zc_cuda_synchronize(cuda, stream));
	uint16_t row[4096];
	double per_step[1024], per_layer_sync[1024];
	uint32_t steps = opt.decode_steps < residual_capacity ? opt.decode_steps : residual_capacity;
	for (uint32_t step = 0; step < steps; step++) {
		/* The daemon's side: one new token per layer appended to the residual. */
		for (uint32_t l = 0; l < opt.layers; l++) {
			size_t rh = (size_t)residual_capacity * opt.dim;
			uint16_t *rk = (uint16_t *)(mapping_rw + layers[l].residual_offset);
			for (uint32_t h = 0; h < opt.heads; h++) {
				synthetic_kv_fill(row, 1, 1, opt.dim, true, 5000 + step * 64 + h);
				memcpy(rk + h * rh + (size_t)step * opt.dim, row, opt.dim * 2);
				memcpy(rk + rh * opt.heads + h * rh + (size_t)step * opt.dim, row,
				       opt.dim * 2);
			}
		}
		double t0 = now_seconds();
		for (uint32_t l = 0; l < opt.layers; l++) {
			zc_cuda_layer d = layer_desc(&layers[l], ZC_CUDA_HOST, layers[l].blocks, step + 1);
			zc_cuda_target t = layer_target(&layers[l]);
			CHECK_ZC(cuda, zc_cuda_load_layer(cuda, &d, &t, layers[l].mirror, stream));
		}
		CHECK_CUDA(cudaStreamSynchronize(stream));
		per_step[step] = (now_seconds() - t0) / opt.layers;
		/* The same, but waiting for each layer (the latency of one). */
		if (step + 1 < steps) {
			per_layer_sync[step] = 0;
		}
	}
	zc_cuda_stats stats;
	zc_cuda_get_stats(cuda, &stats);
	/* Latency of one layer alone: a 1-row load and its completion. */
	double lone[256];
	uint32_t lone_n = opt.layers < 256 ? opt.layers : 256;
	for (uint32_t l = 0; l < lone_n; l++) {
		zc_cuda_mirror_trim(layers[l].mirror, opt.tokens + steps - 1);
		zc_cuda_layer d = layer_desc(&layers[l], ZC_CUDA_HOST, layers[l].blocks, steps);
		zc_cuda_target t = layer_target(&layers[l]);
		double t0 = now_seconds();
		CHECK_ZC(cuda, zc_cuda_load_layer(cuda, &d, &t, layers[l].mirror, stream));
		CHECK_CUDA(cudaStreamSynchronize(stream));
		lone[l] = now_seconds() - t0;
	}
	printf("{\"bench\":\"cuda\",\"path\":\"decode_step\",\"layers\":%u,\"new_tokens_per_layer\":1,"
	       "\"steps\":%u,\"us_per_layer_pipelined\":%.2f,\"us_per_layer_synchronous\":%.2f,"
	       "\"blocks_skipped\":%llu,\"residual_rows\":%llu}\n",
	       opt.layers, steps, median(per_step, steps) * 1e6, median(lone, lone_n) * 1e6,
	       (unsigned long long)stats.blocks_skipped, (unsigned long long)stats.residual_rows);
	(void)per_layer_sync;
}

static void parse(int argc, char **argv)
{
	for (int i = 1; i + 1 < argc; i += 2) {
		uint32_t v = (uint32_t)strtoul(argv[i + 1], NULL, 10);
		if (!strcmp(argv[i], "--layers")) opt.layers = v;
		else if (!strcmp(argv[i], "--tokens")) opt.tokens = v;
		else if (!strcmp(argv[i], "--heads")) opt.heads = v;
		else if (!strcmp(argv[i], "--dim")) opt.dim = v;
		else if (!strcmp(argv[i], "--block-tokens")) opt.block_tokens = v;
		else if (!strcmp(argv[i], "--repeat")) opt.repeat = v;
		else if (!strcmp(argv[i], "--decode-steps")) opt.decode_steps = v;
		else if (!strcmp(argv[i], "--kernels-only")) opt.kernels_only = v;
		else {
			fprintf(stderr, "usage: cuda_bench [--layers N] [--tokens N] [--heads N] "
					"[--dim N] [--block-tokens N] [--repeat N] [--decode-steps N] "
					"[--kernels-only 0|1]\n");
			exit(2);
		}
	}
	if (opt.repeat < 1 || opt.repeat > 64)
		opt.repeat = 5;
	if (opt.dim > 4096 || opt.decode_steps > 1024)
		exit(2);
}

int main(int argc, char **argv)
{
	parse(argc, argv);
	if (zc_cuda_device_count() <= 0) {
		printf("{\"bench\":\"cuda\",\"skipped\":\"no CUDA device\"}\n");
		return 0;
	}
	zc_codec_config_default(&config);
	struct cudaDeviceProp prop;
	CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
	zc_block_layout lk;
	zc_block_shape shape = { 1, opt.heads, opt.block_tokens, opt.dim };
	zc_block_layout_compute(&config, ZC_TENSOR_VALUES, &shape, &lk);
	uint32_t n_blocks = (opt.tokens + opt.block_tokens - 1) / opt.block_tokens;
	arena_room = (lk.total_bytes + 4096) * n_blocks;
	size_t residual_bytes = 2 * (size_t)opt.heads * residual_capacity * opt.dim * 2;
	size_t per_layer = 2 * arena_room + residual_bytes;
	mapping_bytes = per_layer * opt.layers;
	int fd = memfd_create("cuda_bench", 0);
	if (fd < 0 || ftruncate(fd, (off_t)mapping_bytes) < 0) {
		perror("cuda_bench: memfd");
		return 1;
	}
	mapping_rw = mmap(NULL, mapping_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	mapping_ro = mmap(NULL, mapping_bytes, PROT_READ, MAP_SHARED, fd, 0);
	if (mapping_rw == MAP_FAILED || mapping_ro == MAP_FAILED) {
		perror("cuda_bench: mmap");
		return 1;
	}
	layers = calloc(opt.layers, sizeof *layers);
	size_t tensor = (size_t)opt.heads * head_elements() * 2;
	size_t target = (size_t)opt.heads * (opt.tokens + opt.decode_steps) * opt.dim * 2;
	for (uint32_t l = 0; l < opt.layers; l++) {
		struct bench_layer *layer = &layers[l];
		layer->fp16_k = malloc(tensor);
		layer->fp16_v = malloc(tensor);
		CHECK_CUDA(cudaHostAlloc((void **)&layer->pinned_k, tensor, cudaHostAllocDefault));
		CHECK_CUDA(cudaHostAlloc((void **)&layer->pinned_v, tensor, cudaHostAllocDefault));
		CHECK_CUDA(cudaMalloc((void **)&layer->device_k, target));
		CHECK_CUDA(cudaMalloc((void **)&layer->device_v, target));
		layer->key_offset = l * per_layer;
		layer->value_offset = layer->key_offset + arena_room;
		layer->residual_offset = layer->value_offset + arena_room;
		layer->n_blocks = n_blocks;
		layer->blocks = calloc(n_blocks, sizeof *layer->blocks);
	}
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	uint32_t threads = cpus > 1 ? (uint32_t)cpus : 1;
	if (threads > opt.layers)
		threads = opt.layers;
	pthread_t tid[256];
	struct prepare_job jobs[256];
	double t0 = now_seconds();
	for (uint32_t i = 0; i < threads && i < 256; i++) {
		jobs[i].first = opt.layers * i / threads;
		jobs[i].count = opt.layers * (i + 1) / threads - jobs[i].first;
		pthread_create(&tid[i], NULL, prepare_layers, &jobs[i]);
	}
	for (uint32_t i = 0; i < threads && i < 256; i++)
		pthread_join(tid[i], NULL);
	double compressed = 0;
	for (uint32_t l = 0; l < opt.layers; l++)
		compressed += (double)(layers[l].key_bytes + layers[l].value_bytes);
	printf("{\"bench\":\"cuda\",\"setup\":\"session\",\"device\":\"%s\",\"layers\":%u,"
	       "\"tokens\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"block_tokens\":%u,"
	       "\"codec\":\"hi %d lo %d fraction %.2f group %d\",\"fp16_bytes\":%.0f,"
	       "\"compressed_bytes\":%.0f,\"ratio\":%.3f,\"prepare_s\":%.2f,\"isa\":\"%s\"}\n",
	       prop.name, opt.layers, opt.tokens, opt.heads, opt.dim, opt.block_tokens,
	       config.hi_bits, config.lo_bits, config.hi_fraction, config.group_size,
	       (double)layer_fp16_bytes() * opt.layers, compressed,
	       (double)layer_fp16_bytes() * opt.layers / compressed, now_seconds() - t0,
	       zc_isa_name(zc_codec_isa()));
	fflush(stdout);

	cudaStream_t stream;
	CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	zc_cuda *cuda = NULL;
	CHECK_ZC(cuda, zc_cuda_open(0, 0, &cuda));
	double fp16 = (double)layer_fp16_bytes() * opt.layers;

	double pageable = 0, pinned = 0;
	char extra[256];
	if (opt.kernels_only)
		goto kernels;
	pageable = time_fp16(false, stream);
	print_path("fp16_pageable", pageable, fp16, "");
	pinned = time_fp16(true, stream);
	print_path("fp16_pinned", pinned, fp16, "");
	double flat[2];
	for (int p = 0; p < 2; p++) {
		void *scratch;
		CHECK_CUDA(cudaMalloc(&scratch, 2 * (size_t)opt.heads * head_elements() * 2));
		double times[64];
		for (uint32_t r = 0; r < opt.repeat; r++) {
			CHECK_CUDA(cudaDeviceSynchronize());
			double start = now_seconds();
			for (uint32_t l = 0; l < opt.layers; l++) {
				size_t n = (size_t)opt.heads * head_elements() * 2;
				CHECK_CUDA(cudaMemcpyAsync(scratch, p ? layers[l].pinned_k : layers[l].fp16_k, n,
							   cudaMemcpyHostToDevice, stream));
				CHECK_CUDA(cudaMemcpyAsync((uint8_t *)scratch + n,
							   p ? layers[l].pinned_v : layers[l].fp16_v, n,
							   cudaMemcpyHostToDevice, stream));
			}
			CHECK_CUDA(cudaStreamSynchronize(stream));
			times[r] = now_seconds() - start;
		}
		flat[p] = median(times, opt.repeat);
		cudaFree(scratch);
	}
	print_path("fp16_pageable_contiguous", flat[0], fp16, "");
	print_path("fp16_pinned_contiguous", flat[1], fp16, "");

	double bounce = time_compressed(cuda, ZC_CUDA_HOST, stream, NULL);
	verify_layer0();
	snprintf(extra, sizeof extra, ",\"vs_pinned\":%.2f,\"vs_pageable\":%.2f,\"verified\":true",
		 pinned / bounce, pageable / bounce);
	print_path("zc_bounce", bounce, compressed, extra);

	/* Registered: the mapping page-locked in place, at three chunk sizes
	 * (a context each; a range is registered by one context at a time). */
	static const size_t chunk_mb[] = { 4, 16, 64 };
	for (size_t c = 0; c < sizeof chunk_mb / sizeof chunk_mb[0]; c++) {
		zc_cuda *reg = NULL;
		CHECK_ZC(reg, zc_cuda_open(0, chunk_mb[c] << 20, &reg));
		double r0 = now_seconds();
		int registered = zc_cuda_register_host(reg, mapping_ro, mapping_bytes);
		double register_seconds = now_seconds() - r0;
		if (registered != 0) {
			printf("{\"bench\":\"cuda\",\"path\":\"zc_registered\",\"error\":\"%s\"}\n",
			       zc_cuda_last_error(reg));
			zc_cuda_close(reg);
			break;
		}
		double direct = time_compressed(reg, ZC_CUDA_HOST, stream, NULL);
		CHECK_CUDA(cudaMemset(layers[0].device_k, 0, target));
		(void)time_compressed(reg, ZC_CUDA_HOST, stream, NULL);
		verify_layer0();
		snprintf(extra, sizeof extra,
			 ",\"chunk_mb\":%zu,\"vs_pinned\":%.2f,\"vs_pageable\":%.2f,\"register_ms\":%.1f,"
			 "\"verified\":true",
			 chunk_mb[c], pinned / direct, pageable / direct, register_seconds * 1e3);
		print_path("zc_registered", direct, compressed, extra);
		CHECK_ZC(reg, zc_cuda_unregister_host(reg, mapping_ro));
		zc_cuda_close(reg);
	}

kernels:
	/* Kernels alone: the compressed arenas already on the device. */
	for (uint32_t l = 0; l < opt.layers; l++) {
		CHECK_CUDA(cudaMalloc(&layers[l].device_arena, 2 * arena_room));
		CHECK_CUDA(cudaMemcpy(layers[l].device_arena, mapping_ro + layers[l].key_offset,
				      2 * arena_room, cudaMemcpyHostToDevice));
	}
	double kernel_seconds = 0;
	double on_device = time_compressed(cuda, ZC_CUDA_DEVICE, stream, &kernel_seconds);
	verify_layer0();
	snprintf(extra, sizeof extra, ",\"event_ms\":%.3f,\"fp16_written_tb_per_s\":%.3f",
		 kernel_seconds * 1e3, fp16 / kernel_seconds / 1e12);
	print_path("zc_kernels", on_device, compressed, extra);

	/* Scale: the device copying the fp16 bytes once (read + write). */
	void *a, *b;
	CHECK_CUDA(cudaMalloc(&a, (size_t)fp16));
	CHECK_CUDA(cudaMalloc(&b, (size_t)fp16));
	double copies[64];
	for (uint32_t r = 0; r < opt.repeat; r++) {
		CHECK_CUDA(cudaDeviceSynchronize());
		double c0 = now_seconds();
		CHECK_CUDA(cudaMemcpyAsync(b, a, (size_t)fp16, cudaMemcpyDeviceToDevice, stream));
		CHECK_CUDA(cudaStreamSynchronize(stream));
		copies[r] = now_seconds() - c0;
	}
	double copy = median(copies, opt.repeat);
	printf("{\"bench\":\"cuda\",\"path\":\"device_copy_fp16\",\"ms\":%.3f,"
	       "\"read_plus_write_tb_per_s\":%.3f,\"write_tb_per_s\":%.3f}\n",
	       copy * 1e3, 2 * fp16 / copy / 1e12, fp16 / copy / 1e12);
	cudaFree(a);
	cudaFree(b);

	bench_decode(cuda, stream);
	zc_cuda_stats stats;
	zc_cuda_get_stats(cuda, &stats);
	printf("{\"bench\":\"cuda\",\"stats\":{\"loads\":%llu,\"chunks\":%llu,\"bytes_staged\":%llu,"
	       "\"bytes_direct\":%llu}}\n",
	       (unsigned long long)stats.loads, (unsigned long long)stats.chunks,
	       (unsigned long long)stats.bytes_staged, (unsigned long long)stats.bytes_direct);
	zc_cuda_close(cuda);
	return 0;
}
