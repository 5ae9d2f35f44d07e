"""Which calls make the host wait for a busy copy stream (run by scripts/gpu_checks.sh on a GPU).

A layerwise load's hooks must never block the host: its copies queue on a stream of their own
behind whatever that stream still has to run. On an H200 the copy-stream ordering test found the
host waiting for such a stream somewhere in ``start_loads`` / ``before_layer`` (memory hits).
Here each call those hooks make is timed alone with ~0.25 s of work queued ahead of it on the
current stream, a fresh stream each time (torch's caching allocator keeps memory per stream),
then the load hooks themselves, call by call. A line says how long the call took and whether the
stream had drained by then (``WAITED``: the host waited for it)."""

from __future__ import annotations

import time

import torch

from lmkv.kernels import _device_int64, _stream, block_copy, block_shape, to_device
from lmkv.kernels.streams import Streams

SLEEP_CYCLES = 500_000_000  # ~0.25 s on an H100/H200


def timed_call(name: str, fn, busy: torch.cuda.Stream) -> None:
    """Run ``fn``; say how long it took and whether ``busy`` had drained by then."""
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    print(f"{'WAITED' if busy.query() else 'ok':6s} {took * 1e3:8.2f} ms  {name}", flush=True)


def probe(name: str, fn, stream: torch.cuda.Stream | None = None) -> None:
    s = stream or torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        timed_call(name, fn, s)
    torch.cuda.synchronize()


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.synchronize()
    print("-- single calls, each on a fresh stream with ~0.25 s queued ahead")
    probe("torch.empty(256) (a new stream's first small block)", lambda: torch.empty(256, device=dev))
    warm = Streams.new([dev]).by_device[dev]  # (a copy stream as the worker makes it: memory set aside)
    probe("torch.empty(256) on a new copy stream (Streams.new)", lambda: torch.empty(256, device=dev), warm)
    probe("torch.empty(64 MiB) (a large block)", lambda: torch.empty(64 << 20, dtype=torch.uint8, device=dev))
    probe("pinned host tensor of a size not used before", lambda: torch.empty(12345, pin_memory=True))
    probe("to_device(256 ints)", lambda: to_device(list(range(256)), dev))
    probe("_device_int64", lambda: _device_int64(1, dev))
    probe("torch.cuda.Event(enable_timing=True).record()", lambda: torch.cuda.Event(enable_timing=True).record())
    layer = torch.zeros(16, 2, 64, dtype=torch.bfloat16, device=dev)
    page = torch.zeros(layer[0].numel() * 2 * 4, dtype=torch.uint8, pin_memory=True)
    shape = block_shape(layer)
    assert shape is not None
    nbytes = layer[0].numel() * 2

    def launch() -> None:
        ptrs = _device_int64(layer.data_ptr(), dev)
        blocks = to_device([0, 1, 2, 3], dev)
        pages = to_device([page.data_ptr() + i * nbytes for i in range(4)], dev)
        block_copy(ptrs, blocks, pages, block_stride=layer.stride(0) * 2, shape=shape, layer_stride=0,
                   page_offset=0, to_pages=False, stream=_stream(dev))

    launch()  # (the kernel compiled and loaded first)
    torch.cuda.synchronize()
    probe("block_copy launch, indices included", launch)
    print("-- a layerwise load of memory hits, hook by hook (the copy stream held ~0.25 s first)")
    load_hooks(dev)


def load_hooks(dev: torch.device) -> None:
    """The load half of tests/test_cuda_kernels.py's ordering test, each hook timed."""
    from lmkv.config import load_config
    from lmkv.engine.plan import PageOp, StepPlan
    from lmkv.engine.worker import LayerwiseTransfer
    from lmkv.layout import attention_layout
    from lmkv.store import TieredStore

    layers_n, blocks_n, heads, tokens, head = 3, 10, 2, 16, 4  # (the ordering test's shapes: K and V side by side)
    layers = [torch.randn(blocks_n, heads, tokens, 2 * head, device=dev).to(torch.bfloat16) for _ in range(layers_n)]
    layout = attention_layout("attn", layers_n, tokens, heads, head, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(layers_n)}
    chains = [bytes([i + 1]) * 16 for i in range(4)]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB", "pin": "always"}}, environ={}))
    with store:
        w = LayerwiseTransfer(store, [layout], [layers], names)
        w.begin(StepPlan(stores=[PageOp("", 0, chains, [4, 2, 6, 1], [])]))
        for name in names:
            w.after_layer(name)
        w.end()
        out = [torch.zeros_like(t) for t in layers]
        r = LayerwiseTransfer(store, [layout], [out], names)
        torch.cuda.synchronize()
        r.begin(StepPlan(loads=[PageOp("x", 0, chains, [0, 3, 8, 9], list(range(4)))]))
        step = r._streams.step.by_device[dev]
        with torch.cuda.stream(step):
            torch.cuda._sleep(SLEEP_CYCLES)
        calls = [("start_loads", r.start_loads)]
        calls += [(f"before_layer({n})", lambda n=n: r.before_layer(n)) for n in names]
        for name, fn in calls:
            timed_call(name, fn, step)
        r.end()
        torch.cuda.synchronize()
        print("errors:", r.take_errors() or "none")


if __name__ == "__main__":
    main()
