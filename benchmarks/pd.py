"""``lmkv bench pd``: prefill/decode hand-off through a shared tier, on vLLM's CPU engine.

Two ``vllm serve`` engines as a P/D fleet runs them: a prefill engine (P, ``kv_producer``) and a
decode engine (D, ``kv_consumer``) sharing one tier: ``lmkv serve`` over TCP (as between two
hosts), ``lmkv serve`` over same-host shared memory, Redis, or Mooncake Store (a master and a
storage client holding the pages; the engines' clients contribute no memory). Each prompt (2-4k tokens) goes to
P with ``max_tokens: 1`` and ``do_remote_decode``, then to D the instant P answers with P's
``kv_transfer_params`` (what a P/D proxy does: ``examples/pd_proxy.py``). Two page shapes: the
bench model's 256 KiB pages and an 8B model's 4 MiB pages (32 layers, 8 KV heads of 128: a
small model with an 8B model's KV, so its pages weigh what they would and its prefill stays short).

Every hand-off runs under a fresh ``cache_salt`` (new keys everywhere), in turns with its
baseline: D's cold prefill of the same prompt under another salt, then that prompt's prefix-cache
hit (vLLM's CPU kernels pay a one-time cost for each new shape: a hit computes the prompt's last
tokens over its whole context, as a hand-off does). Per tier and shape:

- ``pd.handoff_hit_blocks``: the blocks D loaded on the worst hand-off, of its full prompt blocks;
- ``pd.ttft_decode``: D's TTFT (it loads the prompt) vs D's cold prefill, summed over the
  hand-offs; ``pd.ttft_decode_vs_prefix_cache``: vs D's own prefix-cache hit of the same prompt;
- ``pd.ttft_end_to_end``: P's answer + the hand-off + D's TTFT vs one engine's cold TTFT;
- ``pd.handoff_wait``: the longest D waited for P's pages to land (what ``pd.wait`` must cover);
- ``pd.consumer_writes``: bytes D wrote below its memory per hand-off (its decoded blocks only);
- ``pd.tokens_wrong``: hand-offs whose token is neither D's cold prefill's nor its own prefix-cache
  hit's of the same prompt (vLLM's CPU engine can round a hit's last tokens, computed alone over
  cached KV, to another token than the cold prefill's: measured at 2,700 and 3,400 tokens of the
  4 MiB shape, vLLM's own cache with no connector);
- ``pd.stall_extra``: the tier SIGSTOPped between P's answer and D's request: D's time over a cold
  prefill of the same prompt just before, beside ``pd.wait``; ``pd.stall_short_ttft``: a short
  request sent to D alongside, vs the same hand-off and short request with the tier running;
  both the medians of five such rounds (:data:`STALLS`);
- ``pd.multiturn.answer_blocks.{stores_decoded,no_stores_decoded}`` (first tier and shape):
  turn 2 (turn 1 + D's answer + a question) prefilled on P: the blocks of turn 1's answer P
  loaded, with D storing its decoded blocks (``pd.consumer_stores_decoded``) and without.

Both engines and the tier share this machine's cores, where a P/D fleet gives P and D hosts of
their own. After every step vLLM's CPU engine spins on its shared-memory queues for a second
(``shm_broadcast``'s busy loop, no setting): P's engine and worker processes took 1.4-1.6 of the
2 cores' 2 CPU-seconds in each second after P answered, the second D's hand-off runs in (D's TTFT
0.2-1.1 s for the same 256 KiB-page hand-off over Redis, by how much of P's spin it met). So P
runs at nice 19 (:data:`PRODUCER_NICE`), its session's scheduling group too (with the kernel's
autogroups a nice value weighs only within its session: a 4 MiB-page hand-off of 3,990 tokens
over Redis took 0.9-1.0 s with P's processes alone at nice 19, 0.42-0.48 s with its group
too). P's spin takes what D and the tier leave, its own prefill runs while D is idle, and P's
figures (its TTFT, the end-to-end time) are measured as before.

``--quick``: the 256 KiB shape over ``lmkv serve`` TCP, two prompts, no multi-turn case.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkv.benchmarks.report import Report
from lmkv.dev.redis_server import start_redis
from lmkv.dev.server_process import spawn
from lmkv.dev.tinymodels import LLAMA_BENCH, make_llama
from lmkv.dev.vllm_serve import Client, Serve

log = logging.getLogger("lmkv.bench.pd")

BLOCK = 32
WAIT = 2.0  # pd.wait for the run (a hand-off that needs it all is a figure worth seeing, not a failure)
#: stalled hand-offs per tier, each beside a cold prefill and an unstalled one: the stall figures are
#: their medians (a 2,000-token cold prefill varied 0.75-1.08 s run to run here, a short request's
#: TTFT by 20-30%: as much as the figures look for)
STALLS = 5
ANSWER = 100  # turn 1's answer, tokens (three blocks and more of decoded KV)
#: P's priority on the cores it shares with D here (see the module doc): its spin yields to D
PRODUCER_NICE = 19
#: Mooncake's master evicts from this share of its memory on (default 0.9), and a put that finds no
#: room fails: a quarter of the 2 GiB store stays free for P's steps (a 2,048-token step of 4 MiB
#: pages is 256 MiB; with the default, from the sixth 4 MiB-page prompt on P's puts failed for
#: lack of space and D loaded 24-37 of 84-124 blocks). docs/guides/mooncake.md says how to size it.
MOONCAKE_HIGH_WATERMARK = 0.75


@dataclass
class Shape:
    """A model whose KV page (one block of every layer) weighs ``page``."""

    name: str
    model: dict[str, Any]
    kv_bytes: int  # each engine's KV budget
    memory: str  # each engine's lmkv memory


SHAPES = [
    Shape("256KiB", LLAMA_BENCH, 256 << 20, "512MiB"),
    Shape("4MiB", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=32, vocab_size=2048), 1536 << 20, "2GiB"),
]
TIERS = ["server_tcp", "server_shm", "redis", "mooncake"]


@dataclass
class Tier:
    """A shared tier for one pair of engines: its ``remote`` settings and the process to stall."""

    remote: dict[str, Any]
    pid: int


@contextlib.contextmanager
def _tier(name: str, memory: str) -> Iterator[Tier]:
    """``memory``: what the tier may hold (least recently used pages go past it)."""
    if name == "redis":
        with start_redis(maxmemory=memory.replace("GiB", "gb")) as r:
            yield Tier({"url": r.url}, r.procs[0].pid)
        return
    if name == "mooncake":  # (the master is what a stall stops: every lookup and read asks it first)
        from lmkv.dev.mooncake_master import start_master, start_storage

        with start_master(flags=[f"--eviction_high_watermark_ratio={MOONCAKE_HIGH_WATERMARK}"]) as m, \
                start_storage(m, int(memory.removesuffix("GiB")) << 30):
            yield Tier({"url": m.url, "mooncake": {"segment_size": 0}}, m.proc.pid)
        return
    with spawn("--memory", memory) as s:
        yield Tier({"url": s.url, "shm": "never" if name == "server_tcp" else "auto"}, s.proc.pid)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return [(i * 131 + seed * 7919) % (vocab - 3) + 3 for i in range(n)]


def _put_bytes_below_memory(c: Client) -> float:
    return c.metric("vllm:lmkv_tier_bytes_total", direction="put") - c.metric(
        "vllm:lmkv_tier_bytes_total", direction="put", tier="memory")


@dataclass
class Pair:
    """P and D, and the hand-off between them."""

    p: Serve
    d: Serve

    def prefill(self, ids: list[int], salt: str) -> dict | None:
        """P's half of a hand-off (``max_tokens: 1``, ``do_remote_decode``): the params D is sent."""
        out = self.p.post("/v1/completions", {**self.p.body(ids, salt, 1),
                                              "kv_transfer_params": {"do_remote_decode": True}})
        return out.get("kv_transfer_params")

    def hand_off(self, ids: list[int], salt: str, max_tokens: int = 1) -> tuple[list[int], float, float]:
        """One request through P then D: D's tokens (all ``max_tokens``), P's time, D's time."""
        t0 = time.perf_counter()
        params = self.prefill(ids, salt)
        t1 = time.perf_counter()
        out = self.d.post("/v1/completions", {**self.d.body(ids, salt, max_tokens), "ignore_eos": True,
                                              "kv_transfer_params": params})
        return out["choices"][0]["token_ids"], t1 - t0, time.perf_counter() - t1


def _engine(model: str, shape: Shape, remote: dict, log: Path, role: str, **pd: Any) -> Serve:
    lmkv = {"memory": {"capacity": shape.memory}, "remote": remote, "pd": {"wait": WAIT, **pd}}
    return Serve(model, lmkv, log, role=role, block=BLOCK, max_model_len=8192, kv_bytes=shape.kv_bytes,
                 nice=PRODUCER_NICE if role == "kv_producer" else 0)


@contextlib.contextmanager
def _running(*engines: Serve) -> Iterator[None]:
    try:
        for e in engines:
            e.wait_ready(600)
        for e in engines:  # the first request of a fresh engine pays a warm-up
            e.complete(list(range(3, 67)), salt="warm-up", max_tokens=1)
        yield
    finally:
        for e in engines:
            e.stop()


def _handoffs(rep: Report, pair: Pair, prompts: list[list[int]], repeats: int, suffix: str) -> None:
    """The hand-off figures over these prompts, each ``repeats`` times under new salts."""
    d = pair.d
    worst: tuple[float, int, int] = (2.0, 0, 0)
    t_d = t_cold = t_floor = t_e2e = 0.0
    writes, wrong, waited = 0.0, 0, 0.0
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            want, cold = d.complete(ids, salt=f"cold-{r}-{i}", max_tokens=1)
            # (a hit's shape: vLLM's CPU kernels warm per shape; and a hit's token: computing the prompt's
            # last tokens alone over cached KV can round to another token than the cold prefill did)
            hit = d.complete(ids, salt=f"cold-{r}-{i}", max_tokens=1)[0]
            loaded0, put0 = d.metric("vllm:lmkv_loaded_pages_total"), _put_bytes_below_memory(d)
            waited0 = d.metric("vllm:lmkv_scheduler_handoff_wait_ms_total")
            got, tp, td = pair.hand_off(ids, salt=f"pd-{r}-{i}")
            loaded = d.metric("vllm:lmkv_loaded_pages_total") - loaded0
            waited = max(waited, (d.metric("vllm:lmkv_scheduler_handoff_wait_ms_total") - waited0) / 1000)
            writes += _put_bytes_below_memory(d) - put0
            floor = min(d.complete(ids, salt=f"pd-{r}-{i}", max_tokens=1)[1] for _ in range(2))  # (vLLM's cache)
            full = (len(ids) - 1) // BLOCK
            worst = min(worst, (loaded / full, int(loaded), full))
            wrong += got not in (want, hit)
            if got not in (want, hit):
                log.warning("%s prompt %d: D's tokens %s are neither its cold prefill's %s nor its prefix-cache "
                            "hit's %s (%d of %d blocks loaded)", suffix, len(ids), got, want, hit, loaded, full)
            t_d, t_cold, t_floor, t_e2e = t_d + td, t_cold + cold, t_floor + floor, t_e2e + tp + td
            log.info("%s prompt %d: %d/%d blocks, D %.3f s (cold %.3f, floor %.3f), P %.3f s",
                     suffix, len(ids), loaded, full, td, cold, floor, tp)
    n = repeats * len(prompts)
    rep.add(f"pd.handoff_hit_blocks{suffix}", worst[1], "blocks", worst[2], "full prompt blocks (worst hand-off)")
    rep.add(f"pd.ttft_decode{suffix}", t_d, "s", t_cold, "D's cold prefill of the same prompts")
    rep.add(f"pd.ttft_decode_vs_prefix_cache{suffix}", t_d, "s", t_floor, "D's own prefix-cache hit, same prompts")
    rep.add(f"pd.ttft_end_to_end{suffix}", t_e2e, "s", t_cold, "one engine's cold TTFT, same prompts")
    rep.add(f"pd.handoff_wait{suffix}", waited, "s", WAIT, "pd.wait (the longest wait for P's pages)")
    rep.add(f"pd.consumer_writes{suffix}", writes / n, "bytes")
    rep.add(f"pd.tokens_wrong{suffix}", wrong, "hand-offs")


def _stall(rep: Report, pair: Pair, tier: Tier, ids: list[int], vocab: int, suffix: str) -> None:
    """The tier stopped between P's answer and D's request: D's time over its cold prefill, and a
    short request's TTFT sent to D alongside, vs the same hand-off and short request unstalled:
    medians over :data:`STALLS` rounds, each a cold prefill, an unstalled and a stalled hand-off
    (the extra is each stalled hand-off's over its own round's cold prefill)."""
    d = pair.d
    short = _tokens(200, 99, vocab)

    def alongside(salt: str, stop: bool) -> tuple[float, float]:
        """D's time for the hand-off of ``ids`` and a short request's sent 50 ms after it."""
        params = pair.prefill(ids, salt)
        out: dict[str, float] = {}

        def short_one() -> None:
            time.sleep(0.05)  # (once the hand-off's lookup is out)
            out["short"] = d.complete(short, salt=f"short-{salt}", max_tokens=1)[1]

        th = threading.Thread(target=short_one)
        if stop:
            os.kill(tier.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            th.start()
            d.post("/v1/completions", {**d.body(ids, salt, 1), "kv_transfer_params": params})
            took = time.perf_counter() - t0
            th.join()
        finally:
            if stop:
                os.kill(tier.pid, signal.SIGCONT)
        return took, out["short"]

    cold, runs = [], []
    for i in range(STALLS):  # (each stalled hand-off beside its own cold prefill and unstalled hand-off)
        cold.append(d.complete(ids, salt=f"stall-cold-{i}", max_tokens=1)[1])
        runs.append((alongside(f"stall-base-{i}", stop=False), alongside(f"stall-{i}", stop=True)))
    took, short_stalled, short_base = [s[0] for _, s in runs], [s[1] for _, s in runs], [b[1] for b, _ in runs]
    log.info("%s stall: D %s s (cold %s), short %s s (unstalled %s)", suffix,
             *([round(t, 3) for t in ts] for ts in (took, cold, short_stalled, short_base)))
    rep.add(f"pd.stall_extra{suffix}", max(0.0, statistics.median(t - c for t, c in zip(took, cold))), "s", WAIT,
            "pd.wait (the configured deadline)")
    rep.add(f"pd.stall_short_ttft{suffix}", statistics.median(short_stalled), "s", statistics.median(short_base),
            "the same short request beside the same hand-off, tier running")


def _multiturn(rep: Report, pair: Pair, ids: list[int], tag: str) -> None:
    """Turn 2 on P after turn 1's hand-off: the blocks of turn 1's answer P loaded."""
    answer, _, _ = pair.hand_off(ids, salt=f"turn-{tag}", max_tokens=ANSWER)
    time.sleep(1.0)  # (a user reads the answer: D's decoded blocks reach the tier meanwhile)
    turn2 = ids + answer + _tokens(40, 77, 1000)
    answer_blocks = (len(ids) + len(answer) - 1) // BLOCK - len(ids) // BLOCK
    loaded0 = pair.p.metric("vllm:lmkv_loaded_pages_total")
    pair.prefill(turn2, f"turn-{tag}")
    loaded = pair.p.metric("vllm:lmkv_loaded_pages_total") - loaded0
    rep.add(f"pd.multiturn.answer_blocks.{tag}", loaded, "blocks", answer_blocks,
            "blocks of turn 1's answer (D decoded them)")


def run(quick: bool = False) -> Report:
    shapes = SHAPES[:1] if quick else SHAPES
    tiers = TIERS[:1] if quick else [t for t in TIERS if t != "mooncake" or importlib.util.find_spec("mooncake")]
    lengths = [2000, 3990] if quick else [2000, 2700, 3400, 3990]
    repeats = 1 if quick else 2
    rep = Report("pd", params={"tiers": tiers, "shapes": [s.name for s in shapes], "prompt_tokens": lengths,
                               "repeats": repeats, "block": BLOCK, "pd_wait_s": WAIT})
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-pd-") as tmp:
        workdir = Path(tmp)
        for si, shape in enumerate(shapes):
            model = str(make_llama(f"llama-pd-{shape.name}", **shape.model))
            vocab = shape.model["vocab_size"]
            prompts = [_tokens(n, 11 + i, vocab) for i, n in enumerate(lengths)]
            for ti, name in enumerate(tiers):
                suffix = f".{name}.{shape.name}"
                with _tier(name, "2GiB") as tier:
                    pair = Pair(_engine(model, shape, tier.remote, workdir / f"{name}-p.log", "kv_producer"),
                                _engine(model, shape, tier.remote, workdir / f"{name}-d.log", "kv_consumer"))
                    with _running(pair.p, pair.d):
                        _handoffs(rep, pair, prompts, repeats, suffix)
                        if si == 0 and ti == 0 and not quick:
                            _multiturn(rep, pair, prompts[0], "stores_decoded")
                            off = _engine(model, shape, tier.remote, workdir / "off-d.log", "kv_consumer",
                                          consumer_stores_decoded=False)
                            with _running(off):
                                _multiturn(rep, Pair(pair.p, off), prompts[0], "no_stores_decoded")
                        _stall(rep, pair, tier, prompts[0], vocab, suffix)
    return rep
