/*
 * Page facts the daemon's files share. Session files and maps, block
 * pools, staging buffers and request rings are laid out, reserved and
 * punched in 4 KiB pages (the x86-64 and 4K-arm64 page); a call that
 * needs the kernel's own page size (mmap of an offset) asks sysconf.
 */
#ifndef ZIPCACHED_PAGES_H
#define ZIPCACHED_PAGES_H

#include <stdint.h>
#include <sys/mman.h>

#define PAGE_BYTES 4096u

/* value rounded up to a multiple of unit (a page, or another alignment);
 * the caller keeps value + unit - 1 within 64 bits. */
static inline uint64_t round_up(uint64_t value, uint64_t unit)
{
	return (value + unit - 1) / unit * unit;
}

/* Linux 5.14; older headers lack the name. An older kernel refuses it
 * (EINVAL), and the caller keeps its first-touch faults or copies. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#endif
