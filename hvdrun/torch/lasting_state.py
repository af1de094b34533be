"""``--state-dir DIR``: ``hvd.elastic`` state that outlives the job, so an elastic script continues in the next job
of a chain (``hvdrun qsub --chain``) without code of its own.

At ``hvd.elastic.run``'s start every rank loads ``DIR/elastic-state.pt`` where it exists (then rank 0's copy is
broadcast as after any reset). At a commit rank 0 writes the committed state there, atomically (a reader sees the
old file or the new one, never half of one): when the warning before the walltime is due (``--warn-before``), or
when ``HVDRUN_STATE_INTERVAL_S`` (300) passed since it last did. After the warning's save every rank ends with exit
code 0: the job's work is kept and the next job resumes it. A save that fails is said on every rank, and the job
goes on.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hvdrun.envvars import STATE_DIR, STATE_INTERVAL_S
from hvdrun.runtime import context
from hvdrun.torch.functions import broadcast_object, save_checkpoint
from hvdrun.walltime import warning_due


class State(Protocol):
    """What this module needs of an ``hvd.elastic`` state (:class:`hvdrun.torch.elastic.State`)."""

    def snapshot(self) -> dict[str, Any]:
        """The last commit, as plain data."""

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Make ``snapshot`` the last commit and go back to it."""

STATE_FILE = "elastic-state.pt"
DEFAULT_INTERVAL_S = 300.0
_last_kept = time.monotonic()
_failed_before = False


def state_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """``DIR/elastic-state.pt`` of ``--state-dir`` (``HVDRUN_STATE_DIR``); None without one."""
    directory = (os.environ if environ is None else environ).get(STATE_DIR)
    return Path(directory) / STATE_FILE if directory else None


def resume(state: State) -> None:
    """Load the state the last job kept, where there is one (each rank that can read it; rank 0's is then
    broadcast by ``sync()``)."""
    path = state_file()
    if path is None or not path.is_file():
        return
    try:
        kept = torch.load(path, map_location="cpu", weights_only=False)
        state.load_snapshot(kept["state"])
    except Exception as e:  # noqa: BLE001 - any unreadable file (torn, foreign, of another script): said, not fatal
        _say(f"hvdrun: warning: rank {_rank()}: cannot read the elastic state in {path} ({type(e).__name__}: {e}); "
             "this rank takes rank 0's")
        return
    if _rank() == 0:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(kept.get("saved_at", 0)))
        _say(f"hvdrun: elastic: resumed from {path} (kept at {stamp})")


def keep_at_commit(state: State) -> None:
    """At a commit: rank 0 keeps the state in ``--state-dir`` when due; every rank hears how it went (one
    collective); after the warning's save, the job ends here with exit code 0."""
    global _last_kept, _failed_before
    path = state_file()
    if path is None or not context.is_initialized():
        return
    verdict: tuple[bool, str | None] = (False, None)  # (the job ends now, why the save failed)
    if _rank() == 0:
        warned = warning_due()
        if (warned and not _failed_before) or time.monotonic() - _last_kept >= _interval_s():
            error = _write(path, state)
            _last_kept = time.monotonic()  # after a failure too: the next try waits for the interval
            verdict = (warned and error is None, error)
    ends, error = broadcast_object(verdict, 0, name="hvdrun.elastic.kept")
    if error is not None and not _failed_before:
        _failed_before = True
        _say(f"hvdrun: warning: rank {_rank()}: the elastic state could not be kept in {path.parent} ({error}); the "
             "job goes on")
    if ends:
        if _rank() == 0:
            _say(f"hvdrun: elastic: the allocation ends soon: the state is kept in {path}; this job ends here and the "
                 "next resumes from it")
        raise SystemExit(0)


def _write(path: Path, state: State) -> str | None:
    """Write the committed state (rank 0, atomically); None, or why it could not be written."""
    payload: dict[str, Any] = {"state": state.snapshot(), "saved_at": time.time()}
    try:
        save_checkpoint(payload, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        return (e.strerror if isinstance(e, OSError) else None) or str(e)
    return None


def _interval_s() -> float:
    try:
        return float(os.environ.get(STATE_INTERVAL_S, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _rank() -> int:
    return context.current().world.rank


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
