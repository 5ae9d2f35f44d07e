"""Who holds how much of a tier, and how much each may: per-account usage and limits.

An account is who a page is charged to. On ``lmkv serve`` it is a tenant
(:mod:`lmkv.serve.tenants`); in an engine's own store everything is one account
without a limit, and nothing here changes what the tier does. A page's account
follows from its residency domain (``account_of``: the server qualifies every
domain of a tenant with the tenant's tag), so tiers never learn what a tenant is.

Usage counts room reserved for pages still being written as well as resident
pages: a PUT whose bytes are on their way already holds its share. A tier keeps
every account within its limit by evicting that account's own pages; room it
must make beyond that (the tier is full) comes from the account that holds the
most of its share (:meth:`Accounts.by_pressure`), so a tenant within its quota
can push out only pages of tenants that hold at least as large a share as it.
Not thread-safe: a tier owns its accounts under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limit:
    """The most an account may hold in one tier (``None``: no limit on that)."""

    bytes: int | None = None
    pages: int | None = None


@dataclass(slots=True)
class Usage:
    """Bytes and pages an account holds in a tier."""

    bytes: int = 0
    pages: int = 0


def one_account(domain: str) -> str:
    """An engine's own store: every domain is charged to one account."""
    return ""


@dataclass
class Accounts:
    """Who pages are charged to in a tier (a tenant's residency domains), their usage and limits.

    Used under the owning tier's lock."""

    limits: Mapping[str, Limit] = field(default_factory=dict)
    account_of: Callable[[str], str] = one_account
    usage: dict[str, Usage] = field(default_factory=dict)

    def can_hold(self, account: str, nbytes: int, pages: int = 1) -> bool:
        """Whether ``account`` could hold this much at all (even with nothing else of its own)."""
        lim = self.limits.get(account)
        return lim is None or ((lim.bytes is None or nbytes <= lim.bytes) and (lim.pages is None or pages <= lim.pages))

    def fits(self, account: str, nbytes: int, pages: int = 1) -> bool:
        """Whether ``account`` may take this much more now."""
        lim = self.limits.get(account)
        if lim is None:
            return True
        u = self.usage.get(account, Usage())
        return ((lim.bytes is None or u.bytes + nbytes <= lim.bytes)
                and (lim.pages is None or u.pages + pages <= lim.pages))

    def charge(self, account: str, nbytes: int, pages: int = 1) -> None:
        u = self.usage.get(account)
        if u is None:
            u = self.usage[account] = Usage()
        u.bytes += nbytes
        u.pages += pages

    def refund(self, account: str, nbytes: int, pages: int = 1) -> None:
        u = self.usage[account]
        u.bytes -= nbytes
        u.pages -= pages
        if not u.bytes and not u.pages:
            del self.usage[account]

    def share(self, account: str, capacity: int) -> float:
        """How much of its share ``account`` holds: of its limit, or of the tier without one."""
        u = self.usage.get(account, Usage())
        lim = self.limits.get(account) or Limit()
        of_bytes = u.bytes / (lim.bytes or capacity or 1)
        return max(of_bytes, u.pages / lim.pages) if lim.pages else of_bytes

    def by_pressure(self, accounts: Iterable[str], capacity: int) -> list[str]:
        """``accounts``, those holding the most of their share first (where a full tier takes room)."""
        return sorted(accounts, key=lambda a: self.share(a, capacity), reverse=True)
