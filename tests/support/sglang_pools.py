"""Real SGLang host pools on the CPU, for the SGLang backend's tests.

SGLang's pool modules import ``sglang.srt.configs``, which imports its
multimodal configs, which import ``torchvision``. PyPI's torchvision is built
for CUDA torch and does not import beside the CPU torch this machine runs (and
no CPU torchvision wheel can be fetched here), so while those modules are
imported, ``torchvision`` resolves to an inert placeholder package. Nothing lmkv
or the pools use touches it; transformers is imported first so that it still
sees torchvision as absent. Where a working torchvision exists, it is used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch


class _Inert(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


def _import_pools():
    try:
        import torchvision  # noqa: F401
        placeholder = None
    except Exception:
        import transformers.image_utils  # noqa: F401  (decides "no torchvision" before the placeholder exists)

        sys.modules.pop("torchvision", None)
        placeholder = _InertFinder()
        sys.meta_path.insert(0, placeholder)
    try:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
        from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    finally:
        if placeholder is not None:
            sys.meta_path.remove(placeholder)
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    return types.SimpleNamespace(
        Mamba2CacheParams=Mamba2CacheParams, Mamba2StateShape=Mamba2StateShape, _mha_host_inputs=_mha_host_inputs,
        MambaPool=MambaPool, MHATokenToKVPool=MHATokenToKVPool, MLATokenToKVPool=MLATokenToKVPool,
        MambaPoolHost=MambaPoolHost, MLATokenToKVPoolHost=MLATokenToKVPoolHost)


sg = _import_pools()


def mha_host(layout: str, *, page_size: int = 4, layers: int = 3, heads: int = 2, head_dim: int = 8,
             tokens: int = 64, dtype=torch.bfloat16):
    dev = sg.MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=heads, head_dim=head_dim,
                              layer_num=layers, device="cpu", enable_memory_saver=False)
    cls, info, kw = sg._mha_host_inputs(dev)
    return cls(info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
               pin_memory=False, **kw)


def mla_host(layout: str, *, page_size: int = 4, layers: int = 3, tokens: int = 64):
    dev = sg.MLATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=16,
                              qk_rope_head_dim=8, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return sg.MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False,
                                   device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                   end_layer=dev.end_layer, layer_shard_enabled=False, target_layer_num=layers,
                                   override_kv_cache_dim=dev.kv_cache_dim)


def mamba_host(layout: str = "page_first_direct", *, slots: int = 8, tp_size: int = 1):
    shape = sg.Mamba2StateShape.create(tp_world_size=tp_size, intermediate_size=64, n_groups=1, num_heads=4,
                                       head_dim=16, state_size=8, conv_kernel=4)
    dev = sg.MambaPool(size=slots, spec_state_size=0, cache_params=sg.Mamba2CacheParams(shape=shape, layers=[0, 2]),
                       mamba_layer_ids=[0, 2], device="cpu")
    info = dev.get_device_pool_infos()[0]
    return sg.MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=dev.size, pin_memory=False, layout=layout)


def buffers(host) -> list[torch.Tensor]:
    """Every tensor a host pool keeps its pages in."""
    if hasattr(host, "temporal_buffer"):
        return [*host.conv_buffer, host.temporal_buffer]
    return [host.kv_buffer]


def fill_random(host, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in buffers(host):
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))


def snapshot(host) -> list[torch.Tensor]:
    return [b.clone() for b in buffers(host)]


def zero(host) -> None:
    for b in buffers(host):
        b.zero_()
