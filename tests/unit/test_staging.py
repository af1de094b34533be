"""Environment staging (hvdrun/launch/staging.py, stage_unpack.py): fingerprints, the plan's checks, and the unpack
line's marker logic, run for real in ``sh`` (no launcher, no ranks)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from hvdrun.config import load_config
from hvdrun.errors import ConfigError, UsageError
from hvdrun.hosts import Host
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.stage_tree import TreeReport
from hvdrun.launch.stage_unpack import MARKER, Environment, HostStaged, unpack_command, unpack_failure
from hvdrun.launch.staging import (
    StagePlan,
    ThisMachine,
    check_stage_dir,
    describe,
    find_environment,
    fingerprint,
    stage,
    staged_env,
)
from tests.conftest import wait_until


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A fake environment: pyvenv.cfg, bin/python, one site-packages entry (nothing runs it)."""
    prefix = tmp_path / "env"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python").write_text("#!/bin/sh\n")
    (prefix / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (prefix / "lib" / "python3.11" / "site-packages" / "pkg").mkdir(parents=True)
    (prefix / "lib" / "python3.11" / "site-packages" / "pkg" / "__init__.py").write_text("X = 1\n")
    return prefix


def test_fingerprint_changes_when_a_package_is_installed_or_the_env_moves(venv, tmp_path):
    first = fingerprint(venv)
    assert first == fingerprint(venv) and len(first) == 12
    (venv / "lib" / "python3.11" / "site-packages" / "newpkg-1.0.dist-info").mkdir()
    second = fingerprint(venv)
    assert second != first
    moved = tmp_path / "moved"
    venv.rename(moved)
    assert fingerprint(moved) != second


def test_find_environment_of_a_venv_and_of_no_environment(venv, tmp_path):
    environment = find_environment(str(venv / "bin" / "python"))
    assert environment.prefix == str(venv) and environment.relative_python == "bin/python"
    (tmp_path / "plain" / "bin").mkdir(parents=True)
    (tmp_path / "plain" / "bin" / "python").write_text("")
    with pytest.raises(UsageError, match="is in neither .no pyvenv.cfg or conda-meta/"):
        find_environment(str(tmp_path / "plain" / "bin" / "python"))
    with pytest.raises(UsageError, match="is not here"):
        find_environment("/nowhere/bin/python")
    (tmp_path / "conda" / "bin").mkdir(parents=True)
    (tmp_path / "conda" / "conda-meta").mkdir()
    (tmp_path / "conda" / "bin" / "python").write_text("")
    assert find_environment(str(tmp_path / "conda" / "bin" / "python")).prefix == str(tmp_path / "conda")


@pytest.mark.parametrize("given, expected", [("/tmp/", "/tmp"), ("/local/scratch", "/local/scratch"), ("/", "/")])
def test_stage_dir_must_be_absolute(given, expected):
    assert check_stage_dir(given, "--stage-dir") == expected


@pytest.mark.parametrize("given", ["tmp", "./x", "", "/a\nb"])
def test_a_relative_stage_dir_is_a_usage_error(given):
    with pytest.raises(UsageError, match="expected an absolute path"):
        check_stage_dir(given, "--stage-dir")


def test_staged_env_puts_the_copy_first():
    env = staged_env("/tmp/hvdrun-0/env-ab/bin/python", {"PATH": "/usr/bin", "VIRTUAL_ENV": "/work/venv"})
    assert env == {"PATH": "/tmp/hvdrun-0/env-ab/bin:/usr/bin", "VIRTUAL_ENV": "/tmp/hvdrun-0/env-ab"}
    assert staged_env("/c/bin/python", {}) == {"PATH": "/c/bin"}


def test_describe_says_what_was_done():
    environment = Environment("/w/env/bin/python", "/w/env", "abc")
    copy, python = "/tmp/hvdrun-0/env-abc", "/tmp/hvdrun-0/env-abc/bin/python"
    made = HostStaged("h1", copy, python, 2_500_000_000, 3.0, "tree")
    had = HostStaged("h2", copy, python)
    tree = TreeReport([made, had], "h1", 2_400_000_000, 4, 0)
    assert describe([made, had], [environment], 3.2, [tree]) == (
        "hvdrun: --stage-env: staged /w/env on 1 host in 3.2 s (2.5 GB each: read once by h1 (2.4 GB from the "
        "source), then host to host to 1 host, fan-out 4, depth 0), already staged on 1 host; the ranks run from "
        "/tmp/hvdrun-0/env-abc")
    here = HostStaged("this machine", copy, python, 2_500_000_000, 9.0, "copy")
    sent = TreeReport([made, made, made], None, 2_400_000_000, 2, 1)
    assert "(2.5 GB each: copied here; sent once by hvdrun (2.4 GB from the source), then host to host to 3 hosts, " \
        "fan-out 2, depth 1)" in describe([here, made, made, made], [environment], 9.1, [sent])
    assert describe([had, had], [environment], 0.1) == (
        "hvdrun: --stage-env: /w/env already staged on 2 hosts (/tmp/hvdrun-0/env-abc)")


# -- the plan ------------------------------------------------------------------------------------------------

def _plan(tmp_path, venv, **options):
    (tmp_path / "train.py").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"python: {venv}/bin/python\n{options.pop('yaml', '')}")
    return plan_job(RunOptions(command=("train.py",), num_proc=2, config_file=str(config), **options), os.environ)


def test_the_plan_stages_the_hosts_python_under_the_chosen_dir(tmp_path, venv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _plan(tmp_path, venv).stage is None
    plan = _plan(tmp_path, venv, stage_env=True)
    assert plan.stage.directory == "/tmp" and list(plan.stage.environments) == [f"{venv}/bin/python"]
    assert _plan(tmp_path, venv, stage_env=True, yaml="local_dir: /local/scratch\n").stage.directory == \
        "/local/scratch"
    assert _plan(tmp_path, venv, stage_dir="/x/", yaml="local_dir: /local/scratch\n").stage.directory == "/x"


@pytest.mark.parametrize("options, fragment", [
    (dict(stage_env=True, min_np=1), "an elastic job's hosts join while it runs"),
    (dict(stage_dir="scratch"), "--stage-dir 'scratch': expected an absolute path"),
])
def test_the_plan_refuses(tmp_path, venv, monkeypatch, options, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=fragment.replace("(", ".").replace(")", ".")):
        _plan(tmp_path, venv, **options)


def test_local_dir_in_the_yaml_must_be_absolute(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("local_dir: scratch\n")
    with pytest.raises(ConfigError, match="'local_dir' must be an absolute path"):
        load_config(path)
    path.write_text("local_dir: /local/scratch\n")
    assert load_config(path).local_dir == "/local/scratch"


# -- the unpack line, in a real sh ------------------------------------------------------------------------------

def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _stream(data: bytes, kib: int = 1) -> bytes:
    """What a host's relay writes to its unpack line: the space needed, then the tar stream."""
    return f"{kib} 0 -\n".encode() + data


def _unpack(directory: Path, stdin: bytes, fp: str = "f00d") -> subprocess.CompletedProcess[str]:
    environment = Environment("/unused/bin/python", "/unused", fp)
    return subprocess.run(unpack_command(str(directory), environment), input=stdin, capture_output=True,
                          timeout=30, check=False)


def _lines(done: subprocess.CompletedProcess) -> list[str]:
    return done.stdout.decode().split("\n")


def test_unpack_then_have_then_redo_a_copy_without_marker(tmp_path):
    stream = _tar({"bin/python": b"#!\n", "lib/x.py": b"X = 1\n"})
    copy = tmp_path / f"hvdrun-{os.getuid()}" / "env-f00d"
    first = _unpack(tmp_path, _stream(stream))
    assert first.returncode == 0, first.stderr
    assert _lines(first)[:3] == [f"NEED {copy}", "STREAM", f"DONE {copy} 1"]
    assert (copy / MARKER).exists() and (copy / "lib" / "x.py").read_text() == "X = 1\n"
    assert oct((copy.parent).stat().st_mode & 0o777) == "0o700"
    assert _lines(_unpack(tmp_path, b""))[0] == f"HAVE {copy}"
    (copy / MARKER).unlink()  # a copy whose unpack was cut short: redone, its leftovers gone
    (copy / "leftover").write_text("")
    (copy.parent / ".env-f00d.partial.12345").mkdir()  # a killed job's unpack in progress
    again = _unpack(tmp_path, _stream(stream))
    assert _lines(again)[0] == f"NEED {copy}" and again.returncode == 0
    assert not (copy / "leftover").exists() and (copy / MARKER).exists()
    assert sorted(p.name for p in copy.parent.iterdir()) == [".env-f00d.lock", "env-f00d"]


def test_a_remote_host_answers_stream_and_reads_the_tar_from_stdin(tmp_path):
    copy = tmp_path / "stage" / f"hvdrun-{os.getuid()}" / "env-f00d"
    taken = _unpack(tmp_path / "stage", _stream(_tar({"from-stream": b"2"})))
    assert _lines(taken)[:2] == [f"NEED {copy}", "STREAM"] and (copy / "from-stream").exists(), taken.stderr


def test_a_truncated_stream_leaves_no_copy(tmp_path):
    done = _unpack(tmp_path, _stream(_tar({"a": b"x" * 5000})[:1024]))
    assert done.returncode == 4 and "tar" in done.stderr.decode()
    assert [p.name for p in (tmp_path / f"hvdrun-{os.getuid()}").iterdir()] == [".env-f00d.lock"]


def test_not_enough_space_is_said_before_unpacking(tmp_path):
    done = _unpack(tmp_path, _stream(_tar({"a": b"x"}), kib=2 ** 50))
    assert done.returncode == 5 and "KiB free" in done.stderr.decode()


def test_an_unusable_dir_exits_3(tmp_path):
    (tmp_path / "file").write_text("")
    done = _unpack(tmp_path / "file" / "sub", b"")
    assert done.returncode == 3 and "Not a directory" in done.stderr.decode()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / f"hvdrun-{os.getuid()}").symlink_to(tmp_path)
    done = _unpack(tmp_path / "d", b"")
    assert done.returncode == 3 and "is a symbolic link" in done.stderr.decode()


def test_stage_on_this_machine_copies_the_environment(tmp_path, venv):
    environment = find_environment(str(venv / "bin" / "python"))
    plan = StagePlan(str(tmp_path / "stage"), {environment.python: environment})
    hosts = [(Host("localhost", 2), environment.python), (Host("127.0.0.1", 1), environment.python)]
    staged, line = stage(plan, hosts, ThisMachine())
    copy = tmp_path / "stage" / f"hvdrun-{os.getuid()}" / f"env-{environment.fingerprint}"
    assert staged["localhost"].python == staged["127.0.0.1"].python == f"{copy}/bin/python"
    assert (copy / "lib" / "python3.11" / "site-packages" / "pkg" / "__init__.py").exists()
    assert "staged " in line and "on 1 host" in line
    assert "already staged on 1 host" in stage(plan, hosts, ThisMachine())[1]
    with pytest.raises(UsageError, match=r"cannot use /proc/hvdrun-nowhere on this machine: mkdir"):
        stage(StagePlan("/proc/hvdrun-nowhere", plan.environments), hosts, ThisMachine())



def test_a_login_shells_noise_on_stderr_is_left_out_of_the_error(tmp_path):
    """A login shell may write to the same stderr before the unpack line runs (pyenv's rehash lock, a module
    system): only the line's own messages are quoted."""
    (tmp_path / "file").write_text("")
    noise = "pyenv: cannot rehash: couldn't acquire lock /root/.pyenv/shims/.pyenv-shim for 1 seconds."
    argv = unpack_command(str(tmp_path / "file" / "sub"), Environment("/unused/bin/python", "/unused", "f00d"))
    done = subprocess.run(["sh", "-c", f'echo "{noise}" >&2; exec "$@"', "login", *argv], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 3 and noise in done.stderr
    error = unpack_failure("h2", str(tmp_path / "file" / "sub"), done.returncode, done.stderr)
    assert isinstance(error, UsageError) and "pyenv" not in str(error)
    assert re.search(r"cannot use \S+ on h2: mkdir: .*Not a directory; give a writable directory", str(error))
    assert "cannot rehash" in str(unpack_failure("h2", "/d", 4, noise + "\n"))  # nothing of its own: all of stderr


def test_the_relay_reads_the_variables_hvdrun_sets():
    """The relay imports nothing of hvdrun: the names it reads are pinned to hvdrun's here."""
    from hvdrun import envvars
    from hvdrun.launch.mpiexec import RELAY_RANK
    from hvdrun.launch.remote import stage_relay

    assert stage_relay.TOKEN_VARIABLE == envvars.STAGE_TOKEN and envvars.STAGE_TOKEN in envvars.OFF_THE_COMMAND_LINE
    for flavour, name in RELAY_RANK.items():  # each launcher's rank variable, as the ranks' own lookup knows it
        assert envvars.mpi_rank({name: "7"}) == 7, flavour


def test_the_tree_in_host_order():
    from hvdrun.launch.stage_tree import children_count, tree_depth

    assert [children_count(p, 10, 3) for p in range(10)] == [3, 3, 3, 0, 0, 0, 0, 0, 0, 0]
    assert [children_count(p, 6, 4) for p in range(3)] == [4, 1, 0]
    assert [tree_depth(n, 3) for n in (1, 2, 4, 5, 13, 14)] == [0, 1, 1, 2, 2, 3]
    assert tree_depth(5, 1) == 4  # fan-out 1: a chain


def test_a_first_check_answers_busy_while_another_job_holds_the_copys_lock(tmp_path):
    base = tmp_path / f"hvdrun-{os.getuid()}"
    base.mkdir(mode=0o700)
    lock = base / ".env-f00d.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "30"])
    try:
        assert wait_until(lambda: subprocess.run(["flock", "-n", str(lock), "true"]).returncode != 0)
        environment = Environment("/unused/bin/python", "/unused", "f00d")
        done = subprocess.run(unpack_command(str(tmp_path), environment), input=b"", capture_output=True, timeout=30,
                              env={**os.environ, "HVDRUN_STAGE_LOCK_WAIT": "0"}, check=False)
        assert (done.returncode, _lines(done)[0]) == (0, f"BUSY {base}/env-f00d"), done.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_relay_listens_on_the_jobs_network_interface_else_on_the_route_to_hvdrun():
    from hvdrun.launch.remote.stage_relay import interface_ipv4, own_address

    assert interface_ipv4("lo") == "127.0.0.1" and interface_ipv4("hvd-none0") is None
    assert own_address("lo", "127.0.0.1") == "127.0.0.1"
    assert own_address("hvd-none0", "127.0.0.1") == own_address(None, "127.0.0.1") == "127.0.0.1"  # the route's
