"""The engine's KV layers as copiers, and the streams their copies run on.

Each layer of each cache group gets a copier that gathers its blocks into page ranges and
scatters page ranges into blocks: lmkv's CUDA kernel for a GPU layer it can address
(:class:`lmkv.kernels.KernelLayerBlocks`, pages in the pinned arena or device staging slots), else
torch (:class:`lmkv.engine.blockcopy.LayerBlocks`, the CPU reference). On a GPU the copies run
on streams of their own (``copy_stream``: a step's stream and a background one for
asynchronous loads), ordered against the forward by events; on a CPU engine they run in the
calling thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from lmkv.engine.blockcopy import BlockRun, LayerBlocks, as_bytes_array, block_runs
from lmkv.kernels import KernelLayerBlocks, kernel_layer_blocks, synchronize, to_device
from lmkv.kernels.streams import CopyStreams
from lmkv.layout import GroupLayout
from lmkv.tiers.gds import DeviceBuffer


def layer_copier(layer: torch.Tensor, device_visible: Callable[[int, int], bool]) -> LayerBlocks | KernelLayerBlocks:
    """The copier of an engine layer: for a CUDA tensor, lmkv's kernel
    (:class:`lmkv.kernels.KernelLayerBlocks`, pages in pinned memory where ``device_visible`` says so)
    where it can copy the layout and CuPy is installed; otherwise :class:`LayerBlocks`."""
    if layer.device.type == "cuda":
        k = kernel_layer_blocks(layer, device_visible)
        if k is not None:
            return k
    return LayerBlocks(layer)


def _rows_of(layers: Sequence[LayerBlocks | KernelLayerBlocks]) -> list[LayerBlocks] | None:
    """The layers if each one's blocks are rows of bytes in host memory, else None."""
    rows = [lb for lb in layers if isinstance(lb, LayerBlocks) and lb.rows is not None]
    return rows if len(rows) == len(layers) else None


@dataclass
class Copies:
    """Fetched pages paired with their blocks: host pages as runs, device pages (GDS staging slots)
    as the kernel's (blocks, page addresses) index tensors."""

    runs: list[BlockRun] = field(default_factory=list)
    device: tuple[torch.Tensor, torch.Tensor] | None = None


class Copier:
    """Every layer of every cache group as a copier, and the copy streams (GPU) they run on.

    Built once per worker; the step's thread and the I/O threads of asynchronous loads use it
    (each on its own stream). ``streams`` is None on a CPU engine or with ``copy_stream: false``.
    """

    def __init__(self, groups: Sequence[GroupLayout], tensors: Sequence[Sequence[torch.Tensor]],
                 device_visible: Callable[[int, int], bool], copy_stream: bool) -> None:
        """``tensors[g][l]``: layer ``l`` of group ``g``; ``device_visible(address, bytes)``: whether a
        host buffer is in pinned memory the kernel can reach."""
        self.groups = list(groups)
        self.layers = [[layer_copier(t, device_visible) for t in group] for group in tensors]
        #: per group, its layers where every one is plain rows of bytes (the CPU layout): pages load in place
        self.rows = [_rows_of(layers) for layers in self.layers]
        self.cuda = [t for group in tensors for t in group[:1] if t.device.type == "cuda"]  # a layer per group
        #: GPU: the copies' own streams, ordered against the forward by events (:mod:`lmkv.kernels.streams`)
        self.streams = CopyStreams(t.device for t in self.cuda) if self.cuda and copy_stream else None
        for layout, layers in zip(self.groups, self.layers):
            if len(layers) != layout.num_layers:
                raise ValueError(f"group {layout.name!r}: {len(layers)} tensors for {layout.num_layers} layers")
            for lb in layers:
                if lb.nbytes != layout.layer_stride:
                    raise ValueError(
                        f"group {layout.name!r}: an engine block holds {lb.nbytes} bytes per layer, "
                        f"the page layout expects {layout.layer_stride}"
                    )

    def kernel_only(self, g: int) -> bool:
        """Whether every layer of group ``g`` is copied by lmkv's kernel."""
        return all(isinstance(lb, KernelLayerBlocks) for lb in self.layers[g])

    def copies(self, g: int, block_ids: Sequence[int], views: Sequence) -> Copies:
        """The blocks of the pages that loaded, paired with their host or device pages."""
        host = [(b, as_bytes_array(v)) for b, v in zip(block_ids, views)
                if v is not None and not isinstance(v, DeviceBuffer)]
        on_device = [(b, v.ptr) for b, v in zip(block_ids, views) if isinstance(v, DeviceBuffer)]
        copies = Copies(block_runs([b for b, _ in host], [p for _, p in host]))
        if on_device:
            copies.device = self.index(g, on_device)
        return copies

    def index(self, g: int, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, device page addresses) as the kernel's int64 index tensors on group ``g``'s GPU."""
        dev = self.layers[g][0].tensor.device
        return to_device([b for b, _ in pairs], dev), to_device([p for _, p in pairs], dev)

    def scatter_layer(self, g: int, layer: int, copies: Copies) -> None:
        """Layer ``layer``'s range of each page into its block (queued on the current stream)."""
        start = self.groups[g].layer_range(layer)[0]
        lb = self.layers[g][layer]
        lb.scatter(copies.runs, start)
        if copies.device is not None:
            assert isinstance(lb, KernelLayerBlocks)
            lb.copy_at(*copies.device, start, to_pages=False)

    def gather_all(self, g: int, runs: Iterable[BlockRun]) -> None:
        """Every layer of these blocks into their pages (queued on the current stream)."""
        runs = list(runs)
        for layer, lb in enumerate(self.layers[g]):
            lb.gather(runs, self.groups[g].layer_range(layer)[0])

    def sync(self, background: bool = False) -> None:
        """Wait for the copies queued on the GPU (a no-op on a CPU engine): a step's, or with
        ``background`` those the calling I/O thread queued for an asynchronous load."""
        if self.streams is not None:
            (self.streams.background if background else self.streams.step).synchronize()
        elif self.cuda:
            synchronize(self.cuda)

    def on_stream(self, background: bool = False) -> contextlib.AbstractContextManager:
        """Copies queued inside go to the step's copy stream, or with ``background`` to the one of
        asynchronous loads (without copy streams: the calling thread's current stream)."""
        if self.streams is None:
            return contextlib.nullcontext()
        return (self.streams.background if background else self.streams.step).active()
