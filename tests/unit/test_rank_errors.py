"""The error the launcher reads in a failed rank's stderr (``supervision.hvdrun_error``)."""

from __future__ import annotations

import threading

from hvdrun.launch.supervision import hvdrun_error

TIMED_OUT = "hvdrun.errors.RendezvousError: rendezvous timed out after 3 s: ranks 1 never joined rank 0"


def test_the_last_error_hvdrun_reported_is_read_without_its_prefix():
    assert hvdrun_error(["some output", "hvdrun: error: first", "Traceback (most recent call last):",
                         '  File "x.py", line 1', "hvdrun.errors.PeerLost: rank 3 is gone"]) == "rank 3 is gone"
    assert hvdrun_error(["Traceback (most recent call last):", "ValueError: not ours"]) is None


def test_an_exception_raised_while_handling_hvdruns_leaves_hvdruns_as_the_cause():
    tail = ["Traceback (most recent call last):", '  File "never_joins.py", line 9, in <module>', TIMED_OUT, "",
            "During handling of the above exception, another exception occurred:", "",
            "Traceback (most recent call last):", '  File "never_joins.py", line 11, in <module>',
            "hvdrun.errors.PeerLost: rank 0 closed the connection"]
    assert hvdrun_error(tail) == "rendezvous timed out after 3 s: ranks 1 never joined rank 0"
    assert hvdrun_error(tail[-3:]) == "rank 0 closed the connection"  # no chain in view: the last one
    assert hvdrun_error(tail[-3:] + tail) == "rendezvous timed out after 3 s: ranks 1 never joined rank 0"
    later = ["Traceback (most recent call last):", '  File "x.py", line 3', "hvdrun.errors.PeerLost: rank 3 is gone"]
    assert hvdrun_error(tail + later) == "rank 3 is gone"  # a traceback of its own after the chain: the last


def test_a_failure_reported_to_a_rank_0_that_is_gone_raises_nothing_more():
    """A rank whose rendezvous timed out reports it to rank 0; rank 0, timed out too, may have exited already: the
    report must not raise while the timeout is being handled (a second traceback would bury the first)."""
    import socket

    from hvdrun.runtime.rendezvous.client import Client

    ours, theirs = socket.socketpair()
    theirs.close()  # rank 0 exited
    client = Client.__new__(Client)  # only what report_failure uses: its socket and send lock
    client.sock = ours
    client._send_lock = threading.Lock()
    for _ in range(3):  # the first send may still be taken by the kernel; a later one meets the closed end
        client.report_failure("rank 2 failed while joining the job: rendezvous timed out")
    ours.close()
