"""The merged announcements' compact form (Uniform) and the small-message swap, without processes: merges must give
the general form's answer whatever the mix, and the swap must put a message together from any pieces."""

from __future__ import annotations

import numpy as np
import pytest

from hvdrun.runtime.announcements import CODEC, LAST_RANGES, Announcements, Uniform, holders, last_ranks
from hvdrun.runtime.collectives.streams import swap_small
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import SUM
from hvdrun.runtime.transport.channels import AbortFlag, RxChannel, TxChannel, Waiter

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


def _held(rank: int, keys: tuple[int, ...], cycle: int = 5) -> tuple:
    """Rank ``rank``'s value when it holds ``keys`` (each since ``cycle``) and announces nothing else."""
    tally = ({cycle: 1}, cycle, (rank, rank))  # one object for all: as Announcements.exchange shares it
    return {}, None, dict.fromkeys(keys, tally), False


@pytest.mark.parametrize(("other", "announced", "total"), [
    (Uniform(8, 1, 1, _data(4, 5, 6)), {}, None),  # another number: both held, no data counts
    (Uniform(7, 2, 2, _data(4, 5, 6)), {}, [5, 7, 9]),  # not the next rank: held, still reduced
    (({1: ([], ["blocked"])}, None, {}, False), {1: ([], ["blocked"])}, None),  # a rank blocked on a name
])
def test_anything_else_makes_the_uniform_range_a_tally(other, announced, total):
    merged, lone, tallies, flush = _announcements()._merge(Uniform(7, 0, 0, _data(1, 2, 3)), other)
    assert merged == announced and not flush
    assert tallies[7][0] == {0: 1 + (type(other) is Uniform and other.key == 7)}  # began in cycle 0 (the default)
    assert (None if lone is None else np.frombuffer(lone[1], np.float32).tolist()) == total
    assert lone is None or lone[0] == 7


def test_a_uniform_range_and_a_general_lone_op_still_reduce():
    merged = _announcements()._merge(Uniform(7, 0, 1, _data(1, 2, 3)), ({}, (7, _data(1, 1, 1)), {}, False))
    announced, lone, tallies, _ = merged
    assert announced == {} and lone[0] == 7 and holders(tallies[7]) == 2
    assert np.frombuffer(lone[1], np.float32).tolist() == [2, 3, 4]


def _merged_as_recursive_doubling(values: list) -> object:
    merge = _announcements()._merge
    while len(values) > 1:
        values = [merge(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


@pytest.mark.parametrize("size", [4, 64])
def test_held_numbers_cost_the_same_bytes_at_any_number_of_ranks(size):
    keys = tuple(range(100, 108))  # eight gradients every rank holds
    merged = _merged_as_recursive_doubling([_held(rank, keys) for rank in range(size)])
    announced, lone, tallies, flush = merged
    assert announced == {} and lone is None and not flush
    assert all(tallies[key] == ({5: size}, 5, (0, size - 1)) for key in keys)
    assert len(CODEC.dumps(merged)) == len(CODEC.dumps(_merged_as_recursive_doubling(
        [_held(rank, keys) for rank in range(4)])))


def test_a_tally_names_the_ranks_that_came_last_and_counts_the_others():
    values = [_held(rank, (3,), cycle=9 if rank in (5, 6, 11) else 8) for rank in range(16)]
    values[2] = _held(2, ())  # rank 2 does not hold it yet
    values[4] = ({4: ([(("uncached",), None)], [])}, None, {}, True)  # rank 4 announces another op, asks for a flush
    announced, _, tallies, flush = _merged_as_recursive_doubling(values)
    counts, last, _ = tallies[3]
    assert counts == {8: 11, 9: 3} and holders(tallies[3]) == 14 and last == 9
    assert last_ranks(tallies[3]) == [5, 6, 11] and flush and list(announced) == [4]


def test_ranges_of_last_ranks_are_bounded():
    values = [_held(rank, (3,), cycle=9 if rank % 2 else 8) for rank in range(256)]  # every other rank late
    _, _, tallies, _ = _merged_as_recursive_doubling(values)
    assert holders(tallies[3]) == 256 and len(tallies[3][2]) == 2 * LAST_RANGES
    assert last_ranks(tallies[3]) == list(range(1, 2 * LAST_RANGES, 2))


@pytest.mark.parametrize("value", [Uniform(3, 2, 5, _data(1.5, -2, 3)), ({0: ([(3, None)], ["x"])}, None, {}, False),
                                   _held(3, (4, 5))])
def test_the_codec_round_trips_every_form(value):
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


def test_a_held_range_travels_as_a_header_and_its_numbers_and_merges_only_with_its_twin():
    from hvdrun.runtime.announcements import HeldRange

    keys = np.array([4, 8], np.int64).tobytes()
    value = HeldRange(keys, 3, 0, 1)
    message = CODEC.dumps(value)
    assert len(message) == 32 + 16 and CODEC.loads(memoryview(bytearray(message))) == value
    merge = _announcements()._merge
    assert merge(value, HeldRange(keys, 3, 2, 3)) == HeldRange(keys, 3, 0, 3)
    announced, lone, tallies, _ = merge(value, HeldRange(keys, 2, 2, 3))  # began a cycle earlier: the general form
    assert (announced, lone) == ({}, None) and tallies[4] == ({3: 2, 2: 2}, 3, (0, 1))
