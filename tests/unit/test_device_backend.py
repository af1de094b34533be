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


@pytest.mark.parametrize("cuda, xpu, xccl, ccl_plugin, chosen", [
    (True, False, False, False, "nccl"),   # CUDA, or ROCm behind torch.cuda
    (True, True, True, False, "nccl"),     # an NVIDIA or AMD GPU wins where both report
    (False, True, True, False, "xccl"),    # an Intel GPU with torch's own XPU process group
    (False, True, False, True, "ccl"),     # an Intel GPU with oneCCL's bindings imported
    (False, True, False, False, None),     # an Intel GPU and no backend for it: no device path
])
def test_the_default_device_backend_follows_the_gpu_present(monkeypatch, cuda, xpu, xccl, ccl_plugin, chosen):
    """No GPU here: torch's own availability probes are set to what each machine reports."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: cuda)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: xpu)
    monkeypatch.setattr(dist, "is_xccl_available", lambda: xccl, raising=False)
    plugins = {**dist.Backend._plugins, **({"CCL": object()} if ccl_plugin else {})}
    monkeypatch.setattr(dist.Backend, "_plugins", plugins)
    assert device_backend_name({}) == chosen


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
