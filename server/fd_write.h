/*
 * Positional writes that finish: the one loop the pool, the store and the
 * snapshots use to put bytes into a file at an offset.
 */
#ifndef ZIPCACHED_FD_WRITE_H
#define ZIPCACHED_FD_WRITE_H

#include <stdint.h>

/* pwrite until all n bytes are at `at` (short writes continued, EINTR
 * retried); 0, -errno, or -EIO when the file takes no more. */
int fd_pwrite_all(int fd, const void *buf, uint64_t n, uint64_t at);

#endif
