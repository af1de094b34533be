"""Link set-up between ranks (``hvdrun/runtime/backends/links.py``) over real loopback sockets: links are dialled
all at once, each wait ends at the set-up deadline, and the error names every peer that was missing."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvdrun.errors import RendezvousError
from hvdrun.runtime.backends.links import LINK, Acceptor, dial_all
from hvdrun.runtime.peers import Peer

SECRET = b"job-secret"


def peer(rank: int, listener: socket.socket | None = None) -> Peer:
    port = listener.getsockname()[1] if listener is not None else 0
    return Peer(rank, f"node{rank}", f"node{rank}/boot", 1000 + rank, "127.0.0.1", port)


def listener() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


def test_a_peer_slow_to_answer_delays_none_of_the_others():
    """Rank 1 answers only once ranks 2 and 3 have their connections from rank 0: dialled one after the other
    (rank 1 first) that never happens; dialled at once, every link is made."""
    me = peer(0)
    listeners = {rank: listener() for rank in (1, 2, 3)}
    deadline = time.monotonic() + 10
    fast = {rank: Acceptor(listeners[rank], [(LINK, 0)], SECRET, deadline) for rank in (2, 3)}
    slow: list[Acceptor] = []

    def answer_last() -> None:
        for acceptor in fast.values():
            acceptor.take(LINK, me)
        slow.append(Acceptor(listeners[1], [(LINK, 0)], SECRET, deadline))

    waiter = threading.Thread(target=answer_last)
    waiter.start()
    sockets = dial_all(me, [peer(rank, listeners[rank]) for rank in (1, 2, 3)], SECRET, LINK, deadline)
    waiter.join()
    assert sorted(sockets) == [1, 2, 3]
    accepted = [fast[2].take(LINK, me), fast[3].take(LINK, me), slow[0].take(LINK, me)]
    for rank, theirs in zip((2, 3, 1), accepted, strict=True):  # each link carries bytes one way at least
        theirs.settimeout(5)
        sockets[rank].setblocking(True)
        sockets[rank].sendall(b"ping")
        assert theirs.recv(4) == b"ping"
    for sock in [*sockets.values(), *accepted, *listeners.values()]:
        sock.close()


def test_a_peer_that_never_answers_is_named_at_the_deadline_and_the_links_made_are_closed():
    me, silent, answering = peer(0), listener(), listener()  # the silent one accepts in its backlog, never answers
    acceptor = Acceptor(answering, [(LINK, 0)], SECRET, time.monotonic() + 10)
    with pytest.raises(RendezvousError, match=r"cannot connect to rank 1 \(host node1, pid 1001\) at 127\.0\.0\.1"):
        dial_all(me, [peer(1, silent), peer(2, answering)], SECRET, LINK, time.monotonic() + 0.5)
    theirs = acceptor.take(LINK, me)
    theirs.settimeout(5)
    assert theirs.recv(1) == b"", "the link that was made is closed, not left open"
    for sock in (theirs, silent, answering):
        sock.close()


def test_links_that_never_come_are_all_named_when_the_deadline_passes():
    with listener() as waiting:
        acceptor = Acceptor(waiting, [(LINK, 1), (LINK, 2)], SECRET, time.monotonic() + 0.3)
        with pytest.raises(RendezvousError) as failed:
            acceptor.take_all(LINK, [peer(1), peer(2)])
    assert str(failed.value).startswith("rank 1 (host node1, pid 1001), rank 2 (host node2, pid 1002) did not "
                                        "connect to this rank's data port before the start deadline"), failed.value


def test_a_failed_set_up_closes_what_the_acceptor_took():
    me = peer(0)
    with listener() as waiting:
        acceptor = Acceptor(waiting, [(LINK, 0)], SECRET, time.monotonic() + 10)
        ours = dial_all(me, [peer(1, waiting)], SECRET, LINK, time.monotonic() + 10)[1]
        acceptor.take(LINK, me)
        acceptor.close()  # as NativeBackend.connect does when a later step fails
        ours.settimeout(5)
        assert ours.recv(1) == b"", "the peer's end is closed"
        ours.close()
