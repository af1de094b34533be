"""Unit tests are pure: ``hvdrun qsub`` asks no scheduler here, whatever ``qstat``/``scontrol`` is on PATH (a test
that wants an answer gives :func:`hvdrun.jobs.queue_limits.decide` one, or patches ``ask_scheduler`` itself)."""

from __future__ import annotations

import pytest

from hvdrun.jobs import queue_limits


@pytest.fixture(autouse=True)
def _no_scheduler_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_limits, "ask_scheduler", lambda kind, queue, timeout_s=None: queue_limits.ServerAnswer())
