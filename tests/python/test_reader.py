"""The compressed form read in this process: zero-copy arrays over the pool and
the residual, reconstruction bit-identical to the daemon's views, and reads that
say when the layer changed under them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import zipcache
from zipcache import _lib, codec
from zipcache._lib import lib

from _support import LayerModel, assert_bits_equal, make_keys, make_values
from conftest import start_daemon, stop_daemon


def _maps() -> list[tuple[int, int, str, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def _mapping_of(a: np.ndarray) -> tuple[int, int, str, str]:
    start = a.__array_interface__["data"][0]
    last = start + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    hits = [m for m in _maps() if m[0] <= start and last <= m[1]]
    assert len(hits) == 1, "the array must lie inside one mapping"
    return hits[0]


# --- the ctypes mirrors ---------------------------------------------------------


@pytest.mark.parametrize("cls", _lib.MIRRORED_STRUCTS, ids=lambda c: c.__name__)
def test_mirrored_structs_match_the_library(cls):
    name = cls.__name__.encode()
    assert lib.zc_reader_layout_of(name, None) == ctypes.sizeof(cls)
    for field, _ in cls._fields_:
        assert lib.zc_reader_layout_of(name, field.encode()) == getattr(cls, field).offset, field
    assert lib.zc_reader_layout_of(name, b"no_such_field") == ctypes.c_size_t(-1).value


# --- a long mixed session -------------------------------------------------------


class _Mixed:
    """A session and per-layer models, driven through prefill, decode, flushes and trims."""

    def __init__(self, open_session, policy="streaming", residual_tokens=8, **codec_kw):
        self.config = zipcache.CodecConfig(**codec_kw)
        self.s = open_session(layers=2, batch=2, kv_heads=2, head_dim=16, head_dim_v=8,
                              max_tokens=512, policy=policy, residual_tokens=residual_tokens,
                              codec=self.config)
        self.models = [LayerModel(zipcache.Policy.coerce(policy), residual_tokens, self.config)
                       for _ in range(2)]
        self.rng = np.random.default_rng(11)

    def update(self, layer: int, tokens: int) -> None:
        k = make_keys(self.rng, 2, 2, tokens, 16)
        v = make_values(self.rng, 2, 2, tokens, 8)
        self.s.update_and_fetch(layer, k, v)
        self.models[layer].update(k, v)
        self.check(layer)

    def trim(self, tokens: int) -> None:
        self.s.trim(tokens)
        for m in self.models:
            m.trim(tokens)
        for layer in range(2):
            self.check(layer)

    def check(self, layer: int) -> None:
        K, V = self.s.view(layer)
        RK, RV = self.s.reconstruct_layer(layer)
        assert RK.flags.c_contiguous and RK.flags.owndata and RK.flags.writeable
        assert_bits_equal(RK, K)
        assert_bits_equal(RV, V)
        EK, EV = self.models[layer].layer()
        assert_bits_equal(RK, EK)
        assert_bits_equal(RV, EV)
        # Block by block: they tile the layer, and each reconstructs to the
        # view's rows it covers.
        blocks = self.s.layer_blocks(layer)
        first = 0
        for i, b in enumerate(blocks):
            assert b.index == i and b.first_token == first and 0 < b.valid_tokens <= b.tokens
            bk, bv = b.reconstruct()
            assert bk.shape == (2, 2, b.valid_tokens, 16) and bv.shape == (2, 2, b.valid_tokens, 8)
            assert_bits_equal(bk, K[:, :, first:first + b.valid_tokens])
            assert_bits_equal(bv, V[:, :, first:first + b.valid_tokens])
            assert b.key_payload.size == codec.count_bytes((2, 2, b.tokens, 16), "keys",
                                                           self.config)[0]
            assert b.value_payload.size == codec.count_bytes((2, 2, b.tokens, 8), "values",
                                                             self.config)[0]
            first += b.valid_tokens
        rk, rv = self.s.layer_residual(layer)
        assert first + rk.shape[2] == K.shape[2]
        assert_bits_equal(rk, K[:, :, first:])
        assert_bits_equal(rv, V[:, :, first:])


def test_reconstruct_layer_is_the_view_bit_for_bit_over_a_mixed_session(open_session):
    m = _Mixed(open_session)
    for tokens in (40, 9, 3, 8, 1):
        for layer in range(2):
            m.update(layer, tokens)
    for step in range(120):  # the residual of 8 fills and is compressed, again and again
        m.update(step % 2, 1 + (step % 9 == 0))
    m.trim(2)    # inside the residual
    m.trim(30)   # through it and into a block, which stays whole with its tail cut
    for step in range(30):
        m.update(step % 2, 1)
    m.update(0, 25)
    m.trim(27)
    m.update(1, 12)


def test_per_call_and_exact_values_reconstruct_bit_for_bit(open_session):
    m = _Mixed(open_session, policy="per_call", residual_tokens=0, group_size=5,
               quantize_values=False)
    for tokens in (17, 1, 2, 33, 1, 4):
        for layer in range(2):
            m.update(layer, tokens)
    m.trim(20)
    m.update(0, 3)


# --- zero copy --------------------------------------------------------------------


@pytest.fixture
def layered(open_session):
    rng = np.random.default_rng(12)
    s = open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=256, residual_tokens=8)
    s.update_and_fetch(0, make_keys(rng, 1, 2, 30, 16), make_values(rng, 1, 2, 30, 16))
    s.update_and_fetch(0, make_keys(rng, 1, 2, 20, 16), make_values(rng, 1, 2, 20, 16))
    k = make_keys(rng, 1, 2, 5, 16)
    s.update_and_fetch(0, k, make_values(rng, 1, 2, 5, 16))
    return s, k


def test_payloads_are_read_only_arrays_over_the_pool_mapping(layered):
    s, _ = layered
    blocks = s.layer_blocks(0)
    assert [(b.first_token, b.tokens, b.valid_tokens) for b in blocks] == [(0, 30, 30), (30, 20, 20)]
    pool = lib.zc_session_pool(s._handle.ptr, None)
    for b in blocks:
        for payload, offset in ((b.key_payload, b.key_offset), (b.value_payload, b.value_offset)):
            assert payload.dtype == np.uint8 and payload.ndim == 1
            assert not payload.flags.owndata and not payload.flags.writeable
            assert payload.__array_interface__["data"][0] == pool + offset
            start, end, perms, path = _mapping_of(payload)
            assert perms == "r--s", f"expected a read-only shared mapping, got {perms}"
            assert "pool-" in path, path
            with pytest.raises(ValueError):
                payload[0] = 1
            with pytest.raises(ValueError):
                payload.flags.writeable = True
    # A second read names the same bytes: no copy anywhere.
    again = s.layer_blocks(0)
    assert np.shares_memory(again[1].key_payload, blocks[1].key_payload)
    assert not np.shares_memory(blocks[0].key_payload, blocks[1].key_payload)


def test_payload_bytes_are_the_codecs_for_the_keys_sent(open_session):
    rng = np.random.default_rng(13)
    s = open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=64, policy="per_call")
    k = make_keys(rng, 1, 2, 12, 16)
    v = make_values(rng, 1, 2, 12, 16)
    s.update_and_fetch(0, k, v)
    (block,) = s.layer_blocks(0)
    assert block.key_payload.tobytes() == codec.compress(k, "keys", s.info.codec)
    assert block.value_payload.tobytes() == codec.compress(v, "values", s.info.codec)


def test_residual_rows_are_views_of_the_view(layered):
    s, k = layered
    rk, rv = s.layer_residual(0)
    K, V = s.view(0)
    assert rk.shape == (1, 2, 5, 16)
    assert not rk.flags.writeable and not rk.flags.owndata
    assert np.shares_memory(rk, K) and np.shares_memory(rv, V)
    assert rk.__array_interface__["data"][0] == K[:, :, 50:].__array_interface__["data"][0]
    assert_bits_equal(rk, k)  # the exact tokens sent
    assert _mapping_of(rk)[2] == "r--s"


def test_arrays_keep_the_mapping_after_release(client, layered):
    s, _ = layered
    (block, _b), rk = s.layer_blocks(0), s.layer_residual(0)[0]
    snapshot = block.key_payload.copy()
    s.release()
    np.testing.assert_array_equal(block.key_payload, snapshot)  # still mapped
    assert rk.shape[2] == 5


# --- the protocol -------------------------------------------------------------------


def test_a_write_during_a_read_is_reported(layered):
    s, _ = layered
    rng = np.random.default_rng(14)
    with pytest.raises(zipcache.ConcurrentWrite):
        with s.read(0) as r:
            assert r.tokens == 55 and r.residual_tokens == 5 and r.n_blocks == 2
            assert r.sequence % 2 == 0 and r.view_valid
            r.blocks()
            s.update_and_fetch(0, make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16))
    with s.read(0) as r:  # nothing in between: no complaint
        assert r.tokens == 56


def test_reads_retry_until_one_is_consistent(layered):
    s, _ = layered
    rng = np.random.default_rng(15)
    attempts = s.reads(0)
    seen = []
    for attempt in attempts:
        with attempt as r:
            seen.append(r.tokens)
            if len(seen) == 1:
                s.update_and_fetch(0, make_keys(rng, 1, 2, 2, 16), make_values(rng, 1, 2, 2, 16))
    assert seen == [55, 57] and attempts.attempts == 2


def test_a_read_not_begun_refuses(layered):
    s, _ = layered
    r = s.read(0)
    with pytest.raises(zipcache.FailedPrecondition):
        r.blocks()
    with pytest.raises(zipcache.InvalidArgument):
        s.read(1)


def test_a_dropped_view_is_reported_then_brought_back(tmp_path):
    """A read held across a view drop is told; reconstruct_layer brings the view back."""
    daemon = start_daemon(tmp_path / "d", "--memory-budget", "24M")
    try:
        rng = np.random.default_rng(16)
        with zipcache.Client(daemon.socket_path, timeout=20) as c:
            cold = c.open_session(layers=2, kv_heads=4, head_dim=128, max_tokens=4096,
                                  residual_tokens=16, name="cold")
            model = LayerModel(zipcache.Policy.STREAMING, 16, cold.info.codec)
            for layer in range(2):
                for tokens in (600, 10):
                    k, v = make_keys(rng, 1, 4, tokens, 128), make_values(rng, 1, 4, tokens, 128)
                    cold.update_and_fetch(layer, k, v)
                    if layer == 0:
                        model.update(k, v)
            hot = c.open_session(layers=1, kv_heads=4, head_dim=128, max_tokens=8192,
                                 residual_tokens=16, name="hot")
            held = cold.read(0).begin()
            cold.release_views()  # against the rules, the read goes on past its lease
            stale = None
            for _ in range(30):
                hot.update_and_fetch(0, make_keys(rng, 1, 4, 256, 128),
                                     make_values(rng, 1, 4, 256, 128))
                try:
                    held.end()
                except zipcache.StaleView as e:
                    stale = e
                    break
            assert stale is not None, "the daemon never dropped the idle session's views"
            with cold.read(0) as r:
                assert not r.view_valid
                with pytest.raises(zipcache.StaleView):
                    r.residual()
            hot.release_views()  # so that its views may make room for the rebuild
            K, V = cold.reconstruct_layer(0)  # refreshes the view, then reads
            EK, EV = model.layer()
            assert_bits_equal(K, EK)
            assert_bits_equal(V, EV)
            with cold.read(0) as r:
                assert r.view_valid
            hot.close()
            cold.close()
    finally:
        assert stop_daemon(daemon) == 0
