"""A slab allocator for the host-memory arena.

The arena is cut into equal slabs. A slab is given to one size class (page
size rounded up to :data:`~lmkv.page.ALIGN`) when that class needs room, and
is cut into equal slots; when its last slot is freed it goes back to the pool
for any class. Pages of one class are interchangeable, so churn within a class
never fragments, and a class that shrinks hands whole slabs to the others.
Every slot offset is ALIGN-aligned, so a slot can be the target of O_DIRECT,
cuFile or a DMA copy as it is. With ``room``, each slot keeps that many bytes free
before its start: a tier that stores a page as one object, its header then its
payload (Mooncake), reads the object into the slot in one piece, the header landing
in the room (two pieces cost Mooncake's transfer 6-27% of its rate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lmkv.page import ALIGN, padded

#: ``(offset, nbytes) -> bytes``: the free room before the arena slot at ``offset``
#: (:meth:`SlabAllocator.room_before`, as the memory tier passes it to a tier below)
RoomBefore = Callable[[int, int], int]


@dataclass
class _SizeClass:
    slot_bytes: int
    room: int  # of slot_bytes, before the page (0 where the room would not fit a slab)
    slots_per_slab: int
    free: dict[int, list[int]] = field(default_factory=dict)  # slab -> free slot offsets
    used: dict[int, int] = field(default_factory=dict)  # slab -> slots in use


class SlabAllocator:
    """Offsets into an arena of ``capacity`` bytes; not thread-safe (the tier locks)."""

    def __init__(self, capacity: int, slab_bytes: int, room: int = 0) -> None:
        """``room``: bytes kept free before every slot (a multiple of ALIGN; none before the slots of
        a page too large for a slab to hold with it)."""
        if room % ALIGN:
            raise ValueError(f"a slot's room of {room} bytes is not a multiple of {ALIGN}")
        self.room = room
        slab_bytes = min(padded(slab_bytes), capacity - capacity % ALIGN)
        if slab_bytes < ALIGN:
            raise ValueError(f"arena of {capacity} bytes is smaller than one {ALIGN}-byte slot")
        self.capacity = capacity
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity // slab_bytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}

    def size_class(self, nbytes: int) -> int:
        """The class a page of ``nbytes`` is kept in (its size padded to ALIGN): pages of one class
        take each other's slots."""
        size = padded(max(nbytes, 1))
        if size > self.slab_bytes:
            raise ValueError(
                f"a page of {nbytes} bytes does not fit a {self.slab_bytes}-byte slab; "
                "raise memory.slab_size"
            )
        return size

    def _class(self, nbytes: int) -> _SizeClass:
        size = self.size_class(nbytes)
        cls = self._classes.get(size)
        if cls is None:
            room = self.room if size + self.room <= self.slab_bytes else 0
            cls = self._classes[size] = _SizeClass(size + room, room, self.slab_bytes // (size + room))
        return cls

    def alloc(self, nbytes: int) -> int | None:
        """An ALIGN-aligned offset for ``nbytes`` (after its slot's room), or None when the arena is
        full for it."""
        cls = self._class(nbytes)
        if not cls.free:
            if not self._free_slabs:
                return None
            slab = self._free_slabs.pop()
            base = slab * self.slab_bytes
            cls.free[slab] = [base + i * cls.slot_bytes for i in range(cls.slots_per_slab - 1, -1, -1)]
            cls.used[slab] = 0
        # Fill the fullest slab first so that lightly used slabs can drain and be returned.
        slab = max(cls.free, key=lambda s: cls.used[s]) if len(cls.free) > 1 else next(iter(cls.free))
        slots = cls.free[slab]
        off = slots.pop()
        if not slots:
            del cls.free[slab]
        cls.used[slab] += 1
        return off + cls.room

    def _in_use(self, offset: int, nbytes: int) -> tuple[_SizeClass, int] | None:
        """The size class and slab of the slot whose payload starts at ``offset``, if one does."""
        cls = self._classes.get(self.size_class(nbytes))
        if cls is None:
            return None
        start = offset - cls.room
        slab = start // self.slab_bytes
        if start < 0 or slab not in cls.used or (start - slab * self.slab_bytes) % cls.slot_bytes:
            return None
        return cls, slab

    def room_before(self, offset: int, nbytes: int) -> int:
        """The free bytes before ``offset``: :attr:`room` if a slot for ``nbytes`` starts there (a
        view into the middle of a slot has none, nor a page so large that its room would not fit a
        slab). Safe without the owner's lock for a slot its caller holds (its slab stays with its
        class)."""
        try:
            found = self._in_use(offset, nbytes) if self.room else None
        except ValueError:  # (no slot is that large)
            return 0
        return 0 if found is None else found[0].room

    def free(self, offset: int, nbytes: int) -> None:
        found = self._in_use(offset, nbytes)
        if found is None:
            raise ValueError(f"offset {offset} was not allocated for {nbytes} bytes")
        cls, slab = found
        cls.used[slab] -= 1
        cls.free.setdefault(slab, []).append(offset - cls.room)
        if cls.used[slab] == 0:
            del cls.used[slab], cls.free[slab]
            self._free_slabs.append(slab)

    def can_alloc(self, nbytes: int) -> bool:
        return bool(self._class(nbytes).free) or bool(self._free_slabs)

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def used_slots(self, nbytes: int) -> int:
        return sum(self._class(nbytes).used.values())

    def slots_per_slab(self, nbytes: int) -> int:
        return self._class(nbytes).slots_per_slab
