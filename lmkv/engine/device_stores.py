"""GPUDirect Storage in the worker: device staging slots for the disk tier's pages, and a step's
stores written to disk from device memory.

With a disk tier on ``disk.io: gds`` on the engine's GPU and layers lmkv's kernel copies, disk
pages are read into device staging slots (:mod:`lmkv.tiers.device_staging`), verified there, and
scattered by the kernel; under write-through, the blocks a step stored are gathered into slots
after its forward, their headers made on the device, and written to disk from there (the host
copy goes to the memory tier alone). Slots come back once their writes are done.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from lmkv.engine.copier import Copier
from lmkv.kernels import KernelLayerBlocks
from lmkv.keys import PageKey
from lmkv.page import padded
from lmkv.store import TieredStore
from lmkv.tiers.device_staging import DeviceStaging, StagingLease
from lmkv.tiers.gds import DeviceBuffer

log = logging.getLogger(__name__)


def device_staging(store: TieredStore, copier: Copier) -> tuple[DeviceStaging | None, set[int]]:
    """Staging slots for a GPUDirect Storage disk tier on the engine's GPU, and the groups whose
    layers the kernel copies there (others take the host path)."""
    disk = store.gds_disk
    if disk is None or disk.gds is None:
        return None, set()
    groups = {g for g, layers in enumerate(copier.layers)
              if layers and copier.kernel_only(g) and layers[0].tensor.device.index == disk.gds.device}
    if not groups:
        return None, set()
    slot = max(copier.groups[g].payload_bytes for g in groups)
    slots = max(1, store.cfg.disk.gds_staging // padded(slot))
    return DeviceStaging(disk.gds, slot, slots), groups


def store_from_device(store: TieredStore, copier: Copier, staging: DeviceStaging, groups: set[int],
                      stored: Mapping[int, tuple[Sequence[PageKey], Sequence[int]]]) -> dict[str, set[PageKey]]:
    """Under write-through: the pages this step stored (``stored[g]``: their keys and blocks), for
    the ``groups`` on the device, gathered into staging slots after the whole forward, their headers
    made on the device, written to the disk tier from there on an I/O thread. The keys the disk
    tier gets this way, by tier name: the step's own write-through skips them there."""
    if store.cfg.store.write_policy != "write_through":
        return {}
    from lmkv.kernels.digests import headers_on_device

    disk = store.gds_disk
    assert disk is not None
    sent: set[PageKey] = set()
    for g, (keys, blocks) in stored.items():
        if g not in groups or not keys:
            continue
        slots = staging.take(len(keys))
        n = len(slots.ptrs)
        if not n:
            continue
        layout = copier.groups[g]
        if copier.streams is not None:  # after the whole forward
            copier.streams.step.follow(copier.streams.compute())
        with copier.on_stream():
            index = copier.index(g, list(zip(blocks[:n], slots.ptrs)))
            for layer, lb in enumerate(copier.layers[g]):
                assert isinstance(lb, KernelLayerBlocks)
                lb.copy_at(*index, layout.layer_range(layer)[0], to_pages=True)
        copier.sync()
        try:
            heads = headers_on_device(list(keys[:n]), slots.ptrs, layout, device=staging.device)
        except Exception:  # the host path writes them instead
            log.exception("lmkv: digests on the device failed; writing these pages from host memory")
            slots.release()
            continue
        pages = [(h, DeviceBuffer(p)) for h, p in zip(heads, slots.ptrs)]
        store.submit(_write_from_device, store, disk, pages, slots)
        sent.update(keys[:n])
    return {disk.name: sent} if sent else {}


def _write_from_device(store: TieredStore, disk, pages: list, slots: StagingLease) -> None:
    try:
        store.write_down(disk, pages, store.domain)
    finally:
        slots.release()
