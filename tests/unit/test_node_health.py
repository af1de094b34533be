"""Node health (``hvdrun check --health``, ``hvdrun --preflight``): the parsers of what a node says, and the verdicts.

The vendor tools' texts are their documented formats (the samples below, and the fakes in tests/fakes/fake_gpu_tools
run as the real tools would be); /sys/class/net and /proc/self/mountinfo are real files of the same layout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvdrun.cli import cli
from hvdrun.config import parse_config
from hvdrun.errors import ConfigError, LaunchError
from hvdrun.health.host_checks import HostReport
from hvdrun.health.node_checks import (
    ClockReading,
    HealthOptions,
    NodeExpectations,
    clock_check,
    clock_offset,
    gpu_health_check,
    interface_check,
    local_dir_check,
    mounts_check,
    node_checks,
    node_expectations,
)
from hvdrun.health.node_health import (
    GpuHealth,
    InterfaceState,
    MountState,
    NodeHealth,
    SpaceState,
    free_space,
    interface_state,
    mount_states,
    parse_mountinfo,
    parse_nvidia_smi_q,
    parse_rocm_smi_ras,
    parse_xpu_smi_health,
    serve_clock,
    vendor_health,
)
from hvdrun.health.on_host import HealthFacts
from hvdrun.health.preflight import failure_line, without_hosts
from hvdrun.health.verdict import Check
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.remote.hostfacts import HostFacts
from hvdrun.ranks import GpuLayout
from tests.conftest import REPO

FAKES = REPO / "tests" / "fakes" / "fake_gpu_tools"

# nvidia-smi -q of an A100 with a pending remap (the sample in stas00/ml-engineering's nvidia/debug.md, shortened)
A100 = """
==============NVSMI LOG==============

Driver Version                            : 510.73.08
CUDA Version                              : 11.6

Attached GPUs                             : 8
GPU 00000000:10:1C.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 1
        Uncorrectable Error               : 0
        Pending                           : Yes
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
            High                          : 1 bank(s)
"""

# the layout before Ampere (a V100): Single Bit / Double Bit sections with a Total, Retired Pages > Pending
V100 = """
GPU 00000000:3B:00.0
    Product Name                          : Tesla V100-SXM2-32GB
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 4
                Total                     : 4
            Double Bit
                Device Memory             : 2
                Total                     : 2
        Aggregate
            Single Bit
                Total                     : 4
            Double Bit
                Total                     : 2
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 1
        Pending                           : Yes
"""


def test_nvidia_smi_a100_pending_remap_is_a_problem_and_correctable_errors_are_not():
    health = parse_nvidia_smi_q(A100)
    assert health.devices == 1 and health.notes == ()
    assert health.problems == ("GPU 0 (00000000:10:1C.0): a row remap is pending (a GPU reset applies it)",)


def test_nvidia_smi_before_ampere_counts_double_bit_totals_and_the_old_pending_field():
    health = parse_nvidia_smi_q(V100)
    assert health.problems == ("GPU 0 (00000000:3B:00.0): 2 uncorrectable ECC errors since the driver loaded",
                               "GPU 0 (00000000:3B:00.0): a page retirement is pending (a GPU reset retires it)")


def fake(tool: str, *args: str, **env: str) -> str:
    """The fake tool's output, run as the real one would be."""
    return subprocess.run([str(FAKES / tool), *args], capture_output=True, text=True, check=True, timeout=10,
                          env={**os.environ, **env}).stdout


@pytest.mark.parametrize("mode, problem", [
    ("healthy", None),
    ("ecc", "GPU 1 (00000000:46:00.0): 3 uncorrectable ECC errors since the driver loaded"),
    ("remap-pending", "GPU 1 (00000000:46:00.0): a row remap is pending (a GPU reset applies it)"),
    ("remap-failed", "GPU 1 (00000000:46:00.0): row remapping failed (the GPU needs service)"),
    ("retired-pending", "GPU 1 (00000000:46:00.0): a page retirement is pending (a GPU reset retires it)"),
])
def test_the_fake_nvidia_smi_reads_as_the_real_one(mode, problem):
    health = parse_nvidia_smi_q(fake("nvidia-smi", "-q", FAKE_NVIDIA_SMI_MODE=mode, FAKE_NVIDIA_SMI_GPUS="8"))
    assert health.devices == 8 and health.problems == ((problem,) if problem else ())


def test_lifetime_only_ecc_errors_are_a_note_not_a_problem():
    health = parse_nvidia_smi_q(fake("nvidia-smi", "-q", FAKE_NVIDIA_SMI_MODE="aggregate"))
    assert health.problems == ()
    assert health.notes == ("GPU 1 (00000000:46:00.0): 2 uncorrectable ECC errors in its lifetime (aggregate)",)


XPU_HEALTHY = """
+------------------------------+-------------------------------------------------------------------+
| Device ID                    | 0                                                                 |
+------------------------------+-------------------------------------------------------------------+
| 1. GPU Core Temperature      | Status: Ok                                                        |
|                              | Description: All temperature sensors are healthy.                 |
|                              | Throttle Threshold: 105 Celsius Degree                            |
+------------------------------+-------------------------------------------------------------------+
| 4. GPU Memory                | Status: Ok                                                        |
|                              | Description: All memory channels are healthy.                     |
+------------------------------+-------------------------------------------------------------------+
| 6. GPU Frequency             | Status: OK                                                        |
|                              | Description: The device frequency not throttled                   |
+------------------------------+-------------------------------------------------------------------+
"""


def test_xpu_smi_health_of_the_documented_sample_is_healthy():
    assert parse_xpu_smi_health(XPU_HEALTHY) == GpuHealth("xpu-smi", 1)


def test_xpu_smi_critical_is_a_problem_and_warning_a_note():
    critical = parse_xpu_smi_health(fake("xpu-smi", "health", "-l", FAKE_XPU_SMI_MODE="critical"))
    assert critical.devices == 6
    assert critical.problems == ("GPU 2: GPU Memory: critical (Memory has uncorrectable errors.)",)
    warning = parse_xpu_smi_health(fake("xpu-smi", "health", "-l", FAKE_XPU_SMI_MODE="warning"))
    assert warning.problems == () and warning.notes[0].startswith("GPU 2: GPU Core Temperature: warning (")


def test_every_vendor_tool_on_path_is_asked_and_one_that_hangs_is_named(monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKES}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_MODE", "hang")
    answers = vendor_health(timeout_s=1.0)
    assert answers == (GpuHealth("nvidia-smi", error="'nvidia-smi -q' did not answer within 1 s"),
                       GpuHealth("xpu-smi", 6), GpuHealth("rocm-smi", 4))


def test_rocm_smi_ras_state_mult_is_a_problem():
    assert parse_rocm_smi_ras(fake("rocm-smi", "--showrasinfo", "all")) == GpuHealth("rocm-smi", 4)
    bad = parse_rocm_smi_ras(fake("rocm-smi", "--showrasinfo", "all", FAKE_ROCM_SMI_MODE="uncorrectable"))
    assert bad.problems == ("GPU 1: RAS block UMC: multiple uncorrectable errors (MULT)",)


def test_rocm_smi_poison_state_and_a_two_word_state():
    text = "GPU[3]: \tRAS INFO\n         Block       Status  \n           UMC       POSITION  0  1\n" \
           "           GFX  UNKNOWN ERROR  0  0\n"
    assert parse_rocm_smi_ras(text).problems == ("GPU 3: RAS block UMC: a page isolated, treated as uncorrectable "
                                                 "(POSITION)",)


def sysfs(tmp_path: Path, name: str, flags: str, carrier: str | None, operstate: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "flags").write_text(flags + "\n")
    (folder / "operstate").write_text(operstate + "\n")
    if carrier is not None:
        (folder / "carrier").write_text(carrier + "\n")
    return tmp_path


def test_interface_state_from_sys_class_net(tmp_path):
    root = sysfs(tmp_path, "hsn0", "0x1003", "1", "up")
    assert interface_state("hsn0", root) == InterfaceState("hsn0", True, True, True, "up")
    assert interface_state("hsn1", root) == InterfaceState("hsn1", present=False)
    sysfs(tmp_path, "ib0", "0x1002", None, "down")  # down: the kernel refuses to read its carrier
    assert interface_state("ib0", root) == InterfaceState("ib0", True, False, None, "down")


def test_interface_state_of_this_machine_loopback():
    state = interface_state("lo")
    assert state.present and state.up and state.carrier


MOUNTINFO = """22 1 0:21 / /proc rw,nosuid - proc proc rw
36 25 0:31 / /lus/flare rw,relatime shared:12 - lustre 10.1.0.1@o2ib:/flare rw
37 25 0:32 / /mnt/with\\040space rw - tmpfs tmpfs rw
"""


def test_mountinfo_mount_points_with_escapes():
    points = parse_mountinfo(MOUNTINFO)
    assert points["/lus/flare"] == ("lustre", "10.1.0.1@o2ib:/flare")
    assert points["/mnt/with space"] == ("tmpfs", "tmpfs")


def test_mount_states_of_this_machine(tmp_path):
    (tmp_path / "mountinfo").write_text(MOUNTINFO)
    states = mount_states(["/proc", str(tmp_path), "/nonexistent/lus"], tmp_path / "mountinfo")
    assert states[0] == MountState("/proc", True, "proc", "proc")
    assert states[1] == MountState(str(tmp_path), False)
    assert states[2] == MountState("/nonexistent/lus", False, error="no such directory")


def test_free_space_of_a_directory(tmp_path):
    assert free_space(str(tmp_path)).free_bytes > 0
    assert free_space(str(tmp_path / "gone")) == SpaceState(str(tmp_path / "gone"), None, "no such directory")


EXPECT = NodeExpectations(interface="hsn0", mounts=("/lus/flare",), local_dir="/local/scratch",
                          min_local_bytes=int(50e9), vendor="nvidia", gpus=4,
                          origin={"interface": "network_interface of aurora.yaml"})


def test_interface_verdicts_name_what_is_wrong():
    expected = "hsn0 present, up, with carrier (network_interface of aurora.yaml)"
    assert interface_check(InterfaceState("hsn0", True, True, True, "up"), EXPECT, "n1") == \
        Check("interface", True, expected, "hsn0 up, carrier (operstate up)")
    down = interface_check(InterfaceState("hsn0", True, False, None, "down"), EXPECT, "n1")
    assert not down.ok and down.found == "hsn0 is down (operstate down)" and "ip link set hsn0 up" in down.fix
    no_link = interface_check(InterfaceState("hsn0", True, True, False, "lowerlayerdown"), EXPECT, "n1")
    assert not no_link.ok and no_link.found.endswith("has no carrier (operstate lowerlayerdown): no link")
    assert interface_check(InterfaceState("hsn0", False), EXPECT, "n1").found == "no interface hsn0"


def test_mount_and_local_dir_verdicts():
    missing = mounts_check([MountState("/lus/flare", False)], EXPECT, "n1")
    assert not missing.ok and missing.found == "/lus/flare is not a mount point"
    hung = mounts_check([MountState("/lus/flare", False, "lustre", "mgs:/flare", "statvfs did not answer within 5 s "
                                    "(a hung file system)")], EXPECT, "n1")
    assert hung.found == ("/lus/flare (lustre from mgs:/flare) does not answer: statvfs did not answer within 5 s "
                          "(a hung file system)")
    full = local_dir_check(SpaceState("/local/scratch", 123_000_000), EXPECT, "n1")
    assert not full.ok and full.expected == ">= 50 GB free in /local/scratch" and full.found == "0.12 GB free"
    assert local_dir_check(SpaceState("/local/scratch", int(60e9)), EXPECT, "n1").ok


def test_gpu_health_verdict_counts_the_vendor_tools_gpus_and_names_every_problem():
    healthy = gpu_health_check([GpuHealth("nvidia-smi", 4)], EXPECT, "n1")
    assert healthy.ok and healthy.found == "nvidia-smi: 4 GPUs healthy"
    short = gpu_health_check([GpuHealth("nvidia-smi", 3, ("GPU 1 (b): row remapping failed",))], EXPECT, "n1")
    assert not short.ok and short.found == "nvidia-smi lists 3 GPUs, not 4; GPU 1 (b): row remapping failed"
    failed = gpu_health_check([GpuHealth("nvidia-smi", error="'nvidia-smi -q' did not answer within 20 s")],
                              EXPECT, "n1")
    assert not failed.ok and failed.found == "nvidia-smi: 'nvidia-smi -q' did not answer within 20 s"
    noted = gpu_health_check([GpuHealth("nvidia-smi", 4, notes=("GPU 0 (b): 2 uncorrectable ...",))], EXPECT, "n1")
    assert noted.ok and noted.warn


def test_a_node_without_an_answer_to_health_fails():
    assert not node_checks(None, EXPECT, "n1")[0].ok


def test_node_checks_ask_only_what_is_expected():
    health = NodeHealth(interfaces=(InterfaceState("hsn0", True, True, True, "up"),))
    names = [c.name for c in node_checks(health, NodeExpectations(), "n1")]
    assert names == ["gpu-health"]
    assert [c.name for c in node_checks(health, EXPECT, "n1")] == ["interface", "mounts", "gpu-health"]


def scripted(times: list[float]):
    values = iter(times)
    return lambda: next(values)


def test_clock_offset_takes_the_shortest_round_trip_and_its_middle():
    # three samples (sent, node's clock, received): the second has the shortest round trip (0.010 s)
    ours = scripted([100.0, 100.5, 101.0, 101.010, 102.0, 102.3])
    node = scripted([102.9, 103.505, 105.0])
    reading = clock_offset(node, now=ours)
    assert reading.rtt_s == pytest.approx(0.010) and reading.offset_s == pytest.approx(2.5)


def test_clock_verdicts_allow_for_half_the_round_trip():
    assert clock_check(ClockReading(0.2, 0.004), 1.0, "n1").ok
    late = clock_check(ClockReading(-2.5, 0.010), 1.0, "n1")
    assert not late.ok and late.found == "-2.500 s (+- 0.005 s, half the round trip)" and "chronyc" in late.fix
    unsure = clock_check(ClockReading(0.9, 0.6), 1.0, "n1")  # 0.6 .. 1.2 s off: cannot tell
    assert unsure.ok and unsure.warn
    assert not clock_check(ClockReading(1.5, 0.6), 1.0, "n1").ok  # at least 1.2 s off


def test_serve_clock_answers_each_line_with_the_time():
    out: list[str] = []
    serve_clock(["\n", "\n"], out.append)
    assert out[0] == "ready\n" and len(out) == 3 and float(out[1]) > 1e9


def test_node_expectations_take_the_options_then_the_job_then_the_cluster_file():
    config = parse_config({"network_interface": "hsn0", "mounts": ["/lus/flare"], "local_dir": "/tmp",
                           "gpu_vendor": "intel", "gpus_per_node": 12, "tiles_per_gpu": 2}, "aurora.yaml")
    layout = GpuLayout(gpus_per_node=12, vendor="intel", tiles_per_gpu=2)
    expect = node_expectations(HealthOptions(), config, layout)
    assert (expect.interface, expect.mounts, expect.local_dir, expect.gpus) == ("hsn0", ("/lus/flare",), "/tmp", 6)
    assert expect.origin["mounts"] == "mounts of aurora.yaml"
    assert expect.origin["gpu-health"] == "12 devices = 6 GPUs x 2 tiles"
    given = node_expectations(HealthOptions(interface="ib0", mounts=("/eagle",)), config, layout, ("hsn1", "job"))
    assert (given.interface, given.mounts, given.origin["interface"]) == ("ib0", ("/eagle",), "--interface")
    assert node_expectations(HealthOptions(), config, layout, ("hsn1", "job")).interface == "hsn1"
    assert expect.probe_args() == ["--health", "--health-interface", "hsn0", "--mount", "/lus/flare",
                                   "--local-dir", "/tmp"]


def test_cluster_file_mounts_must_be_absolute():
    with pytest.raises(ConfigError, match="'mounts' must be an absolute path"):
        parse_config({"mounts": ["lus/flare"]}, "c.yaml")


def test_health_facts_carry_the_node_health_through_json():
    base = HostFacts(hostname="n1", python="3.11.7", executable="/p", hvdrun="0.1.0", torch=None, cpus=8,
                     interface_addr=None, ports=())
    node = NodeHealth(interfaces=(InterfaceState("hsn0", True),), mounts=(MountState("/lus", False),),
                      local_dir=SpaceState("/tmp", 5), gpu_health=(GpuHealth("xpu-smi", 6, ("GPU 2: x",)),))
    facts = HealthFacts(base=base, torch_version=None, torch_error="no torch", node=node)
    assert HealthFacts.from_json(facts.to_json()).node == node


def plan(hosts: str, spares: int = 0):
    return plan_job(RunOptions(command=("prog",), hosts=hosts, spares=spares, launcher="ssh"), {})


def test_preflight_leaves_unhealthy_hosts_out_when_a_spare_takes_their_place():
    said: list[str] = []
    replanned = without_hosts(plan("a:1,b:1,c:1", spares=1), ["b"], said.append)
    assert [slot.hostname for slot in replanned.slots] == ["a", "c"]
    assert [host.name for host in replanned.hosts] == ["a", "c"]  # restarts never pick it either
    assert said == ["hvdrun: preflight: left out b; the job's 2 ranks run on a, c"]


def test_preflight_without_room_stops_naming_the_hosts():
    with pytest.raises(LaunchError, match=r"1 unhealthy host\(s\) \(b\), and the other hosts hold 1 of the job's 2 "
                                          r"ranks; no rank was started") as error:
        without_hosts(plan("a:1,b:1"), ["b"], print)
    assert error.value.host == "b"


def test_the_preflight_line_names_each_failed_check():
    report = HostReport("n7", "ssh", checks=[Check("reach", True, "ssh", "ok"),
                                             Check("mounts", False, "/lus mounted", "/lus is not a mount point"),
                                             Check("clock", False, "within 1 s", "+3.000 s")])
    assert failure_line(report) == ("mounts: /lus is not a mount point (expected /lus mounted); "
                                    "clock: +3.000 s (expected within 1 s)")


@pytest.mark.parametrize("args, fragment", [
    (("check", "-np", "1", "--mount", "lus"), "--mount lus: give the absolute path every node has"),
    (("check", "-np", "1", "--max-clock-skew", "0"), "must be a finite number of seconds above 0"),
    (("--preflight", "-np", "2", "--min-np", "1", "touch", "started"), "--preflight checks the hosts of a job of "
                                                                       "fixed ranks"),
])
def test_health_usage_errors_are_one_line_and_exit_2(args, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 2 and result.output.startswith("hvdrun: error: ") and result.output.count("\n") == 1
    assert fragment in result.output and not (tmp_path / "started").exists()
