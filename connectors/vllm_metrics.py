"""lmkv's counters in vLLM's ``/metrics``, through the KV-connector Prometheus hook.

vLLM (0.32/0.33) sums each step's connector stats across workers and hands them to
the connector's ``KVConnectorPromMetrics`` in the process that serves ``/metrics``.
lmkv's stats are flat counts (:class:`~connectors.vllm.LMKVConnectorStats`): the
workers' transfers (``loaded_pages``, ``recomputed_tokens``, ...), their store's
tiers (``tier.<name>.<counter>``) and the scheduler's ``scheduler.*`` (lookups,
planned loads and stores, lazy offload's decisions as ``scheduler.lazy.*``). Each
becomes a ``vllm:lmkv_*_total`` counter with vLLM's engine labels.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from lmkv.engine.scheduler import SchedulerStats
from lmkv.engine.transfer_stats import TransferCounts
from lmkv.metrics import TIER_COUNTERS, MetricDoc

TRANSFER_DOCS = {
    "loaded_pages": "pages loaded into the engine's KV cache",
    "loaded_bytes": "bytes loaded into the engine's KV cache",
    "failed_pages": "pages whose load failed (their tokens are recomputed)",
    "recomputed_tokens": "tokens lmkv offered that the engine computed because a load failed",
    "layerwise_pages": "pages of layerwise loads read layer by layer from a tier below memory",
    "layer_wait_us": "microseconds the forward waited for layers of those loads",
    "stored_pages": "pages copied out of the engine's KV cache",
    "stored_bytes": "bytes copied out of the engine's KV cache",
    "rescued_pages": "lazy offload: blocks copied in the step that handed them out, before its forward",
    "dropped_pages": "stores skipped because lmkv's memory had no room",
    "pulled_pages": "pages a waiting P/D consumer copied into lmkv's memory as they landed on the shared tier",
}
SCHEDULER_DOCS = {
    "lookups": "lookups of waiting requests (a waiting request is looked up each step it waits)",
    "loaded_tokens": "tokens planned for loading (hits the engine took)",
    "stored_pages": "pages planned for storing",
    "skipped_resident": "pages not stored because a tier held them already",
    "layerwise_loads": "hits that load layer by layer inside the step computing the rest of their request",
    "async_loads": "hits that load whole before their request runs",
    "lookups_timed_out": "lookups a network tier did not answer within remote.lookup_timeout (the request ran "
                         "without it)",
    "lookups_local_only": "lookups that asked only this process's tiers because a network tier had not answered "
                          "another lookup for 50 ms, 250 ms before any had answered (presumed stalled)",
    "handoffs_short": "consumer requests whose announced pages had not all come within pd.wait",
    "handoff_wait_ms": "milliseconds consumer requests waited for the pages a producer announced, summed",
}


_LAZY = ("lazy_offload_decisions", "lazy offload's decisions, by kind (planned, rescued, unlikely: not copied, ...)")
_TIER_BYTES = ("tier_bytes", "payload bytes moved per tier and direction")


def _spec() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(stats key, metric name without ``vllm:lmkv_`` and ``_total``, meaning, own labels) of every
    counter; a key ending in ``.*`` stands for the keys it prefixes."""
    out: list[tuple[str, str, str, tuple[str, ...]]] = [(k, k, doc, ()) for k, doc in TRANSFER_DOCS.items()]
    out += [(f"scheduler.{k}", f"scheduler_{k}", doc, ()) for k, doc in SCHEDULER_DOCS.items()]
    out.append(("scheduler.lazy.*", _LAZY[0], _LAZY[1], ("decision",)))
    out += [(f"tier.*.{f}", f"tier_{f}", f"{f} per tier", ("tier",)) for f in TIER_COUNTERS]
    out.append(("tier.*.*_bytes", _TIER_BYTES[0], _TIER_BYTES[1], ("tier", "direction")))
    return out


def metrics() -> list[MetricDoc]:
    """Every counter lmkv adds to vLLM's ``/metrics`` (besides vLLM's own engine labels)."""
    return [MetricDoc(f"vllm:lmkv_{name}_total", "counter", labels, f"lmkv: {doc}") for _, name, doc, labels in _spec()]


class LMKVPromMetrics(KVConnectorPromMetrics):
    """lmkv's counters as ``vllm:lmkv_*_total`` Prometheus counters, fed vLLM's summed connector stats each step."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        assert set(TRANSFER_DOCS) == set(vars(TransferCounts())) and set(SCHEDULER_DOCS) == set(vars(SchedulerStats()))

        def counter(name: str, doc: str, labels: tuple[str, ...]):
            return self._counter_cls(name=f"vllm:lmkv_{name}_total", documentation=f"lmkv: {doc}",
                                     labelnames=self._labelnames + list(labels))

        made = {key: counter(name, doc, labels) for key, name, doc, labels in _spec()}
        # stats key -> (counter, its own label values)
        self._counters: dict[str, tuple[Any, tuple[str, ...]]] = {
            k: (made[k], ()) for k in [*TRANSFER_DOCS, *(f"scheduler.{k}" for k in SCHEDULER_DOCS)]}
        self._lazy = made["scheduler.lazy.*"]
        self._tier = {f: made[f"tier.*.{f}"] for f in TIER_COUNTERS}
        self._bytes = made["tier.*.*_bytes"]
        self._children: dict[tuple[int, str], Any] = {}

    def _child(self, engine_idx: int, key: str, metric, labels: tuple[str, ...]):
        child = self._children.get((engine_idx, key))
        if child is None:
            child = self._children[(engine_idx, key)] = metric.labels(
                *self.per_engine_labelvalues[engine_idx], *labels)
        return child

    def _resolve(self, key: str) -> tuple[Any, tuple[str, ...]] | None:
        """The counter and label values a stats key counts into (None: a key this build does not know)."""
        if key in self._counters:
            return self._counters[key]
        if key.startswith("scheduler.lazy."):
            return self._lazy, (key.removeprefix("scheduler.lazy."),)
        if key.startswith("tier."):
            tier, _, field = key.removeprefix("tier.").rpartition(".")
            if field in self._tier:
                return self._tier[field], (tier,)
            if field in ("put_bytes", "get_bytes"):
                return self._bytes, (tier, field.removesuffix("_bytes"))
        return None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            found = self._resolve(key)
            if found is not None:
                self._child(engine_idx, key, *found).inc(value)
