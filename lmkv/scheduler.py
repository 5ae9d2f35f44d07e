"""Scheduler-side logic, engine-agnostic: lookups, load and store decisions, finalization.

An engine adapter calls this in the engine's scheduler: it asks how many tokens
of a request lmkv can supply, tells which engine blocks were allocated for
them, and once per step turns the scheduled requests into a :class:`StepPlan`
for the workers. Everything is about keys and block ids; no bytes move here.

Stores are *eager* here: every page a step completes is planned for storing in
that step, unless some tier already holds it, and the workers copy it out of
the engine blocks before that step ends (``wait_for_save``). Two-phase
finalization keeps three events apart: compute finished
(:meth:`OffloadScheduler.finish`); the final store decision submitted, which
for eager stores is the plan of the step that computed the request's last full
page (the page its final token filled) and so precedes ``finish``; all
transfers complete, which the step's end guarantees for the copies out of
engine blocks (tier write-back continues from lmkv's own buffers). So a
finished request's blocks need no holding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmkv.keys import KeySpace
from lmkv.layout import GroupLayout
from lmkv.plan import PageOp, StepPlan
from lmkv.sequence import SequenceKeys, Span
from lmkv.store import Lookup

#: engine block id that marks "no block" (vLLM's null block; skipped windows)
NULL_BLOCK = 0


@dataclass
class RequestState:
    req_id: str
    seq: SequenceKeys
    local_pages: int = 0  # pages the engine had itself at the last lookup
    stored_upto: int = 0  # pages below this are resident somewhere or planned for storing
    pending_loads: list[PageOp] = field(default_factory=list)
    async_load: bool = False  # the last lookup's load waits instead of running layerwise
    pins: list = field(default_factory=list)  # memory pages held for a planned layerwise load


@dataclass
class SchedulerStats:
    lookups: int = 0  # a waiting request is looked up again every step it waits
    loaded_tokens: int = 0  # tokens planned for loading (tier hits the engine took)
    stored_pages: int = 0  # pages planned for storing
    skipped_resident: int = 0  # pages not stored because a tier already had them


@dataclass
class Scheduled:
    """One request scheduled in this step, as the engine reports it."""

    req_id: str
    computed_after_step: int  # tokens whose state exists once this step ran
    tokens: Sequence[int]  # all token ids known so far


class Residency(Protocol):
    """What the scheduler asks about residency: a :class:`~lmkv.store.TieredStore` or a
    :class:`~lmkv.residency.ResidencyMirror` of workers in other processes."""

    def lookup(self, keys: Sequence[bytes]) -> Lookup: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...


class OffloadScheduler:
    def __init__(
        self,
        store: Residency,
        groups: Sequence[GroupLayout],
        tokens_per_page: int,
        model_id: str,
        namespace: str,
        load_mode: str = "auto",
        quarantine_seconds: float = 30.0,
    ) -> None:
        """``load_mode``: "layerwise", "async", or "auto" — layerwise when every page of the hit is
        in memory, asynchronous when some must come from a lower tier (a failed layerwise load
        leaves vLLM's prefix cache holding the failed block until its recompute; an asynchronous
        one is only cached once it succeeded)."""
        self.store = store
        self.load_mode = load_mode
        self.quarantine_seconds = quarantine_seconds
        self._quarantine: dict[bytes, float] = {}  # chain hash -> when it may be offered again
        self._released_next: list = []  # memory pins of the loads in the last plan
        self.groups = list(groups)
        self.tpp = tokens_per_page
        self.model_id = model_id
        self.namespace = namespace
        self.requests: dict[str, RequestState] = {}
        self.stats = SchedulerStats()

    # -- requests ------------------------------------------------------------

    def track(self, req_id: str, salt: str = "", spans: Sequence[Span] = ()) -> RequestState:
        """State of a request, created on first sight; ``salt`` isolates its keys (cache salt, LoRA)."""
        st = self.requests.get(req_id)
        if st is None:
            ns = self.namespace if not salt else f"{self.namespace}\0{salt}"
            st = RequestState(req_id, SequenceKeys(KeySpace(self.model_id, ns), self.tpp, tuple(spans)))
            self.requests[req_id] = st
        return st

    def lookup(self, st: RequestState, tokens: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that lmkv can load (whole pages; never the last token)."""
        max_pages = (len(tokens) - 1) // self.tpp  # the engine must compute at least one token
        local = num_computed_tokens // self.tpp
        st.local_pages = local
        if max_pages <= local or not self.groups:
            return 0
        st.seq.extend(tokens[: max_pages * self.tpp])
        hit = self._unquarantined(st.seq.chains, local, max_pages) - local
        tiers: set[str] = set()
        for layout in self.groups:
            if hit == 0:
                break
            found = self.store.lookup(st.seq.keys(layout, local, local + hit))
            hit = min(hit, found.pages)
            tiers.update(found.tiers[:hit])
        st.async_load = self.load_mode == "async" or (self.load_mode == "auto" and not tiers <= {"memory"})
        self.stats.lookups += 1
        return hit * self.tpp

    def _unquarantined(self, chains: Sequence[bytes], start: int, end: int) -> int:
        """The first page in ``[start, end)`` whose load failed recently (or ``end``)."""
        if not self._quarantine:
            return end
        now = time.monotonic()
        self._quarantine = {c: t for c, t in self._quarantine.items() if t > now}
        return next((p for p in range(start, end) if chains[p] in self._quarantine), end)

    def quarantine(self, chains: Iterable[bytes]) -> None:
        """Pages whose load failed: not offered again for a while, so a retry recomputes them."""
        until = time.monotonic() + self.quarantine_seconds
        for c in chains:
            self._quarantine[c] = until

    def allocated(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """The engine gave the request its blocks; plan the load of ``num_external_tokens``."""
        st = self.requests.get(req_id)
        if st is None:
            return
        n = num_external_tokens // self.tpp
        first = st.local_pages
        st.pending_loads = []
        if n:
            st.pending_loads = []
            for g in range(len(self.groups)):
                # A group may hold no block for some pages (a sliding window's skipped blocks).
                want = [p for p in range(first, first + n) if block_ids[g][p] != NULL_BLOCK]
                if want:
                    st.pending_loads.append(PageOp(
                        req_id, g, [st.seq.chains[p] for p in want], [block_ids[g][p] for p in want], want,
                    ))
            memory = getattr(self.store, "memory", None)
            if memory is not None and not st.async_load:
                # Sharing the workers' store: hold the pages until the step that loads them ran,
                # so nothing evicts them in between (a failed layerwise load is costly, see above).
                st.pins = [memory.borrow(st.seq.keys(lay, first, first + n), count=False) for lay in self.groups]
            self.stats.loaded_tokens += n * self.tpp
        st.stored_upto = max(st.stored_upto, first + n)

    # -- per step ------------------------------------------------------------

    def build_plan(self, scheduled: Iterable[Scheduled], block_ids_of: Callable[[str], Sequence[Sequence[int]]]) -> StepPlan:
        """Loads allocated since the last step, and stores of every page this step completes."""
        plan = StepPlan()
        for lease in self._released_next:  # the step that loaded them has run
            lease.release()
        self._released_next = []
        for st in self.requests.values():
            if st.pending_loads and st.async_load:  # these wait for their load instead of running
                plan.async_loads.extend(st.pending_loads)
                st.pending_loads = []
        planned: set[bytes] = set()  # two requests completing the same page in one step store it once
        for s in scheduled:
            st = self.requests.get(s.req_id)
            if st is None:
                continue
            plan.loads.extend(st.pending_loads)
            st.pending_loads = []
            self._released_next.extend(st.pins)
            st.pins = []
            full = min(s.computed_after_step, len(s.tokens)) // self.tpp
            if full > st.stored_upto:
                st.seq.extend(s.tokens[: full * self.tpp])
                blocks = block_ids_of(s.req_id)
                for g, layout in enumerate(self.groups):
                    op = self._store_op(st, g, layout, st.stored_upto, full, blocks[g], planned)
                    if op is not None:
                        plan.stores.append(op)
                st.stored_upto = full
        return plan

    def _store_op(
        self, st: RequestState, g: int, layout: GroupLayout, start: int, end: int,
        blocks: Sequence[int], planned: set[bytes],
    ) -> PageOp | None:
        keys = st.seq.keys(layout, start, end)
        resident = self.store.contains(keys)
        want = [
            i for i in range(end - start)
            if not resident[i] and keys[i] not in planned and blocks[start + i] != NULL_BLOCK
        ]
        self.stats.skipped_resident += sum(resident)
        if not want:
            return None
        planned.update(keys[i] for i in want)
        self.stats.stored_pages += len(want)
        chains = st.seq.chains
        return PageOp(
            st.req_id, g, [chains[start + i] for i in want], [blocks[start + i] for i in want],
            [start + i for i in want],
        )

    # -- finalization ----------------------------------------------------------

    def finish(self, req_id: str) -> bool:
        """Compute finished; returns whether the engine must hold the request's blocks.

        The request's last full page was planned in the step that computed it and
        copied out before that step ended, so stores never need the blocks held. (A
        request aborted during an asynchronous load keeps its blocks until the workers
        report the load finished: vLLM itself holds those.)
        """
        st = self.requests.pop(req_id, None)
        if st is not None:
            for lease in st.pins:
                lease.release()
        return False
