"""vLLM's ``BlockPool`` as the :class:`lmkv.offload.lazy.FreeQueue` the lazy offload policy reads.

Hashes are vLLM's ``BlockHashWithGroupId`` bytes (block hash + 4-byte group id), so one
pool shared by several cache groups is read as one queue. The queue is only read:
lmkv never moves a block in it, so vLLM's own cache keeps exactly the blocks it
would keep without lmkv (a planned block is copied in the step that plans it).

The cached blocks a step's allocations take are noted as the queue hands them out
(its ``popleft_n``, which only ``BlockPool.get_new_blocks`` calls, before the pool
drops their hashes), so the policy can rescue them before the step's forward. Blocks
the pool drops from its cache without handing them out (``evict_blocks``, after a
failed load) are not noted: their bytes may be wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from lmkv.keys import EngineBlockKey

log = logging.getLogger(__name__)


class VllmFreeQueue:
    """vLLM's ``BlockPool`` free queue as lazy offload's :class:`~lmkv.offload.lazy.FreeQueue`.

    Read on vLLM's scheduler thread, between steps; it never moves a block in the queue. It counts
    what the engine takes from and puts back at the head, so walks can start past the run of
    never-used blocks a large pool begins with."""

    def __init__(self, pool) -> None:
        self.pool = pool
        #: cached blocks ``get_new_blocks`` handed out since :meth:`take_reused` (block id -> the hash it
        #: held); the queue's ``popleft_n`` is only called there, before the hashes are dropped
        self._reused: dict[int, EngineBlockKey] = {}
        #: the run of blocks without a hash at the head of the queue (a large pool's thousands of
        #: never-used blocks), as the last walk from the head saw it: its last block and that block's
        #: place. The engine takes blocks from the head (``popleft_n``), puts blocks without a hash back
        #: there (``prepend_n``), cached ones at the tail, and removes only cached blocks from the
        #: middle: counting what comes and goes at the head keeps the run's end and its place exact,
        #: and a walk from the head starts there
        self._cold: tuple[Any, int] | None = None
        self._shift = 0  # blocks put at the head less blocks taken from it, since :meth:`head_shift`
        queue = pool.free_block_queue
        popleft_n = getattr(queue, "popleft_n", None)
        self._counted = popleft_n is not None  # (the run is kept up to date)
        if popleft_n is None:  # another vLLM: lazy offload works on, without rescues
            log.warning("lmkv: vLLM's free block queue has no popleft_n; blocks a burst takes are not rescued")
            return
        remove, popleft, prepend_n = queue.remove, queue.popleft, queue.prepend_n

        def popleft_n_noting(n: int):
            blocks = popleft_n(n)
            for b in blocks:
                if b.block_hash is not None:
                    self._reused[b.block_id] = b.block_hash
            self._moved(-len(blocks))
            return blocks

        def prepend_n_noting(blocks) -> None:
            prepend_n(blocks)
            self._moved(len(blocks))

        def remove_noting(block) -> None:
            if block.block_hash is None:  # (not a revived block: the run may have lost one)
                self._cold = None
            remove(block)

        def popleft_noting():
            block = popleft()
            self._moved(-1)
            return block

        queue.popleft_n = popleft_n_noting
        queue.remove = remove_noting
        queue.popleft = popleft_noting
        queue.prepend_n = prepend_n_noting

    def _moved(self, n: int) -> None:
        """``n`` blocks came to the head of the queue (taken from it, if negative)."""
        self._shift += n
        if self._cold is not None:
            run_end, at = self._cold
            self._cold = (run_end, at + n) if at + n >= 0 else None

    def head_shift(self) -> int:
        self._shift, shift = 0, self._shift
        return shift

    def take_reused(self) -> list[tuple[int, EngineBlockKey]]:
        out, self._reused = list(self._reused.items()), {}
        return out

    def iter_free(self, limit: int, start: int | None = None, at: int = 0) -> Iterator[tuple[int, int, EngineBlockKey]]:
        # (the queue's own links, walked here: its iter_blocks_after and the blocks' hash property
        # cost a generator frame and a call per block, most of the walk on a large pool)
        queue = self.pool.free_block_queue
        tail = queue.fake_free_list_tail
        block, i = queue.fake_free_list_head.next_free_block, 0
        cold = self._counted  # (walking the run of never-used blocks at the head)
        if start is not None and self.pool.blocks[start].prev_free_block is not None:
            block, i = self.pool.blocks[start], at  # (a block out of the queue: from the head)
            cold = False
        elif cold and self._cold is not None:
            run_end, at_end = self._cold
            if run_end.prev_free_block is not None and run_end.block_hash is None:
                block, i = run_end, at_end
        while i < limit and block is not None and block is not tail:
            h = block.block_hash
            if h is not None:
                cold = False
                yield i, block.block_id, h
            elif cold:
                self._cold = (block, i)
            i += 1
            block = block.next_free_block

    def cached_block(self, block_hash: EngineBlockKey) -> int | None:
        b = self.pool.cached_block_hash_to_block.get_one_block(block_hash)
        return None if b is None else b.block_id

    def block_hash(self, block_id: int) -> EngineBlockKey | None:
        return self.pool.blocks[block_id].block_hash

    def held(self, block_id: int) -> bool:
        return self.pool.blocks[block_id].ref_cnt > 0
