"""The lazy policy's reuse model: lineages, and the learned chance of a block being needed again."""

from lmkv.offload.reuse import BRANCHES, EXTENDS, MIN_EVIDENCE, MIN_WATCH_STEPS, SINGLE, ReuseModel, idle_bucket


def chain(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def note(m: ReuseModel, hashes: list[bytes], cached: int = 0, step: int = 0) -> None:
    for h in hashes:
        m.note_block(h, hashes[0])
    m.note_request(hashes, cached, step)


SYSTEM = ["sys0", "sys1"]


def test_agent_turns_extend_and_document_questions_branch():
    m = ReuseModel(remembered=100)
    note(m, chain(*SYSTEM, "a0", "a1"))  # an agent's first turn
    note(m, chain(*SYSTEM, "d0", "d1", "q0"))  # a document's first question: the family's shared pages shrink
    note(m, chain(*SYSTEM, "a0", "a1", "out", "a2"))  # the agent's next turn continues the whole first one
    note(m, chain(*SYSTEM, "d0", "d1", "q1"))  # another question leaves the first at the document's end
    note(m, chain(*SYSTEM, "d0", "d1", "q2"))
    kind = lambda h: m._class(h.encode(), 0)[1]  # noqa: E731
    assert kind("a2") == EXTENDS and kind("d1") == BRANCHES and kind("q2") == BRANCHES
    assert kind("sys0") == SINGLE  # the family's shared pages belong to no lineage
    assert m._class(b"d0", 0)[0] == 3 and m._class(b"q0", 0)[0] == 1  # uses: the body thrice, a question's tail once


def test_the_estimate_needs_evidence_and_learns_from_outcomes():
    m = ReuseModel(remembered=100)
    tails = [chain(*SYSTEM, f"doc{i}", f"q{i}") for i in range(MIN_EVIDENCE)]
    for c in tails:
        note(m, c)
    # the same class, watched near eviction: nothing settled yet, so no estimate
    assert all(m.watch(c[-1], step=0) is None for c in tails)
    m.settle(MIN_WATCH_STEPS + 1)  # nobody asked for them within the horizon: not needed
    assert m.watch(b"new", step=MIN_WATCH_STEPS + 1) is None  # another class: still no evidence
    note(m, chain(*SYSTEM, "docX", "qX"), step=MIN_WATCH_STEPS + 2)
    p = m.watch(b"qX", step=MIN_WATCH_STEPS + 2)
    assert p is not None and p < 0.2
    # one of them is asked for after all, beyond what the engine holds: a late success, the
    # horizon of its class grows (and only of its class)
    note(m, tails[0], cached=2, step=10 * MIN_WATCH_STEPS)
    c = (1, SINGLE, 0)
    assert m.needed[c] == 1 and m.not_needed[c] == MIN_EVIDENCE - 1
    assert m.horizon[c] >= 2 * (10 * MIN_WATCH_STEPS) and len(m.horizon) == 1


def test_one_lineage_s_many_blocks_are_one_observation():
    """A document's body settles a hundred blocks at once: evidence for an estimate takes outcomes
    from MIN_EVIDENCE lineages, not MIN_EVIDENCE blocks of one."""
    m = ReuseModel(remembered=100)
    note(m, chain(*SYSTEM, "other"))
    bodies = [chain(*SYSTEM, *(f"doc{i}-{j}" for j in range(50))) for i in range(MIN_EVIDENCE)]
    note(m, bodies[0])
    for h in bodies[0][2:]:
        m.watch(h, 0)
    m.settle(MIN_WATCH_STEPS + 1)
    c = m._class(bodies[0][-1], 0)  # as they were when watched
    assert m.not_needed[c] == 50 and m.estimate(c) is None
    for step, b in enumerate(bodies[1:], start=MIN_WATCH_STEPS + 2):
        note(m, b, step=step)
        m.watch(b[-1], step)
    m.settle(3 * MIN_WATCH_STEPS)
    assert m.estimate(c) < 0.2


def test_a_branching_lineage_s_tails_are_not_continued():
    """A document's next question leaves the previous one's tail (and answer): once lineages that had
    branched went on branching, a block only one request used in such a lineage is unlikely to be
    read again; the document's body (used by every question) is not judged by this."""
    m = ReuseModel(remembered=100)
    note(m, chain(*SYSTEM, "other"))
    for d in range(MIN_EVIDENCE):
        for q in range(3):
            note(m, chain(*SYSTEM, f"d{d}", f"body{d}", f"q{d}-{q}"), step=10 * q)
            m.finish(chain(*SYSTEM, f"d{d}", f"body{d}", f"q{d}-{q}", f"a{d}-{q}"), 10 * q + 5)
    assert m.continued(b"q0-2", b"q0-2") < 0.2
    assert m.continued(b"a0-2", b"q0-2") < 0.2  # an answer (in no lineage) judged by its question's
    assert m.continued(b"body0", b"body0") is None  # used by every question
    note(m, chain(*SYSTEM, "agent", "t0"), step=100)
    m.finish(chain(*SYSTEM, "agent", "t0", "out0"), 105)
    note(m, chain(*SYSTEM, "agent", "t0", "out0", "t1"), step=110)  # it extends
    assert m.continued(b"t1", b"t1") is None


def test_a_block_the_engine_still_held_was_not_needed_from_a_tier():
    m = ReuseModel(remembered=100)
    c = chain(*SYSTEM, "a0", "a1")
    note(m, c)
    m.watch(b"a1", step=1)
    note(m, c, cached=len(c), step=2)  # revived from the engine's own cache: a copy would have been wasted
    assert m.not_needed[(1, SINGLE, 0)] == 1 and m.needed[(1, SINGLE, 0)] == 0
    m.watch(b"a1", step=3)
    note(m, c, cached=2, step=4)  # evicted meanwhile: needed from a tier
    assert m.needed[(2, SINGLE, 0)] == 1


def test_one_shot_families_and_forgetting():
    m = ReuseModel(remembered=2)
    for i in range(10):
        note(m, chain("stream-sys", f"p{i}a", f"p{i}b"))
    assert m.one_shot(b"p3a", min_requests=8, min_rate=0.1)
    assert not m.one_shot(b"p3a", min_requests=16, min_rate=0.1)  # not enough requests to judge
    assert len(m._lineages) == 2  # bounded
    for i in range(5):  # one-shot prompts without a shared first page: one family each, bounded too
        note(m, chain(f"alone{i}", "x"))
    assert len(m._families) == 2
    m.forget(b"p3a")
    assert not m.one_shot(b"p3a", min_requests=8, min_rate=0.1)  # a block it no longer knows


def test_sessions_waited_for_are_bounded_by_the_lineages_remembered():
    m = ReuseModel(remembered=3)
    note(m, chain(*SYSTEM, "other"))
    for s in range(10):  # agent sessions that end after two turns
        first = [*SYSTEM, f"s{s}", f"s{s}t0"]
        note(m, chain(*first), step=10 * s)
        m.finish(chain(*first, f"s{s}out0"), 10 * s + 1)
        note(m, chain(*first, f"s{s}out0", f"s{s}t1"), cached=4, step=10 * s + 2)
        m.finish(chain(*first, f"s{s}out0", f"s{s}t1", f"s{s}out1"), 10 * s + 3)
    assert m._reached[0] == 10  # every one waited for its next turn
    assert len(m._bucket) <= 3 and sum(len(f) for f in m._idle) == len(m._bucket)



def test_idle_time_separates_a_session_between_turns_from_one_that_ended():
    """Blocks are classed by how long ago a request used them: an agent's blocks near eviction
    during a tool call (needed by the next turn) and long after its last turn (never needed)
    learn apart, each class settling on its own horizon."""
    assert [idle_bucket(i) for i in (0, 15, 16, 31, 32, 100, 1000, 10**6)] == [0, 0, 1, 1, 1, 2, 3, 4]
    m = ReuseModel(remembered=1000)
    note(m, chain(*SYSTEM, "another"))  # the family's shared pages: the system prompt
    for s in range(MIN_EVIDENCE):
        t0 = 10_000 * s
        first, second = chain(*SYSTEM, f"s{s}a", "x"), chain(*SYSTEM, f"s{s}a", "x", f"s{s}b", "y")
        note(m, first, step=t0)
        m.finish(first, t0 + 5)  # the turn finishes
        m.watch(f"s{s}a".encode(), t0 + 10)  # near eviction during the tool call
        note(m, second, cached=2, step=t0 + 4000)  # a slow next turn needs it from a tier
        m.finish(second, t0 + 4005)  # the last turn finishes
        m.watch(f"s{s}b".encode(), t0 + 4005 + 600)  # near eviction long after
        m.settle(t0 + 4005 + 600 + MIN_WATCH_STEPS + 1)  # settled although the other class waits longer
    assert m.needed[(1, SINGLE, 0)] == MIN_EVIDENCE and m.horizon[(1, SINGLE, 0)] >= 2 * 3990
    assert m.not_needed[(1, EXTENDS, idle_bucket(600))] == MIN_EVIDENCE
    note(m, chain(*SYSTEM, "n", "z"), step=10**6)
    assert m.watch(b"n", 10**6 + 3) > 0.8
    m.finish(chain(*SYSTEM, "n", "z"), 10**6 + 5)
    note(m, chain(*SYSTEM, "n", "z", "m"), step=10**6 + 10)  # the lineage extends
    assert m.watch(b"m", 10**6 + 10 + 600) < 0.2


def test_an_agent_session_idle_far_longer_than_its_turns_gaps_has_ended():
    """The chance of another turn is learned from every session's gaps between requests (not only
    from blocks near eviction): sessions whose turns came within 20 steps and that then fell
    silent teach that one idle for 600 steps has ended, and one idle for 5 has not. No horizon
    is waited out: a session still silent counts as not back (yet)."""
    m = ReuseModel(remembered=1000)
    note(m, chain(*SYSTEM, "another"))
    step = 0
    for s in range(2 * MIN_EVIDENCE):
        history = [*SYSTEM, f"s{s}"]
        for t in range(5):  # five turns, each continuing the whole previous one and its answer
            history = history + [f"s{s}t{t}"]
            note(m, chain(*history), cached=len(history) - 1, step=step)
            history = history + [f"s{s}out{t}"]
            m.finish(chain(*history), step + 5)  # the turn finishes; the next comes 10-14 steps later
            step += 15 + t
            m.settle(step)
    last = [*SYSTEM, "s1", "s1t0", "s1out0", "s1t1", "s1out1", "s1t2", "s1out2", "s1t3", "s1out3", "s1t4"]
    block = last[-1].encode()
    # fewer than MIN_EVIDENCE sessions have been silent this long: judged as the longest idle enough were
    assert m.another_turn(block, step) < 0.2
    m.settle(step + 2000)
    assert m.another_turn(block, step + 2000) < 0.2
    m.settle(step + 3000)
    late = [*last, "s1out4", "late"]
    note(m, chain(*late), cached=len(late) - 1, step=step + 3000)  # one comes back after all, 3000 steps on
    assert 0.1 < m.another_turn(b"s2t4", step + 3000) < 0.3  # 1 of the 8 seen idle that long
    step += 4000
    live = [*SYSTEM, "live", "livet0"]
    note(m, chain(*live), step=step)
    m.finish(chain(*live, "liveout0"), step + 5)
    note(m, chain(*live, "liveout0", "livet1"), cached=3, step=step + 10)  # it extends: an agent-like session
    m.finish(chain(*live, "liveout0", "livet1", "liveout1"), step + 15)
    assert m.another_turn(b"livet1", step + 20) > 0.6  # four of every five sessions idle 4-7 steps came back
    note(m, chain(*SYSTEM, "doc", "q0"), step=step + 100)
    m.finish(chain(*SYSTEM, "doc", "q0", "a0"), step + 105)
    note(m, chain(*SYSTEM, "doc", "q1"), step=step + 110)  # it branches: a document's questions
    assert m.another_turn(b"doc", step + 1000) is None


def test_a_request_beside_a_running_one_is_not_its_next_turn():
    """A lineage's next request that arrives while its latest still runs (two questions on one
    document at once) branches, even when its prompt holds all the running one's pages: an agent's
    next turn waits for the answer and continues it."""
    m = ReuseModel(remembered=100)
    note(m, chain(*SYSTEM, "other"))
    note(m, chain(*SYSTEM, "doc0", "doc1"), step=0)  # the question fits in the document's last partial page
    note(m, chain(*SYSTEM, "doc0", "doc1", "q1"), step=3)
    assert m._class(b"doc1", 3)[1] == BRANCHES
    m.finish(chain(*SYSTEM, "doc0", "doc1", "q1", "a1"), 8)
    note(m, chain(*SYSTEM, "doc0", "doc1", "q2"), step=20)  # after it finished, but not continuing its answer
    assert m._lineages[b"doc0"].branches == 2 and m._lineages[b"doc0"].extends == 0
