"""A layerwise fetch: the pages of an engine load, read layer by layer from every tier.

DESIGN.md mechanism 2. A page keeps every layer's bytes contiguous, so layer ``l``
of all of a load's pages is one byte range per page: one request per tier carries
them all (:meth:`lmkv.tiers.base.Tier.get_ranges`: the server's ranged GET, one Redis
pipeline, parallel ``preadv`` on disk), and each unit is verified against its digest
as it lands. Requests go out in layer order, ``depth`` of them in flight per tier,
so layer 0 arrives first and the engine's forward waits for a layer only when it
gets there (:meth:`LayerFetch.wait`); the layers it computes meanwhile hide the
rest of the fetch.

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

from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.store import Fetched, Landing, TieredStore, tier_read
from lmkv.tiers.base import Tier

log = logging.getLogger(__name__)

class LayerFetch:
    """One engine load's pages, layer by layer. :meth:`start` it on an executor; :meth:`wait` for
    a layer; :meth:`finish` once the forward is done (then release the result)."""

    def __init__(self, store: TieredStore, keys: Sequence[PageKey], layout: GroupLayout,
                 depth: Callable[[str], int]) -> None:
        self.store, self.keys, self.layout = store, list(keys), layout
        self._depth = depth
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
        self.requests = 0  # layer requests sent
        self._began: dict[str, float] = {}  # per tier, when its first layer request went out
        self._failed: set[int] = set()  # pages a layer failed for: not asked for again
        self._dead: set[str] = set()  # tiers whose request failed: their later layers are not asked

    # -- driving ----------------------------------------------------------------

    def start(self, pool: Executor) -> None:
        """Queue the fetch: the lookup of who holds what, then each tier's layer requests."""
        try:
            pool.submit(self._setup, pool)
        except RuntimeError:  # the executor is shutting down: every page fails, nothing waits forever
            for ev in self._ready:
                ev.set()

    def _setup(self, pool: Executor) -> None:
        holders: list[tuple[Tier, list[int]]] = []
        try:
            lease = self.store.memory.borrow(self.keys)
            self._leases.append(lease)
            self.views, self.headers = list(lease.views), list(lease.headers)
            missing = [i for i, v in enumerate(self.views) if v is None]
            here = [i for i, v in enumerate(self.views) if v is not None]
            for ok in self._ok:
                for i in here:
                    ok[i] = True
            if missing and len(self.store.tiers) > 1:
                holders = self.store.holders(self.keys, missing)
                self._landing = landing = self.store.landing(self.keys, self.layout, holders)
                if landing is not None:  # where the layers land, for the engine's copies meanwhile
                    for i in landing.missing:
                        self.views[i] = landing.buf(i)
        except Exception:  # a failing tier must cost a recompute, never the engine
            log.exception("lmkv: layerwise fetch could not start; recomputing its pages")
            holders = []
        self.from_below = sum(len(held) for _, held in holders)
        with self._lock:
            self._left = [len(holders)] * self.layout.num_layers
        if not holders:
            for ev in self._ready:
                ev.set()
            return
        for tier, held in holders:
            depth = max(1, min(self._depth(tier.name), self.layout.num_layers))
            self._began[tier.name] = time.perf_counter()
            for layer in range(depth):
                self._submit(pool, tier, held, layer, depth)

    def _submit(self, pool: Executor, tier: Tier, held: list[int], layer: int, depth: int) -> None:
        try:
            pool.submit(self._read_layer, pool, tier, held, layer, depth)
        except RuntimeError:  # the executor is shutting down: these layers fail, nothing waits forever
            for rest in range(layer, self.layout.num_layers, depth):
                self._layer_done(rest)

    def _read_layer(self, pool: Executor, tier: Tier, held: list[int], layer: int, depth: int) -> None:
        try:
            landing = self._landing
            assert landing is not None
            start, end = self.layout.layer_range(layer)
            with self._lock:
                ask = [] if tier.name in self._dead else [i for i in held if i not in self._failed]
            got = None
            if ask:
                t0 = time.perf_counter()
                got = tier_read(tier, tier.get_ranges, [self.keys[i] for i in ask], self.layout, [(start, end)],
                                [landing.buf(i) for i in ask])
                done = time.perf_counter()
                if got is not None:
                    self.store.link.requested(tier.name, done - t0)
                if got is not None and layer == self.layout.num_layers - 1:  # the last: the delivered rate
                    self.store.link.fetched(tier.name, len(ask) * self.layout.payload_bytes,
                                            done - self._began[tier.name])
            with self._lock:
                self.requests += bool(ask)
                if got is None:
                    self._dead.add(tier.name)
                for i, h in zip(ask, got or [None] * len(ask)):
                    if h is None:
                        self._failed.add(i)
                        continue
                    self._ok[layer][i] = True
                    if landing.headers[landing.at[i]] is None:
                        landing.headers[landing.at[i]] = h
        except Exception:  # a failing tier must cost a recompute, never the engine
            log.exception("lmkv: layer %d of a layerwise fetch failed; recomputing its pages", layer)
        finally:
            self._layer_done(layer)
        if layer + depth < self.layout.num_layers:
            self._submit(pool, tier, held, layer + depth, depth)

    def _layer_done(self, layer: int) -> None:
        with self._lock:
            self._left[layer] -= 1
            if self._left[layer] <= 0:
                self._ready[layer].set()

    # -- the engine's side --------------------------------------------------------

    def wait(self, layer: int) -> list[bool]:
        """Block until ``layer`` (and every layer before it) has landed; per page, whether all of
        them are there intact."""
        for ev in self._ready[: layer + 1]:
            ev.wait()
        with self._lock:
            return [ok and all(self._ok[k][i] for k in range(layer)) for i, ok in enumerate(self._ok[layer])]

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
