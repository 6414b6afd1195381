/*
 * Sessions and their work queues. A session is one sequence's store plus
 * a FIFO of jobs; its jobs run one at a time, in order (so requests on one
 * (session, layer) can never overtake each other), either right away on
 * the loop thread or, when costly, on the daemon's worker threads
 * (workers.h) so a prefill or a view rebuild does not stall other
 * sessions' decode steps.
 */
#ifndef ZIPCACHE_SESSION_H
#define ZIPCACHE_SESSION_H

#include <stdbool.h>
#include <stdint.h>

#include "store.h"
#include "workers.h"

struct session;

struct job {
	struct worker_task task;      /* when it runs on a worker thread */
	struct job *next;
	struct session *session;
	struct session_table *table;  /* set by session_submit */
	/* Elements the job writes: those of its new tokens plus those of the
	 * dropped views it rebuilds. Above the table's offload_elements it runs
	 * on a worker thread; the one rule for every kind of job. */
	uint64_t cost;
	bool observe_only;            /* looking is not using: idle time keeps running */
	/* Whether the job may start while deferred flushes of the session are
	 * pending (session_flush_start): NULL, never (it waits for them all). */
	bool (*may_overlap_flush)(struct job *job);
	/* Runs with the session to itself (loop or worker thread). */
	void (*run)(struct job *job);
	/* Runs on the loop thread after run; owns and frees the job. */
	void (*done)(struct job *job);
};

/* Layer accounting summed: over every session's layers for metrics, or
 * over one session's layers for its stats. */
struct session_totals {
	uint64_t tokens;
	uint64_t residual_tokens;
	uint64_t blocks;
	zc_byte_count key;
	zc_byte_count value;
};

/* The one place layer accounting is summed: adds s to *totals (sign 1)
 * or takes it back out (sign -1). */
void session_totals_add(struct session_totals *totals, const struct store_layer_stats *s, int sign);

struct session {
	uint64_t id;
	uint32_t owner_uid;
	char name[STORE_NAME_BYTES];
	struct store *store;
	uint64_t last_used_ms;
	struct job *queue_head, *queue_tail;
	bool running;                 /* a job of this session is executing */
	uint32_t flushes;             /* deferred flushes begun, not yet published */
	bool closed;                  /* closed: no new work, freed when idle */
	unsigned refs;                /* jobs and lookups holding it */
	/* Each layer's accounting as last added to the table's totals. */
	struct store_layer_stats *accounted;
	/* Clients whose views of this session memory relief must not drop
	 * (docs/MAP.md): one per connection, until its deadline. */
	struct session_lease *leases;
	uint32_t n_leases, lease_capacity;
};

struct session_lease {
	uint64_t peer_id;
	uint64_t until_ms;
};

struct session_table {
	struct session **items;
	size_t count, capacity;
	uint64_t next_id;
	struct workers *workers;      /* NULL or without threads: every job inline */
	uint64_t jobs_in_flight;
	uint64_t offload_elements;    /* --offload-elements */
	struct session_totals totals;
};

void session_table_init(struct session_table *table, struct workers *workers,
			uint64_t offload_elements);

/* A connection's lease on a session's views: each call on the session
 * renews it to until_ms (a call that cannot be recorded leaves the views
 * unprotected, never the daemon stuck); release or the connection's end
 * takes it back. */
void session_lease(struct session *session, uint64_t peer_id, uint64_t until_ms);
void session_lease_release(struct session *session, uint64_t peer_id);
void session_table_release_peer(struct session_table *table, uint64_t peer_id);
/* Whether any lease runs past now. */
bool session_leased(const struct session *session, uint64_t now_ms);
/* Closes every store (keeping the files) and frees the table. */
void session_table_free(struct session_table *table);

/* Adds a session that owns `store`; the id comes from the store's header. */
int session_table_add(struct session_table *table, struct store *store, struct session **out);

/* The session with this id if `uid` owns it (NULL otherwise: another
 * user's session does not exist for the caller). */
struct session *session_find(struct session_table *table, uint64_t id, uint32_t uid);
struct session *session_find_name(struct session_table *table, const char *name, uint32_t uid);

/* Marks a session closed and takes it out of the table (its name and id
 * are free again); remove_file deletes its shared memory. The memory
 * itself goes with session_release_if_unused(). */
void session_retire(struct session_table *table, struct session *session, bool remove_file);

/* Frees a retired session once no job holds it; true if it was freed. */
bool session_release_if_unused(struct session *session);

/* Queues a job behind the session's others and starts it if it is first. */
void session_submit(struct session_table *table, struct job *job);

/* Queues a job ahead of the others: a retry keeps its place in line. */
void session_submit_front(struct session_table *table, struct job *job);

bool session_idle(const struct session *session);

/* Runs a job that belongs to no session yet (an import: it makes one) on
 * a worker thread; done runs on the loop thread. Counted in flight, so a
 * stopping server waits for it. job->session is NULL. */
void session_table_run_detached(struct session_table *table, struct job *job);

/*
 * After a reply: compresses the layer's full residual on a worker thread
 * (store_flush_begin / _compress), then publishes it as a job at the head
 * of the session's queue. Meanwhile the session's jobs that may overlap a
 * flush (short appends that fit beside it) go on; the others wait for
 * the publish. Nothing when no flush is due.
 */
void session_flush_start(struct session_table *table, struct session *session, uint32_t layer);

/* Open sessions `uid` holds. */
uint32_t session_count_of_uid(const struct session_table *table, uint32_t uid);

/* Moves the table's totals from what a layer was last counted as to `now`
 * (a snapshot a job took). Loop thread only. */
void session_account_layer(struct session_table *table, struct session *session,
			   const struct store_layer_stats *now);

/* Re-counts every layer from the store; only while no job runs on it. */
void session_account_all(struct session_table *table, struct session *session);

uint64_t session_now_ms(void);

#endif
