/* Staging buffers: sealed memfds mapped read-only by the daemon. */
#include "staging.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pages.h"
#include "store.h"
#include "zipcache/error.h"

int staging_memfd_map(const char *name, uint64_t bytes, int prot, int *fd, uint8_t **base)
{
	int memfd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (memfd < 0)
		return -errno;
	void *mapping = MAP_FAILED;
	if (ftruncate(memfd, (off_t)bytes) < 0 ||
	    fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
	    (mapping = mmap(NULL, bytes, prot, MAP_SHARED, memfd, 0)) == MAP_FAILED) {
		int rc = -errno;
		close(memfd);
		return rc;
	}
	*fd = memfd;
	*base = mapping;
	return 0;
}

int staging_charge(struct store_budget *memory, struct store_budget *quota, uint64_t bytes)
{
	if (store_budget_take(quota, bytes) < 0)
		return ZC_EEXHAUSTED;
	int rc = store_budget_take(memory, bytes);
	if (rc < 0)
		store_budget_give(quota, bytes);
	return rc;
}

void staging_uncharge(struct store_budget *memory, struct store_budget *quota, uint64_t bytes)
{
	store_budget_give(memory, bytes);
	store_budget_give(quota, bytes);
}

int staging_create(uint64_t bytes, struct store_budget *memory, struct store_budget *quota,
		   struct staging **out)
{
	struct staging *staging;
	int rc;

	if (bytes == 0 || bytes > UINT64_MAX - (PAGE_BYTES - 1))
		return -EINVAL;
	bytes = round_up(bytes, PAGE_BYTES);
	if ((rc = staging_charge(memory, quota, bytes)) < 0)
		return rc;
	rc = -ENOMEM;
	staging = calloc(1, sizeof(*staging));
	if (!staging)
		goto out_charge;
	uint8_t *base;
	rc = staging_memfd_map("zipcache-staging", bytes, PROT_READ, &staging->fd, &base);
	if (rc < 0)
		goto out_free;
	staging->base = base;
	staging->bytes = bytes;
	staging->refs = 1;
	staging->memory = memory;
	staging->quota = quota;
	*out = staging;
	return 0;

out_free:
	free(staging);
out_charge:
	staging_uncharge(memory, quota, bytes);
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
	staging_uncharge(staging->memory, staging->quota, staging->bytes);
	free(staging);
}
