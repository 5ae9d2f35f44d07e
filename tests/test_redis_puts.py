"""A step's pages streamed to a real Redis (one node and a three-node cluster) layer by layer, in
staging keys renamed into place at the commit: readable only once committed, nothing left behind."""

from __future__ import annotations

import time

import pytest
import redis
from conftest import make_pages, raw_redis, reads_back

from lmkv.config import load_config
from lmkv.store import TieredStore
from lmkv.tiers.redis import RedisTier


def _store(url: str, prefix: str, **remote) -> TieredStore:
    return TieredStore(load_config({"memory": {"capacity": "32MiB"},
                                    "remote": {"url": url, "key_prefix": prefix, **remote}}, environ={}))


def _staged(raw, prefix: str) -> list[bytes]:
    """The staging keys under ``prefix`` (on every node of a cluster)."""
    if isinstance(raw, redis.RedisCluster):
        return list(raw.scan_iter(match=f"{prefix}*:s:*", target_nodes=redis.RedisCluster.PRIMARIES))
    return list(raw.scan_iter(match=f"{prefix}*:s:*"))


def _writes(monkeypatch) -> list[int]:
    """The pages each whole write (the write-through of pages no stream took) carried."""
    sizes: list[int] = []
    write = RedisTier._write
    monkeypatch.setattr(RedisTier, "_write", lambda self, pages, domain: (sizes.append(len(pages)),
                                                                          write(self, pages, domain))[1])
    return sizes


def _fill(session, payloads, layout, pages=None) -> None:
    """What a worker does: each layer of every page lands, then is reported."""
    pages = range(len(payloads)) if pages is None else pages
    for layer in range(layout.num_layers):
        a, b = layout.layer_range(layer)
        for i in pages:
            session.buffer(i)[a:b] = payloads[i][a:b]
        session.filled(list(pages), a, b)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["node", "cluster"])
def test_a_steps_pages_stream_to_redis_and_are_readable_only_once_committed(request, layout, where, monkeypatch):
    """Staging keys fill layer by layer; no reader finds a page before the commit; at the commit
    they are renamed into place (nothing is written through), a page the step did not store is not
    stored, no staging key is left, and an aborted step leaves nothing."""
    url = request.getfixturevalue("redis_node" if where == "node" else "redis_cluster").url
    prefix = f"rs{time.monotonic_ns()}:"
    raw = raw_redis(url)
    writes = _writes(monkeypatch)
    keys, payloads, _ = make_pages(layout, 6, seed=51)
    with _store(url, prefix) as store, _store(url, prefix) as reader:
        remote = store.tiers[-1]
        with store.open_session(keys, [layout] * 6, streamed=True) as session:
            assert session.streaming
            _fill(session, payloads, layout)
            _wait(lambda: len(_staged(raw, prefix)) == 6, "every page staged")
            assert reader.tiers[-1].contains(keys) == [False] * 6  # (streamed, not committed)
            headers = session._inner.headers()
            session.commit([*headers[:5], None])
        assert session.written_through.result() is None
        assert writes == []  # (the stream took every page)
        assert remote.contains(keys) == [True] * 5 + [False]
        assert _staged(raw, prefix) == []
        assert (remote.stats.puts, remote.stats.put_bytes) == (5, 5 * layout.payload_bytes)
        assert reads_back(reader.tiers[-1], keys[:5], layout, payloads)

        more, more_payloads, _ = make_pages(layout, 2, seed=52)
        with store.open_session(more, [layout] * 2, streamed=True) as session:
            _fill(session, more_payloads, layout)
            _wait(lambda: len(_staged(raw, prefix)) == 2, "staged")
            session.abort()
        _wait(lambda: _staged(raw, prefix) == [], "the aborted step's staging keys deleted")
        assert remote.contains(more) == [False, False]
        assert remote.stats.errors == 0


def test_a_streamed_page_keeps_the_tiers_expiry_and_a_lost_staging_key_costs_only_its_page(redis_node, layout,
                                                                                          monkeypatch):
    """With ``remote.ttl`` a streamed page expires as a written one does (without it, never: the
    staging key's own expiry does not follow the page). A staging key Redis dropped (evicted under
    ``maxmemory``) costs only its page's bytes again: mid-step, the next range finds the length wrong
    and the page goes whole at the commit; after the last range, the rename fails and the page is
    written through whole. Either way every page reads back right."""
    prefix = f"rt{time.monotonic_ns()}:"
    raw = raw_redis(redis_node.url)
    writes = _writes(monkeypatch)
    keys, payloads, _ = make_pages(layout, 3, seed=53)
    with _store(redis_node.url, prefix, ttl=600) as store:
        with store.open_session(keys, [layout] * 3, streamed=True) as session:
            a, b = layout.layer_range(0)
            for i, p in enumerate(payloads):
                session.buffer(i)[a:b] = p[a:b]
            session.filled([0, 1, 2], a, b)
            _wait(lambda: len(_staged(raw, prefix)) == 3, "staged")
            staged = {i: next(s for s in _staged(raw, prefix) if store.tiers[-1]._names(k)[1][:-2] in s)
                      for i, k in enumerate(keys)}
            raw.delete(staged[1])  # (as an eviction would)
            for layer in range(1, layout.num_layers):
                a, b = layout.layer_range(layer)
                for i, p in enumerate(payloads):
                    session.buffer(i)[a:b] = p[a:b]
                session.filled([0, 1, 2], a, b)
            _wait(lambda: raw.strlen(staged[2]) == layout.payload_bytes, "the last layer staged")
            raw.delete(staged[2])
            session.commit()
        session.written_through.result()
        assert writes == [1]  # (the page whose staging key went after its last range, whole)
        assert _staged(raw, prefix) == []
        for k in keys:
            h, p = store.tiers[-1]._names(k)
            assert 0 < raw.pttl(p) <= 600_000 and 0 < raw.pttl(h) <= 600_000
        store.memory.delete(keys)
        assert reads_back(store, keys, layout, payloads)
    more, more_payloads, _ = make_pages(layout, 1, seed=54)
    with _store(redis_node.url, prefix) as store:
        with store.open_session(more, [layout], streamed=True) as session:
            _fill(session, more_payloads, layout)
            session.commit()
        session.written_through.result()
        assert raw.pttl(store.tiers[-1]._names(more[0])[1]) == -1  # (no expiry)
    with _store(redis_node.url, prefix, stream_stores=False) as store:
        with store.open_session(more, [layout], streamed=True) as session:
            assert not session.streaming
