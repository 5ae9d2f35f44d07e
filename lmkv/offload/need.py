"""How often blocks of each class were needed again, with a confidence bound: which classes lazy
offload may leave uncopied, from evidence rather than a guess.

Skipping a copy that is needed later costs a recompute of the block's tokens, far dearer than
the copy: a 32-token page of an 8B model is ~0.5 TFLOP to recompute (~1.3 ms at 400 TFLOP/s)
against 4 MiB over PCIe (~0.17 ms at 25 GB/s), about a tenth. So a class of blocks is skipped
only when the *upper* confidence bound of its chance of being needed is below
``offload.min_need_rate`` (0.1 by default, that ratio): where the evidence is thin the bound is
high and the block is copied.

Each outcome is a block watched near eviction: needed (asked for again while the engine no
longer held it) or not. Outcomes of one lineage (a document's hundred-block body asked again or
not) are one observation, not a hundred: the bound's sample size is the number of distinct
lineages a class has seen, its rate the share of its blocks needed (Wilson's score interval,
one-sided 95%). Evidence is a window, not a lifetime: once the classes have seen ``WINDOW``
observations all counts are halved, so a class whose blocks start being needed again is
copied again within a window.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

#: one-sided 95% normal quantile: the confidence of each class's bound
Z = 1.645
#: observations (distinct lineages per class) the estimate keeps before halving every count
WINDOW = 4096


def upper_bound(p: float, n: float) -> float:
    """Wilson's one-sided upper confidence bound of a rate ``p`` observed over ``n`` trials (1 for none)."""
    return _wilson(p, n, +1)


def lower_bound(p: float, n: float) -> float:
    """Wilson's one-sided lower confidence bound of a rate ``p`` observed over ``n`` trials (0 for none)."""
    return _wilson(p, n, -1)


def _wilson(p: float, n: float, side: int) -> float:
    if n <= 0:
        return 1.0 if side > 0 else 0.0
    z2 = Z * Z
    centre = p + z2 / (2 * n)
    spread = Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, max(0.0, (centre + side * spread) / (1 + z2 / n)))


@dataclass
class Counts:
    """Outcomes of one class of blocks: how many came due, how many were needed again."""

    needed: float = 0.0  # blocks needed again from a tier
    blocks: float = 0.0  # blocks settled
    sources: float = 0.0  # distinct lineages among them: the independent observations

    @property
    def rate(self) -> float:
        return self.needed / self.blocks if self.blocks else 0.0

    @property
    def bound(self) -> float:
        return upper_bound(self.rate, self.sources)

    @property
    def low(self) -> float:
        return lower_bound(self.rate, self.sources)


class NeedEstimate:
    """Per class, the blocks settled and needed, and whether the class may go uncopied."""

    def __init__(self, min_need_rate: float) -> None:
        self.min_need_rate = min_need_rate
        self.counts: dict[Hashable, Counts] = {}
        self._pairs: OrderedDict[tuple[Hashable, Hashable], None] = OrderedDict()  # (class, lineage) seen lately
        self._observations = 0.0

    def add(self, c: Hashable, source: Hashable, needed: bool) -> None:
        """A block of class ``c`` (of lineage ``source``) settled: needed again from a tier or not."""
        k = self.counts.get(c)
        if k is None:
            k = self.counts[c] = Counts()
        k.blocks += 1
        k.needed += needed
        pair = (c, source)
        if pair in self._pairs:
            self._pairs.move_to_end(pair)
            return
        self._pairs[pair] = None
        k.sources += 1
        self._observations += 1
        if len(self._pairs) > 4 * WINDOW:
            self._pairs.popitem(last=False)
        if self._observations > WINDOW:
            self._halve()

    def correct(self, c: Hashable) -> None:
        """A block of class ``c`` settled as not needed was needed after all (its horizon was short)."""
        k = self.counts.get(c)
        if k is not None:
            k.needed = min(k.blocks, k.needed + 1)

    def _halve(self) -> None:
        for k in self.counts.values():
            k.needed, k.blocks, k.sources = k.needed / 2, k.blocks / 2, k.sources / 2
        self._observations /= 2
        self._pairs.clear()  # (a lineage seen again counts anew: it is an observation of the new window)

    def skip(self, c: Hashable) -> bool:
        """Whether a block of class ``c`` may be left uncopied: blocks like it were needed again less often
        than ``min_need_rate``, at 95% confidence."""
        k = self.counts.get(c)
        return k is not None and k.bound < self.min_need_rate

    def shown_needed(self, c: Hashable) -> bool:
        """Whether blocks of class ``c`` were needed again at least ``min_need_rate`` of the time, at 95%
        confidence (the evidence that overrides a rule of thumb that would leave them uncopied)."""
        k = self.counts.get(c)
        return k is not None and k.low >= self.min_need_rate
