"""The engine benchmarks in --quick form: their JSON shape, and the figures that are
correctness, not speed (identical tokens, no wrong output, no crash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _bench(name: str, tmp_path) -> dict:
    env = {**os.environ, "LMKV_MODEL_DIR": str(tmp_path / "models")}
    out = subprocess.run([sys.executable, "-m", "lmkv.cli", "bench", name, "--quick", "--json", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)  # stdout carries exactly one JSON object, engine logs go to stderr
    assert report["bench"] == name
    for m in report["metrics"].values():
        assert m["ratio"] is None or m["ratio"] == pytest.approx(m["value"] / m["baseline"])
    return report["metrics"]


def test_bench_vllm_quick(tmp_path):
    m = _bench("vllm", tmp_path)
    for name in ("ttft.lmkv_memory", "ttft.lmkv_disk", "ttft.lmkv_memory_vs_example", "ttft.cold_with_lmkv",
                 "workload.lmkv", "workload.lmkv_vs_example"):
        assert m[name]["unit"] == "s" and m[name]["value"] > 0 and m[name]["baseline"] > 0
    for name in ("ttft.remote.server_tcp", "ttft.disk_cold", "ttft.remote.server_tcp_vs_whole",
                 "ttft.disk_cold_vs_whole", "ttft.remote.added_vs_whole", "workload.remote"):
        assert m[name]["unit"] == "s" and m[name]["value"] > 0 and m[name]["baseline"] > 0
    assert m["tokens_identical"]["value"] == 1  # every variant, every tier, both load paths
    assert m["workload.lmkv_loaded_pages"]["value"] > 0 and m["workload.remote_loaded_pages"]["value"] > 0
    # with nothing else running, auto loads a hit from any tier layer by layer
    assert m["ttft.remote.server_tcp.layerwise_loads"]["ratio"] == m["ttft.disk_cold.layerwise_loads"]["ratio"] == 1


def test_bench_faults_quick(tmp_path):
    m = _bench("faults", tmp_path)
    assert m["completed"]["value"] == m["completed"]["baseline"] > 0
    assert m["wrong_outputs"]["value"] == 0
    assert m["engine_crashes"]["value"] == 0
    assert m["failed_pages"]["value"] > 0 and m["recomputed_tokens"]["value"] > 0
    assert m["goodput"]["value"] > 0
