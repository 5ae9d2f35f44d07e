"""The Mooncake Store tier against a real ``mooncake_master`` on loopback: pages stored and read
back verified (whole and by ranges), damage and absence are misses, a master that is down or
stalled costs a bounded wait and the tier comes back, pages another process wrote are read here
(Mooncake places each object in some client's segment: the writer's going loses those)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import MemoryConfig, RemoteConfig
from lmkv.dev.mooncake_master import start_master
from lmkv.dev.redis_server import free_port
from lmkv.errors import TierUnavailableError
from lmkv.page import header_bytes, make_header
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import TierStats
from lmkv.tiers.memory import MemoryTier
from lmkv.tiers.quarantine import Quarantine

pytest.importorskip("mooncake.store")

from lmkv.tiers.mooncake import MooncakeTier  # noqa: E402


@pytest.fixture(scope="module")
def master():
    with start_master() as m:
        yield m


def _tier(url: str, **kw) -> MooncakeTier:
    mc = {"segment_size": 64 << 20, "local_buffer_size": 16 << 20, "staging_size": 8 << 20}
    return MooncakeTier(RemoteConfig(url=url, timeout=kw.pop("timeout", 5.0), mooncake=mc, **kw))


@pytest.fixture(scope="module")
def tier(master):
    t = _tier(master.url)
    yield t
    t.close()


def _read(tier, layout, keys) -> list:
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    return [h is not None for h in tier.get(keys, layout, outs)], outs


def test_pages_round_trip_verified_whole_and_by_ranges(tier, layout):
    keys, payloads, pages = make_pages(layout, 40, seed=1)  # (more than one staging batch: 8 MiB / 64 KiB)
    assert tier.put(pages, "engine") == [True] * 40
    assert tier.contains(keys + [b"\0" * 16]) == [True] * 40 + [False]
    found, outs = _read(tier, layout, keys)
    assert all(found) and all((o == p).all() for o, p in zip(outs, payloads))
    layer = layout.layer_range(2)
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys[:3]]
    assert all(h is not None for h in tier.get_ranges(keys[:3], layout, [layer], outs))
    for o, p in zip(outs, payloads):
        assert (o[layer[0] : layer[1]] == p[layer[0] : layer[1]]).all() and not o[: layer[0]].any()
    assert tier.delete(keys[:2]) == 2
    assert tier.contains(keys[:3]) == [False, False, True]


def test_a_damaged_object_is_a_miss_and_only_its_damaged_layer_fails_a_ranged_read(tier, layout):
    keys, payloads, pages = make_pages(layout, 2, seed=2)
    assert tier.put(pages, "engine") == [True, True]
    raw = tier._client()
    name = tier._name(keys[0])
    blob = np.zeros(header_bytes(layout) + layout.payload_bytes, np.uint8)  # (in registered memory: staging)
    staging = tier._staging
    assert raw.batch_get_into([name], [staging.ctypes.data], [blob.nbytes]) == [blob.nbytes]
    blob[:] = staging[: blob.nbytes]
    flip = header_bytes(layout) + layout.layer_range(1)[0] + 7
    blob[flip] ^= 0xFF
    staging[: blob.nbytes] = blob
    assert raw.batch_remove([name], True) == [0]
    assert raw.batch_put_from([name], [staging.ctypes.data], [blob.nbytes]) == [0]
    out = [np.zeros(layout.payload_bytes, np.uint8)]
    assert tier.get_ranges(keys[:1], layout, [layout.layer_range(0)], out)[0] is not None  # its layer 0 is fine
    assert tier.get_ranges(keys[:1], layout, [layout.layer_range(1)], out)[0] is None  # (and the page is dropped)
    found, _ = _read(tier, layout, keys)
    assert found == [False, True]


def _three_pages_read_by_layers(tier, layout, seed: int, monkeypatch) -> tuple[list, list, list]:
    """Three pages stored, then read by ranges a layer at a time for three layers: only the first
    layer's read asks Mooncake for their headers. (keys, payloads, the buffers read into.)"""
    keys, payloads, pages = make_pages(layout, 3, seed=seed)
    assert tier.put(pages, "engine") == [True] * 3
    asked: list[list[bool]] = []
    real = tier._fetch

    def fetch(client, names, ptrs, lens, srcs, whole):
        asked.append([src[0] == 0 for src in srcs])  # (the header is at the object's offset 0)
        return real(client, names, ptrs, lens, srcs, whole)

    monkeypatch.setattr(tier, "_fetch", fetch)
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    for layer in range(3):
        assert all(h is not None for h in tier.get_ranges(keys, layout, [layout.layer_range(layer)], outs))
    assert asked == [[True] * 3, [False] * 3, [False] * 3]
    return keys, payloads, outs


def test_a_pages_header_is_read_once_and_verifies_its_later_ranges(tier, layout, monkeypatch):
    """A layerwise load reads each page in spans: the first brings the page's header, the later ones
    ask Mooncake for their ranges alone and are verified against the header kept from the first.
    A range that does not match it (the object written again under its key with other bytes) is
    still a bad page (counted, dropped), and the header is no longer kept."""
    keys, payloads, outs = _three_pages_read_by_layers(tier, layout, 5, monkeypatch)
    for layer in range(3):
        a, b = layout.layer_range(layer)
        assert all((o[a:b] == p[a:b]).all() for o, p in zip(outs, payloads))
    _, other, _ = make_pages(layout, 1, seed=6)
    assert tier._client().batch_remove([tier._name(keys[0])], True) == [0]
    assert tier.put([(make_header(keys[0], layout, other[0]), other[0])], "engine") == [True]
    corrupt = tier.stats.corrupt
    got = tier.get_ranges(keys[:1], layout, [layout.layer_range(3)], outs[:1])
    assert got == [None] and tier.stats.corrupt == corrupt + 1 and tier._headers.get(keys[:1]) == [None]
    assert tier.get_ranges(keys[1:], layout, [layout.layer_range(3)], outs[1:]) != [None, None]


def test_with_verify_off_a_pages_header_is_still_read_once_and_a_bad_one_is_a_miss(master, layout, monkeypatch):
    """``remote.verify: false`` skips the payload's digests, not the header: a layerwise load's later
    spans read ranges alone (the header kept from the first span, as when verifying), and a header
    that is not this page's is still a miss."""
    t = _tier(master.url, verify=False)
    try:
        keys, payloads, outs = _three_pages_read_by_layers(t, layout, 15, monkeypatch)
        a, b = layout.layer_range(2)
        assert all((o[a:b] == p[a:b]).all() for o, p in zip(outs, payloads))
        raw, staging, size = t._client(), t._staging, header_bytes(layout) + layout.payload_bytes
        (other,), _, _ = make_pages(layout, 1, seed=16)
        assert raw.batch_get_into([t._name(keys[0])], [staging.ctypes.data], [size]) == [size]
        assert raw.batch_put_from([t._name(other)], [staging.ctypes.data], [size]) == [0]  # (page 0's object)
        corrupt = t.stats.corrupt
        assert t.get_ranges([other], layout, [layout.layer_range(3)], outs[:1]) == [None]
        assert t.stats.corrupt == corrupt + 1 and t._headers.get([other]) == [None]
    finally:
        t.close()


def test_a_layerwise_loads_spans_read_in_one_get_session(tier, layout, monkeypatch):
    """The spans of a layerwise load read the same pages one after another: the first starts their
    get session, the later ones read in it (no start, no master). An object that goes meanwhile
    is a miss and leaves the session; a page written again under its key is found afresh; objects
    idle for SESSION_IDLE_S leave the session with the next read."""
    from lmkv.tiers import mooncake

    monkeypatch.setattr(mooncake, "SESSION_IDLE_S", 60.0)  # (however slow this machine: nothing idles out)
    keys, payloads, pages = make_pages(layout, 4, seed=7)
    assert tier.put(pages, "engine") == [True] * 4
    real = tier._client()
    calls: list[tuple[str, list[str]]] = []

    class Counting:  # (counts the session calls, passes every call on)
        def __getattr__(self, name):
            f = getattr(real, name)
            if not name.startswith("batch_get_session"):
                return f
            return lambda names, *a: calls.append((name.rsplit("_", 1)[1], sorted(names))) or f(names, *a)

    monkeypatch.setattr(tier, "_client", Counting)
    names = sorted(tier._name(k) for k in keys)
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]

    def span(layer, ks=keys, os=outs):
        return [h is not None for h in tier.get_ranges(ks, layout, [layout.layer_range(layer)], os)]

    assert span(0) == span(1) == span(2) == [True] * 4
    assert calls == [("start", names)]
    a, b = layout.layer_range(2)
    assert all((o[a:b] == p[a:b]).all() for o, p in zip(outs, payloads))
    assert tier.delete(keys[:1]) == 1  # (deleting a page also forgets its header: the next span asks for it)
    assert span(3) == [False, True, True, True]
    assert ("end", [tier._name(keys[0])]) in calls
    assert tier.put(pages[:1], "engine") == [True]
    calls.clear()
    assert span(3) == [True] * 4
    assert calls == [("start", [tier._name(keys[0])])]
    monkeypatch.setattr(mooncake, "SESSION_IDLE_S", 0.05)
    time.sleep(0.1)
    other, _, more = make_pages(layout, 1, seed=8)
    assert tier.put(more, "engine") == [True]
    calls.clear()
    assert span(0, other, outs[:1]) == [True]
    assert any(op == "end" and set(names) <= set(ended) for op, ended in calls)
    assert ("start", [tier._name(other[0])]) in calls


def test_a_master_that_is_not_there_is_a_bounded_miss_and_the_tier_comes_up_with_it(layout):
    port = free_port()
    t = _tier(f"mooncake://127.0.0.1:{port}", connect_timeout=0.5)
    keys, _, pages = make_pages(layout, 2, seed=3)
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError):
        t.contains(keys)
    assert time.monotonic() - t0 < 0.5 + 0.5
    with pytest.raises(TierUnavailableError):  # marked down: fails at once
        t.put(pages, "engine")
    with start_master(port):
        deadline = time.monotonic() + 30
        while not t.health.up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert t.health.up
        assert t.put(pages, "engine") == [True, True] and t.contains(keys) == [True, True]
        t.close()


def test_a_stalled_master_costs_one_timeout_then_fails_fast(layout):
    with start_master() as m:
        t = _tier(m.url, timeout=1.0)
        keys, _, pages = make_pages(layout, 2, seed=4)
        assert t.put(pages, "engine") == [True, True]
        m.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TierUnavailableError):
                t.contains(keys)
            assert time.monotonic() - t0 < 1.0 + 0.5
            t0 = time.monotonic()
            with pytest.raises(TierUnavailableError):
                t.contains(keys)
            assert time.monotonic() - t0 < 0.1
        finally:
            m.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not t.health.up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert t.health.up and t.contains(keys) == [True, True]
        t.close()


def test_a_tier_closed_while_it_connects_keeps_no_client(master):
    """``close`` while the client is being set up: the new client is closed as soon as it is ready,
    and the closed tier neither holds one nor starts connecting again."""
    from concurrent.futures import CancelledError
    from concurrent.futures import wait as futures_wait

    t = _tier(master.url)
    t.connect_soon()
    connecting = t._connecting
    assert connecting is not None
    t.close()
    futures_wait([connecting], timeout=30)
    assert connecting.done()
    with pytest.raises((CancelledError, TierUnavailableError)):  # (no client set up on a closed tier)
        connecting.result()
    assert t._store is None and not t.connected
    t.connect_soon()
    assert t._connecting is connecting
    with pytest.raises(TierUnavailableError):
        t.contains([b"\0" * 16])


CLOSER = textwrap.dedent("""
    import signal, sys, time, numpy as np
    sys.path.insert(0, "tests")
    from conftest import make_pages
    from lmkv.config import RemoteConfig
    from lmkv.dev.mooncake_master import start_master, start_storage
    from lmkv.errors import TierUnavailableError
    from lmkv.layout import attention_layout
    from lmkv.tiers.mooncake import MooncakeTier
    layout = attention_layout("attn", num_layers=4, tokens_per_page=32, num_kv_heads=2, head_size=64,
                              dtype_bytes=2, dtype="bfloat16")
    with start_master() as m, start_storage(m, 64 << 20):
        t = MooncakeTier(RemoteConfig(url=m.url, timeout=0.5, mooncake={
            "segment_size": 0, "local_buffer_size": 16 << 20, "staging_size": 8 << 20}))
        keys, _, pages = make_pages(layout, 16, seed=8)
        assert t.put(pages, "engine") == [True] * 16
        client = t._client()
        m.signal(signal.SIGSTOP)
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        try:
            t.get(keys, layout, outs)
        except TierUnavailableError:
            print("given up", flush=True)
        t0 = time.monotonic()
        t.close()  # (the read given up on is still inside Mooncake: the master is stopped)
        print("closed", client._calls > 0, time.monotonic() - t0 < 0.5, flush=True)
        try:
            client.batch_is_exist(["x"])
        except RuntimeError:
            print("refused", flush=True)
        m.signal(signal.SIGCONT)  # (the read returns, and the client is closed behind it)
        deadline = time.monotonic() + 20
        while client._calls and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        print("survived", client._calls, flush=True)
""")


def test_a_tier_closed_while_a_call_given_up_on_is_in_flight_closes_its_client_once_that_call_returns():
    """A read given up on as the master stalls is still inside Mooncake when the tier closes (an
    engine shutting down behind a stalled master): closing Mooncake's client under that call
    crashed the process (SIGSEGV) once the call returned. The tier's close returns at once, the
    client refuses calls from then on and is closed once the call returns. (In a child process: a
    crash would take pytest with it.)"""
    done = subprocess.run([sys.executable, "-c", CLOSER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == ["given up", "closed True True", "refused", "survived 0"]


def test_pages_move_between_mooncake_and_the_arena_directly_and_a_call_given_up_on_keeps_its_slots(layout):
    """With the memory tier's arena shared, pages written from arena slots leave from there and pages
    read into arena slots land there, whole or by ranges: staging takes their headers only. A read
    given up on (the master stalled past ``remote.timeout``) keeps the slots it was lent in the
    quarantine until the call returns, and later calls use a new staging buffer."""
    with start_master() as m:
        t = _tier(m.url, timeout=1.0)
        arena = HostArena(1 << 20, "never")
        quarantine = Quarantine(threading.Lock(), lambda *a: None, 1 << 20, TierStats())
        t.share_arena(arena, quarantine)
        keys, payloads, pages = make_pages(layout, 4, seed=8)
        size = layout.payload_bytes
        slots = [arena.buf[i * size : (i + 1) * size] for i in range(8)]
        for slot, p in zip(slots, payloads):
            slot[:] = p
        assert t.put([(h, slot) for (h, _), slot in zip(pages, slots)], "engine") == [True] * 4
        headers = 4 * header_bytes(layout)
        staging = t._staging
        assert staging[:headers].any() and not staging[headers:].any()  # (no payload went through staging)
        assert all(h is not None for h in t.get(keys, layout, slots[4:]))
        assert all((o == p).all() for o, p in zip(slots[4:], payloads))
        a, b = layout.layer_range(1)
        for slot in slots[4:]:
            slot[:] = 0
        assert all(h is not None for h in t.get_ranges(keys, layout, [(a, b)], slots[4:]))
        assert all((o[a:b] == p[a:b]).all() and not o[:a].any() for o, p in zip(slots[4:], payloads))
        assert not staging[headers:].any()
        m.signal(signal.SIGSTOP)
        try:
            with pytest.raises(TierUnavailableError):
                t.get(keys, layout, slots[4:])
            assert quarantine.held == 4 and t._staging is not staging
        finally:
            m.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while (quarantine.held or not t.health.up) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert quarantine.held == 0
        assert all(h is not None for h in t.get(keys, layout, slots[4:]))
        t.close()


def test_a_page_moves_as_one_buffer_its_header_in_the_room_the_memory_tier_keeps_before_its_slot(master, layout):
    """A memory tier that keeps the Mooncake tier's ``header_room`` before each slot: a page written
    from its slot leaves with its header written into that room, and a page read into a fresh slot
    lands with its header there (one buffer each: header and payload are one run of memory), is
    verified, and leaves the slots beside it alone; staging carries nothing. A buffer in the arena
    that is not a slot's start has no room: its header goes through staging."""
    t = _tier(master.url)
    memory = MemoryTier(MemoryConfig(capacity="4MiB", pin="never"), header_room=t.header_room)
    try:
        t.share_arena(memory.arena, memory.quarantine, memory.room_before)
        keys, payloads, pages = make_pages(layout, 4, seed=21)
        hdr = header_bytes(layout)
        assert memory.put(pages, "engine") == [True] * 4
        with memory.borrow(keys) as lease:
            assert t.put([(h, v) for (h, _), v in zip(pages, lease.views)], "engine") == [True] * 4
            rooms = [bytes(memory.arena.buf[e.offset - hdr : e.offset]) for e in lease._entries]
            assert rooms == [h.pack() for h, _ in pages]
        assert not t._staging.any()
        memory.delete(keys)
        session = memory.open_session(keys, [layout] * 4, "engine")
        slots = [session.buffer(i) for i in range(4)]
        arena = memory.arena.buf
        arena[:] = 7
        offsets = [s.ctypes.data - arena.ctypes.data for s in slots]
        assert all(h is not None for h in t.get(keys, layout, slots))
        assert all((s == p).all() for s, p in zip(slots, payloads))
        assert not t._staging.any()
        untouched = np.ones(arena.nbytes, bool)
        for at, (h, _) in zip(offsets, pages):
            assert bytes(arena[at - hdr : at]) == h.pack()
            untouched[at - hdr : at + layout.payload_bytes] = False
        assert (arena[untouched] == 7).all()
        assert session.commit() == [True] * 4
        elsewhere = arena[-layout.payload_bytes :]  # (in the arena, not a slot)
        assert t.get(keys[:1], layout, [elsewhere])[0] is not None and (elsewhere == payloads[0]).all()
        assert bytes(t._staging[:hdr]) == pages[0][0].pack()
    finally:
        memory.close()
        t.close()


def test_a_ranged_read_whose_session_went_away_starts_it_again_and_is_a_hit(tier, layout):
    """A layerwise load's later spans read in the get session its first span started; when that
    session is gone (ended by another caller of the client, its lease run out), the read starts it
    again and the pages come, not misses and recomputed blocks."""
    keys, payloads, pages = make_pages(layout, 3, seed=31)
    assert tier.put(pages, "engine") == [True] * 3
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    assert all(h is not None for h in tier.get_ranges(keys, layout, [layout.layer_range(0)], outs))
    assert tier._client().batch_get_session_end([tier._name(k) for k in keys]) == 0
    a, b = layout.layer_range(1)
    assert all(h is not None for h in tier.get_ranges(keys, layout, [(a, b)], outs))
    assert all((o[a:b] == p[a:b]).all() for o, p in zip(outs, payloads))


def test_an_expired_lease_is_a_miss_not_an_outage():
    """Mooncake lends an object to a reader for ``default_kv_lease_ttl``; a read that outlives the lease is
    refused (-707, LEASE_EXPIRED: engines on other connectors died of it, Mooncake #3076). With a 1 ms
    lease, whole reads of 2 MiB pages and a ranged read that starts 10 ms after its session are misses;
    nothing raises, the tier stays up."""
    from lmkv.dev.mooncake_master import start_storage
    from lmkv.layout import attention_layout

    big = attention_layout("attn", num_layers=16, tokens_per_page=32, num_kv_heads=8, head_size=128,
                           dtype_bytes=2, dtype="bfloat16")  # 2 MiB pages
    with start_master(flags=["--default_kv_lease_ttl=1"]) as m, start_storage(m, 64 << 20):
        # (the pages live in the storage client's segment: a reader's own replica is read without a lease)
        t = MooncakeTier(RemoteConfig(url=m.url, timeout=5.0, mooncake={
            "segment_size": 0, "local_buffer_size": 16 << 20, "staging_size": 16 << 20}))
        keys, _, pages = make_pages(big, 3, seed=9)
        assert t.put(pages, "engine") == [True] * 3
        assert t.contains(keys) == [True] * 3
        found, _ = _read(t, big, keys)
        assert found == [False] * 3
        client = t._client()

        class Slow:
            """The client, reading a session's ranges only after the lease of its start ran out."""

            def __getattr__(self, name):
                return getattr(client, name)

            def batch_get_into_multi_buffer_ranges(self, *args):
                time.sleep(0.01)
                return client.batch_get_into_multi_buffer_ranges(*args)

        t._store = Slow()
        outs = [np.zeros(big.payload_bytes, np.uint8) for _ in keys]
        assert t.get_ranges(keys, big, [big.layer_range(0)], outs) == [None] * 3
        assert t.health.up and t.contains(keys) == [True] * 3
        t._store = client
        t.close()


WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, "tests")
    from conftest import make_pages
    from lmkv.layout import attention_layout
    from lmkv.config import RemoteConfig
    from lmkv.tiers.mooncake import MooncakeTier
    layout = attention_layout("attn", num_layers=4, tokens_per_page=32, num_kv_heads=2, head_size=64,
                              dtype_bytes=2, dtype="bfloat16")
    t = MooncakeTier(RemoteConfig(url=sys.argv[1], mooncake={"segment_size": 64 << 20,
                                  "local_buffer_size": 16 << 20, "staging_size": 8 << 20}))
    keys, payloads, pages = make_pages(layout, 3, seed=int(sys.argv[2]))
    assert t.put(pages, "engine") == [True] * 3
    print(" ".join(k.hex() for k in keys), flush=True)
    sys.stdin.read()  # until told to go
""")


def test_pages_written_by_another_process_are_read_here_and_its_death_is_a_miss(master, tier, layout):
    _, payloads, _ = make_pages(layout, 3, seed=77)  # (the writer's payloads: the same seeds)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, master.url, "77"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        keys = [bytes.fromhex(k) for k in writer.stdout.readline().split()]
        assert len(keys) == 3
        found, outs = _read(tier, layout, keys)
        assert all(found) and all((o == p).all() for o, p in zip(outs, payloads))
    finally:
        writer.kill()
        writer.wait()
    t0 = time.monotonic()
    found, outs = _read(tier, layout, keys)  # (an object that lived in the writer's segment is gone)
    assert time.monotonic() - t0 < tier.cfg.timeout + 1.0
    assert all((o == p).all() for f, o, p in zip(found, outs, payloads) if f)  # what is found is right


def test_a_store_writes_through_to_mooncake_and_loads_from_it(layout):
    from lmkv.config import load_config
    from lmkv.store import TieredStore

    keys, payloads, _ = make_pages(layout, 4, seed=5)
    with start_master() as m, TieredStore(load_config({"memory": {"capacity": "16MiB"}, "remote": {
            "url": m.url, "mooncake": {"segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                                       "staging_size": 8 << 20}}}, environ={})) as store:
        with store.open_session(keys, [layout] * 4) as session:  # (an engine's store: pages land in memory slots)
            for i, p in enumerate(payloads):
                session.buffer(i)[:] = p
            session.commit()
        store.drain()
        store.memory.delete(keys)
        assert store.lookup(keys).tiers == ("mooncake",) * 4
        with store.fetch(keys, layout) as fetched:  # (an engine's load: into memory slots, promoted)
            assert all((np.asarray(v) == p).all() for v, p in zip(fetched.views, payloads))
        staging = store.tiers[-1]._staging  # (pages went from and into the memory tier's arena: headers alone here)
        assert not staging[4 * header_bytes(layout) :].any()
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        store.memory.delete(keys)
        assert all(h is not None for h in store.get(keys, layout, outs))
        assert all((o == p).all() for o, p in zip(outs, payloads))


def test_a_killed_master_is_a_bounded_miss_and_a_new_one_is_picked_up(layout):
    port = free_port()
    keys, payloads, pages = make_pages(layout, 3, seed=6)
    with start_master(port) as m:
        t = _tier(m.url, timeout=1.0, connect_timeout=0.5)
        assert t.put(pages, "engine") == [True] * 3
        m.signal(signal.SIGKILL)
        m.proc.wait()
        t0 = time.monotonic()
        try:  # a miss or an outage, within the timeout; never wrong bytes
            found, outs = _read(t, layout, keys)
            assert all((o == p).all() for f, o, p in zip(found, outs, payloads) if f)
        except TierUnavailableError:
            pass
        assert time.monotonic() - t0 < 1.0 + 0.5
    with start_master(port):  # a new master: the client is known to it again within seconds
        deadline, stored = time.monotonic() + 30, [False]
        while not all(stored) and time.monotonic() < deadline:
            try:
                stored = t.put(pages, "engine")
            except TierUnavailableError:
                time.sleep(0.2)
        assert all(stored)
        found, outs = _read(t, layout, keys)
        assert all(found) and all((o == p).all() for o, p in zip(outs, payloads))
        t.close()


def _streaming_store(url: str, **mooncake):
    from lmkv.config import load_config
    from lmkv.store import TieredStore

    mc = {"segment_size": 64 << 20, "local_buffer_size": 16 << 20, "staging_size": 8 << 20, **mooncake}
    return TieredStore(load_config({"memory": {"capacity": "16MiB"}, "remote": {"url": url, "mooncake": mc}},
                                   environ={}))


def test_a_steps_pages_stream_to_mooncake_layer_by_layer_and_are_readable_only_once_committed(layout):
    """A step's store session puts each layer's range of its pages as the layer lands (one put
    session: its start, a ranged put per layer, the headers and its end at the commit), and no
    reader finds a page before the commit. A page the step did not store is revoked; an aborted
    step leaves nothing, and its pages can be stored later."""
    keys, payloads, _ = make_pages(layout, 5, seed=11)
    with start_master() as m, _streaming_store(m.url) as store:
        mc = store.tiers[-1]
        assert mc.contains(keys) == [False] * 5  # (connects the client: a step never waits for that)
        real = mc._store
        calls: list[str] = []

        class Counting:  # (counts the put calls, passes every call on)
            def __getattr__(self, name):
                f = getattr(real, name)
                return (lambda *a: calls.append(name) or f(*a)) if name.startswith("batch_put") else f

        mc._store = Counting()
        with store.open_session(keys[:4], [layout] * 4, streamed=True) as session:
            assert session.streaming
            for layer in range(layout.num_layers):
                a, b = layout.layer_range(layer)
                for i, p in enumerate(payloads[:4]):
                    session.buffer(i)[a:b] = p[a:b]
                session.filled(range(4), a, b)
            mc._streamer.submit(lambda: None).result()  # (every layer put)
            assert mc.contains(keys[:4]) == [False] * 4  # (reserved and filled: not readable yet)
            headers = [make_header(k, layout, p) for k, p in zip(keys[:4], payloads[:4])]
            session.commit([*headers[:3], None])
        session.written_through.result()
        assert calls == (["batch_put_session_start"] + ["batch_put_from_multi_buffer_ranges"] * layout.num_layers
                         + ["batch_put_from_multi_buffer_ranges", "batch_put_session_end", "batch_put_session_revoke"])
        assert mc.contains(keys[:4]) == [True, True, True, False]
        assert (mc.stats.puts, mc.stats.put_bytes) == (3, 3 * layout.payload_bytes)  # (counted as any write)
        store.memory.delete(keys)
        ok, outs = _read(mc, layout, keys[:3])  # (verified against the headers written last)
        assert ok == [True] * 3 and all((o == p).all() for o, p in zip(outs, payloads))

        calls.clear()
        with store.open_session(keys[3:], [layout] * 2, streamed=True) as session:
            a, b = layout.layer_range(0)
            session.buffer(0)[:] = payloads[3]
            session.filled([0], a, b)
            session.abort()
        mc._streamer.submit(lambda: None).result()
        assert calls[0] == "batch_put_session_start" and calls[-1] == "batch_put_session_revoke"
        assert mc.contains(keys[3:]) == [False, False]
        with store.open_session(keys[3:], [layout] * 2, streamed=True) as session:  # (revoked keys are free again)
            for i, p in enumerate(payloads[3:]):
                session.buffer(i)[:] = p
            session.filled([0], *layout.layer_range(0))  # (the rest never said filled: put at the commit)
            session.commit()
        session.written_through.result()
        assert mc.contains(keys[3:]) == [True, True]
        store.memory.delete(keys)
        ok, outs = _read(mc, layout, keys[3:])
        assert ok == [True, True] and all((o == p).all() for o, p in zip(outs, payloads[3:]))


def test_a_step_streams_nothing_when_it_is_off_its_caller_reports_no_ranges_or_the_tier_is_not_connected(layout):
    keys, payloads, _ = make_pages(layout, 2, seed=12)
    with start_master() as m, _streaming_store(m.url, stream_stores=False) as store:
        store.tiers[-1].contains(keys)
        with store.open_session(keys, [layout] * 2, streamed=True) as session:
            assert not session.streaming
        with _streaming_store(m.url) as other:
            other.tiers[-1].contains(keys)
            with other.open_session(keys, [layout] * 2) as session:  # (a caller that reports no ranges)
                assert not session.streaming
    port = free_port()  # (a store opened before its master: its first connection fails)
    with _streaming_store(f"mooncake://127.0.0.1:{port}") as store:
        with store.open_session(keys, [layout] * 2, streamed=True) as session:  # (not connected: whole, after)
            assert not session.streaming
            with start_master(port):
                for i, p in enumerate(payloads):
                    session.buffer(i)[:] = p
                session.commit()
                session.written_through.result()
                assert store.tiers[-1].contains(keys) == [True, True]


def test_a_store_connects_to_mooncake_as_it_opens(layout):
    """Mooncake's client setup takes long enough that an engine's first lookups would take it for a
    stalled network and miss: the store starts it as it opens, before any call."""
    with start_master() as m, _streaming_store(m.url) as store:
        deadline = time.monotonic() + 10
        while not store.tiers[-1].connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.tiers[-1].connected
        assert store.tiers[-1].stats.puts == store.tiers[-1].stats.hits == store.tiers[-1].stats.misses == 0


def test_bench_mooncake_quick_json_shape():
    """``lmkv bench mooncake``: every figure beside its baseline from the same run, the verified
    reads also beside the raw calls followed by hashing, and unverified."""
    out = subprocess.run([sys.executable, "-m", "lmkv.cli", "bench", "mooncake", "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout)
    assert report["bench"] == "mooncake" and "skipped" not in report["params"]
    names = {"mooncake.put.2MiB", "mooncake.put_session.2MiB"}
    for read in ("mooncake.get.2MiB", "mooncake.get.256KiB", "mooncake.get_layer.2MiB"):
        names |= {read, f"{read}.vs_raw_hashed", f"{read}.unverified"}
    assert set(report["metrics"]) == names
    for m in report["metrics"].values():
        assert m["unit"] == "GB/s" and m["value"] > 0 and m["baseline"] > 0 and m["baseline_what"]
        assert m["ratio"] == pytest.approx(m["value"] / m["baseline"])
    assert "xxh3" in report["metrics"]["mooncake.get_layer.2MiB.vs_raw_hashed"]["baseline_what"]
