"""The page format: a header, then every layer's segments contiguous.

Header (little-endian)::

    offset size field
    0      4    magic  b"LMKV"
    4      2    version
    6      2    flags (0)
    8      4    header_bytes      64 + 8 * num_units (unpadded)
    12     4    num_units         layers x segments
    16     8    layout fingerprint
    24     8    payload length
    32     8    checksum          xxh3_64 over key, fingerprint, length and digests
    40     16   key
    56     8    reserved (0)
    64     8*n  unit digests      xxh3_64 of each (layer, segment) byte range

The payload follows the header; on disk the header is padded to
:data:`ALIGN` so the payload can be read with O_DIRECT or cuFile.

Checksums are per *unit* (one layer's segment) so a layerwise load can verify
exactly the ranges it reads, and the page checksum is a hash of those digests:
computing it is one pass over the payload, done once when the page is made.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from lmkv.errors import ChecksumError, PageFormatError, ShortReadError
from lmkv.keys import KEY_BYTES, PageKey
from lmkv.layout import GroupLayout

MAGIC = b"LMKV"
VERSION = 1
ALIGN = 4096
_FIXED = struct.Struct("<4sHHIIQQQ16sQ")
FIXED_BYTES = _FIXED.size  # 64
MAX_UNITS = 1 << 16  # a bound on what a reader will allocate for a header


def padded(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class PageHeader:
    """A page's header: its key, layout fingerprint, payload length and one digest per (layer, segment) unit."""

    key: PageKey
    layout_fp: int
    payload_len: int
    digests: bytes  # num_units little-endian u64
    checksum: int

    @property
    def num_units(self) -> int:
        return len(self.digests) // 8

    @property
    def header_bytes(self) -> int:
        return FIXED_BYTES + len(self.digests)

    @property
    def disk_header_bytes(self) -> int:
        return padded(self.header_bytes)

    @property
    def disk_bytes(self) -> int:
        """The page's file size: header and payload, each padded to ALIGN."""
        return self.disk_header_bytes + padded(self.payload_len)

    def pack(self) -> bytes:
        return _pack(self.key, self.layout_fp, self.payload_len, self.digests, self.checksum)

    def unit_digest(self, unit: int) -> int:
        return int.from_bytes(self.digests[8 * unit : 8 * unit + 8], "little")


def num_units(layout: GroupLayout) -> int:
    """(layer, segment) units of a page: one digest each."""
    return layout.num_layers * len(layout.segments)


def header_bytes(layout: GroupLayout) -> int:
    """A page header of this layout, packed (what precedes the payload in a network tier's object)."""
    return FIXED_BYTES + 8 * num_units(layout)


def _made(key: bytes, layout_fp: int, payload_len: int, digests: bytes, checksum: int) -> PageHeader:
    """``PageHeader(...)`` for a header already checked, at half the cost: the frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, and a header is made for every
    page read."""
    h = _new(PageHeader)
    _set_key(h, key)
    _set_fp(h, layout_fp)
    _set_len(h, payload_len)
    _set_digests(h, digests)
    _set_checksum(h, checksum)
    return h


_new = object.__new__
_set_key, _set_fp, _set_len, _set_digests, _set_checksum = (
    PageHeader.__dict__[f].__set__ for f in ("key", "layout_fp", "payload_len", "digests", "checksum"))


def disk_header_bytes(layout: GroupLayout) -> int:
    """A page header of this layout as stored on disk (padded to ALIGN)."""
    return padded(FIXED_BYTES + 8 * num_units(layout))


def disk_page_bytes(layout: GroupLayout) -> int:
    """The file size of a page of this layout."""
    return disk_header_bytes(layout) + padded(layout.payload_bytes)


def _header_checksum(key: bytes, layout_fp: int, payload_len: int, digests: bytes) -> int:
    return xxhash.xxh3_64_intdigest(
        key + layout_fp.to_bytes(8, "little") + payload_len.to_bytes(8, "little") + digests
    )


def unit_ranges(layout: GroupLayout) -> tuple[tuple[int, int], ...]:
    """Byte ranges of every (layer, segment) unit in payload order (computed once per layout)."""
    return layout.unit_ranges


def _digests(layout: GroupLayout, payload: memoryview, units: Iterable[int]) -> list[int]:
    slices, digest = layout.unit_slices, xxhash.xxh3_64_intdigest
    return [digest(payload[slices[u]]) for u in units]


def as_bytes_view(buf) -> memoryview:
    """A flat byte view of a buffer (bytes, bytearray, numpy array, memoryview); a flat byte
    memoryview is its own (every page check asks for one)."""
    mv = buf if type(buf) is memoryview else memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def make_header(key: PageKey, layout: GroupLayout, payload) -> PageHeader:
    """Compute the header of a page: one pass over the payload."""
    view = as_bytes_view(payload)
    if len(view) != layout.payload_bytes:
        raise ValueError(
            f"group {layout.name!r}: payload has {len(view)} bytes, layout says {layout.payload_bytes}"
        )
    n_units = num_units(layout)
    return header_of_digests(key, layout, np.array(_digests(layout, view, range(n_units)), dtype="<u8").tobytes())


def header_of_digests(key: PageKey, layout: GroupLayout, digests: bytes) -> PageHeader:
    """The header of a page whose unit digests were computed elsewhere (on the GPU, for a page
    stored from device memory: :mod:`lmkv.kernels.digests`)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key has {KEY_BYTES} bytes, got {len(key)}")
    if len(digests) != 8 * num_units(layout):
        raise ValueError(f"group {layout.name!r}: {len(digests) // 8} digests for {num_units(layout)} units")
    fp = layout.fingerprint
    plen = layout.payload_bytes
    return PageHeader(key, fp, plen, digests, _header_checksum(key, fp, plen, digests))


def _pack(key: bytes, layout_fp: int, payload_len: int, digests: bytes, checksum: int) -> bytes:
    n = len(digests)
    return _FIXED.pack(MAGIC, VERSION, 0, FIXED_BYTES + n, n // 8, layout_fp, payload_len, checksum, key, 0) + digests


def packed_as(header: PageHeader, key: bytes) -> bytes:
    """``rekey(header, key).pack()`` without the header in between (every page a server GET answers)."""
    fp, plen, digests = header.layout_fp, header.payload_len, header.digests
    return _pack(key, fp, plen, digests, _header_checksum(key, fp, plen, digests))


def rekey(header: PageHeader, key: PageKey) -> PageHeader:
    """The same page under another key (the server's namespace-qualified key and back):
    only the header checksum is recomputed, the payload digests stay."""
    return _made(key, header.layout_fp, header.payload_len, header.digests,
                 _header_checksum(key, header.layout_fp, header.payload_len, header.digests))


def unpack_header(buf, expect_key: PageKey | None = None, layout: GroupLayout | None = None) -> PageHeader:
    """Parse and check a header.

    Raises:
        PageFormatError: not an lmkv page of this version, or not of ``expect_key`` / ``layout``.
    """
    view = buf if type(buf) is bytes else as_bytes_view(buf)
    if len(view) < FIXED_BYTES:
        raise ShortReadError(f"page header needs {FIXED_BYTES} bytes, got {len(view)}")
    magic, version, _flags, header_bytes, n_units, fp, plen, checksum, key, _ = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise PageFormatError(f"not an lmkv page (magic {bytes(magic)!r})")
    if version != VERSION:
        raise PageFormatError(f"page format version {version}, this lmkv reads {VERSION}")
    if n_units > MAX_UNITS or header_bytes != FIXED_BYTES + 8 * n_units:
        raise PageFormatError(f"inconsistent header: {header_bytes} bytes for {n_units} units")
    if len(view) < header_bytes:
        raise ShortReadError(f"page header needs {header_bytes} bytes, got {len(view)}")
    digests = bytes(view[FIXED_BYTES:header_bytes])
    if _header_checksum(key, fp, plen, digests) != checksum:
        raise ChecksumError(f"page header checksum mismatch for key {key.hex()}")
    if expect_key is not None and key != expect_key:
        raise PageFormatError(f"page holds key {key.hex()}, expected {expect_key.hex()}")
    if layout is not None:
        if fp != layout.fingerprint:
            raise PageFormatError(
                f"page layout {fp:#018x} differs from group {layout.name!r} ({layout.fingerprint:#018x})"
            )
        if plen != layout.payload_bytes or n_units != num_units(layout):
            raise PageFormatError(f"page size {plen} does not match group {layout.name!r}")
    return _made(key, fp, plen, digests, checksum)


def verify_payload(header: PageHeader, layout: GroupLayout, payload) -> None:
    """Check every unit of a whole payload.

    Raises:
        ChecksumError: a unit does not match its digest (the message names the first bad one).
        ShortReadError: the payload is shorter than the header says.
    """
    verify_units(header, layout, payload, range(header.num_units))


def verify_units(header: PageHeader, layout: GroupLayout, payload, units: Iterable[int]) -> None:
    """Check selected units of a payload laid out at full-page offsets.

    Raises:
        ChecksumError: a unit does not match its digest.
        ShortReadError: the payload is shorter than the header says.
    """
    view = as_bytes_view(payload)
    if len(view) < header.payload_len:
        raise ShortReadError(f"payload has {len(view)} bytes, header says {header.payload_len}")
    if type(units) is range and units.step == 1:  # (every GET's and every landing chunk's case)
        # a run of units is one comparison of packed digests
        got = _digests(layout, view, units)
        if _packed_digests(len(got)).pack(*got) == header.digests[8 * units.start : 8 * units.stop]:
            return
    else:
        units = list(units)
        got = _digests(layout, view, units)
    for u, d in zip(units, got):
        if d != header.unit_digest(u):
            raise _mismatch(header, layout, u)


@functools.cache
def _packed_digests(n: int) -> struct.Struct:
    """How ``n`` unit digests are packed in a header (a unit count is bounded by MAX_UNITS)."""
    return struct.Struct(f"<{n}Q")


def _mismatch(header: PageHeader, layout: GroupLayout, unit: int) -> ChecksumError:
    layer, seg = divmod(unit, len(layout.segments))
    return ChecksumError(
        f"key {header.key.hex()}: layer {layer} segment {layout.segments[seg].name!r} checksum mismatch"
    )


def verify_unit_buffers(header: PageHeader, layout: GroupLayout, units: Sequence) -> None:
    """Check a payload read into one buffer per unit (an engine's block rows), in unit order."""
    if len(units) != header.num_units:  # the caller's mistake, not the page's
        raise ValueError(f"{len(units)} unit buffers for a {header.num_units}-unit page")
    for u, buf in enumerate(units):
        if xxhash.xxh3_64_intdigest(buf) != header.unit_digest(u):
            raise _mismatch(header, layout, u)


def copy_units(layout: GroupLayout, payload, units: Sequence) -> None:
    """Copy a whole payload into one buffer per unit (the inverse of reading units in place)."""
    src = np.frombuffer(as_bytes_view(payload), np.uint8)
    for (start, end), dst in zip(layout.unit_ranges, units):
        np.copyto(np.frombuffer(as_bytes_view(dst), np.uint8), src[start:end])


#: bytes copied or received between checks: a chunk is still in the CPU's cache when its units are hashed
LANDING_CHUNK_BYTES = 256 << 10


#: a run of whole units: (start, end, the units in it)
Chunk = tuple[int, int, range]


def landing_chunks(layout: GroupLayout, ranges: Sequence[tuple[int, int]]) -> tuple[Chunk, ...]:
    """``ranges`` (whole units) cut into runs of whole units of about :data:`LANDING_CHUNK_BYTES`:
    (start, end, the units in it). A receive that verifies each run right after it lands hashes
    bytes still in cache: measured here 1.45x as fast as receiving whole pages and hashing them on a
    second thread. (Remembered per layout and ranges: every GET of a page asks the same.)"""
    return _landing_chunks(layout, tuple(map(tuple, ranges)))


@functools.lru_cache(maxsize=1024)
def _landing_chunks(layout: GroupLayout, ranges: tuple[tuple[int, int], ...]) -> tuple[Chunk, ...]:
    out: list[Chunk] = []
    for a, b in ranges:
        start, first = a, None
        for u in units_in_ranges(layout, [(a, b)]):  # (consecutive units: one range is a run)
            first = u if first is None else first
            end = layout.unit_ranges[u][1]
            if end - start >= LANDING_CHUNK_BYTES or end == b:
                out.append((start, end, range(first, u + 1)))
                start, first = end, None
    return tuple(out)


def units_of_layers(layout: GroupLayout, layers: Iterable[int]) -> list[int]:
    """Unit indices that make up the given layers (all their segments)."""
    n = len(layout.segments)
    return [layer * n + s for layer in layers for s in range(n)]


def units_in_ranges(layout: GroupLayout, ranges: Iterable[tuple[int, int]]) -> Sequence[int]:
    """Unit indices covered by byte ranges; a range must start and end on unit boundaries, and the
    ranges come in increasing order without overlapping: each unit is named at most once, so what
    ranges expand to is bounded by the page (a peer's request cannot multiply it)."""
    bounds = unit_ranges(layout)
    if isinstance(ranges, (list, tuple)) and len(ranges) == 1 and tuple(ranges[0]) == (0, layout.payload_bytes):
        return range(len(bounds))  # (the whole page: the common case)
    starts = layout.unit_starts
    out: list[int] = []
    prev_end = 0
    for start, end in ranges:
        if start < prev_end:
            raise ValueError(f"range [{start}, {end}) overlaps or precedes the range before it")
        prev_end = end
        u = starts.get(start)
        if u is None or not start < end <= layout.payload_bytes:
            raise ValueError(f"range [{start}, {end}) does not start on a unit of group {layout.name!r}")
        while u < len(bounds) and bounds[u][1] <= end:
            out.append(u)
            u += 1
        if bounds[u - 1][1] != end:
            raise ValueError(f"range [{start}, {end}) does not end on a unit of group {layout.name!r}")
    if out and out[-1] - out[0] == len(out) - 1:  # (increasing, so one run: verified in one comparison)
        return range(out[0], out[-1] + 1)
    return out
