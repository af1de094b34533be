"""One verdict of ``hvdrun check`` (:class:`Check`): shared by the host checks, the node checks and the job."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One verdict: what was expected, what was found, and how to fix a failure (or a warning).

    A warning (``warn``) passes: the job would run, but something deserves a look (a slow link).
    """

    name: str
    ok: bool
    expected: str
    found: str
    fix: str | None = None
    warn: bool = False
