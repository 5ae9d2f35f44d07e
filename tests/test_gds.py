"""GPUDirect Storage for the disk tier: where it is chosen and why not (runs anywhere), and the
device path itself against the POSIX engines on the same files (on a GPU with cuFile)."""

from __future__ import annotations

import logging
import shutil
import subprocess

import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import DiskConfig
from lmkv.page import disk_header_bytes, padded
from lmkv.tiers import gds
from lmkv.tiers.disk import DiskTier, probe_direct_io


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="no findmnt")
def test_the_file_system_type_is_the_kernels(tmp_path):
    want = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(tmp_path)], capture_output=True,
                          text=True).stdout.strip()
    assert gds.fs_type(tmp_path) == want


def test_a_tmpfs_is_not_for_cufile(tiny_fs):
    reason = gds.probe(tiny_fs)
    assert reason is not None and "tmpfs" in reason


def test_auto_uses_gds_where_it_can_and_says_once_why_not(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lmkv")
    reason = gds.probe(tmp_path)
    tiers = [DiskTier(DiskConfig(path=str(tmp_path / f"t{i}"), io="auto")) for i in range(2)]
    try:
        if reason is None:  # a GPU machine where cuFile reads this file system
            assert all(t.gds is not None and t.direct for t in tiers)
            return
        assert all(t.gds is None for t in tiers)
        assert all(t.direct == probe_direct_io(tmp_path) for t in tiers)  # then O_DIRECT where it can
        said = [r.getMessage() for r in caplog.records if "GPUDirect Storage not used" in r.getMessage()]
        assert len(said) == 2 and all(reason.split(" (")[0] in m for m in said)  # once per tier directory
    finally:
        for t in tiers:
            t.close()


def test_gds_required_where_it_cannot_run_is_refused_with_the_reason(tiny_fs):
    with pytest.raises(ValueError, match="disk.io = 'gds': .*tmpfs"):
        DiskTier(DiskConfig(path=str(tiny_fs / "d"), io="gds"))


# -- the device path (a GPU, libcufile, a file system cuFile reads) -----------------------------------

@pytest.fixture
def gds_tier(tmp_path):
    reason = gds.probe(tmp_path)
    if reason is not None:
        pytest.skip(f"no GPUDirect Storage here: {reason}")
    tier = DiskTier(DiskConfig(path=str(tmp_path / "disk"), io="gds"))
    yield tier
    tier.close()


def _device_buffers(layout, n):
    import torch

    return [torch.zeros(padded(layout.payload_bytes), dtype=torch.uint8, device="cuda") for _ in range(n)]


def test_pages_written_by_posix_read_into_device_memory(gds_tier, layout, tmp_path):
    """One format: a page the POSIX engine wrote is read by cuFile, verified on the device."""
    keys, payloads, pages = make_pages(layout, 4)
    posix = DiskTier(DiskConfig(path=str(gds_tier.root), io="buffered"))
    try:
        assert posix.put(pages, "e") == [True] * 4
    finally:
        posix.close()
    gds_tier.contains(keys)  # (another process's files: indexed on first sight)
    bufs = _device_buffers(layout, 4)
    heads = gds_tier.get_device(keys, layout, [gds.DeviceBuffer(b.data_ptr()) for b in bufs])
    assert [h.key for h in heads] == keys
    for b, p in zip(bufs, payloads):
        assert np.array_equal(b[: layout.payload_bytes].cpu().numpy(), p)


def test_pages_written_from_device_memory_read_by_posix(gds_tier, layout):
    import torch

    from lmkv.cuda.digests import headers_on_device

    keys, payloads, _ = make_pages(layout, 3)
    bufs = _device_buffers(layout, 3)
    for b, p in zip(bufs, payloads):
        b[: layout.payload_bytes] = torch.from_numpy(p).cuda()
    heads = headers_on_device(keys, [b.data_ptr() for b in bufs], layout)
    assert gds_tier.put([(h, gds.DeviceBuffer(b.data_ptr())) for h, b in zip(heads, bufs)], "e") == [True] * 3
    posix = DiskTier(DiskConfig(path=str(gds_tier.root), io="buffered"))
    try:
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert [h.key for h in posix.get(keys, layout, outs)] == keys
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    finally:
        posix.close()


def test_a_corrupt_page_file_is_a_miss_on_the_device_path(gds_tier, layout):
    keys, _, pages = make_pages(layout, 2)
    gds_tier.put(pages, "e")
    path = next(p for p in (gds_tier.root / "d").rglob("*.page") if keys[1].hex() in p.name)
    with open(path, "r+b") as f:
        f.seek(disk_header_bytes(layout) + layout.payload_bytes - 1)  # the payload's last byte
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    bufs = _device_buffers(layout, 2)
    heads = gds_tier.get_device(keys, layout, [gds.DeviceBuffer(b.data_ptr()) for b in bufs])
    assert heads[0] is not None and heads[1] is None
    assert gds_tier.contains(keys) == [True, False]  # dropped


def test_bench_gds_reports_why_it_did_not_run_or_its_figures(tmp_path):
    import json
    import sys

    out = subprocess.run([sys.executable, "-m", "lmkv.cli", "bench", "gds", "--quick", "--json",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout)
    reason = gds.probe(tmp_path)
    if reason is not None:
        assert report["params"]["skipped"] == reason and report["metrics"] == {}
        return
    for op in ("read", "write"):
        for size in ("256KiB", "2MiB"):
            for name in (f"gds.{op}.{size}", f"gds.{op}.{size}.vs_posix"):
                m = report["metrics"][name]
                assert m["value"] > 0 and m["baseline"] > 0 and m["baseline_what"]
