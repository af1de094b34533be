"""Processes that leave a rank's process group (``setsid``) and clear its environment (``env -i``) are
still found and stopped with the rank. Standard library only; Linux.

Where the cgroup v2 hierarchy is writable, the guard starts its worker in a cgroup of its own
(``hvdrun-<label>-<guard pid>``, beside the guard's) and kills the whole cgroup (``cgroup.kill``) at
the end: nothing the worker starts can leave it. Elsewhere the guard becomes a child subreaper, so the
worker's orphans are reparented to the guard, which finds them by parent pid. Either way the ones
outside the worker's process group are named in a warning when they are stopped.
"""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import time
from collections.abc import Callable

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _cgroup2_mount() -> tuple[str, str] | None:
    """(mount point, root inside the hierarchy) of the cgroup v2 file system, or None."""
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            for line in mountinfo:
                fields = line.split()
                if fields[fields.index("-") + 1] == "cgroup2":
                    return fields[4], fields[3]
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_cgroup_dir() -> str | None:
    """This process's cgroup v2 directory, or None without a cgroup v2 hierarchy."""
    mount = _cgroup2_mount()
    try:
        with open("/proc/self/cgroup") as cgroups:
            path = next((line[3:].strip() for line in cgroups if line.startswith("0::")), None)
    except OSError:
        return None
    if mount is None or path is None or not path.startswith(mount[1]):
        return None
    return os.path.join(mount[0], path[len(mount[1]):].lstrip("/"))


def _make_cgroup(label: str) -> str | None:
    parent = _own_cgroup_dir()
    if parent is None:
        return None
    path = os.path.join(parent, f"hvdrun-{label}-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    if os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        return path
    _remove(path)
    return None


def kill_rank_cgroups(guard: int) -> None:
    """SIGKILL everything in the cgroups that the guard ``guard``, a child of this process, made for its worker
    (``hvdrun-*-GUARD`` beside ours) and remove the ones already empty: a guard killed leaves its cgroup."""
    parent = _own_cgroup_dir()
    if parent is None:
        return
    for path in glob.glob(os.path.join(glob.escape(parent), f"hvdrun-*-{guard}")):
        _write(os.path.join(path, "cgroup.kill"), "1")
        _remove(path)  # fails while its killed processes are still going: left for the machine's tools


def _remove(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def command_of(pid: int) -> str:
    """The command line of ``pid``, shortened, for a warning."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return words[:120] or "?"


class Containment:
    """The guard's hold on everything its worker starts (see the module docstring).

    Args:
        label: part of the cgroup's name (job id and rank).
    """

    def __init__(self, label: str) -> None:
        self.cgroup = _make_cgroup(label)
        self.subreaper = _become_subreaper()  # also with a cgroup: moving the worker into it may fail
        self._named: set[int] = set()

    def enter(self) -> None:
        """Move the calling process into the cgroup (the worker, between fork and exec)."""
        if self.cgroup is not None:
            try:
                with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as procs:
                    procs.write(str(os.getpid()))
            except OSError:
                pass

    def _cgroup_members(self) -> set[int]:
        if self.cgroup is None:
            return set()
        try:
            with open(os.path.join(self.cgroup, "cgroup.procs")) as procs:
                return {int(line) for line in procs if line.strip()}
        except (OSError, ValueError):
            return set()

    def _members(self) -> list[int]:
        """The cgroup's processes, and the orphans reparented to the guard (the worker's own child aside)."""
        members = self._cgroup_members()
        if self.subreaper:
            me = os.getpid()
            members.update(pid for pid in _all_pids() if (_stat(pid) or ("", 0, 0))[1] == me)
        return sorted(members)

    def holds_nothing(self) -> bool:
        """Whether the worker, once reaped, left no process at all: as subreaper the guard has no child (every
        live descendant would be one, or the child of one) and the cgroup is empty. Reads no other process's
        files, so that a host's guards ending together do not each scan every process of the host."""
        if not self.subreaper:
            return False
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return not self._cgroup_members()
        return False

    def escapees(self, group: int) -> list[int]:
        """Live processes of the worker that left the process group ``group``."""
        found = []
        for pid in self._members():
            stat = _stat(pid)
            if stat is not None and stat[0] != "Z" and stat[2] != group:
                found.append(pid)
        return found

    def stop(self, group: int) -> list[str]:
        """SIGKILL everything the worker left (the whole cgroup, or the escapees); returns ``pid N (command)``
        for each escapee not named before."""
        found = self.escapees(group)
        named = [f"pid {pid} ({command_of(pid)})" for pid in found if pid not in self._named]
        self._named.update(found)
        killed_cgroup = self.cgroup is not None and _write(os.path.join(self.cgroup, "cgroup.kill"), "1")
        for pid in found if killed_cgroup or self.cgroup is None else self._members():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return named

    def close(self, wait_s: float = 1.0) -> None:
        """Remove the cgroup once it is empty (its killed processes take a moment to go); reap orphans."""
        if self.subreaper:
            reap_children()
        if self.cgroup is None:
            return
        deadline = time.monotonic() + wait_s
        while self._cgroup_members() and time.monotonic() < deadline:
            time.sleep(0.01)
        _remove(self.cgroup)


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as file:
            file.write(text)
        return True
    except OSError:
        return False


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def parent_death_killer(parent: int | None = None) -> Callable[[], None]:
    """A function for a child between fork and exec (``preexec_fn``), or for a process that its parent ``parent``
    started, to call at its start: the kernel SIGKILLs the caller when the thread that forked it dies
    (``PR_SET_PDEATHSIG``; fork from the main thread), and the caller kills itself at once if its parent already
    died. libc is looked up here (before the fork)."""
    parent = os.getpid() if parent is None else parent
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: nobody would send the signal
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def reap_children() -> None:
    """Collect every ended child of this process (the guard's reparented orphans would stay zombies until it
    exits)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
