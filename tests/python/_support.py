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


def expected_layer(blocks: list[tuple[np.ndarray, np.ndarray]], policy: zipcache.Policy,
                   residual_tokens: int, config: zipcache.CodecConfig) -> tuple[np.ndarray, np.ndarray]:
    """The layer's K/V after these update_and_fetch blocks, per DESIGN.md's block policy.

    per_call: each block is compressed on its own. streaming: blocks of at
    least residual_tokens tokens are compressed on their own (after the
    residual, flushed first); shorter ones join the exact fp16 residual,
    which is compressed as one block once it holds residual_tokens tokens.
    """
    keys_out: list[np.ndarray] = []
    values_out: list[np.ndarray] = []
    residual: list[tuple[np.ndarray, np.ndarray]] = []

    def compress(k: np.ndarray, v: np.ndarray) -> None:
        keys_out.append(codec.roundtrip(k, "keys", config))
        values_out.append(codec.roundtrip(v, "values", config))

    def flush() -> None:
        if residual:
            compress(np.concatenate([k for k, _ in residual], axis=2),
                     np.concatenate([v for _, v in residual], axis=2))
            residual.clear()

    for k, v in blocks:
        if policy == zipcache.Policy.PER_CALL or k.shape[2] >= residual_tokens:
            flush()
            compress(k, v)
        else:
            residual.append((k, v))
            if sum(r.shape[2] for r, _ in residual) >= residual_tokens:
                flush()
    keys_out += [k for k, _ in residual]
    values_out += [v for _, v in residual]
    return np.concatenate(keys_out, axis=2), np.concatenate(values_out, axis=2)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    a = np.ascontiguousarray(actual).view(np.uint16)
    e = np.ascontiguousarray(expected).view(np.uint16)
    mismatched = int((a != e).sum())
    assert mismatched == 0, f"{mismatched} of {a.size} elements differ"
