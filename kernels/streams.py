"""The worker's copies on CUDA streams of their own, ordered against the forward by events.

The forward's kernels run on torch's current stream (the *compute* stream). Queued there,
lmkv's copies would run between the layers' kernels: a load's layer ``l`` after layer
``l - 1``'s compute, a store's gather of layer ``l`` before layer ``l + 1``'s compute, the
forward stretched by every copy. On a stream of their own they overlap it:

- a load's layer ``l`` is queued as soon as its bytes are in host memory (every layer at
  once for memory hits), an event recorded after it; before attention layer ``l`` the
  compute stream waits on that event alone, and the host does not block at all unless layer
  ``l``'s bytes have not landed yet;
- after layer ``l`` computes, an event on the compute stream; the copy stream waits on it
  and gathers layer ``l`` while the later layers compute;
- at a step's start the copy stream waits for what the compute stream has queued so far
  (an earlier step may still read blocks this step's loads overwrite);
- at a step's end the host waits for the copy stream alone before it commits pages or
  hands them back.

Tensors the copies allocate (index tensors) are allocated while the copy stream is current,
so torch's caching allocator never hands their memory to the compute stream too early.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

#: an event per device, recorded on one stream of each
Events = dict[torch.device, torch.cuda.Event]


class Streams:
    """One CUDA stream per device; what is queued inside :meth:`active` goes to them.

    ``Streams.compute(devices)`` names torch's current streams (the forward's) instead of new
    ones, so both sides of an ordering are spoken of the same way."""

    def __init__(self, by_device: dict[torch.device, torch.cuda.Stream]) -> None:
        self.by_device = by_device
        self._timed: list[tuple[Events, Events]] = []

    @classmethod
    def new(cls, devices: Iterable[torch.device]) -> Streams:
        """New streams, each with memory of torch's caching allocator set aside for it now.

        The allocator keeps the blocks it frees for the stream they were used on: the first tensor
        a new stream's copies allocate (an index, a staging buffer) takes a ``cudaMalloc``, and the
        CUDA guide lists device allocation among the calls that synchronize implicitly. Made here,
        while nothing is queued, the index tensors' memory is this stream's before its first copy
        has to wait behind the forward."""
        streams = cls({d: torch.cuda.Stream(d) for d in devices})
        with streams.active():
            for d in streams.by_device:
                torch.empty(1, dtype=torch.uint8, device=d)  # (freed at once: its segment stays this stream's)
        return streams

    @classmethod
    def compute(cls, devices: Iterable[torch.device]) -> Streams:
        return cls({d: torch.cuda.current_stream(d) for d in devices})

    def record(self, timing: bool = False) -> Events:
        """An event after what is queued on each stream now."""
        out: Events = {}
        for dev, s in self.by_device.items():
            ev = torch.cuda.Event(enable_timing=timing)
            ev.record(s)
            out[dev] = ev
        return out

    def wait(self, events: Events) -> None:
        """What is queued on these streams from now on runs after ``events`` (the host does not wait)."""
        for dev, s in self.by_device.items():
            ev = events.get(dev)
            if ev is not None:
                s.wait_event(ev)

    def follow(self, other: Streams) -> None:
        """What is queued here from now on runs after everything queued on ``other`` so far."""
        self.wait(other.record())

    @contextmanager
    def active(self) -> Iterator[None]:
        """torch's current stream of each device is this set's while inside (CuPy's kernels and
        torch's copies queued inside go here).

        (Not ``torch.cuda.stream``: its context asks ``torch.cuda.is_available()`` on every entry,
        a driver call that cost ~160 µs in a VM, twice per layer per hook; streams and the current
        device are read and set by index here.)"""
        device = torch.cuda.current_device()
        before = [torch.cuda.current_stream(d) for d in self.by_device]
        try:
            for s in self.by_device.values():
                torch.cuda.set_stream(s)  # (also makes s's device the current one)
            yield
        finally:
            for s in before:
                torch.cuda.set_stream(s)
            torch.cuda.set_device(device)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """The copies queued inside are timed on the device (read with :meth:`take_seconds`): the
        time they took, not the time the stream spent waiting for the compute they follow."""
        start = self.record(timing=True)
        with self.active():
            yield
        self._timed.append((start, self.record(timing=True)))

    def take_seconds(self) -> float:
        """The device time of the copies timed since the last call (call after :meth:`synchronize`)."""
        ms = sum(a[d].elapsed_time(b[d]) for a, b in self._timed for d in a)
        self._timed = []
        return ms / 1e3

    def synchronize(self) -> None:
        """The host waits for everything queued on these streams."""
        for s in self.by_device.values():
            s.synchronize()


class CopyStreams:
    """A worker's two copy streams per device: ``step`` for the copies inside a step (layerwise
    loads and stores, rescues), ``background`` for asynchronous loads that run on I/O threads
    (never made to wait for a step's copies, nor a step for theirs)."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.devices = sorted(set(devices), key=str)
        self.step = Streams.new(self.devices)
        self.background = Streams.new(self.devices)

    def compute(self) -> Streams:
        """The forward's streams on this thread now (vLLM may run its forward on a stream of its own)."""
        return Streams.compute(self.devices)
