"""A Redis Cluster losing a primary under readers and writers: only that node's slots miss, until its
replica is promoted; nothing wrong, nothing raised, each outage logged once, its end once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import RemoteConfig
from lmkv.dev.redis_server import cluster_primaries, start_cluster
from lmkv.errors import PartlyStoredError
from lmkv.tiers.redis import RedisTier


@pytest.fixture
def cluster():
    """Three primaries with one replica each; a primary silent for 1.5 s is replaced."""
    with start_cluster(3, replicas=1, node_timeout_ms=1500) as c:
        yield c


@pytest.fixture
def tier(cluster, caplog):
    """The tier on the cluster, with lmkv's warnings captured; closed after the test."""
    caplog.set_level(logging.WARNING, logger="lmkv")
    t = RedisTier(RemoteConfig(url=cluster.url, timeout=0.5, connect_timeout=0.3))
    yield t
    t.close()


def _stored(tier: RedisTier, layout):
    keys, payloads, pages = make_pages(layout, 60)
    assert tier.put(pages, "engine") == [True] * 60
    return keys, payloads


def _replicated(port: int) -> None:
    """Wait until each primary's replica holds what the primary holds."""
    deadline = time.monotonic() + 10
    out = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], capture_output=True,
                             text=True).stdout
        offset = next(int(x.split(":")[1]) for x in out.splitlines() if x.startswith("master_repl_offset"))
        if f"offset={offset}," in out:
            return
        time.sleep(0.05)
    raise AssertionError(f"replica of {port} did not catch up: {out}")


class Load:
    """A reader of known pages and a writer of new ones, on their own threads, recording outcomes."""

    def __init__(self, tier: RedisTier, keys, payloads, layout) -> None:
        self.tier, self.keys, self.payloads, self.layout = tier, keys, payloads, layout
        self.stop = threading.Event()
        self.reads: list[tuple[float, list[bool]]] = []  # (when a read began, which pages it found)
        self.slowest = 0.0
        self.wrong = 0
        self.written: list[tuple[bytes, np.ndarray]] = []
        self.unreachable = 0
        self.raised: list[BaseException] = []
        self._threads = [threading.Thread(target=self._read), threading.Thread(target=self._write)]

    def _read(self) -> None:
        outs = [np.zeros(self.layout.payload_bytes, np.uint8) for _ in self.keys]
        while not self.stop.is_set():
            try:
                t = time.monotonic()
                got = self.tier.get(self.keys, self.layout, outs)
                self.slowest = max(self.slowest, time.monotonic() - t)
            except BaseException as err:  # noqa: BLE001 - the test asserts nothing escaped
                self.raised.append(err)
                return
            self.wrong += sum(1 for h, o, p in zip(got, outs, self.payloads) if h is not None
                              and not np.array_equal(o, p))
            self.reads.append((t, [h is not None for h in got]))  # (when it began, which pages hit)

    def _write(self) -> None:
        seed = 10_000
        while not self.stop.is_set():
            keys, payloads, pages = make_pages(self.layout, 6, seed)
            seed += 6
            try:
                ok = self.tier.put(pages, "engine")
            except PartlyStoredError as err:
                ok, self.unreachable = err.stored, self.unreachable + len(err.unreachable)
            except BaseException as err:  # noqa: BLE001
                self.raised.append(err)
                return
            self.written += [(k, p) for k, p, good in zip(keys, payloads, ok) if good]
            time.sleep(0.01)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)


def _victim_and_pages(tier: RedisTier, keys) -> tuple[int, list[int], list[int]]:
    victim = int(tier.node_of(keys[0]).rsplit(":", 1)[1])
    on = [i for i, k in enumerate(keys) if tier.node_of(k).endswith(f":{victim}")]
    return victim, on, [i for i in range(len(keys)) if i not in on]


def _outage_logs(caplog, victim: int) -> tuple[int, int, int]:
    msgs = [r.getMessage() for r in caplog.records]
    return (sum(f"node 127.0.0.1:{victim} unreachable" in m for m in msgs),
            sum(f"node 127.0.0.1:{victim} reachable again" in m for m in msgs),
            sum("redis tier unreachable" in m for m in msgs))


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_primary_costs_only_its_own_slots(cluster, tier, layout, caplog, fault):
    keys, payloads = _stored(tier, layout)
    victim, on, off = _victim_and_pages(tier, keys)
    assert on and off
    for p in cluster_primaries(cluster.ports[0]):
        _replicated(p)
    proc = cluster.procs[cluster.ports.index(victim)]
    with Load(tier, keys, payloads, layout) as load:
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if fault == "hang":  # back before the cluster gives up on it
            time.sleep(1.0)
            os.kill(proc.pid, signal.SIGCONT)
        deadline = t0 + 20
        while time.monotonic() < deadline and not (
                load.reads and load.reads[-1][0] > t0 and all(load.reads[-1][1])):
            time.sleep(0.05)
        back = time.monotonic() - t0
        time.sleep(0.5)  # the writer writes to every slot again
    assert not load.raised and load.wrong == 0
    during = [hits for t, hits in load.reads if t > t0]
    survivors = [hits[i] for hits in during for i in off]
    victims = [hits[i] for hits in during for i in on]
    assert all(survivors), f"{survivors.count(False)} of {len(survivors)} reads of surviving slots missed"
    assert not all(victims)  # the victim's pages did miss meanwhile ...
    assert all(load.reads[-1][1]), f"still missing {back:.1f} s after the {fault}"  # ... and are back
    assert load.slowest < 5
    # the recovery is logged by the node's reconnect loop, whose next ping (backing off up to 5 s) may
    # come after its slots are served again
    deadline = time.monotonic() + 15
    while _outage_logs(caplog, victim)[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _outage_logs(caplog, victim) == (1, 1, 0)
    # what the writer was told is stored is there; pages for the dead node were reported unreachable
    got = tier.get([k for k, _ in load.written], layout,
                   outs := [np.zeros(layout.payload_bytes, np.uint8) for _ in load.written])
    assert all(h is not None for h in got)
    assert all(np.array_equal(o, p) for o, (_, p) in zip(outs, load.written))


def _replica_of(port: int) -> int:
    """The port of a replica the primary on ``port`` streams to (once it is online)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], capture_output=True, text=True,
                             timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("slave") and "state=online" in line:
                return int(dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))["port"])
        time.sleep(0.05)
    raise AssertionError(f"no replica of {port} online")


def _role(port: int) -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), "role"], capture_output=True, text=True, timeout=10).stdout
    return out.split()[0] if out else ""


def test_a_manual_failover_moves_slots_without_an_outage(tier, layout, caplog):
    """``CLUSTER FAILOVER`` on a replica: the old primary answers ``MOVED`` for the slots it gave
    up; the tier reads the slot map again and writes to the new primary. No page refused, none
    lost, no outage logged."""
    keys, payloads = _stored(tier, layout)
    old, on, _ = _victim_and_pages(tier, keys)
    _replicated(old)
    new = _replica_of(old)
    subprocess.run(["redis-cli", "-p", str(new), "cluster", "failover"], check=True, capture_output=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_role(new), _role(old)) != ("master", "slave"):
        time.sleep(0.05)
    assert (_role(new), _role(old)) == ("master", "slave")
    assert tier.node_of(keys[on[0]]).endswith(f":{old}")  # the tier's map is stale now
    more, more_payloads, more_pages = make_pages(layout, 60, 500)
    assert tier.put(more_pages, "engine") == [True] * 60  # MOVED: the map read again, retried
    assert tier.node_of(keys[on[0]]).endswith(f":{new}")
    assert tier.contains(keys + more) == [True] * 120
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys + more]
    assert all(h is not None for h in tier.get(keys + more, layout, outs))
    assert all(np.array_equal(o, p) for o, p in zip(outs, payloads + more_payloads))
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert tier.stats.errors == 0
