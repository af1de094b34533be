"""The ``hvdrun`` command line: parse, call, map :class:`HvdrunError` to exit codes. Nothing else.

``hvdrun [OPTIONS] COMMAND...`` is short for ``hvdrun run [OPTIONS] COMMAND...``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from typing import Any, NoReturn

import click

from hvdrun.config import available_clusters
from hvdrun.envvars import RESTART_COUNT, TORCHELASTIC_RESTART_COUNT
from hvdrun.errors import HvdrunError, JobInterrupted
from hvdrun.interrupts import own_signals, signal_number
from hvdrun.ranks import GPU_VISIBILITIES
from hvdrun.schedulers import SCHEDULERS
from hvdrun.version import __version__

_CLUSTER_HELP = f"A cluster from cluster_configs/ ({', '.join(available_clusters())})."


class _HvdrunFailure(click.ClickException):
    """An HvdrunError on its way out of click, keeping its exit code."""

    def __init__(self, error: HvdrunError) -> None:
        super().__init__(str(error))
        self.exit_code = error.exit_code  # type: ignore[misc]  # click declares it on the class

    def format_message(self) -> str:
        return self.message


class _Seconds(click.ParamType):
    """A finite, non-negative number of seconds (``nan`` and ``inf`` are refused)."""

    name = "seconds"

    def __init__(self, positive: bool = False) -> None:
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (self.positive and seconds == 0):
            self.fail(f"{value!r} must be a finite number of seconds{' above 0' if self.positive else ''}",
                      param, ctx)
        return seconds


class _DefaultRunGroup(click.Group):
    """A group whose default subcommand is ``run``; every error is one ``hvdrun: error:`` line."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands and args[0] not in ("--help", "-h", "--version", "-v"):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,  # type: ignore[override]
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Run the CLI; errors (click's usage errors included) print one line and exit with their code."""
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if not standalone_mode:
                raise
            message = e.format_message()
            if isinstance(e, click.NoSuchOption):
                message = _no_such_option(e)
            if isinstance(e, click.UsageError):  # click's own: one line, with where to look
                message = " ".join(message.split()) + "; see 'hvdrun --help'"
            _say(f"hvdrun: error: {message}")
            sys.exit(e.exit_code)
        except click.Abort as e:
            if not standalone_mode:
                raise
            _exit_interrupted(e.__context__ or KeyboardInterrupt())
        if standalone_mode:
            sys.exit(result if isinstance(result, int) else 0)
        return result

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """``hvdrun --help``: the run options (a command line is a run by default), the subcommands and the
        environment variables hvdrun reads or sets."""
        from hvdrun.envvars import HELP

        formatter.write_usage("hvdrun", "[RUN OPTIONS] COMMAND [ARGS]...")
        formatter.write_usage("hvdrun", "check|bench|qsub|qstat|qdel|stacks|top|run [OPTIONS] [ARGS]...",
                              prefix="   or: ")
        self.format_help_text(ctx, formatter)
        run_command = self.commands["run"]
        records = [r for p in run_command.get_params(ctx) if (r := p.get_help_record(ctx)) is not None]
        with formatter.section("Run options (hvdrun run)"):
            formatter.write_dl(records)
        self.format_commands(ctx, formatter)
        with formatter.section("Environment"):
            formatter.write_dl(HELP)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HvdrunError as e:
            raise _HvdrunFailure(e) from e
        except KeyboardInterrupt as e:  # a stop signal outside the phases that handle their own: nothing runs
            raise _HvdrunFailure(_interrupted(e)) from None


def _interrupted(error: BaseException) -> JobInterrupted:
    """The error that a stop signal (:mod:`hvdrun.interrupts`) that reached the command line becomes."""
    signum = signal_number(error)
    return JobInterrupted(f"received {signal.Signals(signum).name}; nothing is running", 128 + signum)


def _exit_interrupted(error: BaseException) -> NoReturn:
    """One line for an interrupt that reached the command line, and exit 128 + N."""
    failure = _interrupted(error)
    _say(f"hvdrun: error: {failure}")
    sys.exit(failure.exit_code)


def _say(line: str) -> None:
    """One line on stderr that waits for a console that stopped reading a few seconds at most."""
    from hvdrun.launch.console import write_bounded

    write_bounded(sys.stderr, f"{line}\n")


@click.group(cls=_DefaultRunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-v", "--version", prog_name="hvdrun")
def cli() -> None:
    """Launch data-parallel PyTorch jobs on many hosts and GPUs (Horovod's horovodrun, rebuilt)."""


# foreign launchers' options: what to type instead (click's own guess would be a near spelling)
_FOREIGN_OPTIONS = {
    "--nproc-per-node": "-np N (ranks in total) or --ranks-per-node N (ranks on every host)",
    "--nproc_per_node": "-np N (ranks in total) or --ranks-per-node N (ranks on every host)",
    "--nnodes": "-H host1:N,host2:N or --hostfile FILE (hvdrun starts every host's ranks itself)",
    "--node-rank": "nothing: hvdrun starts the ranks of every host from one command",
    "--node_rank": "nothing: hvdrun starts the ranks of every host from one command",
    "--master-addr": "--network-interface IF (hvdrun advertises rank 0's address on it)",
    "--master_addr": "--network-interface IF (hvdrun advertises rank 0's address on it)",
    "--master-port": "nothing: hvdrun picks free ports", "--master_port": "nothing: hvdrun picks free ports",
    "--rdzv-endpoint": "-H or --hostfile", "--rdzv_endpoint": "-H or --hostfile",
    "--standalone": "nothing: without hosts, hvdrun runs -np ranks on this machine",
    "--ntasks": "-np N", "-n": "-np N", "--host": "-H host1:N,host2:N",
    "--network-interfaces": "--network-interface IF",
}


def _no_such_option(error: click.NoSuchOption) -> str:
    """One line: the unknown option, and a suggestion that means the same thing here."""
    import difflib

    name = error.option_name
    if name in _FOREIGN_OPTIONS:
        return f"no such option '{name}'; in hvdrun use {_FOREIGN_OPTIONS[name]}"
    spellings = {o: "/".join(p.opts) for p in (error.ctx.command.params if error.ctx else [])
                 if isinstance(p, click.Option) for o in p.opts}
    close = difflib.get_close_matches(name, list(spellings), n=len(spellings) or 1, cutoff=0.8)
    if not close:
        return f"no such option '{name}'"
    # of the near spellings, the fewest typing slips away ('--hsots' is one swap from --hosts, two from --slots)
    best = min(close, key=lambda option: _typo_distance(name, option))
    return f"no such option '{name}'; did you mean '{spellings[best]}'"


def _typo_distance(typed: str, word: str) -> int:
    """Letters inserted, dropped, replaced or swapped with a neighbour to get ``word`` from ``typed``
    (optimal string alignment distance)."""
    rows = [list(range(len(word) + 1))]
    for i, a in enumerate(typed, 1):
        row = [i]
        for j, b in enumerate(word, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (a != b)))
            if i > 1 and j > 1 and a == word[j - 2] and typed[i - 2] == b:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]



def _host_options(with_np: bool = True) -> Any:
    """The options that say where ranks run and how they are started (run, check; bench without -np)."""
    options = [
        click.option("-np", "--num-proc", "num_proc", type=click.IntRange(min=1),
                     help="Number of ranks (default: all slots)."),
    ] if with_np else []
    options += [
        click.option("-H", "--hosts", help="Hosts and slots: 'a:4,b:4' (user@host:N, [ipv6]:N)."),
        click.option("-hostfile", "--hostfile", type=click.Path(dir_okay=False),
                     help="File with one 'host slots=N' per line."),
        click.option("--cluster", help=_CLUSTER_HELP),
        click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A cluster YAML file."),
        click.option("--gpus-per-node", type=click.IntRange(min=0),
                     help="GPUs (Intel: tiles) per host; pins each rank through its vendor's variable "
                     "(CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK, ROCR_VISIBLE_DEVICES)."),
        click.option("--gpus-per-rank", type=click.IntRange(min=1), help="GPUs each rank gets (default 1)."),
        click.option("--gpu-visibility", type=click.Choice(GPU_VISIBILITIES),
                     help="node (default): every rank sees its host's GPUs in the cluster's order, so device "
                          "local_rank is its own (set_device(local_rank) works); rank: each rank sees only its own."),
        click.option("--cpu-bind", metavar="none|cores|numa|depth:D|list:A-B:C-D...",
                     help="Cores of each rank: cores = an equal disjoint share, numa = one NUMA node, depth:D = "
                          "CPUs L*D..L*D+D-1 (PALS's --depth), list: one core list per local rank (default: the "
                          "cluster's cpu_bind, else none)."),
        click.option("--ranks-per-node", type=click.IntRange(min=1),
                     help="Ranks on every host (default: its slots; in an allocation one per GPU, or per node)."),
        click.option("--launcher", type=click.Choice(["local", "ssh", "mpiexec", "srun"]),
                     help="How to start workers (default: the cluster's, else local or ssh)."),
        click.option("-p", "--ssh-port", type=click.IntRange(1, 65535), help="SSH port of every remote host."),
        click.option("-i", "--ssh-identity-file", type=click.Path(exists=True, dir_okay=False),
                     help="Private key for SSH (also tried: ~/.ssh/config IdentityFile, default keys, agent)."),
        click.option("--ssh-known-hosts", type=click.Path(exists=True, dir_okay=False),
                     help="known_hosts file that vouches for host keys (default ~/.ssh/known_hosts)."),
        click.option("--ssh-fanout", type=click.IntRange(1), metavar="N",
                     help="Hosts hvdrun reaches over SSH itself (default 32, HVDRUN_SSH_FANOUT); the host agents on "
                          "those reach the others, a tree."),
        click.option("--network-interface", help="Interface whose address rank 0 advertises to the other hosts."),
        click.option("--mpi-flavour", type=click.Choice(["mpich", "openmpi", "pals"]),
                     help="The MPI of --launcher mpiexec (default: from 'mpiexec --version')."),
        click.option("--mpi-args", help="Extra arguments for mpiexec, e.g. --mpi-args='--cpu-bind depth'."),
        click.option("-x", "env_specs", multiple=True, metavar="VAR[=VALUE]", help="Forward or set a variable."),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


_REFUSED_FLAGS = ("--autotune", "--hierarchical-allreduce", "--hierarchical-allgather", "--torus-allreduce", "--jsrun")


def _refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A horovodrun option that cannot apply here: refused, saying why."""
    if value:
        from hvdrun.horovodrun import REFUSED

        name = param.opts[0]
        raise click.UsageError(f"{name} cannot apply in hvdrun: {REFUSED[name]}", ctx)


def _horovodrun_options(command: Any) -> Any:
    """horovodrun's options (see hvdrun/horovodrun.py): tuning, controller, config file, check-build, output."""
    options = [
        click.option("--fusion-threshold-mb", type=click.FloatRange(min=0), help="Fusion buffer size in MB."),
        click.option("--cycle-time-ms", type=click.FloatRange(min=0), help="Negotiation cycle in ms (mpi/gloo)."),
        click.option("--cache-capacity", type=click.IntRange(min=0),
                     help="Accepted for horovodrun's scripts; hvdrun negotiates every op (no response cache)."),
        click.option("--disable-cache", is_flag=True, help="Accepted: hvdrun caches no launch checks."),
        click.option("--timeline-mark-cycles", is_flag=True, default=None, help="Mark cycles in the timeline."),
        click.option("--no-stall-check", is_flag=True, default=None, help="No stall warning or shutdown."),
        click.option("--stall-check-warning-time-seconds", type=click.FloatRange(min=0),
                     help="Warn about ops some ranks have not submitted after this long (60)."),
        click.option("--stall-check-shutdown-time-seconds", type=click.FloatRange(min=0),
                     help="Fail them after this long (300; 0: never)."),
        click.option("--log-level", type=click.Choice(["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"],
                                                      case_sensitive=False), help="Runtime log level."),
        click.option("--mpi", "controller", flag_value="mpi", default=None,
                     help="Ranks under mpiexec with the MPI backend (horovodrun --mpi)."),
        click.option("--gloo", "controller", flag_value="gloo", help="hvdrun's own ring (horovodrun --gloo)."),
        click.option("--config-file", "horovod_config_file", type=click.Path(dir_okay=False),
                     help="horovodrun's YAML of parameters (options given here win)."),
        click.option("-cb", "--check-build", is_flag=True, help="Show what this hvdrun can use, then exit."),
        click.option("-prefix-timestamp", "--prefix-timestamp", "--prefix-output-with-timestamp", "prefix_timestamp",
                     is_flag=True, help="Prefix every output line with the time."),
        *[click.option(flag, is_flag=True, hidden=True, expose_value=False, callback=_refuse)
          for flag in _REFUSED_FLAGS],
        click.option("--binding-args", hidden=True, expose_value=False, callback=_refuse),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _elastic_options(command: Any) -> Any:
    """Elastic training (Horovod's): workers that leave or join while the job goes on."""
    options = [
        click.option("--min-np", "--min-num-proc", "min_np", type=click.IntRange(min=1),
                     help="Elastic: keep training while at least this many workers remain (default -np)."),
        click.option("--max-np", "--max-num-proc", "max_np", type=click.IntRange(min=1),
                     help="Elastic: never more workers than this (default: every slot discovery offers)."),
        click.option("--host-discovery-script", type=click.Path(exists=True, dir_okay=False),
                     help="Elastic: prints 'host' or 'host:slots' per line; run again every second."),
        click.option("--slots-per-host", "--slots", "slots_per_host", type=click.IntRange(min=1),
                     help="Elastic: slots of a discovery line without ':slots' (default 1)."),
        click.option("--elastic-timeout", "elastic_timeout_s", type=_Seconds(positive=True),
                     help="Elastic: seconds to wait for --min-np workers before the job stops (600)."),
        click.option("--reset-limit", type=click.IntRange(min=0), help="Elastic: fail after this many resets."),
        click.option("--blacklist-cooldown-range", "cooldown_range", nargs=2, type=_Seconds(),
                     help="Elastic: a failed slot or host takes no new worker for MIN s, doubling per failure up "
                          "to MAX (default 60 3600)."),
        click.option("--blacklist-scope", type=click.Choice(["slot", "host"]),
                     help="Elastic: what a failed worker takes out for the cool-down: its slot, or its whole host, "
                          "whose other workers leave (Horovod's blacklist; default, decided at each failure: host "
                          "while more than one host is offered, else slot)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


_STAGE_ENV_HELP = ("Copy the ranks' Python environment (a venv or conda env) once to every host's own disk and run "
                   "the ranks from the copy, not from the shared file system; the copy stays there for the next "
                   "job (DIR/hvdrun-UID/env-FINGERPRINT; a changed environment gets a new one). One host reads it "
                   "from the shared file system, the others get it host to host (a tree); every launcher.")
_STAGE_DIR_HELP = ("Where --stage-env copies it on each host (implies --stage-env; default: the cluster's local_dir, "
                   "else /tmp).")


def _stage_options(command: Any) -> Any:
    """Environment staging (launch/staging.py): run, and qsub for the job's hvdrun."""
    command = click.option("--stage-dir", metavar="DIR", help=_STAGE_DIR_HELP)(command)
    return click.option("--stage-env", is_flag=True, help=_STAGE_ENV_HELP)(command)


def _observe_options(command: Any) -> Any:
    """Metrics and the job report (observe/): sampled from the ranks while the job runs."""
    options = [
        click.option("--metrics-port", metavar="[ADDR:]PORT",
                     help="Serve the ranks' live numbers (those of 'hvdrun top') in Prometheus' text format at "
                          "http://ADDR:PORT/metrics (ADDR default 127.0.0.1; 0.0.0.0 for every interface)."),
        click.option("--metrics-file", type=click.Path(dir_okay=False),
                     help="Append the same numbers to this file as one JSON line per sample."),
        click.option("--metrics-interval", "metrics_interval_s", type=_Seconds(positive=True),
                     help="Seconds between two samples of the ranks (default 5)."),
        click.option("--report", type=click.Path(dir_okay=False),
                     help="Write a self-contained HTML report of the job here when it ends (succeeded, failed or "
                          "stopped): hosts, ranks, start-up per host, rates over time, stragglers, the failure."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


_WARN_BEFORE_HELP = ("Warn every rank S seconds before the allocation ends (its PBS, Slurm or Cobalt job's end, as the "
                     "scheduler says), once, with --warn-signal; the ranks read the time left with hvd.time_left().")


def _walltime_options(command: Any) -> Any:
    """Jobs longer than a walltime (launch/warning.py): the warning before the end, state that outlives the job."""
    options = [
        click.option("--warn-before", "warn_before_s", type=_Seconds(positive=True), metavar="S",
                     help=_WARN_BEFORE_HELP),
        click.option("--warn-signal", metavar="SIG", help="The warning's signal (default USR1)."),
        click.option("--state-dir", metavar="DIR",
                     help="hvd.elastic state is saved here (rank 0, atomically) and restored from here by the next "
                          "job: at the warning, and at a commit at most every HVDRUN_STATE_INTERVAL_S (300)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _restart_options(command: Any) -> Any:
    """Restarts of the whole job (torchrun's --max-restarts), routed around the host that failed."""
    options = [
        click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
                     help=f"Start the whole job again up to N times when a rank fails ({RESTART_COUNT}, "
                          f"{TORCHELASTIC_RESTART_COUNT} tell the ranks which attempt they are in)."),
        click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Hold the last K hosts back: a restart runs on them instead of the host that failed."),
        click.option("--exclude-hosts", help="Hosts to leave out from the start, e.g. 'h3,h7'."),
        click.option("--exclude-hosts-file", type=click.Path(exists=True, dir_okay=False),
                     help="Hosts to leave out, one per line ('#' comments), as 'hvdrun check --write-excludes' "
                          "writes them."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


_HOROVODRUN_NAMES = ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "disable_cache",
                     "timeline_mark_cycles", "no_stall_check", "stall_check_warning_time_seconds",
                     "stall_check_shutdown_time_seconds", "log_level", "controller", "horovod_config_file",
                     "check_build")


@cli.command(context_settings={"allow_interspersed_args": False})
@_host_options()
@click.option("-m", "--module", is_flag=True, help="COMMAND is a module: every rank runs 'python -m COMMAND'.")
@click.option("--no-prefix", is_flag=True, help="Do not prefix output lines with [rank]<stream>:.")
@click.option("--output-dir", "--output-filename", "output_dir", type=click.Path(file_okay=False),
              help="Also write DIR/rank.N/stdout and stderr.")
@click.option("--start-timeout", "start_timeout_s", type=_Seconds(positive=True),
              help="Seconds the ranks wait for each other at init() (default 60).")
@click.option("--verbose", is_flag=True, help="Print the rank plan before starting.")
@click.option("--timeline-filename", type=click.Path(dir_okay=False),
              help="Write a Chrome-trace timeline of the collectives (rank 0) to this file.")
@click.option("--grace-period", "grace_s", type=_Seconds(), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping workers.")
@click.option("--ranks-output", metavar="RANKS",
              help="Show only these ranks' output on the console, e.g. 0 or 0,3-5 (--output-dir still gets all).")
@click.option("--idle-timeout", "idle_timeout_s", type=_Seconds(positive=True),
              help="Stop the job (exit 124) when no rank printed anything for this many seconds.")
@click.option("--forward-signals", metavar="LIST",
              help="Signals to hvdrun passed on to every rank, the job going on (default USR1,USR2; 'none'). "
                   "USR1/USR2 not listed are ignored with a note (a scheduler's warning never stops the job).")
@click.option("--horovod-compat", is_flag=True,
              help="'import horovod' and 'import horovod.torch' in the ranks resolve to hvdrun.")
@click.option("--preload", metavar="MODULES", default="auto", show_default=True,
              help="Modules each host imports once, its ranks then starting by fork (local and ssh launchers): "
                   "'auto' (torch when the script imports it), 'none' (every rank starts a new Python), or a "
                   "comma-separated list. A rank whose Python or environment differs starts a new Python.")
@_observe_options
@_stage_options
@_elastic_options
@_restart_options
@_walltime_options
@_horovodrun_options
@click.option("--preflight", is_flag=True,
              help="Before any rank starts, check every host (spares too) at once: reached, GPUs as the cluster file "
                   "says and their vendor tool's health, the job's network interface up with carrier, the cluster "
                   "file's mounts, free space in the node-local directory, the clock within a second. Each unhealthy "
                   "host is named in one line and left out where the others hold every rank (--spares); otherwise "
                   "the job stops (exit 1).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(command: tuple[str, ...], no_prefix: bool, preflight: bool, **options: Any) -> None:
    """Run COMMAND on every rank (a .py file runs under this Python)."""
    from hvdrun.horovodrun import horovodrun_settings
    from hvdrun.launch.job import run_job
    from hvdrun.launch.plan import RunOptions, describe_plan, plan_job

    horovod = {name: options.pop(name) for name in _HOROVODRUN_NAMES}
    if horovod.pop("check_build"):
        from hvdrun.horovodrun import check_build

        click.echo(check_build())
        return
    launcher, extra_env = horovodrun_settings(horovod, options["launcher"])
    options.update(launcher=launcher, extra_env=tuple(extra_env.items()))
    plan = plan_job(RunOptions(command=command, prefix_output=not no_prefix, **options), os.environ)
    for note in plan.notes:
        click.echo(f"hvdrun: note: {note}", err=True)
    if preflight:
        from hvdrun.health.preflight import preflight as check_hosts_first

        plan = check_hosts_first(plan, lambda line: click.echo(line, err=True))
    if options["verbose"]:
        click.echo(describe_plan(plan), err=True)
    run_job(plan)


_HEALTH_NAMES = ("health", "interface", "mounts", "local_dir", "min_local_gb", "max_clock_skew_s")


def _health_options(command: Any) -> Any:
    """``hvdrun check --health`` and what it checks on every node (health/node_checks.py)."""
    options = [
        click.option("--health", is_flag=True,
                     help="Also check each node's health: the network interface, mounts, free space in the node-local "
                          "directory, the GPU vendor tools' verdicts (nvidia-smi -q, xpu-smi health, rocm-smi RAS) "
                          "and the clock. The options below imply it."),
        click.option("--interface", metavar="IF",
                     help="The interface that must be up with carrier (default: --network-interface, else the "
                          "cluster's network_interface)."),
        click.option("--mount", "mounts", multiple=True, metavar="PATH",
                     help="A file system every node must have mounted (repeatable; default: the cluster's mounts)."),
        click.option("--local-dir", metavar="DIR",
                     help="The node-local directory whose free space is checked (default: the cluster's local_dir)."),
        click.option("--min-local-gb", type=click.FloatRange(min=0),
                     help="Free space the node-local directory needs (default 1)."),
        click.option("--max-clock-skew", "max_clock_skew_s", type=_Seconds(positive=True),
                     help="How far a node's clock may be from this machine's, the round trip allowed for (default 1)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _health_from(options: dict[str, Any]) -> Any:
    """The :class:`HealthOptions` of ``check``'s options (popped from ``options``); None without --health or any of
    its options."""
    from hvdrun.errors import UsageError
    from hvdrun.health.node_checks import HealthOptions

    values = {name: options.pop(name) for name in _HEALTH_NAMES}
    if not (values.pop("health") or any(v not in (None, ()) for v in values.values())):
        return None
    for option, path in [*(("--mount", m) for m in values["mounts"]), ("--local-dir", values["local_dir"])]:
        if path is not None and not path.startswith("/"):
            raise UsageError(f"{option} {path}: give the absolute path every node has, e.g. {option} /lus/flare")
    given = {name: value for name, value in values.items() if value is not None}
    return HealthOptions(**{**given, "mounts": tuple(values["mounts"])})


class _Size(click.ParamType):
    """A byte count: ``4096``, ``4K``, ``64M``, ``1G`` (binary units)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from hvdrun.measure.timing import parse_size

        try:
            return value if isinstance(value, int) else parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


@cli.command()
@_host_options()
@click.option("--timeout", "timeout_s", type=_Seconds(positive=True), default=30.0, show_default=True,
              help="Seconds each host has to answer (connect and probe).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema hvdrun-check/1).")
@click.option("--min-disk-gb", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Free space the working directory needs on every host.")
@click.option("--latency-size", "latency_bytes", type=_Size(), default="4K", show_default=True,
              help="Allreduce size whose latency is measured.")
@click.option("--bandwidth-size", "bandwidth_bytes", type=_Size(), default="64M", show_default=True,
              help="Allreduce size whose bus bandwidth is measured.")
@click.option("--link-size", "link_bytes", type=_Size(), default="16M", show_default=True,
              help="Bytes sent over each ring link to time it.")
@click.option("--write-excludes", "excludes_path", type=click.Path(dir_okay=False),
              help="Write the hosts that failed a check to this file, for 'hvdrun --exclude-hosts-file'.")
@_health_options
def check(timeout_s: float, as_json: bool, min_disk_gb: float, latency_bytes: int, bandwidth_bytes: int,
          link_bytes: int, excludes_path: str | None, **options: Any) -> int:
    """Prove that the hosts can run a job: reach, versions, GPUs, disk, port, a real allreduce; with --health also
    each node's health (interface, mounts, node-local space, GPU vendor tools, clock)."""
    from rich.console import Console

    from hvdrun.health.check import CheckOptions, check_targets, plan_check, run_check
    from hvdrun.health.check_view import HostProgress, print_check
    from hvdrun.health.excludes import check_writable, describe_written, write_excludes
    from hvdrun.launch.plan import RunOptions

    health = _health_from(options)
    check_options = CheckOptions(RunOptions(command=(), **options), timeout_s, min_disk_gb, latency_bytes,
                                 bandwidth_bytes, link_bytes, health)
    targets = check_targets(plan_check(check_options, os.environ))  # bad options: exit 2 before any contact
    if excludes_path is not None:
        check_writable(excludes_path)
    progress = HostProgress(Console(stderr=True), [t.host.name for t in targets])
    with progress.shown():
        report = run_check(check_options, os.environ, progress.host_done, progress.phase)
    if as_json:
        click.echo(report.to_json())
    else:
        print_check(report, _stdout_console())
    if excludes_path is not None:
        failed = report.failed_hosts()
        written = write_excludes(excludes_path, failed)
        click.echo(describe_written(written, list(failed), report.ok), err=True)
    return 0 if report.ok else 1


class _IntList(click.ParamType):
    """Comma-separated positive integers: ``1,2,4``."""

    name = "list"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(v) for v in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of rank counts, e.g. 1,2,4", param, ctx)
        if min(numbers) < 1:
            self.fail(f"{value!r}: rank counts must be at least 1", param, ctx)
        return numbers


class _SizeList(click.ParamType):
    """Comma-separated sizes: ``4K,64K,1M``."""

    name = "sizes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        return tuple(_Size().convert(v, param, ctx) for v in str(value).split(","))


@cli.command()
@_host_options(with_np=False)
@click.option("-np", "--np", "rank_counts", type=_IntList(),
              help="Rank counts to run, e.g. 1,2,4 (default: 1, 2, 4, ... up to all slots).")
@click.option("--sizes", type=_SizeList(), default="4K,64K,1M,16M,64M,256M", show_default=True,
              help="Message sizes.")
@click.option("--libraries", help="Some of hvdrun,gloo,mpi (default: all that are installed).")
@click.option("--iterations", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed batches per size; the median is reported.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed ops first.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default="hvdrun-bench.png", show_default=True,
              help="The PNG of bus bandwidth vs size.")
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG.")
def bench(rank_counts: tuple[int, ...] | None, sizes: tuple[int, ...], libraries: str | None, iterations: int,
          warmup: int, json_path: str | None, plot_path: str, no_plot: bool, **options: Any) -> int:
    """Time the allreduce over sizes and rank counts: hvdrun vs gloo (and MPI), with a table, JSON and a plot."""
    from pathlib import Path

    from rich.console import Console

    from hvdrun.bench.sweep import BenchOptions, plan_bench, run_bench
    from hvdrun.bench.table import print_bench
    from hvdrun.launch.plan import RunOptions

    bench_options = BenchOptions(RunOptions(command=(), **options), rank_counts, sizes,
                                 tuple(libraries.split(",")) if libraries else None, iterations, warmup)
    plan_bench(bench_options, os.environ)  # bad options: exit 2 before anything runs
    status = Console(stderr=True)
    report = run_bench(bench_options, os.environ, lambda text: status.print(f"hvdrun bench: {text}", style="dim"))
    print_bench(report, _stdout_console())
    if json_path:
        Path(json_path).write_text(report.to_json())
        click.echo(f"hvdrun bench: wrote {json_path}", err=True)
    if not no_plot and report.rows:
        from hvdrun.bench.plot import plot_bench

        plot_bench(report, plot_path)
        click.echo(f"hvdrun bench: wrote {plot_path}", err=True)
    return 0 if report.rows and not report.skipped else 1


def _stdout_console() -> Any:
    """rich's console on stdout; wide enough for the tables when stdout is a file or a pipe."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _scheduler_option(help_text: str) -> Any:
    """The ``--scheduler`` option of qsub, qstat and qdel: one of :data:`hvdrun.schedulers.SCHEDULERS`."""
    return click.option("--scheduler", type=click.Choice(SCHEDULERS), help=help_text)


_JOB_SCHEDULER = _scheduler_option("The job's scheduler (default: the one hvdrun submitted it to).")


def _job_options(command: Any) -> Any:
    options = [
        click.option("--cluster", help=_CLUSTER_HELP),
        click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A cluster YAML file."),
        _scheduler_option("The scheduler (default: the cluster's)."),
        click.option("-n", "--nodes", type=click.IntRange(min=1), help="Nodes (GPUs in Sophia's by-gpu queue)."),
        click.option("-t", "--walltime", help="Minutes (90) or HH:MM:SS."),
        click.option("-q", "--queue", help="Queue (Slurm: partition)."),
        click.option("-A", "--account", help="Project to charge."),
        click.option("--filesystems", help="Filesystems the job needs: home,eagle."),
        click.option("-N", "--job-name", help="Job name (default: the script's name)."),
        click.option("-o", "--output", help="Output file, or a directory ending in '/' (default hvdrun-jobs/)."),
        click.option("-e", "--error", help="Separate error file (default: merged into the output)."),
        click.option("--module", "modules", multiple=True, help="'module load NAME' in the job (repeatable)."),
        click.option("--conda", help="'conda activate ENV' in the job."),
        click.option("--venv", help="Activate this virtualenv in the job."),
        click.option("--export", "exports", multiple=True, metavar="VAR=VALUE", help="Export a variable."),
        click.option("--setup", multiple=True, metavar="LINE", help="A shell line run before hvdrun (verbatim)."),
        click.option("--ranks-per-node", type=click.IntRange(min=1), help="Ranks per node (default: one per GPU)."),
        click.option("--gpus-per-node", type=click.IntRange(min=0), help="GPUs per node (default: the cluster's)."),
        click.option("--directive", "directives", multiple=True, help="An extra directive line (repeatable)."),
        click.option("--after", multiple=True, metavar="JOBID", help="Start after this job succeeded."),
        click.option("--template", help="A Jinja2 template instead of the shipped one."),
        click.option("--python", help="The Python that runs hvdrun in the job (default: --venv's or --conda's, "
                     "the YAML's, else the Python running this command)."),
        click.option("--run-args", help="Extra hvdrun options inside the job, e.g. '--launcher ssh'."),
        click.option("--max-restarts", type=click.IntRange(min=0),
                     help="The job's hvdrun starts the whole job again up to N times when a rank fails."),
        click.option("--spares", type=click.IntRange(min=0),
                     help="Of the -n nodes, the last K take over from a failed one at a restart."),
        click.option("--report", type=click.Path(dir_okay=False),
                     help="The job's hvdrun writes its HTML report here when the job ends (as 'hvdrun --report')."),
        click.option("--chain", type=int, metavar="N",
                     help="Submit N jobs, each starting after the previous one ended: a job warned before its "
                          "walltime (or preempted) is continued by the next, one that ends with exit code 0 before "
                          "any warning ends the chain (training done), a failure stops it. Needs -t; --warn-before "
                          "defaults to a tenth of the walltime (at most 600 s)."),
        click.option("--warn-before", type=_Seconds(positive=True), metavar="S",
                     help="The job's hvdrun warns every rank S seconds before the walltime ('hvdrun --warn-before')."),
        click.option("--warn-signal", metavar="SIG", help="The warning's signal (default USR1)."),
        click.option("--copper", is_flag=True,
                     help="Run ALCF's Copper around the job (Aurora): module load copper, launch_copper.sh before the "
                          "ranks, the job's site-packages read through its mount, stop_copper.sh at the end."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@cli.command(context_settings={"allow_interspersed_args": False})
@_job_options
@_stage_options
@click.option("--dry-run", is_flag=True, help="Print the job script (the default when not submitting).")
@click.option("--submit", is_flag=True, help="Write the script next to the output and submit it.")
@click.option("--wait", is_flag=True, help="Submit, follow the job and exit with its exit code.")
@click.option("--explain", is_flag=True,
              help="Print the cluster's site facts (queues, limits, filesystems, modules, variables), each with the "
                   "page it was read from, and exit.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def qsub(dry_run: bool, submit: bool, wait: bool, explain: bool, **options: Any) -> int:
    """Write a PBS, Cobalt or Slurm job script that runs COMMAND with hvdrun; print or submit it."""
    if explain:
        from hvdrun.jobs.explain import explain_request

        click.echo(explain_request(options["cluster"], options["config_file"]), nl=False)
        return 0
    from hvdrun.errors import UsageError
    from hvdrun.jobs.chain import first_link
    from hvdrun.jobs.follow import follow
    from hvdrun.jobs.follow import submit as submit_job
    from hvdrun.jobs.render import render_script
    from hvdrun.jobs.spec import JobRequest, build_spec, python_warning

    if dry_run and (submit or wait):
        raise UsageError("--dry-run prints the script only; drop it to --submit or --wait")
    spec = build_spec(JobRequest(**options))
    for notice in spec.notices:
        click.echo(f"hvdrun: note: {notice}", err=True)
    chained = options["chain"]
    text = render_script(first_link(spec) if chained else spec)  # the first job of a chain: as each one reads
    warning = python_warning(spec.launch[0])
    if warning:
        click.echo(f"hvdrun: warning: {warning}", err=True)
    if not (submit or wait):
        click.echo(text, nl=False)
        return 0
    if chained:
        return _submit_chain(spec, chained, wait)
    job = submit_job(spec, text)
    click.echo(job.job_id)
    click.echo(f"hvdrun: submitted job {job.job_id} to {spec.scheduler}; script {job.script}; "
               f"output {job.output}", err=True)
    return follow(job, lambda line: click.echo(line, err=True)) if wait else 0


def _submit_chain(spec: Any, length: int, wait: bool) -> int:
    """``hvdrun qsub --chain N``: submit the chain, print its id (and each job's on stderr), follow it with --wait."""
    from hvdrun.jobs.chain import follow_chain, submit_chain
    from hvdrun.jobs.render import render_script

    def say(line: str) -> None:
        click.echo(line, err=True)

    chain = submit_chain(spec, length, render_script, say)
    click.echo(chain.chain_id)
    for number, job in enumerate(chain.jobs, start=1):
        say(f"hvdrun: chain {chain.chain_id}: job {number} of {chain.length}: {job.job_id}; script {job.script}")
    say(f"hvdrun: chain file {chain.path}; 'hvdrun qstat {chain.chain_id}' lists its jobs, 'hvdrun qdel "
        f"{chain.chain_id}' cancels them")
    return follow_chain(chain, say) if wait else 0


@cli.command()
@_JOB_SCHEDULER
@click.argument("job_id")
def qstat(job_id: str, scheduler: str | None) -> int:
    """Show a job's state, exit code, and why a queued job waits; for a chain (chain-ID), every job of it."""
    from hvdrun.jobs.chain import describe_chain, find_chain, is_chain_id
    from hvdrun.jobs.follow import current_status, scheduler_of

    if is_chain_id(job_id):
        click.echo("\n".join(describe_chain(find_chain(job_id))))
        return 0

    backend, job = scheduler_of(job_id, scheduler)
    status = current_status(backend, job_id, job.exit_file if job else None)
    click.echo(f"job {job_id} ({backend.kind}): {status.describe()}")
    if job:
        click.echo(f"  output: {job.output}\n  script: {job.script}")
    return 1 if status.state == "UNKNOWN" else 0


@cli.command()
@_JOB_SCHEDULER
@click.argument("job_id")
def qdel(job_id: str, scheduler: str | None) -> int:
    """Cancel a job (a job that already ended is not an error); for a chain (chain-ID), every job of it."""
    from hvdrun.jobs.chain import cancel_chain, find_chain, is_chain_id
    from hvdrun.jobs.follow import scheduler_of

    if is_chain_id(job_id):
        cancel_chain(find_chain(job_id), click.echo)
        return 0

    backend, _ = scheduler_of(job_id, scheduler)
    if backend.cancel(job_id):
        click.echo(f"hvdrun: cancelled job {job_id}")
    else:
        click.echo(f"hvdrun: job {job_id} had already ended (or is unknown to {backend.kind}); nothing to cancel")
    return 0


@cli.command("chain-link", hidden=True)
@click.argument("step", type=click.Choice(["begin", "end"]))
@click.argument("chain_file")
@click.argument("number", type=click.IntRange(min=1))
@click.argument("exit_code", type=int, required=False)
@click.argument("stopped_by", required=False)
def chain_link(step: str, chain_file: str, number: int, exit_code: int | None, stopped_by: str | None) -> int:
    """Inside a job of a chain (its script's first and last lines): begin exits 3 where the chain has ended, end
    decides whether it goes on, from the job's exit code and the stop signal its script got, if any
    (jobs/chain.py)."""
    from hvdrun.jobs.chain import link_begins, link_ends, load_chain
    from hvdrun.jobs.scheduler import CHAIN_ENDED

    chain = load_chain(chain_file)
    if step == "begin":
        return 0 if link_begins(chain, number, click.echo) else CHAIN_ENDED
    link_ends(chain, number, exit_code, click.echo, stopped_by or None)
    return 0


@cli.command()
@click.argument("job", required=False)
def stacks(job: str | None) -> int:
    """Print where every rank of a running job is: each thread's Python stack, the collective it waits in,
    its last collectives (ranks alike folded together). JOB: the job id or hvdrun's pid (default: the only
    job of this user that is running). Ctrl-\\ to a running hvdrun prints the same."""
    from hvdrun.launch.stacks import NO_ANSWER, fetch_report

    chosen, secret = _running_job(job)
    try:
        click.echo(fetch_report(chosen["addr"], int(chosen["port"]), secret))
    except NO_ANSWER as e:
        raise _no_answer(chosen, e) from None
    return 0


@cli.command()
@click.argument("job", required=False)
@click.option("--once", is_flag=True, help="Print one view and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print each view as one line of JSON (schema hvdrun-top/1).")
@click.option("--interval", "interval_s", type=_Seconds(positive=True), default=2.0, show_default=True,
              help="Seconds between two views (each rate is measured over it).")
def top(job: str | None, once: bool, as_json: bool, interval_s: float) -> int:
    """Show every rank's progress live: collectives and bytes per second, the share of time it waits for the
    others, optimizer steps per second, the collective it is in, memory, straggler marks (jobs of more than 16
    ranks folded into hosts plus the ten worst ranks). JOB: the job id or hvdrun's pid (default: the only job of
    this user that is running)."""
    import json

    from hvdrun.launch.stacks import NO_ANSWER
    from hvdrun.observe.top import job_sampler, render, watch

    chosen, secret = _running_job(job)
    live = sys.stdout.isatty() and not (once or as_json)

    def show(view: dict[str, Any]) -> None:
        text = json.dumps(view) if as_json else render(view)
        click.echo(("\x1b[H\x1b[2J" if live else "") + text + ("" if as_json or live else "\n"))

    try:
        watch(chosen["job_id"], job_sampler(chosen, secret), show, interval_s, once)
    except NO_ANSWER as e:
        raise _no_answer(chosen, e) from None
    except KeyboardInterrupt:
        pass
    return 0


def _running_job(job: str | None) -> tuple[dict[str, Any], str]:
    """The running job ``job`` names (or the only one) and its secret, from its hvdrun.

    Raises:
        UsageError: no such job (or several and none named).
        InspectionError: its hvdrun did not hand over the secret.
    """
    from hvdrun.errors import InspectionError
    from hvdrun.launch.registry import ask_secret, choose_job

    chosen = choose_job(job)
    try:
        return chosen, ask_secret(chosen)
    except OSError as e:
        raise InspectionError(f"job {chosen['job_id']}: its hvdrun (pid {chosen['pid']}) did not hand over the "
                              f"job's secret ({e}); the job may have just ended") from None


def _no_answer(job: dict[str, Any], error: Exception) -> Exception:
    from hvdrun.errors import InspectionError

    return InspectionError(f"job {job['job_id']}: rank 0 at {job['addr']}:{job['port']} did not answer ({error}); "
                           "its ranks may not have reached init() yet, or the job has no rendezvous (--mpi, elastic)")


def main() -> None:
    """The command line (``hvdrun.__main__.main``, the console script's entry point, calls it)."""
    own_signals()  # again for callers that import this module directly
    cli(prog_name="hvdrun")
