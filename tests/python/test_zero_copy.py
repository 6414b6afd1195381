"""The fetched arrays are read-only views of the daemon's shared mapping, not copies."""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest

import zipcache
from zipcache import _lib
from zipcache._lib import lib

from _support import make_keys, make_values


def _maps() -> list[tuple[int, int, str, str]]:
    """(start, end, perms, path) of this process's mappings."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def _extent(a: np.ndarray) -> tuple[int, int]:
    """[first, last) byte addresses an array with non-negative strides touches."""
    start = a.__array_interface__["data"][0]
    last = start + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    return start, last


def _c_view(session: zipcache.Session, layer: int) -> _lib.zc_view:
    view = _lib.zc_view()
    assert lib.zc_session_view(session._handle.ptr, layer, ctypes.byref(view)) == 0
    return view


@pytest.fixture
def filled(open_session):
    rng = np.random.default_rng(1)
    s = open_session(layers=2, kv_heads=3, head_dim=16, head_dim_v=8, batch=2, max_tokens=64)
    k = make_keys(rng, 2, 3, 5, 16)
    v = make_values(rng, 2, 3, 5, 8)
    K, V = s.update_and_fetch(1, k, v)
    return s, K, V


def test_shape_dtype_and_flags(filled):
    s, K, V = filled
    assert K.shape == (2, 3, 5, 16) and V.shape == (2, 3, 5, 8)
    assert K.dtype == np.float16 and V.dtype == np.float16
    for a in (K, V):
        assert not a.flags.owndata
        assert not a.flags.writeable
        # The token axis is strided by max_tokens rows: [B][H][max_tokens][D].
        assert a.strides == (3 * 64 * a.shape[3] * 2, 64 * a.shape[3] * 2, a.shape[3] * 2, 2)


def test_assignment_raises(filled):
    _, K, V = filled
    with pytest.raises(ValueError):
        K[0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        V[...] = 0
    with pytest.raises(ValueError):
        K.flags.writeable = True  # the pages are PROT_READ: this must never succeed
    with pytest.raises(ValueError):
        np.add(K, 1, out=K)


def test_address_is_the_c_view_inside_a_read_only_shared_mapping(filled, daemon):
    s, K, V = filled
    view = _c_view(s, 1)
    assert K.__array_interface__["data"][0] == ctypes.cast(view.keys, ctypes.c_void_p).value
    assert V.__array_interface__["data"][0] == ctypes.cast(view.values, ctypes.c_void_p).value
    for a in (K, V):
        first, last = _extent(a)
        hits = [m for m in _maps() if m[0] <= first and last <= m[1]]
        assert len(hits) == 1, "the array must lie inside one mapping"
        start, end, perms, path = hits[0]
        assert perms == "r--s", f"expected a read-only shared mapping, got {perms}"
        # The daemon's views: a memfd it passed, never its durable file.
        assert path.startswith("/memfd:zipcache-map"), path


def test_two_fetches_share_memory(filled):
    s, K, V = filled
    rng = np.random.default_rng(2)
    K2, V2 = s.update_and_fetch(1, make_keys(rng, 2, 3, 1, 16), make_values(rng, 2, 3, 1, 8))
    assert K2.shape[2] == 6
    assert np.shares_memory(K, K2) and np.shares_memory(V, V2)
    assert K.__array_interface__["data"][0] == K2.__array_interface__["data"][0]
    K3, _ = s.view(1)
    assert np.shares_memory(K3, K2)
    # Different layers, different memory.
    s.update_and_fetch(0, make_keys(rng, 2, 3, 1, 16), make_values(rng, 2, 3, 1, 8))
    K0, _ = s.view(0)
    assert not np.shares_memory(K0, K2)


def test_a_fetch_sees_later_writes_without_copying(open_session):
    """Streaming: the residual's exact tokens are rewritten in place when it is compressed."""
    rng = np.random.default_rng(3)
    s = open_session(residual_tokens=4)
    k = make_keys(rng, 1, 2, 3, 16)
    v = make_values(rng, 1, 2, 3, 16)
    K, _ = s.update_and_fetch(0, k, v)
    before = K.copy()
    np.testing.assert_array_equal(before, k)  # exact while in the residual
    s.update_and_fetch(0, make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16))
    # Same memory, new contents: the residual of 4 tokens was compressed.
    assert not np.array_equal(K, before)


def test_arrays_outlive_session_close(client, open_session):
    rng = np.random.default_rng(4)
    s = open_session()
    k = make_keys(rng, 1, 2, 4, 16)
    K, V = s.update_and_fetch(0, k, make_values(rng, 1, 2, 4, 16))
    snapshot = K.copy()
    handle = weakref.ref(s._handle)
    name = s.name
    s.close()
    assert name not in [i.name for i in client.list_sessions()]  # closed on the daemon
    np.testing.assert_array_equal(K, snapshot)  # and still readable here
    assert handle() is not None  # the mapping is pinned by K and V
    del K, V
    gc.collect()
    assert handle() is None  # released with the last array


def test_close_without_live_arrays_unmaps_at_once(client, open_session):
    rng = np.random.default_rng(5)
    s = open_session()
    s.update_and_fetch(0, make_keys(rng, 1, 2, 4, 16), make_values(rng, 1, 2, 4, 16))
    handle = weakref.ref(s._handle)
    s.close()
    gc.collect()
    assert handle() is None


def test_arrays_outlive_client_close(daemon):
    rng = np.random.default_rng(6)
    c = zipcache.Client(daemon.socket_path)
    s = c.open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=16, name="outlive-client")
    K, _ = s.update_and_fetch(0, make_keys(rng, 1, 2, 4, 16), make_values(rng, 1, 2, 4, 16))
    snapshot = K.copy()
    c.close()  # releases the handle: the daemon keeps the session
    np.testing.assert_array_equal(K, snapshot)
    with pytest.raises(zipcache.FailedPrecondition):
        s.update_and_fetch(0, make_keys(rng, 1, 2, 1, 16), make_values(rng, 1, 2, 1, 16))
    del K
    gc.collect()
    with zipcache.Client(daemon.socket_path) as c2:
        again = c2.open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=16,
                                name="outlive-client", attach=True)
        np.testing.assert_array_equal(again.view(0)[0], snapshot)
        again.close()


def test_input_buffer_is_not_retained(open_session):
    """The daemon copies the block into its store: mutating the input later changes nothing."""
    rng = np.random.default_rng(7)
    s = open_session(residual_tokens=128)
    k = make_keys(rng, 1, 2, 3, 16)
    v = make_values(rng, 1, 2, 3, 16)
    K, V = s.update_and_fetch(0, k, v)
    expected = k.copy()
    k[...] = 0
    np.testing.assert_array_equal(K, expected)
