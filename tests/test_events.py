"""The event log routers' events come from (lmkv/engine/events.py), without an engine."""

from lmkv.engine.events import MEMORY, EventLog, Placement
from lmkv.engine.residency import ResidencyDelta

DISK = Placement("STORAGE", "LOCAL")
SERVER = Placement("STORAGE", "REMOTE")


def _k(i: int) -> bytes:
    return bytes([i]) * 16


def _seen(events):
    return [(e.stored, e.info, e.where) for e in events]


def test_committed_not_planned_then_below_then_gone():
    log = EventLog()
    log.expect(_k(1), "p1")
    log.expect(_k(2), "p2")  # planned, never committed: never reported
    assert _seen(log.apply(ResidencyDelta(added=[_k(1), _k(9)]), lambda keys: [None] * len(keys))) == [
        (True, "p1", MEMORY)]  # k9: not this engine's store
    below = {_k(1): "server"}
    assert _seen(log.apply(ResidencyDelta(removed=[_k(1)]), lambda keys: [below.get(k) for k in keys])) == [
        (False, "p1", MEMORY), (True, "p1", SERVER)]
    # promoted back into memory: stored in memory again; the server copy stays
    assert _seen(log.apply(ResidencyDelta(added=[_k(1)]), lambda keys: [None] * len(keys))) == [(True, "p1", MEMORY)]
    assert sorted(_seen(log.cleared()), key=str) == sorted([(False, "p1", MEMORY), (False, "p1", SERVER)], key=str)
    assert log.apply(ResidencyDelta(removed=[_k(1)]), lambda keys: ["disk"] * len(keys)) == []


def test_a_page_no_tier_holds_is_removed_and_forgotten():
    log = EventLog()
    log.expect(_k(3), "p3")
    log.apply(ResidencyDelta(added=[_k(3)]), lambda keys: [None] * len(keys))
    assert _seen(log.apply(ResidencyDelta(removed=[_k(3)]), lambda keys: [None] * len(keys))) == [
        (False, "p3", MEMORY)]
    assert log.cleared() == []


def test_what_it_remembers_is_bounded_and_what_it_forgets_is_reported_removed():
    log = EventLog(max_expected=2, max_held=2)
    for i in range(4):
        log.expect(_k(i), f"p{i}")
    assert _seen(log.apply(ResidencyDelta(added=[_k(0), _k(3)]), lambda keys: ["disk"] * len(keys))) == [
        (True, "p3", MEMORY)]  # p0's plan was forgotten (the oldest of 4 with room for 2)
    log.expect(_k(5), "p5")
    log.expect(_k(6), "p6")
    events = _seen(log.apply(ResidencyDelta(added=[_k(5), _k(6)]), lambda keys: ["disk"] * len(keys)))
    assert events[-1] == (False, "p3", MEMORY)  # three held, room for two: the oldest is let go, reported


def test_pages_a_lower_tier_dropped_by_itself_are_found_and_reported_removed():
    """Disk evicted a page, Redis expired another: no delta says so, the audit does."""
    log = EventLog()
    below = {_k(i): "disk" for i in range(5)}
    for i in range(5):
        log.expect(_k(i), f"p{i}")
    log.apply(ResidencyDelta(added=[_k(i) for i in range(5)]), lambda keys: [None] * len(keys))
    log.apply(ResidencyDelta(removed=[_k(i) for i in range(4)]), lambda keys: [below.get(k) for k in keys])
    asked: list[list[bytes]] = []

    def now(keys):
        asked.append(list(keys))
        return [below.get(k) for k in keys]

    assert log.audit(now, limit=10) == [] and asked == [[_k(i) for i in range(4)]]  # p4 is in memory: not asked
    del below[_k(1)]
    below[_k(2)] = "redis"
    asked.clear()
    assert _seen(log.audit(now, limit=2)) == [(False, "p1", DISK)]  # two asked, the longest unchecked
    assert asked == [[_k(0), _k(1)]]
    assert _seen(log.audit(now, limit=2)) == [(False, "p2", DISK), (True, "p2", SERVER)]
    assert asked[-1] == [_k(2), _k(3)]
    assert log.audit(now, limit=2) == [] and asked[-1] == [_k(0), _k(2)]  # round and round
    # a forgotten page is not asked about again; a reset reports what is left
    assert sorted(_seen(log.cleared()), key=str) == sorted(
        [(False, "p0", DISK), (False, "p2", SERVER), (False, "p3", DISK), (False, "p4", MEMORY)], key=str)
