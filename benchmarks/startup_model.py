"""A model of start-up time (``hvdrun`` to every rank past ``init()``), calibrated here, extrapolated to thousands.

    python benchmarks/startup_model.py                                      # default parameters: the table
    python benchmarks/startup_model.py --fit benchmarks/results/startup.json --markdown   # docs/scaling.md's

H hosts, L ranks per host, C cores per host, N = H L. What each part costs (seconds; CPU seconds marked c_):

    t_cli      hvdrun's own start: Python, click, the plan                         (fit: intercept of `hvdrun true`)
    c_spawn    per rank, to start it under its guard (fork server: one fork + the guard's exec of the rank)
                                                                                  (fit: slope of `hvdrun -np N true`)
    c_rank     per rank, from exec to past init(): interpreter, imports, join, set-up (fit: slope of `hvdrun -np N`)
    c_ssh      per SSH connection, at the process that opens it (paramiko's handshake and the channel: Python)
    t_agent    per host, its agent: one Python start, then the fork server
    c_join     per connection a leader admits (rank 0's included): its handshake, its table, two set-up barriers
    c_row      per rank, at rank 0: its record read and put in the tables (every record reaches rank 0)
    t_link     per link a rank dials (TCP connect + the job secret's handshake); a rank dials log2 H + 2
    alpha      one control-plane hop between hosts

    launch     flat: H c_ssh at hvdrun, then one t_agent;   tree (fan-out k): ceil(log_k H) levels of
               k c_ssh + t_agent (each agent opens its children's connections in parallel with its siblings)
    on a host  L c_spawn / C + L c_rank / min(L, C)   (the host's ranks start in parallel on its cores)
    rendezvous the rendezvous tree (fan-out F, hvdrun/protocol/tree.py): rank 0 and every leader admit at most F
               hosts, d = ceil(log_F H) levels: d F c_join + N c_row + 2 (d + 1) x 3 barriers x alpha;
               without the tree (every host's leader on rank 0): H c_join; without host leaders (every rank
               on rank 0, the old star): N c_join
    links      (log2 H + 2) t_link

    T(H, L) = t_cli + launch + on a host + rendezvous + links

The file-system term (``--fs``: :class:`FileSystem`, :func:`fs_time`): every rank imports its Python stack
(``import hvdrun.torch``: M metadata operations and B bytes of files, measured here with strace), from one of

    shared     the shared file system itself: M round trips in a row on each node, and the storm of H M
               operations on the metadata servers:      t_local + M t_md + H M / R_md + H B / BW_fs
    packed     hvdrun before its tree: every host reads one packed file (S bytes) and unpacks it:
               t_local + S / min(bw_client, BW_fs / H, r_unpack), H S read from the shared source
    tree       --stage-env now: the root reads S once; each host unpacks while it passes the stream on to k
               children: t_local + t_start(H) + S / min(bw_client, bw_link / k, r_unpack, r_relay)
               + depth(H, k) x chunk / rate, S read from the shared source; t_start is H c_ssh where hvdrun
               opens an SSH connection to every host for its relay, a launch tree's time under mpiexec
    copper     ALCF's Copper: the root reads each file once, the other nodes ask up Copper's tree:
               t_local + M t_md + M depth x t_hop

Not modelled: the scheduler's own node start-up, and device (NCCL) initialisation; published anchors for those
are printed beside the predictions.

Fitting (``--fit``): on this machine every host and rank shares the same few cores, so each measured CPU term
is divided by the machine's cores: local runs give t_cli, c_spawn and c_rank (linear in N); namespace-host runs
give c_ssh (hvdrun's own CPU per host it connects to, ``flat cpu``) and t_agent (the per-host slope of the tree
runs once the ranks' CPU, c_ssh and c_join are taken out); c_join and c_row come from
benchmarks/rendezvous_cost.py (``--c-join``, ``--c-row``: 0.93 ms a connection of 12 ranks, 16.2 ms of 1,536),
t_link and alpha are set (``--t-link``, ``--alpha``), not fitted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hvdrun.launch.stage_tree import tree_depth

# Published anchors (start-up at scale of other tools), for the table's last rows.
ANCHORS = (
    ("ezpz `yeet` (env staged to /tmp), Aurora, 1,024 nodes x 12, first step", 61.0),
    ("ezpz `yeet`, Aurora, 4,096 nodes x 12, first step", 194.0),
    ("PyTorch TCPStore (libuv), 96K ranks, rendezvous", 100.0),
    ("NCCL init at thousands of GPUs (reported)", 150.0),
)


@dataclass(frozen=True)
class Params:
    """The model's parameters (seconds); defaults measured on the 2-core development VM (docs/scaling.md)."""

    t_cli: float = 0.30
    c_spawn: float = 0.010
    c_rank: float = 0.20
    c_ssh: float = 0.030
    t_agent: float = 0.15
    c_join: float = 0.0009
    c_row: float = 10e-6
    t_link: float = 0.001
    alpha: float = 20e-6
    fanout: int = 32
    rendezvous_fanout: int = 32
    cores: int = 32


def levels(hosts: int, fanout: int) -> int:
    """Levels of the SSH tree for ``hosts`` at ``fanout`` (1: hvdrun reaches every host itself)."""
    return max(1, math.ceil(math.log(hosts, fanout))) if hosts > 1 else 1


def launch_time(p: Params, hosts: int, tree: bool = True) -> float:
    """From hvdrun's start to every host's agent running."""
    if not tree or hosts <= p.fanout:
        return hosts * p.c_ssh + p.t_agent
    return levels(hosts, p.fanout) * (p.fanout * p.c_ssh + p.t_agent)


def host_time(p: Params, per_host: int) -> float:
    """From a host's agent to its ranks past their imports (in parallel on the host's cores)."""
    return per_host * p.c_spawn / p.cores + per_host * p.c_rank / min(per_host, p.cores)


def rendezvous_time(p: Params, hosts: int, per_host: int, leaders: bool = True, tree: bool = True) -> float:
    """The admissions in a row (along the rendezvous tree's depth, at most its fan-out each; without the tree one
    per host at rank 0; without leaders one per rank), every record at rank 0, and the barriers' hops."""
    if not leaders:
        return hosts * per_host * p.c_join + 2 * 3 * p.alpha
    if not tree or hosts <= p.rendezvous_fanout + 1:
        return hosts * p.c_join + 2 * 3 * p.alpha
    depth = levels(hosts, p.rendezvous_fanout)
    return depth * p.rendezvous_fanout * p.c_join + hosts * per_host * p.c_row + 2 * (depth + 1) * 3 * p.alpha


def startup_time(p: Params, hosts: int, per_host: int, tree: bool = True, leaders: bool = True,
                 rendezvous_tree: bool = True) -> float:
    """T(H, L): hvdrun to every rank past init()."""
    links = (math.log2(hosts) + 2) * p.t_link if hosts > 1 else 0.0
    return (p.t_cli + launch_time(p, hosts, tree) + host_time(p, per_host)
            + rendezvous_time(p, hosts, per_host, leaders, rendezvous_tree) + links)


# -- the file-system term ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileSystem:
    """The file-system term's parameters: measured on this VM, from a source, or assumed (each says which)."""

    import_ops: int = 20_474  # measured: strace -f of `python -c "import hvdrun.torch"` (torch 2.13 CPU build)
    import_bytes: float = 573e6  # measured: the 1,186 files it opens (torch's shared libraries most of it)
    env_bytes: float = 5e9  # ezpz's yeet page: its 512-node example's 5 GB venv (a GPU stack)
    t_local: float = 2.5  # measured: the same import, warm, from this VM's own disk
    t_md: float = 0.5e-3  # ASSUMED: one metadata round trip to the shared file system from an idle client
    md_rate: float = 100_000.0  # ASSUMED: metadata operations a second the shared file system serves in all
    fs_bw: float = 500e9  # ASSUMED: the shared file system's aggregate read bandwidth
    client_bw: float = 2e9  # ASSUMED: one client's read bandwidth from it
    link_bw: float = 25e9  # ezpz's yeet page: a 200 Gb/s NIC
    unpack_bw: float = 1e9  # measured: tar | tar of 1.55 GB into tmpfs in 3.1 s on this VM's 2 cores
    relay_bw: float = 0.3e9  # measured: a relay's receive, sends and pipe write cost 3.3 core-s a GB on this VM
    # (its veth network stack included; benchmarks/stage_tree.py): the slowest stage here, far below a node's NIC
    chunk: float = 1 << 20  # a relay's chunk (hvdrun/launch/remote/stage_relay.py)
    stage_fanout: int = 4  # HVDRUN_STAGE_FANOUT's default
    c_start: float = 0.0126  # measured: hvdrun's CPU a host it opens an SSH connection to (c_ssh, the fit)
    t_hop: float = 50e-6  # ASSUMED: one Copper request a level up its tree
    copper_fanout: int = 4  # ASSUMED: Copper's tree


def fs_time(fs: FileSystem, hosts: int, way: str) -> float:
    """Seconds until every node's ranks have imported their stack, ``way`` one of shared, packed, tree, copper."""
    if way == "shared":
        return (fs.t_local + fs.import_ops * fs.t_md + hosts * fs.import_ops / fs.md_rate
                + hosts * fs.import_bytes / fs.fs_bw)
    if way == "packed":
        return fs.t_local + fs.env_bytes / min(fs.client_bw, fs.fs_bw / hosts, fs.unpack_bw)
    if way in ("tree", "tree-mpiexec"):  # the relays start over SSH from hvdrun (flat), or by mpiexec (a tree)
        rate = min(fs.client_bw, fs.link_bw / fs.stage_fanout, fs.unpack_bw, fs.relay_bw)
        depth = tree_depth(hosts, fs.stage_fanout)
        start = hosts * fs.c_start if way == "tree" else launch_time(Params(), hosts)
        return fs.t_local + start + fs.env_bytes / rate + depth * fs.chunk / rate
    if way == "copper":
        return fs.t_local + fs.import_ops * (fs.t_md + tree_depth(hosts, fs.copper_fanout) * fs.t_hop)
    raise ValueError(f"unknown way {way!r}")


def source_bytes(fs: FileSystem, hosts: int, way: str) -> float:
    """Bytes read from the shared file system in all."""
    return {"shared": hosts * fs.import_bytes, "packed": (hosts + 1) * fs.env_bytes, "tree": fs.env_bytes,
            "tree-mpiexec": fs.env_bytes, "copper": fs.import_bytes}[way]


FS_ANCHORS = {  # saforem2/ezpz docs/cli/yeet.md, Aurora, measured 2026-04-30 to 05-01 (tarball broadcast mode)
    1024: ("255.4 s", "60.8 s"), 4096: ("750.6 s", "194.0 s"),
}


def fs_table(fs: FileSystem, hosts: list[int]) -> str:
    """Markdown: the file-system term of each way at ``hosts``, with the bytes from the shared source, beside
    ezpz's published yeet (environment broadcast) and first-step seconds."""
    lines = ["| nodes | shared FS (no staging) | packed file a node (before) | --stage-env tree, relays over SSH | "
             "the tree under mpiexec | Copper | bytes from the shared source (shared / packed / tree / Copper) | "
             "ezpz yeet / first step |", "|---|---|---|---|---|---|---|---|"]
    for h in hosts:
        ways = ("shared", "packed", "tree", "tree-mpiexec", "copper")
        times = " | ".join(f"{fs_time(fs, h, way):.1f} s" for way in ways)
        volume = " / ".join(f"{source_bytes(fs, h, way) / 1e9:,.1f} GB" for way in ways if way != "tree-mpiexec")
        yeet, first = FS_ANCHORS.get(h, ("", ""))
        lines.append(f"| {h:,} | {times} | {volume} | {yeet} / {first} |")
    return "\n".join(lines)


# -- fitting ---------------------------------------------------------------------------------------------------
def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return mean_y - slope * mean_x, slope


def _medians(results: list[dict], kind: str, key: str) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for entry in results:
        if entry.get("kind") == kind and key in entry and (key != "ranks" or "hosts" not in entry):
            by.setdefault(int(entry[key]), []).append(float(entry["seconds"]))
    return {count: statistics.median(values) for count, values in sorted(by.items())}


def fit(paths: list[Path], start: Params, machine_cores: int) -> tuple[Params, list[str]]:
    """Fit t_cli, c_spawn, c_rank (local runs) and the per-host cost (host runs) to startup.py --json files."""
    results = [entry for path in paths for entry in json.loads(path.read_text())["results"]]
    notes: list[str] = []
    params = start
    true_runs, init_runs = _medians(results, "hvdrun true", "ranks"), _medians(results, "hvdrun", "ranks")
    if len(true_runs) >= 2:
        intercept, slope = _line(list(map(float, true_runs)), list(true_runs.values()))
        params = replace(params, t_cli=max(intercept, 0.0), c_spawn=max(slope * machine_cores, 0.0))
        notes.append(f"`hvdrun -np N true` at N = {list(true_runs)}: {intercept:.3f} s + {slope * 1e3:.2f} ms x N")
    if len(init_runs) >= 2:
        intercept, slope = _line(list(map(float, init_runs)), list(init_runs.values()))
        params = replace(params, c_rank=max(slope * machine_cores - params.c_spawn, 0.0))
        notes.append(f"`hvdrun -np N` to past init() at N = {list(init_runs)}: {intercept:.3f} s + "
                     f"{slope * 1e3:.2f} ms x N")
    params, host_notes = _fit_hosts(params, results, machine_cores)
    return params, notes + host_notes


def _host_medians(results: list[dict], kind: str) -> dict[int, tuple[int, float]]:
    """Hosts -> (ranks, median seconds) of one kind of hosts_startup.py's runs."""
    by: dict[int, tuple[int, list[float]]] = {}
    for entry in results:
        if "hosts" in entry and entry.get("kind") == kind:
            ranks, values = by.setdefault(int(entry["hosts"]), (int(entry["ranks"]), []))
            values.append(float(entry["seconds"]))
    return {hosts: (ranks, statistics.median(values)) for hosts, (ranks, values) in sorted(by.items())}


def _fit_hosts(params: Params, results: list[dict], machine_cores: int) -> tuple[Params, list[str]]:
    """c_ssh from hvdrun's own CPU over hosts (flat: it opens every connection); t_agent from the slope of the
    tree's time over hosts once the ranks' CPU (c_spawn, c_rank) and rank 0's c_join are taken out."""
    notes = []
    launcher_cpu = _host_medians(results, "flat cpu")
    if len(launcher_cpu) >= 2:
        _, slope = _line([float(h) for h in launcher_cpu], [cpu for _, cpu in launcher_cpu.values()])
        params = replace(params, c_ssh=max(slope, 0.0))
        notes.append(f"hvdrun's own CPU, flat, at hosts {list(launcher_cpu)}: {slope * 1e3:.1f} ms per host (c_ssh)")
    runs = _host_medians(results, "tree")
    if len(runs) >= 2:
        xs = [float(hosts) for hosts in runs]
        ys = [seconds - ranks * (params.c_spawn + params.c_rank) / machine_cores for ranks, seconds in runs.values()]
        _, slope = _line(xs, ys)
        per_host = slope * machine_cores  # all hosts share this machine's cores: per-host work is CPU here
        params = replace(params, t_agent=max(per_host - params.c_ssh - params.c_join, 0.0))
        notes.append(f"tree at hosts {list(runs)}: {slope * 1e3:.0f} ms per added host, the ranks' CPU taken out: "
                     f"{per_host * 1e3:.0f} ms of CPU per host = c_ssh + t_agent + c_join")
    return params, notes


# -- output ----------------------------------------------------------------------------------------------------
def prediction_table(p: Params, hosts: list[int], per_host: list[int]) -> str:
    """Markdown: T(H, L) with the trees and leaders, and without each (flat fan-out, every leader on rank 0, star
    rendezvous)."""
    lines = ["| hosts x ranks | hvdrun (trees + leaders) | launch / on a host / rendezvous | flat SSH fan-out | "
             "rendezvous without its tree | star rendezvous (no leaders) |", "|---|---|---|---|---|---|"]
    for h in hosts:
        for L in per_host:
            parts = (launch_time(p, h), host_time(p, L), rendezvous_time(p, h, L))
            lines.append(f"| {h:,} x {L} | {startup_time(p, h, L):.1f} s | "
                         f"{parts[0]:.1f} / {parts[1]:.1f} / {parts[2]:.2f} s | "
                         f"{startup_time(p, h, L, tree=False):.1f} s | "
                         f"{startup_time(p, h, L, rendezvous_tree=False):.1f} s | "
                         f"{startup_time(p, h, L, leaders=False):.1f} s |")
    return "\n".join(lines)


def growth_line(p: Params, per_host: int) -> str:
    """How T grows per added host: the derivative's shape (log steps from the tree, c_join from rank 0)."""
    samples = [(h, startup_time(p, h, per_host)) for h in (64, 512, 1024, 4096)]
    steps = ", ".join(f"{a:,}->{b:,}: +{tb - ta:.2f} s" for (a, ta), (b, tb) in zip(samples, samples[1:], strict=False))
    return (f"Growth at {per_host} ranks per host: {steps}; per added host {per_host * p.c_row * 1e3:.2f} ms of "
            f"records at rank 0 (linear, small), a launch level every x{p.fanout} hosts "
            f"({p.fanout * p.c_ssh + p.t_agent:.2f} s) and a rendezvous level every x{p.rendezvous_fanout} "
            f"({p.rendezvous_fanout * p.c_join:.3f} s).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", nargs="+", type=Path, metavar="JSON", help="startup.py --json results")
    parser.add_argument("--machine-cores", type=int, default=2, help="cores of the measuring machine")
    parser.add_argument("--hosts", default="1024,4096")
    parser.add_argument("--ranks-per-host", default="4,8,12")
    parser.add_argument("--markdown", action="store_true", help="only the markdown of docs/scaling.md")
    parser.add_argument("--fs", action="store_true", help="the file-system term's table instead")
    for name, value in asdict(Params()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), help=f"set {name} (default {value})")
    args = parser.parse_args()
    if args.fs:
        fs = FileSystem()
        print("File system: " + ", ".join(f"{k} = {v:.4g}" for k, v in asdict(fs).items()) + "\n")
        print(fs_table(fs, [int(w) for w in args.hosts.split(",")]))
        return
    params = Params()
    notes: list[str] = []
    if args.fit:
        params, notes = fit(args.fit, params, args.machine_cores)
    overrides = {name: getattr(args, name) for name in asdict(params) if getattr(args, name) is not None}
    params = replace(params, **overrides)
    hosts = [int(w) for w in args.hosts.split(",")]
    per_host = [int(w) for w in args.ranks_per_host.split(",")]
    print("Parameters: " + ", ".join(f"{k} = {v:.4g}" for k, v in asdict(params).items()))
    for note in notes:
        print(f"- {note}")
    print()
    print(prediction_table(params, hosts, per_host))
    print()
    print(growth_line(params, per_host[0]))
    if not args.markdown:
        print()
        for what, seconds in ANCHORS:
            print(f"anchor: {what}: {seconds:.0f} s")


if __name__ == "__main__":
    main()
