"""Line splitting of worker output and log file names."""

from __future__ import annotations

import pytest

from hvdrun.launch.output import LineSplitter, rank_dir_name


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
    ([b"bad \xff byte\n"], ["bad \ufffd byte\n"]),
    ([b"\n\n"], ["\n", "\n"]),
    ([], []),
])
def test_line_splitter(chunks, expected):
    assert split_all(chunks) == expected


def test_line_splitter_never_loses_bytes():
    data = b"x" * 100 + b"\r\n" + b"y\r" * 50 + b"tail"
    pieces = [data[i:i + 7] for i in range(0, len(data), 7)]
    assert "".join(split_all(pieces)) == data.decode()


def test_rank_dir_names_sort_by_rank():
    assert rank_dir_name(3, 4) == "rank.3"
    assert rank_dir_name(3, 12) == "rank.03"
    assert rank_dir_name(0, 1) == "rank.0"
