"""Prefill/decode hand-off through lmkv's shared tiers, on vLLM's real scheduler (no model): a
producer stores every prompt block and says so; a consumer waits for the announced pages without
holding the scheduler up, never re-uploads a prompt it computed, and gives up within its deadline;
a network tier that stalls makes a lookup "not yet", then a miss, never a blocked step.

Producer and consumer are two harnesses in one process (two engines, two stores) sharing a disk
tier, the shared tier of these tests. This file also runs on vLLM 0.33.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from support.scheduler_harness import BLOCK, Harness, tokens  # noqa: E402

from lmkv.dev.server_process import ServerProcess, spawn  # noqa: E402
from lmkv.engine.lookups import NOT_YET  # noqa: E402
from lmkv.engine.stores import live_stores  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = 100  # 6 full pages of 16 tokens
PAGES = PROMPT // BLOCK


@contextlib.contextmanager
def _engines(model_config, shared: dict, producer: dict | None = None,
             consumer: dict | None = None) -> Iterator[tuple[Harness, Harness]]:
    """A producer and a consumer on the ``shared`` tier settings, closed on the way out."""
    p = Harness(model_config, {**shared, **(producer or {})}, role="kv_producer")
    d = Harness(model_config, {**shared, **(consumer or {})}, role="kv_consumer")
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _pair(model_config, tmp_path, producer: dict | None = None, consumer: dict | None = None):
    """A producer and a consumer sharing a disk tier."""
    shared = {"memory": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "shared")}}
    return _engines(model_config, shared, producer, consumer)


@contextlib.contextmanager
def _server_pair(model_config, wait: float) -> Iterator[tuple[ServerProcess, Harness, Harness]]:
    """A producer and a consumer sharing a real ``lmkv serve`` (resumed before the engines close if
    a test stopped it)."""
    with spawn("--memory", "64MiB") as server:
        remote = {"url": server.url, "shm": "never", "timeout": 5, "lookup_timeout": 4}
        with _engines(model_config, {"memory": {"capacity": "64MiB"}, "remote": remote},
                      consumer={"pd": {"wait": wait}}) as (p, d):
            try:
                yield server, p, d
            finally:
                if server.proc.poll() is None:
                    os.kill(server.proc.pid, signal.SIGCONT)


def _store_of(h: Harness):
    return h.worker.worker.store


def _run_until(h: Harness, req, timeout: float = 30) -> float:
    """Steps until ``req`` finished; the longest step (s)."""
    longest = 0.0
    deadline = time.monotonic() + timeout
    while not req.is_finished() and time.monotonic() < deadline:
        t0 = time.monotonic()
        h.step()
        longest = max(longest, time.monotonic() - t0)
    assert req.is_finished()
    return longest


def _step_until_pulled(d: Harness, pages: int, timeout: float = 10) -> None:
    """Steps of a consumer that waits for the rest of a hand-off, until it pulled ``pages``."""
    deadline = time.monotonic() + timeout
    while d.worker.worker.stats.totals.pulled_pages < pages and time.monotonic() < deadline:
        assert not d.step().num_scheduled_tokens  # (still waiting for the rest)
        _store_of(d).drain()
    assert d.worker.worker.stats.totals.pulled_pages == pages


def test_a_producer_stores_every_prompt_block_whatever_the_policy_and_says_so(model_config, tmp_path):
    """Lazy offload would store nothing of a prefill that fits the engine: a producer stores all."""
    with _pair(model_config, tmp_path, producer={"offload": {"policy": "lazy"}}) as (p, d):
        a = p.request("a", tokens(PROMPT, 1), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        p.run(a)
        _store_of(p).drain()
        assert p.worker.worker.stats.totals.stored_pages == PAGES
        assert p.transfer_params["a"] == {"lmkv": {"pages": PAGES}}
        assert d.transfer_params == {}  # (a consumer announces nothing)


def test_a_consumer_waits_for_announced_pages_and_loads_them(model_config, tmp_path):
    """The consumer's request arrives before the producer's pages: it waits ("not yet") while the
    consumer's scheduler keeps stepping, then loads every announced page; it stores nothing of the
    prompt it was handed."""
    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 20}}) as (p, d):
        prompt = tokens(PROMPT, 2)
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        for _ in range(3):
            so = d.step()
            assert not so.num_scheduled_tokens  # waiting for the producer's pages
        a = p.request("a", prompt, max_tokens=1)
        p.run(a)
        _store_of(p).drain()
        _run_until(d, b)
        assert d.worker.worker.stats.totals.loaded_pages == PAGES
        d.check_kv(b, PROMPT + 2)
        assert d.worker.worker.stats.totals.stored_pages == 0


def test_a_waiting_consumer_pulls_pages_into_memory_as_they_land(model_config, tmp_path):
    """The producer's pages land in two bursts (its prefill's steps): while the consumer waits for
    the rest, it copies the first burst into its memory, so its load reads only the second burst
    from the shared tier, and no page twice."""
    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 20}}) as (p, d):
        prompt, first = tokens(PROMPT, 17), 4
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        p.run(p.request("a0", prompt[: first * BLOCK], max_tokens=1))
        _store_of(p).drain()
        shared = _store_of(d).tiers[1]
        _step_until_pulled(d, first)
        assert shared.stats.hits == first
        p.run(p.request("a", prompt, max_tokens=1))
        _store_of(p).drain()
        _run_until(d, b)
        t = d.worker.worker.stats.totals
        assert t.loaded_pages == PAGES and t.layerwise_pages == PAGES - first  # (read from below memory)
        assert shared.stats.hits == PAGES
        assert not d.served_wrong_kv
        d.check_kv(b, PROMPT + 2)


def test_a_waiting_consumer_asks_with_backoff_and_paces_an_idle_engine_only(model_config, tmp_path):
    """An engine with nothing to run steps in a tight loop (vLLM's scheduler and worker spinning on
    each other): a request waiting for announced pages asks the tiers every few ms at first, then
    every POLL_MAX_S, and an engine with nothing else to run steps only as often. An engine running
    another request is not paced."""
    from lmkv.engine.scheduler import POLL_MAX_S

    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 0.5}}) as (p, d):
        sched = d.sched.connector.scheduler
        asked = []
        find = sched.store.find_prefix
        sched.store.find_prefix = lambda *a, **kw: (asked.append(1), find(*a, **kw))[1]
        b = d.request("b", tokens(PROMPT, 16), max_tokens=2, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        steps, t0 = 0, time.monotonic()
        while not d.step().num_scheduled_tokens:
            steps += 1
        assert len(asked) <= 0.5 / POLL_MAX_S + 8
        assert steps <= len(asked) + 8  # (unpaced, an idle engine steps hundreds of times a second)
        assert time.monotonic() - t0 < 0.5 + POLL_MAX_S + 0.3
        _run_until(d, b)
        r = d.request("r", tokens(40, 18), max_tokens=400)
        d.sched.add_request(r)
        c = d.request("c", tokens(PROMPT, 19), max_tokens=2, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(c)
        steps, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.3:
            assert "c" not in d.step().num_scheduled_tokens
            steps += 1
        assert steps > 3 * 0.3 / POLL_MAX_S  # (r's steps are not paced by c's wait)


def test_an_idle_engine_is_paced_only_while_nothing_else_waits():
    """The pause of a step that runs nothing lasts until a waiting consumer's next poll, or until its
    lookup answers when one is out, and is none while another request waits for its own lookup (it
    runs the moment the answer comes)."""
    import threading

    from lmkv.config import load_config
    from lmkv.engine.scheduler import POLL_MAX_S, OffloadScheduler
    from lmkv.layout import attention_layout
    from lmkv.store import TieredStore

    layout = attention_layout("attn", 2, BLOCK, 2, 64, 2, "bfloat16")
    with TieredStore(load_config({"memory": {"capacity": "4MiB"}}, environ={})) as store:
        s = OffloadScheduler(store, [layout], BLOCK, "m", "ns", role="consumer", lookup_timeout=5)
        assert s.idle_wait() == 0.0  # (no one waits)
        st = s.track("a", prompt_tokens=PROMPT, expect_pages=PAGES)
        st.next_poll = time.monotonic() + 0.02
        assert 0.01 < s.idle_wait() <= min(0.02, POLL_MAX_S)
        # a's lookup out: the pause lasts until it answers (the engine's loop never spins meanwhile)
        landed = threading.Event()
        assert s._lookups.result("a", 0, lambda: landed.wait(5)) is NOT_YET
        st.next_poll = time.monotonic() - 1  # (its poll was due: what paced the loop before was the lookup)
        assert 0.9 * POLL_MAX_S < s.idle_wait() <= POLL_MAX_S
        t0 = time.monotonic()
        s.pause_idle()
        assert time.monotonic() - t0 >= 0.9 * POLL_MAX_S  # (nothing answered: the whole pause)
        threading.Timer(0.005, landed.set).start()
        t0 = time.monotonic()
        s.pause_idle()
        assert time.monotonic() - t0 < 0.9 * POLL_MAX_S  # (woken by the answer)
        answer = threading.Event()
        s.track("b", prompt_tokens=PROMPT)
        assert s._lookups.result("b", 0, lambda: answer.wait(5)) is NOT_YET
        assert s.idle_wait() == 0.0
        answer.set()
        s.close()


def test_a_consumer_gives_up_at_its_deadline_and_uploads_nothing(model_config, tmp_path):
    """Announced pages that never come: the request runs once ``pd.wait`` has passed, recomputing
    its prompt, which the consumer does not store (it only ever had it because it did not come)."""
    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 0.3}}) as (p, d):
        b = d.request("b", tokens(PROMPT, 3), max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        t0 = time.monotonic()
        while not d.step().num_scheduled_tokens:
            assert time.monotonic() - t0 < 5
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 1.0
        _run_until(d, b)
        d.check_kv(b, PROMPT + 2)
        assert d.worker.worker.stats.totals.loaded_pages == 0 and d.worker.worker.stats.totals.stored_pages == 0
        _store_of(d).drain()
        assert len(_store_of(d).tiers[1]) == 0  # nothing reached the shared tier


@pytest.mark.parametrize("stores_decoded", [True, False])
def test_a_consumer_stores_the_blocks_it_decoded_only_if_told(model_config, tmp_path, stores_decoded):
    """The answer's blocks are what the next turn's prefill on the producer could load."""
    pd = {"consumer_stores_decoded": stores_decoded, "wait": 0}
    with _pair(model_config, tmp_path, consumer={"pd": pd}) as (p, d):
        b = d.request("b", tokens(PROMPT, 4), max_tokens=30)  # 100 + 30 tokens: pages 6 and 7 are decoded
        d.run(b)
        stored = d.worker.worker.stats.totals.stored_pages
        assert stored == (2 if stores_decoded else 0)


def test_a_pause_ends_when_a_request_arrives():
    """A consumer waits, its lookup out: a request that comes in meanwhile ends the pause of an
    empty step at once (vLLM reads its input queue only between steps), found in the input queue
    of the engine core that built the connector."""
    import queue
    import threading

    from lmkv.config import load_config
    from lmkv.connectors.vllm_arrivals import engine_arrivals
    from lmkv.engine.scheduler import POLL_MAX_S, OffloadScheduler
    from lmkv.layout import attention_layout
    from lmkv.store import TieredStore

    class Connector:
        def __init__(self) -> None:
            self.arrivals = engine_arrivals()

    class Scheduler:
        def __init__(self) -> None:
            self.connector = Connector()

    class EngineCore:  # (vLLM's: its scheduler built in its constructor, the queue made before it)
        def __init__(self) -> None:
            self.input_queue: queue.Queue = queue.Queue()
            self.scheduler = Scheduler()

    core = EngineCore()
    arrived = core.scheduler.connector.arrivals
    assert arrived is not None and not arrived()
    assert Connector().arrivals is None  # (built by no engine core: the pause keeps its own timing)
    layout = attention_layout("attn", 2, BLOCK, 2, 64, 2, "bfloat16")
    with TieredStore(load_config({"memory": {"capacity": "4MiB"}}, environ={})) as store:
        s = OffloadScheduler(store, [layout], BLOCK, "m", "ns", role="consumer", lookup_timeout=5)
        s.track("a", prompt_tokens=PROMPT, expect_pages=PAGES)
        landed = threading.Event()
        assert s._lookups.result("a", 0, lambda: landed.wait(5)) is NOT_YET
        t0 = time.monotonic()
        s.pause_idle(arrived)
        assert time.monotonic() - t0 >= 0.9 * POLL_MAX_S  # (nothing came: the whole pause)
        threading.Timer(0.005, core.input_queue.put, ("a request",)).start()
        t0 = time.monotonic()
        s.pause_idle(arrived)
        assert time.monotonic() - t0 < 0.8 * POLL_MAX_S  # (woken by the request)
        landed.set()
        s.close()


def test_a_lookup_given_up_on_is_no_measure_of_the_networks_pace():
    """Lookups no request waits for any more (a consumer's deadline passed, the network was
    presumed stalled) that answer late do not raise the bar for the next stall: the fifth stalled
    hand-off in a row was not seen as one, and the request beside it waited out its whole lookup
    deadline. Lookups answered slowly while waited for still do (a slow network is not stalled)."""
    import threading

    from lmkv.engine.lookups import STALL_S, AsyncLookups

    lookups = AsyncLookups(timeout=5)
    try:
        for i in range(3):  # a quick network
            assert lookups.result(f"q{i}", 0, lambda: 0) == 0
        stop = threading.Event()
        for i in range(8):  # then stalled lookups, given up on, answering late
            assert lookups.result(f"s{i}", 0, lambda: stop.wait(5)) is NOT_YET
            lookups.forget(f"s{i}")
        time.sleep(0.2)
        stop.set()
        time.sleep(0.05)
        hang = threading.Event()
        assert lookups.result("next", 0, lambda: hang.wait(5)) is NOT_YET
        time.sleep(STALL_S * 2)
        assert lookups.stalled()  # (with the late answers counted: only past 8 x 0.2 s)
        hang.set()

        slow = AsyncLookups(timeout=5)  # a slow network: every lookup answered, while waited for, in 0.1 s
        for i in range(5):
            while slow.result(f"q{i}", 0, lambda: time.sleep(0.1)) is NOT_YET:
                time.sleep(0.005)
        hang.clear()
        assert slow.result("next", 0, lambda: hang.wait(5)) is NOT_YET
        time.sleep(STALL_S * 3)
        assert not slow.stalled()
        hang.set()
        slow.close()
    finally:
        lookups.close()


def test_before_any_lookup_has_answered_a_stall_takes_longer_to_presume():
    """A fresh engine's first lookups pay one-time costs: one unanswered for more than STALL_S, but
    less than STALL_FIRST_S, is not yet a stall (a vLLM CPU engine's first lookup of a healthy
    same-host server went unanswered for 55 ms, and its request missed the server's pages). Once a
    lookup has answered, STALL_S applies."""
    import threading

    from lmkv.engine.lookups import STALL_FIRST_S, STALL_S, AsyncLookups

    lookups = AsyncLookups(timeout=5)
    hang = threading.Event()
    try:
        assert lookups.result("first", 0, lambda: hang.wait(5)) is NOT_YET
        time.sleep(STALL_S * 2)
        assert not lookups.stalled()
        time.sleep(STALL_FIRST_S)
        assert lookups.stalled()  # (a tier stalled from the start costs the first request this once)
        hang.set()
        while lookups.result("first", 0, lambda: None) is NOT_YET:
            time.sleep(0.005)
        for i in range(3):  # (quick answers: the slow first one does not set the bar)
            assert lookups.result(f"q{i}", 0, lambda: 0) == 0
        hang.clear()
        assert lookups.result("second", 0, lambda: hang.wait(5)) is NOT_YET
        time.sleep(STALL_S * 2)
        assert lookups.stalled()
    finally:
        hang.set()
        lookups.close()


def test_a_stalled_network_tier_never_stalls_the_scheduler(model_config, silent_listener):
    """A tier that accepts and never answers: a waiting request's lookup is "not yet", then (the
    tier presumed stalled) it asks local tiers only and runs; meanwhile a running request goes on
    step after step, and no step waits for the tier."""
    lmkv = {"memory": {"capacity": "64MiB"},
            "remote": {"url": f"lmkv://127.0.0.1:{silent_listener}", "timeout": 3, "lookup_timeout": 2,
                       "shm": "never"}}
    h = Harness(model_config, lmkv)
    try:
        running = h.request("r", tokens(40, 5), max_tokens=200)
        h.sched.add_request(running)
        assert _wait_to_run(h, "r") < 1.5  # (far sooner than lookup_timeout: the tier is presumed stalled)
        waiting = h.request("w", tokens(PROMPT, 6), max_tokens=2)
        h.sched.add_request(waiting)
        t0, longest, steps, with_r = time.monotonic(), 0.0, 0, 0
        while not waiting.is_finished():
            s0 = time.monotonic()
            so = h.step()
            longest = max(longest, time.monotonic() - s0)
            steps, with_r = steps + 1, with_r + ("r" in so.num_scheduled_tokens)
            assert time.monotonic() - t0 < 5
        assert longest < 0.2, longest  # (a blocked lookup would hold a step for the tier's 3 s)
        assert with_r == steps  # (r went on in every step meanwhile)
        assert h.connector_stats.get("scheduler.lookups_local_only", 0) >= 1
        h.check_kv(waiting, PROMPT + 1)
    finally:
        h.close()


def _wait_to_run(h: Harness, req_id: str, timeout: float = 10) -> float:
    """Steps until ``req_id`` is scheduled; the seconds that took."""
    t0 = time.monotonic()
    while req_id not in h.step().num_scheduled_tokens:
        assert time.monotonic() - t0 < timeout
    return time.monotonic() - t0


def _short_handoffs_said(caplog) -> list[str]:
    """What the consumer logged of its hand-offs that came short."""
    return [r.getMessage() for r in caplog.records if "came within pd.wait" in r.getMessage()]


def test_a_consumer_waits_no_longer_than_pd_wait_for_a_stalled_tier(model_config, silent_listener, caplog):
    """Promised pages on a tier that stopped answering: the request runs at ``pd.wait``, though
    its lookup's own deadline (``remote.lookup_timeout``) is far later; the log says so."""
    caplog.set_level(logging.INFO, logger="lmkv.engine.scheduler")
    lmkv = {"memory": {"capacity": "64MiB"}, "pd": {"wait": 0.3},
            "remote": {"url": f"lmkv://127.0.0.1:{silent_listener}", "timeout": 10, "lookup_timeout": 5,
                       "shm": "never"}}
    d = Harness(model_config, lmkv, role="kv_consumer")
    try:
        b = d.request("b", tokens(PROMPT, 7), max_tokens=2, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        waited = _wait_to_run(d, "b")
        assert 0.3 <= waited < 0.8, waited
        _run_until(d, b)
        assert d.connector_stats.get("scheduler.handoffs_short") == 1
        said = _short_handoffs_said(caplog)
        assert len(said) == 1 and f"request b: 0 of the {PAGES} pages" in said[0], said
        assert "its last lookup unanswered" in said[0]
        d.check_kv(b, PROMPT + 1)
    finally:
        d.close()


def test_requests_over_a_stalled_tier_wait_a_moment_not_each_a_lookup_timeout(model_config, silent_listener):
    """Lookups the tier never answers: once one has gone unanswered for a moment, each request
    (the first and those after it) asks only the local tiers and runs, instead of each waiting
    out ``remote.lookup_timeout`` in turn."""
    lmkv = {"memory": {"capacity": "64MiB"},
            "remote": {"url": f"lmkv://127.0.0.1:{silent_listener}", "timeout": 10, "lookup_timeout": 3,
                       "shm": "never"}}
    h = Harness(model_config, lmkv)
    try:
        reqs = [h.request(f"q{i}", tokens(PROMPT, 8 + i), max_tokens=2) for i in range(3)]
        t0 = time.monotonic()
        for r in reqs:
            h.sched.add_request(r)
            _wait_to_run(h, r.request_id)
        assert time.monotonic() - t0 < 1.5  # (3 x lookup_timeout = 9 s without the stall rule)
        for r in reqs:
            _run_until(h, r)
        assert not h.served_wrong_kv  # (every step's attention read exactly its tokens' KV)
        assert h.connector_stats.get("scheduler.lookups_local_only", 0) >= 3
        assert h.connector_stats.get("scheduler.lookups_timed_out", 0) == 0
    finally:
        h.close()


def test_a_consumer_loads_the_pages_that_came_and_computes_exactly_the_rest(model_config, tmp_path, caplog):
    """The producer died after storing 3 of the 6 pages it would have announced: the consumer
    waits out ``pd.wait``, loads those 3 and computes the prompt's other tokens."""
    caplog.set_level(logging.INFO, logger="lmkv.engine.scheduler")
    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 0.3}}) as (p, d):
        prompt, came = tokens(PROMPT, 12), 3
        p.run(p.request("a", prompt[: came * BLOCK], max_tokens=1))
        _store_of(p).drain()
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        assert 0.3 <= _wait_to_run(d, "b") < 1.0
        _run_until(d, b)
        assert d.worker.worker.stats.totals.loaded_pages == came
        assert d.connector_stats.get("scheduler.loaded_tokens") == came * BLOCK
        assert d.connector_stats.get("scheduler.handoffs_short") == 1
        assert 300 <= d.connector_stats.get("scheduler.handoff_wait_ms", 0) < 1000
        said = _short_handoffs_said(caplog)
        assert len(said) == 1 and f"request b: {came} of the {PAGES} pages" in said[0], said
        assert "unanswered" not in said[0]
        assert not d.served_wrong_kv
        d.check_kv(b, PROMPT + 2)


def test_a_torn_page_on_the_shared_tier_is_recomputed_from_there(model_config, tmp_path):
    """A page file cut short on the shared tier (a writer that died mid-write, a full disk): the
    consumer loads what verifies and recomputes the rest, token-exact."""
    with _pair(model_config, tmp_path, consumer={"pd": {"wait": 1}}) as (p, d):
        prompt = tokens(PROMPT, 13)
        p.run(p.request("a", prompt, max_tokens=1))
        _store_of(p).drain()
        pages = sorted(f for f in (tmp_path / "shared").rglob("*") if f.is_file() and f.stat().st_size > 4096)
        assert len(pages) == PAGES
        victim = pages[len(pages) // 2]
        os.truncate(victim, victim.stat().st_size // 2)
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        _wait_to_run(d, "b")
        _run_until(d, b)
        assert d.worker.worker.stats.totals.loaded_pages < PAGES
        assert not d.served_wrong_kv
        d.check_kv(b, PROMPT + 2)


@pytest.mark.parametrize("fate", ["killed", "stopped"])
def test_a_consumer_recomputes_within_pd_wait_when_the_shared_server_dies_or_stalls(model_config, fate):
    """A real ``lmkv serve`` holds the producer's pages, then is killed or SIGSTOPped before the
    consumer asks: the consumer's request runs at ``pd.wait`` (far sooner than the tier's
    timeouts) and computes its prompt token-exact; a stalled server that resumes serves the next
    hand-off."""
    with _server_pair(model_config, 0.5) as (server, p, d):
        prompt = tokens(PROMPT, 14)
        p.run(p.request("a", prompt, max_tokens=1))
        _store_of(p).drain()
        os.kill(server.proc.pid, signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        assert _wait_to_run(d, "b") < 0.5 + 0.3
        _run_until(d, b)
        assert d.worker.worker.stats.totals.loaded_pages == 0
        assert not d.served_wrong_kv
        d.check_kv(b, PROMPT + 2)
        if fate == "stopped":
            os.kill(server.proc.pid, signal.SIGCONT)
            again = tokens(PROMPT, 15)
            p.run(p.request("a2", again, max_tokens=1))
            _store_of(p).drain()
            c = d.request("c", again, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
            d.sched.add_request(c)
            _run_until(d, c)
            assert d.worker.worker.stats.totals.loaded_pages == PAGES
            d.check_kv(c, PROMPT + 2)


def test_a_consumer_whose_tier_stalls_mid_wait_loads_what_had_landed(model_config):
    """Half the announced pages landed and were pulled into the consumer's memory, then the shared
    server stalls: at ``pd.wait`` the consumer loads those pages from its own memory and computes
    the rest, instead of taking the unanswered lookup for a miss (or waiting on the stalled tier)."""
    with _server_pair(model_config, 1.0) as (server, p, d):
        prompt, came = tokens(PROMPT, 20), 3
        p.run(p.request("a", prompt[: came * BLOCK], max_tokens=1))
        _store_of(p).drain()
        b = d.request("b", prompt, max_tokens=3, kv_transfer_params={"lmkv": {"pages": PAGES}})
        d.sched.add_request(b)
        _step_until_pulled(d, came)
        os.kill(server.proc.pid, signal.SIGSTOP)
        assert _wait_to_run(d, "b") < 1.0 + 0.3
        _run_until(d, b)
        assert d.worker.worker.stats.totals.loaded_pages == came
        assert d.connector_stats.get("scheduler.lookups_timed_out") == 1
        assert not d.served_wrong_kv
        d.check_kv(b, PROMPT + 2)


def test_live_stores_are_released(model_config, tmp_path):
    """(Two engines in one process: each releases its store when closed.)"""
    before = len(live_stores())
    with _pair(model_config, tmp_path):
        assert len(live_stores()) == before + 2
    assert len(live_stores()) == before
