"""Snapshots through the Python client and zipcachectl, against real daemons."""
import os
import subprocess

import numpy as np
import pytest

import zipcache
from conftest import BUILD, start_daemon, stop_daemon
from _support import make_keys, make_values


def _fill(s, rng, steps):
    for tokens in steps:
        for layer in range(s.info.layers):
            s.update_and_fetch(layer, make_keys(rng, 1, 2, tokens, 16),
                               make_values(rng, 1, 2, tokens, 16))


def _same(a, b):
    assert a.stats() == b.stats() or _stats_equal(a.stats(), b.stats())
    for layer in range(a.info.layers):
        for x, y in zip(a.reconstruct_layer(layer), b.reconstruct_layer(layer)):
            np.testing.assert_array_equal(x, y)
        if a.info.views == "full" and b.info.views == "full":
            for x, y in zip(a.view(layer), b.view(layer)):
                np.testing.assert_array_equal(x, y)


def _stats_equal(x, y):
    return x.layers == y.layers and x.total == y.total


@pytest.mark.parametrize("views", ["full", "none"])
def test_export_import_round_trip(client, open_session, tmp_path, views):
    rng = np.random.default_rng(3)
    s = open_session(residual_tokens=16, views=views, model_id="py-model")
    assert s.info.model_id == "py-model"
    _fill(s, rng, [40, 5])
    path = tmp_path / "s.zcsnap"
    written = s.export(path)
    assert written == path.stat().st_size
    t = client.import_session(path, name=f"py-imported-{views}", model_id="py-model")
    try:
        assert t.info.model_id == "py-model"
        assert t.info.views == views
        _same(s, t)
        # Both take the same appends alike.
        for tokens in (1, 3, 20):
            for layer in range(2):
                k = make_keys(rng, 1, 2, tokens, 16)
                v = make_values(rng, 1, 2, tokens, 16)
                s.update_and_fetch(layer, k, v)
                t.update_and_fetch(layer, k, v)
        _same(s, t)
    finally:
        t.close()


def test_file_objects_and_a_second_daemon(client, open_session, tmp_path):
    rng = np.random.default_rng(4)
    s = open_session(residual_tokens=16)
    _fill(s, rng, [33])
    with open(tmp_path / "f.zcsnap", "wb") as f:
        s.export(f)
    other = start_daemon(tmp_path / "second")
    try:
        c2 = zipcache.Client(other.socket_path, timeout=20)
        with open(tmp_path / "f.zcsnap", "rb") as f:
            t = c2.import_session(f, name="there")
        _same(s, t)
        t.close()
        c2.close()
    finally:
        assert stop_daemon(other) == 0


def test_damaged_snapshots_make_nothing(client, open_session, tmp_path):
    rng = np.random.default_rng(5)
    s = open_session(residual_tokens=16, model_id="m1")
    _fill(s, rng, [40, 5])
    path = tmp_path / "d.zcsnap"
    s.export(path)
    data = bytearray(path.read_bytes())
    before = len(client.list_sessions())
    bad = tmp_path / "bad.zcsnap"
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(zipcache.DataLoss, match="checksum mismatch"):
        client.import_session(bad)
    bad.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(zipcache.DataLoss, match="truncated"):
        client.import_session(bad)
    with pytest.raises(zipcache.FailedPrecondition, match="not 'm2'"):
        client.import_session(path, model_id="m2")
    assert len(client.list_sessions()) == before
    with pytest.raises(zipcache.InvalidArgument, match="open for writing"):
        with open(path, "rb") as f:
            s.export(f)


def test_zipcachectl_round_trip(client, open_session, tmp_path, daemon):
    rng = np.random.default_rng(6)
    s = open_session(residual_tokens=16, model_id="ctl-model")
    _fill(s, rng, [20])
    path = tmp_path / "ctl.zcsnap"
    ctl = str(BUILD / "bin" / "zipcachectl")
    out = subprocess.run([ctl, "--socket", daemon.socket_path, "export", str(s.id), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert f"exported session {s.id} to {path}" in out
    out = subprocess.run([ctl, "--socket", daemon.socket_path, "--json", "import", str(path),
                          "--name", "from-ctl"], capture_output=True, text=True, check=True).stdout
    assert '"model_id":"ctl-model"' in out
    t = next(i for i in client.list_sessions() if i.name == "from-ctl")
    assert t.model_id == "ctl-model" and t.max_layer_tokens == 20
    # Exported to standard output, the report goes to stderr.
    done = subprocess.run([ctl, "--socket", daemon.socket_path, "export", str(s.id), "-"],
                          capture_output=True, check=True)
    assert done.stdout == path.read_bytes()
    assert b"exported session" in done.stderr
    client.open_session(name="from-ctl", attach=True, layers=2, kv_heads=2, head_dim=16,
                        max_tokens=256, residual_tokens=16).close()
