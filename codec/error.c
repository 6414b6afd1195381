/* zc_strerror: one sentence for every code a zipcache function returns. */
#include "zipcache/error.h"

#include <string.h>

struct error_text {
	int code;
	const char *name;
	const char *text;
};

static const struct error_text error_texts[] = {
	{ ZC_EBITS, "ZC_EBITS", "bit width must be between 1 and 8" },
	{ ZC_EFRACTION, "ZC_EFRACTION", "hi_fraction must be a number in [0, 1]" },
	{ ZC_EGROUPSIZE, "ZC_EGROUPSIZE", "group_size must be at least 1" },
	{ ZC_ESHAPE, "ZC_ESHAPE", "block shape has a zero or oversized dimension" },
	{ ZC_ENONFINITE, "ZC_ENONFINITE", "input contains NaN or Inf" },
	{ ZC_EBUFFER, "ZC_EBUFFER", "output buffer is too small" },
	{ ZC_ECORRUPT, "ZC_ECORRUPT", "compressed data does not match its shape and config" },
	{ ZC_ETENSOR, "ZC_ETENSOR", "tensor must be keys or values" },
	{ ZC_EPROTOCOL, "ZC_EPROTOCOL", "peer broke the wire protocol" },
	{ ZC_EFRAMESIZE, "ZC_EFRAMESIZE", "frame is larger than the agreed maximum" },
	{ ZC_ENOTFOUND, "ZC_ENOTFOUND", "no such session" },
	{ ZC_EEXISTS, "ZC_EEXISTS", "a session with that name already exists" },
	{ ZC_EEXHAUSTED, "ZC_EEXHAUSTED", "a limit or the memory budget was reached" },
	{ ZC_EDENIED, "ZC_EDENIED", "permission denied" },
	{ ZC_EPRECONDITION, "ZC_EPRECONDITION", "request is not valid in the current state" },
	{ ZC_EINTERNAL, "ZC_EINTERNAL", "internal error in the daemon" },
	{ ZC_EINVALID, "ZC_EINVALID", "invalid argument" },
	{ ZC_ERESTARTED, "ZC_ERESTARTED", "the daemon restarted; reopen sessions to remap them" },
	{ ZC_EBROKEN, "ZC_EBROKEN", "the connection broke in an earlier call; call zc_client_reconnect" },
	{ ZC_ESTALE, "ZC_ESTALE", "the view was read after its lease ended or after it was dropped; "
				  "fetch it again" },
	{ ZC_EAGAIN, "ZC_EAGAIN", "the layer changed while it was read; read it again" },
	{ ZC_EDEVICE, "ZC_EDEVICE", "the GPU or its driver failed (zc_cuda_last_error says how)" },
	{ ZC_EREMOTE, "ZC_EREMOTE", "the remote tier (Redis) failed or cannot be reached" },
};

static const struct error_text *error_find(int code)
{
	for (size_t i = 0; i < sizeof(error_texts) / sizeof(error_texts[0]); i++)
		if (error_texts[i].code == code)
			return &error_texts[i];
	return NULL;
}

const char *zc_strerror(int code)
{
	const struct error_text *entry = error_find(code);

	if (code == 0)
		return "success";
	if (entry)
		return entry->text;
	/* strerror() of an errno is a static string for known values in glibc. */
	if (code < 0 && code > ZC_ERROR_BASE)
		return strerror(-code);
	return "unknown error";
}

const char *zc_error_name(int code)
{
	const struct error_text *entry = error_find(code);

	if (code == 0)
		return "OK";
	if (entry)
		return entry->name;
	if (code < 0 && code > ZC_ERROR_BASE) {
		const char *name = strerrorname_np(-code);
		return name ? name : "EUNKNOWN";
	}
	return "EUNKNOWN";
}
