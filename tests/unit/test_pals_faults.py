"""PALS's own failure lines name the node it could not reach: that node is blamed, not the one reporting. The lines
are ALCF's (argonne-lcf/user-guides docs/polaris/known-issues.md and docs/aurora/known-issues.md) and ezpz PR 244's
(a line broken before the child's name)."""

from __future__ import annotations

import pytest

from hvdrun.launch.pals_faults import PalsLines, job_host


def sick_of(*lines: str):
    reader = PalsLines()
    for line in lines:
        reader.feed(line)
    return reader.sick


@pytest.mark.parametrize(("lines", "name", "reporter"), [
    (["launch failed on x3104c0s1b0n0: Couldn't forward RPC launch(ab751d77-e80a-4c54-b1c2-4e881f7e8c90) to child "
      "x3104c0s31b0n0.hsn.cm.polaris.alcf.anl.gov: Resource temporarily unavailable"],
     "x3104c0s31b0n0.hsn.cm.polaris.alcf.anl.gov", "x3104c0s1b0n0"),
    (["ping failed on x4707c6s4b0n0: Couldn't forward RPC ping(24c93b8c-3434-4fb5-a8f0-53cff4cbbe42) to child "
      "x4707c7s6b0n0.hostmgmt2707.cm.aurora.alcf.anl.gov: Resource temporarily unavailable"],
     "x4707c7s6b0n0.hostmgmt2707.cm.aurora.alcf.anl.gov", "x4707c6s4b0n0"),
    (["launch failed on x4201c0s4b0n0: Couldn't forward RPC launch(...) to child",
      "x4513c0s7b0n0.hsn.cm.aurora.alcf.anl.gov: Resource temporarily unavailable"],
     "x4513c0s7b0n0.hsn.cm.aurora.alcf.anl.gov", "x4201c0s4b0n0"),
    (["ping failed on x4304c1s6b0n0: No reply from x4307c2s6b0n0.hostmgmt2307.cm.aurora.alcf.anl.gov after 87s"],
     "x4307c2s6b0n0.hostmgmt2307.cm.aurora.alcf.anl.gov", "x4304c1s6b0n0"),
    (["ping RPC timeout from x4212c7s0b0n0.hostmgmt2212.cm.aurora.alcf.anl.gov after 120s"],
     "x4212c7s0b0n0.hostmgmt2212.cm.aurora.alcf.anl.gov", None),
])
def test_the_child_is_the_sick_node(lines, name, reporter):
    sick = sick_of("Disabling the GPU pinning", *lines)
    assert sick is not None and (sick.name, sick.reporter) == (name, reporter)
    assert sick.describe().startswith(f"PALS could not reach node {name} (")


def test_other_pals_failures_name_no_sick_node():
    """A configuration error is no node's fault (docs/aurora/known-issues.md, running-jobs-aurora.md)."""
    assert sick_of("start failed on x4102c5s2b0n0: No VNIs available in internal allocator",
                   "launch failed on x4520c2s0b0n0: Failed to parse implicit GPU selection") is None


def test_the_first_node_named_stays():
    sick = sick_of("ping RPC timeout from a.hsn after 120s", "ping RPC timeout from b.hsn after 120s")
    assert sick is not None and sick.name == "a.hsn"


def test_a_node_is_found_among_the_jobs_hosts_under_another_domain():
    hosts = ["x4201c0s4b0n0.hostmgmt2201.cm.aurora.alcf.anl.gov", "x4513c0s7b0n0.hostmgmt2513.cm.aurora.alcf.anl.gov"]
    assert job_host("x4513c0s7b0n0.hsn.cm.aurora.alcf.anl.gov", hosts) == hosts[1]
    assert job_host("x4513c0s7b0n0", ["x4201c0s4b0n0", "x4513c0s7b0n0"]) == "x4513c0s7b0n0"
    assert job_host("10.1.2.3", ["10.1.2.4", "10.1.2.3"]) == "10.1.2.3"
    assert job_host("10.1.2.3.hsn", ["10.1.2.30", "10.1.2.3"]) == "10.1.2.3"
    assert job_host("x9999c0s0b0n0.hsn", hosts) is None
