"""Device staging slots for the disk tier's GPUDirect Storage path in the worker.

With GDS a page travels between its file and the GPU without a stop in host memory:
a load reads the payload into a slot of this buffer (registered with cuFile once, so
the driver does not pin memory per read), verifies it there, and the copy kernel
scatters it into the engine's blocks; a store gathers the blocks into slots and
cuFile writes them out. Slots are lent per fetch and come back when its copies have
run; when every slot is lent the pages left over take the host path (the pinned
arena), so a large hit never waits for room here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from lmkv.page import padded


@dataclass
class StagingLease:
    """Slots lent by a :class:`DeviceStaging` (device addresses); give them back with :meth:`release`."""

    ptrs: list[int]
    _staging: DeviceStaging | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._staging is not None and self.ptrs:
            self._staging.give_back(self.ptrs)
        self.ptrs = []


class DeviceStaging:
    """``slots`` page slots of ``padded(slot_payload)`` bytes in device memory on cuFile's device,
    registered with it (``io``: :class:`lmkv.tiers.gds.CuFile` or the hipFile engine)."""

    def __init__(self, io, slot_payload: int, slots: int) -> None:
        import torch

        self.io = io
        self.slot_bytes = padded(slot_payload)
        self._buf = torch.empty(self.slot_bytes * slots, dtype=torch.uint8, device=f"cuda:{io.device}")
        self._base = self._buf.data_ptr()
        io.register(self._base, self.slot_bytes * slots)
        self._free = [self._base + i * self.slot_bytes for i in range(slots)]
        self._lock = threading.Lock()

    @property
    def device(self) -> int:
        return self.io.device

    def take(self, n: int) -> StagingLease:
        """Up to ``n`` free slots (fewer, or none, when the others are lent)."""
        with self._lock:
            got, self._free = self._free[:n], self._free[n:]
        return StagingLease(got, self)

    def give_back(self, ptrs: list[int]) -> None:
        with self._lock:
            self._free.extend(ptrs)

    def close(self) -> None:
        self.io.deregister(self._base)
