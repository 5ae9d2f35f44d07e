"""The lazy policy's reuse model (lineages, classes, outcomes) and its need estimate (confidence bounds)."""

import pytest

from lmkv.offload.need import WINDOW, Counts, NeedEstimate, lower_bound, upper_bound
from lmkv.offload.reuse import BRANCHES, EXTENDS, MIN_WATCH_STEPS, SINGLE, ReuseModel, idle_bucket


def chain(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def note(m: ReuseModel, hashes: list[bytes], cached: int = 0, step: int = 0) -> None:
    for h in hashes:
        m.note_block(h, hashes[0])
    m.note_request(hashes, cached, step)


def model(remembered: int = 1000, rate: float = 0.1) -> ReuseModel:
    return ReuseModel(remembered, rate, min_family_requests=16, min_reuse_rate=0.1)


SYSTEM = ["sys0", "sys1"]


def test_the_upper_bound_is_wilsons_and_tightens_only_with_observations():
    assert upper_bound(0.0, 0) == 1.0
    assert upper_bound(0.0, 1) == pytest.approx(1.645**2 / (1 + 1.645**2))
    bounds = [upper_bound(0.0, n) for n in (5, 20, 100, 1000)]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] < 0.003
    assert upper_bound(0.2, 400) == pytest.approx(0.2349, abs=1e-4)  # (Wilson, z = 1.645)
    assert upper_bound(0.2, 10) > 0.4  # the same rate from a few observations proves little
    assert Counts(needed=1, blocks=100, sources=1).bound > 0.7  # one lineage's hundred blocks: one observation


def test_the_lower_bound_is_wilsons_and_shows_a_need_only_with_evidence():
    assert lower_bound(0.5, 0) == 0.0 and lower_bound(0.0, 50) == 0.0
    assert lower_bound(0.2, 400) == pytest.approx(0.1692, abs=1e-4)  # (Wilson, z = 1.645)
    assert lower_bound(0.2, 400) < 0.2 < upper_bound(0.2, 400)
    est = NeedEstimate(min_need_rate=0.1)
    for i in range(10):  # 3 in 10 lineages needed: the bound is ~0.13
        est.add("c", f"lineage{i}", needed=i < 3)
    assert est.shown_needed("c")
    est2 = NeedEstimate(min_need_rate=0.1)
    for i in range(10):
        est2.add("c", f"lineage{i}", needed=i < 2)  # 2 in 10: not shown at 95%
    assert not est2.shown_needed("c") and not est2.skip("c") and not est2.shown_needed("unseen")


def test_a_class_is_skipped_only_with_enough_independent_evidence():
    est = NeedEstimate(min_need_rate=0.1)
    for i in range(20):  # 20 lineages, none needed: the bound (~0.12) is still above 0.1
        est.add("c", f"lineage{i}", needed=False)
    assert not est.skip("c")
    for j in range(200):  # many more blocks of the same lineages: no new observation
        est.add("c", f"lineage{j % 20}", needed=False)
    assert est.counts["c"].sources == 20 and not est.skip("c")
    for i in range(20, 40):
        est.add("c", f"lineage{i}", needed=False)
    assert est.skip("c")
    assert not est.skip("unseen")
    for i in range(40, 60):  # blocks of it start being needed: 7 of 260 blocks (the bound is ~0.08)
        est.add("c", f"lineage{i}", needed=i % 3 == 0)
    assert est.skip("c")
    for i in range(60, 80):
        est.add("c", f"lineage{i}", needed=True)
    assert not est.skip("c")  # 27 of 280 needed: ~1/10 is not below 1/10
    assert not NeedEstimate(min_need_rate=0.0).skip("c")


def test_evidence_is_a_window_not_a_lifetime():
    est = NeedEstimate(min_need_rate=0.1)
    for i in range(WINDOW):
        est.add("old", f"l{i}", needed=False)
    assert est.skip("old")
    for i in range(WINDOW):  # the classes go on being observed: the old counts fade
        est.add("new", f"m{i}", needed=True)
    k = est.counts["old"]
    assert k.sources <= WINDOW / 2 and k.blocks <= WINDOW / 2
    for i in range(WINDOW // 8):  # the old class's blocks are needed again now: it is copied again
        est.add("old", f"n{i}", needed=True)
    assert not est.skip("old")


def test_agent_turns_extend_and_document_questions_branch():
    m = model(100)
    note(m, chain(*SYSTEM, "a0", "a1"))  # an agent's first turn
    note(m, chain(*SYSTEM, "d0", "d1", "q0"))  # a document's first question: the family's shared pages shrink
    note(m, chain(*SYSTEM, "a0", "a1", "out", "a2"))  # the agent's next turn continues the whole first one
    note(m, chain(*SYSTEM, "d0", "d1", "q1"))  # another question leaves the first at the document's end
    note(m, chain(*SYSTEM, "d0", "d1", "q2"))
    kind = lambda h: m._class(h.encode(), 0)[2]  # noqa: E731
    assert kind("a2") == EXTENDS and kind("d1") == BRANCHES and kind("q2") == BRANCHES
    assert kind("sys0") == SINGLE  # the family's shared pages belong to no lineage
    assert m._class(b"d0", 0)[1] == 3 and m._class(b"q0", 0)[1] == 1  # uses: the body thrice, a question's tail once
    assert m._class(b"never-admitted", 0)[1] == 0  # decoding filled it


def test_outcomes_settle_on_the_class_horizon_and_late_successes_correct_them():
    m = model()
    tails = [chain(*SYSTEM, f"doc{i}", f"q{i}") for i in range(4)]
    for c in tails:
        note(m, c)
    cls = {m.watch(c[-1], step=0) for c in tails}
    assert len(cls) == 1
    (c,) = cls
    assert c not in m.need.counts  # nothing settled yet
    m.settle(MIN_WATCH_STEPS + 1)  # nobody asked for them within the horizon: not needed
    k = m.need.counts[c]
    assert (k.needed, k.blocks, k.sources) == (0, 4, 4)
    # one is asked for after all, beyond what the engine holds: a late success, the horizon of its
    # class grows (and only of its class)
    note(m, tails[0], cached=2, step=10 * MIN_WATCH_STEPS)
    assert (k.needed, k.blocks) == (1, 4)
    assert m.horizon[c] >= 2 * (10 * MIN_WATCH_STEPS) and len(m.horizon) == 1


def test_a_block_has_one_outcome_until_a_request_uses_it_again():
    """The policy looks at a block near eviction every step: each look is not another observation."""
    m = model()
    c = chain(*SYSTEM, "a0", "a1")
    note(m, c)
    for step in range(0, 3 * MIN_WATCH_STEPS, 7):
        m.watch(b"a1", step)
        m.settle(step)
    k = m.need.counts[m._class(b"a1", 0)]
    assert k.blocks == 1 and k.needed == 0
    note(m, c, cached=2, step=3 * MIN_WATCH_STEPS)  # used again (needed from a tier): a new episode
    assert k.needed == 1 and k.blocks == 1
    m.watch(b"a1", 3 * MIN_WATCH_STEPS + 1)
    assert b"a1" in m._watched


def test_a_block_the_engine_still_held_was_not_needed_from_a_tier():
    m = model()
    c = chain(*SYSTEM, "a0", "a1")
    note(m, c)
    first = m.watch(b"a1", step=1)
    note(m, c, cached=len(c), step=2)  # revived from the engine's own cache: a copy would have been wasted
    assert m.need.counts[first].needed == 0 and m.need.counts[first].blocks == 1
    second = m.watch(b"a1", step=3)
    note(m, c, cached=2, step=4)  # evicted meanwhile: needed from a tier
    assert second != first and m.need.counts[second].needed == 1  # (used twice now: another row)


def test_a_decoded_page_counts_for_its_request_s_lineage():
    """An answer's pages belong to no lineage (no prompt named them), but their outcomes are
    observations of their request's lineage: a document's ten answer pages are one, not ten."""
    m = model()
    note(m, chain(*SYSTEM, "other"))
    note(m, chain(*SYSTEM, "doc", "q"))
    answer = [f"ans{i}" for i in range(10)]
    m.finish(chain(*SYSTEM, "doc", "q", *answer), 5)
    for a in answer:
        m.watch(a.encode(), 6)
    m.settle(6 + MIN_WATCH_STEPS + 1)
    k = m.need.counts[(False, 0, SINGLE, idle_bucket(1))]
    assert k.blocks == 10 and k.sources == 1


def test_one_shot_families_and_forgetting():
    """A family is judged on requests older than the reuse horizon only: until then a second turn
    may still come for each of them."""
    m = ReuseModel(2, 0.1, min_family_requests=8, min_reuse_rate=0.1)
    for i in range(10):
        note(m, chain("stream-sys", f"p{i}a", f"p{i}b"), step=i)
    later = 7 + MIN_WATCH_STEPS
    assert not m.one_shot(b"p3a", 9) and not m.one_shot(b"p3a", later)  # (7 requests old enough)
    assert m.one_shot(b"p3a", later + 1) and m._class(b"p3a", later + 1)[0]
    assert not ReuseModel(2, 0.1, min_family_requests=16, min_reuse_rate=0.1).one_shot(b"p3a", later + 1)
    m.wait_for_returns = False  # (evaluation: judged on every request so far, ten of them, at once)
    assert m.one_shot(b"p3a", 10) and m.need_score(b"p3a", 10) == pytest.approx(upper_bound(0.0, 10))
    m.wait_for_returns = True
    assert len(m._lineages) == 2  # bounded
    for i in range(5):  # one-shot prompts without a shared first page: one family each, bounded too
        note(m, chain(f"alone{i}", "x"))
    assert len(m._families) == 2
    m.forget(b"p3a")
    assert not m.one_shot(b"p3a", later + 1)  # a block it no longer knows


def test_a_conversation_service_is_not_one_shot_once_its_second_turns_come():
    """Every first turn looks one-shot until its second turn comes: a family whose requests come
    back after a gap longer than the shortest watch is judged only once that gap has passed."""
    m = ReuseModel(100, 0.1, min_family_requests=8, min_reuse_rate=0.1)
    gap = 4 * MIN_WATCH_STEPS
    def turn(i: int) -> list[bytes]:
        return chain("chat-sys", f"c{i}a", f"c{i}b", f"c{i}c")

    for i in range(40):  # first turns, then each one's second turn `gap` steps later
        note(m, turn(i), step=10 * i)
    assert m.one_shot(b"c0a", gap - 1)  # (no second turn seen yet: nothing says one will come)
    for i in range(40):
        m.note_block(f"c{i}t2".encode(), b"chat-sys")
        m.note_request(turn(i) + chain(f"c{i}t2"), 1, 10 * i + gap)
        # once the long gaps are more than 5% of the reuses seen (the first turns' own reuse of the
        # system prompt is the rest), the horizon covers them and the family is judged again
        assert m.one_shot(b"c0a", 10 * i + gap) == (i < 2)
    assert m._families[b"chat-sys"].horizon >= gap
    for i in range(40):  # a stream of one-shot prompts beside it: judged on its own (short) reuses
        note(m, chain("stream-sys", f"s{i}a", f"s{i}b", f"s{i}c"), step=10 * i + gap)
    assert m.one_shot(b"s0a", 390 + gap + MIN_WATCH_STEPS) and not m.one_shot(b"c0a", 390 + gap + MIN_WATCH_STEPS)


def test_idle_time_separates_a_session_between_turns_from_one_that_ended():
    """Blocks are classed by how long ago a request used them: an agent's blocks near eviction
    during a tool call (needed by the next turn) and long after its last turn (never needed)
    learn apart, each class settling on its own horizon, and only the second is skipped."""
    assert [idle_bucket(i) for i in (0, 15, 16, 31, 32, 100, 1000, 10**6)] == [0, 0, 1, 1, 1, 2, 3, 4]
    m = model()
    note(m, chain(*SYSTEM, "another"))  # the family's shared pages: the system prompt
    sessions = 40
    for s in range(sessions):
        t0 = 10_000 * s
        first, second = chain(*SYSTEM, f"s{s}a", "x"), chain(*SYSTEM, f"s{s}a", "x", f"s{s}b", "y")
        note(m, first, step=t0)
        m.finish(first, t0 + 5)  # the turn finishes
        m.watch(f"s{s}a".encode(), t0 + 10)  # near eviction during the tool call
        note(m, second, cached=2, step=t0 + 4000)  # a slow next turn needs it from a tier
        m.finish(second, t0 + 4005)  # the last turn finishes
        m.watch(f"s{s}b".encode(), t0 + 4005 + 600)  # near eviction long after
        # settled on the horizon reuses have shown (a turn 4000 steps on: 4096), though the class
        # of the tool call's blocks has waited longer than that for its successes
        m.settle(t0 + 4005 + 600 + 4096 + 1)
    m.settle(10_000 * sessions + 10**5)  # (the system prompt's reuses, 6000 steps apart, lengthen the horizon)
    during, after = (False, 1, SINGLE, 0), (False, 1, EXTENDS, idle_bucket(600))
    assert m.need.counts[during].needed == sessions and m.horizon[during] >= 2 * 3990
    assert m.need.counts[after].needed == 0 and m.need.counts[after].sources == sessions
    assert m.need.skip(after) and not m.need.skip(during)


def test_a_request_beside_a_running_one_is_not_its_next_turn():
    """A lineage's next request that arrives while its latest still runs (two questions on one
    document at once) branches, even when its prompt holds all the running one's pages: an agent's
    next turn waits for the answer and continues it."""
    m = model(100)
    note(m, chain(*SYSTEM, "other"))
    note(m, chain(*SYSTEM, "doc0", "doc1"), step=0)  # the question fits in the document's last partial page
    note(m, chain(*SYSTEM, "doc0", "doc1", "q1"), step=3)
    assert m._class(b"doc1", 3)[2] == BRANCHES
    m.finish(chain(*SYSTEM, "doc0", "doc1", "q1", "a1"), 8)
    note(m, chain(*SYSTEM, "doc0", "doc1", "q2"), step=20)  # after it finished, but not continuing its answer
    assert m._lineages[b"doc0"].branches == 2 and m._lineages[b"doc0"].extends == 0


def test_no_miss_is_settled_before_most_reuses_would_have_come():
    """Blocks nobody asked for yet are not counted as not needed while 95% of the prefixes seen
    coming back took longer than they have waited: a class is not judged before its blocks could
    have returned (the bias that made a slow return look like no return)."""
    m = model()
    note(m, chain(*SYSTEM, "other"))
    for i in range(20):  # prefixes that came back after ~3000 steps
        note(m, chain(*SYSTEM, f"p{i}"), step=0)
        note(m, chain(*SYSTEM, f"p{i}", "more"), cached=2, step=3000)
    assert m._horizon_now == 4096
    note(m, chain(*SYSTEM, "w", "x"), step=3000)
    c = m.watch(b"x", 3000)
    m.settle(3000 + MIN_WATCH_STEPS + 1)
    assert c not in m.need.counts  # still waiting
    m.settle(3000 + 4096 + 1)
    assert m.need.counts[c].blocks == 1 and m.need.counts[c].needed == 0
