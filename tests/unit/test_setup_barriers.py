"""Rank 0's side of a set-up barrier (hvdrun.runtime.rendezvous.server): released once every rank reached it, or,
at the start deadline, an error that names who rank 0 had not heard reach it, by host. Real sockets, no ranks:
each control connection is one end of a socket pair whose other end speaks for a rank or a host's leader."""

from __future__ import annotations

import socket
import time

import pytest

from hvdrun.errors import RendezvousError
from hvdrun.protocol.wire import recv_frame, send_frame
from hvdrun.runtime.peers import Peer
from hvdrun.runtime.rendezvous.server import RootServer, _Conn
from hvdrun.runtime.transport.channels import AbortFlag

HOSTS = {1: "nodeB", 2: "nodeB", 3: "nodeC", 4: "nodeD", 5: "nodeD"}


@pytest.fixture
def root():
    server = RootServer("127.0.0.1", 0, 6, b"secret", AbortFlag(), 0)
    server.members = {rank: Peer(rank, host, "key", 1000 + rank, "127.0.0.1", 1) for rank, host in HOSTS.items()}
    ends = []

    def connect(ranks: list[int], leader: bool) -> tuple[_Conn, socket.socket]:
        ours, theirs = socket.socketpair()
        ends.extend((ours, theirs))
        conn = _Conn(ours, [server.members[r] for r in ranks], leader)
        server.conns[ours] = conn
        return conn, theirs

    yield server, connect
    for end in ends:
        end.close()


def test_a_barrier_every_rank_reached_releases_them_all(root):
    server, connect = root
    conns = [connect([1, 2], True), connect([3], False), connect([4, 5], True)]
    for conn, theirs in conns:
        send_frame(theirs, ("ready", 1, len(conn.ranks)))
        server._read_client(conn)
    server.barrier(1, time.monotonic() + 5)
    assert [recv_frame(theirs) for _, theirs in conns] == [("go", 1)] * 3


def test_a_barrier_that_times_out_names_who_rank_0_had_not_heard_reach_it(root):
    server, connect = root
    leader_b, theirs_b = connect([1, 2], True)
    rank_3, theirs_3 = connect([3], False)
    connect([4, 5], True)  # nodeD's leader never says its host reached it
    for conn, theirs in ((leader_b, theirs_b), (rank_3, theirs_3)):
        send_frame(theirs, ("ready", 2, len(conn.ranks)))
        server._read_client(conn)
    send_frame(theirs_3, ("ready", 1, 1))  # another barrier's arrival counts for that one only
    server._read_client(rank_3)
    with pytest.raises(RendezvousError) as raised:
        server.barrier(2, time.monotonic() + 0.2)
    assert str(raised.value).endswith("not reached (as rank 0 heard): ranks 4-5 on nodeD")
    assert "set-up barrier 2: not every rank arrived before the start deadline" in str(raised.value)
    with pytest.raises(RendezvousError) as raised:
        server.barrier(1, time.monotonic())
    assert str(raised.value).endswith("not reached (as rank 0 heard): ranks 1-2 on nodeB; ranks 4-5 on nodeD")
