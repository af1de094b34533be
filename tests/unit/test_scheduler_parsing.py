"""What each back-end reads from its scheduler's output: job ids, states, exit codes, reasons."""

from __future__ import annotations

import json

import pytest

from hvdrun.errors import JobError
from hvdrun.jobs import SCHEDULERS, pbs, scheduler_for, slurm
from hvdrun.jobs.cobalt import Cobalt
from hvdrun.jobs.pbs import Pbs
from hvdrun.jobs.scheduler import FINISHED, HELD, QUEUED, RUNNING, JobStatus
from hvdrun.jobs.slurm import Slurm


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_the_registry_names_each_back_end_by_its_own_kind(kind):
    assert scheduler_for(kind).kind == kind


@pytest.mark.parametrize("stdout, job_id", [
    ("640002.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov\n", "640002.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"),
    ("\n123[].server\n", "123[].server"), ("7\n", "7")])
def test_pbs_job_id(stdout, job_id):
    assert Pbs().parse_job_id(stdout) == job_id


@pytest.mark.parametrize("stdout, job_id", [("42\n", "42"), ("42;cluster2\n", "42"), ("42_3\n", "42_3")])
def test_slurm_job_id(stdout, job_id):
    assert Slurm().parse_job_id(stdout) == job_id


def test_cobalt_job_id_is_the_first_integer_line():
    assert Cobalt().parse_job_id("Job routed to queue \"full-node\".\n400123\n") == "400123"
    with pytest.raises(JobError, match="no Cobalt job id"):
        Cobalt().parse_job_id("oops\n")


def pbs_json(**fields):
    return json.dumps({"Jobs": {"12.server": fields}})


@pytest.mark.parametrize("fields, state, exit_code", [
    ({"job_state": "Q", "comment": "Not Running: x"}, QUEUED, None),
    ({"job_state": "H"}, HELD, None),
    ({"job_state": "R", "exec_host": "a/0*64+b/0*64"}, RUNNING, None),
    ({"job_state": "F", "Exit_status": 0}, FINISHED, 0),
    ({"job_state": "F", "Exit_status": 3}, FINISHED, 3),
    ({"job_state": "F", "Exit_status": 271}, FINISHED, 143),  # killed by SIGTERM
    ({"job_state": "F", "Exit_status": -1}, FINISHED, 1),     # PBS's own failure to start it
])
def test_pbs_states(fields, state, exit_code):
    status = pbs._from_json("12", pbs_json(**fields))
    assert (status.state, status.exit_code) == (state, exit_code)
    assert status.job_id == "12.server"
    if "exec_host" in fields:
        assert status.nodes == "a,b"


def test_pbs_torque_text():
    text = "Job Id:\t2\n\tJob_Name = x\n\tjob_state = C\n\texec_host = n1/1+n2/1\n"
    assert pbs._from_text("2", text) == JobStatus("2", FINISHED, "C", None, None, "n1,n2")


@pytest.mark.parametrize("line, state, exit_code, reason", [
    ("JobId=5 JobState=PENDING Reason=Resources ExitCode=0:0 NodeList=(null)", QUEUED, None, "Resources"),
    ("JobId=5 JobState=RUNNING Reason=None ExitCode=0:0 NodeList=n[1-2]", RUNNING, None, None),
    ("JobId=5 JobState=COMPLETED Reason=None ExitCode=0:0", FINISHED, 0, None),
    ("JobId=5 JobState=FAILED Reason=NonZeroExitCode ExitCode=5:0", FINISHED, 5, "NonZeroExitCode"),
    ("JobId=5 JobState=CANCELLED Reason=None ExitCode=0:15", FINISHED, 143, None),
    ("JobId=5 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:0", FINISHED, 1, "TimeLimit"),
])
def test_slurm_states(line, state, exit_code, reason):
    status = slurm._from_scontrol("5", line)
    assert (status.state, status.exit_code, status.reason) == (state, exit_code, reason)


def test_status_descriptions():
    assert JobStatus("1", QUEUED, "PENDING", reason="Resources").describe() == "QUEUED [PENDING] (Resources)"
    assert JobStatus("1", RUNNING, "R", nodes="a,b").describe() == "RUNNING [R] on a,b"
    assert JobStatus("1", FINISHED, "FINISHED", 0).describe() == "FINISHED, exit code 0"
