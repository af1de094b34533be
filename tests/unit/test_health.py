"""The verdicts of ``hvdrun check`` and the helpers of ``hvdrun bench`` (pure logic)."""

from __future__ import annotations

import socket
import stat
import sys
from dataclasses import replace
from datetime import datetime, timezone

import pytest

from hvdrun.errors import UsageError
from hvdrun.health.check import CheckReport, JobReport, hosts_of_ranks, judge
from hvdrun.health.excludes import describe_written, exclude_text, write_excludes
from hvdrun.health.host_checks import Check, Expectations, HostReport, binding_check, compare
from hvdrun.health.on_host import Gpu, HealthFacts
from hvdrun.hosts import Host
from hvdrun.launch.remote.hostfacts import HostFacts
from hvdrun.measure.timing import bus_bandwidth, human_bytes, parse_size
from hvdrun.ranks import GpuLayout, assign_slots


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


# -- the exclude file (hvdrun check --write-excludes) --------------------------------------------------------------

def host(name: str, *failed: str) -> HostReport:
    checks = [Check(n, n not in failed, "e", "f") for n in ("reach", "python", "torch", "disk")]
    return HostReport(name, "ssh", checks)


def test_hosts_that_failed_a_host_check_are_listed_in_rank_order_with_their_checks():
    report = CheckReport({}, [host("h1"), host("h3", "torch", "disk"), host("h2", "reach")],
                         JobReport(ran=False, skipped="host checks failed on h3, h2"))
    assert report.failed_hosts() == {"h3": ["torch", "disk"], "h2": ["reach"]}


def test_the_hosts_a_failed_job_is_put_on_are_listed():
    wrong = JobReport(ran=True, checks=[Check("allreduce", False, "exact", "wrong on ranks [2, 3]")],
                      blamed=("h2",))
    assert CheckReport({}, [host("h1"), host("h2")], wrong).failed_hosts() == {"h2": ["allreduce"]}
    no_result = JobReport(ran=True, error="rank 0 printed no result")
    assert CheckReport({}, [host("h1")], no_result).failed_hosts() == {}  # failed, but no host to blame
    assert CheckReport({}, [host("h1")], JobReport(ran=True)).failed_hosts() == {}


def test_wrong_ranks_are_put_on_their_hosts_each_once():
    slots = assign_slots([Host("a", 2), Host("b", 2), Host("c", 1)], 5)
    assert hosts_of_ranks(slots, [3, 2, 4, 1]) == ("b", "c", "a")
    assert hosts_of_ranks(slots, []) == ()


WRITTEN_AT = datetime(2026, 11, 25, 3, 14, 7, tzinfo=timezone.utc)


def test_the_exclude_file_is_a_host_per_line_after_comments():
    assert exclude_text({"10.200.0.77": ["reach"], "n17": ["torch", "disk"]}, WRITTEN_AT) == (
        "# written by hvdrun check at 2026-11-25T03:14:07Z\n"
        "# 10.200.0.77 failed: reach\n10.200.0.77\n"
        "# n17 failed: torch, disk\nn17\n")
    assert exclude_text({}, WRITTEN_AT) == "# written by hvdrun check at 2026-11-25T03:14:07Z\n"


def test_the_exclude_file_replaces_a_stale_list_whole(tmp_path):
    target = tmp_path / "lists" / "bad-hosts"
    write_excludes(target, {"h2": ["reach"]}, WRITTEN_AT)
    hosts = [line for line in target.read_text().splitlines() if not line.startswith("#")]
    assert hosts == ["h2"] and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert write_excludes(target, {}) == target
    assert target.read_text().startswith("# written by hvdrun check at ") and target.read_text().count("\n") == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["bad-hosts"]  # no temp file left


def test_the_run_side_reads_back_the_hosts_written(tmp_path):
    from hvdrun.hosts import excluded_hosts

    target = write_excludes(tmp_path / "bad-hosts", {"10.200.0.77": ["reach"], "n17": ["allreduce"]})
    assert excluded_hosts(None, target) == {"10.200.0.77", "n17"}
    assert excluded_hosts(None, write_excludes(target, {})) == frozenset()


def test_an_unwritable_exclude_file_is_a_usage_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match=r"--write-excludes '.*a-file/bad': cannot write it \("):
        write_excludes(tmp_path / "a-file" / "bad", {"h2": ["reach"]})
    with pytest.raises(UsageError, match="cannot write it"):
        write_excludes(tmp_path, {})  # a directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_line_printed_says_how_many_hosts_and_where(tmp_path):
    path = tmp_path / "x"
    assert describe_written(path, ["h2", "h3"], False) == f"hvdrun check: wrote 2 hosts to exclude to {path} (h2, h3)"
    assert describe_written(path, [], True) == f"hvdrun check: wrote 0 hosts to exclude to {path} (every host passed)"
    assert "no host is to blame" in describe_written(path, [], False)


def polaris_like_facts() -> HealthFacts:
    """32 cores x 2 threads on one socket split in 4 NUMA nodes of 8 cores; GPU i sits on NUMA node 3 - i."""
    return replace(facts(gpus=4), cpus=tuple(range(64)),
                   numa={str(n): [*range(8 * n, 8 * n + 8), *range(32 + 8 * n, 40 + 8 * n)] for n in range(4)},
                   siblings={str(c): [c % 32, c % 32 + 32] for c in range(64)}, gpu_numa={"nvidia": [3, 2, 1, 0]})


@pytest.mark.parametrize("order", [("3", "2", "1", "0"), None])
def test_cores_follow_each_gpu_to_its_numa_node_in_the_bindings_report(order):
    check = binding_check(polaris_like_facts(), replace(EXPECT, cpu_bind="cores", layout=GpuLayout(4, order)),
                          "x3001", 4)
    assert check.ok and not check.warn and check.fix is None
    beside = ("0-7,32-39 (NUMA 0), GPU 3 = device 0 of 3,2,1,0 (NUMA 0)" if order
              else "24-31,56-63 (NUMA 3), GPU 0 = device 0 of 0,1,2,3 (NUMA 3)")
    first = f"local rank 0: cores {beside}"
    assert check.found.startswith(first), check.found


def test_the_bindings_report_warns_when_a_ranks_cores_and_gpu_sit_on_different_numa_nodes():
    expect = replace(EXPECT, cpu_bind="list:0-7:8-15:16-23:24-31", layout=GpuLayout(4))
    check = binding_check(polaris_like_facts(), expect, "x3001", 4)
    assert check.ok and check.warn
    assert check.found.startswith("local rank 0: cores 0-7 (NUMA 0), GPU 0 = device 0 of 0,1,2,3 (NUMA 3)"), check.found
    assert "local ranks 0, 1, 2, 3 of x3001 have their cores on another NUMA node" in (check.fix or "")


def test_the_bindings_report_fails_a_core_list_the_host_does_not_have():
    expect = replace(EXPECT, cpu_bind="list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100")
    check = binding_check(polaris_like_facts(), expect, "x3001", 12)
    assert not check.ok and "local rank 7 gets cores 61-68, but 64-68 are not allowed here" in check.found


def test_the_launchers_torch_version_is_read_without_importing_torch(tmp_path, monkeypatch):
    import torch

    from hvdrun.health.on_host import installed_torch_version

    assert installed_torch_version() == str(torch.__version__)
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('never imported')\n")
    (fake / "version.py").write_text("from typing import Optional\n__version__ = '9.1.0a0+git1234'\ndebug = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch")
    assert installed_torch_version() == "9.1.0a0+git1234"


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    """Rank 0 binds the port later: no outgoing connection may take it meanwhile as its own end."""
    from hvdrun.launch.remote import hostfacts

    low = hostfacts._ephemeral_low()
    ports = hostfacts.free_ports(3)
    assert len(set(ports)) == 3
    if low - hostfacts._PORT_FLOOR >= 1_000:
        assert all(hostfacts._PORT_FLOOR <= port < low for port in ports), (ports, low)
    for port in ports:
        socket.create_server(("", port)).close()
