#!/usr/bin/env python3
"""FAKE Cray PALS ``mpiexec`` for tests: Cray PALS cannot be installed here.

It replays only what ALCF's documentation says PALS's mpiexec does with the options hvdrun uses
(Polaris/Aurora user guides: ``-n/--np`` total ranks, ``--ppn`` ranks per node, ``--hostfile``,
``--env VAR=val``, ``--envall``, ``--line-buffer``, ``--cpu-bind``, ``--depth=D`` and ``--gpu-bind``
(accepted and recorded only: the fake binds nothing); per-rank ``PMI_RANK``, ``PMI_SIZE``,
``PMI_LOCAL_RANK``, ``PMI_LOCAL_SIZE``, ``PALS_RANKID``, ``PALS_LOCAL_RANKID``): it starts every
rank on THIS machine, whatever the hostfile lists, and passes their output through. It appends its
command line and hosts to ``$FAKE_PALS_RECORD`` (a JSON line a run) when set. With ``$FAKE_PALS_UNREACHABLE`` (a
marker file) its first run starts no rank: it prints PALS's "Couldn't forward RPC launch(...) to child" failure
(ALCF's known issues) naming the hostfile's second node, and exits 255. It is not PALS and proves nothing about
PALS itself.
"""

import json
import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    np_, ppn, env, hostfile = 1, 1, {}, None
    words = iter(argv)
    command = []
    for word in words:
        if word in ("-n", "--np"):
            np_ = int(next(words))
        elif word in ("--ppn", "-ppn"):
            ppn = int(next(words))
        elif word == "--hostfile":
            hostfile = next(words)
        elif word in ("--cpu-bind", "--gpu-bind"):
            next(words)
        elif word in ("--env", "-env"):
            name, _, value = next(words).partition("=")
            env[name] = value
        elif word in ("--envall", "--line-buffer") or word.startswith("--depth="):
            continue
        else:
            command = [word, *words]
    hosts = open(hostfile).read().split() if hostfile else None
    if os.environ.get("FAKE_PALS_RECORD"):
        with open(os.environ["FAKE_PALS_RECORD"], "a") as record:  # one line per run
            record.write(json.dumps({"argv": argv, "hosts": hosts}) + "\n")
    unreachable = os.environ.get("FAKE_PALS_UNREACHABLE")  # a marker file: the first run cannot reach node 2
    if unreachable and hosts and len(hosts) > 1 and not os.path.exists(unreachable):
        open(unreachable, "w").close()
        # the shape of ALCF's known issue (argonne-lcf/user-guides docs/polaris/known-issues.md), the child's name
        # broken onto a line of its own as ezpz PR 244 shows it
        print(f"launch failed on {hosts[0]}: Couldn't forward RPC launch(ab751d77-e80a-4c54-b1c2-4e881f7e8c90) to "
              f"child\n{hosts[1]}: Resource temporarily unavailable", file=sys.stderr, flush=True)
        return 255
    procs = [subprocess.Popen(command, env={**os.environ, **env, "PMI_RANK": str(r), "PMI_SIZE": str(np_),
                                            "PMI_LOCAL_RANK": str(r % ppn), "PMI_LOCAL_SIZE": str(ppn),
                                            "PALS_RANKID": str(r), "PALS_LOCAL_RANKID": str(r % ppn)})
             for r in range(np_)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0) if all(c >= 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
