"""Gather/scatter between an engine's paged KV tensors and page buffers (CPU reference path).

An engine keeps one tensor per layer whose first dimension is the block id
(vLLM: ``[num_blocks, heads, block_size, 2 * head_size]``, strided per the
layout it picked; SGLang host pools similarly). One page holds one block of
every layer of a group, so storing a page *gathers* ``layer[block]`` for each
layer into that layer's range of the page, and loading *scatters* it back.

When a layer's blocks are each contiguous (vLLM's CPU layout, and the
block-outermost layouts), a block is a row of bytes and rows are copied with
numpy, which moves small rows at several times torch's per-call speed; runs of
consecutive blocks whose pages sit at one stride in memory (:func:`block_runs`) are
one strided torch copy per layer. Any other layout is copied through torch's strided
views. This is the reference the CUDA/HIP kernels are tested against; the worker
(:func:`lmkv.engine.copier.layer_copier`) picks the kernel for a GPU layer where it applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def block_nbytes(layer: torch.Tensor) -> int:
    """Bytes of one block of one layer."""
    return layer[0].numel() * layer.element_size()


def as_bytes_array(buf) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer (numpy array, mmap, memoryview, CPU tensor)."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1).numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


@dataclass(frozen=True)
class BlockRun:
    """Consecutive engine blocks ``block .. block + count - 1`` whose pages lie ``stride`` bytes
    apart in memory, starting at ``page``: one strided copy per layer moves the whole run."""

    block: int
    count: int
    page: np.ndarray
    stride: int


def address(page: np.ndarray) -> int:
    """Where a page buffer's bytes start in memory."""
    return page.__array_interface__["data"][0]


def block_runs(block_ids: Sequence[int], pages: Sequence[np.ndarray]) -> list[BlockRun]:
    """Pair blocks with their pages, merging neighbours into runs.

    A request's blocks are mostly consecutive in the engine, and the arena hands a session's
    pages out in consecutive slots, so a 6k-token hit is usually one run: one copy per layer
    (measured here: 48 MiB in 2.5 ms, against 5 ms as 1,536 row copies). Pages merge only when
    they are equally sized and the next one starts exactly one stride on (a multiple of 8
    bytes, so any element type can view it), so a strided view covers those pages' bytes and
    no others.
    """
    runs: list[BlockRun] = []
    first, count, stride, prev = 0, 0, 0, 0
    for i, (b, page) in enumerate(zip(block_ids, pages)):
        addr = address(page)
        if count and b == block_ids[first] + count and len(page) == len(pages[first]) and page.strides == (1,):
            step = addr - prev
            if (count == 1 and step >= len(page) and step % 8 == 0) or (count > 1 and step == stride):
                stride, prev, count = step, addr, count + 1
                continue
        if count:
            runs.append(BlockRun(int(block_ids[first]), count, pages[first], stride))
        first, count, stride, prev = i, 1, 0, addr
        if page.strides != (1,):  # not a plain run of bytes: it stays on its own
            runs.append(BlockRun(int(b), 1, page, 0))
            count = 0
    if count:
        runs.append(BlockRun(int(block_ids[first]), count, pages[first], stride))
    return runs


class LayerBlocks:
    """One layer's KV tensor, addressed by block."""

    def __init__(self, layer: torch.Tensor) -> None:
        self.tensor = layer
        self.nbytes = block_nbytes(layer)
        self.rows: np.ndarray | None = None  # [num_blocks, nbytes] view when blocks are contiguous
        if layer.device.type == "cpu" and layer[0].is_contiguous() and layer.stride(-1) == 1:
            arr = layer.view(torch.uint8).numpy()
            rows = arr.reshape(arr.shape[0], -1)
            if np.may_share_memory(rows, arr) and rows.shape[1] == self.nbytes:
                self.rows = rows

    def units(self, block: int, segments: Sequence) -> list[np.ndarray]:
        """A contiguous block's bytes cut into the layout's segments (each a page unit), in place."""
        assert self.rows is not None
        row, out, off = self.rows[block], [], 0
        for seg in segments:
            out.append(row[off : off + seg.nbytes])
            off += seg.nbytes
        return out

    def _page_view(self, page: np.ndarray, start: int) -> torch.Tensor:
        t = torch.from_numpy(page[start : start + self.nbytes])
        return t.view(self.tensor.dtype).view(self.tensor.shape[1:])

    def _run_views(self, run: BlockRun, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A run's blocks and its pages' ranges as two tensors of the same shape (one copy)."""
        pages = np.lib.stride_tricks.as_strided(run.page[start:], (run.count, self.nbytes), (run.stride, 1))
        src = torch.from_numpy(pages).view(self.tensor.dtype).view(run.count, *self.tensor.shape[1:])
        return self.tensor[run.block : run.block + run.count], src

    def gather(self, runs: Sequence[BlockRun], start: int) -> None:
        """Copy each run's blocks into its pages' ``[start:start + nbytes]``."""
        for run in runs:
            if run.count == 1 and self.rows is not None:
                run.page[start : start + self.nbytes] = self.rows[run.block]
            elif run.count == 1:
                self._page_view(run.page, start).copy_(self.tensor[run.block])
            else:
                blocks, pages = self._run_views(run, start)
                pages.copy_(blocks)

    def scatter(self, runs: Sequence[BlockRun], start: int) -> None:
        """Copy each run's pages' ``[start:start + nbytes]`` into its blocks."""
        for run in runs:
            if run.count == 1 and self.rows is not None:
                self.rows[run.block] = run.page[start : start + self.nbytes]
            elif run.count == 1:
                self.tensor[run.block].copy_(self._page_view(run.page, start))
            else:
                blocks, pages = self._run_views(run, start)
                blocks.copy_(pages)
