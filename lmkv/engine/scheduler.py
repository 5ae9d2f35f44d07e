"""Scheduler-side logic, engine-agnostic: lookups, load and store decisions, finalization.

An engine adapter calls this in the engine's scheduler: it asks how many tokens
of a request lmkv can supply, tells which engine blocks were allocated for
them, and once per step turns the scheduled requests into a :class:`StepPlan`
for the workers.

Rules of this module:

1. No bytes move here: every decision is keys and block ids. The workers
   (:mod:`lmkv.engine.worker`) execute the plan; residency is asked of a
   :class:`Residency` (the store, or a mirror of workers in other processes).
2. Pages are named by chain hash in plans (each rank makes its own page keys from them:
   a sharded group's keys carry the rank) and by page key in residency questions.
3. Every call may come for a request it no longer tracks (finished, aborted): that is a
   no-op, never an error.

Stores are *eager* by default: every page a step completes is planned for storing in
that step, unless some tier already holds it, and the workers copy it out of
the engine blocks before that step ends (``wait_for_save``). Two-phase
finalization keeps three events apart: compute finished
(:meth:`OffloadScheduler.finish`); the final store decision submitted, which
for eager stores is the plan of the step that computed the request's last full
page (the page its final token filled) and so precedes ``finish``; all
transfers complete, which the step's end guarantees for the copies out of
engine blocks (tier write-back continues from lmkv's own buffers). So a
finished request's blocks need no holding.

With ``offload.policy: lazy`` (and the engine's free queue bound), pages are not
stored when computed: :class:`lmkv.offload.lazy.LazyOffload` plans copies of cached
blocks as they reach the head of the engine's free queue, and the workers copy
them like any other store. A finished request's blocks simply join that queue.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmkv.config import OffloadConfig, PDConfig
from lmkv.engine.lookups import NOT_YET, AsyncLookups, Verdict
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.sequence import SequenceKeys, Span
from lmkv.keys import ChainHash, EngineBlockKey, KeySpace, PageKey, page_key
from lmkv.layout import GroupLayout, Growth
from lmkv.lookup import Lookup, PrefixMemo, find_last
from lmkv.offload.lazy import FreeQueue, LazyOffload, Pick
from lmkv.tiers.link import COPY_OUT

#: engine block id that marks "no block" (vLLM's null block; skipped windows)
NULL_BLOCK = 0
#: a consumer waiting for announced pages asks the tiers again after this, then twice as long each
#: time up to POLL_MAX_S: the engine asks every step (an idle engine steps in a tight loop), and a
#: shared tier should not answer thousands of lookups a second per waiting request; the backoff
#: adds at most POLL_MAX_S to a hand-off whose pages are late
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.025
#: a pause looks this often for a request that came in meanwhile (see :meth:`OffloadScheduler.pause_idle`)
ARRIVAL_POLL_S = 0.002

log = logging.getLogger(__name__)


def _state_block(blocks: Sequence[int]) -> int | None:
    """The block holding a request's running state in a state group (its last real block)."""
    return next((b for b in reversed(blocks) if b != NULL_BLOCK), None)


def _pages(tokens: int, tpp: int) -> int:
    """Blocks that ``tokens`` tokens occupy (the last one may be partly filled)."""
    return -(-tokens // tpp)


def _next_pages(computed: int, before: int, known: int, tpp: int) -> int:
    """Blocks a request scheduled this step takes in the next: a prefill with ``known`` tokens and
    ``computed`` of them done after this step computes another chunk like this step's (from
    ``before``); a decode computes one token."""
    upto = min(known, computed + max(1, computed - before)) if computed < known else computed + 1
    return _pages(upto, tpp) - _pages(computed, tpp)


@dataclass
class RequestState:
    """What the scheduler side knows of one request: its keys, what it loads, what of it is stored."""

    req_id: str
    seq: SequenceKeys
    local_pages: int = 0  # pages the engine had itself at the last lookup
    stored_upto: int = 0  # pages below this are resident somewhere or planned for storing
    seen: int = 0  # full pages the steps so far have completed
    pending_loads: list[PageOp] = field(default_factory=list)
    async_load: bool = False  # the last lookup's load waits instead of running layerwise
    pins: list = field(default_factory=list)  # memory pages held for a planned layerwise load
    computed: int = 0  # tokens with state at the last step (to count the blocks each step takes)
    hit_pages: int = 0  # pages the engine or lmkv supplied when the request was admitted
    state_page: int | None = None  # the page whose boundary state this request stored last
    restorable: int = 0  # state groups: pages up to the last boundary whose state is kept
    prompt_pages: int = 0  # full pages of its prompt (a consumer never stores them)
    expect_pages: int = 0  # pages a producer announced for it
    wait_until: float = 0.0  # until when it waits for them
    next_poll: float = 0.0  # while it waits: when to ask the tiers again
    polls: int = 0  # while it waits: lookups that found the pages not all there
    pulled: int = 0  # while it waits: pages (from ``local_pages``) already asked to be pulled into memory
    pending_pulls: list[PageOp] = field(default_factory=list)  # pulls for the next step's plan
    noted: bool = False  # lazy offload: this request's use of its prefix has been counted
    memos: dict[int, PrefixMemo] = field(default_factory=dict)  # per group: what its last lookup found


@dataclass
class SchedulerStats:
    """The scheduler side's counts: lookups, planned loads and stores (reported in the engine's stats)."""

    lookups: int = 0  # a waiting request is looked up again every step it waits
    loaded_tokens: int = 0  # tokens planned for loading (tier hits the engine took)
    stored_pages: int = 0  # pages planned for storing
    skipped_resident: int = 0  # pages not stored because a tier already had them
    layerwise_loads: int = 0  # hits the engine took that load layer by layer inside a step
    async_loads: int = 0  # hits the engine took that load before their request runs
    lookups_timed_out: int = 0  # lookups a network tier did not answer in time (the request ran without it)
    lookups_local_only: int = 0  # lookups that asked only local tiers: a network tier was presumed stalled
    handoffs_short: int = 0  # consumer requests whose announced pages had not all come by pd.wait
    handoff_wait_ms: int = 0  # how long consumer requests waited for announced pages, summed


@dataclass
class Scheduled:
    """One request scheduled in this step, as the engine reports it."""

    req_id: str
    computed_after_step: int  # tokens whose state exists once this step ran
    tokens: Sequence[int]  # all token ids known so far
    block_hashes: Sequence[bytes] = ()  # the engine's hash of each full block, its own bytes (for lazy offload)


class Residency(Protocol):
    """What the scheduler asks about residency: a :class:`~lmkv.store.TieredStore` or a
    :class:`~lmkv.engine.residency.ResidencyMirror` of workers in other processes."""

    def find_prefix(self, keys_of: Callable[[int, int], Sequence[PageKey]], start: int, end: int,
                    memo: PrefixMemo | None = None, local: bool = False) -> tuple[Lookup, PrefixMemo]:
        """:func:`lmkv.lookup.find_prefix` over its tiers (``local``: without a network round trip)."""
        ...

    def contains(self, keys: Sequence[PageKey]) -> list[bool]: ...

    def contains_local(self, keys: Sequence[PageKey]) -> list[bool]:
        """As ``contains``, without a network round trip (asked on the engine's scheduler thread)."""
        ...


class OffloadScheduler:
    """The scheduler side of lmkv, engine-agnostic: lookups, load and store plans, finalization.

    An engine adapter calls it on the engine's scheduler thread: a lookup per waiting request, the
    blocks it was given, once per step the scheduled requests (:meth:`build_plan`), finished
    requests and the workers' reports (failed pages, measured rates). It asks a
    :class:`Residency` what is held and never moves bytes."""

    def __init__(
        self,
        store: Residency,
        groups: Sequence[GroupLayout],
        tokens_per_page: int,
        model_id: str,
        namespace: str,
        load_mode: str = "auto",
        quarantine_seconds: float = 30.0,
        offload: OffloadConfig | None = None,
        max_stall: float = 2.0,
        role: str = "both",
        pd: PDConfig | None = None,
        lookup_timeout: float | None = None,
    ) -> None:
        """``load_mode``: "layerwise", "async", or "auto" (:meth:`loads_async`); ``role``: "producer",
        "consumer" or "both" (vLLM's ``kv_role``, :class:`~lmkv.config.PDConfig`); ``lookup_timeout``:
        lookups run off the caller's thread with this deadline (the residency asks a network tier)."""
        self.store = store
        self.role = role
        self.pd = pd or PDConfig()
        self._lookups = AsyncLookups(lookup_timeout) if lookup_timeout is not None else None
        self.load_mode = load_mode
        self.max_stall = max_stall
        #: what the workers measured: each lower tier's read rate (bytes/s), the forward's time per layer
        self.link_rates: dict[str, float] = {}
        self.layer_compute_s: float | None = None
        self.running = 0  # requests the last step ran
        self.quarantine_seconds = quarantine_seconds
        self._quarantine: dict[ChainHash, float] = {}  # when each may be offered again
        self._released_next: list = []  # memory pins of the loads in the last plan
        self.groups = list(groups)
        self.tpp = tokens_per_page
        self.model_id = model_id
        self.namespace = namespace
        self.requests: dict[str, RequestState] = {}
        self.stats = SchedulerStats()
        self._reported: dict[str, int] = {}  # the counts :meth:`take_stats` last returned, as totals
        self.offload = offload
        # lazy offload: active once the engine's free queue is bound (eager stores until then)
        self.lazy: LazyOffload | None = None
        if offload is not None and offload.policy == "lazy" and role != "producer":  # (a producer stores all)
            page_bytes = max((lay.payload_bytes for lay in self.groups), default=1)
            self.lazy = LazyOffload(offload, page_bytes, self._engine_resident)
        self._pool: FreeQueue | None = None
        self._engine_key: Callable[[int, bytes], EngineBlockKey] | None = None
        self._engine_pages: OrderedDict[EngineBlockKey, tuple[int, ChainHash]] = OrderedDict()  # -> (group, chain)
        self._inflight: list[Pick] = []
        #: lazy offload: requests looked up since the last step's plan -> the blocks admitting them takes
        self._asked: dict[str, int] = {}
        #: groups that keep one state per sequence (Mamba), and every how many page boundaries one is kept
        self._state_groups = [g for g, lay in enumerate(self.groups) if lay.growth is Growth.PER_SEQUENCE]
        self._state_every = offload.state_every_pages if offload is not None else 1

    def take_stats(self) -> dict[str, int]:
        """What this side counted since the last call (lookups, planned loads and stores, and lazy
        offload's decisions as ``lazy.*``: planned, rescued, unlikely, ...), for the engine's stats."""
        totals = dict(vars(self.stats))
        if self.lazy is not None:
            totals.update({f"lazy.{k}": v for k, v in vars(self.lazy.stats).items()})
        out = {k: v - self._reported.get(k, 0) for k, v in totals.items()}
        self._reported = totals
        return out

    def bind_free_queue(self, pool: FreeQueue, engine_key: Callable[[int, bytes], EngineBlockKey]) -> None:
        """The engine's block pool, for lazy offload; ``engine_key(group, block hash)`` is how the
        pool names a group's cached block."""
        self._pool = pool
        self._engine_key = engine_key

    @property
    def lazy_active(self) -> bool:
        return self.lazy is not None and self._pool is not None

    # -- requests ------------------------------------------------------------

    def track(self, req_id: str, salt: str = "", spans: Sequence[Span] = (), prompt_tokens: int = 0,
              expect_pages: int = 0) -> RequestState:
        """State of a request, created on first sight; ``salt`` isolates its keys (cache salt, LoRA);
        ``expect_pages``: pages a producer announced for it (a consumer waits for them, ``pd.wait``)."""
        st = self.requests.get(req_id)
        if st is None:
            ns = self.namespace if not salt else f"{self.namespace}\0{salt}"
            st = RequestState(req_id, SequenceKeys(KeySpace(self.model_id, ns), self.tpp, tuple(spans)))
            st.prompt_pages = prompt_tokens // self.tpp
            if expect_pages and self.role != "producer":
                st.expect_pages = expect_pages
                st.wait_until = time.monotonic() + self.pd.wait
            self.requests[req_id] = st
        return st

    def lookup(self, st: RequestState, tokens: Sequence[int], num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that lmkv can load (whole pages; never the last
        token), or None: not known yet (a network tier has not answered, or the pages a producer
        announced have not all landed); ask again next step."""
        max_pages = (len(tokens) - 1) // self.tpp  # the engine must compute at least one token
        local = num_computed_tokens // self.tpp
        st.local_pages = local
        if max_pages <= local or not self.groups or (self.role == "producer" and not self.pd.producer_loads):
            self._asking(st, len(tokens))
            return 0
        if st.expect_pages and time.monotonic() < min(st.next_poll, st.wait_until):
            return None  # (waiting for announced pages: not asking again yet)
        end = max_pages
        found: tuple[int, dict[str, int]] | Verdict
        unanswered = False  # (a network tier had not answered by the end of the wait)
        if self._lookups is None:
            found = self._find(st, tokens, local, end)
        else:
            patient = bool(st.expect_pages)  # (pages were promised: worth waiting for the network)
            found = self._lookups.result(st.req_id, (local, end), lambda: self._find(st, tokens, local, end),
                                         None if patient else lambda: self._find_local(st, tokens, local, end))
            if found is NOT_YET:
                unanswered = True
                if not (st.expect_pages and time.monotonic() >= st.wait_until):
                    return None
                self._lookups.forget(st.req_id)  # (the wait for announced pages bounds its lookup too)
                self.stats.lookups_timed_out += 1
                # the pages pulled into this engine as they landed are loaded (never from the tier
                # that did not answer: the load would wait for it as long)
                found = self._find_local(st, tokens, local, end)
        hit, below = (0, {}) if isinstance(found, Verdict) else found
        if isinstance(found, Verdict):  # TIMED_OUT: a miss
            self.stats.lookups_timed_out += 1
        if st.expect_pages:
            now = time.monotonic()
            if local + hit < min(st.expect_pages, end):
                if now < st.wait_until:  # a producer's pages are on their way: ask again soon
                    st.next_poll = now + min(POLL_MAX_S, POLL_FIRST_S * 2 ** st.polls)
                    st.polls += 1
                    if below:
                        self._pull(st, local, hit)
                    return None
                self.stats.handoffs_short += 1
                log.info("lmkv: request %s: %d of the %d pages its producer announced came within pd.wait (%.1f s, "
                         "%d polls%s); it computes the rest", st.req_id, local + hit, min(st.expect_pages, end),
                         self.pd.wait, st.polls, ", its last lookup unanswered" if unanswered else "")
            self.stats.handoff_wait_ms += round((now - st.wait_until + self.pd.wait) * 1000)
            st.expect_pages = 0  # (waited for once)
        st.async_load = self.loads_async(below)
        self.stats.lookups += 1
        self._asking(st, len(tokens))
        return hit * self.tpp

    def _asking(self, st: RequestState, tokens: int) -> None:
        """Lazy offload: a lookup answered, the engine may admit the request now; if it does not, the next
        step takes its blocks (those the engine does not hold)."""
        if self.lazy is not None:
            self._asked[st.req_id] = _pages(tokens, self.tpp) - st.local_pages

    def idle_wait(self) -> float:
        """How long a step that runs nothing may pause before the engine steps again: until the next
        poll of a consumer waiting for a producer's pages, or, for one whose lookup is out, until it
        answers (:meth:`pause_idle` wakes then); at most :data:`POLL_MAX_S`, 0 if none waits. An
        engine with requests steps in a tight loop even when none can run, and vLLM's scheduler and
        worker processes spin on each other's replies; while a consumer waits that loop takes the
        cores the producer's writes, the shared tier and this engine's own fetches need (measured
        on 2 cores: a 4 MiB-page prompt landed in 1.2-2 s instead of 0.2-0.5 s; a Redis
        write-through of 15 MiB took 0.28 s while a consumer's lookup was out)."""
        now = time.monotonic()
        asking = self._lookups.waiting() if self._lookups is not None else set()
        due = [st.wait_until if r in asking else min(st.next_poll, st.wait_until)
               for r, st in self.requests.items() if st.expect_pages]
        if not due or any(r not in self.requests or not self.requests[r].expect_pages for r in asking):
            return 0.0  # (another request waits for its lookup: it runs the moment the answer comes)
        return min(POLL_MAX_S, max(0.0, min(due) - now))

    def pause_idle(self, arrived: Callable[[], bool] | None = None) -> None:
        """Pause a step that runs nothing for :meth:`idle_wait`, waking early when a waiting
        consumer's lookup answers (its request then runs the next step) or, given ``arrived``
        (whether the engine has a new request to take in), when a request comes in: a request
        sent while a consumer waits is not held up by the pause (on a 50 ms request beside a
        hand-off over a stalled tier, a pause of up to 25 ms added 10-25%)."""
        end = time.monotonic() + self.idle_wait()
        while (left := end - time.monotonic()) > 0:
            if arrived is not None and arrived():
                return
            step = left if arrived is None else min(left, ARRIVAL_POLL_S)
            if self._lookups is not None:
                if self._lookups.wait_any(step):
                    return
            else:
                time.sleep(step)

    def _pull(self, st: RequestState, local: int, hit: int) -> None:
        """Plan the copy into memory of the promised pages that landed since the last poll: they
        come in while the rest land (one 4 MiB-page prompt takes ~0.1-1 s to land), and the load
        that follows reads them from memory. Pages a producer has yet to write are not asked for."""
        start = max(st.pulled, local)
        if hit + local <= start:
            return
        chains = st.seq.chains[start : local + hit]
        for g, layout in enumerate(self.groups):
            if layout.growth is not Growth.PER_SEQUENCE:
                st.pending_pulls.append(PageOp(st.req_id, g, list(chains), [], list(range(start, local + hit))))
        st.pulled = local + hit

    def _find(self, st: RequestState, tokens: Sequence[int], start: int, end: int,
              local: bool = False) -> tuple[int, dict[str, int]]:
        """How many of pages ``[start, end)`` of the request lmkv can restore, and the hit's bytes per
        tier below memory; ``local``: asking only the tiers in this process. Each group's lookup
        starts from the request's last one (:func:`lmkv.lookup.find_prefix`: a step asks the tiers
        only what changed) and hashes only as far as the prefix goes. (Off the scheduler's thread
        when a network tier is asked.)"""
        hit = end - start
        below: dict[str, int] = {}  # bytes of the hit per tier below memory
        for g, layout in enumerate(self.groups):
            if hit == 0:
                break
            if layout.growth is Growth.PER_SEQUENCE:
                continue  # state groups: after the pages, below
            keys_of = self._keys_of(st, tokens, layout)
            found, memo = self.store.find_prefix(keys_of, start, start + hit, None if local else st.memos.get(g),
                                                 local)
            if not local:
                st.memos[g] = memo
            hit = min(hit, found.pages)
            for tier, pages in found.per_tier(hit).items():
                if tier != "memory":
                    below[tier] = below.get(tier, 0) + pages * layout.payload_bytes
        hit = self._unquarantined(st.seq.chains, start, start + hit) - start
        for layout in self.groups:
            if hit and layout.growth is Growth.PER_SEQUENCE:
                # one state per stored boundary: the hit ends at the last boundary whose state is held
                hit = find_last(self._keys_of(st, tokens, layout), start, start + hit,
                                self.store.contains_local if local else self.store.contains) - start
        return hit, below

    @staticmethod
    def _keys_of(st: RequestState, tokens: Sequence[int], layout: GroupLayout) -> Callable[[int, int], list[PageKey]]:
        """The keys of a request's pages ``[a, b)`` in one group, its tokens hashed that far first."""
        def keys_of(a: int, b: int) -> list[PageKey]:
            st.seq.extend(tokens, b)
            return st.seq.keys(layout, a, b)
        return keys_of

    def _find_local(self, st: RequestState, tokens: Sequence[int], start: int, end: int) -> tuple[int, dict[str, int]]:
        """:meth:`_find` while the network is presumed stalled."""
        self.stats.lookups_local_only += 1
        return self._find(st, tokens, start, end, local=True)

    def loads_async(self, below: dict[str, int]) -> bool:
        """Whether a hit with ``below`` bytes on each tier under memory waits for its load instead of
        loading layer by layer in the step that computes the rest of its request.

        ``auto``: a layerwise load makes everyone in its step wait for layers that have not
        arrived, so it stays layerwise while its fetch (its bytes over each tier's measured read
        rate) fits in ``max_stall`` times the engine's step, or while nothing else runs (there is
        no one to wait: the fetch still overlaps the request's own compute, and the step it
        would wait for as an asynchronous load is saved). A tier not measured yet counts as
        fast: its first loads measure it. Memory hits always load layerwise."""
        if self.load_mode != "auto":
            return self.load_mode == "async"
        step = self.forward_s
        if not below or self.running == 0 or step is None:
            return False
        fetch = sum(nbytes / rate for tier, nbytes in below.items() if (rate := self.link_rates.get(tier)))
        return fetch > self.max_stall * step

    def observe(self, link_rates: dict[str, float], layer_compute_s: float | None) -> None:
        """The workers' latest measures (from their step reports); the copy-out rate and the forward's
        time set lazy offload's drain cap."""
        self.link_rates.update(link_rates)
        if layer_compute_s is not None:
            self.layer_compute_s = layer_compute_s
        copy, step = self.link_rates.get(COPY_OUT), self.forward_s
        if self.lazy is not None and copy is not None and step is not None:
            self.lazy.observe_copies(copy, step)

    @property
    def forward_s(self) -> float | None:
        """The forward's measured time: its time per layer x the model's layers (None: not measured)."""
        if self.layer_compute_s is None:
            return None
        return self.layer_compute_s * sum(lay.num_layers for lay in self.groups)

    def _unquarantined(self, chains: Sequence[ChainHash], start: int, end: int) -> int:
        """The first page in ``[start, end)`` whose load failed recently (or ``end``)."""
        if not self._quarantine:
            return end
        now = time.monotonic()
        self._quarantine = {c: t for c, t in self._quarantine.items() if t > now}
        return next((p for p in range(start, end) if chains[p] in self._quarantine), end)

    def quarantine(self, chains: Iterable[ChainHash]) -> None:
        """Pages whose load failed: not offered again for a while, so a retry recomputes them."""
        until = time.monotonic() + self.quarantine_seconds
        for c in chains:
            self._quarantine[c] = until

    def allocated(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """The engine gave the request its blocks; plan the load of ``num_external_tokens``."""
        self._asked.pop(req_id, None)
        st = self.requests.get(req_id)
        if st is None:
            return
        n = num_external_tokens // self.tpp
        first = st.local_pages
        st.pending_loads = []
        if n:
            st.pending_loads = []
            for g, layout in enumerate(self.groups):
                if layout.growth is Growth.PER_SEQUENCE:  # the state at the hit's last boundary
                    bid = _state_block(block_ids[g])
                    if bid is not None:
                        p = first + n - 1
                        st.pending_loads.append(PageOp(req_id, g, [st.seq.chains[p]], [bid], [p]))
                    continue
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
            if st.async_load:
                self.stats.async_loads += 1
            else:
                self.stats.layerwise_loads += 1
        st.stored_upto = max(st.stored_upto, first + n)
        st.seen = max(st.seen, first + n)
        st.restorable = max(st.restorable, first + n)
        st.hit_pages = first + n

    # -- per step ------------------------------------------------------------

    def build_plan(self, scheduled: Iterable[Scheduled],
                   block_ids_of: Callable[[str], Sequence[Sequence[int]]]) -> StepPlan:
        """Loads allocated since the last step, and stores of every page this step completes."""
        plan = StepPlan()
        scheduled = list(scheduled)
        self.running = len(scheduled)
        for lease in self._released_next:  # the step that loaded them has run
            lease.release()
        self._released_next = []
        for waiting in self.requests.values():
            if waiting.pending_loads and waiting.async_load:  # these wait for their load instead of running
                plan.async_loads.extend(waiting.pending_loads)
                waiting.pending_loads = []
            plan.pulls.extend(waiting.pending_pulls)
            waiting.pending_pulls = []
        planned: set[PageKey] = set()  # two requests completing the same page in one step store it once
        lazy = self.lazy_active
        allocated = 0  # lazy offload: blocks the engine handed out this step
        demand = 0  # lazy offload: blocks the engine will hand out next step, as far as is known now
        for s in scheduled:
            st = self.requests.get(s.req_id)
            if st is None:
                continue
            plan.loads.extend(st.pending_loads)
            st.pending_loads = []
            self._released_next.extend(st.pins)
            st.pins = []
            full = min(s.computed_after_step, len(s.tokens)) // self.tpp
            if lazy:
                allocated += _pages(s.computed_after_step, self.tpp) - _pages(st.computed, self.tpp)
                demand += _next_pages(s.computed_after_step, st.computed, len(s.tokens), self.tpp)
            st.computed = s.computed_after_step
            if full > st.seen:
                st.seen = full
                st.seq.extend(s.tokens, full)
                if lazy:
                    self._remember(st, s.block_hashes, full)
                blocks = block_ids_of(s.req_id)
                # With state groups (Mamba), a page can be restored only with a state at or after it:
                # pages are stored up to the last boundary a state was kept at, never beyond.
                upto = full
                first = self._stores_from(st)
                if self._state_groups:
                    if s.computed_after_step == full * self.tpp and full % self._state_every == 0:
                        st.restorable = full
                        for g in self._state_groups if first is not None and full > first else ():
                            op = self._state_op(st, g, self.groups[g], full, blocks[g], plan)
                            if op is not None:
                                plan.stores.append(op)
                    upto = st.restorable
                if not lazy and first is not None and upto > first:
                    for g, layout in enumerate(self.groups):
                        if layout.growth is not Growth.PER_SEQUENCE:
                            op = self._store_op(st, g, layout, first, upto, blocks[g], planned)
                            if op is not None:
                                plan.stores.append(op)
                st.stored_upto = max(st.stored_upto, full if lazy else upto)
        if lazy:
            ran = {s.req_id for s in scheduled}
            demand += sum(n for r, n in self._asked.items() if r not in ran)  # looked up, not admitted
            self._lazy_stores(max(0, allocated), demand, plan)
        self._asked.clear()
        return plan

    # -- lazy offload ----------------------------------------------------------

    def _remember(self, st: RequestState, block_hashes: Sequence[bytes], full: int) -> None:
        """Name the engine's blocks of a request's pages (so a planned block maps to a page key)
        and tell the policy the chain; a request's first report counts as a use of its prefix."""
        assert self.lazy is not None
        for g, eks in self._engine_chains(block_hashes[:full]):
            for p in range(st.stored_upto, len(eks)):
                self._engine_pages[eks[p]] = (g, st.seq.chains[p])
                self._engine_pages.move_to_end(eks[p])
            self.lazy.note_chain(eks, used=not st.noted, cached=st.local_pages)
            self.lazy.note_computed(eks[st.stored_upto:])
        st.noted = True
        while len(self._engine_pages) > self.lazy.cfg.chain_memory:
            self._engine_pages.popitem(last=False)

    def _engine_chains(self, block_hashes: Sequence[bytes]) -> Iterator[tuple[int, list[EngineBlockKey]]]:
        """The engine's block keys of a request's full blocks, per cache group whose blocks sit in the
        free queue (one state per sequence is stored when computed, not lazily)."""
        assert self._engine_key is not None
        for g, layout in enumerate(self.groups):
            if layout.growth is not Growth.PER_SEQUENCE:
                yield g, [self._engine_key(g, h) for h in block_hashes]

    def _engine_resident(self, engine_hash: EngineBlockKey) -> bool:
        """Whether lmkv holds the page in an engine block (a block lmkv cannot name counts as held:
        it is never planned)."""
        gc = self._engine_pages.get(engine_hash)
        if gc is None:
            return True
        g, chain = gc
        return self.store.contains_local([page_key(chain, self.groups[g])])[0]

    def _lazy_stores(self, allocated: int, demand: int, plan: StepPlan) -> None:
        """Release last step's copies (the workers ran them), then plan this step's (``demand``: the
        blocks the next step is known to take): blocks the step handed out go to ``plan.rescues``
        (copied before the forward), the rest to ``plan.stores``."""
        assert self.lazy is not None and self._pool is not None
        self.lazy.done(self._inflight)
        self.lazy.note_step(allocated)
        self.lazy.note_demand(demand)
        self._inflight = self.lazy.plan(self._pool)
        by_group: dict[tuple[bool, int], tuple[list[ChainHash], list[int]]] = {}
        for p in self._inflight:
            g, chain = self._engine_pages[p.block_hash]
            chains, blocks = by_group.setdefault((p.rescue, g), ([], []))
            chains.append(chain)
            blocks.append(p.block_id)
        self.stats.stored_pages += len(self._inflight)
        for (rescue, g), (chains, blocks) in sorted(by_group.items()):
            (plan.rescues if rescue else plan.stores).append(PageOp("", g, chains, blocks, []))

    def _state_op(self, st: RequestState, g: int, layout: GroupLayout, full: int, blocks: Sequence[int],
                  plan: StepPlan) -> PageOp | None:
        """A state group's page: the state as of page boundary ``full``, where this step ended (one that
        ``offload.state_every_pages`` keeps), unless a tier holds it already; with ``state_retention:
        latest`` the request's previous one is dropped."""
        bid = _state_block(blocks)
        key = st.seq.keys(layout, full - 1, full)[0]
        if bid is None or self.store.contains_local([key])[0]:
            return None
        if self.offload is not None and self.offload.state_retention == "latest" and st.state_page is not None:
            plan.drops.append(PageOp(st.req_id, g, [st.seq.chains[st.state_page]], [], [st.state_page]))
        st.state_page = full - 1
        self.stats.stored_pages += 1
        return PageOp(st.req_id, g, [st.seq.chains[full - 1]], [bid], [full - 1])

    def _store_op(
        self, st: RequestState, g: int, layout: GroupLayout, start: int, end: int,
        blocks: Sequence[int], planned: set[PageKey],
    ) -> PageOp | None:
        keys = st.seq.keys(layout, start, end)
        # (pages past a lookup's hit were in no tier then: a network tier is not asked again here)
        resident = self.store.contains_local(keys)
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

    def announced(self, req_id: str) -> int:
        """A producer's word to its consumer: the pages of this request's prompt it committed or is
        committing (0 for other roles). Asked as the request finishes, before :meth:`finish`."""
        st = self.requests.get(req_id)
        if self.role != "producer" or st is None:
            return 0
        return min(st.stored_upto, st.prompt_pages)

    def _stores_from(self, st: RequestState) -> int | None:
        """The first page of a request this engine stores (None: none): a consumer never stores its
        prompt's pages (it computed them only because they did not come), and its decoded ones
        only with ``pd.consumer_stores_decoded``."""
        if self.role != "consumer":
            return st.stored_upto
        return max(st.stored_upto, st.prompt_pages) if self.pd.consumer_stores_decoded else None

    def close(self) -> None:
        """Stop the lookup threads (a lookup in flight is not waited for)."""
        if self._lookups is not None:
            self._lookups.close()

    def finish(self, req_id: str, block_hashes: Sequence[bytes] = ()) -> bool:
        """Compute finished (``block_hashes``: the engine's hash of each of the request's full blocks, its
        answer's included, for lazy offload's reuse estimate); returns whether the engine must hold the
        request's blocks.

        The request's last full page was planned in the step that computed it and
        copied out before that step ended, so stores never need the blocks held. (A
        request aborted during an asynchronous load keeps its blocks until the workers
        report the load finished: vLLM itself holds those.)
        """
        st = self.requests.pop(req_id, None)
        if self._lookups is not None:
            self._lookups.forget(req_id)
        if st is not None:
            for lease in st.pins:
                lease.release()
            if self.lazy_active and st.noted:
                assert self.lazy is not None
                for _, eks in self._engine_chains(block_hashes):
                    self.lazy.note_finished(eks)
        return False
