"""Waiting on descriptors with poll(2) (``runtime/readiness.py``): no limit on their numbers, select's answers."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from hvdrun.runtime.readiness import readable

HIGH_FD = 1500  # past select()'s 1024


@pytest.fixture
def high_pipe():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH_FD + 1:
        pytest.skip(f"this process may not open descriptor {HIGH_FD + 1} (RLIMIT_NOFILE {soft}, {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH_FD + 2), hard))
    read_end, write_end = os.pipe()
    os.dup2(read_end, HIGH_FD)
    os.dup2(write_end, HIGH_FD + 1)
    os.close(read_end)
    os.close(write_end)
    yield HIGH_FD, HIGH_FD + 1
    for fd in (HIGH_FD, HIGH_FD + 1):
        try:
            os.close(fd)
        except OSError:
            pass  # the test closed it
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_descriptors_past_1024_are_watched_as_select_would(high_pipe):
    read_end, write_end = high_pipe
    assert readable([read_end], 0.01) == []  # nothing yet: the timeout
    assert readable([read_end], 0.0, writable=[write_end]) == []  # writable, but only the readable ones are said
    os.write(write_end, b"x")
    assert readable([read_end], 5.0) == [read_end]
    os.read(read_end, 1)
    os.close(write_end)
    assert readable([read_end], 5.0) == [read_end]  # the end of the pipe reads as readable (an empty read)


def test_sockets_come_back_as_the_objects_given_and_a_closed_one_is_an_error():
    left, right = socket.socketpair()
    with left, right:
        right.send(b"x")
        assert readable([left, right], 5.0) == [left]
        closed = socket.socket()
        closed.close()
        with pytest.raises(ValueError):
            readable([left, closed], 0.0)
