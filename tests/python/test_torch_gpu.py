"""zipcache.torch on a GPU (`make check-gpu`): skipped without CUDA.

- CudaContext: codec payloads reconstructed into CUDA tensors through
  libzipcache_cuda, on torch's stream, bit-identical to the CPU codec;
  incremental loads equal to full ones.
- SessionCache(device="cuda") under transformers' generate(): logits
  within 1e-2 (relative) of DynamicCache at 8/8 bits; the divergence at
  4/2 bits is reported (ZC_GPU_REPORT, stdout), not asserted.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import zipcache  # noqa: E402
import zipcache.torch as zt  # noqa: E402
from zipcache import codec  # noqa: E402

from _support import make_keys, make_values  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch"),
]


def _needs_cuda_library():
    if not zt.cuda_available():
        pytest.skip("libzipcache_cuda is not built or sees no GPU")


@pytest.mark.parametrize("config", [
    zipcache.CodecConfig(),
    zipcache.CodecConfig(hi_bits=8, lo_bits=8, group_size=7),
    zipcache.CodecConfig(hi_bits=3, lo_bits=1, hi_fraction=0.5, group_size=33,
                         quantize_values=False),
])
def test_cuda_context_bit_identical(config):
    _needs_cuda_library()
    rng = np.random.default_rng(7)
    b, h, d = 1, 4, 128
    sizes = [64, 33, 128]
    blocks, expected_k, expected_v, first = [], [], [], 0
    for n in sizes:
        k, v = make_keys(rng, b, h, n, d), make_values(rng, b, h, n, d)
        kp, vp = codec.compress(k, "keys", config), codec.compress(v, "values", config)
        blocks.append((kp, vp, first, n))
        expected_k.append(codec.reconstruct(kp, (b, h, n, d), "keys", config))
        expected_v.append(codec.reconstruct(vp, (b, h, n, d), "values", config))
        first += n
    rk, rv = make_keys(rng, b, h, 5, d), make_values(rng, b, h, 5, d)
    ek = np.concatenate(expected_k + [rk], axis=2)
    ev = np.concatenate(expected_v + [rv], axis=2)
    total = first + 5
    keys = torch.zeros((b, h, total + 11, d), dtype=torch.float16, device="cuda")
    values = torch.zeros((b, h, total + 11, d), dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    with zt.CudaContext() as ctx:
        with torch.cuda.stream(stream):
            ctx.load_layer(config, (b, h, d, d), blocks, keys, values, residual=(rk, rv, first),
                           stream=stream)
        ctx.synchronize(stream)
        got_k = keys[:, :, :total].cpu().numpy()
        got_v = values[:, :, :total].cpu().numpy()
        assert np.array_equal(got_k.view(np.uint16), ek.view(np.uint16))
        assert np.array_equal(got_v.view(np.uint16), ev.view(np.uint16))
        assert not keys[:, :, total:].any()

        # Incremental: a mirror moves only the block and the rows that are new.
        mirror = ctx.new_mirror()
        k2 = torch.zeros_like(keys)
        v2 = torch.zeros_like(values)
        ctx.load_layer(config, (b, h, d, d), blocks[:1], k2, v2, mirror=mirror)
        before = ctx.stats()
        ctx.load_layer(config, (b, h, d, d), blocks, k2, v2, residual=(rk, rv, first),
                       mirror=mirror)
        ctx.synchronize()
        after = ctx.stats()
        assert after["blocks"] - before["blocks"] == 2
        assert after["blocks_skipped"] - before["blocks_skipped"] == 1
        assert torch.equal(k2[:, :, :total], keys[:, :, :total])
        assert torch.equal(v2[:, :, :total], values[:, :, :total])


def test_session_cache_on_cuda_matches_the_view(open_session):
    rng = np.random.default_rng(8)
    s = open_session(layers=2, kv_heads=2, head_dim=64, max_tokens=400, residual_tokens=32)
    cache = zt.SessionCache(s, device="cuda")
    for n in [50, 1, 1, 40, 1, 1]:
        for layer in range(2):
            k = torch.from_numpy(make_keys(rng, 1, 2, n, 64)).cuda()
            v = torch.from_numpy(make_values(rng, 1, 2, n, 64)).cuda()
            ok, ov = cache.update(k, v, layer)
            nk, nv = s.view(layer)
            # The device mirror equals the daemon's view after every step,
            # including residual tokens the flush rewrote.
            assert ok.is_cuda and np.array_equal(ok.cpu().numpy().view(np.uint16),
                                                 np.array(nk).view(np.uint16))
            assert np.array_equal(ov.cpu().numpy().view(np.uint16), np.array(nv).view(np.uint16))


def test_generate_on_cuda_8_bits(open_session):
    pytest.importorskip("transformers")
    if not zt.TRANSFORMERS:
        pytest.skip("transformers predates the Cache layers API")
    from _generate import compare_generate

    report = compare_generate(open_session, "cuda", torch.float16, 8, 8)
    assert report["max_rel"] <= 1e-2, report


def test_generate_on_cuda_4_2_bits_reported(open_session):
    pytest.importorskip("transformers")
    if not zt.TRANSFORMERS:
        pytest.skip("transformers predates the Cache layers API")
    from _generate import compare_generate

    report = compare_generate(open_session, "cuda", torch.float16, 4, 2)
    assert np.isfinite(report["max_rel"])
