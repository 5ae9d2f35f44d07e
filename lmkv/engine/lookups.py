"""Lookups that never stall the engine's scheduler.

The engine's scheduler looks each waiting request up on its own thread, every step it waits. A
lookup that asks a network tier (the lmkv server, Redis) waits for a round trip, and a tier that
stalls would stall every request on the engine with it. So over a store with a network tier a
lookup runs on a thread of its own: the scheduler waits for it a moment (:data:`INLINE_WAIT_S`,
in which a healthy tier on the same host or rack answers) and otherwise answers "not yet": the
request waits, the step runs without it, and the next step asks for the result again. A lookup
that has not answered by its deadline (``remote.lookup_timeout``) is a miss: the request runs
and computes its prefix. Its thread is left to finish (a tier's own timeout bounds it).

A lookup still unanswered after :data:`STALL_S` (:data:`STALL_FIRST_S` before any has answered),
or after several times what lookups have lately taken on a slower network (lookups answered while
a request still waited for them: one given up on was a stall, not the network's pace), means the
network is stalled: until the lookups in flight have answered, a request asks only the tiers in
this process (its ``fallback``) and runs at once, so a stalled tier delays each request by a
moment, not by ``remote.lookup_timeout`` each in turn. A request that waits for pages it was
promised (a P/D consumer's) keeps asking, within its own deadline.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

from lmkv import threads

T = TypeVar("T")

#: how long the scheduler's thread waits for a lookup before answering "not yet"
INLINE_WAIT_S = 0.002
#: how long a lookup may go unanswered before the network is presumed stalled
STALL_S = 0.05
#: the same while no lookup has answered yet: an engine's first lookups pay one-time costs, and
#: there is no measure yet of what the network takes (a fresh vLLM CPU engine's first lookup of a
#: healthy same-host server went unanswered for 55 ms, and was then a miss for pages the server
#: held); a tier stalled from the start costs the first request this long, once
STALL_FIRST_S = 0.25
#: a lookup is presumed stalled past this many times the median of recent lookups' durations
STALL_FACTOR = 8
#: how many recent durations that median is over
RECENT = 32
#: lookups in flight at once (a stalled tier holds one thread each until its own timeout)
THREADS = 8


class Verdict:
    """What a lookup has to say besides its result."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: the lookup is still running: answer "not yet"
NOT_YET = Verdict("NOT_YET")
#: the lookup missed its deadline: a miss
TIMED_OUT = Verdict("TIMED_OUT")


@dataclass
class _Pending(Generic[T]):
    future: Future
    what: Hashable  # what the lookup was for (a request whose prefix changed starts again)
    deadline: float


class AsyncLookups:
    """Per request, at most one lookup in flight. Called on the scheduler's thread only."""

    def __init__(self, timeout: float) -> None:
        """``timeout``: seconds a request waits for its lookup before it counts as a miss."""
        self.timeout = timeout
        self._pool = threads.pool(THREADS, "lmkv-lookup")
        self._pending: dict[str, _Pending] = {}
        self._in_flight: dict[Future, float] = {}  # every lookup still running (abandoned ones too): since when
        self._abandoned: set[Future] = set()  # lookups still running that no request waits for
        self._took: deque[float] = deque(maxlen=RECENT)  # recent answered lookups' durations
        self._lock = threading.Lock()

    def result(self, req_id: str, what: Hashable, find: Callable[[], T],
               fallback: Callable[[], T] | None = None) -> T | Verdict:
        """``find()``'s result for this request, running it off this thread: the result, or
        :data:`NOT_YET` while it runs within the deadline, or :data:`TIMED_OUT` past it; or, with
        a ``fallback`` (a lookup without the network), its result at once while the network is
        presumed stalled."""
        if fallback is not None and self.stalled():
            self.forget(req_id)
            return fallback()
        p = self._pending.get(req_id)
        if p is None or p.what != what:
            self.forget(req_id)
            p = self._pending[req_id] = _Pending(self._submit(find), what, time.monotonic() + self.timeout)
        try:
            out = p.future.result(timeout=INLINE_WAIT_S)
        except FutureTimeout:
            if time.monotonic() < p.deadline:
                return NOT_YET
            self.forget(req_id)
            return TIMED_OUT
        del self._pending[req_id]
        return out

    def stalled(self) -> bool:
        """Whether a lookup has gone unanswered for :data:`STALL_S`, or for :data:`STALL_FACTOR`
        times the median of recent lookups if that is longer (a healthy slow network is not
        stalled); before any lookup has answered, for :data:`STALL_FIRST_S`."""
        with self._lock:
            bar = max(STALL_S, STALL_FACTOR * statistics.median(self._took)) if self._took else STALL_FIRST_S
            since = time.monotonic() - bar
            return any(t < since for t in self._in_flight.values())

    def _submit(self, find: Callable[[], T]) -> Future:
        fut = self._pool.submit(find)
        with self._lock:
            self._in_flight[fut] = time.monotonic()
        fut.add_done_callback(self._answered)
        return fut

    def _answered(self, fut: Future) -> None:
        with self._lock:
            started = self._in_flight.pop(fut, None)
            if started is not None and fut not in self._abandoned:
                self._took.append(time.monotonic() - started)
            self._abandoned.discard(fut)

    def waiting(self) -> set[str]:
        """Requests whose lookup is still out."""
        return set(self._pending)

    def wait_any(self, timeout: float) -> bool:
        """Block until a request's lookup answers (at once if one has, unread), at most ``timeout``;
        whether one has."""
        futures = [p.future for p in self._pending.values()]
        if futures:
            return bool(wait(futures, timeout, FIRST_COMPLETED).done)
        time.sleep(timeout)
        return False

    def forget(self, req_id: str) -> None:
        """No request waits for this one's lookup any more (its time, when it answers, is no
        measure of the network's)."""
        p = self._pending.pop(req_id, None)
        if p is not None:
            with self._lock:
                if p.future in self._in_flight:
                    self._abandoned.add(p.future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
