"""Eviction-aware lazy offload (DESIGN.md mechanism 1): copy a cached block out only when the
engine is about to reuse its memory.

An engine keeps finished requests' blocks in an LRU free queue: the head is reused
first. Writing every computed block to lmkv (eager write-through) spends copy
bandwidth on blocks that are revived by a prefix hit or never evicted at all.
The lazy policy looks only at the *danger zone* at the head of the queue:

- **danger depth** = EMA of blocks allocated per step x ``horizon_steps`` + the next
  step's known demand + ``watermark_blocks``: what the engine will take before
  the copies planned now have finished;
- **rescue**: a step that takes more than that (a burst of long new prompts) takes
  cached blocks the zone did not reach. The engine hands them to the step's requests,
  but their bytes stay as they were until the step's forward writes them, so the
  step's plan copies the ones worth keeping *before* that forward (the worker does it
  first thing, ahead of any load). These copies are on the forward's critical path, the
  zone's are not: the zone does the steady work, a rescue catches what a burst takes
  (measured on the mixed traces: 5% of the pages copied). Judging a block when it is
  lost, not ahead of a burst that may not come, also copies fewer: a block judged later
  has been idle longer. With a declared link there is no rescue: the link is the
  bottleneck, and a copy that the forward must wait for would wait behind its queue
  (measured: rescues under a link at half eager's rate lost 1.16x as many blocks on one
  seed of four, no fewer on the others). The largest burst lately (as many cached
  blocks as it took, fading over a few hundred steps) is due ahead of it instead;
- **snapshot**: a planned block's hash is recorded when it is chosen, and the block
  is **protected** (pulled out of the free queue) until its copy is done, so the
  engine cannot hand it out and the copy can never store stale bytes;
- **prefix closure**: a page is only useful if every page before it in its chain is
  reachable too, so a block's cached ancestors that lmkv lacks are copied first, and
  a block whose ancestor is gone from both the engine and lmkv is not copied at all;
  the walk up stops at an ancestor a running request holds (a shared system prompt):
  it is not at risk, and it is judged like any block once freed and near reuse;
- **drain cap**: at most ``drain_bytes_per_step`` are planned per step (on average: a
  fraction of a page is carried over to the next step), the blocks
  nearest the head first (the first to be lost); while the cap binds, the zone grows
  (up to ``1 + LOOKAHEAD_GAIN`` times: in effect the whole queue), so copies start
  earlier and use the link's idle steps instead of losing blocks at the head; the walk
  stops where the step's copies are planned, so a deep zone costs only what is used.
  (Taking the most-used prefixes first instead lost 1.14x as many blocks under a tight
  link: a much-used block is often one that its requests are done with, such as a
  document after its last question.)
- **families**: requests that start with the same page (one application's system
  prompt) behave alike. A family whose requests, after ``min_family_requests`` of
  them, almost never repeat most of an earlier prompt (a stream of one-shot
  prompts) has its blocks skipped: copying them would be wasted. Repetition is
  judged on what was seen, not on what was served from cache, so skipping copies
  can never make a family look one-shot;
- **need estimate**: without a declared link, a due block is skipped when blocks like
  it (as often used; in an agent-like session, a document-like one, or a single
  request; as long idle) were needed again from a tier less often than
  ``min_need_rate``, learned from what came back (:mod:`lmkv.offload.reuse`): a question's
  tail is never asked again. A block of an agent-like session is also skipped when
  sessions idle as long as it has been seldom got another turn (learned from every
  session's gaps between turns): its session has ended. A block only one request used
  in a lineage that branches (a question's tail or answer: the next question leaves
  it) is skipped when such lineages seldom continued their latest request; copying it
  would copy the document's body with it, by prefix closure, long before the body
  itself is due (a body the engine may keep until its next question).

Only the danger zone is walked each step (O(depth), not O(blocks)), and only until the
step's copies are planned. The engine side is the :class:`FreeQueue` protocol;
:mod:`lmkv.connectors.vllm_pool` implements it on vLLM's ``BlockPool``.

Rules of this module:

1. It decides which blocks are copied and when; it touches neither bytes nor tiers. What
   lmkv holds it learns only through ``in_tier``; the copies are the workers' (a plan).
2. It knows blocks by the engine's keys (:data:`~lmkv.keys.EngineBlockKey`) and ids; the
   scheduler maps them to page keys.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from lmkv.config import OffloadConfig
from lmkv.keys import EngineBlockKey
from lmkv.offload.reuse import ReuseModel


class FreeQueue(Protocol):
    """What the policy needs from an engine's block pool."""

    def iter_free(self) -> Iterator[tuple[int, EngineBlockKey | None]]:
        """Free blocks in eviction order (next to be reused first): (block id, hash or None)."""

    def cached_block(self, block_hash: EngineBlockKey) -> int | None:
        """The block that holds ``block_hash`` in the engine's cache, if any."""

    def block_hash(self, block_id: int) -> EngineBlockKey | None: ...

    def held(self, block_id: int) -> bool:
        """Whether a running request holds the block (it is out of the free queue)."""

    def protect(self, block_ids: Sequence[int]) -> None:
        """Keep these blocks from being reused until :meth:`release`."""

    def release(self, block_ids: Sequence[int], first: bool) -> None:
        """Let these blocks be reused again, in this order; ``first``: before every other free block
        (their bytes are in lmkv now), else after them (as if freed just now)."""

    def take_reused(self) -> list[tuple[int, EngineBlockKey]]:
        """Cached blocks the engine handed out since the last call, each with the hash it held, in
        order. Their bytes stay as they were until the step's forward writes them, so a copy made
        before that forward is not stale."""


#: how much further ahead the policy looks when its drain cap is always binding (under half of
#: eager's link rate: 0.71x eager's losses at 32, 0.67x at 128, 0.65x at 512)
LOOKAHEAD_GAIN = 512.0

#: how fast the remembered largest burst fades, per step (half-life ~230 steps)
BURST_DECAY = 0.997


@dataclass
class CopyBudget:
    """A copy link's bytes per step, kept on average when they are not a whole number of pages: the
    fraction left is carried over (at most one page beyond a step's bytes, so an idle link does not
    bank time), so 1.5 pages a step copies 1, 2, 1, 2 pages rather than 1 each step."""

    bytes_per_step: int
    page_bytes: int
    credit: int = 0

    def refill(self) -> int:
        """A new step: the whole pages that may be copied in it."""
        self.credit = min(self.credit + self.bytes_per_step, self.bytes_per_step + self.page_bytes)
        return self.credit // self.page_bytes

    def spend(self, pages: int) -> None:
        self.credit -= pages * self.page_bytes


@dataclass(frozen=True)
class Pick:
    """A block chosen for a copy, with its hash as it was when chosen (the snapshot)."""

    block_id: int
    block_hash: EngineBlockKey
    due: bool = True  # about to be reused, or an ancestor copied for one (not a lookahead pick or an early copy)
    rescue: bool = False  # handed out this step: copied before the step's forward, never protected or released


@dataclass
class LazyStats:
    planned: int = 0
    closure_added: int = 0
    unreachable: int = 0
    capped_steps: int = 0
    filled: int = 0  # early copies of fresh blocks in steps the zone left link time idle
    unlikely: int = 0  # due blocks not copied: blocks like them were seldom needed again
    rescued: int = 0  # blocks copied in the step that handed them out, before its forward


class LazyOffload:
    """Plans, step by step, which cached blocks in the free queue to copy before they are reused.

    The invariant that keeps a copy from ever storing stale bytes: a block planned in the
    zone is protected (out of the free queue, in :attr:`inflight`) from :meth:`plan` until
    :meth:`done`, so the engine cannot hand it out while its copy is pending. Rescued blocks
    are the exception by construction: the engine has handed them out already, they are never
    protected or released, and their copy is made before the step's forward writes them.
    """

    def __init__(self, cfg: OffloadConfig, page_bytes: int, in_tier: Callable[[EngineBlockKey], bool]) -> None:
        self.cfg = cfg
        #: a declared link budget: keep the link busy with early copies (see OffloadConfig)
        link = cfg.link_bytes_per_step
        self.link_bound = link is not None
        self.budget = CopyBudget(int(link if link is not None else cfg.drain_bytes_per_step), page_bytes)
        self.in_tier = in_tier
        self.alloc_ema = 0.0
        #: with a declared link: the most blocks one step took lately, and the most cached ones among them
        #: (fading); a burst of new prompts takes far more than the average step, and the link cannot copy
        #: it in the step that takes it, so blocks within a burst's reach are due ahead of it
        self.burst = 0.0
        self.burst_evicted = 0.0
        self._binding = 0.0  # how often the drain cap has been binding lately (EMA of 0/1)
        self.inflight: dict[EngineBlockKey, int] = {}  # hash -> protected block id
        self._parent: OrderedDict[EngineBlockKey, EngineBlockKey | None] = OrderedDict()
        self.reuse = ReuseModel(remembered=max(1, cfg.chain_memory // 16))
        #: without a declared link, bytes are the cost: blocks unlikely to be needed are not copied
        #: (with one, the link's time is spent anyway, on the blocks nearest eviction)
        self.estimating = not self.link_bound and cfg.min_need_rate > 0
        self._step = 0
        self._fresh: deque[EngineBlockKey] = deque(maxlen=cfg.chain_memory)  # computed blocks, oldest first
        self.stats = LazyStats()

    # -- what the engine tells the policy ---------------------------------------

    def note_chain(self, hashes: Sequence[EngineBlockKey], used: bool = True, cached: int = 0) -> None:
        """A request's chain of block hashes, first page first: parent links, and (``used``: a request
        was admitted with it, the engine holding its first ``cached`` pages) what the request shows
        about reuse (:class:`lmkv.offload.reuse.ReuseModel`)."""
        if not hashes:
            return
        self._link(hashes)
        if used:
            self.reuse.note_request(hashes, cached, self._step)
        else:
            self.reuse.touch(hashes, self._step)

    def note_finished(self, hashes: Sequence[EngineBlockKey]) -> None:
        """A request finished with this chain (the pages its answer filled included)."""
        if hashes:
            self._link(hashes)
            self.reuse.finish(hashes, self._step)

    def _link(self, hashes: Sequence[EngineBlockKey]) -> None:
        """Remember each page's parent (for prefix closure), the least recently seen forgotten first."""
        prev: EngineBlockKey | None = None
        cap = self.cfg.chain_memory
        for h in hashes:
            if h in self._parent:
                self._parent.move_to_end(h)
            else:
                self._parent[h] = prev
                self.reuse.note_block(h, hashes[0])
                if len(self._parent) > cap:
                    old, _ = self._parent.popitem(last=False)
                    self.reuse.forget(old)
            prev = h

    def note_computed(self, hashes: Sequence[EngineBlockKey]) -> None:
        """Blocks the engine just computed (candidates for early copies on a declared link)."""
        if self.link_bound:
            self._fresh.extend(hashes)

    def _one_shot(self, h: EngineBlockKey) -> bool:
        """Whether ``h``'s family almost never repeats what came before (one-shot prompts)."""
        return self.reuse.one_shot(h, self.cfg.min_family_requests, self.cfg.min_reuse_rate)

    def note_step(self, blocks_allocated: int) -> None:
        self._step += 1
        a = self.cfg.ema_alpha
        self.alloc_ema = (1 - a) * self.alloc_ema + a * blocks_allocated
        if self.link_bound:
            self.burst = max(float(blocks_allocated), self.burst * BURST_DECAY)

    def danger_depth(self, next_demand: int) -> int:
        return math.ceil(self.alloc_ema * self.cfg.horizon_steps) + next_demand + self.cfg.watermark_blocks

    # -- planning ----------------------------------------------------------------

    def _closure(self, h: EngineBlockKey, pool: FreeQueue, chosen: set[EngineBlockKey],
                 gone: dict[EngineBlockKey, int] | None = None) -> list[Pick] | None:
        """``h`` and its cached ancestors lmkv lacks, up to one a running request holds, oldest first;
        None if the chain is broken. ``gone``: blocks handed out this step (hash -> block id), whose
        bytes are still there until the step's forward: they are rescued."""
        out: list[Pick] = []
        cur: EngineBlockKey | None = h
        while cur is not None and not (self.in_tier(cur) or cur in self.inflight or cur in chosen):
            bid = pool.cached_block(cur)
            if bid is not None:
                if cur != h and pool.held(bid):
                    break  # a running request holds it (and the pages before it): not at risk now
                out.append(Pick(bid, cur))
            elif gone is not None and cur in gone:
                out.append(Pick(gone[cur], cur, rescue=True))
            else:
                return None  # an ancestor is neither in the engine nor in lmkv: unreachable
            if cur not in self._parent:
                break  # the chain's start (or a link we no longer remember: treat it as the start)
            cur = self._parent[cur]
        out.reverse()
        return out

    def plan(self, pool: FreeQueue, next_demand: int = 0) -> list[Pick]:
        """The copies to start this step: without a declared link, blocks the step handed out that are
        worth their bytes (rescued: copied before the step's forward); then blocks near the queue's
        head (protected until :meth:`done`)."""
        reused = pool.take_reused()
        if self.link_bound:
            self.burst_evicted = max(float(len(reused)), self.burst_evicted * BURST_DECAY)
        if self.estimating:
            self.reuse.settle(self._step)
        budget = self.budget.refill()
        if budget == 0:
            return []  # a link slower than a page a step: this step's share is carried over
        picks: list[Pick] = []
        chosen: set[EngineBlockKey] = set()
        if not self.link_bound:  # (a declared link is busy: a copy before the forward would stall it)
            self._add(picks, chosen, budget, pool, self._rescues(reused, pool), {h: b for b, h in reused})
        # When the cap has been binding, look further ahead: copies must start earlier to finish in time.
        due_depth = self.danger_depth(next_demand)
        depth = int(due_depth * (1 + LOOKAHEAD_GAIN * self._binding))
        if len(picks) < budget:
            self._add(picks, chosen, budget, pool, self._zone(pool, depth, due_depth), None)
        if self.link_bound:
            self._fill(pool, picks, chosen, budget)
        self._binding = 0.9 * self._binding + 0.1 * (len(picks) >= budget)
        self.budget.spend(len(picks))
        if picks:
            pool.protect([p.block_id for p in picks if not p.rescue])
            for p in picks:
                self.inflight[p.block_hash] = p.block_id
            self.stats.planned += len(picks)
            self.stats.rescued += sum(p.rescue for p in picks)
        return picks

    def _rescues(self, reused: list[tuple[int, EngineBlockKey]],
                 pool: FreeQueue) -> Iterator[tuple[EngineBlockKey, bool]]:
        """The blocks handed out this step worth copying (judged as a due block would be)."""
        for _, h in reused:
            # (a page cached again in another block: a request allocated the same page, not computed yet)
            if pool.cached_block(h) is None and self._worth(h):
                yield h, True

    def _worth(self, h: EngineBlockKey) -> bool:
        """Whether a block about to be lost is worth its copy: lmkv lacks it, no copy of it is in flight,
        its family repeats itself, and (without a declared link) blocks like it were needed often enough."""
        if self.in_tier(h) or h in self.inflight or self._one_shot(h):
            return False
        if self.estimating and self._unlikely(h):
            self.stats.unlikely += 1
            return False
        return True

    def _add(self, picks: list[Pick], chosen: set[EngineBlockKey], budget: int, pool: FreeQueue,
             wanted: Iterator[tuple[EngineBlockKey, bool]], gone: dict[EngineBlockKey, int] | None) -> None:
        """Plan ``wanted`` blocks with their prefix closure, in order, until the budget is spent."""
        for h, due in wanted:
            if h in chosen:
                continue
            chain = self._closure(h, pool, chosen, gone)
            if chain is None:
                self.stats.unreachable += 1
                continue
            room = budget - len(picks)
            if room <= 0:
                self.stats.capped_steps += 1
                return
            if len(chain) > room:  # the chain's oldest pages first: a prefix is useful on its own
                chain = chain[:room]
                self.stats.capped_steps += 1
            self.stats.closure_added += max(0, len(chain) - 1)
            for p in chain:
                picks.append(replace(p, due=due))
                chosen.add(p.block_hash)
                if self.estimating and p.block_hash != h:
                    self.reuse.watch(p.block_hash, self._step)  # its outcome teaches the estimate too
            if len(picks) >= budget:
                return

    def _with_lineage(self, h: EngineBlockKey) -> EngineBlockKey:
        """``h``, or if it is in no lineage (decoding filled it: it is its chain's first block to be
        evicted and, through prefix closure, decides for the whole chain) its nearest ancestor that is."""
        cur: EngineBlockKey | None = h
        while cur is not None and not self.reuse.in_lineage(cur):
            cur = self._parent.get(cur)
        return h if cur is None else cur

    def _unlikely(self, h: EngineBlockKey) -> bool:
        """Whether blocks like ``h`` were seldom needed again, or its agent-like session has likely
        ended (asked only when the first does not already say so: it walks to a lineage)."""
        rate = self.cfg.min_need_rate
        need = self.reuse.watch(h, self._step)
        if need is not None and need < rate:
            return True
        at = self._with_lineage(h)
        turn = self.reuse.another_turn(at, self._step)
        if turn is not None and turn < rate:
            return True
        cont = self.reuse.continued(h, at)
        return cont is not None and cont < rate

    def _zone(self, pool: FreeQueue, depth: int, due_depth: int) -> Iterator[tuple[EngineBlockKey, bool]]:
        """Blocks worth copying within ``depth`` of the queue's head (with a declared link, also the cached
        blocks a burst like the largest lately would take), nearest first, each with whether it is due or
        only looked ahead at. A generator: the walk stops where the step's copies are planned, so a deep
        lookahead costs only what is used of it."""
        reach, evicts, cached = 0, 0, 0
        if self.link_bound:
            reach = math.ceil(self.burst) + self.cfg.watermark_blocks
            evicts = math.ceil(self.burst_evicted) + (self.cfg.watermark_blocks if self.burst_evicted >= 1 else 0)
        for i, (_, h) in enumerate(pool.iter_free()):
            in_burst = cached < evicts and i < reach
            if i >= depth and not in_burst:
                return
            if h is None:
                continue
            cached += 1
            if self._worth(h):
                yield h, i < due_depth or in_burst

    def _fill(self, pool: FreeQueue, picks: list[Pick], chosen: set[EngineBlockKey], budget: int) -> None:
        """The link is the bottleneck: the budget the danger zone leaves this step goes to the oldest
        freshly computed blocks, as eager would copy them, skipping one-shot families; copies made
        now are blocks the zone will not have to rush later."""
        while self._fresh and len(picks) < budget:
            h = self._fresh.popleft()
            if self.in_tier(h) or h in self.inflight or h in chosen or self._one_shot(h):
                continue
            bid = pool.cached_block(h)
            if bid is None:
                continue  # gone from the engine: nothing to copy
            picks.append(Pick(bid, h, due=False))
            chosen.add(h)
            self.stats.filled += 1

    def done(self, picks: Sequence[Pick], pool: FreeQueue) -> None:
        """The copies of ``picks`` finished (or failed): their blocks may be reused again."""
        for p in picks:
            self.inflight.pop(p.block_hash, None)
        # Deepest pages first, like an engine freeing a request: a chain's first page, which every
        # later one needs for a prefix hit in the engine, is reused last. Blocks that were due go
        # first in line (with the ancestors copied for them); lookahead picks and early copies were not
        # near eviction and go back behind. Rescued blocks belong to the step's requests: not ours to release.
        pool.release([p.block_id for p in reversed(picks) if p.due and not p.rescue], first=True)
        pool.release([p.block_id for p in reversed(picks) if not p.due], first=False)
