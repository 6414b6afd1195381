/*
 * One client connection's I/O: reading frames into the frame reader,
 * handing each to the owner, and writing reply frames (with descriptors)
 * with sendmsg. See connection.h for the states.
 */
#include "connection.h"

#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"

/* Requests a connection may have in flight before we stop reading it:
 * deep enough for a 128-layer pipelined step, small enough that one
 * client cannot queue unbounded work. */
#define MAX_IN_FLIGHT 512u

/* Requests in flight while replies already wait unsent: the client is
 * not keeping up, and each request still running would add its reply to
 * the queue whatever its bound says. */
#define MAX_IN_FLIGHT_BACKLOGGED 8u

/* After a queue this large drains or is dropped, the heap's free pages go
 * back to the system (malloc keeps them otherwise: the RSS of a daemon
 * that once buffered for slow clients would stay high). */
#define TRIM_AFTER_BYTES (1u << 20)

/* Reads per readiness event, so one busy client cannot starve others. */
#define READS_PER_EVENT 16

#define MAX_FDS_PER_FRAME 4

/* A defensive check for what cannot happen (SQLite's NEVER()). */
#define NEVER(condition) __builtin_expect(!!(condition), 0)

struct out_frame {
	struct out_frame *next;
	uint8_t *data;
	size_t len, sent;
	int fds[MAX_FDS_PER_FRAME];
	int n_fds;
};

static uint64_t next_connection_id = 1;

static void out_frame_free(struct out_frame *frame)
{
	for (int i = 0; i < frame->n_fds; i++)
		close(frame->fds[i]);
	free(frame->data);
	free(frame);
}

static void connection_ref(struct connection *connection)
{
	connection->refs++;
}

static void connection_unref(struct connection *connection)
{
	if (--connection->refs > 0)
		return;
	frame_reader_free(&connection->reader);
	connection->callbacks->freed(connection);
}

static void on_close(uv_handle_t *handle)
{
	struct connection *connection = handle->data;
	close(connection->fd);
	connection_unref(connection);
}

static void on_resume_closed(uv_handle_t *handle)
{
	connection_unref(handle->data);
}

static void flow_update(struct connection *connection);

/*
 * Tells the owner how the bytes queued now differ from what it was told
 * last (it charges them), and gives the heap back after a large queue.
 */
static void queue_account(struct connection *connection)
{
	if (connection->out_bytes != connection->out_reported) {
		int64_t delta = (int64_t)connection->out_bytes - (int64_t)connection->out_reported;
		connection->out_reported = connection->out_bytes;
		connection->callbacks->queued(connection, delta);
	}
	if (connection->out_bytes > connection->out_peak)
		connection->out_peak = connection->out_bytes;
	if (connection->out_bytes == 0) {
		if (connection->out_peak >= TRIM_AFTER_BYTES)
			malloc_trim(0);
		connection->out_peak = 0;
	}
}

void connection_set_total_over(struct connection *connection, bool over)
{
	connection->total_over = over;
	if (connection->state != CONNECTION_CLOSING)
		flow_update(connection);
}

/* Closes the received descriptors no frame claimed. */
static void in_fds_close(struct connection *connection)
{
	for (int i = 0; i < connection->n_in_fds; i++)
		close(connection->in_fds[i]);
	connection->n_in_fds = 0;
}

int connection_take_fd(struct connection *connection)
{
	if (connection->n_in_fds == 0)
		return -1;
	int fd = connection->in_fds[0];
	connection->n_in_fds--;
	memmove(connection->in_fds, connection->in_fds + 1,
		sizeof(int) * (size_t)connection->n_in_fds);
	return fd;
}

void connection_close(struct connection *connection)
{
	if (connection->state == CONNECTION_CLOSING)
		return;
	connection->state = CONNECTION_CLOSING;
	in_fds_close(connection);
	while (connection->out_head) {
		struct out_frame *frame = connection->out_head;
		connection->out_head = frame->next;
		out_frame_free(frame);
	}
	connection->out_tail = NULL;
	connection->out_bytes = 0;
	connection->out_fds = 0;
	queue_account(connection);
	log_debug("connection", "closed", "connection=%llu uid=%u pid=%d",
		  (unsigned long long)connection->id, connection->uid, connection->pid);
	uv_close((uv_handle_t *)&connection->resume, on_resume_closed);
	uv_close((uv_handle_t *)&connection->poll, on_close);
	connection->callbacks->closing(connection);
}

static void on_poll(uv_poll_t *handle, int status, int events);

/* Keeps the poll watcher in line with the state and the reply queue. */
static void poll_update(struct connection *connection)
{
	int events = 0;
	if (connection->state == CONNECTION_CLOSING)
		return;
	if (connection->state == CONNECTION_DRAINING && !connection->out_head &&
	    connection->in_flight == 0) {
		connection_close(connection);
		return;
	}
	if (connection->state == CONNECTION_OPEN && !connection->peer_closed)
		events |= UV_READABLE;
	if (connection->out_head)
		events |= UV_WRITABLE;
	if (events == connection->poll_events)
		return;
	connection->poll_events = events;
	if (events == 0)
		uv_poll_stop(&connection->poll);
	else
		uv_poll_start(&connection->poll, events, on_poll);
}

static void on_resume(uv_idle_t *handle);

static void flow_update(struct connection *connection)
{
	bool backlogged = connection->out_bytes > 0;
	bool busy = connection->in_flight >= MAX_IN_FLIGHT ||
		    connection->out_bytes >= connection->limits->max_reply_queue_bytes ||
		    connection->out_fds >= CONNECTION_MAX_QUEUED_FDS ||
		    (backlogged && (connection->total_over ||
				    connection->in_flight >= MAX_IN_FLIGHT_BACKLOGGED));
	if (connection->state == CONNECTION_OPEN && busy) {
		connection->state = CONNECTION_PAUSED;
	} else if (connection->state == CONNECTION_PAUSED && !busy) {
		connection->state = CONNECTION_OPEN;
		/* Frames read before the pause come before anything new, but
		 * not from here: this may run inside a job's done callback, and
		 * a request from there could close and free that job's session. */
		if (frame_reader_buffered(&connection->reader) > 0 || connection->peer_closed)
			uv_idle_start(&connection->resume, on_resume);
	}
	poll_update(connection);
}

/* Writes queued replies until the socket would block. Returns -1 if the
 * connection was closed. */
static int flush_frames(struct connection *connection)
{
	while (connection->out_head) {
		struct out_frame *frame = connection->out_head;
		struct iovec iov = { frame->data + frame->sent, frame->len - frame->sent };
		union {
			struct cmsghdr header;
			char bytes[CMSG_SPACE(sizeof(int) * MAX_FDS_PER_FRAME)];
		} control;
		struct msghdr message = { .msg_iov = &iov, .msg_iovlen = 1 };

		if (frame->sent == 0 && frame->n_fds > 0) {
			/* Descriptors ride on the first byte of their frame. */
			memset(&control, 0, sizeof(control));
			message.msg_control = control.bytes;
			message.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)frame->n_fds);
			struct cmsghdr *cmsg = CMSG_FIRSTHDR(&message);
			cmsg->cmsg_level = SOL_SOCKET;
			cmsg->cmsg_type = SCM_RIGHTS;
			cmsg->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)frame->n_fds);
			memcpy(CMSG_DATA(cmsg), frame->fds, sizeof(int) * (size_t)frame->n_fds);
		}
		ssize_t n = sendmsg(connection->fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
				return 0;
			log_debug("connection", "send failed", "connection=%llu error=%s",
				  (unsigned long long)connection->id, strerror(errno));
			connection_close(connection);
			return -1;
		}
		if (frame->n_fds > 0 && n > 0) {
			for (int i = 0; i < frame->n_fds; i++)
				close(frame->fds[i]);
			connection->out_fds -= frame->n_fds;
			frame->n_fds = 0;
		}
		frame->sent += (size_t)n;
		connection->out_bytes -= (size_t)n;
		if (frame->sent < frame->len)
			return 0;
		connection->out_head = frame->next;
		if (!connection->out_head)
			connection->out_tail = NULL;
		out_frame_free(frame);
	}
	return 0;
}

static int flush(struct connection *connection)
{
	if (flush_frames(connection) < 0)
		return -1;
	queue_account(connection);
	return 0;
}

int connection_send(struct connection *connection, uint8_t *data, size_t len,
		    const int *fds, int n_fds)
{
	struct out_frame *frame;
	int rc = -EPIPE;

	if (connection->state == CONNECTION_CLOSING)
		goto out_drop;
	rc = -EINVAL;
	if (n_fds > MAX_FDS_PER_FRAME)
		goto out_drop;
	rc = -ENOMEM;
	frame = calloc(1, sizeof(*frame));
	if (!frame)
		goto out_drop;
	frame->data = data;
	frame->len = len;
	frame->n_fds = n_fds;
	for (int i = 0; i < n_fds; i++)
		frame->fds[i] = fds[i];
	if (connection->out_tail)
		connection->out_tail->next = frame;
	else
		connection->out_head = frame;
	connection->out_tail = frame;
	connection->out_bytes += len;
	connection->out_fds += n_fds;
	/* Most replies fit the socket buffer: send now, no extra loop turn. */
	if (flush(connection) < 0)
		return 0;
	flow_update(connection);
	return 0;

out_drop:
	for (int i = 0; i < n_fds; i++)
		close(fds[i]);
	free(data);
	return rc;
}

static void request_begin(struct connection *connection)
{
	connection->in_flight++;
	connection_ref(connection);
}

void connection_request_begin(struct connection *connection)
{
	/* Runs inside a request, which ends after this one began: the flow
	 * is looked at then. */
	request_begin(connection);
}

void connection_request_end(struct connection *connection)
{
	connection->in_flight--;
	if (connection->state != CONNECTION_CLOSING)
		flow_update(connection);
	connection_unref(connection);
}

void connection_drain(struct connection *connection)
{
	if (connection->state == CONNECTION_CLOSING)
		return;
	connection->state = CONNECTION_DRAINING;
	poll_update(connection);
}

/* Hands every complete frame to the owner; stops early if the connection
 * was closed or paused meanwhile. Runs only from the loop's own callbacks
 * (readable, resume), never from inside a request: see flow_update. */
static void frames_dispatch(struct connection *connection)
{
	const uint8_t *frame;
	size_t len;
	int rc = 0;

	if (NEVER(connection->dispatching))
		return;
	connection->dispatching = true;
	while (connection->state == CONNECTION_OPEN &&
	       (rc = frame_reader_next(&connection->reader, &frame, &len)) == 1) {
		request_begin(connection);
		connection->callbacks->frame(connection, frame, len);
		if (connection->state == CONNECTION_CLOSING)
			return;
		frame_reader_consume(&connection->reader);
		flow_update(connection);
	}
	connection->dispatching = false;
	/* A descriptor arrives with the first byte of its frame: with no
	 * frame left, whole or partial, none is waiting for it. */
	if (frame_reader_buffered(&connection->reader) == 0)
		in_fds_close(connection);
	if (connection->state != CONNECTION_OPEN)
		return;
	if (rc < 0) {
		/* The stream cannot be resynchronised after an oversized frame:
		 * say why, then close once the reply is out. */
		request_begin(connection);
		connection->callbacks->frame_error(connection, rc);
		connection_drain(connection);
	} else if (connection->peer_closed) {
		/* Every whole frame is served; a partial one died with its sender. */
		connection_drain(connection);
	}
}

bool connection_accepting(const struct connection *connection)
{
	return connection->state == CONNECTION_OPEN && !connection->dispatching;
}

void connection_deliver(struct connection *connection, const uint8_t *frame, size_t len)
{
	if (NEVER(!connection_accepting(connection)))
		return;
	connection->dispatching = true;
	request_begin(connection);
	connection->callbacks->frame(connection, frame, len);
	if (connection->state == CONNECTION_CLOSING)
		return;
	connection->dispatching = false;
	flow_update(connection);
}

static void on_resume(uv_idle_t *handle)
{
	struct connection *connection = handle->data;
	uv_idle_stop(handle);
	if (connection->state == CONNECTION_OPEN)
		frames_dispatch(connection);
}

/* One recvmsg: bytes into the frame reader, a descriptor into in_fds.
 * Past CONNECTION_MAX_RECEIVED_FDS the rest are closed (the kernel closes
 * those that did not fit the control buffer). */
static ssize_t receive(struct connection *connection, uint8_t *buffer, size_t room)
{
	union {
		char bytes[CMSG_SPACE(sizeof(int) * CONNECTION_MAX_RECEIVED_FDS)];
		struct cmsghdr align;
	} control;
	struct iovec iov = { .iov_base = buffer, .iov_len = room };
	struct msghdr message = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = control.bytes,
		.msg_controllen = sizeof(control.bytes),
	};
	ssize_t n = recvmsg(connection->fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (n < 0)
		return n;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		const unsigned char *data = CMSG_DATA(c);
		for (int i = 0; i < count; i++) {
			int fd;
			memcpy(&fd, data + (size_t)i * sizeof(int), sizeof(int));
			if (connection->n_in_fds < CONNECTION_MAX_RECEIVED_FDS)
				connection->in_fds[connection->n_in_fds++] = fd;
			else
				close(fd);
		}
	}
	return n;
}

static void read_some(struct connection *connection)
{
	for (int i = 0; i < READS_PER_EVENT && connection->state == CONNECTION_OPEN; i++) {
		uint8_t *buffer;
		size_t room;
		int rc = frame_reader_buffer(&connection->reader, &buffer, &room);
		if (rc < 0) {
			frames_dispatch(connection);
			return;
		}
		ssize_t n = receive(connection, buffer, room);
		if (n == 0) {
			connection->peer_closed = true;
			frames_dispatch(connection);
			if (connection->state != CONNECTION_CLOSING)
				poll_update(connection);
			return;
		}
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
				return;
			connection_close(connection);
			return;
		}
		frame_reader_commit(&connection->reader, (size_t)n);
		frames_dispatch(connection);
		if ((size_t)n < room)
			return;
	}
}

static void on_poll(uv_poll_t *handle, int status, int events)
{
	struct connection *connection = handle->data;
	if (status < 0) {
		connection_close(connection);
		return;
	}
	if ((events & UV_WRITABLE) && flush(connection) < 0)
		return;
	if ((events & UV_READABLE) && connection->state == CONNECTION_OPEN)
		read_some(connection);
	if (connection->state != CONNECTION_CLOSING)
		flow_update(connection);
}

int connection_init(struct connection *connection, uv_loop_t *loop, int fd, uint32_t uid,
		    int32_t pid, const struct connection_callbacks *callbacks,
		    const struct connection_limits *limits, void *data)
{
	int rc;

	memset(connection, 0, sizeof(*connection));
	rc = uv_poll_init(loop, &connection->poll, fd);
	if (rc < 0)
		return rc;
	uv_idle_init(loop, &connection->resume);
	connection->resume.data = connection;
	connection->poll.data = connection;
	connection->fd = fd;
	connection->id = next_connection_id++;
	connection->uid = uid;
	connection->pid = pid;
	connection->callbacks = callbacks;
	connection->limits = limits;
	connection->data = data;
	connection->refs = 2;
	connection->state = CONNECTION_OPEN;
	frame_reader_init(&connection->reader, limits->max_frame_bytes);
	log_debug("connection", "accepted", "connection=%llu uid=%u pid=%d",
		  (unsigned long long)connection->id, connection->uid, connection->pid);
	poll_update(connection);
	return 0;
}

void connection_refuse_socket(int fd, const uint8_t *frame, size_t len)
{
	if (frame)
		(void)!send(fd, frame, len, MSG_NOSIGNAL | MSG_DONTWAIT);
	close(fd);
}
