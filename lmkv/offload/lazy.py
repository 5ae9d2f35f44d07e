"""Eviction-aware lazy offload: copy a cached block out only when the engine is about to reuse
its memory (``offload.policy: lazy``; the design and its figures: docs/design/lazy-offload.md).

An engine keeps finished requests' blocks in an LRU free queue, the head reused first. Each step
the policy walks the *danger zone* at the head and plans copies of the cached blocks there that
lmkv lacks, nearest the head first, within a drain cap of link time. Without a declared link the
zone is just in time: the blocks the next step takes (what the engine knows of it, plus the
largest share of new requests a step took lately), so a block is copied in the step before its
memory is reused, not while a prefix hit may still revive it; its chain's earlier blocks, which
the engine evicts after it, are copied when they come due. A step that takes more than the zone
covered has the blocks it took copied before its forward writes them (rescues). A due block is
skipped only where its class's need rate is below ``min_need_rate`` at 95% confidence
(:mod:`lmkv.offload.need`); under a declared link, the link's time goes to the due blocks most
likely needed, and one-shot families wait.

Rules of this module:

1. It decides which blocks are copied and when; it touches neither bytes nor tiers. What
   lmkv holds it learns only through ``in_tier``; the copies are the workers' (a plan).
2. It knows blocks by the engine's keys (:data:`~lmkv.keys.EngineBlockKey`) and ids; the
   scheduler maps them to page keys.
3. It never moves a block in the engine's free queue: a planned block is copied in the step that
   plans it, so no copy can store stale bytes and the engine evicts what it would without lmkv.
4. Prefix closure: a block is copied only if every block before it in its chain is held, being
   copied, or (without a declared link) still in the engine and owed a copy when it comes due,
   whatever the need estimate says then (an orphan page can never be hit); a block whose hash
   changed since it was noted is never written.
5. Only the zone is walked each step (O(depth), not O(blocks)), and only until the step's copies
   are planned.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from lmkv.config import OffloadConfig
from lmkv.keys import EngineBlockKey
from lmkv.offload.reuse import ReuseModel


class FreeQueue(Protocol):
    """What the policy needs from an engine's block pool."""

    def iter_free(self, limit: int, start: int | None = None, at: int = 0) -> Iterator[tuple[int, int, EngineBlockKey]]:
        """The cached blocks among the first ``limit`` free blocks in eviction order (next to be reused
        first): (position in the queue, block id, hash). Never-used blocks are passed over in the
        engine's own loop: a large pool's head holds thousands of them. ``start``: begin at this block
        (neither held nor handed out since it was seen in the queue), counting it at position ``at``,
        instead of at the head (where a block out of the queue is asked for)."""

    def cached_block(self, block_hash: EngineBlockKey) -> int | None:
        """The block that holds ``block_hash`` in the engine's cache, if any."""

    def block_hash(self, block_id: int) -> EngineBlockKey | None: ...

    def held(self, block_id: int) -> bool:
        """Whether a running request holds the block (it is out of the free queue)."""

    def head_shift(self) -> int:
        """Blocks that came to the head of the queue since the last call, less those taken from it (the
        engine puts blocks without a hash back at the head, to be reused first)."""

    def take_reused(self) -> list[tuple[int, EngineBlockKey]]:
        """Cached blocks the engine handed out since the last call, each with the hash it held, in
        order. Their bytes stay as they were until the step's forward writes them, so a copy made
        before that forward is not stale."""


#: how much further ahead the policy looks when its drain cap is always binding (under half of
#: eager's link rate: 0.71x eager's losses at 32, 0.67x at 128, 0.65x at 512)
LOOKAHEAD_GAIN = 512.0

#: with a declared link, how many steps of its budget of due blocks are ranked by need together (on the
#: Mooncake trace / the generator under a link at half eager's rate, lost blocks against eager's: 4 steps
#: 0.70x / 0.64x, 16 steps 0.65x / 0.62x, 64 steps 0.66x / 0.59x at 1.4x the run time; the zone's order
#: alone 0.76x / 0.64x). (Scheduling them by deadline instead, the exact greedy for copies that each
#: must be made before the engine reaches the block at its mean rate, lost 0.75x / 0.64x: later steps'
#: link time, which that schedule counts on, goes to the blocks that come due meanwhile and to bursts.)
NEED_WINDOW = 16

#: how fast the remembered largest burst (with a declared link: of allocations; without: of allocations
#: beyond what was known of the step) fades, per step (half-life ~230 steps)
BURST_DECAY = 0.997

#: a drain cap not measured yet
UNBOUNDED = 1 << 62


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
        self.credit = max(0, self.credit - pages * self.page_bytes)


@dataclass(frozen=True)
class Pick:
    """A block chosen for a copy, with its hash as it was when chosen (the snapshot)."""

    block_id: int
    block_hash: EngineBlockKey
    rescue: bool = False  # handed out this step: copied before the step's forward (the others during it)


@dataclass
class _Mark:
    """With a declared link: a cached block in the free queue before which no cached block was worth a copy
    when a walk judged it, where the next walk starts (:meth:`LazyOffload._resume`)."""

    block_id: int
    block_hash: EngineBlockKey
    position: int  # in the queue (moved by what came to and went from the head since it was seen)
    cached: int  # cached blocks before it
    #: the verdicts the blocks passed rest on besides lmkv holding them: (family, class) of each passed
    #: because its family looks one-shot; the mark stands while every family still does and no class was
    #: shown needed since
    one_shot: set[tuple[EngineBlockKey, tuple]]


@dataclass
class LazyStats:
    """Lazy offload's decisions, by kind (planned, rescued, unlikely, unreachable, ...)."""

    planned: int = 0
    closure_added: int = 0
    unreachable: int = 0
    capped_steps: int = 0
    filled: int = 0  # early copies of fresh blocks in steps the zone left link time idle
    unlikely: int = 0  # due blocks not copied: blocks like them were seldom needed again (95% bound)
    rescued: int = 0  # blocks copied in the step that handed them out, before its forward


class LazyOffload:
    """Plans, step by step, which cached blocks in the free queue to copy before they are reused.

    The invariant that keeps a copy from ever storing stale bytes: every copy planned in a step is
    made before the engine's next forward can write its block. A block planned in the zone is still
    in the free queue, so no request of this step holds it and only a later step's forward can
    write it: the workers copy it during this step's forward. A rescued block was handed out this
    step: the workers copy it before this step's forward. So the policy never pulls a block out of
    the free queue, and the engine's own cache is exactly what it would be without offload. A
    planned block stays in :attr:`inflight` until :meth:`done` (its page is in lmkv by then).
    """

    def __init__(self, cfg: OffloadConfig, page_bytes: int, in_tier: Callable[[EngineBlockKey], bool]) -> None:
        self.cfg = cfg
        #: a declared link budget: keep the link busy with early copies (see OffloadConfig)
        link = cfg.link_bytes_per_step
        self.link_bound = link is not None
        fixed = link if link is not None else cfg.drain_bytes_per_step
        #: the drain cap; without a fixed one, unbounded until :meth:`observe_copies` measures the link
        self.budget = CopyBudget(int(fixed) if fixed is not None else UNBOUNDED, page_bytes)
        self.measured_cap = fixed is None
        self.in_tier = in_tier
        self.alloc_ema = 0.0
        #: with a declared link: the most blocks one step took lately, and the most cached ones among them
        #: (fading); a burst of new prompts takes far more than the average step, and the link cannot copy
        #: it in the step that takes it, so blocks within a burst's reach are due ahead of it
        self.burst = 0.0
        self.burst_evicted = 0.0
        self._binding = 0.0  # how often the drain cap has been binding lately (EMA of 0/1)
        self.inflight: dict[EngineBlockKey, int] = {}  # hash -> block id, planned last step
        self._mark: _Mark | None = None
        self._parent: OrderedDict[EngineBlockKey, EngineBlockKey | None] = OrderedDict()
        self.reuse = ReuseModel(max(1, cfg.chain_memory // 16), cfg.min_need_rate, cfg.min_family_requests,
                                cfg.min_reuse_rate)
        #: the need estimate learns in both modes; without a declared link, bytes are the cost: blocks
        #: unlikely to be needed are not copied (with one, the link's time is spent anyway, and the
        #: estimate only overrides the one-shot family rule where it shows the blocks needed)
        self.estimating = cfg.min_need_rate > 0
        self._step = 0
        self._allocated = 0  # blocks the engine handed out this step
        self.foreseen = 0  # blocks the next step is known to take (:meth:`note_demand`)
        #: the most blocks a step took lately beyond what was known of it (new requests; fading)
        self.unforeseen_burst = 0.0
        #: ancestors left in the engine when a later block of their chain was copied: copied when they come
        #: due whatever the need estimate says (an orphan page can never be hit)
        self._owed: OrderedDict[EngineBlockKey, None] = OrderedDict()
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

    def note_demand(self, blocks: int) -> None:
        """The blocks the next step is known to take (told after :meth:`note_step`, before :meth:`plan`):
        decodes that cross a page boundary, prefills' next chunks, requests looked up and not admitted
        yet. New requests are not known before the step that looks them up: their share is measured
        (:attr:`unforeseen_burst`)."""
        self.foreseen = max(0, blocks)

    def note_step(self, blocks_allocated: int) -> None:
        self._step += 1
        self._allocated = blocks_allocated
        a = self.cfg.ema_alpha
        self.alloc_ema = (1 - a) * self.alloc_ema + a * blocks_allocated
        unforeseen = max(0, blocks_allocated - self.foreseen)
        self.unforeseen_burst = max(float(unforeseen), self.unforeseen_burst * BURST_DECAY)
        self.foreseen = 0
        if self.link_bound:
            self.burst = max(float(blocks_allocated), self.burst * BURST_DECAY)

    def observe_copies(self, bytes_per_s: float, step_s: float) -> None:
        """The copy link's measured rate and the engine's step time: without a fixed cap, a step may plan
        ``drain_link_share`` of the step's time on the link (so the cap is link time, whatever a page's size)."""
        if not self.measured_cap or bytes_per_s <= 0 or step_s <= 0:
            return
        self.budget.bytes_per_step = max(self.budget.page_bytes, int(self.cfg.drain_link_share * bytes_per_s * step_s))

    def danger_depth(self) -> int:
        """How far from the free queue's head the zone reaches (in queue positions: every free block,
        cached or not, is one allocation away from reuse).

        Without a declared link, just in time: the blocks the next step takes (what is known of it,
        :meth:`note_demand`, plus the measured share of new requests), copied during this step's
        forward; where one step's link time cannot copy them all (the drain cap), the steps after it
        too, so the copies start as early as they must. A deeper zone copies blocks a prefix hit
        revives before the engine reuses them. With a declared link, copies must start early: the
        zone covers ``horizon_steps`` of allocations plus ``watermark_blocks``."""
        if self.link_bound:
            return math.ceil(self.alloc_ema * self.cfg.horizon_steps) + self.cfg.watermark_blocks
        demand = self.foreseen + math.ceil(self.unforeseen_burst)
        per_step = max(1, self.budget.bytes_per_step // self.budget.page_bytes)
        steps = -(-demand // per_step)
        return demand + max(0, steps - 1) * math.ceil(self.alloc_ema)

    # -- planning ----------------------------------------------------------------

    def _closure(self, h: EngineBlockKey, pool: FreeQueue, chosen: set[EngineBlockKey],
                 gone: dict[EngineBlockKey, int] | None, walks: dict[EngineBlockKey, bool]) -> list[Pick] | None:
        """``h`` and the ancestors lmkv lacks that are copied with it, oldest first; None if the chain is
        broken (an ancestor is neither in the engine nor in lmkv). ``gone``: blocks handed out this step
        (hash -> block id), whose bytes are still there until the step's forward: they are rescued.

        With a declared link, every cached ancestor up to one a running request holds goes with ``h``
        (the link may not reach it in time). Without one, only rescued ancestors do: an ancestor still in
        the free queue waits behind ``h`` (the engine frees a chain's last block first) and is copied
        when it comes due, owed a copy whatever the need estimate says then; copied now, a prefix hit
        that revives it first makes the copy a waste. The walk still goes to the chain's start, to
        know the chain whole. ``walks``: this step's verdicts on the blocks walked (True: the prefix up
        to it is whole), where a later walk stops."""
        defer = not self.link_bound
        out: list[Pick] = []
        walked: list[EngineBlockKey] = []
        owed: EngineBlockKey | None = None
        cur: EngineBlockKey | None = h
        whole = True
        while cur is not None and not (self.in_tier(cur) or cur in self.inflight or cur in chosen):
            bid = pool.cached_block(cur)
            if bid is not None and cur != h and (defer or pool.held(bid)):
                owed = owed or cur
                if pool.held(bid):  # a running request holds it (and the pages before it): not at risk now
                    break
            elif bid is not None:
                out.append(Pick(bid, cur))
            elif gone is not None and cur in gone:
                out.append(Pick(gone[cur], cur, rescue=True))
            else:
                whole = False  # unreachable
                break
            if cur != h and cur in walks:  # (an earlier walk went on from here)
                whole = walks[cur]
                break
            walked.append(cur)
            if cur not in self._parent:
                break  # the chain's start (or a link we no longer remember: treat it as the start)
            cur = self._parent[cur]
        walks.update(dict.fromkeys(walked, whole))
        if not whole:
            return None
        if defer and owed is not None:
            self._owe(owed)
        out.reverse()
        return out

    def plan(self, pool: FreeQueue) -> list[Pick]:
        """The copies to make this step: without a declared link, blocks the step handed out that are
        worth their bytes (rescued: copied before the step's forward); then blocks near the queue's
        head (copied during it)."""
        reused = pool.take_reused()
        shift = pool.head_shift()
        if self._mark is not None:  # blocks came to and went from the head: the mark's place moved
            if any(b == self._mark.block_id for b, _ in reused):
                self._mark = None  # handed out: its bytes, and its place, are another block's now
            else:
                self._mark.position = max(0, self._mark.position + shift)
                self._mark.cached = max(0, self._mark.cached - len(reused))
        if self.link_bound:
            self.burst_evicted = max(float(len(reused)), self.burst_evicted * BURST_DECAY)
        if self.estimating:
            self.reuse.settle(self._step)
        budget = self.budget.refill()
        if self.measured_cap:
            # A step may always copy as many blocks as it took: computing a block takes longer than
            # copying it out (an 8B model's page: ~1.3 ms of prefill against ~0.17 ms over PCIe), so
            # this is within the step's own link time even when the measured step time lags a burst.
            budget = max(budget, self._allocated)
        if budget == 0:
            return []  # a link slower than a page a step: this step's share is carried over
        picks: list[Pick] = []
        chosen: set[EngineBlockKey] = set()
        walks: dict[EngineBlockKey, bool] = {}
        if not self.link_bound:  # (a declared link is busy: a copy before the forward would stall it)
            self._add(picks, chosen, budget, pool, self._rescues(reused, pool), {h: b for b, h in reused}, walks)
        # With a declared link that has been binding, look further ahead: copies must start earlier to
        # finish in time. (Without one, the cap is a step's link time and never below what the step
        # took: looking ahead there copied blocks the engine revived, 1.2x the bytes of 8B pages.)
        gain = LOOKAHEAD_GAIN if self.link_bound else 0.0
        depth = int(self.danger_depth() * (1 + gain * self._binding))
        if len(picks) < budget:
            wanted = self._zone(pool, depth)
            if self.link_bound and self.estimating:
                wanted = self._by_need(wanted, budget)
            self._add(picks, chosen, budget, pool, wanted, None, walks)
        if self.link_bound:
            self._fill(pool, picks, chosen, budget)
        self._binding = 0.9 * self._binding + 0.1 * (len(picks) >= budget)
        self.budget.spend(len(picks))
        for p in picks:
            self.inflight[p.block_hash] = p.block_id
            self._owed.pop(p.block_hash, None)
        self.stats.planned += len(picks)
        self.stats.rescued += sum(p.rescue for p in picks)
        return picks

    def _rescues(self, reused: list[tuple[int, EngineBlockKey]], pool: FreeQueue) -> Iterator[EngineBlockKey]:
        """The blocks handed out this step worth copying (judged as a due block would be)."""
        for _, h in reused:
            # (a page cached again in another block: a request allocated the same page, not computed yet)
            if pool.cached_block(h) is None and self._worth(h):
                yield h

    def _worth(self, h: EngineBlockKey) -> bool:
        """Whether a block about to be lost is worth its copy: lmkv lacks it, no copy of it is in flight,
        and, without a declared link, the need estimate does not let blocks like it go. With a declared
        link, its family does not look one-shot, or blocks like it were shown needed all the same (a
        conversation service's one family, most of whose first turns never get a second: the fifth
        that do are worth the link's time)."""
        if self.in_tier(h) or h in self.inflight:
            return False
        if h in self._owed:
            if self.estimating:
                self.reuse.watch(h, self._step)  # (copied whatever its class: its outcome teaches the estimate too)
            return True
        if self.link_bound:
            step = self._step
            return not self.reuse.one_shot(h, step) or (self.estimating and self.reuse.shown_needed(h, step))
        if self.estimating and self.reuse.skippable(h, self._step):
            self.stats.unlikely += 1
            return False
        return True

    def _owe(self, h: EngineBlockKey) -> None:
        """``h`` is left in the engine while a later block of its chain is copied: copy it when it comes
        due (the last ``chain_memory`` such blocks are remembered, as the chains' links are)."""
        self._owed[h] = None
        self._owed.move_to_end(h)
        if len(self._owed) > self.cfg.chain_memory:
            self._owed.popitem(last=False)

    def _add(self, picks: list[Pick], chosen: set[EngineBlockKey], budget: int, pool: FreeQueue,
             wanted: Iterator[EngineBlockKey], gone: dict[EngineBlockKey, int] | None,
             walks: dict[EngineBlockKey, bool]) -> None:
        """Plan ``wanted`` blocks with their prefix closure (:meth:`_closure`), in order, until the budget
        is spent."""
        for h in wanted:
            if h in chosen:
                continue
            chain = self._closure(h, pool, chosen, gone, walks)
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
                picks.append(p)
                chosen.add(p.block_hash)
                if self.estimating and p.block_hash != h:
                    self.reuse.watch(p.block_hash, self._step)  # its outcome teaches the estimate too
            if len(picks) >= budget:
                return

    def _zone(self, pool: FreeQueue, depth: int) -> Iterator[EngineBlockKey]:
        """Blocks worth copying within ``depth`` of the queue's head (with a declared link, also the cached
        blocks a burst like the largest lately would take), nearest first. A generator: the walk stops
        where the step's copies are planned, so a deep lookahead costs only what is used of it."""
        reach, evicts, cached = 0, 0, 0
        start, at = None, 0
        if self.link_bound:
            reach = math.ceil(self.burst) + self.cfg.watermark_blocks
            evicts = math.ceil(self.burst_evicted) + (self.cfg.watermark_blocks if self.burst_evicted >= 1 else 0)
            start, at, cached = self._resume(pool)
        covered = self.link_bound  # no cached block walked so far was worth a copy: the mark may move on (past
        # the never-used blocks at a large pool's head, too: none of them is cached until the engine takes it)
        verdicts = self._mark.one_shot if self._mark is not None else set()
        for i, bid, h in pool.iter_free(max(depth, reach), start, at):
            in_burst = cached < evicts and i < reach
            if i >= depth and not in_burst:
                return
            worth = self._worth(h)
            if covered:  # (the next walk starts at this block: it judges it again)
                if not worth and not (self.in_tier(h) or h in self.inflight):  # its family looks one-shot
                    verdicts.add((self.reuse.family(h), self.reuse.watch(h, self._step)))
                self._mark = _Mark(bid, h, i, cached, verdicts)
                covered = not worth
            cached += 1
            if worth:
                yield h

    def _resume(self, pool: FreeQueue) -> tuple[int | None, int, int]:
        """Where a walk under a declared link starts: at the mark, if its block is still in the free queue
        with the same bytes (not handed out, not revived by a request since: the engine frees cached
        blocks to the tail and puts only blocks without a hash back at the head, so no cached block came
        before it meanwhile) and the verdicts the blocks passed rest on still hold (their families still
        look one-shot, no class of theirs was shown needed since); else at the head. Under a link, the
        blocks lmkv copied (and those of one-shot families, not copied) sit at the head until the engine
        takes them, and a walk from the head judged them again every step: 0.6-7.7 ms a step (median
        per run) on the Mooncake trace and the generator, 0.13-2.5 ms from the mark (and past the
        never-used blocks, :mod:`lmkv.connectors.vllm_pool`), the same blocks copied, lost and hit in
        every link run of ``lmkv bench offload``. A page lmkv's own tier dropped is not copied again
        while its block sits before the mark (lmkv chose to drop it). The mark's position is the one it
        was seen at, moved by what came to and went from the head since (:meth:`FreeQueue.head_shift`;
        a block revived from before it makes that an overestimate until the mark moves: the zone ends
        a little sooner)."""
        mark, self._mark = self._mark, None
        if mark is None or pool.held(mark.block_id) or pool.block_hash(mark.block_id) != mark.block_hash:
            return None, 0, 0
        step = self._step
        for root, c in mark.one_shot:  # a verdict changed: the blocks passed are judged again
            if not self.reuse.family_one_shot(root, step) or (self.estimating and self.reuse.need.shown_needed(c)):
                return None, 0, 0
        self._mark = mark
        return mark.block_id, mark.position, mark.cached

    def _by_need(self, wanted: Iterator[EngineBlockKey], budget: int) -> Iterator[EngineBlockKey]:
        """A declared link cannot copy every block it should: the first :data:`NEED_WINDOW` steps' worth
        of due blocks, most likely needed first (:meth:`ReuseModel.need_score`), nearest the head
        among equals. A block ranked low near the head is lost to the link rather than a block more
        likely needed further back."""
        ranked = []
        for i, h in enumerate(wanted):
            ranked.append((-self.reuse.need_score(h, self._step), i, h))
            if len(ranked) >= NEED_WINDOW * budget:
                break
        ranked.sort()
        for _, _, h in ranked:
            yield h

    def _fill(self, pool: FreeQueue, picks: list[Pick], chosen: set[EngineBlockKey], budget: int) -> None:
        """The link is the bottleneck: the budget the danger zone leaves this step goes to the oldest
        freshly computed blocks, as eager would copy them, skipping one-shot families; copies made
        now are blocks the zone will not have to rush later."""
        while self._fresh and len(picks) < budget:
            h = self._fresh.popleft()
            if h in chosen or not self._worth(h):
                continue
            bid = pool.cached_block(h)
            if bid is None:
                continue  # gone from the engine: nothing to copy
            picks.append(Pick(bid, h))
            chosen.add(h)
            self.stats.filled += 1

    def done(self, picks: Sequence[Pick]) -> None:
        """The copies of ``picks`` were made (or failed): lmkv holds their pages now, or will not."""
        for p in picks:
            self.inflight.pop(p.block_hash, None)
