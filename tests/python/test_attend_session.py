"""zipcache.attend: attention over one layer of a session, read in this process.

Over a mixed session (prefill, decode through residual flushes, trims) the
result is, bit for bit, attend_arrays over reconstruct_layer cut where the
layer's blocks are (for views "none" and "full", and over the fp16 view),
and within the core's accuracy bound of float64 attention over the same
reconstruction; bad queries are refused with the core's codes; a dropped
view is brought back.
"""

from __future__ import annotations

import numpy as np
import pytest

import zipcache

from _support import LayerModel, assert_bits_equal, make_keys, make_values
from conftest import start_daemon, stop_daemon
from test_attend import _assert_close, _reference


def _cut_at_blocks(session: zipcache.Session, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """reconstruct_layer as fp16 rows, one segment per block and one for the residual."""
    K, V = session.reconstruct_layer(layer)
    segments, first = [], 0
    for b in session.layer_blocks(layer):
        segments.append((K[:, :, first:first + b.valid_tokens], V[:, :, first:first + b.valid_tokens]))
        first += b.valid_tokens
    if first < K.shape[2] or not segments:
        segments.append((K[:, :, first:], V[:, :, first:]))
    return segments


class _Mixed:
    def __init__(self, open_session, views: str, **kw) -> None:
        self.s = open_session(layers=2, batch=2, kv_heads=2, head_dim=32, head_dim_v=16,
                              max_tokens=512, residual_tokens=8, views=views, **kw)
        self.models = [LayerModel(self.s.info.policy, self.s.info.residual_tokens, self.s.info.codec)
                       for _ in range(2)]
        self.rng = np.random.default_rng(21 if views == "none" else 22)
        self.views = views

    def update(self, layer: int, tokens: int) -> None:
        k, v = make_keys(self.rng, 2, 2, tokens, 32), make_values(self.rng, 2, 2, tokens, 16)
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
        segments = _cut_at_blocks(self.s, layer)
        tokens = sum(k.shape[2] for k, _ in segments)
        for q_heads, n_q, causal in ((4, 1, False), (4, 3, True), (2, 1, False)):
            if causal and tokens < n_q:
                continue
            q = self.rng.standard_normal((2, q_heads, n_q, 32)).astype(np.float32)
            out = zipcache.attend(self.s, layer, q, causal=causal, threads=1 + n_q % 2)
            assert out.shape == (2, q_heads, n_q, 16) and out.dtype == np.float32
            want = zipcache.attend_arrays(q, segments, causal=causal)
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
            if self.views == "full":
                over = zipcache.attend(self.s, layer, q, causal=causal, over_view=True)
                assert np.array_equal(over.view(np.uint32), want.view(np.uint32))
            EK, EV = self.models[layer].layer()
            _assert_close(out, *_reference(q, EK, EV, causal=causal))


@pytest.mark.parametrize("views", ["none", "full"])
def test_attend_is_attend_arrays_over_the_reconstruction_bit_for_bit(open_session, views):
    m = _Mixed(open_session, views)
    for tokens in (40, 9, 3, 8, 1):
        for layer in range(2):
            m.update(layer, tokens)
    for step in range(60):  # the residual of 8 fills and is compressed, again and again
        m.update(step % 2, 1 + (step % 9 == 0))
    m.trim(2)    # inside the residual
    m.trim(30)   # through it and into a block, which stays whole with its tail cut
    for step in range(20):
        m.update(step % 2, 1)
    m.update(0, 25)


def test_fp16_scale_and_per_call(open_session):
    s = open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=256, policy="per_call",
                     views="none", codec=zipcache.CodecConfig(group_size=5, quantize_values=False))
    rng = np.random.default_rng(23)
    for tokens in (17, 1, 2, 33):
        s.update_and_fetch(0, make_keys(rng, 1, 2, tokens, 16), make_values(rng, 1, 2, tokens, 16))
    q = rng.standard_normal((1, 8, 2, 16)).astype(np.float16)
    out = zipcache.attend(s, 0, q, scale=0.3, causal=True, out_dtype=np.float16)
    assert out.dtype == np.float16 and out.shape == (1, 8, 2, 16)
    want = zipcache.attend_arrays(q, _cut_at_blocks(s, 0), scale=0.3, causal=True,
                                  out_dtype=np.float16)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


def test_bad_queries_are_refused(open_session):
    s = open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=256, views="none")
    rng = np.random.default_rng(24)
    s.update_and_fetch(0, make_keys(rng, 1, 2, 20, 16), make_values(rng, 1, 2, 20, 16))
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    zipcache.attend(s, 0, q)

    def refused(name, *args, **kw):
        with pytest.raises(zipcache.ZipCacheError) as info:
            zipcache.attend(*args, **kw)
        assert info.value.name == name, info.value
        return info.value

    e = refused("ZC_ESHAPE", s, 0, q[:, :3])  # 3 query heads over 2 KV heads
    assert "multiple of 2" in str(e)
    refused("ZC_ESHAPE", s, 0, q[..., :8])  # D_k is 16
    refused("ZC_ESHAPE", s, 0, np.concatenate([q, q]))  # batch is 1
    refused("ZC_ESHAPE", s, 1, q)  # an empty layer
    refused("ZC_ESHAPE", s, 0, np.zeros((1, 4, 21, 16), np.float32), causal=True)
    bad = q.copy()
    bad[0, 1, 0, 3] = np.nan
    refused("ZC_ENONFINITE", s, 0, bad)
    e = refused("ZC_EPRECONDITION", s, 0, q, over_view=True)
    assert isinstance(e, zipcache.FailedPrecondition)
    with pytest.raises(zipcache.InvalidArgument):
        zipcache.attend(s, 2, q)  # layer out of range
    with pytest.raises(ValueError):
        zipcache.attend(s, 0, q[0])  # not [B, q_heads, n_q, D]


def test_a_dropped_view_is_brought_back(tmp_path):
    daemon = start_daemon(tmp_path / "d", "--memory-budget", "24M")
    try:
        rng = np.random.default_rng(25)
        with zipcache.Client(daemon.socket_path, timeout=20) as c:
            cold = c.open_session(layers=2, kv_heads=4, head_dim=128, max_tokens=4096,
                                  residual_tokens=16, name="cold")
            for layer in range(2):
                for tokens in (600, 10):
                    cold.update_and_fetch(layer, make_keys(rng, 1, 4, tokens, 128),
                                          make_values(rng, 1, 4, tokens, 128))
            q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
            before = zipcache.attend(cold, 0, q)
            hot = c.open_session(layers=1, kv_heads=4, head_dim=128, max_tokens=8192,
                                 residual_tokens=16, name="hot")
            cold.release_views()
            for _ in range(30):
                hot.update_and_fetch(0, make_keys(rng, 1, 4, 256, 128),
                                     make_values(rng, 1, 4, 256, 128))
                with cold.read(0) as r:
                    if not r.view_valid:
                        break
            with cold.read(0) as r:
                assert not r.view_valid, "the daemon never dropped the idle session's views"
            hot.release_views()  # so that its views may make room for the rebuild
            after = zipcache.attend(cold, 0, q)  # the residual is in the view: brought back
            assert_bits_equal(after, before)
            with cold.read(0) as r:
                assert r.view_valid
            hot.close()
            cold.close()
    finally:
        assert stop_daemon(daemon) == 0
