/*
 * libzipcache_cuda: compressed K/V blocks to a GPU, reconstructed there.
 *
 * A layer's compressed blocks (the payloads zc_block_compress writes,
 * docs/CODEC.md) and its exact fp16 residual rows go to the GPU as they
 * are, about 3.8x fewer bytes than fp16 at the default config, and CUDA
 * kernels reconstruct them into a device fp16 tensor [B, H, S, D] at the
 * caller's element strides. The result is bit-identical to
 * zc_block_reconstruct on the CPU.
 *
 * A separate library (libzipcache_cuda.so, linked against libzipcache.so
 * and CUDA's runtime), built only where nvcc is; nothing else in zipcache
 * needs it. No CUDA header is needed to use it: a stream is a
 * cudaStream_t passed as void * (NULL: the legacy default stream), device
 * memory is a plain pointer.
 *
 * Moving host bytes. Payloads in host memory (ZC_CUDA_HOST) travel in
 * chunks through the context's two pinned bounce buffers: while the CPU
 * copies chunk i+1 into one, the DMA engine moves chunk i and the kernels
 * of chunk i-1 run. A host range registered with zc_cuda_register_host
 * (page-locked in place, read-only) skips the CPU copy: the DMA reads it
 * directly. Payloads already in device memory (ZC_CUDA_DEVICE) are read in
 * place.
 *
 * Incremental loads. A zc_cuda_mirror remembers what an earlier load put
 * into the same target: the blocks it reconstructed and the residual rows
 * it copied. A load with the mirror moves and reconstructs only the blocks
 * new since then and the residual rows not copied yet, O(new tokens).
 *
 * Errors are negative codes (zipcache/error.h). Everything a caller can
 * get wrong (config, shapes, sizes, a host payload's saliency mask, room in
 * the target) is checked before anything is queued; a device payload's
 * mask can only be checked by the kernels, which then write nothing for
 * that head and make the next zc_cuda_synchronize return ZC_ECORRUPT. A
 * CUDA failure is ZC_EDEVICE, with the runtime's words in
 * zc_cuda_last_error. Kernels never read or write outside the payloads
 * and the target rows they were given.
 *
 * Threads: a context belongs to one thread at a time.
 */
#ifndef ZIPCACHE_CUDA_H
#define ZIPCACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "zipcache/codec.h"
#include "zipcache/error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct zc_cuda zc_cuda;
typedef struct zc_cuda_mirror zc_cuda_mirror;
typedef struct zc_session zc_session;   /* zipcache/client.h */

/* Where a layer's payload and residual pointers point. */
typedef enum zc_cuda_memory {
	ZC_CUDA_HOST = 0,    /* any host memory: pageable, a read-only mapping, pinned */
	ZC_CUDA_DEVICE = 1   /* device memory of the context's GPU */
} zc_cuda_memory;

/* One compressed block of a layer: its K and V payloads as zc_block_compress
 * wrote them for a [batch, heads, tokens, head_dim] block. */
typedef struct zc_cuda_block {
	const void *keys;
	const void *values;
	size_t key_bytes;
	size_t value_bytes;
	uint32_t first_token;   /* the layer token of the block's token 0 */
	uint32_t tokens;        /* tokens the block was compressed with */
	uint32_t valid_tokens;  /* of them, how many the layer still holds (a trim cuts a block) */
} zc_cuda_block;

/* What a layer is made of: a codec config and shape, its blocks in token
 * order, then its exact residual rows (layer tokens residual_first ..
 * residual_first + residual_tokens - 1; row i of head (b, h) at
 * residual_keys[b*residual_key_strides.batch + h*residual_key_strides.head
 * + i*residual_key_strides.token], token stride == head_dim). This is what
 * a session's block table holds. */
typedef struct zc_cuda_layer {
	zc_codec_config config;
	uint32_t batch, heads, head_dim_k, head_dim_v;
	const zc_cuda_block *blocks;
	size_t n_blocks;
	const uint16_t *residual_keys;
	const uint16_t *residual_values;
	zc_strides residual_key_strides;
	zc_strides residual_value_strides;
	uint32_t residual_first;
	uint32_t residual_tokens;
	zc_cuda_memory memory;
} zc_cuda_layer;

/* The device fp16 tensors a layer lands in: token t of head (b, h) at
 * keys[b*key_strides.batch + h*key_strides.head + t*key_strides.token]
 * (a torch tensor's data_ptr() and stride()). */
typedef struct zc_cuda_target {
	uint16_t *keys;
	uint16_t *values;
	zc_strides key_strides;
	zc_strides value_strides;
	uint32_t max_tokens;    /* tokens each head has room for */
} zc_cuda_target;

/* Counters of one context, for benchmarks and tests. */
typedef struct zc_cuda_stats {
	uint64_t loads;             /* zc_cuda_load_layer calls that queued work */
	uint64_t blocks;            /* blocks reconstructed (K and V count as one) */
	uint64_t blocks_skipped;    /* blocks a mirror said were there already */
	uint64_t residual_rows;     /* residual token rows copied */
	uint64_t bytes_staged;      /* host bytes copied by the CPU into a bounce buffer */
	uint64_t bytes_direct;      /* host bytes the DMA read from registered memory */
	uint64_t bytes_to_device;   /* bytes moved host -> device in all */
	uint64_t chunks;            /* bounce-buffer chunks */
	uint64_t fetches;           /* zc_cuda_fetch_layer calls that succeeded */
	uint64_t pins;              /* pool extents a fetch page-locked */
	uint64_t pins_released;     /* of them, unregistered again (trimmed, stale, forgotten) */
	uint64_t pin_bytes;         /* bytes page-locked by fetches in all */
} zc_cuda_stats;

/* Default bounce-buffer chunk. On an H200 a session of 32 layers x 32768
 * tokens from registered memory loaded in 23.5 ms with 16 MiB chunks and
 * 22.3 ms with 64 MiB (docs/BENCHMARKS.md): fewer chunks, fewer gaps
 * between DMAs. A context holds two of them pinned and two on the device. */
#define ZC_CUDA_DEFAULT_CHUNK_BYTES (64u << 20)

/* Number of CUDA devices (>= 0), or ZC_EDEVICE when there is no usable
 * driver; never fails for lack of a GPU in another way. */
int zc_cuda_device_count(void);

/* A context on `device`: its copy stream, two pinned bounce buffers of
 * chunk_bytes (0: the default) and their device twins. */
int zc_cuda_open(int device, size_t chunk_bytes, zc_cuda **out);
void zc_cuda_close(zc_cuda *cuda);

/* The CUDA runtime's message for the last ZC_EDEVICE, or "". */
const char *zc_cuda_last_error(const zc_cuda *cuda);

/*
 * Queues the reconstruction of `layer` into `target` on `stream` and
 * returns once it is queued (host bytes are read before it returns, so the
 * caller may change them afterwards). With a mirror, only what is new
 * since the last load through that mirror into the same target is moved;
 * the mirror then describes this load. NULL mirror: everything.
 * Target tokens outside the layer's blocks and residual are not touched.
 */
int zc_cuda_load_layer(zc_cuda *cuda, const zc_cuda_layer *layer, const zc_cuda_target *target,
		       zc_cuda_mirror *mirror, void *stream);

/* Waits for `stream`, then reports what the kernels found: 0, ZC_ECORRUPT
 * (a device payload's mask disagreed with its layout since the last call),
 * or ZC_EDEVICE. */
int zc_cuda_synchronize(zc_cuda *cuda, void *stream);

/* Page-locks [address, address + bytes) in place, read-only
 * (cudaHostRegisterReadOnly), so loads from it skip the bounce buffer.
 * For long-lived ranges such as a session's mapping: registering costs far
 * more than one load. ZC_EDEVICE if the driver refuses (the bounce buffer
 * still works then). */
int zc_cuda_register_host(zc_cuda *cuda, const void *address, size_t bytes);
int zc_cuda_unregister_host(zc_cuda *cuda, const void *address);

void zc_cuda_get_stats(const zc_cuda *cuda, zc_cuda_stats *stats);

/* Incremental state for one target. A new mirror knows nothing (its first
 * load is a full one). After the layer loses tokens (a trim) call
 * zc_cuda_mirror_trim with what it holds now, so rows re-appended at the
 * same positions are moved again. */
int zc_cuda_mirror_new(zc_cuda_mirror **out);
void zc_cuda_mirror_free(zc_cuda_mirror *mirror);
void zc_cuda_mirror_reset(zc_cuda_mirror *mirror);
void zc_cuda_mirror_trim(zc_cuda_mirror *mirror, uint32_t tokens);

/*
 * A session's layer onto the GPU: zc_cuda_load_layer over what the
 * session's block table and residual hold, inside one consistent read of
 * the layer (zipcache/reader.h), for views = none and views = full alike
 * (the residual rows come from the readers' residual or the view's last
 * rows). Returns the layer's token count (>= 0) once the load is queued on
 * `stream`, or a negative code: ZC_EBUFFER (the target has room for fewer
 * tokens; nothing queued), ZC_ESTALE (views = full: the view holding the
 * residual rows was dropped; zc_session_view brings it back), -ETIMEDOUT
 * (a write of the layer never ended), ZC_EAGAIN (every read for
 * ZC_READ_TIMEOUT_MS was torn by writes), and zc_cuda_load_layer's.
 *
 * Blocks of at least 1 MiB are page-locked in place the first time a fetch
 * moves them (cudaHostRegister, read-only: the pool is a sparse 1 TiB
 * mapping, so it is pinned block by block, never whole) and then go
 * straight from the pool by DMA; smaller blocks and the residual rows go
 * through the bounce buffer. A pin is made again when the bytes at its
 * extent are no longer those it was made over (the daemon reuses a freed
 * extent for another block), and dropped when a trim takes its block out of
 * the layer; zc_cuda_forget_session drops a session's pins (call it before
 * zc_session_release or zc_session_close), zc_cuda_close all of them.
 *
 * With a mirror the fetch is incremental: only blocks new since the last
 * fetch through it and residual rows not copied yet move. Trims are seen
 * in the table (fewer tokens than the mirror knows, a block that is not
 * the entry it loaded); a trim that appends made up for before the next
 * fetch is caught by prints of the last token both know (a hash of its
 * rows or of its block's payload edges) and makes the next fetch a full
 * one. A caller that trims the session itself calls zc_cuda_mirror_trim
 * and relies on nothing else.
 */
int zc_cuda_fetch_layer(zc_cuda *cuda, const zc_session *session, uint32_t layer,
			const zc_cuda_target *target, zc_cuda_mirror *mirror, void *stream);

/* Unregisters the pins fetches made of this session's blocks. */
void zc_cuda_forget_session(zc_cuda *cuda, const zc_session *session);

#ifdef __cplusplus
}
#endif

#endif
