"""The worker side without an engine: a layerwise load lands layer by layer as the forward asks,
and a layer the forward did not wait for counts as not loaded."""

from __future__ import annotations

import torch

from lmkv.config import load_config
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.layout import attention_layout
from lmkv.store import TieredStore

LAYERS, TOKENS, BLOCKS = 3, 16, 8
CHAINS = [bytes([i + 1]) * 16 for i in range(4)]
BLOCK_IDS = [6, 1, 4, 2]


def _setup():
    layout = attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(LAYERS)}
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(BLOCKS, 2, TOKENS, 128, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB"}}, environ={}))
    op = PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4)))
    w = LayerwiseTransfer(store, [layout], [full], names)
    w.begin(StepPlan(stores=[op]))
    for name in names:
        w.after_layer(name)
    w.end()
    empty = [torch.zeros_like(t) for t in full]
    return store, LayerwiseTransfer(store, [layout], [empty], names), op, full, empty, names


def test_a_layerwise_load_lands_layer_by_layer():
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for i, name in enumerate(names):
            w.before_layer(name)  # layer i is in place before the forward uses it; later ones not yet
            assert torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS])
            assert all(not empty[j].any() for j in range(i + 1, LAYERS))
        w.end()
        assert w.take_errors() == set() and w.stats.totals.loaded_pages == 4


def test_a_layer_the_forward_did_not_wait_for_is_recomputed():
    """If the forward used a layer without waiting for it (no hook), the blocks are reported so the
    engine recomputes them."""
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for name in list(names)[:-1]:  # the last layer's hook never runs
            w.before_layer(name)
        w.end()
        assert w.take_errors() == set(BLOCK_IDS)


def test_rescued_blocks_are_copied_before_the_forward_writes_them():
    """Blocks lazy offload rescues were just given to the step's requests: their pages hold the bytes
    from before the forward, the other stores' pages the bytes the forward left, layer by layer."""
    layout = attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(LAYERS)}
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(BLOCKS, 2, TOKENS, 128, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    before = [t.clone() for t in kv]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB"}}, environ={}))
    with store:
        w = LayerwiseTransfer(store, [layout], [kv], names)
        rescue = PageOp("", 0, CHAINS[:2], [6, 1], [])
        later = PageOp("", 0, CHAINS[2:], [4, 2], [])
        w.begin(StepPlan(stores=[later], rescues=[rescue]))
        for i, name in enumerate(names):  # the forward writes every block of layer i, then its hook runs
            kv[i].add_(1)
            w.after_layer(name)
        w.end()
        out = [torch.zeros_like(t) for t in kv]
        r = LayerwiseTransfer(store, [layout], [out], names)
        r.begin(StepPlan(loads=[PageOp("x", 0, CHAINS, BLOCK_IDS, list(range(4)))]))
        r.start_loads()
        for name in names:
            r.before_layer(name)
        r.end()
        for i in range(LAYERS):
            assert torch.equal(out[i][[6, 1]], before[i][[6, 1]])
            assert torch.equal(out[i][[4, 2]], kv[i][[4, 2]])


def test_a_step_without_copies_does_not_wait_for_the_device():
    """On a GPU the end of a step waits for the kernel's queued copies, which sit behind the forward: a
    step that stores and loads nothing (most steps with lazy offload) must not wait."""
    store, w, op, full, empty, names = _setup()
    waits = []
    w._sync = lambda: waits.append(1)
    with store:
        w.begin(StepPlan())
        w.start_loads()
        for name in names:
            w.before_layer(name)
            w.after_layer(name)
        w.end()
        assert waits == []
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for name in names:
            w.before_layer(name)
        w.end()
        assert waits == [1]
