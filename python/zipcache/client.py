"""Client and Session: the Python face of libzipcache's blocking client.

Zero copy. A session's K/V views live in a shared mapping the C client
maps read-only once, at open. The arrays this module returns are numpy
views straight into that mapping (``owndata`` False, ``writeable`` False):
a fetch moves no K/V bytes at all, and writing through them is refused by
numpy before the kernel would (the pages are PROT_READ).

Lifetime. Every returned array holds, through its ``base``, a reference to
the native session handle, so the mapping cannot be unmapped under it:
closing a Session while arrays are still alive closes it on the daemon at
once but unmaps only when the last array is garbage collected, and such
arrays keep the last contents the daemon wrote. Closing the Client
likewise defers the unmapping (and the C client's disconnect) to them.

Contents. An array shows the layer as it was right after the call that
returned it. Later calls on the session may rewrite it in place: under the
streaming policy the newest tokens are exact fp16 until the residual is
compressed, then the daemon overwrites them with their reconstruction.
Use the arrays returned by the latest call, or copy (``np.array(view)``)
to keep a snapshot. Under memory pressure the daemon may also drop an idle
session's views (they read as zeros) until its next request rebuilds them.

The compressed form. ``Session.layer_blocks``, ``layer_residual``,
``read``/``reads`` and ``reconstruct_layer`` read the daemon's compressed
blocks (uint8 arrays over the pool mapping, no copy) and residual, and
reconstruct them here with the codec (zipcache.reader, zipcache/reader.h).

Threads. libzipcache handles belong to one thread at a time; a Client
serialises its own calls (and its sessions') with a lock, so sharing one
across threads is safe but not concurrent. Use one Client per thread for
parallelism; many clients may attach to the same daemon session.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _lib
from ._lib import lib
from ._mapping import _mapped_array
from .errors import InvalidArgument, NotFound, StaleView, ZipCacheError, error_from_code
from .reader import Block, LayerRead, ReadAttempts, reconstruct_layer

__all__ = [
    "Client",
    "Session",
    "CodecConfig",
    "Policy",
    "LayerStats",
    "SessionStats",
    "SessionInfo",
    "ServerInfo",
    "ServerStats",
    "default_socket_path",
]

_UINT32_MAX = 2**32 - 1


class Policy(enum.IntEnum):
    """How update_and_fetch blocks are cut for compression (see DESIGN.md).

    STREAMING (default): short blocks wait, exact, in an fp16 residual that
    is compressed once it holds ``residual_tokens`` tokens, so one-token
    decode steps do not pay a whole group's scales per token.
    PER_CALL: every block is compressed on arrival, as the seed did.
    """

    STREAMING = _lib.ZC_POLICY_STREAMING
    PER_CALL = _lib.ZC_POLICY_PER_CALL

    @classmethod
    def coerce(cls, value: "Policy | str | int") -> "Policy":
        if isinstance(value, str):
            try:
                return cls[value.upper().replace("-", "_")]
            except KeyError:
                raise ValueError(f"unknown policy {value!r}: use 'streaming' or 'per_call'") from None
        return cls(value)


_SALIENCY = {"key_norm": 0, "attention": 1}


@dataclass(frozen=True)
class CodecConfig:
    """The seed's ZipCache knobs (zc_codec_config); defaults as the seed's."""

    hi_bits: int = 4
    lo_bits: int = 2
    hi_fraction: float = 0.20
    group_size: int = 32
    quantize_values: bool = True
    # How residual flushes pick salient keys: "key_norm" (the contract)
    # or "attention" (the mass zc_attend measured; docs/ATTEND.md).
    saliency: str = "key_norm"

    def to_c(self) -> _lib.zc_codec_config:
        return _lib.zc_codec_config(
            int(self.hi_bits),
            int(self.lo_bits),
            float(self.hi_fraction),
            int(self.group_size),
            bool(self.quantize_values),
            _SALIENCY.get(self.saliency, -1),
        )

    @classmethod
    def from_c(cls, c: _lib.zc_codec_config) -> "CodecConfig":
        names = {v: k for k, v in _SALIENCY.items()}
        return cls(c.hi_bits, c.lo_bits, c.hi_fraction, c.group_size, bool(c.quantize_values),
                   names.get(c.saliency, str(c.saliency)))

    def validate(self) -> None:
        """Raises InvalidArgument for what the codec would refuse (zc_codec_config_validate)."""
        c = self.to_c()
        rc = lib.zc_codec_config_validate(ctypes.byref(c))
        if rc < 0:
            raise error_from_code(rc, f"invalid codec config {self}", "CodecConfig")


@dataclass(frozen=True)
class LayerStats:
    """The seed's byte accounting for one layer, or a session total (zc_layer_stats)."""

    layer: int
    tokens: int
    residual_tokens: int
    blocks: int
    compressed_key_bytes: int
    compressed_value_bytes: int
    baseline_key_bytes: int
    baseline_value_bytes: int
    fp16_key_bytes: int
    fp16_value_bytes: int
    compression_ratio: float
    effective_avg_bits: float

    @classmethod
    def from_c(cls, s: _lib.zc_layer_stats) -> "LayerStats":
        return cls(*(getattr(s, name) for name, _ in _lib.zc_layer_stats._fields_))

    @property
    def compressed_bytes(self) -> int:
        return self.compressed_key_bytes + self.compressed_value_bytes

    @property
    def fp16_bytes(self) -> int:
        return self.fp16_key_bytes + self.fp16_value_bytes

    @property
    def baseline_bytes(self) -> int:
        return self.baseline_key_bytes + self.baseline_value_bytes


@dataclass(frozen=True)
class SessionStats:
    layers: list[LayerStats]
    total: LayerStats


@dataclass(frozen=True)
class SessionInfo:
    id: int
    name: str
    layers: int
    batch: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int
    max_tokens: int
    codec: CodecConfig
    policy: Policy
    residual_tokens: int
    min_tokens: int
    max_layer_tokens: int
    idle_ms: int
    views: str = "full"        # "full" or "none"
    shared_bytes: int = 0      # of its blocks, bytes another session (a fork) refers to too
    leased: bool = False       # some client holds a lease on its views
    model_id: str = ""         # the caller's model id (open_session's model_id), "" if none

    @classmethod
    def from_c(cls, i: _lib.zc_session_info) -> "SessionInfo":
        return cls(
            i.id,
            i.name.decode(errors="replace"),
            i.layers,
            i.batch,
            i.kv_heads,
            i.head_dim_k,
            i.head_dim_v,
            i.max_tokens,
            CodecConfig.from_c(i.codec),
            Policy(i.policy),
            i.residual_tokens,
            i.min_tokens,
            i.max_layer_tokens,
            i.idle_ms,
            "none" if i.views == _lib.ZC_VIEWS_NONE else "full",
            i.shared_bytes,
            bool(i.leased),
            i.model_id.decode(errors="replace"),
        )


@dataclass(frozen=True)
class ServerInfo:
    protocol_version: int
    server_version: str
    boot_epoch: int
    max_frame_bytes: int
    max_inline_bytes: int
    max_sessions: int
    max_tokens_per_session: int
    memory_budget_bytes: int


@dataclass(frozen=True)
class ServerStats:
    sessions: int
    connections: int
    memory_used_bytes: int
    memory_budget_bytes: int
    requests: int
    request_errors: int
    tokens_appended: int
    uptime_ms: int
    boot_epoch: int


@dataclass(frozen=True)
class MemoryStats:
    """The sessions' memory as their files hold it, by kind (zc_memory_stats)."""
    charged_bytes: int    # what the budget counts
    file_bytes: int       # what the files hold
    views_bytes: int      # file_bytes by kind: fp16 views,
    blocks_bytes: int     # compressed blocks,
    residual_bytes: int   # exact residual rows,
    index_bytes: int      # block index,
    headers_bytes: int    # headers and commit areas
    set_aside_files: int  # session files the daemon did not adopt
    retained_bytes: int   # file_bytes' last kind: closed sessions' pages kept for new ones


def default_socket_path() -> str:
    """The socket a Client dials without a path: libzipcache's one rule.

    The same rule as zipcachectl's and as where zipcached listens when
    started without --socket (zc_default_socket_path in zipcache/client.h):
    $ZIPCACHE_SOCKET when set; else /run/zipcached.sock for root, else
    $XDG_RUNTIME_DIR/zipcached.sock, else /tmp/zipcached-UID.sock; and when
    no socket is there but the system service's /run/zipcached/zipcached.sock
    is, that one.
    """
    buffer = ctypes.create_string_buffer(4096)
    rc = lib.zc_default_socket_path(buffer, len(buffer))
    if rc < 0:
        raise error_from_code(rc, "the default socket path is too long "
                              "(see $ZIPCACHE_SOCKET and $XDG_RUNTIME_DIR)", "default_socket_path")
    return os.fsdecode(buffer.value)


# --- native handles ----------------------------------------------------------
#
# The C objects are owned by small handle objects whose finalizers free
# them. A session handle holds its client handle, and every array holds its
# session handle (via the array's base), so the C client is closed only
# after its last session is released, and a session is released (unmapped)
# only after its last array is gone.


class _ClientHandle:
    __slots__ = ("ptr", "lock", "_finalizer", "__weakref__")

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.lock = threading.RLock()
        self._finalizer = weakref.finalize(self, lib.zc_client_close, ptr)

    def last_error(self) -> str:
        return (lib.zc_client_last_error(self.ptr) or b"").decode(errors="replace")

    def check(self, rc: int, operation: str) -> int:
        """Raises the exception for a negative rc; call with the lock held."""
        if rc < 0:
            raise error_from_code(rc, self.last_error(), operation)
        return rc


class _SessionHandle:
    __slots__ = ("ptr", "client", "holders", "_finalizer", "__weakref__")

    def __init__(self, ptr: int, client: _ClientHandle) -> None:
        self.ptr = ptr
        self.client = client
        # The base objects of live arrays; weak, so they do not keep
        # themselves alive, but the arrays keep them (and us) alive.
        self.holders: "weakref.WeakSet[_ViewHolder]" = weakref.WeakSet()
        # The finalizer holds the client handle: released before closed.
        self._finalizer = weakref.finalize(self, _release_session, ptr, client)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def in_use(self) -> bool:
        return len(self.holders) > 0

    def release_now(self) -> None:
        self._finalizer()

    def forget(self) -> None:
        """The C side freed the handle (zc_session_close): never release it again."""
        self._finalizer.detach()


def _release_session(ptr: int, client: _ClientHandle) -> None:
    with client.lock:
        lib.zc_session_release(ptr)


# --- Client -------------------------------------------------------------------


def _timeout_ms(seconds: float | None) -> int:
    """libzipcache's timeout: milliseconds, at least 1; 0 for none."""
    if seconds is None:
        return 0
    if not seconds >= 0:
        raise InvalidArgument(-errno.EINVAL, f"a timeout is seconds >= 0 or None, got {seconds!r}",
                              operation="timeout")
    return max(1, int(round(seconds * 1000)))


class Client:
    """A connection to zipcached (zc_client).

    ``Client(path)`` connects and says hello; ``timeout`` (seconds, None for
    no limit) bounds the connect and every reply wait. Close it, or use it
    as a context manager; closing releases this client's session handles
    (the daemon keeps the sessions, as zc_client_close does; close them
    first to free them).

    After a failure. A call the daemon refuses (InvalidArgument, NotFound,
    ResourceExhausted, ...) changed nothing and the client stays usable. A
    timeout, the daemon gone or a reply that makes no sense (Unavailable)
    breaks the connection: every later call raises ConnectionBroken until
    ``reconnect()``, and the failed request is applied wholly or not at
    all, perhaps later (zipcache/client.h, "Failures", says how to find
    out).
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = 30.0) -> None:
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket_path()
        ptr = _lib.zc_client_p()
        rc = lib.zc_client_connect(self.socket_path.encode(), _timeout_ms(timeout),
                                   ctypes.byref(ptr))
        if rc < 0:
            reason = lib.zc_strerror(rc).decode()
            raise error_from_code(rc, f"cannot connect to zipcached at {self.socket_path}: {reason}",
                                  "connect")
        self._handle: _ClientHandle | None = _ClientHandle(ptr.value)
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self._timeout = timeout

    # -- plumbing

    def _native(self) -> _ClientHandle:
        if self._handle is None:
            raise error_from_code(_lib.ZC_EPRECONDITION, "the client is closed", "client")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Releases every session handle of this client and disconnects.

        Arrays still alive keep their mapping (and the connection, which
        the C library frees with it) until they are garbage collected.
        """
        if self._handle is None:
            return
        for session in list(self._sessions):
            session.release()
        self._handle = None  # zc_client_close runs when the last handle goes

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<zipcache.Client {self.socket_path!r} {state}>"

    # -- asynchronous updates (Session.update_async)

    def wait_all(self) -> None:
        """Waits for every asynchronous update of this client; raises the first refusal
        no call has reported yet (its message names the request)."""
        handle = self._native()
        with handle.lock:
            handle.check(lib.zc_wait_all(handle.ptr), "wait_all")

    def set_async(self, window: int | None = None, batch: int | None = None,
                  ring: int | None = None) -> None:
        """Asynchronous updates in flight at most (``window``, 1..64), how many go out
        in one write (``batch``, 1 = each at once), and the request ring's bytes
        (``ring``: made now, 64 KiB..16 MiB; 0 = every update on the socket;
        docs/RING.md); see zipcache/client.h."""
        handle = self._native()
        with handle.lock:
            if window is not None:
                handle.check(lib.zc_client_set_async_window(handle.ptr, int(window)), "set_async")
            if batch is not None:
                handle.check(lib.zc_client_set_async_batch(handle.ptr, int(batch)), "set_async")
            if ring is not None:
                handle.check(lib.zc_client_set_async_ring(handle.ptr, int(ring)), "set_async")

    @property
    def async_ring(self) -> tuple[int, int]:
        """The request ring's bytes (0: none on this connection) and the doorbells
        this client rang."""
        handle = self._native()
        size, doorbells = ctypes.c_size_t(0), ctypes.c_uint64(0)
        with handle.lock:
            handle.check(lib.zc_client_async_ring(handle.ptr, ctypes.byref(size),
                                                  ctypes.byref(doorbells)), "async_ring")
        return size.value, doorbells.value

    def set_receive_spin(self, microseconds: int) -> None:
        """How long a wait for a reply polls before it sleeps (0 .. 100000 us; the
        default is the library's ZC_RECEIVE_SPIN_US, 50); see zipcache/client.h."""
        handle = self._native()
        with handle.lock:
            handle.check(lib.zc_client_set_receive_spin(handle.ptr, int(microseconds)),
                         "set_receive_spin")

    # -- operations

    def open_session(self, **kwargs: Any) -> "Session":
        """Opens (or with attach=True, reattaches) a session; see Session."""
        return Session(self, **kwargs)

    def reconnect(self) -> bool:
        """Dials the socket again after the daemon dropped the connection.

        Returns True when the same daemon answered. Raises DaemonRestarted
        when a new one did: its sessions were adopted with their tokens,
        but every Session of this client must be reopened with attach=True
        (their mappings are stale). Either way the connection is usable
        again after ConnectionBroken; a failed reconnect leaves it broken.
        """
        handle = self._native()
        with handle.lock:
            handle.check(lib.zc_client_reconnect(handle.ptr), "reconnect")
        return True

    @property
    def broken(self) -> int:
        """0 while usable; else the (negative) code of the failure that broke the connection."""
        handle = self._native()
        with handle.lock:
            return lib.zc_client_broken(handle.ptr)

    @property
    def timeout(self) -> float | None:
        """The bound on every later wait, in seconds (None: no limit); settable."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        handle = self._native()
        with handle.lock:
            handle.check(lib.zc_client_set_timeout(handle.ptr, _timeout_ms(value)), "timeout")
        self._timeout = value

    @property
    def server_info(self) -> ServerInfo:
        handle = self._native()
        with handle.lock:
            i = lib.zc_client_server_info(handle.ptr).contents
            return ServerInfo(
                i.protocol_version,
                i.server_version.decode(errors="replace"),
                i.boot_epoch,
                i.max_frame_bytes,
                i.max_inline_bytes,
                i.max_sessions,
                i.max_tokens_per_session,
                i.memory_budget_bytes,
            )

    def stats(self) -> ServerStats:
        handle = self._native()
        s = _lib.zc_server_stats()
        with handle.lock:
            handle.check(lib.zc_client_stats(handle.ptr, ctypes.byref(s)), "stats")
        return ServerStats(*(getattr(s, name) for name, _ in _lib.zc_server_stats._fields_))

    def memory_stats(self) -> MemoryStats:
        """The sessions' memory as their files hold it, by kind."""
        handle = self._native()
        m = _lib.zc_memory_stats()
        with handle.lock:
            handle.check(lib.zc_client_memory_stats(handle.ptr, ctypes.byref(m)), "memory_stats")
        return MemoryStats(*(getattr(m, name) for name, _ in _lib.zc_memory_stats._fields_))

    def lookup_prefix(self, keys: Any, *, layers: int, kv_heads: int, head_dim: int,
                      batch: int = 1, head_dim_v: int | None = None,
                      codec: "CodecConfig | None" = None, model_id: str | None = None,
                      max_tokens: int = 1) -> PrefixHeld:
        """How many leading chunks of a chain (``chunk_keys`` of a prompt)
        the daemon holds for this user and this model id, shape and codec,
        itself or (with --remote) in the shared tier; open a session with
        ``prefix=keys[:held.chunks]`` and prefill only the rest."""
        handle = self._native()
        blob = _prefix_bytes(keys, "lookup_prefix")
        config, keep = _session_config(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, max_tokens=max_tokens,
            batch=batch, head_dim_v=head_dim_v, codec=codec, policy=Policy.STREAMING,
            residual_tokens=0, name=None, attach=False, views=0, model_id=model_id,
            operation="lookup_prefix")
        held = _lib.zc_prefix_held()
        with handle.lock:
            handle.check(lib.zc_client_lookup_prefix(handle.ptr, ctypes.byref(config), blob,
                                                     len(blob) // CHUNK_KEY_BYTES,
                                                     ctypes.byref(held)), "lookup_prefix")
        del keep
        return PrefixHeld(held.chunks, held.tokens, held.local_chunks)

    def import_session(self, source: Any, name: str | None = None, *,
                       model_id: str | None = None, fingerprint: int | None = None,
                       views: str = "source", check_finite: bool = False) -> "Session":
        """A new session from a snapshot (docs/SNAPSHOT.md).

        ``source`` is a path or a file object open for reading (its
        descriptor is passed to the daemon, which never opens a path). The
        daemon verifies everything before the session exists, and leaves
        nothing of a refused one: a damaged
        snapshot raises DataLoss naming the region, one of another model
        than ``model_id`` (or ``fingerprint``) FailedPrecondition.
        ``views``: "source" (the exported session's), "full" or "none".
        """
        options = _lib.zc_import_options()
        lib.zc_import_options_default(ctypes.byref(options))
        name_bytes = name.encode() if name else None
        model_bytes = model_id.encode() if model_id is not None else None
        options.name = name_bytes
        options.model_id = model_bytes
        if fingerprint is not None:
            options.check_fingerprint = True
            options.fingerprint = fingerprint
        options.views = _lib.ZC_VIEWS_SOURCE if views == "source" else \
            _views_code(views, "import_session")
        handle = self._native()
        ptr = _lib.zc_session_p()
        with _descriptor(source, os.O_RDONLY) as fd:
            with handle.lock:
                handle.check(lib.zc_session_import(handle.ptr, fd, ctypes.byref(options),
                                                   ctypes.byref(ptr)), "import_session")
        return Session._wrap(self, ptr.value, check_finite)

    def list_sessions(self) -> list[SessionInfo]:
        """This user's sessions on the daemon (not only this client's)."""
        handle = self._native()
        count = ctypes.c_size_t(0)
        with handle.lock:
            # Sessions may open between the two calls: ask until it fits.
            capacity = 16
            while True:
                infos = (_lib.zc_session_info * capacity)()
                handle.check(lib.zc_client_list_sessions(handle.ptr, infos, capacity,
                                                         ctypes.byref(count)), "list_sessions")
                if count.value <= capacity:
                    return [SessionInfo.from_c(infos[i]) for i in range(count.value)]
                capacity = count.value


# --- prefix reuse (docs/PREFIX.md) ---------------------------------------------

#: Tokens of one prefix chunk: one compressed block per layer.
CHUNK_TOKENS = _lib.ZC_PREFIX_CHUNK_TOKENS
#: Bytes of one chunk's chain key.
CHUNK_KEY_BYTES = _lib.ZC_CHUNK_KEY_BYTES
#: Chain keys one lookup_prefix or open_session(prefix=...) may carry.
MAX_PREFIX_CHUNKS = _lib.ZC_PREFIX_MAX_CHUNKS


def _token_ids(token_ids: Any, what: str) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise InvalidArgument(_lib.ZC_EINVALID, f"{what} must be a non-empty 1-D sequence of "
                              f"integer token ids, got {array.dtype} of shape {array.shape}",
                              operation="chunk_chain")
    if array.min() < 0 or array.max() > _UINT32_MAX:
        raise InvalidArgument(_lib.ZC_EINVALID, f"{what}: token ids must be in 0..{_UINT32_MAX}",
                              operation="chunk_chain")
    return np.ascontiguousarray(array, dtype="<u4")


def chunk_chain(prev: bytes | None, token_ids: Any) -> bytes:
    """The chain key of one chunk: XXH3-128 over ``prev`` (the previous
    chunk's key; None for the first chunk, read as 16 zero bytes) followed
    by the chunk's token ids as little-endian uint32, in xxHash's canonical
    (big-endian) form. The C library's ``zc_chunk_chain``, so bit-identical."""
    ids = _token_ids(token_ids, "token_ids")
    if prev is not None and (not isinstance(prev, (bytes, bytearray)) or
                             len(prev) != CHUNK_KEY_BYTES):
        raise InvalidArgument(_lib.ZC_EINVALID, f"prev must be {CHUNK_KEY_BYTES} bytes or None",
                              operation="chunk_chain")
    out = ctypes.create_string_buffer(CHUNK_KEY_BYTES)
    prev_buffer = None if prev is None else ctypes.create_string_buffer(bytes(prev), CHUNK_KEY_BYTES)
    rc = lib.zc_chunk_chain(prev_buffer, ids.ctypes.data, ids.size, out)
    if rc < 0:
        raise error_from_code(rc, "chunk_chain refused its arguments", "chunk_chain")
    return out.raw


def chunk_keys(token_ids: Any) -> list[bytes]:
    """The chain keys of a prompt's whole chunks (its first
    ``len(token_ids) // CHUNK_TOKENS * CHUNK_TOKENS`` tokens); the tail that
    is not a whole chunk has none."""
    ids = _token_ids(token_ids, "token_ids")
    keys: list[bytes] = []
    prev = None
    for start in range(0, ids.size - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        prev = chunk_chain(prev, ids[start:start + CHUNK_TOKENS])
        keys.append(prev)
    return keys


def _prefix_bytes(keys: Any, operation: str) -> bytes:
    """Chain keys (a list of 16-byte keys, or their concatenation) as one blob."""
    blob = bytes(keys) if isinstance(keys, (bytes, bytearray)) else b"".join(bytes(k) for k in keys)
    if isinstance(keys, (list, tuple)) and any(len(k) != CHUNK_KEY_BYTES for k in keys):
        raise InvalidArgument(_lib.ZC_EINVALID, f"every chain key is {CHUNK_KEY_BYTES} bytes",
                              operation=operation)
    if len(blob) % CHUNK_KEY_BYTES:
        raise InvalidArgument(_lib.ZC_EINVALID,
                              f"chain keys are {CHUNK_KEY_BYTES} bytes each; got {len(blob)} bytes",
                              operation=operation)
    if len(blob) // CHUNK_KEY_BYTES > MAX_PREFIX_CHUNKS:
        raise InvalidArgument(_lib.ZC_EINVALID,
                              f"{len(blob) // CHUNK_KEY_BYTES} chain keys; at most "
                              f"{MAX_PREFIX_CHUNKS} per call", operation=operation)
    return blob


@dataclass(frozen=True)
class PrefixHeld:
    """What lookup_prefix found: leading chunks of the chain held in every
    layer (here or in the remote tier), their tokens, and how many of them
    this daemon holds itself."""
    chunks: int
    tokens: int
    local_chunks: int


def _session_config(*, layers: int, kv_heads: int, head_dim: int, max_tokens: int, batch: int,
                    head_dim_v: int | None, codec: "CodecConfig | None", policy: Any,
                    residual_tokens: int, name: str | None, attach: bool, views: int,
                    model_id: str | None, operation: str) -> tuple[Any, list[Any]]:
    """The C config of a session (open_session's and lookup_prefix's), and
    the buffers it points into, which must outlive the call."""
    codec = codec if codec is not None else CodecConfig()
    for label, value in (("layers", layers), ("batch", batch), ("kv_heads", kv_heads),
                         ("head_dim", head_dim), ("max_tokens", max_tokens),
                         ("head_dim_v", head_dim if head_dim_v is None else head_dim_v),
                         ("residual_tokens", residual_tokens)):
        if not isinstance(value, (int, np.integer)) or not 0 <= value <= _UINT32_MAX:
            raise InvalidArgument(_lib.ZC_EINVALID,
                                  f"{label} must be an integer in 0..{_UINT32_MAX}, got {value!r}",
                                  operation=operation)
    config = _lib.zc_session_config()
    lib.zc_session_config_default(ctypes.byref(config))
    name_bytes = name.encode() if name else None
    config.name = name_bytes
    config.layers = layers
    config.batch = batch
    config.kv_heads = kv_heads
    config.head_dim_k = head_dim
    config.head_dim_v = head_dim if head_dim_v is None else head_dim_v
    config.max_tokens = max_tokens
    config.codec = codec.to_c()
    config.policy = int(Policy.coerce(policy))
    config.residual_tokens = residual_tokens
    config.attach = attach
    config.views = views
    model_bytes = model_id.encode() if model_id else None
    config.model_id = model_bytes
    return config, [name_bytes, model_bytes]


# --- Session ------------------------------------------------------------------


def _check_block(x: Any, what: str, batch: int, heads: int, head_dim: int,
                 tokens: int | None, operation: str = "update_and_fetch") -> np.ndarray:
    """Validates one K or V block and returns it as a C-contiguous <f2 array.

    Everything is checked here, before a byte is sent, so a bad call leaves
    the session untouched and fails with a precise message. A block that is
    not C-contiguous (a transpose, a strided slice, a view returned by this
    module) is copied into one, since the wire format is C order.
    """
    array = np.asarray(x)
    if array.dtype.kind != "f" or array.dtype.itemsize != 2:
        raise TypeError(f"{what} must be float16, got {array.dtype}")
    if array.ndim != 4:
        raise InvalidArgument(_lib.ZC_ESHAPE,
                              f"{what} must be 4-D [B, H, S, D], got shape {array.shape}",
                              operation=operation)
    b, h, s, d = array.shape
    if (b, h, d) != (batch, heads, head_dim) or s < 1 or (tokens is not None and s != tokens):
        want_s = "S>=1" if tokens is None else str(tokens)
        raise InvalidArgument(
            _lib.ZC_ESHAPE,
            f"{what} must have shape [B, H, S, D] = [{batch}, {heads}, {want_s}, {head_dim}], "
            f"got {array.shape}",
            operation=operation,
        )
    if s > _UINT32_MAX:
        raise InvalidArgument(_lib.ZC_ESHAPE, f"{what}: {s} tokens in one block is too many",
                              operation=operation)
    return np.ascontiguousarray(array, dtype="<f2")


class _descriptor:
    """A descriptor for a path (opened here, closed after) or a file
    object (its own, flushed first), for export and import."""

    def __init__(self, source: Any, flags: int) -> None:
        self._source = source
        self._flags = flags
        self._owned: int | None = None

    def __enter__(self) -> int:
        if isinstance(self._source, (str, bytes, os.PathLike)):
            mode = self._flags | os.O_CLOEXEC
            if self._flags & os.O_WRONLY:
                mode |= os.O_CREAT | os.O_TRUNC
            self._owned = os.open(self._source, mode, 0o600)
            return self._owned
        flush = getattr(self._source, "flush", None)
        if flush is not None:
            flush()
        return self._source.fileno()

    def __exit__(self, *exc: Any) -> None:
        if self._owned is not None:
            os.close(self._owned)


def _views_code(views: str, operation: str) -> int:
    codes = {"full": _lib.ZC_VIEWS_FULL, "none": _lib.ZC_VIEWS_NONE, "source": _lib.ZC_VIEWS_FULL}
    if views not in codes:
        raise InvalidArgument(_lib.ZC_EINVALID,
                              f"views must be 'full' or 'none', got {views!r}", operation=operation)
    return codes[views]


class Session:
    """One sequence (or batch of sequences) of one model on the daemon.

    Opening gives the shape the daemon sizes the views for; every block sent
    must match it. ``head_dim`` is K's head dim and also V's unless
    ``head_dim_v`` says otherwise. ``name`` must be unique per user (None:
    the daemon picks one); ``attach=True`` reuses the session of that name
    if it exists, provided it has the shape, max_tokens, codec and policy
    given here (and residual_tokens, unless 0 or per_call): any difference
    raises InvalidArgument naming it, and the session is left as it was.
    ``views="none"`` keeps no fp16 at all: the session costs its compressed
    blocks and its exact residual; ``update_and_fetch`` then returns the
    layer's token count, and the layer is read with ``read``,
    ``layer_blocks``, ``layer_residual`` or ``reconstruct_layer``.
    ``prefix`` (chain keys from ``chunk_keys``, as many leading ones as
    ``Client.lookup_prefix`` found) starts the session with those chunks'
    blocks, shared with whoever made them (docs/PREFIX.md); NotFound when
    one is not held for this user, model id, shape and codec.
    ``check_finite=True`` rejects NaN/Inf before sending rather than
    leaving it to the daemon (which always checks): it saves a round trip
    on bad data at the cost of a scan of every block.

    A Session is a context manager: leaving the block closes it on the
    daemon. ``release()`` drops only this handle and keeps the daemon's
    session for a later attach; so does dropping a Session without
    closing it (the daemon then frees it after its idle TTL).
    """

    def __init__(
        self,
        client: Client,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        batch: int = 1,
        head_dim_v: int | None = None,
        codec: CodecConfig | None = None,
        policy: Policy | str | int = Policy.STREAMING,
        residual_tokens: int = 0,
        name: str | None = None,
        attach: bool = False,
        check_finite: bool = False,
        views: str = "full",
        model_id: str | None = None,
        prefix: Any = None,
        _fork_of: tuple["Session", int] | None = None,
    ) -> None:
        self._client = client
        self.check_finite = check_finite
        client_handle = client._native()
        if views == "source" and _fork_of is None:
            raise InvalidArgument(_lib.ZC_EINVALID, "views must be 'full' or 'none'",
                                  operation="open_session")
        config, keep = _session_config(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, max_tokens=max_tokens,
            batch=batch, head_dim_v=head_dim_v, codec=codec, policy=policy,
            residual_tokens=residual_tokens, name=name, attach=attach,
            views=_views_code(views, "open_session"), model_id=model_id,
            operation="open_session")
        name_bytes = keep[0]
        if prefix is not None:
            blob = _prefix_bytes(prefix, "open_session")
            prefix_buffer = ctypes.create_string_buffer(blob, max(len(blob), 1))
            keep.append(prefix_buffer)
            config.prefix = ctypes.cast(prefix_buffer, ctypes.c_void_p)
            config.prefix_chunks = len(blob) // CHUNK_KEY_BYTES
        ptr = _lib.zc_session_p()
        with client_handle.lock:
            if _fork_of is None:
                client_handle.check(
                    lib.zc_session_open(client_handle.ptr, ctypes.byref(config), ctypes.byref(ptr)),
                    "open_session")
            else:
                source, tokens = _fork_of
                client_handle.check(
                    lib.zc_session_fork(source._native().ptr, tokens, name_bytes,
                                        _lib.ZC_VIEWS_SOURCE if views == "source" else
                                        config.views, ctypes.byref(ptr)),
                    "fork_session")
            self._adopt_handle(client_handle, ptr.value)

    @classmethod
    def _wrap(cls, client: Client, ptr: Any, check_finite: bool) -> "Session":
        """A Session over a native handle made elsewhere (an import)."""
        self = cls.__new__(cls)
        self._client = client
        self.check_finite = check_finite
        self._adopt_handle(client._native(), ptr)
        return self

    def _adopt_handle(self, client_handle: Any, ptr: Any) -> None:
        client = self._client
        self._handle: _SessionHandle | None = _SessionHandle(ptr, client_handle)
        self._info = SessionInfo.from_c(lib.zc_session_get_info(ptr).contents)
        client._sessions.add(self)
        self._state = "open"  # "closed" (on the daemon) or "released" (handle only)
        n = self._info.layers
        # Per layer, arrays over the whole [B, H, max_tokens, D] view, built
        # once; each fetch returns a slice of them (no allocation per call
        # beyond the slice object).
        self._full: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n
        # Per layer, stats from the last reply and the layer sequence they
        # belong to, so the accounting properties cost no round trip until
        # the layer changes.
        self._stats: list[tuple[int, LayerStats | _lib.zc_layer_stats] | None] = [None] * n
        # Called before the handle goes (close, release): what others hold
        # over its mappings, e.g. a GPU context's pins, is let go first.
        self._release_hooks: list[Any] = []

    # -- plumbing

    def _native(self) -> _SessionHandle:
        if self._handle is None:
            if self._state == "closed":
                # The daemon would say the same of the id: it no longer exists.
                raise error_from_code(_lib.ZC_ENOTFOUND,
                                      f"session {self._info.name!r} was closed", "session")
            raise error_from_code(_lib.ZC_EPRECONDITION,
                                  f"this handle of session {self._info.name!r} was released; "
                                  "open it again with attach=True", "session")
        self._client._native()  # raises if the client was closed
        return self._handle

    def _check_layer(self, layer: int, operation: str) -> int:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self._info.layers:
            raise InvalidArgument(
                _lib.ZC_EINVALID,
                f"layer {layer!r} out of range: session has {self._info.layers} layers",
                operation=operation,
            )
        return int(layer)

    def _arrays(self, handle: _SessionHandle, layer: int, view: _lib.zc_view,
                tokens: int) -> tuple[np.ndarray, np.ndarray]:
        full = self._full[layer]
        if full is None:
            i = self._info
            keys = _mapped_array(view.keys, (i.batch, i.kv_heads, i.max_tokens, i.head_dim_k),
                                 view.key_strides, handle)
            values = _mapped_array(view.values, (i.batch, i.kv_heads, i.max_tokens, i.head_dim_v),
                                   view.value_strides, handle)
            full = self._full[layer] = (keys, values)
        return full[0][:, :, :tokens, :], full[1][:, :, :tokens, :]

    def _sequence(self, handle: _SessionHandle, layer: int) -> int:
        """The layer's update counter, from the mapping: with views="none"
        through the reader (there is no view to ask), else as view() reads it."""
        if self._info.views != "none":
            return self._read_view(handle, layer).sequence
        read = _lib.zc_read()
        client = handle.client
        with client.lock:
            client.check(lib.zc_read_begin(handle.ptr, layer, 0, ctypes.byref(read)), "stats")
        return read.sequence

    def _read_view(self, handle: _SessionHandle, layer: int) -> _lib.zc_view:
        view = _lib.zc_view()
        client = handle.client
        with client.lock:
            client.check(lib.zc_session_view(handle.ptr, layer, ctypes.byref(view)), "view")
        return view

    # -- public surface

    @property
    def info(self) -> SessionInfo:
        """Shape, codec and policy as the daemon holds them (refreshed by stats())."""
        return self._info

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def id(self) -> int:
        return self._info.id

    @property
    def layers(self) -> int:
        return self._info.layers

    @property
    def closed(self) -> bool:
        return self._handle is None

    def set_attention_mass(self, layer: int, first_token: int, mass: Any) -> None:
        """The attention masses the next update of ``layer`` carries (saliency="attention").

        ``mass`` is float32 [B, kv_heads, n]: what tokens first_token ..
        first_token + n - 1 of the layer received (zipcache.attend's
        AttentionMass, or a MassAccumulator's running figure); the daemon
        ranks the residual's next flush by them. Only the next update
        (update_and_fetch, update_async, ...) carries them; a later call
        replaces them, ``None`` clears them. FailedPrecondition for a
        key_norm session; InvalidArgument for a shape that is not [B,
        kv_heads, n] with 1 <= n <= residual_tokens, or NaN, Inf or negative
        masses; nothing is kept then.
        """
        handle = self._native()
        layer = self._check_layer(layer, "set_attention_mass")
        i = self._info
        client = handle.client
        if mass is None:
            with client.lock:
                client.check(lib.zc_session_set_attention_mass(handle.ptr, layer, 0, None, 0),
                             "set_attention_mass")
            return
        mass = np.ascontiguousarray(mass, dtype="<f4")
        if mass.ndim != 3 or mass.shape[:2] != (i.batch, i.kv_heads) or mass.shape[2] < 1:
            raise InvalidArgument(_lib.ZC_EINVALID,
                                  f"attention masses must be float32 [{i.batch}, {i.kv_heads}, n], "
                                  f"got shape {list(mass.shape)}", operation="set_attention_mass")
        if not isinstance(first_token, (int, np.integer)) or not 0 <= first_token < 2**32:
            raise InvalidArgument(_lib.ZC_EINVALID, f"first_token {first_token!r} out of range",
                                  operation="set_attention_mass")
        with client.lock:
            client.check(lib.zc_session_set_attention_mass(handle.ptr, layer, int(first_token),
                                                           mass.ctypes.data, mass.size),
                         "set_attention_mass")

    def update_and_fetch(self, layer: int, keys: Any, values: Any,
                         chunk_key: bytes | None = None) -> Any:
        """Appends a [B, H, S, D] float16 block to ``layer``; returns the whole layer.

        With ``views="none"`` it returns the layer's token count instead
        (there is no fp16 view to hand out).

        The result is a pair of read-only float16 arrays [B, H, offset, D]
        that are views of the shared mapping, not copies (see the module
        docstring for how long their contents hold). Shape and dtype are
        checked before anything is sent. After a refusal nothing was
        stored; after Unavailable (the connection broke, see Client) the
        block is there wholly or not at all, and may still land later.

        ``chunk_key``: the block is one prefix chunk (exactly CHUNK_TOKENS
        tokens, on a layer holding whole chunks only) with this chain key;
        ``prefill_chunked`` sends a prompt that way.
        """
        handle = self._native()
        layer = self._check_layer(layer, "update_and_fetch")
        i = self._info
        keys = _check_block(keys, "keys", i.batch, i.kv_heads, i.head_dim_k, None)
        tokens = keys.shape[2]
        values = _check_block(values, "values", i.batch, i.kv_heads, i.head_dim_v, tokens)
        if self.check_finite:
            for what, block in (("keys", keys), ("values", values)):
                if not np.isfinite(block).all():
                    raise InvalidArgument(_lib.ZC_ENONFINITE,
                                          f"{what} contain NaN or Inf; nothing was sent",
                                          operation="update_and_fetch")
        view = _lib.zc_view()
        stats = _lib.zc_layer_stats()
        client = handle.client
        if chunk_key is not None and (not isinstance(chunk_key, (bytes, bytearray)) or
                                      len(chunk_key) != CHUNK_KEY_BYTES):
            raise InvalidArgument(_lib.ZC_EINVALID,
                                  f"chunk_key must be {CHUNK_KEY_BYTES} bytes",
                                  operation="update_and_fetch")
        with client.lock:
            if chunk_key is None:
                rc = lib.zc_update_and_fetch(handle.ptr, layer, tokens, keys.ctypes.data,
                                             values.ctypes.data, ctypes.byref(view),
                                             ctypes.byref(stats))
            else:
                rc = lib.zc_update_and_fetch_chunk(handle.ptr, layer, tokens, keys.ctypes.data,
                                                   values.ctypes.data, bytes(chunk_key),
                                                   ctypes.byref(view), ctypes.byref(stats))
            client.check(rc, "update_and_fetch")
        # Kept raw: converted only if someone asks (a decode step should not
        # pay for accounting nobody reads).
        self._stats[layer] = (view.sequence, stats)
        if not view.keys:
            return int(view.tokens)
        return self._arrays(handle, layer, view, view.tokens)

    def update_many(self, blocks: Any) -> int:
        """Appends many [B, H, S, D] float16 blocks, each ``(layer, keys, values)``,
        in order, without a round trip per block (a prefill of every layer);
        returns how many were applied.

        Every block's layer, shape and dtype (and, with ``check_finite``, its
        values) are checked before anything is sent. Large blocks go through
        two slots of the connection's staging buffer in turn, so the daemon
        compresses one while the next is copied. Each block is applied or
        refused on its own, as if sent alone: a refused one does not hold back
        those after it, and the first refusal is raised once all were sent.
        Every exception it raises carries ``applied``: how many blocks were
        applied (0 when a check failed before sending). The layers' contents
        are not returned: read them with ``view`` or ``reconstruct_layer``.
        """
        handle = self._native()
        i = self._info
        checked = []
        try:
            for n, block in enumerate(blocks):
                try:
                    layer, keys, values = block
                except (TypeError, ValueError):
                    raise InvalidArgument(_lib.ZC_EINVALID,
                                          f"block {n}: expected (layer, keys, values); nothing "
                                          "was sent", operation="update_many") from None
                layer = self._check_layer(layer, "update_many")
                keys = _check_block(keys, f"block {n} keys", i.batch, i.kv_heads, i.head_dim_k,
                                    None, "update_many")
                tokens = keys.shape[2]
                values = _check_block(values, f"block {n} values", i.batch, i.kv_heads,
                                      i.head_dim_v, tokens, "update_many")
                if self.check_finite:
                    for what, array in (("keys", keys), ("values", values)):
                        if not np.isfinite(array).all():
                            raise InvalidArgument(_lib.ZC_ENONFINITE,
                                                  f"block {n} {what} contain NaN or Inf; "
                                                  "nothing was sent", operation="update_many")
                checked.append((layer, tokens, keys, values))
        except (ZipCacheError, TypeError) as error:
            error.applied = 0
            raise
        if not checked:
            return 0
        updates = (_lib.zc_update * len(checked))()
        for n, (layer, tokens, keys, values) in enumerate(checked):
            updates[n] = _lib.zc_update(layer, tokens, keys.ctypes.data, values.ctypes.data)
        done = ctypes.c_size_t()
        client = handle.client
        with client.lock:
            rc = lib.zc_update_many(handle.ptr, updates, len(checked), ctypes.byref(done))
            for layer, _, _, _ in checked:
                self._stats[layer] = None  # the replies carry no stats
            if rc < 0:
                error = error_from_code(rc, client.last_error(), "update_many")
                error.applied = int(done.value)
                raise error
        return int(done.value)

    # -- zero-round-trip decode

    def update_async(self, layer: int, keys: Any, values: Any) -> int:
        """Sends a short [B, H, S, D] float16 block to ``layer`` without waiting; returns a ticket.

        Under the streaming policy the caller already holds what the daemon
        would hand back (the new tokens come back exact), so nothing is
        returned: ``wait(layer, ticket)`` or ``poll(layer, ticket)`` completes
        it, and a refusal raises there (or, once, from the next update_async
        or Client.wait_all), naming the request. Updates of a layer are
        applied in order; the client's window bounds how many are in flight.
        The block is copied before this returns.
        """
        handle = self._native()
        layer = self._check_layer(layer, "update_async")
        i = self._info
        keys = _check_block(keys, "keys", i.batch, i.kv_heads, i.head_dim_k, None,
                            "update_async")
        tokens = keys.shape[2]
        values = _check_block(values, "values", i.batch, i.kv_heads, i.head_dim_v, tokens,
                              "update_async")
        if self.check_finite:
            for what, block in (("keys", keys), ("values", values)):
                if not np.isfinite(block).all():
                    raise InvalidArgument(_lib.ZC_ENONFINITE,
                                          f"{what} contain NaN or Inf; nothing was sent",
                                          operation="update_async")
        ticket = ctypes.c_uint64()
        client = handle.client
        with client.lock:
            client.check(lib.zc_update_async(handle.ptr, layer, tokens, keys.ctypes.data,
                                             values.ctypes.data, ctypes.byref(ticket)),
                         "update_async")
        self._stats[layer] = None  # the reply carries no stats
        return int(ticket.value)

    def wait(self, layer: int, ticket: int) -> None:
        """Blocks until the daemon applied the update of ``ticket`` (raises its refusal)."""
        handle = self._native()
        layer = self._check_layer(layer, "wait")
        client = handle.client
        with client.lock:
            client.check(lib.zc_wait(handle.ptr, layer, int(ticket)), "wait")

    def poll(self, layer: int, ticket: int) -> bool:
        """Whether the update of ``ticket`` was applied, without blocking (raises its refusal)."""
        handle = self._native()
        layer = self._check_layer(layer, "poll")
        client = handle.client
        with client.lock:
            return client.check(lib.zc_poll(handle.ptr, layer, int(ticket)), "poll") == 1
    def prefill_chunked(self, layer: int, token_ids: Any, keys: Any, values: Any,
                        start: int = 0) -> list[bytes]:
        """Prefills tokens ``start..len(token_ids)`` of a prompt into ``layer``
        by the boundary rule of prefix reuse (docs/PREFIX.md): each whole
        chunk of CHUNK_TOKENS tokens as one block with its chain key, then
        the tail that is not a whole chunk as an ordinary block.

        ``keys``/``values`` are [B, H, len(token_ids) - start, D] float16,
        the K/V of exactly those tokens. ``start`` is where this layer
        stands: a multiple of CHUNK_TOKENS (0, or the tokens a prefix open
        gave). Returns the prompt's chain keys (``chunk_keys(token_ids)``).
        """
        ids = _token_ids(token_ids, "token_ids")
        if not isinstance(start, (int, np.integer)) or start < 0 or start % CHUNK_TOKENS or \
                start > ids.size:
            raise InvalidArgument(_lib.ZC_EINVALID,
                                  f"start must be a multiple of {CHUNK_TOKENS} within the prompt, "
                                  f"got {start!r}", operation="prefill_chunked")
        i = self._info
        tokens = ids.size - start
        if tokens == 0:
            return chunk_keys(ids) if ids.size >= CHUNK_TOKENS else []
        keys = _check_block(keys, "keys", i.batch, i.kv_heads, i.head_dim_k, tokens)
        values = _check_block(values, "values", i.batch, i.kv_heads, i.head_dim_v, tokens)
        chain = chunk_keys(ids) if ids.size >= CHUNK_TOKENS else []
        at = start
        for c in range(start // CHUNK_TOKENS, len(chain)):
            lo, hi = at - start, at - start + CHUNK_TOKENS
            self.update_and_fetch(layer, keys[:, :, lo:hi], values[:, :, lo:hi], chunk_key=chain[c])
            at += CHUNK_TOKENS
        if at < ids.size:
            self.update_and_fetch(layer, keys[:, :, at - start:], values[:, :, at - start:])
        return chain

    # -- forks and leases

    def fork(self, tokens: int, name: str | None = None, views: str = "source") -> "Session":
        """A new session whose first ``tokens`` tokens (of every layer) are this one's.

        Whole compressed blocks are shared by reference, the rest copied;
        both sessions then go on independently. ``views``: "source" (this
        session's), "full" or "none". For parallel sampling and beam search
        from one prompt, or branching a conversation.
        """
        i = self._info
        if not isinstance(tokens, (int, np.integer)) or not 0 <= tokens <= _UINT32_MAX:
            raise InvalidArgument(_lib.ZC_EINVALID, f"tokens must be in 0..{_UINT32_MAX}",
                                  operation="fork_session")
        if views != "source":
            _views_code(views, "fork_session")
        return Session(self._client, layers=i.layers, kv_heads=i.kv_heads, head_dim=i.head_dim_k,
                       head_dim_v=i.head_dim_v, max_tokens=i.max_tokens, batch=i.batch,
                       codec=i.codec, policy=i.policy, residual_tokens=i.residual_tokens,
                       name=name, views=views,
                       check_finite=self.check_finite, _fork_of=(self, int(tokens)))

    def export(self, target: Any) -> int:
        """Writes a verified snapshot of this session (docs/SNAPSHOT.md).

        ``target`` is a path (created or truncated, mode 0600) or a file
        object open for writing (a regular file or a pipe; written from its
        current position). The snapshot is a consistent cut after every
        earlier call on the session. Returns the bytes written.
        """
        handle = self._native()
        written = ctypes.c_uint64(0)
        with _descriptor(target, os.O_WRONLY) as fd:
            with handle.client.lock:
                handle.client.check(lib.zc_session_export(handle.ptr, fd, ctypes.byref(written)),
                                    "export_session")
        return written.value

    def release_views(self) -> None:
        """Ends this client's lease on the views: memory relief may drop them now.

        Arrays from earlier fetches must not be read after this (they may
        become zeros); the next ``view`` or update brings the views back.
        """
        handle = self._native()
        with handle.client.lock:
            handle.client.check(lib.zc_session_release_views(handle.ptr), "release")

    @property
    def lease_valid(self) -> bool:
        """Whether arrays fetched from this session are still leased (may be read)."""
        return lib.zc_session_lease_check(self._native().ptr) == 0

    def check_lease(self) -> None:
        """Raises StaleView once the lease on the views ended (fetch them again with ``view``)."""
        rc = lib.zc_session_lease_check(self._native().ptr)
        if rc < 0:
            raise error_from_code(rc, "the lease on this session's views ended: arrays fetched "
                                      "before may hold zeros; call view() again", "view")

    def view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer as it is now, without an update.

        Read from the mapping's header (no round trip, unless the daemon
        dropped the views under memory pressure and must rebuild them).
        """
        handle = self._native()
        layer = self._check_layer(layer, "view")
        v = self._read_view(handle, layer)
        return self._arrays(handle, layer, v, v.tokens)

    def last_residual_tokens(self, layer: int) -> int:
        """Exact residual tokens of ``layer`` as of this handle's last update reply (0: none yet).

        Those are the layer's last tokens and the only ones a later update
        can rewrite (a flush replaces them by their reconstruction); every
        token before them is final until a trim. The GPU mirror in
        zipcache.torch copies only from there on.
        """
        layer = self._check_layer(layer, "last_residual_tokens")
        cached = self._stats[layer]
        return int(cached[1].residual_tokens) if cached is not None else 0

    def to_device(self, layer: int, device: Any = "cuda") -> tuple[Any, Any]:
        """The layer's K and V as torch tensors on ``device`` (zipcache.torch.to_device)."""
        from .torch import to_device

        return to_device(self, layer, device)

    def tokens(self, layer: int) -> int:
        """Tokens stored in ``layer``; read as view() reads."""
        handle = self._native()
        layer = self._check_layer(layer, "tokens")
        return self._read_view(handle, layer).tokens

    # -- the compressed form, read in this process (zipcache/reader.h, reader.py)

    def read(self, layer: int, timeout: float | None = None) -> LayerRead:
        """One consistent read of ``layer``: ``with session.read(0) as r: r.blocks() ...``.

        Leaving the block raises ConcurrentWrite if the daemon wrote the
        layer meanwhile (read again, or use ``reads()``), StaleView if the
        view the read used was dropped or rebuilt. See zipcache.reader.
        """
        self._native()
        return LayerRead(self, self._check_layer(layer, "read"), timeout)

    def reads(self, layer: int, timeout: float | None = None) -> ReadAttempts:
        """Reads of ``layer`` retried until one is consistent (see ReadAttempts)."""
        self._native()
        return ReadAttempts(self, self._check_layer(layer, "read"), timeout)

    def layer_blocks(self, layer: int) -> list[Block]:
        """The layer's compressed blocks as one consistent read saw them.

        Each Block's ``key_payload`` / ``value_payload`` are read-only uint8
        arrays over the pool mapping (no copy) and ``reconstruct()`` runs the
        codec here. A block's bytes stay as they are while the session holds
        it; after a trim drops it they may be reused (see zipcache.reader).
        """
        blocks: list[Block] = []
        for attempt in self.reads(layer):
            with attempt as r:
                blocks = r.blocks()
        return blocks

    def layer_residual(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's exact residual rows: read-only float16 [B, H, residual_tokens, D] views.

        No copy: with views = full these are the view's last rows (the
        arrays share memory with ``view()``'s). A dropped view is brought
        back first (one request), as ``view()`` does.
        """
        for refreshed in (False, True):
            try:
                result = None
                for attempt in self.reads(layer):
                    with attempt as r:
                        result = r.residual()
                return result
            except StaleView:
                if refreshed:
                    raise
                self.view(layer)
        raise AssertionError("unreachable")

    def reconstruct_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer rebuilt in this process from its blocks and residual: (K, V) copies.

        float16 [B, H, tokens, D], C-contiguous, bit-identical to ``view()``'s
        arrays; one consistent read (retried while the daemon writes). A
        dropped view whose rows the residual needs is brought back first.
        """
        self._native()
        return reconstruct_layer(self, self._check_layer(layer, "reconstruct_layer"))

    @staticmethod
    def _trim_count(tokens: Any) -> int:
        if not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise InvalidArgument(_lib.ZC_EINVALID, f"cannot trim {tokens!r} tokens", operation="trim")
        return min(int(tokens), _UINT32_MAX)

    def trim(self, tokens: int) -> int:
        """Drops the last ``tokens`` tokens of every layer; returns the most any layer lost."""
        handle = self._native()
        count = self._trim_count(tokens)
        trimmed = ctypes.c_uint32(0)
        client = handle.client
        with client.lock:
            client.check(lib.zc_session_trim(handle.ptr, count, ctypes.byref(trimmed)), "trim")
        return trimmed.value

    def trim_layer(self, layer: int, tokens: int) -> int:
        """Drops the last ``tokens`` tokens of ``layer`` only; returns how many it lost.

        A layer holding fewer tokens loses all it has (min(offset, tokens)),
        as mlx_lm's per-layer ``cache.trim(n)``; other layers are untouched.
        """
        handle = self._native()
        layer = self._check_layer(layer, "trim")
        count = self._trim_count(tokens)
        trimmed = ctypes.c_uint32(0)
        client = handle.client
        with client.lock:
            client.check(lib.zc_session_trim_layer(handle.ptr, layer, count, ctypes.byref(trimmed)),
                         "trim")
        return trimmed.value

    def layer_stats(self, layer: int) -> LayerStats:
        """The byte accounting of one layer, current as of now.

        Served from the last reply while the layer's sequence counter (read
        from the mapping, no round trip) says nothing changed since; else
        fetched with stats().
        """
        handle = self._native()
        layer = self._check_layer(layer, "stats")
        cached = self._stats[layer]
        if cached is not None and cached[0] == self._sequence(handle, layer):
            stats = cached[1]
            if not isinstance(stats, LayerStats):
                stats = LayerStats.from_c(stats)
                self._stats[layer] = (cached[0], stats)
            return stats
        return self.stats().layers[layer]

    def stats(self) -> SessionStats:
        """Per-layer and total byte accounting from the daemon (one round trip)."""
        handle = self._native()
        n = self._info.layers
        layers = (_lib.zc_layer_stats * n)()
        total = _lib.zc_layer_stats()
        client = handle.client
        before = [self._sequence(handle, i) for i in range(n)]
        with client.lock:
            client.check(lib.zc_session_stats(handle.ptr, layers, n, ctypes.byref(total)), "stats")
            self._info = SessionInfo.from_c(lib.zc_session_get_info(handle.ptr).contents)
        result = SessionStats([LayerStats.from_c(layers[i]) for i in range(n)],
                              LayerStats.from_c(total))
        for i in range(n):
            if self._sequence(handle, i) == before[i]:
                self._stats[i] = (before[i], result.layers[i])
        return result

    def close(self) -> None:
        """Closes the session on the daemon (its memory is freed); idempotent.

        If arrays returned by this session are still alive, their mapping
        stays until they are collected (they keep the last contents).
        """
        handle = self._handle
        if handle is None:
            return
        self._run_release_hooks()
        self._handle = None
        self._state = "closed"
        self._full = [None] * self._info.layers  # our own arrays no longer pin the mapping
        client = handle.client
        if not handle.in_use():
            handle.forget()
            with client.lock:
                client.check(lib.zc_session_close(handle.ptr), "close")
            return
        # Arrays still point into this handle's mapping, which zc_session_close
        # would unmap: close the session by id instead and let the handle go
        # with the last array.
        with client.lock:
            client.check(lib.zc_client_close_session(client.ptr, self._info.id), "close")

    def release(self) -> None:
        """Drops this handle but keeps the session on the daemon (reopen with attach=True)."""
        handle = self._handle
        if handle is None:
            return
        self._run_release_hooks()
        self._handle = None
        self._state = "released"
        self._full = [None] * self._info.layers
        if not handle.in_use():
            handle.release_now()
        # else: released when the last array goes (the finalizer holds nothing else).

    def _run_release_hooks(self) -> None:
        hooks, self._release_hooks = self._release_hooks, []
        for hook in hooks:
            hook()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._handle is None or self._client.closed:
            return
        try:
            self.close()
        except NotFound:
            # Gone already (closed through another handle, expired, evicted):
            # what leaving the block asks for, and an error raised here
            # would hide the one that may be propagating.
            pass

    def __repr__(self) -> str:
        i = self._info
        state = self._state
        return (f"<zipcache.Session {i.name!r} id={i.id} layers={i.layers} "
                f"[{i.batch}, {i.kv_heads}, <={i.max_tokens}, {i.head_dim_k}/{i.head_dim_v}] "
                f"{i.policy.name.lower()} {state}>")
