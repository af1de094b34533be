"""Ranks with less data join early: they contribute zeros to the others' allreduces until all joined."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
for step in range(RANK + 1):  # rank r has r + 1 batches
    total = hvd.allreduce(torch.full((3,), float(RANK + 1)), op=hvd.Sum, name=f"sum.{step}")
    mean = hvd.allreduce(torch.full((100_000,), float(RANK + 1)), name=f"mean.{step}")  # ring path, not eager
    contributors = [r + 1 for r in range(SIZE) if r >= step]  # ranks that still have a batch at this step
    assert total.tolist() == [float(sum(contributors))] * 3, (step, total)
    assert torch.allclose(mean, torch.full((100_000,), sum(contributors) / SIZE)), (step, mean[:3])
last = hvd.join()
assert last == SIZE - 1, last  # the rank with the most batches joined last
print(f"rank {RANK}: join returned {last}", flush=True)

if RANK == 0:
    hvd.join()  # joins at once; the others' allgather cannot include it
else:
    try:
        hvd.allgather(torch.ones(1), name="needs_everyone")
    except hvd.HorovodInternalError as e:
        print(f"rank {RANK} raised: {e}", flush=True)
    hvd.join()
print(f"rank {RANK}: join ok", flush=True)

# Horovod's test_horovod_join_allgather: the same with an unnamed allgather, whose automatic name the joined
# rank never took; the next unnamed ops must still pair up on every rank
for _ in range(2):
    if RANK == 0:
        hvd.join()
    else:
        try:
            hvd.allgather(torch.ones(1))
        except RuntimeError as e:  # Horovod's test catches (torch.FatalError, RuntimeError)
            print(f"rank {RANK} raised for an unnamed allgather: {e}", flush=True)
        else:
            raise AssertionError("the allgather naming a joined rank did not fail")
        hvd.join()
# two unnamed allgathers in flight at once, neither taken by the joined rank: both fail, both numbers come back
# (whatever order their failures arrive in), and the next unnamed ops still pair up
if RANK == 0:
    hvd.join()
else:
    # an unnamed allreduce the joined rank takes part in with zeros: its number is used on every rank
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == SIZE - 1
    handles = [hvd.allgather_async(torch.ones(1)) for _ in range(2)]
    for handle in handles:
        try:
            hvd.synchronize(handle)
        except RuntimeError as e:
            print(f"rank {RANK} raised for an async unnamed allgather: {e}", flush=True)
        else:
            raise AssertionError("the async allgather naming a joined rank did not fail")
    hvd.join()
gathered = hvd.allgather(torch.full((1,), float(RANK)))
assert gathered.tolist() == [float(r) for r in range(SIZE)], gathered
summed = hvd.allreduce(torch.ones(1), op=hvd.Sum)
assert summed.item() == SIZE, summed
print(f"rank {RANK}: unnamed ops in step after join", flush=True)
hvd.shutdown()
