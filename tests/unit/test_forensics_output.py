"""Pure pieces of #22's launcher side: rank lists, signal lists, the line cap, the console filter."""

from __future__ import annotations

import io
import signal

import pytest

from hvdrun.errors import UsageError
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.remote.guard import FORWARD, forward_byte
from hvdrun.launch.remote.lines import LineSplitter
from hvdrun.launch.supervision import parse_signal_list
from hvdrun.ranks import format_ranks, parse_rank_list


@pytest.mark.parametrize(("text", "ranks"), [("0", {0}), ("0,3-5", {0, 3, 4, 5}), (" 2 , 1 ", {1, 2})])
def test_rank_lists(text, ranks):
    assert parse_rank_list(text) == ranks
    assert parse_rank_list(format_ranks(sorted(ranks))) == ranks


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2"])
def test_bad_rank_lists(text):
    with pytest.raises(UsageError, match="0,3-5"):
        parse_rank_list(text)


def test_format_ranks_folds_runs():
    assert format_ranks([7, 0, 2, 3, 4]) == "0,2-4,7"


def test_signal_lists():
    assert parse_signal_list("USR1,sigusr2,CONT,10") == (signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
    assert parse_signal_list("none") == ()
    for bad in ("TERM", "INT", "HUP", "KILL", "STOP", "NOPE", "64"):
        with pytest.raises(UsageError):
            parse_signal_list(bad)


def test_forward_bytes_never_collide_with_the_lifeline_commands():
    assert forward_byte(signal.SIGUSR1)[0] == FORWARD + signal.SIGUSR1
    assert all(forward_byte(n) not in (b"T", b"K") for n in range(1, 64))


def test_a_line_past_the_cap_comes_in_pieces():
    splitter = LineSplitter(max_line_bytes=10)
    pieces = [p for _ in range(5) for p in splitter.feed(b"abcd")] + splitter.close()
    assert b"".join(pieces) == b"abcd" * 5 and max(map(len, pieces)) <= 12 and len(pieces) == 2
    assert LineSplitter(max_line_bytes=10).feed(b"ab\ncd") == [b"ab\n"]


def test_console_filter_keeps_tails_of_hidden_ranks():
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(2, console={"stdout": out, "stderr": err}, console_ranks=frozenset({0}))
    for rank, stream, data in ((0, "stdout", b"zero\n"), (1, "stderr", b"one\n")):
        chunks = iter([data, b""])
        router.attach_reader(rank, stream, lambda chunks=chunks: next(chunks))
    router.drain(5.0)
    assert out.getvalue() == "[0]<stdout>:zero\n" and err.getvalue() == ""
    assert router.stderr_tail(1) == ["one"]
