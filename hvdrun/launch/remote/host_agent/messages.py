"""What hvdrun and the host agents (:mod:`hvdrun.launch.remote.host_agent.main`) say to each other.

Standard library only.

**Down** (hvdrun to an agent, and an agent to the agents beneath it), on the SSH channel's stdin: frames, each a
4-byte big-endian length and ``marshal`` of a tuple. Secrets travel only here, never on a command line.

* ``("hello", node, job)``: the first frame. ``node`` is the host's place in the tree (:func:`node`): its index
  in the job, name, SSH target, the command that starts an agent on it, how many free ports to find there, and
  the nodes beneath it; ``job`` what every host shares (``--network-interface``, how to reach hosts over SSH,
  seconds left to the start deadline).
* ``("plan", index, ranks)``: start these ranks on host ``index``; each is
  ``(rank, guard_argv, env, cwd)`` (the guard's arguments, the variables set on top of the login environment).
* ``("signal", index, ranks, code)``: for the ranks of host ``index`` (None: all of them), ``code`` is a byte
  to write to each rank's lifeline (the guard's ``T``, ``K`` or ``0x80 + N``, see ``guard.py``), or
  :data:`DROP`: close the lifeline, and the guard stops its rank as if hvdrun had died.

An agent passes a frame for a host beneath it on towards that host, unchanged.

**Up**, on the channel's stdout: tagged lines (:mod:`hvdrun.launch.remote.lines`). The ranks' ``stdout``,
``stderr`` and ``exit`` lines, and per host (the number is its index):

* ``facts``: the host's :class:`~hvdrun.launch.remote.hostfacts.HostFacts` as JSON; the agent is ready;
* ``failed``: the host could not be reached or its agent not started, as JSON: ``{"connect": why}``,
  ``{"status": exit status, "stderr": its last lines}`` or ``{"unreached": the host above it that failed}``;
* ``lost``: the agent of a host that had answered went away (its connection dropped, it died, or the agent
  above it did), as JSON: ``{"host": the host whose channel ended, "status": .., "stderr": .., "beneath": the
  hosts reached through it}``; every rank of the host has then been stopped by its guard.

An agent passes every line from beneath up unchanged, whole lines only.
"""

from __future__ import annotations

import json
import marshal
import struct
from collections.abc import Callable, Iterator
from typing import Any

from hvdrun.launch.remote.lines import tag

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 << 20  # a plan for hundreds of ranks of one host, with their environments
DROP = -1  # the signal code that closes a rank's lifeline
HELLO, PLAN, SIGNAL, PING = "hello", "plan", "signal", "ping"
# every channel carries a ping down this often; an agent that hears nothing from above for SILENCE_S takes the host
# above for gone (a crashed or cut-off host sends no end of file) and stops its ranks, as at the end of its stdin
HEARTBEAT_S = 5.0
SILENCE_S = 60.0
FACTS, FAILED, LOST = "facts", "failed", "lost"
Node = dict[str, Any]


def frame(message: tuple[Any, ...]) -> bytes:
    """One frame of ``message``."""
    body = marshal.dumps(message)
    return _HEADER.pack(len(body)) + body


def read_frame(read: Callable[[int], bytes]) -> tuple[Any, ...] | None:
    """The next frame from ``read`` (like ``os.read``: at most n bytes, ``b""`` at EOF); None at EOF.

    Raises:
        ValueError: the frame is too long or not a marshalled tuple.
    """
    header = _read_exactly(read, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes; at most {MAX_FRAME_BYTES}")
    body = _read_exactly(read, length)
    if body is None:
        return None
    message = marshal.loads(body)
    if not isinstance(message, tuple) or not message:
        raise ValueError(f"a frame holds {type(message).__name__}, not a message")
    return message


def _read_exactly(read: Callable[[int], bytes], count: int) -> bytes | None:
    parts, left = [], count
    while left:
        data = read(min(left, 1 << 20))
        if not data:
            return None
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def node(index: int, name: str, target: tuple[str, str, int, str, tuple[str, ...]], command: str, ports: int,
         children: list[Node]) -> Node:
    """One host's place in the tree, as the hello frame carries it (``target``: an
    :class:`~hvdrun.launch.remote.connections.SshTarget`'s fields)."""
    return {"index": index, "name": name, "target": list(target), "command": command, "ports": ports,
            "children": children}


def subtree(top: Node) -> Iterator[Node]:
    """``top`` and every node beneath it, parents before children."""
    yield top
    for child in top["children"]:
        yield from subtree(child)


def host_line(index: int, kind: str, value: Any) -> bytes:
    """The up line of kind ``kind`` about host ``index``, its value as JSON."""
    return tag(index, kind, json.dumps(value).encode() + b"\n")


def unreached(top: Node) -> list[bytes]:
    """The ``failed`` lines of every host beneath ``top``, whose agent never started."""
    return [host_line(below["index"], FAILED, {"unreached": top["name"]}) for below in list(subtree(top))[1:]]
