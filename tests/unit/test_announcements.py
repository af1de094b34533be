"""The merged announcements' compact form (Uniform) and the small-message swap, without processes: merges must give
the general form's answer whatever the mix, and the swap must put a message together from any pieces."""

from __future__ import annotations

import numpy as np
import pytest

from hvdrun.runtime.announcements import CODEC, Announcements, Uniform
from hvdrun.runtime.collectives.streams import swap_small
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import SUM
from hvdrun.runtime.transport.base import AbortFlag, RxChannel, TxChannel, Waiter

WIRE = Request("grad", "allreduce", "float32", (3,), SUM).wire()


class _Merging:
    merges = True


def _announcements() -> Announcements:
    return Announcements(_Merging(), 0, 4, lambda key: WIRE)  # type: ignore[arg-type]


def _data(*values: float) -> bytes:
    return np.array(values, np.float32).tobytes()


def test_uniform_ranges_merge_into_one_reduced_range():
    merge = _announcements()._merge
    low = merge(Uniform(7, 0, 0, _data(1, 2, 3)), Uniform(7, 1, 1, _data(10, 20, 30)))
    high = merge(Uniform(7, 2, 2, _data(100, 200, 300)), Uniform(7, 3, 3, _data(0, 0, 1)))
    whole = merge(low, high)
    assert type(whole) is Uniform and (whole.key, whole.lo, whole.hi) == (7, 0, 3)
    assert np.frombuffer(whole.data, np.float32).tolist() == [111, 222, 334]


@pytest.mark.parametrize(("other", "ranks", "total"), [
    (Uniform(8, 1, 1, _data(4, 5, 6)), {0, 1}, None),  # another op: no data counts
    (Uniform(7, 2, 2, _data(4, 5, 6)), {0, 2}, [5, 7, 9]),  # not the next rank: general form, still reduced
    (({1: ([(7, None)], ["blocked"])}, None), {0, 1}, None),  # a rank blocked on a name
])
def test_anything_else_expands_to_the_general_form(other, ranks, total):
    announced, lone = _announcements()._merge(Uniform(7, 0, 0, _data(1, 2, 3)), other)
    assert announced[0] == ([(7, None)], []) and set(announced) == ranks
    assert (None if lone is None else np.frombuffer(lone[1], np.float32).tolist()) == total
    assert lone is None or lone[0] == 7


def test_a_uniform_range_and_a_general_lone_op_still_reduce():
    merged = _announcements()._merge(Uniform(7, 0, 1, _data(1, 2, 3)), ({2: ([(7, None)], [])}, (7, _data(1, 1, 1))))
    announced, lone = merged
    assert sorted(announced) == [0, 1, 2] and lone[0] == 7
    assert np.frombuffer(lone[1], np.float32).tolist() == [2, 3, 4]


@pytest.mark.parametrize("value", [Uniform(3, 2, 5, _data(1.5, -2, 3)), ({0: ([(3, None)], ["x"])}, None)])
def test_the_codec_round_trips_both_forms(value):
    back = CODEC.loads(memoryview(bytearray(CODEC.dumps(value))))
    if type(value) is Uniform:
        assert back[:3] == value[:3] and bytes(back.data) == value.data
    else:
        assert back == value


class _Pipe(TxChannel, RxChannel):
    """One direction of a byte stream that shows what arrived in pieces of ``piece`` bytes at most."""

    def __init__(self, piece: int) -> None:
        self.buffer, self.start, self.piece = bytearray(), 0, piece

    def send_some(self, data: memoryview) -> int:
        self.buffer += data
        return len(data)

    def peek(self, limit: int) -> memoryview:
        return memoryview(self.buffer)[self.start:self.start + min(limit, self.piece)]

    def consume(self, count: int) -> None:
        self.start += count

    def wait_fds(self) -> tuple[list[int], list[int]]:
        return [], []


@pytest.mark.parametrize("piece", [1, 3, 8, 13, 1 << 20])
@pytest.mark.parametrize("length", [0, 5, 8, 4096])
def test_a_small_swap_takes_the_message_whole_or_in_any_pieces(piece, length):
    pipe = _Pipe(piece)
    first = bytes(range(256)) * (length // 256) + bytes(length % 256)
    pipe.send_some(memoryview(b"".join(((length).to_bytes(8, "little"), first, bytes(-length % 8)))))
    received = swap_small(pipe, pipe, Waiter(None, AbortFlag(), spin_s=1.0), b"reply")
    assert bytes(received) == first
    assert bytes(swap_small(pipe, pipe, Waiter(None, AbortFlag(), spin_s=1.0), b"")) == b"reply"
