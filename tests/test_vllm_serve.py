"""``vllm serve`` with lmkv named in ``--kv-transfer-config``, as the README shows it, on the CPU
engine: an HTTP client, a prefix-cache reset, a restart over the disk tier, lmkv in ``/metrics``,
and a bad lmkv setting refused with lmkv's message."""

from __future__ import annotations

import pytest
from support.vllm_engine import BLOCK, prompt

from lmkv.dev.tinymodels import make_llama
from lmkv.dev.vllm_serve import Serve


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
        # lmkv's INFO lines are in vLLM's log, as vLLM's are (its engine and worker processes each say the layout)
        said = srv.lmkv_lines()
        assert sum("INFO" in line and "lmkv: group0: full_attention" in line for line in said) >= 2, said
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

