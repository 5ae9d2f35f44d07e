"""The worker side without an engine: a layerwise load lands layer by layer as the forward asks,
and a layer the forward did not wait for counts as not loaded."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from lmkv.config import load_config
from lmkv.engine.plan import PageOp, StepPlan
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.kernels.streams import Streams
from lmkv.layout import attention_layout
from lmkv.store import TieredStore

LAYERS, TOKENS, BLOCKS = 3, 16, 8
CHAINS = [bytes([i + 1]) * 16 for i in range(4)]
BLOCK_IDS = [6, 1, 4, 2]


def _setup(verify: bool = False):
    layout = attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(LAYERS)}
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(BLOCKS, 2, TOKENS, 128, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB", "verify_checksums": verify}}, environ={}))
    op = PageOp("r", 0, CHAINS, BLOCK_IDS, list(range(4)))
    w = LayerwiseTransfer(store, [layout], [full], names)
    w.begin(StepPlan(stores=[op]))
    for name in names:
        w.after_layer(name)
    w.end()
    empty = [torch.zeros_like(t) for t in full]
    return store, LayerwiseTransfer(store, [layout], [empty], names), op, full, empty, names


def test_a_layerwise_load_lands_layer_by_layer():
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for i, name in enumerate(names):
            w.before_layer(name)  # layer i is in place before the forward uses it; later ones not yet
            assert torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS])
            assert all(not empty[j].any() for j in range(i + 1, LAYERS))
        w.end()
        assert w.take_errors() == set() and w.stats.totals.loaded_pages == 4


def test_a_layer_the_forward_did_not_wait_for_is_recomputed():
    """If the forward used a layer without waiting for it (no hook), the blocks are reported so the
    engine recomputes them."""
    store, w, op, full, empty, names = _setup()
    with store:
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for name in list(names)[:-1]:  # the last layer's hook never runs
            w.before_layer(name)
        w.end()
        assert w.take_errors() == set(BLOCK_IDS)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("path", ["layerwise", "asynchronous", "fetch"])
def test_verify_checksums_turns_a_corrupted_memory_page_into_a_miss_on_every_load_path(path, verify):
    """``memory.verify_checksums``: a byte flipped in a memory page the engine is about to load makes
    that page a miss (its block recomputed, the page dropped) on the layerwise path, the asynchronous
    one and a plain fetch. Off, the flipped byte reaches the engine's block (the check can fail)."""
    store, w, op, full, empty, names = _setup(verify)
    layout = w.groups[0]
    with store:
        keys = w.keys(op)
        with store.memory.borrow(keys[1:2], count=False) as lease:
            lease.views[0][100] ^= 0xFF  # page 1, in layer 0's K: block 1 of the op
        if path == "layerwise":
            w.begin(StepPlan(loads=[op]))
            w.start_loads()
            for name in names:
                w.before_layer(name)
            w.end()
            bad = w.take_errors() == {BLOCK_IDS[1]}
        elif path == "asynchronous":
            w.begin(StepPlan(async_loads=[op]))
            w.start_loads()
            w.end()
            store.drain()
            done, failed = w.transfer_results()
            assert done == {"r"}
            bad = failed == {"r"}
        else:
            with store.fetch(keys, layout) as f:
                bad = f.views[1] is None and all(v is not None for i, v in enumerate(f.views) if i != 1)
        assert bad == verify
        assert (store.memory.contains(keys[1:2]) == [False]) == verify  # dropped, never served again
        assert store.memory.stats.corrupt == int(verify)
        if path == "layerwise" and not verify:
            assert not torch.equal(empty[0][BLOCK_IDS[1]], full[0][BLOCK_IDS[1]])  # the flip reached the block


def test_rescued_blocks_are_copied_before_the_forward_writes_them():
    """Blocks lazy offload rescues were just given to the step's requests: their pages hold the bytes
    from before the forward, the other stores' pages the bytes the forward left, layer by layer."""
    layout = attention_layout("attn", LAYERS, TOKENS, 2, 64, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(LAYERS)}
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(BLOCKS, 2, TOKENS, 128, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    before = [t.clone() for t in kv]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB"}}, environ={}))
    with store:
        w = LayerwiseTransfer(store, [layout], [kv], names)
        rescue = PageOp("", 0, CHAINS[:2], [6, 1], [])
        later = PageOp("", 0, CHAINS[2:], [4, 2], [])
        w.begin(StepPlan(stores=[later], rescues=[rescue]))
        for i, name in enumerate(names):  # the forward writes every block of layer i, then its hook runs
            kv[i].add_(1)
            w.after_layer(name)
        w.end()
        out = [torch.zeros_like(t) for t in kv]
        r = LayerwiseTransfer(store, [layout], [out], names)
        r.begin(StepPlan(loads=[PageOp("x", 0, CHAINS, BLOCK_IDS, list(range(4)))]))
        r.start_loads()
        for name in names:
            r.before_layer(name)
        r.end()
        for i in range(LAYERS):
            assert torch.equal(out[i][[6, 1]], before[i][[6, 1]])
            assert torch.equal(out[i][[4, 2]], kv[i][[4, 2]])


def test_a_step_without_copies_does_not_wait_for_the_device():
    """On a GPU the end of a step waits for the kernel's queued copies, which sit behind the forward: a
    step that stores and loads nothing (most steps with lazy offload) must not wait."""
    store, w, op, full, empty, names = _setup()
    waits = []
    w._sync = lambda: waits.append(1)
    with store:
        w.begin(StepPlan())
        w.start_loads()
        for name in names:
            w.before_layer(name)
            w.after_layer(name)
        w.end()
        assert waits == []
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        for name in names:
            w.before_layer(name)
        w.end()
        assert waits == [1]


class _Log:
    """What the worker queued where: copies on the stream current at the time, events, waits."""

    def __init__(self) -> None:
        self.items: list[tuple] = []
        self.current = "compute"
        self.events = 0


class _FakeStreams(Streams):
    """A stream set that logs instead of queueing (the ordering protocol, tested without a GPU; the
    same path runs on CUDA streams in test_cuda_kernels.py)."""

    def __init__(self, name: str, log: _Log) -> None:
        super().__init__({"dev": None})
        self.name, self.log = name, log

    def record(self, timing: bool = False):
        self.log.events += 1
        self.log.items.append(("record", self.name, self.log.events))
        return {"dev": self.log.events}

    def wait(self, events) -> None:
        self.log.items.append(("wait", self.name, events["dev"]))

    @contextlib.contextmanager
    def active(self):
        before, self.log.current = self.log.current, self.name
        try:
            yield
        finally:
            self.log.current = before

    def take_seconds(self) -> float:
        self._timed = []
        return 1e-3

    def synchronize(self) -> None:
        self.log.items.append(("sync", self.name))


def _logged(w: LayerwiseTransfer) -> _Log:
    log = _Log()
    fake = SimpleNamespace(step=_FakeStreams("step", log), background=_FakeStreams("background", log))
    fake.compute = lambda: _FakeStreams("compute", log)
    w.copier.streams = fake
    for layer, lb in enumerate(w.layers[0]):
        for kind in ("gather", "scatter"):
            real = getattr(lb, kind)
            setattr(lb, kind, lambda runs, start, real=real, kind=kind, layer=layer:
                    (log.items.append((kind, layer, log.current)), real(runs, start)))
    return log


def test_copy_streams_queue_a_loads_layers_ahead_and_the_forward_waits_for_its_layer_alone():
    store, w, op, full, empty, names = _setup()
    with store:
        log = _logged(w)
        w.begin(StepPlan(loads=[op]))
        w.start_loads()
        w._loads[0].future.wait(LAYERS - 1)  # (memory hits: every layer has landed before the forward)
        events = {}
        for i, name in enumerate(names):
            log.items.clear()
            w.before_layer(name)
            if i == 0:  # every layer queued on the step stream, in order, an event after each
                assert [x[0] for x in log.items] == ["scatter", "record"] * LAYERS + ["wait"]
                assert all(x[2] == "step" for x in log.items if x[0] == "scatter")
                events = {x[1]: log.items[2 * x[1] + 1][2] for x in log.items if x[0] == "scatter"}
            else:
                assert [x[0] for x in log.items] == ["wait"]
            assert log.items[-1] == ("wait", "compute", events[i])  # this layer's copy alone
        log.items.clear()
        w.end()
        assert ("sync", "step") in log.items
        assert w.take_errors() == set()
        assert all(torch.equal(empty[i][BLOCK_IDS], full[i][BLOCK_IDS]) for i in range(LAYERS))


def test_copy_streams_start_a_store_after_its_layer_computed_and_follow_the_last_step():
    store, w, op, full, empty, names = _setup()
    with store:
        log = _logged(w)
        stores = PageOp("r", 0, [bytes([9, i]) * 8 for i in range(2)], [3, 5], [])
        rescue = PageOp("r", 0, [bytes([8, i]) * 8 for i in range(2)], [0, 7], [])
        w.begin(StepPlan(stores=[stores], rescues=[rescue]))
        # the step stream follows what the compute stream queued before; the rescues go on it, and
        # the forward waits for them before it may write their blocks
        kinds = [x[:2] for x in log.items]
        assert kinds[:2] == [("record", "compute"), ("wait", "step")]
        assert kinds[2:] == [("gather", i) for i in range(LAYERS)] + [("record", "step"), ("wait", "compute")]
        assert all(x[2] == "step" for x in log.items if x[0] == "gather")
        for i, name in enumerate(names):
            log.items.clear()
            w.after_layer(name)
            assert log.items[0][:2] == ("record", "compute") and log.items[1][:2] == ("wait", "step")
            assert log.items[1][2] == log.items[0][2]  # the step stream waits for layer i's compute ...
            assert [x for x in log.items if x[0] == "gather"] == [("gather", i, "step")]  # ... then copies it
            assert log.items.index(("gather", i, "step")) > 1
        w.end()
        assert w.stats.totals.stored_pages == 4


def test_copy_streams_hand_host_pages_back_only_once_the_stream_that_copies_them_is_done(monkeypatch):
    """Copies queued on the step stream read the fetched pages and write the step's store pages: those
    go back to the memory tier (where another page may take their slots) only after that stream is
    synchronized, at a step's end and when a step that never reached its end (the forward raised) is
    cleaned up by the next one."""
    from lmkv.store import StoreSession
    from lmkv.tiers.memory import Lease

    store, w, op, full, empty, names = _setup()
    with store:
        log = _logged(w)
        real_release, real_abort, real_commit = Lease.release, StoreSession.abort, StoreSession.commit
        monkeypatch.setattr(Lease, "release", lambda self: (log.items.append(("release",)), real_release(self)))
        monkeypatch.setattr(StoreSession, "abort", lambda self: (log.items.append(("abort",)), real_abort(self)))
        monkeypatch.setattr(StoreSession, "commit", lambda self, *a, **kw: (log.items.append(("commit",)),
                                                                           real_commit(self, *a, **kw))[1])
        stores = PageOp("r", 0, [bytes([9, i]) * 8 for i in range(2)], [3, 5], [])
        for finished in (True, False):
            log.items.clear()
            w.begin(StepPlan(loads=[op], stores=[stores]))
            w.start_loads()
            w.before_layer("l0")
            w.after_layer("l0")  # ... and the forward raises here when the step is not finished
            log.items.clear()
            if finished:
                for name in list(names)[1:]:
                    w.before_layer(name)
                    w.after_layer(name)
                log.items.clear()
                w.end()
            else:
                w.begin(StepPlan())  # the next step cleans the last one up
            kinds = [x[0] for x in log.items]
            handed_back = [i for i, k in enumerate(kinds) if k in ("release", "abort", "commit")]
            assert handed_back and ("sync", "step") in log.items
            assert log.items.index(("sync", "step")) < min(handed_back), log.items
            assert ("abort" in kinds) != finished and ("commit" in kinds) == finished
