/* The HTTP endpoint for /metrics and /healthz, inside the daemon's loop. */
#ifndef ZIPCACHE_HTTP_H
#define ZIPCACHE_HTTP_H

#include <stdint.h>

struct server;
struct http_endpoint;

/* HTTP connections served at once (each a descriptor). */
#define HTTP_CONNECTION_LIMIT 64

/* Descriptors of the endpoint besides its connections: the listener,
 * libmicrohttpd's epoll descriptor and its wake-up pipe. */
#define HTTP_FIXED_DESCRIPTORS 4

/* Listens on "HOST:PORT" ("[V6]:PORT"; port 0 picks a free one). */
int http_start(struct server *server, const char *listen, struct http_endpoint **out);

/* The port actually bound. */
uint16_t http_port(const struct http_endpoint *http);

/* Closes the listener and every HTTP connection; frees asynchronously. */
void http_stop(struct http_endpoint *http);

#endif
