"""Horovod's duplicate-name test (test_torch.py's shape) 50 times in one job, each followed by its tearDown
(barrier, shutdown) and a test that must pass; then 50 times back to back in one init (a name reused while the
rank's last op of that name finished during its barrier); then a stray op (submitted by rank 1 only) that the
tearDown's shutdown reports and clears, with the tests after it passing on every rank."""

import torch

import hvdrun.torch as hvd


def teardown() -> None:
    hvd.barrier()
    hvd.shutdown()


def duplicate_name_test(rank: int) -> str:
    tensor = torch.zeros(17, 17, 17)
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            hvd.allreduce_async(tensor, name="duplicate_name")
            try:
                hvd.allreduce_async(tensor, name="duplicate_name")
                return "hvd.allreduce_async did not throw error"
            except ValueError:
                pass
        hvd.barrier()
    return "ok"


def a_test_after(rank: int = 0) -> str:
    summed = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    gathered = hvd.allgather(torch.tensor([hvd.rank()]))
    sent = hvd.broadcast(torch.tensor([hvd.rank() + 5]), root_rank=1)
    return "ok" if (summed.tolist(), gathered.tolist(), sent.tolist()) == ([2.0] * 3, [0, 1], [6]) else "wrong"


outcomes: dict[str, int] = {}
for _ in range(50):
    hvd.init()
    rank = hvd.rank()
    for test in (duplicate_name_test, a_test_after):
        try:
            outcome = test(rank)
        except Exception as e:  # noqa: BLE001 - counted and shown, as pytest would
            outcome = f"{type(e).__name__}: {e}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        teardown()
        hvd.init()
print(f"rank {rank} outcomes {outcomes}", flush=True)

back_to_back: dict[str, int] = {}
for _ in range(50):
    outcome = duplicate_name_test(rank)
    back_to_back[outcome] = back_to_back.get(outcome, 0) + 1
print(f"rank {rank} back to back {back_to_back}", flush=True)

if rank == 1:  # a failed test's stray op: the other rank never submits it
    hvd.allreduce_async(torch.ones(2), name="stray")
teardown()
hvd.init()
print(f"rank {rank} after the stray: {a_test_after()}", flush=True)
teardown()
