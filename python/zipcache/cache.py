"""ZipCacheKVCache: the seed's per-layer cache surface, backed by zipcached.

The seed (veloxquant_mlx.cache.zipcache_cache.ZipCacheKVCache) compressed
each block in-process and kept the reconstruction itself. Here the daemon
does the compressing and keeps both the compressed store and the fp16
view; this class is one layer's window onto a Session, with the same
methods and byte-accounting properties, so a decode loop written for the
seed (mlx_lm style: one cache per layer, ``update_and_fetch`` per step)
runs unchanged apart from building the caches.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from .client import LayerStats, Policy, Session

__all__ = ["ZipCacheKVCache", "make_prompt_cache"]


class ZipCacheKVCache:
    """One layer of a zipcached Session, with the seed's surface.

    update_and_fetch returns read-only float16 views of the daemon's shared
    mapping (see zipcache.client for their lifetime). The byte-accounting
    properties are this layer's share of the session's stats, as the daemon
    reports them.
    """

    def __init__(self, session: Session, layer: int, asynchronous: bool = False) -> None:
        session._check_layer(layer, "ZipCacheKVCache")
        self.session = session
        self.layer = int(layer)
        # Zero-round-trip mode: see update_and_fetch.
        self.asynchronous = bool(asynchronous)
        self._ticket = 0

    @classmethod
    def for_model(cls, session: Session) -> list["ZipCacheKVCache"]:
        """One cache per layer of the session, in layer order (mlx_lm's prompt cache)."""
        return [cls(session, layer) for layer in range(session.layers)]

    def __repr__(self) -> str:
        return f"<ZipCacheKVCache layer={self.layer} of {self.session.name!r}>"

    # -- the mlx_lm cache protocol

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        """Appends float16 [B, H, S, D] keys/values; returns all [B, H, offset, D] K/V.

        The daemon routes key tokens by L2-norm saliency (top hi_fraction at
        hi_bits, the rest at lo_bits; values at hi_bits) and hands back the
        reconstruction zero-copy: the returned arrays are read-only views of
        its shared mapping, not copies. On a ``views="none"`` session (no
        fp16 kept by the daemon) the layer is reconstructed here from its
        blocks and residual instead: copies, O(tokens) per call — use
        ``zipcache.attend`` there rather than this surface.
        """
        if self.asynchronous and self._async_allowed(keys):
            return self._update_async(keys, values)
        result = self.session.update_and_fetch(self.layer, keys, values)
        if isinstance(result, int):
            return self.session.reconstruct_layer(self.layer)
        return result

    def _async_allowed(self, keys: Any) -> bool:
        """Where the seed surface allows it: a streaming session with views, and a block
        short enough to stay exact in the residual (so what it returns is what the
        daemon will hold)."""
        info = self.session.info
        shape = getattr(keys, "shape", ())
        return (info.policy == Policy.STREAMING and info.views != "none" and len(shape) == 4
                and 0 < shape[2] < info.residual_tokens)

    def _update_async(self, keys: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        """Sends the block without waiting and returns the layer as the daemon will hold it:
        the tokens it had (after this layer's previous update, whose reply has come by
        now) followed by the new ones, exact, as copies (the view does not hold the new
        tokens yet)."""
        if self._ticket:
            self.session.wait(self.layer, self._ticket)
        before_k, before_v = self.session.view(self.layer)
        keys = np.ascontiguousarray(keys, dtype=np.float16)
        values = np.ascontiguousarray(values, dtype=np.float16)
        self._ticket = self.session.update_async(self.layer, keys, values)
        return (np.concatenate([before_k, keys], axis=2),
                np.concatenate([before_v, values], axis=2))

    @property
    def offset(self) -> int:
        """Tokens this layer holds (read from the mapping, no round trip)."""
        return self.session.tokens(self.layer)

    @property
    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """The layer's K/V now, as read-only views (no update); copies with views="none"."""
        if self.session.info.views == "none":
            return self.session.reconstruct_layer(self.layer)
        return self.session.view(self.layer)

    def is_trimmable(self) -> bool:
        """True: the daemon can drop trailing tokens (speculative decoding)."""
        return True

    def trim(self, n: int) -> int:
        """Drops the last ``n`` tokens of this layer now; returns how many it dropped.

        mlx_lm's semantics: min(offset, n) tokens go, from this layer only
        (the daemon's per-layer trim); the next update continues from the
        new offset. ``trim_prompt_cache`` calls it on every layer in turn.
        """
        return self.session.trim_layer(self.layer, n)

    def empty(self) -> bool:
        return self.offset == 0

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        """Bytes the daemon really stores for this layer (compressed K + V)."""
        return self.stats.compressed_bytes

    @classmethod
    def merge(cls, *args: Any, **kwargs: Any) -> NoReturn:
        """Not supported, as in the seed: a cache is one daemon session's layer.

        Merging caches (batching sequences) would mean merging daemon
        sessions with their compressed blocks; open one session with the
        batch size instead.
        """
        raise NotImplementedError(
            "ZipCacheKVCache cannot be merged: each cache is a layer of one zipcached session; "
            "open a session with batch=B for batched sequences instead"
        )

    # -- the seed's byte accounting

    @property
    def stats(self) -> LayerStats:
        """All of this layer's accounting at once (one lookup, see Session.layer_stats)."""
        return self.session.layer_stats(self.layer)

    @property
    def compressed_key_bytes(self) -> int:
        """Realized stored bytes of the keys (mixed hi/lo-bit codes; residual as fp16)."""
        return self.stats.compressed_key_bytes

    @property
    def compressed_value_bytes(self) -> int:
        """Realized stored bytes of the values (uniform hi_bits codes; residual as fp16)."""
        return self.stats.compressed_value_bytes

    @property
    def baseline_key_bytes(self) -> int:
        """Uniform lo-bit baseline for the keys (no saliency routing)."""
        return self.stats.baseline_key_bytes

    @property
    def baseline_value_bytes(self) -> int:
        """Uniform lo-bit baseline for the values."""
        return self.stats.baseline_value_bytes

    @property
    def fp16_key_bytes(self) -> int:
        """What the keys would cost uncompressed."""
        return self.stats.fp16_key_bytes

    @property
    def fp16_value_bytes(self) -> int:
        """What the values would cost uncompressed."""
        return self.stats.fp16_value_bytes

    @property
    def compression_ratio(self) -> float:
        """fp16 bytes / compressed bytes, key side; > 1 means savings."""
        return self.stats.compression_ratio

    @property
    def effective_avg_bits(self) -> float:
        """Average stored bits per key element (16 * compressed / fp16)."""
        return self.stats.effective_avg_bits


def make_prompt_cache(session: Session, asynchronous: bool = False) -> list[ZipCacheKVCache]:
    """One ZipCacheKVCache per layer of ``session`` (mlx_lm's make_prompt_cache);
    ``asynchronous``: decode steps do not wait for the daemon (update_and_fetch)."""
    return [ZipCacheKVCache(session, layer, asynchronous) for layer in range(session.layers)]
