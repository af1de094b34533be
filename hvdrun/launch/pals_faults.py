"""The node Cray PALS ``mpiexec`` says it could not reach: the sick node is the one named, not the one reporting.

PALS launches through a tree of its daemons; when one cannot pass a launch (or a ping) on to a child node, the
parent prints the failure (ALCF's known issues, docs/polaris/known-issues.md and docs/aurora/known-issues.md in
argonne-lcf/user-guides; ezpz PR 244 saw the parent differ in each of four production cases while the child was
always the node that stopped answering)::

    launch failed on x3104c0s1b0n0: Couldn't forward RPC launch(ab751d77-...) to child
        x3104c0s31b0n0.hsn.cm.polaris.alcf.anl.gov: Resource temporarily unavailable
    ping failed on x4304c1s6b0n0: No reply from x4307c2s6b0n0.hostmgmt2307.cm.aurora.alcf.anl.gov after 87s
    ping RPC timeout from x4212c7s0b0n0.hostmgmt2212.cm.aurora.alcf.anl.gov after 120s

:class:`PalsLines` reads mpiexec's own lines (a line may break before the child's name) and keeps the first node
named; :func:`job_host` finds it among the job's hosts (the same node under another domain: ``.hsn.`` for the
high-speed network, ``.hostmgmtNNNN.`` for management, or none).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

_FORWARD = re.compile(r"(\w+) failed on (\S+?): Couldn't forward RPC \w+\([^)]*\) to child(?:\s+([^\s:]+))?")
_NO_REPLY = re.compile(r"(\w+) failed on (\S+?): No reply from ([^\s:]+) after")
_TIMEOUT = re.compile(r"(\w+) RPC timeout from ([^\s:]+) after")
_NAME_START = re.compile(r"\s*([^\s:]+)")


@dataclass(frozen=True)
class SickNode:
    """A node PALS could not reach: its name as PALS printed it, who said so, and the line."""

    name: str
    reporter: str | None
    line: str

    def describe(self) -> str:
        """``PALS could not reach node X (launch failed on P: Couldn't forward RPC ... to child X: ...)``."""
        return f"PALS could not reach node {self.name} ({self.line.strip()})"


class PalsLines:
    """Reads mpiexec's own output lines; :attr:`sick` is the first node PALS said it could not reach."""

    def __init__(self) -> None:
        self.sick: SickNode | None = None
        self._waiting: tuple[str, str] | None = None  # (reporter, line) of a forward failure whose child wrapped

    def feed(self, line: str) -> None:
        """One line of mpiexec's own output."""
        if self.sick is not None:
            return
        if self._waiting is not None:
            reporter, first = self._waiting
            self._waiting = None
            name = _NAME_START.match(line)
            if name:
                self.sick = SickNode(name.group(1), reporter, f"{first.strip()} {line.strip()}")
                return
        self.sick = self._read(line)

    def _read(self, line: str) -> SickNode | None:
        forward = _FORWARD.search(line)
        if forward and forward.group(3):
            return SickNode(forward.group(3), forward.group(2), line)
        if forward:
            self._waiting = (forward.group(2), line)
            return None
        no_reply = _NO_REPLY.search(line)
        if no_reply:
            return SickNode(no_reply.group(3), no_reply.group(2), line)
        timeout = _TIMEOUT.search(line)
        return SickNode(timeout.group(2), None, line) if timeout else None


def job_host(name: str, hosts: Iterable[str]) -> str | None:
    """The host of ``hosts`` that PALS's ``name`` is: the same name, that name with a domain, or the same node
    name under another domain (``x4513c0s7b0n0.hsn...`` is ``x4513c0s7b0n0.hostmgmt2513...``)."""
    for host in hosts:
        if name == host or name.startswith(f"{host}.") or host.startswith(f"{name}."):
            return host
    short = name.split(".")[0]
    for host in hosts:
        if not _is_address(host) and host.split(".")[0] == short:
            return host
    return None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
