"""The lazy policy's reuse model: lineages, and the learned chance of a block being needed again."""

from lmkv.reuse import BRANCHES, EXTENDS, MIN_EVIDENCE, MIN_WATCH_STEPS, SINGLE, ReuseModel


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
    kind = lambda h: m._class(h.encode())[1]  # noqa: E731
    assert kind("a2") == EXTENDS and kind("d1") == BRANCHES and kind("q2") == BRANCHES
    assert kind("sys0") == SINGLE  # the family's shared pages belong to no lineage
    assert m._class(b"d0")[0] == 3 and m._class(b"q0")[0] == 1  # uses: the body thrice, a question's tail once


def test_the_estimate_needs_evidence_and_learns_from_outcomes():
    m = ReuseModel(remembered=100)
    tails = [chain(*SYSTEM, f"doc{i}", f"q{i}") for i in range(MIN_EVIDENCE)]
    for c in tails:
        note(m, c)
    # the same class, watched near eviction: nothing settled yet, so no estimate
    assert all(m.watch(c[-1], step=0) is None for c in tails)
    m.settle(MIN_WATCH_STEPS + 1)  # nobody asked for them within the horizon: not needed
    assert m.watch(b"new", step=MIN_WATCH_STEPS + 1) is None  # another class: still no evidence
    note(m, chain(*SYSTEM, "docX", "qX"))
    p = m.watch(b"qX", step=MIN_WATCH_STEPS + 2)
    assert p is not None and p < 0.2
    # one of them is asked for after all, beyond what the engine holds: a late success, the horizon grows
    note(m, tails[0], cached=2, step=10 * MIN_WATCH_STEPS)
    assert m.needed[1][0] == 1 and m.not_needed[1][0] == MIN_EVIDENCE - 1
    assert m.horizon >= 2 * (10 * MIN_WATCH_STEPS)


def test_a_block_the_engine_still_held_was_not_needed_from_a_tier():
    m = ReuseModel(remembered=100)
    c = chain(*SYSTEM, "a0", "a1")
    note(m, c)
    m.watch(b"a1", step=1)
    note(m, c, cached=len(c), step=2)  # revived from the engine's own cache: a copy would have been wasted
    assert m.not_needed[1][0] == 1 and m.needed[1][0] == 0
    m.watch(b"a1", step=3)
    note(m, c, cached=2, step=4)  # evicted meanwhile: needed from a tier
    assert m.needed[2][0] == 1


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
