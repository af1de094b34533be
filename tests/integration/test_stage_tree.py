"""``--stage-env``'s tree (:mod:`hvdrun.launch.stage_tree`) with real relays: each "host" is a relay process in a
mount namespace of its own with a private tmpfs as its node-local directory (root, ``unshare``), all reaching
each other over loopback. What a host had is listed by its wrapper after its relay ended (the tmpfs goes with it).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hvdrun.errors import LaunchError
from hvdrun.launch.stage_tree import ProcessRelays, StageTree, relay_command
from hvdrun.launch.staging import find_environment
from tests.conftest import unavailable, wait_until

pytestmark = pytest.mark.integration

STAGE_DIR = "/srv/hvdrun-stage-tree-test"


@pytest.fixture(scope="module")
def small_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], check=False).returncode != 0:
        unavailable("the staging tree's hosts need root and unshare -m (a private tmpfs each)")
    prefix = tmp_path_factory.mktemp("tree") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=60)
    (prefix / "lib" / "payload.bin").write_bytes(os.urandom(3 << 20))  # 3 MB: several chunks down the tree
    return prefix


class Hosts:
    """``count`` relays started as one command (as mpiexec starts them), each in its own mount namespace."""

    def __init__(self, count: int, listing: Path, tiny: int | None = None, blind: int | None = None,
                 prefix: Path | None = None) -> None:
        self.count, self.listing, self.tiny, self.blind, self.prefix = count, listing, tiny, blind, prefix

    def __call__(self, addr: str, port: int, token: str) -> tuple[list[str], dict[str, str]]:
        lines = [self._host(index, addr, port) for index in range(self.count)]
        return ["sh", "-c", " ".join(lines) + " wait"], {**os.environ, "HVDRUN_STAGE_TOKEN": token}

    def _host(self, index: int, addr: str, port: int) -> str:
        size = "16k" if index == self.tiny else "64m"
        hide = f"mount -t tmpfs none {shlex.quote(str(self.prefix))} && " if index == self.blind else ""
        relay = shlex.join(relay_command(sys.executable, addr, port, str(index), STAGE_DIR))
        listing = shlex.quote(str(self.listing / f"host{index}.txt"))
        inner = (f"mkdir -p {STAGE_DIR} && mount -t tmpfs -o size={size} none {STAGE_DIR} && {hide}{relay}; "
                 f"cd {STAGE_DIR} && find . -type f | sort > {listing}; "
                 f"cat */env-*/lib/payload.bin | md5sum >> {listing}")
        return f"unshare -m --propagation private sh -c {shlex.quote(inner)} &"


def _names(count: int) -> list[str]:
    return [f"host{i}" for i in range(count)]


def _tar_size(prefix: Path) -> int:
    return len(subprocess.run(["tar", "-C", str(prefix), "-cf", "-", "."], capture_output=True, check=True).stdout)


def _left_behind(token_dir: str) -> list[str]:
    done = subprocess.run(["pgrep", "-af", "stage_relay.py|hvdrun-stage"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if token_dir in line]


def test_seven_hosts_get_the_copy_down_a_tree_with_one_read_of_the_source(small_env, tmp_path):
    environment = find_environment(f"{small_env}/bin/python")
    tree = StageTree(_names(7), environment, STAGE_DIR, fanout=2, interface="lo")  # children dial the relays on lo
    report = tree.run(ProcessRelays(Hosts(7, tmp_path)), "127.0.0.1")
    assert report.source_host == "host0" and report.source_bytes == _tar_size(small_env)
    assert (report.fanout, report.depth) == (2, 2)
    copy = f"{STAGE_DIR}/hvdrun-{os.getuid()}/env-{environment.fingerprint}"
    assert [s.host for s in report.staged] == _names(7) and {s.copy for s in report.staged} == {copy}
    assert all(s.via == "tree" and s.copied_bytes > 3 << 20 for s in report.staged)
    expected = subprocess.run(["md5sum"], input=(small_env / "lib" / "payload.bin").read_bytes(),
                              capture_output=True, check=True).stdout.decode()
    for index in range(7):
        listing = (tmp_path / f"host{index}.txt").read_text()
        assert "/pyvenv.cfg\n" in listing and "/.hvdrun-staged\n" in listing and listing.endswith(expected), index
    assert not _left_behind(STAGE_DIR)


def test_a_root_that_cannot_see_the_environment_gets_it_from_hvdrun(small_env, tmp_path):
    environment = find_environment(f"{small_env}/bin/python")
    tree = StageTree(_names(3), environment, STAGE_DIR, fanout=2)
    report = tree.run(ProcessRelays(Hosts(3, tmp_path, blind=0, prefix=small_env)), "127.0.0.1")
    assert report.source_host is None and report.source_bytes == _tar_size(small_env)
    assert all(s.via == "tree" for s in report.staged) and "/.hvdrun-staged" in (tmp_path / "host0.txt").read_text()


def test_a_full_host_is_named_and_its_subtree_stops_with_nothing_left(small_env, tmp_path):
    """host1 (children host3 and host4 at fan-out 2) has 16 KiB: the error names it and the space; host3 and host4
    saw their stream end early, which is not the cause."""
    environment = find_environment(f"{small_env}/bin/python")
    tree = StageTree(_names(5), environment, STAGE_DIR, fanout=2)
    with pytest.raises(LaunchError) as failed:
        tree.run(ProcessRelays(Hosts(5, tmp_path, tiny=1)), "127.0.0.1")
    message = str(failed.value)
    assert message.startswith(f"--stage-env: cannot unpack the environment into {STAGE_DIR} on host1: ")
    assert "KiB free" in message and "needed" in message and failed.value.host == "host1"
    assert "/.hvdrun-staged" in (tmp_path / "host2.txt").read_text()  # the other branch finished
    assert "/.hvdrun-staged" not in (tmp_path / "host3.txt").read_text()
    assert not _left_behind(STAGE_DIR)


def test_a_connection_without_the_token_is_not_a_host(small_env, tmp_path):
    environment = find_environment(f"{small_env}/bin/python")
    hosts = Hosts(2, tmp_path)
    rogue: list[bytes] = []

    def pose_as_host0(addr: str, port: int) -> None:
        try:
            with socket.create_connection((addr, port), timeout=10) as sock:
                sock.recv(200)
                sock.sendall(b'{"index": 0, "proof": "00", "host": "rogue", "identity": "x"}\n')
                rogue.append(sock.recv(200))  # b'': closed on it
        except OSError:  # came after the hosts: the listener had closed
            rogue.append(b"")

    def with_a_rogue(addr: str, port: int, token: str) -> tuple[list[str], dict[str, str]]:
        threading.Thread(target=pose_as_host0, args=(addr, port)).start()
        return hosts(addr, port, token)

    report = StageTree(_names(2), environment, STAGE_DIR, fanout=2).run(ProcessRelays(with_a_rogue), "127.0.0.1")
    assert rogue == [b""] and [s.via for s in report.staged] == ["tree", "tree"]


class TwoHosts:
    """Two long-lived "hosts": a mount namespace each (a sleeping process holds it) with a private tmpfs at
    STAGE_DIR; relays of any job enter a host's namespace (nsenter), so two jobs share each host's directory and
    its lock as two jobs on one node do."""

    def __init__(self) -> None:
        self.holders = [subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                          f"mkdir -p {STAGE_DIR} && mount -t tmpfs -o size=64m none {STAGE_DIR} "
                                          "&& exec sleep 600"]) for _ in range(2)]
        for holder in self.holders:  # its tmpfs mounted: the namespace is a host
            assert wait_until(lambda h=holder: subprocess.run(
                ["nsenter", "-t", str(h.pid), "-m", "mountpoint", "-q", STAGE_DIR], check=False).returncode == 0)

    def __call__(self, addr: str, port: int, token: str) -> tuple[list[str], dict[str, str]]:
        commands = [shlex.join(relay_command(sys.executable, addr, port, str(i), STAGE_DIR)) for i in range(2)]
        lines = [f"nsenter -t {holder.pid} -m {command} &"
                 for holder, command in zip(self.holders, commands, strict=True)]
        return ["sh", "-c", " ".join(lines) + " wait"], {**os.environ, "HVDRUN_STAGE_TOKEN": token}

    def stop(self) -> None:
        for holder in self.holders:
            holder.kill()
            holder.wait()


def test_two_jobs_staging_the_same_hosts_at_once_never_wait_on_each_other(small_env):
    """Each job's first check takes no lock that another job holds (BUSY, asked again after its own tree): two jobs
    holding one host's lock each and waiting on the other's is impossible; each host gets one copy."""
    environment = find_environment(f"{small_env}/bin/python")
    hosts = TwoHosts()
    results: dict[str, object] = {}

    def job(name: str) -> None:
        try:
            results[name] = StageTree(_names(2), environment, STAGE_DIR, fanout=1).run(ProcessRelays(hosts),
                                                                                        "127.0.0.1")
        except Exception as e:  # noqa: BLE001 - the test names it
            results[name] = e

    try:
        jobs = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
        for thread in jobs:
            thread.start()
        for thread in jobs:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in jobs), "the two jobs wait on each other"
    finally:
        hosts.stop()
    reports = [results["a"], results["b"]]
    assert all(hasattr(r, "staged") for r in reports), reports
    made = [s for r in reports for s in r.staged if s.via == "tree"]  # type: ignore[attr-defined]
    assert sorted(s.host for s in made) == ["host0", "host1"]  # one copy a host, by one job or the other
    assert not _left_behind(STAGE_DIR)


def test_a_relay_takes_no_command_from_a_coordinator_without_the_token(tmp_path):
    """The relay makes hvdrun prove the token too: a server that cannot is never told the host's identity twice
    nor gets to run the unpack line (the relay ends with exit 1 and says why)."""
    from hvdrun.launch.remote.stage_relay import proof

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    relay = subprocess.Popen(relay_command(sys.executable, "127.0.0.1", port, "0", str(tmp_path / "never")),
                             stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    relay.stdin.write("the-real-token\n")
    relay.stdin.flush()
    conn, _ = server.accept()
    with conn:
        conn.sendall(b'{"nonce": "n1"}\n')
        hello = json.loads(conn.makefile().readline())
        assert hello["proof"] == proof("the-real-token", "relay", "n1")  # it proved itself, as a relay
        conn.sendall(json.dumps({"proof": proof("a-guessed-token", "hvdrun", hello["nonce"])}).encode() + b"\n")
        conn.sendall(json.dumps({"do": "check", "argv": ["touch", str(tmp_path / "ran")], "lock_wait": 0,
                                 "prefix": "/", "peer": "127.0.0.1"}).encode() + b"\n")
        assert relay.wait(timeout=30) == 1
    server.close()
    assert "did not prove the job's staging token" in relay.stderr.read()
    assert not (tmp_path / "ran").exists()
