"""Across hosts: allreduce between network-namespace hosts, and start-up time of the launchers.

    python benchmarks/multihost.py                # needs root: starts 4 sshd hosts in network namespaces
    python benchmarks/multihost.py --json out.json --repeats 5

1. Allreduce (rank 0's median time, see ``allreduce.py``) with one rank on each of 2 hosts over
   hvdrun's TCP ring, against the same 2 ranks on this machine over loopback TCP
   (``HVDRUN_TRANSPORT=tcp``) and torch.distributed gloo across the same 2 hosts. Jobs of the
   three kinds alternate, so host noise hits them alike.
2. Start-up: seconds from starting ``hvdrun -np 8`` to the last rank past ``hvd.init()``, for
   4 hosts x 2 over SSH, the same 8 ranks on this machine, and ``--launcher mpiexec`` (MPICH
   hydra over ssh) across the same hosts.

The hosts are real OpenSSH servers from tests/infra/ssh_hosts.sh on their own subnet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "infra" / "ssh_hosts.sh"
ALLREDUCE = REPO / "benchmarks" / "allreduce.py"
FIXTURE_ENV = {"HVD_FX_NS_PREFIX": "hvdbn-h", "HVD_FX_BRIDGE": "hvdbn-br0", "HVD_FX_SUBNET": "10.199.0"}

STARTUP_WORKER = """
import os, time
import hvdrun.torch as hvd
hvd.init()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
hvd.shutdown()
"""


def start_hosts(directory: Path, count: int) -> dict:
    env = {**os.environ, **FIXTURE_ENV}
    subprocess.run(["bash", str(FIXTURE), "stop", "-d", str(directory), "--force"], env=env, capture_output=True)
    subprocess.run(["bash", str(FIXTURE), "start", "-n", str(count), "-m", "netns", "-d", str(directory)], env=env,
                   check=True, capture_output=True)
    return json.loads((directory / "hosts.json").read_text())


def stop_hosts(directory: Path) -> None:
    subprocess.run(["bash", str(FIXTURE), "stop", "-d", str(directory), "--purge"], env={**os.environ, **FIXTURE_ENV},
                   capture_output=True)


def hvdrun(args: list[str], env: dict[str, str] | None = None) -> str:
    command = [sys.executable, "-m", "hvdrun", "--no-prefix", *args]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                          **(env or {})}, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def allreduce_rows(info: dict, sizes: str, repeats: int) -> list[dict]:
    ssh = ["-i", info["key"], "--ssh-known-hosts", info["known_hosts"], "--network-interface", "eth0"]
    two_hosts = ",".join(f"{h['addr']}:1" for h in info["hosts"][:2])
    kinds = {
        "hvdrun, 2 hosts (TCP over veth)": (["-H", two_hosts, *ssh, str(ALLREDUCE), "--worker", "hvdrun"], {}),
        "gloo, 2 hosts": (["-H", two_hosts, *ssh, str(ALLREDUCE), "--worker", "gloo"], {}),
        "hvdrun, 1 host (TCP over loopback)": (["-np", "2", str(ALLREDUCE), "--worker", "hvdrun"],
                                               {"HVDRUN_TRANSPORT": "tcp"}),
    }
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for kind, (args, env) in kinds.items():
            for line in hvdrun([*args, "--sizes", sizes], env).splitlines():
                if line.startswith("RESULT "):
                    row = json.loads(line[7:])
                    samples.setdefault((kind, row["bytes"]), []).append(row["seconds"])
    return [{"kind": kind, "bytes": nbytes, "seconds": statistics.median(times), "samples": times}
            for (kind, nbytes), times in samples.items()]


def startup_rows(info: dict, repeats: int) -> list[dict]:
    ssh = ["-i", info["key"], "--ssh-known-hosts", info["known_hosts"]]
    four_hosts = ",".join(f"{h['addr']}:2" for h in info["hosts"][:4])
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "startup.py"
        worker.write_text(STARTUP_WORKER)
        kinds = {"ssh, 4 hosts x 2": ["-H", four_hosts, *ssh, str(worker)],
                 "local, 8 ranks": ["-np", "8", str(worker)],
                 "mpiexec (hydra over ssh), 4 hosts x 2": ["--launcher", "mpiexec", "-H", four_hosts, *ssh,
                                                           str(worker)]}
        samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, args in kinds.items():
                out = hvdrun(args, {"BENCH_T0": f"{time.time():.6f}"})
                samples[kind].append(max(float(line.split()[1]) for line in out.splitlines()
                                         if line.startswith("PAST_INIT")))
    return [{"kind": kind, "seconds": statistics.median(times), "samples": times} for kind, times in samples.items()]


def report(allreduce: list[dict], startup: list[dict]) -> str:
    lines = ["| allreduce | size | time | bus bandwidth |", "|---|---|---|---|"]
    for row in sorted(allreduce, key=lambda r: (r["bytes"], r["kind"])):
        bw = row["bytes"] / row["seconds"] / 1e9  # 2 ranks: bus bandwidth = size / time
        lines.append(f"| {row['kind']} | {row['bytes'] >> 20} MB | {row['seconds'] * 1e3:.1f} ms | {bw:.2f} GB/s |")
    for nbytes in sorted({r["bytes"] for r in allreduce}):
        by_kind = {r["kind"]: r["seconds"] for r in allreduce if r["bytes"] == nbytes}
        cross, loop, gloo = (by_kind[k] for k in ("hvdrun, 2 hosts (TCP over veth)", "hvdrun, 1 host (TCP over "
                                                   "loopback)", "gloo, 2 hosts"))
        lines.append(f"\n{nbytes >> 20} MB: 2 hosts / loopback = {loop / cross:.2f} (bandwidth ratio), "
                     f"hvdrun / gloo across the hosts = {gloo / cross:.2f}x")
    lines += ["", "| start-up, 8 ranks | to the last rank past init() (median) | samples |", "|---|---|---|"]
    lines += [f"| {r['kind']} | {r['seconds']:.2f} s | {', '.join(f'{s:.2f}' for s in r['samples'])} |"
              for r in startup]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("multihost.py needs root to create network namespaces")
    directory = Path(f"/tmp/hvdrun-bench-{os.getpid()}")
    info = start_hosts(directory, 4)
    try:
        allreduce = allreduce_rows(info, args.sizes, args.repeats)
        startup = startup_rows(info, args.repeats)
    finally:
        stop_hosts(directory)
    print(report(allreduce, startup))
    if args.json:
        Path(args.json).write_text(json.dumps({"allreduce": allreduce, "startup": startup}, indent=1))


if __name__ == "__main__":
    main()
