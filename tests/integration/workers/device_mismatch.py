"""Bad input on the device path, which a machine without GPUs reaches with ``meta`` tensors (never on the CPU's
path): a grouped op mixing a CPU and a device tensor on every rank, then on one rank only, and one name on a CPU
tensor on one rank and a device tensor on another. Each ends in one error on every rank, naming the op, the ranks
and their devices; the op after each works."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def expect(label, call, *words):
    try:
        call()
    except hvd.HorovodInternalError as e:
        missing = [word for word in words if word not in str(e)]
        print(f"CHECK {label} rank {RANK}: {'ok' if not missing else f'missing {missing} in {e}'}", flush=True)
        print(f"ERROR {label} rank {RANK}: {e}", flush=True)
    else:
        print(f"CHECK {label} rank {RANK}: did not raise", flush=True)
    after = hvd.allreduce(torch.ones(2), name=f"after.{label}", op=hvd.Sum)
    print(f"CHECK after.{label} rank {RANK}: {'ok' if after.tolist() == [float(SIZE)] * 2 else after}", flush=True)


expect("grouped-mixed-everywhere", lambda: hvd.grouped_allreduce([torch.ones(3), torch.ones(3, device="meta")],
                                                                 name="mixed"),
       "'mixed.0'", "several devices", "rank 0: cpu and torch:meta", f"rank {SIZE - 1}: cpu and torch:meta")
one_rank = [torch.ones(3), torch.ones(3, device="meta" if RANK == 0 else "cpu")]
expect("grouped-mixed-on-rank-0", lambda: hvd.grouped_allreduce(one_rank, name="mixed.once"),
       "several devices", "rank 0: cpu and torch:meta")
mine = torch.ones(4, device="meta" if RANK == 1 else "cpu")
expect("cpu-and-device-under-one-name", lambda: hvd.allreduce(mine, name="one.name"),
       "'one.name'", "device differs across ranks", "rank 1: torch:meta", "rank 0")
hvd.shutdown()
