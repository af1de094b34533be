"""The node checks of ``hvdrun check --health`` and ``hvdrun --preflight``: what a node's answer
(:class:`hvdrun.health.node_health.NodeHealth`) must show, judged on the launcher, one :class:`Check` each.

* ``interface``: the job's network interface is present, set up and has a carrier;
* ``mounts``: each of the job's file systems is a mount point that answers;
* ``local-dir``: the node-local directory has the free space asked for;
* ``gpu-health``: every vendor tool on the node answers and reports no problem, and the cluster's vendor's tool
  lists at least the GPUs the cluster file promises;
* ``clock``: the node's clock is within ``max_clock_skew_s`` of the launcher's, the round trip allowed for
  (:func:`clock_offset`, :func:`clock_check`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hvdrun.config import ClusterConfig
from hvdrun.health.node_health import GpuHealth, InterfaceState, MountState, NodeHealth, SpaceState
from hvdrun.health.verdict import Check
from hvdrun.ranks import GpuLayout

_GB = 1e9
DEFAULT_MIN_LOCAL_GB = 1.0
DEFAULT_MAX_CLOCK_SKEW_S = 1.0
VENDOR_TOOL = {"nvidia": "nvidia-smi", "intel": "xpu-smi", "amd": "rocm-smi"}  # the tool that counts each GPU
NODE_CHECKS = ("interface", "mounts", "local-dir", "gpu-health", "clock")


@dataclass(frozen=True)
class HealthOptions:
    """What ``--health`` was told on the command line; None and empty fall back to the cluster file."""

    interface: str | None = None
    mounts: tuple[str, ...] = ()
    local_dir: str | None = None
    min_local_gb: float = DEFAULT_MIN_LOCAL_GB
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S


@dataclass(frozen=True)
class NodeExpectations:
    """What every node must show; ``origin`` says where each expectation came from (check name -> words)."""

    interface: str | None = None
    mounts: tuple[str, ...] = ()
    local_dir: str | None = None
    min_local_bytes: int = int(DEFAULT_MIN_LOCAL_GB * _GB)
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S
    vendor: str = "nvidia"
    gpus: int = 0  # physical GPUs (not tiles) the vendor's tool must list
    origin: Mapping[str, str] = field(default_factory=dict)

    def probe_args(self) -> list[str]:
        """The arguments of ``on_host facts`` that ask a node for these."""
        args = ["--health"] + (["--health-interface", self.interface] if self.interface else [])
        for path in self.mounts:
            args += ["--mount", path]
        return args + (["--local-dir", self.local_dir] if self.local_dir else [])


def node_checks(health: NodeHealth | None, expect: NodeExpectations, host: str) -> list[Check]:
    """The interface, mounts, local-dir and gpu-health verdicts of one node's answer (the clock is apart)."""
    if health is None:
        return [Check("gpu-health", False, "an answer to --health", "the node said nothing about its health",
                      f"install the same hvdrun on {host} as on the launcher")]
    checks = []
    if expect.interface:
        checks.append(interface_check(_interface(health, expect.interface), expect, host))
    if expect.mounts:
        checks.append(mounts_check(health.mounts, expect, host))
    if expect.local_dir and health.local_dir is not None:
        checks.append(local_dir_check(health.local_dir, expect, host))
    return [*checks, gpu_health_check(health.gpu_health, expect, host)]


def _interface(health: NodeHealth, name: str) -> InterfaceState:
    return next((i for i in health.interfaces if i.name == name), InterfaceState(name, present=False))


def _from(expect: NodeExpectations, check: str) -> str:
    origin = expect.origin.get(check)
    return f" ({origin})" if origin else ""


def interface_check(state: InterfaceState, expect: NodeExpectations, host: str) -> Check:
    """The job's interface on ``host``: present, set up, with a carrier."""
    expected = f"{state.name} present, up, with carrier{_from(expect, 'interface')}"
    if not state.present:
        return Check("interface", False, expected, f"no interface {state.name}",
                     f"check the network driver on {host} ('ip link'), or give the interface the job uses "
                     "(--network-interface, network_interface in the cluster file)")
    if not state.up:
        return Check("interface", False, expected, f"{state.name} is down (operstate {state.operstate or '?'})",
                     f"bring it up on {host} ('ip link set {state.name} up') or leave the node out")
    if state.carrier is False:
        return Check("interface", False, expected, f"{state.name} is up but has no carrier (operstate "
                     f"{state.operstate or '?'}): no link", f"check {host}'s cable or switch port of {state.name}")
    return Check("interface", True, expected, f"{state.name} up, carrier (operstate {state.operstate or '?'})")


def mounts_check(mounts: Sequence[MountState], expect: NodeExpectations, host: str) -> Check:
    """Every one of the job's file systems is mounted on ``host`` and answers."""
    expected = f"{', '.join(expect.mounts)} mounted{_from(expect, 'mounts')}"
    missing = [_mount_problem(m) for m in mounts if not m.mounted]
    if missing:
        return Check("mounts", False, expected, "; ".join(missing),
                     f"mount the job's file systems on {host}, or leave the node out")
    return Check("mounts", True, expected, ", ".join(f"{m.path} ({m.fstype})" for m in mounts))


def _mount_problem(mount: MountState) -> str:
    if mount.fstype:
        return f"{mount.path} ({mount.fstype} from {mount.source}) does not answer: {mount.error}"
    return f"{mount.path} is not a mount point" + (f" ({mount.error})" if mount.error else "")


def local_dir_check(space: SpaceState, expect: NodeExpectations, host: str) -> Check:
    """The node-local directory has at least ``min_local_bytes`` free."""
    expected = f">= {expect.min_local_bytes / _GB:g} GB free in {space.path}{_from(expect, 'local-dir')}"
    if space.free_bytes is None:
        return Check("local-dir", False, expected, f"{space.path}: {space.error}",
                     f"create {space.path} on {host}, or give a node-local directory that exists (--local-dir, "
                     "local_dir in the cluster file)")
    ok = space.free_bytes >= expect.min_local_bytes
    return Check("local-dir", ok, expected, f"{_size(space.free_bytes)} free",
                 None if ok else f"free space in {space.path} on {host} (files of earlier jobs?), or leave it out")


def _size(count: int) -> str:
    return f"{count / _GB:.2f} GB" if count >= 10_000_000 else f"{count / 1e6:.2f} MB"


def gpu_health_check(answers: Sequence[GpuHealth], expect: NodeExpectations, host: str) -> Check:
    """Every vendor tool on the node answered without a problem; the cluster vendor's tool lists enough GPUs."""
    tool = VENDOR_TOOL.get(expect.vendor, "")
    wanted = f"{expect.gpus} {expect.vendor} GPUs listed by {tool}{_from(expect, 'gpu-health')}, " if expect.gpus \
        else ""
    expected = f"{wanted}no ECC, retired-page, row-remap or RAS problem (nvidia-smi, xpu-smi, rocm-smi where present)"
    problems = [f"{a.tool}: {a.error}" for a in answers if a.error]
    problems += [problem for a in answers for problem in a.problems]
    counted = next((a for a in answers if a.tool == tool and not a.error), None)
    if expect.gpus and counted is not None and counted.devices < expect.gpus:
        problems.insert(0, f"{tool} lists {counted.devices} GPUs, not {expect.gpus}")
    notes = [note for a in answers for note in a.notes]
    if problems:
        return Check("gpu-health", False, expected, "; ".join(problems),
                     f"leave {host} out and have its GPUs serviced (a reset clears pending retirements and remaps)")
    if not answers:
        return Check("gpu-health", True, expected, "no vendor tool on PATH (nvidia-smi, xpu-smi, rocm-smi)")
    found = ", ".join(f"{a.tool}: {a.devices} GPUs healthy" for a in answers)
    return Check("gpu-health", True, expected, "; ".join([found, *notes]),
                 f"look at the GPUs of {host}" if notes else None, warn=bool(notes))


# -- the clock ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClockReading:
    """A node's clock minus the launcher's (``offset_s``), read over a round trip of ``rtt_s``."""

    offset_s: float
    rtt_s: float


def clock_offset(ask: Callable[[], float], samples: int = 3, now: Callable[[], float] = time.time) -> ClockReading:
    """The node's clock against ``now``'s, the sample of the shortest round trip of ``samples`` (NTP's choice).

    Each sample: ``sent = now()``, the node's ``ask()``, ``received = now()``; the node read its clock somewhere
    between, so it is taken at the middle, off by at most half the round trip::

        sent 100.000, node says 102.510, received 100.020  ->  offset +2.500 s, +- 0.010 s
    """
    best: ClockReading | None = None
    for _ in range(max(samples, 1)):
        sent = now()
        remote = ask()
        received = now()
        reading = ClockReading(remote - (sent + received) / 2, received - sent)
        if best is None or reading.rtt_s < best.rtt_s:
            best = reading
    assert best is not None
    return best


def clock_check(reading: ClockReading, max_skew_s: float, host: str) -> Check:
    """Fails when the node's clock is surely more than ``max_skew_s`` off (the offset less half the round trip);
    a warning when it may be (the round trip too long to tell)."""
    margin = reading.rtt_s / 2
    expected = f"within {max_skew_s:g} s of the launcher's clock"
    found = f"{reading.offset_s:+.3f} s (+- {margin:.3f} s, half the round trip)"
    least, most = abs(reading.offset_s) - margin, abs(reading.offset_s) + margin
    if least > max_skew_s:
        return Check("clock", False, expected, found,
                     f"synchronise {host}'s clock (chronyc tracking; systemctl restart chronyd), or leave it out")
    if most > max_skew_s:
        return Check("clock", True, expected, found + ": the round trip is too long to tell",
                     f"check {host}'s clock by hand (chronyc tracking)", warn=True)
    return Check("clock", True, expected, found)


def clock_unread(why: str, max_skew_s: float) -> Check:
    """The clock check of a node whose clock could not be read."""
    return Check("clock", False, f"within {max_skew_s:g} s of the launcher's clock", f"could not read it: {why}",
                 "see why the node did not answer")


# -- what is expected, from the options and the cluster file ---------------------------------------------------

def node_expectations(options: HealthOptions, config: ClusterConfig | None, layout: GpuLayout,
                      job_interface: tuple[str | None, str] = (None, "")) -> NodeExpectations:
    """What every node must show: each option given, else the job's (``job_interface``: its name and where it came
    from), else the cluster file's (``network_interface``, ``mounts``, ``local_dir``); the GPUs from ``layout``."""
    source = config.source if config else ""
    origin: dict[str, str] = {}
    interface = _first(origin, "interface", (options.interface, "--interface"), job_interface,
                       (config.network_interface if config else None, f"network_interface of {source}"))
    mounts = _first(origin, "mounts", (options.mounts or None, "--mount"),
                    (config.mounts if config and config.mounts else None, f"mounts of {source}"))
    local_dir = _first(origin, "local-dir", (options.local_dir, "--local-dir"),
                       (config.local_dir if config else None, f"local_dir of {source}"))
    gpus = layout.gpus_per_node // max(layout.tiles_per_gpu, 1)
    if gpus and layout.tiles_per_gpu > 1:
        origin["gpu-health"] = f"{layout.gpus_per_node} devices = {gpus} GPUs x {layout.tiles_per_gpu} tiles"
    return NodeExpectations(interface=interface, mounts=tuple(mounts or ()), local_dir=local_dir,
                            min_local_bytes=int(options.min_local_gb * _GB), max_clock_skew_s=options.max_clock_skew_s,
                            vendor=layout.vendor, gpus=gpus, origin=origin)


T = TypeVar("T")


def _first(origin: dict[str, str], check: str, *choices: tuple[T | None, str]) -> T | None:
    """The first value of ``choices`` given, noting where it came from in ``origin``."""
    for value, where in choices:
        if value:
            origin[check] = where
            return value
    return None
