"""One preallocated host buffer for the memory tier: pinned when CUDA is present.

One allocation for the whole tier, not one per page: page-locking is expensive
per call and a fragmented set of small pinned buffers exhausts locked memory.
Without CUDA the buffer is an anonymous mmap, page-aligned so that slots can be
read and written with O_DIRECT.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class HostArena:
    """``capacity`` bytes as a flat ``numpy.uint8`` array; ``pinned`` says whether it is page-locked."""

    def __init__(self, capacity: int, pin: str = "auto", prefault: bool = False, shared: bool = False) -> None:
        """``shared``: back the arena with a shared-memory window (:mod:`lmkv.shm_window`) that an
        lmkv server on this host can map, so its pages are copied straight into arena slots.
        Page-locking wins over sharing: a pinned arena is never shared."""
        if capacity <= 0:
            raise ValueError(f"arena capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.pinned = False
        self.window = None
        self._owner: object
        want_pin = pin == "always" or (pin == "auto" and cuda_available())
        if want_pin:
            import torch

            t = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            self._owner = t
            self.buf = t.numpy()
            self.pinned = True
        elif shared:
            from lmkv.shm_window import create

            self.window = create(capacity, "lmkv-arena")
            self._owner = self.window
            self.buf = self.window.buf
        else:
            m = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._owner = m
            self.buf = np.frombuffer(m, dtype=np.uint8)
        if prefault:
            # Touch one byte per OS page so the first puts do not pay page faults.
            self.buf[:: mmap.PAGESIZE] = 0
        log.debug("host arena: %d bytes, pinned=%s", capacity, self.pinned)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset : offset + nbytes]
