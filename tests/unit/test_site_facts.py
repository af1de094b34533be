"""Site facts against the pages they were read from (tests/unit/golden/site_facts.json), their explanation
(``hvdrun qsub --explain``), the ``sources:``/``network_interface``/``filesystem_mpi_args`` keys, and what the
facts decide for a job (DAOS's ``--no-vni``, Aurora's and Sophia's queue limits).

The golden file records each fact as ALCF's page gave it (by hand, from the page at the commit it names), so a
cluster file that drifts from its page, cites a page for a fact the page was not read for, or gains a site fact
that names no page fails here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from click.testing import CliRunner

from hvdrun.cli import cli
from hvdrun.config import load_cluster, parse_config
from hvdrun.errors import ConfigError, UsageError
from hvdrun.jobs.render import render_script
from hvdrun.jobs.spec import JobRequest, build_spec
from hvdrun.resources import data_dir
from hvdrun.site_sources import covers, flatten, value_at

GOLDEN = json.loads((Path(__file__).parent / "golden" / "site_facts.json").read_text())["clusters"]
# Keys whose every value is a fact about the site: each must name the page it was read from.
SITE_KEYS = ("scheduler.queues", "scheduler.max_nodes", "scheduler.max_walltime", "scheduler.filesystems",
             "scheduler.valid_filesystems", "scheduler.filesystem_mpi_args", "scheduler.setup", "scheduler.required",
             "env", "network_interface")


def document(cluster: str) -> dict:
    return yaml.safe_load((data_dir("cluster_configs") / f"{cluster}.yaml").read_text())


def recorded(kind: str) -> list[tuple[str, str, str, object]]:
    """(cluster, page, key, value) of every fact ('facts') or list part ('includes') in the golden file."""
    return [(cluster, page, key, value) for cluster, record in GOLDEN.items()
            for page, entry in record["pages"].items() for key, value in entry.get(kind, {}).items()]


@pytest.mark.parametrize("cluster", sorted(GOLDEN))
def test_the_file_names_the_pages_commit_and_the_day_they_were_read(cluster):
    sources, record = load_cluster(cluster).sources, GOLDEN[cluster]
    assert sources is not None, f"{cluster}.yaml has no 'sources:' section"
    assert (sources.repository, sources.commit, sources.committed, sources.read) == (
        record["repository"], record["commit"], record["committed"], record["read"])
    assert set(sources.pages) == set(record["pages"])


@pytest.mark.parametrize("cluster, page, key, value", recorded("facts"))
def test_each_fact_is_its_pages_value(cluster, page, key, value):
    assert value_at(document(cluster), key) == value, f"{cluster}.yaml {key} differs from {page}"
    assert page in load_cluster(cluster).sources.pages_of(key), f"{cluster}.yaml does not cite {page} for {key}"


@pytest.mark.parametrize("cluster, page, key, items", recorded("includes"))
def test_each_list_part_comes_from_its_page(cluster, page, key, items):
    assert set(items) <= set(value_at(document(cluster), key)), f"{cluster}.yaml {key} lacks some of {page}'s"
    assert page in load_cluster(cluster).sources.pages_of(key)


@pytest.mark.parametrize("cluster", sorted(GOLDEN))
def test_every_item_of_a_list_comes_from_some_page(cluster):
    parts: dict[str, set] = {}
    for name, _page, key, items in recorded("includes"):
        if name == cluster:
            parts.setdefault(key, set()).update(items)
    for key, items in parts.items():
        assert set(value_at(document(cluster), key)) == items, f"{cluster}.yaml {key}: items no page gives"


@pytest.mark.parametrize("cluster", sorted(GOLDEN))
def test_every_fact_the_file_credits_to_a_page_was_read_there(cluster):
    """No fact rides on a page's name unchecked: each leaf under a cited key is in the golden record of that page."""
    sources, pages = load_cluster(cluster).sources, GOLDEN[cluster]["pages"]
    for page, keys in sources.pages.items():
        checked = {**pages[page].get("facts", {}), **pages[page].get("includes", {})}
        for key, _ in flatten(document(cluster)):
            if any(covers(given, key) for given in keys):
                assert key in checked, f"{cluster}.yaml credits {key} to {page}; the golden record does not"


@pytest.mark.parametrize("cluster", sorted(GOLDEN))
def test_every_site_fact_names_a_page(cluster):
    sources = load_cluster(cluster).sources
    for key, _ in flatten(document(cluster)):
        if any(covers(site, key) for site in SITE_KEYS):
            assert sources.pages_of(key), f"{cluster}.yaml: {key} names no page in 'sources:'"


# --- hvdrun qsub --explain ------------------------------------------------------------------------------------

def explain(*args: str):
    return CliRunner().invoke(cli, ["qsub", *args, "--explain"])


def test_explain_lists_each_fact_under_its_page_with_a_link_to_the_page_as_read():
    result = explain("--cluster", "aurora")
    assert result.exit_code == 0, result.output
    text = result.output
    commit = GOLDEN["aurora"]["commit"]
    assert f"site facts read 2026-11-27 from argonne-lcf/user-guides at commit {commit[:12]} of 2026-08-19" in text
    queues = text.index("\ndocs/aurora/running-jobs-aurora.md\n")
    assert text.index(f"https://github.com/argonne-lcf/user-guides/blob/{commit}/docs/aurora/running-jobs-aurora.md",
                      queues) < text.index("scheduler.queues.debug-scaling.max_nodes: 256", queues)
    daos = text.index("\ndocs/aurora/data-management/daos/daos-overview.md\n")
    assert "scheduler.filesystem_mpi_args.daos_user_fs: [--no-vni]" in text[daos:]
    assert '  env.CCL_CONFIGURATION_PATH: ""\n' in text  # an empty value stays visible
    assert "  network_interface: hsn0\n" in text
    own = text.index("from no page (hvdrun's own settings for this machine)")
    assert "  local_dir: /tmp\n" in text[own:] and "scheduler.queues" not in text[own:]


def test_explain_of_a_file_without_sources_says_so(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nscheduler: {kind: pbs, queues: {q: {max_nodes: 4}}}\n")
    result = explain("--config", str(path))
    assert result.exit_code == 0, result.output
    assert "this file names no page for its facts (no 'sources:' section)" in result.output
    assert "  scheduler.queues.q.max_nodes: 4\n" in result.output


@pytest.mark.parametrize("args, fragment", [
    ((), "--explain shows a cluster's site facts: give --cluster NAME or --config FILE"),
    (("--cluster", "nosuch"), "unknown cluster 'nosuch'"),
])
def test_explain_without_a_cluster_is_one_line_and_exit_2(args, fragment):
    result = explain(*args)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("hvdrun: error: ") and fragment in result.output


# --- the keys -------------------------------------------------------------------------------------------------

SOURCES = ("sources: {repository: argonne-lcf/user-guides, commit: 7d04a3f91d5e, read: '2026-11-27', "
           "pages: {docs/a.md: [scheduler.queues]}}\n")
QUEUES = "scheduler: {kind: pbs, valid_filesystems: [home, daos_user_fs], queues: {q: {max_nodes: 4}}}\n"


def test_the_keys_parse():
    config = parse_config(yaml.safe_load(QUEUES + SOURCES + "network_interface: hsn0\n"), "x.yaml")
    assert config.network_interface == "hsn0"
    assert config.sources.pages_of("scheduler.queues.q.max_nodes") == ["docs/a.md"]
    assert config.sources.pages_of("scheduler.queue") == []  # a prefix of the name is not a parent key
    assert config.sources.committed is None
    unquoted = parse_config(yaml.safe_load(QUEUES + SOURCES.replace("'2026-11-27'", "2026-11-27")), "x.yaml")
    assert unquoted.sources.read == "2026-11-27"


@pytest.mark.parametrize("text, fragment", [
    ("network_interface: 'hsn0; reboot'\n", "'network_interface' must be an interface name such as hsn0"),
    ("network_interface: 7\n", "'network_interface' must be str"),
    (SOURCES.replace("scheduler.queues", "scheduler.queue"),
     "sources.pages.docs/a.md names 'scheduler.queue', which is not a key of this file"),
    (SOURCES.replace("read: '2026-11-27'", "read: yesterday"), "'sources.read' must be a date YYYY-MM-DD"),
    (SOURCES.replace("read: '2026-11-27'", "read: '2026-02-30'"), "'sources.read' must be a date YYYY-MM-DD"),
    (SOURCES.replace("commit: 7d04a3f91d5e", "commit: main"), "'sources.commit' must be 7 to 40 lower-case hex"),
    (SOURCES.replace("argonne-lcf/user-guides", "user-guides"), "'sources.repository' must be owner/name"),
    (SOURCES.replace("docs/a.md", "../a.md"), "'sources.pages' key '../a.md' must be a page's path"),
    (SOURCES.replace("[scheduler.queues]", "[]"), "sources.pages.docs/a.md must list the keys of this file"),
    (SOURCES.replace("read:", "when:"), "unknown key 'sources.when'"),
    ("sources: [a]\n", "'sources' must be a mapping"),
])
def test_bad_keys_name_the_key_and_what_was_expected(text, fragment):
    with pytest.raises(ConfigError, match="x.yaml: .*") as caught:
        parse_config(yaml.safe_load(QUEUES + text), "x.yaml")
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("mapping, fragment", [
    ("{scratch: [--no-vni]}", "scheduler.filesystem_mpi_args.scratch: 'scratch' is not in scheduler.valid_filesystems"),
    ("{daos_user_fs: []}", "must list mpiexec arguments, e.g. [--no-vni]"),
    ("{daos_user_fs: --no-vni}", "must list mpiexec arguments"),
])
def test_bad_filesystem_mpi_args(mapping, fragment):
    text = QUEUES.replace("queues:", f"filesystem_mpi_args: {mapping}, queues:")
    with pytest.raises(ConfigError, match="x.yaml: scheduler.filesystem_mpi_args"):
        parse_config(yaml.safe_load(text), "x.yaml")
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_load(text), "x.yaml")
    assert fragment in str(caught.value)


def test_a_bad_cluster_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(QUEUES + "network_interface: 'a b'\n")
    result = explain("--config", str(path))
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "bad.yaml: 'network_interface' must be an interface name" in result.output


# --- what the facts decide ------------------------------------------------------------------------------------

def launch_line(**fields) -> str:
    fields.setdefault("output", "/home/me/run/logs/train.output")
    with mock.patch.object(sys, "executable", "/home/me/venv/bin/python"):
        text = render_script(build_spec(JobRequest(command=("train.py",), account="P", **fields), now=0,
                                        workdir="/home/me/run"))
    return next(line for line in text.splitlines() if " -m hvdrun " in line)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")


def test_a_daos_job_gets_no_vni_for_its_pals_mpiexec():
    daos = dict(cluster="aurora", filesystems="flare:daos_user_fs")
    assert " --ranks-per-node 12 --mpi-args=--no-vni -- train.py" in launch_line(**daos)
    assert "#PBS -l filesystems=flare:daos_user_fs" in render_script(build_spec(
        JobRequest(command=("train.py",), account="P", output="/o/x.output", **daos), now=0, workdir="/w"))
    assert "--mpi-args" not in launch_line(cluster="aurora")  # flare alone
    assert "--mpi-args" not in launch_line(**daos, run_args="--launcher ssh")  # no mpiexec in the job
    given = launch_line(**daos, run_args="--mpi-args='--no-vni --verbose'")  # the user's own, with --no-vni
    assert given.count("--mpi-args") == 1 and "'--mpi-args=--no-vni --verbose'" in given


def test_a_daos_job_whose_own_mpi_args_lack_no_vni_is_refused():
    with pytest.raises(UsageError, match=r"--run-args gives --mpi-args '--verbose', which the job's mpiexec would get "
                                         r"instead of the --no-vni that filesystem daos_perf_fs needs \(.*aurora.yaml: "
                                         r"scheduler.filesystem_mpi_args\); add it: --run-args "
                                         r"\"--mpi-args='--verbose --no-vni'\""):
        launch_line(cluster="aurora", filesystems="flare,daos_perf_fs", run_args="--mpi-args=--verbose")


@pytest.mark.parametrize("fields, refused", [
    (dict(cluster="aurora", queue="prod", nodes=10, walltime="60"), "queue 'prod' on aurora takes 256 to 10624 nodes"),
    (dict(cluster="aurora", filesystems="daos_user"), "'daos_user' is not a filesystem of this machine"),
    (dict(cluster="aurora", queue="prod-large", nodes=2000), "'prod-large' is not a queue of aurora"),
    (dict(cluster="sophia", queue="bigmem", walltime="13:00:00"), "queue 'bigmem' on sophia allows at most 12:00:00"),
])
def test_what_the_pages_refuse_hvdrun_refuses(fields, refused):
    with pytest.raises(UsageError, match=refused):
        launch_line(**fields)


@pytest.mark.parametrize("fields", [
    dict(cluster="aurora", queue="debug-scaling", nodes=32, walltime="60"),
    dict(cluster="aurora", queue="capacity", nodes=16, walltime="168:00:00"),
    dict(cluster="aurora", queue="prod", nodes=256, walltime="12:00:00"),
    dict(cluster="sophia", queue="by-node", nodes=2, walltime="20:00:00"),
    dict(cluster="sophia", queue="by-gpu", nodes=8, walltime="24:00:00"),
])
def test_what_the_pages_allow_hvdrun_allows(fields):
    assert " -m hvdrun " in launch_line(**fields)
