"""Rank 0's cost per host in the rendezvous (the model's ``c_join``, benchmarks/startup_model.py).

    python benchmarks/rendezvous_cost.py --hosts 16,64,256 --ranks-per-host 12

Rank 0's server runs in this process; one client process per host plays that host's leader (its own record and
its host's other ranks', as a leader sends them), waits for the table, passes the two set-up barriers and says
goodbye. Printed per host count: rank 0's CPU time (this process, all threads) from the first connection to the
last goodbye, per host; and the bytes of the table each leader received (the layout grows with the hosts).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvdrun.protocol.sockets import listen  # noqa: E402
from hvdrun.runtime.peers import Peer, ring_neighbours  # noqa: E402
from hvdrun.runtime.rendezvous.common import reserve_listener  # noqa: E402
from hvdrun.runtime.rendezvous.server import RootServer  # noqa: E402
from hvdrun.runtime.transport.channels import AbortFlag  # noqa: E402

LEADER = textwrap.dedent("""
    import socket, sys, time
    from hvdrun.protocol.wire import authenticate_server, recv_frame, send_frame
    port, host, per_host, secret = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
    rows = [[1 + (host - 1) * per_host + i, f"node{host}", f"node{host}/boot", 1000 + i, "10.0.0.1", 20000 + i, 0, ""]
            for i in range(per_host)]
    sock = socket.create_connection(("127.0.0.1", port))
    authenticate_server(sock, secret, "rank 0")
    send_frame(sock, (0, rows))
    message = recv_frame(sock)
    assert message[0] == "table", message
    size = len(__import__("marshal").dumps(message))
    for number in (1, 2):
        send_frame(sock, ("ready", number, per_host))
        while recv_frame(sock)[0] != "go":
            pass
    send_frame(sock, ("bye",))
    print(size, flush=True)
    recv_frame(sock)  # rank 0's goodbye
""")


def measure(hosts: int, per_host: int) -> tuple[float, float]:
    """(rank 0's CPU seconds per host, table bytes a leader received)."""
    secret = os.urandom(32)
    size = 1 + hosts * per_host  # rank 0 alone on its host; host h holds ranks 1 + (h - 1) L ..
    sock = listen("127.0.0.1", 0, size)
    port = sock.getsockname()[1]
    reserve_listener("127.0.0.1", port, sock)
    server = RootServer("127.0.0.1", port, size, secret, AbortFlag(), 0)
    me = Peer(0, "node-r0", "node-r0/boot", os.getpid(), "127.0.0.1", 1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    leaders = [subprocess.Popen([sys.executable, "-c", LEADER, str(port), str(h), str(per_host), secret.hex()],
                                env=env, stdout=subprocess.PIPE, text=True) for h in range(1, hosts + 1)]
    time.sleep(0.5 + hosts * 0.02)  # let the leaders start (their Python) before rank 0's clock runs
    before = resource.getrusage(resource.RUSAGE_SELF)
    server.gather(me, time.monotonic() + 120, ring_neighbours, None)
    deadline = time.monotonic() + 120
    for number in (1, 2):
        server.barrier(number, deadline)
    while sum(conn.said_bye for conn in server.conns.values()) < hosts and time.monotonic() < deadline:
        time.sleep(0.001)
    after = resource.getrusage(resource.RUSAGE_SELF)
    server.close()
    sizes = [int(leader.communicate(timeout=60)[0].split()[0]) for leader in leaders]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu / hosts, sum(sizes) / len(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="16,64,256")
    parser.add_argument("--ranks-per-host", type=int, default=12)
    args = parser.parse_args()
    print("| hosts | rank 0 CPU per host | table bytes per leader |")
    print("|---|---|---|")
    for hosts in (int(w) for w in args.hosts.split(",")):
        per_host_cpu, table_bytes = measure(hosts, args.ranks_per_host)
        print(f"| {hosts} | {per_host_cpu * 1e3:.2f} ms | {table_bytes:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
