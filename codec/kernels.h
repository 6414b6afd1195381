/*
 * The codec's inner loops, one table per ISA. block.c orchestrates; a
 * kernel only ever sees rows of one head matrix and one group's params.
 * Every table must produce bit-identical results: docs/CODEC.md fixes
 * the order of every floating-point operation, and the tests compare the
 * tables against each other.
 *
 * Params (fp16 scales and mins) live inside the payload at any byte
 * offset, so kernels take them as bytes and load them unaligned.
 */
#ifndef ZIPCACHE_KERNELS_H
#define ZIPCACHE_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Where group_encode also writes the rows' reconstruction: row r of the
 * call at at + rows[r]*token_stride. stream: whole rows may be written
 * with non-temporal stores (every row on cache lines, a block too large
 * to be read back from cache, codec_views_stream()); the caller fences
 * them before the view is read. */
struct codec_view {
	uint16_t *at;
	size_t token_stride;
	bool stream;
};

struct codec_kernels {
	const char *name;
	/* ZC_ENONFINITE if any of the n values is NaN or Inf, else 0. */
	int (*check_finite)(const uint16_t *values, size_t n);
	/* L2 norm of each of n_rows contiguous rows of dim values; returns
	 * ZC_ENONFINITE (norms then undefined) on NaN or Inf. */
	int (*row_norms)(const uint16_t *rows, size_t n_rows, size_t dim, float *norms);
	/* Per channel over the listed rows of one group: fp16 scale and min. */
	void (*group_params)(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			     size_t dim, int bits, uint8_t *scales, uint8_t *mins);
	/* One code byte per element of the listed rows: codes[r*dim + c]. */
	void (*group_quantize)(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			       size_t dim, int bits, const uint8_t *scales,
			       const uint8_t *mins, uint8_t *codes);
	/* Appends n codes of `bits` bits at bit_offset of a stream whose bytes
	 * before bit_offset are final and whose end is stream_end. */
	void (*pack)(uint8_t *stream, const uint8_t *stream_end, size_t bit_offset,
		     const uint8_t *codes, size_t n, int bits);
	/* Optional (NULL: group_quantize + pack): quantizes and packs the
	 * listed rows of one group straight into the stream, row r's codes at
	 * byte codes + r*dim*bits/8. Only called when dim*bits is a multiple
	 * of 8, with the scales and mins that group_params computed from the
	 * same rows; writes exactly n_rows*dim*bits/8 bytes (fewer, and part
	 * of the view, when it returns ZC_ENONFINITE). On the way it
	 * does group_params for the next group (n_next rows at next_rows, with
	 * their scales and mins; n_next 0: none), and returns ZC_ENONFINITE
	 * (the next group's params then undefined) if one of those rows holds
	 * NaN or Inf, else 0. With a view (not NULL), it also writes each
	 * row's reconstruction there, the halves group_reconstruct would give
	 * from the codes it packs. */
	int (*group_encode)(const uint16_t *head, const uint32_t *rows, size_t n_rows,
			     size_t dim, int bits, const uint8_t *scales, const uint8_t *mins,
			     uint8_t *codes, const uint32_t *next_rows, size_t n_next,
			     uint8_t *next_scales, uint8_t *next_mins,
			     const struct codec_view *view);
	/* Reconstructs n_rows consecutive subset rows of one group, the first
	 * one's codes at bit_offset (each next one dim*bits bits further): row
	 * r lands at out + tokens[r]*token_stride. Bytes may be read (never
	 * used) up to read_end. nt (only with out and 2*token_stride multiples
	 * of 64 bytes, every row on a cache line, for blocks too large to be
	 * read back from cache): whole vectors may be written with
	 * non-temporal stores, ordered before return; kernels without them
	 * ignore it. */
	void (*group_reconstruct)(const uint8_t *stream, const uint8_t *read_end,
				  size_t bit_offset, size_t n_rows, size_t dim, int bits,
				  const uint8_t *scales, const uint8_t *mins,
				  const uint32_t *tokens, uint16_t *out, size_t token_stride,
				  bool nt);
};

extern const struct codec_kernels codec_kernels_scalar;
extern const struct codec_kernels codec_kernels_avx2;
extern const struct codec_kernels codec_kernels_avx512;
/* The AVX-512 table for CPUs that also have VBMI (vpermb, vpmultishiftqb):
 * the same results, faster code unpacking and packing. */
extern const struct codec_kernels codec_kernels_avx512_vbmi;

/* The table in use; chosen once by zc_codec_init(). */
const struct codec_kernels *codec_kernels_active(void);

/* Whether a large block's views, written in the encode's pass, go by
 * non-temporal stores: ZC_CODEC_VIEW_STORES=stream|plain, else the
 * default of this CPU's vendor (docs/CODEC.md, "Writing views"). */
bool codec_views_stream(void);
/* For tests only: 1 stream, 0 plain, -1 the choice above. */
void codec_views_stream_override(int stream);

/* For tests only: makes `kernels` the active table (NULL: the choice of
 * zc_codec_init()); the caller vouches that the CPU can run it. */
void codec_kernels_override(const struct codec_kernels *kernels);

/* The scalar table's packer; the BMI2 one falls back to it for the
 * unaligned start and the last few codes of a run. */
void codec_pack_portable(uint8_t *stream, const uint8_t *stream_end, size_t bit_offset,
			 const uint8_t *codes, size_t n, int bits);

/* Shared by the AVX2 and AVX-512 tables (both require BMI2). */
void codec_pack_bmi2(uint8_t *stream, const uint8_t *stream_end, size_t bit_offset,
		     const uint8_t *codes, size_t n, int bits);

/* The fixed 16-lane fold of docs/CODEC.md, shared so every table folds alike. */
static inline float codec_fold_lanes(const float lanes[16])
{
	float eight[8], four[4], two[2];
	for (int j = 0; j < 8; j++)
		eight[j] = lanes[j] + lanes[j + 8];
	for (int j = 0; j < 4; j++)
		four[j] = eight[j] + eight[j + 4];
	for (int j = 0; j < 2; j++)
		two[j] = four[j] + four[j + 2];
	return two[0] + two[1];
}

#endif
