"""Forks, leases and views = none through the Python client, against a real daemon."""
import numpy as np
import pytest

import zipcache
from _support import make_keys, make_values


def _prefill(s, rng, layers, tokens):
    blocks = []
    for layer in range(layers):
        k = make_keys(rng, 1, 2, tokens, 32)
        v = make_values(rng, 1, 2, tokens, 32)
        s.update_and_fetch(layer, k, v)
        blocks.append((k, v))
    return blocks


def test_fork_shares_the_prefix_and_goes_on_alone(client, open_session):
    rng = np.random.default_rng(21)
    s = open_session(layers=2, kv_heads=2, head_dim=32, max_tokens=512, residual_tokens=16)
    _prefill(s, rng, 2, 200)
    for layer in range(2):
        for _ in range(5):
            s.update_and_fetch(layer, make_keys(rng, 1, 2, 1, 32), make_values(rng, 1, 2, 1, 32))
    before = [tuple(a.copy() for a in s.view(layer)) for layer in range(2)]
    f = s.fork(150, name="py-branch")
    assert f.info.views == "full"
    for layer in range(2):
        fk, fv = f.view(layer)
        assert fk.shape[2] == 150
        np.testing.assert_array_equal(fk, before[layer][0][:, :, :150])
        np.testing.assert_array_equal(fv, before[layer][1][:, :, :150])
    shared = {i.name: i.shared_bytes for i in client.list_sessions()}
    assert shared["py-branch"] > 0
    # Independent: the fork grows, the source is trimmed; neither sees the other.
    f.update_and_fetch(0, make_keys(rng, 1, 2, 3, 32), make_values(rng, 1, 2, 3, 32))
    s.trim(100)
    np.testing.assert_array_equal(f.view(1)[0], before[1][0][:, :, :150])
    np.testing.assert_array_equal(s.view(1)[0], before[1][0][:, :, :105])
    s.close()
    np.testing.assert_array_equal(f.view(1)[0], before[1][0][:, :, :150])
    f.close()


def test_views_none_returns_token_counts_and_reconstructs(open_session):
    rng = np.random.default_rng(22)
    s = open_session(layers=1, kv_heads=2, head_dim=32, max_tokens=512, residual_tokens=16,
                     views="none")
    assert s.info.views == "none"
    k = make_keys(rng, 1, 2, 100, 32)
    v = make_values(rng, 1, 2, 100, 32)
    assert s.update_and_fetch(0, k, v) == 100
    assert s.update_and_fetch(0, k[:, :, :3], v[:, :, :3]) == 103
    keys, values = s.reconstruct_layer(0)
    assert keys.shape == (1, 2, 103, 32)
    # The residual's rows are exact; the block's are its reconstruction.
    np.testing.assert_array_equal(keys[:, :, 100:], k[:, :, :3])
    with pytest.raises(zipcache.ZipCacheError):
        s.view(0)
    full = s.fork(103, name="as-full", views="full")
    np.testing.assert_array_equal(full.view(0)[0], keys)
    full.close()
    s.close()


def test_views_none_stats_are_a_full_twins(open_session):
    """stats() and layer_stats() read the layers' counters through the reader
    (a views="none" session has no view to read them from)."""
    rng = np.random.default_rng(23)
    none = open_session(layers=2, kv_heads=2, head_dim=32, max_tokens=512, residual_tokens=16,
                        views="none")
    full = open_session(layers=2, kv_heads=2, head_dim=32, max_tokens=512, residual_tokens=16)
    for tokens in (100, 3, 1, 20):
        for layer in range(2):
            k, v = make_keys(rng, 1, 2, tokens, 32), make_values(rng, 1, 2, tokens, 32)
            none.update_and_fetch(layer, k, v)
            full.update_and_fetch(layer, k, v)
    a, b = none.stats(), full.stats()
    assert a.total == b.total and a.layers == b.layers
    assert none.layer_stats(1) == full.layer_stats(1) == a.layers[1]
    assert a.layers[0].tokens == 124


def test_lease_check_and_release(open_session):
    rng = np.random.default_rng(23)
    s = open_session(layers=1, kv_heads=2, head_dim=32, max_tokens=256)
    s.update_and_fetch(0, make_keys(rng, 1, 2, 10, 32), make_values(rng, 1, 2, 10, 32))
    assert s.lease_valid
    s.check_lease()
    s.release_views()
    assert not s.lease_valid
    with pytest.raises(zipcache.StaleView):
        s.check_lease()
    s.view(0)          # a view is fetched again, but leases come with calls
    s.stats()
    assert s.lease_valid
    with pytest.raises(zipcache.InvalidArgument):
        s.fork(5, views="partial")


def test_seed_cache_surface_works_on_views_none(open_session):
    rng = np.random.default_rng(24)
    s = open_session(layers=1, kv_heads=2, head_dim=32, max_tokens=256, residual_tokens=16,
                     views="none")
    twin = open_session(layers=1, kv_heads=2, head_dim=32, max_tokens=256, residual_tokens=16)
    c, t = zipcache.ZipCacheKVCache(s, 0), zipcache.ZipCacheKVCache(twin, 0)
    for tokens in (40, 1, 1, 20):
        k, v = make_keys(rng, 1, 2, tokens, 32), make_values(rng, 1, 2, tokens, 32)
        K, V = c.update_and_fetch(k, v)
        TK, TV = t.update_and_fetch(k, v)
        np.testing.assert_array_equal(K, TK)
        np.testing.assert_array_equal(V, TV)
    np.testing.assert_array_equal(c.state[0], t.state[0])
