"""AMD's hipFile for the disk tier: GPUDirect Storage's interface on ROCm GPUs.

hipFile (github.com/ROCm/hipFile, ``libhipfile.so``) mirrors cuFile's API: a driver
opened once per process, file descriptors registered as handles, device buffers
registered once, and ``hipFileRead`` / ``hipFileWrite`` between a file offset and a
device buffer offset. :class:`HipFile` puts it behind the same methods as
:class:`lmkv.tiers.gds.CuFile`, so the disk tier, the worker's staging slots and the
on-disk format do not know which one runs. There is no Python binding for hipFile;
this one is ctypes over the C API of ``hipfile.h`` (v0.2).

No AMD GPU has run this: the binding is tested against a host-memory build of the same
C interface (``tests/test_gds.py``); on a ROCm machine ``disk.io: auto`` picks it where
torch is ROCm's build and the library loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator

from lmkv.tiers.gds_engine import GdsEngine

#: hipFileHandleTypeOpaqueFD: a POSIX file descriptor
HANDLE_FD = 1


class _Error(ctypes.Structure):
    """``hipFileError_t``: hipFile's own code and the HIP driver's."""

    _fields_ = [("err", ctypes.c_int), ("hip_drv_err", ctypes.c_int)]


class _Handle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("hFile", ctypes.c_void_p)]


class _Descr(ctypes.Structure):
    """``hipFileDescr_t``."""

    _fields_ = [("type", ctypes.c_int), ("handle", _Handle), ("fs_ops", ctypes.c_void_p)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    err, vp, size, off = _Error, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    for name, args, res in [
        ("hipFileDriverOpen", [], err),
        ("hipFileHandleRegister", [ctypes.POINTER(vp), ctypes.POINTER(_Descr)], err),
        ("hipFileHandleDeregister", [vp], None),
        ("hipFileBufRegister", [vp, size, ctypes.c_int], err),
        ("hipFileBufDeregister", [vp], err),
        ("hipFileRead", [vp, vp, size, off, off], ctypes.c_ssize_t),
        ("hipFileWrite", [vp, vp, size, off, off], ctypes.c_ssize_t),
        ("hipFileGetOpErrorString", [ctypes.c_int], ctypes.c_char_p),
        ("hipFileGetVersion", [ctypes.POINTER(ctypes.c_uint)] * 3, err),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def load(path: str | None = None) -> ctypes.CDLL:
    """libhipfile (``path``, else ``$LMKV_HIPFILE_LIB``, else the loader's search); OSError if absent."""
    path = path or os.environ.get("LMKV_HIPFILE_LIB") or ctypes.util.find_library("hipfile") or "libhipfile.so"
    return _bind(ctypes.CDLL(path, use_errno=True))


def version(lib: ctypes.CDLL) -> tuple[int, int, int]:
    parts = [ctypes.c_uint() for _ in range(3)]
    _check(lib, lib.hipFileGetVersion(*(ctypes.byref(p) for p in parts)), "hipFileGetVersion")
    return tuple(p.value for p in parts)  # type: ignore[return-value]


def _check(lib: ctypes.CDLL, e: _Error, what: str) -> None:
    if e.err != 0:
        text = lib.hipFileGetOpErrorString(e.err) or b"?"
        raise OSError(f"{what}: {text.decode(errors='replace')} (hipFile {e.err}, HIP {e.hip_drv_err})")


class HipFile(GdsEngine):
    """hipFile on one ROCm device, behind :class:`lmkv.tiers.gds.CuFile`'s methods."""

    name = "hipFile"

    def __init__(self, device: int, lib: ctypes.CDLL | None = None) -> None:
        super().__init__(device)
        if lib is None:
            import torch

            torch.cuda.init()
            torch.empty(1, device=f"cuda:{device}")  # a current HIP context
            lib = load()
        self._lib = lib
        _check(lib, lib.hipFileDriverOpen(), "hipFileDriverOpen")
        # (compat_mode stays None: hipFile falls back to POSIX I/O by itself and does not say)

    def _buf_register(self, ptr: int, nbytes: int) -> None:
        _check(self._lib, self._lib.hipFileBufRegister(ptr, nbytes, 0), "hipFileBufRegister")

    def _buf_deregister(self, ptr: int) -> None:
        _check(self._lib, self._lib.hipFileBufDeregister(ptr), "hipFileBufDeregister")

    @contextlib.contextmanager
    def _handle(self, fd: int) -> Iterator[ctypes.c_void_p]:
        descr = _Descr(HANDLE_FD, _Handle(fd=fd), None)
        handle = ctypes.c_void_p()
        _check(self._lib, self._lib.hipFileHandleRegister(ctypes.byref(handle), ctypes.byref(descr)),
               "hipFileHandleRegister")
        try:
            yield handle
        finally:
            self._lib.hipFileHandleDeregister(handle)

    def _io(self, write: bool, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int) -> int:
        call = self._lib.hipFileWrite if write else self._lib.hipFileRead
        with self._handle(fd) as h:
            n = call(h, ptr, nbytes, file_offset, buf_offset)
        if n == -1:
            err = ctypes.get_errno()
            raise OSError(err, f"hipFile I/O: {os.strerror(err) if err else 'system error'}")
        if n < 0:
            text = self._lib.hipFileGetOpErrorString(-n) or b"?"
            raise OSError(f"hipFile I/O: {text.decode(errors='replace')} ({-n})")
        return int(n)
