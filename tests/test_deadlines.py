"""Every lmkv call that can wait keeps its deadline: a backend that stalls (SIGSTOP: a paused
process, a swap storm) costs each call at most ``remote.timeout`` and a small margin, then the
tier is down and calls fail at once, until it answers again."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import make_pages

from lmkv.config import load_config
from lmkv.dev.redis_server import start_cluster, start_redis
from lmkv.dev.server_process import spawn
from lmkv.dev.signals import pause
from lmkv.errors import LMKVError
from lmkv.store import TieredStore
from lmkv.tiers.redis_nodes import ClusterNodes

TIMEOUT = 1.0
MARGIN = 0.5


@pytest.fixture(params=["server", "redis"])
def backend(request):
    if request.param == "server":
        with spawn("--memory", "64MiB") as s:
            yield SimpleNamespace(url=s.url, pid=s.proc.pid)
            os.kill(s.proc.pid, signal.SIGCONT)
    else:
        with start_redis() as r:
            yield SimpleNamespace(url=r.url, pid=r.procs[0].pid)
            os.kill(r.procs[0].pid, signal.SIGCONT)


CALLS = {
    "contains": lambda tier, keys, pages, layout: tier.contains(keys),
    "get": lambda tier, keys, pages, layout: tier.get(keys, layout, [p for _, p in pages]),
    "get_ranges": lambda tier, keys, pages, layout: tier.get_ranges(keys, layout, [layout.layer_range(0)],
                                                                    [p.copy() for _, p in pages]),
    "put": lambda tier, keys, pages, layout: tier.put(pages, "engine"),
    "delete": lambda tier, keys, pages, layout: tier.delete(keys),
}


@pytest.mark.parametrize("call", CALLS)
def test_a_call_to_a_stalled_backend_keeps_its_deadline(backend, layout, call):
    cfg = load_config({"memory": {"capacity": "16MiB"}, "remote": {"url": backend.url, "timeout": TIMEOUT,
                                                                   "shm": "never"}}, environ={})
    keys, _, pages = make_pages(layout, 4)
    with TieredStore(cfg) as store:
        tier = store.tiers[-1]
        assert tier.put(pages, "engine") == [True] * 4  # (healthy: connected, pages there)
        pause(backend.pid, 5)
        t0 = time.monotonic()
        try:
            CALLS[call](tier, keys, pages, layout)
        except LMKVError:
            pass  # (down: the caller's other tiers serve)
        assert time.monotonic() - t0 < TIMEOUT + MARGIN
        t0 = time.monotonic()
        try:
            CALLS[call](tier, keys, pages, layout)
        except LMKVError:
            pass
        assert time.monotonic() - t0 < 0.05  # marked down: at once


def test_write_through_to_a_stalled_backend_keeps_its_deadline(backend, layout):
    """A step's pages commit to memory at once; their copy down runs on the store's I/O threads, a
    batch bounded like any call, and is queued for a retry."""
    cfg = load_config({"memory": {"capacity": "16MiB"}, "remote": {"url": backend.url, "timeout": TIMEOUT,
                                                                   "shm": "never"}}, environ={})
    keys, payloads, _ = make_pages(layout, 8)
    with TieredStore(cfg) as store:
        store.put(keys[:1], [layout], payloads[:1])
        pause(backend.pid, 5)
        t0 = time.monotonic()
        with store.open_session(keys[1:], [layout] * 7) as session:
            for i, p in enumerate(payloads[1:]):
                session.buffer(i)[:] = p
            assert session.commit() == [True] * 7  # in memory at once
        assert time.monotonic() - t0 < 0.1
        assert session.written_through is not None
        session.written_through.result(timeout=10)
        assert time.monotonic() - t0 < TIMEOUT + MARGIN
        assert store.writes.failed == 7 and store.writes.queued == 7  # (retried once the backend answers)


def test_a_slot_map_refresh_keeps_the_callers_deadline():
    """A cluster asked for its map while a node stalls (each node asked in turn, each with its own
    socket timeout) answers late: the refresh is waited for only as long as the caller's deadline."""
    slow = threading.Event()

    class SlowManager:
        def initialize(self):
            slow.wait(3)

    nodes = ClusterNodes("redis", lambda: SimpleNamespace(nodes_manager=SlowManager()))
    t0 = time.monotonic()
    assert nodes.refresh(0.2) is False
    assert time.monotonic() - t0 < 0.3
    slow.set()


def test_a_cluster_write_with_a_stalled_node_keeps_its_deadline(layout):
    """One primary of three stalls: a write of pages across the cluster returns within the deadline,
    the stalled node's pages failed (to retry), the others stored."""
    from lmkv.errors import PartlyStoredError

    with start_cluster(3) as cluster:
        cfg = load_config({"memory": {"capacity": "16MiB"},
                           "remote": {"url": cluster.url, "timeout": TIMEOUT}}, environ={})
        keys, _, pages = make_pages(layout, 24)
        with TieredStore(cfg) as store:
            tier = store.tiers[-1]
            assert tier.put(pages[:1], "engine") == [True]
            pause(cluster.procs[1].pid, 5)
            try:
                t0 = time.monotonic()
                try:
                    stored = tier.put(pages, "engine")
                except PartlyStoredError as err:
                    stored = err.stored
                assert time.monotonic() - t0 < TIMEOUT + MARGIN
                assert 0 < sum(stored) < len(pages)
            finally:
                os.kill(cluster.procs[1].pid, signal.SIGCONT)
