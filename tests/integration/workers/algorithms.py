"""Every algorithm across hosts, checked exactly (integers): allreduce by ring, recursive doubling and
Rabenseifner at sizes from fewer elements than ranks to several chunks per rank; reducescatter, allgather
(ragged blocks), broadcast from every root (tree and ring sizes), the negotiation's message all-gather; then
ops through the engine. Prints one line per rank."""

import dataclasses
import sys

import numpy as np

from hvdrun.runtime import context
from hvdrun.runtime.collectives.hierarchical import BROADCAST_TREE_MAX_BYTES
from hvdrun.runtime.negotiation import Request
from hvdrun.runtime.transport.posts import SLOT_BYTES
from hvdrun.runtime.transport.tcp import TcpTx

QUICK = sys.argv[1:] == ["quick"]  # fewer sizes and roots: the same paths over real hosts, in less time
runtime = context.init()
size, rank = runtime.world.size, runtime.world.rank
checked = 0
# before any collective: a rank that fails this exits, and would fail its peers' next collective
assert runtime.engine.backend.hierarchy is not None, "the job did not get the hierarchical collectives"
with runtime.engine.paused() as backend:
    hierarchy = backend.hierarchy
    for algorithm in ("ring", "doubling", "halving"):
        hierarchy.choice = dataclasses.replace(hierarchy.choice, algorithm=algorithm)
        for elements in (size + 3, 65_537) if QUICK else (1, size - 1, size + 3, 1000, 65_537):
            for dtype in (np.int64,) if QUICK else (np.int64, np.int32):
                array = (np.arange(elements, dtype=dtype) * (rank + 1)) % 1000
                expected = sum((np.arange(elements, dtype=np.int64) * (r + 1)) % 1000 for r in range(size))
                backend.allreduce(array, np.add)
                assert np.array_equal(array, expected.astype(dtype)), (algorithm, elements, dtype, array[:5])
                checked += 1
            maximum = np.full(elements, rank, np.int64)
            backend.allreduce(maximum, np.maximum)
            assert np.all(maximum == size - 1), (algorithm, elements)
    # several ranks a host: a buffer that fits a post takes the host's board (two rounds), a larger one the ring
    if hierarchy.board is not None:
        for algorithm in ("doubling", "ring"):
            hierarchy.choice = dataclasses.replace(hierarchy.choice, algorithm=algorithm)
            for elements, rounds in ((size + 3, 2), (SLOT_BYTES // 8, 2), (SLOT_BYTES // 8 + 1, 0)):
                before, array = hierarchy.board.round, np.arange(elements, dtype=np.int64) + rank
                backend.allreduce(array, np.add)
                assert np.array_equal(array, size * np.arange(elements) + size * (size - 1) // 2), (elements, array)
                assert hierarchy.board.round - before == rounds, (elements, before, hierarchy.board.round)
                checked += 1
    # reducescatter: rank r gets elements bounds[r] of the sum, blocks of different sizes (some empty)
    counts = [(r % 3) * 5 for r in range(size)]
    total = sum(counts)
    bounds = [(sum(counts[:r]), sum(counts[:r + 1])) for r in range(size)]
    array = np.arange(total, dtype=np.int64) + rank
    backend.reducescatter(array, np.add, bounds)
    start, stop = bounds[rank]
    assert np.array_equal(array[start:stop], size * np.arange(start, stop) + size * (size - 1) // 2)
    # allgather of ragged blocks: rank r contributes r + 1 bytes of value r
    sizes = [r + 1 for r in range(size)]
    out = bytearray(sum(sizes))
    mine = sum(sizes[:rank])
    out[mine:mine + sizes[rank]] = bytes([rank]) * sizes[rank]
    backend.allgatherv(memoryview(out), sizes)
    assert out == b"".join(bytes([r]) * (r + 1) for r in range(size))
    # broadcast from every root, small (binomial tree across hosts) and large (ring across hosts)
    for nbytes in (3, BROADCAST_TREE_MAX_BYTES + 8):
        for root in (0, size - 1) if QUICK else range(size):
            buffer = bytearray([root % 251]) * nbytes if rank == root else bytearray(nbytes)
            backend.broadcast(memoryview(buffer), root)
            assert buffer == bytearray([root % 251]) * nbytes, (root, nbytes)
            checked += 1
    messages = backend.allgather_messages(f"rank {rank}".encode() * (rank + 1))
    assert messages == [f"rank {r}".encode() * (r + 1) for r in range(size)]
    # only what must cross: with the ring across hosts each rank sends 2 (H - 1) / H of its 1/L share over TCP
    hosts, local_size = runtime.world.cross_size, runtime.world.local_size
    hierarchy.choice = dataclasses.replace(hierarchy.choice, algorithm="ring")
    array = np.ones(1024 * hosts * local_size, np.int64)
    channels = {id(tx): tx for tx in [backend.ring.tx, *(link.tx for link in backend._links)]}  # one rank a host:
    tcp = [tx for tx in channels.values() if isinstance(tx, TcpTx)]  # the job's ring is the ring across hosts
    before = sum(tx.bytes_sent for tx in tcp)
    backend.allreduce(array, np.add)
    crossed = sum(tx.bytes_sent for tx in tcp) - before
    assert np.all(array == size)
    assert crossed == 2 * (hosts - 1) * array.nbytes // (hosts * local_size), (crossed, array.nbytes)
# through the engine: negotiation, the eager path and fused allreduces
for elements in (10, 100_000):
    handles = [runtime.engine.submit(Request(f"sum.{elements}.{i}", "allreduce", "int64", (elements,)),
                                     np.full(elements, rank + i, np.int64)) for i in range(3)]
    for i, handle in enumerate(handles):
        assert np.all(handle.wait() == sum(r + i for r in range(size)))
print(f"rank {rank}: {checked} checks ok on {hosts} hosts x {local_size}; {crossed} of {array.nbytes} bytes "
      "crossed hosts", flush=True)
context.shutdown()
