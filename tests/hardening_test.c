/*
 * Attacks on the daemon in issue 9's classes, beyond the cases it names:
 * each test is a failure once found by trying to break the daemon, or an
 * attack that held and stays as a regression test.
 *
 *   trust      a client of the daemon's own uid cutting the view
 *              descriptor it is passed (it owns it: chmod, reopen,
 *              ftruncate) is refused, and the daemon stays up for every
 *              other client.
 *   crashes    real SIGKILLs, at times from a fixed seed, during a mixed
 *              workload (several sessions and layers, per_call one-token
 *              blocks, trims of one layer and of all, thread-pool jobs,
 *              memory relief, closes and reopens): after each, the
 *              adopted sessions equal the acknowledged operations bit for
 *              bit, the one in flight wholly there or wholly absent, and
 *              nothing is set aside.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "store_format.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 900
#define NOBODY 65534u

/* ---- trust: a same-uid client truncating its file ----------------------------- */

static int drop_to_nobody(void)
{
	if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0)
		return -errno;
	return getuid() == NOBODY && geteuid() == NOBODY ? 0 : -EPERM;
}

static zc_session_config small_config(const char *name)
{
	zc_session_config c;
	zc_session_config_default(&c);
	c.name = name;
	c.layers = 2;
	c.batch = 1;
	c.kv_heads = 2;
	c.head_dim_k = c.head_dim_v = 32;
	c.max_tokens = 1024;
	c.residual_tokens = 8;
	return c;
}

/* How the attacker cuts its file. */
enum truncation { CUT_TO_VIEWS, CUT_TO_ZERO };

/*
 * The attacker (uid of the daemon): a session with some tokens, then the
 * view descriptor it is passed made writable (it owns it) and cut; the
 * cut must be refused; then more updates of that session. Exit 0 when it
 * got that far. (A process of the daemon's uid that can reach the shm-dir
 * itself could cut the durable file, as it could kill(2) the daemon: the
 * shm-dir is for the daemon alone; README, Security.)
 */
static int truncating_body(const char *socket_path, enum truncation how)
{
	char why[WHY_BYTES] = "", path[PATH_MAX];
	zc_client *client;
	zc_session *session;
	struct model model;
	struct rng rng;
	zc_session_config config = small_config("truncated");

	if (drop_to_nobody() < 0)
		return 10;
	if (zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client) < 0)
		return 11;
	if (zc_session_open(client, &config, &session) < 0)
		return 12;
	model_init(&model, &config);
	rng_seed(&rng, 3);
	for (uint32_t step = 0; step < 6; step++)
		if (!update_checked(client, session, &model, &rng, step % 2, 1 + step * 5 % 23, why,
				    sizeof(why)))
			return 13;
	/* What it is passed: the view descriptor. It owns it, so it may make
	 * it writable and reopen it; cutting it must still be refused. */
	int passed = raw_view_descriptor(socket_path, config.name);
	if (passed < 0)
		return 14;
	fchmod(passed, 0600);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", passed);
	int fd = open(path, O_RDWR);
	if (fd < 0)
		fd = passed;
	zc_map_header header;
	if (pread(fd, &header, sizeof(header), 0) != (ssize_t)sizeof(header))
		return 18;
	off_t length = how == CUT_TO_VIEWS ? (off_t)header.header_bytes : 0;
	if (ftruncate(fd, length) == 0)
		return 19;                       /* the views were resized */
	if (fd != passed)
		close(fd);
	close(passed);
	/* Its own data is its own business; the daemon must answer at all. */
	for (uint32_t step = 0; step < 4; step++) {
		struct block block;
		zc_view view;
		block_make(&block, &model, step % 2 ? 3 : 40, &rng);
		(void)zc_update_and_fetch(session, step % 2, block.tokens, block.keys, block.values,
					  &view, NULL);
		block_free(&block);
	}
	zc_session_release(session);
	zc_client_close(client);
	model_free(&model);
	return 0;
}

/* Another client of the same daemon: its session before and after. */
static int bystander_check(const char *socket_path, struct model *model, bool first, char *why,
			   size_t size)
{
	zc_client *client;
	zc_session *session;
	struct rng rng;
	zc_session_config config = small_config("bystander");
	int rc = zc_client_connect(socket_path, CLIENT_TIMEOUT_MS, &client);
	if (rc < 0) {
		snprintf(why, size, "connect: %s", zc_strerror(rc));
		return rc;
	}
	config.attach = !first;
	rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		snprintf(why, size, "open: %s: %s", zc_strerror(rc), zc_client_last_error(client));
		zc_client_close(client);
		return rc;
	}
	if (first)
		model_init(model, &config);
	rng_seed(&rng, first ? 100 : 200);
	bool ok = session_matches(session, model, why, size) &&
		  update_checked(client, session, model, &rng, 0, 20, why, size) &&
		  update_checked(client, session, model, &rng, 1, 3, why, size);
	zc_session_release(session);
	zc_client_close(client);
	return ok ? 0 : -1;
}

static void same_uid_truncation(enum truncation how)
{
	char dir[] = "/dev/shm/zc_hardening.XXXXXX", sock[PATH_MAX], shm[PATH_MAX], log_path[PATH_MAX];
	char why[WHY_BYTES];
	struct model bystander;

	if (geteuid() != 0) {
		fprintf(stderr, "hardening_test: not root: cannot run the daemon as another user; "
				"the truncation test checks nothing\n");
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
		      "--metrics-listen", "off", "--idle-ttl", "0", (char *)NULL);
		_exit(3);
	}
	for (int i = 0; i < 1000 && !socket_accepts(sock); i++)
		sleep_ms(10);
	ck_assert_msg(socket_accepts(sock), "the daemon running as nobody does not listen");

	/* The bystander runs as root here: another user entirely. */
	int rc = bystander_check(sock, &bystander, true, why, sizeof(why));
	ck_assert_msg(rc == 0, "bystander before: %s", why);

	pid_t attacker = fork_dying_with_parent(1);
	if (attacker == 0)
		_exit(truncating_body(sock, how));
	int status = 0;
	waitpid(attacker, &status, 0);

	int daemon_status = 0;
	pid_t gone = waitpid(daemon, &daemon_status, WNOHANG);
	rc = gone == 0 ? bystander_check(sock, &bystander, false, why, sizeof(why)) : -1;
	if (gone == 0)
		gone = waitpid(daemon, &daemon_status, WNOHANG);
	kill(daemon, SIGKILL);
	waitpid(daemon, NULL, 0);
	char *log = file_read_whole(log_path, NULL);
	size_t log_len = strlen(log);
	const char *log_tail = log_len > 3000 ? log + log_len - 3000 : log;
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "the truncating client failed at step %d (status 0x%x); log:\n%s",
		      WIFEXITED(status) ? WEXITSTATUS(status) : -1, status, log_tail);
	ck_assert_msg(gone == 0,
		      "a client of the daemon's uid truncated its own session file (to %s) and the "
		      "daemon died: %s %d; every other client lost it; log:\n%s",
		      how == CUT_TO_VIEWS ? "its views" : "0 bytes",
		      WIFSIGNALED(daemon_status) ? "signal" : "exit status",
		      WIFSIGNALED(daemon_status) ? WTERMSIG(daemon_status) : WEXITSTATUS(daemon_status),
		      log_tail);
	ck_assert_msg(rc == 0, "the bystander after the truncation: %s", why);
	free(log);
	model_free(&bystander);
	directory_remove(dir);
}

START_TEST(same_uid_client_truncating_to_views_cannot_kill_daemon)
{
	same_uid_truncation(CUT_TO_VIEWS);
}
END_TEST

START_TEST(same_uid_client_truncating_to_zero_cannot_kill_daemon)
{
	same_uid_truncation(CUT_TO_ZERO);
}
END_TEST

/* ---- crashes: real SIGKILLs during a mixed workload ----------------------------- */

enum rk_kind { RK_OPEN, RK_UPDATE, RK_TRIM, RK_TRIM_LAYER, RK_CLOSE };

#define RK_SESSIONS 4
#define RK_MAX_OPS 4096

enum { RK_PER_CALL, RK_SMALL_R, RK_BIG, RK_DEFAULT_R };

struct rk_op {
	enum rk_kind kind;
	int session;
	uint32_t layer, tokens;
	uint32_t reply_residual;   /* an acknowledged update's residual, as its reply said */
	/* The op a kill followed: the layers (bit per layer) of each session
	 * whose last flush the adopted daemon had not published, as found
	 * after the restart; the replay unpublishes them after the op. */
	uint32_t unpublished[RK_SESSIONS];
};

/* What the op generator needs between kills: cheap, from the replies. */
struct rk_shadow {
	bool exists[RK_SESSIONS];
	uint32_t tokens[RK_SESSIONS][8];
};

/* How an op ended up: applied (the acknowledged ones, and the in-flight
 * one where adoption shows it), applied without its flush, or not. */
enum rk_variant { RK_ABSENT, RK_APPLIED, RK_UNFLUSHED };

struct rk_state {
	struct model models[RK_SESSIONS];
	bool exists[RK_SESSIONS];
};

static zc_session_config rk_config(int session)
{
	static const char *const names[RK_SESSIONS] = { "per-call", "small-r", "big", "default-r" };
	zc_session_config c;
	zc_session_config_default(&c);
	c.name = names[session];
	c.batch = 1;
	switch (session) {
	case RK_PER_CALL:
		c.layers = 4, c.kv_heads = 2, c.head_dim_k = 32, c.head_dim_v = 16, c.max_tokens = 384;
		c.policy = ZC_POLICY_PER_CALL;
		break;
	case RK_SMALL_R:
		c.layers = 3, c.kv_heads = 2, c.head_dim_k = c.head_dim_v = 32, c.max_tokens = 1024;
		c.residual_tokens = 4;
		break;
	case RK_BIG:
		c.layers = 1, c.kv_heads = 8, c.head_dim_k = c.head_dim_v = 128, c.max_tokens = 2048;
		break;
	default:
		c.layers = 2, c.kv_heads = 4, c.head_dim_k = c.head_dim_v = 64, c.max_tokens = 1024;
		break;
	}
	return c;
}

static void rk_block(const struct rk_op *op, size_t i, const struct model *model, struct block *b)
{
	struct rng rng;
	zc_session_config c = rk_config(op->session);
	(void)model;
	rng_seed(&rng, 0x7ed7ea40000ull + i);
	block_make_shape(b, c.batch * c.kv_heads, c.head_dim_k, c.head_dim_v, op->tokens, &rng);
}

static void rk_state_free(struct rk_state *st)
{
	for (int s = 0; s < RK_SESSIONS; s++)
		if (st->exists[s])
			model_free(&st->models[s]);
	memset(st, 0, sizeof(*st));
}

/* Applies op i to st as `variant` (RK_ABSENT: nothing). */
static void rk_apply(struct rk_state *st, const struct rk_op *ops, size_t i, enum rk_variant v)
{
	const struct rk_op *op = &ops[i];
	struct model *m = &st->models[op->session];
	struct block block;
	if (v == RK_ABSENT)
		return;
	switch (op->kind) {
	case RK_OPEN: {
		zc_session_config config = rk_config(op->session);
		if (!st->exists[op->session])
			model_init(m, &config);
		st->exists[op->session] = true;
		break;
	}
	case RK_UPDATE:
		rk_block(op, i, m, &block);
		if (v == RK_UNFLUSHED)
			model_append_exact(m, op->layer, op->tokens, block.keys, block.values);
		else
			(void)model_update(m, op->layer, op->tokens, block.keys, block.values);
		block_free(&block);
		break;
	case RK_TRIM:
		model_trim(m, op->tokens);
		break;
	case RK_TRIM_LAYER:
		model_trim_layer(m, op->layer, op->tokens);
		break;
	case RK_CLOSE:
		model_free(m);
		st->exists[op->session] = false;
		break;
	}
}

static void rk_replay(struct rk_state *st, const struct rk_op *ops, const enum rk_variant *done,
		      size_t n)
{
	memset(st, 0, sizeof(*st));
	for (size_t i = 0; i < n; i++) {
		enum rk_variant v = done[i];
		const struct rk_op *op = &ops[i];
		if (v == RK_APPLIED && op->kind == RK_UPDATE && st->exists[op->session]) {
			const struct model *m = &st->models[op->session];
			uint32_t residual = m->layer[op->layer].residual;
			/* A flush the budget deferred: the tokens stay exact in the
			 * residual (allowed: it is retried on the next update). */
			if (!model_direct(m, op->tokens) && residual + op->tokens >= m->residual_threshold &&
			    op->reply_residual == residual + op->tokens)
				v = RK_UNFLUSHED;
		}
		rk_apply(st, ops, i, v);
		for (int s = 0; s < RK_SESSIONS; s++)
			for (uint32_t l = 0; st->exists[s] && l < st->models[s].layers; l++)
				if (op->unpublished[s] & (1u << l))
					model_unpublish_last_flush(&st->models[s], l);
	}
}

static void rk_shadow_of(struct rk_shadow *sh, const struct rk_state *st)
{
	memset(sh, 0, sizeof(*sh));
	for (int s = 0; s < RK_SESSIONS; s++) {
		sh->exists[s] = st->exists[s];
		for (uint32_t l = 0; st->exists[s] && l < st->models[s].layers; l++)
			sh->tokens[s][l] = st->models[s].layer[l].tokens;
	}
}

/* The next op, from the state as acknowledged so far. */
static struct rk_op rk_next(struct rng *rng, const struct rk_shadow *sh)
{
	struct rk_op op = { .reply_residual = UINT32_MAX };
	op.session = (int)rng_below(rng, RK_SESSIONS);
	if (!sh->exists[op.session]) {
		op.kind = RK_OPEN;
		return op;
	}
	const zc_session_config mc = rk_config(op.session);
	const zc_session_config *m = &mc;
	uint32_t r = rng_below(rng, 100);
	op.layer = rng_below(rng, m->layers);
	if (r < 2) {
		op.kind = RK_CLOSE;
	} else if (r < 10) {
		op.kind = RK_TRIM;
		op.tokens = 1 + rng_below(rng, op.session == RK_BIG ? 300 : 12);
	} else if (r < 20) {
		op.kind = RK_TRIM_LAYER;
		op.tokens = 1 + rng_below(rng, op.session == RK_BIG ? 300 : 12);
	} else {
		op.kind = RK_UPDATE;
		switch (op.session) {
		case RK_PER_CALL:
			op.tokens = rng_below(rng, 4) ? 1 : 1 + rng_below(rng, 9);
			break;
		case RK_SMALL_R:
			op.tokens = 1 + rng_below(rng, 9);
			break;
		case RK_BIG:
			op.tokens = 16 + rng_below(rng, 400);
			break;
		default:
			op.tokens = 1 + rng_below(rng, rng_below(rng, 2) ? 20 : 200);
			break;
		}
		if (sh->tokens[op.session][op.layer] + op.tokens > m->max_tokens) {
			op.kind = RK_TRIM;
			op.tokens = m->max_tokens / 2;
		}
	}
	return op;
}

/* Every session the daemon holds against st. */
static bool rk_matches(zc_client *client, const struct rk_state *st, uint32_t *unpublished,
		       char *why, size_t size)
{
	zc_session_config configs[RK_SESSIONS];
	for (int s = 0; s < RK_SESSIONS; s++)
		configs[s] = rk_config(s);
	return daemon_sessions_match(client, configs, st->models, st->exists, RK_SESSIONS, unpublished,
				     why, size);
}

static const char *rk_name(enum rk_kind kind)
{
	static const char *const names[] = { "open", "update", "trim", "trim_layer", "close" };
	return names[kind];
}

static int count_suffix(const char *dir, const char *suffix)
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

/*
 * One client runs ops until the daemon dies by a SIGKILL from a helper
 * after a delay from the seed; the next daemon (no budget, so every view
 * can be rebuilt to be read) must hold the acknowledged ops and the one
 * in flight wholly or not at all; then the workload goes on, under the
 * budget again, on the adopted files.
 */
static void kill_loop(uint64_t seed, int rounds, int64_t time_budget_ms, const char *budget)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--memory-budget", budget, "--idle-ttl", "0",
				     "--offload-elements", "4096", NULL };
	const char *const plain[] = { "--idle-ttl", "0", "--offload-elements", "4096", NULL };
	struct rk_op *ops = allocate(RK_MAX_OPS * sizeof(*ops));
	enum rk_variant *done = allocate(RK_MAX_OPS * sizeof(*done));
	size_t n_ops = 0;
	struct rng rng, delays;
	struct rk_state st;
	char tail[6000];
	int64_t start = now_ms();
	int kills = 0, in_flight_applied = 0, lazy_layers = 0;

	rng_seed(&rng, seed);
	rng_seed(&delays, seed ^ 0xdead);
	memset(&st, 0, sizeof(st));
	daemon_start(&daemon, args);
	for (int round = 0; round < rounds && now_ms() - start < time_budget_ms &&
			    n_ops < RK_MAX_OPS - 64; round++) {
		zc_client *client = connect_client(&daemon);
		zc_session *handles[RK_SESSIONS] = { 0 };
		struct rk_shadow shadow;
		rk_shadow_of(&shadow, &st);
		for (int s = 0; s < RK_SESSIONS; s++) {
			if (!st.exists[s])
				continue;
			zc_session_config config = rk_config(s);
			config.attach = true;
			int rc = zc_session_open(client, &config, &handles[s]);
			ck_assert_msg(rc == 0 || rc == ZC_EEXHAUSTED, "attach %s: %s (%s)", config.name,
				      zc_error_name(rc), zc_client_last_error(client));
			if (rc < 0)
				handles[s] = NULL;
		}
		/* The kill is aimed at one request: sent just before it, landing
		 * somewhere inside the daemon's work on it (or just after). */
		uint32_t kill_at = rng_below(&delays, 40);
		uint32_t delay = rng_below(&delays, 4000);   /* microseconds */
		pid_t killer = -1;
		bool died = false;
		size_t first = n_ops;
		while (!died && n_ops < RK_MAX_OPS - 1) {
			struct rk_op op = rk_next(&rng, &shadow);
			size_t i = n_ops;
			if (op.kind != RK_OPEN && !handles[op.session]) {
				/* Its attach was refused by the budget: open it again later. */
				continue;
			}
			struct block block = { 0 };
			if (op.kind == RK_UPDATE)
				rk_block(&op, i, NULL, &block);
			if (killer < 0 && n_ops - first >= kill_at) {
				killer = fork_dying_with_parent(1);
				if (killer == 0) {
					usleep(delay);
					kill(daemon.pid, SIGKILL);
					_exit(0);
				}
			}
			ops[n_ops++] = op;
			done[i] = RK_ABSENT;
			zc_session_config config = rk_config(op.session);
			uint32_t trimmed = 0;
			int rc = 0, want = 0;
			zc_view view;
			zc_layer_stats got_stats;
			switch (op.kind) {
			case RK_OPEN:
				if (handles[op.session])
					zc_session_release(handles[op.session]);
				handles[op.session] = NULL;
				rc = zc_session_open(client, &config, &handles[op.session]);
				break;
			case RK_UPDATE:
				rc = zc_update_and_fetch(handles[op.session], op.layer, op.tokens, block.keys,
							 block.values, &view, &got_stats);
				break;
			case RK_TRIM:
				rc = zc_session_trim(handles[op.session], op.tokens, &trimmed);
				break;
			case RK_TRIM_LAYER:
				rc = zc_session_trim_layer(handles[op.session], op.layer, op.tokens, &trimmed);
				break;
			case RK_CLOSE:
				rc = zc_session_close(handles[op.session]);
				handles[op.session] = NULL;
				break;
			}
			block_free(&block);
			if (rc < 0 && daemon_lost(rc)) {
				/* Only our SIGKILL may take the daemon away: an error
				 * before it is sent is the daemon's own failure. */
				ck_assert_msg(killer > 0, "op %zu (%s of %s), before the kill: %s: %s; log:\n%s",
					      i, rk_name(op.kind), config.name, zc_error_name(rc),
					      zc_client_last_error(client),
					      daemon_log_tail(&daemon, tail, sizeof(tail)));
				died = true;
				break;
			}
			if (rc == ZC_EEXHAUSTED && op.kind != RK_OPEN) {
				continue;   /* refused by the budget: nothing changed */
			}
			if (op.kind == RK_OPEN && rc == ZC_EEXHAUSTED) {
				handles[op.session] = NULL;
				continue;
			}
			ck_assert_msg(rc == want, "op %zu (%s of %s): %s: %s", i, rk_name(op.kind),
				      config.name, zc_error_name(rc), zc_client_last_error(client));
			done[i] = RK_APPLIED;
			switch (op.kind) {
			case RK_OPEN:
				shadow.exists[op.session] = true;
				memset(shadow.tokens[op.session], 0, sizeof(shadow.tokens[0]));
				break;
			case RK_UPDATE:
				ops[i].reply_residual = got_stats.residual_tokens;
				shadow.tokens[op.session][op.layer] = view.tokens;
				break;
			case RK_TRIM:
			case RK_TRIM_LAYER:
				for (uint32_t l = 0; l < config.layers; l++) {
					uint32_t *t = &shadow.tokens[op.session][l];
					if (op.kind == RK_TRIM || l == op.layer)
						*t -= op.tokens < *t ? op.tokens : *t;
				}
				break;
			case RK_CLOSE:
				shadow.exists[op.session] = false;
				break;
			}
		}
		int status = 0;
		waitpid(killer, &status, 0);
		for (int s = 0; s < RK_SESSIONS; s++)
			if (handles[s])
				zc_session_release(handles[s]);
		zc_client_close(client);
		ck_assert_msg(died, "ran out of ops before the kill");
		status = daemon_wait_exit(&daemon, 20000);
		ck_assert_msg(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
			      "round %d: the daemon ended with status 0x%x, not by our SIGKILL; log:\n%s",
			      round, status, daemon_log_tail(&daemon, tail, sizeof(tail)));
		kills++;

		/* Adoption, without a budget. */
		daemon_set_extra_args(&daemon, plain);
		daemon_restart(&daemon);
		ck_assert_msg(count_suffix(daemon.shm_dir, ".corrupt") == 0,
			      "round %d (killed %u us in, during op %zu, %s of %s): a file was set aside "
			      "as corrupt; log:\n%s",
			      round, delay, n_ops - 1, rk_name(ops[n_ops - 1].kind),
			      rk_config(ops[n_ops - 1].session).name,
			      daemon_log_tail(&daemon, tail, sizeof(tail)));
		client = connect_client(&daemon);
		size_t inflight = n_ops - 1;
		done[inflight] = RK_ABSENT;
		rk_state_free(&st);
		rk_replay(&st, ops, done, n_ops);   /* the acknowledged state */
		char whys[3][WHY_BYTES] = { "", "", "" };
		bool ok = false;
		enum rk_variant matched = RK_ABSENT;
		for (int v = RK_ABSENT; v <= RK_UNFLUSHED && !ok; v++) {
			const struct rk_op *op = &ops[inflight];
			if (v == RK_UNFLUSHED) {
				/* Only a short streaming update that filled the residual. */
				const struct model *m = &st.models[op->session];
				if (op->kind != RK_UPDATE || !st.exists[op->session] ||
				    model_direct(m, op->tokens) ||
				    m->layer[op->layer].residual + op->tokens < m->residual_threshold) {
					snprintf(whys[v], sizeof(whys[v]), "not possible");
					continue;
				}
			}
			struct rk_state e;
			done[inflight] = (enum rk_variant)v;
			rk_replay(&e, ops, done, n_ops);
			uint32_t unpublished[RK_SESSIONS] = { 0 };
			ok = rk_matches(client, &e, unpublished, whys[v], sizeof(whys[v]));
			rk_state_free(&e);
			if (ok) {
				matched = (enum rk_variant)v;
				memcpy(ops[inflight].unpublished, unpublished, sizeof(unpublished));
				for (int s = 0; s < RK_SESSIONS; s++)
					lazy_layers += __builtin_popcount(unpublished[s]);
			}
		}
		ck_assert_msg(ok,
			      "seed %llu round %d: SIGKILL %u us after sending op %zu (%s of '%s', layer %u, "
			      "%u tokens; ops of this round from %zu): after adoption neither state holds:\n"
			      "  without it: %s\n  with it: %s\n  with it, residual not flushed: %s\n"
			      "log:\n%s",
			      (unsigned long long)seed, round, delay, inflight,
			      rk_name(ops[inflight].kind), rk_config(ops[inflight].session).name,
			      ops[inflight].layer, ops[inflight].tokens, first, whys[RK_ABSENT],
			      whys[RK_APPLIED], whys[RK_UNFLUSHED],
			      daemon_log_tail(&daemon, tail, sizeof(tail)));
		done[inflight] = matched;
		in_flight_applied += matched != RK_ABSENT;
		rk_state_free(&st);
		rk_replay(&st, ops, done, n_ops);
		zc_set_aside_file files[4];
		size_t n_files = 0;
		ck_assert_int_eq(zc_client_set_aside(client, files, 4, &n_files), 0);
		ck_assert_msg(n_files == 0, "round %d: %zu files set aside, the first %s: %s", round,
			      n_files, files[0].file, files[0].reason);
		zc_client_close(client);
		daemon_stop(&daemon);
		daemon_set_extra_args(&daemon, args);
		daemon_restart(&daemon);
	}
	fprintf(stderr, "hardening kill loop (seed %llu, budget %s): %d SIGKILLs over %zu ops, "
			"%d in-flight ops found applied, %d layers adopted with their last flush "
			"unpublished, every adoption as acknowledged\n",
		(unsigned long long)seed, budget, kills, n_ops, in_flight_applied, lazy_layers);
	ck_assert_int_gt(kills, 0);
	rk_state_free(&st);
	free(ops);
	free(done);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}

START_TEST(sigkill_during_mixed_workload)
{
	kill_loop(0x51c0ffee, 12, 60000, "0");
}
END_TEST

START_TEST(sigkill_during_mixed_workload_under_budget)
{
	kill_loop(0xb0d9e7, 12, 60000, "10M");
}
END_TEST

/* ---- restart with a smaller address-space bound than the files need ---------- */

static int count_in_log(const char *path, const char *needle)
{
	char *log = file_read_whole(path, NULL);
	int n = 0;
	for (const char *p = strstr(log, needle); p; p = strstr(p + 1, needle))
		n++;
	free(log);
	return n;
}

/*
 * Files the address-space bound cannot map yet are passing trouble: they
 * stay, are retried, and come in as soon as mapped bytes free up (a
 * close); the log says so without repeating itself every second for
 * every file, and a later daemon with room adopts them all.
 */
START_TEST(restart_with_smaller_max_mapped_bytes)
{
	enum { FILES = 12 };
	struct daemon_harness daemon;
	const char *const args[] = { "--idle-ttl", "0", "--log-level", "info", NULL };
	char names[FILES][16], path[PATH_MAX + 64], bound[32];
	struct model models[FILES];
	struct stat st;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	uint64_t file_bytes = 0;
	for (int i = 0; i < FILES; i++) {
		snprintf(names[i], sizeof(names[i]), "m%d", i);
		zc_session_config config = small_config(names[i]);
		zc_session *session = open_session(client, &config);
		struct rng rng;
		model_init(&models[i], &config);
		rng_seed(&rng, 40 + (uint64_t)i);
		CHECK(update_checked, client, session, &models[i], &rng, 0, 9 + (uint32_t)i);
		snprintf(path, sizeof(path), "%s/session-%016" PRIx64 ".zcs", daemon.shm_dir,
			 zc_session_get_info(session)->id);
		ck_assert_int_eq(stat(path, &st), 0);
		/* What the daemon maps for it: the file and the session map. */
		file_bytes = (uint64_t)st.st_size + zc_session_map(session)->map_bytes;
		zc_session_release(session);
	}
	zc_client_close(client);
	daemon_stop(&daemon);

	/* Room for four files. */
	snprintf(bound, sizeof(bound), "%llu", (unsigned long long)(4 * file_bytes + file_bytes / 2));
	const char *const small[] = { "--idle-ttl", "0", "--log-level", "info", "--max-mapped-bytes",
				      bound, NULL };
	daemon_set_extra_args(&daemon, small);
	daemon_restart(&daemon);
	sleep_ms(4000);
	ck_assert_int_eq(count_suffix(daemon.shm_dir, ".corrupt"), 0);
	ck_assert_int_eq(count_suffix(daemon.shm_dir, ".zcs"), FILES);
	client = connect_client(&daemon);
	zc_session_info infos[FILES + 1];
	size_t count = 0;
	ck_assert_int_eq(zc_client_list_sessions(client, infos, FILES + 1, &count), 0);
	ck_assert_msg(count >= 1 && count < FILES, "%zu of %d adopted under a bound for 4", count,
		      FILES);
	int retries = count_in_log(daemon.log_path, "cannot adopt session file now");
	fprintf(stderr, "max-mapped-bytes %s: %zu adopted, %d retry lines in ~4 s for %zu files\n",
		bound, count, retries, FILES - count);
	/* A close frees room: a waiting file comes in within a few seconds. */
	ck_assert_int_eq(zc_client_close_session(client, infos[0].id), 0);
	size_t after = 0;
	for (int i = 0; i < 50; i++) {
		ck_assert_int_eq(zc_client_list_sessions(client, infos, FILES + 1, &after), 0);
		if (after == count)
			break;
		sleep_ms(100);
	}
	ck_assert_msg(after == count, "after a close, %zu sessions (was %zu): the waiting file "
		      "did not come in", after, count);
	zc_client_close(client);
	ck_assert_msg(retries <= 2 * (int)(FILES - count),
		      "the log repeats 'cannot adopt session file now' %d times in 4 s for %zu "
		      "waiting files: one line per file per second, forever, while the bound holds",
		      retries, FILES - count);
	daemon_stop(&daemon);
	daemon_set_extra_args(&daemon, args);
	daemon_restart(&daemon);
	client = connect_client(&daemon);
	ck_assert_int_eq(zc_client_list_sessions(client, infos, FILES + 1, &count), 0);
	ck_assert_uint_eq(count, FILES - 1);
	zc_client_close(client);
	for (int i = 0; i < FILES; i++)
		model_free(&models[i]);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

static Suite *hardening_suite(void)
{
	Suite *suite = suite_create("hardening");
	const struct test_case cases[] = {
		{ "trust",
		  { same_uid_client_truncating_to_views_cannot_kill_daemon,
		    same_uid_client_truncating_to_zero_cannot_kill_daemon, NULL } },
		{ "adoption", { restart_with_smaller_max_mapped_bytes, NULL } },
		{ "crashes",
		  { sigkill_during_mixed_workload, sigkill_during_mixed_workload_under_budget, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(hardening_suite(), CK_FORK);
}
