"""One allreduce across every rank: prints rank, host and the verified sum; exits EXIT_CODE from argv."""

import socket
import sys

import torch

import hvdrun.torch as hvd

hvd.init()
total = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum)
expected = hvd.size() * (hvd.size() + 1) / 2
assert torch.all(total == expected), (total[:3], expected)
print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()} on {socket.gethostname()} sum={total[0].item():g} ok",
      flush=True)
rank = hvd.rank()
hvd.shutdown()
sys.exit(int(sys.argv[1]) if len(sys.argv) > 2 and rank == int(sys.argv[2]) else 0)
