#include "bench_args.h"

#include <errno.h>
#include <stdlib.h>

int bench_parse_int(const char *v, long lo, long hi, long *out)
{
	char *end;
	errno = 0;
	long n = strtol(v, &end, 10);
	if (errno || end == v || *end || n < lo || n > hi)
		return -1;
	*out = n;
	return 0;
}
