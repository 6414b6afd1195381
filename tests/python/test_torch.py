"""zipcache.torch on the CPU: zero-copy tensors and the transformers-style cache.

Skipped, all of it, where torch is not installed (`make deps` installs
Debian's python3-torch). The generate() comparison runs where transformers
is installed; the GPU half is test_torch_gpu.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import zipcache  # noqa: E402
import zipcache.torch as zt  # noqa: E402

from _support import make_keys, make_values  # noqa: E402


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_layer_tensors_share_the_mapping(open_session):
    rng = np.random.default_rng(1)
    s = open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=256)
    k, v = make_keys(rng, 1, 2, 40, 16), make_values(rng, 1, 2, 40, 16)
    nk, nv = s.update_and_fetch(1, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the not-writable warning is handled, not leaked
        tk, tv = zt.layer_tensors(s, 1)
    assert tk.dtype == torch.float16 and tuple(tk.shape) == (1, 2, 40, 16)
    assert tk.data_ptr() == _address(nk) and tv.data_ptr() == _address(nv)
    assert tk.stride() == tuple(x // 2 for x in nk.strides)
    assert torch.equal(tk, torch.from_numpy(np.array(nk)))
    # Shared, not copied: what the daemon writes later shows through. A
    # wider view of the same mapping sees the tokens appended after it.
    before = tk.data_ptr()
    s.update_and_fetch(1, make_keys(rng, 1, 2, 3, 16), make_values(rng, 1, 2, 3, 16))
    tk2, _ = zt.layer_tensors(s, 1)
    assert tk2.data_ptr() == before and tk2.shape[2] == 43
    assert torch.equal(tk2[:, :, :40], tk)
    # The tensors keep the mapping alive after the session is closed.
    s.close()
    assert torch.isfinite(tk2.float()).all()


def test_layer_tensors_are_read_only_in_fact(open_session):
    """torch cannot mark them read-only; the numpy view under them is."""
    rng = np.random.default_rng(2)
    s = open_session(layers=1, kv_heads=1, head_dim=8, max_tokens=16)
    s.update_and_fetch(0, make_keys(rng, 1, 1, 4, 8), make_values(rng, 1, 1, 4, 8))
    tk, _ = zt.layer_tensors(s, 0)
    nk, _ = s.view(0)
    assert not nk.flags.writeable
    copy = tk.clone()
    copy += 1  # a clone is the way to write
    assert not torch.equal(copy, tk)


def _feed(cache, rng, layers, steps, kv_heads, dim, dtype=torch.float16):
    sent = [[] for _ in range(layers)]
    out = None
    for n in steps:
        for layer in range(layers):
            k = torch.from_numpy(make_keys(rng, 1, kv_heads, n, dim)).to(dtype)
            v = torch.from_numpy(make_values(rng, 1, kv_heads, n, dim)).to(dtype)
            sent[layer].append((k, v))
            out = cache.update(k, v, layer, {"cache_position": torch.arange(n)})
    return sent, out


@pytest.mark.parametrize("policy", ["streaming", "per_call"])
def test_cache_returns_what_the_client_fetches(daemon, open_session, policy):
    rng = np.random.default_rng(3)
    s = open_session(layers=3, kv_heads=2, head_dim=16, max_tokens=512, policy=policy,
                     residual_tokens=16 if policy == "streaming" else 0)
    cache = zt.SessionCache(s)
    assert len(cache) == 3 and cache.get_seq_length() == 0
    _, (k, v) = _feed(cache, rng, 3, [37, 1, 1, 20, 1], 2, 16)
    assert cache.get_seq_length() == 60 and cache.get_seq_length(2) == 60
    assert cache.get_mask_sizes(torch.arange(1), 0) == (61, 0)
    # A second client, the plain C path: the same bits.
    with zipcache.Client(daemon.socket_path) as other:
        with other.open_session(name=s.name, attach=True, layers=3, kv_heads=2, head_dim=16,
                                max_tokens=512, policy=policy,
                                residual_tokens=s.info.residual_tokens) as attached:
            ck, cv = attached.view(2)
            assert np.array_equal(k.numpy().view(np.uint16), ck.view(np.uint16))
            assert np.array_equal(v.numpy().view(np.uint16), cv.view(np.uint16))
            attached.release()
    for layer in range(3):
        lk, lv = cache[layer]
        nk, nv = s.view(layer)
        assert lk.data_ptr() == _address(nk)  # zero copy on the CPU with fp16 states
        assert np.array_equal(lk.numpy().view(np.uint16), nk.view(np.uint16))


def test_cache_dtype_crop_and_refusals(open_session):
    rng = np.random.default_rng(4)
    s = open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=128)
    cache = zt.SessionCache(s)
    _, (k, v) = _feed(cache, rng, 2, [10, 1], 2, 16, dtype=torch.float32)
    assert k.dtype == torch.float32 and tuple(k.shape) == (1, 2, 11, 16)
    nk, _ = s.view(1)
    assert torch.equal(k, torch.from_numpy(np.array(nk)).float())
    cache.crop(7)
    assert cache.get_seq_length(0) == 7 and s.tokens(1) == 7
    cache.crop(-2)
    assert s.tokens(0) == 5
    with pytest.raises(zipcache.InvalidArgument):
        cache.update(k, v, 5)
    with pytest.raises(NotImplementedError):
        cache.reorder_cache(torch.tensor([0]))
    cache.reset()
    assert cache.get_seq_length() == 0


def test_to_device_cpu(open_session):
    rng = np.random.default_rng(5)
    s = open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=64)
    nk, nv = s.update_and_fetch(0, make_keys(rng, 1, 2, 9, 16), make_values(rng, 1, 2, 9, 16))
    k, v = s.to_device(0, "cpu")
    assert torch.equal(k, torch.from_numpy(np.array(nk)))
    assert torch.equal(v, torch.from_numpy(np.array(nv)))


def test_transformers_generate_cpu(open_session):
    """With transformers installed: generate() through SessionCache on the CPU."""
    transformers = pytest.importorskip("transformers")
    if not zt.TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} predates the Cache layers API")
    from _generate import compare_generate

    report = compare_generate(open_session, "cpu", torch.float32, 8, 8)
    assert report["max_rel"] <= 1e-2, report


def test_views_none_on_the_cpu(open_session):
    """views="none" has no fp16 view: the cache and to_device use the client's reconstruction."""
    rng = np.random.default_rng(11)
    s = open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=256, residual_tokens=16,
                     views="none")
    cache = zt.SessionCache(s)
    for n in [30, 1, 1, 20, 1]:
        for layer in range(2):
            k = torch.from_numpy(make_keys(rng, 1, 2, n, 16))
            v = torch.from_numpy(make_values(rng, 1, 2, n, 16))
            ok, ov = cache.update(k, v, layer)
            ek, ev = s.reconstruct_layer(layer)
            assert ok.shape[2] == ek.shape[2] == cache.get_seq_length(layer)
            assert np.array_equal(ok.numpy().view(np.uint16), ek.view(np.uint16))
            assert np.array_equal(ov.numpy().view(np.uint16), ev.view(np.uint16))
    tk, tv = zt.to_device(s, 1, "cpu")
    ek, ev = s.reconstruct_layer(1)
    assert np.array_equal(tk.numpy().view(np.uint16), ek.view(np.uint16))
    assert np.array_equal(tv.numpy().view(np.uint16), ev.view(np.uint16))
    cache.crop(40)
    assert cache.get_seq_length(0) == 40
