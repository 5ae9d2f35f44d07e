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


def _state_segments(spec) -> tuple[Segment, ...]:
    """A Mamba layer's block: its state tensors (conv, then temporal/SSM state) back to back."""
    import math

    import torch

    names = ("conv", "ssm") if len(spec.shapes) == 2 else tuple(f"state{i}" for i in range(len(spec.shapes)))
    return tuple(
        Segment(n, math.prod(shape) * torch.empty((), dtype=dt).element_size())
        for n, shape, dt in zip(names, spec.shapes, spec.dtypes)
    )


def group_layouts(kv_cache_config, tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0) -> list[GroupLayout]:
    """Layouts of the transferable groups, in ``transfer_group_ids`` order; ``pp_rank`` of
    ``pp_size``: the pipeline stage whose layers ``kv_cache_config`` describes (part of each
    page's identity: two stages of equal shape must never read each other's pages).

    Pages are the attention groups' blocks; a Mamba group's page is its state at a page
    boundary (one per stored boundary), so it takes the attention page size as its
    ``tokens_per_page``. Attention groups with different block sizes are not supported.
    """
    groups = [kv_cache_config.kv_cache_groups[g] for g in transfer_group_ids(kv_cache_config)]
    kinds = [_kind(group.kv_cache_spec) for group in groups]
    token_sizes = {g.kv_cache_spec.block_size for g, (k, _) in zip(groups, kinds) if k is not StateKind.MAMBA}
    if len(token_sizes) > 1:
        raise NotImplementedError(f"cache groups with different block sizes {sorted(token_sizes)}")
    if not token_sizes:
        raise NotImplementedError("a model with state but no attention group (no page boundaries to key it by)")
    tpp = token_sizes.pop()
    out = []
    for gi, group, (kind, window) in zip(transfer_group_ids(kv_cache_config), groups, kinds):
        spec = group.kv_cache_spec
        if kind is StateKind.MAMBA:
            replicas = tp_size if spec.tp_replicated else 1
            segments = _state_segments(spec)
        elif kind is StateKind.MLA:
            # one latent per token, not split by heads: every TP rank holds the same bytes (vLLM's
            # own offloading writes pure-MLA KV from one rank, its `replicated_layout`)
            replicas = tp_size
            segments = (Segment("latent", spec.page_size_bytes),)
        else:
            replicas = getattr(kv_cache_config, "kv_tp_replicas", 1) or 1
            shards = getattr(spec, "max_tp_shards", None)
            if shards and tp_size > shards and tp_size % shards == 0:
                # "TP ranks beyond max_tp_shards hold replicas" (e.g. fewer KV heads than ranks)
                replicas = max(replicas, tp_size // shards)
            if tp_size % replicas:
                replicas = 1
            segments = (Segment("kv", spec.page_size_bytes),)
        dtype = getattr(spec, "dtype", None) or getattr(spec, "dtypes", ("?",))[0]
        out.append(
            GroupLayout(
                name=f"group{gi}",
                kind=kind,
                num_layers=len(group.layer_names),
                segments=segments,
                tokens_per_page=tpp,
                dtype=str(dtype).removeprefix("torch."),
                tp_size=tp_size,
                tp_rank=tp_rank,
                tp_replicas=replicas,
                sliding_window=window,
                pp_size=pp_size,
                pp_rank=pp_rank,
            )
        )
    return out
