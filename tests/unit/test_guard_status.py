"""The launcher's end of a guard's status pipe (``forkserver.GuardStatus``)."""

from __future__ import annotations

import os
import resource

import pytest

from hvdrun.launch.remote.forkserver import GuardStatus

HIGH_FD = 1500  # past select()'s 1024: a launcher of hundreds of local ranks holds four descriptors a rank


@pytest.fixture
def high_pipe():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) <= HIGH_FD:
        pytest.skip(f"this process may not open descriptor {HIGH_FD} (RLIMIT_NOFILE {soft}, {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH_FD + 1), hard))
    read_end, write_end = os.pipe()
    os.dup2(read_end, HIGH_FD)
    os.close(read_end)
    yield HIGH_FD, write_end  # the test closes the write end, GuardStatus the read end (at the pipe's end)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_status_is_read_from_a_descriptor_past_1024_without_blocking(high_pipe):
    fd, write_end = high_pipe
    status = GuardStatus(fd)
    assert status.read() is None and not status.ended  # the guard is still running: no wait
    os.write(write_end, b"-9")
    assert status.read() is None  # half a line
    os.write(write_end, b"\n")
    os.close(write_end)
    assert status.read() == -9 and status.ended


def test_a_pipe_that_closes_without_a_status_means_the_guard_died(high_pipe):
    fd, write_end = high_pipe
    status = GuardStatus(fd)
    os.close(write_end)
    assert status.read(block=True) is None and status.ended
