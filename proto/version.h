#ifndef ZIPCACHE_VERSION_H
#define ZIPCACHE_VERSION_H

#define ZIPCACHE_VERSION "0.1.0"
/* 3: export_session, import_session, model_id, DATA_LOSS. */
#define ZIPCACHE_PROTOCOL_VERSION 3u

#endif
