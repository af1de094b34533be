"""op=hvd.Adasum against a NumPy reference: allreduce, grouped_allreduce, prescale, and DistributedOptimizer."""

import numpy as np
import torch
from adasum_reference import reference

import hvdrun.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(1234)
data = [rng.standard_normal((3, 5)) for _ in range(size)]          # every rank knows every rank's input
mine = torch.tensor(data[rank], dtype=torch.float64)

out = hvd.allreduce(mine, op=hvd.Adasum, name="adasum.single")
assert np.allclose(out.numpy().ravel(), reference(data), rtol=1e-12, atol=1e-12), "allreduce"
assert torch.equal(mine, torch.tensor(data[rank])), "the input is untouched"
print(f"rank {rank}: adasum allreduce max |diff| {np.abs(out.numpy().ravel() - reference(data)).max():.2e}")

floats = torch.tensor(data[rank], dtype=torch.float32)
hvd.allreduce_(floats, op=hvd.Adasum, name="adasum.inplace", prescale_factor=2.0, postscale_factor=0.5)
assert np.allclose(floats.numpy().ravel(), reference([2 * d for d in data]) * 0.5, rtol=1e-5, atol=1e-6), "scaled"

second = [rng.standard_normal(7) for _ in range(size)]
group = hvd.grouped_allreduce([mine, torch.tensor(second[rank])], op=hvd.Adasum, name="adasum.group")
assert np.allclose(group[0].numpy().ravel(), reference(data)) and np.allclose(group[1].numpy(), reference(second))
handle = hvd.allreduce_async(torch.tensor(second[rank]), op=hvd.Adasum, name="adasum.async")
assert np.allclose(hvd.synchronize(handle).numpy(), reference(second)), "async"
zeros = hvd.allreduce(torch.zeros(4, dtype=torch.float64) if rank else torch.ones(4, dtype=torch.float64),
                      op=hvd.Adasum, name="adasum.zeros")
assert torch.equal(zeros, torch.ones(4, dtype=torch.float64)), "a zero vector keeps coefficient 1"

for call in (lambda: hvd.reducescatter(torch.ones(size * 2), op=hvd.Adasum),):
    try:
        call()
    except RuntimeError as e:
        print(f"rank {rank}: reducescatter refused: {e}")
    else:
        raise AssertionError("reducescatter(op=Adasum) did not raise")

# DistributedOptimizer: every rank steps on its own gradient; the parameter changes combine with Adasum
torch.manual_seed(0)
model = torch.nn.Linear(4, 2, dtype=torch.float64)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
inputs = [rng.standard_normal((6, 4)) for _ in range(size)]
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=hvd.Adasum)
optimizer.zero_grad()
model(torch.tensor(inputs[rank])).pow(2).sum().backward()
optimizer.step()
for name, param in model.named_parameters():
    deltas = []
    for r in range(size):  # what rank r's local SGD step changed (the same model, rank r's inputs)
        local = torch.nn.Linear(4, 2, dtype=torch.float64)
        local.load_state_dict({k: torch.tensor(v) for k, v in start.items()})
        local(torch.tensor(inputs[r])).pow(2).sum().backward()
        deltas.append(-0.1 * dict(local.named_parameters())[name].grad.numpy())
    expected = start[name].ravel() + reference(deltas)
    assert np.allclose(param.detach().numpy().ravel(), expected, rtol=1e-12, atol=1e-12), name
try:
    optimizer.skip_synchronize()
except AssertionError:
    pass
else:
    raise AssertionError("skip_synchronize with Adasum did not raise")
print(f"rank {rank}: adasum ok", flush=True)
hvd.shutdown()
