"""Writers that finish after lmkv gave up on them: their bytes never land in memory that is in use.

Each asynchronous writer lmkv lends memory to (:mod:`lmkv.tiers.quarantine`) is made to finish
late here — a real ``lmkv serve`` paused with SIGSTOP before or between the chunks of a same-host
load, a disk read still running when another read of the same fetch failed — and the memory it
was lent is then checked: held back while the writer may still write, reused only after.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import load_config
from lmkv.dev.server_process import ServerProcess, spawn
from lmkv.dev.signals import pause
from lmkv.layout import attention_layout
from lmkv.page import make_header, verify_payload
from lmkv.store import TieredStore
from lmkv.tiers import server_client
from lmkv.tiers.quarantine import settled_map
from lmkv.tiers.server_client import ServerTier

#: 512 KiB pages (an 8B model's 4 MiB page scaled down): 16 to the 8 MiB chunk of a same-host read
LAYOUT = attention_layout("attn", num_layers=4, tokens_per_page=32, num_kv_heads=8, head_size=128,
                          dtype_bytes=2, dtype="bfloat16")


def _pages(n: int, seed: int):
    keys = [os.urandom(16) for _ in range(n)]
    payloads = [np.random.default_rng(seed + i).integers(0, 256, LAYOUT.payload_bytes, dtype=np.uint8)
                for i in range(n)]
    return keys, payloads


def _wait(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def _corrupt_in_memory(store: TieredStore) -> int:
    """Pages in the memory tier whose bytes fail their checksums."""
    keys = store.memory.keys()
    bad = 0
    with store.memory.borrow(keys, count=False) as lease:
        for h, v in zip(lease.headers, lease.views):
            if h is None:
                continue
            try:
                verify_payload(h, LAYOUT, v)
            except Exception:
                bad += 1
    return bad


def _store_over(server: ServerProcess, capacity: str = "64MiB") -> TieredStore:
    cfg = load_config({"memory": {"capacity": capacity}, "remote": {"url": server.url, "timeout": 1.0}}, environ={})
    return TieredStore(cfg)


@pytest.fixture
def server():
    with spawn("--memory", "512MiB") as s:
        yield s
        if s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)  # (a test that failed may leave it paused)


def _held_in_server(store: TieredStore, n: int, seed: int):
    """``n`` pages only the server holds (written through, then dropped from memory)."""
    keys, payloads = _pages(n, seed)
    store.put(keys, [LAYOUT] * n, payloads)
    store.drain()
    store.memory.delete(keys)
    assert store.tiers[-1].contains(keys) == [True] * n
    return keys, payloads


def _pause_when(server: ServerProcess, monkeypatch, after_replies: int, after_s: float = 0.0) -> None:
    """SIGSTOP the server once a same-host read has read ``after_replies`` of its replies (0: as the
    read goes out, or ``after_s`` seconds later), once."""
    armed = [True]
    real_read, real_reply = ServerTier._read, server_client.Connection.reply
    seen = [0]

    def pause_once():
        if armed[0]:
            armed[0] = False
            assert pause(server.proc.pid, 5)

    def read(self, *a, **kw):
        seen[0] = 0
        if after_replies == 0 and after_s:
            threading.Timer(after_s, pause_once).start()
        elif after_replies == 0:
            pause_once()
        return real_read(self, *a, **kw)

    def reply(self, typ):
        out = real_reply(self, typ)
        if typ is server_client.GetReply:
            seen[0] += 1
            if seen[0] == after_replies:
                pause_once()
        return out

    monkeypatch.setattr(ServerTier, "_read", read)
    monkeypatch.setattr(server_client.Connection, "reply", reply)


@pytest.mark.parametrize("when", ["as the load goes out", "during its copies", "between chunks of the load"])
def test_a_paused_server_that_resumes_changes_no_byte_lmkv_reused(server, monkeypatch, when):
    """The server stalls past the client's timeout while a same-host load is in flight: the load
    is a miss, the slots it lent are held back while new pages fill memory, and when the server
    resumes and copies the stale pages into those slots, no page in use changes; the slots are then
    reclaimed and serve again. (Without the quarantine, the new pages there fail their checksums.)"""
    with _store_over(server) as store:
        keys, payloads = _held_in_server(store, 60, seed=0)  # 30 MiB: four chunks of 15 pages
        if when == "during its copies":  # (a few ms into a read of ~10 ms)
            _pause_when(server, monkeypatch, after_replies=0, after_s=0.002)
        else:
            _pause_when(server, monkeypatch, after_replies=0 if when == "as the load goes out" else 1)
        t0 = time.monotonic()
        with store.fetch(keys, LAYOUT) as f:
            got = [v is not None for v in f.views]
        assert time.monotonic() - t0 < 3  # the timeout (1 s), not the stall
        monkeypatch.undo()
        held = store.memory.quarantine.held
        step = 60 // server_client.ARENA_SPLIT
        if when == "as the load goes out":
            assert got == [False] * 60 and held == 60
        elif when == "between chunks of the load":  # the first chunk was answered: copied whole
            assert held in range(60 - step, 0, -step), held  # (and the next, if the server sent it as the pause came)
        else:  # chunks answered before the pause were copied whole; the ones after are held
            assert held in range(60, 0, -step), held
        assert store.metrics.value("lmkv_quarantined_total", tier="memory") == held
        assert store.memory.quarantined_bytes == held * LAYOUT.payload_bytes
        assert store.stats()["memory"]["quarantined_bytes"] == held * LAYOUT.payload_bytes
        # New pages fill memory (the health check keeps the server out of it meanwhile).
        new_keys, new_payloads = _pages(100, seed=1000)
        store.memory.put([(make_header(k, LAYOUT, p), p) for k, p in zip(new_keys, new_payloads)], "engine")
        os.kill(server.proc.pid, signal.SIGCONT)
        assert _wait(lambda: store.memory.quarantine.held == 0)  # its replies came: the slots are free again
        assert store.memory.stats.quarantined == store.memory.stats.reclaimed == held
        assert _corrupt_in_memory(store) == 0
        with store.memory.borrow(new_keys, count=False) as lease:
            for v, p in zip(lease.views, new_payloads):
                if v is not None:
                    assert np.array_equal(v, p)
        store.memory.delete(store.memory.keys())
        assert _wait(lambda: store.tiers[-1].health.up)
        with store.fetch(keys, LAYOUT) as f:  # the server serves them again, into slots it may use
            assert all(np.array_equal(v, p) for v, p in zip(f.views, payloads))
        assert store.memory.quarantine.held == 0


def test_slots_lent_to_a_server_that_dies_paused_are_reclaimed(server, monkeypatch):
    """A server that never resumes (killed while stopped) can no longer write: its exit lets go."""
    with _store_over(server) as store:
        keys, _ = _held_in_server(store, 8, seed=2)
        _pause_when(server, monkeypatch, after_replies=0)
        with store.fetch(keys, LAYOUT) as f:
            assert all(v is None for v in f.views)
        assert store.memory.quarantine.held == 8
        time.sleep(1.5)
        assert store.memory.quarantine.held == 8  # stalled: held as long as it takes
        server.proc.kill()
        server.proc.wait()
        assert _wait(lambda: store.memory.quarantine.held == 0)


def test_quarantined_slots_stay_out_of_reuse_until_their_writer_is_done():
    """The memory tier's side: a slot held for a writer is not handed out again when its session
    gives it back, nor evicted into; only once the writer's fate settles."""
    cfg = load_config({"memory": {"capacity": "4MiB"}}, environ={})  # 8 slots of 512 KiB
    with TieredStore(cfg) as store:
        mem = store.memory
        session = mem.open_session([os.urandom(16) for _ in range(3)], [LAYOUT] * 3, "engine")
        offsets = [session.buffer(i).ctypes.data - mem._arena.buf.ctypes.data for i in range(3)]
        fate: Future = Future()
        mem.quarantine.hold([(o, LAYOUT.payload_bytes) for o in offsets[:2]], fate)
        session.abort()  # the third slot goes back; the two held ones do not
        assert mem.used_bytes == 2 * LAYOUT.payload_bytes
        keys, payloads = _pages(8, seed=3)
        stored = mem.put([(make_header(k, LAYOUT, p), p) for k, p in zip(keys, payloads)], "engine")
        assert sum(stored) == 8 and len(mem) == 6  # 6 slots left: the rest evicted their own, never the held
        with mem.borrow(mem.keys(), count=False) as lease:
            at = {v.ctypes.data - mem._arena.buf.ctypes.data for v in lease.views}
        assert not at & set(offsets[:2])
        fate.set_result(None)
        assert mem.quarantine.held == 0 and mem.stats.reclaimed == 2
        more = mem.put([(make_header(k, LAYOUT, p), p) for k, p in zip(*_pages(2, seed=30))], "engine")
        assert sum(more) == 2 and len(mem) == 8


def test_lenders_stop_lending_slots_once_the_quarantine_is_full(server):
    """Past ``memory.quarantine_limit`` a same-host read lands through the connection's own window
    (a copy) instead of the arena: a server that stalls again strands no more slots."""
    cfg = load_config({"memory": {"capacity": "64MiB", "quarantine_limit": "1MiB"},
                       "remote": {"url": server.url}}, environ={})
    with TieredStore(cfg) as store:
        keys, payloads = _held_in_server(store, 4, seed=4)
        remote = store.tiers[-1]
        with remote._conn() as c, store.memory.open_session(keys[:1], [LAYOUT], "engine") as slot:
            assert c.arena and remote._arena_offsets(c, [slot.buffer(0)]) is not None
            store.memory.quarantine.hold([(0, 2 << 20)], Future())  # a stalled writer's 2 MiB
            assert remote._arena_offsets(c, [slot.buffer(0)]) is None
        with store.fetch(keys, LAYOUT) as f:  # served all the same, through the window
            assert all(np.array_equal(v, p) for v, p in zip(f.views, payloads))


def test_settled_map_returns_only_once_every_call_returned():
    """``Executor.map`` raises at the first failure while the other calls still run; a caller
    handing their buffers back then hands them to late writers."""
    done = []

    def call(i: int) -> int:
        if i == 0:
            raise OSError("the first read fails at once")
        time.sleep(0.2)
        done.append(i)
        return i

    with ThreadPoolExecutor(4) as pool:
        with pytest.raises(OSError):
            settled_map(pool, call, [0, 1, 2, 3])
        assert sorted(done) == [1, 2, 3]


def test_a_gds_fetch_hands_back_no_staging_slot_a_read_is_still_filling(tmp_path, layout, monkeypatch):
    """A disk tier reading pages into device staging slots (host memory standing in for the device,
    as in test_gds.py): one page's file cannot be opened, the others' reads are slow. The fetch
    returns, and its slots go back, only once every read returned: bytes written into the slots
    after that (a marker here) stay as written."""
    from support.host_gds import HostCuFile, gds_store

    from lmkv.kernels import digests

    class SlowCuFile(HostCuFile):
        def read(self, *a, **kw) -> None:
            time.sleep(0.3)
            super().read(*a, **kw)

    with gds_store(tmp_path, SlowCuFile(), layout.payload_bytes, 4) as (store, disk, staging):
        keys, _, pages = make_pages(layout, 4)
        disk.put(pages, "e")
        real_open = disk._open_any

        def open_any(key, *a, **kw):
            if key == keys[0]:
                raise PermissionError(13, "Permission denied")
            return real_open(key, *a, **kw)

        disk._open_any = open_any  # (EACCES, EMFILE: an open that fails other than for a missing file)
        monkeypatch.setattr(digests, "verify_on_device", lambda ptrs, lay, headers, **kw: [True] * len(ptrs))
        store.fetch(keys, layout, device=staging).release()
        slots = staging.take(4)
        for p in slots.ptrs:
            staging.page(p, layout.payload_bytes)[:] = 0xAB
        time.sleep(0.5)  # a read still running would land now
        assert all((staging.page(p, layout.payload_bytes) == 0xAB).all() for p in slots.ptrs)
        slots.release()


def test_a_server_that_ends_a_connection_has_stopped_copying_into_its_memory(layout):
    """The client takes a connection's end to mean the server no longer touches its memory: a
    server stopping while a GET into a client's arena is still reading its pages revokes the copy
    before it ends the connection, so the arena is left as it was."""
    import threading

    from lmkv.config import RemoteConfig
    from lmkv.errors import TierUnavailableError
    from lmkv.serve.server import Server
    from lmkv.tiers.arena import HostArena
    from lmkv.tiers.base import TierStats
    from lmkv.tiers.quarantine import Quarantine

    srv = Server(load_config({"server": {"port": 0}, "memory": {"capacity": "64MiB"}}, environ={}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tier = ServerTier(RemoteConfig(url=f"lmkv://127.0.0.1:{srv.port}", timeout=10))
    arena = HostArena(4 << 20, "never", shared=True)
    settled: list = []
    quarantine = Quarantine(threading.Lock(), lambda *a: None, 4 << 20, TierStats())
    tier.share_arena(arena, quarantine)
    keys, _, pages = make_pages(layout, 2)
    assert tier.put(pages, "engine") == [True, True]
    real_fetch, go, reading = srv.store.fetch, threading.Event(), threading.Event()

    def slow_fetch(*a, **kw):
        reading.set()
        go.wait(10)
        return real_fetch(*a, **kw)

    srv.store.fetch = slow_fetch
    outs = [arena.buf[i * layout.payload_bytes : (i + 1) * layout.payload_bytes] for i in range(2)]
    def read() -> None:
        try:
            settled.append(tier.get(keys, layout, outs))
        except TierUnavailableError:  # the server went away mid-request
            settled.append(None)

    get = threading.Thread(target=read)
    get.start()
    assert reading.wait(10)
    stopping = threading.Thread(target=srv.stop)
    stopping.start()
    time.sleep(0.5)  # (stop() ends the connections meanwhile)
    go.set()
    get.join(10)
    stopping.join(10)
    time.sleep(0.3)
    assert not arena.buf[: 2 * layout.payload_bytes].any()  # the copy never ran
    assert settled in ([[None, None]], [None])  # a miss
    assert _wait(lambda: quarantine.held == 0)  # the connection's end let the slots go
    tier.close()
