/* The session table and each session's serial job queue. */
#include "session.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_layout.h"
#include "log.h"
#include "zipcache/error.h"

uint64_t session_now_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000;
}

void session_lease(struct session *session, uint64_t peer_id, uint64_t until_ms)
{
	uint64_t now = session_now_ms();
	for (uint32_t i = 0; i < session->n_leases;) {
		/* Expired leases are forgotten here, the one place that adds. */
		if (session->leases[i].until_ms <= now && session->leases[i].peer_id != peer_id) {
			session->leases[i] = session->leases[--session->n_leases];
			continue;
		}
		i++;
	}
	for (uint32_t i = 0; i < session->n_leases; i++) {
		if (session->leases[i].peer_id == peer_id) {
			session->leases[i].until_ms = until_ms;
			return;
		}
	}
	if (session->n_leases == session->lease_capacity) {
		uint32_t capacity = session->lease_capacity ? session->lease_capacity * 2 : 4;
		struct session_lease *grown = realloc(session->leases, capacity * sizeof(*grown));
		if (!grown)
			return;
		session->leases = grown;
		session->lease_capacity = capacity;
	}
	session->leases[session->n_leases++] = (struct session_lease){ peer_id, until_ms };
}

void session_lease_release(struct session *session, uint64_t peer_id)
{
	for (uint32_t i = 0; i < session->n_leases; i++) {
		if (session->leases[i].peer_id == peer_id) {
			session->leases[i] = session->leases[--session->n_leases];
			return;
		}
	}
}

void session_table_release_peer(struct session_table *table, uint64_t peer_id)
{
	for (size_t i = 0; i < table->count; i++)
		session_lease_release(table->items[i], peer_id);
}

bool session_leased(const struct session *session, uint64_t now_ms)
{
	for (uint32_t i = 0; i < session->n_leases; i++)
		if (session->leases[i].until_ms > now_ms)
			return true;
	return false;
}

void session_table_init(struct session_table *table, struct workers *workers,
			uint64_t offload_elements)
{
	memset(table, 0, sizeof(*table));
	table->workers = workers;
	table->next_id = 1;
	table->offload_elements = offload_elements;
}

static void session_free(struct session *session, bool remove_file)
{
	store_close(session->store, remove_file);
	free(session->leases);
	free(session->accounted);
	free(session);
}

void session_totals_add(struct session_totals *totals, const struct store_layer_stats *s, int sign)
{
	/* Unsigned wrap-around makes subtraction by adding the negation exact. */
	uint64_t k = (uint64_t)(int64_t)sign;
	totals->tokens += k * s->tokens;
	totals->residual_tokens += k * s->residual_tokens;
	totals->blocks += k * s->blocks;
	totals->key.compressed += k * s->key.compressed;
	totals->key.baseline += k * s->key.baseline;
	totals->key.fp16 += k * s->key.fp16;
	totals->value.compressed += k * s->value.compressed;
	totals->value.baseline += k * s->value.baseline;
	totals->value.fp16 += k * s->value.fp16;
}

uint32_t session_count_of_uid(const struct session_table *table, uint32_t uid)
{
	uint32_t count = 0;
	for (size_t i = 0; i < table->count; i++)
		count += table->items[i]->owner_uid == uid && !table->items[i]->closed;
	return count;
}

void session_account_layer(struct session_table *table, struct session *session,
			   const struct store_layer_stats *now)
{
	if (!session->accounted || session->closed)
		return;
	struct store_layer_stats *before = &session->accounted[now->layer];
	session_totals_add(&table->totals, before, -1);
	session_totals_add(&table->totals, now, 1);
	*before = *now;
}

void session_account_all(struct session_table *table, struct session *session)
{
	uint32_t layers = store_header(session->store)->layers;
	for (uint32_t i = 0; i < layers; i++) {
		struct store_layer_stats now;
		store_layer_stats(session->store, i, &now);
		session_account_layer(table, session, &now);
	}
}

void session_table_free(struct session_table *table)
{
	for (size_t i = 0; i < table->count; i++)
		session_free(table->items[i], false);
	free(table->items);
	memset(table, 0, sizeof(*table));
}

int session_table_add(struct session_table *table, struct store *store, struct session **out)
{
	const struct store_header *h = store_header(store);
	if (table->count == table->capacity) {
		size_t capacity = table->capacity ? table->capacity * 2 : 16;
		struct session **items = realloc(table->items, capacity * sizeof(*items));
		if (!items)
			return -ENOMEM;
		table->items = items;
		table->capacity = capacity;
	}
	struct session *session = calloc(1, sizeof(*session));
	if (!session)
		return -ENOMEM;
	session->id = h->session_id;
	session->owner_uid = h->owner_uid;
	memcpy(session->name, h->name, sizeof(session->name));
	session->store = store;
	session->last_used_ms = session_now_ms();
	session->accounted = calloc(h->layers, sizeof(*session->accounted));
	if (!session->accounted) {
		free(session);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < h->layers; i++)
		session->accounted[i].layer = i;
	table->items[table->count++] = session;
	if (session->id >= table->next_id)
		table->next_id = session->id + 1;
	session_account_all(table, session);
	*out = session;
	return 0;
}

struct session *session_find(struct session_table *table, uint64_t id, uint32_t uid)
{
	for (size_t i = 0; i < table->count; i++) {
		struct session *s = table->items[i];
		if (s->id == id && s->owner_uid == uid && !s->closed)
			return s;
	}
	return NULL;
}

struct session *session_find_name(struct session_table *table, const char *name, uint32_t uid)
{
	for (size_t i = 0; i < table->count; i++) {
		struct session *s = table->items[i];
		if (s->owner_uid == uid && !s->closed && strcmp(s->name, name) == 0)
			return s;
	}
	return NULL;
}

bool session_idle(const struct session *session)
{
	return !session->running && !session->queue_head && session->flushes == 0;
}

void session_retire(struct session_table *table, struct session *session, bool remove_file)
{
	uint32_t layers = store_header(session->store)->layers;
	for (uint32_t i = 0; i < layers; i++)
		session_totals_add(&table->totals, &session->accounted[i], -1);
	session->closed = true;
	for (size_t i = 0; i < table->count; i++) {
		if (table->items[i] == session) {
			table->items[i] = table->items[--table->count];
			break;
		}
	}
	if (remove_file)
		store_unlink(session->store);
}

bool session_release_if_unused(struct session *session)
{
	if (!session->closed || !session_idle(session) || session->refs > 0)
		return false;
	session_free(session, false);
	return true;
}

static void session_start_next(struct session_table *table, struct session *session);

/* Bookkeeping after a job's run, on the loop thread. Returns true when the
 * job was the last holder of a closed session, which is now freed. */
static bool job_complete(struct session_table *table, struct job *job)
{
	struct session *session = job->session;
	session->running = false;
	if (!job->observe_only)
		session->last_used_ms = session_now_ms();
	table->jobs_in_flight--;
	session->refs--;
	job->done(job);
	/* Jobs queued behind a close still run (and answer NOT_FOUND). */
	return session_release_if_unused(session);
}

/* The job a worker task belongs to. */
static struct job *job_of(struct worker_task *task)
{
	return (struct job *)((char *)task - offsetof(struct job, task));
}

static void job_work(struct worker_task *task)
{
	struct job *job = job_of(task);
	job->run(job);
}

static void job_after_work(struct worker_task *task)
{
	struct job *job = job_of(task);
	struct session_table *table = job->table;
	struct session *session = job->session;
	if (!job_complete(table, job))
		session_start_next(table, session);
}

/* Runs queued jobs until one goes to the thread pool or the queue is
 * empty; a loop, not recursion, so a long queue cannot grow the stack. */
static void session_start_next(struct session_table *table, struct session *session)
{
	while (!session->running && session->queue_head) {
		struct job *job = session->queue_head;
		/* The head waits for the flushes it may not overlap; the ones
		 * behind it wait for it (order per session). */
		if (session->flushes > 0 &&
		    !(job->may_overlap_flush && job->may_overlap_flush(job)))
			return;
		session->queue_head = job->next;
		if (!session->queue_head)
			session->queue_tail = NULL;
		job->next = NULL;
		session->running = true;
		if (job->cost > table->offload_elements) {
			job->task = (struct worker_task){ .work = job_work, .after = job_after_work };
			if (workers_submit(table->workers, &job->task) == 0)
				return;
		}
		job->run(job);
		if (job_complete(table, job))
			return;
	}
}

void session_submit(struct session_table *table, struct job *job)
{
	struct session *session = job->session;
	job->next = NULL;
	job->table = table;
	session->refs++;
	table->jobs_in_flight++;
	if (session->queue_tail)
		session->queue_tail->next = job;
	else
		session->queue_head = job;
	session->queue_tail = job;
	session_start_next(table, session);
}

void session_submit_front(struct session_table *table, struct job *job)
{
	struct session *session = job->session;
	job->table = table;
	session->refs++;
	table->jobs_in_flight++;
	job->next = session->queue_head;
	session->queue_head = job;
	if (!session->queue_tail)
		session->queue_tail = job;
	session_start_next(table, session);
}

static void detached_after_work(struct worker_task *task)
{
	struct job *job = job_of(task);
	job->table->jobs_in_flight--;
	job->done(job);
}

void session_table_run_detached(struct session_table *table, struct job *job)
{
	job->next = NULL;
	job->table = table;
	job->session = NULL;
	table->jobs_in_flight++;
	job->task = (struct worker_task){ .work = job_work, .after = detached_after_work };
	if (workers_submit(table->workers, &job->task) == 0)
		return;
	job->run(job);
	table->jobs_in_flight--;
	job->done(job);
}

/* ---- deferred residual flushes ---- */

struct flush_task {
	struct job publish;           /* first: queued as a job once compressed */
	struct worker_task compress;
	struct store_flush flush;
};

static bool flush_publish_overlaps(struct job *job)
{
	(void)job;
	return true;  /* it is what the others wait for */
}

static void flush_publish_run(struct job *job)
{
	struct flush_task *task = (struct flush_task *)job;
	struct session *session = job->session;
	if (session->closed) {
		store_flush_abandon(session->store, &task->flush);
		return;
	}
	int rc = store_flush_publish(session->store, &task->flush);
	if (rc < 0)
		log_warn("session", "residual flush deferred", "session=%llu layer=%u error=%s",
			 (unsigned long long)session->id, task->flush.layer,
			 rc == STORE_EBUDGET ? "memory budget exhausted" : zc_strerror(rc));
}

static void flush_publish_done(struct job *job)
{
	struct flush_task *task = (struct flush_task *)job;
	struct session *session = job->session;
	struct store_layer_stats stats;

	session->flushes--;
	if (!session->closed) {
		store_layer_stats(session->store, task->flush.layer, &stats);
		session_account_layer(task->publish.table, session, &stats);
		/* Rows appended beside it may fill the residual again (only when
		 * they reached R: they waited for this publish). Not after a
		 * refused publish (the budget, index space): the residual is
		 * still full, and flushing it again at once would compress and
		 * refuse it forever, with the jobs that wait for the flush
		 * never run; the next update of the layer tries again. The
		 * flush's rc holds the publish's refusal too. */
		if (task->flush.rc == 0)
			session_flush_start(task->publish.table, session, task->flush.layer);
	}
	free(task);
	/* job_complete starts the queue again (the jobs that waited for it). */
}

/* The flush a compress task belongs to. */
static struct flush_task *flush_task_of(struct worker_task *work)
{
	return (struct flush_task *)((char *)work - offsetof(struct flush_task, compress));
}

static void flush_compress_work(struct worker_task *work)
{
	struct flush_task *task = flush_task_of(work);
	store_flush_compress(task->publish.session->store, &task->flush);
}

static void flush_compress_after(struct worker_task *work)
{
	struct flush_task *task = flush_task_of(work);
	struct session_table *table = task->publish.table;
	struct session *session = task->publish.session;
	/* The task's own hold passes to the publish job's. */
	session->refs--;
	table->jobs_in_flight--;
	session_submit_front(table, &task->publish);
}

void session_flush_start(struct session_table *table, struct session *session, uint32_t layer)
{
	if (session->closed || !store_flush_due(session->store, layer))
		return;
	struct flush_task *task = calloc(1, sizeof(*task));
	if (!task)
		return;  /* the residual stays exact; the next update tries again */
	if (store_flush_begin(session->store, layer, &task->flush) < 0) {
		free(task);
		return;
	}
	const struct store_header *h = store_header(session->store);
	task->publish.session = session;
	task->publish.table = table;
	task->publish.may_overlap_flush = flush_publish_overlaps;
	task->publish.run = flush_publish_run;
	task->publish.done = flush_publish_done;
	/* The publish writes the reconstruction into the views (views = full). */
	task->publish.cost = store_views_full(session->store) ?
		kv_block_elements(h->batch, h->kv_heads, task->flush.rows, h->head_dim_k) +
		kv_block_elements(h->batch, h->kv_heads, task->flush.rows, h->head_dim_v) : 0;
	session->flushes++;
	session->refs++;
	table->jobs_in_flight++;
	task->compress = (struct worker_task){ .work = flush_compress_work,
					       .after = flush_compress_after };
	if (workers_submit(table->workers, &task->compress) < 0) {
		/* Inline instead (no worker threads): slower for this caller's
		 * next step, never lost. */
		store_flush_compress(session->store, &task->flush);
		flush_compress_after(&task->compress);
	}
}
