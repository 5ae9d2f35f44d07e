"""One preallocated host buffer for the memory tier: pinned when CUDA is present.

One allocation for the whole tier, not one per page: page-locking is expensive
per call and a fragmented set of small pinned buffers exhausts locked memory.
The buffer is an anonymous mmap, page-aligned so that slots can be read and
written with O_DIRECT; with CUDA it is page-locked in place (``cudaHostRegister``),
exactly its size (torch's pinned allocator rounds a request up to a power of two:
a 40 GiB tier would lock 64 GiB) and mapped for the GPU, whose copy kernel then
reads and writes its slots directly.

A fresh mapping pays a page fault per 4 KiB on its first write (:mod:`lmkv.prefault`:
first writes at 1.1-1.7 GB/s, 8.5-10 GB/s once mapped), so the arena is mapped in
the background: whole from the start (``memory.prefault``, an engine's default: a
step's pages land at once, faster than mapping ahead of use keeps up), or ahead of
the allocator.
"""

from __future__ import annotations

import logging
import mmap
import weakref

import numpy as np

from lmkv.prefault import Prefault

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _page_lock(arena: HostArena, mapping: mmap.mmap, address: int, nbytes: int) -> str | None:
    """Page-lock ``nbytes`` at ``address`` for CUDA (portable, mapped), unlocked when ``arena`` goes
    (``mapping`` is kept until then); None if it worked, else why not (no GPU, the locked-memory limit)."""
    import torch

    try:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))
    except (RuntimeError, AssertionError, AttributeError) as e:
        return str(e)
    if err != 0:
        return f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}"
    weakref.finalize(arena, _page_unlock, cudart, address, mapping)
    return None


def _page_unlock(cudart, address: int, mapping: mmap.mmap) -> None:
    """(``mapping`` is an argument so that it outlives the registration.)"""
    cudart.cudaHostUnregister(address)


class HostArena:
    """``capacity`` bytes as a flat ``numpy.uint8`` array; ``pinned`` says whether it is page-locked."""

    def __init__(self, capacity: int, pin: str = "auto", prefault: bool | None = False, shared: bool = False) -> None:
        """``shared``: back the arena with a shared-memory window (:mod:`lmkv.wire.shm_window`) that an
        lmkv server on this host can map, so its pages are copied straight into arena slots.
        Page-locking wins over sharing: a pinned arena is never shared."""
        if capacity <= 0:
            raise ValueError(f"arena capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.pinned = False
        self.window = None
        self._owner: object
        want_pin = pin == "always" or (pin == "auto" and cuda_available())
        if shared and not want_pin:
            from lmkv.wire.shm_window import create

            self.window = create(capacity, "lmkv-arena")
            self._owner = self.window
            self.buf = self.window.buf
        else:
            m = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._owner = m
            self.buf = np.frombuffer(m, dtype=np.uint8)
            if want_pin:
                why = _page_lock(self, m, self.buf.ctypes.data, capacity)
                if why is not None and pin == "always":
                    raise ValueError(f"memory.pin = 'always': the arena could not be page-locked ({why})")
                if why is not None:
                    log.warning("lmkv: host arena: not page-locked (%s); GPU copies go through torch", why)
                self.pinned = why is None
        # (page-locked memory is mapped already)
        self.prefault = Prefault(self.buf, "lmkv-arena-populate", capacity if self.pinned else 0)
        self.whole = bool(prefault) or self.pinned  # mapped whole from the start, not just ahead of use
        if prefault:
            self.prefault.advance(capacity)
        log.debug("host arena: %d bytes, pinned=%s", capacity, self.pinned)

    def device_visible(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` lie in this arena and it is pinned: a GPU copy kernel can
        then read and write them directly (pinned memory is mapped under unified addressing)."""
        base = self.buf.ctypes.data
        return self.pinned and base <= address and address + nbytes <= base + self.capacity

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset : offset + nbytes]
