"""The key scheme: one 128-bit content key per page.

A request's tokens are cut into pages of ``tokens_per_page`` tokens. Page ``i``
gets a *chain hash*::

    chain[-1] = xxh3_128("lmkv-keys-v1" | model_id | namespace)          # the root
    chain[i]  = xxh3_128(chain[i-1] | tokens[i] as little-endian u32 | extra[i])

Prefixing the parent's 128-bit hash into the input seeds every page with its
whole prefix, so equal chain hashes mean equal token prefixes (up to hash
collisions); ``extra`` carries what else changes a page's state (a LoRA name,
multimodal hashes). The model identity and the namespace (tenant, vLLM's
``cache_salt``) are in the root, so two tenants or two models can never share
a key. The chain hash is shared by every cache group; the *page key* then binds
it to one group's bytes::

    key = xxh3_128(chain[i] | layout.fingerprint as u64 | shard as i32)

where ``shard`` is the tensor-parallel shard index for a sharded group and -1
for a replicated one (every rank of a replica set reads the same key).
Only full pages get keys: a partial page is never stored.

Three kinds of key travel through lmkv, all 16 raw bytes, never interchangeable, so each is
its own type (``NewType`` over bytes: free at run time, told apart by the type checker):
:data:`ChainHash` (a prefix), :data:`PageKey` (a stored page) and :data:`EngineBlockKey`
(the engine's own key of a cached block). A chain hash becomes a page key only through
:func:`page_key`, and bytes from outside (a file name, a frame) only through
:func:`as_page_key`; the engine adapter makes engine block keys from its engine's hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

from lmkv.layout import GroupLayout

KEY_BYTES = 16

#: A page's place in a token sequence: the hash of its whole prefix, the model and the namespace.
#: Shared by every cache group of the sequence.
ChainHash = NewType("ChainHash", bytes)
#: The key one cache group's page is stored under in every tier: a chain hash bound to that
#: group's layout and tensor-parallel shard.
PageKey = NewType("PageKey", bytes)
#: The engine's own key of one cached block (vLLM: ``BlockHashWithGroupId`` bytes), which its
#: free block queue and prefix cache are keyed by; lazy offload tracks blocks by it.
EngineBlockKey = NewType("EngineBlockKey", bytes)
_ROOT_TAG = b"lmkv-keys-v1"
_U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class KeySpace:
    """The identity every key of one engine carries: which model, which tenant."""

    model_id: str
    namespace: str = "default"

    @property
    def root(self) -> ChainHash:
        """The parent of every sequence's first page."""
        ident = b"\0".join((_ROOT_TAG, self.model_id.encode(), self.namespace.encode()))
        return ChainHash(xxhash.xxh3_128_digest(ident))

    def adopt(self, prefix_hash: bytes) -> ChainHash:
        """An engine's own hash of a whole prefix (SGLang's page keys chain their prefix) as a
        chain hash of this key space: it then carries the model and the namespace as ours do."""
        return ChainHash(xxhash.xxh3_128_digest(self.root + prefix_hash))


def _token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
        raise ValueError("token ids must lie in 0..2**32-1")
    return arr.astype("<u4", copy=False)


def chain_hashes(
    parent: ChainHash,
    tokens: Sequence[int] | np.ndarray,
    tokens_per_page: int,
    extras: Sequence[bytes] | None = None,
) -> list[ChainHash]:
    """Chain hashes of every *full* page of ``tokens``, continuing from ``parent``.

    ``parent`` is ``KeySpace.root`` for the first page of a sequence, or the last
    chain hash already known (to extend a sequence without rehashing it).
    """
    if tokens_per_page < 1:
        raise ValueError(f"tokens_per_page must be >= 1, got {tokens_per_page}")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent hash has {KEY_BYTES} bytes, got {len(parent)}")
    data = _token_array(tokens).tobytes()
    n_pages = len(data) // (4 * tokens_per_page)
    if extras is not None and len(extras) < n_pages:
        raise ValueError(f"{n_pages} full pages but only {len(extras)} extras")
    step = 4 * tokens_per_page
    out: list[ChainHash] = []
    h = parent
    for i in range(n_pages):
        chunk = data[i * step : (i + 1) * step]
        h = ChainHash(xxhash.xxh3_128_digest(h + chunk + (extras[i] if extras is not None else b"")))
        out.append(h)
    return out


def page_key(chain: ChainHash, layout: GroupLayout) -> PageKey:
    """The key of one group's page for the prefix ending in ``chain``."""
    shard = -1 if layout.shard is None else layout.shard
    tail = layout.fingerprint.to_bytes(8, "little") + shard.to_bytes(4, "little", signed=True)
    return PageKey(xxhash.xxh3_128_digest(chain + tail))


def page_keys(chains: Sequence[ChainHash], layout: GroupLayout) -> list[PageKey]:
    return [page_key(c, layout) for c in chains]


def as_page_key(raw: bytes) -> PageKey:
    """Bytes from outside (a frame, a page file's header, a qualified client key) as a page key;
    rejects anything that is not :data:`KEY_BYTES` long."""
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a key has {KEY_BYTES} bytes, got {len(raw)}")
    return PageKey(bytes(raw))


def key_hex(key: PageKey) -> str:
    return key.hex()


def parse_key_hex(text: str) -> PageKey:
    """Inverse of :func:`key_hex`; rejects anything that is not 32 hex digits."""
    if len(text) != 2 * KEY_BYTES:
        raise ValueError(f"a key is {2 * KEY_BYTES} hex digits, got {len(text)}")
    return PageKey(bytes.fromhex(text))
