"""Gather/scatter between an engine's paged KV tensors and page buffers (pure torch).

An engine keeps one tensor per layer whose first dimension is the block id
(vLLM: ``[num_blocks, heads, block_size, 2 * head_size]``, strided per the
layout it picked; SGLang host pools similarly). One page holds one block of
every layer of a group, so storing a page *gathers* ``layer[block]`` for each
layer into that layer's range of the page, and loading *scatters* it back.

This is the reference path: it runs on CPU engines and is what the CUDA/HIP
kernels are tested against. It copies through strided views, so every physical
layout the engine may choose is handled without assuming contiguity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def block_nbytes(layer: torch.Tensor) -> int:
    """Bytes of one block of one layer."""
    return layer[0].numel() * layer.element_size()


def as_uint8_tensor(buf) -> torch.Tensor:
    """A uint8 CPU tensor over a host buffer (numpy array, mmap, memoryview) without copying."""
    if isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8).reshape(-1)
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    return torch.frombuffer(buf, dtype=torch.uint8)


def _page_view(page: torch.Tensor, start: int, layer: torch.Tensor) -> torch.Tensor:
    n = block_nbytes(layer)
    return page[start : start + n].view(layer.dtype).view(layer.shape[1:])


def gather_layer(layer: torch.Tensor, block_ids: Sequence[int], pages: Sequence[torch.Tensor], start: int) -> None:
    """Copy ``layer[block_ids[i]]`` into ``pages[i][start:...]`` for every i."""
    for b, page in zip(block_ids, pages):
        _page_view(page, start, layer).copy_(layer[b])


def scatter_layer(layer: torch.Tensor, block_ids: Sequence[int], pages: Sequence[torch.Tensor], start: int) -> None:
    """Copy ``pages[i][start:...]`` into ``layer[block_ids[i]]`` for every i."""
    for b, page in zip(block_ids, pages):
        layer[b].copy_(_page_view(page, start, layer))
