/*
 * A uid's block pool (pool.h): extents in a sparse file, a reference
 * count per extent, first-fit reuse of freed space.
 *
 * Kept extents (server/retain.h): a freed extent's pages may be kept,
 * up to --retain-bytes over the daemon, so that a new block written into
 * them does not wait for the kernel to zero fresh pages. Freeing one
 * takes two steps:
 *
 *   1. its first page is punched ("pool.retain"): the commit point. From
 *      then on the extent is free as far as any later daemon can tell: a
 *      session file naming it would fail adoption's claim check (every
 *      page of a live extent holds bytes: a hole means the block is gone),
 *      exactly as a fully punched extent does.
 *   2. it goes on the kept list, its other pages still charged to the
 *      pool's budget and counted in retain.h's bound.
 *
 * The pool has no durable record of kept extents and needs none: a new
 * daemon's sweep punches every byte no adopted session claims, kept
 * extents included, so a crash at any step leaks nothing. Reuse
 * ("pool.reuse") takes the front of a kept extent for a new block (or of
 * a run of neighbouring ones, for a block larger than each), whose
 * fallocate then refills the punched pages: the block is a fresh extent
 * like any other until a commit names it. Memory relief, a tmpfs that is
 * full (ENOSPC) and the bound release kept extents by punching them
 * whole, after which they are ordinary free space.
 */
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fault.h"
#include "fd_write.h"
#include "retain.h"
#include "log.h"
#include "pages.h"
#include "zipcache/map.h"

#define POOL_DATA_OFFSET PAGE_BYTES

/*
 * Blocks written in place (pool_extent_map) go through windows on the
 * file (POOL_WINDOW_BYTES each), each mapped the first time a block lands
 * in it and kept until the pool closes. A block written into pages the
 * window still maps (a kept extent's, or space freed and taken again)
 * costs no page-table work at all; a mapping per block paid an mmap, a
 * populate and a munmap with its TLB shootdown every time: about 0.5 ms
 * per 4.5 MiB prefill layer on the Xeon host, on the layer's critical
 * path. Fresh pages are not populated ahead: the codec threads fault them
 * in, each its own heads', in parallel. Address space: the file's used
 * size, rounded up to a window.
 */

struct extent {
	uint64_t offset;          /* 0: empty slot (no extent starts at 0) */
	uint64_t bytes;           /* page-rounded */
	uint64_t key_bytes, value_bytes;
	uint32_t refs;
};

struct span {
	uint64_t start, bytes;
};

/* A freed extent whose pages are kept: every page but, when head_hole,
 * the first (punched when it was freed). */
struct kept {
	uint64_t start, bytes;
	bool head_hole;
};

struct pool {
	pthread_mutex_t lock;
	struct store_budget *budget;
	uint64_t charged;
	uint32_t uid;
	int fd;
	char path[4096];
	/* Live extents, open addressing with linear probing. */
	struct extent *slots;
	size_t capacity, count;
	uint64_t shared_bytes;    /* extents with refs > 1 */
	/* Free space below top, sorted by start, coalesced. */
	struct span *free;
	size_t n_free, free_capacity;
	uint64_t top;             /* nothing at or above it */
	/* Kept extents (below top, not in `free`), sorted by start: a closed
	 * session's blocks, written one after another, lie side by side, and
	 * such a run takes a block larger than any one of them. */
	struct kept *kept;
	size_t n_kept, kept_capacity;
	uint64_t kept_bytes;      /* their pages (atomic reads) */
	uint64_t reused_bytes;    /* new blocks written into kept pages */
	/* Writable windows on the file (pool_extent_map), made on first use,
	 * unmapped at close; the array grows under the lock. */
	uint8_t **windows;
	size_t n_windows;
	bool swept;
	bool existed;             /* its file was there when this daemon opened it */
	bool provisional;         /* made for an import no one else has asked for yet */
};

uint64_t pool_value_offset(uint64_t key_offset, uint64_t key_bytes)
{
	return key_offset + round_up(key_bytes, POOL_PAYLOAD_ALIGN);
}

uint64_t pool_extent_bytes(uint64_t key_bytes, uint64_t value_bytes)
{
	return round_up(round_up(key_bytes, POOL_PAYLOAD_ALIGN) + value_bytes, PAGE_BYTES);
}

static uint64_t fd_allocated(int fd)
{
	struct stat st;
	return fstat(fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
}

/* ---- the extent table ------------------------------------------------------ */

static size_t slot_of(const struct pool *pool, uint64_t offset)
{
	uint64_t h = (offset / PAGE_BYTES) * UINT64_C(0x9E3779B97F4A7C15);
	return (size_t)(h >> 20) & (pool->capacity - 1);
}

static struct extent *extent_find(const struct pool *pool, uint64_t offset)
{
	if (pool->capacity == 0)
		return NULL;
	for (size_t i = slot_of(pool, offset);; i = (i + 1) & (pool->capacity - 1)) {
		if (pool->slots[i].offset == offset)
			return &pool->slots[i];
		if (pool->slots[i].offset == 0)
			return NULL;
	}
}

static int extent_table_grow(struct pool *pool)
{
	size_t capacity = pool->capacity ? pool->capacity * 2 : 256;
	struct extent *slots = calloc(capacity, sizeof(*slots));
	if (!slots)
		return -ENOMEM;
	struct extent *old = pool->slots;
	size_t old_capacity = pool->capacity;
	pool->slots = slots;
	pool->capacity = capacity;
	for (size_t i = 0; i < old_capacity; i++) {
		if (old[i].offset == 0)
			continue;
		size_t j = slot_of(pool, old[i].offset);
		while (slots[j].offset != 0)
			j = (j + 1) & (capacity - 1);
		slots[j] = old[i];
	}
	free(old);
	return 0;
}

static int extent_insert(struct pool *pool, const struct extent *e)
{
	if ((pool->count + 1) * 4 > pool->capacity * 3) {
		int rc = extent_table_grow(pool);
		if (rc < 0)
			return rc;
	}
	size_t i = slot_of(pool, e->offset);
	while (pool->slots[i].offset != 0)
		i = (i + 1) & (pool->capacity - 1);
	pool->slots[i] = *e;
	pool->count++;
	return 0;
}

/* Backward-shift deletion keeps every probe chain unbroken. */
static void extent_remove(struct pool *pool, struct extent *e)
{
	size_t mask = pool->capacity - 1;
	size_t hole = (size_t)(e - pool->slots);
	for (size_t i = (hole + 1) & mask; pool->slots[i].offset != 0; i = (i + 1) & mask) {
		size_t home = slot_of(pool, pool->slots[i].offset);
		/* Moves back only entries whose home is not in (hole, i]. */
		bool between = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
		if (!between) {
			pool->slots[hole] = pool->slots[i];
			hole = i;
		}
	}
	pool->slots[hole].offset = 0;
	pool->count--;
}

/* ---- free space ----------------------------------------------------------- */

static int free_insert(struct pool *pool, uint64_t start, uint64_t bytes)
{
	if (start + bytes == pool->top) {
		pool->top = start;
		/* The span below may now end at top too. */
		if (pool->n_free > 0) {
			struct span *last = &pool->free[pool->n_free - 1];
			if (last->start + last->bytes == pool->top) {
				pool->top = last->start;
				pool->n_free--;
			}
		}
		return 0;
	}
	size_t at = 0;
	while (at < pool->n_free && pool->free[at].start < start)
		at++;
	bool joins_before = at > 0 && pool->free[at - 1].start + pool->free[at - 1].bytes == start;
	bool joins_after = at < pool->n_free && start + bytes == pool->free[at].start;
	if (joins_before && joins_after) {
		pool->free[at - 1].bytes += bytes + pool->free[at].bytes;
		memmove(&pool->free[at], &pool->free[at + 1],
			(pool->n_free - at - 1) * sizeof(pool->free[0]));
		pool->n_free--;
		return 0;
	}
	if (joins_before) {
		pool->free[at - 1].bytes += bytes;
		return 0;
	}
	if (joins_after) {
		pool->free[at].start = start;
		pool->free[at].bytes += bytes;
		return 0;
	}
	if (pool->n_free == pool->free_capacity) {
		size_t capacity = pool->free_capacity ? pool->free_capacity * 2 : 64;
		struct span *spans = realloc(pool->free, capacity * sizeof(*spans));
		if (!spans)
			return -ENOMEM;   /* the space is lost until the next sweep */
		pool->free = spans;
		pool->free_capacity = capacity;
	}
	memmove(&pool->free[at + 1], &pool->free[at], (pool->n_free - at) * sizeof(pool->free[0]));
	pool->free[at] = (struct span){ start, bytes };
	pool->n_free++;
	return 0;
}

/* First fit below top, else at top. */
static int space_take(struct pool *pool, uint64_t bytes, uint64_t *start)
{
	for (size_t i = 0; i < pool->n_free; i++) {
		struct span *s = &pool->free[i];
		if (s->bytes < bytes)
			continue;
		*start = s->start;
		s->start += bytes;
		s->bytes -= bytes;
		if (s->bytes == 0) {
			memmove(s, s + 1, (pool->n_free - i - 1) * sizeof(*s));
			pool->n_free--;
		}
		return 0;
	}
	if (pool->top + bytes > POOL_CAPACITY_BYTES || pool->top + bytes < pool->top)
		return ZC_EEXHAUSTED;
	*start = pool->top;
	pool->top += bytes;
	return 0;
}

/* ---- memory --------------------------------------------------------------- */

/* Growth nobody reserved is a reader's faults in free space. */
static uint64_t charge_sync_locked(struct pool *pool)
{
	uint64_t allocated = fd_allocated(pool->fd);
	if (allocated <= pool->charged)
		return 0;
	uint64_t grown = allocated - pool->charged;
	store_budget_force(pool->budget, grown);
	pool->charged = allocated;
	return grown;
}

/* Punches a range and gives what the file released back to the budget. */
static uint64_t punch_locked(struct pool *pool, uint64_t start, uint64_t bytes)
{
	uint64_t before = fd_allocated(pool->fd);
	if (fallocate(pool->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)start,
		      (off_t)bytes) < 0)
		log_warn("pool", "cannot punch a freed block", "path=%s offset=%llu error=%s",
			 pool->path, (unsigned long long)start, strerror(errno));
	uint64_t after = fd_allocated(pool->fd);
	uint64_t released = before > after ? before - after : 0;
	if (released > pool->charged)
		released = pool->charged;
	pool->charged -= released;
	store_budget_give(pool->budget, released);
	return released;
}

/* The pages a kept extent holds. */
static uint64_t kept_pages(const struct kept *k)
{
	return k->bytes - (k->head_hole ? PAGE_BYTES : 0);
}

/* Where a kept extent starting at `start` goes in the sorted list. */
static size_t kept_position(const struct pool *pool, uint64_t start)
{
	size_t low = 0, high = pool->n_kept;
	while (low < high) {
		size_t mid = low + (high - low) / 2;
		if (pool->kept[mid].start < start)
			low = mid + 1;
		else
			high = mid;
	}
	return low;
}

/* Frees an extent keeping its pages (the file comment's steps 1 and 2),
 * or returns false when the bound or memory says no. */
static bool extent_keep(struct pool *pool, uint64_t start, uint64_t bytes)
{
	if (bytes <= PAGE_BYTES || !retain_take(bytes - PAGE_BYTES))
		return false;
	if (pool->n_kept == pool->kept_capacity) {
		size_t capacity = pool->kept_capacity ? pool->kept_capacity * 2 : 16;
		struct kept *kept = realloc(pool->kept, capacity * sizeof(*kept));
		if (!kept) {
			retain_give(bytes - PAGE_BYTES);
			return false;
		}
		pool->kept = kept;
		pool->kept_capacity = capacity;
	}
	/* The commit point: with its first page a hole, no session file can
	 * name this extent and be adopted. */
	punch_locked(pool, start, PAGE_BYTES);
	fault_point("pool.retain");
	size_t at = kept_position(pool, start);
	memmove(pool->kept + at + 1, pool->kept + at, (pool->n_kept - at) * sizeof(*pool->kept));
	pool->kept[at] = (struct kept){ start, bytes, true };
	pool->n_kept++;
	__atomic_store_n(&pool->kept_bytes, pool->kept_bytes + bytes - PAGE_BYTES, __ATOMIC_RELAXED);
	return true;
}

/* Punches kept extents, lowest first, until about `wanted` bytes came
 * back; they become ordinary free space. Returns the bytes freed. */
static uint64_t kept_release_locked(struct pool *pool, uint64_t wanted)
{
	uint64_t freed = 0;
	size_t i = 0;
	for (; i < pool->n_kept && freed < wanted; i++) {
		struct kept *k = &pool->kept[i];
		uint64_t pages = kept_pages(k);
		freed += punch_locked(pool, k->start, k->bytes);
		retain_give(pages);
		__atomic_store_n(&pool->kept_bytes, pool->kept_bytes - pages, __ATOMIC_RELAXED);
		free_insert(pool, k->start, k->bytes);
	}
	if (i > 0)   /* kept is NULL while nothing was ever kept */
		memmove(pool->kept, pool->kept + i, (pool->n_kept - i) * sizeof(*pool->kept));
	pool->n_kept -= i;
	return freed;
}

/* Whether kept extent i+1 starts where i ends. */
static bool kept_adjacent(const struct pool *pool, size_t i)
{
	return i + 1 < pool->n_kept &&
	       pool->kept[i].start + pool->kept[i].bytes == pool->kept[i + 1].start;
}

/* Where `bytes` can go into kept pages: the smallest kept extent that
 * holds it, else the first run of neighbours that does (its first
 * extent's index), or -1. */
static ssize_t kept_find(const struct pool *pool, uint64_t bytes)
{
	ssize_t best = -1, run = -1;
	for (size_t i = 0; i < pool->n_kept; i++)
		if (pool->kept[i].bytes >= bytes &&
		    (best < 0 || pool->kept[i].bytes < pool->kept[best].bytes))
			best = (ssize_t)i;
	if (best >= 0)
		return best;
	for (size_t i = 0; i < pool->n_kept && run < 0;) {
		size_t first = i;
		uint64_t total = pool->kept[i].bytes;
		while (total < bytes && kept_adjacent(pool, i))
			total += pool->kept[++i].bytes;
		if (total >= bytes)
			run = (ssize_t)first;
		i++;   /* past the run: a later start in it holds less */
	}
	return run;
}

/* Punched pages a block's fallocate refills one by one; past this many,
 * one fallocate over the whole block. */
#define KEPT_HOLES_MAX 8u

/* What `bytes` taken from kept extent i onwards lacks: the punched first
 * pages of the extents it reaches (every other page is held), the first
 * KEPT_HOLES_MAX of them at holes[]. Returns how many there are. */
static size_t kept_holes(const struct pool *pool, size_t i, uint64_t bytes,
			 uint64_t holes[KEPT_HOLES_MAX])
{
	size_t n = 0;
	for (uint64_t taken = 0; taken < bytes; taken += pool->kept[i++].bytes) {
		if (!pool->kept[i].head_hole)
			continue;
		if (n < KEPT_HOLES_MAX)
			holes[n] = pool->kept[i].start;
		n++;
	}
	return n;
}

/* Takes `bytes` for a new block from the front of kept extent i and, when
 * it is not enough, of its neighbours after it (kept_find chose them). */
static uint64_t kept_use(struct pool *pool, size_t i, uint64_t bytes)
{
	uint64_t start = pool->kept[i].start;
	__atomic_store_n(&pool->reused_bytes, pool->reused_bytes + bytes, __ATOMIC_RELAXED);
	retain_count_extent_reuse();
	while (bytes > 0) {
		struct kept *k = &pool->kept[i];
		uint64_t take = bytes < k->bytes ? bytes : k->bytes;
		uint64_t pages = take - (k->head_hole ? PAGE_BYTES : 0);
		k->start += take;
		k->bytes -= take;
		k->head_hole = false;
		bytes -= take;
		retain_give(pages);
		__atomic_store_n(&pool->kept_bytes, pool->kept_bytes - pages, __ATOMIC_RELAXED);
		if (k->bytes == 0) {
			memmove(k, k + 1, (pool->n_kept - i - 1) * sizeof(*k));
			pool->n_kept--;
		}
	}
	return start;
}

/* Gives the extent's pages back, or keeps them for the next block. */
static void extent_release(struct pool *pool, uint64_t start, uint64_t bytes)
{
	if (extent_keep(pool, start, bytes))
		return;
	punch_locked(pool, start, bytes);
	free_insert(pool, start, bytes);
}

/* ---- open ----------------------------------------------------------------- */

static void file_name(char *out, size_t size, uint32_t uid, bool temporary)
{
	snprintf(out, size, "%spool-%u.zcp%s", temporary ? "." : "", (unsigned)uid,
		 temporary ? ".tmp" : "");
}

/* The end of the last data the file holds: new extents go above it until
 * the sweep knows what is free. */
static uint64_t data_end(int fd)
{
	uint64_t end = POOL_DATA_OFFSET;
	off_t at = POOL_DATA_OFFSET;
	for (;;) {
		off_t data = lseek(fd, at, SEEK_DATA);
		if (data < 0)
			break;
		off_t hole = lseek(fd, data, SEEK_HOLE);
		if (hole < 0)
			break;
		end = round_up((uint64_t)hole, PAGE_BYTES);
		at = hole;
	}
	return end;
}

static int pool_create_file(int dir_fd, uint32_t uid, const char *name)
{
	char temporary[64];
	file_name(temporary, sizeof(temporary), uid, true);
	unlinkat(dir_fd, temporary, 0);
	int fd = openat(dir_fd, temporary, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0)
		return -errno;
	zc_pool_header header = { .version = ZC_POOL_VERSION, .owner_uid = uid,
				  .capacity = POOL_CAPACITY_BYTES, .data_offset = POOL_DATA_OFFSET };
	memcpy(header.magic, ZC_POOL_MAGIC, sizeof(header.magic));
	int rc = 0;
	if (ftruncate(fd, (off_t)POOL_CAPACITY_BYTES) < 0 ||
	    fallocate(fd, 0, 0, POOL_DATA_OFFSET) < 0 ||
	    pwrite(fd, &header, sizeof(header), 0) != (ssize_t)sizeof(header) || fchmod(fd, 0400) < 0)
		rc = errno ? -errno : -EIO;
	fault_point("pool.create");
	if (rc == 0 && renameat2(dir_fd, temporary, dir_fd, name, RENAME_NOREPLACE) < 0)
		rc = -errno;
	if (rc < 0) {
		unlinkat(dir_fd, temporary, 0);
		close(fd);
		return rc;
	}
	return fd;
}

static int pool_open_file(int dir_fd, uint32_t uid, const char *name, bool *existed, char *reason,
			  size_t reason_size)
{
	char proc_path[64];
	int ro = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (ro < 0 && errno == ENOENT) {
		*existed = false;
		return pool_create_file(dir_fd, uid, name);
	}
	if (ro < 0)
		return -errno;
	*existed = true;
	struct stat st;
	zc_pool_header header;
	int rc = 0;
	if (fstat(ro, &st) < 0)
		rc = -errno;
	else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid())
		rc = -EPERM;
	else if (pread(ro, &header, sizeof(header), 0) != (ssize_t)sizeof(header) ||
		 memcmp(header.magic, ZC_POOL_MAGIC, sizeof(header.magic)) != 0 ||
		 header.version != ZC_POOL_VERSION || header.owner_uid != uid ||
		 header.capacity != POOL_CAPACITY_BYTES || (uint64_t)st.st_size != header.capacity ||
		 header.data_offset != POOL_DATA_OFFSET) {
		snprintf(reason, reason_size, "pool file %s is not a version %u pool of uid %u", name,
			 ZC_POOL_VERSION, (unsigned)uid);
		rc = ZC_ECORRUPT;
	}
	if (rc < 0) {
		close(ro);
		return rc;
	}
	/* 0400 keeps readers from reopening it for writing; the owner lifts
	 * that for the moment it takes its own read-write descriptor. */
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", ro);
	int fd = -1;
	if (geteuid() == 0 || fchmod(ro, 0600) == 0) {
		fd = open(proc_path, O_RDWR | O_CLOEXEC);
		if (fd < 0)
			rc = -errno;
		fchmod(ro, 0400);
	} else {
		rc = -errno;
	}
	close(ro);
	return rc < 0 ? rc : fd;
}

int pool_open(int dir_fd, const char *dir_path, uint32_t uid, struct store_budget *budget,
	      struct pool **out, bool *existed, char *reason, size_t reason_size)
{
	char name[64];
	if (reason && reason_size)
		reason[0] = '\0';
	file_name(name, sizeof(name), uid, false);
	struct pool *pool = calloc(1, sizeof(*pool));
	if (!pool)
		return -ENOMEM;
	int fd = pool_open_file(dir_fd, uid, name, existed, reason, reason_size);
	if (fd < 0) {
		free(pool);
		return fd;
	}
	pthread_mutex_init(&pool->lock, NULL);
	pool->fd = fd;
	pool->uid = uid;
	pool->budget = budget;
	snprintf(pool->path, sizeof(pool->path), "%s/%s", dir_path, name);
	pool->top = *existed ? data_end(fd) : POOL_DATA_OFFSET;
	pool->swept = !*existed;
	/* What an existing pool holds counts, even past the budget. */
	pool->charged = fd_allocated(fd);
	store_budget_force(budget, pool->charged);
	*out = pool;
	return 0;
}

void pool_close(struct pool *pool)
{
	if (!pool)
		return;
	/* Kept pages stay in the file; the next daemon's sweep punches them. */
	retain_give(pool->kept_bytes);
	store_budget_give(pool->budget, pool->charged);
	for (size_t i = 0; i < pool->n_windows; i++)
		if (pool->windows[i])
			munmap(pool->windows[i], POOL_WINDOW_BYTES);
	free(pool->windows);
	close(pool->fd);
	pthread_mutex_destroy(&pool->lock);
	free(pool->slots);
	free(pool->free);
	free(pool->kept);
	free(pool);
}

uint32_t pool_uid(const struct pool *pool)
{
	return pool->uid;
}

void pool_charge_to(struct pool *pool, struct store_budget *budget)
{
	pthread_mutex_lock(&pool->lock);
	store_budget_give(pool->budget, pool->charged);
	pool->budget = budget;
	store_budget_force(budget, pool->charged);
	pthread_mutex_unlock(&pool->lock);
}

/* ---- blocks ---------------------------------------------------------------- */

/* Allocates the pages at offsets[0..n) of fd. */
static int pages_fill(int fd, const uint64_t *offsets, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (fallocate(fd, 0, (off_t)offsets[i], PAGE_BYTES) < 0)
			return -errno;
	return 0;
}

int pool_reserve(struct pool *pool, uint64_t key_bytes, uint64_t value_bytes,
		 uint64_t *key_offset)
{
	uint64_t bytes = pool_extent_bytes(key_bytes, value_bytes), start;
	int rc;
	pthread_mutex_lock(&pool->lock);
	for (int attempt = 0;; attempt++) {
		/* A kept extent needs budget only for its punched page. */
		uint64_t holes[KEPT_HOLES_MAX];
		ssize_t k = kept_find(pool, bytes);
		size_t n_holes = k < 0 ? 0 : kept_holes(pool, (size_t)k, bytes, holes);
		uint64_t need = k < 0 ? bytes : n_holes * PAGE_BYTES;
		rc = store_budget_take(pool->budget, need);
		if (rc < 0)
			goto out;
		if (k >= 0) {
			start = kept_use(pool, (size_t)k, bytes);
			fault_point("pool.reuse");
		} else {
			rc = space_take(pool, bytes, &start);
			if (rc < 0) {
				store_budget_give(pool->budget, need);
				goto out;
			}
		}
		/* Pages first: a full tmpfs is an error reply, and the charge is
		 * what the file really grew (a reader may have faulted some in
		 * already). Kept extents lack only their punched pages: a
		 * fallocate over the whole block would walk every page it holds
		 * (on a prefill layer's block, about a thousand). */
		uint64_t before = fd_allocated(pool->fd);
		if (k >= 0 && n_holes <= KEPT_HOLES_MAX)
			rc = pages_fill(pool->fd, holes, n_holes);
		else
			rc = fallocate(pool->fd, 0, (off_t)start, (off_t)bytes) < 0 ? -errno : 0;
		if (rc < 0) {
			store_budget_give(pool->budget, need);
			if (k >= 0)
				punch_locked(pool, start, bytes);
			free_insert(pool, start, bytes);
			/* Kept pages may be what filled the tmpfs: give them back
			 * and try once more. */
			if (rc == -ENOSPC && attempt == 0 && pool->n_kept > 0) {
				kept_release_locked(pool, UINT64_MAX);
				continue;
			}
			log_warn("pool", "fallocate failed", "path=%s bytes=%llu error=%s", pool->path,
				 (unsigned long long)bytes, strerror(-rc));
			goto out;
		}
		uint64_t after = fd_allocated(pool->fd);
		uint64_t grown = after > before ? after - before : 0;
		if (grown > need)
			grown = need;
		store_budget_give(pool->budget, need - grown);
		pool->charged += grown;
		charge_sync_locked(pool);
		break;
	}
	struct extent e = { .offset = start, .bytes = bytes, .key_bytes = key_bytes,
			    .value_bytes = value_bytes, .refs = 1 };
	rc = extent_insert(pool, &e);
	if (rc < 0) {
		extent_release(pool, start, bytes);
		goto out;
	}
	pthread_mutex_unlock(&pool->lock);
	*key_offset = start;
	return 0;
out:
	pthread_mutex_unlock(&pool->lock);
	return rc;
}

int pool_write_at(struct pool *pool, uint64_t offset, const void *bytes, uint64_t n)
{
	return fd_pwrite_all(pool->fd, bytes, n, offset);
}

int pool_write(struct pool *pool, const void *key, uint64_t key_bytes, const void *value,
	       uint64_t value_bytes, uint64_t *key_offset)
{
	uint64_t start;
	int rc = pool_reserve(pool, key_bytes, value_bytes, &start);
	if (rc < 0)
		return rc;
	/* The bytes are written without the lock: the extent is the caller's. */
	rc = fd_pwrite_all(pool->fd, key, key_bytes, start);
	if (rc == 0)
		rc = fd_pwrite_all(pool->fd, value, value_bytes, pool_value_offset(start, key_bytes));
	if (rc < 0) {
		pool_unref(pool, start);
		return rc;
	}
	fault_point("pool.write");
	*key_offset = start;
	return 0;
}

/* ---- how blocks are written ----------------------------------------------------- */

static enum pool_writes writes_mode = POOL_WRITES_COPY;

static const char *const writes_names[] = { "auto", "map", "copy" };

int pool_writes_parse(const char *text, enum pool_writes *out)
{
	for (int i = 0; i < 3; i++) {
		if (strcmp(text, writes_names[i]) == 0) {
			*out = (enum pool_writes)i;
			return 0;
		}
	}
	return -EINVAL;
}

const char *pool_writes_name(enum pool_writes mode)
{
	return writes_names[mode];
}

void pool_writes_set(enum pool_writes mode)
{
	writes_mode = mode == POOL_WRITES_MAP ? POOL_WRITES_MAP : POOL_WRITES_COPY;
}

#define PROBE_BYTES (1u << 20)
#define POOL_WRITES_MAP_TOLERANCE 4.0
#define PROBE_TRIES 5

static double probe_now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int probe_cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* One try of each way: the block's bytes made (a memset standing in for
 * the codec's output), then in the file's pages. False if a step failed. */
static bool probe_once(int fd, uint8_t *scratch, uint8_t fill, double *map_us, double *copy_us)
{
	/* Fresh pages for each way, as a new extent has. */
	if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PROBE_BYTES) < 0 ||
	    fallocate(fd, 0, 0, PROBE_BYTES) < 0)
		return false;
	double t0 = probe_now_us();
	void *base = mmap(NULL, PROBE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (base == MAP_FAILED)
		return false;
	bool ok = madvise(base, PROBE_BYTES, MADV_POPULATE_WRITE) == 0;
	if (ok)
		memset(base, fill, PROBE_BYTES);
	munmap(base, PROBE_BYTES);
	*map_us = probe_now_us() - t0;
	if (!ok ||
	    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, PROBE_BYTES) < 0 ||
	    fallocate(fd, 0, 0, PROBE_BYTES) < 0)
		return false;
	t0 = probe_now_us();
	memset(scratch, fill, PROBE_BYTES);
	ok = fd_pwrite_all(fd, scratch, PROBE_BYTES, 0) == 0;
	*copy_us = probe_now_us() - t0;
	return ok;
}

enum pool_writes pool_writes_probe(double *map_us, double *copy_us)
{
	double map[PROBE_TRIES], copy[PROBE_TRIES];
	*map_us = *copy_us = 0;
	int fd = memfd_create("zipcached-pool-probe", MFD_CLOEXEC);
	uint8_t *scratch = malloc(PROBE_BYTES);
	bool ok = fd >= 0 && scratch && ftruncate(fd, PROBE_BYTES) == 0;
	for (int i = 0; ok && i < PROBE_TRIES; i++)
		ok = probe_once(fd, scratch, (uint8_t)(i + 1), &map[i], &copy[i]);
	free(scratch);
	if (fd >= 0)
		close(fd);
	if (!ok)
		return POOL_WRITES_COPY;
	qsort(map, PROBE_TRIES, sizeof(double), probe_cmp);
	qsort(copy, PROBE_TRIES, sizeof(double), probe_cmp);
	*map_us = map[PROBE_TRIES / 2];
	*copy_us = copy[PROBE_TRIES / 2];
	return *map_us <= POOL_WRITES_MAP_TOLERANCE * *copy_us ? POOL_WRITES_MAP : POOL_WRITES_COPY;
}

/* Window i of the pool's file, mapped the first time it is asked for;
 * NULL when it cannot be. */
static uint8_t *window_get(struct pool *pool, size_t i)
{
	uint8_t *window = NULL;
	pthread_mutex_lock(&pool->lock);
	if (i >= pool->n_windows) {
		size_t n = i + 1 > 2 * pool->n_windows ? i + 1 : 2 * pool->n_windows;
		uint8_t **grown = realloc(pool->windows, n * sizeof(*grown));
		if (!grown)
			goto out;
		memset(grown + pool->n_windows, 0, (n - pool->n_windows) * sizeof(*grown));
		pool->windows = grown;
		pool->n_windows = n;
	}
	if (!pool->windows[i]) {
		/* Past the file's end is fine: only reserved extents, whose
		 * pages pool_reserve allocated, are ever touched. */
		void *base = mmap(NULL, POOL_WINDOW_BYTES, PROT_READ | PROT_WRITE,
				  MAP_SHARED | MAP_NORESERVE, pool->fd, (off_t)(i * POOL_WINDOW_BYTES));
		if (base == MAP_FAILED) {
			log_warn("pool", "window not mapped", "path=%s window=%zu error=%s",
				 pool->path, i, strerror(errno));
			goto out;
		}
		pool->windows[i] = base;
	}
	window = pool->windows[i];
out:
	pthread_mutex_unlock(&pool->lock);
	return window;
}

uint8_t *pool_extent_map(struct pool *pool, uint64_t offset, uint64_t bytes,
			 struct pool_mapping *mapping)
{
	*mapping = (struct pool_mapping){ 0 };
	if (writes_mode != POOL_WRITES_MAP || bytes == 0)
		return NULL;
	uint64_t first = offset / POOL_WINDOW_BYTES, last = (offset + bytes - 1) / POOL_WINDOW_BYTES;
	if (first == last && first < SIZE_MAX) {
		uint8_t *window = window_get(pool, (size_t)first);
		if (window)
			return window + offset % POOL_WINDOW_BYTES;
	}
	/* An extent across two windows gets a mapping of its own, its pages
	 * populated: the pages are there (pool_reserve's fallocate), so
	 * that only sets up its page table, no first-touch faults while the
	 * codec writes. */
	uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t start = offset / page * page;
	uint64_t length = round_up(offset + bytes, page) - start;
	if (length > SIZE_MAX)
		return NULL;
	void *base = mmap(NULL, (size_t)length, PROT_READ | PROT_WRITE, MAP_SHARED, pool->fd,
			  (off_t)start);
	if (base == MAP_FAILED)
		return NULL;
	if (madvise(base, (size_t)length, MADV_POPULATE_WRITE) != 0) {
		munmap(base, (size_t)length);
		return NULL;
	}
	*mapping = (struct pool_mapping){ base, (size_t)length };
	return (uint8_t *)base + (offset - start);
}

void pool_extent_unmap(struct pool_mapping *mapping)
{
	if (mapping->base)
		munmap(mapping->base, mapping->length);
	*mapping = (struct pool_mapping){ 0 };
}

int pool_read(struct pool *pool, uint64_t offset, void *out, uint64_t bytes)
{
	uint8_t *p = out;
	while (bytes > 0) {
		ssize_t n = pread(pool->fd, p, bytes, (off_t)offset);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0) {
			log_error("pool", "block bytes missing (the pool file was cut)",
				  "path=%s offset=%llu", pool->path, (unsigned long long)offset);
			return ZC_ECORRUPT;
		}
		p += n;
		bytes -= (uint64_t)n;
		offset += (uint64_t)n;
	}
	return 0;
}

void pool_ref(struct pool *pool, uint64_t key_offset)
{
	pthread_mutex_lock(&pool->lock);
	struct extent *e = extent_find(pool, key_offset);
	if (e) {
		if (e->refs == 1)
			pool->shared_bytes += e->bytes;
		e->refs++;
	}
	pthread_mutex_unlock(&pool->lock);
}

void pool_unref(struct pool *pool, uint64_t key_offset)
{
	pthread_mutex_lock(&pool->lock);
	struct extent *e = extent_find(pool, key_offset);
	if (e && --e->refs <= 1) {
		if (e->refs == 1)
			pool->shared_bytes -= e->bytes;
		if (e->refs == 0) {
			uint64_t start = e->offset, bytes = e->bytes;
			extent_remove(pool, e);
			/* Before the sweep nothing is freed: the space may hold
			 * blocks of a session not adopted yet, and the sweep frees
			 * what nobody claimed. */
			if (pool->swept)
				extent_release(pool, start, bytes);
		}
	}
	pthread_mutex_unlock(&pool->lock);
}

uint32_t pool_refs(struct pool *pool, uint64_t key_offset)
{
	pthread_mutex_lock(&pool->lock);
	struct extent *e = extent_find(pool, key_offset);
	uint32_t refs = e ? e->refs : 0;
	pthread_mutex_unlock(&pool->lock);
	return refs;
}

int pool_claim(struct pool *pool, uint64_t key_offset, uint64_t key_bytes, uint64_t value_offset,
	       uint64_t value_bytes, char *reason, size_t reason_size)
{
	uint64_t bytes = pool_extent_bytes(key_bytes, value_bytes);
	int rc = 0;
	if (key_offset % PAGE_BYTES != 0 || key_offset < POOL_DATA_OFFSET ||
	    value_offset != pool_value_offset(key_offset, key_bytes) ||
	    key_offset > POOL_CAPACITY_BYTES || bytes > POOL_CAPACITY_BYTES - key_offset) {
		snprintf(reason, reason_size, "a block at pool offset %llu is out of place",
			 (unsigned long long)key_offset);
		return ZC_ECORRUPT;
	}
	pthread_mutex_lock(&pool->lock);
	struct extent *e = extent_find(pool, key_offset);
	if (e) {
		if (e->key_bytes != key_bytes || e->value_bytes != value_bytes) {
			snprintf(reason, reason_size,
				 "the block at pool offset %llu has another size in another session",
				 (unsigned long long)key_offset);
			rc = ZC_ECORRUPT;
		} else {
			if (e->refs == 1)
				pool->shared_bytes += e->bytes;
			e->refs++;
		}
		goto out;
	}
	/* Every page of an extent holds payload bytes: a hole in it means
	 * the file lost the block. */
	off_t hole = lseek(pool->fd, (off_t)key_offset, SEEK_HOLE);
	if (hole < 0 || (uint64_t)hole < key_offset + bytes) {
		snprintf(reason, reason_size, "the block at pool offset %llu is not in the pool",
			 (unsigned long long)key_offset);
		rc = ZC_ECORRUPT;
		goto out;
	}
	struct extent claim = { .offset = key_offset, .bytes = bytes, .key_bytes = key_bytes,
				.value_bytes = value_bytes, .refs = 1 };
	rc = extent_insert(pool, &claim);
	if (rc == 0 && key_offset + bytes > pool->top)
		pool->top = key_offset + bytes;
out:
	pthread_mutex_unlock(&pool->lock);
	return rc;
}

static int span_compare(const void *a, const void *b)
{
	const struct span *x = a, *y = b;
	return x->start < y->start ? -1 : x->start > y->start;
}

void pool_sweep(struct pool *pool)
{
	pthread_mutex_lock(&pool->lock);
	if (pool->swept) {
		pthread_mutex_unlock(&pool->lock);
		return;
	}
	struct span *live = malloc((pool->count + 1) * sizeof(*live));
	if (!live) {
		/* Tried again at the next sweep; new blocks keep going on top. */
		pthread_mutex_unlock(&pool->lock);
		return;
	}
	size_t n = 0;
	for (size_t i = 0; i < pool->capacity; i++)
		if (pool->slots[i].offset != 0)
			live[n++] = (struct span){ pool->slots[i].offset, pool->slots[i].bytes };
	qsort(live, n, sizeof(*live), span_compare);
	/* Claims that overlap at different offsets come from a file that was
	 * written to by someone else: freeing one would punch the other's
	 * bytes, so both stay for good (one reference more each). */
	for (size_t i = 1; i < n; i++) {
		if (live[i].start >= live[i - 1].start + live[i - 1].bytes)
			continue;
		struct extent *x = extent_find(pool, live[i - 1].start), *y = extent_find(pool, live[i].start);
		if (x)
			x->refs++;
		if (y)
			y->refs++;
		log_error("pool", "claimed blocks overlap; both are kept", "path=%s offset=%llu other=%llu",
			  pool->path, (unsigned long long)live[i - 1].start,
			  (unsigned long long)live[i].start);
	}
	uint64_t at = POOL_DATA_OFFSET, end = pool->top, swept = 0;
	pool->top = n > 0 ? live[n - 1].start + live[n - 1].bytes : POOL_DATA_OFFSET;
	pool->n_free = 0;
	for (size_t i = 0; i <= n; i++) {
		uint64_t next = i < n ? live[i].start : end;
		if (next > at) {
			uint64_t before = fd_allocated(pool->fd);
			fallocate(pool->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)at,
				  (off_t)(next - at));
			uint64_t after = fd_allocated(pool->fd);
			uint64_t released = before > after ? before - after : 0;
			if (released > pool->charged)
				released = pool->charged;
			pool->charged -= released;
			swept += released;
			store_budget_give(pool->budget, released);
			if (i < n)
				free_insert(pool, at, next - at);
		}
		if (i < n && live[i].start + live[i].bytes > at)
			at = live[i].start + live[i].bytes;
	}
	free(live);
	pool->swept = true;
	pthread_mutex_unlock(&pool->lock);
	if (swept > 0)
		log_info("pool", "unreferenced blocks freed", "path=%s bytes=%llu", pool->path,
			 (unsigned long long)swept);
}

int pool_open_readonly(const struct pool *pool)
{
	char proc_path[64];
	snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", pool->fd);
	int fd = open(proc_path, O_RDONLY | O_CLOEXEC);
	return fd < 0 ? -errno : fd;
}

uint64_t pool_memory_bytes(const struct pool *pool)
{
	return __atomic_load_n(&pool->charged, __ATOMIC_RELAXED);
}

uint64_t pool_file_bytes(const struct pool *pool)
{
	return fd_allocated(pool->fd);
}

uint64_t pool_shared_bytes(const struct pool *pool)
{
	return __atomic_load_n(&pool->shared_bytes, __ATOMIC_RELAXED);
}

uint64_t pool_blocks(const struct pool *pool)
{
	return __atomic_load_n(&pool->count, __ATOMIC_RELAXED);
}

uint64_t pool_kept_bytes(const struct pool *pool)
{
	return __atomic_load_n(&pool->kept_bytes, __ATOMIC_RELAXED);
}

uint64_t pool_reused_bytes(const struct pool *pool)
{
	return __atomic_load_n(&pool->reused_bytes, __ATOMIC_RELAXED);
}

uint64_t pool_release_kept(struct pool *pool, uint64_t wanted)
{
	pthread_mutex_lock(&pool->lock);
	uint64_t freed = kept_release_locked(pool, wanted);
	pthread_mutex_unlock(&pool->lock);
	return freed;
}

uint64_t pool_sync_charge(struct pool *pool)
{
	pthread_mutex_lock(&pool->lock);
	uint64_t grown = charge_sync_locked(pool);
	pthread_mutex_unlock(&pool->lock);
	return grown;
}

/* ---- the daemon's pools ------------------------------------------------------ */

void pool_set_init(struct pool_set *set, int dir_fd, const char *dir_path)
{
	*set = (struct pool_set){ .dir_fd = dir_fd, .dir_path = dir_path };
}

static int set_get(struct pool_set *set, uint32_t uid, struct store_budget *budget,
		   struct pool **out, bool *existed, bool provisional, char *reason,
		   size_t reason_size)
{
	bool found;
	for (size_t i = 0; i < set->n; i++) {
		if (set->items[i]->uid == uid) {
			*out = set->items[i];
			/* Someone else may use it from now on. */
			set->items[i]->provisional = false;
			if (existed)
				*existed = set->items[i]->existed;
			return 0;
		}
	}
	if (set->n == set->capacity) {
		size_t capacity = set->capacity ? set->capacity * 2 : 8;
		struct pool **items = realloc(set->items, capacity * sizeof(*items));
		if (!items)
			return -ENOMEM;
		set->items = items;
		set->capacity = capacity;
	}
	struct pool *pool;
	int rc = pool_open(set->dir_fd, set->dir_path, uid, budget, &pool, &found, reason,
			   reason_size);
	if (rc < 0)
		return rc;
	pool->existed = found;
	pool->provisional = provisional && !found;
	set->items[set->n++] = pool;
	*out = pool;
	if (existed)
		*existed = found;
	return 0;
}

int pool_set_get(struct pool_set *set, uint32_t uid, struct store_budget *budget,
		 struct pool **out, bool *existed, char *reason, size_t reason_size)
{
	return set_get(set, uid, budget, out, existed, false, reason, reason_size);
}

int pool_set_get_provisional(struct pool_set *set, uint32_t uid, struct store_budget *budget,
			     struct pool **out, char *reason, size_t reason_size)
{
	return set_get(set, uid, budget, out, NULL, true, reason, reason_size);
}

void pool_set_drop_provisional(struct pool_set *set, struct pool *pool)
{
	pthread_mutex_lock(&pool->lock);
	bool empty = pool->count == 0;
	pthread_mutex_unlock(&pool->lock);
	if (!pool->provisional || !empty)
		return;
	for (size_t i = 0; i < set->n; i++) {
		if (set->items[i] != pool)
			continue;
		set->items[i] = set->items[--set->n];
		char name[64];
		file_name(name, sizeof(name), pool->uid, false);
		/* Its kept pages are the failed import's own. */
		pool_release_kept(pool, UINT64_MAX);
		if (unlinkat(set->dir_fd, name, 0) < 0)
			log_warn("pool", "pool file not removed", "path=%s error=%s", pool->path,
				 strerror(errno));
		pool_close(pool);
		return;
	}
}

void pool_set_scan(struct pool_set *set, struct store_budget *budget)
{
	int fd = dup(set->dir_fd);
	DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
	if (!dir) {
		if (fd >= 0)
			close(fd);
		return;
	}
	/* The dup shares the descriptor's offset, which the adoption scan
	 * just left at the end of the directory. */
	rewinddir(dir);
	struct dirent *entry;
	while ((entry = readdir(dir)) != NULL) {
		unsigned uid;
		char tail[8], reason[200];
		struct pool *pool;
		if (sscanf(entry->d_name, "pool-%u.zc%7s", &uid, tail) != 2 || strcmp(tail, "p") != 0)
			continue;
		char expected[64];
		file_name(expected, sizeof(expected), uid, false);
		if (strcmp(expected, entry->d_name) != 0)
			continue;
		int rc = pool_set_get(set, uid, budget, &pool, NULL, reason, sizeof(reason));
		if (rc < 0)
			log_warn("pool", "pool file not opened", "dir=%s file=%s error=%s",
				 set->dir_path, entry->d_name, rc == ZC_ECORRUPT ? reason : zc_strerror(rc));
	}
	closedir(dir);
}

void pool_set_sweep(struct pool_set *set)
{
	for (size_t i = 0; i < set->n; i++)
		pool_sweep(set->items[i]);
}

void pool_set_sync_charge(struct pool_set *set)
{
	for (size_t i = 0; i < set->n; i++)
		pool_sync_charge(set->items[i]);
}

void pool_set_free(struct pool_set *set)
{
	for (size_t i = 0; i < set->n; i++)
		pool_close(set->items[i]);
	free(set->items);
	set->items = NULL;
	set->n = set->capacity = 0;
}

uint64_t pool_set_memory_bytes(const struct pool_set *set)
{
	uint64_t total = 0;
	for (size_t i = 0; i < set->n; i++)
		total += pool_memory_bytes(set->items[i]);
	return total;
}

uint64_t pool_set_file_bytes(const struct pool_set *set)
{
	uint64_t total = 0;
	for (size_t i = 0; i < set->n; i++)
		total += pool_file_bytes(set->items[i]);
	return total;
}

uint64_t pool_set_kept_bytes(const struct pool_set *set, bool all, uint32_t uid)
{
	uint64_t total = 0;
	for (size_t i = 0; i < set->n; i++)
		if (all || set->items[i]->uid == uid)
			total += pool_kept_bytes(set->items[i]);
	return total;
}

uint64_t pool_set_release_kept(struct pool_set *set, bool all, uint32_t uid, uint64_t wanted)
{
	uint64_t freed = 0;
	for (size_t i = 0; i < set->n && freed < wanted; i++)
		if (all || set->items[i]->uid == uid)
			freed += pool_release_kept(set->items[i], wanted - freed);
	return freed;
}

uint64_t pool_set_shared_bytes(const struct pool_set *set)
{
	uint64_t total = 0;
	for (size_t i = 0; i < set->n; i++)
		total += pool_shared_bytes(set->items[i]);
	return total;
}
