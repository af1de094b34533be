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
    (("examples/linear_regression.py",), "linear_regression"),
    (("./run.sh",), "run"),
])
def test_the_job_is_named_after_its_script_or_module(command, name):
    assert spec_of(*command).job_name == name


def test_a_bare_python_becomes_the_python_that_runs_hvdrun():
    launch = spec_of("python", "-m", "mypkg.train", "--lr", "1").launch
    assert launch[launch.index("--") + 1:] == (sys.executable, "-m", "mypkg.train", "--lr", "1")


def test_the_job_python_given_with_venv_runs_the_command_too(tmp_path):
    launch = spec_of("python3", "train.py", venv=str(tmp_path / "venv")).launch
    assert launch[0] == launch[launch.index("--") + 1] == str(tmp_path / "venv" / "bin" / "python")


def test_an_explicit_interpreter_path_is_kept():
    launch = spec_of("/opt/other/bin/python3", "train.py").launch
    assert launch[launch.index("--") + 1:] == ("/opt/other/bin/python3", "train.py")
