"""``lmkv bench layerwise``: a step's layerwise loads and stores beside the forward, on a GPU.

An 8B-shaped KV cache (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks: a page
is 2 MiB, 64 KiB a layer) in CUDA block tensors in vLLM's token-major layout, and a
synthetic forward on a CUDA stream of its own (as vLLM may run it): per layer, bf16 matmuls
sized from a measurement so that a layer computes about as long as its copies take, and a
read of the layer's loaded blocks. Each step loads ``pages`` pages from the pinned memory
tier into blocks and stores as many other blocks into pages, through the worker
(:class:`lmkv.engine.worker.LayerwiseTransfer`) as the connector's hooks drive it:
``before_layer``, the layer's compute, ``after_layer``, and ``end`` (commit) after the last.

- ``step.balanced`` (s per step, compute about equal to the copies): lmkv on its copy streams;
  baseline: the same forward alone, no lmkv. ``step.balanced.compute_stream``: the copies on
  the forward's stream (``copy_stream: false``), same baseline. ``step.balanced.vs_compute_stream``:
  the copy streams against the forward's stream.
- ``step.light``: the same with compute about twice the copies.
- params: ``copy_s_per_layer`` (the copies' device time per layer, measured on the forward's stream
  with no compute), ``matmul_s`` (one matmul), ``<label>.compute_s_per_layer`` (the layer's compute).

Every step's loaded blocks are checked against the stored pages' bytes after the run. Without a
CUDA GPU (or CuPy) the report says why (``params.skipped``) and has no figures.
"""

from __future__ import annotations

import logging
import time

import torch

from lmkv.benchmarks.report import Report, interleaved
from lmkv.config import load_config
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.keys import ChainHash
from lmkv.layout import attention_layout
from lmkv.store import TieredStore

log = logging.getLogger("lmkv.bench.layerwise")

LAYERS, HEADS, HEAD, TOKENS = 32, 8, 128, 16
HIDDEN = 4096  # the synthetic layer's matmul: [ROWS, HIDDEN] @ [HIDDEN, HIDDEN]
ROWS = 1024


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the CPU engine copies in the forward's thread: nothing to overlap)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "needs CuPy (pip install 'lmkv[gpu]') for lmkv's copy kernel"
    return None


class _Forward:
    """A synthetic forward on ``stream``: per layer ``reps`` matmuls and a read of the loaded blocks,
    the worker's hooks around each layer when one is given."""

    def __init__(self, kv: list[torch.Tensor], stream: torch.cuda.Stream, loaded: list[int]) -> None:
        self.kv, self.stream = kv, stream
        self.x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
        self.y = torch.empty_like(self.x)
        self.idx = torch.tensor(loaded, device="cuda")
        self.acc = torch.zeros(LAYERS, device="cuda", dtype=torch.float32)
        self.reps = 1

    def step(self, w: LayerwiseTransfer | None, plan: StepPlan | None = None) -> float:
        """One step's wall time, from the first hook to the forward and lmkv's copies done."""
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            if w is not None:
                w.begin(plan or StepPlan())
                w.start_loads()
            for layer in range(LAYERS):
                name = f"l{layer}"
                if w is not None:
                    w.before_layer(name)
                self.acc[layer] += self.kv[layer].index_select(0, self.idx).float().sum()  # attention reads it
                for _ in range(self.reps):
                    torch.matmul(self.x, self.w, out=self.y)
                if w is not None:
                    w.after_layer(name)
            if w is not None:
                w.end()
        self.stream.synchronize()
        return time.perf_counter() - t0

    def device_time(self, fn) -> float:
        """Seconds on the device between events around ``fn``'s work on this stream."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def run(quick: bool = False, directory: str | None = None) -> Report:
    pages = 32 if quick else 128
    report = Report("layerwise", params={"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD,
                                         "tokens_per_block": TOKENS, "dtype": "bfloat16", "pages": pages})
    reason = _why_not()
    if reason is not None:
        report.params["skipped"] = reason
        log.warning("layerwise bench skipped: %s", reason)
        return report
    report.params["device"] = torch.cuda.get_device_name()
    layout = attention_layout("kv", LAYERS, TOKENS, HEADS, HEAD, 2, "bfloat16")
    blocks = 4 * pages
    backing = torch.randn(LAYERS, blocks, TOKENS, HEADS, 2 * HEAD, device="cuda").to(torch.bfloat16)
    kv = [backing[layer].permute(0, 2, 1, 3) for layer in range(LAYERS)]  # [blocks, heads, tokens, 2 * head]
    names = {f"l{layer}": (0, layer) for layer in range(LAYERS)}
    stored, loaded, saved = list(range(pages)), list(range(pages, 2 * pages)), list(range(2 * pages, 3 * pages))
    load_chains = [ChainHash(b"L" + i.to_bytes(15, "little")) for i in range(pages)]
    save_chains = [ChainHash(b"S" + i.to_bytes(15, "little")) for i in range(pages)]
    plan = StepPlan(loads=[PageOp("r", 0, load_chains, loaded, list(range(pages)))],
                    stores=[PageOp("r", 0, save_chains, saved, [])])
    capacity = 4 * pages * layout.payload_bytes
    stores, workers = [], {}
    for mode in ("copy_stream", "compute_stream"):
        cfg = load_config({"memory": {"capacity": capacity, "pin": "always"},
                           "copy_stream": mode == "copy_stream"}, environ={})
        store = TieredStore(cfg)
        stores.append(store)
        w = LayerwiseTransfer(store, [layout], [kv], names)
        w.begin(StepPlan(stores=[PageOp("", 0, load_chains, stored, [])]))  # the pages every step loads
        for name in names:
            w.after_layer(name)
        w.end()
        workers[mode] = w
    forward = _Forward(kv, torch.cuda.Stream(), loaded)
    try:
        # the copies' device time per layer, on the forward's stream with no compute
        forward.reps = 0
        for _ in range(2):
            forward.step(workers["compute_stream"], plan)
        copies = min(forward.device_time(lambda: forward.step(workers["compute_stream"], plan)) for _ in range(3))
        one = min(forward.device_time(lambda: torch.matmul(forward.x, forward.w, out=forward.y)) for _ in range(5))
        per_layer = copies / LAYERS
        report.params.update(copy_s_per_layer=per_layer, matmul_s=one)
        rounds = 3 if quick else 7
        for label, share in (("balanced", 1.0), ("light", 2.0)):
            forward.reps = max(1, round(share * per_layer / one))
            report.params[f"{label}.compute_s_per_layer"] = forward.reps * one
            for mode in workers:
                forward.step(workers[mode], plan)  # (warm: index tensors, pinned slots)
            alone, lw, cs = interleaved(rounds, lambda: forward.step(None),
                                        lambda: forward.step(workers["copy_stream"], plan),
                                        lambda: forward.step(workers["compute_stream"], plan))
            report.add(f"step.{label}", lw, "s", alone, "the same forward alone (no lmkv), same run")
            report.add(f"step.{label}.compute_stream", cs, "s", alone,
                       "the same forward alone (no lmkv), same run")
            report.add(f"step.{label}.vs_compute_stream", lw, "s", cs,
                       "lmkv's copies on the forward's stream (copy_stream: false), same run")
            log.info("%s: alone %.2f ms, copy streams %.2f ms, compute stream %.2f ms", label, alone * 1e3,
                     lw * 1e3, cs * 1e3)
        for mode, w in workers.items():
            if w.take_errors() or w.stats.totals.failed_pages:
                raise RuntimeError(f"layerwise bench: loads failed on the {mode} path")
        if not all(torch.equal(kv[layer][loaded], kv[layer][stored]) for layer in (0, LAYERS - 1)):
            raise RuntimeError("layerwise bench: loaded blocks differ from the pages' blocks")
    finally:
        for w in workers.values():
            w.close()
        for store in stores:
            store.close()
    return report
