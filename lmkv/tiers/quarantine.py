"""Memory lent to a writer that may finish late: held back from reuse until its fate is known.

lmkv lends memory it owns to writers that complete asynchronously. A caller may give up on
such a writer (a request that timed out, a step that failed) while the writer is still able to
write; if the memory then went back to its owner, the late bytes would land in whatever reused
it — another prompt's page, served later with a valid-looking header. The rule, for every
writer: **memory lent to a writer goes back only once that writer is known to be finished or
unable to write** — its reply arrived, its stream or event completed, its thread returned, or
the process that writes is gone and can no longer touch the mapping.

Where a caller cannot wait for that (a request's deadline passed), the memory goes into a
:class:`Quarantine` instead of back to its owner: it stays allocated, is counted, and is
reclaimed when the writer's fate settles. A stalled peer that never returns costs memory, never
correctness; the quarantine's limit says when lenders must stop lending to such writers (the
server tier then reads through its connection's own window, which nobody else reuses).

Each asynchronous writer and the rule it follows:

- **A same-host lmkv server** copies GET replies straight into the memory tier's arena slots,
  and reads PUT payloads from them. Slots named by a request that has not been answered when the
  client gives up are quarantined until the connection proves the server is done with them: the
  replies to every request sent on it arrive, the server closes it (a server closes a connection
  only once its copies into that client's memory have stopped), or the server's process exits
  (a pidfd). Pipelined 8 MiB chunks of one read are requests of their own: chunks already answered
  were copied whole, the rest are quarantined.
- **The connection's staging window** belongs to that connection alone and is dropped with it, so
  late bytes there reach nothing anyone reads.
- **The disk tier's parallel reads and writes** (POSIX, O_DIRECT, cuFile into device staging
  slots) return only once every page's I/O has returned, even when one of them failed: a fetch
  never hands back a slot a read is still filling (:func:`settled_map`).
- **Background loads and layerwise fetches** run on lmkv's threads; a request's load is reported
  finished only when its thread returned, and vLLM keeps the blocks of a request aborted mid-load
  until then; a layerwise fetch publishes or releases its landing slots only after every one of
  its tier requests returned.
- **Copy streams** (GPU): host pages a queued copy reads or writes are released only after the
  stream that queued it is synchronized, at the step's end or when a step that never ended is
  cleaned up.
- **Network tiers that copy on the caller's thread** (Redis, the server over TCP) have no late
  writer: a read's bytes are received into the caller's buffer by the caller. Redis *writes* run
  on the tier's event loop and are cancelled at their deadline; only a loop stuck past it could
  read a page's slot after its lease ended, and the page it stored would then fail its checksums
  on every read (a miss), since pages read over the network are always verified (``remote.verify``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future
from typing import TypeVar

import numpy as np

from lmkv.tiers.base import TierStats
from lmkv.wire.shm_window import offsets_in

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Quarantine:
    """Slots of one arena (by offset) that a writer which was given up on may still touch.

    The owner (the memory tier) calls :meth:`defer` under its own lock whenever it would free a
    slot: a held slot is kept out of the free lists instead and freed by ``free`` (called with the
    owner's ``lock`` held) once every fate holding it has settled. Lenders call :meth:`hold` when
    they give up on a writer, with a future that completes when the writer can no longer write.
    """

    def __init__(self, lock: threading.Lock, free: Callable[[int, int, str], None], limit: int,
                 stats: TierStats) -> None:
        """``free(offset, nbytes, account)``: what the owner does to free a slot; ``limit``: bytes
        held beyond which :attr:`full` tells lenders to stop lending slots to late writers;
        ``stats``: the owner's counters (``quarantined``: slots held, ``reclaimed``: let go)."""
        self._lock = lock
        self._free = free
        self.limit = limit
        self._stats = stats
        self._holds: dict[int, tuple[int, int]] = {}  # offset -> (unsettled fates, bytes)
        self._deferred: dict[int, tuple[int, str]] = {}  # offset -> (bytes, account): freed when let go
        self.held_bytes = 0
        self._warned = False

    @property
    def held(self) -> int:
        """Slots held now."""
        return len(self._holds)

    @property
    def full(self) -> bool:
        """Whether lenders should stop lending slots to writers that may finish late."""
        return self.held_bytes >= self.limit

    def hold(self, ranges: Iterable[tuple[int, int]], fate: Future) -> None:
        """Keep the slots at these ``(offset, bytes)`` out of reuse until ``fate`` completes (with
        any result: completion means the writer can no longer write there). Not under the owner's
        lock: a fate already complete lets go at once, here."""
        ranges = list(ranges)
        if not ranges:
            return
        with self._lock:
            for off, nbytes in ranges:
                fates, size = self._holds.get(off, (0, nbytes))
                if not fates:
                    self.held_bytes += size
                    self._stats.quarantined += 1
                self._holds[off] = (fates + 1, size)
            if self.full and not self._warned:
                self._warned = True
                log.warning("lmkv: %d MiB of memory slots are held for writers that gave up and may still "
                            "write (a stalled server); no more slots are lent to such writers until they "
                            "return", self.held_bytes >> 20)
        fate.add_done_callback(lambda _: self._settled(ranges))

    def defer(self, offset: int, nbytes: int, account: str) -> bool:
        """Under the owner's lock, as it frees a slot: True if the slot is held (the free is
        deferred until its writers settle), False if the owner may free it now."""
        if offset not in self._holds:
            return False
        self._deferred[offset] = (nbytes, account)
        return True

    def _settled(self, ranges: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            for off, _ in ranges:
                fates, size = self._holds[off]
                if fates > 1:
                    self._holds[off] = (fates - 1, size)
                    continue
                del self._holds[off]
                self.held_bytes -= size
                self._stats.reclaimed += 1
                freed = self._deferred.pop(off, None)
                if freed is not None:
                    self._free(off, *freed)
            if not self.full:
                self._warned = False


def lendable(arena: np.ndarray | None, quarantine: Quarantine | None, bufs: Sequence) -> list[int] | None:
    """Offsets of every buffer in ``arena`` if all lie inside it and its slots may be lent to a writer
    that could finish late (``quarantine`` is there and not full); None: the buffers go through a
    buffer of the lender's own (a writer that stalls again then strands no more slots)."""
    if arena is None or quarantine is None or quarantine.full:
        return None
    offsets = offsets_in(arena, bufs)
    return None if any(o is None for o in offsets) else offsets  # type: ignore[return-value]


def settled_map(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on ``pool``, returning (or raising the first error) only once every
    call has returned. ``Executor.map`` raises as soon as one call fails while the others still run:
    a caller that then hands their buffers back gives them to late writers."""
    fs = [pool.submit(fn, x) for x in items]
    futures.wait(fs)
    return [f.result() for f in fs]
