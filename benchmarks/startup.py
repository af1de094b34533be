"""Start-up time at scale: ``hvdrun -np N`` against ``mpiexec -n N`` on this machine, in the same run.

    python benchmarks/startup.py                                  # 4,16,64,256 local ranks, 1 round
    python benchmarks/startup.py --ranks 4,16,32,64,128,256 --rounds 2 --json benchmarks/results/startup.json
    python benchmarks/startup.py --ranks 16 --rounds 1            # smoke

For every rank count N, each round runs (order rotating from round to round):

- ``hvdrun``: ``hvdrun -np N`` of a rank that imports ``hvdrun.runtime``, calls ``init()``, prints the time
  and calls ``shutdown()`` (no torch): seconds from starting hvdrun to the last rank past ``init()``;
- ``mpiexec``: the mpich wheel's ``mpiexec -n N`` of a rank that imports ``mpi4py`` (``MPI_Init``) and passes
  a barrier: seconds to the last rank past the barrier;
- ``import``: ``mpiexec -n N python -c 'from hvdrun.runtime import init'`` (what the interpreters and our imports
  cost alone, whole command);
- ``hvdrun true`` / ``mpiexec true``: the launchers alone, starting N ``true`` (whole command).

The table gives the median over rounds and hvdrun's time over mpiexec's. ``--hosts`` adds the same
measure across network-namespace hosts (real sshd, ``--launcher ssh``, 2 ranks per host by default;
needs root): seconds from ``hvdrun`` to the last rank past ``init()``. ``--json`` keeps every number, the
input of ``benchmarks/scaling.py --startup``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600

RUNTIME_WORKER = """
import os, time
import hvdrun.runtime as runtime
runtime.init()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
runtime.shutdown()
"""
MPI_WORKER = """
import os, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
"""


def _bin(name: str) -> str:
    """``name`` from this interpreter's environment (the venv), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float | None]:
    """Run ``argv``; (seconds for the whole command, seconds to the last ``PAST_INIT`` line or None)."""
    env = dict(env or os.environ)
    start = time.time()
    env["BENCH_T0"] = repr(start)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    whole = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    past = [float(line.split()[-1]) for line in done.stdout.splitlines() if "PAST_INIT" in line]
    return whole, (max(past) if past else None)


def local_kinds(workdir: Path) -> dict[str, Callable[[int], float]]:
    """Each measured kind: a function of the rank count that returns its seconds."""
    runtime_py, mpi_py = workdir / "runtime_worker.py", workdir / "mpi_worker.py"
    runtime_py.write_text(RUNTIME_WORKER)
    mpi_py.write_text(MPI_WORKER)
    hvdrun, mpiexec, python = _bin("hvdrun"), _bin("mpiexec"), sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def past_init(argv: list[str]) -> float:
        seconds = _run(argv, env)[1]
        assert seconds is not None, f"no rank printed PAST_INIT: {argv}"
        return seconds

    return {
        "hvdrun": lambda n: past_init([hvdrun, "-np", str(n), str(runtime_py)]),
        "mpiexec": lambda n: past_init([mpiexec, "-n", str(n), python, str(mpi_py)]),
        "import": lambda n: _run([mpiexec, "-n", str(n), python, "-c", "from hvdrun.runtime import init"], env)[0],
        "hvdrun true": lambda n: _run([hvdrun, "-np", str(n), "true"], env)[0],
        "mpiexec true": lambda n: _run([mpiexec, "-n", str(n), "true"], env)[0],
    }


def sweep(counts: list[int], rounds: int, kinds: dict[str, Callable[[int], float]],
          record: Callable[[dict[str, object]], None]) -> dict[tuple[str, int], list[float]]:
    """Every kind at every count, ``rounds`` times, the order of kinds rotating from round to round."""
    names = list(kinds)
    times: dict[tuple[str, int], list[float]] = {}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for count in counts:
            for name in order:
                seconds = kinds[name](count)
                times.setdefault((name, count), []).append(seconds)
                record({"kind": name, "ranks": count, "round": round_index, "seconds": seconds})
                print(f"  round {round_index + 1}: {name:>13} N={count:<4} {seconds:7.2f} s", flush=True)
    return times


def table(counts: list[int], times: dict[tuple[str, int], list[float]], names: list[str]) -> str:
    """Markdown: medians per kind and rank count, plus hvdrun / mpiexec."""
    head = "| | " + " | ".join(str(n) for n in counts) + " |"
    lines = [head, "|---" * (len(counts) + 1) + "|"]
    for name in names:
        cells = [f"{statistics.median(times[(name, n)]):.2f} s" if (name, n) in times else "" for n in counts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for top, bottom in (("hvdrun", "mpiexec"), ("hvdrun true", "mpiexec true")):
        cells = [f"{statistics.median(times[(top, n)]) / statistics.median(times[(bottom, n)]):.2f}x"
                 if (top, n) in times and (bottom, n) in times else "" for n in counts]
        lines.append(f"| {top} / {bottom} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,16,64,256", help="local rank counts")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kinds", default="", help="comma-separated subset of the kinds (default: all)")
    parser.add_argument("--hosts", default="", help="namespace host counts, e.g. 2,8,32 (needs root)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--json", type=Path, help="keep every measurement here")
    args = parser.parse_args()
    counts = [int(word) for word in args.ranks.split(",") if word]
    results: list[dict[str, object]] = []
    meta = {"machine": f"{platform.node()} {os.cpu_count()} CPUs", "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}

    def record(entry: dict[str, object]) -> None:
        results.append(entry)
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    with tempfile.TemporaryDirectory(prefix="hvdrun-startup-") as tmp:
        kinds = local_kinds(Path(tmp))
        if args.kinds:
            kinds = {name: kinds[name] for name in args.kinds.split(",")}
        print(f"local ranks {counts}, {args.rounds} round(s), {meta['machine']}")
        times = sweep(counts, args.rounds, kinds, record)
        print(table(counts, times, list(kinds)))
        if args.hosts:
            from hosts_startup import measure_hosts  # noqa: PLC0415 - only with --hosts (root, sshd)
            measure_hosts([int(w) for w in args.hosts.split(",")], args.ranks_per_host, args.rounds, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
