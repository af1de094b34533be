"""Horovod's module layout under ``hvdrun --horovod-compat`` (run with 2 ranks).

argv[1]: a JSON list of import lines. Each is executed (a failure is printed, not raised), then every
module of the layout is checked to hand out hvdrun's own objects, and a mismatched allreduce on purpose
must be caught by ``except horovod.common.exceptions.HorovodInternalError``.
"""

import json
import sys
import warnings
from pathlib import Path

import horovod
import horovod.common.elastic
import horovod.common.exceptions
import horovod.common.process_sets
import horovod.common.util
import horovod.runner
import horovod.torch as hvd
import horovod.torch.compression
import horovod.torch.elastic
import horovod.torch.elastic.sampler
import horovod.torch.elastic.state
import horovod.torch.functions
import horovod.torch.mpi_ops
import horovod.torch.optimizer
import horovod.torch.sync_batch_norm
import torch

import hvdrun.errors
import hvdrun.launch.function
import hvdrun.torch
import hvdrun.torch.elastic

lines = json.loads(Path(sys.argv[1]).read_text())
imported = 0
for line in lines:
    try:
        exec(line, {})
    except Exception as e:  # noqa: BLE001 - every failing line is reported, then counted out
        print(f"FAILED {line!r}: {type(e).__name__}: {e}", flush=True)
    else:
        imported += 1

# every public name of a module that hvdrun.torch (or its elastic module) also has is that very object
SHIMS = [horovod.torch.mpi_ops, horovod.torch.functions, horovod.torch.compression, horovod.torch.optimizer,
         horovod.torch.sync_batch_norm, horovod.torch.elastic, horovod.torch.elastic.state,
         horovod.torch.elastic.sampler, horovod.common.exceptions, horovod.common.process_sets,
         horovod.common.elastic]
compared = 0
for module in SHIMS:
    for name in module.__all__:
        for home in (hvdrun.torch, hvdrun.torch.elastic):
            if hasattr(home, name):
                assert getattr(module, name) is getattr(home, name), (module.__name__, name, home.__name__)
                compared += 1
same = {
    "mpi_ops.allreduce": (horovod.torch.mpi_ops.allreduce, hvdrun.torch.allreduce),
    "mpi_ops.Average": (horovod.torch.mpi_ops.Average, hvdrun.torch.Average),
    "HorovodInternalError": (horovod.common.exceptions.HorovodInternalError, hvdrun.errors.CollectiveError),
    "hvd.HorovodInternalError": (hvd.HorovodInternalError, hvdrun.errors.CollectiveError),
    "HostsUpdatedInterrupt": (horovod.common.exceptions.HostsUpdatedInterrupt,
                              hvdrun.torch.elastic.HostsUpdatedInterrupt),
    "TorchState": (horovod.torch.elastic.TorchState, hvdrun.torch.elastic.TorchState),
    "state.TorchState": (horovod.torch.elastic.state.TorchState, hvdrun.torch.elastic.TorchState),
    "sampler.ElasticSampler": (horovod.torch.elastic.sampler.ElasticSampler, hvdrun.torch.elastic.ElasticSampler),
    "elastic.run": (horovod.torch.elastic.run, hvdrun.torch.elastic.run),
    "common.elastic.ObjectState": (horovod.common.elastic.ObjectState, hvdrun.torch.elastic.ObjectState),
    "global_process_set": (horovod.common.process_sets.global_process_set, hvdrun.torch.global_process_set),
    "runner.run": (horovod.runner.run, hvdrun.launch.function.run),
    "horovod.run": (horovod.run, hvdrun.launch.function.run),
    "hvd.elastic": (hvd.elastic, horovod.torch.elastic),
    "hvd.mpi_ops": (hvd.mpi_ops, horovod.torch.mpi_ops),
    "FP16Compressor": (horovod.torch.compression.FP16Compressor, hvdrun.torch.Compression.fp16),
    "DistributedOptimizer": (horovod.torch.optimizer.DistributedOptimizer, hvdrun.torch.DistributedOptimizer),
}
for label, (ours, theirs) in same.items():
    assert ours is theirs, label
assert compared > 60, compared

util = horovod.common.util
assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
assert util.num_rank_is_power_2(4) and not util.num_rank_is_power_2(6) and util.is_iterable([])
assert util.extension_available("torch") and not util.extension_available("tensorflow")
assert util.nccl_built() == hvdrun.torch.nccl_built() and util.is_version_greater_equal_than("0.28.1", "0.28.0")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    resolve = horovod.torch.mpi_ops.handle_average_backwards_compatibility
    assert (resolve(None, False), resolve(None, True), resolve(None, None)) == (hvd.Sum, hvd.Average, hvd.Average)

hvd.init()
rank = hvd.rank()
try:
    horovod.torch.mpi_ops.allreduce(torch.ones(3 if rank == 0 else 4), name="mismatch")
except horovod.common.exceptions.HorovodInternalError as e:
    assert isinstance(e, hvdrun.errors.CollectiveError)
    print(f"rank {rank}: caught HorovodInternalError", flush=True)
total = horovod.torch.mpi_ops.allreduce(torch.ones(2), op=horovod.torch.mpi_ops.Sum)  # still usable afterwards
assert total.tolist() == [hvd.size()] * 2
print(f"rank {rank}: imported {imported} of {len(lines)}; {compared + len(same)} identities ok", flush=True)
hvd.shutdown()
