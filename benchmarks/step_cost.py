"""Where a small allreduce across hosts spends its time: the model's gamma taken apart (#34 point 2).

    python benchmarks/step_cost.py              # 4 KB, 20,000 steps and swaps, 3,000 allreduces, 5 rounds
    python benchmarks/step_cost.py --bytes 65536

Four figures, each a mean over many, their medians over ``--rounds`` (this VM's times vary from run to run by
up to 2x), on this machine:

1. **Python per doubling step**: one step of the steady state's merge (a uniform range's value encoded, swapped,
   decoded and merged with the partner's, ``hvdrun.runtime.announcements``), against in-memory channels: every
   line of hvdrun's Python a step runs, no system call.
2. **The transport's floor**: two processes swapping a frame of the same size over loopback TCP with bare
   blocking sockets (the least any step over TCP costs here: two system calls and a wake-up).
3. **hvdrun's whole allreduce**: two ranks given host names of their own (so they connect by TCP, as across
   hosts), ``hvd.allreduce_`` of a float32 tensor of that size, rank 0's time per op, on the pure-Python path
   (``HVDRUN_COMPILED=off``).
4. **The same with the compiled steps** (``HVDRUN_COMPILED=on``), when the module is built (``make compiled``).

What is left of (3) beyond one step's (1) + (2) is hvdrun's Python per *op* (the express cycle, the held
requests' bookkeeping, the torch API); of (4) beyond (2), the Python the compiled call leaves around the step.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from hvdrun.runtime.announcements import CODEC, Announcements, Uniform  # noqa: E402
from hvdrun.runtime.collectives.streams import swap_small  # noqa: E402
from hvdrun.runtime.compiled import load  # noqa: E402
from hvdrun.runtime.negotiation import Request  # noqa: E402
from hvdrun.runtime.reduce import padded  # noqa: E402
from hvdrun.runtime.transport.channels import AbortFlag, RxChannel, TxChannel, Waiter  # noqa: E402
from hvdrun.runtime.transport.tcp import tune  # noqa: E402

RANK = textwrap.dedent("""
    import sys, time, torch
    import hvdrun.torch as hvd
    hvd.init()
    tensor, ops = torch.ones(int(sys.argv[1]) // 4), int(sys.argv[2])
    for _ in range(200):
        hvd.allreduce_(tensor, name="step", op=hvd.Sum)
    hvd.barrier()
    started = time.perf_counter()
    for _ in range(ops):
        hvd.allreduce_(tensor, name="step", op=hvd.Sum)
    if hvd.rank() == 0:
        print((time.perf_counter() - started) / ops)
    hvd.shutdown()
""")


class _Sink(TxChannel):
    """Takes every byte at once."""

    def send_some(self, data: memoryview) -> int:
        return len(data)

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [], []


class _Replay(RxChannel):
    """Holds one framed message, as if the partner's had just arrived."""

    def __init__(self, frame: bytearray) -> None:
        self.frame, self.at = memoryview(frame), 0

    def peek(self, limit: int) -> memoryview:
        return self.frame[self.at:self.at + limit]

    def consume(self, count: int) -> None:
        self.at += count

    def read_into(self, dst: memoryview) -> int:
        raise NotImplementedError

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [], []


class _Merging:
    merges = True


def framed(length: int) -> bytearray:
    """A message of ``length`` bytes as it travels: its length, itself, padding to 8 (zeros)."""
    frame = bytearray(8 + padded(length))
    frame[:8] = length.to_bytes(8, "little")
    return frame


def python_per_step(nbytes: int, steps: int) -> float:
    """Seconds of Python in one doubling step of a uniform value of ``nbytes`` (no system call)."""
    request = Request("step", "allreduce", "float32", (nbytes // 4,))
    announcements = Announcements(_Merging(), 0, 2, lambda key: request.wire())  # type: ignore[arg-type]
    data = np.ones(nbytes // 4, np.float32).tobytes()
    mine, theirs = Uniform(7, 0, 0, data), Uniform(7, 1, 1, data)
    message = CODEC.dumps(theirs)
    frame = framed(len(message))
    frame[8:8 + len(message)] = message
    tx, waiter, dumps, loads = _Sink(), Waiter(None, AbortFlag()), CODEC.dumps, CODEC.loads
    started = time.perf_counter()
    for _ in range(steps):
        other = loads(swap_small(tx, _Replay(frame), waiter, dumps(mine)))
        announcements._merge(mine, other)
    return (time.perf_counter() - started) / steps


def bare_socket_swap(nbytes: int, swaps: int) -> float:
    """Seconds per swap of a frame of ``nbytes`` between two processes over loopback TCP, blocking sockets."""
    frame = bytes(framed(nbytes + 32))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        pid = os.fork()
        if pid == 0:
            with socket.create_connection(listener.getsockname()) as sock:
                _swaps(sock, frame, swaps + 100)
            os._exit(0)
        sock, _ = listener.accept()
    with sock:
        _swaps(sock, frame, 100)
        started = time.perf_counter()
        _swaps(sock, frame, swaps)
        seconds = (time.perf_counter() - started) / swaps
    os.waitpid(pid, 0)
    return seconds


def _swaps(sock: socket.socket, frame: bytes, count: int) -> None:
    tune(sock)
    sock.setblocking(True)
    into = memoryview(bytearray(len(frame)))
    for _ in range(count):
        sock.sendall(frame)
        got = 0
        while got < len(frame):
            got += sock.recv_into(into[got:])


def hvdrun_allreduce(nbytes: int, ops: int, compiled: str) -> float:
    """Rank 0's seconds per ``hvd.allreduce_`` of ``nbytes`` between two ranks on hosts of their own names, with
    ``HVDRUN_COMPILED=compiled``."""
    from hvdrun.envvars import Rendezvous, worker_env
    from hvdrun.hosts import Host
    from hvdrun.launch.remote.hostfacts import free_ports
    from hvdrun.ranks import assign_slots

    rendezvous = Rendezvous("127.0.0.1", *free_ports(2), uuid.uuid4().hex, "step" + uuid.uuid4().hex[:6])
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(nbytes), str(ops)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **worker_env(slot, rendezvous), "OMP_NUM_THREADS": "1",
                                   "HVDRUN_COMPILED": compiled})
             for slot in assign_slots([Host("node0", 1), Host("node1", 1)], 2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[proc.returncode for proc in procs]}")
    return float(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=4096, help="the allreduce's size (default 4096)")
    parser.add_argument("--steps", type=int, default=20000, help="steps and swaps timed (default 20,000)")
    parser.add_argument("--ops", type=int, default=3000, help="allreduces timed (default 3,000)")
    parser.add_argument("--rounds", type=int, default=5, help="each figure's median over this many runs (default 5)")
    args = parser.parse_args()
    built = load({"HVDRUN_COMPILED": "auto"}) is not None
    runs = [(python_per_step(args.bytes, args.steps), bare_socket_swap(args.bytes, args.steps),
             hvdrun_allreduce(args.bytes, args.ops, "off"),
             hvdrun_allreduce(args.bytes, args.ops, "on") if built else math.nan)
            for _ in range(args.rounds)]  # interleaved: drifts hit all of them
    step, floor, python, compiled = (statistics.median(run[i] for run in runs) for i in range(4))
    rows = [("(1) hvdrun's Python in one doubling step (no system call)", step),
            ("(2) a swap over loopback TCP, bare blocking sockets", floor),
            ("(3) hvdrun allreduce, 2 ranks on hosts of their own (one step), pure Python", python),
            ("left for hvdrun's Python per op: (3) - (1) - (2)", python - step - floor)]
    if built:
        rows += [("(4) the same with the compiled steps (hvdrun/runtime/compiled)", compiled),
                 ("left for hvdrun's Python per op there: (4) - (2)", compiled - floor)]
    print(f"Medians of {args.rounds} rounds:\n\n| {args.bytes:,} B | µs |\n|---|---|\n"
          + "\n".join(f"| {label} | {seconds * 1e6:.1f} |" for label, seconds in rows)
          + ("" if built else "\n\n(4): the compiled module is not built (make compiled)"))

if __name__ == "__main__":
    main()
