"""Saliency by attention from Python: zipcache.attend's masses, MassAccumulator, set_attention_mass.

The masses attend returns equal float64 softmax probability mass over the
layer's reconstruction; asking for them leaves the output's bytes alone; the
accumulator aligns calls by token and normalizes by the calls that saw a
token; through a real daemon the flush of a saliency="attention" session is,
byte for byte, the codec's compression ranked by the masses sent (the head
mean for the one token no query saw), while key_norm stays the codec's plain
compression; bad masses are refused before anything is sent, nothing stored.
"""

from __future__ import annotations

import numpy as np
import pytest

import zipcache
from zipcache import codec

from _support import make_keys, make_values

R = 16  # residual rows: the 16th token flushes them


def _reference_mass(q: np.ndarray, k: np.ndarray, first: int) -> np.ndarray:
    """float64 masses of tokens first.. : q [B, Hq, 1, D], k [B, Hkv, T, D] -> [B, Hkv, T - first]."""
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(np.float64).reshape(b, hkv, hq // hkv * n_q, d) / np.sqrt(d)
    s = np.einsum("bhrd,bhtd->bhrt", qg, k.astype(np.float64))
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p.sum(axis=2)[:, :, first:]


def test_masses_match_float64_reference_and_leave_the_output_alone(open_session):
    s = open_session(layers=1, batch=2, kv_heads=2, head_dim=32, max_tokens=256,
                     residual_tokens=R, views="none",
                     codec=zipcache.CodecConfig(saliency="attention"))
    rng = np.random.default_rng(5)
    s.update_and_fetch(0, make_keys(rng, 2, 2, 40, 32), make_values(rng, 2, 2, 40, 32))
    for _ in range(5):
        s.update_and_fetch(0, make_keys(rng, 2, 2, 1, 32, sink=False), make_values(rng, 2, 2, 1, 32))
    q = rng.standard_normal((2, 8, 1, 32)).astype(np.float32)
    out, m = zipcache.attend(s, 0, q, mass=True)
    assert np.array_equal(out.view(np.uint32), zipcache.attend(s, 0, q).view(np.uint32))
    k, _ = s.reconstruct_layer(0)
    assert m.first_token == 40 and m.tokens == 5 and m.mass.shape == (2, 2, 5)
    assert m.mass.dtype == np.float32
    ref = _reference_mass(q, k, m.first_token)
    rows = 4
    # The C suite's bound: 1e-4 relative, 1e-7 per row summed absolute.
    assert np.all(np.abs(m.mass - ref) <= 1e-4 * ref + 1e-7 * rows), np.max(np.abs(m.mass - ref))


def test_accumulator_aligns_by_token_and_normalizes():
    acc = zipcache.MassAccumulator(session=None)
    acc.add(0, zipcache.AttentionMass(10, np.array([[[1.0, 2.0]]], np.float32)))
    acc.add(0, zipcache.AttentionMass(10, np.array([[[1.0, 0.0, 6.0]]], np.float32)))
    f = acc.figure(0)
    assert f.first_token == 10
    np.testing.assert_array_equal(f.mass, [[[1.0, 1.0, 6.0]]])
    # Tokens 10, 11 were compressed: forgotten; 12 keeps its figure.
    acc.add(0, zipcache.AttentionMass(12, np.array([[[2.0, 3.0]]], np.float32)))
    f = acc.figure(0)
    assert f.first_token == 12
    np.testing.assert_array_equal(f.mass, [[[4.0, 3.0]]])
    plain = zipcache.MassAccumulator(session=None, normalize=False)
    plain.add(1, zipcache.AttentionMass(0, np.ones((1, 1, 2), np.float32)))
    plain.add(1, zipcache.AttentionMass(0, np.ones((1, 1, 3), np.float32)))
    np.testing.assert_array_equal(plain.figure(1).mass, [[[2.0, 2.0, 1.0]]])
    assert plain.figure(0) is None
    # An empty residual (after a flush) starts over.
    plain.add(1, zipcache.AttentionMass(3, np.zeros((1, 1, 0), np.float32)))
    assert plain.figure(1) is None


def _decode(s: zipcache.Session, rng: np.random.Generator, acc: zipcache.MassAccumulator | None):
    """R decode tokens with a query per step; returns the keys and the figure sent before the last."""
    keys, sent = [], None
    for t in range(R):
        k = make_keys(rng, 1, 2, 1, 32, sink=(t == 0))
        s.update_and_fetch(0, k, make_values(rng, 1, 2, 1, 32))
        keys.append(k)
        if t + 1 == R:
            break
        q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32) * 3
        if acc is None:
            zipcache.attend(s, 0, q)
        else:
            zipcache.attend(s, 0, q, mass=acc)
            sent = acc.figure(0)
    return np.concatenate(keys, axis=2), sent


def test_flush_ranks_by_the_masses_sent_key_norm_unchanged(open_session):
    config = zipcache.CodecConfig(group_size=8)
    by_mass = open_session(layers=1, batch=1, kv_heads=2, head_dim=32, max_tokens=64,
                           residual_tokens=R, views="none",
                           codec=zipcache.CodecConfig(group_size=8, saliency="attention"))
    by_norm = open_session(layers=1, batch=1, kv_heads=2, head_dim=32, max_tokens=64,
                           residual_tokens=R, views="none", codec=config)
    keys, sent = _decode(by_mass, np.random.default_rng(9), zipcache.MassAccumulator(by_mass))
    same, _ = _decode(by_norm, np.random.default_rng(9), None)
    assert np.array_equal(keys, same)
    assert sent.first_token == 0 and sent.tokens == R - 1

    # The daemon's scores: the masses sent; the last token (no query saw it
    # when its update came) the mean of its head's others.
    scores = np.empty((1, 2, R), np.float32)
    for h in range(2):
        known = sent.mass[0, h]
        mean = 0.0
        for x in known:
            mean += float(x)
        scores[0, h, :R - 1] = known
        scores[0, h, R - 1] = np.float32(mean / (R - 1))
    (block,) = by_mass.layer_blocks(0)
    ranked = codec.compress(keys, "keys", config, scores=scores)
    assert bytes(block.key_payload) == ranked
    (plain,) = by_norm.layer_blocks(0)
    assert bytes(plain.key_payload) == codec.compress(same, "keys", config)
    assert ranked != bytes(plain.key_payload)  # the masses did choose other tokens


def test_bad_masses_are_refused_nothing_stored(open_session):
    s = open_session(layers=1, batch=1, kv_heads=2, head_dim=16, max_tokens=64,
                     residual_tokens=R, views="none", codec=zipcache.CodecConfig(saliency="attention"))
    plain = open_session(layers=1, batch=1, kv_heads=2, head_dim=16, max_tokens=64,
                         residual_tokens=R, views="none")
    rng = np.random.default_rng(3)
    k, v = make_keys(rng, 1, 2, 4, 16), make_values(rng, 1, 2, 4, 16)
    s.update_and_fetch(0, k, v)
    good = np.full((1, 2, 4), 0.25, np.float32)
    for bad, what in ((np.ones((1, 3, 4), np.float32), "shape"),
                      (np.ones((2, 4), np.float32), "rank"),
                      (np.ones((1, 2, 0), np.float32), "no rows"),
                      (np.ones((1, 2, R + 1), np.float32), "more rows than the residual"),
                      (np.where(np.arange(4) == 2, np.nan, good), "NaN"),
                      (-good, "negative"),
                      (np.where(np.arange(4) == 1, np.inf, good), "Inf")):
        with pytest.raises(zipcache.InvalidArgument):
            s.set_attention_mass(0, 0, bad)
    with pytest.raises(zipcache.InvalidArgument):
        s.set_attention_mass(1, 0, good)
    with pytest.raises(zipcache.FailedPrecondition):
        plain.set_attention_mass(0, 0, good)
    with pytest.raises(TypeError):
        zipcache.attend(s, 0, np.ones((1, 2, 1, 16), np.float32), mass="yes")
    with pytest.raises(ValueError):
        zipcache.attend(s, 0, np.ones((1, 2, 1, 16), np.float32),
                        mass=zipcache.MassAccumulator(plain))
    # The daemon's own check (tokens past the layer): the update is refused whole.
    s.set_attention_mass(0, 30, good)
    with pytest.raises(zipcache.InvalidArgument, match="attention_mass"):
        s.update_and_fetch(0, k[:, :, :1], v[:, :, :1])
    assert s.stats().layers[0].tokens == 4
    # Sent once, gone: the next update goes through without them.
    s.update_and_fetch(0, k[:, :, :1], v[:, :, :1])
    assert s.stats().layers[0].tokens == 5
    s.set_attention_mass(0, 0, good)
    s.set_attention_mass(0, 0, None)  # cleared
    s.update_and_fetch(0, k[:, :, :1], v[:, :, :1])
    # update_async carries them as well: the daemon's refusal comes with its ticket.
    s.set_attention_mass(0, 40, good)
    ticket = s.update_async(0, k[:, :, :1], v[:, :, :1])
    with pytest.raises(zipcache.InvalidArgument, match="attention_mass"):
        s.wait(0, ticket)
    assert s.stats().layers[0].tokens == 6
    s.set_attention_mass(0, 2, np.full((1, 2, 4), 0.5, np.float32))
    s.wait(0, s.update_async(0, k[:, :, :1], v[:, :, :1]))
    assert s.stats().layers[0].tokens == 7
    # A key-norm session attends with masses too (they are just not sent).
    plain.update_and_fetch(0, k, v)
    out, m = zipcache.attend(plain, 0, np.ones((1, 2, 1, 16), np.float32), mass=True)
    assert m.first_token == 0 and m.tokens == 4
    np.testing.assert_allclose(m.mass.sum(axis=2), 1.0, rtol=1e-5)
