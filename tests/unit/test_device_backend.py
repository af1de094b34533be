"""Which torch.distributed backend carries device tensors (hvdrun/runtime/device.py)."""

from __future__ import annotations

import re

import pytest
import torch  # noqa: F401 - device_backend_name looks at an imported torch only

from hvdrun.errors import DeviceError, UsageError
from hvdrun.runtime.device import TorchGroup, device_backend_name


@pytest.mark.parametrize("name", ["nccl", "xccl", "ccl", "gloo", "XCCL"])
def test_a_named_backend_is_taken_as_given(name):
    assert device_backend_name({"HVDRUN_DEVICE_BACKEND": name}) == name.lower()


def test_an_unknown_backend_is_a_usage_error_listing_the_known_ones():
    with pytest.raises(UsageError, match="HVDRUN_DEVICE_BACKEND='mpi'; expected one of nccl, xccl, ccl, gloo"):
        device_backend_name({"HVDRUN_DEVICE_BACKEND": "mpi"})


def test_without_a_gpu_there_is_no_device_path():
    assert device_backend_name({}) is None  # the CPU build: neither CUDA/ROCm nor an Intel GPU


@pytest.mark.parametrize("backend, needs", [
    ("xccl", "a torch built for Intel GPUs (XPU, 2.8 or later)"),
    ("ccl", "Intel's oneccl_bindings_for_pytorch, imported before hvd.init()"),
])
def test_a_backend_this_torch_lacks_is_named_with_what_it_needs(backend, needs):
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(DeviceError, match=f"HVDRUN_DEVICE_BACKEND={backend}: this torch .* has no "
                                          f"{backend.upper()} process group; it needs {re.escape(needs)}"):
        TorchGroup.create(backend, store, "p", 0, 2, 5.0)
