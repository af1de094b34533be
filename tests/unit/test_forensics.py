"""Where every rank is (runtime/forensics.py, protocol/inspection.py): flight recorder, folding, divergence."""

from __future__ import annotations

import threading

from hvdrun.protocol.inspection import first_divergence, format_reports
from hvdrun.runtime.forensics import FlightRecorder, rank_report

NOW = 1000.0


def report(rank, waiting=(), recent=(), main=("train.py:9 in step",)):
    return {"rank": rank, "host": "h1" if rank < 2 else "h2", "pid": 100 + rank, "time": NOW,
            "threads": [["MainThread", list(main)]],
            "waiting": [[seq, name, "allreduce", 8, NOW - 20, 0.0] for seq, name in waiting],
            "recent": [[seq, name, "allreduce", 8, NOW - 30, NOW - 25] for seq, name in recent]}


def test_the_recorder_keeps_order_lands_flights_and_scrubs_a_fallback():
    recorder = FlightRecorder()
    first = recorder.take_off("a", "allreduce", 8)
    second = recorder.take_off("b", "allgather", 16)
    first.land()
    other = recorder.take_off("c", "broadcast", 4)  # another thread's op while the lane tried "b"
    recorder.scrub(second)  # a fast-lane attempt that went to the engine instead
    third = recorder.take_off("b", "allgather", 16)
    assert [(f.seq, f.name, bool(f.ended)) for f in recorder.snapshot()] == [
        (1, "a", True), (3, "c", False), (4, "b", False)]
    assert third.seq == 4 and other.seq == 3
    mine = rank_report(3, "h9", recorder)
    assert [row[:2] for row in mine["waiting"]] == [[3, "c"], [4, "b"]]
    assert [row[:2] for row in mine["recent"]] == [[1, "a"]]
    assert mine["threads"][0][0] == "MainThread" and mine["rank"] == 3


def test_hvdruns_own_threads_are_left_out_of_a_report():
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=name, daemon=True) for name in ("hvdrun-engine", "loader")]
    for thread in threads:
        thread.start()
    try:
        names = [name for name, _ in rank_report(0, "h", None)["threads"]]
    finally:
        stop.set()
    assert "loader" in names and "hvdrun-engine" not in names and names[0] == "MainThread"


def test_ranks_alike_fold_and_the_late_rank_is_named():
    reports = [report(r, waiting=[(4, "grad.fc2")], recent=[(3, "grad.fc1")]) for r in (0, 1, 3)]
    reports.append(report(2, recent=[(3, "grad.fc1")], main=("/x/train.py:14 in slow_step: sleep(9)",)))
    text = format_reports(reports, 5, {4: "has not joined rank 0"}, now=NOW)
    assert text.splitlines()[0] == "hvdrun: stacks of 4 of 5 rank(s)"
    assert ("first divergence: rank 2 has not reached #4 allreduce 'grad.fc2' that ranks 0-1,3 wait in: rank 2 "
            "finished #3 'grad.fc1' 25.0 s ago and waits in no collective (main thread at train.py:14 in slow_step)"
            ) in text
    assert "ranks 0-1,3 (on h1, h2):\n  waiting in: #4 allreduce 'grad.fc2' (8 B, for over 10 s)" in text
    assert "rank 2 (on h2):\n  waiting in: no collective\n  last collectives: #3 'grad.fc1'" in text
    assert text.endswith("rank 4: no report: has not joined rank 0")


def test_a_rank_already_in_the_next_collective_and_one_that_never_ran_one():
    reports = [report(0, waiting=[(2, "b")], recent=[(1, "a")]), report(1, waiting=[(2, "b")], recent=[(1, "a")]),
               report(2, waiting=[(3, "c")], recent=[(1, "a"), (2, "b")]), report(3)]
    said = first_divergence(reports, NOW)
    assert said is not None and said.startswith("ranks 2-3 have not reached #2 allreduce 'b' that ranks 0-1 wait in")
    assert "rank 2 finished it and waits in #3 'c'" in said
    assert "rank 3 has run no collective yet and waits in no collective" in said


def test_no_divergence_when_every_rank_waits_alike_or_none_waits():
    assert first_divergence([report(0, waiting=[(1, "a")]), report(1, waiting=[(1, "a")])], NOW) is None
    assert first_divergence([report(0), report(1)], NOW) is None


def test_reports_of_different_moments_name_no_divergence():
    """Rank 1 held the GIL and answered 2 s late, when the op ranks 0 and 2 waited in (at their report) was done."""
    reports = [report(0, waiting=[(2, "b")], recent=[(1, "a")]), report(2, waiting=[(2, "b")], recent=[(1, "a")]),
               {**report(1, recent=[(1, "a"), (2, "b")]), "time": NOW + 2.1}]
    assert first_divergence(reports, NOW + 2.1) == (
        "none that these reports can show: rank 1 finished #2 allreduce 'b', which ranks 0,2 wait in, so the reports "
        "are of different moments (taken over 2.1 s, rank 1 last: a rank that holds the GIL answers late); ask again")
