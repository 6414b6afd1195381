"""Attention straight from compressed blocks, in-process (include/zipcache/attend.h).

    out = zipcache.attend_arrays(q, [zipcache.AttendBlock(k_payload, v_payload, shape),
                                     (k_residual, v_residual)], causal=True)

A thin wrapper over zc_attend_segments(), the compute core the session-level
zipcache.attend(session, layer, ...) is built on: a layer is a list of
segments in token order, each a compressed block as codec.compress() (or
the daemon) wrote it, or fp16 rows [B, H, T, D] (the exact residual, or a
whole fp16 view). Queries [B, q_heads, n_q, D_k] float32 or float16;
q_heads a multiple of the KV heads. The result is float32 (or float16)
[B, q_heads, n_q, D_v], equal to attention over the codec's reconstruction
up to fp32 rounding, with the same bytes on every ISA and thread count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from . import _lib
from ._lib import lib
from .client import CodecConfig
from .errors import error_from_code

__all__ = ["AttendBlock", "attend_arrays"]


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


def attend_arrays(q: np.ndarray, segments: Sequence[Segment], scale: float | None = None,
                  causal: bool = False, out_dtype=np.float32, threads: int = 1) -> np.ndarray:
    """softmax(q K^T * scale) V over the segments, as float32 (or float16) [B, q_heads, n_q, D_v].

    scale defaults to 1/sqrt(D_k). causal: query i is token T - n_q + i of
    the T tokens and sees only tokens up to it. threads > 1 splits the
    (batch, KV head) pairs; the result does not depend on it.
    """
    q = np.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, q_heads, n_q, D], got shape {q.shape}")
    if q.dtype == np.float16:
        q = np.ascontiguousarray(q, dtype="<f2")
        q_dtype = _lib.ZC_ATTEND_FP16
    else:
        q = np.ascontiguousarray(q, dtype="<f4")
        q_dtype = _lib.ZC_ATTEND_FP32
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise TypeError(f"out_dtype must be float32 or float16, got {out_dtype}")

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

    query = _lib.zc_attend_query(*(int(x) for x in q.shape), q_dtype, q.ctypes.data,
                                 0.0 if scale is None else float(scale), bool(causal))
    out = np.empty((q.shape[0], q.shape[1], q.shape[2], dim_v or 0), dtype=out_dtype.newbyteorder("<"))
    output = _lib.zc_attend_output(
        _lib.ZC_ATTEND_FP16 if out_dtype == np.float16 else _lib.ZC_ATTEND_FP32,
        out.ctypes.data if out.size else None, out.nbytes)
    rc = lib.zc_attend_segments(c_segments, len(segments), ctypes.byref(query),
                                ctypes.byref(output), max(1, int(threads)))
    if rc < 0:
        raise error_from_code(rc, "", "attend_arrays")
    return out
