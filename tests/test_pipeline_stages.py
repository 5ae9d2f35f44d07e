"""Pipeline parallelism: two stages of equal shape (same layer count, heads, dtype) share one store.
Each stage's pages are its own layers' bytes, so neither may ever load the other's (that was wrong
KV, silently: the keys were equal)."""

from __future__ import annotations

import torch

from lmkv.config import load_config
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.keys import page_key
from lmkv.layout import GroupLayout, Segment, StateKind
from lmkv.store import TieredStore
from lmkv.wire.protocol import LayoutMsg

LAYERS, TOKENS, BLOCKS = 2, 16, 6
CHAINS = [bytes([i + 1]) * 16 for i in range(3)]
BLOCK_IDS = [1, 2, 4]


def stage(rank: int) -> GroupLayout:
    return GroupLayout("group0", StateKind.FULL_ATTENTION, LAYERS, (Segment("kv", TOKENS * 2 * 64 * 2 * 2),),
                       TOKENS, "bfloat16", pp_size=2, pp_rank=rank)


def _tensors(rank: int, zero: bool) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    t = [torch.randn(BLOCKS, 2, TOKENS, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    return [[torch.zeros_like(x) for x in t] if zero else t]


def _worker(store, rank: int, tensors) -> LayerwiseTransfer:
    # each stage names its own layers (stage 1 holds the model's layers 2 and 3)
    names = {f"model.layers.{rank * LAYERS + i}": (0, i) for i in range(LAYERS)}
    return LayerwiseTransfer(store, [stage(rank)], tensors, names)


def _store(w: LayerwiseTransfer) -> None:
    w.begin(StepPlan(stores=[PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(3)))]))
    for name in w.layer_names:
        w.after_layer(name)
    w.end()


def _load(w: LayerwiseTransfer) -> None:
    w.begin(StepPlan(loads=[PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(3)))]))
    w.start_loads()
    for name in w.layer_names:
        w.before_layer(name)
    w.end()


def test_stages_of_equal_shape_never_read_each_others_pages():
    assert stage(0).fingerprint != stage(1).fingerprint
    assert page_key(CHAINS[0], stage(0)) != page_key(CHAINS[0], stage(1))
    with TieredStore(load_config({"memory": {"capacity": "16MiB"}}, environ={})) as store:
        held0 = _tensors(0, zero=False)
        _store(_worker(store, 0, held0))
        store.drain()
        got1 = _tensors(1, zero=True)
        w1 = _worker(store, 1, got1)
        _load(w1)
        assert w1.stats.totals.loaded_pages == 0  # stage 0's pages are not stage 1's
        assert all(not t.any() for t in got1[0])
        held1 = _tensors(1, zero=False)
        _store(_worker(store, 1, held1))
        store.drain()
        for rank, held in ((0, held0), (1, held1)):
            got = _tensors(rank, zero=True)
            w = _worker(store, rank, got)
            _load(w)
            assert w.stats.totals.loaded_pages == 3
            assert all(torch.equal(g[BLOCK_IDS], h[BLOCK_IDS]) for g, h in zip(got[0], held[0]))


def test_the_stage_travels_with_the_layout_to_the_server():
    assert LayoutMsg.of(stage(1)).layout() == stage(1)
