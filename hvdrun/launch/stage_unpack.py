"""One host's copy of an environment (``--stage-env``, :mod:`hvdrun.launch.staging`): the unpack line that runs
there, and this machine's own copy.

This machine copies the environment directly (``tar | tar``, one pass); a remote host's unpack line is fed by its
relay in the staging tree (:mod:`hvdrun.launch.stage_tree`), from a parent host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from hvdrun.errors import LaunchError, UsageError
from hvdrun.launch.remote.stage_relay import Unpack

MARKER = ".hvdrun-staged"
_DIR_EXIT, _UNPACK_EXIT, _SPACE_EXIT = 3, 4, 5  # the unpack line's exit codes (see _SCRIPT)

# The unpack line: sh -c SCRIPT hvdrun-stage DIR FP [SOURCE]. It takes the copy's lock, waiting for it
# $HVDRUN_STAGE_LOCK_WAIT seconds (600; 0: it answers "BUSY PATH" at once when another job holds it), and
# answers on stdout "HAVE PATH" (a complete copy is there) or "NEED PATH". Then with SOURCE (the environment
# itself: hvdrun's own machine) it copies it;
# without, it reads "KIB ..." from stdin (the space it needs), answers "STREAM" and reads the tar stream from
# stdin (from its host's relay). It ends with "DONE PATH KIB". Its errors go to stderr after "hvdrun-stage: "
# (the user's login shell may write there too: module systems, pyenv); exit 3: the directory, 4: the unpack,
# 5: space. One command per line, the lines joined with "; " (csh and tcsh, the login shell on some clusters,
# refuse line breaks inside quotes): no line may end with "then", "else", "{" or "|".
_SCRIPT_LINES = r"""
dir=$1; fp=$2; src=${3:-}; base="$dir/hvdrun-$(id -u)"; final="$base/env-$fp"; tmp="$base/.env-$fp.partial.$$"
fail() { printf '%s\n' "$2" | sed 's/^/@FAIL@/' >&2; exit "$1"; }
err=$(mkdir -p -- "$dir" 2>&1) || fail 3 "$err"
if [ -L "$base" ]; then fail 3 "$base is a symbolic link; remove it"; fi
if [ -d "$base" ] || err=$(mkdir -m 700 -- "$base" 2>&1) || [ -d "$base" ]; then :; else fail 3 "$err"; fi
[ -O "$base" ] || fail 3 "$base belongs to another user (this one is uid $(id -u))"
chmod 700 -- "$base" 2>/dev/null || fail 3 "cannot make $base private (mode 700)"
[ -w "$base" ] || fail 3 "$base is not writable"
exec 9>"$base/.env-$fp.lock"
wait=${HVDRUN_STAGE_LOCK_WAIT:-600}
locked=$(command -v flock) || locked=
if [ -n "$locked" ] && [ "$wait" = 0 ]; then flock -n 9 || { echo "BUSY $final"; exit 0; }; fi
if [ -n "$locked" ] && [ "$wait" != 0 ]; then flock -w "$wait" 9 || fail 4 "$base/.env-$fp.lock held for $wait s"; fi
if [ -f "$final/@MARKER@" ]; then echo "HAVE $final"; exit 0; fi
rm -rf -- "$final" "$base/.env-$fp.partial."*
err=$(mkdir -- "$tmp" 2>&1) || fail 3 "$err"
echo "NEED $final"
if [ -n "$src" ]; then kib=$(du -sk -- "$src" | cut -f1)
else read -r kib rest || { rm -rf -- "$tmp"; exit 1; }; fi
free=$(df -Pk -- "$base" 2>/dev/null | awk 'NR == 2 { print $4 }')
if [ -n "$free" ] && [ "$free" -lt "$kib" ]; then rm -rf -- "$tmp"; fail 5 "$base has $free KiB free, $kib needed"; fi
if [ -n "$src" ]; then err=$( { tar -C "$src" -cf - . || : > "$tmp.unread"; } | tar -xf - -C "$tmp" 2>&1 ); ok=$?
else echo STREAM; err=$(tar -xf - -C "$tmp" 2>&1); ok=$?; fi
if [ -e "$tmp.unread" ]; then ok=1; err="tar could not read all of $src"; fi
if [ "$ok" != 0 ]; then rm -rf -- "$tmp" "$tmp.unread"; fail 4 "$(printf '%s\n' "$err" | tail -n 3)"; fi
: > "$tmp/@MARKER@" && mv -- "$tmp" "$final" || fail 4 "cannot move $tmp to $final"
echo "DONE $final $kib"
"""
_FAIL_PREFIX = "hvdrun-stage: "  # the unpack line's own errors, told from a login shell's noise on the same stderr
_SCRIPT = "; ".join(_SCRIPT_LINES.strip().splitlines()).replace("@MARKER@", MARKER).replace("@FAIL@", _FAIL_PREFIX)


@dataclass(frozen=True)
class Environment:
    """A Python environment to stage.

    Attributes:
        python: the Python the ranks would run (``/work/venv/bin/python``).
        prefix: the environment's root (``/work/venv``), packed whole.
        fingerprint: 12 hex digits of the path and the modification times of its contents' top entries.
    """

    python: str
    prefix: str
    fingerprint: str

    @property
    def relative_python(self) -> str:
        """The Python inside the environment: ``bin/python``."""
        return os.path.relpath(self.python, self.prefix)


@dataclass(frozen=True)
class HostStaged:
    """One host's staging: where the copy is, its Python, how it got there and what it cost."""

    host: str
    copy: str
    python: str
    copied_bytes: int = 0
    seconds: float = 0.0
    via: str = ""  # copy (this machine) | tree (from a parent host, or the source) | "" (already there)


def unpack_command(directory: str, environment: Environment, copy: bool = False) -> list[str]:
    """The command that checks for, and makes, ``environment``'s copy under ``directory`` on a host (every word
    separate): from the tar stream on its stdin, or with ``copy`` from the environment itself (this machine)."""
    return ["sh", "-c", _SCRIPT, "hvdrun-stage", directory, environment.fingerprint,
            *([environment.prefix] if copy else [])]


_RUNNING: set[subprocess.Popen[bytes]] = set()  # the unpack lines running on this machine


def stop_local_copies() -> int:
    """SIGKILL every unpack line running on this machine, with its ``tar | tar`` (hvdrun was interrupted); how
    many there were."""
    running = list(_RUNNING)
    for process in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return len(running)


def copy_here(directory: str, environment: Environment) -> HostStaged:
    """Check for, and if needed make, the copy of ``environment`` under ``directory`` on this machine (which
    copies the environment itself).

    Raises:
        UsageError: ``directory`` cannot be used here.
        LaunchError: the copy could not be made (disk full, ...).
    """
    started, name = time.monotonic(), "this machine"
    try:  # in a session of its own, stopped with hvdrun: see stop_local_copies
        session = Unpack(unpack_command(directory, environment, copy=True), new_session=True)
    except OSError as e:
        raise LaunchError(f"--stage-env: cannot start the unpack on {name}: {e}", name) from e
    _RUNNING.add(session.process)
    try:
        answer = session.answer
        status, rest, error = session.finish()
    finally:
        _RUNNING.discard(session.process)
    if status != 0 or not answer.startswith(("HAVE ", "NEED ")):
        raise unpack_failure(name, directory, status, error)
    copy, via = answer.split(" ", 1)[1], "copy" if answer.startswith("NEED ") else ""
    copied = int(rest.split()[-1]) * 1024 if via and rest.split() else 0
    return HostStaged(name, copy, f"{copy}/{environment.relative_python}", copied, time.monotonic() - started, via)


def unpack_failure(name: str, directory: str, status: int, error: str) -> UsageError | LaunchError:
    """The error of a host whose unpack line failed: the directory (a usage error) or the unpack itself. The line's
    own messages are quoted, not what the host's login shell wrote around them; all of stderr when it wrote none."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    own = [line.removeprefix(_FAIL_PREFIX) for line in lines if line.startswith(_FAIL_PREFIX)]
    why = " ".join(own or lines) or (
        f"the unpack exited with code {status}" if status > 0 else "the connection was lost")
    if status == _DIR_EXIT:
        return UsageError(f"--stage-env: cannot use {directory} on {name}: {why}; give a writable directory on "
                          "the node's own disk with --stage-dir DIR (or local_dir: in the cluster YAML)")
    if status == _SPACE_EXIT:
        why += "; free some space there, or give another directory with --stage-dir DIR"
    return LaunchError(f"--stage-env: cannot unpack the environment into {directory} on {name}: {why}", name)


