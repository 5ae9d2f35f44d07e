"""lmkv: a KV-cache tier connector and offload library for LLM inference engines.

The core (this package) knows nothing about engines: keys (:mod:`lmkv.keys`),
the page format (:mod:`lmkv.page`), cache-group layouts (:mod:`lmkv.layout`),
tiers (:mod:`lmkv.tiers`) and the tiered store (:mod:`lmkv.store`). Engine
adapters live in :mod:`lmkv.connectors`.
"""

from lmkv.config import ConfigError, LMKVConfig, load_config
from lmkv.keys import KeySpace, chain_hashes, page_key, page_keys
from lmkv.layout import GroupLayout, Growth, Segment, StateKind, attention_layout
from lmkv.lookup import Lookup
from lmkv.store import TieredStore

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "GroupLayout", "Growth", "KeySpace", "LMKVConfig", "Lookup", "Segment",
    "StateKind", "TieredStore", "attention_layout", "chain_hashes", "load_config", "page_key",
    "page_keys",
]
