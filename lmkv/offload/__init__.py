"""Eviction-aware lazy offload (docs/design/lazy-offload.md) and how it is evaluated.

- :mod:`~lmkv.offload.lazy`: which cached blocks to copy to the tiers, and when, from the
  engine's LRU free queue; it decides and touches neither bytes nor tiers.
- :mod:`~lmkv.offload.reuse`: the reuse estimate it judges a block's worth by.
- :mod:`~lmkv.offload.traces` and :mod:`~lmkv.offload.sim`: request traces and their replay on
  vLLM's real ``KVCacheManager`` against eager write-through and an offline oracle
  (``lmkv bench offload``); ``sim`` is the only module here that imports vLLM.
"""
