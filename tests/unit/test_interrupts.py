"""The launcher's wake-up that its signal handlers set (hvdrun.interrupts.Wakeup).

A supervision loop waited on a threading.Event that its SIGINT and --forward-signals handlers set. A signal that
landed while the main thread was inside that Event's wait(), holding its lock, ran the handler on the main thread,
whose set() then waited for that lock forever: hvdrun hung (seen twice in the suite under load: Ctrl-C during
restarts, SIGUSR2 to be forwarded; py-spy showed the handler in Event.set inside Event.wait). The stress below
(another process signalling every 0.2 ms while the main thread waits and clears in a loop) made a
threading.Event-based loop deadlock in 0.8 to 4.9 s in five tries on this 2-core VM; the pipe-based Wakeup
must come through.
"""

from __future__ import annotations

import subprocess
import sys
import threading

from hvdrun.interrupts import Wakeup

STRESS = """
import os, signal, subprocess, sys, time
from hvdrun.interrupts import Wakeup
wake, handled = Wakeup(), []
signal.signal(signal.SIGUSR1, lambda *_: (handled.append(1), wake.set()))
seconds = float(sys.argv[1])
sender = subprocess.Popen([sys.executable, "-c", f'''
import os, signal, time
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    os.kill({os.getpid()}, signal.SIGUSR1)
    time.sleep(0.0002)
'''])
end, waits = time.monotonic() + seconds, 0
while time.monotonic() < end:
    wake.wait(0.0005)
    wake.clear()
    waits += 1
sender.wait()
print("waits", waits, "handled", len(handled))
"""


def test_a_handler_that_sets_the_wakeup_while_the_main_thread_waits_on_it_never_hangs():
    done = subprocess.run([sys.executable, "-c", STRESS, "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    waits, handled = map(int, done.stdout.split()[1::2])
    assert waits > 100 and handled > 1000, done.stdout  # the loop went on, and the signals did land


def test_a_wakeup_wakes_a_waiter_on_another_thread_and_is_cleared_by_the_wait():
    wake = Wakeup()
    try:
        assert not wake.wait(0.01)
        threading.Timer(0.05, wake.set).start()
        assert wake.wait(10)  # woken (a timeout returns False)
        assert not wake.wait(0.01)  # the wait took the wake with it
        wake.set()
        wake.set()
        assert wake.clear() and not wake.clear()
    finally:
        wake.close()
    wake.set()  # closed: a no-op, no error
    assert not wake.wait(0.01)
