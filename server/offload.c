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
	snprintf(why, why_size, "%s: %s", what, text);
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
	e->rc = snapshot_export(e->store, e->fd, false, &e->result, e->why, sizeof(e->why));
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

int restore_fetch(struct remote *remote, uint32_t uid, const char *name, int *fd_out,
		  struct offload_manifest *m, bool *found, uint64_t *bytes_read, char *why,
		  size_t why_size)
{
	struct remote_key *keys = NULL;
	struct remote_item *items = NULL;
	int fd = -1;

	*fd_out = -1;
	*bytes_read = 0;
	int rc = manifest_read(remote, uid, name, m, bytes_read, why, why_size);
	*found = rc != ZC_ENOTFOUND;
	if (rc < 0)
		return rc;
	fd = memfd_create("zipcache-restore", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)m->head.snapshot_bytes) < 0) {
		rc = -errno;
		snprintf(why, why_size, "cannot make a buffer for the snapshot: %s", strerror(errno));
		goto fail;
	}
	/* The header, the layer table and the trailer come from the manifest. */
	uint64_t table_bytes = (uint64_t)m->head.layers * SNAPSHOT_LAYER_BYTES;
	if (pwrite(fd, &m->header, SNAPSHOT_HEADER_BYTES, 0) != SNAPSHOT_HEADER_BYTES ||
	    pwrite(fd, m->table, table_bytes, SNAPSHOT_HEADER_BYTES) != (ssize_t)table_bytes ||
	    pwrite(fd, &m->table_checksum, sizeof(uint64_t), SNAPSHOT_HEADER_BYTES + table_bytes) !=
		    sizeof(uint64_t) ||
	    pwrite(fd, &m->trailer, SNAPSHOT_TRAILER_BYTES,
		   (off_t)(m->head.snapshot_bytes - SNAPSHOT_TRAILER_BYTES)) != SNAPSHOT_TRAILER_BYTES) {
		rc = -EIO;
		snprintf(why, why_size, "cannot write the snapshot's buffer");
		goto fail;
	}
	uint32_t most = 0;
	for (uint32_t l = 0; l < m->head.layers; l++)
		if (m->table[l].blocks > most)
			most = m->table[l].blocks;
	/* A block holds one token at least. */
	if (most > m->header.max_tokens) {
		rc = ZC_ECORRUPT;
		snprintf(why, why_size, "the manifest names %u blocks in one layer", most);
		goto fail;
	}
	keys = calloc((size_t)most + 1, sizeof(*keys));
	items = calloc((size_t)most + 1, sizeof(*items));
	if (!keys || !items) {
		rc = -ENOMEM;
		snprintf(why, why_size, "out of memory");
		goto fail;
	}
	uint64_t fingerprint = m->header.fingerprint, generation = m->head.generation;
	/* One layer's parts at a time: at most a layer is held twice. */
	for (uint32_t l = 0; l < m->head.layers; l++) {
		const struct snapshot_layer *t = &m->table[l];
		size_t n = 0;
		for (uint32_t b = 0; b <= t->blocks; b++) {
			part_key(&keys[n], uid, name, fingerprint, generation, l,
				 b == t->blocks ? UINT32_MAX : b);
			items[n] = (struct remote_item){ .key = &keys[n] };
			n++;
		}
		rc = remote_get_many(remote, items, n);
		if (rc < 0) {
			char what[120];
			snprintf(what, sizeof(what), "cannot read layer %u of '%s' from the remote tier", l,
				 name);
			remote_why(remote, what, why, why_size);
			goto fail;
		}
		uint64_t p = t->offset, end = t->offset + t->bytes;
		for (size_t i = 0; i < n && rc == 0; i++) {
			bool residual = i == n - 1;
			if (items[i].status == ZC_ENOTFOUND) {
				rc = ZC_ENOTFOUND;
				if (residual)
					snprintf(why, why_size, "layer %u residual (generation %llu) is "
						 "missing from the remote tier", l, (unsigned long long)generation);
				else
					snprintf(why, why_size, "layer %u block %zu (generation %llu) is "
						 "missing from the remote tier", l, i,
						 (unsigned long long)generation);
			} else if (items[i].got_len > end - p || (residual && items[i].got_len != end - p)) {
				rc = ZC_ECORRUPT;
				snprintf(why, why_size, "%s of layer %u is %zu bytes, not what the manifest's "
					 "layer table leaves for it", residual ? "the residual" : "a block", l,
					 items[i].got_len);
			} else if (items[i].got_len &&
				   pwrite(fd, items[i].got, items[i].got_len, (off_t)p) !=
					   (ssize_t)items[i].got_len) {
				rc = -EIO;
				snprintf(why, why_size, "cannot write the snapshot's buffer");
			}
			p += items[i].got_len;
			*bytes_read += items[i].got_len;
		}
		for (size_t i = 0; i < n; i++) {
			free(items[i].got);
			items[i].got = NULL;
		}
		if (rc < 0)
			goto fail;
	}
	free(items);
	free(keys);
	*fd_out = fd;
	return 0;
fail:
	free(items);
	free(keys);
	if (fd >= 0)
		close(fd);
	offload_manifest_free(m);
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
