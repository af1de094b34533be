"""Per-worker guard: ``python guard.py GRACE_S [OPTIONS] -- COMMAND...``. Standard library only.

Options: ``--signal-as-code``; ``--remove GLOB`` (files the worker leaves, removed once it is gone:
its shared-memory ring); ``--track NAME=VALUE`` (repeatable: processes whose environment holds all
these entries belong to the worker even if they left its process group with ``setsid``; looked for
when the worker's cgroup or the guard as subreaper (``escapees.py``) still holds a process);
``--env-from-stdin NAME`` (repeatable: the first lines of the lifeline are these variables' values, in
order, so that a secret reaches the worker without appearing on any command line); ``--status-fd N``
(the worker's exit status, as :attr:`subprocess.Popen.returncode` and a newline, is written to file
descriptor N just before the guard exits: whoever reads N's other end tells a guard that reported its
worker's end from one that was killed, which closes N without a word).

The guard leads a process group (and session) that holds the worker and everything the
worker starts. Its standard input is a *lifeline* from hvdrun (a pipe, or an SSH channel):

* one byte ``T`` on the lifeline sends SIGTERM to the group, ``K`` SIGKILLs every other
  process of the group (the guard stays to report the worker's status); a byte ``0x80 + N``
  sends signal N to every other process of the group (hvdrun's ``--forward-signals``, e.g.
  SIGUSR1 from a scheduler: the job goes on): that is how hvdrun
  signals a rank on another host, where sshd refuses signal requests for root;
* when the lifeline reaches EOF (hvdrun died, even by SIGKILL, or the connection dropped)
  or the guard gets SIGHUP, it sends SIGTERM to its group, waits up to GRACE_S seconds
  and then SIGKILLs the group, itself included;
* SIGTERM / SIGINT sent to the group reach the worker directly; the guard survives them
  so that it can report the worker's status;
* if the guard itself dies (even by SIGKILL), the kernel SIGKILLs the worker (its parent-death
  signal); the rest of the group is the fork server's to kill (``forkserver.py``);
* when the worker ends, whatever it left in the group (or tracked by environment) is killed and
  the ``--remove`` files are deleted, and so is MPICH's shared-memory segment of the worker
  (``/dev/shm/mpich_shm_<pid in hex>_N``: MPICH removes it in ``MPI_Finalize``, which a rank that
  failed or was killed never reaches); the guard exits with the worker's exit code, or dies of the
  same signal the worker died of. With ``--signal-as-code`` it exits with ``128 + N`` instead
  (SSH clients lose exit signals).

The worker's stdin is /dev/null; stdout and stderr are inherited.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hvdrun import envvars
from hvdrun.launch.remote import cpubind, preload
from hvdrun.launch.remote.escapees import Containment, parent_death_killer
from hvdrun.ranks import layout_of

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TERMINATE, KILL = b"T", b"K"
_Worker = subprocess.Popen[bytes] | preload.ForkedRank
FORWARD = 0x80  # the byte FORWARD + N passes signal N (1..63) to the worker's processes


def forward_byte(signum: int) -> bytes:
    """The lifeline byte that makes the guard pass ``signum`` to the worker's processes."""
    if not 0 < signum < 64:
        raise ValueError(f"signal {signum} cannot be forwarded (1..63)")
    return bytes([FORWARD + signum])


@dataclass
class _Options:
    grace_s: float
    signal_as_code: bool = False
    remove: list[str] = field(default_factory=list)
    track: list[bytes] = field(default_factory=list)
    env_from_stdin: list[str] = field(default_factory=list)
    status_fd: int = -1


def _parse(argv: list[str]) -> tuple[_Options, list[str]]:
    if "--" not in argv or not argv[argv.index("--") + 1:]:
        raise ValueError("no command")
    split = argv.index("--")
    head, command = argv[:split], argv[split + 1:]
    options = _Options(float(head[0]))
    words = iter(head[1:])
    for word in words:
        if word == "--signal-as-code":
            options.signal_as_code = True
        elif word == "--remove":
            options.remove.append(next(words))
        elif word == "--track":
            options.track.append(os.fsencode(next(words)))
        elif word == "--env-from-stdin":
            options.env_from_stdin.append(next(words))
        elif word == "--status-fd":
            options.status_fd = int(next(words))
        else:
            raise ValueError(f"unknown option {word}")
    return options, command


def _kill_group(options: _Options, worker: _Worker) -> None:
    """SIGTERM the whole group, wait for the worker up to the grace period, then SIGKILL everything."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + options.grace_s
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    _kill_others(options)
    _remove_files(options.remove)
    if _containment is not None:
        _containment.close(0.2)
    returncode = worker.poll()
    _report_status(options.status_fd, -signal.SIGKILL if returncode is None else returncode)
    os.killpg(0, signal.SIGKILL)


def _belongs(pid: int, group: int, track: list[bytes]) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if int(stat.read().rsplit(b")", 1)[1].split()[2]) == group:
                return True
        if not track:
            return False
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = set(environ.read().split(b"\0"))
    except (OSError, ValueError, IndexError):
        return False
    return all(entry in entries for entry in track)


_containment: Containment | None = None  # the worker's cgroup (or the guard as subreaper), set by main


def _stop_escapees(group: int) -> None:
    """Kill what left the worker's process group (setsid) and name it: it would hold the rank's output open."""
    if _containment is None:
        return
    named = _containment.stop(group)
    if named:
        rank = os.environ.get(envvars.RANK, "?")
        try:  # hvdrun may be gone (killed): its end of stderr too, and the files must still be removed
            sys.stderr.write(f"hvdrun: warning: rank {rank}: {len(named)} process(es) left the rank's process "
                             f"group (setsid); stopped: {', '.join(named)}\n")
            sys.stderr.flush()
        except OSError:
            pass


def _kill_others(options: _Options) -> None:
    """SIGKILL every process of our group, or tracked by environment, or in the worker's cgroup, but the guard
    itself (Linux /proc)."""
    _stop_escapees(os.getpgrp())
    _signal_others(signal.SIGKILL, options.track)


def _signal_others(signum: int, track: list[bytes] | None = None) -> None:
    """Send ``signum`` to every process of our group (or tracked by environment) but the guard, which would
    die of e.g. SIGUSR1."""
    me, group = os.getpid(), os.getpgrp()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return
    for pid in pids:
        if pid != me and _belongs(pid, group, track or []):
            try:
                os.kill(pid, signum)
            except OSError:
                pass


def _remove_files(patterns: list[str]) -> None:
    for pattern in patterns:
        for path in glob.glob(pattern):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                os.unlink(path)
            except OSError:
                pass


def _mpi_segments(pid: int) -> str:
    """The pattern of MPICH's shared-memory segments of process ``pid`` (see the module docstring)."""
    return f"/dev/shm/mpich_shm_{pid:x}_*"


def _watch_lifeline(options: _Options, worker: _Worker) -> None:
    while True:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            _kill_group(options, worker)
            return
        if KILL in data:
            _kill_others(options)
        elif TERMINATE in data:
            os.killpg(0, signal.SIGTERM)
        for byte in data:
            if byte > FORWARD:
                _signal_others(byte - FORWARD)


def _read_line(fd: int) -> str | None:
    """One line of ``fd``, read a byte at a time so that nothing after it is consumed; None at EOF."""
    line = bytearray()
    while True:
        try:
            byte = os.read(fd, 1)
        except OSError:
            return None
        if not byte:
            return None
        if byte == b"\n":
            return line.decode()
        line += byte


def _env_from_stdin(names: list[str]) -> None:
    """Set ``names`` from the lifeline's first lines; a lifeline that ends first means hvdrun is gone."""
    for name in names:
        value = _read_line(0)
        if value is None:
            sys.stderr.write(f"hvdrun: the launcher went away before sending {name}\n")
            sys.exit(1)
        os.environ[name] = value


def _report_status(fd: int, returncode: int) -> None:
    """Write the worker's status to ``fd`` (``--status-fd``); nobody may be reading any more."""
    if fd < 0:
        return
    try:
        os.write(fd, f"{returncode}\n".encode())
    except OSError:
        pass


def _exit_like(returncode: int, signal_as_code: bool) -> None:
    if returncode >= 0:
        sys.exit(returncode)
    signum = -returncode
    if signal_as_code:
        sys.exit(128 + signum)
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers cannot be changed
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)


def inherited_fds(environ: Mapping[str, str]) -> tuple[int, ...]:
    """File descriptors the command must inherit: MPICH's PMI-1 connection (``PMI_FD``), which
    mpiexec's proxy opened for the rank and which ``MPI_Init`` reads back by number."""
    fd = environ.get(envvars.PMI_FD, "")
    if fd.isdigit():
        try:
            os.fstat(int(fd))
            return (int(fd),)
        except OSError:
            pass
    return ()


def command_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: the guard's, with the ``horovod`` shim package first on ``PYTHONPATH``
    when the job asked for it (``hvdrun --horovod-compat``); the shim of this host's hvdrun."""
    env = dict(environ)
    if env.get(envvars.HOROVOD_COMPAT) == "1":
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hvdrun/
        shim = os.path.join(package, "compat")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
    return env


def _gpu_nodes(environ: Mapping[str, str], local_size: int) -> list[int] | None:
    """The NUMA node of each local rank's GPU (``--cpu-bind cores`` with GPUs), from the job's layout and /sys."""
    if envvars.GPU_LAYOUT not in environ:
        return None
    layout = layout_of(environ[envvars.GPU_LAYOUT])
    devices = [layout.cards_for(local, "") for local in range(local_size)]
    return cpubind.local_gpu_nodes(devices, cpubind.gpu_numa_nodes(layout.vendor))


def bind_cpus(environ: Mapping[str, str]) -> None:
    """Apply the job's ``--cpu-bind`` (``HVDRUN_CPU_BIND``) to this process, so the rank it starts
    inherits it, and print the rank's line of the bindings report when asked (``--verbose``).

    A binding that does not fit this host ends the rank with one line and exit code 2.
    """
    policy = environ.get(envvars.CPU_BIND, "none")
    report = environ.get(envvars.BIND_REPORT) == "1"
    if policy == "none" and not report or not hasattr(os, "sched_setaffinity"):
        return
    rank, host = environ.get(envvars.RANK, "?"), environ.get(envvars.HOSTNAME, "?")
    nodes = cpubind.numa_nodes()
    try:
        bind = cpubind.parse_cpu_bind(policy)
        allowed = os.sched_getaffinity(0)
        local_size = int(environ.get(envvars.LOCAL_SIZE, "1"))
        cores = cpubind.cores_for(bind, int(environ.get(envvars.LOCAL_RANK, "0")), local_size, allowed, nodes,
                                  cpubind.thread_siblings(allowed) if bind.policy == "cores" else None,
                                  _gpu_nodes(environ, local_size))
        os.sched_setaffinity(0, cores)
    except (cpubind.CpuBindError, ValueError, OSError) as e:
        sys.stderr.write(f"hvdrun: error: rank {rank} on {host}: {e}\n")
        sys.exit(2)
    if report:
        sys.stderr.write(f"hvdrun: binding: rank {rank} on {host}: cores {cpubind.format_cpulist(cores)} "
                         f"(NUMA {cpubind.numa_of(cores, nodes)}), GPU {_gpu_seen(environ)} [--cpu-bind {policy}]\n")


def _gpu_seen(environ: Mapping[str, str]) -> str:
    """``3 (device 0 of CUDA_VISIBLE_DEVICES=3,2,1,0)``: the rank's own GPU and what it sees (bindings report)."""
    shown = envvars.devices_shown(environ)
    if shown is None:
        return "-"
    described, devices = shown
    ordinal = environ.get(envvars.DEVICE_ORDINAL, "")
    if not ordinal.isdigit() or int(ordinal) >= len(devices):
        return described
    return f"{devices[int(ordinal)]} (device {ordinal} of {described})"


def _start_worker(command: list[str], prepare: Callable[[], object]) -> _Worker:
    """Start the worker: forked from this process when it preloaded what the rank imports and nothing the rank's
    interpreter would decide at its start differs (``preload.py``), else as a new process."""
    env, inherit = command_env(os.environ), inherited_fds(os.environ)
    parsed = preload.why_not(command, env, bound=os.environ.get(envvars.CPU_BIND, "none") != "none")
    if isinstance(parsed, preload.PythonCommand):
        return preload.start(command, parsed, env, inherit, prepare)
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=inherit, env=env,
                            preexec_fn=prepare)  # noqa: PLW1509


def main(argv: list[str]) -> None:
    """Run the guard; ``argv`` is ``[GRACE_S, OPTIONS..., "--", COMMAND...]``."""
    try:
        options, command = _parse(argv)
    except (ValueError, IndexError, StopIteration) as e:
        sys.stderr.write(f"usage: guard.py GRACE_S [--signal-as-code] [--remove GLOB] [--track NAME=VALUE]... "
                         f"[--env-from-stdin NAME]... [--status-fd N] -- COMMAND... ({e})\n")
        sys.exit(2)
    if os.getpgid(0) != os.getpid():
        os.setsid()
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda *_: None)
    _env_from_stdin(options.env_from_stdin)
    bind_cpus(os.environ)
    global _containment
    _containment = Containment(f"{os.environ.get(envvars.JOB_ID, 'job')}-r{os.environ.get(envvars.RANK, '0')}")
    enter, die_with_guard = _containment.enter, parent_death_killer()
    if (warning := envvars.warning_signal(os.environ)) is not None:  # ignored across exec, till the rank's handler
        signal.signal(warning, signal.SIG_IGN)
    try:  # from the main thread (the parent-death signal follows the thread that forked), before any other starts
        worker = _start_worker(command, lambda: (enter(), die_with_guard()))
    except OSError as e:
        sys.stderr.write(f"hvdrun: cannot start {command[0]!r}: {e.strerror}\n")
        sys.exit(127)
    signal.signal(signal.SIGHUP, lambda *_: _kill_group(options, worker))
    threading.Thread(target=_watch_lifeline, args=(options, worker), daemon=True).start()
    returncode = worker.wait()
    if not _containment.holds_nothing():
        _kill_others(options)
    _containment.close()
    _remove_files([*options.remove, _mpi_segments(worker.pid)])
    _report_status(options.status_fd, returncode)
    _exit_like(returncode, options.signal_as_code)


if __name__ == "__main__":
    main(sys.argv[1:])
