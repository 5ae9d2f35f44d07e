"""GPUDirect Storage for the disk tier: where it is chosen and why not (runs anywhere), and the
device path itself against the POSIX engines on the same files (on a GPU with cuFile)."""

from __future__ import annotations

import logging
import shutil
import subprocess

import numpy as np
import pytest
from conftest import flip_byte, layerwise_load, make_pages
from support.host_gds import HostCuFile, gds_store

from lmkv.config import DiskConfig
from lmkv.page import disk_header_bytes, padded
from lmkv.tiers import gds
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.posix_io import probe_direct_io


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

    from lmkv.kernels.digests import headers_on_device

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
    flip_byte(path, disk_header_bytes(layout) + layout.payload_bytes - 1)  # the payload's last byte
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
        # (the bench probes a folder of its own under --dir: the same reason, about that folder)
        said = report["params"]["skipped"]
        assert said.split(" under ")[0] == reason.split(" under ")[0] and report["metrics"] == {}
        return
    for op in ("read", "write"):
        for size in ("256KiB", "2MiB"):
            for name in (f"gds.{op}.{size}", f"gds.{op}.{size}.vs_posix"):
                m = report["metrics"][name]
                assert m["value"] > 0 and m["baseline"] > 0 and m["baseline_what"]




def test_the_store_reads_gds_pages_into_staging_slots_and_the_rest_into_memory(tmp_path, layout, monkeypatch):
    """``TieredStore.fetch(device=...)``: pages only the GDS disk tier holds go to free staging slots
    (verified there, not promoted into memory), the rest of them into memory when the slots run out,
    memory hits stay lent; a page that fails its digests is a miss; the slots come back on release."""
    from lmkv.kernels import digests
    from lmkv.page import verify_payload

    def verify_here(ptrs, lay, headers, stream=None, device=None):
        return [_verifies(verify_payload, h, lay, staging.page(p, lay.payload_bytes)) for p, h in zip(ptrs, headers)]

    monkeypatch.setattr(digests, "verify_on_device", verify_here)
    with gds_store(tmp_path, HostCuFile(), layout.payload_bytes, 3) as (store, disk, staging):
        keys, payloads, pages = make_pages(layout, 6)
        disk.put(pages, "e")
        store.memory.put([pages[0]], "e")  # a memory hit
        path = next(p for p in (disk.root / "d").rglob("*.page") if keys[2].hex() in p.name)
        flip_byte(path, disk_header_bytes(layout) + 5)  # one corrupt page among those the slots take
        fetched = store.fetch(keys, layout, device=staging)
        kinds = [type(v).__name__ for v in fetched.views]
        assert kinds[0] != "DeviceBuffer" and fetched.views[2] is None
        assert kinds[1] == kinds[3] == "DeviceBuffer" and kinds[4] == kinds[5] == "ndarray"
        for i in (1, 3):
            assert np.array_equal(staging.page(fetched.views[i].ptr, layout.payload_bytes), payloads[i])
        for i in (0, 4, 5):
            assert np.array_equal(np.asarray(fetched.views[i]).reshape(-1)[: layout.payload_bytes], payloads[i])
        assert store.memory.contains(keys) == [True, False, False, False, True, True]  # slots: not promoted
        assert staging._free == []
        fetched.release()
        assert len(staging._free) == 3
        assert disk.contains([keys[2]]) == [False]  # the corrupt file was dropped


def test_the_worker_loads_disk_pages_through_device_memory_and_stores_from_it(tmp_path):
    """On a GPU with cuFile: write-through stores reach the disk tier from device memory (and read
    back with POSIX I/O), loads of pages only the disk tier holds land in the engine's blocks through
    the staging slots without being promoted, and a corrupt file is a load error for its block."""
    reason = gds.probe(tmp_path)
    if reason is not None:
        pytest.skip(f"no GPUDirect Storage here: {reason}")
    import torch
    from test_blockcopy import C, H, L, N, views

    from lmkv.config import load_config
    from lmkv.engine.plan import PageOp, StepPlan
    from lmkv.engine.worker import LayerwiseTransfer
    from lmkv.keys import page_key
    from lmkv.layout import attention_layout
    from lmkv.store import TieredStore

    layers = views("LBNHC", "cuda")
    layout = attention_layout("attn", L, N, H, C // 2, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(L)}
    chains = [bytes([i + 1]) * 16 for i in range(4)]
    keys = [page_key(c, layout) for c in chains]
    cfg = load_config({"memory": {"capacity": "16MiB", "pin": "always"},
                       "disk": {"path": str(tmp_path / "disk"), "io": "gds"}}, environ={})
    with TieredStore(cfg) as store:
        w = LayerwiseTransfer(store, [layout], [layers], names)
        assert w._staging is not None and w._on_device == {0}
        slots = len(w._staging._free)
        w.begin(StepPlan(stores=[PageOp("", 0, chains, [4, 2, 1, 6], [])]))
        for i, name in enumerate(names):
            layers[i].add_(1)
            w.after_layer(name)
        w.end()
        store.drain()
        assert store.tiers[1].contains(keys) == [True] * 4 and store.writes.failed == 0
        assert len(w._staging._free) == slots
        posix = DiskTier(DiskConfig(path=str(tmp_path / "disk"), io="buffered"))
        bufs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in posix.get(keys, layout, bufs))
        with store.memory.borrow(keys) as lease:
            assert all(np.array_equal(np.asarray(v).reshape(-1), b) for v, b in zip(lease.views, bufs))
        posix.close()
        store.memory.delete(keys)
        path = next(p for p in (tmp_path / "disk" / "d").rglob("*.page") if keys[3].hex() in p.name)
        flip_byte(path, disk_header_bytes(layout) + 1)
        out = views("LBNHC", "cuda")
        for t in out:
            t.zero_()
        r = layerwise_load(store, [layout], [out], names, PageOp("x", 0, chains, [0, 3, 8, 9], list(range(4))))
        assert r.take_errors() == {9}
        for i in range(L):
            for src, dst in ((4, 0), (2, 3), (1, 8)):
                assert torch.equal(out[i][dst], layers[i][src])
        assert store.memory.contains(keys) == [False] * 4  # read to the device, not promoted
        w.close()
        r.close()


# -- the hipFile engine (no AMD GPU here: its C interface built over host memory) ------------------

HIPFILE_SHIM = r"""
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/types.h>
typedef struct { int err; int hip_drv_err; } hipFileError_t;
typedef struct { int type; union { int fd; void *hFile; } handle; const void *fs_ops; } hipFileDescr_t;
static hipFileError_t ok(void) { hipFileError_t e = {0, 0}; return e; }
static hipFileError_t fail(int code) { hipFileError_t e = {code, 0}; return e; }
static int opened = 0;
hipFileError_t hipFileDriverOpen(void) { opened++; return ok(); }
hipFileError_t hipFileGetVersion(unsigned *a, unsigned *b, unsigned *c) { *a = 0; *b = 2; *c = 0; return ok(); }
const char *hipFileGetOpErrorString(int e) { return e == 5022 ? "invalid value" : "other"; }
hipFileError_t hipFileHandleRegister(void **fh, hipFileDescr_t *d) {
    if (!opened || d->type != 1 || d->handle.fd < 0 || d->fs_ops) return fail(5022);
    *fh = (void *)(intptr_t)(d->handle.fd + 1); return ok();
}
void hipFileHandleDeregister(void *fh) { (void)fh; }
hipFileError_t hipFileBufRegister(const void *p, size_t n, int flags) { return p && n && !flags ? ok() : fail(5022); }
hipFileError_t hipFileBufDeregister(const void *p) { return p ? ok() : fail(5022); }
ssize_t hipFileRead(void *fh, void *buf, size_t n, off_t off, off_t boff) {
    ssize_t r = pread((int)(intptr_t)fh - 1, (char *)buf + boff, n, off); return r < 0 ? -1 : r;
}
ssize_t hipFileWrite(void *fh, const void *buf, size_t n, off_t off, off_t boff) {
    ssize_t r = pwrite((int)(intptr_t)fh - 1, (const char *)buf + boff, n, off); return r < 0 ? -1 : r;
}
"""


@pytest.fixture
def host_hipfile(tmp_path):
    """lmkv's hipFile engine over a build of hipFile's C interface that moves host memory."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / "hipfile_shim.c", tmp_path / "libhipfile_shim.so"
    src.write_text(HIPFILE_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    from lmkv.tiers import hipfile

    return hipfile.HipFile(0, lib=hipfile.load(str(lib)))


def test_the_hipfile_engine_moves_bytes_at_buffer_and_file_offsets(host_hipfile, tmp_path):
    import ctypes
    import os

    from lmkv.tiers import hipfile

    assert hipfile.version(host_hipfile._lib) == (0, 2, 0)
    buf = (ctypes.c_char * 8192)()
    ptr = ctypes.addressof(buf)
    host_hipfile.register(ptr, 8192)
    ctypes.memmove(ptr + 4096, b"lmkv" * 1024, 4096)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        host_hipfile.write(fd, ptr, 4096, 4096, 4096)  # the buffer's second half at the file's 4 KiB
        assert os.pread(fd, 8, 4096) == b"lmkvlmkv"
        host_hipfile.read(fd, ptr, 4096, 4096, 0)
        assert bytes(buf[:8]) == b"lmkvlmkv"
        with pytest.raises(OSError, match="hipFileRead: 4096 of 8192 bytes"):  # short: past the end
            host_hipfile.read(fd, ptr, 8192, 4096)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="hipFileHandleRegister: invalid value"):
        host_hipfile.read(-1, ptr, 16, 0)
    host_hipfile.deregister(ptr)


def test_pages_written_through_hipfile_read_with_posix_and_back(host_hipfile, tmp_path, layout, monkeypatch):
    """The hipFile engine under the disk tier writes the POSIX engines' format and reads it (digests
    checked where the bytes land: here, host memory standing in for the device's)."""
    import ctypes
    import mmap

    from lmkv.kernels import digests
    from lmkv.page import make_header, verify_payload

    n, slot = 3, padded(layout.payload_bytes)
    staging = mmap.mmap(-1, n * slot)  # page-aligned, as O_DIRECT needs
    base = ctypes.addressof(ctypes.c_char.from_buffer(staging))
    at = lambda i: np.frombuffer(staging, np.uint8)[i * slot : i * slot + layout.payload_bytes]  # noqa: E731

    def verify_here(ptrs, lay, headers, stream=None, device=None):
        return [_verifies(verify_payload, h, lay, at((p - base) // slot)) for p, h in zip(ptrs, headers)]

    monkeypatch.setattr(digests, "verify_on_device", verify_here)
    tier = DiskTier(DiskConfig(path=str(tmp_path / "d"), io="buffered"))
    tier.gds = host_hipfile
    keys, payloads, _ = make_pages(layout, n)
    for i, p in enumerate(payloads):
        at(i)[:] = p
    heads = [make_header(k, layout, p) for k, p in zip(keys, payloads)]
    assert tier.put([(h, gds.DeviceBuffer(base + i * slot)) for i, h in enumerate(heads)], "e") == [True] * n
    posix = DiskTier(DiskConfig(path=str(tmp_path / "d"), io="buffered"))
    bufs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    posix.contains(keys)
    assert all(h is not None for h in posix.get(keys, layout, bufs))
    assert all(np.array_equal(b, p) for b, p in zip(bufs, payloads))
    ctypes.memset(base, 0, n * slot)
    assert all(h is not None for h in tier.get_device(keys, layout, [gds.DeviceBuffer(base + i * slot)
                                                                     for i in range(n)]))
    assert all(np.array_equal(at(i), p) for i, p in enumerate(payloads))
    posix.close()
    tier.close()


def _verifies(check, *args) -> bool:
    try:
        check(*args)
        return True
    except Exception:
        return False
