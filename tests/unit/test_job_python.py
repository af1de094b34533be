"""A job script's bare ``python`` is the Python that runs hvdrun, and the job is named after what it runs."""

from __future__ import annotations

import sys

import pytest

from hvdrun.jobs.spec import JobRequest, build_spec, is_python

WORKDIR = "/home/me/run"  # the scripts are looked up in the working directory: run from the checkout


def spec_of(*command: str, **fields):
    return build_spec(JobRequest(command=command, scheduler="slurm", **fields), now=0, workdir=WORKDIR)


@pytest.mark.parametrize("word, expected", [("python", True), ("python3", True), ("python3.12", True),
                                            ("/usr/bin/python3", False), ("pythonista", False), ("ipython", False)])
def test_what_counts_as_a_bare_python(word, expected):
    assert is_python(word) is expected


@pytest.mark.parametrize("command, name", [
    (("python", "train.py", "--lr", "1"), "train"),
    (("python3", "-u", "/abs/dir/train_gpt.py"), "train_gpt"),
    (("python", "-m", "mypkg.train", "--epochs", "2"), "mypkg.train"),
    (("python", "-c", "print(1)"), "job"),
    (("python", "-W", "ignore", "train.py"), "train"),
    (("examples/linear_regression.py",), "linear_regression"),
    (("./run.sh",), "run"),
])
def test_the_job_is_named_after_its_script_or_module(command, name):
    assert spec_of(*command).job_name == name


def hvdrun_line(*command: str, **fields) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the job's hvdrun and its options, the COMMAND it runs)."""
    launch = spec_of(*command, **fields).launch
    return launch[:launch.index("--")], launch[launch.index("--") + 1:]


def test_a_bare_python_script_is_run_by_hvdrun_with_its_own_python():
    """hvdrun runs a .py COMMAND with its Python (or a host's python:, or the --stage-env copy)."""
    hvdrun, command = hvdrun_line("python", "train.py", "--lr", "1")
    assert hvdrun[0] == sys.executable and command == ("train.py", "--lr", "1")


def test_a_bare_python_module_is_hvdruns_module():
    hvdrun, command = hvdrun_line("python", "-m", "mypkg.train", "--lr", "1")
    assert hvdrun[-1] == "--module" and command == ("mypkg.train", "--lr", "1")


def test_a_bare_python_with_its_own_options_becomes_the_jobs_python(tmp_path):
    hvdrun, command = hvdrun_line("python3", "-X", "importtime", "train.py", venv=str(tmp_path / "venv"))
    assert hvdrun[0] == command[0] == str(tmp_path / "venv" / "bin" / "python")
    assert command[1:] == ("-X", "importtime", "train.py")


def test_an_explicit_interpreter_path_is_kept():
    assert hvdrun_line("/opt/other/bin/python3", "train.py")[1] == ("/opt/other/bin/python3", "train.py")
