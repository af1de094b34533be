#!/usr/bin/env python3
"""FAKE Cray PALS ``mpiexec`` for tests: Cray PALS cannot be installed here.

It replays only what ALCF's documentation says PALS's mpiexec does with the options hvdrun uses
(Polaris/Aurora user guides: ``-n/--np`` total ranks, ``--ppn`` ranks per node, ``--hostfile``,
``--env VAR=val``, ``--envall``, ``--line-buffer``, ``--cpu-bind``, ``--depth=D`` and ``--gpu-bind``
(accepted and recorded only: the fake binds nothing); per-rank ``PMI_RANK``, ``PMI_SIZE``,
``PMI_LOCAL_RANK``, ``PMI_LOCAL_SIZE``, ``PALS_RANKID``, ``PALS_LOCAL_RANKID``): it starts every
rank on THIS machine, whatever the hostfile lists, and passes their output through. It records its
command line in ``$FAKE_PALS_RECORD`` when set. It is not PALS and proves nothing about PALS itself.
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
    if os.environ.get("FAKE_PALS_RECORD"):
        with open(os.environ["FAKE_PALS_RECORD"], "w") as record:
            json.dump({"argv": argv, "hosts": open(hostfile).read().split() if hostfile else None}, record)
    procs = [subprocess.Popen(command, env={**os.environ, **env, "PMI_RANK": str(r), "PMI_SIZE": str(np_),
                                            "PMI_LOCAL_RANK": str(r % ppn), "PMI_LOCAL_SIZE": str(ppn),
                                            "PALS_RANKID": str(r), "PALS_LOCAL_RANKID": str(r % ppn)})
             for r in range(np_)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0) if all(c >= 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
