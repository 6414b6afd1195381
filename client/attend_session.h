/*
 * zc_attend over any map and pool (client/map_reader.h), so that the tests
 * can drive it with a reader whose pool is cut short: the public call is
 * this over a session handle's mappings.
 */
#ifndef ZIPCACHE_ATTEND_SESSION_H
#define ZIPCACHE_ATTEND_SESSION_H

#include <stddef.h>
#include <stdint.h>

#include "map_reader.h"
#include "zipcache/attend.h"
#include "zipcache/client.h"

/* zc_attend (zipcache/attend.h) with the session's info given apart.
 * *copied (may be NULL) counts the key payloads attended from a private
 * copy in the consistent read (see near_pool_end in attend_session.c). */
int map_attend(const struct map_reader *reader, const zc_session_info *info, uint32_t layer,
	       const zc_attend_query *query, const zc_attend_output *output, unsigned flags,
	       unsigned threads, size_t *copied);

#endif
