"""Collectives restricted to process sets: members get the set's result; other ranks are unaffected."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
assert SIZE == 4
evens = hvd.add_process_set([0, 2])
tail = hvd.add_process_set(hvd.ProcessSet([1, 2, 3]))
assert (evens.process_set_id, tail.process_set_id) == (1, 2)
value = torch.tensor([float(RANK + 1)] * 3)


def check(name, got, want):
    assert torch.allclose(got.double(), torch.as_tensor(want).double()), f"{name}: {got} != {want}"


if evens.included():
    check("sum", hvd.allreduce(value, op=hvd.Sum, process_set=evens), [4.0] * 3)          # 1 + 3
    check("average", hvd.allreduce(torch.ones(50_000) * (RANK + 1), process_set=evens), [2.0] * 50_000)
    check("min", hvd.allreduce(value, op=hvd.Min, process_set=evens), [1.0] * 3)
    check("product int", hvd.allreduce(torch.full((2,), RANK + 1), op=hvd.Product, process_set=evens), [3, 3])
    check("allgather", hvd.allgather(torch.full((RANK + 1, 2), RANK), process_set=evens),
          [[0, 0]] + [[2, 2]] * 3)
    check("broadcast", hvd.broadcast(value, root_rank=2, process_set=evens), [3.0] * 3)
if tail.included():
    check("max", hvd.allreduce(value, op=hvd.Max, process_set=tail), [4.0] * 3)
    out, received = hvd.alltoall(torch.arange(3) + 10 * RANK, splits=[1, 1, 1], process_set=tail)
    check("alltoall", out, [10 + tail.rank(), 20 + tail.rank(), 30 + tail.rank()])
    check("alltoall splits", received, [1, 1, 1])
    check("reducescatter", hvd.reducescatter(torch.ones(4, 1), op=hvd.Sum, process_set=tail),
          [[3.0], [3.0]] if tail.rank() == 0 else [[3.0]])
    grad = torch.ones(2, requires_grad=True)
    (hvd.allreduce(grad, op=hvd.Sum, process_set=tail) * (tail.rank() + 1)).sum().backward()
    check("autograd", grad.grad, [6.0, 6.0])                                             # 1 + 2 + 3
    hvd.barrier(process_set=tail)
outside = [s for s in (evens, tail) if not s.included()]
for process_set in outside:  # a rank outside a set cannot use it
    try:
        hvd.allreduce(value, process_set=process_set)
    except ValueError as e:
        assert "is not in ProcessSet" in str(e), e
    else:
        raise AssertionError("an outsider's call must raise")
check("global", hvd.allreduce(value, op=hvd.Sum), [10.0] * 3)                             # everyone still works
assert hvd.remove_process_set(evens) and evens.process_set_id is None
try:
    hvd.allreduce(value, process_set=evens)
except ValueError as e:
    assert "is not registered" in str(e), e
else:
    raise AssertionError("a removed set must be refused")
print(f"rank {RANK}: process sets ok", flush=True)
hvd.shutdown()
