"""Start-up of torch training ranks: ``hvdrun --preload auto`` against ``--preload none``, torchrun and mpiexec,
in the same run.

    python benchmarks/preload.py                              # 2,4,8 ranks on this machine, 2 rounds
    python benchmarks/preload.py --ranks 2,4,8,16 --rounds 3 --json benchmarks/results/preload-2core.json

Every kind runs the same rank: import torch, build a model and an SGD optimizer, take one step (which imports
``torch._dynamo``), print the time since the command started; the torchrun and mpiexec ranks do the same with
``torch.distributed`` (gloo) / mpi4py in place of ``hvdrun.torch``. For each kind and rank count: seconds from
the command's start to the last rank past its first step, and the CPU seconds of the whole command (this process's
children's user + system time: every rank, guard and server is waited for by its parent). The table gives the
medians over rounds and each launcher over ``hvdrun --preload auto``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import _bin, _run  # noqa: E402 - the benchmarks' own helpers

REPO = Path(__file__).resolve().parent.parent
STEP = """
import torch
model = torch.nn.Linear(64, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4, 64)).sum().backward()
opt.step()
"""
HVDRUN_WORKER = """
import os, time
import torch
import hvdrun.torch as hvd
hvd.init()
""" + STEP + """
hvd.allreduce(torch.ones(1), name="past")
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
"""
TORCHRUN_WORKER = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
""" + STEP + """
dist.all_reduce(torch.ones(1))
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
dist.destroy_process_group()
"""
MPI_WORKER = """
import os, time
from mpi4py import MPI
import torch
""" + STEP + """
MPI.COMM_WORLD.Barrier()
print(f"PAST_INIT {time.time() - float(os.environ['BENCH_T0']):.3f}", flush=True)
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``argv``: (seconds to the last rank past its first step, CPU seconds of the whole command)."""
    cpu = _children_cpu_s()
    past = _run(argv, env)[1]  # the ranks print startup.py's PAST_INIT marker, here past their first step
    if past is None:
        raise RuntimeError(f"no rank printed PAST_INIT: {argv}")
    return past, _children_cpu_s() - cpu


def kinds(workdir: Path) -> dict[str, Callable[[int], tuple[float, float]]]:
    """Each measured kind: a function of the rank count that returns (seconds, CPU seconds)."""
    scripts = {name: workdir / f"{name}.py" for name in ("hvdrun_worker", "torchrun_worker", "mpi_worker")}
    for name, text in zip(scripts, (HVDRUN_WORKER, TORCHRUN_WORKER, MPI_WORKER), strict=True):
        scripts[name].write_text(text)
    hvdrun, torchrun, mpiexec = _bin("hvdrun"), _bin("torchrun"), _bin("mpiexec")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    hvd = str(scripts["hvdrun_worker"])
    return {
        "hvdrun --preload auto": lambda n: measure([hvdrun, "-np", str(n), "--preload", "auto", hvd], env),
        "hvdrun --preload none": lambda n: measure([hvdrun, "-np", str(n), "--preload", "none", hvd], env),
        "torchrun": lambda n: measure([torchrun, "--standalone", f"--nproc-per-node={n}",
                                       str(scripts["torchrun_worker"])], env),
        "mpiexec": lambda n: measure([mpiexec, "-n", str(n), sys.executable, str(scripts["mpi_worker"])], env),
    }


def table(counts: list[int], times: dict[tuple[str, int], list[tuple[float, float]]], names: list[str]) -> str:
    """Markdown: median seconds and CPU seconds per kind and rank count, and each over ``--preload auto``."""
    base = names[0]
    lines = ["| | " + " | ".join(f"{n} ranks" for n in counts) + " |", "|---" * (len(counts) + 1) + "|"]
    for name in names:
        cells = []
        for n in counts:
            wall = statistics.median(t[0] for t in times[(name, n)])
            cpu = statistics.median(t[1] for t in times[(name, n)])
            base_wall = statistics.median(t[0] for t in times[(base, n)])
            cells.append(f"{wall:.2f} s ({wall / base_wall:.2f}x), {cpu:.1f} CPU-s")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8", help="local rank counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="keep every measurement here")
    args = parser.parse_args()
    counts = [int(word) for word in args.ranks.split(",") if word]
    meta = {"machine": f"{platform.node()} {os.cpu_count()} CPUs", "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    results: list[dict[str, object]] = []
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hvdrun-preload-") as tmp:
        measured = kinds(Path(tmp))
        names = list(measured)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for count in counts:
                for name in order:
                    wall, cpu = measured[name](count)
                    times.setdefault((name, count), []).append((wall, cpu))
                    results.append({"kind": name, "ranks": count, "round": round_index, "seconds": wall,
                                    "cpu_seconds": cpu})
                    print(f"  round {round_index + 1}: {name:>22} N={count:<3} {wall:6.2f} s {cpu:6.1f} CPU-s",
                          flush=True)
                    if args.json:
                        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(table(counts, times, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
