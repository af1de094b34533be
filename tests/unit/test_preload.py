"""What the preload imports, and when a rank may start by fork (``launch/remote/preload.py``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from hvdrun.envvars import PRELOAD
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.remote import preload
from hvdrun.launch.remote.inprocess import PythonCommand, parse_python_command
from hvdrun.launch.remote.preload import choose_modules, rank_source

TRAIN = "import torch\nimport hvdrun.torch as hvd\nopt = hvd.DistributedOptimizer(torch.optim.SGD([], lr=1))\n"


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "train.py", "--lr", "1"], PythonCommand("script", "train.py", ("--lr", "1"), False)),
    (["python", "-u", "-m", "pkg.mod", "-x"], PythonCommand("module", "pkg.mod", ("-x",), True)),
    (["python", "-c", "print(1)", "a"], PythonCommand("code", "print(1)", ("a",), False)),
    (["python", "-O", "train.py"], "interpreter option -O"),
    (["python", "-X", "importtime", "train.py"], "interpreter option -X"),
    (["python", "-m"], "-m without a value"),
    (["python", "-u"], "no script"),
])
def test_the_commands_a_preloaded_rank_can_run_and_why_others_cannot(command, expected):
    assert parse_python_command(command) == expected


@pytest.mark.parametrize(("choice", "source", "expected"), [
    ("auto", TRAIN, ("torch", "torch._dynamo", "hvdrun.torch")),
    ("auto", "import torch.distributed as dist\ndist.init_process_group('gloo')\n", ("torch",)),
    ("auto", "def main():\n    import hvdrun.torch as hvd\n", ("torch", "hvdrun.torch")),
    ("auto", "from horovod.torch import allreduce\n", ("torch", "hvdrun.torch")),
    ("auto", "import os\nprint('torch is not imported here')\n", ()),
    ("auto", None, ()),
    ("none", TRAIN, ()),
    ("numpy, torch", None, ("numpy", "torch")),
])
def test_auto_preloads_torch_only_for_scripts_that_import_it(choice, source, expected):
    assert choose_modules(choice, source) == expected


def test_the_source_of_a_script_a_python_command_a_module_and_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "job.py").write_text("import torch\n")
    assert rank_source(["train.py", "--epochs", "1"]) == TRAIN
    assert rank_source([sys.executable, "-u", "train.py"]) == TRAIN
    assert rank_source(["pkg.job"], module=True) == "import torch\n"
    assert rank_source(["python3", "-m", "pkg.job"]) == "import torch\n"
    assert rank_source(["python", "-c", "import torch"]) == "import torch"
    assert rank_source(["hostname"]) is None and rank_source(["missing.py"]) is None
    assert "pkg" not in sys.modules  # looked up, never imported


def test_only_variables_read_after_start_up_may_differ_from_the_preloads():
    imported_under = {"PATH": "/bin", "OMP_PROC_BIND": "close", "RANK": "0", "CUDA_VISIBLE_DEVICES": "0",
                      "HVDRUN_RANK": "0", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
    rank = {**imported_under, "RANK": "3", "CUDA_VISIBLE_DEVICES": "3", "HVDRUN_RANK": "3", "NCCL_DEBUG": "WARN",
            "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_PORT": "29500", "PYTHONUNBUFFERED": "0"}
    assert preload.environment_difference(rank, imported_under) == []
    changed = {**rank, "OMP_PROC_BIND": "spread", "LD_PRELOAD": "/lib/x.so", "PYTHONPATH": "/src",
               "OMP_NUM_THREADS": "2"}  # numpy's BLAS, imported with torch, read it at its load
    assert preload.environment_difference(changed, imported_under) == ["LD_PRELOAD", "OMP_NUM_THREADS",
                                                                       "OMP_PROC_BIND", "PYTHONPATH"]


def test_what_the_loader_and_interpreter_read_at_start_is_compared_with_the_servers_own_start():
    started_under = {"LANG": "C.UTF-8", "PYTHONPATH": "/src"}  # the fork server's (hvdrun's, or sshd's) start
    rank = {"PATH": "/bin", "LANG": "C.UTF-8", "PYTHONPATH": "/src", "LD_PRELOAD": "libjemalloc.so"}
    imported_under = dict(rank)  # `-x LD_PRELOAD=...`: every rank, and the preload's request, have it
    assert preload.environment_difference(rank, imported_under, started_under) == ["LD_PRELOAD"]
    assert preload.environment_difference({**rank, "LD_PRELOAD": ""}, {**imported_under, "LD_PRELOAD": ""},
                                          {**started_under, "LD_PRELOAD": ""}) == []


@pytest.fixture
def preloaded(monkeypatch):
    """This process as if it had preloaded torch under its own environment."""
    environ = dict(os.environ)
    monkeypatch.setattr(preload, "_preloaded", preload.Preloaded(("torch",), environ))
    return environ


def test_a_fork_that_torch_marked_bad_for_gpus_starts_a_new_interpreter(preloaded, tmp_path, monkeypatch):
    """What a preloaded module that called torch.cuda.device_count() leaves on a CUDA build of torch (seen with
    torch 2.13.0+cu130 on a machine without a driver: every forked rank's _is_in_bad_fork() was True); the CPU
    build used here never marks a fork, so the flag is set as torch would set it."""
    import torch

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    assert isinstance(preload.why_not([sys.executable, str(script)], preloaded, bound=False), PythonCommand)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert preload.why_not([sys.executable, str(script)], preloaded, bound=False) == (
        "the preloaded modules queried torch.cuda before the fork (a forked rank could not use its GPU)")


def test_a_rank_forks_only_when_nothing_its_interpreter_decides_at_start_differs(preloaded, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    python = sys.executable
    assert preload.why_not([python, "-u", str(script)], preloaded, bound=False) == PythonCommand(
        "script", str(script), (), True)
    assert preload.why_not(["/usr/bin/env", str(script)], preloaded, bound=False).endswith(f"is not {python}")
    assert preload.why_not([python, "-O", str(script)], preloaded, bound=False) == "interpreter option -O"
    different = preload.why_not([python, str(script)], {**preloaded, "LD_PRELOAD": "x.so"}, bound=False)
    assert different == "environment differs from the preload's: LD_PRELOAD"
    binding = {**preloaded, "OMP_PLACES": "cores"}
    monkeypatch.setattr(preload, "_preloaded", preload.Preloaded(("torch",), binding))
    assert preload.why_not([python, str(script)], binding, bound=False) == PythonCommand("script", str(script), (),
                                                                                         False)
    assert "OpenMP binding" in preload.why_not([python, str(script)], binding, bound=True)
    assert preload.why_not([python, "gone.py"], binding, bound=False).startswith("gone.py is not a Python source")
    (tmp_path / "torch.py").write_text("")  # python would import this one, not the preloaded torch
    assert preload.why_not([python, str(script)], binding, bound=False) == (
        f"{tmp_path / 'torch.py'} beside the rank's code would shadow a module already imported here")
    (tmp_path / "torch.py").unlink()
    (tmp_path / "app.pyz").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip archive: a zipapp's shape
    (tmp_path / "cached.pyc").write_bytes(importlib.util.MAGIC_NUMBER + b"\0" * 12)
    for other in ("app.pyz", "cached.pyc", "."):
        assert "is not a Python source file" in preload.why_not([python, other], binding, bound=False)
    monkeypatch.setitem(sys.modules, "sitecustomize", type(sys)("sitecustomize"))
    assert "sitecustomize" in preload.why_not([python, str(script)], binding, bound=False)


def test_nothing_preloaded_means_every_rank_starts_a_new_interpreter(monkeypatch):
    monkeypatch.setattr(preload, "_preloaded", None)
    assert preload.why_not([sys.executable, "train.py"], dict(os.environ), bound=False) == "nothing preloaded"


def test_the_plan_names_the_modules_for_the_ranks_and_drops_an_inherited_choice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(TRAIN)
    Path("other.py").write_text("print('no torch')\n")
    inherited = {**os.environ, PRELOAD: "numpy"}  # an hvdrun started inside a rank

    def modules(command: str, choice: str = "auto") -> str | None:
        options = RunOptions(command=(command,), num_proc=1, hosts="localhost:1", preload=choice)
        return plan_job(options, inherited).base_env.get(PRELOAD)

    assert modules("train.py") == "torch,torch._dynamo,hvdrun.torch"
    assert modules("other.py") is None
    assert modules("train.py", "none") is None
    assert modules("other.py", "torch") == "torch"


@pytest.fixture
def fresh_preload(monkeypatch):
    """preload() as in a new fork server: nothing tried yet."""
    monkeypatch.setattr(preload, "_tried", False)
    monkeypatch.setattr(preload, "_preloaded", None)
    return preload


def test_the_fork_server_imports_once_under_the_ranks_environment(fresh_preload, monkeypatch):
    environ = {**os.environ, PRELOAD: "json,email.utils", "ONLY_IN_THE_RANKS": "1"}
    fresh_preload.preload(environ)
    assert fresh_preload._preloaded == preload.Preloaded(("json", "email.utils"), environ)
    assert "ONLY_IN_THE_RANKS" not in os.environ  # the server's own environment is given back
    fresh_preload.preload({**environ, PRELOAD: "csv"})
    assert fresh_preload._preloaded.modules == ("json", "email.utils")  # once per server


@pytest.mark.parametrize("change", ["a module that fails", "another PYTHONPATH", "CUDA started"])
def test_nothing_is_preloaded_when_a_forked_rank_could_not_be_what_a_new_one_is(fresh_preload, monkeypatch, change):
    environ = {**os.environ, PRELOAD: "json"}
    if change == "a module that fails":
        environ[PRELOAD] = "json,no_such_module_here"
    elif change == "another PYTHONPATH":
        environ["PYTHONPATH"] = "/elsewhere"
    else:
        class Runtime:
            @staticmethod
            def is_initialized() -> bool:
                return True

        monkeypatch.setitem(sys.modules, "torch", type(sys)("torch"))
        sys.modules["torch"].cuda = Runtime  # type: ignore[attr-defined]
    fresh_preload.preload(environ)
    assert fresh_preload._preloaded is None


def test_a_server_forked_by_a_zygote_compares_each_rank_with_what_the_zygote_imported_under(fresh_preload,
                                                                                           tmp_path, monkeypatch):
    imported_under = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh_preload.adopt(("json",), imported_under)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    fresh_preload.preload({**imported_under, PRELOAD: "json,colorsys"})  # the job's first request: what is missing
    assert "colorsys" in sys.modules
    assert fresh_preload._preloaded == preload.Preloaded(("json", "colorsys"), imported_under)
    fresh_preload.preload({**imported_under, PRELOAD: "json,colorsys,csv"})  # once per server
    assert fresh_preload._preloaded == preload.Preloaded(("json", "colorsys"), imported_under)
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    command = [sys.executable, str(script)]
    rank = {**imported_under, "HVDRUN_RANK": "3", "ROLE_NAME": "default", "MASTER_PORT": "29500"}
    assert isinstance(fresh_preload.why_not(command, rank, bound=False), PythonCommand)  # only late variables
    assert fresh_preload.why_not(command, {**rank, "OMP_NUM_THREADS": "2"}, bound=False) == \
        "environment differs from the preload's: OMP_NUM_THREADS"  # read when torch's thread pools load
