"""What a node says about its own health (``python -m hvdrun.health.on_host facts --health ...``); stdlib only.

Each reading is bounded (a hung file system or a vendor tool that never answers is named, not waited on):

* the job's network interface: ``/sys/class/net/NAME`` (present), its ``flags`` (IFF_UP: set up) and ``carrier``
  (the link has a peer; the kernel refuses to read it while the interface is down);
* the job's file systems: each path is a mount point in ``/proc/self/mountinfo`` and answers ``statvfs``;
* the node-local directory: its free bytes (``statvfs``: blocks available to users, times the fragment size);
* the vendor tools that are on PATH, each under a timeout, read from their documented output:
  ``nvidia-smi -q`` (ECC errors, retired pages, remapped rows), ``xpu-smi health -l`` (each component's status),
  ``rocm-smi --showrasinfo all`` (each RAS block's state);
* the wall clock, on request: :func:`serve_clock` answers each line it reads with ``time.time()``, so that the
  launcher can time the round trip (:func:`hvdrun.health.node_checks.clock_offset`).

The judging is the launcher's (:mod:`hvdrun.health.node_checks`); a parser here only turns a tool's text into
problems (the node must not be used) and notes (it may, but deserves a look).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYS_CLASS_NET = Path("/sys/class/net")
MOUNTINFO = Path("/proc/self/mountinfo")
IFF_UP = 0x1
STATVFS_TIMEOUT_S = 5.0
TOOL_TIMEOUT_S = 20.0  # nvidia-smi -q on eight GPUs takes seconds


@dataclass(frozen=True)
class InterfaceState:
    """A network interface as ``/sys/class/net`` shows it; ``carrier`` None: unknown (the interface is down)."""

    name: str
    present: bool
    up: bool = False
    carrier: bool | None = None
    operstate: str = ""


@dataclass(frozen=True)
class MountState:
    """Whether ``path`` is a mount point (and of what), or why it cannot be used."""

    path: str
    mounted: bool
    fstype: str = ""
    source: str = ""
    error: str | None = None


@dataclass(frozen=True)
class SpaceState:
    """The free bytes of a directory, or why they could not be read."""

    path: str
    free_bytes: int | None
    error: str | None = None


@dataclass(frozen=True)
class GpuHealth:
    """What one vendor tool said: the devices it listed, problems (do not use the node), notes (look at it)."""

    tool: str
    devices: int = 0
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class NodeHealth:
    """A node's answer: the interfaces, mounts, local directory and vendor tools asked about."""

    interfaces: tuple[InterfaceState, ...] = ()
    mounts: tuple[MountState, ...] = ()
    local_dir: SpaceState | None = None
    gpu_health: tuple[GpuHealth, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeHealth:
        """Parse :meth:`to_dict`'s dict."""
        local = data.get("local_dir")
        return cls(interfaces=tuple(InterfaceState(**i) for i in data.get("interfaces", ())),
                   mounts=tuple(MountState(**m) for m in data.get("mounts", ())),
                   local_dir=SpaceState(**local) if local else None,
                   gpu_health=tuple(GpuHealth(**{**g, "problems": tuple(g["problems"]), "notes": tuple(g["notes"])})
                                    for g in data.get("gpu_health", ())))


# -- the network interface ------------------------------------------------------------------------------------------

def interface_state(name: str, root: Path = SYS_CLASS_NET) -> InterfaceState:
    """``name`` as ``root`` (``/sys/class/net``) shows it: present, set up (IFF_UP), carrier, operstate."""
    folder = root / name
    if "/" in name or not folder.exists():
        return InterfaceState(name, present=False)
    flags = _read_int(folder / "flags", base=16)
    carrier = _read_int(folder / "carrier")  # EINVAL while the interface is down
    return InterfaceState(name, present=True, up=bool(flags is not None and flags & IFF_UP),
                          carrier=None if carrier is None else carrier == 1,
                          operstate=_read_text(folder / "operstate") or "")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read_text(path)
    try:
        return int(text, base) if text else None
    except ValueError:
        return None


# -- file systems ------------------------------------------------------------------------------------------------

def parse_mountinfo(text: str) -> dict[str, tuple[str, str]]:
    """Mount point -> (file system type, source) of ``/proc/self/mountinfo``'s lines; the last mount of a point
    wins (it hides the ones below). Fields: ``ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE ...``,
    with space, tab, newline and backslash written as octal escapes (``\\040``)."""
    points: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 2:
            points[_unescape(fields[4])] = (tail[0], _unescape(tail[1]))
    return points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_states(paths: Sequence[str], mountinfo: Path = MOUNTINFO,
                 timeout_s: float = STATVFS_TIMEOUT_S) -> tuple[MountState, ...]:
    """Whether each of ``paths`` is a mount point that answers ``statvfs`` within ``timeout_s``."""
    try:
        points = parse_mountinfo(mountinfo.read_text())
    except OSError as e:
        return tuple(MountState(p, False, error=f"cannot read {mountinfo}: {e.strerror}") for p in paths)
    return tuple(_mount_state(path, points, timeout_s) for path in paths)


def _mount_state(path: str, points: dict[str, tuple[str, str]], timeout_s: float) -> MountState:
    real = os.path.realpath(path)
    if real not in points:
        why = None if os.path.isdir(real) else "no such directory"
        return MountState(path, False, error=why)
    fstype, source = points[real]
    _, error = statvfs_within(real, timeout_s)
    return MountState(path, error is None, fstype, source, error)


def statvfs_within(path: str, timeout_s: float = STATVFS_TIMEOUT_S) -> tuple[os.statvfs_result | None, str | None]:
    """``os.statvfs(path)`` in a thread, so a hung file system is named after ``timeout_s``, not waited on."""
    result: list[os.statvfs_result | BaseException] = []
    thread = threading.Thread(target=lambda: result.append(_statvfs(path)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return None, f"statvfs did not answer within {timeout_s:g} s (a hung file system)"
    answer = result[0]
    if isinstance(answer, OSError):
        return None, answer.strerror or str(answer)
    return (answer, None) if isinstance(answer, os.statvfs_result) else (None, str(answer))


def _statvfs(path: str) -> os.statvfs_result | BaseException:
    try:
        return os.statvfs(path)
    except OSError as e:
        return e


def free_space(path: str, timeout_s: float = STATVFS_TIMEOUT_S) -> SpaceState:
    """The bytes an unprivileged user may still write in ``path``."""
    if not os.path.isdir(path):
        return SpaceState(path, None, "no such directory")
    stat, error = statvfs_within(path, timeout_s)
    return SpaceState(path, stat.f_bavail * stat.f_frsize if stat else None, error)


# -- vendor tools ----------------------------------------------------------------------------------------------------

def parse_nvidia_smi_q(text: str) -> GpuHealth:
    """The memory health of every GPU in ``nvidia-smi -q``'s report (one ``GPU 00000000:3B:00.0`` block each).

    Problems: uncorrectable ECC errors since the driver loaded (``ECC Errors > Volatile``: ``DRAM Uncorrectable``,
    ``SRAM Uncorrectable...``, or before Ampere ``Double Bit > Total``), a page retirement pending (``Retired Pages >
    Pending Page Blacklist``, before that ``Pending``: Yes), a row remap pending or failed (``Remapped Rows >
    Pending``, ``Remapping Failure Occurred``: Yes). Notes: uncorrectable errors in the GPU's lifetime only
    (``Aggregate``): the pages or rows behind them are already retired.
    """
    problems: list[str] = []
    notes: list[str] = []
    gpus = _nvidia_blocks(text)
    for index, (bus, values) in enumerate(gpus):
        where = f"GPU {index} ({bus})"
        volatile, aggregate = _uncorrectable(values, "Volatile"), _uncorrectable(values, "Aggregate")
        if volatile:
            problems.append(f"{where}: {volatile} uncorrectable ECC errors since the driver loaded")
        elif aggregate:
            notes.append(f"{where}: {aggregate} uncorrectable ECC errors in its lifetime (aggregate)")
        if _yes(values, "Retired Pages/Pending Page Blacklist") or _yes(values, "Retired Pages/Pending"):
            problems.append(f"{where}: a page retirement is pending (a GPU reset retires it)")
        if _yes(values, "Remapped Rows/Pending"):
            problems.append(f"{where}: a row remap is pending (a GPU reset applies it)")
        if _yes(values, "Remapped Rows/Remapping Failure Occurred"):
            problems.append(f"{where}: row remapping failed (the GPU needs service)")
    return GpuHealth("nvidia-smi", len(gpus), tuple(problems), tuple(notes))


_KEY_VALUE = re.compile(r"^(\s*)(\S.*?)\s+:\s?(.*)$")


def _nvidia_blocks(text: str) -> list[tuple[str, dict[str, str]]]:
    """(bus id, section path -> value) per GPU block; a path is ``ECC Errors/Volatile/DRAM Uncorrectable``."""
    gpus: list[tuple[str, dict[str, str]]] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            if line.startswith("GPU "):
                gpus.append((line[4:].strip(), {}))
            stack = []
            continue
        if not gpus:
            continue
        stack = [(i, name) for i, name in stack if i < indent]
        found = _KEY_VALUE.match(line)
        if found:
            gpus[-1][1]["/".join([*(name for _, name in stack), found.group(2)])] = found.group(3).strip()
        else:
            stack.append((indent, line.strip()))
    return gpus


def _uncorrectable(values: dict[str, str], kind: str) -> int:
    prefix = f"ECC Errors/{kind}/"
    total = 0
    for path, value in values.items():
        if not path.startswith(prefix) or not value.isdigit():
            continue
        rest = path[len(prefix):]
        if "Uncorrectable" in rest.split("/")[-1] or rest == "Double Bit/Total":
            total += int(value)
    return total


def _yes(values: dict[str, str], path: str) -> bool:
    return values.get(path, "").lower() == "yes"


def parse_xpu_smi_health(text: str) -> GpuHealth:
    """``xpu-smi health -l``'s table: a ``Device ID`` row per GPU, then a row per component (``4. GPU Memory``)
    whose cells say ``Status: Ok|Warning|Critical|Unknown`` and ``Description: ...``. Critical is a problem,
    Warning a note; Unknown (not measured) says nothing."""
    devices: list[str] = []
    component, status = "", ""
    problems: list[str] = []
    notes: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2:
            continue
        if cells[0] == "Device ID":
            devices.append(cells[1])
            continue
        if cells[0]:
            component = re.sub(r"^\d+\.\s*", "", cells[0])
        if cells[1].startswith("Status:"):
            status = cells[1].split(":", 1)[1].strip().lower()
        elif cells[1].startswith("Description:") and status in ("critical", "warning") and devices:
            line_text = f"GPU {devices[-1]}: {component}: {status} ({cells[1].split(':', 1)[1].strip()})"
            (problems if status == "critical" else notes).append(line_text)
            status = ""
    return GpuHealth("xpu-smi", len(devices), tuple(problems), tuple(notes))


_RAS_ROW = re.compile(r"^\s*([A-Z][A-Z0-9_]*)\s+(NONE|DISABLED|UNKNOWN ERROR|SING|MULT|POSITION|ENABLED)\b")
_RAS_BAD = {"MULT": "multiple uncorrectable errors", "POSITION": "a page isolated, treated as uncorrectable"}


def parse_rocm_smi_ras(text: str) -> GpuHealth:
    """``rocm-smi --showrasinfo all``: a ``GPU[N]:  RAS INFO`` table per GPU, a row per block with its state as
    rocm_smi.py names it (``NONE DISABLED UNKNOWN ERROR SING MULT POSITION ENABLED``). MULT (multiple uncorrectable
    errors) and POSITION (a page isolated, treated as uncorrectable) are problems. The counts are not judged:
    rocm_smi.py's header says "uncorrectable err, correctable err" while its rows hold the correctable count first."""
    devices: list[str] = []
    problems: list[str] = []
    for line in text.splitlines():
        header = re.match(r"^\s*GPU\[(\d+)\]\s*:", line)
        if header:
            devices.append(header.group(1))
            continue
        row = _RAS_ROW.match(line)
        if row and devices and row.group(2) in _RAS_BAD:
            problems.append(f"GPU {devices[-1]}: RAS block {row.group(1)}: {_RAS_BAD[row.group(2)]} "
                            f"({row.group(2)})")
    return GpuHealth("rocm-smi", len(dict.fromkeys(devices)), tuple(problems))


@dataclass(frozen=True)
class VendorTool:
    """A vendor's health command and the parser of its output."""

    program: str
    args: tuple[str, ...]
    parse: Callable[[str], GpuHealth] = field(compare=False)


VENDOR_TOOLS = (VendorTool("nvidia-smi", ("-q",), parse_nvidia_smi_q),
                VendorTool("xpu-smi", ("health", "-l"), parse_xpu_smi_health),
                VendorTool("rocm-smi", ("--showrasinfo", "all"), parse_rocm_smi_ras))


def vendor_health(tools: Sequence[VendorTool] = VENDOR_TOOLS,
                  timeout_s: float = TOOL_TIMEOUT_S) -> tuple[GpuHealth, ...]:
    """What each tool on PATH says (tools that are not installed say nothing)."""
    return tuple(_ask_tool(tool, program, timeout_s) for tool in tools if (program := shutil.which(tool.program)))


def _ask_tool(tool: VendorTool, program: str, timeout_s: float) -> GpuHealth:
    command = " ".join([tool.program, *tool.args])
    try:
        done = subprocess.run([program, *tool.args], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return GpuHealth(tool.program, error=f"'{command}' did not answer within {timeout_s:g} s")
    except OSError as e:
        return GpuHealth(tool.program, error=f"'{command}' could not run: {e.strerror or e}")
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-2:]) or "no output"
        return GpuHealth(tool.program, error=f"'{command}' failed with exit code {done.returncode}: {tail[:200]}")
    return tool.parse(done.stdout)


# -- everything ------------------------------------------------------------------------------------------------------

def node_health(interfaces: Sequence[str], mounts: Sequence[str], local_dir: str | None,
                tool_timeout_s: float = TOOL_TIMEOUT_S) -> NodeHealth:
    """The node's answer about ``interfaces``, ``mounts``, ``local_dir`` and every vendor tool on PATH (each tool
    bounded by ``tool_timeout_s``, each ``statvfs`` by the least of it and :data:`STATVFS_TIMEOUT_S`)."""
    statvfs_s = min(tool_timeout_s, STATVFS_TIMEOUT_S)
    return NodeHealth(interfaces=tuple(interface_state(name) for name in interfaces),
                      mounts=mount_states(mounts, timeout_s=statvfs_s),
                      local_dir=free_space(local_dir, statvfs_s) if local_dir else None,
                      gpu_health=vendor_health(timeout_s=tool_timeout_s))


CLOCK_READY = "ready"


def serve_clock(lines: Iterable[str], write: Callable[[str], None]) -> None:
    """Say :data:`CLOCK_READY`, then answer every line of ``lines`` (stdin) with this node's ``time.time()``."""
    write(f"{CLOCK_READY}\n")
    for _ in lines:
        write(f"{time.time()!r}\n")
