"""Gather/scatter between an engine's paged KV tensors and page buffers (CPU reference path).

An engine keeps one tensor per layer whose first dimension is the block id
(vLLM: ``[num_blocks, heads, block_size, 2 * head_size]``, strided per the
layout it picked; SGLang host pools similarly). One page holds one block of
every layer of a group, so storing a page *gathers* ``layer[block]`` for each
layer into that layer's range of the page, and loading *scatters* it back.

When a layer's blocks are each contiguous (vLLM's CPU layout, and the
block-outermost layouts), a block is a row of bytes and rows are copied with
numpy, which moves small rows at several times torch's per-call speed. Any
other layout is copied through torch's strided views. This is the reference
the CUDA/HIP kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def gather(self, block_ids: Sequence[int], pages: Sequence[np.ndarray], start: int) -> None:
        """Copy block ``block_ids[i]`` into ``pages[i][start:start + nbytes]`` for every i."""
        end = start + self.nbytes
        if self.rows is not None:
            rows = self.rows
            for b, page in zip(block_ids, pages):
                page[start:end] = rows[b]
        else:
            for b, page in zip(block_ids, pages):
                self._page_view(page, start).copy_(self.tensor[b])

    def scatter(self, block_ids: Sequence[int], pages: Sequence[np.ndarray], start: int) -> None:
        """Copy ``pages[i][start:start + nbytes]`` into block ``block_ids[i]`` for every i."""
        end = start + self.nbytes
        if self.rows is not None:
            rows = self.rows
            for b, page in zip(block_ids, pages):
                rows[b] = page[start:end]
        else:
            for b, page in zip(block_ids, pages):
                self.tensor[b].copy_(self._page_view(page, start))
