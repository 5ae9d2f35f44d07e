"""What the scheduler side tells the workers each step: which pages to load and store.

Plain dataclasses: they travel inside the engine's per-step metadata (pickled
across processes), so they hold only chain hashes and block ids. Each worker
turns a chain hash into its own page key (a sharded group's key carries the
worker's shard, see :mod:`lmkv.keys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmkv.keys import ChainHash


@dataclass
class PageOp:
    """Pages of one request and one cache group, each mapped to the engine block that holds it."""

    req_id: str
    group: int
    chains: list[ChainHash]
    block_ids: list[int]
    pages: list[int]  # each page's index within the request


@dataclass
class StepPlan:
    """What the workers do in one step: loads (layerwise, or in the background), stores, rescues, drops."""

    loads: list[PageOp] = field(default_factory=list)  # layerwise, during this step's forward
    async_loads: list[PageOp] = field(default_factory=list)  # in the background; the request waits
    stores: list[PageOp] = field(default_factory=list)
    #: stores of blocks this step's requests were just given (lazy offload rescues them): copied before
    #: the forward and the loads write those blocks
    rescues: list[PageOp] = field(default_factory=list)
    drops: list[PageOp] = field(default_factory=list)  # pages no longer worth keeping (superseded states)
    #: pages a waiting P/D consumer was promised that have landed below memory: copied into memory in
    #: the background as they land, so its load, once every page came, reads from memory (no block ids)
    pulls: list[PageOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.async_loads or self.stores or self.rescues or self.drops or self.pulls)
