"""Whole-page loads for requests that wait (asynchronous loads), on the store's I/O threads.

A request whose hit loads asynchronously does not run until its pages are in its blocks: its
load is fetched and copied in entirely off the engine's step. Groups whose blocks are plain rows
of bytes (the CPU layout) load in place (:meth:`lmkv.store.TieredStore.get_units`: copied from the
arena, or read from a buffered disk tier straight into the rows); the others are fetched in
chunks and scattered, the next chunk read while this one is copied in. A request is reported
finished only once its thread returned, every copy into its blocks done (on a GPU, its stream
synchronized): the engine may then hand its blocks to anyone. One whose load failed anywhere is
recomputed whole.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from lmkv import threads
from lmkv.engine.blockcopy import LayerBlocks
from lmkv.engine.copier import Copier
from lmkv.engine.plan import PageOp
from lmkv.engine.transfer_stats import FailedChains, WorkerStats
from lmkv.keys import PageKey
from lmkv.store import Fetched, TieredStore
from lmkv.tiers.device_staging import DeviceStaging

log = logging.getLogger(__name__)

#: how long a step with nothing else to do waits for a background load to finish
IDLE_WAIT_S = 0.005
#: pages per fetch of a background load: the next chunk is read while this one is copied in
LOAD_CHUNK_PAGES = 32


class BackgroundLoads:
    """The asynchronous loads in flight, one future per request. :meth:`start` from the step's
    thread; the loads run on the store's I/O threads (their next chunks on two prefetch threads);
    :meth:`results` reports the finished ones; :meth:`close` ends the prefetch threads."""

    def __init__(self, store: TieredStore, copier: Copier, keys_of: Callable[[PageOp], list[PageKey]],
                 device_of: Callable[[int], DeviceStaging | None], stats: WorkerStats, failed: FailedChains) -> None:
        """``keys_of(op)``: this rank's page keys of an op; ``device_of(group)``: GDS staging slots for
        the group's pages, if they go through device memory."""
        self.store, self.copier = store, copier
        self._keys_of, self._device_of = keys_of, device_of
        self.stats, self.failed = stats, failed
        self.loads: dict[str, Future] = {}  # request -> its load (True if every page loaded)
        # fetches of a load's next chunk (a pool of its own: it never waits on the store's)
        self._prefetch = threads.pool(2, "lmkv-prefetch")

    def start(self, ops: Iterable[PageOp]) -> None:
        """Start the loads of these ops, one per request not loading already."""
        by_request: dict[str, list[PageOp]] = {}
        for op in ops:
            by_request.setdefault(op.req_id, []).append(op)
        streams = self.copier.streams
        if by_request and streams is not None:  # (their blocks' last readers may still be queued)
            streams.background.follow(streams.compute())
        for rid, req_ops in by_request.items():
            if rid not in self.loads:
                self.loads[rid] = self.store.submit(self._load, req_ops)

    def _load(self, ops: list[PageOp]) -> bool:
        """Load every layer of a waiting request's pages; whether all of them loaded."""
        rows = self.copier.rows
        ok = True
        for op in ops:
            in_place = rows[op.group]
            if in_place is not None:
                ok = self._load_in_place(op, in_place) and ok
        ok = self._load_staged([op for op in ops if rows[op.group] is None]) and ok
        if not ok:
            groups = self.copier.groups
            self.stats.add(recomputed_tokens=max(len(op.chains) * groups[op.group].tokens_per_page for op in ops))
        return ok

    def _load_in_place(self, op: PageOp, rows: list[LayerBlocks]) -> bool:
        """Pages read straight into the blocks' rows (:meth:`TieredStore.get_units`: copied from the
        arena, or read from a buffered disk tier with one read per page).

        A page that failed may have left anything in its blocks (a torn read, the bytes that failed
        their checksum): they are zeroed. The engine recomputes the request into those blocks, but
        the last one is only partly rewritten, and an attention kernel that weighs the unused slots
        by zero still turns a NaN or an infinity there into NaN outputs."""
        layout = self.copier.groups[op.group]
        units = [[u for layer in rows for u in layer.units(b, layout.segments)] for b in op.block_ids]
        got = self.store.get_units(self._keys_of(op), layout, units)
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
        keys = {id(op): self._keys_of(op) for op in ops}

        def fetch(k: int) -> Future:
            op, i = chunks[k]
            chunk = keys[id(op)][i : i + LOAD_CHUNK_PAGES]
            return self._prefetch.submit(self.store.fetch, chunk, self.copier.groups[op.group],
                                         self._device_of(op.group))

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
        """Scatter one fetched chunk into its blocks; whether all of it loaded."""
        copier = self.copier
        with fetched:
            with copier.on_stream(background=True):
                copies = copier.copies(op.group, op.block_ids[i : i + LOAD_CHUNK_PAGES], fetched.views)
                for layer in range(copier.groups[op.group].num_layers):
                    copier.scatter_layer(op.group, layer, copies)
            copier.sync(background=True)  # (before the pages are released)
            return self._landed(op, i, [v is not None for v in fetched.views])

    def _landed(self, op: PageOp, first: int, ok: list[bool]) -> bool:
        """Account for pages ``first..`` of a load; whether all of them loaded."""
        layout = self.copier.groups[op.group]
        failed = [c for c, good in zip(op.chains[first:], ok) if not good]
        if failed:
            self.failed.add(failed)
        loaded = len(ok) - len(failed)
        self.stats.add(layout.name, loaded_pages=loaded, failed_pages=len(failed),
                       loaded_bytes=loaded * layout.payload_bytes)
        return not failed

    def results(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose load finished, and the subset that failed (to recompute).

        ``idle``: the engine had nothing to run this step and will ask again at once; waiting
        here briefly for a load to finish keeps that loop from starving the loads of the GIL.
        """
        if idle and self.loads:
            concurrent.futures.wait(list(self.loads.values()), timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        done, failed = set(), set()
        for rid, fut in list(self.loads.items()):
            if not fut.done():
                continue
            del self.loads[rid]
            done.add(rid)
            try:
                if not fut.result():
                    failed.add(rid)
            except Exception:  # a failing tier must cost a recompute, never the engine
                log.exception("lmkv: background load of %s failed; recomputing", rid)
                failed.add(rid)
        return done, failed

    def close(self) -> None:
        self._prefetch.shutdown(wait=True)
