"""Attention straight from compressed blocks, in-process (include/zipcache/attend.h).

    out = zipcache.attend(session, layer, q)             # one layer of a session
    out = zipcache.attend_arrays(q, [zipcache.AttendBlock(k_payload, v_payload, shape),
                                     (k_residual, v_residual)], causal=True)

``attend`` (zc_attend) reads one layer of a session in this process, its
compressed blocks in the pool mapping and its exact residual rows, inside one
consistent read (retried while the daemon writes), and attends over them
without reconstructing anything: what a ``views="none"`` session is for.
``over_view=True`` runs the same call over the fp16 view of a ``views="full"``
session instead (cut at the same blocks, so the result is the same bytes).

Saliency by attention (a session opened with CodecConfig(saliency="attention")):
``attend(..., mass=True)`` also returns each residual token's attention mass
(AttentionMass: the softmax probability it got, summed over the query rows of
its KV head's group); ``attend(..., mass=accumulator)`` with a MassAccumulator
adds them to a running figure per token (the mean over the calls that saw it,
the ZipCache paper's normalized score) and hands it to the layer's next update,
so the daemon's next flush of the residual ranks the tokens by it:

    acc = zipcache.MassAccumulator(session)
    for step ...:
        session.update_and_fetch(layer, k, v)         # carries the masses so far
        out = zipcache.attend(session, layer, q, mass=acc)

``attend_arrays`` is zc_attend_segments(), the compute core: a layer is a list
of segments in token order, each a compressed block as codec.compress() (or
the daemon) wrote it, or fp16 rows [B, H, T, D] (the exact residual, or a
whole fp16 view).

Both take queries [B, q_heads, n_q, D_k] float32 or float16, q_heads a
multiple of the KV heads, and give float32 (or float16) [B, q_heads, n_q,
D_v], equal to attention over the codec's reconstruction up to fp32 rounding,
with the same bytes on every ISA and thread count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Union

import numpy as np

from . import _lib
from ._lib import lib
from .client import CodecConfig
from .errors import ConcurrentWrite, StaleView, error_from_code

if TYPE_CHECKING:  # pragma: no cover
    from .client import Session

__all__ = ["AttendBlock", "AttentionMass", "MassAccumulator", "attend", "attend_arrays"]


@dataclass
class AttendBlock:
    """One compressed block of a layer: its K and V payloads and its shape.

    shape is (batch, kv_heads, tokens, head_dim_k); head_dim_v defaults to
    head_dim_k; valid_tokens (default: all) counts the first tokens only,
    as a trim cut leaves a block.
    """

    keys: Union[bytes, bytearray, memoryview, np.ndarray]
    values: Union[bytes, bytearray, memoryview, np.ndarray]
    shape: tuple[int, int, int, int]
    head_dim_v: int | None = None
    valid_tokens: int | None = None
    config: CodecConfig | None = None


Segment = Union[AttendBlock, tuple[np.ndarray, np.ndarray]]


@dataclass
class AttentionMass:
    """The attention mass of tokens first_token .. first_token + n - 1 of a layer:
    mass[b, h, i] is the softmax probability token first_token + i got, summed over
    the query rows of KV head h's group (its q_heads / kv_heads query heads times n_q)."""

    first_token: int
    mass: np.ndarray  # float32 [B, kv_heads, n]

    @property
    def tokens(self) -> int:
        return int(self.mass.shape[2])


class MassAccumulator:
    """Each residual token's attention mass over the attend calls that saw it, per layer.

    ``add`` (or ``attend(..., mass=acc)``) adds one call's AttentionMass:
    tokens before its first_token (compressed since) are forgotten, new ones
    start at 0. ``figure(layer)`` is what is sent: with ``normalize`` (the
    default) each token's sum over the number of calls that saw it (the
    ZipCache paper's normalized attention score: a token that arrived late
    is not outranked for having been seen fewer times), else the plain sum.
    ``send(layer)`` hands it to the session for the layer's next update;
    ``attend(..., mass=acc)`` does that after every add.
    """

    def __init__(self, session: "Session", normalize: bool = True) -> None:
        self.session = session
        self.normalize = normalize
        self._layers: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    def add(self, layer: int, m: AttentionMass) -> None:
        first, n = int(m.first_token), m.tokens
        if n == 0:
            self._layers.pop(layer, None)
            return
        total = np.zeros(m.mass.shape, np.float64)
        seen = np.zeros(n, np.int64)
        if layer in self._layers:
            old_first, old_total, old_seen = self._layers[layer]
            lo, hi = max(first, old_first), min(first + n, old_first + old_seen.size)
            if lo < hi:
                total[:, :, lo - first:hi - first] = old_total[:, :, lo - old_first:hi - old_first]
                seen[lo - first:hi - first] = old_seen[lo - old_first:hi - old_first]
        total += m.mass
        seen += 1
        self._layers[layer] = (first, total, seen)

    def figure(self, layer: int) -> AttentionMass | None:
        """The layer's running figure (None before any add, or after an empty residual)."""
        if layer not in self._layers:
            return None
        first, total, seen = self._layers[layer]
        figure = total / seen if self.normalize else total
        return AttentionMass(first, figure.astype(np.float32))

    def send(self, layer: int) -> None:
        figure = self.figure(layer)
        if figure is None:
            self.session.set_attention_mass(layer, 0, None)
            return
        # At most the residual's rows (the daemon's bound): the newest.
        cut = max(0, figure.tokens - self.session.info.residual_tokens)
        self.session.set_attention_mass(layer, figure.first_token + cut, figure.mass[:, :, cut:])


def _payload(data) -> np.ndarray:
    """The payload as a contiguous uint8 array (no copy when it already is one)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def _rows(name: str, array: np.ndarray) -> tuple[np.ndarray, _lib.zc_strides]:
    """fp16 [B, H, T, D] rows whose last axis is contiguous, and their element strides."""
    array = np.asarray(array)
    if array.dtype != np.float16:
        raise TypeError(f"{name} must be float16, got {array.dtype}")
    if array.ndim != 4:
        raise ValueError(f"{name} must be [B, H, T, D], got shape {array.shape}")
    if array.strides[3] != 2 or any(s % 2 for s in array.strides):
        array = np.ascontiguousarray(array)
    b, h, t = (s // 2 for s in array.strides[:3])
    return array, _lib.zc_strides(b, h, t)


def _query(q: np.ndarray, scale: float | None, causal: bool) -> tuple[np.ndarray, _lib.zc_attend_query]:
    """q as the C call reads it (little-endian, C order) and its zc_attend_query."""
    q = np.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, q_heads, n_q, D], got shape {q.shape}")
    if q.dtype == np.float16:
        q = np.ascontiguousarray(q, dtype="<f2")
        q_dtype = _lib.ZC_ATTEND_FP16
    else:
        q = np.ascontiguousarray(q, dtype="<f4")
        q_dtype = _lib.ZC_ATTEND_FP32
    query = _lib.zc_attend_query(*(int(x) for x in q.shape), q_dtype,
                                 q.ctypes.data,
                                 0.0 if scale is None else float(scale), bool(causal))
    return q, query


def _out_dtype(out_dtype) -> np.dtype:
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise TypeError(f"out_dtype must be float32 or float16, got {out_dtype}")
    return out_dtype


def _output(q: np.ndarray, dim_v: int, out_dtype: np.dtype) -> tuple[np.ndarray, _lib.zc_attend_output]:
    out = np.empty((q.shape[0], q.shape[1], q.shape[2], dim_v), dtype=out_dtype.newbyteorder("<"))
    output = _lib.zc_attend_output(
        _lib.ZC_ATTEND_FP16 if out_dtype == np.float16 else _lib.ZC_ATTEND_FP32,
        out.ctypes.data if out.size else None, out.nbytes)
    return out, output


def attend_arrays(q: np.ndarray, segments: Sequence[Segment], scale: float | None = None,
                  causal: bool = False, out_dtype=np.float32, threads: int = 1) -> np.ndarray:
    """softmax(q K^T * scale) V over the segments, as float32 (or float16) [B, q_heads, n_q, D_v].

    scale defaults to 1/sqrt(D_k). causal: query i is token T - n_q + i of
    the T tokens and sees only tokens up to it. threads > 1 splits the
    (batch, KV head) pairs; the result does not depend on it.
    """
    q, query = _query(q, scale, causal)
    out_dtype = _out_dtype(out_dtype)

    keep: list[object] = [q]  # everything the C call points into
    c_segments = (_lib.zc_attend_segment * max(1, len(segments)))()
    dim_v = None
    for i, seg in enumerate(segments):
        c = c_segments[i]
        if isinstance(seg, AttendBlock):
            k, v = _payload(seg.keys), _payload(seg.values)
            keep += [k, v]
            b, h, t, d = (int(x) for x in seg.shape)
            dv = int(seg.head_dim_v if seg.head_dim_v is not None else d)
            c.kind = _lib.ZC_ATTEND_BLOCK
            c.block = _lib.zc_attend_block(
                (seg.config or CodecConfig()).to_c(), _lib.zc_block_shape(b, h, t, d), dv,
                int(seg.valid_tokens if seg.valid_tokens is not None else t),
                k.ctypes.data if k.size else None, k.size,
                v.ctypes.data if v.size else None, v.size)
        else:
            k, v = seg
            k, ks = _rows("keys", k)
            v, vs = _rows("values", v)
            if k.shape[:3] != v.shape[:3]:
                raise ValueError(f"keys {k.shape} and values {v.shape} disagree on [B, H, T]")
            keep += [k, v]
            b, h, t, d = k.shape
            dv = v.shape[3]
            c.kind = _lib.ZC_ATTEND_ROWS
            c.rows = _lib.zc_attend_rows(b, h, t, d, dv, k.ctypes.data if k.size else None, ks,
                                         v.ctypes.data if v.size else None, vs)
        dim_v = dv if dim_v is None else dim_v

    out, output = _output(q, dim_v or 0, out_dtype)
    rc = lib.zc_attend_segments(c_segments, len(segments), ctypes.byref(query),
                                ctypes.byref(output), max(1, int(threads)))
    if rc < 0:
        raise error_from_code(rc, "", "attend_arrays")
    return out


class _InCall:
    """Counted among a session handle's users while a C call reads its mappings,
    so that a release() from another thread waits for it before unmapping."""

    __slots__ = ("__weakref__",)


def attend(session: "Session", layer: int, q: np.ndarray, scale: float | None = None,
           causal: bool = False, *, over_view: bool = False, out_dtype=np.float32,
           threads: int = 1, mass: "bool | MassAccumulator" = False):
    """softmax(q K^T * scale) V over one layer of a session, as float32 (or float16) [B, q_heads, n_q, D_v].

    Read here, inside one consistent read of the layer (zc_attend): its
    compressed blocks and exact residual, nothing reconstructed, nothing
    sent to the daemon. q is [B, q_heads, n_q, D_k] float32 or float16 with
    the session's batch and D_k and q_heads a multiple of its KV heads.
    scale defaults to 1/sqrt(D_k); causal: query i is token T - n_q + i of
    the layer's T tokens and sees only tokens up to it. over_view=True
    attends over the fp16 view of a views="full" session instead (the same
    bytes; what a views="full" worker would read). threads > 1 splits the
    (batch, KV head) pairs; the result does not depend on it.

    A view the daemon dropped (its rows are needed: the residual of a
    views="full" session, or over_view) is brought back with one request
    and the call made again; StaleView if it is gone again by then,
    ConcurrentWrite if the daemon never stopped writing the layer for
    ZC_READ_TIMEOUT_MS.

    mass=True: returns (out, AttentionMass) with the masses of the layer's
    residual rows, read in the same consistent read (any session; an empty
    residual gives n = 0). mass=a MassAccumulator: they are added to it and
    sent with the layer's next update (Session.set_attention_mass, a
    saliency="attention" session); returns out.
    """
    handle = session._native()
    layer = session._check_layer(layer, "attend")
    i = session.info
    q, query = _query(q, scale, causal)
    out, output = _output(q, i.head_dim_v, _out_dtype(out_dtype))
    if mass is not False and mass is not True and not isinstance(mass, MassAccumulator):
        raise TypeError(f"mass must be True, False or a MassAccumulator, got {type(mass).__name__}")
    if isinstance(mass, MassAccumulator) and mass.session is not session:
        raise ValueError("the MassAccumulator belongs to another session")
    if mass is not False:
        # A residual holds residual_tokens rows, up to twice that only
        # after a crash left them (the next update flushes them).
        masses = np.empty(i.batch * i.kv_heads * max(1, 2 * i.residual_tokens), "<f4")
        c_mass = _lib.zc_attend_mass(masses.ctypes.data, masses.size, 0, 0)
        output.mass = ctypes.pointer(c_mass)
    flags = _lib.ZC_ATTEND_OVER_VIEW if over_view else 0
    call = _InCall()
    for refreshed in (False, True):
        handle.holders.add(call)
        try:
            rc = lib.zc_attend(handle.ptr, layer, ctypes.byref(query), ctypes.byref(output),
                               flags, max(1, int(threads)))
        finally:
            handle.holders.discard(call)
        if rc == _lib.ZC_ESTALE and not refreshed:
            session.view(layer)  # a request brings a dropped view back
            continue
        break
    if rc == _lib.ZC_ESTALE:
        raise StaleView(rc, f"layer {layer}'s view was dropped again before it could be read",
                        operation="attend")
    if rc == _lib.ZC_EAGAIN:
        raise ConcurrentWrite(rc, f"layer {layer} was written under every read for "
                              f"{_lib.ZC_READ_TIMEOUT_MS} ms", operation="attend")
    if rc < 0:
        raise error_from_code(rc, _attend_message(rc, session, layer, q, over_view), "attend")
    if mass is False:
        return out
    n = int(c_mass.tokens)
    got = AttentionMass(int(c_mass.first_token),
                        masses[:i.batch * i.kv_heads * n].reshape(i.batch, i.kv_heads, n).copy())
    if mass is True:
        return out, got
    mass.add(layer, got)
    mass.send(layer)
    return out


def _attend_message(rc: int, session: "Session", layer: int, q: np.ndarray, over_view: bool) -> str:
    i = session.info
    if rc == _lib.ZC_ESHAPE:
        return (f"q {list(q.shape)} does not fit layer {layer} of the session ([{i.batch}, "
                f"{i.kv_heads}, tokens, {i.head_dim_k}]; q_heads a multiple of {i.kv_heads}; "
                "the layer must hold tokens, at least n_q with causal)")
    if rc == _lib.ZC_EPRECONDITION and over_view:
        return "over_view needs a views='full' session; this one has views='none'"
    if rc == _lib.ZC_ENONFINITE:
        return "q holds NaN or Inf"
    return ""
