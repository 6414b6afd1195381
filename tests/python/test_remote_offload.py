"""An offloaded session attached from Python: a real redis-server, two daemons."""
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import zipcache
from conftest import start_daemon, stop_daemon
from _support import make_keys, make_values


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (make deps)")
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("redis-server did not answer PING")
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_attach_restores_an_offloaded_session(tmp_path, redis_url):
    one = start_daemon(tmp_path / "one", "--remote", redis_url, "--offload-idle-seconds", "1")
    two = start_daemon(tmp_path / "two", "--remote", redis_url)
    try:
        rng = np.random.default_rng(13)
        a = zipcache.Client(one.socket_path, timeout=20)
        s = a.open_session(name="py-offload", layers=2, kv_heads=2, head_dim=16,
                           max_tokens=256, residual_tokens=16, model_id="py-model")
        for tokens in (40, 5):
            for layer in range(2):
                s.update_and_fetch(layer, make_keys(rng, 1, 2, tokens, 16),
                                   make_values(rng, 1, 2, tokens, 16))
        want_stats = s.stats()
        want = [tuple(np.array(x) for x in s.view(layer)) for layer in range(2)]
        s.release_views()
        s.release()
        deadline = time.monotonic() + 20
        while a.list_sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.list_sessions() == [], "the idle session was not offloaded"

        b = zipcache.Client(two.socket_path, timeout=20)
        t = b.open_session(name="py-offload", layers=2, kv_heads=2, head_dim=16,
                           max_tokens=256, residual_tokens=16, attach=True)
        assert t.info.model_id == "py-model"
        got_stats = t.stats()
        assert got_stats.layers == want_stats.layers and got_stats.total == want_stats.total
        for layer in range(2):
            for x, y in zip(t.view(layer), want[layer]):
                np.testing.assert_array_equal(x, y)
        t.close()
        a.close()
        b.close()
    finally:
        for d in (one, two):
            rc = stop_daemon(d)
            assert rc == 0, f"zipcached exited with {rc}:\n{d.log()}"
