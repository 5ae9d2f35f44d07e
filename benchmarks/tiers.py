"""``lmkv bench tiers``: put/get GB/s of the host-memory and disk tiers beside their ceilings.

Per page size (256 KiB, 2 MiB, 16 MiB):

- ``memory.put.*``: ``TieredStore.put`` into a memory-only store, which makes the
  page header (checksums, one pass) and copies into the arena; baseline: a numpy
  memcpy of the same bytes into preallocated buffers.
- ``memory.get.*``: ``TieredStore.get`` into preallocated buffers; same baseline.
- ``disk.put.*``: make the header and ``DiskTier.put`` (temp file, fsync, link);
  baseline: plain sequential write + fsync of the same bytes, one file per
  page, same directory.
- ``disk.get.*``: ``DiskTier.get`` (read + checksum verification); baseline: a
  plain read of those files into a preallocated buffer, after dropping them
  from the page cache (the tier's O_DIRECT reads never hit the cache either).
- ``disk.*.vs_odirect``: the same tier figures against raw O_DIRECT I/O of the
  same bytes, the device's own ceiling.

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


def _raw_write(paths: list[Path], payloads: list[np.ndarray], direct: bool) -> float:
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


def _raw_read(paths: list[Path], dst: np.ndarray, direct: bool) -> float:
    for p in paths:  # cold start for the buffered baseline, as for the tier's O_DIRECT reads
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def run() -> None:
        for p in paths:
            fd = os.open(p, flags)
            try:
                os.readv(fd, [dst.data])
            finally:
                os.close(fd)

    return timed(run)


def _disk(report: Report, label: str, lay: GroupLayout, n: int, rounds: int, root: Path) -> dict:
    size = lay.payload_bytes
    payloads = aligned_buffers(n, size, fill=True)
    dsts = aligned_buffers(n, size, fill=False)
    keys = random_keys(n)
    raw_dir = root / "raw"
    raw_dir.mkdir(exist_ok=True)
    raw = [raw_dir / f"p{i}" for i in range(n)]
    tier = DiskTier(DiskConfig(path=str(root / "tier"), capacity=4 * n * size))

    def put() -> float:
        def run() -> None:
            tier.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench")

        t = timed(run)
        tier.delete(keys)
        return gbps(n * size, t)

    def get() -> float:
        return gbps(n * size, timed(lambda: tier.get(keys, lay, dsts)))

    def raw_put(direct: bool):
        return lambda: gbps(n * size, _raw_write(raw, payloads, direct))

    scratch = aligned_buffers(1, size, fill=False)[0]

    def raw_get(direct: bool):
        return lambda: gbps(n * size, _raw_read(raw, scratch, direct))

    put_v, put_b, put_d = interleaved(rounds, put, raw_put(False), raw_put(True))
    tier.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench")
    get_v, get_b, get_d = interleaved(rounds, get, raw_get(False), raw_get(True))
    for d in dsts:
        d[:] = 0
    tier.get(keys, lay, dsts)
    assert all((d == s).all() for d, s in zip(dsts, payloads)), "disk tier returned wrong bytes"
    report.add(f"disk.put.{label}", put_v, "GB/s", put_b,
               "plain sequential write+fsync of the same bytes, one file per page, same file system")
    report.add(f"disk.get.{label}", get_v, "GB/s", get_b,
               "plain read of those files into a preallocated buffer, page cache dropped first")
    report.add(f"disk.put.{label}.vs_odirect", put_v, "GB/s", put_d, "raw O_DIRECT write+fsync of the same bytes")
    report.add(f"disk.get.{label}.vs_odirect", get_v, "GB/s", get_d, "raw O_DIRECT read of the same bytes")
    return {"direct_io": tier.direct}


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
