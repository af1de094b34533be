"""Print every TCP address this rank listens on after init() (a job on one machine: loopback only)."""

import json

import psutil
import torch

import hvdrun.torch as hvd

hvd.init()
hvd.allreduce(torch.ones(4))
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"})
print("LISTEN " + json.dumps({"rank": hvd.rank(), "addresses": listening}), flush=True)
hvd.barrier()
hvd.shutdown()
