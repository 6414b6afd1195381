"""The Python client's default socket is the one rule zipcached and zipcachectl
follow (zc_default_socket_path in zipcache/client.h): compared with what
the daemon's --help says it would listen on and what zipcachectl dials."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import zipcache

from conftest import BUILD

SERVICE_SOCKET = "/run/zipcached/zipcached.sock"


def _environment(**set_vars: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZIPCACHE_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")}
    env.update(set_vars)
    return env


def _daemon_default(env: dict[str, str]) -> str:
    out = subprocess.run([str(BUILD / "bin" / "zipcached"), "--help"], env=env,
                         capture_output=True, text=True, check=True).stdout
    match = re.search(r"--socket PATH.*\(default ([^)]*)\)", out)
    assert match, out
    return match.group(1)


def _ctl_dials(env: dict[str, str]) -> str:
    run = subprocess.run([str(BUILD / "bin" / "zipcachectl"), "--timeout", "5000", "ping"],
                         env=env, capture_output=True, text=True)
    match = re.search(r"cannot connect to ([^:]*):", run.stderr) or \
        re.search(r" at (\S+)", run.stdout)
    assert match, (run.stdout, run.stderr)
    return match.group(1)


def _python_default(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    for name in ("ZIPCACHE_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
        if name in env:
            monkeypatch.setenv(name, env[name])
    return zipcache.default_socket_path()


@pytest.mark.parametrize("variables", [{}, {"XDG_RUNTIME_DIR": "/nonexistent/xdg"}])
def test_python_dials_where_the_daemon_listens(monkeypatch, variables):
    if os.path.exists(SERVICE_SOCKET):
        pytest.skip("this machine runs the system service, which clients fall back to")
    env = _environment(**variables)
    python = _python_default(monkeypatch, env)
    assert python == _daemon_default(env)
    assert python == _ctl_dials(env)


def test_zipcache_socket_points_python_and_zipcachectl_alike(monkeypatch):
    env = _environment(ZIPCACHE_SOCKET="/nonexistent/pointed.sock")
    assert _python_default(monkeypatch, env) == "/nonexistent/pointed.sock"
    assert _ctl_dials(env) == "/nonexistent/pointed.sock"


def test_runtime_directory_is_the_daemons_own(monkeypatch, tmp_path):
    """systemd gives the daemon its RuntimeDirectory; a client's is its own unit's."""
    env = _environment(RUNTIME_DIRECTORY=f"{tmp_path}:/other")
    assert _daemon_default(env) == f"{tmp_path}/zipcached.sock"
    assert _python_default(monkeypatch, env) == _ctl_dials(env)
    assert _python_default(monkeypatch, env) != f"{tmp_path}/zipcached.sock"
