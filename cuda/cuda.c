/*
 * libzipcache_cuda's driver: the context, the bounce-buffer pipeline,
 * registered host ranges, and the public calls of zipcache/cuda.h.
 *
 * The pipeline. A context has two slots, each a pinned host buffer and a
 * device buffer of the same size plus a prefix scratch. A load is cut into
 * chunks (plan.c); chunk i takes slot i % 2:
 *   1. the CPU waits until the slot's previous DMA has read its pinned
 *      buffer, then copies the chunk's host bytes and its job table in;
 *   2. the context's copy stream waits until the slot's previous kernels
 *      are done with its device buffer, then moves the bytes (one DMA per
 *      run of staged bytes; registered host ranges go straight from where
 *      they are);
 *   3. the caller's stream waits for that copy and runs the chunk's kernels.
 * So while the CPU fills chunk i + 1, chunk i is on the wire and chunk
 * i - 1 in the kernels; successive loads (one per layer) pipeline the same
 * way, because a call returns once its last chunk is queued.
 */
#include "zipcache/cuda.h"

#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"
#include "plan.h"
#include "session.h"

/* Jobs one chunk holds at most: a layer of 32768 tokens in 128-token
 * blocks is 512 jobs, so one table covers it. */
#define CHUNK_MAX_JOBS 1024u
/* A host piece at least this large goes straight from registered memory
 * by DMA; smaller ones are cheaper to gather into the bounce buffer than
 * to move by DMA calls of their own. */
#define DIRECT_MIN_BYTES (64u << 10)
#define SLOT_ALIGN 256u
/* A chunk this small (a decode step's rows and its job table) is read by
 * the kernels straight from the pinned buffer over PCIe: cheaper than a
 * DMA call, an event and a wait, which cost more than moving it. */
#define IN_PLACE_MAX_BYTES (32u << 10)
/* ... and has few thread blocks: each reads its job over PCIe too. */
#define IN_PLACE_MAX_BLOCKS 256u

struct slot {
	uint8_t *pinned;
	uint8_t *pinned_device;  /* the pinned buffer as the GPU addresses it */
	uint8_t *device;
	uint32_t *prefix;
	uint64_t prefix_words;
	cudaEvent_t copied;     /* its DMA has read the pinned buffer */
	cudaEvent_t finished;   /* its kernels are done with the device buffer */
	bool used;
	bool read_in_place;     /* its last kernels read the pinned buffer itself */
};

/* A page-locked host range: the caller's (zc_cuda_register_host), or a
 * block's pool extent pinned by a session fetch (owner set). */
struct registered {
	const uint8_t *address;
	size_t bytes;
	const zc_session *owner;    /* NULL: the caller's range */
	uint32_t layer;
	uint64_t print;             /* session_block_print when it was pinned */
};

struct zc_cuda {
	int device;
	/* Two copy streams, taking a chunk's DMAs in turn: each DMA call has
	 * a fixed start-up, and one stream's start-up runs while the other's
	 * transfer does. copy_stream ends every chunk (after copy_join). */
	cudaStream_t copy_stream, copy_stream_b;
	cudaEvent_t copy_join;
	unsigned copy_turn;
	struct slot slots[2];
	unsigned next;
	size_t data_capacity;   /* bytes of a slot's data area */
	size_t slot_bytes;      /* data area + job table */
	int *error;             /* device flag the kernels set */
	struct plan plan;
	struct plan_chunk chunk;
	struct registered *registered;   /* sorted by address, never overlapping */
	size_t n_registered, registered_capacity;
	struct session_layer fetch;
	bool pins_refused;      /* the driver refused a pin: fetches bounce from then on */
	zc_cuda_stats stats;
	char message[256];
};

static int device_error(zc_cuda *cuda, cudaError_t error, const char *what)
{
	snprintf(cuda->message, sizeof cuda->message, "%s: %s (%s)", what,
		 cudaGetErrorString(error), cudaGetErrorName(error));
	/* Clears a sticky launch error for the next call; a sticky context
	 * error stays, and every later call reports it. */
	(void)cudaGetLastError();
	return ZC_EDEVICE;
}

#define CUDA_TRY(cuda, call) \
	do { \
		cudaError_t try_error_ = (call); \
		if (try_error_ != cudaSuccess) \
			return device_error(cuda, try_error_, #call); \
	} while (0)

int zc_cuda_device_count(void)
{
	int count = 0;
	cudaError_t error = cudaGetDeviceCount(&count);
	if (error == cudaErrorNoDevice)
		return 0;
	if (error != cudaSuccess) {
		(void)cudaGetLastError();
		return ZC_EDEVICE;
	}
	return count;
}

const char *zc_cuda_last_error(const zc_cuda *cuda)
{
	return cuda ? cuda->message : "";
}

static size_t align_to(size_t n, size_t a)
{
	return (n + a - 1) / a * a;
}

static void slot_release(struct slot *slot)
{
	if (slot->pinned)
		cudaFreeHost(slot->pinned);
	if (slot->device)
		cudaFree(slot->device);
	if (slot->prefix)
		cudaFree(slot->prefix);
	slot->pinned = NULL;
	slot->device = NULL;
	slot->prefix = NULL;
	slot->prefix_words = 0;
}

static size_t table_bytes(void)
{
	return sizeof(struct cuda_launch) + CHUNK_MAX_JOBS * sizeof(struct cuda_job);
}

/* (Re)allocates both slots' buffers for data_capacity; waits for their work first. */
static int slots_allocate(zc_cuda *cuda, size_t data_capacity)
{
	data_capacity = align_to(data_capacity, SLOT_ALIGN);
	size_t bytes = data_capacity + table_bytes();
	for (int i = 0; i < 2; i++) {
		struct slot *slot = &cuda->slots[i];
		if (slot->used) {
			CUDA_TRY(cuda, cudaEventSynchronize(slot->copied));
			CUDA_TRY(cuda, cudaEventSynchronize(slot->finished));
		}
		if (slot->pinned)
			cudaFreeHost(slot->pinned);
		if (slot->device)
			cudaFree(slot->device);
		slot->pinned = NULL;
		slot->device = NULL;
		CUDA_TRY(cuda, cudaHostAlloc((void **)&slot->pinned, bytes, cudaHostAllocMapped));
		CUDA_TRY(cuda, cudaHostGetDevicePointer((void **)&slot->pinned_device, slot->pinned, 0));
		CUDA_TRY(cuda, cudaMalloc((void **)&slot->device, bytes));
		slot->used = false;
	}
	cuda->data_capacity = data_capacity;
	cuda->slot_bytes = bytes;
	return 0;
}

static int slot_prefix(zc_cuda *cuda, struct slot *slot, uint64_t words)
{
	if (words <= slot->prefix_words)
		return 0;
	if (slot->used)
		CUDA_TRY(cuda, cudaEventSynchronize(slot->finished));
	if (slot->prefix)
		cudaFree(slot->prefix);
	slot->prefix = NULL;
	slot->prefix_words = 0;
	uint64_t room = words < 4096 ? 4096 : words + words / 2;
	CUDA_TRY(cuda, cudaMalloc((void **)&slot->prefix, room * sizeof(uint32_t)));
	slot->prefix_words = room;
	return 0;
}

void zc_cuda_close(zc_cuda *cuda)
{
	if (!cuda)
		return;
	cudaSetDevice(cuda->device);
	cudaStreamSynchronize(cuda->copy_stream);
	if (cuda->copy_stream_b)
		cudaStreamSynchronize(cuda->copy_stream_b);
	for (int i = 0; i < 2; i++) {
		struct slot *slot = &cuda->slots[i];
		if (slot->used)
			cudaEventSynchronize(slot->finished);
		slot_release(slot);
		if (slot->copied)
			cudaEventDestroy(slot->copied);
		if (slot->finished)
			cudaEventDestroy(slot->finished);
	}
	for (size_t i = 0; i < cuda->n_registered; i++)
		cudaHostUnregister((void *)cuda->registered[i].address);
	if (cuda->error)
		cudaFree(cuda->error);
	if (cuda->copy_stream)
		cudaStreamDestroy(cuda->copy_stream);
	if (cuda->copy_stream_b)
		cudaStreamDestroy(cuda->copy_stream_b);
	if (cuda->copy_join)
		cudaEventDestroy(cuda->copy_join);
	free(cuda->registered);
	session_layer_free(&cuda->fetch);
	free(cuda->chunk.jobs);
	free(cuda->chunk.placements);
	plan_free(&cuda->plan);
	free(cuda);
}

static int context_start(zc_cuda *cuda, size_t chunk_bytes)
{
	CUDA_TRY(cuda, cudaSetDevice(cuda->device));
	CUDA_TRY(cuda, cudaStreamCreateWithFlags(&cuda->copy_stream, cudaStreamNonBlocking));
	CUDA_TRY(cuda, cudaStreamCreateWithFlags(&cuda->copy_stream_b, cudaStreamNonBlocking));
	CUDA_TRY(cuda, cudaEventCreateWithFlags(&cuda->copy_join, cudaEventDisableTiming));
	for (int i = 0; i < 2; i++) {
		CUDA_TRY(cuda, cudaEventCreateWithFlags(&cuda->slots[i].copied,
							cudaEventDisableTiming));
		CUDA_TRY(cuda, cudaEventCreateWithFlags(&cuda->slots[i].finished,
							cudaEventDisableTiming));
	}
	CUDA_TRY(cuda, cudaMalloc((void **)&cuda->error, sizeof(int)));
	CUDA_TRY(cuda, cudaMemset(cuda->error, 0, sizeof(int)));
	return slots_allocate(cuda, chunk_bytes);
}

int zc_cuda_open(int device, size_t chunk_bytes, zc_cuda **out)
{
	int count = zc_cuda_device_count();
	if (count < 0)
		return count;
	if (device < 0 || device >= count)
		return -ENODEV;
	zc_cuda *cuda = calloc(1, sizeof *cuda);
	if (!cuda)
		return -ENOMEM;
	cuda->device = device;
	plan_init(&cuda->plan);
	session_layer_init(&cuda->fetch);
	cuda->chunk.max_jobs = CHUNK_MAX_JOBS;
	cuda->chunk.jobs = calloc(CHUNK_MAX_JOBS, sizeof *cuda->chunk.jobs);
	cuda->chunk.placements = calloc(CHUNK_MAX_JOBS, sizeof *cuda->chunk.placements);
	if (!cuda->chunk.jobs || !cuda->chunk.placements) {
		zc_cuda_close(cuda);
		return -ENOMEM;
	}
	int rc = context_start(cuda, chunk_bytes ? chunk_bytes : ZC_CUDA_DEFAULT_CHUNK_BYTES);
	if (rc < 0) {
		fprintf(stderr, "zc_cuda_open: %s\n", cuda->message);
		zc_cuda_close(cuda);
		return rc;
	}
	*out = cuda;
	return 0;
}

/* The index of the first range ending past address (n_registered: none). */
static size_t registered_find(const zc_cuda *cuda, const uint8_t *address)
{
	size_t lo = 0, hi = cuda->n_registered;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		const struct registered *r = &cuda->registered[mid];
		if (r->address + r->bytes <= address)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static bool is_registered(const zc_cuda *cuda, const uint8_t *address, uint64_t bytes)
{
	size_t i = registered_find(cuda, address);
	if (i == cuda->n_registered)
		return false;
	const struct registered *r = &cuda->registered[i];
	return address >= r->address && address + bytes <= r->address + r->bytes;
}

/* Page-locks a range that overlaps no registered one and keeps it in order. */
static int registered_add(zc_cuda *cuda, const struct registered *range)
{
	if (cuda->n_registered == cuda->registered_capacity) {
		size_t capacity = cuda->registered_capacity ? 2 * cuda->registered_capacity : 8;
		struct registered *r = realloc(cuda->registered, capacity * sizeof *r);
		if (!r)
			return -ENOMEM;
		cuda->registered = r;
		cuda->registered_capacity = capacity;
	}
	size_t at = registered_find(cuda, range->address);
	if (at < cuda->n_registered && cuda->registered[at].address < range->address + range->bytes)
		return -EEXIST;
	CUDA_TRY(cuda, cudaSetDevice(cuda->device));
	/* Read-only: the DMA only reads, and a client's mapping is PROT_READ. */
	CUDA_TRY(cuda, cudaHostRegister((void *)range->address, range->bytes,
					cudaHostRegisterReadOnly | cudaHostRegisterPortable));
	memmove(&cuda->registered[at + 1], &cuda->registered[at],
		(cuda->n_registered - at) * sizeof *cuda->registered);
	cuda->registered[at] = *range;
	cuda->n_registered++;
	return 0;
}

/* Unregisters range i and forgets it, whatever the driver says. */
static int registered_remove(zc_cuda *cuda, size_t i)
{
	const uint8_t *address = cuda->registered[i].address;
	if (cuda->registered[i].owner)
		cuda->stats.pins_released++;
	memmove(&cuda->registered[i], &cuda->registered[i + 1],
		(cuda->n_registered - i - 1) * sizeof *cuda->registered);
	cuda->n_registered--;
	CUDA_TRY(cuda, cudaSetDevice(cuda->device));
	/* DMAs from the range may still be queued. */
	CUDA_TRY(cuda, cudaStreamSynchronize(cuda->copy_stream));
	CUDA_TRY(cuda, cudaStreamSynchronize(cuda->copy_stream_b));
	/* A pin whose mapping went first may not be found by address; the
	 * driver drops it with the context. */
	CUDA_TRY(cuda, cudaHostUnregister((void *)address));
	return 0;
}

int zc_cuda_register_host(zc_cuda *cuda, const void *address, size_t bytes)
{
	if (!address || bytes == 0)
		return -EINVAL;
	/* Pins of a fetch in the way are dropped (the fetch pins again if it
	 * needs to); a caller's range in the way is the caller's mistake. */
	const uint8_t *start = address, *end = start + bytes;
	for (size_t i = registered_find(cuda, start);
	     i < cuda->n_registered && cuda->registered[i].address < end;) {
		if (!cuda->registered[i].owner)
			return -EEXIST;
		int rc = registered_remove(cuda, i);
		if (rc < 0)
			return rc;
	}
	return registered_add(cuda, &(struct registered){ .address = start, .bytes = bytes });
}

int zc_cuda_unregister_host(zc_cuda *cuda, const void *address)
{
	for (size_t i = 0; i < cuda->n_registered; i++) {
		if (cuda->registered[i].address != address || cuda->registered[i].owner)
			continue;
		return registered_remove(cuda, i);
	}
	return -ENOENT;
}

void zc_cuda_get_stats(const zc_cuda *cuda, zc_cuda_stats *stats)
{
	*stats = cuda->stats;
}

/* One run of device bytes to fill from one host range. */
static int copy_run(zc_cuda *cuda, uint8_t *device, const uint8_t *host, uint64_t bytes)
{
	if (bytes == 0)
		return 0;
	cuda->copy_turn ^= 1u;
	CUDA_TRY(cuda, cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice,
				       cuda->copy_turn ? cuda->copy_stream_b : cuda->copy_stream));
	cuda->stats.bytes_to_device += bytes;
	return 0;
}

/* Steps 1 and 2 of the pipeline for one chunk in `slot`. */
static int chunk_transfer(zc_cuda *cuda, struct slot *slot, bool host)
{
	struct plan_chunk *chunk = &cuda->chunk;
	uint64_t device_base = (uint64_t)(uintptr_t)slot->device;
	size_t table_offset = align_to(chunk->data_bytes, SLOT_ALIGN);
	struct cuda_launch *launch = (struct cuda_launch *)(slot->pinned + table_offset);
	struct cuda_job *jobs = (struct cuda_job *)(launch + 1);

	if (slot->used)
		CUDA_TRY(cuda, cudaEventSynchronize(slot->read_in_place ? slot->finished : slot->copied));
	/* Pinned runs: [run_begin, run_end) of staged bytes to move in one DMA. */
	uint64_t run_begin = 0, run_end = 0;
	bool run_open = false;
	/* Direct runs: host-contiguous registered pieces placed back to back. */
	const uint8_t *direct_host = NULL;
	uint64_t direct_begin = 0, direct_end = 0;

	CUDA_TRY(cuda, cudaStreamWaitEvent(cuda->copy_stream, slot->finished, 0));
	CUDA_TRY(cuda, cudaStreamWaitEvent(cuda->copy_stream_b, slot->finished, 0));
	for (size_t i = 0; i < chunk->n_jobs; i++) {
		jobs[i] = chunk->jobs[i];
		if (!host)
			continue;
		const struct plan_placement *place = &chunk->placements[i];
		jobs[i].src += device_base;
		if (place->bytes == 0)
			continue;
		bool direct = !place->strided && place->bytes >= DIRECT_MIN_BYTES &&
			      is_registered(cuda, place->source, place->bytes);
		if (direct) {
			/* Joins the open run when it follows it in host memory as it
			 * does in the chunk: back to back, or a few bytes on inside
			 * the same registered range (a block's V after its K, which
			 * plan_next_chunk placed with the same gap). */
			const uint8_t *host_end = direct_host ? direct_host + (direct_end - direct_begin)
							      : NULL;
			uint64_t gap = place->offset - direct_end;
			bool joins = direct_host && place->offset >= direct_end &&
				     place->source >= host_end &&
				     (uint64_t)(place->source - host_end) == gap &&
				     (gap == 0 || (gap <= PLAN_GAP_BYTES &&
						   is_registered(cuda, direct_host,
								 (uint64_t)(place->source - direct_host) +
									 place->bytes)));
			if (joins) {
				direct_end = place->offset + place->bytes;
			} else {
				if (copy_run(cuda, slot->device + direct_begin, direct_host,
					     direct_end - direct_begin) < 0)
					return ZC_EDEVICE;
				direct_host = place->source;
				direct_begin = place->offset;
				direct_end = place->offset + place->bytes;
			}
			cuda->stats.bytes_direct += place->bytes;
			continue;
		}
		plan_stage(place, slot->pinned);
		cuda->stats.bytes_staged += place->bytes;
		if (run_open && place->offset <= run_end + PLAN_GAP_BYTES) {
			run_end = place->offset + place->bytes;
		} else {
			if (run_open && copy_run(cuda, slot->device + run_begin, slot->pinned + run_begin,
						 run_end - run_begin) < 0)
				return ZC_EDEVICE;
			run_open = true;
			run_begin = place->offset;
			run_end = place->offset + place->bytes;
		}
	}
	if (copy_run(cuda, slot->device + direct_begin, direct_host, direct_end - direct_begin) < 0)
		return ZC_EDEVICE;
	launch->n_jobs = chunk->n_jobs;
	launch->tiles = chunk->tiles;
	launch->scan_heads = chunk->scan_heads;
	launch->pad = 0;
	uint64_t table_end = table_offset + sizeof *launch + chunk->n_jobs * sizeof *jobs;
	/* The job table joins the last staged run when it is near, so a small
	 * load is one DMA. */
	if (run_open && table_offset <= run_end + SLOT_ALIGN) {
		run_end = table_end;
	} else {
		if (run_open && copy_run(cuda, slot->device + run_begin, slot->pinned + run_begin,
					 run_end - run_begin) < 0)
			return ZC_EDEVICE;
		run_begin = table_offset;
		run_end = table_end;
	}
	if (copy_run(cuda, slot->device + run_begin, slot->pinned + run_begin, run_end - run_begin) < 0)
		return ZC_EDEVICE;
	/* The chunk is copied when both streams are. */
	CUDA_TRY(cuda, cudaEventRecord(cuda->copy_join, cuda->copy_stream_b));
	CUDA_TRY(cuda, cudaStreamWaitEvent(cuda->copy_stream, cuda->copy_join, 0));
	CUDA_TRY(cuda, cudaEventRecord(slot->copied, cuda->copy_stream));
	return 0;
}

/* A small chunk: staged into the pinned buffer, where its kernels read it. */
static int chunk_in_place(zc_cuda *cuda, struct slot *slot, bool host)
{
	struct plan_chunk *chunk = &cuda->chunk;
	size_t table_offset = align_to(chunk->data_bytes, SLOT_ALIGN);
	struct cuda_launch *launch = (struct cuda_launch *)(slot->pinned + table_offset);
	struct cuda_job *jobs = (struct cuda_job *)(launch + 1);

	/* Its last kernels (which read it in place, or read what its DMA
	 * brought) are done: then so is that DMA. */
	if (slot->used)
		CUDA_TRY(cuda, cudaEventSynchronize(slot->finished));
	for (size_t i = 0; i < chunk->n_jobs; i++) {
		jobs[i] = chunk->jobs[i];
		if (!host)
			continue;
		jobs[i].src += (uint64_t)(uintptr_t)slot->pinned_device;
		if (chunk->placements[i].bytes) {
			plan_stage(&chunk->placements[i], slot->pinned);
			cuda->stats.bytes_staged += chunk->placements[i].bytes;
			cuda->stats.bytes_to_device += chunk->placements[i].bytes;
		}
	}
	launch->n_jobs = chunk->n_jobs;
	launch->tiles = chunk->tiles;
	launch->scan_heads = chunk->scan_heads;
	launch->pad = 0;
	return 0;
}

static int layer_load(zc_cuda *cuda, const zc_cuda_layer *layer, cudaStream_t stream)
{
	struct plan *plan = &cuda->plan;
	struct plan_cursor cursor = { 0, 0 };
	bool host = plan->memory == ZC_CUDA_HOST;
	int rc;

	if (host && plan->max_per_head > cuda->data_capacity &&
	    (rc = slots_allocate(cuda, plan->max_per_head)) < 0)
		return rc;
	while (plan_next_chunk(plan, &cursor, cuda->data_capacity, &cuda->chunk)) {
		struct plan_chunk *chunk = &cuda->chunk;
		struct slot *slot = &cuda->slots[cuda->next];
		cuda->next ^= 1u;
		if (chunk->tiles > INT_MAX || chunk->scan_heads > INT_MAX)
			return ZC_EBUFFER;
		if ((rc = slot_prefix(cuda, slot, chunk->prefix_words)) < 0)
			return rc;
		size_t table_offset = align_to(chunk->data_bytes, SLOT_ALIGN);
		bool in_place = table_offset + sizeof(struct cuda_launch) +
					chunk->n_jobs * sizeof(struct cuda_job) <= IN_PLACE_MAX_BYTES &&
				chunk->tiles + chunk->scan_heads <= IN_PLACE_MAX_BLOCKS;
		const uint8_t *base;
		if (in_place) {
			rc = chunk_in_place(cuda, slot, host);
			base = slot->pinned_device;
		} else {
			rc = chunk_transfer(cuda, slot, host);
			base = slot->device;
			if (rc == 0)
				CUDA_TRY(cuda, cudaStreamWaitEvent(stream, slot->copied, 0));
		}
		if (rc < 0)
			return rc;
		int launched = cuda_kernels_launch(
			(const struct cuda_launch *)(base + table_offset), chunk->n_jobs,
			chunk->tiles, chunk->scan_heads, slot->prefix, cuda->error, stream);
		if (launched != cudaSuccess)
			return device_error(cuda, (cudaError_t)launched, "kernel launch");
		CUDA_TRY(cuda, cudaEventRecord(slot->finished, stream));
		slot->used = true;
		slot->read_in_place = in_place;
		cuda->stats.chunks++;
	}
	return 0;
}

int zc_cuda_load_layer(zc_cuda *cuda, const zc_cuda_layer *layer, const zc_cuda_target *target,
		       zc_cuda_mirror *mirror, void *stream)
{
	int rc = plan_layer(&cuda->plan, layer, target, mirror);
	if (rc < 0)
		return rc;
	if (cuda->plan.n_units == 0)
		goto out_mirror;
	CUDA_TRY(cuda, cudaSetDevice(cuda->device));
	rc = layer_load(cuda, layer, (cudaStream_t)stream);
	if (rc < 0) {
		/* Part of it may be queued: the target's state is unknown. */
		if (mirror)
			zc_cuda_mirror_reset(mirror);
		return rc;
	}
	cuda->stats.loads++;
	cuda->stats.blocks += cuda->plan.blocks;
	cuda->stats.residual_rows += cuda->plan.residual_rows;
out_mirror:
	cuda->stats.blocks_skipped += cuda->plan.blocks_skipped;
	if (mirror)
		return plan_mirror_update(mirror, layer, target);
	return 0;
}

int zc_cuda_synchronize(zc_cuda *cuda, void *stream)
{
	int found = 0;
	CUDA_TRY(cuda, cudaSetDevice(cuda->device));
	CUDA_TRY(cuda, cudaStreamSynchronize((cudaStream_t)stream));
	CUDA_TRY(cuda, cudaMemcpy(&found, cuda->error, sizeof found, cudaMemcpyDeviceToHost));
	if (found) {
		CUDA_TRY(cuda, cudaMemset(cuda->error, 0, sizeof(int)));
		snprintf(cuda->message, sizeof cuda->message,
			 "a device payload's saliency mask disagrees with its layout");
		return ZC_ECORRUPT;
	}
	return 0;
}

/* ---- session fetches -------------------------------------------------------- */

/* A block's pool extent at least this large is pinned by a fetch, once;
 * smaller ones (a decode step's residual flush, ~70 KB at D = 128) go
 * through the bounce buffer: cheaper than a registration each. */
#define PIN_MIN_BYTES (1u << 20)

/* The pages of a block's pool extent (K, then V, docs/MAP.md), or false
 * when its payloads do not lie together as the pool lays them out. */
static bool block_extent(const zc_cuda_block *block, const uint8_t **start, size_t *bytes)
{
	uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
	uintptr_t k = (uintptr_t)block->keys, v = (uintptr_t)block->values;
	uintptr_t lo = k < v ? k : v;
	uintptr_t hi = k + block->key_bytes > v + block->value_bytes ? k + block->key_bytes :
								      v + block->value_bytes;
	lo = lo / page * page;
	hi = (hi + page - 1) / page * page;
	if (hi - lo > 2 * (block->key_bytes + block->value_bytes) + 2 * page)
		return false;
	*start = (const uint8_t *)lo;
	*bytes = hi - lo;
	return true;
}

/*
 * Pins a block the fetch is about to move, unless it is pinned already.
 * A pin holds the pages the extent had when it was made: once the session
 * drops the block, the daemon punches the extent and may write another
 * block there, into new pages the pin does not see. So a pin is used only
 * while the bytes the client's mapping shows there still have its print;
 * else it is made again.
 */
static void pin_block(zc_cuda *cuda, const zc_session *session, uint32_t layer,
		      const zc_cuda_block *block)
{
	const uint8_t *start;
	size_t bytes;
	if (cuda->pins_refused || !block_extent(block, &start, &bytes) || bytes < PIN_MIN_BYTES)
		return;
	uint64_t print = session_block_print(block);
	size_t i = registered_find(cuda, start);
	if (i < cuda->n_registered) {
		const struct registered *r = &cuda->registered[i];
		if (!r->owner && r->address <= start && start + bytes <= r->address + r->bytes)
			return; /* inside the caller's own range */
		if (r->owner && r->address == start && r->bytes == bytes && r->print == print)
			return;
	}
	for (i = registered_find(cuda, start);
	     i < cuda->n_registered && cuda->registered[i].address < start + bytes;) {
		if (!cuda->registered[i].owner)
			return; /* overlaps the caller's range: bounce */
		(void)registered_remove(cuda, i);
	}
	int rc = registered_add(cuda, &(struct registered){ .address = start, .bytes = bytes,
							    .owner = session, .layer = layer,
							    .print = print });
	if (rc == ZC_EDEVICE) {
		/* The bounce buffer still works; a driver that refused once is not
		 * asked on every fetch. */
		cuda->pins_refused = true;
		return;
	}
	if (rc == 0) {
		cuda->stats.pins++;
		cuda->stats.pin_bytes += bytes;
	}
}

/* After a trim: the layer's pins whose blocks left its table. */
static void pins_sweep(zc_cuda *cuda, const zc_session *session, uint32_t layer,
		       const zc_cuda_layer *contents)
{
	for (size_t i = 0; i < cuda->n_registered;) {
		const struct registered *r = &cuda->registered[i];
		bool named = r->owner != session || r->layer != layer;
		for (size_t b = 0; !named && b < contents->n_blocks; b++) {
			const uint8_t *start;
			size_t bytes;
			named = block_extent(&contents->blocks[b], &start, &bytes) &&
				start == r->address && bytes == r->bytes;
		}
		if (named)
			i++;
		else
			(void)registered_remove(cuda, i);
	}
}

struct fetch_arg {
	zc_cuda *cuda;
	void *stream;
};

static int fetch_load(void *arg, const zc_session *session, uint32_t layer,
		      const zc_cuda_layer *contents, const zc_cuda_target *target,
		      zc_cuda_mirror *mirror, uint32_t first, bool rewrite)
{
	struct fetch_arg *a = arg;
	if (rewrite)
		pins_sweep(a->cuda, session, layer, contents);
	for (size_t i = 0; i < contents->n_blocks; i++) {
		const zc_cuda_block *block = &contents->blocks[i];
		if (block->valid_tokens && block->first_token >= first)
			pin_block(a->cuda, session, layer, block);
	}
	return zc_cuda_load_layer(a->cuda, contents, target, mirror, a->stream);
}

int zc_cuda_fetch_layer(zc_cuda *cuda, const zc_session *session, uint32_t layer,
			const zc_cuda_target *target, zc_cuda_mirror *mirror, void *stream)
{
	if (!cuda || !session || !target)
		return -EINVAL;
	struct fetch_arg arg = { cuda, stream };
	struct session_load load = { fetch_load, &arg };
	int rc = session_fetch(&cuda->fetch, session, layer, target, mirror, &load);
	if (rc >= 0)
		cuda->stats.fetches++;
	return rc;
}

void zc_cuda_forget_session(zc_cuda *cuda, const zc_session *session)
{
	for (size_t i = 0; i < cuda->n_registered;) {
		if (cuda->registered[i].owner == session)
			(void)registered_remove(cuda, i);
		else
			i++;
	}
}
