"""SGLang HiCache host pools seen as lmkv pages (docs/design/cache-groups.md).

SGLang hands a storage backend its host pools (``HostPoolGroup`` entries: the KV
anchor, and sidecars such as ``SWA`` and ``MAMBA``). Each pool becomes one
:class:`~lmkv.layout.GroupLayout`, derived from the pool's real buffers, and a
:class:`PoolPages` that finds a page's segments inside the pool's buffer
whatever ``--hicache-mem-layout`` chose:

- MHA (``MHATokenToKVPoolHost``): segments ``k`` and ``v``, each
  ``page_size x heads x head_dim`` elements per layer; the ``KV`` pool is full
  attention, the ``SWA`` pool sliding window.
- MLA (``MLATokenToKVPoolHost``): one latent segment per layer.
- Mamba (``MambaPoolHost``, one slot per key): the conv states then the
  temporal (SSM) state, per Mamba layer; one state per stored page boundary.

lmkv's page lays every layer out contiguously with the layer's segments inside
(``layer * layer_stride + segment_offset``), so a page moves in one object
however SGLang strides it in host memory. Tensor parallelism is explicit: an
MLA latent is the same on every rank (SGLang's ``is_mla_model``: one writer,
every rank reads the same key); MHA heads and Mamba state are sharded (every
rank writes under its own shard's key).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmkv.layout import GroupLayout, Segment, StateKind

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolPages:
    """One host pool as lmkv pages: the group layout and where each page's bytes sit."""

    name: str
    layout: GroupLayout
    slots_per_page: int  # host indices one key covers (the pool's page_size; 1 for Mamba)
    page_slice: Callable[[int], Any]  # page number -> the pool's buffers for that page (a tensor or a tuple)
    segments: Callable[[Any], list[torch.Tensor]]  # page slice -> per segment, (layers, ...) views
    num_pages: int  # pages the pool's buffers hold: a page number outside [0, num_pages) is refused

    def page_of(self, host_index: int) -> int:
        return host_index // self.slots_per_page

    def flat_shape(self) -> torch.Size:
        """Shape of one page slice (SGLang's flat data page follows it)."""
        return self.page_slice(0).shape

    def gather(self, parts: Sequence[torch.Tensor], payload) -> None:
        """Copy a page's segments (from :attr:`segments`) into an lmkv payload buffer."""
        for dst, src in zip(self._payload_views(payload, parts), parts):
            dst.copy_(src.view(torch.uint8))

    def scatter(self, payload, parts: Sequence[torch.Tensor]) -> None:
        """Copy an lmkv payload into a page's segments."""
        for src, dst in zip(self._payload_views(payload, parts), parts):
            dst.view(torch.uint8).copy_(src)

    def _payload_views(self, payload, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        lay = self.layout
        rows = torch.frombuffer(payload, dtype=torch.uint8).view(lay.num_layers, lay.layer_stride)
        out, off = [], 0
        for seg, part in zip(lay.segments, parts):
            # bytes, so segments of different dtypes need no alignment
            shape = part.view(torch.uint8).shape[1:]
            out.append(rows[:, off : off + seg.nbytes].view(lay.num_layers, *shape))
            off += seg.nbytes
        return out


def _dtype_name(dtypes: Sequence[torch.dtype]) -> str:
    return "+".join(dict.fromkeys(str(d).removeprefix("torch.") for d in dtypes))


def _segments_of(name_parts: Sequence[tuple[str, torch.Tensor]]) -> tuple[Segment, ...]:
    """Segment sizes from one page's per-layer views."""
    return tuple(Segment(n, t[0].numel() * t.element_size()) for n, t in name_parts)


def _token_pool_slices(buffer: torch.Tensor, layout: str, page_size: int, lead: int) -> tuple[
        Callable[[int], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], int]:
    """For a token pool's buffer with ``lead`` leading axes (2 for MHA's K/V, 0 for MLA):
    page slice, slice -> (layers, tokens, ...) view, and the pages the buffer holds."""
    if layout not in LAYOUTS:
        raise NotImplementedError(
            f"lmkv reads SGLang host pools laid out as {', '.join(LAYOUTS)}; this one is {layout!r} "
            "(--hicache-mem-layout page_first_direct is the match for lmkv's pages)")
    pre = (slice(None),) * lead
    if layout == "layer_first":  # (..., L, size, ...)
        return (lambda p: buffer[pre + (slice(None), slice(p * page_size, (p + 1) * page_size))],
                lambda s: s, buffer.shape[lead + 1] // page_size)
    if layout == "page_first":  # (..., size, L, ...): a layer is strided inside the page
        return (lambda p: buffer[pre + (slice(p * page_size, (p + 1) * page_size),)],
                lambda s: s.transpose(0, 1), buffer.shape[lead] // page_size)
    return (lambda p: buffer[pre + (slice(p, p + 1),)],  # (..., page_num, L, P, ...)
            lambda s: s[0], buffer.shape[lead])


def describe_pool(
    host_pool,
    name: str,
    *,
    tokens_per_page: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    replicated: bool = False,
) -> PoolPages:
    """The :class:`PoolPages` of one registered SGLang host pool.

    ``name`` is the pool's ``PoolName`` value (``kv``, ``swa``, ``mamba``, ...);
    ``tokens_per_page`` is the KV anchor's page size (a Mamba state is keyed by the
    attention page it ends on); ``replicated``: every rank holds these bytes
    (SGLang's ``is_mla_model``), so one rank writes and all read the same key.
    Raises ``NotImplementedError`` for pools and layouts lmkv does not move.
    """
    kind_name = type(host_pool).__name__
    replicas = tp_size if replicated else 1
    common: dict[str, Any] = dict(tp_size=tp_size, tp_rank=tp_rank, tp_replicas=replicas)
    if hasattr(host_pool, "temporal_buffer") and hasattr(host_pool, "conv_buffer"):  # MambaPoolHost
        buffers = [*host_pool.conv_buffer, host_pool.temporal_buffer]
        names = [f"conv{i}" if len(buffers) > 2 else "conv" for i in range(len(buffers) - 1)] + ["ssm"]
        live = [(n, b) for n, b in zip(names, buffers) if b.numel()]  # conv-only models: no temporal state

        def state_slice(slot: int) -> tuple[torch.Tensor, ...]:
            return tuple(b[slot] for _, b in live)  # each (layers, 1, *state)

        def segments(s) -> list[torch.Tensor]:
            return list(s)

        probe = state_slice(0)
        layout = GroupLayout(
            name=name, kind=StateKind.MAMBA, num_layers=host_pool.num_mamba_layers,
            segments=_segments_of(list(zip([n for n, _ in live], probe))), tokens_per_page=tokens_per_page,
            dtype=_dtype_name([b.dtype for _, b in live]), **common)
        return PoolPages(name, layout, 1, state_slice, segments, live[0][1].shape[0])

    page_size = host_pool.page_size
    if page_size != tokens_per_page:
        raise NotImplementedError(f"pool {name!r}: page size {page_size} differs from the KV pool's {tokens_per_page}")
    if hasattr(host_pool, "kv_cache_dim"):  # MLATokenToKVPoolHost: one latent per token
        page_slice, per_layer, stored_pages = _token_pool_slices(host_pool.kv_buffer, host_pool.layout, page_size, 0)
        storage_index = getattr(host_pool, "_storage_page_index", None)  # decode-context-parallel translation
        # (a translated pool is addressed by the logical pages of its size, which its index maps)
        num_pages = host_pool.size // page_size if storage_index else stored_pages

        def mla_slice(p: int):
            return page_slice(storage_index(p * page_size) // page_size if storage_index else p)

        def mla_segments(s) -> list[torch.Tensor]:
            return [per_layer(s)]

        layout = GroupLayout(
            name=name, kind=StateKind.MLA, num_layers=host_pool.layer_num,
            segments=_segments_of([("latent", per_layer(mla_slice(0)))]), tokens_per_page=page_size,
            dtype=_dtype_name([host_pool.dtype]), **common)
        return PoolPages(name, layout, page_size, mla_slice, mla_segments, num_pages)
    if hasattr(host_pool, "k_buffer") and hasattr(host_pool, "head_num"):  # MHATokenToKVPoolHost
        if host_pool.v_head_dim != host_pool.head_dim:
            raise NotImplementedError(f"pool {name!r}: K and V head sizes differ")
        page_slice, per_layer, num_pages = _token_pool_slices(host_pool.kv_buffer, host_pool.layout, page_size, 1)

        def mha_segments(s) -> list[torch.Tensor]:
            return [per_layer(s[0]), per_layer(s[1])]

        window = name == "swa"
        layout = GroupLayout(
            name=name, kind=StateKind.SLIDING_WINDOW if window else StateKind.FULL_ATTENTION,
            num_layers=host_pool.layer_num, segments=_segments_of(list(zip("kv", mha_segments(page_slice(0))))),
            # no sliding_window: SGLang picks the window's pages itself (trailing pages)
            tokens_per_page=page_size, dtype=_dtype_name([host_pool.dtype]), **common)
        return PoolPages(name, layout, page_size, page_slice, mha_segments, num_pages)
    raise NotImplementedError(f"lmkv does not move SGLang host pool {kind_name} ({name!r}) yet")
