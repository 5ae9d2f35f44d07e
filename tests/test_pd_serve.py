"""The P/D flow users run: two ``vllm serve`` engines on the CPU engine, a prefill engine
(``kv_producer``) and a decode engine (``kv_consumer``), sharing ``lmkv serve`` over TCP (as
between two hosts), Redis or Mooncake Store (a master and a storage client holding the pages, the
engines' clients contributing no memory, as engines on hosts of their own would), and
``examples/pd_proxy.py`` sending each request to both. The
decode engine loads every full block of each prompt, with a cold computation's tokens, and stores
nothing of the prompts."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from support.vllm_engine import BLOCK, prompt  # noqa: E402

from lmkv.dev.redis_server import start_redis  # noqa: E402
from lmkv.dev.server_process import spawn  # noqa: E402
from lmkv.dev.tinymodels import make_llama  # noqa: E402
from lmkv.dev.vllm_serve import Client, Serve  # noqa: E402

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _proxy_module():
    spec = importlib.util.spec_from_file_location("pd_proxy", EXAMPLES / "pd_proxy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _shared(tier: str):
    """The shared tier's ``remote`` settings, while it runs."""
    if tier == "lmkv serve":
        with spawn("--memory", "512MiB") as s:
            yield {"url": s.url, "shm": "never"}
    elif tier == "redis":
        with start_redis() as r:
            yield {"url": r.url}
    else:
        pytest.importorskip("mooncake.store")
        from lmkv.dev.mooncake_master import start_master, start_storage

        with start_master() as m, start_storage(m, 512 << 20):
            yield {"url": m.url, "mooncake": {"segment_size": 0, "local_buffer_size": 16 << 20,
                                              "staging_size": 32 << 20}}


@pytest.mark.parametrize("tier", ["lmkv serve", "redis", "mooncake"])
def test_prefill_and_decode_engines_hand_prompts_off_through_a_shared_tier(tmp_path, tier):
    model = str(make_llama())
    with _shared(tier) as remote:
        # (a generous wait: the pages must all come on a loaded CI machine; pd.wait's default is a bench's figure)
        lmkv = {"memory": {"capacity": "256MiB"}, "remote": remote, "pd": {"wait": 5}}
        p = Serve(model, lmkv, tmp_path / "prefill.log", role="kv_producer")
        d = Serve(model, lmkv, tmp_path / "decode.log", role="kv_consumer")
        proxy = _proxy_module().make_server(p.url, d.url, port=0)
        via = Client(f"http://127.0.0.1:{proxy.server_address[1]}", model)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            p.wait_ready()
            d.wait_ready()
            prompts = [prompt(1000 + 200 * i, seed=60 + i) for i in range(3)]
            expected = [p.complete(ids, salt=f"cold-{i}")[0] for i, ids in enumerate(prompts)]  # (no hit anywhere)
            assert [via.complete(ids)[0] for ids in prompts] == expected
            pages = sum((len(ids) - 1) // BLOCK for ids in prompts)
            # (what each side counted and logged, should a check fail)
            seen = {"prefill": (p.metrics(), p.lmkv_lines()), "decode": (d.metrics(), d.lmkv_lines())}
            assert d.metric("vllm:lmkv_scheduler_handoffs_short_total") == 0, seen
            assert d.metric("vllm:lmkv_loaded_pages_total") == pages, seen
            assert d.metric("vllm:lmkv_recomputed_tokens_total") == 0, seen
            assert d.metric("vllm:lmkv_stored_pages_total") == 0, seen  # (8 decoded tokens fill no block)
        finally:
            proxy.shutdown()
            p.stop()
            d.stop()
