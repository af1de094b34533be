"""The runtime of one process: ``init()`` builds rendezvous, backend and engine; ``shutdown()`` tears them down."""

from __future__ import annotations

import atexit
import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hvdrun import envvars
from hvdrun.errors import CollectiveError, NotInitializedError, RendezvousError, UsageError
from hvdrun.protocol.inspection import VITALS, format_reports
from hvdrun.protocol.rounds import Assignment
from hvdrun.protocol.tree import tree_place
from hvdrun.runtime.backends.backend import Backend, World
from hvdrun.runtime.backends.torchdist import open_store
from hvdrun.runtime.collectives.hierarchical import (
    DEFAULT_DOUBLING_MAX_BYTES,
    DEFAULT_HALVING_MAX_BYTES,
    AlgorithmChoice,
)
from hvdrun.runtime.device import DeviceCollectives, device_backend_name, select_current_device
from hvdrun.runtime.engine import Engine
from hvdrun.runtime.forensics import rank_report
from hvdrun.runtime.membership import is_elastic, join_round
from hvdrun.runtime.negotiation import DEFAULT_CACHE_CAPACITY
from hvdrun.runtime.rendezvous import Rendezvous
from hvdrun.runtime.timeline import Timeline
from hvdrun.runtime.transport.channels import AbortFlag
from hvdrun.runtime.vitals import rank_vitals

BACKENDS = ("ring", "mpi", "gloo")
_CAUSE_WAIT_S = 1.0  # how long a rank that failed to join waits to hear a peer's failure that caused it
DEFAULT_FUSION_BYTES = 64 << 20
DEFAULT_EAGER_BYTES = 64 << 10
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class Runtime:
    """Everything ``init()`` created in this process."""

    launch: envvars.LaunchInfo
    backend: Backend
    engine: Engine
    rendezvous: Rendezvous | None
    device: DeviceCollectives | None = None
    timeline_dynamic: bool = False
    assignment: Assignment | None = None  # this process's round of an elastic job

    @property
    def world(self) -> World:
        """This rank's topology."""
        return self.backend.world


_lock = threading.Lock()
_runtime: Runtime | None = None
_generation = 0
_atexit_registered = False


def _choose_backend(launch: envvars.LaunchInfo, environ: Mapping[str, str]) -> str:
    name = environ.get(envvars.BACKEND, "").lower() or ("mpi" if launch.launcher == "mpi" else "ring")
    if name not in BACKENDS:
        raise UsageError(f"{envvars.BACKEND}={name!r}; expected one of {', '.join(BACKENDS)}")
    if launch.launcher == "mpi" and name == "ring":
        raise UsageError(f"started by an MPI launcher without hvdrun: use {envvars.BACKEND}=mpi (the default there)")
    return name


def _connect(launch: envvars.LaunchInfo, environ: Mapping[str, str], abort: AbortFlag,
             generation: int, store_port: int, timeout_s: float) -> tuple[Backend, Rendezvous | None]:
    name = _choose_backend(launch, environ)
    if name == "mpi":
        from hvdrun.runtime.backends.mpi import MpiBackend

        backend = MpiBackend.connect()
        if backend.world.size != launch.size:
            raise UsageError(f"rank {launch.rank}: {envvars.BACKEND}=mpi, but MPI sees {backend.world.size} rank(s) "
                             f"where the job has {launch.size}: the ranks were not started by MPI; use "
                             "'hvdrun --launcher mpiexec' (or mpiexec itself) for the MPI backend")
        return backend, None
    if launch.size == 1 and launch.launcher == "single":
        from hvdrun.runtime.backends.native import NativeBackend

        return NativeBackend.single(launch.hostname, abort), None
    if not launch.secret or launch.rendezvous_addr is None or launch.rendezvous_port is None:
        raise UsageError(f"rank {launch.rank}: {envvars.SECRET} and the rendezvous address are required; "
                         "start workers with hvdrun")
    local_size = None if is_elastic(environ) else _local_size(environ)  # elastic: a host's ranks change
    tree = None if is_elastic(environ) else tree_place(environ)  # elastic: hosts come and go
    rendezvous = Rendezvous(launch.rank, launch.size, launch.rendezvous_addr, launch.rendezvous_port,
                            launch.secret.encode(), abort, generation, local_size, tree)
    rendezvous.set_reporter(functools.partial(_report, launch, None))  # until the engine runs
    try:
        if name == "gloo":
            from hvdrun.runtime.backends.torchdist import TorchBackend

            return TorchBackend.connect(launch, rendezvous, timeout_s, generation, store_port, abort), rendezvous
        from hvdrun.runtime.backends.native import NativeBackend

        use_shm = environ.get(envvars.TRANSPORT, "").lower() != "tcp"
        return NativeBackend.connect(rendezvous, launch.hostname, f"{launch.job_id}-{generation}",
                                     launch.secret.encode(), abort, timeout_s, use_shm, store_port,
                                     algorithm_choice(environ),
                                     envvars.wait_policy(environ)), rendezvous
    except BaseException as e:
        cause = _heard_cause(abort, e)
        rendezvous.report_failure(f"rank {launch.rank} failed while joining the job: {cause or e}")  # none waits
        rendezvous.close()
        if cause is not None:
            raise RendezvousError(f"{cause} (here: {e})") from e
        raise


def _heard_cause(abort: AbortFlag, error: BaseException) -> str | None:
    """Why the job stops, when ``error`` (a peer that could not be reached while joining) is only its symptom: a
    peer that failed first makes its neighbours' connections fail before its failure reaches them over the control
    connections (a refused or reset connection, a shared-memory segment already removed), so wait a moment for it
    (None: no other failure was heard; ``error`` is the cause)."""
    if not isinstance(error, Exception) or isinstance(error, UsageError):
        return None
    deadline = time.monotonic() + _CAUSE_WAIT_S
    while abort.reason is None and time.monotonic() < deadline:
        time.sleep(0.02)
    reason = abort.reason
    return reason if reason is not None and reason not in str(error) else None


def _local_size(environ: Mapping[str, str]) -> int | None:
    """The number of ranks on this host as the launcher set it, for the rendezvous's host leaders; None when it is
    missing or not a number (every rank then joins rank 0 itself)."""
    try:
        return int(environ[envvars.LOCAL_SIZE])
    except (KeyError, ValueError):
        return None


def algorithm_choice(environ: Mapping[str, str]) -> AlgorithmChoice:
    """Which algorithm crosses hosts, from ``HVDRUN_ALGORITHM`` and the crossover sizes.

    Raises:
        UsageError: a value is not one of the algorithms or not a size.
    """
    envvars.check_tuning(environ)
    return AlgorithmChoice(
        envvars.env_text(environ, envvars.ALGORITHM) or "auto",
        int(envvars.env_number(environ, envvars.DOUBLING_MAX_BYTES, DEFAULT_DOUBLING_MAX_BYTES)),
        int(envvars.env_number(environ, envvars.HALVING_MAX_BYTES, DEFAULT_HALVING_MAX_BYTES)))


def _device_collectives(name: str | None, store: Any, backend: Backend, launch: envvars.LaunchInfo,
                        timeout_s: float, generation: int, abort: AbortFlag) -> DeviceCollectives | None:
    """The device path, joined to rank 0's store announced in the rendezvous table."""
    if launch.size == 1:
        return DeviceCollectives("local", None, "", 0, 1, timeout_s)
    peers = getattr(backend, "peers", None)
    if name is None or not peers:
        return None
    if store is None:
        store = open_store(launch.rank, launch.size, timeout_s, peers[0].data_addr, peers[0].store_port)
    device = DeviceCollectives(name, store, f"hvdrun-device{generation}", launch.rank, launch.size, timeout_s,
                               lambda: abort.reason)
    abort.on_set(device.abort)
    return device


_usage_hook_installed = False


def _engine_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The engine's tuning from ``HOROVOD_*``/``HVDRUN_*`` variables (UsageError names a bad one)."""
    no_stall_check = envvars.env_text(environ, envvars.STALL_CHECK_DISABLE) in ("1", "true", "True")
    quiet = (envvars.env_text(environ, envvars.LOG_LEVEL) or "").upper() in ("ERROR", "FATAL")
    warning_s = envvars.env_number(environ, envvars.STALL_WARNING_S, 60.0)
    return {
        "fusion_threshold": int(envvars.env_number(environ, envvars.FUSION_THRESHOLD, DEFAULT_FUSION_BYTES)),
        "stall_warning_s": math.inf if no_stall_check or quiet else warning_s,
        "stall_error_s": 0.0 if no_stall_check else envvars.env_number(environ, envvars.STALL_ERROR_S, 300.0),
        "cycle_time_s": envvars.env_number(environ, envvars.CYCLE_TIME_MS, 1.0) / 1000,
        "eager_bytes": int(envvars.env_number(environ, envvars.EAGER_BYTES, DEFAULT_EAGER_BYTES)),
        "cache_capacity": int(envvars.env_number(environ, envvars.CACHE_CAPACITY, DEFAULT_CACHE_CAPACITY)),
    }


def usage_error_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``sys.excepthook``: an uncaught :class:`UsageError` (a bad variable, a backend that cannot work
    here) is one line ``hvdrun: error: ...``, not a traceback."""

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if isinstance(value, UsageError):
            sys.stderr.write(f"hvdrun: error: {value}\n")
            sys.stderr.flush()
            return
        previous(kind, value, traceback)

    return hook


def _tell_launcher(environ: Mapping[str, str], marker: bytes) -> None:
    """Write a control line for hvdrun's launcher on stderr (it strips it); nothing when hvdrun did not launch us."""
    if envvars.JOB_ID in environ:
        sys.stderr.flush()
        os.write(2, marker)


def init(environ: Mapping[str, str] | None = None) -> Runtime:
    """Join the job (idempotent): rendezvous, backend, engine thread.

    Args:
        environ: the environment to read the launch from (default ``os.environ``).

    Raises:
        UsageError: the environment is malformed.
        RendezvousError: the ranks could not find or authenticate each other in time.
    """
    global _runtime, _generation, _atexit_registered
    with _lock:
        if _runtime is not None:
            return _runtime
        global _usage_hook_installed
        if not _usage_hook_installed:
            sys.excepthook = usage_error_hook(sys.excepthook)
            _usage_hook_installed = True
        environ = os.environ if environ is None else environ
        _tell_launcher(environ, envvars.INIT_MARKER)
        launch = envvars.read_launch_info(environ)
        generation, assignment = _generation, None
        if is_elastic(environ):
            assignment = join_round(environ)
            launch = replace(launch, rank=assignment.rank, size=assignment.size,
                             rendezvous_addr=assignment.rendezvous_addr, rendezvous_port=assignment.rendezvous_port)
            generation = assignment.round
        abort = AbortFlag()
        device_backend = device_backend_name(environ) if launch.size > 1 else None
        timeout_s = envvars.start_timeout_s(environ)
        tuning = _engine_settings(environ)  # a bad value stops every rank the same way, before any connection
        store = (open_store(0, launch.size, timeout_s, launch.rendezvous_addr or "")
                 if device_backend and launch.rank == 0 else None)
        backend, rendezvous = _connect(launch, environ, abort, generation, store.port if store else 0, timeout_s)
        _tell_launcher(environ, envvars.JOINED_MARKER)
        select_current_device(environ, backend.world.local_rank)  # every script's set_device(local_rank), done
        device = _device_collectives(device_backend, store, backend, launch, timeout_s, generation, abort)
        _generation += 1
        engine = Engine(backend, root_cause=lambda: abort.reason,
                        report_failure=rendezvous.report_failure if rendezvous else (lambda reason: None),
                        device=device, **tuning)
        _runtime = Runtime(launch, backend, engine, rendezvous, device, assignment=assignment)
        if rendezvous is not None:
            _answer_reports(rendezvous, engine, launch)
        if assignment is not None and environ is os.environ:  # scripts that read RANK etc. see this round's
            os.environ.update(envvars.topology_env(backend.world))
        _start_configured_timeline(_runtime, environ)
        if not _atexit_registered:
            atexit.register(shutdown)
            sys.excepthook = _failure_hook(sys.excepthook)
            _atexit_registered = True
        return _runtime


def _report(launch: envvars.LaunchInfo, engine: Engine | None, what: str) -> dict[str, Any]:
    """This rank's answer to a report request: its stacks and flight recorder, or its vitals."""
    if what == VITALS:
        return rank_vitals(launch.rank, launch.hostname, engine.world.local_rank if engine else 0,
                           engine.recorder if engine else None, engine.stragglers if engine else None)
    return rank_report(launch.rank, launch.hostname, engine.recorder if engine else None)


def _answer_reports(rendezvous: Rendezvous, engine: Engine, launch: envvars.LaunchInfo) -> None:
    """This rank answers report requests with its stacks and flight recorder, or its vitals; rank 0 also prints
    every rank's report when the stall check warns or fails (:mod:`hvdrun.runtime.forensics`)."""
    rendezvous.set_reporter(functools.partial(_report, launch, engine))
    if launch.rank != 0:
        return

    one_at_a_time = threading.Lock()  # stall warnings come in batches: one report is enough

    def print_reports(reason: str) -> None:
        if not one_at_a_time.acquire(blocking=False):
            return
        try:
            gathered = rendezvous.gather_reports()
            if gathered is not None:
                reports, absent = gathered
                sys.stderr.write(f"hvdrun: {reason}\n{format_reports(reports, launch.size, absent)}\n")
                sys.stderr.flush()
        except Exception as e:  # noqa: BLE001 - a report must not fail the engine that asked for it
            sys.stderr.write(f"hvdrun: warning: could not gather where every rank is: {e}\n")
        finally:
            one_at_a_time.release()

    def on_stall(text: str, fatal: bool) -> None:
        reason = f"where every rank is, as the stall check {'fails the job' if fatal else 'warns'}"
        if fatal:  # before the ranks fail and leave
            print_reports(reason)
        else:
            threading.Thread(target=print_reports, args=(reason,), name="hvdrun-report", daemon=True).start()

    engine.on_stall = on_stall


def _is_collective_failure(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, CollectiveError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _failure_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``sys.excepthook``: say whether this rank dies of its own error or of another rank's.

    Its own error (any exception but a collective failure) is told to the other ranks at once, so
    they stop with a message naming this rank and the exception; a collective failure marks this
    rank's stderr so the launcher reports the rank whose failure came first.
    """

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        runtime = _runtime
        if runtime is not None and not issubclass(kind, (KeyboardInterrupt, SystemExit)):
            if _is_collective_failure(value):
                sys.stderr.flush()
                os.write(2, envvars.CONSEQUENCE_MARKER)
            else:
                runtime.engine.fail(f"rank {runtime.world.rank} failed with {kind.__name__}: {value}")
        previous(kind, value, traceback)

    return hook


def _start_configured_timeline(runtime: Runtime, environ: Mapping[str, str]) -> None:
    """``HOROVOD_TIMELINE=path`` starts the timeline on rank 0 now; ``DYNAMIC`` leaves it to start_timeline()."""
    setting = envvars.env_text(environ, envvars.TIMELINE)
    runtime.timeline_dynamic = setting == "DYNAMIC"
    if setting and not runtime.timeline_dynamic:
        mark = envvars.env_text(environ, envvars.TIMELINE_MARK_CYCLES) in ("1", "true", "True")
        start_timeline(setting, mark, _allow_static=True)


def start_timeline(file_path: str, mark_cycles: bool = False, _allow_static: bool = False) -> None:
    """Record a Chrome-trace timeline of every collective on rank 0 (needs ``HOROVOD_TIMELINE=DYNAMIC``)."""
    runtime = current()
    if not (runtime.timeline_dynamic or _allow_static):
        raise ValueError(f"start_timeline() needs the environment variable {envvars.HOROVOD_TIMELINE}=DYNAMIC")
    if runtime.world.rank == 0:
        stop_timeline()
        runtime.engine.timeline = Timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the timeline file."""
    timeline, current().engine.timeline = current().engine.timeline, None
    _write_timeline(timeline)


def _write_timeline(timeline: Timeline | None) -> None:
    """Write ``timeline``'s file; one that cannot be written is one warning line, never a traceback."""
    if timeline is not None:
        try:
            timeline.close()
        except OSError as e:
            print(f"hvdrun: warning: the timeline could not be written to {timeline.path}: {e.strerror or e}",
                  file=sys.stderr, flush=True)


def shutdown() -> None:
    """Leave the job: negotiate the end with the other ranks, then close everything. Idempotent."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is None:
        return
    failed = runtime.engine.stop(SHUTDOWN_TIMEOUT_S)
    _write_timeline(runtime.engine.timeline)
    if runtime.rendezvous is not None:
        if failed is not None:  # peers still in the shutdown would wait for this rank: tell them, as a failure does
            runtime.rendezvous.report_failure(f"rank {runtime.world.rank} could not complete the shutdown: {failed}")
        runtime.rendezvous.close()
    if runtime.device is not None:
        runtime.device.close()
    runtime.backend.close()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _runtime is not None


def current_or_none() -> Runtime | None:
    """The runtime, or None before ``init()`` and after ``shutdown()``."""
    return _runtime


def current() -> Runtime:
    """The runtime, or NotInitializedError before ``init()``."""
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError("hvdrun has not been initialized; use hvd.init()")
    return runtime
