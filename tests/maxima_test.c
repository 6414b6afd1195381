/*
 * Every size the daemon computes from client input is checked where it is
 * computed: sessions opened at every maximum the flags and the protocol
 * allow (and one past each) get a session or a clear refusal, never a
 * wrapped layout, a crash or a hang; the address space all sessions map
 * together is bounded by --max-mapped-bytes.
 */
#include <check.h>
#include <limits.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 300

/* What a session may be (zipcache/client.h) and the largest --max-tokens. */
#define MAX_LAYERS ZC_MAX_LAYERS
#define MAX_HEADS ZC_MAX_HEADS
#define MAX_RESIDUAL ZC_MAX_RESIDUAL_TOKENS
#define MAX_TOKENS_FLAG ZC_MAX_BLOCK_TOKENS

static void daemon_alive(zc_client *client, const char *after)
{
	zc_server_stats stats;
	int rc = zc_client_stats(client, &stats);
	ck_assert_msg(rc == 0, "the daemon does not answer after %s: %s", after, zc_strerror(rc));
}

START_TEST(sessions_at_every_maximum)
{
	struct daemon_harness daemon;
	char tokens_flag[32], what[256];
	snprintf(tokens_flag, sizeof(tokens_flag), "%u", MAX_TOKENS_FLAG);
	const char *const args[] = { "--max-tokens", tokens_flag, NULL };
	static const uint32_t layers[] = { 1, MAX_LAYERS };
	static const uint32_t batch_heads[][2] = { { 1, 1 }, { 1, MAX_HEADS }, { 256, 256 } };
	static const uint32_t dims[] = { 1, ZC_MAX_HEAD_DIM };
	static const uint32_t max_tokens[] = { 1, 4096, MAX_TOKENS_FLAG };
	static const uint32_t residual[] = { 1, MAX_RESIDUAL };
	int opened = 0, refused = 0;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	for (size_t a = 0; a < 2; a++)
		for (size_t b = 0; b < 3; b++)
			for (size_t d = 0; d < 2; d++)
				for (size_t t = 0; t < 3; t++)
					for (size_t r = 0; r < 2; r++) {
		zc_session_config c;
		zc_session *session = NULL;
		zc_session_config_default(&c);
		c.name = "max";
		c.layers = layers[a];
		c.batch = batch_heads[b][0];
		c.kv_heads = batch_heads[b][1];
		c.head_dim_k = dims[d];
		c.head_dim_v = dims[1 - d];
		c.max_tokens = max_tokens[t];
		c.residual_tokens = residual[r];
		snprintf(what, sizeof(what), "layers %u, batch %u x kv_heads %u, dims %u/%u, max_tokens %u, "
			 "residual %u", c.layers, c.batch, c.kv_heads, c.head_dim_k, c.head_dim_v,
			 c.max_tokens, c.residual_tokens);
		int rc = zc_session_open(client, &c, &session);
		ck_assert_msg(rc == 0 || rc == ZC_EEXHAUSTED, "%s: %s: %s", what, zc_error_name(rc),
			      zc_client_last_error(client));
		if (rc == ZC_EEXHAUSTED) {
			ck_assert_msg(strstr(zc_client_last_error(client), "address space") != NULL,
				      "%s: the refusal does not name the limit: %s", what,
				      zc_client_last_error(client));
			refused++;
		} else {
			/* A session that opened takes its first token. */
			size_t elements = (size_t)c.batch * c.kv_heads * (c.head_dim_k > c.head_dim_v ?
									     c.head_dim_k : c.head_dim_v);
			uint16_t *kv = calloc(elements, 2);
			zc_view view;
			if (elements <= (1u << 20)) {
				rc = zc_update_and_fetch(session, c.layers - 1, 1, kv, kv, &view, NULL);
				ck_assert_msg(rc == 0, "%s: first token: %s: %s", what, zc_error_name(rc),
					      zc_client_last_error(client));
				ck_assert_uint_eq(view.tokens, 1);
			}
			free(kv);
			ck_assert_int_eq(zc_session_close(session), 0);
			opened++;
		}
		daemon_alive(client, what);
	}
	fprintf(stderr, "maxima: %d sessions opened, %d refused for their size\n", opened, refused);
	ck_assert_int_gt(opened, 0);
	ck_assert_int_gt(refused, 0);

	/* One past each maximum: a refusal that says what the limit is. */
	struct {
		const char *what;
		uint32_t layers, batch, kv_heads, dim, max_tokens, residual;
	} past[] = {
		{ "layers", MAX_LAYERS + 1, 1, 1, 8, 16, 8 },
		{ "heads", 1, 1, MAX_HEADS + 1, 8, 16, 8 },
		{ "batch x heads", 1, 2, MAX_HEADS / 2 + 1, 8, 16, 8 },
		{ "head_dim", 1, 1, 1, ZC_MAX_HEAD_DIM + 1, 16, 8 },
		{ "max_tokens", 1, 1, 1, 8, MAX_TOKENS_FLAG + 1, 8 },
		{ "residual_tokens", 1, 1, 1, 8, 16, MAX_RESIDUAL + 1 },
		{ "everything", UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX },
	};
	for (size_t i = 0; i < sizeof(past) / sizeof(past[0]); i++) {
		zc_session_config c;
		zc_session *session = NULL;
		zc_session_config_default(&c);
		c.name = "past";
		c.layers = past[i].layers;
		c.batch = past[i].batch;
		c.kv_heads = past[i].kv_heads;
		c.head_dim_k = c.head_dim_v = past[i].dim;
		c.max_tokens = past[i].max_tokens;
		c.residual_tokens = past[i].residual;
		int rc = zc_session_open(client, &c, &session);
		ck_assert_msg(rc == ZC_EINVALID || rc == ZC_EEXHAUSTED || rc == ZC_ESHAPE,
			      "one past the %s maximum: %s (%s)", past[i].what, zc_error_name(rc),
			      zc_client_last_error(client));
		daemon_alive(client, past[i].what);
	}
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* Sessions together may map at most --max-mapped-bytes. */
START_TEST(mapped_bytes_are_bounded)
{
	struct daemon_harness daemon;
	const char *const args[] = { "--max-mapped-bytes", "64M", NULL };
	zc_session *sessions[64] = { 0 };
	char names[64][16];
	int n = 0, rc = 0;

	daemon_start(&daemon, args);
	zc_client *client = connect_client(&daemon);
	for (; n < 64; n++) {
		zc_session_config c;
		zc_session_config_default(&c);
		snprintf(names[n], sizeof(names[n]), "m%d", n);
		c.name = names[n];
		c.layers = 4;
		c.kv_heads = 8;
		c.head_dim_k = c.head_dim_v = 128;
		c.max_tokens = 512;    /* about 10 MiB of sparse file each */
		rc = zc_session_open(client, &c, &sessions[n]);
		if (rc < 0)
			break;
	}
	ck_assert_msg(n > 0 && n < 64, "%d sessions of ~10 MiB fit under 64 MiB of address space", n);
	ck_assert_int_eq(rc, ZC_EEXHAUSTED);
	ck_assert_msg(strstr(zc_client_last_error(client), "--max-mapped-bytes") != NULL,
		      "the refusal does not name the limit: %s", zc_client_last_error(client));
	/* Closing one makes room for one. */
	ck_assert_int_eq(zc_session_close(sessions[0]), 0);
	zc_session_config c;
	zc_session_config_default(&c);
	c.name = "again";
	c.layers = 4;
	c.kv_heads = 8;
	c.head_dim_k = c.head_dim_v = 128;
	c.max_tokens = 512;
	ck_assert_int_eq(zc_session_open(client, &c, &sessions[0]), 0);
	for (int i = 0; i < n; i++)
		zc_session_close(sessions[i]);
	zc_client_close(client);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST


/*
 * A daemon whose address space is limited (ulimit -v) bounds what its
 * sessions map below it by default, so it refuses sessions with a reason
 * and goes on accepting connections and serving — it never runs out of
 * address space for its own allocations (where libuv would abort).
 */
START_TEST(address_space_limit_is_respected)
{
#ifdef __SANITIZE_ADDRESS__
	fprintf(stderr, "maxima_test: ASan reserves its shadow memory: no address-space limit here\n");
#else
	struct daemon_harness daemon;
	char sock[PATH_MAX], shm[PATH_MAX];
	zc_session *sessions[200] = { 0 };
	char names[200][16];
	int n = 0, rc = 0;

	/* The harness's directory, for the socket and shm-dir of our own launch. */
	daemon_start(&daemon, NULL);
	daemon_stop(&daemon);
	snprintf(sock, sizeof(sock), "%s/as.sock", daemon.dir);
	snprintf(shm, sizeof(shm), "%s/as-shm", daemon.dir);
	pid_t pid = fork_dying_with_parent(1);
	if (pid == 0) {
		struct rlimit as = { 4ull << 30, 4ull << 30 };
		char log_path[PATH_MAX];
		snprintf(log_path, sizeof(log_path), "%s/as.log", daemon.dir);
		if (!freopen(log_path, "w", stderr) || !freopen(log_path, "a", stdout) ||
		    setrlimit(RLIMIT_AS, &as) < 0)
			_exit(2);
		execl(daemon_binary_path(), "zipcached", "--socket", sock, "--shm-dir", shm,
		      "--metrics-listen", "off", (char *)NULL);
		_exit(3);
	}
	for (int i = 0; i < 1000 && !socket_accepts(sock); i++)
		sleep_ms(10);
	ck_assert_msg(socket_accepts(sock), "the daemon under ulimit -v 4G does not listen");
	zc_client *client;
	ck_assert_int_eq(zc_client_connect(sock, 20000, &client), 0);
	for (; n < 200; n++) {
		zc_session_config c;
		zc_session_config_default(&c);
		snprintf(names[n], sizeof(names[n]), "as%d", n);
		c.name = names[n];
		c.layers = 8;
		c.kv_heads = 8;
		c.head_dim_k = c.head_dim_v = 128;
		c.max_tokens = 4096;    /* about 120 MiB of sparse file each */
		rc = zc_session_open(client, &c, &sessions[n]);
		if (rc < 0)
			break;
	}
	ck_assert_msg(n > 0 && n < 200 && rc == ZC_EEXHAUSTED,
		      "%d sessions of ~120 MiB under a 4 GiB address space, then %s", n,
		      zc_error_name(rc));
	ck_assert_msg(strstr(zc_client_last_error(client), "address space") != NULL,
		      "the refusal does not say what ran out: %s", zc_client_last_error(client));
	/* Still serving: new connections, updates, stats. */
	zc_client *second;
	ck_assert_int_eq(zc_client_connect(sock, 20000, &second), 0);
	daemon_alive(second, "the address-space refusal");
	uint16_t kv[8 * 128] = { 0 };
	zc_view view;
	ck_assert_int_eq(zc_update_and_fetch(sessions[0], 0, 1, kv, kv, &view, NULL), 0);
	zc_client_close(second);
	for (int i = 0; i < n; i++)
		zc_session_release(sessions[i]);
	zc_client_close(client);
	int status = 0;
	ck_assert_int_eq(waitpid(pid, &status, WNOHANG), 0);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	daemon_cleanup(&daemon);
#endif
}
END_TEST

static Suite *maxima_suite(void)
{
	Suite *suite = suite_create("maxima");
	const struct test_case cases[] = {
		{ "maxima", { sessions_at_every_maximum, mapped_bytes_are_bounded,
			      address_space_limit_is_respected, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(maxima_suite(), CK_FORK);
}
