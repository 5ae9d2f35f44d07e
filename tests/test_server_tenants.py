"""``lmkv serve`` shared by tenants: what each token grants, whose pages a request can reach, and
what one tenant's writes can take from another's. Real ``lmkv serve`` processes on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from conftest import make_pages

from lmkv.config import ConfigError, RemoteConfig, ServerConfig
from lmkv.dev.server_process import spawn
from lmkv.errors import TierUnavailableError
from lmkv.serve.tenants import Tenants
from lmkv.tiers.server_client import ServerTier
from lmkv.wire.protocol import Clear, Count, Empty, Keys, Op, RemoteError, decode_reply, encode, frame, read_frame

A_TOKEN = "team-a-token-0123456789"
B_TOKEN = "team-b-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789ab"


def _tenants(**quota_a) -> list[dict]:
    return [
        {"name": "team-a", "token": A_TOKEN, "namespaces": ["team-a", "team-a/*"], "quota": quota_a},
        {"name": "team-b", "token": B_TOKEN, "namespaces": ["team-b"]},
    ]


def _serve(tmp_path, memory: str = "64MiB", **server):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"server": server}))  # (YAML reads JSON)
    return spawn("--memory", memory, "--file", str(cfg))


def _tier(s, token: str, namespace: str) -> ServerTier:
    return ServerTier(RemoteConfig(url=s.url, token=token, shm="never"), namespace)


def _read_all(tier, layout, keys) -> list[bool]:
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    return [h is not None for h in tier.get(keys, layout, outs)]


@pytest.fixture
def shared(tmp_path):
    with _serve(tmp_path, tenants=_tenants(), admin_token=ADMIN_TOKEN) as s:
        yield s


def test_a_token_opens_only_the_namespaces_granted_to_it(shared, layout):
    """Naming another tenant's namespace no longer reaches its pages: HELLO is refused (the tier is
    down for that client); its own namespaces, a prefix grant included, work."""
    keys, _, pages = make_pages(layout, 3)
    b = _tier(shared, B_TOKEN, "team-b")
    assert b.put(pages, "engine") == [True] * 3
    thief = _tier(shared, A_TOKEN, "team-b")  # A's token, B's namespace
    with pytest.raises(TierUnavailableError, match="not granted"):
        thief.contains(keys)
    for ns in ("team-a", "team-a/user-17"):
        a = _tier(shared, A_TOKEN, ns)
        assert a.contains(keys) == [False] * 3  # same keys, its own namespace: B's pages are not there
        assert a.put(pages[:1], "engine") == [True]
        a.close()
    with pytest.raises(TierUnavailableError, match="authentication failed"):
        _tier(shared, "not-a-token-at-all-xyz", "team-a").contains(keys)
    assert _read_all(b, layout, keys) == [True] * 3
    for t in (b, thief):
        t.close()


def test_stats_and_clear_see_the_callers_tenant_only(shared, layout):
    a, b = _tier(shared, A_TOKEN, "team-a"), _tier(shared, B_TOKEN, "team-b")
    a_keys, _, a_pages = make_pages(layout, 2)
    b_keys, _, b_pages = make_pages(layout, 5, seed=10)
    assert a.put(a_pages, "engine") == [True] * 2 and b.put(b_pages, "engine") == [True] * 5
    _read_all(b, layout, b_keys)
    stats = a.server_stats()
    assert stats["memory"]["pages"] == 2 and stats["tenant"]["pages"] == 2
    assert stats["tenant"]["hits"] == 0 and stats["tenant"]["puts"] == 2  # B's 5 reads are not A's business
    assert not any(k.startswith("tenant:") for k in stats)
    assert a.clear("engine") == 2  # A's domain "engine" is not B's
    assert _read_all(b, layout, b_keys) == [True] * 5
    assert b.server_stats()["tenant"]["hits"] == 10
    with pytest.raises(RemoteError, match="admin"):
        b.clear_tenant("team-a")
    b.close()
    a.close()


def test_the_admin_token_sees_the_server_and_clears_a_tenant_but_holds_no_pages(shared, layout):
    a, b = _tier(shared, A_TOKEN, "team-a"), _tier(shared, B_TOKEN, "team-b")
    a_keys, _, a_pages = make_pages(layout, 2)
    b_keys, _, b_pages = make_pages(layout, 3, seed=10)
    a.put(a_pages, "engine")
    b.put(b_pages, "w1")
    admin = _tier(shared, ADMIN_TOKEN, "anything")
    stats = admin.server_stats()
    assert stats["memory"]["pages"] == 5
    assert stats["tenant:team-a"]["pages"] == 2 and stats["tenant:team-b"]["pages"] == 3
    with pytest.raises(RemoteError, match="not pages"):
        admin.contains(a_keys)
    assert admin.clear_tenant("team-b") == 3
    assert _read_all(b, layout, b_keys) == [False] * 3
    assert _read_all(a, layout, a_keys) == [True] * 2
    for t in (a, b, admin):
        t.close()


def test_a_tenant_at_its_quota_evicts_its_own_pages_never_anothers(tmp_path, layout):
    """A server memory of 32 pages, B holding 24 of them (its quota), A allowed 8: A writing 30
    pages keeps its newest 8 and takes nothing of B's (with one shared LRU, A's writes would have
    pushed B's pages out)."""
    tenants = _tenants(memory_pages=8)
    tenants[1]["quota"] = {"memory_pages": 24}
    memory = f"{32 * layout.payload_bytes}"
    with _serve(tmp_path, memory=memory, tenants=tenants) as s:
        a, b = _tier(s, A_TOKEN, "team-a"), _tier(s, B_TOKEN, "team-b")
        b_keys, _, b_pages = make_pages(layout, 24, seed=100)
        assert b.put(b_pages, "engine") == [True] * 24
        a_keys, _, a_pages = make_pages(layout, 30)
        for i in range(0, 30, 3):
            assert a.put(a_pages[i : i + 3], "engine") == [True] * 3
        assert _read_all(b, layout, b_keys) == [True] * 24
        assert a.contains(a_keys) == [False] * 22 + [True] * 8
        stats = a.server_stats()["memory"]
        assert stats["pages"] == 8 and stats["quota_pages"] == 8
        a.close()
        b.close()


def test_residency_domains_are_capped_per_tenant_and_freed_when_empty(tmp_path, layout):
    """A tenant cannot register domains without end (6,000 once slowed every tenant's reads for
    good): at its cap a new domain is refused; clearing one frees its place, and the server
    forgets a domain with its last page (2,000 domains come and go; none is left)."""
    with _serve(tmp_path, tenants=_tenants(domains=3)) as s:
        a = _tier(s, A_TOKEN, "team-a")
        _, _, pages = make_pages(layout, 1)
        for d in ("w1", "w2", "w3"):
            assert a.put(pages, d) == [True]
        assert a.put(pages, "w1") == [True]  # a domain it has is no new one
        _, _, other = make_pages(layout, 1, seed=5)
        with pytest.raises(RemoteError, match="quota.domains"):
            a.put(other, "w4")
        assert a.clear("w3") == 0  # (w1 and w2 still own the page)
        assert a.put(other, "w4") == [True]
        assert a.clear("w4") == 1
        for i in range(2000):  # each one new, each one cleared: the place it took is free again
            assert a.put(other, f"churn{i}") == [True]
            assert a.clear(f"churn{i}") == 1
        assert a.server_stats()["tenant"]["domains"] == 2  # w1, w2
        a.close()


def _hello(port: int, token: str | None, namespace: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(frame(Op.HELLO, msgspec.msgpack.encode({"version": 1, "namespace": namespace, "token": token})))
        status, meta, _ = read_frame(c, 1 << 20)
        if status == 0:
            c.sendall(frame(Op.DELETE, encode(Keys([b"k" * 16]))))
            status, meta, _ = read_frame(c, 1 << 20)
        return status, meta


def test_token_files_must_be_private(tmp_path):
    token = tmp_path / "a.token"
    token.write_text(A_TOKEN + "\n")
    token.chmod(0o644)
    cfg = tmp_path / "serve.yaml"
    tenant = {"name": "team-a", "token_file": str(token), "namespaces": ["team-a"]}
    cfg.write_text(json.dumps({"server": {"tenants": [tenant]}}))
    run = subprocess.run([sys.executable, "-m", "lmkv.cli", "serve", "--port", "0", "--file", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "readable by others" in run.stderr
    token.chmod(0o600)
    with spawn("--memory", "16MiB", "--file", str(cfg)) as s:
        assert _hello(s.port, A_TOKEN, "team-a")[0] == 0
        assert _hello(s.port, A_TOKEN, "team-b") == (1, encode({"error": "namespace 'team-b' is not granted "
                                                                          "to this token"}))


def test_one_token_is_one_tenant_with_every_namespace_and_the_servers_stats(tmp_path, layout):
    """The single-tenant setup keeps working: server.token opens every namespace, and its STATS
    and clears are the server's (what the README says it grants)."""
    with _serve(tmp_path, token="correct-horse-battery") as s:
        x, y = _tier(s, "correct-horse-battery", "x"), _tier(s, "correct-horse-battery", "y")
        _, _, pages = make_pages(layout, 2)
        x.put(pages, "engine")
        y.put(pages[:1], "engine")
        assert x.server_stats()["memory"]["pages"] == 3
        assert x.clear_tenant("default") == 3
        x.close()
        y.close()


@pytest.mark.parametrize("tenants, why", [
    ([{"name": "a", "token": A_TOKEN, "namespaces": ["shared/*"]},
      {"name": "b", "token": B_TOKEN, "namespaces": ["shared/b"]}], "would share namespaces"),
    ([{"name": "a", "token": A_TOKEN, "namespaces": ["a"]},
      {"name": "b", "token": A_TOKEN, "namespaces": ["b"]}], "share a token"),
    ([{"name": "a", "namespaces": ["a"]}], "token or token_file"),
])
def test_tenant_configurations_that_would_leak_are_refused(tenants, why):
    with pytest.raises((ConfigError, ValueError), match=why):
        Tenants.from_config(ServerConfig.model_validate({"tenants": tenants}))
    with pytest.raises(ConfigError, match="each tenant has its own token"):
        Tenants.from_config(ServerConfig(token="correct-horse-battery", tenants=[
            {"name": "a", "token": A_TOKEN, "namespaces": ["a"]}]))


def test_raw_frames_of_the_admin_are_refused_page_ops(shared):
    with socket.create_connection(("127.0.0.1", shared.port), timeout=10) as c:
        c.sendall(frame(Op.HELLO, msgspec.msgpack.encode({"version": 1, "namespace": "x", "token": ADMIN_TOKEN})))
        assert read_frame(c, 1 << 20)[0] == 0
        c.sendall(frame(Op.CLEAR, encode(Clear("engine"))))
        status, meta, _ = read_frame(c, 1 << 20)
        assert status == 1 and b"name the tenant" in meta
        c.sendall(frame(Op.CLEAR, encode(Clear(tenant="team-a"))))
        status, meta, _ = read_frame(c, 1 << 20)
        assert status == 0 and decode_reply(meta, Count).count == 0
        c.sendall(frame(Op.PING, encode(Empty())))
        assert read_frame(c, 1 << 20)[0] == 0


def test_the_server_guides_multi_tenant_example_is_a_valid_configuration(tmp_path):
    import re
    from pathlib import Path

    import yaml

    from lmkv.config import LMKVConfig

    guide = (Path(__file__).parents[1] / "docs" / "guides" / "server.md").read_text()
    block = re.search(r"```yaml\n(# lmkv serve --file serve.yaml.*?)```", guide, re.S)
    assert block, "the server guide's multi-tenant example is gone"
    data = yaml.safe_load(block.group(1).replace("/etc/lmkv/", f"{tmp_path}/"))
    for name, token in (("admin", ADMIN_TOKEN), ("search", A_TOKEN), ("chat", B_TOKEN)):
        (tmp_path / f"{name}.token").write_text(token + "\n")
        (tmp_path / f"{name}.token").chmod(0o600)
    tenants = Tenants.from_config(LMKVConfig.model_validate(data).server)
    assert tenants.authenticate(A_TOKEN).grants("search/user-1")
    assert not tenants.authenticate(B_TOKEN).grants("search")
    assert tenants.authenticate(ADMIN_TOKEN).admin


def _held(port: int, token: str, namespace: str) -> tuple[socket.socket, int, bytes]:
    """A connection that said HELLO and stays open: its status and reply."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(frame(Op.HELLO, msgspec.msgpack.encode({"version": 1, "namespace": namespace, "token": token})))
    status, meta, _ = read_frame(c, 1 << 20)
    return c, status, meta


def test_one_tenant_cannot_take_every_connection(tmp_path):
    """Each tenant holds at most its share of ``max_connections`` (or its ``quota.connections``): a
    tenant at its cap is refused with the reason while another tenant still connects, from the same
    address (authenticated connections count against their tenant, not the shared 127.0.0.1)."""
    tenants = _tenants(connections=3)
    tenants.append({"name": "team-c", "token": "team-c-token-0123456789", "namespaces": ["team-c"]})
    with _serve(tmp_path, tenants=tenants, max_connections=8, max_per_peer=4) as s:
        a = [_held(s.port, A_TOKEN, "team-a") for _ in range(3)]
        assert [status for _, status, _ in a] == [0, 0, 0]
        c, status, meta = _held(s.port, A_TOKEN, "team-a")
        assert status == 1 and b"its quota" in meta
        c.close()
        b = [_held(s.port, B_TOKEN, "team-b") for _ in range(3)]  # 8 // 3 tenants = 2 each by default
        assert [status for _, status, _ in b] == [0, 0, 1]
        assert _hello(s.port, "team-c-token-0123456789", "team-c")[0] == 0  # 6 from 127.0.0.1, max_per_peer 4
        a[0][0].close()
        for _ in range(50):  # (the server sees the close)
            c, status, _ = _held(s.port, A_TOKEN, "team-a")
            c.close()
            if status == 0:
                break
            time.sleep(0.05)
        assert status == 0
        for c, _, _ in a[1:] + b:
            c.close()
