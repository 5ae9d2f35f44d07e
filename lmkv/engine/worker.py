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

GPUDirect Storage (a disk tier with ``disk.io: gds`` on the engine's GPU, layers the
copy kernel can address): disk pages are read into device staging slots
(:mod:`lmkv.tiers.device_staging`), verified there, and scattered by the kernel; under
write-through, stored blocks are gathered into slots after the forward and written to
disk from device memory, the host copy going to the memory tier alone.

Asynchronous loads (the request waits instead of running) are fetched and
copied into their blocks entirely on the store's I/O threads;
:meth:`LayerwiseTransfer.transfer_results` reports the requests whose load
completed and those whose load failed (the engine recomputes them whole). The
chain hashes of pages that failed are reported too, so the scheduler stops
offering them for a while.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lmkv.cuda import KernelLayerBlocks, kernel_layer_blocks, synchronize, to_device
from lmkv.cuda.streams import CopyStreams, Events
from lmkv.engine.blockcopy import BlockRun, LayerBlocks, as_bytes_array, block_runs
from lmkv.engine.layer_fetch import LayerFetch, SpanChooser
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.errors import TierFullError
from lmkv.keys import ChainHash, PageKey, page_key
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, header_of_digests, make_header, padded
from lmkv.store import Fetched, StoreSession, TieredStore
from lmkv.tiers.device_staging import DeviceStaging
from lmkv.tiers.gds import DeviceBuffer

log = logging.getLogger(__name__)

#: how long a step with nothing else to do waits for a background load to finish
IDLE_WAIT_S = 0.005
#: pages per fetch of a background load: the next chunk is read while this one is copied in
LOAD_CHUNK_PAGES = 32
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


def layer_copier(layer: torch.Tensor, device_visible: Callable[[int, int], bool]) -> LayerBlocks | KernelLayerBlocks:
    """The copier of an engine layer: for a CUDA tensor, lmkv's kernel
    (:class:`lmkv.cuda.KernelLayerBlocks`, pages in pinned memory where ``device_visible`` says so)
    where it can copy the layout and CuPy is installed; otherwise :class:`LayerBlocks`."""
    if layer.device.type == "cuda":
        k = kernel_layer_blocks(layer, device_visible)
        if k is not None:
            return k
    return LayerBlocks(layer)


def _rows_of(layers: Sequence[LayerBlocks | KernelLayerBlocks]) -> list[LayerBlocks] | None:
    """The layers if each one's blocks are rows of bytes in host memory, else None."""
    rows = [lb for lb in layers if isinstance(lb, LayerBlocks) and lb.rows is not None]
    return rows if len(rows) == len(layers) else None


@dataclass
class TransferCounts:
    loaded_pages: int = 0
    loaded_bytes: int = 0
    failed_pages: int = 0
    recomputed_tokens: int = 0  # tokens lmkv offered but the engine computes because a load failed
    layerwise_pages: int = 0  # pages of layerwise loads read from a tier below memory, layer by layer
    layer_wait_us: int = 0  # time the forward waited for layers of those loads
    stored_pages: int = 0
    stored_bytes: int = 0
    rescued_pages: int = 0  # stored pages copied before the forward (lazy offload: blocks the step took)
    dropped_pages: int = 0  # stores skipped because memory had no room


class WorkerStats:
    """Transfer counts since start (``totals``, and per cache group in ``groups``) and since the
    engine last asked (:meth:`take`)."""

    def __init__(self) -> None:
        self.totals = TransferCounts()
        self.groups: dict[str, TransferCounts] = {}
        self._recent = TransferCounts()

    def add(self, group: str | None = None, **counts: int) -> None:
        targets = [self.totals, self._recent]
        if group is not None:
            targets.append(self.groups.setdefault(group, TransferCounts()))
        for k, v in counts.items():
            for t in targets:
                setattr(t, k, getattr(t, k) + v)

    def take(self) -> dict[str, int]:
        out = dict(vars(self._recent))
        self._recent = TransferCounts()
        return out


@dataclass
class _Copies:
    """Fetched pages paired with their blocks: host pages as runs, device pages (GDS staging slots)
    as the kernel's (blocks, page addresses) index tensors."""

    runs: list[BlockRun] = field(default_factory=list)
    device: tuple[torch.Tensor, torch.Tensor] | None = None


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
    copies: _Copies = field(default_factory=_Copies)  # the pages that loaded and their blocks
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
    def __init__(
        self,
        store: TieredStore,
        groups: Sequence[GroupLayout],
        tensors: Sequence[Sequence[torch.Tensor]],
        layer_names: Mapping[str, tuple[int, int]],
    ) -> None:
        """``tensors[g][l]`` is layer ``l`` of group ``g``; ``layer_names`` maps the engine's names to (g, l)."""
        self.store = store
        self.groups = list(groups)
        self.layers = [[layer_copier(t, store.memory.device_visible) for t in group] for group in tensors]
        #: per group, its layers where every one is plain rows of bytes (the CPU layout): pages load in place
        self._rows = [_rows_of(layers) for layers in self.layers]
        self._cuda = [t for group in tensors for t in group[:1] if t.device.type == "cuda"]  # a layer per group
        #: GPU: the copies' own streams, ordered against the forward by events (:mod:`lmkv.cuda.streams`)
        self._streams = CopyStreams(t.device for t in self._cuda) if self._cuda and store.cfg.copy_stream else None
        self.layer_names = dict(layer_names)
        for layout, layers in zip(self.groups, self.layers):
            if len(layers) != layout.num_layers:
                raise ValueError(f"group {layout.name!r}: {len(layers)} tensors for {layout.num_layers} layers")
            for lb in layers:
                if lb.nbytes != layout.layer_stride:
                    raise ValueError(
                        f"group {layout.name!r}: an engine block holds {lb.nbytes} bytes per layer, "
                        f"the page layout expects {layout.layer_stride}"
                    )
        #: GPUDirect Storage: device staging slots on the GDS disk tier's GPU, and the groups that use them
        self._staging, self._on_device = self._device_staging(tensors)
        self.stats = WorkerStats()
        self._loads: dict[int, _GroupLoad] = {}
        self._stores: dict[int, _GroupStore] = {}
        self._session: StoreSession | None = None
        #: this step's copies out of engine blocks: bytes and seconds spent on them (lazy offload's drain
        #: cap is a share of the link's time: the scheduler is told the rate)
        self._copied_bytes = 0
        self._copy_s = 0.0
        self._errors: set[int] = set()
        self._failed_chains: list[ChainHash] = []
        self._failed_lock = threading.Lock()
        self._async: dict[str, Future] = {}  # request -> its background load (True if every page loaded)
        # fetches of a background load's next chunk (a pool of its own: it never waits on the store's)
        self._prefetch = ThreadPoolExecutor(2, thread_name_prefix="lmkv-prefetch")
        self._layer_pool = ThreadPoolExecutor(LAYER_THREADS, thread_name_prefix="lmkv-layers")
        #: the forward's time per layer (between one layer's wait and the next), a moving average
        self.layer_compute_s: float | None = None
        self._layer_end: float | None = None
        self._spans: dict[tuple[str, int], SpanChooser] = {}  # (tier, layers) -> its layers per request
        self._plan = StepPlan()
        self._load_keys: list[list[PageKey]] = []  # the keys of the step's loads, in the plan's order
        self._held: list = []
        self.layers_touched = False

    def _device_staging(self, tensors: Sequence[Sequence[torch.Tensor]]) -> tuple[DeviceStaging | None, set[int]]:
        """Staging slots for a GPUDirect Storage disk tier on the engine's GPU, and the groups whose
        layers the kernel copies there (others take the host path)."""
        disk = self.store.gds_disk
        if disk is None or disk.gds is None:
            return None, set()
        groups = {g for g, (layers, ts) in enumerate(zip(self.layers, tensors))
                  if ts and all(isinstance(lb, KernelLayerBlocks) for lb in layers)
                  and ts[0].device.index == disk.gds.device}
        if not groups:
            return None, set()
        slot = max(self.groups[g].payload_bytes for g in groups)
        slots = max(1, self.store.cfg.disk.gds_staging // padded(slot))
        return DeviceStaging(disk.gds, slot, slots), groups

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
            self._session = self.store.open_session(all_keys, layouts)
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
            rescued = [(b, p) for b, p, now in zip(blocks, pages, at_once) if now]
            if rescued:
                runs = block_runs([b for b, _ in rescued], [p for _, p in rescued])
                with self._on_stream():
                    for layer, lb in enumerate(self.layers[g]):
                        lb.gather(runs, self.groups[g].layer_range(layer)[0])
                if self._streams is not None:  # the forward writes these blocks only once they are copied
                    self._streams.compute().follow(self._streams.step)
                self.stats.add(self.groups[g].name, rescued_pages=len(rescued))
            later = [(b, p, k, i - len(keys) + j)
                     for j, (b, p, k, now) in enumerate(zip(blocks, pages, keys, at_once)) if not now]
            on_device = self._streams is not None and all(isinstance(lb, KernelLayerBlocks) for lb in self.layers[g])
            self._stores[g] = _GroupStore(block_runs([b for b, _, _, _ in later], [p for _, p, _, _ in later]),
                                          [k for _, _, k, _ in later], [b for b, _, _, _ in later],
                                          [at for _, _, _, at in later], digests={} if on_device else None)

    def start_loads(self) -> None:
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
        by_request: dict[str, list[PageOp]] = {}
        for op in self._plan.async_loads:
            by_request.setdefault(op.req_id, []).append(op)
        if by_request and self._streams is not None:  # (their blocks' last readers may still be queued)
            self._streams.background.follow(self._streams.compute())
        for rid, ops in by_request.items():
            if rid not in self._async:
                self._async[rid] = self.store.submit(self._load_in_background, ops)

    def _load_in_background(self, ops: list[PageOp]) -> bool:
        """Load every layer of a waiting request's pages; whether all of them loaded (a request
        whose load fails is recomputed whole). Groups whose blocks are plain rows of bytes load in
        place, the others through host pages."""
        ok = True
        for op in ops:
            rows = self._rows[op.group]
            if rows is not None:
                ok = self._load_in_place(op, rows) and ok
        ok = self._load_staged([op for op in ops if self._rows[op.group] is None]) and ok
        if not ok:
            self.stats.add(recomputed_tokens=max(len(op.chains) * self.groups[op.group].tokens_per_page for op in ops))
        return ok

    def _load_in_place(self, op: PageOp, rows: list[LayerBlocks]) -> bool:
        """Pages read straight into the blocks' rows (:meth:`TieredStore.get_units`: copied from the
        arena, or read from a buffered disk tier with one read per page).

        A page that failed may have left anything in its blocks (a torn read, the bytes that failed
        their checksum): they are zeroed. The engine recomputes the request into those blocks, but
        the last one is only partly rewritten, and an attention kernel that weighs the unused slots
        by zero still turns a NaN or an infinity there into NaN outputs."""
        layout = self.groups[op.group]
        units = [[u for layer in rows for u in layer.units(b, layout.segments)] for b in op.block_ids]
        got = self.store.get_units(self.keys(op), layout, units)
        for bufs, h in zip(units, got):
            if h is None:
                for u in bufs:
                    u[:] = 0
        return self._landed(op, 0, [h is not None for h in got])

    def _load_staged(self, ops: list[PageOp]) -> bool:
        """Pages fetched in chunks and scattered into their blocks, the next chunk's reads running
        while this chunk is copied in, so the request waits for roughly the reads alone."""
        ok = True
        chunks = [(op, i) for op in ops for i in range(0, len(op.chains), LOAD_CHUNK_PAGES)]
        keys = {id(op): self.keys(op) for op in ops}

        def fetch(k: int) -> Future:
            op, i = chunks[k]
            chunk = keys[id(op)][i : i + LOAD_CHUNK_PAGES]
            return self._prefetch.submit(self.store.fetch, chunk, self.groups[op.group], self._device(op.group))

        nxt = fetch(0) if chunks else None
        try:
            for k, (op, i) in enumerate(chunks):
                assert nxt is not None
                cur, nxt = nxt, fetch(k + 1) if k + 1 < len(chunks) else None
                ok = self._copy_chunk(op, i, cur.result()) and ok
        except BaseException:
            if nxt is not None:  # its pages are pinned until released
                try:
                    nxt.result().release()
                except Exception:
                    pass
            raise
        return ok

    def _copy_chunk(self, op: PageOp, i: int, fetched: Fetched) -> bool:
        """Scatter one fetched chunk of a background load into its blocks; whether all of it loaded."""
        layout = self.groups[op.group]
        with fetched:
            with self._on_stream(background=True):
                copies = self._copies(op.group, op.block_ids[i : i + LOAD_CHUNK_PAGES], fetched.views)
                for layer in range(layout.num_layers):
                    self._scatter_layer(op.group, layer, copies)
            self._sync(background=True)  # (before the pages are released)
            return self._landed(op, i, [v is not None for v in fetched.views])

    def _landed(self, op: PageOp, first: int, ok: list[bool]) -> bool:
        """Account for pages ``first..`` of a background load; whether all of them loaded."""
        layout = self.groups[op.group]
        failed = [c for c, good in zip(op.chains[first:], ok) if not good]
        if failed:
            with self._failed_lock:
                self._failed_chains.extend(failed)
        loaded = len(ok) - len(failed)
        self.stats.add(layout.name, loaded_pages=loaded, failed_pages=len(failed),
                       loaded_bytes=loaded * layout.payload_bytes)
        return not failed

    def transfer_results(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose background load finished, and the subset that failed (to recompute).

        ``idle``: the engine had nothing to run this step and will ask again at once; waiting
        here briefly for a load to finish keeps that loop from starving the loads of the GIL.
        """
        if idle and self._async:
            concurrent.futures.wait(list(self._async.values()), timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        done, failed = set(), set()
        for rid, fut in list(self._async.items()):
            if not fut.done():
                continue
            del self._async[rid]
            done.add(rid)
            try:
                if not fut.result():
                    failed.add(rid)
            except Exception:  # a failing tier must cost a recompute, never the engine
                log.exception("lmkv: background load of %s failed; recomputing", rid)
                failed.add(rid)
        return done, failed

    def take_failed_chains(self) -> list[ChainHash]:
        with self._failed_lock:
            out, self._failed_chains = self._failed_chains, []
        return out

    def _depth(self, tier: str, span: int) -> int:
        """Requests in flight: a request carries ``span`` layers, the forward computes as many."""
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
                for tier, (span, nbytes) in load.future.spans.items():
                    self._chooser(tier, self.groups[g].num_layers).record(span, load.waited_s, nbytes)
            else:
                fetched = load.future.result()
        except Exception:  # a failing tier must cost a recompute, never the engine
            log.exception("lmkv: fetch failed; recomputing")
            fetched = Fetched([None] * len(load.block_ids), [None] * len(load.block_ids), [])
        load.fetched = fetched
        views = fetched.views
        load.ok = [v is not None for v in views]
        if not isinstance(load.future, LayerFetch):  # (a layerwise load paired its pages layer by layer)
            load.copies = self._copies(g, load.block_ids, views)
        loaded = sum(load.ok)
        failed = [b for b, ok in zip(load.block_ids, load.ok) if not ok]
        self._errors.update(failed)
        # the engine recomputes each request from its first failed page on
        recomputed = 0
        for first, n in load.requests:
            bad = next((i for i in range(n) if not load.ok[first + i]), n)
            recomputed += (n - bad) * self.groups[g].tokens_per_page
        with self._failed_lock:
            self._failed_chains.extend(c for c, ok in zip(load.chains, load.ok) if not ok)
        self.stats.add(
            self.groups[g].name,
            failed_pages=len(failed),
            recomputed_tokens=recomputed,
            loaded_pages=loaded,
            loaded_bytes=loaded * self.groups[g].payload_bytes,
            layerwise_pages=load.future.from_below if isinstance(load.future, LayerFetch) else 0,
        )
        return fetched

    def _copies(self, g: int, block_ids: Sequence[int], views: Sequence) -> _Copies:
        """The blocks of the pages that loaded, paired with their host or device pages."""
        host = [(b, as_bytes_array(v)) for b, v in zip(block_ids, views)
                if v is not None and not isinstance(v, DeviceBuffer)]
        on_device = [(b, v.ptr) for b, v in zip(block_ids, views) if isinstance(v, DeviceBuffer)]
        copies = _Copies(block_runs([b for b, _ in host], [p for _, p in host]))
        if on_device:
            copies.device = self._index(g, on_device)
        return copies

    def _index(self, g: int, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, device page addresses) as the kernel's int64 index tensors on group ``g``'s GPU."""
        dev = self.layers[g][0].tensor.device
        return to_device([b for b, _ in pairs], dev), to_device([p for _, p in pairs], dev)

    def _scatter_layer(self, g: int, layer: int, copies: _Copies) -> None:
        start = self.groups[g].layer_range(layer)[0]
        lb = self.layers[g][layer]
        lb.scatter(copies.runs, start)
        if copies.device is not None:
            assert isinstance(lb, KernelLayerBlocks)
            lb.copy_at(*copies.device, start, to_pages=False)

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
                    load.copies = self._copies(g, [b for b, ok in zip(load.block_ids, landed) if ok],
                                               [v for v, ok in zip(load.future.views, landed) if ok])
            else:
                self._fetched(g, load)
            self._scatter_layer(g, layer, load.copies)
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
            below = self._store_from_device()
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

    def _store_from_device(self) -> dict[str, set[PageKey]]:
        """GPUDirect Storage under write-through: the blocks this step stored (computed now) are
        gathered into device staging slots, their headers made on the device, and written to the
        disk tier from there on an I/O thread. The keys the disk tier gets this way, by tier name:
        the session's own write-through skips them there."""
        staging = self._staging
        if staging is None or self.store.cfg.store.write_policy != "write_through":
            return {}
        from lmkv.cuda.digests import headers_on_device

        disk = self.store.gds_disk
        assert disk is not None
        sent: set[PageKey] = set()
        for g, st in self._stores.items():
            if g not in self._on_device or not st.keys:
                continue
            slots = staging.take(len(st.keys))
            n = len(slots.ptrs)
            if not n:
                continue
            layout = self.groups[g]
            if self._streams is not None:  # after the whole forward
                self._streams.step.follow(self._streams.compute())
            with self._on_stream():
                index = self._index(g, list(zip(st.blocks[:n], slots.ptrs)))
                for layer, lb in enumerate(self.layers[g]):
                    assert isinstance(lb, KernelLayerBlocks)
                    lb.copy_at(*index, layout.layer_range(layer)[0], to_pages=True)
            self._sync()
            try:
                heads = headers_on_device(st.keys[:n], slots.ptrs, layout, device=staging.device)
            except Exception:  # the host path writes them instead
                log.exception("lmkv: digests on the device failed; writing these pages from host memory")
                slots.release()
                continue
            pages = [(h, DeviceBuffer(p)) for h, p in zip(heads, slots.ptrs)]
            self.store.submit(self._write_from_device, disk, pages, slots)
            sent.update(st.keys[:n])
        return {disk.name: sent} if sent else {}

    def _write_from_device(self, disk, pages: list, slots) -> None:
        try:
            self.store.write_down(disk, pages, self.store.domain)
        finally:
            slots.release()

    @property
    def _copying(self) -> bool:
        """Whether this step queued copies (stores or loads): a step without any waits for nothing."""
        return self._session is not None or bool(self._loads)

    def _sync(self, background: bool = False) -> None:
        """Wait for the copies queued on the GPU (a no-op on a CPU engine): a step's, or with
        ``background`` those the calling I/O thread queued for an asynchronous load."""
        if self._streams is not None:
            (self._streams.background if background else self._streams.step).synchronize()
        elif self._cuda:
            synchronize(self._cuda)

    def _on_stream(self, background: bool = False) -> contextlib.AbstractContextManager:
        """Copies queued inside go to the step's copy stream, or with ``background`` to the one of
        asynchronous loads (without copy streams: the calling thread's current stream)."""
        if self._streams is None:
            return contextlib.nullcontext()
        return (self._streams.background if background else self._streams.step).active()

    def close(self) -> None:
        """Finish the step in flight and hand back what the worker holds (the GDS staging slots once
        their writes are done, the prefetch threads)."""
        self.end()
        self._prefetch.shutdown(wait=True)
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
