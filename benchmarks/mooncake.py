"""``lmkv bench mooncake``: the Mooncake Store tier beside raw Mooncake client calls.

A real ``mooncake_master`` on loopback and two clients in this process, each contributing a
segment (objects land in either, as across a cluster's nodes): lmkv's tier, given a memory tier's
arena as a store gives it (registered with Mooncake; its pages read into and written from that
tier's slots, a header's room before each), and a peer. The baseline is raw
calls of lmkv's own client (``MooncakeDistributedStore``) into a buffer registered with it: the same
objects from the same segments, so placement favours neither side. Per round, the same pages:

- ``mooncake.put.2MiB``: ``MooncakeTier.put`` of 2 MiB pages from memory slots (header and
  payload, one object each); baseline: ``batch_put_from`` of objects of the same sizes from
  registered memory.
- ``mooncake.put_session.2MiB``: the same pages through a step's put session
  (:mod:`lmkv.tiers.mooncake_puts`): its start, every layer's range of every page as its own put,
  the headers and the session's end, back to back (in a step, the ranges go while the forward
  computes); baseline: ``batch_put_from`` as above.
- ``mooncake.get.2MiB`` / ``mooncake.get.256KiB``: ``MooncakeTier.get`` into memory slots, every
  page verified; baseline: ``batch_get_into`` of the same objects into registered memory.
  ``.unverified``: the same with ``remote.verify`` off (what the checksums cost is the gap).
  ``.vs_raw_hashed``: the verified figure against the raw call followed by xxh3 over every unit of
  what landed (the hashing any verifying reader pays: what is left is the tier's own cost).
- ``mooncake.get_layer.2MiB``: one layer's range of every page (what a layerwise load asks for a
  span), verified, as a layerwise load's later spans are read: in the get session its first span
  started, against the headers that span kept; baseline: the raw ranged call
  (``batch_get_into_multi_buffer_ranges``) of the same ranges on the same client, in that session.
  (A baseline on the peer's client, session start and end included, read the objects from the
  other side of the wire: its ratio went 0.62-0.70x or 0.81-0.86x from run to run, with where the
  master had put the objects.) ``.vs_raw_hashed`` and ``.unverified`` as for whole gets.
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.benchmarks.tiers import bench_layout, random_keys
from lmkv.config import MemoryConfig, RemoteConfig
from lmkv.dev.mooncake_master import start_master
from lmkv.page import header_bytes, make_header, units_in_ranges
from lmkv.tiers.memory import MemorySession, MemoryTier

log = logging.getLogger("lmkv.bench.mooncake")

#: the memory tier's arena: room for 2 x 32 slots of 2 MiB and their header room (read into, written from)
ARENA_BYTES = 192 << 20


def run(quick: bool = False) -> Report:
    try:
        from mooncake.store import MooncakeDistributedStore

        from lmkv.tiers.mooncake import MooncakeTier
    except ImportError as err:
        report = Report("mooncake", params={"skipped": f"the Mooncake client is not installed ({err})"})
        return report
    rounds = 3 if quick else 15  # (with 7, a figure varied 0.67-0.85x from one run to the next on 2 cores)
    report = Report("mooncake", params={"rounds": rounds, "protocol": "tcp", "host": "loopback"})
    with start_master() as master:
        mc = {"segment_size": 1 << 30, "local_buffer_size": 64 << 20, "staging_size": 128 << 20}
        tier = MooncakeTier(RemoteConfig(url=master.url, timeout=30, mooncake=mc))
        memory = MemoryTier(MemoryConfig(capacity=str(ARENA_BYTES), pin="never"), header_room=tier.header_room)
        tier.share_arena(memory.arena, memory.quarantine, memory.room_before)
        peer = MooncakeDistributedStore()
        if peer.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 30, 64 << 20, "tcp", "", master.url.split("//")[1]) != 0:
            raise RuntimeError("the peer Mooncake client could not set up")
        raw = tier._client()
        reg = np.zeros(160 << 20, np.uint8)
        if raw.register_buffer(reg.ctypes.data, reg.nbytes) != 0:
            raise RuntimeError("the Mooncake client could not register the baseline's buffer")
        try:
            for label, page, n in (("2MiB", 2 << 20, 16 if quick else 32), ("256KiB", 256 << 10, 128)):
                slots = memory.open_session(random_keys(2 * n), [bench_layout(page)] * (2 * n), "bench")
                try:  # (slots as a load takes them)
                    _size(report, tier, raw, reg, slots, label, page, n, rounds)
                finally:
                    slots.abort()
        finally:
            raw.unregister_buffer(reg.ctypes.data)
            tier.close()
            peer.close()
            memory.close()
    return report


def _size(report: Report, tier, raw, reg: np.ndarray, slots: MemorySession, label: str, page: int,
          n: int, rounds: int) -> None:
    """One page size's figures (``raw``: the tier's client, with ``reg`` registered; ``slots``: 2 x
    ``n`` of its memory tier's, the first ``n`` read into, the others written from)."""
    lay = bench_layout(page)
    obj = header_bytes(lay) + page
    payloads = [np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8) for i in range(n)]
    keys = random_keys(n)
    if not all(tier.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench")):
        raise RuntimeError("the Mooncake tier refused pages")
    names = [tier._name(k) for k in keys]
    ptrs = [reg.ctypes.data + i * obj for i in range(n)]
    outs = [slots.buffer(i) for i in range(n)]
    srcs = [slots.buffer(n + i) for i in range(n)]
    for src, p in zip(srcs, payloads):
        src[:] = p
    what = "raw calls of the same client for the same objects, into registered memory, same run"

    def get() -> float:
        return gbps(n * page, timed(lambda: tier.get(keys, lay, outs)))

    def raw_get() -> float:
        return gbps(n * page, timed(lambda: raw.batch_get_into(names, ptrs, [obj] * n)))

    def raw_get_hashed() -> float:
        def go() -> None:
            raw.batch_get_into(names, ptrs, [obj] * n)
            _hash_units(reg, n, obj, header_bytes(lay), lay.unit_slices)

        return gbps(n * page, timed(go))

    _checked_and_not(report, tier, f"mooncake.get.{label}", rounds, get, raw_get, raw_get_hashed, what,
                     "the same raw calls, then xxh3 over every unit of the bytes that landed, same run (what "
                     "verifying costs any reader: the tier's own overhead is the gap)")
    if not all(np.array_equal(o, p) for o, p in zip(outs, payloads)):
        raise RuntimeError("the Mooncake tier read wrong bytes")
    if label != "2MiB":
        return
    a, b = lay.layer_range(lay.num_layers // 2)

    def layer() -> float:
        got: list = []
        took = timed(lambda: got.extend(tier.get_ranges(keys, lay, [(a, b)], outs)))
        if not all(got):
            raise RuntimeError(f"the Mooncake tier missed {got.count(None)} of {n} pages' ranges")
        return gbps(n * (b - a), took)

    def ranged() -> None:
        got = raw.batch_get_into_multi_buffer_ranges(names, [[x] for x in ptrs], [[b - a]] * n,
                                                     [[header_bytes(lay) + a]] * n)
        if any(g != b - a for g in got):
            raise RuntimeError(f"the raw ranged read moved {got} bytes, not {b - a} a page")

    layer()  # (untimed: the first span, which starts the get session and keeps the headers)

    def raw_layer() -> float:
        return gbps(n * (b - a), timed(ranged))

    in_range = [lay.unit_slices[u] for u in units_in_ranges(lay, [(a, b)])]

    def raw_layer_hashed() -> float:
        def go() -> None:
            ranged()
            _hash_units(reg, n, obj, -a, in_range)

        return gbps(n * (b - a), timed(go))

    _checked_and_not(report, tier, "mooncake.get_layer.2MiB", rounds, layer, raw_layer, raw_layer_hashed, what,
                     "the same ranged raw calls, then xxh3 over every unit of the ranges that landed, same run")

    def put() -> float:
        fresh = random_keys(n)
        todo = [(make_header(k, lay, p), src) for k, p, src in zip(fresh, payloads, srcs)]  # (untimed)
        took = timed(lambda: tier.put(todo, "bench"))
        tier.delete(fresh)
        return gbps(n * page, took)

    def raw_put() -> float:
        fresh = [f"raw:{k.hex()}" for k in random_keys(n)]
        took = timed(lambda: raw.batch_put_from(fresh, ptrs, [obj] * n))
        raw.batch_remove(fresh, True)
        return gbps(n * page, took)

    ours, base = interleaved(rounds, put, raw_put)
    report.add("mooncake.put.2MiB", ours, "GB/s", base, what)

    def streamed() -> float:
        fresh = random_keys(n)
        headers = [make_header(k, lay, p) for k, p in zip(fresh, payloads)]  # (untimed: the step hashes them)

        def go() -> None:
            stream = tier.stream(fresh, [lay] * n, srcs, "bench")
            if stream is None:
                raise RuntimeError("the Mooncake tier took no put session")
            for layer in range(lay.num_layers):
                stream.filled(range(n), *lay.layer_range(layer))
            if stream.finish(headers, [s.ctypes.data for s in srcs]).result() != set(fresh):
                raise RuntimeError("a put session lost pages")
        took = timed(go)
        tier.delete(fresh)
        return gbps(n * page, took)

    ours, base = interleaved(rounds, streamed, raw_put)
    report.add("mooncake.put_session.2MiB", ours, "GB/s", base, what)


def _hash_units(reg: np.ndarray, n: int, stride: int, shift: int, units) -> None:
    """xxh3 over ``units`` (slices of a page's payload) of ``n`` objects landed in ``reg`` every
    ``stride`` bytes, each unit's payload offset ``shift`` bytes from where its object landed."""
    landed = reg.data  # (a flat byte view: reg is uint8)
    for i in range(n):
        at = i * stride + shift
        for u in units:
            xxhash.xxh3_64_intdigest(landed[at + u.start : at + u.stop])


def _checked_and_not(report: Report, tier, name: str, rounds: int, ours, raw, raw_hashed, what: str,
                     hashed_what: str) -> None:
    """``name`` (the tier's verified reads against the raw calls), ``.vs_raw_hashed`` (against the
    raw calls followed by hashing) and ``.unverified`` (``remote.verify`` off, against the raw calls)."""
    got, base, hashed = interleaved(rounds, ours, raw, raw_hashed)
    report.add(name, got, "GB/s", base, what)
    report.add(f"{name}.vs_raw_hashed", got, "GB/s", hashed, hashed_what)
    tier.verifies = False
    try:
        got, base = interleaved(rounds, ours, raw)
    finally:
        tier.verifies = True
    report.add(f"{name}.unverified", got, "GB/s", base, what)
