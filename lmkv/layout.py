"""Cache-group layout descriptors (docs/design/cache-groups.md).

A page is one engine block (or a fixed run of tokens) of one cache group, for
all layers. Its payload lays the layers out one after another; inside a layer
the group's segments (K then V, an MLA latent, Mamba conv and temporal state)
follow each other. So layer ``l``'s segment ``s`` is the byte range
``l * layer_stride + segment_offset(s)``, and a layerwise transfer moves ranges
of a single page rather than one object per layer.

How the group sits across tensor-parallel ranks is explicit, never guessed from
head counts: ``tp_replicas`` consecutive ranks hold identical bytes (vLLM's
``kv_tp_replicas``; ``tp_size`` for a fully replicated group, ``1`` for a fully
sharded one). Within a replica set one rank writes and all read the same key;
different replica sets hold different bytes and so write under keys that carry
their shard index. Skipping a sharded write would silently lose data.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import asdict, dataclass, field, fields
from typing import cast

import xxhash


class StateKind(str, enum.Enum):
    """What a cache group holds: full attention, a sliding window, MLA latents, or Mamba state."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


class Growth(str, enum.Enum):
    """How state accumulates, which decides how a page can be restored."""

    PER_TOKEN = "per_token"  # every page holds its own tokens: prefix-addressable
    PER_SEQUENCE = "per_sequence"  # one state for the whole prefix: restorable at stored boundaries


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of a layer inside a page (e.g. ``k``, ``v``, ``conv``)."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class GroupLayout:
    """Everything lmkv needs to know to store and restore one cache group's pages."""

    name: str
    kind: StateKind
    num_layers: int
    segments: tuple[Segment, ...]
    tokens_per_page: int
    dtype: str
    tp_size: int = 1
    tp_rank: int = 0
    tp_replicas: int = 1
    sliding_window: int | None = None  # tokens; None where the engine itself picks the window's pages (SGLang)
    growth: Growth = field(default=None)  # type: ignore[assignment]  # derived from kind when omitted
    # pipeline parallelism: a stage holds other layers of the model under the same prefix, so its
    # pages are other bytes (a different identity, never one the other stages read)
    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        growth = cast(Growth | None, self.growth)  # (None until derived here: the field's default)
        if growth is None:
            derived = Growth.PER_SEQUENCE if self.kind is StateKind.MAMBA else Growth.PER_TOKEN
            object.__setattr__(self, "growth", derived)
        problems = []
        if self.num_layers < 1:
            problems.append(f"num_layers={self.num_layers} must be >= 1")
        if not self.segments:
            problems.append("a layout needs at least one segment")
        if any(s.nbytes <= 0 for s in self.segments):
            problems.append(f"segment sizes must be > 0: {self.segments}")
        if len({s.name for s in self.segments}) != len(self.segments):
            problems.append(f"segment names must be unique: {self.segments}")
        if self.tokens_per_page < 1:
            problems.append(f"tokens_per_page={self.tokens_per_page} must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            problems.append(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            problems.append(f"pp_rank={self.pp_rank} outside pp_size={self.pp_size}")
        if self.tp_replicas < 1 or self.tp_size % self.tp_replicas:
            problems.append(f"tp_replicas={self.tp_replicas} must divide tp_size={self.tp_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 (or None: the engine picks the pages)")
        if problems:
            raise ValueError(f"group {self.name!r}: " + "; ".join(problems))

    @functools.cached_property
    def _hash(self) -> int:
        # (of the fields' text, not of the fields: a layout pickled to another process carries this
        # with it, and a string's hash differs between processes)
        return xxhash.xxh3_64_intdigest(repr(tuple(getattr(self, f.name) for f in fields(self))).encode())

    def __hash__(self) -> int:
        """Worked out once: a layout keys the caches of every read's plan, and hashing its fields
        anew cost more than the lookups it keyed."""
        return self._hash

    @functools.cached_property
    def layer_stride(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @functools.cached_property
    def payload_bytes(self) -> int:
        return self.num_layers * self.layer_stride

    @functools.cached_property
    def unit_ranges(self) -> tuple[tuple[int, int], ...]:
        """Byte ranges of every (layer, segment) unit in payload order: what one checksum covers."""
        return tuple(
            self.layer_range(layer, seg) for layer in range(self.num_layers) for seg in range(len(self.segments))
        )

    @functools.cached_property
    def unit_slices(self) -> tuple[slice, ...]:
        """:attr:`unit_ranges` as slices: a page's digests are one ``view[s]`` per unit (every read
        verifies them; a prepared slice is 25% cheaper a unit than indexing a range's two ends)."""
        return tuple(slice(a, b) for a, b in self.unit_ranges)

    @functools.cached_property
    def unit_starts(self) -> dict[int, int]:
        """Each unit's first byte -> its index (how byte ranges are checked against units)."""
        return {start: u for u, (start, _) in enumerate(self.unit_ranges)}

    def segment_index(self, name: str) -> int:
        for i, s in enumerate(self.segments):
            if s.name == name:
                return i
        raise KeyError(f"group {self.name!r} has no segment {name!r}")

    def segment_offset(self, segment: int) -> int:
        return sum(s.nbytes for s in self.segments[:segment])

    def layer_range(self, layer: int, segment: int | None = None) -> tuple[int, int]:
        """Byte range ``[start, end)`` of one layer (all segments) or one layer's segment."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        base = layer * self.layer_stride
        if segment is None:
            return base, base + self.layer_stride
        start = base + self.segment_offset(segment)
        return start, start + self.segments[segment].nbytes

    @property
    def num_shards(self) -> int:
        return self.tp_size // self.tp_replicas

    @property
    def is_sharded(self) -> bool:
        return self.num_shards > 1

    @property
    def shard(self) -> int | None:
        """The shard index a key must carry, or None when every rank holds the same bytes."""
        return self.tp_rank // self.tp_replicas if self.is_sharded else None

    @property
    def is_writer(self) -> bool:
        """One writer per replica set: the first rank of the set."""
        return self.tp_rank % self.tp_replicas == 0

    @functools.cached_property
    def fingerprint(self) -> int:
        """64-bit identity of the byte layout; the TP ranks of one group share it, pipeline stages
        do not (each holds other layers)."""
        canon = (
            f"{self.kind.value}|{self.growth.value}|{self.num_layers}|{self.tokens_per_page}|"
            f"{self.dtype}|{self.sliding_window}|{self.num_shards}|"
            + ",".join(f"{s.name}:{s.nbytes}" for s in self.segments)
            + (f"|pp{self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else "")
        )
        return xxhash.xxh3_64_intdigest(canon.encode())

    def with_rank(self, tp_rank: int) -> GroupLayout:
        return GroupLayout(**{**self.to_dict(), "tp_rank": tp_rank})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        d["growth"] = self.growth
        d["segments"] = self.segments
        return d

    def describe(self) -> str:
        segs = "+".join(f"{s.name}:{s.nbytes}" for s in self.segments)
        tp = f"shard {self.shard}/{self.num_shards}" if self.is_sharded else f"replicated x{self.tp_replicas}"
        if self.pp_size > 1:
            tp += f", stage {self.pp_rank}/{self.pp_size}"
        return (
            f"{self.name}: {self.kind.value}, {self.num_layers} layers x [{segs}] bytes, "
            f"{self.tokens_per_page} tokens/page, {self.payload_bytes} bytes/page, {tp}"
        )


def attention_layout(
    name: str,
    num_layers: int,
    tokens_per_page: int,
    num_kv_heads: int,
    head_size: int,
    dtype_bytes: int,
    dtype: str,
    *,
    kind: StateKind = StateKind.FULL_ATTENTION,
    head_size_v: int | None = None,
    sliding_window: int | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    tp_replicas: int = 1,
) -> GroupLayout:
    """K and V segments for ``num_kv_heads`` heads (this rank's heads when sharded)."""
    k = tokens_per_page * num_kv_heads * head_size * dtype_bytes
    v = tokens_per_page * num_kv_heads * (head_size_v or head_size) * dtype_bytes
    return GroupLayout(
        name=name,
        kind=kind,
        num_layers=num_layers,
        segments=(Segment("k", k), Segment("v", v)),
        tokens_per_page=tokens_per_page,
        dtype=dtype,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_replicas=tp_replicas,
        sliding_window=sliding_window,
    )
