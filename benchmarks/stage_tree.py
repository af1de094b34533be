"""``--stage-env`` to many hosts: the tree (one read of the shared source, then host to host) against every host
reading one packed file from the shared directory (hvdrun before the tree, from a git worktree of ``--before``).

    sudo python benchmarks/stage_tree.py --hosts 32 --rounds 3 --env-mb 100 --before f35a9b3

Each host is a real OpenSSH server in a network namespace of its own (tests/infra/ssh_hosts.sh) and, here, a
mount namespace of its own with a private tmpfs as its node-local directory (``HVD_FX_MOUNT_NS=1``), so every
host unpacks its own copy, as nodes do. The environment is a venv with real packages copied from this Python's
site-packages up to ``--env-mb``. Rounds alternate between the two ways; every round is cold (the copies are
removed between rounds). Both ways are driven the same way: ``stage()`` of that version of hvdrun, in a process
of its own, over SSH connections to every host.

Bytes read from the shared source, from each version's own report: before, hvdrun packs the environment (one
read) and every host that read the packed file reads it whole (one more read each); the tree reads it once, on
its root host (or hvdrun sends it once, when the root cannot see it). On one machine the "shared file system"
and every host's disk are the same page cache and the same 2 cores, so the seconds here are an upper bound set
by this VM's CPUs (every unpack runs on the same 2 cores); the bytes are what changes at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE_DIR = "/srv/hvdrun-stage-bench"
DRIVER = r'''
import contextlib, inspect, json, sys, time
from hvdrun.hosts import Host
from hvdrun.launch.remote.connections import SshOptions, connect_all, resolve_targets
from hvdrun.launch import staging
addrs, key, known_hosts, python, directory, work = json.loads(sys.argv[1])
hosts = [Host(addr, 1, "root") for addr in addrs]
options = SshOptions(identity_file=key, known_hosts=known_hosts)
clients = dict(zip(addrs, connect_all(resolve_targets(hosts, options), options, time.monotonic() + 60)))

class Over:
    network_interface = None
    def is_remote(self, host): return True
    def connection(self, host): return contextlib.nullcontext(clients[host.name])
    def relays(self, members, directory):
        from hvdrun.launch.stage_tree import SshRelays
        return SshRelays(members, directory, self.connection)
    def callback_address(self, members):
        from hvdrun.launch.remote.hostfacts import route_source_address
        return route_source_address(members[0].name)

plan = staging.plan_staging(directory, [python])
started = time.monotonic()
if "shared_dir" in inspect.signature(staging.stage).parameters:  # hvdrun before the tree
    _, line = staging.stage(plan, [(h, python) for h in hosts], Over(), shared_dir=work)
else:
    _, line = staging.stage(plan, [(h, python) for h in hosts], Over())
print(json.dumps({"seconds": time.monotonic() - started, "line": line}))
'''
_SIZE = re.compile(r"\(([0-9.]+) ([kMG]?B)")
_FILE_READERS = re.compile(r"(\d+) hosts? read the packed file")
_TREE_SOURCE = re.compile(r"(?:read once by \S+|sent once by hvdrun) \(([0-9.]+) ([kMG]?B) from the source\)")
_UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def make_env(work: Path, megabytes: int) -> Path:
    """A venv with whole packages of this Python's site-packages copied in, largest first, up to ``megabytes``."""
    prefix = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    site = next(prefix.glob("lib/python*/site-packages"))
    source = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    sizes = {entry: _du(entry) for entry in source.iterdir() if entry.is_dir() and entry.name != "torch"}
    total = 0
    for entry, size in sorted(sizes.items(), key=lambda item: -item[1]):
        if total + size <= megabytes * 1e6:
            shutil.copytree(entry, site / entry.name, symlinks=True)
            total += size
    return prefix


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def mount_node_dirs(info: dict, directory: Path) -> list[int]:
    """A private tmpfs at STAGE_DIR in each host's mount namespace; the sshd pids."""
    Path(STAGE_DIR).mkdir(parents=True, exist_ok=True)
    pids = [int((directory / host["name"] / "sshd.pid").read_text()) for host in info["hosts"]]
    for pid in pids:
        subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "-t", "tmpfs", "-o", "size=2g", "none", STAGE_DIR],
                       check=True)
    return pids


def clear_copies(pids: list[int]) -> None:
    for pid in pids:
        subprocess.run(["nsenter", "-t", str(pid), "-m", "sh", "-c", f"rm -rf {STAGE_DIR}/hvdrun-*"], check=True)


def run_round(pythonpath: Path, info: dict, env: Path, work: Path) -> dict:
    args = json.dumps([[h["addr"] for h in info["hosts"]], info["key"], info["known_hosts"], str(env / "bin/python"),
                       STAGE_DIR, str(work)])
    done = subprocess.run([sys.executable, "-c", DRIVER, args], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(pythonpath)}, cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"a staging round failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_bytes(line: str, env_bytes: int) -> int:
    """Bytes read from the shared source, from one staging line (see the module docstring)."""
    tree = _TREE_SOURCE.search(line)
    if tree:
        return int(float(tree[1]) * _UNITS[tree[2]])
    readers = _FILE_READERS.search(line)
    return env_bytes * (1 + (int(readers[1]) if readers else 0))  # the pack, then each host's read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-mb", type=int, default=100)
    parser.add_argument("--before", default="f35a9b3", help="the commit of hvdrun before the tree")
    parser.add_argument("--json", help="also write the rounds here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    os.environ["HVD_FX_MOUNT_NS"] = "1"
    from multihost import start_hosts, stop_hosts  # noqa: PLC0415 - root, sshd

    work = Path(tempfile.mkdtemp(prefix="hvdrun-stage-tree-"))
    before = work / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before), args.before], check=True,
                   capture_output=True)
    hosts_dir = Path(tempfile.mkdtemp(prefix="hvdrun-stage-tree-hosts-"))
    rounds: dict[str, list[dict]] = {"before": [], "tree": []}
    try:
        env = make_env(work, args.env_mb)
        env_bytes = len(subprocess.run(["tar", "-C", str(env), "-cf", "-", "."], capture_output=True).stdout)
        info = start_hosts(hosts_dir, args.hosts)
        pids = mount_node_dirs(info, hosts_dir)
        for _ in range(args.rounds):
            for way, path in (("before", before), ("tree", REPO)):
                clear_copies(pids)
                result = run_round(path, info, env, work)
                result["source_bytes"] = source_bytes(result["line"], env_bytes)
                rounds[way].append(result)
                print(f"{way}: {result['seconds']:.1f} s, {result['source_bytes'] / 1e6:.0f} MB from the source: "
                      f"{result['line']}", flush=True)
        clear_copies(pids)
    finally:
        stop_hosts(hosts_dir)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.hosts} hosts, environment {env_bytes / 1e6:.0f} MB as tar, {args.rounds} rounds each, "
          f"{os.cpu_count()} CPUs\n")
    print("| hosts | way | bytes read from the shared source | seconds (median, min-max) |\n|---|---|---|---|")
    for way, label in (("before", "every host reads the packed file (before)"), ("tree", "tree, fan-out 4")):
        seconds = [r["seconds"] for r in rounds[way]]
        print(f"| {args.hosts} | {label} | {rounds[way][0]['source_bytes'] / 1e6:,.0f} MB | "
              f"{statistics.median(seconds):.1f} ({min(seconds):.1f}-{max(seconds):.1f}) |")
    if args.json:
        result = {"hosts": args.hosts, "env_bytes": env_bytes, "rounds": rounds}
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
