/*
 * Wire messages over nanopb 0.4.7: every nanopb call of the project is in
 * this file. The generated structs (wire_pb.h) are decoded and encoded
 * first; the plain structs of wire.h, which the daemon and the client
 * speak, are converted to and from them at the end of the file, only the
 * op a message carries.
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
#include "wire_pb.h"

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

/* Protocol Buffers wire types of the fields encoded and decoded by hand. */
#define PB_WIRE_VARINT 0u
#define PB_WIRE_LEN 2u

/* What the decode callbacks need; their arg points at one of these. */
struct decode_ctx {
	const uint8_t *frame; /* the buffer being decoded, to bound spans */
	size_t len;
	wire_span *keys;
	wire_span *values;
	wire_span *mass;
	struct decode_list {
		void *items;
		size_t n;
		size_t cap;
	} layers, sessions;
	int err;         /* -ENOMEM from a callback, else 0: ZC_EPROTOCOL */
	const char *why; /* our reason for a callback failure, over nanopb's */
};

/* The generated struct one entry of a list becomes before it is encoded. */
union pb_entry {
	zipcache_v1_LayerStats layer;
	zipcache_v1_SessionInfo session;
};

/* A list to encode: the caller's array and how to encode one entry
 * (converted first when the array holds plain structs). */
struct encode_list {
	const void *items;
	size_t n;
	size_t size;
	const pb_msgdesc_t *desc;
	void (*convert)(const void *item, union pb_entry *out);
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

/* keys / values / attention_mass of UpdateAndFetchRequest: remember where
 * they are, skip them. */
static bool decode_inline(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
	struct decode_ctx *ctx = *arg;
	wire_span *span;

	if (!stream_in_frame(ctx, stream)) {
		ctx->why = "inline keys/values must be length-delimited bytes";
		return false;
	}
	span = field->tag == zipcache_v1_UpdateAndFetchRequest_keys_tag ? ctx->keys :
	       field->tag == zipcache_v1_UpdateAndFetchRequest_values_tag ? ctx->values :
								       ctx->mass;
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
 * that carries strings or enums (hello, open_session, fork_session, all rare), is
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
WIRE_NAMES(ForkSessionRequest);
WIRE_NAMES(ReleaseRequest);
WIRE_NAMES(ExportSessionRequest);
WIRE_NAMES(ImportSessionRequest);

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
	WIRE_NAMES_ENTRY(ForkSessionRequest), WIRE_NAMES_ENTRY(ReleaseRequest),
	WIRE_NAMES_ENTRY(ExportSessionRequest), WIRE_NAMES_ENTRY(ImportSessionRequest),
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
	{ &zipcache_v1_OpenSessionRequest_msg, zipcache_v1_OpenSessionRequest_views_tag,
	  _zipcache_v1_Views_MIN, _zipcache_v1_Views_MAX, "0 (VIEWS_FULL) or 1 (VIEWS_NONE)" },
	{ &zipcache_v1_ForkSessionRequest_msg, zipcache_v1_ForkSessionRequest_views_tag,
	  _zipcache_v1_Views_MIN, _zipcache_v1_Views_MAX, "0 (VIEWS_FULL) or 1 (VIEWS_NONE)" },
	{ &zipcache_v1_ImportSessionRequest_msg, zipcache_v1_ImportSessionRequest_views_tag,
	  _zipcache_v1_Views_MIN, _zipcache_v1_Views_MAX, "0 (VIEWS_FULL) or 1 (VIEWS_NONE)" },
	{ &zipcache_v1_CodecConfig_msg, zipcache_v1_CodecConfig_saliency_tag,
	  _zipcache_v1_Saliency_MIN, _zipcache_v1_Saliency_MAX,
	  "0 (SALIENCY_KEY_NORM) or 1 (SALIENCY_ATTENTION)" },
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
		case PB_LTYPE_BYTES: {
			size_t room = iter.data_size - offsetof(pb_bytes_array_t, bytes);
			if (wire_type != PB_WT_STRING || !pb_decode_varint32(s, &length) ||
			    length > s->bytes_left)
				return false;
			if (PB_ATYPE(iter.type) == PB_ATYPE_STATIC && length > room)
				check_note(check, "%s is %u bytes; the limit is %zu", path, (unsigned)length,
					   room);
			if (!pb_read(s, NULL, length))
				return false;
			continue;
		}
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
static void request_check(const uint8_t *frame, size_t len, wire_pb_request *out)
{
	struct request_check check = { .why = out->reason, .why_size = sizeof(out->reason) };
	pb_istream_t s = pb_istream_from_buffer(frame, len);

	out->reason[0] = '\0';
	check_message(&check, &s, &zipcache_v1_Request_msg, "");
	out->msg.request_id = check.request_id;
}

int wire_pb_request_decode(const uint8_t *frame, size_t len, wire_pb_request *out)
{
	struct decode_ctx ctx = { .frame = frame, .len = len };
	zipcache_v1_UpdateAndFetchRequest *uaf = &out->msg.op.update_and_fetch;
	pb_istream_t s;

	memset(out, 0, sizeof(*out));
	ctx.keys = &out->keys;
	ctx.values = &out->values;
	ctx.mass = &out->attention_mass;

	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode(&s, &zipcache_v1_Request_msg, &out->msg))
		goto out_malformed;
	if (out->msg.which_op == zipcache_v1_Request_hello_tag ||
	    out->msg.which_op == zipcache_v1_Request_open_session_tag ||
	    out->msg.which_op == zipcache_v1_Request_fork_session_tag ||
	    out->msg.which_op == zipcache_v1_Request_import_session_tag ||
	    out->msg.which_op == zipcache_v1_Request_lookup_prefix_tag) {
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
	uaf->attention_mass.funcs.decode = decode_inline;
	uaf->attention_mass.arg = &ctx;
	s = pb_istream_from_buffer(frame, len);
	if (!pb_decode_ex(&s, &zipcache_v1_Request_msg, &out->msg, PB_DECODE_NOINIT))
		goto out_malformed;
	if (out->msg.which_op != zipcache_v1_Request_update_and_fetch_tag ||
	    uaf->keys.funcs.decode == NULL || uaf->values.funcs.decode == NULL ||
	    uaf->attention_mass.funcs.decode == NULL) {
		ctx.why = "another op precedes update_and_fetch in the request";
		goto out_malformed;
	}
	/* No pointers to this stack frame may outlive it. */
	memset(&uaf->keys, 0, sizeof(uaf->keys));
	memset(&uaf->values, 0, sizeof(uaf->values));
	memset(&uaf->attention_mass, 0, sizeof(uaf->attention_mass));
	return 0;

out_malformed:
	memset(out, 0, sizeof(*out));
	request_check(frame, len, out);
	out->error = ctx.why ? ctx.why : out->reason[0] ? out->reason : PB_GET_ERROR(&s);
	return ZC_EPROTOCOL;
}

int wire_pb_response_decode(const uint8_t *frame, size_t len, wire_pb_response *out)
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

void wire_pb_response_free(wire_pb_response *resp)
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
		union pb_entry entry;

		if (list->convert) {
			list->convert(item, &entry);
			item = &entry;
		}

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
static void request_prepare(const wire_pb_request *req, zipcache_v1_Request *msg)
{
	*msg = req->msg;
	if (msg->which_op == zipcache_v1_Request_update_and_fetch_tag) {
		zipcache_v1_UpdateAndFetchRequest *uaf = &msg->op.update_and_fetch;

		uaf->keys.funcs.encode = encode_inline;
		uaf->keys.arg = (void *)&req->keys;
		uaf->values.funcs.encode = encode_inline;
		uaf->values.arg = (void *)&req->values;
		uaf->attention_mass.funcs.encode = encode_inline;
		uaf->attention_mass.arg = (void *)&req->attention_mass;
	}
}

/*
 * The response nanopb should see. The generated struct is ~17 KiB (the
 * view layout arrays), so it is copied into *copy only for the two ops
 * whose list callbacks must be planted; *list must outlive the encode.
 * Returns NULL for a list too long for any decoder to accept.
 */
static const zipcache_v1_Response *response_prepare(const wire_pb_response *resp,
						    zipcache_v1_Response *copy,
						    struct encode_list *list)
{
	pb_callback_t *cb;

	if (resp->msg.which_op == zipcache_v1_Response_stats_tag) {
		*list = (struct encode_list){ resp->layers, resp->n_layers,
					      sizeof(zipcache_v1_LayerStats),
					      &zipcache_v1_LayerStats_msg, NULL };
		*copy = resp->msg;
		cb = &copy->op.stats.layers;
	} else if (resp->msg.which_op == zipcache_v1_Response_list_sessions_tag) {
		*list = (struct encode_list){ resp->sessions, resp->n_sessions,
					      sizeof(zipcache_v1_SessionInfo),
					      &zipcache_v1_SessionInfo_msg, NULL };
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

int wire_pb_request_frame_size(const wire_pb_request *req, size_t *size)
{
	zipcache_v1_Request msg;

	request_prepare(req, &msg);
	return frame_size(&zipcache_v1_Request_msg, &msg, size);
}

int wire_pb_request_encode(const wire_pb_request *req, uint8_t *buf, size_t cap, size_t *frame_len)
{
	zipcache_v1_Request msg;

	request_prepare(req, &msg);
	return encode_frame(&zipcache_v1_Request_msg, &msg, buf, cap, frame_len);
}

int wire_pb_response_frame_size(const wire_pb_response *resp, size_t *size)
{
	zipcache_v1_Response copy;
	struct encode_list list;
	const zipcache_v1_Response *msg = response_prepare(resp, &copy, &list);

	if (msg == NULL)
		return ZC_EINVALID;
	return frame_size(&zipcache_v1_Response_msg, msg, size);
}

int wire_pb_response_encode(const wire_pb_response *resp, uint8_t *buf, size_t cap, size_t *frame_len)
{
	zipcache_v1_Response copy;
	struct encode_list list;
	const zipcache_v1_Response *msg = response_prepare(resp, &copy, &list);

	if (msg == NULL)
		return ZC_EINVALID;
	return encode_frame(&zipcache_v1_Response_msg, msg, buf, cap, frame_len);
}

/* message (may be NULL) into text[0..size), cut on a UTF-8 character
 * boundary so other protobuf decoders accept it. */
static void message_copy(char *text, size_t size, const char *message)
{
	size_t max = size - 1;
	size_t n = message ? strlen(message) : 0;

	if (n > max) {
		/* message[n] is the first byte left out: back off to a lead byte. */
		n = max;
		while (n > 0 && ((unsigned char)message[n] & 0xc0) == 0x80)
			n--;
	}
	if (n > 0)
		memcpy(text, message, n);
	text[n] = '\0';
}

void wire_pb_response_set_status(wire_pb_response *resp, int zc_error, const char *message)
{
	resp->msg.status = wire_pb_status_from_error(zc_error);
	message_copy(resp->msg.message, sizeof(resp->msg.message), message);
}

zipcache_v1_Status wire_pb_status_from_error(int zc_error)
{
	return (zipcache_v1_Status)wire_status_from_error(zc_error);
}

int wire_pb_error_from_status(zipcache_v1_Status status)
{
	return wire_error_from_status((int)status);
}

enum wire_status wire_status_from_error(int zc_error)
{
	if (zc_error >= 0)
		return WIRE_STATUS_OK;
	switch (zc_error) {
	case ZC_EINVALID:
	case ZC_EBITS:
	case ZC_EFRACTION:
	case ZC_EGROUPSIZE:
	case ZC_ESHAPE:
	case ZC_ENONFINITE:
	case ZC_ETENSOR:
	case ZC_EPROTOCOL:
		return WIRE_STATUS_INVALID_ARGUMENT;
	case ZC_ENOTFOUND:
		return WIRE_STATUS_NOT_FOUND;
	case ZC_EEXISTS:
		return WIRE_STATUS_ALREADY_EXISTS;
	case ZC_EEXHAUSTED:
	case ZC_EFRAMESIZE:
	case -ENOMEM:
	case -ENOSPC:
	case -EMFILE:
	case -ENFILE:
	case -EAGAIN:
	case -ENOBUFS:
		return WIRE_STATUS_RESOURCE_EXHAUSTED;
	case ZC_EDENIED:
		return WIRE_STATUS_PERMISSION_DENIED;
	case ZC_EPRECONDITION:
		return WIRE_STATUS_FAILED_PRECONDITION;
	case ZC_ECORRUPT:
		return WIRE_STATUS_DATA_LOSS;
	case ZC_EREMOTE:
		return WIRE_STATUS_UNAVAILABLE;
	default:
		return WIRE_STATUS_INTERNAL;
	}
}

int wire_error_from_status(int status)
{
	switch (status) {
	case WIRE_STATUS_OK:
		return 0;
	case WIRE_STATUS_INVALID_ARGUMENT:
		return ZC_EINVALID;
	case WIRE_STATUS_NOT_FOUND:
		return ZC_ENOTFOUND;
	case WIRE_STATUS_ALREADY_EXISTS:
		return ZC_EEXISTS;
	case WIRE_STATUS_RESOURCE_EXHAUSTED:
		return ZC_EEXHAUSTED;
	case WIRE_STATUS_PERMISSION_DENIED:
		return ZC_EDENIED;
	case WIRE_STATUS_FAILED_PRECONDITION:
		return ZC_EPRECONDITION;
	case WIRE_STATUS_DATA_LOSS:
		return ZC_ECORRUPT;
	case WIRE_STATUS_UNAVAILABLE:
		return ZC_EREMOTE;
	case WIRE_STATUS_INTERNAL:
	default:
		return ZC_EINTERNAL;
	}
}

/* ---- the plain structs of wire.h, to and from the generated ones ---- */

/* The bounded fields of zipcache.options and the sizes wire.h gives them. */
#define WIRE_SAME_SIZE(a, b) _Static_assert(sizeof(a) == sizeof(b), #a " and " #b " differ")
WIRE_SAME_SIZE(((zipcache_v1_OpenSessionRequest *)0)->name, ((struct wire_open_request *)0)->name);
WIRE_SAME_SIZE(((zipcache_v1_SessionInfo *)0)->name, ((zc_session_info *)0)->name);
WIRE_SAME_SIZE(((zipcache_v1_HelloRequest *)0)->client_name,
	       ((struct wire_hello_request *)0)->client_name);
WIRE_SAME_SIZE(((zipcache_v1_HelloResponse *)0)->server_version,
	       ((zc_server_info *)0)->server_version);
WIRE_SAME_SIZE(((zipcache_v1_Response *)0)->message, ((wire_response *)0)->message);
WIRE_SAME_SIZE(((zipcache_v1_ViewLayout *)0)->key_offsets,
	       ((struct wire_view_layout *)0)->key_offsets);
WIRE_SAME_SIZE(((zipcache_v1_ViewLayout *)0)->value_offsets,
	       ((struct wire_view_layout *)0)->value_offsets);
WIRE_SAME_SIZE(((zipcache_v1_StatsResponse *)0)->set_aside,
	       ((struct wire_stats_response *)0)->set_aside);
WIRE_SAME_SIZE(((zipcache_v1_SetAsideFile *)0)->file, ((zc_set_aside_file *)0)->file);
WIRE_SAME_SIZE(((zipcache_v1_SetAsideFile *)0)->reason, ((zc_set_aside_file *)0)->reason);
WIRE_SAME_SIZE(((zipcache_v1_OpenSessionRequest *)0)->prefix.bytes,
	       ((struct wire_open_request *)0)->prefix);
WIRE_SAME_SIZE(((zipcache_v1_UpdateAndFetchRequest *)0)->chunk_key.bytes,
	       ((struct wire_update_request *)0)->chunk_key);
WIRE_SAME_SIZE(((zipcache_v1_OpenSessionRequest *)0)->model_id,
	       ((struct wire_open_request *)0)->model_id);
WIRE_SAME_SIZE(((zipcache_v1_SessionInfo *)0)->model_id, ((zc_session_info *)0)->model_id);
WIRE_SAME_SIZE(((zipcache_v1_ImportSessionRequest *)0)->name,
	       ((struct wire_import_request *)0)->name);
WIRE_SAME_SIZE(((zipcache_v1_ImportSessionRequest *)0)->model_id,
	       ((struct wire_import_request *)0)->model_id);
_Static_assert(WIRE_STATUS_DATA_LOSS == (int)zipcache_v1_Status_DATA_LOSS &&
	       WIRE_STATUS_UNAVAILABLE == (int)zipcache_v1_Status_UNAVAILABLE,
	       "enum wire_status follows zipcache.v1.Status");
_Static_assert(WIRE_STATUS_INTERNAL == (int)zipcache_v1_Status_INTERNAL &&
	       WIRE_STATUS_RESOURCE_EXHAUSTED == (int)zipcache_v1_Status_RESOURCE_EXHAUSTED,
	       "enum wire_status follows zipcache.v1.Status");
_Static_assert(ZC_POLICY_PER_CALL == (int)zipcache_v1_BlockPolicy_PER_CALL &&
	       ZC_POLICY_STREAMING == (int)zipcache_v1_BlockPolicy_STREAMING,
	       "zc_block_policy follows zipcache.v1.BlockPolicy");

void wire_codec_from_config(const zc_codec_config *config, struct wire_codec *out)
{
	*out = (struct wire_codec){
		.has_hi_bits = true, .hi_bits = config->hi_bits < 0 ? 0 : (uint32_t)config->hi_bits,
		.has_lo_bits = true, .lo_bits = config->lo_bits < 0 ? 0 : (uint32_t)config->lo_bits,
		.has_hi_fraction = true, .hi_fraction = config->hi_fraction,
		.has_group_size = true,
		.group_size = config->group_size < 0 ? 0 : (uint32_t)config->group_size,
		.has_quantize_values = true, .quantize_values = config->quantize_values,
		/* Out of range goes as a value the other side refuses. */
		.has_saliency = true,
		.saliency = config->saliency < 0 ? UINT32_MAX : (uint32_t)config->saliency,
	};
}

void wire_codec_to_config(const struct wire_codec *codec, zc_codec_config *config)
{
	if (codec->has_hi_bits)
		config->hi_bits = codec->hi_bits > 64 ? 64 : (int)codec->hi_bits;
	if (codec->has_lo_bits)
		config->lo_bits = codec->lo_bits > 64 ? 64 : (int)codec->lo_bits;
	if (codec->has_hi_fraction)
		config->hi_fraction = codec->hi_fraction;
	if (codec->has_group_size)
		config->group_size = codec->group_size > ZC_MAX_BLOCK_TOKENS ? 0 : (int)codec->group_size;
	if (codec->has_quantize_values)
		config->quantize_values = codec->quantize_values;
	if (codec->has_saliency)
		config->saliency = codec->saliency > INT32_MAX ? -1 : (int)codec->saliency;
}

static void codec_to_pb(const struct wire_codec *c, zipcache_v1_CodecConfig *out)
{
	*out = (zipcache_v1_CodecConfig){
		.has_hi_bits = c->has_hi_bits, .hi_bits = c->hi_bits,
		.has_lo_bits = c->has_lo_bits, .lo_bits = c->lo_bits,
		.has_hi_fraction = c->has_hi_fraction, .hi_fraction = c->hi_fraction,
		.has_group_size = c->has_group_size, .group_size = c->group_size,
		.has_quantize_values = c->has_quantize_values, .quantize_values = c->quantize_values,
		.has_saliency = c->has_saliency, .saliency = (zipcache_v1_Saliency)c->saliency,
	};
}

static void codec_from_pb(const zipcache_v1_CodecConfig *c, struct wire_codec *out)
{
	*out = (struct wire_codec){
		.has_hi_bits = c->has_hi_bits, .hi_bits = c->hi_bits,
		.has_lo_bits = c->has_lo_bits, .lo_bits = c->lo_bits,
		.has_hi_fraction = c->has_hi_fraction, .hi_fraction = c->hi_fraction,
		.has_group_size = c->has_group_size, .group_size = c->group_size,
		.has_quantize_values = c->has_quantize_values, .quantize_values = c->quantize_values,
		.has_saliency = c->has_saliency, .saliency = (uint32_t)c->saliency,
	};
}

static void shape_to_pb(const struct wire_shape *s, zipcache_v1_SessionShape *out)
{
	*out = (zipcache_v1_SessionShape){ s->layers, s->batch, s->kv_heads, s->head_dim_k, s->head_dim_v };
}

static void shape_from_pb(const zipcache_v1_SessionShape *s, struct wire_shape *out)
{
	*out = (struct wire_shape){ s->layers, s->batch, s->kv_heads, s->head_dim_k, s->head_dim_v };
}

/* A session as replies describe it: shape and codec always present. */
static void session_to_pb(const zc_session_info *info, zipcache_v1_SessionInfo *out)
{
	struct wire_codec codec;

	memset(out, 0, sizeof(*out));
	out->session_id = info->id;
	memcpy(out->name, info->name, sizeof(out->name));
	out->name[sizeof(out->name) - 1] = '\0';
	out->has_shape = true;
	out->shape = (zipcache_v1_SessionShape){ info->layers, info->batch, info->kv_heads,
						 info->head_dim_k, info->head_dim_v };
	out->max_tokens = info->max_tokens;
	out->has_codec = true;
	wire_codec_from_config(&info->codec, &codec);
	codec_to_pb(&codec, &out->codec);
	out->policy = info->policy == ZC_POLICY_PER_CALL ? zipcache_v1_BlockPolicy_PER_CALL :
							   zipcache_v1_BlockPolicy_STREAMING;
	out->residual_tokens = info->residual_tokens;
	out->min_tokens = info->min_tokens;
	out->max_layer_tokens = info->max_layer_tokens;
	out->idle_ms = info->idle_ms;
	out->views = info->views == ZC_VIEWS_NONE ? zipcache_v1_Views_VIEWS_NONE :
						    zipcache_v1_Views_VIEWS_FULL;
	out->shared_bytes = info->shared_bytes;
	out->leased = info->leased;
	memcpy(out->model_id, info->model_id, sizeof(out->model_id));
	out->model_id[sizeof(out->model_id) - 1] = '\0';
}

static void session_from_pb(const zipcache_v1_SessionInfo *w, zc_session_info *info)
{
	struct wire_codec codec;

	memset(info, 0, sizeof(*info));
	info->id = w->session_id;
	memcpy(info->name, w->name, sizeof(info->name));
	info->layers = w->shape.layers;
	info->batch = w->shape.batch;
	info->kv_heads = w->shape.kv_heads;
	info->head_dim_k = w->shape.head_dim_k;
	info->head_dim_v = w->shape.head_dim_v;
	info->max_tokens = w->max_tokens;
	codec_from_pb(&w->codec, &codec);
	wire_codec_to_config(&codec, &info->codec);
	info->policy = w->policy == zipcache_v1_BlockPolicy_PER_CALL ? ZC_POLICY_PER_CALL :
								       ZC_POLICY_STREAMING;
	info->residual_tokens = w->residual_tokens;
	info->min_tokens = w->min_tokens;
	info->max_layer_tokens = w->max_layer_tokens;
	info->idle_ms = w->idle_ms;
	info->views = w->views == zipcache_v1_Views_VIEWS_NONE ? ZC_VIEWS_NONE : ZC_VIEWS_FULL;
	info->shared_bytes = w->shared_bytes;
	info->leased = w->leased;
	memcpy(info->model_id, w->model_id, sizeof(info->model_id));
}

static void layer_to_pb(const zc_layer_stats *s, zipcache_v1_LayerStats *out)
{
	*out = (zipcache_v1_LayerStats){
		.layer = s->layer,
		.tokens = s->tokens,
		.residual_tokens = s->residual_tokens,
		.compressed_key_bytes = s->compressed_key_bytes,
		.compressed_value_bytes = s->compressed_value_bytes,
		.baseline_key_bytes = s->baseline_key_bytes,
		.baseline_value_bytes = s->baseline_value_bytes,
		.fp16_key_bytes = s->fp16_key_bytes,
		.fp16_value_bytes = s->fp16_value_bytes,
		.compression_ratio = s->compression_ratio,
		.effective_avg_bits = s->effective_avg_bits,
		.blocks = s->blocks,
	};
}

static void layer_from_pb(const zipcache_v1_LayerStats *w, zc_layer_stats *out)
{
	*out = (zc_layer_stats){
		.layer = w->layer,
		.tokens = w->tokens,
		.residual_tokens = w->residual_tokens,
		.blocks = w->blocks,
		.compressed_key_bytes = w->compressed_key_bytes,
		.compressed_value_bytes = w->compressed_value_bytes,
		.baseline_key_bytes = w->baseline_key_bytes,
		.baseline_value_bytes = w->baseline_value_bytes,
		.fp16_key_bytes = w->fp16_key_bytes,
		.fp16_value_bytes = w->fp16_value_bytes,
		.compression_ratio = w->compression_ratio,
		.effective_avg_bits = w->effective_avg_bits,
	};
}

static void convert_layer(const void *item, union pb_entry *out)
{
	layer_to_pb(item, &out->layer);
}

static void convert_session(const void *item, union pb_entry *out)
{
	session_to_pb(item, &out->session);
}

static void request_to_pb(const wire_request *req, wire_pb_request *out)
{
	zipcache_v1_Request *msg = &out->msg;

	memset(out, 0, sizeof(*out));
	msg->request_id = req->request_id;
	switch (req->op) {
	case WIRE_OP_HELLO:
		msg->which_op = zipcache_v1_Request_hello_tag;
		msg->op.hello.protocol_version = req->hello.protocol_version;
		memcpy(msg->op.hello.client_name, req->hello.client_name,
		       sizeof(msg->op.hello.client_name));
		break;
	case WIRE_OP_OPEN_SESSION:
	case WIRE_OP_LOOKUP_PREFIX: {
		bool lookup = req->op == WIRE_OP_LOOKUP_PREFIX;
		const struct wire_open_request *o = lookup ? &req->lookup_prefix : &req->open_session;
		zipcache_v1_OpenSessionRequest *p = lookup ? &msg->op.lookup_prefix :
							     &msg->op.open_session;

		msg->which_op = lookup ? zipcache_v1_Request_lookup_prefix_tag :
					 zipcache_v1_Request_open_session_tag;
		p->prefix.size = (pb_size_t)(o->prefix_len <= sizeof(p->prefix.bytes) ? o->prefix_len :
										  sizeof(p->prefix.bytes));
		memcpy(p->prefix.bytes, o->prefix, p->prefix.size);
		memcpy(p->name, o->name, sizeof(p->name));
		p->has_shape = o->has_shape;
		shape_to_pb(&o->shape, &p->shape);
		p->max_tokens = o->max_tokens;
		p->has_codec = o->has_codec;
		codec_to_pb(&o->codec, &p->codec);
		p->policy = (zipcache_v1_BlockPolicy)o->policy;
		p->has_residual_tokens = o->has_residual_tokens;
		p->residual_tokens = o->residual_tokens;
		p->attach = o->attach;
		p->views = (zipcache_v1_Views)o->views;
		memcpy(p->model_id, o->model_id, sizeof(p->model_id));
		break;
	}
	case WIRE_OP_EXPORT_SESSION:
		msg->which_op = zipcache_v1_Request_export_session_tag;
		msg->op.export_session.session_id = req->export_session.session_id;
		break;
	case WIRE_OP_IMPORT_SESSION: {
		const struct wire_import_request *m = &req->import_session;
		zipcache_v1_ImportSessionRequest *p = &msg->op.import_session;

		msg->which_op = zipcache_v1_Request_import_session_tag;
		memcpy(p->name, m->name, sizeof(p->name));
		p->has_model_id = m->has_model_id;
		memcpy(p->model_id, m->model_id, sizeof(p->model_id));
		p->has_fingerprint = m->has_fingerprint;
		p->fingerprint = m->fingerprint;
		p->has_views = m->has_views;
		p->views = (zipcache_v1_Views)m->views;
		break;
	}
	case WIRE_OP_FORK_SESSION: {
		const struct wire_fork_request *f = &req->fork_session;
		zipcache_v1_ForkSessionRequest *p = &msg->op.fork_session;

		msg->which_op = zipcache_v1_Request_fork_session_tag;
		p->source_id = f->source_id;
		p->tokens = f->tokens;
		memcpy(p->name, f->name, sizeof(p->name));
		p->has_views = f->has_views;
		p->views = (zipcache_v1_Views)f->views;
		break;
	}
	case WIRE_OP_RELEASE:
		msg->which_op = zipcache_v1_Request_release_tag;
		msg->op.release.session_id = req->release.session_id;
		break;
	case WIRE_OP_UPDATE_AND_FETCH: {
		const struct wire_update_request *u = &req->update_and_fetch;
		zipcache_v1_UpdateAndFetchRequest *p = &msg->op.update_and_fetch;

		msg->which_op = zipcache_v1_Request_update_and_fetch_tag;
		p->session_id = u->session_id;
		p->layer = u->layer;
		p->tokens = u->tokens;
		p->staged = u->staged;
		p->keys_offset = u->keys_offset;
		p->values_offset = u->values_offset;
		p->has_omit_stats = u->omit_stats;
		p->omit_stats = u->omit_stats;
		p->chunk_key.size = (pb_size_t)(u->chunk_key_len <= sizeof(p->chunk_key.bytes) ?
						u->chunk_key_len : sizeof(p->chunk_key.bytes));
		memcpy(p->chunk_key.bytes, u->chunk_key, p->chunk_key.size);
		out->keys = u->keys;
		out->values = u->values;
		out->attention_mass = u->attention_mass;
		p->mass_first_token = u->mass_first_token;
		break;
	}
	case WIRE_OP_TRIM:
		msg->which_op = zipcache_v1_Request_trim_tag;
		msg->op.trim = (zipcache_v1_TrimRequest){ req->trim.session_id, req->trim.tokens,
							  req->trim.has_layer, req->trim.layer };
		break;
	case WIRE_OP_CLOSE_SESSION:
		msg->which_op = zipcache_v1_Request_close_session_tag;
		msg->op.close_session.session_id = req->close_session.session_id;
		break;
	case WIRE_OP_STATS:
		msg->which_op = zipcache_v1_Request_stats_tag;
		msg->op.stats.session_id = req->stats.session_id;
		msg->op.stats.use = req->stats.use;
		break;
	case WIRE_OP_LIST_SESSIONS:
		msg->which_op = zipcache_v1_Request_list_sessions_tag;
		break;
	case WIRE_OP_STAGING:
		msg->which_op = zipcache_v1_Request_staging_tag;
		msg->op.staging.bytes = req->staging.bytes;
		msg->op.staging.ring = req->staging.ring;
		break;
	case WIRE_OP_NONE:
		break;
	}
}

static void request_from_pb(const wire_pb_request *in, wire_request *out)
{
	const zipcache_v1_Request *msg = &in->msg;

	memset(out, 0, sizeof(*out));
	out->request_id = msg->request_id;
	switch (msg->which_op) {
	case zipcache_v1_Request_hello_tag:
		out->op = WIRE_OP_HELLO;
		out->hello.protocol_version = msg->op.hello.protocol_version;
		memcpy(out->hello.client_name, msg->op.hello.client_name, sizeof(out->hello.client_name));
		break;
	case zipcache_v1_Request_open_session_tag:
	case zipcache_v1_Request_lookup_prefix_tag: {
		bool lookup = msg->which_op == zipcache_v1_Request_lookup_prefix_tag;
		const zipcache_v1_OpenSessionRequest *p = lookup ? &msg->op.lookup_prefix :
								   &msg->op.open_session;
		struct wire_open_request *o = lookup ? &out->lookup_prefix : &out->open_session;

		out->op = lookup ? WIRE_OP_LOOKUP_PREFIX : WIRE_OP_OPEN_SESSION;
		o->prefix_len = p->prefix.size;
		memcpy(o->prefix, p->prefix.bytes, p->prefix.size);
		memcpy(o->name, p->name, sizeof(o->name));
		o->has_shape = p->has_shape;
		shape_from_pb(&p->shape, &o->shape);
		o->max_tokens = p->max_tokens;
		o->has_codec = p->has_codec;
		codec_from_pb(&p->codec, &o->codec);
		o->policy = (int)p->policy;
		o->has_residual_tokens = p->has_residual_tokens;
		o->residual_tokens = p->residual_tokens;
		o->attach = p->attach;
		o->views = (int)p->views;
		memcpy(o->model_id, p->model_id, sizeof(o->model_id));
		break;
	}
	case zipcache_v1_Request_export_session_tag:
		out->op = WIRE_OP_EXPORT_SESSION;
		out->export_session.session_id = msg->op.export_session.session_id;
		break;
	case zipcache_v1_Request_import_session_tag: {
		const zipcache_v1_ImportSessionRequest *p = &msg->op.import_session;
		struct wire_import_request *m = &out->import_session;

		out->op = WIRE_OP_IMPORT_SESSION;
		memcpy(m->name, p->name, sizeof(m->name));
		m->has_model_id = p->has_model_id;
		memcpy(m->model_id, p->model_id, sizeof(m->model_id));
		m->has_fingerprint = p->has_fingerprint;
		m->fingerprint = p->fingerprint;
		m->has_views = p->has_views;
		m->views = (int)p->views;
		break;
	}
	case zipcache_v1_Request_fork_session_tag: {
		const zipcache_v1_ForkSessionRequest *p = &msg->op.fork_session;
		struct wire_fork_request *f = &out->fork_session;

		out->op = WIRE_OP_FORK_SESSION;
		f->source_id = p->source_id;
		f->tokens = p->tokens;
		memcpy(f->name, p->name, sizeof(f->name));
		f->has_views = p->has_views;
		f->views = (int)p->views;
		break;
	}
	case zipcache_v1_Request_release_tag:
		out->op = WIRE_OP_RELEASE;
		out->release.session_id = msg->op.release.session_id;
		break;
	case zipcache_v1_Request_update_and_fetch_tag: {
		const zipcache_v1_UpdateAndFetchRequest *p = &msg->op.update_and_fetch;
		struct wire_update_request *u = &out->update_and_fetch;

		out->op = WIRE_OP_UPDATE_AND_FETCH;
		u->session_id = p->session_id;
		u->layer = p->layer;
		u->tokens = p->tokens;
		u->keys = in->keys;
		u->values = in->values;
		u->attention_mass = in->attention_mass;
		u->mass_first_token = p->mass_first_token;
		u->staged = p->staged;
		u->keys_offset = p->keys_offset;
		u->values_offset = p->values_offset;
		u->omit_stats = p->has_omit_stats && p->omit_stats;
		u->chunk_key_len = p->chunk_key.size;
		memcpy(u->chunk_key, p->chunk_key.bytes, p->chunk_key.size);
		break;
	}
	case zipcache_v1_Request_trim_tag:
		out->op = WIRE_OP_TRIM;
		out->trim = (struct wire_trim_request){ msg->op.trim.session_id, msg->op.trim.tokens,
							msg->op.trim.has_layer, msg->op.trim.layer };
		break;
	case zipcache_v1_Request_close_session_tag:
		out->op = WIRE_OP_CLOSE_SESSION;
		out->close_session.session_id = msg->op.close_session.session_id;
		break;
	case zipcache_v1_Request_stats_tag:
		out->op = WIRE_OP_STATS;
		out->stats.session_id = msg->op.stats.session_id;
		out->stats.use = msg->op.stats.use;
		break;
	case zipcache_v1_Request_list_sessions_tag:
		out->op = WIRE_OP_LIST_SESSIONS;
		break;
	case zipcache_v1_Request_staging_tag:
		out->op = WIRE_OP_STAGING;
		out->staging.bytes = msg->op.staging.bytes;
		out->staging.ring = msg->op.staging.ring;
		break;
	default:
		out->op = WIRE_OP_NONE;
		break;
	}
}

/* A varint at frame[*pos], minimally encoded (an overlong one is not the
 * canonical form and goes to nanopb), at most 64 bits. */
static bool varint_get(const uint8_t *frame, size_t len, size_t *pos, uint64_t *v)
{
	uint64_t x = 0;
	for (unsigned shift = 0; shift < 64 && *pos < len; shift += 7) {
		uint8_t b = frame[(*pos)++];
		if (shift == 63 && b > 1)
			return false;
		x |= (uint64_t)(b & 0x7f) << shift;
		if (!(b & 0x80)) {
			if (b == 0 && shift > 0)
				return false;
			*v = x;
			return true;
		}
	}
	return false;
}

/*
 * The update request decoded by hand, in the form the encoder above
 * writes: request_id (optional) then the update, last, its fields once
 * each, of their own wire types, values in range. Anything else (another
 * op, an unknown or repeated field, a bool other than 0 or 1, a number too
 * large for its field, a cut frame) is not decided here but left to
 * nanopb, so what a request means and how a bad one is refused do not
 * depend on this path (wire_test compares the two over mutated frames).
 * Returns whether it decoded the frame.
 */
static bool update_request_decode(const uint8_t *frame, size_t len, wire_request *out)
{
	size_t pos = 0;
	uint64_t tag, v, request_id = 0;
	bool have_id = false;

	for (;;) {
		if (!varint_get(frame, len, &pos, &tag))
			return false;
		if (tag == (zipcache_v1_Request_request_id_tag << 3 | PB_WIRE_VARINT) && !have_id) {
			if (!varint_get(frame, len, &pos, &request_id))
				return false;
			have_id = true;
			continue;
		}
		if (tag != (zipcache_v1_Request_update_and_fetch_tag << 3 | PB_WIRE_LEN) ||
		    !varint_get(frame, len, &pos, &v) || v != len - pos)
			return false;
		break;
	}
	memset(out, 0, sizeof(*out));
	out->request_id = request_id;
	out->op = WIRE_OP_UPDATE_AND_FETCH;
	struct wire_update_request *u = &out->update_and_fetch;
	uint32_t seen = 0;
	while (pos < len) {
		/* mass_first_token is the last of its fields. */
		if (!varint_get(frame, len, &pos, &tag) || (tag >> 3) == 0 ||
		    (tag >> 3) > zipcache_v1_UpdateAndFetchRequest_mass_first_token_tag)
			return false;
		uint32_t number = (uint32_t)(tag >> 3);
		bool bytes = number == zipcache_v1_UpdateAndFetchRequest_keys_tag ||
			     number == zipcache_v1_UpdateAndFetchRequest_values_tag ||
			     number == zipcache_v1_UpdateAndFetchRequest_chunk_key_tag ||
			     number == zipcache_v1_UpdateAndFetchRequest_attention_mass_tag;
		if ((seen & 1u << number) || (tag & 7) != (bytes ? PB_WIRE_LEN : PB_WIRE_VARINT) ||
		    !varint_get(frame, len, &pos, &v) || (bytes && v > len - pos))
			return false;
		seen |= 1u << number;
		wire_span span = { bytes ? frame + pos : NULL, bytes ? (size_t)v : 0 };
		if (bytes)
			pos += (size_t)v;
		switch (number) {
		case zipcache_v1_UpdateAndFetchRequest_session_id_tag:
			u->session_id = v;
			break;
		case zipcache_v1_UpdateAndFetchRequest_keys_offset_tag:
			u->keys_offset = v;
			break;
		case zipcache_v1_UpdateAndFetchRequest_values_offset_tag:
			u->values_offset = v;
			break;
		case zipcache_v1_UpdateAndFetchRequest_layer_tag:
		case zipcache_v1_UpdateAndFetchRequest_tokens_tag:
		case zipcache_v1_UpdateAndFetchRequest_mass_first_token_tag:
			if (v > UINT32_MAX)
				return false;
			*(number == zipcache_v1_UpdateAndFetchRequest_layer_tag ? &u->layer :
			  number == zipcache_v1_UpdateAndFetchRequest_tokens_tag ? &u->tokens :
										 &u->mass_first_token) =
				(uint32_t)v;
			break;
		case zipcache_v1_UpdateAndFetchRequest_staged_tag:
		case zipcache_v1_UpdateAndFetchRequest_omit_stats_tag:
			if (v > 1)
				return false;
			*(number == zipcache_v1_UpdateAndFetchRequest_staged_tag ? &u->staged :
									       &u->omit_stats) = v == 1;
			break;
		case zipcache_v1_UpdateAndFetchRequest_keys_tag:
			u->keys = span;
			break;
		case zipcache_v1_UpdateAndFetchRequest_values_tag:
			u->values = span;
			break;
		case zipcache_v1_UpdateAndFetchRequest_attention_mass_tag:
			u->attention_mass = span;
			break;
		case zipcache_v1_UpdateAndFetchRequest_chunk_key_tag:
			if (span.len > sizeof(u->chunk_key))
				return false;
			u->chunk_key_len = (uint32_t)span.len;
			memcpy(u->chunk_key, span.data, span.len);
			break;
		}
	}
	return true;
}

int wire_request_decode(const uint8_t *frame, size_t len, wire_request *out)
{
	if (update_request_decode(frame, len, out))
		return 0;

	wire_pb_request pb;
	int rc = wire_pb_request_decode(frame, len, &pb);

	request_from_pb(&pb, out);
	if (rc < 0) {
		out->op = WIRE_OP_NONE;
		if (pb.error == pb.reason) {
			memcpy(out->reason, pb.reason, sizeof(out->reason));
			out->error = out->reason;
		} else {
			out->error = pb.error;
		}
	}
	return rc;
}

/*
 * The update request, encoded by hand: it is sent once per layer per
 * decode step, and nanopb's table walk (a sizing pass for the submessage,
 * field descriptors unpacked one by one, the ~4 KiB generated struct
 * cleared and copied) costs ten times the copy of its 4 KiB of K/V.
 * The bytes are those nanopb writes for the same request, field by field
 * in number order, proto3 defaults left out (wire_test checks them
 * against nanopb's), with the field numbers from the generated header.
 * One walk over the fields: with `out` NULL it only counts.
 */
static size_t varint_bytes(uint64_t v)
{
	size_t n = 1;
	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

static uint8_t *varint_put(uint8_t *out, uint64_t v)
{
	while (v >= 0x80) {
		*out++ = (uint8_t)(v | 0x80);
		v >>= 7;
	}
	*out++ = (uint8_t)v;
	return out;
}

/* A field: its tag, then a varint or a length and the bytes. Returns the
 * bytes it takes; writes them at *out (advanced) unless out is NULL. */
static size_t field_varint(uint8_t **out, uint32_t number, uint64_t v)
{
	if (out) {
		*out = varint_put(*out, (uint64_t)number << 3 | PB_WIRE_VARINT);
		*out = varint_put(*out, v);
	}
	return varint_bytes((uint64_t)number << 3) + varint_bytes(v);
}

/* The tag and length that open a length-delimited field of `len` bytes
 * (bytes, or a submessage whose fields follow). */
static size_t field_len(uint8_t **out, uint32_t number, size_t len)
{
	if (out) {
		*out = varint_put(*out, (uint64_t)number << 3 | PB_WIRE_LEN);
		*out = varint_put(*out, len);
	}
	return varint_bytes((uint64_t)number << 3) + varint_bytes(len);
}

static size_t field_bytes(uint8_t **out, uint32_t number, const void *data, size_t len)
{
	size_t n = field_len(out, number, len);
	if (out) {
		memcpy(*out, data, len);
		*out += len;
	}
	return n + len;
}

static size_t update_fields(const struct wire_update_request *u, uint8_t **out)
{
	size_t n = 0;
	uint32_t chunk = u->chunk_key_len <= sizeof(u->chunk_key) ? u->chunk_key_len :
								     (uint32_t)sizeof(u->chunk_key);
	if (u->session_id)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_session_id_tag, u->session_id);
	if (u->layer)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_layer_tag, u->layer);
	if (u->tokens)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_tokens_tag, u->tokens);
	if (u->keys.len)
		n += field_bytes(out, zipcache_v1_UpdateAndFetchRequest_keys_tag, u->keys.data,
				 u->keys.len);
	if (u->values.len)
		n += field_bytes(out, zipcache_v1_UpdateAndFetchRequest_values_tag, u->values.data,
				 u->values.len);
	if (u->staged)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_staged_tag, 1);
	if (u->keys_offset)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_keys_offset_tag,
				  u->keys_offset);
	if (u->values_offset)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_values_offset_tag,
				  u->values_offset);
	/* Optional with presence: sent when set, and it is set only as true. */
	if (u->omit_stats)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_omit_stats_tag, 1);
	if (chunk)
		n += field_bytes(out, zipcache_v1_UpdateAndFetchRequest_chunk_key_tag, u->chunk_key,
				 chunk);
	if (u->attention_mass.len)
		n += field_bytes(out, zipcache_v1_UpdateAndFetchRequest_attention_mass_tag,
				 u->attention_mass.data, u->attention_mass.len);
	if (u->mass_first_token)
		n += field_varint(out, zipcache_v1_UpdateAndFetchRequest_mass_first_token_tag,
				  u->mass_first_token);
	return n;
}

/* The request's body: its id, then the update as a submessage of
 * `fields` bytes (update_fields' count); with `out` NULL it only counts. */
static size_t update_request_body(const wire_request *req, size_t fields, uint8_t **out)
{
	size_t n = 0;
	if (req->request_id)
		n += field_varint(out, zipcache_v1_Request_request_id_tag, req->request_id);
	n += field_len(out, zipcache_v1_Request_update_and_fetch_tag, fields);
	if (out)
		update_fields(&req->update_and_fetch, out);
	return n + fields;
}

/* The whole frame's bytes and its update's, or ZC_EFRAMESIZE past what
 * the frame header holds. */
static int update_frame_bytes(const wire_request *req, size_t *size, size_t *fields)
{
	*fields = update_fields(&req->update_and_fetch, NULL);
	size_t body = update_request_body(req, *fields, NULL);
	if (body > UINT32_MAX)
		return ZC_EFRAMESIZE;
	*size = FRAME_HEADER_BYTES + body;
	return 0;
}

static int update_request_encode(const wire_request *req, uint8_t *buf, size_t cap,
				 size_t *frame_len)
{
	size_t total, fields;
	int rc = update_frame_bytes(req, &total, &fields);
	if (rc < 0)
		return rc;
	if (total > cap)
		return ZC_EBUFFER;
	uint8_t *out = buf + FRAME_HEADER_BYTES;
	update_request_body(req, fields, &out);
	frame_header_write(buf, (uint32_t)(total - FRAME_HEADER_BYTES));
	*frame_len = total;
	return 0;
}

int wire_request_frame_size(const wire_request *req, size_t *size)
{
	wire_pb_request pb;

	if (req->op == WIRE_OP_UPDATE_AND_FETCH) {
		size_t fields;
		return update_frame_bytes(req, size, &fields);
	}

	request_to_pb(req, &pb);
	return wire_pb_request_frame_size(&pb, size);
}

int wire_request_encode(const wire_request *req, uint8_t *buf, size_t cap, size_t *frame_len)
{
	wire_pb_request pb;

	if (req->op == WIRE_OP_UPDATE_AND_FETCH)
		return update_request_encode(req, buf, cap, frame_len);

	request_to_pb(req, &pb);
	return wire_pb_request_encode(&pb, buf, cap, frame_len);
}

static void view_to_pb(const struct wire_view_layout *v, zipcache_v1_ViewLayout *out)
{
	out->mapping_bytes = v->mapping_bytes;
	out->header_bytes = v->header_bytes;
	out->key_offsets_count = (pb_size_t)(v->key_offsets_count > ZC_MAX_LAYERS ? ZC_MAX_LAYERS :
					     v->key_offsets_count);
	memcpy(out->key_offsets, v->key_offsets, out->key_offsets_count * sizeof(uint64_t));
	out->value_offsets_count = (pb_size_t)(v->value_offsets_count > ZC_MAX_LAYERS ? ZC_MAX_LAYERS :
					       v->value_offsets_count);
	memcpy(out->value_offsets, v->value_offsets, out->value_offsets_count * sizeof(uint64_t));
}

static void view_from_pb(const zipcache_v1_ViewLayout *v, struct wire_view_layout *out)
{
	out->mapping_bytes = v->mapping_bytes;
	out->header_bytes = v->header_bytes;
	out->key_offsets_count = v->key_offsets_count;
	memcpy(out->key_offsets, v->key_offsets, v->key_offsets_count * sizeof(uint64_t));
	out->value_offsets_count = v->value_offsets_count;
	memcpy(out->value_offsets, v->value_offsets, v->value_offsets_count * sizeof(uint64_t));
}

static void stats_to_pb(const struct wire_stats_response *s, zipcache_v1_StatsResponse *out)
{
	out->has_session = s->has_session;
	if (s->has_session)
		session_to_pb(&s->session, &out->session);
	out->has_total = s->has_total;
	layer_to_pb(&s->total, &out->total);
	out->sessions = s->sessions;
	out->connections = s->connections;
	out->memory_used_bytes = s->memory_used_bytes;
	out->memory_budget_bytes = s->memory_budget_bytes;
	out->requests = s->requests;
	out->request_errors = s->request_errors;
	out->tokens_appended = s->tokens_appended;
	out->uptime_ms = s->uptime_ms;
	out->boot_epoch = s->boot_epoch;
	out->has_caller = s->has_caller;
	out->caller = (zipcache_v1_UidUsage){
		s->caller.uid, s->caller.sessions, s->caller.max_sessions, s->caller.connections,
		s->caller.max_connections, s->caller.memory_used_bytes, s->caller.memory_budget_bytes,
		s->caller.staging_bytes, s->caller.max_staging_bytes,
	};
	out->daemon_wide = s->daemon_wide;
	out->staging_bytes = s->staging_bytes;
	out->reply_queue_bytes = s->reply_queue_bytes;
	out->memory_file_bytes = s->memory_file_bytes;
	out->set_aside_count = (pb_size_t)(s->set_aside_count > WIRE_MAX_SET_ASIDE ? WIRE_MAX_SET_ASIDE :
					   s->set_aside_count);
	for (pb_size_t i = 0; i < out->set_aside_count; i++) {
		memcpy(out->set_aside[i].file, s->set_aside[i].file, sizeof(out->set_aside[i].file));
		memcpy(out->set_aside[i].reason, s->set_aside[i].reason, sizeof(out->set_aside[i].reason));
	}
	out->set_aside_total = s->set_aside_total;
	out->has_memory = s->has_memory;
	out->memory = (zipcache_v1_MemoryByKind){ s->memory.views, s->memory.blocks, s->memory.residual,
						  s->memory.index, s->memory.headers,
						  s->memory.retained };
}

static void stats_from_pb(const zipcache_v1_StatsResponse *s, struct wire_stats_response *out)
{
	out->has_session = s->has_session;
	if (s->has_session)
		session_from_pb(&s->session, &out->session);
	out->has_total = s->has_total;
	layer_from_pb(&s->total, &out->total);
	out->sessions = s->sessions;
	out->connections = s->connections;
	out->memory_used_bytes = s->memory_used_bytes;
	out->memory_budget_bytes = s->memory_budget_bytes;
	out->requests = s->requests;
	out->request_errors = s->request_errors;
	out->tokens_appended = s->tokens_appended;
	out->uptime_ms = s->uptime_ms;
	out->boot_epoch = s->boot_epoch;
	out->has_caller = s->has_caller;
	out->caller = (struct wire_uid_usage){
		s->caller.uid, s->caller.sessions, s->caller.max_sessions, s->caller.connections,
		s->caller.max_connections, s->caller.memory_used_bytes, s->caller.memory_budget_bytes,
		s->caller.staging_bytes, s->caller.max_staging_bytes,
	};
	out->daemon_wide = s->daemon_wide;
	out->staging_bytes = s->staging_bytes;
	out->reply_queue_bytes = s->reply_queue_bytes;
	out->memory_file_bytes = s->memory_file_bytes;
	out->set_aside_count = s->set_aside_count;
	for (pb_size_t i = 0; i < s->set_aside_count; i++) {
		memcpy(out->set_aside[i].file, s->set_aside[i].file, sizeof(out->set_aside[i].file));
		memcpy(out->set_aside[i].reason, s->set_aside[i].reason, sizeof(out->set_aside[i].reason));
	}
	out->set_aside_total = s->set_aside_total;
	out->has_memory = s->has_memory;
	out->memory = (struct wire_memory_by_kind){ s->memory.views, s->memory.blocks, s->memory.residual,
						    s->memory.index, s->memory.headers,
						    s->memory.retained };
}

/*
 * The generated response for a plain one: the header and the op's member
 * only (the struct is ~17 KiB, and the other members are never read), the
 * list callbacks planted over the caller's plain arrays. Returns NULL for
 * a list too long for any decoder to accept.
 */
static const zipcache_v1_Response *plain_response_prepare(const wire_response *resp,
							  zipcache_v1_Response *msg,
							  struct encode_list *list)
{
	pb_callback_t *cb = NULL;

	msg->request_id = resp->request_id;
	msg->status = (zipcache_v1_Status)resp->status;
	memcpy(msg->message, resp->message, sizeof(msg->message));
	msg->fds = resp->fds;
	switch (resp->op) {
	case WIRE_OP_HELLO: {
		const zc_server_info *h = &resp->hello;

		msg->which_op = zipcache_v1_Response_hello_tag;
		msg->op.hello = (zipcache_v1_HelloResponse){
			.protocol_version = h->protocol_version,
			.boot_epoch = h->boot_epoch,
			.max_frame_bytes = h->max_frame_bytes,
			.max_inline_bytes = h->max_inline_bytes,
			.max_sessions = h->max_sessions,
			.max_tokens_per_session = h->max_tokens_per_session,
			.memory_budget_bytes = h->memory_budget_bytes,
			.lease_ms = h->lease_ms,
			.max_ring_bytes = h->max_ring_bytes,
		};
		memcpy(msg->op.hello.server_version, h->server_version,
		       sizeof(msg->op.hello.server_version));
		break;
	}
	case WIRE_OP_OPEN_SESSION:
	case WIRE_OP_FORK_SESSION:
	case WIRE_OP_IMPORT_SESSION: {
		const struct wire_open_response *o = &resp->open_session;
		zipcache_v1_OpenSessionResponse *p =
			resp->op == WIRE_OP_FORK_SESSION ? &msg->op.fork_session :
			resp->op == WIRE_OP_IMPORT_SESSION ? &msg->op.import_session :
							     &msg->op.open_session;

		msg->which_op = resp->op == WIRE_OP_FORK_SESSION ? zipcache_v1_Response_fork_session_tag :
				resp->op == WIRE_OP_IMPORT_SESSION ?
						    zipcache_v1_Response_import_session_tag :
						    zipcache_v1_Response_open_session_tag;
		memset(p, 0, sizeof(*p));
		p->has_session = o->has_session;
		if (o->has_session)
			session_to_pb(&o->session, &p->session);
		p->has_view = o->has_view;
		if (o->has_view)
			view_to_pb(&o->view, &p->view);
		p->attached = o->attached;
		break;
	}
	case WIRE_OP_UPDATE_AND_FETCH: {
		const struct wire_update_response *u = &resp->update_and_fetch;

		msg->which_op = zipcache_v1_Response_update_and_fetch_tag;
		msg->op.update_and_fetch.tokens = u->tokens;
		msg->op.update_and_fetch.has_stats = u->has_stats;
		layer_to_pb(&u->stats, &msg->op.update_and_fetch.stats);
		msg->op.update_and_fetch.sequence = u->sequence;
		break;
	}
	case WIRE_OP_TRIM:
		msg->which_op = zipcache_v1_Response_trim_tag;
		msg->op.trim = (zipcache_v1_TrimResponse){ resp->trim.trimmed, resp->trim.tokens };
		break;
	case WIRE_OP_CLOSE_SESSION:
		msg->which_op = zipcache_v1_Response_close_session_tag;
		memset(&msg->op.close_session, 0, sizeof(msg->op.close_session));
		break;
	case WIRE_OP_STATS:
		msg->which_op = zipcache_v1_Response_stats_tag;
		memset(&msg->op.stats, 0, sizeof(msg->op.stats));
		stats_to_pb(&resp->stats, &msg->op.stats);
		*list = (struct encode_list){ resp->layers, resp->n_layers, sizeof(zc_layer_stats),
					      &zipcache_v1_LayerStats_msg, convert_layer };
		cb = &msg->op.stats.layers;
		break;
	case WIRE_OP_LIST_SESSIONS:
		msg->which_op = zipcache_v1_Response_list_sessions_tag;
		memset(&msg->op.list_sessions, 0, sizeof(msg->op.list_sessions));
		*list = (struct encode_list){ resp->sessions, resp->n_sessions, sizeof(zc_session_info),
					      &zipcache_v1_SessionInfo_msg, convert_session };
		cb = &msg->op.list_sessions.sessions;
		break;
	case WIRE_OP_STAGING:
		msg->which_op = zipcache_v1_Response_staging_tag;
		msg->op.staging.bytes = resp->staging.bytes;
		msg->op.staging.ring = resp->staging.ring;
		break;
	case WIRE_OP_RELEASE:
		msg->which_op = zipcache_v1_Response_release_tag;
		memset(&msg->op.release, 0, sizeof(msg->op.release));
		break;
	case WIRE_OP_LOOKUP_PREFIX:
		msg->which_op = zipcache_v1_Response_lookup_prefix_tag;
		msg->op.lookup_prefix = (zipcache_v1_LookupPrefixResponse){
			resp->lookup_prefix.chunks, resp->lookup_prefix.tokens,
			resp->lookup_prefix.local_chunks
		};
		break;
	case WIRE_OP_EXPORT_SESSION:
		msg->which_op = zipcache_v1_Response_export_session_tag;
		msg->op.export_session = (zipcache_v1_ExportSessionResponse){
			resp->export_session.bytes, resp->export_session.fingerprint,
			resp->export_session.tokens
		};
		break;
	case WIRE_OP_NONE:
		msg->which_op = 0;
		break;
	}
	if (!cb)
		return msg;
	if (list->n > WIRE_MAX_LIST_ITEMS || (list->n > 0 && list->items == NULL))
		return NULL;
	cb->funcs.encode = encode_list;
	cb->arg = list;
	return msg;
}

/*
 * The update reply without stats (what a decode step gets back), encoded
 * by hand as the request is, to nanopb's bytes: request_id, status, fds,
 * then the op (sent even when empty, being a oneof member) with tokens
 * and sequence. Any other reply goes through nanopb.
 */
static bool update_response_plain(const wire_response *resp)
{
	return resp->op == WIRE_OP_UPDATE_AND_FETCH && !resp->update_and_fetch.has_stats &&
	       resp->message[0] == '\0' && resp->status >= 0;
}

static size_t update_reply_fields(const struct wire_update_response *u, uint8_t **out)
{
	size_t n = 0;
	if (u->tokens)
		n += field_varint(out, zipcache_v1_UpdateAndFetchResponse_tokens_tag, u->tokens);
	if (u->sequence)
		n += field_varint(out, zipcache_v1_UpdateAndFetchResponse_sequence_tag, u->sequence);
	return n;
}

/* The reply's body, its op a submessage of `op` bytes
 * (update_reply_fields' count); with `out` NULL it only counts. */
static size_t update_response_body(const wire_response *resp, size_t op, uint8_t **out)
{
	size_t n = 0;
	if (resp->request_id)
		n += field_varint(out, zipcache_v1_Response_request_id_tag, resp->request_id);
	if (resp->status)
		n += field_varint(out, zipcache_v1_Response_status_tag, (uint64_t)resp->status);
	if (resp->fds)
		n += field_varint(out, zipcache_v1_Response_fds_tag, resp->fds);
	n += field_len(out, zipcache_v1_Response_update_and_fetch_tag, op);
	if (out)
		update_reply_fields(&resp->update_and_fetch, out);
	return n + op;
}

int wire_response_frame_size(const wire_response *resp, size_t *size)
{
	if (update_response_plain(resp)) {
		size_t op = update_reply_fields(&resp->update_and_fetch, NULL);
		*size = FRAME_HEADER_BYTES + update_response_body(resp, op, NULL);
		return 0;
	}

	zipcache_v1_Response msg;
	struct encode_list list;
	const zipcache_v1_Response *prepared = plain_response_prepare(resp, &msg, &list);

	if (prepared == NULL)
		return ZC_EINVALID;
	return frame_size(&zipcache_v1_Response_msg, prepared, size);
}

int wire_response_encode(const wire_response *resp, uint8_t *buf, size_t cap, size_t *frame_len)
{
	if (update_response_plain(resp)) {
		size_t op = update_reply_fields(&resp->update_and_fetch, NULL);
		size_t body = update_response_body(resp, op, NULL);
		if (FRAME_HEADER_BYTES + body > cap)
			return ZC_EBUFFER;
		uint8_t *out = buf + FRAME_HEADER_BYTES;
		update_response_body(resp, op, &out);
		frame_header_write(buf, (uint32_t)body);
		*frame_len = FRAME_HEADER_BYTES + body;
		return 0;
	}

	zipcache_v1_Response msg;
	struct encode_list list;
	const zipcache_v1_Response *prepared = plain_response_prepare(resp, &msg, &list);

	if (prepared == NULL)
		return ZC_EINVALID;
	return encode_frame(&zipcache_v1_Response_msg, prepared, buf, cap, frame_len);
}

/* The lists of a decoded response, converted; the generated ones freed. */
static int lists_from_pb(wire_pb_response *pb, wire_response *out)
{
	if (pb->n_layers > 0) {
		out->layers = calloc(pb->n_layers, sizeof(*out->layers));
		if (!out->layers)
			return -ENOMEM;
		for (size_t i = 0; i < pb->n_layers; i++)
			layer_from_pb(&pb->layers[i], &out->layers[i]);
		out->n_layers = pb->n_layers;
	}
	if (pb->n_sessions > 0) {
		out->sessions = calloc(pb->n_sessions, sizeof(*out->sessions));
		if (!out->sessions)
			return -ENOMEM;
		for (size_t i = 0; i < pb->n_sessions; i++)
			session_from_pb(&pb->sessions[i], &out->sessions[i]);
		out->n_sessions = pb->n_sessions;
	}
	return 0;
}

/*
 * The update reply without stats decoded by hand when it has the form
 * above (fields once each, in order, values in range, the op last);
 * anything else is left to nanopb, as for the request. Returns whether it
 * decoded the frame.
 */
static bool update_response_decode(const uint8_t *frame, size_t len, wire_response *out)
{
	static const uint32_t order[] = { zipcache_v1_Response_request_id_tag,
					  zipcache_v1_Response_status_tag,
					  zipcache_v1_Response_fds_tag };
	uint64_t head[3] = { 0, 0, 0 }, tag, v;
	size_t pos = 0, next = 0;

	for (;;) {
		if (!varint_get(frame, len, &pos, &tag))
			return false;
		while (next < 3 && tag != (order[next] << 3 | PB_WIRE_VARINT))
			next++;
		if (next == 3)
			break;
		if (!varint_get(frame, len, &pos, &head[next]))
			return false;
		next++;
	}
	if (tag != (zipcache_v1_Response_update_and_fetch_tag << 3 | PB_WIRE_LEN) ||
	    !varint_get(frame, len, &pos, &v) || v != len - pos || head[1] > INT32_MAX ||
	    head[2] > UINT32_MAX)
		return false;
	uint64_t tokens = 0, sequence = 0;
	bool have_tokens = false, have_sequence = false;
	while (pos < len) {
		if (!varint_get(frame, len, &pos, &tag))
			return false;
		if (tag == (zipcache_v1_UpdateAndFetchResponse_tokens_tag << 3 | PB_WIRE_VARINT) &&
		    !have_tokens && !have_sequence) {
			if (!varint_get(frame, len, &pos, &tokens) || tokens > UINT32_MAX)
				return false;
			have_tokens = true;
		} else if (tag == (zipcache_v1_UpdateAndFetchResponse_sequence_tag << 3 |
				   PB_WIRE_VARINT) && !have_sequence) {
			if (!varint_get(frame, len, &pos, &sequence))
				return false;
			have_sequence = true;
		} else {
			return false;
		}
	}
	memset(out, 0, sizeof(*out));
	out->request_id = head[0];
	out->status = (int)head[1];
	out->fds = (uint32_t)head[2];
	out->op = WIRE_OP_UPDATE_AND_FETCH;
	out->update_and_fetch.tokens = (uint32_t)tokens;
	out->update_and_fetch.sequence = sequence;
	return true;
}

int wire_response_decode(const uint8_t *frame, size_t len, wire_response *out)
{
	wire_pb_response decoded, *pb = &decoded;
	const zipcache_v1_Response *msg;
	int rc;

	if (update_response_decode(frame, len, out))
		return 0;
	memset(out, 0, sizeof(*out));
	rc = wire_pb_response_decode(frame, len, pb);
	if (rc < 0) {
		out->error = pb->error;
		return rc;
	}
	msg = &pb->msg;
	out->request_id = msg->request_id;
	out->status = (int)msg->status;
	memcpy(out->message, msg->message, sizeof(out->message));
	out->fds = msg->fds;
	switch (msg->which_op) {
	case zipcache_v1_Response_hello_tag: {
		const zipcache_v1_HelloResponse *h = &msg->op.hello;

		out->op = WIRE_OP_HELLO;
		out->hello = (zc_server_info){
			.protocol_version = h->protocol_version,
			.boot_epoch = h->boot_epoch,
			.max_frame_bytes = h->max_frame_bytes,
			.max_inline_bytes = h->max_inline_bytes,
			.max_sessions = h->max_sessions,
			.max_tokens_per_session = h->max_tokens_per_session,
			.memory_budget_bytes = h->memory_budget_bytes,
			.lease_ms = h->lease_ms,
			.max_ring_bytes = h->max_ring_bytes,
		};
		memcpy(out->hello.server_version, h->server_version, sizeof(out->hello.server_version));
		break;
	}
	case zipcache_v1_Response_open_session_tag:
	case zipcache_v1_Response_fork_session_tag:
	case zipcache_v1_Response_import_session_tag: {
		bool fork = msg->which_op == zipcache_v1_Response_fork_session_tag;
		bool import = msg->which_op == zipcache_v1_Response_import_session_tag;
		const zipcache_v1_OpenSessionResponse *p = fork ? &msg->op.fork_session :
							   import ? &msg->op.import_session :
								    &msg->op.open_session;

		out->op = fork ? WIRE_OP_FORK_SESSION : import ? WIRE_OP_IMPORT_SESSION :
								WIRE_OP_OPEN_SESSION;
		out->open_session.has_session = p->has_session;
		session_from_pb(&p->session, &out->open_session.session);
		out->open_session.has_view = p->has_view;
		view_from_pb(&p->view, &out->open_session.view);
		out->open_session.attached = p->attached;
		break;
	}
	case zipcache_v1_Response_update_and_fetch_tag:
		out->op = WIRE_OP_UPDATE_AND_FETCH;
		out->update_and_fetch.tokens = msg->op.update_and_fetch.tokens;
		out->update_and_fetch.has_stats = msg->op.update_and_fetch.has_stats;
		layer_from_pb(&msg->op.update_and_fetch.stats, &out->update_and_fetch.stats);
		out->update_and_fetch.sequence = msg->op.update_and_fetch.sequence;
		break;
	case zipcache_v1_Response_trim_tag:
		out->op = WIRE_OP_TRIM;
		out->trim.trimmed = msg->op.trim.trimmed;
		out->trim.tokens = msg->op.trim.tokens;
		break;
	case zipcache_v1_Response_close_session_tag:
		out->op = WIRE_OP_CLOSE_SESSION;
		break;
	case zipcache_v1_Response_stats_tag:
		out->op = WIRE_OP_STATS;
		stats_from_pb(&msg->op.stats, &out->stats);
		break;
	case zipcache_v1_Response_list_sessions_tag:
		out->op = WIRE_OP_LIST_SESSIONS;
		break;
	case zipcache_v1_Response_staging_tag:
		out->op = WIRE_OP_STAGING;
		out->staging.bytes = msg->op.staging.bytes;
		out->staging.ring = msg->op.staging.ring;
		break;
	case zipcache_v1_Response_release_tag:
		out->op = WIRE_OP_RELEASE;
		break;
	case zipcache_v1_Response_lookup_prefix_tag:
		out->op = WIRE_OP_LOOKUP_PREFIX;
		out->lookup_prefix.chunks = msg->op.lookup_prefix.chunks;
		out->lookup_prefix.tokens = msg->op.lookup_prefix.tokens;
		out->lookup_prefix.local_chunks = msg->op.lookup_prefix.local_chunks;
		break;
	case zipcache_v1_Response_export_session_tag:
		out->op = WIRE_OP_EXPORT_SESSION;
		out->export_session.bytes = msg->op.export_session.bytes;
		out->export_session.fingerprint = msg->op.export_session.fingerprint;
		out->export_session.tokens = msg->op.export_session.tokens;
		break;
	default:
		out->op = WIRE_OP_NONE;
		break;
	}
	rc = lists_from_pb(pb, out);
	wire_pb_response_free(pb);
	if (rc < 0) {
		free(out->layers);
		free(out->sessions);
		memset(out, 0, sizeof(*out));
		out->error = "out of memory";
		return rc;
	}
	out->lists_owned = 1;
	return 0;
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

void wire_response_init(wire_response *resp, uint64_t request_id, enum wire_op op)
{
	memset(resp, 0, sizeof(*resp));
	resp->request_id = request_id;
	resp->op = op;
}

void wire_response_set_status(wire_response *resp, int zc_error, const char *message)
{
	resp->status = (int)wire_status_from_error(zc_error);
	message_copy(resp->message, sizeof(resp->message), message);
}
