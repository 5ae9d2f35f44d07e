"""Fault injection: a tier wrapper that makes loads fail the ways real tiers fail.

Configured per tier name under ``faults`` (tests and ``lmkv bench faults`` use it)::

    faults:
      disk: {corrupt_rate: 0.05, missing_rate: 0.02, short_read_rate: 0.02,
             delay_ms: 1, outages: [[10, 15]], seed: 7}

- ``missing_rate``: a page the lookup saw is gone when read (evicted in between);
- ``corrupt_rate``: a bit flips in transit, after the tier read it;
- ``short_read_rate``: the read returns fewer bytes than the page holds;
- ``delay_ms``: added latency per call;
- ``outages``: ``[start, end)`` windows in seconds since the tier was opened during which
  every call raises :class:`~lmkv.errors.TierUnavailableError` (a backend that is down).

Injected corruption is caught the way a page crossing a process or device boundary is:
by its checksum. Every fault is counted in the wrapped tier's stats.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmkv.config import FaultSpec
from lmkv.errors import PageError, ShortReadError, TierUnavailableError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import (
    PageHeader,
    as_bytes_view,
    units_in_ranges,
    verify_payload,
    verify_unit_buffers,
    verify_units,
)
from lmkv.tiers.base import Range, ReadsInPlace, Tier, WriteSession


class FaultyTier(Tier):
    """A tier whose reads fail as configured; writes, deletes and clears pass through."""

    def __init__(self, inner: Tier, spec: FaultSpec) -> None:
        super().__init__(inner.name)
        self.inner = inner
        self.spec = spec
        self.stats = inner.stats  # one set of counters for the tier, faults included
        self.serves_in_order = inner.serves_in_order
        self._rng = random.Random(spec.seed)
        self._rng_lock = threading.Lock()
        self._t0 = time.monotonic()
        self.injected = {"missing": 0, "corrupt": 0, "short": 0, "outage": 0}

    def _draw(self) -> float:
        with self._rng_lock:
            return self._rng.random()

    def _gate(self) -> None:
        if self.spec.delay_ms:
            time.sleep(self.spec.delay_ms / 1000)
        now = time.monotonic() - self._t0
        if any(a <= now < b for a, b in self.spec.outages):
            self.injected["outage"] += 1
            raise TierUnavailableError(f"{self.name}: injected outage")

    def _fault(self) -> str | None:
        r = self._draw()
        for kind, rate in (("missing", self.spec.missing_rate), ("corrupt", self.spec.corrupt_rate),
                           ("short", self.spec.short_read_rate)):
            if r < rate:
                return kind
            r -= rate
        return None

    def _spoil(self, kind: str, out, check: Callable[[], None]) -> None:
        """Damage what was read into ``out`` (a buffer), then run the boundary check that must catch it."""
        dst = np.frombuffer(as_bytes_view(out), np.uint8)
        self.injected[kind] += 1
        try:
            if kind == "corrupt":
                dst[self._draw_index(len(dst))] ^= 0x40
                check()
            else:
                raise ShortReadError(f"{self.name}: injected short read")
        except PageError:
            self.stats.corrupt += kind == "corrupt"
            self.stats.errors += kind == "short"
            raise

    def _draw_index(self, n: int) -> int:
        with self._rng_lock:
            return self._rng.randrange(n)

    # -- Tier --------------------------------------------------------------

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._gate()
        return self.inner.contains(keys)

    def _read_each(self, keys: Sequence[PageKey], outs: Sequence,
                   read: Callable[[PageKey, Any], PageHeader | None],
                   spoil: Callable[[str, PageHeader, Any], None]) -> list[PageHeader | None]:
        """Read page by page, each drawing its fault: a missing page is not read; a corrupt or
        short one is read, then damaged by ``spoil``, whose check makes it a miss."""
        self._gate()
        results: list[PageHeader | None] = []
        for key, out in zip(keys, outs):
            kind = self._fault()
            if kind == "missing":
                self.injected["missing"] += 1
                self.stats.misses += 1
                results.append(None)
                continue
            h = read(key, out)
            if h is not None and kind is not None:
                try:
                    spoil(kind, h, out)
                except PageError:
                    h = None
            results.append(h)
        return results

    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        def spoil(kind: str, h: PageHeader, out) -> None:
            self._spoil(kind, out, functools.partial(verify_payload, h, layout, out))

        return self._read_each(keys, outs, lambda k, out: self.inner.get([k], layout, [out])[0], spoil)

    def read_ranges(self, key: PageKey, layout: GroupLayout, ranges: Sequence[Range], out) -> PageHeader | None:
        return self.get_ranges([key], layout, ranges, [out])[0]

    def get_ranges(self, keys: Sequence[PageKey], layout: GroupLayout, ranges: Sequence[Range],
                   outs: Sequence) -> list[PageHeader | None]:
        """Each page's ranges drawing its own fault (a layerwise load can fail at any layer)."""
        def spoil(kind: str, h: PageHeader, out) -> None:
            self._spoil(kind, out, functools.partial(verify_units, h, layout, out, units_in_ranges(layout, ranges)))

        return self._read_each(keys, outs, lambda k, out: self.inner.get_ranges([k], layout, ranges, [out])[0], spoil)

    def put(self, pages: Sequence[tuple[PageHeader, object]], domain: str) -> list[bool]:
        self._gate()
        return self.inner.put(pages, domain)

    def delete(self, keys: Sequence[PageKey]) -> int:
        return self.inner.delete(keys)

    def open_session(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> WriteSession:
        self._gate()
        return self.inner.open_session(keys, layouts, domain)

    def clear(self, domain: str) -> int:
        return self.inner.clear(domain)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    def __len__(self) -> int:
        return len(self.inner)

    def close(self) -> None:
        self.inner.close()


class FaultyInPlaceTier(FaultyTier, ReadsInPlace):
    """The fault wrapper of a tier that reads in place (a buffered disk tier): faults hit that path
    too, so the fault benches and tests exercise the read path an engine's loads take in production."""

    def __init__(self, inner: Tier, spec: FaultSpec) -> None:
        if not isinstance(inner, ReadsInPlace):
            raise TypeError(f"{inner.name}: not an in-place reader")
        super().__init__(inner, spec)
        self.reader = inner

    @property
    def reads_in_place(self) -> bool:
        return self.reader.reads_in_place

    def get_units(self, keys: Sequence[PageKey], layout: GroupLayout, units: Sequence[list]) -> list[PageHeader | None]:
        def spoil(kind: str, h: PageHeader, bufs: list) -> None:  # a flipped byte lands in one engine buffer
            target = bufs[self._draw_index(len(bufs))]
            self._spoil(kind, target, functools.partial(verify_unit_buffers, h, layout, bufs))

        return self._read_each(keys, units, lambda k, bufs: self.reader.get_units([k], layout, [bufs])[0], spoil)


def faulty(tier: Tier, spec: FaultSpec) -> FaultyTier:
    """``tier`` behind a fault injector that keeps its capabilities (in-place reads)."""
    return FaultyInPlaceTier(tier, spec) if isinstance(tier, ReadsInPlace) else FaultyTier(tier, spec)
