"""GPU paths: device pinning, hvdrun's allreduce on CUDA tensors vs torch.distributed NCCL, and training with
DistributedOptimizer vs DDP, each in one run.

    python benchmarks/gpu.py                      # every rank count the GPUs allow, 4 KB .. 256 MB
    python benchmarks/gpu.py --ranks 1 --sizes 4K,64M
    python benchmarks/gpu.py --cpu --ranks 2 --sizes 4K,64K   # no GPU: the same path on CPU tensors, gloo
    python benchmarks/gpu.py --training           # DistributedOptimizer vs DDP (NCCL), every rank count

Needs CUDA (``--xpu --training``: Intel GPUs). Each rank count runs one job under ``hvdrun --gpus-per-node G`` that
times, in turn and ``--rounds`` times over, ``hvd.allreduce_`` on a CUDA tensor (hvdrun's device path: negotiation
by the engine, execution on its NCCL process group), that same process group called directly, and
``dist.all_reduce`` on the NCCL group the script builds from hvdrun's torchrun variables (env://). Each rank first
reports what pinning gave it (``CUDA_VISIBLE_DEVICES``, the device it sees) so a wrong pin shows in the table.
Times are rank 0's median of batch means, synchronised with ``torch.cuda.synchronize()``.

``--cpu`` measures the same device path where there is no GPU: CPU tensors sent through it
(``HVDRUN_CPU_VIA_DEVICE_BACKEND=1`` on a gloo group) against the group and ``dist.all_reduce`` on gloo; the
difference is hvdrun's Python in front of the process group (negotiation, express cycle).

``--training`` runs ``benchmarks/training.py --device cuda`` for a ResNet-like model and a many-tensor one at
every rank count from 2: DDP and two DistributedOptimizers (overlap on and off) in one job, ratios to DDP.
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

LIBRARIES = ("hvdrun", "group", "torch")


def _timed_ops(device: str, hvd: object) -> dict[str, object]:
    """Each library's in-place sum of a tensor: ``hvd.allreduce_`` (the engine's negotiation, then the device
    path's process group), that same process group called directly, and ``dist.all_reduce`` on the job's
    torch.distributed group (env://, the backend DDP would use)."""
    import torch.distributed as dist

    from hvdrun.runtime import context
    from hvdrun.runtime.reduce import SUM

    def group_op(t: object) -> None:  # the device path's own group, without hvdrun's engine in front
        device_path = context.current().device
        assert device_path is not None
        device_path.group.allreduce(t, SUM)

    return {"hvdrun": lambda t: hvd.allreduce_(t, op=hvd.Sum, name=f"b{t.numel()}"),  # type: ignore[attr-defined]
            "group": group_op, "torch": dist.all_reduce}


def worker(sizes: list[int], rounds: int) -> None:
    """Inside a job: report the pin, check one sum per library, then time every size with each library in turn,
    ``rounds`` times (rank 0 prints JSON lines)."""
    import torch
    import torch.distributed as dist

    import hvdrun.torch as hvd

    device = os.environ.get("BENCH_DEVICE", "cuda")
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    hvd.init()
    if device == "cuda":  # torchrun's idiom: every rank sees its node's GPUs, its own is device LOCAL_RANK
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://")
    rank, size = hvd.rank(), hvd.size()
    if device == "cuda":
        current = torch.cuda.current_device()
        pin = {"rank": rank, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
               "current": current, "name": torch.cuda.get_device_name(current)}
        print("PIN " + json.dumps(pin), flush=True)
    ops = _timed_ops(device, hvd)
    for library, allreduce in ops.items():
        check = torch.full((1000,), float(rank + 1), device=device)
        allreduce(check)
        synchronize()
        if not torch.all(check == size * (size + 1) / 2):
            raise SystemExit(f"rank {rank}: {library} sum {check[0].item()} != {size * (size + 1) / 2}")
    for _ in range(rounds):
        for nbytes in sizes:
            tensor = torch.zeros(nbytes // 4, device=device)
            for library, allreduce in ops.items():
                def one(t: torch.Tensor = tensor, op: object = allreduce) -> None:
                    op(t)  # type: ignore[operator]
                    synchronize()

                repeats, batch = batch_plan(nbytes, slow=device == "cpu")
                seconds = median_seconds(one, hvd.barrier, repeats, batch)
                if rank == 0:
                    print("RESULT " + json.dumps({"library": library, "ranks": size, "bytes": nbytes,
                                                  "seconds": seconds}), flush=True)
    hvd.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


CPU_DEVICE_PATH = {"BENCH_DEVICE": "cpu", "HVDRUN_CPU_VIA_DEVICE_BACKEND": "1", "HVDRUN_DEVICE_BACKEND": "gloo"}


def run_job(ranks: int, sizes: list[int], rounds: int, cpu: bool = False) -> tuple[list[dict], list[dict]]:
    """One job timing every library: rank 0's results and every rank's pin report (``cpu``: the device path on
    CPU tensors)."""
    args = [str(Path(__file__).resolve()), "--worker", "--sizes", ",".join(map(str, sizes)), "--rounds", str(rounds)]
    pinning = [] if cpu else ["--gpus-per-node", str(ranks)]
    command = [sys.executable, "-m", "hvdrun", "-np", str(ranks), *pinning, "--no-prefix", *args]
    env = {**os.environ, **(CPU_DEVICE_PATH if cpu else {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    lines = done.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    return results, [json.loads(line[4:]) for line in lines if line.startswith("PIN ")]


def table(rows: list[dict], backend: str) -> str:
    """Markdown: per ranks and size, each library's time and hvdrun's time over the others'."""
    index = {(r["library"], r["ranks"], r["bytes"]): r["seconds"] for r in rows}
    lines = [f"| ranks | size | hvd.allreduce_ | its {backend} group directly | dist.all_reduce ({backend}) "
             "| hvdrun / group | hvdrun / dist |", "|---|---|---|---|---|---|---|"]
    for ranks, nbytes in sorted({(r["ranks"], r["bytes"]) for r in rows}):
        ours, group, theirs = (index.get((library, ranks, nbytes)) for library in LIBRARIES)
        cells = [str(ranks), f"{nbytes >> 10} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB"]
        cells += [f"{s * 1e6:,.1f} µs" if s else "-" for s in (ours, group, theirs)]
        cells += [f"{ours / other:.2f}x" if ours and other else "-" for other in (group, theirs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_case(runs: list[dict]) -> dict[tuple, list[dict]]:
    cases: dict[tuple, list[dict]] = {}
    for run in runs:
        cases.setdefault((run["library"], run["ranks"], run["bytes"]), []).append(run)
    return cases


def training(rank_counts: list[int], args: argparse.Namespace) -> None:
    """DistributedOptimizer against DDP on the GPUs (NCCL; XCCL on Intel GPUs), with overlap on and off, for a
    ResNet-like model and a many-tensor one, at every rank count: ``benchmarks/training.py`` on the device."""
    import training as bench  # benchmarks/training.py, beside this file

    device = "xpu" if args.xpu else "cuda"
    print(bench.TABLE_HEAD)
    for ranks in rank_counts:
        for model in ("resnet", "many-small"):
            options = argparse.Namespace(steps=args.steps, warmup=5, batch_size=32, rounds=args.rounds, model=model,
                                         overlap="both", device=device, device_path=False)
            print(bench.table_rows(bench.run_job(ranks, options), options), flush=True)


def collectives(rank_counts: list[int], sizes: list[int], args: argparse.Namespace) -> None:
    """hvd.allreduce_ on device tensors against its process group and torch.distributed, at every rank count."""
    import torch

    runs, pins = [], []
    for ranks in rank_counts:
        print(f"timing {', '.join(LIBRARIES)} with {ranks} ranks...", file=sys.stderr, flush=True)
        results, pinned = run_job(ranks, sizes, args.rounds, args.cpu)
        runs += results
        pins += [{"ranks": ranks, **p} for p in pinned]
    rows = [{**group[0], "seconds": statistics.median(r["seconds"] for r in group)}
            for group in _by_case(runs).values()]
    if args.cpu:
        print(f"CPU tensors through the device path (gloo), torch {torch.__version__}, {os.cpu_count()} cores\n")
    else:
        print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}\n")
    for pin in pins:
        print(f"pin: np={pin['ranks']} rank {pin['rank']}: CUDA_VISIBLE_DEVICES={pin['visible']} "
              f"sees {pin['count']} x {pin['name']}, current device {pin.get('current', 0)}")
    print()
    print(table(rows, "gloo" if args.cpu else "NCCL"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "pins": pins}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", help="comma-separated rank counts (default: 1 .. the GPUs there are)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M", help="sizes: 4096, 4K, 64M, 1G")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--cpu", action="store_true", help="no GPU: the device path on CPU tensors against gloo")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every library in one job")
    parser.add_argument("--training", action="store_true",
                        help="DistributedOptimizer vs DDP on the GPUs (a ResNet-like and a many-tensor model)")
    parser.add_argument("--xpu", action="store_true", help="with --training: Intel GPUs (XCCL) instead of CUDA")
    parser.add_argument("--steps", type=int, default=60, help="with --training: measured steps per mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        return worker(sizes, args.rounds)
    import torch

    gpus = torch.xpu.device_count() if args.xpu else torch.cuda.device_count()
    if gpus == 0 and not args.cpu:
        raise SystemExit("no GPU: this benchmark measures the GPU paths (--cpu: the same path on CPU tensors)")
    rank_counts = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(1, max(gpus, 1) + 1))
    if args.training:
        return training([r for r in rank_counts if r > 1] or [1], args)
    return collectives(rank_counts, sizes, args)


if __name__ == "__main__":
    main()
