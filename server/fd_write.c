#include "fd_write.h"

#include <errno.h>
#include <unistd.h>

int fd_pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at)
{
	const uint8_t *p = buf;
	while (n > 0) {
		/* Linux writes at most ~2 GiB per call; ask for no more than 1 GiB. */
		size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
		ssize_t put = pwrite(fd, p, chunk, (off_t)at);
		if (put < 0 && errno == EINTR)
			continue;
		if (put < 0)
			return -errno;
		if (put == 0)
			return -EIO;
		p += put;
		n -= (uint64_t)put;
		at += (uint64_t)put;
	}
	return 0;
}
