/*
 * .npy reader and writer for '<f2' C-order arrays; see npy.h for the
 * format and the promises.
 */
#include "npy.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static const unsigned char npy_magic[6] = { 0x93, 'N', 'U', 'M', 'P', 'Y' };
#define NPY_MAGIC_BYTES 6
/* magic + major + minor */
#define NPY_PREFIX_BYTES 8
/* Writers pad the header so the data starts at a multiple of this, which
 * numpy uses since 1.14 (and which is also a multiple of the older 16). */
#define NPY_ALIGNMENT 64
/* Biggest single read() or write(); Linux moves at most ~2 GiB per call. */
#define NPY_IO_CHUNK ((size_t)1 << 30)

__attribute__((format(printf, 3, 4)))
static void npy_set_detail(char *detail, size_t detail_size, const char *format, ...)
{
	va_list arguments;

	if (!detail || detail_size == 0)
		return;
	va_start(arguments, format);
	vsnprintf(detail, detail_size, format, arguments);
	va_end(arguments);
}

const char *zc_npy_strerror(int code)
{
	switch (code) {
	case 0:
		return "success";
	case ZC_NPY_EMAGIC:
		return "not a .npy file (bad magic)";
	case ZC_NPY_EVERSION:
		return "unsupported .npy format version";
	case ZC_NPY_EHEADER:
		return "malformed .npy header";
	case ZC_NPY_EDTYPE:
		return "dtype is not '<f2' (little-endian float16)";
	case ZC_NPY_EFORTRAN:
		return "array is in Fortran order; only C order is supported";
	case ZC_NPY_ERANK:
		return "array rank is not 2 or 4";
	case ZC_NPY_ESHAPE:
		return "array shape is too large";
	case ZC_NPY_ETRUNCATED:
		return "file is truncated";
	case ZC_NPY_ETRAILING:
		return "file has trailing data after the array";
	case ZC_NPY_ENOTREGULAR:
		return "not a regular file";
	default:
		break;
	}
	/* Codes above the library's own range are -errno. */
	if (code < 0 && code > -4000)
		return strerror(-code);
	return "unknown error";
}

/* ---- header dict parser ------------------------------------------------ */

/* A position in the header text; the parser never looks past length. */
typedef struct npy_cursor {
	const char *text;
	size_t length;
	size_t position;
	char *detail;
	size_t detail_size;
} npy_cursor;

static int cursor_peek(const npy_cursor *cursor)
{
	if (cursor->position >= cursor->length)
		return -1;
	return (unsigned char)cursor->text[cursor->position];
}

/* Python allows any of these between tokens inside braces and brackets. */
static void cursor_skip_space(npy_cursor *cursor)
{
	for (;;) {
		int c = cursor_peek(cursor);

		if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
			return;
		cursor->position++;
	}
}

static int cursor_expect(npy_cursor *cursor, char expected, const char *where)
{
	if (cursor_peek(cursor) != (unsigned char)expected) {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: expected '%c' %s at byte %zu",
			       expected, where, cursor->position);
		return ZC_NPY_EHEADER;
	}
	cursor->position++;
	return 0;
}

/*
 * A quoted string of printable ASCII without backslashes: every key and
 * simple dtype string numpy writes is one, and refusing escapes means the
 * text is exactly what is stored.
 */
static int cursor_parse_string(npy_cursor *cursor, char *out, size_t out_size)
{
	size_t start = cursor->position;
	int quote = cursor_peek(cursor);
	size_t used = 0;

	if (quote != '\'' && quote != '"') {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: expected a quoted string at byte %zu", start);
		return ZC_NPY_EHEADER;
	}
	cursor->position++;
	for (;;) {
		int c = cursor_peek(cursor);

		if (c == quote)
			break;
		if (c < 0) {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "malformed header: string at byte %zu is not closed", start);
			return ZC_NPY_EHEADER;
		}
		if (c < 0x20 || c > 0x7e || c == '\\') {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "malformed header: unsupported character 0x%02x in string at byte %zu",
				       (unsigned)c, cursor->position);
			return ZC_NPY_EHEADER;
		}
		if (used + 1 >= out_size) {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "malformed header: string at byte %zu is longer than %zu characters",
				       start, out_size - 1);
			return ZC_NPY_EHEADER;
		}
		out[used++] = (char)c;
		cursor->position++;
	}
	cursor->position++;
	out[used] = '\0';
	return 0;
}

static int cursor_parse_bool(npy_cursor *cursor, bool *value)
{
	const char *rest = cursor->text + cursor->position;
	size_t left = cursor->length - cursor->position;

	if (left >= 4 && memcmp(rest, "True", 4) == 0) {
		cursor->position += 4;
		*value = true;
	} else if (left >= 5 && memcmp(rest, "False", 5) == 0) {
		cursor->position += 5;
		*value = false;
	} else {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: fortran_order is not True or False at byte %zu",
			       cursor->position);
		return ZC_NPY_EHEADER;
	}
	/* "Truex" would otherwise pass as True followed by junk. */
	int next = cursor_peek(cursor);
	if ((next >= 'a' && next <= 'z') || (next >= 'A' && next <= 'Z') ||
	    (next >= '0' && next <= '9') || next == '_') {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: fortran_order is not True or False at byte %zu",
			       cursor->position);
		return ZC_NPY_EHEADER;
	}
	return 0;
}

/* A non-negative decimal Python int: no sign, no leading zeros, no '_'. */
static int cursor_parse_dimension(npy_cursor *cursor, uint64_t *value)
{
	size_t start = cursor->position;
	uint64_t result = 0;
	int c = cursor_peek(cursor);

	if (c < '0' || c > '9') {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: shape entry at byte %zu is not a non-negative integer",
			       start);
		return ZC_NPY_EHEADER;
	}
	while ((c = cursor_peek(cursor)) >= '0' && c <= '9') {
		unsigned digit = (unsigned)(c - '0');

		if (result > (UINT64_MAX - digit) / 10) {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "shape entry at byte %zu does not fit in 64 bits", start);
			return ZC_NPY_ESHAPE;
		}
		result = result * 10 + digit;
		cursor->position++;
	}
	if (cursor->position - start > 1 && cursor->text[start] == '0') {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: shape entry at byte %zu has a leading zero", start);
		return ZC_NPY_EHEADER;
	}
	*value = result;
	return 0;
}

/*
 * A tuple of dimensions. As in Python, "(4)" is not a tuple but "(4,)" is,
 * and "()" is the empty tuple of a scalar.
 */
static int cursor_parse_shape(npy_cursor *cursor, zc_npy_header *header)
{
	size_t start = cursor->position;
	bool trailing_comma = false;
	int result;

	result = cursor_expect(cursor, '(', "to open the shape tuple");
	if (result < 0)
		return result;
	header->rank = 0;
	cursor_skip_space(cursor);
	while (cursor_peek(cursor) != ')') {
		uint64_t dimension;

		if (header->rank == ZC_NPY_MAX_RANK) {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "rank: shape at byte %zu has more than %d dimensions",
				       start, ZC_NPY_MAX_RANK);
			return ZC_NPY_ERANK;
		}
		result = cursor_parse_dimension(cursor, &dimension);
		if (result < 0)
			return result;
		header->shape[header->rank++] = dimension;
		trailing_comma = false;
		cursor_skip_space(cursor);
		if (cursor_peek(cursor) == ',') {
			cursor->position++;
			trailing_comma = true;
			cursor_skip_space(cursor);
		} else if (cursor_peek(cursor) != ')') {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "malformed header: expected ',' or ')' in shape at byte %zu",
				       cursor->position);
			return ZC_NPY_EHEADER;
		}
	}
	cursor->position++;
	if (header->rank == 1 && !trailing_comma) {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: shape at byte %zu is a parenthesised integer, not a tuple",
			       start);
		return ZC_NPY_EHEADER;
	}
	return 0;
}

enum npy_key {
	NPY_KEY_DESCR = 1 << 0,
	NPY_KEY_FORTRAN_ORDER = 1 << 1,
	NPY_KEY_SHAPE = 1 << 2,
	NPY_KEY_ALL = (1 << 3) - 1
};

static int cursor_parse_entry(npy_cursor *cursor, zc_npy_header *header, unsigned *seen)
{
	/* Room for the longest key plus one, so longer keys are still read
	 * whole up to this bound and reported as unexpected. */
	char key[ZC_NPY_MAX_DESCR + 1];
	size_t key_position = cursor->position;
	unsigned which;
	int result;

	result = cursor_parse_string(cursor, key, sizeof(key));
	if (result < 0)
		return result;
	if (strcmp(key, "descr") == 0) {
		which = NPY_KEY_DESCR;
	} else if (strcmp(key, "fortran_order") == 0) {
		which = NPY_KEY_FORTRAN_ORDER;
	} else if (strcmp(key, "shape") == 0) {
		which = NPY_KEY_SHAPE;
	} else {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: unexpected key '%s' at byte %zu", key, key_position);
		return ZC_NPY_EHEADER;
	}
	if (*seen & which) {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: key '%s' repeated at byte %zu", key, key_position);
		return ZC_NPY_EHEADER;
	}
	*seen |= which;

	cursor_skip_space(cursor);
	result = cursor_expect(cursor, ':', "after a key");
	if (result < 0)
		return result;
	cursor_skip_space(cursor);

	switch (which) {
	case NPY_KEY_DESCR:
		if (cursor_peek(cursor) != '\'' && cursor_peek(cursor) != '"') {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "dtype is not a simple type string (structured dtypes are not supported); expected '<f2'");
			return ZC_NPY_EDTYPE;
		}
		return cursor_parse_string(cursor, header->descr, sizeof(header->descr));
	case NPY_KEY_FORTRAN_ORDER:
		return cursor_parse_bool(cursor, &header->fortran_order);
	default:
		return cursor_parse_shape(cursor, header);
	}
}

static int npy_parse_dict(npy_cursor *cursor, zc_npy_header *header)
{
	unsigned seen = 0;
	int result;

	cursor_skip_space(cursor);
	result = cursor_expect(cursor, '{', "to open the header dict");
	if (result < 0)
		return result;
	cursor_skip_space(cursor);
	while (cursor_peek(cursor) != '}') {
		result = cursor_parse_entry(cursor, header, &seen);
		if (result < 0)
			return result;
		cursor_skip_space(cursor);
		if (cursor_peek(cursor) == ',') {
			cursor->position++;
			cursor_skip_space(cursor);
		} else if (cursor_peek(cursor) != '}') {
			npy_set_detail(cursor->detail, cursor->detail_size,
				       "malformed header: expected ',' or '}' at byte %zu",
				       cursor->position);
			return ZC_NPY_EHEADER;
		}
	}
	cursor->position++;
	/* Writers pad with spaces and end with '\n'; nothing else may follow. */
	cursor_skip_space(cursor);
	if (cursor->position != cursor->length) {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: unexpected byte 0x%02x after the dict at byte %zu",
			       (unsigned)cursor_peek(cursor), cursor->position);
		return ZC_NPY_EHEADER;
	}
	if (seen != NPY_KEY_ALL) {
		npy_set_detail(cursor->detail, cursor->detail_size,
			       "malformed header: missing key '%s'",
			       !(seen & NPY_KEY_DESCR) ? "descr" :
			       !(seen & NPY_KEY_FORTRAN_ORDER) ? "fortran_order" : "shape");
		return ZC_NPY_EHEADER;
	}
	return 0;
}

int zc_npy_header_parse(const void *bytes, size_t size, zc_npy_header *header,
			char *detail, size_t detail_size)
{
	const unsigned char *data = bytes;
	size_t length_bytes;
	uint32_t header_length;
	size_t compared = size < NPY_MAGIC_BYTES ? size : NPY_MAGIC_BYTES;
	npy_cursor cursor;

	memset(header, 0, sizeof(*header));
	if (size == 0) {
		npy_set_detail(detail, detail_size, "not a .npy file: the file is empty (bad magic)");
		return ZC_NPY_EMAGIC;
	}
	if (memcmp(data, npy_magic, compared) != 0) {
		npy_set_detail(detail, detail_size,
			       "not a .npy file: bad magic (does not start with \\x93NUMPY)");
		return ZC_NPY_EMAGIC;
	}
	if (size < NPY_PREFIX_BYTES) {
		npy_set_detail(detail, detail_size,
			       "file is truncated: it ends inside the .npy magic and version");
		return ZC_NPY_ETRUNCATED;
	}
	header->major_version = data[6];
	header->minor_version = data[7];
	if (header->major_version < 1 || header->major_version > 3 || header->minor_version != 0) {
		npy_set_detail(detail, detail_size,
			       "unsupported .npy format version %d.%d (this reader knows 1.0, 2.0 and 3.0)",
			       header->major_version, header->minor_version);
		return ZC_NPY_EVERSION;
	}
	length_bytes = header->major_version == 1 ? 2 : 4;
	if (size < NPY_PREFIX_BYTES + length_bytes) {
		npy_set_detail(detail, detail_size,
			       "file is truncated: it ends inside the header length");
		return ZC_NPY_ETRUNCATED;
	}
	header_length = (uint32_t)data[8] | (uint32_t)data[9] << 8;
	if (length_bytes == 4)
		header_length |= (uint32_t)data[10] << 16 | (uint32_t)data[11] << 24;
	if (header_length > ZC_NPY_MAX_HEADER_BYTES) {
		npy_set_detail(detail, detail_size,
			       "malformed header: header length %" PRIu32 " exceeds the limit of %u bytes",
			       header_length, ZC_NPY_MAX_HEADER_BYTES);
		return ZC_NPY_EHEADER;
	}
	header->data_offset = NPY_PREFIX_BYTES + length_bytes + header_length;
	if (header->data_offset > size) {
		npy_set_detail(detail, detail_size,
			       "file is truncated: the header needs %" PRIu32 " bytes, only %zu present",
			       header_length, size - NPY_PREFIX_BYTES - length_bytes);
		return ZC_NPY_ETRUNCATED;
	}

	cursor.text = (const char *)data + NPY_PREFIX_BYTES + length_bytes;
	cursor.length = header_length;
	cursor.position = 0;
	cursor.detail = detail;
	cursor.detail_size = detail_size;
	return npy_parse_dict(&cursor, header);
}

/* Writes the shape as "(2, 3)" for messages; truncates safely. */
static void npy_format_shape(const zc_npy_header *header, char *out, size_t out_size)
{
	size_t used = 0;

	out[0] = '\0';
	for (int i = 0; i < header->rank && used < out_size; i++) {
		int written = snprintf(out + used, out_size - used, "%s%" PRIu64,
				       i == 0 ? "" : ", ", header->shape[i]);
		if (written < 0)
			return;
		used += (size_t)written;
	}
}

int zc_npy_header_check_f16(const zc_npy_header *header, size_t *count,
			    char *detail, size_t detail_size)
{
	char shape_text[128];
	uint64_t elements = 1;
	bool empty = false;

	if (strcmp(header->descr, "<f2") != 0) {
		npy_set_detail(detail, detail_size,
			       "dtype '%s' is not '<f2' (little-endian float16)", header->descr);
		return ZC_NPY_EDTYPE;
	}
	if (header->fortran_order) {
		npy_set_detail(detail, detail_size,
			       "fortran_order is True; only C-order arrays are supported");
		return ZC_NPY_EFORTRAN;
	}
	npy_format_shape(header, shape_text, sizeof(shape_text));
	if (header->rank != 2 && header->rank != 4) {
		npy_set_detail(detail, detail_size,
			       "rank %d array of shape (%s); expected rank 2 [S, D] or 4 [B, H, S, D]",
			       header->rank, shape_text);
		return ZC_NPY_ERANK;
	}
	/* An array with a zero dimension is empty however large the others
	 * are, so look for one before multiplying (which could overflow). */
	for (int i = 0; i < header->rank; i++)
		if (header->shape[i] == 0)
			empty = true;
	if (!empty) {
		for (int i = 0; i < header->rank; i++) {
			if (elements > (SIZE_MAX / sizeof(uint16_t)) / header->shape[i]) {
				npy_set_detail(detail, detail_size,
					       "shape (%s) has too many elements to hold in memory",
					       shape_text);
				return ZC_NPY_ESHAPE;
			}
			elements *= header->shape[i];
		}
	} else {
		elements = 0;
	}
	*count = (size_t)elements;
	return 0;
}

/* ---- file reading ------------------------------------------------------ */

/* Reads exactly size bytes at offset; a short file is ZC_NPY_ETRUNCATED. */
static int npy_read_exact(int fd, void *buffer, size_t size, off_t offset)
{
	unsigned char *bytes = buffer;

	while (size > 0) {
		size_t chunk = size < NPY_IO_CHUNK ? size : NPY_IO_CHUNK;
		ssize_t got = pread(fd, bytes, chunk, offset);

		if (got < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (got == 0)
			return ZC_NPY_ETRUNCATED;
		bytes += got;
		size -= (size_t)got;
		offset += got;
	}
	return 0;
}

void zc_npy_array_free(zc_npy_array *array)
{
	if (!array)
		return;
	free(array->data);
	memset(array, 0, sizeof(*array));
}

int zc_npy_read_f16(const char *path, zc_npy_array *array, char *detail,
		    size_t detail_size)
{
	zc_npy_header header;
	unsigned char *prefix = NULL;
	size_t prefix_size;
	size_t count = 0;
	uint64_t data_bytes, available;
	struct stat status;
	int fd;
	int result;

	memset(array, 0, sizeof(*array));
	/* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
	 * writer forever; regular files ignore the flag. */
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0) {
		result = -errno;
		npy_set_detail(detail, detail_size, "cannot open: %s", strerror(errno));
		return result;
	}
	if (fstat(fd, &status) < 0) {
		result = -errno;
		npy_set_detail(detail, detail_size, "cannot stat: %s", strerror(errno));
		goto close_file;
	}
	if (!S_ISREG(status.st_mode)) {
		result = ZC_NPY_ENOTREGULAR;
		npy_set_detail(detail, detail_size, "not a regular file%s",
			       S_ISDIR(status.st_mode) ? " (it is a directory)" : "");
		goto close_file;
	}

	/* The longest header there can be, or the whole file if shorter. */
	prefix_size = NPY_PREFIX_BYTES + 4 + ZC_NPY_MAX_HEADER_BYTES;
	if ((uint64_t)status.st_size < prefix_size)
		prefix_size = (size_t)status.st_size;
	prefix = malloc(prefix_size > 0 ? prefix_size : 1);
	if (!prefix) {
		result = -ENOMEM;
		npy_set_detail(detail, detail_size, "out of memory reading the header");
		goto close_file;
	}
	result = npy_read_exact(fd, prefix, prefix_size, 0);
	if (result < 0) {
		npy_set_detail(detail, detail_size, "cannot read the header: %s",
			       result == ZC_NPY_ETRUNCATED ? "file is truncated (it shrank while read)" :
			       strerror(-result));
		goto free_prefix;
	}
	result = zc_npy_header_parse(prefix, prefix_size, &header, detail, detail_size);
	if (result < 0)
		goto free_prefix;
	result = zc_npy_header_check_f16(&header, &count, detail, detail_size);
	if (result < 0)
		goto free_prefix;

	/* Compare with the file size before allocating: a hostile shape must
	 * not make us reserve memory the file cannot fill. */
	data_bytes = (uint64_t)count * sizeof(uint16_t);
	available = (uint64_t)status.st_size - header.data_offset;
	if (available < data_bytes) {
		result = ZC_NPY_ETRUNCATED;
		npy_set_detail(detail, detail_size,
			       "data truncated: the shape needs %" PRIu64 " bytes after the header, the file has %" PRIu64,
			       data_bytes, available);
		goto free_prefix;
	}
	if (available > data_bytes) {
		result = ZC_NPY_ETRAILING;
		npy_set_detail(detail, detail_size,
			       "trailing data: %" PRIu64 " bytes after the %" PRIu64 " the shape needs",
			       available - data_bytes, data_bytes);
		goto free_prefix;
	}

	if (count > 0) {
		unsigned char *bytes;

		array->data = malloc((size_t)data_bytes);
		if (!array->data) {
			result = -ENOMEM;
			npy_set_detail(detail, detail_size, "out of memory for %" PRIu64 " bytes of data",
				       data_bytes);
			goto free_prefix;
		}
		result = npy_read_exact(fd, array->data, (size_t)data_bytes,
					(off_t)header.data_offset);
		if (result < 0) {
			npy_set_detail(detail, detail_size, "cannot read the data: %s",
				       result == ZC_NPY_ETRUNCATED ? "data truncated (file shrank while read)" :
				       strerror(-result));
			goto free_data;
		}
		/* The file is little-endian; decode so big-endian hosts work
		 * too (on little-endian ones this is a copy onto itself). */
		bytes = (unsigned char *)array->data;
		for (size_t i = 0; i < count; i++)
			array->data[i] = (uint16_t)(bytes[2 * i] | bytes[2 * i + 1] << 8);
	}
	array->rank = header.rank;
	memcpy(array->shape, header.shape, sizeof(array->shape));
	array->count = count;
	result = 0;
	goto free_prefix;

free_data:
	free(array->data);
	array->data = NULL;
free_prefix:
	free(prefix);
close_file:
	close(fd);
	return result;
}

/* ---- file writing ------------------------------------------------------ */

static int npy_write_all(int fd, const void *buffer, size_t size)
{
	const unsigned char *bytes = buffer;

	while (size > 0) {
		size_t chunk = size < NPY_IO_CHUNK ? size : NPY_IO_CHUNK;
		ssize_t written = write(fd, bytes, chunk);

		if (written < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		bytes += written;
		size -= (size_t)written;
	}
	return 0;
}

/* Builds the magic, version 1.0, length and padded dict; returns its size. */
static size_t npy_build_header(char *out, size_t out_size, int rank, const uint64_t *shape)
{
	size_t used = NPY_PREFIX_BYTES + 2;
	size_t padded;

	used += (size_t)snprintf(out + used, out_size - used,
				 "{'descr': '<f2', 'fortran_order': False, 'shape': (");
	for (int i = 0; i < rank; i++)
		used += (size_t)snprintf(out + used, out_size - used, "%s%" PRIu64,
					 i == 0 ? "" : ", ", shape[i]);
	used += (size_t)snprintf(out + used, out_size - used, "%s), }",
				 rank == 1 ? "," : "");
	/* Pad with spaces and a final newline so the data is aligned. */
	padded = (used + 1 + NPY_ALIGNMENT - 1) / NPY_ALIGNMENT * NPY_ALIGNMENT;
	memset(out + used, ' ', padded - used - 1);
	out[padded - 1] = '\n';
	memcpy(out, npy_magic, NPY_MAGIC_BYTES);
	out[6] = 1;
	out[7] = 0;
	out[8] = (char)((padded - NPY_PREFIX_BYTES - 2) & 0xff);
	out[9] = (char)((padded - NPY_PREFIX_BYTES - 2) >> 8);
	return padded;
}

int zc_npy_write_f16(const char *path, int rank, const uint64_t *shape,
		     const uint16_t *data)
{
	/* 64 dimensions of at most 20 digits and ", " fit well inside this. */
	char header[4096];
	size_t header_size;
	unsigned char chunk[8192];
	uint64_t count = 1;
	static unsigned temp_counter;
	char *temp_path;
	size_t temp_path_size;
	int fd = -1;
	int result;

	if (rank < 0 || rank > ZC_NPY_MAX_RANK)
		return ZC_NPY_ERANK;
	for (int i = 0; i < rank; i++)
		if (shape[i] == 0)
			count = 0;
	for (int i = 0; i < rank && count > 0; i++) {
		if (count > (SIZE_MAX / sizeof(uint16_t)) / shape[i])
			return ZC_NPY_ESHAPE;
		count *= shape[i];
	}
	if (count > 0 && !data)
		return -EINVAL;
	header_size = npy_build_header(header, sizeof(header), rank, shape);

	/* Same directory, so the final rename() cannot cross file systems. */
	temp_path_size = strlen(path) + 64;
	temp_path = malloc(temp_path_size);
	if (!temp_path)
		return -ENOMEM;
	for (int attempt = 0; attempt < 100; attempt++) {
		snprintf(temp_path, temp_path_size, "%s.tmp-%ld-%u", path, (long)getpid(),
			 temp_counter++);
		/* 0666 and the umask, like any file the user creates. */
		fd = open(temp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0666);
		if (fd >= 0 || errno != EEXIST)
			break;
	}
	if (fd < 0) {
		result = -errno;
		goto free_temp_path;
	}

	result = npy_write_all(fd, header, header_size);
	if (result < 0)
		goto close_temp;
	for (size_t done = 0; done < count;) {
		size_t batch = sizeof(chunk) / 2;

		if (batch > count - done)
			batch = (size_t)(count - done);
		for (size_t i = 0; i < batch; i++) {
			chunk[2 * i] = (unsigned char)(data[done + i] & 0xff);
			chunk[2 * i + 1] = (unsigned char)(data[done + i] >> 8);
		}
		result = npy_write_all(fd, chunk, batch * 2);
		if (result < 0)
			goto close_temp;
		done += batch;
	}
	/* close() can report a delayed write error (NFS, quota): check it.
	 * No fsync: the output is derived data, and the promise is only that
	 * no half-written file ever sits at path. */
	if (close(fd) < 0) {
		result = -errno;
		goto remove_temp;
	}
	if (rename(temp_path, path) < 0) {
		result = -errno;
		goto remove_temp;
	}
	result = 0;
	goto free_temp_path;

close_temp:
	close(fd);
remove_temp:
	unlink(temp_path);
free_temp_path:
	free(temp_path);
	return result;
}
