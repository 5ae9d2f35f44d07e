"""``vllm serve`` as a user runs it (the engine in its own process), for tests and benchmarks over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lmkv.dev.redis_server import free_port

VLLM = Path(sys.executable).with_name("vllm")


@dataclass
class Client:
    """An OpenAI-compatible completions endpoint: a ``vllm serve`` or a proxy in front of engines."""

    url: str
    model: str
    max_tokens: int = 8

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def body(self, ids: list[int], salt: str | None = None, max_tokens: int | None = None) -> dict:
        """A greedy completion's request; ``salt``: vLLM's ``cache_salt`` (no cache hit)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens or self.max_tokens, "temperature": 0,
                "return_token_ids": True}
        if salt is not None:
            body["cache_salt"] = salt
        return body

    def complete(self, ids: list[int], salt: str | None = None,
                 max_tokens: int | None = None) -> tuple[list[int], float]:
        """Greedy tokens of a completion and its time."""
        t = time.perf_counter()
        out = self.post("/v1/completions", self.body(ids, salt, max_tokens))
        return out["choices"][0]["token_ids"], time.perf_counter() - t

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for (n, got), v in self._samples()
                   if n == name and all(got.get(k) == want for k, want in labels.items()))

    def metrics(self, prefix: str = "vllm:lmkv_") -> dict[str, float]:
        """Every nonzero sample whose name begins with ``prefix``, named with its own labels (not
        vLLM's engine labels): what a test prints when a figure is off."""
        out: dict[str, float] = {}
        for (name, labels), v in self._samples():
            if name.startswith(prefix) and not name.endswith("_created") and v:  # (not a counter's birth time)
                own = ",".join(f"{k}={labels[k]}" for k in ("tier", "direction", "decision") if k in labels)
                key = f"{name}{{{own}}}" if own else name
                out[key] = out.get(key, 0) + v
        return out

    def _samples(self) -> list[tuple[tuple[str, dict[str, str]], float]]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return [((s.name, s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _nice_session(pid: int, nice: int) -> None:
    """Lower the CPU share of the session ``pid`` leads against other sessions. With the kernel's
    autogroups (``kernel.sched_autogroup_enabled``, on in most distributions) each session is a
    scheduling group of its own and a process's nice value weighs only within its group: an
    engine at nice 19 still took a full share of the cores from the engine beside it until its
    group's nice was set too (``/proc/PID/autogroup``)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:  # no autogroups (the nice value alone then does it), or not ours to lower
        pass


class Serve(Client):
    """One ``vllm serve`` process (and its engine process) in a session of its own, stopped as a group."""

    def __init__(self, model: str, lmkv: dict, log: Path, role: str = "kv_both", block: int = 32,
                 max_model_len: int = 2048, kv_bytes: int = 64 << 20, max_tokens: int = 8, nice: int = 0) -> None:
        """``lmkv``: the connector's settings; ``role``: vLLM's ``kv_role``; ``kv_bytes``: the KV
        budget; ``max_tokens``: what :meth:`complete` asks for; ``nice``: the scheduling priority
        every process and thread of the engine runs at (``nice(1)``'s increment)."""
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", model, max_tokens)
        cfg = {"kv_connector": "LMKVConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": lmkv}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: /reset_prefix_cache
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it: the engine in its own process
        self.log = log
        self.proc = subprocess.Popen(
            [*(["nice", "-n", str(nice)] if nice else []), str(VLLM), "serve", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--block-size", str(block),
             "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
             "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0",
             "--kv-transfer-config", json.dumps(cfg)],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if nice:
            _nice_session(self.proc.pid, nice)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lmkv_lines(self) -> list[str]:
        """lmkv's own log lines in the engine's output (what a test prints when a figure is off)."""
        return [line for line in self.output().splitlines() if "] lmkv: " in line]

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vllm serve not ready in {timeout} s:\n{self.output()[-4000:]}")

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
