/*
 * Verified snapshots (docs/SNAPSHOT.md) against a real daemon.
 *
 *   round_trip     Sessions of several configs (bit widths, hi_fraction,
 *                  exact values, per_call, K and V dims that differ, batch
 *                  2; residual empty, partial and about to flush; views
 *                  full and none; after trims, and forks) are exported to
 *                  a file and imported into the same daemon and into a
 *                  second one with its own shm-dir: the import equals the
 *                  model of the original bit for bit (views or the
 *                  client's reconstruction, and every counter), keeps the
 *                  model id, and then takes the same appends as the
 *                  original with the same results. A pipe gets the same
 *                  bytes as a file. Every checksum of an export is plain
 *                  XXH3 (recomputed here), whichever vector kernel the
 *                  daemon hashed with; a daemon on the scalar path takes
 *                  the file and exports the same bytes.
 *   corruption     One bit flipped in every region (header, layer table,
 *                  every block record's header, K and V payloads, every
 *                  residual, trailer), and the file cut at every region
 *                  boundary (and one byte past it): each import is
 *                  refused with ZC_ECORRUPT naming the region, and
 *                  nothing is made: no session, no file in the shm-dir,
 *                  no block left in the pool. A newer version, a forged
 *                  config with honest checksums, a wrong model id or
 *                  fingerprint each get their own error.
 *   descriptors    A directory, a socket, a read-only file for an export,
 *                  a write-only one for an import, no descriptor at all:
 *                  refused clearly; an unknown session and another uid's
 *                  are not exported; an import past the memory budget is
 *                  ZC_EEXHAUSTED with nothing made.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "daemon_harness.h"
#include "layer_model.h"
#include "process_run.h"
#include "snapshot_format.h"
#include "suite_main.h"
#include "wire.h"
#include "zipcache/client.h"
#include "zipcache/error.h"

#define TEST_TIMEOUT_SECONDS 300

/* ---- helpers ------------------------------------------------------------------ */

static void path_in(const struct service *service, const char *name, char *out, size_t size)
{
	snprintf(out, size, "%s/%s", service->daemon.dir, name);
}

static uint64_t export_file(zc_session *session, const char *path)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	uint64_t bytes = 0;
	int rc = zc_session_export(session, fd, &bytes);
	ck_assert_msg(rc == 0, "export: %s", zc_error_name(rc));
	close(fd);
	struct stat st;
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert_uint_eq((uint64_t)st.st_size, bytes);
	return bytes;
}

static int import_file(zc_client *client, const char *path, const zc_import_options *options,
		       zc_session **out)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	int rc = zc_session_import(client, fd, options, out);
	close(fd);
	return rc;
}

static void bytes_write(const char *path, const uint8_t *bytes, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, bytes, n), (ssize_t)n);
	close(fd);
}

/* Files in the shm-dir: sessions and temporaries. */
static int shm_files(const struct service *service)
{
	DIR *dir = opendir(service->daemon.shm_dir);
	struct dirent *entry;
	int count = 0;
	ck_assert_ptr_nonnull(dir);
	while ((entry = readdir(dir)) != NULL)
		if (strstr(entry->d_name, ".zcs"))
			count++;
	closedir(dir);
	return count;
}

/* What must not change when an import is refused. */
struct holdings {
	size_t sessions;
	int files;
	uint64_t blocks_bytes;
};

static struct holdings holdings_of(struct service *service)
{
	struct holdings h = { 0 };
	zc_session_info infos[16];
	zc_memory_stats memory;
	ck_assert_int_eq(zc_client_list_sessions(service->client, infos, 16, &h.sessions), 0);
	ck_assert_int_eq(zc_client_memory_stats(service->client, &memory), 0);
	h.files = shm_files(service);
	h.blocks_bytes = memory.blocks_bytes;
	return h;
}

static void nothing_made(struct service *service, const struct holdings *before, const char *what)
{
	struct holdings now = holdings_of(service);
	ck_assert_msg(now.sessions == before->sessions, "%s: %zu sessions, before %zu", what,
		      now.sessions, before->sessions);
	ck_assert_msg(now.files == before->files, "%s: %d files in the shm-dir, before %d", what,
		      now.files, before->files);
	ck_assert_msg(now.blocks_bytes == before->blocks_bytes,
		      "%s: the pool holds %llu bytes of blocks, before %llu", what,
		      (unsigned long long)now.blocks_bytes, (unsigned long long)before->blocks_bytes);
}

/* A refused import: the code, a sentence naming `needle`, nothing made. */
static void import_refused(struct service *service, const char *path, const zc_import_options *o,
			   int expected, const char *needle, const char *what)
{
	struct holdings before = holdings_of(service);
	zc_session *session = NULL;
	int rc = import_file(service->client, path, o, &session);
	ck_assert_msg(rc == expected, "%s: import gave %s, expected %s (%s)", what, zc_error_name(rc),
		      zc_error_name(expected), zc_client_last_error(service->client));
	ck_assert_msg(strstr(zc_client_last_error(service->client), needle) != NULL,
		      "%s: the message \"%s\" does not mention \"%s\"", what,
		      zc_client_last_error(service->client), needle);
	nothing_made(service, &before, what);
}

/* ---- round trips ---------------------------------------------------------------- */

struct trip {
	const char *what;
	zc_session_config config;
	uint32_t updates[8];          /* tokens per update (all layers), 0 ends */
	uint32_t trim;                /* tokens trimmed after them */
	uint32_t fork_at;             /* export a fork of this many tokens instead (0: none) */
};

static void trip_build(zc_client *client, const struct trip *t, zc_session **out,
		       struct model *model, struct rng *rng)
{
	zc_session *session = open_session(client, &t->config);
	model_init(model, &t->config);
	for (int u = 0; u < 8 && t->updates[u]; u++)
		for (uint32_t layer = 0; layer < t->config.layers; layer++)
			CHECK(update_checked, client, session, model, rng, layer, t->updates[u]);
	if (t->trim)
		CHECK(trim_checked, client, session, model, t->trim);
	*out = session;
}

/* The same appends on both sessions: each against its own model. */
static void continue_both(zc_client *a_client, zc_session *a, struct model *a_model,
			  zc_client *b_client, zc_session *b, struct model *b_model, struct rng *rng)
{
	const uint32_t steps[] = { 1, 3, 200, 7 };
	for (size_t s = 0; s < sizeof(steps) / sizeof(steps[0]); s++) {
		for (uint32_t layer = 0; layer < a_model->layers; layer++) {
			if (a_model->layer[layer].tokens + steps[s] > a_model->max_tokens)
				continue;
			struct block block;
			block_make(&block, a_model, steps[s], rng);
			CHECK(update_block_checked, a_client, a, a_model, layer, &block, NULL, NULL);
			CHECK(update_block_checked, b_client, b, b_model, layer, &block, NULL, NULL);
			block_free(&block);
		}
	}
	CHECK(session_matches, a, a_model);
	CHECK(session_matches, b, b_model);
}

static void trip_run(const struct trip *t, struct service *one, struct service *two)
{
	struct rng rng;
	struct model model, imported_model;
	zc_session *session, *source = NULL;
	char path[PATH_MAX];

	rng_seed(&rng, 1234);
	trip_build(one->client, t, &session, &model, &rng);
	if (t->fork_at) {
		struct model fork_model;
		zc_session *fork;
		source = session;
		ck_assert_int_eq(zc_session_fork(source, t->fork_at, NULL, ZC_VIEWS_SOURCE, &fork), 0);
		model_fork(&fork_model, &model, t->fork_at);
		model_free(&model);
		model = fork_model;
		session = fork;
		ck_assert_str_eq(zc_session_get_info(fork)->model_id,
				 t->config.model_id ? t->config.model_id : "");
	}
	CHECK(session_matches, session, &model);
	path_in(one, "trip.zcsnap", path, sizeof(path));
	export_file(session, path);

	for (int target = 0; target < 2; target++) {
		struct service *to = target == 0 ? one : two;
		zc_import_options options;
		zc_session *imported;
		zc_import_options_default(&options);
		options.name = "imported";
		int rc = import_file(to->client, path, &options, &imported);
		ck_assert_msg(rc == 0, "%s: import into daemon %d: %s (%s)", t->what, target,
			      zc_error_name(rc), zc_client_last_error(to->client));
		const zc_session_info *info = zc_session_get_info(imported);
		ck_assert_str_eq(info->name, "imported");
		ck_assert_str_eq(info->model_id, t->config.model_id ? t->config.model_id : "");
		ck_assert_int_eq(info->views, t->config.views);
		ck_assert_uint_eq(info->max_tokens, t->config.max_tokens);
		CHECK(session_matches, imported, &model);
		model_fork(&imported_model, &model, model.max_tokens);
		continue_both(one->client, session, &model, to->client, imported, &imported_model,
			      &rng);
		model_free(&imported_model);
		ck_assert_int_eq(zc_session_close(imported), 0);
		/* The original went on: a fresh export for the next target. */
		export_file(session, path);
	}
	ck_assert_int_eq(zc_session_close(session), 0);
	if (source)
		ck_assert_int_eq(zc_session_close(source), 0);
	model_free(&model);
}

static struct trip trip_of(const char *what, uint32_t layers, uint32_t batch, uint32_t kv_heads,
			   uint32_t dk, uint32_t dv, zc_block_policy policy, uint32_t residual)
{
	struct trip t = { .what = what };
	t.config = shaped_config(NULL, layers, batch, kv_heads, dk, dv, 2048, policy, residual);
	return t;
}

START_TEST(round_trips_are_bit_exact)
{
	struct service one, two;
	service_start(&one, NULL);
	service_start(&two, NULL);
	struct trip trips[12];
	int n = 0;

	/* Default codec, streaming; residual partial after a direct block. */
	trips[n] = trip_of("default, partial residual", 2, 1, 2, 64, 64, ZC_POLICY_STREAMING, 16);
	trips[n].config.model_id = "llama-3-8b";
	trips[n++].updates[0] = 40, trips[n - 1].updates[1] = 5;
	/* Residual empty: only whole blocks. */
	trips[n] = trip_of("residual empty", 2, 1, 2, 32, 32, ZC_POLICY_STREAMING, 16);
	trips[n++].updates[0] = 64;
	/* Residual one short of its flush. */
	trips[n] = trip_of("residual full", 1, 1, 2, 32, 32, ZC_POLICY_STREAMING, 16);
	trips[n++].updates[0] = 15;
	/* Other widths, exact values, K and V dims that differ, batch 2. */
	trips[n] = trip_of("3/1 bits, exact values, dk != dv, batch 2", 2, 2, 2, 64, 32,
			   ZC_POLICY_STREAMING, 8);
	trips[n].config.codec.hi_bits = 3;
	trips[n].config.codec.lo_bits = 1;
	trips[n].config.codec.hi_fraction = 0.35;
	trips[n].config.codec.group_size = 16;
	trips[n].config.codec.quantize_values = false;
	trips[n++].updates[0] = 33, trips[n - 1].updates[1] = 3;
	/* 8/8 bits, every token salient. */
	trips[n] = trip_of("8 bits, hi_fraction 1", 1, 1, 1, 16, 16, ZC_POLICY_STREAMING, 4);
	trips[n].config.codec.hi_bits = 8;
	trips[n].config.codec.lo_bits = 8;
	trips[n].config.codec.hi_fraction = 1.0;
	trips[n++].updates[0] = 9;
	/* per_call: every update a block. */
	trips[n] = trip_of("per_call", 2, 1, 2, 32, 32, ZC_POLICY_PER_CALL, 0);
	trips[n++].updates[0] = 3, trips[n - 1].updates[1] = 1, trips[n - 1].updates[2] = 20;
	/* views = none. */
	trips[n] = trip_of("views none", 2, 1, 2, 32, 32, ZC_POLICY_STREAMING, 16);
	trips[n].config.views = ZC_VIEWS_NONE;
	trips[n].config.model_id = "m";
	trips[n++].updates[0] = 40, trips[n - 1].updates[1] = 6;
	/* After a trim that cuts a block. */
	trips[n] = trip_of("after a trim through a block", 2, 1, 2, 32, 32, ZC_POLICY_STREAMING, 16);
	trips[n].updates[0] = 64;
	trips[n].updates[1] = 5;
	trips[n++].trim = 20;
	/* A fork that ends inside a block. */
	trips[n] = trip_of("a fork", 2, 1, 2, 32, 32, ZC_POLICY_STREAMING, 16);
	trips[n].config.model_id = "forked-model";
	trips[n].updates[0] = 64;
	trips[n].updates[1] = 10;
	trips[n++].fork_at = 50;
	/* An empty session. */
	trips[n++] = trip_of("empty", 3, 1, 1, 16, 16, ZC_POLICY_STREAMING, 8);

	for (int i = 0; i < n; i++)
		trip_run(&trips[i], &one, &two);
	service_stop(&two);
	service_stop(&one);
}
END_TEST

/* An export to a pipe (read by a helper) has the file's bytes. */
static int pipe_reader(void *arg)
{
	const int *fds = arg;   /* [read end, output file] */
	uint8_t buf[65536];
	ssize_t n;
	while ((n = read(fds[0], buf, sizeof(buf))) > 0)
		CHILD_EXPECT(write(fds[1], buf, (size_t)n) == n, "write: %s", strerror(errno));
	return n == 0 ? 0 : 1;
}

START_TEST(pipe_export_equals_file_export)
{
	struct service service;
	struct rng rng;
	struct model model;
	char file[PATH_MAX], piped[PATH_MAX];
	service_start(&service, NULL);
	rng_seed(&rng, 7);
	zc_session_config config = shaped_config("p", 2, 1, 2, 64, 64, 4096, ZC_POLICY_STREAMING, 16);
	zc_session *session = open_session(service.client, &config);
	model_init(&model, &config);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, service.client, session, &model, &rng, layer, 3000);
	path_in(&service, "file.zcsnap", file, sizeof(file));
	path_in(&service, "piped.zcsnap", piped, sizeof(piped));
	uint64_t bytes = export_file(session, file);

	int p[2];
	ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
	int out = open(piped, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	int args[2] = { p[0], out };
	pid_t reader = child_spawn(pipe_reader, args, p[1]);
	close(p[0]);
	close(out);
	uint64_t piped_bytes = 0;
	int rc = zc_session_export(session, p[1], &piped_bytes);
	ck_assert_msg(rc == 0, "export to a pipe: %s (%s)", zc_error_name(rc),
		      zc_client_last_error(service.client));
	close(p[1]);
	child_wait_ok(reader, "pipe reader");
	ck_assert_uint_eq(piped_bytes, bytes);
	size_t a_len, b_len;
	char *a = file_read_whole(file, &a_len), *b = file_read_whole(piped, &b_len);
	ck_assert_uint_eq(a_len, b_len);
	ck_assert_int_eq(memcmp(a, b, a_len), 0);
	free(a);
	free(b);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/*
 * Every checksum of an export, recomputed here by the header-only XXH3
 * this test is built with (its default kernel, SSE2): the daemon hashes
 * with the kernel its CPU has (AVX2, AVX-512), which must give the same
 * values. Then the file goes through a daemon forced to the scalar codec
 * path (ZC_CODEC_ISA=scalar: the SSE2 hash too), which must accept it and
 * export the very same bytes.
 */
static void checksums_recompute(const uint8_t *file, size_t len)
{
	struct snapshot_header h;
	struct snapshot_trailer trailer;
	memcpy(&h, file, sizeof(h));
	memcpy(&trailer, file + len - sizeof(trailer), sizeof(trailer));
	ck_assert_uint_eq(h.checksum, XXH3_64bits(&h, offsetof(struct snapshot_header, checksum)));
	uint32_t layers = h.config.layers;
	uint64_t heads = (uint64_t)h.config.batch * h.config.kv_heads, table_checksum;
	const uint8_t *table = file + sizeof(h);
	memcpy(&table_checksum, table + (size_t)layers * SNAPSHOT_LAYER_BYTES, sizeof(uint64_t));
	ck_assert_uint_eq(table_checksum, XXH3_64bits(table, (size_t)layers * SNAPSHOT_LAYER_BYTES));
	XXH3_state_t whole;
	XXH3_64bits_reset(&whole);
	XXH3_64bits_update(&whole, file, sizeof(h) + (size_t)layers * SNAPSHOT_LAYER_BYTES + 8);
	uint64_t long_payloads = 0;
	for (uint32_t i = 0; i < layers; i++) {
		struct snapshot_layer l;
		memcpy(&l, table + (size_t)i * SNAPSHOT_LAYER_BYTES, sizeof(l));
		uint64_t at = l.offset;
		for (uint32_t k = 0; k < l.blocks; k++) {
			struct snapshot_block b;
			uint64_t sum;
			memcpy(&b, file + at, sizeof(b));
			ck_assert_uint_eq(b.checksum,
					  XXH3_64bits(&b, offsetof(struct snapshot_block, checksum)));
			uint64_t payload = b.key_bytes + b.value_bytes;
			memcpy(&sum, file + at + SNAPSHOT_BLOCK_BYTES + payload, sizeof(sum));
			ck_assert_msg(sum == XXH3_64bits(file + at + SNAPSHOT_BLOCK_BYTES, payload),
				      "layer %u block %u: the payload checksum is not XXH3's", i, k);
			long_payloads += payload > (1u << 20);
			XXH3_64bits_update(&whole, &b.checksum, sizeof(b.checksum));
			XXH3_64bits_update(&whole, &sum, sizeof(sum));
			at += snapshot_record_bytes(b.key_bytes, b.value_bytes);
		}
		uint64_t residual = heads * l.residual_tokens *
				    (h.config.head_dim_k + h.config.head_dim_v) * 2;
		ck_assert_msg(l.residual_checksum == XXH3_64bits(file + at, residual),
			      "layer %u: the residual checksum is not XXH3's", i);
		XXH3_64bits_update(&whole, &l.residual_checksum, sizeof(uint64_t));
	}
	ck_assert_uint_eq(trailer.checksum, XXH3_64bits_digest(&whole));
	/* Payloads longer than an export's 256 KiB chunk were among them. */
	ck_assert_uint_gt(long_payloads, 0);
}

START_TEST(checksums_are_xxh3_on_every_kernel)
{
	struct service one, scalar;
	struct rng rng;
	struct model model;
	char file[PATH_MAX], again[PATH_MAX];
	service_start(&one, NULL);
	setenv("ZC_CODEC_ISA", "scalar", 1);
	service_start(&scalar, NULL);
	unsetenv("ZC_CODEC_ISA");
	rng_seed(&rng, 31);
	/* Blocks of 3000 tokens (K and V payloads of about 1.6 MiB each), a
	 * residual of 33 rows. */
	zc_session_config config = shaped_config("h", 2, 1, 8, 128, 128, 4096, ZC_POLICY_STREAMING,
						 64);
	config.model_id = "hash-model";
	zc_session *session = open_session(one.client, &config);
	model_init(&model, &config);
	for (uint32_t layer = 0; layer < 2; layer++) {
		CHECK(update_checked, one.client, session, &model, &rng, layer, 3000);
		CHECK(update_checked, one.client, session, &model, &rng, layer, 33);
	}
	path_in(&one, "h.zcsnap", file, sizeof(file));
	path_in(&scalar, "again.zcsnap", again, sizeof(again));
	uint64_t bytes = export_file(session, file);
	size_t a_len, b_len;
	uint8_t *a = (uint8_t *)file_read_whole(file, &a_len);
	ck_assert_uint_eq(a_len, bytes);
	ck_assert_uint_ge(a_len, 4u << 20);   /* written in parallel where there are two CPUs */
	checksums_recompute(a, a_len);
	/* The same bytes through a pipe (in order, one writer)... */
	int p[2];
	char piped[PATH_MAX];
	path_in(&one, "piped.zcsnap", piped, sizeof(piped));
	ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
	int out = open(piped, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	int args[2] = { p[0], out };
	pid_t reader = child_spawn(pipe_reader, args, p[1]);
	close(p[0]);
	close(out);
	uint64_t piped_bytes = 0;
	ck_assert_int_eq(zc_session_export(session, p[1], &piped_bytes), 0);
	close(p[1]);
	child_wait_ok(reader, "pipe reader");
	uint8_t *b = (uint8_t *)file_read_whole(piped, &b_len);
	ck_assert_uint_eq(b_len, a_len);
	ck_assert_int_eq(memcmp(a, b, a_len), 0);
	free(b);
	/* ...and from a file's offset on, leaving the offset after the
	 * snapshot; appended with O_APPEND (in order) too. */
	static const char prefix[] = "a prefix the export must not touch";
	for (int append = 0; append < 2; append++) {
		int fd = open(piped, O_WRONLY | O_TRUNC | O_CLOEXEC | (append ? O_APPEND : 0));
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(write(fd, prefix, sizeof(prefix)), (ssize_t)sizeof(prefix));
		ck_assert_int_eq(zc_session_export(session, fd, &piped_bytes), 0);
		ck_assert_int_eq(lseek(fd, 0, SEEK_CUR), (off_t)(sizeof(prefix) + a_len));
		close(fd);
		b = (uint8_t *)file_read_whole(piped, &b_len);
		ck_assert_uint_eq(b_len, sizeof(prefix) + a_len);
		ck_assert_int_eq(memcmp(b, prefix, sizeof(prefix)), 0);
		ck_assert_msg(memcmp(b + sizeof(prefix), a, a_len) == 0, "append %d: other bytes",
			      append);
		free(b);
	}

	zc_import_options options;
	zc_session *imported;
	zc_import_options_default(&options);
	options.name = "h";
	ck_assert_int_eq(import_file(scalar.client, file, &options, &imported), 0);
	CHECK(session_matches, imported, &model);
	export_file(imported, again);
	b = (uint8_t *)file_read_whole(again, &b_len);
	ck_assert_uint_eq(a_len, b_len);
	ck_assert_int_eq(memcmp(a, b, a_len), 0);
	free(a);
	free(b);
	ck_assert_int_eq(zc_session_close(imported), 0);
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&scalar);
	service_stop(&one);
}
END_TEST

/* ---- corruption -------------------------------------------------------------------- */

/* A byte region of a snapshot, named as the daemon's messages name it. */
struct region {
	uint64_t start, bytes;
	char what[64];      /* for the test's messages */
	char needle[48];    /* what the daemon's sentence must mention */
};

static struct region region_make(uint64_t start, uint64_t bytes, const char *what,
				 const char *needle)
{
	struct region r = { .start = start, .bytes = bytes };
	snprintf(r.what, sizeof(r.what), "%s", what);
	snprintf(r.needle, sizeof(r.needle), "%s", needle);
	return r;
}

/* Every region of a snapshot, in file order, from its own tables. */
static size_t regions_of(const uint8_t *file, size_t len, struct region *out, size_t max)
{
	struct snapshot_header h;
	size_t n = 0;
	memcpy(&h, file, sizeof(h));
	uint32_t layers = h.config.layers;
	uint64_t heads = (uint64_t)h.config.batch * h.config.kv_heads;
	out[n++] = region_make(0, sizeof(h), "header", "header");
	out[n++] = region_make(sizeof(h), (uint64_t)layers * SNAPSHOT_LAYER_BYTES + 8, "layer table",
			       "layer table");
	for (uint32_t i = 0; i < layers; i++) {
		struct snapshot_layer l;
		memcpy(&l, file + sizeof(h) + (size_t)i * SNAPSHOT_LAYER_BYTES, sizeof(l));
		uint64_t at = l.offset;
		for (uint32_t k = 0; k < l.blocks; k++) {
			struct snapshot_block b;
			memcpy(&b, file + at, sizeof(b));
			ck_assert_uint_lt(n + 4, max);
			struct region *r = &out[n++];
			*r = region_make(at, SNAPSHOT_BLOCK_BYTES, "", "");
			snprintf(r->what, sizeof(r->what), "layer %u block %u header", i, k);
			snprintf(r->needle, sizeof(r->needle), "layer %u block %u", i, k);
			r = &out[n++];
			*r = region_make(at + SNAPSHOT_BLOCK_BYTES, b.key_bytes, "", "");
			snprintf(r->what, sizeof(r->what), "layer %u block %u K payload", i, k);
			snprintf(r->needle, sizeof(r->needle), "layer %u block %u: payload", i, k);
			r = &out[n++];
			*r = region_make(at + SNAPSHOT_BLOCK_BYTES + b.key_bytes, b.value_bytes, "", "");
			snprintf(r->what, sizeof(r->what), "layer %u block %u V payload", i, k);
			snprintf(r->needle, sizeof(r->needle), "layer %u block %u: payload", i, k);
			r = &out[n++];
			*r = region_make(at + SNAPSHOT_BLOCK_BYTES + b.key_bytes + b.value_bytes,
					 SNAPSHOT_BLOCK_END_BYTES, "", "");
			snprintf(r->what, sizeof(r->what), "layer %u block %u payload checksum", i, k);
			snprintf(r->needle, sizeof(r->needle), "layer %u block %u: payload", i, k);
			at += snapshot_record_bytes(b.key_bytes, b.value_bytes);
		}
		uint64_t residual = heads * l.residual_tokens *
				    (h.config.head_dim_k + h.config.head_dim_v) * 2;
		if (residual) {
			struct region *r = &out[n++];
			*r = region_make(at, residual, "", "");
			snprintf(r->what, sizeof(r->what), "layer %u residual", i);
			snprintf(r->needle, sizeof(r->needle), "layer %u residual", i);
		}
	}
	out[n++] = region_make(len - SNAPSHOT_TRAILER_BYTES, SNAPSHOT_TRAILER_BYTES, "trailer",
			       "trailer");
	/* The regions tile the file. */
	uint64_t at = 0;
	for (size_t i = 0; i < n; i++) {
		ck_assert_msg(out[i].start == at, "%s starts at %llu, expected %llu", out[i].what,
			      (unsigned long long)out[i].start, (unsigned long long)at);
		at += out[i].bytes;
	}
	ck_assert_uint_eq(at, len);
	return n;
}

/* A session of two layers, each with two blocks and a partial residual. */
static zc_session *corruption_session(struct service *service, struct model *model)
{
	struct rng rng;
	rng_seed(&rng, 99);
	zc_session_config config = shaped_config("source", 2, 1, 2, 32, 32, 1024,
						 ZC_POLICY_STREAMING, 16);
	config.model_id = "model-a";
	zc_session *session = open_session(service->client, &config);
	model_init(model, &config);
	for (uint32_t layer = 0; layer < 2; layer++) {
		CHECK(update_checked, service->client, session, model, &rng, layer, 20);
		CHECK(update_checked, service->client, session, model, &rng, layer, 17);
		CHECK(update_checked, service->client, session, model, &rng, layer, 5);
	}
	return session;
}

START_TEST(every_region_flipped_or_cut_is_refused)
{
	struct service service;
	struct model model;
	char good[PATH_MAX], bad[PATH_MAX];
	struct region regions[64];
	size_t len;

	service_start(&service, NULL);
	zc_session *session = corruption_session(&service, &model);
	path_in(&service, "good.zcsnap", good, sizeof(good));
	path_in(&service, "bad.zcsnap", bad, sizeof(bad));
	export_file(session, good);
	uint8_t *file = (uint8_t *)file_read_whole(good, &len);
	size_t n = regions_of(file, len, regions, 64);
	ck_assert_uint_ge(n, 2 + 2 * (2 * 4 + 1) + 1);

	uint8_t *copy = allocate(len);
	for (size_t i = 0; i < n; i++) {
		const struct region *r = &regions[i];
		/* A bit in its first, middle and last byte. */
		uint64_t where[3] = { r->start, r->start + r->bytes / 2, r->start + r->bytes - 1 };
		for (int w = 0; w < 3; w++) {
			char what[96];
			memcpy(copy, file, len);
			copy[where[w]] ^= (uint8_t)(1u << (where[w] % 8));
			bytes_write(bad, copy, len);
			snprintf(what, sizeof(what), "a bit of byte %llu (%s)",
				 (unsigned long long)where[w], r->what);
			/* A flip in a record's header is found there, in the
			 * header's checksum, magic or fields. */
			import_refused(&service, bad, NULL, ZC_ECORRUPT, r->needle, what);
		}
	}
	/* Cut at every region boundary, and one byte past it. */
	for (size_t i = 0; i < n; i++) {
		uint64_t cuts[2] = { regions[i].start, regions[i].start + 1 };
		for (int c = 0; c < 2; c++) {
			char what[96];
			bytes_write(bad, file, cuts[c]);
			snprintf(what, sizeof(what), "cut to %llu bytes (in %s)",
				 (unsigned long long)cuts[c], regions[i].what);
			import_refused(&service, bad, NULL, ZC_ECORRUPT, "truncated", what);
		}
	}
	/* One stray byte at the end. */
	memcpy(copy, file, len);
	bytes_write(bad, copy, len);
	int fd = open(bad, O_WRONLY | O_APPEND);
	ck_assert_int_eq(write(fd, "x", 1), 1);
	close(fd);
	import_refused(&service, bad, NULL, ZC_ECORRUPT, "stray bytes", "a byte appended");

	/* And the good one still imports. */
	zc_session *imported;
	ck_assert_int_eq(import_file(service.client, good, NULL, &imported), 0);
	CHECK(session_matches, imported, &model);
	free(copy);
	free(file);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* Pool files in the shm-dir. */
static int pool_files(const struct service *service)
{
	DIR *dir = opendir(service->daemon.shm_dir);
	struct dirent *entry;
	int count = 0;
	ck_assert_ptr_nonnull(dir);
	while ((entry = readdir(dir)) != NULL)
		count += strncmp(entry->d_name, "pool-", 5) == 0 ||
			 strncmp(entry->d_name, ".pool-", 6) == 0;
	closedir(dir);
	return count;
}

/*
 * The import verifies records as it builds them: one refused after it
 * stored blocks (a payload of the last layer, the whole-file checksum)
 * throws them away, and on a daemon where the uid had no session it
 * removes the pool file it made too. Then the good file imports there.
 */
START_TEST(a_refused_import_leaves_no_pool)
{
	struct service service, fresh;
	struct model model;
	char good[PATH_MAX], bad[PATH_MAX];
	struct region regions[64];
	size_t len;

	service_start(&service, NULL);
	zc_session *session = corruption_session(&service, &model);
	path_in(&service, "good.zcsnap", good, sizeof(good));
	path_in(&service, "bad.zcsnap", bad, sizeof(bad));
	export_file(session, good);
	uint8_t *file = (uint8_t *)file_read_whole(good, &len);
	size_t n = regions_of(file, len, regions, 64);
	const struct region *last_payload = NULL;
	for (size_t i = 0; i < n; i++)
		if (strcmp(regions[i].what, "layer 1 block 1 V payload") == 0)
			last_payload = &regions[i];
	ck_assert_ptr_nonnull(last_payload);
	uint64_t flips[2] = { last_payload->start + last_payload->bytes / 2, len - 1 };
	const char *needles[2] = { "layer 1 block 1: payload checksum mismatch",
				   "trailer: whole-snapshot checksum mismatch" };
	service_start(&fresh, NULL);
	for (int f = 0; f < 2; f++) {
		uint8_t *copy = allocate(len);
		memcpy(copy, file, len);
		copy[flips[f]] ^= 0x10;
		bytes_write(bad, copy, len);
		free(copy);
		ck_assert_int_eq(pool_files(&fresh), 0);
		import_refused(&fresh, bad, NULL, ZC_ECORRUPT, needles[f], needles[f]);
		ck_assert_msg(pool_files(&fresh) == 0, "%s: a pool file was left", needles[f]);
		/* Where the uid has a pool already, it stays. */
		import_refused(&service, bad, NULL, ZC_ECORRUPT, needles[f], needles[f]);
		ck_assert_int_eq(pool_files(&service), 1);
	}
	zc_session *imported;
	ck_assert_int_eq(import_file(fresh.client, good, NULL, &imported), 0);
	CHECK(session_matches, imported, &model);
	ck_assert_int_eq(pool_files(&fresh), 1);
	free(file);
	model_free(&model);
	service_stop(&fresh);
	service_stop(&service);
}
END_TEST

/* Rewrites the header's checksum after a change, as a forger would. */
static void header_reseal(uint8_t *file)
{
	struct snapshot_header h;
	memcpy(&h, file, sizeof(h));
	h.checksum = XXH3_64bits(&h, offsetof(struct snapshot_header, checksum));
	memcpy(file, &h, sizeof(h));
}

START_TEST(version_config_and_fingerprint_are_checked)
{
	struct service service;
	struct model model;
	char good[PATH_MAX], bad[PATH_MAX];
	size_t len;

	service_start(&service, NULL);
	zc_session *session = corruption_session(&service, &model);
	path_in(&service, "good.zcsnap", good, sizeof(good));
	path_in(&service, "bad.zcsnap", bad, sizeof(bad));
	export_file(session, good);
	uint8_t *file = (uint8_t *)file_read_whole(good, &len);
	uint8_t *copy = allocate(len);
	struct snapshot_header h;

	/* A newer format, honestly sealed. */
	memcpy(copy, file, len);
	memcpy(&h, copy, sizeof(h));
	h.version = SNAPSHOT_VERSION + 1;
	memcpy(copy, &h, sizeof(h));
	header_reseal(copy);
	bytes_write(bad, copy, len);
	import_refused(&service, bad, NULL, ZC_ECORRUPT, "version 2", "a newer version");

	/* A config changed under a resealed header: the fingerprint says so. */
	memcpy(copy, file, len);
	memcpy(&h, copy, sizeof(h));
	h.config.hi_bits = 3;
	memcpy(copy, &h, sizeof(h));
	header_reseal(copy);
	bytes_write(bad, copy, len);
	import_refused(&service, bad, NULL, ZC_ECORRUPT, "fingerprint does not match",
		       "a changed config");

	/* ...and with the fingerprint forged too, every block record is of
	 * another config. */
	memcpy(&h, copy, sizeof(h));
	h.fingerprint = XXH3_64bits(&h.config, sizeof(h.config));
	memcpy(copy, &h, sizeof(h));
	header_reseal(copy);
	bytes_write(bad, copy, len);
	import_refused(&service, bad, NULL, ZC_ECORRUPT, "layer 0 block 0: the record is of another config",
		       "a forged fingerprint");

	/* A config no session may have, sealed and fingerprinted. */
	memcpy(copy, file, len);
	memcpy(&h, copy, sizeof(h));
	h.config.hi_bits = 9;
	h.fingerprint = XXH3_64bits(&h.config, sizeof(h.config));
	memcpy(copy, &h, sizeof(h));
	header_reseal(copy);
	bytes_write(bad, copy, len);
	import_refused(&service, bad, NULL, ZC_EINVALID, "bad config", "hi_bits 9");

	/* Inconsistent counts in an honestly sealed header. */
	memcpy(copy, file, len);
	memcpy(&h, copy, sizeof(h));
	h.tokens += 1;
	memcpy(copy, &h, sizeof(h));
	header_reseal(copy);
	bytes_write(bad, copy, len);
	import_refused(&service, bad, NULL, ZC_ECORRUPT, "inconsistent counts", "a token too many");

	/* Expectations: the model id and the fingerprint. */
	zc_import_options options;
	zc_import_options_default(&options);
	options.model_id = "model-b";
	import_refused(&service, good, &options, ZC_EPRECONDITION, "model 'model-a', not 'model-b'",
		       "another model");
	zc_import_options_default(&options);
	options.check_fingerprint = true;
	memcpy(&h, file, sizeof(h));
	options.fingerprint = h.fingerprint ^ 1;
	import_refused(&service, good, &options, ZC_EPRECONDITION, "wrong fingerprint",
		       "another fingerprint");
	options.fingerprint = h.fingerprint;
	options.model_id = "model-a";
	options.name = "checked";
	zc_session *imported;
	ck_assert_int_eq(import_file(service.client, good, &options, &imported), 0);
	CHECK(session_matches, imported, &model);
	/* A name that is taken. */
	import_refused(&service, good, &options, ZC_EEXISTS, "already exists", "a taken name");

	free(copy);
	free(file);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* ---- descriptors, ownership, budget ------------------------------------------------- */

static void export_refused(struct service *service, zc_session *session, int fd, int expected,
			   const char *needle, const char *what)
{
	uint64_t bytes = 0;
	int rc = zc_session_export(session, fd, &bytes);
	ck_assert_msg(rc == expected, "%s: export gave %s, expected %s (%s)", what, zc_error_name(rc),
		      zc_error_name(expected), zc_client_last_error(service->client));
	ck_assert_msg(strstr(zc_client_last_error(service->client), needle) != NULL,
		      "%s: \"%s\" does not mention \"%s\"", what,
		      zc_client_last_error(service->client), needle);
}

static void import_fd_refused(struct service *service, int fd, const char *needle,
			      const char *what)
{
	struct holdings before = holdings_of(service);
	zc_session *session;
	int rc = zc_session_import(service->client, fd, NULL, &session);
	ck_assert_msg(rc == ZC_EINVALID, "%s: import gave %s (%s)", what, zc_error_name(rc),
		      zc_client_last_error(service->client));
	ck_assert_msg(strstr(zc_client_last_error(service->client), needle) != NULL,
		      "%s: \"%s\" does not mention \"%s\"", what,
		      zc_client_last_error(service->client), needle);
	nothing_made(service, &before, what);
}

START_TEST(bad_descriptors_are_refused)
{
	struct service service;
	struct model model;
	char path[PATH_MAX];
	service_start(&service, NULL);
	zc_session *session = corruption_session(&service, &model);
	path_in(&service, "s.zcsnap", path, sizeof(path));
	export_file(session, path);

	int dir = open(service.daemon.dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	int pair[2];
	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
	int read_only = open(path, O_RDONLY | O_CLOEXEC);
	int write_only = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
	ck_assert_int_ge(dir, 0);
	export_refused(&service, session, dir, ZC_EINVALID, "a directory", "export to a directory");
	export_refused(&service, session, pair[0], ZC_EINVALID, "a socket", "export to a socket");
	export_refused(&service, session, read_only, ZC_EINVALID, "open for writing",
		       "export to a read-only file");
	import_fd_refused(&service, dir, "a directory", "import from a directory");
	import_fd_refused(&service, pair[0], "a socket", "import from a socket");
	import_fd_refused(&service, write_only, "open for reading", "import from a write-only file");
	/* A pipe whose reader is gone: the export fails and says why. */
	int gone_reader[2];
	ck_assert_int_eq(pipe2(gone_reader, O_CLOEXEC), 0);
	close(gone_reader[0]);
	export_refused(&service, session, gone_reader[1], ZC_EINTERNAL, "cannot write the snapshot",
		       "export to a pipe nobody reads");
	close(gone_reader[1]);
	/* The connection is still in step after every refusal. */
	CHECK(session_matches, session, &model);

	/* An unknown session. */
	zc_session_config config = shaped_config("gone", 1, 1, 1, 16, 16, 64, ZC_POLICY_STREAMING, 8);
	zc_session *gone = open_session(service.client, &config);
	ck_assert_int_eq(zc_client_close_session(service.client, zc_session_get_info(gone)->id), 0);
	int out = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
	export_refused(&service, gone, out, ZC_ENOTFOUND, "no session", "an unknown session");
	zc_session_release(gone);
	close(out);
	close(dir);
	close(pair[0]);
	close(pair[1]);
	close(read_only);
	close(write_only);
	model_free(&model);
	service_stop(&service);
}
END_TEST

/* Another uid asks for root's session by its id, with a descriptor of
 * its own: the daemon answers NOT_FOUND (raw frames: the library has no
 * handle for a session the caller cannot open). */
struct other_uid {
	const char *socket_path;
	uint64_t session_id;
};

static int other_uid_body(void *arg)
{
	const struct other_uid *o = arg;
	char why[200];
	CHILD_EXPECT(user_become(65534, 65534, why, sizeof(why)), "%s", why);
	char path[] = "/tmp/zipcache-snapshot-XXXXXX";
	int fd = mkstemp(path);
	CHILD_EXPECT(fd >= 0, "mkstemp: %s", strerror(errno));
	unlink(path);
	int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	snprintf(address.sun_path, sizeof(address.sun_path), "%s", o->socket_path);
	CHILD_EXPECT(connect(sock, (struct sockaddr *)&address, sizeof(address)) == 0, "connect: %s",
		     strerror(errno));
	wire_request request = { .request_id = 7, .op = WIRE_OP_EXPORT_SESSION };
	request.export_session.session_id = o->session_id;
	uint8_t frame[256];
	size_t len;
	CHILD_EXPECT(wire_request_encode(&request, frame, sizeof(frame), &len) == 0, "encode");
	union {
		char bytes[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control;
	struct iovec iov = { frame, len };
	struct msghdr message = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.bytes,
				  .msg_controllen = sizeof(control.bytes) };
	struct cmsghdr *c = CMSG_FIRSTHDR(&message);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof(int));
	CHILD_EXPECT(sendmsg(sock, &message, 0) == (ssize_t)len, "sendmsg: %s", strerror(errno));
	uint8_t reply[1024];
	size_t got = 0;
	uint32_t body = 0;
	while (got < 4 || got < 4 + body) {
		ssize_t n = read(sock, reply + got, sizeof(reply) - got);
		CHILD_EXPECT(n > 0, "read: %s", n < 0 ? strerror(errno) : "end of stream");
		got += (size_t)n;
		if (got >= 4)
			memcpy(&body, reply, 4);
		CHILD_EXPECT(4 + (size_t)body <= sizeof(reply), "reply of %u bytes", body);
	}
	wire_response response;
	CHILD_EXPECT(wire_response_decode(reply + 4, body, &response) == 0, "decode");
	CHILD_EXPECT(response.status == WIRE_STATUS_NOT_FOUND, "export of root's session: status %d (%s)",
		     response.status, response.message);
	CHILD_EXPECT(lseek(fd, 0, SEEK_END) == 0, "bytes were written to the descriptor");
	wire_response_free(&response);
	close(sock);
	close(fd);
	return 0;
}

START_TEST(another_uids_session_is_not_exported)
{
	struct service service;
	struct model model;
	const char *const args[] = { "--socket-mode", "0666", NULL };
	service_start(&service, args);
	if (!other_users_possible(service.daemon.dir)) {
		service_stop(&service);
		return;
	}
	ck_assert_int_eq(chmod(service.daemon.dir, 0755), 0);
	zc_session *session = corruption_session(&service, &model);
	struct other_uid o = { service.daemon.socket_path, zc_session_get_info(session)->id };
	pid_t pid = child_spawn(other_uid_body, &o, -1);
	child_wait_ok(pid, "nobody's client");
	model_free(&model);
	service_stop(&service);
}
END_TEST

START_TEST(an_import_past_the_budget_makes_nothing)
{
	struct service big, small;
	struct model model;
	struct rng rng;
	char path[PATH_MAX];
	service_start(&big, NULL);
	rng_seed(&rng, 5);
	zc_session_config config = shaped_config("big", 2, 1, 8, 128, 128, 8192,
						 ZC_POLICY_STREAMING, 128);
	config.views = ZC_VIEWS_NONE;
	zc_session *session = open_session(big.client, &config);
	model_init(&model, &config);
	for (uint32_t layer = 0; layer < 2; layer++)
		CHECK(update_checked, big.client, session, &model, &rng, layer, 8000);
	path_in(&big, "big.zcsnap", path, sizeof(path));
	uint64_t bytes = export_file(session, path);
	ck_assert_uint_gt(bytes, 8u << 20);

	const char *const args[] = { "--memory-budget", "8388608", NULL };
	service_start(&small, args);
	/* The uid has no session here: a refused import does not even make its pool. */
	import_refused(&small, path, NULL, ZC_EEXHAUSTED, "memory budget", "past the budget");
	service_stop(&small);
	/* A session longer than another daemon's --max-tokens allows. */
	const char *const short_args[] = { "--max-tokens", "4096", NULL };
	service_start(&small, short_args);
	import_refused(&small, path, NULL, ZC_EEXHAUSTED, "--max-tokens 4096", "past --max-tokens");
	model_free(&model);
	service_stop(&small);
	service_stop(&big);
}
END_TEST

START_TEST(model_id_is_kept_and_bounded)
{
	struct service service;
	service_start(&service, NULL);
	zc_session_config config = shaped_config("m", 1, 1, 1, 16, 16, 64, ZC_POLICY_STREAMING, 8);
	char long_id[ZC_MODEL_ID_MAX + 2];
	memset(long_id, 'x', sizeof(long_id) - 1);
	long_id[sizeof(long_id) - 1] = '\0';
	config.model_id = long_id;
	zc_session *session;
	ck_assert_int_eq(zc_session_open(service.client, &config, &session), ZC_EINVALID);
	long_id[ZC_MODEL_ID_MAX] = '\0';
	session = open_session(service.client, &config);
	ck_assert_str_eq(zc_session_get_info(session)->model_id, long_id);
	zc_session_info infos[4];
	size_t count;
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 1);
	ck_assert_str_eq(infos[0].model_id, long_id);
	/* Kept across a restart (the session file holds it). */
	zc_session_release(session);
	zc_client_close(service.client);
	daemon_stop(&service.daemon);
	daemon_restart(&service.daemon);
	service.client = connect_client(&service.daemon);
	ck_assert_int_eq(zc_client_list_sessions(service.client, infos, 4, &count), 0);
	ck_assert_uint_eq(count, 1);
	ck_assert_str_eq(infos[0].model_id, long_id);
	service_stop(&service);
}
END_TEST

/*
 * Exports taken while the residual's flushes are deferred (the updates go
 * without stats, several in one write, so later rows land beside a flush
 * not yet published): each export waits for what was acknowledged and
 * the import is the model's, bit for bit, and goes on like the original.
 */
START_TEST(exports_beside_deferred_flushes)
{
	struct service one;
	zc_session_config config = shaped_config("deferred", 2, 1, 2, 32, 32, 1024,
						 ZC_POLICY_STREAMING, 16);
	struct model model, imported_model;
	struct rng rng;
	char path[PATH_MAX];

	service_start(&one, NULL);
	path_in(&one, "deferred.zcsnap", path, sizeof(path));
	zc_session *session = open_session(one.client, &config);
	model_init(&model, &config);
	rng_seed(&rng, 77);
	for (int round = 0; round < 6; round++) {
		struct block blocks[4];
		zc_update updates[4];
		uint32_t fill = 16 - model.layer[0].residual;
		uint32_t layers[4] = { 0, 0, 1, 0 };
		uint32_t tokens[4] = { fill, 3, 5, 1 };
		for (int i = 0; i < 4; i++) {
			block_make(&blocks[i], &model, tokens[i], &rng);
			ck_assert_int_eq(model_update(&model, layers[i], tokens[i], blocks[i].keys,
						      blocks[i].values), 0);
			updates[i] = (zc_update){ layers[i], tokens[i], blocks[i].keys, blocks[i].values };
		}
		size_t done = 0;
		ck_assert_int_eq(zc_update_many(session, updates, 4, &done), 0);
		ck_assert_uint_eq(done, 4);
		for (int i = 0; i < 4; i++)
			block_free(&blocks[i]);
		export_file(session, path);
		zc_import_options options;
		zc_session *imported;
		zc_import_options_default(&options);
		char name[32];
		snprintf(name, sizeof(name), "imported-%d", round);
		options.name = name;
		ck_assert_int_eq(import_file(one.client, path, &options, &imported), 0);
		CHECK(session_matches, imported, &model);
		model_fork(&imported_model, &model, model.max_tokens);
		continue_both(one.client, session, &model, one.client, imported, &imported_model,
			      &rng);
		model_free(&imported_model);
		ck_assert_int_eq(zc_session_close(imported), 0);
	}
	ck_assert_int_eq(zc_session_close(session), 0);
	model_free(&model);
	service_stop(&one);
}
END_TEST

int main(void)
{
	Suite *suite = suite_create("snapshot");
	const struct test_case cases[] = {
		{ "round_trip", { round_trips_are_bit_exact, pipe_export_equals_file_export,
				  exports_beside_deferred_flushes, checksums_are_xxh3_on_every_kernel,
				  NULL } },
		{ "corruption", { every_region_flipped_or_cut_is_refused,
				  version_config_and_fingerprint_are_checked, a_refused_import_leaves_no_pool,
				  NULL } },
		{ "descriptors", { bad_descriptors_are_refused, another_uids_session_is_not_exported,
				   an_import_past_the_budget_makes_nothing, model_id_is_kept_and_bounded,
				   NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite_main(suite, CK_FORK);
}
