"""What a rank's interpreter set up before its first line ran; then it ends as ``sys.argv[1]`` says."""

import json
import os
import random
import signal
import sys
import threading
import time

PRELOADED = "torch" in sys.modules  # before this script imported anything of its own

import torch  # noqa: E402


def proc_view() -> dict:
    """What ps and /proc show of this process (a forked rank rewrites its parent's strings)."""
    with open("/proc/self/cmdline", "rb") as cmdline, open("/proc/self/environ", "rb") as environ:
        words, entries = cmdline.read().replace(b"\0", b" ").split(), environ.read().split(b"\0")
    shown = dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)
    return {"ps": [w.decode() for w in words[-3:]], "environ_is_own": shown == dict(os.environ)}


def facts() -> dict:
    loader = torch.utils.data.DataLoader(range(4), batch_size=2, num_workers=1)  # forks a worker of its own
    handlers = {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGHUP",
                                                                                 "SIGPIPE", "SIGCHLD", "SIGUSR1")}
    return {"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__, "spec": repr(__spec__),
            "cwd": os.getcwd(), "fds": sorted(os.listdir("/proc/self/fd")), "stdin": sys.stdin.read(),
            "handlers": handlers, "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "rank": os.environ["HVDRUN_RANK"], "unbuffered": sys.stdout.write_through,
            **proc_view(), "loader": [batch.tolist() for batch in loader]}


def late_line() -> None:
    time.sleep(0.2)
    print("the non-daemon thread ended", flush=True)


print("FACTS " + json.dumps({**facts(), "random": random.random(), "preloaded": PRELOADED}), flush=True)
threading.Thread(target=late_line).start()
import atexit  # noqa: E402

atexit.register(lambda: print("atexit ran"))
print("written without a flush")
end = sys.argv[1]
if end == "exit3":
    sys.exit(3)
if end == "message":
    sys.exit("the rank gave up")
if end == "raise":
    raise ValueError("the rank failed")
if end == "interrupt":
    raise KeyboardInterrupt
