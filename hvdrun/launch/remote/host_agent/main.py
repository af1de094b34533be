"""A host's agent: ``python -m hvdrun.launch.remote.host_agent.main``, one per host of a job, under one SSH channel.

hvdrun (``--launcher ssh``, :mod:`hvdrun.launch.agent_forest`) starts it in the job's working directory, under the
host's Python, and speaks to it over the channel (:mod:`hvdrun.launch.remote.host_agent.messages`). The agent

1. reads its hello frame, forks its fork server while it has one thread (one Python start per host, not one per
   rank) and answers with the host's facts (what the probe, :mod:`hvdrun.launch.remote.hostfacts`, says);
2. when the hello names hosts beneath it (a tree, for many hosts), connects to them with the targets and SSH
   options hvdrun resolved (host keys verified against the same known_hosts, the same key file: a shared
   home, as clusters have), starts their agents the same way and passes their lines up and frames down;
3. starts its host's ranks when their plan comes, each under its own guard with its own lifeline
   (:mod:`hvdrun.launch.remote.host_agent.local_ranks`), and sends their output and exit codes up as tagged lines;
4. writes the lifeline bytes that ``signal`` frames carry (terminate, kill, a forwarded signal, or close);
5. when its stdin ends (hvdrun ended or was killed, the connection dropped, the agent above it died) closes
   every rank's lifeline, so every guard stops its rank exactly as it would for a local rank, closes the
   channels beneath it (their agents do the same) and exits.
"""

from __future__ import annotations

import dataclasses
import os
import select
import sys
import threading
import time
import traceback
from typing import Any

from hvdrun.errors import LaunchError
from hvdrun.launch.remote.forkserver import ForkServer
from hvdrun.launch.remote.host_agent.channel import AgentChannel
from hvdrun.launch.remote.host_agent.local_ranks import HostRanks
from hvdrun.launch.remote.host_agent.messages import (
    DROP,
    FACTS,
    FAILED,
    HELLO,
    PLAN,
    SIGNAL,
    SILENCE_S,
    Node,
    frame,
    host_line,
    read_frame,
    subtree,
    unreached,
)
from hvdrun.launch.remote.hostfacts import facts


class _Upstream:
    """The agent's stdout: whole lines from many threads, one write at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(1, view):]
            except OSError:
                pass  # the side above is gone: our stdin ends too, and that ends the agent

    def lines(self, lines: list[bytes]) -> None:
        self.write(b"".join(lines))


class Agent:
    """One host's agent: its ranks, and the channels to the agents beneath it.

    Args:
        top: this host's node (its index, name and the nodes beneath it).
        job: what every host shares (``interface``, ``ssh`` options, ``seconds`` to the deadline).
        up: where lines go.
        ranks: this host's ranks.
    """

    def __init__(self, top: Node, job: dict[str, Any], up: _Upstream, ranks: HostRanks) -> None:
        self.top, self.job, self.up, self.ranks = top, job, up, ranks
        self.login_env = dict(os.environ)
        self._deadline = time.monotonic() + float(job["seconds"])
        self._children: list[AgentChannel] = []
        self._route: dict[int, AgentChannel] = {}
        self._lock = threading.Lock()

    def reach_children(self) -> None:
        """Connect to the hosts right beneath this one (a sliding window of handshakes) and start their agents.
        Whatever goes wrong, every child not yet reached is reported failed at once (never left to the deadline)."""
        reported: set[int] = set()
        try:
            self._reach_children(reported)
        except Exception as e:  # noqa: BLE001 - a bug or an odd failure: name it, for every child it cost
            for child in self.top["children"]:
                if child["index"] not in reported:
                    self.up.lines([host_line(child["index"], FAILED, {"connect": f"{type(e).__name__}: {e}"}),
                                   *unreached(child)])

    def _reach_children(self, reported: set[int]) -> None:
        from hvdrun.launch.remote.connections import SshOptions, SshTarget, connect_each

        children = self.top["children"]
        targets = [SshTarget(host, hostname, int(port), user, tuple(keys))
                   for host, hostname, port, user, keys in (child["target"] for child in children)]
        options = SshOptions(**self.job["ssh"])
        for child, client in zip(children, connect_each(targets, options, self._deadline), strict=True):
            reported.add(child["index"])
            if isinstance(client, LaunchError):
                self.up.lines([host_line(child["index"], FAILED, {"connect": str(client)}), *unreached(child)])
                continue
            channel = AgentChannel(child, client, self.up.lines)
            with self._lock:
                self._children.append(channel)
                self._route.update({below["index"]: channel for below in subtree(child)})
            channel.start(self.job, self._deadline)

    def handle(self, message: tuple[Any, ...]) -> None:
        """One frame from above: for this host, or passed on towards the host it is for."""
        kind, index = message[0], message[1]
        if index != self.top["index"]:
            with self._lock:
                channel = self._route.get(index)
            if channel is not None:
                channel.send(frame(message))
        elif kind == PLAN:
            self.ranks.start(message[2], self.login_env)
        elif kind == SIGNAL:
            self.ranks.signal(message[2], message[3])

    def teardown(self) -> None:
        """Close every rank's lifeline (each guard stops its rank) and every channel beneath."""
        self.ranks.signal(None, DROP)
        with self._lock:
            children = list(self._children)
        for channel in children:
            channel.close()


def _stdin(count: int) -> bytes:
    """At most ``count`` bytes from above; ``b""`` at its end, or after :data:`SILENCE_S` without a byte (the
    host above crashed or was cut off: no end of file ever comes)."""
    try:
        if not select.select([0], [], [], SILENCE_S)[0]:
            sys.stderr.write(f"hvdrun: the host agent heard nothing from above for {SILENCE_S:g} s; "
                             "stopping this host's ranks\n")
            return b""
        return os.read(0, count)
    except OSError:
        return b""


def _facts_line(top: Node, job: dict[str, Any]) -> bytes:
    found = facts(job.get("interface"), int(top["ports"]))
    return host_line(top["index"], FACTS, dataclasses.asdict(found))


def main() -> None:
    """Serve one host of a job until the channel's stdin ends."""
    hello = read_frame(_stdin)
    if hello is None or hello[0] != HELLO:
        sys.exit("hvdrun: the host agent expects hvdrun's hello frame on its stdin")
    _, top, job = hello
    up = _Upstream()
    ranks = HostRanks(up.write, top["name"])
    ranks.server = ForkServer.fork(top["name"], on_exit=ranks.on_exit, on_gone=ranks.on_gone)  # before any thread
    agent = Agent(top, job, up, ranks)
    up.write(_facts_line(top, job))
    if top["children"]:
        threading.Thread(target=agent.reach_children, name="hvdrun-agent-children", daemon=True).start()
    code = 0
    try:
        while (message := read_frame(_stdin)) is not None:
            agent.handle(message)
    except Exception:  # noqa: BLE001 - named on stderr, which the side above reports; the ranks still stop
        traceback.print_exc()
        code = 1
    finally:
        agent.teardown()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
