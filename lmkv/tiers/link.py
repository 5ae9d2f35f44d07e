"""How fast each tier has delivered reads lately, as measured: the inputs of the layerwise path.

Per tier, two moving averages: the bytes per second its fetches delivered (a whole
fetch, or all of a layerwise fetch's layer requests from first sent to last landed),
and the time one layer request takes. The worker sets a layerwise fetch's pipeline
depth from the second; the scheduler weighs the first against the engine's step time
to choose between a layerwise and an asynchronous load (:mod:`lmkv.engine.scheduler`).
The copies out of engine blocks are measured the same way (``COPY_OUT``): lazy offload's
drain cap is a share of that link's time per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

#: weight of the newest sample
EMA = 0.2

#: the link copies out of engine blocks take (not a tier): its rate sets lazy offload's drain cap
COPY_OUT = "engine->lmkv"


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


@dataclass
class Link:
    """One tier's measured read rate (bytes/s) and layer-request time (seconds); None: not seen yet."""

    rate: float | None = None
    request_s: float | None = None


class LinkRates:
    """Each tier's measured read rate and request time, and the copy-out rate: what the layerwise path
    and lazy offload's drain cap read."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()

    def fetched(self, tier: str, nbytes: int, seconds: float) -> None:
        """A fetch from ``tier`` delivered ``nbytes`` in ``seconds`` of wall time."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            link = self._links.setdefault(tier, Link())
            link.rate = ema(link.rate, nbytes / seconds)

    def copied(self, nbytes: int, seconds: float) -> None:
        """A step's copies out of engine blocks moved ``nbytes`` in ``seconds`` of copying."""
        self.fetched(COPY_OUT, nbytes, seconds)

    def requested(self, tier: str, seconds: float) -> None:
        """One layer request to ``tier`` took ``seconds``."""
        with self._lock:
            link = self._links.setdefault(tier, Link())
            link.request_s = ema(link.request_s, seconds)

    def get(self, tier: str) -> Link:
        with self._lock:
            link = self._links.get(tier)
            return Link(link.rate, link.request_s) if link is not None else Link()

    def rates(self) -> dict[str, float]:
        """Per tier measured so far, its read rate (what the scheduler is told)."""
        with self._lock:
            return {t: link.rate for t, link in self._links.items() if link.rate is not None}
