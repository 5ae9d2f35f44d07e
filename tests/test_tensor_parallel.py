"""TP=2 as two processes over shared tiers: a sharded group is written by every rank under its
own keys and restored byte for byte on each; a replicated group is written once and read by both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmkv.dev.server_process import spawn

RANK = Path(__file__).parent / "support" / "tp_rank.py"


def _rank(rank: int, phase: str, cfg: dict) -> dict:
    out = subprocess.run([sys.executable, str(RANK), str(rank), phase, json.dumps(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shared", ["disk", "server"])
def test_two_ranks_over_a_shared_tier(tmp_path, shared):
    server = spawn("--memory", "64MiB") if shared == "server" else None
    try:
        if shared == "disk":
            cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "disk")}}
        else:
            cfg = {"memory": {"capacity": "16MiB"}, "remote": {"url": server.url}}
        stored = [_rank(r, "store", cfg)["stored"] for r in (0, 1)]
        assert stored == [8, 4]  # rank 0: attn shard 0 + the replicated latent; rank 1: attn shard 1 only
        for r in (0, 1):  # a fresh process per rank, its memory empty: everything comes from the shared tier
            got = _rank(r, "load", cfg)
            assert got["identical"] == {"attn": True, "latent": True}
            assert got["groups"] == {"attn": 4, "latent": 4}
        if shared == "disk":
            assert len(list((tmp_path / "disk").rglob("*.page"))) == 4 * 2 + 4  # two attn shards, one latent
        else:
            from lmkv.config import RemoteConfig
            from lmkv.tiers.server_client import ServerTier

            probe = ServerTier(RemoteConfig(url=server.url))
            assert probe.server_stats()["memory"]["puts"] == 12
            probe.close()
    finally:
        if server is not None:
            server.stop()
