"""Which cached blocks are worth copying: what the lazy offload policy knows about reuse.

Eviction order says which blocks the engine will lose, not which will be asked for
again. This module keeps what requests have shown about that, per block, and learns
from it:

- **families**: requests that start with the same page (one application's system
  prompt). A family whose requests almost never repeat most of an earlier prompt is a
  stream of one-shot prompts; its blocks are not worth copying.
- **lineages**: within a family, the requests that continue one page past the pages all
  of the family's requests share: one agent session, or one document and the questions
  asked about it. A lineage *extends* when a request continues the whole previous one
  (an agent's next turn) and *branches* when it leaves it at an earlier page (another
  question on the same document: the previous question's tail is never read again).
- **the estimate**: the chance that a block about to be evicted will be needed from a
  tier (asked for again while the engine no longer holds it), by how many requests used
  it and its lineage's kind (one request so far, extending, branching). Each block the
  policy sees near eviction, and each ancestor it copies for one, is watched: a success if a later request needs it beyond
  what the engine still holds, a miss if a request finds it still in the engine (a copy
  would have been wasted) or if nobody asks for it within twice the slowest success seen
  so far (it becomes a success after all if it is needed later; the horizon grows).
  Outcomes are seen whether or not the block was copied (requests name their blocks
  either way), so skipping copies can never teach the estimate that they were useless.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: use counts told apart by the estimate (this many and more share a row)
MAX_USES = 4
#: lineage kinds: one request so far, requests that extend the previous one, or branch off it
SINGLE, EXTENDS, BRANCHES = 0, 1, 2
#: candidates whose outcome is being watched, and settled misses that may still turn into successes
WATCH_LIMIT = 1 << 16
#: the shortest watch before a candidate counts as not needed
MIN_WATCH_STEPS = 256
#: settled outcomes a (uses, kind) class needs before its estimate may stop a copy
MIN_EVIDENCE = 8


@dataclass
class Family:
    shared: list[bytes]  # the pages every request of the family began with so far
    requests: int = 0
    repeats: int = 0  # requests most of whose pages were used before


@dataclass
class Lineage:
    requests: int = 0
    leaf: bytes | None = None  # the latest request's last page
    extends: int = 0
    branches: int = 0

    @property
    def kind(self) -> int:
        if self.requests < 2:
            return SINGLE
        return EXTENDS if self.extends >= self.branches else BRANCHES


Outcome = tuple[tuple[int, int], int]  # (uses row, lineage kind), step first watched


class ReuseModel:
    """Per-block use counts, families and lineages, and the learned chance of being needed."""

    def __init__(self, remembered: int) -> None:
        """``remembered``: how many families and how many lineages are kept (the least recently
        seen are forgotten)."""
        self.uses: dict[bytes, int] = {}
        self._root: dict[bytes, bytes] = {}  # block -> the first page of its chain (its family)
        self._families: OrderedDict[bytes, Family] = OrderedDict()
        self._lineage_of: dict[bytes, bytes] = {}  # block past its family's shared pages -> its lineage
        self._lineages: OrderedDict[bytes, Lineage] = OrderedDict()
        self._remembered = remembered
        self.needed = [[0] * 3 for _ in range(MAX_USES + 1)]
        self.not_needed = [[0] * 3 for _ in range(MAX_USES + 1)]
        self.horizon = MIN_WATCH_STEPS
        self._watch: OrderedDict[bytes, Outcome] = OrderedDict()  # oldest first
        self._missed: OrderedDict[bytes, Outcome] = OrderedDict()

    # -- what requests show --------------------------------------------------

    def note_block(self, h: bytes, root: bytes) -> None:
        """A block seen for the first time, in the family that starts with ``root``."""
        self._root[h] = root

    def forget(self, h: bytes) -> None:
        for table in (self.uses, self._root, self._lineage_of):
            table.pop(h, None)

    def note_request(self, hashes: Sequence[bytes], cached: int, step: int) -> None:
        """A request was admitted with this chain, the engine holding its first ``cached`` pages."""
        seen = 0
        for i, h in enumerate(hashes):
            seen += h in self.uses
            self.uses[h] = self.uses.get(h, 0) + 1
            self._outcome(h, step, needed=i >= cached)
        fam = self._families.get(hashes[0])
        if fam is None:
            fam = self._families[hashes[0]] = Family(list(hashes))
            if len(self._families) > self._remembered:
                self._families.popitem(last=False)
        else:
            self._families.move_to_end(hashes[0])
        fam.requests += 1
        fam.repeats += seen >= 0.5 * len(hashes)
        self._note_lineage(fam, hashes)

    def _note_lineage(self, fam: Family, hashes: Sequence[bytes]) -> None:
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
            if lin.leaf in hashes[n:]:
                lin.extends += 1
            else:
                lin.branches += 1
        lin.requests += 1
        lin.leaf = hashes[-1]
        for h in hashes[n:]:
            self._lineage_of[h] = key

    def _add_lineage(self, key: bytes, lin: Lineage) -> Lineage:
        self._lineages[key] = lin
        if len(self._lineages) > self._remembered:
            self._lineages.popitem(last=False)
        return lin

    def one_shot(self, h: bytes, min_requests: int, min_rate: float) -> bool:
        """Whether ``h``'s family, after ``min_requests`` requests, repeats less often than ``min_rate``."""
        fam = self._families.get(self._root.get(h, b""))
        return fam is not None and fam.requests >= min_requests and fam.repeats < min_rate * fam.requests

    # -- the estimate ----------------------------------------------------------

    def _class(self, h: bytes) -> tuple[int, int]:
        lin = self._lineages.get(self._lineage_of.get(h, b""))
        return min(self.uses.get(h, 0), MAX_USES), SINGLE if lin is None else lin.kind

    def watch(self, h: bytes, step: int) -> float | None:
        """Start watching a block near eviction; the chance it will be needed from a tier, or None
        while blocks like it have too few settled outcomes to tell."""
        c = self._class(h)
        if h not in self._watch:
            self._watch[h] = (c, step)
        needed, not_needed = self.needed[c[0]][c[1]], self.not_needed[c[0]][c[1]]
        if needed + not_needed < MIN_EVIDENCE:
            return None
        return (needed + 1) / (needed + not_needed + 2)

    def _outcome(self, h: bytes, step: int, needed: bool) -> None:
        entry = self._watch.pop(h, None)
        if entry is None and h in self._missed:
            entry = self._missed.pop(h)
            if not needed:
                return  # settled as a miss already, and still one
            self.not_needed[entry[0][0]][entry[0][1]] -= 1  # needed after all: the horizon was short
        if entry is None:
            return
        (row, col), since = entry
        if needed:
            self.needed[row][col] += 1
            self.horizon = max(self.horizon, 2 * (step - since))
        else:
            self.not_needed[row][col] += 1

    def settle(self, step: int) -> None:
        """Watched blocks nobody asked for within the horizon count as not needed."""
        while self._watch:
            h, (c, since) = next(iter(self._watch.items()))
            if step - since <= self.horizon and len(self._watch) <= WATCH_LIMIT:
                break
            del self._watch[h]
            self.not_needed[c[0]][c[1]] += 1
            self._missed[h] = (c, since)
            if len(self._missed) > WATCH_LIMIT:
                self._missed.popitem(last=False)
