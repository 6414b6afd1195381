/*
 * Page facts the daemon's files share. Session files and maps, block
 * pools, staging buffers and request rings are laid out, reserved and
 * punched in 4 KiB pages (the x86-64 and 4K-arm64 page); a call that
 * needs the kernel's own page size (mmap of an offset) asks sysconf.
 */
#ifndef ZIPCACHED_PAGES_H
#define ZIPCACHED_PAGES_H

#include <sys/mman.h>

#define PAGE_BYTES 4096u

/* Linux 5.14; older headers lack the name. An older kernel refuses it
 * (EINVAL), and the caller keeps its first-touch faults or copies. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#endif
