"""Typed exceptions, one per failure domain.

Every error hvdrun raises on purpose derives from :class:`HvdrunError`. The CLI maps
them to exit codes in one place (``hvdrun.cli.main``); nothing else prints errors.
Messages say what was given, what was expected and, where it helps, an example.
"""

from __future__ import annotations

USAGE_EXIT_CODE = 2


class HvdrunError(Exception):
    """Base of every error hvdrun raises deliberately."""

    exit_code: int = 1


class UsageError(HvdrunError):
    """The command line asks for something impossible (exit code 2)."""

    exit_code = USAGE_EXIT_CODE


class HostSpecError(UsageError):
    """A host list, hostfile or scheduler nodefile could not be parsed."""


class ConfigError(UsageError):
    """A cluster YAML file is missing, malformed or has an invalid key."""


class LaunchError(HvdrunError):
    """Workers could not be started; ``host``: the host that could not be reached or used, when one is to blame."""

    def __init__(self, message: str, host: str | None = None) -> None:
        super().__init__(message)
        self.host = host


class StartCancelled(LaunchError):
    """A stop (a signal to hvdrun) was decided while ranks were being started: nothing more starts."""


class WorkerFailed(HvdrunError):
    """A worker exited with a non-zero status; carries that status as the exit code.

    Where one rank is the root cause: ``host`` it ran on (None: the launcher cannot tell), ``signal`` that
    killed it (None: it exited), ``cause``, the last lines of its stderr (what a restart compares to tell a bug
    from a bad node), and ``note``, the launcher's account when the exit status alone does not say why (a lost
    SSH connection; mpiexec exited and no rank said why).
    """

    def __init__(self, message: str, exit_code: int, host: str | None = None, signal: int | None = None,
                 cause: str = "", note: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.host, self.signal, self.cause, self.note = exit_code, host, signal, cause, note


class JobInterrupted(HvdrunError):
    """hvdrun received SIGINT or SIGTERM and stopped every worker."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class InspectionError(HvdrunError):
    """A running job could not be inspected (``hvdrun stacks``, ``hvdrun top``): its hvdrun or its rank 0 did not
    answer."""


class JobError(HvdrunError):
    """A scheduler command (qsub, sbatch, qstat, ...) failed."""


class CollectiveError(HvdrunError, RuntimeError):
    """A collective could not complete: peer failure, mismatch across ranks, stall, shutdown.

    Exported by ``hvdrun.torch`` as ``HorovodInternalError``.
    """


class PeerLostError(CollectiveError):
    """A peer's data connection ended: usually a consequence of a failure elsewhere, which the job's control plane
    names a moment later (the engine waits briefly for it)."""


class RendezvousError(CollectiveError):
    """The ranks of a job could not find or authenticate each other."""


RENDEZVOUS_TIMED_OUT = "rendezvous timed out"  # how rank 0's error begins when ranks never joined (the launcher looks)
RENDEZVOUS_UNREACHED = "cannot reach rank 0 at "  # how a rank's error begins when rank 0 never listened (likewise)


class DeviceError(CollectiveError):
    """Device tensors cannot be reduced: the installed torch has no process group of the chosen backend."""


class NotInitializedError(HvdrunError, ValueError):
    """A runtime call was made before ``init()`` (or after ``shutdown()``)."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Elastic jobs: the launcher added or removed workers: every rank stops at this commit and the job re-forms.

    ``skip_sync``: the state need not be broadcast again (Horovod: only hosts were removed).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were updated")
        self.skip_sync = skip_sync
