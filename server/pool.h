/*
 * A uid's pool of immutable compressed blocks: one sparse file in the
 * shm-dir (pool-UID.zcp, layout in zipcache/map.h), shared by every
 * session of that uid. A block is written once into a page-aligned extent
 * of its own and never changes; sessions refer to it by offset, and it is
 * freed (its pages punched, or kept for the next block: pool.c) when the
 * last reference goes.
 *
 * Nothing about references is durable here: the session files are the
 * truth. After a restart each adopted session claims the extents it
 * names, and pool_sweep() frees every other one (a block written by a
 * mutation that never committed). Until then new blocks go above every
 * byte the file holds, so nothing a pending session may claim is reused.
 *
 * The daemon never maps the pool: it writes and reads it with pwrite and
 * pread, so a client that found a way to truncate the file (its mapping's
 * descriptor, reopened by a same-uid process) cannot crash the daemon.
 * Thread-safe: jobs of different sessions of one uid run concurrently.
 */
#ifndef ZIPCACHE_POOL_H
#define ZIPCACHE_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "budget.h"

/* The pool file's size: sparse, never mapped by the daemon; clients map
 * it whole, read-only (address space only). */
#define POOL_CAPACITY_BYTES (UINT64_C(1) << 40)

/* A block's V payload starts this aligned after its K payload (fp16
 * params and exact values are read as 16-bit words). */
#define POOL_PAYLOAD_ALIGN 64u

struct pool;

/* Opens the uid's pool in dir_fd, creating it when missing (*existed says
 * which). ZC_ECORRUPT with a reason when the file found is not a pool. */
int pool_open(int dir_fd, const char *dir_path, uint32_t uid, struct store_budget *budget,
	      struct pool **out, bool *existed, char *reason, size_t reason_size);
void pool_close(struct pool *pool);

uint32_t pool_uid(const struct pool *pool);
/* Moves the pool's charge to another budget (the uid's quota). */
void pool_charge_to(struct pool *pool, struct store_budget *budget);

/* Where a block of these payload sizes sits relative to its extent. */
uint64_t pool_value_offset(uint64_t key_offset, uint64_t key_bytes);
uint64_t pool_extent_bytes(uint64_t key_bytes, uint64_t value_bytes);

/*
 * Writes a new block (K payload, then V at pool_value_offset) into a
 * fresh extent holding one reference, which the caller owns: it drops it
 * with pool_unref unless a commit made a session refer to the block.
 * STORE_EBUDGET, ZC_EEXHAUSTED (pool full), -ENOSPC and other errnos.
 */
int pool_write(struct pool *pool, const void *key, uint64_t key_bytes, const void *value,
	       uint64_t value_bytes, uint64_t *key_offset);

/*
 * pool_write in two steps, for a caller that streams a block in pieces
 * (an import, chunk by chunk as it is verified): pool_reserve takes the
 * budget and the pages of a fresh extent holding one reference, as
 * pool_write does, without writing it; pool_write_at writes bytes into
 * an extent the caller owns (K at *key_offset, V at pool_value_offset).
 * The caller reaches the "pool.write" fault step once the block is whole,
 * and drops the reference with pool_unref unless a commit named it.
 */
int pool_reserve(struct pool *pool, uint64_t key_bytes, uint64_t value_bytes,
		 uint64_t *key_offset);
int pool_write_at(struct pool *pool, uint64_t offset, const void *bytes, uint64_t n);

/*
 * How new blocks get into the pool file (--pool-writes). MAP: the codec
 * writes them in place through a mapping of their extent (pool_extent_map),
 * which saves the kernel's copy and its per-page locking, but costs page
 * table work per page: cheap on bare metal and ordinary VMs (a warm prefill
 * on the Xeon host 0.31 -> 0.36 of memcpy), three times the copy on a
 * paravirtualized guest that syncs its page tables on every change. COPY:
 * pwrite from scratch (pool_write_at). AUTO: MAP, unless a probe at start
 * (pool_writes_probe) finds page-table work so dear that MAP is sure to
 * lose.
 */
enum pool_writes { POOL_WRITES_AUTO, POOL_WRITES_MAP, POOL_WRITES_COPY };

int pool_writes_parse(const char *text, enum pool_writes *out);
const char *pool_writes_name(enum pool_writes mode);
/* MAP or COPY for this machine: a 1 MiB block written into a fresh shmem
 * file both ways (the median of five tries each; *map_us and *copy_us).
 * Alone, MAP is slower even where it wins in place of the copy a block
 * write really is (on the Xeon host the probe takes 1.9 times the copy's
 * time, and a prefill is 10-25 % faster mapped); on the paravirtualized
 * VM, 18 times, and a prefill three times slower. So MAP up to
 * POOL_WRITES_MAP_TOLERANCE times the copy. COPY when the probe cannot run. */
enum pool_writes pool_writes_probe(double *map_us, double *copy_us);
/* MAP or COPY, from now on, for every pool (before serving). */
void pool_writes_set(enum pool_writes mode);

/*
 * A writable mapping of bytes at offset of an extent the caller owns, so
 * that a block is written in place (the codec's output buffer) instead of
 * through pool_write_at's copy. NULL when it cannot be made, or the pool
 * writes by COPY: the caller then writes with pool_write_at. An extent
 * within one window of POOL_WINDOW_BYTES (pool.c says why) is written
 * through the window, which stays mapped until the pool closes
 * (mapping->base stays NULL); one across two windows gets a mapping of
 * its own, populated. Either way the caller calls pool_extent_unmap
 * before the block is committed or dropped.
 */
#define POOL_WINDOW_BYTES (UINT64_C(64) << 20)

struct pool_mapping {
	void *base;
	size_t length;
};
uint8_t *pool_extent_map(struct pool *pool, uint64_t offset, uint64_t bytes,
			 struct pool_mapping *mapping);
void pool_extent_unmap(struct pool_mapping *mapping);

/* Reads bytes at offset (a block's payload); ZC_ECORRUPT when the file
 * no longer holds them. */
int pool_read(struct pool *pool, uint64_t offset, void *out, uint64_t bytes);

/* One more reference to a live block (a fork shares it). */
void pool_ref(struct pool *pool, uint64_t key_offset);
/* One reference fewer; the last frees the extent. */
void pool_unref(struct pool *pool, uint64_t key_offset);
/* References to the block at key_offset (0: none). */
uint32_t pool_refs(struct pool *pool, uint64_t key_offset);

/* Adoption: a session names a block. ZC_ECORRUPT (with reason) when it is
 * out of range, disagrees with a claim already made, or its bytes are not
 * in the file. */
int pool_claim(struct pool *pool, uint64_t key_offset, uint64_t key_bytes, uint64_t value_offset,
	       uint64_t value_bytes, char *reason, size_t reason_size);
/* Frees every extent no session claimed; afterwards freed space is
 * reused. Call once no adopted session is pending. */
void pool_sweep(struct pool *pool);

/* A fresh read-only descriptor for a client (caller closes). */
int pool_open_readonly(const struct pool *pool);

/* Memory the pool holds (charged), and the part of it in blocks that
 * more than one session refers to. */
uint64_t pool_memory_bytes(const struct pool *pool);
uint64_t pool_shared_bytes(const struct pool *pool);
/* What the file really holds (fstat's blocks): what the charge must match. */
uint64_t pool_file_bytes(const struct pool *pool);
uint64_t pool_blocks(const struct pool *pool);
/* Kept extents (pool.c, server/retain.h): the pages they hold (part of
 * pool_memory_bytes), and the bytes of new blocks written into them. */
uint64_t pool_kept_bytes(const struct pool *pool);
uint64_t pool_reused_bytes(const struct pool *pool);
/* Punches kept extents, oldest first, until about `wanted` bytes came
 * back; returns the bytes freed. */
uint64_t pool_release_kept(struct pool *pool, uint64_t wanted);
/* Charges pages a client's read faults allocated; returns the growth. */
uint64_t pool_sync_charge(struct pool *pool);

/* The daemon's pools, one per uid, opened on first use. */
struct pool_set {
	struct pool **items;
	size_t n, capacity;
	int dir_fd;               /* borrowed */
	const char *dir_path;
};

void pool_set_init(struct pool_set *set, int dir_fd, const char *dir_path);
/* The uid's pool, opened (or created) on first use and charged to budget
 * then; *existed (may be NULL) says whether its file was there before
 * this daemon opened it. */
int pool_set_get(struct pool_set *set, uint32_t uid, struct store_budget *budget,
		 struct pool **out, bool *existed, char *reason, size_t reason_size);
/*
 * pool_set_get for an import (docs/SNAPSHOT.md): a pool whose file it
 * had to make is provisional until any other pool_set_get asks for the
 * uid's pool. pool_set_drop_provisional, after the import failed, removes
 * such a pool (its file, its kept pages) if it still is provisional and
 * holds no block, so a refused import leaves no pool file behind; any
 * other pool it leaves alone. Both on the loop, as pool_set_get.
 */
int pool_set_get_provisional(struct pool_set *set, uint32_t uid, struct store_budget *budget,
			     struct pool **out, char *reason, size_t reason_size);
void pool_set_drop_provisional(struct pool_set *set, struct pool *pool);
/* Opens every pool file in the directory (so that the sweep frees the
 * blocks of pools no session refers to). */
void pool_set_scan(struct pool_set *set, struct store_budget *budget);
void pool_set_sweep(struct pool_set *set);
void pool_set_sync_charge(struct pool_set *set);
void pool_set_free(struct pool_set *set);
/* Sums over every pool. */
uint64_t pool_set_memory_bytes(const struct pool_set *set);
uint64_t pool_set_shared_bytes(const struct pool_set *set);
/* Kept pages of every pool (all) or of uid's, and their release. */
uint64_t pool_set_kept_bytes(const struct pool_set *set, bool all, uint32_t uid);
uint64_t pool_set_release_kept(struct pool_set *set, bool all, uint32_t uid, uint64_t wanted);
uint64_t pool_set_file_bytes(const struct pool_set *set);

#endif
