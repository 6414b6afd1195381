/*
 * Framing: every message on the socket is a 4-byte little-endian length
 * followed by exactly that many bytes.
 *
 * The frame reader does no I/O, as hiredis's read.c: the daemon and the
 * client both hand it bytes and pull whole frames out, so it is tested
 * without sockets. Two ways in:
 *
 *   - frame_reader_buffer() + frame_reader_commit(): the reader lends the
 *     free tail of its own buffer, the caller read()s (or libuv's alloc_cb
 *     fills) straight into it and says how many bytes arrived. No copy.
 *   - frame_reader_feed(): copies bytes the caller already holds.
 *
 * Then frame_reader_next() until it returns 0, calling
 * frame_reader_consume() after each frame is handled:
 *
 *	while ((rc = frame_reader_next(&r, &frame, &len)) == 1) {
 *		handle(frame, len);
 *		frame_reader_consume(&r);
 *	}
 *	if (rc < 0)
 *		close the connection (ZC_EFRAMESIZE);
 *
 * Memory: the buffer starts empty and grows only to what the frame in
 * hand needs plus a little read-ahead, never past max_frame_bytes + 4
 * through the buffer API; a header announcing more than max_frame_bytes is
 * refused as soon as its 4 bytes are in, before anything is allocated for
 * it. Consumed bytes are reclaimed by moving the unconsumed tail to the
 * front (compaction) when the free tail runs short.
 *
 * Lifetime of a frame: the pointer frame_reader_next() returns (and every
 * span decoded from it, see wire.h) stays valid until frame_reader_consume(),
 * frame_reader_buffer(), frame_reader_feed() or frame_reader_free(), any of
 * which may move or free the bytes. A caller that hands a frame to other
 * work must therefore stop reading until it consumes the frame.
 *
 * Errors are sticky: once a frame is too large every later call returns
 * ZC_EFRAMESIZE, because the stream can no longer be resynchronised.
 */
#ifndef ZIPCACHE_FRAME_H
#define ZIPCACHE_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define FRAME_HEADER_BYTES 4

/*
 * Private to proto/, daemon and client: embed it in a connection and treat
 * the fields as read-only (tests look at cap to check growth).
 */
typedef struct frame_reader {
	uint8_t *buf;
	size_t cap;        /* bytes allocated at buf */
	size_t start;      /* first unconsumed byte */
	size_t end;        /* one past the last byte received */
	size_t pending;    /* header + body of the frame next() returned, 0 if none */
	uint32_t max_frame; /* largest body accepted, in bytes */
	int error;         /* sticky ZC_EFRAMESIZE, or 0 */
} frame_reader;

/* Starts an empty reader; allocates nothing until bytes arrive. */
void frame_reader_init(frame_reader *r, uint32_t max_frame_bytes);

/* Frees the buffer; r may be initialised again afterwards. */
void frame_reader_free(frame_reader *r);

/*
 * Lends the free tail of the buffer for the caller to read into: *buf and
 * *len (len > 0) on success. Room is at least what completes the frame
 * being received (its header has said how long it is), otherwise a
 * read-ahead chunk, both capped at max_frame_bytes + 4 in total. Follow it
 * with frame_reader_commit(). Returns 0, -ENOMEM, ZC_EFRAMESIZE when the
 * buffered header is already too large, or -ENOBUFS when a whole frame that
 * fills the buffer is still unconsumed (drain with frame_reader_next first).
 */
int frame_reader_buffer(frame_reader *r, uint8_t **buf, size_t *len);

/* Records that n bytes were written at the start of the lent buffer. */
void frame_reader_commit(frame_reader *r, size_t n);

/*
 * Appends a copy of len bytes. Unlike frame_reader_buffer() this always
 * takes everything it is given (the caller already holds these bytes), so
 * the buffer may exceed max_frame_bytes + 4 when several frames are fed at
 * once. Returns 0, -ENOMEM, or a sticky ZC_EFRAMESIZE.
 */
int frame_reader_feed(frame_reader *r, const void *data, size_t len);

/*
 * Returns 1 with *frame and *len set to the next frame's body (len may be
 * 0), 0 when more bytes are needed, or ZC_EFRAMESIZE when the next frame's
 * header declares more than max_frame_bytes: close the connection. Calling
 * it again without consuming returns the same frame.
 */
int frame_reader_next(frame_reader *r, const uint8_t **frame, size_t *len);

/* Drops the frame frame_reader_next() returned; no-op if there is none. */
void frame_reader_consume(frame_reader *r);

/* Bytes received and not yet consumed. */
size_t frame_reader_buffered(const frame_reader *r);

/* Writes the 4-byte little-endian header for a body of len bytes. */
void frame_header_write(uint8_t out[FRAME_HEADER_BYTES], uint32_t len);

/* Reads a 4-byte little-endian header. */
uint32_t frame_header_read(const uint8_t in[FRAME_HEADER_BYTES]);

#endif
