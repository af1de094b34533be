"""What an inspector asks rank 0 for, and the job's report it prints: one home for the launcher and the ranks.

An inspector that knows the job's secret (``hvdrun stacks``, or hvdrun on Ctrl-\\) connects to rank 0's
rendezvous (:mod:`hvdrun.runtime.rendezvous`) and sends ``(INSPECT, STACKS)`` (or ``(INSPECT, None)``) for every
rank's report, ``(INSPECT, VITALS)`` for every rank's vitals (``hvdrun top``, :mod:`hvdrun.runtime.vitals`), or
``(SIGNAL, N)`` to pass signal N to every rank's process (:func:`ask_rank0` sends one). Each rank's report
(:func:`hvdrun.runtime.forensics.rank_report`) is a plain dict: its host, pid, threads' stacks, the
collectives it waits in and its recent ones (rows ``[seq, name, kind, nbytes, started, ended]``).

:func:`format_reports` folds ranks with identical stacks into one entry ("ranks 0,2-7:") and names the first
divergence among the flight recorders ("rank 3 has not submitted #12 'grad.fc2' ..."); the launcher prints it
for ``hvdrun stacks``, rank 0 for its stall check.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from hvdrun.protocol.wire import authenticate_server, recv_frame, send_frame
from hvdrun.ranks import format_ranks

INSPECT = "inspect"
STACKS, VITALS = "stacks", "vitals"  # what an INSPECT asks every rank for
SIGNAL = "signal"  # an inspector's request: pass signal N to every rank's process (hvdrun --forward-signals)
MOMENT_S = 0.5  # reports taken further apart than this may show ranks at different moments of the job
REPORT_TIMEOUT_S = 3.0  # how long rank 0 waits for the ranks' reports (a rank stuck holding the GIL never answers)
CONNECT_TIMEOUT_S = 5.0
STACKS_HEADER = "hvdrun: stacks of "  # how the job's report begins (the job report keeps the last one printed)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hvdrun: frames inside it are ours


def ask_rank0(addr: str, port: int, secret: str, request: tuple[str, Any]) -> Any:
    """One authenticated request to the rank 0 that serves ``addr:port``, and its answer.

    Raises:
        OSError: rank 0 cannot be reached (the job ended, or has not started its rendezvous yet).
        RendezvousError: rank 0 refused the secret (another job now serves that port).
    """
    with socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S + REPORT_TIMEOUT_S)
        authenticate_server(sock, secret.encode(), f"rank 0 at {addr}:{port}")
        send_frame(sock, request)
        return recv_frame(sock)


def format_reports(reports: list[dict[str, Any]], size: int, absent: dict[int, str] | None = None,
                   now: float | None = None) -> str:
    """The job's report: the first divergence, then one entry per group of ranks with identical stacks and
    collectives, then the ranks that did not answer (``absent``: rank -> why)."""
    now = time.time() if now is None else now
    lines = [f"{STACKS_HEADER}{len(reports)} of {size} rank(s)"]
    divergence = first_divergence(reports, now)
    if divergence:
        lines.append(f"first divergence: {divergence}")
    groups: dict[str, list[int]] = {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        groups.setdefault(_entry(report, now), []).append(report["rank"])
    for entry, ranks in groups.items():
        hosts = sorted({r["host"] for r in reports if r["rank"] in ranks})
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} (on {', '.join(hosts)}):")
        lines.append(entry)
    reasons: dict[str, list[int]] = {}
    for rank, why in sorted((absent or {}).items()):
        reasons.setdefault(why, []).append(rank)
    for why, ranks in reasons.items():
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: no report: {why}")
    return "\n".join(lines)


def _entry(report: dict[str, Any], now: float) -> str:
    """What a rank does, without what differs between ranks in the same state (pid, exact times)."""
    out = []
    waiting = report["waiting"]
    if waiting:
        out.append("  waiting in: " + "; ".join(f"#{seq} {kind} '{name}' ({nbytes} B, {_age(now - started)})"
                                               for seq, name, kind, nbytes, started, _ in waiting))
    else:
        out.append("  waiting in: no collective")
    recent = report["recent"]
    if recent:
        out.append("  last collectives: " + ", ".join(f"#{seq} '{name}'" for seq, name, *_ in recent))
    for name, frames in report["threads"]:
        out.append(f"  thread {name}:")
        out.extend(f"    {frame}" for frame in frames)
    return "\n".join(out)


def _age(seconds: float) -> str:
    """``for over 10 s``: coarse, so that ranks waiting alike fold together."""
    bound = next((b for b in (300, 60, 10, 1) if seconds >= b), None)
    return f"for over {bound} s" if bound else "just now"


def first_divergence(reports: list[dict[str, Any]], now: float | None = None) -> str | None:
    """Where the ranks part ways: the collective most ranks wait in, and what each other rank does instead.

    ``rank 2 has not submitted #12 allreduce 'grad.fc2' that ranks 0,1,3 wait in: it finished #11
    'grad.fc1' 4 s ago and waits in no collective (main thread at train.py:14 in slow_step)``.
    """
    now = time.time() if now is None else now
    waiters: dict[str, list[int]] = {}
    for report in reports:
        for _, name, *_ in report["waiting"]:
            waiters.setdefault(name, []).append(report["rank"])
    if not waiters:
        return None
    name, ranks = max(waiters.items(), key=lambda item: (len(item[1]), -min(item[1])))
    others = [r for r in sorted(reports, key=lambda r: r["rank"]) if r["rank"] not in ranks]
    if not others:
        return None
    seq, kind = next((row[0], row[2]) for r in reports for row in r["waiting"] if row[1] == name)
    ahead = [r["rank"] for r in others if any(row[1] == name for row in r["recent"])]
    spread = max(r["time"] for r in reports) - min(r["time"] for r in reports)
    if ahead and spread > MOMENT_S:  # past the op others wait in, reported later: it completed in between
        return _different_moments(reports, ahead, ranks, f"#{seq} {kind} '{name}'")
    parts = [_elsewhere(report, name, now) for report in others]
    return (f"rank{'s' if len(others) > 1 else ''} {format_ranks([r['rank'] for r in others])} "
            f"{'have' if len(others) > 1 else 'has'} not reached #{seq} {kind} '{name}' that "
            f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} wait{'' if len(ranks) > 1 else 's'} in: "
            + "; ".join(parts))


def _different_moments(reports: list[dict[str, Any]], ahead: list[int], waiting: list[int], op: str) -> str:
    """Why no divergence is named: the reports do not show one moment (a rank holding the GIL answers late)."""
    latest = max(reports, key=lambda r: r["time"])
    spread = latest["time"] - min(r["time"] for r in reports)
    return (f"none that these reports can show: rank{'s' if len(ahead) > 1 else ''} {format_ranks(ahead)} finished "
            f"{op}, which rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} wait in, so the reports are "
            f"of different moments (taken over {spread:.1f} s, rank {latest['rank']} last: a rank that holds the GIL "
            "answers late); ask again")


def _elsewhere(report: dict[str, Any], name: str, now: float) -> str:
    """What one rank that is not waiting in ``name`` does instead."""
    rank = report["rank"]
    finished = [row for row in report["recent"] if row[1] == name]
    if finished:
        where = "finished it"
    elif report["recent"]:
        seq, last, *_, ended = report["recent"][-1]
        where = f"finished #{seq} '{last}' {now - ended:.1f} s ago"
    else:
        where = "has run no collective yet"
    waiting = report["waiting"]
    doing = (f"waits in #{waiting[0][0]} '{waiting[0][1]}'" if waiting
             else f"waits in no collective ({_main_frame(report)})")
    return f"rank {rank} {where} and {doing}"


def _main_frame(report: dict[str, Any]) -> str:
    """``main thread at train.py:14 in slow_step``: the innermost frame of the main thread outside hvdrun."""
    for name, frames in report["threads"]:
        if name == "MainThread" and frames:
            outside = [frame for frame in frames if not frame.startswith(PACKAGE_DIR + os.sep)]
            frame = (outside or frames)[-1]
            where, _, rest = frame.partition(" in ")
            return f"main thread at {os.path.basename(where)} in {rest.split(':')[0]}"
    return "its main thread's stack is unknown"
