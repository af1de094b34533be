"""Rank 2 is late: it sits in ``slow_data_loader`` until the file named by argv[1] exists, while the other
ranks wait in the allreduce 'grad.fc2' (for the stacks, stall and divergence reports).

Until every rank is ready, each prints a line a second: an --idle-timeout test's clock must not run while torch
imports and init() connects, which take seconds on loaded cores."""

import os
import sys
import threading
import time

print("starting", flush=True)
READY = threading.Event()


def keep_talking_until_ready() -> None:
    while not READY.wait(1.0):
        print("still loading", flush=True)


threading.Thread(target=keep_talking_until_ready, daemon=True).start()

import torch  # noqa: E402

import hvdrun.torch as hvd  # noqa: E402


def slow_data_loader(release: str) -> None:
    while not os.path.exists(release):
        time.sleep(0.05)  # the line the reports name


def main() -> None:
    hvd.init()
    data = torch.ones(1000)
    for step in range(3):
        hvd.allreduce(data, name=f"grad.step{step}")
    READY.set()
    print("ready", flush=True)
    if hvd.rank() == 2:
        slow_data_loader(sys.argv[1])
    wall, cpu = time.monotonic(), time.process_time()
    total = hvd.allreduce(data, name="grad.fc2", op=hvd.Sum)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    print(f"done {float(total[0])}", flush=True)
    print(f"rank {hvd.rank()} waited {wall:.2f} s using {cpu:.2f} s of CPU", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
