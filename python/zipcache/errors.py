"""Exceptions: one class per daemon status, carrying the daemon's words.

libzipcache reports failures as negative codes (zipcache/error.h): -errno
for the operating system's errors, ZC_E* for zipcache's own. The daemon
answers with a wire status (INVALID_ARGUMENT, NOT_FOUND, ...) plus a
sentence; the C client turns the status back into a ZC_E* code and keeps
the sentence in zc_client_last_error(). These classes follow the status,
so callers can catch what they can act on (``except NotFound``) without
parsing text, and keep the code and both sentences for logs.

Some classes also derive from the matching Python built-in (ValueError,
LookupError, ConnectionError, ...) so generic handlers keep working.
"""

from __future__ import annotations

import errno as _errno

from . import _lib
from ._lib import lib

__all__ = [
    "ZipCacheError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "ResourceExhausted",
    "PermissionDenied",
    "FailedPrecondition",
    "Internal",
    "Unavailable",
    "DaemonRestarted",
    "ConnectionBroken",
    "StaleView",
    "ConcurrentWrite",
    "error_from_code",
]


class ZipCacheError(Exception):
    """A failed libzipcache call.

    Attributes:
        code: the negative code the C call returned (ZC_E* or -errno).
        name: its symbolic name, e.g. ``"ZC_EINVALID"`` or ``"ECONNREFUSED"``.
        status: the wire status it corresponds to, e.g. ``"INVALID_ARGUMENT"``;
            ``"UNAVAILABLE"`` when the daemon could not be reached at all.
        message: the daemon's (or the client's) sentence about this failure,
            from zc_client_last_error(); may be empty.
        description: zc_strerror(code), the generic sentence for the code.
    """

    status = "INTERNAL"

    def __init__(self, code: int, message: str = "", *, operation: str = "") -> None:
        self.code = code
        self.name = lib.zc_error_name(code).decode()
        self.description = lib.zc_strerror(code).decode()
        self.message = message
        self.operation = operation
        super().__init__(self._text())

    def _text(self) -> str:
        head = f"{self.operation}: " if self.operation else ""
        detail = self.message or self.description
        return f"{head}{detail} [{self.status}, {self.name}]"

    def __reduce__(self):  # keep pickling (multiprocessing) working
        # The instance's dict goes along: what a call added after the
        # error was made (update_many's ``applied``) survives the trip.
        return (error_from_code, (self.code, self.message, self.operation), dict(self.__dict__))


class InvalidArgument(ZipCacheError, ValueError):
    """The request was malformed: bad shape, NaN/Inf in K/V, bad codec config, wrong layer."""

    status = "INVALID_ARGUMENT"


class NotFound(ZipCacheError, LookupError):
    """No such session for this user (closed, expired, evicted, or never opened)."""

    status = "NOT_FOUND"


class AlreadyExists(ZipCacheError):
    """A session of that name exists; open it with ``attach=True`` to reuse it."""

    status = "ALREADY_EXISTS"


class ResourceExhausted(ZipCacheError):
    """A limit was reached: max_tokens, max_sessions, memory budget, frame size."""

    status = "RESOURCE_EXHAUSTED"


class PermissionDenied(ZipCacheError, PermissionError):
    """The daemon refused this user."""

    status = "PERMISSION_DENIED"


class FailedPrecondition(ZipCacheError):
    """The request is not valid in the current state (e.g. a released session handle)."""

    status = "FAILED_PRECONDITION"


class Internal(ZipCacheError):
    """The daemon failed, or its data did not match its layout."""

    status = "INTERNAL"


class DataLoss(Internal):
    """Data handed over is damaged: a snapshot that is truncated, fails a
    checksum or contradicts itself (ZC_ECORRUPT); the message names the
    region. Nothing was made."""


class Unavailable(ZipCacheError, ConnectionError):
    """The daemon could not be reached, or dropped the connection (reconnect)."""

    status = "UNAVAILABLE"


class DaemonRestarted(Unavailable):
    """A restarted daemon answered: sessions must be reopened with ``attach=True``."""


class StaleView(ZipCacheError):
    """A view was read after its lease ended or after the daemon dropped it.

    The arrays read may hold zeros or another session's bytes: fetch the
    layer again (``Session.view`` or the next ``update_and_fetch``).
    """


class ConcurrentWrite(ZipCacheError):
    """The layer changed while it was being read; read it again."""


class ConnectionBroken(Unavailable):
    """An earlier call broke the connection; every call refuses until ``Client.reconnect()``.

    A timeout, the daemon gone, or a reply that made no sense leaves the
    socket out of step: a late reply (and the descriptors it carries) could
    answer the next request. So after the first such failure (raised as
    Unavailable, e.g. ETIMEDOUT) the client refuses every call with this
    error, without touching the socket. ``Client.broken`` tells which
    failure it was. What became of the request that failed is unknown: it
    is applied wholly or not at all, and may still land later; see
    "Failures" in zipcache/client.h for how to find out.
    """


_BY_CODE: dict[int, type[ZipCacheError]] = {
    _lib.ZC_EINVALID: InvalidArgument,
    _lib.ZC_EBITS: InvalidArgument,
    _lib.ZC_EFRACTION: InvalidArgument,
    _lib.ZC_EGROUPSIZE: InvalidArgument,
    _lib.ZC_ESHAPE: InvalidArgument,
    _lib.ZC_ENONFINITE: InvalidArgument,
    _lib.ZC_ETENSOR: InvalidArgument,
    -_errno.EINVAL: InvalidArgument,
    -_errno.ENAMETOOLONG: InvalidArgument,
    _lib.ZC_ENOTFOUND: NotFound,
    _lib.ZC_EEXISTS: AlreadyExists,
    _lib.ZC_EEXHAUSTED: ResourceExhausted,
    _lib.ZC_EFRAMESIZE: ResourceExhausted,
    _lib.ZC_EBUFFER: ResourceExhausted,
    -_errno.ENOMEM: ResourceExhausted,
    -_errno.ENOSPC: ResourceExhausted,
    _lib.ZC_EDENIED: PermissionDenied,
    -_errno.EACCES: PermissionDenied,
    -_errno.EPERM: PermissionDenied,
    _lib.ZC_EPRECONDITION: FailedPrecondition,
    _lib.ZC_EINTERNAL: Internal,
    _lib.ZC_ECORRUPT: DataLoss,
    _lib.ZC_EDEVICE: Internal,
    _lib.ZC_EREMOTE: Unavailable,
    # A client-side ZC_EPROTOCOL means the reply made no sense: the
    # connection cannot be trusted any more, like a dropped one.
    _lib.ZC_EPROTOCOL: Unavailable,
    _lib.ZC_ERESTARTED: DaemonRestarted,
    _lib.ZC_EBROKEN: ConnectionBroken,
    _lib.ZC_ESTALE: StaleView,
    _lib.ZC_EAGAIN: ConcurrentWrite,
    -_errno.EPIPE: Unavailable,
    -_errno.ECONNRESET: Unavailable,
    -_errno.ECONNREFUSED: Unavailable,
    -_errno.ENOENT: Unavailable,
    -_errno.ETIMEDOUT: Unavailable,
    -_errno.EAGAIN: Unavailable,
}


def error_from_code(code: int, message: str = "", operation: str = "") -> ZipCacheError:
    """The exception for a negative libzipcache code (ZipCacheError if unmapped)."""
    cls = _BY_CODE.get(code, ZipCacheError)
    return cls(code, message, operation=operation)
