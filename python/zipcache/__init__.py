"""Python client of zipcached: ZipCache-compressed KV caches, fetched zero-copy.

    import numpy as np
    import zipcache

    with zipcache.Client("/run/zipcached.sock") as client, \\
         client.open_session(layers=32, kv_heads=8, head_dim=128, max_tokens=4096) as session:
        cache = zipcache.make_prompt_cache(session)      # one ZipCacheKVCache per layer
        k, v = cache[0].update_and_fetch(keys, values)   # float16 [B, H, S, D] in
        # k, v: read-only float16 [B, H, offset, D] views of the daemon's mapping

Pure Python over libzipcache.so (ctypes) and numpy. The library is found
through $ZIPCACHE_LIBRARY, else the build tree next to this package
(build/lib/libzipcache.so), else the system's library path.
"""

from ._lib import library_path
from .attend import AttendBlock, AttentionMass, MassAccumulator, attend, attend_arrays
from .cache import ZipCacheKVCache, make_prompt_cache
from .reader import Block, LayerRead, ReadAttempts
from .client import (
    CHUNK_KEY_BYTES,
    CHUNK_TOKENS,
    MAX_PREFIX_CHUNKS,
    Client,
    PrefixHeld,
    chunk_chain,
    chunk_keys,
    CodecConfig,
    LayerStats,
    MemoryStats,
    Policy,
    ServerInfo,
    ServerStats,
    Session,
    SessionInfo,
    SessionStats,
    default_socket_path,
)
from .errors import (
    AlreadyExists,
    ConnectionBroken,
    StaleView,
    ConcurrentWrite,
    DaemonRestarted,
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    ZipCacheError,
    error_from_code,
)

__version__ = "0.1.0"

__all__ = [
    "attend",
    "attend_arrays",
    "AttendBlock",
    "AttentionMass",
    "MassAccumulator",
    "Client",
    "Session",
    "PrefixHeld",
    "chunk_chain",
    "chunk_keys",
    "CHUNK_TOKENS",
    "CHUNK_KEY_BYTES",
    "MAX_PREFIX_CHUNKS",
    "ZipCacheKVCache",
    "Block",
    "LayerRead",
    "ReadAttempts",
    "make_prompt_cache",
    "CodecConfig",
    "Policy",
    "LayerStats",
    "SessionStats",
    "SessionInfo",
    "ServerInfo",
    "MemoryStats",
    "ServerStats",
    "default_socket_path",
    "library_path",
    "ZipCacheError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "ResourceExhausted",
    "PermissionDenied",
    "FailedPrecondition",
    "Internal",
    "DataLoss",
    "Unavailable",
    "DaemonRestarted",
    "ConnectionBroken",
    "StaleView",
    "ConcurrentWrite",
    "error_from_code",
]
