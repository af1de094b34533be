"""GPU paths: device pinning, and hvdrun's allreduce on CUDA tensors vs torch.distributed NCCL, in one run.

    python benchmarks/gpu.py                      # every rank count the GPUs allow, 4 KB .. 256 MB
    python benchmarks/gpu.py --ranks 1 --sizes 4K,64M
    python benchmarks/gpu.py --cpu --ranks 1,2 --sizes 4K,64K   # no GPU: the same path on CPU tensors, gloo

Needs CUDA. Each rank count runs two jobs under ``hvdrun --gpus-per-node G``: one times
``hvd.allreduce_`` on a CUDA tensor (hvdrun's device path: negotiation by the engine, execution
on a NCCL process group), one times ``dist.all_reduce`` on a NCCL group that the same script
builds from hvdrun's torchrun variables (env://). Each rank first reports what pinning gave it
(``CUDA_VISIBLE_DEVICES``, the device it sees) so a wrong pin shows in the table. Times are
rank 0's median of batch means, synchronised with ``torch.cuda.synchronize()``.

``--cpu`` measures the same device path where there is no GPU: CPU tensors sent through it
(``HVDRUN_CPU_VIA_DEVICE_BACKEND=1`` on a gloo group) against ``dist.all_reduce`` on gloo; the
difference is hvdrun's Python in front of the process group (negotiation, express cycle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hvdrun.measure.timing import batch_plan, median_seconds, parse_size

LIBRARIES = ("hvdrun", "nccl")


def worker(library: str, sizes: list[int]) -> None:
    """Inside a job: report the pin, check one sum, time every size (rank 0 prints JSON lines)."""
    import torch
    import torch.distributed as dist

    device = os.environ.get("BENCH_DEVICE", "cuda")
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":  # torchrun's idiom: every rank sees its node's GPUs, its own is device LOCAL_RANK
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if library == "nccl":
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://")
        rank, size = dist.get_rank(), dist.get_world_size()
        allreduce, barrier = dist.all_reduce, dist.barrier
    else:
        import hvdrun.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        allreduce = lambda t: hvd.allreduce_(t, op=hvd.Sum, name=f"b{t.numel()}")  # noqa: E731
        barrier = hvd.barrier
    if device == "cuda":
        current = torch.cuda.current_device()
        pin = {"rank": rank, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
               "current": current, "name": torch.cuda.get_device_name(current)}
        print("PIN " + json.dumps(pin), flush=True)
    check = torch.full((1000,), float(rank + 1), device=device)
    allreduce(check)
    synchronize()
    expected = size * (size + 1) / 2
    if not torch.all(check == expected):
        raise SystemExit(f"rank {rank}: sum {check[0].item()} != {expected}")
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, device=device)

        def one(t: torch.Tensor = tensor) -> None:
            allreduce(t)
            synchronize()

        repeats, batch = batch_plan(nbytes, slow=False)
        seconds = median_seconds(one, barrier, repeats, batch)
        if rank == 0:
            print("RESULT " + json.dumps({"library": library, "ranks": size, "bytes": nbytes, "seconds": seconds}),
                  flush=True)
    barrier()
    if library == "nccl":
        dist.destroy_process_group()
    else:
        hvd.shutdown()


CPU_DEVICE_PATH = {"BENCH_DEVICE": "cpu", "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1", "HVDRUN_DEVICE_BACKEND": "gloo"}


def run_job(library: str, ranks: int, sizes: list[int], cpu: bool = False) -> tuple[list[dict], list[dict]]:
    """One job: rank 0's results and every rank's pin report (``cpu``: the device path on CPU tensors)."""
    args = [str(Path(__file__).resolve()), "--worker", library, "--sizes", ",".join(map(str, sizes))]
    pinning = [] if cpu else ["--gpus-per-node", str(ranks)]
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), *pinning, "--no-prefix", *args]
    env = {**os.environ, **(CPU_DEVICE_PATH if cpu else {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{library} with {ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    lines = done.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    return results, [json.loads(line[4:]) for line in lines if line.startswith("PIN ")]


def table(rows: list[dict]) -> str:
    """Markdown: per ranks and size, each library's time and hvdrun's ratio to NCCL."""
    index = {(r["library"], r["ranks"], r["bytes"]): r["seconds"] for r in rows}
    lines = ["| ranks | size | hvdrun | NCCL | NCCL time / hvdrun time |", "|---|---|---|---|---|"]
    for ranks, nbytes in sorted({(r["ranks"], r["bytes"]) for r in rows}):
        ours, theirs = index.get(("hvdrun", ranks, nbytes)), index.get(("nccl", ranks, nbytes))
        cells = [str(ranks), f"{nbytes >> 10} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB"]
        cells += [f"{s * 1e6:,.1f} µs" if s else "-" for s in (ours, theirs)]
        cells.append(f"{theirs / ours:.2f}x" if ours and theirs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_case(runs: list[dict]) -> dict[tuple, list[dict]]:
    cases: dict[tuple, list[dict]] = {}
    for run in runs:
        cases.setdefault((run["library"], run["ranks"], run["bytes"]), []).append(run)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", help="comma-separated rank counts (default: 1 .. the GPUs there are)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M", help="sizes: 4096, 4K, 64M, 1G")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--cpu", action="store_true", help="no GPU: the device path on CPU tensors against gloo")
    parser.add_argument("--rounds", type=int, default=1, help="jobs per library, alternating; medians reported")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        return worker(args.worker, sizes)
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0 and not args.cpu:
        raise SystemExit("no CUDA device: this benchmark measures the GPU paths (--cpu: the same path on CPU)")
    rank_counts = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(1, max(gpus, 1) + 1))
    runs, pins = [], []
    for _ in range(args.rounds):
        for ranks in rank_counts:
            for library in LIBRARIES:
                print(f"running {library} with {ranks} ranks...", file=sys.stderr, flush=True)
                results, pinned = run_job(library, ranks, sizes, args.cpu)
                runs += results
                pins += [{"library": library, "ranks": ranks, **p} for p in pinned]
    rows = [{**group[0], "seconds": statistics.median(r["seconds"] for r in group)}
            for group in _by_case(runs).values()]
    if args.cpu:
        print(f"CPU tensors through the device path (gloo), torch {torch.__version__}, {os.cpu_count()} cores; "
              "the NCCL column is torch.distributed gloo\n")
    else:
        print(f"GPU: {torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}\n")
    for pin in pins:
        print(f"pin: {pin['library']} np={pin['ranks']} rank {pin['rank']}: CUDA_VISIBLE_DEVICES={pin['visible']} "
              f"sees {pin['count']} x {pin['name']}, current device {pin.get('current', 0)}")
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "pins": pins}, indent=1))


if __name__ == "__main__":
    main()
