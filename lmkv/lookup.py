"""Prefix-ordered lookups over tiers fastest first: which tier holds each page of a prefix.

Shared by the store (its own tiers) and by a scheduler in another process
(:class:`lmkv.engine.residency.ResidencyMirror`: mirrored worker memory, then the tiers it
can see itself). A tier that cannot answer holds nothing for now; it never fails a lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lmkv.errors import LMKVError
from lmkv.keys import PageKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    """Where each page of the hit prefix lives (the tier name), fastest first."""

    tiers: tuple[str, ...]

    @property
    def pages(self) -> int:
        return len(self.tiers)


class HasContains(Protocol):
    """What a lookup asks of a tier (a real tier, or the scheduler's mirror of a worker's memory)."""

    name: str

    def contains(self, keys: Sequence[PageKey]) -> list[bool]: ...


def locate(keys: Sequence[PageKey], tiers: Sequence[HasContains], strict: bool = False) -> list[str | None]:
    """Per key, the first tier that holds it; each tier is asked only about keys the ones above lacked.

    A tier that cannot answer (down, timed out) holds nothing for now; with ``strict`` its error
    is raised instead (for a caller that must not take "cannot answer" for "does not hold").
    """
    where: list[str | None] = [None] * len(keys)
    for tier in tiers:
        todo = [i for i, w in enumerate(where) if w is None]
        if not todo:
            break
        try:
            present = tier.contains([keys[i] for i in todo])
        except (LMKVError, OSError) as err:
            tier_failed(tier, "lookup", err)
            if strict:
                raise
            continue
        for i, p in zip(todo, present):
            if p:
                where[i] = tier.name
    return where


_last_warning: dict[str, float] = {}


def tier_failed(tier, what: str, err: BaseException) -> None:
    """Count a failing tier call and log it, at most once a minute per tier."""
    stats = getattr(tier, "stats", None)
    if stats is not None:
        stats.errors += 1
    now = time.monotonic()
    if now - _last_warning.get(tier.name, -1e9) > 60:
        _last_warning[tier.name] = now
        log.warning("lmkv: %s tier failed a %s (%s); serving from the other tiers", tier.name, what, err)


def prefix_lookup(keys: Sequence[PageKey], tiers: Sequence[HasContains]) -> Lookup:
    """The longest prefix of ``keys`` that some tier holds, page by page."""
    where = locate(keys, tiers)
    n = next((i for i, w in enumerate(where) if w is None), len(keys))
    return Lookup(tuple(w for w in where[:n] if w is not None))
