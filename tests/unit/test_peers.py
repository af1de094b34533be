"""What the rendezvous sends each rank (runtime/peers.py): the layout of the whole job, run-length encoded, and only
the records that rank's collectives need (runtime/backends/native.needs_plan)."""

import marshal

import pytest

from hvdrun.errors import RendezvousError
from hvdrun.runtime.backends.native import needs_plan
from hvdrun.runtime.collectives.hierarchical import AlgorithmChoice, grid_of, link_partners
from hvdrun.runtime.peers import Layout, Peer, PeerTable


def peers(hosts: int, per_host: int, settings: str = "auto") -> list[Peer]:
    return [Peer(h * per_host + i, f"n{h}", f"n{h}/boot", 100 + i, f"10.0.0.{h}", 2000 + i, 0, settings)
            for h in range(hosts) for i in range(per_host)]


def test_the_layout_travels_as_one_entry_per_host_and_comes_back_whole():
    job = peers(64, 12)
    layout = Layout.of(job)
    encoded = layout.encode()
    assert len(encoded[2]) == 64 and len(encoded[3]) == 1  # runs: one per host; one settings value for all
    again = Layout.decode(marshal.loads(marshal.dumps(encoded)))
    assert again == layout
    assert again.rank_host_keys() == [p.host_key for p in job] and again.rank_hostnames()[13] == "n1"


def test_a_rank_gets_its_partners_records_and_not_the_whole_table():
    job = peers(16, 4)
    table = PeerTable(Layout.of(job), {p.rank: p for p in job})
    plan = needs_plan(AlgorithmChoice())(table.layout)
    grid = grid_of(table.layout.rank_host_keys())
    for rank in (0, 5, 37, 63):
        wanted = plan(rank)
        assert link_partners(grid, rank) | {(rank - 1) % 64, (rank + 1) % 64} == wanted - {rank}
        layout, rows = table.encode_for(wanted)
        mine = PeerTable.decode(layout, rows)
        assert mine.known() == sorted(wanted | {0})
        assert len(mine.known()) <= 2 + 2 + 2 + 4 + 1  # ring, host ring, cross ring, doubling partners, rank 0
        assert mine[(rank + 1) % 64] == job[(rank + 1) % 64] and len(mine) == 64
        outsider = next(r for r in range(64) if r not in wanted | {0})
        with pytest.raises(RendezvousError, match=f"rank {outsider}'s record was not sent"):
            mine[outsider]


def test_flat_plans_only_the_ring_neighbours():
    table = PeerTable(Layout.of(peers(4, 2)), {})
    assert needs_plan(AlgorithmChoice(algorithm="flat"))(table.layout)(3) == {2, 4}
