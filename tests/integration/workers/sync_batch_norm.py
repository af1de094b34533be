"""SyncBatchNorm on shards equals BatchNorm on the full batch: outputs, input gradients, running stats."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.manual_seed(0)
PER_RANK = 4
full = torch.randn(PER_RANK * SIZE, 3, 5, dtype=torch.float64) * 2 + 1
upstream = torch.randn_like(full)
mine = slice(RANK * PER_RANK, (RANK + 1) * PER_RANK)

reference = torch.nn.BatchNorm1d(3).double()
x_full = full.clone().requires_grad_()
out_full = reference(x_full)
(out_full * upstream).sum().backward()  # the sum of every rank's loss

sync = hvd.SyncBatchNorm(3).double()
x = full[mine].clone().requires_grad_()
out = sync(x)
(out * upstream[mine]).sum().backward()

assert torch.allclose(out, out_full[mine], atol=1e-10), "outputs differ"
assert torch.allclose(x.grad, x_full.grad[mine], atol=1e-10), "input gradients differ"
assert torch.allclose(sync.running_mean, reference.running_mean, atol=1e-12)
assert torch.allclose(sync.running_var, reference.running_var, atol=1e-12)
assert torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), reference.weight.grad, atol=1e-10)
assert torch.allclose(hvd.allreduce(sync.bias.grad, op=hvd.Sum), reference.bias.grad, atol=1e-10)
sync.eval()
assert torch.allclose(sync(full[mine]), reference.eval()(full[mine]), atol=1e-10)
print(f"rank {RANK}: sync batch norm ok", flush=True)
hvd.shutdown()
