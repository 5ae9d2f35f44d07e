"""cuFile's interface and device staging slots over host memory: this machine has no GPU, so the
"device" addresses are host ones and reads are ``preadv``. The store's and the disk tier's GDS
routing run against these; the real engine is tested on a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from lmkv.config import load_config
from lmkv.page import padded
from lmkv.store import TieredStore
from lmkv.tiers.disk import DiskTier


class HostCuFile:
    """cuFile's interface over host memory: this machine has no GPU, so the "device" addresses are
    host ones and reads are preadv. It lets the store's routing run here; the real engine is
    tested on a GPU below."""

    device = 0

    def read(self, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int = 0) -> None:
        import ctypes
        import os

        if os.preadv(fd, [(ctypes.c_char * nbytes).from_address(ptr + buf_offset)], file_offset) != nbytes:
            raise OSError("short read")

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def deregister(self, ptr: int) -> None:
        pass


class HostStaging:
    def __init__(self, io, slot: int, slots: int) -> None:
        import mmap

        from lmkv.tiers.device_staging import StagingLease

        self.io, self.slot = io, padded(slot)
        self.buf = np.frombuffer(mmap.mmap(-1, self.slot * slots), np.uint8)  # aligned, as O_DIRECT needs
        self._free = [self.buf.ctypes.data + i * self.slot for i in range(slots)]
        self._lease = StagingLease

    def take(self, n: int):
        got, self._free = self._free[:n], self._free[n:]
        return self._lease(got, self)

    def give_back(self, ptrs) -> None:
        self._free.extend(ptrs)

    def page(self, ptr: int, n: int) -> np.ndarray:
        off = ptr - self.buf.ctypes.data
        return self.buf[off : off + n]


@contextmanager
def gds_store(root, cufile, slot_payload: int, slots: int) -> Iterator[tuple[TieredStore, DiskTier, HostStaging]]:
    """A store over a buffered disk tier under ``root`` whose GDS engine is ``cufile`` (a stand-in
    above), and ``slots`` staging slots of ``slot_payload`` bytes for it."""
    cfg = load_config({"memory": {"capacity": "4MiB"}, "disk": {"path": str(root / "d"), "io": "buffered"}},
                      environ={})
    with TieredStore(cfg) as store:
        disk = store.tiers[1]
        assert isinstance(disk, DiskTier)
        disk.gds = cufile
        yield store, disk, HostStaging(cufile, slot_payload, slots)
