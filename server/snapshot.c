/*
 * Session snapshots: encode, verify, export, import (snapshot.h,
 * docs/SNAPSHOT.md). The parts (a header, a block record) are encoded and
 * checked without I/O; the file functions read and write only the
 * descriptor they are given.
 *
 * Import reads the file once. A first step checks the header and the
 * layer table (every count against the others and the layout, the
 * importer's expectations) and makes nothing; then one pass verifies and
 * builds at once: each block record is checked, its payload read chunk
 * by chunk (memory stays bounded by a chunk and a residual, not the
 * snapshot), hashed and written from the same buffer into a fresh pool
 * extent of the not yet committed session, several layers at once on
 * several threads; the trailer's whole-file checksum last, before the
 * commit point. Any failure throws away everything the pass made.
 */
#include "snapshot.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

/*
 * XXH3 header-only (nothing linked), with its x86 vector kernels chosen
 * at run time: built without -mavx2, the header alone would fix the SSE2
 * kernel (about 10 GB/s, a third of the AVX2 one: the export's largest
 * cost after the kernel's two copies, BENCHMARKS.md). XXH_X86DISPATCH
 * makes the header compile every x86 kernel under its own target
 * attribute, as the library's xxh_x86dispatch.c does; hash_update()
 * below picks one by the codec's ISA choice (the CPU's, or ZC_CODEC_ISA).
 * Every kernel computes the same XXH3: the format does not change.
 */
#if defined(__x86_64__) && defined(__GNUC__)
#define SNAPSHOT_HASH_DISPATCH 1
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_SSE2 __attribute__((__target__("sse2")))
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#include <immintrin.h>   /* the kernels' vector types, whatever -m flags say */
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "fault.h"
#include "fd_write.h"
#include "pool.h"
#include "resources.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
	       "snapshots are written as little-endian structs");
_Static_assert(SNAPSHOT_MODEL_ID_BYTES == ZC_MODEL_ID_MAX + 1 &&
	       SNAPSHOT_MODEL_ID_BYTES == STORE_NAME_BYTES,
	       "one bound for a model id");

/* How long an export to a pipe waits for its reader before giving up:
 * the session's later requests wait behind the export. */
#define SNAPSHOT_PIPE_STALL_MS 30000

/* Export and verification move payloads in chunks of this size: big
 * enough for a syscall's cost to vanish, small enough to stay in L2
 * between the read, the hash and the write. */
#define SNAPSHOT_CHUNK_BYTES (256u << 10)

__attribute__((format(printf, 4, 5)))
static int fail(int rc, char *why, size_t size, const char *format, ...)
{
	va_list args;
	if (why && size) {
		va_start(args, format);
		vsnprintf(why, size, format, args);
		va_end(args);
	}
	return rc;
}

/* ---- hashing ------------------------------------------------------------------ */

typedef void (*hash_update_fn)(XXH3_state_t *state, const void *data, size_t len);

static void hash_update_default(XXH3_state_t *state, const void *data, size_t len)
{
	XXH3_64bits_update(state, data, len);
}

#ifdef SNAPSHOT_HASH_DISPATCH
XXH_TARGET_AVX2 static void hash_update_avx2(XXH3_state_t *state, const void *data, size_t len)
{
	XXH3_update(state, (const xxh_u8 *)data, len, XXH3_accumulate_512_avx2,
		    XXH3_scrambleAcc_avx2);
}

XXH_TARGET_AVX512 static void hash_update_avx512(XXH3_state_t *state, const void *data,
						 size_t len)
{
	XXH3_update(state, (const xxh_u8 *)data, len, XXH3_accumulate_512_avx512,
		    XXH3_scrambleAcc_avx512);
}
#endif

static hash_update_fn hash_update_chosen;
static pthread_once_t hash_once = PTHREAD_ONCE_INIT;

static void hash_choose(void)
{
	hash_update_chosen = hash_update_default;
#ifdef SNAPSHOT_HASH_DISPATCH
	/* The codec checked the CPU and the OS (the registers' state is saved). */
	zc_isa isa = zc_codec_isa();
	if (isa == ZC_ISA_AVX512)
		hash_update_chosen = hash_update_avx512;
	else if (isa == ZC_ISA_AVX2)
		hash_update_chosen = hash_update_avx2;
#endif
}

/* XXH3_64bits_update with the fastest kernel: for payloads and residuals. */
static void hash_update(XXH3_state_t *state, const void *data, size_t len)
{
	pthread_once(&hash_once, hash_choose);
	hash_update_chosen(state, data, len);
}

/* XXH3_64bits: the same value (the streaming form equals the one-shot one). */
static uint64_t hash64(const void *data, size_t len)
{
	if (len <= 4096)
		return XXH3_64bits(data, len);
	XXH3_state_t state;
	XXH3_64bits_reset(&state);
	hash_update(&state, data, len);
	return XXH3_64bits_digest(&state);
}

/* ---- the parts ------------------------------------------------------------- */

void snapshot_config_of(const struct store_header *h, struct snapshot_config *out)
{
	memset(out, 0, sizeof(*out));
	out->layers = h->layers;
	out->batch = h->batch;
	out->kv_heads = h->kv_heads;
	out->head_dim_k = h->head_dim_k;
	out->head_dim_v = h->head_dim_v;
	out->policy = h->policy;
	out->residual_tokens = h->residual_tokens;
	out->hi_bits = h->hi_bits;
	out->lo_bits = h->lo_bits;
	out->group_size = h->group_size;
	out->hi_fraction = h->hi_fraction;
	out->quantize_values = h->quantize_values;
	out->saliency = h->saliency;
	snprintf(out->model_id, sizeof(out->model_id), "%s", h->model_id);
}

/* The config as a codec config. */
static zc_codec_config config_codec(const struct snapshot_config *c)
{
	zc_codec_config codec;
	zc_codec_config_default(&codec);
	codec.hi_bits = c->hi_bits;
	codec.lo_bits = c->lo_bits;
	codec.hi_fraction = c->hi_fraction;
	codec.group_size = c->group_size;
	codec.quantize_values = c->quantize_values != 0;
	codec.saliency = c->saliency > 1 ? -1 : (int)c->saliency;
	return codec;
}

uint64_t snapshot_fingerprint(const struct snapshot_config *config)
{
	/* Hashed as a copy with the padding and the model id's tail zeroed,
	 * so two equal configs always have one fingerprint. */
	struct snapshot_config c;
	memset(&c, 0, sizeof(c));
	c = *config;
	memset(c.pad2, 0, sizeof(c.pad2));
	size_t used = strnlen(config->model_id, sizeof(c.model_id) - 1);
	memset(c.model_id + used, 0, sizeof(c.model_id) - used);
	return XXH3_64bits(&c, sizeof(c));
}

void snapshot_header_encode(const struct snapshot_config *config, uint32_t max_tokens,
			    uint32_t views, uint64_t tokens, uint64_t blocks, uint64_t file_bytes,
			    struct snapshot_header *out)
{
	memset(out, 0, sizeof(*out));
	memcpy(out->magic, SNAPSHOT_MAGIC, sizeof(out->magic));
	out->version = SNAPSHOT_VERSION;
	out->header_bytes = SNAPSHOT_HEADER_BYTES;
	out->config = *config;
	out->fingerprint = snapshot_fingerprint(config);
	out->max_tokens = max_tokens;
	out->views = views;
	out->tokens = tokens;
	out->blocks = blocks;
	out->file_bytes = file_bytes;
	out->checksum = XXH3_64bits(out, offsetof(struct snapshot_header, checksum));
}

int snapshot_header_verify(const struct snapshot_header *h, char *why, size_t size)
{
	const struct snapshot_config *c = &h->config;

	if (memcmp(h->magic, SNAPSHOT_MAGIC, sizeof(h->magic)) != 0)
		return fail(ZC_ECORRUPT, why, size, "not a zipcache snapshot (header magic)");
	if (h->version != SNAPSHOT_VERSION)
		return fail(ZC_ECORRUPT, why, size,
			    "header: snapshot format version %u; this daemon reads version %u", h->version,
			    SNAPSHOT_VERSION);
	if (h->checksum != XXH3_64bits(h, offsetof(struct snapshot_header, checksum)))
		return fail(ZC_ECORRUPT, why, size, "header checksum mismatch (bytes 0..%zu)",
			    sizeof(*h));
	if (h->header_bytes != SNAPSHOT_HEADER_BYTES)
		return fail(ZC_ECORRUPT, why, size, "header says it is %u bytes, not %u",
			    h->header_bytes, SNAPSHOT_HEADER_BYTES);
	if (memchr(c->model_id, '\0', sizeof(c->model_id)) == NULL)
		return fail(ZC_ECORRUPT, why, size, "header: model id not terminated");
	if (h->fingerprint != snapshot_fingerprint(c))
		return fail(ZC_ECORRUPT, why, size, "header: fingerprint does not match its config");
	for (size_t i = 0; i < sizeof(h->reserved) / sizeof(h->reserved[0]); i++)
		if (h->reserved[i])
			return fail(ZC_ECORRUPT, why, size, "header: reserved field %zu is not 0", i);
	/* Sound checksums over a config no session may have: a snapshot
	 * written by something else, refused as the open would refuse it. */
	if (c->layers == 0 || c->layers > ZC_MAX_LAYERS || c->batch == 0 || c->kv_heads == 0 ||
	    c->head_dim_k == 0 || c->head_dim_k > ZC_MAX_HEAD_DIM || c->head_dim_v == 0 ||
	    c->head_dim_v > ZC_MAX_HEAD_DIM || (uint64_t)c->batch * c->kv_heads > ZC_MAX_HEADS)
		return fail(ZC_EINVALID, why, size,
			    "bad config: shape layers %u batch %u kv_heads %u head_dim_k %u "
			    "head_dim_v %u is outside the limits", c->layers, c->batch, c->kv_heads,
			    c->head_dim_k, c->head_dim_v);
	if (h->max_tokens == 0 || h->max_tokens > ZC_MAX_BLOCK_TOKENS)
		return fail(ZC_EINVALID, why, size, "bad config: max_tokens %u", h->max_tokens);
	if (c->policy > STORE_POLICY_PER_CALL ||
	    (c->policy == STORE_POLICY_STREAMING &&
	     (c->residual_tokens == 0 || c->residual_tokens > ZC_MAX_RESIDUAL_TOKENS)) ||
	    (c->policy == STORE_POLICY_PER_CALL && c->residual_tokens != 0))
		return fail(ZC_EINVALID, why, size, "bad config: policy %u with residual_tokens %u",
			    c->policy, c->residual_tokens);
	if (h->views != ZC_VIEWS_FULL && h->views != ZC_VIEWS_NONE)
		return fail(ZC_EINVALID, why, size, "bad config: views %u", h->views);
	zc_codec_config codec = config_codec(c);
	if (c->quantize_values > 1 || zc_codec_config_validate(&codec) < 0)
		return fail(ZC_EINVALID, why, size,
			    "bad config: codec hi_bits %d lo_bits %d hi_fraction %g group_size %d "
			    "saliency %u", c->hi_bits, c->lo_bits, c->hi_fraction, c->group_size,
			    c->saliency);
	if (h->tokens > (uint64_t)c->layers * h->max_tokens || h->blocks > h->tokens)
		return fail(ZC_ECORRUPT, why, size,
			    "header: %llu tokens and %llu blocks do not fit %u layers of %u tokens",
			    (unsigned long long)h->tokens, (unsigned long long)h->blocks, c->layers,
			    h->max_tokens);
	return 0;
}

void snapshot_payload_bytes(const struct snapshot_config *config, uint32_t tokens,
			    uint64_t *key_bytes, uint64_t *value_bytes)
{
	zc_codec_config codec = config_codec(config);
	zc_block_shape key_shape = { config->batch, config->kv_heads, tokens, config->head_dim_k };
	zc_block_shape value_shape = { config->batch, config->kv_heads, tokens, config->head_dim_v };
	zc_byte_count key = { 0 }, value = { 0 };
	zc_block_count_bytes(&codec, ZC_TENSOR_KEYS, &key_shape, &key);
	zc_block_count_bytes(&codec, ZC_TENSOR_VALUES, &value_shape, &value);
	*key_bytes = key.compressed;
	*value_bytes = value.compressed;
}

/* The record header alone (the payload checksum is written after the payloads). */
static void block_header_encode(uint64_t fingerprint, uint32_t layer, uint32_t index,
				const store_block *entry, struct snapshot_block *out)
{
	memset(out, 0, sizeof(*out));
	memcpy(out->magic, SNAPSHOT_BLOCK_MAGIC, sizeof(out->magic));
	out->fingerprint = fingerprint;
	out->layer = layer;
	out->index = index;
	out->first_token = entry->first_token;
	out->tokens = entry->tokens;
	out->valid_tokens = entry->valid_tokens;
	out->key_bytes = entry->key_bytes;
	out->value_bytes = entry->value_bytes;
	out->checksum = XXH3_64bits(out, offsetof(struct snapshot_block, checksum));
}

void snapshot_block_encode(uint64_t fingerprint, uint32_t layer, uint32_t index,
			   const store_block *entry, const void *key, const void *value,
			   uint8_t *record)
{
	struct snapshot_block h;
	block_header_encode(fingerprint, layer, index, entry, &h);
	memcpy(record, &h, sizeof(h));
	memcpy(record + SNAPSHOT_BLOCK_BYTES, key, entry->key_bytes);
	memcpy(record + SNAPSHOT_BLOCK_BYTES + entry->key_bytes, value, entry->value_bytes);
	XXH3_state_t state;
	XXH3_64bits_reset(&state);
	hash_update(&state, key, entry->key_bytes);
	hash_update(&state, value, entry->value_bytes);
	uint64_t sum = XXH3_64bits_digest(&state);
	memcpy(record + SNAPSHOT_BLOCK_BYTES + entry->key_bytes + entry->value_bytes, &sum,
	       sizeof(sum));
}

/* A block record's header on its own: everything but the payload's hash. */
static int block_header_check(const struct snapshot_header *h, uint32_t layer, uint32_t index,
			      const struct snapshot_block *b, char *why, size_t size)
{
	if (memcmp(b->magic, SNAPSHOT_BLOCK_MAGIC, sizeof(b->magic)) != 0)
		return fail(ZC_ECORRUPT, why, size, "layer %u block %u: no block magic", layer, index);
	if (b->checksum != XXH3_64bits(b, offsetof(struct snapshot_block, checksum)))
		return fail(ZC_ECORRUPT, why, size, "layer %u block %u: record header checksum mismatch",
			    layer, index);
	if (b->fingerprint != h->fingerprint)
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u block %u: the record is of another config (fingerprint "
			    "%016llx, the snapshot's is %016llx)", layer, index,
			    (unsigned long long)b->fingerprint, (unsigned long long)h->fingerprint);
	if (b->layer != layer || b->index != index)
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u block %u: the record says it is layer %u block %u", layer, index,
			    b->layer, b->index);
	if (b->tokens == 0 || b->tokens > h->max_tokens || b->valid_tokens == 0 ||
	    b->valid_tokens > b->tokens || b->flags != 0 || b->first_token >= h->max_tokens)
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u block %u: counts out of range (first_token %u, tokens %u, "
			    "valid_tokens %u, flags %u)", layer, index, b->first_token, b->tokens,
			    b->valid_tokens, b->flags);
	uint64_t key_bytes, value_bytes;
	snapshot_payload_bytes(&h->config, b->tokens, &key_bytes, &value_bytes);
	if (b->key_bytes != key_bytes || b->value_bytes != value_bytes)
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u block %u: payloads of %llu and %llu bytes; %u tokens of this "
			    "config take %llu and %llu", layer, index,
			    (unsigned long long)b->key_bytes, (unsigned long long)b->value_bytes,
			    b->tokens, (unsigned long long)key_bytes, (unsigned long long)value_bytes);
	return 0;
}

static void entry_of(const struct snapshot_block *b, store_block *entry)
{
	*entry = (store_block){
		.first_token = b->first_token,
		.tokens = b->tokens,
		.valid_tokens = b->valid_tokens,
		.key_bytes = b->key_bytes,
		.value_bytes = b->value_bytes,
	};
}

int snapshot_block_verify(const struct snapshot_header *h, uint32_t layer, uint32_t index,
			  const void *record, uint64_t len, store_block *entry, char *why,
			  size_t size)
{
	struct snapshot_block b;
	if (len < SNAPSHOT_BLOCK_BYTES)
		return fail(ZC_ECORRUPT, why, size, "layer %u block %u: truncated record header", layer,
			    index);
	memcpy(&b, record, sizeof(b));
	int rc = block_header_check(h, layer, index, &b, why, size);
	if (rc < 0)
		return rc;
	if (len != snapshot_record_bytes(b.key_bytes, b.value_bytes))
		return fail(ZC_ECORRUPT, why, size, "layer %u block %u: record is %llu bytes, not %llu",
			    layer, index, (unsigned long long)len,
			    (unsigned long long)snapshot_record_bytes(b.key_bytes, b.value_bytes));
	uint64_t sum;
	memcpy(&sum, (const uint8_t *)record + SNAPSHOT_BLOCK_BYTES + b.key_bytes + b.value_bytes,
	       sizeof(sum));
	if (hash64((const uint8_t *)record + SNAPSHOT_BLOCK_BYTES, b.key_bytes + b.value_bytes) != sum)
		return fail(ZC_ECORRUPT, why, size, "layer %u block %u: payload checksum mismatch", layer,
			    index);
	entry_of(&b, entry);
	return 0;
}

/* ---- the layout of a whole file ------------------------------------------------ */

static uint64_t table_bytes(uint32_t layers)
{
	return (uint64_t)layers * SNAPSHOT_LAYER_BYTES + sizeof(uint64_t);
}

static uint64_t residual_row_bytes(const struct snapshot_config *c)
{
	return (uint64_t)c->batch * c->kv_heads * (c->head_dim_k + c->head_dim_v) * 2;
}

/*
 * The tiling rule of zipcache/map.h for block `index` of a layer, given
 * the block before it: block 0 starts at token 0, each later one after
 * the one before, which then holds at least one and at most its
 * valid_tokens rows. `end` (for the last block) is where the residual
 * begins.
 */
static int tiling_check(uint32_t layer, uint32_t index, const struct snapshot_block *prev,
			const struct snapshot_block *b, char *why, size_t size)
{
	if (index == 0 && b->first_token != 0)
		return fail(ZC_ECORRUPT, why, size, "layer %u block 0 starts at token %u, not 0", layer,
			    b->first_token);
	if (index > 0 && (b->first_token <= prev->first_token ||
			  b->first_token - prev->first_token > prev->valid_tokens))
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u block %u starts at token %u; block %u starts at %u with %u "
			    "valid tokens", layer, index, b->first_token, index - 1, prev->first_token,
			    prev->valid_tokens);
	return 0;
}

static int last_block_check(uint32_t layer, const struct snapshot_layer *l,
			    const struct snapshot_block *last, char *why, size_t size)
{
	uint32_t end = l->tokens - l->residual_tokens;
	if (l->blocks == 0)
		return end == 0 ? 0 :
		       fail(ZC_ECORRUPT, why, size,
			    "layer %u: %u tokens before the residual but no blocks", layer, end);
	if (end <= last->first_token || end - last->first_token > last->valid_tokens)
		return fail(ZC_ECORRUPT, why, size,
			    "layer %u: its blocks end at token %u, its last block starts at %u with %u "
			    "valid tokens", layer, end, last->first_token, last->valid_tokens);
	return 0;
}

/* ---- I/O ------------------------------------------------------------------------ */

/* Reads exactly n bytes at offset; a short file is a truncated snapshot. */
static int read_at(int fd, uint64_t offset, void *buf, uint64_t n, const char *what, char *why,
		   size_t size)
{
	uint8_t *p = buf;
	while (n > 0) {
		ssize_t got = pread(fd, p, n > SSIZE_MAX ? SSIZE_MAX : (size_t)n, (off_t)offset);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0)
			return fail(-errno, why, size, "cannot read the snapshot (%s): %s", what,
				    strerror(errno));
		if (got == 0)
			return fail(ZC_ECORRUPT, why, size, "truncated in %s (at byte %llu)", what,
				    (unsigned long long)offset);
		p += got;
		n -= (uint64_t)got;
		offset += (uint64_t)got;
	}
	return 0;
}

/* Writes all n bytes. To a pipe, never more than it has room for, so the
 * write cannot block; a reader that stops reading for
 * SNAPSHOT_PIPE_STALL_MS fails the export. */
static int write_all(int fd, bool pipe, const void *buf, uint64_t n)
{
	const uint8_t *p = buf;
	while (n > 0) {
		size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
		if (pipe) {
			struct pollfd poller = { .fd = fd, .events = POLLOUT };
			int ready = poll(&poller, 1, SNAPSHOT_PIPE_STALL_MS);
			if (ready < 0 && errno == EINTR)
				continue;
			if (ready < 0)
				return -errno;
			if (ready == 0)
				return -ETIMEDOUT;
			if (poller.revents & (POLLERR | POLLHUP))
				return -EPIPE;
			int capacity = fcntl(fd, F_GETPIPE_SZ);
			int queued = 0;
			if (capacity <= 0 || ioctl(fd, FIONREAD, &queued) < 0)
				capacity = PIPE_BUF, queued = 0;
			size_t room = capacity > queued ? (size_t)(capacity - queued) : PIPE_BUF;
			if (chunk > room)
				chunk = room;
		}
		ssize_t put = write(fd, p, chunk);
		if (put < 0 && (errno == EINTR || (pipe && errno == EAGAIN)))
			continue;
		if (put < 0)
			return -errno;
		if (put == 0)
			return -EIO;
		p += put;
		n -= (uint64_t)put;
	}
	return 0;
}

/* ---- export ------------------------------------------------------------------------ */

/*
 * A layer's residual as the file has it: compact rows, [batch][kv_heads]
 * [rows][dim] of K, then of V. In the store each head's rows are
 * contiguous (the residual's capacity apart), so the file's bytes are
 * 2 x heads segments taken in order: hashed and written segment by
 * segment, never packed into a copy first.
 */
struct residual_segment {
	const void *bytes;
	size_t len;
};

static struct residual_segment residual_segment(const struct store_cut *cut, uint32_t heads,
						uint32_t head_dim_k, uint32_t head_dim_v,
						uint32_t index)
{
	bool value = index >= heads;
	uint32_t head = value ? index - heads : index, dim = value ? head_dim_v : head_dim_k;
	const uint16_t *rows = value ? cut->value_residual : cut->key_residual;
	return (struct residual_segment){ rows + (size_t)head * cut->residual_capacity * dim,
					  (size_t)cut->residual_tokens * dim * 2 };
}

static uint64_t residual_hash(const struct store_cut *cut, uint32_t heads, uint32_t head_dim_k,
			      uint32_t head_dim_v)
{
	XXH3_state_t state;
	XXH3_64bits_reset(&state);
	for (uint32_t i = 0; cut->residual_tokens && i < 2 * heads; i++) {
		struct residual_segment seg = residual_segment(cut, heads, head_dim_k, head_dim_v, i);
		hash_update(&state, seg.bytes, seg.len);
	}
	return XXH3_64bits_digest(&state);
}

static int buffer_fit(uint8_t **buf, uint64_t *capacity, uint64_t bytes)
{
	if (bytes <= *capacity)
		return 0;
	uint8_t *grown = realloc(*buf, bytes);
	if (!grown)
		return -ENOMEM;
	*buf = grown;
	*capacity = bytes;
	return 0;
}

/*
 * Two chunk-sized buffers in front of the descriptor, and a thread of
 * the export's own that writes one while the export fills the other:
 * block bytes are read from the pool into a buffer and hashed there while
 * in cache, and the kernel's copy into the destination (the larger cost,
 * BENCHMARKS.md) overlaps the next read. Without the thread (it could not
 * be made) every flush writes in line.
 */
struct writer {
	int fd;
	bool pipe;
	bool positional;           /* pwrite at `at` (a parallel export's worker) */
	uint64_t at;
	uint8_t *bufs[2];
	uint8_t *buf;              /* the one being filled */
	size_t used;
	bool threaded;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	const uint8_t *pending;    /* handed to the thread, not yet written */
	size_t pending_len;
	bool stop;
	int rc;                    /* the thread's first failure */
};

static void *writer_thread(void *arg)
{
	struct writer *w = arg;
	pthread_mutex_lock(&w->lock);
	for (;;) {
		while (!w->pending && !w->stop)
			pthread_cond_wait(&w->cond, &w->lock);
		if (!w->pending)
			break;
		const uint8_t *p = w->pending;
		size_t n = w->pending_len;
		pthread_mutex_unlock(&w->lock);
		int rc = write_all(w->fd, w->pipe, p, n);
		pthread_mutex_lock(&w->lock);
		if (rc < 0 && w->rc == 0)
			w->rc = rc;
		w->pending = NULL;
		pthread_cond_broadcast(&w->cond);
	}
	pthread_mutex_unlock(&w->lock);
	return NULL;
}

/* positional: one buffer, no thread, each flush a pwrite at w->at. */
static int writer_open(struct writer *w, int fd, bool pipe, bool positional)
{
	*w = (struct writer){ .fd = fd, .pipe = pipe, .positional = positional };
	w->bufs[0] = malloc(SNAPSHOT_CHUNK_BYTES);
	w->bufs[1] = positional ? NULL : malloc(SNAPSHOT_CHUNK_BYTES);
	if (!w->bufs[0] || (!positional && !w->bufs[1]))
		return -ENOMEM;
	w->buf = w->bufs[0];
	if (positional)
		return 0;
	/* On one CPU (the daemon pinned to it) the thread could overlap
	 * nothing: each buffer would only cost two switches. */
	if (resources_cpus() < 2)
		return 0;
	if (pthread_mutex_init(&w->lock, NULL) == 0) {
		if (pthread_cond_init(&w->cond, NULL) == 0) {
			w->threaded = pthread_create(&w->thread, NULL, writer_thread, w) == 0;
			if (!w->threaded)
				pthread_cond_destroy(&w->cond);
		}
		if (!w->threaded)
			pthread_mutex_destroy(&w->lock);
	}
	return 0;
}

/* Hands the filled buffer over (or writes it), once the other is written. */
static int writer_flush(struct writer *w)
{
	if (!w->threaded) {
		int rc = w->positional ? fd_pwrite_all(w->fd, w->buf, w->used, w->at) :
					 write_all(w->fd, w->pipe, w->buf, w->used);
		w->at += w->used;
		w->used = 0;
		return rc;
	}
	pthread_mutex_lock(&w->lock);
	while (w->pending && w->rc == 0)
		pthread_cond_wait(&w->cond, &w->lock);
	int rc = w->rc;
	if (rc == 0 && w->used) {
		w->pending = w->buf;
		w->pending_len = w->used;
		pthread_cond_broadcast(&w->cond);
		w->buf = w->buf == w->bufs[0] ? w->bufs[1] : w->bufs[0];
	}
	pthread_mutex_unlock(&w->lock);
	w->used = 0;
	return rc;
}

/* Everything written (or the first failure); the thread is gone after. */
static int writer_close(struct writer *w, bool finish)
{
	int rc = finish ? writer_flush(w) : 0;
	if (w->threaded) {
		pthread_mutex_lock(&w->lock);
		while (w->pending && w->rc == 0)
			pthread_cond_wait(&w->cond, &w->lock);
		if (rc == 0)
			rc = w->rc;
		w->stop = true;
		w->pending = NULL;   /* after a failure nothing more is written */
		pthread_cond_broadcast(&w->cond);
		pthread_mutex_unlock(&w->lock);
		pthread_join(w->thread, NULL);
		pthread_cond_destroy(&w->cond);
		pthread_mutex_destroy(&w->lock);
		w->threaded = false;
	}
	free(w->bufs[0]);
	free(w->bufs[1]);
	w->bufs[0] = w->bufs[1] = w->buf = NULL;
	return rc;
}

static int writer_put(struct writer *w, const void *data, uint64_t n)
{
	const uint8_t *p = data;
	while (n > 0) {
		size_t take = SNAPSHOT_CHUNK_BYTES - w->used;
		if (take > n)
			take = (size_t)n;
		memcpy(w->buf + w->used, p, take);
		w->used += take;
		p += take;
		n -= take;
		if (w->used == SNAPSHOT_CHUNK_BYTES) {
			int rc = writer_flush(w);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

static int writer_from_pool(struct writer *w, struct pool *pool, uint64_t offset, uint64_t n,
			    XXH3_state_t *hash)
{
	while (n > 0) {
		size_t take = SNAPSHOT_CHUNK_BYTES - w->used;
		if (take > n)
			take = (size_t)n;
		int rc = pool_read(pool, offset, w->buf + w->used, take);
		if (rc < 0)
			return rc;
		hash_update(hash, w->buf + w->used, take);
		w->used += take;
		offset += take;
		n -= take;
		if (w->used == SNAPSHOT_CHUNK_BYTES) {
			rc = writer_flush(w);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

/*
 * Export to a regular file, in parallel: with a second CPU, two threads
 * (the export's and one of its own) each take the next piece of the file
 * (a block record or a layer's residual: their offsets are the layout's)
 * and read it from the pool, hash it and pwrite it at its place, each
 * through a buffer of its own that stays in its core's cache. Both the
 * pool's pages and the destination's are the kernel's to copy, so one
 * thread spends about as long on each copy as a memcpy of the bytes
 * (BENCHMARKS.md): two share that. The header and table go first, the
 * trailer last, once the whole-file checksum is folded in file order from
 * the pieces' own checksums. A pipe, an O_APPEND file, one CPU or a small
 * snapshot take the sequential path, as does the offload (in order).
 */
#define SNAPSHOT_EXPORT_WORKERS 2
#define SNAPSHOT_PARALLEL_MIN_BYTES (UINT64_C(4) << 20)

struct export_item {
	uint32_t layer, block;        /* block UINT32_MAX: the layer's residual */
	uint64_t at;                  /* from the snapshot's first byte */
	uint64_t record_checksum;     /* the record header's */
	uint64_t sum;                 /* the payloads', once written */
};

struct export_work {
	struct store *store;
	int fd;
	uint64_t base, fingerprint;
	uint32_t heads, head_dim_k, head_dim_v;
	struct export_item *items;
	size_t count;
	size_t next;                  /* atomic: the next item to take */
	bool stop;                    /* atomic: a worker failed */
	pthread_mutex_t lock;         /* over the first failure: */
	int rc;
	const struct export_item *failed;
};

/* Whether fd takes pwrite at offsets from its current one (*base). */
static bool export_positional(int fd, uint64_t *base)
{
	struct stat st;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
		return false;
	int flags = fcntl(fd, F_GETFL);
	if (flags < 0 || (flags & O_APPEND))
		return false;
	if (resources_cpus() < 2)
		return false;
	off_t at = lseek(fd, 0, SEEK_CUR);
	if (at < 0)
		return false;
	*base = (uint64_t)at;
	return true;
}

static int export_item_write(struct export_work *x, struct writer *w, struct export_item *it)
{
	struct store_cut cut;
	store_layer_cut(x->store, it->layer, &cut);
	w->at = x->base + it->at;
	if (it->block == UINT32_MAX) {
		for (uint32_t k = 0; cut.residual_tokens && k < 2 * x->heads; k++) {
			struct residual_segment seg = residual_segment(&cut, x->heads, x->head_dim_k,
								       x->head_dim_v, k);
			int rc = writer_put(w, seg.bytes, seg.len);
			if (rc < 0)
				return rc;
		}
		return writer_flush(w);
	}
	const store_block *e = &cut.entries[it->block];
	struct snapshot_block h;
	XXH3_state_t payload;
	block_header_encode(x->fingerprint, it->layer, it->block, e, &h);
	XXH3_64bits_reset(&payload);
	int rc = writer_put(w, &h, sizeof(h));
	if (rc == 0)
		rc = writer_from_pool(w, store_pool(x->store), e->key_offset, e->key_bytes, &payload);
	if (rc == 0)
		rc = writer_from_pool(w, store_pool(x->store), e->value_offset, e->value_bytes, &payload);
	if (rc < 0)
		return rc;
	it->sum = XXH3_64bits_digest(&payload);
	rc = writer_put(w, &it->sum, sizeof(it->sum));
	return rc < 0 ? rc : writer_flush(w);
}

static void export_failed(struct export_work *x, int rc, const struct export_item *it)
{
	pthread_mutex_lock(&x->lock);
	if (x->rc == 0) {
		x->rc = rc;
		x->failed = it;
	}
	pthread_mutex_unlock(&x->lock);
	__atomic_store_n(&x->stop, true, __ATOMIC_RELEASE);
}

static void *export_worker(void *arg)
{
	struct export_work *x = arg;
	struct writer w;
	int rc = writer_open(&w, x->fd, false, true);
	if (rc < 0)
		export_failed(x, rc, NULL);
	while (rc == 0 && !__atomic_load_n(&x->stop, __ATOMIC_ACQUIRE)) {
		size_t i = __atomic_fetch_add(&x->next, 1, __ATOMIC_RELAXED);
		if (i >= x->count)
			break;
		rc = export_item_write(x, &w, &x->items[i]);
		if (rc < 0)
			export_failed(x, rc, &x->items[i]);
	}
	writer_close(&w, false);
	return NULL;
}

/* The pieces after the header and table, in file order. */
static struct export_item *export_items(struct store *store, uint64_t fingerprint,
					const struct snapshot_layer *table, uint32_t layers,
					uint64_t blocks, size_t *count)
{
	struct export_item *items = calloc((size_t)blocks + layers, sizeof(*items));
	size_t n = 0;
	if (!items)
		return NULL;
	for (uint32_t i = 0; i < layers; i++) {
		struct store_cut cut;
		store_layer_cut(store, i, &cut);
		uint64_t at = table[i].offset;
		for (uint32_t b = 0; b < cut.blocks; b++) {
			struct snapshot_block h;
			block_header_encode(fingerprint, i, b, &cut.entries[b], &h);
			items[n++] = (struct export_item){ .layer = i, .block = b, .at = at,
							   .record_checksum = h.checksum };
			at += snapshot_record_bytes(cut.entries[b].key_bytes, cut.entries[b].value_bytes);
		}
		items[n++] = (struct export_item){ .layer = i, .block = UINT32_MAX, .at = at };
	}
	*count = n;
	return items;
}

static int export_parallel(struct store *store, int fd, uint64_t base, uint64_t fingerprint,
			   const struct snapshot_header *header, const struct snapshot_layer *table,
			   uint64_t table_checksum, char *why, size_t size)
{
	const struct store_header *sh = store_header(store);
	uint32_t layers = sh->layers;
	struct export_work x = {
		.store = store, .fd = fd, .base = base, .fingerprint = fingerprint,
		.heads = sh->batch * sh->kv_heads, .head_dim_k = sh->head_dim_k,
		.head_dim_v = sh->head_dim_v,
	};
	pthread_t helpers[SNAPSHOT_EXPORT_WORKERS - 1];
	int started = 0;

	x.items = export_items(store, fingerprint, table, layers, header->blocks, &x.count);
	if (!x.items || pthread_mutex_init(&x.lock, NULL) != 0) {
		free(x.items);
		return fail(-ENOMEM, why, size, "out of memory");
	}
	/* The header and the table with its checksum, at the start. */
	int rc = fd_pwrite_all(fd, header, sizeof(*header), base);
	if (rc == 0)
		rc = fd_pwrite_all(fd, table, (uint64_t)layers * SNAPSHOT_LAYER_BYTES,
				base + sizeof(*header));
	if (rc == 0)
		rc = fd_pwrite_all(fd, &table_checksum, sizeof(table_checksum),
				base + sizeof(*header) + (uint64_t)layers * SNAPSHOT_LAYER_BYTES);
	if (rc < 0) {
		x.rc = rc;
	} else {
		for (int i = 0; i < SNAPSHOT_EXPORT_WORKERS - 1; i++)
			if (pthread_create(&helpers[started], NULL, export_worker, &x) == 0)
				started++;
		export_worker(&x);
		for (int i = 0; i < started; i++)
			pthread_join(helpers[i], NULL);
	}
	pthread_mutex_destroy(&x.lock);
	rc = x.rc;
	if (rc == ZC_ECORRUPT && x.failed)
		rc = fail(rc, why, size, "cannot read layer %u block %u from the pool: %s",
			  x.failed->layer, x.failed->block, zc_strerror(rc));
	else if (rc < 0)
		rc = fail(rc, why, size, "cannot write the snapshot: %s", strerror(-rc));
	if (rc == 0) {
		/* The whole-file checksum, in file order, then the trailer. */
		XXH3_state_t whole;
		XXH3_64bits_reset(&whole);
		XXH3_64bits_update(&whole, header, sizeof(*header));
		XXH3_64bits_update(&whole, table, (size_t)layers * SNAPSHOT_LAYER_BYTES);
		XXH3_64bits_update(&whole, &table_checksum, sizeof(table_checksum));
		for (size_t i = 0; i < x.count; i++) {
			const struct export_item *it = &x.items[i];
			if (it->block == UINT32_MAX) {
				XXH3_64bits_update(&whole, &table[it->layer].residual_checksum,
						   sizeof(uint64_t));
				continue;
			}
			XXH3_64bits_update(&whole, &it->record_checksum, sizeof(it->record_checksum));
			XXH3_64bits_update(&whole, &it->sum, sizeof(it->sum));
		}
		struct snapshot_trailer trailer = { .file_bytes = header->file_bytes };
		memcpy(trailer.magic, SNAPSHOT_TRAILER_MAGIC, sizeof(trailer.magic));
		trailer.checksum = XXH3_64bits_digest(&whole);
		rc = fd_pwrite_all(fd, &trailer, sizeof(trailer),
				base + header->file_bytes - SNAPSHOT_TRAILER_BYTES);
		/* Where sequential writes would have left the offset. */
		if (rc == 0 && lseek(fd, (off_t)(base + header->file_bytes), SEEK_SET) < 0)
			rc = -errno;
		if (rc < 0)
			rc = fail(rc, why, size, "cannot write the snapshot: %s", strerror(-rc));
	}
	free(x.items);
	return rc;
}

static int export_run(struct store *store, int fd, bool pipe, bool in_order,
		      struct snapshot_result *result, char *why, size_t size)
{
	struct writer w = { .buf = NULL };
	bool writer_made = false;
	const struct store_header *sh = store_header(store);
	struct snapshot_config config;
	struct snapshot_header header;
	uint32_t layers = sh->layers;
	uint32_t heads = sh->batch * sh->kv_heads;
	int rc;

	snapshot_config_of(sh, &config);
	uint64_t fingerprint = snapshot_fingerprint(&config);
	struct snapshot_layer *table = calloc(layers, sizeof(*table));
	if (!table)
		return fail(-ENOMEM, why, size, "out of memory");

	/* The layout first: the table says where every layer lies. */
	uint64_t offset = SNAPSHOT_HEADER_BYTES + table_bytes(layers), tokens = 0, blocks = 0;
	for (uint32_t i = 0; i < layers; i++) {
		struct store_cut cut;
		store_layer_cut(store, i, &cut);
		table[i] = (struct snapshot_layer){
			.tokens = cut.tokens, .residual_tokens = cut.residual_tokens,
			.blocks = cut.blocks, .offset = offset,
		};
		for (uint32_t b = 0; b < cut.blocks; b++)
			table[i].bytes += snapshot_record_bytes(cut.entries[b].key_bytes,
								cut.entries[b].value_bytes);
		table[i].bytes += (uint64_t)cut.residual_tokens * residual_row_bytes(&config);
		offset += table[i].bytes;
		tokens += cut.tokens;
		blocks += cut.blocks;
	}
	uint64_t file_bytes = offset + SNAPSHOT_TRAILER_BYTES;

	/* Residual checksums go in the table, ahead of the rows: one pass
	 * over the (small) residuals now. */
	for (uint32_t i = 0; i < layers; i++) {
		struct store_cut cut;
		store_layer_cut(store, i, &cut);
		table[i].residual_checksum = residual_hash(&cut, heads, sh->head_dim_k, sh->head_dim_v);
	}

	XXH3_state_t whole;
	XXH3_64bits_reset(&whole);
	snapshot_header_encode(&config, sh->max_tokens, sh->views, tokens, blocks, file_bytes, &header);
	uint64_t table_checksum = XXH3_64bits(table, (size_t)layers * SNAPSHOT_LAYER_BYTES);
	XXH3_64bits_update(&whole, &header, sizeof(header));
	XXH3_64bits_update(&whole, table, (size_t)layers * SNAPSHOT_LAYER_BYTES);
	XXH3_64bits_update(&whole, &table_checksum, sizeof(table_checksum));

	uint64_t base;
	if (!pipe && !in_order && blocks >= 2 && file_bytes >= SNAPSHOT_PARALLEL_MIN_BYTES &&
	    export_positional(fd, &base)) {
		rc = export_parallel(store, fd, base, fingerprint, &header, table, table_checksum, why,
				     size);
		if (rc == 0)
			*result = (struct snapshot_result){ file_bytes, fingerprint, tokens };
		goto out;
	}

	writer_made = true;
	if (writer_open(&w, fd, pipe, false) < 0)
		goto out_nomem;
	rc = writer_put(&w, &header, sizeof(header));
	if (rc == 0)
		rc = writer_put(&w, table, (size_t)layers * SNAPSHOT_LAYER_BYTES);
	if (rc == 0)
		rc = writer_put(&w, &table_checksum, sizeof(table_checksum));
	if (rc < 0)
		goto out_write;
	for (uint32_t i = 0; i < layers; i++) {
		struct store_cut cut;
		store_layer_cut(store, i, &cut);
		for (uint32_t b = 0; b < cut.blocks; b++) {
			const store_block *e = &cut.entries[b];
			struct snapshot_block h;
			XXH3_state_t payload;
			block_header_encode(fingerprint, i, b, e, &h);
			XXH3_64bits_reset(&payload);
			rc = writer_put(&w, &h, sizeof(h));
			if (rc == 0)
				rc = writer_from_pool(&w, store_pool(store), e->key_offset, e->key_bytes,
						      &payload);
			if (rc == 0)
				rc = writer_from_pool(&w, store_pool(store), e->value_offset,
						      e->value_bytes, &payload);
			if (rc == ZC_ECORRUPT) {
				rc = fail(rc, why, size, "cannot read layer %u block %u from the pool: %s",
					  i, b, zc_strerror(rc));
				goto out;
			}
			uint64_t sum = XXH3_64bits_digest(&payload);
			if (rc == 0)
				rc = writer_put(&w, &sum, sizeof(sum));
			if (rc < 0)
				goto out_write;
			XXH3_64bits_update(&whole, &h.checksum, sizeof(h.checksum));
			XXH3_64bits_update(&whole, &sum, sizeof(sum));
		}
		for (uint32_t k = 0; cut.residual_tokens && k < 2 * heads; k++) {
			struct residual_segment seg = residual_segment(&cut, heads, sh->head_dim_k,
								       sh->head_dim_v, k);
			rc = writer_put(&w, seg.bytes, seg.len);
			if (rc < 0)
				goto out_write;
		}
		XXH3_64bits_update(&whole, &table[i].residual_checksum, sizeof(uint64_t));
	}
	struct snapshot_trailer trailer = { .file_bytes = file_bytes };
	memcpy(trailer.magic, SNAPSHOT_TRAILER_MAGIC, sizeof(trailer.magic));
	trailer.checksum = XXH3_64bits_digest(&whole);
	rc = writer_put(&w, &trailer, sizeof(trailer));
	if (rc == 0)
		rc = writer_close(&w, true);
	writer_made = false;
	if (rc < 0)
		goto out_write;
	*result = (struct snapshot_result){ file_bytes, fingerprint, tokens };
	rc = 0;
	goto out;

out_nomem:
	rc = fail(-ENOMEM, why, size, "out of memory");
	goto out;
out_write:
	rc = fail(rc, why, size, "cannot write the snapshot: %s",
		  rc == -ETIMEDOUT ? "the pipe's reader stopped reading" : strerror(-rc));
out:
	if (writer_made)
		writer_close(&w, false);
	free(table);
	return rc;
}

int snapshot_export(struct store *store, int fd, bool pipe, struct snapshot_result *result,
		    char *why, size_t size)
{
	return export_run(store, fd, pipe, false, result, why, size);
}

int snapshot_export_in_order(struct store *store, int fd, struct snapshot_result *result,
			     char *why, size_t size)
{
	return export_run(store, fd, false, true, result, why, size);
}

/* ---- verify (import's first pass) ------------------------------------------------- */

/* Every count of the layer table against the others and the layout of
 * a file_bytes snapshot (both passes, and a restore's parts). */
static int table_check(const struct snapshot_header *h, const struct snapshot_layer *table,
		       uint64_t file_bytes, char *why, size_t size)
{
	uint32_t layers = h->config.layers;
	uint32_t capacity = store_residual_capacity(h->config.residual_tokens, h->max_tokens);
	uint64_t offset = SNAPSHOT_HEADER_BYTES + table_bytes(layers), tokens = 0, blocks = 0;
	for (uint32_t i = 0; i < layers; i++) {
		const struct snapshot_layer *l = &table[i];
		const char *bad = NULL;
		if (l->tokens > h->max_tokens)
			bad = "more tokens than max_tokens";
		else if (l->residual_tokens > l->tokens || l->residual_tokens > capacity)
			bad = "residual larger than its tokens or the residual's capacity";
		else if (l->blocks > l->tokens - l->residual_tokens)
			bad = "more blocks than tokens before the residual";
		else if (l->pad)
			bad = "padding not 0";
		else if (l->offset != offset)
			bad = "does not start where the layer before it ends";
		else if (l->bytes > file_bytes - offset ||
			 l->bytes < (uint64_t)l->blocks * snapshot_record_bytes(0, 0) +
					    (uint64_t)l->residual_tokens * residual_row_bytes(&h->config))
			bad = "byte count does not fit its blocks and residual in the file";
		if (bad) {
			return fail(ZC_ECORRUPT, why, size,
				    "inconsistent counts: layer %u (%u tokens, %u residual, %u blocks, "
				    "%llu bytes at %llu): %s", i, l->tokens, l->residual_tokens, l->blocks,
				    (unsigned long long)l->bytes, (unsigned long long)l->offset, bad);
		}
		offset += l->bytes;
		tokens += l->tokens;
		blocks += l->blocks;
	}
	if (offset + SNAPSHOT_TRAILER_BYTES != file_bytes || tokens != h->tokens ||
	    blocks != h->blocks) {
		return fail(ZC_ECORRUPT, why, size,
			    "inconsistent counts: the layers hold %llu tokens, %llu blocks and end at "
			    "byte %llu; the header says %llu tokens, %llu blocks, %llu bytes",
			    (unsigned long long)tokens, (unsigned long long)blocks,
			    (unsigned long long)(offset + SNAPSHOT_TRAILER_BYTES),
			    (unsigned long long)h->tokens, (unsigned long long)h->blocks,
			    (unsigned long long)file_bytes);
	}
	return 0;
}

/* Reads and checks the header and the layer table (both passes). */
static int head_read(int fd, uint64_t file_bytes, struct snapshot_header *h,
		     struct snapshot_layer **table_out, uint64_t *table_checksum, char *why,
		     size_t size)
{
	if (file_bytes < SNAPSHOT_HEADER_BYTES)
		return fail(ZC_ECORRUPT, why, size,
			    "truncated: %llu bytes, shorter than the %u-byte header",
			    (unsigned long long)file_bytes, SNAPSHOT_HEADER_BYTES);
	int rc = read_at(fd, 0, h, sizeof(*h), "the header", why, size);
	if (rc < 0)
		return rc;
	rc = snapshot_header_verify(h, why, size);
	if (rc < 0)
		return rc;
	if (h->file_bytes != file_bytes)
		return fail(ZC_ECORRUPT, why, size,
			    "%s: the header says %llu bytes, the file holds %llu",
			    file_bytes < h->file_bytes ? "truncated" : "stray bytes",
			    (unsigned long long)h->file_bytes, (unsigned long long)file_bytes);
	uint32_t layers = h->config.layers;
	if (SNAPSHOT_HEADER_BYTES + table_bytes(layers) + SNAPSHOT_TRAILER_BYTES > file_bytes)
		return fail(ZC_ECORRUPT, why, size, "truncated in the layer table");
	struct snapshot_layer *table = malloc(table_bytes(layers));
	if (!table)
		return fail(-ENOMEM, why, size, "out of memory");
	rc = read_at(fd, SNAPSHOT_HEADER_BYTES, table, table_bytes(layers), "the layer table", why,
		     size);
	if (rc < 0) {
		free(table);
		return rc;
	}
	memcpy(table_checksum, (uint8_t *)table + (size_t)layers * SNAPSHOT_LAYER_BYTES,
	       sizeof(*table_checksum));
	if (XXH3_64bits(table, (size_t)layers * SNAPSHOT_LAYER_BYTES) != *table_checksum) {
		free(table);
		return fail(ZC_ECORRUPT, why, size, "layer table checksum mismatch");
	}
	rc = table_check(h, table, file_bytes, why, size);
	if (rc < 0) {
		free(table);
		return rc;
	}
	*table_out = table;
	return 0;
}

static int file_size_of(int fd, uint64_t *bytes, char *why, size_t size)
{
	struct stat st;
	if (fstat(fd, &st) < 0)
		return fail(-errno, why, size, "cannot stat the snapshot: %s", strerror(errno));
	if (!S_ISREG(st.st_mode))
		return fail(ZC_EINVALID, why, size, "the snapshot must be a regular file");
	*bytes = (uint64_t)st.st_size;
	return 0;
}

/* What the importer asked of the snapshot (docs/SNAPSHOT.md, step 5). */
static int expectations_check(const struct snapshot_header *h, const struct snapshot_expect *expect,
			      char *why, size_t size)
{
	if (expect->model_id && strcmp(expect->model_id, h->config.model_id) != 0)
		return fail(ZC_EPRECONDITION, why, size,
			    "wrong fingerprint: the snapshot is of model '%s', not '%s'",
			    h->config.model_id, expect->model_id);
	if (expect->has_fingerprint && expect->fingerprint != h->fingerprint)
		return fail(ZC_EPRECONDITION, why, size,
			    "wrong fingerprint: the snapshot's is %016llx, not %016llx",
			    (unsigned long long)h->fingerprint, (unsigned long long)expect->fingerprint);
	return 0;
}

int snapshot_verify(int fd, const struct snapshot_expect *expect, struct snapshot_header *h,
		    char *why, size_t size)
{
	struct snapshot_layer *table = NULL;
	uint64_t file_bytes, table_checksum;
	int rc = file_size_of(fd, &file_bytes, why, size);
	if (rc < 0)
		return rc;
	if (expect->max_bytes && file_bytes > expect->max_bytes)
		return fail(ZC_EEXHAUSTED, why, size,
			    "the snapshot is %llu bytes; the memory budget has room for %llu",
			    (unsigned long long)file_bytes, (unsigned long long)expect->max_bytes);
	rc = head_read(fd, file_bytes, h, &table, &table_checksum, why, size);
	if (rc < 0)
		return rc;
	free(table);
	return expectations_check(h, expect, why, size);
}

/* ---- verify part by part (a restore from the remote tier) ------------------------- */

/* The whole-snapshot checksum covers the header, the table and every
 * record's and residual's own checksum, in file order: it is computed as
 * the parts arrive, never over the payloads a second time. */
struct snapshot_stream {
	struct snapshot_header header;
	const struct snapshot_layer *table;
	uint32_t next_layer;
	XXH3_state_t whole;
};

int snapshot_stream_open(const struct snapshot_header *h, const struct snapshot_layer *table,
			 uint64_t table_checksum, const struct snapshot_expect *expect,
			 struct snapshot_stream **out, char *why, size_t size)
{
	*out = NULL;
	int rc = snapshot_header_verify(h, why, size);
	if (rc < 0)
		return rc;
	uint32_t layers = h->config.layers;
	if (expect->max_bytes && h->file_bytes > expect->max_bytes)
		return fail(ZC_EEXHAUSTED, why, size,
			    "the snapshot is %llu bytes; the memory budget has room for %llu",
			    (unsigned long long)h->file_bytes, (unsigned long long)expect->max_bytes);
	if (SNAPSHOT_HEADER_BYTES + table_bytes(layers) + SNAPSHOT_TRAILER_BYTES > h->file_bytes)
		return fail(ZC_ECORRUPT, why, size, "truncated in the layer table");
	if (XXH3_64bits(table, (size_t)layers * SNAPSHOT_LAYER_BYTES) != table_checksum)
		return fail(ZC_ECORRUPT, why, size, "layer table checksum mismatch");
	rc = table_check(h, table, h->file_bytes, why, size);
	if (rc < 0)
		return rc;
	rc = expectations_check(h, expect, why, size);
	if (rc < 0)
		return rc;
	struct snapshot_stream *s;
	if (posix_memalign((void **)&s, 64, sizeof(*s)) != 0)
		return fail(-ENOMEM, why, size, "out of memory");
	memset(s, 0, sizeof(*s));
	s->header = *h;
	s->table = table;
	XXH3_64bits_reset(&s->whole);
	XXH3_64bits_update(&s->whole, h, sizeof(*h));
	XXH3_64bits_update(&s->whole, table, (size_t)layers * SNAPSHOT_LAYER_BYTES);
	XXH3_64bits_update(&s->whole, &table_checksum, sizeof(table_checksum));
	*out = s;
	return 0;
}

int snapshot_stream_layer(struct snapshot_stream *s, uint32_t layer,
			  const struct snapshot_part *blocks, const struct snapshot_part *residual,
			  store_block *entries, char *why, size_t size)
{
	const struct snapshot_header *h = &s->header;
	if (layer != s->next_layer || layer >= h->config.layers)
		return fail(ZC_EINTERNAL, why, size, "layer %u verified out of order", layer);
	const struct snapshot_layer *l = &s->table[layer];
	uint64_t bytes = residual->len;
	struct snapshot_block prev = { 0 }, b;
	for (uint32_t k = 0; k < l->blocks; k++) {
		int rc = snapshot_block_verify(h, layer, k, blocks[k].bytes, blocks[k].len, &entries[k],
					       why, size);
		if (rc < 0)
			return rc;
		memcpy(&b, blocks[k].bytes, sizeof(b));
		rc = tiling_check(layer, k, &prev, &b, why, size);
		if (rc < 0)
			return rc;
		uint64_t sum;
		memcpy(&sum, (const uint8_t *)blocks[k].bytes + blocks[k].len - sizeof(sum), sizeof(sum));
		XXH3_64bits_update(&s->whole, &b.checksum, sizeof(b.checksum));
		XXH3_64bits_update(&s->whole, &sum, sizeof(sum));
		bytes += blocks[k].len;
		prev = b;
	}
	int rc = last_block_check(layer, l, &prev, why, size);
	if (rc < 0)
		return rc;
	uint64_t rows = (uint64_t)l->residual_tokens * residual_row_bytes(&h->config);
	if (residual->len != rows || bytes != l->bytes)
		return fail(ZC_ECORRUPT, why, size,
			    "inconsistent counts: layer %u's parts hold %llu bytes (%llu of residual); "
			    "its table entry says %llu (%u residual rows, %llu bytes)", layer,
			    (unsigned long long)bytes, (unsigned long long)residual->len,
			    (unsigned long long)l->bytes, l->residual_tokens, (unsigned long long)rows);
	if (hash64(residual->bytes, rows) != l->residual_checksum)
		return fail(ZC_ECORRUPT, why, size, "layer %u residual checksum mismatch", layer);
	XXH3_64bits_update(&s->whole, &l->residual_checksum, sizeof(uint64_t));
	s->next_layer++;
	return 0;
}

int snapshot_stream_end(struct snapshot_stream *s, const struct snapshot_trailer *trailer,
			char *why, size_t size)
{
	if (s->next_layer != s->header.config.layers)
		return fail(ZC_EINTERNAL, why, size, "%u of %u layers verified", s->next_layer,
			    s->header.config.layers);
	if (memcmp(trailer->magic, SNAPSHOT_TRAILER_MAGIC, sizeof(trailer->magic)) != 0 ||
	    trailer->file_bytes != s->header.file_bytes)
		return fail(ZC_ECORRUPT, why, size, "trailer: bad magic or size (truncated?)");
	if (trailer->checksum != XXH3_64bits_digest(&s->whole))
		return fail(ZC_ECORRUPT, why, size, "trailer: whole-snapshot checksum mismatch");
	return 0;
}

void snapshot_stream_free(struct snapshot_stream *s)
{
	free(s);
}

/* ---- building a verified snapshot's session ---------------------------------------- */

int snapshot_build_begin(const struct snapshot_header *h, const struct store_params *params,
			 int dir_fd, const char *dir_path, struct store_budget *budget,
			 struct pool *pool, struct store **out, char *why, size_t size)
{
	const struct snapshot_config *c = &h->config;
	struct store_params p = *params;
	p.model_id = c->model_id;
	p.layers = c->layers;
	p.batch = c->batch;
	p.kv_heads = c->kv_heads;
	p.head_dim_k = c->head_dim_k;
	p.head_dim_v = c->head_dim_v;
	p.max_tokens = h->max_tokens;
	p.codec = config_codec(c);
	p.policy = (enum store_policy)c->policy;
	p.residual_tokens = c->residual_tokens;
	int rc = store_import_begin(dir_fd, dir_path, &p, budget, pool, out);
	if (rc < 0) {
		*out = NULL;
		if (rc != STORE_EBUDGET)
			fail(rc, why, size, "cannot create the session's file: %s", zc_strerror(rc));
	}
	return rc;
}

/* Layer `layer`'s residual rows (compact, K then V) into the import. */
static int build_residual(struct store *store, const struct snapshot_config *c, uint32_t layer,
			  const struct snapshot_layer *l, const uint8_t *rows, char *why, size_t size)
{
	uint64_t key_part = (uint64_t)c->batch * c->kv_heads * l->residual_tokens * c->head_dim_k * 2;
	int rc = store_import_layer(store, layer, l->tokens, l->residual_tokens,
				    (const uint16_t *)rows, (const uint16_t *)(rows + key_part));
	if (rc < 0 && rc != STORE_EBUDGET)
		fail(rc, why, size, "cannot store layer %u's residual: %s", layer, zc_strerror(rc));
	return rc;
}

int snapshot_build_layer(struct store *store, const struct snapshot_header *h, uint32_t layer,
			 const struct snapshot_layer *l, const struct snapshot_part *blocks,
			 const store_block *entries, const void *residual, char *why, size_t size)
{
	for (uint32_t k = 0; k < l->blocks; k++) {
		const uint8_t *record = blocks[k].bytes;
		int rc = store_import_block(store, layer, &entries[k], record + SNAPSHOT_BLOCK_BYTES,
					    record + SNAPSHOT_BLOCK_BYTES + entries[k].key_bytes);
		if (rc < 0) {
			if (rc != STORE_EBUDGET)
				fail(rc, why, size, "cannot store layer %u block %u: %s", layer, k,
				     zc_strerror(rc));
			return rc;
		}
	}
	return build_residual(store, &h->config, layer, l, residual, why, size);
}

/* ---- import: verified and built in one pass ------------------------------------------ */

/* Threads that build layers at once, the import's own included: each
 * takes the next layer; bounded by the CPUs the daemon may use. */
#define SNAPSHOT_IMPORT_WORKERS 4

struct import_work {
	int fd;
	const struct snapshot_header *h;
	const struct snapshot_layer *table;
	const uint64_t *first_block;  /* per layer: its first block's number in the file */
	uint64_t *sums;               /* per block: its header's and its payload's checksum */
	struct store *store;
	pthread_mutex_t store_lock;   /* store_import_* of every layer (one file's charge) */
	uint32_t next;                /* atomic: the next layer to take */
	uint32_t failed;              /* atomic: the lowest layer that failed (layers: none) */
	pthread_mutex_t lock;         /* over the failure: */
	int rc;
	char why[180];
};

/* A layer's failure; the lowest layer's is the answer, as if the layers
 * had been read one after another. */
static void import_failed(struct import_work *x, uint32_t layer, int rc, const char *why)
{
	pthread_mutex_lock(&x->lock);
	if (layer < x->failed) {
		x->rc = rc;
		snprintf(x->why, sizeof(x->why), "%s", why);
		__atomic_store_n(&x->failed, layer, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&x->lock);
}

/* Whether a layer below this one failed: the import is lost, stop. */
static bool import_stopped(struct import_work *x, uint32_t layer)
{
	return __atomic_load_n(&x->failed, __ATOMIC_ACQUIRE) < layer;
}

/* n bytes of the file at `from` into the pool at `to`, chunk by chunk:
 * each chunk hashed while in cache and written from the same buffer, so
 * the bytes checked are the bytes stored. */
static int import_copy(struct import_work *x, uint64_t from, uint64_t n, uint64_t to,
		       uint8_t *chunk, XXH3_state_t *state, const char *what, char *why,
		       size_t size)
{
	while (n > 0) {
		uint64_t part = n < SNAPSHOT_CHUNK_BYTES ? n : SNAPSHOT_CHUNK_BYTES;
		int rc = read_at(x->fd, from, chunk, part, what, why, size);
		if (rc < 0)
			return rc;
		hash_update(state, chunk, part);
		rc = pool_write_at(store_pool(x->store), to, chunk, part);
		if (rc < 0)
			return fail(rc, why, size, "cannot store %s: %s", what, zc_strerror(rc));
		from += part;
		to += part;
		n -= part;
	}
	return 0;
}

/* One block record at *at: checked, streamed into a fresh extent, named
 * in the layer's index. The checks and their order are the verification's
 * (docs/SNAPSHOT.md); a failure after the extent was taken gives it back. */
static int import_block(struct import_work *x, uint32_t layer, uint32_t k, uint64_t *at,
			uint64_t end, struct snapshot_block *prev, uint8_t *chunk, char *why,
			size_t size)
{
	const struct snapshot_header *h = x->h;
	struct pool *pool = store_pool(x->store);
	struct snapshot_block b;
	store_block entry;
	char what[64];
	snprintf(what, sizeof(what), "layer %u block %u", layer, k);
	if (end - *at < SNAPSHOT_BLOCK_BYTES)
		return fail(ZC_ECORRUPT, why, size, "%s: past the end of its layer", what);
	int rc = read_at(x->fd, *at, &b, sizeof(b), what, why, size);
	if (rc == 0)
		rc = block_header_check(h, layer, k, &b, why, size);
	if (rc == 0)
		rc = tiling_check(layer, k, prev, &b, why, size);
	if (rc < 0)
		return rc;
	if (snapshot_record_bytes(b.key_bytes, b.value_bytes) > end - *at)
		return fail(ZC_ECORRUPT, why, size, "%s: payload past the end of its layer", what);
	uint64_t payload = *at + SNAPSHOT_BLOCK_BYTES, key_offset;
	pthread_mutex_lock(&x->store_lock);
	rc = store_import_block_room(x->store, layer);
	pthread_mutex_unlock(&x->store_lock);
	if (rc == 0)
		rc = pool_reserve(pool, b.key_bytes, b.value_bytes, &key_offset);
	if (rc < 0)
		return rc == STORE_EBUDGET ? rc :
		       fail(rc, why, size, "cannot store %s: %s", what, zc_strerror(rc));
	XXH3_state_t state;
	uint64_t stored;
	XXH3_64bits_reset(&state);
	rc = import_copy(x, payload, b.key_bytes, key_offset, chunk, &state, what, why, size);
	if (rc == 0)
		rc = import_copy(x, payload + b.key_bytes, b.value_bytes,
				 pool_value_offset(key_offset, b.key_bytes), chunk, &state, what, why,
				 size);
	if (rc == 0)
		rc = read_at(x->fd, payload + b.key_bytes + b.value_bytes, &stored, sizeof(stored),
			     what, why, size);
	if (rc == 0 && stored != XXH3_64bits_digest(&state))
		rc = fail(ZC_ECORRUPT, why, size, "%s: payload checksum mismatch", what);
	if (rc < 0) {
		pool_unref(pool, key_offset);
		return rc;
	}
	fault_point("pool.write");
	entry_of(&b, &entry);
	pthread_mutex_lock(&x->store_lock);
	store_import_block_add(x->store, layer, &entry, key_offset);
	pthread_mutex_unlock(&x->store_lock);
	uint64_t *sums = x->sums + 2 * (x->first_block[layer] + k);
	sums[0] = b.checksum;
	sums[1] = stored;
	*at = payload + b.key_bytes + b.value_bytes + SNAPSHOT_BLOCK_END_BYTES;
	*prev = b;
	return 0;
}

/* One layer: its blocks in order, then its residual rows. */
static int import_layer(struct import_work *x, uint32_t layer, uint8_t *chunk, uint8_t **rows,
			uint64_t *capacity, char *why, size_t size)
{
	const struct snapshot_config *c = &x->h->config;
	const struct snapshot_layer *l = &x->table[layer];
	uint64_t at = l->offset, end = l->offset + l->bytes;
	struct snapshot_block prev = { 0 };
	for (uint32_t k = 0; k < l->blocks; k++) {
		if (import_stopped(x, layer))
			return 0;
		int rc = import_block(x, layer, k, &at, end, &prev, chunk, why, size);
		if (rc < 0)
			return rc;
	}
	int rc = last_block_check(layer, l, &prev, why, size);
	if (rc < 0)
		return rc;
	uint64_t residual = (uint64_t)l->residual_tokens * residual_row_bytes(c);
	if (end - at != residual)
		return fail(ZC_ECORRUPT, why, size,
			    "inconsistent counts: layer %u has %llu bytes after its blocks; its "
			    "%u residual rows take %llu", layer, (unsigned long long)(end - at),
			    l->residual_tokens, (unsigned long long)residual);
	rc = buffer_fit(rows, capacity, residual ? residual : 1);
	if (rc < 0)
		return fail(rc, why, size, "out of memory");
	char what[64];
	snprintf(what, sizeof(what), "layer %u residual", layer);
	rc = read_at(x->fd, at, *rows, residual, what, why, size);
	if (rc == 0 && hash64(*rows, residual) != l->residual_checksum)
		rc = fail(ZC_ECORRUPT, why, size, "layer %u residual checksum mismatch", layer);
	if (rc < 0)
		return rc;
	pthread_mutex_lock(&x->store_lock);
	rc = build_residual(x->store, c, layer, l, *rows, why, size);
	pthread_mutex_unlock(&x->store_lock);
	return rc;
}

static void *import_worker(void *arg)
{
	struct import_work *x = arg;
	uint32_t layers = x->h->config.layers;
	uint8_t *chunk = malloc(SNAPSHOT_CHUNK_BYTES), *rows = NULL;
	uint64_t capacity = 0;
	char why[180];
	for (;;) {
		uint32_t i = __atomic_fetch_add(&x->next, 1, __ATOMIC_RELAXED);
		/* Layers are taken in order: past a failed one, all are. */
		if (i >= layers || import_stopped(x, i))
			break;
		why[0] = '\0';
		int rc = chunk ? import_layer(x, i, chunk, &rows, &capacity, why, sizeof(why)) :
				 fail(-ENOMEM, why, sizeof(why), "out of memory");
		if (rc < 0)
			import_failed(x, i, rc, why);
	}
	free(rows);
	free(chunk);
	return NULL;
}

/* How many threads build an import: one per CPU the daemon may use, at
 * most SNAPSHOT_IMPORT_WORKERS and one per layer. Small snapshots too (a
 * thread's start is tens of microseconds, a session file's creation
 * more), so the crash and corruption tests take the same path. */
static int import_workers(const struct snapshot_header *h)
{
	int n = resources_cpus();
	if (n > SNAPSHOT_IMPORT_WORKERS)
		n = SNAPSHOT_IMPORT_WORKERS;
	if ((uint32_t)n > h->config.layers)
		n = (int)h->config.layers;
	return n < 1 ? 1 : n;
}

/* The trailer and the whole-file checksum: the header, the table, then
 * every region's own checksum in file order. */
static int import_trailer(struct import_work *x, uint64_t file_bytes, char *why, size_t size)
{
	const struct snapshot_header *h = x->h;
	struct snapshot_trailer trailer;
	int rc = read_at(x->fd, file_bytes - SNAPSHOT_TRAILER_BYTES, &trailer, sizeof(trailer),
			 "the trailer", why, size);
	if (rc < 0)
		return rc;
	if (memcmp(trailer.magic, SNAPSHOT_TRAILER_MAGIC, sizeof(trailer.magic)) != 0 ||
	    trailer.file_bytes != file_bytes)
		return fail(ZC_ECORRUPT, why, size, "trailer: bad magic or size (truncated?)");
	XXH3_state_t whole;
	XXH3_64bits_reset(&whole);
	XXH3_64bits_update(&whole, h, sizeof(*h));
	XXH3_64bits_update(&whole, x->table, (size_t)table_bytes(h->config.layers));
	for (uint32_t i = 0; i < h->config.layers; i++) {
		XXH3_64bits_update(&whole, x->sums + 2 * x->first_block[i],
				   (size_t)x->table[i].blocks * 2 * sizeof(uint64_t));
		XXH3_64bits_update(&whole, &x->table[i].residual_checksum, sizeof(uint64_t));
	}
	if (trailer.checksum != XXH3_64bits_digest(&whole))
		return fail(ZC_ECORRUPT, why, size, "trailer: whole-snapshot checksum mismatch");
	return 0;
}

int snapshot_import(int fd, const struct snapshot_header *verified, const struct store_params *params,
		    int dir_fd, const char *dir_path, struct store_budget *budget, struct pool *pool,
		    struct store **out, char *why, size_t size)
{
	const struct snapshot_config *c = &verified->config;
	struct snapshot_header h;
	struct snapshot_layer *table = NULL;
	uint64_t file_bytes, table_checksum, *first_block = NULL, *sums = NULL;
	struct store *store = NULL;
	int rc = file_size_of(fd, &file_bytes, why, size);
	if (rc == 0)
		rc = head_read(fd, file_bytes, &h, &table, &table_checksum, why, size);
	/* The file is the client's: it may have changed since the header was
	 * checked against the expectations. */
	if (rc == 0 && memcmp(&h, verified, sizeof(h)) != 0)
		rc = fail(ZC_ECORRUPT, why, size, "the snapshot changed while it was imported");
	if (rc < 0)
		goto out;
	first_block = malloc((size_t)c->layers * sizeof(*first_block));
	sums = malloc((size_t)h.blocks * 2 * sizeof(*sums) + 1);
	if (!first_block || !sums) {
		rc = fail(-ENOMEM, why, size, "out of memory");
		goto out;
	}
	for (uint32_t i = 0, n = 0; i < c->layers; n += table[i].blocks, i++)
		first_block[i] = n;

	rc = snapshot_build_begin(&h, params, dir_fd, dir_path, budget, pool, &store, why, size);
	if (rc < 0)
		goto out;
	struct import_work x = {
		.fd = fd, .h = &h, .table = table, .first_block = first_block, .sums = sums,
		.store = store, .failed = c->layers,
	};
	if (pthread_mutex_init(&x.lock, NULL) != 0) {
		rc = fail(-ENOMEM, why, size, "out of memory");
		goto out;
	}
	if (pthread_mutex_init(&x.store_lock, NULL) != 0) {
		pthread_mutex_destroy(&x.lock);
		rc = fail(-ENOMEM, why, size, "out of memory");
		goto out;
	}
	pthread_t helpers[SNAPSHOT_IMPORT_WORKERS - 1];
	int wanted = import_workers(&h), started = 0;
	for (int i = 0; i < wanted - 1; i++)
		if (pthread_create(&helpers[started], NULL, import_worker, &x) == 0)
			started++;
	import_worker(&x);
	for (int i = 0; i < started; i++)
		pthread_join(helpers[i], NULL);
	pthread_mutex_destroy(&x.store_lock);
	pthread_mutex_destroy(&x.lock);
	rc = x.rc;
	if (rc < 0) {
		snprintf(why, size, "%s", x.why);
		goto out;
	}
	rc = import_trailer(&x, file_bytes, why, size);
	if (rc < 0)
		goto out;
	rc = store_import_commit(store);
	if (rc < 0) {
		/* The commit threw the store away. */
		store = NULL;
		fail(rc, why, size, "cannot put the session's file in place: %s", zc_strerror(rc));
		goto out;
	}
	*out = store;
	store = NULL;
out:
	if (store)
		store_import_abandon(store);
	free(sums);
	free(first_block);
	free(table);
	return rc;
}
