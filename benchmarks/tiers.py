"""``lmkv bench tiers``: put/get GB/s of the host-memory and disk tiers beside their ceilings.

Per page size (256 KiB, 2 MiB, 16 MiB), each figure against a baseline that moves the same
bytes the same way (through the page cache, or past it), in the same run:

- ``memory.put.*``: ``TieredStore.put`` into a memory-only store, which makes the
  page header (checksums, one pass) and copies into the arena; baseline: a numpy
  memcpy of the same bytes into preallocated buffers.
- ``memory.get.*``: ``TieredStore.get`` into preallocated buffers; same baseline.
- ``disk.put.*``: make the header and ``DiskTier.put`` with buffered I/O (the default:
  temp file, write, fsync, link); baseline: a plain buffered write + fsync of the same
  bytes, one file per page, same directory.
- ``disk.put.*.direct``: the same with ``disk.io: direct``, against raw O_DIRECT
  write + fsync (where the file system takes O_DIRECT).
- ``disk.get.*.hot``: ``DiskTier.get`` (read + checksum verification) of page files the
  OS page cache holds; baseline: a plain buffered read of cached files of the same size
  into the same buffers.
- ``disk.get.*.cold``: the same with the page cache dropped before each round, for the
  tier's files and the baseline's alike (``POSIX_FADV_DONTNEED`` on each file).
- ``disk.get_layer.*.hot``: ``DiskTier.get_ranges`` of one layer of every cached page (a
  layerwise load's span, its headers kept from an earlier span); baseline: a plain read of the
  same range of each cached file into the same buffers.
- ``disk.get.*.direct``: a ``disk.io: direct`` tier's reads against raw O_DIRECT reads.

Every round runs the tier and its baselines back to back; figures are medians.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.config import DiskConfig, load_config
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout, Segment, StateKind
from lmkv.page import make_header
from lmkv.store import TieredStore
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.posix_io import probe_direct_io

log = logging.getLogger("lmkv.bench.tiers")

SIZES = {"256KiB": 256 << 10, "2MiB": 2 << 20, "16MiB": 16 << 20}
LAYERS = 8


def bench_layout(page_bytes: int) -> GroupLayout:
    unit = page_bytes // (2 * LAYERS)
    return GroupLayout(
        name=f"bench{page_bytes}", kind=StateKind.FULL_ATTENTION, num_layers=LAYERS,
        segments=(Segment("k", unit), Segment("v", unit)), tokens_per_page=16, dtype="bfloat16",
    )


def random_keys(n: int) -> list[PageKey]:
    return [PageKey(os.urandom(16)) for _ in range(n)]


def aligned_buffers(n: int, nbytes: int, fill: bool) -> list[np.ndarray]:
    """Page-aligned, touched buffers (what an arena slot or an engine staging buffer is)."""
    out = []
    rng = np.random.default_rng(0)
    for _ in range(n):
        a = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
        a[:] = rng.integers(0, 256, nbytes, dtype=np.uint8) if fill else 0
        out.append(a)
    return out


def _memory(report: Report, label: str, lay: GroupLayout, n: int, rounds: int) -> None:
    size = lay.payload_bytes
    cfg = load_config(
        {"memory": {"capacity": n * size + (64 << 20), "slab_size": max(64 << 20, size), "prefault": True}},
        environ={},
    )
    payloads = aligned_buffers(n, size, fill=True)
    dsts = aligned_buffers(n, size, fill=False)
    keys = random_keys(n)
    with TieredStore(cfg) as store:

        def put() -> float:
            t = timed(lambda: store.put(keys, [lay] * n, payloads))
            store.delete(keys)
            return gbps(n * size, t)

        def get() -> float:
            return gbps(n * size, timed(lambda: store.get(keys, lay, dsts)))

        def memcpy() -> float:
            def copy() -> None:
                for d, s in zip(dsts, payloads):
                    np.copyto(d, s)

            return gbps(n * size, timed(copy))

        put_v, put_b = interleaved(rounds, put, memcpy)
        store.put(keys, [lay] * n, payloads)
        get_v, get_b = interleaved(rounds, get, memcpy)
        for d in dsts:
            d[:] = 0
        store.get(keys, lay, dsts)
        assert all((d == s).all() for d, s in zip(dsts, payloads)), "memory tier returned wrong bytes"
    what = "numpy memcpy of the same bytes into preallocated buffers, same run"
    report.add(f"memory.put.{label}", put_v, "GB/s", put_b, what)
    report.add(f"memory.get.{label}", get_v, "GB/s", get_b, what)


def _raw_write(paths: list[str], payloads: list[np.ndarray], direct: bool) -> float:
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def run() -> None:
        for p, buf in zip(paths, payloads):
            fd = os.open(p, flags, 0o644)
            try:
                os.write(fd, buf.data)
                os.fsync(fd)
            finally:
                os.close(fd)

    return timed(run)


def _drop_cached(paths: list[str]) -> None:
    """Evict these (written, fsynced) files from the OS page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(paths: list[str], dsts: list[np.ndarray], direct: bool) -> float:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def run() -> None:
        for p, dst in zip(paths, dsts):
            fd = os.open(p, flags)
            try:
                os.readv(fd, [dst.data])
            finally:
                os.close(fd)

    return timed(run)


def _raw_read_range(paths: list[str], dsts: list[np.ndarray], a: int, b: int) -> float:
    def run() -> None:
        for p, dst in zip(paths, dsts):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.preadv(fd, [dst.data[a:b]], a)
            finally:
                os.close(fd)

    return timed(run)


def _page_files(tier_root: Path) -> list[str]:
    return [str(p) for p in (tier_root / "d").rglob("*.page")]


def _disk(report: Report, label: str, lay: GroupLayout, n: int, rounds: int, root: Path) -> dict:
    size = lay.payload_bytes
    payloads = aligned_buffers(n, size, fill=True)
    dsts = aligned_buffers(n, size, fill=False)
    raw_dsts = aligned_buffers(n, size, fill=False)
    keys = random_keys(n)
    raw_dir = root / "raw"
    raw_dir.mkdir(exist_ok=True)
    raw = [str(raw_dir / f"p{i}") for i in range(n)]
    tiers = {"buffered": DiskTier(DiskConfig(path=str(root / "buffered"), capacity=4 * n * size, io="buffered"))}
    if probe_direct_io(root):
        tiers["direct"] = DiskTier(DiskConfig(path=str(root / "direct"), capacity=4 * n * size, io="direct"))

    def put(tier: DiskTier):
        def once() -> float:
            t = timed(lambda: tier.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench"))
            tier.delete(keys)
            return gbps(n * size, t)

        return once

    def raw_put(direct: bool):
        return lambda: gbps(n * size, _raw_write(raw, payloads, direct))

    def get(tier: DiskTier, cold: bool):
        def once() -> float:
            if cold:
                _drop_cached(_page_files(tier.root))
            return gbps(n * size, timed(lambda: tier.get(keys, lay, dsts)))

        return once

    def raw_get(direct: bool, cold: bool):
        def once() -> float:
            if cold:
                _drop_cached(raw)
            return gbps(n * size, _raw_read(raw, raw_dsts, direct))

        return once

    put_v, put_b = interleaved(rounds, put(tiers["buffered"]), raw_put(False))
    report.add(f"disk.put.{label}", put_v, "GB/s", put_b,
               "plain buffered write+fsync of the same bytes, one file per page, same file system")
    if "direct" in tiers:
        v, b = interleaved(rounds, put(tiers["direct"]), raw_put(True))
        report.add(f"disk.put.{label}.direct", v, "GB/s", b, "raw O_DIRECT write+fsync of the same bytes")
    for tier in tiers.values():
        tier.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench")
    _raw_write(raw, payloads, direct=False)
    hot = tiers["buffered"]
    hot.get(keys, lay, dsts)  # both read once: in the page cache
    _raw_read(raw, raw_dsts, direct=False)
    v, b = interleaved(rounds, get(hot, cold=False), raw_get(False, cold=False))
    report.add(f"disk.get.{label}.hot", v, "GB/s", b, "plain buffered read of page-cached files, same buffers")
    lo, hi = lay.layer_range(lay.num_layers // 2)
    hot.get_ranges(keys, lay, [lay.layer_range(0)], dsts)  # (an earlier span: the headers are kept)
    v, b = interleaved(rounds, lambda: gbps(n * (hi - lo), timed(lambda: hot.get_ranges(keys, lay, [(lo, hi)], dsts))),
                       lambda: gbps(n * (hi - lo), _raw_read_range(raw, raw_dsts, lo, hi)))
    report.add(f"disk.get_layer.{label}.hot", v, "GB/s", b,
               "plain buffered read of the same range of each page-cached file, same buffers")
    v, b = interleaved(rounds, get(hot, cold=True), raw_get(False, cold=True))
    report.add(f"disk.get.{label}.cold", v, "GB/s", b,
               "plain buffered read, the page cache dropped for both first, same buffers")
    if "direct" in tiers:
        v, b = interleaved(rounds, get(tiers["direct"], cold=False), raw_get(True, cold=False))
        report.add(f"disk.get.{label}.direct", v, "GB/s", b, "raw O_DIRECT read of the same bytes")
    for tier in tiers.values():
        for d in dsts:
            d[:] = 0
        tier.get(keys, lay, dsts)
        assert all((d == s).all() for d, s in zip(dsts, payloads)), f"{tier.root.name} disk tier: wrong bytes"
        tier.close()
    return {"direct_io_supported": "direct" in tiers}


def run(quick: bool, directory: str | None = None) -> Report:
    mem_total = (64 if quick else 512) << 20
    disk_total = (32 if quick else 256) << 20
    rounds = 3 if quick else 7
    root = Path(tempfile.mkdtemp(prefix="lmkv-bench-tiers-", dir=directory))
    report = Report("tiers", params={
        "page_sizes": list(SIZES), "layers_per_page": LAYERS, "rounds": rounds,
        "memory_bytes_per_round": mem_total, "disk_bytes_per_round": disk_total, "disk_dir": str(root),
    })
    try:
        for label, size in SIZES.items():
            lay = bench_layout(size)
            log.info("memory tier, %s pages", label)
            _memory(report, label, lay, max(2, mem_total // size), rounds)
            log.info("disk tier, %s pages", label)
            d = root / label
            d.mkdir()
            report.params.update(_disk(report, label, lay, max(2, disk_total // size), rounds, d))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report
