"""``hvdrun.run(fn, ...)``: Horovod's ``horovod.run`` — call a Python function on every rank, return the results.

The function travels pickled in the ranks' environment (:mod:`hvdrun.launch.remote.task`), so nothing has
to be on a shared filesystem; each rank's return value comes back on its stdout, is taken out of
the output, and the list of them (index = rank) is returned. The ranks' other output is shown as
a launch shows it, with rank prefixes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hvdrun import envvars
from hvdrun.errors import LaunchError, UsageError
from hvdrun.launch.job import run_job
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.remote.task import RESULT_MARK, TASK_VAR, dumps, loads

_TASK_ENV_LIMIT = 100_000  # one variable's value must stay below the kernel's 128 KiB
_RESULT_LINE = re.compile(r"^\[(\d+)\]<stdout>:" + re.escape(RESULT_MARK) + r"(\S+)$")
_ELASTIC = ("min_num_proc", "max_num_proc", "min_np", "max_np", "slots", "reset_limit", "cooldown_range",
            "host_discovery_script")


class _ResultConsole:
    """A console stream that keeps the ranks' result lines and passes every other line on."""

    def __init__(self, target: Any) -> None:
        self.target, self._partial = target, ""
        self.results: dict[int, Any] = {}

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            match = _RESULT_LINE.match(line)
            if match:
                self.results[int(match.group(1))] = loads(match.group(2))
            else:
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, hosts: str | None = None, hostfile: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        verbose: bool = False, use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | None = None, output_filename: str | None = None,
        executable: str | None = None, np: int | None = None, **others: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a job and return each rank's result, by rank.

    The arguments are those of ``horovod.run`` (``np`` is its old name for ``num_proc``); ``fn`` usually
    calls ``hvd.init()`` itself. ``use_mpi`` starts the ranks with mpiexec and the MPI backend.

    Raises:
        UsageError: bad arguments (elastic ones are not supported here), or a function too large to send.
        WorkerFailed: a rank failed; the job was stopped on every host.
    """
    unknown = sorted(set(others) - {"disable_cache", "network_interfaces", "cache_capacity"})
    elastic = [name for name in unknown if name in _ELASTIC]
    if elastic:
        raise UsageError(f"hvdrun.run: elastic arguments ({', '.join(elastic)}) are not supported here")
    if unknown:
        raise UsageError(f"hvdrun.run: unknown argument(s) {', '.join(unknown)}")
    if use_gloo and use_mpi:
        raise UsageError("hvdrun.run: give use_gloo or use_mpi, not both")
    task = dumps((fn, tuple(args), dict(kwargs or {})))
    if len(task) > _TASK_ENV_LIMIT:
        raise UsageError(f"hvdrun.run: the pickled function and arguments take {len(task)} bytes; at most "
                         f"{_TASK_ENV_LIMIT} travel to the ranks (pass file paths instead of large data)")
    interface = network_interface or (others.get("network_interfaces") or "").split(",")[0] or None
    options = RunOptions(command=("hvdrun.launch.remote.task",), module=True, num_proc=num_proc or np, hosts=hosts,
                         hostfile=hostfile, start_timeout_s=start_timeout, ssh_port=ssh_port,
                         ssh_identity_file=ssh_identity_file, verbose=verbose, mpi_args=mpi_args,
                         network_interface=interface, output_dir=output_filename,
                         launcher="mpiexec" if use_mpi else None)
    environ = {**os.environ, TASK_VAR: task, **({envvars.BACKEND: "mpi"} if use_mpi else {})}
    plan = plan_job(options, environ)
    if executable:
        plan = _with_python(plan, executable)
    console = _ResultConsole(sys.stdout)
    run_job(plan, console={"stdout": console, "stderr": sys.stderr})  # type: ignore[dict-item]
    missing = [rank for rank in range(len(plan.slots)) if rank not in console.results]
    if missing:
        raise LaunchError(f"hvdrun.run: ranks {', '.join(map(str, missing))} ended without returning a result")
    return [console.results[rank] for rank in range(len(plan.slots))]


def _with_python(plan: Any, executable: str) -> Any:
    from dataclasses import replace

    return replace(plan, default_python=executable)
