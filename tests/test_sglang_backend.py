"""lmkv as SGLang's HiCache storage backend, on SGLang's real host pools and its dynamic backend factory.

SGLang's engine needs a GPU (its CPU build of sgl_kernel is not installable
here), so these tests call the backend the way ``HybridCacheController`` does,
with real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` / ``MambaPoolHost``
pools in every host layout, through ``StorageBackendFactory`` (which wraps it
in SGLang's failure injector when asked).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402  (after support.sglang_pools set up the import)
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from support.sglang_pools import fill_random, mamba_host, mha_host, mla_host, snapshot, zero

from lmkv.layout import StateKind

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
P = 4  # tokens per page


def backend(tmp_path, *, tp_size=1, tp_rank=0, mla=False, memory="64MiB", disk=True, metrics=False, **extra):
    """An lmkv backend made by SGLang's factory; ``extra``: more lmkv settings."""
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=False, model_name="org/tiny",
        extra_config={"backend_name": "lmkv", "module_path": "lmkv.connectors.sglang",
                      "class_name": "LMKVHiCacheStorage", "interface_v1": 1,
                      **({"memory": {"capacity": memory}} if memory else {}),
                      **({"disk": {"path": str(tmp_path / "disk")}} if disk else {}), **extra})
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def attach(b, **pools):
    """Register pools the way the controller does: the KV anchor first, then every entry, then the burst ends."""
    b.register_mem_pool_host(pools["kv"])
    for name, host in pools.items():
        b.register_mem_host_pool_v2(host, PoolName(name))
    b.on_host_pools_registered()
    return b


def page_hashes(n: int, seed: int = 0) -> list[str]:
    """SGLang-style chained sha256 page keys."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + np.arange(i * P, (i + 1) * P, dtype="<u4").tobytes() + bytes([seed])).digest()
        out.append(prev.hex())
    return out


def inner(b):
    """The lmkv backend under SGLang's optional failure-injector wrapper."""
    return getattr(b, "_backend", b)


# -- descriptors (issue 5) -------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_descriptors_from_real_host_pools(tmp_path, layout):
    mha, mla = mha_host(layout), mla_host(layout)
    b = attach(backend(tmp_path, disk=False), kv=mha, swa=mha_host(layout))
    kv = inner(b).pool("kv").layout
    assert kv.kind is StateKind.FULL_ATTENTION and [s.name for s in kv.segments] == ["k", "v"]
    assert kv.num_layers == 3 and kv.tokens_per_page == P and kv.dtype == "bfloat16"
    assert kv.payload_bytes == mha.get_size_per_token() * P  # every byte of a page, nothing else
    assert inner(b).pool("swa").layout.kind is StateKind.SLIDING_WINDOW
    b.close()

    b = attach(backend(tmp_path, disk=False, mla=True), kv=mla)
    lat = inner(b).pool("kv").layout
    assert lat.kind is StateKind.MLA and [s.name for s in lat.segments] == ["latent"]
    assert lat.payload_bytes == mla.get_size_per_token() * P
    b.close()


def test_mamba_descriptor_segments_and_tokens_per_page(tmp_path):
    mamba = mamba_host()
    b = attach(backend(tmp_path, disk=False), kv=mha_host("page_first_direct"), mamba=mamba)
    lay = inner(b).pool("mamba").layout
    assert lay.kind is StateKind.MAMBA and [s.name for s in lay.segments] == ["conv", "ssm"]
    assert lay.num_layers == mamba.num_mamba_layers and lay.tokens_per_page == P  # keyed by attention pages
    conv, ssm = mamba.conv_buffer[0][0], mamba.temporal_buffer[0]
    assert [s.nbytes for s in lay.segments] == [conv[0].numel() * conv.element_size(),
                                                ssm[0].numel() * ssm.element_size()]
    assert lay.dtype == "bfloat16+float32"
    b.close()


def test_tensor_parallel_descriptors_come_from_sglangs_config(tmp_path):
    """MLA is the same on every rank (one writer, one shared key); MHA heads and Mamba state are sharded."""
    for rank in (0, 1):
        b = attach(backend(tmp_path, disk=False, tp_size=2, tp_rank=rank, mla=True),
                   kv=mla_host("page_first_direct"), mamba=mamba_host())
        kv, st = inner(b).pool("kv").layout, inner(b).pool("mamba").layout
        assert kv.shard is None and kv.is_writer == (rank == 0)
        assert st.shard == rank and st.is_writer  # Mamba is sharded even beside MLA
        b.close()
        b = attach(backend(tmp_path, disk=False, tp_size=2, tp_rank=rank), kv=mha_host("page_first_direct"))
        assert inner(b).pool("kv").layout.shard == rank and inner(b).pool("kv").layout.is_writer
        b.close()


def test_unsupported_layout_fails_the_attach_with_a_clear_error(tmp_path):
    b = backend(tmp_path, disk=False)
    host = mha_host("page_head")
    with pytest.raises(NotImplementedError, match="page_first_direct"):
        attach(b, kv=host)
    assert b.batch_set_v1(page_hashes(1), torch.arange(P)) == [False]  # and transfers fail soft
    b.close()


# -- page format ------------------------------------------------------------------


def test_page_bytes_are_layer_major_with_k_then_v(tmp_path):
    """Layer l's K of an lmkv page is the byte range the layout names, whatever the host layout."""
    host = mha_host("page_first")
    fill_random(host)
    b = attach(backend(tmp_path, disk=False), kv=host)
    keys = page_hashes(2)
    assert b.batch_set_v1(keys, torch.arange(P, 3 * P)) == [True, True]  # host pages 1 and 2
    lay = inner(b).pool("kv").layout
    store = inner(b).store
    with store.fetch(inner(b).keys_for("kv", keys[1:]), lay) as got:
        payload = np.frombuffer(got.views[0], np.uint8)
        for layer in range(lay.num_layers):
            for seg, kv in ((0, 0), (1, 1)):
                a, e = lay.layer_range(layer, seg)
                want = host.kv_buffer[kv, 2 * P:3 * P, layer].contiguous().view(torch.uint8).numpy().ravel()
                assert np.array_equal(payload[a:e], want)
    b.close()


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("make", [mha_host, mla_host], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip_every_layout(tmp_path, make, layout):
    host = make(layout)
    fill_random(host, seed=3)
    ref = [host.get_data_page(p * P).clone() for p in range(8)]
    b = attach(backend(tmp_path, mla=make is mla_host), kv=host)
    keys = page_hashes(5)
    idx = torch.arange(2 * P, 7 * P)  # host pages 2..6
    assert b.batch_set_v1(keys, idx) == [True] * 5
    assert b.batch_exists(keys + page_hashes(2, seed=9)) == 5
    zero(host)
    store = inner(b).store
    store.drain()  # the write-through copies have landed
    store.memory.delete(store.memory.keys())  # so these are served from disk, checksums verified
    assert b.batch_get_v1(keys, idx) == [True] * 5
    for p in range(8):
        got = host.get_data_page(p * P)
        assert torch.equal(got, ref[p]) if 2 <= p <= 6 else not got.any()
    b.close()


def test_pages_move_between_host_layouts(tmp_path):
    """lmkv's page does not depend on SGLang's host layout: a page_first engine's pages load into page_first_direct."""
    src, dst = mha_host("page_first"), mha_host("page_first_direct")
    fill_random(src, seed=5)
    b = attach(backend(tmp_path), kv=src)
    keys = page_hashes(3)
    assert all(b.batch_set_v1(keys, torch.arange(0, 3 * P)))
    b.close()
    b = attach(backend(tmp_path), kv=dst)  # a fresh engine over the same disk tier
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys, torch.arange(4 * P, 7 * P)) == [True] * 3
    for p in range(3):
        assert torch.equal(dst.kv_buffer[:, 4 + p].transpose(1, 2), src.kv_buffer[:, p * P:(p + 1) * P])
    b.close()


def test_generic_flat_page_path(tmp_path):
    """Without interface_v1 SGLang calls batch_set/batch_get with flat pages in the host's order."""
    host = mha_host("page_first")
    fill_random(host, seed=7)
    b = attach(backend(tmp_path), kv=host)
    keys = page_hashes(2)
    pages = [host.get_data_page(i * P) for i in range(2)]
    assert b.batch_set(keys, pages)
    assert b.exists(keys[0]) and not b.exists(page_hashes(1, seed=4)[0])
    out = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(o, p) for o, p in zip(out, pages))
    zero(host)  # the same pages load through the zero-copy path too
    assert b.batch_get_v1(keys, torch.arange(0, 2 * P)) == [True, True]
    assert torch.equal(host.get_data_page(P), pages[1])
    assert b.get(page_hashes(1, seed=4)[0], host.get_dummy_flat_data_page()) is None
    b.close()


# -- sidecar pools (v2) --------------------------------------------------------------


def test_mamba_state_trailing_pages_and_restorable_prefixes(tmp_path):
    """One state per stored boundary: batch_exists_v2 answers the sparse set of prefix lengths
    whose state exists, and batch_get_v2 restores exactly those bytes."""
    kv, mamba = mha_host("page_first_direct"), mamba_host()
    fill_random(kv, 1)
    fill_random(mamba, 2)
    states = snapshot(mamba)
    b = attach(backend(tmp_path), kv=kv, mamba=mamba)
    keys = page_hashes(6)
    assert all(b.batch_set_v1(keys, torch.arange(0, 6 * P)))
    for page, slot in ((2, 1), (4, 3)):  # states stored at the ends of pages 2 and 4 (prefixes 2 and 4 pages)
        t = PoolTransfer(name=PoolName.MAMBA, keys=[keys[page - 1]], host_indices=torch.tensor([slot]),
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert b.batch_set_v2([t]) == {PoolName.MAMBA: [True]}
    query = PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    res = b.batch_exists_v2(keys, [query])
    assert res.restorable_prefix_pages == [2, 4] and res.kv_hit_pages == 4
    assert res.extra_pool_hit_pages[PoolName.MAMBA] == 4
    zero(mamba)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[keys[3]], host_indices=torch.tensor([6]),
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert got == {PoolName.MAMBA: [True]}
    after = snapshot(mamba)
    assert all(torch.equal(a[6], s[3]) for a, s in zip(after, states))  # slot 3's state, now in slot 6
    miss = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[keys[2]], host_indices=torch.tensor([5]))])
    assert miss == {PoolName.MAMBA: [False]}
    b.close()


def test_swa_pool_and_all_pages_policy(tmp_path):
    kv, swa = mha_host("page_first_direct"), mha_host("page_first_direct", layers=2)
    fill_random(kv, 1)
    fill_random(swa, 2)
    b = attach(backend(tmp_path), kv=kv, swa=swa)
    keys = page_hashes(4)
    assert all(b.batch_set_v1(keys, torch.arange(0, 4 * P)))
    t = PoolTransfer(name=PoolName.SWA, keys=keys[2:4], host_indices=torch.arange(2 * P, 4 * P),
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_set_v2([t]) == {PoolName.SWA: [True, True]}
    window = PoolTransfer(name=PoolName.SWA, keys=keys[2:4], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_exists_v2(keys, [window]).restorable_prefix_pages == [4]
    every = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert b.batch_exists_v2(keys, [every]).kv_hit_pages == 0  # page 1's SWA KV is missing
    ref = swa.kv_buffer[:, 2:4].clone()
    zero(swa)
    assert b.batch_get_v2([t]) == {PoolName.SWA: [True, True]}
    assert torch.equal(swa.kv_buffer[:, 2:4], ref)
    b.close()


# -- tensor parallelism: two ranks over one shared tier --------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha-sharded", "mla-replicated"])
def test_two_ranks_share_one_disk_tier(tmp_path, mla):
    make = mla_host if mla else mha_host
    hosts = [make("page_first_direct") for _ in range(2)]
    for r, h in enumerate(hosts):
        fill_random(h, seed=10 + (0 if mla else r))  # MLA ranks hold the same latents; MHA ranks their own heads
    refs = [snapshot(h)[0] for h in hosts]
    keys = page_hashes(3)
    ranks = [attach(backend(tmp_path, tp_size=2, tp_rank=r, mla=mla, memory="8MiB"), kv=h)
             for r, h in enumerate(hosts)]
    for b in ranks:
        assert b.batch_set_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
    for b in ranks:
        b.close()  # write-through copies land on disk before the engines go
    from lmkv.config import DiskConfig
    from lmkv.tiers.disk import DiskTier

    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk")))
    assert disk.wait_indexed(30) and len(disk) == (3 if mla else 6)  # replicated: written once; sharded: once per rank
    disk.close()
    for r, h in enumerate(hosts):  # fresh engines: each rank restores its own bytes from the shared tier
        zero(h)
        b = attach(backend(tmp_path, tp_size=2, tp_rank=r, mla=mla, memory="8MiB"), kv=h)
        assert b.batch_get_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
        assert torch.equal(h.kv_buffer[:3], refs[r][:3]) if mla else torch.equal(h.kv_buffer[:, :3], refs[r][:, :3])
        b.close()


# -- failures become recomputation ----------------------------------------------------------


def test_corrupt_page_is_a_miss_from_there(tmp_path):
    host = mha_host("page_first_direct")
    fill_random(host)
    b = attach(backend(tmp_path), kv=host)
    keys = page_hashes(3)
    assert all(b.batch_set_v1(keys, torch.arange(0, 3 * P)))
    store = inner(b).store
    store.drain()
    store.memory.delete(store.memory.keys())
    victim = inner(b).keys_for("kv", keys[1:2])[0]
    path = next(p for p in (tmp_path / "disk").rglob("*") if p.is_file() and victim.hex() in p.name)
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF  # inside the payload (the header takes the first 4 KiB)
    path.write_bytes(bytes(raw))
    assert b.batch_get_v1(keys, torch.arange(4 * P, 7 * P)) == [True, False, True]  # SGLang stops at page 1
    b.close()


def test_bad_requests_and_sglangs_failure_injector_never_raise(tmp_path, monkeypatch):
    host = mha_host("page_first_direct")
    b = attach(backend(tmp_path), kv=host)
    keys = page_hashes(2)
    assert b.batch_set_v1(keys, torch.arange(0, P)) == [False, False]  # index count does not match
    assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.arange(2))]) == \
        {PoolName.MAMBA: [False, False]}  # no such pool registered
    b.close()
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    b = attach(backend(tmp_path), kv=host)
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, torch.arange(0, 2 * P)) == [False, False]
    b.close()


def test_remote_backend_down_is_a_miss(tmp_path):
    host = mha_host("page_first_direct")
    b = attach(backend(tmp_path, disk=False, remote={"url": "lmkv://127.0.0.1:1", "connect_timeout": 0.2}), kv=host)
    keys = page_hashes(2)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, torch.arange(0, 2 * P)) == [True, True]  # memory took them; the remote copy is queued
    assert b.batch_exists(keys) == 2
    b.close()


def test_pages_through_the_mooncake_tier_verified_and_a_damaged_one_is_a_miss(tmp_path):
    """The backend over a real ``mooncake_master`` (no disk): SGLang's pages written through to Mooncake
    come back byte for byte once memory has dropped them; a page damaged in Mooncake is a miss from
    there (SGLang recomputes it and the pages after it)."""
    pytest.importorskip("mooncake.store")
    from lmkv.dev.mooncake_master import start_master

    host = mha_host("page_first_direct")
    fill_random(host, seed=11)
    ref = [host.get_data_page(p * P).clone() for p in range(3)]
    with start_master() as m:
        remote = {"url": m.url, "timeout": 5.0, "mooncake": {"segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                                                             "staging_size": 8 << 20}}
        b = attach(backend(tmp_path, disk=False, memory="8MiB", remote=remote), kv=host)
        keys = page_hashes(3)
        assert b.batch_set_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
        store = inner(b).store
        store.drain()
        store.memory.delete(store.memory.keys())
        assert store.lookup(inner(b).keys_for("kv", keys)).tiers == ("mooncake",) * 3
        zero(host)
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, torch.arange(0, 3 * P)) == [True] * 3
        assert all(torch.equal(host.get_data_page(p * P), ref[p]) for p in range(3))
        store.memory.delete(store.memory.keys())
        tier = store.tiers[-1]
        victim = tier._name(inner(b).keys_for("kv", keys[1:2])[0])
        raw, staging = tier._client(), tier._staging
        size = raw.get_size(victim)
        assert raw.batch_get_into([victim], [staging.ctypes.data], [size]) == [size]
        staging[size - 1] ^= 0xFF  # the payload's last byte
        assert raw.batch_remove([victim], True) == [0]
        assert raw.batch_put_from([victim], [staging.ctypes.data], [size]) == [0]
        zero(host)
        assert b.batch_get_v1(keys, torch.arange(0, 3 * P)) == [True, False, True]  # SGLang stops at page 1
        assert torch.equal(host.get_data_page(0), ref[0])
        b.close()


def test_bad_config_is_a_clear_error(tmp_path):
    from lmkv.config import ConfigError

    with pytest.raises(ConfigError, match="store.write_polcy: unknown setting"):
        backend(tmp_path, disk=False, store={"write_polcy": "write_back"})


def test_the_launch_examples_backend_config_works(tmp_path):
    """examples/sglang_serve.sh's extra config, as SGLang's factory would receive it."""
    import json
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "examples" / "sglang_serve.sh").read_text()
    extra = json.loads(re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", text, re.S).group(1))
    assert "--hicache-mem-layout page_first_direct" in text
    extra["disk"]["path"] = str(tmp_path / "disk")
    extra["memory"]["capacity"] = "16MiB"
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="org/tiny", extra_config=extra)
    b = attach(StorageBackendFactory.create_backend("dynamic", cfg, None), kv=mha_host("page_first_direct"))
    assert type(inner(b)).__name__ == "LMKVHiCacheStorage"
    assert b.batch_set_v1(page_hashes(1), torch.arange(P)) == [True]
    b.close()


# -- robustness: nothing raises into SGLang (issue 20) ------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_indices_outside_the_pool_are_refused_not_raised_or_wrapped(tmp_path, layout):
    """Indices past the pool's end raised IndexError into SGLang's I/O threads; negative ones would
    have wrapped around to other pages. Both are a per-page False now, and no page is touched."""
    host = mha_host(layout)
    fill_random(host, seed=4)
    before = snapshot(host)
    b = attach(backend(tmp_path), kv=host)
    pages = inner(b).pool("kv").num_pages
    keys = page_hashes(2)
    for idx in (torch.arange(pages * P, (pages + 2) * P), torch.arange(-2 * P, 0), torch.arange(10**6, 10**6 + 2 * P)):
        assert b.batch_set_v1(keys, idx) == [False, False]
        assert b.batch_get_v1(keys, idx) == [False, False]
        assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=idx)]) == \
            {PoolName.KV: [False, False]}
    assert b.batch_exists(keys) == 0
    assert all(torch.equal(a, c) for a, c in zip(before, snapshot(host)))
    b.close()


def test_calls_after_close_are_misses(tmp_path):
    host = mha_host("page_first_direct")
    b = attach(backend(tmp_path), kv=host)
    keys = page_hashes(2)
    assert b.batch_set_v1(keys, torch.arange(0, 2 * P)) == [True, True]
    b.close()
    assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
    assert b.batch_get_v1(keys, torch.arange(0, 2 * P)) == [False, False]
    assert b.batch_set_v1(keys, torch.arange(0, 2 * P)) == [False, False]
    assert b.batch_exists_v2(keys).kv_hit_pages == 0
    assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=torch.arange(0, 2 * P))]) == \
        {PoolName.KV: [False, False]}
    b.clear()
    b.close()


def test_sglangs_own_extra_config_keys_are_accepted_and_lmkvs_still_checked(tmp_path):
    from lmkv.config import ConfigError

    own = {"allocator": "shm", "prefetch_threshold": 128, "hicache_storage_pass_prefix_keys": True,
           "tp_lcm_size": 2}
    b = backend(tmp_path, **own)
    b.close()
    with pytest.raises(ConfigError, match="allocatr: unknown setting"):
        backend(tmp_path, allocatr="shm")


EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_sglang_backend import attach, backend, mha_host, page_hashes, P
from pathlib import Path
host = mha_host("page_first_direct")
from support.sglang_pools import fill_random
fill_random(host, seed=1)
b = attach(backend(Path({tmp!r})), kv=host)
print(b.batch_set_v1(page_hashes(8), torch.arange(0, 8 * P)).count(True), flush=True)
# exits here without close(): the copies down to disk are still on their way
"""


def test_acknowledged_pages_reach_disk_when_the_process_exits_without_close(tmp_path):
    """Pages ``batch_set_v1`` acknowledged were lost (0-8 of 8) when the process exited without
    ``close()``: the write-through copies failed as Python shut its thread pools down. They are
    flushed at exit now; three runs, every page on disk each time."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    for run in range(3):
        where = tmp_path / f"run{run}"
        where.mkdir()
        out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(tests=tests, tmp=str(where))],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == "8"
        assert len(list((where / "disk").rglob("*.page"))) == 8, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


def test_storage_metrics_for_sglangs_collector(tmp_path):
    """``--enable-storage-metrics``: SGLang's collector reads get_stats() after each drain and logs
    pages per operation and GB/s into its histograms; each call reports what came since the last."""
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    host = mha_host("page_first_direct")
    fill_random(host, seed=2)
    b = attach(backend(tmp_path, metrics=True), kv=host)
    keys = page_hashes(5)
    assert b.batch_set_v1(keys, torch.arange(0, 5 * P)) == [True] * 5
    assert b.batch_set_v1(keys, torch.arange(0, 5 * P)) == [True] * 5  # held already: nothing moves
    assert b.batch_get_v1(keys[:3], torch.arange(5 * P, 8 * P)) == [True] * 3
    stats = b.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [5] and stats.prefetch_pgs == [3]
    assert all(bw > 0 for bw in stats.backup_bandwidth + stats.prefetch_bandwidth)
    StorageMetricsCollector(labels={"model_name": "t"}).log_storage_metrics(stats)  # SGLang's own consumer
    again = b.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []
    b.close()
    off = attach(backend(tmp_path / "off"), kv=mha_host("page_first_direct"))
    assert off.get_stats() is None
    off.close()
