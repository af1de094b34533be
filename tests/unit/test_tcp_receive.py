"""A copy over TCP lands straight in its destination (``TcpRx.read_into``), after any bytes already staged, in
order; the padding after it and the next transfer stay in the stream."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from hvdrun.errors import PeerLostError
from hvdrun.runtime.collectives.streams import CopySink, move
from hvdrun.runtime.transport.channels import AbortFlag, Waiter
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx, tune


class _CountingRx(TcpRx):
    """Counts the bytes that went through the staging buffer."""

    staged_in_all = 0  # (not ``staged``: that is the channel's own method)

    def _fill(self) -> None:
        before = self._end
        super()._fill()
        self.staged_in_all += self._end - before


@pytest.fixture
def pair():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP over loopback, as between hosts
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for sock in (a, b):
        tune(sock)
    yield TcpTx(a, "peer a"), TcpRx(a, "peer a"), TcpTx(b, "peer b"), _CountingRx(b, "peer b")
    a.close()
    b.close()


def test_read_into_takes_staged_bytes_first_then_the_socket_directly(pair):
    tx_a, _, _, rx_b = pair
    tx_a.send_some(memoryview(b"0123456789"))
    assert bytes(rx_b.peek(4)) == b"0123456789"[:4]  # the whole burst is staged now
    rx_b.consume(2)
    out = bytearray(6)
    assert rx_b.read_into(memoryview(out)) == 6 and out == b"234567"  # from staging
    tx_a.send_some(memoryview(b"abcdef"))
    rest = bytearray(10)
    got = rx_b.read_into(memoryview(rest))
    got += rx_b.read_into(memoryview(rest)[got:])
    assert bytes(rest[:got]) == b"89abcdef"


def test_read_into_reports_a_closed_peer(pair):
    _, rx_a, _, rx_b = pair
    rx_a.sock.close()
    with pytest.raises(PeerLostError, match="peer b closed its connection"):
        while True:
            rx_b.read_into(memoryview(bytearray(4)))


@pytest.mark.parametrize("nbytes", [1, 13, 4096, 3 << 20])
def test_a_copy_across_tcp_arrives_whole_and_leaves_the_next_transfer_in_the_stream(pair, nbytes):
    tx_a, rx_a, tx_b, rx_b = pair
    payload = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    after = b"next transfer"
    waiter = Waiter(None, AbortFlag())
    out = np.zeros(nbytes, np.uint8)

    def send() -> None:
        move(tx_a, rx_a, waiter, [memoryview(payload)], None)
        move(tx_a, rx_a, waiter, [memoryview(after)], None)

    sender = threading.Thread(target=send)
    sender.start()
    sink = CopySink(memoryview(out))
    move(tx_b, rx_b, Waiter(None, AbortFlag()), [], sink)
    sender.join()
    assert np.array_equal(out, payload) and sink.done
    assert rx_b.staged_in_all <= 7 + 16  # the payload went straight into place: only its padding and what follows
    rest = bytearray(len(after))
    taken = 0
    while taken < len(after):
        taken += rx_b.read_into(memoryview(rest)[taken:])
    assert bytes(rest) == after


def test_read_into_a_destination_longer_than_the_staging_buffer_takes_only_what_is_staged(pair):
    tx_a, _, _, rx_b = pair
    tx_a.send_some(memoryview(b"staged"))
    assert bytes(rx_b.peek(3)) == b"sta"
    big = memoryview(bytearray(5 << 20))  # longer than TcpRx's staging buffer
    assert rx_b.read_into(big) == 6 and bytes(big[:6]) == b"staged"
    tx_a.send_some(memoryview(b"direct"))
    got = 0
    while got < 6:
        got += rx_b.read_into(big[got:])
    assert bytes(big[:6]) == b"direct" and rx_b.staged_in_all == 6


class _Board:
    """A channel no poll sees (as a shared-memory ring): ready when told."""

    def __init__(self, ready: bool) -> None:
        self.is_ready = ready

    def ready(self) -> bool:
        return self.is_ready

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [], []


def test_one_poll_asks_every_socket_and_staged_bytes_and_other_channels_count_too():
    """``any_ready``: the sockets' readability with one poll, bytes already staged (the socket itself empty), and
    channels no poll sees, each of which alone makes the answer yes."""
    from hvdrun.runtime.transport.channels import any_ready

    links = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        for _ in range(3):
            a = socket.create_connection(listener.getsockname())
            b, _ = listener.accept()
            tune(a)
            tune(b)
            links.append((TcpTx(a, "a"), TcpRx(b, "b")))
    receivers = [rx for _, rx in links]
    assert not any_ready(receivers) and not any_ready([*receivers, _Board(False)])
    assert any_ready([*receivers, _Board(True)])
    links[2][0].sock.setblocking(True)
    links[2][0].sock.sendall(b"x" * 16)
    assert wait_for(lambda: any_ready(receivers))  # the bytes reach the socket
    assert not any_ready(receivers, poll=False), "left to the caller's poll"
    assert bytes(receivers[2].peek(8)) == b"x" * 8  # all 16 staged now, the socket empty
    assert receivers[2].poll_fd() is None and any_ready(receivers, poll=False)
    receivers[2].consume(16)
    assert not any_ready(receivers)
    for tx, rx in links:
        tx.close()
        rx.close()


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_waiter_with_bytes_staged_does_not_sleep(pair, monkeypatch):
    """The socket is empty but the channel holds bytes already read: the waiter must not go to its poll (it would
    sleep until its timeout, as nothing more arrives)."""
    import hvdrun.runtime.transport.channels as base

    tx_a, _, _, rx_b = pair
    tx_a.sock.setblocking(True)
    tx_a.sock.sendall(b"y" * 16)
    assert wait_for(lambda: rx_b.ready())
    assert bytes(rx_b.peek(8)) == b"y" * 8 and rx_b.poll_fd() is None  # all 16 staged

    def no_poll(*args, **kwargs):
        raise AssertionError("slept on the poll with bytes staged")

    monkeypatch.setattr(base, "readable", no_poll)
    base.Waiter(None, AbortFlag()).sleep([rx_b], [], 5.0)  # returns at once
    rx_b.consume(16)
    monkeypatch.undo()


def test_frames_a_peer_sent_before_leaving_are_all_taken_before_its_end_is_raised(pair):
    """The shutdown's last cycle: a peer sends its last frames and closes at once; a swap that reads ahead of the
    frame it needs meets the stream's end with frames still staged, and must hand them out first (it lost them, and
    the rank's shutdown ended early while its own successor waited for it)."""
    from hvdrun.runtime.collectives.streams import swap_message

    tx_a, _, tx_b, rx_b = pair
    frames = [f"frame {i}".encode() * 3 for i in range(4)]
    for frame in frames:  # what swap_message sends: length, message, padding
        tx_a.sock.sendall(len(frame).to_bytes(8, "little") + frame + bytes(-len(frame) % 8))
    tx_a.sock.shutdown(socket.SHUT_WR)  # then it leaves
    waiter = Waiter(None, AbortFlag())
    rx_b.peek(1)  # everything, and the end, arrive in one read
    got = [bytes(swap_message(tx_b, rx_b, waiter, b"mine")) for _ in frames]
    assert got == frames
    with pytest.raises(PeerLostError, match="peer b closed its connection"):
        swap_message(tx_b, rx_b, waiter, b"mine")
