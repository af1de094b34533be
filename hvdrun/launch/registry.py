"""The running jobs of this user, so that ``hvdrun stacks`` finds one from another shell.

Each running job is registered in a file readable by its user alone (``~/.hvdrun/jobs/running/JOB.json``, mode
0600 in a 0700 directory, removed when the job ends): its id, hvdrun's pid, the size, rank 0's rendezvous address
and the command. The job's secret is not in it: hvdrun keeps it in memory and hands it, over a Unix socket in the
abstract namespace (:class:`SecretKeeper`), to a process of the same user that asks. The socket dies with hvdrun,
so a hvdrun killed with SIGKILL leaves a file with no secret, which the next ``hvdrun`` that looks prunes.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

from hvdrun.envvars import JOBS_DIR, Rendezvous, jobs_dir
from hvdrun.errors import UsageError

_ASK_TIMEOUT_S = 5.0
_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def running_dir() -> Path:
    """Where running jobs are registered: ``running/`` in hvdrun's job records (``$HVDRUN_JOBS_DIR``)."""
    return jobs_dir() / "running"


class SecretKeeper:
    """Serves the job's secret to processes of this user, over an abstract Unix socket that dies with hvdrun.

    Args:
        secret: the job's secret.
        name: the socket's name in the abstract namespace (no file on disk).
    """

    def __init__(self, secret: str, name: str) -> None:
        self.name = name
        self._secret = secret.encode()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind("\0" + name)
        self._server.listen(16)
        threading.Thread(target=self._serve, name="hvdrun-secret-keeper", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed: the job ended
            with conn:
                credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
                _, uid, _ = _PEER_CREDENTIALS.unpack(credentials)
                if uid == os.getuid():
                    try:
                        conn.sendall(self._secret)
                    except OSError:
                        pass

    def close(self) -> None:
        """Stop serving (the thread ends at its next accept)."""
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()


def ask_secret(job: dict[str, Any]) -> str:
    """The secret of running ``job`` (an entry of :func:`running_jobs`), from its hvdrun.

    Raises:
        OSError: hvdrun does not answer (it ended meanwhile, or the job was registered by an older hvdrun).
    """
    name = job.get("secret_socket")
    if not isinstance(name, str):
        raise OSError(f"job {job.get('job_id')} names no socket for its secret")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_ASK_TIMEOUT_S)
        sock.connect("\0" + name)
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    if not chunks:
        raise OSError(f"hvdrun (pid {job.get('pid')}) gave no secret")
    return b"".join(chunks).decode()


def register(rendezvous: Rendezvous, size: int) -> tuple[Path, SecretKeeper] | None:
    """Register the running job (its file and its secret's keeper); None where it cannot be (no writable home, no
    abstract socket). Entries of jobs whose hvdrun is gone are pruned first."""
    folder = running_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid == os.getuid():
            folder.chmod(0o700)  # an older or shared directory: what is below is this user's alone
        running_jobs()
        keeper = SecretKeeper(rendezvous.secret, f"hvdrun-job-{rendezvous.job_id}-{os.getpid()}")
    except (OSError, UsageError):
        return None
    path = folder / f"{rendezvous.job_id}.json"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"job_id": rendezvous.job_id, "pid": os.getpid(), "size": size, "addr": rendezvous.addr,
                       "port": rendezvous.port, "secret_socket": keeper.name, "command": " ".join(sys.argv)}, out)
    except OSError:
        keeper.close()
        return None
    return path, keeper


def unregister(registered: tuple[Path, SecretKeeper] | None) -> None:
    """The job ended: its file goes, its secret is no longer served."""
    if registered is not None:
        path, keeper = registered
        path.unlink(missing_ok=True)
        keeper.close()


def running_jobs() -> list[dict[str, Any]]:
    """This user's registered jobs whose hvdrun is still running (files of ended ones are removed).

    Raises:
        UsageError: the records' folder cannot be read (one line: which folder, why, what to set).
    """
    jobs = []
    folder = running_dir()
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError as e:
        raise UsageError(f"cannot read hvdrun's running jobs in {folder} ({e.strerror or e}); give a folder of "
                         f"yours in {JOBS_DIR}") from e
    for path in paths:
        try:
            job = json.loads(path.read_text())
            os.kill(int(job["pid"]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        jobs.append(job)
    return jobs


def choose_job(job_id: str | None) -> dict[str, Any]:
    """The running job ``hvdrun stacks`` means: ``job_id``, or the only one running.

    Raises:
        UsageError: no such job, none running, or several and none named.
    """
    jobs = running_jobs()
    if job_id is not None:
        match = [job for job in jobs if job["job_id"] == job_id or str(job["pid"]) == job_id]
        if not match:
            raise UsageError(f"no running hvdrun job {job_id!r}; running: {_listing(jobs) or 'none'}")
        return match[0]
    if not jobs:
        raise UsageError(f"no running hvdrun job of this user (looked in {running_dir()})")
    if len(jobs) > 1:
        raise UsageError(f"{len(jobs)} hvdrun jobs are running; name one: {_listing(jobs)}")
    return jobs[0]


def _listing(jobs: list[dict[str, Any]]) -> str:
    return "; ".join(f"{job['job_id']} (hvdrun pid {job['pid']}, {job['size']} ranks: {job['command']})"
                     for job in jobs)
