"""The Redis tier: single node, Redis Cluster or Valkey, through redis-py's asyncio client.

Each page is two keys that share a hash tag, so both land on one cluster slot::

    <prefix>{<key hex>}:p   payload (layers one after another, page.py's layout)
    <prefix>{<key hex>}:h   packed header, written after the payload

A page exists when its header does; a reader that finds the header but not the
payload (Redis evicted one of the two under ``maxmemory``) gets a miss, and the
orphan is deleted. Pages are content-addressed (a key names one content), so
concurrent writers of one page write the same bytes and need no transaction.
A layerwise load reads a layer with ``GETRANGE`` on the payload key. Because a
key names one content, headers are cached client-side once seen: a read whose
header is cached is one command (``GET`` or ``GETRANGE`` of the payload), and a
page that is gone comes back empty and is a miss.

Expiry (``remote.ttl``) and memory limits are Redis's job: lmkv reads what is
there and treats what is not as a miss. Redis pages have no residency domain:
Redis is a shared tier whose pages live until Redis expires or evicts them,
so clearing one engine's domain leaves them in place.

The tier's synchronous methods (what :class:`~lmkv.store.TieredStore` calls from
its I/O threads) run coroutines of redis-py's asyncio client on one event-loop
thread; its pool gives each concurrent batch its own connection. Bulk reads
are the exception: they use redis-py's blocking client from the calling thread,
because on 2 MiB values it measured 1.4-1.5x faster than the asyncio client
here (asyncio's stream reader copies each value several times), while asyncio
measured faster for writes. Every operation has a deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis import exceptions as rexc

from lmkv.config import ConfigError, RemoteConfig
from lmkv.errors import PageError, TierUnavailableError
from lmkv.keys import PageKey, key_hex
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, as_bytes_view, unpack_header
from lmkv.tiers.base import Range
from lmkv.tiers.remote import RemoteTier

#: packed headers kept client-side (about 200 bytes each for an 8-layer page)
HEADER_CACHE = 65536

_UNREACHABLE = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError, rexc.RedisClusterException,
                asyncio.TimeoutError, OSError)


def _tls_kwargs(cfg: RemoteConfig) -> dict:
    return {
        "ssl_ca_certs": cfg.tls_ca,
        "ssl_cert_reqs": "required" if cfg.tls_verify else "none",
        "ssl_check_hostname": cfg.tls_verify,
    }


def _cluster_retry(asyncio_client: bool):
    """A few immediate retries, for what a cluster answers while slots move (MOVED, TRYAGAIN,
    CLUSTERDOWN); lmkv's own health check decides when to try an unreachable backend again."""
    from redis.backoff import NoBackoff

    if asyncio_client:
        from redis.asyncio.retry import Retry as AsyncRetry

        return AsyncRetry(NoBackoff(), 3)
    from redis.retry import Retry

    return Retry(NoBackoff(), 3)


def make_client(cfg: RemoteConfig, asyncio_client: bool = True):
    """A redis-py client for ``cfg.url``, asyncio or blocking (no connection is made here)."""
    url = cfg.url or ""
    common: dict[str, Any] = dict(
        socket_timeout=cfg.timeout,
        socket_connect_timeout=cfg.connect_timeout,
        username=cfg.username,
        password=cfg.password,
    )
    common = {k: v for k, v in common.items() if v is not None}
    parts = urlsplit(url)
    if parts.scheme in ("redis-cluster", "rediss-cluster"):
        netloc = parts.netloc
        creds, _, hosts = netloc.rpartition("@")
        if creds:
            user, _, pw = creds.partition(":")
            common.setdefault("username", unquote(user) or None)
            common.setdefault("password", unquote(pw) or None)
        nodes = []
        for hp in filter(None, hosts.split(",")):
            host, _, port = hp.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"remote.url = {url!r}: expected host:port[,host:port...] after redis-cluster://")
            nodes.append((host.strip("[]"), int(port)))
        if not nodes:
            raise ConfigError(f"remote.url = {url!r}: no cluster nodes given")
        tls = _tls_kwargs(cfg) if parts.scheme == "rediss-cluster" else {}
        mod = acluster if asyncio_client else scluster
        return mod.RedisCluster(startup_nodes=[mod.ClusterNode(h, p) for h, p in nodes], ssl=bool(tls),
                                max_connections=cfg.max_connections, require_full_coverage=False,
                                retry=_cluster_retry(asyncio_client), socket_read_size=1 << 20, **tls, **common)
    tls = _tls_kwargs(cfg) if parts.scheme == "rediss" else {}
    cls = aredis.Redis if asyncio_client else redis.Redis
    return cls.from_url(url, max_connections=cfg.max_connections, socket_read_size=1 << 20, **tls, **common)


class RedisTier(RemoteTier):
    def __init__(self, cfg: RemoteConfig, name: str = "redis") -> None:
        super().__init__(name, cfg)
        self.cluster = urlsplit(cfg.url or "").scheme.endswith("-cluster")
        self._prefix = cfg.key_prefix
        self._px = int(cfg.ttl * 1000) if cfg.ttl else None
        self._headers: OrderedDict[bytes, PageHeader] = OrderedDict()
        self._headers_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmkv-redis", daemon=True)
        self._thread.start()
        self._client = self._run_plain(self._make_client(), cfg.connect_timeout + 1)
        self._reader = make_client(cfg, asyncio_client=False)

    async def _make_client(self):
        return make_client(self.cfg)

    # -- running coroutines from the store's threads ------------------------------

    def _run_plain(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _run(self, coro):
        """Run one operation with the configured deadline; unreachable -> TierUnavailableError."""
        async def bounded():
            return await asyncio.wait_for(coro, self.cfg.timeout)

        try:
            return self._run_plain(bounded(), self.cfg.timeout + 1)
        except _UNREACHABLE as err:
            raise TierUnavailableError(f"{self.name}: {type(err).__name__}: {err}") from err
        except TimeoutError as err:  # concurrent.futures timeout: the loop itself is stuck
            raise TierUnavailableError(f"{self.name}: no answer in {self.cfg.timeout} s") from err

    def _names(self, key: PageKey) -> tuple[bytes, bytes]:
        tag = f"{self._prefix}{{{key_hex(key)}}}"
        return (tag + ":h").encode(), (tag + ":p").encode()

    # -- primitives ----------------------------------------------------------

    def _ping(self) -> None:
        self._run(self._client.ping())

    def _exists(self, keys: Sequence[PageKey]) -> list[bool]:
        async def run():
            async with self._client.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.exists(self._names(k)[0])
                return [bool(n) for n in await pipe.execute()]

        return self._run(run())

    def _cached_header(self, key: PageKey) -> PageHeader | None:
        with self._headers_lock:
            h = self._headers.get(key)
            if h is not None:
                self._headers.move_to_end(key)
            return h

    def _remember(self, key: PageKey, header: PageHeader | None) -> None:
        with self._headers_lock:
            if header is None:
                self._headers.pop(key, None)
                return
            self._headers[key] = header
            if len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)

    def _read(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
              ranges: Sequence[Range] | None) -> list:
        try:
            return [self._read_one(k, layout, o, ranges) for k, o in zip(keys, outs)]
        except _UNREACHABLE as err:
            raise TierUnavailableError(f"{self.name}: {type(err).__name__}: {err}") from err

    def _read_one(self, key: PageKey, layout: GroupLayout, out, ranges: Sequence[Range] | None):
        h, p = self._names(key)
        want = [(0, layout.payload_bytes)] if ranges is None else list(ranges)
        header = self._cached_header(key)
        if header is None or len(want) > 1:
            pipe = self._reader.pipeline(transaction=False)
            if header is None:
                pipe.get(h)
            for a, b in want:
                pipe.getrange(p, a, b - 1) if ranges is not None else pipe.get(p)
            replies = pipe.execute()
            if header is None:
                header, *replies = replies
                if header is None:
                    return None
        elif ranges is None:
            replies = [self._reader.get(p)]
        else:
            replies = [self._reader.getrange(p, want[0][0], want[0][1] - 1)]
        if not replies[0]:  # gone, or Redis evicted the payload but not the header
            self._remember(key, None)
            self._reader.delete(h, p)
            return None
        dst = as_bytes_view(out)
        for (a, b), part in zip(want, replies):
            if len(part) != b - a:
                self._remember(key, None)
                return b""  # a short page: the header check rejects it
            dst[a:b] = part
        if not isinstance(header, PageHeader):
            try:
                header = unpack_header(header, expect_key=key, layout=layout)
            except PageError:
                return header  # the caller's check counts and drops it
        self._remember(key, header)
        return header

    def _write(self, pages: Sequence[tuple[PageHeader, memoryview]], domain: str) -> list[bool]:
        """Payloads one ``SET`` at a time (measured faster than pipelining many 2 MiB values, and it
        bounds what the client buffers), then every header in one pipeline: a page becomes
        visible only once its payload is there."""
        async def run():
            ok: list[bool] = []
            for h, payload in pages:
                try:
                    ok.append(await self._client.set(self._names(h.key)[1], payload, px=self._px) is True)
                except rexc.ResponseError as err:
                    self._refused(err)
                    ok.append(False)
            todo = [h for h, good in zip((h for h, _ in pages), ok) if good]
            if todo:
                async with self._client.pipeline(transaction=False) as pipe:
                    for h in todo:
                        pipe.set(self._names(h.key)[0], h.pack(), px=self._px)
                    replies = iter(await pipe.execute(raise_on_error=False))
                for i, good in enumerate(ok):
                    if good:
                        r = next(replies)
                        if r is True:
                            self._remember(pages[i][0].key, pages[i][0])
                        else:
                            self._refused(r)
                            ok[i] = False
            return ok

        return self._run(run())

    def _refused(self, reply) -> None:
        """Count a write Redis refused: full (``maxmemory`` with noeviction) or another error."""
        if isinstance(reply, rexc.ResponseError) and "OOM" in str(reply):
            self.stats.full += 1
        else:
            self.stats.errors += 1

    def _delete(self, keys: Sequence[PageKey]) -> int:
        async def run():
            async with self._client.pipeline(transaction=False) as pipe:
                for k in keys:
                    self._remember(k, None)
                    pipe.delete(*self._names(k))
                return sum(1 for n in await pipe.execute() if n)

        return self._run(run())

    def _clear(self, domain: str) -> int:
        """Redis pages belong to no engine's domain (see the module docstring): nothing to drop."""
        return 0

    def _fetch_usage(self) -> tuple[int, int, int]:
        async def run():
            if self.cluster:
                nodes = self._client.get_primaries()
                infos = [await self._client.info("memory", target_nodes=n) for n in nodes]
                sizes = [await self._client.dbsize(target_nodes=n) for n in nodes]
            else:
                infos = [await self._client.info("memory")]
                sizes = [await self._client.dbsize()]
            used = sum(int(i.get("used_memory", 0)) for i in infos)
            cap = sum(int(i.get("maxmemory", 0)) for i in infos)
            return used, cap, sum(sizes) // 2

        return self._run(run())

    def close(self) -> None:
        super().close()
        try:
            self._run_plain(self._client.aclose(), 2)
        except Exception:  # closing a client whose server is gone must not fail shutdown
            pass
        self._reader.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2)
