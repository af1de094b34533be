"""Run a Python command in this process as a new interpreter would run it: the rank forked by a preloaded guard
(``preload.py``).

:func:`become_rank` gives the process what a fresh interpreter starts with: the rank's environment and standard
streams (buffered as ``-u``/``PYTHONUNBUFFERED`` say), Python's default signal handlers and an empty signal mask,
only fds 0..2 (and those it must inherit) open, stdin from /dev/null, its own random state (``random`` reseeds
itself at fork; numpy's global generator is reseeded here), and torch's thread count as a fresh process would
choose it under the rank's ``OMP_NUM_THREADS`` and CPU binding (libgomp read both when torch was imported).
:func:`run_command` runs ``SCRIPT``, ``-m MODULE`` or ``-c CODE`` as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as the interpreter sets them, then ends as it ends: non-daemon threads joined, ``atexit``
functions run, streams flushed (exit code 120 when that fails); 1 after an uncaught exception, whose traceback
starts at the rank's code; death by SIGINT after an uncaught KeyboardInterrupt. Standard library only.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib.machinery
import io
import os
import signal
import sys
import threading
import types
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


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


def affinity() -> set[int]:
    """The CPUs this process may run on (empty where the platform cannot say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def path0(parsed: PythonCommand) -> str:
    """``sys.path[0]`` of ``python`` running ``parsed``: the script's directory, the working directory, or ''."""
    if parsed.kind == "script":
        return os.path.dirname(os.path.realpath(parsed.target))
    return os.getcwd() if parsed.kind == "module" else ""


def become_rank(environ: Mapping[str, str], inherit: Sequence[int], unbuffered: bool,
                ignored: Collection[int] = ()) -> None:
    """The process state a fresh interpreter would start the rank with; ``ignored``: signals it starts with
    ignored, as a new interpreter would inherit them (never their default for an instant)."""
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
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
    unbuffered = unbuffered or bool(environ.get("PYTHONUNBUFFERED"))
    _reopen_streams(unbuffered)
    if unbuffered:
        _unbuffer_c_stdio()  # as the interpreter does for -u: an extension's printf goes out at once
    _reseed()
    _set_threads(environ)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _unbuffer_c_stdio() -> None:
    libc = _libc()
    if libc is None:
        return
    for name in ("stdout", "stderr"):
        try:
            stream = ctypes.c_void_p.in_dll(libc, name)
        except ValueError:
            continue
        libc.setvbuf(stream, None, 2, 0)  # _IONBF


def _close_fds_from(low: int, keep: set[int]) -> None:
    for fd in sorted(keep | {os.sysconf("SC_OPEN_MAX")}):  # the bound subprocess closes up to, too
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1


def flush_standard_streams() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr`` as far as they still can be (closed or gone: nothing to do)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _reopen_streams(unbuffered: bool) -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` on fds 0..2, buffered as the rank's interpreter would buffer them."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    flush_standard_streams()
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding, errors=errors)
    setattr(sys, "__stdin__", sys.stdin)  # noqa: B010 - typeshed calls it final; the interpreter sets it at start
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
    threads = int(value) if value.isdigit() and int(value) > 0 else len(affinity()) or 1
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def run_command(parsed: PythonCommand) -> int:
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
    if not sys.flags.safe_path:
        sys.path[0] = path0(parsed)
    if parsed.kind == "module":
        import runpy

        sys.argv = ["-m", *parsed.args]
        runpy._run_module_as_main(parsed.target, alter_argv=True)  # type: ignore[attr-defined] # as 'python -m' does
        return
    if parsed.kind == "code":
        sys.argv = ["-c", *parsed.args]
        exec(compile(parsed.target, "<string>", "exec", dont_inherit=True), main.__dict__)  # noqa: S102
        return
    sys.argv = [parsed.target, *parsed.args]
    path = os.path.abspath(parsed.target)  # __main__.__file__ is absolute since Python 3.9; argv[0] is as given
    main.__file__ = path
    main.__dict__["__cached__"] = None
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
    _close_what_finalization_closes()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120 if code == 0 else code
    libc = _libc()
    if libc is not None:
        libc.fflush(None)  # C stdio's buffers (an extension's printf): exit(3) would flush them, _exit does not
    return code


def _close_what_finalization_closes() -> None:
    """What the interpreter's finalization does to the rank's objects before the process ends: ``__main__``'s
    names go (their files close, flushing what they buffered), and every file still open is flushed."""
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase) and obj not in (sys.stdout, sys.stderr):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass
