"""``lmkv serve`` in a real child process, and its client tier over TCP and shared memory."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import make_pages, random_key, random_payload

from lmkv.config import ConfigError, RemoteConfig, load_config
from lmkv.dev.redis_server import free_port
from lmkv.dev.server_process import spawn
from lmkv.errors import TierUnavailableError
from lmkv.page import make_header
from lmkv.serve.server import Server
from lmkv.store import TieredStore
from lmkv.tiers.server_client import ServerTier
from lmkv.wire.protocol import FRAME, MAGIC, Get, Hello, LayoutMsg, Op, RemoteError, encode, frame


@pytest.fixture(scope="module")
def server():
    with spawn("--memory", "512MiB") as s:
        yield s


def _tier(url: str, **kw) -> ServerTier:
    ns = kw.pop("namespace", "default")
    return ServerTier(RemoteConfig(url=url, **kw), namespace=ns)


@pytest.mark.parametrize("shm", ["never", "auto"])
def test_roundtrip(server, layout, shm):
    t = _tier(server.url, shm=shm)
    keys, payloads, pages = make_pages(layout, 20)
    assert t.put(pages, "engine") == [True] * 20
    with t._conn() as c:
        assert (c.window is not None) == (shm == "auto")
    assert t.contains(keys + [random_key()]) == [True] * 20 + [False]
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    assert [h.key for h in t.get(keys, layout, outs)] == keys
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    rng = layout.layer_range(1, 1)
    out = np.zeros(layout.payload_bytes, np.uint8)
    assert t.read_ranges(keys[3], layout, [rng], out) is not None
    assert np.array_equal(out[rng[0]:rng[1]], payloads[3][rng[0]:rng[1]]) and not out[: rng[0]].any()
    assert t.delete(keys[:5]) == 5
    assert t.contains(keys[:6]) == [False] * 5 + [True]
    assert t.stats.corrupt == 0
    t.close()


@pytest.mark.parametrize("shm", ["never", "auto"])
def test_a_page_corrupt_in_its_last_chunk_is_caught_and_the_next_pages_still_land(server, shm):
    """Pages are verified chunk by chunk as they arrive (over the socket, or out of the staging
    window): a bad unit near a page's end fails that page only, and the stream stays in step for
    the pages after it in the same reply."""
    from lmkv.layout import attention_layout

    big = attention_layout("big", num_layers=8, tokens_per_page=64, num_kv_heads=4, head_size=128,
                           dtype_bytes=2, dtype="bfloat16")  # 16 units of 64 KiB: 4 landing chunks
    t = _tier(server.url, shm=shm)
    keys, payloads, pages = make_pages(big, 3, seed=7)
    bad = payloads[1].copy()
    bad[big.unit_ranges[14][0] + 5] ^= 0x10  # unit 14 of 16: the page's last chunk
    pages[1] = (pages[1][0], bad)  # its header still describes the good bytes
    assert t.put(pages, "engine") == [True] * 3
    outs = [np.zeros(big.payload_bytes, np.uint8) for _ in keys]
    got = t.get(keys, big, outs)
    assert got[0] is not None and got[1] is None and got[2] is not None
    assert np.array_equal(outs[0], payloads[0]) and np.array_equal(outs[2], payloads[2])
    assert t.stats.corrupt == 1
    t.close()


def test_namespaces_are_isolated(server, layout):
    a, b = _tier(server.url, namespace="tenant-a"), _tier(server.url, namespace="tenant-b")
    keys, payloads, pages = make_pages(layout, 3)
    a.put(pages, "engine")
    assert b.contains(keys) == [False] * 3
    assert b.get(keys, layout, [np.zeros(layout.payload_bytes, np.uint8)] * 3) == [None] * 3
    # b stores other bytes under the same keys; a still reads its own
    other = [(make_header(k, layout, random_payload(layout, 99)), random_payload(layout, 99)) for k in keys]
    b.put(other, "engine")
    out = np.zeros(layout.payload_bytes, np.uint8)
    assert a.get(keys[:1], layout, [out])[0] is not None and np.array_equal(out, payloads[0])
    a.close()
    b.close()


def test_wrong_layout_is_a_miss(server, layout, mamba_layout):
    t = _tier(server.url)
    keys, _, pages = make_pages(layout, 1)
    t.put(pages, "engine")
    assert t.get(keys, mamba_layout, [np.zeros(mamba_layout.payload_bytes, np.uint8)]) == [None]
    t.close()


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _reply(s: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < FRAME.size:
        chunk = s.recv(FRAME.size - len(head))
        if not chunk:
            return -1, b""
        head += chunk
    _, status, meta_len, _ = FRAME.unpack(head)
    meta = b""
    while len(meta) < meta_len:
        meta += s.recv(meta_len - len(meta))
    return status, meta


def _hello() -> bytes:
    return frame(Op.HELLO, encode(Hello(1, "default")))


BAD_FRAMES = {
    "bad magic": b"HTTP/1.1 GET /\r\n\r\n" + b"\0" * 16,
    "oversized metadata": struct.pack("<4sB3xIQ", MAGIC, Op.EXISTS, 1 << 30, 0),
    "oversized bulk": struct.pack("<4sB3xIQ", MAGIC, Op.PUT, 0, 1 << 40),
    "truncated frame": MAGIC + b"\x02",
    "a second HELLO": frame(Op.HELLO, encode(Hello(1, "other-tenant"))),
}

def _lay(layers: int) -> LayoutMsg:
    return LayoutMsg("x", "full_attention", layers, (("k", 8),), 16, "bf16", 1, 0, 1, None, "per_token")


BAD_REQUESTS = {
    "not msgpack": frame(Op.EXISTS, b"\xc1\xc1\xc1"),
    "unknown op": frame(99, b"\x80"),
    "wrong field types": frame(Op.EXISTS, encode({"keys": "not a list"})),
    "a 3-byte key": frame(Op.EXISTS, encode({"keys": [b"abc"]})),
    "too many keys": frame(Op.EXISTS, encode({"keys": [b"k" * 16] * 5000})),
    "a layout with no layers": frame(Op.GET, encode(Get([b"k" * 16], _lay(0)))),
    "ranges off unit boundaries": frame(Op.GET, encode(Get([b"k" * 16], _lay(2), [(3, 9)]))),
    "put bulk that does not match": frame(Op.PUT, encode({"headers": [], "domain": "engine"}), 10) + b"0123456789",
    "put of a garbage header": frame(Op.PUT, encode({"headers": [b"\0" * 80], "domain": "engine"})),
    "a bad domain": frame(Op.CLEAR, encode({"domain": "../../etc"})),
    "a layout of a million layers": frame(Op.GET, encode(Get([b"k" * 16], _lay(10**6)))),
    "shared memory never mapped": frame(Op.GET, encode(Get([b"k" * 16], _lay(2), dst=[0]))),
}


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_broken_frames_close_only_that_connection(server, layout, case):
    good = _tier(server.url)
    keys, _, pages = make_pages(layout, 2)
    good.put(pages, "engine")
    s = _raw(server.port)
    s.sendall(_hello())
    assert _reply(s)[0] == 0
    s.sendall(BAD_FRAMES[case])
    if case == "truncated frame":
        s.shutdown(socket.SHUT_WR)
    status, _ = _reply(s)
    assert status in (1, -1)
    try:
        assert s.recv(1) == b""  # closed
    except ConnectionResetError:
        pass  # closed with our unread bytes still queued: a reset
    s.close()
    assert good.contains(keys) == [True, True]
    assert server.proc.poll() is None
    good.close()


def test_bad_requests_get_errors_and_the_connection_goes_on(server, layout):
    s = _raw(server.port)
    s.sendall(frame(Op.EXISTS, encode({"keys": []})))
    status, meta = _reply(s)
    assert status == 1 and b"HELLO" in meta  # nothing before HELLO
    s.sendall(_hello())
    assert _reply(s)[0] == 0
    for name, req in BAD_REQUESTS.items():
        s.sendall(req)
        status, meta = _reply(s)
        assert status == 1, name
    s.sendall(frame(Op.PING, encode({})))
    assert _reply(s)[0] == 0  # still in step, still served
    s.close()


def test_requests_sent_in_one_write_are_each_answered_in_order(server, layout):
    """The server reads whatever has arrived in one call: a PUT's bulk and the requests after it
    may share its buffer with the request before, and each is still answered, in order."""
    keys, payloads, pages = make_pages(layout, 2)
    put = frame(Op.PUT, encode({"headers": [h.pack() for h, _ in pages], "domain": "engine"}),
                2 * layout.payload_bytes) + b"".join(p.tobytes() for p in payloads)
    msg = LayoutMsg.of(layout)
    s = _raw(server.port)
    s.sendall(_hello())
    assert _reply(s)[0] == 0
    s.sendall(put + frame(Op.EXISTS, encode({"keys": keys})) + frame(Op.GET, encode(Get([keys[1]], msg)))
              + frame(Op.PING, encode({})))
    assert _reply(s) == (0, encode({"stored": [True, True]}))
    assert _reply(s) == (0, encode({"present": [True, True]}))
    status, meta = _reply(s)
    got = bytearray()
    while len(got) < layout.payload_bytes:
        got += s.recv(layout.payload_bytes - len(got))
    assert status == 0 and bytes(got) == payloads[1].tobytes()
    assert _reply(s)[0] == 0
    s.close()


def test_token_required_off_loopback_and_checked(layout, monkeypatch):
    with pytest.raises(ConfigError, match="token"):
        Server(load_config({"server": {"host": "0.0.0.0", "port": 0}}, environ={}))
    with spawn("--memory", "64MiB", env={"LMKV_SERVER__TOKEN": "correct-horse"}) as s:
        good = _tier(s.url, token="correct-horse")
        keys, _, pages = make_pages(layout, 1)
        assert good.put(pages, "engine") == [True]
        bad = _tier(s.url, token="wrong-token")
        with pytest.raises(TierUnavailableError, match="authentication"):  # refused: the tier is down
            bad.contains(keys)
        assert not bad.health.up
        none = _tier(s.url)
        with pytest.raises(TierUnavailableError, match="authentication"):
            none.contains(keys)
        for t in (good, bad, none):
            t.close()


def test_tls(tmp_path, layout):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    env = {"LMKV_SERVER__TLS_CERT": str(cert), "LMKV_SERVER__TLS_KEY": str(key)}
    with spawn("--memory", "64MiB", env=env) as s:
        url = s.url.replace("lmkv://", "lmkvs://")
        t = _tier(url, tls_ca=str(cert), shm="never")
        keys, payloads, pages = make_pages(layout, 3)
        assert t.put(pages, "engine") == [True] * 3
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in t.get(keys, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
        plain = _tier(s.url, shm="never", timeout=2)  # a client that does not speak TLS
        with pytest.raises((TierUnavailableError, RemoteError)):
            plain.contains(keys)
        t.close()
        plain.close()


def test_restart_over_disk_keeps_pages_and_clients_reconnect(tmp_path, layout):
    port = free_port()
    disk = str(tmp_path / "disk")
    t = _tier(f"lmkv://127.0.0.1:{port}", timeout=2, connect_timeout=0.5)
    keys, payloads, pages = make_pages(layout, 8)
    with spawn("--memory", "64MiB", "--disk", disk, port=port):
        assert t.put(pages, "engine") == [True] * 8
    # down: a miss, fast, and the tier knows it
    with pytest.raises(TierUnavailableError):
        t.contains(keys)
    assert not t.health.up
    with spawn("--memory", "64MiB", "--disk", disk, port=port):
        deadline = time.monotonic() + 15
        while not t.health.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.health.up
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in t.get(keys, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    t.close()


def test_memory_stays_within_its_bound(layout):
    with spawn("--memory", "4MiB") as s:
        t = _tier(s.url)
        keys, payloads, pages = make_pages(layout, 200)  # 12.5 MiB through a 4 MiB tier
        for i in range(0, 200, 20):
            t.put(pages[i : i + 20], "engine")
        stats = t.server_stats()["memory"]
        assert stats["used_bytes"] <= stats["capacity_bytes"] == 4 << 20
        assert stats["evictions"] > 0
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        got = t.get(keys, layout, outs)
        assert 0 < sum(h is not None for h in got) < 200
        assert all(np.array_equal(outs[i], payloads[i]) for i, h in enumerate(got) if h is not None)
        t.close()


def test_load_many_clients_nothing_lost_or_corrupt(server, layout):
    """8 clients x 4 s of mixed put/get/exists: every page read back is checked."""
    from lmkv.dev.load_test import run_load

    result = run_load(server.url, clients=8, seconds=4.0, layout=layout)
    assert result.pages_checked > 100
    assert result.lost == 0 and result.corrupt == 0 and result.errors == 0
    assert result.server_evictions == 0 and result.server_memory_used <= result.server_memory_capacity


@pytest.mark.parametrize("pages", [4, 300])
def test_store_shares_pages_through_the_server(server, layout, pages):
    """A store on the server's host shares its memory arena: fetched pages are copied by the server
    straight into arena slots (300 pages: several chunks, each verified while the next is copied)."""
    cfg = load_config({"remote": {"url": server.url}, "namespace": "store-test"}, environ={})
    keys, payloads, _ = make_pages(layout, pages)
    with TieredStore(cfg) as a:
        a.put(keys, [layout] * pages, payloads)
    with TieredStore(cfg) as b:
        assert b.lookup(keys).tiers == ("server",) * pages
        with b.tiers[-1]._conn() as c:
            assert c.arena
        with b.fetch(keys, layout) as f:
            assert all(np.array_equal(v, p) for v, p in zip(f.views, payloads))
        assert b.tiers[-1].stats.hits == pages and b.tiers[-1].stats.corrupt == 0


def test_server_in_process_survives_a_client_dying_mid_put(layout):
    srv = Server(load_config({"server": {"port": 0}, "memory": {"capacity": "64MiB"}}, environ={}))
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    s = _raw(srv.port)
    s.sendall(_hello())
    _reply(s)
    keys, _, pages = make_pages(layout, 2)
    s.sendall(frame(Op.PUT, encode({"headers": [h.pack() for h, _ in pages], "domain": "engine"}),
                    2 * layout.payload_bytes) + b"x" * 1000)
    s.close()  # gone mid-bulk: the reserved slots must be released
    time.sleep(0.3)
    assert srv.store.memory.used_bytes == 0 and len(srv.store.memory) == 0
    t = _tier(f"lmkv://127.0.0.1:{srv.port}")
    assert t.put(pages, "engine") == [True, True]
    t.close()
    srv.stop()


def test_prometheus_endpoint(layout):
    import urllib.request

    mport = free_port()
    with spawn("--memory", "64MiB", "--metrics-port", str(mport)) as s:
        t = _tier(s.url)
        keys, _, pages = make_pages(layout, 3)
        t.put(pages, "engine")
        t.get(keys, layout, [np.zeros(layout.payload_bytes, np.uint8) for _ in keys])
        body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert 'lmkv_puts_total{tier="memory"} 3.0' in body
        assert 'lmkv_pages{tier="memory"} 3.0' in body
        t.close()


def test_a_busy_pool_is_a_miss_not_an_outage(server, layout):
    from lmkv.errors import TierBusyError

    t = _tier(server.url, max_connections=1, timeout=0.3)
    keys, _, pages = make_pages(layout, 1)
    t.put(pages, "engine")
    with t._conn():  # the only connection is taken
        with pytest.raises(TierBusyError):
            t.contains(keys)
    assert t.health.up  # the server is fine
    assert t.contains(keys) == [True]
    t.close()


def test_a_layerwise_read_is_one_access_so_pages_not_read_yet_outlive_it(layout):
    """A prompt read once layer by layer (a ranged GET per layer) must not look hot to the server's
    S3-FIFO: a P/D consumer read every page of the last prompts that way, and the next prompt P
    wrote had its first pages evicted before anyone read them (D found none of it)."""
    with spawn("--memory", "4MiB") as s:  # 64 pages
        t = _tier(s.url)
        keys_a, _, pages_a = make_pages(layout, 40)
        assert t.put(pages_a, "engine") == [True] * 40
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys_a]
        for layer in range(layout.num_layers):  # (as LayerFetch reads: one request per layer)
            got = t.get_ranges(keys_a, layout, [layout.layer_range(layer, 1)], outs)
            assert all(h is not None for h in got)
        keys_b, payloads_b, pages_b = make_pages(layout, 40, seed=100)
        for i in range(0, 40, 8):  # (a prefill's steps)
            t.put(pages_b[i : i + 8], "engine")
        assert t.contains(keys_b) == [True] * 40
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys_b]
        assert all(h is not None for h in t.get(keys_b, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads_b))
        t.close()


@pytest.mark.parametrize("shm", ["never", "auto"])
def test_a_large_write_goes_in_requests_a_reader_sees_as_they_commit(server, layout, shm, monkeypatch):
    """A prompt's pages go to the server a few MiB at a time, each request published when it
    commits: a P/D consumer sees the first pages of an 8B model's prompt (250 MiB) while the rest
    are on their way, instead of all at once."""
    from lmkv.tiers import remote
    from lmkv.tiers.server_connection import Connection

    calls = []
    monkeypatch.setattr(remote, "PUBLISH_BYTES", 3 * layout.payload_bytes)
    t = _tier(server.url, shm=shm)
    keys, payloads, pages = make_pages(layout, 8)
    call = Connection.call
    monkeypatch.setattr(Connection, "call", lambda self, op, *a, **kw: (calls.append(op), call(self, op, *a, **kw))[1])
    assert t.put(pages, "engine") == [True] * 8
    assert calls.count(Op.PUT) == 3  # 3 + 3 + 2 pages
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    assert all(h is not None for h in t.get(keys, layout, outs))
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    assert remote.batches([9] * 4, 1, 8) == [range(i, i + 1) for i in range(4)]  # (at least one page each)
    assert remote.batches([1] * 5, 100, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    t.close()


def test_a_layout_message_maps_to_one_layout_and_a_bad_one_is_refused_every_time():
    msg = _lay(2)
    assert msg.layout() is _lay(2).layout()  # (equal messages: one cached layout)
    assert hash(msg) == hash(_lay(2))
    for _ in range(2):  # (a refusal is not cached as an answer)
        with pytest.raises(ValueError, match="out of bounds"):
            _lay(0).layout()


def _mapped_bytes(buf: np.ndarray) -> int:
    """Bytes of ``buf``'s mapping that have page-table entries in this process (its VMA's Rss)."""
    start = buf.ctypes.data
    with open("/proc/self/smaps") as f:
        lines = iter(f.read().splitlines())
    for line in lines:
        if "-" in line.split()[0] and int(line.split("-")[0], 16) == start:
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError("no mapping starts at the buffer")


def test_a_clients_arena_is_mapped_once_for_all_its_connections_and_whole_when_the_client_maps_it_whole(layout):
    """Every connection of a same-host client passes its arena; the server maps it once (a page
    copied through a second mapping would fault again there), and maps that view whole in the
    background when the client maps its arena whole (an engine's ``memory.prefault``)."""
    from lmkv.tiers.arena import HostArena
    from lmkv.tiers.base import TierStats
    from lmkv.tiers.quarantine import Quarantine

    srv = Server(load_config({"server": {"port": 0}, "memory": {"capacity": "64MiB"}}, environ={}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for whole in (True, False):
            size = 32 << 20
            arena = HostArena(size, "never", prefault=whole, shared=True)
            tier = _tier(f"lmkv://127.0.0.1:{srv.port}", max_connections=4)
            tier.share_arena(arena, Quarantine(threading.Lock(), lambda *a: None, size, TierStats()))
            with tier._conn() as a, tier._conn() as b, tier._conn() as c:
                assert a is not b is not c and a.arena and b.arena and c.arena
                assert len(srv.arenas) == 1
                ((_, mapped),) = srv.arenas._maps.items()
                assert mapped.users == 3 and len(mapped.buf) == size
                deadline = time.monotonic() + 20
                while whole and _mapped_bytes(mapped.buf) < size and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert _mapped_bytes(mapped.buf) == size if whole else _mapped_bytes(mapped.buf) < size // 2
            keys, payloads, pages = make_pages(layout, 4)
            assert tier.put(pages, "w") == [True] * 4
            outs = [arena.buf[i * layout.payload_bytes : (i + 1) * layout.payload_bytes] for i in range(4)]
            assert tier.get(keys, layout, outs) is not None
            assert all((o == p).all() for o, p in zip(outs, payloads))
            tier.close()
            deadline = time.monotonic() + 10
            while len(srv.arenas) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(srv.arenas) == 0  # the last connection's end unmapped it
    finally:
        srv.stop()


def test_a_store_connects_to_a_same_host_server_as_it_opens():
    """The first connection opens in the background when the store does, so an engine's first load
    finds it, and the server's view of the arena is mapped by then; a server that is down costs
    the store nothing at open."""
    srv = Server(load_config({"server": {"port": 0}, "memory": {"capacity": "64MiB"}}, environ={}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        store = TieredStore(load_config({"memory": {"capacity": "16MiB", "pin": "never"},
                                         "remote": {"url": f"lmkv://127.0.0.1:{srv.port}"}}, environ={}))
        deadline = time.monotonic() + 10
        while not len(srv.arenas) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(srv.arenas) == 1  # (nothing was asked of the tier)
        store.close()
    finally:
        srv.stop()
    t0 = time.monotonic()
    down = TieredStore(load_config({"remote": {"url": f"lmkv://127.0.0.1:{free_port()}"},
                                    "memory": {"capacity": "16MiB", "pin": "never"}}, environ={}))
    assert time.monotonic() - t0 < 1.0
    down.close()


def test_a_read_of_small_pages_into_the_arena_goes_in_chunks_checked_as_the_next_are_copied(layout, monkeypatch):
    """A read of many small pages into the shared arena is asked for in several chunks (the server
    copies the next while this one is checked), each page checked and landed whole; one of big
    pages keeps its chunks of up to ``ARENA_CHUNK_BYTES``."""
    from lmkv.tiers import server_client
    from lmkv.tiers.arena import HostArena
    from lmkv.tiers.base import TierStats
    from lmkv.tiers.quarantine import Quarantine
    from lmkv.tiers.server_connection import Connection

    asked: list[int] = []
    send = Connection.send

    def counting(self, op, meta, *a, **kw):
        if op is Op.GET:
            asked.append(len(meta.keys))
        return send(self, op, meta, *a, **kw)

    monkeypatch.setattr(Connection, "send", counting)
    srv = Server(load_config({"server": {"port": 0}, "memory": {"capacity": "64MiB"}}, environ={}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        n = 16
        size = n * layout.payload_bytes
        arena = HostArena(size, "never", shared=True)
        tier = _tier(f"lmkv://127.0.0.1:{srv.port}")
        tier.share_arena(arena, Quarantine(threading.Lock(), lambda *a: None, size, TierStats()))
        keys, payloads, pages = make_pages(layout, n)
        assert tier.put(pages, "w") == [True] * n
        outs = [arena.buf[i * layout.payload_bytes : (i + 1) * layout.payload_bytes] for i in range(n)]
        assert tier.get(keys, layout, outs) is not None
        assert all((o == p).all() for o, p in zip(outs, payloads))
        assert asked == [n // server_client.ARENA_SPLIT] * server_client.ARENA_SPLIT
        asked.clear()
        monkeypatch.setattr(server_client, "ARENA_CHUNK_BYTES", 2 * layout.payload_bytes)  # (pages this big)
        for o in outs:
            o[:] = 0
        assert tier.get(keys, layout, outs) is not None
        assert all((o == p).all() for o, p in zip(outs, payloads))
        assert asked == [2] * (n // 2)
        tier.close()
    finally:
        srv.stop()
