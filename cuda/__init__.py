"""CUDA/HIP copy kernels (DESIGN.md mechanism 6), launched with CuPy.

``block_copy.cu`` gathers engine KV blocks into page buffers and scatters them back,
all layers of a step in one launch or one layer at a time. CuPy compiles it with
NVRTC (or hiprtc on ROCm) on first use, so nothing is built at install time. It
handles layouts whose per-layer blocks are contiguous; :mod:`lmkv.blockcopy` is the
reference it is tested against (on a GPU) and the path for every other layout.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import numpy as np

THREADS = 256


def kernel_source() -> str:
    return files(__name__).joinpath("block_copy.cu").read_text()


@cache
def _kernel():
    import cupy

    return cupy.RawModule(code=kernel_source()).get_function("lmkv_block_copy")


def block_copy(layer_ptrs, block_ids, page_ptrs, *, block_stride: int, block_bytes: int,
               layer_stride: int, page_offset: int, to_pages: bool, stream=None) -> None:
    """Copy ``len(block_ids)`` x ``len(layer_ptrs)`` blocks; pointer arrays are int64 device arrays
    (CuPy arrays or torch CUDA tensors), addresses of layer tensors and page buffers."""
    import cupy

    layers, pages = int(len(layer_ptrs)), int(len(block_ids))
    if not layers or not pages:
        return
    args = (
        cupy.asarray(layer_ptrs), cupy.asarray(block_ids), cupy.asarray(page_ptrs),
        np.int64(block_stride), np.int64(block_bytes), np.int64(layer_stride), np.int64(page_offset),
        np.int32(1 if to_pages else 0),
    )
    _kernel()((pages, layers), (THREADS,), args, stream=stream)
