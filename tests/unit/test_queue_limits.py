"""Queue limits from the scheduler, then the YAML (hvdrun/jobs/queue_limits.py, the parsers in pbs.py and slurm.py).

Golden samples in golden/queue_limits/: ``scontrol_show_partition.txt`` is real Slurm 22.05 output (the test
cluster of tests/infra/slurm_cluster.sh, with two partitions added by ``scontrol create``);
``qstat_Qf_F_json_*.json`` are in PBS's own JSON as openpbs/openpbs prints it (src/cmds/qstat.c status_que and
prt_attr: resources nested per attribute, values that read as JSON numbers printed as numbers, booleans as the
strings "True"/"False"), once with PBS Pro 2022's printer (src/lib/Libcmds/pbs_json.c before 74106a6a: 4-space
indent, ``"key":value``) for an Aurora-like server, once with OpenPBS 23's cJSON printer (tabs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hvdrun.config import QueueLimits, QueueRoute, SchedulerDefaults
from hvdrun.errors import JobError, UsageError
from hvdrun.jobs import pbs, slurm
from hvdrun.jobs.queue_limits import (
    QueueJob,
    ServerAnswer,
    ServerQueue,
    ServerQueues,
    ask_scheduler,  # the real one: tests/unit/conftest.py patches the module's name only
    decide,
)
from hvdrun.walltime import pbs_duration_s, slurm_duration_s

GOLDEN = Path(__file__).parent / "golden" / "queue_limits"
AURORA_JSON = (GOLDEN / "qstat_Qf_F_json_pbspro2022_aurora.json").read_text()
OPENPBS_JSON = (GOLDEN / "qstat_Qf_F_json_openpbs23.json").read_text()
PARTITIONS = (GOLDEN / "scontrol_show_partition.txt").read_text()
H = 3600
YAML = "/site/aurora.yaml"
AURORA_YAML = SchedulerDefaults(kind="pbs", queues={
    "debug": QueueLimits(min_nodes=1, max_nodes=2, max_walltime_s=1 * H),
    "prod": QueueLimits(min_nodes=256, max_nodes=10624, max_walltime_s=24 * H, routes=(
        QueueRoute("small", 256, 1024, 12 * H), QueueRoute("medium", 1025, 1999, 18 * H),
        QueueRoute("large", 2000, 10624, 24 * H))),
    "capacity": QueueLimits(min_nodes=1, max_nodes=16, max_walltime_s=168 * H),
    "old-queue": QueueLimits(max_nodes=8),
})


# -- parsers ----------------------------------------------------------------------------------------------

def test_pbs_2022_json_of_a_routing_queue_and_its_execution_queues():
    server = pbs.parse_queues(AURORA_JSON)
    assert server.server == "aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"
    assert list(server.queues) == ["debug", "prod", "small", "medium", "large", "capacity"]
    prod = server.queues["prod"]
    assert prod.limits == QueueLimits(min_nodes=256, max_nodes=10624, max_walltime_s=24 * H, routes=(
        QueueRoute("small", 256, 1024, 12 * H), QueueRoute("medium", 1025, 1999, 18 * H),
        QueueRoute("large", 2000, 10624, 24 * H)))
    assert prod.stated == {"min_nodes", "max_nodes", "max_walltime_s", "routes"}
    assert server.queues["debug"].limits == QueueLimits(min_nodes=1, max_nodes=2, max_walltime_s=H)
    assert server.queues["small"].route_only and not server.queues["debug"].route_only
    assert not server.queues["capacity"].enabled and server.queues["debug"].enabled


def test_openpbs_23_json_queues_without_limits_and_remote_destinations():
    server = pbs.parse_queues(OPENPBS_JSON)
    workq = server.queues["workq"]
    assert workq.limits == QueueLimits() and workq.stated == {"routes"}  # states no limit: the YAML's apply
    assert server.queues["routeq"].limits.routes == (
        QueueRoute("shortq", 1, 4, 1800), QueueRoute("longq", 2, None, 72 * H), QueueRoute("farq", 1, None, None))
    assert server.queues["longq"].stated == {"min_nodes", "max_walltime_s", "routes"}


@pytest.mark.parametrize("text, error", [("Unknown option -F\n", "not PBS's JSON"), ('{"Queue": 3}', "no 'Queue'")])
def test_pbs_output_that_is_not_its_queue_json(text, error):
    with pytest.raises(JobError, match=error):
        pbs.parse_queues(text)


@pytest.mark.parametrize("value, seconds", [("06:00:00", 6 * H), ("168:00:00", 168 * H), ("90:00", 5400),
                                            ("45", 45), (3600, H), ("01:00:00.5", H), ("soon", None), (None, None)])
def test_pbs_durations(value, seconds):
    assert pbs_duration_s(value) == seconds


def test_slurm_partitions_of_a_real_scontrol():
    server = slurm.parse_partitions(PARTITIONS)
    assert server.default == "debug" and server.noun == "partition"
    queues = server.queues
    assert queues["debug"].limits == QueueLimits()  # MinNodes=0, MaxNodes=UNLIMITED, MaxTime=UNLIMITED
    assert queues["short"].limits == QueueLimits(max_nodes=1, max_walltime_s=600)
    assert queues["wide"].limits == QueueLimits(min_nodes=2, max_walltime_s=24 * H)
    assert queues["big"].limits == QueueLimits(min_nodes=4, max_nodes=64, max_walltime_s=60 * H)
    assert queues["half"].limits == QueueLimits(max_walltime_s=1800)  # MinNodes=1 is no limit
    assert [name for name, q in queues.items() if not q.enabled] == ["big", "half"]  # INACTIVE, DRAIN


@pytest.mark.parametrize("text, seconds", [("UNLIMITED", None), ("INFINITE", None), ("30", 1800), ("30:00", 1800),
                                           ("01:00:00", H), ("1-00:00:00", 24 * H), ("2-12", 60 * H),
                                           ("2-12:30", 60 * H + 1800), ("", None)])
def test_slurm_times(text, seconds):
    assert slurm_duration_s(text) == seconds


def test_slurm_output_without_partitions():
    with pytest.raises(JobError, match="no 'PartitionName=' line"):
        slurm.parse_partitions("slurm_load_partitions error: Unable to contact slurm controller\n")


# -- the decision -----------------------------------------------------------------------------------------

def job(queue, nodes=1, walltime_s=None, defaults=AURORA_YAML, cluster="aurora", source=YAML):
    return QueueJob(queue, nodes, walltime_s, cluster, defaults, source)


def aurora(**changes: dict[str, object]) -> ServerAnswer:
    """The Aurora-like server's answer, with some queues' attributes changed as ``qmgr`` would."""
    document = json.loads(AURORA_JSON)
    for name, attributes in changes.items():
        queue = document["Queue"].setdefault(name, {"queue_type": "Execution", "enabled": "True"})
        for key, value in attributes.items():
            group, _, resource = key.partition(".")
            queue.setdefault(group, {})[resource] = value
    return ServerAnswer(pbs.parse_queues(json.dumps(document, indent=4, separators=(",", ":"))))


def refused(queue_job, answer) -> str:
    with pytest.raises(UsageError) as error:
        decide(queue_job, answer)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_without_an_answer_the_yaml_decides_as_before():
    assert refused(job("debug", nodes=3), ServerAnswer()) == "-n/--nodes 3: queue 'debug' on aurora takes 1 to 2 nodes"
    assert decide(job("debug"), ServerAnswer()).notices == ()


def test_the_server_refuses_where_the_yaml_would_allow_and_says_so():
    answer = aurora(small={"resources_max.walltime": "06:00:00"})
    assert refused(job("prod", nodes=300, walltime_s=8 * H), answer) == (
        "-t/--walltime 08:00:00: queue 'prod' on aurora (from the PBS server: qstat -Qf -F json) sends 300 nodes to "
        f"'small' (256-1024 nodes), which allows at most 06:00:00; the YAML ({YAML}) would allow it")


def test_both_refuse_with_different_limits():
    answer = aurora(debug={"resources_max.nodect": 4})
    assert refused(job("debug", nodes=5), answer) == (
        "-n/--nodes 5: queue 'debug' on aurora (from the PBS server: qstat -Qf -F json) takes 1 to 4 nodes; "
        f"the YAML ({YAML}) says it takes 1 to 2 nodes")


def test_the_server_accepts_what_the_yaml_refuses_with_a_notice():
    answer = aurora(debug={"resources_max.nodect": 4})
    decision = decide(job("debug", nodes=3), answer)
    assert decision.notices == (f"queue 'debug' on aurora: the PBS server (qstat -Qf -F json) accepts -n/--nodes 3, "
                                f"which the YAML ({YAML}) refuses (it takes 1 to 2 nodes); the server decided",)
    assert decision.limits == QueueLimits(1, 4, H)


def test_limits_that_differ_where_the_job_fits_both_are_a_notice():
    answer = aurora(small={"resources_max.walltime": "06:00:00"})
    notices = decide(job("prod", nodes=300, walltime_s=5 * H), answer).notices
    assert notices == (f"queue 'prod' on aurora: the PBS server (qstat -Qf -F json) states 'small' (256-1024 nodes, "
                       f"at most 06:00:00); the YAML ({YAML}) says 'small' (256-1024 nodes, at most 12:00:00); the "
                       "server's limits decided",)
    assert decide(job("prod", nodes=300, walltime_s=5 * H), aurora()).notices == ()  # they agree: quiet


def test_a_queue_the_server_does_not_have_lists_its_queues():
    assert refused(job("old-queue"), aurora()) == (
        "-q/--queue 'old-queue': the PBS server (qstat -Qf -F json) has no queue 'old-queue'; its queues: debug, "
        f"prod, capacity (the YAML {YAML} lists it: it is stale)")


def test_a_queue_only_the_server_has_is_checked_against_the_server():
    answer = aurora(new={"resources_max.nodect": 8})
    assert "takes 1 to 8 nodes" in refused(job("new", nodes=9), answer)
    assert decide(job("new", nodes=2), answer).notices == (
        f"-q/--queue 'new' is not among the queues of the YAML ({YAML}), but the PBS server (qstat -Qf -F json) has "
        "it: the server decided",)


def test_route_only_and_disabled_queues():
    assert refused(job("small", nodes=300), aurora()).endswith("takes jobs only from a routing queue; submit to prod")
    assert refused(job("capacity"), aurora()) == (
        "-q/--queue 'capacity': queue 'capacity' on aurora (from the PBS server: qstat -Qf -F json) is not enabled: "
        "it accepts no jobs now")


def test_a_limit_the_server_does_not_state_is_the_yamls_and_named_so():
    sophia = SchedulerDefaults(kind="pbs", max_walltime_s=12 * H,
                               queues={"by-gpu": QueueLimits(nodes_allowed=(1, 2, 4, 8), unit="gpus")})
    answer = ServerAnswer(ServerQueues("the PBS server", "qstat -Qf -F json",
                                       {"by-gpu": ServerQueue("by-gpu", QueueLimits(), frozenset({"routes"}))}))
    by_gpu = job("by-gpu", nodes=3, defaults=sophia, cluster="sophia", source="/site/sophia.yaml")
    assert refused(by_gpu, answer) == ("-n/--nodes 3: queue 'by-gpu' on sophia (from the YAML: /site/sophia.yaml) "
                                       "takes 1 2 4 8 gpus")
    long = job("by-gpu", nodes=2, walltime_s=13 * H, defaults=sophia, cluster="sophia", source="/site/sophia.yaml")
    assert "sophia (from the YAML: /site/sophia.yaml) runs no job longer than 12:00:00" in refused(long, answer)
    assert decide(job("by-gpu", nodes=2, defaults=sophia, cluster="sophia"), answer).limits.unit == "gpus"


def test_a_server_node_count_says_nothing_of_a_queue_the_yaml_counts_in_gpus():
    """Sophia's by-gpu: -n counts GPUs on one node, so a server's resources_max.nodect=1 refuses no -n 8."""
    sophia = SchedulerDefaults(kind="pbs", queues={"by-gpu": QueueLimits(nodes_allowed=(1, 2, 4, 8), unit="gpus")})
    answer = ServerAnswer(ServerQueues("the PBS server", "qstat -Qf -F json", {"by-gpu": ServerQueue(
        "by-gpu", QueueLimits(min_nodes=1, max_nodes=1), frozenset({"min_nodes", "max_nodes"}))}))
    assert decide(job("by-gpu", nodes=8, defaults=sophia, cluster="sophia"), answer).limits.max_nodes is None


def test_a_routing_queue_takes_the_first_destination_that_accepts_nodes_and_walltime():
    routes = (QueueRoute("small", 10, 24, 3 * H), QueueRoute("backfill-small", 10, 24, 6 * H))
    answer = ServerAnswer(ServerQueues("the PBS server", "qstat -Qf -F json",
                                       {"prod": ServerQueue("prod", QueueLimits(routes=routes))}))
    no_yaml = SchedulerDefaults(kind="pbs")
    assert decide(job("prod", nodes=10, walltime_s=5 * H, defaults=no_yaml, source=None), answer).notices == ()
    assert "sends 10 nodes to 'small' (10-24 nodes), which allows at most 03:00:00" in refused(
        job("prod", nodes=10, walltime_s=7 * H, defaults=no_yaml, source=None), answer)
    assert "routes no job of that size (its queues: small 10-24, backfill-small 10-24)" in refused(
        job("prod", nodes=30, defaults=no_yaml, source=None), answer)


def test_slurms_default_partition_decides_a_job_without_a_queue():
    server = slurm.parse_partitions(PARTITIONS.replace("Default=YES", "Default=NO").replace(
        "PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO",
        "PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES"))
    plain = job(None, nodes=2, defaults=SchedulerDefaults(kind="slurm"), cluster="slurm", source=None)
    assert refused(plain, ServerAnswer(server)) == ("-n/--nodes 2: queue 'short' (the default) on slurm (from the "
                                                    "Slurm controller: scontrol show partition) takes exactly 1 node")


def test_a_server_that_names_another_machine_is_not_believed():
    answer = ServerAnswer(ServerQueues("the PBS server", "qstat -Qf -F json", {}, server="polaris-pbs-01.hsn.cm."
                                       "polaris.alcf.anl.gov"))
    decision = decide(job("debug"), answer)
    assert decision.notices == ("the PBS server here (polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov) is not aurora's: "
                                f"queue limits come from the YAML ({YAML}) only",)
    assert decision.limits == AURORA_YAML.queues["debug"]
    elsewhere = ServerAnswer(ServerQueues("the PBS server", "qstat -Qf -F json", {}, server="pbs01.example.org"))
    mine = job("debug", cluster="mycluster")  # a site of its own: its server is believed
    assert "has no queue 'debug'" in refused(mine, elsewhere)


def test_a_server_that_did_not_answer_leaves_the_yaml_with_a_notice():
    decision = decide(job("debug"), ServerAnswer(problem="'qstat -Q -f -F json' did not answer within 5 s"))
    assert decision.notices == ("could not ask the scheduler for queue limits ('qstat -Q -f -F json' did not answer "
                                f"within 5 s); checked against the YAML ({YAML}) only",)


# -- asking -----------------------------------------------------------------------------------------------

@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    """An empty directory that is all of PATH; ``add(name, body)`` puts a shell script there."""
    monkeypatch.setenv("PATH", str(tmp_path))

    def add(name: str, body: str) -> None:
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)

    return add


def test_nothing_is_asked_without_the_command_or_without_a_queue(bin_dir):
    assert ask_scheduler("pbs", "debug") == ServerAnswer()
    bin_dir("qstat", "echo asked >&2; exit 1")
    assert ask_scheduler("pbs", None) == ServerAnswer()  # PBS's answer names no default queue
    assert ask_scheduler("cobalt", "full-node") == ServerAnswer()  # Cobalt is not asked


def test_an_answer_through_the_scheduler_command(bin_dir, tmp_path):
    (tmp_path / "answer.json").write_text(AURORA_JSON)
    bin_dir("qstat", f'[ "$*" = "-Q -f -F json" ] && exec /bin/cat {tmp_path / "answer.json"}; exit 2')
    answer = ask_scheduler("pbs", "prod")
    assert answer.problem is None and answer.queues is not None and "prod" in answer.queues.queues


@pytest.mark.parametrize("body, problem", [
    ("echo 'qstat: cannot connect to server pbs01 (errno=15010)' >&2; exit 1",
     "'qstat -Q -f -F json' failed with exit code 1: qstat: cannot connect to server pbs01 (errno=15010)"),
    ("echo 'Unknown option: F'; exit 0", "qstat -Qf -F json printed something that is not PBS's JSON"),
    ("exec /bin/sleep 30", "'qstat -Q -f -F json' did not answer within 0.3 s"),
])
def test_a_server_that_fails_is_one_line(bin_dir, body, problem):
    bin_dir("qstat", body)
    answer = ask_scheduler("pbs", "debug", timeout_s=0.3)
    assert answer.queues is None and answer.problem is not None and answer.problem.startswith(problem)
    assert "\n" not in answer.problem


def test_slurm_is_asked_for_every_partition_even_without_a_queue(bin_dir, tmp_path):
    (tmp_path / "partitions.txt").write_text(PARTITIONS)
    bin_dir("scontrol", f'[ "$*" = "--all --oneliner show partition" ] && exec /bin/cat {tmp_path / "partitions.txt"}; '
                        "exit 2")
    answer = ask_scheduler("slurm", None)
    assert answer.queues is not None and answer.queues.default == "debug"
    assert os.environ["PATH"] == str(tmp_path)
