"""``hvdrun qsub`` options + the cluster YAML -> a validated :class:`JobSpec`.

Every check that can be made before the queue sees the job is made here: the fields the machine
requires, queue limits on nodes and walltime, valid filesystems, and the characters of every value
that ends up in a directive. Each failure is a :class:`~hvdrun.errors.UsageError` naming the option,
the value given and what is allowed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hvdrun.config import (
    ClusterConfig,
    CopperSettings,
    SchedulerDefaults,
    available_clusters,
    load_cluster,
    load_cluster_config,
    parse_walltime,
)
from hvdrun.errors import UsageError
from hvdrun.jobs import SCHEDULERS, queue_limits, scheduler_class
from hvdrun.jobs.scheduler import JobSpec, quote
from hvdrun.launch.remote.cpubind import CpuBindError, parse_cpu_bind
from hvdrun.schedulers import SLURM

DEFAULT_OUTPUT_DIR = "hvdrun-jobs"
DEFAULT_CHAIN_WARNING_MAX_S = 600.0  # --chain without --warn-before: a tenth of the walltime, at most this
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}")
_WORD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_JOB_ID_RE = re.compile(r"[0-9]+(\[[0-9]*\])?(\.[A-Za-z0-9_.-]+)?|[0-9]+_[0-9]+")
_VAR_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PYTHON_RE = re.compile(r"python(3(\.[0-9]+)?)?")
_PYTHON_OPTIONS_WITH_VALUES = frozenset({"-W", "-X", "-Q"})


@dataclass(frozen=True)
class JobRequest:
    """What the user asked ``hvdrun qsub`` for (None: take the cluster YAML's default)."""

    command: tuple[str, ...]
    cluster: str | None = None
    config_file: str | None = None
    scheduler: str | None = None
    nodes: int | None = None
    walltime: str | None = None
    queue: str | None = None
    account: str | None = None
    filesystems: str | None = None
    job_name: str | None = None
    output: str | None = None
    error: str | None = None
    modules: tuple[str, ...] = ()
    conda: str | None = None
    venv: str | None = None
    exports: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    ranks_per_node: int | None = None
    gpus_per_node: int | None = None
    directives: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    template: str | None = None
    python: str | None = None
    run_args: str | None = None
    max_restarts: int | None = None
    spares: int | None = None
    stage_env: bool = False
    stage_dir: str | None = None
    report: str | None = None  # the job's hvdrun writes its HTML report here (observe/report.py)
    chain: int | None = None  # submit this many jobs, each after the previous one (jobs/chain.py)
    warn_before: float | None = None  # the job's hvdrun warns the ranks this many seconds before the walltime
    warn_signal: str | None = None
    copper: bool = False  # ALCF's Copper around the job (the cluster file's scheduler.copper)


def load_job_config(request: JobRequest) -> tuple[ClusterConfig | None, list[str]]:
    """The cluster YAML of the request and the hvdrun options that name it inside the job."""
    path = str(Path(request.config_file).resolve()) if request.config_file else None
    config = load_cluster_config(request.cluster, path)
    if request.cluster:
        return config, ["--cluster", request.cluster]
    return config, (["--config", path] if path else [])


def _defaults(request: JobRequest, config: ClusterConfig | None) -> SchedulerDefaults:
    if config is not None and config.scheduler is not None:
        return config.scheduler
    if request.scheduler is None:
        where = f"cluster '{config.name}' ({config.source}) has no 'scheduler:' section; " if config else ""
        raise UsageError(f"{where}name the scheduler: --scheduler {{{','.join(SCHEDULERS)}}}, or --cluster NAME "
                         f"of a machine with one ({', '.join(_clusters_with_scheduler())})")
    return SchedulerDefaults(kind=request.scheduler)


def _clusters_with_scheduler() -> list[str]:
    """The shipped clusters whose file has a ``scheduler:`` section (those ``hvdrun qsub --cluster`` can use)."""
    return [name for name in available_clusters() if load_cluster(name).scheduler is not None]


def _word(option: str, value: str | None, pattern: re.Pattern[str] = _WORD_RE,
          expected: str = "letters, digits, '_', '.', '+' or '-'") -> str | None:
    if value is not None and not pattern.fullmatch(value):
        raise UsageError(f"{option} {value!r}: expected {expected}")
    return value


def _filesystems(request: JobRequest, defaults: SchedulerDefaults) -> tuple[str, ...]:
    if request.filesystems is None:
        names = defaults.filesystems
    else:
        names = tuple(n for n in re.split(r"[,:]", request.filesystems) if n)
    for name in names:
        _word("--filesystems", name, _WORD_RE, "filesystem names separated by ',' or ':', e.g. home,eagle")
    if defaults.valid_filesystems:
        bad = [n for n in names if n not in defaults.valid_filesystems]
        if bad:
            raise UsageError(f"--filesystems: {bad[0]!r} is not a filesystem of this machine; allowed: "
                             f"{', '.join(defaults.valid_filesystems)}")
    return names


def _check_required(defaults: SchedulerDefaults, values: dict[str, object], cluster: str) -> None:
    flags = {"account": "-A/--account", "walltime": "-t/--walltime", "filesystems": "--filesystems",
             "queue": "-q/--queue"}
    for name in defaults.required:
        if not values.get(name):
            raise UsageError(f"{flags[name]} is required on {cluster} and was not given "
                             f"(nor set under scheduler.{name} in its config)")


def _check_queue(queue: str | None, defaults: SchedulerDefaults, nodes: int, walltime_s: int | None,
                 cluster: str, config: ClusterConfig | None, kind: str) -> queue_limits.QueueDecision:
    """Nodes and walltime against the queue's limits: the scheduler's where it answers, else the YAML's
    (:mod:`hvdrun.jobs.queue_limits`)."""
    job = queue_limits.QueueJob(queue, nodes, walltime_s, cluster, defaults, config.source if config else None)
    return queue_limits.decide(job, queue_limits.ask_scheduler(kind, queue))


def _check_cpu_bind(config: ClusterConfig | None, ranks_per_node: int) -> None:
    """The cluster's ``cpu_bind`` must read, and a ``list:`` must give every rank of a node its cores."""
    if config is None or not config.cpu_bind:
        return
    try:
        bind = parse_cpu_bind(config.cpu_bind)
    except CpuBindError as e:
        raise UsageError(f"{config.source}: cpu_bind: {e}") from None
    if bind.policy == "list" and len(bind.lists) < ranks_per_node:
        raise UsageError(f"--ranks-per-node {ranks_per_node}: {config.source}: cpu_bind lists cores for "
                         f"{len(bind.lists)} ranks per node; give at most {len(bind.lists)} ranks per node, or "
                         "a cpu_bind list per rank")


def is_python(word: str) -> bool:
    """Whether a COMMAND's first word asks for "the" Python (``python``, ``python3``, ``python3.12``: no path)."""
    return _PYTHON_RE.fullmatch(word) is not None


def _program_of(command: Sequence[str]) -> str:
    """What a COMMAND runs, for its name: the script or ``-m`` module after a bare Python, else the program."""
    if not command:
        return "job"
    if not is_python(command[0]):
        return Path(command[0]).stem
    words = iter(command[1:])
    for word in words:
        if word == "-m":
            return next(words, "job")
        if word == "-c":
            return "job"
        if word in _PYTHON_OPTIONS_WITH_VALUES:
            next(words, None)
        elif not word.startswith("-"):
            return Path(word).stem
    return "job"


def _for_hvdrun(command: tuple[str, ...], python: str) -> tuple[list[str], tuple[str, ...]]:
    """A COMMAND that starts with a bare Python, as the job's hvdrun should run it: ``python train.py ARGS`` as
    ``train.py ARGS`` and ``python -m pkg ARGS`` as ``--module pkg ARGS`` (hvdrun runs them with its own Python,
    a host's ``python:`` or the ``--stage-env`` copy), other interpreter options with the job's ``python``;
    never the ``python`` the site's setup lines put first on PATH. Returns (hvdrun options, command)."""
    if not is_python(command[0]):
        return [], command
    rest = command[1:]
    if len(rest) > 1 and rest[0] == "-m":
        return ["--module"], rest[1:]
    if rest and rest[0].endswith(".py"):
        return [], rest
    return [], (python, *rest)


def _job_name(request: JobRequest) -> str:
    if request.job_name is not None:
        return str(_word("-N/--job-name", request.job_name, _NAME_RE,
                         "a letter, then up to 62 letters, digits, '_', '.' or '-'"))
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", _program_of(request.command))[:62]
    return name if name[:1].isalpha() else f"hvd-{name}"[:63]


def _output_paths(request: JobRequest, name: str, kind: str, now: float) -> tuple[str, str | None, str, str]:
    """(output, error, exit file, script copy), all absolute, from ``-o``/``-e``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    given = request.output
    if given is None or given.endswith("/") or Path(given).is_dir():
        output = Path(given or DEFAULT_OUTPUT_DIR).resolve() / f"{name}-{stamp}.output"
    else:
        output = Path(given).resolve()
    for option, path in (("-o/--output", str(output)), ("-e/--error", request.error)):
        if path is not None and any(c in path for c in "\n\r\0"):
            raise UsageError(f"{option} {path!r}: a path cannot contain line breaks")
    stem = output.with_suffix("") if output.suffix else output
    error = str(Path(request.error).resolve()) if request.error else (
        f"{stem}.error" if scheduler_class(kind).needs_error_file else None)
    return str(output), error, f"{stem}.exitcode", f"{stem}.{kind}.sh"


def _setup_lines(request: JobRequest, defaults: SchedulerDefaults) -> tuple[str, ...]:
    lines = list(defaults.setup)  # the machine's own first (e.g. 'module load conda'), then the user's
    lines += [f"module load {quote(m)}" for m in request.modules]
    if request.conda:
        lines.append(f"conda activate {quote(request.conda)}")
    if request.venv:
        lines.append(f"source {quote(str(Path(request.venv).resolve() / 'bin' / 'activate'))}")
    for item in request.exports:
        name, sep, value = item.partition("=")
        if not sep or not _VAR_RE.fullmatch(name):
            raise UsageError(f"--export {item!r}: expected VAR=VALUE with VAR a valid variable name")
        lines.append(f"export {name}={quote(value)}")
    for line in request.setup:
        if "\0" in line:
            raise UsageError("--setup: a line cannot contain a NUL byte")
        lines.append(line)
    return tuple(lines)


def _copper_of(request: JobRequest, config: ClusterConfig | None, defaults: SchedulerDefaults) -> CopperSettings | None:
    """The Copper the job gets (None: none): ``--copper``, or the cluster file's ``when: custom_env`` and a job with
    an environment of its own (``--venv``, ``--conda``).

    Raises:
        UsageError: ``--copper`` on a cluster whose file has no ``scheduler.copper``.
    """
    copper = defaults.copper
    if request.copper and copper is None:
        where = f"cluster '{config.name}' ({config.source})" if config else "this job (no cluster file)"
        raise UsageError(f"--copper: {where} has no Copper (no scheduler.copper in its file); ALCF runs Copper on "
                         "Aurora (--cluster aurora)")
    wanted = request.copper or (copper is not None and copper.when == "custom_env" and bool(request.venv or
                                                                                            request.conda))
    return copper if wanted else None


def _copper_lines(copper: CopperSettings | None, output: str, python: str) -> tuple[str, ...]:
    """Copper around the job, as ALCF's page runs it: load its module, start it with a log directory beside the
    job's output and the mount, stop it when the script exits (also after a failure or a stop signal), and route
    the job's site-packages through the mount on ``PYTHONPATH`` (the ranks inherit it)."""
    if copper is None:
        return ()
    logs = quote(f"{Path(output).with_suffix('')}.copper-logs")
    site = f"$({quote(python)} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    return (f'hvdrun_copper_mount="{copper.mount}"',  # a path whose ${VAR}s expand (checked by the file's parser)
            f"hvdrun_copper_logs={logs}",
            f"module load {copper.module}",
            f'{copper.launch} -d "$hvdrun_copper_logs" -v "$hvdrun_copper_mount"',
            f"""trap '{copper.stop} -d "$hvdrun_copper_logs" -v "$hvdrun_copper_mount"' EXIT""",
            f'export PYTHONPATH="$hvdrun_copper_mount{site}${{PYTHONPATH:+:$PYTHONPATH}}"')


def _copper_notices(copper: CopperSettings | None, python: str) -> tuple[str, ...]:
    """Where Copper does not help: a job whose Python is not the user's own (a directory the user cannot write:
    the site's frameworks module, in the system image; ALCF's page: those often do not benefit)."""
    if copper is None or not python.startswith("/"):
        return ()
    home = Path(python).parent
    if os.access(home, os.W_OK):
        return ()
    return (f"--copper: the job's Python ({python}) is the site's, not yours ({home} is not writable to you: a "
            "module of the system image), and ALCF's Copper page says those often do not benefit; it helps an "
            "environment of your own on the shared file system (--venv, --conda, --python)",)


def _python(request: JobRequest, config: ClusterConfig | None) -> str:
    """The job's Python: ``--python``, ``--venv``'s, the ``--conda`` environment's (activated first), the
    YAML's, else the Python that runs ``hvdrun qsub`` (an absolute path: a machine's ``conda activate``
    of its base environment does not bring hvdrun)."""
    if request.python:
        return request.python
    if request.venv:
        return str(Path(request.venv).resolve() / "bin" / "python")
    if request.conda:
        return "python"
    if config is not None and config.python:
        return config.python
    return sys.executable


def python_warning(python: str) -> str | None:
    """One line when the job's ``python`` cannot import hvdrun on this machine (None when it can, or
    when it is the activated ``--conda`` environment's, which only the job sees)."""
    if not python.startswith("/") or python == sys.executable:
        return None
    if not os.access(python, os.X_OK):
        return (f"the job's Python {python} does not exist on this machine; the job fails at its start unless it "
                "exists on the compute nodes")
    try:
        done = subprocess.run([python, "-c", "import hvdrun"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the job's Python {python} could not be run here ({e}); the job checks it again at its start"
    if done.returncode != 0:
        return (f"the job's Python {python} cannot import hvdrun on this machine: install hvdrun there "
                f"(pip install hvdrun, or pip install -e of this checkout), or give --venv, --conda or --python")
    return None


def _restart_args(request: JobRequest, nodes: int, unit: str) -> list[str]:
    """``--max-restarts N [--spares K]`` for the job's hvdrun; ``-n/--nodes`` counts the spares too."""
    spares = request.spares or 0
    if spares and unit != "nodes":
        raise UsageError(f"--spares {spares}: this queue counts the GPUs of one node, so no node can be held back; "
                         "drop --spares, or use a queue that allocates whole nodes")
    if spares and spares >= nodes:
        raise UsageError(f"--spares {spares} with -n/--nodes {nodes}: no node would be left to run on; -n counts "
                         f"the spares too, e.g. -n {spares + 1} --spares {spares}")
    if spares and not request.max_restarts:
        raise UsageError(f"--spares {spares}: spare nodes only take over at a restart; give --max-restarts N too")
    args = ["--max-restarts", str(request.max_restarts)] if request.max_restarts is not None else []
    return args + (["--spares", str(spares)] if spares else [])


def _report_args(request: JobRequest) -> list[str]:
    """``--report PATH`` for the job's hvdrun, the path made absolute here (the job may start elsewhere)."""
    return ["--report", str(Path(request.report).expanduser().resolve())] if request.report else []


def _warning_args(request: JobRequest, walltime_s: int | None, scheduler: str) -> list[str]:
    """``--warn-before S [--warn-signal SIG]`` for the job's hvdrun; with ``--chain``, a tenth of the walltime (at
    most 10 minutes) unless given.

    Raises:
        UsageError: ``--chain`` 0, without a walltime, with ``--after``, on a scheduler that cannot chain; a warning
            as long as the walltime.
    """
    chained = request.chain is not None
    if chained:
        _check_chain(request, walltime_s, scheduler)
    lead = request.warn_before
    if lead is None and chained and walltime_s:
        lead = min(walltime_s / 10, DEFAULT_CHAIN_WARNING_MAX_S)
    if lead is None:
        if request.warn_signal:
            raise UsageError(f"--warn-signal {request.warn_signal}: give --warn-before S too (when to send it)")
        return []
    if request.warn_signal:
        from hvdrun.launch.warning import warn_signal_number

        warn_signal_number(request.warn_signal)
    if walltime_s and lead >= walltime_s:
        raise UsageError(f"--warn-before {lead:g}: the job's walltime is {walltime_s} s; the warning must come "
                         f"before its end, e.g. --warn-before {max(walltime_s // 10, 1)}")
    return ["--warn-before", f"{lead:g}", *(["--warn-signal", request.warn_signal] if request.warn_signal else [])]


def _check_chain(request: JobRequest, walltime_s: int | None, scheduler: str) -> None:
    length = request.chain or 0
    if length < 1:
        raise UsageError(f"--chain {length}: expected at least 1 job")
    if not walltime_s:
        raise UsageError(f"--chain {length}: a chain continues jobs that end at their walltime; give -t/--walltime")
    if request.after:
        raise UsageError(f"--chain {length} with --after {request.after[0]}: a chain's first job starts when the "
                         "scheduler allows and each next one after the previous; drop --after, or submit the chain "
                         "after that job has ended")
    reason = scheduler_class(scheduler).no_chain
    if reason:
        raise UsageError(f"--chain {length}: {reason}")


def _run_args(request: JobRequest) -> list[str]:
    """``--run-args``, split as the shell would."""
    try:
        return shlex.split(request.run_args or "")
    except ValueError as e:
        raise UsageError(f"--run-args {request.run_args!r}: {e}") from None


def _job_launcher(run_args: Sequence[str], config: ClusterConfig | None, kind: str, nodes: int) -> tuple[str, str]:
    """The launcher the job's hvdrun will use, and where that choice comes from (as ``launch/job.py`` chooses:
    srun in a Slurm job of several nodes)."""
    given = _option_values(run_args, "--launcher")
    if given:
        return given[-1], "--run-args"
    if config is not None and config.launcher:
        return config.launcher, f"the launcher of {config.source}"
    return ("srun", "hvdrun's default in a Slurm job") if kind == SLURM and nodes > 1 else ("ssh", "hvdrun's default")


def _stage_args(request: JobRequest) -> list[str]:
    """``--stage-env [--stage-dir DIR]`` for the job's hvdrun (every launcher stages: hvdrun.launch.stage_tree)."""
    from hvdrun.launch.staging import check_stage_dir

    if not (request.stage_env or request.stage_dir):
        return []
    directory = check_stage_dir(request.stage_dir, "--stage-dir") if request.stage_dir else None
    return ["--stage-env", *(["--stage-dir", directory] if directory else [])]


def _option_values(words: Sequence[str], option: str) -> list[str]:
    """The values ``option`` takes among ``words`` (``--name value`` and ``--name=value``), in order."""
    values = []
    for i, word in enumerate(words):
        name, sep, value = word.partition("=")
        if name == option:
            values.append(value if sep else (words[i + 1] if i + 1 < len(words) else ""))
    return values


def _filesystem_args(request: JobRequest, config: ClusterConfig | None, defaults: SchedulerDefaults, kind: str,
                     nodes: int, filesystems: Sequence[str]) -> list[str]:
    """``--mpi-args`` the job's mpiexec needs for the filesystems it requests (the cluster file's
    ``scheduler.filesystem_mpi_args``, e.g. Aurora's DAOS needs PALS's ``--no-vni``); nothing when none needs any
    or ``--run-args`` already passes them.

    Raises:
        UsageError: ``--run-args`` has its own ``--mpi-args`` without them (the job's hvdrun takes only that one).
    """
    run_args = _run_args(request)
    wanted = {word: name for name in filesystems for word in defaults.filesystem_mpi_args.get(name, ())}
    if not wanted or _job_launcher(run_args, config, kind, nodes)[0] != "mpiexec":
        return []
    given = _option_values(run_args, "--mpi-args")
    if not given:
        return [f"--mpi-args={shlex.join(wanted)}"]
    missing = [word for word in wanted if word not in shlex.split(given[-1])]
    if missing:
        where = f"{config.source if config else kind}: scheduler.filesystem_mpi_args"
        raise UsageError(f"--run-args gives --mpi-args {given[-1]!r}, which the job's mpiexec would get instead of "
                         f"the {' '.join(missing)} that filesystem {wanted[missing[0]]} needs ({where}); add it: "
                         f"--run-args \"--mpi-args='{' '.join([given[-1], *missing])}'\"")
    return []


def _launch(request: JobRequest, config_args: list[str], python: str, ranks_per_node: int,
            run_options: Sequence[str]) -> tuple[str, ...]:
    from hvdrun.launch.plan import resolve_command

    module, command = _for_hvdrun(resolve_command(request.command, check_program=False), python)
    args = [python, "-m", "hvdrun", *config_args, "--ranks-per-node", str(ranks_per_node), *module]
    if request.gpus_per_node is not None:
        args += ["--gpus-per-node", str(request.gpus_per_node)]
    args += [*run_options, *_run_args(request)]
    return (*args, "--", *command)


def build_spec(request: JobRequest, now: float | None = None, workdir: str | None = None) -> JobSpec:
    """Validate ``request`` against its cluster YAML and return the job to render.

    Raises:
        UsageError: a missing required field, a value outside the queue's limits, a bad value.
    """
    config, config_args = load_job_config(request)
    defaults = _defaults(request, config)
    kind = request.scheduler or defaults.kind
    cluster = config.name if config else kind
    nodes = request.nodes or 1
    walltime_text = request.walltime or defaults.walltime
    walltime_s = parse_walltime(walltime_text, "-t/--walltime") if walltime_text else None
    queue = _word("-q/--queue", request.queue or defaults.queue)
    account = _word("-A/--account", request.account or defaults.account)
    filesystems = _filesystems(request, defaults)
    _check_required(defaults, {"account": account, "walltime": walltime_s, "filesystems": filesystems,
                               "queue": queue}, cluster)
    decision = _check_queue(queue, defaults, nodes, walltime_s, cluster, config, kind)
    unit = decision.limits.unit if decision.limits else "nodes"
    gpus = request.gpus_per_node if request.gpus_per_node is not None else (config.gpus_per_node if config else 0)
    per_rank = config.gpus_per_rank if config else 1
    ranks_per_node = request.ranks_per_node or (nodes if unit == "gpus" else None) or (
        config.ranks_per_node if config else None) or max(gpus // per_rank, 1)
    _check_cpu_bind(config, ranks_per_node)
    run_options = [*_restart_args(request, nodes, unit), *_warning_args(request, walltime_s, kind),
                   *_stage_args(request),
                   *_filesystem_args(request, config, defaults, kind, nodes, filesystems), *_report_args(request)]
    name = _job_name(request)
    output, error, exit_file, script_path = _output_paths(request, name, kind, time.time() if now is None else now)
    python = _python(request, config)
    copper = _copper_of(request, config, defaults)
    setup = (*_setup_lines(request, defaults), *_copper_lines(copper, output, python))
    after = tuple(str(_word("--after", job, _JOB_ID_RE, "a job id such as 1234 or 1234.server"))
                  for job in request.after)
    return JobSpec(
        scheduler=kind, cluster=cluster, nodes=nodes, unit=unit, walltime_s=walltime_s, queue=queue,
        account=account, filesystems=filesystems, job_name=name, output=output, error=error, exit_file=exit_file,
        script_path=script_path, workdir=workdir or os.getcwd(), setup=setup, ranks_per_node=ranks_per_node,
        gpus_per_node=gpus if unit == "nodes" else nodes, system=defaults.system, place=defaults.place,
        directives=(*defaults.extra_directives, *request.directives), skip_directives=defaults.skip_directives,
        after=after, launch=_launch(request, config_args, python, ranks_per_node, run_options),
        template=request.template or defaults.template,
        notices=(*decision.notices, *_copper_notices(copper, python)))
