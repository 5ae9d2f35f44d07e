"""lmkv's one configuration object.

A configuration is built from, in increasing precedence:

1. the defaults below (they work without tuning),
2. a YAML file (``config_file`` in the dict, or ``LMKV_CONFIG``),
3. ``LMKV_*`` environment variables, nested with ``__``
   (``LMKV_MEMORY__CAPACITY=8GiB``, ``LMKV_DISK__PATH=/nvme/lmkv``),
4. a dict, e.g. vLLM's ``kv_connector_extra_config``.

Every bad value raises :class:`ConfigError` naming the field, the value given
and what is accepted, so a typo in an engine's extra config fails at start-up
rather than silently falling back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmkv.domains import DOMAIN_PATTERN, NAMESPACE_PATTERN

ENV_PREFIX = "LMKV_"
ENV_NESTING = "__"
#: LMKV_* variables that are not settings: the config file, and where generated models live
NOT_SETTINGS = {"LMKV_CONFIG", "LMKV_MODEL_DIR"}


class ConfigError(ValueError):
    """A configuration value was rejected; the message names field, value and what is accepted."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MemoryConfig(_Section):
    """Host-memory tier: one preallocated arena (pinned when CUDA is present)."""

    capacity: ByteSize = Field(ByteSize(2 << 30), description="arena size, e.g. 8GiB")
    policy: Literal["lru", "s3fifo"] = Field("s3fifo", description="eviction policy")
    slab_size: ByteSize = Field(
        ByteSize(64 << 20), description="arena slab; every page must fit in one slab"
    )
    verify_checksums: bool = Field(
        False, description="verify a page's checksums every time it is read from memory, engine loads included "
        "(pages arriving from another tier are verified on the way in either way)"
    )
    quarantine_limit: ByteSize | None = Field(
        None, description="bytes of arena slots held back at most for writers that were given up on and may "
        "still write there (a same-host server that stalled past remote.timeout); beyond it such a server's "
        "reads go through its connection's own window instead. Unset: a quarter of capacity")
    pin: Literal["auto", "always", "never"] = Field(
        "auto", description="page-lock the arena in place (cudaHostRegister) for the GPU copy kernel: auto = "
        "when CUDA is available (unpinned, with a warning, if that fails), always = an error if it fails"
    )
    prefault: bool | None = Field(
        None, description="map the whole arena at start-up, in the background, rather than 128 MiB ahead of "
        "use. Unset: on in an engine (vLLM, SGLang), whose steps land hundreds of MiB of pages at once, faster "
        "than mapping ahead of use keeps up (first writes to unmapped memory run at ~1 GB/s, ~9 GB/s mapped; "
        "a page-locked arena on a GPU host is mapped whole anyway); off in lmkv serve and a library's store, "
        "whose memory then grows with use. A same-host lmkv server maps its view of a whole-mapped arena "
        "whole too")


class DiskConfig(_Section):
    """Local disk tier: buffered POSIX, O_DIRECT or GPUDirect Storage, one file format."""

    path: str | None = Field(None, description="directory; unset disables the disk tier")
    capacity: ByteSize = Field(ByteSize(32 << 30), description="bytes on disk before eviction")
    io: Literal["auto", "buffered", "direct", "gds"] = Field(
        "buffered",
        description="buffered: through the OS page cache, which serves recently used pages at memory "
        "speed, across engine restarts too (measured here: a 6k-token disk hit 1.35-1.5x vLLM's own "
        "prefix-cache hit, against 1.7x with O_DIRECT); direct: O_DIRECT, the disk tier stays out "
        "of the page cache; gds: GPUDirect Storage (cuFile) between page files and device memory, "
        "O_DIRECT for host buffers, refused at start-up where it cannot run; auto: gds where a CUDA "
        "device, libcufile and the file system allow it, else O_DIRECT where the file system allows "
        "it, else buffered (the fallback logged once)",
    )
    fsync: bool = Field(True, description="fsync a page before it becomes visible")
    policy: Literal["lru", "s3fifo"] = Field("lru", description="eviction policy")
    io_threads: int = Field(8, ge=1, le=128, description="parallel reads and writes (a device needs queue depth)")
    gds_staging: ByteSize = Field(
        ByteSize(64 << 20), description="with GPUDirect Storage: device memory per worker for the staging slots "
        "pages pass through between their files and the engine's blocks (registered with cuFile once); "
        "pages beyond it take the host path")


class StoreConfig(_Section):
    """How the tiers cooperate."""

    write_policy: Literal["write_through", "write_back"] = Field(
        "write_through",
        description="write_through: every put is copied to every tier in the background, so "
        "evicting from memory is free; write_back: puts land in memory and are written down "
        "when memory evicts them (fewer disk writes, but an eviction waits for its write)",
    )
    promote_on_hit: bool = Field(
        True, description="copy a lower-tier hit into memory (except pages a buffered disk tier reads "
        "straight into the engine's blocks: the OS page cache already holds them)")
    failed_writes: Literal["retry", "drop"] = Field(
        "retry",
        description="a copy down that a tier refused (down, full): retry it from memory when that "
        "tier next takes a write, or drop it; either way it is counted and never fails inference",
    )
    retry_pages: int = Field(65536, ge=0, description="pages queued for retry per tier; the oldest are dropped")
    io_threads: int = Field(4, ge=1, le=64, description="background I/O threads")


class OffloadConfig(_Section):
    """When computed pages are copied out of the engine (docs/design/lazy-offload.md), and which
    recurrent states (Mamba) are kept."""

    state_every_pages: int = Field(
        1, ge=1, description="state groups (Mamba): store the state at every Nth page boundary a step ends on")
    state_retention: Literal["every", "latest"] = Field(
        "every", description="state groups: keep every stored boundary's state, or only a request's "
        "latest (older ones are dropped when a newer one is stored)")

    policy: Literal["eager", "lazy"] = Field(
        "eager",
        description="eager: every page is copied out in the step that computes it (write-through); "
        "lazy: a cached page is copied only when the engine's free queue is about to reuse its "
        "block (needs the engine's prefix caching; fewer copies, see lmkv bench offload)",
    )
    horizon_steps: float = Field(
        4.0, gt=0, description="lazy, with link_bytes_per_step: steps of allocations the danger zone covers (without a "
        "declared link the zone is the next step's known demand plus the largest share of new requests lately)")
    ema_alpha: float = Field(0.2, gt=0, le=1, description="lazy: weight of the last step in the allocation rate")
    watermark_blocks: int = Field(
        16, ge=0, description="lazy, with link_bytes_per_step: blocks always in the danger zone")
    drain_link_share: float = Field(
        0.5, gt=0, le=1, description="lazy: the share of a step's time the copies planned in it may take on the "
        "copy link (the workers' measured copy rate x the forward's measured time: the same link time whatever "
        "a page's size; never fewer pages than the step took)")
    drain_bytes_per_step: ByteSize | None = Field(
        None, description="lazy: a fixed cap on the bytes planned per step instead of drain_link_share")
    link_bytes_per_step: ByteSize | None = Field(
        None, description="lazy: the copy link's capacity per step, where it is the bottleneck (it then "
        "replaces drain_bytes_per_step): what the danger zone leaves of it goes to early copies of freshly "
        "computed blocks, oldest first, skipping one-shot families, so the link is never idle while "
        "blocks wait (unset: only blocks about to be reused are copied)")
    chain_memory: int = Field(1 << 20, ge=1024, description="lazy: block links remembered for prefix closure")
    min_family_requests: int = Field(
        16, ge=1, description="lazy: requests of a family (same first page) seen before judging its reuse")
    min_need_rate: float = Field(
        0.1, ge=0, le=1, description="lazy, without a declared link: a block about to be reused is not copied "
        "only when blocks like it (one-shot family or not, as often used, the same kind of session, as long idle) "
        "were needed again from a tier less often than this at 95% confidence, as learned from what came back; "
        "the default is a copy's cost against a recompute's (an 8B model's page over PCIe: ~1/10); 0: copy every "
        "due block")
    min_reuse_rate: float = Field(
        0.1, ge=0, le=1, description="lazy: a family whose requests (those older than the reuse horizon) "
        "repeat most of an earlier prompt less often than this looks one-shot (a class of the need estimate; "
        "with a declared link, not copied unless the estimate shows blocks like them needed)")


#: ``remote.url`` schemes: the lmkv server (``lmkvs``: TLS), and Redis, Redis over TLS or a Unix socket,
#: Redis Cluster
SERVER_SCHEMES = ("lmkv", "lmkvs")
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis-cluster", "rediss-cluster")
MOONCAKE_SCHEMES = ("mooncake",)


class MooncakeConfig(_Section):
    """The Mooncake Store client ``remote.url: mooncake://MASTER:PORT`` opens (``pip install
    'lmkv[mooncake]'``): what it contributes to the store and how it moves bytes."""

    local_hostname: str = Field(
        "127.0.0.1", description="this client's address as the other clients reach it (they read the objects "
        "its segment holds from there)")
    metadata_server: str = Field(
        "P2PHANDSHAKE", description="Mooncake's metadata service: P2PHANDSHAKE (none: clients exchange it "
        "directly), or http://host:port/metadata of the master's HTTP metadata server, or etcd://...")
    protocol: Literal["tcp", "rdma", "efa"] = Field("tcp", description="Mooncake's transport")
    device_names: str = Field("", description="RDMA devices (comma-separated); empty: discovered")
    segment_size: ByteSize = Field(
        ByteSize(1 << 30), description="memory this client contributes to the store (pages others write may "
        "live in it, and go when this process does); 0: none, the pages live in other clients' segments "
        "(dedicated storage clients, e.g. Mooncake's mooncake_client)")
    local_buffer_size: ByteSize = Field(ByteSize(64 << 20), description="Mooncake's own transfer buffer")
    staging_size: ByteSize = Field(
        ByteSize(64 << 20), description="registered memory pages are staged through when the caller's buffers "
        "are not registered with Mooncake (a batch larger than this goes in parts)")
    stream_stores: bool = Field(
        True, description="a step's pages are put in one Mooncake put session, layer by layer as the forward "
        "computes them, and made readable when the step commits (off: written through whole after the commit)")


class RemoteConfig(_Section):
    """A network tier below memory and disk: the lmkv server or Redis.

    ``url`` picks it: ``lmkv://host:port`` (``lmkvs://`` for TLS), ``redis://``,
    ``rediss://`` (TLS), ``unix:///path/redis.sock``,
    ``redis-cluster://host:port,host:port`` (``rediss-cluster://`` for TLS), or a Mooncake
    Store master, ``mooncake://host:port`` (its client's settings in ``remote.mooncake``).
    """

    url: str | None = Field(None, description="unset: no network tier")
    token: str | None = Field(None, description="lmkv server auth token (or LMKV_REMOTE__TOKEN)")
    username: str | None = Field(None, description="Redis ACL user (a URL may carry it too)")
    password: str | None = Field(None, description="Redis password (a URL may carry it too)")
    tls_ca: str | None = Field(None, description="CA bundle to verify the server's certificate")
    tls_verify: bool = Field(True, description="verify the server's certificate and host name")
    timeout: float = Field(5.0, gt=0, le=600, description="seconds one operation may take")
    lookup_timeout: float = Field(
        0.5, gt=0, le=600, description="seconds an engine's lookup of a request may wait for this tier before the "
        "request runs without it (it waits, not the engine: other requests are scheduled meanwhile)")
    connect_timeout: float = Field(2.0, gt=0, le=600, description="seconds to connect")
    max_connections: int = Field(16, ge=1, le=1024, description="connection pool size")
    ttl: float | None = Field(None, gt=0, description="Redis: seconds before a page expires (none: never)")
    key_prefix: str = Field("lmkv:", max_length=64, description="Redis, Mooncake: prefix of every key lmkv writes")
    verify: bool = Field(True, description="verify checksums of pages read over the network")
    shm: Literal["auto", "never"] = Field(
        "auto", description="lmkv server on this host: move bulk bytes through shared memory"
    )
    shm_size: ByteSize = Field(ByteSize(64 << 20), description="shared-memory window per connection")
    stream_stores: bool = Field(
        True, description="lmkv server and Redis: a step's pages go to the tier layer by layer as the forward "
        "computes them, in one put session (Redis: staging keys) made readable when the step commits (off: "
        "written through whole after the commit)")
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        known = SERVER_SCHEMES + REDIS_SCHEMES + MOONCAKE_SCHEMES
        if url is not None and urlsplit(url).scheme not in known:
            accepted = ", ".join(f"{s}://" for s in known)
            raise ValueError(f"unknown scheme {urlsplit(url).scheme!r} (accepted: {accepted})")
        return url


class PDConfig(_Section):
    """Prefill/decode hand-off: what vLLM's ``kv_role`` makes lmkv do. A producer (``kv_producer``)
    stores every full block of every prompt, whatever ``offload.policy`` says, and tells what it
    stored in its response's ``kv_transfer_params``; a consumer (``kv_consumer``) loads, waits
    for the pages a producer announced, and never uploads a prompt it computed itself;
    ``kv_both`` does both jobs as one engine does."""

    wait: float = Field(
        1.0, ge=0, le=600, description="seconds a consumer's request waits for the pages its producer announced "
        "before it computes what did not come (the request waits, not the engine); measured (lmkv bench pd), a "
        "prompt's last pages landed up to 0.6 s after its producer answered with 256 KiB pages, 0.83 s with 4 MiB")
    consumer_stores_decoded: bool = Field(
        True, description="a consumer stores the blocks it decoded (the next turn's prefill on a producer loads "
        "the answer's KV then); its prompts' blocks never")
    producer_loads: bool = Field(True, description="a producer loads the prefixes lmkv holds instead of recomputing")


#: a tenant's name: it appears in logs and stats, never in a key or a path
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$"
#: a namespace a tenant may use: exact, or ending in ``*`` for every namespace it begins
GRANT_PATTERN = r"^[\x21-\x7e]{1,256}$"


class QuotaConfig(_Section):
    """A tenant's share of the server (each unset: no limit). Bytes and pages are counted in each
    local tier apart (room reserved for pages on their way counts too); at its limit a tenant's
    writes evict its own least recently used pages, never another tenant's."""

    memory_bytes: ByteSize | None = Field(None, description="bytes in the server's memory tier")
    memory_pages: int | None = Field(None, ge=1, description="pages in the server's memory tier")
    disk_bytes: ByteSize | None = Field(None, description="bytes in the server's disk tier")
    disk_pages: int | None = Field(None, ge=1, description="pages in the server's disk tier")
    domains: int = Field(256, ge=1, le=65536, description="residency domains owning pages at once")
    connections: int | None = Field(
        None, ge=1, le=65536, description="authenticated connections at once; unset: an equal share of "
        "server.max_connections among the tenants (all of it for a server without tenants)")


class TenantConfig(_Section):
    """One tenant of ``lmkv serve``: its token opens only its namespaces, within its quota."""

    name: str = Field(pattern=TENANT_PATTERN)
    token: str | None = Field(None, min_length=16, description="the tenant's token (or token_file)")
    token_file: str | None = Field(None, description="a file holding the token (first line)")
    namespaces: list[Annotated[str, Field(pattern=GRANT_PATTERN)]] = Field(
        min_length=1, description="namespaces its clients may name in HELLO; 'team-a/*' grants every one "
        "beginning 'team-a/'")
    quota: QuotaConfig = Field(default_factory=QuotaConfig)

    @model_validator(mode="after")
    def _one_token(self) -> TenantConfig:
        if (self.token is None) == (self.token_file is None):
            raise ValueError(f"tenant {self.name!r}: give token or token_file (one of them)")
        return self


class ServerConfig(_Section):
    """``lmkv serve``: the standalone cache server (its tiers are this config's memory, disk, remote)."""

    host: str = Field("127.0.0.1", description="bind address; anything but loopback requires a token")
    port: int = Field(7420, ge=0, le=65535, description="TCP port (0: any free port)")
    token: str | None = Field(
        None, min_length=8, description="one tenant: clients must present it and may then use every namespace "
        "and see server-wide stats (or LMKV_SERVER__TOKEN; with tenants, unset)")
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="tenants, each with its token, namespaces and quota")
    admin_token: str | None = Field(None, min_length=16, description="with tenants: server-wide stats and clears")
    admin_token_file: str | None = Field(None, description="a file holding admin_token")
    quota: QuotaConfig = Field(
        default_factory=QuotaConfig, description="without tenants: the one tenant's quota")
    tls_cert: str | None = Field(None, description="PEM certificate: serve TLS")
    tls_key: str | None = Field(None, description="PEM private key for tls_cert")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint port (unset: off)")
    metrics_host: str = Field("127.0.0.1", description="Prometheus endpoint address (loopback unless set)")
    metrics_auth: bool = Field(
        False, description="scrapes must send Authorization: Bearer <server.token, or admin_token with tenants>")
    max_connections: int = Field(256, ge=1, le=65536, description="clients served at once; more are refused")
    max_bulk: ByteSize = Field(ByteSize(256 << 20), description="largest request or reply body")
    idle_timeout: float = Field(600.0, gt=0, description="seconds a silent client keeps its connection")
    hello_timeout: float = Field(5.0, gt=0, description="seconds a new connection has to authenticate, in all")
    max_unauthenticated: int = Field(32, ge=1, le=65536, description="connections not yet authenticated, at once")
    max_per_peer: int = Field(128, ge=1, le=65536, description="connections from one address (or one uid locally)")
    payload_timeout: float = Field(
        10.0, gt=0, description="seconds a PUT's pages have to arrive, in all, once its header did")
    shared_memory: bool = Field(
        True, description="serve same-host clients over a Unix domain socket too, where they may pass "
        "sealed memfds (their staging windows, their memory tier's arena) for bulk bytes")
    shm_uids: list[int] | None = Field(
        None, description="uids whose clients may share memory (SO_PEERCRED); unset: the server's own")
    max_shm: ByteSize = Field(ByteSize(1 << 40), description="largest memfd a client may pass")


class FaultSpec(_Section):
    """Faults injected into one lower tier's loads (:mod:`lmkv.tiers.faults`)."""

    missing_rate: float = Field(0.0, ge=0, le=1)
    corrupt_rate: float = Field(0.0, ge=0, le=1)
    short_read_rate: float = Field(0.0, ge=0, le=1)
    delay_ms: float = Field(0.0, ge=0)
    outages: list[tuple[float, float]] = Field(default_factory=list)
    seed: int = 0


class LMKVConfig(_Section):
    """Everything lmkv reads. Engine adapters add the model identity themselves."""

    namespace: str = Field("default", pattern=NAMESPACE_PATTERN, description="tenant; part of every key")
    domain: str = Field("engine", pattern=DOMAIN_PATTERN,
                        description="residency domain that owns what this process stores")
    model_id: str | None = Field(None, description="model identity for keys; engines fill it in")
    load_mode: Literal["auto", "layerwise", "async"] = Field(
        "auto",
        description="layerwise: a hit loads inside the step that computes the rest of its request, "
        "layer by layer from whichever tier holds it (a layer is waited for only when the forward "
        "reaches it), a failed page recomputes from that page on; async: the request waits while "
        "its pages load whole in the background, and a failed load recomputes the request; auto: "
        "layerwise, except a hit below memory whose fetch (its bytes over the tier's measured read "
        "rate) would take longer than layerwise_max_stall times the engine's step while other "
        "requests run (their step would wait for it), and except models with several cache groups "
        "(vLLM recovers their failures per request only)",
    )
    layerwise_span: int = Field(
        0, ge=0, description="layers per request when a layerwise load reads a tier below memory; 0: "
        "chosen per tier from recent loads at each span: the tier's time to deliver a load plus the "
        "forward's waits for it, per byte (every page of a request costs fixed work at both ends, so "
        "one layer per request can cost more than its overlap hides)")
    layerwise_max_stall: float = Field(
        2.0, ge=0, description="load_mode auto: the longest fetch, as a multiple of the engine's recent "
        "step time, that a hit below memory may take layerwise while other requests share the step")
    copy_stream: bool = Field(
        True, description="GPU engines: the worker's copies run on CUDA streams of their own, ordered "
        "against the forward by one event per layer (a load's layers are copied ahead and the forward "
        "waits for layer l's copy alone; layer l's store copy starts once it is computed and overlaps "
        "the later layers); false: on the forward's stream, in order with the layers. CPU engines copy "
        "in the forward's thread either way (there is nothing to overlap)")
    quarantine_seconds: float = Field(
        30.0, ge=0, description="how long a page whose load failed is not offered again"
    )
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    pd: PDConfig = Field(default_factory=PDConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    faults: dict[str, FaultSpec] = Field(
        default_factory=dict, description="fault injection per lower tier name (tests, benchmarks)"
    )


_HINTS = {
    "byte_size": "expected a byte size such as 512MiB, 8GiB or a number of bytes",
    "byte_size_unit": "expected a byte size such as 512MiB, 8GiB or a number of bytes",
    "bool_parsing": "expected true/false, yes/no, on/off or 1/0",
}


def _describe(err: Mapping[str, Any], model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section: Any = model
        for part in err["loc"][:-1]:
            section = section.model_fields[str(part)].annotation
        accepted = ", ".join(sorted(section.model_fields))
        return f"{loc}: unknown setting (accepted here: {accepted})"
    hint = _HINTS.get(err["type"])
    return f"{loc} = {err.get('input')!r}: {err['msg']}" + (f" ({hint})" if hint else "")


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``LMKV_A__B=v`` becomes ``{"a": {"b": "v"}}`` (except :data:`NOT_SETTINGS`)."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        path = name[len(ENV_PREFIX):].lower().split(ENV_NESTING)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with a scalar setting of the same prefix")
        node[path[-1]] = value
    return out


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path) as f:  # (a stream: a YAML error then names the file, not "<unicode string>")
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config_file = {str(path)!r}: cannot read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config_file = {str(path)!r}: not valid YAML ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config_file = {str(path)!r}: expected a mapping at the top level")
    return data


def load_config(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LMKVConfig:
    """Build the configuration from file, environment and ``overrides`` (highest precedence).

    Raises:
        ConfigError: a bad value, an unknown setting, or a config file that cannot be read or parsed
            (the message names the setting or the file, the value and what is accepted).
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    file = overrides.pop("config_file", None) or environ.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = load_yaml(file) if file else {}
    merged = _deep_merge(merged, env_overrides(environ))
    merged = _deep_merge(merged, overrides)
    try:
        return LMKVConfig.model_validate(merged)
    except ValidationError as e:
        lines = [_describe(err, LMKVConfig) for err in e.errors()]
        raise ConfigError("invalid lmkv configuration:\n  " + "\n  ".join(lines)) from None
