"""The Redis tier against a real redis-server and a real three-node Redis Cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import make_pages, random_key, raw_redis

from lmkv.config import ConfigError, RemoteConfig, load_config
from lmkv.dev.redis_server import free_port, start_redis
from lmkv.errors import TierUnavailableError
from lmkv.store import TieredStore
from lmkv.tiers.factory import open_remote
from lmkv.tiers.redis import RedisTier


@pytest.fixture(params=["node", "cluster"])
def tier(request):
    url = (request.getfixturevalue("redis_node") if request.param == "node"
           else request.getfixturevalue("redis_cluster")).url
    t = RedisTier(RemoteConfig(url=url, key_prefix=f"t{time.monotonic_ns()}:"))
    yield t
    t.close()


def test_roundtrip_ranges_delete(tier, layout):
    keys, payloads, pages = make_pages(layout, 5)
    assert tier.put(pages, "engine") == [True] * 5
    assert tier.contains(keys + [random_key()]) == [True] * 5 + [False]
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    headers = tier.get(keys, layout, outs)
    assert [h.key for h in headers] == keys
    for o, p in zip(outs, payloads):
        assert np.array_equal(o, p)
    # a layerwise read: layer 2 only, at its page offsets
    rng = layout.layer_range(2)
    out = np.zeros(layout.payload_bytes, np.uint8)
    assert tier.read_ranges(keys[0], layout, [rng], out) is not None
    assert np.array_equal(out[rng[0]:rng[1]], payloads[0][rng[0]:rng[1]])
    assert not out[: rng[0]].any()
    assert tier.delete(keys[:2]) == 2
    assert tier.contains(keys) == [False, False, True, True, True]
    assert tier.stats.hits == 5 and tier.stats.puts == 5  # (a range inside a page read already is no new hit)


def test_flipped_byte_in_redis_is_a_miss_and_dropped(tier, layout):
    keys, payloads, pages = make_pages(layout, 2)
    tier.put(pages, "engine")
    raw = raw_redis(tier.cfg.url)
    name = tier._names(keys[0])[1]
    b = raw.getrange(name, 1000, 1000)
    raw.setrange(name, 1000, bytes([b[0] ^ 0x10]))
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    got = tier.get(keys, layout, outs)
    assert got[0] is None and got[1] is not None
    assert tier.stats.corrupt == 1
    assert tier.contains(keys) == [False, True]  # the bad page was deleted


def test_payload_evicted_but_header_left_is_a_miss(tier, layout):
    keys, _, pages = make_pages(layout, 1)
    tier.put(pages, "engine")
    raw_redis(tier.cfg.url).delete(tier._names(keys[0])[1])
    assert tier.get(keys, layout, [np.zeros(layout.payload_bytes, np.uint8)]) == [None]
    assert tier.contains(keys) == [False]


def test_truncated_payload_and_foreign_layout_are_misses(tier, layout, mamba_layout):
    keys, _, pages = make_pages(layout, 1)
    tier.put(pages, "engine")
    raw_redis(tier.cfg.url).set(tier._names(keys[0])[1], b"short")
    assert tier.get(keys, layout, [np.zeros(layout.payload_bytes, np.uint8)]) == [None]
    keys, _, pages = make_pages(layout, 1, seed=5)
    tier.put(pages, "engine")
    # the same key asked for as another model's layout: refused by the header check
    assert tier.get(keys, mamba_layout, [np.zeros(mamba_layout.payload_bytes, np.uint8)]) == [None]
    assert tier.stats.corrupt == 2


def test_ttl_expiry_is_a_miss(redis_node, layout):
    t = RedisTier(RemoteConfig(url=redis_node.url, ttl=0.3, key_prefix="ttl:"))
    keys, _, pages = make_pages(layout, 2)
    t.put(pages, "engine")
    assert t.contains(keys) == [True, True]
    time.sleep(0.6)
    assert t.contains(keys) == [False, False]
    assert t.get(keys, layout, [np.zeros(layout.payload_bytes, np.uint8)] * 2) == [None, None]
    t.close()


def test_maxmemory_eviction_loses_nothing_it_serves(layout):
    """A Redis with a 4 MiB limit evicting under allkeys-lru: every page served is intact."""
    with start_redis(maxmemory="4mb") as r:
        t = RedisTier(RemoteConfig(url=r.url))
        keys, payloads, pages = make_pages(layout, 200)  # 12.5 MiB of pages
        for i in range(0, 200, 10):
            t.put(pages[i : i + 10], "engine")
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        got = t.get(keys, layout, outs)
        served = [i for i, h in enumerate(got) if h is not None]
        assert 0 < len(served) < 200
        for i in served:
            assert np.array_equal(outs[i], payloads[i])
        assert t.stats.corrupt == 0
        t.close()


def test_password_from_config(layout):
    with start_redis(password="s3cret") as r:
        good = RedisTier(RemoteConfig(url=r.url, password="s3cret"))
        keys, _, pages = make_pages(layout, 1)
        assert good.put(pages, "engine") == [True]
        bad = RedisTier(RemoteConfig(url=r.url, password="wrong", timeout=1))
        with pytest.raises(TierUnavailableError):
            bad.contains(keys)
        good.close()
        bad.close()


def test_backend_down_at_start_then_up(layout):
    """The store starts and serves without Redis; once Redis is up, the tier is used again."""
    port = free_port()
    cfg = load_config({"remote": {"url": f"redis://127.0.0.1:{port}", "connect_timeout": 0.2, "timeout": 0.5}},
                      environ={})
    with TieredStore(cfg) as store:
        keys, payloads, _ = make_pages(layout, 2)
        assert store.lookup(keys).pages == 0  # no exception: a miss
        t0 = time.monotonic()
        assert store.lookup(keys).pages == 0
        assert time.monotonic() - t0 < 0.1  # known down: fails fast, no timeout per call
        remote = store.tiers[-1]
        assert not remote.health.up
        with start_redis(port=port):
            deadline = time.monotonic() + 10
            while not remote.health.up and time.monotonic() < deadline:
                time.sleep(0.05)
            assert remote.health.up
            store.put(keys, [layout] * 2, payloads)
            store.drain()
            assert remote.contains(keys) == [True, True]


def test_redis_stopped_midway_is_a_miss(layout):
    r = start_redis()
    cfg = load_config({"remote": {"url": r.url, "timeout": 1}}, environ={})
    with TieredStore(cfg) as store:
        keys, payloads, _ = make_pages(layout, 2)
        store.put(keys, [layout] * 2, payloads)
        store.drain()
        store.memory.delete(keys)
        assert store.lookup(keys).tiers == ("redis", "redis")
        r.stop()
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert store.get(keys, layout, outs) == [None, None]
        assert store.tiers[-1].stats.errors >= 1


def test_store_shares_pages_through_redis(redis_cluster, layout):
    """Two stores (two engines) over one cluster: the second is served what the first wrote."""
    cfg = load_config({"remote": {"url": redis_cluster.url, "key_prefix": "share:"}}, environ={})
    keys, payloads, _ = make_pages(layout, 6)
    with TieredStore(cfg) as a:
        a.put(keys, [layout] * 6, payloads)
    with TieredStore(cfg) as b:
        assert b.lookup(keys).tiers == ("redis",) * 6
        with b.fetch(keys, layout) as f:
            for v, p in zip(f.views, payloads):
                assert np.array_equal(v, p)
        assert b.lookup(keys).tiers == ("memory",) * 6  # promoted on the load


def test_bad_urls_are_config_errors():
    with pytest.raises(ConfigError, match="unknown scheme 'http'"):  # (refused by the configuration itself)
        load_config({"remote": {"url": "http://x"}}, environ={})
    with pytest.raises(ConfigError, match="host:port"):
        open_remote(RemoteConfig(url="redis-cluster://nohostport"))


def test_tls(tmp_path, layout):
    import subprocess

    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    with start_redis(tls=(cert, key)) as r:
        assert r.url.startswith("rediss://")
        t = RedisTier(RemoteConfig(url=r.url, tls_ca=cert))
        keys, payloads, pages = make_pages(layout, 3)
        assert t.put(pages, "engine") == [True] * 3
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in t.get(keys, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
        t.close()
        untrusted = RedisTier(RemoteConfig(url=r.url, timeout=1))  # the system CAs do not know this certificate
        with pytest.raises(TierUnavailableError):
            untrusted.contains(keys)
        untrusted.close()


def test_lmkv_server_with_redis_beneath(redis_node, layout):
    """lmkv serve holding memory with Redis beneath: what clients put reaches Redis, and a
    restarted server (memory empty) serves it back from Redis."""
    from lmkv.dev.server_process import spawn
    from lmkv.tiers.server_client import ServerTier

    env = {"LMKV_REMOTE__URL": redis_node.url, "LMKV_REMOTE__KEY_PREFIX": "beneath:"}
    keys, payloads, pages = make_pages(layout, 4)
    with spawn("--memory", "64MiB", env=env) as s:
        c = ServerTier(RemoteConfig(url=s.url))
        assert c.put(pages, "engine") == [True] * 4
        deadline = time.monotonic() + 10  # the server copies down to Redis in the background
        while c.server_stats()["redis"]["puts"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.server_stats()["redis"]["puts"] == 4
        c.close()
    with spawn("--memory", "64MiB", env=env) as s:
        c = ServerTier(RemoteConfig(url=s.url))
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in c.get(keys, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
        assert c.server_stats()["redis"]["hits"] == 4
        c.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_memory_evictions_never_write_a_page_to_redis_twice(redis_node, layout, policy):
    """200 pages through a memory tier of 8: Redis takes each page once. Under write-through, a
    demotion used to rewrite every evicted page (twice the network traffic)."""
    cfg = load_config({"memory": {"capacity": 8 * layout.payload_bytes, "slab_size": 2 * layout.payload_bytes},
                       "store": {"write_policy": policy},
                       "remote": {"url": redis_node.url, "key_prefix": f"twice-{policy}:"}}, environ={})
    keys, payloads, _ = make_pages(layout, 200)
    with TieredStore(cfg) as store:
        for i in range(0, 200, 4):
            store.put(keys[i : i + 4], [layout] * 4, payloads[i : i + 4])
            store.drain()
        redis = store.tiers[-1]
        with store.fetch(keys[:8], layout) as f:  # promoted back into memory, then evicted again
            assert all(h is not None for h in f.headers)
        fresh, more, _ = make_pages(layout, 8, seed=900)
        store.put(fresh, [layout] * 8, more)  # evicts the promoted 8, which Redis holds already
        store.drain()
        written = redis.stats.puts
    # write-through: each page once as it is put; write-back: each page once as memory evicts it
    # (the 8 fresh ones are still in memory)
    assert written == (208 if policy == "write_through" else 200)


def test_a_large_write_is_published_a_part_at_a_time(redis_node, layout, monkeypatch):
    """Headers (what makes a page visible) go after each few MiB of payloads, not after the whole
    write: a P/D consumer pulls a prompt's first pages while the rest are on their way."""
    import redis.asyncio.client as aclient

    from lmkv.tiers import remote

    monkeypatch.setattr(remote, "PUBLISH_BYTES", 3 * layout.payload_bytes)
    published: list[int] = []
    execute = aclient.Pipeline.execute

    async def counted(self, *a, **kw):
        published.append(len(self.command_stack))
        return await execute(self, *a, **kw)

    monkeypatch.setattr(aclient.Pipeline, "execute", counted)
    t = RedisTier(RemoteConfig(url=redis_node.url, key_prefix=f"t{time.monotonic_ns()}:"))
    try:
        keys, payloads, pages = make_pages(layout, 8)
        assert t.put(pages, "engine") == [True] * 8
        assert published == [3, 3, 2]
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert all(h is not None for h in t.get(keys, layout, outs))
        assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
    finally:
        t.close()
