"""Which cached blocks are worth copying: what the lazy offload policy knows about reuse.

Eviction order says which blocks the engine will lose, not which will be asked for
again. This module keeps what requests have shown about that, per block, and learns
from it:

- **families**: requests that start with the same page (one application's system
  prompt). A family whose requests almost never repeat most of an earlier prompt looks
  like a stream of one-shot prompts.
- **lineages**: within a family, the requests that continue one page past the pages all
  of the family's requests share: one agent session, or one document and the questions
  asked about it. A lineage *extends* when a request continues the whole previous one,
  its answer included (an agent's next turn, after the previous finished), and
  *branches* when it leaves it at an earlier page or comes while it still runs (another
  question on the same document: the previous question's tail is never read again).
- **classes**: what the engine can see of a block about to be evicted: whether its family
  looks one-shot, how many requests used it (0: decoding filled it), its lineage's kind (one
  request so far, extending, branching) and how long ago a request last used it.
- **outcomes**: each block the policy sees near eviction, and each ancestor it copies for
  one, is watched: *needed* if a later request asks for it beyond what the engine still
  holds, *not needed* if a request finds it still in the engine (a copy would have been
  wasted) or if nobody asks for it within its class's horizon: twice the slowest success
  seen in the class, and at least as long as 95% of the reuses any request has shown (how
  long a request's prefix lay unused before it came back, from the engine or a tier, in
  powers of two), so a class is not judged before its blocks could have come back (a miss
  becomes a success after all if it is needed later; the class's horizon grows). A block
  has one outcome until a request uses it again, however often the policy looks at it.
  Outcomes are seen whether or not the block was copied (requests name their blocks either
  way), so skipping copies can never teach the estimate that they were useless. They go to
  :class:`lmkv.offload.need.NeedEstimate`, which says which classes may be skipped; a
  decoded block's outcome counts for its request's lineage.

Nothing here is fitted to a trace: the classes are what any engine sees, the rates are
learned online with a confidence bound, and the threshold is the economics of a copy
against a recompute (see :mod:`lmkv.offload.need`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from lmkv.keys import EngineBlockKey
from lmkv.offload.need import NeedEstimate, upper_bound

#: use counts told apart by the estimate (this many and more share a row; 0: decoding filled it)
MAX_USES = 4
#: lineage kinds: one request so far, requests that extend the previous one, or branch off it
SINGLE, EXTENDS, BRANCHES = 0, 1, 2
#: idle time, steps since a request last used a block, in powers of four: under 16, 16-63,
#: 64-255, 256-1023, 1024 and more (an agent session between two turns is idle for a tool
#: call's length; one idle for much longer has ended)
IDLE_BUCKETS = 5
#: candidates whose outcome is being watched, and settled misses that may still turn into successes
#: (beyond it the oldest watch is dropped without an outcome: counting it as a miss would bias the estimate)
WATCH_LIMIT = 1 << 20
#: the shortest watch before a candidate counts as not needed
MIN_WATCH_STEPS = 512
#: a watch lasts at least as long as this share of the reuses seen took (the bound's confidence)
REUSE_SHARE = 0.95
#: buckets of reuse gaps (powers of two of steps)
GAP_BUCKETS = 32

#: request times a family keeps (at least; older ones are only counted)
FAMILY_STEPS = 4096

Class = tuple[bool, int, int, int]  # (family looks one-shot, uses row, lineage kind, idle bucket)


def reuse_horizon(gaps: list[int]) -> int:
    """Steps within which 95% of the reuses counted in ``gaps`` (by power of two) came, the upper edge of
    their bucket; never under :data:`MIN_WATCH_STEPS` (nothing is judged on a shorter wait: a return
    that takes longer than any seen so far may not have had its first chance yet)."""
    total = sum(gaps)
    seen = 0
    for b, n in enumerate(gaps):
        seen += n
        if seen >= REUSE_SHARE * total:
            return max(MIN_WATCH_STEPS, 1 << b)
    return MIN_WATCH_STEPS

#: no block has an empty key: what a lookup of a block's family or lineage falls back to
_NO_BLOCK = EngineBlockKey(b"")


def idle_bucket(idle: int) -> int:
    """The idle-time bucket of a block a request last used ``idle`` steps ago."""
    return min(IDLE_BUCKETS - 1, max(0, (idle.bit_length() - 3) // 2))


@dataclass
class Family:
    """Requests that share a first page (one application's): how often they repeat an earlier prompt."""

    shared: list[EngineBlockKey]  # the pages every request of the family began with so far
    repeats: int = 0  # requests most of whose pages were used before
    steps: list[int] = field(default_factory=list)  # when its latest requests came, oldest first
    older: int = 0  # requests before those (older than any reuse horizon lmkv judges by)
    gaps: list[int] = field(default_factory=lambda: [0] * GAP_BUCKETS)  # its requests' reuse gaps
    horizon: int = MIN_WATCH_STEPS  # within which 95% of its reuses came

    @property
    def requests(self) -> int:
        return self.older + len(self.steps)

    def came(self, step: int) -> None:
        self.steps.append(step)
        if len(self.steps) > 2 * FAMILY_STEPS:
            del self.steps[:FAMILY_STEPS]
            self.older += FAMILY_STEPS

    def before(self, step: int) -> int:
        """Requests that came before ``step``."""
        return self.older + bisect_left(self.steps, step)

    def judged(self, step: int) -> int:
        """Requests old enough to judge at ``step``: older than the family's reuse horizon."""
        return self.before(step - self.horizon)


@dataclass
class Lineage:
    """One session's requests, each continuing the last one's answer (agent-like) or branching beside it."""

    requests: int = 0
    leaf: EngineBlockKey | None = None  # the latest request's last page (once it finished: its answer's)
    extends: int = 0
    branches: int = 0
    running: bool = False  # the latest request has not finished

    @property
    def kind(self) -> int:
        if self.requests < 2:
            return SINGLE
        return EXTENDS if self.extends >= self.branches else BRANCHES


class ReuseModel:
    """Per-block use counts, families and lineages, and the outcomes of blocks watched near eviction."""

    def __init__(self, remembered: int, min_need_rate: float, min_family_requests: int,
                 min_reuse_rate: float) -> None:
        """``remembered``: how many families and how many lineages are kept (the least recently
        seen are forgotten); ``min_need_rate``: the need estimate's threshold; a family looks one-shot
        after ``min_family_requests`` requests repeating an earlier prompt less often than
        ``min_reuse_rate``."""
        self.uses: dict[EngineBlockKey, int] = {}
        self._touched: dict[EngineBlockKey, int] = {}  # block -> the step a request last used it
        self._root: dict[EngineBlockKey, EngineBlockKey] = {}  # block -> the first page of its chain (its family)
        self._families: OrderedDict[EngineBlockKey, Family] = OrderedDict()
        #: block past its family's shared pages -> its lineage
        self._lineage_of: dict[EngineBlockKey, EngineBlockKey] = {}
        #: a page decoding filled -> its request's lineage (the observation its outcome belongs to)
        self._answer_of: dict[EngineBlockKey, EngineBlockKey] = {}
        self._lineages: OrderedDict[EngineBlockKey, Lineage] = OrderedDict()
        self._remembered = remembered
        self._min_requests = min_family_requests
        self._min_rate = min_reuse_rate
        self.need = NeedEstimate(min_need_rate)
        #: per class: twice the slowest success seen (an agent's next turn comes within a tool
        #: call, a document's next question maybe much later: one horizon would settle the
        #: agents' misses only as late as the documents' successes)
        self.horizon: dict[Class, int] = {}
        #: requests that reused a prefix, by how long it lay unused (steps, powers of two)
        self._reuse_gaps = [0] * GAP_BUCKETS
        self._horizon_now = MIN_WATCH_STEPS  # reuse_horizon(self._reuse_gaps), kept up to date
        #: per class: block -> step watched, oldest first
        self._watch: dict[Class, OrderedDict[EngineBlockKey, int]] = {}
        self._watched: dict[EngineBlockKey, Class] = {}
        self._missed: OrderedDict[EngineBlockKey, tuple[Class, int]] = OrderedDict()
        self._scores: dict[tuple[Class, EngineBlockKey], float] = {}  # need_score's, for one step
        self._scored_step = -1
        #: judge a family only on requests older than its reuse horizon; False (evaluation only, ``lmkv bench
        #: offload``): on all its requests at once, to show what judging before returns could come costs
        self.wait_for_returns = True

    # -- what requests show --------------------------------------------------

    def note_block(self, h: EngineBlockKey, root: EngineBlockKey) -> None:
        """A block seen for the first time, in the family that starts with ``root``."""
        self._root[h] = root

    def forget(self, h: EngineBlockKey) -> None:
        for table in (self.uses, self._touched, self._root, self._lineage_of, self._answer_of):
            table.pop(h, None)

    def touch(self, hashes: Sequence[EngineBlockKey], step: int) -> None:
        """A request is using these blocks now (running)."""
        for h in hashes:
            self._touched[h] = step

    def finish(self, hashes: Sequence[EngineBlockKey], step: int) -> None:
        """A request finished with this chain (its answer's pages included): if it is its lineage's
        latest, the lineage's leaf is its answer's last page (an agent's next turn continues it, another
        question on a document does not)."""
        self.touch(hashes, step)
        for i in range(len(hashes) - 1, -1, -1):  # the deepest page with a lineage (decoding's pages have none)
            key = self._lineage_of.get(hashes[i])
            if key is not None:
                for h in hashes[i + 1:]:
                    self._answer_of[h] = key
                lin = self._lineages.get(key)
                if lin is not None and lin.running and lin.leaf in hashes[i:]:
                    lin.leaf = hashes[-1]
                    lin.running = False
                return

    def note_request(self, hashes: Sequence[EngineBlockKey], cached: int, step: int) -> None:
        """A request was admitted with this chain, the engine holding its first ``cached`` pages."""
        seen = 0
        gap = -1
        for i, h in enumerate(hashes):
            last = self._touched.get(h)
            if last is not None:
                gap = max(gap, step - last)
            seen += h in self.uses
            self.uses[h] = self.uses.get(h, 0) + 1
            self._touched[h] = step
            self._outcome(h, step, needed=i >= cached)
        fam = self._families.get(hashes[0])
        if fam is None:
            fam = self._families[hashes[0]] = Family(list(hashes))
            if len(self._families) > self._remembered:
                self._families.popitem(last=False)
        else:
            self._families.move_to_end(hashes[0])
        if gap >= 0:
            bucket = min(GAP_BUCKETS - 1, gap.bit_length())
            self._reuse_gaps[bucket] += 1
            self._horizon_now = reuse_horizon(self._reuse_gaps)
            fam.gaps[bucket] += 1
            fam.horizon = reuse_horizon(fam.gaps)
        fam.came(step)
        fam.repeats += seen >= 0.5 * len(hashes)
        self._note_lineage(fam, hashes)

    def _note_lineage(self, fam: Family, hashes: Sequence[EngineBlockKey]) -> None:
        n = 0
        while n < len(fam.shared) and n < len(hashes) and fam.shared[n] == hashes[n]:
            n += 1
        if n < len(fam.shared) and fam.requests == 2:  # the family's first request: a lineage of its own
            if fam.shared[n] not in self._lineages:
                self._add_lineage(fam.shared[n], Lineage(requests=1, leaf=fam.shared[-1]))
            for h in fam.shared[n:]:
                self._lineage_of[h] = fam.shared[n]
        del fam.shared[n:]
        if len(hashes) <= n:
            return
        key = hashes[n]
        lin = self._lineages.get(key)
        if lin is None:
            lin = self._add_lineage(key, Lineage())
        else:
            self._lineages.move_to_end(key)
            # a request that comes while the latest still runs goes beside it, not after it
            cont = not lin.running and lin.leaf in hashes[n:]
            lin.extends += cont
            lin.branches += not cont
        lin.requests += 1
        lin.leaf = hashes[-1]
        lin.running = True
        for h in hashes[n:]:
            self._lineage_of[h] = key

    def _add_lineage(self, key: EngineBlockKey, lin: Lineage) -> Lineage:
        self._lineages[key] = lin
        if len(self._lineages) > self._remembered:
            self._lineages.popitem(last=False)
        return lin

    def one_shot(self, h: EngineBlockKey, step: int) -> bool:
        """Whether ``h``'s family, after enough requests, repeats an earlier prompt less often than the
        configured rate (a stream of one-shot prompts). Only requests older than the family's reuse
        horizon (within which 95% of the reuses its requests showed came) are judged: a conversation
        service's first turns all look one-shot until their second turns come, tens of seconds later,
        while a stream of one-shot prompts (whose only reuse is its system prompt's) is judged soon."""
        return self.family_one_shot(self.family(h), step)

    def family(self, h: EngineBlockKey) -> EngineBlockKey:
        """The first page of ``h``'s chain: its family's key (an empty key if unknown)."""
        return self._root.get(h, _NO_BLOCK)

    def family_one_shot(self, root: EngineBlockKey, step: int) -> bool:
        """:meth:`one_shot` of the family whose first page is ``root``."""
        fam = self._families.get(root)
        if fam is None:
            return False
        judged = self._judged(fam, step)
        return judged >= self._min_requests and fam.repeats < self._min_rate * judged

    def _judged(self, fam: Family, step: int) -> int:
        return fam.judged(step) if self.wait_for_returns else fam.before(step)

    # -- outcomes --------------------------------------------------------------

    def _class(self, h: EngineBlockKey, step: int) -> Class:
        lin = self._lineages.get(self._lineage_of.get(h, _NO_BLOCK))
        return (self.one_shot(h, step), min(self.uses.get(h, 0), MAX_USES), SINGLE if lin is None else lin.kind,
                idle_bucket(step - self._touched.get(h, step)))

    def _source(self, h: EngineBlockKey) -> EngineBlockKey:
        """The observation ``h``'s outcome belongs to: its lineage (its request's, for an answer's page)."""
        return self._lineage_of.get(h) or self._answer_of.get(h) or h

    def skippable(self, h: EngineBlockKey, step: int) -> bool:
        """Watch a block near eviction; whether blocks like it may go uncopied (:mod:`lmkv.offload.need`)."""
        return self.need.skip(self.watch(h, step))

    def shown_needed(self, h: EngineBlockKey, step: int) -> bool:
        """Watch a block near eviction; whether blocks like it were shown to be needed (:mod:`lmkv.offload.need`)."""
        return self.need.shown_needed(self.watch(h, step))

    def need_score(self, h: EngineBlockKey, step: int) -> float:
        """Watch a block near eviction; how likely blocks like it are to be needed again, at the upper
        95% bound (in doubt a block ranks high): its class's rate (:mod:`lmkv.offload.need`), no
        higher than its family's rate of repeating most of an earlier prompt (judged, as
        :meth:`one_shot` judges, on requests older than the family's reuse horizon); 1 without
        evidence. For ranking where a copy link cannot take every block. (Outcomes come with requests
        and :meth:`settle`, not while a step is planned: a step's scores are kept per class and family.)"""
        c, root = self.watch(h, step), self.family(h)
        if step != self._scored_step:
            self._scores.clear()
            self._scored_step = step
        score = self._scores.get((c, root))
        if score is None:
            k = self.need.counts.get(c)
            score = 1.0 if k is None else k.bound
            fam = self._families.get(root)
            if fam is not None:
                judged = self._judged(fam, step)
                if judged:
                    score = min(score, upper_bound(min(1.0, fam.repeats / judged), judged))
            self._scores[(c, root)] = score
        return score

    def watch(self, h: EngineBlockKey, step: int) -> Class:
        """Start watching a block near eviction (or one copied for it); its class as of now. A block has
        one outcome until a request uses it again: one watched already, or settled as not needed (it may
        still turn out needed), is not watched anew however often the policy looks at it."""
        c = self._watched.get(h)
        if c is not None:
            return c
        c = self._class(h, step)
        if h in self._missed:
            return c
        self._watched[h] = c
        self._watch.setdefault(c, OrderedDict())[h] = step
        if len(self._watched) > WATCH_LIMIT:
            old = next(iter(self._watched))
            self._watch[self._watched.pop(old)].pop(old)
        return c

    def _outcome(self, h: EngineBlockKey, step: int, needed: bool) -> None:
        c = self._watched.pop(h, None)
        if c is not None:
            since = self._watch[c].pop(h)
        elif h in self._missed:
            c, since = self._missed.pop(h)
            if needed:  # settled as a miss, needed after all: the class's horizon was short
                self.need.correct(c)
                self.horizon[c] = max(self.horizon.get(c, MIN_WATCH_STEPS), 2 * (step - since))
            return
        else:
            return
        if needed:
            self.horizon[c] = max(self.horizon.get(c, MIN_WATCH_STEPS), 2 * (step - since))
        self.need.add(c, self._source(h), needed)

    def _settle_one(self, c: Class, fifo: OrderedDict[EngineBlockKey, int]) -> None:
        h, since = fifo.popitem(last=False)
        del self._watched[h]
        self.need.add(c, self._source(h), needed=False)
        self._missed[h] = (c, since)
        if len(self._missed) > WATCH_LIMIT:
            self._missed.popitem(last=False)

    def tally(self) -> dict[Hashable, tuple[float, float]]:
        """Per class, (blocks needed, blocks watched), the blocks still watched counted as not needed (as
        the end of a run settles them): for evaluation (``lmkv bench offload``'s hindsight bounds)."""
        out = {}
        for c in set(self.need.counts) | set(self._watch):
            k = self.need.counts.get(c)
            pending = len(self._watch[c]) if c in self._watch else 0
            out[c] = (k.needed if k else 0.0, (k.blocks if k else 0.0) + pending)
        return out

    def settle(self, step: int) -> None:
        """Watched blocks nobody asked for within their class's horizon count as not needed."""
        for c, fifo in self._watch.items():
            horizon = max(self.horizon.get(c, MIN_WATCH_STEPS), self._horizon_now)
            while fifo and step - next(iter(fifo.values())) > horizon:
                self._settle_one(c, fifo)
