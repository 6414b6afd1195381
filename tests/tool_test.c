/*
 * Tests for tools/npy.c and the zipcache-tool program.
 *
 * The npy reader is driven in-process with headers built byte by byte
 * (numpy's own layouts, sloppy ones, hostile ones). The program is run as
 * a real process (fork + exec of ZC_BUILD_DIR/bin/zipcache-tool) with its
 * stdout and stderr captured, in a fresh temporary directory per test, so
 * what is checked is what a user or script sees: the exit status, the
 * JSON line, the one-line error, and which files exist afterwards.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tools/npy.h"
#include "process_run.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"
#include "suite_main.h"

#define PYTHON "/usr/bin/python3"

/* ---- per-test directories ---------------------------------------------- */

/* Files a test makes live in work_dir; the captured output of the program
 * goes to capture_dir, so listing work_dir shows exactly what the program
 * left behind. */
static char work_dir[PATH_MAX];
static char capture_dir[PATH_MAX];

static void make_temp_dir(char *out, size_t size, const char *label)
{
	const char *base = getenv("TMPDIR");

	if (!base || !*base)
		base = "/tmp";
	snprintf(out, size, "%s/zc_tool_test_%s.XXXXXX", base, label);
	ck_assert_msg(mkdtemp(out) != NULL, "mkdtemp %s: %s", out, strerror(errno));
}

static void setup_dirs(void)
{
	make_temp_dir(work_dir, sizeof(work_dir), "work");
	make_temp_dir(capture_dir, sizeof(capture_dir), "capture");
}

static void teardown_dirs(void)
{
	directory_remove(work_dir);
	directory_remove(capture_dir);
}

/* A path inside work_dir; each call site passes its own buffer. */
static const char *work_path(char *out, size_t size, const char *name)
{
	int length = snprintf(out, size, "%s/%s", work_dir, name);

	ck_assert(length > 0 && (size_t)length < size);
	return out;
}

/* Fails unless work_dir holds exactly the named entries (NULL-terminated):
 * no output file, no temporary file, nothing else. */
static void assert_work_dir_holds(const char *const *names)
{
	DIR *listing = opendir(work_dir);
	struct dirent *entry;
	size_t expected = 0, found = 0;

	ck_assert_ptr_nonnull(listing);
	while (names[expected])
		expected++;
	while ((entry = readdir(listing)) != NULL) {
		bool known = false;

		if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
			continue;
		for (size_t i = 0; names[i]; i++)
			if (strcmp(names[i], entry->d_name) == 0)
				known = true;
		ck_assert_msg(known, "unexpected file '%s' left in the work directory", entry->d_name);
		found++;
	}
	closedir(listing);
	ck_assert_uint_eq(found, expected);
}

/* ---- file helpers ------------------------------------------------------ */

static void write_file(const char *path, const void *bytes, size_t size)
{
	FILE *file = fopen(path, "wb");

	ck_assert_msg(file != NULL, "fopen %s: %s", path, strerror(errno));
	ck_assert_uint_eq(fwrite(bytes, 1, size, file), size);
	ck_assert_int_eq(fclose(file), 0);
}

/* The padding layouts .npy writers produce: numpy >= 1.14 aligns the data
 * to 64 bytes, older numpy to 16; other writers pad not at all. */
typedef enum pad_style {
	PAD_64,
	PAD_16,
	PAD_NEWLINE_ONLY,
	PAD_NONE
} pad_style;

/* Builds a .npy image: magic, version, header length, dict text, padding,
 * data. The length field is 2 bytes for major version 1 (and 0), else 4. */
static unsigned char *npy_image(int major, int minor, const char *dict, pad_style pad,
				const void *data, size_t data_bytes, size_t *size)
{
	size_t length_bytes = major <= 1 ? 2 : 4;
	size_t prefix = 8 + length_bytes;
	size_t dict_length = strlen(dict);
	size_t header_length;
	unsigned char *image;

	switch (pad) {
	case PAD_64:
	case PAD_16: {
		size_t alignment = pad == PAD_64 ? 64 : 16;

		header_length = (prefix + dict_length + 1 + alignment - 1) / alignment * alignment - prefix;
		break;
	}
	case PAD_NEWLINE_ONLY:
		header_length = dict_length + 1;
		break;
	default:
		header_length = dict_length;
		break;
	}
	*size = prefix + header_length + data_bytes;
	image = malloc(*size > 0 ? *size : 1);
	ck_assert_ptr_nonnull(image);
	memcpy(image, "\x93NUMPY", 6);
	image[6] = (unsigned char)major;
	image[7] = (unsigned char)minor;
	for (size_t i = 0; i < length_bytes; i++)
		image[8 + i] = (unsigned char)(header_length >> (8 * i));
	memcpy(image + prefix, dict, dict_length);
	memset(image + prefix + dict_length, ' ', header_length - dict_length);
	if (pad != PAD_NONE)
		image[prefix + header_length - 1] = '\n';
	if (data_bytes > 0)
		memcpy(image + prefix + header_length, data, data_bytes);
	return image;
}

static void write_npy_raw(const char *path, int major, const char *dict, pad_style pad,
			  const void *data, size_t data_bytes)
{
	size_t size;
	unsigned char *image = npy_image(major, 0, dict, pad, data, data_bytes, &size);

	write_file(path, image, size);
	free(image);
}

/* count little-endian fp16 values 0, 1, 2, ... (bit patterns, all finite). */
static unsigned char *counting_data(size_t count)
{
	unsigned char *bytes = malloc(count * 2 + 1);

	ck_assert_ptr_nonnull(bytes);
	for (size_t i = 0; i < count; i++) {
		bytes[2 * i] = (unsigned char)(i & 0xff);
		bytes[2 * i + 1] = (unsigned char)((i >> 8) & 0x3f);
	}
	return bytes;
}

static uint64_t shape_count(int rank, const uint64_t *shape)
{
	uint64_t count = 1;

	for (int i = 0; i < rank; i++)
		count *= shape[i];
	return count;
}

/*
 * A K/V-like block: small values with every fifth token scaled up, so
 * the saliency split has something to find, from a fixed LCG so every
 * run (and every ISA) sees the same bits.
 */
static uint16_t *make_block(int rank, const uint64_t *shape, uint32_t seed)
{
	uint64_t count = shape_count(rank, shape);
	uint64_t head_dim = shape[rank - 1];
	uint16_t *values = malloc(count > 0 ? count * sizeof(uint16_t) : 1);
	uint32_t state = seed * 2654435761u + 1;

	ck_assert_ptr_nonnull(values);
	for (uint64_t i = 0; i < count; i++) {
		uint64_t token = i / head_dim;
		float value;

		state = state * 1664525u + 1013904223u;
		value = (float)((int)(state >> 16) % 2001 - 1000) / 250.0f;
		if (token % 5 == 0)
			value *= 8.0f;
		values[i] = zc_float_to_fp16(value);
	}
	return values;
}

/* ---- running programs -------------------------------------------------- */

typedef struct program_output run_result;

static const char *tool_binary(void)
{
	static char path[PATH_MAX];

	snprintf(path, sizeof(path), "%s/bin/zipcache-tool", build_dir());
	return path;
}

/* Runs argv[0] with argv (NULL-terminated), stdin from /dev/null, stdout
 * and stderr into capture_dir (so work_dir shows only what it left). */
static void run_program(run_result *result, char *const *argv)
{
	char out_path[PATH_MAX + 16], err_path[PATH_MAX + 16];

	snprintf(out_path, sizeof(out_path), "%s/stdout", capture_dir);
	snprintf(err_path, sizeof(err_path), "%s/stderr", capture_dir);
	program_capture(result, (const char *const *)argv, out_path, err_path, NULL, NULL);
}

/*
 * Runs zipcache-tool with arguments (NULL-terminated); the words "IN" and
 * "OUT" stand for work_dir/in.npy and work_dir/out.npy.
 */
static void run_tool(run_result *result, const char *const *arguments)
{
	char in_path[PATH_MAX], out_path[PATH_MAX];
	char *argv[32];
	int argc = 0;

	work_path(in_path, sizeof(in_path), "in.npy");
	work_path(out_path, sizeof(out_path), "out.npy");
	argv[argc++] = (char *)tool_binary();
	for (size_t i = 0; arguments[i]; i++) {
		ck_assert_int_lt(argc, 31);
		if (strcmp(arguments[i], "IN") == 0)
			argv[argc++] = in_path;
		else if (strcmp(arguments[i], "OUT") == 0)
			argv[argc++] = out_path;
		else
			argv[argc++] = (char *)arguments[i];
	}
	argv[argc] = NULL;
	run_program(result, argv);
}

static size_t count_char(const char *text, size_t length, char c)
{
	size_t found = 0;

	for (size_t i = 0; i < length; i++)
		if (text[i] == c)
			found++;
	return found;
}

/* The error contract: exit status, nothing on stdout, exactly one line
 * "zipcache-tool: ..." on stderr that names the problem. */
static void assert_error_line(const run_result *result, int status, const char *word)
{
	ck_assert_msg(result->status == status, "exit status %d, expected %d; stderr: %s",
		      result->status, status, result->err);
	ck_assert_msg(result->out_length == 0, "stdout not empty: %s", result->out);
	ck_assert_msg(result->err_length > 0 && result->err[result->err_length - 1] == '\n' &&
		      count_char(result->err, result->err_length, '\n') == 1,
		      "stderr is not exactly one line: '%s'", result->err);
	ck_assert_msg(strncmp(result->err, "zipcache-tool: ", 15) == 0,
		      "stderr lacks the program prefix: %s", result->err);
	ck_assert_msg(strstr(result->err, word) != NULL, "stderr '%s' does not mention '%s'",
		      result->err, word);
}

/* ---- JSON fields ------------------------------------------------------- */

static const char *json_value(const char *json, const char *key)
{
	char pattern[64];
	const char *at;

	snprintf(pattern, sizeof(pattern), "\"%s\":", key);
	at = strstr(json, pattern);
	ck_assert_msg(at != NULL, "JSON lacks \"%s\": %s", key, json);
	/* Each key appears once. */
	ck_assert_msg(strstr(at + 1, pattern) == NULL, "JSON repeats \"%s\"", key);
	return at + strlen(pattern);
}

static uint64_t json_uint(const char *json, const char *key)
{
	const char *value = json_value(json, key);
	char *end;
	uint64_t parsed;

	ck_assert_msg(*value >= '0' && *value <= '9', "\"%s\" is not a number", key);
	parsed = strtoull(value, &end, 10);
	ck_assert_msg(*end == ',' || *end == '}', "\"%s\" is not an integer", key);
	return parsed;
}

static void json_expect_double(const char *json, const char *key, double expected)
{
	const char *value = json_value(json, key);
	char *end;
	double parsed = strtod(value, &end);

	ck_assert_msg(end != value && (*end == ',' || *end == '}'), "\"%s\" is not a number", key);
	/* Printed with 17 significant digits, so it parses back exactly. */
	ck_assert_msg(parsed == expected, "\"%s\" is %.17g, expected %.17g", key, parsed, expected);
}

static void json_expect_raw(const char *json, const char *key, const char *expected)
{
	const char *value = json_value(json, key);

	ck_assert_msg(strncmp(value, expected, strlen(expected)) == 0 &&
		      (value[strlen(expected)] == ',' || value[strlen(expected)] == '}'),
		      "\"%s\" is not %s in %s", key, expected, json);
}

/* ---- npy reader and writer --------------------------------------------- */

static const char *const dict_3x5 = "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }";

/* Writes an image and reads it back, returning the reader's code. */
static int read_raw(int major, const char *dict, pad_style pad, const void *data,
		    size_t data_bytes, zc_npy_array *array, char *detail, size_t detail_size)
{
	char path[PATH_MAX];

	work_path(path, sizeof(path), "raw.npy");
	write_npy_raw(path, major, dict, pad, data, data_bytes);
	return zc_npy_read_f16(path, array, detail, detail_size);
}

static void assert_read_fails(int major, const char *dict, size_t data_bytes, int expected,
			      const char *word)
{
	unsigned char *data = counting_data(data_bytes / 2 + 1);
	zc_npy_array array;
	char detail[512] = "";
	int result = read_raw(major, dict, PAD_64, data, data_bytes, &array, detail, sizeof(detail));

	ck_assert_msg(result == expected, "header %s: got %d (%s), expected %d", dict, result,
		      detail, expected);
	ck_assert_msg(strstr(detail, word) != NULL, "detail '%s' for %s does not mention '%s'",
		      detail, dict, word);
	ck_assert_ptr_null(array.data);
	zc_npy_array_free(&array);
	free(data);
}

START_TEST(test_npy_write_then_read)
{
	static const uint64_t shapes[][4] = { { 3, 5 }, { 2, 1, 4, 8 }, { 0, 7 }, { 1, 1, 0, 4 } };
	static const int ranks[] = { 2, 4, 2, 4 };

	for (size_t k = 0; k < sizeof(ranks) / sizeof(ranks[0]); k++) {
		char path[PATH_MAX];
		uint64_t count = shape_count(ranks[k], shapes[k]);
		uint16_t *values = malloc(count * sizeof(uint16_t) + 2);
		zc_npy_array array;
		char *bytes;
		size_t size, header_length;

		ck_assert_ptr_nonnull(values);
		for (uint64_t i = 0; i < count; i++)
			values[i] = (uint16_t)(0x3c00 + i * 7); /* distinct bytes in both halves */
		work_path(path, sizeof(path), "written.npy");
		ck_assert_int_eq(zc_npy_write_f16(path, ranks[k], shapes[k], values), 0);

		/* The bytes are what numpy would write: version 1.0, data at a
		 * multiple of 64, the dict in numpy's own spelling. */
		bytes = file_read_whole(path, &size);
		ck_assert_mem_eq(bytes, "\x93NUMPY\x01\x00", 8);
		header_length = (unsigned char)bytes[8] | (size_t)(unsigned char)bytes[9] << 8;
		ck_assert_uint_eq((10 + header_length) % 64, 0);
		ck_assert_uint_eq(size, 10 + header_length + 2 * count);
		ck_assert_int_eq(bytes[10 + header_length - 1], '\n');
		{
			static const char numpy_dict[] = "{'descr': '<f2', 'fortran_order': False, 'shape': (";

			ck_assert(strncmp(bytes + 10, numpy_dict, strlen(numpy_dict)) == 0);
		}
		for (uint64_t i = 0; i < count; i++) {
			ck_assert_uint_eq((unsigned char)bytes[10 + header_length + 2 * i], values[i] & 0xff);
			ck_assert_uint_eq((unsigned char)bytes[10 + header_length + 2 * i + 1], values[i] >> 8);
		}
		free(bytes);

		ck_assert_int_eq(zc_npy_read_f16(path, &array, NULL, 0), 0);
		ck_assert_int_eq(array.rank, ranks[k]);
		for (int d = 0; d < ranks[k]; d++)
			ck_assert_uint_eq(array.shape[d], shapes[k][d]);
		ck_assert_uint_eq(array.count, count);
		if (count > 0)
			ck_assert_mem_eq(array.data, values, count * sizeof(uint16_t));
		else
			ck_assert_ptr_null(array.data);
		zc_npy_array_free(&array);
		free(values);
	}
	{
		/* One dimension is written as Python's 1-tuple "(4,)". */
		uint64_t shape[1] = { 4 };
		uint16_t values[4] = { 1, 2, 3, 4 };
		char path[PATH_MAX];
		char *bytes;
		size_t size;

		work_path(path, sizeof(path), "rank1.npy");
		ck_assert_int_eq(zc_npy_write_f16(path, 1, shape, values), 0);
		bytes = file_read_whole(path, &size);
		ck_assert_ptr_nonnull(strstr(bytes + 10, "'shape': (4,), }"));
		free(bytes);
	}
}
END_TEST

/* Every header layout below is one numpy (some version) or another
 * reasonable writer produces, and all mean the same [3, 5] array. */
START_TEST(test_npy_header_variants)
{
	static const struct {
		int major;
		pad_style pad;
		const char *dict;
	} variants[] = {
		{ 1, PAD_64, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 1, PAD_16, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 1, PAD_NEWLINE_ONLY, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 1, PAD_NONE, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 2, PAD_64, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 2, PAD_NONE, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 3, PAD_64, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }" },
		{ 1, PAD_64, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)}" },
		{ 1, PAD_64, "{\"descr\": \"<f2\", \"fortran_order\": False, \"shape\": (3, 5)}" },
		{ 1, PAD_64, "{'shape': (3, 5), 'fortran_order': False, 'descr': '<f2'}" },
		{ 1, PAD_64, "{'descr':'<f2','fortran_order':False,'shape':(3,5)}" },
		{ 1, PAD_64, "  {\n 'descr' : '<f2' ,\n\t'fortran_order' : False ,\r\n 'shape' : ( 3 , 5 , ) , }  " },
		{ 1, PAD_64, "{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5,), }" },
	};
	unsigned char *data = counting_data(15);

	for (size_t k = 0; k < sizeof(variants) / sizeof(variants[0]); k++) {
		zc_npy_array array;
		char detail[512] = "";
		int result = read_raw(variants[k].major, variants[k].dict, variants[k].pad, data, 30,
				      &array, detail, sizeof(detail));

		ck_assert_msg(result == 0, "variant %zu (%s) rejected: %s", k, variants[k].dict, detail);
		ck_assert_int_eq(array.rank, 2);
		ck_assert_uint_eq(array.shape[0], 3);
		ck_assert_uint_eq(array.shape[1], 5);
		ck_assert_uint_eq(array.count, 15);
		for (size_t i = 0; i < 15; i++)
			ck_assert_uint_eq(array.data[i], i);
		zc_npy_array_free(&array);
	}
	{
		unsigned char *data4 = counting_data(64);
		zc_npy_array array;

		ck_assert_int_eq(read_raw(2, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 1, 4, 8), }",
					  PAD_64, data4, 128, &array, NULL, 0), 0);
		ck_assert_int_eq(array.rank, 4);
		ck_assert_uint_eq(array.shape[0], 2);
		ck_assert_uint_eq(array.shape[1], 1);
		ck_assert_uint_eq(array.shape[2], 4);
		ck_assert_uint_eq(array.shape[3], 8);
		ck_assert_uint_eq(array.data[63], 63);
		zc_npy_array_free(&array);
		free(data4);
	}
	free(data);
}
END_TEST

START_TEST(test_npy_rejects_wrong_rank)
{
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 8,
			  ZC_NPY_ERANK, "rank 1");
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (), }", 2,
			  ZC_NPY_ERANK, "rank 0");
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 4, 5), }", 80,
			  ZC_NPY_ERANK, "rank 3");
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 1, 2, 2), }", 8,
			  ZC_NPY_ERANK, "rank 5");
	{
		/* 65 dimensions: more than any numpy allows. */
		char dict[512] = "{'descr': '<f2', 'fortran_order': False, 'shape': (";

		for (int i = 0; i < 65; i++)
			strcat(dict, "1, ");
		strcat(dict, "), }");
		assert_read_fails(1, dict, 2, ZC_NPY_ERANK, "rank");
	}
}
END_TEST

START_TEST(test_npy_rejects_dtype_and_order)
{
	assert_read_fails(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 5), }", 60,
			  ZC_NPY_EDTYPE, "'<f4'");
	assert_read_fails(1, "{'descr': '>f2', 'fortran_order': False, 'shape': (3, 5), }", 30,
			  ZC_NPY_EDTYPE, "'>f2'");
	assert_read_fails(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (3, 5), }", 15,
			  ZC_NPY_EDTYPE, "'|u1'");
	assert_read_fails(1, "{'descr': '=f2', 'fortran_order': False, 'shape': (3, 5), }", 30,
			  ZC_NPY_EDTYPE, "dtype");
	assert_read_fails(1, "{'descr': [('a', '<f2')], 'fortran_order': False, 'shape': (3, 5), }", 30,
			  ZC_NPY_EDTYPE, "structured");
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': True, 'shape': (3, 5), }", 30,
			  ZC_NPY_EFORTRAN, "fortran_order");
}
END_TEST

START_TEST(test_npy_rejects_malformed_headers)
{
	static const char *const dicts[] = {
		"",
		"{",
		"}",
		"[]",
		"{'descr': '<f2', 'fortran_order': False}",
		"{'descr': '<f2', 'shape': (3, 5)}",
		"{'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2', 'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), 'extra': 1}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (15)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (-3, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (03, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3,, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (,)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5.0)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5_0)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': [3, 5]}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)",
		"{'descr': '<f2', 'fortran_order': Flase, 'shape': (3, 5)}",
		"{'descr': '<f2', 'fortran_order': Falsey, 'shape': (3, 5)}",
		"{'descr': '<f2', 'fortran_order': 0, 'shape': (3, 5)}",
		"{'descr': '<f2, 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2\", 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f\\x32', 'fortran_order': False, 'shape': (3, 5)}",
		"{descr: '<f2', 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr' '<f2', 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2' 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)}}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)} x",
		"{, 'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5),,}",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5)",
		"{'descr': 'a-string-that-is-much-longer-than-any-dtype', 'fortran_order': False, 'shape': (3, 5)}",
	};

	for (size_t k = 0; k < sizeof(dicts) / sizeof(dicts[0]); k++)
		assert_read_fails(1, dicts[k], 30, ZC_NPY_EHEADER, "header");
	{
		/* A NUL byte inside the header. */
		size_t size;
		unsigned char *data = counting_data(15);
		unsigned char *image = npy_image(1, 0, dict_3x5, PAD_64, data, 30, &size);
		char path[PATH_MAX];
		zc_npy_array array;
		char detail[512];

		image[10 + 12] = '\0';
		work_path(path, sizeof(path), "nul.npy");
		write_file(path, image, size);
		ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_EHEADER);
		free(image);
		free(data);
	}
}
END_TEST

START_TEST(test_npy_rejects_oversized_shapes)
{
	zc_npy_array array;

	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (18446744073709551615, 18446744073709551615), }",
			  30, ZC_NPY_ESHAPE, "too many elements");
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (99999999999999999999, 2), }",
			  30, ZC_NPY_ESHAPE, "64 bits");
	/* 2^62 * 4 elements: the product overflows 64 bits, not just memory. */
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 4611686018427387904, 4), }",
			  30, ZC_NPY_ESHAPE, "too many elements");
	/* Big but representable: the file is far too short for it. */
	assert_read_fails(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (100000, 100000), }",
			  30, ZC_NPY_ETRUNCATED, "truncated");
	/* A zero dimension makes the array empty, however large the rest. */
	ck_assert_int_eq(read_raw(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 18446744073709551615), }",
				  PAD_64, NULL, 0, &array, NULL, 0), 0);
	ck_assert_uint_eq(array.count, 0);
	ck_assert_ptr_null(array.data);
	zc_npy_array_free(&array);
}
END_TEST

START_TEST(test_npy_rejects_bad_files)
{
	unsigned char *data = counting_data(15);
	char path[PATH_MAX], detail[512];
	unsigned char *image;
	zc_npy_array array;
	size_t size;
	int result;

	work_path(path, sizeof(path), "bad.npy");

	/* Not .npy at all, or cut before the header starts. */
	write_file(path, "", 0);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_EMAGIC);
	ck_assert_ptr_nonnull(strstr(detail, "magic"));
	write_file(path, "hello, world\n", 13);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_EMAGIC);
	write_file(path, "\x93NUMPX\x01\x00\x10\x00", 10);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_EMAGIC);
	write_file(path, "\x93NUM", 4);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);
	write_file(path, "\x93NUMPY\x01\x00", 8);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);
	write_file(path, "\x93NUMPY\x02\x00\x10\x00", 10);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);

	/* Versions this reader does not know. */
	static const int versions[][2] = { { 0, 0 }, { 4, 0 }, { 1, 1 }, { 2, 5 }, { 255, 0 } };
	for (size_t k = 0; k < sizeof(versions) / sizeof(versions[0]); k++) {
		image = npy_image(versions[k][0], versions[k][1], dict_3x5, PAD_64, data, 30, &size);
		write_file(path, image, size);
		result = zc_npy_read_f16(path, &array, detail, sizeof(detail));
		ck_assert_msg(result == ZC_NPY_EVERSION, "version %d.%d gave %d", versions[k][0],
			      versions[k][1], result);
		ck_assert_ptr_nonnull(strstr(detail, "version"));
		free(image);
	}

	/* The header length points past the end of the file. */
	image = npy_image(1, 0, dict_3x5, PAD_64, data, 30, &size);
	image[9] = 0x7f;
	write_file(path, image, size);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);
	free(image);

	/* A version 2 length of 4 GiB - 1 is refused before any allocation. */
	image = npy_image(2, 0, dict_3x5, PAD_64, data, 30, &size);
	memset(image + 8, 0xff, 4);
	write_file(path, image, size);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_EHEADER);
	ck_assert_ptr_nonnull(strstr(detail, "exceeds"));
	free(image);

	/* Data one byte short, missing entirely, one byte too long. */
	write_npy_raw(path, 1, dict_3x5, PAD_64, data, 29);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);
	ck_assert_ptr_nonnull(strstr(detail, "truncated"));
	write_npy_raw(path, 1, dict_3x5, PAD_64, data, 0);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRUNCATED);
	write_npy_raw(path, 1, dict_3x5, PAD_64, data, 31);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), ZC_NPY_ETRAILING);
	ck_assert_ptr_nonnull(strstr(detail, "trailing"));

	/* No file, and a directory. */
	work_path(path, sizeof(path), "missing.npy");
	ck_assert_int_eq(zc_npy_read_f16(path, &array, detail, sizeof(detail)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(detail, "No such file"));
	ck_assert_int_eq(zc_npy_read_f16(work_dir, &array, detail, sizeof(detail)), ZC_NPY_ENOTREGULAR);
	ck_assert_ptr_nonnull(strstr(detail, "directory"));
	ck_assert_ptr_null(array.data);
	free(data);
}
END_TEST

/*
 * Random damage to a valid image: the parser must answer 0 or one of its
 * codes, never read outside the bytes it was given (the image sits in an
 * exact-size allocation, so ASan sees any overread), and always leave a
 * terminated detail.
 */
START_TEST(test_npy_header_parse_survives_damage)
{
	static const char *const seeds[] = {
		"{'descr': '<f2', 'fortran_order': False, 'shape': (3, 5), }",
		"{'descr': '<f2', 'fortran_order': False, 'shape': (2, 1, 4, 8), }",
		"{'descr': [('a', '<f2')], 'fortran_order': True, 'shape': (18446744073709551615,), }",
	};
	uint32_t state = 12345;

	for (int iteration = 0; iteration < 30000; iteration++) {
		const char *seed = seeds[iteration % 3];
		int major = 1 + iteration % 3;
		size_t size;
		unsigned char *image = npy_image(major, 0, seed, (pad_style)(iteration % 4), NULL, 0, &size);
		unsigned char *exact;
		int edits;
		zc_npy_header header;
		char detail[64];
		size_t count;
		int result;

		state = state * 1664525u + 1013904223u;
		edits = 1 + (int)(state >> 28) % 4;
		for (int e = 0; e < edits; e++) {
			state = state * 1664525u + 1013904223u;
			size_t at = (state >> 8) % size;
			state = state * 1664525u + 1013904223u;
			/* Mostly header punctuation and digits, sometimes any byte. */
			static const char alphabet[] = "{}()[],:'\" 0123456789\n\\TF-";
			image[at] = (state & 3) == 0 ? (unsigned char)(state >> 24)
						     : (unsigned char)alphabet[(state >> 24) % (sizeof(alphabet) - 1)];
		}
		state = state * 1664525u + 1013904223u;
		if ((state & 7) == 0)
			size = (state >> 8) % (size + 1);
		exact = malloc(size > 0 ? size : 1);
		ck_assert_ptr_nonnull(exact);
		memcpy(exact, image, size);
		memset(detail, 'x', sizeof(detail));
		result = zc_npy_header_parse(exact, size, &header, detail, sizeof(detail));
		if (result == 0)
			result = zc_npy_header_check_f16(&header, &count, detail, sizeof(detail));
		ck_assert_msg(result == 0 || (result <= ZC_NPY_EMAGIC && result >= ZC_NPY_ENOTREGULAR),
			      "unexpected code %d", result);
		if (result < 0)
			ck_assert_ptr_nonnull(memchr(detail, '\0', sizeof(detail)));
		else
			ck_assert_uint_le(header.data_offset, size);
		free(exact);
		free(image);
	}
}
END_TEST

START_TEST(test_npy_write_is_atomic)
{
	char path[PATH_MAX], missing_dir_path[PATH_MAX];
	uint64_t shape[2] = { 2, 3 };
	uint16_t first[6] = { 1, 2, 3, 4, 5, 6 };
	uint16_t second[6] = { 9, 9, 9, 9, 9, 9 };
	zc_npy_array array;
	static const char *const only_out[] = { "out.npy", NULL };

	work_path(path, sizeof(path), "out.npy");
	ck_assert_int_eq(zc_npy_write_f16(path, 2, shape, first), 0);
	ck_assert_int_eq(zc_npy_write_f16(path, 2, shape, second), 0);
	assert_work_dir_holds(only_out);
	ck_assert_int_eq(zc_npy_read_f16(path, &array, NULL, 0), 0);
	ck_assert_mem_eq(array.data, second, sizeof(second));
	zc_npy_array_free(&array);

	work_path(missing_dir_path, sizeof(missing_dir_path), "no-such-dir/out.npy");
	ck_assert_int_eq(zc_npy_write_f16(missing_dir_path, 2, shape, first), -ENOENT);
	/* A directory in the way: the rename fails and the temporary goes. */
	work_path(path, sizeof(path), "a-directory");
	ck_assert_int_eq(mkdir(path, 0700), 0);
	ck_assert_int_lt(zc_npy_write_f16(path, 2, shape, first), 0);
	{
		static const char *const out_and_dir[] = { "out.npy", "a-directory", NULL };
		assert_work_dir_holds(out_and_dir);
	}
	ck_assert_int_eq(rmdir(path), 0);

	ck_assert_int_eq(zc_npy_write_f16(path, ZC_NPY_MAX_RANK + 1, shape, first), ZC_NPY_ERANK);
	ck_assert_int_eq(zc_npy_write_f16(path, 2, shape, NULL), -EINVAL);
	assert_work_dir_holds(only_out);
}
END_TEST

START_TEST(test_npy_strerror)
{
	for (int code = ZC_NPY_EMAGIC; code >= ZC_NPY_ENOTREGULAR; code--) {
		const char *text = zc_npy_strerror(code);

		ck_assert_ptr_nonnull(text);
		ck_assert_str_ne(text, "unknown error");
		for (int other = code - 1; other >= ZC_NPY_ENOTREGULAR; other--)
			ck_assert_str_ne(text, zc_npy_strerror(other));
	}
	ck_assert_str_eq(zc_npy_strerror(-ENOENT), strerror(ENOENT));
	ck_assert_str_eq(zc_npy_strerror(ZC_NPY_ERROR_BASE - 99), "unknown error");
}
END_TEST

/* ---- the program: successful roundtrips -------------------------------- */

/*
 * Writes a block as work_dir/in.npy, runs the tool with arguments, and
 * checks everything it promises against the codec run in this process:
 * the JSON numbers, and OUT equal bit for bit to zc_block_reconstruct().
 */
static void check_roundtrip(int rank, const uint64_t *dims, zc_tensor tensor,
			    const zc_codec_config *config, const char *const *arguments)
{
	char in_path[PATH_MAX], out_path[PATH_MAX];
	uint64_t count = shape_count(rank, dims);
	uint16_t *input = make_block(rank, dims, (uint32_t)(count + (uint64_t)rank));
	uint16_t *expected = malloc(count > 0 ? count * sizeof(uint16_t) : 2);
	zc_block_shape shape = { 1, 1, 0, 0 };
	zc_byte_count bytes;
	zc_strides strides;
	void *compressed;
	int64_t written;
	run_result result;
	zc_npy_array output;
	char shape_text[128];

	ck_assert_ptr_nonnull(expected);
	if (rank == 2) {
		shape.tokens = (uint32_t)dims[0];
		shape.head_dim = (uint32_t)dims[1];
		snprintf(shape_text, sizeof(shape_text), "[%" PRIu64 ",%" PRIu64 "]", dims[0], dims[1]);
	} else {
		shape.batch = (uint32_t)dims[0];
		shape.heads = (uint32_t)dims[1];
		shape.tokens = (uint32_t)dims[2];
		shape.head_dim = (uint32_t)dims[3];
		snprintf(shape_text, sizeof(shape_text), "[%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 "]",
			 dims[0], dims[1], dims[2], dims[3]);
	}
	ck_assert_int_eq(zc_npy_write_f16(work_path(in_path, sizeof(in_path), "in.npy"), rank, dims, input), 0);

	ck_assert_int_eq(zc_block_count_bytes(config, tensor, &shape, &bytes), 0);
	compressed = malloc(bytes.compressed > 0 ? bytes.compressed : 1);
	ck_assert_ptr_nonnull(compressed);
	written = zc_block_compress(config, tensor, &shape, input, compressed, bytes.compressed);
	ck_assert_int_eq(written, (int64_t)bytes.compressed);
	strides.token = shape.head_dim;
	strides.head = (size_t)shape.tokens * shape.head_dim;
	strides.batch = strides.head * shape.heads;
	ck_assert_int_eq(zc_block_reconstruct(config, tensor, &shape, compressed, bytes.compressed,
					      expected, &strides), 0);

	run_tool(&result, arguments);
	ck_assert_msg(result.status == 0, "exit %d: %s", result.status, result.err);
	ck_assert_msg(result.err_length == 0, "stderr not empty: %s", result.err);
	/* One JSON object on one line. */
	ck_assert_msg(result.out_length > 2 && result.out[0] == '{' &&
		      result.out[result.out_length - 2] == '}' &&
		      result.out[result.out_length - 1] == '\n' &&
		      count_char(result.out, result.out_length, '\n') == 1,
		      "stdout is not one JSON line: %s", result.out);
	ck_assert_uint_eq(json_uint(result.out, "compressed_bytes"), bytes.compressed);
	ck_assert_uint_eq(json_uint(result.out, "baseline_bytes"), bytes.baseline);
	ck_assert_uint_eq(json_uint(result.out, "fp16_bytes"), bytes.fp16);
	ck_assert_uint_eq(json_uint(result.out, "n_hi"), zc_codec_salient_tokens(config, tensor, shape.tokens));
	if (bytes.compressed > 0) {
		json_expect_double(result.out, "compression_ratio", (double)bytes.fp16 / (double)bytes.compressed);
		json_expect_double(result.out, "effective_avg_bits", 16.0 * (double)bytes.compressed / (double)bytes.fp16);
	} else {
		json_expect_raw(result.out, "compression_ratio", "null");
		json_expect_raw(result.out, "effective_avg_bits", "null");
	}
	json_expect_raw(result.out, "mode", tensor == ZC_TENSOR_KEYS ? "\"keys\"" : "\"values\"");
	json_expect_raw(result.out, "shape", shape_text);
	{
		char isa[32];

		snprintf(isa, sizeof(isa), "\"%s\"", zc_isa_name(zc_codec_isa()));
		json_expect_raw(result.out, "isa", isa);
	}

	ck_assert_int_eq(zc_npy_read_f16(work_path(out_path, sizeof(out_path), "out.npy"), &output, NULL, 0), 0);
	ck_assert_int_eq(output.rank, rank);
	for (int d = 0; d < rank; d++)
		ck_assert_uint_eq(output.shape[d], dims[d]);
	ck_assert_uint_eq(output.count, count);
	for (uint64_t i = 0; i < count; i++)
		ck_assert_msg(output.data[i] == expected[i], "element %" PRIu64 ": tool 0x%04x, codec 0x%04x",
			      i, output.data[i], expected[i]);
	{
		static const char *const in_and_out[] = { "in.npy", "out.npy", NULL };
		assert_work_dir_holds(in_and_out);
	}
	zc_npy_array_free(&output);
	program_output_free(&result);
	free(compressed);
	free(expected);
	free(input);
}

START_TEST(test_roundtrip_one_head_defaults)
{
	static const uint64_t dims[2] = { 48, 64 };
	static const char *const arguments[] = { "roundtrip", "IN", "OUT", NULL };
	zc_codec_config config;

	zc_codec_config_default(&config);
	check_roundtrip(2, dims, ZC_TENSOR_KEYS, &config, arguments);
}
END_TEST

START_TEST(test_roundtrip_block_keys_options)
{
	static const uint64_t dims[4] = { 1, 2, 33, 24 };
	/* Options after and between the paths, in both spellings. */
	static const char *const arguments[] = {
		"roundtrip", "IN", "--hi-bits=8", "--lo-bits", "3", "OUT",
		"--hi-fraction", "0.35", "--group-size=5", "--mode", "keys", NULL
	};
	zc_codec_config config;

	zc_codec_config_default(&config);
	config.hi_bits = 8;
	config.lo_bits = 3;
	config.hi_fraction = 0.35;
	config.group_size = 5;
	check_roundtrip(4, dims, ZC_TENSOR_KEYS, &config, arguments);
}
END_TEST

START_TEST(test_roundtrip_block_values)
{
	static const uint64_t dims[4] = { 2, 3, 40, 32 };
	static const char *const arguments[] = {
		"roundtrip", "--mode", "values", "--hi-bits", "6", "--group-size", "16", "IN", "OUT", NULL
	};
	zc_codec_config config;

	zc_codec_config_default(&config);
	config.hi_bits = 6;
	config.group_size = 16;
	check_roundtrip(4, dims, ZC_TENSOR_VALUES, &config, arguments);
}
END_TEST

START_TEST(test_roundtrip_values_unquantized_is_exact)
{
	static const uint64_t dims[4] = { 1, 2, 9, 16 };
	static const char *const arguments[] = {
		"roundtrip", "--mode=values", "--no-quantize-values", "IN", "OUT", NULL
	};
	zc_codec_config config;
	zc_npy_array input, output;
	char path[PATH_MAX];

	zc_codec_config_default(&config);
	config.quantize_values = false;
	check_roundtrip(4, dims, ZC_TENSOR_VALUES, &config, arguments);
	ck_assert_int_eq(zc_npy_read_f16(work_path(path, sizeof(path), "in.npy"), &input, NULL, 0), 0);
	ck_assert_int_eq(zc_npy_read_f16(work_path(path, sizeof(path), "out.npy"), &output, NULL, 0), 0);
	ck_assert_mem_eq(input.data, output.data, input.count * sizeof(uint16_t));
	zc_npy_array_free(&input);
	zc_npy_array_free(&output);
}
END_TEST

START_TEST(test_roundtrip_empty_block)
{
	static const uint64_t dims[2] = { 0, 16 };
	static const char *const arguments[] = { "roundtrip", "IN", "OUT", NULL };
	zc_codec_config config;

	zc_codec_config_default(&config);
	check_roundtrip(2, dims, ZC_TENSOR_KEYS, &config, arguments);
}
END_TEST

START_TEST(test_help_and_version)
{
	static const char *const help[] = { "--help", NULL };
	static const char *const roundtrip_help[] = { "roundtrip", "--help", NULL };
	static const char *const version[] = { "--version", NULL };
	run_result result;

	run_tool(&result, help);
	ck_assert_int_eq(result.status, 0);
	ck_assert_ptr_nonnull(strstr(result.out, "usage: zipcache-tool roundtrip"));
	ck_assert_ptr_nonnull(strstr(result.out, "--hi-fraction"));
	ck_assert_uint_eq(result.err_length, 0);
	program_output_free(&result);

	run_tool(&result, roundtrip_help);
	ck_assert_int_eq(result.status, 0);
	ck_assert_ptr_nonnull(strstr(result.out, "usage:"));
	program_output_free(&result);

	run_tool(&result, version);
	ck_assert_int_eq(result.status, 0);
	ck_assert_str_eq(result.out, "zipcache-tool 0.1.0\n");
	ck_assert_uint_eq(result.err_length, 0);
	program_output_free(&result);
}
END_TEST

/* ---- the program: every error exit ------------------------------------- */

typedef enum input_kind {
	INPUT_NONE,           /* no in.npy at all */
	INPUT_VALID,          /* a finite [8, 16] float16 array */
	INPUT_BAD_MAGIC,
	INPUT_FLOAT32,
	INPUT_BIG_ENDIAN,
	INPUT_UINT8,
	INPUT_FORTRAN,
	INPUT_RANK_3,
	INPUT_RANK_1,
	INPUT_TRUNCATED,
	INPUT_TRAILING,
	INPUT_BAD_HEADER,
	INPUT_NAN,
	INPUT_INFINITY,
	INPUT_HEAD_DIM_TOO_LARGE,
	INPUT_ZERO_HEADS,
	INPUT_DIRECTORY
} input_kind;

static void make_input(input_kind kind)
{
	static const char *const f2_8x16 = "{'descr': '<f2', 'fortran_order': False, 'shape': (8, 16), }";
	unsigned char *data = counting_data(5000);
	char path[PATH_MAX];

	work_path(path, sizeof(path), "in.npy");
	switch (kind) {
	case INPUT_NONE:
		break;
	case INPUT_VALID:
		write_npy_raw(path, 1, f2_8x16, PAD_64, data, 256);
		break;
	case INPUT_BAD_MAGIC:
		write_file(path, "PK\x03\x04 this is a zip file, not an array", 38);
		break;
	case INPUT_FLOAT32:
		write_npy_raw(path, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (8, 16), }", PAD_64, data, 512);
		break;
	case INPUT_BIG_ENDIAN:
		write_npy_raw(path, 1, "{'descr': '>f2', 'fortran_order': False, 'shape': (8, 16), }", PAD_64, data, 256);
		break;
	case INPUT_UINT8:
		write_npy_raw(path, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (8, 16), }", PAD_64, data, 128);
		break;
	case INPUT_FORTRAN:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': True, 'shape': (8, 16), }", PAD_64, data, 256);
		break;
	case INPUT_RANK_3:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 8, 16), }", PAD_64, data, 512);
		break;
	case INPUT_RANK_1:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (16,), }", PAD_64, data, 32);
		break;
	case INPUT_TRUNCATED:
		write_npy_raw(path, 1, f2_8x16, PAD_64, data, 255);
		break;
	case INPUT_TRAILING:
		write_npy_raw(path, 1, f2_8x16, PAD_64, data, 258);
		break;
	case INPUT_BAD_HEADER:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (8 16), }", PAD_64, data, 256);
		break;
	case INPUT_NAN:
	case INPUT_INFINITY:
		/* Last element: the codec must look at every value. */
		data[254] = 0x00;
		data[255] = kind == INPUT_NAN ? 0x7e : 0xfc;
		write_npy_raw(path, 1, f2_8x16, PAD_64, data, 256);
		break;
	case INPUT_HEAD_DIM_TOO_LARGE:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 5000), }", PAD_64, data, 10000);
		break;
	case INPUT_ZERO_HEADS:
		write_npy_raw(path, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 0, 4, 8), }", PAD_64, data, 0);
		break;
	case INPUT_DIRECTORY:
		ck_assert_int_eq(mkdir(path, 0700), 0);
		break;
	}
	free(data);
}

typedef struct error_case {
	const char *name;
	input_kind input;
	const char *arguments[12];
	const char *word;     /* the error line must contain this */
} error_case;

#define ROUNDTRIP_IN_OUT "roundtrip", "IN", "OUT", NULL

static const error_case error_cases[] = {
	{ "missing input", INPUT_NONE, { ROUNDTRIP_IN_OUT }, "No such file" },
	{ "input is a directory", INPUT_DIRECTORY, { ROUNDTRIP_IN_OUT }, "regular file" },
	{ "bad magic", INPUT_BAD_MAGIC, { ROUNDTRIP_IN_OUT }, "magic" },
	{ "float32", INPUT_FLOAT32, { ROUNDTRIP_IN_OUT }, "dtype '<f4'" },
	{ "big-endian float16", INPUT_BIG_ENDIAN, { ROUNDTRIP_IN_OUT }, "dtype '>f2'" },
	{ "uint8", INPUT_UINT8, { ROUNDTRIP_IN_OUT }, "dtype '|u1'" },
	{ "fortran order", INPUT_FORTRAN, { ROUNDTRIP_IN_OUT }, "fortran_order" },
	{ "rank 3", INPUT_RANK_3, { ROUNDTRIP_IN_OUT }, "rank 3" },
	{ "rank 1", INPUT_RANK_1, { ROUNDTRIP_IN_OUT }, "rank 1" },
	{ "truncated data", INPUT_TRUNCATED, { ROUNDTRIP_IN_OUT }, "truncated" },
	{ "trailing data", INPUT_TRAILING, { ROUNDTRIP_IN_OUT }, "trailing" },
	{ "malformed header", INPUT_BAD_HEADER, { ROUNDTRIP_IN_OUT }, "header" },
	{ "NaN", INPUT_NAN, { ROUNDTRIP_IN_OUT }, "non-finite" },
	{ "Inf", INPUT_INFINITY, { ROUNDTRIP_IN_OUT }, "non-finite" },
	{ "NaN in values mode", INPUT_NAN, { "roundtrip", "--mode", "values", "IN", "OUT", NULL }, "non-finite" },
	{ "head_dim too large", INPUT_HEAD_DIM_TOO_LARGE, { ROUNDTRIP_IN_OUT }, "shape" },
	{ "zero heads", INPUT_ZERO_HEADS, { ROUNDTRIP_IN_OUT }, "shape" },
	{ "hi-bits 9", INPUT_VALID, { "roundtrip", "--hi-bits", "9", "IN", "OUT", NULL }, "--hi-bits" },
	{ "hi-bits 0", INPUT_VALID, { "roundtrip", "--hi-bits=0", "IN", "OUT", NULL }, "--hi-bits" },
	{ "hi-bits empty", INPUT_VALID, { "roundtrip", "--hi-bits", "", "IN", "OUT", NULL }, "--hi-bits" },
	{ "hi-bits space", INPUT_VALID, { "roundtrip", "--hi-bits", " 4", "IN", "OUT", NULL }, "--hi-bits" },
	{ "hi-bits huge", INPUT_VALID, { "roundtrip", "--hi-bits", "99999999999999999999", "IN", "OUT", NULL }, "--hi-bits" },
	{ "lo-bits 0", INPUT_VALID, { "roundtrip", "--lo-bits", "0", "IN", "OUT", NULL }, "--lo-bits" },
	{ "lo-bits 2.5", INPUT_VALID, { "roundtrip", "--lo-bits", "2.5", "IN", "OUT", NULL }, "--lo-bits" },
	{ "hi-fraction abc", INPUT_VALID, { "roundtrip", "--hi-fraction", "abc", "IN", "OUT", NULL }, "--hi-fraction" },
	{ "hi-fraction 1.5", INPUT_VALID, { "roundtrip", "--hi-fraction", "1.5", "IN", "OUT", NULL }, "--hi-fraction" },
	{ "hi-fraction -0.1", INPUT_VALID, { "roundtrip", "--hi-fraction=-0.1", "IN", "OUT", NULL }, "--hi-fraction" },
	{ "hi-fraction nan", INPUT_VALID, { "roundtrip", "--hi-fraction", "nan", "IN", "OUT", NULL }, "--hi-fraction" },
	{ "hi-fraction 0.5x", INPUT_VALID, { "roundtrip", "--hi-fraction", "0.5x", "IN", "OUT", NULL }, "--hi-fraction" },
	{ "group-size 0", INPUT_VALID, { "roundtrip", "--group-size", "0", "IN", "OUT", NULL }, "--group-size" },
	{ "group-size 12x", INPUT_VALID, { "roundtrip", "--group-size", "12x", "IN", "OUT", NULL }, "--group-size" },
	{ "mode foo", INPUT_VALID, { "roundtrip", "--mode", "foo", "IN", "OUT", NULL }, "--mode" },
	{ "unknown option", INPUT_VALID, { "roundtrip", "--frobnicate", "IN", "OUT", NULL }, "unknown option '--frobnicate'" },
	{ "unknown short option", INPUT_VALID, { "roundtrip", "-x", "IN", "OUT", NULL }, "unknown option '-x'" },
	{ "option without value", INPUT_VALID, { "roundtrip", "IN", "OUT", "--hi-bits", NULL }, "needs a value" },
	{ "flag with value", INPUT_VALID, { "roundtrip", "--no-quantize-values=1", "IN", "OUT", NULL }, "takes no value" },
	{ "no paths", INPUT_VALID, { "roundtrip", NULL }, "wrong number of arguments" },
	{ "one path", INPUT_VALID, { "roundtrip", "IN", NULL }, "wrong number of arguments" },
	{ "three paths", INPUT_VALID, { "roundtrip", "IN", "OUT", "OUT", NULL }, "wrong number of arguments" },
	{ "no command", INPUT_VALID, { NULL }, "missing command" },
	{ "unknown command", INPUT_VALID, { "compress", "IN", "OUT", NULL }, "unknown command 'compress'" },
	{ "unknown top-level option", INPUT_VALID, { "--frobnicate", NULL }, "unknown option" },
};

START_TEST(test_error_exit)
{
	const error_case *test = &error_cases[_i];
	static const char *const only_in[] = { "in.npy", NULL };
	static const char *const nothing[] = { NULL };
	run_result result;

	make_input(test->input);
	run_tool(&result, test->arguments);
	if (result.status != 2 || !strstr(result.err, test->word))
		fprintf(stderr, "case '%s' failed\n", test->name);
	assert_error_line(&result, 2, test->word);
	assert_work_dir_holds(test->input == INPUT_NONE ? nothing : only_in);
	program_output_free(&result);
}
END_TEST

/* An OUT that exists already is left exactly as it was when IN is bad. */
START_TEST(test_error_keeps_existing_output)
{
	static const char *const arguments[] = { ROUNDTRIP_IN_OUT };
	static const char *const in_and_out[] = { "in.npy", "out.npy", NULL };
	char path[PATH_MAX];
	run_result result;
	char *kept;
	size_t size;

	make_input(INPUT_NAN);
	write_file(work_path(path, sizeof(path), "out.npy"), "precious", 8);
	run_tool(&result, arguments);
	assert_error_line(&result, 2, "non-finite");
	kept = file_read_whole(path, &size);
	ck_assert_str_eq(kept, "precious");
	assert_work_dir_holds(in_and_out);
	free(kept);
	program_output_free(&result);
}
END_TEST

/* Failing to write OUT is a runtime failure (1), not a usage error. */
START_TEST(test_unwritable_output)
{
	static const char *const only_in[] = { "in.npy", NULL };
	char out_path[PATH_MAX];
	const char *arguments[] = { "roundtrip", "IN", out_path, NULL };
	run_result result;

	make_input(INPUT_VALID);
	work_path(out_path, sizeof(out_path), "no-such-dir/out.npy");
	run_tool(&result, arguments);
	assert_error_line(&result, 1, "cannot write");
	assert_work_dir_holds(only_in);
	program_output_free(&result);
}
END_TEST

/* A newline in a file name must not split the error into two lines. */
START_TEST(test_error_line_masks_control_characters)
{
	char in_path[PATH_MAX], out_path[PATH_MAX];
	const char *arguments[] = { "roundtrip", in_path, out_path, NULL };
	static const char *const nothing[] = { NULL };
	run_result result;

	work_path(in_path, sizeof(in_path), "in\nsecond line.npy");
	work_path(out_path, sizeof(out_path), "out.npy");
	run_tool(&result, arguments);
	assert_error_line(&result, 2, "in?second line.npy: cannot open: No such file");
	assert_work_dir_holds(nothing);
	program_output_free(&result);
}
END_TEST

/* ---- NumPy interoperability (skipped without numpy) -------------------- */

static bool numpy_available(void)
{
	char *argv[] = { PYTHON, "-c", "import numpy", NULL };
	run_result result;
	bool available;

	if (access(PYTHON, X_OK) != 0)
		return false;
	run_program(&result, argv);
	available = result.status == 0;
	program_output_free(&result);
	return available;
}

START_TEST(test_numpy_reads_output)
{
	static const char make_input_script[] =
		"import sys, numpy as np\n"
		"rng = np.random.default_rng(7)\n"
		"a = (rng.standard_normal((2, 2, 24, 16)) * 3).astype(np.float16)\n"
		"with open(sys.argv[1], 'wb') as f:\n"
		"    np.lib.format.write_array(f, a, version=(2, 0))\n";
	static const char check_output_script[] =
		"import sys, json, numpy as np\n"
		"a = np.load(sys.argv[1])\n"
		"assert a.dtype == np.dtype('<f2'), a.dtype\n"
		"assert a.shape == (2, 2, 24, 16), a.shape\n"
		"assert a.flags.c_contiguous\n"
		"assert np.isfinite(a).all()\n"
		"report = json.loads(sys.argv[3])\n"
		"assert report['shape'] == [2, 2, 24, 16], report\n"
		"assert report['fp16_bytes'] == a.size * 2, report\n"
		"np.save(sys.argv[2], a)\n";
	static const char *const arguments[] = { ROUNDTRIP_IN_OUT };
	char in_path[PATH_MAX], out_path[PATH_MAX], resaved_path[PATH_MAX];
	zc_npy_array input, output, resaved;
	zc_codec_config config;
	zc_block_shape shape = { 2, 2, 24, 16 };
	zc_byte_count bytes;
	zc_strides strides = { 2 * 24 * 16, 24 * 16, 16 };
	uint16_t *expected;
	void *compressed;
	run_result result, python;

	if (!numpy_available()) {
		fprintf(stderr, "tool_test: " PYTHON " cannot import numpy; NumPy test skipped\n");
		return;
	}
	work_path(in_path, sizeof(in_path), "in.npy");
	work_path(out_path, sizeof(out_path), "out.npy");
	work_path(resaved_path, sizeof(resaved_path), "resaved.npy");

	/* NumPy writes IN (format version 2.0); the tool reads it. */
	{
		char *argv[] = { PYTHON, "-c", (char *)make_input_script, in_path, NULL };

		run_program(&python, argv);
		ck_assert_msg(python.status == 0, "python: %s", python.err);
		program_output_free(&python);
	}
	run_tool(&result, arguments);
	ck_assert_msg(result.status == 0, "tool: %s", result.err);

	/* NumPy loads OUT and the JSON, then saves OUT again its own way. */
	{
		char *argv[] = { PYTHON, "-c", (char *)check_output_script, out_path, resaved_path,
				 result.out, NULL };

		run_program(&python, argv);
		ck_assert_msg(python.status == 0, "python: %s", python.err);
		program_output_free(&python);
	}

	/* What NumPy saved is what the tool wrote, and both are the codec's
	 * reconstruction of what NumPy wrote first. */
	ck_assert_int_eq(zc_npy_read_f16(in_path, &input, NULL, 0), 0);
	ck_assert_int_eq(zc_npy_read_f16(out_path, &output, NULL, 0), 0);
	ck_assert_int_eq(zc_npy_read_f16(resaved_path, &resaved, NULL, 0), 0);
	ck_assert_uint_eq(resaved.count, output.count);
	ck_assert_mem_eq(resaved.data, output.data, output.count * sizeof(uint16_t));

	zc_codec_config_default(&config);
	ck_assert_int_eq(zc_block_count_bytes(&config, ZC_TENSOR_KEYS, &shape, &bytes), 0);
	compressed = malloc(bytes.compressed);
	expected = malloc(input.count * sizeof(uint16_t));
	ck_assert_ptr_nonnull(compressed);
	ck_assert_ptr_nonnull(expected);
	ck_assert_int_eq(zc_block_compress(&config, ZC_TENSOR_KEYS, &shape, input.data, compressed,
					   bytes.compressed), (int64_t)bytes.compressed);
	ck_assert_int_eq(zc_block_reconstruct(&config, ZC_TENSOR_KEYS, &shape, compressed,
					      bytes.compressed, expected, &strides), 0);
	ck_assert(memcmp(expected, output.data, input.count * sizeof(uint16_t)) == 0);

	free(expected);
	free(compressed);
	zc_npy_array_free(&input);
	zc_npy_array_free(&output);
	zc_npy_array_free(&resaved);
	program_output_free(&result);
}
END_TEST

/* ---- suite -------------------------------------------------------------- */

static Suite *tool_suite(void)
{
	Suite *suite = suite_create("tool");
	TCase *npy = tcase_create("npy");
	TCase *program = tcase_create("program");
	TCase *errors = tcase_create("errors");
	TCase *numpy = tcase_create("numpy");

	tcase_add_checked_fixture(npy, setup_dirs, teardown_dirs);
	tcase_set_timeout(npy, 120);
	tcase_add_test(npy, test_npy_write_then_read);
	tcase_add_test(npy, test_npy_header_variants);
	tcase_add_test(npy, test_npy_rejects_wrong_rank);
	tcase_add_test(npy, test_npy_rejects_dtype_and_order);
	tcase_add_test(npy, test_npy_rejects_malformed_headers);
	tcase_add_test(npy, test_npy_rejects_oversized_shapes);
	tcase_add_test(npy, test_npy_rejects_bad_files);
	tcase_add_test(npy, test_npy_header_parse_survives_damage);
	tcase_add_test(npy, test_npy_write_is_atomic);
	tcase_add_test(npy, test_npy_strerror);
	suite_add_tcase(suite, npy);

	tcase_add_checked_fixture(program, setup_dirs, teardown_dirs);
	tcase_set_timeout(program, 120);
	tcase_add_test(program, test_roundtrip_one_head_defaults);
	tcase_add_test(program, test_roundtrip_block_keys_options);
	tcase_add_test(program, test_roundtrip_block_values);
	tcase_add_test(program, test_roundtrip_values_unquantized_is_exact);
	tcase_add_test(program, test_roundtrip_empty_block);
	tcase_add_test(program, test_help_and_version);
	suite_add_tcase(suite, program);

	tcase_add_checked_fixture(errors, setup_dirs, teardown_dirs);
	tcase_set_timeout(errors, 120);
	tcase_add_loop_test(errors, test_error_exit, 0,
			    (int)(sizeof(error_cases) / sizeof(error_cases[0])));
	tcase_add_test(errors, test_error_keeps_existing_output);
	tcase_add_test(errors, test_unwritable_output);
	tcase_add_test(errors, test_error_line_masks_control_characters);
	suite_add_tcase(suite, errors);

	tcase_add_checked_fixture(numpy, setup_dirs, teardown_dirs);
	tcase_set_timeout(numpy, 120);
	tcase_add_test(numpy, test_numpy_reads_output);
	suite_add_tcase(suite, numpy);
	return suite;
}

int main(void)
{
	/* Fork mode: a crash in one test (or in the tool's harness) cannot
	 * take the others down, and each gets a fresh process. */
	return suite_main(tool_suite(), CK_FORK);
}
