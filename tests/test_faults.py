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
