"""Layerwise loads from every tier below memory, without an engine (real disk files, a real
``lmkv serve``, a real redis-server): one request per tier per layer for all of a load's pages,
the forward waits for one layer at a time, a failure between layers costs exactly the affected
blocks, and a half-fetched page is never published."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from conftest import MOONCAKE_SMALL

from lmkv.config import load_config
from lmkv.engine.layer_fetch import SpanChooser
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.scheduler import OffloadScheduler
from lmkv.engine.worker import LayerwiseTransfer, pipeline_depth
from lmkv.errors import TierUnavailableError
from lmkv.keys import page_key
from lmkv.layout import attention_layout
from lmkv.store import TieredStore

LAYERS, TOKENS, BLOCKS = 4, 16, 8
CHAINS = [bytes([i + 1]) * 16 for i in range(4)]
BLOCK_IDS = [6, 1, 4, 2]
LAYOUT = attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16")
NAMES = {f"l{i}": (0, i) for i in range(LAYERS)}


@pytest.fixture(scope="module")
def server():
    from lmkv.dev.server_process import spawn

    with spawn("--memory", "64MiB") as s:
        yield s


@pytest.fixture(params=["disk", "server", "redis", "mooncake"])
def below(request, tmp_path):
    """The config of a store whose pages live in one tier below memory."""
    if request.param == "disk":
        extra = {"disk": {"path": str(tmp_path / "disk")}}
    elif request.param == "server":
        extra = {"remote": {"url": request.getfixturevalue("server").url}}
    elif request.param == "redis":
        extra = {"remote": {"url": request.getfixturevalue("redis_node").url, "key_prefix": uuid.uuid4().hex}}
    else:
        extra = {"remote": {"url": request.getfixturevalue("mooncake_master").url, "key_prefix": uuid.uuid4().hex,
                            "mooncake": MOONCAKE_SMALL}}
    return {"memory": {"capacity": "16MiB"}, "namespace": uuid.uuid4().hex, "layerwise_span": 1, **extra}


def _filled(cfg: dict, chain_sets: tuple[list[bytes], ...] = (CHAINS,)) -> list[torch.Tensor]:
    """KV blocks stored through the worker into ``cfg``'s tiers (write-through reaches the one below),
    under each set of chains in turn."""
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(BLOCKS, 2, TOKENS, 128, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    with TieredStore(load_config(cfg, environ={})) as store:
        w = LayerwiseTransfer(store, [LAYOUT], [full], NAMES)
        for chains in chain_sets:
            w.begin(StepPlan(stores=[PageOp("r", 0, chains, BLOCK_IDS, list(range(4)))]))
            for name in NAMES:
                w.after_layer(name)
            w.end()
        store.drain()
        w.close()
    return full


class Recorder:
    """Wraps a tier's read methods and records every call: which pages, which byte ranges."""

    def __init__(self, tier, hold=None, lose=None) -> None:
        self.calls: list[tuple[str, int, list]] = []
        self.in_flight = self.most_in_flight = 0  # layer requests at once
        self._lock = threading.Lock()
        self._ranges, self._get = tier.get_ranges, tier.get
        self.hold = hold  # (layer) -> called before the read, may block or raise
        self.lose = lose  # (layer, key) -> whether that page's range comes back missing
        tier.get_ranges, tier.get = self.get_ranges, self.get

    def get_ranges(self, keys, layout, ranges, outs):
        layer = ranges[0][0] // layout.layer_stride
        self.calls.append(("ranges", len(keys), list(ranges)))
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                self.hold(layer)
            got = self._ranges(keys, layout, ranges, outs)
        finally:
            with self._lock:
                self.in_flight -= 1
        return [None if self.lose and self.lose(layer, k) else h for k, h in zip(keys, got)]

    def get(self, keys, layout, outs):
        self.calls.append(("get", len(keys), []))
        return self._get(keys, layout, outs)


def _load(store, empty, plan_op):
    w = LayerwiseTransfer(store, [LAYOUT], [empty], NAMES)
    w.begin(StepPlan(loads=[plan_op]))
    w.start_loads()
    return w


def test_a_load_from_a_lower_tier_arrives_layer_by_layer_one_request_per_layer(below):
    full = _filled(below)
    with TieredStore(load_config(below, environ={})) as store:  # memory empty: every page is below
        later = threading.Event()  # (layer 0's request waits a while for any other to start)
        rec = Recorder(store.tiers[1], hold=lambda layer: later.wait(0.3) if layer == 0 else later.set())
        empty = [torch.zeros_like(t) for t in full]
        w = _load(store, empty, PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4))))
        for i, name in enumerate(NAMES):
            w.before_layer(name)
            assert torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS])
        w.end()
        assert w.take_errors() == set()
        # every page's layer l in one request, layer after layer; never a whole page
        assert sorted(c[2][0][0] // LAYOUT.layer_stride for c in rec.calls) == list(range(LAYERS))
        assert all(kind == "ranges" and n == 4 and len(r) == 1 and r[0][1] - r[0][0] == LAYOUT.layer_stride
                   for kind, n, r in rec.calls)
        t = w.stats.totals
        assert t.loaded_pages == 4 and t.layerwise_pages == 4
        keys = [page_key(c, LAYOUT) for c in CHAINS]
        assert store.memory.contains(keys) == [True] * 4  # whole pages, published once every layer landed
        assert store.link.get(store.tiers[1].name).request_s is not None
        if store.tiers[1].name == "redis":  # (one request at a time, layer after layer: serves_in_order)
            assert rec.most_in_flight == 1
            assert [c[2][0][0] // LAYOUT.layer_stride for c in rec.calls] == list(range(LAYERS))
        w.close()


def test_the_forward_waits_for_its_layer_not_for_the_whole_fetch(tmp_path):
    cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk")}, "layerwise_span": 1}
    full = _filled(cfg)
    gate = threading.Event()
    with TieredStore(load_config(cfg, environ={})) as store:
        Recorder(store.tiers[1], hold=lambda layer: layer and gate.wait(30))  # layers >= 1 held back
        empty = [torch.zeros_like(t) for t in full]
        w = _load(store, empty, PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4))))
        first = threading.Thread(target=w.before_layer, args=("l0",))
        first.start()
        first.join(20)
        assert not first.is_alive(), "layer 0 waited for later layers"
        assert torch.equal(empty[0][BLOCK_IDS], full[0][BLOCK_IDS]) and not empty[1].any()
        gate.set()
        for name in list(NAMES)[1:]:
            w.before_layer(name)
        w.end()
        assert w.take_errors() == set()
        assert all(torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS]) for i in range(LAYERS))
        w.close()


def test_a_fetch_that_cannot_plan_its_requests_recomputes_and_never_leaves_the_forward_waiting(tmp_path,
                                                                                             monkeypatch):
    """A failure while a fetch plans its requests (here the span choice raises) fails every page
    below memory for a recompute; the forward's layer waits return, nothing is published."""
    cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk")}}
    full = _filled(cfg)
    with TieredStore(load_config(cfg, environ={})) as store:
        monkeypatch.setattr(LayerwiseTransfer, "_span", lambda self, layers, tier: 1 // 0)
        empty = [torch.zeros_like(t) for t in full]
        w = _load(store, empty, PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4))))
        forward = threading.Thread(target=lambda: [w.before_layer(n) for n in NAMES] and w.end())
        forward.start()
        forward.join(20)
        assert not forward.is_alive(), "the forward waits for a fetch that never started"
        assert w.take_errors() == set(BLOCK_IDS)
        assert not any(t.any() for t in empty)
        assert store.memory.contains([page_key(c, LAYOUT) for c in CHAINS]) == [False] * 4
        w.close()


@pytest.mark.parametrize("how", ["one page fails at layer 2", "the tier dies after layer 0"])
def test_a_failure_between_layers_recomputes_exactly_the_affected_blocks(below, how):
    full = _filled(below)
    keys = [page_key(c, LAYOUT) for c in CHAINS]

    def dies(layer):
        if layer >= 1:
            raise TierUnavailableError("injected: the tier is gone")

    with TieredStore(load_config(below, environ={})) as store:
        if how.startswith("one page"):
            Recorder(store.tiers[1], lose=lambda layer, k: layer == 2 and k == keys[1])
        else:
            Recorder(store.tiers[1], hold=dies)
        empty = [torch.zeros_like(t) for t in full]
        w = _load(store, empty, PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4))))
        for name in NAMES:
            w.before_layer(name)
        w.end()
        errors = w.take_errors()
        if how.startswith("one page"):
            assert errors == {BLOCK_IDS[1]}
            assert store.memory.contains(keys) == [True, False, True, True]  # the torn page never published
            for i in range(LAYERS):
                assert torch.equal(empty[i][[6, 4, 2]], full[i][[6, 4, 2]])
            assert w.take_failed_chains() == [CHAINS[1]]
        else:
            assert errors == set(BLOCK_IDS)
            assert store.memory.contains(keys) == [False] * 4
        w.close()


def test_pipeline_depth_follows_the_request_time_over_a_layers_compute():
    assert pipeline_depth(None, 0.01) == pipeline_depth(0.01, None) == 2
    assert pipeline_depth(0.001, 0.01) == 2  # a request shorter than a layer: one in flight, one landing
    assert pipeline_depth(0.035, 0.01) == 5
    assert pipeline_depth(10.0, 0.001) == 8  # bounded


def test_the_scheduler_chooses_layerwise_unless_the_fetch_would_stall_a_shared_step():
    with TieredStore(load_config({"memory": {"capacity": "4MiB"}}, environ={})) as store:
        s = OffloadScheduler(store, [LAYOUT], TOKENS, "m", "ns", load_mode="auto", max_stall=2.0)
        big = {"redis": 100 << 20}
        assert not s.loads_async({})  # memory hits
        assert not s.loads_async(big)  # nothing measured yet
        s.observe({"redis": 1e9}, 0.001)  # a step: 4 layers x 1 ms
        assert not s.loads_async(big)  # 0.1 s of fetch, but no other request runs
        s.running = 3
        assert s.loads_async(big)  # 0.1 s > 2 x 4 ms: the others would wait
        assert not s.loads_async({"redis": 4 << 20})  # 4 ms <= 8 ms
        assert not s.loads_async({"disk": 100 << 20})  # a tier not measured yet counts as fast
        for mode, want in (("async", True), ("layerwise", False)):
            s.load_mode = mode
            assert s.loads_async({"redis": 4 << 20}) is want


def test_the_span_follows_what_its_loads_cost_per_byte():
    c = SpanChooser(8)
    assert c.spans == [1, 2, 4, 8]
    assert c.pick() == 8  # whole pages first
    c.record(8, 0.010, 1 << 20)
    assert c.pick() == 4  # then the neighbour
    c.record(4, 0.004, 1 << 20)
    assert c.pick() == 2
    c.record(2, 0.006, 1 << 20)
    assert c.pick() == 4  # its neighbours measured, the cheapest stays
    for _ in range(20):  # it gets dear: 2 is the best now, and its other neighbour is tried
        c.record(4, 0.050, 1 << 20)
    assert c.pick() == 1
    c.record(1, 0.020, 1 << 20)
    assert c.pick() == 2
    tie = SpanChooser(4, cost={1: 0.0, 2: 0.0, 4: 0.0})
    assert tie.pick() == 4  # nothing waited at any span: the fewest requests


def test_the_span_counts_the_fetchs_time_not_only_the_forwards_waits(tmp_path):
    """A tier that serves one request at a time, each costing far more than its bytes, under a
    forward slower than any request: each span's forward waits only for its first request, so the
    smallest span waits least, but the tier works three times as long for it. The span stays
    whole pages once its neighbour was tried (the waits alone walked it down to one layer)."""
    cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk")}}
    sets = [[bytes([16 * k + i + 1]) * 16 for i in range(4)] for k in range(4)]
    full = _filled(cfg, tuple(sets))  # (every set on disk)
    with TieredStore(load_config(cfg, environ={})) as store:  # memory empty: every page is below
        disk, one_at_a_time, spans = store.tiers[1], threading.Lock(), []
        read = disk.get_ranges

        def slow(keys, layout, ranges, outs):
            span = (ranges[0][1] - ranges[0][0]) // layout.layer_stride
            with one_at_a_time:
                spans.append(span)
                time.sleep(0.12 + 0.01 * span)  # (a fixed cost per request, and a little per layer)
                return read(keys, layout, ranges, outs)

        disk.get_ranges = slow
        w = LayerwiseTransfer(store, [LAYOUT], [[torch.zeros_like(t) for t in full]], NAMES)
        chosen = []
        for chains in sets:
            w.begin(StepPlan(loads=[PageOp("r", 0, chains, BLOCK_IDS, list(range(4)))]))
            w.start_loads()
            for name in NAMES:
                w.before_layer(name)
                time.sleep(0.15)  # (the layer's compute: longer than any request)
            w.end()
            assert w.take_errors() == set()
            chosen.append(spans[-1])
        w.close()
    assert chosen == [LAYERS, LAYERS // 2, LAYERS, LAYERS]


def test_a_fetch_with_a_span_asks_each_run_of_layers_in_one_range(tmp_path):
    cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk")}, "layerwise_span": 3}
    full = _filled(cfg)
    with TieredStore(load_config(cfg, environ={})) as store:
        rec = Recorder(store.tiers[1])
        empty = [torch.zeros_like(t) for t in full]
        w = _load(store, empty, PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4))))
        for name in NAMES:
            w.before_layer(name)
        w.end()
        assert w.take_errors() == set()
        stride = LAYOUT.layer_stride
        assert sorted(r[0] for _, _, r in rec.calls) == [(0, 3 * stride), (3 * stride, 4 * stride)]
        assert all(torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS]) for i in range(LAYERS))
        w.close()
