"""Prefix reuse by content (docs/PREFIX.md) through the Python client."""
import numpy as np
import pytest

import zipcache
from zipcache import CHUNK_TOKENS
from _support import make_keys, make_values

SHAPE = dict(layers=2, kv_heads=2, head_dim=16)

# Pinned in tests/prefix_test.c too: the chain rule is one definition.
PINNED_FIRST = "1ad0492d3dbb85bc9cc579c431609f52"
PINNED_SECOND = "affa74b72c264e9c6a96b91531261780"


def test_chain_rule_is_the_c_librarys():
    ids = np.arange(CHUNK_TOKENS)
    first = zipcache.chunk_chain(None, ids)
    assert first.hex() == PINNED_FIRST
    assert zipcache.chunk_chain(first, ids).hex() == PINNED_SECOND
    assert zipcache.chunk_chain(bytes(16), list(range(CHUNK_TOKENS))) == first
    keys = zipcache.chunk_keys(np.concatenate([ids, ids, ids[:100]]))
    assert [k.hex() for k in keys] == [PINNED_FIRST, PINNED_SECOND]
    other = ids.copy()
    other[7] += 1 << 24  # the high byte of one token id
    assert zipcache.chunk_chain(None, other) != first


@pytest.mark.parametrize("bad", [[], [-1], [2**32], np.zeros((2, 2), dtype=np.int64), [0.5]])
def test_chain_rule_refuses_what_is_not_token_ids(bad):
    with pytest.raises(zipcache.InvalidArgument):
        zipcache.chunk_chain(None, bad)


def _prompt_kv(rng, tokens):
    return [(make_keys(rng, 1, 2, tokens, 16), make_values(rng, 1, 2, tokens, 16))
            for _ in range(SHAPE["layers"])]


def test_prefix_open_shares_and_equals_a_prefill(client, open_session):
    rng = np.random.default_rng(5)
    ids = np.arange(3 * CHUNK_TOKENS + 40) * 7 + 1
    kv = _prompt_kv(rng, ids.size)
    writer = open_session(max_tokens=2048, model_id="py-prefix", **SHAPE)
    chain = []
    for layer, (k, v) in enumerate(kv):
        chain = writer.prefill_chunked(layer, ids, k, v)
    assert chain == zipcache.chunk_keys(ids) and len(chain) == 3
    assert writer.tokens(0) == ids.size

    held = client.lookup_prefix(chain, model_id="py-prefix", **SHAPE)
    assert held == zipcache.PrefixHeld(3, 3 * CHUNK_TOKENS, 3)
    assert client.lookup_prefix(chain, model_id="another", **SHAPE).chunks == 0
    assert client.lookup_prefix(chain[1:], model_id="py-prefix", **SHAPE).chunks == 0

    before = client.memory_stats().blocks_bytes
    reader = open_session(max_tokens=2048, model_id="py-prefix", prefix=chain[:held.chunks],
                          **SHAPE)
    assert client.memory_stats().blocks_bytes == before
    assert reader.tokens(0) == held.tokens
    # The worker prefills only the rest, and the result equals a session
    # that prefilled everything itself.
    for layer, (k, v) in enumerate(kv):
        reader.prefill_chunked(layer, ids, k[:, :, held.tokens:], v[:, :, held.tokens:],
                               start=held.tokens)
    alone = open_session(max_tokens=2048, model_id="py-prefix", **SHAPE)
    for layer, (k, v) in enumerate(kv):
        alone.update_and_fetch(layer, k, v)
    for layer in range(SHAPE["layers"]):
        for x, y, z in zip(reader.view(layer), writer.view(layer), alone.reconstruct_layer(layer)):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(reader.reconstruct_layer(layer), writer.reconstruct_layer(layer)):
            np.testing.assert_array_equal(x, y)
    # The session that sent one block of everything cut it differently: the
    # first whole chunks are what make sharing work.
    assert reader.stats().total.blocks == writer.stats().total.blocks


def test_bad_prefixes_are_refused(client, open_session):
    rng = np.random.default_rng(6)
    ids = np.arange(CHUNK_TOKENS) + 99
    s = open_session(max_tokens=1024, model_id="py-bad", **SHAPE)
    k, v = make_keys(rng, 1, 2, CHUNK_TOKENS, 16), make_values(rng, 1, 2, CHUNK_TOKENS, 16)
    key = zipcache.chunk_keys(ids)[0]
    with pytest.raises(zipcache.InvalidArgument):
        s.update_and_fetch(0, k[:, :, :100], v[:, :, :100], chunk_key=key)
    with pytest.raises(zipcache.InvalidArgument):
        s.update_and_fetch(0, k, v, chunk_key=b"short")
    s.update_and_fetch(0, k[:, :, :10], v[:, :, :10])
    with pytest.raises(zipcache.FailedPrecondition):
        s.update_and_fetch(0, k, v, chunk_key=key)
    with pytest.raises(zipcache.NotFound):
        open_session(max_tokens=1024, model_id="py-bad", prefix=[key], **SHAPE)
    with pytest.raises(zipcache.InvalidArgument):
        open_session(max_tokens=1024, prefix=b"x" * 17, **SHAPE)
    with pytest.raises(zipcache.InvalidArgument):
        client.lookup_prefix([key] * (zipcache.MAX_PREFIX_CHUNKS + 1), **SHAPE)
    with pytest.raises(zipcache.InvalidArgument):
        s.prefill_chunked(1, ids, k, v, start=10)
    names = [i.name for i in client.list_sessions()]
    assert names == [s.name]
