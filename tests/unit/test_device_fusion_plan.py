"""The device path's fusion decided without communication: which ready ops share a buffer, the buckets of a
DistributedOptimizer, and the buffers kept from op to op."""

from __future__ import annotations

import pytest
import torch

from hvdrun.runtime.device_buffers import FusionBuffers, SideStreams, wait_for_device_ops
from hvdrun.runtime.negotiation import Entry, Request, plan
from hvdrun.runtime.reduce import AVERAGE, SUM
from hvdrun.torch import buckets


def entry(name: str, kind: str = "allreduce", device: str = "torch:cuda", dtype: str = "float32", size: int = 4,
          op: int = SUM, root: int = -1) -> Entry:
    request = Request(name, kind, dtype, (size,), op=op, root=root, device=device)
    return Entry(name, {0: request, 1: request})


def names(batches: list[list[Entry]]) -> list[list[str]]:
    return [[e.name for e in batch] for batch in batches]


def test_device_allreduces_that_agree_share_one_buffer_up_to_the_threshold():
    ready = [entry("a"), entry("b"), entry("c", dtype="float64"), entry("d"), entry("e", op=AVERAGE),
             entry("f", device="cpu"), entry("g", device="cpu")]
    assert names(list(plan(ready, threshold_bytes=1 << 20))) == [["a", "b"], ["c"], ["d"], ["e"], ["f", "g"]]
    assert names(list(plan([entry("a"), entry("b"), entry("c")], threshold_bytes=32))) == [["a", "b"], ["c"]]


def test_device_broadcasts_of_one_root_share_a_buffer_whatever_their_dtypes():
    ready = [entry("a", "broadcast", root=0), entry("b", "broadcast", dtype="int32", root=0),
             entry("c", "broadcast", root=1), entry("d", "broadcast", device="cpu", root=1),
             entry("e", "broadcast", device="cpu", root=1)]
    assert names(list(plan(ready, threshold_bytes=1 << 20))) == [["a", "b"], ["c"], ["d"], ["e"]]


def test_device_allgathers_share_a_buffer_whatever_their_dtypes_and_shapes():
    ready = [entry("a", "allgather"), entry("b", "allgather", dtype="int16"), entry("c", "allgather", device="cpu"),
             entry("d", "allgather", device="cpu")]
    assert names(list(plan(ready, threshold_bytes=1 << 20))) == [["a", "b"], ["c"], ["d"]]


def test_an_entry_in_error_is_never_fused():
    failed = entry("b")
    failed.error = "mismatch"
    assert names(list(plan([entry("a"), failed, entry("c")], threshold_bytes=1 << 20))) == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize(("sizes", "kinds", "first_cap", "cap", "expected"), [
    ([4, 4, 4, 4], "ffff", 4, 8, [[0], [1, 2], [3]]),
    ([4, 4, 4, 4], "fdfd", 8, 8, [[0, 2], [1, 3]]),
    ([100, 1, 1], "fff", 8, 8, [[0], [1, 2]]),  # a member larger than the cap: a bucket of its own
    ([1] * 5, "fffff", 1 << 20, 1 << 20, [[0, 1, 2, 3, 4]]),
    ([], "", 1, 1, []),
])
def test_buckets_follow_backwards_order_one_kind_each_under_their_caps(sizes, kinds, first_cap, cap, expected):
    assert buckets.assign(sizes, list(kinds), first_cap, cap) == expected


def test_bucket_caps_follow_ddp_and_the_fusion_threshold():
    assert buckets.bucket_caps(64 << 20) == (1 << 20, 25 << 20)
    assert buckets.bucket_caps(64 << 10) == (64 << 10, 64 << 10)
    assert buckets.bucket_caps(0) == (0, 0)  # no fusion: a bucket a parameter


def test_buckets_of_parameters_in_reverse_registration_order_with_fp16_on_the_wire():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 7)] + [torch.nn.Parameter(torch.zeros(2).double())]
    names_of = {id(p): f"p{i}" for i, p in enumerate(params)}
    plain = buckets.build(params, lambda p: names_of[id(p)], fp16=False, fusion_threshold=1 << 20)
    assert [[names_of[id(p)] for p in b.params] for b in plain] == [["p3"], ["p2", "p1", "p0"]]
    assert [b.buffer.dtype for b in plain] == [torch.float64, torch.float32]
    halved = buckets.build(params, lambda p: names_of[id(p)], fp16=True, fusion_threshold=1 << 20)
    assert [b.buffer.dtype for b in halved] == [torch.float16] and halved[0].buffer.numel() == 17
    grads = [torch.arange(p.numel(), dtype=p.dtype) + 0.25 for p in halved[0].params]
    halved[0].fill(grads)
    back = [torch.zeros_like(g) for g in grads]
    halved[0].drain(back)
    assert all(torch.equal(a, b) for a, b in zip(back, grads, strict=True))  # exact in float16 at these values
    renamed = buckets.build(params, lambda p: "other" + names_of[id(p)], fp16=False, fusion_threshold=1 << 20)
    assert [b.name for b in renamed] != [b.name for b in plain]  # ranks whose models differ never meet


def test_fusion_buffers_are_kept_and_grow():
    buffers = FusionBuffers()
    first = buffers.flat(torch.float32, torch.device("cpu"), 10)
    again = buffers.flat(torch.float32, torch.device("cpu"), 6)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 6
    grown = buffers.flat(torch.float32, torch.device("cpu"), 100)
    assert grown.numel() == 100 and buffers.flat(torch.int32, torch.device("cpu"), 1).dtype == torch.int32
    flat, views = buffers.views([torch.zeros(2, 3), torch.zeros(4)])
    assert flat.numel() == 10 and [v.numel() for v in views] == [6, 4]


def test_cpu_tensors_need_no_streams():
    streams, tensor = SideStreams(), torch.ones(3)
    streams.mark_ready([tensor])
    with streams.running([tensor]):
        tensor.add_(1)
    wait_for_device_ops([tensor], streams)
    assert streams.stream_of(tensor.device) is None and tensor.tolist() == [2.0] * 3
