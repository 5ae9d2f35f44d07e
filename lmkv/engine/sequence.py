"""Page keys of a growing token sequence (a request), hashed incrementally.

A request's tokens only grow (prompt, then outputs), so its chain hashes are
extended page by page and never recomputed; keys per cache group are derived
from them on demand.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmkv.keys import ChainHash, KeySpace, PageKey, chain_hashes, page_key
from lmkv.layout import GroupLayout


@dataclass(frozen=True)
class Span:
    """Tokens ``[offset, offset + length)`` whose state depends on more than their ids (an image)."""

    offset: int
    length: int
    identity: bytes


@dataclass
class SequenceKeys:
    """A request's page chain hashes and per-group page keys, hashed incrementally as its tokens grow.

    Thread-safe: a lookup may hash a waiting request's pages on a lookup thread."""

    space: KeySpace
    tokens_per_page: int
    spans: tuple[Span, ...] = ()
    chains: list[ChainHash] = field(default_factory=list)
    _keys: dict[tuple[int, int | None], list[PageKey]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _extras(self, first: int, count: int) -> list[bytes] | None:
        if not self.spans:
            return None
        tpp = self.tokens_per_page
        out = []
        for p in range(first, first + count):
            lo, hi = p * tpp, (p + 1) * tpp
            out.append(b"|".join(s.identity for s in self.spans if s.offset < hi and s.offset + s.length > lo))
        return out

    def extend(self, tokens: Sequence[int], pages: int | None = None) -> int:
        """Hash the full pages of ``tokens`` (the first ``pages`` of them at most) not hashed yet;
        returns the number of pages hashed. Only the new pages' tokens are read."""
        with self._lock:
            have = len(self.chains)
            full = len(tokens) // self.tokens_per_page
            if pages is not None:
                full = min(full, pages)
            if full > have:
                parent = self.chains[-1] if have else self.space.root
                start = have * self.tokens_per_page
                new = chain_hashes(parent, tokens[start : full * self.tokens_per_page], self.tokens_per_page,
                                   self._extras(have, full - have))
                self.chains.extend(new)
            return len(self.chains)

    def keys(self, layout: GroupLayout, start: int, end: int) -> list[PageKey]:
        """Keys of pages ``[start, end)`` of one group (pages must be hashed already)."""
        with self._lock:
            if end > len(self.chains):
                raise ValueError(f"page {end - 1} is not hashed yet ({len(self.chains)} pages)")
            cached = self._keys.setdefault((layout.fingerprint, layout.shard), [])
            while len(cached) < end:
                cached.append(page_key(self.chains[len(cached)], layout))
            return cached[start:end]
