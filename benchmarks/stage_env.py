"""Environment staging (``hvdrun --stage-env``): what staging costs, and how fast ranks start from the copy.

    python benchmarks/stage_env.py                      # this Python's environment (the checkout's .venv), 4 ranks
    python benchmarks/stage_env.py --ranks 4 --rounds 3

(Staging many hosts, the tree against every host reading one packed file: ``benchmarks/stage_tree.py``.)

Measured, each the median over ``--rounds`` (hvdrun's own one-line report gives the staging numbers):

- ``copy here``: a cold ``--stage-env`` on this machine (tar | tar of the environment into a fresh directory);
- ``already staged``: the check alone, when the copy is there;
- ``ranks from the env`` / ``ranks from the copy``: ``hvdrun -np N`` of ranks that ``import hvdrun.torch``
  (torch): the whole command, the last rank past its import (seconds from hvdrun's start, the staging check
  included), and the import alone as each rank times it (median over ranks and rounds), the two kinds of
  run alternating.

On one machine the "shared file system" is this machine's own disk, and the page cache holds the environment
after the first round: the benefit of staging (no metadata storm on Lustre at scale) cannot show here. What
this measures is the cost of staging, and that ranks started from the copy are no slower.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMPORT_TORCH = """
import os, time
started = time.perf_counter()
import hvdrun.torch
print(f"IMPORTED {time.time() - float(os.environ['BENCH_T0']):.3f} {time.perf_counter() - started:.3f}", flush=True)
"""
NOOP = "pass\n"
_STAGED = re.compile(r"staged .* in ([0-9.]+) s \(([0-9.]+ [kMG]?B) each: ")


def hvdrun(*args: str, cwd: Path, timeout_s: float = 600) -> tuple[float, str, str]:
    """Run hvdrun; (wall seconds, stdout, stderr). A failure stops the benchmark with hvdrun's error."""
    env = {**os.environ, "BENCH_T0": f"{time.time():.6f}", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hvdrun", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"hvdrun {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done.stdout, done.stderr


def staging_report(stderr: str) -> tuple[float, str]:
    """(seconds, size) from hvdrun's ``--stage-env`` line."""
    match = _STAGED.search(stderr)
    if not match:
        raise SystemExit(f"no staging line in hvdrun's output:\n{stderr[-2000:]}")
    return float(match[1]), match[2]


def cold_stage(work: Path, rounds: int, extra: Sequence[str] = ()) -> dict[str, object]:
    """A cold --stage-env (fresh directory) per round: hvdrun's reported seconds and size."""
    reports = []
    for round_ in range(rounds):
        stage_dir = work / f"cold-{round_}"
        _, _, stderr = hvdrun(*extra, "--stage-dir", str(stage_dir), "-np", "1", "noop.py", cwd=work)
        reports.append(staging_report(stderr))
        shutil.rmtree(stage_dir, ignore_errors=True)
    return {"seconds": statistics.median(r[0] for r in reports), "size": reports[0][1]}


def already_staged(work: Path, rounds: int) -> float:
    """Seconds hvdrun spends when the copy is there: a job with --stage-env minus the same job without it."""
    stage_dir = work / "warm"
    hvdrun("--stage-dir", str(stage_dir), "-np", "1", "noop.py", cwd=work)
    with_check = [hvdrun("--stage-dir", str(stage_dir), "-np", "1", "noop.py", cwd=work)[0] for _ in range(rounds)]
    without = [hvdrun("-np", "1", "noop.py", cwd=work)[0] for _ in range(rounds)]
    return max(statistics.median(with_check) - statistics.median(without), 0.0)


def rank_start(work: Path, ranks: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    """(whole command, last rank past ``import hvdrun.torch`` from hvdrun's start, the import alone in a rank) for
    ranks from the env and from the copy; medians over rounds (and ranks for the import)."""
    stage_dir = work / "warm"
    hvdrun("--stage-dir", str(stage_dir), "-np", "1", "noop.py", cwd=work)  # staged (and both caches warm)
    hvdrun("-np", str(ranks), "import_torch.py", cwd=work)
    runs: dict[str, list[tuple[float, float, list[float]]]] = {"env": [], "copy": []}
    for round_ in range(rounds):
        for kind in (("env", "copy") if round_ % 2 == 0 else ("copy", "env")):
            staged = ("--stage-dir", str(stage_dir)) if kind == "copy" else ()
            seconds, stdout, _ = hvdrun(*staged, "-np", str(ranks), "import_torch.py", cwd=work)
            found = [line.split("IMPORTED ")[1].split() for line in stdout.splitlines() if "IMPORTED " in line]
            runs[kind].append((seconds, max(float(f[0]) for f in found), [float(f[1]) for f in found]))
    return {kind: (statistics.median(r[0] for r in found), statistics.median(r[1] for r in found),
                   statistics.median(s for r in found for s in r[2])) for kind, found in runs.items()}


def table(results: dict[str, object], ranks: int) -> str:
    """The markdown table of the results."""
    here = results["here"]
    rows = [("stage: copy on this machine (cold)", here["size"], f"{here['seconds']:.1f}"),
            ("stage: already staged (the check)", "", f"{results['check']:.2f}")]
    for kind, label in (("env", "the env"), ("copy", "the staged copy")):
        whole, last, alone = results["start"][kind]
        rows.append((f"hvdrun -np {ranks}, ranks import hvdrun.torch from {label}", "",
                     f"{whole:.2f} (last rank imported at {last:.2f}; the import alone {alone:.2f})"))
    lines = ["| measure | bytes | seconds |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the start-up measure")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measure (median)")
    parser.add_argument("--start-rounds", type=int, help="rounds of the start-up measure (default --rounds)")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvdrun-stage-bench-"))
    try:
        (work / "noop.py").write_text(NOOP)
        (work / "import_torch.py").write_text(IMPORT_TORCH)
        results: dict[str, object] = {"env": sys.prefix, "here": cold_stage(work, args.rounds)}
        results["check"] = already_staged(work, args.rounds)
        results["start"] = rank_start(work, args.ranks, args.start_rounds or args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"environment {sys.prefix}, {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    print(table(results, args.ranks))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
