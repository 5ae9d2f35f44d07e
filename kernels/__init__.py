"""CUDA/HIP copy kernels (docs/design/kernels-and-storage.md), launched with CuPy.

``block_copy.cu`` gathers engine KV blocks into page buffers and scatters them back,
all layers of a step in one launch or one layer at a time. CuPy compiles it with
NVRTC (or hiprtc on ROCm) on first use, so nothing is built at install time.

:class:`KernelLayerBlocks` is one CUDA layer tensor behind the same ``gather`` /
``scatter`` interface as :class:`lmkv.engine.blockcopy.LayerBlocks` (the CPU reference the
kernel is tested against, and the path for what the kernel cannot do): pages in pinned
host memory (the memory tier's arena) are copied by the kernel straight over the bus,
one launch per layer; a page elsewhere (a temporary buffer) goes through torch. The
kernel writes the same bytes as the reference: a block's elements in its logical order
(``layer[block]`` as torch copies it), whatever the engine's physical layout, so a page
stored by a GPU engine loads into a CPU one and back.

Copies are queued on torch's current stream, after the layer's compute and before the
next layer's: the caller synchronizes (:func:`synchronize`) before it commits or releases
the host pages.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import numpy as np
import torch

from lmkv.engine.blockcopy import LayerBlocks, address, block_nbytes

log = logging.getLogger(__name__)

THREADS = 256


def kernel_source() -> str:
    return files(__name__).joinpath("block_copy.cu").read_text()


@cache
def _kernel():
    import cupy

    return cupy.RawModule(code=kernel_source()).get_function("lmkv_block_copy")


@dataclass(frozen=True)
class BlockShape:
    """Where one block's bytes sit in the engine: ``rows_a`` x ``rows_b`` rows of ``row_bytes``
    contiguous bytes, row (a, b) at ``a * src_a + b * src_b`` from the block's start; in a page
    the rows are dense, in that order."""

    rows_a: int
    rows_b: int
    row_bytes: int
    src_a: int
    src_b: int

    @classmethod
    def contiguous(cls, nbytes: int) -> BlockShape:
        return cls(1, 1, nbytes, 0, 0)


def block_shape(layer) -> BlockShape | None:
    """The shape of ``layer[b]`` (a torch tensor whose first dimension is the block), or None if its
    elements are not rows of contiguous bytes indexed by at most two strides."""
    item = layer.element_size()
    dims = [(n, s * item) for n, s in zip(layer.shape[1:], layer.stride()[1:]) if n != 1]
    if not dims:
        return BlockShape.contiguous(item)
    if dims[-1][1] != item:
        return None  # the innermost elements are not contiguous
    row = dims.pop()[0] * item
    while dims and dims[-1][1] == row:  # the next dimension continues the row
        row *= dims.pop()[0]
    merged: list[tuple[int, int]] = []
    for n, s in dims:  # merge outer dimensions that step evenly into the next one
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, 0))
    (na, sa), (nb, sb) = merged
    return BlockShape(na, nb, row, sa, sb)


def block_copy(layer_ptrs, block_ids, page_ptrs, *, block_stride: int, shape: BlockShape,
               layer_stride: int, page_offset: int, to_pages: bool, stream=None) -> None:
    """Copy ``len(block_ids)`` x ``len(layer_ptrs)`` blocks; pointer arrays are int64 device arrays
    (CuPy arrays or torch CUDA tensors), addresses of layer tensors and page buffers."""
    import cupy

    layers, pages = int(len(layer_ptrs)), int(len(block_ids))
    if not layers or not pages:
        return
    args = (
        cupy.asarray(layer_ptrs), cupy.asarray(block_ids), cupy.asarray(page_ptrs), np.int64(block_stride),
        np.int64(shape.rows_a), np.int64(shape.rows_b), np.int64(shape.row_bytes), np.int64(shape.src_a),
        np.int64(shape.src_b), np.int64(layer_stride), np.int64(page_offset), np.int32(1 if to_pages else 0),
    )
    _kernel()((pages, layers), (THREADS,), args, stream=stream)


@dataclass(frozen=True)
class _Gathered:
    """A digested gather's device staging (one slot a page) and its kernels' address arrays."""

    staging: torch.Tensor
    base: Any  # (CuPy int64 arrays on the layer's device)
    slots: Any
    slot_ptrs: Any
    unit_ptrs: Any
    unit_lens: Any


#: what the kernels need for the runs lists copied lately (:func:`_once`): per list and device its
#: CuPy index arrays, per digested gather its :class:`_Gathered`; the worker's background loads use
#: it from their own threads
_INDEX_CACHE: dict = {}
_INDEX_LOCK = threading.Lock()


def _once(key: tuple, runs: Sequence, make: Callable[[], Any]) -> Any:
    """What ``make`` makes for ``runs`` under ``key``, made once while the list is in use (a step
    copies the same runs for every layer); the cache holds the list, which keeps its id from being
    reused, and the last 8 such lists (a step's loads and stores, per group)."""
    with _INDEX_LOCK:
        hit = _INDEX_CACHE.get(key)
    if hit is not None and hit[0] is runs:
        return hit[1]
    made = make()
    with _INDEX_LOCK:
        if len(_INDEX_CACHE) >= 8:
            _INDEX_CACHE.pop(next(iter(_INDEX_CACHE)))
        _INDEX_CACHE[key] = (runs, made)
    return made


def _device_int64(value: int, device: torch.device):
    """A one-element CuPy int64 array on ``device`` holding ``value`` (filled there: no host copy
    that could wait for the stream)."""
    import cupy

    return cupy.asarray(torch.full((1,), value, dtype=torch.int64, device=device))


def _stream(device):
    """Torch's current stream on ``device``, as CuPy sees it (the kernel is queued behind the layer)."""
    import cupy

    s = torch.cuda.current_stream(device)
    try:
        return cupy.cuda.Stream.from_external(s)  # CuPy >= 14 (torch streams speak __cuda_stream__)
    except (AttributeError, TypeError):
        return cupy.cuda.ExternalStream(s.cuda_stream)


def to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, copied on the current stream without the host
    waiting: staged in pinned memory (``torch.tensor(..., device=...)`` copies from pageable memory
    and waits for the stream, which on the worker's copy stream may be waiting for the forward;
    torch keeps the pinned staging until the copy has run)."""
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def cupy_device(device: torch.device):
    """CuPy's device context for a torch CUDA device."""
    import cupy

    return cupy.cuda.Device(device.index)


class KernelLayerBlocks:
    """One CUDA layer tensor, addressed by block; ``device_visible(address, nbytes)`` says whether a
    host buffer is pinned memory the GPU can reach."""

    rows = None  # (the CPU layout's in-place rows: never on a GPU)

    def __init__(self, layer, shape: BlockShape, device_visible: Callable[[int, int], bool]) -> None:
        self.tensor = layer
        self.nbytes = block_nbytes(layer)
        self.shape = shape
        self.block_stride = layer.stride(0) * layer.element_size()
        self.visible = device_visible
        self.fallback = LayerBlocks(layer)  # for pages the GPU cannot reach
        self._ptr: Any = None  # (a CuPy int64 array: the layer's address)

    def _indices(self, runs: Sequence):
        """The blocks and page addresses the kernel can copy (CuPy arrays), and the runs it cannot;
        made once for a list of runs (:func:`_once`)."""
        return _once((id(runs), self.tensor.device), runs, lambda: self._make_indices(runs))

    def _make_indices(self, runs: Sequence):
        blocks: list[int] = []
        pages: list[int] = []
        rest = []
        for run in runs:
            base = address(run.page)
            if run.page.strides == (1,) and self.visible(base, (run.count - 1) * run.stride + len(run.page)):
                blocks.extend(range(run.block, run.block + run.count))
                pages.extend(base + i * run.stride for i in range(run.count))
            else:
                rest.append(run)
        import cupy

        dev = self.tensor.device
        # (as CuPy arrays: the kernel's launch takes them as they are, layer after layer)
        return cupy.asarray(to_device(blocks, dev)), cupy.asarray(to_device(pages, dev)), rest

    def _copy(self, runs: Sequence, start: int, to_pages: bool) -> list:
        blocks, pages, rest = self._indices(runs)
        self.copy_at(blocks, pages, start, to_pages)
        return rest

    def copy_at(self, blocks, pages, start: int, to_pages: bool) -> None:
        """Queue the copy between blocks ``blocks[i]`` and the pages at addresses ``pages[i]``
        (int64 arrays on this layer's device, torch or CuPy; pages in device memory, or pinned host memory),
        each page's ``[start:start + nbytes]``."""
        if not len(blocks):
            return
        if self._ptr is None:
            self._ptr = _device_int64(self.tensor.data_ptr(), self.tensor.device)
        # the tensor's device, not the thread's current one (a store I/O thread's is device 0)
        with cupy_device(self.tensor.device):
            block_copy(self._ptr, blocks, pages, block_stride=self.block_stride, shape=self.shape,
                       layer_stride=0, page_offset=start, to_pages=to_pages, stream=_stream(self.tensor.device))

    def gather(self, runs: Sequence, start: int) -> None:
        """Queue the copy of each run's blocks into its pages' ``[start:start + nbytes]``."""
        rest = self._copy(runs, start, True)
        if rest:
            self.fallback.gather(rest, start)

    def gather_digested(self, runs: Sequence, start: int, units: Sequence[tuple[int, int]]):
        """:meth:`gather`, and the XXH3-64 of each page's ``units`` (byte ranges relative to ``start``)
        computed on the device: the blocks are gathered into device memory first, hashed there, then
        copied into the pages in one more launch, so the host never reads the bytes to checksum them.
        The digests (a CuPy uint64 array, ``[pages, units]`` in the runs' page order) are ready once
        the queue has run; None (and a plain gather) where a page is not in pinned memory."""
        from lmkv.kernels.digests import device_digests

        blocks, pages, rest = self._indices(runs)
        if rest:
            self.gather(runs, start)
            return None
        stream = _stream(self.tensor.device)
        g = self._gathered(runs, units, len(blocks), stream)
        self.copy_at(blocks, g.slot_ptrs, 0, to_pages=True)
        digests = device_digests(g.unit_ptrs, g.unit_lens, stream, self.tensor.device.index)
        with cupy_device(self.tensor.device):
            block_copy(g.base, g.slots, pages, block_stride=self.nbytes, shape=BlockShape.contiguous(self.nbytes),
                       layer_stride=0, page_offset=start, to_pages=True, stream=stream)
        return digests.reshape(len(blocks), len(units))

    def _gathered(self, runs: Sequence, units: Sequence[tuple[int, int]], n: int, stream) -> _Gathered:
        """The device staging of a digested gather and its address arrays, made once for a list of
        runs and reused for every layer a step stores (a layer's copies are queued on one stream
        behind the previous layer's, so they may share the buffer)."""
        key = ("gathered", id(runs), tuple(units), self.tensor.device, self.nbytes, stream.ptr)
        return _once(key, runs, lambda: self._make_gathered(units, n))

    def _make_gathered(self, units: Sequence[tuple[int, int]], n: int) -> _Gathered:
        import cupy

        dev = self.tensor.device
        # (every array made on the device or staged through pinned memory, on the copies' stream:
        # nothing here waits for it, which may be waiting for the forward)
        staging = torch.empty(n * self.nbytes, dtype=torch.uint8, device=dev)
        base = staging.data_ptr()
        slots = torch.arange(n, dtype=torch.int64, device=dev)
        starts = to_device([a for a, _ in units], dev)
        lens = to_device([b - a for a, b in units], dev)
        return _Gathered(
            staging=staging,
            base=_device_int64(base, dev),
            slots=cupy.asarray(slots),
            slot_ptrs=cupy.asarray(slots * self.nbytes + base),
            unit_ptrs=cupy.asarray((slots[:, None] * self.nbytes + base + starts[None, :]).reshape(-1)),
            unit_lens=cupy.asarray(lens.repeat(n)),
        )

    def scatter(self, runs: Sequence, start: int) -> None:
        """Queue the copy of each run's pages' ``[start:start + nbytes]`` into its blocks."""
        rest = self._copy(runs, start, False)
        if rest:
            self.fallback.scatter(rest, start)


def kernel_layer_blocks(layer, device_visible: Callable[[int, int], bool]) -> KernelLayerBlocks | None:
    """The kernel's view of a CUDA layer tensor, or None where it cannot copy it (CuPy missing, a
    layout it cannot express): the caller then copies with torch."""
    shape = block_shape(layer)
    if shape is None:
        _warn_once(f"lmkv: a KV layout the copy kernel cannot express (shape {tuple(layer.shape)}, strides "
                   f"{layer.stride()}): copying with torch")
        return None
    try:
        import cupy  # noqa: F401
    except ImportError:
        _warn_once("lmkv: CuPy is not installed (pip install 'lmkv[gpu]'): copying KV blocks with torch")
        return None
    return KernelLayerBlocks(layer, shape, device_visible)


@cache
def _warn_once(message: str) -> None:
    """(An engine registers every layer: one warning, not one per layer.)"""
    log.warning(message)


def synchronize(tensors: Sequence) -> None:
    """Wait for the copies queued on torch's current stream of each device these tensors are on."""
    for dev in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()
