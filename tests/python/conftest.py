"""Fixtures: a real zipcached on a private socket, clients, a reference model.

The daemon is the one `make` built (ZC_BUILD_DIR/bin/zipcached, else
build/bin/zipcached of this checkout); the package is imported from
python/ of this checkout unless ZIPCACHE_PYTHONPATH says otherwise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ZC_BUILD_DIR", REPO / "build"))
sys.path.insert(0, os.environ.get("ZIPCACHE_PYTHONPATH", str(REPO / "python")))

import zipcache  # noqa: E402


@dataclass
class Daemon:
    socket_path: str
    shm_dir: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _wait_for_socket(daemon: Daemon, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"zipcached exited with {daemon.process.returncode}:\n{daemon.log()}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(daemon.socket_path)
                return
            except OSError:
                time.sleep(0.02)
    raise RuntimeError(f"zipcached did not listen on {daemon.socket_path}:\n{daemon.log()}")


def start_daemon(directory: Path, *extra: str) -> Daemon:
    binary = BUILD / "bin" / "zipcached"
    if not binary.exists():
        pytest.exit(f"{binary} is missing: run `make` first", returncode=2)
    directory.mkdir(parents=True, exist_ok=True)
    sock = str(directory / "z.sock")
    shm = str(directory / "shm")
    args = [str(binary), "--socket", sock, "--shm-dir", shm, "--log-level", "warn"]
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    if "--metrics-listen" in help_text:
        args += ["--metrics-listen", "off"]  # tests must not fight over a TCP port
    args += list(extra)
    log_path = directory / "zipcached.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    daemon = Daemon(sock, shm, process, log_path)
    _wait_for_socket(daemon)
    return daemon


def stop_daemon(daemon: Daemon) -> int:
    if daemon.process.poll() is None:
        daemon.process.send_signal(signal.SIGTERM)
        try:
            daemon.process.wait(10)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait()
    return daemon.process.returncode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One zipcached per test module; it must exit 0 on SIGTERM."""
    d = start_daemon(tmp_path_factory.mktemp("zipcached"))
    yield d
    rc = stop_daemon(d)
    assert rc == 0, f"zipcached exited with {rc}:\n{d.log()}"


@pytest.fixture
def client(daemon: Daemon) -> Iterator[zipcache.Client]:
    c = zipcache.Client(daemon.socket_path, timeout=20)
    yield c
    c.close()


@pytest.fixture
def open_session(client: zipcache.Client):
    """open_session(**kw): a session closed on the daemon after the test."""
    sessions: list[zipcache.Session] = []

    def factory(**kw) -> zipcache.Session:
        kw.setdefault("layers", 2)
        kw.setdefault("kv_heads", 2)
        kw.setdefault("head_dim", 16)
        kw.setdefault("max_tokens", 256)
        s = client.open_session(**kw)
        sessions.append(s)
        return s

    yield factory
    for s in sessions:
        if not s.closed and not client.closed:
            try:
                s.close()
            except zipcache.NotFound:
                pass  # a test closed it through another handle of the same session


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and torch with CUDA "
                            "(run by `make check-gpu`; skipped elsewhere)")
