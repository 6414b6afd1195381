/*
 * Portable IEEE binary16 conversions. They are the reference the SIMD
 * kernels must match bit for bit (F16C rounds to nearest even as well),
 * so they are written for exactness, not speed: the hot loops convert
 * with F16C where the CPU has it.
 */
#include "zipcache/codec.h"

#include <string.h>

float zc_fp16_to_float(uint16_t half)
{
	uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
	uint32_t exponent = (half >> 10) & 0x1fu;
	uint32_t mantissa = half & 0x3ffu;
	uint32_t bits;
	float value;

	if (exponent == 0x1f) {
		bits = sign | 0x7f800000u | (mantissa << 13);
	} else if (exponent != 0) {
		bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
	} else if (mantissa == 0) {
		bits = sign;
	} else {
		/* Subnormal: normalise the mantissa into an fp32 normal. */
		int shift = 0;
		while (!(mantissa & 0x400u)) {
			mantissa <<= 1;
			shift++;
		}
		mantissa &= 0x3ffu;
		bits = sign | ((uint32_t)(113 - shift) << 23) | (mantissa << 13);
	}
	memcpy(&value, &bits, sizeof(value));
	return value;
}

uint16_t zc_float_to_fp16(float value)
{
	uint32_t bits;
	uint32_t sign, exponent, mantissa;

	memcpy(&bits, &value, sizeof(bits));
	sign = (bits >> 16) & 0x8000u;
	exponent = (bits >> 23) & 0xffu;
	mantissa = bits & 0x7fffffu;

	if (exponent == 0xff) {
		/* Inf stays Inf; NaN stays a (quiet) NaN with its top payload bits. */
		if (mantissa == 0)
			return (uint16_t)(sign | 0x7c00u);
		return (uint16_t)(sign | 0x7e00u | (mantissa >> 13));
	}
	int e = (int)exponent - 127 + 15;
	if (e >= 0x1f)
		return (uint16_t)(sign | 0x7c00u);
	if (e <= 0) {
		/* Result is subnormal or zero: shift the full 24-bit significand. */
		if (e < -10)
			return (uint16_t)sign;
		uint32_t significand = mantissa | 0x800000u;
		unsigned shift = (unsigned)(14 - e);
		uint32_t half_mantissa = significand >> shift;
		uint32_t remainder = significand & ((1u << shift) - 1u);
		uint32_t halfway = 1u << (shift - 1);
		if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u)))
			half_mantissa++;
		return (uint16_t)(sign | half_mantissa);
	}
	uint32_t half = ((uint32_t)e << 10) | (mantissa >> 13);
	uint32_t remainder = mantissa & 0x1fffu;
	/* A carry out of the mantissa correctly bumps the exponent (to Inf at the top). */
	if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u)))
		half++;
	return (uint16_t)(sign | half);
}
