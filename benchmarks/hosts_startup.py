"""Start-up across hosts: ``hvdrun --launcher ssh`` to network-namespace hosts (real sshd; needs root), flat
against a tree of host agents.

    python benchmarks/hosts_startup.py                                   # 2,8,32 hosts x 2 ranks, 1 round
    python benchmarks/hosts_startup.py --hosts 2,8,32 --rounds 3 --json benchmarks/results/hosts-startup.json
    python benchmarks/startup.py --ranks 4 --hosts 2,8,32                # the same, after the local sweep

For H hosts x R ranks (N = H R), each round runs (order rotating from round to round):

- ``flat``: ``HVDRUN_SSH_FANOUT=H``: hvdrun reaches every host itself; seconds from starting hvdrun to the last
  rank past ``hvdrun.runtime.init()``;
- ``tree``: the same with ``HVDRUN_SSH_FANOUT=round(sqrt(H))``: hvdrun reaches that many hosts, their agents
  the others (two levels);
- ``flat true`` / ``tree true``: ``hvdrun -np N true`` across the same hosts (the whole command);
- ``flat cpu`` / ``tree cpu``: the CPU seconds hvdrun itself spent in the ``flat`` / ``tree`` runs (its
  handshakes, channels and the ranks' output): what the tree takes off the launcher's machine.

Every host runs on this machine (one network and UTS namespace each, tests/infra/ssh_hosts.sh), so the CPU
that N interpreters, H agents and H sshd sessions cost is shared by one machine's cores: a tree cannot be
faster here, where the handshakes it moves to the hosts run on the same cores; on a cluster they run on the
hosts' own. The table gives the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multihost import start_hosts, stop_hosts  # noqa: E402 - the benchmarks' own namespace hosts

WORKER = """
import os, time
import hvdrun.runtime as runtime
runtime.init()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
runtime.shutdown()
"""
KINDS = ("flat", "tree", "flat true", "tree true")
MEASURES = (*KINDS, "flat cpu", "tree cpu")
TIMEOUT_S = 600


def tree_fanout(hosts: int) -> int:
    """The fan-out that makes two levels of ``hosts`` (one level for a single host)."""
    return max(1, min(round(math.sqrt(hosts)), hosts - 1))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _seconds(argv: list[str], env: dict[str, str], past_init: bool) -> tuple[float, float]:
    """Run one hvdrun: (seconds to the last ``PAST_INIT`` line, or for the whole command; its CPU seconds)."""
    start, cpu = time.time(), _children_cpu()
    done = subprocess.run(argv, env={**env, "BENCH_T0": repr(start)}, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    whole, cpu = time.time() - start, _children_cpu() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    if not past_init:
        return whole, cpu
    past = [float(line.split()[-1]) for line in done.stdout.splitlines() if "PAST_INIT" in line]
    if not past:
        raise RuntimeError(f"no rank printed PAST_INIT: {done.stdout[-1000:]}")
    return max(past), cpu


def kinds_for(info: dict, worker: Path, hosts: int, per_host: int) -> dict[str, Callable[[], tuple[float, float]]]:
    """Each kind at ``hosts`` x ``per_host``: a function that runs it once and returns (its seconds, hvdrun's CPU
    seconds)."""
    where = ["-H", ",".join(f"{h['addr']}:{per_host}" for h in info["hosts"][:hosts]), "-i", info["key"],
             "--ssh-known-hosts", info["known_hosts"], "--launcher", "ssh", "--start-timeout", "300"]
    hvdrun = [sys.executable, "-m", "hvdrun", *where]
    fanouts = {"flat": hosts, "tree": tree_fanout(hosts)}

    def run(kind: str) -> tuple[float, float]:
        fanout = fanouts[kind.split()[0]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HVDRUN_SSH_FANOUT": str(fanout)}
        if kind.endswith("true"):
            return _seconds([*hvdrun, "-np", str(hosts * per_host), "true"], env, past_init=False)
        return _seconds([*hvdrun, str(worker)], env, past_init=True)

    return {kind: (lambda kind=kind: run(kind)) for kind in KINDS}


def table(counts: list[int], per_host: int, times: dict[tuple[str, int], list[float]]) -> str:
    """Markdown: the median seconds of each kind at each host count, and tree / flat."""
    head = "| hosts x ranks | " + " | ".join(f"{h} x {per_host}" for h in counts) + " |"
    lines = [head, "|---" * (len(counts) + 1) + "|",
             "| tree fan-out | " + " | ".join(str(tree_fanout(h)) for h in counts) + " |"]
    for kind in MEASURES:
        cells = [f"{statistics.median(times[(kind, h)]):.2f} s" if (kind, h) in times else "" for h in counts]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    for top, bottom in (("tree", "flat"), ("tree true", "flat true")):
        cells = [f"{statistics.median(times[(top, h)]) / statistics.median(times[(bottom, h)]):.2f}x"
                 if (top, h) in times and (bottom, h) in times else "" for h in counts]
        lines.append(f"| {top} / {bottom} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_hosts(host_counts: list[int], ranks_per_host: int, rounds: int,
                  record: Callable[[dict], None]) -> None:
    """Start ``max(host_counts)`` namespace hosts, time every kind at every count ``rounds`` times, give each
    measurement to ``record`` (``{"kind", "hosts", "ranks", "round", "seconds"}``), print the table, stop the hosts.
    """
    if os.geteuid() != 0:
        raise SystemExit("hosts_startup.py needs root to create network namespaces")
    directory = Path(f"/tmp/hvdrun-hosts-startup-{os.getpid()}")
    times: dict[tuple[str, int], list[float]] = {}

    def keep(entry: dict) -> None:
        times.setdefault((entry["kind"], entry["hosts"]), []).append(entry["seconds"])
        record(entry)

    print(f"starting {max(host_counts)} namespace hosts...", flush=True)
    info = start_hosts(directory, max(host_counts))
    try:
        with tempfile.TemporaryDirectory(prefix="hvdrun-hosts-startup-") as tmp:
            worker = Path(tmp) / "worker.py"
            worker.write_text(WORKER)
            for round_index in range(rounds):
                for hosts in host_counts:
                    one_round(kinds_for(info, worker, hosts, ranks_per_host), round_index, hosts, ranks_per_host,
                              keep)
    finally:
        stop_hosts(directory)
    print(table(host_counts, ranks_per_host, times))


def one_round(kinds: dict[str, Callable[[], tuple[float, float]]], round_index: int, hosts: int, per_host: int,
              record: Callable[[dict], None]) -> None:
    """Every kind once at one host count (the order rotating from round to round), recorded; hvdrun's CPU too."""
    for kind in KINDS[round_index % len(KINDS):] + KINDS[:round_index % len(KINDS)]:
        seconds, cpu = kinds[kind]()
        measured = {kind: seconds, **({f"{kind} cpu": cpu} if kind in ("flat", "tree") else {})}
        for name, value in measured.items():
            record({"kind": name, "hosts": hosts, "ranks": hosts * per_host, "round": round_index, "seconds": value})
        print(f"  round {round_index + 1}: {kind:>9} {hosts:>3} x {per_host} {seconds:7.2f} s "
              f"(hvdrun's CPU {cpu:.2f} s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="2,8,32", help="namespace host counts (at most 250)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="keep every measurement here")
    args = parser.parse_args()
    results: list[dict] = []

    def record(entry: dict) -> None:
        results.append(entry)
        if args.json:
            args.json.write_text(json.dumps({"results": results}, indent=1))

    measure_hosts([int(word) for word in args.hosts.split(",") if word], args.ranks_per_host, args.rounds, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
