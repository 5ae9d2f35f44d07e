"""Per-account limits in the memory and disk tiers, and domains that are forgotten with their last page.

Accounts are what ``lmkv serve`` charges tenants' pages to; here they are driven directly, with the
server's rule for naming them (a domain's account is what precedes its first dot).
"""

import os

import numpy as np
import pytest
from conftest import random_key, random_payload

from lmkv.config import DiskConfig, MemoryConfig
from lmkv.domains import DomainRegistry
from lmkv.page import disk_page_bytes, make_header
from lmkv.tiers.accounts import Accounts, Limit
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.memory import MemoryTier


def account_of(domain: str) -> str:
    return domain.split(".", 1)[0]


def _page(layout, seed):
    p = random_payload(layout, seed)
    k = random_key()
    return k, make_header(k, layout, p), p


def _memory(pages, layout, limits):
    cfg = MemoryConfig(capacity=pages * layout.payload_bytes, slab_size=layout.payload_bytes * 2)
    return MemoryTier(cfg, accounts=Accounts(limits, account_of))


def _disk(path, pages, layout, limits):
    cfg = DiskConfig(path=str(path), capacity=pages * disk_page_bytes(layout), io="buffered")
    tier = DiskTier(cfg, accounts=Accounts(limits, account_of))
    assert tier.wait_indexed(30)  # (a restarted tier's index is rebuilt in the background)
    return tier


def _fill(tier, layout, domain, n, seed):
    pages = [_page(layout, seed + i) for i in range(n)]
    for _, h, p in pages:
        tier.put([(h, p)], domain)
    return [k for k, _, _ in pages]


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_an_account_at_its_limit_evicts_its_own_pages_only(tmp_path, layout, where):
    limits = {"a": Limit(pages=3), "b": Limit(pages=3)}
    tier = _memory(8, layout, limits) if where == "memory" else _disk(tmp_path, 8, layout, limits)
    b = _fill(tier, layout, "b.w", 3, 100)
    a = _fill(tier, layout, "a.w", 6, 0)  # twice its quota, into a tier with room to spare
    assert tier.usage("a").pages == 3 and tier.usage("b").pages == 3
    assert tier.contains(b) == [True] * 3  # the other tenant lost nothing
    assert tier.contains(a) == [False] * 3 + [True] * 3  # its own oldest went
    assert tier.stats.evictions == 3
    assert tier.usage("a").bytes == 3 * (layout.payload_bytes if where == "memory" else disk_page_bytes(layout))


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_full_tier_takes_room_from_whoever_holds_most_of_its_share(tmp_path, layout, where):
    limits = {"a": Limit(pages=6), "b": Limit(pages=6)}  # shares summing past the tier: 8 pages
    tier = _memory(8, layout, limits) if where == "memory" else _disk(tmp_path, 8, layout, limits)
    a = _fill(tier, layout, "a.w", 6, 0)
    b = _fill(tier, layout, "b.w", 2, 100)
    assert len(tier) == 8
    b += _fill(tier, layout, "b.w", 2, 200)  # b is within its quota; the tier is full
    assert tier.contains(b) == [True] * 4  # b's room came from a, which held 6/6 of its share
    assert tier.contains(a) == [False] * 2 + [True] * 4  # its oldest
    assert tier.usage("a").pages == 4 and tier.usage("b").pages == 4


def test_a_page_larger_than_the_quota_is_refused_without_evicting(layout):
    tier = _memory(8, layout, {"a": Limit(bytes=layout.payload_bytes // 2)})
    other = _fill(tier, layout, "b.w", 8, 100)
    k, h, p = _page(layout, 1)
    assert tier.put([(h, p)], "a.w") == [False]
    assert tier.contains(other) == [True] * 8 and tier.stats.evictions == 0


def test_an_open_session_holds_its_accounts_room(layout):
    tier = _memory(8, layout, {"a": Limit(pages=2)})
    session = tier.open_session([random_key(), random_key()], [layout, layout], "a.w")
    assert tier.usage("a").pages == 2
    k, h, p = _page(layout, 1)
    assert tier.put([(h, p)], "a.w") == [False]  # its quota is the session's until it ends
    session.abort()
    assert tier.usage("a").pages == 0
    assert tier.put([(h, p)], "a.w") == [True]


def test_restarted_disk_charges_pages_to_their_accounts_and_trims_on_the_next_write(tmp_path, layout):
    tier = _disk(tmp_path, 16, layout, {})
    a = _fill(tier, layout, "a.w", 5, 0)
    tier.close()
    tier = _disk(tmp_path, 16, layout, {"a": Limit(pages=3)})  # the quota is lower after the restart
    assert tier.usage("a").pages == 5 and tier.contains(a) == [True] * 5
    a += _fill(tier, layout, "a.w", 1, 50)
    assert tier.usage("a").pages == 3
    present = tier.contains(a)  # (the order a restart knows is the files' mtimes: ties are possible)
    assert present[5] and sum(present[:5]) == 2


def test_domains_are_forgotten_with_their_last_page(tmp_path, layout):
    mem = _memory(64, layout, {})
    disk = _disk(tmp_path, 64, layout, {})
    for i in range(200):  # many short-lived domains, one page each
        k, h, p = _page(layout, i)
        for tier in (mem, disk):
            tier.put([(h, p)], f"t.w{i}")
            assert tier.clear(f"t.w{i}") == 1
    for tier in (mem, disk):
        assert tier.domains("t") == set() and len(tier._domains) == 0
    assert os.listdir(tmp_path / "d") == []  # and so are their directories on disk
    k, h, p = _page(layout, 999)
    mem.put([(h, p)], "t.last")
    assert mem._index[k].domains == 1  # the bit is the lowest again, not the 201st
    out = np.zeros_like(p)
    assert mem.get([k], layout, [out]) == [h]


def test_registry_counts_pages_per_domain():
    forgot = []
    reg = DomainRegistry(account_of, on_forget=forgot.append)
    m1 = reg.add(reg.add(0, "a.x"), "a.y")
    m2 = reg.add(0, "a.x")
    assert reg.of_account("a") == {"a.x", "a.y"} and reg.names(m1) == ["a.x", "a.y"]
    m1 = reg.remove(m1, "a.y")
    assert forgot == ["a.y"] and reg.of_account("a") == {"a.x"}
    reg.release(m1)
    assert forgot == ["a.y"]  # m2 still holds a.x
    reg.release(m2)
    assert forgot == ["a.y", "a.x"] and len(reg) == 0 and reg.mask("a.x") == 0


@pytest.mark.parametrize("read", ["fetch", "get"])
def test_a_copy_promoted_from_disk_keeps_its_owner_and_is_charged_to_it(tmp_path, layout, read):
    """On a server, a page read back from disk into memory is the tenant's, within its quota (not
    the server's own domain's, outside every quota and every tenant's clear)."""
    from lmkv.config import LMKVConfig
    from lmkv.store import TieredStore

    cfg = LMKVConfig(memory={"capacity": 8 * layout.payload_bytes, "slab_size": 2 * layout.payload_bytes},
                     disk={"path": str(tmp_path), "io": "buffered"})
    accounts = {"memory": Accounts({"a": Limit(pages=4)}, account_of), "disk": Accounts({}, account_of)}
    with TieredStore(cfg, accounts=accounts) as store:
        keys = [random_key() for _ in range(6)]
        payloads = [random_payload(layout, i) for i in range(6)]
        store.put(keys, [layout] * 6, payloads, domain="a.w")
        store.drain()
        assert store.memory.usage("a").pages == 4 and store.memory.contains(keys[:2]) == [False] * 2
        if read == "fetch":
            with store.fetch(keys[:2], layout) as f:
                assert all(h is not None for h in f.headers)
        else:
            outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in range(2)]
            assert all(h is not None for h in store.get(keys[:2], layout, outs))
        assert store.memory.contains(keys[:2]) == [True] * 2
        assert [store.memory.owners(k) for k in keys[:2]] == [["a.w"]] * 2
        assert store.memory.usage("a").pages == 4  # within its quota still
        assert store.clear("a.w") == 6 + 4  # every copy goes with the tenant's domain (disk 6, memory 4)
        assert len(store.memory) == 0
