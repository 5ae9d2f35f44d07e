"""Small models generated locally (random weights, a config we choose; nothing downloaded).

The demo, the tests and the benchmarks run vLLM's CPU engine on these. Weights
come from a fixed seed, so two engines (or two runs) loading the same
directory compute the same tokens. They are drawn wider than a trained model's
initialisation (std 0.3, not 0.02) so that logits are well separated: vLLM's
CPU kernels round differently for different batch shapes, and near-tied logits
would let that flip an argmax, while with separated ones identical tokens are a
strict check that the right KV bytes were restored. A directory is reused when its config
matches, so a model is generated once per machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LLAMA_TINY: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=4, vocab_size=1024,
)
#: prefill takes seconds per few thousand tokens on a 2-core CPU: what the benchmarks use
LLAMA_BENCH: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
    num_hidden_layers=8, vocab_size=2048,
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("LMKV_MODEL_DIR", Path.home() / ".cache" / "lmkv" / "models"))


def make_llama(
    name: str = "llama-tiny", root: Path | None = None, seed: int = 0, max_len: int = 16384,
    init_std: float = 0.3, **shape: Any,
) -> Path:
    """A Llama checkpoint (safetensors, bfloat16) under ``root/name``; returns its directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {**LLAMA_TINY, **shape}
    config = LlamaConfig(
        **spec, max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
        initializer_range=init_std,
    )
    out = (root or default_cache_dir()) / name
    stamp = out / "lmkv-model.json"
    want = {"spec": spec, "seed": seed, "max_len": max_len, "init_std": init_std}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


def make_gemma2(name: str = "gemma2-tiny", root: Path | None = None, seed: int = 0, init_std: float = 0.3) -> Path:
    """A Gemma-2 checkpoint: alternating sliding-window (64 tokens) and global attention layers,
    so vLLM runs it with two KV cache groups."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    spec = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=64,
                max_position_embeddings=4096)
    out = (root or default_cache_dir()) / name
    stamp = out / "lmkv-model.json"
    want = {"spec": spec, "seed": seed, "init_std": init_std, "arch": "gemma2"}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(**spec, initializer_range=init_std, torch_dtype="bfloat16")).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


def make_granite_hybrid(name: str = "granite-hybrid-tiny", root: Path | None = None, seed: int = 0,
                        init_std: float = 0.3) -> Path:
    """A GraniteMoeHybrid checkpoint: Mamba2 and attention layers interleaved (two kinds of
    state). vLLM's CPU engine runs it with prefix caching off."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    spec = dict(vocab_size=1024, hidden_size=256, intermediate_size=256, shared_intermediate_size=256,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8, mamba_d_head=64,
                mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, num_local_experts=2,
                num_experts_per_tok=1, max_position_embeddings=2048, position_embedding_type="rope")
    out = (root or default_cache_dir()) / name
    stamp = out / "lmkv-model.json"
    want = {"spec": spec, "seed": seed, "init_std": init_std, "arch": "granitemoehybrid"}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(**spec, bos_token_id=1, eos_token_id=2, initializer_range=init_std,
                                    torch_dtype="bfloat16")
    model = GraniteMoeHybridForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out
