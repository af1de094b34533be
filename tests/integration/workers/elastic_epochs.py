"""An elastic training counted in epochs, for the scenario tests (tests/integration/test_elastic_scenarios.py).

Every epoch is a few small batches, each followed by a commit. At the end of an epoch rank 0 appends
one JSON line to ``--log``: the epoch, its host, the rank this worker had when it started, its rank
and the world size now, and how many rounds the training has been through. The tests' discovery
script counts those lines to know the epoch, so a ``--hosts-by-epoch`` schedule changes the hosts
between epochs; when the next epoch's hosts differ, every rank keeps checking for the launcher's
host update before training on (so each epoch runs on the hosts the schedule gives it).

Arguments:
    --log FILE: the per-epoch lines.  --epochs N, --batches N: the training's length.
    --hosts-by-epoch JSON: ``[[epoch or null, ["host:slots", ...]], ...]``; null is every other epoch.
    --fail JSON: ``{"EPOCH,BATCH": [start ranks]}``: those workers fail before that batch,
        by ``--fail-mode exception`` (an uncaught RuntimeError) or ``kill`` (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import hvdrun.torch as hvd

START_RANK = int(os.environ["HVDRUN_RANK"])  # the rank given at start (the environment follows later rounds)
HOSTNAME = os.environ["HVDRUN_HOSTNAME"]
UPDATE_CHECKS = 400  # x 0.05 s: how long the ranks wait for an expected host update


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--hosts-by-epoch", default="[]")
    parser.add_argument("--fail", default="{}")
    parser.add_argument("--fail-mode", choices=["exception", "kill"], default="exception")
    return parser.parse_args()


def hosts_of(schedule: list, epoch: int) -> list[str]:
    """The hosts the schedule gives ``epoch``."""
    listed = {when: hosts for when, hosts in schedule}
    return listed.get(epoch, listed.get(None, []))


def main() -> None:
    args = parse_args()
    schedule, failures = json.loads(args.hosts_by_epoch), json.loads(args.fail)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, rounds=0)

    def maybe_fail() -> None:
        if START_RANK not in failures.get(f"{state.epoch},{state.batch}", []):
            return
        print(f"start rank {START_RANK} fails at epoch {state.epoch} batch {state.batch}", flush=True)
        if args.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"scheduled failure of start rank {START_RANK}")

    def wait_for_host_update() -> None:
        for _ in range(UPDATE_CHECKS):  # every rank checks together (the answer is broadcast from rank 0)
            time.sleep(0.05)
            state.check_host_updates()
        raise TimeoutError(f"no host update before epoch {state.epoch}")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        state.rounds += 1
        while state.epoch < args.epochs:
            while state.batch < args.batches:
                maybe_fail()
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.batch += 1
                state.commit()
            if hvd.rank() == 0:
                line = {"epoch": state.epoch, "hostname": HOSTNAME, "start_rank": START_RANK, "rank": hvd.rank(),
                        "size": hvd.size(), "rounds": state.rounds}
                with open(args.log, "a") as log:
                    log.write(json.dumps(line) + "\n")
            changing = hosts_of(schedule, state.epoch) != hosts_of(schedule, state.epoch + 1)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()
            if changing and state.epoch < args.epochs:
                wait_for_host_update()

    train(state)
    hvd.shutdown()


if __name__ == "__main__":
    main()
