"""``hvdrun check`` against real SSH hosts (network namespaces) and real virtualenvs on them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

SCHEMA = json.loads((REPO / "docs" / "check-schema.json").read_text())
SMALL = ("--bandwidth-size", "1M", "--link-size", "256K")
SITE = Path(sysconfig.get_paths()["purelib"]).relative_to(sysconfig.get_paths()["data"])


def _venv(directory: Path) -> Path:
    """A bare virtualenv (no pip); returns its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    return directory / SITE


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, Path]:
    """Two Pythons a host may have instead of the launcher's: one without torch (hvdrun from the source
    tree only) and one with the launcher's packages but another hvdrun release installed over them."""
    root = tmp_path_factory.mktemp("venvs")
    no_torch = _venv(root / "no-torch")
    (no_torch / "hvdrun-src.pth").write_text(f"{REPO}\n")
    other = _venv(root / "other-hvdrun")
    shutil.copytree(REPO / "hvdrun", other / "hvdrun", ignore=shutil.ignore_patterns("__pycache__"))
    version = other / "hvdrun" / "version.py"
    version.write_text(version.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.0.9"'))
    (other / "launcher-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"no-torch": root / "no-torch" / "bin" / "python", "other-hvdrun": root / "other-hvdrun" / "bin" / "python"}


def check_json(run_hvdrun, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = run_hvdrun("check", "--json", *SMALL, *args, timeout=timeout)
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)
    return done, report


def check_with_python(run_hvdrun, ssh_hosts, tmp_path, index: int, python: Path) -> tuple[object, dict]:
    """Check the first two hosts, host ``index`` running ``python`` (the cluster YAML's ``python:``)."""
    lines = [f"  - {{name: {addr}, slots: 1{f', python: {python}' if i == index else ''}}}\n"
             for i, addr in enumerate(ssh_hosts.addrs[:2])]
    config = tmp_path / "c.yaml"
    config.write_text("hosts:\n" + "".join(lines))
    return check_json(run_hvdrun, "--config", str(config), *ssh_hosts.args())


def checks_of(report: dict, host: str) -> dict[str, dict]:
    entry = next(h for h in report["hosts"] if h["host"] == host)
    return {c["name"]: c for c in entry["checks"]}


def test_healthy_hosts_pass_every_check_and_the_allreduce(run_hvdrun, ssh_hosts):
    done, report = check_json(run_hvdrun, "-H", f"localhost:1,{ssh_hosts.addrs[0]}:2,{ssh_hosts.addrs[1]}:1",
                              *ssh_hosts.args())
    assert done.returncode == 0 and report["ok"], done.stdout
    assert [h["host"] for h in report["hosts"]] == ["localhost", *ssh_hosts.addrs[:2]]
    for host in report["hosts"]:
        assert host["ok"] and host["facts"]["hvdrun"] == report["launcher"]["hvdrun"]
        assert set(checks_of(report, host["host"])) == {"reach", "python", "hvdrun", "torch", "gpus", "disk", "port",
                                                        "binding"}
    binding = checks_of(report, ssh_hosts.addrs[0])["binding"]  # the bindings report of the host with 2 ranks
    assert binding["ok"] and binding["found"].startswith("local rank 0: cores ")
    assert "; local rank 1: cores " in binding["found"]
    assert report["hosts"][1]["via"] == "ssh" and report["hosts"][1]["facts"]["hostname"] == "h1"
    job = report["job"]["result"]
    assert report["job"]["ok"] and job["verified"] and job["ranks"] == 4
    assert job["hosts"][1:] == ["h1", "h1", "h2"] and job["latency_s"] > 0 and job["bus_bandwidth"] > 0
    assert [(link["src"], link["dst"]) for link in job["links"]] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert all(link["bandwidth"] > 0 for link in job["links"])


def test_a_cpu_binding_that_does_not_fit_a_host_fails_its_check(run_hvdrun):
    done, report = check_json(run_hvdrun, "-H", "localhost:1", "--cpu-bind", "list:4096")
    assert done.returncode == 1 and not report["ok"] and not report["job"]["ran"]
    binding = checks_of(report, "localhost")["binding"]
    assert not binding["ok"] and "local rank 0 gets cores 4096, but 4096 are not allowed here" in binding["found"]


def excluded(path: Path) -> list[str]:
    """The hosts of an exclude file, as ``hvdrun --exclude-hosts-file`` reads them."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_a_host_that_is_down_is_named_and_written_to_exclude_while_the_others_are_checked(run_hvdrun, ssh_hosts,
                                                                                          tmp_path):
    down, path = ssh_hosts.unused_addr(), tmp_path / "lists" / "bad-hosts"
    # the default --timeout (30 s) also bounds the healthy hosts' probe (SSH, then Python importing torch): about
    # 1.5 s on an idle machine, and past 10 s once on two cores that other tests' ranks kept busy; the down host
    # fails on its own much sooner (the bridge's ARP gives up: "No route to host")
    done, report = check_json(run_hvdrun, "-H", f"{ssh_hosts.addrs[0]}:1,{down}:1,{ssh_hosts.addrs[1]}:1",
                              "--write-excludes", str(path), *ssh_hosts.args())
    assert done.returncode == 1 and not report["ok"]
    reach = checks_of(report, down)["reach"]
    assert not reach["ok"] and f"root@{down}" in reach["found"] and reach["fix"]
    assert [h["ok"] for h in report["hosts"]] == [True, False, True]  # the others were fully checked
    assert report["job"] == {"ran": False, "ok": False, "skipped": f"host checks failed on {down}", "error": None,
                             "checks": [], "result": None}
    assert excluded(path) == [down]  # and stdout stays the JSON document alone (check_json parsed it)
    text = path.read_text()
    assert text.startswith("# written by hvdrun check at ") and f"# {down} failed: reach\n" in text
    assert f"hvdrun check: wrote 1 host to exclude to {path} ({down})" in done.stderr
    table = run_hvdrun("check", "-H", f"{ssh_hosts.addrs[0]}:1,{down}:1", "--timeout", "3", *ssh_hosts.args())
    assert table.returncode == 1
    assert f"{down}: reach: expected ssh root@{down}" in table.stdout
    assert "fix: check that the host is up" in table.stdout


def test_the_check_table_names_every_link_and_a_clean_check_empties_the_exclude_list(run_hvdrun, ssh_hosts,
                                                                                     tmp_path):
    path = tmp_path / "lists" / "bad-hosts"
    path.parent.mkdir()
    path.write_text("# written by hvdrun check at an earlier run\n# h9 failed: reach\nh9\n")
    table = run_hvdrun("check", *SMALL, "-H", ssh_hosts.hosts(1, 2), "--write-excludes", str(path),
                       *ssh_hosts.args(), timeout=120)
    assert table.returncode == 0, table.stderr
    assert "hvdrun check: all checks passed" in table.stdout and "link 1->0" in table.stdout
    assert excluded(path) == [] and len(path.read_text().splitlines()) == 1
    assert f"wrote 0 hosts to exclude to {path} (every host passed)" in table.stderr
    assert sorted(p.name for p in path.parent.iterdir()) == ["bad-hosts"]


def test_write_excludes_names_a_host_whose_python_fails_the_probe(run_hvdrun, ssh_hosts, venvs, tmp_path):
    path = tmp_path / "bad-hosts"
    lines = [f"  - {{name: {ssh_hosts.addrs[0]}, slots: 1}}\n",
             f"  - {{name: {ssh_hosts.addrs[1]}, slots: 1, python: /nonexistent/bin/python}}\n"]
    (tmp_path / "c.yaml").write_text("hosts:\n" + "".join(lines))
    table = run_hvdrun("check", *SMALL, "--config", str(tmp_path / "c.yaml"), "--write-excludes", str(path),
                       *ssh_hosts.args(), timeout=120)
    assert table.returncode == 1 and excluded(path) == [ssh_hosts.addrs[1]], table.stdout
    assert f"# {ssh_hosts.addrs[1]} failed: python\n" in path.read_text()


def test_write_excludes_to_a_path_that_cannot_be_written_fails_before_any_host_is_checked(run_hvdrun, tmp_path):
    (tmp_path / "a-file").write_text("")
    done = run_hvdrun("check", "-np", "1", "--write-excludes", str(tmp_path / "a-file" / "bad-hosts"))
    assert done.returncode == 2 and done.stderr.startswith("hvdrun: error: --write-excludes ")
    assert "cannot write it" in done.stderr and done.stdout == ""


def test_a_python_without_torch_is_named_with_the_fix(run_hvdrun, ssh_hosts, venvs, tmp_path):
    done, report = check_with_python(run_hvdrun, ssh_hosts, tmp_path, 1, venvs["no-torch"])
    assert done.returncode == 1
    torch = checks_of(report, ssh_hosts.addrs[1])["torch"]
    assert not torch["ok"] and "No module named 'torch'" in torch["found"]
    assert torch["fix"] == f"pip install torch=={report['launcher']['torch']} for {venvs['no-torch']} on " \
                           f"{ssh_hosts.addrs[1]}"
    assert checks_of(report, ssh_hosts.addrs[0])["torch"]["ok"] and not report["job"]["ran"]


def test_another_hvdrun_release_on_a_host_names_both_versions(run_hvdrun, ssh_hosts, venvs, tmp_path):
    done, report = check_with_python(run_hvdrun, ssh_hosts, tmp_path, 0, venvs["other-hvdrun"])
    assert done.returncode == 1
    found = checks_of(report, ssh_hosts.addrs[0])
    assert not found["hvdrun"]["ok"] and found["hvdrun"]["expected"] == "0.1.0"
    assert found["hvdrun"]["found"].startswith("0.0.9 (hvdrun; the launcher has 0.1.0)")
    assert found["torch"]["ok"] and found["python"]["ok"]  # the same torch and Python, through the .pth
    assert checks_of(report, ssh_hosts.addrs[1])["hvdrun"]["ok"]


def test_gpus_promised_by_the_config_are_counted(run_hvdrun):
    done, report = check_json(run_hvdrun, "-np", "1", "--gpus-per-node", "4")
    assert done.returncode == 1
    gpus = checks_of(report, "localhost")["gpus"]
    assert gpus["expected"] == "4 (--gpus-per-node)" and gpus["found"].startswith("0") and gpus["fix"]


def test_bad_host_options_are_usage_errors(run_hvdrun):
    done = run_hvdrun("check", "-H", "a;reboot:1")
    assert done.returncode == 2 and done.stderr.startswith("hvdrun: error:") and len(done.stderr.splitlines()) == 1
    done = run_hvdrun("check", "--bandwidth-size", "lots")
    assert done.returncode == 2 and "'lots' is not a size" in done.stderr
