"""Network tiers failing the ways they fail in production: nothing blocks, nothing is wrong, all is counted."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import random_key, random_payload

from lmkv.config import load_config
from lmkv.dev.redis_server import free_port, start_redis
from lmkv.dev.server_process import spawn
from lmkv.store import TieredStore


def _wait_up(tier, timeout=15.0) -> None:
    deadline = time.monotonic() + timeout
    while not tier.health.up and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.health.up


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_failed_copies_down_are_retried_from_memory_or_dropped(layout, policy):
    port = free_port()
    cfg = load_config({"remote": {"url": f"redis://127.0.0.1:{port}", "timeout": 0.5, "connect_timeout": 0.2},
                       "store": {"failed_writes": policy}}, environ={})
    keys = [random_key() for _ in range(4)]
    payloads = [random_payload(layout, i) for i in range(4)]
    with TieredStore(cfg) as store:
        remote = store.tiers[-1]
        t0 = time.monotonic()
        assert store.put(keys[:3], [layout] * 3, payloads[:3]) == [True] * 3  # memory took them
        assert time.monotonic() - t0 < 2  # a dead tier does not hold the writer up
        assert store.writes.failed == 3
        with start_redis(port=port):
            _wait_up(remote)
            store.put(keys[3:], [layout], payloads[3:])  # the tier takes a write: retries follow it
            present = remote.contains(keys)
            if policy == "retry":
                assert present == [True] * 4 and store.writes.retried == 3 and store.writes.dropped == 0
            else:
                assert present == [False] * 3 + [True] and store.writes.dropped == 3
            assert store.metrics.value("lmkv_writes_down_total", outcome="failed") == 3


def test_retry_queue_is_bounded(layout):
    cfg = load_config({"remote": {"url": f"redis://127.0.0.1:{free_port()}", "connect_timeout": 0.2},
                       "store": {"retry_pages": 2}}, environ={})
    with TieredStore(cfg) as store:
        for i in range(5):
            store.put([random_key()], [layout], [random_payload(layout, i)])
        assert store.writes.failed == 5 and store.writes.dropped == 3 and store.writes.queued == 2


@pytest.mark.parametrize("scheme", ["lmkv", "redis"])
def test_a_backend_that_never_answers_times_out_into_misses(layout, silent_listener, scheme):
    cfg = load_config({"remote": {"url": f"{scheme}://127.0.0.1:{silent_listener}", "timeout": 0.5,
                                  "connect_timeout": 0.5}}, environ={})
    keys = [random_key() for _ in range(2)]
    with TieredStore(cfg) as store:
        t0 = time.monotonic()
        assert store.lookup(keys).pages == 0
        assert time.monotonic() - t0 < 3
        remote = store.tiers[-1]
        assert not remote.health.up and remote.stats.errors >= 1
        t0 = time.monotonic()
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert store.get(keys, layout, outs) == [None, None]
        assert time.monotonic() - t0 < 0.2  # known down: no second timeout


def test_server_killed_between_lookup_and_load(layout):
    """The lookup saw the pages; the server dies before the load: the load fails cleanly."""
    keys = [random_key() for _ in range(3)]
    payloads = [random_payload(layout, i) for i in range(3)]
    server = spawn("--memory", "64MiB")
    try:
        cfg = load_config({"remote": {"url": server.url, "timeout": 1, "connect_timeout": 0.3}}, environ={})
        with TieredStore(cfg) as a:
            a.put(keys, [layout] * 3, payloads)
        with TieredStore(cfg) as b:
            assert b.lookup(keys).tiers == ("server",) * 3
            server.proc.kill()
            server.proc.wait()
            with b.fetch(keys, layout) as f:
                assert f.views == [None] * 3
            assert b.tiers[-1].stats.errors >= 1
    finally:
        server.stop()
