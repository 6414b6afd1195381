/* Staging buffers: sealed memfds mapped read-only by the daemon. */
#include "staging.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "store.h"
#include "zipcache/error.h"

int staging_create(uint64_t bytes, struct store_budget *memory, struct store_budget *quota,
		   struct staging **out)
{
	struct staging *staging;
	int rc;

	if (bytes == 0 || bytes > UINT64_MAX - 4095)
		return -EINVAL;
	bytes = (bytes + 4095) / 4096 * 4096;
	if (store_budget_take(quota, bytes) < 0)
		return ZC_EEXHAUSTED;
	rc = store_budget_take(memory, bytes);
	if (rc < 0)
		goto out_quota;
	rc = -ENOMEM;
	staging = calloc(1, sizeof(*staging));
	if (!staging)
		goto out_memory;
	staging->fd = memfd_create("zipcache-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (staging->fd < 0) {
		rc = -errno;
		goto out_free;
	}
	if (ftruncate(staging->fd, (off_t)bytes) < 0 ||
	    fcntl(staging->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		rc = -errno;
		goto out_close;
	}
	void *base = mmap(NULL, bytes, PROT_READ, MAP_SHARED, staging->fd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		goto out_close;
	}
	staging->base = base;
	staging->bytes = bytes;
	staging->refs = 1;
	staging->memory = memory;
	staging->quota = quota;
	*out = staging;
	return 0;

out_close:
	close(staging->fd);
out_free:
	free(staging);
out_memory:
	store_budget_give(memory, bytes);
out_quota:
	store_budget_give(quota, bytes);
	return rc;
}

void staging_ref(struct staging *staging)
{
	staging->refs++;
}

void staging_unref(struct staging *staging)
{
	if (!staging || --staging->refs > 0)
		return;
	munmap((void *)staging->base, staging->bytes);
	close(staging->fd);
	store_budget_give(staging->memory, staging->bytes);
	store_budget_give(staging->quota, staging->bytes);
	free(staging);
}
