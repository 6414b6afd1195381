/*
 * Wire messages over nanopb 0.4.7: every nanopb call of the project is in
 * this file (see wire.h).
 *
 * Why decoding the three callback-carrying ops takes two passes.
 * UpdateAndFetchRequest, StatsResponse and ListSessionsResponse live inside
 * the `op` oneof, and when nanopb enters a oneof member it memsets it
 * first, wiping any pb_callback_t we planted there (nanopb's cure, the
 * submsg_callback option, would change the generated structs). So:
 *
 *   1. pb_decode() the whole message as usual. Callback fields, still
 *      NULL, are skipped (in O(1): skipping a buffer stream only moves a
 *      pointer), and we learn which op the message carries.
 *   2. Only for those three ops: zero the struct, set which_op to that op
 *      ourselves and plant the callbacks, then decode again with
 *      PB_DECODE_NOINIT. nanopb sees the member already selected and keeps
 *      the callbacks (setting a submessage to defaults never touches
 *      callbacks), so they capture the inline bytes or collect the list.
 *
 * If another op precedes the final one in the message, nanopb still wipes
 * the callbacks on the switch; we notice (the callback is NULL afterwards)
 * and refuse the message rather than miss bytes. The second pass costs a
 * re-parse of a few dozen bytes of scalars, nothing next to the codec.
 */
#include "wire.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pb_common.h>
#include <pb_decode.h>
#include <pb_encode.h>

#include "frame.h"
#include "zipcache/error.h"

/* What the decode callbacks need; their arg points at one of these. */
struct decode_ctx {
	const uint8_t *frame; /* the buffer being decoded, to bound spans */
	size_t len;
	wire_span *keys;
	wire_span *values;
	struct decode_list {
		void *items;
		size_t n;
		size_t cap;
	} layers, sessions;
	int err;         /* -ENOMEM from a callback, else 0: ZC_EPROTOCOL */
	const char *why; /* our reason for a callback failure, over nanopb's */
};

/* A list to encode: the caller's array and how to encode one entry. */
struct encode_list {
	const void *items;
	size_t n;
	size_t size;
	const pb_msgdesc_t *desc;
};

/*
 * Whether a callback's stream reads straight from the frame. For a
 * length-delimited field it does; for a field sent with a scalar wire type
 * nanopb copies the value to its own stack and hands us a stream over that
 * copy, which is both a protocol error for our fields and a pointer we must
 * never keep.
 */
static bool stream_in_frame(const struct decode_ctx *ctx, const pb_istream_t *stream)
{
	uintptr_t lo = (uintptr_t)ctx->frame;
	uintptr_t p = (uintptr_t)stream->state;

	return p >= lo && p - lo <= ctx->len && stream->bytes_left <= ctx->len - (p - lo);
}

/* keys / values of UpdateAndFetchRequest: remember where they are, skip them. */
static bool decode_inline(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
	struct decode_ctx *ctx = *arg;
	wire_span *span;

	if (!stream_in_frame(ctx, stream)) {
		ctx->why = "inline keys/values must be length-delimited bytes";
		return false;
	}
	span = field->tag == zipcache_v1_UpdateAndFetchRequest_keys_tag ? ctx->keys : ctx->values;
	/* A repeated occurrence replaces the earlier one, as for any bytes field. */
	span->data = stream->state;
	span->len = stream->bytes_left;
	return pb_read(stream, NULL, stream->bytes_left);
}

/* Appends one decoded entry of a repeated message field to list. */
static bool decode_list_entry(struct decode_ctx *ctx, pb_istream_t *stream,
			      struct decode_list *list, size_t size,
			      const pb_msgdesc_t *desc)
{
	void *item;

	if (!stream_in_frame(ctx, stream)) {
		ctx->why = "repeated message field is not length-delimited";
		return false;
	}
	if (list->n == WIRE_MAX_LIST_ITEMS) {
		ctx->why = "too many entries in a repeated field";
		return false;
	}
	if (list->n == list->cap) {
		size_t cap = list->cap ? list->cap * 2 : 8;
		void *p;

		if (cap > WIRE_MAX_LIST_ITEMS)
			cap = WIRE_MAX_LIST_ITEMS;
		p = realloc(list->items, cap * size);
		if (p == NULL) {
			ctx->err = -ENOMEM;
			ctx->why = "out of memory";
			return false;
		}
		list->items = p;
		list->cap = cap;
	}
	item = (char *)list->items + list->n * size;
	memset(item, 0, size);
	if (!pb_decode(stream, desc, item))
		return false;
	list->n++;
	return true;
}

static bool decode_layer(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
	struct decode_ctx *ctx = *arg;

	return decode_list_entry(ctx, stream, &ctx->layers, sizeof(zipcache_v1_LayerStats),
				 &zipcache_v1_LayerStats_msg);
}

static bool decode_session(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
	struct decode_ctx *ctx = *arg;

	return decode_list_entry(ctx, stream, &ctx->sessions, sizeof(zipcache_v1_SessionInfo),
				 &zipcache_v1_SessionInfo_msg);
}

/*
 * The second look at a request: what nanopb does not check or does not
 * say. nanopb refuses a string longer than its array, or an integer wider
 * than its field, with "string overflow" / "integer too large" and no word
 * of which field; it accepts a string with a NUL byte inside, which C
 * then reads cut short (so "a\0x" would name the session "a"), and an
 * enum value the enum does not define. And a failed pb_decode() leaves us
 * no request id to answer with. So a refused request, and every request
 * that carries strings or enums (hello, open_session, both rare), is
 * walked field by field once more against the descriptors, to recover
 * the id and to name the first field that broke its type's limit.
 */

/* Field names from the generated FIELDLIST macros, for messages only. */
struct field_name {
	uint32_t tag;
	const char *name;  /* "layers", or "(op,hello,op.hello)" for a oneof member */
};

#define WIRE_FIELD_NAME(a, allocation, kind, ltype, field, tag) { tag, #field },
#define WIRE_NAMES(message)                                                        \
	static const struct field_name names_##message[] = {                       \
		zipcache_v1_##message##_FIELDLIST(WIRE_FIELD_NAME, 0)               \
	}

WIRE_NAMES(Request);
WIRE_NAMES(HelloRequest);
WIRE_NAMES(OpenSessionRequest);
WIRE_NAMES(SessionShape);
WIRE_NAMES(CodecConfig);
WIRE_NAMES(UpdateAndFetchRequest);
WIRE_NAMES(TrimRequest);
WIRE_NAMES(CloseSessionRequest);
WIRE_NAMES(StatsRequest);
WIRE_NAMES(StagingRequest);

#define WIRE_NAMES_ENTRY(message)                                                  \
	{ &zipcache_v1_##message##_msg, names_##message,                             \
	  sizeof(names_##message) / sizeof(names_##message[0]) }

static const struct message_names {
	const pb_msgdesc_t *desc;
	const struct field_name *names;
	size_t count;
} message_names[] = {
	WIRE_NAMES_ENTRY(Request), WIRE_NAMES_ENTRY(HelloRequest),
	WIRE_NAMES_ENTRY(OpenSessionRequest), WIRE_NAMES_ENTRY(SessionShape),
	WIRE_NAMES_ENTRY(CodecConfig), WIRE_NAMES_ENTRY(UpdateAndFetchRequest),
	WIRE_NAMES_ENTRY(TrimRequest), WIRE_NAMES_ENTRY(CloseSessionRequest),
	WIRE_NAMES_ENTRY(StatsRequest), WIRE_NAMES_ENTRY(StagingRequest),
};

/* The enums of requests; nanopb's descriptors store them as plain uint32. */
static const struct enum_field {
	const pb_msgdesc_t *desc;
	uint32_t tag;
	int64_t min, max;
	const char *what;
} enum_fields[] = {
	{ &zipcache_v1_OpenSessionRequest_msg, zipcache_v1_OpenSessionRequest_policy_tag,
	  _zipcache_v1_BlockPolicy_MIN, _zipcache_v1_BlockPolicy_MAX,
	  "0 (STREAMING) or 1 (PER_CALL)" },
};

struct request_check {
	uint64_t request_id;  /* the last well-formed field 1, else 0 */
	char *why;            /* the first limit broken; "" while none */
	size_t why_size;
};

/* "open_session.shape.layers": parent's path, a dot, this field's name. */
static void field_path(char *path, size_t size, const char *parent, const pb_msgdesc_t *desc,
		       uint32_t tag)
{
	const char *name = NULL;
	int length;

	for (size_t i = 0; i < sizeof(message_names) / sizeof(message_names[0]) && !name; i++)
		for (size_t j = 0; message_names[i].desc == desc && j < message_names[i].count; j++)
			if (message_names[i].names[j].tag == tag)
				name = message_names[i].names[j].name;
	if (!name) {
		snprintf(path, size, "%s%sfield %u", parent, *parent ? "." : "", (unsigned)tag);
		return;
	}
	length = (int)strlen(name);
	if (name[0] == '(') {
		/* A oneof member: the second of "(oneof,member,path)". */
		const char *member = strchr(name, ',') + 1;
		name = member;
		length = (int)(strchr(member, ',') - member);
	}
	snprintf(path, size, "%s%s%.*s", parent, *parent ? "." : "", length, name);
}

__attribute__((format(printf, 2, 3)))
static void check_note(struct request_check *check, const char *format, ...)
{
	va_list args;

	if (check->why[0])
		return;  /* the first broken limit is the one to name */
	va_start(args, format);
	vsnprintf(check->why, check->why_size, format, args);
	va_end(args);
}

static const struct enum_field *enum_field_find(const pb_msgdesc_t *desc, uint32_t tag)
{
	for (size_t i = 0; i < sizeof(enum_fields) / sizeof(enum_fields[0]); i++)
		if (enum_fields[i].desc == desc && enum_fields[i].tag == tag)
			return &enum_fields[i];
	return NULL;
}

/* A varint field's value against what its field can hold. */
static void check_varint(struct request_check *check, const pb_field_iter_t *iter,
			 const char *path, uint64_t value)
{
	const struct enum_field *e = enum_field_find(iter->descriptor, iter->tag);

	if (e) {
		/* proto3 enums are int32: a negative one arrives sign-extended. */
		int64_t v = (int64_t)value;
		if (v < e->min || v > e->max)
			check_note(check, "%s is %lld; it must be %s", path, (long long)v, e->what);
	} else if (PB_LTYPE(iter->type) == PB_LTYPE_UVARINT && iter->data_size == 4 &&
		   value > UINT32_MAX) {
		check_note(check, "%s is %llu; the limit is %u", path, (unsigned long long)value,
			   UINT32_MAX);
	}
}

/*
 * Walks the fields of one message (the stream is a buffer stream over the
 * frame, so its state is the next byte). Returns false where the structure
 * itself breaks: nothing after that point can be read.
 */
static bool check_message(struct request_check *check, pb_istream_t *s,
			  const pb_msgdesc_t *desc, const char *parent)
{
	/* Storage the iterator may point into; never read or written. */
	static const zipcache_v1_Request scratch;

	while (s->bytes_left > 0) {
		pb_field_iter_t iter;
		pb_wire_type_t wire_type;
		uint32_t tag, length;
		uint64_t value;
		bool eof;
		char path[128];

		if (!pb_decode_tag(s, &wire_type, &tag, &eof))
			return false;
		if (!pb_field_iter_begin_const(&iter, desc, &scratch) || !pb_field_iter_find(&iter, tag))
			goto skip;
		field_path(path, sizeof(path), parent, desc, tag);
		switch (PB_LTYPE(iter.type)) {
		case PB_LTYPE_BOOL:
		case PB_LTYPE_VARINT:
		case PB_LTYPE_UVARINT:
			if (wire_type != PB_WT_VARINT)
				return false;
			if (!pb_decode_varint(s, &value))
				return false;
			if (desc == &zipcache_v1_Request_msg && tag == zipcache_v1_Request_request_id_tag)
				check->request_id = value;
			else
				check_varint(check, &iter, path, value);
			continue;
		case PB_LTYPE_STRING:
			if (wire_type != PB_WT_STRING || !pb_decode_varint32(s, &length) ||
			    length > s->bytes_left)
				return false;
			if (PB_ATYPE(iter.type) == PB_ATYPE_STATIC && length > iter.data_size - 1u)
				check_note(check, "%s is %u bytes; the limit is %u", path, (unsigned)length,
					   (unsigned)(iter.data_size - 1u));
			else if (memchr(s->state, '\0', length))
				check_note(check, "%s has a NUL byte at offset %td; text may not contain NUL",
					   path, (const uint8_t *)memchr(s->state, '\0', length) -
						 (const uint8_t *)s->state);
			if (!pb_read(s, NULL, length))
				return false;
			continue;
		case PB_LTYPE_SUBMESSAGE: {
			pb_istream_t sub;
			bool whole;

			if (wire_type != PB_WT_STRING || !pb_make_string_substream(s, &sub))
				return false;
			whole = check_message(check, &sub, iter.submsg_desc, path);
			if (!pb_close_string_substream(s, &sub) || !whole)
				return false;
			continue;
		}
		default:
			break;
		}
skip:
		if (!pb_skip_field(s, wire_type))
			return false;
	}
	return true;
}

/* Fills out->msg.request_id and, for a broken limit, out->reason. */
static void request_check(const uint8_t *frame, size_t len, wire_request *out)
{
	struct request_check check = { .why = out->reason, .why_size = sizeof(out->reason) };
	pb_istream_t s = pb_istream_from_buffer(frame, len);

	out->reason[0] = '\0';
	check_message(&check, &s, &zipcache_v1_Request_msg, "");
	out->msg.request_id = check.request_id;
}

int wire_request_decode(const uint8_t *frame, size_t len, wire_request *out)
{
	struct decode_ctx ctx = { .frame = frame, .len = len };
	zipcache_v1_UpdateAndFetchRequest *uaf = &out->msg.op.update_and_fetch;
	pb_istream_t s;

	memset(out, 0, sizeof(*out));
	ctx.keys = &out->keys;
	ctx.values = &out->values;

	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode(&s, &zipcache_v1_Request_msg, &out->msg))
		goto out_malformed;
	if (out->msg.which_op == zipcache_v1_Request_hello_tag ||
	    out->msg.which_op == zipcache_v1_Request_open_session_tag) {
		/* The ops with strings and enums: see request_check(). */
		request_check(frame, len, out);
		if (out->reason[0])
			goto out_malformed;
		return 0;
	}
	if (out->msg.which_op != zipcache_v1_Request_update_and_fetch_tag)
		return 0;

	memset(&out->msg, 0, sizeof(out->msg));
	out->msg.which_op = zipcache_v1_Request_update_and_fetch_tag;
	uaf->keys.funcs.decode = decode_inline;
	uaf->keys.arg = &ctx;
	uaf->values.funcs.decode = decode_inline;
	uaf->values.arg = &ctx;
	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode_ex(&s, &zipcache_v1_Request_msg, &out->msg, PB_DECODE_NOINIT))
		goto out_malformed;
	if (out->msg.which_op != zipcache_v1_Request_update_and_fetch_tag ||
	    uaf->keys.funcs.decode == NULL || uaf->values.funcs.decode == NULL) {
		ctx.why = "another op precedes update_and_fetch in the request";
		goto out_malformed;
	}
	/* No pointers to this stack frame may outlive it. */
	memset(&uaf->keys, 0, sizeof(uaf->keys));
	memset(&uaf->values, 0, sizeof(uaf->values));
	return 0;

out_malformed:
	memset(out, 0, sizeof(*out));
	request_check(frame, len, out);
	out->error = ctx.why ? ctx.why : out->reason[0] ? out->reason : PB_GET_ERROR(&s);
	return ZC_EPROTOCOL;
}

int wire_response_decode(const uint8_t *frame, size_t len, wire_response *out)
{
	struct decode_ctx ctx = { .frame = frame, .len = len };
	pb_callback_t *cb;
	pb_size_t op;
	pb_istream_t s;

	memset(out, 0, sizeof(*out));
	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode(&s, &zipcache_v1_Response_msg, &out->msg))
		goto out_free_lists;
	op = out->msg.which_op;
	if (op != zipcache_v1_Response_stats_tag && op != zipcache_v1_Response_list_sessions_tag)
		return 0;

	memset(&out->msg, 0, sizeof(out->msg));
	out->msg.which_op = op;
	if (op == zipcache_v1_Response_stats_tag) {
		cb = &out->msg.op.stats.layers;
		cb->funcs.decode = decode_layer;
	} else {
		cb = &out->msg.op.list_sessions.sessions;
		cb->funcs.decode = decode_session;
	}
	cb->arg = &ctx;
	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode_ex(&s, &zipcache_v1_Response_msg, &out->msg, PB_DECODE_NOINIT))
		goto out_free_lists;
	if (out->msg.which_op != op || cb->funcs.decode == NULL) {
		ctx.why = "another op precedes the final op in the response";
		goto out_free_lists;
	}
	memset(cb, 0, sizeof(*cb));
	out->layers = ctx.layers.items;
	out->n_layers = ctx.layers.n;
	out->sessions = ctx.sessions.items;
	out->n_sessions = ctx.sessions.n;
	out->lists_owned = 1;
	return 0;

out_free_lists:
	free(ctx.layers.items);
	free(ctx.sessions.items);
	/* Half-decoded fields and a callback aimed at ctx on this stack: drop them. */
	memset(out, 0, sizeof(*out));
	out->error = ctx.why ? ctx.why : PB_GET_ERROR(&s);
	return ctx.err ? ctx.err : ZC_EPROTOCOL;
}

void wire_response_free(wire_response *resp)
{
	if (resp->lists_owned) {
		free(resp->layers);
		free(resp->sessions);
	}
	resp->layers = NULL;
	resp->n_layers = 0;
	resp->sessions = NULL;
	resp->n_sessions = 0;
	resp->lists_owned = 0;
}

/* keys / values of UpdateAndFetchRequest from a span; proto3 omits empty bytes. */
static bool encode_inline(pb_ostream_t *stream, const pb_field_t *field, void *const *arg)
{
	const wire_span *span = *arg;

	if (span->len == 0)
		return true;
	return pb_encode_tag_for_field(stream, field) &&
	       pb_encode_string(stream, span->data, span->len);
}

static bool encode_list(pb_ostream_t *stream, const pb_field_t *field, void *const *arg)
{
	const struct encode_list *list = *arg;

	for (size_t i = 0; i < list->n; i++) {
		const void *item = (const char *)list->items + i * list->size;

		if (!pb_encode_tag_for_field(stream, field) ||
		    !pb_encode_submessage(stream, list->desc, item))
			return false;
	}
	return true;
}

/*
 * A request as nanopb should see it: a copy (the caller's is const) with
 * the inline callbacks pointing at the caller's spans.
 */
static void request_prepare(const wire_request *req, zipcache_v1_Request *msg)
{
	*msg = req->msg;
	if (msg->which_op == zipcache_v1_Request_update_and_fetch_tag) {
		zipcache_v1_UpdateAndFetchRequest *uaf = &msg->op.update_and_fetch;

		uaf->keys.funcs.encode = encode_inline;
		uaf->keys.arg = (void *)&req->keys;
		uaf->values.funcs.encode = encode_inline;
		uaf->values.arg = (void *)&req->values;
	}
}

/*
 * The response nanopb should see. The generated struct is ~17 KiB (the
 * view layout arrays), so it is copied into *copy only for the two ops
 * whose list callbacks must be planted; *list must outlive the encode.
 * Returns NULL for a list too long for any decoder to accept.
 */
static const zipcache_v1_Response *response_prepare(const wire_response *resp,
						    zipcache_v1_Response *copy,
						    struct encode_list *list)
{
	pb_callback_t *cb;

	if (resp->msg.which_op == zipcache_v1_Response_stats_tag) {
		*list = (struct encode_list){ resp->layers, resp->n_layers,
					      sizeof(zipcache_v1_LayerStats),
					      &zipcache_v1_LayerStats_msg };
		*copy = resp->msg;
		cb = &copy->op.stats.layers;
	} else if (resp->msg.which_op == zipcache_v1_Response_list_sessions_tag) {
		*list = (struct encode_list){ resp->sessions, resp->n_sessions,
					      sizeof(zipcache_v1_SessionInfo),
					      &zipcache_v1_SessionInfo_msg };
		*copy = resp->msg;
		cb = &copy->op.list_sessions.sessions;
	} else {
		return &resp->msg;
	}
	if (list->n > WIRE_MAX_LIST_ITEMS || (list->n > 0 && list->items == NULL))
		return NULL;
	cb->funcs.encode = encode_list;
	cb->arg = list;
	return copy;
}

/* Frame size for an encodable message, or ZC_EINVALID / ZC_EFRAMESIZE. */
static int frame_size(const pb_msgdesc_t *desc, const void *msg, size_t *size)
{
	size_t n;

	if (!pb_get_encoded_size(&n, desc, msg))
		return ZC_EINVALID;
	if (n > UINT32_MAX)
		return ZC_EFRAMESIZE;
	*size = FRAME_HEADER_BYTES + n;
	return 0;
}

/*
 * Encodes header + message into buf. nanopb reports a full buffer and a
 * bad struct alike (false), so on failure the message is sized to tell the
 * caller which: a cold path, the hot one encodes once.
 */
static int encode_frame(const pb_msgdesc_t *desc, const void *msg, uint8_t *buf,
			size_t cap, size_t *frame_len)
{
	pb_ostream_t s;
	size_t room, size;
	int rc;

	if (cap < FRAME_HEADER_BYTES)
		goto out_classify;
	room = cap - FRAME_HEADER_BYTES;
	/* The header holds 32 bits; a larger message can never be sent. */
	if (room > UINT32_MAX)
		room = UINT32_MAX;
	s = pb_ostream_from_buffer(buf + FRAME_HEADER_BYTES, room);
	if (!pb_encode(&s, desc, msg))
		goto out_classify;
	frame_header_write(buf, (uint32_t)s.bytes_written);
	*frame_len = FRAME_HEADER_BYTES + s.bytes_written;
	return 0;

out_classify:
	rc = frame_size(desc, msg, &size);
	return rc < 0 ? rc : ZC_EBUFFER;
}

int wire_request_frame_size(const wire_request *req, size_t *size)
{
	zipcache_v1_Request msg;

	request_prepare(req, &msg);
	return frame_size(&zipcache_v1_Request_msg, &msg, size);
}

int wire_request_encode(const wire_request *req, uint8_t *buf, size_t cap, size_t *frame_len)
{
	zipcache_v1_Request msg;

	request_prepare(req, &msg);
	return encode_frame(&zipcache_v1_Request_msg, &msg, buf, cap, frame_len);
}

int wire_response_frame_size(const wire_response *resp, size_t *size)
{
	zipcache_v1_Response copy;
	struct encode_list list;
	const zipcache_v1_Response *msg = response_prepare(resp, &copy, &list);

	if (msg == NULL)
		return ZC_EINVALID;
	return frame_size(&zipcache_v1_Response_msg, msg, size);
}

int wire_response_encode(const wire_response *resp, uint8_t *buf, size_t cap, size_t *frame_len)
{
	zipcache_v1_Response copy;
	struct encode_list list;
	const zipcache_v1_Response *msg = response_prepare(resp, &copy, &list);

	if (msg == NULL)
		return ZC_EINVALID;
	return encode_frame(&zipcache_v1_Response_msg, msg, buf, cap, frame_len);
}

void wire_response_set_status(wire_response *resp, int zc_error, const char *message)
{
	size_t max = sizeof(resp->msg.message) - 1;
	size_t n = message ? strlen(message) : 0;

	resp->msg.status = wire_status_from_error(zc_error);
	if (n > max) {
		/* message[n] is the first byte left out: back off to a lead byte. */
		n = max;
		while (n > 0 && ((unsigned char)message[n] & 0xc0) == 0x80)
			n--;
	}
	if (n > 0)
		memcpy(resp->msg.message, message, n);
	resp->msg.message[n] = '\0';
}

zipcache_v1_Status wire_status_from_error(int zc_error)
{
	if (zc_error >= 0)
		return zipcache_v1_Status_OK;
	switch (zc_error) {
	case ZC_EINVALID:
	case ZC_EBITS:
	case ZC_EFRACTION:
	case ZC_EGROUPSIZE:
	case ZC_ESHAPE:
	case ZC_ENONFINITE:
	case ZC_ETENSOR:
	case ZC_EPROTOCOL:
		return zipcache_v1_Status_INVALID_ARGUMENT;
	case ZC_ENOTFOUND:
		return zipcache_v1_Status_NOT_FOUND;
	case ZC_EEXISTS:
		return zipcache_v1_Status_ALREADY_EXISTS;
	case ZC_EEXHAUSTED:
	case ZC_EFRAMESIZE:
	case -ENOMEM:
	case -ENOSPC:
	case -EMFILE:
	case -ENFILE:
	case -EAGAIN:
	case -ENOBUFS:
		return zipcache_v1_Status_RESOURCE_EXHAUSTED;
	case ZC_EDENIED:
		return zipcache_v1_Status_PERMISSION_DENIED;
	case ZC_EPRECONDITION:
		return zipcache_v1_Status_FAILED_PRECONDITION;
	default:
		return zipcache_v1_Status_INTERNAL;
	}
}

int wire_error_from_status(zipcache_v1_Status status)
{
	switch (status) {
	case zipcache_v1_Status_OK:
		return 0;
	case zipcache_v1_Status_INVALID_ARGUMENT:
		return ZC_EINVALID;
	case zipcache_v1_Status_NOT_FOUND:
		return ZC_ENOTFOUND;
	case zipcache_v1_Status_ALREADY_EXISTS:
		return ZC_EEXISTS;
	case zipcache_v1_Status_RESOURCE_EXHAUSTED:
		return ZC_EEXHAUSTED;
	case zipcache_v1_Status_PERMISSION_DENIED:
		return ZC_EDENIED;
	case zipcache_v1_Status_FAILED_PRECONDITION:
		return ZC_EPRECONDITION;
	case zipcache_v1_Status_INTERNAL:
	default:
		return ZC_EINTERNAL;
	}
}
