"""The tier interface every place a page can live implements.

All calls are batched, thread-safe and synchronous; :class:`lmkv.store.TieredStore`
runs them on its I/O threads and offers awaitable variants, so async code and
an engine's model-runner thread use the same tiers.

Reads land in caller-owned buffers at the page's own offsets: a full read fills
``out[0:payload_bytes]``, a ranged read fills only the requested ranges, so a
layerwise loader can hand layer ``l``'s bytes to the engine as soon as they
arrive. A failed read is a miss for the caller (``None``); the tier counts the
reason and drops a page it found corrupt so it is never served.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from lmkv.domains import DomainRegistry
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, as_bytes_view, make_header
from lmkv.tiers.accounts import Accounts, Limit, Usage

Range = tuple[int, int]


@dataclass
class TierStats:
    """Counters a tier keeps about itself (exported by :mod:`lmkv.metrics`)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    full: int = 0
    quarantined: int = 0
    reclaimed: int = 0

    def stored(self, nbytes: int) -> None:
        """A page of ``nbytes`` went into the tier."""
        self.puts += 1
        self.put_bytes += nbytes


class ResidencyListener(Protocol):
    """Told of every key a memory tier publishes or drops, under the tier's lock (so in order).

    The engine side logs these for a scheduler in another process
    (:class:`lmkv.engine.residency.ResidencyLog`); a call must not block or call back into the tier.
    """

    def added(self, key: PageKey) -> None: ...

    def removed(self, key: PageKey) -> None: ...


def covered(ranges: Iterable[tuple[int, int]], size: int) -> bool:
    """Whether byte ``ranges`` cover ``[0, size)`` (what a stream sent of a page, before it ends it)."""
    at = 0
    for start, end in sorted(ranges):
        if start > at:
            return False
        at = max(at, end)
    return at >= size


class StepStream(Protocol):
    """A step's pages going down to a tier while the step computes them, made readable there when it
    commits (:meth:`Tier.stream`; Mooncake's put sessions, :mod:`lmkv.tiers.mooncake_puts`; the lmkv
    server's and Redis's, :mod:`lmkv.tiers.put_stream`)."""

    def filled(self, indices: Sequence[int], start: int, end: int,
               ready: Callable[[], object] | None = None) -> None:
        """Bytes ``[start, end)`` of the pages at ``indices`` are in their buffers (once ``ready``
        returns)."""

    def finish(self, headers: Sequence[PageHeader | None], slots: Sequence[int | None]) -> Future[set[PageKey]]:
        """The step committed ``headers`` (None: a page not stored); ``slots``: each page's buffer
        address now (pinned). Resolves to the pages readable in the tier."""

    def abort(self) -> None:
        """The step aborted: nothing of it becomes readable."""


class WriteSession(ABC):
    """Pages reserved for one step, filled range by range, committed atomically.

    Nothing is visible to readers before :meth:`commit`; :meth:`abort` (or leaving
    the ``with`` block by an exception) releases every reservation and leaves no trace.
    """

    def __init__(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout]) -> None:
        if len(keys) != len(layouts):
            raise ValueError("one layout per key")
        self.keys = list(keys)
        self.layouts = list(layouts)
        self.closed = False

    @abstractmethod
    def buffer(self, i: int):
        """Writable byte view of page ``i``'s payload (for copies that write in place)."""

    def write(self, i: int, offset: int, data) -> None:
        """Copy ``data`` into page ``i`` at payload ``offset`` (e.g. one layer's range)."""
        src = as_bytes_view(data)
        if offset < 0 or offset + len(src) > self.layouts[i].payload_bytes:
            raise ValueError(
                f"range [{offset}, {offset + len(src)}) outside a {self.layouts[i].payload_bytes}-byte page"
            )
        self.buffer(i)[offset : offset + len(src)] = src

    def headers(self) -> list[PageHeader]:
        """Checksum every page: one pass over each payload, once."""
        return [make_header(k, lay, self.buffer(i)) for i, (k, lay) in enumerate(zip(self.keys, self.layouts))]

    @abstractmethod
    def commit(self, headers: Sequence[PageHeader | None] | None = None) -> list[bool]:
        """Publish every page at once; per page, whether it was stored.

        ``headers`` skips the checksum pass for pages whose header is known (a page
        read from another tier, already verified); a ``None`` entry drops that page
        (it failed to fill) and stores only the others.
        """

    @abstractmethod
    def abort(self) -> None:
        """Release every reservation; nothing becomes visible."""

    def __enter__(self) -> WriteSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.closed:
            self.abort()


class Tier(ABC):
    """A place pages live: host memory, local disk, the lmkv server, Redis."""

    #: whether reads from this tier verify page checksums
    verifies: bool = True
    #: whether one server thread answers this tier's requests one after another (a Redis node): requests
    #: in flight at once share its time, so a layerwise load's first layer lands no sooner than all of
    #: them; one request at a time lands the layers in order at the same rate (the worker's depth 1)
    serves_in_order: bool = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TierStats()

    @abstractmethod
    def contains(self, keys: Sequence[PageKey]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        """Read whole payloads into ``outs``; ``None`` for a page that is missing or failed."""

    @abstractmethod
    def read_ranges(self, key: PageKey, layout: GroupLayout, ranges: Sequence[Range], out) -> PageHeader | None:
        """Read byte ranges (whole units of the layout) into ``out`` at their page offsets."""

    def get_ranges(self, keys: Sequence[PageKey], layout: GroupLayout, ranges: Sequence[Range],
                   outs: Sequence) -> list[PageHeader | None]:
        """The same byte ranges of many pages (a layer of each, in a layerwise load) into ``outs`` at
        their page offsets, each verified unit by unit as it lands; ``None`` for a page that is
        missing or failed. Network tiers send one request for all of them; this default reads page
        by page."""
        return [self.read_ranges(k, layout, ranges, o) for k, o in zip(keys, outs)]

    @abstractmethod
    def put(self, pages: Sequence[tuple[PageHeader, object]], domain: str) -> list[bool]:
        """Store pages whose header is already made; per page, whether it is now resident."""

    @abstractmethod
    def delete(self, keys: Sequence[PageKey]) -> int: ...

    @abstractmethod
    def open_session(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> WriteSession: ...

    @abstractmethod
    def clear(self, domain: str) -> int:
        """Drop ``domain``'s ownership everywhere; delete pages no one else owns. Returns pages deleted."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    def quarantined_bytes(self) -> int:
        """Bytes held back from reuse for writers that may still finish late (:mod:`lmkv.tiers.quarantine`)."""
        return 0

    def stream(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
               domain: str) -> StepStream | None:
        """A step's pages (filling ``bufs``, memory-tier slots; owned by ``domain``) taken layer by
        layer as they fill, or None: the tier takes them whole when the step's write-through copies
        them down (the default)."""
        return None

    @abstractmethod
    def __len__(self) -> int: ...

    def close(self) -> None:  # noqa: B027 (optional: most tiers have nothing to release)
        """Release resources; the default has none."""


class ReadsInPlace(ABC):
    """A capability: the tier reads pages straight into an engine's buffers, one buffer per unit
    (one layer's segment of one block), checksums verified where the bytes land, without a stop
    in lmkv's memory tier (a buffered disk tier: the OS page cache is its memory). The store
    stages every other tier's pages through memory. As with vLLM's ``SupportsHMA``, the type
    declares the capability; :attr:`reads_in_place` says whether this instance can use it now
    (a disk tier on O_DIRECT needs aligned buffers, which an engine's blocks are not)."""

    @property
    @abstractmethod
    def reads_in_place(self) -> bool: ...

    @abstractmethod
    def get_units(self, keys: Sequence[PageKey], layout: GroupLayout, units: Sequence[list]) -> list[PageHeader | None]:
        """Read page ``i``'s unit ``u`` into ``units[i][u]``; ``None`` where a page is missing or failed
        (its buffers may then hold anything)."""


def in_place_reader(tier: Tier) -> ReadsInPlace | None:
    """``tier`` as an in-place reader if it is one and can read in place now, else ``None``."""
    return tier if isinstance(tier, ReadsInPlace) and tier.reads_in_place else None


class _Owned(Protocol):
    domains: int  # a bit per residency domain (:class:`lmkv.domains.DomainRegistry`)


class LocalTier(Tier):
    """A tier whose index lives in this process (memory, disk): the bookkeeping they share.

    Subclasses fill in the index (key -> entry with a ``domains`` bit set), the domain registry,
    the bytes used and the lock.
    """

    _index: Mapping[PageKey, _Owned]
    _domains: DomainRegistry
    _accounts: Accounts
    _used: int
    _lock: threading.Lock

    def owners(self, key: PageKey) -> list[str]:
        """The residency domains that own a page."""
        with self._lock:
            e = self._index.get(key)
            return self._domains.names(e.domains) if e else []

    def usage(self, account: str) -> Usage:
        """What ``account`` holds here now (resident and reserved)."""
        with self._lock:
            u = self._accounts.usage.get(account, Usage())
            return Usage(u.bytes, u.pages)

    def limit(self, account: str) -> Limit | None:
        return self._accounts.limits.get(account)

    def domains(self, account: str) -> set[str]:
        """The residency domains charged to ``account`` that own pages here."""
        with self._lock:
            return self._domains.of_account(account)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)
