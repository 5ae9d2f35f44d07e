"""Prometheus metrics: hits, misses, bytes per tier and direction, latencies.

Counters live in each tier's :class:`~lmkv.tiers.base.TierStats` (plain ints on
the hot path) and are read only when Prometheus scrapes, through a collector;
latencies go to a histogram. Every store has its own registry, so several
stores in one process (tests, two engines) never collide.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmkv.tiers.base import Tier


@dataclass(frozen=True)
class MetricDoc:
    """One exported metric, as the reference documents it: its full name, kind, labels and meaning."""

    name: str
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    doc: str


_COUNTERS = {
    "hits": "pages found in the tier",
    "misses": "pages looked for and not found (or failed)",
    "evictions": "pages evicted for room",
    "corrupt": "pages discarded because their checksum or header was wrong",
    "errors": "I/O errors other than a full tier",
    "full": "puts refused because the tier (or its file system) was full",
    "puts": "pages stored",
    "quarantined": "slots held back from reuse because a writer that was given up on may still write them",
    "reclaimed": "quarantined slots let go once their writer was known to be finished",
}


#: per tier, the counters an engine's own stats path reports (besides the bytes)
TIER_COUNTERS = tuple(_COUNTERS)
#: per tier, gauges read from the tier: attribute -> meaning
_GAUGES = {
    "used_bytes": "bytes resident",
    "capacity_bytes": "configured capacity",
    "quarantined_bytes": "bytes held back for writers that may still finish late",
}
_BYTES = "payload bytes moved"
_PAGES = "pages resident"
_WRITES = "copies to lower tiers that failed, were retried from memory, or were given up"
_OUTCOMES = ("failed", "retried", "dropped")
_LATENCY = "latency of store operations"


def store_metrics() -> list[MetricDoc]:
    """Every metric a store exports (``lmkv serve``'s ``/metrics``; an engine's store in its process)."""
    out = [MetricDoc(f"lmkv_{field}_total", "counter", ("tier",), doc) for field, doc in _COUNTERS.items()]
    out.append(MetricDoc("lmkv_bytes_total", "counter", ("tier", "direction"), _BYTES + " (direction: put, get)"))
    out += [MetricDoc(f"lmkv_{attr}", "gauge", ("tier",), doc) for attr, doc in _GAUGES.items()]
    out.append(MetricDoc("lmkv_pages", "gauge", ("tier",), _PAGES))
    out.append(MetricDoc("lmkv_writes_down_total", "counter", ("outcome",),
                         f"{_WRITES} (outcome: {', '.join(_OUTCOMES)})"))
    out.append(MetricDoc("lmkv_op_seconds", "histogram", ("op",), _LATENCY))
    return out


class TierDeltas:
    """What each tier counted since the last :meth:`take` (``tier.<name>.<counter>``, bytes as
    ``put_bytes``/``get_bytes``): how a worker inside an engine reports its store through the
    engine's own stats (vLLM's KV-connector stats), which sums them across workers."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, tiers: Sequence[Tier]) -> dict[str, int]:
        now = {f"tier.{t.name}.{f}": int(getattr(t.stats, f))
               for t in tiers for f in (*TIER_COUNTERS, "put_bytes", "get_bytes")}
        out = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        return {k: v for k, v in out.items() if v}


class _TierCollector(Collector):
    def __init__(self, tiers: Callable[[], Sequence[Tier]]) -> None:
        self._tiers = tiers

    def describe(self) -> Iterator:
        """The families without their values: registering the collector reads no tier (a network
        tier would be asked for its usage)."""
        for field, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"lmkv_{field}", doc, labels=["tier"])
        yield CounterMetricFamily("lmkv_bytes", _BYTES, labels=["tier", "direction"])
        for attr, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"lmkv_{attr}", doc, labels=["tier"])
        yield GaugeMetricFamily("lmkv_pages", _PAGES, labels=["tier"])

    def collect(self) -> Iterator:
        tiers = self._tiers()
        for field, doc in _COUNTERS.items():
            fam = CounterMetricFamily(f"lmkv_{field}", doc, labels=["tier"])
            for t in tiers:
                fam.add_metric([t.name], getattr(t.stats, field))
            yield fam
        fam = CounterMetricFamily("lmkv_bytes", _BYTES, labels=["tier", "direction"])
        for t in tiers:
            fam.add_metric([t.name, "put"], t.stats.put_bytes)
            fam.add_metric([t.name, "get"], t.stats.get_bytes)
        yield fam
        for attr, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"lmkv_{attr}", doc, labels=["tier"])
            for t in tiers:
                g.add_metric([t.name], getattr(t, attr))
            yield g
        g = GaugeMetricFamily("lmkv_pages", _PAGES, labels=["tier"])
        for t in tiers:
            g.add_metric([t.name], len(t))
        yield g


class _WriteCollector(Collector):
    def __init__(self, writes: Callable[[], object]) -> None:
        self._writes = writes

    def collect(self) -> Iterator:
        fam = CounterMetricFamily("lmkv_writes_down", _WRITES, labels=["outcome"])
        w = self._writes()
        for outcome in _OUTCOMES:
            fam.add_metric([outcome], getattr(w, outcome))
        yield fam


class _Timed:
    __slots__ = ("_hist", "_t0")

    def __init__(self, hist: Histogram) -> None:
        self._hist = hist
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._hist.observe(time.perf_counter() - self._t0)


class Metrics:
    """One store's metrics; ``registry`` can be served with prometheus_client."""

    def __init__(self, tiers: Callable[[], Sequence[Tier]], writes: Callable[[], object] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TierCollector(tiers))
        if writes is not None:
            self.registry.register(_WriteCollector(writes))
        self.latency = Histogram(
            "lmkv_op_seconds", _LATENCY, ["op"], registry=self.registry,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5),
        )
        self._per_op: dict[str, Histogram] = {}

    def timed(self, op: str) -> _Timed:
        """A context that observes its duration as ``op``'s latency (every store call is timed: a
        class and a cached label cost a fraction of a generator and a label lookup per call)."""
        child = self._per_op.get(op)
        if child is None:
            child = self._per_op[op] = self.latency.labels(op)
        return _Timed(child)

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        """Scrapes are not logged (one line per scrape on stderr otherwise)."""


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_metrics(registry: CollectorRegistry, host: str, port: int, token: str | None) -> WSGIServer:
    """The Prometheus endpoint in a background thread; with ``token``, a scrape must present it as
    ``Authorization: Bearer <token>`` (401 otherwise). ``server_port`` is the port it got."""
    app = make_wsgi_app(registry)

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "")
        if token is not None and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"lmkv: a bearer token is required\n"]
        return app(environ, start_response)

    server = make_server(host, port, guarded, _ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="lmkv-metrics", daemon=True).start()
    return server
