import pytest

from lmkv.tiers.eviction import LRUPolicy, S3FIFOPolicy, make_policy


def _fill_and_run(policy, capacity: int, trace: list[int]) -> int:
    """Simulate a cache of ``capacity`` keys; returns hits."""
    resident: set[int] = set()
    hits = 0
    for k in trace:
        if k in resident:
            hits += 1
            policy.touch(k)
            continue
        if len(resident) >= capacity:
            resident.discard(policy.victim(lambda _: True))
        policy.insert(k)
        resident.add(k)
    return hits


def test_lru_order_and_pinned_skip():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.victim(lambda k: k != "b") == "c"
    assert p.victim(lambda k: True) == "b"
    assert len(p) == 1
    assert p.victim(lambda k: False) is None


def test_s3fifo_resists_a_scan_that_flushes_lru():
    hot = list(range(50))
    trace = hot * 4
    for i in range(5):  # a long scan of one-time keys between bursts of the hot set
        trace += list(range(1000 + 400 * i, 1400 + 400 * i)) + hot * 2
    lru_hits = _fill_and_run(LRUPolicy(), 100, trace)
    s3_hits = _fill_and_run(S3FIFOPolicy(), 100, trace)
    assert s3_hits > lru_hits * 1.5


def test_s3fifo_skips_pinned_and_removes():
    p = S3FIFOPolicy()
    for k in range(10):
        p.insert(k)
    p.remove(3)
    assert len(p) == 9
    evicted = [p.victim(lambda k: k % 2 == 0) for _ in range(5)]
    assert sorted(evicted) == [0, 2, 4, 6, 8]
    assert p.victim(lambda k: k % 2 == 0) is None
    assert len(p) == 4


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="accepted"):
        make_policy("clock")
