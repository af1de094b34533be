"""The job ``hvdrun check`` runs on every slot: ``python -m hvdrun.health.check_job [OPTIONS]``.

Each rank: an allreduce whose result is checked element by element; the latency of a small
allreduce and the bus bandwidth of a large one; then, for every ring neighbour pair in turn
(rank r to rank r+1), the bandwidth of that one link, timed as an alltoall in which only r sends
(to r+1). Rank 0 prints one line ``HVDRUN-CHECK-JOB {json}``. A job that outlives
``--deadline-s`` stops itself, naming the phase it was in.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import socket
from typing import Any

from hvdrun.measure.timing import bus_bandwidth, median_seconds

RESULT_TAG = "HVDRUN-CHECK-JOB "
_phase = "start"


def _on_alarm(signum: int, frame: object) -> None:
    raise TimeoutError(f"the check job did not finish within its deadline (phase: {_phase})")


def _set_phase(name: str) -> None:
    global _phase
    _phase = name


def verify_allreduce(hvd: Any, torch: Any, elements: int = 65_537) -> bool:
    """Sum of every rank's ``(rank + 1) * (i % 1000)``: exact in float32, compared element by element."""
    base = torch.arange(elements, dtype=torch.float32) % 1000
    result = hvd.allreduce(base * (hvd.rank() + 1), op=hvd.Sum, name="check.verify")
    size = hvd.size()
    return bool(torch.equal(result, base * (size * (size + 1) // 2)))


def link_seconds(hvd: Any, torch: Any, nbytes: int) -> list[float]:
    """This rank's time for each ring link r -> r+1 (an alltoall where only r sends, to r+1)."""
    size, rank = hvd.size(), hvd.rank()
    elements = max(nbytes // 4, 1)
    times = []
    for src in range(size):
        dst = (src + 1) % size
        splits = [0] * size
        if rank == src:
            splits[dst] = elements
        op = functools.partial(hvd.alltoall, torch.zeros(sum(splits), dtype=torch.float32), splits=splits,
                               name=f"check.link.{src}")
        times.append(median_seconds(op, hvd.barrier, repeats=3, batch=1, warmup=1))
    return times


def run(latency_bytes: int, bandwidth_bytes: int, link_bytes: int) -> dict[str, Any] | None:
    """Every measurement; rank 0 returns the results, the others None."""
    import torch

    import hvdrun.torch as hvd

    _set_phase("init")
    hvd.init()
    size = hvd.size()
    _set_phase("allreduce verification")
    verified = verify_allreduce(hvd, torch)
    hosts = hvd.allgather_object(socket.gethostname(), name="check.hosts")
    bad = [r for r, ok in enumerate(hvd.allgather_object(verified, name="check.verified")) if not ok]
    _set_phase(f"latency at {latency_bytes} bytes")
    small = torch.zeros(max(latency_bytes // 4, 1))
    latency = median_seconds(lambda: hvd.allreduce_(small, op=hvd.Sum, name="check.latency"), hvd.barrier,
                             repeats=7, batch=100, warmup=10)
    _set_phase(f"bandwidth at {bandwidth_bytes} bytes")
    bandwidth_s = median_seconds(functools.partial(hvd.allreduce_, torch.zeros(max(bandwidth_bytes // 4, 1)),
                                                   op=hvd.Sum, name="check.bandwidth"),
                                 hvd.barrier, repeats=3, batch=1, warmup=1)
    _set_phase("ring links")
    per_rank = hvd.allgather_object(link_seconds(hvd, torch, link_bytes) if size > 1 else [], name="check.links")
    result = None
    if hvd.rank() == 0:
        links = [{"src": src, "dst": (src + 1) % size, "src_host": hosts[src], "dst_host": hosts[(src + 1) % size],
                  "bytes": link_bytes, "seconds": max(per_rank[src][src], per_rank[(src + 1) % size][src])}
                 for src in range(size)] if size > 1 else []
        result = {"ranks": size, "hosts": hosts, "verified": not bad, "wrong_ranks": bad,
                  "latency_bytes": latency_bytes, "latency_s": latency, "bandwidth_bytes": bandwidth_bytes,
                  "bandwidth_s": bandwidth_s, "bus_bandwidth": bus_bandwidth(bandwidth_bytes, bandwidth_s, size),
                  "links": links}
    hvd.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    """Run the check job on this rank."""
    parser = argparse.ArgumentParser(prog="python -m hvdrun.health.check_job")
    parser.add_argument("--latency-bytes", type=int, default=4 << 10)
    parser.add_argument("--bandwidth-bytes", type=int, default=64 << 20)
    parser.add_argument("--link-bytes", type=int, default=16 << 20)
    parser.add_argument("--deadline-s", type=int, default=300)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(args.deadline_s)
    result = run(args.latency_bytes, args.bandwidth_bytes, args.link_bytes)
    signal.alarm(0)
    if result is not None:
        print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
