/*
 * The expected state of a zipcached session, built from the codec's public
 * API alone, for the suites that check a real daemon bit for bit
 * (tests/service_test.c, tests/reliability_test.c).
 *
 * The model forms blocks the way the specification says the daemon does:
 * per_call compresses each update as one block; streaming compresses a
 * block of at least R tokens alone after flushing the residual, and keeps
 * shorter ones exact in the residual until it holds R tokens and is
 * compressed as one block. Views must equal the model bit for bit, and the
 * byte accounting must be the seed's formulas over the model's blocks.
 *
 * The comparing helpers never call ck_assert: they write a sentence into
 * `why` and return false, so helper processes forked by a test may use
 * them too; CHECK() turns the verdict into an assertion in the test
 * process. A codec failure inside the model aborts (model_abort).
 */
#ifndef ZIPCACHE_TESTS_LAYER_MODEL_H
#define ZIPCACHE_TESTS_LAYER_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon_harness.h"
#include "zipcache/client.h"
#include "zipcache/codec.h"

/* The daemon's streaming threshold when a session asks for none. */
#define MODEL_DEFAULT_RESIDUAL_TOKENS 128u

/* Room for the sentence a failed check writes. */
#define WHY_BYTES 2048

/* Runs a bool helper that explains itself and asserts on its verdict
 * (needs <check.h>). */
#define CHECK(helper, ...)                                                      \
	do {                                                                    \
		char why_[WHY_BYTES] = "(no reason given)";                     \
		bool ok_ = helper(__VA_ARGS__, why_, sizeof(why_));             \
		ck_assert_msg(ok_, "%s", why_);                                 \
	} while (0)

/* ---- failure messages ------------------------------------------------------ */

/* Writes a sentence into why and returns false. */
bool fail_with(char *why, size_t size, const char *format, ...)
	__attribute__((format(printf, 3, 4)));

/* Explains on stderr and aborts: the model cannot go on after a codec
 * failure, and in a helper process the abort shows in the exit status. */
void model_abort(const char *format, ...) __attribute__((format(printf, 1, 2), noreturn));

/* calloc that never returns NULL (aborts instead); 0 bytes gives 1. */
void *allocate(size_t bytes);

/* ---- deterministic data ------------------------------------------------------ */

/* Fixed seeds, so a failure reproduces exactly. */
struct rng {
	uint64_t state;
};

void rng_seed(struct rng *rng, uint64_t seed);
uint64_t rng_next(struct rng *rng);
uint32_t rng_below(struct rng *rng, uint32_t bound);
double rng_normal(struct rng *rng);

/* ---- the model of a session ----------------------------------------------- */

struct model_block {
	uint32_t first_token;
	uint32_t tokens;          /* tokens it was compressed with (trim keeps it whole) */
	bool flushed;             /* made from the residual (model_flush) */
	zc_byte_count key, value;
};

struct model_layer {
	/* Both in the view's [batch][kv_heads][max_tokens][D] layout. */
	uint16_t *exact_keys, *exact_values; /* the tokens as they were sent */
	uint16_t *keys, *values;             /* what the view must show */
	uint32_t tokens;
	uint32_t residual;                   /* newest tokens still exact */
	struct model_block *blocks;
	size_t n_blocks, capacity;
};

struct model {
	uint32_t layers, batch, kv_heads, head_dim_k, head_dim_v, max_tokens;
	zc_codec_config codec;
	bool per_call;
	uint32_t residual_threshold;
	uint32_t residual_capacity;          /* the daemon's: 2R, at most max_tokens */
	struct model_layer *layer;
};

void model_init(struct model *model, const zc_session_config *config);
void model_free(struct model *model);
/* A fork of source at `tokens` (its own copy, freed with model_free). */
void model_fork(struct model *fork, const struct model *source, uint32_t tokens);

/* The view layout's strides for a head dimension. */
zc_strides model_strides(const struct model *model, uint32_t dim);

/* Whether an update of `tokens` goes straight into a block of its own. */
bool model_direct(const struct model *model, uint32_t tokens);

/* The whole residual becomes one block, compressed from the exact tokens. */
void model_flush(struct model *model, uint32_t layer);

/*
 * The layer as it is while the daemon has not yet published the deferred
 * flush that made its last block (an update that asked for no stats
 * filled the residual; the flush runs after the reply): that block's
 * rows back in the residual, exact. False, and nothing changed, when the
 * last block is not a whole flushed residual.
 */
bool model_unpublish_last_flush(struct model *model, uint32_t layer);

/*
 * A short streaming update up to, not including, the flush it may cause:
 * the state a crash between publishing the tokens and compressing the
 * residual leaves behind. The daemon flushes a residual that cannot take
 * the block first (only possible after such a crash).
 */
void model_append_exact(struct model *model, uint32_t layer, uint32_t tokens,
			const uint16_t *keys, const uint16_t *values);

/*
 * What the daemon must do with an update: the code it must answer, and on
 * success the new state. Inputs are finite here (the tests that send NaN
 * expect a refusal without asking the model).
 */
int model_update(struct model *model, uint32_t layer, uint32_t tokens, const uint16_t *keys,
		 const uint16_t *values);

/*
 * Trim as specified: the residual's tail goes first; past it, blocks that
 * start at or after the new end are dropped whole, and a block cut in the
 * middle stays (its kept prefix unchanged). Returns what the most-cut
 * layer lost.
 */
uint32_t model_trim(struct model *model, uint32_t tokens);

/* The same for one layer; returns what it lost. */
uint32_t model_trim_layer(struct model *model, uint32_t layer, uint32_t tokens);

/* The seed's accounting: blocks as stored, plus the residual as the fp16
 * it really is (its baseline is that of the block it will become). */
void model_layer_stats(const struct model *model, uint32_t layer, zc_layer_stats *out);
void model_total_stats(const struct model *model, zc_layer_stats *out);

/* ---- comparing the daemon with the model ------------------------------------ */

/* The view's geometry, strides and every readable element. */
bool view_matches(const struct model *model, uint32_t layer, const zc_view *view, char *why,
		  size_t size);

/* Every counter exactly, the two ratios to 1e-9 relative; the layer field
 * only when compare_layer (totals have none). */
bool stats_match(const char *what, const zc_layer_stats *got, const zc_layer_stats *want,
		 bool compare_layer, char *why, size_t size);

/* Every layer's view (through this session's mapping) and the daemon's
 * per-layer and total accounting, against the model. */
bool session_matches(zc_session *session, const struct model *model, char *why, size_t size);

/* session_matches, also accepting, for any of the layers, the state with
 * its last deferred flush not yet published (model_unpublish_last_flush):
 * what a daemon killed before the publish leaves (the tokens are all
 * there, exact). The first model tried is the model as given. On a match
 * *unpublished (may be NULL) gets the layers so found (bit i: layer i):
 * a test that goes on from here must unpublish them in its model too, or
 * a later trim through those rows (exact in the daemon's residual, one
 * block in the model) tells them apart. */
bool session_matches_after_crash(zc_session *session, const struct model *model,
				 uint32_t *unpublished, char *why, size_t size);

/* After a restart: of the n sessions named by configs, exactly those with
 * exists[i] are on the daemon, and each (attached) equals models[i] (or
 * models[i] with deferred flushes unpublished: session_matches_after_crash,
 * whose layers go to unpublished[i] when it is not NULL). */
bool daemon_sessions_match(zc_client *client, const zc_session_config *configs,
			   const struct model *models, const bool *exists, int n,
			   uint32_t *unpublished, char *why, size_t size);

/* Whether a call's code means no reply came: the daemon is gone (killed,
 * or dead of an injected fault), not that it refused. */
bool daemon_lost(int rc);

/* ---- blocks and checked updates -------------------------------------------- */

/* K/V of one update, contiguous [batch * kv_heads][tokens][D]. */
struct block {
	uint32_t tokens;
	uint16_t *keys, *values;
	size_t key_elements, value_elements;
};

/* Fresh K/V that look like a model's: a few loud channels and now and
 * then a loud token, so saliency has something to find. */
void block_make_shape(struct block *block, uint32_t heads, uint32_t head_dim_k,
		      uint32_t head_dim_v, uint32_t tokens, struct rng *rng);

/* block_make_shape() in the model's geometry. */
void block_make(struct block *block, const struct model *model, uint32_t tokens,
		struct rng *rng);

void block_free(struct block *block);

/*
 * One update through the client with a block already made, checked: the
 * code the model expects; on success the view it filled (with an even
 * sequence) and the stats it returned equal the model; on a refusal the
 * daemon said why and the session is unchanged. view_out and stats_out may
 * be NULL.
 */
bool update_block_checked(zc_client *client, zc_session *session, struct model *model,
			  uint32_t layer, const struct block *block, zc_view *view_out,
			  zc_layer_stats *stats_out, char *why, size_t size);

/* update_block_checked() with a fresh block of `tokens`. */
bool update_checked(zc_client *client, zc_session *session, struct model *model,
		    struct rng *rng, uint32_t layer, uint32_t tokens, char *why, size_t size);

/* A trim through the client: the count the model expects, then the session. */
bool trim_checked(zc_client *client, zc_session *session, struct model *model, uint32_t tokens,
		  char *why, size_t size);

/* ---- the client in the test process (Check asserts) ---------------------- */

/* Replies wait at most this long; a daemon that hangs fails the call. */
#define CLIENT_TIMEOUT_MS 20000

zc_client *connect_client(const struct daemon_harness *daemon);

/* A daemon and one client of it: most integration suites' fixture. */
struct service {
	struct daemon_harness daemon;
	zc_client *client;
};

void service_start(struct service *service, const char *const *extra_args);
void service_stop(struct service *service);

/* service_start() with /metrics on a free loopback port (returned). */
uint16_t service_start_metrics(struct service *service, const char *const *extra_args);

/* A session config with every shape field given, the default codec and
 * views = full. */
zc_session_config shaped_config(const char *name, uint32_t layers, uint32_t batch,
				uint32_t kv_heads, uint32_t head_dim_k, uint32_t head_dim_v,
				uint32_t max_tokens, zc_block_policy policy, uint32_t residual_tokens);
zc_session *open_session(zc_client *client, const zc_session_config *config);

/* A streaming session's config with the default codec: batch 1, head_dim
 * for K and V, residual_tokens 0 for the daemon's default. */
zc_session_config streaming_config(const char *name, uint32_t layers, uint32_t kv_heads,
				   uint32_t head_dim, uint32_t max_tokens, uint32_t residual_tokens);

/* The call was refused with `expected`, and the daemon's sentence says
 * what was wrong (it mentions `needle`). */
void assert_refused(zc_client *client, int rc, int expected, const char *needle,
		    const char *what);

#endif
