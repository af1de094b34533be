"""The device path's fusion, on CPU tensors sent through it (gloo in NCCL's place), checked against results worked
out on every rank without communication, and its collectives counted by a process group that counts.

argv[1]: the fusion threshold the job was given (HOROVOD_FUSION_THRESHOLD), in bytes. Prints ``CHECK name rank R:
ok`` (or what differed) for each check, and ``COUNT name rank R: N`` for the counted collectives.
"""

import sys

import torch

import hvdrun.torch as hvd
from hvdrun.envvars import OVERLAP
from hvdrun.runtime import context
from hvdrun.torch import buckets

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
THRESHOLD = int(sys.argv[1])


class CountingGroup:
    """A process group that counts the collectives called on it and passes them on to the real one."""

    COUNTED = ("allreduce", "broadcast", "allgather", "alltoall_base", "reduce_scatter")

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name not in self.COUNTED:
            return attribute

        def counted(*args, **kwargs):
            self.calls += 1
            return attribute(*args, **kwargs)
        return counted


def counting_group():
    """Wrap the device path's job-wide process group (made by the first device op) in a counting one."""
    device = context.current().device
    hvd.allreduce(torch.zeros(1), name="make.the.group")
    torch_group = device.group
    if not isinstance(torch_group.group, CountingGroup):
        torch_group.group = CountingGroup(torch_group.group)
    return torch_group.group


COUNTER = counting_group()


def counted(function):
    """``function()``'s result and the collectives it ran on the job's process group."""
    before = COUNTER.calls
    result = function()
    return result, COUNTER.calls - before


def check(name, ok, detail=""):
    print(f"CHECK {name} rank {RANK}: {'ok' if ok else 'differs ' + detail}", flush=True)


class Mixed(torch.nn.Module):
    """Parameters of two dtypes (float32 and float64), 40 tensors of 1-32 KB, and one frozen."""

    def __init__(self):
        super().__init__()
        self.singles = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(64 + 61 * i)) for i in range(20))
        self.doubles = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(32 + 97 * i, dtype=torch.float64))
                                              for i in range(20))
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        total = sum((w[:4] * x).sum() for w in self.singles)
        return total + sum((w[:4].float() * x).sum() for w in self.doubles) + sum(w.sum() for w in self.singles)


def data_of(rank, step, micro):
    return torch.linspace(-1, 1, 4) * (rank + 1) + step + 0.5 * micro


def expected_grads(trained, step, passes):
    """The average over ranks of every rank's gradient, worked out here for every rank's data (on a copy without
    the optimizer's hooks)."""
    model = Mixed()
    model.load_state_dict(trained.state_dict())
    total = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    for rank in range(SIZE):
        model.zero_grad()
        for micro in range(passes):
            (model(data_of(rank, step, micro)) / passes).backward()
        for acc, p in zip(total, [p for p in model.parameters() if p.requires_grad], strict=True):
            acc += p.grad
    model.zero_grad()
    return [t / SIZE for t in total]


def train_and_compare(label, overlap, compression, passes):
    import os

    os.environ[OVERLAP] = overlap
    torch.manual_seed(0)
    model = Mixed()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(), compression=compression,
                                         backward_passes_per_step=passes)
    worst, calls, during_backward = 0.0, [], []
    for step in range(3):
        wanted = expected_grads(model, step, passes)
        optimizer.zero_grad()
        before = COUNTER.calls
        for micro in range(passes):
            (model(data_of(RANK, step, micro)) / passes).backward()
        during_backward.append(all(bucket.handle is not None for bucket in optimizer._buckets.buckets))
        optimizer.synchronize()
        calls.append(COUNTER.calls - before)
        got = [p.grad for p in model.parameters() if p.requires_grad]
        worst = max(worst, max(float((g - w).abs().max() / (w.abs().max() + 1e-12)) for g, w in zip(got, wanted,
                                                                                                      strict=True)))
        with optimizer.skip_synchronize():
            optimizer.step()
    tolerance = 2e-3 if compression is hvd.Compression.fp16 else 1e-6
    check(label, worst <= tolerance, f"by {worst:.2e} (relative)")
    params = [p for p in model.parameters() if p.requires_grad]
    fp16 = compression is hvd.Compression.fp16
    by_dtype = {}
    for param in params:
        dtype = buckets.wire_dtype(param, fp16)
        by_dtype[dtype] = by_dtype.get(dtype, 0) + param.numel() * dtype.itemsize
    most = sum(-(-nbytes // THRESHOLD) for nbytes in by_dtype.values())  # ceil(bytes / threshold) a dtype
    if overlap == "1":  # every bucket went out during backward, with Python hooks (step 0) and fast ones after
        check(f"{label}.buckets-out-during-backward", all(during_backward), str(during_backward))
        layout = buckets.build(params, lambda p: "x", fp16, THRESHOLD)
        check(f"{label}.one-collective-a-bucket", calls == [len(layout)] * 3 and len(layout) <= most,
              f"{calls} for {len(layout)} buckets, at most {most}")
    else:  # all at step(), flattened: one a dtype
        check(f"{label}.one-collective-a-dtype", calls == [len(by_dtype)] * 3, f"{calls} for {len(by_dtype)} dtypes")
    print(f"COUNT {label} rank {RANK}: {calls[-1]}", flush=True)


def second_backward_before_step_raises():
    """A second backward before step() (one pass a step) is refused, with the fast hooks as with Python ones, and
    training goes on after the step."""
    import os

    os.environ[OVERLAP] = "1"
    model = Mixed()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    raised = []
    for step in range(3):  # step 0 learns backward's order; then the fast hooks
        optimizer.zero_grad()
        model(data_of(RANK, step, 0)).backward()
        try:
            model(data_of(RANK, step, 1)).backward()
        except AssertionError as e:
            raised.append("backward_passes_per_step" in str(e))
        optimizer.step()
    check("second-backward-refused", raised == [True] * 3, str(raised))


def backward_order_that_changes_is_learned_again():
    """A model whose forward uses its parameters in another order from step 3 on: the bucket learned in the first
    order waits for synchronize() once (its last member came early), then the order is learned again and the
    bucket goes out during backward; every step's gradients are right."""
    import os

    os.environ[OVERLAP] = "1"

    class Swapping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8) * 2)
            self.swap = False

        def forward(self, x):
            first, second = (self.b, self.a) if self.swap else (self.a, self.b)
            return ((first * x).sum() * 3 + second.sum()) * (second * x).sum()

    model = Swapping()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters())
    during, right = [], []
    for step in range(6):
        model.swap = step >= 3
        optimizer.zero_grad()
        model(data_of(RANK, step, 0)[:1].repeat(8)).backward()
        during.append(all(bucket.handle is not None for bucket in optimizer._buckets.buckets))
        optimizer.synchronize()
        grads = [p.grad.clone() for p in (model.a, model.b)]
        wanted = [torch.zeros(8), torch.zeros(8)]
        for rank in range(SIZE):
            copy = Swapping()
            copy.load_state_dict(model.state_dict())
            copy.swap = model.swap
            copy(data_of(rank, step, 0)[:1].repeat(8)).backward()
            wanted = [w + p.grad / SIZE for w, p in zip(wanted, (copy.a, copy.b), strict=True)]
        right.append(all(torch.allclose(g, w) for g, w in zip(grads, wanted, strict=True)))
        with optimizer.skip_synchronize():
            optimizer.step()
    check("order-change.relearned", during == [True, True, True, False, True, True], str(during))
    check("order-change.gradients", all(right), str(right))


second_backward_before_step_raises()
backward_order_that_changes_is_learned_again()
for overlap in ("1", "0"):
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        for passes in (1, 2):
            name = f"optimizer.overlap{overlap}.{compression.__name__}.passes{passes}"
            train_and_compare(name, overlap, compression, passes)

# many async allreduces submitted before any wait: fused (bit-exact integer sums, float sums within rounding)
ints = [torch.arange(n, dtype=torch.int64) * (RANK + 1) for n in range(1, 60)]
floats = [torch.linspace(0, 1, n) * (RANK + 1) for n in range(1, 60)]
handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"many.{i}") for i, t in enumerate(ints + floats)]
for handle in handles:
    hvd.synchronize(handle)
factor = SIZE * (SIZE + 1) // 2
check("async.int-sums-exact", all(torch.equal(t, torch.arange(t.numel(), dtype=torch.int64) * factor) for t in ints))
check("async.float-sums", all(torch.allclose(t, torch.linspace(0, 1, t.numel()) * factor) for t in floats))

# a grouped allreduce is one collective (its tensors share a dtype); Average scaled in the fused buffer
group = [torch.full((n,), float(RANK)) for n in (5, 17, 300)]
_, calls = counted(lambda: hvd.grouped_allreduce_(group, name="grouped", op=hvd.Average, prescale_factor=2.0,
                                                   postscale_factor=0.5))
check("grouped.average-scaled", all(torch.allclose(t, torch.full_like(t, (SIZE - 1) / 2)) for t in group))
check("grouped.one-collective", calls == 1, f"{calls} collectives")

# a grouped allgather of tensors of several dtypes and shapes, rows differing by rank (none on rank 0 for one of
# them): one collective
parts = [torch.full((RANK + 1, 2), float(RANK)), torch.arange(RANK * 3, dtype=torch.int64),
         torch.full((1, 2, 2), RANK, dtype=torch.int16)]
gathered, calls = counted(lambda: hvd.grouped_allgather(parts, name="gathered"))
wanted = [torch.cat([torch.full((r + 1, 2), float(r)) for r in range(SIZE)]),
          torch.cat([torch.arange(r * 3, dtype=torch.int64) for r in range(SIZE)]),
          torch.cat([torch.full((1, 2, 2), r, dtype=torch.int16) for r in range(SIZE)])]
check("grouped-allgather.values", all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(gathered, wanted,
                                                                                              strict=True)))
check("grouped-allgather.one-collective", calls == 1, f"{calls} collectives")

# broadcast_parameters of 200 tensors of mixed dtypes: a few collectives, root's values everywhere
state = {f"t{i:03d}": torch.full((1 + i % 7,), float(RANK + i), dtype=(torch.float32, torch.int32,
                                                                           torch.float64)[i % 3])
         for i in range(200)}
_, calls = counted(lambda: hvd.broadcast_parameters(state, root_rank=SIZE - 1))
check("broadcast-parameters.values", all(torch.equal(t, torch.full_like(t, SIZE - 1 + int(k[1:])))
                                         for k, t in state.items()))
check("broadcast-parameters.few-collectives", calls <= 3, f"{calls} collectives")
print(f"COUNT broadcast-parameters rank {RANK}: {calls}", flush=True)

# within a process set: the set's own group, Average by the set's size; the next global op works
evens = hvd.add_process_set(list(range(0, SIZE, 2)))
if RANK % 2 == 0:
    pieces = [torch.full((4,), float(RANK)), torch.full((9,), float(RANK))]
    handles = [hvd.allreduce_async_(t, name=f"set.{i}", process_set=evens) for i, t in enumerate(pieces)]
    for handle in handles:
        hvd.synchronize(handle)
    members = list(range(0, SIZE, 2))
    check("process-set.average", all(torch.allclose(t, torch.full_like(t, sum(members) / len(members)))
                                     for t in pieces))
after = hvd.allreduce(torch.ones(3), name="after.sets", op=hvd.Sum)
check("after-process-set.global", torch.equal(after, torch.full((3,), float(SIZE))))
hvd.shutdown()
