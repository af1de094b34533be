"""The host's post board (hvdrun.runtime.transport.posts): rounds, parity, too-long posts, watches and bells."""

from __future__ import annotations

import os
import select
import uuid

import pytest

from hvdrun.runtime.transport.posts import SLOT_BYTES, PostBoard, board_path
from hvdrun.runtime.transport.shm import shm_supported

pytestmark = pytest.mark.skipif(not shm_supported(), reason="needs /dev/shm on x86-64")


@pytest.fixture
def boards():
    """Three members of one host's board (member 0 created it), names unlinked once all opened it."""
    key = f"unit{uuid.uuid4().hex[:8]}-0"
    members = [PostBoard(key, 5, 3, 0, create=True)]
    members += [PostBoard(key, 5, 3, index, create=False) for index in (1, 2)]
    members[0].unlink()
    yield members
    for board in members:
        board.close()


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_board_is_named_after_the_first_rank_and_leaves_nothing_once_unlinked(boards):
    assert boards[0].path == board_path("-".join(boards[0].path.name.split("-")[1:3]), 5)
    assert boards[0].path.name.endswith("-5.posts") and boards[0].path.parent.name == "shm"
    assert not boards[0].path.exists() and not any(bell.exists() for bell in boards[0].bell_paths)


def test_every_member_reads_every_post_of_a_round_in_local_order_over_many_rounds(boards):
    for r in range(1, 8):  # both parities, lengths that grow and shrink
        posts = [bytes([m * 16 + r]) * (r * 37 % 11 + m) for m in range(3)]
        for m in (2, 0, 1):
            boards[m].post(posts[m])
            assert boards[m].posted() == (m == 1)  # complete with the last post only
        assert all(board.posted() and board.round == r for board in boards)
        for m, board in enumerate(boards):
            assert board.messages(posts[m]) == posts


def test_a_post_of_the_next_round_keeps_the_current_one_readable(boards):
    for m, board in enumerate(boards):
        board.post(b"first-%d" % m)
    boards[1].post(b"second")  # a fast member already posted round 2 (the other parity)
    assert boards[0].messages(b"first-0") == [b"first-0", b"first-1", b"first-2"]
    assert boards[0].arrivals.ready() and not boards[1].complete.ready()


def test_a_post_too_long_sends_every_member_to_the_ring_that_round_alike(boards):
    boards[0].post(b"short")
    boards[1].post(b"\1" * (SLOT_BYTES + 1))
    boards[2].post(b"")
    assert [board.messages(b"") for board in boards] == [None, None, None]
    assert [board.too_long for board in boards] == [1, 1, 1]
    for m, board in enumerate(boards):  # the next round takes the board again
        board.post(b"%d" % m)
    assert boards[2].messages(b"2") == [b"0", b"1", b"2"]


def test_watches_say_when_a_round_is_complete_and_when_a_peer_began_one(boards):
    assert not any(board.arrivals.ready() for board in boards)
    boards[0].post(b"a")
    assert boards[1].arrivals.ready() and boards[2].arrivals.ready() and not boards[0].arrivals.ready()
    assert not boards[0].complete.ready()
    boards[1].post(b"b")
    boards[2].post(b"c")
    assert all(board.complete.ready() for board in boards)
    assert boards[1].complete.wait_fds() == ([boards[1].own_bell.fd], [])


def test_a_post_rings_the_bell_of_a_sleeping_member_only(boards):
    sleeper, awake = boards[1], boards[2]
    sleeper.own_bell.sleeping[0] = 1  # as Waiter.sleep raises it before select()
    boards[0].post(b"wake up")
    assert _readable(sleeper.own_bell.fd) and not _readable(awake.own_bell.fd)
    assert not _readable(boards[0].own_bell.fd)  # a poster does not ring itself
    sleeper.own_bell.drain()
    sleeper.own_bell.sleeping[0] = 0
    boards[2].post(b"quiet")
    assert not _readable(sleeper.own_bell.fd)


def test_opening_a_board_whose_bell_is_not_a_fifo_fails(tmp_path):
    key = f"unit{uuid.uuid4().hex[:8]}-0"
    board = PostBoard(key, 0, 2, 0, create=True)
    try:
        board.bell_paths[1].unlink()
        board.bell_paths[1].write_text("not a fifo")
        with pytest.raises(OSError, match="is not a FIFO"):
            PostBoard(key, 0, 2, 1, create=False)
    finally:
        board.unlink()
        board.close()
    assert not os.path.exists(board.path)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_board_that_cannot_be_made_or_opened_leaves_no_file_and_no_fd():
    key = f"unit{uuid.uuid4().hex[:8]}-0"
    path = board_path(key, 0)
    stale = path.with_name(path.name + "-bell1")
    stale.write_text("left by someone else")  # the creator's second mkfifo fails
    fds = _open_fds()
    try:
        with pytest.raises(FileExistsError):
            PostBoard(key, 0, 3, 0, create=True)
        assert not path.exists() and not path.with_name(path.name + "-bell0").exists()
        assert _open_fds() == fds
    finally:
        stale.unlink()
    board = PostBoard(key, 0, 2, 0, create=True)
    with_board = _open_fds()  # its bells and the mapping's own descriptor
    try:
        board.bell_paths[1].unlink()  # an opener finds the board but not every bell
        with pytest.raises(FileNotFoundError):
            PostBoard(key, 0, 2, 1, create=False)
        assert _open_fds() == with_board
    finally:
        board.unlink()
        board.close()
    assert _open_fds() == fds
