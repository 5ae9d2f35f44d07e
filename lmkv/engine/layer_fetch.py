"""A layerwise fetch: the pages of an engine load, read layer by layer from every tier.

See docs/design/layerwise.md. A page keeps every layer's bytes contiguous, so layer ``l``
of all of a load's pages is one byte range per page: one request per tier carries
them all (:meth:`lmkv.tiers.base.Tier.get_ranges`: the server's ranged GET, one Redis
pipeline, a few runs of ``preadv`` on disk), and each unit is verified against its digest
as it lands. Requests go out in layer order, ``depth`` of them in flight per tier,
so layer 0 arrives first and the engine's forward waits for a layer only when it
gets there (:meth:`LayerFetch.wait`); the layers it computes meanwhile hide the
rest of the fetch.

A request may carry a *span* of consecutive layers (one contiguous range per page):
every page of every request costs a fixed amount of work on both ends, so one layer
per request can cost more than its overlap hides when pages are small or the step
has little to compute. :class:`SpanChooser` picks each tier's span from what the
forward actually waited, per byte, in recent loads at each span.

Memory hits are lent at once, every layer ready. Pages read from below land in
fresh memory slots (or temporary buffers when memory is full, as whole fetches do)
and are published at :meth:`LayerFetch.finish` if every layer of them arrived
intact: a half-fetched page is never visible to anyone. A page that fails at layer
``k`` (missing, corrupt, short, its tier gone between layers) is failed for every
layer from ``k`` on; the engine recomputes its block.

Each tier's delivered rate and layer-request time go to the store's
:class:`~lmkv.tiers.link.LinkRates`: the worker sets the pipeline depth from them, the
scheduler chooses between this path and an asynchronous load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.store import Fetched, Landing, TieredStore, tier_read
from lmkv.tiers.base import Tier

log = logging.getLogger(__name__)

#: weight of the newest sample in a span's cost; every how many loads a neighbouring span is tried again
EMA = 0.3
EXPLORE_EVERY = 8


@dataclass
class SpanChooser:
    """Layers per request for one tier and one group's layer count: the span whose loads cost least
    per byte lately (an EMA per span over powers of two up to all layers). A load's cost is the
    tier's time to deliver all of it plus the time the forward waited for its layers: small spans
    shorten the waits (layer 0 lands sooner) and add work per request at both ends. The waits alone
    miss that work where it shares the CPU with the forward, as on a CPU engine: the forward then
    slows instead of waiting (measured here, a 124-page hand-off of 4 MiB pages from Redis at 2
    layers a request waited 43 ms, all at layer 0, and took 0.99 s; at 16 layers, 0.48 s). Both
    parts grow with the bytes, so loads of different sizes compare per byte.
    Spans next to the best one are tried when not measured yet and every
    :data:`EXPLORE_EVERY` loads after, so the choice follows the tier and the steps as they
    change. Ties go to the longer span (fewer requests, less work on both ends)."""

    layers: int
    cost: dict[int, float] = field(default_factory=dict)  # span -> seconds per MiB fetched
    loads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def spans(self) -> list[int]:
        out, s = [], 1
        while s < self.layers:
            out.append(s)
            s *= 2
        return [*out, self.layers]

    def pick(self) -> int:
        with self._lock:
            spans = self.spans
            if not self.cost:
                return self.layers  # whole pages first: the tier's throughput with the fewest requests
            best = min(self.cost, key=lambda sp: (self.cost[sp], -sp))
            i = spans.index(best)
            near = [spans[j] for j in (i - 1, i + 1) if 0 <= j < len(spans)]
            untried = [sp for sp in near if sp not in self.cost]
            if untried:
                return untried[0]
            if near and self.loads % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                return near[(self.loads // EXPLORE_EVERY) % len(near)]
            return best

    def record(self, span: int, cost_s: float, nbytes: int) -> None:
        """A load of ``nbytes`` at ``span`` that cost ``cost_s`` (see the class)."""
        if nbytes <= 0:
            return
        sample = cost_s / (nbytes / (1 << 20))
        with self._lock:
            self.loads += 1
            old = self.cost.get(span)
            self.cost[span] = sample if old is None else (1 - EMA) * old + EMA * sample


class LayerFetch:
    """One engine load's pages, layer by layer. :meth:`start` it on an executor; :meth:`wait` for
    a layer; :meth:`finish` once the forward is done (then release the result). ``span(tier)``:
    layers per request to that tier; ``depth(tier, span)``: its requests in flight."""

    def __init__(self, store: TieredStore, keys: Sequence[PageKey], layout: GroupLayout,
                 depth: Callable[[str, int], int], span: Callable[[str], int]) -> None:
        self.store, self.keys, self.layout = store, list(keys), layout
        self._depth, self._span = depth, span
        n, layers = len(keys), layout.num_layers
        self.views: list = [None] * n
        self.headers: list = [None] * n
        self._ok = [[False] * n for _ in range(layers)]  # per layer, the pages whose layer landed intact
        self._ready = [threading.Event() for _ in range(layers)]
        self._left = [0] * layers  # per layer, the tiers still reading it
        self._lock = threading.Lock()
        self._leases: list = []
        self._landing: Landing | None = None
        self.from_below = 0  # pages read from a lower tier
        self.spans: dict[str, tuple[int, int]] = {}  # per tier: its span, and the bytes it was asked for
        self.took: dict[str, float] = {}  # per tier that delivered every layer: seconds from its first request
        self._began: dict[str, float] = {}  # per tier, when its first request went out
        self._failed: set[int] = set()  # pages a request failed for: not asked for again
        self._dead: set[str] = set()  # tiers whose request failed: their later layers are not asked

    # -- driving ----------------------------------------------------------------

    def start(self, pool: Executor) -> None:
        """Queue the fetch: the lookup of who holds what, then each tier's requests."""
        try:
            pool.submit(self._setup, pool)
        except RuntimeError:  # the executor is shutting down: every page fails, nothing waits forever
            for ev in self._ready:
                ev.set()

    def _setup(self, pool: Executor) -> None:
        plans: list[tuple[Tier, list[int], list[tuple[int, int]], int]] = []  # (tier, pages, groups, depth)
        layers = self.layout.num_layers
        try:  # (everything that can fail before a request goes out: then nothing is in flight)
            lease = self.store.memory.borrow(self.keys, layout=self.layout)
            self._leases.append(lease)
            self.views, self.headers = list(lease.views), list(lease.headers)
            missing = [i for i, v in enumerate(self.views) if v is None]
            here = [i for i, v in enumerate(self.views) if v is not None]
            for ok in self._ok:
                for i in here:
                    ok[i] = True
            holders: list[tuple[Tier, list[int]]] = []
            if missing and len(self.store.tiers) > 1:
                holders = self.store.holders(self.keys, missing)
                self._landing = landing = self.store.landing(self.keys, self.layout, holders)
                if landing is not None:  # where the layers land, for the engine's copies meanwhile
                    for i in landing.missing:
                        self.views[i] = landing.buf(i)
            for tier, held in holders:
                span = max(1, min(self._span(tier.name), layers))
                groups = [(a, min(layers, a + span)) for a in range(0, layers, span)]
                plans.append((tier, held, groups, max(1, min(self._depth(tier.name, span), len(groups)))))
                self.spans[tier.name] = (span, len(held) * self.layout.payload_bytes)
        except Exception:  # a failing tier (or a bug) must cost a recompute, never a forward that waits forever
            log.exception("lmkv: layerwise fetch could not start; recomputing its pages")
            plans = []
        self.from_below = sum(len(held) for _, held, _, _ in plans)
        with self._lock:
            self._left = [len(plans)] * layers
        if not plans:
            for ev in self._ready:
                ev.set()
            return
        for tier, held, groups, depth in plans:
            self._began[tier.name] = time.perf_counter()
            for k in range(depth):
                self._submit(pool, tier, held, groups, k, depth)

    def _submit(self, pool: Executor, tier: Tier, held: list[int], groups: list[tuple[int, int]], k: int,
                depth: int) -> None:
        try:
            pool.submit(self._read_group, pool, tier, held, groups, k, depth)
        except RuntimeError:  # the executor is shutting down: these layers fail, nothing waits forever
            for rest in groups[k::depth]:
                self._done(rest)

    def _read_group(self, pool: Executor, tier: Tier, held: list[int], groups: list[tuple[int, int]], k: int,
                    depth: int) -> None:
        first, end = groups[k]
        try:
            landing = self._landing
            assert landing is not None
            lo, hi = self.layout.layer_range(first)[0], self.layout.layer_range(end - 1)[1]
            with self._lock:
                ask = [] if tier.name in self._dead else [i for i in held if i not in self._failed]
            got = None
            if ask:
                t0 = time.perf_counter()
                got = tier_read(tier, tier.get_ranges, [self.keys[i] for i in ask], self.layout, [(lo, hi)],
                                [landing.buf(i) for i in ask])
                done = time.perf_counter()
                if got is not None:
                    self.store.link.requested(tier.name, done - t0)
                if got is not None and end == self.layout.num_layers:  # the last: the delivered rate
                    self.took[tier.name] = done - self._began[tier.name]
                    self.store.link.fetched(tier.name, len(ask) * self.layout.payload_bytes, self.took[tier.name])
            with self._lock:
                if got is None:
                    self._dead.add(tier.name)
                for i, h in zip(ask, got or [None] * len(ask)):
                    if h is None:
                        self._failed.add(i)
                        continue
                    for layer in range(first, end):
                        self._ok[layer][i] = True
                    if landing.headers[landing.at[i]] is None:
                        landing.headers[landing.at[i]] = h
        except Exception:  # a failing tier must cost a recompute, never the engine
            log.exception("lmkv: layers %d-%d of a layerwise fetch failed; recomputing its pages", first, end - 1)
        finally:
            self._done((first, end))
        if k + depth < len(groups):
            self._submit(pool, tier, held, groups, k + depth, depth)

    def _done(self, group: tuple[int, int]) -> None:
        with self._lock:
            for layer in range(*group):
                self._left[layer] -= 1
                if self._left[layer] <= 0:
                    self._ready[layer].set()

    # -- the engine's side --------------------------------------------------------

    def landed(self, layer: int) -> bool:
        """Whether :meth:`wait` for ``layer`` would return at once (the worker queues such layers'
        copies ahead of the forward)."""
        return all(ev.is_set() for ev in self._ready[: layer + 1])

    def wait(self, layer: int) -> list[bool]:
        """Block until ``layer`` (and every layer before it) has landed; per page, whether all of
        them are there intact (a page that failed anywhere is no longer copied in: it is recomputed)."""
        for ev in self._ready[: layer + 1]:
            ev.wait()
        with self._lock:
            failed = self._failed
            return [ok and i not in failed for i, ok in enumerate(self._ok[layer])]

    def finish(self) -> Fetched:
        """Every layer waited for; pages intact in all of them published (promoted into memory where
        there was room) and lent with the memory hits; the others are ``None`` (recompute them)."""
        for ev in self._ready:
            ev.wait()
        landing = self._landing
        if landing is not None:
            whole = [all(ok[i] for ok in self._ok) for i in range(len(self.keys))]
            for i in landing.missing:
                if not whole[i]:
                    landing.headers[landing.at[i]] = None
            landing.settle(self.views, self.headers, self._leases)
        return Fetched(self.views, self.headers, self._leases)
