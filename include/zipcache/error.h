/*
 * zipcache error codes.
 *
 * Every function in the public API returns 0 (or a non-negative count) on
 * success and a negative code on failure, as libuv does. Codes in the
 * errno range are -errno from the operating system (-ENOMEM, -ECONNREFUSED,
 * ...); codes from ZC_ERROR_BASE down are zipcache's own, one per distinct
 * mistake a caller can make, so a program can tell them apart without
 * parsing text. zc_strerror() turns either kind into a sentence.
 */
#ifndef ZIPCACHE_ERROR_H
#define ZIPCACHE_ERROR_H

#define ZC_ERROR_BASE (-4000)

enum zc_error {
	ZC_EBITS = ZC_ERROR_BASE - 1,          /* bit width outside 1..8 */
	ZC_EFRACTION = ZC_ERROR_BASE - 2,      /* hi_fraction outside [0, 1] or NaN */
	ZC_EGROUPSIZE = ZC_ERROR_BASE - 3,     /* group_size < 1 */
	ZC_ESHAPE = ZC_ERROR_BASE - 4,         /* a zero or oversized dimension */
	ZC_ENONFINITE = ZC_ERROR_BASE - 5,     /* NaN or Inf in the input */
	ZC_EBUFFER = ZC_ERROR_BASE - 6,        /* output buffer too small */
	ZC_ECORRUPT = ZC_ERROR_BASE - 7,       /* compressed data does not match its layout, or a
						* snapshot is damaged (DATA_LOSS on the wire) */
	ZC_ETENSOR = ZC_ERROR_BASE - 8,        /* unknown tensor kind */
	ZC_EPROTOCOL = ZC_ERROR_BASE - 9,      /* peer broke the wire protocol */
	ZC_EFRAMESIZE = ZC_ERROR_BASE - 10,    /* frame larger than the agreed maximum */
	ZC_ENOTFOUND = ZC_ERROR_BASE - 11,     /* no such session (for this user) */
	ZC_EEXISTS = ZC_ERROR_BASE - 12,       /* session already exists */
	ZC_EEXHAUSTED = ZC_ERROR_BASE - 13,    /* a limit or budget was reached */
	ZC_EDENIED = ZC_ERROR_BASE - 14,       /* permission denied by the daemon */
	ZC_EPRECONDITION = ZC_ERROR_BASE - 15, /* request not valid in this state */
	ZC_EINTERNAL = ZC_ERROR_BASE - 16,     /* daemon-side failure */
	ZC_EINVALID = ZC_ERROR_BASE - 17,      /* invalid argument (from the daemon, or a local call) */
	ZC_ERESTARTED = ZC_ERROR_BASE - 18,    /* the daemon restarted; remap */
	ZC_EBROKEN = ZC_ERROR_BASE - 19,       /* connection unusable since an earlier failure */
	ZC_ESTALE = ZC_ERROR_BASE - 20,        /* a view read after its lease (or after a drop) */
	ZC_EAGAIN = ZC_ERROR_BASE - 21,        /* the layer changed during a read: read again */
	ZC_EDEVICE = ZC_ERROR_BASE - 22,       /* the GPU or its driver failed (libzipcache_cuda) */
	ZC_EREMOTE = ZC_ERROR_BASE - 23,       /* the remote tier (Redis) failed or cannot be reached */
	ZC_ERROR_LAST = ZC_ERROR_BASE - 24
};

/* A static sentence describing code; never NULL. */
const char *zc_strerror(int code);

/* The symbolic name of code ("ZC_ENONFINITE", "ENOMEM"); never NULL. */
const char *zc_error_name(int code);

#endif
