"""Page digests on the GPU: XXH3-64 of each (layer, segment) unit, bit-identical to the CPU's.

A page that lands in device memory (read from disk with GPUDirect Storage) is verified
there, before the kernel scatters it into the engine's blocks: one launch of
``xxh3.cu`` hashes every unit of every page (8 threads a unit), and the digests are
compared with those its header recorded when the page was made (:mod:`lmkv.page`).
A page that does not match is a miss, recomputed, as on the CPU path. The kernel's
source is the same text the test-suite builds for the host and checks against the
xxhash package on every length class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import cache
from importlib.resources import files

import numpy as np

from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, header_of_digests, unit_ranges

UNITS_PER_BLOCK = 8  # 64 threads: 8 units x 8 lanes (xxh3.cu)


def digest_source() -> str:
    return files(__package__).joinpath("xxh3.cu").read_text()


@cache
def _kernel():
    import cupy

    return cupy.RawModule(code=digest_source()).get_function("lmkv_xxh3_64")


def device_digests(ptrs, lens, stream=None, device: int | None = None):
    """XXH3-64 of each byte range ``[ptrs[i], ptrs[i] + lens[i])`` (device or pinned host memory), as
    a CuPy uint64 array on ``device`` (default: the current one), queued on ``stream``. ``ptrs`` and
    ``lens``: sequences of ints, or int64 arrays already on the device (torch or CuPy: nothing is
    copied, so nothing waits for the stream)."""
    import cupy

    n = len(ptrs)
    # (address arrays copied from the host go on ``stream`` too: on CuPy's own stream they could
    # still be in flight when a kernel on another stream reads them)
    with cupy.cuda.Device(device), stream if stream is not None else contextlib.nullcontext():
        out = cupy.empty(n, dtype=cupy.uint64)
        if n:
            args = (_on_device(ptrs, np.int64).view(cupy.uint64), _on_device(lens, np.int64), out, np.int64(n))
            _kernel()(((n + UNITS_PER_BLOCK - 1) // UNITS_PER_BLOCK,), (8 * UNITS_PER_BLOCK,), args, stream=stream)
    return out


def _on_device(values, dtype):
    """``values`` as a CuPy array: a device array as it is (zero copy), a host sequence copied over."""
    import cupy

    if hasattr(values, "__cuda_array_interface__"):
        return cupy.asarray(values)
    return cupy.asarray(np.asarray(values, dtype))


def _unit_digests(payloads: Sequence[int], layout: GroupLayout, stream=None, device: int | None = None) -> np.ndarray:
    """[pages, units] digests of the payloads at these device addresses, in one launch."""
    ranges = unit_ranges(layout)
    ptrs = [base + a for base in payloads for a, _ in ranges]
    lens = [b - a for _ in payloads for a, b in ranges]
    got = device_digests(ptrs, lens, stream, device)
    return got.get(stream=stream).reshape(len(payloads), len(ranges))


def headers_on_device(keys: Sequence[PageKey], payloads: Sequence[int], layout: GroupLayout,
                      stream=None, device: int | None = None) -> list[PageHeader]:
    """The headers of pages whose payloads are in device memory (to store them from there)."""
    digests = _unit_digests(payloads, layout, stream, device).astype("<u8")
    return [header_of_digests(k, layout, row.tobytes()) for k, row in zip(keys, digests)]


def verify_on_device(payloads: Sequence[int], layout: GroupLayout, headers: Sequence[PageHeader],
                     stream=None, device: int | None = None) -> list[bool]:
    """Whether each page's payload (at device address ``payloads[i]``) matches its header's unit
    digests; one launch for all of them."""
    got = _unit_digests(payloads, layout, stream, device)
    want = np.frombuffer(b"".join(h.digests for h in headers), "<u8").reshape(got.shape)
    return [bool(row.all()) for row in got == want]
