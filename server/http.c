/*
 * The metrics endpoint: GET /metrics (Prometheus text) and GET /healthz.
 * HTTP parsing is libmicrohttpd's; we run it inside our own libuv loop
 * (its epoll descriptor under a uv_poll_t, its timeouts under a
 * uv_timer_t), so rendering reads the server's state on the loop thread
 * with no locks. libmicrohttpd's limits keep a slow, partial, oversized
 * or malformed request from holding anything for long.
 */
#include "http.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "metrics.h"
#include "server.h"

/* A scrape is one short request; these bound what a misbehaving peer
 * can hold: connections (HTTP_CONNECTION_LIMIT, in http.h), seconds of
 * silence, bytes of request. */
#define HTTP_PER_IP_LIMIT 16
#define HTTP_IDLE_TIMEOUT_SECONDS 5
#define HTTP_REQUEST_MEMORY_BYTES (32u << 10)

struct http_endpoint {
	struct server *server;
	struct MHD_Daemon *daemon;
	uv_poll_t poll;
	uv_timer_t timer;
	int handles_open;
	uint16_t port;
};

static enum MHD_Result respond(struct MHD_Connection *connection, unsigned status,
			       const char *content_type, char *body, size_t len,
			       enum MHD_ResponseMemoryMode mode)
{
	struct MHD_Response *response = MHD_create_response_from_buffer(len, body, mode);
	if (!response) {
		if (mode == MHD_RESPMEM_MUST_FREE)
			free(body);
		return MHD_NO;
	}
	MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
	enum MHD_Result result = MHD_queue_response(connection, status, response);
	MHD_destroy_response(response);
	return result;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *connection, const char *url,
				  const char *method, const char *version, const char *upload_data,
				  size_t *upload_data_size, void **request_state)
{
	struct http_endpoint *http = cls;
	static char not_found[] = "not found\n";
	static char not_allowed[] = "only GET\n";
	(void)version;
	(void)upload_data;

	/* libmicrohttpd calls first with the headers alone; we answer then,
	 * from the method and path only. A body is never read: the reply
	 * goes out and the connection closes, whatever the peer still sends. */
	(void)request_state;
	(void)upload_data_size;
	if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
		return respond(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", not_allowed,
			       strlen(not_allowed), MHD_RESPMEM_PERSISTENT);
	if (strcmp(url, "/metrics") == 0) {
		char *text;
		size_t len;
		if (metrics_render(http->server, &text, &len) < 0)
			return MHD_NO;
		return respond(connection, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text,
			       len, MHD_RESPMEM_MUST_FREE);
	}
	if (strcmp(url, "/healthz") == 0) {
		static char ok[] = "ok\n";
		static char stopping[] = "stopping\n";
		if (http->server->stopping)
			return respond(connection, MHD_HTTP_SERVICE_UNAVAILABLE, "text/plain", stopping,
				       strlen(stopping), MHD_RESPMEM_PERSISTENT);
		return respond(connection, MHD_HTTP_OK, "text/plain", ok, strlen(ok),
			       MHD_RESPMEM_PERSISTENT);
	}
	return respond(connection, MHD_HTTP_NOT_FOUND, "text/plain", not_found, strlen(not_found),
		       MHD_RESPMEM_PERSISTENT);
}

static void http_drive(struct http_endpoint *http);

static void on_poll(uv_poll_t *handle, int status, int events)
{
	(void)status;
	(void)events;
	http_drive(handle->data);
}

static void on_timer(uv_timer_t *handle)
{
	http_drive(handle->data);
}

/* Lets libmicrohttpd do what is ready, then sleeps until its next timeout. */
static void http_drive(struct http_endpoint *http)
{
	MHD_UNSIGNED_LONG_LONG timeout_ms;
	MHD_run(http->daemon);
	if (MHD_get_timeout(http->daemon, &timeout_ms) == MHD_YES)
		uv_timer_start(&http->timer, on_timer, timeout_ms, 0);
	else
		uv_timer_stop(&http->timer);
}

static void http_logger(void *cls, const char *format, va_list args)
{
	char line[512];
	(void)cls;
	vsnprintf(line, sizeof(line), format, args);
	line[strcspn(line, "\n")] = '\0';
	log_debug("http", "libmicrohttpd", "message=\"%s\"", line);
}

/* "HOST:PORT" or "[V6]:PORT" into a socket address. */
static int listen_address_parse(const char *text, struct sockaddr_storage *address,
				socklen_t *length)
{
	char host[256];
	const char *port;
	const char *colon = strrchr(text, ':');
	if (!colon || colon == text || !colon[1])
		return -EINVAL;
	size_t host_len = (size_t)(colon - text);
	if (text[0] == '[' && colon[-1] == ']') {
		text++;
		host_len -= 2;
	}
	if (host_len >= sizeof(host))
		return -EINVAL;
	memcpy(host, text, host_len);
	host[host_len] = '\0';
	port = colon + 1;

	struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV };
	struct addrinfo *found;
	if (getaddrinfo(host, port, &hints, &found) != 0)
		return -EINVAL;
	memcpy(address, found->ai_addr, found->ai_addrlen);
	*length = found->ai_addrlen;
	freeaddrinfo(found);
	return 0;
}

int http_start(struct server *server, const char *listen, struct http_endpoint **out)
{
	struct sockaddr_storage address;
	socklen_t length;
	int rc = listen_address_parse(listen, &address, &length);

	*out = NULL;
	if (rc < 0)
		return rc;
	struct http_endpoint *http = calloc(1, sizeof(*http));
	if (!http)
		return -ENOMEM;
	http->server = server;
	unsigned flags = MHD_USE_EPOLL | MHD_USE_ERROR_LOG;
	if (address.ss_family == AF_INET6)
		flags |= MHD_USE_IPv6;
	http->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, http,
					MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&address,
					MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_CONNECTION_LIMIT,
					MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)HTTP_PER_IP_LIMIT,
					MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_TIMEOUT_SECONDS,
					MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_REQUEST_MEMORY_BYTES,
					MHD_OPTION_EXTERNAL_LOGGER, http_logger, NULL,
					MHD_OPTION_END);
	if (!http->daemon) {
		free(http);
		return -EADDRINUSE;
	}
	const union MHD_DaemonInfo *epoll_info =
		MHD_get_daemon_info(http->daemon, MHD_DAEMON_INFO_EPOLL_FD);
	const union MHD_DaemonInfo *port_info =
		MHD_get_daemon_info(http->daemon, MHD_DAEMON_INFO_BIND_PORT);
	http->port = port_info ? port_info->port : 0;
	uv_poll_init(server->loop, &http->poll, epoll_info->epoll_fd);
	uv_timer_init(server->loop, &http->timer);
	http->poll.data = http->timer.data = http;
	http->handles_open = 2;
	uv_poll_start(&http->poll, UV_READABLE, on_poll);
	http_drive(http);
	*out = http;
	return 0;
}

uint16_t http_port(const struct http_endpoint *http)
{
	return http->port;
}

static void on_handle_closed(uv_handle_t *handle)
{
	struct http_endpoint *http = handle->data;
	/* The daemon (and its epoll descriptor) goes only after libuv has
	 * stopped watching that descriptor. */
	if (--http->handles_open == 0) {
		MHD_stop_daemon(http->daemon);
		free(http);
	}
}

void http_stop(struct http_endpoint *http)
{
	if (!http)
		return;
	uv_close((uv_handle_t *)&http->poll, on_handle_closed);
	uv_close((uv_handle_t *)&http->timer, on_handle_closed);
}
