"""What a GPUDirect Storage library gives the disk tier, whichever one a GPU has.

:class:`GdsEngine` is the interface of :class:`lmkv.tiers.gds.CuFile` (NVIDIA's cuFile) and
:class:`lmkv.tiers.hipfile.HipFile` (AMD's hipFile): one per process and device, device
buffers registered once, reads and writes between a file offset and a device buffer offset.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import ClassVar, Self


class GdsEngine(ABC):
    """A GPUDirect Storage library on one GPU, shared per process and device: buffers registered
    once (the library pins them once, not per read), reads and writes between a file offset and
    a device buffer offset that raise OSError when short or failed (the page is then a miss, or
    not stored). Two of them: :class:`CuFile` and :class:`lmkv.tiers.hipfile.HipFile`."""

    _shared: ClassVar[dict[int, GdsEngine]]
    _lock: ClassVar[threading.Lock]
    name: ClassVar[str]  # how the library calls its reads: cuFile, hipFile

    def __init__(self, device: int) -> None:
        self.device = device
        #: whether the library moves bytes through bounce buffers of its own (None: it does not say)
        self.compat_mode: bool | None = None
        self._buffers: set[int] = set()

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        cls._shared, cls._lock = {}, threading.Lock()

    @classmethod
    def shared(cls, device: int = 0) -> Self:
        with cls._lock:
            io = cls._shared.get(device)
            if io is None:
                io = cls._shared[device] = cls(device)
            return io  # type: ignore[return-value]

    def register(self, ptr: int, nbytes: int) -> None:
        """Register a device buffer that page I/O will reuse."""
        if ptr not in self._buffers:
            self._buf_register(ptr, nbytes)
            self._buffers.add(ptr)

    def deregister(self, ptr: int) -> None:
        if ptr in self._buffers:
            self._buffers.discard(ptr)
            self._buf_deregister(ptr)

    def read(self, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int = 0) -> None:
        """``nbytes`` of the file at ``file_offset`` into device memory at ``ptr + buf_offset``."""
        got = self._io(False, fd, ptr, nbytes, file_offset, buf_offset)
        if got != nbytes:
            raise OSError(f"{self.name}Read: {got} of {nbytes} bytes")

    def write(self, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int = 0) -> None:
        """``nbytes`` from device memory at ``ptr + buf_offset`` into the file at ``file_offset``."""
        put = self._io(True, fd, ptr, nbytes, file_offset, buf_offset)
        if put != nbytes:
            raise OSError(f"{self.name}Write: {put} of {nbytes} bytes")

    @abstractmethod
    def _buf_register(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def _buf_deregister(self, ptr: int) -> None: ...

    @abstractmethod
    def _io(self, write: bool, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int) -> int:
        """Bytes moved; raises OSError on the library's errors."""
