/*
 * A small reader and writer for NumPy .npy files holding little-endian
 * float16 ('<f2') arrays in C order, the only kind the codec tools need.
 *
 * Format (numpy.lib.format): the magic "\x93NUMPY", a major and a minor
 * version byte, the header length (2 bytes little-endian in version 1, 4
 * bytes in versions 2 and 3), then the header: a Python dict literal such
 * as {'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), } padded
 * with spaces and a newline, then the raw array data.
 *
 * The reader treats the file as hostile: the header length is bounded,
 * the dict is parsed by a strict grammar (no eval), every number is checked
 * for overflow, and the data size the shape implies must match the file
 * size exactly before anything that large is allocated. Every rejection has
 * its own code, so a caller (and a test) can tell why a file was refused.
 */
#ifndef ZIPCACHE_TOOLS_NPY_H
#define ZIPCACHE_TOOLS_NPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The .npy codes live below the library's range (include/zipcache/error.h
 * ends at ZC_ERROR_BASE - 19) so that one int can carry either kind; they
 * stay out of error.h because only the tools ever see them. */
#define ZC_NPY_ERROR_BASE (-4100)

enum zc_npy_error {
	ZC_NPY_EMAGIC = ZC_NPY_ERROR_BASE - 1,      /* does not start with "\x93NUMPY" */
	ZC_NPY_EVERSION = ZC_NPY_ERROR_BASE - 2,    /* format version other than 1.0, 2.0, 3.0 */
	ZC_NPY_EHEADER = ZC_NPY_ERROR_BASE - 3,     /* header too long or not a valid dict */
	ZC_NPY_EDTYPE = ZC_NPY_ERROR_BASE - 4,      /* descr is not '<f2' */
	ZC_NPY_EFORTRAN = ZC_NPY_ERROR_BASE - 5,    /* fortran_order is True */
	ZC_NPY_ERANK = ZC_NPY_ERROR_BASE - 6,       /* number of dimensions not accepted */
	ZC_NPY_ESHAPE = ZC_NPY_ERROR_BASE - 7,      /* a dimension or the element count overflows */
	ZC_NPY_ETRUNCATED = ZC_NPY_ERROR_BASE - 8,  /* file ends before the header or data does */
	ZC_NPY_ETRAILING = ZC_NPY_ERROR_BASE - 9,   /* bytes after the array data */
	ZC_NPY_ENOTREGULAR = ZC_NPY_ERROR_BASE - 10 /* path is a directory, FIFO, device... */
};

/* numpy 2 allows 64 dimensions; a header claiming more is rejected. */
#define ZC_NPY_MAX_RANK 64
/* Longest header the reader accepts. Version 1 cannot exceed 65535 bytes
 * anyway, and real headers are under 200; the bound keeps a hostile
 * version 2 length field from making the reader allocate gigabytes. */
#define ZC_NPY_MAX_HEADER_BYTES 65536u
/* Longest descr string kept; every simple dtype string is far shorter. */
#define ZC_NPY_MAX_DESCR 32

/* What a header says, before any judgement of whether the tools accept it. */
typedef struct zc_npy_header {
	int major_version;
	int minor_version;
	size_t data_offset;                 /* bytes before the array data */
	char descr[ZC_NPY_MAX_DESCR + 1];   /* NUL-terminated */
	bool fortran_order;
	int rank;
	uint64_t shape[ZC_NPY_MAX_RANK];
} zc_npy_header;

/* A float16 array read from a file: values in host byte order, C order. */
typedef struct zc_npy_array {
	int rank;                           /* 2 or 4 */
	uint64_t shape[ZC_NPY_MAX_RANK];
	size_t count;                       /* product of the shape */
	uint16_t *data;                     /* count values; NULL when count is 0 */
} zc_npy_array;

/*
 * Parses the magic, version, length and dict at the start of bytes (size
 * bytes available). Returns 0, ZC_NPY_EMAGIC, ZC_NPY_EVERSION,
 * ZC_NPY_ETRUNCATED (the header runs past size), ZC_NPY_EHEADER or
 * ZC_NPY_ERANK (more than ZC_NPY_MAX_RANK dimensions), ZC_NPY_ESHAPE (a
 * dimension above UINT64_MAX) or ZC_NPY_EDTYPE (descr is not a simple type
 * string, e.g. a structured dtype list). detail (may be NULL) receives a
 * sentence naming what is wrong.
 */
int zc_npy_header_parse(const void *bytes, size_t size, zc_npy_header *header,
			char *detail, size_t detail_size);

/*
 * Checks that a parsed header describes a '<f2' C-order array of rank 2 or
 * 4 whose byte size fits in size_t; stores the element count. Returns 0,
 * ZC_NPY_EDTYPE, ZC_NPY_EFORTRAN, ZC_NPY_ERANK or ZC_NPY_ESHAPE.
 */
int zc_npy_header_check_f16(const zc_npy_header *header, size_t *count,
			    char *detail, size_t detail_size);

/*
 * Reads a rank 2 or 4 '<f2' C-order array from path into array, which the
 * caller releases with zc_npy_array_free() (also safe after a failure).
 * Returns 0, -errno (-ENOENT, -EACCES, -ENOMEM, -EIO...) or one of the
 * ZC_NPY_E* codes.
 */
int zc_npy_read_f16(const char *path, zc_npy_array *array, char *detail,
		    size_t detail_size);

void zc_npy_array_free(zc_npy_array *array);

/*
 * Writes a '<f2' C-order array as a version 1.0 .npy file whose header is
 * padded to 64 bytes, as numpy writes it. The file appears at path only
 * complete: the bytes go to a temporary file in the same directory that is
 * renamed over path at the end, and removed on any failure. rank is
 * 0..ZC_NPY_MAX_RANK; data may be NULL only when the shape has no
 * elements. Returns 0, -errno or ZC_NPY_ERANK / ZC_NPY_ESHAPE.
 */
int zc_npy_write_f16(const char *path, int rank, const uint64_t *shape,
		     const uint16_t *data);

/* A static sentence for a ZC_NPY_E* code or a -errno; never NULL. */
const char *zc_npy_strerror(int code);

#endif
