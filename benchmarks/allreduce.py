"""Allreduce: hvdrun's ring vs torch.distributed gloo vs MPI (mpi4py + mpich), in one run.

    python benchmarks/allreduce.py                 # 2 and 4 ranks, 4 KB .. 256 MB
    python benchmarks/allreduce.py --ranks 2 --sizes 4K,64M --json out.json

Each library runs as its own job on this machine (hvdrun and gloo started by ``hvdrun``, MPI by
the mpich wheel's ``mpiexec``), in-place float32 sum of zeros, rank 0 timing. A size's time is
the median over repeats of (batch time / batch length), batches of back-to-back ops (1000 for
small sizes; 100 for gloo, 25x slower there); bus bandwidth is ``bytes / time * 2 (N - 1) / N``,
the traffic each rank's link carries in a ring. The last columns time one op right after a barrier and
2 ms of computation (a training step's pattern), median of 200 (10 above 1 MB). Every library runs
``--rounds`` jobs (3), alternating with the others so that the host's drifts hit all of them; the
table gives the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from hvdrun.measure.timing import after_pause_seconds, batch_plan, median_seconds
from hvdrun.measure.timing import bus_bandwidth as ring_bus_bandwidth

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}
LIBRARIES = ("hvdrun", "gloo", "mpi")


def measure(allreduce, barrier, nbytes: int, library: str) -> float:  # noqa: ANN001 - the libraries' callables
    """Median of batch means, batches as long as :func:`hvdrun.measure.timing.batch_plan` says."""
    repeats, batch = batch_plan(nbytes, slow=library == "gloo")
    return median_seconds(allreduce, barrier, repeats, batch)


def worker(library: str, sizes: list[int]) -> None:
    """Run inside a job: time every size, rank 0 prints one JSON line per size."""
    import numpy as np

    if library == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.rank, comm.size
        barrier = comm.Barrier
        make = lambda n: (lambda a=np.zeros(n // 4, np.float32): comm.Allreduce(MPI.IN_PLACE, a))  # noqa: E731, B008
    else:
        import torch

        if library == "gloo":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method="env://")
            rank, size = dist.get_rank(), dist.get_world_size()
            barrier = dist.barrier
            make = lambda n: (lambda t=torch.zeros(n // 4): dist.all_reduce(t))  # noqa: E731, B008
        else:
            import hvdrun.torch as hvd

            hvd.init()
            rank, size = hvd.rank(), hvd.size()
            barrier = hvd.barrier
            make = lambda n: (lambda t=torch.zeros(n // 4): hvd.allreduce_(t, op=hvd.Sum, name=f"b{n}"))  # noqa
    for nbytes in sizes:
        op = make(nbytes)
        seconds = measure(op, barrier, nbytes, library)
        paused = after_pause_seconds(op, barrier, 200 if nbytes <= (1 << 20) else 10)
        if rank == 0:
            print("RESULT " + json.dumps({"library": library, "ranks": size, "bytes": nbytes, "seconds": seconds,
                                          "after_pause": paused}), flush=True)
    barrier()
    if library == "gloo":
        dist.destroy_process_group()  # gloo aborts at exit without it
    elif library == "hvdrun":
        hvd.shutdown()


def run_job(library: str, ranks: int, sizes: list[int]) -> list[dict]:
    """Start one library's job and collect rank 0's results."""
    here = str(Path(__file__).resolve())
    args = [here, "--worker", library, "--sizes", ",".join(str(s) for s in sizes)]
    bindir = Path(sys.executable).parent
    if library == "mpi":
        mpiexec = bindir / "mpiexec" if (bindir / "mpiexec").exists() else shutil.which("mpiexec")
        command = [str(mpiexec), "-n", str(ranks), sys.executable, *args]
    else:
        command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), "--no-prefix", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{library} with {ranks} ranks failed:\n{done.stderr[-3000:]}")
    return [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]


def medians(runs: list[dict]) -> list[dict]:
    """One row per library, ranks and size: the median of the rounds' times (each itself a median)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["library"], run["ranks"], run["bytes"]), []).append(run)
    return [{"library": library, "ranks": ranks, "bytes": nbytes, "rounds": len(group),
             "seconds": statistics.median(r["seconds"] for r in group),
             "after_pause": statistics.median(r["after_pause"] for r in group)}
            for (library, ranks, nbytes), group in groups.items()]


def bus_bandwidth(row: dict) -> float:
    """GB/s carried by each rank's ring link."""
    return ring_bus_bandwidth(row["bytes"], row["seconds"], row["ranks"]) / 1e9


def human(nbytes: int) -> str:
    return next(f"{nbytes // v} {u}" for v, u in ((1 << 20, "MB"), (1 << 10, "KB"), (1, "B")) if nbytes >= v)


def table(rows: list[dict]) -> str:
    """Markdown: per ranks and size, time and bus bandwidth of each library, and hvdrun's ratios."""
    lines = ["| ranks | size | hvdrun time | hvdrun busbw | gloo time | gloo busbw | MPI time | MPI busbw "
             "| hvdrun/gloo | hvdrun/MPI | after a 2 ms pause: hvdrun / gloo / MPI | after a pause: hvdrun/MPI |",
             "|" + "---|" * 12]
    index = {(r["library"], r["ranks"], r["bytes"]): r for r in rows}
    for ranks, nbytes in sorted({(r["ranks"], r["bytes"]) for r in rows}):
        cells = [str(ranks), human(nbytes)]
        bw = {}
        for library in LIBRARIES:
            row = index.get((library, ranks, nbytes))
            if row is None:
                cells += ["-", "-"]
                continue
            bw[library] = bus_bandwidth(row)
            cells += [f"{row['seconds'] * 1e6:,.1f} µs", f"{bw[library]:.2f} GB/s"]
        for other in ("gloo", "mpi"):
            cells.append(f"{bw['hvdrun'] / bw[other]:.2f}x" if "hvdrun" in bw and other in bw else "-")
        paused = [index.get((library, ranks, nbytes), {}).get("after_pause") for library in LIBRARIES]
        cells.append(" / ".join(f"{p * 1e6:,.1f} µs" if p else "-" for p in paused))
        cells.append(f"{paused[2] / paused[0]:.2f}x" if paused[0] and paused[2] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--sizes", default=",".join(SIZES), help="sizes: 4K,64K,1M,16M,64M,256M or bytes")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--rounds", type=int, default=3, help="jobs per library, alternating; medians reported")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [SIZES[s] if s in SIZES else int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes)
        return
    runs = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for round_index in range(args.rounds):  # libraries alternate, so the host's drifts hit them alike
            for library in args.libraries.split(","):
                print(f"running {library} with {ranks} ranks (round {round_index + 1} of {args.rounds})...",
                      file=sys.stderr, flush=True)
                runs += run_job(library, ranks, sizes)
    rows = medians(runs)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
