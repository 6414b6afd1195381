/* Per-uid quotas: a small table of entries by uid (see quota.h). */
#include "quota.h"

#include <stdlib.h>

#include "options.h"

static const struct quota_limits no_limits;

/* 1/QUOTA_DEFAULT_SHARE of a limit, rounded up so a limit of 1 still
 * lets each uid have one; no limit stays none. */
static uint64_t share_of(uint64_t limit)
{
	return (limit + QUOTA_DEFAULT_SHARE - 1) / QUOTA_DEFAULT_SHARE;
}

static uint64_t resolved(uint64_t asked, uint64_t derived)
{
	return asked == OPTIONS_DERIVED ? derived : asked;
}

void quota_limits_resolve(const struct options *options, struct quota_limits *out)
{
	uint64_t staging = options->max_staging_bytes > UINT64_MAX / QUOTA_DEFAULT_STAGING_BUFFERS ?
				   UINT64_MAX : options->max_staging_bytes * QUOTA_DEFAULT_STAGING_BUFFERS;
	out->sessions = resolved(options->max_sessions_per_uid, share_of(options->max_sessions));
	out->connections = resolved(options->max_connections_per_uid,
				    share_of(options->max_connections));
	out->memory = resolved(options->memory_budget_per_uid, share_of(options->memory_budget));
	out->staging = resolved(options->max_staging_bytes_per_uid, staging);
}

void quota_table_init(struct quota_table *table, const struct quota_limits *limits,
		      struct store_budget *memory_parent, struct store_budget *staging_parent,
		      uint32_t daemon_uid)
{
	*table = (struct quota_table){
		.limits = *limits,
		.memory_parent = memory_parent,
		.staging_parent = staging_parent,
		.daemon_uid = daemon_uid,
	};
}

void quota_table_free(struct quota_table *table)
{
	for (size_t i = 0; i < table->count; i++)
		free(table->items[i]);
	free(table->items);
	table->items = NULL;
	table->count = table->capacity = 0;
}

bool quota_trusted(const struct quota_table *table, uint32_t uid)
{
	return uid == 0 || uid == table->daemon_uid;
}

const struct quota_limits *quota_limits_of(const struct quota_table *table,
					   const struct quota_usage *usage)
{
	return usage->trusted ? &no_limits : &table->limits;
}

struct quota_usage *quota_usage_of(struct quota_table *table, uint32_t uid)
{
	for (size_t i = 0; i < table->count; i++)
		if (table->items[i]->uid == uid)
			return table->items[i];
	if (table->count == table->capacity) {
		size_t capacity = table->capacity ? table->capacity * 2 : 8;
		struct quota_usage **items = realloc(table->items, capacity * sizeof(*items));
		if (!items)
			return NULL;
		table->items = items;
		table->capacity = capacity;
	}
	struct quota_usage *usage = calloc(1, sizeof(*usage));
	if (!usage)
		return NULL;
	usage->uid = uid;
	usage->trusted = quota_trusted(table, uid);
	const struct quota_limits *limits = quota_limits_of(table, usage);
	usage->memory = (struct store_budget){ .limit = limits->memory, .parent = table->memory_parent };
	usage->staging = (struct store_budget){ .limit = limits->staging, .parent = table->staging_parent };
	table->items[table->count++] = usage;
	return usage;
}

struct store_budget *quota_budget(struct quota_table *table, uint32_t uid)
{
	struct quota_usage *usage = quota_usage_of(table, uid);
	return usage ? &usage->memory : table->memory_parent;
}
