"""A disk tier opens at once over many pages, answers misses from its index, and processes sharing
its directory learn of each other's pages from the change logs, never by a stat per key."""

import os
import threading

import numpy as np
from conftest import make_pages

from lmkv.config import DiskConfig
from lmkv.tiers import disk as disk_module
from lmkv.tiers import disk_log
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.page_files import DiskView


def _tier(path) -> DiskTier:
    return DiskTier(DiskConfig(path=str(path), io="buffered"))


class Stats:
    """Counts the stat-like calls (``stat``, ``exists``) made on page files under a directory."""

    def __init__(self, monkeypatch, root):
        self.calls = 0
        root = str(root)
        real_stat, real_exists = os.stat, os.path.exists

        def stat(path, *a, **kw):
            self.calls += str(path).startswith(root) and str(path).endswith(".page")
            return real_stat(path, *a, **kw)

        def exists(path):
            self.calls += str(path).startswith(root) and str(path).endswith(".page")
            return real_exists(path)

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os.path, "exists", exists)


def test_a_miss_costs_no_stat_once_the_index_is_built(tmp_path, layout, monkeypatch):
    tier = _tier(tmp_path)
    keys, _, pages = make_pages(layout, 4)
    tier.put(pages, "w0")
    tier.close()
    tier = _tier(tmp_path)
    assert tier.wait_indexed(30)
    stats = Stats(monkeypatch, tmp_path)
    missing = [os.urandom(16) for _ in range(1000)]
    assert tier.contains(keys + missing) == [True] * 4 + [False] * 1000
    assert stats.calls == 0
    tier.close()


def test_the_tier_serves_before_its_files_are_indexed(tmp_path, layout, monkeypatch):
    tier = _tier(tmp_path)
    keys, payloads, pages = make_pages(layout, 50)
    tier.put(pages, "w0")
    tier.close()
    release = threading.Event()
    real_scan = disk_module.scan

    def slow_scan(*a, **kw):  # the scan of a directory with millions of files, held open
        release.wait(30)
        yield from real_scan(*a, **kw)

    monkeypatch.setattr(disk_module, "scan", slow_scan)
    tier = _tier(tmp_path)
    assert not tier.wait_indexed(0.05)
    assert tier.contains(keys[:3] + [os.urandom(16)]) == [True, True, True, False]  # found on disk meanwhile
    out = np.zeros_like(payloads[7])
    assert tier.get([keys[7]], layout, [out])[0] is not None and (out == payloads[7]).all()
    k2, _, more = make_pages(layout, 2, seed=9)
    assert tier.put(more, "w0") == [True, True]
    release.set()
    assert tier.wait_indexed(30)
    assert len(tier) == 52 and tier.contains(keys + k2) == [True] * 52
    tier.close()


def test_two_tiers_sharing_a_directory_see_each_others_pages_and_removals(tmp_path, layout, monkeypatch):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert a.wait_indexed(30) and b.wait_indexed(30)
    view = DiskView(tmp_path)
    assert view.wait_indexed(30)
    stats = Stats(monkeypatch, tmp_path)
    keys, payloads, pages = make_pages(layout, 5)
    mark = b.notes.mark()
    a.put(pages, "w0")
    assert b.contains(keys) == [True] * 5 and view.contains(keys) == [True] * 5
    assert b.notes.mark().gained == mark.gained + 5
    out = np.zeros_like(payloads[0])
    assert b.get([keys[0]], layout, [out])[0] is not None and (out == payloads[0]).all()
    a.put(pages[:1], "w1")  # a second owner of page 0
    a.delete(keys[1:3])
    assert b.contains(keys) == [True, False, False, True, True]
    assert view.contains(keys) == [True, False, False, True, True]
    assert sorted(b.notes.lost_since(mark)) == sorted(keys[1:3])
    a.clear("w0")  # page 0 keeps its other owner
    assert view.contains(keys[:1]) == [True] and b.contains(keys[:1]) == [True]
    assert stats.calls == 0  # (every answer came from an index)
    for t in (a, b, view):
        t.close()


def test_a_rotated_log_is_read_to_its_end(tmp_path, layout, monkeypatch):
    monkeypatch.setattr(disk_log, "ROTATE_BYTES", 10 * disk_log.RECORD.size)
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert b.wait_indexed(30)
    keys, _, pages = make_pages(layout, 25)
    b.contains(keys[:1])  # (b has a's first log open)
    a.put(pages, "w0")
    assert len(os.listdir(tmp_path / "log")) == 3  # b's, and a's last two: a rotated twice
    assert b.contains(keys) == [True] * 25
    a.close()
    b.close()


def test_junk_in_a_log_is_skipped(tmp_path, layout):
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert b.wait_indexed(30)
    keys, _, pages = make_pages(layout, 2)
    a.put(pages[:1], "w0")
    with open(tmp_path / "log" / f"{os.getpid()}.junk.log", "wb") as f:  # a hostile local user's "log"
        f.write(os.urandom(3 * disk_log.RECORD.size + 7))
        bad = disk_log.RECORD.pack(1, 5, keys[1], 1 << 20, b"../..")  # a domain that is not one
        f.write(bad)
    a.put(pages[1:], "w0")
    assert b.contains(keys) == [True, True]
    assert b.owners(keys[1]) == ["w0"]
    a.close()
    b.close()


def test_logs_of_writers_that_are_gone_are_removed_once_indexed(tmp_path, layout):
    a = _tier(tmp_path)
    a.put(make_pages(layout, 1)[2], "w0")
    a.close()
    (tmp_path / "log" / "999999999.0123.log").write_bytes(b"")  # a writer whose process exited
    b = _tier(tmp_path)
    assert b.wait_indexed(30) and len(b) == 1
    assert sorted(os.listdir(tmp_path / "log")) == sorted([a._log.name, b._log.name])  # (a's process is alive)
    b.close()
