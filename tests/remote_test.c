/*
 * The remote tier (server/remote.c, server/redis_router.c) against real
 * Redis: a standalone server, one with an ACL user, and a three-primary
 * cluster (tests/redis_harness.c), plus servers of their own for the tests
 * that kill, stop or restart them.
 */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../server/options.h"
#include "daemon_harness.h"
#include "process_run.h"
#include "redis_harness.h"
#include "../server/redis_router.h"
#include "../server/remote.h"
#include "suite_main.h"
#include "zipcache/error.h"

static struct redis_server standalone;
static struct redis_server guarded;    /* ACL user, default user off */
static struct redis_cluster cluster;

#define ACL_USER "zc-node"
#define ACL_PASSWORD "pw-Xq7-never-logged"

static const uint8_t fingerprint[16] = { 0xfe, 0xed, 0xfa, 0xce, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };

static void standalone_up(void)
{
	redis_server_start(&standalone, NULL, NULL);
}

static void standalone_down(void)
{
	redis_server_stop(&standalone);
}

static void guarded_up(void)
{
	redis_server_start(&guarded, ACL_USER, ACL_PASSWORD);
}

static void guarded_down(void)
{
	redis_server_stop(&guarded);
}

static void cluster_up(void)
{
	redis_cluster_start(&cluster);
}

static void cluster_down(void)
{
	redis_cluster_stop(&cluster);
}

/* A remote over the servers' ports. */
static struct remote *remote_over(const struct redis_server *servers, int n, const char *credentials,
				  uint32_t timeout_ms)
{
	struct remote_config config = { .timeout_ms = timeout_ms };
	char url[512] = "redis://", why[512] = "";
	for (int i = 0; i < n; i++)
		snprintf(url + strlen(url), sizeof(url) - strlen(url), "%s127.0.0.1:%u", i ? "," : "",
			 servers[i].port);
	ck_assert_int_eq(remote_url_parse(url, &config, why, sizeof(why)), 0);
	if (credentials)
		snprintf(config.credentials_path, sizeof(config.credentials_path), "%s", credentials);
	struct remote *remote = NULL;
	int rc = remote_open(&config, &remote, why, sizeof(why));
	ck_assert_msg(rc == 0, "remote_open: %s (%s)", zc_strerror(rc), why);
	return remote;
}

static struct remote_key block_key(uint32_t uid, const char *name, uint32_t layer, uint32_t block)
{
	struct remote_key key;
	struct remote_key_parts parts = {
		.kind = REMOTE_KEY_BLOCK, .name = name, .fingerprint = fingerprint,
		.fingerprint_len = sizeof(fingerprint), .layer = layer, .block = block,
	};
	ck_assert_int_eq(remote_key_make(&key, uid, &parts), 0);
	return key;
}

/* Bytes that differ by seed and position. */
static void *pattern(size_t len, uint32_t seed)
{
	uint8_t *bytes = malloc(len ? len : 1);
	ck_assert_ptr_nonnull(bytes);
	uint32_t x = seed * 2654435761u + 1;
	for (size_t i = 0; i < len; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		bytes[i] = (uint8_t)x;
	}
	return bytes;
}

/* A raw command's integer answer. */
static long long raw_integer(const struct redis_server *server, const char *format, const char *key)
{
	redisReply *reply = redis_command(server, format, key);
	ck_assert_msg(reply->type == REDIS_REPLY_INTEGER, "%s: reply type %d (%s)", format, reply->type,
		      reply->type == REDIS_REPLY_ERROR ? reply->str : "");
	long long value = reply->integer;
	freeReplyObject(reply);
	return value;
}

/* ---- configuration and keys (no server) ------------------------------ */

START_TEST(test_url_parse)
{
	struct remote_config config = { .timeout_ms = 1 };
	char why[300];
	ck_assert_int_eq(remote_url_parse("redis://127.0.0.1:6379", &config, why, sizeof(why)), 0);
	ck_assert_uint_eq(config.n_endpoints, 1);
	ck_assert_str_eq(config.endpoints[0].host, "127.0.0.1");
	ck_assert_uint_eq(config.endpoints[0].port, 6379);
	ck_assert_int_eq(remote_url_parse("redis://a.example:7000,b-2.example:7001,[::1]:7002", &config,
					  why, sizeof(why)), 0);
	ck_assert_uint_eq(config.n_endpoints, 3);
	ck_assert_str_eq(config.endpoints[1].host, "b-2.example");
	ck_assert_uint_eq(config.endpoints[1].port, 7001);
	ck_assert_str_eq(config.endpoints[2].host, "::1");
	ck_assert_uint_eq(config.endpoints[2].port, 7002);

	static const struct {
		const char *url, *says;
	} bad[] = {
		{ "127.0.0.1:6379", "redis:// or unix://" },
		{ "http://127.0.0.1:6379", "redis:// or unix://" },
		{ "redis://", "empty address" },
		{ "redis://host", "HOST:PORT" },
		{ "redis://host:", "port is missing" },
		{ "redis://host:0", "outside 1..65535" },
		{ "redis://host:65536", "outside 1..65535" },
		{ "redis://host:12x", "not a number" },
		{ "redis://:6379", "host is empty" },
		{ "redis://a:1,,b:2", "empty address" },
		{ "redis://a:1,", "empty address" },
		{ "redis://user:pw@host:6379", "--remote-credentials" },
		{ "redis://host:6379/0", "not supported" },
		{ "redis://ho st:6379", "character" },
		{ "redis://[::1:6379", "IPv6" },
		{ "redis://::1:6379", "HOST:PORT" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct remote_config before = config;
		why[0] = '\0';
		ck_assert_msg(remote_url_parse(bad[i].url, &config, why, sizeof(why)) == -EINVAL,
			      "%s was accepted", bad[i].url);
		ck_assert_msg(strstr(why, bad[i].says), "%s: '%s' does not say '%s'", bad[i].url, why,
			      bad[i].says);
		ck_assert_msg(memcmp(&before, &config, sizeof(config)) == 0, "%s changed the config",
			      bad[i].url);
	}
	ck_assert_int_eq(remote_url_parse("unix:///run/redis/redis.sock", &config, why, sizeof(why)), 0);
	ck_assert_uint_eq(config.n_endpoints, 1);
	ck_assert_str_eq(config.endpoints[0].host, "/run/redis/redis.sock");
	ck_assert_uint_eq(config.endpoints[0].port, 0);
	static const struct {
		const char *url, *says;
	} bad_unix[] = {
		{ "unix://", "ABSOLUTE" },
		{ "unix://run/redis.sock", "ABSOLUTE" },
		{ "unix:///a.sock,/b.sock", "no list" },
	};
	for (size_t i = 0; i < sizeof(bad_unix) / sizeof(bad_unix[0]); i++) {
		ck_assert_int_eq(remote_url_parse(bad_unix[i].url, &config, why, sizeof(why)), -EINVAL);
		ck_assert_msg(strstr(why, bad_unix[i].says), "%s: %s", bad_unix[i].url, why);
	}
	char long_path[160] = "unix:///";
	memset(long_path + 8, 'p', 120);
	long_path[128] = '\0';
	ck_assert_int_eq(remote_url_parse(long_path, &config, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "longer than"));
	/* Seventeen addresses: one too many. */
	char many[512] = "redis://";
	for (int i = 0; i <= REMOTE_MAX_ENDPOINTS; i++)
		snprintf(many + strlen(many), sizeof(many) - strlen(many), "%sh:%d", i ? "," : "", 1000 + i);
	ck_assert_int_eq(remote_url_parse(many, &config, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "more than"));
}
END_TEST

START_TEST(test_options)
{
	struct options o;
	char *ok[] = { "zipcached", "--remote", "redis://127.0.0.1:7000,127.0.0.1:7001",
		       "--remote-timeout-ms", "250", "--remote-credentials", "/nonexistent/creds", NULL };
	options_default(&o);
	ck_assert_uint_eq(o.remote.n_endpoints, 0);
	ck_assert_uint_eq(o.remote.timeout_ms, REMOTE_TIMEOUT_MS_DEFAULT);
	ck_assert_int_eq(options_parse(&o, 7, ok), 0);
	ck_assert_uint_eq(o.remote.n_endpoints, 2);
	ck_assert_uint_eq(o.remote.endpoints[1].port, 7001);
	ck_assert_uint_eq(o.remote.timeout_ms, 250);
	ck_assert_str_eq(o.remote.credentials_path, "/nonexistent/creds");

	char *bad_url[] = { "zipcached", "--remote", "redis://x", NULL };
	options_default(&o);
	ck_assert_int_eq(options_parse(&o, 3, bad_url), -EINVAL);
	char *bad_timeout[] = { "zipcached", "--remote", "redis://x:1", "--remote-timeout-ms", "0", NULL };
	options_default(&o);
	ck_assert_int_eq(options_parse(&o, 5, bad_timeout), -EINVAL);
	char *orphan[] = { "zipcached", "--remote-credentials", "/x", NULL };
	options_default(&o);
	ck_assert_int_eq(options_parse(&o, 3, orphan), -EINVAL);
}
END_TEST

START_TEST(test_keys)
{
	struct remote_key a, b;
	/* The schema, byte for byte. */
	struct remote_key_parts manifest = { .kind = REMOTE_KEY_MANIFEST, .name = "s1",
					     .fingerprint = (const uint8_t *)"\x01\xab", .fingerprint_len = 2,
					     .generation = 5 };
	ck_assert_int_eq(remote_key_make(&a, 1000, &manifest), 0);
	ck_assert_str_eq(a.text, "zc:1:1000:m:7331");
	ck_assert_uint_eq(a.len, strlen(a.text));
	struct remote_key_parts residual = manifest;
	residual.kind = REMOTE_KEY_RESIDUAL;
	residual.layer = 31;
	ck_assert_int_eq(remote_key_make(&a, 7, &residual), 0);
	ck_assert_str_eq(a.text, "zc:1:7:r:7331:01ab:5:31");
	a = block_key(1000, "s1", 3, 17);
	ck_assert_str_eq(a.text, "zc:1:1000:b:7331:feedface0102030405060708090a0b0c:0:3:17");
	/* Two generations of one block never share a key. */
	struct remote_key_parts generations = residual;
	generations.kind = REMOTE_KEY_BLOCK;
	generations.generation = UINT64_MAX;
	ck_assert_int_eq(remote_key_make(&b, 7, &generations), 0);
	ck_assert_str_eq(b.text, "zc:1:7:b:7331:01ab:18446744073709551615:31:0");
	generations.generation = 1;
	ck_assert_int_eq(remote_key_make(&a, 7, &generations), 0);
	ck_assert_str_ne(a.text, b.text);
	/* The manifest needs no fingerprint. */
	struct remote_key_parts bare = { .kind = REMOTE_KEY_MANIFEST, .name = "s1" };
	ck_assert_int_eq(remote_key_make(&a, 1000, &bare), 0);
	ck_assert_str_eq(a.text, "zc:1:1000:m:7331");
	struct remote_key_parts chunk = { .kind = REMOTE_KEY_CHUNK, .fingerprint = (const uint8_t *)"\x02",
					  .fingerprint_len = 1, .chain = (const uint8_t *)"\xff\x00",
					  .chain_len = 2, .layer = 4 };
	ck_assert_int_eq(remote_key_make(&a, 0, &chunk), 0);
	ck_assert_str_eq(a.text, "zc:1:0:c:02:ff00:4");

	/* Two uids never share a key; names that look like keys, separators
	 * or hash tags stay inside their uid's hex. */
	static const char *const names[] = {
		"a", "a:b", "{tag}", "}{", "zc:1:1001:b:61", "x y\tz", "\xc3\xbc\xe2\x82\xac", "*", "?[]",
	};
	size_t n = sizeof(names) / sizeof(names[0]);
	for (size_t i = 0; i < n; i++) {
		a = block_key(1000, names[i], 0, 0);
		b = block_key(1001, names[i], 0, 0);
		ck_assert_str_ne(a.text, b.text);
		ck_assert_msg(strncmp(a.text, "zc:1:1000:b:", 12) == 0, "%s", a.text);
		ck_assert_msg(strncmp(b.text, "zc:1:1001:b:", 12) == 0, "%s", b.text);
		for (size_t k = 12; k < a.len; k++)
			ck_assert_msg(strchr("0123456789abcdef:", a.text[k]), "key %s has '%c'", a.text,
				      a.text[k]);
		/* Exactly the schema's field count: no name adds a field. */
		int colons = 0;
		for (size_t k = 0; k < a.len; k++)
			colons += a.text[k] == ':';
		ck_assert_int_eq(colons, 8);
		for (size_t j = 0; j < i; j++) {
			b = block_key(1000, names[j], 0, 0);
			ck_assert_str_ne(a.text, b.text);
		}
	}
	/* Missing, empty or oversized parts. */
	char long_name[ZC_SESSION_NAME_MAX + 2];
	memset(long_name, 'n', sizeof(long_name) - 1);
	long_name[sizeof(long_name) - 1] = '\0';
	struct remote_key_parts p = manifest;
	p.name = long_name;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	long_name[ZC_SESSION_NAME_MAX] = '\0';
	ck_assert_int_eq(remote_key_make(&a, UINT32_MAX, &p), 0); /* the longest name fits */
	p.name = "";
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p.name = NULL;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p = residual;
	p.fingerprint_len = 0;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p.fingerprint_len = REMOTE_ID_MAX + 1;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p.fingerprint = NULL;
	p.fingerprint_len = 2;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p = chunk;
	p.chain_len = 0;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	p = manifest;
	p.kind = REMOTE_KEY_KIND_COUNT;
	ck_assert_int_eq(remote_key_make(&a, 1, &p), ZC_EINVALID);
	/* The largest parts of every kind fit. */
	static uint8_t id[REMOTE_ID_MAX];
	struct remote_key_parts big = { .kind = REMOTE_KEY_BLOCK, .name = long_name, .fingerprint = id,
					.fingerprint_len = REMOTE_ID_MAX, .chain = id,
					.chain_len = REMOTE_ID_MAX, .generation = UINT64_MAX,
					.layer = UINT32_MAX, .block = UINT32_MAX };
	for (int kind = 0; kind < REMOTE_KEY_KIND_COUNT; kind++) {
		big.kind = (enum remote_key_kind)kind;
		ck_assert_int_eq(remote_key_make(&a, UINT32_MAX, &big), 0);
	}
}
END_TEST

START_TEST(test_crc16)
{
	/* The Cluster spec's check value of CRC16/XMODEM. */
	ck_assert_uint_eq(router_crc16("123456789", 9), 0x31c3);
	ck_assert_uint_eq(router_key_slot("{user1000}.following", 20),
			  router_key_slot("{user1000}.followers", 20));
	ck_assert_uint_eq(router_key_slot("{user1000}.following", 20), router_key_slot("user1000", 8));
	/* An empty tag hashes the whole key; only the first tag counts. */
	ck_assert_uint_eq(router_key_slot("foo{}{bar}", 10), router_crc16("foo{}{bar}", 10) & 16383);
	ck_assert_uint_eq(router_key_slot("foo{{bar}}zap", 13), router_key_slot("{bar", 4));
	ck_assert_uint_eq(router_key_slot("foo{bar}{zap}", 13), router_key_slot("bar", 3));
	ck_assert_uint_eq(router_key_slot("foo{bar", 7), router_crc16("foo{bar", 7) & 16383);
}
END_TEST

/* ---- credentials ----------------------------------------------------- */

/* Writes a credentials file with mode; its path in path. */
static void credentials_write(char *path, size_t size, const char *text, mode_t mode)
{
	snprintf(path, size, "%s/creds-XXXXXX", standalone.dir[0] ? standalone.dir : "/tmp");
	int fd = mkstemp(path);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
	ck_assert_int_eq(fchmod(fd, mode), 0);
	close(fd);
}

struct root_file_case {
	const char *path;
	int rc;
};

/* In a helper: as uid 12345 (group 12345), reads a file of root's. */
static int read_as_other_user(void *arg)
{
	const struct root_file_case *c = arg;
	char why[512] = "", *user = NULL, *password = NULL;
	CHILD_EXPECT(user_become(12345, 12345, why, sizeof(why)), "%s", why);
	int rc = remote_credentials_read(c->path, &user, &password, why, sizeof(why));
	CHILD_EXPECT(rc == c->rc, "%s, not %s (%s)", zc_error_name(rc), zc_error_name(c->rc), why);
	CHILD_EXPECT(rc < 0 || strcmp(password, ACL_PASSWORD) == 0, "the password read wrong");
	CHILD_EXPECT(rc == 0 || strstr(why, "chmod 640"), "'%s'", why);
	free(user);
	free(password);
	return 0;
}

START_TEST(test_credentials_file)
{
	char path[128], why[512];
	char *user, *password;

	credentials_write(path, sizeof(path), ACL_USER "\n" ACL_PASSWORD "\n", 0600);
	ck_assert_int_eq(remote_credentials_read(path, &user, &password, why, sizeof(why)), 0);
	ck_assert_str_eq(user, ACL_USER);
	ck_assert_str_eq(password, ACL_PASSWORD);
	free(user);
	free(password);
	unlink(path);
	/* No trailing newline, CR LF, the default user. */
	credentials_write(path, sizeof(path), "\r\n" ACL_PASSWORD, 0400);
	ck_assert_int_eq(remote_credentials_read(path, &user, &password, why, sizeof(why)), 0);
	ck_assert_ptr_null(user);
	ck_assert_str_eq(password, ACL_PASSWORD);
	free(password);
	unlink(path);

	static const struct {
		const char *text;
		mode_t mode;
		int rc;
		const char *says;
	} bad[] = {
		{ ACL_USER "\n" ACL_PASSWORD "\n", 0644, ZC_EDENIED, "chmod 600" },
		{ ACL_USER "\n" ACL_PASSWORD "\n", 0640, ZC_EDENIED, "group or others" },
		{ ACL_USER "\n" ACL_PASSWORD "\n", 0604, ZC_EDENIED, "group or others" },
		{ ACL_USER "\n" ACL_PASSWORD "\n", 0610, ZC_EDENIED, "group or others" },
		{ ACL_PASSWORD "\n", 0600, -EINVAL, "empty password" },
		{ ACL_PASSWORD, 0600, -EINVAL, "no second line" },
		{ ACL_USER "\n" ACL_PASSWORD "\nthird\n", 0600, -EINVAL, "more than two lines" },
		{ ACL_USER "\n\n", 0600, -EINVAL, "empty password" },
		{ "a user\n" ACL_PASSWORD "\n", 0600, -EINVAL, "space or control" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		credentials_write(path, sizeof(path), bad[i].text, bad[i].mode);
		why[0] = '\0';
		int rc = remote_credentials_read(path, &user, &password, why, sizeof(why));
		ck_assert_msg(rc == bad[i].rc, "case %zu: %s, not %s (%s)", i, zc_error_name(rc),
			      zc_error_name(bad[i].rc), why);
		ck_assert_msg(strstr(why, bad[i].says), "case %zu: '%s' does not say '%s'", i, why,
			      bad[i].says);
		ck_assert_msg(strstr(why, path), "case %zu: '%s' does not name the file", i, why);
		ck_assert_msg(!strstr(why, ACL_PASSWORD), "case %zu: the password is in '%s'", i, why);
		ck_assert_ptr_null(user);
		ck_assert_ptr_null(password);
		unlink(path);
	}
	/* Another uid's file, a directory, no file. */
	if (geteuid() == 0) {
		credentials_write(path, sizeof(path), ACL_USER "\n" ACL_PASSWORD "\n", 0600);
		ck_assert_int_eq(chown(path, 12345, 12345), 0);
		ck_assert_int_eq(remote_credentials_read(path, &user, &password, why, sizeof(why)), ZC_EDENIED);
		ck_assert_ptr_nonnull(strstr(why, "owned by uid 12345"));
		unlink(path);
	}
	/* Root's file, read by another uid: group-readable passes, no more. */
	if (geteuid() == 0) {
		credentials_write(path, sizeof(path), ACL_USER "\n" ACL_PASSWORD "\n", 0640);
		ck_assert_int_eq(chown(path, 0, 12345), 0);
		struct root_file_case pass = { path, 0 }, refuse = { path, ZC_EDENIED };
		child_wait_ok(child_spawn(read_as_other_user, &pass, -1), "root's 0640 file");
		ck_assert_int_eq(chmod(path, 0644), 0);
		child_wait_ok(child_spawn(read_as_other_user, &refuse, -1), "root's 0644 file");
		ck_assert_int_eq(chmod(path, 0660), 0);
		child_wait_ok(child_spawn(read_as_other_user, &refuse, -1), "root's 0660 file");
		unlink(path);
	}
	ck_assert_int_eq(remote_credentials_read("/tmp", &user, &password, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "not a regular file"));
	ck_assert_int_eq(remote_credentials_read("/nonexistent/creds", &user, &password, why, sizeof(why)),
			 -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "cannot open"));

	/* remote_open refuses the daemon a bad file: nothing made. */
	credentials_write(path, sizeof(path), ACL_USER "\n" ACL_PASSWORD "\n", 0644);
	struct remote_config config = { .timeout_ms = 100, .n_endpoints = 1 };
	snprintf(config.endpoints[0].host, sizeof(config.endpoints[0].host), "127.0.0.1");
	config.endpoints[0].port = 1;
	snprintf(config.credentials_path, sizeof(config.credentials_path), "%s", path);
	struct remote *remote = (struct remote *)1;
	ck_assert_int_eq(remote_open(&config, &remote, why, sizeof(why)), ZC_EDENIED);
	ck_assert_ptr_null(remote);
	ck_assert_ptr_null(strstr(why, ACL_PASSWORD));
	unlink(path);
}
END_TEST

/* ---- standalone ------------------------------------------------------ */

START_TEST(test_standalone_set_get)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 2000);
	struct remote_key key = block_key(1000, "session-a", 0, 0);
	void *value;
	size_t len;

	ck_assert_int_eq(remote_ping(remote), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_ENOTFOUND);
	ck_assert_ptr_null(value);
	ck_assert_int_eq(remote_exists(remote, &key), 0);
	ck_assert_int_eq(remote_set(remote, &key, "hello", 5, 0), 0);
	ck_assert_int_eq(remote_exists(remote, &key), 1);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, 5);
	ck_assert_int_eq(memcmp(value, "hello", 5), 0);
	free(value);
	/* An empty value is a value, not a missing key. */
	ck_assert_int_eq(remote_set(remote, &key, "", 0, 0), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, 0);
	free(value);

	/* A batch: every write confirmed, every read back; misses told apart. */
	enum { N = 300 };
	static struct remote_key keys[N + 10];
	static struct remote_item items[N + 10];
	void *values[N];
	for (int i = 0; i < N; i++) {
		keys[i] = block_key(1000, "session-b", (uint32_t)i / 10, (uint32_t)i % 10);
		values[i] = pattern(100 + (size_t)i * 13, (uint32_t)i);
		items[i] = (struct remote_item){ .key = &keys[i], .value = values[i], .len = 100 + (size_t)i * 13 };
	}
	ck_assert_int_eq(remote_set_many(remote, items, N, 600), 0);
	for (int i = N; i < N + 10; i++) {
		keys[i] = block_key(1000, "session-b", 999, (uint32_t)i);
		items[i] = (struct remote_item){ .key = &keys[i] };
	}
	ck_assert_int_eq(remote_get_many(remote, items, N + 10), 0);
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(items[i].status, 0);
		ck_assert_uint_eq(items[i].got_len, 100 + (size_t)i * 13);
		ck_assert_int_eq(memcmp(items[i].got, values[i], items[i].got_len), 0);
		free(items[i].got);
	}
	for (int i = N; i < N + 10; i++) {
		ck_assert_int_eq(items[i].status, ZC_ENOTFOUND);
		ck_assert_ptr_null(items[i].got);
	}
	const struct remote_key *doomed[N + 10];
	for (int i = 0; i < N + 10; i++)
		doomed[i] = &keys[i];
	uint64_t deleted = 0;
	ck_assert_int_eq(remote_del_many(remote, doomed, N + 10, &deleted), 0);
	ck_assert_uint_eq(deleted, N);
	ck_assert_int_eq(remote_exists(remote, &keys[0]), 0);

	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert(stats.up);
	ck_assert_uint_ge(stats.bytes_sent, 100 * N);
	ck_assert_uint_ge(stats.bytes_received, 100 * N);
	ck_assert_uint_ge(stats.latency_count, 8);
	uint64_t in_buckets = 0;
	for (int i = 0; i < METRICS_BUCKETS; i++)
		in_buckets += stats.latency_buckets[i];
	ck_assert_uint_eq(in_buckets, stats.latency_count);
	for (int i = 0; i < REMOTE_ERROR_KIND_COUNT; i++)
		ck_assert_uint_eq(stats.errors[i], 0);
	for (int i = 0; i < N; i++)
		free(values[i]);
	remote_close(remote);
}
END_TEST

struct worker {
	struct remote *remote;
	uint32_t uid;
	int failures;
};

/* One of several threads on one remote: batches of its own keys. */
static void *worker_run(void *arg)
{
	struct worker *w = arg;
	enum { KEYS = 40 };
	struct remote_key keys[KEYS];
	struct remote_item items[KEYS];
	char values[KEYS][32];
	for (int round = 0; round < 20; round++) {
		for (int i = 0; i < KEYS; i++) {
			keys[i] = block_key(w->uid, "threads", (uint32_t)round, (uint32_t)i);
			snprintf(values[i], sizeof(values[i]), "%u/%d/%d", w->uid, round, i);
			items[i] = (struct remote_item){ .key = &keys[i], .value = values[i],
							 .len = strlen(values[i]) };
		}
		if (remote_set_many(w->remote, items, KEYS, 60) != 0 ||
		    remote_get_many(w->remote, items, KEYS) != 0) {
			w->failures++;
			continue;
		}
		for (int i = 0; i < KEYS; i++) {
			w->failures += items[i].status != 0 || items[i].got_len != strlen(values[i]) ||
				       memcmp(items[i].got, values[i], items[i].got_len) != 0;
			free(items[i].got);
		}
	}
	return NULL;
}

/* remote.h promises calls from several threads at once. */
START_TEST(test_standalone_threads)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 5000);
	enum { THREADS = 6 };
	pthread_t threads[THREADS];
	struct worker workers[THREADS];
	for (int i = 0; i < THREADS; i++) {
		workers[i] = (struct worker){ .remote = remote, .uid = 2000 + (uint32_t)i };
		ck_assert_int_eq(pthread_create(&threads[i], NULL, worker_run, &workers[i]), 0);
	}
	for (int i = 0; i < THREADS; i++) {
		ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
		ck_assert_int_eq(workers[i].failures, 0);
	}
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert_uint_eq(stats.latency_count, 1 + THREADS * 20 * 2);
	remote_close(remote);
}
END_TEST

/* unix:///PATH: the same calls over the server's Unix socket. */
START_TEST(test_standalone_unix_socket)
{
	struct remote_config config = { .timeout_ms = 2000 };
	char url[128], why[512];
	snprintf(url, sizeof(url), "unix://%s", standalone.socket_path);
	ck_assert_int_eq(remote_url_parse(url, &config, why, sizeof(why)), 0);
	struct remote *remote = NULL;
	ck_assert_int_eq(remote_open(&config, &remote, why, sizeof(why)), 0);
	struct remote_key key = block_key(1000, "unix", 0, 0);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_set(remote, &key, "over unix", 9, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, 9);
	ck_assert_int_eq(memcmp(value, "over unix", 9), 0);
	free(value);
	remote_close(remote);
	/* A path nothing listens on: an error naming it. */
	snprintf(url, sizeof(url), "unix://%s/none.sock", standalone.dir);
	ck_assert_int_eq(remote_url_parse(url, &config, why, sizeof(why)), 0);
	ck_assert_int_eq(remote_open(&config, &remote, why, sizeof(why)), 0);
	ck_assert_int_eq(remote_ping(remote), ZC_EREMOTE);
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "none.sock"), "%s", why);
	remote_close(remote);
}
END_TEST

START_TEST(test_standalone_uids_apart)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 2000);
	static const char *const names[] = { "shared", "a:b", "{x}", "zc:1:1001:b" };
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		struct remote_key mine = block_key(1000, names[i], 1, 2);
		struct remote_key theirs = block_key(1001, names[i], 1, 2);
		void *value;
		size_t len;
		ck_assert_int_eq(remote_set(remote, &mine, "uid 1000", 8, 60), 0);
		ck_assert_int_eq(remote_get(remote, &theirs, &value, &len), ZC_ENOTFOUND);
		ck_assert_int_eq(remote_set(remote, &theirs, "uid 1001", 8, 60), 0);
		ck_assert_int_eq(remote_get(remote, &mine, &value, &len), 0);
		ck_assert_int_eq(memcmp(value, "uid 1000", 8), 0);
		free(value);
	}
	remote_close(remote);
}
END_TEST

START_TEST(test_standalone_large)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 5000);
	struct remote_key key = block_key(1000, "large", 0, 0);
	size_t big = 8u << 20;
	void *bytes = pattern(big, 42), *value;
	size_t len;

	ck_assert_int_eq(remote_set(remote, &key, bytes, big, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, big);
	ck_assert_int_eq(memcmp(value, bytes, big), 0);
	free(value);
	/* Several in one batch. */
	struct remote_key keys[3] = { block_key(1000, "large", 1, 0), block_key(1000, "large", 1, 1),
				      block_key(1000, "large", 1, 2) };
	struct remote_item items[3];
	for (int i = 0; i < 3; i++)
		items[i] = (struct remote_item){ .key = &keys[i], .value = bytes, .len = big - (size_t)i };
	ck_assert_int_eq(remote_set_many(remote, items, 3, 60), 0);
	ck_assert_int_eq(remote_get_many(remote, items, 3), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_uint_eq(items[i].got_len, big - (size_t)i);
		ck_assert_int_eq(memcmp(items[i].got, bytes, items[i].got_len), 0);
		free(items[i].got);
	}
	/* Over the limit: refused before anything is sent. */
	struct remote_stats before, after;
	remote_stats_read(remote, &before);
	ck_assert_int_eq(remote_set(remote, &key, bytes, (size_t)REMOTE_VALUE_MAX + 1, 60), ZC_EINVALID);
	remote_stats_read(remote, &after);
	ck_assert_uint_eq(after.bytes_sent, before.bytes_sent);
	/* The limit itself is a value. */
	void *limit = pattern(REMOTE_VALUE_MAX, 9);
	ck_assert_int_eq(remote_set(remote, &key, limit, REMOTE_VALUE_MAX, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, REMOTE_VALUE_MAX);
	ck_assert_int_eq(memcmp(value, limit, len), 0);
	free(value);
	free(limit);
	/* A value over the limit put there by someone else: refused as it
	 * arrives, the connection dropped, the next call fine. */
	size_t huge = (size_t)REMOTE_VALUE_MAX + (1u << 20);
	char *blob = calloc(1, huge);
	ck_assert_ptr_nonnull(blob);
	redisContext *c = redis_connect(&standalone);
	ck_assert_ptr_nonnull(c);
	redisReply *reply = redisCommand(c, "SET %b %b", key.text, (size_t)key.len, blob, huge);
	ck_assert_int_eq(reply->type, REDIS_REPLY_STATUS);
	freeReplyObject(reply);
	redisFree(c);
	free(blob);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EREMOTE);
	char why[512];
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "larger than"), "%s", why);
	ck_assert_int_eq(remote_set(remote, &key, "small", 5, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_uint_eq(len, 5);
	free(value);
	free(bytes);
	remote_close(remote);
}
END_TEST

START_TEST(test_standalone_ttl)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 2000);
	struct remote_key key = block_key(1000, "ttl", 0, 0);

	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 100), 0);
	long long pttl = raw_integer(&standalone, "PTTL %s", key.text);
	ck_assert_msg(pttl > 95000 && pttl <= 100000, "PTTL %lld", pttl);
	ck_assert_int_eq(remote_expire(remote, &key, 5000), 0);
	long long ttl = raw_integer(&standalone, "TTL %s", key.text);
	ck_assert_msg(ttl > 4990 && ttl <= 5000, "TTL %lld", ttl);
	/* No expiry asked: none set. */
	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 0), 0);
	ck_assert_int_eq(raw_integer(&standalone, "TTL %s", key.text), -1);
	struct remote_key missing = block_key(1000, "ttl", 9, 9);
	ck_assert_int_eq(remote_expire(remote, &missing, 10), ZC_ENOTFOUND);
	/* A key that expired is a missing key. */
	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 1), 0);
	sleep_ms(1100);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_ENOTFOUND);
	remote_close(remote);
}
END_TEST

/* An error reply (a key of another type) is an error, not a value. */
START_TEST(test_standalone_error_reply)
{
	struct remote *remote = remote_over(&standalone, 1, NULL, 2000);
	struct remote_key key = block_key(1000, "wrongtype", 0, 0);
	redisReply *reply = redis_command(&standalone, "LPUSH %s x", key.text);
	freeReplyObject(reply);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EREMOTE);
	char why[512];
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "WRONGTYPE"), "%s", why);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert_uint_eq(stats.errors[REMOTE_ERROR_REPLY], 1);
	ck_assert(stats.up);
	remote_close(remote);
}
END_TEST

/* ---- the daemon ------------------------------------------------------ */


/* zipcached --remote: the tier's families in /metrics, Redis up. */
START_TEST(test_daemon_metrics)
{
	struct daemon_harness daemon;
	char url[64], listen_at[32];
	uint16_t port = free_tcp_port();
	snprintf(url, sizeof(url), "redis://127.0.0.1:%u", standalone.port);
	snprintf(listen_at, sizeof(listen_at), "127.0.0.1:%u", port);
	const char *args[] = { "--remote", url, "--remote-timeout-ms", "1000", "--metrics-listen",
			       listen_at, NULL };
	daemon_start(&daemon, args);
	char *text = metrics_scrape(port);
	static const char *const lines[] = {
		"\nzipcache_remote_up 1\n",
		"\nzipcache_remote_errors_total{reason=\"timeout\"} 0\n",
		"\nzipcache_remote_errors_total{reason=\"unavailable\"} 0\n",
		"\nzipcache_remote_latency_seconds_count 1\n",
		"\nzipcache_remote_latency_seconds_bucket{le=\"+Inf\"} 1\n",
		"# TYPE zipcache_remote_latency_seconds histogram\n",
		"\nzipcache_remote_offloads_total 0\n",
		"\nzipcache_remote_restores_total 0\n",
		"# TYPE zipcache_remote_sent_bytes_total counter\n",
	};
	for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++)
		ck_assert_msg(strstr(text, lines[i]), "no '%s' in /metrics", lines[i]);
	free(text);
	daemon_stop(&daemon);
	daemon_cleanup(&daemon);
}
END_TEST

/* A credentials file others can read stops the daemon at start, saying
 * why, and the password is in nothing it writes. */
START_TEST(test_daemon_refuses_credentials)
{
	char dir[] = "/tmp/zc-remote-XXXXXX", socket_path[64], shm[64], creds[64], url[64];
	char out[80];
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(socket_path, sizeof(socket_path), "%s/z.sock", dir);
	snprintf(shm, sizeof(shm), "%s/shm", dir);
	snprintf(creds, sizeof(creds), "%s/creds", dir);
	snprintf(out, sizeof(out), "%s/out", dir);
	snprintf(url, sizeof(url), "redis://127.0.0.1:%u", standalone.port);
	FILE *file = fopen(creds, "w");
	fputs(ACL_USER "\n" ACL_PASSWORD "\n", file);
	fclose(file);
	ck_assert_int_eq(chmod(creds, 0644), 0);
	const char *argv[] = { daemon_binary_path(), "--socket", socket_path, "--shm-dir", shm,
			       "--metrics-listen", "off", "--remote", url, "--remote-credentials", creds, NULL };
	struct program_output result;
	program_capture(&result, argv, out, out, NULL, NULL);
	ck_assert_int_ne(result.status, 0);
	ck_assert_msg(strstr(result.out, "chmod 600"), "%s", result.out);
	ck_assert_msg(!strstr(result.out, ACL_PASSWORD), "the password is in: %s", result.out);
	ck_assert(!socket_accepts(socket_path));
	program_output_free(&result);
	directory_remove(dir);
}
END_TEST

/* zipcached with a wrong password starts (sessions stay local), logs
 * the refusal once, counts it, and writes the password nowhere. */
START_TEST(test_daemon_wrong_password)
{
	struct daemon_harness daemon;
	char url[64], listen_at[32], creds[128];
	uint16_t port = free_tcp_port();
	snprintf(url, sizeof(url), "redis://127.0.0.1:%u", guarded.port);
	snprintf(listen_at, sizeof(listen_at), "127.0.0.1:%u", port);
	credentials_write(creds, sizeof(creds), ACL_USER "\nwrong-" ACL_PASSWORD "\n", 0600);
	const char *args[] = { "--remote", url, "--remote-credentials", creds, "--metrics-listen",
			       listen_at, NULL };
	daemon_start(&daemon, args);
	char *text = metrics_scrape(port);
	ck_assert_msg(strstr(text, "\nzipcache_remote_up 0\n"), "%s", text);
	ck_assert_msg(strstr(text, "\nzipcache_remote_errors_total{reason=\"denied\"} 1\n"), "%s", text);
	ck_assert_msg(!strstr(text, ACL_PASSWORD), "the password is in /metrics");
	free(text);
	daemon_stop(&daemon);
	char *log = file_read_whole(daemon.log_path, NULL);
	ck_assert_msg(strstr(log, "event=\"redis down\" error=ZC_EDENIED"), "%s", log);
	ck_assert_msg(strstr(log, "AUTH as user '" ACL_USER "' refused"), "%s", log);
	ck_assert_msg(!strstr(log, ACL_PASSWORD), "the password is in the log: %s", log);
	free(log);
	daemon_cleanup(&daemon);
	unlink(creds);
}
END_TEST

/* ---- failures: servers of their own ---------------------------------- */

START_TEST(test_down_and_back)
{
	struct redis_server server;
	redis_server_start(&server, NULL, NULL);
	struct remote *remote = remote_over(&server, 1, NULL, 1000);
	struct remote_key key = block_key(1000, "down", 0, 0);
	void *value;
	size_t len;

	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 60), 0);
	redis_server_kill(&server);
	int64_t start = now_ms();
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EREMOTE);
	ck_assert_int_eq(remote_set(remote, &key, "w", 1, 60), ZC_EREMOTE);
	ck_assert_int_lt(now_ms() - start, 1000);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert(!stats.up);
	ck_assert_uint_eq(stats.errors[REMOTE_ERROR_UNAVAILABLE], 2);
	char why[512];
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "127.0.0.1"), "%s", why);

	redis_server_restart(&server);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_ENOTFOUND); /* no persistence */
	ck_assert_int_eq(remote_set(remote, &key, "w", 1, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	free(value);
	remote_stats_read(remote, &stats);
	ck_assert(stats.up);
	remote_close(remote);

	/* A remote opened while Redis is down opens (sessions stay local)
	 * and works once it is up. */
	redis_server_kill(&server);
	remote = remote_over(&server, 1, NULL, 500);
	remote_stats_read(remote, &stats);
	ck_assert(!stats.up);
	redis_server_restart(&server);
	ck_assert_int_eq(remote_ping(remote), 0);
	remote_close(remote);
	redis_server_stop(&server);
}
END_TEST

START_TEST(test_slow_server_times_out)
{
	struct redis_server server;
	redis_server_start(&server, NULL, NULL);
	const uint32_t timeout = 300;
	struct remote *remote = remote_over(&server, 1, NULL, timeout);
	struct remote_key key = block_key(1000, "slow", 0, 0);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 60), 0);

	/* Stopped: the connection is open, nothing answers. */
	ck_assert_int_eq(kill(server.pid, SIGSTOP), 0);
	int64_t start = now_ms();
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), -ETIMEDOUT);
	int64_t took = now_ms() - start;
	ck_assert_msg(took >= timeout - 10 && took < 3 * timeout, "timed out after %lld ms",
		      (long long)took);
	/* A new connection to a stopped server: the kernel accepts it, AUTH
	 * or the command waits; the same bound. */
	struct remote *fresh = remote_over(&server, 1, NULL, timeout);
	start = now_ms();
	ck_assert_int_eq(remote_ping(fresh), -ETIMEDOUT);
	took = now_ms() - start;
	ck_assert_msg(took < 3 * timeout, "timed out after %lld ms", (long long)took);
	ck_assert_int_eq(kill(server.pid, SIGCONT), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	free(value);
	ck_assert_int_eq(remote_ping(fresh), 0);

	/* Busy: DEBUG SLEEP on another connection. */
	redisContext *c = redis_connect(&server);
	ck_assert_ptr_nonnull(c);
	redisAppendCommand(c, "DEBUG SLEEP 1");
	int done = 0;
	while (!done)
		ck_assert_int_eq(redisBufferWrite(c, &done), REDIS_OK);
	sleep_ms(50);
	start = now_ms();
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), -ETIMEDOUT);
	took = now_ms() - start;
	ck_assert_msg(took < 3 * timeout, "timed out after %lld ms", (long long)took);
	redisReply *reply = NULL;
	ck_assert_int_eq(redisGetReply(c, (void **)&reply), REDIS_OK);
	freeReplyObject(reply);
	redisFree(c);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	free(value);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert_uint_eq(stats.errors[REMOTE_ERROR_TIMEOUT], 2);
	remote_close(fresh);
	remote_close(remote);
	redis_server_stop(&server);
}
END_TEST

/* A "server" that answers whatever it is sent with payload, then closes. */
struct garbage {
	int listener;
	const char *payload;
	size_t len;
};

static int garbage_body(void *arg)
{
	const struct garbage *g = arg;
	for (;;) {
		int fd = accept(g->listener, NULL, NULL);
		if (fd < 0)
			return 0;
		char buffer[4096];
		if (read(fd, buffer, sizeof(buffer)) > 0) {
			for (size_t at = 0; at < g->len;) {
				ssize_t n = write(fd, g->payload + at, g->len - at);
				if (n <= 0)
					break;
				at += (size_t)n;
			}
		}
		close(fd);
	}
}

/* Bytes that are no Redis reply, or announce what no reply may hold:
 * an error value each time, never a crash or an allocation to match. */
START_TEST(test_garbage_server)
{
	/* Arrays in arrays, deeper than the reader goes. */
	size_t deep_len = 0;
	char deep[16 * 12];
	for (int i = 0; i < 12; i++)
		deep_len += (size_t)sprintf(deep + deep_len, "*60000\r\n");
	/* An array of 60000 arrays of 60000 integers, the first 25 of them
	 * sent: 6 MB of bytes that would be 80 MB of reply objects, past
	 * what one reply may hold. */
	size_t bomb_len = 0;
	char *bomb = malloc(16 + 25 * (16 + 60000 * 4));
	ck_assert_ptr_nonnull(bomb);
	bomb_len += (size_t)sprintf(bomb, "*60000\r\n");
	for (int i = 0; i < 25; i++) {
		bomb_len += (size_t)sprintf(bomb + bomb_len, "*60000\r\n");
		for (int k = 0; k < 60000; k++) {
			memcpy(bomb + bomb_len, ":1\r\n", 4);
			bomb_len += 4;
		}
	}
	static const char huge_array[] = "*2000000000\r\n";
	static const char cut_short[] = "$10\r\nabc";
	static const char not_resp[] = "@#garbage\r\n";
	const struct {
		const char *payload;
		size_t len;
		const char *says;
	} cases[] = {
		{ not_resp, sizeof(not_resp) - 1, "protocol error" },
		{ huge_array, sizeof(huge_array) - 1, "Out of memory" },
		{ deep, deep_len, "nested" },
		{ bomb, bomb_len, "Out of memory" },
		{ cut_short, sizeof(cut_short) - 1, "closed the connection" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int listener = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in address = { .sin_family = AF_INET,
					       .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
		socklen_t length = sizeof(address);
		ck_assert_int_eq(bind(listener, (struct sockaddr *)&address, sizeof(address)), 0);
		ck_assert_int_eq(listen(listener, 8), 0);
		ck_assert_int_eq(getsockname(listener, (struct sockaddr *)&address, &length), 0);
		struct garbage g = { listener, cases[i].payload, cases[i].len };
		pid_t helper = child_spawn(garbage_body, &g, -1);
		struct redis_server fake = { .port = ntohs(address.sin_port) };
		struct remote *remote = remote_over(&fake, 1, NULL, 2000);
		struct remote_key key = block_key(1000, "garbage", 0, 0);
		void *value;
		size_t len;
		ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EREMOTE);
		char why[512];
		remote_last_error(remote, why, sizeof(why));
		ck_assert_msg(strstr(why, cases[i].says), "case %zu: %s", i, why);
		remote_close(remote);
		kill(helper, SIGKILL);
		close(listener);
	}
	free(bomb);
}
END_TEST

/* ---- AUTH ------------------------------------------------------------ */

START_TEST(test_auth)
{
	char path[128], why[512];
	void *value;
	size_t len;
	struct remote_key key = block_key(1000, "auth", 0, 0);

	credentials_write(path, sizeof(path), ACL_USER "\n" ACL_PASSWORD "\n", 0600);
	struct remote *remote = remote_over(&guarded, 1, path, 2000);
	ck_assert_int_eq(remote_set(remote, &key, "secret", 6, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	free(value);
	remote_close(remote);
	unlink(path);

	/* The wrong password: refused, said clearly, neither password told. */
	credentials_write(path, sizeof(path), ACL_USER "\nnot-the-" ACL_PASSWORD "\n", 0600);
	remote = remote_over(&guarded, 1, path, 2000);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EDENIED);
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "AUTH as user '" ACL_USER "' refused"), "%s", why);
	ck_assert_msg(!strstr(why, ACL_PASSWORD), "the password is in '%s'", why);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert_uint_ge(stats.errors[REMOTE_ERROR_DENIED], 1);
	remote_close(remote);
	unlink(path);

	/* No credentials: the default user is off, nothing works. */
	remote = remote_over(&guarded, 1, NULL, 2000);
	ck_assert_int_lt(remote_get(remote, &key, &value, &len), 0);
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "NOAUTH"), "%s", why);
	remote_close(remote);
}
END_TEST

/* ---- cluster --------------------------------------------------------- */

START_TEST(test_cluster_keyslot)
{
	/* Our slot of a key is the cluster's, hash tags included. */
	for (int i = 0; i < 200; i++) {
		char text[64];
		struct remote_key key = block_key((uint32_t)i, "slots", (uint32_t)i, 7);
		const char *k = key.text;
		if (i % 4 == 1) {
			snprintf(text, sizeof(text), "{tag%d}.x%d", i % 7, i);
			k = text;
		} else if (i % 4 == 2) {
			snprintf(text, sizeof(text), "a{}b{c%d}", i);
			k = text;
		}
		long long slot = raw_integer(&cluster.nodes[0], "CLUSTER KEYSLOT %s", k);
		ck_assert_int_eq(router_key_slot(k, strlen(k)), slot);
	}
}
END_TEST

START_TEST(test_cluster_many)
{
	struct remote *remote = remote_over(cluster.nodes, 1, NULL, 3000);
	enum { N = 600 };
	static struct remote_key keys[N];
	static struct remote_item items[N];
	static const struct remote_key *all[N];
	for (int i = 0; i < N; i++) {
		keys[i] = block_key(1000 + (uint32_t)(i % 3), "cluster-many", (uint32_t)i, 1);
		items[i] = (struct remote_item){ .key = &keys[i], .value = pattern(64 + (size_t)i, (uint32_t)i),
						 .len = 64 + (size_t)i };
		all[i] = &keys[i];
	}
	ck_assert_int_eq(remote_set_many(remote, items, N, 120), 0);
	/* Spread over every primary. */
	for (int n = 0; n < REDIS_CLUSTER_NODES; n++)
		ck_assert_int_gt(raw_integer(&cluster.nodes[n], "DBSIZE", NULL), 50);
	ck_assert_int_eq(remote_get_many(remote, items, N), 0);
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(items[i].status, 0);
		ck_assert_uint_eq(items[i].got_len, 64 + (size_t)i);
		ck_assert_int_eq(memcmp(items[i].got, items[i].value, items[i].got_len), 0);
		free(items[i].got);
	}
	/* The TTL is on the node that serves each key. */
	int owner = redis_cluster_slot_owner(&cluster, router_key_slot(keys[5].text, keys[5].len));
	ck_assert_int_ge(owner, 0);
	long long ttl = raw_integer(&cluster.nodes[owner], "TTL %s", keys[5].text);
	ck_assert_msg(ttl > 110 && ttl <= 120, "TTL %lld", ttl);
	uint64_t deleted = 0;
	ck_assert_int_eq(remote_del_many(remote, all, N, &deleted), 0);
	ck_assert_uint_eq(deleted, N);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_get(remote, &keys[0], &value, &len), ZC_ENOTFOUND);
	for (int i = 0; i < N; i++)
		free((void *)items[i].value);

	/* Large values across nodes. */
	size_t big = 6u << 20;
	void *bytes = pattern(big, 7);
	for (int i = 0; i < 3; i++)
		items[i] = (struct remote_item){ .key = &keys[i], .value = bytes, .len = big - (size_t)i };
	ck_assert_int_eq(remote_set_many(remote, items, 3, 60), 0);
	ck_assert_int_eq(remote_get_many(remote, items, 3), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_uint_eq(items[i].got_len, big - (size_t)i);
		ck_assert_int_eq(memcmp(items[i].got, bytes, items[i].got_len), 0);
		free(items[i].got);
	}
	free(bytes);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert_uint_eq(stats.redirections, 0); /* the map was right */
	remote_close(remote);
}
END_TEST

/* The first address given is down: the next one tells the slot map, and
 * nothing is sent to the dead one again. */
START_TEST(test_cluster_dead_seed)
{
	struct redis_server seeds[2] = { { .port = free_tcp_port() }, cluster.nodes[1] };
	struct remote *remote = remote_over(seeds, 2, NULL, 1000);
	struct remote_key key = block_key(1000, "dead-seed", 0, 0);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 60), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	free(value);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert(stats.up);
	for (int i = 0; i < REMOTE_ERROR_KIND_COUNT; i++)
		ck_assert_uint_eq(stats.errors[i], 0);
	remote_close(remote);
}
END_TEST

/* A key of uid 1000 whose slot is slot (the block number searched). */
static struct remote_key key_in_slot(unsigned slot, uint32_t layer)
{
	for (uint32_t block = 0; block < 10000000; block++) {
		struct remote_key key = block_key(1000, "migrate", layer, block);
		if (router_key_slot(key.text, key.len) == slot)
			return key;
	}
	ck_abort_msg("no key for slot %u", slot);
	return block_key(0, "x", 0, 0);
}

START_TEST(test_cluster_migration)
{
	struct remote *remote = remote_over(cluster.nodes, REDIS_CLUSTER_NODES, NULL, 3000);
	struct remote_key moved = block_key(1000, "migrate", 0, 0);
	unsigned slot = router_key_slot(moved.text, moved.len);
	int from = redis_cluster_slot_owner(&cluster, slot), to = (from + 1) % REDIS_CLUSTER_NODES;
	struct redis_server *source = &cluster.nodes[from], *target = &cluster.nodes[to];
	struct remote_key stays = key_in_slot(slot, 1), fresh = key_in_slot(slot, 2);
	void *value;
	size_t len;

	ck_assert_int_eq(remote_set(remote, &moved, "moved", 5, 300), 0);
	ck_assert_int_eq(remote_set(remote, &stays, "stays", 5, 300), 0);
	/* The slot in migration: `moved` goes over, `stays` does not. */
	redisReply *reply = redis_command(target, "CLUSTER SETSLOT %u IMPORTING %s", slot, cluster.ids[from]);
	ck_assert_int_eq(reply->type, REDIS_REPLY_STATUS);
	freeReplyObject(reply);
	reply = redis_command(source, "CLUSTER SETSLOT %u MIGRATING %s", slot, cluster.ids[to]);
	ck_assert_int_eq(reply->type, REDIS_REPLY_STATUS);
	freeReplyObject(reply);
	reply = redis_command(source, "MIGRATE 127.0.0.1 %u %s 0 5000 KEYS %s", target->port, "", moved.text);
	ck_assert_msg(reply->type == REDIS_REPLY_STATUS, "MIGRATE: %s", reply->str);
	freeReplyObject(reply);

	/* The source answers ASK for what it no longer has: followed. */
	struct remote_stats before, after;
	remote_stats_read(remote, &before);
	ck_assert_int_eq(remote_get(remote, &moved, &value, &len), 0);
	ck_assert_uint_eq(len, 5);
	ck_assert_int_eq(memcmp(value, "moved", 5), 0);
	free(value);
	ck_assert_int_eq(remote_get(remote, &stays, &value, &len), 0);
	ck_assert_int_eq(memcmp(value, "stays", 5), 0);
	free(value);
	/* A new key of the slot is made on the target, through ASK. */
	ck_assert_int_eq(remote_set(remote, &fresh, "fresh", 5, 300), 0);
	redisContext *c = redis_connect(target);
	ck_assert_ptr_nonnull(c);
	reply = redisCommand(c, "ASKING");
	freeReplyObject(reply);
	reply = redisCommand(c, "EXISTS %s", fresh.text);
	ck_assert_int_eq(reply->type, REDIS_REPLY_INTEGER);
	ck_assert_int_eq(reply->integer, 1);
	freeReplyObject(reply);
	redisFree(c);
	remote_stats_read(remote, &after);
	ck_assert_uint_ge(after.redirections, before.redirections + 2);

	/* The rest over, the slot given to the target: MOVED, followed. */
	reply = redis_command(source, "MIGRATE 127.0.0.1 %u %s 0 5000 KEYS %s", target->port, "", stays.text);
	ck_assert_msg(reply->type == REDIS_REPLY_STATUS, "MIGRATE: %s", reply->str);
	freeReplyObject(reply);
	for (int i = 0; i < REDIS_CLUSTER_NODES; i++) {
		reply = redis_command(&cluster.nodes[i], "CLUSTER SETSLOT %u NODE %s", slot, cluster.ids[to]);
		ck_assert_msg(reply->type == REDIS_REPLY_STATUS, "SETSLOT NODE: %s", reply->str);
		freeReplyObject(reply);
	}
	remote_stats_read(remote, &before);
	struct remote_key three[3] = { moved, stays, fresh };
	static const char *const want[3] = { "moved", "stays", "fresh" };
	struct remote_item items[3];
	for (int i = 0; i < 3; i++)
		items[i] = (struct remote_item){ .key = &three[i] };
	ck_assert_int_eq(remote_get_many(remote, items, 3), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(items[i].status, 0);
		ck_assert_int_eq(memcmp(items[i].got, want[i], 5), 0);
		free(items[i].got);
	}
	remote_stats_read(remote, &after);
	ck_assert_uint_ge(after.redirections, before.redirections + 1);
	/* The map was read again: the next call goes straight there. */
	remote_stats_read(remote, &before);
	ck_assert_int_eq(remote_get(remote, &moved, &value, &len), 0);
	free(value);
	remote_stats_read(remote, &after);
	ck_assert_uint_eq(after.redirections, before.redirections);
	ck_assert_int_eq(redis_cluster_slot_owner(&cluster, slot), to);
	remote_close(remote);
}
END_TEST

/* A key of uid 1000 that node serves. */
static struct remote_key key_in_node(int node)
{
	for (uint32_t block = 0; block < 100000; block++) {
		struct remote_key key = block_key(1000, "elsewhere", 0, block);
		if (redis_cluster_slot_owner(&cluster, router_key_slot(key.text, key.len)) == node)
			return key;
	}
	ck_abort_msg("no key for node %d", node);
	return block_key(0, "x", 0, 0);
}

/* A batch over every node waits for its nodes together: two stopped
 * primaries cost one timeout, not two. */
START_TEST(test_cluster_nodes_together)
{
	const uint32_t timeout = 400;
	struct remote *remote = remote_over(cluster.nodes, REDIS_CLUSTER_NODES, NULL, timeout);
	struct remote_key keys[REDIS_CLUSTER_NODES];
	struct remote_item items[REDIS_CLUSTER_NODES];
	for (int n = 0; n < REDIS_CLUSTER_NODES; n++) {
		keys[n] = key_in_node(n);
		items[n] = (struct remote_item){ .key = &keys[n], .value = "v", .len = 1 };
	}
	ck_assert_int_eq(remote_set_many(remote, items, REDIS_CLUSTER_NODES, 60), 0);
	ck_assert_int_eq(kill(cluster.nodes[1].pid, SIGSTOP), 0);
	ck_assert_int_eq(kill(cluster.nodes[2].pid, SIGSTOP), 0);
	int64_t start = now_ms();
	int rc = remote_set_many(remote, items, REDIS_CLUSTER_NODES, 60);
	int64_t took = now_ms() - start;
	ck_assert_int_eq(kill(cluster.nodes[1].pid, SIGCONT), 0);
	ck_assert_int_eq(kill(cluster.nodes[2].pid, SIGCONT), 0);
	ck_assert_int_eq(rc, -ETIMEDOUT);
	ck_assert_msg(took >= timeout - 10 && took < timeout + timeout / 2,
		      "two stopped nodes took %lld ms with a %u ms timeout", (long long)took, timeout);
	redis_cluster_wait_ok(&cluster);
	ck_assert_int_eq(remote_set_many(remote, items, REDIS_CLUSTER_NODES, 60), 0);
	remote_close(remote);
}
END_TEST

/* Last in its case: it kills and restarts a node of the shared cluster. */
START_TEST(test_cluster_node_killed)
{
	struct remote *remote = remote_over(cluster.nodes, REDIS_CLUSTER_NODES, NULL, 1000);
	struct remote_key key = block_key(1000, "killed", 0, 0);
	void *value;
	size_t len;
	ck_assert_int_eq(remote_set(remote, &key, "v", 1, 300), 0);
	int owner = redis_cluster_slot_owner(&cluster, router_key_slot(key.text, key.len));
	int live = (owner + 1) % REDIS_CLUSTER_NODES;
	struct remote_key elsewhere = key_in_node(live);
	redis_server_kill(&cluster.nodes[owner]);

	int64_t start = now_ms();
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), ZC_EREMOTE);
	ck_assert_int_eq(remote_set(remote, &key, "w", 1, 300), ZC_EREMOTE);
	ck_assert_int_lt(now_ms() - start, 4000);
	struct remote_stats stats;
	remote_stats_read(remote, &stats);
	ck_assert(!stats.up);

	/* Once the others see the node failed, its slots are uncovered and
	 * the whole cluster answers CLUSTERDOWN (full coverage is required):
	 * retried with backoff a bounded number of times, then an error. */
	int64_t deadline = now_ms() + REDIS_HARNESS_WAIT_MS;
	for (;;) {
		redisReply *reply = redis_command(&cluster.nodes[live], "CLUSTER INFO");
		bool failed = strstr(reply->str, "cluster_state:fail") != NULL;
		freeReplyObject(reply);
		if (failed)
			break;
		ck_assert_msg(now_ms() < deadline, "the cluster never noticed the killed node");
		sleep_ms(50);
	}
	start = now_ms();
	ck_assert_int_eq(remote_get(remote, &elsewhere, &value, &len), ZC_EREMOTE);
	ck_assert_int_lt(now_ms() - start, 4000);
	char why[512];
	remote_last_error(remote, why, sizeof(why));
	ck_assert_msg(strstr(why, "CLUSTERDOWN") && strstr(why, "tries"), "%s", why);

	redis_server_restart(&cluster.nodes[owner]);
	redis_cluster_wait_ok(&cluster);
	/* The restarted node kept its slots (nodes.conf), not its data. */
	int rc = remote_get(remote, &key, &value, &len);
	ck_assert_msg(rc == ZC_ENOTFOUND, "%s", zc_error_name(rc));
	ck_assert_int_eq(remote_set(remote, &key, "w", 1, 300), 0);
	ck_assert_int_eq(remote_get(remote, &key, &value, &len), 0);
	ck_assert_int_eq(memcmp(value, "w", 1), 0);
	free(value);
	remote_stats_read(remote, &stats);
	ck_assert(stats.up);
	remote_close(remote);
}
END_TEST

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	Suite *suite = suite_create("remote");
	TCase *offline = tcase_create("offline");
	tcase_add_test(offline, test_url_parse);
	tcase_add_test(offline, test_options);
	tcase_add_test(offline, test_keys);
	tcase_add_test(offline, test_crc16);
	tcase_add_test(offline, test_credentials_file);
	suite_add_tcase(suite, offline);
	if (!redis_installed())
		return suite_main(suite, CK_FORK);

	TCase *single = tcase_create("standalone");
	tcase_add_unchecked_fixture(single, standalone_up, standalone_down);
	tcase_set_timeout(single, 20);
	tcase_add_test(single, test_standalone_set_get);
	tcase_add_test(single, test_standalone_uids_apart);
	tcase_add_test(single, test_standalone_threads);
	tcase_add_test(single, test_standalone_unix_socket);
	tcase_add_test(single, test_standalone_large);
	tcase_add_test(single, test_standalone_ttl);
	tcase_add_test(single, test_standalone_error_reply);
	tcase_add_test(single, test_daemon_metrics);
	tcase_add_test(single, test_daemon_refuses_credentials);
	suite_add_tcase(suite, single);

	TCase *failures = tcase_create("failures");
	tcase_set_timeout(failures, 20);
	tcase_add_test(failures, test_down_and_back);
	tcase_add_test(failures, test_slow_server_times_out);
	tcase_add_test(failures, test_garbage_server);
	suite_add_tcase(suite, failures);

	TCase *auth = tcase_create("auth");
	tcase_add_unchecked_fixture(auth, guarded_up, guarded_down);
	tcase_set_timeout(auth, 20);
	tcase_add_test(auth, test_auth);
	tcase_add_test(auth, test_daemon_wrong_password);
	suite_add_tcase(suite, auth);

	TCase *clustered = tcase_create("cluster");
	tcase_add_unchecked_fixture(clustered, cluster_up, cluster_down);
	tcase_set_timeout(clustered, 30);
	tcase_add_test(clustered, test_cluster_keyslot);
	tcase_add_test(clustered, test_cluster_many);
	tcase_add_test(clustered, test_cluster_dead_seed);
	tcase_add_test(clustered, test_cluster_migration);
	tcase_add_test(clustered, test_cluster_nodes_together);
	tcase_add_test(clustered, test_cluster_node_killed);
	suite_add_tcase(suite, clustered);
	return suite_main(suite, CK_FORK);
}
