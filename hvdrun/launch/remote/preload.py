"""Ranks started from an interpreter that already imported torch: one ``import torch`` per host, not per rank.

A rank's Python spends about 2 s of CPU importing torch (1.5 s more for ``torch._dynamo``, which the first
``optimizer.step()`` imports); eight or twelve ranks of a node pay it at once, from the same shared file system.
When the job asks for it (``HVDRUN_PRELOAD``: modules, comma-separated; ``hvdrun --preload``), the fork server
imports those modules once, before it forks the first guard (:func:`preload`), and each guard starts its rank
by ``fork()`` and runs the rank's Python command in the child (:func:`start`), as ``python SCRIPT`` would,
instead of starting a new interpreter.

A rank is started this way only when nothing a fresh interpreter decides at its start could differ
(:func:`why_not`): the same interpreter (path and virtualenv), a command of the form ``python [-u] SCRIPT|-m
MODULE|-c CODE ARGS...``, and an environment equal to the one the modules were imported under, except for the
variables read only after start-up: the rank's own ids and devices (CUDA_VISIBLE_DEVICES and its kin are read
when the device runtime starts, never by ``import torch``), hvdrun's, torchrun's and NCCL's variables,
``PYTHONUNBUFFERED`` and ``OMP_NUM_THREADS`` (both applied in the child). Anything else starts the rank the
ordinary way: the preload saves time, never changes what a rank sees.

The child runs the command as a new interpreter would (``inprocess.py``) and shows its own command line and
environment in ``/proc`` (``proctitle.py``). Standard library only (the guard's rule).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import re
import shutil
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hvdrun import envvars
from hvdrun.envvars import PRELOAD
from hvdrun.launch.remote import inprocess, proctitle
from hvdrun.launch.remote.inprocess import PythonCommand, parse_python_command

_LATE_PREFIXES = ("HVDRUN_", "HOROVOD_", "TORCHELASTIC_", "NCCL_", "TORCH_NCCL_")
# the rank's own ids and devices, but OMP_NUM_THREADS (numpy's BLAS, imported with torch, read it at its load)
_LATE_NAMES = (envvars.rank_variable_names() - {envvars.OMP_NUM_THREADS}) | {
    envvars.TORCH_MASTER_ADDR, envvars.TORCH_MASTER_PORT, envvars.PYTHONUNBUFFERED, *envvars.TORCHELASTIC}
_BINDING_NAMES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")  # read at libgomp's load
# read when this process started (the loader, the interpreter, its site hooks): compared with its own start
_EXEC_PREFIXES = ("LD_", "PYTHON", "LC_", "MALLOC_", "GLIBC_TUNABLES", "LANG", "COVERAGE_PROCESS_START")
_STARTED_UNDER = {name: value for name, value in os.environ.items() if name.startswith(_EXEC_PREFIXES)}
_DEVICE_LIBRARIES = ("libcuda.so", "libamdhip64.so", "libze_loader.so", "libnvidia-ml.so")


_IMPORTS_TORCH = re.compile(r"^[ \t]*(?:import|from)[ \t]+(?:torch|hvdrun\.torch|horovod\.torch)\b", re.M)
_IMPORTS_HVDRUN_TORCH = re.compile(r"^[ \t]*(?:import|from)[ \t]+(?:hvdrun\.torch|horovod\.torch)\b", re.M)
_BUILDS_OPTIMIZER = re.compile(r"\boptim\b|Optimizer\b")
AUTO, NONE = "auto", "none"


def choose_modules(choice: str, source: str | None) -> tuple[str, ...]:
    """The modules to preload: ``choice`` (``auto``, ``none`` or ``mod,mod``); for ``auto``, torch when the rank's
    source (``source``: its script or module, None when unknown) imports it, ``torch._dynamo`` when it also
    builds an optimizer (the first ``step()`` imports it), and ``hvdrun.torch`` when it imports that (or Horovod's
    ``horovod.torch``, which is hvdrun's under ``--horovod-compat``): hvdrun's runtime reads no variable at import."""
    if choice == NONE:
        return ()
    if choice != AUTO:
        return tuple(m.strip() for m in choice.split(",") if m.strip())
    if source is None or not _IMPORTS_TORCH.search(source):
        return ()
    modules = ("torch", "torch._dynamo") if _BUILDS_OPTIMIZER.search(source) else ("torch",)
    return (*modules, "hvdrun.torch") if _IMPORTS_HVDRUN_TORCH.search(source) else modules


def rank_source(command: Sequence[str], module: bool = False, limit: int = 1 << 20) -> str | None:
    """The source of what ``command`` runs (``train.py ...``, ``python [-u] train.py|-m mod|-c code ...``, or with
    ``module`` a module name), at most ``limit`` characters; None when it is another program or not found. A
    module is looked for beside the working directory and on ``sys.path``, never imported."""
    if module:
        path = _module_file(command[0])
    elif command[0].endswith(".py"):
        path = command[0]
    elif os.path.basename(command[0]).startswith("python"):
        parsed = parse_python_command(command)
        if isinstance(parsed, str):
            return None
        if parsed.kind == "code":
            return parsed.target
        path = parsed.target if parsed.kind == "script" else _module_file(parsed.target)
    else:
        return None
    try:
        with open(path or "", encoding="utf-8", errors="replace") as source:
            return source.read(limit)
    except OSError:
        return None


def _module_file(name: str) -> str | None:
    parts = name.split(".")
    for entry in (os.getcwd(), *sys.path):
        base = os.path.join(entry or os.getcwd(), *parts)
        for candidate in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


@dataclass(frozen=True)
class Preloaded:
    """What this process imported for its ranks, and the environment it imported it under."""

    modules: tuple[str, ...]
    environ: dict[str, str]


_preloaded: Preloaded | None = None
_tried = False


def wanted_modules(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The modules ``environ`` names in ``HVDRUN_PRELOAD``, in order."""
    return tuple(m for m in environ.get(PRELOAD, "").split(",") if m)


def preload(environ: Mapping[str, str], importing: Callable[[str], None] = lambda module: None) -> None:
    """Import the modules ``environ`` names in ``HVDRUN_PRELOAD`` (once per process; the fork server calls it
    with its first request's environment), those a zygote imported already (:func:`adopt`) excepted. A module
    that fails to import is left to the ranks, which then start the ordinary way and show the error themselves.
    ``importing(module)`` is called before each import (the fork server tells its launcher, which bounds it)."""
    global _preloaded, _tried
    modules = wanted_modules(environ)
    if _tried or not modules:
        return
    _tried = True
    base = _preloaded or Preloaded((), dict(environ))
    if environment_difference(environ, base.environ, _STARTED_UNDER):
        return  # the ranks' loader or interpreter would start otherwise than this one did: none of them could fork
    missing = tuple(m for m in modules if m not in base.modules)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        for module in missing:
            importing(module)
            importlib.import_module(module)
    except BaseException:  # noqa: BLE001 - even SystemExit: the ranks import it themselves and report it
        return
    finally:
        os.environ.clear()
        os.environ.update(saved)
        inprocess.flush_standard_streams()  # what an import printed must not reach every rank's output from its buffer
    if _device_runtime_started():
        _preloaded = None
    else:
        gc.freeze()  # the preloaded objects stay out of the collector's passes: their pages stay shared
        _preloaded = Preloaded(base.modules + missing, base.environ)


def adopt(modules: Sequence[str], environ: Mapping[str, str]) -> None:
    """Take ``modules`` as preloaded under ``environ``: this process was forked from one that imported them (a
    zygote, ``zygote.py``), so :func:`preload` imports only the job's other modules (``torch._dynamo``,
    ``hvdrun.torch``), once, and :func:`why_not` compares each rank's environment with ``environ``. Nothing is
    taken where a GPU runtime already started (see :func:`preload`)."""
    global _preloaded, _tried
    _tried = False
    _preloaded = None if _device_runtime_started() else Preloaded(tuple(modules), dict(environ))


def _device_runtime_started() -> bool:
    """A GPU runtime started during the imports (torch's CUDA or XPU, or a driver library loaded, as
    ``torch.cuda.device_count()`` does): a forked child could not use its GPU ("Cannot re-initialize CUDA in
    forked subprocess"), so the ranks must start new interpreters."""
    torch = sys.modules.get("torch")
    if torch is not None and any(
            getattr(getattr(torch, name, None), "is_initialized", lambda: False)() for name in ("cuda", "xpu")):
        return True
    try:
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
    except OSError:
        return False
    return any(library in mapped for library in _DEVICE_LIBRARIES)


def _poisoned_for_gpus() -> str | None:
    """Why this forked process could not use a GPU, or None: torch marks a fork "bad" once a preloaded module asked
    the GPU runtime anything (``torch.cuda.device_count()``), even where no driver answers and nothing was
    initialised or mapped that :func:`_device_runtime_started` sees; a rank forked from here would then raise
    "Cannot re-initialize CUDA in forked subprocess" where a new interpreter says what is really there."""
    torch = sys.modules.get("torch")
    for name in ("cuda", "xpu"):
        bad_fork = getattr(getattr(torch, name, None), "_is_in_bad_fork", None)
        if callable(bad_fork) and bad_fork():
            return (f"the preloaded modules queried torch.{name} before the fork (a forked rank could not use its "
                    "GPU)")
    return None


def _same_interpreter(program: str, environ: Mapping[str, str]) -> bool:
    """``program`` (a path, or a name looked up on the rank's PATH) is this interpreter, in this virtualenv."""
    found = program if os.sep in program else shutil.which(program, path=environ.get("PATH", os.defpath))
    if not found:
        return False
    found, ours = os.path.abspath(found), os.path.abspath(sys.executable)
    return os.path.dirname(found) == os.path.dirname(ours) and os.path.realpath(found) == os.path.realpath(ours)


def _is_late(name: str) -> bool:
    return name in _LATE_NAMES or name.startswith(_LATE_PREFIXES)


def environment_difference(environ: Mapping[str, str], imported_under: Mapping[str, str],
                           started_under: Mapping[str, str] | None = None) -> list[str]:
    """The variables, read at start-up or import, whose values differ: every variable but the late ones against
    the environment the modules were imported under, and those the loader and the interpreter read at their
    start (``LD_*``, ``PYTHON*``, locale, malloc) also against the one this process started under."""
    names = set(environ) | set(imported_under)
    different = {n for n in names if not _is_late(n) and environ.get(n) != imported_under.get(n)}
    if started_under is not None:
        started = {n for n in set(environ) | set(started_under) if n.startswith(_EXEC_PREFIXES) and not _is_late(n)}
        different |= {n for n in started if environ.get(n) != started_under.get(n)}
    return sorted(different)


def start_up_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a new interpreter reads at its start (the loader's ``LD_*``, ``PYTHON*``,
    locale, malloc): a process that is to fork ranks with ``environ`` must itself start under these, or none of
    its ranks can fork (an SSH host's agent starts under the login's environment, not the launcher's)."""
    return {name: value for name, value in environ.items() if name.startswith(_EXEC_PREFIXES) and not _is_late(name)}


def why_not(command: Sequence[str], environ: Mapping[str, str], bound: bool) -> PythonCommand | str:
    """The parsed command when this process can run it as a preloaded rank, else the reason it cannot.

    Args:
        command: the rank's command.
        environ: the rank's environment.
        bound: the guard changed this process's CPU affinity (``--cpu-bind``).
    """
    if _preloaded is None:
        return "nothing preloaded"
    poisoned = _poisoned_for_gpus()
    if poisoned:
        return poisoned
    if not command or not _same_interpreter(command[0], environ):
        return f"{command[0] if command else 'nothing'} is not {sys.executable}"
    parsed = parse_python_command(command)
    if isinstance(parsed, str):
        return parsed
    different = environment_difference(environ, _preloaded.environ, _STARTED_UNDER)
    if different:
        return f"environment differs from the preload's: {', '.join(different[:5])}"
    if bound and any(environ.get(name) for name in _BINDING_NAMES):
        return "an OpenMP binding variable with --cpu-bind (libgomp read it at import, before the binding)"
    if parsed.kind == "script" and not _is_source_file(parsed.target):
        return f"{parsed.target} is not a Python source file (a zipapp, .pyc or directory runs in a new Python)"
    if {"sitecustomize", "usercustomize"} & set(sys.modules):
        return "a sitecustomize or usercustomize ran at this process's start, not at the rank's"
    shadowed = _shadowing_entries(parsed)
    if shadowed:
        return f"{', '.join(shadowed[:3])} beside the rank's code would shadow a module already imported here"
    return parsed


def _is_source_file(path: str) -> bool:
    """A regular file that ``python PATH`` runs as source: not a zip archive (zipapp), not bytecode."""
    import zipfile

    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        return False
    with open(path, "rb") as source:
        return source.read(4) != importlib.util.MAGIC_NUMBER


def _shadowing_entries(parsed: PythonCommand) -> list[str]:
    """Entries of the rank's first ``sys.path`` entry named like a module this process already imported: a new
    interpreter would import the rank's file, this one has the module."""
    first = inprocess.path0(parsed) or os.getcwd()
    try:
        names = os.listdir(first)
    except OSError:
        return []
    preloaded = _preloaded.modules if _preloaded else ()
    loaded = {name.split(".")[0] for name in (*sys.modules, *preloaded)} - {"__main__"}
    return sorted(os.path.join(first, n) for n in names if (n[:-3] if n.endswith(".py") else n) in loaded)


class ForkedRank:
    """A rank started by :func:`start`: what the guard needs of a :class:`subprocess.Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _collect(self, options: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, options)
            except ChildProcessError:  # reaped by another waiter (waitpid(-1)): its status is lost, as Popen says
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        """The rank's status, or None while it runs (never blocks)."""
        if self.returncode is not None or not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            return self._collect(os.WNOHANG)
        finally:
            self._lock.release()

    def wait(self) -> int:
        """Wait for the rank's end; its status as :attr:`subprocess.Popen.returncode`."""
        with self._lock:
            while self.returncode is None:
                self._collect(0)  # os.waitpid retries EINTR itself (PEP 475)
        return self.returncode


def start(command: Sequence[str], parsed: PythonCommand, environ: Mapping[str, str], inherit: Sequence[int],
          prepare: Callable[[], object]) -> ForkedRank:
    """Fork this (preloaded) process and run ``parsed`` in the child as the rank.

    Args:
        command: the rank's command, as ``ps`` is to show it.
        parsed: the rank's command (from :func:`why_not`).
        environ: the rank's environment.
        inherit: file descriptors the rank keeps besides 0, 1 and 2 (MPICH's ``PMI_FD``).
        prepare: run first in the child (the guard's cgroup and parent-death signal).
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            prepare()
            warning = envvars.warning_signal(environ)  # ignored, as the guard starts a new interpreter with it
            inprocess.become_rank(environ, inherit, parsed.unbuffered, () if warning is None else (warning,))
            sys.orig_argv = list(command)
            proctitle.show_as(command, environ)
            code = inprocess.run_command(parsed)
        except BaseException:  # noqa: BLE001 - before the rank's code ran: say why, never return to the guard
            traceback.print_exc()
        finally:
            os._exit(code)
    return ForkedRank(pid)


