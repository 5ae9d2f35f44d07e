"""``lmkv bench gds``: the disk tier's GPUDirect Storage path, on a GPU where cuFile runs.

For 256 pages of 2 MiB and of 256 KiB (``--quick``: 64), on files in ``--dir`` (a file
system cuFile reads: ext4, xfs, ...), with the page cache out of the way (O_DIRECT for every
path):

- ``gds.read.<size>``: ``DiskTier.get_device`` (header on the CPU, payload by cuFile into a
  registered device staging buffer, digests verified on the device) and the kernel's
  scatter of every page into an engine block; baseline: raw cuFile reads of the same
  payload bytes into the same staging buffer (the ceiling).
- ``gds.read.<size>.vs_posix``: the same figure against the POSIX path the worker takes
  otherwise: ``DiskTier.get`` with O_DIRECT into the pinned host arena, then the kernel's
  scatter from there over the bus.
- ``gds.write.<size>``: the kernel's gather of engine blocks into device staging, digests on
  the device, ``DiskTier.put`` from device memory; baseline: raw cuFile writes (and fsync) of
  the same bytes to fresh files.
- ``gds.write.<size>.vs_posix``: against gathering into the pinned arena and ``DiskTier.put``
  with O_DIRECT.

Every read checks its bytes afterwards, and one corrupted file must come back a miss. Where
GDS cannot run the report says why (``params.skipped``) and has no figures.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.config import DiskConfig
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout, Segment, StateKind
from lmkv.page import disk_header_bytes, make_header, padded
from lmkv.tiers import gds
from lmkv.tiers.disk import DiskTier

log = logging.getLogger("lmkv.bench.gds")

SIZES = {"256KiB": 256 << 10, "2MiB": 2 << 20}
LAYERS = 32


def _layout(page_bytes: int) -> GroupLayout:
    return GroupLayout("kv", StateKind.FULL_ATTENTION, num_layers=LAYERS,
                       segments=(Segment("kv", page_bytes // LAYERS),), tokens_per_page=16, dtype="bfloat16")


def run(quick: bool = False, directory: str | None = None) -> Report:
    root = Path(tempfile.mkdtemp(prefix="lmkv-bench-gds-", dir=directory))
    report = Report("gds", params={"dir": str(root), "fs": gds.fs_type(root)})
    try:
        reason = gds.probe(root)
        if reason is not None:
            report.params["skipped"] = reason
            log.warning("gds bench skipped: %s", reason)
            return report
        import torch

        io = gds.engine(torch.cuda.current_device())
        report.params.update(device=torch.cuda.get_device_name(), compat_mode=io.compat_mode,
                             pages=64 if quick else 256)
        for label, size in SIZES.items():
            _one_size(report, label, _layout(size), 64 if quick else 256, 3 if quick else 5, root / label, io)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _one_size(report: Report, label: str, lay: GroupLayout, n: int, rounds: int, root: Path, io) -> None:
    import torch

    from lmkv.kernels import BlockShape, block_copy
    from lmkv.kernels.digests import headers_on_device
    from lmkv.tiers.arena import HostArena

    plen, slot = lay.payload_bytes, padded(lay.payload_bytes)
    dev = torch.device("cuda", io.device)
    staging = torch.zeros(n * slot, dtype=torch.uint8, device=dev)
    io.register(staging.data_ptr(), n * slot)
    blocks = torch.randint(0, 256, (2 * n, plen), dtype=torch.uint8, device=dev)  # the "engine": one block a page
    arena = HostArena(n * slot, pin="auto")
    host = [arena.view(i * slot, slot)[:plen] for i in range(n)]
    rng = np.random.default_rng(1)
    out_ids = torch.tensor(rng.choice(2 * n, n, replace=False), dtype=torch.int64, device=dev)
    layer_ptr = torch.tensor([blocks.data_ptr()], dtype=torch.int64, device=dev)
    dev_pages = torch.tensor([staging.data_ptr() + i * slot for i in range(n)], dtype=torch.int64, device=dev)
    base = int(arena.buf.ctypes.data)
    host_pages = torch.tensor([base + i * slot for i in range(n)], dtype=torch.int64, device=dev)
    shape = BlockShape.contiguous(plen)
    keys = [PageKey(os.urandom(16)) for _ in range(n)]
    tiers = {"gds": DiskTier(DiskConfig(path=str(root / "gds"), capacity=4 * n * slot * 2, io="gds")),
             "posix": DiskTier(DiskConfig(path=str(root / "posix"), capacity=4 * n * slot * 2, io="direct"))}

    def copy(pages, to_pages: bool) -> None:
        block_copy(layer_ptr, out_ids, pages, block_stride=plen, shape=shape, layer_stride=0, page_offset=0,
                   to_pages=to_pages)
        torch.cuda.synchronize(dev)

    def write_gds() -> float:
        def once() -> None:
            copy(dev_pages, True)
            heads = headers_on_device(keys, [staging.data_ptr() + i * slot for i in range(n)], lay)
            ok = tiers["gds"].put([(h, gds.DeviceBuffer(staging.data_ptr() + i * slot)) for i, h in enumerate(heads)],
                                  "bench")
            assert all(ok)

        t = timed(once)
        tiers["gds"].delete(keys)
        return gbps(n * plen, t)

    def write_posix() -> float:
        def once() -> None:
            copy(host_pages, True)
            assert all(tiers["posix"].put([(make_header(k, lay, h), h) for k, h in zip(keys, host)], "bench"))

        t = timed(once)
        tiers["posix"].delete(keys)
        return gbps(n * plen, t)

    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw = [str(raw_dir / f"p{i}") for i in range(n)]

    def write_raw() -> float:
        def once() -> None:
            for i, p in enumerate(raw):
                fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
                try:
                    io.write(fd, staging.data_ptr(), slot, 0, i * slot)
                    os.fsync(fd)
                finally:
                    os.close(fd)

        return gbps(n * plen, timed(once))

    v, b, p = interleaved(rounds, write_gds, write_raw, write_posix)
    report.add(f"gds.write.{label}", v, "GB/s", b, "raw cuFile write+fsync of the same bytes from device memory")
    report.add(f"gds.write.{label}.vs_posix", v, "GB/s", p,
               "kernel gather into the pinned arena, then DiskTier.put with O_DIRECT")

    copy(dev_pages, True)  # the pages to read: written by the GDS tier, read by both (one format)
    want = staging.clone()
    heads = headers_on_device(keys, [staging.data_ptr() + i * slot for i in range(n)], lay)
    assert all(tiers["gds"].put([(h, gds.DeviceBuffer(staging.data_ptr() + i * slot)) for i, h in enumerate(heads)],
                                "bench"))
    posix_root = tiers["posix"].root
    tiers["posix"].close()
    shutil.rmtree(posix_root)
    shutil.copytree(tiers["gds"].root, posix_root)
    tiers["posix"] = DiskTier(DiskConfig(path=str(posix_root), capacity=4 * n * slot * 2, io="direct"))

    def read_gds() -> float:
        def once() -> None:
            got = tiers["gds"].get_device(keys, lay, [gds.DeviceBuffer(staging.data_ptr() + i * slot)
                                                       for i in range(n)])
            assert all(h is not None for h in got)
            copy(dev_pages, False)

        return gbps(n * plen, timed(once))

    def read_posix() -> float:
        def once() -> None:
            got = tiers["posix"].get(keys, lay, host)
            assert all(h is not None for h in got)
            copy(host_pages, False)

        return gbps(n * plen, timed(once))

    files = sorted((tiers["gds"].root / "d").rglob("*.page"))
    offset = disk_header_bytes(lay)

    def read_raw() -> float:
        def once() -> None:
            for i, p in enumerate(files):
                fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                try:
                    io.read(fd, staging.data_ptr(), slot, offset, i * slot)
                finally:
                    os.close(fd)

        return gbps(n * plen, timed(once))

    v, b, p = interleaved(rounds, read_gds, read_raw, read_posix)
    read_gds()
    if not torch.equal(staging.view(n, slot)[:, :plen], want.view(n, slot)[:, :plen]):
        raise RuntimeError("gds bench: pages read through GDS differ from those written")
    report.add(f"gds.read.{label}", v, "GB/s", b,
               "raw cuFile reads of the same payloads into the same device buffer (no header, no verification)")
    report.add(f"gds.read.{label}.vs_posix", v, "GB/s", p,
               "DiskTier.get with O_DIRECT into the pinned arena, then the kernel's scatter over the bus")
    with open(files[0], "r+b") as f:  # a flipped byte: a miss, verified on the device
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = next(k for k in keys if k.hex() in files[0].name)
    got = tiers["gds"].get_device([bad], lay, [gds.DeviceBuffer(staging.data_ptr())])
    if got != [None]:
        raise RuntimeError("gds bench: a corrupted page was not caught on the device")
    for t in tiers.values():
        t.close()
    io.deregister(staging.data_ptr())
