/*
 * Offload and restore of whole sessions over the remote tier
 * (docs/REMOTE.md "Offload and restore", docs/DURABILITY.md). A session
 * is written as the parts of its snapshot (server/snapshot.c's encoder,
 * not a second serializer): one key per block record, one per layer's
 * residual rows, under a new generation, and last a manifest naming the
 * generation with the snapshot's header, layer table and trailer, under
 * its own checksum. The manifest is the commit point. A restore fetches
 * the parts back layer by layer, verifies each as it arrives and builds
 * the session from the verified layers while later ones are fetched; the
 * session appears only with its file's rename, after the last part
 * passed.
 *
 * The I/O calls (offload_write, restore_manifest, restore_build,
 * offload_delete) run on a worker thread or, for relief, on the loop
 * thread with the session idle; the scheduling calls (offload_scan, offload_relief) on the loop
 * thread only.
 */
#ifndef ZIPCACHE_OFFLOAD_H
#define ZIPCACHE_OFFLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "remote.h"
#include "snapshot.h"
#include "snapshot_format.h"
#include "store.h"

struct server;
struct session;

#define OFFLOAD_MANIFEST_MAGIC "ZCOFFLD1"
#define OFFLOAD_MANIFEST_VERSION 1u
/* --remote-ttl-seconds's default: a week. Long enough that a
 * conversation resumed after a weekend still finds its session, short
 * enough that what nobody comes back for (a crashed restore's leftovers, an
 * old generation whose deletion failed) does not fill Redis forever. */
#define OFFLOAD_TTL_SECONDS_DEFAULT (7u * 24 * 3600)
/* Retries after a failed offload: from the first to the longest wait. */
#define OFFLOAD_BACKOFF_MIN_MS 1000u
#define OFFLOAD_BACKOFF_MAX_MS 60000u

/* The loop thread's view of offloading (server->offload). */
struct offload_state {
	uint64_t retry_at_ms;   /* no offload before then (backoff after a failure) */
	uint32_t backoff_ms;
	bool failing;           /* as the log last said */
	int64_t offloaded;      /* sessions this node offloaded less those it restored */
};

/* The manifest's fixed head; the snapshot's header, its layer table with
 * the table's checksum and its trailer follow, then a u64 XXH3 over
 * every byte before it. */
struct offload_manifest_head {
	char magic[8];           /* OFFLOAD_MANIFEST_MAGIC */
	uint32_t version;        /* OFFLOAD_MANIFEST_VERSION */
	uint32_t layers;
	uint64_t generation;     /* the blocks' and residuals' keys carry it */
	uint64_t snapshot_bytes; /* the snapshot the parts make up again */
	uint64_t reserved;
};

/* A manifest as read back and checked. */
struct offload_manifest {
	struct offload_manifest_head head;
	struct snapshot_header header;
	struct snapshot_layer *table;   /* head.layers entries, malloc'd */
	uint64_t table_checksum;
	struct snapshot_trailer trailer;
};

void offload_manifest_free(struct offload_manifest *m);

/* What one offload wrote. */
struct offload_result {
	uint64_t generation;
	uint64_t bytes_written;      /* values: blocks, residuals, manifest */
	uint64_t snapshot_bytes;
	uint64_t keys;
	uint64_t elapsed_ns;
};

/*
 * Writes the session (the caller has it to itself) to the remote tier
 * under a new generation, every write confirmed, the manifest last; then
 * deletes the previous generation's keys (best effort). On failure
 * nothing local changed and `why` says what; a manifest is only written
 * after every part was. Fault points offload.encoded, offload.layer (once
 * per layer), offload.manifest.
 */
int offload_write(struct remote *remote, struct store *store, uint32_t uid, const char *name,
		  uint32_t ttl_seconds, struct offload_result *result, char *why, size_t why_size);

/*
 * Reads uid's manifest of `name` (the first step of a restore, before
 * anything is made). ZC_ENOTFOUND: no manifest (*found false);
 * ZC_ECORRUPT: a damaged manifest (why names it); a remote failure.
 * *manifest filled on success (caller frees); *bytes_read its size.
 */
int restore_manifest(struct remote *remote, uint32_t uid, const char *name,
		     struct offload_manifest *manifest, bool *found, uint64_t *bytes_read,
		     char *why, size_t why_size);

/* Where a restore builds its session (as snapshot_import's arguments). */
struct restore_target {
	const struct store_params *params;   /* id, epoch, owner, name, views */
	int dir_fd;
	const char *dir_path;
	struct store_budget *budget;
	struct pool *pool;
};

/* What one restore did, for its log line. */
struct restore_result {
	uint64_t bytes_read;     /* the parts' values */
	uint64_t fetch_ns;       /* the fetcher in remote_get_many */
	uint64_t verify_ns;      /* the fetcher checking the parts */
	uint64_t build_ns;       /* the builder storing layers, and the rename */
	uint64_t wait_ns;        /* the builder waiting for a verified layer */
	uint64_t elapsed_ns;
	bool overlapped;         /* the fetcher had a thread of its own */
};

/*
 * Fetches every part the manifest names and builds the session from
 * them, as a pipeline: each layer's parts verified as they arrive (every
 * block record's checksums and tiling, the residual's, the sizes the
 * layer table gives, the whole-snapshot checksum computed along the
 * way), each verified layer stored into the new session's temporary file
 * and pool extents while later layers are fetched. The commit point is
 * the file's rename, made only after the last part and the trailer's
 * checksum passed; on any failure (a part missing: ZC_ENOTFOUND naming
 * it; damaged: ZC_ECORRUPT; Redis failing; STORE_EBUDGET) nothing is
 * left: no file, no pool extent. Fault points restore.part (a layer
 * fetched and verified), restore.layer (a layer built), restore.fetched
 * (all verified, before the rename), and the import's.
 */
int restore_build(struct remote *remote, uint32_t uid, const char *name,
		  const struct offload_manifest *manifest, const struct snapshot_expect *expect,
		  const struct restore_target *target, struct store **out,
		  struct restore_result *result, char *why, size_t why_size);

/* Loop thread: deletes, off the loop and best effort, uid's remote copy
 * of name if its manifest still names `generation` (manifest first). */
void offload_forget(struct server *server, uint32_t uid, const char *name, uint64_t generation);

/* Deletes a remote copy: its manifest first when `with_manifest` (a
 * reader then finds no session, never a half-deleted one), then its parts.
 * Best effort: returns the first failure. */
int offload_delete(struct remote *remote, uint32_t uid, const char *name,
		   const struct offload_manifest *manifest, bool with_manifest);

/* Loop thread. Queues an offload job for every session idle past
 * --offload-idle-seconds (no job, no live lease), unless the remote tier
 * is in its backoff after a failure. */
void offload_scan(struct server *server, uint64_t now_ms);

/*
 * Memory relief's step (relief.c): offloads idle, unleased sessions other
 * than `keep` (of `uid` only when own_only), least recently used first,
 * synchronously on the loop thread, until about `wanted` bytes came back.
 * Returns the bytes freed.
 */
uint64_t offload_relief(struct server *server, uint64_t wanted, const struct session *keep,
			uint32_t uid, bool own_only);

#endif
