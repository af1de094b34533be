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

In the child (:func:`_run_command`): the environment and standard streams are the rank's, signal handlers and
mask are Python's defaults, ``random`` (and numpy's global generator) are reseeded, torch's thread count is what
a fresh process would choose under the rank's ``OMP_NUM_THREADS`` and CPU binding, ``sys.argv``, ``sys.path[0]``
and a new ``__main__`` are set as the interpreter sets them; at the end non-daemon threads are joined, ``atexit``
functions run and the streams are flushed, and the exit status is the interpreter's (1 after an uncaught
exception, death by SIGINT after an uncaught KeyboardInterrupt). Standard library only (the guard's rule).
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import importlib.machinery
import io
import os
import re
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hvdrun.launch.remote import proctitle

PRELOAD = "HVDRUN_PRELOAD"  # the modules the fork server imports once (hvdrun.envvars names it too)
_LATE_PREFIXES = ("HVDRUN_", "HOROVOD_", "TORCHELASTIC_", "NCCL_", "TORCH_NCCL_")
_LATE_NAMES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
    "PMI_FD", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PALS_RANKID", "PALS_LOCAL_RANKID",
})
_BINDING_NAMES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")  # read at libgomp's load


_IMPORTS_TORCH = re.compile(r"^[ \t]*(?:import|from)[ \t]+(?:torch|hvdrun\.torch|horovod\.torch)\b", re.M)
_BUILDS_OPTIMIZER = re.compile(r"\boptim\b|Optimizer\b")
AUTO, NONE = "auto", "none"


def choose_modules(choice: str, source: str | None) -> tuple[str, ...]:
    """The modules to preload: ``choice`` (``auto``, ``none`` or ``mod,mod``); for ``auto``, torch when the rank's
    source (``source``: its script or module, None when unknown) imports it, and ``torch._dynamo`` when it also
    builds an optimizer (the first ``step()`` imports it)."""
    if choice == NONE:
        return ()
    if choice != AUTO:
        return tuple(m.strip() for m in choice.split(",") if m.strip())
    if source is None or not _IMPORTS_TORCH.search(source):
        return ()
    return ("torch", "torch._dynamo") if _BUILDS_OPTIMIZER.search(source) else ("torch",)


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
    affinity: frozenset[int]


_preloaded: Preloaded | None = None
_tried = False


def preload(environ: Mapping[str, str]) -> None:
    """Import the modules ``environ`` names in ``HVDRUN_PRELOAD`` (once per process; the fork server calls it
    with its first request's environment). A module that fails to import is left to the ranks, which then
    start the ordinary way and show the error themselves."""
    global _preloaded, _tried
    modules = tuple(m for m in environ.get(PRELOAD, "").split(",") if m)
    if _tried or not modules:
        return
    _tried = True
    if environ.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        return  # sys.path was built from this process's PYTHONPATH: the ranks' would differ
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(environ)
        for module in modules:
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure: the ranks import it themselves and report it
        return
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _preloaded = Preloaded(modules, dict(environ), frozenset(_affinity()))


def _affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


@dataclass(frozen=True)
class PythonCommand:
    """A rank's ``python [-u] SCRIPT|-m MODULE|-c CODE ARGS...``, parsed."""

    kind: str  # "script", "module" or "code"
    target: str  # the script's path, the module's name or the code
    args: tuple[str, ...]
    unbuffered: bool


def parse_python_command(command: Sequence[str]) -> PythonCommand | str:
    """``command`` parsed, or why it is not a command the preload can run (other options, no target)."""
    words, unbuffered = list(command[1:]), False
    while words and words[0] == "-u":
        unbuffered, words = True, words[1:]
    if not words:
        return "no script"
    if words[0] in ("-m", "-c"):
        if len(words) < 2:
            return f"{words[0]} without a value"
        return PythonCommand("module" if words[0] == "-m" else "code", words[1], tuple(words[2:]), unbuffered)
    if words[0].startswith("-"):
        return f"interpreter option {words[0]}"
    return PythonCommand("script", words[0], tuple(words[1:]), unbuffered)


def _same_interpreter(program: str, environ: Mapping[str, str]) -> bool:
    """``program`` (a path, or a name looked up on the rank's PATH) is this interpreter, in this virtualenv."""
    import shutil

    found = program if os.sep in program else shutil.which(program, path=environ.get("PATH", os.defpath))
    if not found:
        return False
    found, ours = os.path.abspath(found), os.path.abspath(sys.executable)
    return os.path.dirname(found) == os.path.dirname(ours) and os.path.realpath(found) == os.path.realpath(ours)


def _is_late(name: str) -> bool:
    return name in _LATE_NAMES or name.startswith(_LATE_PREFIXES)


def environment_difference(environ: Mapping[str, str], imported_under: Mapping[str, str]) -> list[str]:
    """The variables, read at start-up or import, whose values differ between the two environments."""
    names = set(environ) | set(imported_under)
    return sorted(n for n in names if not _is_late(n) and environ.get(n) != imported_under.get(n))


def why_not(command: Sequence[str], environ: Mapping[str, str], bound: bool) -> PythonCommand | str:
    """The parsed command when this process can run it as a preloaded rank, else the reason it cannot.

    Args:
        command: the rank's command.
        environ: the rank's environment.
        bound: the guard changed this process's CPU affinity (``--cpu-bind``).
    """
    if _preloaded is None:
        return "nothing preloaded"
    if not command or not _same_interpreter(command[0], environ):
        return f"{command[0] if command else 'nothing'} is not {sys.executable}"
    parsed = parse_python_command(command)
    if isinstance(parsed, str):
        return parsed
    different = environment_difference(environ, _preloaded.environ)
    if different:
        return f"environment differs from the preload's: {', '.join(different[:5])}"
    if bound and any(environ.get(name) for name in _BINDING_NAMES):
        return "an OpenMP binding variable with --cpu-bind (libgomp read it at import, before the binding)"
    if parsed.kind == "script" and not os.path.isfile(parsed.target):
        return f"{parsed.target} is not a file"
    shadowed = _shadowing_entry(parsed)
    if shadowed:
        return f"{shadowed} would shadow a preloaded module"
    return parsed


def _shadowing_entry(parsed: PythonCommand) -> str | None:
    """A file or directory in the rank's first ``sys.path`` entry named like a preloaded top-level module."""
    first = _path0(parsed)
    assert _preloaded is not None
    for top in {m.split(".")[0] for m in _preloaded.modules}:
        for name in (top, f"{top}.py"):
            candidate = os.path.join(first or os.getcwd(), name)
            if os.path.exists(candidate):
                return candidate
    return None


def _path0(parsed: PythonCommand) -> str:
    """``sys.path[0]`` of ``python`` running ``parsed``: the script's directory, the working directory, or ''."""
    if parsed.kind == "script":
        return os.path.dirname(os.path.realpath(parsed.target))
    return os.getcwd() if parsed.kind == "module" else ""


class ForkedRank:
    """A rank started by :func:`start`: what the guard needs of a :class:`subprocess.Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _collect(self, options: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, options)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        """The rank's status, or None while it runs (never blocks)."""
        if self.returncode is not None or not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            return self._collect(os.WNOHANG)
        except ChildProcessError:
            return self.returncode
        finally:
            self._lock.release()

    def wait(self) -> int:
        """Wait for the rank's end; its status as :attr:`subprocess.Popen.returncode`."""
        with self._lock:
            while self.returncode is None:
                try:
                    self._collect(0)
                except InterruptedError:
                    continue
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
            _become_rank(environ, inherit, parsed.unbuffered)
            proctitle.show_as(command, environ)
            code = _run_command(parsed)
        except BaseException:  # noqa: BLE001 - before the rank's code ran: say why, never return to the guard
            traceback.print_exc()
        finally:
            os._exit(code)
    return ForkedRank(pid)


def _become_rank(environ: Mapping[str, str], inherit: Sequence[int], unbuffered: bool) -> None:
    """The process state a fresh interpreter would start the rank with."""
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    _close_fds_from(3, keep=set(inherit))
    os.environ.clear()
    os.environ.update(environ)
    _reopen_streams(unbuffered or bool(environ.get("PYTHONUNBUFFERED")))
    _reseed()
    _set_threads(environ)


def _close_fds_from(low: int, keep: set[int]) -> None:
    for fd in sorted(keep | {1 << 20}):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1


def _reopen_streams(unbuffered: bool) -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` on fds 0..2, buffered as the rank's interpreter would buffer them."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    for old in (sys.stdout, sys.stderr):
        try:
            old.flush()
        except (OSError, ValueError):
            pass
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding, errors=errors)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(raw, encoding=encoding, errors="backslashreplace" if fd == 2 else errors,
                                  line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _reseed() -> None:
    """Every rank its own random state, as a fresh interpreter has (``random`` reseeds itself at fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:  # noqa: BLE001 - an unusual numpy: its generator stays as it is
            pass


def _set_threads(environ: Mapping[str, str]) -> None:
    """torch's intra-op threads as a fresh process would choose them: ``OMP_NUM_THREADS``, else the CPUs this
    process may run on (libgomp read both when torch was imported, before the rank's values were known)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    value = environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else len(_affinity()) or 1
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _run_command(parsed: PythonCommand) -> int:
    """Run the rank's code as ``__main__`` and end as the interpreter ends; the exit status (or death by SIGINT)."""
    interrupted = False
    try:
        _run_main(parsed)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - the interpreter's own behaviour: report it, exit 1
        own = _rank_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(own), own)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    code = _finalize(code)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _rank_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without this module's frames: the traceback the rank's own interpreter would print."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _run_main(parsed: PythonCommand) -> None:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    path0 = _path0(parsed)
    if not sys.flags.safe_path:
        sys.path[0] = path0
    if parsed.kind == "module":
        import runpy

        sys.argv = ["-m", *parsed.args]
        runpy._run_module_as_main(parsed.target, alter_argv=True)  # what 'python -m' itself calls
        return
    if parsed.kind == "code":
        sys.argv = ["-c", *parsed.args]
        exec(compile(parsed.target, "<string>", "exec", dont_inherit=True), main.__dict__)  # noqa: S102
        return
    sys.argv = [parsed.target, *parsed.args]
    path = os.path.abspath(parsed.target)  # __main__.__file__ is absolute since Python 3.9; argv[0] is as given
    main.__file__, main.__cached__ = path, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)  # noqa: S102 - running the rank's script is the point


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        sys.stderr.write(f"{e.code}\n")
    except (OSError, ValueError):
        pass
    return 1


def _finalize(code: int) -> int:
    """The interpreter's end: join non-daemon threads, run ``atexit`` functions, flush the streams (exit code
    120 when that fails)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120 if code == 0 else code
    return code
