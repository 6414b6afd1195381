/*
 * zipcache-demo: drives a synthetic 32-layer, 8-KV-head, 128-dim model
 * through a 2048-token prefill and 256 decode steps against a running
 * zipcached, and prints per-layer and total byte accounting.
 *
 *   zipcache-demo --socket PATH [--layers N] [--prefill N] [--decode N]
 *                 [--policy streaming|per_call]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "zipcache/client.h"

struct demo_options {
	const char *socket;
	uint32_t layers, kv_heads, head_dim, prefill, decode;
	zc_block_policy policy;
};

static uint64_t random_state = 0x2545f4914f6cdd1dull;

static double random_normal(void)
{
	/* xorshift64* for two uniforms, Box-Muller for a normal. */
	double u[2];
	for (int i = 0; i < 2; i++) {
		random_state ^= random_state >> 12;
		random_state ^= random_state << 25;
		random_state ^= random_state >> 27;
		u[i] = ((random_state * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
	}
	return sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]);
}

/* Keys look like real ones: a few large channels and a heavy first token. */
static void fill_block(uint16_t *keys, uint16_t *values, uint32_t heads, uint32_t tokens,
		       uint32_t dim, uint32_t first_token)
{
	for (uint32_t h = 0; h < heads; h++) {
		for (uint32_t t = 0; t < tokens; t++) {
			for (uint32_t d = 0; d < dim; d++) {
				size_t i = ((size_t)h * tokens + t) * dim + d;
				double k = random_normal();
				if (d % 32 == 5)
					k *= 8.0;
				if (first_token + t == 0)
					k *= 4.0;
				keys[i] = zc_float_to_fp16((float)k);
				values[i] = zc_float_to_fp16((float)random_normal());
			}
		}
	}
}

static int parse_options(int argc, char **argv, struct demo_options *o)
{
	*o = (struct demo_options){ NULL, 32, 8, 128, 2048, 256, ZC_POLICY_STREAMING };
	for (int i = 1; i < argc; i++) {
		const char *value = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(argv[i], "--help") == 0) {
			printf("usage: %s --socket PATH [--layers N] [--prefill N] [--decode N] "
			       "[--policy streaming|per_call]\n", argv[0]);
			exit(0);
		}
		if (!value) {
			fprintf(stderr, "zipcache-demo: %s needs a value\n", argv[i]);
			return -1;
		}
		if (strcmp(argv[i], "--socket") == 0)
			o->socket = value;
		else if (strcmp(argv[i], "--layers") == 0)
			o->layers = (uint32_t)strtoul(value, NULL, 10);
		else if (strcmp(argv[i], "--prefill") == 0)
			o->prefill = (uint32_t)strtoul(value, NULL, 10);
		else if (strcmp(argv[i], "--decode") == 0)
			o->decode = (uint32_t)strtoul(value, NULL, 10);
		else if (strcmp(argv[i], "--policy") == 0 && strcmp(value, "per_call") == 0)
			o->policy = ZC_POLICY_PER_CALL;
		else if (strcmp(argv[i], "--policy") == 0 && strcmp(value, "streaming") == 0)
			o->policy = ZC_POLICY_STREAMING;
		else {
			fprintf(stderr, "zipcache-demo: unknown option %s\n", argv[i]);
			return -1;
		}
		i++;
	}
	if (!o->socket || o->layers == 0 || o->prefill == 0) {
		fprintf(stderr, "zipcache-demo: --socket PATH is required (see --help)\n");
		return -1;
	}
	return 0;
}

static void print_row(const char *label, const zc_layer_stats *s)
{
	double value_ratio = s->compressed_value_bytes ?
				     (double)s->fp16_value_bytes / (double)s->compressed_value_bytes : 0;
	printf("%-6s %7u %9u %13llu %13llu %13llu %8.2fx %7.2f %8.2fx\n", label, s->tokens,
	       s->residual_tokens, (unsigned long long)s->fp16_key_bytes,
	       (unsigned long long)s->compressed_key_bytes, (unsigned long long)s->baseline_key_bytes,
	       s->compression_ratio, s->effective_avg_bits, value_ratio);
}

int main(int argc, char **argv)
{
	struct demo_options o;
	zc_client *client;
	zc_session *session;
	zc_session_config config;
	zc_view view;
	int rc;

	if (parse_options(argc, argv, &o) < 0)
		return 2;
	rc = zc_client_connect(o.socket, 5000, &client);
	if (rc < 0) {
		fprintf(stderr, "zipcache-demo: cannot connect to %s: %s\n", o.socket, zc_strerror(rc));
		return 1;
	}
	zc_session_config_default(&config);
	char name[64];
	snprintf(name, sizeof(name), "zipcache-demo-%d", (int)getpid());
	config.name = name;
	config.layers = o.layers;
	config.kv_heads = o.kv_heads;
	config.head_dim_k = config.head_dim_v = o.head_dim;
	config.max_tokens = o.prefill + o.decode;
	config.policy = o.policy;
	rc = zc_session_open(client, &config, &session);
	if (rc < 0) {
		fprintf(stderr, "zipcache-demo: open failed: %s (%s)\n", zc_strerror(rc),
			zc_client_last_error(client));
		zc_client_close(client);
		return 1;
	}

	size_t block = (size_t)o.kv_heads * o.prefill * o.head_dim;
	uint16_t *keys = malloc(block * 2), *values = malloc(block * 2);
	if (!keys || !values) {
		fprintf(stderr, "zipcache-demo: out of memory\n");
		return 1;
	}
	for (uint32_t layer = 0; layer < o.layers && rc == 0; layer++) {
		fill_block(keys, values, o.kv_heads, o.prefill, o.head_dim, 0);
		rc = zc_update_and_fetch(session, layer, o.prefill, keys, values, &view, NULL);
	}
	for (uint32_t step = 0; step < o.decode && rc == 0; step++) {
		for (uint32_t layer = 0; layer < o.layers && rc == 0; layer++) {
			fill_block(keys, values, o.kv_heads, 1, o.head_dim, o.prefill + step);
			rc = zc_update_and_fetch(session, layer, 1, keys, values, &view, NULL);
		}
	}
	if (rc < 0) {
		fprintf(stderr, "zipcache-demo: update_and_fetch failed: %s (%s)\n", zc_strerror(rc),
			zc_client_last_error(client));
		return 1;
	}

	zc_layer_stats *layers = calloc(o.layers, sizeof(*layers)), total;
	rc = zc_session_stats(session, layers, o.layers, &total);
	if (rc < 0) {
		fprintf(stderr, "zipcache-demo: stats failed: %s\n", zc_strerror(rc));
		return 1;
	}
	printf("zipcache-demo: %u layers x %u KV heads x %u dims, %u-token prefill + %u decode steps, "
	       "%s policy\n\n", o.layers, o.kv_heads, o.head_dim, o.prefill, o.decode,
	       o.policy == ZC_POLICY_PER_CALL ? "per_call" : "streaming");
	printf("%-6s %7s %9s %13s %13s %13s %9s %7s %9s\n", "layer", "tokens", "residual",
	       "fp16 K B", "stored K B", "baseline K B", "K ratio", "K bits", "V ratio");
	for (uint32_t i = 0; i < o.layers; i++) {
		char label[16];
		snprintf(label, sizeof(label), "%u", i);
		print_row(label, &layers[i]);
	}
	print_row("total", &total);
	printf("\nkeys: %.2f MiB stored for %.2f MiB of fp16 (%.2fx); values: %.2f MiB for %.2f MiB\n",
	       total.compressed_key_bytes / 1048576.0, total.fp16_key_bytes / 1048576.0,
	       total.compression_ratio, total.compressed_value_bytes / 1048576.0,
	       total.fp16_value_bytes / 1048576.0);
	free(layers);
	free(keys);
	free(values);
	zc_session_close(session);
	zc_client_close(client);
	return 0;
}
