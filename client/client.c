/*
 * libzipcache: requests, replies and the read-only view mappings. One
 * request is in flight at a time (the API is blocking), so the next reply
 * on the socket is always the one we wait for, as long as every request
 * sent got its reply read. When that fails (a timeout, a reply that makes
 * no sense, the daemon gone) the stream can no longer be trusted: a late
 * reply, with its descriptors, may still arrive and would answer the next
 * request. So the connection is marked broken, as hiredis's c->err, and
 * refuses every call until zc_client_reconnect() dials afresh.
 */
#include "zipcache/client.h"

#include <errno.h>
#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kv_layout.h"
#include "zipcache/map.h"
#include "request_ring.h"
#include "transport.h"
#include "version.h"
#include "wire.h"

/* Below this many K+V bytes a block goes inline: a copy into the frame is
 * cheaper than the staging round trip's bookkeeping. */
#define INLINE_LIMIT_BYTES (256u << 10)

/* A daemon's write of one layer takes microseconds to milliseconds: a
 * reader yields this many times before it starts to look at the clock and
 * the socket, then looks once per VIEW_POLL_NS. */
#define VIEW_SPINS 1000
#define VIEW_POLL_NS 1000000

struct zc_session {
	zc_client *client;
	zc_session_info info;
	const uint8_t *mapping;        /* the session map (zipcache/map.h) */
	size_t mapping_bytes;
	uint64_t header_bytes;
	const uint8_t *pool;           /* the uid's block pool */
	size_t pool_bytes;
	uint64_t *key_offsets;
	uint64_t *value_offsets;
	zc_session *prev, *next;
	int64_t lease_until_ms;        /* this client's lease on the views, as the daemon counts it */
	struct session_mass *masses;   /* per layer, what its next update carries; NULL: none yet */
};

/* Attention masses the next update of a layer carries
 * (zc_session_set_attention_mass): count floats, 0 when none. */
struct session_mass {
	float *data;
	size_t count;
	uint32_t first_token;
};

/* An asynchronous update whose reply has not been read. */
struct pending {
	uint64_t id;
	zc_session *session;
	uint32_t layer;
	int64_t sent_ms;
	bool ring;        /* went through the request ring, not the socket */
};

/* The daemon's refusal of one, kept until its ticket is waited for. */
struct failure {
	uint64_t id;
	uint64_t session_id;
	uint32_t layer;
	int rc;
	bool announced;   /* returned once by a later call already */
	char message[257];
};

struct zc_client {
	struct transport transport;
	char socket_path[108];
	int timeout_ms;
	unsigned receive_spin_us;      /* zc_client_set_receive_spin */
	uint64_t next_request_id;
	zc_server_info server;
	char last_error[257];
	int broken;                /* 0, or the code of the failure that broke the connection */
	char broken_error[257];    /* the last_error of that failure */
	uint8_t *send_buffer;
	size_t send_capacity;
	uint8_t *staging;
	size_t staging_bytes;
	zc_session *sessions;
	/* Asynchronous updates sent, oldest first, and the refusals their
	 * replies brought that no zc_wait collected yet. */
	struct pending pending[ZC_ASYNC_WINDOW];
	unsigned n_pending, window;
	struct failure failures[ZC_ASYNC_WINDOW];
	unsigned n_failures;
	/* Asynchronous requests encoded but not yet written: the first
	 * `unsent` bytes of send_buffer, `unsent_frames` requests; written
	 * once `batch` of them wait, or before anything reads a reply. */
	size_t unsent;
	unsigned unsent_frames, batch;
	/* The request ring (docs/RING.md): asked for at the first
	 * zc_update_async, of ring_bytes (0: never); ring_refused once the
	 * daemon could not make one on this connection. Socket-sent updates
	 * in flight keep later ones off the ring (and the ring must be taken
	 * before the socket carries one): the daemon sees one order. */
	struct request_ring ring;
	size_t ring_bytes;
	bool ring_refused;
	unsigned socket_pending;
};

static int error_set(zc_client *client, int rc, const char *message)
{
	snprintf(client->last_error, sizeof(client->last_error), "%s", message ? message : "");
	return rc;
}

/* A failure after which the stream is out of step: see the top of file.
 * message NULL keeps the last error's sentence. */
static int client_break(zc_client *client, int rc, const char *message)
{
	if (message)
		error_set(client, rc, message);
	if (!client->broken) {
		client->broken = rc;
		memcpy(client->broken_error, client->last_error, sizeof(client->broken_error));
	}
	return rc;
}

/* What every call on a broken connection returns, before the socket. */
static int client_refuse_broken(zc_client *client)
{
	snprintf(client->last_error, sizeof(client->last_error),
		 "the connection broke earlier (%s: %.180s); call zc_client_reconnect",
		 zc_error_name(client->broken), client->broken_error);
	return ZC_EBROKEN;
}

static int64_t now_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

static int async_drain(zc_client *client);
static void async_forget(zc_client *client);
static bool ring_usable(zc_client *client, size_t len);
static int ring_write(zc_client *client, size_t len);

/*
 * Encodes request at send_buffer + used (*len: its frame's bytes). The
 * buffer is tried as it is first, since it almost always has room: a
 * separate sizing pass costs about half as much again as the encode.
 * Only when it is short is the frame sized and the buffer grown.
 */
static int request_encode(zc_client *client, const wire_request *request, size_t used,
			  size_t *len)
{
	int rc = ZC_EBUFFER;
	if (used < client->send_capacity)
		rc = wire_request_encode(request, client->send_buffer + used,
					 client->send_capacity - used, len);
	if (rc != ZC_EBUFFER)
		return rc;
	size_t size;
	if ((rc = wire_request_frame_size(request, &size)) < 0)
		return rc;
	uint8_t *buffer = realloc(client->send_buffer, used + size);
	if (!buffer)
		return -ENOMEM;
	client->send_buffer = buffer;
	client->send_capacity = used + size;
	return wire_request_encode(request, client->send_buffer + used, size, len);
}

/* Sends one request and waits for its reply; on success *response holds
 * it (free with wire_response_free) and any descriptors it carried are in
 * fds[0..n_fds). */
static int call_fd(zc_client *client, wire_request *request, wire_response *response,
		   int *fds, int max_fds, int send_fd)
{
	size_t len;
	const uint8_t *frame;
	char message[160];
	int rc;

	if (client->broken)
		return client_refuse_broken(client);
	/* The next reply on the socket must be this call's. */
	rc = async_drain(client);
	if (rc < 0)
		return rc;
	client->last_error[0] = '\0';
	request->request_id = client->next_request_id++;
	rc = request_encode(client, request, 0, &len);
	if (rc < 0)
		return error_set(client, rc, rc == -ENOMEM ? "out of memory" :
					 "request cannot be encoded");
	/* From here on a failure leaves the request's fate unknown and the
	 * stream out of step: each one breaks the connection. An update goes
	 * through the request ring when there is one (nothing is in flight:
	 * the ring is empty; its reply comes back through either way). */
	int sent;
	if (send_fd < 0 && request->op == WIRE_OP_UPDATE_AND_FETCH && ring_usable(client, len)) {
		if ((rc = ring_write(client, len)) < 0)
			return rc;
		sent = 0;
	} else {
		sent = send_fd >= 0 ?
		       transport_send_fd(&client->transport, client->send_buffer, len, send_fd) :
		       transport_send(&client->transport, client->send_buffer, len);
	}
	if (sent < 0 && sent != -EPIPE && sent != -ECONNRESET)
		return client_break(client, sent, sent == -ETIMEDOUT ?
				    "timed out sending the request" : "cannot send the request");
	/* A daemon that refused the connection (a limit, a stop) said why
	 * before closing: the reply may be waiting even though the send failed. */
	rc = transport_receive(&client->transport, &frame, &len);
	if (rc < 0)
		return client_break(client, sent < 0 ? sent : rc,
				    sent < 0 ? "cannot send the request" :
				    rc == -ETIMEDOUT ? "timed out waiting for the daemon's reply" :
				    rc == -ECONNRESET ? "the daemon closed the connection" :
				    "no reply from the daemon");
	rc = wire_response_decode(frame, len, response);
	transport_consume(&client->transport);
	if (rc < 0)
		return client_break(client, rc, "malformed reply from the daemon");
	if (response->request_id == 0 && response->status != WIRE_STATUS_OK) {
		/* About the connection, not a request (a limit, a stop, a frame
		 * too large): the daemon closes it after saying so. */
		rc = wire_error_from_status(response->status);
		client_break(client, rc, response->message);
		wire_response_free(response);
		return rc;
	}
	if (response->request_id != request->request_id) {
		snprintf(message, sizeof(message), "reply to request %llu, expected %llu",
			 (unsigned long long)response->request_id,
			 (unsigned long long)request->request_id);
		wire_response_free(response);
		return client_break(client, ZC_EPROTOCOL, message);
	}
	if (response->fds > (uint32_t)max_fds) {
		snprintf(message, sizeof(message), "reply announced %u descriptors; at most %d "
			 "were expected", response->fds, max_fds);
		wire_response_free(response);
		return client_break(client, ZC_EPROTOCOL, message);
	}
	int n_fds = (int)response->fds;
	if (transport_take_fds(&client->transport, fds, n_fds) < 0) {
		snprintf(message, sizeof(message), "reply announced %d descriptors, %d arrived",
			 n_fds, transport_unclaimed_fds(&client->transport));
		wire_response_free(response);
		return client_break(client, ZC_EPROTOCOL, message);
	}
	if (transport_unclaimed_fds(&client->transport) > 0) {
		/* Descriptors no reply announced belong to no call. */
		for (int i = 0; i < n_fds; i++)
			close(fds[i]);
		wire_response_free(response);
		return client_break(client, ZC_EPROTOCOL, "descriptors arrived that no reply announced");
	}
	if (response->status != WIRE_STATUS_OK) {
		rc = wire_error_from_status(response->status);
		error_set(client, rc, response->message);
		for (int i = 0; i < n_fds; i++)
			close(fds[i]);
		wire_response_free(response);
		return rc;
	}
	return n_fds;
}

static int call(zc_client *client, wire_request *request, wire_response *response,
		int *fds, int max_fds)
{
	return call_fd(client, request, response, fds, max_fds, -1);
}

static int hello(zc_client *client)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_HELLO;
	request.hello.protocol_version = ZIPCACHE_PROTOCOL_VERSION;
	snprintf(request.hello.client_name, sizeof(request.hello.client_name),
		 "libzipcache/%s", ZIPCACHE_VERSION);
	int rc = call(client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	if (response.op != WIRE_OP_HELLO ||
	    response.hello.protocol_version != ZIPCACHE_PROTOCOL_VERSION) {
		wire_response_free(&response);
		return client_break(client, ZC_EPROTOCOL, "daemon speaks another protocol version");
	}
	client->server = response.hello;
	wire_response_free(&response);
	return 0;
}

int zc_client_connect(const char *socket_path, int timeout_ms, zc_client **out)
{
	zc_client *client = calloc(1, sizeof(*client));
	int rc;

	if (!client)
		return -ENOMEM;
	if (strlen(socket_path) >= sizeof(client->socket_path)) {
		free(client);
		return -ENAMETOOLONG;
	}
	snprintf(client->socket_path, sizeof(client->socket_path), "%s", socket_path);
	client->timeout_ms = timeout_ms;
	client->next_request_id = 1;
	client->window = ZC_ASYNC_WINDOW;
	client->batch = 1;
	client->receive_spin_us = ZC_RECEIVE_SPIN_US;
	client->ring_bytes = ZC_ASYNC_RING_BYTES;
	client->ring.eventfd = -1;
	rc = transport_connect(&client->transport, socket_path, timeout_ms, ZC_RECEIVE_SPIN_US);
	if (rc == 0)
		rc = hello(client);
	if (rc < 0) {
		transport_close(&client->transport);
		free(client->send_buffer);
		free(client);
		return rc;
	}
	*out = client;
	return 0;
}

static void staging_unmap(zc_client *client)
{
	if (client->staging)
		munmap(client->staging, client->staging_bytes);
	client->staging = NULL;
	client->staging_bytes = 0;
}

void zc_client_close(zc_client *client)
{
	if (!client)
		return;
	while (client->sessions)
		zc_session_release(client->sessions);
	staging_unmap(client);
	request_ring_unmap(&client->ring);
	transport_close(&client->transport);
	free(client->send_buffer);
	free(client);
}

int zc_client_reconnect(zc_client *client)
{
	uint64_t epoch = client->server.boot_epoch;
	/* Whatever the old socket still holds (a late reply, its descriptors)
	 * goes with it. */
	transport_close(&client->transport);
	/* The daemon's staging buffer and ring belonged to the old connection. */
	staging_unmap(client);
	request_ring_unmap(&client->ring);
	client->ring_refused = false;
	/* What was in flight on it is lost with it (each update wholly or not
	 * at all; see the top of client.h). */
	async_forget(client);
	client->n_failures = 0;
	client->broken = 0;
	int rc = transport_connect(&client->transport, client->socket_path, client->timeout_ms,
				   (int)client->receive_spin_us);
	if (rc < 0)
		return client_break(client, rc, "cannot connect to the daemon");
	rc = hello(client);
	if (rc < 0) {
		/* A hello the daemon refused is a connection it does not want. */
		if (!client->broken)
			client_break(client, rc, NULL);
		return rc;
	}
	if (client->server.boot_epoch != epoch)
		return error_set(client, ZC_ERESTARTED, "the daemon restarted: reopen sessions with attach");
	return 0;
}

int zc_client_set_timeout(zc_client *client, int timeout_ms)
{
	if (timeout_ms < 0)
		return error_set(client, -EINVAL, "a timeout is 0 (none) or a positive number of ms");
	int rc = transport_set_timeout(&client->transport, timeout_ms);
	if (rc < 0)
		return error_set(client, rc, "cannot set the socket's timeout");
	client->timeout_ms = timeout_ms;
	return 0;
}

int zc_client_set_receive_spin(zc_client *client, unsigned microseconds)
{
	if (microseconds > ZC_RECEIVE_SPIN_US_MAX)
		return error_set(client, ZC_EINVALID,
				 "a receive spin is 0 .. ZC_RECEIVE_SPIN_US_MAX microseconds");
	client->receive_spin_us = microseconds;
	client->transport.spin_us = (int)microseconds;
	return 0;
}

int zc_client_broken(const zc_client *client)
{
	return client->broken;
}

const zc_server_info *zc_client_server_info(const zc_client *client)
{
	return &client->server;
}

const char *zc_client_last_error(const zc_client *client)
{
	return client->last_error;
}

void zc_session_config_default(zc_session_config *config)
{
	memset(config, 0, sizeof(*config));
	config->batch = 1;
	zc_codec_config_default(&config->codec);
	config->policy = ZC_POLICY_STREAMING;
}

/* Maps the session map and the pool, and records where each layer's K
 * and V views live; checks the layout against the mappings so a bad reply
 * cannot send us out of them. */
static int session_map(zc_session *session, const int *fds, const struct wire_view_layout *view)
{
	const zc_session_info *info = &session->info;
	uint64_t key_bytes = kv_block_bytes(info->batch, info->kv_heads, info->max_tokens, info->head_dim_k);
	uint64_t value_bytes = kv_block_bytes(info->batch, info->kv_heads, info->max_tokens,
					      info->head_dim_v);

	if (view->key_offsets_count != info->layers || view->value_offsets_count != info->layers ||
	    info->layers == 0 || view->header_bytes > view->mapping_bytes ||
	    sizeof(zc_map_header) + info->layers * sizeof(zc_map_layer) > view->header_bytes)
		return ZC_EPROTOCOL;
	for (uint32_t i = 0; i < info->layers; i++) {
		if (view->key_offsets[i] == 0 && view->value_offsets[i] == 0)
			continue;   /* views = none */
		if (view->key_offsets[i] > view->mapping_bytes ||
		    key_bytes > view->mapping_bytes - view->key_offsets[i] ||
		    view->value_offsets[i] > view->mapping_bytes ||
		    value_bytes > view->mapping_bytes - view->value_offsets[i] ||
		    (view->key_offsets[i] | view->value_offsets[i]) & 1)
			return ZC_EPROTOCOL;
	}
	session->key_offsets = calloc(info->layers, sizeof(uint64_t));
	session->value_offsets = calloc(info->layers, sizeof(uint64_t));
	if (!session->key_offsets || !session->value_offsets)
		return -ENOMEM;
	memcpy(session->key_offsets, view->key_offsets, info->layers * sizeof(uint64_t));
	memcpy(session->value_offsets, view->value_offsets, info->layers * sizeof(uint64_t));
	/* PROT_READ on a read-only descriptor: the mapping can never become
	 * writable, not even with mprotect(). */
	void *mapping = mmap(NULL, view->mapping_bytes, PROT_READ, MAP_SHARED, fds[0], 0);
	if (mapping == MAP_FAILED)
		return -errno;
	session->mapping = mapping;
	session->mapping_bytes = view->mapping_bytes;
	session->header_bytes = view->header_bytes;
	const zc_map_header *m = mapping;
	if (memcmp(m->magic, ZC_MAP_MAGIC, sizeof(m->magic)) != 0 || m->version != ZC_MAP_VERSION ||
	    m->layers != info->layers || m->batch != info->batch || m->kv_heads != info->kv_heads ||
	    m->head_dim_k != info->head_dim_k || m->head_dim_v != info->head_dim_v ||
	    m->max_tokens != info->max_tokens || m->map_bytes != view->mapping_bytes ||
	    m->table_offset < m->header_bytes || m->table_bytes < m->max_blocks * sizeof(zc_map_block) ||
	    m->table_offset + (uint64_t)m->layers * m->table_bytes > m->map_bytes ||
	    (m->residual_offset &&
	     m->residual_offset + (uint64_t)m->layers * m->residual_bytes > m->map_bytes) ||
	    m->pool_bytes == 0)
		return ZC_EPROTOCOL;
	void *pool = mmap(NULL, m->pool_bytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, fds[1], 0);
	if (pool == MAP_FAILED)
		return -errno;
	session->pool = pool;
	session->pool_bytes = m->pool_bytes;
	return 0;
}

static void session_free(zc_session *session)
{
	if (session->mapping)
		munmap((void *)session->mapping, session->mapping_bytes);
	if (session->pool)
		munmap((void *)session->pool, session->pool_bytes);
	free(session->key_offsets);
	free(session->value_offsets);
	if (session->masses)
		for (uint32_t i = 0; i < session->info.layers; i++)
			free(session->masses[i].data);
	free(session->masses);
	free(session);
}

int zc_session_set_attention_mass(zc_session *session, uint32_t layer, uint32_t first_token,
				  const float *mass, size_t count)
{
	if (!session)
		return ZC_EINVALID;
	zc_client *client = session->client;
	const zc_session_info *info = &session->info;
	size_t row = (size_t)info->batch * info->kv_heads;

	if (layer >= info->layers)
		return error_set(client, ZC_EINVALID, "layer out of range");
	if (info->codec.saliency != ZC_SALIENCY_ATTENTION)
		return error_set(client, ZC_EPRECONDITION, "attention masses are for a session "
				 "opened with saliency = attention; this one ranks by key norm");
	if (count == 0) {
		if (session->masses)
			session->masses[layer].count = 0;
		return 0;
	}
	/* The daemon's own checks, made here so that a bad array is named
	 * at once and never costs an update. */
	if (!mass || count % row != 0 || count / row > ZC_MAX_RESIDUAL_TOKENS ||
	    count / row > info->residual_tokens ||
	    (uint64_t)first_token + count / row > info->max_tokens)
		return error_set(client, ZC_EINVALID, "attention masses must be float32 "
				 "[batch][kv_heads][n], 1 <= n <= the residual's tokens, of tokens "
				 "within max_tokens");
	for (size_t i = 0; i < count; i++)
		if (!(mass[i] >= 0.0f) || mass[i] > FLT_MAX)
			return error_set(client, ZC_ENONFINITE, "attention masses must be finite "
					 "and >= 0");
	if (!session->masses &&
	    !(session->masses = calloc(info->layers, sizeof(*session->masses))))
		return error_set(client, -ENOMEM, "out of memory");
	struct session_mass *m = &session->masses[layer];
	float *data = realloc(m->data, count * sizeof(float));
	if (!data)
		return error_set(client, -ENOMEM, "out of memory");
	memcpy(data, mass, count * sizeof(float));
	*m = (struct session_mass){ data, count, first_token };
	return 0;
}

/* The layer's pending masses into an update request (they stay pending
 * until mass_sent: the request may still be refused before it is sent). */
static void mass_attach(const zc_session *session, uint32_t layer,
			struct wire_update_request *update)
{
	if (!session->masses || layer >= session->info.layers || !session->masses[layer].count)
		return;
	const struct session_mass *m = &session->masses[layer];
	update->attention_mass = (wire_span){ (const uint8_t *)m->data, m->count * sizeof(float) };
	update->mass_first_token = m->first_token;
}

/* The request that carried them was encoded: the next update carries
 * none unless they are set again. */
static void mass_sent(zc_session *session, uint32_t layer, const struct wire_update_request *update)
{
	if (update->attention_mass.len && session->masses && layer < session->info.layers)
		session->masses[layer].count = 0;
}

/* A call on the session renews this client's lease on its views: from
 * before the request was sent (`sent`), so the client's deadline is never
 * later than the daemon's. */
static void lease_renewed(zc_session *session, int64_t sent)
{
	session->lease_until_ms = sent + session->client->server.lease_ms;
}

int zc_session_lease_check(const zc_session *session)
{
	return now_ms() < session->lease_until_ms ? 0 : ZC_ESTALE;
}

int zc_session_release_views(zc_session *session)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_RELEASE;
	request.release.session_id = session->info.id;
	int rc = call(session->client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	wire_response_free(&response);
	if (response.op != WIRE_OP_RELEASE)
		return client_break(session->client, ZC_EPROTOCOL, "bad release reply");
	session->lease_until_ms = 0;
	return 0;
}

static int session_from_call(zc_client *client, wire_request *request, enum wire_op op,
			     zc_session **out);

int zc_session_fork(zc_session *source, uint32_t tokens, const char *name, int views,
		    zc_session **out)
{
	zc_client *client = source->client;
	wire_request request = { 0 };
	struct wire_fork_request *fork = &request.fork_session;

	if (client->broken)
		return client_refuse_broken(client);
	if (name && strlen(name) >= sizeof(fork->name))
		return error_set(client, ZC_EINVALID, "session name too long");
	if (views != ZC_VIEWS_SOURCE && views != ZC_VIEWS_FULL && views != ZC_VIEWS_NONE)
		return error_set(client, ZC_EINVALID, "views must be ZC_VIEWS_FULL, ZC_VIEWS_NONE or "
					  "ZC_VIEWS_SOURCE");
	request.op = WIRE_OP_FORK_SESSION;
	fork->source_id = source->info.id;
	fork->tokens = tokens;
	if (name)
		snprintf(fork->name, sizeof(fork->name), "%s", name);
	fork->has_views = views != ZC_VIEWS_SOURCE;
	fork->views = views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL;
	int64_t sent = now_ms();
	int rc = session_from_call(client, &request, WIRE_OP_FORK_SESSION, out);
	if (rc == 0)
		lease_renewed(source, sent);
	return rc;
}

/* Sends an open (or fork) and maps the session its reply names: the
 * session map and the pool, two descriptors. */
static int session_from_call_fd(zc_client *client, wire_request *request, enum wire_op op,
				int send_fd, zc_session **out)
{
	wire_response response;
	int fds[2] = { -1, -1 };
	int64_t before = now_ms();
	int rc = call_fd(client, request, &response, fds, 2, send_fd);
	if (rc < 0)
		return rc;
	if (rc != 2 || response.op != op || !response.open_session.has_view) {
		for (int i = 0; i < rc; i++)
			close(fds[i]);
		wire_response_free(&response);
		return client_break(client, ZC_EPROTOCOL, "open reply without a view");
	}
	zc_session *session = calloc(1, sizeof(*session));
	if (!session) {
		rc = -ENOMEM;
		goto out_close;
	}
	session->client = client;
	session->info = response.open_session.session;
	rc = session_map(session, fds, &response.open_session.view);
	if (rc < 0) {
		session_free(session);
		/* A layout that does not fit its mapping is the daemon's mistake;
		 * a failed mmap is ours, and the session exists on the daemon. */
		if (rc == ZC_EPROTOCOL)
			client_break(client, rc, "the open reply's view layout does not fit its mapping");
		else
			error_set(client, rc, "cannot map the session's views");
		goto out_close;
	}
	lease_renewed(session, before);
	session->next = client->sessions;
	if (client->sessions)
		client->sessions->prev = session;
	client->sessions = session;
	*out = session;
	rc = 0;
out_close:
	close(fds[0]);
	close(fds[1]);
	wire_response_free(&response);
	return rc;
}

static int session_from_call(zc_client *client, wire_request *request, enum wire_op op,
			     zc_session **out)
{
	return session_from_call_fd(client, request, op, -1, out);
}

/* A config as open_session's fields (also lookup_prefix's); 0 or a
 * refusal set on the client. */
static int open_request_fill(zc_client *client, const zc_session_config *config,
			     struct wire_open_request *open)
{
	if (config->name && strlen(config->name) >= sizeof(open->name)) {
		char message[80];
		snprintf(message, sizeof(message), "session name is %zu bytes; the limit is %zu",
			 strlen(config->name), sizeof(open->name) - 1);
		return error_set(client, ZC_EINVALID, message);
	}
	if (config->name)
		snprintf(open->name, sizeof(open->name), "%s", config->name);
	open->has_shape = true;
	open->shape = (struct wire_shape){ config->layers, config->batch, config->kv_heads,
					   config->head_dim_k, config->head_dim_v };
	open->max_tokens = config->max_tokens;
	open->has_codec = true;
	wire_codec_from_config(&config->codec, &open->codec);
	open->policy = config->policy == ZC_POLICY_PER_CALL ? ZC_POLICY_PER_CALL : ZC_POLICY_STREAMING;
	if (config->residual_tokens) {
		open->has_residual_tokens = true;
		open->residual_tokens = config->residual_tokens;
	}
	open->attach = config->attach;
	if (config->model_id && strlen(config->model_id) > ZC_MODEL_ID_MAX)
		return error_set(client, ZC_EINVALID, "model id too long");
	if (config->model_id)
		snprintf(open->model_id, sizeof(open->model_id), "%s", config->model_id);
	open->views = config->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL;
	return 0;
}

static int prefix_fill(zc_client *client, const uint8_t *keys, size_t n,
		       struct wire_open_request *open)
{
	if (n > ZC_PREFIX_MAX_CHUNKS)
		return error_set(client, ZC_EINVALID, "more chunk keys than ZC_PREFIX_MAX_CHUNKS");
	if (n && !keys)
		return error_set(client, ZC_EINVALID, "chunk keys missing");
	open->prefix_len = (uint32_t)(n * ZC_CHUNK_KEY_BYTES);
	if (n)
		memcpy(open->prefix, keys, open->prefix_len);
	return 0;
}

int zc_session_open(zc_client *client, const zc_session_config *config, zc_session **out)
{
	wire_request request = { 0 };
	struct wire_open_request *open = &request.open_session;

	if (client->broken)
		return client_refuse_broken(client);
	request.op = WIRE_OP_OPEN_SESSION;
	int rc = open_request_fill(client, config, open);
	if (rc == 0)
		rc = prefix_fill(client, config->prefix, config->prefix_chunks, open);
	if (rc < 0)
		return rc;
	return session_from_call(client, &request, WIRE_OP_OPEN_SESSION, out);
}

int zc_client_lookup_prefix(zc_client *client, const zc_session_config *config,
			    const uint8_t *keys, size_t n_keys, zc_prefix_held *out)
{
	wire_request request = { 0 };
	wire_response response;

	if (client->broken)
		return client_refuse_broken(client);
	request.op = WIRE_OP_LOOKUP_PREFIX;
	int rc = open_request_fill(client, config, &request.lookup_prefix);
	if (rc == 0)
		rc = prefix_fill(client, keys, n_keys, &request.lookup_prefix);
	if (rc == 0)
		rc = call(client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	if (response.op != WIRE_OP_LOOKUP_PREFIX || response.lookup_prefix.chunks > n_keys) {
		wire_response_free(&response);
		return client_break(client, ZC_EPROTOCOL, "bad lookup_prefix reply");
	}
	out->chunks = response.lookup_prefix.chunks;
	out->tokens = response.lookup_prefix.tokens;
	out->local_chunks = response.lookup_prefix.local_chunks;
	wire_response_free(&response);
	return 0;
}

void zc_import_options_default(zc_import_options *options)
{
	memset(options, 0, sizeof(*options));
	options->views = ZC_VIEWS_SOURCE;
}

int zc_session_export(zc_session *session, int fd, uint64_t *bytes)
{
	return zc_client_export(session->client, session->info.id, fd, bytes);
}

int zc_client_export(zc_client *client, uint64_t session_id, int fd, uint64_t *bytes)
{
	wire_request request = { 0 };
	wire_response response;

	if (client->broken)
		return client_refuse_broken(client);
	if (fd < 0)
		return error_set(client, ZC_EINVALID, "export needs a descriptor");
	request.op = WIRE_OP_EXPORT_SESSION;
	request.export_session.session_id = session_id;
	int none[1];
	int rc = call_fd(client, &request, &response, none, 0, fd);
	if (rc < 0)
		return rc;
	if (response.op != WIRE_OP_EXPORT_SESSION) {
		wire_response_free(&response);
		return client_break(client, ZC_EPROTOCOL, "export reply of another op");
	}
	if (bytes)
		*bytes = response.export_session.bytes;
	wire_response_free(&response);
	return 0;
}

int zc_session_import(zc_client *client, int fd, const zc_import_options *options,
		      zc_session **out)
{
	wire_request request = { 0 };
	struct wire_import_request *import = &request.import_session;
	zc_import_options defaults;

	if (client->broken)
		return client_refuse_broken(client);
	if (!options) {
		zc_import_options_default(&defaults);
		options = &defaults;
	}
	if (fd < 0)
		return error_set(client, ZC_EINVALID, "import needs a descriptor");
	if (options->name && strlen(options->name) > ZC_SESSION_NAME_MAX)
		return error_set(client, ZC_EINVALID, "session name too long");
	if (options->model_id && strlen(options->model_id) > ZC_MODEL_ID_MAX)
		return error_set(client, ZC_EINVALID, "model id too long");
	if (options->views != ZC_VIEWS_SOURCE && options->views != ZC_VIEWS_FULL &&
	    options->views != ZC_VIEWS_NONE)
		return error_set(client, ZC_EINVALID, "views must be ZC_VIEWS_FULL, ZC_VIEWS_NONE or "
					  "ZC_VIEWS_SOURCE");
	request.op = WIRE_OP_IMPORT_SESSION;
	if (options->name)
		snprintf(import->name, sizeof(import->name), "%s", options->name);
	import->has_model_id = options->model_id != NULL;
	if (options->model_id)
		snprintf(import->model_id, sizeof(import->model_id), "%s", options->model_id);
	import->has_fingerprint = options->check_fingerprint;
	import->fingerprint = options->fingerprint;
	import->has_views = options->views != ZC_VIEWS_SOURCE;
	import->views = options->views == ZC_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL;
	return session_from_call_fd(client, &request, WIRE_OP_IMPORT_SESSION, fd, out);
}

void zc_session_release(zc_session *session)
{
	if (!session)
		return;
	zc_client *client = session->client;
	/* No reply in flight may name a session that is gone. */
	for (unsigned i = 0; i < client->n_pending; i++)
		if (client->pending[i].session == session) {
			async_drain(client);
			break;
		}
	if (session->prev)
		session->prev->next = session->next;
	else
		client->sessions = session->next;
	if (session->next)
		session->next->prev = session->prev;
	session_free(session);
}

int zc_session_close(zc_session *session)
{
	int rc = zc_client_close_session(session->client, session->info.id);
	zc_session_release(session);
	return rc;
}

const zc_session_info *zc_session_get_info(const zc_session *session)
{
	return &session->info;
}

const zc_map_header *zc_session_map(const zc_session *session)
{
	return (const zc_map_header *)session->mapping;
}

const uint8_t *zc_session_pool(const zc_session *session, size_t *bytes)
{
	if (bytes)
		*bytes = session->pool_bytes;
	return session->pool;
}

/* Fills a view of one layer; tokens as the reply (or the header) says. */
static void view_fill(const zc_session *session, uint32_t layer, uint32_t tokens,
		      uint64_t sequence, zc_view *view)
{
	const zc_session_info *info = &session->info;
	/* views = none: no fp16 to point at (the blocks are read with
	 * zc_layer_block, the residual with zc_layer_layout). */
	bool none = session->key_offsets[layer] == 0;
	view->keys = none ? NULL : (const uint16_t *)(session->mapping + session->key_offsets[layer]);
	view->values = none ? NULL : (const uint16_t *)(session->mapping + session->value_offsets[layer]);
	view->tokens = tokens;
	view->batch = info->batch;
	view->kv_heads = info->kv_heads;
	view->head_dim_k = info->head_dim_k;
	view->head_dim_v = info->head_dim_v;
	view->max_tokens = info->max_tokens;
	view->key_strides = kv_view_strides(info->kv_heads, info->max_tokens, info->head_dim_k);
	view->value_strides = kv_view_strides(info->kv_heads, info->max_tokens, info->head_dim_v);
	view->sequence = sequence;
}

static int update_call(zc_session *session, wire_request *request, uint32_t layer,
		       zc_view *view, zc_layer_stats *stats)
{
	wire_response response;
	int64_t sent = now_ms();
	/* Chunk-keyed blocks come before any residual row: no mass is for them. */
	if (!request->update_and_fetch.chunk_key_len)
		mass_attach(session, layer, &request->update_and_fetch);
	int rc = call(session->client, request, &response, NULL, 0);
	mass_sent(session, layer, &request->update_and_fetch);
	if (rc < 0)
		return rc;
	lease_renewed(session, sent);
	const struct wire_update_response *reply = &response.update_and_fetch;
	if (response.op != WIRE_OP_UPDATE_AND_FETCH || reply->tokens > session->info.max_tokens) {
		wire_response_free(&response);
		return client_break(session->client, ZC_EPROTOCOL, "bad update_and_fetch reply");
	}
	if (view)
		view_fill(session, layer, reply->tokens, reply->sequence, view);
	if (stats)
		*stats = reply->stats;
	wire_response_free(&response);
	return 0;
}

static int block_bytes(const zc_session *session, uint32_t tokens, uint64_t *key_bytes,
		       uint64_t *value_bytes)
{
	const zc_session_info *info = &session->info;
	*key_bytes = kv_block_bytes(info->batch, info->kv_heads, tokens, info->head_dim_k);
	*value_bytes = kv_block_bytes(info->batch, info->kv_heads, tokens, info->head_dim_v);
	return 0;
}

/* An update of staged bytes; chunk_key NULL for an ordinary block. */
static int update_staged(zc_session *session, uint32_t layer, uint32_t tokens,
			 size_t keys_offset, size_t values_offset, const uint8_t *chunk_key,
			 zc_view *view, zc_layer_stats *stats)
{
	wire_request request = { 0 };
	struct wire_update_request *update = &request.update_and_fetch;
	request.op = WIRE_OP_UPDATE_AND_FETCH;
	update->session_id = session->info.id;
	update->layer = layer;
	update->tokens = tokens;
	update->staged = true;
	update->keys_offset = keys_offset;
	update->values_offset = values_offset;
	update->omit_stats = stats == NULL;
	if (chunk_key) {
		update->chunk_key_len = ZC_CHUNK_KEY_BYTES;
		memcpy(update->chunk_key, chunk_key, ZC_CHUNK_KEY_BYTES);
	}
	return update_call(session, &request, layer, view, stats);
}

int zc_update_and_fetch_staged(zc_session *session, uint32_t layer, uint32_t tokens,
			       size_t keys_offset, size_t values_offset, zc_view *view,
			       zc_layer_stats *stats)
{
	return update_staged(session, layer, tokens, keys_offset, values_offset, NULL, view, stats);
}

/* A block inline when small, through the staging buffer when large. */
static int update_block(zc_session *session, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values, const uint8_t *chunk_key,
			zc_view *view, zc_layer_stats *stats)
{
	zc_client *client = session->client;
	uint64_t key_bytes, value_bytes;
	block_bytes(session, tokens, &key_bytes, &value_bytes);
	uint64_t limit = client->server.max_inline_bytes < INLINE_LIMIT_BYTES ?
				 client->server.max_inline_bytes : INLINE_LIMIT_BYTES;

	if (client->broken)
		return client_refuse_broken(client);
	if (key_bytes + value_bytes > limit) {
		void *buffer;
		int rc = zc_client_staging(client, key_bytes + value_bytes, &buffer);
		if (rc < 0)
			return rc;
		memcpy(buffer, keys, key_bytes);
		memcpy((uint8_t *)buffer + key_bytes, values, value_bytes);
		return update_staged(session, layer, tokens, 0, key_bytes, chunk_key, view, stats);
	}
	wire_request request = { 0 };
	struct wire_update_request *update = &request.update_and_fetch;
	request.op = WIRE_OP_UPDATE_AND_FETCH;
	update->session_id = session->info.id;
	update->layer = layer;
	update->tokens = tokens;
	update->keys = (wire_span){ (const uint8_t *)keys, key_bytes };
	update->values = (wire_span){ (const uint8_t *)values, value_bytes };
	update->omit_stats = stats == NULL;
	if (chunk_key) {
		update->chunk_key_len = ZC_CHUNK_KEY_BYTES;
		memcpy(update->chunk_key, chunk_key, ZC_CHUNK_KEY_BYTES);
	}
	return update_call(session, &request, layer, view, stats);
}

/* ---- asynchronous updates --------------------------------------------------- */

static struct pending *pending_find(zc_client *client, uint64_t id, unsigned *index)
{
	for (unsigned i = 0; i < client->n_pending; i++)
		if (client->pending[i].id == id) {
			*index = i;
			return &client->pending[i];
		}
	return NULL;
}

static void failure_note(zc_client *client, const struct pending *p, int rc, const char *message)
{
	/* The table has a slot per window entry; when full the oldest goes
	 * (its ticket then reads as done: its error was announced already or
	 * is announced now through the newer ones). */
	if (client->n_failures == ZC_ASYNC_WINDOW) {
		memmove(client->failures, client->failures + 1,
			sizeof(client->failures[0]) * (ZC_ASYNC_WINDOW - 1));
		client->n_failures--;
	}
	struct failure *f = &client->failures[client->n_failures++];
	*f = (struct failure){ .id = p->id, .session_id = p->session->info.id, .layer = p->layer,
			       .rc = rc };
	snprintf(f->message, sizeof(f->message), "%s", message ? message : "");
}

/* Says which request a failure was, in last_error, and returns its code. */
static int failure_report(zc_client *client, struct failure *f)
{
	f->announced = true;
	snprintf(client->last_error, sizeof(client->last_error),
		 "asynchronous update %llu (session %llu, layer %u) failed: %.180s",
		 (unsigned long long)f->id, (unsigned long long)f->session_id, f->layer, f->message);
	return f->rc;
}

/* How async_receive reads: a reply already there or -EAGAIN; or waiting
 * for one, after writing what is queued (a reply can only come for what
 * was written), or without writing (async_flush's own wait). */
enum receive_mode { RECEIVE_READY, RECEIVE_WAIT, RECEIVE_WAIT_UNFLUSHED };

static int async_receive(zc_client *client, enum receive_mode mode);

/* Every entry of the request ring taken by the daemon. Socket bytes are
 * read by the daemon's loop when it pleases, so they go only behind a
 * ring it has emptied: what is taken from it has begun, in order. */
static int ring_settle(zc_client *client)
{
	while (!request_ring_taken(&client->ring)) {
		if (client->n_pending == 0)
			return client_break(client, ZC_EPROTOCOL, "the daemon's request ring says "
					    "it did not take requests it answered");
		int rc = async_receive(client, RECEIVE_WAIT_UNFLUSHED);
		if (rc < 0)
			return rc;
	}
	return 0;
}

/* Writes the asynchronous requests still in the send buffer. */
static int async_flush(zc_client *client)
{
	if (client->unsent == 0)
		return 0;
	int rc = ring_settle(client);
	if (rc < 0)
		return rc;
	rc = transport_send(&client->transport, client->send_buffer, client->unsent);
	client->unsent = 0;
	client->unsent_frames = 0;
	if (rc < 0)
		return client_break(client, rc, rc == -ETIMEDOUT ? "timed out sending the request" :
				    "cannot send the request");
	return 0;
}

/*
 * Reads one reply to an asynchronous update (see enum receive_mode). A
 * reply that makes no sense, or none within the timeout, breaks the
 * connection as in call().
 */
static int async_receive(zc_client *client, enum receive_mode mode)
{
	const uint8_t *frame;
	size_t len;
	wire_response response;
	unsigned index;
	char message[160];

	if (client->broken) {
		async_forget(client);
		return client_refuse_broken(client);
	}
	/* A reply can only come for what was written: before waiting for
	 * one, write what is queued (a look that does not wait need not). */
	int rc = mode == RECEIVE_WAIT ? async_flush(client) : 0;
	if (rc < 0)
		return rc;
	rc = mode == RECEIVE_READY ? transport_receive_ready(&client->transport, &frame, &len) :
			      transport_receive(&client->transport, &frame, &len);
	if (rc == -EAGAIN)
		return rc;
	if (rc < 0)
		return client_break(client, rc, rc == -ETIMEDOUT ?
				    "timed out waiting for the daemon's reply" :
				    rc == -ECONNRESET ? "the daemon closed the connection" :
				    "no reply from the daemon");
	rc = wire_response_decode(frame, len, &response);
	transport_consume(&client->transport);
	if (rc < 0)
		return client_break(client, rc, "malformed reply from the daemon");
	if (response.request_id == 0 && response.status != WIRE_STATUS_OK) {
		rc = wire_error_from_status(response.status);
		client_break(client, rc, response.message);
		wire_response_free(&response);
		return rc;
	}
	struct pending *p = pending_find(client, response.request_id, &index);
	if (!p || response.fds != 0 || transport_unclaimed_fds(&client->transport) > 0 ||
	    (response.status == WIRE_STATUS_OK &&
	     (response.op != WIRE_OP_UPDATE_AND_FETCH ||
	      response.update_and_fetch.tokens > p->session->info.max_tokens))) {
		snprintf(message, sizeof(message), "reply to request %llu, which no asynchronous "
			 "update in flight expected in this form",
			 (unsigned long long)response.request_id);
		wire_response_free(&response);
		return client_break(client, ZC_EPROTOCOL, message);
	}
	if (response.status != WIRE_STATUS_OK)
		failure_note(client, p, wire_error_from_status(response.status), response.message);
	else
		lease_renewed(p->session, p->sent_ms);
	wire_response_free(&response);
	if (!p->ring)
		client->socket_pending--;
	memmove(client->pending + index, client->pending + index + 1,
		sizeof(client->pending[0]) * (client->n_pending - index - 1));
	client->n_pending--;
	return 0;
}

/* What a broken connection had in flight is lost with it (each update
 * wholly or not at all): nothing to read, nothing to wait for. */
static void async_forget(zc_client *client)
{
	client->n_pending = 0;
	client->socket_pending = 0;
	client->unsent = 0;
	client->unsent_frames = 0;
}

/* Reads every reply in flight; their refusals stay for zc_wait. */
static int async_drain(zc_client *client)
{
	if (client->broken && client->n_pending > 0) {
		async_forget(client);
		return client_refuse_broken(client);
	}
	while (client->n_pending > 0) {
		int rc = async_receive(client, RECEIVE_WAIT);
		if (rc < 0)
			return rc;
	}
	return 0;
}

/* The first refusal no call has returned yet, announced now. */
static int failure_unannounced(zc_client *client)
{
	for (unsigned i = 0; i < client->n_failures; i++)
		if (!client->failures[i].announced)
			return failure_report(client, &client->failures[i]);
	return 0;
}

/* Encodes an inline update at the end of the send buffer (*used bytes so
 * far); the request id is the next one. */
static int update_encode(zc_session *session, uint32_t layer, uint32_t tokens,
			 const uint16_t *keys, const uint16_t *values, bool staged,
			 uint64_t keys_offset, uint64_t values_offset, size_t *used, uint64_t *id)
{
	zc_client *client = session->client;
	wire_request request = { 0 };
	struct wire_update_request *update = &request.update_and_fetch;
	uint64_t key_bytes, value_bytes;
	size_t len;

	block_bytes(session, tokens, &key_bytes, &value_bytes);
	request.op = WIRE_OP_UPDATE_AND_FETCH;
	request.request_id = client->next_request_id;
	update->session_id = session->info.id;
	update->layer = layer;
	update->tokens = tokens;
	update->omit_stats = true;
	update->staged = staged;
	if (staged) {
		update->keys_offset = keys_offset;
		update->values_offset = values_offset;
	} else {
		update->keys = (wire_span){ (const uint8_t *)keys, key_bytes };
		update->values = (wire_span){ (const uint8_t *)values, value_bytes };
	}
	mass_attach(session, layer, update);
	int rc = request_encode(client, &request, *used, &len);
	if (rc < 0)
		return error_set(client, rc, rc == -ENOMEM ? "out of memory" :
					 "request cannot be encoded");
	*used += len;
	*id = client->next_request_id++;
	mass_sent(session, layer, update);
	return 0;
}

/* What every asynchronous entry point checks before it sends. */
static int async_check(zc_session *session, uint32_t layer)
{
	zc_client *client = session->client;
	if (client->broken)
		return client_refuse_broken(client);
	if (layer >= session->info.layers)
		return error_set(client, ZC_EINVALID, "layer out of range");
	return failure_unannounced(client);
}

/* Requests [first_id, first_id + n) were encoded at the end of the send
 * buffer (now `used` bytes long): in flight from now on, written with the
 * batch they complete (or at once with `now`). */
static int async_queue(zc_session *session, uint32_t layer_of_first, const zc_update *updates,
		       size_t used, uint64_t first_id, unsigned n, bool now)
{
	zc_client *client = session->client;
	int64_t sent = now_ms();
	for (unsigned i = 0; i < n; i++)
		client->pending[client->n_pending++] = (struct pending){
			first_id + i, session, updates ? updates[i].layer : layer_of_first, sent, false
		};
	client->socket_pending += n;
	client->unsent = used;
	client->unsent_frames += n;
	return now || client->unsent_frames >= client->batch ? async_flush(client) : 0;
}

/* Asks the daemon for this connection's request ring of ring_bytes, if
 * wanted, none is there yet, the daemon makes one that large (its hello
 * says) and has not refused it on this connection. A refusal (its quota,
 * its memory) leaves the socket in use. */
static void ring_open(zc_client *client)
{
	if (client->ring_bytes == 0 || client->ring.base || client->ring_refused ||
	    client->server.max_ring_bytes < client->ring_bytes)
		return;
	wire_request request = { 0 };
	wire_response response;
	int fds[2] = { -1, -1 };
	request.op = WIRE_OP_STAGING;
	request.staging.bytes = client->ring_bytes;
	request.staging.ring = true;
	client->ring_refused = true;
	char error[sizeof(client->last_error)];
	memcpy(error, client->last_error, sizeof(error));
	int rc = call(client, &request, &response, fds, 2);
	if (rc < 0) {
		/* The update goes by the socket instead; its caller hears of the
		 * refusal only through zc_client_async_ring. */
		if (!client->broken)
			memcpy(client->last_error, error, sizeof(error));
		return;
	}
	uint64_t granted = response.staging.bytes;
	bool ring = response.staging.ring;
	wire_response_free(&response);
	if (rc != 2 || !ring) {
		for (int i = 0; i < rc; i++)
			close(fds[i]);
		client_break(client, ZC_EPROTOCOL, "request ring reply without its two descriptors");
		return;
	}
	if (request_ring_map(&client->ring, fds[0], fds[1], granted) < 0)
		client_break(client, ZC_EPROTOCOL, "the daemon's request ring cannot be mapped");
	else if (transport_set_ring(&client->transport, &client->ring) < 0)
		client_break(client, -ENOMEM, "no memory for the request ring's replies");
	else
		client->ring_refused = false;
}

/* Whether the next update's frame (`len` bytes, alone in the send
 * buffer) may go through the ring: nothing of the socket's in flight or
 * queued, and it fits. */
static bool ring_usable(zc_client *client, size_t len)
{
	return client->unsent == 0 && client->socket_pending == 0 && client->ring_bytes > 0 &&
	       request_ring_fits(&client->ring, len);
}

/* The frame at the start of the send buffer into the ring, as soon as
 * the daemon has taken enough to make room for it (with nothing in
 * flight, the ring is empty: no room then is the daemon's fault). */
static int ring_write(zc_client *client, size_t len)
{
	int rc;
	while ((rc = request_ring_put(&client->ring, client->send_buffer, len)) == 0) {
		if (client->n_pending == 0)
			return client_break(client, ZC_EPROTOCOL, "the request ring is full, and "
					    "nothing is in flight");
		if ((rc = async_receive(client, RECEIVE_WAIT)) < 0)
			return rc;
	}
	if (rc < 0)
		return client_break(client, rc, rc == ZC_EPROTOCOL ?
				    "the daemon's request ring head makes no sense" :
				    "cannot ring the daemon's doorbell");
	return 0;
}

/* An asynchronous update through the ring, in flight from now on. */
static int ring_queue(zc_session *session, uint32_t layer, size_t len, uint64_t id)
{
	zc_client *client = session->client;
	int rc = ring_write(client, len);
	if (rc < 0)
		return rc;
	client->pending[client->n_pending++] = (struct pending){ id, session, layer, now_ms(),
								 true };
	return 0;
}

int zc_update_async(zc_session *session, uint32_t layer, uint32_t tokens,
		    const uint16_t *keys, const uint16_t *values, zc_ticket *ticket)
{
	zc_client *client = session->client;
	uint64_t key_bytes, value_bytes, id;
	size_t used = 0;

	int rc = async_check(session, layer);
	if (rc < 0)
		return rc;
	block_bytes(session, tokens, &key_bytes, &value_bytes);
	uint64_t limit = client->server.max_inline_bytes < INLINE_LIMIT_BYTES ?
				 client->server.max_inline_bytes : INLINE_LIMIT_BYTES;
	if (tokens == 0 || key_bytes + value_bytes > limit)
		return error_set(client, ZC_EINVALID, "an asynchronous update is a short inline "
					  "block (1 token or more, within the inline limit): send "
					  "large blocks with zc_update_many or zc_update_and_fetch");
	/* Back-pressure: replies already there make room; only when none is
	 * does the caller wait (after writing what is queued). */
	while (client->n_pending >= client->window) {
		rc = async_receive(client, RECEIVE_READY);
		if (rc == -EAGAIN)
			rc = async_receive(client, RECEIVE_WAIT);
		if (rc < 0)
			return rc;
	}
	if (client->batch == 1) {
		ring_open(client);
		if (client->broken)
			return client_refuse_broken(client);
	}
	used = client->unsent;
	rc = update_encode(session, layer, tokens, keys, values, false, 0, 0, &used, &id);
	if (rc < 0)
		return rc;
	/* A batch of more than one is the socket's way of saving writes. */
	if (client->batch == 1 && ring_usable(client, used))
		rc = ring_queue(session, layer, used, id);
	else
		rc = async_queue(session, layer, NULL, used, id, 1, false);
	if (rc < 0)
		return rc;
	*ticket = id;
	return 0;
}

/* The ticket's outcome once its reply was read: 0, or its refusal. */
static int ticket_outcome(zc_client *client, zc_ticket ticket)
{
	for (unsigned i = 0; i < client->n_failures; i++) {
		if (client->failures[i].id != ticket)
			continue;
		struct failure f = client->failures[i];
		memmove(client->failures + i, client->failures + i + 1,
			sizeof(client->failures[0]) * (client->n_failures - i - 1));
		client->n_failures--;
		return failure_report(client, &f);
	}
	return 0;
}

static int ticket_check(zc_session *session, uint32_t layer, zc_ticket ticket)
{
	zc_client *client = session->client;
	if (ticket == 0 || ticket >= client->next_request_id)
		return error_set(client, ZC_EINVALID, "no such ticket");
	if (layer >= session->info.layers)
		return error_set(client, ZC_EINVALID, "layer out of range");
	return 0;
}

int zc_wait(zc_session *session, uint32_t layer, zc_ticket ticket)
{
	zc_client *client = session->client;
	unsigned index;
	int rc = ticket_check(session, layer, ticket);
	if (rc < 0)
		return rc;
	while (pending_find(client, ticket, &index)) {
		rc = async_receive(client, RECEIVE_WAIT);
		if (rc < 0)
			return rc;
	}
	return ticket_outcome(client, ticket);
}

int zc_poll(zc_session *session, uint32_t layer, zc_ticket ticket)
{
	zc_client *client = session->client;
	unsigned index;
	int rc = ticket_check(session, layer, ticket);
	if (rc < 0)
		return rc;
	if (pending_find(client, ticket, &index) && (rc = async_flush(client)) < 0)
		return rc;
	while (pending_find(client, ticket, &index)) {
		rc = async_receive(client, RECEIVE_READY);
		if (rc == -EAGAIN)
			return 0;
		if (rc < 0)
			return rc;
	}
	rc = ticket_outcome(client, ticket);
	return rc < 0 ? rc : 1;
}

int zc_wait_all(zc_client *client)
{
	if (client->broken)
		return client_refuse_broken(client);
	int rc = async_drain(client);
	return rc < 0 ? rc : failure_unannounced(client);
}

int zc_client_set_async_batch(zc_client *client, unsigned frames)
{
	if (frames == 0 || frames > ZC_ASYNC_WINDOW)
		return error_set(client, ZC_EINVALID, "a batch is 1 .. ZC_ASYNC_WINDOW updates");
	/* Batched writes go on the socket: what the ring holds is taken
	 * first, here, not later inside a zc_poll. */
	int rc = frames > 1 ? ring_settle(client) : 0;
	if (rc == 0)
		rc = async_flush(client);
	if (rc < 0)
		return rc;
	client->batch = frames;
	return 0;
}

int zc_client_set_async_ring(zc_client *client, size_t bytes)
{
	if (bytes != 0 && (bytes < ZC_ASYNC_RING_MIN_BYTES || bytes > ZC_ASYNC_RING_MAX_BYTES))
		return error_set(client, ZC_EINVALID, "a request ring is 0 (none) or "
					  "ZC_ASYNC_RING_MIN_BYTES .. ZC_ASYNC_RING_MAX_BYTES");
	if (client->ring.base && bytes != 0 && bytes != client->ring.capacity)
		return error_set(client, ZC_EINVALID, "this connection has its request ring "
					  "already: a new size takes a zc_client_reconnect");
	int rc = async_drain(client);
	if (rc < 0)
		return rc;
	client->ring_bytes = bytes;
	/* Asked for by name: tried again even if refused before. */
	client->ring_refused = false;
	ring_open(client);
	return client->broken ? client_refuse_broken(client) : 0;
}

int zc_client_async_ring(const zc_client *client, size_t *bytes, uint64_t *doorbells)
{
	*bytes = client->ring.base ? (size_t)client->ring.capacity : 0;
	*doorbells = client->ring.doorbells;
	return 0;
}

int zc_client_set_async_window(zc_client *client, unsigned window)
{
	if (window == 0 || window > ZC_ASYNC_WINDOW)
		return error_set(client, ZC_EINVALID, "the window is 1 .. ZC_ASYNC_WINDOW updates");
	client->window = window;
	return 0;
}

/* Staged blocks of zc_update_many in flight at once, each in its own slot
 * of the staging buffer: the one the daemon compresses and the next. The
 * daemon never waits for the next one, and it reads it while the cache
 * still holds what the client just wrote (a whole batch staged ahead is
 * read back from memory: 2x slower on the Xeon host); the slots' pages,
 * written again for every pair of blocks, stay mapped on both sides. */
#define MANY_STAGED_AHEAD 2

/* The reply to update i of a batch: counted in *done, or the first
 * refusal kept in *first and first_error. */
static int many_reap(zc_session *session, const zc_update *u, uint64_t id, size_t *done,
		     int *first, char *first_error)
{
	zc_client *client = session->client;
	int rc = zc_wait(session, u->layer, id);
	if (rc == 0) {
		(*done)++;
		return 0;
	}
	if (client->broken)
		return rc;
	if (*first == 0) {
		*first = rc;
		memcpy(first_error, client->last_error, sizeof(client->last_error));
	}
	return 0;
}

/*
 * Sends n inline updates in one write and waits for their replies. Each
 * is applied or refused on its own: all are counted, and the first
 * refusal is the answer.
 */
static int many_inline(zc_session *session, const zc_update *updates, size_t n, size_t *done)
{
	zc_client *client = session->client;
	size_t used = client->unsent;
	uint64_t ids[ZC_ASYNC_WINDOW];
	int first = 0, rc = 0;
	char first_error[sizeof(client->last_error)];
	if (n == 0 || n > ZC_ASYNC_WINDOW)
		return 0;
	for (size_t i = 0; i < n; i++) {
		const zc_update *u = &updates[i];
		if ((rc = update_encode(session, u->layer, u->tokens, u->keys, u->values, false, 0, 0,
					&used, &ids[i])) < 0)
			return rc;
	}
	if ((rc = async_queue(session, 0, updates, used, ids[0], (unsigned)n, true)) < 0)
		return rc;
	for (size_t i = 0; i < n; i++)
		if ((rc = many_reap(session, &updates[i], ids[i], done, &first, first_error)) < 0)
			return rc;
	if (first < 0)
		memcpy(client->last_error, first_error, sizeof(first_error));
	return first;
}

/* The staging buffer for staged updates of up to slot_bytes each: *slots
 * slots if the daemon makes a buffer that large, else one (its
 * --max-staging-bytes, the uid's staging quota or its memory may allow no
 * more); *slots says which. */
static int many_staging(zc_client *client, uint64_t slot_bytes, size_t *slots, void **buffer)
{
	int rc = zc_client_staging(client, *slots * slot_bytes, buffer);
	if (rc < 0 && *slots > 1 && !client->broken) {
		*slots = 1;
		rc = zc_client_staging(client, slot_bytes, buffer);
	}
	return rc;
}

/*
 * Sends n staged updates through `slots` slots of slot_bytes in the
 * staging buffer: update i is copied into slot i % slots as soon as the
 * one before it there is answered, and sent at once. Each is applied or
 * refused on its own: all are counted, and the first refusal is the
 * answer.
 */
static int many_staged(zc_session *session, const zc_update *updates, size_t n,
		       uint8_t *staging, uint64_t slot_bytes, size_t slots, size_t *done)
{
	zc_client *client = session->client;
	uint64_t ids[MANY_STAGED_AHEAD];
	size_t reaped = 0, queued = 0;
	int first = 0, rc = 0;
	char first_error[sizeof(client->last_error)];
	for (size_t i = 0; i < n && rc == 0; i++) {
		const zc_update *u = &updates[i];
		uint64_t key_bytes, value_bytes, at = (i % slots) * slot_bytes;
		size_t used = client->unsent;
		block_bytes(session, u->tokens, &key_bytes, &value_bytes);
		for (; reaped + slots <= i; reaped++)
			if ((rc = many_reap(session, &updates[reaped], ids[reaped % slots], done,
					    &first, first_error)) < 0)
				return rc;
		memcpy(staging + at, u->keys, key_bytes);
		memcpy(staging + at + key_bytes, u->values, value_bytes);
		rc = update_encode(session, u->layer, u->tokens, u->keys, u->values, true, at,
				   at + key_bytes, &used, &ids[i % slots]);
		if (rc == 0) {
			queued = i + 1;
			rc = async_queue(session, 0, u, used, ids[i % slots], 1, true);
		}
	}
	if (rc < 0) {
		/* Blocks already sent are answered before the error goes back:
		 * their replies are theirs, and the slots they name are the
		 * next call's. A refusal among them is still the first one. */
		char error[sizeof(client->last_error)];
		memcpy(error, client->last_error, sizeof(error));
		for (; reaped < queued && !client->broken; reaped++)
			(void)many_reap(session, &updates[reaped], ids[reaped % slots], done, &first,
					first_error);
		if (first < 0 && !client->broken) {
			memcpy(client->last_error, first_error, sizeof(first_error));
			return first;
		}
		memcpy(client->last_error, error, sizeof(error));
		return rc;
	}
	for (; reaped < n; reaped++)
		if ((rc = many_reap(session, &updates[reaped], ids[reaped % slots], done, &first,
				    first_error)) < 0)
			return rc;
	if (first < 0)
		memcpy(client->last_error, first_error, sizeof(first_error));
	return first;
}

int zc_update_many(zc_session *session, const zc_update *updates, size_t n, size_t *done)
{
	zc_client *client = session->client;
	uint64_t limit = client->server.max_inline_bytes < INLINE_LIMIT_BYTES ?
				 client->server.max_inline_bytes : INLINE_LIMIT_BYTES;
	size_t applied = 0;
	int rc = 0;

	if (done)
		*done = 0;
	if (client->broken)
		return client_refuse_broken(client);
	rc = async_drain(client);
	if (rc < 0)
		return rc;
	for (size_t i = 0; i < n; i++)
		if (updates[i].layer >= session->info.layers || updates[i].tokens == 0) {
			char message[120];
			snprintf(message, sizeof(message), "update %zu: layer out of range or no tokens; "
				 "nothing was sent", i);
			return error_set(client, ZC_EINVALID, message);
		}
	int first = 0;
	char first_error[sizeof(client->last_error)];
	/* Staged blocks before this one go in runs of one: the daemon made no
	 * buffer for their run's largest block, and each is refused or
	 * applied as if sent alone. */
	size_t alone_until = 0;
	for (size_t i = 0; i < n && !client->broken;) {
		/* A run of inline blocks (a window's worth), or of staged ones
		 * (any number: only MANY_STAGED_AHEAD are in flight). */
		uint64_t key_bytes, value_bytes, slot_bytes = 0;
		block_bytes(session, updates[i].tokens, &key_bytes, &value_bytes);
		bool inline_ = key_bytes + value_bytes <= limit;
		size_t count = 0, most = inline_ ? client->window : i < alone_until ? 1 : SIZE_MAX;
		while (i + count < n && count < most) {
			block_bytes(session, updates[i + count].tokens, &key_bytes, &value_bytes);
			uint64_t bytes = key_bytes + value_bytes;
			if ((bytes <= limit) != inline_)
				break;
			/* Slots on cache lines: the daemon's reads of one never
			 * share a line with the client's writes of the next. */
			bytes = (bytes + 63) & ~(uint64_t)63;
			slot_bytes = bytes > slot_bytes ? bytes : slot_bytes;
			count++;
		}
		if (inline_) {
			rc = many_inline(session, updates + i, count, &applied);
		} else {
			/* No more in flight than the client's window either. */
			size_t ahead = client->window < MANY_STAGED_AHEAD ? client->window :
									    MANY_STAGED_AHEAD;
			size_t slots = count < ahead ? count : ahead;
			void *buffer = NULL;
			rc = many_staging(client, slot_bytes, &slots, &buffer);
			if (rc < 0 && count > 1 && !client->broken) {
				alone_until = i + count;
				continue;
			}
			if (rc == 0)
				rc = many_staged(session, updates + i, count, buffer, slot_bytes,
						 slots, &applied);
		}
		if (rc < 0 && first == 0) {
			first = rc;
			memcpy(first_error, client->last_error, sizeof(first_error));
		}
		i += count;
	}
	if (done)
		*done = applied;
	if (rc < 0 && client->broken)
		return rc;
	if (first < 0)
		memcpy(client->last_error, first_error, sizeof(first_error));
	return first;
}

int zc_update_and_fetch(zc_session *session, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values, zc_view *view,
			zc_layer_stats *stats)
{
	return update_block(session, layer, tokens, keys, values, NULL, view, stats);
}

int zc_update_and_fetch_chunk(zc_session *session, uint32_t layer, uint32_t tokens,
			      const uint16_t *keys, const uint16_t *values,
			      const uint8_t chunk_key[ZC_CHUNK_KEY_BYTES], zc_view *view,
			      zc_layer_stats *stats)
{
	if (!chunk_key)
		return error_set(session->client, ZC_EINVALID, "a chunk update needs its chain key");
	return update_block(session, layer, tokens, keys, values, chunk_key, view, stats);
}

int zc_client_staging(zc_client *client, size_t bytes, void **buffer)
{
	if (client->broken)
		return client_refuse_broken(client);
	if (client->staging && client->staging_bytes >= bytes) {
		*buffer = client->staging;
		return 0;
	}
	wire_request request = { 0 };
	wire_response response;
	int fd = -1;
	request.op = WIRE_OP_STAGING;
	request.staging.bytes = bytes;
	int rc = call(client, &request, &response, &fd, 1);
	if (rc < 0)
		return rc;
	uint64_t granted = response.staging.bytes;
	wire_response_free(&response);
	if (rc != 1 || granted < bytes) {
		if (rc == 1)
			close(fd);
		return client_break(client, ZC_EPROTOCOL, "staging reply without a buffer");
	}
	void *mapping = mmap(NULL, granted, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (mapping == MAP_FAILED)
		return error_set(client, -errno, "cannot map the staging buffer");
	staging_unmap(client);
	client->staging = mapping;
	client->staging_bytes = granted;
	*buffer = mapping;
	return 0;
}

/*
 * Waits, within the client's timeout, for the daemon to finish a write of
 * the layer (an odd sequence). A daemon killed in the middle of one leaves
 * the sequence odd for good: its end of the socket closes, which is what
 * tells a death from a long write (or a stopped daemon) before the time is
 * up. Returns 0 once the sequence is even.
 */
static int view_wait_for_writer(zc_session *session, uint32_t layer,
				const zc_map_layer *l, unsigned *spins,
				int64_t *deadline)
{
	zc_client *client = session->client;
	char message[200];

	if (!(__atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE) & 1))
		return 0;
	if (++*spins < VIEW_SPINS) {
		sched_yield();
		return 0;
	}
	if (*deadline == 0)
		*deadline = client->timeout_ms > 0 ? now_ms() + client->timeout_ms : -1;
	while (__atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE) & 1) {
		uint64_t sequence = __atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE);
		if (transport_peer_closed(&client->transport) < 0) {
			snprintf(message, sizeof(message),
				 "the daemon is gone, and it left layer %u in the middle of a write "
				 "(sequence %llu): reconnect, and a restarted daemon repairs the layer",
				 layer, (unsigned long long)sequence);
			return client_break(client, -ECONNRESET, message);
		}
		if (*deadline >= 0 && now_ms() >= *deadline) {
			snprintf(message, sizeof(message),
				 "layer %u was still being written (sequence %llu) after %d ms",
				 layer, (unsigned long long)sequence, client->timeout_ms);
			return error_set(client, -ETIMEDOUT, message);
		}
		nanosleep(&(struct timespec){ 0, VIEW_POLL_NS }, NULL);
	}
	return 0;
}

int zc_session_view(zc_session *session, uint32_t layer, zc_view *view)
{
	zc_client *client = session->client;
	unsigned spins = 0;
	int64_t deadline = 0;  /* set once waiting starts; -1: none */

	if (client->broken)
		return client_refuse_broken(client);
	if (layer >= session->info.layers)
		return error_set(client, ZC_EINVALID, "layer out of range");
	if (session->info.views == ZC_VIEWS_NONE)
		return error_set(client, ZC_EPRECONDITION, "the session was opened with views = none: it "
					  "has no fp16 views (read its blocks and residual instead)");
	const zc_map_header *header = (const zc_map_header *)session->mapping;
	const zc_map_layer *l = &header->layer[layer];
	/* Views the daemon dropped under memory pressure come back with any
	 * request that touches the session; stats is the cheapest. */
	if (!__atomic_load_n(&l->view_valid, __ATOMIC_ACQUIRE)) {
		int rc = zc_session_stats(session, NULL, 0, NULL);
		if (rc < 0)
			return rc;
	}
	/* The layer's seqlock: odd while the daemon writes; a read is good
	 * when the counter was even and unchanged around it. */
	for (;;) {
		int rc = view_wait_for_writer(session, layer, l, &spins, &deadline);
		if (rc < 0)
			return rc;
		uint64_t before = __atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE);
		if (before & 1)
			continue;
		uint32_t tokens = __atomic_load_n(&l->tokens, __ATOMIC_ACQUIRE);
		__atomic_thread_fence(__ATOMIC_ACQUIRE);
		if (__atomic_load_n(&l->sequence, __ATOMIC_ACQUIRE) != before)
			continue;
		/* The views are sized for max_tokens: a count past it is not ours to follow. */
		if (tokens > session->info.max_tokens)
			return client_break(client, ZC_EPROTOCOL, "the layer header counts more tokens "
					    "than the session's views hold");
		view_fill(session, layer, tokens, before, view);
		return 0;
	}
}

static int trim_call(zc_session *session, bool one_layer, uint32_t layer, uint32_t tokens,
		     uint32_t *trimmed)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_TRIM;
	request.trim.session_id = session->info.id;
	request.trim.tokens = tokens;
	request.trim.has_layer = one_layer;
	request.trim.layer = layer;
	int64_t sent = now_ms();
	int rc = call(session->client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	lease_renewed(session, sent);
	if (trimmed)
		*trimmed = response.trim.trimmed;
	wire_response_free(&response);
	return 0;
}

int zc_session_trim(zc_session *session, uint32_t tokens, uint32_t *trimmed)
{
	return trim_call(session, false, 0, tokens, trimmed);
}

int zc_session_trim_layer(zc_session *session, uint32_t layer, uint32_t tokens,
			  uint32_t *trimmed)
{
	return trim_call(session, true, layer, tokens, trimmed);
}

/* One stats request; `use` rebuilds dropped views and counts as a use. */
static int stats_call(zc_client *client, uint64_t session_id, bool use, zc_layer_stats *layers,
		      size_t capacity, zc_layer_stats *total, zc_session_info *info)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_STATS;
	request.stats.session_id = session_id;
	request.stats.use = use;
	int rc = call(client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	for (size_t i = 0; layers && i < capacity && i < response.n_layers; i++)
		layers[i] = response.layers[i];
	if (total)
		*total = response.stats.total;
	if (info && response.stats.has_session)
		*info = response.stats.session;
	wire_response_free(&response);
	return 0;
}

int zc_session_stats(zc_session *session, zc_layer_stats *layers, size_t capacity,
		     zc_layer_stats *total)
{
	int64_t sent = now_ms();
	int rc = stats_call(session->client, session->info.id, true, layers, capacity, total,
			    &session->info);
	if (rc == 0)
		lease_renewed(session, sent);
	return rc;
}

int zc_client_session_stats(zc_client *client, uint64_t session_id, zc_layer_stats *layers,
			    size_t capacity, zc_layer_stats *total, zc_session_info *info)
{
	if (client->broken)
		return client_refuse_broken(client);
	if (session_id == 0)
		return error_set(client, ZC_EINVALID, "session id 0 names no session");
	return stats_call(client, session_id, false, layers, capacity, total, info);
}

int zc_client_close_session(zc_client *client, uint64_t session_id)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_CLOSE_SESSION;
	request.close_session.session_id = session_id;
	int rc = call(client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	wire_response_free(&response);
	return 0;
}

int zc_client_list_sessions(zc_client *client, zc_session_info *sessions, size_t capacity,
			    size_t *count)
{
	wire_request request = { 0 };
	wire_response response;
	request.op = WIRE_OP_LIST_SESSIONS;
	int rc = call(client, &request, &response, NULL, 0);
	if (rc < 0)
		return rc;
	for (size_t i = 0; sessions && i < capacity && i < response.n_sessions; i++)
		sessions[i] = response.sessions[i];
	*count = response.n_sessions;
	wire_response_free(&response);
	return 0;
}

/* The daemon-wide stats reply (no session named). */
static int server_stats_call(zc_client *client, wire_response *response)
{
	wire_request request = { 0 };
	request.op = WIRE_OP_STATS;
	return call(client, &request, response, NULL, 0);
}

int zc_client_uid_stats(zc_client *client, zc_uid_stats *uid, zc_server_stats *stats,
			zc_memory_stats *memory)
{
	wire_response response;
	int rc = server_stats_call(client, &response);
	if (rc < 0)
		return rc;
	const struct wire_uid_usage *u = &response.stats.caller;
	*uid = (zc_uid_stats){
		.uid = u->uid,
		.daemon_wide = response.stats.daemon_wide,
		.sessions = u->sessions,
		.max_sessions = u->max_sessions,
		.connections = u->connections,
		.max_connections = u->max_connections,
		.memory_used_bytes = u->memory_used_bytes,
		.memory_budget_bytes = u->memory_budget_bytes,
		.staging_bytes = u->staging_bytes,
		.max_staging_bytes = u->max_staging_bytes,
	};
	if (stats) {
		const struct wire_stats_response *r = &response.stats;
		stats->sessions = r->sessions;
		stats->connections = r->connections;
		stats->memory_used_bytes = r->memory_used_bytes;
		stats->memory_budget_bytes = r->memory_budget_bytes;
		stats->requests = r->requests;
		stats->request_errors = r->request_errors;
		stats->tokens_appended = r->tokens_appended;
		stats->uptime_ms = r->uptime_ms;
		stats->boot_epoch = r->boot_epoch;
	}
	if (memory) {
		const struct wire_stats_response *r = &response.stats;
		*memory = (zc_memory_stats){
			.charged_bytes = r->memory_used_bytes,
			.file_bytes = r->memory_file_bytes,
			.views_bytes = r->memory.views,
			.blocks_bytes = r->memory.blocks,
			.residual_bytes = r->memory.residual,
			.index_bytes = r->memory.index,
			.headers_bytes = r->memory.headers,
			.set_aside_files = r->set_aside_total,
			.retained_bytes = r->memory.retained,
		};
	}
	wire_response_free(&response);
	return 0;
}

int zc_client_memory_stats(zc_client *client, zc_memory_stats *out)
{
	zc_uid_stats uid;
	return zc_client_uid_stats(client, &uid, NULL, out);
}

int zc_client_set_aside(zc_client *client, zc_set_aside_file *files, size_t capacity,
			size_t *count)
{
	wire_response response;
	int rc = server_stats_call(client, &response);
	if (rc < 0)
		return rc;
	const struct wire_stats_response *r = &response.stats;
	for (size_t i = 0; files && i < capacity && i < r->set_aside_count; i++) {
		snprintf(files[i].file, sizeof(files[i].file), "%s", r->set_aside[i].file);
		snprintf(files[i].reason, sizeof(files[i].reason), "%s", r->set_aside[i].reason);
	}
	*count = r->set_aside_total;
	wire_response_free(&response);
	return 0;
}

int zc_client_stats(zc_client *client, zc_server_stats *stats)
{
	zc_uid_stats uid;
	return zc_client_uid_stats(client, &uid, stats, NULL);
}
