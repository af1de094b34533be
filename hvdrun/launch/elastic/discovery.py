"""Where an elastic job may run: a fixed host list, or a discovery script run again and again.

A discovery script (``--host-discovery-script``, Horovod's contract) prints one host per line,
``host`` or ``host:slots``; a line without slots gets ``--slots-per-host`` (else 1). Each run
replaces the previous answer: a host that disappears leaves the job, one that appears joins it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import replace

from hvdrun.errors import HostSpecError, UsageError
from hvdrun.hosts import Host, merge_duplicates, parse_host_item

DISCOVERY_TIMEOUT_S = 10.0


class DiscoveryError(UsageError):
    """The discovery script failed or printed something that is not a host list."""


class FixedHosts:
    """Discovery that always answers the hosts of ``-H`` / a hostfile / the allocation."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self.hosts = tuple(hosts)

    def find(self) -> tuple[Host, ...]:
        """The hosts and their slots, in rank order."""
        return self.hosts

    def describe(self) -> str:
        """How the hosts are found, for messages."""
        return "the fixed host list"


class ScriptDiscovery:
    """Runs ``script`` and parses its output; ``slots`` is the default for a line without ``:slots``."""

    def __init__(self, script: str, slots: int | None = None) -> None:
        self.script, self.slots = script, slots or 1

    def describe(self) -> str:
        """How the hosts are found, for messages."""
        return f"discovery script {self.script}"

    def find(self) -> tuple[Host, ...]:
        """Run the script once.

        Raises:
            DiscoveryError: it could not run, failed, timed out or printed a bad line.
        """
        try:
            done = subprocess.run([self.script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S,
                                  check=False)
        except OSError as e:
            raise DiscoveryError(f"--host-discovery-script {self.script}: cannot run it: {e.strerror}") from e
        except subprocess.TimeoutExpired as e:
            raise DiscoveryError(f"--host-discovery-script {self.script}: no answer within "
                                 f"{DISCOVERY_TIMEOUT_S:g} s") from e
        if done.returncode != 0:
            raise DiscoveryError(f"--host-discovery-script {self.script} exited with code {done.returncode}: "
                                 f"{done.stderr.strip()[-300:]}")
        return parse_discovery_output(done.stdout, self.script, self.slots)


def parse_discovery_output(text: str, script: str, default_slots: int) -> tuple[Host, ...]:
    """Hosts from a discovery script's output (blank lines and ``#`` comments skipped)."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--host-discovery-script {script}, line {number}"
        try:
            if ":" in line and not line.endswith("]"):
                hosts.append(parse_host_item(line, where))
            else:
                hosts.append(replace(parse_host_item(f"{line}:1", where), slots=default_slots))
        except HostSpecError as e:
            raise DiscoveryError(str(e)) from e
    try:
        return merge_duplicates(hosts, f"--host-discovery-script {script}")
    except HostSpecError as e:
        raise DiscoveryError(str(e)) from e


def make_discovery(script: str | None, slots_per_host: int | None, hosts: Sequence[Host]) -> FixedHosts | \
        ScriptDiscovery:
    """The discovery of an elastic job: the script when given, else the fixed hosts."""
    if script is None:
        return FixedHosts(hosts)
    return ScriptDiscovery(script, slots_per_host)
