import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import random_payload

from lmkv.config import load_config
from lmkv.errors import TierFullError
from lmkv.keys import KeySpace, chain_hashes, page_keys
from lmkv.store import TieredStore


def _store(tmp_path, layout, mem_pages=4, **store_cfg) -> TieredStore:
    store_cfg.setdefault("write_policy", "write_back")  # most tests here watch demotion
    cfg = {"memory": {"capacity": mem_pages * layout.payload_bytes, "slab_size": layout.payload_bytes}}
    if tmp_path is not None:
        cfg["disk"] = {"path": str(tmp_path / "disk")}
    cfg["store"] = store_cfg
    return TieredStore(load_config(cfg, environ={}))


def _prefix_keys(layout, n, salt=0):
    toks = np.arange(n * layout.tokens_per_page) + salt * 10_000
    return page_keys(chain_hashes(KeySpace("m").root, toks, layout.tokens_per_page), layout)


def test_lookup_is_prefix_ordered_across_tiers(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=2) as st:
        keys = _prefix_keys(layout, 6)
        payloads = [random_payload(layout, i) for i in range(6)]
        st.put(keys[:4], [layout] * 4, payloads[:4])  # write-back: 2 in memory, 2 demoted to disk
        assert sorted(st.lookup(keys[:4]).tiers) == ["disk", "disk", "memory", "memory"]
        st.put(keys[5:], [layout], payloads[5:])  # page 4 missing: page 5 cannot count
        assert st.lookup(keys).pages == 4
        st.delete(keys[:1])
        assert st.lookup(keys).pages == 0


def test_lower_tier_hit_is_promoted(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=2) as st:
        keys = _prefix_keys(layout, 3)
        payloads = [random_payload(layout, i) for i in range(3)]
        st.put(keys, [layout] * 3, payloads)
        assert st.lookup(keys[:1]).tiers == ("disk",)
        outs = [np.zeros_like(p) for p in payloads]
        assert all(h is not None for h in st.get(keys, layout, outs))
        assert all((o == p).all() for o, p in zip(outs, payloads))
        assert st.memory.contains(keys[:1]) == [True]


def test_write_through_reaches_every_tier(tmp_path, layout):
    with _store(tmp_path, layout, write_policy="write_through") as st:
        keys = _prefix_keys(layout, 2)
        st.put(keys, [layout] * 2, [random_payload(layout, i) for i in range(2)])
        assert st.tiers[1].contains(keys) == [True, True]
        with st.open_session(_prefix_keys(layout, 1, salt=1), [layout]) as s:
            s.write(0, 0, random_payload(layout, 5))
            s.commit()
        s.written_through.result(timeout=30)
        assert len(st.tiers[1]) == 3


def test_write_back_keeps_disk_empty_until_eviction(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=4) as st:
        keys = _prefix_keys(layout, 4)
        st.put(keys, [layout] * 4, [random_payload(layout, i) for i in range(4)])
        assert len(st.tiers[1]) == 0
        st.put(_prefix_keys(layout, 1, salt=2), [layout], [random_payload(layout, 9)])
        assert len(st.tiers[1]) == 1 and st.lookup(keys).pages == 4


def test_session_abort_leaves_nothing_anywhere(tmp_path, layout):
    with _store(tmp_path, layout, write_policy="write_through") as st:
        keys = _prefix_keys(layout, 2)
        with pytest.raises(RuntimeError):
            with st.open_session(keys, [layout] * 2) as s:
                s.write(0, 0, random_payload(layout))
                raise RuntimeError("forward failed")
        assert st.lookup(keys).pages == 0
        assert st.memory.used_bytes == 0 and len(st.tiers[1]) == 0


def test_session_larger_than_memory_is_refused(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=2) as st:
        with pytest.raises(TierFullError):
            st.open_session(_prefix_keys(layout, 3), [layout] * 3)
        assert st.memory.used_bytes == 0


def test_clear_is_scoped_to_a_domain_in_every_tier(tmp_path, layout):
    with _store(tmp_path, layout, write_policy="write_through") as st:
        mine, theirs = _prefix_keys(layout, 2), _prefix_keys(layout, 2, salt=1)
        st.put(mine, [layout] * 2, [random_payload(layout, i) for i in range(2)])
        st.put(theirs, [layout] * 2, [random_payload(layout, i) for i in range(2)], domain="shared-owner")
        st.clear()
        assert st.lookup(mine).pages == 0 and st.lookup(theirs).pages == 2
        assert st.tiers[1].contains(theirs) == [True, True]


@pytest.mark.asyncio
async def test_async_api(tmp_path, layout):
    with _store(tmp_path, layout) as st:
        keys = _prefix_keys(layout, 2)
        payloads = [random_payload(layout, i) for i in range(2)]
        assert await st.aput(keys, [layout] * 2, payloads) == [True, True]
        assert (await st.alookup(keys)).pages == 2
        outs = [np.zeros_like(p) for p in payloads]
        await asyncio.gather(*(st.aget([k], layout, [o]) for k, o in zip(keys, outs)))
        assert all((o == p).all() for o, p in zip(outs, payloads))


@pytest.mark.asyncio
async def test_async_api_over_the_server_from_many_coroutines(layout):
    """The store's async calls run on its I/O threads: coroutines sharing one store over an lmkv
    server (its client pool) all get their own pages back, and the event loop is
    never blocked by a transfer (a ticker keeps running meanwhile)."""
    from lmkv.dev.server_process import spawn

    with spawn("--memory", "64MiB") as server:
        cfg = load_config({"memory": {"capacity": 4 * layout.payload_bytes, "slab_size": layout.payload_bytes},
                           "store": {"write_policy": "write_through"}, "remote": {"url": server.url}}, environ={})
        with TieredStore(cfg) as st:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.001)
                    ticks += 1

            async def client(c: int) -> bool:
                keys = _prefix_keys(layout, 3, salt=100 + c)
                payloads = [random_payload(layout, 10 * c + i) for i in range(3)]
                assert await st.aput(keys, [layout] * 3, payloads) == [True] * 3
                await asyncio.to_thread(st.drain)  # the copies down to the server, off the loop
                outs = [np.zeros_like(p) for p in payloads]
                got = await st.aget(keys, layout, outs)
                return all(h is not None for h in got) and all((o == p).all() for o, p in zip(outs, payloads))

            tick = asyncio.create_task(ticker())
            results = await asyncio.gather(*(client(c) for c in range(12)))
            tick.cancel()
            assert all(results)
            assert ticks > 0
            assert st.tiers[-1].stats.hits > 0  # most pages came back from the server (memory holds 4)


def test_metrics_count_hits_misses_bytes_and_latency(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=1) as st:
        keys = _prefix_keys(layout, 2)
        st.put(keys, [layout] * 2, [random_payload(layout, i) for i in range(2)])
        outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
        st.get(keys, layout, outs)
        m = st.metrics
        assert m.value("lmkv_hits_total", tier="memory") + m.value("lmkv_hits_total", tier="disk") == 2
        assert m.value("lmkv_bytes_total", tier="disk", direction="put") >= layout.payload_bytes
        assert m.value("lmkv_op_seconds_count", op="get") == 1
        assert m.value("lmkv_pages", tier="disk") >= 1
        assert b"lmkv_capacity_bytes" in m.exposition()
        stats = st.stats()
        assert stats["memory"]["pages"] == 1 and stats["disk"]["capacity_bytes"] > 0


def test_memory_only_store(layout):
    with _store(None, layout) as st:
        keys = _prefix_keys(layout, 5)
        st.put(keys, [layout] * 5, [random_payload(layout, i) for i in range(5)])
        assert len(st.tiers) == 1
        assert st.lookup(keys).pages == 0  # the oldest page was evicted: no prefix at all
        assert st.lookup(keys[1:]).pages == 4


def test_bench_tiers_quick_json_shape(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lmkv.cli", "bench", "tiers", "--quick", "--json", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    report = json.loads(out.stdout)
    assert report["bench"] == "tiers" and report["lmkv_version"]
    for what in ("memory.put", "memory.get", "disk.put", "disk.get.{}.hot", "disk.get.{}.cold",
                 "disk.get_layer.{}.hot"):
        for size in ("256KiB", "2MiB", "16MiB"):
            name = what.format(size) if "{}" in what else f"{what}.{size}"
            m = report["metrics"][name]
            assert m["unit"] == "GB/s" and m["value"] > 0 and m["baseline"] > 0
            assert m["ratio"] == pytest.approx(m["value"] / m["baseline"])
            assert m["baseline_what"]
    # hot against page-cached files, cold against files dropped from the cache: never hot vs cold
    assert "page-cached" in report["metrics"]["disk.get.2MiB.hot"]["baseline_what"]
    assert "dropped" in report["metrics"]["disk.get.2MiB.cold"]["baseline_what"]
    assert not list(tmp_path.iterdir())  # the bench cleans up its files


def test_fetch_lends_memory_pages_and_promotes_lower_tier_hits(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=2) as st:
        keys = _prefix_keys(layout, 4)
        payloads = [random_payload(layout, i) for i in range(4)]
        st.put(keys, [layout] * 4, payloads)  # pages 0, 1 demoted to disk
        with st.fetch(keys[:2] + [bytes(16)], layout) as f:
            assert f.views[2] is None
            assert all((v == p).all() for v, p in zip(f.views[:2], payloads[:2]))
        assert st.memory.contains(keys[:2]) == [True, True]
        assert st.tiers[1].stats.hits == 2


def test_fetch_reports_a_corrupt_lower_tier_page_as_failed(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=1) as st:
        keys = _prefix_keys(layout, 2)
        st.put(keys, [layout] * 2, [random_payload(layout, i) for i in range(2)])
        (f,) = list((tmp_path / "disk").rglob(keys[0].hex() + ".page"))
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        with st.fetch(keys, layout) as got:
            assert got.views[0] is None and got.views[1] is not None
        assert st.tiers[1].stats.corrupt == 1 and st.lookup(keys).pages == 0


def test_write_back_flushes_memory_to_disk_on_close(tmp_path, layout):
    keys = _prefix_keys(layout, 3)
    payloads = [random_payload(layout, i) for i in range(3)]
    with _store(tmp_path, layout, mem_pages=8) as st:
        st.put(keys, [layout] * 3, payloads)
        st.put(keys[:1], [layout], payloads[:1], domain="other")
        assert len(st.tiers[1]) == 0
    with _store(tmp_path, layout, mem_pages=8) as again:
        assert again.lookup(keys).tiers == ("disk", "disk", "disk")
        assert sorted(again.tiers[1].owners(keys[0])) == ["engine", "other"]
        outs = [np.zeros_like(p) for p in payloads]
        assert all(h is not None for h in again.get(keys, layout, outs))
        assert all((o == p).all() for o, p in zip(outs, payloads))


def test_fetch_without_promotion_reads_into_its_own_buffers(tmp_path, layout):
    with _store(tmp_path, layout, mem_pages=4, promote_on_hit=False, write_policy="write_through") as st:
        keys = _prefix_keys(layout, 2)
        payloads = [random_payload(layout, i) for i in range(2)]
        st.put(keys, [layout] * 2, payloads)
        st.memory.delete(keys)  # only the disk has them now
        with st.fetch(keys, layout) as f:
            assert all((v == p).all() for v, p in zip(f.views, payloads))
        assert st.memory.contains(keys) == [False, False] and st.memory.used_bytes == 0


def _unit_buffers(layout, n):
    """One buffer per unit of each of n pages, spread over a larger block of memory like an engine's rows."""
    rows = np.zeros((n, layout.num_layers, layout.layer_stride + 64), np.uint8)
    bounds = [(layout.segment_offset(s), layout.segment_offset(s) + seg.nbytes)
              for s, seg in enumerate(layout.segments)]
    return rows, [[rows[i, lay, a:b] for lay in range(layout.num_layers) for a, b in bounds] for i in range(n)]


def _joined(units):
    return np.concatenate(units)


@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_get_units_reads_pages_into_engine_buffers_from_every_tier(tmp_path, layout, io):
    """Memory pages are copied from the arena, buffered disk pages read in place without a stop in
    memory; O_DIRECT disk pages are staged (and promoted); a corrupt page is None and dropped."""
    from lmkv.tiers.posix_io import probe_direct_io

    if io == "direct" and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    cfg = {"memory": {"capacity": 8 * layout.payload_bytes, "slab_size": layout.payload_bytes},
           "disk": {"path": str(tmp_path / "disk"), "io": io}, "store": {"write_policy": "write_through"}}
    with TieredStore(load_config(cfg, environ={})) as st:
        keys = _prefix_keys(layout, 4)
        payloads = [random_payload(layout, i) for i in range(4)]
        st.put(keys, [layout] * 4, payloads)
        st.drain()
        st.memory.delete(keys[2:])  # pages 2 and 3 only on disk
        (f,) = list((tmp_path / "disk").rglob(keys[3].hex() + ".page"))
        data = bytearray(f.read_bytes())
        data[4096 + 7] ^= 0x55
        f.write_bytes(bytes(data))
        _, units = _unit_buffers(layout, 4)
        got = st.get_units(keys, layout, units)
        assert [h is not None for h in got] == [True, True, True, False]
        for i in range(3):
            assert np.array_equal(_joined(units[i]), payloads[i])
        assert st.tiers[1].stats.corrupt == 1 and not st.contains(keys[3:])[0]
        promoted = st.memory.contains(keys[2:3])[0]
        assert promoted == (io == "direct")  # buffered: the page cache is the disk tier's memory


def test_get_units_through_a_fault_injector_still_reads_in_place(tmp_path, layout):
    """The fault wrapper keeps its tier's in-place reads (fault benches and tests run the read path
    production takes): buffered disk pages land in the engine's buffers without a stop in memory."""
    cfg = {"memory": {"capacity": 8 * layout.payload_bytes, "slab_size": layout.payload_bytes},
           "disk": {"path": str(tmp_path / "disk"), "io": "buffered"}, "store": {"write_policy": "write_through"},
           "faults": {"disk": {"missing_rate": 0.0}}}
    with TieredStore(load_config(cfg, environ={})) as st:
        keys = _prefix_keys(layout, 2)
        payloads = [random_payload(layout, i) for i in range(2)]
        st.put(keys, [layout] * 2, payloads)
        st.drain()
        st.memory.delete(keys)
        _, units = _unit_buffers(layout, 2)
        assert all(h is not None for h in st.get_units(keys, layout, units))
        assert all(np.array_equal(_joined(u), p) for u, p in zip(units, payloads))
        assert not any(st.memory.contains(keys))  # not staged (a staged read promotes)


def test_write_through_evictions_never_write_again_what_the_tier_below_dropped(tmp_path, layout):
    """Under write-through each page goes down once, as it is stored: when memory evicts a page
    the disk tier has dropped meanwhile, it is not written again (nor asked about)."""
    with _store(tmp_path, layout, mem_pages=4, write_policy="write_through") as st:
        keys = _prefix_keys(layout, 8)
        payloads = [random_payload(layout, i) for i in range(8)]
        st.put(keys[:4], [layout] * 4, payloads[:4])
        st.drain()
        disk = st.tiers[1]
        disk.delete(keys[:4])  # (the disk tier evicted them: they were its coldest)
        asked = []
        contains = disk.contains
        disk.contains = lambda ks: (asked.append(list(ks)), contains(ks))[1]
        st.put(keys[4:], [layout] * 4, payloads[4:])  # memory evicts the first 4
        st.drain()
        assert disk.stats.puts == 8
        assert not [k for ks in asked for k in ks if k in keys[:4]]
        assert st.lookup(keys[4:]).pages == 4


def test_work_submitted_after_other_futures_runs_once_they_are_all_done_and_drain_waits_for_it(layout):
    from concurrent.futures import Future

    with TieredStore(load_config({"memory": {"capacity": "8MiB"}}, environ={})) as store:
        first, second = Future(), Future()
        ran: list[str] = []
        out = store.submit_after([first, second], lambda: ran.append("ran") or 7)
        first.set_result(None)
        assert not ran and not out.done()  # (one still running: nothing waits on a thread meanwhile)
        second.set_exception(RuntimeError("a failed one counts as done"))
        store.drain(timeout=10)
        assert out.result(timeout=0) == 7 and ran == ["ran"]
        failing = store.submit_after([], lambda: 1 / 0)
        store.drain(timeout=10)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=0)
