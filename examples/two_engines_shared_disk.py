"""Two vLLM engines, two processes, one lmkv disk tier.

    python examples/two_engines_shared_disk.py [DISK_DIR]

Engine A reads a set of documents; engine B, started afterwards in another process and
running at the same time as A, answers questions about them: its prompts' document
pages come from the disk tier A wrote, not from recomputation. Both engines write
through to disk so the other sees pages as soon as they are stored.
"""

import json
import multiprocessing as mp
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # each engine is its own process already

DOCS = [[(i * 31 + d * 977) % 1000 + 3 for i in range(1024)] for d in range(3)]


def engine(model: str, disk: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=2048,
        kv_cache_memory_bytes=128 << 20, seed=0,
        worker_extension_cls="lmkv.connectors.vllm.LMKVWorkerExtension",
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMKVConnector", kv_connector_module_path="lmkv.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"memory": {"capacity": "512MiB"}, "disk": {"path": disk},
                                       "store": {"write_policy": "write_through"}},
        ),
    )


def ask(llm, d: int, q: int) -> list[int]:
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": DOCS[d] + [q + 3] * 16}
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, detokenize=False), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def engine_a(model: str, disk: str, ready, done) -> None:
    llm = engine(model, disk)
    for d in range(len(DOCS)):
        ask(llm, d, 0)
    llm.collective_rpc("lmkv_stats")  # the step that stored the last pages has run
    ready.set()
    done.wait(600)  # stay up while B works: the tier is shared live, not handed over


def engine_b(model: str, disk: str, results) -> None:
    llm = engine(model, disk)
    answers = [ask(llm, d, 1) for d in range(len(DOCS))]
    results.put({"answers": answers, "stats": llm.collective_rpc("lmkv_stats")[0]})


def main() -> int:
    from lmkv.dev.tinymodels import make_llama

    model = str(make_llama())
    disk = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="lmkv-shared-disk-")
    ctx = mp.get_context("spawn")
    ready, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    a = ctx.Process(target=engine_a, args=(model, disk, ready, done))
    a.start()
    if not ready.wait(600):
        raise SystemExit("engine A did not come up")
    b = ctx.Process(target=engine_b, args=(model, disk, results))
    b.start()
    out = results.get(timeout=600)
    b.join()
    done.set()
    a.join()
    t = out["stats"]["transfers"]
    disk_stats = out["stats"]["tiers"]["disk"]
    print(json.dumps({"b_loaded_pages": t["loaded_pages"], "b_disk_hits": disk_stats["hits"],
                      "b_computed_and_stored_pages": t["stored_pages"], "disk": disk}))
    # every full page of every document: 1024 tokens / 32
    return 0 if t["loaded_pages"] == len(DOCS) * 1024 // 32 else 1


if __name__ == "__main__":
    sys.exit(main())
