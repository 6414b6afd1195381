/* The client's side of the socket: blocking I/O with timeouts and SCM_RIGHTS. */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "request_ring.h"
#include "ring_format.h"
#include "zipcache/error.h"

/*
 * The socket is blocking once connected, with SO_RCVTIMEO/SO_SNDTIMEO as
 * the client's timeout: a synchronous call is then one send and one
 * recvmsg that sleeps in the kernel until the reply is there. The
 * non-blocking alternative costs a recvmsg that fails with EAGAIN and a
 * poll before the recvmsg that succeeds: two system calls more per call.
 * Looks that must not wait (transport_receive_ready) pass MSG_DONTWAIT.
 */

/* Replies can carry a stats list for every layer; allow them room. */
#define MAX_REPLY_BYTES (64u << 20)

static int64_t now_ms(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* Waits for `events` until the deadline (-1: none). */
static int wait_for(int fd, short events, int64_t deadline)
{
	for (;;) {
		int timeout = -1;
		if (deadline >= 0) {
			int64_t left = deadline - now_ms();
			if (left <= 0)
				return -ETIMEDOUT;
			timeout = (int)left;
		}
		struct pollfd p = { .fd = fd, .events = events };
		int rc = poll(&p, 1, timeout);
		if (rc > 0)
			return 0;
		if (rc == 0)
			return -ETIMEDOUT;
		if (errno != EINTR)
			return -errno;
	}
}

static int64_t deadline_of(const struct transport *transport)
{
	return transport->timeout_ms > 0 ? now_ms() + transport->timeout_ms : -1;
}

int transport_connect(struct transport *transport, const char *path, int timeout_ms, int spin_us)
{
	struct sockaddr_un address = { .sun_family = AF_UNIX };
	int rc;

	memset(transport, 0, sizeof(*transport));
	transport->fd = -1;
	transport->timeout_ms = timeout_ms;
	transport->spin_us = spin_us;
	if (strlen(path) >= sizeof(address.sun_path))
		return -ENAMETOOLONG;
	memcpy(address.sun_path, path, strlen(path) + 1);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	rc = connect(fd, (const struct sockaddr *)&address, sizeof(address));
	if (rc < 0 && (errno == EAGAIN || errno == EINPROGRESS)) {
		/* A full backlog: wait, within the timeout, for the daemon to accept. */
		int error = 0;
		socklen_t length = sizeof(error);
		rc = wait_for(fd, POLLOUT, deadline_of(transport));
		if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error)
			rc = -error;
		if (rc < 0) {
			close(fd);
			return rc;
		}
	} else if (rc < 0) {
		rc = -errno;
		close(fd);
		return rc;
	}
	int flags = fcntl(fd, F_GETFL);
	if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0) {
		rc = -errno;
		close(fd);
		return rc;
	}
	transport->fd = fd;
	rc = transport_set_timeout(transport, timeout_ms);
	if (rc < 0) {
		close(fd);
		transport->fd = -1;
		return rc;
	}
	frame_reader_init(&transport->reader, MAX_REPLY_BYTES);
	return 0;
}

int transport_set_timeout(struct transport *transport, int timeout_ms)
{
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };

	transport->timeout_ms = timeout_ms;
	if (transport->fd < 0)
		return 0;
	if (setsockopt(transport->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0 ||
	    setsockopt(transport->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0)
		return -errno;
	return 0;
}

/* Whether a blocking call that returned EAGAIN ran out of the client's
 * time (its socket timeout fired, or the deadline passed between calls). */
static bool timed_out(int64_t deadline)
{
	return deadline >= 0 && now_ms() >= deadline;
}

void transport_close(struct transport *transport)
{
	for (int i = 0; i < transport->n_fds; i++)
		close(transport->fds[i]);
	transport->n_fds = 0;
	if (transport->fd >= 0)
		close(transport->fd);
	transport->fd = -1;
	frame_reader_free(&transport->reader);
	free(transport->ring_frame);
	transport->ring_frame = NULL;
	transport->ring = NULL;
}

int transport_set_ring(struct transport *transport, struct request_ring *ring)
{
	if (ring && !transport->ring_frame && !(transport->ring_frame = malloc(RING_REPLY_BYTES)))
		return -ENOMEM;
	transport->ring = ring;
	return 0;
}

/* A reply from the ring's reply area into the frame reader, only between
 * frames (never into the middle of one the socket is still delivering):
 * 1 when one came, 0 when none, or ZC_EPROTOCOL. */
static int ring_pull(struct transport *transport)
{
	size_t len;
	if (!transport->ring || frame_reader_buffered(&transport->reader) > 0)
		return 0;
	int rc = request_ring_reply(transport->ring, transport->ring_frame, &len);
	if (rc != 1)
		return rc;
	rc = frame_reader_feed(&transport->reader, transport->ring_frame, len);
	return rc < 0 ? rc : 1;
}

/* A whole frame already in hand: from the reader's buffer, else from the
 * ring's reply area; nudges (empty frames) skipped. 1 with *frame and
 * *len, 0 when the socket must be read, or a negative code. */
static int frame_in_hand(struct transport *transport, const uint8_t **frame, size_t *len)
{
	for (;;) {
		int rc = frame_reader_next(&transport->reader, frame, len);
		if (rc == 1 && *len == 0) {
			frame_reader_consume(&transport->reader);   /* a nudge */
			continue;
		}
		if (rc != 0)
			return rc;
		if ((rc = ring_pull(transport)) <= 0)
			return rc;
	}
}

static int receive_some(struct transport *transport, int64_t deadline, int flags);

/* receive_some, but a daemon that wrote its last reply into the ring and
 * then closed (a stop, a frame it refused) is heard out: the reply is
 * taken before the end of the stream is. */
static int socket_receive(struct transport *transport, int64_t deadline, int flags)
{
	int rc = receive_some(transport, deadline, flags);
	if (rc == -ECONNRESET && ring_pull(transport) == 1)
		return 0;
	return rc;
}

int transport_send(struct transport *transport, const uint8_t *data, size_t len)
{
	int64_t deadline = deadline_of(transport);
	if (transport->fd < 0)
		return -ENOTCONN;
	while (len > 0) {
		ssize_t n = send(transport->fd, data, len, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				/* SO_SNDTIMEO fired with the buffer still full. */
				if (deadline < 0 || timed_out(deadline))
					return -ETIMEDOUT;
				continue;
			}
			return -errno;
		}
		if (len > (size_t)n && timed_out(deadline))
			return -ETIMEDOUT;
		data += n;
		len -= (size_t)n;
	}
	return 0;
}

/* One recvmsg: bytes into the frame reader, descriptors into the FIFO.
 * With MSG_DONTWAIT in flags, -EAGAIN when nothing is there yet. */
static int receive_some(struct transport *transport, int64_t deadline, int flags)
{
	uint8_t *buffer;
	size_t room;
	int rc = frame_reader_buffer(&transport->reader, &buffer, &room);
	if (rc < 0)
		return rc;
	for (;;) {
		union {
			struct cmsghdr header;
			char bytes[CMSG_SPACE(sizeof(int) * TRANSPORT_MAX_FDS)];
		} control;
		struct iovec iov = { buffer, room };
		struct msghdr message = {
			.msg_iov = &iov,
			.msg_iovlen = 1,
			.msg_control = control.bytes,
			.msg_controllen = sizeof(control.bytes),
		};
		ssize_t n = recvmsg(transport->fd, &message, MSG_CMSG_CLOEXEC | flags);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				if (flags & MSG_DONTWAIT)
					return -EAGAIN;
				/* SO_RCVTIMEO fired (or a spurious wake-up). */
				if (deadline < 0 || !timed_out(deadline))
					continue;
				return -ETIMEDOUT;
			}
			return -errno;
		}
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c)) {
			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			const unsigned char *data = CMSG_DATA(c);
			for (int i = 0; i < count; i++) {
				int fd;
				memcpy(&fd, data + i * sizeof(int), sizeof(int));
				if (transport->n_fds < TRANSPORT_MAX_FDS)
					transport->fds[transport->n_fds++] = fd;
				else
					close(fd);
			}
		}
		if (message.msg_flags & MSG_CTRUNC)
			return ZC_EPROTOCOL;
		if (n == 0)
			return -ECONNRESET;
		frame_reader_commit(&transport->reader, (size_t)n);
		return 0;
	}
}

static int64_t now_ns(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/*
 * A reply a few microseconds away is cheaper to poll for than to sleep
 * for: a reader asleep in recvmsg must be woken by the daemon's send (an
 * inter-processor interrupt, a context switch on both sides), and it is
 * woken once more for nothing when the daemon reads the request (the
 * kernel wakes a blocked reader of a Unix socket when its own send buffer
 * drains). The caller of a synchronous call waits anyway; the spin is
 * bounded by spin_us (and the call's deadline, in ms as deadline_of), then
 * it sleeps as before. -EAGAIN: nothing came.
 */
static int receive_spin(struct transport *transport, int64_t deadline)
{
	if (transport->spin_us <= 0)
		return -EAGAIN;
	int64_t until = now_ns() + (int64_t)transport->spin_us * 1000;
	if (deadline >= 0 && until > deadline * 1000000)
		until = deadline * 1000000;
	/* With a ring the replies come in memory: the socket (a reply with
	 * descriptors, or too large for the ring) is looked at every
	 * SOCKET_EVERY turns, each one a system call. */
	enum { SOCKET_EVERY = 32 };
	unsigned turn = 0;
	do {
		int rc = ring_pull(transport);
		if (rc != 0)
			return rc < 0 ? rc : 0;
		if (!transport->ring || frame_reader_buffered(&transport->reader) > 0 ||
		    turn++ % SOCKET_EVERY == 0) {
			rc = socket_receive(transport, -1, MSG_DONTWAIT);
			if (rc != -EAGAIN)
				return rc;
		}
	} while (now_ns() < until);
	return -EAGAIN;
}

/* Sleeps in recvmsg, after asking the daemon for a nudge should its
 * reply go to the ring meanwhile. */
static int receive_sleep(struct transport *transport, int64_t deadline)
{
	if (transport->ring && frame_reader_buffered(&transport->reader) == 0 &&
	    request_ring_sleep(transport->ring))
		return 0;   /* it came: the caller pulls it */
	int rc = socket_receive(transport, deadline, 0);
	if (transport->ring)
		request_ring_awake(transport->ring);
	return rc;
}

int transport_receive(struct transport *transport, const uint8_t **frame, size_t *len)
{
	int64_t deadline = deadline_of(transport);
	if (transport->fd < 0)
		return -ENOTCONN;
	for (;;) {
		int rc = frame_in_hand(transport, frame, len);
		if (rc != 0)
			return rc < 0 ? rc : 0;
		if (timed_out(deadline))
			return -ETIMEDOUT;
		rc = receive_spin(transport, deadline);
		if (rc == -EAGAIN)
			rc = receive_sleep(transport, deadline);
		if (rc < 0)
			return rc;
	}
}

int transport_receive_ready(struct transport *transport, const uint8_t **frame, size_t *len)
{
	if (transport->fd < 0)
		return -ENOTCONN;
	for (;;) {
		int rc = frame_in_hand(transport, frame, len);
		if (rc != 0)
			return rc < 0 ? rc : 0;
		rc = socket_receive(transport, -1, MSG_DONTWAIT);
		if (rc < 0)
			return rc;
	}
}

void transport_consume(struct transport *transport)
{
	frame_reader_consume(&transport->reader);
}

int transport_take_fds(struct transport *transport, int *fds, int n)
{
	if (n > transport->n_fds)
		return ZC_EPROTOCOL;
	if (n == 0)
		return 0;
	memcpy(fds, transport->fds, sizeof(int) * (size_t)n);
	memmove(transport->fds, transport->fds + n, sizeof(int) * (size_t)(transport->n_fds - n));
	transport->n_fds -= n;
	return 0;
}

int transport_unclaimed_fds(const struct transport *transport)
{
	return transport->n_fds;
}

int transport_peer_closed(const struct transport *transport)
{
	struct pollfd p = { .fd = transport->fd, .events = POLLIN | POLLRDHUP };

	if (transport->fd < 0)
		return -ENOTCONN;
	/* A dead daemon's socket reads as end of stream: POLLRDHUP, or POLLHUP
	 * once both directions are gone. Bytes waiting (POLLIN alone) are not
	 * an end. */
	if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)))
		return -ECONNRESET;
	return 0;
}

int transport_send_fd(struct transport *transport, const uint8_t *data, size_t len, int fd)
{
	int64_t deadline = deadline_of(transport);
	union {
		char bytes[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control;
	if (transport->fd < 0)
		return -ENOTCONN;
	for (;;) {
		struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
		struct msghdr message = {
			.msg_iov = &iov,
			.msg_iovlen = 1,
			.msg_control = control.bytes,
			.msg_controllen = sizeof(control.bytes),
		};
		struct cmsghdr *cmsg = CMSG_FIRSTHDR(&message);
		cmsg->cmsg_level = SOL_SOCKET;
		cmsg->cmsg_type = SCM_RIGHTS;
		cmsg->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
		ssize_t n = sendmsg(transport->fd, &message, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			int rc = wait_for(transport->fd, POLLOUT, deadline);
			if (rc < 0)
				return rc;
			continue;
		}
		if (n < 0)
			return -errno;
		/* The descriptor went with the first byte; the rest is plain. */
		return transport_send(transport, data + n, len - (size_t)n);
	}
}
