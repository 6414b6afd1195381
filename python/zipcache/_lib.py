"""ctypes bindings of libzipcache: structs, prototypes and loading.

Everything here mirrors include/zipcache/{attend,client,codec,error,reader}.h
one to one (tests/python/test_reader.py checks every mirrored reader
struct's size and field offsets against the library's zc_reader_layout_of);
the friendly API lives in client.py and cache.py. Keep the field
order exactly as in the headers: ctypes lays structs out with the C ABI,
so a missing or reordered field silently shifts every later one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int64,
    c_size_t,
    c_uint,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    Union,
)
from pathlib import Path

__all__ = ["lib", "library_path"]

# --- error.h -----------------------------------------------------------------

ZC_ERROR_BASE = -4000
ZC_EBITS = ZC_ERROR_BASE - 1
ZC_EFRACTION = ZC_ERROR_BASE - 2
ZC_EGROUPSIZE = ZC_ERROR_BASE - 3
ZC_ESHAPE = ZC_ERROR_BASE - 4
ZC_ENONFINITE = ZC_ERROR_BASE - 5
ZC_EBUFFER = ZC_ERROR_BASE - 6
ZC_ECORRUPT = ZC_ERROR_BASE - 7
ZC_ETENSOR = ZC_ERROR_BASE - 8
ZC_EPROTOCOL = ZC_ERROR_BASE - 9
ZC_EFRAMESIZE = ZC_ERROR_BASE - 10
ZC_ENOTFOUND = ZC_ERROR_BASE - 11
ZC_EEXISTS = ZC_ERROR_BASE - 12
ZC_EEXHAUSTED = ZC_ERROR_BASE - 13
ZC_EDENIED = ZC_ERROR_BASE - 14
ZC_EPRECONDITION = ZC_ERROR_BASE - 15
ZC_EINTERNAL = ZC_ERROR_BASE - 16
ZC_EINVALID = ZC_ERROR_BASE - 17
ZC_ERESTARTED = ZC_ERROR_BASE - 18
ZC_EBROKEN = ZC_ERROR_BASE - 19
ZC_ESTALE = ZC_ERROR_BASE - 20
ZC_EAGAIN = ZC_ERROR_BASE - 21
ZC_EDEVICE = ZC_ERROR_BASE - 22
ZC_EREMOTE = ZC_ERROR_BASE - 23

# --- codec.h -----------------------------------------------------------------

ZC_TENSOR_KEYS = 0
ZC_TENSOR_VALUES = 1


class zc_codec_config(Structure):
    _fields_ = [
        ("hi_bits", c_int),
        ("lo_bits", c_int),
        ("hi_fraction", c_double),
        ("group_size", c_int),
        ("quantize_values", c_bool),
        ("saliency", c_int),  # zc_saliency: 0 key_norm, 1 attention
    ]


class zc_block_shape(Structure):
    _fields_ = [
        ("batch", c_uint32),
        ("heads", c_uint32),
        ("tokens", c_uint32),
        ("head_dim", c_uint32),
    ]


class zc_strides(Structure):
    _fields_ = [("batch", c_size_t), ("head", c_size_t), ("token", c_size_t)]


class zc_block_layout(Structure):
    _fields_ = [
        ("tokens", c_uint32),
        ("head_dim", c_uint32),
        ("n_hi", c_uint32),
        ("n_lo", c_uint32),
        ("groups_hi", c_uint32),
        ("groups_lo", c_uint32),
        ("hi_bits", c_int),
        ("lo_bits", c_int),
        ("exact", c_bool),
        ("mask_offset", c_size_t),
        ("mask_bytes", c_size_t),
        ("hi_params_offset", c_size_t),
        ("lo_params_offset", c_size_t),
        ("hi_codes_offset", c_size_t),
        ("hi_codes_bytes", c_size_t),
        ("lo_codes_offset", c_size_t),
        ("lo_codes_bytes", c_size_t),
        ("head_bytes", c_size_t),
        ("heads", c_size_t),
        ("total_bytes", c_size_t),
    ]


class zc_byte_count(Structure):
    _fields_ = [("compressed", c_uint64), ("baseline", c_uint64), ("fp16", c_uint64)]


# --- attend.h ----------------------------------------------------------------

ZC_ATTEND_MAX_ROWS = 4096
ZC_ATTEND_BLOCK = 0
ZC_ATTEND_ROWS = 1
ZC_ATTEND_FP32 = 0
ZC_ATTEND_FP16 = 1
ZC_ATTEND_OVER_VIEW = 1


class zc_attend_block(Structure):
    _fields_ = [
        ("config", zc_codec_config),
        ("shape", zc_block_shape),
        ("head_dim_v", c_uint32),
        ("valid_tokens", c_uint32),
        ("keys", c_void_p),
        ("key_bytes", c_size_t),
        ("values", c_void_p),
        ("value_bytes", c_size_t),
    ]


class zc_attend_rows(Structure):
    _fields_ = [
        ("batch", c_uint32),
        ("heads", c_uint32),
        ("tokens", c_uint32),
        ("head_dim_k", c_uint32),
        ("head_dim_v", c_uint32),
        ("keys", c_void_p),
        ("key_strides", zc_strides),
        ("values", c_void_p),
        ("value_strides", zc_strides),
    ]


class _zc_attend_segment_u(Union):
    _fields_ = [("block", zc_attend_block), ("rows", zc_attend_rows)]


class zc_attend_segment(Structure):
    _anonymous_ = ("u",)
    _fields_ = [("kind", c_int), ("u", _zc_attend_segment_u)]


class zc_attend_query(Structure):
    _fields_ = [
        ("batch", c_uint32),
        ("q_heads", c_uint32),
        ("n_q", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_int),
        ("data", c_void_p),
        ("scale", c_double),
        ("causal", c_bool),
    ]


class zc_attend_mass(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("capacity", c_size_t),   # floats at data
        ("first_token", c_uint32),
        ("tokens", c_uint32),
    ]


class zc_attend_output(Structure):
    _fields_ = [("dtype", c_int), ("data", c_void_p), ("capacity", c_size_t),
                ("mass", POINTER(zc_attend_mass))]


# --- client.h ----------------------------------------------------------------

ZC_POLICY_STREAMING = 0
ZC_POLICY_PER_CALL = 1
ZC_VIEWS_FULL = 0
ZC_VIEWS_NONE = 1
ZC_VIEWS_SOURCE = -1


class zc_session_config(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("layers", c_uint32),
        ("batch", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim_k", c_uint32),
        ("head_dim_v", c_uint32),
        ("max_tokens", c_uint32),
        ("codec", zc_codec_config),
        ("policy", c_int),
        ("residual_tokens", c_uint32),
        ("attach", c_bool),
        ("views", c_int),
        ("model_id", c_char_p),
        ("prefix", c_void_p),
        ("prefix_chunks", c_uint32),
    ]


# Prefix reuse (client.h): one chunk's tokens, a chain key's bytes, keys per call.
ZC_PREFIX_CHUNK_TOKENS = 256
ZC_CHUNK_KEY_BYTES = 16
ZC_PREFIX_MAX_CHUNKS = 256


class zc_prefix_held(Structure):
    _fields_ = [("chunks", c_uint32), ("tokens", c_uint32), ("local_chunks", c_uint32)]


class zc_view(Structure):
    _fields_ = [
        ("keys", POINTER(c_uint16)),
        ("values", POINTER(c_uint16)),
        ("tokens", c_uint32),
        ("batch", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim_k", c_uint32),
        ("head_dim_v", c_uint32),
        ("max_tokens", c_uint32),
        ("key_strides", zc_strides),
        ("value_strides", zc_strides),
        ("sequence", c_uint64),
    ]


class zc_layer_stats(Structure):
    _fields_ = [
        ("layer", c_uint32),
        ("tokens", c_uint32),
        ("residual_tokens", c_uint32),
        ("blocks", c_uint64),
        ("compressed_key_bytes", c_uint64),
        ("compressed_value_bytes", c_uint64),
        ("baseline_key_bytes", c_uint64),
        ("baseline_value_bytes", c_uint64),
        ("fp16_key_bytes", c_uint64),
        ("fp16_value_bytes", c_uint64),
        ("compression_ratio", c_double),
        ("effective_avg_bits", c_double),
    ]


class zc_session_info(Structure):
    _fields_ = [
        ("id", c_uint64),
        ("name", c_char * 65),
        ("layers", c_uint32),
        ("batch", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim_k", c_uint32),
        ("head_dim_v", c_uint32),
        ("max_tokens", c_uint32),
        ("codec", zc_codec_config),
        ("policy", c_int),
        ("residual_tokens", c_uint32),
        ("min_tokens", c_uint32),
        ("max_layer_tokens", c_uint32),
        ("idle_ms", c_uint64),
        ("views", c_int),
        ("shared_bytes", c_uint64),
        ("leased", c_bool),
        ("model_id", c_char * 65),
    ]


class zc_import_options(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("model_id", c_char_p),
        ("check_fingerprint", c_bool),
        ("fingerprint", c_uint64),
        ("views", c_int),
    ]


class zc_server_info(Structure):
    _fields_ = [
        ("protocol_version", c_uint32),
        ("server_version", c_char * 33),
        ("boot_epoch", c_uint64),
        ("max_frame_bytes", c_uint32),
        ("max_inline_bytes", c_uint32),
        ("max_sessions", c_uint32),
        ("max_tokens_per_session", c_uint64),
        ("memory_budget_bytes", c_uint64),
        ("lease_ms", c_uint32),
        ("max_ring_bytes", c_uint64),
    ]


class zc_server_stats(Structure):
    _fields_ = [
        ("sessions", c_uint32),
        ("connections", c_uint32),
        ("memory_used_bytes", c_uint64),
        ("memory_budget_bytes", c_uint64),
        ("requests", c_uint64),
        ("request_errors", c_uint64),
        ("tokens_appended", c_uint64),
        ("uptime_ms", c_uint64),
        ("boot_epoch", c_uint64),
    ]


class zc_memory_stats(Structure):
    _fields_ = [
        ("charged_bytes", c_uint64),
        ("file_bytes", c_uint64),
        ("views_bytes", c_uint64),
        ("blocks_bytes", c_uint64),
        ("residual_bytes", c_uint64),
        ("index_bytes", c_uint64),
        ("headers_bytes", c_uint64),
        ("set_aside_files", c_uint32),
        ("retained_bytes", c_uint64),
    ]


# --- map.h, reader.h -----------------------------------------------------------

ZC_VIEWS_FULL = 0
ZC_VIEWS_NONE = 1
ZC_READ_TIMEOUT_MS = 10000


class zc_read(Structure):
    _fields_ = [
        ("layer", c_uint32),
        ("view", c_uint32),
        ("sequence", c_uint64),
        ("generation", c_uint64),
        ("tokens", c_uint32),
        ("residual_tokens", c_uint32),
        ("blocks", c_uint32),
        ("view_valid", c_uint32),
    ]


class zc_layer_contents(Structure):
    _fields_ = [
        ("layer", c_uint32),
        ("tokens", c_uint32),
        ("residual_tokens", c_uint32),
        ("blocks", c_uint32),
        ("views", c_uint32),
        ("view_valid", c_uint32),
        ("residual_keys", POINTER(c_uint16)),
        ("residual_values", POINTER(c_uint16)),
        ("key_strides", zc_strides),
        ("value_strides", zc_strides),
    ]


class zc_update(Structure):
    _fields_ = [
        ("layer", c_uint32),
        ("tokens", c_uint32),
        ("keys", c_void_p),
        ("values", c_void_p),
    ]


class zc_block(Structure):
    _fields_ = [
        ("layer", c_uint32),
        ("index", c_uint32),
        ("first_token", c_uint32),
        ("tokens", c_uint32),
        ("valid_tokens", c_uint32),
        ("key_shape", zc_block_shape),
        ("value_shape", zc_block_shape),
        ("key_payload", c_void_p),
        ("value_payload", c_void_p),
        ("key_bytes", c_uint64),
        ("value_bytes", c_uint64),
        ("key_offset", c_uint64),
        ("value_offset", c_uint64),
    ]


# The structs above that the library reports the layout of (by C name).
MIRRORED_STRUCTS = (zc_read, zc_layer_contents, zc_block, zc_block_shape, zc_strides,
                    zc_session_config, zc_session_info, zc_server_info, zc_view,
                    zc_prefix_held)

# Opaque handles: only ever passed back to the library.
zc_client_p = c_void_p
zc_session_p = c_void_p

_u16p = POINTER(c_uint16)

# name: (restype, argtypes)
_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    # error.h
    "zc_strerror": (c_char_p, [c_int]),
    "zc_error_name": (c_char_p, [c_int]),
    # codec.h
    "zc_codec_config_default": (None, [POINTER(zc_codec_config)]),
    "zc_codec_config_validate": (c_int, [POINTER(zc_codec_config)]),
    "zc_block_layout_compute": (
        c_int,
        [POINTER(zc_codec_config), c_int, POINTER(zc_block_shape), POINTER(zc_block_layout)],
    ),
    "zc_block_count_bytes": (
        c_int,
        [POINTER(zc_codec_config), c_int, POINTER(zc_block_shape), POINTER(zc_byte_count)],
    ),
    "zc_block_compress": (
        c_int64,
        [POINTER(zc_codec_config), c_int, POINTER(zc_block_shape), _u16p, c_void_p, c_size_t],
    ),
    "zc_block_compress_scored": (
        c_int64,
        [POINTER(zc_codec_config), POINTER(zc_block_shape), _u16p, POINTER(c_float), c_void_p,
         c_size_t],
    ),
    "zc_block_reconstruct": (
        c_int,
        [
            POINTER(zc_codec_config),
            c_int,
            POINTER(zc_block_shape),
            c_void_p,
            c_size_t,
            _u16p,
            POINTER(zc_strides),
        ],
    ),
    # attend.h
    "zc_attend_segments": (
        c_int,
        [
            POINTER(zc_attend_segment),
            c_size_t,
            POINTER(zc_attend_query),
            POINTER(zc_attend_output),
            c_uint,
        ],
    ),
    "zc_attend": (
        c_int,
        [
            zc_session_p,
            c_uint32,
            POINTER(zc_attend_query),
            POINTER(zc_attend_output),
            c_uint,
            c_uint,
        ],
    ),
    # client.h
    "zc_default_socket_path": (c_int, [c_char_p, c_size_t]),
    "zc_daemon_socket_path": (c_int, [c_char_p, c_size_t]),
    "zc_client_connect": (c_int, [c_char_p, c_int, POINTER(zc_client_p)]),
    "zc_client_close": (None, [zc_client_p]),
    "zc_client_reconnect": (c_int, [zc_client_p]),
    "zc_client_broken": (c_int, [zc_client_p]),
    "zc_client_set_timeout": (c_int, [zc_client_p, c_int]),
    "zc_client_set_receive_spin": (c_int, [zc_client_p, c_uint]),
    "zc_client_server_info": (POINTER(zc_server_info), [zc_client_p]),
    "zc_client_last_error": (c_char_p, [zc_client_p]),
    "zc_session_config_default": (None, [POINTER(zc_session_config)]),
    "zc_session_open": (c_int, [zc_client_p, POINTER(zc_session_config), POINTER(zc_session_p)]),
    "zc_session_close": (c_int, [zc_session_p]),
    "zc_session_release": (None, [zc_session_p]),
    "zc_session_get_info": (POINTER(zc_session_info), [zc_session_p]),
    "zc_session_set_attention_mass": (c_int, [zc_session_p, c_uint32, c_uint32, c_void_p, c_size_t]),
    "zc_session_fork": (c_int, [zc_session_p, c_uint32, c_char_p, c_int, POINTER(zc_session_p)]),
    "zc_session_release_views": (c_int, [zc_session_p]),
    "zc_import_options_default": (None, [POINTER(zc_import_options)]),
    "zc_session_export": (c_int, [zc_session_p, c_int, POINTER(c_uint64)]),
    "zc_client_export": (c_int, [zc_client_p, c_uint64, c_int, POINTER(c_uint64)]),
    "zc_session_import": (c_int, [zc_client_p, c_int, POINTER(zc_import_options),
                                  POINTER(zc_session_p)]),
    "zc_session_lease_check": (c_int, [zc_session_p]),
    # K/V input as void*: an address (ndarray.ctypes.data) passes without
    # building a ctypes pointer object on every decode step.
    "zc_update_and_fetch": (
        c_int,
        [
            zc_session_p,
            c_uint32,
            c_uint32,
            c_void_p,
            c_void_p,
            POINTER(zc_view),
            POINTER(zc_layer_stats),
        ],
    ),
    "zc_update_async": (
        c_int, [zc_session_p, c_uint32, c_uint32, c_void_p, c_void_p, POINTER(c_uint64)]),
    "zc_wait": (c_int, [zc_session_p, c_uint32, c_uint64]),
    "zc_poll": (c_int, [zc_session_p, c_uint32, c_uint64]),
    "zc_wait_all": (c_int, [zc_client_p]),
    "zc_update_many": (c_int, [zc_session_p, POINTER(zc_update), c_size_t, POINTER(c_size_t)]),
    "zc_client_set_async_window": (c_int, [zc_client_p, c_uint]),
    "zc_client_set_async_batch": (c_int, [zc_client_p, c_uint]),
    "zc_client_set_async_ring": (c_int, [zc_client_p, c_size_t]),
    "zc_client_async_ring": (c_int, [zc_client_p, POINTER(c_size_t), POINTER(c_uint64)]),
    "zc_chunk_chain": (c_int, [c_void_p, c_void_p, c_size_t, c_void_p]),
    "zc_update_and_fetch_chunk": (
        c_int,
        [
            zc_session_p,
            c_uint32,
            c_uint32,
            c_void_p,
            c_void_p,
            c_void_p,
            POINTER(zc_view),
            POINTER(zc_layer_stats),
        ],
    ),
    "zc_client_lookup_prefix": (c_int, [zc_client_p, POINTER(zc_session_config), c_void_p,
                                        c_size_t, POINTER(zc_prefix_held)]),
    "zc_session_view": (c_int, [zc_session_p, c_uint32, POINTER(zc_view)]),
    "zc_session_trim": (c_int, [zc_session_p, c_uint32, POINTER(c_uint32)]),
    "zc_session_trim_layer": (c_int, [zc_session_p, c_uint32, c_uint32, POINTER(c_uint32)]),
    "zc_session_stats": (
        c_int,
        [zc_session_p, POINTER(zc_layer_stats), c_size_t, POINTER(zc_layer_stats)],
    ),
    "zc_client_close_session": (c_int, [zc_client_p, c_uint64]),
    "zc_client_list_sessions": (
        c_int,
        [zc_client_p, POINTER(zc_session_info), c_size_t, POINTER(c_size_t)],
    ),
    "zc_client_stats": (c_int, [zc_client_p, POINTER(zc_server_stats)]),
    "zc_client_memory_stats": (c_int, [zc_client_p, POINTER(zc_memory_stats)]),
    "zc_session_map": (c_void_p, [zc_session_p]),
    "zc_session_pool": (c_void_p, [zc_session_p, POINTER(c_size_t)]),
    # reader.h
    "zc_read_begin": (c_int, [zc_session_p, c_uint32, c_int, POINTER(zc_read)]),
    "zc_read_end": (c_int, [zc_session_p, POINTER(zc_read)]),
    "zc_layer_layout": (c_int, [zc_session_p, POINTER(zc_read), POINTER(zc_layer_contents)]),
    "zc_layer_block": (c_int, [zc_session_p, POINTER(zc_read), c_uint32, POINTER(zc_block)]),
    "zc_block_reconstruct_rows": (
        c_int,
        [zc_session_p, POINTER(zc_block), c_void_p, POINTER(zc_strides), c_void_p,
         POINTER(zc_strides)],
    ),
    "zc_layer_reconstruct": (
        c_int,
        [zc_session_p, c_uint32, c_void_p, POINTER(zc_strides), c_void_p, POINTER(zc_strides),
         c_uint32, POINTER(c_uint32)],
    ),
    "zc_reader_layout_of": (c_size_t, [c_char_p, c_char_p]),
}


def _candidates() -> list[str]:
    """Where to look for libzipcache.so, most explicit first.

    ZIPCACHE_LIBRARY wins so a test or a deployment can pin one build; then
    the build tree this package sits in (python/ next to build/), so a
    checkout works without installing; then the system's search path.
    """
    found: list[str] = []
    env = os.environ.get("ZIPCACHE_LIBRARY")
    if env:
        return [env]
    tree = Path(__file__).resolve().parent.parent.parent / "build" / "lib" / "libzipcache.so"
    if tree.exists():
        found.append(str(tree))
    system = ctypes.util.find_library("zipcache")
    if system:
        found.append(system)
    return found


def _load() -> tuple[ctypes.CDLL, str]:
    candidates = _candidates()
    errors: list[str] = []
    for path in candidates:
        try:
            dll = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(dll, name)
            fn.restype = restype
            fn.argtypes = argtypes
        return dll, path
    detail = "; ".join(errors) if errors else "no candidate found"
    raise ImportError(
        "cannot load libzipcache.so (set ZIPCACHE_LIBRARY, build it with `make`, "
        f"or install it): {detail}"
    )


lib, library_path = _load()
