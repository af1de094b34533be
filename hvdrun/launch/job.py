"""Running a job's plan (:mod:`hvdrun.launch.plan`): reach the hosts, start the ranks, supervise them, restart
or run the elastic driver.

:func:`run_job` starts and supervises the workers of a plan; :func:`run_elastic_job` runs an elastic one.
"""

from __future__ import annotations

import functools
import glob
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from hvdrun.envvars import ELASTIC_ADDR, ELASTIC_PORT, Rendezvous, shm_files_glob
from hvdrun.hosts import Host
from hvdrun.interrupts import interrupted_before_ranks
from hvdrun.launch.launcher import Launcher, WorkerSpec
from hvdrun.launch.observation import Observation, observed
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.plan import ElasticPlan, JobPlan, start_timeout_s
from hvdrun.launch.stacks import print_stacks, signal_ranks, stacks_on_demand
from hvdrun.launch.supervision import WorkerGroup
from hvdrun.launch.warning import WarningClock, warning_clock
from hvdrun.protocol.tree import fanout, inner_hosts, tree_value
from hvdrun.ranks import Slot, assign_slots, total_slots

if TYPE_CHECKING:
    from hvdrun.launch.remote.connections import SshOptions
    from hvdrun.launch.staging import Reach

PROBE_TIMEOUT_S = 10.0  # the probe of the next attempt's hosts between two restarts (connect + answer)


def make_launcher(plan: JobPlan) -> Launcher:
    """The launcher that starts ``plan``'s ranks."""
    options = plan.options
    if plan.launcher == "local":
        from hvdrun.launch.local import LocalLauncher

        return LocalLauncher(grace_s=options.grace_s)
    ssh = ssh_options(plan)
    if plan.launcher in ("mpiexec", "srun"):
        from hvdrun.launch.mpiexec import SRUN, MpiexecLauncher

        flavour = SRUN if plan.launcher == "srun" else plan.mpi_flavour
        return MpiexecLauncher(options.grace_s, ssh, plan.layout, flavour, options.network_interface,
                               shlex.split(options.mpi_args or ""))
    from hvdrun.launch.remote.preload import start_up_variables
    from hvdrun.launch.ssh import SshLauncher

    return SshLauncher(options.grace_s, ssh, plan.cwd, plan.python_for, options.network_interface,
                       everywhere=options.launcher == "ssh", fanout=options.ssh_fanout,
                       agent_env=start_up_variables(plan.base_env))


def ssh_options(plan: JobPlan) -> SshOptions:
    """How ``plan``'s launcher reaches remote hosts (``-p``, ``-i``, known_hosts, the YAML's port)."""
    from hvdrun.launch.remote.connections import SshOptions

    options = plan.options
    return SshOptions(port=options.ssh_port, identity_file=options.ssh_identity_file,
                      known_hosts=options.ssh_known_hosts, default_port=plan.ssh_port,
                      connect_timeout_s=min(10.0, start_timeout_s(options)))


def remove_files(pattern: str) -> int:
    """Delete the files matching ``pattern``; returns how many."""
    removed = 0
    for path in glob.glob(pattern):
        Path(path).unlink(missing_ok=True)
        removed += 1
    return removed


def run_job(plan: JobPlan, console: dict[str, TextIO] | None = None) -> None:
    """Reach the hosts, start every rank of ``plan`` and supervise them until the job ends; with
    ``--max-restarts``, start it again after a failure (:mod:`hvdrun.launch.restarts`); with ``--warn-before``,
    warn the ranks before the allocation ends (:mod:`hvdrun.launch.warning`).

    ``console`` replaces hvdrun's stdout and stderr as the destination of the ranks' output.

    Raises:
        LaunchError: a host cannot run ranks (nothing was started anywhere).
        WorkerFailed: a rank failed (exit code = that rank's).
        JobInterrupted: hvdrun was interrupted.
    """
    say = _console_writer(console)
    with warning_clock(plan.warning, lambda text: say(f"{text}\n"), plan.base_env) as clock:
        if plan.elastic is not None:
            return run_elastic_job(plan, plan.elastic, console, clock)
        if plan.options.max_restarts:
            from hvdrun.launch.restarts import run_with_restarts

            run_id = secrets.token_hex(4)  # torchrun's TORCHELASTIC_RUN_ID stays the same across restarts
            return run_with_restarts(plan, plan.options.max_restarts, functools.partial(plan_for_attempt, plan),
                                     lambda attempt_plan, attempt: _run_attempt(attempt_plan, console, attempt, run_id,
                                                                                clock),
                                     lambda text: say(f"{text}\n"), functools.partial(probe_hosts, plan))
        return _run_attempt(plan, console, 0, clock=clock)


def probe_hosts(plan: JobPlan, hosts: Sequence[Host]) -> dict[str, str]:
    """The hosts of ``hosts`` that fail ``plan``'s launcher's probe (each with why), within
    :data:`PROBE_TIMEOUT_S` (or ``--start-timeout`` when shorter); launchers without one find none."""
    launcher = make_launcher(plan)
    try:
        return launcher.probe_hosts(hosts, time.monotonic() + min(PROBE_TIMEOUT_S, start_timeout_s(plan.options)))
    finally:
        launcher.close()


def plan_for_attempt(plan: JobPlan, hosts: tuple[Host, ...]) -> JobPlan:
    """``plan`` with its ranks assigned to ``hosts`` (the same number of ranks, in host order)."""
    return replace(plan, slots=tuple(assign_slots(hosts, len(plan.slots), plan.layout)))


def _run_attempt(plan: JobPlan, console: dict[str, TextIO] | None, attempt: int, run_id: str = "",
                 clock: WarningClock | None = None) -> None:
    """One attempt of a job: every rank started, supervised, and stopped when one fails."""
    options = plan.options
    output_dir = options.output_dir
    if output_dir and options.max_restarts:
        output_dir = str(Path(output_dir) / f"attempt.{attempt}")
    router = OutputRouter(len(plan.slots), prefix=options.prefix_output, output_dir=output_dir,
                          console=console, timestamp=options.prefix_timestamp, console_ranks=plan.console_ranks)
    launcher = make_launcher(plan)
    secret, job_id = secrets.token_hex(32), secrets.token_hex(4)
    observation = Observation(plan, job_id, router, _console_writer(console), attempt, run_id)
    write = observation.write
    try:
        with observed(observation):
            launcher.prepare(plan.slots, time.monotonic() + start_timeout_s(options))
            plan = stage_environment(plan, launcher, write)
            endpoint = launcher.endpoint(plan.slots[0].host)
            rendezvous = Rendezvous(endpoint.addr, endpoint.port, endpoint.master_port, secret, job_id, attempt,
                                    options.max_restarts, run_id or job_id, rendezvous_tree(launcher, plan.slots))
            specs = plan.specs(rendezvous, launcher.cpus)
            observation.ranks_starting(rendezvous, specs, launcher.reached_at())
            group = WorkerGroup(launcher, router, idle_timeout_s=options.idle_timeout_s,
                                on_idle=lambda: print_stacks(rendezvous, write),
                                signal_ranks=functools.partial(signal_ranks, rendezvous),
                                forward_signals=plan.forward_signals)
            with stacks_on_demand(rendezvous, len(plan.slots), write), _warned_through(clock, group.pass_signal):
                group.run(specs)
    except KeyboardInterrupt as e:  # reaching the hosts, staging: no rank was started
        raise interrupted_before_ranks(e) from None
    finally:
        launcher.close()
        remove_files(shm_files_glob(job_id))  # left by ranks killed during init() (their guards remove them too)


def rendezvous_tree(launcher: Launcher, slots: Sequence[Slot]) -> str:
    """``HVDRUN_RENDEZVOUS_TREE`` for a job on ``slots`` (:mod:`hvdrun.protocol.tree`): empty while rank 0 admits
    every host, or where ``launcher`` reserved no endpoint on an inner host (every host then joins rank 0)."""
    per_leader = fanout(os.environ)
    endpoints = [launcher.tree_endpoint(host)
                 for host in inner_hosts(list(dict.fromkeys(slot.host for slot in slots)), per_leader)]
    if any(endpoint is None for endpoint in endpoints):
        return ""
    return tree_value(per_leader, [endpoint for endpoint in endpoints if endpoint is not None])


def stage_environment(plan: JobPlan, launcher: Launcher, write: Callable[[str], None]) -> JobPlan:
    """``--stage-env``: stage ``plan``'s environments on its hosts (the launcher has reached them), say what it
    did in one line, and return the plan whose ranks run the copies; ``plan`` itself without it.

    Raises:
        UsageError: the staging directory cannot be used on a host.
        LaunchError: a host could not unpack the copy.
    """
    if plan.stage is None:
        return plan
    from hvdrun.launch.staging import stage

    hosts = [(host, plan.python_for(host)) for host in dict.fromkeys(slot.host for slot in plan.slots)]
    staged, line = stage(plan.stage, hosts, _reach(launcher))
    write(f"{line}\n")
    return replace(plan, staged={name: host.python for name, host in staged.items()})


def _reach(launcher: Launcher) -> Reach:
    """How staging reaches the hosts: the ssh launcher's connections, the mpiexec launcher's mpiexec, else this
    machine only."""
    from hvdrun.launch.mpiexec import MpiexecLauncher
    from hvdrun.launch.ssh import SshLauncher
    from hvdrun.launch.staging import ThisMachine

    return launcher if isinstance(launcher, SshLauncher | MpiexecLauncher) else ThisMachine()


def _console_writer(console: dict[str, TextIO] | None) -> Callable[[str], None]:
    """Writes hvdrun's own reports where the ranks' stderr goes."""
    from hvdrun.launch.console import write_bounded

    stream = (console or {}).get("stderr") or sys.stderr
    return lambda text: None if write_bounded(stream, text) else None


def _warned_through(clock: WarningClock | None, deliver: Callable[[int], None]) -> AbstractContextManager[None]:
    """The warning before the walltime goes to ``deliver`` while inside (nothing without a clock)."""
    return clock.attached(deliver) if clock is not None else nullcontext()


def run_elastic_job(plan: JobPlan, elastic: ElasticPlan, console: dict[str, TextIO] | None = None,
                    clock: WarningClock | None = None) -> None:
    """Run an elastic job: workers follow discovery, failures shrink the job, new hosts grow it.

    Raises:
        WorkerFailed: the job could not keep --min-np workers, or passed --reset-limit.
        JobInterrupted: hvdrun was interrupted.
    """
    options = plan.options
    capacity = elastic.settings.max_np or max(total_slots(elastic.hosts), 1)
    router = OutputRouter(capacity, prefix=options.prefix_output, output_dir=options.output_dir, console=console,
                          timestamp=options.prefix_timestamp, console_ranks=plan.console_ranks)
    launcher = make_launcher(plan)
    secret, job_id = secrets.token_hex(32), secrets.token_hex(4)

    def spec_for(slot: Slot, extra_env: dict[str, str]) -> WorkerSpec:
        service = Rendezvous(extra_env[ELASTIC_ADDR], int(extra_env[ELASTIC_PORT]), 0, secret, job_id)
        return plan.spec(slot, service, launcher.cpus, extra_env)

    from hvdrun.launch.elastic.driver import ElasticDriver  # 25 ms that a job of fixed ranks does not pay

    driver = ElasticDriver(launcher, router, elastic.discovery(), elastic.settings, spec_for, secret, plan.layout,
                           log=router.say)  # never held up by a console that stopped reading
    try:
        with _warned_through(clock, driver.pass_signal):
            driver.run()
    finally:
        router.drain(5.0)
        launcher.close()
        remove_files(shm_files_glob(job_id))
