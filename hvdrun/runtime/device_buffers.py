"""What the device path keeps between ops: fusion buffers on the device and the side stream its collectives run on.

**Fusion buffers.** Ready device ops that agree (kind, dtype, device, op, scaling) are copied into one flat buffer,
reduced or broadcast by one collective and copied back (Horovod's fusion buffer, DDP's buckets). The buffers are
kept per dtype and device and only grow, so a training step allocates nothing.

**The side stream** (CUDA and XPU). The engine's thread never queues work on the stream the model computes on: a
fused op waits (on the device, through an event) for the point where its tensors were ready, runs its copies, the
collective and its scaling on a stream of its own, and whoever takes the result makes its own stream wait for that
side stream (:func:`wait_for_device_ops`). Nothing blocks the host. CPU tensors (the gloo stand-in) have no
streams: every call here is then a no-op, and the same code runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_STREAMED = ("cuda", "xpu")
_MAX_READY = 4096  # tensors with an event before the ones that happened are dropped


def _has_streams(device: Any) -> bool:
    return getattr(device, "type", "cpu") in _STREAMED


def _module(device: Any) -> Any:
    """``torch.cuda`` or ``torch.xpu``: their Stream, Event, current_stream and stream context."""
    import torch

    return getattr(torch, device.type)


class FusionBuffers:
    """One growing flat buffer per (dtype, device): the fused ops' staging area, reused by every cycle."""

    def __init__(self) -> None:  # noqa: D107
        self._buffers: dict[tuple[Any, Any], Any] = {}

    def flat(self, dtype: Any, device: Any, count: int) -> Any:
        """The first ``count`` elements of the buffer for ``dtype`` on ``device`` (grown when too small)."""
        import torch

        key = (dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = self._buffers[key] = torch.empty(count, dtype=dtype, device=device)
        return buffer[:count]

    def views(self, tensors: Sequence[Any]) -> tuple[Any, list[Any]]:
        """A flat buffer for ``tensors`` (one dtype and device) and each one's piece of it, flattened."""
        sizes = [t.numel() for t in tensors]
        flat = self.flat(tensors[0].dtype, tensors[0].device, sum(sizes))
        return flat, list(flat.split(sizes))

    def clear(self) -> None:
        """Let go of every buffer (the device memory returns to torch's allocator)."""
        self._buffers.clear()


class SideStreams:
    """The stream each device's collectives run on, and the events that order them against the model's stream.

    The thread that submits a device tensor records where it became ready (:meth:`mark_ready`); the engine's
    thread makes the side stream wait for that event before touching it (:meth:`running`).
    """

    def __init__(self) -> None:  # noqa: D107
        self._streams: dict[Any, Any] = {}
        self._ready: dict[int, Any] = {}
        self._lock = threading.Lock()

    def stream_of(self, device: Any) -> Any:
        """The side stream of ``device`` (made on first use), or None for a device without streams."""
        if not _has_streams(device):
            return None
        stream = self._streams.get(device)
        if stream is None:
            with self._lock:  # the engine's thread and a caller's may both come first
                stream = self._streams.get(device) or _module(device).Stream(device=device)
                self._streams[device] = stream
        return stream

    def mark_ready(self, tensors: Sequence[Any]) -> None:
        """Record, on the submitting thread's current stream, the point where ``tensors`` hold their values: one
        event a device for all of them (a submission of hundreds of tensors records a handful)."""
        events: dict[Any, Any] = {}
        for tensor in tensors:
            device = tensor.device
            if _has_streams(device) and device not in events:
                module = _module(device)
                events[device] = module.Event()
                events[device].record(module.current_stream(device))
        if not events:
            return
        with self._lock:
            if len(self._ready) >= _MAX_READY:
                self._prune()
            for tensor in tensors:
                if tensor.device in events:
                    self._ready[id(tensor)] = events[tensor.device]

    def _prune(self) -> None:
        """Drop the events that have happened (an op that failed before it ran leaves its own behind): waiting on
        them would be free anyway. Those still pending stay, however many: their ops have yet to run."""
        for key in [key for key, event in self._ready.items() if event.query()]:
            del self._ready[key]

    def forget(self, tensor: Any) -> None:
        """Drop the event :meth:`mark_ready` recorded for ``tensor`` (its op ran without the side stream)."""
        with self._lock:
            self._ready.pop(id(tensor), None)

    @contextmanager
    def running(self, tensors: Sequence[Any]) -> Iterator[None]:
        """Run the body on the side stream of ``tensors``' device, after the events of their readiness (or, for a
        tensor submitted without one, after everything queued on the device's current stream so far)."""
        device = tensors[0].device if tensors else None
        stream = self.stream_of(device)
        if stream is None:
            yield
            return
        module = _module(device)
        with self._lock:
            events = [self._ready.pop(id(t), None) for t in tensors]
        for event in dict.fromkeys(events):
            if event is None:
                stream.wait_stream(module.current_stream(device))
            else:
                stream.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(stream)  # the allocator must not reuse its memory before the side stream is done
        with module.stream(stream):
            yield


def wait_for_device_ops(results: Sequence[Any], streams: SideStreams | None) -> None:
    """Make the current stream of each result's device wait for the device path's side stream (on the device,
    not the host), so the results may be used on it; and tell the allocator they are used there (an output made
    on the side stream, freed by the caller, must not be handed to the side stream's next op while the caller's
    kernels still read it). Tensors without streams need nothing."""
    if streams is None:
        return
    for result in results:
        stream = streams.stream_of(result.device)
        if stream is not None:
            current = _module(result.device).current_stream(result.device)
            current.wait_stream(stream)
            result.record_stream(current)
