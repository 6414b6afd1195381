/* Fault points: see fault.h. */
#include "fault.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Every step a mutation of the store goes through, in its order. Each one
 * names the moment right after the work it describes is done. */
const char *const fault_steps[] = {
	"create.file",       /* temporary file made and sized */
	"create.header",     /* header and empty commit area written */
	"create.rename",     /* renamed to its final name: the open's commit point */
	"append.compress",   /* block(s) compressed into the pool, views written */
	"append.index",      /* index entries written past the committed count */
	"append.record",     /* the layer's next commit record written */
	"append.publish",    /* committed generation advanced: the commit point */
	"residual.copy",     /* rows copied into the residual and the views */
	"residual.record",
	"residual.publish",  /* commit point of a short streaming update */
	"flush.compress",    /* the full residual compressed into the pool */
	"flush.index",
	"flush.record",
	"flush.publish",     /* commit point of the residual flush */
	"compact.copy",      /* rows appended during a deferred flush copied to row 0 */
	"compact.record",
	"compact.publish",   /* commit point of that move: the residual starts at row 0 again */
	"trim.record",       /* one layer's commit record written (hit once per layer) */
	"trim.publish",      /* commit point of a trim, of one layer or all */
	"drop.mark",         /* a layer's view marked invalid for readers */
	"drop.punch",        /* its pages given back */
	"rebuild.block",     /* one block reconstructed into a view */
	"rebuild.done",      /* a layer's view valid again */
	"close.unlink",      /* about to remove the file: the close's commit point */
	"close.done",        /* file removed */
	"fork.layers",       /* a fork's records, index and residual written, before the rename */
	"pool.create",       /* a uid's pool file made, not yet renamed into place */
	"pool.write",        /* a new block's bytes in the pool, not yet named by a session */
	"pool.retain",       /* a freed extent's first page punched, its other pages kept: free from here */
	"pool.reuse",        /* a kept extent taken for a new block, before its pages are reserved */
	"retain.map",        /* a closed session's map kept for the next session (not durable) */
	"import.verified",   /* a snapshot's header and table verified, nothing made yet */
	"import.block",      /* one imported block in the pool and the new file's index */
	"import.layers",     /* every layer of an import written, before the rename */
	"offload.encoded",   /* the snapshot encoded in memory, nothing written to Redis */
	"offload.layer",     /* one layer's blocks and residual confirmed by Redis (once per layer) */
	"offload.manifest",  /* the manifest written: the offload's commit point; local copy intact */
	"offload.dropped",   /* the local copy retired (its file unlinked) */
	"restore.fetched",   /* every part fetched and verified, nothing made (then import.*) */
	"restore.committed", /* the restored session in the table, the remote copy not yet deleted */
	NULL
};

static const char *armed_step;
static uint64_t armed_hit;
static uint64_t hits;
static pthread_once_t armed_once = PTHREAD_ONCE_INIT;

static void fault_arm(void)
{
	static char step[64];
	const char *spec = getenv("ZIPCACHED_FAULT");
	const char *colon = spec ? strrchr(spec, ':') : NULL;
	if (!colon || (size_t)(colon - spec) >= sizeof(step))
		return;
	memcpy(step, spec, (size_t)(colon - spec));
	step[colon - spec] = '\0';
	armed_hit = strtoull(colon + 1, NULL, 10);
	if (armed_hit > 0)
		armed_step = step;
}

/* ZIPCACHED_FAULT_PAUSE=STEP:MS: each time the step is reached the thread
 * sleeps MS milliseconds, so a test can act in the middle of a mutation
 * (stop Redis between two layers' writes, send a request). */
static const char *pause_step;
static unsigned pause_ms;
static pthread_once_t pause_once = PTHREAD_ONCE_INIT;

static void pause_arm(void)
{
	static char step[64];
	const char *spec = getenv("ZIPCACHED_FAULT_PAUSE");
	const char *colon = spec ? strrchr(spec, ':') : NULL;
	if (!colon || (size_t)(colon - spec) >= sizeof(step))
		return;
	memcpy(step, spec, (size_t)(colon - spec));
	step[colon - spec] = '\0';
	pause_ms = (unsigned)strtoul(colon + 1, NULL, 10);
	if (pause_ms > 0)
		pause_step = step;
}

void fault_point(const char *step)
{
	pthread_once(&pause_once, pause_arm);
	if (pause_step && strcmp(step, pause_step) == 0)
		usleep(pause_ms * 1000u);
	pthread_once(&armed_once, fault_arm);
	if (!armed_step || strcmp(step, armed_step) != 0)
		return;
	if (__atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED) == armed_hit) {
		static const char message[] = "zipcached: fault injected, exiting\n";
		ssize_t ignored = write(STDERR_FILENO, message, sizeof(message) - 1);
		(void)ignored;
		_exit(FAULT_EXIT_STATUS);
	}
}
