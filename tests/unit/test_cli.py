"""Every usage error: exit code 2, one clear line naming what was wrong, no traceback, nothing started."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from hvdrun.cli import cli


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("PBS_NODEFILE", "COBALT_NODEFILE", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)

    def run(*args, env=None):
        return CliRunner().invoke(cli, list(args), env=env)

    return run


def assert_usage_error(result, tmp_path, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("hvdrun: error: ") and result.output.count("\n") == 1, result.output
    for fragment in fragments:
        assert fragment in result.output
    assert not (tmp_path / "started").exists(), "a worker was started despite the error"


START = ("touch", "started")


@pytest.mark.parametrize("args, fragments", [
    (("-H", "node1:x"), ["-H 'node1:x': slots must be a positive integer, got 'x'"]),
    (("-H", "node1"), ["'node1' is not host:slots", "-H node1:4,node2:4"]),
    (("-H", "a;reboot:1"), ["invalid host name 'a;reboot'"]),
    (("-np", "5", "-H", "localhost:2"), ["-np 5 is more than the 2 slots"]),
    (("-np", "0"), ["Invalid value for '-np'"]),
    (("--bogus",), ["no such option '--bogus'"]),
    (("-H", "localhost:1", "--hostfile", "h"), ["either -H or --hostfile"]),
    (("--cluster", "frontier"), ["unknown cluster 'frontier'"]),
    (("--cluster", "localhost", "--config", "x.yaml"), ["either --cluster NAME or --config FILE"]),
    (("-x", "HVDRUN_SURELY_UNSET"), ["-x HVDRUN_SURELY_UNSET: HVDRUN_SURELY_UNSET is not set"]),
    (("-np", "2", "--gpus-per-node", "1"), ["host 'localhost' has 1 GPUs but local rank 1 needs"]),
    (("--launcher", "local", "-H", "elsewhere.invalid:2"), ["host 'elsewhere.invalid' is not this machine"]),
    (("-p", "0"), ["Invalid value for '-p'"]),
    (("-i", "no-such-key"), ["'no-such-key' does not exist"]),
    (("--min-np", "1", "--blacklist-scope", "rack"), ["Invalid value for '--blacklist-scope'", "'slot', 'host'"]),
])
def test_usage_errors(invoke, tmp_path, args, fragments):
    assert_usage_error(invoke(*args, *START), tmp_path, *fragments)


def test_hostfile_error_names_file_and_line(invoke, tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=2\nlocalhost2 slots=two\n")
    assert_usage_error(invoke("--hostfile", "hosts", *START), tmp_path, "hostfile hosts, line 2: slots must be")


def test_yaml_error_names_file_and_key(invoke, tmp_path):
    (tmp_path / "c.yaml").write_text("gpus_per_node: 1\nlauncher: local\nslotz: 3\n")
    assert_usage_error(invoke("--config", "c.yaml", *START), tmp_path, "c.yaml: unknown key 'slotz'; allowed keys")


@pytest.mark.parametrize("option", ["--config", "--config-file"])
def test_invalid_yaml_is_one_line_with_line_and_column(invoke, tmp_path, option):
    (tmp_path / "bad.yaml").write_text("launcher: local\nenv:\n  A: b: c\n")
    assert_usage_error(invoke(option, "bad.yaml", *START), tmp_path,
                       "bad.yaml:3:7: not valid YAML: mapping values are not allowed here")


def test_missing_nodefile_of_the_allocation(invoke, tmp_path):
    result = invoke(*START, env={"PBS_NODEFILE": str(tmp_path / "gone")})
    assert_usage_error(result, tmp_path, "cannot read PBS nodefile", "gone")


def test_bad_slurm_nodelist_of_the_allocation(invoke, tmp_path):
    result = invoke(*START, env={"SLURM_JOB_NODELIST": "nid[3-1]"})
    assert_usage_error(result, tmp_path, "SLURM_JOB_NODELIST: cannot expand 'nid[3-1]'")


def test_missing_script_and_program(invoke, tmp_path):
    assert_usage_error(invoke("train.py"), tmp_path, "script 'train.py' not found")
    assert_usage_error(invoke("no-such-program-hvd"), tmp_path, "program 'no-such-program-hvd' not found")


def test_no_command(invoke, tmp_path):
    assert_usage_error(invoke("-np", "2"), tmp_path, "no command given; expected e.g. 'hvdrun -np 2 train.py'")
    assert_usage_error(invoke(), tmp_path, "no command given")


@pytest.mark.parametrize("args, fragments", [
    (("--bogus",), ["no such option '--bogus'", "see 'hvdrun --help'"]),
    (("-np", "0"), ["Invalid value for '-np' / '--num-proc': 0 is not in the range x>=1"]),
    (("--hostfile", "."), ["'--hostfile': File '.' is a directory", "is a directory"]),
    (("-H", "localhost:99999999999999999999"), ["slots must be a positive integer", "at most 4096 per host"]),
    (("-H", "localhost:5000"), ["at most 4096 per host"]),
    (("--start-timeout", "nan"), ["'nan' must be a finite number of seconds above 0"]),
    (("--start-timeout", "0"), ["'0' must be a finite number of seconds above 0"]),
    (("--grace-period", "inf"), ["'inf' must be a finite number of seconds"]),
    (("--grace-period", "-1"), ["'-1' must be a finite number of seconds"]),
    (("-H", ""), ["-H: empty host in ''"]),
    (("-H", "localhost\n:1"), [r"-H: 'localhost\n:1' holds a newline or another control character"]),
    (("-H", "a\nb:1"), [r"-H: 'a\nb:1' holds a newline"]),
    (("-x", "FOO\n=1"), ["is not a valid environment variable name"]),
    (("--output-dir", "afile/sub"), ["--output-dir afile/sub: cannot create it"]),
])
def test_every_bad_input_is_one_line(invoke, tmp_path, args, fragments):
    (tmp_path / "afile").write_text("")
    assert_usage_error(invoke(*args, *START), tmp_path, *fragments)


def test_binary_files_are_usage_errors(invoke, tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00binary")
    assert_usage_error(invoke("--config", "bin.yaml", *START), tmp_path, "bin.yaml' is not a UTF-8 text file")
    assert_usage_error(invoke("--hostfile", "bin.yaml", *START), tmp_path, "bin.yaml' is not a text file")


def test_repeated_slots_in_a_hostfile(invoke, tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1 slots=2\n")
    assert_usage_error(invoke("--hostfile", "hosts", *START), tmp_path, "line 1: slots= is given more than once")


@pytest.mark.parametrize("name, value, fragment", [
    ("HVDRUN_START_TIMEOUT", "abc", "HVDRUN_START_TIMEOUT='abc' is not a number"),
    ("HOROVOD_FUSION_THRESHOLD", "abc", "HOROVOD_FUSION_THRESHOLD='abc' is not a number"),
    ("HOROVOD_CYCLE_TIME", "-5", "HOROVOD_CYCLE_TIME='-5': expected a finite number of at least 0"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "nan", "expected a finite number"),
])
def test_bad_tuning_variables_stop_the_launch(invoke, tmp_path, name, value, fragment):
    assert_usage_error(invoke(*START, env={name: value}), tmp_path, fragment)


def test_error_is_one_line(invoke, tmp_path):
    result = invoke("-H", "node1:x", *START)
    assert result.output.strip().count("\n") == 0
    assert result.output.startswith("hvdrun: error: ")


def test_allocation_hosts_are_used_when_none_given(invoke, tmp_path):
    (tmp_path / "nodefile").write_text("localhost\nlocalhost\n")
    result = invoke("--no-prefix", "python3", "-c", "import os; print('size', os.environ['HVDRUN_SIZE'])",
                    env={"PBS_NODEFILE": str(tmp_path / "nodefile")})
    assert result.exit_code == 0, result.output
    assert result.output.count("size 2") == 2


def test_version_and_help(invoke):
    assert invoke("--version").output.startswith("hvdrun, version")
    assert "COMMAND" in invoke("run", "--help").output


def test_verbose_prints_the_rank_plan_and_start_timeout_reaches_the_ranks(invoke):
    result = invoke("-np", "2", "--verbose", "--start-timeout", "7", "--no-prefix", "python3", "-c",
                    "import os; print('timeout', os.environ['HVDRUN_START_TIMEOUT'])")
    assert result.exit_code == 0, result.output
    assert "hvdrun: 2 ranks, launcher local" in result.output
    assert "  1     localhost             1/2    0/1    -" in result.output
    assert result.output.count("timeout 7.0") == 2


@pytest.mark.parametrize("args, fragments", [
    (("--nproc-per-node", "2", "t.py"), ["no such option '--nproc-per-node'; in hvdrun use -np N"]),
    (("--nnodes", "2", "t.py"), ["no such option '--nnodes'; in hvdrun use -H host1:N,host2:N"]),
    (("--gpus-per-nod", "2", "t.py"), ["no such option '--gpus-per-nod'; did you mean '--gpus-per-node'"]),
    (("--hsots", "a:2", "t.py"), ["no such option '--hsots'; did you mean '-H/--hosts'"]),
    (("--hots", "a:2", "t.py"), ["no such option '--hots'; did you mean '-H/--hosts'"]),
    (("--hostfil", "f", "t.py"), ["no such option '--hostfil'; did you mean '-hostfile/--hostfile'"]),
    (("--sltos", "2", "t.py"), ["no such option '--sltos'; did you mean '--slots-per-host/--slots'"]),
    (("--autotune", "t.py"), ["--autotune cannot apply in hvdrun: hvdrun has no autotuner"]),
    (("--hierarchical-allreduce", "t.py"), ["--hierarchical-allreduce cannot apply in hvdrun"]),
    (("--binding-args", "-bind-to core", "t.py"), ["--binding-args cannot apply in hvdrun: give binding options"]),
    (("--mpi", "--launcher", "ssh", "t.py"), ["--mpi runs the ranks under MPI, but --launcher ssh does not"]),
    (("--fusion-threshold-mb", "-1", "t.py"), ["Invalid value for '--fusion-threshold-mb'"]),
    (("--log-level", "loud", "t.py"), ["Invalid value for '--log-level'"]),
])
def test_horovodrun_options_refused_or_redirected(invoke, tmp_path, args, fragments):
    assert_usage_error(invoke(*args), tmp_path, *fragments)


@pytest.mark.parametrize("text, fragment", [
    ("params: {fusion_threshold_mb: lots}\n", "'params.fusion_threshold_mb' must be float, got 'lots'"),
    ("params: {hierarchical_allreduce: true}\n", "'params.hierarchical_allreduce: true' cannot apply"),
    ("autotune: {enabled: true}\n", "'autotune.enabled: true' cannot apply: hvdrun has no autotuner"),
    ("params: {fusion_mb: 1}\n", "unknown key 'params.fusion_mb'; allowed: fusion_threshold_mb"),
    ("tuning: {}\n", "unknown section 'tuning'"),
    ("controller: nccl\n", "'controller' is 'nccl'; expected gloo or mpi"),
    ("stall_check: {warning_time_seconds: -3}\n", "must be a finite number >= 0"),
])
def test_config_file_errors_name_the_key(invoke, tmp_path, text, fragment):
    (tmp_path / "horovod.yaml").write_text(text)
    assert_usage_error(invoke("--config-file", "horovod.yaml", *START), tmp_path, "horovod.yaml", fragment)


def test_check_build_and_short_version(invoke):
    report = invoke("-cb").output
    assert "Available Controllers:" in report and "[X] PyTorch (" in report and "[X] Gloo" in report
    assert invoke("-v").output.startswith("hvdrun, version")


def test_help_shows_run_options_subcommands_and_environment(invoke):
    text = invoke("--help").output
    for fragment in ("Run options (hvdrun run):", "-np, --num-proc", "--fusion-threshold-mb", "--horovod-compat",
                     "Commands:", "check", "bench", "qsub", "Environment:", "HOROVOD_FUSION_THRESHOLD",
                     "HVDRUN_BACKEND"):
        assert fragment in text, fragment


def test_importing_the_cli_loads_no_heavy_library():
    heavy = ("jinja2", "torch", "paramiko", "rich", "yaml", "matplotlib", "numpy")
    code = f"import sys, hvdrun.cli; print(sorted(set({heavy!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_launcher_loads_none_of_the_worker_runtime():
    code = ("import sys, hvdrun.launch.job, hvdrun.launch.ssh, hvdrun.launch.local; "
            "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('hvdrun.runtime')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
