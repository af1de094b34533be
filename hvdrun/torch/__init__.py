"""``import hvdrun.torch as hvd``: Horovod's PyTorch API on hvdrun's runtime.

A Horovod script runs with only its import line changed::

    import hvdrun.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
"""

from __future__ import annotations

from hvdrun.errors import CollectiveError as HorovodInternalError
from hvdrun.runtime import context
from hvdrun.torch import elastic  # hvd.elastic
from hvdrun.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hvdrun.torch.build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from hvdrun.torch.compression import Compression, Compressor
from hvdrun.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    save_checkpoint,
)
from hvdrun.torch.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hvdrun.torch.optimizer import DistributedOptimizer
from hvdrun.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hvdrun.torch.steps import count_optimizer_steps
from hvdrun.torch.sync_batch_norm import SyncBatchNorm
from hvdrun.walltime import time_left, warn_again_if_due


def init(comm: object = None, process_sets: object = None) -> None:
    """Join the job: rendezvous with the other ranks and start the engine.

    Args:
        comm: unused (hvdrun finds its ranks from the launcher).
        process_sets: ``ProcessSet`` objects to register now, on every rank in the same order.
    """
    context.init()
    warn_again_if_due()  # the warning before the walltime came while this rank was still starting
    count_optimizer_steps()
    if isinstance(process_sets, (list, tuple)):
        for process_set in process_sets:
            add_process_set(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline on rank 0 (needs ``HOROVOD_TIMELINE=DYNAMIC``)."""
    context.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and write its file."""
    context.stop_timeline()


def shutdown() -> None:
    """Leave the job; ``init()`` may be called again afterwards."""
    context.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return context.is_initialized()


def size() -> int:
    """Number of ranks."""
    return context.current().world.size


def rank() -> int:
    """This process's rank, 0..size-1."""
    return context.current().world.rank


def local_size() -> int:
    """Number of ranks on this host."""
    return context.current().world.local_size


def local_rank() -> int:
    """Rank within this host (use it to pick a GPU)."""
    return context.current().world.local_rank


def cross_size() -> int:
    """Number of hosts that have a rank with this rank's local rank."""
    return context.current().world.cross_size


def cross_rank() -> int:
    """Index of this host among those."""
    return context.current().world.cross_rank


__all__ = [
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "elastic", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "init",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "save_checkpoint", "shutdown", "size", "start_timeline", "stop_timeline", "synchronize", "time_left",
]
