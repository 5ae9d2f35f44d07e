"""``lmkv bench offload``: eager write-through, eviction-aware lazy offload and the offline oracle,
replayed on vLLM's real ``KVCacheManager`` (:mod:`lmkv.offload.sim`) over the same seeded traces.

- Mixed trace (agent sessions with tool gaps + repeatedly queried documents + a no-reuse
  stream) with the engine's KV budget at 1/1.25, 1/2 and 1/3 of the trace's distinct
  blocks: ``bytes_written``, ``hit_tokens``, ``blocks_lost`` are lazy's sums beside eager's;
  ``bytes_vs_oracle`` beside the oracle's bytes (every block that was evicted and asked for
  again, each written once); ``stale_writes`` must be 0.
- ``bw.*``: the same runs with a copy budget per step at half of eager's mean write rate,
  so eager falls behind and blocks are evicted before their copy; the budget is declared to
  the lazy policy (``offload.link_bytes_per_step``), which then keeps the link busy.
- ``computed_tokens``: what tier hits are for, the tokens the engine computed.
- ``rescued_pages``: lazy's copies of blocks a step had already taken (a burst beyond
  the danger zone), made before that step's forward: the share of its copies on the
  forward's critical path.
- ``policy_us_per_step``: the lazy policy's median time per step with 100k blocks and
  1k running requests.
Per-trace figures (agents, documents, and each working-set factor) come as extra metrics.

- ``mooncake.*``: a real production trace, the Mooncake FAST'25 conversation trace
  (``traces/``, replayed by :func:`lmkv.offload.traces.mooncake`: its first 5 minutes, 1 with
  ``--quick``; 40 ms of trace a step, outputs capped at 32 tokens), at the same three KV
  budgets, summed over them: ``bytes_vs_oracle``, ``hit_tokens`` (beside eager's),
  ``engine_hit_tokens`` (the engine's own prefix-cache hits beside the run without offload:
  what offloading costs vLLM's cache), and ``bw.*`` under the same half-rate link; beside them
  LMCache 0.5.6's eviction-aware store queue in the same runs (``lmcache_*``, when lmcache is
  importable: :mod:`lmkv.offload.peer`). Nothing in the policy was chosen on this trace.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from lmkv.benchmarks.report import Report
from lmkv.offload.peer import available
from lmkv.offload.sim import SimConfig, SimResult, distinct_blocks, simulate
from lmkv.offload.traces import TraceRequest, generate, load, mooncake, save

log = logging.getLogger("lmkv.bench.offload")

FACTORS = (1.25, 2.0, 3.0)


def _scale_trace(running: int, prompt: int, out: int) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0, f"r{i}", [(i * 7919 + j * 31) % 30000 + 3 for j in range(prompt)],
                         [(i + j) % 30000 + 3 for j in range(out)]) for i in range(running)]


@dataclass
class _Runs:
    """One trace at one KV budget: each policy's run, the oracle's bytes, and the runs under a
    copy link at half of eager's mean write rate."""

    none: SimResult
    eager: SimResult
    lazy: SimResult
    oracle: int
    bw_eager: SimResult
    bw_lazy: SimResult
    lmcache: SimResult | None


def _budget(trace: list[TraceRequest], ws: int, factor: float, peer: bool = False) -> _Runs:
    """The runs at a KV budget of ``ws / factor`` blocks (``peer``: LMCache's policy too)."""
    cfg = SimConfig(num_blocks=max(256, int(ws / factor)))
    none, eager, lazy = (simulate(trace, cfg, p) for p in ("none", "eager", "lazy"))
    rate = eager.bytes_written / max(1, eager.steps)
    bw = SimConfig(num_blocks=cfg.num_blocks, d2h_bytes_per_step=max(cfg.page_bytes, int(rate / 2)))
    return _Runs(none, eager, lazy, len(none.oracle_blocks) * cfg.page_bytes, simulate(trace, bw, "eager"),
                 simulate(trace, bw, "lazy"), simulate(trace, cfg, "lmcache") if peer else None)


def run(quick: bool = False, directory: str | None = None) -> Report:
    scale = 1.0 if quick else 3.0
    report = Report("offload", params={"trace_scale": scale, "factors": FACTORS, "block_size": 32,
                                       "page_bytes": 256 << 10, "seed": 1})
    sums = {k: 0 for k in ("lazy_bytes", "eager_bytes", "oracle_bytes", "lazy_hits", "eager_hits", "lazy_lost",
                           "eager_lost", "stale", "bw_lazy_lost", "bw_eager_lost", "bw_lazy_hits", "bw_eager_hits",
                           "lazy_computed", "eager_computed", "bw_lazy_computed", "bw_eager_computed",
                           "lazy_writes", "lazy_rescues")}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for kind in ("mixed", "agents", "documents"):
            path = Path(tmp) / f"{kind}.parquet"
            save(generate(kind, seed=1, scale=scale), str(path))  # replayed from Parquet, as a user's trace would be
            trace = load(str(path))
            ws = distinct_blocks(trace, 32)
            for f in FACTORS:
                r = _budget(trace, ws, f)
                eager, lazy, beager, blazy, oracle = r.eager, r.lazy, r.bw_eager, r.bw_lazy, r.oracle
                tag = f"{kind}.{f:g}x"
                same = "eager, same trace"
                report.add(f"{tag}.bytes_written", lazy.bytes_written, "bytes", eager.bytes_written, same)
                report.add(f"{tag}.bytes_vs_oracle", lazy.bytes_written, "bytes", oracle or None, "offline oracle")
                report.add(f"{tag}.hit_tokens", lazy.hit_tokens, "tokens", eager.hit_tokens or None, same)
                report.add(f"{tag}.computed_tokens", lazy.computed_tokens, "tokens", eager.computed_tokens,
                           "eager, same trace (prefill and decode the engine computed)")
                report.add(f"{tag}.wasted_writes", lazy.wasted_writes, "blocks", eager.wasted_writes, same)
                report.add(f"{tag}.bw.blocks_lost", blazy.blocks_lost, "blocks", beager.blocks_lost or None, "eager")
                report.add(f"{tag}.bw.hit_tokens", blazy.hit_tokens, "tokens", beager.hit_tokens or None, "eager")
                report.add(f"{tag}.bw.computed_tokens", blazy.computed_tokens, "tokens", beager.computed_tokens,
                           "eager")
                log.info("%s: lazy %d B, eager %d B, oracle %d B; hits lazy %d eager %d", tag, lazy.bytes_written,
                         eager.bytes_written, oracle, lazy.hit_tokens, eager.hit_tokens)
                if kind == "mixed":
                    for k, v in (("lazy_bytes", lazy.bytes_written), ("eager_bytes", eager.bytes_written),
                                 ("oracle_bytes", oracle), ("lazy_hits", lazy.hit_tokens),
                                 ("eager_hits", eager.hit_tokens), ("lazy_lost", lazy.blocks_lost),
                                 ("eager_lost", eager.blocks_lost), ("stale", lazy.stale_writes + blazy.stale_writes),
                                 ("bw_lazy_lost", blazy.blocks_lost), ("bw_eager_lost", beager.blocks_lost),
                                 ("bw_lazy_hits", blazy.hit_tokens), ("bw_eager_hits", beager.hit_tokens),
                                 ("lazy_computed", lazy.computed_tokens), ("eager_computed", eager.computed_tokens),
                                 ("bw_lazy_computed", blazy.computed_tokens),
                                 ("bw_eager_computed", beager.computed_tokens),
                                 ("lazy_writes", lazy.writes), ("lazy_rescues", lazy.rescues)):
                        sums[k] += v
    vs_eager, vs_budget = "eager write-through, same traces", "eager under the same copy budget"
    report.add("bytes_written", sums["lazy_bytes"], "bytes", sums["eager_bytes"], vs_eager)
    report.add("bytes_vs_oracle", sums["lazy_bytes"], "bytes", sums["oracle_bytes"] or None,
               "offline oracle, same traces")
    report.add("hit_tokens", sums["lazy_hits"], "tokens", sums["eager_hits"] or None, vs_eager)
    report.add("blocks_lost", sums["lazy_lost"], "blocks", sums["eager_lost"], vs_eager)
    # what a tier hit is for: tokens the engine did not compute (a policy can raise tier hits by
    # evicting engine-cached blocks early, which costs compute; this figure shows it)
    report.add("computed_tokens", sums["lazy_computed"], "tokens", sums["eager_computed"], vs_eager)
    report.add("stale_writes", sums["stale"], "writes")
    # copies made before a step's forward (blocks a burst took): on the forward's critical path
    report.add("rescued_pages", sums["lazy_rescues"], "pages", sums["lazy_writes"] or None,
               "pages lazy copied, same traces")
    report.add("bw.blocks_lost", sums["bw_lazy_lost"], "blocks", sums["bw_eager_lost"] or None, vs_budget)
    report.add("bw.hit_tokens", sums["bw_lazy_hits"], "tokens", sums["bw_eager_hits"] or None, vs_budget)
    report.add("bw.computed_tokens", sums["bw_lazy_computed"], "tokens", sums["bw_eager_computed"], vs_budget)
    _mooncake(report, seconds=60 if quick else 300)
    running = 250 if quick else 1000
    big = simulate(_scale_trace(running, 2048, 48),
                   SimConfig(num_blocks=100_000, max_running=running, step_tokens=1 << 20), "lazy")
    report.add("policy_us_per_step", big.policy_us_median, "us")
    report.params["policy_scale"] = {"blocks": 100_000, "running": running, "steps": big.steps}
    return report


def _mooncake(report: Report, seconds: float) -> None:
    """The real trace's family of figures (see the module docstring)."""
    trace = mooncake(str(files(__package__).joinpath("traces/mooncake_conversation.jsonl.gz")), seconds=seconds)
    ws = distinct_blocks(trace, 32)
    report.params["mooncake"] = {"seconds": seconds, "requests": len(trace), "distinct_blocks": ws, "step_ms": 40,
                                 "max_output": 32}
    keys = ("lazy_bytes", "oracle_bytes", "lazy_hits", "eager_hits", "lazy_engine", "none_engine",
            "bw_lazy_lost", "bw_eager_lost", "bw_lazy_hits", "bw_eager_hits", "peer_bytes", "peer_hits", "peer_engine")
    sums = dict.fromkeys(keys, 0)
    peer = available()
    if peer is not None:
        report.params["lmcache_skipped"] = peer
    for f in FACTORS:
        r = _budget(trace, ws, f, peer=peer is None)
        none, eager, lazy, beager, blazy, oracle = r.none, r.eager, r.lazy, r.bw_eager, r.bw_lazy, r.oracle
        if r.lmcache is not None:
            sums["peer_bytes"] += r.lmcache.bytes_written
            sums["peer_hits"] += r.lmcache.hit_tokens
            sums["peer_engine"] += r.lmcache.engine_hit_tokens
        tag = f"mooncake.{f:g}x"
        report.add(f"{tag}.bytes_vs_oracle", lazy.bytes_written, "bytes", oracle or None, "offline oracle")
        report.add(f"{tag}.hit_tokens", lazy.hit_tokens, "tokens", eager.hit_tokens or None, "eager, same trace")
        report.add(f"{tag}.engine_hit_tokens", lazy.engine_hit_tokens, "tokens", none.engine_hit_tokens or None,
                   "the run without offload")
        log.info("%s: lazy %d B, eager %d B, oracle %d B; tier hits lazy %d eager %d; engine hits lazy %d none %d",
                 tag, lazy.bytes_written, eager.bytes_written, oracle, lazy.hit_tokens, eager.hit_tokens,
                 lazy.engine_hit_tokens, none.engine_hit_tokens)
        for k, v in (("lazy_bytes", lazy.bytes_written), ("oracle_bytes", oracle), ("lazy_hits", lazy.hit_tokens),
                     ("eager_hits", eager.hit_tokens), ("lazy_engine", lazy.engine_hit_tokens),
                     ("none_engine", none.engine_hit_tokens), ("bw_lazy_lost", blazy.blocks_lost),
                     ("bw_eager_lost", beager.blocks_lost), ("bw_lazy_hits", blazy.hit_tokens),
                     ("bw_eager_hits", beager.hit_tokens)):
            sums[k] += v
    report.add("mooncake.bytes_vs_oracle", sums["lazy_bytes"], "bytes", sums["oracle_bytes"] or None,
               "offline oracle, same runs")
    report.add("mooncake.hit_tokens", sums["lazy_hits"], "tokens", sums["eager_hits"] or None, "eager, same runs")
    report.add("mooncake.engine_hit_tokens", sums["lazy_engine"], "tokens", sums["none_engine"] or None,
               "the runs without offload")
    report.add("mooncake.bw.blocks_lost", sums["bw_lazy_lost"], "blocks", sums["bw_eager_lost"] or None,
               "eager under the same copy budget")
    if peer is None:
        report.add("mooncake.lmcache_bytes_vs_oracle", sums["peer_bytes"], "bytes", sums["oracle_bytes"] or None,
                   "offline oracle, same runs (LMCache 0.5.6's eviction-aware store queue)")
        report.add("mooncake.lmcache_hit_tokens", sums["peer_hits"], "tokens", sums["eager_hits"] or None,
                   "eager, same runs (LMCache 0.5.6's eviction-aware store queue)")
        report.add("mooncake.lmcache_engine_hit_tokens", sums["peer_engine"], "tokens", sums["none_engine"] or None,
                   "the runs without offload (LMCache 0.5.6's eviction-aware store queue)")
    report.add("mooncake.bw.hit_tokens", sums["bw_lazy_hits"], "tokens", sums["bw_eager_hits"] or None,
               "eager under the same copy budget")
