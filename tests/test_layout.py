import pytest

from lmkv.layout import GroupLayout, Growth, Segment, StateKind, attention_layout


def test_layer_ranges_tile_the_payload(layout):
    stride = layout.layer_stride
    assert layout.payload_bytes == 4 * stride
    assert layout.layer_range(2) == (2 * stride, 3 * stride)
    k0, k1 = layout.layer_range(2, 0)
    v0, v1 = layout.layer_range(2, 1)
    assert (k0, v1) == layout.layer_range(2) and k1 == v0
    with pytest.raises(IndexError):
        layout.layer_range(4)


def test_growth_follows_kind(layout, mamba_layout):
    assert layout.growth is Growth.PER_TOKEN
    assert mamba_layout.growth is Growth.PER_SEQUENCE


def test_tp_placement_is_explicit():
    kw = dict(name="g", num_layers=1, tokens_per_page=16, num_kv_heads=1, head_size=64, dtype_bytes=2, dtype="bf16")
    # tp=8 with 2 KV heads: 4 consecutive ranks share each head -> 2 shards, 1 writer per replica set
    ranks = [attention_layout(**kw, tp_size=8, tp_rank=r, tp_replicas=4) for r in range(8)]
    assert [lay.shard for lay in ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.is_writer for lay in ranks] == [True, False, False, False, True, False, False, False]
    full = [attention_layout(**kw, tp_size=2, tp_rank=r, tp_replicas=2) for r in range(2)]
    assert [lay.shard for lay in full] == [None, None] and [lay.is_writer for lay in full] == [True, False]
    assert len({lay.fingerprint for lay in ranks}) == 1


def test_sharded_mamba_every_rank_writes(mamba_layout):
    ranks = [mamba_layout.with_rank(r) for r in range(2)]
    assert all(lay.is_writer for lay in ranks)
    assert [lay.shard for lay in ranks] == [0, 1]


@pytest.mark.parametrize("bad", [
    dict(num_layers=0), dict(segments=()), dict(segments=(Segment("k", 0),)),
    dict(segments=(Segment("k", 4), Segment("k", 4))), dict(tokens_per_page=0),
    dict(tp_size=2, tp_rank=2), dict(tp_size=4, tp_replicas=3), dict(kind=StateKind.SLIDING_WINDOW, sliding_window=0),
])
def test_invalid_layouts_are_rejected(bad):
    base = dict(name="g", kind=StateKind.FULL_ATTENTION, num_layers=2, segments=(Segment("kv", 64),),
                tokens_per_page=16, dtype="bf16")
    with pytest.raises(ValueError, match="group 'g'"):
        GroupLayout(**{**base, **bad})


def test_fingerprint_tracks_bytes_not_rank(layout):
    assert layout.fingerprint == layout.with_rank(0).fingerprint
    other = GroupLayout(**{**layout.to_dict(), "num_layers": 5})
    assert other.fingerprint != layout.fingerprint
    assert "4 layers" in layout.describe()


def test_vllm_replication_fields_decide_writers():
    """Replication comes from vLLM's own fields: kv_tp_replicas, max_tp_shards, tp_replicated."""
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from lmkv.connectors.vllm_groups import group_layouts

    attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, max_tp_shards=2)
    mamba = MambaSpec(block_size=1024, shapes=((3, 32), (4, 16, 8)), dtypes=(torch.bfloat16, torch.float32),
                      tp_replicated=False)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["m"], mamba)])
    a, m = group_layouts(cfg, tp_size=4, tp_rank=3)
    assert a.tp_replicas == 2 and a.shard == 1 and not a.is_writer  # 4 ranks, 2 shards: rank 3 replicates rank 2
    assert m.tp_replicas == 1 and m.shard == 3 and m.is_writer  # a sharded state: every rank writes its own
    assert [s.nbytes for s in m.segments] == [3 * 32 * 2, 4 * 16 * 8 * 4]  # conv, then temporal state
    assert a.tokens_per_page == m.tokens_per_page == 16  # states keyed by attention page boundaries


def test_vllm_mla_and_sliding_window_descriptors():
    """An MLA latent is one segment and the same on every TP rank (one writer, one shared key);
    a sliding-window group carries its window; both are per-token, prefix-addressable."""
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

    from lmkv.connectors.vllm_groups import group_layouts
    from lmkv.layout import Growth

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["m0", "m1"], mla), KVCacheGroupSpec(["s0"], swa)])
    for rank in (0, 1):
        m, w = group_layouts(cfg, tp_size=2, tp_rank=rank)
        assert m.kind is StateKind.MLA and [s.name for s in m.segments] == ["latent"]
        assert m.segments[0].nbytes == 16 * 576 * 2 and m.num_layers == 2
        assert m.shard is None and m.is_writer == (rank == 0)
        assert w.kind is StateKind.SLIDING_WINDOW and w.sliding_window == 128 and w.shard == rank
        assert m.growth is w.growth is Growth.PER_TOKEN
