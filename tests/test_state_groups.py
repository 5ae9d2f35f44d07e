"""State groups (Mamba): one state per stored page boundary, a retention setting, and lookups
that end at the last boundary whose state is held — on lmkv's scheduler, no engine."""

from __future__ import annotations

import pytest

from lmkv.config import OffloadConfig, load_config
from lmkv.engine.scheduler import OffloadScheduler, Scheduled
from lmkv.layout import GroupLayout, Segment, StateKind, attention_layout
from lmkv.store import TieredStore

TPP = 16
ATTN = attention_layout("attn", 2, TPP, 1, 64, 2, "bfloat16")
STATE = GroupLayout("mamba", StateKind.MAMBA, 2, (Segment("conv", 512), Segment("ssm", 2048)), TPP, "float32")
TOKENS = list(range(3, 3 + 100))
STATE_BLOCK = 77


@pytest.fixture
def store():
    with TieredStore(load_config({"memory": {"capacity": "64MiB"}}, environ={})) as s:
        yield s


def _sched(store, **offload) -> OffloadScheduler:
    return OffloadScheduler(store, [ATTN, STATE], TPP, "m", "ns", offload=OffloadConfig(**offload))


def _blocks(rid):
    return [list(range(1, 8)), [STATE_BLOCK]]


def _steps(sched, computed_each_step: list[int]):
    """Run the request through steps ending at these token counts; the plans, in order."""
    plans = []
    st = sched.track("r")
    sched.lookup(st, TOKENS, 0)
    sched.allocated("r", _blocks("r"), 0)
    for c in computed_each_step:
        plans.append(sched.build_plan([Scheduled("r", c, TOKENS)], _blocks))
    return plans


def _state_ops(plan):
    return [op for op in plan.stores if op.group == 1]


def test_a_state_is_stored_only_when_a_step_ends_on_a_page_boundary(store):
    plans = _steps(_sched(store), [24, 32, 40, 64])
    assert [_state_ops(p) for p in plans][0] == []  # 24 tokens: inside page 2
    (op,) = _state_ops(plans[1])  # 32 = 2 pages: the state after page 2
    assert op.pages == [1] and op.block_ids == [STATE_BLOCK]
    assert _state_ops(plans[2]) == []
    assert [o.pages for o in _state_ops(plans[3])] == [[3]]
    # attention pages are stored up to the last boundary with a state: none could be restored beyond it
    assert [[p for op in plan.stores if op.group == 0 for p in op.pages] for plan in plans] == [[], [0, 1], [], [2, 3]]


def test_pages_past_the_last_state_boundary_are_never_stored(store):
    """A request that ends between two boundaries leaves its last pages unstored: without a state at
    or after them, no lookup could ever load them (the hit ends at the last boundary with a state)."""
    plans = _steps(_sched(store), [40, 41, 42])
    assert [op.pages for p in plans for op in p.stores] == []
    plans = _steps(_sched(store, state_every_pages=2), [16, 48, 64])  # states kept at every 2nd boundary
    assert [[(op.group, op.pages) for op in p.stores] for p in plans] == [[], [], [(1, [3]), (0, [0, 1, 2, 3])]]


def test_retention_every_n_pages_and_latest_only(store):
    plans = _steps(_sched(store, state_every_pages=2), [16, 32, 48, 64])
    assert [o.pages for p in plans for o in _state_ops(p)] == [[1], [3]]  # boundaries at pages 2 and 4 only
    plans = _steps(_sched(store, state_retention="latest"), [16, 32, 48])
    assert [o.pages for p in plans for o in _state_ops(p)] == [[0], [1], [2]]
    assert [[o.pages for o in p.drops] for p in plans] == [[], [[0]], [[1]]]  # each new state drops the last


def test_a_hit_ends_at_the_last_boundary_whose_state_is_held(store):
    sched = _sched(store)
    st = sched.track("a")
    sched.lookup(st, TOKENS, 0)
    keys_attn = st.seq.keys(ATTN, 0, 5)
    keys_state = st.seq.keys(STATE, 0, 5)
    store.put(keys_attn, [ATTN] * 5, [bytes(ATTN.payload_bytes)] * 5)
    store.put([keys_state[2]], [STATE], [bytes(STATE.payload_bytes)])  # a state at 48 tokens only
    st2 = sched.track("b")
    assert sched.lookup(st2, TOKENS, 0) == 3 * TPP  # 5 attention pages held, the state only at 3
    sched.allocated("b", _blocks("b"), 3 * TPP)
    loads = st2.pending_loads
    assert [(op.group, op.pages) for op in loads] == [(0, [0, 1, 2]), (1, [2])]
    assert loads[1].block_ids == [STATE_BLOCK]
    store.delete([keys_state[2]])
    assert sched.lookup(sched.track("c"), TOKENS, 0) == 0  # no state held: nothing can be restored


def test_a_long_hits_state_is_asked_from_its_end_back_not_page_by_page(store):
    """A 200-page hit whose states are held at pages 150 and 190: the lookup asks the 16 boundaries
    before the end, then 64 more back, and ends the hit at 191 (every page's state asked before)."""
    from lmkv.lookup import FIRST_CHUNK

    tokens = list(range(3, 3 + 200 * TPP + 1))
    sched = _sched(store)
    st = sched.track("long")
    st.seq.extend(tokens, 200)
    keys_attn, keys_state = st.seq.keys(ATTN, 0, 200), st.seq.keys(STATE, 0, 200)
    store.put(keys_attn, [ATTN] * 200, [bytes(ATTN.payload_bytes)] * 200)
    asked: list[int] = []
    real = store.contains

    def counted(keys):
        asked.append(len(keys))
        return real(keys)

    store.contains = counted
    store.put([keys_state[150]], [STATE], [bytes(STATE.payload_bytes)])
    assert sched.lookup(st, tokens, 0) == 151 * TPP
    assert asked[-2:] == [FIRST_CHUNK, 4 * FIRST_CHUNK]  # (from page 199 back: 184-199, then 120-183)
    store.put([keys_state[190]], [STATE], [bytes(STATE.payload_bytes)])
    asked.clear()
    assert sched.lookup(sched.track("again"), tokens, 0) == 191 * TPP
    assert asked[-1] == FIRST_CHUNK
    store.delete([keys_state[150], keys_state[190]])
    assert sched.lookup(sched.track("none"), tokens, 0) == 0  # no state held anywhere: asked back to page 0
