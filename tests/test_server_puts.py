"""A step's pages streamed to a real ``lmkv serve`` layer by layer, readable only once committed."""

from __future__ import annotations

import time

import pytest
from conftest import make_pages, reads_back

from lmkv.config import load_config
from lmkv.dev.server_process import spawn
from lmkv.store import TieredStore
from lmkv.tiers.server_connection import Connection
from lmkv.wire.protocol import Op, PutOpen, PutRange, RemoteError


@pytest.fixture(scope="module")
def server():
    with spawn("--memory", "256MiB") as s:
        yield s


def _store(url: str, shm: str, ns: str, **remote) -> TieredStore:
    return TieredStore(load_config({"memory": {"capacity": "32MiB"}, "namespace": ns,
                                    "remote": {"url": url, "shm": shm, **remote}}, environ={}))


def _calls(monkeypatch) -> list[Op]:
    ops: list[Op] = []
    call = Connection.call
    monkeypatch.setattr(Connection, "call", lambda self, op, *a, **kw: (ops.append(op), call(self, op, *a, **kw))[1])
    return ops


@pytest.mark.parametrize("shm", ["auto", "never"])
def test_a_steps_pages_stream_to_the_server_layer_by_layer_and_are_readable_only_once_committed(
        server, layout, shm, monkeypatch):
    """One put session: its opening, a range per layer (from the shared arena on this host, in the
    request across hosts), the headers at the commit; no reader finds a page before it. A page the
    step did not store is not stored; an aborted step leaves nothing and its keys can be stored later."""
    keys, payloads, _ = make_pages(layout, 3, seed=41)
    ops = _calls(monkeypatch)
    with _store(server.url, shm, f"stream-{shm}") as store, _store(server.url, shm, f"stream-{shm}") as reader:
        remote = store.tiers[-1]
        with store.open_session(keys, [layout] * 3, streamed=True) as session:
            assert session.streaming
            for layer in range(layout.num_layers):
                a, b = layout.layer_range(layer)
                for i, p in enumerate(payloads):
                    session.buffer(i)[a:b] = p[a:b]
                session.filled(range(3), a, b)
            assert reader.tiers[-1].contains(keys) == [False] * 3  # (streamed, not committed)
            headers = session._inner.headers()
            session.commit([headers[0], headers[1], None])
        assert session.written_through.result() is None
        assert ops.count(Op.PUT_OPEN) == 1 and ops.count(Op.PUT_RANGE) == layout.num_layers
        assert ops.count(Op.PUT_END) == 1 and Op.PUT not in ops  # (nothing left to write through)
        assert remote.contains(keys) == [True, True, False]
        assert (remote.stats.puts, remote.stats.put_bytes) == (2, 2 * layout.payload_bytes)
        assert reads_back(reader.tiers[-1], keys[:2], layout, payloads)

        more, more_payloads, _ = make_pages(layout, 2, seed=42)
        with store.open_session(more, [layout] * 2, streamed=True) as session:
            a, b = layout.layer_range(0)
            session.buffer(0)[a:b] = more_payloads[0][a:b]
            session.filled([0], a, b)
            session.abort()
        deadline = time.monotonic() + 10  # (the abort goes from the stream's thread)
        while Op.PUT_ABORT not in ops and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ops.count(Op.PUT_ABORT) == 1
        assert remote.contains(more) == [False, False]
        with store.open_session(more, [layout] * 2, streamed=True) as session:  # (reported nothing: whole)
            for i, p in enumerate(more_payloads):
                session.buffer(i)[:] = p
            session.commit()
        session.written_through.result()
        assert remote.contains(more) == [True, True] and Op.PUT not in ops
        assert remote.stats.errors == 0


def test_a_stream_that_fails_leaves_its_pages_to_the_write_through_and_nothing_half_written(server, layout):
    """The server refuses a range: the session is dropped there and the step's pages are written
    through whole after its commit. Streaming off, or a pool of one connection: whole, after the
    commit, from the start."""
    keys, payloads, _ = make_pages(layout, 2, seed=43)
    with _store(server.url, "auto", "stream-fail") as store:
        with store.open_session(keys, [layout] * 2, streamed=True) as session:
            for i, p in enumerate(payloads):
                session.buffer(i)[:] = p
            session.filled([0, 1], 0, layout.payload_bytes + 1)  # (past a page's end: refused)
            session.commit()
        session.written_through.result()
        assert store.tiers[-1].contains(keys) == [True, True]
        store.memory.delete(keys)
        assert reads_back(store, keys, layout, payloads)
    for off in ({"stream_stores": False}, {"max_connections": 1}):  # (a stream holds a connection a step long)
        with _store(server.url, "auto", "stream-off", **off) as store:
            with store.open_session(keys, [layout] * 2, streamed=True) as session:
                assert not session.streaming


def test_the_server_bounds_put_sessions_and_drops_them_with_their_connection(server, layout):
    """Sessions belong to their connection: another cannot touch them, ranges outside a page or the
    shared region are refused, at most four are open at once, and a connection's end drops its
    sessions' pages unpublished."""
    from lmkv.config import RemoteConfig
    from lmkv.tiers.server_client import ServerTier
    from lmkv.wire.protocol import LayoutMsg, Opened

    keys, _, _ = make_pages(layout, 2, seed=44)
    tier = ServerTier(RemoteConfig(url=server.url, shm="never"), namespace="stream-bounds")
    msg = LayoutMsg.of(layout)
    used = tier.server_stats()["memory"]["used_bytes"]
    c, other = tier._open(None), tier._open(None)
    try:
        number = c.call(Op.PUT_OPEN, PutOpen([bytes(k) for k in keys], [msg] * 2, "d"), Opened).session
        assert number is not None
        with pytest.raises(RemoteError, match="no put session"):
            other.call(Op.PUT_RANGE, PutRange(number, [0], 0, 8), Opened, [b"\0" * 8])
        with pytest.raises(RemoteError, match="outside a page"):
            c.call(Op.PUT_RANGE, PutRange(number, [0], 0, layout.payload_bytes + 8), Opened,
                   [b"\0" * (layout.payload_bytes + 8)])
        with pytest.raises(RemoteError, match="no shared arena"):
            c.call(Op.PUT_RANGE, PutRange(number, [1], 0, 8, [0]), Opened)
        with pytest.raises(RemoteError, match="out of the session"):
            c.call(Op.PUT_RANGE, PutRange(number, [2], 0, 8), Opened, [b"\0" * 8])
        for _ in range(3):
            c.call(Op.PUT_OPEN, PutOpen([bytes(k) for k in keys], [msg] * 2, "d"), Opened)
        with pytest.raises(RemoteError, match="put sessions open"):
            c.call(Op.PUT_OPEN, PutOpen([bytes(k) for k in keys], [msg] * 2, "d"), Opened)
        assert tier.server_stats()["memory"]["used_bytes"] == used + 8 * layout.payload_bytes  # (reserved)
    finally:
        c.close()
        other.close()
    deadline = time.monotonic() + 10
    while tier.server_stats()["memory"]["used_bytes"] != used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.server_stats()["memory"]["used_bytes"] == used
    assert tier.contains(keys) == [False, False]
    tier.close()
