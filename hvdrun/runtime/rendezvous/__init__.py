"""Rendezvous: rank 0 serves an authenticated TCP control socket that every rank joins, itself or through its host.

1. Every rank sends its :class:`Peer` record (host, pid, data endpoint); rank 0 answers with the job's
   :class:`~hvdrun.runtime.peers.Layout` (every rank's host, small) and the full records that rank's collectives
   need (its ring neighbours and links: :data:`~hvdrun.runtime.peers.NeedsPlan`), or with an error naming the
   ranks that never arrived. On a host with several ranks, its local rank 0 leads it (:mod:`.leader`): the host's
   ranks join it over a local socket and it joins rank 0 for them, so rank 0 holds one connection per host.
2. Afterwards the control connections are the job's failure detector: if one drops without a goodbye, rank 0
   (or the host's leader) tells every other rank which rank died; if rank 0 drops, every rank notices (through
   its leader). Either way the :class:`AbortFlag` is set and every wait loop raises.
3. They also carry reports (:mod:`hvdrun.runtime.forensics`; the requests: :mod:`hvdrun.protocol.inspection`):
   an inspector that knows the secret (``hvdrun stacks``, or hvdrun on Ctrl-\\) connects to rank 0 and sends
   ``("inspect",)``; rank 0 asks every rank for its report over the control connections (a leader answers for
   its host) and answers with all of them. Rank 0's stall check gathers the same reports itself.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from hvdrun import envvars
from hvdrun.errors import RendezvousError
from hvdrun.protocol.sockets import MIN_BACKLOG, listen
from hvdrun.protocol.tree import TreePlace
from hvdrun.runtime.peers import NeedsPlan, Peer, PeerTable, ring_neighbours
from hvdrun.runtime.rendezvous.children import Children
from hvdrun.runtime.rendezvous.client import Client
from hvdrun.runtime.rendezvous.common import (
    Reporter,
    Upstream,
    local_socket_name,
    reserve_listener,
    route_to,
    try_listen_local,
)
from hvdrun.runtime.rendezvous.leader import HostLeader
from hvdrun.runtime.rendezvous.server import RootServer
from hvdrun.runtime.transport.channels import AbortFlag

__all__ = ["Peer", "PeerTable", "Rendezvous", "reserve_listener"]


class Rendezvous:
    """One rank's membership in the job's control plane.

    With more than one rank on a host (``local_size``, as the launcher set it), the first of them to bind the
    host's local socket leads it: the host's other ranks join it there, it joins rank 0 for all of them and relays
    aborts, reports, signals and set-up barriers (:mod:`hvdrun.runtime.rendezvous.leader`), so rank 0 holds one
    connection per host. Otherwise (or with ``HVDRUN_RENDEZVOUS=flat``) every rank joins rank 0 itself.

    Args:
        rank: this rank.
        size: number of ranks.
        addr: rank 0's advertised address.
        port: rank 0's control port.
        secret: the job's secret (bytes).
        abort: the flag to set when a peer fails.
        generation: how many times this process called init() before; all ranks agree on it.
        local_size: number of ranks on this host (None: unknown; every rank then joins rank 0 itself).
        tree: where this rank's host sits in a large job's rendezvous tree (:mod:`hvdrun.protocol.tree`; None: it
            joins rank 0 and admits no other host).
    """

    def __init__(self, rank: int, size: int, addr: str, port: int, secret: bytes, abort: AbortFlag,
                 generation: int = 0, local_size: int | None = None, tree: TreePlace | None = None) -> None:
        self.rank, self.size, self.addr, self.port = rank, size, addr, port
        self.abort, self.secret, self.generation = abort, secret, generation
        flat = os.environ.get(envvars.RENDEZVOUS, "").lower() == "flat"
        self.tree = None if flat or rank == 0 else tree
        self.grouped = ((local_size or 1) > 1 or (self.tree is not None and self.tree.listen is not None)) \
            and sys.platform.startswith("linux") and not flat
        self._server = RootServer(addr, port, size, secret, abort, generation) if rank == 0 else None
        self._client: Client | None = None
        self._leader: HostLeader | None = None
        if rank != 0 and not self.grouped:
            self._client = Client(self._upstream(), secret, abort, generation)

    def _upstream(self, local_name: str | None = None) -> Upstream:
        """Where this rank (or, as its leader, its host) joins: its parent host's leader in the tree, else rank 0."""
        if local_name is None and self.tree is not None and self.tree.parent is not None:
            return Upstream(*self.tree.parent, tree_parent=True)
        return Upstream(self.addr, self.port, local_name)

    def local_address(self, deadline: float) -> str:
        """The address of this rank that the others can reach (the route to rank 0)."""
        if self._server is not None:
            return self.addr
        if self._client is not None and (self.tree is None or self.tree.parent is None):
            return str(self._client.connect(deadline).getsockname()[0])
        return route_to(self.addr, self.port)

    def exchange(self, me: Peer, timeout_s: float, needs: NeedsPlan = ring_neighbours) -> PeerTable:
        """Publish ``me``; return the job's layout with the records this rank needs (``needs``), by rank.

        Grouped, the first rank of a host to bind the host's local socket leads it (rank 0 leads its own host when
        it binds first); the others join the leader there."""
        deadline = time.monotonic() + timeout_s
        local_name = local_socket_name(self.secret, self.generation, me.host_key) if self.grouped else None
        listener = try_listen_local(local_name) if local_name is not None else None
        if self._server is not None:
            return self._server.gather(me, deadline, needs, listener)
        if listener is not None:
            return self._lead_host(me, listener, deadline)
        if self._client is None:
            self._client = Client(self._upstream(local_name), self.secret, self.abort, self.generation)
        return self._client.join_table(me, deadline)

    def _lead_host(self, me: Peer, listener: socket.socket, deadline: float) -> PeerTable:
        """Join for this host as its leader; on an inner host of the tree, admit its children too and join for them
        all."""
        children = None
        if self.tree is not None and self.tree.listen is not None:
            try:  # the launcher's address for it (as the children reach it); an earlier init()'s may be closing
                children = Children(listen(*self.tree.listen, MIN_BACKLOG, until=deadline), self.secret,
                                    self.generation, self.size)
            except RendezvousError as e:
                listener.close()
                raise RendezvousError(f"rank {self.rank} admits other hosts of the rendezvous tree: {e}") from e
        self._leader = HostLeader(Client(self._upstream(), self.secret, self.abort, self.generation), listener,
                                  children)
        return self._leader.exchange(me, deadline)

    def set_reporter(self, reporter: Reporter) -> None:
        """What this rank answers when asked for its report."""
        for endpoint in (self._server, self._leader, self._client):
            if endpoint is not None:
                endpoint.reporter = reporter

    def gather_reports(self) -> tuple[list[dict[str, Any]], dict[int, str]] | None:
        """Rank 0: every rank's report and why some have none (other ranks: None)."""
        return self._server.gather_reports() if self._server is not None else None

    def barrier(self, number: int, deadline: float) -> None:
        """Set-up barrier ``number`` over the control connections: returns once every rank reached it.

        Raises:
            CollectiveError: the job was aborted meanwhile (a rank died).
            RendezvousError: not every rank arrived by the monotonic ``deadline``.
        """
        endpoint = self._server or self._leader or self._client
        if endpoint is not None:
            endpoint.barrier(number, deadline)

    def report_failure(self, reason: str) -> None:
        """Tell the other ranks that this rank hit a fatal error (rank 0 relays it)."""
        if self._server is not None:
            self._server.broadcast_abort(reason)
            return
        endpoint = self._leader or self._client
        if endpoint is not None:
            endpoint.report_failure(reason)

    def close(self) -> None:
        """Leave the job cleanly."""
        for endpoint in (self._server, self._leader, self._client):
            if endpoint is not None:
                endpoint.close()
