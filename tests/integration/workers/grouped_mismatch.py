"""Ranks group different numbers of tensors: a mismatch on every rank, and later ops are unaffected."""

import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
count = 2 + RANK  # rank 0 groups 2 tensors, rank 1 groups 3, ...
for kind, call in [
    ("allreduce", lambda ts: hvd.grouped_allreduce(ts, name="g", op=hvd.Sum)),
    ("allgather", lambda ts: hvd.grouped_allgather(ts, name="g")),
    ("reducescatter", lambda ts: hvd.grouped_reducescatter(ts, name="g", op=hvd.Sum)),
]:
    try:
        call([torch.ones(SIZE * 2) for _ in range(count)])
    except hvd.HorovodInternalError as e:
        assert "number of tensors in the group differs across ranks" in str(e), str(e)
        print(f"rank {RANK}: grouped {kind} mismatch raised: {e}", flush=True)
    else:
        raise AssertionError(f"rank {RANK}: grouped {kind} with different tensor counts did not raise")
    # the same names work right after, with matching groups
    total = hvd.grouped_allreduce([torch.ones(3), torch.ones(2)], name="g", op=hvd.Sum)
    assert [t.tolist() for t in total] == [[float(SIZE)] * 3, [float(SIZE)] * 2]
print(f"rank {RANK}: grouped mismatch ok", flush=True)
hvd.shutdown()
