/*
 * What the benchmarks' option parsers share.
 */
#ifndef ZIPCACHE_BENCH_ARGS_H
#define ZIPCACHE_BENCH_ARGS_H

/* A whole decimal number in [lo, hi] into *out: 0, else -1 (out untouched). */
int bench_parse_int(const char *v, long lo, long hi, long *out);

#endif
