"""``lmkv demo``: vLLM's CPU engine with lmkv on a locally generated model, cold vs warm TTFT.

Three passes over documents that are each asked about with a new question:

1. cold: every document is computed (and lmkv stores its pages, memory and disk);
2. warm: vLLM's own prefix cache is reset first, so the documents come from lmkv's memory tier;
3. fresh engine: a new engine (new process-level store, empty memory) over the same disk tier.

TTFT is the wall time of a one-token generation, so it is prefill plus one step.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lmkv.dev.local_engine import close, prepare_env
from lmkv.dev.tinymodels import make_llama

DEMO_MODEL: dict[str, Any] = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                  num_hidden_layers=8, vocab_size=2048)


@dataclass
class DemoArgs:
    """The demo's settings (model size, prompt length, tiers), from ``lmkv demo``'s options."""

    docs: int = 4
    doc_tokens: int = 4096
    disk: str | None = None


class _QuietWarmup(logging.Filter):
    """vLLM warms up a chat template at start-up and, with no tokenizer (the demo's token-id
    prompts), logs the harmless failure with a traceback that reads as the demo failing. The demo
    drops that one record; a user's own runs keep vLLM's logging as they configured it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


def _engine(model: Path, disk: str, doc_tokens: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    logging.getLogger("vllm.renderers.base").addFilter(_QuietWarmup())

    return LLM(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=doc_tokens + 256, block_size=32, max_num_batched_tokens=2048, max_num_seqs=4,
        kv_cache_memory_bytes=512 << 20, seed=0,
        worker_extension_cls="lmkv.connectors.vllm.LMKVWorkerExtension",
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMKVConnector", kv_connector_module_path="lmkv.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "memory": {"capacity": "1GiB"},
                "disk": {"path": disk},
                "store": {"write_policy": "write_through"},
            },
        ),
    )


def _ttft(llm, tokens: list[int]) -> tuple[float, list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)
    return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)


def run(args: DemoArgs) -> int:
    # The demo's output is the demo's: vLLM's start-up warnings and lmkv's own info lines are not.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (torch's C++ warnings: NUMA binding, ...)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import vllm  # noqa: F401  (first: without vLLM there is nothing to demo, and no model is made)

    prepare_env()
    console = Console()
    disk = args.disk or tempfile.mkdtemp(prefix="lmkv-demo-disk-")
    docs = [[(i * 31 + d * 977) % 2000 + 3 for i in range(args.doc_tokens)] for d in range(args.docs)]

    def ask(d: int, q: int) -> list[int]:
        return docs[d] + [(q * 53 + d + j * 7) % 2000 + 3 for j in range(24)]

    with console.status("generating a local model (random weights; nothing downloaded)"):
        model = make_llama("lmkv-demo", **DEMO_MODEL)
    console.print(f"model: {model} ({DEMO_MODEL['num_hidden_layers']} layers, hidden {DEMO_MODEL['hidden_size']})")
    with console.status("starting vLLM's CPU engine with lmkv"):
        llm = _engine(model, disk, args.doc_tokens)

    rows: dict[int, list[float]] = {d: [] for d in range(args.docs)}
    same = True
    with Progress(console=console) as progress:
        task = progress.add_task("pass 1: cold", total=args.docs)
        cold_tokens = []
        for d in range(args.docs):
            t, toks = _ttft(llm, ask(d, 0))
            rows[d].append(t)
            cold_tokens.append(toks)
            progress.advance(task)
        llm.reset_prefix_cache()  # vLLM forgets; lmkv does not
        task = progress.add_task("pass 2: warm (lmkv memory)", total=args.docs)
        for d in range(args.docs):
            rows[d].append(_ttft(llm, ask(d, 1))[0])
            progress.advance(task)
        memory_stats = llm.collective_rpc("lmkv_stats")[0]
        close(llm)
        task = progress.add_task("pass 3: fresh engine (lmkv disk)", total=args.docs)
        llm = _engine(model, disk, args.doc_tokens)
        for d in range(args.docs):
            t, toks = _ttft(llm, ask(d, 0))
            rows[d].append(t)
            same &= toks == cold_tokens[d]
            progress.advance(task)
        disk_stats = llm.collective_rpc("lmkv_stats")[0]
        close(llm)

    table = Table(title=f"TTFT, {args.doc_tokens}-token documents + a 24-token question")
    for col in ("document", "cold", "warm: lmkv memory", "fresh engine: lmkv disk", "speed-up (memory / disk)"):
        table.add_column(col, justify="right")
    for d, (cold, warm, fresh) in rows.items():
        speedup = f"{cold / warm:.1f}x / {cold / fresh:.1f}x"
        table.add_row(str(d), f"{cold:.3f} s", f"{warm:.3f} s", f"{fresh:.3f} s", speedup)
    console.print(table)

    stats = Table(title="lmkv tiers (engine 1: passes 1-2; engine 2: pass 3)")
    for col in ("engine", "tier", "pages", "hits", "misses", "stored MiB", "read MiB", "evictions", "corrupt"):
        stats.add_column(col, justify="right")
    for label, s in (("1", memory_stats), ("2", disk_stats)):
        for tier, c in s["tiers"].items():
            stats.add_row(label, tier, str(c["pages"]), str(c["hits"]), str(c["misses"]),
                          f"{c['put_bytes'] / 2**20:.1f}", f"{c['get_bytes'] / 2**20:.1f}",
                          str(c["evictions"]), str(c["corrupt"]))
    console.print(stats)
    loaded = memory_stats["transfers"]["loaded_pages"], disk_stats["transfers"]["loaded_pages"]
    console.print(f"pages loaded into the engine: {loaded[0]} (warm), {loaded[1]} (fresh engine); "
                  f"first tokens identical to the cold pass after a restart: {same}")
    console.print(f"disk tier: {disk}")
    return 0 if same else 1
