"""Environment staging (``hvdrun --stage-env``): the ranks' Python environment copied once per host to
node-local storage, and the ranks run from the copy.

At a few hundred nodes the slow part of a job's start is every rank importing torch from the shared file
system (thousands of small files, each a metadata round trip, times every rank). A copy on each node's own
disk turns that into one tar stream per node. The flow:

1. At plan time (:func:`plan_staging`), each Python the ranks run must live in a virtual environment
   (``pyvenv.cfg`` beside ``bin/``) or a conda environment (``conda-meta/``) on this machine; its
   fingerprint is the path and the modification times of its top-level and site-packages entries.
2. After the launcher reached the hosts (:func:`stage`), each host runs one ``sh`` line
   (:mod:`hvdrun.launch.stage_unpack`) that takes a lock and answers ``HAVE PATH`` when a complete copy is there,
   else ``NEED PATH``. This machine copies the environment itself (``tar | tar``); the remote hosts that need
   it get it down a tree (:mod:`hvdrun.launch.stage_tree`): one host reads the environment from the shared file
   system, once for the whole job, and every host passes the stream on to its children while it unpacks. The
   ssh launcher starts the hosts' relays over its connections, the mpiexec launcher with one more ``mpiexec``
   of one process a host.
3. The ranks' Python becomes the copy's (``PATH`` starts with its ``bin/``): :func:`staged_env`.

On a host, under the staging directory (``--stage-dir``, the YAML's ``local_dir``, else ``/tmp``)::

    hvdrun-UID/                 mode 700 and owned by the user: another user of a shared /tmp cannot
                                hand the ranks a copy of their own
      env-FINGERPRINT/          the copy; its .hvdrun-staged marker is written last, then the directory is
                                renamed into place, so a copy without it (a killed job's) is redone, never used
      .env-FINGERPRINT.lock     flock(1) while one job checks or unpacks (ranks of two jobs on one node)
      .env-FINGERPRINT.partial.PID   an unpack in progress (a killed job's is removed by the next one)

The copy stays after the job, for the next one; ``rm -rf DIR/hvdrun-UID`` removes every copy. A virtual
environment's copy still runs the base interpreter its ``pyvenv.cfg`` names (and that interpreter's standard
library); a conda environment's copy brings its own. Console scripts in the copy's ``bin/`` keep the
original environment's path in their ``#!`` line: ranks run ``python script.py`` or ``python -m``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hvdrun.errors import UsageError
from hvdrun.hosts import Host
from hvdrun.launch.stage_tree import RelayStarter, StageTree, TreeReport, stage_fanout
from hvdrun.launch.stage_unpack import Environment, HostStaged, copy_here, stop_local_copies

DEFAULT_STAGE_DIR = "/tmp"  # noqa: S108 - node-local by default; the copy lives in a private hvdrun-UID/ below it

@dataclass(frozen=True)
class StagePlan:
    """What ``--stage-env`` stages: where on each host, and the environment of each Python of the job."""

    directory: str
    environments: Mapping[str, Environment] = field(default_factory=dict)  # by the Python the ranks run


def find_environment(python: str) -> Environment:
    """The environment of ``python`` (``PREFIX/bin/python`` of a venv or conda environment), fingerprinted.

    Raises:
        UsageError: ``python`` is not on this machine, or not in a virtual or conda environment.
    """
    if not os.path.isabs(python) or not os.path.exists(python):
        raise UsageError(f"--stage-env packs the ranks' Python environment on this machine, and their Python "
                         f"{python} is not here; run hvdrun where that environment is (it is usually on the "
                         "shared file system)")
    prefix = os.path.dirname(os.path.dirname(python))
    if not (os.path.isfile(os.path.join(prefix, "pyvenv.cfg")) or os.path.isdir(os.path.join(prefix, "conda-meta"))):
        raise UsageError(f"--stage-env copies a virtual environment or a conda environment, and the ranks' "
                         f"Python {python} is in neither (no pyvenv.cfg or conda-meta/ in {prefix}); create one, "
                         "e.g. 'python -m venv --system-site-packages ENV', and run hvdrun from it")
    return Environment(python, prefix, fingerprint(Path(prefix)))


def fingerprint(prefix: Path) -> str:
    """12 hex digits that change when ``prefix`` moves or a package is installed, upgraded or removed.

    What is hashed: the path, then name, size and modification time of every entry of ``prefix``, of its
    ``bin/`` and of every ``site-packages`` directory (installing a package adds or replaces entries there).
    A file edited in place inside a package is not seen; ``touch PREFIX`` forces a new copy.
    """
    digest = hashlib.sha256(str(prefix).encode())
    for directory in (prefix, prefix / "bin", *_site_packages(prefix)):
        for entry in _entries(directory):
            digest.update(f"{entry.name}\0{entry.size}\0{entry.mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class _Entry:
    name: str
    size: int
    mtime_ns: int


def _entries(directory: Path) -> list[_Entry]:
    """``directory`` itself and its entries (symbolic links not followed), sorted; none when it is missing."""
    try:
        with os.scandir(directory) as scan:
            found = [_Entry(str(directory / e.name), *_size_mtime(e.stat(follow_symlinks=False))) for e in scan]
        return [_Entry(str(directory), *_size_mtime(directory.stat())), *sorted(found, key=lambda e: e.name)]
    except FileNotFoundError:
        return []


def _size_mtime(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _site_packages(prefix: Path) -> list[Path]:
    """``lib/pythonX.Y/site-packages`` (venv, conda) and ``Lib/site-packages`` style directories of ``prefix``."""
    return sorted({*prefix.glob("lib*/python*/site-packages"), *prefix.glob("lib*/site-packages")})


def check_stage_dir(directory: str, where: str) -> str:
    """``directory`` as given, when it can name the same directory on every host.

    Raises:
        UsageError: a relative path, or one with a line break or NUL.
    """
    if not directory.startswith("/") or any(c in directory for c in "\n\r\0"):
        raise UsageError(f"{where} {directory!r}: expected an absolute path on every host's own disk, e.g. /tmp")
    return directory.rstrip("/") or "/"


def plan_staging(directory: str, pythons: Sequence[str]) -> StagePlan:
    """The staging plan of a job whose ranks run ``pythons`` (one per host, often all the same).

    Raises:
        UsageError: a Python that is not in an environment on this machine.
    """
    return StagePlan(directory, {python: find_environment(python) for python in dict.fromkeys(pythons)})


def staged_env(python: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that make ``python``'s environment (a staged copy) the ranks' own: its ``bin/`` first on
    ``PATH``, and ``VIRTUAL_ENV`` naming it when the launcher's environment had one activated."""
    bin_dir = os.path.dirname(python)
    changed = {"PATH": f"{bin_dir}:{env['PATH']}" if env.get("PATH") else bin_dir}
    if "VIRTUAL_ENV" in env:
        changed["VIRTUAL_ENV"] = os.path.dirname(bin_dir)
    return changed


class Reach(Protocol):
    """How hvdrun reaches the job's hosts to stage them (the ssh and mpiexec launchers; :class:`ThisMachine` for
    the local one)."""

    def is_remote(self, host: Host) -> bool:
        """Whether ``host`` gets its copy through the staging tree (else: this machine copies it itself)."""
        ...

    def relays(self, hosts: Sequence[tuple[Host, str]], directory: str) -> RelayStarter:
        """What starts the staging relay on each of ``hosts`` (with its Python), in this order."""
        ...

    def callback_address(self, hosts: Sequence[Host]) -> str:
        """This machine's address as ``hosts`` reach it."""
        ...

    @property
    def network_interface(self) -> str | None:
        """The job's network interface (``--network-interface``), where the relays listen; None: the route's."""
        ...


class ThisMachine:
    """Every host is this machine (the local launcher)."""

    def is_remote(self, host: Host) -> bool:
        """Never."""
        return False

    def relays(self, hosts: Sequence[tuple[Host, str]], directory: str) -> RelayStarter:
        """Never asked: no host is remote."""
        raise AssertionError("the local launcher has no remote host")

    def callback_address(self, hosts: Sequence[Host]) -> str:
        """Loopback."""
        return "127.0.0.1"

    @property
    def network_interface(self) -> str | None:
        """None: no remote host listens."""
        return None


def stage(plan: StagePlan, hosts: Sequence[tuple[Host, str]], reach: Reach) -> tuple[dict[str, HostStaged], str]:
    """Stage each host's environment on it: this machine copies its own; the remote hosts get theirs down a tree
    (:mod:`hvdrun.launch.stage_tree`), one tree an environment.

    Args:
        plan: the directory, and the environments by Python.
        hosts: each host of the job with the Python its ranks run.
        reach: which hosts are remote, and how their relays start.

    Returns:
        Each host name's staging, and the one line that tells the user what it did.

    Raises:
        UsageError: the staging directory cannot be used on a host (named).
        LaunchError: a host could not unpack the copy (named, with the cause: disk full, ...).
    """
    started = time.monotonic()
    remote = [(host, python) for host, python in hosts if reach.is_remote(host)]
    here = next((python for host, python in hosts if not reach.is_remote(host)), None)
    result: dict[str, HostStaged] = {}
    trees: list[TreeReport] = []
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdrun-stage-here") as pool:
            mine = pool.submit(copy_here, plan.directory, plan.environments[here]) if here is not None else None
            for python in dict.fromkeys(python for _, python in remote):  # meanwhile, the remote hosts' trees
                members = [(host, p) for host, p in remote if p == python]
                tree = StageTree([host.name for host, _ in members], plan.environments[python], plan.directory,
                                 stage_fanout(os.environ), reach.network_interface)
                report = tree.run(reach.relays(members, plan.directory),
                                  reach.callback_address([host for host, _ in members]))
                trees.append(report)
                result.update({staged.host: staged for staged in report.staged})
            if mine is not None:
                result.update({host.name: mine.result() for host, _ in hosts if not reach.is_remote(host)})
    except KeyboardInterrupt:  # hvdrun got a stop signal (hvdrun.interrupts): its copies here stop with it
        stop_local_copies()
        raise
    done = [*({id(s): s for s in result.values()}.values())]
    environments = [plan.environments[p] for p in dict.fromkeys(p for _, p in hosts)]
    return result, describe(done, environments, time.monotonic() - started, trees)


def describe(done: Sequence[HostStaged], environments: Sequence[Environment], seconds: float,
             trees: Sequence[TreeReport] = ()) -> str:
    """One line: how many hosts got a copy and how, the bytes and seconds, how many had one already."""
    where = ", ".join(sorted({d.copy for d in done}))
    sources = ", ".join(e.prefix for e in environments)
    made = [d for d in done if d.via]
    if not made:
        return f"hvdrun: --stage-env: {sources} already staged on {_hosts(len(done))} ({where})"
    how = "; ".join(_how(made, trees))
    already = len(done) - len(made)
    return (f"hvdrun: --stage-env: staged {sources} on {_hosts(len(made))} in {seconds:.1f} s "
            f"({_size(max(d.copied_bytes for d in made))} each: {how})"
            f"{f', already staged on {_hosts(already)}' if already else ''}; the ranks run from {where}")


def _how(made: Sequence[HostStaged], trees: Sequence[TreeReport]) -> list[str]:
    """How the copies were made: here, and down each tree (who read the source, how much, the tree's shape)."""
    ways = ["copied here"] if any(d.via == "copy" for d in made) else []
    for tree in trees:
        count = sum(1 for d in tree.staged if d.via == "tree")
        if not count:
            continue
        reader = f"read once by {tree.source_host}" if tree.source_host else "sent once by hvdrun"
        ways.append(f"{reader} ({_size(tree.source_bytes)} from the source), then host to host to "
                    f"{_hosts(count)}, fan-out {tree.fanout}, depth {tree.depth}")
    return ways


def _hosts(count: int) -> str:
    return f"{count} host{'s' if count != 1 else ''}"


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
