"""Residency domains: who owns a resident page.

A tier says where a page lives; a domain says who owns it (an engine worker, a
shared cache owner, a tenant). A page may be owned by several domains. Clearing
a domain drops its ownership; a page is deleted when its last owner goes, so a
worker restart clears its own residency and never a shared owner's.
Domains are kept as bits of an int per page: O(1) memory per page.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterator

DOMAIN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: namespaces (tenants) are qualified into keys and domains, never into paths: printable ASCII
NAMESPACE_PATTERN = r"^[\x21-\x7e]{1,256}$"
_NAME = re.compile(DOMAIN_PATTERN)
_NAMESPACE = re.compile(NAMESPACE_PATTERN)


def check_domain(name: str) -> str:
    """Domain names become directory names on disk, so they are restricted."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"residency domain {name!r}: expected 1-64 characters of letters, digits, '.', '_', '-'"
        )
    return name


def check_namespace(name: str) -> str:
    """A namespace: 1-256 printable ASCII characters, no spaces; rejected, never truncated."""
    if not isinstance(name, str) or not _NAMESPACE.fullmatch(name):
        raise ValueError(f"namespace {name!r}: expected 1-256 printable ASCII characters without spaces")
    return name


def qualified(prefix: str, name: str) -> str:
    """``name`` qualified by ``prefix`` (a tenant's tag), as a domain name itself; a name too long to
    qualify is rejected, never truncated (two long names must not become one)."""
    check_domain(name)
    full = f"{prefix}.{name}"
    if not _NAME.fullmatch(full):
        raise ValueError(f"residency domain {name!r}: at most {63 - len(prefix)} characters here")
    return full


class DomainRegistry:
    """Maps the domains that own pages to bits of a page's ``domains`` int; not thread-safe (a tier
    owns it under its lock).

    A domain lives while some page holds its bit: the registry counts pages per domain and forgets
    a domain with its last page (its bit is free again, ``on_forget`` is told). Names that come
    and go therefore cost nothing once gone, and masks stay as narrow as the domains alive now
    (6,000 domains registered once made every later read slower, forever). ``account_of`` names
    who each domain is charged to (:mod:`lmkv.tiers.accounts`); the registry keeps each account's
    live domains, so a cap on them is a set's length.
    """

    def __init__(self, account_of: Callable[[str], str] = lambda name: "",
                 on_forget: Callable[[str], None] | None = None) -> None:
        self._index: dict[str, int] = {}  # name -> bit index
        self._names: dict[int, str] = {}
        self._pages: dict[int, int] = {}  # bit index -> pages holding it
        self._free: list[int] = []  # bit indexes to reuse, lowest first
        self._account_of = account_of
        self._on_forget = on_forget
        self._by_account: dict[str, set[str]] = {}

    def mask(self, name: str) -> int:
        """The bit of a live domain; 0 when no page holds it."""
        i = self._index.get(name)
        return 0 if i is None else 1 << i

    def add(self, mask: int, name: str) -> int:
        """A page's mask with ``name`` among its owners (registering the domain if new)."""
        i = self._index.get(name)
        if i is None:
            check_domain(name)
            i = heapq.heappop(self._free) if self._free else len(self._index)
            self._index[name] = i
            self._names[i] = name
            self._pages[i] = 0
            self._by_account.setdefault(self._account_of(name), set()).add(name)
        if not mask >> i & 1:
            self._pages[i] += 1
            mask |= 1 << i
        return mask

    def remove(self, mask: int, name: str) -> int:
        """A page's mask without ``name`` (forgetting the domain if that was its last page)."""
        i = self._index.get(name)
        if i is None or not mask >> i & 1:
            return mask
        self._release(i)
        return mask & ~(1 << i)

    def release(self, mask: int) -> None:
        """A page is gone: each of its domains holds one page fewer."""
        for i in _bits(mask):
            self._release(i)

    def _release(self, i: int) -> None:
        self._pages[i] -= 1
        if self._pages[i]:
            return
        name = self._names.pop(i)
        del self._index[name], self._pages[i]
        heapq.heappush(self._free, i)
        account = self._account_of(name)
        live = self._by_account[account]
        live.discard(name)
        if not live:
            del self._by_account[account]
        if self._on_forget is not None:
            self._on_forget(name)

    def names(self, mask: int) -> list[str]:
        return [self._names[i] for i in _bits(mask)]

    def of_account(self, account: str) -> set[str]:
        """The live domains charged to ``account``."""
        return set(self._by_account.get(account, ()))

    def __len__(self) -> int:
        return len(self._index)


def _bits(mask: int) -> Iterator[int]:
    """The indexes of the set bits of ``mask``, lowest first (as many steps as bits set)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
