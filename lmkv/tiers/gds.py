"""GPUDirect Storage for the disk tier: page payloads read into device memory and written from it.

The disk tier's files are the same whichever engine moves their bytes (header padded
to 4 KiB, then the payload padded to 4 KiB: :mod:`lmkv.tiers.disk`): with cuFile
the header still travels through a small host buffer (it is parsed and its
checksum checked on the CPU), and the payload goes between the file and device
memory with ``cuFileRead`` / ``cuFileWrite``, through nothing else where the
nvidia-fs driver is loaded (true GDS), or through cuFile's own bounce buffers where
it is not (its compatibility mode: POSIX reads inside libcufile, still no copy
through lmkv's memory). The payload is then verified on the device
(:mod:`lmkv.kernels.digests`).

The binding is cuda-python's ``cuda.bindings.cufile``, a thin layer over libcufile
(the ``nvidia-cufile`` wheel): pointer-based reads at any file and buffer offset,
which is what a page (a payload at a fixed offset into a slot of a staging buffer)
needs; it comes with the CUDA Python stack a GPU machine has. (KvikIO adds a thread
pool and its own compatibility mode on top of the same library; lmkv's disk tier
already runs its own I/O threads.)

On ROCm GPUs AMD's hipFile takes cuFile's place behind the same methods
(:mod:`lmkv.tiers.hipfile`); :func:`engine` picks the one of this process's GPUs.

:func:`probe` says whether GDS can serve a directory, and why not: no CUDA device,
no cuFile library, a file system cuFile does not read (tmpfs, overlayfs, ...), or
cuFile refusing a file there. ``disk.io: auto`` falls back to POSIX I/O then,
logged once; ``disk.io: gds`` refuses to start with that reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lmkv.tiers.gds_engine import GdsEngine

log = logging.getLogger(__name__)

#: file systems cuFile reads (ext4 and xfs locally; the distributed ones with their GDS clients)
GDS_FILESYSTEMS = frozenset({"ext4", "xfs", "lustre", "nfs", "nfs4", "wekafs", "beegfs", "gpfs"})
PROBE_BYTES = 4096


@dataclass(frozen=True)
class DeviceBuffer:
    """A page payload in device memory for the disk tier's GDS path: ``padded(payload_bytes)``
    bytes at ``ptr`` (cuFile moves whole 4 KiB units; the tail past the payload is padding)."""

    ptr: int


def fs_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (``/proc/self/mounts``: the longest mount
    point above it), or ``"unknown"``."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def nvidia_fs_loaded() -> bool:
    """Whether the nvidia-fs kernel driver is there (without it cuFile runs in compatibility mode)."""
    return os.path.exists("/proc/driver/nvidia-fs/stats")


def _cufile():
    from cuda.bindings import cufile  # (cuda-python: pip install 'lmkv[gpu]')

    return cufile


def _on_rocm() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def engine(device: int = 0) -> GdsEngine:
    """The GPUDirect Storage engine of this process's GPUs, shared per device: cuFile on CUDA,
    AMD's hipFile (:class:`lmkv.tiers.hipfile.HipFile`, the same methods) on ROCm."""
    if _on_rocm():
        from lmkv.tiers.hipfile import HipFile

        return HipFile.shared(device)
    return CuFile.shared(device)


def _library_missing() -> str | None:
    """Why this GPU's GDS library cannot be used, or None."""
    if _on_rocm():
        from lmkv.tiers import hipfile

        try:
            hipfile.version(hipfile.load())
        except (OSError, AttributeError) as err:
            return f"AMD's hipFile library is not usable ({err})"
        return None
    try:
        _cufile().get_version()
    except ImportError as err:
        return f"cuda-python's cuFile bindings are not importable ({err}; pip install 'lmkv[gpu]')"
    except Exception as err:  # the library itself is missing or broken
        return f"libcufile is not usable ({type(err).__name__}: {err})"
    return None


def probe(directory: str | os.PathLike[str], device: int = 0) -> str | None:
    """``None`` when cuFile (hipFile on ROCm) can read and write page files under ``directory``
    from GPU ``device``; otherwise why not, in words."""
    kind = fs_type(directory)
    if kind not in GDS_FILESYSTEMS:
        return f"{directory} is on {kind}, which cuFile does not read (it reads {', '.join(sorted(GDS_FILESYSTEMS))})"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
    except ImportError:
        return "torch is not installed"
    missing = _library_missing()
    if missing is not None:
        return missing
    try:
        _probe_file(engine(device), Path(directory))
    except Exception as err:  # the library refusing the file, the driver, the buffer: all mean "not here"
        return f"GPUDirect Storage refused a file under {directory} ({type(err).__name__}: {err})"
    return None


def _probe_file(io: GdsEngine, directory: Path) -> None:
    import torch

    buf = torch.arange(PROBE_BYTES, dtype=torch.int32, device=f"cuda:{io.device}").to(torch.uint8)
    back = torch.zeros_like(buf)
    path = directory / f".gds-probe-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        io.write(fd, buf.data_ptr(), PROBE_BYTES, 0)
        io.read(fd, back.data_ptr(), PROBE_BYTES, 0)
        torch.cuda.synchronize(io.device)
        if not torch.equal(buf, back):
            raise OSError("read back different bytes")
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


class CuFile(GdsEngine):
    """cuFile on one CUDA device: the driver opened once per process and device, file handles
    registered around each page's I/O (a page is a file)."""

    name = "cuFile"

    def __init__(self, device: int) -> None:
        import torch

        super().__init__(device)
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=f"cuda:{device}")  # a current context for libcufile
            self._cufile = _cufile()
            self._cufile.driver_open()
        self.compat_mode = not nvidia_fs_loaded()
        self._threads = threading.local()

    def _in_context(self) -> None:
        """Make the device's context current in this thread (the disk tier's I/O threads call in)."""
        if getattr(self._threads, "device", None) != self.device:
            import torch

            torch.cuda.set_device(self.device)
            self._threads.device = self.device

    def _buf_register(self, ptr: int, nbytes: int) -> None:
        self._cufile.buf_register(ptr, nbytes, 0)

    def _buf_deregister(self, ptr: int) -> None:
        self._cufile.buf_deregister(ptr)

    @contextlib.contextmanager
    def _handle(self, fd: int) -> Iterator[int]:
        descr = self._cufile.Descr()
        descr.type = self._cufile.FileHandleType.OPAQUE_FD
        descr.handle.fd = fd
        descr.fs_ops = 0
        try:
            handle = self._cufile.handle_register(descr.ptr)
        except Exception as err:  # (cuFile reads the volume's udev properties: a VM without them is refused)
            raise OSError(f"cuFile refused the file (cuFileHandleRegister: {type(err).__name__}: {err})") from err
        try:
            yield handle
        finally:
            self._cufile.handle_deregister(handle)

    def _io(self, write: bool, fd: int, ptr: int, nbytes: int, file_offset: int, buf_offset: int) -> int:
        self._in_context()
        op = "write" if write else "read"
        try:
            with self._handle(fd) as h:
                return int(getattr(self._cufile, op)(h, ptr, nbytes, file_offset, buf_offset))
        except OSError:
            raise
        except Exception as err:  # cuda-python's cuFileError, a CUDA error: the tier's I/O failed
            raise OSError(f"cuFile {op}: {type(err).__name__}: {err}") from err


@cache
def _fallback_warning(directory: str, reason: str) -> None:
    log.warning("lmkv: disk tier %s: GPUDirect Storage not used (%s); reading and writing with POSIX I/O",
                directory, reason)


def choose(directory: str | os.PathLike[str], required: bool, device: int = 0) -> GdsEngine | None:
    """The GDS engine for the disk tier under ``directory`` (:func:`engine`), or ``None`` (POSIX I/O;
    logged once). ``required`` (``disk.io: gds``): a reason not to use it is an error, raised as
    ValueError."""
    reason = probe(directory, device)
    if reason is None:
        io = engine(device)
        log.info("lmkv: disk tier %s: GPUDirect Storage (%s) on cuda:%d%s", directory, type(io).__name__, device,
                 " (compatibility mode: no nvidia-fs driver)" if io.compat_mode else "")
        return io
    if required:
        raise ValueError(f"disk.io = 'gds': {reason}")
    _fallback_warning(str(directory), reason)
    return None
