"""lmkv with vLLM's offline ``LLM`` API.

    python examples/vllm_offline.py [MODEL_DIR [DISK_DIR]]

Without a model directory it generates a small Llama locally (random weights). The
second generation of the same long prompt, after vLLM's own prefix cache is reset,
is served from lmkv instead of recomputed.
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # drop this line on a GPU machine


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from lmkv.dev.tinymodels import make_llama

    model = sys.argv[1] if len(sys.argv) > 1 else str(make_llama())
    disk = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="lmkv-example-disk-")
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,  # token-id prompts; remove for a model with a tokenizer
        enforce_eager=True,
        block_size=32,
        max_model_len=4096,
        kv_cache_memory_bytes=256 << 20,
        worker_extension_cls="lmkv.connectors.vllm.LMKVWorkerExtension",  # for llm.collective_rpc("lmkv_stats")
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMKVConnector",
            kv_connector_module_path="lmkv.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "memory": {"capacity": "1GiB"},
                "disk": {"path": disk},
            },
        ),
    )
    prompt = {"prompt_token_ids": [(i * 37) % 1000 + 3 for i in range(3000)]}
    params = SamplingParams(max_tokens=16, temperature=0, detokenize=False)
    for label in ("cold", "after vLLM forgot it"):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"{label}: {time.perf_counter() - t0:.3f} s, tokens {list(out.outputs[0].token_ids)}")
        llm.reset_prefix_cache()
    stats = llm.collective_rpc("lmkv_stats")[0]
    print("pages loaded from lmkv:", stats["transfers"]["loaded_pages"])
    print("tiers:", {t: {k: c[k] for k in ("pages", "hits", "put_bytes")} for t, c in stats["tiers"].items()})


if __name__ == "__main__":
    main()
