"""The codec on its own, in-process: compress and reconstruct fp16 blocks.

A thin wrapper over libzipcache's zc_block_* functions, the very code the
daemon runs, so a caller can predict bit for bit what the daemon will hand
back for a block (tests do), or use the codec without a daemon.
"""

from __future__ import annotations

import ctypes
from typing import Literal

import numpy as np

from . import _lib
from ._lib import lib
from .client import CodecConfig
from .errors import error_from_code

__all__ = ["compress", "reconstruct", "roundtrip", "count_bytes", "Tensor"]

Tensor = Literal["keys", "values"]

_TENSORS = {"keys": _lib.ZC_TENSOR_KEYS, "values": _lib.ZC_TENSOR_VALUES}
_u16p = ctypes.POINTER(ctypes.c_uint16)


def _tensor(tensor: Tensor) -> int:
    try:
        return _TENSORS[tensor]
    except KeyError:
        raise ValueError(f"tensor must be 'keys' or 'values', got {tensor!r}") from None


def _block(block: np.ndarray) -> tuple[np.ndarray, _lib.zc_block_shape]:
    block = np.asarray(block)
    if block.dtype.kind != "f" or block.dtype.itemsize != 2:
        raise TypeError(f"block must be float16, got {block.dtype}")
    if block.ndim == 2:
        block = block[None, None]
    if block.ndim != 4:
        raise ValueError(f"block must be [S, D] or [B, H, S, D], got shape {block.shape}")
    block = np.ascontiguousarray(block, dtype="<f2")
    return block, _lib.zc_block_shape(*block.shape)


def count_bytes(shape: tuple[int, int, int, int], tensor: Tensor,
                config: CodecConfig | None = None) -> tuple[int, int, int]:
    """(compressed, baseline, fp16) bytes of a [B, H, S, D] block, as the daemon counts them."""
    c = (config or CodecConfig()).to_c()
    count = _lib.zc_byte_count()
    rc = lib.zc_block_count_bytes(ctypes.byref(c), _tensor(tensor),
                                  ctypes.byref(_lib.zc_block_shape(*shape)), ctypes.byref(count))
    if rc < 0:
        raise error_from_code(rc, "", "count_bytes")
    return count.compressed, count.baseline, count.fp16


def compress(block: np.ndarray, tensor: Tensor, config: CodecConfig | None = None,
             scores: np.ndarray | None = None) -> bytes:
    """The compressed payload of a float16 [B, H, S, D] (or [S, D]) block.

    scores (keys only): per token [B, H, S] (or [S]), finite and >= 0; the
    salient tokens are those with the largest scores instead of the largest
    key norms (zc_block_compress_scored).
    """
    block, shape = _block(block)
    if scores is not None:
        if tensor != "keys":
            raise ValueError("scores choose salient keys: tensor must be 'keys'")
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        if scores.size != shape.batch * shape.heads * shape.tokens:
            raise ValueError(f"scores must hold one score per token of each head "
                             f"({shape.batch}x{shape.heads}x{shape.tokens}), got {scores.shape}")
    c = (config or CodecConfig()).to_c()
    layout = _lib.zc_block_layout()
    rc = lib.zc_block_layout_compute(ctypes.byref(c), _tensor(tensor), ctypes.byref(shape),
                                     ctypes.byref(layout))
    if rc < 0:
        raise error_from_code(rc, "", "compress")
    out = ctypes.create_string_buffer(max(1, layout.total_bytes))
    if scores is not None:
        n = lib.zc_block_compress_scored(ctypes.byref(c), ctypes.byref(shape),
                                         block.ctypes.data_as(_u16p),
                                         scores.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                         out, layout.total_bytes)
    else:
        n = lib.zc_block_compress(ctypes.byref(c), _tensor(tensor), ctypes.byref(shape),
                                  block.ctypes.data_as(_u16p), out, layout.total_bytes)
    if n < 0:
        raise error_from_code(int(n), "", "compress")
    return out.raw[:n]


def reconstruct(payload: bytes, shape: tuple[int, int, int, int], tensor: Tensor,
                config: CodecConfig | None = None) -> np.ndarray:
    """The float16 [B, H, S, D] block a payload from compress() stands for."""
    c = (config or CodecConfig()).to_c()
    b, h, s, d = shape
    out = np.empty(shape, dtype="<f2")
    strides = _lib.zc_strides(h * s * d, s * d, d)
    buf = ctypes.create_string_buffer(bytes(payload), max(1, len(payload)))
    rc = lib.zc_block_reconstruct(ctypes.byref(c), _tensor(tensor),
                                  ctypes.byref(_lib.zc_block_shape(b, h, s, d)), buf,
                                  len(payload), out.ctypes.data_as(_u16p), ctypes.byref(strides))
    if rc < 0:
        raise error_from_code(rc, "", "reconstruct")
    return out


def roundtrip(block: np.ndarray, tensor: Tensor, config: CodecConfig | None = None) -> np.ndarray:
    """reconstruct(compress(block)): what the daemon stores for this block."""
    block4, shape = _block(block)
    out = reconstruct(compress(block4, tensor, config), block4.shape, tensor, config)
    return out.reshape(np.shape(block))
