"""A request looked up again every step it waits costs what changed since its last lookup."""

import os
from collections import Counter

import numpy as np
import pytest

from lmkv.config import load_config
from lmkv.engine.residency import ResidencyDelta, ResidencyMirror
from lmkv.engine.scheduler import OffloadScheduler
from lmkv.lookup import FIRST_CHUNK
from lmkv.page import header_of_digests, make_header
from lmkv.store import TieredStore

PAGES = 1024


class Asked:
    """Counts the keys each tier of a store is asked about (wrapping the real tiers' ``contains``)."""

    def __init__(self, tiers):
        self.keys = {t.name: 0 for t in tiers}
        for t in tiers:
            real = t.contains

            def counted(keys, real=real, name=t.name):
                self.keys[name] += len(keys)
                return real(keys)

            t.contains = counted

    def take(self) -> dict[str, int]:
        out, self.keys = self.keys, dict.fromkeys(self.keys, 0)
        return out


def _request(layout, pages=PAGES, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 50_000, pages * layout.tokens_per_page + 1).tolist()
    return tokens


def _put(store, layout, keys):
    payload = np.zeros(layout.payload_bytes, np.uint8)
    digests = make_header(keys[0], layout, payload).digests
    store.put_pages([(header_of_digests(k, layout, digests), payload) for k in keys])
    store.drain()


@pytest.fixture
def store(tmp_path):
    cfg = load_config({"memory": {"capacity": "256MiB"},
                       "disk": {"path": str(tmp_path / "disk"), "capacity": "1GiB", "io": "buffered"}}, environ={})
    with TieredStore(cfg) as s:
        s.tiers[1].wait_indexed()
        yield s


def _sched(store, layout):
    return OffloadScheduler(store, [layout], layout.tokens_per_page, "m", "default")


def test_a_prompt_no_tier_holds_is_hashed_and_asked_only_as_far_as_its_first_miss(store, layout):
    sched = _sched(store, layout)
    asked = Asked(store.tiers)
    st = sched.track("r")
    assert sched.lookup(st, _request(layout), 0) == 0
    assert len(st.seq.chains) <= FIRST_CHUNK  # (not the prompt's 1,024 pages)
    assert asked.take() == {"memory": FIRST_CHUNK, "disk": FIRST_CHUNK}


def test_a_repeated_lookup_asks_no_tier_about_pages_it_answered_for(store, layout):
    sched = _sched(store, layout)
    tokens = _request(layout)
    st = sched.track("r")
    sched.lookup(st, tokens, 0)
    st.seq.extend(tokens, 600)
    keys = st.seq.keys(layout, 0, 600)
    _put(store, layout, keys[:400])  # memory and (write-through) disk
    asked = Asked(store.tiers)
    assert sched.lookup(st, tokens, 0) == 400 * layout.tokens_per_page
    first = sum(asked.take().values())
    # other requests store pages between steps: the tiers gained pages, none of this request's
    _put(store, layout, [os.urandom(16) for _ in range(8)])
    for _ in range(3):
        assert sched.lookup(st, tokens, 0) == 400 * layout.tokens_per_page
        step = asked.take()
        assert sum(step.values()) <= 2 * FIRST_CHUNK, step  # only past the hit, never its 400 pages
    assert first >= 400
    # nothing changed at all: nothing asked
    assert sched.lookup(st, tokens, 0) == 400 * layout.tokens_per_page
    assert asked.take() == {"memory": 0, "disk": 0}


def test_a_page_a_tier_lost_since_the_last_lookup_ends_the_hit_there(store, layout):
    sched = _sched(store, layout)
    tokens = _request(layout)
    st = sched.track("r")
    st.seq.extend(tokens, 300)
    keys = st.seq.keys(layout, 0, 300)
    _put(store, layout, keys)
    assert sched.lookup(st, tokens, 0) == 300 * layout.tokens_per_page
    store.delete([keys[120]])  # both tiers lose page 120
    assert sched.lookup(st, tokens, 0) == 120 * layout.tokens_per_page
    store.memory.delete([keys[50]])  # memory alone loses page 50: the disk still has it
    assert sched.lookup(st, tokens, 0) == 120 * layout.tokens_per_page
    _put(store, layout, [keys[120]])  # back again: the hit grows past it
    assert sched.lookup(st, tokens, 0) == 300 * layout.tokens_per_page


def test_a_repeated_lookup_counts_each_tiers_pages_as_a_fresh_lookup_does(store, layout):
    """A step adds only its new pages to the last count of pages per tier (what the scheduler
    weighs a hit's loads by): it must still equal a count from scratch, after growth and losses."""
    keys = [os.urandom(16) for _ in range(300)]
    memo = None

    def step() -> Counter:
        nonlocal memo
        found, memo = store.find_prefix(lambda a, b: keys[a:b], 0, len(keys), memo)
        fresh, _ = store.find_prefix(lambda a, b: keys[a:b], 0, len(keys))
        assert found.tiers == fresh.tiers
        assert found.per_tier(40) == Counter(fresh.tiers[:40])
        return Counter(found.per_tier(found.pages))

    assert step() == {}
    _put(store, layout, keys[:200])  # memory and (write-through) disk
    assert step() == {"memory": 200}
    store.memory.delete(keys[:20])  # on the disk alone now
    assert step() == {"disk": 20, "memory": 180}
    _put(store, layout, keys[200:250])  # the hit grows: its new pages are added to the last count
    assert step() == {"disk": 20, "memory": 230}
    assert step() == {"disk": 20, "memory": 230}


def test_the_mirror_of_a_workers_memory_follows_its_deltas(layout):
    mirror = ResidencyMirror()
    sched = _sched(mirror, layout)
    tokens = _request(layout, pages=200)
    st = sched.track("r")
    st.seq.extend(tokens, 200)
    keys = st.seq.keys(layout, 0, 200)
    assert sched.lookup(st, tokens, 0) == 0
    mirror.apply(ResidencyDelta(added=keys[:150]))
    assert sched.lookup(st, tokens, 0) == 150 * layout.tokens_per_page
    mirror.apply(ResidencyDelta(removed=[keys[10]]))
    assert sched.lookup(st, tokens, 0) == 10 * layout.tokens_per_page


def test_a_lost_page_older_than_the_notes_remember_is_asked_again(store, layout, monkeypatch):
    sched = _sched(store, layout)
    tokens = _request(layout, pages=100)
    st = sched.track("r")
    st.seq.extend(tokens, 100)
    keys = st.seq.keys(layout, 0, 100)
    _put(store, layout, keys)
    assert sched.lookup(st, tokens, 0) == 100 * layout.tokens_per_page
    store.delete([keys[70]])
    for t in store.tiers:  # the notes forgot what was lost (more losses than they keep)
        t.notes._recent.clear()
    assert sched.lookup(st, tokens, 0) == 70 * layout.tokens_per_page
