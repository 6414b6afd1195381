/*
 * Durability, checked deterministically (docs/DURABILITY.md).
 *
 *   fault_points   For every named step of every mutation (server/fault.c)
 *                  and for several of its hits, a daemon started with
 *                  ZIPCACHED_FAULT=STEP:N dies on the spot while one client
 *                  runs a fixed script that reaches every mutation: open,
 *                  direct blocks, residual appends and flushes, a flush
 *                  ahead of a direct block, trims of one layer and of all
 *                  (cutting through blocks), per_call blocks, views dropped
 *                  by memory relief and rebuilt, close. A daemon without
 *                  the fault then adopts the files, and every session must
 *                  equal, bit for bit (views and accounting), the model of
 *                  the acknowledged operations, with the operation in
 *                  flight either wholly applied or wholly absent.
 *   adoption       Files that cannot be opened for a passing reason (a
 *                  descriptor limit) stay where they are, untouched, and
 *                  come back once the daemon can open them; files that
 *                  fail a real check are set aside with a reason; files of
 *                  an unfinished open are removed.
 *   trust          A client of the daemon's own uid cannot resize the
 *                  views it is passed, and what it writes (there, or into
 *                  the durable file it can reach) does not crash the daemon
 *                  or change what it answers.
 *                  The shared-memory directory must be the daemon's own:
 *                  another owner, group or other access, or a symlink, and
 *                  the daemon refuses to start; a planted .lock symlink is
 *                  never followed.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "../server/fault.h"
#include "layer_model.h"
#include "store_format.h"
#include "process_run.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 600

static void daemon_alive_check(zc_client *client, const char *after,
			       const struct daemon_harness *daemon, char *tail, size_t size)
{
	zc_server_stats stats;
	int rc = zc_client_stats(client, &stats);
	ck_assert_msg(rc == 0, "the daemon does not answer after %s: %s; log:\n%s", after,
		      zc_strerror(rc), daemon_log_tail(daemon, tail, size));
}

/* ---- the script ------------------------------------------------------------ */

enum op_kind { OP_OPEN, OP_UPDATE, OP_TRIM, OP_TRIM_LAYER, OP_ATTACH, OP_CLOSE, OP_RELEASE, OP_FORK,
	       OP_IMPORT, OP_PAIR };

/* OP_PAIR: an update of `tokens` that fills the residual and one more
 * token of the same layer, in one write (zc_update_many): the daemon
 * reads both at once, so the second lands beside the deferred flush of
 * the first, and the publish moves it back (compact.*). */

#define SESSIONS 7

enum { S_STREAM, S_PER_CALL, S_IDLE, S_GROWER, S_FORK, S_IMPORT, S_HEIR };

/* S_HEIR: the grower's shape under another name, opened after the grower
 * closed: its map is the grower's kept map, its blocks go into the
 * grower's kept extents (retain.h), so the retained pages' steps
 * (retain.map, pool.retain, pool.reuse) fall inside the script. */

/* OP_FORK: session is the fork, layer the source, tokens where it forks.
 * OP_IMPORT: session is the import, layer the session exported (whole)
 * just before; the export changes nothing and is not the op in flight. */

struct op {
	enum op_kind kind;
	int session;
	uint32_t layer, tokens;
};

/* The budget under which the grower's blocks make relief drop the idle
 * sessions' views (and the idle session's rebuild drop the grower's). */
#define SCRIPT_BUDGET "12M"

static zc_session_config script_config(int session)
{
	static const char *const names[SESSIONS] = { "stream", "per-call", "idle", "grower", "fork",
						     "imported", "heir" };
	zc_session_config c;
	zc_session_config_default(&c);
	c.name = names[session];
	c.batch = 1;
	switch (session) {
	case S_STREAM:
	case S_IMPORT:   /* a copy of S_STREAM */
	case S_FORK:
		c.layers = 2, c.kv_heads = 2, c.head_dim_k = c.head_dim_v = 32, c.max_tokens = 1024;
		/* The fork keeps no fp16: blocks and a readers' residual only. */
		c.views = session == S_FORK ? ZC_VIEWS_NONE : ZC_VIEWS_FULL;
		c.residual_tokens = 8;
		break;
	case S_PER_CALL:
		c.layers = 2, c.kv_heads = 2, c.head_dim_k = 32, c.head_dim_v = 16, c.max_tokens = 256;
		c.policy = ZC_POLICY_PER_CALL;
		break;
	default:
		c.layers = 1, c.kv_heads = 8, c.head_dim_k = c.head_dim_v = 128, c.max_tokens = 2048;
		break;
	}
	return c;
}

static size_t script_make(struct op *ops, size_t capacity)
{
	size_t n = 0;
#define OP(k, s, l, t)                                                                    \
	do {                                                                               \
		ck_assert(n < capacity);                                                   \
		ops[n++] = (struct op){ k, s, l, t };                                      \
	} while (0)
	OP(OP_OPEN, S_STREAM, 0, 0);
	OP(OP_OPEN, S_PER_CALL, 0, 0);
	OP(OP_UPDATE, S_STREAM, 0, 20);
	OP(OP_UPDATE, S_STREAM, 1, 20);
	for (int i = 0; i < 5; i++) {     /* 3, 6, 9 (flushed), 3, 6 */
		OP(OP_UPDATE, S_STREAM, 0, 3);
		OP(OP_UPDATE, S_STREAM, 1, 3);
	}
	OP(OP_PAIR, S_STREAM, 0, 2);      /* 8: flushed after the reply, 1 beside it */
	OP(OP_UPDATE, S_STREAM, 0, 10);   /* the residual of 1 goes ahead as its own block */
	OP(OP_TRIM_LAYER, S_STREAM, 1, 4);
	OP(OP_TRIM, S_STREAM, 0, 15);      /* cuts through blocks of both layers */
	OP(OP_UPDATE, S_STREAM, 0, 3);
	OP(OP_UPDATE, S_STREAM, 1, 3);
	OP(OP_UPDATE, S_STREAM, 0, 12);
	OP(OP_FORK, S_FORK, S_STREAM, 30);  /* shares blocks, cuts one, copies residual rows */
	OP(OP_UPDATE, S_FORK, 0, 3);
	OP(OP_UPDATE, S_FORK, 1, 9);
	OP(OP_TRIM, S_FORK, 0, 5);
	OP(OP_IMPORT, S_IMPORT, S_STREAM, 0);  /* every block, a residual, a trimmed block */
	OP(OP_UPDATE, S_IMPORT, 0, 3);
	OP(OP_UPDATE, S_IMPORT, 1, 12);
	for (int i = 0; i < 3; i++) {
		OP(OP_UPDATE, S_PER_CALL, 0, 1);
		OP(OP_UPDATE, S_PER_CALL, 1, 1 + (uint32_t)i);
	}
	OP(OP_TRIM, S_PER_CALL, 0, 2);
	OP(OP_UPDATE, S_PER_CALL, 0, 5);
	OP(OP_OPEN, S_IDLE, 0, 0);
	OP(OP_UPDATE, S_IDLE, 0, 512);
	OP(OP_UPDATE, S_IDLE, 0, 512);
	OP(OP_RELEASE, S_IDLE, 0, 0);      /* unleased: relief may drop its views */
	OP(OP_OPEN, S_GROWER, 0, 0);
	for (int i = 0; i < 8; i++)
		OP(OP_UPDATE, S_GROWER, 0, 256);
	OP(OP_RELEASE, S_GROWER, 0, 0);    /* so that the rebuild below may drop its views */
	OP(OP_ATTACH, S_IDLE, 0, 0);       /* its views come back */
	OP(OP_UPDATE, S_GROWER, 0, 2);     /* into a dropped view */
	OP(OP_CLOSE, S_PER_CALL, 0, 0);
	OP(OP_UPDATE, S_STREAM, 0, 3);
	OP(OP_CLOSE, S_STREAM, 0, 0);      /* the fork keeps the shared blocks */
	OP(OP_UPDATE, S_FORK, 0, 3);
	OP(OP_CLOSE, S_IMPORT, 0, 0);      /* room under the budget for what is kept */
	OP(OP_CLOSE, S_IDLE, 0, 0);
	OP(OP_CLOSE, S_GROWER, 0, 0);      /* its map and block extents kept */
	OP(OP_OPEN, S_HEIR, 0, 0);         /* the kept map, stale bytes and all */
	OP(OP_UPDATE, S_HEIR, 0, 256);     /* into kept extents */
	OP(OP_UPDATE, S_HEIR, 0, 300);
	OP(OP_TRIM, S_HEIR, 0, 100);
	OP(OP_UPDATE, S_HEIR, 0, 7);
#undef OP
	return n;
}

/* The K/V of op i, the same in every run and replay. */
static void op_block(const struct op *op, size_t i, const struct model *model, struct block *b)
{
	struct rng rng;
	rng_seed(&rng, 0x5eed0000u + i);
	block_make(b, model, op->tokens, &rng);
}

/* The one token an OP_PAIR sends after its first block. */
static void op_second_block(size_t i, const struct model *model, struct block *b)
{
	struct rng rng;
	rng_seed(&rng, 0x5eed8000u + i);
	block_make(b, model, 1, &rng);
}

/* What the run saw of each operation. */
struct outcome {
	int rc;          /* its code when acknowledged */
};

/*
 * Runs the script until the daemon dies; returns how many operations were
 * acknowledged (outcomes[0..n) hold their codes); *died says whether it
 * stopped because the daemon went away.
 */
static size_t script_run(const struct daemon_harness *daemon, const struct op *ops, size_t n_ops,
			 struct outcome *outcomes, bool *died)
{
	zc_client *client = NULL;
	zc_session *sessions[SESSIONS] = { 0 };
	struct model models[SESSIONS];
	bool open[SESSIONS] = { 0 };
	size_t i = 0;

	*died = false;
	int rc = zc_client_connect(daemon->socket_path, CLIENT_TIMEOUT_MS, &client);
	ck_assert_msg(rc == 0, "connect: %s", zc_strerror(rc));
	for (; i < n_ops; i++) {
		const struct op *op = &ops[i];
		zc_session_config config = script_config(op->session);
		uint32_t trimmed = 0;
		struct block block = { 0 };
		zc_view view;

		switch (op->kind) {
		case OP_OPEN:
		case OP_ATTACH:
			config.attach = op->kind == OP_ATTACH;
			if (sessions[op->session])
				zc_session_release(sessions[op->session]);
			sessions[op->session] = NULL;
			rc = zc_session_open(client, &config, &sessions[op->session]);
			if (rc == 0 && !open[op->session]) {
				model_init(&models[op->session], &config);
				open[op->session] = true;
			}
			break;
		case OP_UPDATE:
			op_block(op, i, &models[op->session], &block);
			rc = zc_update_and_fetch(sessions[op->session], op->layer, op->tokens, block.keys,
						 block.values, &view, NULL);
			block_free(&block);
			break;
		case OP_PAIR: {
			struct block second;
			op_block(op, i, &models[op->session], &block);
			op_second_block(i, &models[op->session], &second);
			zc_update pair[2] = { { op->layer, op->tokens, block.keys, block.values },
					      { op->layer, 1, second.keys, second.values } };
			size_t done = 0;
			rc = zc_update_many(sessions[op->session], pair, 2, &done);
			block_free(&block);
			block_free(&second);
			break;
		}
		case OP_TRIM:
			rc = zc_session_trim(sessions[op->session], op->tokens, &trimmed);
			break;
		case OP_TRIM_LAYER:
			rc = zc_session_trim_layer(sessions[op->session], op->layer, op->tokens, &trimmed);
			break;
		case OP_CLOSE:
			rc = zc_session_close(sessions[op->session]);
			sessions[op->session] = NULL;
			break;
		case OP_RELEASE:
			rc = zc_session_release_views(sessions[op->session]);
			break;
		case OP_FORK:
			if (sessions[op->session])
				zc_session_release(sessions[op->session]);
			sessions[op->session] = NULL;
			rc = zc_session_fork(sessions[op->layer], op->tokens, config.name, config.views,
					     &sessions[op->session]);
			if (rc == 0 && !open[op->session]) {
				model_init(&models[op->session], &config);
				open[op->session] = true;
			}
			break;
		case OP_IMPORT: {
			char path[PATH_MAX];
			snprintf(path, sizeof(path), "%s/export.zcsnap", daemon->dir);
			int fd = openat(AT_FDCWD, path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
			ck_assert_int_ge(fd, 0);
			rc = zc_session_export(sessions[op->layer], fd, NULL);
			if (rc == 0) {
				zc_import_options options;
				zc_import_options_default(&options);
				options.name = config.name;
				rc = zc_session_import(client, fd, &options, &sessions[op->session]);
			}
			close(fd);
			if (rc == 0 && !open[op->session]) {
				model_init(&models[op->session], &config);
				open[op->session] = true;
			}
			break;
		}
		}
		if (rc < 0 && daemon_lost(rc)) {
			*died = true;
			break;
		}
		/* Only the budget may refuse anything in the script. */
		ck_assert_msg(rc == 0 || rc == ZC_EEXHAUSTED, "op %zu: %s: %s", i, zc_error_name(rc),
			      zc_client_last_error(client));
		outcomes[i].rc = rc;
	}
	for (int s = 0; s < SESSIONS; s++) {
		if (sessions[s])
			zc_session_release(sessions[s]);
		if (open[s])
			model_free(&models[s]);
	}
	zc_client_close(client);
	return i;
}

/* ---- the expected state ------------------------------------------------------- */

/* How the operation in flight at the crash is taken. */
enum variant {
	ABSENT,            /* never happened */
	APPLIED,           /* wholly applied (a short update: its residual flushed) */
	APPLIED_UNFLUSHED, /* a short update that filled the residual, before its flush */
	PAIR_FIRST,        /* of an OP_PAIR, the first update only */
	VARIANTS
};

struct expected {
	struct model models[SESSIONS];
	bool exists[SESSIONS];
};

static void expected_free(struct expected *e)
{
	for (int s = 0; s < SESSIONS; s++)
		if (e->exists[s])
			model_free(&e->models[s]);
}

static void op_apply(struct expected *e, const struct op *ops, size_t i, enum variant variant)
{
	const struct op *op = &ops[i];
	struct model *m = &e->models[op->session];
	struct block block;

	switch (op->kind) {
	case OP_OPEN: {
		zc_session_config config = script_config(op->session);
		if (!e->exists[op->session])
			model_init(m, &config);
		e->exists[op->session] = true;
		break;
	}
	case OP_ATTACH:
		break;
	case OP_UPDATE:
		op_block(op, i, m, &block);
		if (variant == APPLIED_UNFLUSHED)
			model_append_exact(m, op->layer, op->tokens, block.keys, block.values);
		else
			ck_assert_int_eq(model_update(m, op->layer, op->tokens, block.keys, block.values), 0);
		block_free(&block);
		break;
	case OP_PAIR: {
		struct block second;
		op_block(op, i, m, &block);
		op_second_block(i, m, &second);
		ck_assert_int_eq(model_update(m, op->layer, op->tokens, block.keys, block.values), 0);
		if (variant != PAIR_FIRST)
			ck_assert_int_eq(model_update(m, op->layer, 1, second.keys, second.values), 0);
		block_free(&block);
		block_free(&second);
		break;
	}
	case OP_TRIM:
		model_trim(m, op->tokens);
		break;
	case OP_TRIM_LAYER:
		model_trim_layer(m, op->layer, op->tokens);
		break;
	case OP_CLOSE:
		model_free(m);
		e->exists[op->session] = false;
		break;
	case OP_RELEASE:
		break;
	case OP_FORK:
		if (e->exists[op->session])
			model_free(m);
		model_fork(m, &e->models[op->layer], op->tokens);
		e->exists[op->session] = true;
		break;
	case OP_IMPORT:
		if (e->exists[op->session])
			model_free(m);
		model_fork(m, &e->models[op->layer], UINT32_MAX);
		e->exists[op->session] = true;
		break;
	}
}

/* The acknowledged operations (those refused by the budget changed
 * nothing), then the one in flight as `variant`. */
static void expected_build(struct expected *e, const struct op *ops, const struct outcome *outcomes,
			   size_t acked, bool in_flight, enum variant variant)
{
	memset(e, 0, sizeof(*e));
	for (size_t i = 0; i < acked; i++)
		if (outcomes[i].rc == 0)
			op_apply(e, ops, i, APPLIED);
	if (in_flight && variant != ABSENT)
		op_apply(e, ops, acked, variant);
}

/* Whether the in-flight op can be taken as `variant` at all. */
static bool variant_possible(const struct op *op, const struct expected *acked, enum variant v)
{
	if (v == PAIR_FIRST)
		return op->kind == OP_PAIR;
	if (v != APPLIED_UNFLUSHED)
		return true;
	if (op->kind != OP_UPDATE || !acked->exists[op->session])
		return false;
	const struct model *m = &acked->models[op->session];
	return !model_direct(m, op->tokens) &&
	       m->layer[op->layer].residual + op->tokens >= m->residual_threshold;
}

/* Every session the daemon holds now against `e`; a sentence in why if not. */
static bool daemon_matches(zc_client *client, const struct expected *e, char *why, size_t size)
{
	zc_session_config configs[SESSIONS];
	for (int s = 0; s < SESSIONS; s++)
		configs[s] = script_config(s);
	return daemon_sessions_match(client, configs, e->models, e->exists, SESSIONS, NULL, why,
				     size);
}

/* ---- fault points ------------------------------------------------------------------- */

static const char *op_name(enum op_kind kind)
{
	static const char *const names[] = { "open", "update", "trim", "trim_layer", "attach", "close",
					     "release", "fork", "import", "update pair" };
	return names[kind];
}

/* One run: the script under STEP:HIT, then adoption checked. Returns
 * false when the step was not reached that many times. */
static bool fault_run(const char *step, int hit, const struct op *ops, size_t n_ops)
{
	struct daemon_harness daemon;
	/* Blocks written in place and by copy (--pool-writes), every other hit. */
	const char *const args[] = { "--memory-budget", SCRIPT_BUDGET, "--idle-ttl", "0",
				     "--pool-writes", hit % 2 ? "map" : "copy", NULL };
	const char *const plain[] = { "--idle-ttl", "0", NULL };
	struct outcome outcomes[128] = { 0 };
	char spec[96], tail[4096];
	bool died;

	snprintf(spec, sizeof(spec), "%s:%d", step, hit);
	setenv("ZIPCACHED_FAULT", spec, 1);
	daemon_start(&daemon, args);
	unsetenv("ZIPCACHED_FAULT");
	size_t acked = script_run(&daemon, ops, n_ops, outcomes, &died);
	if (!died) {
		daemon_stop(&daemon);
		daemon_cleanup(&daemon);
		return false;
	}
	int status = daemon_wait_exit(&daemon, 20000);
	ck_assert_msg(status != -1, "%s: the client lost the daemon at op %zu, but it still runs",
		      spec, acked);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == FAULT_EXIT_STATUS,
		      "%s: the daemon ended with status 0x%x, not by the fault; log:\n%s", spec,
		      status, daemon_log_tail(&daemon, tail, sizeof(tail)));

	/* Without a budget, so that every view can be rebuilt to be read. */
	daemon_set_extra_args(&daemon, plain);
	daemon_restart(&daemon);
	zc_client *client = connect_client(&daemon);
	const struct op *inflight = &ops[acked];
	struct expected acked_state;
	expected_build(&acked_state, ops, outcomes, acked, false, ABSENT);
	char whys[VARIANTS][WHY_BYTES] = { "", "", "", "" };
	bool ok = false;
	for (enum variant v = ABSENT; v < VARIANTS && !ok; v++) {
		if (!variant_possible(inflight, &acked_state, v)) {
			snprintf(whys[v], sizeof(whys[v]), "not possible");
			continue;
		}
		struct expected e;
		expected_build(&e, ops, outcomes, acked, true, v);
		ok = daemon_matches(client, &e, whys[v], sizeof(whys[v]));
		expected_free(&e);
	}
	expected_free(&acked_state);
	ck_assert_msg(ok,
		      "%s: killed during op %zu (%s of session %d), after adoption neither state "
		      "holds:\n  without it: %s\n  with it: %s\n  with it, residual not flushed: %s\n"
		      "  its first update only: %s\nlog:\n%s",
		      spec, acked, op_name(inflight->kind), inflight->session, whys[ABSENT],
		      whys[APPLIED], whys[APPLIED_UNFLUSHED], whys[PAIR_FIRST],
		      daemon_log_tail(&daemon, tail, sizeof(tail)));

	/* The adopted sessions go on: one more update where the script stopped. */
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
	return true;
}

/* Whether the comma-separated list names step. */
static bool list_has(const char *list, const char *step)
{
	size_t n = strlen(step);
	for (const char *at = list; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL)
		if (strncmp(at, step, n) == 0 && (at[n] == ',' || at[n] == '\0'))
			return true;
	return false;
}

/* One worker's share of the fault points: every step whose index is
 * `worker` modulo `workers`, at every hit the script reaches. */
static int fault_worker(unsigned worker, unsigned workers, const struct op *ops, size_t n_ops)
{
	static const int hits[] = { 1, 2, 3, 4, 5, 6, 8, 12, 20, 35 };
	int runs = 0;

	/* ZC_FAULT_STEPS=a,b: only those steps (a developer's rerun). */
	const char *only = getenv("ZC_FAULT_STEPS");
	for (size_t s = 0; fault_steps[s]; s++) {
		if (s % workers != worker || (only && !list_has(only, fault_steps[s])))
			continue;
		/* Offload and restore need a Redis: tests/remote_offload_test.c
		 * kills the daemon at each of their steps. */
		if (strncmp(fault_steps[s], "offload.", 8) == 0 ||
		    strncmp(fault_steps[s], "restore.", 8) == 0)
			continue;
		for (size_t h = 0; h < sizeof(hits) / sizeof(hits[0]); h++) {
			bool reached = fault_run(fault_steps[s], hits[h], ops, n_ops);
			ck_assert_msg(reached || h > 0,
				      "the script never reaches step %s: it does not test it",
				      fault_steps[s]);
			if (!reached)
				break;
			runs++;
		}
	}
	return runs;
}

/* The fault points are independent (each run its own daemon, socket and
 * directories), so they are shared between two worker processes: CI's
 * machines have two CPUs, and one run mostly waits for a daemon. */
#define FAULT_WORKERS 2u

START_TEST(every_step_of_every_mutation)
{
	struct op ops[128];
	size_t n_ops = script_make(ops, 128);
	pid_t pids[FAULT_WORKERS];
	int pipes[FAULT_WORKERS][2];
	int runs = 0;

	for (unsigned w = 0; w < FAULT_WORKERS; w++) {
		ck_assert_int_eq(pipe(pipes[w]), 0);
		pids[w] = fork();
		ck_assert_int_ge(pids[w], 0);
		if (pids[w] == 0) {
			/* A failed assertion here reports through Check's own
			 * channel and exits 1, as it would in the test. */
			close(pipes[w][0]);
			int n = fault_worker(w, FAULT_WORKERS, ops, n_ops);
			ssize_t put = write(pipes[w][1], &n, sizeof(n));
			_exit(put == (ssize_t)sizeof(n) ? 0 : 3);
		}
		close(pipes[w][1]);
	}
	bool failed = false;
	for (unsigned w = 0; w < FAULT_WORKERS; w++) {
		int status = 0, n = 0;
		ssize_t got = read(pipes[w][0], &n, sizeof(n));
		close(pipes[w][0]);
		while (waitpid(pids[w], &status, 0) < 0 && errno == EINTR)
			;
		ck_assert_msg(!WIFSIGNALED(status), "fault worker %u was killed by signal %d", w,
			      WTERMSIG(status));
		if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && got == (ssize_t)sizeof(n))
			runs += n;
		else
			failed = true;
	}
	/* A worker that failed sent its assertion's message already; the
	 * test ends with it rather than writing over it. */
	if (failed)
		exit(1);
	fprintf(stderr, "fault points: %d crashes, every one adopted as acknowledged\n", runs);
}
END_TEST

/* The script itself, without faults, leaves what the model says (and
 * shows the budget really dropped views and refused nothing it should not). */
START_TEST(script_without_faults)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", SCRIPT_BUDGET, "--idle-ttl", "0", NULL };
	struct op ops[128];
	struct outcome outcomes[128] = { 0 };
	size_t n_ops = script_make(ops, 128);
	bool died;

	daemon_start(&daemon, args);
	size_t done = script_run(&daemon, ops, n_ops, outcomes, &died);
	ck_assert_msg(!died && done == n_ops, "the daemon died at op %zu", done);
	zc_client *client = connect_client(&daemon);
	zc_server_stats stats;
	ck_assert_int_eq(zc_client_stats(client, &stats), 0);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_set_extra_args(&daemon, NULL);
	daemon_restart(&daemon);
	client = connect_client(&daemon);
	struct expected e;
	expected_build(&e, ops, outcomes, n_ops, false, ABSENT);
	CHECK(daemon_matches, client, &e);
	expected_free(&e);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ---- adoption ------------------------------------------------------------------------ */

static int count_files(const char *dir, const char *suffix)
{
	char command[PATH_MAX + 64];
	snprintf(command, sizeof(command), "ls -a '%s' | grep -c -- '%s$'", dir, suffix);
	FILE *p = popen(command, "r");
	int n = 0;
	if (p) {
		if (fscanf(p, "%d", &n) != 1)
			n = 0;
		pclose(p);
	}
	return n;
}

START_TEST(descriptor_limit_never_sets_files_aside)
{
	enum { FILES = 60 };
	struct daemon_harness daemon;
	const char *const args[] = { "--idle-ttl", "0", NULL };
	zc_session_config config = script_config(S_STREAM);
	char names[FILES][16];

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	for (int i = 0; i < FILES; i++) {
		snprintf(names[i], sizeof(names[i]), "s%d", i);
		config.name = names[i];
		zc_session *session = open_session(client, &config);
		struct model model;
		struct rng rng;
		model_init(&model, &config);
		rng_seed(&rng, (uint64_t)i);
		CHECK(update_checked, client, session, &model, &rng, 0, 5 + (uint32_t)i % 7);
		model_free(&model);
		zc_session_release(session);
	}
	zc_client_close(client);
	daemon_kill(&daemon);

	/* A daemon that can open only a few files: the rest must stay where
	 * they are, untouched (it may not even get to listen). */
	pid_t pid = fork_dying_with_parent(1);
	if (pid == 0) {
		char sock[PATH_MAX];
		struct rlimit low = { 24, 24 };
		snprintf(sock, sizeof(sock), "%s/low.sock", daemon.dir);
		char log_path[PATH_MAX];
		snprintf(log_path, sizeof(log_path), "%s/low.log", daemon.dir);
		if (!freopen(log_path, "w", stderr) || setrlimit(RLIMIT_NOFILE, &low) < 0)
			_exit(2);
		execl(daemon_binary_path(), "zipcached", "--socket", sock, "--shm-dir", daemon.shm_dir,
		      "--metrics-listen", "off", "--idle-ttl", "0", (char *)NULL);
		_exit(3);
	}
	sleep_ms(500);
	kill(pid, SIGKILL);
	int status;
	waitpid(pid, &status, 0);
	ck_assert_msg(!WIFEXITED(status) || WEXITSTATUS(status) == 1,
		      "the low-limit daemon did not run (status 0x%x)", status);
	ck_assert_int_eq(count_files(daemon.shm_dir, ".corrupt"), 0);
	ck_assert_int_eq(count_files(daemon.shm_dir, ".zcs"), FILES);

	daemon_restart(&daemon);
	ck_assert_int_eq(count_files(daemon.shm_dir, ".corrupt"), 0);
	client = connect_client(&daemon);
	zc_session_info infos[FILES + 1];
	size_t count = 0;
	ck_assert_int_eq(zc_client_list_sessions(client, infos, FILES + 1, &count), 0);
	ck_assert_msg(count == FILES, "%zu of %d sessions came back after the descriptor limit",
		      count, FILES);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* A file that fails its checks is set aside with the reason logged; an
 * unfinished open's temporary file is removed; healthy neighbours stay. */
START_TEST(corrupt_files_set_aside_healthy_ones_adopted)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--idle-ttl", "0", NULL };
	zc_session_config config = script_config(S_STREAM);
	char path[PATH_MAX + 64], tail[4096];

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	config.name = "healthy";
	zc_session *healthy = open_session(client, &config);
	struct model model;
	struct rng rng;
	model_init(&model, &config);
	rng_seed(&rng, 7);
	CHECK(update_checked, client, healthy, &model, &rng, 0, 40);
	config.name = "broken";
	zc_session *broken = open_session(client, &config);
	uint64_t broken_id = zc_session_get_info(broken)->id;
	zc_session_release(broken);
	zc_session_release(healthy);
	zc_client_close(client);
	daemon_kill(&daemon);

	/* Break the second file's header; plant an unfinished open. */
	snprintf(path, sizeof(path), "%s/session-%016" PRIx64 ".zcs", daemon.shm_dir, broken_id);
	FILE *f = fopen(path, "r+");
	ck_assert_ptr_nonnull(f);
	fseek(f, 8, SEEK_SET);
	fputc(0x7f, f);   /* the version */
	fclose(f);
	snprintf(path, sizeof(path), "%s/.session-00000000000000aa.zcs.tmp", daemon.shm_dir);
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fclose(f);
	/* Not a session file: never followed, never waited for. */
	snprintf(path, sizeof(path), "%s/session-00000000000000bb.zcs", daemon.shm_dir);
	ck_assert_int_eq(symlink("/etc/passwd", path), 0);

	daemon_restart(&daemon);
	ck_assert_int_eq(count_files(daemon.shm_dir, ".corrupt"), 1);
	ck_assert_int_eq(count_files(daemon.shm_dir, ".tmp"), 0);
	char link_target[64];
	ck_assert_msg(readlink(path, link_target, sizeof(link_target)) > 0,
		      "the planted symlink was renamed or removed");
	ck_assert_msg(strstr(daemon_log_tail(&daemon, tail, sizeof(tail)), "format version") != NULL,
		      "the log does not say why the file was set aside:\n%s", tail);
	client = connect_client(&daemon);
	/* zipcachectl and the stats say which file and why. */
	zc_set_aside_file files[4];
	size_t n_files = 0;
	ck_assert_int_eq(zc_client_set_aside(client, files, 4, &n_files), 0);
	ck_assert_uint_eq(n_files, 2);
	if (!strstr(files[0].file, ".corrupt")) {
		zc_set_aside_file swap = files[0];
		files[0] = files[1];
		files[1] = swap;
	}
	ck_assert_msg(strstr(files[0].file, ".corrupt") && strstr(files[0].reason, "format version"),
		      "set aside: %s: %s", files[0].file, files[0].reason);
	ck_assert_msg(strstr(files[1].file, "bb.zcs") && strstr(files[1].reason, "cannot be opened"),
		      "set aside: %s: %s", files[1].file, files[1].reason);
	char ctl_path[PATH_MAX], out[4096], err[4096];
	int ctl_status = 0;
	snprintf(ctl_path, sizeof(ctl_path), "%s/bin/zipcachectl", build_dir());
	const char *const ctl_argv[] = { ctl_path, "--socket", daemon.socket_path, "set-aside", NULL };
	ck_assert_int_eq(program_run(ctl_argv, &ctl_status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_msg(WIFEXITED(ctl_status) && WEXITSTATUS(ctl_status) == 0 &&
			      strstr(out, files[0].file) && strstr(out, "format version"),
		      "zipcachectl set-aside printed:\n%s%s", out, err);
	config.name = "healthy";
	config.attach = true;
	healthy = open_session(client, &config);
	CHECK(session_matches, healthy, &model);
	/* A new session never takes the id of the file set aside. */
	config.name = "new";
	config.attach = false;
	zc_session *fresh = open_session(client, &config);
	ck_assert_uint_gt(zc_session_get_info(fresh)->id, broken_id);
	zc_session_release(fresh);
	zc_session_release(healthy);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* ---- trust ------------------------------------------------------------------------------ */

/* Runs zipcached on dir/shm as it is, expecting it to refuse to start. */
static void expect_refusal(const struct daemon_harness *d, const char *shm, const char *needle)
{
	char sock[PATH_MAX];
	char out[4096], err[8192];
	int status = 0;
	snprintf(sock, sizeof(sock), "%s/refused.sock", d->dir);
	const char *const argv[] = { daemon_binary_path(), "--socket", sock, "--shm-dir", shm,
				     "--metrics-listen", "off", NULL };
	ck_assert_int_eq(program_run(argv, &status, out, sizeof(out), err, sizeof(err)), 0);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) != 0,
		      "zipcached started on an untrusted shm-dir %s (status 0x%x)", shm, status);
	ck_assert_msg(strstr(err, needle) != NULL, "the refusal does not say '%s':\n%s", needle, err);
}

START_TEST(untrusted_shm_dir_is_refused)
{
	struct daemon_harness daemon;
	char shm[PATH_MAX], target[PATH_MAX], link_path[PATH_MAX + 16];
	struct stat st;

	daemon_start(&daemon, NULL);
	daemon_stop(&daemon);

	/* Owned by another user. */
	snprintf(shm, sizeof(shm), "%s/foreign", daemon.dir);
	ck_assert_int_eq(mkdir(shm, 0700), 0);
	ck_assert_int_eq(chown(shm, 65534, 65534), 0);
	expect_refusal(&daemon, shm, "untrusted");
	/* Ours, but open to the group. */
	snprintf(shm, sizeof(shm), "%s/open", daemon.dir);
	ck_assert_int_eq(mkdir(shm, 0700), 0);
	ck_assert_int_eq(chmod(shm, 0770), 0);
	expect_refusal(&daemon, shm, "untrusted");
	/* A symlink to a directory of ours. */
	snprintf(target, sizeof(target), "%s/real", daemon.dir);
	ck_assert_int_eq(mkdir(target, 0700), 0);
	snprintf(shm, sizeof(shm), "%s/link", daemon.dir);
	ck_assert_int_eq(symlink(target, shm), 0);
	expect_refusal(&daemon, shm, "shared-memory directory");
	/* A planted .lock symlink is never followed. */
	snprintf(shm, sizeof(shm), "%s/planted", daemon.dir);
	ck_assert_int_eq(mkdir(shm, 0700), 0);
	snprintf(link_path, sizeof(link_path), "%s/.lock", shm);
	snprintf(target, sizeof(target), "%s/victim", daemon.dir);
	ck_assert_int_eq(symlink(target, link_path), 0);
	expect_refusal(&daemon, shm, "shared-memory directory");
	ck_assert_msg(lstat(target, &st) < 0 && errno == ENOENT,
		      "the daemon created %s through a planted symlink", target);
	daemon_cleanup(&daemon);
}
END_TEST


/* ---- a client of the daemon's own uid ------------------------------------------ */

#define NOBODY 65534u

static int drop_to_nobody(void)
{
	if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0)
		return -errno;
	return getuid() == NOBODY && geteuid() == NOBODY ? 0 : -EPERM;
}

/*
 * The attacker: same uid as the daemon. The view descriptor it is passed
 * cannot be truncated or grown, not even after chmod and a reopen for
 * writing (the views are a sealed memfd). Whatever it writes — through
 * that descriptor into the header and layer headers, or straight into the
 * durable file it can reach in the shm-dir — the daemon never reads back
 * while it runs: it goes on serving, from its own state.
 */
static int same_uid_body(const char *socket_path, const char *shm_dir, int report_fd)
{
	char why[WHY_BYTES] = "", path[PATH_MAX + 64], proc[64];
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	zc_session_config config = script_config(S_STREAM);

	if (drop_to_nobody() < 0)
		return 10;
	if (zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client) < 0)
		return 11;
	if (zc_session_open(client, &config, &session) < 0)
		return 12;
	model_init(&model, &config);
	rng_seed(&rng, 3);
	for (uint32_t step = 0; step < 12; step++)
		if (!update_checked(client, session, &model, &rng, step % 2, 1 + step * 5 % 23, why,
				    sizeof(why)))
			return 13;
	int fd = raw_view_descriptor(socket_path, config.name);
	if (fd < 0)
		return 14;
	struct stat st;
	if (fstat(fd, &st) < 0)
		return 15;
	if (ftruncate(fd, 0) == 0 || ftruncate(fd, st.st_size * 2) == 0)
		return 16;                       /* read-only: no resizing */
	fchmod(fd, 0600);                        /* it owns the memfd: it may */
	snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
	int rw = open(proc, O_RDWR);
	if (rw >= 0) {
		if (ftruncate(rw, 0) == 0 || ftruncate(rw, st.st_size + 4096) == 0)
			return 17;               /* sealed: nobody resizes it */
		/* The header and layer headers, scribbled. */
		static uint8_t junk[4096];
		memset(junk, 0xff, sizeof(junk));
		if (pwrite(rw, junk + 8, sizeof(junk) - 8, 8) < 0)
			return 18;
		close(rw);
	}
	close(fd);
	/* The durable file, reached through the directory (same uid, same
	 * host): its header, commit area and index, scribbled. */
	snprintf(path, sizeof(path), "%s/session-%016llx.zcs", shm_dir,
		 (unsigned long long)zc_session_get_info(session)->id);
	if (chmod(path, 0600) < 0)
		return 19;
	int file = open(path, O_RDWR);
	if (file < 0 || fstat(file, &st) < 0)
		return 20;
	struct store_header header;
	if (pread(file, &header, sizeof(header), 0) != (ssize_t)sizeof(header))
		return 21;
	static uint8_t junk[64 << 10];
	memset(junk, 0xa5, sizeof(junk));
	/* The header, the commit area, layer 0's block index: the daemon's
	 * bookkeeping. (Its residual rows and pool blocks are the session's
	 * data itself: writing those changes the attacker's own cache,
	 * nothing more.) */
	off_t index = (off_t)(header.layers_offset + header.index_offset);
	if (pwrite(file, junk, 4096 - 8, 8) < 0 ||
	    pwrite(file, junk, header.commit_bytes, (off_t)header.commit_offset) < 0 ||
	    pwrite(file, junk, 4096, index) < 0)
		return 22;
	close(file);

	/* The daemon goes on: what it answers is still the model. */
	for (uint32_t step = 0; step < 12; step++) {
		struct block block;
		zc_view view;
		block_make(&block, &model, 1 + step % 9, &rng);
		zc_layer_stats stats, want;
		int rc = zc_update_and_fetch(session, step % 2, block.tokens, block.keys, block.values,
					     &view, &stats);
		if (rc < 0)
			return 23;
		model_update(&model, step % 2, block.tokens, block.keys, block.values);
		model_layer_stats(&model, step % 2, &want);
		block_free(&block);
		if (!stats_match("stats after the scribbling", &stats, &want, true, why, sizeof(why)))
			return 24;
	}
	if (!session_matches(session, &model, why, sizeof(why))) {
		fprintf(stderr, "same-uid client: %s\n", why);
		return 25;
	}
	ssize_t ignored = write(report_fd, "ok", 2);
	(void)ignored;
	zc_session_release(session);
	zc_client_close(client);
	model_free(&model);
	return 0;
}

START_TEST(a_client_of_the_daemons_uid_cannot_hurt_it)
{
	char dir[] = "/dev/shm/zc_same_uid.XXXXXX", sock[PATH_MAX], shm[PATH_MAX], log_path[PATH_MAX];
	int report[2];

	if (geteuid() != 0) {
		fprintf(stderr, "durability_test: not root: cannot run the daemon as another user\n");
		return;
	}
	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(chown(dir, NOBODY, NOBODY), 0);
	ck_assert_int_eq(chmod(dir, 0755), 0);
	snprintf(sock, sizeof(sock), "%s/z.sock", dir);
	snprintf(shm, sizeof(shm), "%s/shm", dir);
	snprintf(log_path, sizeof(log_path), "%s/daemon.log", dir);
	pid_t daemon = fork_dying_with_parent(1);
	if (daemon == 0) {
		if (!freopen(log_path, "w", stderr) || drop_to_nobody() < 0)
			_exit(2);
		execl(daemon_binary_path(), "zipcached", "--socket", sock, "--shm-dir", shm,
		      "--metrics-listen", "off", (char *)NULL);
		_exit(3);
	}
	for (int i = 0; i < 1000 && !socket_accepts(sock); i++)
		sleep_ms(10);
	ck_assert_msg(socket_accepts(sock), "the daemon running as nobody does not listen");
	ck_assert_int_eq(pipe(report), 0);
	pid_t attacker = fork_dying_with_parent(1);
	if (attacker == 0) {
		close(report[0]);
		_exit(same_uid_body(sock, shm, report[1]));
	}
	close(report[1]);
	int status = 0;
	waitpid(attacker, &status, 0);
	char said[4] = "";
	ssize_t got = read(report[0], said, 2);
	close(report[0]);
	int daemon_status = 0;
	pid_t gone = waitpid(daemon, &daemon_status, WNOHANG);
	kill(daemon, SIGKILL);
	waitpid(daemon, NULL, 0);
	char *log = file_read_whole(log_path, NULL);
	ck_assert_msg(gone == 0, "the daemon died (status 0x%x); log:\n%s", daemon_status, log);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0 && got == 2,
		      "the same-uid client failed at step %d (status 0x%x); log:\n%s",
		      WIFEXITED(status) ? WEXITSTATUS(status) : -1, status, log);
	free(log);
	directory_remove(dir);
}
END_TEST


/* ---- a full tmpfs ------------------------------------------------------------------ */

/* A fresh tmpfs of `options` on a new directory (returned in dir, a
 * mkdtemp template); false, with a line on stderr, where mounting is not
 * allowed (the test then checks nothing). */
static bool tmpfs_mount(char *dir, const char *options, const char *test)
{
	ck_assert_ptr_nonnull(mkdtemp(dir));
	if (mount("zc-test", dir, "tmpfs", 0, options) == 0)
		return true;
	fprintf(stderr, "durability_test: cannot mount a tmpfs here (%s): %s checks nothing\n",
		strerror(errno), test);
	rmdir(dir);
	return false;
}

static void tmpfs_unmount(char *dir)
{
	umount(dir);
	rmdir(dir);
}

/* Fills the file system under dir: returns the filler's path. */
static void tmpfs_fill(const char *dir, char *filler, size_t size)
{
	static char chunk[1 << 16];
	snprintf(filler, size, "%s/filler", dir);
	int fd = open(filler, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	ck_assert_int_ge(fd, 0);
	while (write(fd, chunk, sizeof(chunk)) > 0)
		;
	close(fd);
}

/*
 * Views punched by memory relief, then a crash before the daemon could
 * say so, then a full tmpfs: the next daemon adopts the file, serves the
 * session bit for bit (its views are rebuilt in memory of its own), and
 * answers the update that needs pages of the full file system with
 * RESOURCE_EXHAUSTED — never a SIGBUS — and takes it once there is room.
 */
START_TEST(full_tmpfs_is_an_error_not_a_sigbus)
{
	struct daemon_harness daemon;
	char mount_dir[] = "/tmp/zc_tmpfs.XXXXXX", shm[PATH_MAX], filler[PATH_MAX], tail[4096];

	if (!tmpfs_mount(mount_dir, "size=16m,mode=0700", "the full-tmpfs test"))
		return;
	snprintf(shm, sizeof(shm), "%s/shm", mount_dir);
	const char *const args[] = { "--shm-dir", shm, "--memory-budget", "4M", "--idle-ttl", "0",
				     NULL };
	const char *const plain[] = { "--shm-dir", shm, "--idle-ttl", "0", NULL };
	zc_session_config config = script_config(S_IDLE);
	struct model model;
	struct rng rng;

	setenv("ZIPCACHED_FAULT", "drop.punch:1", 1);
	daemon_start(&daemon, args);
	unsetenv("ZIPCACHED_FAULT");
	zc_client *client = connect_client(&daemon);
	config.name = "dropped";
	zc_session *dropped = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 11);
	CHECK(update_checked, client, dropped, &model, &rng, 0, 256);
	ck_assert_int_eq(zc_session_release_views(dropped), 0);
	config.name = "pressing";
	zc_session *pressing = open_session(client, &config);
	struct block block;
	block_make(&block, &model, 256, &rng);
	zc_view view;
	int rc = zc_update_and_fetch(pressing, 0, 256, block.keys, block.values, &view, NULL);
	block_free(&block);
	ck_assert_msg(rc < 0, "relief never dropped the idle views (the update went through)");
	ck_assert_int_eq(daemon_wait_exit(&daemon, 20000) >> 8, FAULT_EXIT_STATUS);
	zc_session_release(pressing);
	zc_session_release(dropped);
	zc_client_close(client);

	tmpfs_fill(mount_dir, filler, sizeof(filler));
	daemon_set_extra_args(&daemon, plain);
	daemon_restart(&daemon);
	client = connect_client(&daemon);
	config.name = "dropped";
	config.attach = true;
	/* Views are the daemon's memory, not the shm-dir's: they come back. */
	dropped = open_session(client, &config);
	CHECK(session_matches, dropped, &model);
	/* New tokens need pages of the full file system: refused, not SIGBUS. */
	block_make(&block, &model, 300, &rng);
	rc = zc_update_and_fetch(dropped, 0, 300, block.keys, block.values, &view, NULL);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "an update on a full tmpfs: %s (%s), want ZC_EEXHAUSTED",
		      zc_error_name(rc), zc_client_last_error(client));
	daemon_alive_check(client, "an update on a full tmpfs", &daemon, tail, sizeof(tail));
	CHECK(session_matches, dropped, &model);

	unlink(filler);
	ck_assert_int_eq(model_update(&model, 0, 300, block.keys, block.values), 0);
	ck_assert_int_eq(zc_update_and_fetch(dropped, 0, 300, block.keys, block.values, &view, NULL), 0);
	block_free(&block);
	CHECK(session_matches, dropped, &model);
	zc_session_release(dropped);
	zc_client_close(client);
	model_free(&model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
	tmpfs_unmount(mount_dir);
}
END_TEST


/* ---- memory as the files hold it -------------------------------------------------- */

static uint64_t stats_of(zc_client *client, uint64_t *file_bytes)
{
	zc_memory_stats memory;
	ck_assert_int_eq(zc_client_memory_stats(client, &memory), 0);
	*file_bytes = memory.file_bytes;
	return memory.charged_bytes;
}

/*
 * A client that reads its whole mapping after relief dropped its views
 * makes tmpfs allocate the pages again, behind the daemon's back. The
 * charge must catch up with what the files hold, and admission then
 * counts it: the budget is never passed by more than a reader can fault
 * in between two ticks.
 */
START_TEST(client_read_faults_are_charged)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", "8M", "--idle-ttl", "0", NULL };
	zc_session_config config = script_config(S_IDLE);
	struct model model;
	struct rng rng;
	uint64_t files_before, files_after;

	config.max_tokens = 4096;
	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	config.name = "reader";
	zc_session *reader = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 5);
	CHECK(update_checked, client, reader, &model, &rng, 0, 256);
	zc_view view;
	ck_assert_int_eq(zc_session_view(reader, 0, &view), 0);
	/* Its lease given up: another session's growth makes relief drop the
	 * reader's views (which it goes on reading, against the rules). */
	ck_assert_int_eq(zc_session_release_views(reader), 0);
	config.name = "grower";
	zc_session *grower = open_session(client, &config);
	struct model grower_model;
	model_init(&grower_model, &config);
	for (int i = 0; i < 8; i++) {
		struct block block;
		block_make(&block, &grower_model, 256, &rng);
		zc_view ignored;
		int rc = zc_update_and_fetch(grower, 0, 256, block.keys, block.values, &ignored, NULL);
		if (rc == 0)
			model_update(&grower_model, 0, 256, block.keys, block.values);
		block_free(&block);
		if (rc < 0)
			break;
	}
	uint64_t used_before = stats_of(client, &files_before);
	/* The reader touches every row of its (dropped) mapping. */
	volatile uint64_t sum = 0;
	size_t head_elements = (size_t)view.max_tokens * view.head_dim_k;
	for (size_t h = 0; h < (size_t)view.batch * view.kv_heads; h++)
		for (size_t i = 0; i < head_elements; i += 2048) {
			sum += view.keys[h * head_elements + i];
			sum += view.values[h * head_elements + i];
		}
	(void)sum;
	uint64_t used_after = 0;
	for (int i = 0; i < 40; i++) {
		used_after = stats_of(client, &files_after);
		if (used_after >= files_after && files_after > files_before)
			break;
		sleep_ms(100);
	}
	fprintf(stderr, "read faults: files %llu -> %llu bytes, charged %llu -> %llu\n",
		(unsigned long long)files_before, (unsigned long long)files_after,
		(unsigned long long)used_before, (unsigned long long)used_after);
	ck_assert_msg(files_after > files_before + (8u << 20),
		      "the reads did not allocate pages (%llu -> %llu): the test measured nothing",
		      (unsigned long long)files_before, (unsigned long long)files_after);
	ck_assert_msg(used_after >= files_after,
		      "the daemon charges %llu bytes while its files hold %llu",
		      (unsigned long long)used_after, (unsigned long long)files_after);
	/* Over the budget now: new tokens need relief first, or are refused. */
	struct block block;
	block_make(&block, &grower_model, 256, &rng);
	int rc = zc_update_and_fetch(grower, 0, 256, block.keys, block.values, &view, NULL);
	block_free(&block);
	uint64_t files_end;
	uint64_t used_end = stats_of(client, &files_end);
	ck_assert_msg(rc == ZC_EEXHAUSTED || used_end <= 8u << 20,
		      "an update went through with %llu bytes charged under an 8 MiB budget",
		      (unsigned long long)used_end);
	/* Relief gives the faulted pages back: the reader's views were
	 * dropped already, but what its reads brought back goes again. */
	ck_assert_msg(files_end + (8u << 20) < files_after,
		      "relief left the pages the reader faulted in (%llu bytes, %llu before)",
		      (unsigned long long)files_end, (unsigned long long)files_after);
	zc_session_release(grower);
	zc_session_release(reader);
	model_free(&grower_model);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST


/*
 * A direct block that fails after the residual ahead of it was compressed
 * (here: the tmpfs fills up under the arena) stores nothing, and the
 * residual's rows still read exact afterwards, not their reconstruction.
 */
START_TEST(failed_block_leaves_the_residual_exact)
{
	struct daemon_harness daemon;
	char mount_dir[] = "/tmp/zc_tmpfs.XXXXXX", shm[PATH_MAX], filler[PATH_MAX];

	if (!tmpfs_mount(mount_dir, "size=8m,mode=0700", "the failed-block test"))
		return;
	snprintf(shm, sizeof(shm), "%s/shm", mount_dir);
	const char *const args[] = { "--shm-dir", shm, "--memory-budget", "0", NULL };
	zc_session_config config = script_config(S_STREAM);
	struct model model;
	struct rng rng;

	config.layers = 1;
	config.max_tokens = 8192;
	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	zc_session *session = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 21);
	/* Views and arena reserved for 2000 tokens, then given back to trim. */
	CHECK(update_checked, client, session, &model, &rng, 0, 2000);
	CHECK(trim_checked, client, session, &model, 2000);
	CHECK(update_checked, client, session, &model, &rng, 0, 8);
	CHECK(update_checked, client, session, &model, &rng, 0, 5);   /* the residual */
	tmpfs_fill(mount_dir, filler, sizeof(filler));
	struct block block;
	block_make(&block, &model, 2200, &rng);
	zc_view view;
	int rc = zc_update_and_fetch(session, 0, 2200, block.keys, block.values, &view, NULL);
	block_free(&block);
	unlink(filler);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "a block past a full tmpfs: %s (%s)", zc_error_name(rc),
		      zc_client_last_error(client));
	CHECK(session_matches, session, &model);
	zc_session_release(session);
	zc_client_close(client);
	model_free(&model);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
	tmpfs_unmount(mount_dir);
}
END_TEST

/* The views an adopted file still holds are memory relief can give back:
 * a restarted daemon under the same budget is not stuck. */
START_TEST(adopted_views_can_be_relieved)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", "12M", "--idle-ttl", "0", NULL };
	zc_session_config config = script_config(S_IDLE);
	struct model model, other;
	struct rng rng;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	config.name = "old";
	zc_session *old = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 31);
	CHECK(update_checked, client, old, &model, &rng, 0, 1024);
	zc_session_release(old);
	zc_client_close(client);
	daemon_kill(&daemon);

	daemon_restart(&daemon);
	client = connect_client(&daemon);
	config.name = "new";
	zc_session *fresh = open_session(client, &config);
	model_init(&other, &config);
	/* Its blocks fit only once the adopted session's old views are gone. */
	for (int i = 0; i < 4; i++)
		CHECK(update_checked, client, fresh, &other, &rng, 0, 256);
	/* Unleased, its views may go for the old session's rebuild. */
	ck_assert_int_eq(zc_session_release_views(fresh), 0);
	config.name = "old";
	config.attach = true;
	old = open_session(client, &config);
	zc_session_release(fresh);
	CHECK(session_matches, old, &model);
	zc_session_release(old);
	model_free(&model);
	model_free(&other);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST


/* What the files hold, by kind, adds up to what they hold, and each kind
 * is where it should be. */
START_TEST(memory_by_kind_adds_up)
{
	/* Without retained pages, so that a close gives everything back. */
	const char *const args[] = { "--retain-bytes", "0", NULL };
	struct daemon_harness daemon;
	zc_session_config config = script_config(S_IDLE);
	struct model model;
	struct rng rng;
	zc_memory_stats st;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	config.name = "kinds";
	zc_session *session = open_session(client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 41);
	CHECK(update_checked, client, session, &model, &rng, 0, 300);   /* a block */
	CHECK(update_checked, client, session, &model, &rng, 0, 5);     /* the residual */
	ck_assert_int_eq(zc_client_memory_stats(client, &st), 0);
	uint64_t sum = st.views_bytes + st.blocks_bytes + st.residual_bytes +
		       st.index_bytes + st.headers_bytes + st.retained_bytes;
	fprintf(stderr, "memory by kind: views %llu, blocks %llu, residual %llu, index %llu, "
			"headers %llu; files %llu\n",
		(unsigned long long)st.views_bytes, (unsigned long long)st.blocks_bytes,
		(unsigned long long)st.residual_bytes, (unsigned long long)st.index_bytes,
		(unsigned long long)st.headers_bytes, (unsigned long long)st.file_bytes);
	ck_assert_uint_eq(sum, st.file_bytes);
	/* Views: every head's rows reserved up to 305 + 256 tokens, K and V. */
	uint64_t heads = (uint64_t)config.batch * config.kv_heads;
	ck_assert_uint_ge(st.views_bytes, heads * 305 * 2 * 128 * 2);
	ck_assert_uint_gt(st.blocks_bytes, 0);
	ck_assert_uint_lt(st.blocks_bytes, st.views_bytes);
	ck_assert_uint_gt(st.residual_bytes, 0);
	ck_assert_uint_gt(st.index_bytes, 0);
	ck_assert_uint_gt(st.headers_bytes, 0);
	ck_assert_int_eq(zc_session_close(session), 0);
	ck_assert_int_eq(zc_client_memory_stats(client, &st), 0);
	/* What stays is the uid's pool file's header page. */
	ck_assert_uint_eq(st.file_bytes, 4096);
	ck_assert_uint_eq(st.blocks_bytes, 4096);
	model_free(&model);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static Suite *durability_suite(void)
{
	Suite *suite = suite_create("durability");
	const struct test_case cases[] = {
		{ "faults", { every_step_of_every_mutation, script_without_faults, NULL } },
		{ "adoption",
		  { descriptor_limit_never_sets_files_aside, corrupt_files_set_aside_healthy_ones_adopted,
		    NULL } },
		{ "accounting", { memory_by_kind_adds_up, NULL } },
		{ "tmpfs", { full_tmpfs_is_an_error_not_a_sigbus, client_read_faults_are_charged,
			     failed_block_leaves_the_residual_exact, adopted_views_can_be_relieved, NULL } },
		{ "trust", { untrusted_shm_dir_is_refused, a_client_of_the_daemons_uid_cannot_hurt_it,
			     NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(durability_suite(), CK_FORK);
}
