"""``hvdrun check --health`` and ``hvdrun --preflight`` against real SSH hosts whose faults are real.

Each host is an sshd in its own network namespace (tests/infra/ssh_hosts.sh) started through a wrapper that gives
it a mount namespace of its own, with /sys mounted again there (as ``ip netns exec`` does, so that
/sys/class/net shows the host's interfaces). Every host has ``hsn0``, one end of a veth pair whose other end
(``hsn0p``) is in the same namespace; the job's file system is a tmpfs mounted on the same path in every host's
mount namespace. A test breaks one host for real and repairs it afterwards: ``hsn0`` set down, its peer set down
(no carrier), the file system unmounted, a tiny tmpfs filled over the node-local directory, vendor tools put on
its PATH (the fakes of tests/fakes/fake_gpu_tools, which print the real tools' documented output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import (
    REPO,
    SshHosts,
    fixture_names,
    fixture_tag,
    host_processes,
    start_ssh_hosts,
    stop_ssh_hosts,
    unavailable,
    wait_until,
)

pytestmark = pytest.mark.integration

SCHEMA = json.loads((REPO / "docs" / "check-schema.json").read_text())
FAKE_TOOLS = REPO / "tests" / "fakes" / "fake_gpu_tools"
SMALL = ("--bandwidth-size", "1M", "--link-size", "256K", "--timeout", "60")
# sshd in a mount namespace of its own, /sys mounted again inside it (its sessions inherit both)
SSHD_WRAPPER = """#!/bin/sh
exec unshare --mount --propagation private sh -c 'mount -t sysfs sysfs /sys && exec /usr/sbin/sshd "$@"' sshd "$@"
"""


@dataclass(frozen=True)
class Nodes:
    """The hosts, their namespaces, and the paths every host has: the job's file system and node-local directory."""

    ssh: SshHosts
    ns_prefix: str
    lus: Path
    local: Path

    def netns(self, index: int) -> str:
        return f"{self.ns_prefix}{index + 1}"

    def sshd_pid(self, index: int) -> str:
        return (self.ssh.dir / self.ssh.names[index] / "sshd.pid").read_text().strip()

    def ip(self, index: int, *args: str) -> None:
        subprocess.run(["ip", "-n", self.netns(index), *args], check=True, capture_output=True, timeout=10)

    def inside(self, index: int, *command: str) -> None:
        """Run ``command`` in host ``index``'s mount namespace."""
        subprocess.run(["nsenter", "-t", self.sshd_pid(index), "-m", *command], check=True, capture_output=True,
                       timeout=30)

    def health_args(self) -> list[str]:
        return ["--interface", "hsn0", "--mount", str(self.lus), "--local-dir", str(self.local),
                "--min-local-gb", "0.01"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[Nodes]:
    """Three hosts with hsn0 up (carrier), the job's file system mounted, a node-local directory."""
    if os.geteuid() != 0:
        unavailable("node health hosts need root (network and mount namespaces)")
    root = tmp_path_factory.mktemp("node-health")
    wrapper = root / "sshd-own-mounts"
    wrapper.write_text(SSHD_WRAPPER)
    wrapper.chmod(0o755)
    names = {**fixture_names(fixture_tag(2)), "HVD_FX_SSHD": str(wrapper)}
    directory = Path(f"/tmp/hvdrun-nh-{os.getpid()}")
    ssh = start_ssh_hosts(directory, 3, names)
    lus, local = root / "lus", root / "local"
    lus.mkdir()
    local.mkdir()
    found = Nodes(ssh, names["HVD_FX_NS_PREFIX"], lus, local)
    try:
        for index in range(3):
            found.ip(index, "link", "add", "hsn0", "type", "veth", "peer", "name", "hsn0p")
            found.ip(index, "link", "set", "hsn0p", "up")
            found.ip(index, "link", "set", "hsn0", "up")
            found.inside(index, "mount", "-t", "tmpfs", "-o", "size=4m", "lus-test", str(lus))
        yield found
    finally:  # the mounts go with the hosts' mount namespaces, the interfaces with their network namespaces
        stop_ssh_hosts(directory, names)


@contextmanager
def interface_down(nodes: Nodes, index: int, name: str = "hsn0") -> Iterator[None]:
    """``name`` set down on host ``index`` (hsn0: the interface; hsn0p: its peer, so hsn0 loses its carrier)."""
    nodes.ip(index, "link", "set", name, "down")
    try:
        yield
    finally:
        nodes.ip(index, "link", "set", name, "up")


@contextmanager
def unmounted(nodes: Nodes, index: int) -> Iterator[None]:
    """The job's file system unmounted on host ``index``."""
    nodes.inside(index, "umount", str(nodes.lus))
    try:
        yield
    finally:
        nodes.inside(index, "mount", "-t", "tmpfs", "-o", "size=4m", "lus-test", str(nodes.lus))


@contextmanager
def local_dir_full(nodes: Nodes, index: int) -> Iterator[None]:
    """A 1 MB tmpfs over host ``index``'s node-local directory, filled up."""
    nodes.inside(index, "mount", "-t", "tmpfs", "-o", "size=1m", "full-test", str(nodes.local))
    try:
        nodes.inside(index, "sh", "-c", f"dd if=/dev/zero of={nodes.local}/fill bs=64k 2>/dev/null; true")
        yield
    finally:
        nodes.inside(index, "umount", str(nodes.local))


@contextmanager
def vendor_tools(nodes: Nodes, index: int, **modes: str) -> Iterator[None]:
    """The fake vendor tools on host ``index``'s PATH (/usr/local/sbin), each in its mode: ``nvidia_smi="ecc"``
    installs nvidia-smi with FAKE_NVIDIA_SMI_MODE=ecc."""
    nodes.inside(index, "mount", "-t", "tmpfs", "-o", "size=1m", "tools-test", "/usr/local/sbin")
    try:
        for tool, mode in modes.items():
            program = tool.replace("_", "-")
            script = f"#!/bin/sh\nFAKE_{tool.upper()}_MODE={mode} exec {FAKE_TOOLS / program} \"$@\"\n"
            nodes.inside(index, "sh", "-c", f"cat > /usr/local/sbin/{program} <<'EOF'\n{script}EOF\n"
                                            f"chmod +x /usr/local/sbin/{program}")
        yield
    finally:
        nodes.inside(index, "umount", "/usr/local/sbin")


def check_json(run_hvdrun, nodes: Nodes, count: int, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    hosts = ",".join(f"{addr}:1" for addr in nodes.ssh.addrs[:count])
    done = run_hvdrun("check", "--json", *SMALL, "-H", hosts, *nodes.health_args(), *nodes.ssh.args(), *args,
                      timeout=180)
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)
    return done, report


def checks_of(report: dict, host: str) -> dict[str, dict]:
    entry = next(h for h in report["hosts"] if h["host"] == host)
    return {c["name"]: c for c in entry["checks"]}


def failed(report: dict) -> dict[str, list[str]]:
    """Host -> the names of the checks it failed."""
    return {h["host"]: [c["name"] for c in h["checks"] if not c["ok"]] for h in report["hosts"] if not h["ok"]}


def test_healthy_nodes_pass_every_node_check(run_hvdrun, nodes):
    done, report = check_json(run_hvdrun, nodes, 2)
    assert done.returncode == 0 and report["ok"], done.stdout
    for addr in nodes.ssh.addrs[:2]:
        checks = checks_of(report, addr)
        assert {"interface", "mounts", "local-dir", "gpu-health", "clock"} <= set(checks)
        assert checks["interface"]["found"] == "hsn0 up, carrier (operstate up)"
        assert checks["mounts"]["found"] == f"{nodes.lus} (tmpfs)"
        assert checks["gpu-health"]["found"] == "no vendor tool on PATH (nvidia-smi, xpu-smi, rocm-smi)"
        assert checks["clock"]["ok"] and not checks["clock"]["warn"]
    node = next(h for h in report["hosts"] if h["host"] == nodes.ssh.addrs[0])["facts"]["node"]
    assert node["interfaces"] == [{"name": "hsn0", "present": True, "up": True, "carrier": True, "operstate": "up"}]
    assert report["job"]["ok"]


def test_an_interface_down_one_without_carrier_and_a_failing_vendor_tool_name_their_hosts(run_hvdrun, nodes):
    h1, h2, h3 = nodes.ssh.addrs
    with interface_down(nodes, 1), interface_down(nodes, 2, "hsn0p"), vendor_tools(nodes, 0, nvidia_smi="fail"):
        done, report = check_json(run_hvdrun, nodes, 3)
    assert done.returncode == 1 and failed(report) == {h1: ["gpu-health"], h2: ["interface"], h3: ["interface"]}
    assert checks_of(report, h2)["interface"]["found"] == "hsn0 is down (operstate down)"
    assert checks_of(report, h3)["interface"]["found"] == ("hsn0 is up but has no carrier (operstate "
                                                           "lowerlayerdown): no link")
    assert checks_of(report, h1)["interface"]["ok"]
    assert checks_of(report, h1)["gpu-health"]["found"].startswith(
        "nvidia-smi: 'nvidia-smi -q' failed with exit code 9: NVIDIA-SMI has failed because it couldn't communicate")
    assert report["job"]["skipped"] == f"host checks failed on {h1}, {h2}, {h3}"


def test_a_missing_mount_and_a_full_local_dir_name_their_hosts_in_one_line_each(run_hvdrun, nodes):
    h1, h2, h3 = nodes.ssh.addrs
    hosts = f"{h1}:1,{h2}:1,{h3}:1"
    with unmounted(nodes, 2), local_dir_full(nodes, 1):
        done = run_hvdrun("check", *SMALL, "-H", hosts, *nodes.health_args(), *nodes.ssh.args(), timeout=180)
    assert done.returncode == 1, done.stderr
    text = " ".join(done.stdout.split())  # rich folds a long line at the console's width
    assert f"{h3}: mounts: expected {nodes.lus} mounted (--mount); found {nodes.lus} is not a mount point" in text
    assert f"{h2}: local-dir: expected >= 0.01 GB free in {nodes.local} (--local-dir); found 0.00 MB free" in text
    assert f"{h1}: " not in text


def test_vendor_tools_that_report_problems_name_the_host_and_the_gpu(run_hvdrun, nodes):
    h1, h2, h3 = nodes.ssh.addrs
    with vendor_tools(nodes, 0, nvidia_smi="healthy"), vendor_tools(nodes, 1, nvidia_smi="ecc"), \
            vendor_tools(nodes, 2, nvidia_smi="remap-pending", xpu_smi="critical"):
        done, report = check_json(run_hvdrun, nodes, 3, "--gpus-per-node", "4")
    assert failed(report) == {h2: ["gpu-health"], h3: ["gpu-health"]}
    assert checks_of(report, h1)["gpus"]["found"] == "4 (NVIDIA A100-SXM4-40GB; nvidia-smi)"
    assert checks_of(report, h1)["gpu-health"]["found"] == "nvidia-smi: 4 GPUs healthy"
    assert checks_of(report, h2)["gpu-health"]["found"] == ("GPU 1 (00000000:46:00.0): 3 uncorrectable ECC errors "
                                                            "since the driver loaded")
    assert checks_of(report, h3)["gpu-health"]["found"] == (
        "GPU 1 (00000000:46:00.0): a row remap is pending (a GPU reset applies it); "
        "GPU 2: GPU Memory: critical (Memory has uncorrectable errors.)")


def write_config(path: Path, nodes: Nodes, **extra: str) -> Path:
    hosts = "".join(f"  - {{name: {addr}, slots: 1}}\n" for addr in nodes.ssh.addrs)
    path.write_text(f"hosts:\n{hosts}mounts: [{nodes.lus}]\n" + "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return path


def test_preflight_leaves_an_unhealthy_host_out_and_a_spare_takes_its_place(run_hvdrun, nodes, tmp_path):
    h1, h2, h3 = nodes.ssh.addrs
    config = write_config(tmp_path / "cluster.yaml", nodes)
    (tmp_path / "where.py").write_text("import socket\nprint('ran on', socket.gethostname())\n")
    with unmounted(nodes, 1):
        done = run_hvdrun("--preflight", "--config", str(config), "--spares", "1", *nodes.ssh.args(), "where.py",
                          timeout=180)
    assert done.returncode == 0, done.stderr
    unhealthy = [line for line in done.stderr.splitlines() if "is unhealthy" in line]
    assert unhealthy == [f"hvdrun: preflight: host {h2} is unhealthy: mounts: {nodes.lus} is not a mount point "
                         f"(expected {nodes.lus} mounted (mounts of {config}))"]
    assert f"hvdrun: preflight: left out {h2}; the job's 2 ranks run on {h1}, {h3}" in done.stderr
    assert sorted(line.split(":", 1)[1] for line in done.stdout.splitlines()) == ["ran on h1", "ran on h3"]
    assert wait_until(lambda: not host_processes(nodes.ssh.addrs)), "left behind on the hosts"


def test_preflight_without_room_stops_before_any_rank_naming_the_unreachable_host(run_hvdrun, nodes, tmp_path):
    down = nodes.ssh.unused_addr()
    (tmp_path / "where.py").write_text("print('a rank ran')\n")
    done = run_hvdrun("--preflight", "-H", f"{nodes.ssh.addrs[0]}:1,{down}:1", *nodes.ssh.args(), "where.py",
                      timeout=180)
    assert done.returncode == 1 and "a rank ran" not in done.stdout
    named = [line for line in done.stderr.splitlines() if down in line]
    assert named[0].startswith(f"hvdrun: preflight: host {down} is unhealthy: reach: ")
    assert named[1].startswith(f"hvdrun: error: preflight: 1 unhealthy host(s) ({down}), and the other hosts hold "
                               "1 of the job's 2 ranks; no rank was started")
    assert len(named) == 2
    assert wait_until(lambda: not host_processes(nodes.ssh.addrs)), "left behind on the hosts"


def test_preflight_of_healthy_hosts_says_so_in_one_line_and_the_job_runs(run_hvdrun):
    done = run_hvdrun("--preflight", "-np", "2", "echo", "ran")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["hvdrun: preflight: 1 host(s) healthy (reach, gpus, gpu-health, clock)"]
    assert sorted(done.stdout.splitlines()) == ["[0]<stdout>:ran", "[1]<stdout>:ran"]


def test_a_node_whose_clock_is_off_is_named(run_hvdrun, nodes, tmp_path):
    """The host's Python reads a clock 5 s ahead (a sitecustomize, named as the fake it is): the launcher's reading
    over the round trip catches it."""
    fake_clock = tmp_path / "fake-clock"
    fake_clock.mkdir()
    (fake_clock / "sitecustomize.py").write_text(
        "# FAKE: this host's clock runs 5 s ahead (for hvdrun's clock check test)\n"
        "import time\n_real = time.time\ntime.time = lambda: _real() + 5.0\n")
    python = tmp_path / "python-clock-ahead"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake_clock} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    h1, h2 = nodes.ssh.addrs[:2]
    config = tmp_path / "c.yaml"
    config.write_text(f"hosts:\n  - {{name: {h1}, slots: 1}}\n  - {{name: {h2}, slots: 1, python: {python}}}\n")
    done = run_hvdrun("check", "--json", *SMALL, "--config", str(config), "--health", *nodes.ssh.args(), timeout=180)
    report = json.loads(done.stdout)
    assert failed(report) == {h2: ["clock"]}
    clock = checks_of(report, h2)["clock"]
    assert clock["expected"] == "within 1 s of the launcher's clock"
    assert float(clock["found"].split()[0]) == pytest.approx(5.0, abs=0.5)  # the node's clock, not a duration
