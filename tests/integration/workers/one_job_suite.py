"""Many collective tests in ONE job, as Horovod's CI runs its suite: ``hvdrun -np 2 python -m pytest THIS``.

Tests named ``test_fails_on_purpose_*`` fail on purpose (on every rank, or on one); every other test
must pass on every rank however the ones before it ended. Each test starts at a sync point; a rank
that left a test early waits there for the others, and the deadlock it would otherwise leave behind
is reported by hvdrun instead of hanging the job.
"""

import time

import pytest
import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


@pytest.fixture(autouse=True)
def sync_point(request):
    """Line the ranks up before each test; a rank still inside the previous one (waiting for an op its peer
    skipped by failing) gets a deadlock error there, and both meet again on the next attempt."""
    for attempt in range(3):
        try:
            hvd.barrier()  # the auto-named barriers stay in step: both ranks submit each attempt
            return
        except hvd.HorovodInternalError:
            time.sleep(0.01 * attempt)
    pytest.fail("ranks could not meet before the test")


def test_allreduce_sum():
    assert hvd.allreduce(torch.ones(5) * (RANK + 1), op=hvd.Sum, name="sum").tolist() == [SIZE * (SIZE + 1) / 2] * 5


def test_fails_on_purpose_mismatched_shapes():
    hvd.allreduce(torch.ones(3 + RANK), name="mismatch")


def test_allgather_after_a_mismatch():
    assert hvd.allgather(torch.tensor([RANK]), name="gather").tolist() == list(range(SIZE))


def test_fails_on_purpose_deadlock():
    if RANK == 0:
        hvd.barrier()
    else:
        hvd.allreduce(torch.ones(2), name="never-on-rank-0")


def test_broadcast_after_a_deadlock():
    assert hvd.broadcast(torch.tensor([RANK * 7]), root_rank=1, name="bcast").tolist() == [7]


def test_fails_on_purpose_duplicate_name():
    if RANK != 0:
        hvd.barrier()  # submits 'dup' only once rank 0 has tried it twice: it cannot have finished there
    handle = hvd.allreduce_async(torch.ones(2), name="dup")
    try:
        if RANK == 0:
            hvd.allreduce_async(torch.ones(2), name="dup")
    finally:
        if RANK == 0:
            hvd.barrier()
        hvd.synchronize(handle)


def test_alltoall_after_a_duplicate():
    out = hvd.alltoall(torch.arange(SIZE) + 10 * RANK, name="a2a")
    assert out.tolist() == [10 * r + RANK for r in range(SIZE)]


def test_fails_on_purpose_assertion_on_rank_1_before_an_op():
    assert RANK == 0, "rank 1 leaves this test before the op rank 0 waits in"
    hvd.allreduce(torch.ones(2), name="rank-1-never-comes")


def test_reducescatter_after_a_one_sided_failure():
    out = hvd.reducescatter(torch.ones(2 * SIZE), op=hvd.Sum, name="rs")
    assert out.tolist() == [float(SIZE)] * 2


def test_fails_on_purpose_broadcast_object_with_a_bad_root():
    hvd.broadcast_object("x", root_rank=SIZE + 3, name="bad-root")


@pytest.mark.parametrize("n", range(20))
def test_many_more_collectives(n):
    values = hvd.allreduce(torch.full((n + 1,), float(RANK)), op=hvd.Sum, name=f"many.{n}")
    assert values.tolist() == [float(sum(range(SIZE)))] * (n + 1)
    assert hvd.allgather_object((RANK, n), name=f"many.obj.{n}") == [(r, n) for r in range(SIZE)]
