"""ctypes bindings of libzipcache_cuda (include/zipcache/cuda.h).

Loaded on first use, never at import: the library exists only where nvcc
was at build time, and a machine without it must import zipcache fine.
Found through $ZIPCACHE_CUDA_LIBRARY, else beside the libzipcache.so in
use (build/lib/), else the system's library path. Field order is the
header's exactly.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, Structure, c_int, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path

from . import _lib
from .errors import error_from_code

ZC_CUDA_HOST = 0
ZC_CUDA_DEVICE = 1


class zc_cuda_block(Structure):
    _fields_ = [
        ("keys", c_void_p),
        ("values", c_void_p),
        ("key_bytes", c_size_t),
        ("value_bytes", c_size_t),
        ("first_token", c_uint32),
        ("tokens", c_uint32),
        ("valid_tokens", c_uint32),
    ]


class zc_cuda_layer(Structure):
    _fields_ = [
        ("config", _lib.zc_codec_config),
        ("batch", c_uint32),
        ("heads", c_uint32),
        ("head_dim_k", c_uint32),
        ("head_dim_v", c_uint32),
        ("blocks", POINTER(zc_cuda_block)),
        ("n_blocks", c_size_t),
        ("residual_keys", c_void_p),
        ("residual_values", c_void_p),
        ("residual_key_strides", _lib.zc_strides),
        ("residual_value_strides", _lib.zc_strides),
        ("residual_first", c_uint32),
        ("residual_tokens", c_uint32),
        ("memory", c_int),
    ]


class zc_cuda_target(Structure):
    _fields_ = [
        ("keys", c_void_p),
        ("values", c_void_p),
        ("key_strides", _lib.zc_strides),
        ("value_strides", _lib.zc_strides),
        ("max_tokens", c_uint32),
    ]


class zc_cuda_stats(Structure):
    _fields_ = [(name, c_uint64) for name in (
        "loads", "blocks", "blocks_skipped", "residual_rows", "bytes_staged", "bytes_direct",
        "bytes_to_device", "chunks", "fetches", "pins", "pins_released", "pin_bytes")]


def _path() -> str:
    env = os.environ.get("ZIPCACHE_CUDA_LIBRARY")
    if env:
        return env
    beside = Path(_lib.library_path).resolve().parent / "libzipcache_cuda.so"
    if beside.exists():
        return str(beside)
    return "libzipcache_cuda.so.0"


_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded library; ImportError (saying where it looked) if there is none."""
    global _library
    if _library is not None:
        return _library
    path = _path()
    try:
        cdll = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"cannot load libzipcache_cuda ({path}): {e}; it is built by `make` "
                          "only where nvcc is") from None
    p = POINTER
    cdll.zc_cuda_device_count.argtypes = []
    cdll.zc_cuda_device_count.restype = c_int
    cdll.zc_cuda_open.argtypes = [c_int, c_size_t, p(c_void_p)]
    cdll.zc_cuda_open.restype = c_int
    cdll.zc_cuda_close.argtypes = [c_void_p]
    cdll.zc_cuda_close.restype = None
    cdll.zc_cuda_last_error.argtypes = [c_void_p]
    cdll.zc_cuda_last_error.restype = ctypes.c_char_p
    cdll.zc_cuda_load_layer.argtypes = [c_void_p, p(zc_cuda_layer), p(zc_cuda_target), c_void_p,
                                        c_void_p]
    cdll.zc_cuda_load_layer.restype = c_int
    cdll.zc_cuda_synchronize.argtypes = [c_void_p, c_void_p]
    cdll.zc_cuda_synchronize.restype = c_int
    cdll.zc_cuda_register_host.argtypes = [c_void_p, c_void_p, c_size_t]
    cdll.zc_cuda_register_host.restype = c_int
    cdll.zc_cuda_unregister_host.argtypes = [c_void_p, c_void_p]
    cdll.zc_cuda_unregister_host.restype = c_int
    cdll.zc_cuda_get_stats.argtypes = [c_void_p, p(zc_cuda_stats)]
    cdll.zc_cuda_get_stats.restype = None
    cdll.zc_cuda_fetch_layer.argtypes = [c_void_p, c_void_p, c_uint32, p(zc_cuda_target), c_void_p,
                                         c_void_p]
    cdll.zc_cuda_fetch_layer.restype = c_int
    cdll.zc_cuda_forget_session.argtypes = [c_void_p, c_void_p]
    cdll.zc_cuda_forget_session.restype = None
    cdll.zc_cuda_mirror_new.argtypes = [p(c_void_p)]
    cdll.zc_cuda_mirror_new.restype = c_int
    cdll.zc_cuda_mirror_free.argtypes = [c_void_p]
    cdll.zc_cuda_mirror_free.restype = None
    cdll.zc_cuda_mirror_reset.argtypes = [c_void_p]
    cdll.zc_cuda_mirror_reset.restype = None
    cdll.zc_cuda_mirror_trim.argtypes = [c_void_p, c_uint32]
    cdll.zc_cuda_mirror_trim.restype = None
    _library = cdll
    return cdll


def check(cuda: int | None, rc: int, operation: str) -> int:
    if rc < 0:
        detail = ""
        if cuda:
            detail = (library().zc_cuda_last_error(cuda) or b"").decode(errors="replace")
        raise error_from_code(rc, detail, operation)
    return rc
