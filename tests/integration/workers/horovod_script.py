# A training script written for Horovod; the test runs it with only the import line changed.
import argparse
import warnings

import torch
import torch.nn.functional as F
import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
if hvd.nccl_built() and torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())
torch.set_num_threads(1)

data = torch.randn(256, 10)
labels = (data.sum(1) > 0).long()
sampler = torch.utils.data.distributed.DistributedSampler(
    torch.utils.data.TensorDataset(data, labels), num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, labels), batch_size=16, sampler=sampler)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16, op=hvd.Average,
                                     gradient_predivide_factor=1.0)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for batch, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if batch % 2:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        avg_loss = hvd.allreduce(loss.detach(), True, name="avg_loss").item()  # legacy positional average
        total = hvd.allreduce(torch.tensor(1.0), average=False, name="count").item()
    assert total == hvd.size()
    if hvd.rank() == 0:
        print(f"Train Epoch: {epoch} Loss: {avg_loss:.6f}", flush=True)
state = [p.detach().clone() for p in model.parameters()]
everyone = hvd.allgather_object([s.tolist() for s in state])
assert all(e == everyone[0] for e in everyone), "ranks diverged"
print(f"rank {hvd.rank()} done", flush=True)
