"""Across hosts: an allreduce sweep over 2-8 network-namespace hosts (hvdrun's algorithms against MPICH),
and, on request, the older two-host comparison and the start-up time of the launchers.

    python benchmarks/multihost.py                # needs root: starts sshd hosts in network namespaces
    python benchmarks/multihost.py --hosts 2,4,8 --ranks-per-host 1,2 --sizes 4K,64K,16M --rounds 3 \\
        --algorithms auto,flat --json benchmarks/results/multihost-sweep.json
    python benchmarks/multihost.py --hosts 2 --ranks-per-host 1 --sizes 4K --rounds 1 --algorithms auto  # smoke
    python benchmarks/multihost.py --no-sweep --loopback --startup    # the two older sections only
    python benchmarks/multihost.py --no-ssh --hosts 2,4 --ranks-per-host 1,2   # no sshd: benchmarks/netns_direct.py

Sweep (the default): for every host count (``--hosts``) and ranks per host (``--ranks-per-host``),
``benchmarks/allreduce.py``'s workers time an in-place float32 sum at every size (rank 0's median of
batch means, see that file):

- one hvdrun job per ``--algorithms`` entry, started over SSH with ``HVDRUN_ALGORITHM`` set (``flat``:
  one ring through every rank, the old path; ``auto``/``ring``/``doubling``/``halving``: shared memory
  inside a host and the named algorithm across hosts; a runtime that does not know the variable
  ignores it, and every job then runs the flat ring);
- one MPI job: the mpich wheel's hydra through ``hvdrun --launcher mpiexec`` running the mpi4py worker,
  with ``UCX_TLS=tcp,self`` (``--ucx-tls``): the namespace hosts share one kernel, and UCX would
  otherwise move data between them through shared memory. MPICH's own shared memory still serves the
  ranks of one host.

Inside a round every configuration runs each kind once, back to back (the order rotates from round to
round), so host noise hits the kinds alike; the table gives the median over rounds, hvdrun's time over
MPI's (below 1: hvdrun is faster), H hosts x 2 against H hosts x 1, and how the smallest size's time
grows from the fewest to the most hosts. ``--json`` keeps every job's numbers (written after each job),
the input of ``benchmarks/scaling.py --fit``.

``--loopback``: one rank on each of 2 hosts over hvdrun's TCP ring against the same 2 ranks on this
machine over loopback TCP (``HVDRUN_TRANSPORT=tcp``) and torch.distributed gloo across the 2 hosts.
``--startup``: seconds from starting ``hvdrun -np 8`` to the last rank past ``hvd.init()``, for 4 hosts
x 2 over SSH, 8 local ranks, and ``--launcher mpiexec`` across the same hosts.

The hosts are real OpenSSH servers from tests/infra/ssh_hosts.sh, one network namespace each, on a
bridge of their own (names and subnet derived from this process's id); they are stopped and their
directory removed at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hvdrun.measure.timing import human_bytes, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns_direct  # noqa: E402 - beside this file

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "infra" / "ssh_hosts.sh"
ALLREDUCE = REPO / "benchmarks" / "allreduce.py"
ALGORITHMS = ("auto", "flat", "ring", "doubling", "halving")
MPI = "MPI"
START_TIMEOUT_S = 300  # 16 ranks importing torch on 2 cores take a while to meet at init()

STARTUP_WORKER = """
import os, time
import hvdrun.torch as hvd
hvd.init()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
hvd.shutdown()
"""


def fixture_env(tag: int) -> dict[str, str]:
    """Namespace, bridge and subnet names of this run's hosts (distinct from the test suite's 10.200-249)."""
    tag %= 10_000
    return {"HVD_FX_NS_PREFIX": f"hb{tag}h", "HVD_FX_BRIDGE": f"hb{tag}br0",
            "HVD_FX_SUBNET": f"10.{150 + tag % 50}.{tag // 50 % 250}"}


FIXTURE_ENV = fixture_env(os.getpid())


def start_hosts(directory: Path, count: int) -> dict:
    env = {**os.environ, **FIXTURE_ENV}
    subprocess.run(["bash", str(FIXTURE), "stop", "-d", str(directory), "--force"], env=env, capture_output=True)
    done = subprocess.run(["bash", str(FIXTURE), "start", "-n", str(count), "-m", "netns", "-d", str(directory)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not start {count} namespace hosts:\n{done.stderr[-3000:]}")
    return json.loads((directory / "hosts.json").read_text())


def stop_hosts(directory: Path) -> None:
    subprocess.run(["bash", str(FIXTURE), "stop", "-d", str(directory), "--purge"], env={**os.environ, **FIXTURE_ENV},
                   capture_output=True)
    shutil.rmtree(directory, ignore_errors=True)  # --purge leaves the fixture's .lock


class JobFailed(RuntimeError):
    """One hvdrun job exited non-zero or ran too long."""


def hvdrun(args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run one hvdrun job; its stdout, or :class:`JobFailed` with the end of its stderr."""
    command = [sys.executable, "-m", "hvdrun", "--no-prefix", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise JobFailed(f"{' '.join(command)} ran past {timeout:.0f} s") from e
    if done.returncode != 0:
        raise JobFailed(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def results(stdout: str) -> list[dict]:
    return [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]


# -- the sweep ---------------------------------------------------------------------------------------------

def ssh_args(info: dict) -> list[str]:
    return ["-i", info["key"], "--ssh-known-hosts", info["known_hosts"]]


def host_list(info: dict, hosts: int, per_host: int) -> str:
    return ",".join(f"{h['addr']}:{per_host}" for h in info["hosts"][:hosts])


def job_command(kind: str, info: dict, hosts: int, per_host: int, sizes: str, mpi_env: dict[str, str],
                hvdrun_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """hvdrun's arguments and the extra environment of one sweep job."""
    where = ["-H", host_list(info, hosts, per_host), *ssh_args(info), "--start-timeout", str(START_TIMEOUT_S)]
    if kind == MPI:  # hydra over ssh; -x puts each variable on mpiexec's -genv as well as in its environment
        forward = [word for name, value in mpi_env.items() for word in ("-x", f"{name}={value}")]
        return (["--launcher", "mpiexec", *where, *forward, str(ALLREDUCE), "--worker", "mpi", "--sizes", sizes],
                dict(mpi_env))
    env = kind_env(kind, hvdrun_env)
    forward = [word for name, value in env.items() for word in ("-x", f"{name}={value}")]
    return ([*where, "--network-interface", "eth0", *forward, str(ALLREDUCE), "--worker", "hvdrun", "--sizes", sizes],
            env)


COMPILED_OFF = "compiled-off"  # a kind's suffix: the same algorithm with HVDRUN_COMPILED=off (--compare-compiled)


def kind_env(kind: str, hvdrun_env: dict[str, str]) -> dict[str, str]:
    """The environment of an hvdrun kind: ``hvdrun ALGORITHM [compiled-off]``."""
    words = kind.split()
    return {"HVDRUN_ALGORITHM": words[1], **hvdrun_env, **({"HVDRUN_COMPILED": "off"} if COMPILED_OFF in words else {})}


def run_job(kind: str, info: dict | netns_direct.BareHosts, hosts: int, per_host: int, sizes: str,
            args: argparse.Namespace) -> str:
    """One sweep job's stdout: through hvdrun over SSH, or (``--no-ssh``) started straight into the namespaces."""
    if isinstance(info, dict):
        command, env = job_command(kind, info, hosts, per_host, sizes, args.mpi_env, args.hvdrun_env)
        return hvdrun(command, env, args.job_timeout)
    script = [str(ALLREDUCE), "--worker", "mpi" if kind == MPI else "hvdrun", "--sizes", sizes]
    if kind == MPI:
        code, out, err = netns_direct.run_mpi(info, hosts, per_host, script, args.mpi_env, args.job_timeout)
    else:
        env = kind_env(kind, args.hvdrun_env)
        code, out, err = netns_direct.run_hvdrun(info, hosts, per_host, script, env, args.job_timeout)
    if code != 0:
        raise JobFailed(f"{kind} on {hosts} x {per_host} failed (exit {code}):\n{err}")
    return out


def sweep(info: dict | netns_direct.BareHosts, args: argparse.Namespace, kinds: list[str],
          save: Callable[[list[dict], list[dict]], None]) -> tuple[list[dict], list[dict]]:
    """Every (round, configuration, kind) job; returns (one row per job and size, failed jobs)."""
    sizes = ",".join(str(s) for s in args.sizes)
    configs = args.configs or [(h, r) for h in args.hosts for r in args.ranks_per_host]
    runs: list[dict] = []
    failures: list[dict] = []
    total, done = args.rounds * len(configs) * len(kinds), 0
    for round_index in range(args.rounds):
        turn = round_index % len(kinds)
        order = kinds[turn:] + kinds[:turn]  # rotate, so no kind always runs first after another configuration
        for hosts, per_host in configs:
            for kind in order:
                done += 1
                label = f"{kind}, {hosts} hosts x {per_host}, round {round_index + 1} of {args.rounds}"
                print(f"[{done}/{total}] {label}...", file=sys.stderr, end=" ", flush=True)
                start = time.monotonic()
                try:
                    rows = results(run_job(kind, info, hosts, per_host, sizes, args))
                except JobFailed as e:
                    print("FAILED", file=sys.stderr, flush=True)
                    failures.append({"kind": kind, "hosts": hosts, "ranks_per_host": per_host,
                                     "round": round_index, "error": str(e)[-2000:]})
                    print(str(e)[-1500:], file=sys.stderr, flush=True)
                    if args.stop_on_failure:
                        raise
                    save(runs, failures)
                    continue
                wall = time.monotonic() - start
                print(f"{wall:.1f} s", file=sys.stderr, flush=True)
                for row in rows:
                    runs.append({"kind": kind, "library": "mpi" if kind == MPI else "hvdrun",
                                 "algorithm": None if kind == MPI else kind.split()[1], "hosts": hosts,
                                 "ranks_per_host": per_host, "ranks": row["ranks"], "bytes": row["bytes"],
                                 "seconds": row["seconds"], "after_pause": row.get("after_pause"),
                                 "round": round_index, "job_wall_s": round(wall, 2)})
                save(runs, failures)
    return runs, failures


def medians(runs: list[dict]) -> list[dict]:
    """One row per kind, hosts, ranks per host and size: medians over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["kind"], run["hosts"], run["ranks_per_host"], run["bytes"]), []).append(run)
    rows = []
    for (kind, hosts, per_host, nbytes), group in groups.items():
        paused = [r["after_pause"] for r in group if r.get("after_pause") is not None]
        rows.append({"kind": kind, "library": group[0]["library"], "algorithm": group[0]["algorithm"],
                     "hosts": hosts, "ranks_per_host": per_host, "ranks": hosts * per_host, "bytes": nbytes,
                     "rounds": len(group), "seconds": statistics.median(r["seconds"] for r in group),
                     "samples": [r["seconds"] for r in group],
                     "after_pause": statistics.median(paused) if paused else None})
    return sorted(rows, key=lambda r: (r["hosts"], r["ranks_per_host"], r["bytes"], r["kind"]))


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:,.1f} µs" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"


def ratio(top: float | None, bottom: float | None) -> str:
    return f"{top / bottom:.2f}x" if top and bottom else "-"


def sweep_report(rows: list[dict], kinds: list[str]) -> str:
    """Markdown: times, hvdrun/MPI, H x 2 against H x 1, growth of the smallest size with the host count."""
    index = {(r["kind"], r["hosts"], r["ranks_per_host"], r["bytes"]): r["seconds"] for r in rows}
    ours = [k for k in kinds if k != MPI]
    mpi = MPI in kinds
    header = ["hosts x ranks", "size", *kinds]
    header += [f"{k} / MPI" for k in ours] if mpi else []
    header += [f"{k} / {ours[1]}" for k in ours[:1]] if len(ours) > 1 else []
    lines = ["Allreduce, float32 sum, rank 0's median time (median over rounds); X / Y = X's time over Y's "
             "(below 1: X is faster).", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    points = sorted({(r["hosts"], r["ranks_per_host"], r["bytes"]) for r in rows})
    for hosts, per_host, nbytes in points:
        times = {k: index.get((k, hosts, per_host, nbytes)) for k in kinds}
        cells = [f"{hosts} x {per_host}", human_bytes(nbytes), *(fmt_time(times[k]) for k in kinds)]
        cells += [ratio(times[k], times[MPI]) for k in ours] if mpi else []
        cells += [ratio(times[ours[0]], times[ours[1]])] if len(ours) > 1 else []
        lines.append("| " + " | ".join(cells) + " |")

    pairs = sorted({(h, r) for h, r, _ in points if r > 1 and (h, 1) in {(p[0], p[1]) for p in points}})
    if pairs:
        lines += ["", f"H hosts x R ranks against H hosts x 1 (time ratio; where H x R exceeds this machine's "
                  f"{os.cpu_count()} cores, the ranks share them):", "",
                  "| hosts | ranks per host | size | " + " | ".join(kinds) + " |", "|" + "---|" * (3 + len(kinds))]
        for hosts, per_host in pairs:
            for nbytes in sorted({b for h, r, b in points if (h, r) == (hosts, per_host)}):
                cells = [str(hosts), f"{per_host} vs 1", human_bytes(nbytes)]
                cells += [ratio(index.get((k, hosts, per_host, nbytes)), index.get((k, hosts, 1, nbytes)))
                          for k in kinds]
                lines.append("| " + " | ".join(cells) + " |")

    host_counts = sorted({h for h, _, _ in points})
    if len(host_counts) > 1:
        few, many = host_counts[0], host_counts[-1]
        smallest = min(b for _, _, b in points)
        lines += ["", f"{human_bytes(smallest)}: time on {many} hosts over time on {few} (flat ring: grows with "
                  f"the ranks; recursive doubling: with log2 of the hosts, {_log2_ratio(few, many)} here):", "",
                  f"| ranks per host | kind | {few} hosts | {many} hosts | growth | ranks per core |",
                  "|---|---|---|---|---|---|"]
        cores = os.cpu_count() or 1
        for per_host in sorted({r for _, r, _ in points}):
            per_core = f"{few * per_host / cores:g} -> {many * per_host / cores:g}"
            for kind in kinds:
                a, b = index.get((kind, few, per_host, smallest)), index.get((kind, many, per_host, smallest))
                lines.append(f"| {per_host} | {kind} | {fmt_time(a)} | {fmt_time(b)} | {ratio(b, a)} | {per_core} |")
    return "\n".join(lines)


def _log2_ratio(few: int, many: int) -> str:
    return f"{math.log2(many) / math.log2(few):.1f}x" if few > 1 else "-"


# -- the older sections: two hosts against loopback and gloo; start-up -------------------------------------

def loopback_rows(info: dict, sizes: str, repeats: int) -> list[dict]:
    ssh = [*ssh_args(info), "--network-interface", "eth0"]
    two_hosts = host_list(info, 2, 1)
    kinds = {
        "hvdrun, 2 hosts (TCP over veth)": (["-H", two_hosts, *ssh, str(ALLREDUCE), "--worker", "hvdrun"], {}),
        "gloo, 2 hosts": (["-H", two_hosts, *ssh, str(ALLREDUCE), "--worker", "gloo"], {}),
        "hvdrun, 1 host (TCP over loopback)": (["-np", "2", str(ALLREDUCE), "--worker", "hvdrun"],
                                               {"HVDRUN_TRANSPORT": "tcp"}),
    }
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for kind, (args, env) in kinds.items():
            for row in results(hvdrun([*args, "--sizes", sizes], env)):
                samples.setdefault((kind, row["bytes"]), []).append(row["seconds"])
    return [{"kind": kind, "bytes": nbytes, "seconds": statistics.median(times), "samples": times}
            for (kind, nbytes), times in samples.items()]


def startup_rows(info: dict, repeats: int) -> list[dict]:
    ssh = ssh_args(info)
    four_hosts = host_list(info, 4, 2)
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


def loopback_report(rows: list[dict]) -> str:
    lines = ["| allreduce | size | time | bus bandwidth |", "|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r["bytes"], r["kind"])):
        bw = row["bytes"] / row["seconds"] / 1e9  # 2 ranks: bus bandwidth = size / time
        lines.append(f"| {row['kind']} | {human_bytes(row['bytes'])} | {fmt_time(row['seconds'])} | {bw:.2f} GB/s |")
    for nbytes in sorted({r["bytes"] for r in rows}):
        by_kind = {r["kind"]: r["seconds"] for r in rows if r["bytes"] == nbytes}
        cross, loop, gloo = (by_kind[k] for k in ("hvdrun, 2 hosts (TCP over veth)", "hvdrun, 1 host (TCP over "
                                                   "loopback)", "gloo, 2 hosts"))
        lines.append(f"\n{human_bytes(nbytes)}: 2 hosts / loopback = {loop / cross:.2f} (bandwidth ratio), "
                     f"hvdrun / gloo across the hosts = {gloo / cross:.2f}x")
    return "\n".join(lines)


def startup_report(rows: list[dict]) -> str:
    lines = ["| start-up, 8 ranks | to the last rank past init() (median) | samples |", "|---|---|---|"]
    lines += [f"| {r['kind']} | {r['seconds']:.2f} s | {', '.join(f'{s:.2f}' for s in r['samples'])} |" for r in rows]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------

def machine() -> dict:
    """What the numbers were measured on."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "hvdrun"], capture_output=True,
                           text=True)
    envvars_text = (REPO / "hvdrun" / "envvars.py").read_text()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cores": os.cpu_count(), "cpu": model, "kernel": platform.release(),
            "commit": commit.stdout.strip() + (" (hvdrun/ modified)" if dirty.stdout.strip() else ""),
            # whether this runtime reads HVDRUN_ALGORITHM at all (envvars.py spells every variable it reads)
            "hvdrun_reads_algorithm": '"HVDRUN_ALGORITHM"' in envvars_text,
            # crossovers, eager size and the like, when set here (the jobs inherit them)
            "hvdrun_env": {name: value for name, value in os.environ.items() if name.startswith("HVDRUN_")}}


def other_heavy_jobs() -> list[str]:
    """Test or benchmark processes besides this one (they would share the 2 cores with the measurement)."""
    done = subprocess.run(["pgrep", "-af", "pytest|benchmarks/"], capture_output=True, text=True)
    mine = {str(os.getpid()), str(os.getppid())}
    return [line for line in done.stdout.splitlines() if line.split()[0] not in mine]


def csv_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 2,4,8")
    return values


def csv_sizes(text: str) -> list[int]:
    try:
        return [parse_size(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def csv_configs(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(h), int(r)) for h, _, r in (v.strip().partition("x") for v in text.split(",") if v.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOSTSxRANKS,..., e.g. 4x1,2x2; got {text!r}") from None


def csv_algorithms(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in ALGORITHMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(unknown)}; expected {', '.join(ALGORITHMS)}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=csv_ints, default=[2, 4, 8], help="host counts of the sweep (default 2,4,8)")
    parser.add_argument("--ranks-per-host", type=csv_ints, default=[1, 2], help="ranks on each host (default 1,2)")
    parser.add_argument("--sizes", type=csv_sizes, default=csv_sizes("4K,64K,16M"), help="default 4K,64K,16M")
    parser.add_argument("--algorithms", type=csv_algorithms, default=["auto", "flat"],
                        help=f"hvdrun jobs, one per HVDRUN_ALGORITHM ({', '.join(ALGORITHMS)}); default auto,flat")
    parser.add_argument("--no-mpi", action="store_true", help="leave out the MPI jobs")
    parser.add_argument("--compare-compiled", action="store_true",
                        help="also each algorithm with HVDRUN_COMPILED=off, alternating with it (the compiled "
                             "module's gain)")
    parser.add_argument("--configs", type=csv_configs, help="hosts x ranks to run, e.g. 4x1,2x2 (instead of every "
                        "--hosts with every --ranks-per-host)")
    parser.add_argument("--ucx-tls", default="tcp,self", help="UCX_TLS of the MPI jobs (default tcp,self)")
    parser.add_argument("--mpi-env", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for the MPI jobs, e.g. MPIR_CVAR_POLLS_BEFORE_YIELD=10 (repeatable)")
    parser.add_argument("--no-ssh", action="store_true",
                        help="bare namespace hosts, ranks started into them directly (machines without sshd; "
                        "sweep only)")
    parser.add_argument("--hvdrun-env", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for the hvdrun jobs (repeatable)")
    parser.add_argument("--rounds", "--repeats", type=int, default=3, help="jobs per kind, alternating; medians")
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep (with --loopback / --startup)")
    parser.add_argument("--loopback", action="store_true",
                        help="also: 2 hosts vs loopback TCP vs gloo (sizes: --loopback-sizes)")
    parser.add_argument("--loopback-sizes", default="16M,64M")
    parser.add_argument("--startup", action="store_true", help="also: start-up time of 8 ranks per launcher")
    parser.add_argument("--job-timeout", type=float, default=1200, help="seconds one job may take (default 1200)")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop at the first failed job")
    parser.add_argument("--json", help="also write the raw results here (rewritten after every job)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("multihost.py needs root to create network namespaces")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if max(args.hosts) > 250:
        raise SystemExit("at most 250 namespace hosts")
    if args.no_sweep and not (args.loopback or args.startup):
        raise SystemExit("--no-sweep leaves nothing to run: add --loopback and/or --startup")
    suffixes = ("", f" {COMPILED_OFF}") if args.compare_compiled else ("",)
    kinds = [f"hvdrun {a}{suffix}" for a in args.algorithms for suffix in suffixes] + ([] if args.no_mpi else [MPI])
    if args.configs:
        args.hosts = sorted({hosts for hosts, _ in args.configs})
    if args.no_ssh and (args.loopback or args.startup):
        raise SystemExit("--no-ssh runs the sweep only (--loopback and --startup need sshd hosts)")
    for option, items in (("--mpi-env", args.mpi_env), ("--hvdrun-env", args.hvdrun_env)):
        bad = [item for item in items if "=" not in item or not item.partition("=")[0].isidentifier()]
        if bad:
            raise SystemExit(f"{option}: expected NAME=VALUE, got {', '.join(bad)}")
    args.mpi_env = {"UCX_TLS": args.ucx_tls, **dict(item.partition("=")[::2] for item in args.mpi_env)}
    args.hvdrun_env = dict(item.partition("=")[::2] for item in args.hvdrun_env)
    busy = other_heavy_jobs()
    if busy:
        print("warning: other test or benchmark processes are running; the numbers will be noisy:\n  "
              + "\n  ".join(busy), file=sys.stderr)
    meta = {**machine(), "hosts": args.hosts, "ranks_per_host": args.ranks_per_host, "sizes": args.sizes,
            "rounds": args.rounds, "kinds": kinds, "mpi_env": args.mpi_env,
            # the steady state's steps across hosts in C (hvdrun/runtime/compiled): built and not turned off
            "hvdrun_compiled": (REPO / "hvdrun/runtime/compiled/_uniform_steps.so").exists()
            and {**os.environ, **args.hvdrun_env}.get("HVDRUN_COMPILED", "auto").lower() != "off"}
    output: dict = {"meta": meta}

    def save(runs: list[dict], failures: list[dict]) -> None:
        if args.json:
            output.update(runs=runs, rows=medians(runs), failures=failures)
            Path(args.json).write_text(json.dumps(output, indent=1))

    count = max([*(args.hosts if not args.no_sweep else [1]), 4 if args.startup else 1, 2 if args.loopback else 1])
    directory = Path(f"/tmp/hvdrun-bench-{os.getpid()}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below stops the hosts
    reports = []
    try:
        print(f"starting {count} namespace hosts...", file=sys.stderr, flush=True)
        if args.no_ssh:
            info: dict | netns_direct.BareHosts = netns_direct.start(count, FIXTURE_ENV, directory)
        else:
            info = start_hosts(directory, count)
        if not args.no_sweep:
            runs, failures = sweep(info, args, kinds, save)
            save(runs, failures)
            reports.append(sweep_report(medians(runs), kinds))
            if failures:
                reports.append(f"{len(failures)} job(s) failed: "
                               + "; ".join(f"{f['kind']} on {f['hosts']} x {f['ranks_per_host']}" for f in failures))
        if args.loopback:
            output["loopback"] = loopback_rows(info, args.loopback_sizes, args.rounds)
            reports.append(loopback_report(output["loopback"]))
        if args.startup:
            output["startup"] = startup_rows(info, args.rounds)
            reports.append(startup_report(output["startup"]))
    except JobFailed as e:
        raise SystemExit(str(e)) from e
    finally:
        if args.no_ssh:
            netns_direct.stop(netns_direct.hosts_for(count, FIXTURE_ENV, directory))
            shutil.rmtree(directory, ignore_errors=True)
        else:
            stop_hosts(directory)
        if args.json and len(output) > 1:
            Path(args.json).write_text(json.dumps(output, indent=1))
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
