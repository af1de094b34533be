"""SSH failures in hvdrun's words, within the timeout given: a host that accepts TCP and then says nothing,
or hangs up during the handshake (a socket listener on this machine stands in for it; ~/.ssh/config names
it h3)."""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvdrun.errors import LaunchError
from hvdrun.hosts import Host
from hvdrun.launch.remote.connections import SshOptions, connect, resolve_targets

pytestmark = pytest.mark.integration

PARAMIKO_WORDS = ("No existing session", "protocol banner", "Negotiation failed")


def _serve(server: socket.socket, hang_up: bool) -> None:
    held = []
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            break
        if hang_up:
            conn.close()
        else:
            held.append(conn)  # accepted, never a byte back
    for conn in held:
        conn.close()


@pytest.fixture(params=["silent", "hangs up"])
def fake_host(request, tmp_path: Path) -> Iterator[tuple[str, Path, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=_serve, args=(server, request.param == "hangs up"), daemon=True).start()
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(f"Host h3\n  HostName 127.0.0.1\n  Port {port}\n")
    yield request.param, tmp_path, port
    server.close()


def test_connect_names_the_host_and_what_it_did(fake_host, monkeypatch):
    kind, home, port = fake_host
    monkeypatch.setenv("HOME", str(home))
    options = SshOptions(connect_timeout_s=2.0)
    target = resolve_targets([Host("h3", 1)], options)[0]
    with pytest.raises(LaunchError) as raised:
        connect(target, options, time.monotonic() + 2.0)
    message = str(raised.value)
    assert not any(words in message for words in PARAMIKO_WORDS), message
    assert raised.value.host == "h3"
    if kind == "silent":
        assert message.startswith(f"h3 ({getpass.getuser()}@127.0.0.1:{port}) did not answer within 2 s"), message
    else:
        where = f"h3 ({getpass.getuser()}@127.0.0.1:{port})"
        assert message.startswith(f"{where} closed the connection during the SSH handshake"), message


def test_check_reports_a_silent_host_within_its_timeout_and_names_the_known_hosts_given(fake_host, tmp_path):
    kind, home, port = fake_host
    if kind != "silent":
        pytest.skip("one host kind is enough for the check's report")
    known = tmp_path / "known"
    known.write_text("")
    env = {**os.environ, "HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "hvdrun", "check", "-H", "h3:1", "--timeout", "5",
                           "--ssh-known-hosts", str(known)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=5 * 5)  # start-up (imports, seconds under the suite's load) + the 5 s timeout; a
    # hang, or a wait per step as the old check's (3 x timeout and more, plus start-up), still fails
    output = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert done.returncode != 0
    assert f"h3 ({getpass.getuser()}@127.0.0.1:{port}) did not answer within 5 s" in output, output
    assert not any(words in output for words in PARAMIKO_WORDS), output
    assert f"its key is in {known} (--ssh-known-hosts)" in output, output
