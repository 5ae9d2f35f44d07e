"""Injected faults turn into misses the caller can recompute; nothing raises, nothing wrong is served."""

import numpy as np
import pytest
from conftest import random_key, random_payload

from lmkv.config import ConfigError, load_config
from lmkv.store import TieredStore


def _store(tmp_path, layout, **faults) -> TieredStore:
    cfg = {"memory": {"capacity": 8 * layout.payload_bytes, "slab_size": layout.payload_bytes},
           "disk": {"path": str(tmp_path / "disk")}, "faults": {"disk": {"seed": 3, **faults}}}
    return TieredStore(load_config(cfg, environ={}))


def _fill(st, layout, n=6):
    keys = [random_key() for _ in range(n)]
    payloads = [random_payload(layout, i) for i in range(n)]
    st.put(keys, [layout] * n, payloads)
    st.drain()
    st.memory.delete(keys)  # only the disk has them now
    return keys, payloads


@pytest.mark.parametrize("fault", ["corrupt_rate", "missing_rate", "short_read_rate"])
def test_every_read_fault_is_a_clean_miss(tmp_path, layout, fault):
    with _store(tmp_path, layout, **{fault: 1.0}) as st:
        keys, _ = _fill(st, layout)
        assert st.lookup(keys).pages == 6  # the lookup saw them
        with st.fetch(keys, layout) as f:
            assert f.views == [None] * 6
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        assert st.get(keys, layout, outs) == [None] * 6
        disk = st.tiers[1]
        assert sum(disk.injected.values()) == 12
        if fault == "corrupt_rate":
            assert disk.stats.corrupt == 12  # every flipped bit was caught by the checksum


def test_partial_faults_serve_only_good_pages(tmp_path, layout):
    with _store(tmp_path, layout, corrupt_rate=0.3, missing_rate=0.2) as st:
        keys, payloads = _fill(st, layout, n=40)
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        got = st.get(keys, layout, outs)
        good = [i for i, h in enumerate(got) if h is not None]
        assert 0 < len(good) < 40
        assert all((outs[i] == payloads[i]).all() for i in good)


def test_outage_window_makes_the_tier_absent_then_it_returns(tmp_path, layout):
    with _store(tmp_path, layout) as st:
        keys, payloads = _fill(st, layout)
    with _store(tmp_path, layout, outages=[[0, 3600]]) as down:
        assert down.lookup(keys).pages == 0  # a backend that is down holds nothing for now
        assert down.get(keys, layout, [np.zeros_like(p) for p in payloads]) == [None] * 6
        assert down.put([random_key()], [layout], [payloads[0]]) == [True]  # memory still takes it
        assert down.tiers[1].stats.errors >= 3
    with _store(tmp_path, layout) as up:
        assert up.lookup(keys).pages == 6


def test_faults_name_a_lower_tier():
    with pytest.raises(ValueError, match="no lower tier named"):
        TieredStore(load_config({"faults": {"disk": {}}}, environ={}))
    with pytest.raises(ConfigError, match="faults.disk.corrupt_rate"):
        load_config({"faults": {"disk": {"corrupt_rate": 2}}}, environ={})


def test_a_fault_on_the_in_place_read_path_is_recomputed(tmp_path):
    """A waiting request's pages load from a buffered disk tier straight into the engine's blocks
    (the read path a CPU engine's loads take in production: nothing is staged through memory), with
    the fault injector in front of it. Injected corruption fails that load: the request is reported
    for recomputation, its pages' chains for quarantine, and nothing it read counts as loaded."""
    import torch

    from lmkv.engine.plan import PageOp, StepPlan
    from lmkv.engine.worker import LayerwiseTransfer
    from lmkv.keys import ChainHash, page_key
    from lmkv.layout import attention_layout
    from lmkv.tiers.base import in_place_reader

    layout = attention_layout("attn", 3, 16, 2, 64, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(3)}
    gen = torch.Generator().manual_seed(5)
    held = [torch.randn(8, 2, 16, 128, generator=gen).to(torch.bfloat16) for _ in range(3)]
    chains = [ChainHash(bytes([i + 1]) * 16) for i in range(4)]
    blocks = [6, 1, 4, 2]
    op = PageOp("r", 0, chains, blocks, list(range(4)))
    keys = [page_key(c, layout) for c in chains]

    def store(faults: dict | None) -> TieredStore:
        cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk"), "io": "buffered"},
               "store": {"write_policy": "write_through"}}
        return TieredStore(load_config({**cfg, "faults": {"disk": faults}} if faults else cfg, environ={}))

    with store(None) as st:  # the engine stored these pages (through to disk) before
        w = LayerwiseTransfer(st, [layout], [held], names)
        w.begin(StepPlan(stores=[op]))
        for name in names:
            w.after_layer(name)
        w.end()
        st.drain()
    for faults in (None, {"corrupt_rate": 1.0, "seed": 1}):
        with store(faults) as st:  # restarted: memory is empty, the disk tier has the pages
            assert in_place_reader(st.tiers[1]) is not None
            empty = [torch.zeros_like(t) for t in held]
            w = LayerwiseTransfer(st, [layout], [empty], names)
            w.begin(StepPlan(async_loads=[op]))
            w.start_loads()
            done: set[str] = set()
            failed: set[str] = set()
            for _ in range(2000):
                d, f = w.transfer_results(idle=True)
                done, failed = done | d, failed | f
                if done:
                    break
            w.end()
            assert done == {"r"}
            assert not any(st.memory.contains(keys))  # read in place: not staged through memory
            if faults is None:
                assert not failed and w.stats.totals.loaded_pages == 4
                assert all(torch.equal(e[blocks], h[blocks]) for e, h in zip(empty, held))
            else:
                assert failed == {"r"}  # the engine recomputes the request
                assert st.tiers[1].injected["corrupt"] == 4 and st.tiers[1].stats.corrupt == 4
                assert w.stats.totals.loaded_pages == 0 and w.stats.totals.failed_pages == 4
                assert sorted(w.take_failed_chains()) == sorted(chains)
                # what the failed reads left in the blocks (bytes that failed their checksum, a NaN
                # among them perhaps) is gone: the engine's recompute rewrites only the tokens it has
                assert all(not e[blocks].any() for e in empty)
