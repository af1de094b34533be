"""``hvdrun check``: prove that the hosts of a job can run it, before an allocation is spent.

The hosts come from the same options as a launch (:func:`hvdrun.launch.plan.plan_job`). Every host
is checked at once (:mod:`hvdrun.health.host_checks`; with ``--health`` its node health too,
:mod:`hvdrun.health.node_checks`); when all pass, a real job runs on every slot
(:mod:`hvdrun.health.check_job`) through the plan's launcher. The result is a
:class:`CheckReport`, whose :meth:`CheckReport.to_dict` is the versioned JSON document
(:data:`SCHEMA`, described in ``docs/check-schema.json``).
"""

from __future__ import annotations

import json
import socket
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hvdrun.envvars import CPU_BIND
from hvdrun.health.check_job import RESULT_TAG
from hvdrun.health.host_checks import Check, CheckTarget, Expectations, HostChecker, HostReport
from hvdrun.health.node_checks import HealthOptions, NodeExpectations, node_expectations
from hvdrun.hosts import Host, is_local_host
from hvdrun.launch.job import ssh_options
from hvdrun.launch.plan import JobPlan, RunOptions, plan_job
from hvdrun.measure.capture import run_captured
from hvdrun.measure.timing import human_bytes
from hvdrun.ranks import Slot

SCHEMA = "hvdrun-check/1"
SLOW_LINK_FRACTION = 0.5  # a link below this fraction of the median link is named slow


@dataclass(frozen=True)
class CheckOptions:
    """``hvdrun check``'s own options (the hosts and launcher are in ``run``)."""

    run: RunOptions
    timeout_s: float = 30.0
    min_disk_gb: float = 1.0
    latency_bytes: int = 4 << 10
    bandwidth_bytes: int = 64 << 20
    link_bytes: int = 16 << 20
    health: HealthOptions | None = None  # --health and its options: ask every node about its health too


@dataclass
class JobReport:
    """The real job's outcome: run or skipped, its checks and raw measurements.

    ``blamed``: the hosts its failure is put on (the first failed rank's host, the hosts of ranks whose
    sum was wrong), by the names the job gives them; empty when it passed or no host is to blame.
    """

    ran: bool
    skipped: str | None = None
    error: str | None = None
    checks: list[Check] = field(default_factory=list)
    result: dict[str, Any] | None = None
    blamed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The job ran and every one of its checks passed."""
        return self.ran and self.error is None and all(c.ok for c in self.checks)


@dataclass
class CheckReport:
    """Everything ``hvdrun check`` found."""

    launcher: dict[str, Any]
    hosts: list[HostReport]
    job: JobReport

    @property
    def ok(self) -> bool:
        """Every host check and the job passed."""
        return all(h.ok for h in self.hosts) and self.job.ok

    def failures(self) -> list[tuple[str, Check]]:
        """(where, check) of every failed check, hosts first."""
        found = [(h.host, c) for h in self.hosts for c in h.checks if not c.ok]
        return found + [("job", c) for c in self.job.checks if not c.ok]

    def failed_hosts(self) -> dict[str, list[str]]:
        """Each host to leave out of a run, with the names of the checks it failed: the hosts that failed a
        host check, in rank order, then those the job's failure is put on (:attr:`JobReport.blamed`)."""
        failed = {h.host: [c.name for c in h.checks if not c.ok] for h in self.hosts if not h.ok}
        job_checks = [c.name for c in self.job.checks if not c.ok] or ["allreduce"]
        for host in self.job.blamed:
            failed.setdefault(host, job_checks)
        return failed

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (schema :data:`SCHEMA`)."""
        return {
            "schema": SCHEMA, "ok": self.ok, "launcher": self.launcher,
            "hosts": [{"host": h.host, "ok": h.ok, "via": h.via, "seconds": round(h.seconds, 3),
                       "checks": [asdict(c) for c in h.checks],
                       "facts": _facts_dict(h)} for h in self.hosts],
            "job": {"ran": self.job.ran, "ok": self.job.ok, "skipped": self.job.skipped, "error": self.job.error,
                    "checks": [asdict(c) for c in self.job.checks], "result": self.job.result},
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)


def _facts_dict(report: HostReport) -> dict[str, Any] | None:
    if report.facts is None:
        return None
    facts = report.facts
    return {"hostname": facts.base.hostname, "python": facts.base.python, "executable": facts.base.executable,
            "hvdrun": facts.base.hvdrun, "torch": facts.torch_version, "cpus": facts.base.cpus,
            "gpus": [asdict(g) for g in facts.gpus], "gpu_source": facts.gpu_source,
            "disk_free_bytes": facts.disk_free_bytes, "workdir": facts.workdir,
            **({"node": facts.node.to_dict()} if facts.node is not None else {})}


def plan_check(options: CheckOptions, environ: Mapping[str, str]) -> JobPlan:
    """The job ``check`` would run: the user's hosts and launcher, the check worker as the command.

    Raises:
        UsageError: bad host options (exit code 2), before anything is contacted.
    """
    args = ("--latency-bytes", str(options.latency_bytes), "--bandwidth-bytes", str(options.bandwidth_bytes),
            "--link-bytes", str(options.link_bytes), "--deadline-s", str(int(max(60.0, 6 * options.timeout_s))))
    run = replace(options.run, command=("hvdrun.health.check_job", *args), module=True, prefix_output=True,
                  start_timeout_s=options.run.start_timeout_s or options.timeout_s)
    return plan_job(run, environ)


def check_targets(plan: JobPlan, hosts: Sequence[Host] = ()) -> list[CheckTarget]:
    """Every host of ``plan`` once, in rank order (rank 0's host first), then those of ``hosts`` without ranks (the
    spares), and whether SSH reaches each."""
    everywhere = plan.options.launcher == "ssh"
    ranks = {host.name: 0 for host in hosts}
    for slot in plan.slots:
        ranks[slot.host.name] = slot.local_size
    order: dict[str, Host] = {}
    for host in [*(slot.host for slot in plan.slots), *hosts]:
        order.setdefault(host.name, host)
    return [CheckTarget(host, plan.python_for(host), everywhere or not is_local_host(host.name), ranks[host.name])
            for host in order.values()]


def node_expectations_of(plan: JobPlan, health: HealthOptions, run: RunOptions) -> NodeExpectations:
    """What every node of ``plan`` must show: ``--health``'s options, else the job's interface
    (``--network-interface``), else the cluster file's."""
    from hvdrun.config import load_cluster_config

    config = load_cluster_config(run.cluster, run.config_file)
    job_interface = (run.network_interface, "--network-interface")
    return node_expectations(health, config, plan.layout, job_interface)


def run_check(options: CheckOptions, environ: Mapping[str, str],
              on_host: Callable[[HostReport], None] = lambda r: None,
              on_job: Callable[[str], None] = lambda s: None) -> CheckReport:
    """Check every host, then (when they all pass) run the job; ``on_host``/``on_job`` report progress."""
    plan = plan_check(options, environ)
    run = options.run
    gpus_from = "--gpus-per-node" if run.gpus_per_node is not None else (
        f"gpus_per_node of {run.cluster or run.config_file}")
    expect = replace(Expectations.of_launcher(plan.layout.gpus_per_node, gpus_from, int(options.min_disk_gb * 1e9)),
                     cpu_bind=plan.base_env.get(CPU_BIND, "none"), layout=plan.layout)
    node = node_expectations_of(plan, options.health, run) if options.health is not None else None
    checker = HostChecker(check_targets(plan), plan.cwd, ssh_options(plan), options.timeout_s, expect,
                          plan.options.network_interface, node)
    hosts = checker.run(on_host)
    launcher = {"host": socket.gethostname(), "python": expect.python, "hvdrun": expect.hvdrun, "torch": expect.torch,
                "launcher": plan.launcher, "ranks": len(plan.slots), "interface": interface_of(plan, run)}
    if not all(h.ok for h in hosts):
        bad = ", ".join(h.host for h in hosts if not h.ok)
        return CheckReport(launcher, hosts, JobReport(ran=False, skipped=f"host checks failed on {bad}"))
    on_job(f"running an allreduce on {len(plan.slots)} ranks")
    return CheckReport(launcher, hosts, run_check_job(plan))


def interface_of(plan: JobPlan, run: RunOptions) -> dict[str, str | None]:
    """The interface whose address rank 0 advertises to the other hosts: its name (None: the source address of
    the route to the first other host), where that choice comes from, and its address on this machine."""
    from hvdrun.launch.remote.hostfacts import interface_address

    name = plan.options.network_interface
    if run.network_interface:
        source: str | None = "--network-interface"
    elif name:
        source = f"network_interface of {run.cluster or run.config_file}"
    else:
        source = None
    shown = {"name": name, "from": source, "address": interface_address(name) if name else None}
    return {**shown, "note": plan.notes[0]} if plan.notes else shown


def run_check_job(plan: JobPlan) -> JobReport:
    """Run the check worker on every slot of ``plan`` and judge what rank 0 measured."""
    job = run_captured(plan)
    if job.error:
        return JobReport(ran=True, error=job.error,
                         checks=[Check("allreduce", False, f"a job of {len(plan.slots)} ranks runs", "it failed",
                                       "see the error; run the same hosts with 'hvdrun --verbose' to see the plan")],
                         blamed=(job.host,) if job.host else ())
    results = job.rank0_results(RESULT_TAG)
    if not results:
        return JobReport(ran=True, error="rank 0 printed no result", checks=[])
    return JobReport(ran=True, checks=judge(results[0]), result=results[0],
                     blamed=hosts_of_ranks(plan.slots, results[0]["wrong_ranks"]))


def hosts_of_ranks(slots: Sequence[Slot], ranks: Iterable[int]) -> tuple[str, ...]:
    """The hosts (as the job names them) that ``ranks`` run on, each once, in the order of ``ranks``."""
    return tuple(dict.fromkeys(slots[rank].hostname for rank in ranks))


def judge(result: dict[str, Any]) -> list[Check]:
    """The job's verdicts: a correct sum everywhere, then latency, bandwidth and every ring link."""
    ranks = result["ranks"]
    checks = [Check("allreduce", result["verified"], f"the exact sum on all {ranks} ranks",
                    "exact on every rank" if result["verified"] else f"wrong on ranks {result['wrong_ranks']}",
                    None if result["verified"] else "check the hosts' memory and network (wrong data in transit)"),
              Check("latency", True, f"allreduce of {human_bytes(result['latency_bytes'])}",
                    f"{result['latency_s'] * 1e6:,.1f} us"),
              Check("bandwidth", True, f"allreduce of {human_bytes(result['bandwidth_bytes'])}",
                    f"{result['bus_bandwidth'] / 1e9:.2f} GB/s bus bandwidth "
                    f"({result['bandwidth_s'] * 1e3:,.1f} ms)")]
    links = result["links"]
    if links:
        speeds = [link["bytes"] / link["seconds"] for link in links]
        median = statistics.median(speeds)
        for link, speed in zip(links, speeds, strict=True):
            link["bandwidth"] = speed
            link["slow"] = speed < SLOW_LINK_FRACTION * median
        slow = [f"rank {ln['src']} ({ln['src_host']}) -> rank {ln['dst']} ({ln['dst_host']}): "
                f"{ln['bandwidth'] / 1e9:.2f} GB/s" for ln in links if ln["slow"]]
        checks.append(Check("links", True,
                            f"every ring link within {1 / SLOW_LINK_FRACTION:g}x of the median {median / 1e9:.2f} GB/s",
                            "; ".join(slow) or f"{min(speeds) / 1e9:.2f} .. {max(speeds) / 1e9:.2f} GB/s",
                            "check the slow host's network link (speed, errors, other traffic) or leave it out"
                            if slow else None, warn=bool(slow)))
    return checks
