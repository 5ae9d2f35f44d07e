"""LMCache's lazy offload policy, driven in the simulator as LMCache's own connector drives it.

The peer's figure belongs beside lmkv's in the same runs: LMCache 0.5.6's
``EvictionAwareStoreQueue`` (``pip install --no-deps lmcache==0.5.6``) gets what its
``LazyOffloadManager`` gives it. A store operation per request per step, covering the
full blocks the step computed, with the hash of each block read at admission; one drain
a step with that step's block allocations and, as the next step's estimate, the blocks
its scheduled tokens fill (``ceil(tokens / block_size)``); each emitted operation is
checked against its snapshot again, pinned (``touch``) and copied, then freed, which puts
its free blocks back at the free queue's tail, as LMCache's manager does; a mismatch drops
the operation and the rest of the request's drain; a preempted request's buffer is dropped.
Only the policy is LMCache's; the bookkeeping is this module's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass


@dataclass(frozen=True)
class _Op:
    start: int
    end: int


@dataclass(frozen=True)
class _Meta:
    """The parts of LMCache's ``LMCacheMPRequestMetadata`` its policy reads."""

    request_id: str
    op: _Op


def available() -> str | None:
    """``None`` if LMCache 0.5.6's policy is installed, else why not. It is looked up, not imported:
    lmcache imports numba, whose objects break vLLM's kernel dispatcher in any engine started later
    in the same process (the simulator starts none)."""
    if importlib.util.find_spec("lmcache") is None:
        return "lmcache is not installed (pip install --no-deps lmcache==0.5.6)"
    got = importlib.metadata.version("lmcache")
    if got != "0.5.6":
        return f"lmcache {got} is installed; the policy driven here is 0.5.6's"
    return None


class LMCacheStoreQueue:
    """``EvictionAwareStoreQueue`` with its default configuration over vLLM's block pool."""

    def __init__(self, pool) -> None:
        from lmcache.integration.vllm.lazy_offload_policy import eviction_aware
        from lmcache.integration.vllm.lazy_offload_policy.eviction_aware import (
            EvictionAwarePolicyConfig,
            EvictionAwareStoreQueue,
        )

        eviction_aware.logger.setLevel(logging.WARNING)  # (its ledger, every 5 s: the figures are ours to print)
        self._pool = pool
        self._policy = EvictionAwareStoreQueue(EvictionAwarePolicyConfig(), pool)

    def add(self, request_id: str, start: int, end: int, block_ids: list[int]) -> None:
        """A store of tokens ``[start, end)`` of a request, held in ``block_ids``."""
        if block_ids:
            hashes = {b: self._pool.blocks[b].block_hash for b in block_ids}
            self._policy.add(_Meta(request_id, _Op(start, end)), hashes)

    def drop(self, request_id: str) -> None:
        self._policy.drop_request(request_id)

    def drain(self, allocated: int, scheduled_tokens: int, block_size: int) -> list:
        """The block hashes to copy now (their snapshots checked again, as LMCache's manager does)."""
        from lmcache.integration.vllm.lazy_offload_policy.base import DrainSignals

        drain = self._policy.drain(DrainSignals(new_blocks_allocated=allocated,
                                                est_next_step_blocks=-(-scheduled_tokens // block_size),
                                                finished_request_ids=set(), blocked_request_ids=set()))
        out = []
        for item in drain.items:
            for _, snapshot in item.metadatas:
                if any(self._pool.blocks[b].block_hash != h for b, h in snapshot.items()):
                    break  # recycled since: this operation and the rest of the request's drain go
                blocks = [self._pool.blocks[b] for b in snapshot]
                self._pool.touch(blocks)  # pinned while copied ...
                out.extend(snapshot.values())
                self._pool.free_blocks(blocks)  # ... and released once copied
        return out
