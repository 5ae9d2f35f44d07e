"""``lmkv bench faults``: requests served while loads fail, against a fault-free run.

Documents are computed once and their pages written to a disk tier. Then two fresh
engines (empty memory, so every hit comes from disk) each run the same requests over
a copy of that tier: one without faults (the baseline: outputs and goodput), one with
faults injected into the disk tier at rate R per class — page gone after the lookup,
bits flipped in transit, short reads — plus added latency and an outage window where
the tier is down. Every request must complete with exactly the baseline's tokens; the
figures say how many did, how many tokens were recomputed and what goodput remained.

The engine runs in float32: a failed page changes how much of a prompt is loaded and how
much computed, and vLLM's own prefix cache shows that in bfloat16 the rounding of a
prefill that starts after a short cached prefix can flip a near-tied token several steps
later (measured here: 2-3 cached blocks flip one request's 4th token, no connector at
all). float32 leaves wrong outputs to mean wrong bytes.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkv.benchmarks.report import Report
from lmkv.dev.local_engine import close, prepare_env
from lmkv.dev.tinymodels import make_llama

log = logging.getLogger("lmkv.bench.faults")

MODEL: dict[str, Any] = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=8, vocab_size=2048)


@dataclass
class Shape:
    """The run's size: model, prompts and requests (``--quick`` runs a smaller one)."""

    docs: int
    doc_tokens: int
    questions: int
    max_tokens: int
    rate: float


FULL = Shape(docs=8, doc_tokens=2048, questions=4, max_tokens=16, rate=0.1)
QUICK = Shape(docs=4, doc_tokens=1024, questions=2, max_tokens=8, rate=0.1)


def _engine(model: Path, disk: Path, faults: dict | None, max_len: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"memory": {"capacity": "1GiB"}, "disk": {"path": str(disk)}}
    if faults:
        extra["faults"] = {"disk": faults}
    return LLM(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
        max_model_len=max_len, block_size=32, max_num_batched_tokens=4096, max_num_seqs=8,
        kv_cache_memory_bytes=512 << 20, worker_extension_cls="lmkv.connectors.vllm.LMKVWorkerExtension",
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMKVConnector", kv_connector_module_path="lmkv.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
        ),
    )


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run(quick: bool, directory: str | None = None) -> Report:
    prepare_env()
    shape = QUICK if quick else FULL
    model = make_llama("lmkv-demo", **MODEL)
    vocab = MODEL["vocab_size"]
    docs = [[(i * 31 + d * 977) % (vocab - 3) + 3 for i in range(shape.doc_tokens)] for d in range(shape.docs)]
    prompts = [doc + [(q * 53 + d + j * 7) % (vocab - 3) + 3 for j in range(24)]
               for q in range(shape.questions) for d, doc in enumerate(docs)]
    max_len = shape.doc_tokens + 64
    faults = {"missing_rate": shape.rate, "corrupt_rate": shape.rate, "short_read_rate": shape.rate,
              "delay_ms": 1.0, "outages": [[2.0, 2.5]], "seed": 11}
    report = Report("faults", params={
        "requests": len(prompts), "doc_tokens": shape.doc_tokens, "max_tokens": shape.max_tokens,
        "faults": faults, "model": MODEL, "dtype": "float32",
    })
    root = Path(tempfile.mkdtemp(prefix="lmkv-bench-faults-", dir=directory))
    try:
        log.info("writing %d documents' pages to the disk tier", len(docs))
        llm = _engine(model, root / "prepared", None, max_len)
        _generate(llm, docs, 1)
        close(llm)

        log.info("fault-free run")
        shutil.copytree(root / "prepared", root / "clean")
        llm = _engine(model, root / "clean", None, max_len)
        t0 = time.perf_counter()
        reference = _generate(llm, prompts, shape.max_tokens)
        clean_s = time.perf_counter() - t0
        close(llm)

        log.info("faults at rate %.2f per class", shape.rate)
        shutil.copytree(root / "prepared", root / "faulty")
        crashes, outputs, stats, injected = 0, [], {}, {}
        llm = _engine(model, root / "faulty", faults, max_len)
        t0 = time.perf_counter()
        try:
            outputs = _generate(llm, prompts, shape.max_tokens)
        except Exception:
            log.exception("the engine failed under faults")
            crashes = 1
        faulty_s = time.perf_counter() - t0
        if not crashes:
            stats = llm.collective_rpc("lmkv_stats")[0]
            from lmkv.engine.stores import live_stores
            from lmkv.tiers.faults import FaultyTier

            for store in live_stores().values():
                disk = store.tiers[1]
                assert isinstance(disk, FaultyTier)
                injected = dict(disk.injected)
        close(llm)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    generated = sum(len(o) for o in outputs)
    wrong = sum(o != r for o, r in zip(outputs, reference)) + (len(prompts) - len(outputs))
    transfers = stats.get("transfers", {})
    report.add("completed", len(outputs), "requests", len(prompts), "requests submitted")
    report.add("wrong_outputs", wrong, "count")
    report.add("engine_crashes", crashes, "count")
    report.add("recomputed_tokens", transfers.get("recomputed_tokens", 0), "tokens")
    report.add("goodput", generated / faulty_s, "tokens/s", len(prompts) * shape.max_tokens / clean_s,
               "the same requests without faults, same run")
    report.add("failed_pages", transfers.get("failed_pages", 0), "pages")
    report.add("loaded_pages", transfers.get("loaded_pages", 0), "pages")
    for kind, n in injected.items():
        report.add(f"injected.{kind}", n, "count")
    return report
