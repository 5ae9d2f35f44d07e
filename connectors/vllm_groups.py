"""Translate vLLM's KV cache configuration into lmkv group layouts.

One :class:`~lmkv.layout.GroupLayout` per KV cache group that vLLM allows to be
transferred. A layer's block is one segment: vLLM's per-layer view is
``[num_blocks, heads, block_size, content]`` (K and V packed in ``content`` for
attention; the raw state bytes for Mamba), so one block of one layer is
``spec.page_size_bytes`` bytes, whatever physical layout vLLM picked.
Replication across tensor-parallel ranks comes from vLLM's own fields
(``KVCacheConfig.kv_tp_replicas``, ``MambaSpec.tp_replicated``), never from
head counts.
"""

from __future__ import annotations

from lmkv.layout import GroupLayout, Segment, StateKind


def _kind(spec) -> tuple[StateKind, int | None]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    if isinstance(spec, MLAAttentionSpec):
        return StateKind.MLA, None
    if isinstance(spec, SlidingWindowSpec):
        return StateKind.SLIDING_WINDOW, spec.sliding_window
    if isinstance(spec, FullAttentionSpec):
        return StateKind.FULL_ATTENTION, None
    if isinstance(spec, MambaSpec):
        return StateKind.MAMBA, None
    raise NotImplementedError(f"lmkv does not handle KV cache spec {type(spec).__name__} yet")


def transfer_group_ids(kv_cache_config) -> list[int]:
    """Groups vLLM lets a connector move (ephemeral groups are excluded)."""
    return [
        g for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if getattr(group, "enable_kv_transfer", True)
    ]


def group_layouts(kv_cache_config, tp_size: int, tp_rank: int) -> list[GroupLayout]:
    """Layouts of the transferable groups, in ``transfer_group_ids`` order."""
    out = []
    for g in transfer_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[g]
        spec = group.kv_cache_spec
        kind, window = _kind(spec)
        if kind is StateKind.MAMBA:
            replicas = tp_size if spec.tp_replicated else 1
        else:
            replicas = getattr(kv_cache_config, "kv_tp_replicas", 1) or 1
            if tp_size % replicas:
                replicas = 1
        dtype = getattr(spec, "dtype", None) or getattr(spec, "dtypes", ("?",))[0]
        out.append(
            GroupLayout(
                name=f"group{g}",
                kind=kind,
                num_layers=len(group.layer_names),
                segments=(Segment("state" if kind is StateKind.MAMBA else "kv", spec.page_size_bytes),),
                tokens_per_page=spec.block_size,
                dtype=str(dtype).removeprefix("torch."),
                tp_size=tp_size,
                tp_rank=tp_rank,
                tp_replicas=replicas,
                sliding_window=window,
            )
        )
    return out
