"""What the site facts change at launch: Open MPI's options by its version (Sophia's Open MPI 4 refuses
Open MPI 5's ``--prtemca``), and the interface rank 0 advertises (a cluster file's ``network_interface``, e.g.
Aurora's hsn0, for a job that spans hosts; ``--network-interface`` first), as ``hvdrun check`` shows it.

Open MPI cannot run here: its line is checked as text, and its ``--version`` comes from a fake mpirun.
"""

from __future__ import annotations

import os
import time

import pytest
from rich.console import Console

from hvdrun.envvars import Rendezvous
from hvdrun.errors import LaunchError
from hvdrun.health.check import CheckReport, JobReport, interface_of
from hvdrun.health.check_view import network_line
from hvdrun.hosts import Host
from hvdrun.launch.job import make_launcher
from hvdrun.launch.mpiexec import MpiexecCommand, MpiexecLauncher, detect_flavour, openmpi_major
from hvdrun.launch.plan import RunOptions, plan_job
from hvdrun.launch.remote.connections import SshOptions
from hvdrun.ranks import GpuLayout

HOSTS = (Host("n1", 2), Host("n2", 2))
RANK = ("/venv/bin/python", "-m", "hvdrun.launch.remote.mpirank", "5", "--", "/venv/bin/python", "-u", "train.py")


@pytest.mark.parametrize("text, major", [
    ("mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n", 4),
    ("mpiexec (Open MPI) 4.0.5\n", 4),
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n", 5),
    ("orterun (OpenRTE) 1.10.7\n", 1),
    ("prterun (PRRTE) 3.0.6\n", 5),  # PRRTE is Open MPI 5's launcher
    ("HYDRA build details:\n    Version:                                 4.1.2\n", None),
    ("", None),
])
def test_open_mpi_major_version_from_its_version_text(text, major):
    assert openmpi_major(text) == major
    if major is not None:
        assert detect_flavour(text) == "openmpi"


def openmpi_line(major: int | None) -> list[str]:
    return MpiexecCommand("openmpi", "/usr/bin/mpirun", HOSTS, {"A": "1"}, RANK, "/tmp/x/ssh", None, None, (),
                          openmpi_major=major).argv()


@pytest.mark.parametrize("major", [1, 4])
def test_open_mpi_4_gets_orte_spellings(major):
    argv = openmpi_line(major)
    assert argv[argv.index("--mca"):argv.index("--mca") + 3] == ["--mca", "plm_rsh_agent", "/tmp/x/ssh"]
    assert "--prtemca" not in argv
    assert argv[1:9] == ["-n", "4", "--host", "n1:2,n2:2", "--map-by", "slot", "--bind-to", "none"]  # 4 takes these


@pytest.mark.parametrize("major", [5, 6, None])
def test_open_mpi_5_and_an_unknown_version_get_prrte_spellings(major):
    argv = openmpi_line(major)
    assert argv[argv.index("--prtemca"):argv.index("--prtemca") + 3] == ["--prtemca", "plm_ssh_agent", "/tmp/x/ssh"]
    assert "--mca" not in argv


def fake_mpirun(tmp_path, version_text: str | None) -> str:
    path = tmp_path / "mpirun"
    body = f"printf '{version_text}'" if version_text is not None else "exit 3"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def planned_command(tmp_path, monkeypatch, flavour: str | None, version_text: str | None) -> MpiexecCommand:
    monkeypatch.setenv("HVDRUN_MPIEXEC", fake_mpirun(tmp_path, version_text))
    config = tmp_path / "c.yaml"
    config.write_text("launcher: mpiexec\nhosts: ['localhost:2']\n" + (f"mpi_flavour: {flavour}\n" if flavour else ""))
    plan = plan_job(RunOptions(command=("/bin/true",), config_file=str(config)), dict(os.environ))
    launcher = make_launcher(plan)
    assert isinstance(launcher, MpiexecLauncher)
    launcher.prepare(plan.slots, time.monotonic() + 30)
    try:
        return launcher.command(plan.specs(Rendezvous("127.0.0.1", 1, 2, "s3cr3t", "job1"), lambda host: 4))
    finally:
        launcher.close()


@pytest.mark.parametrize("flavour", ["openmpi", None])
def test_the_launcher_asks_open_mpi_its_version_even_when_the_cluster_names_the_flavour(tmp_path, monkeypatch,
                                                                                         flavour):
    command = planned_command(tmp_path, monkeypatch, flavour, "mpirun (Open MPI) 4.1.5\\n")
    assert command.flavour == "openmpi" and command.openmpi_major == 4
    assert "plm_rsh_agent" in command.argv() and "--prtemca" not in command.argv()


def test_a_named_open_mpi_whose_version_cannot_be_read_keeps_prrte_spellings(tmp_path, monkeypatch):
    command = planned_command(tmp_path, monkeypatch, "openmpi", None)
    assert command.openmpi_major is None and "--prtemca" in command.argv()


# --- the interface rank 0 advertises ----------------------------------------------------------------------------

def plan(tmp_path, hosts: str, interface: str | None = None, environ: dict | None = None, launcher: str = "ssh",
         yaml_interface: str = "lo"):
    config = tmp_path / "site.yaml"
    config.write_text(f"launcher: {launcher}\nnetwork_interface: {yaml_interface}\n")
    options = RunOptions(command=("/bin/true",), hosts=hosts, config_file=str(config), network_interface=interface)
    return options, plan_job(options, environ or {})


def test_the_cluster_files_interface_carries_a_job_across_hosts(tmp_path):
    _, planned = plan(tmp_path, "localhost:1,node-b:1")
    assert planned.options.network_interface == "lo" and planned.notes == ()
    assert planned.base_env["GLOO_SOCKET_IFNAME"] == planned.base_env["NCCL_SOCKET_IFNAME"] == "lo"
    _, remote_rank0 = plan(tmp_path, "node-a:1,node-b:1", yaml_interface="hsn0")  # rank 0's host probes it there
    assert remote_rank0.options.network_interface == "hsn0"


def test_a_cluster_interface_this_machine_lacks_gives_way_to_the_route_with_a_note(tmp_path):
    """A login node or a laptop without hsn0, rank 0 here: the job runs, as it did before the YAML named one."""
    _, planned = plan(tmp_path, "localhost:1,node-b:1", yaml_interface="hsn0")
    assert planned.options.network_interface is None and "GLOO_SOCKET_IFNAME" not in planned.base_env
    assert planned.notes == (f"this machine has no IPv4 address on hsn0 (network_interface of {tmp_path / 'site.yaml'})"
                             "; rank 0 advertises the address of the route to the other hosts instead",)


def test_a_job_on_this_machine_alone_ignores_it(tmp_path):
    _, planned = plan(tmp_path, "localhost:2", launcher="local")
    assert planned.options.network_interface is None and "GLOO_SOCKET_IFNAME" not in planned.base_env


def test_the_option_wins_and_the_users_own_socket_variables_stay(tmp_path):
    _, planned = plan(tmp_path, "localhost:1,node-b:1", "eth7", {"NCCL_SOCKET_IFNAME": "ib0"})
    assert planned.options.network_interface == "eth7"
    assert planned.base_env["GLOO_SOCKET_IFNAME"] == "eth7" and planned.base_env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_mpiexec_advertises_the_interfaces_address_or_says_which_interface_is_missing():
    launcher = MpiexecLauncher(1.0, SshOptions(), GpuLayout(), "pals", network_interface="lo")
    assert launcher._local_address(Host("node-b", 1)) == "127.0.0.1"
    launcher.network_interface = "hsn9"
    with pytest.raises(LaunchError, match="this machine has no IPv4 address on network interface 'hsn9' "
                                          r"\(--network-interface, else the cluster file's network_interface\)"):
        launcher._local_address(Host("node-b", 1))


def shown(report: CheckReport) -> str:
    console = Console(width=400, record=True, color_system=None)
    console.print(network_line(report))
    return console.export_text().strip()


def test_check_shows_the_interface_and_where_it_comes_from(tmp_path):
    options, planned = plan(tmp_path, "localhost:1,node-b:1")
    interface = interface_of(planned, options)
    assert interface == {"name": "lo", "from": f"network_interface of {tmp_path / 'site.yaml'}",
                         "address": "127.0.0.1"}
    report = CheckReport({"interface": interface}, [], JobReport(ran=False))
    assert shown(report) == (f"network: rank 0 advertises its address on lo (network_interface of "
                             f"{tmp_path / 'site.yaml'}); this machine's is 127.0.0.1")
    options, planned = plan(tmp_path, "localhost:1,node-b:1", yaml_interface="hsn0")
    report = CheckReport({"interface": interface_of(planned, options)}, [], JobReport(ran=False))
    assert shown(report) == (f"network: this machine has no IPv4 address on hsn0 (network_interface of "
                             f"{tmp_path / 'site.yaml'}); rank 0 advertises the address of the route to the other "
                             "hosts instead")
    options, planned = plan(tmp_path, "localhost:1,node-b:1", "lo")
    report = CheckReport({"interface": interface_of(planned, options)}, [], JobReport(ran=False))
    assert shown(report) == ("network: rank 0 advertises its address on lo (--network-interface); "
                             "this machine's is 127.0.0.1")
    options, planned = plan(tmp_path, "localhost:2", launcher="local")
    report = CheckReport({"interface": interface_of(planned, options)}, [], JobReport(ran=False))
    assert shown(report).startswith("network: rank 0 advertises the address of its route to the first other host")
