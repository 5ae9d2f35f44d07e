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

from lmkv.keys import EngineBlockKey

log = logging.getLogger(__name__)


class VllmFreeQueue:
    def __init__(self, pool) -> None:
        self.pool = pool
        #: cached blocks ``get_new_blocks`` handed out since :meth:`take_reused` (block id -> the hash it
        #: held); the queue's ``popleft_n`` is only called there, before the hashes are dropped
        self._reused: dict[int, EngineBlockKey] = {}
        queue = pool.free_block_queue
        popleft_n = getattr(queue, "popleft_n", None)
        if popleft_n is None:  # another vLLM: lazy offload works on, without rescues
            log.warning("lmkv: vLLM's free block queue has no popleft_n; blocks a burst takes are not rescued")
            return

        def popleft_n_noting(n: int):
            blocks = popleft_n(n)
            for b in blocks:
                if b.block_hash is not None:
                    self._reused[b.block_id] = b.block_hash
            return blocks

        queue.popleft_n = popleft_n_noting

    def take_reused(self) -> list[tuple[int, EngineBlockKey]]:
        out, self._reused = list(self._reused.items()), {}
        return out

    def iter_free(self, limit: int, start: int | None = None, at: int = 0) -> Iterator[tuple[int, int, EngineBlockKey]]:
        # (the queue's own links, walked here: its iter_blocks_after and the blocks' hash property
        # cost a generator frame and a call per block, most of the walk on a large pool)
        queue = self.pool.free_block_queue
        tail = queue.fake_free_list_tail
        block, i = queue.fake_free_list_head.next_free_block, 0
        if start is not None and self.pool.blocks[start].prev_free_block is not None:
            block, i = self.pool.blocks[start], at  # (a block out of the queue: from the head)
        while i < limit and block is not None and block is not tail:
            h = block.block_hash
            if h is not None:
                yield i, block.block_id, h
            i += 1
            block = block.next_free_block

    def cached_block(self, block_hash: EngineBlockKey) -> int | None:
        b = self.pool.cached_block_hash_to_block.get_one_block(block_hash)
        return None if b is None else b.block_id

    def block_hash(self, block_id: int) -> EngineBlockKey | None:
        return self.pool.blocks[block_id].block_hash

    def held(self, block_id: int) -> bool:
        return self.pool.blocks[block_id].ref_cnt > 0
