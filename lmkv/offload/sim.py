"""Trace-driven offload simulator on vLLM's real ``KVCacheManager`` / ``BlockPool`` (no model, no forward).

A small scheduler loop admits a trace's requests (FCFS, a token budget per step,
prompts prefilled in one step), decodes one token per running request per step,
preempts the newest request when the pool is out of blocks, and frees finished
requests, whose blocks then sit in vLLM's LRU free queue until reused. Prefix
hits come from vLLM's own cache first, then from a simulated lmkv tier (the
contiguous run of blocks lmkv holds after the engine's hit).

Policies (the same trace, each in its own run):

- ``none``: nothing is written; the run also records, for the **oracle**, every
  block that was evicted and asked for again later (the only writes that can pay);
- ``eager``: every block is queued for a copy when it is computed;
- ``lazy``: :class:`lmkv.offload.lazy.LazyOffload` on the real free queue, told what the
  vLLM connector tells it (each step's full pages of each scheduled request, finished
  chains, blocks allocated, the measured copy rate and step time, and what the connector
  knows of the next step's demand: decodes crossing a page boundary and the request looked
  up and not admitted, not the requests that arrive meanwhile); every block it plans is
  written in that step, as the workers copy it during (a rescue: before) the step's forward;
- ``lmcache``: LMCache 0.5.6's eviction-aware store queue, driven as its connector drives
  it (:mod:`lmkv.offload.peer`);
- ``evict``: the copy-at-eviction bound: exactly the cached blocks vLLM evicts, each copied at
  the moment it is evicted (no reuse guessing, an unlimited link). It keeps every hit eager
  keeps, and it is the ceiling a lazy policy that does not predict reuse should reach.

A copy budget per step (``d2h_bytes_per_step``) models the host link: a queued
block evicted before its copy is *lost*. Figures per run: bytes written, tier-hit
tokens, blocks lost (evicted unwritten, then asked for), wasted writes (written,
then served from the engine's own cache), stale writes (a copy whose block no
longer held the planned hash: must be 0), peak pending bytes, policy time per step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from lmkv.config import OffloadConfig
from lmkv.keys import EngineBlockKey
from lmkv.offload.lazy import CopyBudget, LazyOffload, Pick
from lmkv.offload.peer import LMCacheStoreQueue
from lmkv.offload.traces import TraceRequest
from lmkv.tiers.link import ema


@dataclass
class SimConfig:
    """A replay's settings: the KV budget, the policy and its offload settings, the copy link, evaluation options."""

    num_blocks: int
    block_size: int = 32
    page_bytes: int = 256 << 10
    step_tokens: int = 8192  # prefill tokens admitted per step
    max_running: int = 64
    d2h_bytes_per_step: int | None = None  # a declared copy link (eager's too); None: the host link below
    #: the copy link as the workers would measure it (a PCIe-class host link), and a step's time: the
    #: trace's step, or its computed tokens' time where longer (a prefill of 8k tokens of an 8B model
    #: takes ~0.3 s, not a 40 ms trace step); lazy's drain cap is a share of the link's time per step
    copy_bytes_per_s: float = 25e9
    step_s: float = 0.04
    token_s: float = 2.5e-6  # a ~0.5B model's token (1 GFLOP at 400 TFLOP/s); 40e-6 for an 8B model
    lazy: OffloadConfig = field(default_factory=lambda: OffloadConfig(policy="lazy"))
    #: evaluation only: under a declared link, lazy ranks due blocks by these per-class need rates
    #: (another run's tally: known in hindsight) instead of its estimate's bounds
    hindsight_rates: dict | None = None
    #: evaluation only: lazy judges a family on all its requests at once, not only on those older than its
    #: reuse horizon (what judging a family one-shot before its returns could have come costs or saves)
    judge_at_once: bool = False


@dataclass
class SimResult:
    """What a replay measured: bytes written, hits from tiers and from vLLM's cache, blocks lost, wasted writes."""

    policy: str
    steps: int = 0
    bytes_written: int = 0
    writes: int = 0
    rescues: int = 0  # lazy: writes of blocks the step had taken, made before its forward
    hit_tokens: int = 0
    engine_hit_tokens: int = 0  # prompt tokens the engine's own prefix cache served
    computed_tokens: int = 0
    blocks_lost: int = 0
    wasted_writes: int = 0
    stale_writes: int = 0
    peak_pending_bytes: int = 0
    preemptions: int = 0
    policy_us: list[float] = field(default_factory=list, repr=False)
    oracle_blocks: set = field(default_factory=set, repr=False)  # none: evicted, then asked for again
    #: lazy: per class of the need estimate, (blocks needed again, blocks watched) at the end
    need_classes: dict = field(default_factory=dict, repr=False)

    @property
    def policy_us_median(self) -> float:
        return statistics.median(self.policy_us) if self.policy_us else 0.0


def make_manager(num_blocks: int, block_size: int, max_model_len: int = 1 << 17):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(cfg, max_model_len=max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_caching=True)


def make_request(rid: str, prompt: list[int], max_tokens: int, block_size: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))


class _Run:
    def __init__(self, trace: list[TraceRequest], cfg: SimConfig, policy: str) -> None:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        from lmkv.connectors.vllm_pool import VllmFreeQueue

        self.cfg = cfg
        self.policy = policy
        self.res = SimResult(policy)
        self.mgr = make_manager(cfg.num_blocks, cfg.block_size)
        self.pool = self.mgr.block_pool
        self.queue = VllmFreeQueue(self.pool)
        self.key = lambda h: EngineBlockKey(make_block_hash_with_group_id(h, 0))  # noqa: E731
        self.tier: set[EngineBlockKey] = set()
        #: written and not evicted since: a HBM hit on one is a wasted write
        self.written_live: set[EngineBlockKey] = set()
        self.evicted_unwritten: set[EngineBlockKey] = set()
        self.evicted: set[EngineBlockKey] = set()
        self.pending: deque[EngineBlockKey] = deque()  # eager copies not yet done
        self.handed_out: dict[int, EngineBlockKey] = {}  # cached blocks this step's allocations took: id -> hash
        #: eager's copies through the simulated link (lazy declares it to its policy, which keeps it)
        self.link = None if cfg.d2h_bytes_per_step is None else CopyBudget(cfg.d2h_bytes_per_step, cfg.page_bytes)
        lazy_cfg = cfg.lazy
        if cfg.d2h_bytes_per_step is not None:  # the simulated link is declared to the policy
            lazy_cfg = lazy_cfg.model_copy(update={"link_bytes_per_step": cfg.d2h_bytes_per_step})
        self.lazy = LazyOffload(lazy_cfg, cfg.page_bytes, self.tier.__contains__) if policy == "lazy" else None
        if self.lazy is not None:  # (the evaluation-only settings)
            reuse = self.lazy.reuse
            reuse.wait_for_returns = not cfg.judge_at_once
            if cfg.hindsight_rates is not None:
                rates = cfg.hindsight_rates
                reuse.need_score = lambda h, step: rates.get(reuse.watch(h, step), 1.0)  # type: ignore[method-assign]
        self.peer = LMCacheStoreQueue(self.pool) if policy == "lmcache" else None
        self.looked_up = 0  # blocks of the request the step looked up and did not admit
        self.scheduled = 0  # tokens this step computes (the peer's estimate of the next step's blocks)
        self.step_s: float | None = None  # the steps' time as the workers would report it (EMA, one step late)
        self.inflight: list[Pick] = []
        self.by_id = {r.id: r for r in trace}
        self.later: dict[str, list[TraceRequest]] = {}
        self.arrivals: dict[int, list[TraceRequest]] = {}
        for r in trace:
            if r.after:
                self.later.setdefault(r.after, []).append(r)
            else:
                self.arrivals.setdefault(r.arrival, []).append(r)
        self.outputs: dict[str, list[int]] = {}
        self.noted: set[str] = set()  # requests whose use of their prefix the lazy policy has been told
        self.waiting: deque = deque()
        self.running: list = []
        self.remaining = len(trace)
        self.allocated = 0
        orig = self.pool._maybe_evict_cached_block

        def evict(block, _orig=orig):
            h = block.block_hash
            if h is not None:
                self.handed_out[block.block_id] = h
                self.evicted.add(h)
                self.written_live.discard(h)
                if policy == "evict" and h not in self.tier:
                    self.write(h, evicted=True)
                if h not in self.tier:
                    self.evicted_unwritten.add(h)
            return _orig(block)

        self.pool._maybe_evict_cached_block = evict
        orig_get = self.pool.get_new_blocks

        def get_new(n, *a, _orig=orig_get, **kw):
            self.allocated += n
            return _orig(n, *a, **kw)

        self.pool.get_new_blocks = get_new

    # -- scheduling ----------------------------------------------------------

    def arrive(self, step: int) -> None:
        for r in self.arrivals.pop(step, []):
            req = make_request(r.id, r.prompt, len(r.output), self.cfg.block_size)
            self.outputs[r.id] = r.output
            self.waiting.append(req)

    def admit(self, step: int) -> list:
        bs = self.cfg.block_size
        budget = self.cfg.step_tokens
        admitted: list = []
        self.looked_up = 0
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_running:
            req = self.waiting[0]
            blocks, hbm_tokens, *_ = self.mgr.get_computed_blocks(req)
            n = req.num_tokens
            # (if it is not admitted now, the next step takes its blocks first: known to the connector, which
            # looked it up)
            self.looked_up = -(-n // bs) - hbm_tokens // bs
            if n - hbm_tokens > budget and admitted:
                break
            hashes = [self.key(h) for h in req.block_hashes[: (n - 1) // bs]]
            for h in hashes[: hbm_tokens // bs]:
                if h in self.written_live:
                    self.res.wasted_writes += 1
                    self.written_live.discard(h)
            rest = hashes[hbm_tokens // bs:]
            tier_blocks = 0
            while tier_blocks < len(rest) and rest[tier_blocks] in self.tier:
                tier_blocks += 1
            self.res.oracle_blocks.update(h for h in rest if h in self.evicted)
            self.res.blocks_lost += sum(1 for h in rest[tier_blocks:] if h in self.evicted_unwritten)
            new_blocks = self.mgr.allocate_slots(req, n - hbm_tokens, hbm_tokens, blocks)
            if new_blocks is None:
                if not self.running and not admitted:  # can never fit: drop it
                    self.waiting.popleft()
                    self.finish_trace(req, step)
                break
            self.waiting.popleft()
            self.looked_up = 0
            budget -= n - hbm_tokens
            hit = tier_blocks * bs
            self.res.hit_tokens += hit
            self.res.engine_hit_tokens += hbm_tokens
            self.res.computed_tokens += n - hbm_tokens - hit
            req.num_computed_tokens = n
            first = hbm_tokens // bs + tier_blocks
            if self.lazy is not None:  # as the connector's scheduler tells it, once the prefill's pages are full
                self.remember(req, n // bs, first, hbm_tokens // bs)
            if self.policy == "eager":
                self.pending.extend(h for h in (self.key(x) for x in req.block_hashes[first : n // bs])
                                    if h not in self.tier)
            elif self.peer is not None:
                ids = self.mgr.get_block_ids(req.request_id)[0]
                self.peer.add(req.request_id, first * bs, (n // bs) * bs, list(ids[first : n // bs]))
            self.scheduled += n - hbm_tokens
            self.sample(req, step)
            admitted.append(req)
        return admitted

    def remember(self, req, full: int, computed_from: int, cached: int) -> None:
        """What the connector's scheduler tells the policy when a request's full pages grow: the chain of
        its full pages (a use of it the first time: a preempted request resumed is not another use),
        and the pages computed now."""
        assert self.lazy is not None
        hashes = [self.key(h) for h in req.block_hashes[:full]]
        if not hashes:
            return
        self.lazy.note_chain(hashes, used=req.request_id not in self.noted, cached=cached)
        self.noted.add(req.request_id)
        self.lazy.note_computed(hashes[computed_from:])

    def sample(self, req, step: int) -> None:
        out = self.outputs[req.request_id]
        k = len(req.output_token_ids)
        if k >= len(out):
            if self.lazy is not None:  # link the blocks decoding filled to their chain
                self.lazy.note_finished([self.key(h) for h in req.block_hashes])
            self.mgr.free(req)
            self.finish_trace(req, step)
            return
        req.append_output_token_ids(out[k])
        if req not in self.running:
            self.running.append(req)

    def finish_trace(self, req, step: int) -> None:
        if req in self.running:
            self.running.remove(req)
        self.remaining -= 1
        for nxt in self.later.pop(req.request_id, []):
            self.arrivals.setdefault(step + 1 + nxt.gap, []).append(nxt)

    def decode(self, step: int, fresh: list) -> None:
        bs = self.cfg.block_size
        for req in [r for r in self.running if r not in fresh]:
            if req not in self.running:
                continue
            while self.mgr.allocate_slots(req, 1) is None:
                victim = self.running[-1]  # preempt the newest
                self.mgr.free(victim)
                self.running.remove(victim)
                victim.num_computed_tokens = 0
                self.waiting.appendleft(victim)
                self.res.preemptions += 1
                if self.peer is not None:
                    self.peer.drop(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                continue
            req.num_computed_tokens += 1
            self.res.computed_tokens += 1
            self.scheduled += 1
            if req.num_computed_tokens % bs == 0:
                k = req.num_computed_tokens // bs - 1
                h = self.key(req.block_hashes[k])
                if self.policy == "eager" and h not in self.tier:
                    self.pending.append(h)
                elif self.lazy is not None:
                    self.remember(req, k + 1, k, 0)
                elif self.peer is not None:
                    self.peer.add(req.request_id, k * bs, (k + 1) * bs, [self.mgr.get_block_ids(req.request_id)[0][k]])
            self.sample(req, step)

    # -- copies ----------------------------------------------------------------

    def write(self, h: EngineBlockKey, evicted: bool = False) -> None:
        self.tier.add(h)
        if not evicted:
            self.written_live.add(h)
        self.evicted_unwritten.discard(h)
        self.res.writes += 1
        self.res.bytes_written += self.cfg.page_bytes

    def copies(self) -> None:
        if self.policy == "eager":
            pages = None if self.link is None else self.link.refill()
            done = 0
            while self.pending and (pages is None or done < pages):
                h = self.pending.popleft()
                if h in self.tier:
                    continue
                if self.pool.cached_block_hash_to_block.get_one_block(h) is None:
                    continue  # evicted before its copy: counted as lost when asked for
                self.write(h)
                done += 1
            if self.link is not None:
                self.link.spend(done)
            self.res.peak_pending_bytes = max(self.res.peak_pending_bytes, len(self.pending) * self.cfg.page_bytes)
        elif self.peer is not None:
            for h in self.peer.drain(self.allocated, self.scheduled, self.cfg.block_size):
                if h not in self.tier:
                    self.write(h)
            self.allocated = 0
        elif self.lazy is not None:
            self.lazy.done(self.inflight)  # (made last step: the pages are in the tier)
            self.lazy.note_step(self.allocated)
            self.allocated = 0
            # What the connector knows of the next step: a decode crossing a page boundary takes a block,
            # a request looked up and not admitted takes its prompt's (prefills here run in one step).
            bs = self.cfg.block_size
            self.lazy.note_demand(sum(r.num_computed_tokens % bs == 0 for r in self.running) + self.looked_up)
            if self.step_s is not None:  # what the workers reported of the last step
                self.lazy.observe_copies(self.cfg.copy_bytes_per_s, self.step_s)
            self.step_s = ema(self.step_s, max(self.cfg.step_s, self.scheduled * self.cfg.token_s))
            t0 = time.perf_counter()
            self.inflight = self.lazy.plan(self.queue)
            self.res.policy_us.append((time.perf_counter() - t0) * 1e6)
            # Every planned block is copied in this step: a rescue before its forward (the block was
            # handed out), the others during it (still in the free queue: no forward of this step writes them).
            for p in self.inflight:
                held = self.handed_out.get(p.block_id) if p.rescue else self.queue.block_hash(p.block_id)
                if held != p.block_hash:
                    self.res.stale_writes += 1
                else:
                    self.write(p.block_hash, evicted=p.rescue)
                    self.res.rescues += p.rescue
            self.res.peak_pending_bytes = max(self.res.peak_pending_bytes, len(self.inflight) * self.cfg.page_bytes)

    def run(self, max_steps: int = 1_000_000) -> SimResult:
        step = 0
        while self.remaining and step < max_steps:
            self.arrive(step)
            fresh = self.admit(step)
            self.decode(step, fresh)
            self.copies()
            self.handed_out.clear()
            self.scheduled = 0
            step += 1
        self.res.steps = step
        if self.lazy is not None:
            self.res.need_classes = self.lazy.reuse.tally()
        return self.res


def simulate(trace: list[TraceRequest], cfg: SimConfig, policy: str) -> SimResult:
    """Replay ``trace`` under ``policy`` (``none``, ``eager``, ``lazy``, ``lmcache`` or ``evict``)."""
    if policy not in ("none", "eager", "lazy", "lmcache", "evict"):
        raise ValueError(f"unknown policy {policy!r}")
    return _Run(trace, cfg, policy).run()


def distinct_blocks(trace: list[TraceRequest], block_size: int) -> int:
    """Full blocks of distinct content in a trace (prefixes shared by requests count once)."""
    seen: set[EngineBlockKey] = set()
    for r in trace:
        req = make_request(r.id, r.prompt + r.output, 1, block_size)
        seen.update(req.block_hashes)
    return len(seen)
