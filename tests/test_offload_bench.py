"""``lmkv bench offload``: its bound of what judging a block by its request can reach, and its quick run."""

from __future__ import annotations

import json
import subprocess
import sys

from lmkv.benchmarks.offload import _request_bound
from lmkv.offload.peer import available
from lmkv.offload.traces import TraceRequest

BLOCK = 4


def _req(rid: str, *blocks: int) -> TraceRequest:
    """A request whose prompt is these blocks of content (each ``BLOCK`` tokens of its number)."""
    return TraceRequest(rid, 0, rid, [b for b in blocks for _ in range(BLOCK)], [1, 2])


def test_groups_that_tell_reuse_apart_are_copied_alone():
    """Documents (two blocks) each asked again; one-shot prompts (four blocks) never: a policy that knew
    the groups' rates copies exactly the blocks asked for again."""
    docs = [_req(f"d{i}", 10 * i, 10 * i + 1) for i in range(4)]
    again = [_req(f"q{i}", 10 * i, 10 * i + 1, 1000 + i) for i in range(4)]
    stream = [_req(f"s{i}", *range(500 + 4 * i, 504 + 4 * i)) for i in range(4)]
    assert _request_bound(docs + stream + again, BLOCK) == (8, 8)


def test_requests_that_look_alike_are_copied_alike():
    """Four first turns alike, two of them continued: whatever a request shows, keeping the reused blocks
    means copying all four."""
    first = [_req(f"t{i}", 10 * i, 10 * i + 1) for i in range(4)]
    second = [_req(f"u{i}", 10 * i, 10 * i + 1, 1000 + i) for i in range(2)]
    assert _request_bound(first + second, BLOCK) == (4, 8)


def test_bench_offload_quick_holds_the_targets_that_do_not_depend_on_time(tmp_path):
    """``lmkv bench offload --quick``: every family's figures beside their baselines from the same runs;
    the replays are deterministic, so the targets on counts hold here as in the full run: no stale
    write, tier hits >= 0.97x eager's and vLLM's own hits >= 0.995x the run without offload's (small and
    8B pages), fewer bytes than LMCache's policy where it is installed."""
    cmd = [sys.executable, "-m", "lmkv.cli", "bench", "offload", "--quick", "--json", "--dir", str(tmp_path)]
    report = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout)
    m = report["metrics"]
    assert report["bench"] == "offload" and m["stale_writes"]["value"] == 0
    for fam in ("gen", "mooncake"):
        for name in ("bytes_vs_oracle", "hindsight_classes_vs_oracle", "bw.blocks_lost", "bw.hit_tokens",
                     "bw.hindsight_classes_blocks_lost", "bw.judged_at_once_blocks_lost"):
            assert m[f"{fam}.{name}"]["baseline_what"], name
        for pages in ("", "8b."):
            assert m[f"{fam}.{pages}hit_tokens"]["ratio"] >= 0.97
            assert m[f"{fam}.{pages}engine_hit_tokens"]["ratio"] >= 0.995
            if available() is None:
                assert m[f"{fam}.{pages}bytes_vs_lmcache"]["ratio"] < 1
    assert all(m[f"{fam}.hindsight_requests_vs_reused"]["ratio"] > 0 for fam in ("gen", "mooncake"))
    assert m["policy_us_per_step"]["value"] > 0 and m["policy_us_per_step.link"]["value"] > 0
