"""Opening the configured tiers: the one place that knows every tier class.

A tier module never imports another tier's (the network tiers share
:mod:`lmkv.tiers.remote`, which knows neither of them); what ``remote.url``
names and which tiers get fault injectors is decided here, for the store
(:func:`open_tiers`) and for a scheduler in another process that only looks
pages up (:func:`open_views`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from lmkv.config import MOONCAKE_SCHEMES, REDIS_SCHEMES, LMKVConfig, RemoteConfig
from lmkv.lookup import HasContains
from lmkv.tiers.accounts import Accounts
from lmkv.tiers.base import Tier
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.faults import faulty
from lmkv.tiers.memory import EvictHook, MemoryTier
from lmkv.tiers.page_files import DiskView
from lmkv.tiers.remote import RemoteTier


def open_remote(cfg: RemoteConfig, namespace: str = "default") -> RemoteTier | None:
    """The network tier ``cfg.url`` names, or ``None`` when unset. Never connects here:
    a backend that is down at start-up is picked up when it comes back. ``namespace``
    is the tenant the lmkv server isolates this client's pages under."""
    if not cfg.url:
        return None
    if urlsplit(cfg.url).scheme in REDIS_SCHEMES:  # (the config accepts only known schemes)
        from lmkv.tiers.redis import RedisTier  # (redis-py is an optional dependency)

        return RedisTier(cfg)
    if urlsplit(cfg.url).scheme in MOONCAKE_SCHEMES:
        from lmkv.tiers.mooncake import MooncakeTier  # (the Mooncake client is an optional dependency)

        return MooncakeTier(cfg)
    from lmkv.tiers.server_client import ServerTier

    return ServerTier(cfg, namespace)


def open_tiers(cfg: LMKVConfig, on_evict: EvictHook | None = None, lower: Sequence[Tier] = (),
               accounts: Mapping[str, Accounts] | None = None) -> tuple[MemoryTier, list[Tier]]:
    """The memory tier and the tiers below it, fastest first: the disk tier if configured, then
    ``lower``, then ``remote.url``'s tier. Tiers named under ``faults`` come wrapped in their
    fault injectors. The remote tier is given the memory tier's arena to move pages into and out of.
    ``accounts``: per local tier ("memory", "disk"), who pages are charged to and the limits."""
    accounts = accounts or {}
    remote = open_remote(cfg.remote, cfg.namespace)
    share = remote is not None and remote.wants_arena
    memory = MemoryTier(cfg.memory, on_evict=on_evict, shared=share, accounts=accounts.get("memory"),
                        header_room=0 if remote is None else remote.header_room)
    if remote is not None:
        remote.share_arena(memory.arena, memory.quarantine, memory.room_before)
        remote.connect_soon()  # (after sharing: the arena is registered as it connects)
    below: list[Tier] = [DiskTier(cfg.disk, accounts=accounts.get("disk"))] if cfg.disk.path else []
    below.extend(lower)
    if remote is not None:
        below.append(remote)
    unknown = set(cfg.faults) - {t.name for t in below}
    if unknown:
        for t in [memory, *below]:
            t.close()
        raise ValueError(f"faults: no lower tier named {sorted(unknown)} (tiers: {[t.name for t in below]})")
    return memory, [faulty(t, cfg.faults[t.name]) if t.name in cfg.faults else t for t in below]


def open_views(cfg: LMKVConfig) -> tuple[list[HasContains], RemoteTier | None]:
    """What a scheduler whose workers live in other processes can look up by itself: the shared
    disk directory's files and the network tier (returned apart too: the caller closes it). A
    Mooncake client there only asks what exists: it contributes no memory to the store."""
    rc = cfg.remote
    if rc.url is not None and urlsplit(rc.url).scheme in MOONCAKE_SCHEMES:
        rc = rc.model_copy(update={"mooncake": rc.mooncake.model_copy(update={
            "segment_size": 0, "local_buffer_size": 1 << 20, "staging_size": 1 << 20})})
    remote = open_remote(rc, cfg.namespace)
    views: list[HasContains] = [DiskView(cfg.disk.path)] if cfg.disk.path else []
    if remote is not None:
        remote.connect_soon()
        views.append(remote)
    return views, remote
