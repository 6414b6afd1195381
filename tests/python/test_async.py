"""Zero-round-trip decode from Python: Session.update_async / wait / poll,
Client.wait_all and set_async, and ZipCacheKVCache(asynchronous=True)."""

from __future__ import annotations

import numpy as np
import pytest

import zipcache

from _support import assert_bits_equal, make_keys, make_values


def _pair(open_session, name_a, name_b, **shape):
    return open_session(name=name_a, **shape), open_session(name=name_b, **shape)


@pytest.mark.parametrize("views", ["full", "none"])
def test_async_loop_equals_sync(client, open_session, views):
    rng = np.random.default_rng(140)
    shape = dict(layers=2, kv_heads=2, head_dim=16, residual_tokens=8, max_tokens=2048,
                 views=views)
    a, s = _pair(open_session, f"py-async-{views}", f"py-sync-{views}", **shape)
    client.set_async(window=8, batch=4)
    tickets = [0, 0]
    for step in range(600):
        for layer in range(2):
            n = 3 if step % 37 == 0 else 1
            k, v = make_keys(rng, 1, 2, n, 16), make_values(rng, 1, 2, n, 16)
            tickets[layer] = a.update_async(layer, k, v)
            s.update_and_fetch(layer, k, v)
        if step % 7 == 0:
            a.poll(1, tickets[1])
        if step % 101 == 100:
            assert a.trim(5) == s.trim(5)
    a.wait(0, tickets[0])
    client.wait_all()
    a.stats()  # waits for the daemon's deferred flushes
    for layer in range(2):
        if views == "full":
            ka, va = a.view(layer)
            ks, vs = s.view(layer)
        else:
            ka, va = a.reconstruct_layer(layer)
            ks, vs = s.reconstruct_layer(layer)
        assert ka.shape == ks.shape
        assert_bits_equal(ka, ks)
        assert_bits_equal(va, vs)
    client.set_async(window=64, batch=1)


@pytest.mark.parametrize("ring", [0, 64 << 10])
def test_async_through_the_ring_or_the_socket(client, open_session, ring):
    """The same loop with the smallest request ring and with none: the session
    holds every update, in order, and the ring is there or not."""
    c = client
    c.set_async(ring=ring)
    rng = np.random.default_rng(142)
    s = open_session(name=f"py-ring-{ring}", layers=2, kv_heads=2, head_dim=16,
                     residual_tokens=8, max_tokens=1024)
    sent = [[], []]
    for step in range(200):
        for layer in range(2):
            k, v = make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16)
            s.update_async(layer, k, v)
            sent[layer].append((k, v))
    c.wait_all()
    size, doorbells = c.async_ring
    assert size == ring
    assert doorbells >= 0
    with pytest.raises(zipcache.InvalidArgument):
        c.set_async(ring=1000)
    s.stats()  # waits for the daemon's deferred flushes
    for layer in range(2):
        assert s.tokens(layer) == 200
        k, v = s.reconstruct_layer(layer)
        assert k.shape[2] == 200


def test_async_refusal_names_the_request(client, open_session):
    rng = np.random.default_rng(141)
    s = open_session(name="py-async-bad", layers=1, kv_heads=2, head_dim=16, check_finite=False)
    k, v = make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16)
    k[0, 0, 0, 0] = np.nan
    ticket = s.update_async(0, k, v)
    with pytest.raises(zipcache.InvalidArgument) as info:
        s.wait(0, ticket)
    assert f"asynchronous update {ticket}" in str(info.value)
    assert s.tokens(0) == 0
    with pytest.raises(zipcache.InvalidArgument):
        s.wait(0, ticket + 100)  # no such ticket
    with pytest.raises(zipcache.InvalidArgument):
        client.set_async(window=0)


def test_cache_asynchronous_returns_what_the_daemon_will_hold(client, open_session):
    rng = np.random.default_rng(142)
    s = open_session(name="py-async-cache", layers=3, kv_heads=2, head_dim=16, residual_tokens=8)
    caches = zipcache.make_prompt_cache(s, asynchronous=True)
    sync = open_session(name="py-async-cache-ref", layers=3, kv_heads=2, head_dim=16,
                        residual_tokens=8)
    ref = zipcache.make_prompt_cache(sync)
    prompt = [(make_keys(rng, 1, 2, 20, 16), make_values(rng, 1, 2, 20, 16)) for _ in caches]
    for cache, other, (k, v) in zip(caches, ref, prompt):
        cache.update_and_fetch(k, v)   # a prompt goes the synchronous way
        other.update_and_fetch(k, v)
    for step in range(40):
        for cache, other in zip(caches, ref):
            k, v = make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16)
            K, V = cache.update_and_fetch(k, v)
            RK, RV = other.update_and_fetch(k, v)
            assert K.shape == RK.shape
            # The newest tokens are exact either way; older ones are those
            # the daemon held after the previous step.
            assert_bits_equal(K[:, :, -1:], k)
            assert_bits_equal(V[:, :, -1:], v)
    client.wait_all()
    s.stats()
    for cache, other in zip(caches, ref):
        assert cache.offset == other.offset == 60
        assert_bits_equal(cache.state[0], other.state[0])
        assert_bits_equal(cache.state[1], other.state[1])


@pytest.mark.parametrize("spin", [0, 50, 100000])
def test_receive_spin_keeps_answers_the_same(client, open_session, spin):
    rng = np.random.default_rng(143 + spin)
    client.set_receive_spin(spin)
    s = open_session(name=f"py-spin-{spin}", layers=1, kv_heads=2, head_dim=16,
                     residual_tokens=8)
    for step in range(12):
        k, v = make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16)
        keys, values = s.update_and_fetch(0, k, v)
        assert keys.shape[2] == step + 1
    with pytest.raises(zipcache.InvalidArgument):
        client.set_receive_spin(100001)
    client.set_receive_spin(50)


def _prefill_blocks(rng, plan, heads=8, dim=128):
    return [(layer, make_keys(rng, 1, heads, tokens, dim), make_values(rng, 1, heads, tokens, dim))
            for layer, tokens in plan]


# 300 tokens at H 8, D 128: 1.2 MiB of K+V, over the inline limit (staged).
_MANY_SHAPE = dict(layers=3, kv_heads=8, head_dim=128, residual_tokens=128, max_tokens=2048)


def test_update_many_equals_one_update_per_block(client, open_session):
    """A prefill of every layer in one update_many, large blocks through the
    staging slots and short ones inline, holds bit for bit what one
    update_and_fetch per block does."""
    rng = np.random.default_rng(515)
    many, one = _pair(open_session, "py-many", "py-one", **_MANY_SHAPE)
    blocks = _prefill_blocks(rng, [(0, 300), (1, 300), (2, 330), (0, 5), (1, 310), (2, 7)])
    assert many.update_many(blocks) == len(blocks)
    assert many.update_many([]) == 0
    for layer, k, v in blocks:
        one.update_and_fetch(layer, k, v)
    for layer in range(3):
        ka, va = many.view(layer)
        ks, vs = one.view(layer)
        assert ka.shape[2] == sum(k.shape[2] for l, k, _ in blocks if l == layer)
        assert_bits_equal(ka, ks)
        assert_bits_equal(va, vs)


def test_update_many_checks_every_block_before_sending(client, open_session):
    """A bad block anywhere in the list (shape, layer, form, NaN with
    check_finite) fails the call with nothing sent."""
    rng = np.random.default_rng(516)
    s = open_session(name="py-many-checks", check_finite=True, **_MANY_SHAPE)
    good = _prefill_blocks(rng, [(0, 300), (1, 5)])
    k, v = make_keys(rng, 1, 8, 300, 128), make_values(rng, 1, 8, 300, 128)
    nan = v.copy()
    nan[0, 3, 17, 9] = np.nan
    for bad, kind in [((2, k[:, :4], v[:, :4]), zipcache.InvalidArgument),
                      ((2, k, v[:, :, :299]), zipcache.InvalidArgument),
                      ((3, k, v), zipcache.InvalidArgument),
                      ((2, k), zipcache.InvalidArgument),
                      ((2, k, nan), zipcache.InvalidArgument),
                      ((2, k.astype(np.float32), v), TypeError)]:
        with pytest.raises(kind) as caught:
            s.update_many(good + [bad])
        assert caught.value.applied == 0
        if kind is zipcache.InvalidArgument:
            assert caught.value.operation == "update_many"
    for layer in range(3):
        assert s.tokens(layer) == 0


def test_update_many_refusal_holds_back_nothing_else(client, open_session):
    """The daemon refuses one staged block (an Inf it finds itself): the
    error names that layer and says how many were applied, and the blocks
    before and after it are stored."""
    rng = np.random.default_rng(517)
    s = open_session(name="py-many-refused", **_MANY_SHAPE)
    blocks = _prefill_blocks(rng, [(0, 300), (1, 300), (2, 300), (0, 4)])
    blocks[1][2][0, 0, 0, 0] = np.inf
    with pytest.raises(zipcache.InvalidArgument) as caught:
        s.update_many(blocks)
    assert caught.value.applied == 3
    assert "layer 1" in str(caught.value)
    assert [s.tokens(layer) for layer in range(3)] == [304, 0, 300]
