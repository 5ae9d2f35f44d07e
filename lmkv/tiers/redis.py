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

On a cluster, the blocking client's slot map says which node serves a key;
writes, existence checks and deletes go to each node through a plain asyncio
client of that node's own. redis-py's asyncio cluster client is not used: when
one node fails it closes every node's connections to re-read the map, which
broke commands in flight to the surviving nodes (they timed out, and their
slots were taken for down). A slot that moved (a ``MOVED`` reply, after a manual
failover or a reshard) makes the tier read the map again and retry its pages once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aredis
import redis.cluster as scluster
from redis import exceptions as rexc

from lmkv import threads
from lmkv.config import ConfigError, RemoteConfig
from lmkv.errors import PartlyStoredError, TierUnavailableError
from lmkv.keys import PageKey, key_hex
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, as_bytes_view, units_in_ranges
from lmkv.tiers import remote
from lmkv.tiers.base import Range
from lmkv.tiers.header_cache import HeaderCache
from lmkv.tiers.put_stream import StepPutStream
from lmkv.tiers.redis_nodes import ClusterNodes
from lmkv.tiers.redis_puts import RedisPutTarget, redis_session, staging_ttl_ms
from lmkv.tiers.redis_reads import AHEAD, read_pipelined
from lmkv.tiers.remote import Checked, RemoteTier, batches

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


def _no_retry():
    """Blocking commands are not retried by redis-py: each retry of a node that hangs costs a
    timeout, while lmkv's health (per node on a cluster) turns its pages into misses at the first
    failure and finds it again (or the replica that took its slots) in the background."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def _cluster(cfg: RemoteConfig) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """A cluster URL's startup nodes, and the keyword arguments of a client of any of its nodes."""
    url = cfg.url or ""
    parts = urlsplit(url)
    creds, _, hosts = parts.netloc.rpartition("@")
    kwargs = _common_kwargs(cfg)
    if creds:
        user, _, pw = creds.partition(":")
        kwargs.setdefault("username", unquote(user) or None)
        kwargs.setdefault("password", unquote(pw) or None)
    nodes = []
    for hp in filter(None, hosts.split(",")):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"remote.url = {url!r}: expected host:port[,host:port...] after redis-cluster://")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ConfigError(f"remote.url = {url!r}: no cluster nodes given")
    tls = _tls_kwargs(cfg) if parts.scheme == "rediss-cluster" else {}
    return nodes, {**kwargs, **tls, "ssl": bool(tls)}


def _common_kwargs(cfg: RemoteConfig) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        socket_timeout=cfg.timeout,
        socket_connect_timeout=cfg.connect_timeout,
        username=cfg.username,
        password=cfg.password,
        max_connections=cfg.max_connections,
        socket_read_size=1 << 20,
    )
    return {k: v for k, v in common.items() if v is not None}


def is_cluster(cfg: RemoteConfig) -> bool:
    return urlsplit(cfg.url or "").scheme in ("redis-cluster", "rediss-cluster")


def make_client(cfg: RemoteConfig, asyncio_client: bool = True):
    """A redis-py client for ``cfg.url`` (no connection is made here): on one node asyncio or
    blocking; on a cluster the blocking cluster client (the asyncio side uses :func:`node_client`)."""
    if is_cluster(cfg):
        nodes, kwargs = _cluster(cfg)
        return scluster.RedisCluster(startup_nodes=[scluster.ClusterNode(h, p) for h, p in nodes],
                                     require_full_coverage=False, retry=_no_retry(), **kwargs)
    tls = _tls_kwargs(cfg) if urlsplit(cfg.url or "").scheme == "rediss" else {}
    if asyncio_client:  # (each call runs under its own deadline: asyncio.wait_for)
        return aredis.Redis.from_url(cfg.url or "", **tls, **_common_kwargs(cfg))
    # (redis-py's default retries a connect up to 3 times with backoff: a server that accepts and never
    # answers would hold a read for several timeouts, where lmkv's health makes it a miss at the first)
    return redis.Redis.from_url(cfg.url or "", retry=_no_retry(), **tls, **_common_kwargs(cfg))


def node_client(node: str, kwargs: dict[str, Any]) -> aredis.Redis:
    """An asyncio client of one cluster node (``host:port``), with connections of its own; ``kwargs``:
    the cluster's (:func:`_cluster`)."""
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff

    host, _, port = node.rpartition(":")
    return aredis.Redis(host=host.strip("[]"), port=int(port), retry=AsyncRetry(NoBackoff(), 0), **kwargs)


class RedisTier(RemoteTier):
    """Redis, Redis Cluster or Valkey as a tier: a payload key and a header key per page, one hash slot.

    Thread-safe: reads run on the caller's thread on redis-py's blocking client; writes and
    cluster calls on an asyncio loop of its own, each node with its own client and health.
    Connects lazily (an engine starts while Redis is down); :meth:`close` stops the loop."""

    #: a Redis node runs commands on one thread: a load's layer requests go one at a time (measured,
    #: 124 pages of 4 MiB at two in flight: the first layer landed with the last, the forward waited
    #: 0.18-0.48 s for it; one at a time: 0.04-0.14 s, D's load-to-first-token 0.31-0.71 s from 0.33-1.07 s)
    serves_in_order = True

    def __init__(self, cfg: RemoteConfig, name: str = "redis") -> None:
        super().__init__(name, cfg)
        self.cluster = is_cluster(cfg)
        #: a cluster node's client's settings (parsed now: a bad URL is a config error here, not at first use)
        self._node_kwargs = _cluster(cfg)[1] if self.cluster else {}
        self._prefix = cfg.key_prefix
        self._px = int(cfg.ttl * 1000) if cfg.ttl else None
        self._headers = HeaderCache(HEADER_CACHE)
        self._loop = asyncio.new_event_loop()
        self._thread = threads.start(self._loop.run_forever, "lmkv-redis")
        self._client: Any = None if self.cluster else self._run_plain(self._make_client(), cfg.connect_timeout + 1)
        self._node_clients: dict[str, aredis.Redis] = {}  # cluster: per node, used on the loop thread only
        self._reader_made: Any = None  # redis.Redis or redis.cluster.RedisCluster, made by _reader()
        self._reader_lock = threading.Lock()
        self.nodes = ClusterNodes(name, self._reader) if self.cluster else None
        self._streamer = threads.pool(remote.STREAMS_OPEN, f"lmkv-{name}-stream")  # (a thread a stream)
        if not self.cluster:
            self._reader()

    async def _make_client(self):
        return make_client(self.cfg)

    def _reader(self):
        """The blocking client, made at first use: a cluster client asks for the slot map as it
        is made, so an engine that starts while the cluster is down makes it once it is up."""
        with self._reader_lock:
            if self._reader_made is None:
                try:
                    self._reader_made = make_client(self.cfg, asyncio_client=False)
                except _UNREACHABLE as err:
                    raise self._unreachable(err) from err
            return self._reader_made

    def stream(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
               domain: str) -> StepPutStream | None:
        """A step's pages staged in Redis layer by layer from ``bufs`` (their memory slots) as they fill,
        renamed into place when it commits (:mod:`lmkv.tiers.redis_puts`); None where it cannot be:
        ``remote.stream_stores`` off, the tier down, or :data:`~lmkv.tiers.remote.STREAMS_OPEN` streaming."""
        if not self.cfg.stream_stores or not keys or not self.health.up or not self._stream_slot(remote.STREAMS_OPEN):
            return None
        target = RedisPutTarget(keys, bufs, self._names, self._per_node, self._px, staging_ttl_ms(self.cfg.timeout),
                                self._headers, self._refused)
        return StepPutStream(self.name, keys, layouts, bufs, redis_session(target), self._call, self.cfg.timeout,
                             self._streamer.submit, self._stream_closed, self.stats)

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
            raise self._unreachable(err) from err
        except TimeoutError as err:  # concurrent.futures timeout: the loop itself is stuck
            raise TierUnavailableError(f"{self.name}: no answer in {self.cfg.timeout} s") from err

    def _per_node(self, names: Sequence[bytes], job: Callable[[Any, list[int]], Awaitable[list]]) -> dict[int, Any]:
        """``job(client, indices)`` once per node serving some of ``names``, concurrently, each with
        its own client and deadline; per index, what its node's job returned. Indices on a node
        that is down, or that fails now (and is marked down), are left out; those on a node that
        answers ``MOVED`` are grouped again by a fresh slot map and tried once more, all within the
        one deadline (``remote.timeout``): what is not done by then is left out. Without a
        cluster: one job, and a failure raises (the tier's own health takes it)."""
        if self.nodes is None:
            every = list(range(len(names)))
            return dict(zip(every, self._run(job(self._client, every))))

        async def run(groups: dict[str, list[int]], timeout: float):
            return await asyncio.gather(*(self._on_node(node, job, idx, timeout=timeout)
                                          for node, idx in groups.items()))

        deadline = time.monotonic() + self.cfg.timeout
        out: dict[int, Any] = {}
        todo = list(range(len(names)))
        for attempt in range(2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            groups = {node: [todo[j] for j in idx]
                      for node, idx in self.nodes.group([names[i] for i in todo]).items()}
            try:
                results = self._run_plain(run(groups, left), left + 1)
            except TimeoutError as err:
                raise TierUnavailableError(f"{self.name}: no answer in {self.cfg.timeout} s") from err
            todo = []
            for (node, idx), res in zip(groups.items(), results):
                if isinstance(res, rexc.MovedError) and attempt == 0:
                    todo += idx
                elif isinstance(res, BaseException):
                    self.stats.errors += 1
                    self.nodes.failed(node, res)
                else:
                    out.update(zip(idx, res))
            if not todo or not self.nodes.refresh(deadline - time.monotonic()):
                break
        return out

    async def _on_node(self, node: str, call: Callable[..., Awaitable], *args: Any, timeout: float | None = None):
        """``call(client, *args)`` with ``node``'s own client and a deadline (the tier's unless
        ``timeout``); what makes the node unreachable, or a ``MOVED`` reply, is returned, not raised."""
        try:
            client = self._node_clients.get(node)
            if client is None:
                client = self._node_clients[node] = node_client(node, self._node_kwargs)
            return await asyncio.wait_for(call(client, *args), self.cfg.timeout if timeout is None else timeout)
        except (*_UNREACHABLE, rexc.MovedError) as err:
            return err

    def _primaries(self, call: Callable[[Any], Awaitable]) -> list:
        """What ``call(client)`` returns on each primary of the cluster that answers."""
        nodes = [n.name for n in self._reader().get_primaries()]

        async def run():
            return await asyncio.gather(*(self._on_node(n, call) for n in nodes))

        return [res for res in self._run_plain(run(), self.cfg.timeout + 1) if not isinstance(res, BaseException)]

    def node_of(self, key: PageKey) -> str | None:
        """The cluster node (``host:port``) serving ``key``'s page now; ``None`` on one node."""
        return self.nodes.node_of(self._names(key)[0]) if self.nodes is not None else None

    def _unreachable(self, err: BaseException) -> TierUnavailableError:
        return TierUnavailableError(f"{self.name}: {type(err).__name__}: {err}")

    def _names(self, key: PageKey) -> tuple[bytes, bytes]:
        tag = f"{self._prefix}{{{key_hex(key)}}}"
        return (tag + ":h").encode(), (tag + ":p").encode()

    # -- primitives ----------------------------------------------------------

    def _ping(self) -> None:
        if self.cluster:  # the tier is up when some node answers; each node has its own health
            try:
                self._reader().ping(target_nodes=scluster.RedisCluster.RANDOM)
            except _UNREACHABLE as err:
                raise self._unreachable(err) from err
            return
        self._run(self._client.ping())

    def _exists(self, keys: Sequence[PageKey]) -> list[bool]:
        names = [self._names(k)[0] for k in keys]

        async def job(client, idx: list[int]) -> list[bool]:
            async with client.pipeline(transaction=False) as pipe:
                for i in idx:
                    pipe.exists(names[i])
                return [bool(n) for n in await pipe.execute()]

        found = self._per_node(names, job)
        return [found.get(i, False) for i in range(len(keys))]

    def _read(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
              ranges: Sequence[Range] | None) -> list:
        """Every page's ranges (or whole payload) pipelined, each reply received straight into its
        page's buffer (:mod:`lmkv.tiers.redis_reads`); on a cluster, each node's pages on its own
        connection, a node that fails costing only its pages."""
        reader = self._reader()
        if self.nodes is None:
            try:
                return self._read_pages(reader.connection_pool, keys, layout, outs, ranges)
            except _UNREACHABLE as err:
                raise self._unreachable(err) from err
        got: list = [None] * len(keys)  # a page on a down node is a miss; the others are read
        for node, idx in self.nodes.group([self._names(k)[0] for k in keys]).items():
            try:
                pool = reader.get_redis_connection(reader.get_node(node_name=node)).connection_pool
                for i, r in zip(idx, self._read_pages(pool, [keys[i] for i in idx], layout, [outs[i] for i in idx],
                                                      ranges)):
                    got[i] = r
            except _UNREACHABLE as err:  # this node's pages are misses
                self.stats.errors += 1
                self.nodes.failed(node, err)
        return got

    def _read_pages(self, pool, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
                    ranges: Sequence[Range] | None) -> list:
        """Pages (or their ``ranges``), with the headers not cached yet, in one stream of commands sent
        in chunks, each page verified as soon as its replies are in while Redis sends the next. Redis
        holds the replies of the chunks sent ahead too (:data:`~lmkv.tiers.redis_reads.AHEAD`), so a
        chunk is that share of :data:`~lmkv.tiers.remote.PUBLISH_BYTES`: what Redis buffers for one
        read stays within it (its clients' buffers count against ``maxmemory``: more would evict pages)."""
        want = [(0, layout.payload_bytes)] if ranges is None else list(ranges)
        units = units_in_ranges(layout, want) if self.verifies else None
        headers: list = self._headers.get(keys)
        names = [self._names(k) for k in keys]
        per_page = sum(b - a for a, b in want)
        chunks: list[list[tuple]] = []
        sinks: list = []
        for r in batches([per_page] * len(keys), remote.PUBLISH_BYTES // (1 + AHEAD), len(keys)):
            commands: list[tuple] = []
            for j in r:
                (h, p), dst = names[j], as_bytes_view(outs[j])
                if headers[j] is None:
                    commands.append(("GET", h))
                    sinks.append(None)
                for a, b in want:
                    commands.append(("GET", p) if ranges is None else ("GETRANGE", p, a, b - 1))
                    sinks.append(dst[a:b])
            chunks.append(commands)
        out: list = []
        with contextlib.closing(read_pipelined(pool, chunks, sinks)) as replies:
            for j, key in enumerate(keys):
                header = next(replies) if headers[j] is None else headers[j]
                parts = [next(replies) for _ in want]
                got = self._landed(key, names[j], layout, want, header, parts)
                if units is not None and isinstance(got, PageHeader):
                    got = self._verified(key, got, layout, outs[j], units)
                    if not isinstance(got, Checked):  # (the caller's check counts and drops it)
                        self._headers.forget([key])
                out.append(got)
        return out

    def _landed(self, key: PageKey, names: tuple[bytes, bytes], layout: GroupLayout, want: list[Range],
                header, parts: list):
        """One page's replies (its payload's already in its buffer): its header (parsed), a miss, or
        what the caller's check rejects."""
        for reply in (header, *parts):
            if isinstance(reply, rexc.ResponseError):  # (a slot that moved: the map is read again meanwhile)
                if str(reply).startswith(("MOVED", "ASK")) and self.nodes is not None:
                    self.nodes.refresh(0)
                else:
                    self.stats.errors += 1
                return None
        if header is None:
            return None
        if not parts[0]:  # gone, or Redis evicted the payload but not the header
            self._headers.forget([key])
            self._reader().delete(*names)
            return None
        if any(n != b - a for (a, b), n in zip(want, parts)):
            self._headers.forget([key])
            return b""  # a short page: the header check rejects it
        header = self._parsed(key, header, layout)
        if not isinstance(header, PageHeader):
            return header  # the caller's check counts and drops it
        self._headers.put(key, header)
        return header

    def _write(self, pages: Sequence[tuple[PageHeader, memoryview]], domain: str) -> list[bool]:
        """Payloads one ``SET`` at a time (measured faster than pipelining many 2 MiB values, and it
        bounds what the client buffers), then their headers in one pipeline, every
        :data:`~lmkv.tiers.remote.PUBLISH_BYTES` of payloads: a page becomes visible only once its
        payload is there, and a reader sees a large write's first pages while the rest are on
        their way. On a cluster each node's pages go concurrently; pages whose node is down raise
        :class:`PartlyStoredError` once the rest are written."""
        names = [self._names(h.key) for h, _ in pages]

        async def job(client, idx: list[int]) -> list[bool]:
            ok: list[bool] = []
            for r in batches([len(pages[i][1]) for i in idx], remote.PUBLISH_BYTES, len(idx)):
                ok += await publish(client, idx[r.start : r.stop])
            return ok

        async def publish(client, idx: list[int]) -> list[bool]:
            ok: list[bool] = []
            for i in idx:
                try:
                    ok.append(await client.set(names[i][1], pages[i][1], px=self._px) is True)
                except rexc.MovedError:
                    raise
                except rexc.ResponseError as err:
                    self._refused(err)
                    ok.append(False)
            todo = [i for i, good in zip(idx, ok) if good]
            if todo:
                async with client.pipeline(transaction=False) as pipe:
                    for i in todo:
                        pipe.set(names[i][0], pages[i][0].pack(), px=self._px)
                    replies = dict(zip(todo, await pipe.execute(raise_on_error=False)))
                for j, i in enumerate(idx):
                    if ok[j]:
                        if replies[i] is True:
                            self._headers.put(pages[i][0].key, pages[i][0])
                        else:
                            self._refused(replies[i])
                            ok[j] = False
            return ok

        done = self._per_node([n for _, n in names], job)
        stored = [done.get(i, False) for i in range(len(pages))]
        lost = [i for i in range(len(pages)) if i not in done]
        if lost:
            raise PartlyStoredError(f"{self.name}: {len(lost)} of {len(pages)} pages on nodes that are down "
                                    f"({', '.join(self.nodes.down) if self.nodes else ''})", stored, lost)
        return stored

    def _refused(self, reply) -> None:
        """Count a write Redis refused: full (``maxmemory`` with noeviction) or another error."""
        if isinstance(reply, rexc.ResponseError) and "OOM" in str(reply):
            self.stats.full += 1
        else:
            self.stats.errors += 1

    def _delete(self, keys: Sequence[PageKey]) -> int:
        self._headers.forget(keys)
        names = [self._names(k) for k in keys]

        async def job(client, idx: list[int]) -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                for i in idx:
                    pipe.delete(*names[i])
                return await pipe.execute()

        return sum(1 for n in self._per_node([h for h, _ in names], job).values() if n)

    def _clear(self, domain: str) -> int:
        """Redis pages belong to no engine's domain (see the module docstring): nothing to drop."""
        return 0

    def _fetch_usage(self) -> tuple[int, int, int]:
        """Summed over the primaries that answer (a down node is left out, not a failed tier)."""
        async def one(client) -> tuple[int, int, int]:
            info = await client.info("memory")
            return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), await client.dbsize()

        if not self.cluster:
            used, cap, n = self._run(one(self._client))
            return used, cap, n // 2
        parts = self._primaries(one)
        used, cap, n = (sum(col) for col in zip(*parts)) if parts else (0, 0, 0)
        return used, cap, n // 2

    def close(self) -> None:
        super().close()
        self._streamer.shutdown(wait=False)  # (a stream still waiting for its step gives up on its own)
        if self.nodes is not None:
            self.nodes.close()
        for client in [self._client, *self._node_clients.values()]:
            try:
                if client is not None:
                    self._run_plain(client.aclose(), 2)
            except Exception:  # closing a client whose server is gone must not fail shutdown
                pass
        if self._reader_made is not None:
            self._reader_made.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2)
