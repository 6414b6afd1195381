/*
 * The wire messages as nanopb holds them: the generated structs
 * (zipcache_v1_Request, zipcache_v1_Response, build/gen/zipcache.pb.h),
 * wrapped with the few things nanopb cannot hold in a static struct: the
 * inline K/V bytes of update_and_fetch and the two repeated lists.
 *
 * The daemon and the client never include this header: they speak the
 * plain structs of wire.h, which wire.c converts to and from these. It is
 * here for wire.c and for the tests that build or inspect protobuf
 * messages field by field (tests/wire_test.c, the fuzzer's oracle), so a
 * nanopb upgrade touches the proto/wire room and those tests only. Leave
 * the pb_callback_t members of the generated structs alone; wire.c fills
 * them in from the spans and arrays below.
 */
#ifndef ZIPCACHE_WIRE_PB_H
#define ZIPCACHE_WIRE_PB_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"
#include "zipcache.pb.h"

typedef struct wire_pb_request {
	zipcache_v1_Request msg;
	/*
	 * msg.op.update_and_fetch.keys / .values, inline fp16 bytes.
	 * Encode: read from here (len 0: not sent). Decode: point into the
	 * frame that was decoded, no copy, valid as long as that frame is
	 * (see frame.h); {NULL, 0} when absent.
	 */
	wire_span keys;
	wire_span values;
	wire_span attention_mass;   /* msg.op.update_and_fetch.attention_mass, likewise */
	/* After a failed decode: why, a static string or `reason` below (so
	 * valid as long as this struct). NULL otherwise. */
	const char *error;
	char reason[160];
} wire_pb_request;

typedef struct wire_pb_response {
	zipcache_v1_Response msg;
	/*
	 * msg.op.stats.layers and msg.op.list_sessions.sessions.
	 * Encode: the caller's arrays, only read. Decode: arrays allocated by
	 * wire_pb_response_decode() and owned by this struct until
	 * wire_pb_response_free(); NULL with count 0 when the list is empty or
	 * the op is another one.
	 */
	zipcache_v1_LayerStats *layers;
	size_t n_layers;
	zipcache_v1_SessionInfo *sessions;
	size_t n_sessions;
	/* After a failed decode: why, a static string. NULL otherwise. */
	const char *error;
	/* Private: set by decode so wire_pb_response_free() never frees caller arrays. */
	int lists_owned;
} wire_pb_response;

/*
 * Decodes one request frame body (no header) into *out, which need not be
 * initialised; allocates nothing. Returns 0, or ZC_EPROTOCOL with
 * out->error set for bytes that are not a valid Request, including inline
 * keys/values that are not length-delimited, a message in which another
 * op precedes its final update_and_fetch (legal protobuf that no encoder
 * produces and that the zero-copy capture cannot follow), and a value its
 * field cannot hold: a string longer than its limit or with a NUL byte in
 * it (C would silently cut it there), an integer wider than its field, an
 * enum value the enum does not define. Then out->error names the field
 * and the limit ("open_session.name is 80 bytes; the limit is 64").
 *
 * On failure out->msg is all zero except msg.request_id, which holds the
 * request's id whenever it could be read (a well-formed field 1 before any
 * break in the message's structure), else 0, so a refusal can echo it.
 */
int wire_pb_request_decode(const uint8_t *frame, size_t len, wire_pb_request *out);

/*
 * Decodes one response frame body into *out, which need not be
 * initialised. Returns 0, ZC_EPROTOCOL with out->error set, or -ENOMEM.
 * On success call wire_pb_response_free() when done with the lists; on
 * failure nothing is left to free (calling it is harmless).
 */
int wire_pb_response_decode(const uint8_t *frame, size_t len, wire_pb_response *out);

/* Frees the lists a decode allocated and clears them; safe to repeat. */
void wire_pb_response_free(wire_pb_response *resp);

/* *size = bytes of the whole frame (header + message) for req / resp. */
int wire_pb_request_frame_size(const wire_pb_request *req, size_t *size);
int wire_pb_response_frame_size(const wire_pb_response *resp, size_t *size);

/*
 * Encodes a whole frame, header included, at buf[0..cap). Returns 0 with
 * *frame_len set, ZC_EBUFFER when cap is too small (nothing useful in buf),
 * or ZC_EINVALID when the struct cannot be encoded (a string member not
 * NUL-terminated within its array, more than WIRE_MAX_LIST_ITEMS entries).
 * The input is not modified.
 */
int wire_pb_request_encode(const wire_pb_request *req, uint8_t *buf, size_t cap,
			size_t *frame_len);
int wire_pb_response_encode(const wire_pb_response *resp, uint8_t *buf, size_t cap,
			 size_t *frame_len);

/*
 * Sets resp->msg.status from a zipcache error code and copies message
 * (may be NULL) into resp->msg.message, cut to fit on a UTF-8 character
 * boundary so other protobuf decoders accept it.
 */
void wire_pb_response_set_status(wire_pb_response *resp, int zc_error, const char *message);

/*
 * Status <-> error code. 0 (and any non-negative count) is OK. Codec
 * validation errors (ZC_EBITS, ZC_EFRACTION, ZC_EGROUPSIZE, ZC_ESHAPE,
 * ZC_ENONFINITE, ZC_ETENSOR), ZC_EINVALID and ZC_EPROTOCOL (a malformed
 * request) are INVALID_ARGUMENT; ZC_EEXHAUSTED, ZC_EFRAMESIZE and the
 * errnos of a resource running out (-ENOMEM, -ENOSPC, -EMFILE, -ENFILE,
 * -EAGAIN, -ENOBUFS) are RESOURCE_EXHAUSTED; everything unlisted is INTERNAL. Back
 * from a status each maps to its one ZC_E* code; an unknown status value
 * (a newer daemon) is ZC_EINTERNAL.
 */
zipcache_v1_Status wire_pb_status_from_error(int zc_error);
int wire_pb_error_from_status(zipcache_v1_Status status);

#endif
