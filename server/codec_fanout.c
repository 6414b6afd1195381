/*
 * One block's codec work spread over threads, by heads. Threads are
 * started per block and joined before the call returns: a prefill block
 * is milliseconds of work against tens of microseconds to start a thread,
 * and nothing outlives the call (no pool to size, park or shut down). A
 * thread that cannot be started leaves its share to the caller.
 */
#include "codec_fanout.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>

#include "resources.h"

static unsigned fanout_threads = 1;

unsigned codec_fanout_set_threads(unsigned threads)
{
	if (threads == 0) {
		int cpus = resources_cpus();
		threads = cpus > 8 ? 8u : (unsigned)cpus;
	}
	if (threads > CODEC_FANOUT_MAX_THREADS)
		threads = CODEC_FANOUT_MAX_THREADS;
	fanout_threads = threads;
	return threads;
}

unsigned codec_fanout_threads(void)
{
	return fanout_threads;
}

/* One call's work: the block's flat heads (b * heads + h) cut into parts
 * of whole heads; each part runs the public codec call over its runs of
 * heads within one batch entry. */
struct fanout {
	const zc_codec_config *config;
	zc_tensor tensor;
	zc_block_shape shape;
	const zc_strides *strides;
	size_t head_bytes;
	bool reconstruct;
	const uint16_t *input;        /* compress */
	const float *scores;
	uint8_t *out;
	const struct codec_sink *sink;
	const uint8_t *compressed;    /* reconstruct */
	uint16_t *view;
	unsigned parts;
	size_t heads;                 /* batch * heads */
};

struct part {
	struct fanout *f;
	unsigned index;
	int rc;
	pthread_t thread;
	bool started;
};

/* Heads [first, last) of one batch entry. */
static int run_span(const struct fanout *f, size_t first, size_t last)
{
	size_t b = first / f->shape.heads, hh = first % f->shape.heads;
	zc_block_shape one = { 1, (uint32_t)(last - first), f->shape.tokens, f->shape.head_dim };
	size_t bytes = (last - first) * f->head_bytes;
	size_t at = b * f->strides->batch + hh * f->strides->head;
	if (f->reconstruct)
		return zc_block_reconstruct(f->config, f->tensor, &one,
					    f->compressed + first * f->head_bytes, bytes,
					    f->view + at, f->strides);
	int64_t rc;
	if (f->scores)
		rc = zc_block_compress_scored_strided(f->config, &one, f->input + at, f->strides,
						      f->scores + first * f->shape.tokens,
						      f->out + first * f->head_bytes, bytes);
	else
		rc = zc_block_compress_strided(f->config, f->tensor, &one, f->input + at,
					       f->strides, f->out + first * f->head_bytes, bytes);
	if (rc >= 0 && f->sink)
		rc = f->sink->write(f->sink->ctx, first * f->head_bytes,
				    f->out + first * f->head_bytes, bytes);
	return rc < 0 ? (int)rc : 0;
}

static int run_part(const struct fanout *f, unsigned index)
{
	size_t first = f->heads * index / f->parts;
	size_t last = f->heads * (index + 1) / f->parts;
	while (first < last) {
		/* A run never crosses a batch entry: the strides differ there.
		 * Compression goes one head per call: the codec's check pass
		 * (key norms, or finiteness) reads the whole span before it
		 * writes, and a prefill head (1 MiB at 4096 x 128) still sits
		 * in L2 when its encode reads it again; a span of several
		 * heads would be read back from L3 or memory. */
		size_t entry_end = (first / f->shape.heads + 1) * f->shape.heads;
		size_t end = last < entry_end ? last : entry_end;
		if (!f->reconstruct)
			end = first + 1;
		int rc = run_span(f, first, end);
		if (rc < 0)
			return rc;
		first = end;
	}
	return 0;
}

static void *part_main(void *arg)
{
	struct part *p = arg;
	p->rc = run_part(p->f, p->index);
	return NULL;
}

/* The parts on threads, part 0 on the caller; the first part's error
 * (by index, not by time) is the answer, so it does not depend on which
 * thread ran first. */
static int fanout_run(struct fanout *f)
{
	struct part parts[CODEC_FANOUT_MAX_THREADS];
	for (unsigned i = 0; i < f->parts; i++) {
		parts[i] = (struct part){ .f = f, .index = i };
		if (i > 0)
			parts[i].started = pthread_create(&parts[i].thread, NULL, part_main,
							  &parts[i]) == 0;
	}
	parts[0].rc = run_part(f, 0);
	for (unsigned i = 1; i < f->parts; i++) {
		if (parts[i].started)
			pthread_join(parts[i].thread, NULL);
		else
			parts[i].rc = run_part(f, i);
	}
	for (unsigned i = 0; i < f->parts; i++) {
		if (parts[i].rc < 0)
			return parts[i].rc;
	}
	return 0;
}

/* How many parts a block is worth; 0 sends the call to the codec as is
 * (which then also gives every error of a malformed call), 1 keeps a large
 * block on the calling thread but still head by head (run_part). */
static unsigned parts_for(const zc_codec_config *config, zc_tensor tensor,
			  const zc_block_shape *shape, const zc_strides *strides,
			  zc_block_layout *layout)
{
	unsigned threads = fanout_threads;
	if (zc_block_layout_compute(config, tensor, shape, layout) < 0)
		return 0;
	if (strides->token != layout->head_dim || layout->total_bytes == 0)
		return 0;
	uint64_t elements = (uint64_t)layout->heads * layout->tokens * layout->head_dim;
	if (elements < CODEC_FANOUT_MIN_ELEMENTS || layout->heads < 2)
		return 0;
	return layout->heads < threads ? (unsigned)layout->heads : threads;
}

int64_t codec_fanout_compress(const zc_codec_config *config, zc_tensor tensor,
			      const zc_block_shape *shape, const uint16_t *input,
			      const zc_strides *strides, const float *scores, void *out,
			      size_t capacity, const struct codec_sink *sink)
{
	zc_block_layout layout;
	unsigned parts = parts_for(config, tensor, shape, strides, &layout);
	if (parts == 0 || capacity < layout.total_bytes) {
		int64_t n = scores ? zc_block_compress_scored_strided(config, shape, input, strides,
								       scores, out, capacity) :
				     zc_block_compress_strided(config, tensor, shape, input, strides,
							       out, capacity);
		if (n > 0 && sink) {
			int rc = sink->write(sink->ctx, 0, out, (size_t)n);
			if (rc < 0)
				return rc;
		}
		return n;
	}
	struct fanout f = {
		.config = config, .tensor = tensor, .shape = *shape, .strides = strides,
		.head_bytes = layout.head_bytes, .input = input, .scores = scores, .out = out,
		.sink = sink, .parts = parts, .heads = layout.heads,
	};
	int rc = fanout_run(&f);
	return rc < 0 ? rc : (int64_t)layout.total_bytes;
}

int codec_fanout_reconstruct(const zc_codec_config *config, zc_tensor tensor,
			     const zc_block_shape *shape, const void *compressed, size_t size,
			     uint16_t *out, const zc_strides *strides)
{
	zc_block_layout layout;
	unsigned parts = parts_for(config, tensor, shape, strides, &layout);
	if (parts <= 1 || size != layout.total_bytes)
		return zc_block_reconstruct(config, tensor, shape, compressed, size, out, strides);
	struct fanout f = {
		.config = config, .tensor = tensor, .shape = *shape, .strides = strides,
		.head_bytes = layout.head_bytes, .reconstruct = true, .compressed = compressed,
		.view = out, .parts = parts, .heads = layout.heads,
	};
	return fanout_run(&f);
}
