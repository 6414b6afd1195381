"""Bad input is refused before anything is sent; daemon errors arrive as typed exceptions."""

from __future__ import annotations

import numpy as np
import pytest

import zipcache
from zipcache import _lib

from _support import make_keys, make_values


def _requests(client: zipcache.Client) -> int:
    """The daemon's request counter; the stats call itself counts as one."""
    return client.stats().requests


@pytest.fixture
def session(open_session):
    rng = np.random.default_rng(20)
    s = open_session(layers=2, kv_heads=2, head_dim=16, head_dim_v=8, max_tokens=32)
    s.update_and_fetch(0, make_keys(rng, 1, 2, 4, 16), make_values(rng, 1, 2, 4, 8))
    return s


GOOD_K = np.zeros((1, 2, 3, 16), np.float16)
GOOD_V = np.zeros((1, 2, 3, 8), np.float16)

SHAPE_ERRORS = {
    "keys-3d": (GOOD_K[0], GOOD_V),
    "keys-5d": (GOOD_K[None], GOOD_V),
    "wrong-batch": (np.zeros((2, 2, 3, 16), np.float16), np.zeros((2, 2, 3, 8), np.float16)),
    "wrong-heads": (np.zeros((1, 3, 3, 16), np.float16), np.zeros((1, 3, 3, 8), np.float16)),
    "wrong-key-dim": (np.zeros((1, 2, 3, 8), np.float16), GOOD_V),
    "wrong-value-dim": (GOOD_K, np.zeros((1, 2, 3, 16), np.float16)),
    "zero-tokens": (GOOD_K[:, :, :0], GOOD_V[:, :, :0]),
    "token-mismatch": (GOOD_K, GOOD_V[:, :, :2]),
}


@pytest.mark.parametrize("keys,values", SHAPE_ERRORS.values(), ids=SHAPE_ERRORS.keys())
def test_bad_shape_is_refused_before_sending(client, session, keys, values):
    before = _requests(client)
    with pytest.raises(zipcache.InvalidArgument) as info:
        session.update_and_fetch(0, keys, values)
    assert info.value.code == _lib.ZC_ESHAPE
    assert info.value.status == "INVALID_ARGUMENT"
    assert isinstance(info.value, ValueError)
    assert _requests(client) == before + 1  # only the second stats call
    assert session.tokens(0) == 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.uint16, np.float16])
def test_wrong_dtype_raises_type_error(client, session, dtype):
    keys = GOOD_K.astype(dtype)
    values = GOOD_V.astype(np.float32 if dtype == np.float16 else dtype)
    before = _requests(client)
    with pytest.raises(TypeError, match="float16"):
        session.update_and_fetch(0, keys, values)
    assert _requests(client) == before + 1
    assert session.tokens(0) == 4


def test_python_lists_are_not_silently_converted(session):
    with pytest.raises(TypeError):
        session.update_and_fetch(0, GOOD_K.tolist(), GOOD_V.tolist())


def test_wrong_layer(client, session):
    before = _requests(client)
    for layer in (2, -1, 10**12, 1.0):
        with pytest.raises(zipcache.InvalidArgument, match="layer"):
            session.update_and_fetch(layer, GOOD_K, GOOD_V)
    with pytest.raises(zipcache.InvalidArgument):
        session.view(2)
    with pytest.raises(zipcache.InvalidArgument):
        zipcache.ZipCacheKVCache(session, 2)
    assert _requests(client) == before + 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["keys", "values"])
def test_non_finite_is_refused_by_the_daemon(session, bad, where):
    k, v = GOOD_K.copy(), GOOD_V.copy()
    (k if where == "keys" else v)[0, 1, 2, 3] = bad
    with pytest.raises(zipcache.InvalidArgument) as info:
        session.update_and_fetch(0, k, v)
    e = info.value
    assert e.status == "INVALID_ARGUMENT"
    assert e.code == _lib.ZC_EINVALID and e.name == "ZC_EINVALID"
    assert where in e.message and "NaN or Inf" in e.message  # the daemon's own sentence
    assert e.message in str(e)
    assert session.tokens(0) == 4


def test_check_finite_refuses_before_sending(client, open_session):
    s = open_session(check_finite=True)
    k = np.zeros((1, 2, 3, 16), np.float16)
    k[0, 0, 0, 0] = np.nan
    before = _requests(client)
    with pytest.raises(zipcache.InvalidArgument) as info:
        s.update_and_fetch(0, k, np.zeros_like(k))
    assert info.value.code == _lib.ZC_ENONFINITE
    assert _requests(client) == before + 1


def test_max_tokens_exceeded(session):
    rng = np.random.default_rng(21)
    with pytest.raises(zipcache.ResourceExhausted) as info:
        session.update_and_fetch(0, make_keys(rng, 1, 2, 29, 16), make_values(rng, 1, 2, 29, 8))
    assert "max_tokens" in info.value.message
    assert session.tokens(0) == 4
    session.update_and_fetch(0, make_keys(rng, 1, 2, 28, 16), make_values(rng, 1, 2, 28, 8))
    assert session.tokens(0) == 32


def test_unknown_session_after_close(daemon, client, open_session):
    s = open_session(name="closing")
    with zipcache.Client(daemon.socket_path) as other:
        twin = other.open_session(layers=2, kv_heads=2, head_dim=16, max_tokens=256,
                                  name="closing", attach=True)
        s.close()
        # The daemon no longer knows the session: its own NOT_FOUND.
        with pytest.raises(zipcache.NotFound) as info:
            twin.update_and_fetch(0, GOOD_K, np.zeros((1, 2, 3, 16), np.float16))
        assert info.value.status == "NOT_FOUND" and info.value.code == _lib.ZC_ENOTFOUND
        assert info.value.message  # the daemon said which session
        with pytest.raises(zipcache.NotFound):
            twin.stats()
        with pytest.raises(zipcache.NotFound):
            twin.trim(1)
    # And the closed handle itself says the same without asking.
    with pytest.raises(zipcache.NotFound):
        s.update_and_fetch(0, GOOD_K, np.zeros((1, 2, 3, 16), np.float16))
    with pytest.raises(zipcache.NotFound):
        s.stats()
    s.close()  # idempotent


def test_already_exists_and_attach_shape_mismatch(open_session):
    open_session(name="twice")
    with pytest.raises(zipcache.AlreadyExists):
        open_session(name="twice")
    with pytest.raises(zipcache.InvalidArgument, match="different shape"):
        open_session(name="twice", attach=True, kv_heads=4)
    again = open_session(name="twice", attach=True)
    assert again.name == "twice"


@pytest.mark.parametrize("config", [
    zipcache.CodecConfig(hi_bits=9),
    zipcache.CodecConfig(lo_bits=0),
    zipcache.CodecConfig(hi_fraction=1.5),
    zipcache.CodecConfig(group_size=0),
])
def test_bad_codec_config(open_session, config):
    with pytest.raises(zipcache.InvalidArgument):
        config.validate()
    with pytest.raises(zipcache.InvalidArgument):
        open_session(codec=config)


def test_bad_session_shape(open_session):
    with pytest.raises(zipcache.InvalidArgument):
        open_session(max_tokens=0)
    with pytest.raises(zipcache.InvalidArgument):
        open_session(kv_heads=-1)
    with pytest.raises(ValueError):
        open_session(policy="sometimes")


def test_connect_failure(tmp_path):
    with pytest.raises(zipcache.Unavailable) as info:
        zipcache.Client(str(tmp_path / "nobody.sock"), timeout=1)
    assert info.value.status == "UNAVAILABLE"
    assert isinstance(info.value, ConnectionError)


def test_closed_client(daemon):
    c = zipcache.Client(daemon.socket_path)
    c.close()
    with pytest.raises(zipcache.FailedPrecondition):
        c.stats()
    with pytest.raises(zipcache.FailedPrecondition):
        c.open_session(layers=1, kv_heads=1, head_dim=8, max_tokens=8)
    c.close()


def test_error_classes_follow_the_status():
    cases = {
        _lib.ZC_EINVALID: zipcache.InvalidArgument,
        _lib.ZC_ENONFINITE: zipcache.InvalidArgument,
        _lib.ZC_ENOTFOUND: zipcache.NotFound,
        _lib.ZC_EEXISTS: zipcache.AlreadyExists,
        _lib.ZC_EEXHAUSTED: zipcache.ResourceExhausted,
        _lib.ZC_EDENIED: zipcache.PermissionDenied,
        _lib.ZC_EPRECONDITION: zipcache.FailedPrecondition,
        _lib.ZC_EINTERNAL: zipcache.Internal,
        _lib.ZC_ERESTARTED: zipcache.DaemonRestarted,
        -32: zipcache.Unavailable,  # EPIPE
        -4242: zipcache.ZipCacheError,
    }
    for code, cls in cases.items():
        e = zipcache.error_from_code(code, "words")
        assert type(e) is cls and e.code == code and e.message == "words"
        assert isinstance(e, zipcache.ZipCacheError)
        assert e.name and e.description
    import pickle
    e = pickle.loads(pickle.dumps(zipcache.error_from_code(_lib.ZC_ENOTFOUND, "gone", "stats")))
    assert isinstance(e, zipcache.NotFound) and e.message == "gone"
    refused = zipcache.error_from_code(_lib.ZC_EINVALID, "layer 1: Inf", "update_many")
    refused.applied = 3
    e = pickle.loads(pickle.dumps(refused))
    assert isinstance(e, zipcache.InvalidArgument) and e.applied == 3
    assert e.operation == "update_many" and str(e) == str(refused)
