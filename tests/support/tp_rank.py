"""One tensor-parallel rank, run as its own process by test_tensor_parallel.py.

    python tests/support/tp_rank.py RANK store|load CONFIG_JSON

Two groups: ``attn`` is sharded by heads (each rank holds different bytes), ``latent`` is
replicated on both ranks (equal bytes). ``store`` copies 4 blocks of each group out of
this rank's KV tensors through lmkv's worker; ``load`` restores them into zeroed tensors
from a fresh store and prints, as JSON, whether every byte matches what the rank held.
"""

import json
import sys

import torch

from lmkv.config import load_config
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.layout import attention_layout
from lmkv.store import TieredStore

LAYERS, TOKENS, BLOCKS = 2, 16, 8
CHAINS = [bytes([i + 1]) * 16 for i in range(4)]
BLOCK_IDS = [1, 3, 5, 7]


def groups(rank: int):
    return [
        attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16", tp_size=2, tp_rank=rank, tp_replicas=1),
        attention_layout("latent", LAYERS, TOKENS, 1, 64, 2, "bfloat16", tp_size=2, tp_rank=rank, tp_replicas=2),
    ]


def held(rank: int) -> list[list[torch.Tensor]]:
    """What this rank's KV tensors hold: attn differs per rank, latent is the same on both."""
    out = []
    for g, heads in enumerate((2, 1)):
        layers = []
        for layer in range(LAYERS):
            seed = 1000 * g + 10 * layer + (rank if g == 0 else 0)
            gen = torch.Generator().manual_seed(seed)
            layers.append(torch.randn(BLOCKS, heads, TOKENS, 128, generator=gen).to(torch.bfloat16))
        out.append(layers)
    return out


def main() -> None:
    rank, phase, cfg = int(sys.argv[1]), sys.argv[2], load_config(json.loads(sys.argv[3]), environ={})
    names = {f"g{g}.l{layer}": (g, layer) for g in range(2) for layer in range(LAYERS)}
    tensors = held(rank) if phase == "store" else [[torch.zeros_like(t) for t in ts] for ts in held(rank)]
    ops = [PageOp("r", g, CHAINS, BLOCK_IDS, list(range(4))) for g in range(2)]
    with TieredStore(cfg) as store:
        w = LayerwiseTransfer(store, groups(rank), tensors, names)
        if phase == "store":
            w.begin(StepPlan(stores=ops))
            for name in names:
                w.after_layer(name)
            w.end()
            store.drain()
            print(json.dumps({"stored": w.stats.totals.stored_pages}))
            return
        w.begin(StepPlan(loads=ops))
        w.start_loads()
        for name in names:
            w.before_layer(name)
        w.end()
        want = held(rank)
        same = {lay.name: all(torch.equal(tensors[g][i][BLOCK_IDS], want[g][i][BLOCK_IDS]) for i in range(LAYERS))
                for g, lay in enumerate(groups(rank))}
        print(json.dumps({"loaded": w.stats.totals.loaded_pages, "identical": same,
                          "groups": {k: vars(v)["loaded_pages"] for k, v in w.stats.groups.items()}}))


if __name__ == "__main__":
    main()
