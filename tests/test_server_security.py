"""``lmkv serve`` against hostile clients on its own host: what a client can make the server map,
and what happens to an engine when the server refuses it. Real ``lmkv serve`` processes on
loopback; a second uid through ``setpriv`` where the tests run as root."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import RemoteConfig, load_config
from lmkv.dev.server_process import spawn
from lmkv.store import TieredStore
from lmkv.tiers.server_client import ServerTier
from lmkv.wire import shm_window
from lmkv.wire.protocol import Empty, Get, HelloReply, LayoutMsg, Op, decode_reply, encode, frame, read_frame

OTHER_UID = 65534  # nobody


@pytest.fixture(scope="module")
def server():
    with spawn("--memory", "256MiB") as s:
        yield s


def _hello(sock: socket.socket, **fields) -> HelloReply:
    """HELLO with whatever fields a client chooses to send (msgpack map: unknown ones included)."""
    sock.sendall(frame(Op.HELLO, msgspec.msgpack.encode({"version": 1, "namespace": "default", **fields})))
    status, meta, _ = read_frame(sock, 1 << 20)
    assert status == 0, meta
    return decode_reply(meta, HelloReply)


def _tcp(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _unix(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(name)
    return s


def test_the_server_never_opens_a_path_a_client_names(server, tmp_path, layout):
    """The old attack: name another process's descriptor (or any file) as a window, with its first
    bytes as the "secret", then GET a page into that window. The server must not map it: the GET
    is refused and the file keeps its bytes."""
    keys, _, pages = make_pages(layout, 1)
    writer = ServerTier(RemoteConfig(url=server.url, shm="never"))
    assert writer.put(pages, "engine") == [True]
    writer.close()
    victim = tmp_path / "root-only"
    victim.write_bytes(os.urandom(1 << 20))
    victim.chmod(0o600)
    before = victim.read_bytes()
    fd = os.open(victim, os.O_RDWR)
    try:
        with _tcp(server) as s:
            name = f"/proc/{os.getpid()}/fd/{fd}"
            rep = _hello(s, shm_name=name, shm_secret=before[:32], arena_name=name, arena_secret=before[:32],
                         window=True)
            assert not rep.shm and not rep.arena
            s.sendall(frame(Op.GET, encode(Get(list(keys), LayoutMsg.of(layout), None, True))))
            status, meta, _ = read_frame(s, 1 << 20)
            assert status == 1 and b"no shared-memory window" in meta
    finally:
        os.close(fd)
    assert victim.read_bytes() == before


def test_tcp_clients_never_get_shared_memory(server):
    """Over TCP the window flags mean nothing: no descriptor is read, the reply maps nothing, and a
    client on this host is told where the Unix socket is."""
    with _tcp(server) as s:
        rep = _hello(s, window=True, arena=True)
        assert not rep.shm and not rep.arena
        assert rep.unix_socket and rep.unix_socket.startswith("\0lmkv-serve-") and rep.pid == server.proc.pid
        s.sendall(frame(Op.PING, encode(Empty())))
        assert read_frame(s, 1 << 20)[0] == 0  # nothing was waiting for descriptors


def _socket_name(server) -> str:
    with _tcp(server) as s:
        rep = _hello(s)
    assert rep.unix_socket
    return rep.unix_socket


def test_only_sealed_memfds_are_mapped_and_they_cannot_shrink(server):
    """A client that could shrink its memory after HELLO would kill the server (SIGBUS). Only
    memfds sealed against resizing are mapped; an unsealed one, or a plain file, is closed unmapped
    (the socket carries the bytes); a sealed one cannot be shrunk."""
    name = _socket_name(server)
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 1 << 20)
    with _unix(name) as s:
        s.sendall(frame(Op.HELLO, encode({"version": 1, "namespace": "default", "window": True})))
        socket.send_fds(s, [shm_window.MARKER], [unsealed])
        status, meta, _ = read_frame(s, 1 << 20)
        assert status == 0 and not decode_reply(meta, HelloReply).shm
        os.ftruncate(unsealed, 0)  # the attack: the server must not have this mapped
        s.sendall(frame(Op.PING, encode(Empty())))
        assert read_frame(s, 1 << 20)[0] == 0
    os.close(unsealed)
    sealed = shm_window.create(1 << 20)
    with pytest.raises(PermissionError):
        os.ftruncate(sealed.fd, 0)
    with _unix(name) as s:
        s.sendall(frame(Op.HELLO, encode({"version": 1, "namespace": "default", "window": True})))
        shm_window.send(s, [sealed])
        status, meta, _ = read_frame(s, 1 << 20)
        assert status == 0 and decode_reply(meta, HelloReply).shm
    sealed.close()
    with _unix(name) as s:  # the server lives on
        _hello(s)


def test_a_client_whose_socket_is_not_the_servers_stays_on_tcp(server, layout):
    """The pid the TCP port answered with must hold the Unix socket: a client refuses to pass its
    memory to any other process (here: a socket of its own under that name)."""
    from lmkv.tiers.server_client import UnixEndpoint

    t = ServerTier(RemoteConfig(url=server.url, shm="auto"))
    with pytest.raises(Exception, match="held by pid"):
        t._open(UnixEndpoint(_socket_name(server), server.proc.pid + 1))
    t.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.parametrize("allowed", [False, True])
def test_another_uid_shares_memory_only_if_allowed(tmp_path, layout, allowed):
    """A client of another uid (kernel-checked on the Unix socket) gets no shared memory unless
    ``server.shm_uids`` names it; its pages still move, over the socket."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"server:\n  shm_uids: [0, {OTHER_UID}]\n" if allowed else "server: {}\n")
    with spawn("--memory", "64MiB", "--file", str(cfg)) as s:
        keys, payloads, pages = make_pages(layout, 2)
        t = ServerTier(RemoteConfig(url=s.url, shm="never"))
        assert all(t.put(pages, "engine"))
        t.close()
        probe = (
            "import json, sys, numpy as np\n"
            "from lmkv.config import RemoteConfig\n"
            "from lmkv.layout import attention_layout\n"
            "from lmkv.tiers.server_client import ServerTier\n"
            "lay = attention_layout(*json.loads(sys.argv[2]))\n"
            "t = ServerTier(RemoteConfig(url=sys.argv[1], shm='auto'))\n"
            "keys = [bytes.fromhex(k) for k in json.loads(sys.argv[3])]\n"
            "outs = [np.zeros(lay.payload_bytes, np.uint8) for _ in keys]\n"
            "got = t.get(keys, lay, outs)\n"
            "with t._conn() as c:\n"
            "    print(json.dumps({'unix': t._unix is not None, 'window': c.window is not None,\n"
            "                      'loaded': [h is not None for h in got],\n"
            "                      'sums': [int(o.sum()) for o in outs]}))\n"
        )
        spec = json.dumps(["attn", 4, 32, 2, 64, 2, "bfloat16"])  # (the layout fixture)
        out = subprocess.run(
            ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
             sys.executable, "-c", probe, s.url, spec, json.dumps([k.hex() for k in keys])],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "HOME": str(tmp_path)},
        )
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["unix"] and got["window"] == allowed
        assert got["loaded"] == [True, True]
        assert got["sums"] == [int(p.sum()) for p in payloads]


def test_an_engine_starts_while_the_server_refuses_it(layout):
    """A server that refuses HELLO (here: full) is a tier that is down: the store opens, serves from
    its other tiers, and picks the server up once it accepts again."""
    with spawn("--memory", "64MiB", env={"LMKV_SERVER__MAX_CONNECTIONS": "1"}) as s:
        holder = ServerTier(RemoteConfig(url=s.url, shm="never"))
        keys, _, pages = make_pages(layout, 2)
        assert all(holder.put(pages, "engine"))
        with holder._conn():  # the one connection the server takes
            store = TieredStore(load_config({"memory": {"capacity": "16MiB"}, "remote": {"url": s.url}},
                                            environ={}))
            assert store.lookup(keys).pages == 0  # refused: a miss, not an error
            assert not store.tiers[-1].health.up
        holder.close()  # (its pooled connection held the server's one slot)
        deadline = time.monotonic() + 20
        while store.lookup(keys).pages != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.lookup(keys).pages == 2
        store.close()


def test_window_memory_is_the_clients_own(server, layout):
    """Bulk bytes through the window are the client's pages, nothing else: a round trip over the
    Unix socket with shared memory returns exactly what was stored."""
    t = ServerTier(RemoteConfig(url=server.url, shm="auto"))
    keys, payloads, pages = make_pages(layout, 3)
    assert all(t.put(pages, "engine"))
    with t._conn() as c:
        assert c.window is not None and t._unix is not None
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    assert all(h is not None for h in t.get(keys, layout, outs))
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    t.close()


def _serve(tmp_path, **server) -> object:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"server": server}))  # (YAML reads JSON)
    return spawn("--memory", "64MiB", "--file", str(cfg))


def test_half_open_connections_never_lock_a_client_out(tmp_path, layout):
    """256 connections that never say HELLO, held open: a normal client still connects and works
    (the oldest unauthenticated connections are closed to make room, not the newest refused)."""
    with _serve(tmp_path, max_unauthenticated=16, max_connections=64) as s:
        held = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(256)]
        try:
            t = ServerTier(RemoteConfig(url=s.url, shm="never"))
            keys, _, pages = make_pages(layout, 2)
            assert all(t.put(pages, "engine")) and t.contains(keys) == [True, True]
            t.close()
        finally:
            for h in held:
                h.close()


def test_hello_has_a_deadline_however_slowly_it_trickles(tmp_path):
    """A client that sends its HELLO one byte at a time is cut off at the deadline, not kept for
    the idle timeout."""
    with _serve(tmp_path, hello_timeout=1.0) as s, _tcp(s) as c:
        hello = frame(Op.HELLO, msgspec.msgpack.encode({"version": 1, "namespace": "default"}))
        t0 = time.monotonic()
        with pytest.raises(OSError):  # the server closed it: a later send fails
            for i in range(50):  # 10 bytes a second: the whole HELLO would take 3 s
                c.send(hello[i % len(hello) : i % len(hello) + 1])
                time.sleep(0.1)
        assert time.monotonic() - t0 < 4


def test_connections_per_peer_are_capped_until_they_authenticate(tmp_path):
    """One address holds at most ``max_per_peer`` connections that have not said HELLO; an
    authenticated one counts against its tenant instead (tenants on one host share its address)."""
    with _serve(tmp_path, max_per_peer=4) as s:
        mine = [_tcp(s) for _ in range(4)]
        with _tcp(s) as fifth:
            status, meta, _ = read_frame(fifth, 1 << 20)
            assert status == 1 and b"too many connections from 127.0.0.1" in meta
        for c in mine:
            _hello(c)
        more = [_tcp(s) for _ in range(4)]
        for c in more:
            _hello(c)
        for c in mine + more:
            c.close()


def test_wrong_tokens_are_answered_slower_and_slower(tmp_path):
    """Guessing a token costs time: each failure from a peer waits twice as long as the last."""
    with _serve(tmp_path, token="correct-horse-battery") as s:
        t0 = time.monotonic()
        for _ in range(3):
            with _tcp(s) as c:
                c.sendall(frame(Op.HELLO, encode({"version": 1, "namespace": "default", "token": "guess"})))
                status, meta, _ = read_frame(c, 1 << 20)
                assert status == 1 and b"authentication failed" in meta
        assert time.monotonic() - t0 >= 0.25 + 0.5 + 1.0 - 0.1
        with _tcp(s) as c:  # the right token is not slowed
            t1 = time.monotonic()
            _hello(c, token="correct-horse-battery")
            assert time.monotonic() - t1 < 0.25


def test_a_silent_client_loses_its_connection_at_the_idle_timeout_and_a_busy_one_keeps_it(tmp_path):
    """A client that says nothing for ``server.idle_timeout`` is told so and closed; one that keeps
    asking is not, however long it stays. (Its socket's calls give up in the kernel: a blocking
    socket without ``SO_RCVTIMEO`` would wait for it forever.)"""
    with _serve(tmp_path, idle_timeout=1.0) as s:
        with _tcp(s) as silent, _tcp(s) as busy:
            _hello(silent)
            _hello(busy)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.5:  # past the idle timeout, a request every 0.2 s
                busy.sendall(frame(Op.STATS, encode(Empty())))
                assert read_frame(busy, 1 << 20)[0] == 0
                time.sleep(0.2)
            status, meta, _ = read_frame(silent, 1 << 20)  # told why, and closed, while the other asked
            assert status == 1 and b"timeout" in meta
            assert silent.recv(1 << 16) == b""


def test_a_client_that_never_reads_its_reply_loses_its_connection_not_a_thread_forever(tmp_path, layout):
    """A GET whose reply (16 MiB, far more than the sockets buffer) the client never reads: the
    server's send gives up at the timeout and closes the connection; other clients are served."""
    with _serve(tmp_path, idle_timeout=1.0) as s:
        keys, _, pages = make_pages(layout, 256)
        tier = ServerTier(RemoteConfig(url=s.url, shm="never"))
        assert all(tier.put(pages, "engine"))
        tier.close()
        with _tcp(s) as stuck:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            _hello(stuck)
            stuck.sendall(frame(Op.GET, encode(Get(list(keys), LayoutMsg.of(layout)))))
            time.sleep(3.0)  # never reading, past the timeout
            got, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < 10:
                try:
                    chunk = stuck.recv(1 << 20)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                got += len(chunk)
            assert got < 256 * layout.payload_bytes  # cut off, not sent whole after all
        tier = ServerTier(RemoteConfig(url=s.url, shm="never"))
        assert all(h is not None for h in tier.get(keys[:4], layout, [np.zeros(layout.payload_bytes, np.uint8)] * 4))
        tier.close()


def test_a_put_whose_pages_never_come_releases_its_room(tmp_path, layout):
    """A PUT reserves room for its pages when its header arrives; if they do not follow within
    the payload deadline the connection is closed and the room is free again."""
    from lmkv.page import make_header
    from lmkv.wire.protocol import Put, Stats

    with _serve(tmp_path, payload_timeout=1.0) as s:
        keys, payloads, _ = make_pages(layout, 4)
        headers = [make_header(k, layout, p).pack() for k, p in zip(keys, payloads)]
        with _tcp(s) as c:
            _hello(c)
            c.sendall(frame(Op.PUT, encode(Put(headers, "engine")), 4 * layout.payload_bytes))
            c.sendall(payloads[0][:100].tobytes())  # and then nothing
            t0 = time.monotonic()
            assert c.recv(1 << 16) == b""  # closed at the deadline
            assert 0.8 < time.monotonic() - t0 < 5
        with _tcp(s) as c:
            _hello(c)
            c.sendall(frame(Op.STATS, encode(Empty())))
            status, meta, _ = read_frame(c, 1 << 20)
            assert decode_reply(meta, Stats).tiers["memory"]["used_bytes"] == 0


def test_ranges_cannot_multiply_what_a_request_expands_to(server, layout):
    """A GET naming the whole page 500 times (8 KB of metadata) is refused before anything is
    allocated: ranges must come in order without overlapping."""
    with _tcp(server) as c:
        _hello(c)
        whole = (0, layout.payload_bytes)
        keys, _, _ = make_pages(layout, 1)
        c.sendall(frame(Op.GET, encode(Get(list(keys), LayoutMsg.of(layout), [whole] * 500))))
        status, meta, _ = read_frame(c, 1 << 20)
        assert status == 1 and b"overlaps" in meta


def test_deeply_nested_metadata_is_an_error_reply(server):
    with _tcp(server) as c:
        # a HELLO with an unknown field holding an array in an array ... 200k deep
        nested = b"\x83\xa7version\x01\xa9namespace\xa1x\xa5extra" + b"\x91" * 200_000 + b"\xc0"
        c.sendall(frame(Op.HELLO, nested))
        status, meta, _ = read_frame(c, 1 << 20)
        assert status == 1
    with _tcp(server) as c:  # and the server lives on
        _hello(c)


def test_long_residency_domains_are_refused_not_aliased(server, layout):
    """Two different 63-character domains would have become one after qualification (truncated to
    64); each is refused instead, and a domain that fits still works."""
    t = ServerTier(RemoteConfig(url=server.url, shm="never"))
    keys, _, pages = make_pages(layout, 1)
    from lmkv.wire.protocol import RemoteError

    for name in ("a" * 62 + "1", "a" * 62 + "2"):
        with pytest.raises(RemoteError, match="at most"):
            t.put(pages, name)
    assert t.put(pages, "a" * 40) == [True]
    t.close()


def test_metrics_stay_on_loopback_and_can_require_the_token(tmp_path):
    """The data port on every address does not put the counters there: the endpoint is on loopback
    unless configured, and with ``metrics_auth`` a scrape needs the bearer token."""
    import urllib.error
    import urllib.request

    from lmkv.dev.redis_server import free_port

    mport = free_port()
    with _serve(tmp_path, host="0.0.0.0", token="correct-horse-battery", metrics_port=mport, metrics_auth=True):
        url = f"http://127.0.0.1:{mport}/metrics"
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(url, timeout=5)
            except urllib.error.HTTPError as e:
                assert e.code == 401
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        req = urllib.request.Request(url, headers={"Authorization": "Bearer correct-horse-battery"})
        assert b"lmkv_" in urllib.request.urlopen(req, timeout=5).read()
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):  # not on this host's other addresses, where the data port is
            with socket.socket() as probe:
                assert probe.connect_ex((other, mport)) != 0


def test_only_buffers_wholly_inside_the_shared_arena_are_lent_by_offset():
    """What a client names by offset the server writes into: a buffer outside the arena, not
    contiguous, or empty is never lent (its bytes go through the socket instead)."""
    arena = np.zeros(1 << 16, np.uint8)
    other = np.zeros(64, np.uint8)
    bufs = [arena[4096:8192], memoryview(arena)[100:200], memoryview(arena[8:16]).toreadonly(), arena[-10:],
            other, arena[::2][:10], arena[:0], bytes(10), bytearray(5)]
    assert shm_window.offsets_in(arena, bufs) == [4096, 100, 8, (1 << 16) - 10, None, None, None, None, None]
