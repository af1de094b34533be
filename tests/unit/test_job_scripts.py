"""Job scripts: golden files of every template x shipped cluster, and every validation error.

Regenerate the golden files after an intended change with ``HVDRUN_REGOLD=1 pytest tests/unit/test_job_scripts.py``
and review the diff.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner

from hvdrun.cli import cli
from hvdrun.config import available_clusters, format_hms, parse_walltime
from hvdrun.errors import ConfigError, UsageError
from hvdrun.jobs.render import check_script, render_script
from hvdrun.jobs.scheduler import ScriptRules
from hvdrun.jobs.spec import JobRequest, build_spec

GOLDEN = Path(__file__).parent / "golden"
WORKDIR = "/home/me/run"
COMMAND = ("train.py", "--epochs", "3", "--name", "it's $HOME")

CASES = {
    "polaris": dict(cluster="polaris", nodes=2, account="MyProject"),
    "aurora": dict(cluster="aurora", nodes=2, account="MyProject", walltime="50", queue="debug-scaling"),
    "sophia": dict(cluster="sophia", nodes=2, account="MyProject", queue="by-node"),
    "sophia-by-gpu": dict(cluster="sophia", nodes=4, account="MyProject", queue="by-gpu", walltime="30"),
    "thetagpu-cobalt": dict(cluster="thetagpu-cobalt", nodes=2, account="MyProject", walltime="01:30:00"),
    "slurm": dict(cluster="slurm", nodes=2, ranks_per_node=4, gpus_per_node=4, queue="gpu", account="MyProject",
                  venv="/home/me/venv"),
    "polaris-everything": dict(
        cluster="polaris", nodes=8, account="MyProject", queue="debug-scaling", walltime="45", filesystems="home,grand",
        job_name="resnet50", error="/home/me/run/logs/train.err", modules=("cudatoolkit",), conda="/home/me/env",
        exports=("NCCL_DEBUG=INFO", "NOTE=a b;c"), setup=("ulimit -c 0",), directives=("-l mig_config=/x.json",),
        after=("1234.polaris-pbs-01",), run_args="--verbose"),
    "cobalt-everything": dict(
        cluster="thetagpu-cobalt", nodes=1, account="MyProject", queue="single-gpu", walltime="20", ranks_per_node=1,
        after=("101", "102"), directives=("--attrs mig-mode=True",), python="/opt/py/bin/python"),
    "slurm-everything": dict(
        scheduler="slurm", nodes=3, walltime="2-00:00:00", account="acct", job_name="big",
        directives=("#SBATCH --constraint=a100", "--exclusive"), after=("77",), exports=("A=1",),
        python="/usr/bin/python3", run_args="--launcher ssh --network-interface ib0"),
    "polaris-restarts": dict(cluster="polaris", nodes=2, account="MyProject", max_restarts=3, spares=1),
    "polaris-stage-env": dict(cluster="polaris", nodes=2, account="MyProject", stage_env=True,
                              stage_dir="/local/scratch", run_args="--launcher ssh"),
    "slurm-gpu": dict(cluster="slurm-gpu", nodes=2, account="MyProject"),
    "slurm-amd": dict(cluster="slurm-amd", nodes=4, account="MyProject", walltime="02:00:00"),
}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.setenv("HVDRUN_JOBS_DIR", str(tmp_path / "registry"))


SUBMITTING_PYTHON = "/home/me/venv/bin/python"  # the Python running `hvdrun qsub`, the job's by default


def render(**fields):
    fields.setdefault("output", "/home/me/run/logs/train.output")
    with mock.patch.object(sys, "executable", SUBMITTING_PYTHON):
        return render_script(build_spec(JobRequest(command=COMMAND, **fields), now=0, workdir=WORKDIR))


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_script(case):
    text = render(**CASES[case])
    path = GOLDEN / f"{case}.sh"
    if os.environ.get("HVDRUN_REGOLD"):
        path.write_text(text)
    assert text == path.read_text(), f"{case}: rendered script differs from {path}"


def test_every_shipped_scheduler_cluster_has_a_golden_file():
    covered = {fields.get("cluster") for fields in CASES.values()}
    assert set(available_clusters()) - covered == {"localhost"}  # the one machine without a scheduler


@pytest.mark.parametrize("text, seconds, hms", [
    ("90", 5400, "01:30:00"), ("01:30:00", 5400, "01:30:00"), ("0:05:00", 300, "00:05:00"),
    ("1-12:00:00", 129600, "36:00:00"), (30, 1800, "00:30:00")])
def test_walltime_normalised(text, seconds, hms):
    assert parse_walltime(text, "-t") == seconds
    assert format_hms(seconds) == hms


def test_walltime_per_scheduler():
    assert "#PBS -l walltime=01:30:00" in render(cluster="polaris", account="P", walltime="90", queue="capacity")
    assert "#SBATCH --time=01:30:00" in render(scheduler="slurm", walltime="90")
    assert "#COBALT -t 90\n" in render(cluster="thetagpu-cobalt", account="P", walltime="01:30:00")
    assert "#COBALT -t 2\n" in render(cluster="thetagpu-cobalt", account="P", walltime="0:01:01")  # rounded up


def test_values_are_quoted_by_the_code():
    text = render(scheduler="slurm", exports=("X=$(reboot)",), output="/tmp/a b/out.log")
    assert "export X='$(reboot)'" in text
    assert "--output='/tmp/a b/out.log'" in text
    assert "echo \"$rc\" > '/tmp/a b/out.exitcode'" in text
    assert "'it'\"'\"'s $HOME'" in text  # the command's arguments arrive verbatim


@pytest.mark.parametrize("fields", [dict(cluster="polaris", account="P"), dict(scheduler="slurm"),
                                    dict(cluster="thetagpu-cobalt", account="P", walltime="30")])
def test_restarts_reach_the_hvdrun_line_of_every_scheduler(fields):
    def launch(**extra):
        return next(line for line in render(nodes=2, **fields, **extra).splitlines() if " -m hvdrun " in line)

    assert " --max-restarts 2 --spares 1 -- train.py " in launch(max_restarts=2, spares=1)
    assert " --max-restarts 0 -- train.py " in launch(max_restarts=0)  # given: passed on as given
    assert "--max-restarts" not in launch() and "--spares" not in launch()


def test_the_warning_reaches_the_hvdrun_line_and_a_chain_warns_a_tenth_of_its_walltime():
    def launch(**fields):
        return next(line for line in render(account="P", cluster="polaris", **fields).splitlines()
                    if " -m hvdrun --" in line)

    assert " --warn-before 300 --warn-signal USR2 -- train.py " in launch(warn_before=300, warn_signal="USR2")
    assert " --warn-before 360 -- train.py " in launch(chain=2)  # 01:00:00 / 10
    assert " --warn-before 600 -- train.py " in launch(chain=2, walltime="24:00:00", queue="prod", nodes=100)
    assert "--warn-before" not in launch()


def test_the_scripts_of_a_chain_judge_it_first_and_last():
    from hvdrun.jobs.chain import first_link, link_spec

    spec = build_spec(JobRequest(command=("train.py",), cluster="polaris", account="P", chain=3))
    text = render_script(first_link(spec))
    stem = spec.exit_file.removesuffix(".exitcode")
    lines = text.splitlines()
    begin = lines.index(f"{spec.launch[0]} -m hvdrun chain-link begin {stem}.chain.json 1 || {{ rc=$?; "
                        f"[ \"$rc\" -eq 3 ] && exit 0; echo \"$rc\" > {stem}.1.exitcode; exit \"$rc\"; }}")
    assert lines[begin + 1] == f"export HVDRUN_JOB_EVENTS={stem}.1.events.json"
    assert lines[begin + 3].startswith("trap 'stopped_by=SIGTERM; echo ") and lines[begin + 3].endswith("' TERM")
    assert f"{spec.launch[0]} -m hvdrun chain-link end {stem}.chain.json 1 \"$rc\" \"$stopped_by\"" in lines
    assert "#PBS -W depend" not in text and f"#PBS -o {stem}.1.output" in text
    second = render_script(link_spec(spec, Path(f"{stem}.chain.json"), 2, "77.pbs"))
    assert "#PBS -W depend=afterany:77.pbs" in second and f" {stem}.chain.json 2 " in second
    assert "chain-link" not in render_script(spec)  # a job of no chain: as before


def test_copper_starts_before_the_ranks_reads_the_jobs_site_packages_and_stops_at_any_exit():
    spec = build_spec(JobRequest(command=("train.py",), cluster="aurora", account="P", copper=True,
                                 python="/lus/flare/me/venv/bin/python"))
    lines = render_script(spec).splitlines()
    logs = f"{spec.output.removesuffix('.output')}.copper-logs"
    start = lines.index('hvdrun_copper_mount="/tmp/${USER}/copper_mount"')
    assert lines[start - 1] == "module load frameworks"  # the machine's setup first
    assert lines[start:start + 6] == [
        'hvdrun_copper_mount="/tmp/${USER}/copper_mount"', f"hvdrun_copper_logs={logs}", "module load copper",
        'launch_copper.sh -d "$hvdrun_copper_logs" -v "$hvdrun_copper_mount"',
        """trap 'stop_copper.sh -d "$hvdrun_copper_logs" -v "$hvdrun_copper_mount"' EXIT""",
        """export PYTHONPATH="$hvdrun_copper_mount$(/lus/flare/me/venv/bin/python -c 'import sysconfig; """
        """print(sysconfig.get_paths()[\"purelib\"])')${PYTHONPATH:+:$PYTHONPATH}\""""]
    assert lines.index("if ! /lus/flare/me/venv/bin/python -c 'import hvdrun' 2>/dev/null; then") > start + 5
    assert "copper" not in render(cluster="aurora", account="P")  # only when asked (aurora.yaml: when: asked)


def test_copper_says_where_it_does_not_help():
    spec = build_spec(JobRequest(command=("train.py",), cluster="aurora", account="P", copper=True,
                                 python="/proc/self/exe"))  # a directory not even root can write: the system's
    assert spec.notices[-1].startswith("--copper: the job's Python (/proc/self/exe) is the site's, not yours "
                                       "(/proc/self is not writable to you")


def test_a_cluster_file_can_give_copper_to_every_job_with_its_own_environment(tmp_path):
    config = tmp_path / "site.yaml"
    config.write_text("scheduler:\n  kind: pbs\n  copper: {module: copper, launch: launch_copper.sh, stop: "
                      "stop_copper.sh, mount: '/tmp/${USER}/copper_mount', when: custom_env}\n")
    with_env = render_script(build_spec(JobRequest(command=("train.py",), config_file=str(config),
                                                   venv=str(tmp_path / "venv"))))
    assert "launch_copper.sh -d " in with_env
    assert "launch_copper.sh" not in render_script(build_spec(JobRequest(command=("train.py",),
                                                                         config_file=str(config))))
    config.write_text("scheduler:\n  copper: {module: copper, launch: launch_copper.sh, stop: stop_copper.sh, "
                      "mount: '/tmp/$(reboot)'}\n")
    with pytest.raises(ConfigError, match=r"scheduler.copper.mount must be given, e.g. '/tmp/\$\{USER\}/copper_mount', "
                                          r"got '/tmp/\$\(reboot\)'"):
        build_spec(JobRequest(command=("train.py",), config_file=str(config)))


def test_report_reaches_the_hvdrun_line_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = next(line for line in render(nodes=2, account="P", cluster="polaris", report="reports/job.html")
                .splitlines() if " -m hvdrun " in line)
    assert f" --report {tmp_path / 'reports' / 'job.html'} -- train.py " in line


def test_stage_env_reaches_the_hvdrun_line_whatever_its_launcher():
    def launch(**fields):
        return next(line for line in render(nodes=2, account="P", **fields).splitlines() if " -m hvdrun " in line)

    assert " --stage-env --launcher ssh -- train.py " in launch(cluster="polaris", stage_env=True,
                                                                  run_args="--launcher ssh")
    assert " --stage-env --stage-dir /l --launcher=local -- train.py " in launch(
        cluster="slurm", stage_dir="/l/", run_args="--launcher=local")
    assert " --stage-env " in launch(cluster="aurora", stage_env=True, walltime="50", queue="debug-scaling")  # PALS
    assert " --stage-env " in launch(scheduler="slurm", stage_env=True)  # srun starts the relays
    assert " --stage-env -- train.py " in render(scheduler="slurm", nodes=1, stage_env=True)  # one node: local
    with pytest.raises(UsageError, match="--stage-dir 'scratch': expected an absolute path"):
        launch(cluster="polaris", stage_dir="scratch", run_args="--launcher ssh")


def test_default_output_is_a_stamped_file_in_hvdrun_jobs(tmp_path):
    spec = build_spec(JobRequest(command=COMMAND, scheduler="slurm"), workdir=WORKDIR)
    assert re.fullmatch(re.escape(str(tmp_path)) + r"/hvdrun-jobs/train-\d{8}-\d{6}\.output", spec.output)
    assert spec.script_path == spec.output.replace(".output", ".slurm.sh")
    assert spec.exit_file == spec.output.replace(".output", ".exitcode")


@pytest.fixture
def invoke():
    def run(*args):
        return CliRunner().invoke(cli, ["qsub", *args])
    return run


def assert_usage_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("hvdrun: error: ") and result.output.count("\n") == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


POLARIS = ("--cluster", "polaris", "-A", "P")


@pytest.mark.parametrize("args, fragments", [
    (("--cluster", "polaris"), ["-A/--account is required on polaris"]),
    (("--cluster", "polaris", "-A", "P", "--filesystems", ""), ["--filesystems is required on polaris"]),
    ((*POLARIS, "--filesystems", "home,nosuchfs"), ["'nosuchfs' is not a filesystem of this machine",
                                                   "allowed: home, eagle, grand"]),
    ((*POLARIS, "-q", "nosuch"), ["-q/--queue 'nosuch' is not a queue of polaris", "debug, debug-scaling"]),
    ((*POLARIS, "-n", "3"), ["-n/--nodes 3: queue 'debug' on polaris takes 1 to 2 nodes"]),
    ((*POLARIS, "-q", "prod", "-n", "4"), ["-n/--nodes 4: queue 'prod' on polaris takes 10 to 496 nodes"]),
    ((*POLARIS, "-t", "61"), ["-t/--walltime 01:01:00: queue 'debug' on polaris allows at most 01:00:00"]),
    ((*POLARIS, "-t", "1:30"), ["walltime '1:30' is not minutes (e.g. 90) or HH:MM:SS"]),
    ((*POLARIS, "-t", "0"), ["walltime '0' must be longer than zero"]),
    (("--cluster", "sophia", "-A", "P", "-q", "by-gpu", "-n", "3"),
     ["-n/--nodes 3: queue 'by-gpu' on sophia takes 1 2 4 8 gpus"]),
    (("--cluster", "sophia", "-A", "P", "-q", "by-node", "-t", "24:00:01"),
     ["-t/--walltime 24:00:01: queue 'by-node' on sophia allows at most 24:00:00"]),
    (("--cluster", "aurora", "-A", "P", "-q", "debug-scaling", "-n", "300"),
     ["-n/--nodes 300: queue 'debug-scaling' on aurora takes 2 to 256 nodes"]),
    (("--cluster", "aurora", "-A", "P", "-q", "prod-large", "-n", "2000"),
     ["-q/--queue 'prod-large' is not a queue of aurora; allowed: debug, debug-scaling, prod, capacity"]),
    (("--cluster", "aurora", "-A", "P", "-q", "prod", "-n", "10", "-t", "20"),
     ["-n/--nodes 10: queue 'prod' on aurora takes 256 to 10624 nodes"]),
    (("--cluster", "aurora", "-A", "P", "-q", "prod", "-n", "1000", "-t", "13:00:00"),
     ["sends 1000 nodes to 'small' (256-1024 nodes), which allows at most 12:00:00"]),
    (("--cluster", "polaris", "-A", "P", "-q", "prod", "-n", "24", "-t", "03:30:00"),
     ["queue 'prod' on polaris sends 24 nodes to 'small' (10-24 nodes), which allows at most 03:00:00"]),
    (("--cluster", "polaris", "-A", "P", "-q", "prod", "-n", "99", "-t", "07:00:00"),
     ["sends 99 nodes to 'medium' (25-99 nodes), which allows at most 06:00:00"]),
    (("--cluster", "sophia", "-A", "P", "-q", "by-gpu", "-n", "2", "-t", "24:00:01"),
     ["queue 'by-gpu' on sophia allows at most 24:00:00"]),
    (("--cluster", "thetagpu-cobalt", "-t", "30"), ["-A/--account is required on thetagpu-cobalt"]),
    (("--cluster", "aurora", "-A", "P", "--ranks-per-node", "16"),
     ["--ranks-per-node 16: ", "aurora.yaml: cpu_bind lists cores for 12 ranks per node"]),
    (("--cluster", "thetagpu-cobalt", "-A", "P", "-t", "13:00:00"), ["allows at most 12:00:00"]),
    ((*POLARIS, "-A", "P; rm -rf ~"), ["-A/--account 'P; rm -rf ~': expected letters, digits"]),
    ((*POLARIS, "-q", "$(id)"), ["-q/--queue '$(id)'"]),
    ((*POLARIS, "-N", "1job"), ["-N/--job-name '1job': expected a letter"]),
    ((*POLARIS, "--after", "12;x"), ["--after '12;x': expected a job id"]),
    ((*POLARIS, "--directive", "-l a=b\n#PBS -l c=d"), ["one directive per option, no line breaks"]),
    ((*POLARIS, "--directive", "-l a=b # why"), ["no comments on a directive line"]),
    ((*POLARIS, "--directive", "place=scatter"), ["expected pbs options such as '-l place=scatter'"]),
    ((*POLARIS, "--export", "1X=2"), ["--export '1X=2': expected VAR=VALUE"]),
    (("--scheduler", "slurm", "--filesystems", "home"), ["Slurm has no filesystems request"]),
    (("--cluster", "polaris", "--config", "x.yaml"), ["either --cluster NAME or --config FILE"]),
    ((), ["name the scheduler: --scheduler {pbs,cobalt,slurm}"]),
    (("--cluster", "localhost"), ["cluster 'localhost'", "has no 'scheduler:' section"]),
    (("--cluster", "nosuch"), ["unknown cluster 'nosuch'"]),
    ((*POLARIS, "--dry-run", "--submit"), ["--dry-run prints the script only"]),
    ((*POLARIS, "--template", "nosuch.j2"), ["--template 'nosuch.j2': no such file "
                                             "(shipped: pbs.sh.j2, cobalt.sh.j2, slurm.sh.j2)"]),
    ((*POLARIS, "-n", "0"), ["Invalid value for '-n'"]),
    ((*POLARIS, "-n", "2", "--max-restarts", "-1"), ["Invalid value for '--max-restarts'"]),
    ((*POLARIS, "-n", "2", "--max-restarts", "1", "--spares", "2"),
     ["--spares 2 with -n/--nodes 2: no node would be left to run on", "e.g. -n 3 --spares 2"]),
    ((*POLARIS, "-n", "2", "--spares", "1"), ["--spares 1: spare nodes only take over at a restart",
                                              "give --max-restarts N too"]),
    (("--cluster", "sophia", "-A", "P", "-q", "by-gpu", "-n", "4", "--max-restarts", "1", "--spares", "1"),
     ["--spares 1: this queue counts the GPUs of one node"]),
    ((*POLARIS, "--warn-before", "3600"), ["--warn-before 3600: the job's walltime is 3600 s; the warning must come "
                                           "before its end, e.g. --warn-before 360"]),
    ((*POLARIS, "--chain", "0"), ["--chain 0: expected at least 1 job"]),
    (("--scheduler", "slurm", "--chain", "2"), ["--chain 2: a chain continues jobs that end at their walltime; give "
                                                "-t/--walltime"]),
    ((*POLARIS, "--chain", "2", "--after", "12"), ["--chain 2 with --after 12: a chain's first job starts when"]),
    (("--cluster", "thetagpu-cobalt", "-A", "P", "-t", "60", "--chain", "3"),
     ["--chain 3: Cobalt's --dependencies starts a job only after the others succeeded"]),
    ((*POLARIS, "--warn-signal", "USR2"), ["--warn-signal USR2: give --warn-before S too"]),
    ((*POLARIS, "--copper"), ["--copper: cluster 'polaris' (", "polaris.yaml) has no Copper (no scheduler.copper in "
                                                                "its file); ALCF runs Copper on Aurora"]),
    ((*POLARIS, "--warn-before", "60", "--warn-signal", "TERM"), ["--warn-signal TERM: SIGTERM stops the job"]),
])
def test_validation_errors(invoke, args, fragments):
    assert_usage_error(invoke(*args, "--", "train.py"), *fragments)


def test_missing_script_is_a_usage_error(invoke):
    assert_usage_error(invoke(*POLARIS, "--", "nosuch.py"), "script 'nosuch.py' not found")


def test_custom_template_with_strict_undefined(invoke, tmp_path):
    (tmp_path / "t.sh.j2").write_text("#!/bin/bash\n{% for d in directives %}{{ d }}\n{% endfor %}{{ nosuch }}\n")
    assert_usage_error(invoke(*POLARIS, "--template", str(tmp_path / "t.sh.j2"), "--", "train.py"),
                       "'nosuch' is undefined")


@pytest.mark.parametrize("scheduler, body, fragment", [
    ("thetagpu-cobalt", "#!/bin/bash\n\n{% for d in directives %}{{ d }}\n{% endfor %}",
     "comes after the first command or blank line"),
    ("thetagpu-cobalt", "#!/bin/bash\n{{ directives[0] }}\n\n{% for d in directives[1:] %}{{ d }}\n{% endfor %}",
     "#COBALT directives there are ignored"),
    ("polaris", "#!/bin/bash\n{{ directives[0] }}\n# a note\n{% for d in directives[1:] %}{{ d }}\n{% endfor %}",
     "comment inside the #PBS block ('# a note')"),
    ("polaris", "#!/bin/bash\ncd /tmp\n{% for d in directives %}{{ d }}\n{% endfor %}",
     "comes after the first command"),
    ("polaris", "echo no shebang\n", "must start with a '#!' line"),
    ("polaris", "#!/bin/bash\necho nothing\n", "no #PBS directives at the top"),
])
def test_scheduler_directive_rules_on_custom_templates(invoke, tmp_path, scheduler, body, fragment):
    (tmp_path / "t.sh.j2").write_text(body)
    account = ("-A", "P", "-t", "30")
    assert_usage_error(invoke("--cluster", scheduler, *account, "--template", str(tmp_path / "t.sh.j2"), "--",
                              "train.py"), fragment)


def test_pbs_rules_allow_comments_after_the_block():
    check_script("#!/bin/bash\n#PBS -A x\n#PBS -q y\n\n# note\necho hi\n", ScriptRules("#PBS", comments_in_block=False),
                 "t")
    with pytest.raises(UsageError, match="comment on a directive line"):
        check_script("#!/bin/bash\n#PBS -A x #note\n", ScriptRules("#PBS", comments_in_block=False), "t")


def test_dry_run_prints_the_script_and_writes_nothing(invoke, tmp_path):
    result = invoke(*POLARIS, "--dry-run", "--", "train.py")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("#!/bin/bash -l\n#PBS -A P\n")
    assert not (tmp_path / "hvdrun-jobs").exists()


def test_aurora_prod_takes_256_nodes_and_up():
    assert "#PBS -l select=256:system=aurora" in render(cluster="aurora", account="A", queue="prod", nodes=256)


def test_the_job_runs_the_submitting_python_by_default_and_an_environment_when_named():
    assert render(cluster="polaris", account="A", **{}).count(f"{SUBMITTING_PYTHON} -m hvdrun") == 1
    assert "\npython -m hvdrun" in render(cluster="polaris", account="A", conda="/envs/torch")
    assert "/opt/venv/bin/python -m hvdrun" in render(cluster="polaris", account="A", venv="/opt/venv")


@pytest.mark.parametrize("line, python", [
    ("python: /opt/site/bin/python3", "/opt/site/bin/python3"),
    ("venv: /lus/me/venv/", "/lus/me/venv/bin/python"),
])
def test_the_cluster_files_python_or_venv_runs_the_job_unless_an_option_names_another(tmp_path, line, python):
    config = tmp_path / "site.yaml"
    config.write_text(f"{line}\nscheduler: {{kind: pbs, walltime: '30'}}\n")
    text = render(config_file=str(config))
    assert f"\n{python} -m hvdrun" in text and SUBMITTING_PYTHON not in text
    assert "/opt/other/bin/python -m hvdrun" in render(config_file=str(config), python="/opt/other/bin/python")


def test_a_job_whose_python_cannot_import_hvdrun_fails_at_its_start_in_one_line(tmp_path):
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else pytest.skip("no /usr/bin/python3")
    text = render_script(build_spec(JobRequest(command=("train.py",), cluster="slurm", python=python,
                                               output=str(tmp_path / "job.out")), now=0, workdir=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and f"hvdrun: error: the job's Python {python} cannot import hvdrun" \
        in done.stderr, done.stderr
    assert (tmp_path / "job.exitcode").read_text().strip() == "2"


def test_qsub_warns_when_the_jobs_python_cannot_import_hvdrun_here(tmp_path):
    from hvdrun.jobs.spec import python_warning

    assert python_warning(sys.executable) is None and python_warning("python") is None
    assert "does not exist on this machine" in (python_warning(str(tmp_path / "bin" / "python")) or "")
    bare = tmp_path / "python"  # a Python that exits 1 for any program: it cannot import hvdrun
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(0o755)
    assert "cannot import hvdrun on this machine" in (python_warning(str(bare)) or "")
