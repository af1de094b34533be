"""``hvdrun --stage-env``: the ranks run from a copy of their environment on each host's own disk.

A small venv (``python -m venv --without-pip``, 60 kB) stands for the job's environment: a ``.pth`` in it adds
this test run's site-packages, so hvdrun and its dependencies import as usual, while the interpreter, ``sys.prefix``
and ``PATH`` are the copy's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.integration.test_local_launch import script

pytestmark = pytest.mark.integration

WHERE = """
import json, os, socket, sys
from hvdrun.runtime import init
print("WHERE " + json.dumps({"host": socket.gethostname(), "executable": sys.executable, "prefix": sys.prefix,
      "path0": os.environ["PATH"].split(":")[0]}), flush=True)
"""


@pytest.fixture(scope="module")
def small_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of a few files that imports what this Python imports (its site-packages through a .pth)."""
    prefix = tmp_path_factory.mktemp("small") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=60)
    site = Path(sysconfig.get_paths(vars={"base": str(prefix)})["purelib"])
    (site / "run-from-tests.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return prefix


def config(tmp_path: Path, env: Path, extra: str = "") -> str:
    path = tmp_path / "stage.yaml"
    path.write_text(f"python: {env}/bin/python\n{extra}")
    return str(path)


def where(stdout: str) -> list[dict]:
    return [json.loads(line.split("WHERE ", 1)[1]) for line in stdout.splitlines() if "WHERE " in line]


def staging_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hvdrun: --stage-env:")]


def test_ranks_run_from_the_copy_and_the_next_job_finds_it(run_hvdrun, small_env, tmp_path):
    stage_dir = tmp_path / "node-local"
    conf = config(tmp_path, small_env, f"launcher: local\nlocal_dir: {stage_dir}\n")
    program = script(tmp_path, "where.py", WHERE)
    done = run_hvdrun("--config", conf, "--stage-env", "-np", "2", program)
    assert done.returncode == 0, done.stderr
    copies = list((stage_dir / f"hvdrun-{os.getuid()}").glob("env-*"))
    assert len(copies) == 1 and (copies[0] / ".hvdrun-staged").exists()
    copy = str(copies[0])
    [line] = staging_lines(done.stderr)
    assert f"staged {small_env} on 1 host in " in line and line.endswith(f"the ranks run from {copy}")
    ranks = where(done.stdout)
    assert len(ranks) == 2 and all(r["executable"] == f"{copy}/bin/python" and r["prefix"] == copy
                                   and r["path0"] == f"{copy}/bin" for r in ranks)
    again = run_hvdrun("--config", conf, "--stage-env", "-np", "1", program)
    assert again.returncode == 0, again.stderr
    assert staging_lines(again.stderr) == [f"hvdrun: --stage-env: {small_env} already staged on 1 host ({copy})"]
    assert where(again.stdout)[0]["prefix"] == copy

    (Path(copy) / ".hvdrun-staged").unlink()  # as a job killed while unpacking leaves it: redone, never used
    (Path(copy) / "half-written").write_text("")
    redone = run_hvdrun("--config", conf, "--stage-dir", str(stage_dir), "-np", "1", program)
    assert redone.returncode == 0, redone.stderr
    assert "staged " in staging_lines(redone.stderr)[0] and not (Path(copy) / "half-written").exists()


@pytest.mark.parametrize("stage_dir, fragment", [
    ("relative/dir", "hvdrun: error: --stage-dir 'relative/dir': expected an absolute path"),
    ("{tmp}/a-file/sub", "hvdrun: error: --stage-env: cannot use {tmp}/a-file/sub on this machine: mkdir: "),
], ids=["relative", "under-a-file"])
def test_a_bad_stage_dir_is_one_line_and_exit_2(run_hvdrun, small_env, tmp_path, stage_dir, fragment):
    (tmp_path / "a-file").write_text("")
    program = script(tmp_path, "where.py", WHERE)
    done = run_hvdrun("--config", config(tmp_path, small_env), "--stage-dir", stage_dir.format(tmp=tmp_path),
                      "-np", "1", program)
    assert done.returncode == 2
    assert done.stderr.startswith(fragment.format(tmp=tmp_path)) and done.stderr.count("\n") == 1, done.stderr
    assert not done.stdout


def test_each_ssh_host_stages_once(run_hvdrun, ssh_hosts, small_env, tmp_path):
    """The namespace hosts share this machine's disk, so their staging directory is one directory (the same boot id,
    device and inode): the first host's relay (started over SSH) unpacks, reading the environment itself, and the
    other, checking after it, finds the complete copy; each host's ranks run from it."""
    stage_dir = tmp_path / "ssh-local"
    conf = config(tmp_path, small_env)
    program = script(tmp_path, "where.py", WHERE)
    args = ("--config", conf, "-H", ssh_hosts.hosts(1, 2), *ssh_hosts.args(), "--stage-dir", str(stage_dir), program)
    done = run_hvdrun(*args, timeout=120)
    assert done.returncode == 0, done.stderr
    [copy] = [str(p) for p in (stage_dir / f"hvdrun-{os.getuid()}").glob("env-*")]
    [line] = staging_lines(done.stderr)
    assert f"staged {small_env} on 1 host in " in line and "already staged on 1 host" in line, line
    assert f"read once by {ssh_hosts.addrs[0]} (" in line and "then host to host to 1 host, fan-out 4, depth 0" in line
    ranks = sorted(where(done.stdout), key=lambda r: r["host"])
    assert [r["host"] for r in ranks] == ["h1", "h2"]
    assert all(r["executable"] == f"{copy}/bin/python" and r["path0"] == f"{copy}/bin" for r in ranks)
    again = run_hvdrun(*args, timeout=120)
    assert again.returncode == 0 and staging_lines(again.stderr) == [
        f"hvdrun: --stage-env: {small_env} already staged on 2 hosts ({copy})"], again.stderr
    bad = run_hvdrun("--config", conf, "-H", ssh_hosts.hosts(1, 1), *ssh_hosts.args(), "--stage-dir",
                     "/proc/hvdrun-nowhere", program, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith(
        f"hvdrun: error: --stage-env: cannot use /proc/hvdrun-nowhere on {ssh_hosts.addrs[0]}: mkdir: "), bad.stderr


@pytest.mark.parametrize("flavour", ["mpich", "pals"])
def test_under_mpiexec_one_process_a_host_stages_and_the_ranks_run_from_the_copy(run_hvdrun, ssh_hosts, small_env,
                                                                                  tmp_path, hvdrun_env, flavour):
    """hydra (the mpich wheel) starts the relays over SSH on two namespace hosts; the FAKE PALS mpiexec starts them
    on this machine (it starts everything here)."""
    stage_dir = tmp_path / f"mpi-{flavour}"
    program = script(tmp_path, "where.py", WHERE)
    hosts = ["-H", ssh_hosts.hosts(1, 2), *ssh_hosts.args()]
    if flavour == "pals":
        hosts = ["-H", "localhost:1,127.0.0.1:1"]
    if flavour == "pals":
        hvdrun_env["HVDRUN_MPIEXEC"] = str(Path(__file__).parent.parent / "fakes" / "fake_pals_mpiexec.py")
    done = run_hvdrun("--config", config(tmp_path, small_env), "--launcher", "mpiexec", "--mpi-flavour", flavour,
                      *hosts, "--stage-dir", str(stage_dir), program, timeout=120)
    assert done.returncode == 0, done.stderr
    [copy] = [str(p) for p in (stage_dir / f"hvdrun-{os.getuid()}").glob("env-*")]
    [line] = staging_lines(done.stderr)
    assert f"staged {small_env} on 1 host in " in line and "already staged on 1 host" in line, line
    ranks = where(done.stdout)
    assert len(ranks) == 2 and all(r["executable"] == f"{copy}/bin/python" for r in ranks), done.stdout
