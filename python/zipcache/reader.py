"""Reading a session's compressed form in this process (zipcache/reader.h).

The daemon keeps each layer as compressed blocks in the uid's pool plus an
exact fp16 residual; a session handle maps both read-only. This module
reads them without copies and reconstructs them with the codec here:

    with session.read(layer) as r:          # one consistent read (a seqlock)
        for block in r.blocks():            # block.key_payload: np.uint8 over the pool
            k, v = block.reconstruct()      # float16 [B, H, valid_tokens, D] copies
        rk, rv = r.residual()               # float16 views of the exact residual rows
    # leaving the block checks the read: ConcurrentWrite if the layer changed
    # under it (read again), StaleView if the view it read was dropped

``Session.reads(layer)`` retries for you (``for attempt in session.reads(0):
with attempt as r: ...``); ``Session.layer_blocks``, ``layer_residual`` and
``reconstruct_layer`` are one consistent read each.

How long what a read returned holds. Payload arrays point into the pool:
their bytes never change while the session refers to the block, but once
a trim drops it its extent may be freed and reused, so use them inside the
read (whose end tells you) or right after one. Residual arrays are views
of rows the daemon rewrites when the residual is compressed. Copy to keep.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from . import _lib
from ._lib import lib
from ._mapping import _mapped_array, _mapped_bytes
from .errors import ConcurrentWrite, StaleView, error_from_code

if TYPE_CHECKING:  # pragma: no cover
    from .client import Session

__all__ = ["Block", "LayerRead", "ReadAttempts"]


def _packed_strides(heads: int, rows: int, dim: int) -> _lib.zc_strides:
    return _lib.zc_strides(heads * rows * dim, rows * dim, dim)


class Block:
    """One compressed block of a layer, as the read it came from saw it.

    ``key_payload`` / ``value_payload`` are read-only ``np.uint8`` arrays over
    the pool mapping (docs/CODEC.md's layout for shape ``[B, H, tokens, D]``
    and the session's codec config, ``Session.info.codec``). Tokens
    ``[first_token, first_token + valid_tokens)`` of the layer are the first
    ``valid_tokens`` rows of the block's reconstruction.
    """

    __slots__ = ("layer", "index", "first_token", "tokens", "valid_tokens", "key_offset",
                 "value_offset", "key_payload", "value_payload", "_c", "_session", "_handle")

    def __init__(self, session: "Session", handle: Any, c: _lib.zc_block) -> None:
        self.layer = c.layer
        self.index = c.index
        self.first_token = c.first_token
        self.tokens = c.tokens
        self.valid_tokens = c.valid_tokens
        self.key_offset = c.key_offset
        self.value_offset = c.value_offset
        self.key_payload = _mapped_bytes(c.key_payload, c.key_bytes, handle, "block")
        self.value_payload = _mapped_bytes(c.value_payload, c.value_bytes, handle, "block")
        self._c = c
        self._session = session
        self._handle = handle

    def reconstruct(self) -> tuple[np.ndarray, np.ndarray]:
        """The block's valid rows, reconstructed here: float16 [B, H, valid_tokens, D] copies."""
        i = self._session.info
        rows = self.valid_tokens
        keys = np.empty((i.batch, i.kv_heads, rows, i.head_dim_k), dtype="<f2")
        values = np.empty((i.batch, i.kv_heads, rows, i.head_dim_v), dtype="<f2")
        ks = _packed_strides(i.kv_heads, rows, i.head_dim_k)
        vs = _packed_strides(i.kv_heads, rows, i.head_dim_v)
        rc = lib.zc_block_reconstruct_rows(self._handle.ptr, ctypes.byref(self._c),
                                           keys.ctypes.data, ctypes.byref(ks),
                                           values.ctypes.data, ctypes.byref(vs))
        if rc < 0:
            raise error_from_code(rc, f"block {self.index} of layer {self.layer} does not "
                                  "reconstruct", "reconstruct")
        return keys, values

    def __repr__(self) -> str:
        return (f"<zipcache.Block layer={self.layer} #{self.index} tokens "
                f"[{self.first_token}, {self.first_token + self.valid_tokens}) of {self.tokens} "
                f"K {self.key_payload.size} B V {self.value_payload.size} B>")


def _end_error(rc: int, layer: int) -> Exception:
    if rc == _lib.ZC_ESTALE:
        return StaleView(rc, f"layer {layer}'s view was dropped or rebuilt during the read",
                         operation="read")
    if rc == _lib.ZC_EAGAIN:
        return ConcurrentWrite(rc, f"layer {layer} changed during the read; read it again",
                               operation="read")
    return error_from_code(rc, f"cannot end the read of layer {layer}", "read")


class LayerRead:
    """One read of one layer (zc_read_begin .. zc_read_end); a context manager.

    Entering waits (bounded by ``timeout`` seconds; None: ZC_READ_TIMEOUT_MS)
    for the daemon to finish any write of the layer. Inside, ``tokens``,
    ``residual_tokens`` and ``n_blocks`` are the layer's counts, and
    ``blocks()``, ``block(i)``, ``residual()`` what it holds. Leaving checks
    that nothing changed: ConcurrentWrite if the layer was written meanwhile
    (read again), StaleView if the view was dropped or rebuilt. An error
    raised inside a read that then turns out torn becomes ConcurrentWrite
    (a torn read may see entries that make no sense); with retry=True the
    ConcurrentWrite is swallowed and ``retry`` set instead (ReadAttempts).
    """

    def __init__(self, session: "Session", layer: int, timeout: float | None = None,
                 retry: bool = False) -> None:
        self._session = session
        self.layer = layer
        self._timeout_ms = 0 if timeout is None else max(1, int(round(timeout * 1000)))
        self._retry = retry
        self.retry = False
        self._read: _lib.zc_read | None = None
        self._handle: Any = None

    # -- the protocol

    def begin(self) -> "LayerRead":
        handle = self._session._native()
        read = _lib.zc_read()
        rc = lib.zc_read_begin(handle.ptr, self.layer, self._timeout_ms, ctypes.byref(read))
        if rc < 0:
            raise error_from_code(rc, f"layer {self.layer} was still being written", "read")
        self._handle = handle
        self._read = read
        # Counted among the handle's users, so a release() meanwhile waits
        # for the read (and its arrays) before it unmaps.
        handle.holders.add(self)
        return self

    def end(self) -> None:
        """Raises ConcurrentWrite or StaleView unless the read saw one state."""
        rc = lib.zc_read_end(self._native(), ctypes.byref(self._read))
        self._handle.holders.discard(self)
        if rc != 0:
            raise _end_error(rc, self.layer)

    def __enter__(self) -> "LayerRead":
        return self.begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._read is None:
            return False
        rc = lib.zc_read_end(self._handle.ptr, ctypes.byref(self._read))
        self._handle.holders.discard(self)
        if rc == 0:
            return False  # consistent: whatever the body raised stands
        if rc == _lib.ZC_EAGAIN and self._retry:
            self.retry = True
            return True
        raise _end_error(rc, self.layer) from exc

    def _native(self) -> int:
        if self._read is None:
            raise error_from_code(_lib.ZC_EPRECONDITION, "the read has not begun", "read")
        return self._handle.ptr

    # -- what a read sees

    @property
    def tokens(self) -> int:
        return self._check().tokens

    @property
    def residual_tokens(self) -> int:
        return self._check().residual_tokens

    @property
    def n_blocks(self) -> int:
        return self._check().blocks

    @property
    def sequence(self) -> int:
        return self._check().sequence

    @property
    def generation(self) -> int:
        return self._check().generation

    @property
    def view_valid(self) -> bool:
        return bool(self._check().view_valid)

    def _check(self) -> _lib.zc_read:
        self._native()
        return self._read

    def block(self, index: int) -> Block:
        c = _lib.zc_block()
        rc = lib.zc_layer_block(self._native(), ctypes.byref(self._read), index, ctypes.byref(c))
        if rc < 0:
            raise error_from_code(rc, f"block {index} of layer {self.layer} is not readable",
                                  "read")
        return Block(self._session, self._handle, c)

    def blocks(self) -> list[Block]:
        return [self.block(i) for i in range(self.n_blocks)]

    def _contents(self) -> _lib.zc_layer_contents:
        c = _lib.zc_layer_contents()
        rc = lib.zc_layer_layout(self._native(), ctypes.byref(self._read), ctypes.byref(c))
        if rc < 0:
            if rc == _lib.ZC_ESTALE:
                raise StaleView(rc, f"layer {self.layer}'s residual rows are in its view, which "
                                "the daemon dropped: Session.view() brings it back",
                                operation="read")
            raise error_from_code(rc, f"layer {self.layer}'s layout is not readable", "read")
        return c

    def residual(self) -> tuple[np.ndarray, np.ndarray]:
        """The exact residual rows: read-only float16 [B, H, residual_tokens, D] views, no copy."""
        c = self._contents()
        i = self._session.info
        rows = c.residual_tokens
        keys = _mapped_array(c.residual_keys, (i.batch, i.kv_heads, rows, i.head_dim_k),
                             c.key_strides, self._handle, "residual")
        values = _mapped_array(c.residual_values, (i.batch, i.kv_heads, rows, i.head_dim_v),
                               c.value_strides, self._handle, "residual")
        return keys, values


class ReadAttempts:
    """``for attempt in session.reads(layer): with attempt as r: ...``

    Each attempt is a LayerRead; one the layer changed under is retried
    (its body ran, its results must be thrown away: only the last attempt's
    count), for up to ``timeout`` seconds (None: ZC_READ_TIMEOUT_MS), then
    ConcurrentWrite. StaleView is not retried: the view must come back first.
    """

    def __init__(self, session: "Session", layer: int, timeout: float | None = None) -> None:
        self._session = session
        self._layer = layer
        self._timeout = timeout
        self.attempts = 0

    def __iter__(self) -> Iterator[LayerRead]:
        limit = (self._timeout if self._timeout is not None else _lib.ZC_READ_TIMEOUT_MS / 1000)
        deadline = time.monotonic() + limit
        while True:
            self.attempts += 1
            left = max(deadline - time.monotonic(), 0.001)
            attempt = LayerRead(self._session, self._layer, left, retry=True)
            yield attempt
            if attempt._read is None or not attempt.retry:
                return
            if time.monotonic() >= deadline:
                raise _end_error(_lib.ZC_EAGAIN, self._layer)


def reconstruct_layer(session: "Session", layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Session.reconstruct_layer: the layer rebuilt here from its blocks and residual."""
    handle = session._native()
    i = session.info
    read = _lib.zc_read()
    tokens = ctypes.c_uint32(0)
    refreshed = False
    while True:
        rc = lib.zc_read_begin(handle.ptr, layer, 0, ctypes.byref(read))
        if rc < 0:
            raise error_from_code(rc, f"layer {layer} was still being written", "reconstruct")
        capacity = max(read.tokens, 1)
        keys = np.empty((i.batch, i.kv_heads, capacity, i.head_dim_k), dtype="<f2")
        values = np.empty((i.batch, i.kv_heads, capacity, i.head_dim_v), dtype="<f2")
        ks = _packed_strides(i.kv_heads, capacity, i.head_dim_k)
        vs = _packed_strides(i.kv_heads, capacity, i.head_dim_v)
        rc = lib.zc_layer_reconstruct(handle.ptr, layer, keys.ctypes.data, ctypes.byref(ks),
                                      values.ctypes.data, ctypes.byref(vs), capacity,
                                      ctypes.byref(tokens))
        if rc == _lib.ZC_EBUFFER:
            continue  # the layer grew since the count was read
        if rc == _lib.ZC_ESTALE and not refreshed:
            session.view(layer)  # a request brings a dropped view back
            refreshed = True
            continue
        if rc < 0:
            raise _end_error(rc, layer) if rc in (_lib.ZC_EAGAIN, _lib.ZC_ESTALE) else \
                error_from_code(rc, f"layer {layer} does not reconstruct", "reconstruct")
        n = tokens.value
        if n == capacity:
            return keys, values
        return (np.ascontiguousarray(keys[:, :, :n, :]), np.ascontiguousarray(values[:, :, :n, :]))
