"""A cost model of allreduce across hosts, calibrated on the namespace hosts, extrapolated to thousands.

    python benchmarks/scaling.py                              # default parameters; table + docs/scaling.png
    python benchmarks/scaling.py --fit results.json           # fit alpha, beta, gamma to multihost.py --json
    python benchmarks/scaling.py --fit results.json --markdown  # the tables of docs/scaling.md
    python benchmarks/scaling.py --alpha 2e-6 --beta 4e-11    # another network (2 us, 25 GB/s)

Parameters (seconds; see docs/scaling.md):
    alpha        latency of one message between hosts (network + the C-level send/receive path)
    beta         seconds per byte on a host's link (its inverse is the link's bandwidth)
    gamma        per-step cost of hvdrun's Python collective loop, paid on every step of hvdrun's algorithms
    alpha_local  latency of one step between ranks of a host (shared memory)
    beta_local   seconds per byte through shared memory (also the cost of reducing a byte)

H hosts, L ranks per host, N = H L ranks, n bytes. A step costs alpha + (bytes on the busiest host
link) beta (+ gamma for hvdrun); concurrent messages of one step overlap. Algorithms:
    hvdrun flat       one ring through every rank: 2 (N - 1) steps of n / N bytes
    hvdrun ring       reduce-scatter inside the host (L - 1 steps of n / L), L rings across hosts in
                      parallel on n / L each (2 (H - 1) steps, the link carries n / H a step), all-gather
                      inside the host (L - 1 steps); up to 256 KiB (a post) the host's phases are two rounds
                      of its post board instead
    hvdrun doubling   the same local phases; recursive doubling across hosts: log2 H steps, n on the link
                      each (a non-power-of-two H adds 2 steps of n: MPICH's fold)
    hvdrun halving    the same local phases; Rabenseifner across hosts: 2 log2 H steps, 2 (H - 1) / H n in all
    negotiation       every hvdrun op first exchanges every rank's announcement (m bytes): flat, a ring
                      all-gather of N - 1 steps; hierarchical, an all-gather inside the host (one step on the
                      host's post board, L m bytes copied; the ring's L - 1 steps past 256 KiB a post) then
                      the announcements merged across hosts by recursive doubling (log2 H steps; what a rank
                      sends doubles every step: 2^j L m bytes at step j, the L local ranks at once)
    eager             an allreduce of at most min(HVDRUN_EAGER_BYTES, EAGER_JOB_BYTES / W) travels inside that
                      exchange (hvdrun/runtime/submissions.py, announcements.py), W being the ranks whose data
                      every rank receives whole; EAGER_JOB_BYTES = 128 KiB. Flat (one host, uneven hosts,
                      HVDRUN_ALGORITHM=flat): W = N; the all-gather carries m + n bytes a rank and every rank
                      reduces the N contributions itself. Merged (hierarchical): W = L; inside the host the
                      ranks all-gather m + n bytes each (one board step) and reduce the L contributions ((L - 1) n);
                      across hosts, at recursive doubling's step j every local rank sends 2^j L m bytes of
                      announcements plus ONE reduced copy of the data (n) and reduces the n it receives: log2 H
                      messages of n, as MPI's recursive doubling (MPICH's fold for a non-power-of-two H: fold-in
                      L m + n, fold-out H L m + n). The runtime sends data eagerly only when every rank
                      announced the same op alone (the steady state of training); the model assumes it does
    hvdrun auto       the model's cheapest of eager (up to HVDRUN_EAGER_BYTES, without the EAGER_JOB_BYTES cap),
                      ring, doubling and halving: what the best rules could do
    hvdrun rules      what the runtime's rules pick, by calling them: eager up to the capped size above, then
                      AlgorithmChoice.across_hosts (hvdrun/runtime/collectives/hierarchical.py): doubling up to
                      HVDRUN_DOUBLING_MAX_BYTES, halving up to HVDRUN_HALVING_MAX_BYTES x H / 8, the ring
                      above; "hvdrun flat" also keeps the runtime's eager cap
    MPI               MPICH's documented selection (Thakur, Rabenseifner & Gropp 2005; MPICH's
                      MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE = 2048 and its SMP-aware allreduce): binomial reduce to a
                      leader per host, recursive doubling (n <= 2 KB) or Rabenseifner among the leaders, binomial
                      broadcast; no gamma
    NCCL ring / tree  NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc): ring latency 2 (N - 1) steps of which
                      2 (H - 1) cross hosts, bytes 2 (N - 1) / N n; tree latency 2 ((L - 1) intra + log2 H inter),
                      bytes 2 n; same alpha and beta, no gamma, no per-op base latency

Fitting: each measured time is a linear function of the parameters, so alpha, beta and gamma (``--fit-params``)
come from a non-negative least-squares fit of the relative errors. The namespace hosts share the machine's
cores, so a measured point's model time is multiplied by max(1, N / cores) (every per-step and per-byte cost
is CPU time there); predictions give every rank its own core and every host its own link.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PARAMETERS = ("alpha", "beta", "gamma", "alpha_local", "beta_local")
HVDRUN_ALGORITHMS = ("flat", "ring", "doubling", "halving")
COLUMNS = ("hvdrun flat", "hvdrun ring", "hvdrun doubling", "hvdrun halving", "hvdrun auto", "hvdrun rules", "MPI",
           "NCCL ring", "NCCL tree")
SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}

try:  # the runtime's own defaults, when this checkout has them
    from hvdrun.runtime.context import DEFAULT_EAGER_BYTES
except ImportError:  # pragma: no cover - an older or newer layout
    DEFAULT_EAGER_BYTES = 64 << 10
try:
    from hvdrun.runtime.collectives.hierarchical import DEFAULT_DOUBLING_MAX_BYTES, DEFAULT_HALVING_MAX_BYTES
except ImportError:  # pragma: no cover
    DEFAULT_DOUBLING_MAX_BYTES, DEFAULT_HALVING_MAX_BYTES = 64 << 10, 4 << 20
try:  # eager data one negotiation may carry, from all the ranks whose data every rank receives whole
    from hvdrun.runtime.submissions import EAGER_JOB_BYTES
except ImportError:  # pragma: no cover
    EAGER_JOB_BYTES = 128 << 10
try:  # one post on a host's board: a merged exchange's message up to this size takes one step inside the host
    from hvdrun.runtime.transport.posts import SLOT_BYTES as POST_BYTES
except ImportError:  # pragma: no cover
    POST_BYTES = 256 << 10
try:  # the runtime's own choice of the algorithm across hosts
    from hvdrun.runtime.collectives.hierarchical import AlgorithmChoice
except ImportError:  # pragma: no cover
    @dataclass(frozen=True)
    class AlgorithmChoice:  # type: ignore[no-redef]
        """The runtime's rule as of docs/scaling.md: the ring's crossover grows with the hosts beyond 8."""

        algorithm: str = "auto"
        doubling_max_bytes: int = DEFAULT_DOUBLING_MAX_BYTES
        halving_max_bytes: int = DEFAULT_HALVING_MAX_BYTES

        def across_hosts(self, nbytes: int, hosts: int = 2) -> str:
            if self.algorithm != "auto":
                return self.algorithm
            if nbytes <= self.doubling_max_bytes:
                return "doubling"
            return "halving" if nbytes * 8 <= self.halving_max_bytes * hosts else "ring"

MPI_SHORT_BYTES = 2048  # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE default


@dataclass(frozen=True)
class Setting:
    """What hvdrun does besides the algorithm: announcement size, eager size, auto's crossovers."""

    # one rank's announcement of one allreduce: 20 B once the response cache knows the op (its number), 99 B the
    # first time (the whole Request); a training step's ops are cached after the first step
    message_bytes: int = 20
    # what a rank sends a merge step for a cycle of cached ops once they are held (hvdrun/runtime/held.py): one
    # tally, whatever the number of ranks (measured 128 B for eight held allreduces at 2 x 2 and at 32 x 2 ranks,
    # tests/integration/test_scale_out.py); a lone eager op travels as a 32-byte header and its data. None: every
    # rank's announcement reaches every rank (the runtime before cached ops were held)
    held_bytes: int | None = 128
    eager_bytes: int = DEFAULT_EAGER_BYTES  # HVDRUN_EAGER_BYTES: a rank's limit
    eager_job_bytes: int | None = EAGER_JOB_BYTES  # the cap on what arrives whole (None: no cap)
    doubling_max_bytes: int = DEFAULT_DOUBLING_MAX_BYTES
    halving_max_bytes: int = DEFAULT_HALVING_MAX_BYTES
    # the compiled module (hvdrun/runtime/compiled) runs the steps across hosts of a cycle of held ops (a lone eager
    # op's, with its data; or a held range's, without) and recursive doubling's core steps: no gamma a step, one for
    # the Python around the call; False: every step is Python's
    compiled_steps: bool = True

    def eager_limit(self, hosts: int, per_host: int, merged: bool) -> int:
        """The largest allreduce that goes eager (Submissions.eager_bytes): the cap divided among the ranks whose
        data every rank receives whole, a host's when announcements are ``merged`` (hierarchical), else the job's."""
        if self.eager_job_bytes is None:
            return self.eager_bytes
        whole_from = per_host if merged else hosts * per_host
        return min(self.eager_bytes, self.eager_job_bytes // max(whole_from, 1))

    def across_hosts(self, nbytes: float, hosts: int) -> str:
        """The runtime's algorithm across hosts for ``auto`` (AlgorithmChoice.across_hosts)."""
        choice = AlgorithmChoice(algorithm="auto", doubling_max_bytes=self.doubling_max_bytes,
                                 halving_max_bytes=self.halving_max_bytes)
        return choice.across_hosts(int(nbytes), hosts)


# -- costs: linear in the parameters ---------------------------------------------------------------------

class Cost(dict):
    """A linear combination of the parameters (name -> coefficient); ``seconds(params)`` evaluates it."""

    def __add__(self, other: Cost) -> Cost:  # type: ignore[override]
        out = Cost(self)
        for name, value in other.items():
            out[name] = out.get(name, 0.0) + value
        return out

    def __mul__(self, factor: float) -> Cost:
        return Cost({name: value * factor for name, value in self.items()})

    def seconds(self, params: dict[str, float]) -> float:
        return sum(value * params[name] for name, value in self.items())


def steps(count: float, link_bytes: float, local: bool, python: bool) -> Cost:
    """``count`` steps, each moving ``link_bytes`` over the busiest link (shared memory when ``local``)."""
    if count <= 0:
        return Cost()
    latency, per_byte = ("alpha_local", "beta_local") if local else ("alpha", "beta")
    cost = Cost({latency: count, per_byte: count * link_bytes})
    return cost + Cost({"gamma": count}) if python else cost


def fold(hosts: int) -> tuple[int, int]:
    """(log2 of the largest power of two <= hosts, the members left over)."""
    pof2 = 1 << (hosts.bit_length() - 1)
    return pof2.bit_length() - 1, hosts - pof2


def flat_ring(hosts: int, per_host: int, nbytes: float, python: bool = True) -> Cost:
    ranks = hosts * per_host
    return steps(2 * (ranks - 1), nbytes / ranks, hosts == 1, python)


def flat_allgather(hosts: int, per_host: int, message: float) -> Cost:
    """A ring all-gather of one message per rank through every rank (the old negotiation)."""
    return steps(hosts * per_host - 1, message, hosts == 1, True)


def merged_eager(hosts: int, per_host: int, message: float, nbytes: float, held: float | None = None,
                 compiled: bool = False) -> Cost:
    """Announcements merged on the way (hvdrun/runtime/announcements.py), with a lone eager op's ``nbytes`` of data.

    Inside the host the ranks all-gather their values (``message`` + ``nbytes`` each) on the host's post board
    (one step: a post and a wait, each rank copying the L - 1 other posts; a value past a post's size takes the
    host's ring, L - 1 steps) and the host's leader reduces the L payloads; across hosts the leaders alone run
    recursive doubling: at step j a leader sends the headers of 2^j L ranks and one reduced copy of the data, and
    reduces the copy it receives (MPICH's fold for a non-power-of-two H: fold-in one host's value, fold-out
    everything); a host's link carries one copy. The leader then posts the job's value in a second round of the
    board, where the others read it. With ``nbytes`` 0, the hierarchical negotiation.

    ``held``: the ops are cached and held (:attr:`Setting.held_bytes`): every value, inside the host and at every
    step across, is one tally of ``held`` bytes (with the data), whatever the number of ranks it stands for.
    ``compiled``: a held cycle (a lone eager op's, with its data, or a held range's) runs whole in one compiled
    call: its board rounds and its steps across hosts (MPICH's fold included), no gamma for any of them, one for the
    cycle's Python around the call.
    """
    whole = compiled = compiled and held is not None
    if held is not None:
        message = held
    k, rem = fold(hosts)

    def headers(ranks_hosts: int) -> float:  # what a leader sends of the announcements of ``ranks_hosts`` hosts
        return held if held is not None else per_host * message * ranks_hosts

    def board_round(post: float) -> Cost:  # every rank of the host posts ``post`` bytes and reads the L posts
        if per_host == 1:
            return Cost()
        if post <= POST_BYTES:
            return steps(1, per_host * post, True, not whole)
        return steps(per_host - 1, post, True, True)

    cross = Cost({"gamma": 1}) if compiled and (k or rem or per_host > 1) else Cost()
    for j in range(k):  # step j: the leader sends 2^j hosts' headers (or one tally) and the data
        cross = cross + steps(1, headers(1 << j) + nbytes, False, not compiled)
    if rem:  # fold in (one host's value), fold out (everything)
        cross = cross + steps(1, headers(1) + nbytes, False, not compiled) + \
            steps(1, headers(hosts) + nbytes, False, not compiled)
    reductions = (per_host - 1 + k + (1 if rem else 0)) * nbytes  # the host's L payloads, then one per step
    local = board_round(message + nbytes) + board_round(headers(hosts) + nbytes)  # the posts, then the result
    return local + cross + (Cost({"beta_local": reductions}) if reductions else Cost())


def hier_allgather(hosts: int, per_host: int, message: float, held: float | None = None,
                   compiled: bool = False) -> Cost:
    """All-gather inside the host, then the announcements merged across hosts by recursive doubling among the
    hosts' leaders (what a leader sends doubles every step: the same bytes as all-gathering the hosts' bundles; with
    ``held``, one tally a step), then the job's value through the board."""
    return merged_eager(hosts, per_host, message, 0, held, compiled)


def local_phases(per_host: int, nbytes: float, python: bool = True) -> Cost:
    """Reduce-scatter and all-gather inside a host. A buffer that fits a post takes the host's post board: two
    rounds (a post of n and the own part reduced from the L posts; a post of n / L and the others' parts copied:
    2 n + (L - 1) / L n through shared memory in all); a larger one the rings, 2 (L - 1) steps of n / L."""
    if 1 < per_host and nbytes <= POST_BYTES:
        return steps(2, (2 * nbytes + (per_host - 1) / per_host * nbytes) / 2, True, python)
    return steps(2 * (per_host - 1), nbytes / per_host, True, python)


def cross_hosts(algorithm: str, hosts: int, nbytes: float, python: bool = True, compiled: bool = False) -> Cost:
    """The part across hosts; ``nbytes`` is what crosses a host's link in all (L parts of n / L). ``compiled``:
    recursive doubling's core steps run in one compiled call (one gamma for the call; the fold stays Python)."""
    k, rem = fold(hosts)
    extra = steps(2, nbytes, False, python) if rem else Cost()
    if algorithm == "doubling" and compiled and python and k:
        return steps(k, nbytes, False, False) + Cost({"gamma": 1}) + extra
    if algorithm == "ring":
        return steps(2 * (hosts - 1), nbytes / hosts, False, python)
    if algorithm == "doubling":
        return steps(k, nbytes, False, python) + extra
    if algorithm == "halving":
        pof2 = 1 << k
        # 2k steps whose sizes halve, then double: alpha 2k times, beta on 2 (pof2 - 1) / pof2 n in all
        return Cost({"alpha": 2 * k, "beta": 2 * (pof2 - 1) / pof2 * nbytes,
                     **({"gamma": 2 * k} if python else {})}) + extra
    raise ValueError(f"unknown algorithm {algorithm!r}")


def hvdrun_cost(algorithm: str, hosts: int, per_host: int, nbytes: float, setting: Setting) -> tuple[Cost, str]:
    """(cost, path) of one hvdrun allreduce: negotiation + algorithm, or eager inside the negotiation.

    ``algorithm``: flat, ring, doubling or halving, or ``auto`` for the runtime's own crossovers (what a measured
    job ran); :func:`best_hvdrun` picks the cheapest path instead. Sizes up to ``setting.eager_limit`` go eager:
    merged across hosts when hierarchical (:func:`merged_eager`), in the flat all-gather otherwise.
    """
    ranks = hosts * per_host
    if ranks == 1:
        return Cost(), "one rank"
    hierarchical = algorithm != "flat" and hosts > 1  # one host, or uneven hosts: the flat ring
    if algorithm == "auto":
        algorithm = setting.across_hosts(nbytes, hosts)
    if nbytes <= setting.eager_limit(hosts, per_host, hierarchical):
        if hierarchical:
            return merged_eager(hosts, per_host, setting.message_bytes, nbytes, setting.held_bytes,
                                setting.compiled_steps), "eager (merged)"
        reduce = Cost({"beta_local": (ranks - 1) * nbytes})  # each rank sums N contributions
        return flat_allgather(hosts, per_host, setting.message_bytes + nbytes) + reduce, "eager (flat)"
    if not hierarchical:
        return flat_allgather(hosts, per_host, setting.message_bytes) + flat_ring(hosts, per_host, nbytes), "flat ring"
    negotiation = hier_allgather(hosts, per_host, setting.message_bytes, setting.held_bytes, setting.compiled_steps)
    return negotiation + local_phases(per_host, nbytes) + cross_hosts(algorithm, hosts, nbytes,
                                                                      compiled=setting.compiled_steps), algorithm


def best_hvdrun(hosts: int, per_host: int, nbytes: float, setting: Setting,
                params: dict[str, float]) -> tuple[float, str]:
    """hvdrun auto as it should choose: the cheapest of eager (up to HVDRUN_EAGER_BYTES, ignoring the
    EAGER_JOB_BYTES cap; merged across hosts), ring, doubling, halving."""
    no_eager = replace(setting, eager_bytes=-1)
    options = [hvdrun_cost(a, hosts, per_host, nbytes, no_eager) for a in ("ring", "doubling", "halving")]
    if nbytes <= setting.eager_bytes:
        options.append(hvdrun_cost("ring", hosts, per_host, nbytes, replace(setting, eager_job_bytes=None)))
    return min((cost.seconds(params), path) for cost, path in options)


def mpi_cost(hosts: int, per_host: int, nbytes: float) -> Cost:
    """MPICH: SMP-aware (binomial reduce / broadcast inside the host), 2005 selection among the host leaders."""
    local = steps(2 * math.ceil(math.log2(per_host)), nbytes, True, False) if per_host > 1 else Cost()
    if hosts == 1:
        return local
    k, _ = fold(hosts)
    short = nbytes <= MPI_SHORT_BYTES or nbytes / 4 < (1 << k)  # count < pof2: doubling too
    return local + cross_hosts("doubling" if short else "halving", hosts, nbytes, python=False)


def nccl_cost(algorithm: str, hosts: int, per_host: int, nbytes: float) -> Cost:
    """NCCL's tuning model (latency part without its base latency), on our alpha / beta."""
    ranks = hosts * per_host
    if algorithm == "ring":
        inter = 2 * (hosts - 1)
        intra = 2 * (ranks - 1) - inter
        return Cost({"alpha": inter, "alpha_local": intra, "beta": 2 * (ranks - 1) / ranks * nbytes})
    k = int(math.log2(hosts)) if hosts > 1 else 0  # NCCL's log2i: floor
    return Cost({"alpha": 2 * k, "alpha_local": 2 * (per_host - 1), "beta": 2 * nbytes})


def column_time(column: str, hosts: int, per_host: int, nbytes: float, setting: Setting,
                params: dict[str, float]) -> tuple[float, str]:
    """Predicted seconds (one rank per core, one link per host) and the path taken."""
    if column == "hvdrun auto":
        return best_hvdrun(hosts, per_host, nbytes, setting, params)
    if column == "hvdrun rules":  # what the runtime's eager cap and AlgorithmChoice.across_hosts pick
        cost, path = hvdrun_cost("auto", hosts, per_host, nbytes, setting)
        return cost.seconds(params), path
    if column.startswith("hvdrun "):
        algorithm = column.split()[1]
        no_eager = setting if algorithm == "flat" else replace(setting, eager_bytes=-1)
        cost, path = hvdrun_cost(algorithm, hosts, per_host, nbytes, no_eager)
        return cost.seconds(params), path
    if column == "MPI":
        return mpi_cost(hosts, per_host, nbytes).seconds(params), "MPICH"
    return nccl_cost(column.split()[1], hosts, per_host, nbytes).seconds(params), column


# -- measured points and the fit ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    kind: str  # "hvdrun flat", "hvdrun auto", ..., "MPI"
    hosts: int
    per_host: int
    nbytes: int
    seconds: float
    cores: int


# The issue's figures (2-core VM, MPICH over TCP between namespace hosts; hvdrun's flat ring): the defaults'
# calibration when no --fit file is given. Middle of each measured range.
ISSUE_POINTS = (
    Point("MPI", 2, 1, 4 << 10, 21.5e-6, 2),     # 21-22 us
    Point("MPI", 2, 1, 64 << 10, 41.5e-6, 2),    # 41-42 us
    Point("MPI", 2, 1, 16 << 20, 12.9e-3, 2),    # 12.2-13.6 ms
    Point("hvdrun flat", 2, 1, 4 << 10, 60.5e-6, 2),   # 54-67 us
    Point("hvdrun flat", 4, 1, 4 << 10, 377.5e-6, 2),  # 367-388 us
)
# Inside a host (README, one-host table, same VM): 2 ranks, 16 MB in 2.68 ms through shared memory, 2 steps of
# 8 MB: beta_local = 2.68 ms / 16 MiB; alpha_local: a futex wake-up between two ranks, a few microseconds.
FIXED = {"alpha_local": 2e-6, "beta_local": 2.68e-3 / (16 << 20)}
PRIOR = 0.05  # how strongly a --fit keeps what its points leave open near the defaults
START = {"alpha": 10e-6, "beta": 0.5e-9, "gamma": 30e-6, **FIXED}


def point_cost(point: Point, setting: Setting, reads_algorithm: bool) -> tuple[Cost, str]:
    """The model of a measured point, scaled by the oversubscription of the measuring machine's cores."""
    ranks = point.hosts * point.per_host
    if point.kind == "MPI":
        cost, path = mpi_cost(point.hosts, point.per_host, point.nbytes), "MPICH"
    else:
        algorithm = point.kind.split()[1] if reads_algorithm else "flat"
        cost, path = hvdrun_cost(algorithm, point.hosts, point.per_host, point.nbytes, setting)
    return cost * max(1.0, ranks / point.cores), path


def load_points(paths: list[str]) -> tuple[list[Point], bool, dict]:
    """Points of multihost.py's JSON files; whether their runtime read HVDRUN_ALGORITHM; their HVDRUN_* env, and
    under "compiled" whether every one ran the compiled steps (hvdrun/runtime/compiled; False for sweeps before)."""
    points, reads, env = [], True, {"compiled": True}
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = data.get("meta", {})
        reads = reads and bool(meta.get("hvdrun_reads_algorithm", False))
        env.update(meta.get("hvdrun_env", {}))
        env["compiled"] = env["compiled"] and bool(meta.get("hvdrun_compiled", False))  # sweeps before it: False
        cores = int(meta.get("cores") or 2)
        rows = data.get("rows") or []
        if not rows and data.get("runs"):  # an interrupted sweep: medians of what is there
            groups: dict[tuple, list[float]] = {}
            for run in data["runs"]:
                groups.setdefault((run["kind"], run["hosts"], run["ranks_per_host"], run["bytes"]), []).append(
                    run["seconds"])
            rows = [{"kind": k, "hosts": h, "ranks_per_host": r, "bytes": b, "seconds": statistics.median(s)}
                    for (k, h, r, b), s in groups.items()]
        if not rows:
            raise SystemExit(f"{path}: no sweep rows (expected benchmarks/multihost.py --json output)")
        points += [Point(r["kind"], r["hosts"], r["ranks_per_host"], r["bytes"], r["seconds"], cores) for r in rows]
    return points, reads, env


def fitted(point: Point) -> bool:
    """Whether a point takes part in the fit: not MPI with more ranks than cores (MPICH's ranks poll, and
    polling ranks that share a core take each other's time slices, which no per-step cost describes)."""
    return not (point.kind == "MPI" and point.hosts * point.per_host > point.cores)


def fit(points: list[Point], names: tuple[str, ...], start: dict[str, float], setting: Setting,
        reads_algorithm: bool, prior: float = 0.0) -> dict[str, float]:
    """Non-negative least squares on relative errors over the parameters ``names``; the others stay at ``start``.

    ``prior`` > 0 adds a weak pull of every fitted parameter towards its start value (relative weight
    ``prior``), so that what the points cannot tell apart (a sweep of one size, say) stays near the
    defaults. A parameter no point depends on keeps its start value. Few unknowns: every subset is tried.
    """
    import numpy as np

    points = [p for p in points if fitted(p)]
    costs = [point_cost(p, setting, reads_algorithm)[0] for p in points]
    names = tuple(n for n in names if any(c.get(n, 0.0) for c in costs))
    if not names:
        return dict(start)
    fixed = [n for n in PARAMETERS if n not in names]
    rows = [[c.get(n, 0.0) / p.seconds for n in names] for c, p in zip(costs, points, strict=True)]
    targets = [1.0 - sum(c.get(n, 0.0) * start[n] for n in fixed) / p.seconds
               for c, p in zip(costs, points, strict=True)]
    if prior > 0:
        for i, name in enumerate(names):
            if start[name] > 0:
                rows.append([prior / start[name] if j == i else 0.0 for j in range(len(names))])
                targets.append(prior)
    a, b = np.array(rows), np.array(targets)
    best: tuple[float, dict[str, float]] | None = None
    for size in range(len(names), 0, -1):
        for subset in itertools.combinations(range(len(names)), size):
            solution, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if (solution < 0).any():
                continue
            values = dict.fromkeys(names, 0.0)
            values.update({names[i]: float(v) for i, v in zip(subset, solution, strict=True)})
            residual = float(np.sum((a @ np.array([values[n] for n in names]) - b) ** 2))
            if best is None or residual < best[0] - 1e-15:
                best = (residual, values)
    return {**start, **(best[1] if best else {})}


# -- output ------------------------------------------------------------------------------------------------

def fmt_time(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1e6:,.1f} µs"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def human(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def parameter_table(params: dict[str, float], source: str) -> str:
    rows = [("alpha", f"{params['alpha'] * 1e6:.2f} µs", "latency of a message between hosts"),
            ("beta", f"{params['beta'] * 1e9:.3f} ns/B ({1 / params['beta'] / 1e9:.2f} GB/s)" if params["beta"] else
             "0", "per byte on a host's link"),
            ("gamma", f"{params['gamma'] * 1e6:.2f} µs", "hvdrun's Python cost per step"),
            ("alpha_local", f"{params['alpha_local'] * 1e6:.2f} µs", "a step between ranks of a host"),
            ("beta_local", f"{params['beta_local'] * 1e9:.3f} ns/B", "per byte through shared memory / reduced")]
    return "\n".join([f"Parameters ({source}):", "", "| parameter | value | what |", "|---|---|---|",
                      *(f"| {n} | {v} | {w} |" for n, v, w in rows)])


def prediction_table(params: dict[str, float], setting: Setting, hosts: list[int], per_host: int,
                     sizes: list[int]) -> str:
    header = ["hosts x ranks", "size", *COLUMNS, "auto picks", "flat / auto", "auto / MPI", "auto / NCCL best"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for count in hosts:
        for nbytes in sizes:
            times = {c: column_time(c, count, per_host, nbytes, setting, params) for c in COLUMNS}
            auto = times["hvdrun auto"][0]
            nccl = min(times["NCCL ring"][0], times["NCCL tree"][0])
            cells = [f"{count:,} x {per_host}", human(nbytes), *(fmt_time(times[c][0]) for c in COLUMNS),
                     times["hvdrun auto"][1], f"{times['hvdrun flat'][0] / auto:,.1f}x",
                     f"{auto / times['MPI'][0]:.2f}x", f"{auto / nccl:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_table(points: list[Point], params: dict[str, float], setting: Setting, reads_algorithm: bool,
                held_out: bool = False) -> str:
    """The model against measured ``points``, with each one's relative error and their median and largest
    (``held_out``: points of shapes the fit never saw, every one counted)."""
    lines = ["| kind | hosts x ranks | size | measured | model | model / measured - 1 | model's path |",
             "|---|---|---|---|---|---|---|"]
    errors: list[float] = []
    for p in sorted(points, key=lambda p: (p.kind, p.hosts, p.per_host, p.nbytes)):
        cost, path = point_cost(p, setting, reads_algorithm)
        model = cost.seconds(params)
        error = model / p.seconds - 1
        if held_out or fitted(p):
            errors.append(error)
        else:
            path += " (not fitted: MPI, more ranks than cores)"
        lines.append(f"| {p.kind} | {p.hosts} x {p.per_host} | {human(p.nbytes)} | {fmt_time(p.seconds)} | "
                     f"{fmt_time(model)} | {error:+.0%} | {path} |")
    if errors:
        which = "points of shapes the fit did not see" if held_out else "fitted points"
        lines.append(f"\nMedian |error| {statistics.median(abs(e) for e in errors):.0%}, largest "
                     f"{max(abs(e) for e in errors):.0%}, over the {len(errors)} {which} (model times include "
                     "the oversubscription factor max(1, N / cores)).")
    if not reads_algorithm:
        lines.append("The measured runtime did not read HVDRUN_ALGORITHM: every hvdrun job ran the flat ring, and is "
                     "modelled so.")
    return "\n".join(lines)


def crossover_line(params: dict[str, float], setting: Setting, hosts: int, per_host: int) -> str:
    """Where the model's cheapest path changes, against where the runtime's rules change."""
    sizes = [1 << e for e in range(8, 31)]

    def changes(picks: list[str]) -> str:
        return f"{picks[0]} from 256 B" + "".join(f", {picks[i - 1]} -> {picks[i]} at {human(sizes[i])}"
                                                  for i in range(1, len(sizes)) if picks[i] != picks[i - 1])

    best = [best_hvdrun(hosts, per_host, n, setting, params)[1] for n in sizes]
    rules = [hvdrun_cost("auto", hosts, per_host, n, setting)[1] for n in sizes]
    return (f"{hosts:,} hosts x {per_host}: the model's cheapest path: {changes(best)}; the runtime's rules: "
            f"{changes(rules)} (eager up to {human(setting.eager_limit(hosts, per_host, hosts > 1))})")


def negotiation_line(params: dict[str, float], setting: Setting, hosts: int, per_host: int) -> str:
    """What the all-gather of announcements alone costs, and how much of it is bytes (they grow with N)."""
    flat = flat_allgather(hosts, per_host, setting.message_bytes)
    hier = hier_allgather(hosts, per_host, setting.message_bytes)
    line = (f"{hosts:,} hosts x {per_host}: negotiation ({setting.message_bytes} B a rank) flat "
            f"{fmt_time(flat.seconds(params))}, hierarchical {fmt_time(hier.seconds(params))} of which "
            f"{_moving(hier, params)}")
    if setting.held_bytes is None:
        return line
    held = hier_allgather(hosts, per_host, setting.message_bytes, setting.held_bytes, setting.compiled_steps)
    return line + f"; a cycle of held (cached) ops {fmt_time(held.seconds(params))} of which {_moving(held, params)}"


def _moving(cost: Cost, params: dict[str, float]) -> str:
    """How much of ``cost`` is moving bytes, and how many cross a host's link."""
    per_byte = {**params, "alpha": 0.0, "gamma": 0.0, "alpha_local": 0.0}
    return f"{fmt_time(cost.seconds(per_byte))} moving bytes ({human(int(cost.get('beta', 0)))} over a host's link)"


PLOT_RANKS_PER_HOST = (4, 12)  # Polaris-like and Aurora-like hosts: a column of panels each


def plot(path: Path, params: dict[str, float], setting: Setting, per_hosts: Sequence[int], sizes: list[int],
         points: list[Point]) -> str:
    """docs/scaling.png: predicted time against hosts, a row of panels per size and a column per ranks a host."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is missing from this environment: no plot drawn (the tables above are complete)"
    rows, cols = len(sizes), len(per_hosts)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for row, nbytes in enumerate(sizes):
        for col, per_host in enumerate(per_hosts):
            _panel(axes[row][col], params, setting, per_host, nbytes, points)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Model: alpha {params['alpha'] * 1e6:.1f} µs, beta {params['beta'] * 1e9:.2f} ns/B, "
                 f"gamma {params['gamma'] * 1e6:.1f} µs (benchmarks/scaling.py)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # room for the title above the panels
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


_STYLES = {"hvdrun flat": ("tab:red", "-"), "hvdrun auto": ("tab:blue", "-"), "hvdrun rules": ("tab:cyan", "-."),
           "MPI": ("tab:green", "--"), "NCCL ring": ("tab:gray", ":"), "NCCL tree": ("black", ":")}


def _panel(ax: Any, params: dict[str, float], setting: Setting, per_host: int, nbytes: int,
           points: list[Point]) -> None:
    """One panel: every column's predicted time against hosts, and the measured points of this shape."""
    host_counts = [1 << e for e in range(1, 13)]
    for column, (color, style) in _STYLES.items():
        ys = [column_time(column, h, per_host, nbytes, setting, params)[0] for h in host_counts]
        ax.plot(host_counts, ys, style, color=color, label=column)
    measured = [p for p in points if p.nbytes == nbytes and p.per_host == per_host]
    for kind, marker in (("hvdrun flat", "x"), ("hvdrun auto", "o"), ("MPI", "^")):
        xs = [p.hosts for p in measured if p.kind == kind]
        if xs:
            ax.scatter(xs, [p.seconds for p in measured if p.kind == kind], marker=marker, s=25,
                       color=_STYLES[kind][0], label=f"{kind} measured (shared cores)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"allreduce of {human(nbytes)}, {per_host} ranks per host")
    ax.set_xlabel("hosts")
    ax.set_ylabel("seconds")
    ax.grid(True, which="both", alpha=0.3)


def parse_sizes(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        out.append(SIZES[item] if item in SIZES else int(item))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", nargs="+", metavar="JSON", help="multihost.py --json results to calibrate on")
    parser.add_argument("--check", nargs="+", metavar="JSON",
                        help="multihost.py --json results of other shapes: the model against them, not fitted")
    parser.add_argument("--fit-params", default="alpha,beta,gamma", help="parameters fitted (default alpha,beta,gamma)")
    parser.add_argument("--hosts", default="64,512,4096", help="host counts of the predictions")
    parser.add_argument("--ranks-per-host", type=int, default=4)
    parser.add_argument("--sizes", default="4K,64K,16M,256M")
    for name in PARAMETERS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, help=f"set {name} (seconds), after any fit")
    parser.add_argument("--message-bytes", type=int, default=Setting.message_bytes,
                        help="one rank's announcement in the negotiation (default 20: a cached op)")
    parser.add_argument("--held-bytes", type=int, default=Setting.held_bytes,
                        help="what a rank sends a merge step for a cycle of held (cached) ops (default "
                        f"{Setting.held_bytes}); 0: every rank's announcement reaches every rank, as before")
    parser.add_argument("--eager-bytes", type=int, help=f"HVDRUN_EAGER_BYTES (default {DEFAULT_EAGER_BYTES}; the "
                        f"runtime caps it at {EAGER_JOB_BYTES} / ranks per host across hosts, / ranks when flat)")
    parser.add_argument("--cores", type=int, help="cores of the measuring machine (default: from the JSON, else 2)")
    parser.add_argument("--markdown", action="store_true", help="print only the markdown of docs/scaling.md, no plot")
    parser.add_argument("--plot", default=str(REPO / "docs" / "scaling.png"), help="where to draw (default docs/)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", help="also write parameters and predictions here")
    args = parser.parse_args()

    # the defaults describe the issue's figures, measured before the compiled module; a fit reads it from the sweeps
    setting = Setting(message_bytes=args.message_bytes, held_bytes=args.held_bytes or None, compiled_steps=False)
    if args.fit:
        points, reads, env = load_points(args.fit)
        setting = replace(setting, **{field: int(float(env[name])) for field, name in (
            ("eager_bytes", "HVDRUN_EAGER_BYTES"), ("doubling_max_bytes", "HVDRUN_DOUBLING_MAX_BYTES"),
            ("halving_max_bytes", "HVDRUN_HALVING_MAX_BYTES")) if name in env}, compiled_steps=env["compiled"])
        source = f"fitted to {', '.join(args.fit)}"
    else:
        points, reads, source = list(ISSUE_POINTS), False, "defaults, fitted to the issue's measured figures"
    if args.eager_bytes is not None:
        setting = replace(setting, eager_bytes=args.eager_bytes)
    if args.cores:
        points = [replace(p, cores=args.cores) for p in points]
    names = tuple(n.strip() for n in args.fit_params.split(",") if n.strip())
    unknown = [n for n in names if n not in PARAMETERS]
    if unknown:
        raise SystemExit(f"--fit-params: unknown {', '.join(unknown)}; expected some of {', '.join(PARAMETERS)}")
    defaults = fit(list(ISSUE_POINTS), ("alpha", "beta", "gamma"), START, Setting(compiled_steps=False), False)
    params = fit(points, names, defaults, setting, reads, PRIOR) if args.fit else defaults
    overrides = {n: getattr(args, n) for n in PARAMETERS if getattr(args, n) is not None}
    if overrides:
        params.update(overrides)
        source += "; set by hand: " + ", ".join(overrides)

    hosts = [int(h) for h in args.hosts.split(",")]
    sizes = parse_sizes(args.sizes)
    blocks = [parameter_table(params, source),
              f"Predicted allreduce time, {args.ranks_per_host} ranks per host (one core per rank, one link per "
              "host; X / Y = X's time over Y's):\n\n" + prediction_table(params, setting, hosts, args.ranks_per_host,
                                                                         sizes),
              "\n".join(crossover_line(params, setting, h, args.ranks_per_host) for h in hosts),
              "\n".join(negotiation_line(params, setting, h, args.ranks_per_host) for h in hosts),
              "Model against the measured points:\n\n" + check_table(points, params, setting, reads)]
    if args.check:
        held_out, held_out_reads, _ = load_points(args.check)
        if args.cores:
            held_out = [replace(p, cores=args.cores) for p in held_out]
        blocks.append(f"Model against shapes it was not fitted to ({', '.join(args.check)}):\n\n"
                      + check_table(held_out, params, setting, held_out_reads, held_out=True))
    print("\n\n".join(blocks))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "parameters": params, "source": source, "setting": setting.__dict__,
            "predictions": [{"hosts": h, "ranks_per_host": args.ranks_per_host, "bytes": n, "column": c,
                             "seconds": column_time(c, h, args.ranks_per_host, n, setting, params)[0],
                             "path": column_time(c, h, args.ranks_per_host, n, setting, params)[1]}
                            for h in hosts for n in sizes for c in COLUMNS]}, indent=1))
    if not args.no_plot and not (args.markdown and args.plot == parser.get_default("plot")):
        per_hosts = sorted({*PLOT_RANKS_PER_HOST, args.ranks_per_host})
        print(plot(Path(args.plot), params, setting, per_hosts, sizes, points), file=sys.stderr)


if __name__ == "__main__":
    main()
