"""zipcache.attend_arrays: attention over compressed payloads and fp16 rows, in-process.

The reference is float64 attention in numpy over codec.reconstruct() of the
same payloads; the criterion is the C suite's (tests/attend_test.c):
|out - ref| <= 1e-4 * max(|ref|, 0.1 * A), A = sum_t p_t |v_t|.
"""

from __future__ import annotations

import numpy as np
import pytest

import zipcache
from zipcache import codec


def _layer(rng, b=2, h=2, d=64, dv=None, sizes=(64, 100), residual=5, config=None):
    dv = dv or d
    config = config or zipcache.CodecConfig()
    segments, ks, vs = [], [], []
    for s in sizes:
        k = (rng.standard_normal((b, h, s, d)) * 1.5).astype(np.float16)
        v = rng.standard_normal((b, h, s, dv)).astype(np.float16)
        kp, vp = codec.compress(k, "keys", config), codec.compress(v, "values", config)
        segments.append(zipcache.AttendBlock(kp, vp, (b, h, s, d), head_dim_v=dv, config=config))
        ks.append(codec.reconstruct(kp, (b, h, s, d), "keys", config))
        vs.append(codec.reconstruct(vp, (b, h, s, dv), "values", config))
    # The residual as a strided view into a larger buffer, as a session's view is.
    kr = rng.standard_normal((b, h, residual + 4, d)).astype(np.float16)[:, :, :residual]
    vr = rng.standard_normal((b, h, residual + 4, dv)).astype(np.float16)[:, :, :residual]
    segments.append((kr, vr))
    ks.append(kr)
    vs.append(vr)
    return segments, np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)


def _reference(q, k, v, scale=None, causal=False):
    b, qh, nq, d = q.shape
    rep = qh // k.shape[1]
    k = np.repeat(k.astype(np.float64), rep, axis=1)
    v = np.repeat(v.astype(np.float64), rep, axis=1)
    s = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64), k) * (scale or 1 / np.sqrt(d))
    if causal:
        t = k.shape[2]
        mask = np.arange(t)[None, :] > (t - nq + np.arange(nq))[:, None]
        s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, p @ np.abs(v)


def _assert_close(out, ref, mag):
    bound = 1e-4 * np.maximum(np.abs(ref), 0.1 * mag)
    err = np.abs(out.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: {out[worst]} vs {ref[worst]} (bound {bound[worst]})"


@pytest.mark.parametrize("q_heads,n_q,causal", [(2, 1, False), (8, 1, False), (16, 8, True),
                                                (8, 8, False)])
def test_matches_float64_reference(q_heads, n_q, causal):
    rng = np.random.default_rng(q_heads * 10 + n_q)
    segments, k, v = _layer(rng)
    q = rng.standard_normal((2, q_heads, n_q, 64)).astype(np.float32)
    out = zipcache.attend_arrays(q, segments, causal=causal)
    assert out.shape == (2, q_heads, n_q, 64) and out.dtype == np.float32
    _assert_close(out, *_reference(q, k, v, causal=causal))


def test_configs_dims_scale_and_fp16():
    rng = np.random.default_rng(5)
    config = zipcache.CodecConfig(hi_bits=3, lo_bits=1, hi_fraction=0.5, group_size=7,
                                  quantize_values=False)
    segments, k, v = _layer(rng, d=80, dv=48, sizes=(1, 65, 130), residual=0, config=config)
    q = rng.standard_normal((2, 4, 1, 80)).astype(np.float16)
    out = zipcache.attend_arrays(q, segments, scale=0.2)
    _assert_close(out, *_reference(q, k, v, scale=0.2))
    half = zipcache.attend_arrays(q, segments, scale=0.2, out_dtype=np.float16)
    assert half.dtype == np.float16
    assert np.array_equal(half, out.astype(np.float16))


def test_blocks_equal_their_reconstruction_as_rows_and_threads_do_not_matter():
    rng = np.random.default_rng(6)
    segments, _, _ = _layer(rng, sizes=(64, 100), residual=3)
    rows = []
    for seg in segments:
        if isinstance(seg, zipcache.AttendBlock):
            shape_v = seg.shape[:3] + (seg.head_dim_v,)
            rows.append((codec.reconstruct(seg.keys, seg.shape, "keys"),
                         codec.reconstruct(seg.values, shape_v, "values")))
        else:
            rows.append(seg)
    q = rng.standard_normal((2, 8, 1, 64)).astype(np.float32)
    a = zipcache.attend_arrays(q, segments)
    assert np.array_equal(a.view(np.uint32), zipcache.attend_arrays(q, rows).view(np.uint32))
    assert np.array_equal(a.view(np.uint32),
                          zipcache.attend_arrays(q, segments, threads=3).view(np.uint32))


def test_trim_cut_counts_only_the_valid_tokens():
    rng = np.random.default_rng(7)
    segments, k, v = _layer(rng, sizes=(100,), residual=0)
    segments[0].valid_tokens = 37
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    out = zipcache.attend_arrays(q, segments[:1])
    _assert_close(out, *_reference(q, k[:, :, :37], v[:, :, :37]))


def test_bad_input_is_refused():
    rng = np.random.default_rng(8)
    segments, _, _ = _layer(rng)
    q = rng.standard_normal((2, 3, 1, 64)).astype(np.float32)
    with pytest.raises(zipcache.InvalidArgument) as info:
        zipcache.attend_arrays(q, segments)  # 3 query heads over 2 KV heads
    assert info.value.name == "ZC_ESHAPE"
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    q[1, 2, 0, 5] = np.nan
    with pytest.raises(zipcache.InvalidArgument) as info:
        zipcache.attend_arrays(q, segments)
    assert info.value.name == "ZC_ENONFINITE"
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    with pytest.raises(zipcache.InvalidArgument):
        zipcache.attend_arrays(q, segments)  # D_k differs
    block = segments[0]
    short = zipcache.AttendBlock(bytes(block.keys)[:-1], block.values, block.shape)
    with pytest.raises(zipcache.ZipCacheError) as info:
        zipcache.attend_arrays(rng.standard_normal((2, 4, 1, 64)).astype(np.float32), [short])
    assert info.value.name == "ZC_ECORRUPT"
