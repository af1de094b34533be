"""Horovod's module layout under ``hvdrun --horovod-compat``: the imports real scripts and libraries write."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"

# every ``from horovod... import`` line of Horovod 0.28.x's horovod/torch/__init__.py, in its order
TORCH_PACKAGE_LINES = [
    "from horovod.common.util import check_extension",
    "from horovod.torch import elastic",
    "from horovod.torch.compression import Compression",
    "from horovod.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, "
    "broadcast_parameters",
    "from horovod.torch.mpi_ops import allreduce, allreduce_async, allreduce_, allreduce_async_",
    "from horovod.torch.mpi_ops import grouped_allreduce, grouped_allreduce_async, grouped_allreduce_, "
    "grouped_allreduce_async_",
    "from horovod.torch.mpi_ops import sparse_allreduce_async",
    "from horovod.torch.mpi_ops import allgather, allgather_async",
    "from horovod.torch.mpi_ops import grouped_allgather, grouped_allgather_async",
    "from horovod.torch.mpi_ops import broadcast, broadcast_async, broadcast_, broadcast_async_",
    "from horovod.torch.mpi_ops import alltoall, alltoall_async",
    "from horovod.torch.mpi_ops import reducescatter, reducescatter_async",
    "from horovod.torch.mpi_ops import grouped_reducescatter, grouped_reducescatter_async",
    "from horovod.torch.mpi_ops import join",
    "from horovod.torch.mpi_ops import barrier",
    "from horovod.torch.mpi_ops import poll, synchronize",
    "from horovod.torch.mpi_ops import init, shutdown",
    "from horovod.torch.mpi_ops import is_initialized, start_timeline, stop_timeline",
    "from horovod.torch.mpi_ops import size, local_size, cross_size, rank, local_rank, cross_rank",
    "from horovod.torch.mpi_ops import mpi_threads_supported, mpi_enabled, mpi_built",
    "from horovod.torch.mpi_ops import gloo_enabled, gloo_built",
    "from horovod.torch.mpi_ops import nccl_built, ddl_built, ccl_built, cuda_built, rocm_built",
    "from horovod.torch.mpi_ops import ProcessSet, global_process_set, add_process_set, remove_process_set",
    "from horovod.torch.mpi_ops import Average, Sum, Adasum, Min, Max, Product",
    "from horovod.torch.mpi_ops import HorovodInternalError",
    "from horovod.torch.optimizer import DistributedOptimizer",
    "from horovod.torch.sync_batch_norm import SyncBatchNorm",
]

# the other public modules, and the common imports of Horovod's own torch modules, scripts and libraries
OTHER_LINES = [
    "from horovod.torch.mpi_ops import handle_average_backwards_compatibility",
    "from horovod.torch.mpi_ops import Compression",
    "from horovod.torch.compression import Compressor, NoneCompressor, FP16Compressor",
    "from horovod.torch.elastic import run, TorchState, ElasticSampler",
    "from horovod.torch.elastic.state import TorchState",
    "from horovod.torch.elastic.sampler import ElasticSampler",
    "import horovod.torch.elastic.state",
    "from horovod.common.exceptions import HorovodInternalError",
    "from horovod.common.exceptions import HostsUpdatedInterrupt",
    "from horovod.common.process_sets import ProcessSet, global_process_set, add_process_set, remove_process_set",
    "from horovod.common.util import check_installed_version, get_average_backwards_compatibility_fun, "
    "gpu_available, num_rank_is_power_2",
    "from horovod.common.util import split_list, is_iterable, env, extension_available",
    "from horovod.common.util import mpi_built, gloo_built, nccl_built, ddl_built, ccl_built",
    "from horovod.common.util import is_version_greater_equal_than",
    "from horovod.common.elastic import run_fn",
    "from horovod.common.elastic import State, ObjectState",
    "from horovod.runner import run",
    "from horovod.runner.util.threads import in_thread",  # Horovod's test/utils/common.py imports it
    "from horovod import run",
]

LINES = TORCH_PACKAGE_LINES + OTHER_LINES


def test_every_horovod_import_line_gives_hvdruns_own_objects(run_hvdrun, tmp_path):
    """One job of 2 ranks: every line imports, the objects are hvdrun's, hvdrun's errors meet Horovod's except."""
    lines_file = tmp_path / "lines.json"
    lines_file.write_text(json.dumps(LINES))
    done = run_hvdrun("-np", "2", "--horovod-compat", str(WORKERS / "horovod_modules.py"), str(lines_file),
                      timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FAILED" not in done.stdout, done.stdout
    counts = re.findall(r"^\[(\d)\]<stdout>:rank \1: imported (\d+) of (\d+);", done.stdout, re.M)
    assert sorted(rank for rank, _, _ in counts) == ["0", "1"], done.stdout
    assert all(int(imported) == int(total) == len(LINES) for _, imported, total in counts), counts
    assert done.stdout.count("caught HorovodInternalError") == 2
