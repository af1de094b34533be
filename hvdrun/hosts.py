"""Host sources: ``-H`` strings, hostfiles, scheduler nodefiles and Slurm hostlists.

Every parser returns a tuple of :class:`Host` and raises :class:`HostSpecError` with the
offending text, what was expected and an example. Parsing does no network I/O.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdrun.errors import HostSpecError
from hvdrun.schedulers import COBALT, PBS, SLURM

# used with fullmatch: "$" would also accept a trailing newline
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_SLOTS_RE = re.compile(r"[0-9]{1,9}")
_TASKS_PER_NODE_RE = re.compile(r"(\d+)(?:\(x(\d+)\))?")
MAX_SLOTS_PER_HOST = 4096

HOST_EXAMPLE = "-H node1:4,node2:4 (also user@node1:4 and [fe80::1]:2)"
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})

# what the scheduler of an allocation sets: hosts come from the first one present
PBS_NODEFILE = "PBS_NODEFILE"
COBALT_NODEFILE = "COBALT_NODEFILE"
SLURM_JOB_NODELIST = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")  # the second: older Slurm
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"


@dataclass(frozen=True)
class Host:
    """One machine of the job.

    Attributes:
        name: hostname or address as the user wrote it (IPv6 without brackets).
        slots: how many ranks may run on it.
        user: login name for SSH, or None for the current user.
        python: the Python interpreter to use there (cluster YAML ``python:``/``venv:``), or None
            for the launcher's own.
    """

    name: str
    slots: int
    user: str | None = None
    python: str | None = None

    @property
    def ssh_target(self) -> str:
        """``user@name`` or ``name``, the string an SSH client connects to."""
        return f"{self.user}@{self.name}" if self.user else self.name


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine (no DNS lookup: names and interface addresses only)."""
    if name in LOCAL_NAMES or name.startswith("127.") or name == socket.gethostname():
        return True
    import psutil

    return any(addr.address.split("%")[0] == name for addrs in psutil.net_if_addrs().values() for addr in addrs)


def validate_hostname(name: str, where: str) -> str:
    """Return ``name`` (an IPv6 address loses its brackets) or raise HostSpecError.

    Only letters, digits, ``.``, ``-`` and ``_`` are allowed, so a host name can never
    smuggle shell syntax into a remote command.
    """
    if name.startswith("[") and name.endswith("]"):
        inner = name[1:-1]
        try:
            ipaddress.IPv6Address(inner.split("%", 1)[0])
        except ValueError:
            raise HostSpecError(f"{where}: '{name}' is not a valid IPv6 address in brackets") from None
        return inner
    if not _HOSTNAME_RE.fullmatch(name):
        raise HostSpecError(
            f"{where}: invalid host name {name!r}; expected letters, digits, '.', '-' or '_' "
            "(IPv6 addresses go in brackets, e.g. [fe80::1])"
        )
    return name


def _split_user(text: str, where: str) -> tuple[str | None, str]:
    if "@" not in text:
        return None, text
    user, _, host = text.partition("@")
    if not _USER_RE.fullmatch(user):
        raise HostSpecError(f"{where}: invalid user name {user!r} in {text!r}")
    return user, host


def _parse_slots(text: str, where: str) -> int:
    if not _SLOTS_RE.fullmatch(text) or not 1 <= int(text) <= MAX_SLOTS_PER_HOST:
        raise HostSpecError(f"{where}: slots must be a positive integer, got {text!r} "
                            f"(at most {MAX_SLOTS_PER_HOST} per host)")
    return int(text)


def parse_host_item(item: str, where: str = "-H") -> Host:
    """Parse one ``[user@]host:slots`` item (IPv6 hosts in brackets: ``[::1]:2``)."""
    if any(ord(char) < 32 or ord(char) == 127 for char in item):
        raise HostSpecError(f"{where}: {item!r} holds a newline or another control character; "
                            f"expected e.g. {HOST_EXAMPLE}")
    text = item.strip()
    user, rest = _split_user(text, where)
    host_part, sep, slots_part = rest.rpartition(":")
    if not sep or not host_part or (":" in host_part and not host_part.startswith("[")):
        raise HostSpecError(f"{where}: {item!r} is not host:slots; expected e.g. {HOST_EXAMPLE}")
    name = validate_hostname(host_part, where)
    return Host(name=name, slots=_parse_slots(slots_part, f"{where} '{item}'"), user=user)


def merge_duplicates(hosts: Iterable[Host], where: str) -> tuple[Host, ...]:
    """Reject a host listed twice: its slots would be ambiguous."""
    hosts = tuple(hosts)
    seen: set[tuple[str | None, str]] = set()
    for host in hosts:
        key = (host.user, host.name)
        if key in seen:
            raise HostSpecError(f"{where}: host '{host.name}' is listed more than once; "
                                "give it once with all its slots")
        seen.add(key)
    return hosts


def parse_host_string(spec: str) -> tuple[Host, ...]:
    """Parse ``-H a:4,b:4``.

    Args:
        spec: comma-separated ``[user@]host:slots`` items.

    Returns:
        The hosts in the given order.
    """
    items = spec.split(",")
    if not spec.strip() or any(not item.strip() for item in items):
        raise HostSpecError(f"-H: empty host in {spec!r}; expected e.g. {HOST_EXAMPLE}")
    return merge_duplicates([parse_host_item(item) for item in items], "-H")


def _parse_hostfile_line(line: str, where: str) -> Host:
    fields = line.split()
    user, name = _split_user(fields[0], where)
    host, sep, count = name.rpartition(":")
    if sep and count.isdigit() and host and not host.startswith("["):
        raise HostSpecError(f"{where}: {fields[0]!r} is the -H form; a hostfile line is 'host slots=N': "
                            f"write '{fields[0].rpartition(':')[0]} slots={count}'")
    slots = None
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if key != "slots" or not sep:
            raise HostSpecError(f"{where}: unknown field {field!r}; expected 'host slots=N'")
        if slots is not None:
            raise HostSpecError(f"{where}: slots= is given more than once; expected 'host slots=N'")
        slots = _parse_slots(value, where)
    return Host(name=validate_hostname(name, where), slots=slots or 1, user=user)


def parse_hostfile(path: str | Path) -> tuple[Host, ...]:
    """Parse a hostfile: one ``[user@]host [slots=N]`` per line, ``#`` comments, blank lines."""
    text = _read(path, "hostfile")
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_parse_hostfile_line(line, f"hostfile {path}, line {number}"))
    if not hosts:
        raise HostSpecError(f"hostfile {path}: no hosts found; expected lines like 'node1 slots=4'")
    return merge_duplicates(hosts, f"hostfile {path}")


def parse_nodefile(path: str | Path, kind: str) -> tuple[Host, ...]:
    """Parse a PBS or Cobalt nodefile: one host per line, repeated once per slot.

    Duplicates are folded keeping first-seen order; a host's slots are its line count.
    """
    text = _read(path, f"{kind} nodefile")
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise HostSpecError(f"{kind} nodefile {path} is empty; expected one host name per line")
    counts = Counter(names)
    ordered = dict.fromkeys(names)
    where = f"{kind} nodefile {path}"
    return tuple(Host(validate_hostname(name, where), counts[name]) for name in ordered)


def excluded_hosts(names: str | None, path: str | Path | None) -> frozenset[str]:
    """Host names to leave out: ``--exclude-hosts a,b`` and a file of one name per line (``#`` comments), as
    ``hvdrun check --write-excludes`` writes it."""
    listed = [validate_hostname(name.strip(), "--exclude-hosts") for name in (names or "").split(",") if name.strip()]
    if path is not None:
        lines = [line.split("#", 1)[0].strip() for line in _read(path, "--exclude-hosts-file").splitlines()]
        listed += [validate_hostname(line, f"--exclude-hosts-file {path}") for line in lines if line]
    return frozenset(listed)


def without_excluded(hosts: tuple[Host, ...], excluded: frozenset[str]) -> tuple[Host, ...]:
    """``hosts`` less the excluded ones (matched by name).

    Raises:
        HostSpecError: every host is excluded.
    """
    kept = tuple(host for host in hosts if host.name not in excluded)
    if excluded and not kept:
        raise HostSpecError(f"every host is excluded ({', '.join(sorted(excluded))}); nothing is left to run on")
    return kept


def expand_slurm_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``nid[001-004,007],gpu[1-2]`` (zero padding kept)."""
    import hostlist  # python-hostlist

    try:
        names = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise HostSpecError(
            f"SLURM_JOB_NODELIST: cannot expand '{nodelist}' ({e}); expected e.g. 'nid[001-004,007],gpu[1-2]'"
        ) from e
    if not names:
        raise HostSpecError(f"SLURM_JOB_NODELIST is empty ('{nodelist}')")
    return names


def parse_tasks_per_node(spec: str, node_count: int) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) to one count per node."""
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS_PER_NODE_RE.fullmatch(item.strip())
        if not match:
            raise HostSpecError(f"SLURM_TASKS_PER_NODE: cannot parse '{spec}'; expected e.g. '2(x3),1'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if len(counts) != node_count:
        raise HostSpecError(
            f"SLURM_TASKS_PER_NODE '{spec}' describes {len(counts)} nodes but the nodelist has {node_count}"
        )
    return counts


def parse_slurm_allocation(nodelist: str, tasks_per_node: str | None) -> tuple[Host, ...]:
    """Hosts of a Slurm allocation; slots from ``SLURM_TASKS_PER_NODE`` when set, else 1."""
    names = expand_slurm_hostlist(nodelist)
    slots = parse_tasks_per_node(tasks_per_node, len(names)) if tasks_per_node else [1] * len(names)
    where = SLURM_JOB_NODELIST[0]
    return merge_duplicates([Host(validate_hostname(n, where), s) for n, s in zip(names, slots, strict=True)], where)


def detect_allocation(environ: Mapping[str, str]) -> tuple[str, tuple[Host, ...]] | None:
    """The scheduler allocation hvdrun runs inside, as ``(scheduler, hosts)``, or None.

    PBS (``PBS_NODEFILE``), Cobalt (``COBALT_NODEFILE``) and Slurm (``SLURM_JOB_NODELIST``)
    are tried in that order.
    """
    if environ.get(PBS_NODEFILE):
        return PBS, parse_nodefile(environ[PBS_NODEFILE], "PBS")
    if environ.get(COBALT_NODEFILE):
        return COBALT, parse_nodefile(environ[COBALT_NODEFILE], "Cobalt")
    nodelist = environ.get(SLURM_JOB_NODELIST[0]) or environ.get(SLURM_JOB_NODELIST[1])
    if nodelist:
        return SLURM, parse_slurm_allocation(nodelist, environ.get(SLURM_TASKS_PER_NODE))
    return None


def _read(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise HostSpecError(f"cannot read {what} '{path}': {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise HostSpecError(f"{what} '{path}' is not a text file") from e
