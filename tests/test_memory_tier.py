import threading

import numpy as np
import pytest
from conftest import random_key, random_payload

from lmkv.config import MemoryConfig
from lmkv.errors import TierFullError
from lmkv.page import make_header
from lmkv.tiers.memory import MemoryTier


def _tier(pages: int, layout, **kw) -> MemoryTier:
    return MemoryTier(MemoryConfig(capacity=pages * layout.payload_bytes, slab_size=layout.payload_bytes * 2, **kw))


def _page(layout, seed=0):
    p = random_payload(layout, seed)
    k = random_key()
    return k, make_header(k, layout, p), p


def test_put_get_roundtrip_and_miss(layout):
    t = _tier(4, layout)
    k, h, p = _page(layout)
    assert t.put([(h, p)], "w0") == [True]
    out = np.zeros_like(p)
    assert t.get([k, random_key()], layout, [out, out.copy()]) == [h, None]
    assert (out == p).all()
    assert t.stats.hits == 1 and t.stats.misses == 1
    assert t.contains([k]) == [True]


def test_capacity_evicts_and_reports_to_hook(layout):
    evicted = []
    t = _tier(4, layout)
    t.on_evict = lambda items: evicted.extend(h.key for h, _, _ in items)
    pages = [_page(layout, i) for i in range(6)]
    for _, h, p in pages:
        t.put([(h, p)], "w0")
    assert len(t) == 4 and t.used_bytes == 4 * layout.payload_bytes
    assert len(evicted) == 2 and t.stats.evictions == 2
    assert not any(t.contains([k])[0] for k in evicted)


def test_pinned_pages_are_not_evicted(layout):
    t = _tier(2, layout)
    a, b = _page(layout, 1), _page(layout, 2)
    t.put([(a[1], a[2]), (b[1], b[2])], "w0")
    with t.borrow([a[0], b[0]]) as lease:
        assert (lease.views[0] == a[2]).all()
        c = _page(layout, 3)
        assert t.put([(c[1], c[2])], "w0") == [False]  # everything pinned: refuse, never overwrite
        assert t.stats.full == 1
    assert t.put([(c[1], c[2])], "w0") == [True]


def test_delete_while_borrowed_keeps_bytes_until_release(layout):
    t = _tier(1, layout)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    lease = t.borrow([k])
    assert t.delete([k]) == 1
    other = _page(layout, 9)
    assert t.put([(other[1], other[2])], "w0") == [False]  # the slot is still being read
    assert (lease.views[0] == p).all()
    lease.release()
    assert t.put([(other[1], other[2])], "w0") == [True]


def test_session_commit_and_abort(layout):
    t = _tier(4, layout)
    keys = [random_key() for _ in range(2)]
    p = [random_payload(layout, i) for i in range(2)]
    with t.open_session(keys, [layout] * 2, "w0") as s:
        for layer in range(layout.num_layers):
            for i in range(2):
                lo, hi = layout.layer_range(layer)
                s.write(i, lo, p[i][lo:hi])
        assert t.contains(keys) == [False, False]  # nothing visible before commit
        assert s.commit() == [True, True]
    out = np.zeros_like(p[0])
    assert t.get(keys[1:], layout, [out]) != [None] and (out == p[1]).all()
    with t.open_session([random_key()], [layout], "w0") as s:
        s.write(0, 0, p[0][:100])
        s.abort()
    assert len(t) == 2 and t.used_bytes == 2 * layout.payload_bytes
    with pytest.raises(RuntimeError):
        with t.open_session([random_key()], [layout], "w0"):
            raise RuntimeError("step failed")
    assert len(t) == 2 and t.used_bytes == 2 * layout.payload_bytes
    with pytest.raises(ValueError):
        with t.open_session([random_key()], [layout], "w0") as s:
            s.write(0, layout.payload_bytes - 1, b"xx")


def test_session_that_cannot_fit_reserves_nothing(layout):
    t = _tier(2, layout)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    with t.borrow([k]):
        with pytest.raises(TierFullError):
            t.open_session([random_key(), random_key()], [layout] * 2, "w0")
    assert t.used_bytes == layout.payload_bytes


def test_domains_scope_clears(layout):
    t = _tier(4, layout)
    shared, own = _page(layout, 1), _page(layout, 2)
    t.put([(shared[1], shared[2]), (own[1], own[2])], "worker0")
    t.put([(shared[1], shared[2])], "cache-owner")
    assert sorted(t.owners(shared[0])) == ["cache-owner", "worker0"]
    assert t.clear("worker0") == 1
    assert t.contains([shared[0], own[0]]) == [True, False]
    assert t.owners(shared[0]) == ["cache-owner"]


def test_verification_discards_a_corrupt_page(layout):
    t = _tier(2, layout, verify_checksums=True)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    with t.borrow([k]) as lease:
        lease.views[0][5] ^= 0xFF  # corrupt the resident bytes
    out = np.zeros_like(p)
    assert t.get([k], layout, [out]) == [None]
    assert t.stats.corrupt == 1 and t.contains([k]) == [False]


def test_ranged_read(layout):
    t = _tier(2, layout, verify_checksums=True)
    k, h, p = _page(layout)
    t.put([(h, p)], "w0")
    out = np.zeros_like(p)
    rng = layout.layer_range(2)
    assert t.read_ranges(k, layout, [rng], out) == h
    assert (out[rng[0]:rng[1]] == p[rng[0]:rng[1]]).all() and not out[: rng[0]].any()


def test_two_size_classes_share_the_arena(layout, mamba_layout):
    t = MemoryTier(MemoryConfig(capacity=4 * layout.payload_bytes, slab_size=layout.payload_bytes))
    for i in range(4):
        k, h, p = _page(layout, i)
        t.put([(h, p)], "w0")
    k, h, p = _page(mamba_layout, 7)
    assert t.put([(h, p)], "w0") == [True]  # evicts a whole slab's worth of the other class
    out = np.zeros_like(p)
    assert t.get([k], mamba_layout, [out]) == [h] and (out == p).all()


def test_concurrent_puts_and_gets(layout):
    t = _tier(16, layout, verify_checksums=True)
    pages = [_page(layout, i) for i in range(40)]
    errors = []

    def worker(chunk):
        out = np.zeros(layout.payload_bytes, np.uint8)
        for k, h, p in chunk:
            t.put([(h, p)], "w0")
            got = t.get([k], layout, [out])
            if got[0] is not None and not (out == p).all():
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(pages[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and t.stats.corrupt == 0
    assert len(t) == 16 and t.used_bytes == 16 * layout.payload_bytes


def _resident_fraction(buf) -> float:
    """Fraction of a buffer's OS pages that are mapped in (mincore)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    n = (len(buf) + _mmap.PAGESIZE - 1) // _mmap.PAGESIZE
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(buf.ctypes.data, len(buf), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / n


def _wait_populated(arena, timeout=10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while arena.prefault.running and time.monotonic() < deadline:
        time.sleep(0.01)


def test_arena_is_mapped_ahead_of_use_without_touching_its_contents():
    from lmkv.tiers.arena import HostArena

    a = HostArena(64 << 20, pin="never")
    assert _resident_fraction(a.buf) < 0.1  # fresh: nothing mapped yet
    a.buf[5 << 20 : (5 << 20) + 4096] = 7  # a slot written before and while the arena is populated
    a.prefault.advance(32 << 20)
    a.buf[40 << 20 : (40 << 20) + 4096] = 9
    _wait_populated(a)
    assert _resident_fraction(a.buf[: 32 << 20]) == 1.0
    assert (a.buf[5 << 20 : (5 << 20) + 4096] == 7).all() and (a.buf[40 << 20 : (40 << 20) + 4096] == 9).all()
    assert not a.buf[: 5 << 20].any()


def test_an_arena_that_must_be_pinned_and_cannot_be_is_an_error():
    """``memory.pin: always`` without a GPU (or over the locked-memory limit) fails clearly; ``auto``
    runs unpinned."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU can pin it")
    from lmkv.tiers.arena import HostArena

    with pytest.raises(ValueError, match="could not be page-locked"):
        HostArena(1 << 20, pin="always")
    a = HostArena(1 << 20, pin="auto")
    assert not a.pinned and not a.device_visible(a.buf.ctypes.data, 4096)


def test_memory_tier_maps_ahead_of_the_slots_it_hands_out(layout):
    from conftest import make_pages

    from lmkv.config import MemoryConfig
    from lmkv.tiers.memory import POPULATE_AHEAD, MemoryTier

    t = MemoryTier(MemoryConfig(capacity=POPULATE_AHEAD * 2, pin="never"))  # (a page-locked arena is mapped whole)
    _, _, pages = make_pages(layout, 2)
    t.put(pages, "w0")
    _wait_populated(t._arena)
    assert t._arena.prefault.target >= POPULATE_AHEAD
    assert _resident_fraction(t._arena.buf[:POPULATE_AHEAD]) == 1.0
    assert _resident_fraction(t._arena.buf[POPULATE_AHEAD + (8 << 20):]) < 0.5  # not the whole arena


def test_an_engines_store_maps_its_arena_whole_unless_told_not_to():
    """``memory.prefault`` unset: an engine's store maps its whole arena from the start (a step's
    pages land at once); a library's store maps ahead of use; an explicit setting wins."""
    from lmkv.config import load_config
    from lmkv.engine.stores import acquire_store, release_store
    from lmkv.store import TieredStore

    for given, whole in ((None, True), (False, False), (True, True)):
        mem = {"capacity": "32MiB", "pin": "never", **({} if given is None else {"prefault": given})}
        scope = f"test-prefault-{given}"
        store = acquire_store(scope, load_config({"memory": mem}, environ={}))
        try:
            arena = store.memory.arena
            assert arena.whole is whole
            _wait_populated(arena)
            assert _resident_fraction(arena.buf) == 1.0 if whole else _resident_fraction(arena.buf) < 0.5
        finally:
            release_store(scope)
    library = TieredStore(load_config({"memory": {"capacity": "32MiB", "pin": "never"}}, environ={}))
    try:
        assert library.memory.arena.whole is False
    finally:
        library.close()
