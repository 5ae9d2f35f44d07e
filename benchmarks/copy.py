"""``lmkv bench copy``: moving KV blocks between an engine's paged layer tensors and lmkv's pages.

An engine's layers are views ``[blocks, heads, tokens, 2 * head]`` over one allocation,
in vLLM's token-major (``LBNHC``, its default) or head-major (``LBHNC``) physical
layout; ``pages`` random blocks of every layer are gathered into pages in a memory-tier
arena (pinned on a GPU machine) and scattered back into other blocks, one layer at a
time as the worker does, through the copier the worker uses (:func:`lmkv.engine.copier.layer_copier`:
lmkv's CUDA kernel on a GPU, the torch/numpy path on a CPU).

- ``gather.<layout>`` / ``scatter.<layout>``: GB/s; baseline: one contiguous copy of the
  same bytes between the same memories (numpy on a CPU; device to pinned host and back
  on a GPU), the ceiling for scattered blocks.
- On a GPU, ``gather.<layout>.torch`` / ``scatter.<layout>.torch``: the same with torch's
  block-by-block copies (what the worker does without the kernel), same baseline.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.engine.blockcopy import LayerBlocks, block_runs
from lmkv.engine.copier import layer_copier
from lmkv.tiers.arena import HostArena

log = logging.getLogger("lmkv.bench.copy")

LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4)}  # backing dims -> [L, B, H, N, 2D]


def _layers(order: str, num_layers: int, blocks: int, heads: int, tokens: int, head: int, device: str):
    dims = {"L": num_layers, "B": blocks, "H": heads, "N": tokens, "C": 2 * head}
    backing = torch.empty([dims[d] for d in order], dtype=torch.bfloat16, device=device).normal_()
    logical = backing.permute([order.index(d) for d in "LBHNC"])
    return [logical[layer] for layer in range(num_layers)]


def run(quick: bool = False, directory: str | None = None) -> Report:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    num_layers, heads, tokens, head = (8, 8, 16, 128) if quick else (32, 8, 16, 128)
    blocks, pages = (512, 64) if quick else (4096 if gpu else 1024, 256)  # (8 GiB of KV on a GPU, 2 on a CPU)
    nbytes = heads * tokens * 2 * head * 2  # one block of one layer
    page = num_layers * nbytes
    total = pages * page
    arena = HostArena(2 * total, pin="auto")
    slots = [arena.view(i * page, page) for i in range(2 * pages)]
    src = [slots[i] for i in range(pages)]
    rng = np.random.default_rng(0)
    picked = rng.choice(blocks, size=2 * pages, replace=False).tolist()
    out_blocks, in_blocks = picked[:pages], picked[pages:]
    report = Report("copy", params={"device": torch.cuda.get_device_name() if gpu else "cpu", "layers": num_layers,
                                    "blocks": blocks, "pages": pages, "page_bytes": page, "pinned": arena.pinned})

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    # the ceiling: one contiguous copy of the same bytes between the same memories
    flat_dev = torch.empty(total, dtype=torch.uint8, device=device)
    flat_host = torch.from_numpy(arena.view(0, total))
    def to_host() -> None:
        if gpu:
            flat_host.copy_(flat_dev, non_blocking=True)
            sync()
        else:
            np.copyto(arena.view(0, total), arena.view(total, total))

    def from_host() -> None:
        if gpu:
            flat_dev.copy_(flat_host, non_blocking=True)
            sync()
        else:
            np.copyto(arena.view(total, total), arena.view(0, total))
    for order in LAYOUTS:
        layers = _layers(order, num_layers, blocks, heads, tokens, head, device)
        paths = {"": [layer_copier(t, arena.device_visible) for t in layers]}
        if gpu:
            paths[".torch"] = [LayerBlocks(t) for t in layers]
        for suffix, copiers in paths.items():
            out_runs, in_runs = block_runs(out_blocks, src), block_runs(in_blocks, src)

            def gather(copiers=copiers, out_runs=out_runs) -> None:
                for layer, c in enumerate(copiers):
                    c.gather(out_runs, layer * nbytes)
                sync()

            def scatter(copiers=copiers, in_runs=in_runs) -> None:
                for layer, c in enumerate(copiers):
                    c.scatter(in_runs, layer * nbytes)
                sync()

            gather()
            scatter()
            ok = all(torch.equal(layers[layer][b], layers[layer][a])
                     for layer in (0, num_layers - 1) for a, b in list(zip(out_blocks, in_blocks))[:4])
            if not ok:
                raise RuntimeError(f"copy bench: blocks scattered back differ from those gathered ({order}{suffix})")
            rounds = 3 if quick else 5
            g, ceil_out = interleaved(rounds, lambda: timed(gather), lambda: timed(to_host))
            s, ceil_in = interleaved(rounds, lambda: timed(scatter), lambda: timed(from_host))
            what = "one contiguous copy of the same bytes, " + ("device to pinned host" if gpu else "numpy memcpy")
            report.add(f"gather.{order}{suffix}", gbps(total, g), "GB/s", gbps(total, ceil_out), what)
            what = "one contiguous copy of the same bytes, " + ("pinned host to device" if gpu else "numpy memcpy")
            report.add(f"scatter.{order}{suffix}", gbps(total, s), "GB/s", gbps(total, ceil_in), what)
            log.info("%s%s: gather %.2f GB/s, scatter %.2f GB/s", order, suffix, gbps(total, g), gbps(total, s))
        del layers, paths
    return report
