"""hvdrun.torch's training API with real processes: DistributedOptimizer, broadcasts, examples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("size, overlap", [(1, "0"), (2, "0"), (3, "0"), (2, "1")],
                         ids=["1", "2", "3", "2-overlapping-backward"])
def test_distributed_optimizer_equals_full_batch_training(run_hvdrun, hvdrun_env, tmp_path, size, overlap):
    hvdrun_env["HVDRUN_OVERLAP"] = overlap
    result = run_hvdrun("-np", str(size), str(WORKERS / "optimizer.py"), str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): optimizer ok", result.stdout))) == set(range(size))
    for label in ("sgd plain", "adam accumulate x3", "sgd groups=2", "adam predivide 2"):
        differences = [float(d) for d in re.findall(rf"{label}: max \|diff\| (\S+)", result.stdout)]
        assert len(differences) == size and max(differences) < 1e-9, (label, differences)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_linear_regression_example_matches_single_process_descent(run_hvdrun):
    result = run_hvdrun("-np", "2", str(EXAMPLES / "linear_regression.py"), "--check", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    coefficients = re.findall(r"coefficients=\[([^\]]+)\]", result.stdout)
    assert len(coefficients) == 2 and coefficients[0] == coefficients[1]
    assert [round(float(c)) for c in coefficients[0].split(",")] == [5, 3, 2, 1]
    differences = [float(d) for d in re.findall(r"single process\| = (\S+)", result.stdout)]
    assert len(differences) == 2 and max(differences) < 1e-12


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_through_every_collective(run_hvdrun, size):
    result = run_hvdrun("-np", str(size), str(WORKERS / "autograd.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): autograd ok", result.stdout))) == set(range(size))


def test_a_horovod_script_runs_with_only_its_import_changed(run_hvdrun, tmp_path):
    source = (WORKERS / "horovod_script.py").read_text()
    assert source.count("import horovod.torch as hvd") == 1
    script = tmp_path / "train.py"
    script.write_text(source.replace("import horovod.torch as hvd", "import hvdrun.torch as hvd"))
    result = run_hvdrun("-np", "2", str(script), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Train Epoch:") == 3
    assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout


def test_digits_example_trains_checkpoints_and_resumes(run_hvdrun, tmp_path):
    first = run_hvdrun("-np", "2", str(EXAMPLES / "digits.py"), "--epochs", "3", "--checkpoint-dir", "ck",
                       timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"checkpoint-{e}.pt" for e in range(3)]
    resumed = run_hvdrun("-np", "2", str(EXAMPLES / "digits.py"), "--epochs", "5", "--checkpoint-dir", "ck",
                         "--resume", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    epochs = [int(e) for e in re.findall(r"epoch (\d+): val_loss", resumed.stdout)]
    assert epochs == [3, 4]  # continued after the newest checkpoint
    accuracy = float(re.findall(r"val_accuracy=([\d.]+)", resumed.stdout)[-1])
    assert accuracy > 0.5, resumed.stdout


def test_synthetic_benchmark_example_reports_throughput(run_hvdrun):
    result = run_hvdrun("-np", "2", "--no-prefix", str(EXAMPLES / "synthetic_benchmark.py"), "--num-iters", "2",
                        "--num-batches-per-iter", "2", "--batch-size", "8", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"^Iter #\d: [\d.]+ img/sec per CPU$", result.stdout, re.MULTILINE)) == 2
    assert "Img/sec per CPU: " in result.stdout
    assert float(re.search(r"Total img/sec on 2 CPU\(s\): ([\d.]+)", result.stdout).group(1)) > 0


def trace_rows(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Per tensor name, its (event name, phase) sequence in a Chrome trace."""
    import json

    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    rows: dict[str, list[tuple[str, str]]] = {}
    for event in events:
        if event["ph"] in "BE":
            rows.setdefault(names[event["pid"]], []).append((event["name"], event["ph"]))
    return rows


def test_timeline_filename_writes_a_chrome_trace(run_hvdrun, tmp_path):
    result = run_hvdrun("-np", "2", "--timeline-filename", "trace.json", str(WORKERS / "timeline.py"), "unused")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("start_timeline() needs the environment variable HOROVOD_TIMELINE=DYNAMIC") == 2
    rows = trace_rows(tmp_path / "trace.json")
    assert set(rows) == {"small", "large", "gathered"}
    assert rows["large"] == [("NEGOTIATE_ALLREDUCE", "B"), ("NEGOTIATE_ALLREDUCE", "E"), ("ALLREDUCE", "B"),
                             ("ALLREDUCE", "E")]
    assert rows["gathered"][-1] == ("ALLGATHER", "E")



def test_a_timeline_filename_rank_0_could_not_write_is_a_usage_error_before_the_job(run_hvdrun, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = run_hvdrun("-np", "1", "--timeline-filename", "a-file/trace.json", "true")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"hvdrun: error: --timeline-filename a-file/trace.json: {tmp_path / 'a-file'} is not a "
                             "directory (rank 0 writes the timeline there when the job ends)\n")


def test_dynamic_timeline_starts_and_stops(run_hvdrun, hvdrun_env, tmp_path):
    hvdrun_env["HOROVOD_TIMELINE"] = "DYNAMIC"
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "timeline.json"
    result = run_hvdrun("-np", "2", str(WORKERS / "timeline.py"), str(tmp_path / "dynamic.json"), str(unwritable))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"hvdrun: warning: the timeline could not be written to {unwritable}: " in result.stderr
    assert "Traceback" not in result.stderr
    rows = trace_rows(tmp_path / "dynamic.json")
    assert set(rows) == {"small", "large", "gathered"}  # nothing after stop_timeline()
    import json

    events = json.loads((tmp_path / "dynamic.json").read_text())["traceEvents"]
    assert any(e["name"] == "CYCLE_START" for e in events)  # mark_cycles=True


@pytest.mark.parametrize("size", [2, 3])
def test_sync_batch_norm_equals_full_batch_batch_norm(run_hvdrun, size):
    result = run_hvdrun("-np", str(size), str(WORKERS / "sync_batch_norm.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): sync batch norm ok", result.stdout))) == set(range(size))


@pytest.mark.parametrize("size", [2, 3])  # Horovod's suite runs at 2 ranks
def test_join_lets_ranks_with_less_data_contribute_zeros(run_hvdrun, size):
    result = run_hvdrun("-np", str(size), str(WORKERS / "join.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = set(range(size))
    assert set(map(int, re.findall(rf"rank (\d+): join returned {size - 1}", result.stdout))) == ranks
    assert set(map(int, re.findall(r"rank (\d+): join ok", result.stdout))) == ranks
    for rank in range(1, size):
        assert (f"rank {rank} raised: allgather 'needs_everyone': rank(s) 0 already called join()"
                in result.stdout)
        # Horovod's test_horovod_join_allgather, twice, unnamed: the error each time; the joined rank counts the
        # numbers the others used, so each takes the next one, and so do the two submitted back to back
        numbers = re.findall(rf"rank {rank} raised for an (?:async )?unnamed allgather: allgather "
                             r"'allgather.noname.(\d)': rank\(s\) 0 already called join\(\)", result.stdout)
        assert sorted(numbers) == ["1", "2", "3", "4"], numbers
    assert set(map(int, re.findall(r"rank (\d+): unnamed ops in step after join", result.stdout))) == ranks


def test_process_sets_restrict_collectives_to_their_ranks(run_hvdrun):
    result = run_hvdrun("-np", "4", str(WORKERS / "process_sets.py"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): process sets ok", result.stdout))) == {0, 1, 2, 3}


def test_grouped_allgather_reducescatter_and_sparse_allreduce(run_hvdrun):
    result = run_hvdrun("-np", "3", str(WORKERS / "grouped.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(map(int, re.findall(r"rank (\d+): grouped ok", result.stdout))) == {0, 1, 2}


def test_grouped_ops_with_different_tensor_counts_fail_on_every_rank(run_hvdrun):
    result = run_hvdrun("-np", "2", str(WORKERS / "grouped_mismatch.py"), timeout=60)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank}: grouped mismatch ok" in result.stdout
        assert result.stdout.count(f"rank {rank}: grouped ") == 4


def test_checkpoint_is_streamed_and_stale_temp_files_are_removed(tmp_path, monkeypatch):
    """A one-rank job in this process: the save cleans up after a killed save and never copies the data."""
    import tracemalloc

    import torch

    import hvdrun.torch as hvd

    for name in ("HVDRUN_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    try:
        stale = tmp_path / ".ckpt.pt.hvdrun-tmp.abc123"
        stale.write_bytes(b"half a checkpoint")
        state = {"weights": torch.zeros(16 << 20, dtype=torch.uint8)}  # 16 MiB
        tracemalloc.start()
        written = hvd.save_checkpoint(state, tmp_path / "ckpt.pt")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert written == tmp_path / "ckpt.pt" and torch.load(written)["weights"].numel() == 16 << 20
        assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
        assert peak < 8 << 20, f"saving held {peak >> 20} MiB of Python memory: the checkpoint was buffered"
    finally:
        hvd.shutdown()
