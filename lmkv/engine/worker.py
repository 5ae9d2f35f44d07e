"""Worker-side data path, engine-agnostic: execute a step's plan layer by layer.

For each step the engine adapter calls, in order:

- :meth:`LayerwiseTransfer.begin` with the step's plan: a write session reserves
  host pages for every page to store (nothing visible until commit); pages of
  blocks the step's requests were just given (rescued by lazy offload) are copied
  at once, before the forward writes those blocks;
- :meth:`LayerwiseTransfer.start_loads`: fetches of the pages to load start
  (memory hits are lent zero-copy; pages below memory are read layer by layer,
  :mod:`lmkv.engine.layer_fetch`, a few layers ahead of the forward);
- :meth:`LayerwiseTransfer.before_layer` before attention layer ``l`` runs: wait
  for layer ``l`` alone, scatter its range of each page into its block;
- :meth:`LayerwiseTransfer.after_layer` after layer ``l`` computed: gather layer
  ``l`` of every block to store into its page's range;
- :meth:`LayerwiseTransfer.end` after the forward: layers whose hooks did not
  run are handled, the session commits atomically, fetched pages are released.

A page that cannot be fetched (missing, corrupt, short, tier down) marks its
blocks as load errors; the engine recomputes exactly those tokens.

The copies themselves are :mod:`lmkv.engine.copier`'s (the kernel or torch per layer, on the
copy streams on a GPU). Asynchronous loads (the request waits instead of running) are
:mod:`lmkv.engine.background_load`'s; GPUDirect Storage's device path is
:mod:`lmkv.engine.device_stores`'. The chain hashes of pages that failed are reported
(:mod:`lmkv.engine.transfer_stats`), so the scheduler stops offering them for a while.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lmkv import threads
from lmkv.engine.background_load import BackgroundLoads
from lmkv.engine.blockcopy import BlockRun, as_bytes_array, block_runs
from lmkv.engine.copier import Copier, Copies
from lmkv.engine.device_stores import device_staging, store_from_device
from lmkv.engine.layer_fetch import LayerFetch, SpanChooser
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.transfer_stats import FailedChains, WorkerStats
from lmkv.errors import TierFullError
from lmkv.kernels import KernelLayerBlocks
from lmkv.kernels.streams import Events
from lmkv.keys import ChainHash, PageKey, page_key
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, header_of_digests, make_header
from lmkv.store import Fetched, StoreSession, TieredStore
from lmkv.tiers.device_staging import DeviceStaging

log = logging.getLogger(__name__)

#: layer requests in flight per tier in a layerwise fetch, at most (each holds a connection)
MAX_DEPTH = 8
#: threads sending layerwise fetches' requests (up to MAX_DEPTH for each of a few tiers)
LAYER_THREADS = 16


def pipeline_depth(request_s: float | None, compute_s: float | None) -> int:
    """Layer requests a layerwise fetch keeps in flight on one tier: enough that a layer lands for
    each layer the forward computes (a request's time over a layer's compute, plus the one landing),
    at least 2, at most :data:`MAX_DEPTH`; 2 until both are measured."""
    if request_s is None or not compute_s:
        return 2
    return max(2, min(MAX_DEPTH, math.ceil(request_s / compute_s) + 1))


@dataclass
class _GroupLoad:
    block_ids: list[int]
    future: Future | LayerFetch  # a whole fetch (GDS into device slots) or a layerwise one
    chains: list[ChainHash]
    requests: list[tuple[int, int]]  # (first index, pages) of each request's run in the lists above
    fetched: Fetched | None = None
    landed: list[bool] | None = None  # the pages of the last layer scattered (``copies`` pairs them)
    waited_s: float = 0.0  # how long the forward waited for this load's layers
    ok: list[bool] = field(default_factory=list)
    copies: Copies = field(default_factory=Copies)  # the pages that loaded and their blocks
    done_layers: set[int] = field(default_factory=set)  # the layers the forward waited for
    queued: dict[int, Events] = field(default_factory=dict)  # copy streams: layers queued, an event after each


@dataclass
class _GroupStore:
    runs: list[BlockRun]
    keys: list[PageKey]  # of the pages stored layer by layer (not the rescued ones), with their blocks
    blocks: list[int]
    index: list[int]  # each page's place in the step's write session
    done_layers: set[int] = field(default_factory=set)
    #: copy streams with the kernel: per layer, the unit digests the device computed as it gathered
    #: (None for a layer it could not); None: the pages are hashed on the host at commit
    digests: dict[int, Any] | None = None


class LayerwiseTransfer:
    """A worker's side of lmkv: a step's loads and stores, layer by layer, around the forward.

    The engine's model-runner thread calls the step hooks in order (:meth:`begin`,
    :meth:`start_loads`, :meth:`before_layer` / :meth:`after_layer` per layer, :meth:`end`); the
    fetches run on the layer pool and the store's I/O threads. A step that never reached
    :meth:`end` is cleaned up by the next :meth:`begin`; :meth:`close` ends the threads.
    """

    def __init__(
        self,
        store: TieredStore,
        groups: Sequence[GroupLayout],
        tensors: Sequence[Sequence[torch.Tensor]],
        layer_names: Mapping[str, tuple[int, int]],
    ) -> None:
        """``tensors[g][l]`` is layer ``l`` of group ``g``; ``layer_names`` maps the engine's names to (g, l)."""
        self.store = store
        self.copier = Copier(groups, tensors, store.memory.device_visible, store.cfg.copy_stream)
        self.groups, self.layers = self.copier.groups, self.copier.layers
        self.layer_names = dict(layer_names)
        #: GPUDirect Storage: device staging slots on the GDS disk tier's GPU, and the groups that use them
        self._staging, self._on_device = device_staging(store, self.copier)
        self.stats = WorkerStats()
        self.failed = FailedChains()
        self.background = BackgroundLoads(store, self.copier, self.keys, self._device, self.stats, self.failed)
        self._loads: dict[int, _GroupLoad] = {}
        self._stores: dict[int, _GroupStore] = {}
        self._session: StoreSession | None = None
        #: this step's copies out of engine blocks: bytes and seconds spent on them (lazy offload's drain
        #: cap is a share of the link's time: the scheduler is told the rate)
        self._copied_bytes = 0
        self._copy_s = 0.0
        self._errors: set[int] = set()
        self._layer_pool = threads.pool(LAYER_THREADS, "lmkv-layers")
        #: the forward's time per layer (between one layer's wait and the next), a moving average
        self.layer_compute_s: float | None = None
        self._layer_end: float | None = None
        self._spans: dict[tuple[str, int], SpanChooser] = {}  # (tier, layers) -> its layers per request
        self._in_order = {t.name for t in store.tiers if t.serves_in_order}
        self._plan = StepPlan()
        self._load_keys: list[list[PageKey]] = []  # the keys of the step's loads, in the plan's order
        self._held: list = []
        self._pulling: list[tuple[set[PageKey], Future]] = []  # pulls in flight: their keys
        self.layers_touched = False

    def _device(self, g: int) -> DeviceStaging | None:
        return self._staging if g in self._on_device else None

    def keys(self, op: PageOp) -> list[PageKey]:
        """This rank's page keys (a sharded group's keys carry the rank's shard)."""
        layout = self.groups[op.group]
        return [page_key(c, layout) for c in op.chains]

    # -- step ----------------------------------------------------------------

    def begin(self, plan: StepPlan) -> None:
        self._abort_leftovers()
        self._plan = plan
        self._layer_end = None
        if plan.drops:  # superseded states: gone from every tier, in the background
            self.store.submit(self.store.delete, [k for op in plan.drops for k in self.keys(op)])
        self._pulling = [(keys, fut) for keys, fut in self._pulling if not fut.done()]
        for op in plan.pulls:
            self._pulling.append((set(self.keys(op)), self.store.submit(self._pull, op)))
        self.layers_touched = False  # whether this step ran a forward (its layer hooks)
        if self._streams is not None and (plan.loads or plan.stores or plan.rescues):
            # an earlier step's forward may still read the blocks this step's loads overwrite
            self._streams.step.follow(self._streams.compute())
        # Hold this step's memory-resident pages before reserving room for its stores, which may evict.
        self._load_keys = [self.keys(op) for op in plan.loads]
        self._held = [self.store.memory.borrow(keys, count=False) for keys in self._load_keys]
        by_group: dict[int, tuple[list[PageKey], list[int], list[bool]]] = {}
        for op, now in [(op, False) for op in plan.stores] + [(op, True) for op in plan.rescues]:
            if not self.groups[op.group].is_writer:
                continue  # a replicated group: the first rank of the replica set writes for all of them
            keys, blocks, at_once = by_group.setdefault(op.group, ([], [], []))
            keys.extend(self.keys(op))
            blocks.extend(op.block_ids)
            at_once.extend([now] * len(op.block_ids))
        if not by_group:
            return
        order = sorted(by_group)
        all_keys = [k for g in order for k in by_group[g][0]]
        layouts = [self.groups[g] for g in order for _ in by_group[g][0]]
        try:
            self._session = self.store.open_session(all_keys, layouts, streamed=True)
        except TierFullError:
            self.stats.add(dropped_pages=len(all_keys))
            log.warning("lmkv: no room in memory for %d pages; not storing them this step", len(all_keys))
            return
        i = 0
        for g in order:
            keys, blocks, at_once = by_group[g]
            pages = [as_bytes_array(self._session.buffer(i + j)) for j in range(len(keys))]
            i += len(keys)
            # Rescued blocks belong to this step's requests now: every layer is copied before the
            # forward (and any load) writes them. The others are copied layer by layer as it runs.
            rescued = [(b, p, i - len(keys) + j) for j, (b, p, now) in enumerate(zip(blocks, pages, at_once)) if now]
            if rescued:
                runs = block_runs([b for b, _, _ in rescued], [p for _, p, _ in rescued])
                with self._on_stream():
                    self.copier.gather_all(g, runs)
                if self._streams is not None:  # the forward writes these blocks only once they are copied
                    self._streams.compute().follow(self._streams.step)
                if self._session.streaming:
                    self._session.filled([at for _, _, at in rescued], 0, self.groups[g].payload_bytes, self._ready())
                self.stats.add(self.groups[g].name, rescued_pages=len(rescued))
            later = [(b, p, k, i - len(keys) + j)
                     for j, (b, p, k, now) in enumerate(zip(blocks, pages, keys, at_once)) if not now]
            on_device = self._streams is not None and self.copier.kernel_only(g)
            self._stores[g] = _GroupStore(block_runs([b for b, _, _, _ in later], [p for _, p, _, _ in later]),
                                          [k for _, _, k, _ in later], [b for b, _, _, _ in later],
                                          [at for _, _, _, at in later], digests={} if on_device else None)

    def start_loads(self) -> None:
        if self._pulling and self._load_keys:  # (pages still coming into memory are not read twice)
            want = {k for keys in self._load_keys for k in keys}
            wait_all([f for keys, f in self._pulling if keys & want], timeout=self.store.cfg.remote.timeout)
        by_group: dict[int, tuple[list[PageKey], list[int], list[ChainHash], list[tuple[int, int]]]] = {}
        for op, op_keys in zip(self._plan.loads, self._load_keys):
            keys, blocks, chains, runs = by_group.setdefault(op.group, ([], [], [], []))
            runs.append((len(keys), len(op.chains)))
            keys.extend(op_keys)
            blocks.extend(op.block_ids)
            chains.extend(op.chains)
        for g, (keys, blocks, chains, runs) in by_group.items():
            if g in self._loads:
                continue
            if self._device(g) is not None:  # GDS: whole pages into device staging slots
                future: Future | LayerFetch = self.store.submit(self.store.fetch, keys, self.groups[g], self._device(g))
            else:
                future = LayerFetch(self.store, keys, self.groups[g], self._depth,
                                    functools.partial(self._span, self.groups[g].num_layers))
                future.start(self._layer_pool)
            self._loads[g] = _GroupLoad(blocks, future, chains, runs)
        self.background.start(self._plan.async_loads)

    def _pull(self, op: PageOp) -> None:
        """Copy landed pages a waiting consumer was promised into memory (a fetch publishes what it
        reads there); on the store's I/O threads. A page that fails is left where it is: the load
        reads it again, and recomputes it if it fails there too."""
        with self.store.fetch(self.keys(op), self.groups[op.group]) as got:
            self.stats.add(self.groups[op.group].name, pulled_pages=sum(v is not None for v in got.views))

    def transfer_results(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load finished, and the subset that failed (to recompute);
        see :meth:`BackgroundLoads.results`."""
        return self.background.results(idle)

    def take_failed_chains(self) -> list[ChainHash]:
        return self.failed.take()

    def _depth(self, tier: str, span: int) -> int:
        """Requests in flight: a request carries ``span`` layers, the forward computes as many; one at a
        time to a tier that serves requests in order (:attr:`~lmkv.tiers.base.Tier.serves_in_order`)."""
        if tier in self._in_order:
            return 1
        compute = self.layer_compute_s * span if self.layer_compute_s is not None else None
        return pipeline_depth(self.store.link.get(tier).request_s, compute)

    def _span(self, layers: int, tier: str) -> int:
        fixed = self.store.cfg.layerwise_span
        return fixed if fixed else self._chooser(tier, layers).pick()

    def _chooser(self, tier: str, layers: int) -> SpanChooser:
        key = (tier, layers)
        chooser = self._spans.get(key)
        if chooser is None:
            chooser = self._spans[key] = SpanChooser(layers)
        return chooser

    def _fetched(self, g: int, load: _GroupLoad) -> Fetched:
        """A load's fetched pages, waited for and accounted once: the blocks of pages that failed are
        load errors (the engine recomputes them), their chains are quarantined."""
        if load.fetched is not None:
            return load.fetched
        try:
            if isinstance(load.future, LayerFetch):
                fetched = load.future.finish()
                for tier, took in load.future.took.items():  # (tiers that failed a request: no sample)
                    span, nbytes = load.future.spans[tier]
                    self._chooser(tier, self.groups[g].num_layers).record(span, took + load.waited_s, nbytes)
            else:
                fetched = load.future.result()
        except Exception:  # a failing tier must cost a recompute, never the engine
            log.exception("lmkv: fetch failed; recomputing")
            fetched = Fetched([None] * len(load.block_ids), [None] * len(load.block_ids), [])
        load.fetched = fetched
        views = fetched.views
        load.ok = [v is not None for v in views]
        if not isinstance(load.future, LayerFetch):  # (a layerwise load paired its pages layer by layer)
            load.copies = self.copier.copies(g, load.block_ids, views)
        loaded = sum(load.ok)
        failed = [b for b, ok in zip(load.block_ids, load.ok) if not ok]
        self._errors.update(failed)
        # the engine recomputes each request from its first failed page on
        recomputed = 0
        for first, n in load.requests:
            bad = next((i for i in range(n) if not load.ok[first + i]), n)
            recomputed += (n - bad) * self.groups[g].tokens_per_page
        self.failed.add(c for c, ok in zip(load.chains, load.ok) if not ok)
        self.stats.add(
            self.groups[g].name,
            failed_pages=len(failed),
            recomputed_tokens=recomputed,
            loaded_pages=loaded,
            loaded_bytes=loaded * self.groups[g].payload_bytes,
            layerwise_pages=load.future.from_below if isinstance(load.future, LayerFetch) else 0,
        )
        return fetched

    def _scatter(self, g: int, layer: int) -> None:
        """Layer ``layer`` of group ``g``'s load in its blocks before the forward reads them. With copy
        streams, the layers after it that have landed already are queued too (memory hits: all of
        them at the first layer), and the forward waits for this layer's copy alone."""
        load = self._loads.get(g)
        if load is None or layer in load.done_layers:
            return
        self._queue_layer(g, load, layer)
        if self._streams is not None:
            for ahead in range(layer + 1, self.groups[g].num_layers):
                if ahead in load.queued:
                    continue
                if not self._layer_landed(load, ahead):
                    break
                self._queue_layer(g, load, ahead)
            self._streams.compute().wait(load.queued[layer])
        load.done_layers.add(layer)

    def _layer_landed(self, load: _GroupLoad, layer: int) -> bool:
        """Whether ``layer``'s bytes are in host (or staging) memory: its copy can go without waiting."""
        if load.fetched is not None:
            return True
        if isinstance(load.future, LayerFetch):
            return load.future.landed(layer)
        return load.future.done()

    def _queue_layer(self, g: int, load: _GroupLoad, layer: int) -> None:
        """Wait for ``layer``'s bytes to land, then copy them into the blocks (queue the copy, on a GPU)."""
        if layer in load.queued:
            return
        with self._on_stream():
            if isinstance(load.future, LayerFetch) and load.fetched is None:
                t0 = time.perf_counter()
                landed = load.future.wait(layer)
                waited = time.perf_counter() - t0
                load.waited_s += waited
                self.stats.add(layer_wait_us=int(waited * 1e6))
                if landed != load.landed:  # (the same pages layer after layer, usually: paired once)
                    load.landed = landed
                    load.copies = self.copier.copies(g, [b for b, ok in zip(load.block_ids, landed) if ok],
                                               [v for v, ok in zip(load.future.views, landed) if ok])
            else:
                self._fetched(g, load)
            self.copier.scatter_layer(g, layer, load.copies)
        if self._streams is not None:
            load.queued[layer] = self._streams.step.record()

    def _gather(self, g: int, layer: int) -> None:
        st = self._stores.get(g)
        if st is None or layer in st.done_layers:
            return
        layout = self.groups[g]
        start = layout.layer_range(layer)[0]
        lb = self.layers[g][layer]
        if self._streams is not None:  # copied once computed, while the later layers compute
            self._streams.step.follow(self._streams.compute())
            with self._streams.step.timed():
                if st.digests is not None and isinstance(lb, KernelLayerBlocks):  # checksummed on the device
                    # (a layer's units, relative to its start: layer 0's)
                    st.digests[layer] = lb.gather_digested(st.runs, start, layout.unit_ranges[: len(layout.segments)])
                else:
                    lb.gather(st.runs, start)
        else:
            t0 = time.perf_counter()
            lb.gather(st.runs, start)
            self._copy_s += time.perf_counter() - t0
        self._copied_bytes += len(st.keys) * self.groups[g].layer_stride
        st.done_layers.add(layer)
        if self._session is not None and self._session.streaming:
            self._session.filled(st.index, *layout.layer_range(layer), self._ready())

    def _ready(self) -> Callable[[], object] | None:
        """What a reader of the copies queued so far waits on: the step's copy stream's events (None
        without copy streams: the copies are done)."""
        if self._streams is None:
            return None
        events = self._streams.step.record()
        return lambda: [ev.synchronize() for ev in events.values()]

    def before_layer(self, name: str) -> None:
        self.layers_touched = True
        now = time.perf_counter()
        if self._layer_end is not None:  # the forward's time for the layer before this one
            spent = now - self._layer_end
            old = self.layer_compute_s
            self.layer_compute_s = spent if old is None else 0.8 * old + 0.2 * spent
        where = self.layer_names.get(name)
        if where is not None and self._loads:
            self._scatter(*where)
        self._layer_end = time.perf_counter()

    def after_layer(self, name: str) -> None:
        self.layers_touched = True
        where = self.layer_names.get(name)
        if where is not None and self._stores:
            self._gather(*where)

    def end(self) -> None:
        """After the forward: finish every layer, commit the stores, release the fetched pages."""
        copied = self._copying  # (read before the session and the loads are cleared below)
        if self._session is not None:
            for g in self._stores:
                for layer in range(self.groups[g].num_layers):
                    self._gather(g, layer)
        for g, load in self._loads.items():
            self._fetched(g, load)
            if len(load.done_layers) < self.groups[g].num_layers:
                # The forward ran without (some of) these layers loaded: recompute those tokens.
                self._errors.update(load.block_ids)
        if copied:
            t0 = time.perf_counter()
            self._sync()  # the GPU's queued copies have read and written the host pages
            if self._streams is not None:  # (the copies' device time, not the waits for the forward)
                self._copy_s = self._streams.step.take_seconds()
            else:
                self._copy_s += time.perf_counter() - t0
            if self._copied_bytes:
                self.store.link.copied(self._copied_bytes, self._copy_s)
        self._copied_bytes, self._copy_s = 0, 0.0
        for g, load in self._loads.items():
            self._fetched(g, load).release()
        self._loads = {}
        self._release_held()
        if self._session is not None:
            headers = self._session_headers()
            below = {} if self._staging is None else store_from_device(
                self.store, self.copier, self._staging, self._on_device,
                {g: (st.keys, st.blocks) for g, st in self._stores.items()})
            results = self._session.commit(headers, below=below)
            for lay, ok in zip(self._session.layouts, results):
                if ok:
                    self.stats.add(lay.name, stored_pages=1, stored_bytes=lay.payload_bytes)
            self._session = None
        self._stores = {}

    def _session_headers(self) -> list[PageHeader] | None:
        """The headers of the step's pages, where the device computed their digests as it gathered
        them (the others hashed here); None when it computed none (the session hashes them all)."""
        session = self._session
        assert session is not None
        known: dict[int, PageHeader] = {}
        for g, st in self._stores.items():
            layout = self.groups[g]
            got = st.digests
            if not got or len(got) != layout.num_layers or any(d is None for d in got.values()):
                continue
            rows = np.concatenate([got[layer].get() for layer in range(layout.num_layers)], axis=1).astype("<u8")
            for at, key, row in zip(st.index, st.keys, rows):
                known[at] = header_of_digests(key, layout, row.tobytes())
        if not known:
            return None
        return [known.get(i) or make_header(k, lay, session.buffer(i))
                for i, (k, lay) in enumerate(zip(session.keys, session.layouts))]

    @property
    def _copying(self) -> bool:
        """Whether this step queued copies (stores or loads): a step without any waits for nothing."""
        return self._session is not None or bool(self._loads)

    def _sync(self) -> None:
        """Wait for the step's copies queued on the GPU (a no-op on a CPU engine)."""
        self.copier.sync()

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """Copies queued inside go to the step's copy stream (without copy streams: the current one)."""
        return self.copier.on_stream()

    @property
    def _streams(self):
        return self.copier.streams

    def close(self) -> None:
        """Finish the step in flight and hand back what the worker holds (the GDS staging slots once
        their writes are done, the prefetch threads)."""
        self.end()
        self.background.close()
        self._layer_pool.shutdown(wait=True)
        if self._staging is not None:
            self.store.drain()
            self._staging.close()
            self._staging = None

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def _release_held(self) -> None:
        for lease in self._held:
            lease.release()
        self._held = []

    def _abort_leftovers(self) -> None:
        """A step that never reached :meth:`end` (an engine error) leaves nothing behind."""
        try:
            if self._copying:
                self._sync()
            if self._streams is not None:
                self._streams.step.take_seconds()  # (not this step's copy rate)
        except Exception:  # a failed step can leave the device in error: the pages are dropped anyway
            log.exception("lmkv: waiting for the last step's copies failed")
        self._copied_bytes, self._copy_s = 0, 0.0
        self._release_held()
        if self._session is not None:
            self._session.abort()
            self._session = None
        for g, load in self._loads.items():
            self._fetched(g, load).release()
        self._loads, self._stores = {}, {}
