"""One rank under mpiexec: ``python -m hvdrun.launch.remote.mpirank GRACE_S -- COMMAND...``.

mpiexec (MPICH hydra, Open MPI, Cray PALS) starts one copy of this shim per rank. The shim

1. reads its MPI rank (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``PALS_RANKID``, ``PMIX_RANK``) and
   the job plan hvdrun put in ``HVDRUN_MPI_PLAN`` (hosts, -np, GPU layout), and computes its slot
   with the same pure :func:`hvdrun.ranks.assign_slots` as every other launcher;
2. gives the command hvdrun's environment contract for that slot (``HVDRUN_*``, ``HOROVOD_*``,
   torchrun's variables, ``CUDA_VISIBLE_DEVICES`` pinned in the machine's GPU order);
3. runs it under hvdrun's guard, whose lifeline is a pipe from this shim: if the shim is killed
   outright, the guard stops the command's whole process group by itself, removes the rank's
   shared memory and stops processes tracked by the job's environment;
4. prefixes every output line with ``[rank]<stdout>:`` or ``[rank]<stderr>:``, then reports
   ``[rank]<exit>:CODE``, so hvdrun can split mpiexec's merged output back into ranks and name
   the rank that failed first;
5. forwards SIGTERM / SIGINT to the group (SIGKILL after GRACE_S), and stops it when its parent
   (mpiexec's proxy) dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from hvdrun import envvars
from hvdrun.hosts import Host
from hvdrun.launch.remote.forkserver import GuardStatus, describe_status
from hvdrun.launch.remote.guard import forward_byte
from hvdrun.launch.remote.lines import LineSplitter, tag
from hvdrun.ranks import GpuLayout, Slot, assign_slots, layout_of, layout_value

_PR_SET_PDEATHSIG = 1
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)  # what MPICH's hydra, Open MPI's mpirun and srun pass to their ranks
_write_lock = threading.Lock()


def plan_value(hosts: list[Host], num_proc: int, layout: GpuLayout) -> str:
    """The ``HVDRUN_MPI_PLAN`` value that lets every shim compute its slot."""
    return json.dumps({"hosts": [[h.name, h.slots] for h in hosts], "np": num_proc, "gpus": layout_value(layout)})


def slot_of(environ: Mapping[str, str]) -> Slot:
    """This rank's slot, from the MPI rank and hvdrun's plan."""
    plan = json.loads(environ[envvars.MPI_PLAN])
    layout = layout_of(plan["gpus"])
    slots = assign_slots([Host(name, slots) for name, slots in plan["hosts"]], plan["np"], layout)
    rank = envvars.mpi_rank(environ)
    if rank is None or not 0 <= rank < len(slots):
        raise SystemExit(f"hvdrun: mpirank: no MPI rank in the environment, or rank {rank} outside the job "
                         f"of {len(slots)} ranks")
    return slots[rank]


def worker_environment(environ: Mapping[str, str]) -> tuple[Slot, dict[str, str]]:
    """The slot and full environment of this rank's command."""
    slot = slot_of(environ)
    rendezvous = envvars.rendezvous_of(environ)
    env = {**environ, **envvars.thread_env(slot, os.cpu_count() or 1, environ), **envvars.worker_env(slot, rendezvous)}
    return slot, env


def _emit(rank: int, stream: str, line: bytes) -> None:
    data = tag(rank, stream, line)
    with _write_lock:
        view, fd = memoryview(data), 2 if stream == "stderr" else 1
        while view:
            view = view[os.write(fd, view):]


def _pump(rank: int, stream: str, fd: int) -> None:
    splitter = LineSplitter()
    while data := os.read(fd, 1 << 20):
        for line in splitter.feed(data):
            _emit(rank, stream, line)
    for line in splitter.close():
        _emit(rank, stream, line)
    os.close(fd)


def _pass_on(lifeline: int, signum: int) -> None:
    """Have the guard pass ``signum`` to the rank's processes (the job goes on)."""
    try:
        os.write(lifeline, forward_byte(signum))
    except OSError:
        pass  # the guard has ended


def _stop(worker: subprocess.Popen[bytes], grace_s: float, signum: int) -> None:
    try:
        os.killpg(worker.pid, signum)
        deadline = time.monotonic() + grace_s
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> None:
    """Run one rank; ``argv`` is ``[GRACE_S, "--", COMMAND...]``."""
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m hvdrun.launch.remote.mpirank GRACE_S -- COMMAND...")
    grace_s = float(argv[0])
    slot, env = worker_environment(os.environ)
    try:  # die with mpiexec's proxy (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    lifeline, _keep_open = os.pipe()  # ours is not inherited: if this shim dies, even by SIGKILL, the guard sees EOF
    status_r, status_w = os.pipe()  # the guard writes its rank's status there before it exits; killed, it writes none
    os.set_inheritable(status_w, True)
    guard = [sys.executable, "-m", "hvdrun.launch.remote.guard", f"{grace_s:g}", *envvars.guard_options(env),
             "--status-fd", str(status_w), "--"]
    worker = subprocess.Popen([*guard, *argv[2:]], stdin=lifeline, stdout=out_w, stderr=err_w, env=env,
                              start_new_session=True, close_fds=False)  # close_fds=False: MPI's PMI_FD stays
    for fd in (out_w, err_w, lifeline, status_w):
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: threading.Thread(target=_stop, args=(worker, grace_s, s)).start())
    for signum in PASSED_ON:  # where mpiexec/srun pass these on (Open MPI, srun): the guard hands them to the rank
        signal.signal(signum, lambda s, _f: _pass_on(_keep_open, s))
    pumps = [threading.Thread(target=_pump, args=(slot.rank, s, fd)) for s, fd in (("stdout", out_r),
                                                                                    ("stderr", err_r))]
    for pump in pumps:
        pump.start()
    code = worker.wait()
    try:  # what the command left in its group would hold the output pipes open
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pump in pumps:
        pump.join()
    if code < 0 and GuardStatus(status_r).read() is None:  # no status: the guard was killed (its rank by PDEATHSIG)
        _emit(slot.rank, "stderr", f"hvdrun: error: rank {slot.rank}'s guard (pid {worker.pid}) on {slot.hostname} "
                                   f"{describe_status(code)}; its rank was stopped\n".encode())
    _emit(slot.rank, "exit", f"{code}\n".encode())
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
