"""``hvdrun --preflight``: every node of a job proven healthy before its ranks start.

Every host the job may use (spares too) is asked at once, each bounded by :data:`PREFLIGHT_TIMEOUT_S`
(:meth:`hvdrun.health.host_checks.HostChecker.check_nodes`): reached, able to run hvdrun under the ranks'
Python, its GPUs as the cluster file says, and its node health (:mod:`hvdrun.health.node_checks`: the job's
network interface, the cluster file's ``mounts``, free space in the node-local directory, the vendor tools'
verdicts, the clock). Each unhealthy host is named in one line with what failed.

Unhealthy hosts are left out when the others still hold every rank (``--spares K``, or more slots than
``-np``): the job's plan is made again without them, as a restart does (:mod:`hvdrun.launch.restarts`), and
its later restarts never pick them either. Otherwise the job stops before any rank starts
(:class:`hvdrun.errors.LaunchError`, exit code 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hvdrun.config import load_cluster_config
from hvdrun.errors import LaunchError, UsageError
from hvdrun.health.check import check_targets
from hvdrun.health.host_checks import Expectations, HostChecker, HostReport
from hvdrun.health.node_checks import HealthOptions, NodeExpectations, node_expectations
from hvdrun.launch.job import plan_for_attempt, ssh_options
from hvdrun.launch.plan import JobPlan
from hvdrun.ranks import total_slots

PREFLIGHT_TIMEOUT_S = 30.0  # each host's bound: connect, probe (Python, torch, the vendor tools), clock


def preflight(plan: JobPlan, say: Callable[[str], None], timeout_s: float = PREFLIGHT_TIMEOUT_S) -> JobPlan:
    """Check every host of ``plan``, name each unhealthy one through ``say``, and return the plan to run.

    Raises:
        UsageError: an elastic job (its hosts come and go while it runs).
        LaunchError: unhealthy hosts, and the others cannot hold every rank; nothing was started.
    """
    if plan.elastic is not None:
        raise UsageError("--preflight checks the hosts of a job of fixed ranks before they start; an elastic job's "
                         "hosts join while it runs (drop --preflight, or the elastic options)")
    reports = check_nodes(plan, timeout_s)
    unhealthy = {report.host: failure_line(report) for report in reports if not report.ok}
    for host, line in unhealthy.items():
        say(f"hvdrun: preflight: host {host} is unhealthy: {line}")
    if not unhealthy:
        checked = dict.fromkeys(check.name for report in reports for check in report.checks)
        say(f"hvdrun: preflight: {len(reports)} host(s) healthy ({', '.join(checked)})")
    return without_hosts(plan, list(unhealthy), say)


def preflight_expectations(plan: JobPlan) -> NodeExpectations:
    """What every node of ``plan`` must show: the job's network interface, the cluster file's mounts, its node-local
    directory (``--stage-dir``'s where the environment is staged), the GPUs of its layout."""
    options = plan.options
    config = load_cluster_config(options.cluster, options.config_file)
    local_dir = plan.stage.directory if plan.stage is not None else None
    return node_expectations(HealthOptions(local_dir=local_dir), config, plan.layout,
                             (options.network_interface, "the job's network interface"))


def check_nodes(plan: JobPlan, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[HostReport]:
    """Phase 1 of ``hvdrun check`` on every host of ``plan`` (spares too), with node health, without the version
    comparisons."""
    run = plan.options
    gpus_from = "--gpus-per-node" if run.gpus_per_node is not None else (
        f"gpus_per_node of {run.cluster or run.config_file}")
    expect = replace(Expectations.of_launcher(plan.layout.gpus_per_node, gpus_from, 0), layout=plan.layout)
    checker = HostChecker(check_targets(plan, plan.hosts), plan.cwd, ssh_options(plan), timeout_s, expect,
                          run.network_interface, preflight_expectations(plan), versions=False)
    return checker.check_nodes()


def failure_line(report: HostReport) -> str:
    """What ``report``'s host failed, in one line: ``CHECK: FOUND (expected EXPECTED)`` for each failed check."""
    failed = [check for check in report.checks if not check.ok]
    return "; ".join(f"{check.name}: {check.found} (expected {check.expected})" for check in failed) or "no answer"


def without_hosts(plan: JobPlan, unhealthy: Sequence[str], say: Callable[[str], None]) -> JobPlan:
    """``plan`` without the ``unhealthy`` hosts, its ranks on the others in host order (spares last).

    Raises:
        LaunchError: the other hosts cannot hold every rank.
    """
    if not unhealthy:
        return plan
    kept = tuple(host for host in plan.hosts if host.name not in unhealthy)
    named = ", ".join(unhealthy)
    if total_slots(kept) < len(plan.slots):
        raise LaunchError(f"preflight: {len(unhealthy)} unhealthy host(s) ({named}), and the other hosts hold "
                          f"{total_slots(kept)} of the job's {len(plan.slots)} ranks; no rank was started: repair "
                          f"them, leave them out (--exclude-hosts {','.join(unhealthy)}) and lower -np, or hold spare "
                          "hosts back (--spares K)", host=unhealthy[0])
    replanned = replace(plan_for_attempt(plan, kept), hosts=kept)
    running = ", ".join(dict.fromkeys(slot.hostname for slot in replanned.slots))
    say(f"hvdrun: preflight: left out {named}; the job's {len(plan.slots)} ranks run on {running}")
    return replanned
