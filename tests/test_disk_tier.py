import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import random_key, random_payload

from lmkv.config import DiskConfig
from lmkv.page import make_header
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.posix_io import probe_direct_io

IO = ["buffered", "direct"]


def _tier(path, io="auto", **kw) -> DiskTier:
    return DiskTier(DiskConfig(path=str(path), io=io, **kw))


def _reopened(path, io="auto", **kw) -> DiskTier:
    """The tier opened again over its files, once its index is rebuilt (in the background)."""
    t = _tier(path, io, **kw)
    assert t.wait_indexed(30)
    return t


def _page(layout, seed=0):
    p = random_payload(layout, seed)
    k = random_key()
    return k, make_header(k, layout, p), p


def _files(tier, key):
    return [p for p in tier.root.rglob(key.hex() + ".page")]


@pytest.fixture(params=IO)
def io(request, tmp_path):
    if request.param == "direct" and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    return request.param


def test_put_get_both_engines_same_format(tmp_path, layout, mamba_layout, io):
    t = _tier(tmp_path, io)
    assert t.direct == (io == "direct")
    for lay in (layout, mamba_layout):  # 64 KiB (aligned) and 24288 bytes (bounce buffer)
        k, h, p = _page(lay)
        assert t.put([(h, p)], "w0") == [True]
        out = np.zeros_like(p)
        assert t.get([k], lay, [out]) == [h] and (out == p).all()
    other = _tier(tmp_path, "buffered" if io == "direct" else "auto")  # the other engine reads it back
    out = np.zeros_like(p)
    assert other.get([k], mamba_layout, [out]) == [h] and (out == p).all()


def test_ranged_read(tmp_path, layout, io):
    t = _tier(tmp_path, io)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    out = np.zeros_like(p)
    r1, r3 = layout.layer_range(1), layout.layer_range(3, 1)
    assert t.read_ranges(k, layout, [r1, r3], out) == h
    for s, e in (r1, r3):
        assert (out[s:e] == p[s:e]).all()
    assert not out[: r1[0]].any()


def test_restart_rebuilds_index_and_owners(tmp_path, layout):
    t = _tier(tmp_path)
    pages = [_page(layout, i) for i in range(3)]
    t.put([(h, p) for _, h, p in pages], "worker0")
    t.put([(pages[0][1], pages[0][2])], "owner")
    (tmp_path / "tmp" / "leftover.partial").write_bytes(b"x" * 100)
    again = _reopened(tmp_path)
    assert len(again) == 3 and again.used_bytes == t.used_bytes
    assert sorted(again.owners(pages[0][0])) == ["owner", "worker0"]
    assert not list((tmp_path / "tmp").iterdir())
    out = np.zeros_like(pages[2][2])
    assert again.get([pages[2][0]], layout, [out]) == [pages[2][1]] and (out == pages[2][2]).all()


def test_clear_is_scoped_to_a_domain(tmp_path, layout):
    t = _tier(tmp_path)
    shared, own = _page(layout, 1), _page(layout, 2)
    t.put([(shared[1], shared[2]), (own[1], own[2])], "worker0")
    t.put([(shared[1], shared[2])], "owner")
    assert len(_files(t, shared[0])) == 2  # one hard link per owner, one copy of the bytes
    assert t.clear("worker0") == 1
    assert t.contains([shared[0], own[0]]) == [True, False]
    assert not _files(t, own[0]) and len(_files(t, shared[0])) == 1
    assert _reopened(tmp_path).owners(shared[0]) == ["owner"]


def test_capacity_evicts_lru(tmp_path, layout):
    file_bytes = 4096 + layout.payload_bytes
    t = _tier(tmp_path, capacity=3 * file_bytes)
    pages = [_page(layout, i) for i in range(5)]
    for _, h, p in pages:
        assert t.put([(h, p)], "w0") == [True]
    assert len(t) == 3 and t.used_bytes <= 3 * file_bytes and t.stats.evictions == 2
    assert t.contains([k for k, _, _ in pages]) == [False, False, True, True, True]
    assert not _files(t, pages[0][0])


@pytest.mark.parametrize("where", ["payload", "header", "truncate"])
def test_corrupt_file_is_detected_and_discarded(tmp_path, layout, where):
    t = _tier(tmp_path)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    (f,) = _files(t, k)
    data = bytearray(f.read_bytes())
    if where == "payload":
        data[4096 + 12345] ^= 0x10
    elif where == "header":
        data[70] ^= 0x01  # inside the unit digests
    else:
        data = data[: len(data) // 2]
    f.write_bytes(bytes(data))
    out = np.zeros_like(p)
    assert t.get([k], layout, [out]) == [None]
    assert t.stats.corrupt == 1 and not t.contains([k])[0] and not f.exists()


def test_layerwise_read_catches_corruption_in_the_layer_read(tmp_path, layout):
    t = _tier(tmp_path, "buffered")
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    (f,) = _files(t, k)
    data = bytearray(f.read_bytes())
    s, _ = layout.layer_range(2)
    data[4096 + s + 3] ^= 0xFF
    f.write_bytes(bytes(data))
    out = np.zeros_like(p)
    assert t.read_ranges(k, layout, [layout.layer_range(1)], out) == h  # layer 1 is intact
    assert t.read_ranges(k, layout, [layout.layer_range(2)], out) is None
    assert t.stats.corrupt == 1


def test_cached_reads_go_in_parallel_runs_only_when_each_page_read_is_large(tmp_path, monkeypatch):
    """Whole 256 KiB pages from the page cache go in parallel runs (their copies overlap); a span of
    one 32 KiB layer of the same pages goes in one run, in the caller's thread (a read that small
    is mostly the interpreter's work: parallel runs would contend for its lock)."""
    from conftest import make_pages

    from lmkv.benchmarks.tiers import bench_layout
    from lmkv.tiers import disk

    monkeypatch.setattr(disk, "INLINE_RUNS", 2)
    lay = bench_layout(256 << 10)
    t = _tier(tmp_path, "buffered", capacity="64MiB")
    keys, payloads, pages = make_pages(lay, 2 * disk.MIN_RUN_PAGES)
    assert all(t.put(pages, "w0"))
    submitted = []
    real = t._io.submit
    monkeypatch.setattr(t._io, "submit", lambda fn, *a: (submitted.append(fn), real(fn, *a))[1])
    outs = [np.zeros_like(p) for p in payloads]
    assert all(h is not None for h in t.get(keys, lay, outs)) and len(submitted) == 1  # (the second run)
    a, b = lay.layer_range(3)
    assert b - a < disk.MIN_PARALLEL_READ
    assert all(h is not None for h in t.get_ranges(keys, lay, [(a, b)], outs)) and len(submitted) == 1
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))


def test_a_layerwise_loads_later_spans_do_not_read_the_header_again(tmp_path, layout, monkeypatch):
    """The first span of a page's layerwise read reads its header; the later spans verify their
    layers against the header kept from it. A page dropped (deleted here) takes its kept header
    with it: written again, it is read with its header once more."""
    from conftest import make_pages

    t = _tier(tmp_path, "buffered")
    keys, payloads, pages = make_pages(layout, 3, seed=4)
    t.put(pages, "w0")
    headers_read = []
    real = t._files._header
    monkeypatch.setattr(t._files, "_header", lambda fd, key, *a: (headers_read.append(key), real(fd, key, *a))[1])
    outs = [np.zeros_like(p) for p in payloads]
    for layer in range(layout.num_layers):
        assert t.get_ranges(keys, layout, [layout.layer_range(layer)], outs) == [h for h, _ in pages]
    assert sorted(headers_read) == sorted(keys)
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    assert t.delete(keys[:1]) == 1 and t.put(pages[:1], "w0") == [True]
    assert t.read_ranges(keys[0], layout, [layout.layer_range(1)], outs[0]) == pages[0][0]
    assert headers_read.count(keys[0]) == 2


def test_malformed_files_are_removed_at_restart(tmp_path, layout):
    t = _tier(tmp_path)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    (f,) = _files(t, k)
    with open(f, "r+b") as fh:
        fh.truncate(5000)  # not a whole number of blocks: cannot be a page
    (f.parent / "not-a-key.page").write_bytes(b"junk")
    again = _reopened(tmp_path)
    assert len(again) == 0 and not f.exists()


def test_disk_full_is_a_clean_per_page_failure(tiny_fs, layout):
    t = _tier(tiny_fs, capacity=1 << 30)  # our own limit is far away: the file system fills first
    pages = [_page(layout, i) for i in range(20)]
    results = [t.put([(h, p)], "w0")[0] for _, h, p in pages]
    assert True in results and False in results
    assert t.stats.full >= 1 and t.stats.errors == 0
    assert not list((tiny_fs / "tmp").iterdir())  # no half-written page left behind
    out = np.zeros_like(pages[0][2])
    for (k, _, p), ok in zip(pages, results):
        got = t.get([k], layout, [out])[0]
        assert (got is not None) == ok
        if ok:
            assert (out == p).all()
    t.delete([k for k, _, _ in pages[:3]])
    k, h, p = _page(layout, 99)
    assert t.put([(h, p)], "w0") == [True]
    assert len(_reopened(tiny_fs)) == len(t)


def test_session_commits_all_or_nothing_visible(tmp_path, layout):
    t = _tier(tmp_path)
    keys = [random_key() for _ in range(3)]
    p = [random_payload(layout, i) for i in range(3)]
    with t.open_session(keys, [layout] * 3, "w0") as s:
        for i in range(3):
            for layer in range(layout.num_layers):
                lo, hi = layout.layer_range(layer)
                s.write(i, lo, p[i][lo:hi])
        assert t.contains(keys) == [False] * 3
        assert s.commit() == [True] * 3
    out = np.zeros_like(p[0])
    assert t.get(keys[2:], layout, [out])[0] is not None and (out == p[2]).all()
    with t.open_session([random_key()], [layout], "w0") as s:
        s.write(0, 0, p[0])
    assert len(t) == 3 and not list((tmp_path / "tmp").iterdir())


WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from lmkv.config import DiskConfig
    from lmkv.layout import attention_layout
    from lmkv.page import make_header
    from lmkv.tiers.disk import DiskTier
    lay = attention_layout("g", 4, 32, 8, 128, 2, "bf16")
    t = DiskTier(DiskConfig(path=sys.argv[1]))
    real_fsync = os.fsync
    def slow_fsync(fd):
        time.sleep(30)  # the parent kills us here: the page is written but not yet in place
        real_fsync(fd)
    os.fsync = slow_fsync
    p = np.random.default_rng(0).integers(0, 256, lay.payload_bytes, dtype=np.uint8)
    k = bytes(16)
    t.put([(make_header(k, lay, p), p)], "w0")
""")


def test_writer_killed_mid_page_leaves_nothing_visible(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (tmp_path / "tmp").exists() or not list((tmp_path / "tmp").iterdir()):
            assert proc.poll() is None, "writer exited early"
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list((tmp_path / "tmp").iterdir()), "the kill should land while the temp file exists"
    t = _tier(tmp_path)
    assert len(t) == 0 and not t.contains([bytes(16)])[0]
    assert not list((tmp_path / "tmp").iterdir())
    assert not list((tmp_path / "d").rglob("*.page"))


def _cached(path) -> bool:
    """Whether the OS page cache holds a file's last byte (a read that may not wait for the disk)."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], os.fstat(fd).st_size - 1, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _drop_from_page_cache(files) -> None:
    import os

    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages only can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("span", [None, 1], ids=["whole", "a layer"])
def test_cached_pages_are_read_inline_and_uncached_ones_on_io_threads(tmp_path, layout, monkeypatch, span):
    """Buffered reads, of whole pages or of a layerwise load's span: what the OS page cache holds
    is copied in the caller's thread; pages it dropped are read in parallel on the I/O threads.
    Both come back verified."""
    import os

    from conftest import make_pages

    from lmkv.tiers import disk

    t = _tier(tmp_path, io="buffered")
    keys, payloads, pages = make_pages(layout, 6)
    t.put(pages, "w0")
    handed = []
    real_map = disk.settled_map
    monkeypatch.setattr(disk, "settled_map", lambda pool, fn, items: (handed.extend(items := list(items)),
                                                                      real_map(pool, fn, items))[1])
    a, b = (0, layout.payload_bytes) if span is None else layout.layer_range(span)

    def read(outs) -> list:
        return t.get(keys, layout, outs) if span is None else t.get_ranges(keys, layout, [(a, b)], outs)

    outs = [np.zeros_like(p) for p in payloads]
    assert all(h is not None for h in read(outs)) and handed == []
    assert all(np.array_equal(o[a:b], p[a:b]) for o, p in zip(outs, payloads))
    files = {i: _files(t, keys[i])[0] for i in range(6)}
    dropped: list[int] = []
    for _ in range(20):  # the kernel may keep a page it was asked to drop a while
        _drop_from_page_cache([files[i] for i in range(3, 6)])
        dropped = [i for i in range(3, 6) if not _cached(files[i])]
        if dropped:
            break
        time.sleep(0.05)
    if not dropped:  # a file system that keeps its pages in memory (tmpfs, some overlays): the
        # probe says of pages 3-5 what RWF_NOWAIT says of a page the cache does not hold
        uncached = {os.stat(files[i]).st_ino for i in range(3, 6)}
        real_preadv = os.preadv

        def preadv(fd, bufs, offset, flags=0):
            if flags & os.RWF_NOWAIT and os.fstat(fd).st_ino in uncached:
                raise BlockingIOError(11, "would block")
            return real_preadv(fd, bufs, offset, flags)

        monkeypatch.setattr(disk.os, "preadv", preadv)
        dropped = [3, 4, 5]
    outs = [np.zeros_like(p) for p in payloads]
    assert all(h is not None for h in read(outs))
    assert all(np.array_equal(o[a:b], p[a:b]) for o, p in zip(outs, payloads))
    # the dropped pages went to the threads, cached ones did not (the kernel may reclaim one more
    # of the pages just dropped from under the check before the read: it goes to a thread too)
    assert set(dropped) <= set(handed) <= {3, 4, 5}
    # (a page read layer by layer is one hit, counted at its first layer's read)
    assert t.stats.hits == (12 if span is None else 0) and t.stats.misses == 0
    assert t.stats.get_bytes == 12 * (b - a)
