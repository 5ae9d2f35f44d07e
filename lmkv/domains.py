"""Residency domains: who owns a resident page.

A tier says where a page lives; a domain says who owns it (an engine worker, a
shared cache owner, a tenant). A page may be owned by several domains. Clearing
a domain drops its ownership; a page is deleted when its last owner goes, so a
worker restart clears its own residency and never a shared owner's.
Domains are kept as bits of an int per page: O(1) memory per page.
"""

from __future__ import annotations

import re

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
    """Maps domain names to bits; not thread-safe (owned by a tier under its lock)."""

    def __init__(self) -> None:
        self._bits: dict[str, int] = {}

    def bit(self, name: str) -> int:
        b = self._bits.get(name)
        if b is None:
            check_domain(name)
            b = self._bits[name] = 1 << len(self._bits)
        return b

    def names(self, mask: int) -> list[str]:
        return [n for n, b in self._bits.items() if mask & b]
