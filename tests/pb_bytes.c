/* Hand-made protobuf bytes (tests/pb_bytes.h). */
#include "pb_bytes.h"

#include <check.h>
#include <string.h>

void pb_varint(struct pb_bytes *b, uint64_t v)
{
	do {
		ck_assert_uint_lt(b->len, sizeof(b->data));
		b->data[b->len++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
		v >>= 7;
	} while (v);
}

void pb_field_varint(struct pb_bytes *b, uint32_t field, uint64_t v)
{
	pb_varint(b, (uint64_t)field << 3);
	pb_varint(b, v);
}

void pb_field_bytes(struct pb_bytes *b, uint32_t field, const void *data, size_t len)
{
	pb_varint(b, (uint64_t)field << 3 | 2);
	pb_varint(b, len);
	ck_assert_uint_le(b->len + len, sizeof(b->data));
	if (len)
		memcpy(b->data + b->len, data, len);
	b->len += len;
}

void pb_field_message(struct pb_bytes *b, uint32_t field, const struct pb_bytes *sub)
{
	pb_field_bytes(b, field, sub->data, sub->len);
}
