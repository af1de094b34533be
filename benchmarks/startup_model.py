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

Not modelled: reading the Python environment from a shared file system at scale (metadata servers serving
thousands of nodes at once; what ``hvdrun --stage-env`` avoids), the scheduler's own node start-up, and
device (NCCL) initialisation; published anchors for those are printed beside the predictions.

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
    for name, value in asdict(Params()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), help=f"set {name} (default {value})")
    args = parser.parse_args()
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
