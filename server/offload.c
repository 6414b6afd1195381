/* Offload and restore of sessions over the remote tier (offload.h). */
#include "offload.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
/* As snapshot.c: the header-only build, no library to link. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "fault.h"
#include "log.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "zipcache/error.h"

/* A manifest of this many layers, in bytes: the one formula. */
static size_t manifest_bytes(uint32_t layers)
{
	return sizeof(struct offload_manifest_head) + SNAPSHOT_HEADER_BYTES +
	       (size_t)layers * SNAPSHOT_LAYER_BYTES + sizeof(uint64_t) + SNAPSHOT_TRAILER_BYTES +
	       sizeof(uint64_t);
}

void offload_manifest_free(struct offload_manifest *m)
{
	free(m->table);
	m->table = NULL;
}

static void manifest_key(struct remote_key *key, uint32_t uid, const char *name)
{
	struct remote_key_parts parts = { .kind = REMOTE_KEY_MANIFEST, .name = name };
	remote_key_make(key, uid, &parts);
}

/* A part's key: a block (block < UINT32_MAX) or the layer's residual. */
static int part_key(struct remote_key *key, uint32_t uid, const char *name, uint64_t fingerprint,
		    uint64_t generation, uint32_t layer, uint32_t block)
{
	struct remote_key_parts parts = {
		.kind = block == UINT32_MAX ? REMOTE_KEY_RESIDUAL : REMOTE_KEY_BLOCK,
		.name = name,
		.fingerprint = (const uint8_t *)&fingerprint,
		.fingerprint_len = sizeof(fingerprint),
		.generation = generation,
		.layer = layer,
		.block = block == UINT32_MAX ? 0 : block,
	};
	return remote_key_make(key, uid, &parts);
}

/* Checks a manifest's bytes and fills *m (m->table malloc'd). */
static int manifest_parse(const uint8_t *bytes, size_t len, struct offload_manifest *m, char *why,
			  size_t why_size)
{
	memset(m, 0, sizeof(*m));
	if (len < sizeof(m->head) + sizeof(uint64_t)) {
		snprintf(why, why_size, "the manifest is %zu bytes, too short", len);
		return ZC_ECORRUPT;
	}
	memcpy(&m->head, bytes, sizeof(m->head));
	if (memcmp(m->head.magic, OFFLOAD_MANIFEST_MAGIC, 8) != 0 ||
	    m->head.version != OFFLOAD_MANIFEST_VERSION) {
		snprintf(why, why_size, "the manifest has the wrong magic or version");
		return ZC_ECORRUPT;
	}
	if (m->head.layers == 0 || m->head.layers > STORE_MAX_LAYERS ||
	    len != manifest_bytes(m->head.layers)) {
		snprintf(why, why_size, "the manifest is %zu bytes for %u layers", len, m->head.layers);
		return ZC_ECORRUPT;
	}
	uint64_t sum;
	memcpy(&sum, bytes + len - sizeof(sum), sizeof(sum));
	if (sum != XXH3_64bits(bytes, len - sizeof(sum))) {
		snprintf(why, why_size, "the manifest's checksum does not match");
		return ZC_ECORRUPT;
	}
	const uint8_t *p = bytes + sizeof(m->head);
	memcpy(&m->header, p, SNAPSHOT_HEADER_BYTES);
	p += SNAPSHOT_HEADER_BYTES;
	char header_why[160];
	int rc = snapshot_header_verify(&m->header, header_why, sizeof(header_why));
	if (rc < 0) {
		snprintf(why, why_size, "the manifest's snapshot header: %s", header_why);
		return rc;
	}
	if (m->header.config.layers != m->head.layers || m->header.file_bytes != m->head.snapshot_bytes) {
		snprintf(why, why_size, "the manifest's head and snapshot header disagree");
		return ZC_ECORRUPT;
	}
	m->table = malloc((size_t)m->head.layers * SNAPSHOT_LAYER_BYTES);
	if (!m->table)
		return -ENOMEM;
	memcpy(m->table, p, (size_t)m->head.layers * SNAPSHOT_LAYER_BYTES);
	p += (size_t)m->head.layers * SNAPSHOT_LAYER_BYTES;
	memcpy(&m->table_checksum, p, sizeof(uint64_t));
	p += sizeof(uint64_t);
	memcpy(&m->trailer, p, SNAPSHOT_TRAILER_BYTES);
	/* Where the parts go back: each layer's region inside the file. */
	uint64_t body = SNAPSHOT_HEADER_BYTES + (uint64_t)m->head.layers * SNAPSHOT_LAYER_BYTES +
			sizeof(uint64_t);
	if (m->head.snapshot_bytes < body + SNAPSHOT_TRAILER_BYTES) {
		snprintf(why, why_size, "the manifest's snapshot size is too small");
		offload_manifest_free(m);
		return ZC_ECORRUPT;
	}
	for (uint32_t l = 0; l < m->head.layers; l++) {
		const struct snapshot_layer *t = &m->table[l];
		if (t->offset < body || t->bytes > m->head.snapshot_bytes - SNAPSHOT_TRAILER_BYTES ||
		    t->offset > m->head.snapshot_bytes - SNAPSHOT_TRAILER_BYTES - t->bytes) {
			snprintf(why, why_size, "the manifest's layer %u lies outside the snapshot", l);
			offload_manifest_free(m);
			return ZC_ECORRUPT;
		}
	}
	return 0;
}

/* Reads uid's manifest of name: 0, ZC_ENOTFOUND, ZC_ECORRUPT or a remote failure. */
static int manifest_read(struct remote *remote, uint32_t uid, const char *name,
			 struct offload_manifest *m, uint64_t *bytes_read, char *why, size_t why_size)
{
	struct remote_key key;
	void *value = NULL;
	size_t len = 0;
	manifest_key(&key, uid, name);
	int rc = remote_get(remote, &key, &value, &len);
	if (rc == ZC_ENOTFOUND) {
		snprintf(why, why_size, "no manifest of session '%s' in the remote tier", name);
		return rc;
	}
	if (rc < 0) {
		char text[200];
		remote_last_error(remote, text, sizeof(text));
		snprintf(why, why_size, "cannot read the manifest of '%s': %s", name, text);
		return rc;
	}
	if (bytes_read)
		*bytes_read += len;
	rc = manifest_parse(value, len, m, why, why_size);
	free(value);
	return rc;
}

static void remote_why(struct remote *remote, const char *what, char *why, size_t why_size)
{
	char text[200];
	remote_last_error(remote, text, sizeof(text));
	snprintf(why, why_size, "%s: %.100s", what, text);
}

static uint64_t realtime_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The snapshot encoder on its own thread, writing into a memfd. */
struct encoder {
	struct store *store;
	int fd;
	int rc;                   /* snapshot_export's */
	bool done;                /* atomic: rc and result are final */
	struct snapshot_result result;
	char why[200];
};

static void *encoder_run(void *arg)
{
	struct encoder *e = arg;
	/* In order: the offload reads each layer once the memfd's size passed it. */
	e->rc = snapshot_export_in_order(e->store, e->fd, &e->result, e->why, sizeof(e->why));
	__atomic_store_n(&e->done, true, __ATOMIC_RELEASE);
	return NULL;
}

/* Waits until the image holds `bytes` (true) or the encoder ended short
 * of them (false). Polls the memfd's size: the wait is the encoder's own
 * time, a few hundred microseconds per step. */
static bool image_wait(struct encoder *e, uint64_t bytes)
{
	for (;;) {
		bool done = __atomic_load_n(&e->done, __ATOMIC_ACQUIRE);
		struct stat st;
		if (fstat(e->fd, &st) == 0 && (uint64_t)st.st_size >= bytes)
			return true;
		if (done) {
			if (e->rc == 0)
				snprintf(e->why, sizeof(e->why), "the image is shorter than its layout");
			return false;
		}
		usleep(200);
	}
}

static int encoder_finish(struct encoder *e, pthread_t *thread, bool *started)
{
	if (*started) {
		pthread_join(*thread, NULL);
		*started = false;
	}
	return e->rc;
}

int offload_write(struct remote *remote, struct store *store, uint32_t uid, const char *name,
		  uint32_t ttl_seconds, struct offload_result *result, char *why, size_t why_size)
{
	struct offload_manifest prev = { 0 };
	bool has_prev = false;
	struct remote_key mkey;
	char local_why[200];
	uint8_t *map = MAP_FAILED;
	uint64_t size = 0;
	struct remote_key *keys = NULL;
	struct remote_item *items = NULL;
	uint8_t *manifest = NULL;
	int fd = -1;
	struct encoder encoder = { .fd = -1 };
	pthread_t encoder_thread;
	bool encoder_started = false;

	memset(result, 0, sizeof(*result));
	uint64_t start_ns = uv_hrtime();
	/* The generation this one replaces, to delete once it is committed. A
	 * manifest we cannot read is one we cannot build on: a damaged one is
	 * simply replaced. */
	int rc = manifest_read(remote, uid, name, &prev, NULL, local_why, sizeof(local_why));
	if (rc == 0)
		has_prev = true;
	else if (rc != ZC_ENOTFOUND && rc != ZC_ECORRUPT) {
		snprintf(why, why_size, "%s", local_why);
		return rc;
	}
	manifest_key(&mkey, uid, name);

	/* The snapshot encoder writes the image on a thread of its own; each
	 * layer's parts are cut from it and sent as soon as the image holds
	 * them, so the encoding of layer L+1 overlaps the writes of layer L. */
	fd = memfd_create("zipcache-offload", MFD_CLOEXEC);
	if (fd < 0) {
		rc = -errno;
		snprintf(why, why_size, "cannot make a buffer for the snapshot: %s", strerror(errno));
		goto out;
	}
	encoder = (struct encoder){ .store = store, .fd = fd };
	if (pthread_create(&encoder_thread, NULL, encoder_run, &encoder) != 0) {
		encoder_run(&encoder);   /* in line: no overlap, same bytes */
	} else {
		encoder_started = true;
	}
	struct snapshot_header header_copy;
	if (!image_wait(&encoder, SNAPSHOT_HEADER_BYTES) ||
	    pread(fd, &header_copy, sizeof(header_copy), 0) != (ssize_t)sizeof(header_copy)) {
		rc = ZC_EINTERNAL;
		snprintf(why, why_size, "cannot encode the snapshot: %s", encoder.why);
		goto out;
	}
	size = header_copy.file_bytes;
	uint32_t layers = header_copy.config.layers;
	if (!image_wait(&encoder, SNAPSHOT_HEADER_BYTES + (uint64_t)layers * SNAPSHOT_LAYER_BYTES +
					  sizeof(uint64_t))) {
		rc = ZC_EINTERNAL;
		snprintf(why, why_size, "cannot encode the snapshot: %s", encoder.why);
		goto out;
	}
	fault_point("offload.encoded");
	/* Mapped at its final size; only what the encoder has written is read. */
	map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		rc = -errno;
		snprintf(why, why_size, "cannot map the snapshot: %s", strerror(errno));
		goto out;
	}
	const struct snapshot_header *header = (const struct snapshot_header *)map;
	const struct snapshot_layer *table = (const struct snapshot_layer *)(map + SNAPSHOT_HEADER_BYTES);
	uint64_t generation = has_prev ? prev.head.generation + 1 : 1;
	uint64_t now = realtime_us();
	if (now > generation)
		generation = now;
	uint32_t most = 0;
	for (uint32_t l = 0; l < layers; l++)
		if (table[l].blocks > most)
			most = table[l].blocks;
	keys = calloc((size_t)most + 1, sizeof(*keys));
	items = calloc((size_t)most + 1, sizeof(*items));
	if (!keys || !items) {
		rc = -ENOMEM;
		snprintf(why, why_size, "out of memory");
		goto out;
	}

	/* Every part of the new generation, one layer's batch at a time, each
	 * write confirmed. */
	for (uint32_t l = 0; l < layers; l++) {
		uint64_t p = table[l].offset, end = table[l].offset + table[l].bytes;
		size_t n = 0;
		if (!image_wait(&encoder, end)) {
			rc = ZC_EINTERNAL;
			snprintf(why, why_size, "cannot encode the snapshot: %s", encoder.why);
			goto out;
		}
		for (uint32_t b = 0; b < table[l].blocks; b++) {
			/* Records follow each other unaligned: copy the header out. */
			struct snapshot_block blk;
			memcpy(&blk, map + p, sizeof(blk));
			uint64_t len = snapshot_record_bytes(blk.key_bytes, blk.value_bytes);
			part_key(&keys[n], uid, name, header->fingerprint, generation, l, b);
			items[n] = (struct remote_item){ .key = &keys[n], .value = map + p, .len = len };
			n++;
			p += len;
		}
		part_key(&keys[n], uid, name, header->fingerprint, generation, l, UINT32_MAX);
		items[n] = (struct remote_item){ .key = &keys[n], .value = map + p, .len = end - p };
		n++;
		rc = remote_set_many(remote, items, n, ttl_seconds);
		if (rc < 0) {
			char what[120];
			snprintf(what, sizeof(what), "cannot write layer %u of '%s' to the remote tier", l, name);
			remote_why(remote, what, why, why_size);
			goto out;
		}
		for (size_t i = 0; i < n; i++)
			result->bytes_written += items[i].len;
		result->keys += n;
		fault_point("offload.layer");
	}

	/* The whole image, trailer included, checked by the encoder. */
	if (!image_wait(&encoder, size) || encoder_finish(&encoder, &encoder_thread,
							   &encoder_started) < 0 ||
	    encoder.result.bytes != size) {
		rc = ZC_EINTERNAL;
		snprintf(why, why_size, "cannot encode the snapshot: %s", encoder.why);
		goto out;
	}
	/* The commit point: the manifest, written last. */
	size_t mlen = manifest_bytes(layers);
	manifest = malloc(mlen);
	if (!manifest) {
		rc = -ENOMEM;
		snprintf(why, why_size, "out of memory");
		goto out;
	}
	struct offload_manifest_head head = {
		.magic = OFFLOAD_MANIFEST_MAGIC,
		.version = OFFLOAD_MANIFEST_VERSION,
		.layers = layers,
		.generation = generation,
		.snapshot_bytes = size,
	};
	uint8_t *q = manifest;
	memcpy(q, &head, sizeof(head));
	q += sizeof(head);
	/* The header, the layer table and its checksum, as the file has them. */
	size_t front = SNAPSHOT_HEADER_BYTES + (size_t)layers * SNAPSHOT_LAYER_BYTES + sizeof(uint64_t);
	memcpy(q, map, front);
	q += front;
	memcpy(q, map + size - SNAPSHOT_TRAILER_BYTES, SNAPSHOT_TRAILER_BYTES);
	q += SNAPSHOT_TRAILER_BYTES;
	uint64_t sum = XXH3_64bits(manifest, (size_t)(q - manifest));
	memcpy(q, &sum, sizeof(sum));
	rc = remote_set(remote, &mkey, manifest, mlen, ttl_seconds);
	if (rc < 0) {
		char what[120];
		snprintf(what, sizeof(what), "cannot write the manifest of '%s' to the remote tier", name);
		remote_why(remote, what, why, why_size);
		goto out;
	}
	fault_point("offload.manifest");
	result->bytes_written += mlen;
	result->keys++;
	result->generation = generation;
	result->snapshot_bytes = size;
	/* The old generation is no one's now: best effort, expiry covers the rest. */
	if (has_prev && prev.head.generation != generation)
		offload_delete(remote, uid, name, &prev, false);
	result->elapsed_ns = uv_hrtime() - start_ns;
	rc = 0;
out:
	if (encoder_started) {
		/* A failure before the end: let the encoder finish into the memfd. */
		encoder_finish(&encoder, &encoder_thread, &encoder_started);
	}
	offload_manifest_free(&prev);
	free(manifest);
	free(items);
	free(keys);
	if (map != MAP_FAILED)
		munmap(map, size);
	if (fd >= 0)
		close(fd);
	return rc;
}

int restore_manifest(struct remote *remote, uint32_t uid, const char *name,
		     struct offload_manifest *m, bool *found, uint64_t *bytes_read, char *why,
		     size_t why_size)
{
	*bytes_read = 0;
	int rc = manifest_read(remote, uid, name, m, bytes_read, why, why_size);
	*found = rc != ZC_ENOTFOUND;
	if (rc < 0)
		return rc;
	uint32_t most = 0;
	for (uint32_t l = 0; l < m->head.layers; l++)
		if (m->table[l].blocks > most)
			most = m->table[l].blocks;
	/* A block holds one token at least. */
	if (most > m->header.max_tokens) {
		snprintf(why, why_size, "the manifest names %u blocks in one layer", most);
		offload_manifest_free(m);
		return ZC_ECORRUPT;
	}
	return 0;
}

/*
 * The restore's pipeline (docs/REMOTE.md "Restore"): a fetcher, on a
 * thread of its own, reads each layer's parts (one pipelined batch per
 * layer) and verifies them as they arrive (snapshot_stream_layer); the
 * caller's thread builds each verified layer into the new session's
 * temporary file while later layers are fetched. At most RESTORE_AHEAD
 * layers are held. Nothing is visible until the last part and the
 * whole-snapshot checksum passed and the file is renamed into place.
 */
#define RESTORE_AHEAD 3u

struct fetched_layer {
	struct remote_key *keys;        /* blocks + 1 (the residual last) */
	struct remote_item *items;
	struct snapshot_part *parts;
	store_block *entries;
};

struct restore_pipe {
	struct remote *remote;
	uint32_t uid;
	const char *name;
	const struct offload_manifest *m;
	struct snapshot_stream *stream;
	struct fetched_layer slots[RESTORE_AHEAD];
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint32_t fetched;    /* layers fetched and verified (layer L in slot L % AHEAD) */
	uint32_t built;      /* layers the builder let go of */
	bool stop;           /* the builder failed: fetch no more */
	int rc;              /* the fetcher's failure, with why */
	char why[240];
	uint64_t bytes_read, fetch_ns, verify_ns;
};

static void slot_release(struct fetched_layer *slot, size_t n)
{
	for (size_t i = 0; slot->items && i < n; i++) {
		free(slot->items[i].got);
		slot->items[i].got = NULL;
	}
}

/* Layer l's parts into its slot, each checked; 0 or the failure (why set). */
static int layer_fetch(struct restore_pipe *p, uint32_t l)
{
	const struct offload_manifest *m = p->m;
	const struct snapshot_layer *t = &m->table[l];
	struct fetched_layer *slot = &p->slots[l % RESTORE_AHEAD];
	uint64_t fingerprint = m->header.fingerprint, generation = m->head.generation;
	size_t n = (size_t)t->blocks + 1;
	char why[200];

	for (uint32_t b = 0; b <= t->blocks; b++) {
		part_key(&slot->keys[b], p->uid, p->name, fingerprint, generation, l,
			 b == t->blocks ? UINT32_MAX : b);
		slot->items[b] = (struct remote_item){ .key = &slot->keys[b] };
	}
	uint64_t t0 = uv_hrtime();
	int rc = remote_get_many(p->remote, slot->items, n);
	uint64_t t1 = uv_hrtime();
	p->fetch_ns += t1 - t0;
	if (rc < 0) {
		char what[120];
		snprintf(what, sizeof(what), "cannot read layer %u of '%s' from the remote tier", l,
			 p->name);
		remote_why(p->remote, what, p->why, sizeof(p->why));
		return rc;
	}
	for (size_t i = 0; i < n; i++) {
		p->bytes_read += slot->items[i].got_len;
		if (slot->items[i].status != ZC_ENOTFOUND) {
			slot->parts[i] = (struct snapshot_part){ slot->items[i].got, slot->items[i].got_len };
			continue;
		}
		slot_release(slot, n);
		if (i == n - 1)
			snprintf(p->why, sizeof(p->why), "layer %u residual (generation %llu) is missing "
				 "from the remote tier", l, (unsigned long long)generation);
		else
			snprintf(p->why, sizeof(p->why), "layer %u block %zu (generation %llu) is missing "
				 "from the remote tier", l, i, (unsigned long long)generation);
		return ZC_ENOTFOUND;
	}
	rc = snapshot_stream_layer(p->stream, l, slot->parts, &slot->parts[n - 1], slot->entries, why,
				   sizeof(why));
	p->verify_ns += uv_hrtime() - t1;
	if (rc < 0) {
		slot_release(slot, n);
		snprintf(p->why, sizeof(p->why), "%s", why);
		return rc;
	}
	fault_point("restore.part");
	return 0;
}

static void *fetcher_run(void *arg)
{
	struct restore_pipe *p = arg;
	for (uint32_t l = 0; l < p->m->head.layers; l++) {
		pthread_mutex_lock(&p->lock);
		while (!p->stop && l - p->built >= RESTORE_AHEAD)
			pthread_cond_wait(&p->cond, &p->lock);
		bool stop = p->stop;
		pthread_mutex_unlock(&p->lock);
		if (stop)
			break;
		int rc = layer_fetch(p, l);
		pthread_mutex_lock(&p->lock);
		if (rc < 0)
			p->rc = rc;
		else
			p->fetched = l + 1;
		pthread_cond_broadcast(&p->cond);
		pthread_mutex_unlock(&p->lock);
		if (rc < 0)
			break;
	}
	return NULL;
}

int restore_build(struct remote *remote, uint32_t uid, const char *name,
		  const struct offload_manifest *m, const struct snapshot_expect *expect,
		  const struct restore_target *target, struct store **out,
		  struct restore_result *result, char *why, size_t why_size)
{
	struct restore_pipe p = { .remote = remote, .uid = uid, .name = name, .m = m };
	struct store *store = NULL;
	pthread_t thread;
	bool threaded = false, synced = false;
	uint32_t layers = m->head.layers, most = 0;
	uint64_t start_ns = uv_hrtime();

	*out = NULL;
	memset(result, 0, sizeof(*result));
	int rc = snapshot_stream_open(&m->header, m->table, m->table_checksum, expect, &p.stream, why,
				      why_size);
	if (rc < 0)
		return rc;
	for (uint32_t l = 0; l < layers; l++)
		if (m->table[l].blocks > most)
			most = m->table[l].blocks;
	for (uint32_t i = 0; i < RESTORE_AHEAD; i++) {
		struct fetched_layer *slot = &p.slots[i];
		slot->keys = calloc((size_t)most + 1, sizeof(*slot->keys));
		slot->items = calloc((size_t)most + 1, sizeof(*slot->items));
		slot->parts = calloc((size_t)most + 1, sizeof(*slot->parts));
		slot->entries = calloc((size_t)most + 1, sizeof(*slot->entries));
		if (!slot->keys || !slot->items || !slot->parts || !slot->entries) {
			rc = -ENOMEM;
			snprintf(why, why_size, "out of memory");
			goto out;
		}
	}
	if (pthread_mutex_init(&p.lock, NULL) == 0) {
		if (pthread_cond_init(&p.cond, NULL) == 0) {
			synced = true;
			threaded = pthread_create(&thread, NULL, fetcher_run, &p) == 0;
		} else {
			pthread_mutex_destroy(&p.lock);
		}
	}

	for (uint32_t l = 0; l < layers; l++) {
		uint64_t t0 = uv_hrtime();
		if (threaded) {
			pthread_mutex_lock(&p.lock);
			while (p.fetched <= l && p.rc == 0)
				pthread_cond_wait(&p.cond, &p.lock);
			rc = p.rc;
			pthread_mutex_unlock(&p.lock);
		} else {
			/* No thread: each layer fetched, then built, in line. */
			rc = layer_fetch(&p, l);
			p.rc = rc;
		}
		uint64_t t1 = uv_hrtime();
		result->wait_ns += t1 - t0;
		if (rc < 0) {
			snprintf(why, why_size, "%s", p.why);
			goto out;
		}
		struct fetched_layer *slot = &p.slots[l % RESTORE_AHEAD];
		/* The session's file is made once its first layer passed. */
		if (!store) {
			rc = snapshot_build_begin(&m->header, target->params, target->dir_fd,
						  target->dir_path, target->budget, target->pool, &store,
						  why, why_size);
			if (rc < 0)
				goto out;
		}
		rc = snapshot_build_layer(store, &m->header, l, &m->table[l], slot->parts,
					  slot->entries, slot->parts[m->table[l].blocks].bytes, why,
					  why_size);
		slot_release(slot, (size_t)m->table[l].blocks + 1);
		result->build_ns += uv_hrtime() - t1;
		if (rc < 0)
			goto out;
		if (threaded) {
			pthread_mutex_lock(&p.lock);
			p.built = l + 1;
			pthread_cond_broadcast(&p.cond);
			pthread_mutex_unlock(&p.lock);
		}
		fault_point("restore.layer");
	}
	/* Every part passed: the whole-snapshot checksum, then the commit. */
	rc = snapshot_stream_end(p.stream, &m->trailer, why, why_size);
	if (rc < 0)
		goto out;
	fault_point("restore.fetched");
	uint64_t t2 = uv_hrtime();
	rc = store_import_commit(store);
	result->build_ns += uv_hrtime() - t2;
	if (rc < 0) {
		store = NULL;   /* the commit threw it away */
		snprintf(why, why_size, "cannot put the session's file in place: %s", zc_strerror(rc));
		goto out;
	}
	*out = store;
	store = NULL;
out:
	if (threaded) {
		pthread_mutex_lock(&p.lock);
		p.stop = true;
		pthread_cond_broadcast(&p.cond);
		pthread_mutex_unlock(&p.lock);
		pthread_join(thread, NULL);
	}
	if (synced) {
		pthread_cond_destroy(&p.cond);
		pthread_mutex_destroy(&p.lock);
	}
	/* Layers fetched and not built (a failure): their buffers. */
	for (uint32_t i = 0; i < RESTORE_AHEAD; i++) {
		slot_release(&p.slots[i], (size_t)most + 1);
		free(p.slots[i].keys);
		free(p.slots[i].items);
		free(p.slots[i].parts);
		free(p.slots[i].entries);
	}
	if (store)
		store_import_abandon(store);
	snapshot_stream_free(p.stream);
	result->bytes_read = p.bytes_read;
	result->fetch_ns = p.fetch_ns;
	result->verify_ns = p.verify_ns;
	result->elapsed_ns = uv_hrtime() - start_ns;
	result->overlapped = threaded;
	return rc;
}

int offload_delete(struct remote *remote, uint32_t uid, const char *name,
		   const struct offload_manifest *m, bool with_manifest)
{
	int first = 0;
	if (with_manifest) {
		struct remote_key key;
		const struct remote_key *one = &key;
		manifest_key(&key, uid, name);
		first = remote_del_many(remote, &one, 1, NULL);
		if (first < 0)
			return first;   /* the parts stay readable while the manifest does */
	}
	for (uint32_t l = 0; l < m->head.layers; l++) {
		uint32_t n = m->table[l].blocks + 1;
		struct remote_key *keys = calloc(n, sizeof(*keys));
		const struct remote_key **refs = calloc(n, sizeof(*refs));
		if (!keys || !refs) {
			free(keys);
			free(refs);
			return -ENOMEM;
		}
		for (uint32_t b = 0; b < n; b++) {
			part_key(&keys[b], uid, name, m->header.fingerprint, m->head.generation, l,
				 b == n - 1 ? UINT32_MAX : b);
			refs[b] = &keys[b];
		}
		int rc = remote_del_many(remote, refs, n, NULL);
		if (rc < 0 && first == 0)
			first = rc;
		free(refs);
		free(keys);
	}
	return first;
}

/* ---- scheduling, on the loop thread ---- */

static void state_failed(struct server *server, const char *name, int rc, const char *why)
{
	struct offload_state *s = &server->offload;
	uint64_t now = session_now_ms();
	s->backoff_ms = s->failing ? s->backoff_ms * 2 : OFFLOAD_BACKOFF_MIN_MS;
	if (s->backoff_ms > OFFLOAD_BACKOFF_MAX_MS)
		s->backoff_ms = OFFLOAD_BACKOFF_MAX_MS;
	s->retry_at_ms = now + s->backoff_ms;
	if (!s->failing)
		log_warn("remote", "offload failing", "session_name=%s error=%s reason=\"%s\" retry_ms=%u",
			 name, zc_strerror(rc), why, s->backoff_ms);
	s->failing = true;
}

static void state_succeeded(struct server *server)
{
	struct offload_state *s = &server->offload;
	if (s->failing)
		log_info("remote", "offload working again", "after_backoff_ms=%u", s->backoff_ms);
	s->failing = false;
	s->backoff_ms = 0;
	s->retry_at_ms = 0;
}

static bool offload_allowed(struct server *server, uint64_t now)
{
	return server->remote && !server->stopping && now >= server->offload.retry_at_ms;
}

/* Drops the local copy once the remote one is committed. */
static void session_drop_offloaded(struct server *server, struct session *session,
				   const struct offload_result *result, const char *why_text)
{
	log_info("session", "offloaded", "session=%llu name=%s uid=%u generation=%llu bytes=%llu "
		 "snapshot_bytes=%llu ms=%.3f cause=%s", (unsigned long long)session->id, session->name,
		 session->owner_uid, (unsigned long long)result->generation,
		 (unsigned long long)result->bytes_written, (unsigned long long)result->snapshot_bytes,
		 (double)result->elapsed_ns * 1e-6, why_text);
	remote_count_offload(server->remote, result->elapsed_ns);
	server->offload.offloaded++;
	session_retire(&server->sessions, session, true);
	fault_point("offload.dropped");
}

/* A cleanup off the loop: the manifest and parts of one generation. */
struct cleanup_job {
	struct job job;
	struct server *server;
	uint32_t uid;
	char name[STORE_NAME_BYTES];
	uint64_t generation;   /* only this generation's manifest is deleted */
};

static void cleanup_run(struct job *base)
{
	struct cleanup_job *job = (struct cleanup_job *)base;
	struct offload_manifest m;
	char why[200];
	if (manifest_read(job->server->remote, job->uid, job->name, &m, NULL, why, sizeof(why)) < 0)
		return;
	if (m.head.generation == job->generation)
		offload_delete(job->server->remote, job->uid, job->name, &m, true);
	offload_manifest_free(&m);
}

static void cleanup_done(struct job *base)
{
	free(base);
}

void offload_forget(struct server *server, uint32_t uid, const char *name, uint64_t generation)
{
	struct cleanup_job *job = calloc(1, sizeof(*job));
	if (!job)
		return;   /* expiry takes it */
	job->server = server;
	job->uid = uid;
	snprintf(job->name, sizeof(job->name), "%s", name);
	job->generation = generation;
	job->job.run = cleanup_run;
	job->job.done = cleanup_done;
	session_table_run_detached(&server->sessions, &job->job);
}

struct offload_job {
	struct job job;
	struct server *server;
	uint64_t used_ms;      /* the session's last use when the offload was queued */
	uint32_t uid;
	char name[STORE_NAME_BYTES];
	int rc;
	char why[240];
	struct offload_result result;
};

static void offload_run(struct job *base)
{
	struct offload_job *job = (struct offload_job *)base;
	if (base->session->closed) {
		job->rc = ZC_ENOTFOUND;
		return;
	}
	job->rc = offload_write(job->server->remote, base->session->store, job->uid, job->name,
				job->server->options.remote_ttl_seconds, &job->result, job->why,
				sizeof(job->why));
}

/*
 * On the loop thread, so atomic with respect to dispatch: a session used
 * since the offload was queued (a request answered, one queued behind it,
 * a live lease) keeps its local copy, which stays the live one, and the
 * remote copy just written is forgotten; else the local copy goes.
 */
static void offload_done(struct job *base)
{
	struct offload_job *job = (struct offload_job *)base;
	struct server *server = job->server;
	struct session *session = base->session;

	if (job->rc == ZC_ENOTFOUND && session->closed) {
		free(job);
		return;
	}
	if (job->rc < 0) {
		remote_count_offload_failure(server->remote, job->rc == ZC_EINTERNAL || job->rc == -ENOMEM ?
							     REMOTE_FAILURE_LOCAL : REMOTE_FAILURE_REMOTE);
		state_failed(server, job->name, job->rc, job->why);
		free(job);
		return;
	}
	state_succeeded(server);
	uint64_t now = session_now_ms();
	if (session->closed || session->last_used_ms != job->used_ms || session->queue_head ||
	    session->flushes || session_leased(session, now)) {
		remote_count_offload_failure(server->remote, REMOTE_FAILURE_TOUCHED);
		log_info("session", "offload abandoned", "session=%llu name=%s reason=\"used while it "
			 "was written: the local copy stays the live one\"", (unsigned long long)session->id,
			 session->name);
		offload_forget(server, job->uid, job->name, job->result.generation);
		free(job);
		return;
	}
	session_drop_offloaded(server, session, &job->result, "idle");
	free(job);
}

/* Whether a session may be offloaded now: nothing queued or running, no
 * live lease (a client may be reading its views). */
static bool offload_candidate(const struct session *s, uint64_t now)
{
	return !s->closed && session_idle(s) && !session_leased(s, now);
}

void offload_scan(struct server *server, uint64_t now)
{
	uint64_t idle_ms = server->options.offload_idle_seconds * 1000;
	if (idle_ms == 0 || !offload_allowed(server, now))
		return;
	for (size_t i = 0; i < server->sessions.count; i++) {
		struct session *s = server->sessions.items[i];
		if (!offload_candidate(s, now) || now - s->last_used_ms < idle_ms)
			continue;
		struct offload_job *job = calloc(1, sizeof(*job));
		if (!job)
			return;
		job->server = server;
		job->used_ms = s->last_used_ms;
		job->uid = s->owner_uid;
		snprintf(job->name, sizeof(job->name), "%s", s->name);
		job->job.session = s;
		job->job.run = offload_run;
		job->job.done = offload_done;
		/* Redis I/O: always on the thread pool. */
		job->job.cost = UINT64_MAX;
		/* Writing it out is not using it. */
		job->job.observe_only = true;
		session_submit(&server->sessions, &job->job);
	}
}

static int by_last_use(const void *a, const void *b)
{
	const struct session *x = *(struct session *const *)a, *y = *(struct session *const *)b;
	return x->last_used_ms < y->last_used_ms ? -1 : x->last_used_ms > y->last_used_ms;
}

uint64_t offload_relief(struct server *server, uint64_t wanted, const struct session *keep,
			uint32_t uid, bool own_only)
{
	struct session_table *table = &server->sessions;
	uint64_t now = session_now_ms(), freed = 0;
	if (!offload_allowed(server, now) || table->count == 0)
		return 0;
	struct session **candidates = calloc(table->count, sizeof(*candidates));
	size_t count = 0;
	if (!candidates)
		return 0;
	for (size_t i = 0; i < table->count; i++) {
		struct session *s = table->items[i];
		if (s != keep && offload_candidate(s, now) && (!own_only || s->owner_uid == uid))
			candidates[count++] = s;
	}
	qsort(candidates, count, sizeof(*candidates), by_last_use);
	/* On the loop thread with the session idle: nothing else can touch it
	 * until this returns, and relief wants the memory now. */
	for (size_t i = 0; i < count && freed < wanted; i++) {
		struct session *s = candidates[i];
		struct offload_result result;
		char why[240];
		int rc = offload_write(server->remote, s->store, s->owner_uid, s->name,
				       server->options.remote_ttl_seconds, &result, why, sizeof(why));
		if (rc < 0) {
			remote_count_offload_failure(server->remote, rc == ZC_EINTERNAL || rc == -ENOMEM ?
								     REMOTE_FAILURE_LOCAL : REMOTE_FAILURE_REMOTE);
			state_failed(server, s->name, rc, why);
			break;
		}
		state_succeeded(server);
		uint64_t before = server_memory_bytes(server);
		session_drop_offloaded(server, s, &result, "memory relief");
		session_release_if_unused(s);
		uint64_t after = server_memory_bytes(server);
		freed += before > after ? before - after : 1;
	}
	free(candidates);
	return freed;
}
