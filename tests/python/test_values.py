"""What the arrays hold equals the C client's view and the codec's reconstruction, bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import zipcache
from zipcache import _lib, codec
from zipcache._lib import lib

from _support import assert_bits_equal, expected_layer, make_keys, make_values


def _c_path(session: zipcache.Session, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The layer read through the C API only (zc_session_view + its strides), copied out."""
    view = _lib.zc_view()
    assert lib.zc_session_view(session._handle.ptr, layer, ctypes.byref(view)) == 0

    def gather(pointer, strides, d: int) -> np.ndarray:
        base = ctypes.cast(pointer, ctypes.c_void_p).value
        out = np.empty((view.batch, view.kv_heads, view.tokens, d), dtype=np.uint16)
        for b in range(view.batch):
            for h in range(view.kv_heads):
                offset = (b * strides.batch + h * strides.head) * 2
                raw = ctypes.string_at(base + offset, view.tokens * strides.token * 2)
                rows = np.frombuffer(raw, dtype=np.uint16).reshape(view.tokens, strides.token)
                out[b, h] = rows[:, :d]
        return out.view(np.float16)

    return (gather(view.keys, view.key_strides, view.head_dim_k),
            gather(view.values, view.value_strides, view.head_dim_v))


CONFIGS = [
    zipcache.CodecConfig(),
    zipcache.CodecConfig(hi_bits=8, lo_bits=3, hi_fraction=0.5, group_size=4),
    zipcache.CodecConfig(hi_bits=2, lo_bits=1, hi_fraction=0.0, group_size=7, quantize_values=False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "8-3-half-g4", "2-1-none-exactv"])
def test_per_call_matches_codec(open_session, config):
    rng = np.random.default_rng(10)
    s = open_session(layers=2, batch=2, kv_heads=3, head_dim=32, head_dim_v=16,
                     policy="per_call", codec=config)
    blocks = []
    for n in (37, 1, 1, 5, 64):
        k, v = make_keys(rng, 2, 3, n, 32), make_values(rng, 2, 3, n, 16)
        blocks.append((k, v))
        K, V = s.update_and_fetch(1, k, v)
    ek, ev = expected_layer(blocks, zipcache.Policy.PER_CALL, 0, config)
    assert_bits_equal(K, ek)
    assert_bits_equal(V, ev)
    assert s.tokens(0) == 0


def test_streaming_matches_codec(open_session):
    rng = np.random.default_rng(11)
    config = zipcache.CodecConfig()
    s = open_session(layers=1, kv_heads=2, head_dim=16, residual_tokens=8, max_tokens=256)
    blocks = []
    # 3+3 wait exact, +2 fills the residual (compressed as one block of 8),
    # 20 goes straight through, 5 waits, 30 flushes those 5 then goes through,
    # then 1-token decode steps.
    for n in (3, 3, 2, 20, 5, 30, 1, 1, 1, 1, 1, 1, 1, 1, 1):
        k, v = make_keys(rng, 1, 2, n, 16), make_values(rng, 1, 2, n, 16)
        blocks.append((k, v))
        K, V = s.update_and_fetch(0, k, v)
        ek, ev = expected_layer(blocks, zipcache.Policy.STREAMING, 8, config)
        assert_bits_equal(K, ek)
        assert_bits_equal(V, ev)


def test_second_client_and_c_path_agree(daemon, client, open_session):
    rng = np.random.default_rng(12)
    s = open_session(layers=3, batch=2, kv_heads=2, head_dim=16, head_dim_v=24,
                     name="shared-values", residual_tokens=16)
    for layer in range(3):
        for n in (20, 3, 1):
            K, V = s.update_and_fetch(layer, make_keys(rng, 2, 2, n, 16), make_values(rng, 2, 2, n, 24))
    with zipcache.Client(daemon.socket_path) as other:
        twin = other.open_session(layers=3, batch=2, kv_heads=2, head_dim=16, head_dim_v=24,
                                  max_tokens=256, name="shared-values", attach=True)
        assert twin.id == s.id
        for layer in range(3):
            K, V = s.view(layer)
            K2, V2 = twin.view(layer)
            # Another mapping of the same pages.
            assert not np.shares_memory(K, K2)
            assert_bits_equal(K2, K)
            assert_bits_equal(V2, V)
            ck, cv = _c_path(s, layer)
            assert_bits_equal(K, ck)
            assert_bits_equal(V, cv)
        # An update through one handle is visible through the other.
        k, v = make_keys(rng, 2, 2, 2, 16), make_values(rng, 2, 2, 2, 24)
        twin.update_and_fetch(0, k, v)
        K, _ = s.view(0)
        assert K.shape[2] == 26
        np.testing.assert_array_equal(K[:, :, -2:], k)  # still in the exact residual
        twin.release()


def test_large_block_through_staging(open_session):
    """A block over the inline limit goes through the staging buffer; same result."""
    rng = np.random.default_rng(13)
    s = open_session(layers=1, kv_heads=8, head_dim=128, max_tokens=1024, policy="per_call")
    k, v = make_keys(rng, 1, 8, 512, 128), make_values(rng, 1, 8, 512, 128)
    K, V = s.update_and_fetch(0, k, v)
    assert_bits_equal(K, codec.roundtrip(k, "keys"))
    assert_bits_equal(V, codec.roundtrip(v, "values"))


def test_non_contiguous_input_is_accepted(open_session):
    """A [B, S, H, D] model tensor transposed to [B, H, S, D] is copied to C order, not rejected."""
    rng = np.random.default_rng(14)
    s = open_session(layers=1, kv_heads=2, head_dim=16, policy="per_call")
    bshd_k = np.ascontiguousarray(make_keys(rng, 1, 2, 9, 16).transpose(0, 2, 1, 3))
    bshd_v = np.ascontiguousarray(make_values(rng, 1, 2, 9, 16).transpose(0, 2, 1, 3))
    k, v = bshd_k.transpose(0, 2, 1, 3), bshd_v.transpose(0, 2, 1, 3)
    assert not k.flags.c_contiguous
    K, V = s.update_and_fetch(0, k, v)
    assert_bits_equal(K, codec.roundtrip(np.ascontiguousarray(k), "keys"))
    assert_bits_equal(V, codec.roundtrip(np.ascontiguousarray(v), "values"))


def test_returned_view_can_be_sent_back(open_session):
    """Views are strided (max_tokens rows per head); feeding one back copies it first."""
    rng = np.random.default_rng(15)
    a = open_session(layers=1, kv_heads=2, head_dim=16, residual_tokens=128)
    b = open_session(layers=1, kv_heads=2, head_dim=16, residual_tokens=128)
    K, V = a.update_and_fetch(0, make_keys(rng, 1, 2, 6, 16), make_values(rng, 1, 2, 6, 16))
    K2, V2 = b.update_and_fetch(0, K, V)
    assert_bits_equal(K2, K)
    assert_bits_equal(V2, V)


def test_big_endian_float16_is_converted(open_session):
    rng = np.random.default_rng(16)
    s = open_session(layers=1, kv_heads=2, head_dim=16, residual_tokens=128)
    k = make_keys(rng, 1, 2, 3, 16)
    K, _ = s.update_and_fetch(0, k.astype(">f2"), k.astype(">f2"))
    np.testing.assert_array_equal(K, k)
