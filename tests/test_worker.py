"""The worker side without an engine: layerwise loads copied ahead of the forward, and what counts
as loaded when the forward did not wait for a layer."""

from __future__ import annotations

import torch

from lmkv.config import load_config
from lmkv.layout import attention_layout
from lmkv.plan import PageOp, StepPlan
from lmkv.store import TieredStore
from lmkv.worker import LayerwiseTransfer

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


def test_layers_are_in_place_before_the_forward_asks_for_them():
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        load = w._loads[0]
        load.ahead.result()  # the copy ran ahead of any forward hook
        assert load.done_layers == set(range(LAYERS)) and not load.consumed
        for name in names:
            w.before_layer(name)
        w.end()
        assert all(torch.equal(e[BLOCK_IDS], f[BLOCK_IDS]) for e, f in zip(empty, full))
        assert w.take_errors() == set() and w.stats.totals.loaded_pages == 4


def test_a_layer_the_forward_did_not_wait_for_is_recomputed():
    """Copied ahead is not enough: if the forward used a layer without waiting for it (no hook),
    the blocks are reported so the engine recomputes them."""
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for name in list(names)[:-1]:  # the last layer's hook never runs
            w.before_layer(name)
        w.end()
        assert w.take_errors() == set(BLOCK_IDS)
