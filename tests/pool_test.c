/*
 * A uid's block pool (server/pool.c) on its own, without a daemon: bytes
 * written come back; an extent lives while it has references and is
 * punched (its pages and its budget given back) at the last; freed space
 * is reused first fit and coalesced; exhaustion and the memory budget
 * refuse without taking anything; after a restart, sessions' claims keep
 * their extents byte for byte and the sweep frees the rest; claims that
 * cannot be right and files that are not pools are refused with a reason.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../server/budget.h"
#include "../server/pool.h"
#include "../server/retain.h"
#include "shm_dir.h"
#include "suite_main.h"
#include "zipcache/error.h"
#include "zipcache/map.h"

#define TEST_TIMEOUT_SECONDS 120
#define PAGE 4096u
#define UID 4242u

/* ---- helpers ---------------------------------------------------------------- */

struct fixture {
	struct shm_dir dir;
	struct store_budget budget;
	struct pool *pool;
	char reason[256];
};

static struct pool *fixture_open(struct fixture *f, uint32_t uid, bool *existed)
{
	struct pool *pool = NULL;
	bool found = true;
	f->reason[0] = '\0';
	int rc = pool_open(f->dir.fd, f->dir.path, uid, &f->budget, &pool, &found, f->reason,
			   sizeof(f->reason));
	ck_assert_msg(rc == 0, "pool_open uid %u: %s (%s)", uid, zc_strerror(rc), f->reason);
	if (existed)
		*existed = found;
	return pool;
}

static void fixture_start(struct fixture *f, const char *tag)
{
	memset(f, 0, sizeof(*f));
	shm_dir_make(&f->dir, tag);
	bool existed = true;
	f->pool = fixture_open(f, UID, &existed);
	ck_assert(!existed);
}

static void fixture_end(struct fixture *f)
{
	pool_close(f->pool);
	f->pool = NULL;
	ck_assert_uint_eq(f->budget.used, 0);
	shm_dir_remove(&f->dir);
}

/* A payload of `bytes` bytes that only `seed` gives. */
static uint8_t *pattern(uint64_t bytes, uint32_t seed)
{
	uint8_t *p = malloc(bytes ? bytes : 1);
	ck_assert_ptr_nonnull(p);
	uint32_t x = seed * 2654435761u + 1;
	for (uint64_t i = 0; i < bytes; i++) {
		x = x * 1103515245u + 12345u;
		p[i] = (uint8_t)(x >> 16);
	}
	return p;
}

/* One block as a test knows it. */
struct blk {
	uint64_t key_bytes, value_bytes, offset;
	uint32_t seed;
};

static uint64_t write_block(struct pool *pool, struct blk *b, uint64_t key_bytes,
			    uint64_t value_bytes, uint32_t seed)
{
	uint8_t *k = pattern(key_bytes, seed), *v = pattern(value_bytes, seed + 1000);
	*b = (struct blk){ .key_bytes = key_bytes, .value_bytes = value_bytes, .seed = seed };
	int rc = pool_write(pool, k, key_bytes, v, value_bytes, &b->offset);
	ck_assert_msg(rc == 0, "pool_write %llu+%llu bytes: %s", (unsigned long long)key_bytes,
		      (unsigned long long)value_bytes, zc_strerror(rc));
	free(k);
	free(v);
	return b->offset;
}

/* A block of `pages` pages (K fills the first ones, V one byte short of the end). */
static uint64_t write_pages(struct pool *pool, struct blk *b, uint32_t pages, uint32_t seed)
{
	uint64_t key_bytes = (uint64_t)pages * PAGE / 2;
	uint64_t value_bytes = (uint64_t)pages * PAGE - key_bytes - 1;
	ck_assert_uint_eq(pool_extent_bytes(key_bytes, value_bytes), (uint64_t)pages * PAGE);
	return write_block(pool, b, key_bytes, value_bytes, seed);
}

/* The block's bytes, read back through the pool and through a reader's
 * descriptor, are the ones written. */
static void assert_block_intact(struct pool *pool, const struct blk *b)
{
	uint8_t *k = pattern(b->key_bytes, b->seed), *v = pattern(b->value_bytes, b->seed + 1000);
	uint8_t *got = malloc(b->key_bytes + b->value_bytes + 1);
	uint64_t value_offset = pool_value_offset(b->offset, b->key_bytes);
	ck_assert_int_eq(pool_read(pool, b->offset, got, b->key_bytes), 0);
	ck_assert_msg(memcmp(got, k, b->key_bytes) == 0, "K of the block at %llu changed",
		      (unsigned long long)b->offset);
	ck_assert_int_eq(pool_read(pool, value_offset, got, b->value_bytes), 0);
	ck_assert_msg(memcmp(got, v, b->value_bytes) == 0, "V of the block at %llu changed",
		      (unsigned long long)b->offset);
	int fd = pool_open_readonly(pool);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pread(fd, got, b->key_bytes, (off_t)b->offset), (ssize_t)b->key_bytes);
	ck_assert(memcmp(got, k, b->key_bytes) == 0);
	close(fd);
	free(got);
	free(k);
	free(v);
}

/* Whether [start, start + bytes) of the pool file holds no data at all. */
static bool is_hole(struct pool *pool, uint64_t start, uint64_t bytes)
{
	int fd = pool_open_readonly(pool);
	ck_assert_int_ge(fd, 0);
	off_t data = lseek(fd, (off_t)start, SEEK_DATA);
	close(fd);
	return data < 0 || (uint64_t)data >= start + bytes;
}

/* Whether every byte of [start, start + bytes) is data. */
static bool is_data(struct pool *pool, uint64_t start, uint64_t bytes)
{
	int fd = pool_open_readonly(pool);
	ck_assert_int_ge(fd, 0);
	off_t data = lseek(fd, (off_t)start, SEEK_DATA);
	off_t hole = lseek(fd, (off_t)start, SEEK_HOLE);
	close(fd);
	return data == (off_t)start && hole >= (off_t)(start + bytes);
}

/* The charge is what the file really holds, and what the budget counts. */
static void assert_charge_exact(const struct fixture *f, struct pool *pool)
{
	ck_assert_uint_eq(pool_memory_bytes(pool), pool_file_bytes(pool));
	ck_assert_uint_eq(f->budget.used, pool_memory_bytes(pool));
}

static void claim_ok(struct pool *pool, const struct blk *b)
{
	char reason[200] = "";
	int rc = pool_claim(pool, b->offset, b->key_bytes, pool_value_offset(b->offset, b->key_bytes),
			    b->value_bytes, reason, sizeof(reason));
	ck_assert_msg(rc == 0, "claim of %llu: %s (%s)", (unsigned long long)b->offset,
		      zc_strerror(rc), reason);
}

/* A claim that must be refused as corrupt, with a reason that says so. */
static void claim_refused(struct pool *pool, uint64_t offset, uint64_t key_bytes,
			  uint64_t value_offset, uint64_t value_bytes, const char *needle)
{
	char reason[200] = "";
	int rc = pool_claim(pool, offset, key_bytes, value_offset, value_bytes, reason,
			    sizeof(reason));
	ck_assert_msg(rc == ZC_ECORRUPT, "claim at %llu (%llu+%llu bytes, V at %llu): %s, not "
		      "ZC_ECORRUPT", (unsigned long long)offset, (unsigned long long)key_bytes,
		      (unsigned long long)value_bytes, (unsigned long long)value_offset,
		      zc_error_name(rc));
	ck_assert_msg(strstr(reason, needle) != NULL, "the reason \"%s\" does not say \"%s\"", reason,
		      needle);
}

static void pool_file_name(char *out, size_t size, uint32_t uid)
{
	snprintf(out, size, "pool-%u.zcp", (unsigned)uid);
}

/* Rewrites bytes of a pool file in place (it is 0400: lifted for the write). */
static void file_patch(const struct shm_dir *dir, const char *name, off_t offset,
		       const void *bytes, size_t size)
{
	ck_assert_int_eq(fchmodat(dir->fd, name, 0600, 0), 0);
	int fd = openat(dir->fd, name, O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, bytes, size, offset), (ssize_t)size);
	close(fd);
	ck_assert_int_eq(fchmodat(dir->fd, name, 0400, 0), 0);
}

/* ---- writing and reading ------------------------------------------------------- */

START_TEST(write_read_round_trip)
{
	struct fixture f;
	fixture_start(&f, "pool_rw");
	char name[64];
	pool_file_name(name, sizeof(name), UID);

	/* A new pool: the header page, and nothing else held. */
	ck_assert(shm_dir_has(&f.dir, name));
	ck_assert_uint_eq(pool_uid(f.pool), UID);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	assert_charge_exact(&f, f.pool);
	zc_pool_header header;
	int fd = pool_open_readonly(f.pool);
	ck_assert_int_ge(fd, 0);
	struct stat st;
	ck_assert_int_eq(fstat(fd, &st), 0);
	ck_assert_uint_eq((uint64_t)st.st_size, POOL_CAPACITY_BYTES);
	ck_assert_uint_eq(st.st_mode & 0777, 0400);
	ck_assert_int_eq(pread(fd, &header, sizeof(header), 0), (ssize_t)sizeof(header));
	ck_assert(memcmp(header.magic, ZC_POOL_MAGIC, sizeof(header.magic)) == 0);
	ck_assert_uint_eq(header.version, ZC_POOL_VERSION);
	ck_assert_uint_eq(header.owner_uid, UID);
	ck_assert_uint_eq(header.capacity, POOL_CAPACITY_BYTES);
	ck_assert_uint_eq(header.data_offset, PAGE);
	/* A reader's descriptor cannot write. */
	ck_assert_int_lt(pwrite(fd, "x", 1, PAGE), 0);
	close(fd);

	/* The layout rule: V starts 64-aligned after K, extents are whole pages. */
	ck_assert_uint_eq(pool_value_offset(PAGE, 1), PAGE + 64);
	ck_assert_uint_eq(pool_value_offset(PAGE, 64), PAGE + 64);
	ck_assert_uint_eq(pool_value_offset(PAGE, 65), PAGE + 128);
	ck_assert_uint_eq(pool_extent_bytes(1, 1), PAGE);
	ck_assert_uint_eq(pool_extent_bytes(1000, 3000), PAGE);
	ck_assert_uint_eq(pool_extent_bytes(1000, 3100), 2 * PAGE);

	struct blk a, b, c;
	ck_assert_uint_eq(write_block(f.pool, &a, 1000, 3000, 1), PAGE);
	ck_assert_uint_eq(write_block(f.pool, &b, 5000, 7001, 2), 2 * PAGE);
	ck_assert_uint_eq(write_block(f.pool, &c, 0, 10, 3), 2 * PAGE + pool_extent_bytes(5000, 7001));
	ck_assert_uint_eq(pool_blocks(f.pool), 3);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 1);
	ck_assert_uint_eq(pool_refs(f.pool, b.offset), 1);
	ck_assert_uint_eq(pool_refs(f.pool, c.offset), 1);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset + PAGE / 2), 0);   /* not a block */
	assert_block_intact(f.pool, &a);
	assert_block_intact(f.pool, &b);
	assert_block_intact(f.pool, &c);
	ck_assert(is_data(f.pool, a.offset, pool_extent_bytes(a.key_bytes, a.value_bytes)));
	ck_assert_uint_eq(pool_file_bytes(f.pool),
			  PAGE + pool_extent_bytes(1000, 3000) + pool_extent_bytes(5000, 7001) +
				  pool_extent_bytes(0, 10));
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 0);
	assert_charge_exact(&f, f.pool);

	/* Reading past what the file holds is corruption, not a crash. */
	uint8_t byte;
	ck_assert_int_eq(pool_read(f.pool, POOL_CAPACITY_BYTES, &byte, 1), ZC_ECORRUPT);

	pool_unref(f.pool, a.offset);
	pool_unref(f.pool, b.offset);
	pool_unref(f.pool, c.offset);
	ck_assert_uint_eq(pool_blocks(f.pool), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	assert_charge_exact(&f, f.pool);
	fixture_end(&f);
}
END_TEST

/* Blocks written in place: through the pool's windows, and through a
 * mapping of their own when they straddle two; read back as written,
 * also into space freed (punched or kept) and taken again. */
static void write_mapped(struct pool *pool, struct blk *b, uint64_t bytes, uint32_t seed,
			 bool *own_mapping)
{
	*b = (struct blk){ .key_bytes = bytes / 2, .value_bytes = bytes - bytes / 2 - 64,
			   .seed = seed };
	ck_assert_int_eq(pool_reserve(pool, b->key_bytes, b->value_bytes, &b->offset), 0);
	uint64_t value_offset = pool_value_offset(b->offset, b->key_bytes);
	uint64_t span = value_offset + b->value_bytes - b->offset;
	struct pool_mapping mapping;
	uint8_t *at = pool_extent_map(pool, b->offset, span, &mapping);
	ck_assert_ptr_nonnull(at);
	*own_mapping = mapping.base != NULL;
	uint8_t *k = pattern(b->key_bytes, seed), *v = pattern(b->value_bytes, seed + 1000);
	memcpy(at, k, b->key_bytes);
	memcpy(at + (value_offset - b->offset), v, b->value_bytes);
	pool_extent_unmap(&mapping);
	ck_assert_ptr_null(mapping.base);
	free(k);
	free(v);
}

START_TEST(blocks_written_in_place_through_windows)
{
	struct fixture f;
	fixture_start(&f, "pool_map");
	pool_writes_set(POOL_WRITES_MAP);
	/* 3 MiB blocks: the 22nd straddles the first window's end. */
	const uint64_t bytes = UINT64_C(3) << 20;
	enum { N = 24 };
	struct blk b[N];
	unsigned straddling = 0;
	for (uint32_t i = 0; i < N; i++) {
		bool own;
		write_mapped(f.pool, &b[i], bytes, i + 1, &own);
		uint64_t end = b[i].offset + pool_extent_bytes(b[i].key_bytes, b[i].value_bytes);
		bool across = b[i].offset / POOL_WINDOW_BYTES != (end - 1) / POOL_WINDOW_BYTES;
		ck_assert_msg(own == across, "block %u at %llu: own mapping %d, across windows %d", i,
			      (unsigned long long)b[i].offset, own, across);
		straddling += across;
	}
	ck_assert_uint_eq(straddling, 1);
	for (uint32_t i = 0; i < N; i++)
		assert_block_intact(f.pool, &b[i]);
	/* Freed (every other one) and taken again, through the same window:
	 * the new bytes, not the old pages'. */
	for (uint32_t i = 0; i < N; i += 2)
		pool_unref(f.pool, b[i].offset);
	for (uint32_t i = 0; i < N; i += 2) {
		bool own;
		write_mapped(f.pool, &b[i], bytes, 100 + i, &own);
	}
	for (uint32_t i = 0; i < N; i++)
		assert_block_intact(f.pool, &b[i]);
	for (uint32_t i = 0; i < N; i++)
		pool_unref(f.pool, b[i].offset);
	assert_charge_exact(&f, f.pool);
	pool_writes_set(POOL_WRITES_COPY);
	/* COPY: no mapping at all. */
	struct pool_mapping mapping;
	uint64_t offset;
	ck_assert_int_eq(pool_reserve(f.pool, 100, 100, &offset), 0);
	ck_assert_ptr_null(pool_extent_map(f.pool, offset, 200, &mapping));
	ck_assert_ptr_null(mapping.base);
	pool_unref(f.pool, offset);
	fixture_end(&f);
}
END_TEST

START_TEST(last_reference_punches_and_gives_back)
{
	struct fixture f;
	fixture_start(&f, "pool_refs");
	struct blk keep, a;
	write_pages(f.pool, &keep, 1, 7);
	uint64_t used_before = f.budget.used, file_before = pool_file_bytes(f.pool);
	write_pages(f.pool, &a, 3, 8);
	ck_assert_uint_eq(f.budget.used, used_before + 3 * PAGE);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file_before + 3 * PAGE);

	/* Shared by a second reference: counted as shared until it is one again. */
	pool_ref(f.pool, a.offset);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 2);
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 3 * PAGE);
	pool_ref(f.pool, a.offset);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 3);
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 3 * PAGE);
	pool_unref(f.pool, a.offset);
	pool_unref(f.pool, a.offset);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 1);
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 0);
	/* Nothing freed while a reference is left. */
	ck_assert_uint_eq(pool_file_bytes(f.pool), file_before + 3 * PAGE);
	assert_block_intact(f.pool, &a);

	/* The last one: its pages are punched and the budget gets them back. */
	pool_unref(f.pool, a.offset);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 0);
	ck_assert_uint_eq(pool_blocks(f.pool), 1);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file_before);
	ck_assert_uint_eq(f.budget.used, used_before);
	ck_assert(is_hole(f.pool, a.offset, 3 * PAGE));
	assert_charge_exact(&f, f.pool);
	assert_block_intact(f.pool, &keep);

	/* References to what is not a block change nothing. */
	pool_ref(f.pool, a.offset);
	pool_unref(f.pool, a.offset);
	pool_unref(f.pool, keep.offset + PAGE);
	ck_assert_uint_eq(pool_refs(f.pool, a.offset), 0);
	ck_assert_uint_eq(pool_refs(f.pool, keep.offset), 1);
	ck_assert_uint_eq(pool_shared_bytes(f.pool), 0);
	assert_charge_exact(&f, f.pool);

	/* A budget handed on takes the charge with it. */
	struct store_budget other = { 0 };
	uint64_t charged = pool_memory_bytes(f.pool);
	pool_charge_to(f.pool, &other);
	ck_assert_uint_eq(other.used, charged);
	ck_assert_uint_eq(f.budget.used, 0);
	pool_charge_to(f.pool, &f.budget);
	ck_assert_uint_eq(other.used, 0);
	ck_assert_uint_eq(f.budget.used, charged);

	pool_unref(f.pool, keep.offset);
	fixture_end(&f);
}
END_TEST

/* ---- free space ---------------------------------------------------------------- */

START_TEST(freed_space_is_reused_first_fit)
{
	struct fixture f;
	fixture_start(&f, "pool_fit");
	struct blk a, b, c, d, e, x, y, z;
	write_pages(f.pool, &a, 1, 1);
	write_pages(f.pool, &b, 2, 2);
	write_pages(f.pool, &c, 1, 3);
	write_pages(f.pool, &d, 3, 4);
	write_pages(f.pool, &e, 1, 5);
	uint64_t top = e.offset + PAGE;

	/* Two holes: b's two pages and d's three. */
	pool_unref(f.pool, b.offset);
	pool_unref(f.pool, d.offset);
	ck_assert(is_hole(f.pool, b.offset, 2 * PAGE));
	ck_assert(is_hole(f.pool, d.offset, 3 * PAGE));
	/* Three pages fit only d's hole; one page then the first hole, b's. */
	ck_assert_uint_eq(write_pages(f.pool, &x, 3, 6), d.offset);
	ck_assert_uint_eq(write_pages(f.pool, &y, 1, 7), b.offset);
	ck_assert_uint_eq(write_pages(f.pool, &z, 1, 8), b.offset + PAGE);
	/* No hole is left: the next goes on top. */
	struct blk w;
	ck_assert_uint_eq(write_pages(f.pool, &w, 1, 9), top);

	struct blk *live[] = { &a, &c, &e, &x, &y, &z, &w };
	for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++) {
		assert_block_intact(f.pool, live[i]);
		pool_unref(f.pool, live[i]->offset);
	}
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	assert_charge_exact(&f, f.pool);
	/* Everything free: the pool starts over at its first data page. */
	ck_assert_uint_eq(write_pages(f.pool, &a, 2, 10), PAGE);
	pool_unref(f.pool, a.offset);
	fixture_end(&f);
}
END_TEST

/* Frees b, c and d (each one page) in the given order, with a and e
 * around them kept: one allocation of three pages lands where b was. */
static void coalesce_in_order(const int order[3])
{
	struct fixture f;
	fixture_start(&f, "pool_join");
	struct blk blocks[5], three;
	for (int i = 0; i < 5; i++)
		write_pages(f.pool, &blocks[i], 1, (uint32_t)i + 1);
	for (int i = 0; i < 3; i++)
		pool_unref(f.pool, blocks[1 + order[i]].offset);
	ck_assert_uint_eq(write_pages(f.pool, &three, 3, 20), blocks[1].offset);
	assert_block_intact(f.pool, &three);
	assert_block_intact(f.pool, &blocks[0]);
	assert_block_intact(f.pool, &blocks[4]);
	struct blk next;
	ck_assert_uint_eq(write_pages(f.pool, &next, 1, 21), blocks[4].offset + PAGE);
	pool_unref(f.pool, next.offset);
	pool_unref(f.pool, three.offset);
	pool_unref(f.pool, blocks[0].offset);

	/* The span below the top joins it when the top block goes: all of
	 * it is one allocation again, from a's offset. */
	pool_unref(f.pool, blocks[4].offset);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	ck_assert_uint_eq(write_pages(f.pool, &next, 5, 22), blocks[0].offset);
	pool_unref(f.pool, next.offset);
	fixture_end(&f);
}

START_TEST(neighbours_coalesce)
{
	static const int orders[][3] = { { 0, 1, 2 }, { 2, 1, 0 }, { 0, 2, 1 }, { 1, 0, 2 },
					 { 1, 2, 0 }, { 2, 0, 1 } };
	for (size_t i = 0; i < sizeof(orders) / sizeof(orders[0]); i++)
		coalesce_in_order(orders[i]);
}
END_TEST

/* ---- refusals ------------------------------------------------------------------ */

START_TEST(capacity_exhausted_takes_nothing)
{
	struct fixture f;
	fixture_start(&f, "pool_full");
	struct blk a, b;
	write_pages(f.pool, &a, 1, 1);
	uint64_t used = f.budget.used, file = pool_file_bytes(f.pool);
	uint8_t byte = 0;
	uint64_t offset = 77;

	/* Larger than the pool, and one page more than is left above a. */
	int rc = pool_write(f.pool, &byte, POOL_CAPACITY_BYTES, &byte, 0, &offset);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "a block as large as the pool: %s", zc_error_name(rc));
	rc = pool_write(f.pool, &byte, POOL_CAPACITY_BYTES - 2 * PAGE + 1, &byte, 0, &offset);
	ck_assert_msg(rc == ZC_EEXHAUSTED, "a block one page past the room left: %s",
		      zc_error_name(rc));
	ck_assert_uint_eq(offset, 77);
	ck_assert_uint_eq(f.budget.used, used);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file);
	ck_assert_uint_eq(pool_blocks(f.pool), 1);
	assert_charge_exact(&f, f.pool);
	/* Nothing moved: the next block goes right after a. */
	ck_assert_uint_eq(write_pages(f.pool, &b, 1, 2), a.offset + PAGE);
	pool_unref(f.pool, a.offset);
	pool_unref(f.pool, b.offset);
	fixture_end(&f);
}
END_TEST

START_TEST(budget_refuses_without_taking)
{
	struct fixture f;
	fixture_start(&f, "pool_budget");
	struct blk a, b, c;
	write_pages(f.pool, &a, 1, 1);
	f.budget.limit = f.budget.used + 2 * PAGE;
	uint64_t used = f.budget.used, file = pool_file_bytes(f.pool);
	uint8_t *k = pattern(3 * PAGE / 2, 9), *v = pattern(3 * PAGE / 2, 10);
	uint64_t offset = 77;
	int rc = pool_write(f.pool, k, 3 * PAGE / 2, v, 3 * PAGE / 2 - 1, &offset);
	ck_assert_msg(rc == STORE_EBUDGET, "three pages under a budget of two: %s", zc_error_name(rc));
	ck_assert_uint_eq(offset, 77);
	ck_assert_uint_eq(f.budget.used, used);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file);
	ck_assert_uint_eq(pool_blocks(f.pool), 1);
	/* Exactly the room left fits, and lands where the refused one would have. */
	ck_assert_uint_eq(write_pages(f.pool, &b, 2, 11), a.offset + PAGE);
	ck_assert_uint_eq(f.budget.used, f.budget.limit);
	assert_charge_exact(&f, f.pool);
	rc = pool_write(f.pool, k, 1, v, 1, &offset);
	ck_assert_int_eq(rc, STORE_EBUDGET);

	/* A parent budget refuses for its child, and neither is charged. */
	struct store_budget parent = { .limit = f.budget.used + PAGE };
	struct store_budget child = { .parent = &parent };
	pool_charge_to(f.pool, &child);
	ck_assert_uint_eq(f.budget.used, 0);
	ck_assert_uint_eq(child.used, pool_memory_bytes(f.pool));
	ck_assert_uint_eq(parent.used, child.used);
	used = child.used;
	rc = pool_write(f.pool, k, PAGE, v, 1, &offset);
	ck_assert_msg(rc == STORE_EBUDGET, "two pages under a parent with one left: %s",
		      zc_error_name(rc));
	ck_assert_uint_eq(child.used, used);
	ck_assert_uint_eq(parent.used, used);
	ck_assert_uint_eq(write_pages(f.pool, &c, 1, 12), b.offset + 2 * PAGE);
	ck_assert_uint_eq(parent.used, used + PAGE);
	ck_assert_uint_eq(child.used, parent.used);
	/* Freeing gives back to both. */
	pool_unref(f.pool, c.offset);
	pool_unref(f.pool, b.offset);
	ck_assert_uint_eq(child.used, 2 * PAGE);
	ck_assert_uint_eq(parent.used, 2 * PAGE);
	free(k);
	free(v);
	pool_unref(f.pool, a.offset);
	pool_close(f.pool);
	f.pool = NULL;
	ck_assert_uint_eq(parent.used, 0);
	ck_assert_uint_eq(child.used, 0);
	ck_assert_uint_eq(f.budget.used, 0);
	shm_dir_remove(&f.dir);
}
END_TEST

/* ---- adoption: claims and the sweep ------------------------------------------------ */

/* Writes n blocks of varied sizes and closes the pool without freeing any
 * (a daemon that stopped); returns the pool reopened. */
static struct pool *pool_restarted(struct fixture *f, struct blk *blocks, int n)
{
	for (int i = 0; i < n; i++)
		write_block(f->pool, &blocks[i], 700 + 1500 * (uint64_t)i, 3000 + 900 * (uint64_t)i,
			    100 + (uint32_t)i);
	pool_close(f->pool);
	ck_assert_uint_eq(f->budget.used, 0);
	bool existed = false;
	f->pool = fixture_open(f, UID, &existed);
	ck_assert(existed);
	/* What the file holds is charged, past any limit. */
	assert_charge_exact(f, f->pool);
	ck_assert_uint_eq(pool_blocks(f->pool), 0);
	return f->pool;
}

/* Claims overlapping at different offsets (a file someone else wrote):
 * both extents stay after the sweep and after their sessions let go, so
 * freeing one never punches the other's bytes. */
START_TEST(overlapping_claims_are_kept_for_good)
{
	struct fixture f;
	struct blk blocks[2];
	fixture_start(&f, "pool_overlap");
	struct pool *pool = pool_restarted(&f, blocks, 2);
	claim_ok(pool, &blocks[1]);
	/* A forged claim starting one page into block 1. */
	struct blk forged = { .key_bytes = 100, .value_bytes = 100, .offset = blocks[1].offset + PAGE };
	claim_ok(pool, &forged);
	pool_sweep(pool);
	pool_unref(pool, forged.offset);
	pool_unref(pool, blocks[1].offset);
	assert_block_intact(pool, &blocks[1]);
	ck_assert_uint_ge(pool_refs(pool, blocks[1].offset), 1);
	fixture_end(&f);
}
END_TEST

START_TEST(sweep_keeps_claims_and_frees_the_rest)
{
	struct fixture f;
	struct blk blocks[6];
	fixture_start(&f, "pool_sweep");
	struct pool *pool = pool_restarted(&f, blocks, 6);
	uint64_t extent[6];
	for (int i = 0; i < 6; i++)
		extent[i] = pool_extent_bytes(blocks[i].key_bytes, blocks[i].value_bytes);
	uint64_t file_before = pool_file_bytes(pool);

	/* Sessions claim 0, 2 and 4; 2 twice (a forked pair). */
	claim_ok(pool, &blocks[0]);
	claim_ok(pool, &blocks[2]);
	claim_ok(pool, &blocks[2]);
	claim_ok(pool, &blocks[4]);
	ck_assert_uint_eq(pool_refs(pool, blocks[0].offset), 1);
	ck_assert_uint_eq(pool_refs(pool, blocks[2].offset), 2);
	ck_assert_uint_eq(pool_refs(pool, blocks[4].offset), 1);
	ck_assert_uint_eq(pool_refs(pool, blocks[1].offset), 0);
	ck_assert_uint_eq(pool_shared_bytes(pool), extent[2]);
	ck_assert_uint_eq(pool_blocks(pool), 3);

	/* Before the sweep a new block goes above everything the file holds
	 * (block 5 is unclaimed, but a pending session may still name it). */
	struct blk fresh;
	ck_assert_uint_eq(write_pages(pool, &fresh, 1, 50), blocks[5].offset + extent[5]);
	/* And a reference dropped to zero frees nothing yet. */
	pool_unref(pool, blocks[4].offset);
	ck_assert_uint_eq(pool_refs(pool, blocks[4].offset), 0);
	ck_assert_uint_eq(pool_file_bytes(pool), file_before + PAGE);
	ck_assert(is_data(pool, blocks[4].offset, extent[4]));
	assert_charge_exact(&f, pool);

	pool_sweep(pool);
	/* Unclaimed 1, 3, 5 and the unreferenced 4 are holes now; the rest intact. */
	for (int i = 1; i < 6; i++)
		if (i != 2)
			ck_assert_msg(is_hole(pool, blocks[i].offset, extent[i]),
				      "block %d was not punched by the sweep", i);
	assert_block_intact(pool, &blocks[0]);
	assert_block_intact(pool, &blocks[2]);
	assert_block_intact(pool, &fresh);
	ck_assert_uint_eq(pool_file_bytes(pool), PAGE + extent[0] + extent[2] + PAGE);
	assert_charge_exact(&f, pool);
	ck_assert_uint_eq(pool_refs(pool, blocks[2].offset), 2);
	/* A second sweep changes nothing. */
	pool_sweep(pool);
	assert_block_intact(pool, &blocks[2]);
	ck_assert_uint_eq(pool_file_bytes(pool), PAGE + extent[0] + extent[2] + PAGE);

	/* After the sweep freed space is reused, first fit: block 1's place. */
	struct blk again;
	ck_assert_uint_eq(write_pages(pool, &again, 1, 51), blocks[1].offset);
	/* And an unref to zero frees at once. */
	pool_unref(pool, blocks[2].offset);
	pool_unref(pool, blocks[2].offset);
	ck_assert(is_hole(pool, blocks[2].offset, extent[2]));
	pool_unref(pool, blocks[0].offset);
	pool_unref(pool, fresh.offset);
	pool_unref(pool, again.offset);
	ck_assert_uint_eq(pool_file_bytes(pool), PAGE);
	assert_charge_exact(&f, pool);
	fixture_end(&f);
}
END_TEST

START_TEST(sweep_of_an_unclaimed_pool_frees_everything)
{
	struct fixture f;
	struct blk blocks[3];
	fixture_start(&f, "pool_sweep_all");
	struct pool *pool = pool_restarted(&f, blocks, 3);
	ck_assert_uint_gt(pool_file_bytes(pool), PAGE);
	pool_sweep(pool);
	ck_assert_uint_eq(pool_file_bytes(pool), PAGE);
	assert_charge_exact(&f, pool);
	struct blk a;
	ck_assert_uint_eq(write_pages(pool, &a, 1, 1), PAGE);
	pool_unref(pool, a.offset);
	fixture_end(&f);
}
END_TEST

START_TEST(claims_that_cannot_be_right_are_corrupt)
{
	struct fixture f;
	struct blk blocks[3];
	fixture_start(&f, "pool_claims");
	struct pool *pool = pool_restarted(&f, blocks, 3);
	const struct blk *a = &blocks[0], *c = &blocks[2];
	uint64_t a_value = pool_value_offset(a->offset, a->key_bytes);
	claim_ok(pool, a);
	uint64_t file = pool_file_bytes(pool), used = f.budget.used;

	/* Another size for an offset already claimed. */
	claim_refused(pool, a->offset, a->key_bytes + 1, pool_value_offset(a->offset, a->key_bytes + 1),
		      a->value_bytes, "another size");
	claim_refused(pool, a->offset, a->key_bytes, a_value, a->value_bytes - 1, "another size");
	/* Not where blocks can be. */
	claim_refused(pool, a->offset + 8, a->key_bytes, pool_value_offset(a->offset + 8, a->key_bytes),
		      a->value_bytes, "out of place");
	claim_refused(pool, 0, 16, pool_value_offset(0, 16), 16, "out of place");
	claim_refused(pool, POOL_CAPACITY_BYTES, 16, pool_value_offset(POOL_CAPACITY_BYTES, 16), 16,
		      "out of place");
	claim_refused(pool, POOL_CAPACITY_BYTES - PAGE, PAGE, POOL_CAPACITY_BYTES, 1, "out of place");
	/* V not where pool_value_offset puts it. */
	claim_refused(pool, c->offset, c->key_bytes, pool_value_offset(c->offset, c->key_bytes) + 64,
		      c->value_bytes, "out of place");
	claim_refused(pool, c->offset, c->key_bytes, c->offset, c->value_bytes, "out of place");
	/* An extent that is a hole: past everything written, and one that
	 * runs off the end of the last block into the hole after it. */
	uint64_t end = c->offset + pool_extent_bytes(c->key_bytes, c->value_bytes);
	claim_refused(pool, end + 16 * PAGE, 100, pool_value_offset(end + 16 * PAGE, 100), 100,
		      "not in the pool");
	claim_refused(pool, c->offset, c->key_bytes, pool_value_offset(c->offset, c->key_bytes),
		      c->value_bytes + 2 * PAGE, "not in the pool");

	/* None of it changed anything: a is claimed once, c not at all. */
	ck_assert_uint_eq(pool_refs(pool, a->offset), 1);
	ck_assert_uint_eq(pool_refs(pool, c->offset), 0);
	ck_assert_uint_eq(pool_blocks(pool), 1);
	ck_assert_uint_eq(pool_file_bytes(pool), file);
	ck_assert_uint_eq(f.budget.used, used);
	/* c is still claimable as it is. */
	claim_ok(pool, c);
	pool_sweep(pool);
	assert_block_intact(pool, a);
	assert_block_intact(pool, c);
	ck_assert(is_hole(pool, blocks[1].offset,
			  pool_extent_bytes(blocks[1].key_bytes, blocks[1].value_bytes)));
	/* A block the sweep freed is gone for a late claim. */
	claim_refused(pool, blocks[1].offset, blocks[1].key_bytes,
		      pool_value_offset(blocks[1].offset, blocks[1].key_bytes), blocks[1].value_bytes,
		      "not in the pool");
	pool_unref(pool, a->offset);
	pool_unref(pool, c->offset);
	fixture_end(&f);
}
END_TEST

/* ---- the daemon's pools -------------------------------------------------------------- */

START_TEST(pool_set_opens_one_pool_per_uid)
{
	struct fixture f;
	memset(&f, 0, sizeof(f));
	shm_dir_make(&f.dir, "pool_set");
	struct pool_set set;
	struct pool *p1 = NULL, *p2 = NULL, *again = NULL;
	bool existed = true;
	char reason[200];

	pool_set_init(&set, f.dir.fd, f.dir.path);
	ck_assert_int_eq(pool_set_get(&set, 1000, &f.budget, &p1, &existed, reason, sizeof(reason)),
			 0);
	ck_assert(!existed);
	ck_assert_uint_eq(pool_uid(p1), 1000);
	ck_assert_int_eq(pool_set_get(&set, 1000, &f.budget, &again, &existed, reason, sizeof(reason)),
			 0);
	ck_assert_ptr_eq(again, p1);
	ck_assert(!existed);   /* the file was not there before this set opened it */
	ck_assert_int_eq(pool_set_get(&set, 1001, &f.budget, &p2, NULL, reason, sizeof(reason)), 0);
	ck_assert_ptr_ne(p1, p2);
	ck_assert_uint_eq(set.n, 2);
	ck_assert(shm_dir_has(&f.dir, "pool-1000.zcp"));
	ck_assert(shm_dir_has(&f.dir, "pool-1001.zcp"));

	struct blk a, b, c;
	write_pages(p1, &a, 2, 1);
	write_pages(p2, &b, 1, 2);
	write_pages(p2, &c, 1, 3);
	pool_ref(p2, c.offset);
	ck_assert_uint_eq(pool_set_memory_bytes(&set), pool_memory_bytes(p1) + pool_memory_bytes(p2));
	ck_assert_uint_eq(pool_set_file_bytes(&set), 2 * PAGE + 2 * PAGE + 2 * PAGE);
	ck_assert_uint_eq(pool_set_shared_bytes(&set), PAGE);
	ck_assert_uint_eq(f.budget.used, pool_set_file_bytes(&set));
	pool_set_sync_charge(&set);
	ck_assert_uint_eq(f.budget.used, pool_set_file_bytes(&set));
	pool_set_free(&set);
	ck_assert_uint_eq(f.budget.used, 0);
	ck_assert_uint_eq(set.n, 0);

	/* A restart: the scan opens every pool file there (and nothing that
	 * only looks like one), each charged for what it holds. */
	int fd = openat(f.dir.fd, "pool-12.zcp.corrupt", O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);
	fd = openat(f.dir.fd, ".pool-13.zcp.tmp", O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);
	fd = openat(f.dir.fd, "pool-0014.zcp", O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);
	pool_set_init(&set, f.dir.fd, f.dir.path);
	pool_set_scan(&set, &f.budget);
	ck_assert_uint_eq(set.n, 2);
	ck_assert_uint_eq(f.budget.used, 6 * PAGE);
	ck_assert_int_eq(pool_set_get(&set, 1001, &f.budget, &p2, &existed, reason, sizeof(reason)), 0);
	ck_assert(existed);
	ck_assert_int_eq(pool_set_get(&set, 1000, &f.budget, &p1, &existed, reason, sizeof(reason)), 0);
	ck_assert(existed);
	ck_assert_uint_eq(set.n, 2);
	/* One session of uid 1001 claims c; the sweep frees every other block
	 * of every pool. */
	claim_ok(p2, &c);
	pool_set_sweep(&set);
	ck_assert_uint_eq(pool_file_bytes(p1), PAGE);
	ck_assert_uint_eq(pool_file_bytes(p2), 2 * PAGE);
	assert_block_intact(p2, &c);
	ck_assert_uint_eq(f.budget.used, pool_set_file_bytes(&set));
	/* The look-alikes were left alone. */
	ck_assert(shm_dir_has(&f.dir, "pool-12.zcp.corrupt"));
	ck_assert(shm_dir_has(&f.dir, ".pool-13.zcp.tmp"));
	ck_assert(shm_dir_has(&f.dir, "pool-0014.zcp"));
	ck_assert(!shm_dir_has(&f.dir, "pool-12.zcp"));
	pool_unref(p2, c.offset);
	pool_set_free(&set);
	ck_assert_uint_eq(f.budget.used, 0);
	shm_dir_remove(&f.dir);
}
END_TEST

/* Lists the directory to its end through a dup of its descriptor, as the
 * daemon's adoption scan does just before it scans for pools. */
static int directory_list(int dir_fd)
{
	DIR *dir = fdopendir(dup(dir_fd));
	ck_assert_ptr_nonnull(dir);
	int n = 0;
	while (readdir(dir) != NULL)
		n++;
	closedir(dir);
	return n;
}

START_TEST(pool_set_scan_after_the_directory_was_listed)
{
	struct fixture f;
	memset(&f, 0, sizeof(f));
	shm_dir_make(&f.dir, "pool_scan");
	struct pool_set set;
	struct pool *pool;
	char reason[200];
	struct blk a;

	pool_set_init(&set, f.dir.fd, f.dir.path);
	ck_assert_int_eq(pool_set_get(&set, 2000, &f.budget, &pool, NULL, reason, sizeof(reason)), 0);
	write_pages(pool, &a, 2, 1);
	pool_set_free(&set);

	/* The daemon lists the directory for sessions first (through a dup,
	 * which shares the descriptor's offset), then scans it for pools:
	 * the scan must still find every pool, or the sweep never frees
	 * the blocks of a pool none of whose sessions is left. */
	ck_assert_int_ge(directory_list(f.dir.fd), 3);
	pool_set_init(&set, f.dir.fd, f.dir.path);
	pool_set_scan(&set, &f.budget);
	ck_assert_msg(set.n == 1, "the scan after a listing opened %zu pools, not 1", set.n);
	ck_assert_uint_eq(f.budget.used, 3 * PAGE);
	pool_set_sweep(&set);
	ck_assert_uint_eq(pool_set_file_bytes(&set), PAGE);
	/* And a second scan finds it again (the set keeps one pool per uid). */
	pool_set_scan(&set, &f.budget);
	ck_assert_uint_eq(set.n, 1);
	pool_set_free(&set);
	ck_assert_uint_eq(f.budget.used, 0);
	shm_dir_remove(&f.dir);
}
END_TEST

/* Opening uid's pool fails as corrupt, says so, and changes nothing. */
static void assert_pool_corrupt(struct fixture *f, uint32_t uid, const char *what)
{
	char name[64];
	struct stat before, after;
	pool_file_name(name, sizeof(name), uid);
	ck_assert_int_eq(fstatat(f->dir.fd, name, &before, 0), 0);
	struct pool *pool = NULL;
	bool existed = false;
	uint64_t used = f->budget.used;
	f->reason[0] = '\0';
	int rc = pool_open(f->dir.fd, f->dir.path, uid, &f->budget, &pool, &existed, f->reason,
			   sizeof(f->reason));
	ck_assert_msg(rc == ZC_ECORRUPT, "%s: pool_open gave %s", what, zc_error_name(rc));
	ck_assert_msg(strstr(f->reason, "not a version") != NULL && strstr(f->reason, name) != NULL,
		      "%s: the reason \"%s\" does not say what is wrong with %s", what, f->reason, name);
	ck_assert_uint_eq(f->budget.used, used);
	/* Through the set as well, which keeps nothing of it. */
	struct pool_set set;
	pool_set_init(&set, f->dir.fd, f->dir.path);
	rc = pool_set_get(&set, uid, &f->budget, &pool, NULL, f->reason, sizeof(f->reason));
	ck_assert_int_eq(rc, ZC_ECORRUPT);
	ck_assert_uint_eq(set.n, 0);
	pool_set_scan(&set, &f->budget);
	ck_assert_uint_eq(set.n, 0);
	pool_set_free(&set);
	ck_assert_uint_eq(f->budget.used, used);
	/* The file itself is left as it was: setting aside is the caller's call. */
	ck_assert_int_eq(fstatat(f->dir.fd, name, &after, 0), 0);
	ck_assert_uint_eq(after.st_size, before.st_size);
	ck_assert_uint_eq(after.st_mode, before.st_mode);
	ck_assert_uint_eq(after.st_ino, before.st_ino);
}

/* A fresh, valid pool file of uid with one block in it. */
static void pool_file_fresh(struct fixture *f, uint32_t uid)
{
	char name[64];
	pool_file_name(name, sizeof(name), uid);
	unlinkat(f->dir.fd, name, 0);
	struct pool *pool = fixture_open(f, uid, NULL);
	struct blk b;
	write_pages(pool, &b, 1, uid);
	pool_close(pool);
}

START_TEST(a_file_that_is_not_a_pool_is_corrupt)
{
	struct fixture f;
	fixture_start(&f, "pool_corrupt");
	pool_close(f.pool);
	f.pool = NULL;
	/* Only the file under test in the directory: the scan must open none. */
	char first[64];
	pool_file_name(first, sizeof(first), UID);
	ck_assert_int_eq(unlinkat(f.dir.fd, first, 0), 0);
	const uint32_t uid = 77;
	char name[64], other[64];
	pool_file_name(name, sizeof(name), uid);
	zc_pool_header h;

	pool_file_fresh(&f, uid);
	file_patch(&f.dir, name, 0, "ZCPOOL99", 8);
	assert_pool_corrupt(&f, uid, "bad magic");

	pool_file_fresh(&f, uid);
	uint32_t version = ZC_POOL_VERSION + 1;
	file_patch(&f.dir, name, (off_t)offsetof(zc_pool_header, version), &version, sizeof(version));
	assert_pool_corrupt(&f, uid, "another version");

	pool_file_fresh(&f, uid);
	uint64_t data_offset = 2 * PAGE;
	file_patch(&f.dir, name, (off_t)offsetof(zc_pool_header, data_offset), &data_offset,
		   sizeof(data_offset));
	assert_pool_corrupt(&f, uid, "another data offset");

	pool_file_fresh(&f, uid);
	uint64_t capacity = POOL_CAPACITY_BYTES / 2;
	file_patch(&f.dir, name, (off_t)offsetof(zc_pool_header, capacity), &capacity,
		   sizeof(capacity));
	assert_pool_corrupt(&f, uid, "another capacity in the header");

	/* uid 78's file under uid 77's name. */
	pool_file_fresh(&f, uid + 1);
	pool_file_name(other, sizeof(other), uid + 1);
	ck_assert_int_eq(renameat(f.dir.fd, other, f.dir.fd, name), 0);
	assert_pool_corrupt(&f, uid, "another uid in the header");

	/* Cut short, grown, and shorter than a header. */
	pool_file_fresh(&f, uid);
	ck_assert_int_eq(fchmodat(f.dir.fd, name, 0600, 0), 0);
	int fd = openat(f.dir.fd, name, O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)(64 * PAGE)), 0);
	assert_pool_corrupt(&f, uid, "a pool cut short");
	ck_assert_int_eq(ftruncate(fd, (off_t)(POOL_CAPACITY_BYTES + PAGE)), 0);
	assert_pool_corrupt(&f, uid, "a pool grown");
	ck_assert_int_eq(ftruncate(fd, (off_t)(sizeof(h) - 1)), 0);
	assert_pool_corrupt(&f, uid, "a file shorter than a pool header");
	ck_assert_int_eq(ftruncate(fd, 0), 0);
	assert_pool_corrupt(&f, uid, "an empty file");
	close(fd);

	/* Made whole again, it opens. */
	pool_file_fresh(&f, uid);
	bool existed = false;
	f.pool = fixture_open(&f, uid, &existed);
	ck_assert(existed);
	ck_assert_uint_eq(pool_file_bytes(f.pool), 2 * PAGE);
	pool_sweep(f.pool);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	fixture_end(&f);
}
END_TEST

/* Kept extents (retain.h): a freed block's pages stay (all but its
 * punched first page, the commit point), under the bound, and the next
 * block of a fitting size goes into them with its bytes exact; a claim of
 * a kept extent is refused; release punches them; after a "crash" (the
 * pool reopened without closing) the sweep frees them: nothing leaks. */
START_TEST(kept_extents_are_reused_counted_and_swept)
{
	struct fixture f;
	enum { BYTES = 16 * PAGE };
	static uint8_t key[BYTES], value[BYTES], back[BYTES];
	uint64_t a, b, c;
	fixture_start(&f, "kept");
	retain_set_limit(4 * BYTES);
	for (size_t i = 0; i < BYTES; i++) {
		key[i] = (uint8_t)(i * 7 + 1);
		value[i] = (uint8_t)(i * 13 + 5);
	}
	ck_assert_int_eq(pool_write(f.pool, key, BYTES - 64, value, BYTES, &a), 0);
	uint64_t extent = pool_extent_bytes(BYTES - 64, BYTES);
	uint64_t file = pool_file_bytes(f.pool);
	pool_unref(f.pool, a);
	/* Kept: one page fewer in the file, the rest counted and charged. */
	ck_assert_uint_eq(pool_kept_bytes(f.pool), extent - PAGE);
	ck_assert_uint_eq(retain_held_bytes(), extent - PAGE);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file - PAGE);
	ck_assert_uint_eq(f.budget.used, pool_file_bytes(f.pool));
	/* The commit point: a session naming the kept extent is not adopted. */
	ck_assert_int_eq(pool_claim(f.pool, a, BYTES - 64, pool_value_offset(a, BYTES - 64), BYTES,
				    f.reason, sizeof(f.reason)), ZC_ECORRUPT);
	/* Reused, bytes exact. */
	uint64_t reuses = retain_extent_reuses();
	memset(key, 0xA5, 100);
	ck_assert_int_eq(pool_write(f.pool, key, BYTES - 64, value, BYTES, &b), 0);
	ck_assert_uint_eq(b, a);
	ck_assert_uint_eq(retain_extent_reuses(), reuses + 1);
	ck_assert_uint_eq(pool_kept_bytes(f.pool), 0);
	ck_assert_uint_eq(retain_held_bytes(), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file);
	ck_assert_int_eq(pool_read(f.pool, b, back, BYTES - 64), 0);
	ck_assert_mem_eq(back, key, BYTES - 64);
	ck_assert_int_eq(pool_read(f.pool, pool_value_offset(b, BYTES - 64), back, BYTES), 0);
	ck_assert_mem_eq(back, value, BYTES);
	/* The bound holds: of three freed extents, two fit under it. */
	ck_assert_int_eq(pool_write(f.pool, key, BYTES, value, BYTES, &c), 0);
	uint64_t d;
	ck_assert_int_eq(pool_write(f.pool, key, BYTES, value, BYTES, &d), 0);
	uint64_t big = pool_extent_bytes(BYTES, BYTES);
	pool_unref(f.pool, b);
	pool_unref(f.pool, c);
	pool_unref(f.pool, d);
	ck_assert_uint_le(retain_held_bytes(), 4 * BYTES);
	ck_assert_uint_eq(pool_kept_bytes(f.pool), extent - PAGE + big - PAGE);
	ck_assert_uint_eq(f.budget.used, pool_file_bytes(f.pool));
	/* Release punches them whole. */
	ck_assert_uint_gt(pool_release_kept(f.pool, UINT64_MAX), 0);
	ck_assert_uint_eq(pool_kept_bytes(f.pool), 0);
	ck_assert_uint_eq(retain_held_bytes(), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), PAGE);
	/* Kept again, then the daemon dies: the next one's sweep frees them. */
	ck_assert_int_eq(pool_write(f.pool, key, BYTES, value, BYTES, &c), 0);
	pool_unref(f.pool, c);
	ck_assert_uint_gt(pool_kept_bytes(f.pool), 0);
	struct store_budget other = { 0 };
	struct pool *next = NULL;
	bool existed = false;
	ck_assert_int_eq(pool_open(f.dir.fd, f.dir.path, UID, &other, &next, &existed, f.reason,
				   sizeof(f.reason)), 0);
	ck_assert(existed);
	pool_sweep(next);
	ck_assert_uint_eq(pool_file_bytes(next), PAGE);
	pool_close(next);
	ck_assert_uint_eq(other.used, 0);
	fixture_end(&f);
	ck_assert_uint_eq(retain_held_bytes(), 0);
	retain_set_limit(0);
}
END_TEST

/* Neighbouring kept extents (a closed session's blocks, one after the
 * other) take a block larger than any one of them: it lands at the first,
 * runs across the others' punched pages (charged again, each once), reads
 * back exact, and what is left of the run stays kept and counted. */
START_TEST(neighbouring_kept_extents_take_a_larger_block)
{
	struct fixture f;
	enum { SMALL = 4 * PAGE, LARGE = 10 * PAGE };
	static uint8_t key[LARGE], value[LARGE], back[LARGE];
	uint64_t at[4], big;
	fixture_start(&f, "kept-run");
	retain_set_limit(64 * PAGE);
	for (size_t i = 0; i < LARGE; i++) {
		key[i] = (uint8_t)(i * 11 + 3);
		value[i] = (uint8_t)(i * 5 + 9);
	}
	/* Four extents of 4 pages each (2 of key, 2 of value), side by side. */
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(pool_write(f.pool, key, SMALL / 2, value, SMALL / 2, &at[i]), 0);
	for (int i = 1; i < 4; i++)
		ck_assert_uint_eq(at[i], at[i - 1] + SMALL);
	uint64_t file = pool_file_bytes(f.pool);
	/* Freed out of order: the list is by position, not by age. */
	pool_unref(f.pool, at[2]);
	pool_unref(f.pool, at[0]);
	pool_unref(f.pool, at[3]);
	pool_unref(f.pool, at[1]);
	ck_assert_uint_eq(pool_kept_bytes(f.pool), 4 * (SMALL - PAGE));
	ck_assert_uint_eq(f.budget.used, pool_file_bytes(f.pool));
	uint64_t reuses = retain_extent_reuses();
	/* 10 pages: three of the kept extents, the third only in part. */
	ck_assert_uint_eq(pool_extent_bytes(LARGE / 2, LARGE / 2), LARGE);
	ck_assert_int_eq(pool_write(f.pool, key, LARGE / 2, value, LARGE / 2, &big), 0);
	ck_assert_uint_eq(big, at[0]);
	ck_assert_uint_eq(retain_extent_reuses(), reuses + 1);
	/* Left kept: the last 2 pages of the third and all of the fourth but
	 * its punched page. */
	ck_assert_uint_eq(pool_kept_bytes(f.pool), 2 * PAGE + SMALL - PAGE);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file - PAGE);
	ck_assert_uint_eq(f.budget.used, pool_file_bytes(f.pool));
	ck_assert_int_eq(pool_read(f.pool, big, back, LARGE / 2), 0);
	ck_assert_mem_eq(back, key, LARGE / 2);
	ck_assert_int_eq(pool_read(f.pool, pool_value_offset(big, LARGE / 2), back, LARGE / 2), 0);
	ck_assert_mem_eq(back, value, LARGE / 2);
	/* The rest of the run takes a block of its size (2 + 4 pages). */
	uint64_t rest;
	ck_assert_int_eq(pool_write(f.pool, key, 2 * PAGE, value, 4 * PAGE, &rest), 0);
	ck_assert_uint_eq(rest, at[2] + 2 * PAGE);
	ck_assert_uint_eq(pool_kept_bytes(f.pool), 0);
	ck_assert_uint_eq(retain_held_bytes(), 0);
	ck_assert_uint_eq(pool_file_bytes(f.pool), file);
	ck_assert_uint_eq(f.budget.used, pool_file_bytes(f.pool));
	pool_unref(f.pool, big);
	pool_unref(f.pool, rest);
	fixture_end(&f);
	retain_set_limit(0);
}
END_TEST

static Suite *pool_suite(void)
{
	Suite *suite = suite_create("pool");
	const struct test_case cases[] = {
		{ "blocks", { write_read_round_trip, last_reference_punches_and_gives_back,
			      blocks_written_in_place_through_windows, NULL } },
		{ "free_space", { freed_space_is_reused_first_fit, neighbours_coalesce, NULL } },
		{ "refusals", { capacity_exhausted_takes_nothing, budget_refuses_without_taking, NULL } },
		{ "adoption", { sweep_keeps_claims_and_frees_the_rest, overlapping_claims_are_kept_for_good,
				sweep_of_an_unclaimed_pool_frees_everything,
				claims_that_cannot_be_right_are_corrupt, NULL } },
		{ "files", { pool_set_opens_one_pool_per_uid, pool_set_scan_after_the_directory_was_listed,
			     a_file_that_is_not_a_pool_is_corrupt,
			     NULL } },
		{ "kept", { kept_extents_are_reused_counted_and_swept,
			    neighbouring_kept_extents_take_a_larger_block, NULL } },
	};
	suite_add_cases(suite, cases, sizeof(cases) / sizeof(cases[0]), TEST_TIMEOUT_SECONDS);
	return suite;
}

int main(void)
{
	return suite_main(pool_suite(), CK_FORK_GETENV);
}
