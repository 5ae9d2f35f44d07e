"""``vllm serve`` with lmkv named in ``--kv-transfer-config``, as the README shows it, on the CPU
engine: an HTTP client, a prefix-cache reset, a restart over the disk tier, lmkv in ``/metrics``,
and a bad lmkv setting refused with lmkv's message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.vllm_engine import BLOCK, prompt

from lmkv.dev.redis_server import free_port
from lmkv.dev.tinymodels import make_llama

VLLM = Path(sys.executable).with_name("vllm")


class Serve:
    """One ``vllm serve`` process (and its engine process) in a session of its own, stopped as a group."""

    def __init__(self, model: str, lmkv: dict, log: Path) -> None:
        self.port = free_port()
        self.model = model
        cfg = {"kv_connector": "LMKVConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": lmkv}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: /reset_prefix_cache
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it: the engine in its own process
        self.log = log
        self.proc = subprocess.Popen(
            [str(VLLM), "serve", model, "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(BLOCK),
             "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
             "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
             "--kv-transfer-config", json.dumps(cfg)],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vllm serve not ready in {timeout} s:\n{self.output()[-4000:]}")

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def complete(self, ids: list[int]) -> tuple[list[int], float]:
        t = time.perf_counter()
        out = self.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 8,
                                            "temperature": 0, "return_token_ids": True})
        return out["choices"][0]["token_ids"], time.perf_counter() - t

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C does: vLLM shuts its engine down
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything of the group still there (an engine process) goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture(scope="module")
def model() -> str:
    return str(make_llama())


def test_vllm_serve_serves_lmkv_hits_across_a_reset_and_a_restart(model, tmp_path):
    lmkv = {"memory": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "disk"), "capacity": "1GiB"},
            "store": {"write_policy": "write_through"}}
    ids = prompt(1500, 5)
    srv = Serve(model, lmkv, tmp_path / "serve1.log")
    try:
        srv.wait_ready()
        srv.complete(prompt(64, 99))  # warm-up (vLLM's first request pays one-time costs)
        cold, t_cold = srv.complete(ids)
        srv.post("/reset_prefix_cache")  # vLLM forgets the prompt; lmkv does not
        again, t_again = srv.complete(ids)
        assert again == cold
        pages = 1500 // BLOCK
        assert srv.metric("vllm:lmkv_loaded_pages_total") >= pages
        assert srv.metric("vllm:lmkv_tier_hits_total", tier="memory") >= pages
        assert srv.metric("vllm:lmkv_stored_pages_total") >= pages
        assert t_again < t_cold
    finally:
        srv.stop()
    srv = Serve(model, lmkv, tmp_path / "serve2.log")  # a restart: memory is gone, the disk tier is not
    try:
        srv.wait_ready()
        after, _ = srv.complete(ids)
        assert after == cold
        assert srv.metric("vllm:lmkv_tier_hits_total", tier="disk") >= pages
        assert srv.metric("vllm:lmkv_loaded_pages_total") >= pages
    finally:
        srv.stop()


def test_a_bad_lmkv_setting_stops_vllm_serve_with_lmkvs_message(model, tmp_path):
    srv = Serve(model, {"memory": {"capacity": "lots"}}, tmp_path / "bad.log")
    try:
        rc = srv.proc.wait(300)
    finally:
        srv.stop()
    out = srv.output()
    assert rc != 0
    assert "memory.capacity = 'lots'" in out and "invalid lmkv configuration" in out
    assert "Loading weights" in out and "KV cache size" not in out  # refused before the KV cache is built
    # and said last, after vLLM's own "Engine core initialization failed. See root cause above"
    last = out[out.index("Engine core initialization failed"):]
    assert "lmkv: the engine did not start: invalid lmkv configuration" in last and "memory.capacity" in last

