"""One host agent under its SSH channel, seen from above: from hvdrun (the hosts it reaches itself) or from the
agent of the host above it in the tree (:mod:`hvdrun.launch.remote.host_agent.main`).

An :class:`AgentChannel` starts the agent (one exec channel), sends it its hello frame, passes frames down and
hands every whole line the agent sends up to its owner. When the channel ends it says why, in the wire's words
(:mod:`hvdrun.launch.remote.host_agent.messages`): ``failed`` for the host and ``unreached`` for the hosts beneath it
if the agent never answered (no Python, no hvdrun, no working directory: the exit status and stderr say which), ``lost``
for the host and every host beneath it if it had answered and the channel was not closed from above.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hvdrun.launch.remote.host_agent.messages import (
    FACTS,
    FAILED,
    HEARTBEAT_S,
    HELLO,
    LOST,
    PING,
    Node,
    frame,
    host_line,
    subtree,
    unreached,
)
from hvdrun.launch.remote.lines import TAGGED_LINE_BYTES, LineSplitter, untag

if TYPE_CHECKING:
    import paramiko

_STDERR_LINES = 5  # of an agent's stderr, kept for the report when it fails
_OPEN_TIMEOUT_S = 10.0


class AgentChannel:
    """A host agent, started over ``client``.

    Args:
        top: the host's node (its index, name, command, and the nodes beneath it).
        client: an open connection to the host.
        up: gets every whole line the agent sends (a list per read), and the lines that say it failed or was lost.
        on_end: called once when the channel has ended and its last line went up.
    """

    def __init__(self, top: Node, client: paramiko.SSHClient, up: Callable[[list[bytes]], None],
                 on_end: Callable[[], None] = lambda: None) -> None:
        self.top, self.client, self._up, self._on_end = top, client, up, on_end
        self.answered = False  # the agent sent its host's facts
        self.closing = False  # closed from above: its end is no loss
        self._stderr: deque[str] = deque(maxlen=_STDERR_LINES)
        self._channel: paramiko.Channel | None = None
        self._send_lock = threading.Lock()

    def start(self, job: dict[str, Any], deadline: float) -> None:
        """Start the agent and send its hello; a failure to do so goes up as the host's ``failed`` line."""
        try:
            transport = self.client.get_transport()
            if transport is None or not transport.is_active():
                raise ConnectionError("the connection closed")
            channel = transport.open_session(timeout=_OPEN_TIMEOUT_S)
            channel.exec_command(self.top["command"])
            channel.sendall(frame((HELLO, self.top, {**job, "seconds": _seconds_for_agent(deadline)})))
        except Exception as e:  # noqa: BLE001 - paramiko's channel errors, named in the report
            why = f"cannot start hvdrun's agent on {self.top['name']}: {e or type(e).__name__}"
            self._up([host_line(self.top["index"], FAILED, {"connect": why}), *unreached(self.top)])
            self._on_end()
            return
        self._channel = channel
        threading.Thread(target=self._read, name=f"hvdrun-agent-{self.top['name']}", daemon=True).start()
        threading.Thread(target=self._beat, name=f"hvdrun-agent-ping-{self.top['name']}", daemon=True).start()

    def _beat(self) -> None:
        """Tell the agent, every HEARTBEAT_S, that the host above is alive (see :data:`SILENCE_S`)."""
        ping = frame((PING, self.top["index"]))
        while not self.closing and self._channel is not None and not self._channel.closed:
            self.send(ping)
            time.sleep(HEARTBEAT_S)

    def send(self, data: bytes) -> None:
        """Pass frames down; a channel that is gone drops them (its end is reported by the reader)."""
        if self._channel is None:
            return
        try:
            with self._send_lock:
                self._channel.sendall(data)
        except Exception:  # noqa: BLE001,S110 - the channel is gone: its end goes up as lost
            pass

    def close(self) -> None:
        """End the agent's stdin (it stops its ranks and ends) and the connection."""
        self.closing = True
        if self._channel is not None:
            try:
                self._channel.shutdown_write()
            except Exception:  # noqa: BLE001,S110 - already gone
                pass
        self.client.close()

    def _read(self) -> None:
        assert self._channel is not None
        channel = self._channel
        stderr = threading.Thread(target=self._read_stderr, args=(channel,), daemon=True,
                                  name=f"hvdrun-agent-{self.top['name']}-stderr")
        stderr.start()
        splitter = LineSplitter(TAGGED_LINE_BYTES)
        while data := _receive(channel.recv):
            lines = splitter.feed(data)
            if lines:
                self._note_answer(lines)
                self._up(lines)
        stderr.join(5.0)
        self._up(self._ending(channel.recv_exit_status()))
        self._on_end()

    def _note_answer(self, lines: list[bytes]) -> None:
        if not self.answered:
            for line in lines:
                tagged = untag(line)
                if tagged is not None and tagged.kind == FACTS and tagged.number == self.top["index"]:
                    self.answered = True

    def _read_stderr(self, channel: paramiko.Channel) -> None:
        splitter = LineSplitter()
        while data := _receive(channel.recv_stderr):
            self._stderr.extend(line.decode(errors="replace").rstrip() for line in splitter.feed(data))
        self._stderr.extend(line.decode(errors="replace").rstrip() for line in splitter.close())

    def _ending(self, status: int) -> list[bytes]:
        """The lines that say why the channel ended: none when it was closed from above."""
        stderr = "\n".join(self._stderr)
        if not self.answered:
            return [host_line(self.top["index"], FAILED, {"status": status, "stderr": stderr}), *unreached(self.top)]
        if self.closing:
            return []
        beneath = [below["name"] for below in subtree(self.top)][1:]
        lost = {"host": self.top["name"], "status": status, "stderr": stderr, "beneath": beneath}
        return [host_line(below["index"], LOST, lost) for below in subtree(self.top)]


def _seconds_for_agent(deadline: float) -> float:
    """The agent's share of the time to ``deadline``: less than all of it, so that what it reports from beneath
    (a host that did not answer its connect) arrives here before the deadline, through its start and every hop."""
    return max((deadline - time.monotonic()) * 0.9 - 0.5, 0.1)


def _receive(receive: Callable[[int], bytes]) -> bytes:
    try:
        return receive(1 << 16)
    except Exception:  # noqa: BLE001 - a closed channel or transport is the end of the stream
        return b""
