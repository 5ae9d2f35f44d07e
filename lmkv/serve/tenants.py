"""What a token grants on ``lmkv serve``: a tenant, its namespaces, its quota, or admin rights.

A tenant is configured by the operator (``server.tenants``): a name, a token (or a
file holding it), the namespaces its clients may name in HELLO and its quota.
Clients never declare who they are beyond presenting the token; the namespace
they ask for must be one the token was granted, so no client can read, delete
or poison another tenant's pages by naming its namespace. Each namespace
belongs to one tenant at most (the configuration is refused otherwise): pages
are charged to exactly one tenant.

Without ``server.tenants`` there is one tenant, ``default``: ``server.token`` (or,
on loopback, no token at all) grants every namespace and the admin rights, as a
single-tenant server always has. With tenants, ``server.admin_token`` grants the
admin rights alone: server-wide stats and clearing a tenant, no pages.

A tenant's pages are charged to its *tag* (:mod:`lmkv.tiers.accounts`): the
server qualifies each of its residency domains as ``<tag>.<namespace tag>.<name>``,
so the tiers (and a restarted disk tier, from its directory names) know whose a
page is without knowing tenants.
"""

from __future__ import annotations

import hmac
import logging
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from lmkv.config import ConfigError, QuotaConfig, ServerConfig
from lmkv.tiers.accounts import Accounts, Limit

log = logging.getLogger(__name__)

DEFAULT = "default"
ADMIN = "admin"


@dataclass(frozen=True)
class Tenant:
    """Who a token is: its name, the namespaces it may use, its quota, whether it is the admin."""

    name: str
    token: str | None
    namespaces: tuple[str, ...]  # exact names; one ending in '*' grants every name it begins
    quota: QuotaConfig
    admin: bool = False

    @property
    def tag(self) -> str:
        """The account its pages are charged to (the first part of each of its domains)."""
        return tag_of(self.name)

    def grants(self, namespace: str) -> bool:
        return any(namespace.startswith(g[:-1]) if g.endswith("*") else namespace == g for g in self.namespaces)

    @property
    def holds_pages(self) -> bool:
        """Whether it may use namespaces at all (the admin token of a multi-tenant server may not)."""
        return bool(self.namespaces)


@dataclass
class Counters:
    """What one tenant's clients did (its STATS; an admin sees every tenant's)."""

    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    puts: int = 0
    put_bytes: int = 0
    refused: int = 0  # pages a PUT could not store (its quota, a full server)


def tag_of(name: str) -> str:
    return xxhash.xxh3_64_hexdigest(b"lmkv-tenant\0" + name.encode())[:8]


def account_of(domain: str) -> str:
    """Who a domain of the server's tiers is charged to: the tenant tag its name begins with."""
    return domain.split(".", 1)[0]


def _read_token(path: str, what: str) -> str:
    """A token file's first line. A file others may read is refused: anyone who reads it is the tenant."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path!r} ({e.strerror})") from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what}: {path!r} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    token = text.splitlines()[0].strip() if text.strip() else ""
    if len(token) < 16:
        raise ConfigError(f"{what}: the token in {path!r} has {len(token)} characters; at least 16")
    return token


def _overlap(a: str, b: str) -> bool:
    """Whether two grants can name the same namespace."""
    if a.endswith("*") and b.endswith("*"):
        return a[:-1].startswith(b[:-1]) or b[:-1].startswith(a[:-1])
    if a.endswith("*"):
        return b.startswith(a[:-1])
    if b.endswith("*"):
        return a.startswith(b[:-1])
    return a == b


@dataclass(frozen=True)
class Tenants:
    """Every tenant of a server, and the one rule for which a token is."""

    tenants: tuple[Tenant, ...]
    open: bool  # no token anywhere (a loopback server): every client is the default tenant

    @classmethod
    def from_config(cls, sc: ServerConfig) -> Tenants:
        if not sc.tenants:
            if sc.admin_token or sc.admin_token_file:
                raise ConfigError("server.admin_token: only with server.tenants (server.token is the admin's)")
            return cls((Tenant(DEFAULT, sc.token, ("*",), sc.quota, admin=True),), open=sc.token is None)
        if sc.token:
            raise ConfigError("server.token and server.tenants: with tenants, each tenant has its own token")
        out = []
        for t in sc.tenants:
            token = t.token if t.token is not None else _read_token(str(t.token_file), f"tenant {t.name!r}")
            out.append(Tenant(t.name, token, tuple(t.namespaces), t.quota))
        if sc.admin_token_file and sc.admin_token:
            raise ConfigError("server.admin_token and server.admin_token_file: one of them")
        admin = sc.admin_token or (_read_token(sc.admin_token_file, "server.admin_token_file")
                                   if sc.admin_token_file else None)
        if admin:
            out.append(Tenant(ADMIN, admin, (), QuotaConfig(), admin=True))
        names = [t.name for t in out]
        if len(set(names)) != len(names):
            raise ConfigError(f"server.tenants: a name twice in {names}")
        tags = [t.tag for t in out]
        if len(set(tags)) != len(tags):
            raise ConfigError("server.tenants: two names share a tag; rename one")
        tokens = [t.token for t in out]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("server.tenants: two tenants (or a tenant and the admin) share a token")
        for i, a in enumerate(out):
            for b in out[i + 1:]:
                for ga in a.namespaces:
                    for gb in b.namespaces:
                        if _overlap(ga, gb):
                            raise ConfigError(f"server.tenants: {a.name!r} ({ga!r}) and {b.name!r} ({gb!r}) "
                                              "would share namespaces; a namespace belongs to one tenant")
        return cls(tuple(out), open=False)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant ``token`` is, comparing against every tenant's in constant time (how long it
        takes says nothing about which one, or how near a guess came)."""
        if self.open:
            return self.tenants[0]
        given = (token or "").encode()
        found = None
        for t in self.tenants:
            if hmac.compare_digest(given, (t.token or "").encode()) and t.token:
                found = t
        return found

    def by_name(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def accounts(self, tier: str) -> Accounts:
        """The limits of every tenant in the server's ``tier`` ("memory" or "disk")."""
        limits = {}
        for t in self.tenants:
            q = t.quota
            lim = Limit(q.memory_bytes, q.memory_pages) if tier == "memory" else Limit(q.disk_bytes, q.disk_pages)
            if lim != Limit():
                limits[t.tag] = Limit(None if lim.bytes is None else int(lim.bytes), lim.pages)
        return Accounts(limits, account_of)

    @property
    def admin_token(self) -> str | None:
        """The token that grants admin rights (the metrics bearer, too)."""
        return next((t.token for t in self.tenants if t.admin), None)
