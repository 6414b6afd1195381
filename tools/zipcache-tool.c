/*
 * zipcache-tool: runs the codec on .npy files, so a config can be tried on
 * a real K/V dump and the codec can be checked from outside (scripts,
 * NumPy) without a daemon.
 *
 *   zipcache-tool roundtrip [options] IN.npy OUT.npy
 *
 * compresses IN, reconstructs it into OUT and prints the byte accounting
 * as one JSON object on one line of standard output. Every error is one
 * line "zipcache-tool: <what is wrong>" on standard error; OUT is only
 * ever created complete (see zc_npy_write_f16()).
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "failure.h"
#include "npy.h"
#include "zipcache/codec.h"
#include "zipcache/error.h"

#define TOOL_NAME "zipcache-tool"
#define TOOL_VERSION "0.1.0"

/* Scripts tell "you gave me something wrong" (2) from "something broke
 * while running" (1). */
enum tool_exit {
	TOOL_EXIT_OK = 0,
	TOOL_EXIT_FAILURE = 1,
	TOOL_EXIT_USAGE = 2
};

static void tool_usage(FILE *stream)
{
	fprintf(stream,
		"usage: " TOOL_NAME " roundtrip [options] IN.npy OUT.npy\n"
		"       " TOOL_NAME " --help | --version\n"
		"\n"
		"roundtrip compresses a float16 .npy array of shape [S, D] (one head) or\n"
		"[B, H, S, D] with the zipcache codec, writes the reconstruction to OUT.npy\n"
		"(same shape and dtype) and prints the byte accounting as one JSON object.\n"
		"\n"
		"options:\n"
		"  --mode keys|values     tensor kind (default keys)\n"
		"  --hi-bits N            bits for salient key tokens and all values, 1..8 (default %d)\n"
		"  --lo-bits N            bits for the other key tokens, 1..8 (default %d)\n"
		"  --hi-fraction F        fraction of key tokens that are salient, 0..1 (default %g)\n"
		"  --group-size N         token rows per quantization group, >= 1 (default %d)\n"
		"  --no-quantize-values   values mode: keep values as exact fp16\n"
		"  -h, --help             show this help\n"
		"\n"
		"exit status: 0 success; 1 failure while running (out of memory, cannot\n"
		"write OUT); 2 bad input, option or usage. Errors are one line on stderr.\n",
		ZC_DEFAULT_HI_BITS, ZC_DEFAULT_LO_BITS, ZC_DEFAULT_HI_FRACTION,
		ZC_DEFAULT_GROUP_SIZE);
}

/* "zipcache-tool: <message>", one line; see failure_print(). */
__attribute__((format(printf, 2, 3)))
static int tool_fail(int status, const char *format, ...)
{
	va_list arguments;

	va_start(arguments, format);
	status = failure_print(TOOL_NAME, status, format, arguments);
	va_end(arguments);
	return status;
}

/* ---- option parsing ---------------------------------------------------- */

typedef struct roundtrip_options {
	zc_codec_config config;
	zc_tensor tensor;
	const char *input_path;
	const char *output_path;
} roundtrip_options;

enum roundtrip_option_id {
	OPTION_MODE,
	OPTION_HI_BITS,
	OPTION_LO_BITS,
	OPTION_HI_FRACTION,
	OPTION_GROUP_SIZE,
	OPTION_NO_QUANTIZE_VALUES
};

static const struct roundtrip_option {
	const char *name;
	enum roundtrip_option_id id;
	bool takes_value;
} roundtrip_option_table[] = {
	{ "--mode", OPTION_MODE, true },
	{ "--hi-bits", OPTION_HI_BITS, true },
	{ "--lo-bits", OPTION_LO_BITS, true },
	{ "--hi-fraction", OPTION_HI_FRACTION, true },
	{ "--group-size", OPTION_GROUP_SIZE, true },
	{ "--no-quantize-values", OPTION_NO_QUANTIZE_VALUES, false },
};

/* strtol() skips leading white space and accepts an empty string as 0;
 * neither is a number a user meant, so both are refused here. */
static int parse_integer(const char *name, const char *text, long minimum, long maximum,
			 int *value)
{
	char *end;
	long parsed;

	errno = 0;
	parsed = strtol(text, &end, 10);
	if (text[0] == '\0' || !(text[0] == '-' || text[0] == '+' || (text[0] >= '0' && text[0] <= '9')) ||
	    *end != '\0' || errno == ERANGE || parsed < minimum || parsed > maximum) {
		if (maximum == INT_MAX)
			tool_fail(TOOL_EXIT_USAGE, "%s: '%s' is not an integer >= %ld", name, text,
				  minimum);
		else
			tool_fail(TOOL_EXIT_USAGE, "%s: '%s' is not an integer in %ld..%ld", name,
				  text, minimum, maximum);
		return -EINVAL;
	}
	*value = (int)parsed;
	return 0;
}

static int parse_fraction(const char *name, const char *text, double *value)
{
	char *end;
	double parsed;

	errno = 0;
	parsed = strtod(text, &end);
	/* "nan" parses, and fails the range test because every comparison
	 * with NaN is false. */
	if (text[0] == '\0' || text[0] == ' ' || text[0] == '\t' || text[0] == '\n' ||
	    *end != '\0' || errno == ERANGE || !(parsed >= 0.0 && parsed <= 1.0)) {
		tool_fail(TOOL_EXIT_USAGE, "%s: '%s' is not a number in [0, 1]", name, text);
		return -EINVAL;
	}
	*value = parsed;
	return 0;
}

static int roundtrip_apply_option(roundtrip_options *options, const struct roundtrip_option *option,
				  const char *value)
{
	switch (option->id) {
	case OPTION_MODE:
		if (strcmp(value, "keys") == 0) {
			options->tensor = ZC_TENSOR_KEYS;
		} else if (strcmp(value, "values") == 0) {
			options->tensor = ZC_TENSOR_VALUES;
		} else {
			tool_fail(TOOL_EXIT_USAGE, "--mode: '%s' is not keys or values", value);
			return -EINVAL;
		}
		return 0;
	case OPTION_HI_BITS:
		return parse_integer(option->name, value, 1, 8, &options->config.hi_bits);
	case OPTION_LO_BITS:
		return parse_integer(option->name, value, 1, 8, &options->config.lo_bits);
	case OPTION_HI_FRACTION:
		return parse_fraction(option->name, value, &options->config.hi_fraction);
	case OPTION_GROUP_SIZE:
		return parse_integer(option->name, value, 1, INT_MAX, &options->config.group_size);
	case OPTION_NO_QUANTIZE_VALUES:
		options->config.quantize_values = false;
		return 0;
	}
	return -EINVAL;
}

/*
 * Options may come before, between or after the two paths, as
 * "--name value" or "--name=value"; "--" ends them, so a path may start
 * with '-'. Sets *help_shown instead of parsing further on --help.
 */
static int roundtrip_parse(int argc, char **argv, roundtrip_options *options, bool *help_shown)
{
	const char *paths[2] = { NULL, NULL };
	int path_count = 0;
	bool options_ended = false;

	*help_shown = false;
	memset(options, 0, sizeof(*options));
	zc_codec_config_default(&options->config);
	options->tensor = ZC_TENSOR_KEYS;

	for (int i = 0; i < argc; i++) {
		const char *argument = argv[i];
		const struct roundtrip_option *option = NULL;
		const char *equals;
		const char *value;
		size_t name_length;

		if (options_ended || argument[0] != '-' || argument[1] == '\0') {
			if (path_count < 2)
				paths[path_count] = argument;
			path_count++;
			continue;
		}
		if (strcmp(argument, "--") == 0) {
			options_ended = true;
			continue;
		}
		if (strcmp(argument, "--help") == 0 || strcmp(argument, "-h") == 0) {
			tool_usage(stdout);
			*help_shown = true;
			return 0;
		}
		equals = strchr(argument, '=');
		name_length = equals ? (size_t)(equals - argument) : strlen(argument);
		for (size_t k = 0; k < sizeof(roundtrip_option_table) / sizeof(roundtrip_option_table[0]); k++) {
			if (strlen(roundtrip_option_table[k].name) == name_length &&
			    memcmp(roundtrip_option_table[k].name, argument, name_length) == 0)
				option = &roundtrip_option_table[k];
		}
		if (!option) {
			tool_fail(TOOL_EXIT_USAGE, "unknown option '%.*s'; try '" TOOL_NAME " --help'",
				  (int)name_length, argument);
			return -EINVAL;
		}
		if (!option->takes_value) {
			if (equals) {
				tool_fail(TOOL_EXIT_USAGE, "option %s takes no value", option->name);
				return -EINVAL;
			}
			value = NULL;
		} else if (equals) {
			value = equals + 1;
		} else if (i + 1 < argc) {
			value = argv[++i];
		} else {
			tool_fail(TOOL_EXIT_USAGE, "option %s needs a value", option->name);
			return -EINVAL;
		}
		if (roundtrip_apply_option(options, option, value) < 0)
			return -EINVAL;
	}

	if (path_count != 2) {
		tool_fail(TOOL_EXIT_USAGE,
			  "wrong number of arguments: roundtrip takes IN.npy OUT.npy, got %d path%s",
			  path_count, path_count == 1 ? "" : "s");
		return -EINVAL;
	}
	options->input_path = paths[0];
	options->output_path = paths[1];
	return 0;
}

/* ---- the roundtrip ----------------------------------------------------- */

/* "[2,3,64,128]", the shape as the input file gave it. */
static void format_shape(const zc_npy_array *array, char *out, size_t out_size)
{
	size_t used = 0;

	used += (size_t)snprintf(out, out_size, "[");
	for (int i = 0; i < array->rank && used < out_size; i++)
		used += (size_t)snprintf(out + used, out_size - used, "%s%" PRIu64,
					 i == 0 ? "" : ",", array->shape[i]);
	if (used < out_size)
		snprintf(out + used, out_size - used, "]");
}

/* An [S, D] array is one head: B = H = 1. */
static int block_shape_from_array(const zc_npy_array *array, zc_block_shape *shape)
{
	uint64_t dimensions[4] = { 1, 1, 0, 0 };

	if (array->rank == 2) {
		dimensions[2] = array->shape[0];
		dimensions[3] = array->shape[1];
	} else {
		memcpy(dimensions, array->shape, sizeof(dimensions));
	}
	for (int i = 0; i < 4; i++)
		if (dimensions[i] > UINT32_MAX)
			return ZC_ESHAPE;
	shape->batch = (uint32_t)dimensions[0];
	shape->heads = (uint32_t)dimensions[1];
	shape->tokens = (uint32_t)dimensions[2];
	shape->head_dim = (uint32_t)dimensions[3];
	return 0;
}

/* JSON has no NaN: a ratio over an empty block (S = 0) is null. */
static void format_ratio(double numerator, double denominator, char *out, size_t out_size)
{
	if (denominator == 0.0)
		snprintf(out, out_size, "null");
	else
		snprintf(out, out_size, "%.17g", numerator / denominator);
}

static int roundtrip_run(const roundtrip_options *options)
{
	const zc_codec_config *config = &options->config;
	zc_npy_array input;
	zc_block_shape shape;
	zc_byte_count count;
	zc_strides strides;
	void *compressed = NULL;
	uint16_t *output = NULL;
	char detail[512];
	char shape_text[160];
	char ratio_text[40], bits_text[40];
	char json[1024];
	int64_t written;
	int status;
	int result;

	result = zc_npy_read_f16(options->input_path, &input, detail, sizeof(detail));
	if (result < 0) {
		status = tool_fail(result == -ENOMEM ? TOOL_EXIT_FAILURE : TOOL_EXIT_USAGE, "%s: %s",
				   options->input_path, detail);
		goto free_input;
	}
	format_shape(&input, shape_text, sizeof(shape_text));
	result = block_shape_from_array(&input, &shape);
	if (result == 0)
		result = zc_block_count_bytes(config, options->tensor, &shape, &count);
	if (result < 0) {
		status = tool_fail(TOOL_EXIT_USAGE, "%s: shape %s not accepted by the codec: %s",
				   options->input_path, shape_text, zc_strerror(result));
		goto free_input;
	}
	if (count.compressed > SIZE_MAX) {
		status = tool_fail(TOOL_EXIT_FAILURE, "%s: compressed form of %" PRIu64 " bytes does not fit in memory",
				   options->input_path, count.compressed);
		goto free_input;
	}

	/* malloc(0) may return NULL; an empty block still needs a pointer. */
	compressed = malloc(count.compressed > 0 ? (size_t)count.compressed : 1);
	if (!compressed) {
		status = tool_fail(TOOL_EXIT_FAILURE, "out of memory for %" PRIu64 " compressed bytes",
				   count.compressed);
		goto free_input;
	}
	written = zc_block_compress(config, options->tensor, &shape, input.data, compressed,
				    (size_t)count.compressed);
	if (written == ZC_ENONFINITE) {
		status = tool_fail(TOOL_EXIT_USAGE,
				   "%s: input contains non-finite values (NaN or Inf); the codec accepts only finite numbers",
				   options->input_path);
		goto free_compressed;
	}
	if (written < 0) {
		status = tool_fail(TOOL_EXIT_FAILURE, "%s: compression failed: %s",
				   options->input_path, zc_strerror((int)written));
		goto free_compressed;
	}
	if ((uint64_t)written != count.compressed) {
		status = tool_fail(TOOL_EXIT_FAILURE,
				   "internal error: the codec wrote %" PRId64 " bytes but counts %" PRIu64,
				   written, count.compressed);
		goto free_compressed;
	}

	output = malloc(input.count > 0 ? input.count * sizeof(uint16_t) : sizeof(uint16_t));
	if (!output) {
		status = tool_fail(TOOL_EXIT_FAILURE, "out of memory for the reconstruction");
		goto free_compressed;
	}
	strides.token = shape.head_dim;
	strides.head = (size_t)shape.tokens * shape.head_dim;
	strides.batch = strides.head * shape.heads;
	result = zc_block_reconstruct(config, options->tensor, &shape, compressed,
				      (size_t)count.compressed, output, &strides);
	if (result < 0) {
		status = tool_fail(TOOL_EXIT_FAILURE, "%s: reconstruction failed: %s",
				   options->input_path, zc_strerror(result));
		goto free_output;
	}

	format_ratio((double)count.fp16, (double)count.compressed, ratio_text, sizeof(ratio_text));
	format_ratio(16.0 * (double)count.compressed, (double)count.fp16, bits_text, sizeof(bits_text));
	snprintf(json, sizeof(json),
		 "{\"compressed_bytes\":%" PRIu64 ",\"baseline_bytes\":%" PRIu64
		 ",\"fp16_bytes\":%" PRIu64 ",\"compression_ratio\":%s,\"effective_avg_bits\":%s"
		 ",\"n_hi\":%" PRIu32 ",\"mode\":\"%s\",\"shape\":%s,\"isa\":\"%s\"}\n",
		 count.compressed, count.baseline, count.fp16, ratio_text, bits_text,
		 zc_codec_salient_tokens(config, options->tensor, shape.tokens),
		 options->tensor == ZC_TENSOR_KEYS ? "keys" : "values", shape_text,
		 zc_isa_name(zc_codec_isa()));

	/* The file first: if it cannot be written, stdout stays empty. */
	result = zc_npy_write_f16(options->output_path, input.rank, input.shape, output);
	if (result < 0) {
		status = tool_fail(TOOL_EXIT_FAILURE, "%s: cannot write: %s", options->output_path,
				   zc_npy_strerror(result));
		goto free_output;
	}
	if (fputs(json, stdout) == EOF || fflush(stdout) == EOF) {
		status = tool_fail(TOOL_EXIT_FAILURE, "cannot write to standard output: %s",
				   strerror(errno));
		goto free_output;
	}
	status = TOOL_EXIT_OK;

free_output:
	free(output);
free_compressed:
	free(compressed);
free_input:
	zc_npy_array_free(&input);
	return status;
}

static int roundtrip_main(int argc, char **argv)
{
	roundtrip_options options;
	bool help_shown;

	if (roundtrip_parse(argc, argv, &options, &help_shown) < 0)
		return TOOL_EXIT_USAGE;
	if (help_shown)
		return TOOL_EXIT_OK;
	/* The parser checked every field; this catches a codec whose limits
	 * have moved away from the ones above. */
	int result = zc_codec_config_validate(&options.config);
	if (result < 0)
		return tool_fail(TOOL_EXIT_USAGE, "invalid codec configuration: %s", zc_strerror(result));
	zc_codec_init();
	return roundtrip_run(&options);
}

int main(int argc, char **argv)
{
	const char *command;

	if (argc < 2)
		return tool_fail(TOOL_EXIT_USAGE, "missing command; try '" TOOL_NAME " --help'");
	command = argv[1];
	if (strcmp(command, "--help") == 0 || strcmp(command, "-h") == 0) {
		tool_usage(stdout);
		return TOOL_EXIT_OK;
	}
	if (strcmp(command, "--version") == 0) {
		printf(TOOL_NAME " " TOOL_VERSION "\n");
		return TOOL_EXIT_OK;
	}
	if (strcmp(command, "roundtrip") == 0)
		return roundtrip_main(argc - 2, argv + 2);
	if (command[0] == '-')
		return tool_fail(TOOL_EXIT_USAGE, "unknown option '%s'; try '" TOOL_NAME " --help'",
				 command);
	return tool_fail(TOOL_EXIT_USAGE, "unknown command '%s'; try '" TOOL_NAME " --help'",
			 command);
}
