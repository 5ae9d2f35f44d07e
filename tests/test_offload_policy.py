"""The lazy offload policy's rules, on vLLM's real BlockPool (through lmkv's adapter), and the simulator."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lmkv.config import OffloadConfig  # noqa: E402
from lmkv.offload.lazy import LazyOffload  # noqa: E402
from lmkv.offload.reuse import MIN_WATCH_STEPS  # noqa: E402
from lmkv.offload.sim import SimConfig, distinct_blocks, make_manager, make_request, simulate  # noqa: E402
from lmkv.offload.traces import generate, load, save  # noqa: E402

BS = 16


@pytest.fixture
def engine():
    """A real KVCacheManager with 64 blocks and a helper that runs a request to completion."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from lmkv.connectors.vllm_pool import VllmFreeQueue

    mgr = make_manager(64, BS)

    def finish(rid: str, tokens: list[int]) -> list[bytes]:
        req = make_request(rid, tokens, 1, BS)
        blocks, hit, *_ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None
        req.num_computed_tokens = len(tokens)
        mgr.free(req)
        return [make_block_hash_with_group_id(h, 0) for h in req.block_hashes]

    return mgr, VllmFreeQueue(mgr.block_pool), finish


def _policy(tier: set, **kw) -> LazyOffload:
    return LazyOffload(OffloadConfig(**{"policy": "lazy", "watermark_blocks": 0, "horizon_steps": 1.0,
                                        "ema_alpha": 1.0, **kw}),
                       1 << 20, tier.__contains__)


def test_with_a_declared_link_danger_depth_follows_the_allocation_rate():
    p = _policy(set(), ema_alpha=0.5, horizon_steps=4, link_bytes_per_step=1 << 30)
    assert p.danger_depth() == 0
    p.note_step(10)
    assert p.danger_depth() == 4 * 5
    p.note_step(10)
    assert p.danger_depth() == 4 * 7.5
    p.note_step(0)
    assert p.danger_depth() == 15  # it decays when the engine allocates less


def test_without_a_link_the_zone_is_the_next_steps_demand():
    """Just in time: the zone covers what the next step is known to take plus the largest share of new
    requests a step took lately (fading), and the steps after it only where one step's link time
    cannot copy them all."""
    p = _policy(set(), ema_alpha=0.5, horizon_steps=4, watermark_blocks=16)
    p.note_step(0)
    p.note_demand(3)  # three decodes cross a page boundary next step
    assert p.danger_depth() == 3  # (horizon_steps and watermark_blocks are the declared link's)
    p.note_step(3)  # it took what was known of it
    assert p.unforeseen_burst == 0
    p.note_step(40)  # a new prompt's 40 blocks were known to none
    p.note_demand(2)
    assert p.danger_depth() == 2 + 40
    for _ in range(300):
        p.note_step(0)
    assert p.danger_depth() < 20  # the burst fades
    slow = _policy(set(), ema_alpha=1.0)
    slow.note_step(0)
    slow.note_demand(6)
    slow.note_step(6)  # as known: no burst; 6 blocks a step lately
    slow.note_demand(10)
    assert slow.danger_depth() == 10
    slow.observe_copies(bytes_per_s=8 << 20, step_s=1.0)  # a slow link: 4 pages of 1 MiB a step (half its time)
    assert slow.danger_depth() == 10 + 2 * 6  # 10 blocks take 3 steps of copies: 2 more steps' allocations


def test_only_the_danger_zone_is_planned_and_the_free_queue_is_left_as_it_was(engine):
    """A planned block stays in the free queue (the workers copy it in the step that plans it, before
    any later forward can write it): vLLM's cache evicts exactly what it would without lmkv."""
    mgr, queue, finish = engine
    chain = finish("a", list(range(3, 3 + 4 * BS)))  # 4 hashed blocks now free, tail first in eviction order
    tier: set = set()
    p = _policy(tier)
    p.note_chain(chain)
    p.note_step(1)  # depth 1: only the head of the queue is in danger
    free_before = mgr.block_pool.get_num_free_blocks()
    # the queue's head holds never-used (unhashed) blocks; the chain sits at its tail, out of danger
    order = [h for _, _, h in queue.iter_free(1 << 20)]
    assert p.plan(queue) == []
    p.note_step(200)  # a burst: everything is in danger
    picks = p.plan(queue)
    # the whole chain, in the engine's eviction order (its last page first; each page's earlier ones wait
    # behind it in the queue, owed their copies)
    assert [x.block_hash for x in picks] == chain[::-1]
    assert not any(x.rescue for x in picks)  # still in the queue: copied during the step's forward
    assert mgr.block_pool.get_num_free_blocks() == free_before and [h for _, _, h in queue.iter_free(1 << 20)] == order
    assert all(queue.block_hash(x.block_id) == x.block_hash for x in picks)  # the snapshot holds this step
    assert p.plan(queue) == []  # in flight: not planned twice
    tier.update(x.block_hash for x in picks)
    p.done(picks)
    assert not p.inflight and [h for _, _, h in queue.iter_free(1 << 20)] == order


@pytest.mark.parametrize("link", [None, 1 << 30])
def test_prefix_closure_copies_or_owes_cached_ancestors_and_skips_broken_chains(engine, link):
    """With a declared link a block's cached ancestors go with it (oldest first); without one each is copied
    when it comes due (after it: the engine evicts a chain's last page first). Either way a page after a
    hole is never copied."""
    mgr, queue, finish = engine
    chain = finish("a", list(range(3, 3 + 4 * BS)))
    tier: set = {chain[0]}
    p = _policy(tier, link_bytes_per_step=link)
    p.note_chain(chain)
    p.note_step(200)
    picks = p.plan(queue)
    assert [x.block_hash for x in picks] == (chain[1:] if link else chain[:0:-1])  # the first page is in lmkv
    p.done(picks)
    # now break the chain: evict page 1 from the engine while lmkv lacks it
    p2 = _policy(set(), link_bytes_per_step=link)
    p2.note_chain(chain)
    mgr.block_pool.evict_blocks({queue.cached_block(chain[1])})
    p2.note_step(200)
    picks = p2.plan(queue)
    assert [x.block_hash for x in picks] == chain[:1]  # pages after the hole are unreachable: not copied
    assert p2.stats.unreachable >= 1


def test_closure_stops_at_an_ancestor_a_running_request_holds(engine):
    """A running request holds the shared system prompt: a finished request's pages after it are
    copied without it (the engine keeps it while it is held; it is judged like any block once it
    is freed and nears reuse)."""
    mgr, queue, finish = engine
    system = list(range(3, 3 + 2 * BS))
    chain = finish("a", system + list(range(100, 100 + 2 * BS)))
    running = make_request("b", system + list(range(500, 500 + BS)), 1, BS)  # holds the system prompt
    blocks, hit, *_ = mgr.get_computed_blocks(running)
    assert hit == 2 * BS and mgr.allocate_slots(running, BS, hit, blocks) is not None
    p = _policy(set())
    p.note_chain(chain)
    p.note_step(200)
    picks = p.plan(queue)
    assert [x.block_hash for x in picks] == chain[:1:-1]
    p.done(picks)
    mgr.free(running)


@pytest.mark.parametrize("link", [False, True])
def test_a_drain_cap_takes_the_pages_nearest_reuse_first(engine, link):
    """Two pages a step: without a declared link, the two the engine reuses first (the chain's last); with
    one, a block's cached ancestors go with it, and a chain's oldest pages are kept first (a prefix is
    useful on its own)."""
    mgr, queue, finish = engine
    chain = finish("a", list(range(3, 3 + 6 * BS)))
    p = _policy(set(), **({"link_bytes_per_step": 2 << 20} if link else {"drain_bytes_per_step": 2 << 20}))
    p.note_chain(chain)
    p.note_step(200)
    first = p.plan(queue)
    assert [x.block_hash for x in first] == (chain[:2] if link else chain[:-3:-1])
    assert p.stats.capped_steps == link  # (a chain cut short)
    p.done(first)


@pytest.mark.parametrize("pages_per_step, expected", [(1.5, [1, 2, 1, 2]), (0.5, [0, 1, 0, 1]), (2, [2, 2, 2, 2])])
def test_a_cap_of_a_fraction_of_pages_is_kept_on_average(engine, pages_per_step, expected):
    """A link of 1.5 pages a step copies 1, 2, 1, 2 pages (not 1 every step: a third less than
    declared); unused budget is not banked beyond a page."""
    mgr, queue, finish = engine
    chain = finish("a", list(range(3, 3 + 12 * BS)))
    tier: set = set()
    p = _policy(tier, drain_bytes_per_step=int(pages_per_step * (1 << 20)))
    p.note_chain(chain)
    counts = []
    for _ in expected:
        p.note_step(200)
        picks = p.plan(queue)
        counts.append(len(picks))
        tier.update(x.block_hash for x in picks)
        p.done(picks)
    assert counts == expected
    tier.clear()
    idle = _policy(tier, drain_bytes_per_step=int(pages_per_step * (1 << 20)))
    for _ in range(5):
        idle.plan(queue)  # nothing to copy: steps pass with the budget unused
    idle.note_chain(chain)
    idle.note_step(200)
    assert len(idle.plan(queue)) == int(pages_per_step + 1)  # at most one page carried over


def test_blocks_a_step_handed_out_are_rescued_before_its_forward(engine):
    """A burst (a long new prompt) takes cached blocks the zone did not reach. Their bytes are intact
    until the step's forward writes them, so the plan of that step copies them (rescues), with their
    closure: an ancestor taken in the same step is rescued too, one still in the queue is owed its copy
    when it comes due (here in this very step: the zone now reaches as far as a burst like this one).
    Rescued blocks are the step's requests' now; the others stay in the free queue."""
    mgr, queue, finish = engine
    pool = mgr.block_pool
    a = finish("a", list(range(3, 3 + 3 * BS)))
    b = finish("b", list(range(500, 500 + 2 * BS)))
    p = _policy(set(), ema_alpha=0.01)
    p.note_chain(a)
    p.note_chain(b)
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)  # never-used blocks: nothing to rescue
    p.note_step(0)
    assert p.plan(queue) == []
    # the queue's head is now a's chain, deepest page first, then b's: take a[2] and a[1]
    assert [h for _, _, h in queue.iter_free(1 << 20)] == a[::-1] + b[::-1]
    pool.get_new_blocks(2)
    p.note_step(2)
    picks = p.plan(queue)
    by_hash = {x.block_hash: x for x in picks}
    # the rescued (closure order), then the zone of a burst of 2: a[0] (owed) and b[1]
    assert [x.block_hash for x in picks] == [a[1], a[2], a[0], b[1]]
    assert by_hash[a[1]].rescue and by_hash[a[2]].rescue and not by_hash[a[0]].rescue and not by_hash[b[1]].rescue
    assert p.stats.rescued == 2
    assert pool.get_num_free_blocks() == 3  # a[0] and b stay in the queue
    p.done(picks)
    # with a declared link (busy: a copy before the forward would wait behind it) nothing is rescued
    linked = _policy(set(), ema_alpha=0.01, link_bytes_per_step=1 << 30)
    linked.note_chain(b)
    pool.get_new_blocks(2)  # b's blocks
    linked.note_step(2)
    assert not any(x.rescue for x in linked.plan(queue)) and linked.stats.rescued == 0


def test_an_ancestor_left_in_the_engine_is_copied_when_due_whatever_the_estimate_says(engine):
    """Without a link a block's earlier pages are copied when they come due, not with it. Were the need
    estimate to let blocks like them go then, the copied page would be an orphan (never hit): they
    are owed their copies. A block no copied page depends on is skipped as the estimate says."""
    mgr, queue, finish = engine
    pool = mgr.block_pool
    a = finish("a", list(range(3, 3 + 3 * BS)))
    b = finish("b", list(range(500, 500 + 2 * BS)))
    tier: set = set()
    p = _policy(tier, ema_alpha=0.01)
    p.note_chain(a)
    p.note_chain(b)
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)  # the head: a's chain, last page first, then b's
    p.note_step(0)
    p.note_demand(1)
    picks = p.plan(queue)
    assert [x.block_hash for x in picks] == [a[2]]  # a[1] and a[0] wait behind it in the queue
    tier.update(x.block_hash for x in picks)
    p.done(picks)
    p.reuse.skippable = lambda h, step: True  # from now on the estimate would let every block go
    p.note_step(0)
    p.note_demand(4)
    picks = p.plan(queue)
    assert [x.block_hash for x in picks] == [a[1], a[0]]  # owed (a[0] by a[1]); b[1] is skipped
    assert p.stats.unlikely >= 1


def test_a_rescue_needs_its_whole_prefix(engine):
    """A block whose ancestor the engine dropped (here without handing it out: its bytes may be a
    failed load's, never a rescue) cannot be hit: no rescue."""
    mgr, queue, finish = engine
    pool = mgr.block_pool
    a = finish("a", list(range(3, 3 + 2 * BS)))
    p = _policy(set(), ema_alpha=0.01)
    p.note_chain(a)
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    p.note_step(0)
    assert p.plan(queue) == []
    order = [h for _, _, h in queue.iter_free(1 << 20)]
    assert order == a[::-1]
    pool.get_new_blocks(1)  # a[1] taken
    pool.evict_blocks({queue.cached_block(a[0])})  # a[0] dropped, not handed out
    p.note_step(1)
    assert p.plan(queue) == []
    assert p.stats.unreachable == 1 and p.stats.rescued == 0


def test_a_page_cached_again_in_another_block_is_not_rescued(engine):
    mgr, queue, finish = engine
    pool = mgr.block_pool
    tokens = list(range(3, 3 + 2 * BS))
    a = finish("a", tokens)
    p = _policy(set(), ema_alpha=0.01)
    p.note_chain(a)
    held = pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    p.note_step(0)
    assert p.plan(queue) == []
    pool.get_new_blocks(1)  # a[1] taken, a[0] at the head
    pool.free_blocks(held[:2])  # room for the next request (never-used blocks, at the head)
    again = make_request("again", tokens + [7], 1, BS)  # the same pages: a[0] hit, a[1] cached anew
    blocks, hit, *_ = mgr.get_computed_blocks(again)
    assert hit == BS
    assert mgr.allocate_slots(again, len(tokens) + 1 - hit, hit, blocks) is not None
    assert queue.cached_block(a[1]) is not None
    p.note_step(2)
    assert p.plan(queue) == []  # its new block is not computed yet: nothing to copy


def test_with_a_declared_link_a_burst_makes_blocks_ahead_of_it_due(engine):
    """A link cannot copy a burst in the step that takes it: the policy remembers how many cached
    blocks the largest step lately took (fading) and treats as many at the head as due."""
    mgr, queue, finish = engine
    pool = mgr.block_pool
    chains = [finish(f"r{i}", list(range(1000 * i + 3, 1000 * i + 3 + 2 * BS))) for i in range(4)]
    tier = set(chains[0] + chains[1])  # the first two are in lmkv already (skipped, still counted)
    p = _policy(tier, ema_alpha=0.01, link_bytes_per_step=1 << 30)
    for c in chains:
        p.note_chain(c)
    held = pool.get_new_blocks(pool.get_num_free_blocks() - 8)  # never-used blocks: no eviction
    p.note_step(len(held))
    assert p.plan(queue) == [] and p.burst_evicted == 0  # depth 1: the head is in lmkv
    taken = pool.get_new_blocks(4)  # a burst: takes the two chains in lmkv
    p.note_step(len(taken))
    picks = p.plan(queue)
    assert p.burst_evicted == 4 and p.danger_depth() == 1
    assert {x.block_hash for x in picks} == set(chains[2] + chains[3])
    p.done(picks)
    for _ in range(1000):
        p.note_step(0)
        p.plan(queue)
    assert p.burst_evicted < 1  # it fades


def test_the_zone_is_walked_only_until_the_steps_copies_are_planned(engine):
    mgr, queue, finish = engine
    chains = [finish(f"r{i}", list(range(100 * i + 3, 100 * i + 3 + 2 * BS))) for i in range(4)]
    p = _policy(set(), drain_bytes_per_step=1 << 20)  # one page per step
    for c in chains:
        p.note_chain(c)
    p.note_step(200)  # everything is in danger
    walked = []
    inner = queue.iter_free

    def counting(limit, start=None, at=0):
        for entry in inner(limit, start, at):
            walked.append(entry)
            yield entry

    queue.iter_free = counting
    (pick,) = p.plan(queue)
    assert pick.block_hash == chains[0][-1]  # the head of the queue: the chain's last page
    free = mgr.block_pool.get_num_free_blocks()
    assert walked[-1][2] == chains[0][-1] and len(walked) < free  # stopped at the first candidate


def test_the_blocks_nearest_the_head_go_first_under_a_cap(engine):
    """However often a prefix was used: the first block to be lost is the first copied."""
    mgr, queue, finish = engine
    a = finish("a", list(range(100, 100 + 2 * BS)))
    b = finish("b", list(range(500, 500 + 2 * BS)))  # freed after a: nearer the tail
    p = _policy(set(), drain_bytes_per_step=1 << 20)
    p.note_chain(b)
    p.note_chain(b)  # b's prefix was used twice
    p.note_chain(a)
    p.note_step(200)
    (pick,) = p.plan(queue)
    assert pick.block_hash == a[-1]  # a's chain, its last page first (the engine frees it first)


def test_traces_round_trip_through_parquet(tmp_path):
    trace = generate("mixed", seed=3, scale=0.3)
    save(trace, str(tmp_path / "t.parquet"))
    assert load(str(tmp_path / "t.parquet")) == trace
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["x"]}), str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match="missing columns"):
        load(str(tmp_path / "bad.parquet"))


def test_simulator_lazy_writes_about_what_eviction_does():
    """The copy-at-eviction bound (exactly the blocks vLLM evicts, copied as it evicts them) keeps every hit
    eager keeps; lazy offload, told what the connector knows of the next step, writes about as much as it
    and little that a prefix hit revives first."""
    trace = generate("mixed", seed=5, scale=3.0)
    cfg = SimConfig(num_blocks=max(256, distinct_blocks(trace, 32) // 2))
    eager, evict, lazy = (simulate(trace, cfg, p) for p in ("eager", "evict", "lazy"))
    assert evict.hit_tokens == eager.hit_tokens and evict.wasted_writes == 0 and evict.writes < eager.writes
    assert lazy.writes <= 1.05 * evict.writes
    assert lazy.hit_tokens >= 0.99 * eager.hit_tokens
    assert lazy.wasted_writes <= 0.03 * lazy.writes and lazy.stale_writes == 0


def test_simulator_lazy_writes_less_than_eager_and_never_stale():
    trace = generate("documents", seed=2, scale=0.5)
    cfg = SimConfig(num_blocks=max(256, distinct_blocks(trace, 32) // 2))
    none, eager, lazy = (simulate(trace, cfg, p) for p in ("none", "eager", "lazy"))
    assert none.bytes_written == 0 and none.oracle_blocks
    assert lazy.bytes_written < eager.bytes_written
    assert lazy.stale_writes == 0
    assert lazy.hit_tokens >= 0.97 * eager.hit_tokens


def test_one_shot_families_are_a_class_and_with_a_link_not_copied_unless_shown_needed(engine):
    """A family (same first page) whose prompts never repeat the rest: with a declared link its blocks
    are not copied unless the need estimate shows blocks like them needed; without one, its blocks
    are a class of their own for the need estimate (copied until blocks like them are shown, in
    enough lineages, not to be needed)."""
    mgr, queue, finish = engine
    once = finish("once", list(range(3, 3 + 3 * BS)))
    kept = finish("kept", list(range(900, 900 + 3 * BS)))
    for link in (1 << 30, None):
        p = _policy(set(), min_family_requests=3, min_reuse_rate=0.2, link_bytes_per_step=link)
        p.note_chain(once)
        for i in range(2):  # more prompts of the same family (first page), never repeating the rest
            p.note_chain([once[0], bytes([i]) * 36, bytes([i + 9]) * 36])
        for _ in range(3):  # the same prompt again and again: a family that repeats (never served from
            p.note_chain(kept)  # cache here, which must not count against it)
        for _ in range(MIN_WATCH_STEPS):  # a family is judged on requests older than its reuse horizon
            p.note_step(0)
        p.note_step(200)
        assert p.reuse.one_shot(once[1], p._step) and not p.reuse.one_shot(kept[1], p._step)
        picks = {x.block_hash for x in p.plan(queue)}
        assert picks == (set(kept) if link else set(kept) | set(once))
        assert p.reuse._class(once[2], p._step)[0] and not p.reuse._class(kept[2], p._step)[0]
        if link:  # the estimate shows blocks like these needed after all (a third of 30 lineages'):
            c = p.reuse._class(once[2], p._step)  # the evidence overrides the family rule
            for i in range(30):
                p.reuse.need.add(c, f"lineage{i}", needed=i % 3 == 0)
            assert p.reuse.one_shot(once[2], p._step) and {x.block_hash for x in p.plan(queue)} == set(once)


def test_a_declared_link_is_kept_busy_with_early_copies_of_fresh_blocks(engine):
    """With offload.link_bytes_per_step, link time the danger zone leaves goes to freshly computed
    blocks, oldest first, one-shot families skipped; without it nothing is copied early."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    mgr, queue, finish = engine
    running = make_request("run", list(range(500, 500 + 4 * BS)), 8, BS)  # still running: not in the free queue
    blocks, hit, *_ = mgr.get_computed_blocks(running)
    assert mgr.allocate_slots(running, 4 * BS - hit, hit, blocks) is not None
    fresh = [make_block_hash_with_group_id(h, 0) for h in running.block_hashes]
    idle = _policy(set())
    idle.note_chain(fresh)
    idle.note_computed(fresh)
    assert idle.plan(queue) == []  # nothing is due: a lazy policy waits
    tier: set = set()
    busy = _policy(tier, link_bytes_per_step=3 << 20)  # three 1 MiB pages per step
    busy.note_chain(fresh)
    busy.note_computed(fresh)
    picks = busy.plan(queue)
    assert [x.block_hash for x in picks] == fresh[:3] and busy.stats.filled == 3
    assert all(mgr.block_pool.blocks[x.block_id].ref_cnt == 1 for x in picks)  # held by the request alone
    tier.update(x.block_hash for x in picks)
    busy.done(picks)
    assert [x.block_hash for x in busy.plan(queue)] == fresh[3:]


def test_a_short_link_copies_due_blocks_before_fresh_ones(engine):
    """A declared link of one page per step: the block about to be reused is copied first, a fresh
    block only with the link time left over (fresh first measured 0.92x eager's losses under a
    budget, due first 0.81x)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    mgr, queue, finish = engine
    done = finish("old", list(range(3, 3 + 2 * BS)))  # its blocks wait in the free queue
    running = make_request("run", list(range(500, 500 + 2 * BS)), 8, BS)
    blocks, hit, *_ = mgr.get_computed_blocks(running)
    assert mgr.allocate_slots(running, 2 * BS - hit, hit, blocks) is not None
    fresh = [make_block_hash_with_group_id(h, 0) for h in running.block_hashes]
    tier: set = set()
    p = _policy(tier, link_bytes_per_step=1 << 20)
    p.note_chain(done)
    p.note_chain(fresh)
    p.note_computed(fresh)
    p.note_step(200)  # a burst: every free block is in danger
    for expected in done:  # closure order: the chain's first page first
        picks = p.plan(queue)
        assert [x.block_hash for x in picks] == [expected] and p.stats.filled == 0
        tier.add(expected)
        p.done(picks)
    picks = p.plan(queue)  # nothing due is left: the link goes to the fresh blocks
    assert [x.block_hash for x in picks] == [fresh[0]] and p.stats.filled == 1


def test_without_a_link_blocks_seldom_needed_again_are_not_copied(engine):
    """A due block of a class that was seldom needed again (a question's tail: used once, in a
    lineage that branches), as observed in enough lineages for the 95% bound to be below
    min_need_rate, is skipped; with a declared link its copy is made anyway (the link's time is
    there to be spent)."""
    from lmkv.offload.reuse import BRANCHES

    mgr, queue, finish = engine
    sys_, doc_a, doc_b = list(range(3, 3 + BS)), list(range(100, 100 + BS)), list(range(200, 200 + BS))
    chains = [finish(f"r{i}", sys_ + doc + list(range(q, q + BS)))
              for i, (doc, q) in enumerate([(doc_a, 300), (doc_a, 400), (doc_b, 500), (doc_b, 600)])]
    tails = {c[-1] for c in chains[2:]}  # doc B's questions: its lineage branched
    for link in (None, 1 << 30):
        p = _policy(set(), link_bytes_per_step=link)
        for c in chains:
            p.note_chain(c)
        p.note_step(200)  # a burst: everything is in danger
        assert all(p.reuse._class(t, p._step)[1:3] == (1, BRANCHES) for t in tails)
        for t in tails:  # blocks like these, from 30 lineages, were never needed again
            for i in range(30):
                p.reuse.need.add(p.reuse._class(t, p._step), f"lineage{i}", needed=False)
        picks = p.plan(queue)
        copied = {x.block_hash for x in picks}
        assert chains[2][1] in copied  # doc B's body: no evidence against it
        if link is None:
            assert not tails & copied and p.stats.unlikely >= 2
        else:
            assert tails <= copied and p.stats.unlikely == 0
        p.done(picks)  # back in the free queue for the next policy


def test_the_mooncake_trace_replays_with_the_prefixes_it_shares():
    """Each 512-token block hash becomes the same tokens wherever it appears; prompts are cut to
    their input length, arrive at timestamp // 40 ms, and produce at most 32 tokens."""
    import gzip
    import json
    from importlib.resources import files

    from lmkv.offload.traces import mooncake

    path = str(files("lmkv.benchmarks").joinpath("traces/mooncake_conversation.jsonl.gz"))
    with gzip.open(path, "rt") as f:
        raw = [json.loads(line) for line in f]
    trace = mooncake(path, seconds=20)
    assert len(trace) == sum(1 for r in raw if r["timestamp"] < 20_000)
    for req, r in zip(trace, raw):
        assert len(req.prompt) == r["input_length"] and req.arrival == r["timestamp"] // 40
        assert 1 <= len(req.output) <= 32
    a, b = raw[0], raw[1]  # both open with hash 0, then differ
    shared = next(i for i, (x, y) in enumerate(zip(a["hash_ids"], b["hash_ids"])) if x != y)
    assert shared >= 1
    assert trace[0].prompt[: 512 * shared] == trace[1].prompt[: 512 * shared]
    assert trace[0].prompt[512 * shared : 512 * shared + 512] != trace[1].prompt[512 * shared : 512 * shared + 512]


def test_lmcaches_policy_replays_beside_lmkvs():
    """LMCache 0.5.6's eviction-aware queue in the same simulator: it never writes a recycled block,
    writes no more than eager, and what it wrote serves tier hits. (In a process of its own: lmcache
    imports numba, whose objects break vLLM's kernel dispatcher in engines started later in the
    same process.)"""
    import json
    import subprocess
    import sys

    from lmkv.offload.peer import available

    if (why := available()) is not None:
        pytest.skip(why)
    code = ("import json\n"
            "from lmkv.offload.sim import SimConfig, distinct_blocks, simulate\n"
            "from lmkv.offload.traces import generate\n"
            "trace = generate('mixed', seed=2, scale=0.5)\n"
            "cfg = SimConfig(num_blocks=max(256, distinct_blocks(trace, 32) // 2))\n"
            "runs = {p: simulate(trace, cfg, p) for p in ('eager', 'lmcache')}\n"
            "print(json.dumps({p: [r.bytes_written, r.hit_tokens, r.stale_writes] for p, r in runs.items()}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    (eager_bytes, _, _), (peer_bytes, peer_hits, peer_stale) = got["eager"], got["lmcache"]
    assert peer_stale == 0
    assert 0 < peer_bytes <= eager_bytes
    assert peer_hits > 0


@pytest.mark.parametrize("page_bytes", [256 << 10, 4 << 20])
def test_the_drain_cap_is_link_time_whatever_the_page_size(page_bytes):
    """Without a fixed cap a step plans drain_link_share of its time on the copy link at the workers'
    measured rate (unbounded until measured), and never fewer pages than the step took."""
    p = LazyOffload(OffloadConfig(policy="lazy", drain_link_share=0.5), page_bytes, set().__contains__)
    assert p.measured_cap and p.budget.refill() > 1 << 30
    p.observe_copies(25e9, 0.04)  # 25 GB/s, 40 ms steps: 500 MB a step
    assert p.budget.bytes_per_step == int(0.5 * 25e9 * 0.04)
    p.budget.credit = 0
    assert p.budget.refill() == int(0.5 * 25e9 * 0.04) // page_bytes
    fixed = LazyOffload(OffloadConfig(policy="lazy", drain_bytes_per_step=1 << 20), page_bytes, set().__contains__)
    fixed.observe_copies(25e9, 0.04)
    assert not fixed.measured_cap and fixed.budget.bytes_per_step == 1 << 20


def test_a_step_may_copy_as_many_blocks_as_it_took(engine):
    """A burst's step takes more blocks than a lagging measure of link time allows: it may still copy
    as many as it took (computing them took longer than copying them out)."""
    mgr, queue, finish = engine
    chain = finish("a", list(range(3, 3 + 6 * BS)))
    mgr.block_pool.get_new_blocks(mgr.block_pool.get_num_free_blocks() - 6)  # the chain at the queue's head
    p = _policy(set())
    p.observe_copies(1 << 20, 1.0)  # one 1 MiB page a step by link time
    p.note_chain(chain)
    p.note_step(4)  # the step took four blocks
    assert len(p.plan(queue)) == 4


def test_the_simulator_tells_lazy_what_the_connector_does_and_costs_the_engine_nothing():
    """The engine's own prefix-cache hits with lazy offload are exactly those without offload (the
    policy never moves a block in the free queue), and every planned block is copied intact."""
    trace = generate("mixed", seed=4, scale=0.5)
    cfg = SimConfig(num_blocks=max(256, distinct_blocks(trace, 32) // 2))
    none, lazy = simulate(trace, cfg, "none"), simulate(trace, cfg, "lazy")
    assert lazy.engine_hit_tokens == none.engine_hit_tokens > 0
    assert lazy.stale_writes == 0 and lazy.writes > 0 and lazy.need_classes


def test_a_short_link_copies_the_blocks_more_likely_needed_first(engine):
    """With a declared link that cannot copy every due block, a block whose class was seldom needed
    again ranks below one without such evidence, though nearer the head: the link copies the block
    more likely needed first, and the other only with link time left over (never skipped)."""
    mgr, queue, finish = engine
    a = finish("a", list(range(100, 100 + 2 * BS)))  # nearer the head
    b = finish("b", list(range(500, 500 + 2 * BS)))
    for link_pages in (1, 4):
        tier: set = set()
        p = _policy(tier, link_bytes_per_step=link_pages << 20)
        p.note_chain(a)
        p.note_chain(b)
        p.note_chain(b)  # b's blocks were used twice: a class of their own
        p.note_step(200)  # a burst: every free block is due
        for h in a:  # blocks like a's, from 30 lineages, were never needed again
            for i in range(30):
                p.reuse.need.add(p.reuse._class(h, p._step), f"lineage{i}", needed=False)
        assert p.reuse.need_score(a[0], p._step) < p.reuse.need_score(b[0], p._step) == 1.0
        picks = [x.block_hash for x in p.plan(queue)]
        if link_pages == 1:
            assert picks == [b[0]]  # b's chain, its first page first
        else:
            assert picks == [*b, *a]


def test_under_a_link_the_walk_resumes_past_the_blocks_lmkv_holds(engine):
    """Under a declared link, the blocks lmkv copied sit at the queue's head until the engine takes them:
    the next walk starts at the first block the last walk found worth a copy (a mark) instead of passing
    them again, and plans what a walk from the head would; a mark whose block a request revived is
    dropped (the walk starts at the head again)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    mgr, queue, finish = engine
    chains = [finish(f"r{i}", list(range(100 * i + 3, 100 * i + 3 + 2 * BS))) for i in range(4)]
    tier = set(chains[0] + chains[1])  # lmkv holds the two chains nearest the head
    walks: list[list] = []
    inner = queue.iter_free

    def logging(limit, start=None, at=0):
        walks.append([])
        for entry in inner(limit, start, at):
            walks[-1].append(entry)
            yield entry

    queue.iter_free = logging
    p = _policy(tier, link_bytes_per_step=1 << 20)
    for c in chains:
        p.note_chain(c)
    p.note_step(200)
    (first,) = p.plan(queue)
    # (vLLM frees a request's blocks last first: a chain's last block is the nearer the head)
    assert first.block_hash == chains[2][0] and walks[-1][0][2] == chains[0][1]
    tier.add(first.block_hash)
    p.done([first])
    p.note_step(200)
    (second,) = p.plan(queue)
    assert walks[-1][0][2] == chains[2][1]  # resumed where the blocks lmkv held from the head ended
    fresh = _policy(set(tier), link_bytes_per_step=1 << 20)
    for c in chains:
        fresh.note_chain(c)
    fresh.note_step(200)
    assert second.block_hash == fresh.plan(queue)[0].block_hash == chains[2][1]
    tier.add(second.block_hash)
    p.done([second])
    p.note_step(200)
    p.plan(queue)
    assert walks[-1][0][2] == chains[2][1] and walks[-1][-1][2] == chains[3][0]  # the mark moves on to chain 3
    # a request revives chain 3's blocks (the mark's among them): the next walk starts at the head
    req = make_request("again", list(range(303, 303 + 2 * BS)) + [1], 1, BS)
    blocks, hit, *_ = mgr.get_computed_blocks(req)
    assert hit == 2 * BS and [make_block_hash_with_group_id(h, 0) for h in req.block_hashes] == chains[3]
    assert mgr.allocate_slots(req, 1, hit, blocks) is not None
    p.note_step(200)
    p.plan(queue)
    assert walks[-1][0][2] == chains[0][1]
    null = mgr.block_pool.null_block.block_id  # never in the free queue: asked to start there, it starts at the head
    assert list(inner(1 << 20, null, 99)) == list(inner(1 << 20))


def test_a_walk_from_the_head_starts_past_the_never_used_blocks_it_passed_before(engine):
    """A large pool's queue begins with thousands of never-used blocks: a walk from the head starts where
    the last one found them end, moved by what the engine took from the head and put back there since
    (blocks without a hash go back to the head): the same blocks at the same places as a walk from the
    head."""
    mgr, queue, finish = engine
    pool = mgr.block_pool

    def from_head() -> list:
        queue._cold = None
        return list(queue.iter_free(1 << 20))

    a = finish("a", list(range(3, 3 + 2 * BS)))
    expected = from_head()
    assert expected[0][0] == 61 and queue._cold[1] == 60  # (63 free blocks: 61 never used, then a's two)
    assert list(queue.iter_free(1 << 20)) == expected
    taken = pool.get_new_blocks(5)  # the engine takes five never-used blocks from the head
    assert queue._cold[1] == 55 and list(queue.iter_free(1 << 20)) == from_head()
    pool.free_blocks(taken)  # and puts them back there: never cached
    assert queue._cold[1] == 60 and list(queue.iter_free(1 << 20)) == from_head() == expected
    b = finish("b", list(range(500, 500 + 2 * BS)))
    walk = list(queue.iter_free(1 << 20))
    assert walk == from_head() and [h for *_, h in walk] == [*a[::-1], *b[::-1]]
    assert queue.head_shift() == -4  # a's and b's pages, taken from the head and freed, cached, to the tail
