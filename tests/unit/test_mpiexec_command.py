"""The mpiexec command lines hvdrun builds for MPICH hydra, Open MPI and Cray PALS, and the rank shim's slot.

PALS and Open MPI cannot run here (only the mpich wheel is installed): their lines are checked
as text against what their documentation asks for (see ../shared reference: PALS ``--np``,
``--ppn``, ``--env``, ``--hostfile``; Open MPI ``--host``, ``-x``, ``--prtemca plm_ssh_agent``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import replace

import pytest

from hvdrun.errors import UsageError
from hvdrun.hosts import Host
from hvdrun.launch.mpiexec import SRUN, MpiexecCommand, detect_flavour, ssh_agent_script
from hvdrun.launch.remote.connections import SshOptions
from hvdrun.launch.remote.mpirank import plan_value, slot_of, worker_environment
from hvdrun.ranks import GpuLayout

HOSTS = (Host("n1", 2), Host("n2", 2))
ENV = {"HVDRUN_SECRET": "s3cr3t", "WITH SPACE": "a b"}
COMMAND = ("/venv/bin/python", "-m", "hvdrun.launch.remote.mpirank", "5", "--", "/venv/bin/python", "-u", "train.py")


def command(flavour: str, hosts=HOSTS) -> MpiexecCommand:
    return MpiexecCommand(flavour, "/venv/bin/mpiexec", hosts, ENV, COMMAND, "/tmp/x/ssh", "10.0.0.254",
                          "/tmp/x/hostfile", ("--verbose",))


@pytest.mark.parametrize("text, flavour", [
    ("HYDRA build details:\n    Version:                                 5.0.2\n", "mpich"),
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n", "openmpi"),
    ("prterun (PRRTE) 3.0.6\n", "openmpi"),
    ("mpiexec version 1.2.12 (PALS 1.2.12)\n", "pals"),
    ("something else 1.0\n", None),
])
def test_flavour_from_version_text(text, flavour):
    assert detect_flavour(text) == flavour


def test_mpich_hydra_line():
    assert command("mpich").argv() == [
        "/venv/bin/mpiexec", "-n", "4", "-hosts", "n1:2,n2:2", "-launcher", "ssh", "-launcher-exec", "/tmp/x/ssh",
        "-localhost", "10.0.0.254", "-genvall", "-genv", "WITH SPACE", "a b", "--verbose",
        *COMMAND]


def test_open_mpi_line():
    argv = command("openmpi").argv()
    assert argv[:9] == ["/venv/bin/mpiexec", "-n", "4", "--host", "n1:2,n2:2", "--map-by", "slot", "--bind-to",
                        "none"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert argv[argv.index("--prtemca"):argv.index("--prtemca") + 3] == ["--prtemca", "plm_ssh_agent", "/tmp/x/ssh"]
    assert argv[argv.index("-x"):argv.index("-x") + 4] == ["-x", "HVDRUN_SECRET", "-x", "WITH SPACE=a b"]
    assert argv[-len(COMMAND) - 1:] == ["--verbose", *COMMAND]


def test_pals_line_and_uneven_hosts():
    assert command("pals").argv() == [
        "/venv/bin/mpiexec", "--np", "4", "--ppn", "2", "--cpu-bind", "none", "--envall", "--line-buffer",
        "--hostfile", "/tmp/x/hostfile",
        "--env", "WITH SPACE=a b", "--verbose", *COMMAND]
    with pytest.raises(UsageError, match="same number of ranks on every host.*n1:2,n2:1"):
        command("pals", (Host("n1", 2), Host("n2", 1))).argv()


@pytest.mark.parametrize("flavour", ["mpich", "openmpi", "pals", SRUN])
def test_the_secret_reaches_mpiexec_through_its_environment_never_its_command_line(flavour):
    """``ps`` shows every user of a node the command lines: the secret goes through mpiexec's environment."""
    line = command(flavour, (Host("n1", 2), Host("n2", 2))).argv()
    assert not any("s3cr3t" in word for word in line)
    assert command(flavour).process_env({"PATH": "/bin"})["HVDRUN_SECRET"] == "s3cr3t"


@pytest.mark.parametrize("cpu_bind, pals, srun, launcher_binds", [
    ("none", "none", "none", False),
    ("cores", "none", "none", False),  # the guard splits the node's cores; the launcher must not bind first
    ("numa", "numa", "ldoms", True),
    ("list:0-3:4-7", "list:0-3:4-7", "mask_cpu:0xf,0xf0", True),
    ("depth:8", "depth", "none", True),  # PALS --depth=8 --cpu-bind depth; under srun the guard binds
])
def test_pals_and_srun_get_the_cpu_binding_they_apply_themselves(cpu_bind, pals, srun, launcher_binds):
    on_pals = replace(command("pals"), cpu_bind=cpu_bind)
    argv = on_pals.argv()
    assert argv[argv.index("--cpu-bind") + 1] == pals and on_pals.launcher_binds() == launcher_binds
    assert f"--cpu-bind={srun}" in replace(command(SRUN), cpu_bind=cpu_bind).argv()
    assert "--bind-to" in replace(command("openmpi"), cpu_bind=cpu_bind).argv()  # none: the guard binds
    assert not replace(command("openmpi"), cpu_bind=cpu_bind).launcher_binds()
    assert ("--depth=8" in argv) == cpu_bind.startswith("depth:")
    assert replace(command(SRUN), cpu_bind=cpu_bind).launcher_binds() == (cpu_bind in ("numa", "list:0-3:4-7"))


def test_ssh_agent_applies_options_and_quotes_them(tmp_path):
    agent = tmp_path / "ssh"
    agent.write_text(ssh_agent_script(SshOptions(port=2222, identity_file="/keys/my key",
                                                 known_hosts="/k/known hosts")))
    text = agent.read_text()
    assert "StrictHostKeyChecking=yes" in text and "BatchMode=yes" in text
    words = shlex.split(text.splitlines()[1])
    assert words[:2] == ["exec", "ssh"] and words[-1] == "$@"
    assert ["-p", "2222"] == words[words.index("-p"):words.index("-p") + 2]
    assert ["-i", "/keys/my key"] == words[words.index("-i"):words.index("-i") + 2]
    assert "UserKnownHostsFile=/k/known hosts" in words
    agent.chmod(0o700)
    assert subprocess.run(["sh", "-n", str(agent)]).returncode == 0


@pytest.mark.parametrize("rank_var", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMIX_RANK"])
def test_shim_finds_its_slot_and_pins_gpus_in_machine_order(rank_var):
    layout = GpuLayout(gpus_per_node=4, gpu_order=("3", "2", "1", "0"), gpus_per_rank=1)
    environ = {"HVDRUN_MPI_PLAN": plan_value([Host("x1", 4), Host("x2", 4)], 8, layout), rank_var: "6",
               "HVDRUN_RENDEZVOUS_ADDR": "x1", "HVDRUN_RENDEZVOUS_PORT": "1234", "MASTER_PORT": "1235",
               "HVDRUN_SECRET": "ab", "HVDRUN_JOB_ID": "j1"}
    slot = slot_of(environ)
    assert (slot.rank, slot.hostname, slot.local_rank, slot.cross_rank, slot.devices) == (6, "x2", 2, 1, ("1",))
    _, env = worker_environment(environ)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0" and env["HVDRUN_DEVICE_ORDINAL"] == "2"  # GPU 1, device 2
    assert env["HVDRUN_RANK"] == env["RANK"] == "6"
    assert env["LOCAL_RANK"] == "2" and env["MASTER_ADDR"] == "x1" and env["HVDRUN_SECRET"] == "ab"


def test_shim_without_an_mpi_rank_says_so():
    environ = {"HVDRUN_MPI_PLAN": plan_value([Host("x1", 2)], 2, GpuLayout())}
    with pytest.raises(SystemExit, match="no MPI rank in the environment"):
        slot_of(environ)
