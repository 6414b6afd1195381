/*
 * Session snapshots (docs/SNAPSHOT.md, proto/snapshot_format.h): the
 * encoder and verifier of each part (a header, one block record), which
 * do no I/O and can be reused wherever a block record is kept on its own
 * (a remote tier), and the whole-file export and import built on them.
 * Export and import run on a worker thread with the session (for an
 * export) to themselves; they never open a path, only the descriptor the
 * client passed.
 */
#ifndef ZIPCACHE_SNAPSHOT_H
#define ZIPCACHE_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "snapshot_format.h"
#include "store.h"

/* The fingerprinted config of a session, and its fingerprint: the one
 * function that computes it (XXH3 over the config's bytes). */
void snapshot_config_of(const struct store_header *h, struct snapshot_config *out);
uint64_t snapshot_fingerprint(const struct snapshot_config *config);

/* Fills a header (checksum included) from its fields. */
void snapshot_header_encode(const struct snapshot_config *config, uint32_t max_tokens,
			    uint32_t views, uint64_t tokens, uint64_t blocks, uint64_t file_bytes,
			    struct snapshot_header *out);

/*
 * Checks a header on its own: magic, version, size, checksum, the config
 * (shape, policy, codec within the daemon's limits), the fingerprint it
 * claims. ZC_ECORRUPT (damaged) or ZC_EINVALID (a config no session may
 * have) with `why` naming it.
 */
int snapshot_header_verify(const struct snapshot_header *h, char *why, size_t why_size);

/* The payload sizes the codec gives a block of `tokens` rows of this config. */
void snapshot_payload_bytes(const struct snapshot_config *config, uint32_t tokens,
			    uint64_t *key_bytes, uint64_t *value_bytes);

/* Encodes one whole block record (header, payloads, payload checksum:
 * snapshot_record_bytes(entry->key_bytes, entry->value_bytes) bytes at
 * record) for a pool entry and its payloads. */
void snapshot_block_encode(uint64_t fingerprint, uint32_t layer, uint32_t index,
			   const store_block *entry, const void *key, const void *value,
			   uint8_t *record);

/*
 * Verifies one block record (`len` bytes: header, payloads, payload
 * checksum) against the
 * snapshot's header: magic, checksums, fingerprint, that it is block
 * `index` of `layer`, token counts, payload sizes the codec gives its
 * shape. On success *entry holds its table entry (offsets 0) and the
 * payloads are at record + SNAPSHOT_BLOCK_BYTES. ZC_ECORRUPT with `why`.
 */
int snapshot_block_verify(const struct snapshot_header *h, uint32_t layer, uint32_t index,
			  const void *record, uint64_t len, store_block *entry, char *why,
			  size_t why_size);

/* What export wrote. */
struct snapshot_result {
	uint64_t bytes;
	uint64_t fingerprint;
	uint64_t tokens;
};

/*
 * Writes the store's snapshot to fd (a regular file or, with `pipe`, a
 * pipe: then never blocking past SNAPSHOT_PIPE_STALL_MS without
 * progress), from fd's offset on, leaving the offset after it. The caller
 * has the session to itself. Negative errno of the write, ZC_ECORRUPT
 * when the pool lost a block, with `why`. A regular file (not O_APPEND)
 * may be written out of order, by two threads at once, with a second CPU.
 */
int snapshot_export(struct store *store, int fd, bool pipe, struct snapshot_result *result,
		    char *why, size_t why_size);

/* The same, always in file order (a reader may follow the writes, as the
 * offload follows its memfd's size). */
int snapshot_export_in_order(struct store *store, int fd, struct snapshot_result *result,
			     char *why, size_t why_size);

/* What an import expects of the snapshot besides being intact. */
struct snapshot_expect {
	const char *model_id;      /* NULL: any */
	bool has_fingerprint;
	uint64_t fingerprint;
	uint64_t max_bytes;        /* the largest snapshot taken in (the memory budget's room) */
};

/*
 * The import's first step, without making anything: the snapshot in fd
 * (a regular file, read from offset 0) against max_bytes, its header and
 * layer table (their checksums, every count against the others and the
 * layout), the expectations. The records, residuals and the whole-file
 * checksum are verified by snapshot_import as it builds. *header is its
 * header. ZC_ECORRUPT (damaged, truncated, wrong version),
 * ZC_EPRECONDITION (another model or fingerprint), ZC_EINVALID (a config
 * no session may have), ZC_EEXHAUSTED (larger than max_bytes), or a
 * read's errno; `why` names what and where.
 */
int snapshot_verify(int fd, const struct snapshot_expect *expect, struct snapshot_header *header,
		    char *why, size_t why_size);

/*
 * Makes the session the snapshot describes (params gives its id, epoch,
 * owner, name and views; the rest comes from the header snapshot_verify
 * checked): one pass that verifies every record, residual and the
 * whole-file checksum, in the order and with the errors of docs/SNAPSHOT.md,
 * while it builds the new session's temporary file and blocks (layers on
 * up to four threads, all joined before it returns);
 * then renames the file into place (store_import_commit). On any failure
 * nothing is left: no file, no block. STORE_EBUDGET when the memory
 * budget refused a page.
 */
int snapshot_import(int fd, const struct snapshot_header *header, const struct store_params *params,
		    int dir_fd, const char *dir_path, struct store_budget *budget, struct pool *pool,
		    struct store **out, char *why, size_t why_size);

/* One part of a snapshot held in memory: a block record or a residual. */
struct snapshot_part {
	const void *bytes;
	uint64_t len;
};

/*
 * A snapshot verified part by part as its parts arrive (a restore from
 * the remote tier, docs/REMOTE.md), with the same checks the import
 * makes of a file: open checks the header, the layer table (checksum and
 * every count) and the expectations; each layer, in order, its block
 * records (checksums, tiling, sizes; *entries filled) and its residual;
 * end the trailer and the whole-snapshot checksum, computed along the
 * way. Only a snapshot whose end returned 0 is intact. The table is
 * borrowed until free. Errors as snapshot_verify's.
 */
struct snapshot_stream;
int snapshot_stream_open(const struct snapshot_header *header, const struct snapshot_layer *table,
			 uint64_t table_checksum, const struct snapshot_expect *expect,
			 struct snapshot_stream **out, char *why, size_t why_size);
int snapshot_stream_layer(struct snapshot_stream *stream, uint32_t layer,
			  const struct snapshot_part *blocks, const struct snapshot_part *residual,
			  store_block *entries, char *why, size_t why_size);
int snapshot_stream_end(struct snapshot_stream *stream, const struct snapshot_trailer *trailer,
			char *why, size_t why_size);
void snapshot_stream_free(struct snapshot_stream *stream);

/*
 * The session a snapshot's header describes, built layer by layer under
 * its temporary name (store_import_begin; params as for snapshot_import),
 * from layers snapshot_stream_layer passed: snapshot_build_layer stores
 * the layer's blocks (entries from the verification) and residual rows.
 * The caller commits (store_import_commit: the rename) or abandons
 * (store_import_abandon: no file, no block). STORE_EBUDGET when the
 * memory budget refused a page.
 */
int snapshot_build_begin(const struct snapshot_header *header, const struct store_params *params,
			 int dir_fd, const char *dir_path, struct store_budget *budget,
			 struct pool *pool, struct store **out, char *why, size_t why_size);
int snapshot_build_layer(struct store *store, const struct snapshot_header *header, uint32_t layer,
			 const struct snapshot_layer *entry, const struct snapshot_part *blocks,
			 const store_block *entries, const void *residual, char *why,
			 size_t why_size);

#endif
