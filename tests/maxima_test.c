/*
 * Every size the daemon computes from client input is checked where it is
 * computed: sessions opened at every maximum the flags and the protocol
 * allow (and one past each) get a session or a clear refusal, never a
 * wrapped layout, a crash or a hang; the address space all sessions map
 * together is bounded by --max-mapped-bytes.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "suite_main.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 300

/* What the store allows (server/store.h) and the largest --max-tokens. */
#define MAX_LAYERS 1024u
#define MAX_HEADS 65536u
#define MAX_RESIDUAL 65536u
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

static Suite *maxima_suite(void)
{
	Suite *suite = suite_create("maxima");
	const struct test_case cases[] = {
		{ "maxima", { sessions_at_every_maximum, mapped_bytes_are_bounded, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(maxima_suite(), CK_FORK);
}
