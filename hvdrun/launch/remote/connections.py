"""SSH connections to a job's hosts: resolved targets, verified host keys, parallel bounded connects.

* A host's target comes from the host (``user@name``), hvdrun's options (``-p``, ``-i``), the
  cluster YAML's ``ssh_port`` and ``~/.ssh/config`` (HostName, Port, User, IdentityFile), in that
  order of precedence.
* Host keys are checked against ``~/.ssh/known_hosts`` (hashed entries too) or
  ``--ssh-known-hosts``; an unknown or changed key is refused, never accepted.
* Connections open concurrently across hosts in a sliding window: at most :data:`MAX_PARALLEL_CONNECTS`
  handshakes in flight in all (the next starts as soon as one ends) and at most :data:`HANDSHAKES_PER_HOST`
  to one host (sshd's default ``MaxStartups 10:30:100`` drops handshakes beyond 10 in flight); the
  failures that such drops cause are retried.

hvdrun uses this module on its own machine, and the host agents use it to reach the hosts beneath them
(:mod:`hvdrun.launch.remote.host_agent.main`), with the targets hvdrun resolved and the same options.
"""

from __future__ import annotations

import base64
import errno
import getpass
import hashlib
import logging
import random
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdrun.errors import LaunchError

if TYPE_CHECKING:
    import paramiko

from hvdrun.hosts import Host

HANDSHAKES_PER_HOST = 4
MAX_PARALLEL_CONNECTS = 64
DEFAULT_SSH_PORT = 22
_RETRYABLE_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}


class HostKeyError(LaunchError):
    """A host's SSH key is unknown or differs from the one in known_hosts."""


@dataclass(frozen=True)
class SshOptions:
    """How hvdrun reaches hosts over SSH.

    Attributes:
        port: ``-p``; overrides the YAML's ``ssh_port`` and ``~/.ssh/config``.
        identity_file: ``-i``; tried before the keys ``~/.ssh/config`` names.
        known_hosts: ``--ssh-known-hosts``; default ``~/.ssh/known_hosts``.
        config_file: OpenSSH client config; default ``~/.ssh/config`` when it exists.
        default_port: the cluster YAML's ``ssh_port``.
        connect_timeout_s: per attempt, for TCP connect, banner and authentication.
    """

    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    config_file: str | None = None
    default_port: int | None = None
    connect_timeout_s: float = 10.0

    @property
    def known_hosts_path(self) -> Path:
        """The known_hosts file that vouches for host keys."""
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect for one host of the job."""

    host: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()

    def describe(self) -> str:
        """``root@h1 (10.200.0.1:22)``: the name the user gave and where it leads."""
        return f"{self.user}@{self.host} ({self.hostname}:{self.port})"


def _ssh_config(options: SshOptions) -> paramiko.SSHConfig | None:
    import paramiko

    path = Path(options.config_file or "~/.ssh/config").expanduser()
    if not path.is_file():
        if options.config_file:
            raise LaunchError(f"SSH config file '{options.config_file}' does not exist")
        return None
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, UnicodeDecodeError, paramiko.ConfigParseError) as e:
        raise LaunchError(f"cannot read SSH config '{path}': {e}") from e


def resolve_targets(hosts: Sequence[Host], options: SshOptions) -> list[SshTarget]:
    """The SSH target of every host (no network I/O)."""
    config = _ssh_config(options)
    return [_resolve(host, options, config) for host in hosts]


def _resolve(host: Host, options: SshOptions, config: paramiko.SSHConfig | None) -> SshTarget:
    entry: dict[str, Any] = dict(config.lookup(host.name)) if config else {}
    port = options.port or options.default_port or int(entry.get("port", DEFAULT_SSH_PORT))
    keys = [options.identity_file] if options.identity_file else []
    keys += [str(Path(k).expanduser()) for k in entry.get("identityfile", []) if Path(k).expanduser().is_file()]
    return SshTarget(host=host.name, hostname=str(entry.get("hostname", host.name)), port=port,
                     user=host.user or str(entry.get("user") or getpass.getuser()), key_files=tuple(keys))


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's fingerprint of a key: ``SHA256:`` + unpadded base64 of the key blob's digest."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _refuse_unknown_keys(target: SshTarget, known_hosts: Path) -> paramiko.MissingHostKeyPolicy:
    import paramiko

    class RefuseUnknown(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            where = known_hosts if known_hosts.is_file() else f"{known_hosts} (which does not exist)"
            port = f"-p {target.port} " if target.port != DEFAULT_SSH_PORT else ""
            raise HostKeyError(
                f"host key of {target.host} ({hostname}) is not known: {key.get_name()} {fingerprint(key)} is not "
                f"in {where}; refusing to connect. If that fingerprint is the host's, add it with "
                f"'ssh-keyscan {port}-t {key.get_name()} {target.hostname} >> {known_hosts}' (or ssh to it once)")

    return RefuseUnknown()


def _changed_key_error(target: SshTarget, error: paramiko.BadHostKeyException, known_hosts: Path) -> HostKeyError:
    return HostKeyError(
        f"host key of {target.host} ({target.hostname}) has CHANGED: the host offered {error.key.get_name()} "
        f"{fingerprint(error.key)} but {known_hosts} has {fingerprint(error.expected_key)}; refusing to connect "
        f"(someone may be intercepting the connection). If the host was reinstalled, remove the old key with "
        f"'ssh-keygen -f {known_hosts} -R {target.hostname}' and add the new one")


def _is_retryable(error: BaseException) -> bool:
    import paramiko

    if isinstance(error, paramiko.SSHException) and not isinstance(
            error, (paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return "banner" in str(error).lower() or "reset" in str(error).lower() or "EOF" in str(error)
    return isinstance(error, (EOFError, ConnectionResetError)) or (
        isinstance(error, OSError) and error.errno in _RETRYABLE_ERRNOS)


def _explain(target: SshTarget, error: BaseException, options: SshOptions, timeout_s: float) -> LaunchError:
    """The LaunchError that names why ``target`` could not be reached (and blames its host) in hvdrun's
    words, not paramiko's ("No existing session", "Error reading SSH protocol banner")."""
    explained = _handshake_failure(target, error, timeout_s) or _explanation(target, error, options)
    explained.host = target.host
    return explained


def _handshake_failure(target: SshTarget, error: BaseException, timeout_s: float) -> LaunchError | None:
    """A host that accepted TCP but never finished the SSH greeting: silent, or hung up on us."""
    import paramiko

    where = f"{target.host} ({target.user}@{target.hostname}:{target.port})"
    if isinstance(error, (TimeoutError, socket.timeout)):
        return LaunchError(f"{where} did not answer within {timeout_s:g} s (host down or port blocked?)")
    if not isinstance(error, paramiko.SSHException) or isinstance(
            error, (paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return None
    text, cause = str(error), error.__cause__ or error.__context__
    if text.startswith("Error reading SSH protocol banner") and isinstance(cause, (TimeoutError, socket.timeout)) \
            or text in ("No existing session", "Negotiation failed."):  # paramiko's start_client gave up waiting
        return LaunchError(f"{where} did not answer within {timeout_s:g} s: the TCP connection opened but no SSH "
                           "greeting came (sshd hung or overloaded, or another service on that port?)")
    if text.startswith("Error reading SSH protocol banner") or isinstance(cause, (EOFError, ConnectionError)):
        return LaunchError(f"{where} closed the connection during the SSH handshake (sshd's MaxStartups, "
                           "a firewall or TCP wrapper, or not an SSH server on that port?)")
    return None


def _explanation(target: SshTarget, error: BaseException, options: SshOptions) -> LaunchError:
    import paramiko

    if isinstance(error, HostKeyError):
        return error
    if isinstance(error, paramiko.BadHostKeyException):
        return _changed_key_error(target, error, options.known_hosts_path)
    if isinstance(error, paramiko.AuthenticationException):
        tried = ", ".join(target.key_files) or "the default keys in ~/.ssh and the agent"
        return LaunchError(f"cannot log in to {target.describe()}: authentication failed (tried {tried}); "
                           f"give the key with -i KEY or add it to ~{target.user}/.ssh/authorized_keys there")
    if isinstance(error, socket.gaierror):
        return LaunchError(f"cannot resolve host name '{target.hostname}' of {target.host}: {error.strerror}")
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError) and error.errors:
        error = next(iter(error.errors.values()))  # one per address tried; the first says why
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error) or type(error).__name__
    return LaunchError(f"cannot connect to {target.describe()}: {reason}")


def connect(target: SshTarget, options: SshOptions, deadline: float) -> paramiko.SSHClient:
    """Open one verified, authenticated connection; retry dropped handshakes until ``deadline``.

    Raises:
        HostKeyError: the host key is unknown or changed.
        LaunchError: anything else, naming the host.
    """
    import paramiko

    _quiet_paramiko()
    attempt = 0
    given_s = round(max(min(options.connect_timeout_s, deadline - time.monotonic()), 0.1), 1)
    while True:
        client = paramiko.SSHClient()
        if options.known_hosts_path.is_file():
            client.load_host_keys(str(options.known_hosts_path))
        client.set_missing_host_key_policy(_refuse_unknown_keys(target, options.known_hosts_path))
        timeout = max(min(options.connect_timeout_s, deadline - time.monotonic()), 0.1)
        try:
            client.connect(target.hostname, port=target.port, username=target.user,
                           key_filename=list(target.key_files) or None, timeout=timeout, banner_timeout=timeout,
                           auth_timeout=timeout, allow_agent=True, look_for_keys=True)
            transport = client.get_transport()
            assert transport is not None
            transport.set_keepalive(15)
            return client
        except Exception as e:  # noqa: BLE001 - paramiko raises many types; all are explained below
            client.close()
            attempt += 1
            if not _is_retryable(e) or time.monotonic() + 0.1 > deadline or attempt >= 8:
                raise _explain(target, e, options, given_s) from e
            time.sleep(min(0.05 * 2 ** attempt, 1.0) * (0.5 + random.random()))


def _quiet_paramiko() -> None:
    """paramiko logs a traceback for every dropped handshake; hvdrun retries them and reports only its own error."""
    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def connect_each(targets: Sequence[SshTarget], options: SshOptions,
                 deadline: float) -> list[paramiko.SSHClient | LaunchError]:
    """Connect to every target concurrently (a target listed k times gets k connections); each entry is the
    connection or the :class:`LaunchError` that names why it could not be opened.

    A sliding window: at most :data:`MAX_PARALLEL_CONNECTS` handshakes run at once, and at most
    :data:`HANDSHAKES_PER_HOST` against one host.
    """
    caps: dict[tuple[str, int], threading.Semaphore] = {}
    for target in targets:
        caps.setdefault((target.hostname, target.port), threading.Semaphore(HANDSHAKES_PER_HOST))

    def one(target: SshTarget) -> paramiko.SSHClient | LaunchError:
        with caps[(target.hostname, target.port)]:
            try:
                return connect(target, options, deadline)
            except LaunchError as e:
                return e

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(len(targets), MAX_PARALLEL_CONNECTS),
                            thread_name_prefix="hvdrun-ssh-connect") as pool:
        return list(pool.map(one, targets))


def connect_all(targets: Sequence[SshTarget], options: SshOptions, deadline: float) -> list[paramiko.SSHClient]:
    """Connect to every target as :func:`connect_each` does. If any connection fails, the ones that were opened
    are closed and the first failure (in target order) is raised."""
    opened = connect_each(targets, options, deadline)
    failures = [entry for entry in opened if isinstance(entry, LaunchError)]
    if failures:
        for entry in opened:
            if not isinstance(entry, LaunchError):
                entry.close()
        raise failures[0]
    return [entry for entry in opened if not isinstance(entry, LaunchError)]


def peer_address(client: paramiko.SSHClient) -> tuple[str, str]:
    """(our address on the route to the host, the host's address) of a connection."""
    transport = client.get_transport()
    assert transport is not None
    sock = transport.sock
    return str(sock.getsockname()[0]), str(sock.getpeername()[0])  # type: ignore[union-attr]


def run_command(client: paramiko.SSHClient, command: str, timeout_s: float) -> tuple[int, str, str]:
    """Run ``command`` on the host; return (exit status, stdout, stderr). -1: no status (connection lost)."""
    transport = client.get_transport()
    assert transport is not None
    channel = transport.open_session(timeout=timeout_s)
    channel.settimeout(timeout_s)
    try:
        channel.exec_command(command)
        channel.shutdown_write()
        stdout, stderr = bytearray(), bytearray()
        deadline = time.monotonic() + timeout_s
        while not (channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            if channel.recv_ready():
                stdout += channel.recv(65536)
            elif channel.recv_stderr_ready():
                stderr += channel.recv_stderr(65536)
            else:
                time.sleep(0.005)
        return channel.recv_exit_status(), stdout.decode(errors="replace"), stderr.decode(errors="replace")
    finally:
        channel.close()

