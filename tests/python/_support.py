"""Shared test helpers: synthetic K/V and the reference model of a layer."""

from __future__ import annotations

import numpy as np

import zipcache
from zipcache import codec


# --- synthetic data -------------------------------------------------------------


def make_keys(rng: np.random.Generator, b: int, h: int, s: int, d: int,
              sink: bool = True) -> np.ndarray:
    """Keys as real ones look: a few large-magnitude channels, a high-norm first token."""
    x = rng.standard_normal((b, h, s, d)).astype(np.float32)
    channels = rng.choice(d, size=min(4, d), replace=False)
    x[..., channels] += rng.uniform(8, 16, size=(h, 1, len(channels))) * rng.choice([-1, 1], size=len(channels))
    if sink:
        x[:, :, :1, :] *= 6
    return x.astype(np.float16)


def make_values(rng: np.random.Generator, b: int, h: int, s: int, d: int) -> np.ndarray:
    return rng.standard_normal((b, h, s, d)).astype(np.float16)


# --- what the daemon should hand back, computed with the codec in-process --------


class LayerModel:
    """One layer as the daemon keeps it, computed with the codec in-process.

    Follows DESIGN.md's block policy. per_call: each block is compressed on
    its own. streaming: blocks of at least residual_tokens tokens are
    compressed on their own (after the residual, flushed first); shorter
    ones join the exact fp16 residual, which is compressed as one block
    once it holds residual_tokens tokens. trim(n) as the daemon's per-layer
    trim: a cut within the residual shortens it; a deeper cut drops the
    residual and whole blocks past the cut, and a block cut in the middle
    stays whole (its kept prefix is the prefix of its reconstruction).
    """

    def __init__(self, policy: zipcache.Policy, residual_tokens: int,
                 config: zipcache.CodecConfig) -> None:
        self.policy = zipcache.Policy.coerce(policy)
        self.residual_tokens = residual_tokens
        self.config = config
        # Compressed blocks: [keys reconstruction, values reconstruction, valid tokens].
        self.blocks: list[list] = []
        self.residual: list[tuple[np.ndarray, np.ndarray]] = []
        self.shape: tuple[int, int, int, int] | None = None  # (B, H, Dk, Dv)

    def _compress(self, k: np.ndarray, v: np.ndarray) -> None:
        self.blocks.append([codec.roundtrip(k, "keys", self.config),
                            codec.roundtrip(v, "values", self.config), k.shape[2]])

    def _flush(self) -> None:
        if self.residual:
            self._compress(np.concatenate([k for k, _ in self.residual], axis=2),
                           np.concatenate([v for _, v in self.residual], axis=2))
            self.residual.clear()

    def _residual_count(self) -> int:
        return sum(k.shape[2] for k, _ in self.residual)

    @property
    def tokens(self) -> int:
        return sum(valid for _, _, valid in self.blocks) + self._residual_count()

    def update(self, k: np.ndarray, v: np.ndarray) -> None:
        self.shape = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if self.policy == zipcache.Policy.PER_CALL or k.shape[2] >= self.residual_tokens:
            self._flush()
            self._compress(k, v)
        else:
            self.residual.append((k, v))
            if self._residual_count() >= self.residual_tokens:
                self._flush()

    def trim(self, n: int) -> int:
        cut = min(n, self.tokens)
        keep = self.tokens - cut
        residual = self._residual_count()
        if cut <= residual:
            k = np.concatenate([k for k, _ in self.residual], axis=2) if self.residual else None
            v = np.concatenate([v for _, v in self.residual], axis=2) if self.residual else None
            self.residual = [(k[:, :, :residual - cut], v[:, :, :residual - cut])] if residual > cut else []
            return cut
        self.residual = []
        first = 0
        kept: list[list] = []
        for block in self.blocks:
            if first >= keep:
                break
            kept.append([block[0], block[1], min(block[2], keep - first)])
            first += block[2]
        self.blocks = kept
        return cut

    def layer(self) -> tuple[np.ndarray, np.ndarray]:
        keys = [k[:, :, :valid] for k, _, valid in self.blocks] + [k for k, _ in self.residual]
        values = [v[:, :, :valid] for _, v, valid in self.blocks] + [v for _, v in self.residual]
        if not keys:
            assert self.shape is not None, "no block seen yet"
            b, h, dk, dv = self.shape
            return np.zeros((b, h, 0, dk), np.float16), np.zeros((b, h, 0, dv), np.float16)
        return np.concatenate(keys, axis=2), np.concatenate(values, axis=2)


def expected_layer(blocks: list[tuple[np.ndarray, np.ndarray]], policy: zipcache.Policy,
                   residual_tokens: int, config: zipcache.CodecConfig) -> tuple[np.ndarray, np.ndarray]:
    """The layer's K/V after these update_and_fetch blocks (see LayerModel)."""
    model = LayerModel(policy, residual_tokens, config)
    for k, v in blocks:
        model.update(k, v)
    return model.layer()


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    a = np.ascontiguousarray(actual).view(np.uint16)
    e = np.ascontiguousarray(expected).view(np.uint16)
    mismatched = int((a != e).sum())
    assert mismatched == 0, f"{mismatched} of {a.size} elements differ"
