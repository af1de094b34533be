"""Line splitting of worker output and log file names."""

from __future__ import annotations

import pytest

from hvdrun.launch.output import rank_dir_name
from hvdrun.launch.remote.lines import LineSplitter


def split_all(chunks):
    splitter = LineSplitter()
    lines = [line for chunk in chunks for line in splitter.feed(chunk)]
    return lines + splitter.close()


@pytest.mark.parametrize("chunks, expected", [
    ([b"a\nb\n"], ["a\n", "b\n"]),
    ([b"par", b"tial\nrest"], ["partial\n", "rest"]),
    ([b"10%\r20%\r30%\n"], ["10%\r", "20%\r", "30%\n"]),
    ([b"dos\r", b"\nnext\r\n"], ["dos\r\n", "next\r\n"]),
    ([b"end\r"], ["end\r"]),
    (["é€".encode()[:3], "é€".encode()[3:] + b"\n"], ["é€\n"]),
    ([b"bad \xff byte\n"], ["bad \udcff byte\n"]),
    ([b"\n\n"], ["\n", "\n"]),
    ([], []),
])
def test_line_splitter(chunks, expected):
    assert split_all(chunks) == [line.encode("utf-8", "surrogateescape") for line in expected]  # bytes pass as they are


def test_line_splitter_never_loses_bytes():
    data = b"x" * 100 + b"\r\n" + b"y\r" * 50 + b"tail"
    pieces = [data[i:i + 7] for i in range(0, len(data), 7)]
    assert b"".join(split_all(pieces)) == data


def test_rank_dir_names_sort_by_rank():
    assert rank_dir_name(3, 4) == "rank.3"
    assert rank_dir_name(3, 12) == "rank.03"
    assert rank_dir_name(0, 1) == "rank.0"


def test_line_splitter_result_does_not_depend_on_chunking():
    import random

    rng = random.Random(7)
    data = b"".join(rng.choice([b"a" * rng.randint(0, 300), b"\n", b"\r", b"\r\n", "é".encode()])
                    for _ in range(2000))
    whole = split_all([data])
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), 50))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert split_all(pieces) == whole
    assert b"".join(whole) == data


def test_line_splitter_is_linear_in_a_long_line():
    """A 4 MB line fed in 64 KB reads is joined once; the old splitter rescanned it on every read."""
    splitter = LineSplitter()
    data = b"x" * (4 << 20) + b"\n"
    lines = [line for i in range(0, len(data), 65536) for line in splitter.feed(data[i:i + 65536])]
    assert lines == [data] and splitter.close() == []


@pytest.mark.parametrize("pieces_of_limit", [1, 2, 3])
def test_a_line_of_exactly_a_multiple_of_the_limit_gains_no_empty_line(pieces_of_limit):
    splitter = LineSplitter(max_line_bytes=16)
    data = b"x" * (16 * pieces_of_limit) + b"\n"
    lines = [line for i in range(0, len(data), 16) for line in splitter.feed(data[i:i + 16])] + splitter.close()
    assert b"".join(lines) == data and all(len(line) <= 16 for line in lines)
    assert b"\n" not in lines and lines[-1].endswith(b"x\n")
