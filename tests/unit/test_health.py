"""The verdicts of ``hvdrun check`` and the helpers of ``hvdrun bench`` (pure logic)."""

from __future__ import annotations

import pytest

from hvdrun.health.check import judge
from hvdrun.health.host_agent import Gpu, HealthFacts
from hvdrun.health.host_checks import Expectations, compare
from hvdrun.launch.remote.hostfacts import HostFacts
from hvdrun.measure.timing import bus_bandwidth, human_bytes, parse_size


def facts(python="3.11.7", hvdrun="0.1.0", torch="2.13.0+cpu", gpus=0, free=50e9) -> HealthFacts:
    base = HostFacts(hostname="n1", python=python, executable="/venv/bin/python", hvdrun=hvdrun, torch=torch,
                     cpus=8, interface_addr=None, ports=())
    return HealthFacts(base=base, torch_version=torch, torch_error=None if torch else "ModuleNotFoundError: torch",
                       gpus=tuple(Gpu(i, "NVIDIA A100-SXM4-40GB", 40536) for i in range(gpus)),
                       gpu_source="nvidia-smi" if gpus else "none", disk_free_bytes=int(free), workdir="/work")


EXPECT = Expectations(python="3.11.7", hvdrun="0.1.0", torch="2.13.0+cpu", gpus=8, gpus_from="gpus_per_node of polaris")


def verdicts(**kwargs) -> dict:
    return {c.name: c for c in compare(facts(**kwargs), EXPECT, "n1")}


def test_a_matching_host_passes_everything():
    assert all(c.ok for c in verdicts(gpus=8).values())
    assert verdicts(gpus=8)["gpus"].found == "8 (NVIDIA A100-SXM4-40GB; nvidia-smi)"


@pytest.mark.parametrize("kwargs, name, found", [
    ({"python": "3.10.12"}, "python", "3.10.12 (Python /venv/bin/python; the launcher has 3.11.7)"),
    ({"hvdrun": "0.0.9"}, "hvdrun", "0.0.9 (hvdrun; the launcher has 0.1.0)"),
    ({"torch": "2.12.0+cu126"}, "torch", "2.12.0+cu126 (torch; the launcher has 2.13.0+cpu)"),
    ({"torch": None}, "torch", "not importable (ModuleNotFoundError: torch)"),
    ({"gpus": 3}, "gpus", "3 (NVIDIA A100-SXM4-40GB; nvidia-smi)"),
    ({"free": 0.2e9}, "disk", "0.2 GB free"),
])
def test_each_mismatch_names_both_sides_and_a_fix(kwargs, name, found):
    check = verdicts(**{"gpus": 8, **kwargs})[name]
    assert not check.ok and check.found == found and check.fix
    assert [c.name for c in verdicts(**{"gpus": 8, **kwargs}).values() if not c.ok] == [name]


def test_no_gpu_requirement_passes_whatever_is_found():
    check = {c.name: c for c in compare(facts(), Expectations("3.11.7", "0.1.0", "2.13.0+cpu"), "n1")}["gpus"]
    assert check.ok and check.expected == "any (no gpus_per_node given)" and check.found == "0"


def result(link_seconds, verified=True):
    size = len(link_seconds)
    return {"ranks": size, "hosts": [f"h{i}" for i in range(size)], "verified": verified,
            "wrong_ranks": [] if verified else [1], "latency_bytes": 4096, "latency_s": 1e-4,
            "bandwidth_bytes": 64 << 20, "bandwidth_s": 0.1, "bus_bandwidth": 1e9,
            "links": [{"src": i, "dst": (i + 1) % size, "src_host": f"h{i}", "dst_host": f"h{(i + 1) % size}",
                       "bytes": 1 << 20, "seconds": s} for i, s in enumerate(link_seconds)]}


def test_a_slow_link_is_named_as_a_warning():
    checks = {c.name: c for c in judge(result([1e-3, 1e-3, 5e-3, 1e-3]))}
    links = checks["links"]
    assert links.ok and links.warn and "rank 2 (h2) -> rank 3 (h3): 0.21 GB/s" in links.found
    assert not {c.name: c for c in judge(result([1e-3, 1.2e-3, 1e-3]))}["links"].warn


def test_a_wrong_sum_fails_the_job():
    check = judge(result([1e-3, 1e-3], verified=False))[0]
    assert check.name == "allreduce" and not check.ok and check.found == "wrong on ranks [1]"


@pytest.mark.parametrize("text, size", [("4096", 4096), ("4K", 4096), ("64m", 64 << 20), ("1GB", 1 << 30)])
def test_sizes(text, size):
    assert parse_size(text) == size
    assert human_bytes(size) in ("4 KB", "64 MB", "1 GB")


@pytest.mark.parametrize("text", ["", "0", "4X", "K", "-4K", "1.5M"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_bus_bandwidth_is_the_ring_traffic_per_link():
    assert bus_bandwidth(1000, 1.0, 4) == 1500.0 and bus_bandwidth(1000, 1.0, 1) == 0.0
