/*
 * Picks the kernel table once, from the CPU's features or from
 * ZC_CODEC_ISA=scalar|avx2|avx512 (tests force each path that way).
 * The choice never changes results, only speed.
 */
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zipcache/codec.h"

static _Atomic(const struct codec_kernels *) active_kernels;
static _Atomic int active_isa = ZC_ISA_SCALAR;

#if defined(__x86_64__) || defined(__i386__)
/* clang 14 knows no "f16c" for __builtin_cpu_supports: ask CPUID leaf 1. */
static bool cpu_has_f16c(void)
{
	unsigned eax, ebx, ecx, edx;
	return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}
#endif

static bool cpu_supports_isa(zc_isa isa)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_cpu_init();
	switch (isa) {
	case ZC_ISA_SCALAR:
		return true;
	case ZC_ISA_AVX2:
		return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
		       cpu_has_f16c() && __builtin_cpu_supports("bmi2");
	case ZC_ISA_AVX512:
		return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
		       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
		       cpu_has_f16c() && __builtin_cpu_supports("bmi2");
	}
	return false;
#else
	return isa == ZC_ISA_SCALAR;
#endif
}

/* VBMI only changes how the AVX-512 table unpacks and packs codes. */
static bool cpu_has_vbmi(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_cpu_init();
	return __builtin_cpu_supports("avx512vbmi");
#else
	return false;
#endif
}

static const struct codec_kernels *kernels_for(zc_isa isa)
{
	switch (isa) {
	case ZC_ISA_AVX512:
		return cpu_has_vbmi() ? &codec_kernels_avx512_vbmi : &codec_kernels_avx512;
	case ZC_ISA_AVX2:
		return &codec_kernels_avx2;
	case ZC_ISA_SCALAR:
		break;
	}
	return &codec_kernels_scalar;
}

const char *zc_isa_name(zc_isa isa)
{
	switch (isa) {
	case ZC_ISA_SCALAR:
		return "scalar";
	case ZC_ISA_AVX2:
		return "avx2";
	case ZC_ISA_AVX512:
		return "avx512";
	}
	return "unknown";
}

int zc_codec_set_isa(zc_isa isa)
{
	if (isa != ZC_ISA_SCALAR && isa != ZC_ISA_AVX2 && isa != ZC_ISA_AVX512)
		return -EINVAL;
	if (!cpu_supports_isa(isa))
		return -ENOTSUP;
	atomic_store(&active_isa, (int)isa);
	atomic_store(&active_kernels, kernels_for(isa));
	return 0;
}

static zc_isa isa_best(void)
{
	if (cpu_supports_isa(ZC_ISA_AVX512))
		return ZC_ISA_AVX512;
	if (cpu_supports_isa(ZC_ISA_AVX2))
		return ZC_ISA_AVX2;
	return ZC_ISA_SCALAR;
}

void zc_codec_init(void)
{
	const char *wanted = getenv("ZC_CODEC_ISA");
	zc_isa isa = isa_best();

	if (wanted && *wanted) {
		zc_isa forced = isa;
		if (strcmp(wanted, "scalar") == 0)
			forced = ZC_ISA_SCALAR;
		else if (strcmp(wanted, "avx2") == 0)
			forced = ZC_ISA_AVX2;
		else if (strcmp(wanted, "avx512") == 0)
			forced = ZC_ISA_AVX512;
		else
			fprintf(stderr, "zipcache: ignoring unknown ZC_CODEC_ISA=%s\n", wanted);
		if (cpu_supports_isa(forced))
			isa = forced;
		else
			fprintf(stderr, "zipcache: ZC_CODEC_ISA=%s is not supported by this CPU; using %s\n",
				wanted, zc_isa_name(isa));
	}
	atomic_store(&active_isa, (int)isa);
	atomic_store(&active_kernels, kernels_for(isa));
}

zc_isa zc_codec_isa(void)
{
	(void)codec_kernels_active();
	return (zc_isa)atomic_load(&active_isa);
}

const struct codec_kernels *codec_kernels_active(void)
{
	const struct codec_kernels *kernels = atomic_load(&active_kernels);
	if (!kernels) {
		/* Two threads may both probe; they store the same answer. */
		zc_codec_init();
		kernels = atomic_load(&active_kernels);
	}
	return kernels;
}

/* Intel's hosts write a prefill's views faster with non-temporal stores,
 * AMD's Zen 4 slower (docs/CODEC.md, "Writing views"), and no probe at
 * start tells them apart: a streaming probe runs them faster on both. */
static bool cpu_is_intel(void)
{
#if defined(__x86_64__) || defined(__i386__)
	unsigned eax, ebx, ecx, edx;
	/* "GenuineIntel", in EBX, EDX, ECX. */
	return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x756e6547u &&
	       edx == 0x49656e69u && ecx == 0x6c65746eu;
#else
	return false;
#endif
}

/* 0: not decided yet, 1: plain, 2: stream. */
static _Atomic int view_stores;

bool codec_views_stream(void)
{
	/* Two threads may both decide; they store the same answer. */
	int c = atomic_load(&view_stores);
	if (c == 0) {
		const char *wanted = getenv("ZC_CODEC_VIEW_STORES");
		bool stream = cpu_is_intel();
		if (wanted && strcmp(wanted, "stream") == 0)
			stream = true;
		else if (wanted && strcmp(wanted, "plain") == 0)
			stream = false;
		else if (wanted && *wanted)
			fprintf(stderr, "zipcache: ignoring unknown ZC_CODEC_VIEW_STORES=%s\n", wanted);
		c = stream ? 2 : 1;
		atomic_store(&view_stores, c);
	}
	return c == 2;
}

void codec_views_stream_override(int stream)
{
	atomic_store(&view_stores, stream < 0 ? 0 : stream ? 2 : 1);
}

void codec_kernels_override(const struct codec_kernels *kernels)
{
	if (!kernels)
		kernels = kernels_for((zc_isa)atomic_load(&active_isa));
	atomic_store(&active_kernels, kernels);
}
