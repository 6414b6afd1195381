/* One-line error messages for the command-line tools. */
#include "failure.h"

#include <stdio.h>

int failure_print(const char *program, int status, const char *format, va_list arguments)
{
	char message[1024];

	vsnprintf(message, sizeof(message), format, arguments);
	for (char *c = message; *c; c++)
		if ((unsigned char)*c < 0x20 || *c == 0x7f)
			*c = '?';
	fflush(stdout);
	fprintf(stderr, "%s: %s\n", program, message);
	return status;
}
