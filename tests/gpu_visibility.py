"""Each GPU vendor's visibility rule, applied to a rank's environment, and the idioms of unchanged scripts.

No GPU is needed: what a rank's runtime shows it is a function of its environment, by each vendor's
rule, taken at its strictest where a vendor's documentation leaves the order open:

* NVIDIA (CUDA): ``CUDA_VISIBLE_DEVICES`` lists the devices in order (device ``i`` is its ``i``-th entry);
  unset, every device in index order.
* AMD (ROCm): ``ROCR_VISIBLE_DEVICES`` chooses among the node's devices, kept in index order (whatever
  order it lists them in), then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``) lists, in order,
  indexes among what ROCR left.
* Intel (Level Zero): under ``ZE_FLAT_DEVICE_HIERARCHY=FLAT`` every tile is a device (FLAT id ``g * tiles + t``)
  and ``ZE_AFFINITY_MASK`` chooses FLAT ids, kept in index order; under ``COMPOSITE`` a mask of ``GPU.tile``
  ids shows each masked GPU, in index order, as one device made of its masked tiles.

The idioms pick an ordinal among what the rank sees: Horovod's ``set_device(hvd.local_rank())``, torchrun's
``set_device(int(os.environ["LOCAL_RANK"]))``, pytorch/examples' ``device_count() // local_world_size`` (first of
the rank's share) and ALCF's ``set_device(int(os.environ["PALS_LOCAL_RANKID"]))`` (set by PALS only).

``python tests/gpu_visibility.py`` prints the layout x idiom table for the shipped GPU clusters.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

Device = frozenset[str]  # the physical devices (FLAT ids, or GPU.tile ids under COMPOSITE) one ordinal reaches


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [part for part in value.split(",") if part]


def visible_devices(vendor: str, environ: Mapping[str, str], node: Sequence[str], tiles_per_gpu: int = 1
                    ) -> list[Device]:
    """What a rank's runtime shows it, ordinal by ordinal, on a node whose devices are ``node`` (index order;
    Intel: FLAT ids, ``tiles_per_gpu`` a GPU)."""
    if vendor == "amd":
        rocr = sorted(_split(environ.get("ROCR_VISIBLE_DEVICES")) or list(node), key=int)
        hip = _split(environ.get("HIP_VISIBLE_DEVICES") or environ.get("CUDA_VISIBLE_DEVICES"))
        shown = [rocr[int(i)] for i in hip if int(i) < len(rocr)] if hip is not None else rocr
        return [frozenset({d}) for d in shown]
    if vendor == "intel":
        mask = _split(environ.get("ZE_AFFINITY_MASK"))
        if environ.get("ZE_FLAT_DEVICE_HIERARCHY") == "COMPOSITE" and mask and "." in mask[0]:
            cards: dict[str, set[str]] = {}
            for tile in sorted(mask, key=lambda t: [int(part) for part in t.split(".")]):
                cards.setdefault(tile.split(".")[0], set()).update(own_device(vendor, tile, tiles_per_gpu))
            return [frozenset(tiles) for tiles in cards.values()]
        return [frozenset({d}) for d in sorted(mask if mask is not None else node, key=int)]
    shown_ids = _split(environ.get("CUDA_VISIBLE_DEVICES"))
    return [frozenset({d}) for d in (shown_ids if shown_ids is not None else node)]


def _horovod(env: Mapping[str, str], count: int) -> int:
    return int(env["HOROVOD_LOCAL_RANK"])


def _torchrun(env: Mapping[str, str], count: int) -> int:
    return int(env["LOCAL_RANK"])


def _pytorch_examples(env: Mapping[str, str], count: int) -> int:
    share = count // int(env["LOCAL_WORLD_SIZE"])
    if share == 0:
        raise LookupError(f"device_count() {count} // local_world_size {env['LOCAL_WORLD_SIZE']} is 0 devices")
    return int(env["LOCAL_RANK"]) * share


def _alcf(env: Mapping[str, str], count: int) -> int:
    return int(env["PALS_LOCAL_RANKID"])


IDIOMS: dict[str, Callable[[Mapping[str, str], int], int]] = {
    "set_device(hvd.local_rank())": _horovod,
    "set_device(LOCAL_RANK)": _torchrun,
    "device_count() // local_world_size": _pytorch_examples,
    "xpu.set_device(PALS_LOCAL_RANKID)": _alcf,
}


def reached(idiom: str, vendor: str, env: Mapping[str, str], node: Sequence[str], tiles_per_gpu: int = 1
            ) -> Device | str:
    """The devices ``idiom`` makes current for a rank with ``env``, or why it fails (a message)."""
    shown = visible_devices(vendor, env, node, tiles_per_gpu)
    try:
        ordinal = IDIOMS[idiom](env, len(shown))
    except KeyError as e:
        return f"{e.args[0]} is not set"
    except LookupError as e:
        return str(e)
    if not 0 <= ordinal < len(shown):
        return f"invalid device ordinal {ordinal} ({len(shown)} visible)"
    return shown[ordinal]


def own_device(vendor: str, device: str, tiles_per_gpu: int) -> Device:
    """The physical device of hvdrun's choice ``device`` as :func:`visible_devices` names it."""
    if vendor == "intel" and "." in device:  # a GPU.tile id: its FLAT id
        gpu, tile = device.split(".")
        return frozenset({str(int(gpu) * tiles_per_gpu + int(tile))})
    return frozenset({device})


def node_devices(vendor: str, gpus_per_node: int) -> list[str]:
    """A node's devices in index order (FLAT ids on Intel)."""
    return [str(i) for i in range(gpus_per_node)]


SHIPPED_LAYOUTS = ("polaris", "sophia", "slurm-amd", "aurora")


def rank_envs(cluster: str) -> tuple[object, list[tuple[object, dict[str, str]]]]:
    """The layout of ``cluster`` (its YAML) and every rank's environment on one full node, as this checkout's
    hvdrun gives them (PALS clusters: with the variables the PALS launcher adds)."""
    from hvdrun import envvars
    from hvdrun.config import load_cluster
    from hvdrun.hosts import Host
    from hvdrun.ranks import GpuLayout, assign_slots

    config = load_cluster(cluster)
    fields = {"gpus_per_node": config.gpus_per_node, "gpu_order": config.gpu_order, "vendor": config.gpu_vendor,
              "tiles_per_gpu": config.tiles_per_gpu}
    if "visibility" in GpuLayout.__dataclass_fields__:
        fields["visibility"] = config.gpu_visibility
    layout = GpuLayout(**fields)
    slots = assign_slots([Host("x1000c0s0b0n0", config.gpus_per_node)], config.gpus_per_node, layout)
    rendezvous = envvars.Rendezvous("10.0.0.1", 29400, 29401, "00" * 32, "job")
    pals = config.mpi_flavour == "pals"
    return layout, [(slot, {**envvars.worker_env(slot, rendezvous),
                            **({"PALS_LOCAL_RANKID": str(slot.local_rank)} if pals else {})})
                    for slot in slots]


def idiom_table() -> dict[str, dict[str, str]]:
    """Layout x idiom: ``all N`` where every local rank lands on its own GPU, else how many did and why not."""
    table: dict[str, dict[str, str]] = {}
    for cluster in SHIPPED_LAYOUTS:
        layout, ranks = rank_envs(cluster)
        node = node_devices(layout.vendor, layout.gpus_per_node)  # type: ignore[attr-defined]
        row = {}
        for idiom in IDIOMS:
            if idiom.startswith("xpu") and "PALS_LOCAL_RANKID" not in ranks[0][1]:
                row[idiom] = "n/a (not PALS)"
                continue
            good, why = 0, ""
            for slot, env in ranks:
                want = own_device(layout.vendor, slot.devices[0], layout.tiles_per_gpu)  # type: ignore
                got = reached(idiom, layout.vendor, env, node, layout.tiles_per_gpu)  # type: ignore
                good += got == want
                why = why or (got if isinstance(got, str) else "" if got == want else f"another GPU ({sorted(got)})")
            row[idiom] = f"all {len(ranks)}" if good == len(ranks) else f"{good}/{len(ranks)}: {why}"
        table[cluster] = row
    return table


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    rows = idiom_table()
    print("| layout | " + " | ".join(f"`{idiom}`" for idiom in IDIOMS) + " |")
    print("|---" * (len(IDIOMS) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row.values()) + " |")
