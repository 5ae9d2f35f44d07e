import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmkv.page import ALIGN
from lmkv.tiers.allocator import SlabAllocator


@given(st.lists(st.tuples(st.booleans(), st.sampled_from([4096, 10000, 65536, 200000, 1 << 20])), max_size=300),
       st.integers(0, 2**16), st.sampled_from([0, ALIGN, 2 * ALIGN]))
@settings(max_examples=80, deadline=None)
def test_churn_never_overlaps_and_frees_everything(ops, seed, room):
    """Slots never overlap, with the room kept before each (a tier's header lands there) counted as
    the slot's; the room is there for a slot's start alone, and not for a page a slab holds only
    without it."""
    rnd = random.Random(seed)
    a = SlabAllocator(4 << 20, 1 << 20, room)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            off = a.alloc(size)
            if off is None:
                continue
            here = room if size < 1 << 20 else 0
            assert off % ALIGN == 0
            assert here <= off and off + size <= a.capacity
            for o, s in live.items():
                assert off + size <= o - a.room_before(o, s) or o + s <= off - here, "overlapping slots"
            assert a.room_before(off, size) == here and a.room_before(off + ALIGN, size) == 0
            live[off] = size
        else:
            off = rnd.choice(list(live))
            a.free(off, live.pop(off))
    for off, size in live.items():
        a.free(off, size)
    assert a.free_slabs == a.num_slabs


def test_a_shrinking_class_hands_slabs_to_another():
    a = SlabAllocator(4 << 20, 1 << 20)  # 4 slabs
    small = [a.alloc(64 << 10) for _ in range(64)]  # fills all 4 slabs with 16 slots each
    assert all(o is not None for o in small) and a.alloc(64 << 10) is None
    assert a.alloc(300 << 10) is None
    for off in small[:16]:  # empties exactly the first slab carved
        a.free(off, 64 << 10)
    assert a.free_slabs == 1
    assert a.alloc(300 << 10) is not None


def test_errors():
    a = SlabAllocator(1 << 20, 1 << 20)
    with pytest.raises(ValueError, match="slab"):
        a.alloc(2 << 20)
    off = a.alloc(4096)
    with pytest.raises(ValueError):
        a.free(off + 1, 4096)
    with pytest.raises(ValueError):
        SlabAllocator(100, 4096)
    with pytest.raises(ValueError, match="multiple"):
        SlabAllocator(1 << 20, 1 << 20, room=100)
