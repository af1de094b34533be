"""The job ``hvdrun bench`` runs: ``python -m hvdrun.bench.bench_job --libraries L --sizes S``.

Libraries are timed one after the other in the same processes, so they see the same hosts, the
same placement and the same moment: ``hvdrun`` (this runtime's allreduce, in place, sum),
``gloo`` (torch.distributed's, on the same env:// rendezvous a torchrun script uses) and
``mpi`` (mpi4py's ``Allreduce``, in a job that mpiexec started). Every op is an in-place sum of
float32 zeros; a size's time is :func:`hvdrun.measure.timing.median_seconds` with
:func:`hvdrun.measure.timing.batch_plan`'s batch length. Rank 0 prints one line per library and
size: ``HVDRUN-BENCH {"library", "ranks", "bytes", "seconds"}``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from hvdrun.measure.timing import batch_plan, median_seconds

RESULT_TAG = "HVDRUN-BENCH "
LIBRARIES = ("hvdrun", "gloo", "mpi")


def _report(rank: int, library: str, size: int, nbytes: int, seconds: float) -> None:
    if rank == 0:
        print(RESULT_TAG + json.dumps({"library": library, "ranks": size, "bytes": nbytes, "seconds": seconds}),
              flush=True)


def _sweep(rank: int, size: int, library: str, sizes: list[int], iterations: int, warmup: int,
           make: Callable[[int], Callable[[], Any]], barrier: Callable[[], Any]) -> None:
    for nbytes in sizes:
        _, batch = batch_plan(nbytes, slow=library == "gloo")
        seconds = median_seconds(make(nbytes), barrier, repeats=iterations, batch=batch, warmup=warmup)
        _report(rank, library, size, nbytes, seconds)


def bench_hvdrun(sizes: list[int], iterations: int, warmup: int) -> None:
    """hvdrun's allreduce over every size."""
    import torch

    import hvdrun.torch as hvd

    hvd.init()

    def make(nbytes: int) -> Callable[[], Any]:
        tensor = torch.zeros(max(nbytes // 4, 1))
        return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=f"bench.{nbytes}")

    _sweep(hvd.rank(), hvd.size(), "hvdrun", sizes, iterations, warmup, make, hvd.barrier)
    hvd.shutdown()


def bench_gloo(sizes: list[int], iterations: int, warmup: int) -> None:
    """torch.distributed gloo's allreduce over every size (env:// rendezvous)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")

    def make(nbytes: int) -> Callable[[], Any]:
        tensor = torch.zeros(max(nbytes // 4, 1))
        return lambda: dist.all_reduce(tensor)

    _sweep(dist.get_rank(), dist.get_world_size(), "gloo", sizes, iterations, warmup, make, dist.barrier)
    dist.barrier()
    dist.destroy_process_group()  # gloo aborts at exit without it


def bench_mpi(sizes: list[int], iterations: int, warmup: int) -> None:
    """MPI's allreduce (mpi4py, in place) over every size."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def make(nbytes: int) -> Callable[[], Any]:
        array = np.zeros(max(nbytes // 4, 1), np.float32)
        return lambda: comm.Allreduce(MPI.IN_PLACE, array)

    _sweep(comm.rank, comm.size, "mpi", sizes, iterations, warmup, make, comm.Barrier)


RUNNERS = {"hvdrun": bench_hvdrun, "gloo": bench_gloo, "mpi": bench_mpi}


def main(argv: list[str] | None = None) -> None:
    """Time every library named, in order."""
    parser = argparse.ArgumentParser(prog="python -m hvdrun.bench.bench_job")
    parser.add_argument("--libraries", default="hvdrun,gloo")
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    for library in args.libraries.split(","):
        RUNNERS[library](sizes, args.iterations, args.warmup)


if __name__ == "__main__":
    main()
