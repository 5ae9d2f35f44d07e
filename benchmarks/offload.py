"""``lmkv bench offload``: eager write-through, eviction-aware lazy offload, LMCache's policy and the
offline oracle, replayed on vLLM's real ``KVCacheManager`` (:mod:`lmkv.offload.sim`) over the same
traces, at KV budgets of 1/1.25, 1/2 and 1/3 of each trace's distinct blocks.

Two trace families, each summed over its runs (seeds x budgets):

- ``gen.*``: the generator's mixed trace (agent sessions with tool gaps, repeatedly queried
  documents, a no-reuse stream) over 8 seeds (2 with ``--quick``), replayed from Parquet as a
  user's recorded trace would be;
- ``mooncake.*``: a real production trace, the Mooncake FAST'25 conversation trace (``traces/``,
  replayed by :func:`lmkv.offload.traces.mooncake`: its first 5 minutes, 1 with ``--quick``;
  40 ms of trace a step, outputs capped at 32 tokens). Nothing in the policy was chosen on it.

Per family: ``bytes_vs_oracle`` (lazy's bytes; the oracle's: every block that was evicted and
asked for again, written once), ``bytes_vs_eviction`` (lazy's bytes; the copy-at-eviction bound's:
exactly the cached blocks vLLM evicts, each copied as it is evicted, with no reuse guessing and an
unlimited link, the ceiling for a lazy policy that does not predict reuse), ``eviction_bytes_vs_oracle``
and ``eviction_hit_tokens`` (that bound against the oracle and eager), ``wasted_writes`` (pages lazy
copied that a prefix hit then served from vLLM's own cache; its writes), ``rescued_pages`` (pages
copied before a step's forward, on its critical path; its writes), ``hit_tokens`` (tier-hit
tokens; eager's), ``engine_hit_tokens`` (vLLM's own prefix-cache hits; the run without offload:
what offloading costs the engine's cache), ``lmcache_*`` (LMCache 0.5.6's eviction-aware store
queue in the same runs, driven as its connector drives it: :mod:`lmkv.offload.peer`),
``bytes_vs_lmcache``; ``bw.*`` under a
declared copy link at half of eager's mean write rate (eager falls behind and loses blocks;
lazy keeps the link busy); ``worst.*``: the seed with the fewest tier hits against eager's
(and the one with the most bytes); ``8b.*``: the same runs with 8B-shaped pages (4 MiB per
32-token page, a token 40 us of compute) where only lazy's drain cap depends on the page's
size (none, eager, the oracle and LMCache's policy decide the same blocks for any page size,
and their bytes scale with it); ``hindsight_classes_vs_oracle``: the bytes of a policy that
knew each class's need rate in hindsight and copied whole classes, most needed first, until
97% of the needed blocks are kept — what judging blocks by the classes the engine can see
can reach at best; ``hindsight_requests_vs_reused``: the same with hindsight over groups of what a
request shows (its turn, its prompt's and answer's length, a block's place), against the trace's blocks
asked for again, whatever the budget; ``bw.hindsight_classes_blocks_lost``: under the link, the blocks
lost by lazy ranking due blocks by their class's need rate known in hindsight (the same run's tally)
instead of its estimate's bound: what ranking by class can reach there; ``bw.judged_at_once_blocks_lost``:
the same with families judged on all their requests at once, not only on those older than their reuse
horizon (a stream of one-shot prompts is skipped sooner; a conversation service's first turns are skipped
before their second turns could come); ``bw.policy_us_per_step``: the
policy's time per step under the link (the slowest run's median). Per budget: ``{family}.{f}x.*``.

Top level (docs/benchmarks.md): the ``gen`` family's sums as ``bytes_written`` (vs eager),
``bytes_vs_oracle``, ``hit_tokens``, ``blocks_lost``, ``computed_tokens``, ``stale_writes``
(must be 0), ``rescued_pages`` (copies made before a step's forward: on its critical path),
``bw.*``; ``policy_us_per_step``: lazy's median time per step with 100k blocks and 1k
running requests (``.link``: the same under a declared link at half of eager's mean write rate).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path

from lmkv.benchmarks.report import Report
from lmkv.offload.peer import available
from lmkv.offload.sim import SimConfig, SimResult, distinct_blocks, simulate
from lmkv.offload.traces import TraceRequest, generate, load, mooncake, save

log = logging.getLogger("lmkv.bench.offload")

FACTORS = (1.25, 2.0, 3.0)
#: page shapes: bytes per 32-token page and seconds of compute per token
SMALL = (256 << 10, 2.5e-6)
EIGHT_B = (4 << 20, 40e-6)
#: the share of needed blocks the hindsight class bound keeps (the tier-hit target)
KEEP = 0.97


def _scale_trace(running: int, prompt: int, out: int) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0, f"r{i}", [(i * 7919 + j * 31) % 30000 + 3 for j in range(prompt)],
                         [(i + j) % 30000 + 3 for j in range(out)]) for i in range(running)]


@dataclass(frozen=True)
class Task:
    """One replay of the offload bench: a trace family, a seed, a KV budget, the policies compared."""

    family: str  # "gen" or "mooncake"
    seed: int  # gen: the generator's seed; mooncake: 0
    factor: float
    scale: float  # gen: the generator's scale; mooncake: seconds of the trace
    peer: bool  # run LMCache's policy too
    directory: str | None = None  # where the generated traces are written (the system's temp dir)


@dataclass
class Outcome:
    """One trace at one budget: each policy's figures (blocks as counts; pages of the small shape)."""

    task: Task
    figures: dict[str, float] = field(default_factory=dict)


def _trace(task: Task, tmp: str) -> list[TraceRequest]:
    if task.family == "mooncake":
        return mooncake(str(files(__package__).joinpath("traces/mooncake_conversation.jsonl.gz")), seconds=task.scale)
    path = str(Path(tmp) / f"mixed-{task.seed}.parquet")
    save(generate("mixed", seed=task.seed, scale=task.scale), path)  # replayed as a user's trace would be
    return load(path)


def _keep_most_needed(groups: Iterable[Sequence[float]]) -> float:
    """Blocks copied by a policy that knew each group's (needed, blocks) in hindsight and copied whole
    groups, most needed first, until ``KEEP`` of the needed blocks are kept."""
    rows = sorted(groups, key=lambda g: -(g[0] / g[1] if g[1] else 0))
    total = sum(needed for needed, _ in rows)
    kept = copied = 0.0
    for needed, blocks in rows:
        if kept >= KEEP * total:
            break
        kept += needed
        copied += blocks
    return copied


def _hindsight(r: SimResult) -> float:
    """Blocks a class-level policy with hindsight copies to keep ``KEEP`` of the needed blocks."""
    return _keep_most_needed(r.need_classes.values())


def _request_bound(trace: list[TraceRequest], block: int = 32) -> tuple[int, int]:
    """(blocks asked for again, blocks copied) by a policy that knew in hindsight how often the blocks
    of each group of what a request shows were asked for again (how many of its prompt's blocks were
    seen before: its turn; its prompt's and its answer's length; whether the block is the prompt's last
    full one), copying whole groups, most reused first, until ``KEEP`` of the reused blocks are kept.
    Independent of lmkv's classes and of eviction: what judging a block by its request can reach."""
    seen: dict[int, int] = {}  # chained block -> times a prompt used it
    intro: list[tuple[int, tuple[int, int, int, bool]]] = []  # each block at its first use, with its group
    for r in trace:
        full = len(r.prompt) // block
        keys, prev = [], 0
        for b in range(full):
            prev = hash((prev, tuple(r.prompt[b * block:(b + 1) * block])))
            keys.append(prev)
        old = sum(k in seen for k in keys)
        for b, k in enumerate(keys):
            if k not in seen:
                intro.append((k, (min(4, old.bit_length()), min(9, full.bit_length()),
                                  min(5, len(r.output).bit_length() // 2), b == full - 1)))
            seen[k] = seen.get(k, 0) + 1
    groups: dict[tuple[int, int, int, bool], list[int]] = {}
    for k, g in intro:
        row = groups.setdefault(g, [0, 0])
        row[0] += seen[k] > 1
        row[1] += 1
    return sum(n for n, _ in groups.values()), int(_keep_most_needed(groups.values()))


def _half_eager_link(eager: SimResult, page_bytes: int) -> int:
    """The copy link the ``bw.*`` runs declare: half of eager's mean write rate, in bytes per step (at
    least a page)."""
    return max(page_bytes, int(eager.writes / max(1, eager.steps) * page_bytes / 2))


def _run(task: Task) -> Outcome:
    logging.getLogger("lmkv").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(dir=task.directory) as tmp:
        trace = _trace(task, tmp)
    ws = distinct_blocks(trace, 32)
    blocks = max(256, int(ws / task.factor))
    cfg = SimConfig(num_blocks=blocks, page_bytes=SMALL[0], token_s=SMALL[1])
    runs = {p: simulate(trace, cfg, p) for p in ("none", "eager", "evict", "lazy")}
    runs["lazy8b"] = simulate(trace, SimConfig(num_blocks=blocks, page_bytes=EIGHT_B[0], token_s=EIGHT_B[1]), "lazy")
    bw = SimConfig(num_blocks=blocks, d2h_bytes_per_step=_half_eager_link(runs["eager"], cfg.page_bytes))
    runs["bw_eager"], runs["bw_lazy"] = simulate(trace, bw, "eager"), simulate(trace, bw, "lazy")
    rates = {c: n / total if total else 0.0 for c, (n, total) in runs["bw_lazy"].need_classes.items()}
    runs["bw_hindsight"] = simulate(trace, replace(bw, hindsight_rates=rates), "lazy")
    runs["bw_at_once"] = simulate(trace, replace(bw, judge_at_once=True), "lazy")
    if task.peer:
        runs["lmcache"] = simulate(trace, cfg, "lmcache")
    out = Outcome(task, {"oracle": len(runs["none"].oracle_blocks), "hindsight": _hindsight(runs["lazy"])})
    if task.factor == FACTORS[0]:  # (a figure of the trace: once per trace)
        out.figures["reused"], out.figures["request_bound"] = _request_bound(trace)
    for name, r in runs.items():
        for k in ("writes", "hit_tokens", "engine_hit_tokens", "computed_tokens", "blocks_lost", "stale_writes",
                  "rescues", "wasted_writes"):
            out.figures[f"{name}.{k}"] = getattr(r, k)
        out.figures[f"{name}.policy_us"] = r.policy_us_median
    log.info("%s seed %d at 1/%g: lazy %d writes, eager %d, oracle %d; tier hits lazy %d eager %d",
             task.family, task.seed, task.factor, runs["lazy"].writes, runs["eager"].writes, out.figures["oracle"],
             runs["lazy"].hit_tokens, runs["eager"].hit_tokens)
    return out


def _sum(outcomes: list[Outcome], key: str) -> float:
    return sum(o.figures.get(key, 0) for o in outcomes)


def _family(report: Report, name: str, outcomes: list[Outcome], peer: bool) -> None:
    """The family's figures (see the module docstring); bytes are pages x the shape's page bytes."""
    page, big = SMALL[0], EIGHT_B[0]
    oracle = _sum(outcomes, "oracle") * page
    runs = "same runs"

    def add(metric: str, value: float, unit: str, baseline: float, what: str) -> None:
        report.add(f"{name}.{metric}", value, unit, baseline or None, what)

    peer_what = "LMCache 0.5.6's eviction-aware store queue"
    bound = "the copy-at-eviction bound (exactly the blocks vLLM evicts, copied as it evicts them)"
    add("eviction_bytes_vs_oracle", _sum(outcomes, "evict.writes") * page, "bytes", oracle,
        f"offline oracle, {runs}; value: {bound}")
    add("eviction_hit_tokens", _sum(outcomes, "evict.hit_tokens"), "tokens", _sum(outcomes, "eager.hit_tokens"),
        f"eager, {runs}; value: {bound}")
    for prefix, lazy, pb, shape in (("", "lazy", page, ""), ("8b.", "lazy8b", big, " (4 MiB pages)")):
        add(f"{prefix}bytes_vs_oracle", _sum(outcomes, f"{lazy}.writes") * pb, "bytes", _sum(outcomes, "oracle") * pb,
            f"offline oracle, {runs}{shape}")
        add(f"{prefix}bytes_vs_eviction", _sum(outcomes, f"{lazy}.writes") * pb, "bytes",
            _sum(outcomes, "evict.writes") * pb, f"{bound}, {runs}{shape}")
        add(f"{prefix}wasted_writes", _sum(outcomes, f"{lazy}.wasted_writes"), "pages",
            _sum(outcomes, f"{lazy}.writes"),
            f"pages lazy copied, {runs}{shape}; value: those a prefix hit then served from vLLM's own cache")
        add(f"{prefix}rescued_pages", _sum(outcomes, f"{lazy}.rescues"), "pages", _sum(outcomes, f"{lazy}.writes"),
            f"pages lazy copied, {runs}{shape}; value: those copied before a step's forward (blocks it took)")
        add(f"{prefix}bytes_written", _sum(outcomes, f"{lazy}.writes") * pb, "bytes",
            _sum(outcomes, "eager.writes") * pb, f"eager write-through, {runs}{shape}")
        add(f"{prefix}hit_tokens", _sum(outcomes, f"{lazy}.hit_tokens"), "tokens", _sum(outcomes, "eager.hit_tokens"),
            f"eager, {runs}{shape}")
        add(f"{prefix}engine_hit_tokens", _sum(outcomes, f"{lazy}.engine_hit_tokens"), "tokens",
            _sum(outcomes, "none.engine_hit_tokens"), f"the runs without offload, {runs}{shape}")
        if peer:
            add(f"{prefix}bytes_vs_lmcache", _sum(outcomes, f"{lazy}.writes") * pb, "bytes",
                _sum(outcomes, "lmcache.writes") * pb, f"{peer_what}, {runs}{shape}")
    add("hindsight_classes_vs_oracle", _sum(outcomes, "hindsight") * page, "bytes", oracle,
        f"offline oracle; value: whole classes of the need estimate copied with hindsight, most needed first, "
        f"until {KEEP:.0%} of the needed blocks are kept")
    add("hindsight_requests_vs_reused", _sum(outcomes, "request_bound") * page, "bytes",
        _sum(outcomes, "reused") * page,
        f"the trace's blocks asked for again; value: whole groups of what a request shows (its turn, its "
        f"prompt's and answer's length, a block's place) copied with hindsight, most reused first, until "
        f"{KEEP:.0%} of them are kept")
    add("bw.blocks_lost", _sum(outcomes, "bw_lazy.blocks_lost"), "blocks", _sum(outcomes, "bw_eager.blocks_lost"),
        "eager under the same copy link")
    add("bw.hit_tokens", _sum(outcomes, "bw_lazy.hit_tokens"), "tokens", _sum(outcomes, "bw_eager.hit_tokens"),
        "eager under the same copy link")
    report.add(f"{name}.bw.policy_us_per_step", max(o.figures["bw_lazy.policy_us"] for o in outcomes), "us")
    add("bw.hindsight_classes_blocks_lost", _sum(outcomes, "bw_hindsight.blocks_lost"), "blocks",
        _sum(outcomes, "bw_eager.blocks_lost"), "eager under the same copy link; value: lazy ranking due blocks by "
        "their class's need rate known in hindsight (the same runs' tally) instead of its estimate")
    add("bw.judged_at_once_blocks_lost", _sum(outcomes, "bw_at_once.blocks_lost"), "blocks",
        _sum(outcomes, "bw_eager.blocks_lost"), "eager under the same copy link; value: lazy judging a family "
        "one-shot on all its requests, not waiting for its reuse horizon (before any return could have come)")
    if peer:
        add("lmcache_bytes_vs_oracle", _sum(outcomes, "lmcache.writes") * page, "bytes", oracle,
            f"offline oracle, {runs} ({peer_what})")
        add("lmcache_hit_tokens", _sum(outcomes, "lmcache.hit_tokens"), "tokens", _sum(outcomes, "eager.hit_tokens"),
            f"eager, {runs} ({peer_what})")
        add("lmcache_engine_hit_tokens", _sum(outcomes, "lmcache.engine_hit_tokens"), "tokens",
            _sum(outcomes, "none.engine_hit_tokens"), f"the runs without offload, {runs} ({peer_what})")
    for f in FACTORS:
        at = [o for o in outcomes if o.task.factor == f]
        add(f"{f:g}x.bytes_vs_oracle", _sum(at, "lazy.writes") * page, "bytes", _sum(at, "oracle") * page,
            "offline oracle")
        add(f"{f:g}x.hit_tokens", _sum(at, "lazy.hit_tokens"), "tokens", _sum(at, "eager.hit_tokens"), "eager")
        add(f"{f:g}x.8b.hit_tokens", _sum(at, "lazy8b.hit_tokens"), "tokens", _sum(at, "eager.hit_tokens"), "eager")
    seeds = sorted({o.task.seed for o in outcomes})
    if len(seeds) > 1:
        by_seed = {s: [o for o in outcomes if o.task.seed == s] for s in seeds}

        def ratio(s: int, key: str, base: str) -> float:
            return _sum(by_seed[s], key) / max(1.0, _sum(by_seed[s], base))

        for prefix, lazy in (("", "lazy"), ("8b.", "lazy8b")):
            s = min(seeds, key=lambda s: ratio(s, f"{lazy}.hit_tokens", "eager.hit_tokens"))
            add(f"{prefix}worst.hit_tokens", _sum(by_seed[s], f"{lazy}.hit_tokens"), "tokens",
                _sum(by_seed[s], "eager.hit_tokens"), f"eager, the seed ({s}) with the fewest against it")
            s = min(seeds, key=lambda s: ratio(s, f"{lazy}.engine_hit_tokens", "none.engine_hit_tokens"))
            add(f"{prefix}worst.engine_hit_tokens", _sum(by_seed[s], f"{lazy}.engine_hit_tokens"), "tokens",
                _sum(by_seed[s], "none.engine_hit_tokens"), f"the run without offload, the seed ({s}) with the fewest")
        s = max(seeds, key=lambda s: ratio(s, "lazy.writes", "oracle"))
        add("worst.bytes_vs_oracle", _sum(by_seed[s], "lazy.writes") * page, "bytes",
            _sum(by_seed[s], "oracle") * page, f"offline oracle, the seed ({s}) with the most against it")


def run(quick: bool = False, directory: str | None = None) -> Report:
    """``directory``: where the generated traces are written and replayed from."""
    seeds = (1, 2) if quick else tuple(range(1, 9))
    scale, seconds = (1.0, 60.0) if quick else (3.0, 300.0)
    why = available()
    peer = why is None
    report = Report("offload", params={"factors": FACTORS, "block_size": 32, "page_bytes": SMALL[0],
                                       "page_bytes_8b": EIGHT_B[0], "gen": {"seeds": seeds, "scale": scale},
                                       "mooncake": {"seconds": seconds, "step_ms": 40, "max_output": 32}})
    if not peer:
        report.params["lmcache_skipped"] = why
    tasks = [Task("gen", s, f, scale, peer, directory) for s in seeds for f in FACTORS]
    tasks += [Task("mooncake", 0, f, seconds, peer, directory) for f in FACTORS]
    tasks.sort(key=lambda t: t.family != "mooncake")  # the long ones first
    with multiprocessing.get_context("spawn").Pool(max(1, min(len(tasks), os.cpu_count() or 1))) as pool:
        outcomes = pool.map(_run, tasks, chunksize=1)
    gen = [o for o in outcomes if o.task.family == "gen"]
    for name in ("gen", "mooncake"):
        _family(report, name, [o for o in outcomes if o.task.family == name], peer)
    _top(report, gen)
    running = 250 if quick else 1000
    at_scale = SimConfig(num_blocks=100_000, max_running=running, step_tokens=1 << 20)
    big_trace = _scale_trace(running, 2048, 48)
    big = simulate(big_trace, at_scale, "lazy")
    report.add("policy_us_per_step", big.policy_us_median, "us")
    link = _half_eager_link(simulate(big_trace, at_scale, "eager"), at_scale.page_bytes)
    report.add("policy_us_per_step.link", simulate(big_trace, replace(at_scale, d2h_bytes_per_step=link), "lazy")
               .policy_us_median, "us")
    report.params["policy_scale"] = {"blocks": 100_000, "running": running, "steps": big.steps}
    return report


def _top(report: Report, gen: list[Outcome]) -> None:
    """The contract's top-level names (docs/benchmarks.md): the generator's family summed."""
    page = SMALL[0]
    vs_eager, vs_link = "eager write-through, same traces", "eager under the same copy link"
    report.add("bytes_written", _sum(gen, "lazy.writes") * page, "bytes", _sum(gen, "eager.writes") * page, vs_eager)
    report.add("bytes_vs_oracle", _sum(gen, "lazy.writes") * page, "bytes", _sum(gen, "oracle") * page or None,
               "offline oracle, same traces")
    report.add("hit_tokens", _sum(gen, "lazy.hit_tokens"), "tokens", _sum(gen, "eager.hit_tokens") or None, vs_eager)
    report.add("blocks_lost", _sum(gen, "lazy.blocks_lost"), "blocks", _sum(gen, "eager.blocks_lost"), vs_eager)
    # what a tier hit is for: tokens the engine did not compute
    report.add("computed_tokens", _sum(gen, "lazy.computed_tokens"), "tokens", _sum(gen, "eager.computed_tokens"),
               vs_eager)
    lazy_runs = ("lazy", "lazy8b", "bw_lazy", "bw_hindsight", "bw_at_once")
    report.add("stale_writes", sum(_sum(gen, f"{p}.stale_writes") for p in lazy_runs), "writes")
    report.add("wasted_writes", _sum(gen, "lazy.wasted_writes"), "blocks", _sum(gen, "eager.wasted_writes"), vs_eager)
    report.add("rescued_pages", _sum(gen, "lazy.rescues"), "pages", _sum(gen, "lazy.writes") or None,
               "pages lazy copied, same traces")
    report.add("bw.blocks_lost", _sum(gen, "bw_lazy.blocks_lost"), "blocks", _sum(gen, "bw_eager.blocks_lost") or None,
               vs_link)
    report.add("bw.hit_tokens", _sum(gen, "bw_lazy.hit_tokens"), "tokens", _sum(gen, "bw_eager.hit_tokens") or None,
               vs_link)
    report.add("bw.computed_tokens", _sum(gen, "bw_lazy.computed_tokens"), "tokens",
               _sum(gen, "bw_eager.computed_tokens"), vs_link)
