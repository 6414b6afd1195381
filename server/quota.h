/*
 * Per-uid quotas: how much of the daemon's sessions, connections, memory
 * and staging buffers one user may hold, so that one user filling a
 * daemon-wide limit does not lock every other user out. One entry per uid
 * that connected or owns a session, made on first use and kept for the
 * daemon's life (uids on a machine are few, and the entry also carries the
 * uid's request counters for stats). Loop thread only, except the two
 * budgets, which jobs on the thread pool charge atomically (store.c).
 *
 * Root and the daemon's own uid are trusted and exempt: either can stop
 * the daemon or remove its files anyway, so a quota would protect nothing
 * from them; and a single-user deployment (the Kubernetes sidecar runs
 * daemon and workers as one uid) keeps the daemon-wide limits as before.
 */
#ifndef ZIPCACHE_QUOTA_H
#define ZIPCACHE_QUOTA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"

struct options;

/* Derived defaults: a uid may hold 1/QUOTA_DEFAULT_SHARE of each
 * daemon-wide limit (sessions, connections, memory budget), so no single
 * one exhausts it; and QUOTA_DEFAULT_STAGING_BUFFERS full-size staging
 * buffers (--max-staging-bytes each) over all its connections. */
#define QUOTA_DEFAULT_SHARE 2
#define QUOTA_DEFAULT_STAGING_BUFFERS 4

/* What one uid may hold; 0: no per-uid limit. */
struct quota_limits {
	uint64_t sessions;
	uint64_t connections;
	uint64_t memory;    /* bytes of the memory budget */
	uint64_t staging;   /* bytes of staging buffers */
};

/* One uid's holdings and counters. */
struct quota_usage {
	uint32_t uid;
	bool trusted;
	struct store_budget memory;    /* the uid's quota; parent: the daemon's budget */
	struct store_budget staging;   /* the uid's staging bytes; parent: the daemon's */
	uint32_t connections;
	uint64_t reply_queue_bytes;
	uint64_t requests, request_errors, tokens_appended;
};

struct quota_table {
	struct quota_usage **items;    /* each allocated once: budgets never move */
	size_t count, capacity;
	struct quota_limits limits;
	struct store_budget *memory_parent;
	struct store_budget *staging_parent;
	uint32_t daemon_uid;
};

/* The per-uid limits the options ask for, OPTIONS_DERIVED resolved (the
 * memory budget must be resolved already). */
void quota_limits_resolve(const struct options *options, struct quota_limits *out);

void quota_table_init(struct quota_table *table, const struct quota_limits *limits,
		      struct store_budget *memory_parent, struct store_budget *staging_parent,
		      uint32_t daemon_uid);

/* Frees every entry; only after every store and staging buffer charged
 * to one is gone. */
void quota_table_free(struct quota_table *table);

/* Root and the daemon's own uid. */
bool quota_trusted(const struct quota_table *table, uint32_t uid);

/* The uid's entry, made on first use; NULL only when out of memory. */
struct quota_usage *quota_usage_of(struct quota_table *table, uint32_t uid);

/* The budget to charge a store of this uid's to: the uid's, whose parent
 * is the daemon-wide one. Never NULL: when no entry can be made it is the
 * daemon-wide budget itself. */
struct store_budget *quota_budget(struct quota_table *table, uint32_t uid);

/* The limits that apply to an entry (all 0 for a trusted uid). */
const struct quota_limits *quota_limits_of(const struct quota_table *table,
					   const struct quota_usage *usage);

#endif
