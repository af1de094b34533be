"""Rank assignment: hosts + number of processes -> one :class:`Slot` per rank. Pure, no I/O.

Hosts are filled in the given order, all slots of a host before the next one (Horovod's
rule). Example, ``-H a:2,b:4 -np 5``::

    rank  host  local_rank  local_size  cross_rank  cross_size
    0     a     0           2           0           2
    1     a     1           2           0           2
    2     b     0           3           1           2
    3     b     1           3           1           2
    4     b     2           3           0           1

``cross_rank`` is the index of the host among the hosts that have a rank with the same
local rank, ``cross_size`` the number of such hosts.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

from hvdrun.errors import UsageError
from hvdrun.hosts import Host

GPU_VENDORS = ("nvidia", "intel", "amd")
GPU_BINDERS = ("hvdrun", "launcher")
# node: every rank sees its host's devices in the affinity order, so ordinal ``local_rank`` is its own device (the
# contract of horovodrun, torchrun and every script's ``set_device(local_rank)``); rank: each rank sees only its own
GPU_VISIBILITIES = ("node", "rank")


@dataclass(frozen=True)
class GpuLayout:
    """How GPUs are handed out on every host.

    Attributes:
        gpus_per_node: devices ranks are pinned to on each host (0: no pinning); on Intel GPUs
            with tiles, the tiles (Aurora: 6 GPUs x 2 tiles = 12).
        gpu_order: device ids in the machine's order (Polaris: 3,2,1,0); default 0..G-1, or
            ``GPU.tile`` ids (0.0, 0.1, 1.0, ...) where ``tiles_per_gpu`` is above 1.
        gpus_per_rank: consecutive devices each rank gets.
        vendor: nvidia, intel or amd: which variable pins a rank (see ``envvars.device_env``).
        tiles_per_gpu: tiles of each Intel GPU that ranks are pinned to one by one.
        binder: ``hvdrun`` (the vendor's variable, set per rank) or ``launcher``: Cray PALS's
            ``--gpu-bind list:...`` pins the same devices and hvdrun sets no variable (``rank`` visibility only).
        visibility: ``node`` (each rank sees the host's devices in ``gpu_order``; its own is ordinal
            ``local_rank * gpus_per_rank``) or ``rank`` (each rank sees only its own devices, as ordinals 0..).
    """

    gpus_per_node: int = 0
    gpu_order: tuple[str, ...] | None = None
    gpus_per_rank: int = 1
    vendor: str = "nvidia"
    tiles_per_gpu: int = 1
    binder: str = "hvdrun"
    visibility: str = "node"
    given_by: str = ""  # where the devices came from when the scheduler chose them (``CUDA_VISIBLE_DEVICES=2,5``)

    def default_order(self) -> tuple[str, ...]:
        """Device ids in index order: ``0..G-1`` (with tiles, Level Zero's FLAT ids: tile t of GPU g is
        ``g * tiles_per_gpu + t``)."""
        return tuple(str(i) for i in range(self.gpus_per_node))

    def order(self) -> tuple[str, ...]:
        """The host's devices in the machine's affinity order (local rank 0's first)."""
        return self.gpu_order or self.default_order()

    def visible_for(self, local_rank: int, host: str) -> tuple[str, ...]:
        """What ``local_rank`` on ``host`` is shown (see ``visibility``), tiles as FLAT ids under ``node``.

        Raises:
            UsageError: its own devices are missing, or an Intel order Level Zero cannot show (it lists the
                masked devices in index order, so ``node`` visibility needs them ascending).
        """
        own = self.devices_for(local_rank, host)
        if self.visibility == "rank":
            return own
        shown = tuple(self._flat(device) for device in self.order())
        if self.vendor == "intel" and all(d.isdigit() for d in shown) and list(shown) != sorted(shown, key=int):
            raise UsageError(f"gpu_order {','.join(self.order())} on host '{host}': Level Zero shows the devices of a "
                             "mask in index order, so with gpu_visibility node (every rank sees the node's) the order "
                             "must be ascending; give an ascending gpu_order, or --gpu-visibility rank")
        return shown

    def _flat(self, device: str) -> str:
        """A ``GPU.tile`` id as Level Zero's FLAT id (``1.1`` is 3 with 2 tiles a GPU); other ids as they are."""
        gpu, dot, tile = device.partition(".")
        if self.vendor != "intel" or not dot or not (gpu.isdigit() and tile.isdigit()):
            return device
        return str(int(gpu) * self.tiles_per_gpu + int(tile))

    def ordinal_for(self, local_rank: int) -> int:
        """The index of ``local_rank``'s first device among the devices it sees."""
        return 0 if self.visibility == "rank" else local_rank * self.gpus_per_rank

    def cards_for(self, local_rank: int, host: str) -> tuple[str, ...]:
        """The GPUs (cards) of ``local_rank``'s devices: a tile's FLAT id names GPU ``id // tiles_per_gpu``
        (for NUMA lookups, which /sys answers per card)."""
        return tuple(str(int(d) // self.tiles_per_gpu) if self._tiled(d) else d
                     for d in self.devices_for(local_rank, host))

    def tile_ids_for(self, local_rank: int, host: str) -> tuple[str, ...]:
        """``local_rank``'s devices with tiles as ``GPU.tile`` ids (FLAT id 3 is ``1.1``): what Cray PALS's
        ``--gpu-bind list:`` parses (ALCF's Aurora page: FLAT ids fail there); other ids as they are."""
        tiles = self.tiles_per_gpu
        return tuple(f"{int(d) // tiles}.{int(d) % tiles}" if self._tiled(d) else d
                     for d in self.devices_for(local_rank, host))

    def _tiled(self, device: str) -> bool:
        """Whether ``device`` is the FLAT id of a tile (Intel GPUs whose tiles each get a rank)."""
        return self.vendor == "intel" and self.tiles_per_gpu > 1 and device.isdigit()

    def hierarchy(self) -> str:
        """Level Zero's device hierarchy the ids a rank is shown need: ``FLAT`` (tiles as devices, FLAT ids; node
        visibility shows ``GPU.tile`` ids that way too), ``COMPOSITE`` (a rank shown only its ``GPU.tile`` ids),
        or "" (whole GPUs: whatever the site set)."""
        if self.vendor != "intel" or not self.gpus_per_node:
            return ""
        if self.visibility == "rank" and any("." in device for device in self.order()):
            return "COMPOSITE"
        return "FLAT" if self.tiles_per_gpu > 1 else ""

    def within(self, given: tuple[str, tuple[str, ...]]) -> GpuLayout:
        """This layout on the devices the scheduler gave the job (Slurm ``--gpus``, PBS by-gpu): ``given`` is
        ``(variable, ids)``; those of ``gpu_order`` in its order when it lists them all, else the ids as they came."""
        variable, ids = given
        order = self.order()
        kept = tuple(d for d in order if d in ids) if set(ids) <= set(order) else ids
        return replace(self, gpus_per_node=len(kept), gpu_order=kept, given_by=f"{variable}={','.join(ids)}")

    def devices_for(self, local_rank: int, host: str) -> tuple[str, ...]:
        """The devices of ``local_rank`` on ``host``; raises UsageError when there are too few."""
        if not self.gpus_per_node:
            return ()
        order = self.order()
        start = local_rank * self.gpus_per_rank
        if start + self.gpus_per_rank > len(order):
            given = f" (the job was given {self.given_by})" if self.given_by else ""
            raise UsageError(
                f"host '{host}' has {len(order)} GPUs{given} but local rank {local_rank} needs GPUs "
                f"{start}..{start + self.gpus_per_rank - 1} ({self.gpus_per_rank} per rank); "
                "lower -np or the slots of that host, or --gpus-per-rank"
            )
        return tuple(order[start:start + self.gpus_per_rank])


@dataclass(frozen=True)
class Topology:
    """A rank's place in the job: global, on its host, and across hosts."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def topologies(host_of_rank: Sequence[Hashable]) -> list[Topology]:
    """Every rank's topology from the host each rank runs on (Horovod's rules, hosts ordered by first rank).

    ``cross_rank`` is the index of the rank's host among the hosts that have a rank with the
    same local rank; ``cross_size`` is the number of such hosts. Linear in the number of ranks.
    """
    local_rank_of: list[int] = []
    count_on: dict[Hashable, int] = {}
    for host in host_of_rank:
        local_rank_of.append(count_on.get(host, 0))
        count_on[host] = local_rank_of[-1] + 1
    cross_rank_of: dict[tuple[Hashable, int], int] = {}
    hosts_with: list[int] = []  # hosts_with[L]: how many hosts have a rank with local rank L
    for host, count in count_on.items():  # dicts keep first-seen order: hosts by their first rank
        for local in range(count):
            if local == len(hosts_with):
                hosts_with.append(0)
            cross_rank_of[(host, local)] = hosts_with[local]
            hosts_with[local] += 1
    return [Topology(rank, len(host_of_rank), local, count_on[host], cross_rank_of[(host, local)], hosts_with[local])
            for rank, (host, local) in enumerate(zip(host_of_rank, local_rank_of, strict=True))]


@dataclass(frozen=True)
class Slot(Topology):
    """Where one rank runs: its topology, its host and its GPUs."""

    host: Host
    host_index: int
    devices: tuple[str, ...] = ()
    host_count: int = 1
    gpu_vendor: str = "nvidia"
    visible_devices: tuple[str, ...] = ()
    device_ordinal: int | None = None
    device_hierarchy: str = ""

    @property
    def hostname(self) -> str:
        """The host's name as the user gave it."""
        return self.host.name


def total_slots(hosts: Sequence[Host]) -> int:
    """Number of ranks the hosts can hold."""
    return sum(host.slots for host in hosts)


def _ranks_per_host(hosts: Sequence[Host], num_proc: int) -> list[int]:
    counts, left = [], num_proc
    for host in hosts:
        take = min(host.slots, left)
        counts.append(take)
        left -= take
    return counts


def _more_slots(hosts: Sequence[Host], num_proc: int) -> str:
    """Options that give ``hosts`` (all of them) room for ``num_proc`` ranks: ``-H a:6,b:6 or --ranks-per-node 6``."""
    per_host = -(-num_proc // max(len(hosts), 1))
    every_host = f"--ranks-per-node {per_host}"
    if len(hosts) > 4:  # an -H list too long to read
        return every_host
    return f"-H {','.join(f'{h.name}:{per_host}' for h in hosts)} or {every_host}"


def assign_slots(hosts: Sequence[Host], num_proc: int, gpus: GpuLayout | None = None) -> list[Slot]:
    """Assign ``num_proc`` ranks to ``hosts`` in order.

    Args:
        hosts: the hosts, in the order ranks fill them.
        num_proc: number of ranks; never more are started.
        gpus: GPU layout for ``CUDA_VISIBLE_DEVICES`` pinning, or None.

    Returns:
        One slot per rank, sorted by rank. Hosts that get no rank are left out.

    Raises:
        UsageError: ``num_proc`` is below 1 or above the total slots, or GPUs run out.
    """
    available = total_slots(hosts)
    if num_proc < 1:
        raise UsageError(f"-np must be at least 1, got {num_proc}")
    if num_proc > available:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise UsageError(f"-np {num_proc} is more than the {available} slots of the hosts ({listed}); "
                         f"lower -np or add slots, e.g. {_more_slots(hosts, num_proc)}")
    layout = gpus or GpuLayout()
    counts = _ranks_per_host(hosts, num_proc)
    used = [host for host, count in zip(hosts, counts, strict=True) for _ in range(count)]
    host_index = {host: index for index, host in enumerate(dict.fromkeys(used))}
    return [slot_on(layout, topology, host, host_index[host], len(host_index))
            for topology, host in zip(topologies(used), used, strict=True)]


def slot_on(layout: GpuLayout, topology: Topology, host: Host, host_index: int, host_count: int) -> Slot:
    """The slot of ``topology`` on ``host``, with its devices and what it sees of them under ``layout``."""
    local = topology.local_rank
    devices = layout.devices_for(local, host.name)
    return Slot(**vars(topology), host=host, host_index=host_index, devices=devices, host_count=host_count,
                gpu_vendor=layout.vendor, visible_devices=layout.visible_for(local, host.name) if devices else (),
                device_ordinal=layout.ordinal_for(local) if devices else None, device_hierarchy=layout.hierarchy())


def layout_value(layout: GpuLayout) -> str:
    """``layout`` as one JSON text, for a variable (read back with :func:`layout_of`)."""
    return json.dumps([layout.gpus_per_node, list(layout.gpu_order or ()), layout.gpus_per_rank, layout.vendor,
                       layout.tiles_per_gpu, layout.visibility])


def layout_of(value: str) -> GpuLayout:
    """The layout :func:`layout_value` wrote."""
    gpus_per_node, order, per_rank, vendor, tiles, *rest = json.loads(value)  # rest: visibility (hvdrun >= 33)
    return GpuLayout(gpus_per_node, tuple(order) or None, per_rank, vendor, tiles,
                     visibility=rest[0] if rest else "rank")


def parse_rank_list(text: str) -> frozenset[int]:
    """Ranks from ``0``, ``0,3-5`` (``--ranks-output``).

    Raises:
        UsageError: not a comma-separated list of ranks and ranges (e.g. ``0,3-5``).
    """
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or dash and not high.isdigit() or dash and int(high) < int(low):
            raise UsageError(f"{text!r} is not a list of ranks; expected ranks and ranges like '0' or '0,3-5'")
        ranks.update(range(int(low), int(high if dash else low) + 1))
    return frozenset(ranks)


def format_ranks(ranks: Iterable[int]) -> str:
    """``0,2-7``: ranks, consecutive ones folded into ranges (the inverse of :func:`parse_rank_list`)."""
    ordered = sorted(set(ranks))
    groups: list[list[int]] = []
    for rank in ordered:
        if groups and rank == groups[-1][-1] + 1:
            groups[-1].append(rank)
        else:
            groups.append([rank])
    return ",".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)
