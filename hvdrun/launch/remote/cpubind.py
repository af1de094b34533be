"""CPU binding of a rank: which cores ``--cpu-bind`` gives local rank L of R.

Policies (``--cpu-bind`` or the cluster YAML's ``cpu_bind``):

* ``none``: the rank keeps every core the job may use (the default).
* ``cores``: an equal, disjoint share of the cores allowed to the job on this host (a core's hardware
  threads stay together): where ``/sys`` tells the NUMA node of every local rank's GPU, each node's
  cores are shared by the ranks whose GPU sits there; else they are cut in NUMA order, so that a
  share stays on one NUMA node where the counts allow. With Polaris's reversed ``gpu_order``, local rank 0
  gets cores 0-7 (and their threads 32-39), the ones next to its GPU 3.
* ``numa``: every core of one NUMA node; ranks are spread over the nodes in order.
* ``list:A-B:C-D:...``: local rank L gets the L-th core list (``,`` and ``-`` inside an item,
  as ``taskset -c`` and Cray PALS write them).
* ``depth:D``: local rank L gets the D CPUs ``L*D .. L*D+D-1``, as Cray PALS's ``--depth=D --cpu-bind depth``
  places them (ALCF's Polaris examples use ``--depth=8``).

The guard applies it (``sched_setaffinity``) before the rank starts, so the rank and everything it
starts stay on those cores. Cray PALS (``numa``, ``list``, ``depth``) and srun (``numa``, ``list``) get
their own flags instead (see ``launch/mpiexec.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hvdrun.ranks import format_ranks

POLICIES = ("none", "cores", "numa")
_NODE_ROOT = Path("/sys/devices/system/node")
_CPU_ROOT = Path("/sys/devices/system/cpu")
_ITEM_RE = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
_EXPECTED = "expected none, cores, numa, depth:D or list:A-B:C-D... (one core list per local rank, e.g. list:0-7:8-15)"


class CpuBindError(ValueError):
    """A policy that cannot be read, or that does not fit this host."""


@dataclass(frozen=True)
class CpuBind:
    """A parsed ``--cpu-bind`` value: a policy name, the core lists of ``list:``, the ``D`` of ``depth:D``."""

    policy: str
    lists: tuple[frozenset[int], ...] = ()
    depth: int = 0

    @property
    def binds(self) -> bool:
        """Whether ranks are bound at all."""
        return self.policy != "none"


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> ``{0, 1, 2, 3, 8}`` (the kernel's and taskset's cpulist format)."""
    if not _ITEM_RE.fullmatch(text.strip()):
        raise CpuBindError(f"{text!r} is not a core list such as 0-7 or 0-3,8")
    cores: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise CpuBindError(f"core range {part!r} runs backwards")
        cores.update(range(low, high + 1))
    return frozenset(cores)


def format_cpulist(cores: set[int] | frozenset[int]) -> str:
    """``{0, 1, 2, 3, 8}`` -> ``"0-3,8"`` (the kernel's and taskset's cpulist format)."""
    return format_ranks(cores)


def parse_cpu_bind(text: str) -> CpuBind:
    """Read a ``--cpu-bind`` value; raises :class:`CpuBindError` naming what is expected."""
    if text in POLICIES:
        return CpuBind(text)
    if text.startswith("list:") and text[5:]:
        return CpuBind("list", tuple(parse_cpulist(item) for item in text[5:].split(":")))
    if text.startswith("depth:"):
        depth = text[6:]
        if not depth.isdigit() or int(depth) < 1:
            raise CpuBindError(f"--cpu-bind {text!r}: depth:D takes a positive number of CPUs per rank, e.g. depth:8")
        return CpuBind("depth", depth=int(depth))
    raise CpuBindError(f"--cpu-bind {text!r}: {_EXPECTED}")


def numa_nodes(root: Path = _NODE_ROOT) -> dict[int, frozenset[int]]:
    """This host's NUMA nodes and their cores, from ``/sys`` (empty when it does not say)."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*")):
        try:
            cores = parse_cpulist((path / "cpulist").read_text())
        except (OSError, CpuBindError):
            continue
        if cores:
            nodes[int(path.name[4:])] = cores
    return nodes


def thread_siblings(cpus: set[int] | frozenset[int], root: Path = _CPU_ROOT) -> dict[int, frozenset[int]]:
    """Each CPU's hardware-thread siblings (itself included) from ``/sys``; alone where it does not say."""
    siblings = {}
    for cpu in cpus:
        try:
            siblings[cpu] = parse_cpulist((root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, CpuBindError):
            siblings[cpu] = frozenset({cpu})
    return siblings


def cores_for(bind: CpuBind, local_rank: int, local_size: int, allowed: set[int] | frozenset[int],
              nodes: dict[int, frozenset[int]], siblings: dict[int, frozenset[int]] | None = None,
              gpu_nodes: list[int] | None = None) -> frozenset[int]:
    """The cores of ``local_rank`` (of ``local_size`` on this host) under ``bind``.

    Args:
        allowed: the cores the job may use here (``os.sched_getaffinity(0)``).
        nodes: this host's NUMA nodes (:func:`numa_nodes`); one node holding ``allowed`` when empty.
        siblings: each CPU's hardware threads (:func:`thread_siblings`); every CPU its own core when None.
        gpu_nodes: the NUMA node of each local rank's GPU, where ``/sys`` tells all of them: ``cores``
            then splits each NUMA node among the ranks whose GPU sits there.

    Raises:
        CpuBindError: the binding does not fit this host (too few cores or lists, cores not allowed).
    """
    allowed = frozenset(allowed)
    if bind.policy == "none":
        return allowed
    nodes = {n: cores & allowed for n, cores in (nodes or {0: allowed}).items() if cores & allowed}
    if bind.policy == "list":
        return _from_list(bind, local_rank, local_size, allowed)
    if bind.policy == "depth":
        first = local_rank * bind.depth
        return _allowed_or_error(frozenset(range(first, first + bind.depth)), f"depth:{bind.depth}", local_rank,
                                 allowed)
    if bind.policy == "numa":
        ordered = sorted(nodes)
        return nodes[ordered[local_rank * len(ordered) // local_size]]
    beside_gpu = _beside_gpu(local_rank, local_size, nodes, gpu_nodes)
    if beside_gpu is not None:
        node, local_rank, local_size = beside_gpu
        nodes = {node: nodes[node]}
        allowed = nodes[node]
    cores = _physical_cores(allowed, nodes, siblings or {})
    share = len(cores) // local_size
    if share < 1:
        raise CpuBindError(f"--cpu-bind cores: {local_size} ranks on this host but only {len(cores)} cores are "
                           f"allowed ({format_cpulist(allowed)})")
    return frozenset().union(*cores[local_rank * share:(local_rank + 1) * share])


def _beside_gpu(local_rank: int, local_size: int, nodes: dict[int, frozenset[int]],
                gpu_nodes: list[int] | None) -> tuple[int, int, int] | None:
    """(NUMA node of this rank's GPU, this rank's place among the ranks whose GPU sits there, their
    number), or None unless ``/sys`` placed every local rank's GPU on a node with allowed cores."""
    if not gpu_nodes or len(gpu_nodes) < local_size or any(gpu_nodes[r] not in nodes for r in range(local_size)):
        return None
    node = gpu_nodes[local_rank]
    sharing = [rank for rank in range(local_size) if gpu_nodes[rank] == node]
    return node, sharing.index(local_rank), len(sharing)


def _physical_cores(allowed: frozenset[int], nodes: dict[int, frozenset[int]],
                    siblings: dict[int, frozenset[int]]) -> list[frozenset[int]]:
    """The allowed CPUs grouped by physical core, in NUMA order, then by their first CPU."""
    node_of = {cpu: node for node, cpus in nodes.items() for cpu in cpus}
    groups = {siblings.get(cpu, frozenset({cpu})) & allowed for cpu in allowed}
    return sorted(groups, key=lambda group: (node_of.get(min(group), 0), min(group)))


def _from_list(bind: CpuBind, local_rank: int, local_size: int, allowed: frozenset[int]) -> frozenset[int]:
    if len(bind.lists) < local_size:
        raise CpuBindError(f"--cpu-bind list: gives {len(bind.lists)} core lists for {local_size} ranks on this host")
    return _allowed_or_error(bind.lists[local_rank], "list", local_rank, allowed)


def _allowed_or_error(cores: frozenset[int], policy: str, local_rank: int, allowed: frozenset[int]) -> frozenset[int]:
    outside = cores - allowed
    if outside:
        raise CpuBindError(f"--cpu-bind {policy}: local rank {local_rank} gets cores {format_cpulist(cores)}, but "
                           f"{format_cpulist(outside)} are not allowed here (allowed: {format_cpulist(allowed)})")
    return cores


def numa_of(cores: frozenset[int], nodes: dict[int, frozenset[int]]) -> str:
    """The NUMA node(s) ``cores`` sit on, e.g. ``0`` or ``0,1`` (``-`` when /sys does not say)."""
    touched = sorted(node for node, node_cores in nodes.items() if node_cores & cores)
    return ",".join(str(node) for node in touched) or "-"


_PCI_ROOT = Path("/sys/bus/pci/devices")
_GPU_VENDOR_IDS = {"nvidia": "0x10de", "intel": "0x8086", "amd": "0x1002"}


def gpu_numa_nodes(vendor: str, root: Path = _PCI_ROOT) -> list[int]:
    """The NUMA node of each ``vendor`` GPU in PCI order (-1 where ``/sys`` does not say); GPU i is index i
    of ``CUDA_VISIBLE_DEVICES`` with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, of ``ROCR_VISIBLE_DEVICES``, and
    the GPU of ``ZE_AFFINITY_MASK`` ids ``i`` and ``i.tile``."""
    nodes = []
    for device in sorted(root.glob("*")):
        try:
            if (device / "vendor").read_text().strip() != _GPU_VENDOR_IDS.get(vendor) or \
                    not (device / "class").read_text().strip().startswith(("0x03", "0x12")):
                continue  # display controllers, and processing accelerators (Intel GPU Max, AMD Instinct)
            nodes.append(int((device / "numa_node").read_text().strip()))
        except (OSError, ValueError):
            continue
    return nodes


def gpu_index(device: str) -> int | None:
    """The GPU a device id names (``3``, ``3.1``), or None for UUIDs."""
    head = device.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def local_gpu_nodes(devices: list[tuple[str, ...]], gpu_numa: list[int]) -> list[int]:
    """The NUMA node of each local rank's (first) GPU, -1 where unknown; ``devices[L]`` are rank L's ids."""
    def node(ids: tuple[str, ...]) -> int:
        index = gpu_index(ids[0]) if ids else None
        return gpu_numa[index] if index is not None and index < len(gpu_numa) else -1
    return [node(ids) for ids in devices]
