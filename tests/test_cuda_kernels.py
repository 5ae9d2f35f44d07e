"""The CUDA/HIP copy kernel: compiled here (nvcc is on PATH, no GPU), run against the CPU
reference where a GPU is present."""

import shutil
import subprocess

import numpy as np
import pytest

from lmkv.kernels import BlockShape, block_shape, kernel_source

torch = pytest.importorskip("torch")

from test_blockcopy import B, C, H, L, N, views  # noqa: E402

from lmkv.engine.blockcopy import LayerBlocks, block_runs  # noqa: E402

ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]  # every physical layout vLLM may pick


def _kernel_on_cpu(layer, blocks: list[int], pages: list[np.ndarray], start: int) -> None:
    """What the kernel does for one layer, addressed byte by byte the same way, on a CPU tensor."""
    shape = block_shape(layer)
    item = layer.element_size()
    mem = torch.empty(0, dtype=torch.uint8).set_(layer.untyped_storage()).numpy()  # the bytes under it
    for b, page in zip(blocks, pages):
        base = (layer.storage_offset() + b * layer.stride(0)) * item
        for a in range(shape.rows_a):
            for r in range(shape.rows_b):
                src = base + a * shape.src_a + r * shape.src_b
                dst = start + (a * shape.rows_b + r) * shape.row_bytes
                page[dst : dst + shape.row_bytes] = mem[src : src + shape.row_bytes]


@pytest.mark.parametrize("order", ORDERS)
def test_the_kernels_addressing_writes_what_the_cpu_reference_writes(order):
    """The block shape the kernel is given, for every layout: its rows, read where the shape says,
    land in the page exactly as the reference's copy (a block's elements in logical order)."""
    layers = views(order)
    nbytes = LayerBlocks(layers[0]).nbytes
    blocks = [7, 2, 5]
    ref = [np.zeros(L * nbytes, np.uint8) for _ in blocks]
    got = [np.zeros(L * nbytes, np.uint8) for _ in blocks]
    for layer in range(L):
        LayerBlocks(layers[layer]).gather(block_runs(blocks, ref), layer * nbytes)
        _kernel_on_cpu(layers[layer], blocks, got, layer * nbytes)
    assert all(np.array_equal(r, g) for r, g in zip(ref, got))


def test_block_shapes():
    item = 2
    assert block_shape(views("LBHNC")[0]) == BlockShape.contiguous(H * N * C * item)  # one run of bytes
    assert block_shape(views("LBNHC")[0]) == BlockShape(H, N, C * item, C * item, H * C * item)
    assert block_shape(views("LHBNC")[0]) == BlockShape(1, H, N * C * item, 0, B * N * C * item)
    t = torch.zeros(4, 3, 5, 6)[:, :, :, ::2]  # every other element: not rows of contiguous bytes
    assert block_shape(t) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["block_copy", "xxh3"])
def test_kernels_compile_for_cuda(tmp_path, arch, name):
    src = tmp_path / f"{name}.cu"
    src.write_text(_sources()[name])
    out = subprocess.run(["nvcc", "--cubin", f"-arch={arch}", "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


def test_kernel_needs_no_headers():
    """CuPy builds the kernel with NVRTC at run time, which has no C library headers (an #include of
    <stdint.h> built with nvcc here and failed on an H200); nvcc cannot check that."""
    assert "#include" not in kernel_source()


def _gpu():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")


def _pinned_pages(count: int, nbytes: int):
    """Pages in one pinned buffer (as the memory tier's arena), and the check the kernel is given."""
    buf = torch.zeros(count * nbytes, dtype=torch.uint8).pin_memory()
    base = buf.data_ptr()
    pages = [buf[i * nbytes : (i + 1) * nbytes].numpy() for i in range(count)]
    return buf, pages, lambda addr, n: base <= addr and addr + n <= base + buf.numel()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("pinned", [True, False])
def test_the_kernel_matches_the_cpu_reference_on_a_gpu(order, pinned):
    """On a GPU, for every layout: pages gathered from CUDA blocks hold what the CPU reference gathers
    from the same blocks, and scatter back to the same blocks (pages outside pinned memory go
    through torch)."""
    _gpu()
    from lmkv.kernels import kernel_layer_blocks, synchronize

    layers = views(order, "cuda")
    nbytes = LayerBlocks(layers[0].cpu()).nbytes
    blocks = [7, 2, 3, 5]  # 2 and 3 make a run when their pages are consecutive
    buf, pages, visible = _pinned_pages(len(blocks), L * nbytes)
    if not pinned:
        visible = lambda addr, n: False  # noqa: E731
    ks = [kernel_layer_blocks(t, visible) for t in layers]
    for layer in range(L):
        ks[layer].gather(block_runs(blocks, pages), layer * nbytes)
    synchronize(layers)
    ref = [np.zeros(L * nbytes, np.uint8) for _ in blocks]
    for layer in range(L):
        LayerBlocks(layers[layer].cpu()).gather(block_runs(blocks, ref), layer * nbytes)
    assert all(np.array_equal(p, r) for p, r in zip(pages, ref))
    back = views(order, "cuda")
    for t in back:
        t.zero_()
    kb = [kernel_layer_blocks(t, visible) for t in back]
    for layer in range(L):
        kb[layer].scatter(block_runs(blocks, pages), layer * nbytes)
    synchronize(back)
    assert all(torch.equal(back[layer][b], layers[layer][b]) for layer in range(L) for b in blocks)
    assert all(not back[layer][b].any() for layer in range(L) for b in set(range(B)) - set(blocks))


@pytest.mark.parametrize("copy_stream", [True, False])
def test_the_worker_stores_and_loads_cuda_blocks_through_the_kernel(copy_stream):
    """LayerwiseTransfer on CUDA tensors (vLLM's token-major layout) with a pinned memory tier: stores
    layer by layer as the forward runs, a rescue before it, and a layerwise load into other blocks;
    on the worker's copy streams and on the forward's."""
    _gpu()
    from conftest import layerwise_load

    from lmkv.config import load_config
    from lmkv.engine.plan import PageOp, StepPlan
    from lmkv.engine.worker import LayerwiseTransfer
    from lmkv.kernels import KernelLayerBlocks
    from lmkv.layout import attention_layout
    from lmkv.store import TieredStore

    layers = views("LBNHC", "cuda")
    before = [t.clone() for t in layers]
    layout = attention_layout("attn", L, N, H, C // 2, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(L)}
    chains = [bytes([i + 1]) * 16 for i in range(4)]
    store = TieredStore(load_config({"memory": {"capacity": "16MiB", "pin": "always"}, "copy_stream": copy_stream},
                                    environ={}))
    with store:
        w = LayerwiseTransfer(store, [layout], [layers], names)
        assert isinstance(w.layers[0][0], KernelLayerBlocks) and (w._streams is not None) == copy_stream
        w.begin(StepPlan(stores=[PageOp("", 0, chains[2:], [4, 2], [])],
                         rescues=[PageOp("", 0, chains[:2], [6, 1], [])]))
        for i, name in enumerate(names):
            layers[i].add_(1)  # the forward writes layer i, then its hook runs
            w.after_layer(name)
        w.end()
        assert w.stats.totals.stored_pages == 4 and w.stats.totals.rescued_pages == 2
        out = views("LBNHC", "cuda")
        for t in out:
            t.zero_()
        r = layerwise_load(store, [layout], [out], names, PageOp("x", 0, chains, [0, 3, 8, 9], list(range(4))))
        assert r.take_errors() == set()
        for i in range(L):
            assert torch.equal(out[i][0], before[i][6]) and torch.equal(out[i][3], before[i][1])  # rescued
            assert torch.equal(out[i][8], layers[i][4]) and torch.equal(out[i][9], layers[i][2])  # after the forward
        # a background load: copied on a store I/O thread (its own stream), waited for before it is reported
        for t in out:
            t.zero_()
        r.begin(StepPlan(async_loads=[PageOp("y", 0, chains, [5, 7, 1, 2], list(range(4)))]))
        r.start_loads()
        r.end()
        done: set = set()
        for _ in range(200):
            got, failed = r.transfer_results(idle=True)
            assert not failed
            done |= got
            if done:
                break
        assert done == {"y"}
        for i in range(L):
            assert torch.equal(out[i][5], before[i][6]) and torch.equal(out[i][2], layers[i][2])


def test_copy_streams_wait_for_the_forward_and_the_forward_for_them(monkeypatch):
    """The worker's copy streams against a slow forward on a stream of its own (as vLLM may run it):
    a layer's store copy waits until the forward wrote that layer (a sleep before each write); the
    forward's read of a loaded layer waits for its copy (the copy stream held up by a sleep first);
    the host never waits for the forward on the way."""
    _gpu()
    from lmkv.config import load_config
    from lmkv.engine import worker
    from lmkv.engine.plan import PageOp, StepPlan
    from lmkv.engine.worker import LayerwiseTransfer
    from lmkv.keys import page_key
    from lmkv.layout import attention_layout
    from lmkv.page import make_header
    from lmkv.store import TieredStore

    layers = views("LBNHC", "cuda")
    layout = attention_layout("attn", L, N, H, C // 2, 2, "bfloat16")
    names = {f"l{i}": (0, i) for i in range(L)}
    chains = [bytes([i + 1]) * 16 for i in range(4)]
    compute = torch.cuda.Stream()
    store = TieredStore(load_config({"memory": {"capacity": "16MiB", "pin": "always"}}, environ={}))
    with store, torch.cuda.stream(compute):
        w = LayerwiseTransfer(store, [layout], [layers], names)
        w.begin(StepPlan(stores=[PageOp("", 0, chains, [4, 2, 6, 1], [])]))
        for i, name in enumerate(names):
            torch.cuda._sleep(20_000_000)  # a slow layer: its KV is written well after the hook is queued
            layers[i].add_(1)
            w.after_layer(name)
        assert not compute.query()  # the hooks did not wait for the forward
        hashed_here = []
        monkeypatch.setattr(worker, "make_header", lambda *a: hashed_here.append(a) or make_header(*a))
        w.end()  # (waits for the copies, which waited for the forward)
        written = [t.clone() for t in layers]
        # the pages' checksums were computed on the device as they were gathered, and are xxhash's
        assert not hashed_here
        keys = [page_key(c, layout) for c in chains]
        with store.memory.borrow(keys) as lease:
            assert all(h == make_header(k, layout, v) for k, h, v in zip(keys, lease.headers, lease.views))
        out = views("LBNHC", "cuda")
        for t in out:
            t.zero_()
        r = LayerwiseTransfer(store, [layout], [out], names)
        # (indexed by a device tensor: a Python list is copied from pageable memory, which makes the
        # host wait for the compute stream, and so for the copies it waits on)
        rows = torch.tensor([0, 3, 8, 9], device="cuda")
        sums = torch.zeros(L, device="cuda", dtype=torch.float64)
        for i in range(L):  # (the reads' memory, cached by torch's allocator now: a new cudaMalloc may wait)
            sums[i] = out[i].index_select(0, rows).double().sum()
        torch.cuda.synchronize()
        r.begin(StepPlan(loads=[PageOp("x", 0, chains, [0, 3, 8, 9], list(range(4)))]))
        with torch.cuda.stream(r._streams.step.by_device[out[0].device]):
            torch.cuda._sleep(500_000_000)  # the copies queue behind this (~0.25 s)
        r.start_loads()
        for i, name in enumerate(names):
            r.before_layer(name)
            sums[i] = out[i].index_select(0, rows).double().sum()  # the forward reads layer i
        assert not r._streams.step.by_device[out[0].device].query()  # nor for the copies
        r.end()
        torch.cuda.synchronize()
        assert r.take_errors() == set()
        want = [written[i][[4, 2, 6, 1]].double().sum() for i in range(L)]
        assert torch.equal(sums, torch.stack(want))
        assert all(torch.equal(out[i][[0, 3, 8, 9]], written[i][[4, 2, 6, 1]]) for i in range(L))


# -- the HIP build (no AMD GPU here: compiled, not run) ---------------------------------------------

def _sources() -> dict[str, str]:
    from lmkv.kernels.digests import digest_source

    return {"block_copy": kernel_source(), "xxh3": digest_source()}


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc not installed (apt-get install hipcc libamdhip64-dev)")
@pytest.mark.parametrize("name", ["block_copy", "xxh3"])
def test_kernels_compile_for_hip_gfx90a(tmp_path, name):
    """MI200 (gfx90a) with Debian's hipcc (ROCm 5.2): a code object linked against ROCm's device
    libraries. hiprtc includes HIP's runtime header by itself at run time; offline it is named."""
    import os

    src = tmp_path / f"{name}.hip"
    src.write_text(_sources()[name])
    out = subprocess.run(["hipcc", "--genco", "--offload-arch=gfx90a", "-include", "hip/hip_runtime.h",
                          "-o", str(tmp_path / "k.hsaco"), str(src)], capture_output=True, text=True,
                         env={**os.environ, "HIP_PLATFORM": "amd"})  # (nvcc on PATH: hipcc would target it)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.hsaco").stat().st_size > 0


@pytest.mark.skipif(shutil.which("clang-19") is None or shutil.which("hipcc") is None,
                    reason="clang-19 and ROCm's HIP headers not installed")
@pytest.mark.parametrize("name", ["block_copy", "xxh3"])
def test_kernels_compile_for_hip_gfx942(tmp_path, name):
    """MI300 (gfx942): ROCm 5.2's compiler predates it and ships no gfx942 device library, so LLVM 19
    compiles the source with ROCm 5.2's HIP headers to gfx942 assembly (the device library calls
    for thread indices stay unresolved until hiprtc links them at run time on ROCm 6+)."""
    src = tmp_path / f"{name}.hip"
    src.write_text(_sources()[name])
    asm = tmp_path / "k.s"
    out = subprocess.run(["clang-19", "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "-S", "-O3",
                          "-nogpulib", "--rocm-path=/usr", "-include", "hip/hip_runtime.h", "-o", str(asm), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = asm.read_text()
    kernel = {"block_copy": "lmkv_block_copy", "xxh3": "lmkv_xxh3_64"}[name]
    assert "amdgcn-amd-amdhsa--gfx942" in text and f"{kernel}:" in text
