"""What the worker counts of its transfers, and the pages whose load failed.

The counts go to the engine's own stats (vLLM's KV-connector stats, summed over workers) as
deltas (:meth:`WorkerStats.take`) and to ``lmkv_stats`` as totals, per cache group too. Failed
pages are handed to the scheduler, which stops offering them for a while (so a retry
recomputes them instead of looping on them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from lmkv.keys import ChainHash


@dataclass
class TransferCounts:
    """The worker's transfer counts (pages and bytes loaded, failed, stored; tokens recomputed)."""

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
    pulled_pages: int = 0  # pages a waiting P/D consumer copied into memory as they landed


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


class FailedChains:
    """Chains of pages whose load failed, until the scheduler takes them; any thread adds."""

    def __init__(self) -> None:
        self._chains: list[ChainHash] = []
        self._lock = threading.Lock()

    def add(self, chains: Iterable[ChainHash]) -> None:
        with self._lock:
            self._chains.extend(chains)

    def take(self) -> list[ChainHash]:
        with self._lock:
            out, self._chains = self._chains, []
        return out
