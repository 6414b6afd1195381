/*
 * One block's codec work spread over threads, by heads. The helpers are
 * kept between blocks (the crew below): a prefill's 32 layers would
 * otherwise start and join a thread each, tens of microseconds of a
 * layer's critical path. One call has the crew at a time; a second call
 * meanwhile (another session's block on another worker) starts threads
 * of its own for the call, as every call once did. A thread that cannot
 * be started leaves its share to the caller.
 */
#include "codec_fanout.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

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

/* One tensor of a block. */
struct work {
	zc_tensor tensor;
	zc_block_shape shape;
	const zc_strides *strides;
	size_t head_bytes;
	size_t heads;                 /* batch * heads */
	const uint16_t *input;        /* compress */
	const float *scores;
	uint8_t *out;
	const struct codec_sink *sink;
	const uint8_t *compressed;    /* reconstruct */
	uint16_t *view;               /* reconstruct, or compress with a view */
	const zc_strides *view_strides;
};

/*
 * One call's work: single heads (the tensors' flat heads b * heads + h,
 * one tensor after the other) handed out from a shared counter. A thread
 * that started late or ran fast takes more, and a block's keys and values
 * need one start and one join between them.
 */
struct fanout {
	const zc_codec_config *config;
	struct work work[CODEC_FANOUT_MAX_TENSORS];
	size_t n_work;
	bool reconstruct;
	unsigned parts;
	size_t tasks;                 /* every tensor's heads */
	size_t next;                  /* atomic: the next task to hand out */
	size_t failed;                /* atomic: the lowest task that failed */
};

struct part {
	struct fanout *f;
	int rc;
	size_t failed;                /* the task rc came from */
	pthread_t thread;
	bool started;
};

/* The codec call for a tensor: with its view written on the way, by the
 * caller's scores (keys), or plain. */
static int64_t compress_tensor(const zc_codec_config *config, zc_tensor tensor,
			       const zc_block_shape *shape, const uint16_t *input,
			       const zc_strides *strides, const float *scores, void *out,
			       size_t capacity, uint16_t *view, const zc_strides *view_strides)
{
	if (view)
		return zc_block_compress_view(config, tensor, shape, input, strides, scores, out,
					      capacity, view, view_strides);
	if (scores)
		return zc_block_compress_scored_strided(config, shape, input, strides, scores, out,
							capacity);
	return zc_block_compress_strided(config, tensor, shape, input, strides, out, capacity);
}

/* Heads [first, last) of one batch entry of w (a run never crosses
 * one: the strides differ there). */
static int run_span(const zc_codec_config *config, const struct work *w, size_t first,
		    size_t last, bool reconstruct)
{
	size_t b = first / w->shape.heads, hh = first % w->shape.heads;
	zc_block_shape one = { 1, (uint32_t)(last - first), w->shape.tokens, w->shape.head_dim };
	size_t bytes = (last - first) * w->head_bytes;
	size_t at = b * w->strides->batch + hh * w->strides->head;
	if (reconstruct)
		return zc_block_reconstruct(config, w->tensor, &one,
					    w->compressed + first * w->head_bytes, bytes,
					    w->view + at, w->strides);
	int64_t rc = compress_tensor(config, w->tensor, &one, w->input + at, w->strides,
				     w->scores ? w->scores + first * w->shape.tokens : NULL,
				     w->out + first * w->head_bytes, bytes,
				     w->view ? w->view + b * w->view_strides->batch +
						       hh * w->view_strides->head :
					       NULL,
				     w->view_strides);
	if (rc >= 0 && w->sink)
		rc = w->sink->write(w->sink->ctx, first * w->head_bytes,
				    w->out + first * w->head_bytes, bytes);
	return rc < 0 ? (int)rc : 0;
}

/* Takes heads until none is left, or one before it failed (a later
 * head's work would be thrown away). One head per codec call: the codec's
 * check pass (key norms, or finiteness where the encode does not check
 * values itself) reads the whole head before it writes, and a prefill
 * head (1 MiB at 4096 x 128) still sits in L2 when its encode reads it
 * again; a span of several heads would be read back from L3 or memory.
 * Tasks are handed out in order, so this thread's first failure is its
 * lowest. */
static void run_heads(struct fanout *f, struct part *p)
{
	for (;;) {
		size_t task = __atomic_fetch_add(&f->next, 1, __ATOMIC_RELAXED);
		if (task >= f->tasks || task > __atomic_load_n(&f->failed, __ATOMIC_RELAXED))
			return;
		const struct work *w = f->work;
		size_t head = task;
		while (head >= w->heads)
			head -= (w++)->heads;
		int rc = run_span(f->config, w, head, head + 1, f->reconstruct);
		if (rc < 0) {
			p->rc = rc;
			p->failed = task;
			size_t seen = __atomic_load_n(&f->failed, __ATOMIC_RELAXED);
			while (task < seen &&
			       !__atomic_compare_exchange_n(&f->failed, &seen, task, true,
							    __ATOMIC_RELAXED, __ATOMIC_RELAXED))
				;
			return;
		}
	}
}

static void *part_main(void *arg)
{
	struct part *p = arg;
	run_heads(p->f, p);
	return NULL;
}

/*
 * The crew: helper threads kept from one call to the next, waiting on
 * `go` for a new generation. The call that holds it (busy) posts its
 * fanout and how many helpers it wants, runs part 0 itself, and waits on
 * `done` until those helpers finished; only then does it let the crew
 * go, so a generation's helpers never see the next one's work early.
 * Helpers inherit the creating thread's priority and signal mask (a
 * worker's: workers.c). A forked child has none of them (atfork): its
 * first call starts its own.
 */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t go, done, idle;   /* idle: busy or closing went false */
	bool busy, stopping, atfork;
	bool closing;                 /* a stop is waiting for the holder: no new one */
	unsigned started;             /* helpers alive */
	unsigned wanted, finished;    /* of this generation */
	uint64_t generation;
	uint64_t born[CODEC_FANOUT_MAX_THREADS];  /* each helper's generation at its start */
	struct fanout *f;
	struct part parts[CODEC_FANOUT_MAX_THREADS];  /* helper i's is parts[i + 1] */
	pthread_t threads[CODEC_FANOUT_MAX_THREADS];
} crew = { .lock = PTHREAD_MUTEX_INITIALIZER, .go = PTHREAD_COND_INITIALIZER,
	   .done = PTHREAD_COND_INITIALIZER, .idle = PTHREAD_COND_INITIALIZER };

static void *helper_main(void *arg)
{
	unsigned index = (unsigned)(uintptr_t)arg;
	pthread_mutex_lock(&crew.lock);
	uint64_t seen = crew.born[index];
	for (;;) {
		while (crew.generation == seen && !crew.stopping)
			pthread_cond_wait(&crew.go, &crew.lock);
		if (crew.generation == seen)
			break;   /* stopping, and no work posted that is ours */
		seen = crew.generation;
		if (index >= crew.wanted)
			continue;
		struct fanout *f = crew.f;
		struct part *p = &crew.parts[index + 1];
		pthread_mutex_unlock(&crew.lock);
		run_heads(f, p);
		pthread_mutex_lock(&crew.lock);
		if (++crew.finished == crew.wanted)
			pthread_cond_signal(&crew.done);
	}
	pthread_mutex_unlock(&crew.lock);
	return NULL;
}

/* Around a fork the forking thread holds the lock, so that the child's
 * copy of the crew is whole; in the child the helpers do not exist (nor
 * any waiter on the conditions), so it starts with none. */
static void crew_fork_prepare(void)
{
	pthread_mutex_lock(&crew.lock);
}

static void crew_fork_parent(void)
{
	pthread_mutex_unlock(&crew.lock);
}

static void crew_fork_child(void)
{
	pthread_cond_init(&crew.go, NULL);
	pthread_cond_init(&crew.done, NULL);
	pthread_cond_init(&crew.idle, NULL);
	crew.busy = crew.stopping = crew.closing = false;
	crew.started = crew.wanted = crew.finished = 0;
	crew.f = NULL;
	pthread_mutex_unlock(&crew.lock);
}

/* Takes the crew for a call that wants `helpers` threads, starting the
 * ones it lacks; returns the helpers it has (0: not taken). */
static unsigned crew_take(unsigned helpers)
{
	unsigned have = 0;
	pthread_mutex_lock(&crew.lock);
	if (!crew.busy && !crew.closing) {
		crew.busy = true;
		if (!crew.atfork)
			crew.atfork = pthread_atfork(crew_fork_prepare, crew_fork_parent,
						     crew_fork_child) == 0;
		while (crew.atfork && crew.started < helpers) {
			unsigned i = crew.started;
			crew.born[i] = crew.generation;
			if (pthread_create(&crew.threads[i], NULL, helper_main, (void *)(uintptr_t)i))
				break;
			crew.started++;
		}
		have = crew.started < helpers ? crew.started : helpers;
		if (have == 0)
			crew.busy = false;
	}
	pthread_mutex_unlock(&crew.lock);
	return have;
}

/* Parts 1..have on the crew, part 0 on the caller; parts[] gets theirs. */
static void crew_run(struct fanout *f, unsigned have, struct part *parts)
{
	pthread_mutex_lock(&crew.lock);
	crew.f = f;
	crew.wanted = have;
	crew.finished = 0;
	for (unsigned i = 1; i <= have; i++)
		crew.parts[i] = parts[i];
	crew.generation++;
	pthread_cond_broadcast(&crew.go);
	pthread_mutex_unlock(&crew.lock);

	run_heads(f, &parts[0]);

	pthread_mutex_lock(&crew.lock);
	while (crew.finished < crew.wanted)
		pthread_cond_wait(&crew.done, &crew.lock);
	for (unsigned i = 1; i <= have; i++)
		parts[i] = crew.parts[i];
	crew.f = NULL;
	crew.busy = false;
	pthread_cond_broadcast(&crew.idle);
	pthread_mutex_unlock(&crew.lock);
}

void codec_fanout_stop(void)
{
	pthread_mutex_lock(&crew.lock);
	/* A call that holds the crew finishes first. Stopping earlier would
	 * let its helpers leave before it posts its generation (it took the
	 * crew and has not posted yet), and it would wait for them forever.
	 * Calls from now on find the crew closing and start threads of their
	 * own, so the wait cannot be taken over by call after call. A second
	 * stop meanwhile waits for the first (one joins the helpers). */
	while (crew.closing)
		pthread_cond_wait(&crew.idle, &crew.lock);
	crew.closing = true;
	while (crew.busy)
		pthread_cond_wait(&crew.idle, &crew.lock);
	crew.stopping = true;
	pthread_cond_broadcast(&crew.go);
	unsigned started = crew.started;
	pthread_mutex_unlock(&crew.lock);
	for (unsigned i = 0; i < started; i++)
		pthread_join(crew.threads[i], NULL);
	pthread_mutex_lock(&crew.lock);
	crew.started = 0;
	crew.stopping = crew.closing = false;
	pthread_cond_broadcast(&crew.idle);
	pthread_mutex_unlock(&crew.lock);
}

/* The parts on threads, part 0 on the caller. The answer is the error
 * of the lowest failed task (tensor by tensor, head by head), so it does
 * not depend on which thread ran first. */
static int fanout_run(struct fanout *f)
{
	struct part parts[CODEC_FANOUT_MAX_THREADS];
	f->next = 0;
	f->failed = SIZE_MAX;
	for (unsigned i = 0; i < f->parts; i++)
		parts[i] = (struct part){ .f = f, .failed = SIZE_MAX };
	unsigned have = f->parts > 1 ? crew_take(f->parts - 1) : 0;
	if (have > 0) {
		crew_run(f, have, parts);
		/* Helpers the crew lacked: their share is the caller's. */
		for (unsigned i = have + 1; i < f->parts; i++)
			run_heads(f, &parts[i]);
	} else {
		for (unsigned i = 1; i < f->parts; i++)
			parts[i].started = pthread_create(&parts[i].thread, NULL, part_main,
							  &parts[i]) == 0;
		run_heads(f, &parts[0]);
		for (unsigned i = 1; i < f->parts; i++) {
			if (parts[i].started)
				pthread_join(parts[i].thread, NULL);
			else
				run_heads(f, &parts[i]);
		}
	}
	int rc = 0;
	size_t lowest = SIZE_MAX;
	for (unsigned i = 0; i < f->parts; i++) {
		if (parts[i].rc < 0 && parts[i].failed < lowest) {
			lowest = parts[i].failed;
			rc = parts[i].rc;
		}
	}
	return rc;
}

/* How many threads a tensor is worth; 0 sends the call to the codec as
 * is (which then also gives every error of a malformed call), 1 keeps a
 * large block on the calling thread but still head by head. */
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

/* The codec's own call for one tensor, bytes then through its sink. */
static int64_t compress_direct(const zc_codec_config *config, const struct codec_fanout_tensor *t)
{
	int64_t n = compress_tensor(config, t->tensor, &t->shape, t->input, t->strides, t->scores,
				    t->out, t->capacity, t->view, t->view_strides);
	if (n > 0 && t->sink) {
		int rc = t->sink->write(t->sink->ctx, 0, t->out, (size_t)n);
		if (rc < 0)
			return rc;
	}
	return n;
}

/* Adds a tensor to a block call, its heads as tasks. Returns the threads
 * it is worth; 0 (nothing added) when it must go through the codec's own
 * call: too small, malformed, or `bytes` not what its layout needs (at
 * least that much to compress into, exactly that much to reconstruct). */
static unsigned fanout_add(struct fanout *f, zc_tensor tensor, const zc_block_shape *shape,
			   const zc_strides *strides, size_t bytes)
{
	zc_block_layout layout;
	unsigned parts = parts_for(f->config, tensor, shape, strides, &layout);
	if (parts == 0 || (f->reconstruct && parts == 1) ||
	    (f->reconstruct ? bytes != layout.total_bytes : bytes < layout.total_bytes))
		return 0;
	f->work[f->n_work++] = (struct work){ .tensor = tensor, .shape = *shape,
					      .strides = strides, .head_bytes = layout.head_bytes,
					      .heads = layout.heads };
	f->tasks += layout.heads;
	f->parts = parts > f->parts ? parts : f->parts;
	return parts;
}

static int64_t compress_one(const zc_codec_config *config, const struct codec_fanout_tensor *t);

int codec_fanout_compress_block(const zc_codec_config *config,
				const struct codec_fanout_tensor *tensors, size_t n)
{
	struct fanout f = { .config = config };
	bool direct = n == 0 || n > CODEC_FANOUT_MAX_TENSORS;
	for (size_t i = 0; i < n && !direct; i++) {
		const struct codec_fanout_tensor *t = &tensors[i];
		direct = fanout_add(&f, t->tensor, &t->shape, t->strides, t->capacity) == 0;
		if (!direct) {
			struct work *w = &f.work[i];
			w->input = t->input;
			w->scores = t->scores;
			w->out = t->out;
			w->sink = t->sink;
			w->view = t->view;
			w->view_strides = t->view_strides;
		}
	}
	/* A tensor the threads would not take: one tensor after the other,
	 * the same bytes and, for a malformed call, the codec's own error. */
	if (direct) {
		for (size_t i = 0; i < n; i++) {
			int64_t rc = compress_one(config, &tensors[i]);
			if (rc < 0)
				return (int)rc;
		}
		return 0;
	}
	return fanout_run(&f);
}

/* One tensor: on threads if it is worth them, else the codec's own call. */
static int64_t compress_one(const zc_codec_config *config, const struct codec_fanout_tensor *t)
{
	zc_block_layout layout;
	if (parts_for(config, t->tensor, &t->shape, t->strides, &layout) == 0 ||
	    t->capacity < layout.total_bytes)
		return compress_direct(config, t);
	int rc = codec_fanout_compress_block(config, t, 1);
	return rc < 0 ? rc : (int64_t)layout.total_bytes;
}

int64_t codec_fanout_compress(const zc_codec_config *config, zc_tensor tensor,
			      const zc_block_shape *shape, const uint16_t *input,
			      const zc_strides *strides, const float *scores, void *out,
			      size_t capacity, const struct codec_sink *sink)
{
	const struct codec_fanout_tensor t = { tensor, *shape, input, strides, scores,
					       out, capacity, sink, NULL, NULL };
	return compress_one(config, &t);
}

int codec_fanout_reconstruct_block(const zc_codec_config *config,
				   const struct codec_fanout_view *views, size_t n)
{
	struct fanout f = { .config = config, .reconstruct = true };
	bool direct = n == 0 || n > CODEC_FANOUT_MAX_TENSORS;
	for (size_t i = 0; i < n && !direct; i++) {
		const struct codec_fanout_view *v = &views[i];
		direct = fanout_add(&f, v->tensor, &v->shape, v->strides, v->size) == 0;
		if (!direct) {
			f.work[i].compressed = v->compressed;
			f.work[i].view = v->out;
		}
	}
	if (direct) {
		for (size_t i = 0; i < n; i++) {
			const struct codec_fanout_view *v = &views[i];
			int rc = n > 1 ? codec_fanout_reconstruct_block(config, v, 1) :
					 zc_block_reconstruct(config, v->tensor, &v->shape,
							      v->compressed, v->size, v->out,
							      v->strides);
			if (rc < 0)
				return rc;
		}
		return 0;
	}
	return fanout_run(&f);
}

int codec_fanout_reconstruct(const zc_codec_config *config, zc_tensor tensor,
			     const zc_block_shape *shape, const void *compressed, size_t size,
			     uint16_t *out, const zc_strides *strides)
{
	const struct codec_fanout_view v = { tensor, *shape, compressed, size, out, strides };
	return codec_fanout_reconstruct_block(config, &v, 1);
}
