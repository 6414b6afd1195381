"""ZipCacheKVCache: the seed's surface, its byte accounting, trim, merge."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import zipcache
from zipcache import codec

from _support import LayerModel, assert_bits_equal, expected_layer, make_keys, make_values

FIELDS = ["compressed_key_bytes", "compressed_value_bytes", "baseline_key_bytes",
          "baseline_value_bytes", "fp16_key_bytes", "fp16_value_bytes"]


def test_for_model_and_update_and_fetch(open_session):
    rng = np.random.default_rng(30)
    s = open_session(layers=4, kv_heads=2, head_dim=16, policy="per_call")
    caches = zipcache.make_prompt_cache(s)
    assert [c.layer for c in caches] == [0, 1, 2, 3]
    assert [c.layer for c in zipcache.ZipCacheKVCache.for_model(s)] == [0, 1, 2, 3]
    assert all(c.offset == 0 and c.empty() for c in caches)
    blocks: list[list] = [[] for _ in caches]
    for n in (16, 1, 1):
        for i, cache in enumerate(caches):
            k, v = make_keys(rng, 1, 2, n, 16), make_values(rng, 1, 2, n, 16)
            blocks[i].append((k, v))
            K, V = cache.update_and_fetch(k, v)
            assert K.shape == (1, 2, cache.offset, 16)
    for i, cache in enumerate(caches):
        assert cache.offset == cache.size() == 18
        ek, ev = expected_layer(blocks[i], zipcache.Policy.PER_CALL, 0, zipcache.CodecConfig())
        K, V = cache.state
        assert_bits_equal(K, ek)
        assert_bits_equal(V, ev)


@pytest.mark.parametrize("policy", ["per_call", "streaming"])
def test_accounting_matches_session_stats(open_session, policy):
    rng = np.random.default_rng(31)
    s = open_session(layers=3, kv_heads=2, head_dim=32, head_dim_v=16, policy=policy,
                     residual_tokens=16)
    caches = zipcache.make_prompt_cache(s)
    for n in (40, 1, 1, 1):
        for cache in caches[:2]:  # layer 2 stays empty
            cache.update_and_fetch(make_keys(rng, 1, 2, n, 32), make_values(rng, 1, 2, n, 16))
    stats = s.stats()
    for cache, layer in zip(caches, stats.layers):
        for field in FIELDS + ["compression_ratio", "effective_avg_bits"]:
            assert getattr(cache, field) == getattr(layer, field), field
    assert caches[2].fp16_key_bytes == 0 and caches[2].compressed_key_bytes == 0
    for field in FIELDS:
        assert getattr(stats.total, field) == sum(getattr(c, field) for c in caches)
    c0 = caches[0]
    assert c0.fp16_key_bytes == 2 * 43 * 32 * 2 and c0.fp16_value_bytes == 2 * 43 * 16 * 2
    assert c0.compression_ratio == pytest.approx(c0.fp16_key_bytes / c0.compressed_key_bytes)
    assert c0.effective_avg_bits == pytest.approx(16 * c0.compressed_key_bytes / c0.fp16_key_bytes)
    assert c0.nbytes == c0.compressed_key_bytes + c0.compressed_value_bytes


def test_accounting_matches_the_codec_count(open_session):
    """per_call: the stored bytes are the sum of each block's codec byte count (independent of the daemon)."""
    rng = np.random.default_rng(32)
    config = zipcache.CodecConfig(hi_bits=6, lo_bits=3, hi_fraction=0.3, group_size=8)
    s = open_session(layers=1, kv_heads=2, head_dim=32, policy="per_call", codec=config)
    cache = zipcache.ZipCacheKVCache(s, 0)
    want = np.zeros((2, 3), dtype=np.int64)
    for n in (50, 1, 7):
        cache.update_and_fetch(make_keys(rng, 1, 2, n, 32), make_values(rng, 1, 2, n, 32))
        want[0] += codec.count_bytes((1, 2, n, 32), "keys", config)
        want[1] += codec.count_bytes((1, 2, n, 32), "values", config)
    assert (cache.compressed_key_bytes, cache.baseline_key_bytes, cache.fp16_key_bytes) == tuple(want[0])
    assert (cache.compressed_value_bytes, cache.baseline_value_bytes, cache.fp16_value_bytes) == tuple(want[1])


def test_accounting_follows_changes_from_elsewhere(open_session):
    """The properties are not stale after a trim or another handle's update."""
    rng = np.random.default_rng(33)
    s = open_session(layers=1, policy="per_call")
    cache = zipcache.ZipCacheKVCache(s, 0)
    cache.update_and_fetch(make_keys(rng, 1, 2, 10, 16), make_values(rng, 1, 2, 10, 16))
    before = cache.fp16_key_bytes
    s.trim(4)
    assert cache.fp16_key_bytes == before * 6 // 10
    assert cache.fp16_key_bytes == s.stats().layers[0].fp16_key_bytes


def test_seed_decode_inflation_and_streaming_fix(open_session):
    """The point of the streaming policy (DESIGN.md): per_call decode inflates memory."""
    rng = np.random.default_rng(34)
    per_call = zipcache.ZipCacheKVCache(open_session(layers=1, head_dim=128, policy="per_call"), 0)
    streaming = zipcache.ZipCacheKVCache(open_session(layers=1, head_dim=128), 0)
    for cache in (per_call, streaming):
        cache.update_and_fetch(make_keys(rng, 1, 2, 128, 128), make_values(rng, 1, 2, 128, 128))
        for _ in range(128):
            cache.update_and_fetch(make_keys(rng, 1, 2, 1, 128, sink=False), make_values(rng, 1, 2, 1, 128))
    assert per_call.compression_ratio < 1.0 < 4.0 < streaming.compression_ratio


def test_trim_layer_by_layer(open_session):
    """mlx_lm's trim_prompt_cache: every layer's trim(n) in turn, each applied at once."""
    rng = np.random.default_rng(35)
    s = open_session(layers=3, policy="per_call")
    caches = zipcache.make_prompt_cache(s)
    for cache in caches:
        cache.update_and_fetch(make_keys(rng, 1, 2, 10, 16), make_values(rng, 1, 2, 10, 16))
    prefix = [c.state[0][:, :, :7].copy() for c in caches]
    assert all(c.is_trimmable() for c in caches)
    assert caches[0].trim(3) == 3
    assert [c.offset for c in caches] == [7, 10, 10]
    assert [layer.tokens for layer in s.stats().layers] == [7, 10, 10]  # applied already
    assert caches[1].trim(3) == 3
    assert caches[2].trim(3) == 3
    assert [layer.tokens for layer in s.stats().layers] == [7, 7, 7]
    for cache, p in zip(caches, prefix):
        assert cache.offset == 7
        np.testing.assert_array_equal(cache.state[0], p)
    # Trimming more than a layer has cuts what there is (min(offset, n)).
    assert caches[0].trim(100) == 7
    assert caches[1].trim(100) == 7
    assert caches[2].trim(100) == 7
    assert all(c.empty() for c in caches)
    assert caches[0].trim(1) == 0
    assert caches[0].trim(0) == 0
    K, _ = caches[0].update_and_fetch(make_keys(rng, 1, 2, 2, 16), make_values(rng, 1, 2, 2, 16))
    assert K.shape[2] == 2


@pytest.mark.parametrize("policy", ["per_call", "streaming"])
def test_trim_one_layer(open_session, policy):
    """A layer's trim drops its own tokens only; the layer goes on from the new offset."""
    rng = np.random.default_rng(37)
    config = zipcache.CodecConfig()
    s = open_session(layers=3, policy=policy, residual_tokens=8)
    caches = zipcache.make_prompt_cache(s)
    models = [LayerModel(zipcache.Policy.coerce(policy), 8, config) for _ in caches]

    def update(i: int, n: int) -> None:
        k, v = make_keys(rng, 1, 2, n, 16), make_values(rng, 1, 2, n, 16)
        models[i].update(k, v)
        K, V = caches[i].update_and_fetch(k, v)
        ek, ev = models[i].layer()
        assert_bits_equal(K, ek)
        assert_bits_equal(V, ev)

    for n in (10, 3):  # streaming: one compressed block, 3 tokens in the residual
        for i in range(3):
            update(i, n)
    untouched = [tuple(np.array(a) for a in c.state) for c in caches]
    before = [{f: getattr(c, f) for f in FIELDS} for c in caches]  # primes the cached stats
    # 5 tokens: the whole last block (per_call) or residual (streaming), and
    # 2 tokens of the 10-token block, which stays whole.
    assert caches[0].trim(5) == 5
    assert models[0].trim(5) == 5
    assert [c.offset for c in caches] == [8, 13, 13]
    assert [layer.tokens for layer in s.stats().layers] == [8, 13, 13]
    K, V = caches[0].state
    ek, ev = models[0].layer()
    assert_bits_equal(K, ek)
    assert_bits_equal(V, ev)
    for cache, (k, v) in zip(caches[1:], untouched[1:]):
        K, V = cache.state
        assert_bits_equal(K, k)
        assert_bits_equal(V, v)
    # The accounting properties follow the trim (no stale cached stats).
    stats = s.stats()
    for cache, layer in zip(caches, stats.layers):
        for field in FIELDS + ["compression_ratio", "effective_avg_bits"]:
            assert getattr(cache, field) == getattr(layer, field), field
    assert caches[0].fp16_key_bytes == before[0]["fp16_key_bytes"] * 8 // 13
    assert caches[0].fp16_value_bytes == before[0]["fp16_value_bytes"] * 8 // 13
    assert caches[1].fp16_key_bytes == before[1]["fp16_key_bytes"]
    assert [getattr(caches[2], f) for f in FIELDS] == [before[2][f] for f in FIELDS]
    # Layer 0 goes on from offset 8, each value as the model says
    # (streaming: 1 + 1 + 6 fill the residual, which is compressed).
    for n in (1, 1, 6, 12, 1):
        update(0, n)
    assert caches[0].offset == 8 + 21
    update(1, 1)  # the other layers take updates as usual
    assert [c.offset for c in caches] == [29, 14, 13]
    # Another cut inside layer 0, then more updates.
    assert caches[0].trim(14) == models[0].trim(14) == 14
    update(0, 3)
    assert caches[0].offset == 18
    # More than a layer holds: min(offset, n).
    assert caches[2].trim(100) == 13
    assert caches[2].empty() and caches[2].trim(1) == 0
    assert [c.offset for c in caches] == [18, 14, 0]
    models[2].trim(100)
    update(2, 2)
    assert caches[2].offset == 2
    K, _ = caches[1].state
    ek, _ = models[1].layer()
    assert_bits_equal(K, ek)


def test_trim_layer_arguments(open_session):
    s = open_session(layers=2)
    cache = zipcache.ZipCacheKVCache(s, 1)
    with pytest.raises(zipcache.InvalidArgument):
        cache.trim(-1)
    with pytest.raises(zipcache.InvalidArgument):
        s.trim_layer(2, 1)
    with pytest.raises(zipcache.InvalidArgument):
        s.trim_layer(0, "1")
    assert s.trim_layer(0, 2**40) == 0  # clamped to uint32, nothing to cut


def test_session_trim(open_session):
    rng = np.random.default_rng(36)
    s = open_session(layers=2, residual_tokens=8)
    s.update_and_fetch(0, make_keys(rng, 1, 2, 5, 16), make_values(rng, 1, 2, 5, 16))
    s.update_and_fetch(1, make_keys(rng, 1, 2, 2, 16), make_values(rng, 1, 2, 2, 16))
    assert s.trim(3) == 3
    assert (s.tokens(0), s.tokens(1)) == (2, 0)


def test_merge_raises(open_session):
    cache = zipcache.ZipCacheKVCache(open_session(layers=1), 0)
    with pytest.raises(NotImplementedError, match="cannot be merged"):
        cache.merge([cache])
    with pytest.raises(NotImplementedError, match="cannot be merged"):
        zipcache.ZipCacheKVCache.merge([cache])


def test_context_managers(daemon):
    with zipcache.Client(daemon.socket_path) as c:
        with c.open_session(layers=1, kv_heads=1, head_dim=8, max_tokens=8, name="ctx") as s:
            assert "ctx" in [i.name for i in c.list_sessions()]
            assert "ctx" in repr(s)
        assert s.closed
        assert "ctx" not in [i.name for i in c.list_sessions()]
    assert c.closed


def test_threads_share_a_client(client):
    """The client's lock serialises calls; each thread has its own session."""
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            rng = np.random.default_rng(100 + i)
            with client.open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=64,
                                     policy="per_call") as s:
                for _ in range(20):
                    for layer in range(2):
                        k = make_keys(rng, 1, 2, 1, 16)
                        K, _ = s.update_and_fetch(layer, k, make_values(rng, 1, 2, 1, 16))
                        assert_bits_equal(K[:, :, -1:], codec.roundtrip(k, "keys"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
