"""The compiled steps (hvdrun.runtime.compiled) against the pure-Python doubling, over real loopback TCP links: the
same bits, the same wire (compiled and Python members are partners), the hand-over to Python where a partner's value
is not uniform, and a lost peer or the abort flag ending a wait with an error."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from hvdrun.envvars import check_tuning
from hvdrun.errors import CollectiveError, PeerLostError, UsageError
from hvdrun.runtime import compiled
from hvdrun.runtime.announcements import WHOLE, Announcements, HeldRange, Uniform
from hvdrun.runtime.collectives.hierarchical import MergedPath
from hvdrun.runtime.collectives.pairwise import Link, Pairwise, core_index, partners
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.reduce import AVERAGE, MAX, MIN, PRODUCT, REDUCE_FNS, SUM, scale
from hvdrun.runtime.transport.channels import AbortFlag, Waiter
from hvdrun.runtime.transport.posts import PostBoard
from hvdrun.runtime.transport.shm import shm_supported
from hvdrun.runtime.transport.tcp import TcpRx, TcpTx, tune

KEY = 7


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    path = compiled.build(tmp_path_factory.mktemp("compiled") / "steps.so")
    return compiled.load({"HVDRUN_COMPILED": "on"}, path)


class _Merging:
    """A merging backend's stand-in: ``doubling`` is what it says merges every rank's value by itself."""

    merges = True

    def __init__(self, doubling: Pairwise | None = None) -> None:
        self.doubling = doubling

    def merged_path(self) -> MergedPath | None:
        return MergedPath(self.doubling, None, 0, self.doubling.member, None) if self.doubling is not None else None

    def allgather_merged(self, value, merge, codec):  # noqa: ANN001, ANN201 - the backend's signature
        assert self.doubling is not None
        return self.doubling.allgather_merged(value, merge, codec)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        dialled = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    for sock in (dialled, accepted):
        tune(sock)
    return dialled, accepted


def _groups(size: int, abort: AbortFlag) -> tuple[list[Pairwise], list[socket.socket]]:
    """``size`` members, each linked by its own TCP connection to every partner of the doubling."""
    ends: dict[tuple[int, int], socket.socket] = {}
    for member in range(size):
        for peer in partners(member, size):
            if member < peer:
                ends[member, peer], ends[peer, member] = _tcp_pair()
    groups = [Pairwise(member, size, {peer: Link(TcpTx(ends[member, peer], f"member {peer}"),
                                                 TcpRx(ends[member, peer], f"member {peer}"))
                                      for peer in partners(member, size)}, Waiter(None, abort, spin_s=1e-4))
              for member in range(size)]
    return groups, list(ends.values())


def _members_in_threads(size: int, member: Callable[[int], None], sockets: list[socket.socket]) -> None:
    """``member(index)`` for every member, each in a thread of its own, all finished within 30 s; then the sockets
    closed."""
    threads = [threading.Thread(target=member, args=(index,)) for index in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    for sock in sockets:
        sock.close()


def _run_members(size: int, values: list, library_for: Callable[[int], object], dtype: str = "float32",
                 op: int = SUM, abort: AbortFlag | None = None, runners: list | None = None) -> list:
    """Every member's merged value (or the exception it raised), each member in a thread of its own; ``runners``
    collects the members' compiled runners."""
    wire = Request("grad", "allreduce", dtype, (4,), op).wire()
    abort = abort or AbortFlag()
    groups, sockets = _groups(size, abort)
    results: list = [None] * size

    def member(index: int) -> None:
        steps = library_for(index)
        runner = compiled.UniformSteps(steps) if steps is not None else None  # type: ignore[arg-type]
        if runner is not None and runners is not None:
            runners.append(runner)
        announcements = Announcements(_Merging(), index, size, lambda key: wire, runner)  # type: ignore[arg-type]
        try:
            results[index] = groups[index].allgather_merged(values[index], announcements._merge, announcements.codec)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[index] = e

    _members_in_threads(size, member, sockets)
    return results


def _run_whole(size: int, arrays: list[np.ndarray], whole: Callable[[int], bool], library, op: int = SUM,  # noqa: ANN001
               factor: float = 1.0, keys: list[int] | None = None, rounds: int = 1) -> list[list]:
    """Each member's results of ``rounds`` lone exchanges of its array (the same array each round): WHOLE where the
    compiled module wrote the whole value into it, else the merged value; members where ``whole(index)`` is False
    take Python's :meth:`Announcements.exchange_lone`, as a rank without the library does."""
    dtype = arrays[0].dtype
    wire = Request("grad", "allreduce", dtype.name, arrays[0].shape, op).wire()
    groups, sockets = _groups(size, AbortFlag())
    results: list[list] = [[] for _ in range(size)]

    def member(index: int) -> None:
        compiled_member = whole(index)
        runner = compiled.UniformSteps(library) if compiled_member else None
        announcements = Announcements(_Merging(groups[index]), index, size, lambda key: wire, runner)  # type: ignore
        key = KEY if keys is None else keys[index]
        try:
            for cycle in range(1, rounds + 1):
                data = arrays[index].tobytes()
                if compiled_member:
                    results[index].append(announcements.exchange_whole(key, data, cycle, arrays[index], factor))
                else:
                    results[index].append(announcements.exchange_lone(key, data, cycle))
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[index].append(e)

    _members_in_threads(size, member, sockets)
    return results


@pytest.mark.parametrize(("dtype", "op", "factor"), [("float32", AVERAGE, 1 / 3), ("float64", SUM, 0.5),
                                                     ("int32", MAX, 1.0), ("int64", PRODUCT, 1.0)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_whole_exchange_writes_the_scaled_value_into_the_array(library, dtype, op, factor, size):
    data = _data(size, dtype, seed=size)
    arrays = [row.copy() for row in data]
    results = _run_whole(size, arrays, lambda index: True, library, op, factor)
    python = _run_whole(size, [row.copy() for row in data], lambda index: False, library, op)[0][0]
    scaled = np.frombuffer(python.data, dtype).copy()
    scale(scaled, factor)  # what the Python path does with the merged value (Cycle._express_steady)
    assert all(result == [WHOLE] for result in results)
    assert all(array.tobytes() == scaled.tobytes() for array in arrays)


def test_whole_members_and_python_members_are_partners(library):
    size = 4
    data = _data(size, "float32", seed=3)
    arrays = [row.copy() for row in data]
    results = _run_whole(size, arrays, lambda index: index % 2 == 1, library, SUM, rounds=3)
    python = [merged for index in (0, 2) for merged in results[index]]
    assert all(result == [WHOLE] * 3 for result in (results[1], results[3]))
    assert all(type(merged) is Uniform and (merged.lo, merged.hi) == (0, 3) for merged in python)
    # the compiled members' arrays hold each round's sum, which they send in the next one; the last is everyone's
    assert arrays[1].tobytes() == arrays[3].tobytes() == bytes(results[0][-1].data) == bytes(results[2][-1].data)
    first = (data[0] + data[1]) + (data[2] + data[3])
    assert bytes(results[0][0].data) == first.tobytes()


def test_a_whole_exchange_that_meets_another_value_leaves_the_array_and_python_goes_on(library):
    size = 4
    data = _data(size, "float32", seed=4)
    arrays = [row.copy() for row in data]
    results = _run_whole(size, arrays, lambda index: True, library, SUM, keys=[KEY, KEY, KEY, KEY + 1], rounds=2)
    for index in range(size):
        assert arrays[index].tobytes() == data[index].tobytes()  # untouched: the cycle's agreement decides
        for merged in results[index]:
            assert merged is not WHOLE and not isinstance(merged, Exception)
    assert len({repr(Announcements(_Merging(), 0, size, lambda key: None)._general(results[index][-1])[2])
                for index in range(size)}) == 1  # every member ends with the same tallies


def _uniform(index: int, data: np.ndarray) -> Uniform:
    return Uniform(KEY, index, index, data.tobytes())


def _data(size: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(4).astype(dtype) for _ in range(size)]
    return [rng.integers(-1000, 1000, 4).astype(dtype) for _ in range(size)]


@pytest.mark.parametrize(("dtype", "op"), [("float32", SUM), ("float64", AVERAGE), ("float32", MIN),
                                           ("float64", MAX), ("int32", PRODUCT), ("int64", SUM)])
def test_compiled_members_give_the_python_doubling_bits(library, dtype, op):
    size = 4
    data = _data(size, dtype)
    values = [_uniform(index, data[index]) for index in range(size)]
    python = _run_members(size, values, lambda index: None, dtype, op)
    runners: list = []
    fast = _run_members(size, values, lambda index: library, dtype, op, runners=runners)
    assert [(runner.ran, runner.handed_over) for runner in runners] == [(1, 0)] * size
    expected = REDUCE_FNS[op](REDUCE_FNS[op](data[0], data[1]), REDUCE_FNS[op](data[2], data[3]))
    for merged in python + fast:
        assert type(merged) is Uniform and (merged.key, merged.lo, merged.hi) == (KEY, 0, size - 1)
        assert np.frombuffer(merged.data, dtype).tobytes() == expected.tobytes()


def test_min_and_max_keep_numpys_signed_zeros_and_nans(library):
    data = [np.array(row, np.float32) for row in ([-0.0, 0.0, np.nan, 1.0], [0.0, -0.0, 1.0, np.nan])]
    for op in (MIN, MAX):
        values = [_uniform(index, data[index]) for index in range(2)]
        fast = _run_members(2, values, lambda index: library, op=op)
        expected = REDUCE_FNS[op](data[0], data[1])
        assert all(bytes(merged.data) == expected.tobytes() for merged in fast)


def test_compiled_and_python_members_are_partners_on_one_wire(library):
    size = 4
    data = _data(size, "float32", seed=1)
    values = [_uniform(index, data[index]) for index in range(size)]
    runners: list = []
    mixed = _run_members(size, values, lambda index: library if index % 2 else None, runners=runners)
    assert [(runner.ran, runner.handed_over) for runner in runners] == [(1, 0)] * 2
    assert len({bytes(merged.data) for merged in mixed}) == 1
    assert all((merged.lo, merged.hi) == (0, 3) for merged in mixed)
    assert np.allclose(np.frombuffer(mixed[0].data, np.float32), sum(data))


@pytest.mark.parametrize("odd_one", [0, 3])
def test_a_partner_that_is_not_uniform_hands_the_steps_to_python(library, odd_one):
    """Member ``odd_one`` announces the general form: every member's compiled steps stop where they meet it (the
    first step or the second) and the Python path finishes, with the answer of an all-Python run."""
    size = 4
    data = _data(size, "float32", seed=2)
    values: list = [_uniform(index, data[index]) for index in range(size)]
    values[odd_one] = ({odd_one: ([], ["blocked"])}, None, {}, False)
    python = _run_members(size, values, lambda index: None)
    runners: list = []
    fast = _run_members(size, values, lambda index: library, runners=runners)
    assert fast == python
    assert sum(runner.handed_over for runner in runners) == 3  # the three uniform members met the odd one
    announced, lone, tallies, _ = fast[0]
    assert announced == {odd_one: ([], ["blocked"])} and lone is None and sum(tallies[KEY][0].values()) == 3


def _plain(value: object) -> object:
    """``value`` with its buffers as bytes (to compare)."""
    if isinstance(value, tuple | list):
        return type(value)(_plain(part) for part in value) if not isinstance(value, Uniform) else Uniform(
            value.key, value.lo, value.hi, bytes(value.data))
    return bytes(value) if isinstance(value, np.ndarray | memoryview) else value


@pytest.mark.parametrize("other", [Uniform(KEY + 1, 1, 1, np.zeros(8, np.float32).tobytes()),  # another op, size
                                   Uniform(KEY + 1, 1, 1, np.ones(4, np.float32).tobytes()),  # another op
                                   Uniform(KEY, 2, 2, np.ones(4, np.float32).tobytes())])  # not the next range
def test_another_number_size_or_range_hands_over_too(library, other):
    values = [_uniform(0, _data(1, "float32", seed=3)[0]), other]
    runners: list = []
    fast = _run_members(2, values, lambda index: library, runners=runners)
    python = _run_members(2, values, lambda index: None)
    assert _plain(fast) == _plain(python) and not any(isinstance(result, Exception) for result in fast)
    assert [runner.handed_over for runner in runners] == [1, 1]


def test_a_peer_that_closes_its_link_is_named(library):
    abort = AbortFlag()
    groups, sockets = _groups(2, abort)
    announcements = Announcements(_Merging(), 0, 2, lambda key: Request("g", "allreduce", "float32", (4,),
                                                                        SUM).wire(),
                                  runner := compiled.UniformSteps(library))  # type: ignore[arg-type]
    groups[1].links[0].tx.close()  # member 1 exits
    with pytest.raises(PeerLostError, match="member 1"):
        groups[0].allgather_merged(_uniform(0, np.ones(4, np.float32)), announcements._merge, announcements.codec)
    assert runner.ran == 1
    for sock in sockets:
        sock.close()


def test_the_abort_flag_ends_a_wait_for_a_partner_that_never_sends(library):
    abort = AbortFlag()
    groups, sockets = _groups(2, abort)
    announcements = Announcements(_Merging(), 0, 2, lambda key: Request("g", "allreduce", "float32", (4,),
                                                                        SUM).wire(),
                                  runner := compiled.UniformSteps(library, slice_s=0.01))  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            groups[0].allgather_merged(_uniform(0, np.ones(4, np.float32)), announcements._merge, announcements.codec)
        except CollectiveError as e:
            errors.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # member 1 never sends: the wait goes on
    abort.set("rank 1 failed: boom")
    thread.join(30)
    assert not thread.is_alive() and "rank 1 failed: boom" in str(errors[0]) and runner.ran == 1
    for sock in sockets:
        sock.close()


def test_bytes_sent_count_what_the_compiled_steps_sent(library):
    groups, sockets = _groups(2, AbortFlag())
    values = [_uniform(index, np.ones(4, np.float32)) for index in range(2)]
    wire = Request("g", "allreduce", "float32", (4,), SUM).wire()
    results = []
    threads = []
    for index in range(2):
        announcements = Announcements(_Merging(), index, 2, lambda key: wire,  # type: ignore[arg-type]
                                      compiled.UniformSteps(library))
        threads.append(threading.Thread(target=lambda g=groups[index], v=values[index], a=announcements: results.append(
            g.allgather_merged(v, a._merge, a.codec))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 2
    assert [group.links[1 - index].tx.bytes_sent for index, group in enumerate(groups)] == [8 + 32 + 16] * 2
    for sock in sockets:
        sock.close()


def test_the_mode_is_checked_and_off_means_python(tmp_path):
    assert compiled.load({"HVDRUN_COMPILED": "off"}) is None
    assert compiled.load({}, tmp_path / "missing.so") is None  # auto: not built, the Python path
    with pytest.raises(compiled.CompiledError, match="python -m hvdrun.runtime.compiled"):
        compiled.load({"HVDRUN_COMPILED": "on"}, tmp_path / "missing.so")
    with pytest.raises(UsageError, match="HVDRUN_COMPILED='fast'; expected one of auto, on, off"):
        check_tuning({"HVDRUN_COMPILED": "fast"})


def _held(keys: tuple[int, ...], since: int, member: int) -> HeldRange:
    return HeldRange(np.array(keys, np.int64).tobytes(), since, member, member)


def test_held_ranges_merge_in_the_compiled_steps_when_every_member_holds_the_same_numbers(library):
    """A cycle without data (a step's held gradients): the steps compare the numbers instead of reducing data."""
    runners: list = []
    merged = _run_members(4, [_held((3, 5, 9), 7, member) for member in range(4)], lambda index: library,
                          runners=runners)
    assert merged == [HeldRange(np.array((3, 5, 9), np.int64).tobytes(), 7, 0, 3)] * 4
    assert [(runner.ran, runner.handed_over) for runner in runners] == [(1, 0)] * 4
    announced, lone, tallies, flush = Announcements(_Merging(), 0, 4, lambda key: None)._general(merged[0])
    assert (announced, lone, flush) == ({}, None, False) and tallies == dict.fromkeys((3, 5, 9), ({7: 4}, 7, (0, 3)))


@pytest.mark.parametrize("odd", [_held((3, 5), 7, 3), _held((3, 5, 9), 6, 3), _uniform(3, np.ones(4, np.float32))],
                         ids=["other-numbers", "other-cycle", "a-lone-op"])
def test_a_member_holding_something_else_hands_the_held_steps_to_python(library, odd):
    values = [_held((3, 5, 9), 7, member) for member in range(3)] + [odd]
    runners: list = []
    fast = _run_members(4, values, lambda index: library, runners=runners)
    python = _run_members(4, values, lambda index: None)
    assert _plain(fast) == _plain(python)
    assert [runner.handed_over for runner in runners] == [1] * 4  # 2 and 3 meet at once, 0 and 1 in step 2
    _, _, tallies, _ = fast[0]
    holders = sum(type(value) is HeldRange and 9 in np.frombuffer(value.keys, np.int64) for value in values)
    assert sum(tallies[9][0].values()) == holders  # the tally counts every member that holds 9, whatever else


def _exchange_held(size: int, held: list[dict[int, int]], library, rounds: int = 2) -> tuple[list, list]:  # noqa: ANN001
    """Each member's agreements of ``rounds`` cycles in which it holds ``held[member]`` (number -> cycle it began)
    and says nothing else, through :meth:`Announcements.exchange` over a real doubling; and the runners."""
    groups, sockets = _groups(size, AbortFlag())
    runners = [compiled.UniformSteps(library) for _ in range(size)]
    agreements: list[list] = [[] for _ in range(size)]

    def member(index: int) -> None:
        announcements = Announcements(_Merging(groups[index]), index, size, lambda key: None, runners[index])
        try:
            for cycle in range(8, 8 + rounds):
                agreements[index].append(announcements.exchange(([], []), held[index], cycle))
        except Exception as e:  # noqa: BLE001 - the test reads it
            agreements[index].append(e)

    _members_in_threads(size, member, sockets)
    return agreements, runners


def test_a_held_cycle_runs_whole_and_a_member_holding_other_numbers_hands_it_to_python(library):
    """A cycle of held ops (no data) runs whole in the compiled call: every rank's tallies say each number is
    held by every rank; where one member holds other numbers, the call stops and Python's merge gives the tallies
    that count the holders; the cycles after it run whole again."""
    same = {3: 7, 5: 7, 9: 7}
    agreements, runners = _exchange_held(4, [same] * 4, library)
    assert [runner.wholes for runner in runners] == [2] * 4
    for rounds in agreements:
        assert all(agreement.tallies == dict.fromkeys((3, 5, 9), ({7: 4}, 7, (0, 3))) for agreement in rounds)
    agreements, runners = _exchange_held(4, [same, same, same, {3: 7, 5: 7}], library, rounds=1)
    assert all(sum(rounds[0].tallies[9][0].values()) == 3 and sum(rounds[0].tallies[3][0].values()) == 4
               for rounds in agreements)
    assert all(runner.handed_over == 1 for runner in runners)


@pytest.mark.parametrize("size", [3, 5, 6])
def test_the_fold_of_a_group_that_is_no_power_of_two_runs_compiled_too(library, size):
    """MPICH's fold: members 0, 2, ... hand their value to the next member and take the final value back; every
    step of every member in the compiled call, with the Python doubling's bits."""
    data = _data(size, "float64", seed=size)
    values = [_uniform(index, data[index]) for index in range(size)]
    runners: list = []
    fast = _run_members(size, values, lambda index: library, "float64", runners=runners)
    python = _run_members(size, values, lambda index: None, "float64")
    assert _plain(fast) == _plain(python)
    assert all((merged.lo, merged.hi) == (0, size - 1) for merged in fast)
    assert [(runner.ran, runner.handed_over) for runner in runners] == [(1, 0)] * size


@pytest.mark.parametrize("odd_one", [0, 1, 5])
def test_a_general_value_in_the_fold_hands_over_at_the_step_it_meets(library, odd_one):
    """6 members: 0 and 2 fold out into 1 and 3. A general value at a folding member, its taker or a core member
    reaches every other member at some step (the fold-out's taker included); each finishes in Python with
    Python's answer."""
    size = 6
    data = _data(size, "float32", seed=9)
    values: list = [_uniform(index, data[index]) for index in range(size)]
    values[odd_one] = ({odd_one: ([], ["blocked"])}, None, {}, False)
    runners: list = []
    fast = _run_members(size, values, lambda index: library, runners=runners)
    assert fast == _run_members(size, values, lambda index: None)
    # every member but the odd one (its general value never enters the compiled steps) hands over once
    assert sorted(runner.handed_over for runner in runners) == [0] + [1] * (size - 1)


def _merge_into(results: list, group: Pairwise, value: object, announcements: Announcements) -> None:
    results.append(group.allgather_merged(value, announcements._merge, announcements.codec))


@pytest.mark.parametrize("partner", [_uniform(1, np.arange(4, dtype=np.float32)),  # a frame the steps take
                                     ({1: ([], ["blocked"])}, None, {}, False),  # one they hand over
                                     _held(tuple(range(40)), 7, 1)],  # longer than any frame of this value
                         ids=["uniform", "general", "longer"])
def test_a_frame_the_python_path_read_ahead_is_taken_over(library, partner):
    """The Python path's receive reads what the socket holds, so the partner's next frame may sit staged in the
    channel when the compiled steps begin: they start from it (or hand over at once), and nothing is lost."""
    wire = Request("g", "allreduce", "float32", (4,), SUM).wire()
    results: dict[int, object] = {}
    for library_0 in (library, None):
        groups, sockets = _groups(2, AbortFlag())
        members = [Announcements(_Merging(), index, 2, lambda key: wire,  # type: ignore[arg-type]
                                 compiled.UniformSteps(library) if index or library_0 else None) for index in range(2)]
        partner_done: list = []
        thread = threading.Thread(target=_merge_into, args=(partner_done, groups[1], partner, members[1]))
        thread.start()
        rx = groups[0].links[1].rx
        while not rx.staged():  # the partner's frame arrives and is read ahead, as a Python swap would
            rx.peek(1 << 20)
        own = _uniform(0, np.ones(4, np.float32))
        results[library_0 is not None] = _plain(groups[0].allgather_merged(own, members[0]._merge, members[0].codec))
        thread.join(30)
        assert _plain(partner_done[0]) == results[library_0 is not None]
        for sock in sockets:
            sock.close()
    assert results[True] == results[False]


@pytest.mark.parametrize("op", [SUM, PRODUCT])
def test_nans_of_two_kinds_come_out_as_the_lower_ranks_on_every_member(library, op):
    """x86 keeps the first operand's NaN, and a compiler may swap the operands of + and *: the compiled steps take
    the lower member's NaN explicitly, as numpy's add(lower, upper) does (found by review: each member kept its own
    NaN, so members ended with different bits)."""
    quiet = np.array([0x7FC00000], np.uint32).view(np.float32)  # np.nan's bits
    default = np.array([0xFFC00000], np.uint32).view(np.float32)  # x86's default NaN (inf - inf): another sign
    values = [_uniform(index, np.concatenate([nan, np.ones(3, np.float32)])) for index, nan in enumerate(
        (quiet, default))]
    fast = _run_members(2, values, lambda index: library, op=op)
    python = _run_members(2, values, lambda index: None, op=op)
    assert {bytes(merged.data) for merged in fast} == {bytes(merged.data) for merged in python}
    assert len({bytes(merged.data) for merged in fast}) == 1


def test_a_library_built_from_another_version_of_the_source_is_not_used(tmp_path):
    source = tmp_path / "old.c"
    source.write_text(compiled.SOURCE.read_text().replace(
        f"#define ABI_VERSION {compiled.ABI_VERSION} ", f"#define ABI_VERSION {compiled.ABI_VERSION - 1} "))
    old = compiled.build(tmp_path / "old.so", source)
    assert compiled.load({}, old) is None  # auto: the Python path
    with pytest.raises(compiled.CompiledError, match=f"another version of uniform_steps.c .interface "
                                                     f"{compiled.ABI_VERSION - 1}, expected {compiled.ABI_VERSION}"):
        compiled.load({"HVDRUN_COMPILED": "on"}, old)


def _doubling(size: int, arrays: list[np.ndarray], reduce,
              runner_for: Callable[[int], object]) -> tuple[list[np.ndarray], list[int]]:
    """Pairwise.allreduce_doubling of ``arrays`` (one each, reduced in place), each member in a thread of its own;
    the arrays, and the bytes each member's links counted as sent."""
    groups, sockets = _groups(size, AbortFlag())
    for index, group in enumerate(groups):
        group.compiled = runner_for(index)  # type: ignore[assignment]
    errors: list[BaseException] = []

    def member(index: int) -> None:
        try:
            groups[index].allreduce_doubling(arrays[index], reduce)
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    threads = [threading.Thread(target=member, args=(index,)) for index in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    sent = [sum(group.links[peer].tx.bytes_sent for peer in group.links) for group in groups]
    for sock in sockets:
        sock.close()
    return arrays, sent


@pytest.mark.parametrize("size", [2, 4, 6])
@pytest.mark.parametrize(("dtype", "reduce"), [("float32", np.add), ("float64", np.maximum), ("int64", np.multiply)])
def test_the_compiled_doubling_gives_the_python_loops_bits_and_bytes(library, size, dtype, reduce):
    """Recursive doubling of a buffer (the allreduce across hosts up to HVDRUN_DOUBLING_MAX_BYTES): its core steps in
    one compiled call, each member's operand first as in Python; 6 members fold in and out in Python around it.
    Compiled, Python and both mixed give the same bits, and every link counts the same bytes sent."""
    data = [array.repeat(1000) for array in _data(size, dtype, seed=size)]  # 4,000 elements: several TCP segments
    python, python_sent = _doubling(size, [array.copy() for array in data], reduce, lambda index: None)
    runner = compiled.UniformSteps(library)
    fast, fast_sent = _doubling(size, [array.copy() for array in data], reduce, lambda index: runner)
    mixed, _ = _doubling(size, [array.copy() for array in data], reduce, lambda index: runner if index % 2 else None)
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(python, fast, mixed, strict=True))
    assert fast_sent == python_sent and min(python_sent) > 0
    core = [index for index in range(size) if core_index(index, size) is not None]  # members that fold out: none
    assert runner.ran == len(core) + len([index for index in core if index % 2])  # compiled run, then mixed


def _board_members(members: int) -> list[PostBoard]:
    key = f"whole{uuid.uuid4().hex[:8]}-0"
    boards = [PostBoard(key, 4, members, 0, create=True)]
    boards += [PostBoard(key, 4, members, index, create=False) for index in range(1, members)]
    boards[0].unlink()
    return boards


def _wait_posted(board: PostBoard) -> Callable[[], None]:
    def wait() -> None:
        deadline = time.monotonic() + 10
        while not board.posted():
            assert time.monotonic() < deadline, "a member never posted"
            time.sleep(1e-4)
    return wait


def _python_member_posts(board: PostBoard, key: int, rank: int, data: np.ndarray) -> list:
    """A rank on Python's path: posts its uniform value as the codec writes it, and reads the round's posts."""
    board.post(b"".join((np.array([0, key, rank, rank], np.int64).tobytes(), data.tobytes())))
    _wait_posted(board)()
    posts = board.messages(b"")
    assert posts is not None
    return posts


def _in_threads(*calls: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.skipif(not shm_supported(), reason="needs /dev/shm on x86-64")
def test_whole_ops_of_one_host_meet_on_its_board_with_compiled_and_python_members(library):
    """A job of one host of three ranks: two compiled members and one that posts as Python's path does. Rounds of
    the same op give every compiled member the reduced value (nothing crosses hosts, so every member reduces the
    posts: no result round). A round where the Python member posts another value leaves the arrays untouched:
    POSTS_DIFFER on both, and the rounds after it go on."""
    boards = _board_members(3)
    runner = compiled.UniformSteps(library)
    key, data = 11, _data(3, "float32", seed=5)
    steps = [runner.whole(0, key, member, 3, 16, 0, 0, 1 / 3, (), Waiter(None, AbortFlag(), spin_s=1e-4),
                          compiled.WholeBoard(boards[member], member, 0, _wait_posted(boards[member])))
             for member in (0, 1)]
    try:
        for python_key in (key, key, key + 1, key):  # the third round: another op on the Python member
            arrays = [row.copy() for row in data]
            results: list = [None, None]

            def member(index: int, arrays: list = arrays, results: list = results) -> None:
                results[index] = steps[index].run(arrays[index].ctypes.data)

            threads = _in_threads(lambda: member(0), lambda: member(1))
            posts = _python_member_posts(boards[2], python_key, 2, data[2])
            for thread in threads:
                thread.join(10)
            assert all(bytes(posts[index])[32:] == data[index].tobytes() for index in (0, 1))  # what each posted
            expected = (data[0] + data[1]) + data[2]
            scale(expected, 1 / 3)
            if python_key == key:
                assert results == [None, None]
                assert arrays[0].tobytes() == arrays[1].tobytes() == expected.tobytes()
            else:
                assert results == [compiled.POSTS_DIFFER] * 2
                assert all(arrays[index].tobytes() == data[index].tobytes() for index in (0, 1))
        assert boards[0].round == boards[1].round == boards[2].round == 4  # one round an op
    finally:
        for board in boards:
            board.close()


@pytest.mark.skipif(not shm_supported(), reason="needs /dev/shm on x86-64")
def test_a_hosts_leader_crosses_alone_and_posts_the_jobs_value_for_its_host(library):
    """Host A (ranks 0 and 1: the compiled leader and a rank on Python's path) and host B (rank 2, compiled): the
    leader reduces its host's posts, crosses to B, and posts the job's value in a second round, where the Python
    member reads it (as Hierarchy.shared_result's others do); B and the leader write it into their arrays."""
    boards = _board_members(2)
    a_end, b_end = _tcp_pair()
    runner = compiled.UniformSteps(library)
    key, data = 11, _data(3, "float64", seed=6)
    waiter = Waiter(None, AbortFlag(), spin_s=1e-4)
    leader = runner.whole(0, key, 0, 3, 32, 1, 0, 1.0, (compiled.StepLink(a_end.fileno(), a_end.fileno(), 1, "b"),),
                          waiter, compiled.WholeBoard(boards[0], 0, 0, _wait_posted(boards[0])))
    other = runner.whole(0, key, 2, 3, 32, 1, 0, 1.0, (compiled.StepLink(b_end.fileno(), b_end.fileno(), 0, "a"),),
                         Waiter(None, AbortFlag(), spin_s=1e-4))
    total = (data[0] + data[1]) + data[2]
    try:
        for _ in range(3):
            arrays = [data[0].copy(), None, data[2].copy()]
            results: dict = {}

            def run(index: int, steps: compiled.WholeSteps, arrays: list = arrays, results: dict = results) -> None:
                results[index] = steps.run(arrays[index].ctypes.data)

            threads = _in_threads(lambda: run(0, leader), lambda: run(2, other))
            _python_member_posts(boards[1], key, 1, data[1])
            boards[1].post(b"")  # the result round: nothing to say, the leader's value to read
            _wait_posted(boards[1])()
            result = boards[1].messages(b"")
            for thread in threads:
                thread.join(10)
            assert result is not None
            assert bytes(result[0]) == np.array([0, key, 0, 2], np.int64).tobytes() + total.tobytes()
            assert results == {0: None, 2: None}
            assert arrays[0].tobytes() == arrays[2].tobytes() == total.tobytes()
        assert boards[0].round == boards[1].round == 6  # two rounds an op
    finally:
        a_end.close()
        b_end.close()
        for board in boards:
            board.close()
