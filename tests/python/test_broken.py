"""The Python client after a failure: a timeout breaks the connection, and
every call raises ConnectionBroken until reconnect(); the timed-out block
then lands whole, once. The daemon is stopped with SIGSTOP, so the short
timeout can only expire; every other wait is generous."""

from __future__ import annotations

import errno
import signal
import time

import numpy as np
import pytest

import zipcache
from zipcache import _lib

from _support import make_keys, make_values


def test_timeout_breaks_the_client_until_reconnect(daemon, client):
    rng = np.random.default_rng(5)
    session = client.open_session(layers=1, kv_heads=2, head_dim=16, max_tokens=64,
                                  name="broken")
    k1, v1 = make_keys(rng, 1, 2, 4, 16), make_values(rng, 1, 2, 4, 16)
    session.update_and_fetch(0, k1, v1)
    k2, v2 = make_keys(rng, 1, 2, 3, 16, sink=False), make_values(rng, 1, 2, 3, 16)

    daemon.process.send_signal(signal.SIGSTOP)
    try:
        client.timeout = 0.2
        with pytest.raises(zipcache.Unavailable) as first:
            session.update_and_fetch(0, k2, v2)
        assert type(first.value) is zipcache.Unavailable and first.value.name == "ETIMEDOUT"
        assert client.broken == -errno.ETIMEDOUT
        with pytest.raises(zipcache.ConnectionBroken, match="reconnect") as later:
            client.stats()
        assert later.value.code == _lib.ZC_EBROKEN and "ETIMEDOUT" in later.value.message
        with pytest.raises(zipcache.ConnectionBroken):
            session.view(0)
    finally:
        daemon.process.send_signal(signal.SIGCONT)

    client.timeout = 20
    assert client.timeout == 20
    with pytest.raises(zipcache.ConnectionBroken):
        client.list_sessions()  # the daemon runs again; the client is still broken
    assert client.reconnect() is True
    assert client.broken == 0

    deadline = time.monotonic() + 20
    while session.tokens(0) != 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.tokens(0) == 7
    keys, values = session.view(0)
    # Still in the streaming residual: the exact bits that were sent.
    assert np.array_equal(keys.view(np.uint16), np.concatenate([k1, k2], axis=2).view(np.uint16))
    assert np.array_equal(values.view(np.uint16), np.concatenate([v1, v2], axis=2).view(np.uint16))
    session.close()


def test_negative_timeout_is_refused(client):
    with pytest.raises(zipcache.InvalidArgument):
        client.timeout = -1.0
    assert client.timeout == 20
