"""lmkv's page events as vLLM's KV events (``BlockStored`` / ``BlockRemoved``), for KV-aware routers.

:class:`lmkv.engine.events.EventLog` says what lmkv holds where, in page keys; a router knows
vLLM's block hashes. This module names each page by the hash of the engine block it came from
(recorded when its request was scheduled, or read from the block pool for a lazy store), with
its parent and tokens, and reports it with lmkv's medium and locality (``CPU``/``LOCAL`` in
memory, ``STORAGE`` with ``LOCAL`` for the disk tier, ``REMOTE`` for a server or Redis) and
lmkv's residency domain as ownership. vLLM's own ``offloading/events.py`` is the model.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from lmkv import threads
from lmkv.engine.events import EventLog, PageEvent
from lmkv.engine.plan import StepPlan
from lmkv.engine.residency import ResidencyDelta
from lmkv.engine.scheduler import Scheduled
from lmkv.errors import LMKVError
from lmkv.keys import ChainHash, PageKey, page_key
from lmkv.layout import GroupLayout
from lmkv.lookup import HasContains, locate

#: how often lower tiers are asked whether the pages reported on them are still there (their own
#: evictions and expiries), and about how many pages at a time
AUDIT_SECONDS = 1.0
AUDIT_PAGES = 512
#: how long a step's report waits for the lower tiers to say where the pages memory let go are
#: (they are asked on a thread of their own: a stalled tier never holds the scheduler up)
ASK_WAIT_S = 0.005


class VllmEvents:
    """The scheduler side's translator: fed each step's plan and the workers' residency reports,
    drained by vLLM's ``take_events``. Called on vLLM's scheduler thread only; lives as long as the
    connector."""

    def __init__(self, groups: Sequence[GroupLayout], group_ids: Sequence[int], tokens_per_page: int,
                 domain: str, num_blocks: int) -> None:
        """``group_ids``: vLLM's index of each of lmkv's groups; ``num_blocks``: the engine's block count
        (the block hashes remembered are bounded by it)."""
        self.groups, self.group_ids = list(groups), list(group_ids)
        self.tokens_per_page = tokens_per_page
        self.domain = domain
        self.log = EventLog()
        self.below: list[HasContains] = []  # the tiers under the workers' memory this side can ask
        self._pending: list = []
        self._audit_at = 0.0
        self._asker = threads.pool(1, "lmkv-events")  # asks the lower tiers, one question at a time
        self._asked: list[tuple[list[PageKey], Future]] = []  # questions answered late, or not yet
        self._cap = 2 * max(1, num_blocks) * max(1, len(self.groups))
        self._blocks: OrderedDict[bytes, tuple[bytes | None, bytes]] = OrderedDict()  # hash -> (parent, tokens)
        self._seen: dict[str, int] = {}  # request -> its blocks recorded in _blocks

    def expect_stores(self, scheduled: Sequence[Scheduled], plan: StepPlan, requests: dict[str, Any],
                      block_hash_of: Callable[[int], bytes | None]) -> None:
        """Tell the event log which pages this step stores, named by vLLM's own block hashes and
        tokens; the events follow once the pages are committed. ``block_hash_of(block id)``: the
        hash of a block the pool holds (a lazy store names the engine block it copies)."""
        tpp = self.tokens_per_page
        for st in scheduled:
            hashes = st.block_hashes
            # only the blocks filled since this request was last seen (a long request's earlier
            # blocks are not walked again every step)
            for p in range(self._seen.get(st.req_id, 0), len(hashes)):
                h = bytes(hashes[p])
                if h not in self._blocks:
                    parent = bytes(hashes[p - 1]) if p else None
                    self._blocks[h] = (parent, np.asarray(st.tokens[p * tpp : (p + 1) * tpp], np.int32).tobytes())
                    while len(self._blocks) > self._cap:
                        self._blocks.popitem(last=False)
            self._seen[st.req_id] = len(hashes)
        for op in [*plan.stores, *plan.rescues]:
            req = requests.get(op.req_id)
            for j, chain in enumerate(op.chains):
                known = self._hash_of(req, op.pages[j] if j < len(op.pages) else None, op.block_ids[j],
                                      block_hash_of)
                if known is None:
                    continue
                lora = req.lora_request if req is not None else None
                self.log.expect(self._key(chain, op.group), (known, self.group_ids[op.group],
                                                             lora.adapter_id if lora else None,
                                                             lora.name if lora else None))

    @staticmethod
    def _hash_of(req, page: int | None, block_id: int, block_hash_of: Callable[[int], bytes | None]) -> bytes | None:
        if req is not None and page is not None and page < len(req.block_hashes):
            return bytes(req.block_hashes[page])
        return block_hash_of(block_id)  # a lazy store: the block's own hash, while the pool still holds it

    def _key(self, chain: ChainHash, group: int) -> PageKey:
        return page_key(chain, self.groups[group])

    def forget(self, req_id: str) -> None:
        self._seen.pop(req_id, None)

    def applied(self, delta: ResidencyDelta) -> None:
        """The workers' memory changed (their step report): pages committed, or evicted and now where."""
        if delta:
            self._pending.extend(self._translate(self.log.apply(delta, self._below_of)))

    def cleared(self) -> None:
        """This engine's residency was dropped in every tier: every page it reported is gone."""
        self._pending.extend(self._translate(self.log.cleared()))

    def take(self) -> list:
        """Events since the last call, with the lower tiers' late answers and what they dropped by
        themselves (an audit at most every :data:`AUDIT_SECONDS`, :data:`AUDIT_PAGES` pages at a time)."""
        for keys, fut in [a for a in self._asked if a[1].done()]:
            self._asked.remove((keys, fut))
            if fut.exception() is None:  # (a tier that could not answer: the audit asks again later)
                self._pending.extend(self._translate(self.log.audited(keys, fut.result())))
        if self.below and not self._asked and time.monotonic() >= self._audit_at:
            self._audit_at = time.monotonic() + AUDIT_SECONDS
            keys = self.log.audit_batch(AUDIT_PAGES)
            if keys:
                self._asked.append((keys, self._asker.submit(locate, keys, self.below, True)))
        out, self._pending = self._pending, []
        return out

    def _below_of(self, keys: Sequence[PageKey]) -> list[str | None]:
        """Where the pages memory let go are, if the lower tiers answer within :data:`ASK_WAIT_S` and
        no earlier question is still out (a stalled tier); else none yet, and their events follow
        when the answer comes (:meth:`take`)."""
        if not self.below:
            return [None] * len(keys)
        idle = not self._asked
        fut = self._asker.submit(locate, keys, self.below, True)
        if idle:
            try:
                return fut.result(timeout=ASK_WAIT_S)
            except FutureTimeout:
                pass
            except (LMKVError, OSError):
                return [None] * len(keys)
        self._asked.append((list(keys), fut))
        return [None] * len(keys)

    def close(self) -> None:
        self._asker.shutdown(wait=False, cancel_futures=True)

    def _translate(self, events: list[PageEvent]) -> list:
        """lmkv's page events as vLLM's ``BlockStored``/``BlockRemoved``."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        out: list = []
        for e in events:
            h, group_idx, lora_id, lora_name = e.info
            if not e.stored:
                out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h)], medium=e.where.medium,
                                        group_idx=group_idx, locality=e.where.locality, ownership=self.domain))
                continue
            parent, toks = self._blocks.get(h, (None, b""))
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h)],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                token_ids=np.frombuffer(toks, np.int32).tolist(), block_size=self.tokens_per_page,
                lora_id=lora_id, medium=e.where.medium, lora_name=lora_name, group_idx=group_idx,
                locality=e.where.locality, ownership=self.domain))
        return out
