/*
 * Protobuf bytes built by hand, a field at a time, for the requests no
 * encoder of ours would produce: a name longer than its array, a NUL in a
 * string, an enum value past 32 bits, fields out of their usual order.
 *
 *	struct pb_bytes open = { 0 }, request = { 0 };
 *	pb_field_bytes(&open, zipcache_v1_OpenSessionRequest_name_tag, "a\0x", 3);
 *	pb_field_varint(&request, zipcache_v1_Request_request_id_tag, 7);
 *	pb_field_message(&request, zipcache_v1_Request_open_session_tag, &open);
 *
 * The builders assert (Check) that the bytes fit.
 */
#ifndef ZIPCACHE_TESTS_PB_BYTES_H
#define ZIPCACHE_TESTS_PB_BYTES_H

#include <stddef.h>
#include <stdint.h>

struct pb_bytes {
	uint8_t data[512];
	size_t len;
};

/* A bare varint (a tag byte of one's own making, say). */
void pb_varint(struct pb_bytes *b, uint64_t v);

/* A field of wire type 0. */
void pb_field_varint(struct pb_bytes *b, uint32_t field, uint64_t v);

/* A field of wire type 2: bytes, a string, or a message's encoding. */
void pb_field_bytes(struct pb_bytes *b, uint32_t field, const void *data, size_t len);
void pb_field_message(struct pb_bytes *b, uint32_t field, const struct pb_bytes *sub);

#endif
