#ifndef ZIPCACHE_VERSION_H
#define ZIPCACHE_VERSION_H

#define ZIPCACHE_VERSION "0.1.0"
/* 3: export_session, import_session, model_id, DATA_LOSS. Since, without a
 * bump (an older peer reads them as it did): status UNAVAILABLE (9, an older
 * client sees INTERNAL), optional request and stats fields. */
#define ZIPCACHE_PROTOCOL_VERSION 3u

#endif
