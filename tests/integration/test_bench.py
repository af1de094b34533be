"""``hvdrun bench`` on this machine: the table, the JSON and a PNG that opens."""

from __future__ import annotations

import json
import struct

import pytest

pytestmark = pytest.mark.integration

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which must come first."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bench_sweeps_ranks_and_sizes_against_gloo_and_mpi(run_hvdrun, tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    done = run_hvdrun("bench", "-H", "localhost:2", "--sizes", "4K,256K", "--iterations", "2", "--warmup", "1",
                      "--json", str(out), "--plot", str(plot), timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "hvdrun-bench/1" and report["skipped"] == []
    measured = {(r["library"], r["ranks"], r["bytes"]) for r in report["rows"]}
    assert measured == {(lib, n, b) for lib in ("hvdrun", "gloo", "mpi") for n in (1, 2) for b in (4096, 262144)}
    for row in report["rows"]:
        assert row["seconds"] > 0 and row["hosts"] == 1
        assert row["busbw"] == pytest.approx(row["bytes"] / row["seconds"] * (row["ranks"] - 1))
        if row["library"] == "hvdrun":
            gloo = next(r for r in report["rows"] if (r["library"], r["ranks"], r["bytes"]) ==
                        ("gloo", row["ranks"], row["bytes"]))
            assert row["speedup_vs_gloo"] == pytest.approx(gloo["seconds"] / row["seconds"])
    assert report["efficiency"] == []  # every run fit on one host
    lines = done.stdout.splitlines()
    header = next(line for line in lines if "hvdrun time" in line)
    assert "gloo busbw" in header and "hvdrun vs gloo" in header and "hvdrun vs mpi" in header
    assert sum(1 for line in lines if "256 KB" in line) == 2 and "every run fit on one host" in done.stdout
    width, height = png_size(plot.read_bytes())
    assert width >= 600 and height >= 400 and plot.stat().st_size > 10_000


def test_scaling_efficiency_across_hosts_is_reported(run_hvdrun, ssh_hosts, tmp_path):
    out = tmp_path / "bench.json"
    done = run_hvdrun("bench", "-H", ssh_hosts.hosts(2, 2), *ssh_hosts.args(), "--np", "2,4", "--sizes", "64K",
                      "--libraries", "hvdrun", "--iterations", "2", "--json", str(out), "--no-plot", timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["ranks"], r["hosts"]) for r in report["rows"]] == [(2, 1), (4, 2)]
    (efficiency,) = report["efficiency"]
    assert efficiency["ranks"] == 4 and efficiency["baseline_ranks"] == 2 and efficiency["efficiency"] > 0
    assert "scaling efficiency vs one host" in done.stdout
    assert not (tmp_path / "hvdrun-bench.png").exists()


def test_bad_bench_options_are_usage_errors(run_hvdrun):
    for args, fragment in ((["--np", "1,x"], "not a comma-separated list"), (["--sizes", "4K,huge"], "not a size"),
                           (["--libraries", "nccl2"], "unknown 'nccl2'"), (["-H", "localhost:2", "--np", "4"], "")):
        done = run_hvdrun("bench", *args)
        assert done.returncode == 2 and done.stderr.startswith("hvdrun: error:") and fragment in done.stderr
