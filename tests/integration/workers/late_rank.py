"""Rank 2 is late: it sits in ``slow_data_loader`` until the file named by argv[1] exists, while the other
ranks wait in the allreduce 'grad.fc2' (for the stacks, stall and divergence reports)."""

import os
import sys
import time

print("starting", flush=True)  # output keeps an --idle-timeout test's clock from running during the imports

import torch  # noqa: E402

import hvdrun.torch as hvd  # noqa: E402


def slow_data_loader(release: str) -> None:
    while not os.path.exists(release):
        time.sleep(0.05)


def main() -> None:
    print("imported", flush=True)  # and again after them: importing torch takes seconds on loaded cores
    hvd.init()
    data = torch.ones(1000)
    for step in range(3):
        hvd.allreduce(data, name=f"grad.step{step}")
    print("ready", flush=True)
    if hvd.rank() == 2:
        slow_data_loader(sys.argv[1])
    total = hvd.allreduce(data, name="grad.fc2", op=hvd.Sum)
    print(f"done {float(total[0])}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
