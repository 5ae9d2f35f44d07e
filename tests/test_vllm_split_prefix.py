"""A prefix split between vLLM's own cache and lmkv (or between lmkv's tiers), reached on purpose.

Under KV pressure vLLM evicts the tail blocks of old sequences first, so a long document asked
again comes back partly from vLLM's prefix cache (its head) and partly from lmkv (its tail) — the
case peers serve wrong tokens in on hybrid models. Each family is driven into that state with
other requests, the counters show it was reached (blocks from vLLM's cache and from lmkv, both
> 0), and every request's tokens are checked against a cold computation of the same prompt: one
request alone, then eight concurrent ones sharing the document. vLLM cannot keep a Mamba model's
prefix cache on this CPU engine: there the split is between lmkv's memory and disk tiers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from support.vllm_engine import BLOCK, engine, lmkv_stats, prompt, run  # noqa: E402

pytestmark = pytest.mark.vllm

#: a document of 24 pages, and questions of 20 tokens after it
DOC = 24 * BLOCK
QUESTION = 20


def _questions(n: int, seed: int) -> list[list[int]]:
    return [prompt(QUESTION, seed=seed + i) for i in range(n)]


def _loaded(llm) -> dict[str, int]:
    """Pages lmkv loaded so far, per cache group."""
    return {g: c["loaded_pages"] for g, c in lmkv_stats(llm)["groups"].items()}


def _served(llm, prompts: list[list[int]], expected: list[list[int]]) -> tuple[int, int]:
    """Run ``prompts`` together; their tokens must be ``expected``. Returns (prompt blocks vLLM's own
    cache supplied, blocks lmkv supplied: the full-attention group's pages it loaded; a sliding-window
    group loads only the window's)."""
    before = _loaded(llm)
    outs = run(llm, prompts, max_tokens=8)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    from_lmkv = max(n - before.get(g, 0) for g, n in _loaded(llm).items())
    cached_blocks = sum(o.num_cached_tokens for o in outs) // llm.llm_engine.vllm_config.cache_config.block_size
    return cached_blocks - from_lmkv, from_lmkv


def _cold(llm, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """Each prompt computed from scratch (a cache salt nothing else uses: no hit anywhere)."""
    return [list(run(llm, [p], max_tokens=8, salt=f"{tag}-{i}")[0].outputs[0].token_ids)
            for i, p in enumerate(prompts)]


def _evict_tail(llm, seed: int, blocks: int) -> None:
    """Other requests take ``blocks`` blocks: vLLM reuses the least recently used first, and a finished
    request's blocks are queued tail first, so the document's last blocks go."""
    run(llm, [prompt(blocks * BLOCK - 1, seed=seed)], max_tokens=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from lmkv.dev.tinymodels import make_llama

    return str(make_llama(root=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    from lmkv.dev.tinymodels import make_gemma2

    return str(make_gemma2(root=tmp_path_factory.mktemp("gemma2")))


@pytest.mark.parametrize("family", ["full attention (llama)", "sliding window + global (gemma-2)"])
def test_a_document_split_between_vllms_cache_and_lmkv(family, llama, gemma2):
    """A 24-page document is asked (1 request, then 8 at once with new questions) when vLLM's cache
    holds only its head: the head comes from vLLM, the tail from lmkv. Llama: other requests evicted
    the tail from vLLM's 48-block cache. Gemma-2: vLLM's sliding-window group keeps only the window at
    the end of what it computed and frees the rest early, so eviction leaves it no prefix at all; its
    cache holds a head when the head alone was asked before (all of it in lmkv already). In float32:
    the eight share a batch that the cold runs did not, and bfloat16's rounding of a different batch
    shape flips a greedy token of this random-weight model on some CPUs (AMD EPYC here) with or
    without lmkv."""
    model = llama if family.startswith("full") else gemma2
    doc = prompt(DOC, seed=60)
    with engine(model, lmkv={}, kv_bytes=_kv_bytes(model, 48, dtype_bytes=4), max_len=1472, batched_tokens=None,
                dtype="float32") as e:
        first = [doc + q for q in _questions(1, seed=61)]
        eight = [doc + q for q in _questions(8, seed=70)]
        expected_one, expected_eight = _cold(e, first, "one"), _cold(e, eight, "eight")
        for asked, expected in ((first, expected_one), (eight, expected_eight)):
            run(e, [doc + prompt(QUESTION, seed=99)], max_tokens=1)  # the document, in both caches
            if family.startswith("full"):
                _evict_tail(e, seed=100 + len(asked), blocks=36)
            else:
                assert e.reset_prefix_cache()
                run(e, [doc[: DOC // 2]], max_tokens=1)  # (from lmkv, then in vLLM's cache)
            local, from_lmkv = _served(e, asked, expected)
            assert local > 0 and from_lmkv > 0, (local, from_lmkv)


def test_a_hybrid_mamba_prefix_split_between_lmkvs_memory_and_disk(tmp_path):
    """GraniteMoeHybrid (Mamba2 + attention), lmkv's defaults plus a disk tier: the document's first
    three pages only on disk, its other pages and the state at its last boundary in memory; asked by
    one request, then by 8 at once (each loads the same prefix while the others do)."""
    from lmkv.dev.tinymodels import make_granite_hybrid
    from lmkv.engine.stores import live_stores

    model = str(make_granite_hybrid(root=tmp_path))
    docs = [prompt(DOC, seed=80), prompt(DOC, seed=85)]  # (a document already on disk is read from there whole)
    cfg = {"disk": {"path": str(tmp_path / "disk")}}
    with engine(model, lmkv=cfg, prefix_caching=False, batched_tokens=None) as e:
        (store,) = live_stores().values()
        memory, disk = store.memory, store.tiers[1]
        first = [docs[0] + q for q in _questions(1, seed=81)]
        eight = [docs[1] + q for q in _questions(8, seed=90)]
        expected_one, expected_eight = _cold(e, first, "one"), _cold(e, eight, "eight")
        for doc, asked, expected in ((docs[0], first, expected_one), (docs[1], eight, expected_eight)):
            store.drain()
            memory.delete(memory.keys())
            run(e, [doc], max_tokens=1)  # its pages up to its last boundary, and the state there
            store.drain()
            with memory.borrow(memory.keys(), count=False) as lease:
                page_bytes = max(h.payload_len for h in lease.headers)
                pages = [h.key for h in lease.headers if h.payload_len == page_bytes]  # (in the order stored)
            memory.delete(pages[:3])
            disk_hits, memory_hits = disk.stats.hits, memory.stats.hits
            local, from_lmkv = _served(e, asked, expected)
            assert local == 0  # (vLLM keeps no Mamba prefix cache here)
            assert from_lmkv >= len(pages) and disk.stats.hits > disk_hits and memory.stats.hits > memory_hits


def _kv_bytes(model: str, blocks: int, dtype_bytes: int = 2) -> int:
    """KV cache bytes for ``blocks`` blocks of the model's attention layers."""
    import json
    from pathlib import Path

    c = json.loads((Path(model) / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return blocks * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * BLOCK * dtype_bytes
