/*
 * Per-uid quotas (server/quota.c), without a daemon: the defaults derived
 * from the daemon-wide limits, the trusted uids, entries made on first
 * use that never move, and each uid's memory budget nested in the
 * daemon's so that a charge is refused by whichever is short.
 */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "../server/options.h"
#include "../server/quota.h"
#include "../server/store.h"
#include "suite_main.h"

#define DAEMON_UID 10001u

static void quota_options(struct options *o)
{
	options_default(o);
	o->max_sessions = 1024;
	o->max_connections = 1024;
	o->memory_budget = 8u << 20;
	o->max_staging_bytes = 1u << 20;
}

START_TEST(defaults_are_a_share_of_each_daemon_wide_limit)
{
	struct options o;
	struct quota_limits limits;

	quota_options(&o);
	quota_limits_resolve(&o, &limits);
	ck_assert_uint_eq(limits.sessions, 1024 / QUOTA_DEFAULT_SHARE);
	ck_assert_uint_eq(limits.connections, 1024 / QUOTA_DEFAULT_SHARE);
	ck_assert_uint_eq(limits.memory, (8u << 20) / QUOTA_DEFAULT_SHARE);
	ck_assert_uint_eq(limits.staging, (1u << 20) * QUOTA_DEFAULT_STAGING_BUFFERS);
	/* Below the daemon-wide limit, so one uid cannot take it all. */
	ck_assert_uint_lt(limits.sessions, o.max_sessions);
	ck_assert_uint_lt(limits.memory, o.memory_budget);

	/* A limit of 1 still leaves each uid one; no budget gives no quota. */
	o.max_sessions = 1;
	o.max_connections = 3;
	o.memory_budget = 0;
	quota_limits_resolve(&o, &limits);
	ck_assert_uint_eq(limits.sessions, 1);
	ck_assert_uint_eq(limits.connections, 2);
	ck_assert_uint_eq(limits.memory, 0);

	/* What the flags say wins, 0 meaning no per-uid limit. */
	o.max_sessions_per_uid = 7;
	o.max_connections_per_uid = 0;
	o.memory_budget_per_uid = 12345;
	o.max_staging_bytes_per_uid = 0;
	quota_limits_resolve(&o, &limits);
	ck_assert_uint_eq(limits.sessions, 7);
	ck_assert_uint_eq(limits.connections, 0);
	ck_assert_uint_eq(limits.memory, 12345);
	ck_assert_uint_eq(limits.staging, 0);
}
END_TEST

START_TEST(root_and_the_daemons_uid_have_no_quota)
{
	struct quota_limits limits = { .sessions = 2, .connections = 3, .memory = 4096, .staging = 8192 };
	struct store_budget daemon = { .limit = 1u << 20 }, staging = { 0 };
	struct quota_table table;

	quota_table_init(&table, &limits, &daemon, &staging, DAEMON_UID);
	ck_assert(quota_trusted(&table, 0));
	ck_assert(quota_trusted(&table, DAEMON_UID));
	ck_assert(!quota_trusted(&table, 1000));
	const uint32_t trusted[] = { 0, DAEMON_UID };
	for (int i = 0; i < 2; i++) {
		struct quota_usage *u = quota_usage_of(&table, trusted[i]);
		ck_assert_ptr_nonnull(u);
		ck_assert(u->trusted);
		const struct quota_limits *l = quota_limits_of(&table, u);
		ck_assert_uint_eq(l->sessions + l->connections + l->memory + l->staging, 0);
		ck_assert_uint_eq(u->memory.limit, 0);
		/* Still counted, inside the daemon's budget. */
		ck_assert_ptr_eq(u->memory.parent, &daemon);
	}
	struct quota_usage *other = quota_usage_of(&table, 1000);
	ck_assert(!other->trusted);
	ck_assert_ptr_eq(quota_limits_of(&table, other), &table.limits);
	ck_assert_uint_eq(other->memory.limit, 4096);
	ck_assert_uint_eq(other->staging.limit, 8192);
	ck_assert_ptr_eq(other->staging.parent, &staging);
	quota_table_free(&table);
}
END_TEST

START_TEST(entries_are_made_once_and_never_move)
{
	struct quota_limits limits = { 0 };
	struct store_budget daemon = { 0 };
	struct quota_table table;
	struct quota_usage *first[100];

	quota_table_init(&table, &limits, &daemon, NULL, DAEMON_UID);
	for (uint32_t uid = 0; uid < 100; uid++) {
		first[uid] = quota_usage_of(&table, 5000 + uid);
		ck_assert_ptr_nonnull(first[uid]);
		ck_assert_uint_eq(first[uid]->uid, 5000 + uid);
	}
	/* The table grew many times; every entry (and its budget, which
	 * stores point at) is where it was. */
	for (uint32_t uid = 0; uid < 100; uid++) {
		ck_assert_ptr_eq(quota_usage_of(&table, 5000 + uid), first[uid]);
		ck_assert_ptr_eq(quota_budget(&table, 5000 + uid), &first[uid]->memory);
	}
	ck_assert_uint_eq(table.count, 100);
	quota_table_free(&table);
	ck_assert_uint_eq(table.count, 0);
}
END_TEST

START_TEST(a_uids_budget_is_nested_in_the_daemons)
{
	struct quota_limits limits = { .memory = 100 };
	struct store_budget daemon = { .limit = 150 };
	struct quota_table table;

	quota_table_init(&table, &limits, &daemon, NULL, DAEMON_UID);
	struct store_budget *a = quota_budget(&table, 1001), *b = quota_budget(&table, 1002);
	/* Its own quota refuses first, and then nothing was taken anywhere. */
	ck_assert_int_eq(store_budget_take(a, 80), 0);
	ck_assert_int_eq(store_budget_take(a, 30), STORE_EBUDGET);
	ck_assert_uint_eq(a->used, 80);
	ck_assert_uint_eq(daemon.used, 80);
	/* Another uid has room of its own but the daemon's budget is short. */
	ck_assert_int_eq(store_budget_take(b, 80), STORE_EBUDGET);
	ck_assert_uint_eq(b->used, 0);
	ck_assert_uint_eq(daemon.used, 80);
	ck_assert_int_eq(store_budget_take(b, 70), 0);
	ck_assert_uint_eq(daemon.used, 150);
	/* Giving back returns it to both. */
	store_budget_give(a, 80);
	ck_assert_uint_eq(a->used, 0);
	ck_assert_uint_eq(daemon.used, 70);
	ck_assert_int_eq(store_budget_take(b, 30), 0);
	/* A trusted uid only meets the daemon's budget. */
	struct store_budget *root = quota_budget(&table, 0);
	ck_assert_int_eq(store_budget_take(root, 50), 0);
	ck_assert_int_eq(store_budget_take(root, 1), STORE_EBUDGET);
	quota_table_free(&table);
}
END_TEST

static Suite *quota_suite(void)
{
	Suite *suite = suite_create("quota");
	const struct test_case cases[] = {
		{ "quota", { defaults_are_a_share_of_each_daemon_wide_limit,
			     root_and_the_daemons_uid_have_no_quota, entries_are_made_once_and_never_move,
			     a_uids_budget_is_nested_in_the_daemons, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), 30);
	return suite;
}

int main(void)
{
	return suite_main(quota_suite(), CK_FORK_GETENV);
}
